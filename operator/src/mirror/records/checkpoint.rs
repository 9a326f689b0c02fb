//! The records a worker keeps on the peer, outside `regions/`:
//! - the checkpoint: the lease of every shard with its key count, whether the peer holds a
//!   complete snapshot, and the origin cluster it came from; written when the layout changes and
//!   when a sync starts and ends;
//! - the progress: the origin revision the peer holds completely and the origin's keys it then
//!   holds, written in the same Txn as every watch batch (a few dozen bytes, whatever the number
//!   of leases);
//! - the owner: who writes this origin's mirror; its mod revision is the fencing epoch.
//!
//! A new leader adopts the leases and resumes from them instead of re-putting every key.
//!
//! Every record carries the format it was written in ([`RECORD_FORMAT`]; records without one are
//! of format 1, the first released). A record of a newer format than this version knows reads as
//! no record: the worker then resyncs under new leases rather than misread it.
//!
//! A layout of more than [`SHARDS_PER_PART`] shards is kept in parts beside the checkpoint record
//! ([`plan_write`]): at the least-privilege cap of 64 keys a lease, 1M keys make 32,768 shards and
//! 1.6 MB of layout, past etcd's default 1.5 MiB request, and every split would rewrite all of it.
use crate::keys;
use crate::mirror::leases::shards::Slot;
use serde::{Deserialize, Serialize};
use std::hash::{Hash, Hasher};

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Checkpoint {
    /// The worker instance that wrote it.
    pub owner: String,
    /// The origin revision the peer holds completely (0 before the first complete sync).
    pub revision: i64,
    /// The lease id of each shard.
    pub leases: Vec<i64>,
    /// Each shard's share of the key space once shards were split (aligned with `leases`);
    /// empty for a uniform layout, where a key's shard is its hash modulo `leases.len()`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slots: Vec<crate::mirror::leases::shards::Slot>,
    /// Keys on each shard's lease.
    pub keys: Vec<i64>,
    /// Whether the peer held a complete snapshot at `revision`.
    pub synced: bool,
    /// Leases of a previous layout that may still hold keys while a resync moves them; a
    /// successor keeps them alive until its own sync is complete.
    #[serde(default)]
    pub retiring: Vec<i64>,
    /// The origin etcd's cluster id when the snapshot was taken: a restored or replaced origin
    /// has another, and its revisions mean something else (0: unknown).
    #[serde(default)]
    pub origin_cluster_id: u64,
    /// On a stored record whose layout is kept in parts: where (the vectors above are then empty
    /// in the record). None in a layout small enough to be recorded whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parts: Option<PartsRef>,
    /// Origin keys left out of the mirror because the peer cannot take them (at most
    /// [`LEFT_OUT_RECORDED`]): a worker that resumes without a sync reports them too, since the
    /// peer still lacks them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub left_out: Vec<LeftOut>,
}

/// An origin key left out of the mirror, and its size.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeftOut {
    pub key: String,
    pub bytes: usize,
}

/// Left-out keys a checkpoint records, at most: status shows ten, and the record stays small.
pub const LEFT_OUT_RECORDED: usize = 100;

/// Which parts hold a stored checkpoint's layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartsRef {
    pub id: u64,
    pub count: usize,
}

/// The format of the records this version writes.
pub const RECORD_FORMAT: u32 = 2;

/// A record as written: its format first, then its fields.
#[derive(Serialize)]
struct Versioned<'a, T: Serialize> {
    format: u32,
    #[serde(flatten)]
    record: &'a T,
}

/// The format a record says it is in (1 when it says none).
#[derive(Deserialize)]
struct FormatOf {
    #[serde(default = "first_format")]
    format: u32,
}

fn first_format() -> u32 {
    1
}

/// Decodes a record of a format this version knows; anything else reads as none.
fn decode_known<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Option<T> {
    let FormatOf { format } = serde_json::from_slice(bytes).ok()?;
    if format > RECORD_FORMAT {
        return None;
    }
    serde_json::from_slice(bytes).ok()
}

fn encode_current<T: Serialize>(record: &T) -> Vec<u8> {
    serde_json::to_vec(&Versioned { format: RECORD_FORMAT, record }).expect("a record always serializes")
}

impl Checkpoint {
    pub fn encode(&self) -> Vec<u8> {
        encode_current(self)
    }

    /// Decodes a checkpoint; a value that is not one (damaged, of a newer format, or a layout that
    /// does not line up) reads as none, so that it leads to a full resync rather than a stuck or
    /// misplacing worker.
    pub fn decode(bytes: &[u8]) -> Option<Checkpoint> {
        decode_known::<Checkpoint>(bytes).filter(|c| c.parts.is_some() || c.is_consistent())
    }

    /// Whether the layout lines up: a count per lease, and either a power-of-two number of
    /// uniform shards or slots that split the key space among the leases exactly.
    pub fn is_consistent(&self) -> bool {
        let counts = self.keys.is_empty() || self.keys.len() == self.leases.len();
        let layout = if self.slots.is_empty() {
            self.leases.is_empty() || self.leases.len().is_power_of_two()
        } else {
            self.slots.len() == self.leases.len() && crate::mirror::leases::shards::Layout::partitions(&self.slots)
        };
        counts && layout
    }

    pub fn total_keys(&self) -> i64 {
        self.keys.iter().sum()
    }

    /// Completes a record read from the peer with its parts (`parts[i]` the value of part `i`,
    /// as [`parts_range`] lists them). None when a part is missing or does not line up: a damaged
    /// checkpoint leads to a full resync, as an undecodable record does.
    pub fn assemble(mut self, parts: &[&[u8]]) -> Option<Checkpoint> {
        let Some(stored) = self.parts.take() else { return Some(self) };
        if parts.len() != stored.count {
            return None;
        }
        for bytes in parts {
            let part: Part = serde_json::from_slice(bytes).ok()?;
            for (whole, piece) in
                [(&mut self.leases, part.leases), (&mut self.keys, part.keys), (&mut self.retiring, part.retiring)]
            {
                if !piece.is_empty() && whole.len() != part.first {
                    return None;
                }
                whole.extend(piece);
            }
            if !part.slots.is_empty() && self.slots.len() != part.first {
                return None;
            }
            self.slots.extend(part.slots);
        }
        self.is_consistent().then_some(self)
    }
}

/// The first lease ids of a checkpoint whose header was read, with its first part when it keeps
/// its layout in parts: enough to tell whether its owner still renews, without reading the rest.
pub fn first_leases(header: &Checkpoint, first_part: Option<&[u8]>) -> Vec<i64> {
    match (&header.parts, first_part) {
        (None, _) => header.leases.iter().copied().take(8).collect(),
        (Some(_), Some(bytes)) => {
            serde_json::from_slice::<Part>(bytes).map(|p| p.leases.into_iter().take(8).collect()).unwrap_or_default()
        }
        (Some(_), None) => Vec::new(),
    }
}

/// Shards per part of a layout kept in parts, by default: about 13 KB each, so that a split
/// rewrites one or two parts, not the whole layout. A layout this small or smaller is recorded
/// whole.
pub const SHARDS_PER_PART: usize = 256;

/// One part: shards `first..` of each of the layout's vectors.
#[derive(Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Part {
    first: usize,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    leases: Vec<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    slots: Vec<Slot>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    keys: Vec<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    retiring: Vec<i64>,
}

/// The key of part `index` of the parts `id`.
pub fn part_key(origin: &str, id: u64, index: usize) -> Vec<u8> {
    format!("{}{id:016x}/{index:06}", keys::checkpoint_parts_prefix(origin)).into_bytes()
}

/// The key range holding exactly the parts a record names.
pub fn parts_range(origin: &str, parts: PartsRef) -> (Vec<u8>, Vec<u8>) {
    (part_key(origin, parts.id, 0), part_key(origin, parts.id, parts.count))
}

fn digest(bytes: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

/// How the checkpoint is stored on the peer, as this worker last read or wrote it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Stored {
    /// Not known yet: the next write clears whatever parts there may be.
    #[default]
    Unknown,
    /// One record.
    Whole,
    /// In parts under `id`, with a digest of each part's value.
    Parts { id: u64, digests: Vec<u64> },
}

impl Stored {
    /// What a read found: the record's parts reference and the parts' values.
    pub fn read(parts: Option<PartsRef>, values: &[&[u8]]) -> Stored {
        match parts {
            None => Stored::Whole,
            Some(p) => Stored::Parts { id: p.id, digests: values.iter().map(|v| digest(v)).collect() },
        }
    }
}

/// A write to the worker's records on the peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecordOp {
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    /// Deletes the keys in `from..to`.
    Delete {
        from: Vec<u8>,
        to: Vec<u8>,
    },
}

impl RecordOp {
    fn bytes(&self) -> usize {
        match self {
            RecordOp::Put { key, value } => key.len() + value.len(),
            RecordOp::Delete { from, to } => from.len() + to.len(),
        }
    }
}

/// What one Txn may carry of checkpoint writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordBudget {
    pub ops: usize,
    pub bytes: usize,
}

/// How to write a checkpoint: Txns to apply first (in order, each fenced), then the ops that go
/// into the Txn that commits it (with the other records it is written with). `stored` is how the
/// peer holds it once the commit is applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointWrite {
    pub before: Vec<Vec<RecordOp>>,
    pub commit: Vec<RecordOp>,
    pub stored: Stored,
}

/// Plans writing `cp` over what the peer holds (`stored`). A layout of `per_part` shards or fewer
/// is one record, as before parts existed. A larger one goes in parts of `per_part` shards:
/// - the parts that changed, rewritten in place in the commit itself when they fit `budget`
///   (a split touches one or two);
/// - otherwise every part under a new id (`fresh_id`) in Txns of their own first, and the record
///   naming them in the commit: a reader sees the old layout or the new one, never a mix, and a
///   writer dying halfway leaves only parts no record names, which the next commit deletes.
pub fn plan_write(
    origin: &str,
    cp: &Checkpoint,
    stored: &Stored,
    budget: RecordBudget,
    per_part: usize,
    fresh_id: u64,
) -> CheckpointWrite {
    let per_part = per_part.max(1);
    let record = |parts: Option<PartsRef>| {
        let mut header = cp.clone();
        header.parts = parts;
        if parts.is_some() {
            (header.leases, header.slots, header.keys, header.retiring) = Default::default();
        }
        RecordOp::Put { key: keys::checkpoint_key(origin).into_bytes(), value: header.encode() }
    };
    let prefix = keys::checkpoint_parts_prefix(origin).into_bytes();
    let all_parts = || RecordOp::Delete { to: keys::prefix_range_end(&prefix), from: prefix.clone() };
    if cp.leases.len() <= per_part && cp.retiring.len() <= per_part {
        let mut commit = vec![record(None)];
        if *stored != Stored::Whole {
            commit.push(all_parts());
        }
        return CheckpointWrite { before: Vec::new(), commit, stored: Stored::Whole };
    }

    // Deletes every part but the `count` ones of `id`: a shrunk layout's tail, and whatever a
    // writer that died halfway left.
    let others = |id: u64, count: usize| {
        let (from, to) = parts_range(origin, PartsRef { id, count });
        [
            RecordOp::Delete { from: prefix.clone(), to: from },
            RecordOp::Delete { from: to, to: keys::prefix_range_end(&prefix) },
        ]
    };
    let values = encode_parts(cp, per_part);
    let digests: Vec<u64> = values.iter().map(|v| digest(v)).collect();
    let count = values.len();
    if let Stored::Parts { id, digests: old } = stored {
        let id = *id;
        let mut commit: Vec<RecordOp> = values
            .iter()
            .enumerate()
            .filter(|(i, _)| old.get(*i) != Some(&digests[*i]))
            .map(|(i, v)| RecordOp::Put { key: part_key(origin, id, i), value: v.clone() })
            .collect();
        commit.push(record(Some(PartsRef { id, count })));
        commit.extend(others(id, count));
        if commit.len() <= budget.ops && commit.iter().map(RecordOp::bytes).sum::<usize>() <= budget.bytes {
            return CheckpointWrite { before: Vec::new(), commit, stored: Stored::Parts { id, digests } };
        }
    }

    let id = match stored {
        Stored::Parts { id, .. } if *id == fresh_id => fresh_id.wrapping_add(1),
        _ => fresh_id,
    };
    let mut before: Vec<Vec<RecordOp>> = Vec::new();
    let mut bytes = 0;
    for (i, value) in values.into_iter().enumerate() {
        let op = RecordOp::Put { key: part_key(origin, id, i), value };
        let full = before.last().is_none_or(|txn| txn.len() >= budget.ops || bytes + op.bytes() > budget.bytes);
        if full {
            before.push(Vec::new());
            bytes = 0;
        }
        bytes += op.bytes();
        before.last_mut().expect("just pushed").push(op);
    }
    let mut commit = vec![record(Some(PartsRef { id, count }))];
    commit.extend(others(id, count));
    CheckpointWrite { before, commit, stored: Stored::Parts { id, digests } }
}

/// The layout's vectors cut into parts of `per_part` shards.
fn encode_parts(cp: &Checkpoint, per_part: usize) -> Vec<Vec<u8>> {
    let count = cp.leases.len().max(cp.retiring.len()).div_ceil(per_part);
    let piece = |v: &[i64], first: usize| v.get(first..(first + per_part).min(v.len())).unwrap_or(&[]).to_vec();
    (0..count)
        .map(|i| {
            let first = i * per_part;
            let slots = cp.slots.get(first..(first + per_part).min(cp.slots.len())).unwrap_or(&[]).to_vec();
            let part = Part {
                first,
                leases: piece(&cp.leases, first),
                slots,
                keys: piece(&cp.keys, first),
                retiring: piece(&cp.retiring, first),
            };
            serde_json::to_vec(&part).expect("a part always serializes")
        })
        .collect()
}

/// The progress record: the origin revision the peer holds completely, and who wrote it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Progress {
    pub owner: String,
    pub revision: i64,
    /// The newest origin revision any Txn its writer sent may have carried: past `revision`, the
    /// peer may hold parts of what lies up to it (batches in flight together land in any order).
    /// [`SENT_UNKNOWN`] when nobody knows (a new owner before its first batch lands), and absent
    /// (0) in earlier versions' records.
    #[serde(default, rename = "sent", deserialize_with = "padded_revision")]
    pub sent_through: i64,
    /// The origin's keys the peer holds once it holds `revision` completely, as the writer counts
    /// them (None in earlier versions' records): what the peer's inbound view shows, so that it
    /// need not count the peer's index. Advisory: a value that is not a count (negative, a
    /// fraction, text, out of range) reads as None, so that the view counts instead and the rest
    /// of the record (what fences and resumes the copy) still reads.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "a_count_or_none")]
    pub keys: Option<i64>,
}

fn a_count_or_none<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    Ok(serde_json::Value::deserialize(d)?.as_i64().filter(|keys| *keys >= 0))
}

/// A progress record's `sent_through` when what the peer may hold past it is unknown.
pub const SENT_UNKNOWN: i64 = i64::MAX;

fn padded_revision<'de, D: serde::Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    let text = String::deserialize(d)?;
    text.parse().map_err(serde::de::Error::custom)
}

/// The progress record as written: the revision first again, then what was sent, both
/// zero-padded, so that comparing two records' bytes (which etcd can do in a Txn) compares their
/// revisions and then what they sent. Records without it (written by earlier versions, starting
/// `{"owner"`) compare lower than any with it.
#[derive(Serialize)]
struct OrderedProgress<'a> {
    rev: String,
    sent: String,
    format: u32,
    owner: &'a str,
    revision: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    keys: Option<i64>,
}

impl Progress {
    pub fn encode(&self) -> Vec<u8> {
        let ordered = OrderedProgress {
            rev: format!("{:020}", self.revision),
            sent: format!("{:020}", self.sent_through),
            format: RECORD_FORMAT,
            owner: &self.owner,
            revision: self.revision,
            keys: self.keys,
        };
        serde_json::to_vec(&ordered).expect("progress always serializes")
    }

    pub fn decode(bytes: &[u8]) -> Option<Progress> {
        decode_known(bytes)
    }

    /// The newest origin revision the peer may hold writes of past `applied` (pure): none when
    /// the record says its writer sent nothing past it.
    pub fn peer_may_hold_through(&self, applied: i64) -> Option<i64> {
        let known = self.sent_through >= self.revision && self.sent_through != SENT_UNKNOWN;
        let through = if known { self.sent_through } else { SENT_UNKNOWN };
        (through > applied).then_some(through)
    }
}

/// The owner record: who writes this origin's mirror on this peer. Its mod revision is the
/// fencing epoch every batch compares; every session of every worker takes a new one.
///
/// It also says whose mirror it is (the object, the origin etcd, the peer's name for it), so
/// that a second claim on the region is refused instead of taking the mirror over, and deleting
/// an object retires only what that object owns.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Owner {
    pub owner: String,
    pub acquired_at: String,
    /// Grows by one with every new owner. A record with a lower generation than a worker's own
    /// is an old one brought back by a restore of the peer, not a successor.
    #[serde(default)]
    pub generation: u64,
    /// A tombstone: the RegionPeering was deleted and its mirror retired from this peer. A
    /// worker that owned the mirror before never takes it back; only a new one may.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub retired: bool,
    /// The owner stopped cleanly and renews nothing from now on: a worker of the same object
    /// takes over at once instead of waiting for the leases to run low.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub released: bool,
    /// The object that owns the mirror (None in records of earlier versions, and of workers run
    /// without one, which every claimant is compatible with).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object: Option<OwningObject>,
    /// The origin etcd's cluster id the owner mirrors from (0: unknown).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub origin_cluster_id: u64,
    /// The peer region, as the owner names the etcd it writes ("": unknown).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub peer: String,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The object (a RegionPeering) a worker mirrors for: its UID is its identity; the rest names
/// it for a person.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OwningObject {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// The Kubernetes cluster it lives in, as its operator names it ("": not known).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cluster: String,
}

impl OwningObject {
    /// "ns/name (uid …) in Kubernetes cluster …", for messages.
    pub fn describe(&self) -> String {
        let cluster =
            if self.cluster.is_empty() { String::new() } else { format!(" in Kubernetes cluster {}", self.cluster) };
        format!("RegionPeering {}/{} (uid {}){cluster}", self.namespace, self.name, self.uid)
    }
}

impl Owner {
    pub fn encode(&self) -> Vec<u8> {
        encode_current(self)
    }

    /// Decodes an owner record. Its strings were written on a peer, where another region's user
    /// may write, and reach events and conditions: each is cut to [`MAX_RECORD_STRING`] chars.
    pub fn decode(bytes: &[u8]) -> Option<Owner> {
        let mut owner: Owner = decode_known(bytes)?;
        for field in [&mut owner.owner, &mut owner.acquired_at, &mut owner.peer] {
            cap(field);
        }
        if let Some(object) = owner.object.as_mut() {
            for field in [&mut object.namespace, &mut object.name, &mut object.uid, &mut object.cluster] {
                cap(field);
            }
        }
        Some(owner)
    }
}

/// The most chars a string read from a peer's record keeps.
pub const MAX_RECORD_STRING: usize = 253;

fn cap(s: &mut String) {
    if let Some((cut, _)) = s.char_indices().nth(MAX_RECORD_STRING) {
        s.truncate(cut);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_record_from_a_peer_reaches_people_with_bounded_strings() {
        let long = "é".repeat(10_000);
        let written = Owner {
            owner: long.clone(),
            peer: long.clone(),
            object: Some(OwningObject { namespace: long.clone(), name: "a".into(), uid: long.clone(), cluster: long }),
            ..Default::default()
        };
        let read = Owner::decode(&written.encode()).unwrap();
        assert_eq!(read.owner.chars().count(), MAX_RECORD_STRING);
        assert_eq!(read.peer.chars().count(), MAX_RECORD_STRING);
        let object = read.object.unwrap();
        assert!(object.describe().chars().count() < 4 * MAX_RECORD_STRING + 100);
    }

    #[test]
    fn roundtrips_and_tolerates_garbage() {
        let c = Checkpoint {
            owner: "a/1".into(),
            revision: 42,
            leases: vec![7, 8],
            slots: vec![],
            keys: vec![3, 4],
            synced: true,
            retiring: vec![],
            origin_cluster_id: 9,
            parts: None,
            left_out: vec![],
        };
        assert_eq!(Checkpoint::decode(&c.encode()), Some(c.clone()));
        assert!(!String::from_utf8(c.encode()).unwrap().contains("slots"), "a uniform layout records no slots");
        let split = Checkpoint {
            slots: vec![
                crate::mirror::leases::shards::Slot { depth: 1, index: 0 },
                crate::mirror::leases::shards::Slot { depth: 1, index: 1 },
            ],
            ..c.clone()
        };
        assert_eq!(Checkpoint::decode(&split.encode()), Some(split.clone()));
        assert_eq!(c.total_keys(), 7);
        assert_eq!(Checkpoint::decode(b"not json"), None);
        let p = Progress { owner: "a/1".into(), revision: 1 << 40, sent_through: (1 << 40) + 5, keys: Some(1 << 20) };
        assert_eq!(Progress::decode(&p.encode()), Some(p.clone()));
        assert!(p.encode().len() < 128, "progress stays small");
        // Earlier versions read the record as they did: what they do not know is ignored.
        #[derive(serde::Deserialize)]
        struct EarlierProgress {
            owner: String,
            revision: i64,
        }
        let earlier: EarlierProgress = serde_json::from_slice(&p.encode()).unwrap();
        assert_eq!((earlier.owner.as_str(), earlier.revision), ("a/1", 1 << 40));
        assert_eq!(
            Progress::decode(br#"{"owner":"x","revision":3}"#).map(|p| p.revision),
            Some(3),
            "earlier versions' records"
        );
    }

    #[test]
    fn a_progress_record_whose_count_is_not_a_count_keeps_its_revision_and_loses_only_the_count() {
        let written = |keys: serde_json::Value| {
            let mut record: serde_json::Value = serde_json::from_slice(
                &Progress { owner: "b/1".into(), revision: 70, sent_through: 75, keys: Some(3) }.encode(),
            )
            .unwrap();
            record["keys"] = keys;
            Progress::decode(record.to_string().as_bytes())
        };
        assert_eq!(written(serde_json::json!(12)).and_then(|p| p.keys), Some(12));
        for not_a_count in [
            serde_json::json!(-5),
            serde_json::json!(1.5),
            serde_json::json!(1e30),
            serde_json::json!(18446744073709551615u64),
            serde_json::json!("300"),
            serde_json::json!([1, 2]),
            serde_json::json!({"keys": 1}),
            serde_json::Value::Null,
        ] {
            let read = written(not_a_count.clone()).unwrap_or_else(|| panic!("{not_a_count} lost the record"));
            assert_eq!((read.revision, read.sent_through, read.keys), (70, 75, None), "{not_a_count}");
        }
    }

    #[test]
    fn progress_records_compare_as_their_revisions_do() {
        let at = |owner: &str, revision: i64| {
            Progress { owner: owner.into(), revision, sent_through: revision, keys: None }.encode()
        };
        assert!(at("a/1", 99) < at("a/1", 100), "more digits");
        let sent = |revision: i64, sent_through: i64| {
            Progress { owner: "a/1".into(), revision, sent_through, keys: None }.encode()
        };
        assert!(sent(7, 9) < sent(7, 12), "at one revision, what was sent past it");
        assert!(sent(7, SENT_UNKNOWN) < sent(8, 8), "the revision first");
        assert!(at("b/2", 7) < at("a/1", 8), "whoever wrote them");
        assert!(at("a/1", 0) < at("a/1", i64::MAX));
        assert!(
            br#"{"owner":"a/1","revision":900}"#.as_slice() < at("a/1", 1).as_slice(),
            "an earlier version's record"
        );
    }

    #[test]
    fn records_of_earlier_versions_still_decode() {
        let c = Checkpoint::decode(br#"{"owner":"x","revision":3,"leases":[1],"keys":[2],"synced":true}"#);
        assert_eq!(c.map(|c| (c.origin_cluster_id, c.retiring.len())), Some((0, 0)));
        let o = Owner::decode(br#"{"owner":"x","acquiredAt":"t"}"#).expect("decodes");
        assert_eq!(o.generation, 0);
    }

    /// Records exactly as the first released format (1) wrote them: no format field.
    mod released_format {
        pub const CHECKPOINT: &[u8] = br#"{"owner":"eu-west-operator-0/7","revision":4711,"leases":[7587890000000000000,7587890000000000001],"keys":[498,502],"synced":true,"retiring":[],"originClusterId":14841639068965178418}"#;
        pub const SPLIT_CHECKPOINT: &[u8] = br#"{"owner":"w","revision":9,"leases":[11,12,13],"slots":[{"depth":2,"index":0},{"depth":1,"index":1},{"depth":2,"index":2}],"keys":[3,4,5],"synced":true,"retiring":[5],"originClusterId":7}"#;
        pub const PARTS_RECORD: &[u8] = br#"{"owner":"w","revision":9,"leases":[],"keys":[],"synced":true,"retiring":[],"originClusterId":7,"parts":{"id":12,"count":2}}"#;
        pub const PARTS: [&[u8]; 2] =
            [br#"{"first":0,"leases":[21,22],"keys":[1,2]}"#, br#"{"first":2,"leases":[23,24],"keys":[3,4]}"#];
        pub const PROGRESS: &[u8] = br#"{"rev":"00000000000000004711","owner":"eu-west-operator-0/7","revision":4711}"#;
        pub const OWNER: &[u8] =
            br#"{"owner":"eu-west-operator-0/7","acquiredAt":"2026-11-30T10:00:00Z","generation":3}"#;
    }

    #[test]
    fn records_of_the_released_format_read_as_they_were_written() {
        let c = Checkpoint::decode(released_format::CHECKPOINT).expect("the released checkpoint decodes");
        assert_eq!((c.revision, c.leases.len(), c.total_keys(), c.synced), (4711, 2, 1000, true));
        assert_eq!(c.origin_cluster_id, 14_841_639_068_965_178_418);
        let split = Checkpoint::decode(released_format::SPLIT_CHECKPOINT).expect("a split layout decodes");
        assert_eq!((split.slots.len(), split.retiring.clone()), (3, vec![5]));
        let header = Checkpoint::decode(released_format::PARTS_RECORD).expect("a record of parts decodes");
        let whole = header.assemble(&released_format::PARTS).expect("its parts assemble");
        assert_eq!((whole.leases, whole.keys), (vec![21, 22, 23, 24], vec![1, 2, 3, 4]));
        let p = Progress::decode(released_format::PROGRESS).expect("the released progress decodes");
        assert_eq!(p.revision, 4711);
        // This version's progress records still order above the released ones at equal revisions
        // and by revision otherwise: the nested Txn's byte comparison keeps working across a roll.
        assert!(
            released_format::PROGRESS
                < Progress { owner: "x".into(), revision: 4712, sent_through: 0, keys: None }.encode().as_slice()
        );
        assert!(
            released_format::PROGRESS
                < Progress { owner: "x".into(), revision: 4711, sent_through: 0, keys: None }.encode().as_slice()
        );
        assert_eq!(p.peer_may_hold_through(4711), Some(SENT_UNKNOWN), "a released record does not say what was sent");
        let o = Owner::decode(released_format::OWNER).expect("the released owner decodes");
        assert_eq!((o.generation, o.retired), (3, false));
    }

    #[test]
    fn records_of_a_newer_format_read_as_none_and_this_format_is_written() {
        let c = Checkpoint {
            owner: "w".into(),
            revision: 3,
            leases: vec![1],
            keys: vec![2],
            synced: true,
            ..Default::default()
        };
        let written: serde_json::Value = serde_json::from_slice(&c.encode()).unwrap();
        assert_eq!(written["format"], RECORD_FORMAT);
        let mut newer = written.clone();
        newer["format"] = serde_json::json!(RECORD_FORMAT + 1);
        assert_eq!(Checkpoint::decode(newer.to_string().as_bytes()), None);
        let p = Progress { owner: "w".into(), revision: 8, sent_through: 8, keys: None };
        let mut newer_progress: serde_json::Value = serde_json::from_slice(&p.encode()).unwrap();
        newer_progress["format"] = serde_json::json!(RECORD_FORMAT + 1);
        assert_eq!(Progress::decode(newer_progress.to_string().as_bytes()), None);
        let o =
            Owner { owner: "w".into(), acquired_at: "t".into(), generation: 1, retired: true, ..Default::default() };
        assert_eq!(Owner::decode(&o.encode()), Some(o.clone()));
        let mut newer_owner: serde_json::Value = serde_json::from_slice(&o.encode()).unwrap();
        newer_owner["format"] = serde_json::json!(RECORD_FORMAT + 1);
        assert_eq!(Owner::decode(newer_owner.to_string().as_bytes()), None);
    }

    #[test]
    fn a_layout_that_does_not_line_up_reads_as_none() {
        let base = Checkpoint {
            owner: "w".into(),
            revision: 3,
            leases: vec![1, 2],
            keys: vec![2, 2],
            synced: true,
            ..Default::default()
        };
        assert!(Checkpoint::decode(&base.encode()).is_some());
        // Three uniform shards: hash modulo three is not how keys were placed.
        let three = Checkpoint { leases: vec![1, 2, 3], keys: vec![1, 1, 1], ..base.clone() };
        assert_eq!(Checkpoint::decode(&three.encode()), None);
        // Slots that do not cover the key space would place keys on shards that do not exist.
        let holes =
            Checkpoint { slots: vec![Slot { depth: 2, index: 0 }, Slot { depth: 2, index: 1 }], ..base.clone() };
        assert_eq!(Checkpoint::decode(&holes.encode()), None);
        let counts = Checkpoint { keys: vec![1], ..base };
        assert_eq!(Checkpoint::decode(&counts.encode()), None);
    }

    const BUDGET: RecordBudget = RecordBudget { ops: 125, bytes: (1 << 20) - 4096 };

    /// A synced layout of `shards` shards, then the given shards split.
    fn layout(shards: usize, splits: &[usize]) -> Checkpoint {
        let mut layout = crate::mirror::leases::shards::Layout::uniform(shards);
        let mut leases: Vec<i64> = (0..shards as i64).map(|i| 7_587_890_000_000_000_000 + i).collect();
        for shard in splits {
            layout.split(*shard);
            leases.push(7_587_890_000_100_000_000 + *shard as i64);
        }
        let split = !splits.is_empty();
        Checkpoint {
            owner: "a/1".into(),
            revision: 1 << 30,
            keys: vec![41; leases.len()],
            slots: if split { layout.slots().to_vec() } else { Vec::new() },
            leases,
            synced: true,
            retiring: vec![],
            origin_cluster_id: 9,
            parts: None,
            left_out: vec![],
        }
    }

    /// Applies planned writes to a map standing for the peer's keys, as etcd would.
    fn apply(store: &mut std::collections::BTreeMap<Vec<u8>, Vec<u8>>, write: &CheckpointWrite) {
        for op in write.before.iter().flatten().chain(&write.commit) {
            match op {
                RecordOp::Put { key, value } => {
                    store.insert(key.clone(), value.clone());
                }
                RecordOp::Delete { from, to } => store.retain(|k, _| k < from || k >= to),
            }
        }
    }

    /// Reads the checkpoint back from the map as `records::read_checkpoint` does from etcd.
    fn read(store: &std::collections::BTreeMap<Vec<u8>, Vec<u8>>) -> (Option<Checkpoint>, Stored) {
        let header = Checkpoint::decode(&store[keys::checkpoint_key("a").as_bytes()]).expect("record");
        let Some(parts) = header.parts else { return (Some(header), Stored::Whole) };
        let (from, to) = parts_range("a", parts);
        let values: Vec<&[u8]> = store.range(from..to).map(|(_, v)| v.as_slice()).collect();
        let stored = Stored::read(Some(parts), &values);
        (header.assemble(&values), stored)
    }

    fn parts_keys(store: &std::collections::BTreeMap<Vec<u8>, Vec<u8>>) -> usize {
        let prefix = keys::checkpoint_parts_prefix("a");
        store.keys().filter(|k| k.starts_with(prefix.as_bytes())).count()
    }

    #[test]
    fn a_small_layout_is_one_record_as_before() {
        let cp = layout(SHARDS_PER_PART, &[]);
        let write = plan_write("a", &cp, &Stored::Unknown, BUDGET, SHARDS_PER_PART, 1);
        assert!(write.before.is_empty());
        assert_eq!(write.commit[0], RecordOp::Put { key: keys::checkpoint_key("a").into_bytes(), value: cp.encode() });
        assert_eq!(write.stored, Stored::Whole);
        let again = plan_write("a", &cp, &Stored::Whole, BUDGET, SHARDS_PER_PART, 2);
        assert_eq!(again.commit.len(), 1, "nothing else to clear: {again:?}");
    }

    #[test]
    fn a_layout_past_a_request_is_written_in_parts_and_reads_back_whole() {
        // 1M keys at the least-privilege cap of 64: 32,768 shards, every one split once more.
        let mut store = std::collections::BTreeMap::new();
        let mut cp = layout(32_768, &[0]);
        cp.retiring = (0..20_000).collect();
        assert!(cp.encode().len() > 1_572_864, "whole, it would pass etcd's default request limit");
        let write = plan_write("a", &cp, &Stored::Unknown, BUDGET, SHARDS_PER_PART, 5);
        for txn in write.before.iter().chain([&write.commit]) {
            assert!(txn.len() <= BUDGET.ops + 2, "{} ops", txn.len());
            assert!(txn.iter().map(RecordOp::bytes).sum::<usize>() <= BUDGET.bytes, "a Txn past the budget");
        }
        apply(&mut store, &write);
        let (read_back, stored) = read(&store);
        assert_eq!(read_back, Some(cp.clone()));
        assert_eq!(stored, write.stored);
        let record = &store[keys::checkpoint_key("a").as_bytes()];
        assert!(record.len() < 400, "the record itself stays small: {} bytes", record.len());
    }

    #[test]
    fn a_split_rewrites_only_the_parts_it_changes() {
        let mut store = std::collections::BTreeMap::new();
        // (The first split of a uniform layout records every shard's slot: that one rewrites all.)
        let cp = layout(32_768, &[0]);
        let first = plan_write("a", &cp, &Stored::Unknown, BUDGET, SHARDS_PER_PART, 5);
        apply(&mut store, &first);
        let (_, stored) = read(&store);

        let split = layout(32_768, &[0, 20_000]);
        let write = plan_write("a", &split, &stored, BUDGET, SHARDS_PER_PART, 6);
        assert!(write.before.is_empty(), "in place");
        let bytes: usize = write.commit.iter().map(RecordOp::bytes).sum();
        assert!(write.commit.len() <= 5, "{} ops", write.commit.len());
        assert!(bytes < 40_000, "a split writes {bytes} bytes of a 32,768-shard layout");
        apply(&mut store, &write);
        assert_eq!(read(&store).0, Some(split));
    }

    #[test]
    fn a_writer_dying_between_parts_leaves_the_old_layout_readable_and_the_next_write_clears_up() {
        let mut store = std::collections::BTreeMap::new();
        let old = layout(2_048, &[]);
        apply(&mut store, &plan_write("a", &old, &Stored::Unknown, BUDGET, SHARDS_PER_PART, 5));
        let (_, stored) = read(&store);

        // A new layout under a new id: only its first Txn lands.
        let new = Checkpoint { retiring: old.leases.clone(), ..layout(4_096, &[]) };
        let tight = RecordBudget { ops: 4, bytes: 64 << 10 };
        let torn = plan_write("a", &new, &stored, tight, SHARDS_PER_PART, 6);
        assert!(torn.before.len() > 1);
        for op in &torn.before[0] {
            apply(&mut store, &CheckpointWrite { before: vec![], commit: vec![op.clone()], stored: Stored::Unknown });
        }
        assert_eq!(read(&store).0, Some(old.clone()), "the record still names the old parts");

        // The next writer (a successor, reading what is there) leaves exactly its own parts,
        // whether it rewrites a part in place or all of them anew.
        let (_, stored) = read(&store);
        let mut counted = old.clone();
        counted.keys[3] = 40;
        let in_place = plan_write("a", &counted, &stored, tight, SHARDS_PER_PART, 7);
        assert!(in_place.before.is_empty());
        apply(&mut store, &in_place);
        assert_eq!(read(&store).0, Some(counted));
        assert_eq!(parts_keys(&store), old.leases.len().div_ceil(SHARDS_PER_PART), "the torn write's parts are gone");
        let (_, stored) = read(&store);
        let write = plan_write("a", &new, &stored, tight, SHARDS_PER_PART, 7);
        apply(&mut store, &write);
        assert_eq!(read(&store).0, Some(new.clone()));
        assert_eq!(parts_keys(&store), new.leases.len().div_ceil(SHARDS_PER_PART), "no part left behind");

        // Back to a small layout: one record, no parts.
        let (_, stored) = read(&store);
        let small = layout(8, &[]);
        apply(&mut store, &plan_write("a", &small, &stored, tight, SHARDS_PER_PART, 8));
        assert_eq!(read(&store), (Some(small), Stored::Whole));
        assert_eq!(parts_keys(&store), 0);
    }

    #[test]
    fn a_missing_or_misplaced_part_reads_as_no_checkpoint() {
        let mut store = std::collections::BTreeMap::new();
        apply(&mut store, &plan_write("a", &layout(1_024, &[]), &Stored::Unknown, BUDGET, SHARDS_PER_PART, 5));
        let (key, _) =
            store.iter().find(|(k, _)| k.ends_with(b"/000001")).map(|(k, v)| (k.clone(), v.clone())).unwrap();
        let mut missing = store.clone();
        missing.remove(&key);
        assert_eq!(read(&missing).0, None);
        let mut swapped = store.clone();
        let second = swapped[&key].clone();
        let third_key = [&key[..key.len() - 1], b"2"].concat();
        swapped.insert(key, swapped[&third_key].clone());
        swapped.insert(third_key, second);
        assert_eq!(read(&swapped).0, None);
    }
}

#[cfg(test)]
mod sent_tests {
    use super::*;

    #[test]
    fn a_record_says_what_the_peer_may_hold_past_it() {
        let at = |revision: i64, sent_through: i64| Progress { owner: "w".into(), revision, sent_through, keys: None };
        assert_eq!(at(10, 10).peer_may_hold_through(10), None, "one Txn in flight at a time: exact");
        assert_eq!(at(10, 14).peer_may_hold_through(10), Some(14), "Txns in flight together");
        assert_eq!(at(12, 12).peer_may_hold_through(10), Some(12), "raised after it was read");
        assert_eq!(at(10, SENT_UNKNOWN).peer_may_hold_through(10), Some(SENT_UNKNOWN), "a new owner's");
        assert_eq!(at(10, 0).peer_may_hold_through(10), Some(SENT_UNKNOWN), "an earlier version's");
    }
}
