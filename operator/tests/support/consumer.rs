//! A consumer's eye on a peer, in the spirit of etcd's robustness tests: the origin's history is
//! recorded from its own watch, and the peer is read the way a consumer reads it (the region's
//! subtree and the canary in one Txn, so at one revision). Of every read taken while the canary
//! says synced, [`Consistency::Snapshot`] requires that it equal a state the origin had, at a
//! revision no lower than the previous read's (what a peer next door gives, one Txn in flight at
//! a time); [`Consistency::PerKey`] that each key hold a value it had, never an older one than the
//! previous read showed (what a far peer gives: Txns in flight together land in any order, each
//! key's writes in the origin's). States are compared by an order-free hash of their pairs.
//! Besides the reads, which can miss a brief state, a watch on the peer records every write it
//! took: in either mode each key's writes must follow its history, never going back.
use aether_operator::keys;
use etcd_client::{Client, EventType, GetOptions, Txn, TxnOp, TxnOpResponse, WatchOptions};
use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn entry_hash(key: &[u8], value: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    (key, value).hash(&mut h);
    h.finish()
}

/// What a consumer may see of the origin's history.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Consistency {
    Snapshot,
    PerKey,
}

/// The origin's states, one per revision that changed the subtree, and each key's values in order
/// (None: absent).
#[derive(Default)]
struct History {
    values: HashMap<Vec<u8>, Vec<u8>>,
    per_key: HashMap<Vec<u8>, Vec<Option<Vec<u8>>>>,
    hash: u64,
    /// (revision, hash of the state after it).
    states: Vec<(i64, u64)>,
    /// The origin revision the history has reached.
    through: i64,
}

impl History {
    fn put(&mut self, key: &[u8], value: &[u8]) {
        if let Some(old) = self.values.insert(key.to_vec(), value.to_vec()) {
            self.hash ^= entry_hash(key, &old);
        }
        self.hash ^= entry_hash(key, value);
        self.per_key.entry(key.to_vec()).or_insert_with(|| vec![None]).push(Some(value.to_vec()));
    }

    fn delete(&mut self, key: &[u8]) {
        if let Some(old) = self.values.remove(key) {
            self.hash ^= entry_hash(key, &old);
            self.per_key.entry(key.to_vec()).or_default().push(None);
        }
    }

    fn close_revision(&mut self, revision: i64) {
        if self.states.last().is_none_or(|(r, _)| *r != revision) {
            self.states.push((revision, self.hash));
        } else if let Some(last) = self.states.last_mut() {
            last.1 = self.hash;
        }
        self.through = self.through.max(revision);
    }
}

/// One consumer read of the peer.
#[derive(Clone, Debug)]
struct Read {
    peer_revision: i64,
    hash: u64,
    values: HashMap<Vec<u8>, Vec<u8>>,
    synced: bool,
}

/// What the checker saw.
#[derive(Debug)]
pub struct Verdict {
    pub reads: usize,
    /// Reads taken while the canary said a sync or resync ran (or before the first).
    pub unsynced: usize,
    /// Origin revisions some read matched.
    pub distinct_states: usize,
    /// Writes to the subtree the peer's watch delivered.
    pub peer_writes: usize,
}

/// One write to the peer as its watch delivered it: the key, and its value (None: deleted).
type PeerWrite = (Vec<u8>, Option<Vec<u8>>);

pub struct Consumer {
    history: Arc<Mutex<History>>,
    reads: Arc<Mutex<Vec<Read>>>,
    peer_writes: Arc<Mutex<Vec<PeerWrite>>>,
    stop: Arc<AtomicBool>,
    origin: Client,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Consumer {
    /// Starts recording the origin's history of `region` and reading the peer.
    pub async fn watch(origin: &Client, peer: &Client, region: &str) -> Consumer {
        let prefix = keys::region_prefix(region);
        let mut o = origin.clone();
        let head = o.get(prefix.as_str(), Some(GetOptions::new().with_prefix())).await.expect("origin snapshot");
        let start = head.header().expect("header").revision();
        let mut history = History::default();
        for kv in head.kvs() {
            history.put(kv.key(), kv.value());
        }
        history.close_revision(start);
        let history = Arc::new(Mutex::new(history));
        let stop = Arc::new(AtomicBool::new(false));
        let reads = Arc::new(Mutex::new(Vec::new()));

        let mut watch_client = origin.watch_client();
        let options = WatchOptions::new().with_prefix().with_start_revision(start + 1);
        let mut stream = watch_client.watch(prefix.as_str(), Some(options)).await.expect("origin watch");
        let recording = history.clone();
        let record = tokio::spawn(async move {
            while let Ok(Some(resp)) = stream.message().await {
                let mut h = recording.lock().unwrap();
                let mut open = None;
                for event in resp.events() {
                    let Some(kv) = event.kv() else { continue };
                    if open.is_some_and(|r| r != kv.mod_revision()) {
                        h.close_revision(open.unwrap());
                    }
                    open = Some(kv.mod_revision());
                    match event.event_type() {
                        EventType::Put => h.put(kv.key(), kv.value()),
                        EventType::Delete => h.delete(kv.key()),
                    }
                }
                if let Some(r) = open {
                    h.close_revision(r);
                }
                if let Some(header) = resp.header() {
                    h.through = h.through.max(header.revision());
                }
            }
        });

        let peer_writes = Arc::new(Mutex::new(Vec::new()));
        let follow = follow_writes(peer.clone(), prefix.clone(), peer_writes.clone()).await;
        let (peer, reading, stopped) = (peer.clone(), reads.clone(), stop.clone());
        let canary = keys::canary_key(region);
        let read = tokio::spawn(async move {
            let mut kv = peer.kv_client();
            while !stopped.load(Ordering::SeqCst) {
                let txn = Txn::new().and_then([
                    TxnOp::get(prefix.as_str(), Some(GetOptions::new().with_prefix())),
                    TxnOp::get(canary.as_str(), None),
                ]);
                // A member down or a connection reset: a consumer retries, and so does this.
                let Ok(Ok(resp)) = tokio::time::timeout(Duration::from_secs(2), kv.txn(txn)).await else {
                    tokio::time::sleep(Duration::from_millis(50)).await; // the consumer's retry pace
                    continue;
                };
                let (mut hash, mut values, mut synced) = (0u64, HashMap::new(), false);
                for op in resp.op_responses() {
                    if let TxnOpResponse::Get(get) = op {
                        for kv in get.kvs() {
                            if kv.key() == canary.as_bytes() {
                                let value: serde_json::Value = serde_json::from_slice(kv.value()).unwrap_or_default();
                                synced = value["synced"] == serde_json::Value::Bool(true);
                            } else {
                                hash ^= entry_hash(kv.key(), kv.value());
                                values.insert(kv.key().to_vec(), kv.value().to_vec());
                            }
                        }
                    }
                }
                let peer_revision = resp.header().map_or(0, |h| h.revision());
                reading.lock().unwrap().push(Read { peer_revision, hash, values, synced });
                tokio::time::sleep(Duration::from_millis(30)).await; // the consumer's read pace
            }
        });
        Consumer { history, reads, peer_writes, stop, origin: origin.clone(), tasks: vec![record, read, follow] }
    }

    /// Stops reading, waits until the history holds the origin's head, and checks every read.
    pub async fn verdict(mut self, consistency: Consistency) -> Result<Verdict, String> {
        self.stop.store(true, Ordering::SeqCst);
        let head = self.origin.status().await.expect("origin status").header().expect("header").revision();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while self.history.lock().unwrap().through < head {
            if std::time::Instant::now() > deadline {
                return Err(format!("the origin's watch did not reach revision {head}"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await; // polling the recorder's progress
        }
        for task in self.tasks.drain(..) {
            task.abort();
        }
        let history = self.history.lock().unwrap();
        let reads = self.reads.lock().unwrap().clone();
        let peer_writes = self.peer_writes.lock().unwrap().clone();
        every_write_forward(&history, &peer_writes)?;
        let synced: Vec<(usize, &Read)> = reads.iter().enumerate().filter(|(_, r)| r.synced).collect();
        let distinct_states = match consistency {
            Consistency::Snapshot => snapshots_in_order(&history, &synced)?,
            Consistency::PerKey => {
                each_key_in_order(&history, &synced)?;
                synced.iter().map(|(_, r)| r.hash).collect::<std::collections::BTreeSet<_>>().len()
            }
        };
        Ok(Verdict {
            reads: reads.len(),
            unsynced: reads.len() - synced.len(),
            distinct_states,
            peer_writes: peer_writes.len(),
        })
    }
}

/// Every read is an origin state at a revision no lower than the previous read's; the count of
/// distinct origin revisions matched.
fn snapshots_in_order(history: &History, reads: &[(usize, &Read)]) -> Result<usize, String> {
    let (mut at, mut matched) = (0usize, std::collections::BTreeSet::new());
    for (n, read) in reads {
        let Some(i) = history.states[at..].iter().position(|(_, h)| *h == read.hash) else {
            let earlier = history.states[..at].iter().rev().find(|(_, h)| *h == read.hash);
            let (peer_revision, keys, last) = (read.peer_revision, read.values.len(), history.states[at].0);
            return Err(match earlier {
                Some((r, _)) => format!(
                    "read {n} (peer revision {peer_revision}, {keys} keys) went back to origin revision {r}, after one at origin revision {last}"
                ),
                None => format!(
                    "read {n} (peer revision {peer_revision}, {keys} keys) is no state the origin ever had (the last read matched origin revision {last})"
                ),
            });
        };
        at += i;
        matched.insert(history.states[at].0);
    }
    Ok(matched.len())
}

/// Every key of every read holds a value the origin gave it, no older than the one the previous
/// read showed; no key the origin never had.
fn each_key_in_order(history: &History, reads: &[(usize, &Read)]) -> Result<(), String> {
    let mut at: HashMap<&[u8], usize> = HashMap::new();
    for (n, read) in reads {
        if let Some(key) = read.values.keys().find(|k| !history.per_key.contains_key(*k)) {
            return Err(format!("read {n} holds {}, a key the origin never had", String::from_utf8_lossy(key)));
        }
        for (key, values) in &history.per_key {
            let seen = read.values.get(key).cloned();
            let from = at.get(key.as_slice()).copied().unwrap_or(0);
            let Some(i) = values[from..].iter().position(|v| *v == seen) else {
                return Err(format!(
                    "read {n} (peer revision {}) shows {} at {:?}, older than an earlier read showed or never the origin's",
                    read.peer_revision,
                    String::from_utf8_lossy(key),
                    seen.as_deref().map(String::from_utf8_lossy)
                ));
            };
            at.insert(key.as_slice(), from + i);
        }
    }
    Ok(())
}

/// Records every write to `prefix` the peer's watch delivers, from its revision now, watching
/// again from the next revision whenever the stream breaks (a member killed, a connection reset).
async fn follow_writes(
    mut peer: Client,
    prefix: String,
    writes: Arc<Mutex<Vec<PeerWrite>>>,
) -> tokio::task::JoinHandle<()> {
    let now = peer
        .get(prefix.as_str(), Some(GetOptions::new().with_prefix().with_count_only()))
        .await
        .expect("peer revision");
    let mut next = now.header().expect("header").revision() + 1;
    tokio::spawn(async move {
        loop {
            let options = WatchOptions::new().with_prefix().with_start_revision(next);
            if let Ok(mut stream) = peer.watch(prefix.as_str(), Some(options)).await {
                while let Ok(Some(resp)) = stream.message().await {
                    let mut recorded = writes.lock().unwrap();
                    for event in resp.events() {
                        let Some(kv) = event.kv() else { continue };
                        next = kv.mod_revision() + 1;
                        let value = (event.event_type() == EventType::Put).then(|| kv.value().to_vec());
                        recorded.push((kv.key().to_vec(), value));
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await; // the consumer's retry pace
        }
    })
}

/// Every write the peer took sets a key to a value the origin gave it, no older than the one
/// the key last had on the peer.
fn every_write_forward(history: &History, writes: &[PeerWrite]) -> Result<(), String> {
    let mut at: HashMap<&[u8], usize> = HashMap::new();
    for (n, (key, value)) in writes.iter().enumerate() {
        let Some(values) = history.per_key.get(key) else {
            return Err(format!("peer write {n} sets {}, a key the origin never had", String::from_utf8_lossy(key)));
        };
        let from = at.get(key.as_slice()).copied().unwrap_or(0);
        let Some(i) = values[from..].iter().position(|v| v == value) else {
            return Err(format!(
                "peer write {n} sets {} to {:?}, older than the peer already held or never the origin's",
                String::from_utf8_lossy(key),
                value.as_deref().map(String::from_utf8_lossy)
            ));
        };
        at.insert(key.as_slice(), from + i);
    }
    Ok(())
}
