//! The mirror worker for one (origin region, peer region) pair: its life across sessions.
//!
//! A session (`session.rs`) connects, decides from the peer's records whether this worker owns
//! the mirror and where to resume, takes a new fencing epoch, syncs when it must (`sync.rs`),
//! then watches the origin and applies whole revisions (`watch.rs`); the leases are kept alive by
//! `keepalive.rs` across sessions. An error ends the session; the worker backs off (the backoff
//! only resets once something was applied) and starts another. A fenced worker stands by, keeping
//! the leases alive until a successor shows itself, and takes over again if none does.
use super::backoff::Backoff;
use super::checkpoint::{Checkpoint, CheckpointWrite, Progress, RecordBudget, plan_write};
use super::detector::{ReachabilityDetector, Transition};
use super::health::{MirrorEvent, PeerHealth, Phase, ResyncCause};
use super::keepalive::{Keeper, KeeperSignal};
use super::plan::TxnLimits;
use super::resume::Ownership;
use super::{EtcdTarget, MirrorConfig};
use crate::keys;
use etcd_client::TxnOp;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

/// A running worker.
pub struct MirrorHandle {
    health: watch::Receiver<PeerHealth>,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl MirrorHandle {
    /// The current health snapshot.
    pub fn health(&self) -> PeerHealth {
        self.health.borrow().clone()
    }

    /// A receiver that sees every health change.
    pub fn subscribe(&self) -> watch::Receiver<PeerHealth> {
        self.health.clone()
    }

    /// A clean stop: keepalives stop and nothing is revoked, so the mirror on the peer stays
    /// until the leases lapse or a successor adopts them.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        let _ = self.task.await;
    }

    /// Stops the worker as a crash would: no further request of any kind.
    pub fn abort(self) {
        self.task.abort();
    }

    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

/// Starts a worker. Its events go to `events` (dropped when the receiver lags).
pub fn spawn(
    config: MirrorConfig,
    local: EtcdTarget,
    peer: EtcdTarget,
    events: mpsc::Sender<MirrorEvent>,
) -> MirrorHandle {
    let (health_tx, health_rx) =
        watch::channel(PeerHealth::new(&config.origin, &config.peer, config.lease_ttl_seconds));
    let cancel = CancellationToken::new();
    let span = info_span!("mirror", region = %config.origin, peer = %config.peer);
    let shared = Arc::new(Shared {
        health: health_tx,
        events,
        detector: Mutex::new(ReachabilityDetector::new(config.acceptable_pause, Instant::now())),
    });
    let worker = Worker { config, local, peer, shared, cancel: cancel.clone() };
    let task = tokio::spawn(worker.run().instrument(span));
    MirrorHandle { health: health_rx, cancel, task }
}

/// What the worker and its keepalive task share.
pub(super) struct Shared {
    health: watch::Sender<PeerHealth>,
    events: mpsc::Sender<MirrorEvent>,
    detector: Mutex<ReachabilityDetector>,
}

impl Shared {
    pub(super) fn update(&self, f: impl FnOnce(&mut PeerHealth)) {
        self.health.send_if_modified(|h| {
            let before = h.clone();
            f(h);
            *h != before
        });
    }

    pub(super) fn emit(&self, event: MirrorEvent) {
        if self.events.try_send(event.clone()).is_err() {
            debug!(?event, "event dropped: nobody is reading events fast enough");
        }
    }

    pub(super) fn phase(&self, phase: Phase) {
        self.update(|h| h.phase = phase);
    }

    pub(super) fn detector_success(&self) {
        let transition = self.detector.lock().expect("detector lock").success(Instant::now());
        self.report_transition(transition);
    }

    pub(super) fn detector_evaluate(&self) {
        let transition = self.detector.lock().expect("detector lock").evaluate(Instant::now());
        self.report_transition(transition);
    }

    /// Something was applied: the error is over, and so is the lag up to here.
    pub(super) fn progressed(&self) {
        self.update(|h| {
            h.last_error = None;
            h.last_error_time = None;
        });
    }

    fn report_transition(&self, transition: Option<Transition>) {
        match transition {
            Some(Transition::BecameUnreachable) => {
                warn!("peer region unreachable; its data is left alone");
                self.update(|h| h.reachable = false);
                self.emit(MirrorEvent::RegionUnreachable);
            }
            Some(Transition::BecameReachable) => {
                info!("peer region reachable again");
                self.update(|h| h.reachable = true);
                self.emit(MirrorEvent::RegionReachable);
            }
            None => {}
        }
    }
}

/// How a session ended without an error.
pub(super) enum SessionEnd {
    Shutdown,
    Fenced(String),
}

/// What the worker keeps across sessions. The peer's records stay the truth: every session
/// re-reads them (see `resume.rs`).
#[derive(Default)]
pub(super) struct State {
    pub ownership: Ownership,
    /// One lease per shard (0 where none is granted yet).
    pub leases: Vec<i64>,
    /// The keys a lease may carry on this peer (see `plan::lease_cap`).
    pub lease_cap: u64,
    /// Auth binds this worker's user on the peer (see `session::auth_binds`).
    pub auth_binds: bool,
    /// Which shard each key belongs to (aligned with `leases`).
    pub layout: super::shards::Layout,
    /// Keys per shard.
    pub keys: Vec<i64>,
    /// Leases of a previous shard layout, kept alive until a resync has moved their keys.
    pub retiring: Vec<i64>,
    /// The origin revision the peer holds completely.
    pub applied: i64,
    pub synced: bool,
    /// A sync this worker owes; it stays until a sync completes.
    pub resync_cause: Option<ResyncCause>,
    pub keeper: Option<Keeper>,
    /// The origin etcd's cluster id, recorded with every complete snapshot.
    pub origin_cluster_id: u64,
    /// Origin keys left out because the peer cannot take them: key -> bytes.
    pub oversized: BTreeMap<String, usize>,
    /// Where continuous verification is in the subtree.
    pub walk: super::verify::Walk,
    /// Ops per Txn, lowered when the peer says its `--max-txn-ops` is lower than configured.
    pub txn_ops_cap: Option<usize>,
    /// How the peer stores the checkpoint, as last read or written (written optimistically: a
    /// write that fails ends the session, and the next one reads it again).
    pub stored_checkpoint: super::checkpoint::Stored,
    /// Keys per shard as the checkpoint records them: each shard's count when it was last counted
    /// (by a sync, or by a split of it). A split records only its two shards' counts, so that it
    /// rewrites the parts holding them and not every part whose count moved since.
    pub recorded_keys: Vec<i64>,
}

pub(super) struct Worker {
    pub config: MirrorConfig,
    pub local: EtcdTarget,
    pub peer: EtcdTarget,
    pub shared: Arc<Shared>,
    pub cancel: CancellationToken,
}

/// How standing by ended.
enum StandBy {
    Resume,
    Shutdown,
}

impl Worker {
    async fn run(self) {
        let mut state = State::default();
        let mut backoff = Backoff::new(self.config.backoff_base, self.config.backoff_cap);
        let (lost_tx, mut lost_rx) = mpsc::channel::<KeeperSignal>(64);
        loop {
            let outcome = tokio::select! {
                _ = self.cancel.cancelled() => Ok(SessionEnd::Shutdown),
                r = self.session(&mut state, &lost_tx, &mut lost_rx, &mut backoff) => r,
            };
            match outcome {
                Ok(SessionEnd::Shutdown) => break,
                Ok(SessionEnd::Fenced(by)) => {
                    warn!(%by, "fenced: another worker owns this mirror now; this one stops writing and stands by");
                    self.shared.update(|h| {
                        h.phase = Phase::Fenced;
                        h.synced = false;
                    });
                    self.shared.emit(MirrorEvent::Fenced { by });
                    match self.stand_by(&mut state).await {
                        StandBy::Shutdown => break,
                        StandBy::Resume => {
                            state.ownership.take_over = true;
                            backoff.reset();
                        }
                    }
                }
                Err(error) => {
                    let message = format!("{error:#}");
                    warn!(error = %message, "mirror session failed; backing off");
                    if message.contains("too many operations in txn request") {
                        // The peer's --max-txn-ops is lower than ours: halve until it fits.
                        let cap = state.txn_ops_cap.unwrap_or(self.config.max_txn_ops) / 2;
                        state.txn_ops_cap = Some(cap.max(4));
                        warn!(max_ops = cap.max(4), "the peer takes fewer operations per Txn; batching smaller");
                    }
                    let now = SystemTime::now();
                    self.shared.update(|h| {
                        h.phase = Phase::Backoff;
                        h.last_error = Some(message.clone());
                        h.last_error_time = Some(now);
                        h.session_failures += 1;
                        // Nothing is confirmed applied from here on: the lag keeps growing.
                        h.pending_since = h.pending_since.or(Some(now));
                    });
                    let delay = backoff.next_delay(rand::random::<f64>() * 0.5 + 0.5);
                    tokio::select! {
                        _ = self.cancel.cancelled() => break,
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
        // No revoke: the leases lapse on their own unless a successor adopts them.
        state.keeper = None;
        self.shared.phase(Phase::Stopped);
    }

    /// Fenced: keeps the leases alive until a successor shows itself (it writes the progress
    /// record under its own name when it takes over), then lets them go. Resumes when the owner
    /// record turns out to be a restored old one, when it is gone, when nobody takes over within
    /// two TTLs, or when the successor's leases have all lapsed.
    async fn stand_by(&self, state: &mut State) -> StandBy {
        let started = Instant::now();
        let patience = std::time::Duration::from_secs(2 * self.config.lease_ttl_seconds.max(1) as u64);
        let mut successor_seen = false;
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => return StandBy::Shutdown,
                _ = tokio::time::sleep(self.config.keepalive_interval) => {}
            }
            let Ok(peer) = self.peer.connect().await else { continue };
            let Ok(records) = self.read_records(&peer).await else { continue };
            let decision =
                super::resume::decide_ownership(&self.config.owner_id, &state.ownership, records.owner.as_ref());
            if let super::resume::OwnerDecision::Take { .. } = decision {
                info!("the owner record is gone or an old one came back; resuming");
                return StandBy::Resume;
            }
            let progress_owner = records.progress.as_ref().map(|p| p.owner.as_str());
            if !successor_seen && progress_owner.is_some_and(|o| o != self.config.owner_id) {
                info!(successor = progress_owner.unwrap_or_default(), "a successor took over; keepalives stop here");
                successor_seen = true;
                state.keeper = None;
            }
            if !successor_seen && started.elapsed() > patience {
                warn!(waited = ?started.elapsed(), "nobody took over this mirror; resuming");
                return StandBy::Resume;
            }
            if successor_seen {
                let leases: Vec<i64> = records.checkpoint.as_ref().map(|c| c.leases.clone()).unwrap_or_default();
                let alive = self.leases_alive(&peer, &leases).await.unwrap_or_default();
                if !leases.is_empty() && alive.len() == leases.len() && alive.iter().all(|a| !a) {
                    warn!("the successor's leases all lapsed; resuming");
                    return StandBy::Resume;
                }
            }
        }
    }

    /// The checkpoint record this worker would write now.
    pub(super) fn checkpoint(&self, state: &State, revision: i64, synced: bool) -> Checkpoint {
        self.checkpoint_for(state, &state.layout, &state.leases, &state.keys, revision, synced)
    }

    /// The checkpoint record of a lease layout (the current one, or one about to be used).
    pub(super) fn checkpoint_for(
        &self,
        state: &State,
        layout: &super::shards::Layout,
        leases: &[i64],
        keys: &[i64],
        revision: i64,
        synced: bool,
    ) -> Checkpoint {
        Checkpoint {
            owner: self.config.owner_id.clone(),
            revision,
            leases: leases.to_vec(),
            slots: if layout.is_uniform() { Vec::new() } else { layout.slots().to_vec() },
            keys: keys.to_vec(),
            synced,
            retiring: state.retiring.clone(),
            origin_cluster_id: state.origin_cluster_id,
            parts: None,
        }
    }

    /// Plans writing `record` over what the peer stores, within what one Txn may carry beside
    /// the records written with it.
    pub(super) fn checkpoint_write(&self, state: &mut State, record: &Checkpoint) -> CheckpointWrite {
        let limits = self.limits(state);
        let budget = RecordBudget {
            ops: limits.max_ops.saturating_sub(3).max(1),
            bytes: limits.max_bytes.saturating_sub(4096).max(1),
        };
        let fresh_id = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
        let per_part = self.config.checkpoint_shards_per_part;
        let write = plan_write(&self.config.origin, record, &state.stored_checkpoint, budget, per_part, fresh_id);
        state.stored_checkpoint = write.stored.clone();
        state.recorded_keys = record.keys.clone();
        write
    }

    pub(super) fn progress_op(&self, revision: i64) -> TxnOp {
        TxnOp::put(keys::progress_key(&self.config.origin), self.progress_value(revision), None)
    }

    /// The progress record's value for `revision`.
    pub(super) fn progress_value(&self, revision: i64) -> Vec<u8> {
        Progress { owner: self.config.owner_id.clone(), revision }.encode()
    }

    /// What one peer Txn may carry: the configured limits (ops lowered if the peer said so), less
    /// room for the progress record.
    pub(super) fn limits(&self, state: &State) -> TxnLimits {
        let ops = state.txn_ops_cap.unwrap_or(self.config.max_txn_ops).min(self.config.max_txn_ops);
        TxnLimits::for_peer(ops, self.config.max_txn_bytes, 3, 1024)
    }

    /// Bounds an etcd call by the RPC timeout.
    pub(super) async fn rpc<T>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> anyhow::Result<T> {
        use anyhow::Context;
        match tokio::time::timeout(self.config.rpc_timeout, call).await {
            Err(_) => Err(anyhow::anyhow!("{what}: timed out after {:?}", self.config.rpc_timeout)),
            Ok(r) => r.with_context(|| what.to_string()),
        }
    }

    /// Replaces the keepalive task when the set of leases to keep alive changed.
    pub(super) fn ensure_keeper(&self, state: &mut State, lost_tx: &mpsc::Sender<KeeperSignal>) {
        let mut ids: Vec<i64> = state.leases.iter().chain(&state.retiring).copied().filter(|id| *id != 0).collect();
        ids.sort_unstable();
        ids.dedup();
        self.shared.update(|h| h.leases = state.leases.len());
        if state.keeper.as_ref().is_some_and(|k| k.leases == ids) {
            return;
        }
        state.keeper = Some(Keeper::spawn(
            self.peer.clone(),
            ids,
            self.config.clone(),
            self.shared.clone(),
            lost_tx.clone(),
            state.retiring.clone(),
        ));
    }

    /// Records keys left out because the peer cannot take them, and says so once per key and size.
    pub(super) fn report_oversized(&self, state: &mut State, found: Vec<super::plan::Oversized>, fixed: Vec<String>) {
        let mut changed = false;
        for key in fixed {
            changed |= state.oversized.remove(&key).is_some();
        }
        for o in found {
            if state.oversized.get(&o.key) != Some(&o.bytes) {
                warn!(key = %o.key, bytes = o.bytes, "a value is larger than the peer accepts; left out of the mirror");
                self.shared.emit(MirrorEvent::ValueTooLarge { key: o.key.clone(), bytes: o.bytes });
                state.oversized.insert(o.key, o.bytes);
                changed = true;
            }
        }
        if changed {
            let list: Vec<(String, usize)> = state.oversized.iter().map(|(k, v)| (k.clone(), *v)).collect();
            self.shared.update(|h| h.oversized = list);
        }
    }
}
