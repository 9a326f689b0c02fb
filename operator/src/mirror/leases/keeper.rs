//! The origin-heartbeat: one task per worker, for the worker's whole life, that keeps every lease
//! of the mirror alive on the peer. When to renew and how to spread the renewals is planned in
//! `renewal.rs`; this is the IO.
//!
//! - Leases join and leave the running keeper (`keep`, `granted`); nothing restarts its streams.
//! - A round renews the leases that are due over several LeaseKeepAlive streams to the peer's
//!   leader when a probe saw it (a follower forwards each renewal to the leader, one at a time).
//! - A round that fails, or gets no new answer for its deadline, is abandoned and retried at
//!   once; leases renewed by the answers it got stay renewed. A round the peer keeps answering
//!   runs on: its renewals are queued at the peer, and sending them again would only queue them
//!   twice.
//! - It feeds the failure detector and the health (round time, TTL left), tells the worker about
//!   a lease that is gone or a peer whose cluster id changed, and answers whether leases are
//!   alive (`liveness`).
//!
//! Dropping it stops the renewals; nothing is ever revoked.
use super::renewal::{Book, Kept, Measured, Timing, deal, refused, retry_delay, runs, shortfall, streams_for};
use super::rpc::KeepAliveStream;
use crate::mirror::health::MirrorEvent;
use crate::mirror::shared::Shared;
use crate::mirror::target::RawChannel;
use crate::mirror::{EtcdTarget, MirrorConfig};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{Notify, mpsc, watch};
use tracing::{Instrument, debug, info, warn};

/// What the keeper tells the worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeeperSignal {
    /// The lease is gone, and its keys with it.
    LeaseLost(i64),
    /// The peer answers with another cluster id: restored from a backup or replaced.
    PeerChanged { from: u64, to: u64 },
}

pub fn is_lease_not_found(e: &etcd_client::Error) -> bool {
    e.to_string().contains("lease not found")
}

/// The keeper's handle. The task ends when it is dropped.
pub struct Keeper {
    book: Arc<Mutex<Book>>,
    /// The leases of the layout being granted: capacity is judged against the whole layout while
    /// its grants are still coming in.
    layout: Arc<std::sync::atomic::AtomicUsize>,
    /// Wakes the task when leases join.
    joined: Arc<Notify>,
    /// Bumped after every round, so that `liveness` can wait for answers.
    rounds: watch::Receiver<u64>,
    /// The configured TTL: what the leases this worker grants live by.
    ttl: Duration,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Keeper {
    /// Starts a keeper with nothing to keep (it measures the peer's round trip meanwhile).
    pub(in crate::mirror) fn spawn(
        peer: EtcdTarget,
        config: &MirrorConfig,
        shared: Arc<Shared>,
        signals: mpsc::Sender<KeeperSignal>,
    ) -> Keeper {
        let book = Arc::new(Mutex::new(Book::new()));
        let layout = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let joined = Arc::new(Notify::new());
        let (rounds_tx, rounds) = watch::channel(0u64);
        let rounds_tx = Arc::new(rounds_tx);
        let timing = Timing {
            ttl: Duration::from_secs(config.lease_ttl_seconds.max(1) as u64),
            interval: config.keepalive_interval,
            ceiling: config.rpc_timeout,
        };
        // Supervised: a keeper that died would let the copy lapse while the worker looks alive.
        // One that panicked runs again over the same book (the leases it keeps, their clocks).
        let (book_, layout_, joined_) = (book.clone(), layout.clone(), joined.clone());
        let make = move || {
            Task {
                peer: peer.clone(),
                timing,
                book: book_.clone(),
                layout: layout_.clone(),
                joined: joined_.clone(),
                rounds: rounds_tx.clone(),
                shared: shared.clone(),
                signals: signals.clone(),
                connection: None,
                status_client: None,
                streams_wanted: 1,
                cluster: None,
            }
            .run()
        };
        let task =
            tokio::spawn(crate::supervise::supervised("keeper", config.supervision.clone(), make).in_current_span());
        Keeper { book, layout, joined, rounds, ttl: timing.ttl, task }
    }

    /// A layout of `leases` is being granted: until all of them are kept, the peer's renewal
    /// capacity is judged against it rather than against the leases granted so far.
    pub fn expect_layout(&self, leases: usize) {
        self.layout.store(leases, std::sync::atomic::Ordering::Relaxed);
    }

    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps exactly `leases` and `retiring` alive from now on (0s are skipped). Leases already
    /// kept keep their clocks; new ones are renewed at once.
    pub fn keep(&self, leases: &[i64], retiring: &[i64]) {
        let mut book = self.book();
        let wanted: std::collections::BTreeMap<i64, bool> = leases
            .iter()
            .map(|id| (*id, false))
            .chain(retiring.iter().map(|id| (*id, true)))
            .filter(|(id, _)| *id != 0)
            .collect();
        book.retain(|id, _| wanted.contains_key(id));
        let mut joined = false;
        for (id, is_retiring) in wanted {
            let kept = book.entry(id).or_insert_with(|| {
                joined = true;
                Kept::default()
            });
            kept.retiring = is_retiring && !leases.contains(&id);
        }
        drop(book);
        if joined {
            self.joined.notify_one();
        }
    }

    /// Adds leases found holding the origin's keys when the records could not say which: kept
    /// alive as retiring until a resync has moved their keys.
    pub fn add_retiring(&self, leases: &[i64]) {
        let mut book = self.book();
        let mut joined = false;
        for id in leases.iter().filter(|id| **id != 0) {
            book.entry(*id).or_insert_with(|| {
                joined = true;
                Kept { retiring: true, ..Kept::default() }
            });
        }
        drop(book);
        if joined {
            self.joined.notify_one();
        }
    }

    /// A lease this worker granted just before `at`: its TTL runs from then, so it is not due
    /// before an interval (the keeper is not woken for it).
    pub fn granted(&self, lease: i64, at: Instant) {
        let kept = Kept { renewed_at: Some(at), answered_at: Some(at), ttl: Some(self.ttl), ..Kept::default() };
        self.book().insert(lease, kept);
    }

    /// The TTL the peer granted each of `ids` with, as far as its answers said (None: not known).
    pub fn granted_ttls(&self, ids: &[i64]) -> Vec<Option<Duration>> {
        let book = self.book();
        ids.iter().map(|id| book.get(id).and_then(|k| k.ttl)).collect()
    }

    /// The leases kept now.
    pub fn leases(&self) -> Vec<i64> {
        self.book().keys().copied().collect()
    }

    /// Whether each of `ids` is alive, from the peer's answers to the renewals: a lease the peer
    /// renewed within `fresh` (the TTL) is alive, one it said is gone is not; waits for the
    /// others' first answer, or fails after `timeout`. 0 is never alive.
    pub async fn liveness(&self, ids: &[i64], fresh: Duration, timeout: Duration) -> anyhow::Result<Vec<bool>> {
        let mut rounds = self.rounds.clone();
        let deadline = Instant::now() + timeout;
        loop {
            let now = Instant::now();
            let answers: Option<Vec<bool>> = {
                let book = self.book();
                ids.iter()
                    .map(|id| match book.get(id) {
                        _ if *id == 0 => Some(false),
                        Some(k) if k.lost => Some(false),
                        Some(k) if k.renewed_at.is_some_and(|t| now.saturating_duration_since(t) < fresh) => Some(true),
                        _ => None,
                    })
                    .collect()
            };
            if let Some(alive) = answers {
                return Ok(alive);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if tokio::time::timeout(left, rounds.changed()).await.is_err() {
                anyhow::bail!("the peer did not answer the renewals of the recorded leases within {timeout:?}");
            }
        }
    }
}

/// The keeper's task.
struct Task {
    peer: EtcdTarget,
    timing: Timing,
    book: Arc<Mutex<Book>>,
    layout: Arc<std::sync::atomic::AtomicUsize>,
    joined: Arc<Notify>,
    rounds: Arc<watch::Sender<u64>>,
    shared: Arc<Shared>,
    signals: mpsc::Sender<KeeperSignal>,
    /// The raw channel and its open streams, kept across rounds while they work.
    connection: Option<Connection>,
    /// For a round trip while no lease is kept.
    status_client: Option<etcd_client::Client>,
    streams_wanted: usize,
    /// The peer's cluster id as the last answers gave it.
    cluster: Option<u64>,
}

struct Connection {
    raw: RawChannel,
    streams: Vec<Option<KeepAliveStream>>,
}

/// How a round ended.
struct RoundEnd {
    answered: usize,
    error: Option<String>,
    /// It ended at its deadline, nothing having failed: the peer was only slow.
    silent: bool,
}

impl Task {
    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    async fn run(mut self) {
        let mut attempt = 0u32;
        let mut silent_rounds = 0u32;
        loop {
            let now = Instant::now();
            for (id, kept) in self.book.lock().unwrap_or_else(std::sync::PoisonError::into_inner).iter_mut() {
                if kept.lost {
                    report_lost(*id, kept, &self.signals);
                }
            }
            let (due, next, deadline, live, timing) = {
                let book = self.book();
                (
                    self.timing.due(&book, now),
                    self.timing.next_round(&book, now),
                    self.timing.round_deadline(&book, now),
                    book.values().filter(|k| !k.lost).count(),
                    self.timing.of_book(&book),
                )
            };
            if due.is_empty() {
                if next.is_none() {
                    self.round_trip_without_leases().await;
                }
                let wake = next.unwrap_or(now + self.timing.interval);
                self.idle_until(wake).await;
                continue;
            }
            crate::faults::point("keeper");
            // Connecting is not part of the round's deadline: across distance, with TLS and a
            // password, a new connection takes several round trips, more than the shortest
            // deadline, and counting it would fail every retry once the leases run low.
            let connected = self.connect().await;
            // Never fewer streams than the layout's floor, from the very first round on.
            self.streams_wanted = streams_for(live, self.streams_wanted, None, timing.target_round());
            let started = Instant::now();
            let end = match connected {
                Err(error) => RoundEnd { answered: 0, error: Some(error), silent: false },
                Ok(()) => self.round_while_answered(&due, started, deadline).await,
            };
            let elapsed = started.elapsed();
            // The streams this round used: a round of a few leases uses fewer than are open.
            let streams = if self.connection.is_some() { runs(due.len(), self.streams_wanted) } else { 0 };
            debug!(due = due.len(), answered = end.answered, ?elapsed, ?deadline, streams, "keepalive round");
            let measured = Measured { answered: end.answered, elapsed, streams };
            self.streams_wanted = streams_for(live, self.streams_wanted, Some(measured), timing.target_round());
            let layout = live.max(self.layout.load(std::sync::atomic::Ordering::Relaxed));
            self.judge_capacity(layout, measured, timing.ttl);
            self.rounds.send_modify(|n| *n += 1);
            match end.error {
                None => {
                    attempt = 0;
                    silent_rounds = 0;
                    self.round_succeeded(elapsed, timing);
                }
                Some(error) => {
                    attempt += 1;
                    debug!(%error, answered = end.answered, of = due.len(), attempt, "keepalive round failed; retrying");
                    // Streams that may hold answers of this round are not reused. A peer that
                    // answered, or only did not answer in time (its apply queue holds renewals
                    // back), keeps its connection; a broken one, or a second silent round in a
                    // row, reconnects (the members that answer may have changed).
                    silent_rounds = if end.answered == 0 && end.silent { silent_rounds + 1 } else { 0 };
                    match self.connection.as_mut() {
                        Some(c) if end.answered > 0 || (end.silent && silent_rounds < 2) => c.streams.clear(),
                        _ => self.connection = None,
                    }
                    self.shared.update(|h| h.keepalive_failures += 1);
                    if end.answered > 0 {
                        self.shared.detector_success();
                    } else {
                        self.shared.detector_evaluate();
                    }
                    let delay = retry_delay(attempt, rand::random::<f64>() * 0.5 + 0.5, refused(&error));
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    /// Sleeps until `wake` or until leases join, evaluating reachability at least once a second.
    async fn idle_until(&self, wake: Instant) {
        while Instant::now() < wake {
            let step = wake.min(Instant::now() + Duration::from_secs(1));
            tokio::select! {
                _ = tokio::time::sleep_until(tokio::time::Instant::from_std(step)) => self.shared.detector_evaluate(),
                _ = self.joined.notified() => return,
            }
        }
    }

    /// Connects to the peer for the renewals, if not connected, within the RPC deadline.
    async fn connect(&mut self) -> Result<(), String> {
        if self.connection.is_some() {
            return Ok(());
        }
        let raw = match tokio::time::timeout(self.timing.ceiling, self.peer.connect_raw(true)).await {
            Ok(Ok(raw)) => raw,
            Ok(Err(e)) => return Err(format!("connecting: {e}")),
            Err(_) => return Err(format!("connecting: no answer within {:?}", self.timing.ceiling)),
        };
        debug!(endpoints = ?raw.endpoints, on_leader = raw.on_leader, "keepalive connection");
        let endpoint = raw.endpoints.join(",");
        let on_leader = raw.on_leader;
        self.shared.update(|h| {
            h.keepalive_endpoint = Some(endpoint);
            h.keepalive_on_leader = on_leader;
        });
        self.connection = Some(Connection { raw, streams: Vec::new() });
        Ok(())
    }

    /// Renews `due` over the streams of the connection: each stream takes a run of them.
    async fn round(&mut self, due: &[i64], started: Instant) -> RoundEnd {
        let Some(connection) = self.connection.as_mut() else {
            return RoundEnd { answered: 0, error: Some("not connected".into()), silent: false };
        };
        let runs = deal(due, self.streams_wanted);
        // The streams stay open from round to round: a round of a split's one new lease uses the
        // first of them and closes none (the next full round would only open them again).
        connection.streams.resize_with(self.streams_wanted.max(runs.len()), || None);
        let raw = connection.raw.clone();
        let book = self.book.clone();
        let signals = self.signals.clone();
        let cluster = Arc::new(Mutex::new(None::<u64>));
        let results = futures::future::join_all(connection.streams.iter_mut().zip(runs).map(|(slot, run)| {
            let (raw, book, signals, cluster) = (raw.clone(), book.clone(), signals.clone(), cluster.clone());
            async move {
                let outcome = renew_on(&raw, slot, &run, started, &book, &signals, &cluster).await;
                if outcome.is_err() {
                    *slot = None;
                }
                outcome
            }
        }))
        .await;
        let seen = *cluster.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        self.check_cluster(seen);
        let answered = results.iter().map(|r| r.as_ref().map_or_else(|(n, _)| *n, |n| *n)).sum();
        let error = results.into_iter().find_map(Result::err).map(|(_, e)| e);
        RoundEnd { answered, error, silent: false }
    }

    /// Runs a round for as long as the peer keeps answering: it is abandoned only once `deadline`
    /// passes with no new answer. A peer that answers slowly works through its queue in order
    /// (the stalest leases first), and abandoning the round would only queue the same renewals
    /// again behind the ones it still holds: the rounds after would never be answered in time.
    /// Answers arriving are successful round trips: the failure detector hears of them while the
    /// round runs, not only at its end (a long round of a busy peer is not an unreachable one),
    /// and of their absence too (a peer silent mid-round is unreachable after the pause).
    async fn round_while_answered(&mut self, due: &[i64], started: Instant, deadline: Duration) -> RoundEnd {
        let (book, shared) = (self.book.clone(), self.shared.clone());
        // Often enough for the shortest pause the detector allows (1 s); a look is one pass over
        // the round's leases.
        let look_every = (deadline / 4).clamp(Duration::from_millis(10), Duration::from_millis(250));
        let stalled = {
            let round = self.round(due, started);
            tokio::pin!(round);
            let (mut answered, mut last_answer) = (0, Instant::now());
            loop {
                tokio::select! {
                    end = &mut round => break Ok(end),
                    () = tokio::time::sleep(look_every) => {
                        let now = answered_since(&book, due, started);
                        if now > answered {
                            (answered, last_answer) = (now, Instant::now());
                            shared.detector_success();
                        } else if last_answer.elapsed() >= deadline {
                            break Err(now);
                        }
                        // A peer gone silent mid-round is said within the pause, not only once
                        // the round's deadline passed.
                        shared.detector_evaluate();
                    }
                }
            }
        };
        stalled.unwrap_or_else(|answered| RoundEnd {
            answered,
            error: Some(format!("no answer for {deadline:?}")),
            silent: true,
        })
    }

    fn check_cluster(&mut self, seen: Option<u64>) {
        let Some(to) = seen.filter(|c| *c != 0) else { return };
        if let Some(from) = self.cluster.replace(to)
            && from != to
        {
            let _ = self.signals.try_send(KeeperSignal::PeerChanged { from, to });
        }
    }

    /// Whether the peer renews the whole layout (`leases`) within a third of the TTL at the rate
    /// this round measured; a shortfall is said once when it starts (an event) and in the health
    /// while it lasts. A round too small to measure a rate changes nothing.
    fn judge_capacity(&mut self, leases: usize, measured: Measured, ttl: Duration) {
        if !measured.measures_rate() {
            return;
        }
        let short = shortfall(leases, measured, ttl);
        let started = short.is_some() && self.shared.health.borrow().renewal_shortfall.is_none();
        self.shared.update(|h| h.renewal_shortfall = short);
        if let Some(short) = short.filter(|_| started) {
            warn!(
                leases = short.leases,
                rate = short.rate,
                streams = short.streams,
                round = ?short.round,
                "the peer renews the leases too slowly for the TTL"
            );
            self.shared.emit(MirrorEvent::RenewalsTooSlow(short));
        }
    }

    /// `timing` is the leases' together (`Timing::of_book`): the shortest TTL they live by.
    fn round_succeeded(&mut self, elapsed: Duration, timing: Timing) {
        // The stalest lease and the TTL it was granted with: when it lapses unless renewed.
        let stalest = self.timing.stalest(&self.book());
        let stalest = stalest.map(|(t, ttl)| (SystemTime::now() - t.elapsed(), ttl.as_secs() as i64));
        let streams = self.connection.as_ref().map_or(0, |c| c.streams.len());
        let degraded = timing.degraded(elapsed);
        if degraded {
            info!(round = ?elapsed, streams, "a keepalive round took more than a third of the TTL");
        }
        self.shared.update(|h| {
            h.record_keepalive_rtt(elapsed);
            h.keepalive_failures = 0;
            h.keepalive_last_success = stalest.map(|(t, _)| t).or(Some(SystemTime::now()));
            h.lease_ttl_reported = Some(stalest.map_or(timing.ttl.as_secs() as i64, |(_, ttl)| ttl));
            h.keepalive_streams = streams;
        });
        self.shared.detector_success();
        // A slow round off the leader: look for the leader again next time.
        if elapsed > timing.target_round() && self.connection.as_ref().is_some_and(|c| !c.raw.on_leader) {
            self.connection = None;
        }
    }

    /// With no lease to keep, a status call each interval keeps the round trip measured.
    async fn round_trip_without_leases(&mut self) {
        let started = Instant::now();
        if self.status_client.is_none() {
            self.status_client =
                tokio::time::timeout(self.timing.ceiling, self.peer.connect()).await.ok().and_then(Result::ok);
        }
        let Some(mut client) = self.status_client.clone() else {
            self.shared.update(|h| h.keepalive_failures += 1);
            self.shared.detector_evaluate();
            return;
        };
        match tokio::time::timeout(self.timing.ceiling, client.status()).await {
            Ok(Ok(status)) => {
                self.check_cluster(status.header().map(|h| h.cluster_id()));
                let elapsed = started.elapsed();
                self.shared.update(|h| {
                    h.record_keepalive_rtt(elapsed);
                    h.keepalive_failures = 0;
                    h.keepalive_last_success = Some(SystemTime::now());
                    h.lease_ttl_reported = None;
                });
                self.shared.detector_success();
            }
            _ => {
                self.status_client = None;
                self.shared.update(|h| h.keepalive_failures += 1);
                self.shared.detector_evaluate();
            }
        }
    }
}

/// How many of `due` the peer answered since `since`.
fn answered_since(book: &Mutex<Book>, due: &[i64], since: Instant) -> usize {
    let book = book.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    due.iter().filter(|id| book.get(id).is_some_and(|k| k.answered_at.is_some_and(|t| t >= since))).count()
}

/// Renews `run` on one stream (opened if needed), recording each answer in the book as it comes:
/// answers of a round cut short still count. The count answered, or it with the error.
async fn renew_on(
    raw: &RawChannel,
    slot: &mut Option<KeepAliveStream>,
    run: &[i64],
    started: Instant,
    book: &Mutex<Book>,
    signals: &mpsc::Sender<KeeperSignal>,
    cluster: &Mutex<Option<u64>>,
) -> Result<usize, (usize, String)> {
    match slot {
        Some(stream) => stream.send(run).map_err(|e| (0, e.message().to_string()))?,
        None => *slot = Some(KeepAliveStream::open(raw, run).await.map_err(|e| (0, describe(&e)))?),
    }
    let stream = slot.as_mut().expect("opened");
    let mut waiting: std::collections::HashSet<i64> = run.iter().copied().collect();
    let mut answered = 0;
    while !waiting.is_empty() {
        let answer = match stream.answer().await {
            Ok(Some(answer)) => answer,
            Ok(None) => return Err((answered, "the peer closed the keepalive stream".into())),
            Err(e) => return Err((answered, describe(&e))),
        };
        if !waiting.remove(&answer.id) {
            continue;
        }
        answered += 1;
        if let Some(h) = &answer.header {
            *cluster.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(h.cluster_id);
        }
        let now = Instant::now();
        let mut book = book.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(kept) = book.get_mut(&answer.id) else { continue };
        kept.answered_at = Some(now);
        if answer.ttl > 0 {
            // A renewal answers with the TTL the lease was granted (and now has again).
            kept.ttl = Some(Duration::from_secs(answer.ttl as u64));
            kept.renewed_at = Some(kept.renewed_at.map_or(started, |t| t.max(started)));
        } else {
            kept.lost = true;
            report_lost(answer.id, kept, signals);
        }
    }
    Ok(answered)
}

/// Tells the worker a lease is gone, once; never waits on it (it may be syncing): a signal that
/// does not fit now is sent at the next round. A retiring lease is expected to go.
fn report_lost(id: i64, kept: &mut Kept, signals: &mpsc::Sender<KeeperSignal>) {
    if !kept.reported && !kept.retiring && signals.try_send(KeeperSignal::LeaseLost(id)).is_ok() {
        kept.reported = true;
    }
}

fn describe(status: &tonic::Status) -> String {
    format!("{:?}: {}", status.code(), status.message())
}

/// The most time to live left, in seconds, among the first few of `ids`, read without renewing
/// them: an owner renews all its leases together, so a few tell whether anyone still does.
/// Some(0) when none of them is alive; None when the peer did not answer.
pub async fn most_ttl_left(peer: &etcd_client::Client, ids: &[i64], timeout: Duration) -> Option<i64> {
    let mut most = 0;
    for id in ids.iter().filter(|id| **id != 0).take(8) {
        match tokio::time::timeout(timeout, peer.clone().lease_time_to_live(*id, None)).await {
            Ok(Ok(resp)) => most = most.max(resp.ttl()),
            Ok(Err(e)) if is_lease_not_found(&e) => {}
            _ => return None,
        }
    }
    Some(most)
}

/// Whether `origin` and `peer` are one etcd, for two connections whose etcds answer with one
/// cluster id. That id is derived from the bootstrap configuration only, so etcds bootstrapped
/// from the same manifests in two regions (same member names, peer URLs and
/// `--initial-cluster-token`) share it. A lease is a fact of one etcd: one granted through the
/// peer is looked up through the origin (no key permission needed for either call) and revoked.
/// None when either did not answer.
pub async fn same_etcd(origin: &etcd_client::Client, peer: &etcd_client::Client, timeout: Duration) -> Option<bool> {
    let probe = tokio::time::timeout(timeout, peer.clone().lease_grant(10, None)).await.ok()?.ok()?.id();
    let seen = match tokio::time::timeout(timeout, origin.clone().lease_time_to_live(probe, None)).await {
        Ok(Ok(resp)) => Some(resp.ttl() > 0),
        Ok(Err(e)) if is_lease_not_found(&e) => Some(false),
        _ => None,
    };
    let _ = tokio::time::timeout(timeout, peer.clone().lease_revoke(probe)).await;
    seen
}

/// What one measured renewal round did.
#[derive(Clone, Debug)]
pub struct RoundMeasure {
    pub answered: usize,
    pub elapsed: Duration,
    pub streams: usize,
    /// The members the streams went to, and whether that was the leader alone.
    pub endpoints: Vec<String>,
    pub on_leader: bool,
}

/// One renewal round of `leases` over `streams` streams, opened for it, by the keeper's own code
/// (for the benchmark): with `prefer_leader`, to the leader when a probe sees it.
pub async fn measure_round(
    peer: &EtcdTarget,
    leases: &[i64],
    streams: usize,
    prefer_leader: bool,
    timeout: Duration,
) -> anyhow::Result<RoundMeasure> {
    let raw = peer.connect_raw(prefer_leader).await?;
    let book = Mutex::new(leases.iter().map(|id| (*id, Kept::default())).collect::<Book>());
    let (signals, _lost) = mpsc::channel(leases.len().max(1));
    let cluster = Mutex::new(None);
    let runs = deal(leases, streams);
    let mut slots: Vec<Option<KeepAliveStream>> = (0..runs.len()).map(|_| None).collect();
    let started = Instant::now();
    let round = futures::future::join_all(
        slots.iter_mut().zip(&runs).map(|(slot, run)| renew_on(&raw, slot, run, started, &book, &signals, &cluster)),
    );
    let results =
        tokio::time::timeout(timeout, round).await.map_err(|_| anyhow::anyhow!("a round took over {timeout:?}"))?;
    let elapsed = started.elapsed();
    if let Some((_, e)) = results.iter().find_map(|r| r.as_ref().err()) {
        anyhow::bail!("a renewal stream failed: {e}");
    }
    let answered = results.iter().map(|r| r.as_ref().map_or(0, |n| *n)).sum();
    Ok(RoundMeasure { answered, elapsed, streams: runs.len(), endpoints: raw.endpoints, on_leader: raw.on_leader })
}
