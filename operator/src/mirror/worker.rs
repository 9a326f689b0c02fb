//! The mirror worker for one (origin region, peer region) pair: the IO around the planner.
//!
//! A session connects, takes ownership of the origin's mirror on the peer (fencing), adopts the
//! leases of a previous owner or grants new ones, syncs when it must, then watches the origin's
//! subtree and applies whole revisions in coalesced Txns. Any error ends the session; the worker
//! backs off and starts a new one, resuming from the last applied revision.
use super::checkpoint::{Checkpoint, Owner};
use super::detector::{ReachabilityDetector, Transition};
use super::health::{MirrorEvent, PeerHealth, Phase, ResyncCause};
use super::plan::{Kv, MirrorOp, Revision, SyncBatcher, TxnLimits, WatchBatch, merge_step, next_watch_batch};
use super::shards::{shard_count, shard_count_fits, shard_of};
use super::{EtcdTarget, MirrorConfig};
use crate::keys;
use anyhow::{Context, anyhow};
use etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, LeaseKeepAliveStream, LeaseKeeper, PutOptions, Txn, TxnOp,
    TxnOpResponse, WatchOptions,
};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
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
struct Shared {
    health: watch::Sender<PeerHealth>,
    events: mpsc::Sender<MirrorEvent>,
    detector: Mutex<ReachabilityDetector>,
}

impl Shared {
    fn update(&self, f: impl FnOnce(&mut PeerHealth)) {
        self.health.send_if_modified(|h| {
            let before = h.clone();
            f(h);
            *h != before
        });
    }

    fn emit(&self, event: MirrorEvent) {
        if self.events.try_send(event.clone()).is_err() {
            debug!(?event, "event dropped: nobody is reading events fast enough");
        }
    }

    fn phase(&self, phase: Phase) {
        self.update(|h| h.phase = phase);
    }

    fn detector_success(&self) {
        let transition = self.detector.lock().expect("detector lock").success(Instant::now());
        self.report_transition(transition);
    }

    fn detector_evaluate(&self) {
        let transition = self.detector.lock().expect("detector lock").evaluate(Instant::now());
        self.report_transition(transition);
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
enum SessionEnd {
    Shutdown,
    Fenced(String),
}

/// How a watch ended without an error.
enum WatchEnd {
    Shutdown,
    Fenced(String),
    Resync(ResyncCause),
}

/// The outcome of one batch Txn.
enum Applied {
    Yes,
    Fenced(String),
}

/// A watch batch Txn in flight.
type BatchFuture = std::pin::Pin<Box<dyn Future<Output = anyhow::Result<(Applied, WatchBatch)>> + Send>>;

/// What the worker keeps across sessions.
#[derive(Default)]
struct State {
    /// The owner key's mod revision when this worker took ownership: the fencing epoch.
    epoch: Option<i64>,
    /// One lease per shard (0 where none is granted yet).
    leases: Vec<i64>,
    /// Keys per shard.
    keys: Vec<i64>,
    /// Leases of a previous shard layout, kept alive until a resync has moved their keys.
    retiring: Vec<i64>,
    /// The origin revision the peer holds completely.
    applied: i64,
    /// The revision of the last checkpoint written.
    checkpointed: i64,
    synced: bool,
    resync_cause: Option<ResyncCause>,
    keeper: Option<Keeper>,
}

struct Worker {
    config: MirrorConfig,
    local: EtcdTarget,
    peer: EtcdTarget,
    shared: Arc<Shared>,
    cancel: CancellationToken,
}

impl Worker {
    async fn run(self) {
        let mut state = State { resync_cause: Some(ResyncCause::Initial), ..State::default() };
        let mut backoff = super::backoff::Backoff::new(self.config.backoff_base, self.config.backoff_cap);
        let (lost_tx, mut lost_rx) = mpsc::channel::<i64>(64);
        loop {
            let outcome = tokio::select! {
                _ = self.cancel.cancelled() => Ok(SessionEnd::Shutdown),
                r = self.session(&mut state, &lost_tx, &mut lost_rx, &mut backoff) => r,
            };
            match outcome {
                Ok(SessionEnd::Shutdown) => break,
                Ok(SessionEnd::Fenced(by)) => {
                    warn!(%by, "fenced: another worker owns this mirror now; this one stops writing");
                    state.keeper = None;
                    self.shared.phase(Phase::Fenced);
                    self.shared.emit(MirrorEvent::Fenced { by });
                    self.cancel.cancelled().await;
                    return;
                }
                Err(error) => {
                    let message = format!("{error:#}");
                    warn!(error = %message, "mirror session failed; backing off");
                    self.shared.update(|h| {
                        h.phase = Phase::Backoff;
                        h.last_error = Some(message.clone());
                        h.last_error_time = Some(SystemTime::now());
                        h.pending_since = None;
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

    async fn session(
        &self,
        state: &mut State,
        lost_tx: &mpsc::Sender<i64>,
        lost_rx: &mut mpsc::Receiver<i64>,
        backoff: &mut super::backoff::Backoff,
    ) -> anyhow::Result<SessionEnd> {
        self.shared.phase(Phase::Connecting);
        let mut local = self.local.connect().await.context("connecting to the local etcd")?;
        let mut peer = self.peer.connect().await.context("connecting to the peer etcd")?;

        if let Some(by) = self.acquire(&mut peer, state).await? {
            return Ok(SessionEnd::Fenced(by));
        }
        if state.leases.is_empty() {
            self.adopt(&mut peer, state).await?;
        } else {
            self.verify_leases(&mut peer, state).await?;
        }
        if state.keeper.is_none() {
            self.restart_keeper(state, lost_tx);
        }

        loop {
            // The cause stays until a sync completes: a sync cut short by an error is redone by
            // the next session, never skipped for the watch.
            if let Some(cause) = state.resync_cause {
                if cause != ResyncCause::Initial {
                    self.shared.update(|h| h.resyncs += 1);
                }
                self.shared.emit(MirrorEvent::ResyncStarted { cause });
                info!(cause = cause.as_str(), "full sync");
                match self.sync(&mut local, &mut peer, state, cause, lost_tx).await? {
                    Some(by) => return Ok(SessionEnd::Fenced(by)),
                    None => {
                        state.resync_cause = None;
                        backoff.reset();
                    }
                }
            }
            match self.watch(&mut local, &mut peer, state, lost_rx, backoff).await? {
                WatchEnd::Shutdown => return Ok(SessionEnd::Shutdown),
                WatchEnd::Fenced(by) => return Ok(SessionEnd::Fenced(by)),
                WatchEnd::Resync(cause) => {
                    if cause == ResyncCause::LeaseLost || cause == ResyncCause::Reshard {
                        self.restart_keeper(state, lost_tx);
                    }
                    state.synced = false;
                    state.resync_cause = Some(cause);
                }
            }
        }
    }

    /// Takes ownership of the origin's mirror on the peer, once per worker; later sessions only
    /// check that it is still ours. Returns who fenced us, if someone did.
    async fn acquire(&self, peer: &mut Client, state: &mut State) -> anyhow::Result<Option<String>> {
        let key = keys::owner_key(&self.config.origin);
        let current = self.rpc("read owner", peer.get(key.as_str(), None)).await?;
        let current = current.kvs().first();
        if let Some(epoch) = state.epoch {
            return Ok(match current {
                Some(kv) if kv.mod_revision() == epoch => None,
                Some(kv) => Some(Owner::decode(kv.value()).map(|o| o.owner).unwrap_or_else(|| "unknown".into())),
                None => Some("nobody (the owner key was deleted)".into()),
            });
        }
        let compare = match current {
            Some(kv) => Compare::mod_revision(key.as_str(), CompareOp::Equal, kv.mod_revision()),
            None => Compare::version(key.as_str(), CompareOp::Equal, 0),
        };
        let owner =
            Owner { owner: self.config.owner_id.clone(), acquired_at: k8s_openapi::jiff::Timestamp::now().to_string() };
        let txn = Txn::new().when([compare]).and_then([TxnOp::put(key.as_str(), serde_json::to_vec(&owner)?, None)]);
        let resp = self.rpc("take ownership", peer.txn(txn)).await?;
        if !resp.succeeded() {
            anyhow::bail!("another worker changed the owner of this mirror while this one took over; retrying");
        }
        let epoch = resp.header().map(|h| h.revision()).ok_or_else(|| anyhow!("txn response without header"))?;
        state.epoch = Some(epoch);
        info!(epoch, "took ownership of the mirror on the peer");
        Ok(None)
    }

    /// Adopts a previous owner's leases and revision from the checkpoint, where they are alive.
    async fn adopt(&self, peer: &mut Client, state: &mut State) -> anyhow::Result<()> {
        let resp = self.rpc("read checkpoint", peer.get(keys::checkpoint_key(&self.config.origin), None)).await?;
        let Some(checkpoint) = resp.kvs().first().and_then(|kv| Checkpoint::decode(kv.value())) else {
            return Ok(());
        };
        if checkpoint.leases.is_empty() {
            return Ok(());
        }
        let mut all_alive = true;
        let mut leases = Vec::with_capacity(checkpoint.leases.len());
        for id in &checkpoint.leases {
            if self.lease_alive(peer, *id).await? {
                leases.push(*id);
            } else {
                all_alive = false;
                leases.push(0);
            }
        }
        state.keys =
            if checkpoint.keys.len() == leases.len() { checkpoint.keys.clone() } else { vec![0; leases.len()] };
        state.leases = leases;
        // Leases a predecessor was moving keys off: keep them alive until our sync has moved
        // their keys.
        for id in &checkpoint.retiring {
            if self.lease_alive(peer, *id).await? {
                state.retiring.push(*id);
            }
        }
        if all_alive && checkpoint.synced && checkpoint.revision > 0 {
            state.applied = checkpoint.revision;
            state.checkpointed = checkpoint.revision;
            state.synced = true;
            state.resync_cause = None;
            info!(leases = state.leases.len(), revision = checkpoint.revision, "adopted the previous owner's leases");
            self.shared.emit(MirrorEvent::LeasesAdopted { leases: state.leases.len(), revision: checkpoint.revision });
            self.shared.update(|h| {
                h.last_applied_revision = checkpoint.revision;
                h.keys = checkpoint.total_keys();
                h.leases = checkpoint.leases.len();
                h.synced = true;
            });
        }
        Ok(())
    }

    /// After a session failed: are our leases still there? A lease lost meanwhile means its keys
    /// are gone, and so a new lease and a resync.
    async fn verify_leases(&self, peer: &mut Client, state: &mut State) -> anyhow::Result<()> {
        let mut lost = false;
        for lease in state.leases.iter_mut() {
            if *lease != 0 && !self.lease_alive(peer, *lease).await? {
                warn!(lease = *lease, "lease lost while the session was down");
                *lease = 0;
                lost = true;
            }
        }
        if lost {
            state.keeper = None;
            state.synced = false;
            state.resync_cause = Some(ResyncCause::LeaseLost);
        }
        Ok(())
    }

    async fn lease_alive(&self, peer: &mut Client, id: i64) -> anyhow::Result<bool> {
        match tokio::time::timeout(self.config.rpc_timeout, peer.lease_time_to_live(id, None)).await {
            Err(_) => Err(anyhow!("lease time-to-live: timed out after {:?}", self.config.rpc_timeout)),
            Ok(Ok(resp)) => Ok(resp.ttl() > 0),
            Ok(Err(e)) if is_lease_not_found(&e) => Ok(false),
            Ok(Err(e)) => Err(anyhow!(e).context("lease time-to-live")),
        }
    }

    fn restart_keeper(&self, state: &mut State, lost_tx: &mpsc::Sender<i64>) {
        let mut ids: Vec<i64> = state.leases.iter().copied().filter(|id| *id != 0).collect();
        ids.extend(state.retiring.iter().copied());
        self.shared.update(|h| h.leases = state.leases.len());
        state.keeper = Some(Keeper::spawn(
            self.peer.clone(),
            ids,
            self.config.clone(),
            self.shared.clone(),
            lost_tx.clone(),
            state.retiring.clone(),
        ));
    }

    async fn grant(&self, peer: &mut Client, shard: usize) -> anyhow::Result<i64> {
        let resp = self.rpc("grant lease", peer.lease_grant(self.config.lease_ttl_seconds, None)).await?;
        info!(lease = resp.id(), shard, "lease granted");
        self.shared.emit(MirrorEvent::LeaseGranted { lease: resp.id(), shard });
        Ok(resp.id())
    }

    /// The full sync: the origin's subtree at one revision, diffed page by page against the
    /// peer's copy, applied in parallel batches. Returns who fenced us, if someone did.
    async fn sync(
        &self,
        local: &mut Client,
        peer: &mut Client,
        state: &mut State,
        cause: ResyncCause,
        lost_tx: &mpsc::Sender<i64>,
    ) -> anyhow::Result<Option<String>> {
        let phase = if cause == ResyncCause::Initial { Phase::Syncing } else { Phase::Resyncing };
        self.shared.update(|h| {
            h.phase = phase;
            h.synced = false;
        });
        state.synced = false;
        let prefix = keys::region_prefix(&self.config.origin);
        let range_end = keys::prefix_range_end(prefix.as_bytes());

        // Pin the snapshot: the revision and size of the origin's subtree now.
        let head = self
            .rpc(
                "count origin keys",
                local.get(prefix.as_str(), Some(GetOptions::new().with_prefix().with_count_only())),
            )
            .await?;
        let revision = head.header().map(|h| h.revision()).ok_or_else(|| anyhow!("range response without header"))?;
        let total = head.count().max(0) as u64;

        // Lease layout: keep the current one while it fits, else reshard.
        let max_per_lease = self.config.max_keys_per_lease;
        let mut keeper_changed = false;
        if state.leases.is_empty() || !shard_count_fits(state.leases.len(), total, max_per_lease) {
            let shards = shard_count(total, max_per_lease);
            if !state.leases.is_empty() {
                info!(from = state.leases.len(), to = shards, keys = total, "resharding leases");
                state.retiring.extend(state.leases.iter().copied().filter(|id| *id != 0));
            }
            state.leases = vec![0; shards];
            keeper_changed = true;
        }
        // Grant the missing leases together: one round trip, not one per shard.
        let missing: Vec<usize> = (0..state.leases.len()).filter(|s| state.leases[*s] == 0).collect();
        let granted = futures::future::try_join_all(missing.iter().map(|shard| {
            let mut peer = peer.clone();
            async move { self.grant(&mut peer, *shard).await }
        }))
        .await?;
        for (shard, lease) in missing.into_iter().zip(granted) {
            state.leases[shard] = lease;
            keeper_changed = true;
        }
        if keeper_changed {
            self.restart_keeper(state, lost_tx);
            // Record the new layout before any key moves to it, so that a successor taking over
            // mid-sync keeps every lease that may hold keys alive, and syncs again.
            let epoch = state.epoch.ok_or_else(|| anyhow!("sync without ownership"))?;
            let checkpoint = self.checkpoint(state, state.checkpointed, false);
            let bookkeeping = vec![TxnOp::put(keys::checkpoint_key(&self.config.origin), checkpoint.encode(), None)];
            if let Applied::Fenced(by) = self.apply(peer.clone(), epoch, Vec::new(), &state.leases, bookkeeping).await?
            {
                return Ok(Some(by));
            }
        }

        let shards = state.leases.len();
        let leases = state.leases.clone();
        let epoch = state.epoch.ok_or_else(|| anyhow!("sync without ownership"))?;
        let limits = self.limits(shards);
        let mut batcher = SyncBatcher::new(limits);
        let mut counts = vec![0i64; shards];
        let mut inflight = FuturesUnordered::new();
        let (mut origin_buf, mut peer_buf) = (VecDeque::new(), VecDeque::new());
        let (mut origin_cursor, mut peer_cursor) = (prefix.clone().into_bytes(), prefix.clone().into_bytes());
        let (mut origin_done, mut peer_done) = (false, false);
        let mut ops = Vec::new();
        let page = self.config.page_size;

        loop {
            if origin_buf.is_empty() && !origin_done {
                let opts = GetOptions::new().with_range(range_end.clone()).with_revision(revision).with_limit(page);
                let mut resp = self.rpc("range origin page", local.get(origin_cursor.clone(), Some(opts))).await?;
                origin_done = !resp.more();
                for kv in resp.take_kvs() {
                    counts[shard_of(kv.key(), shards)] += 1;
                    origin_buf.push_back(to_kv(kv));
                }
                if let Some(last) = origin_buf.back() {
                    origin_cursor = next_key(&last.key);
                }
            }
            if peer_buf.is_empty() && !peer_done {
                let opts = GetOptions::new().with_range(range_end.clone()).with_limit(page);
                let mut resp = self.rpc("range peer page", peer.get(peer_cursor.clone(), Some(opts))).await?;
                peer_done = !resp.more();
                peer_buf.extend(resp.take_kvs().into_iter().map(to_kv));
                if let Some(last) = peer_buf.back() {
                    peer_cursor = next_key(&last.key);
                }
            }
            merge_step(
                &mut origin_buf,
                origin_done,
                &mut peer_buf,
                peer_done,
                |key| shard_of(key, shards),
                |shard| leases[shard],
                &mut ops,
            );
            for op in ops.drain(..) {
                if let Some(batch) = batcher.push(op) {
                    while inflight.len() >= self.config.sync_parallelism {
                        if let Some(by) = self.settle(inflight.next().await)? {
                            return Ok(Some(by));
                        }
                    }
                    inflight.push(self.apply(peer.clone(), epoch, batch, &leases, Vec::new()));
                }
            }
            if origin_done && peer_done && origin_buf.is_empty() && peer_buf.is_empty() {
                break;
            }
        }
        if let Some(batch) = batcher.take() {
            inflight.push(self.apply(peer.clone(), epoch, batch, &leases, Vec::new()));
        }
        while let Some(result) = inflight.next().await {
            if let Some(by) = self.settle(Some(result))? {
                return Ok(Some(by));
            }
        }
        drop(inflight);

        // The last Txn records the complete snapshot and writes the canary.
        state.keys = counts;
        let checkpoint = self.checkpoint(state, revision, true);
        let canary =
            serde_json::json!({"revision": revision, "syncedAt": k8s_openapi::jiff::Timestamp::now().to_string()});
        let bookkeeping = vec![
            TxnOp::put(keys::checkpoint_key(&self.config.origin), checkpoint.encode(), None),
            TxnOp::put(
                keys::canary_key(&self.config.origin),
                canary.to_string(),
                Some(PutOptions::new().with_lease(leases[0])),
            ),
        ];
        if let Applied::Fenced(by) = self.apply(peer.clone(), epoch, Vec::new(), &leases, bookkeeping).await? {
            return Ok(Some(by));
        }
        state.applied = revision;
        state.checkpointed = revision;
        state.synced = true;
        let total_keys = checkpoint.total_keys();
        self.shared.update(|h| {
            h.last_applied_revision = revision;
            h.last_seen_revision = h.last_seen_revision.max(revision);
            h.keys = total_keys;
            h.synced = true;
            h.pending_since = None;
        });
        self.shared.emit(MirrorEvent::Synced { revision, keys: total_keys });
        info!(revision, keys = total_keys, "peer holds the complete snapshot; canary written");
        if !state.retiring.is_empty() {
            // The old layout's leases hold nothing now; they lapse on their own.
            state.retiring.clear();
            self.restart_keeper(state, lost_tx);
        }
        Ok(None)
    }

    fn settle(&self, result: Option<anyhow::Result<Applied>>) -> anyhow::Result<Option<String>> {
        match result {
            None | Some(Ok(Applied::Yes)) => Ok(None),
            Some(Ok(Applied::Fenced(by))) => Ok(Some(by)),
            Some(Err(e)) => Err(e),
        }
    }

    /// Watches the origin's subtree from the revision after the last applied one and applies
    /// pending revisions in coalesced Txns, one Txn in flight at a time (order matters here).
    async fn watch(
        &self,
        local: &mut Client,
        peer: &mut Client,
        state: &mut State,
        lost_rx: &mut mpsc::Receiver<i64>,
        backoff: &mut super::backoff::Backoff,
    ) -> anyhow::Result<WatchEnd> {
        let prefix = keys::region_prefix(&self.config.origin);
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(state.applied + 1)
            .with_prev_key()
            .with_progress_notify();
        let mut stream = self.rpc("start watch", local.watch(prefix.as_str(), Some(options))).await?;
        self.shared.update(|h| h.phase = Phase::Watching);
        backoff.reset();

        let epoch = state.epoch.ok_or_else(|| anyhow!("watch without ownership"))?;
        let shards = state.leases.len();
        let limits = self.limits(shards);
        let mut pending: VecDeque<Revision> = VecDeque::new();
        // Per pending revision: its key-count changes (applied to the counts once the revision
        // is) and when it arrived (the lag is the age of the oldest one).
        let mut pending_meta: VecDeque<(Vec<(usize, i64)>, SystemTime)> = VecDeque::new();
        let mut pending_ops = 0usize;
        let mut split = 0usize;
        let mut progress_revision = 0i64;
        let mut inflight: Option<BatchFuture> = None;
        let mut ticker = tokio::time::interval(self.config.progress_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => return Ok(WatchEnd::Shutdown),
                Some(lost) = lost_rx.recv() => {
                    if let Some(shard) = state.leases.iter().position(|id| *id == lost) {
                        warn!(lease = lost, shard, "lease lost; its keys are gone from the peer");
                        // The sync grants its replacement and records it before moving keys.
                        state.leases[shard] = 0;
                        return Ok(WatchEnd::Resync(ResyncCause::LeaseLost));
                    }
                }
                result = async { inflight.as_mut().expect("guarded").await }, if inflight.is_some() => {
                    inflight = None;
                    let (applied, batch) = result?;
                    if let Applied::Fenced(by) = applied {
                        return Ok(WatchEnd::Fenced(by));
                    }
                    for _ in 0..batch.revisions_consumed {
                        if let Some(rev) = pending.pop_front() {
                            pending_ops -= rev.ops.len();
                        }
                        for (shard, delta) in pending_meta.pop_front().map(|m| m.0).unwrap_or_default() {
                            state.keys[shard] = (state.keys[shard] + delta).max(0);
                        }
                    }
                    if batch.split_ops_consumed > split && split == 0
                        && let Some(rev) = pending.front() {
                        warn!(revision = rev.revision, ops = rev.ops.len(), "a source revision exceeds the peer's Txn limits; applying it in parts");
                        self.shared.emit(MirrorEvent::RevisionSplit { revision: rev.revision, ops: rev.ops.len() });
                        self.shared.update(|h| h.split_revisions += 1);
                    }
                    split = batch.split_ops_consumed;
                    state.applied = state.applied.max(batch.applied_through);
                    state.checkpointed = state.applied;
                    let (applied_rev, total) = (state.applied, state.keys.iter().sum::<i64>());
                    let oldest_pending = pending_meta.front().map(|m| m.1);
                    self.shared.update(|h| {
                        h.last_applied_revision = h.last_applied_revision.max(applied_rev);
                        h.keys = total;
                        h.txns += 1;
                        h.ops += batch.ops.len() as u64;
                        h.pending_since = oldest_pending;
                    });
                    if state.keys.iter().any(|n| *n as u64 > self.config.max_keys_per_lease) {
                        return Ok(WatchEnd::Resync(ResyncCause::Reshard));
                    }
                }
                message = stream.message(), if pending_ops < self.config.max_pending_ops => {
                    let Some(response) = message.context("watching the origin")? else {
                        anyhow::bail!("the origin closed the watch");
                    };
                    if response.canceled() {
                        if response.compact_revision() > 0 {
                            warn!(compacted = response.compact_revision(), needed = state.applied + 1, "origin compacted past the mirror's revision");
                            return Ok(WatchEnd::Resync(ResyncCause::Compacted));
                        }
                        anyhow::bail!("the origin cancelled the watch: {}", response.cancel_reason());
                    }
                    let header_revision = response.header().map(|h| h.revision()).unwrap_or(0);
                    if response.events().is_empty() {
                        // A progress notification: every event up to this revision was sent.
                        if !response.created() {
                            progress_revision = progress_revision.max(header_revision);
                        }
                    } else {
                        let mut newest = 0;
                        let received = SystemTime::now();
                        for event in response.events() {
                            let Some(kv) = event.kv() else { continue };
                            let revision = kv.mod_revision();
                            newest = revision;
                            let shard = shard_of(kv.key(), shards);
                            let (op, delta) = match event.event_type() {
                                EventType::Put => (
                                    MirrorOp::Put { key: kv.key().to_vec(), value: kv.value().to_vec(), shard },
                                    i64::from(event.prev_kv().is_none()),
                                ),
                                EventType::Delete => (MirrorOp::Delete { key: kv.key().to_vec() }, -1),
                            };
                            pending_ops += 1;
                            match pending.back_mut() {
                                Some(last) if last.revision == revision => {
                                    last.ops.push(op);
                                    pending_meta.back_mut().expect("parallel to pending").0.push((shard, delta));
                                }
                                _ => {
                                    pending.push_back(Revision { revision, ops: vec![op] });
                                    pending_meta.push_back((vec![(shard, delta)], received));
                                }
                            }
                        }
                        let oldest_pending = pending_meta.front().map(|m| m.1);
                        self.shared.update(|h| {
                            h.last_seen_revision = h.last_seen_revision.max(newest);
                            h.pending_since = oldest_pending;
                        });
                    }
                }
                _ = ticker.tick() => {
                    // Bounded, so that a stalled watch stream cannot stall the loop.
                    self.rpc("request watch progress", stream.request_progress()).await?;
                }
            }

            // Idle and told that nothing is missing up to a revision: the reported watermark
            // advances, so an idle subtree does not look stale. It is never checkpointed nor
            // resumed from: etcd before 3.4.24 and 3.5.8 can send a progress notification ahead
            // of events still on their way (etcd issue 15220), and a successor would skip them.
            if inflight.is_none() && pending.is_empty() && progress_revision > state.applied {
                let watermark = progress_revision;
                self.shared.update(|h| {
                    h.last_applied_revision = h.last_applied_revision.max(watermark);
                    h.last_seen_revision = h.last_seen_revision.max(watermark);
                    h.pending_since = None;
                });
            }
            if inflight.is_none()
                && let Some(batch) = next_watch_batch(&pending, split, state.applied, limits)
            {
                inflight = Some(self.apply_watch_batch(peer.clone(), epoch, batch, state));
            }
        }
    }

    fn apply_watch_batch(&self, peer: Client, epoch: i64, batch: WatchBatch, state: &State) -> BatchFuture {
        // The checkpoint carries the counts as they will be once this batch applies; a small
        // drift is corrected by the next resync.
        let checkpoint = self.checkpoint(state, batch.applied_through.max(state.applied), true);
        let bookkeeping = vec![TxnOp::put(keys::checkpoint_key(&self.config.origin), checkpoint.encode(), None)];
        let leases = state.leases.clone();
        let ops = batch.ops.clone();
        let apply = self.apply(peer, epoch, ops, &leases, bookkeeping);
        Box::pin(async move { apply.await.map(|applied| (applied, batch)) })
    }

    fn checkpoint(&self, state: &State, revision: i64, synced: bool) -> Checkpoint {
        Checkpoint {
            owner: self.config.owner_id.clone(),
            revision,
            leases: state.leases.clone(),
            keys: state.keys.clone(),
            synced,
            retiring: state.retiring.clone(),
        }
    }

    fn limits(&self, shards: usize) -> TxnLimits {
        // Room for the checkpoint (about 40 bytes a shard) and the canary.
        TxnLimits::for_peer(self.config.max_txn_ops, self.config.max_txn_bytes, 2, 1024 + 48 * shards)
    }

    /// One batch Txn: applies only while the owner key still has our epoch, so that a deposed
    /// worker can never interleave writes with its successor.
    fn apply(
        &self,
        mut peer: Client,
        epoch: i64,
        ops: Vec<MirrorOp>,
        leases: &[i64],
        bookkeeping: Vec<TxnOp>,
    ) -> impl Future<Output = anyhow::Result<Applied>> + Send + 'static {
        let owner_key = keys::owner_key(&self.config.origin);
        let mut txn_ops: Vec<TxnOp> = ops
            .into_iter()
            .map(|op| match op {
                MirrorOp::Put { key, value, shard } => {
                    TxnOp::put(key, value, Some(PutOptions::new().with_lease(leases[shard])))
                }
                MirrorOp::Delete { key } => TxnOp::delete(key, None),
            })
            .collect();
        txn_ops.extend(bookkeeping);
        let txn = Txn::new()
            .when([Compare::mod_revision(owner_key.as_str(), CompareOp::Equal, epoch)])
            .and_then(txn_ops)
            .or_else([TxnOp::get(owner_key.as_str(), None)]);
        let timeout = self.config.rpc_timeout;
        let shared = self.shared.clone();
        async move {
            let resp = match tokio::time::timeout(timeout, peer.txn(txn)).await {
                Err(_) => anyhow::bail!("peer txn: timed out after {timeout:?}"),
                Ok(r) => r.context("peer txn")?,
            };
            shared.detector_success();
            if resp.succeeded() {
                return Ok(Applied::Yes);
            }
            let by = resp
                .op_responses()
                .into_iter()
                .find_map(|r| match r {
                    TxnOpResponse::Get(get) => {
                        get.kvs().first().and_then(|kv| Owner::decode(kv.value())).map(|o| o.owner)
                    }
                    _ => None,
                })
                .unwrap_or_else(|| "nobody (the owner key was deleted)".to_string());
            Ok(Applied::Fenced(by))
        }
    }

    async fn rpc<T>(&self, what: &str, call: impl Future<Output = Result<T, etcd_client::Error>>) -> anyhow::Result<T> {
        match tokio::time::timeout(self.config.rpc_timeout, call).await {
            Err(_) => Err(anyhow!("{what}: timed out after {:?}", self.config.rpc_timeout)),
            Ok(r) => r.with_context(|| what.to_string()),
        }
    }
}

fn to_kv(kv: etcd_client::KeyValue) -> Kv {
    let lease = kv.lease();
    let (key, value) = kv.into_key_value();
    Kv { key, value, lease }
}

/// The smallest key after `key`.
fn next_key(key: &[u8]) -> Vec<u8> {
    let mut next = key.to_vec();
    next.push(0);
    next
}

fn is_lease_not_found(e: &etcd_client::Error) -> bool {
    e.to_string().contains("lease not found")
}

/// The keepalive task: keeps every lease alive at the interval, feeds the failure detector and
/// the health, and reports lost leases. Dropping it stops the keepalives (never a revoke).
struct Keeper {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Keeper {
    fn spawn(
        peer: EtcdTarget,
        leases: Vec<i64>,
        config: MirrorConfig,
        shared: Arc<Shared>,
        lost: mpsc::Sender<i64>,
        retiring: Vec<i64>,
    ) -> Keeper {
        let task = tokio::spawn(
            async move {
                let mut slots: Vec<Option<(LeaseKeeper, LeaseKeepAliveStream)>> = leases.iter().map(|_| None).collect();
                let mut client: Option<Client> = None;
                let mut reported_lost: Vec<i64> = Vec::new();
                // A round must end before the next is due, or a slow peer would stretch the
                // keepalive interval past the TTL.
                let round_timeout = config.rpc_timeout.min(config.keepalive_interval).max(Duration::from_millis(500));
                loop {
                    let started = tokio::time::Instant::now();
                    if client.is_none() {
                        client = peer.connect().await.ok();
                    }
                    let results: Vec<Result<i64, String>> = match client.as_ref() {
                        None => leases.iter().map(|_| Err("cannot connect to the peer".to_string())).collect(),
                        Some(c) => {
                            let calls = slots
                                .iter_mut()
                                .zip(&leases)
                                .map(|(slot, id)| keep_alive_once(c.clone(), slot, *id, round_timeout));
                            futures::future::join_all(calls).await
                        }
                    };
                    let mut min_ttl: Option<i64> = None;
                    let mut failed = false;
                    for (id, result) in leases.iter().zip(&results) {
                        match result {
                            Ok(ttl) if *ttl > 0 => min_ttl = Some(min_ttl.map_or(*ttl, |m: i64| m.min(*ttl))),
                            Ok(_) => {
                                if !reported_lost.contains(id) && !retiring.contains(id) {
                                    reported_lost.push(*id);
                                    let _ = lost.send(*id).await;
                                }
                            }
                            Err(e) => {
                                debug!(lease = id, error = %e, "keepalive failed");
                                failed = true;
                            }
                        }
                    }
                    if failed || leases.is_empty() && client.is_none() {
                        shared.update(|h| h.keepalive_failures += 1);
                        shared.detector_evaluate();
                    } else {
                        shared.update(|h| {
                            h.keepalive_failures = 0;
                            h.keepalive_last_success = Some(SystemTime::now());
                            h.lease_ttl_reported = min_ttl;
                        });
                        shared.detector_success();
                    }
                    // Keep the interval from the start of the round, so slow answers do not
                    // stretch it; evaluate reachability at least once a second meanwhile.
                    let next = started + config.keepalive_interval;
                    while tokio::time::Instant::now() < next {
                        tokio::time::sleep_until(next.min(tokio::time::Instant::now() + Duration::from_secs(1))).await;
                        shared.detector_evaluate();
                    }
                }
            }
            .in_current_span(),
        );
        Keeper { task }
    }
}

/// One keepalive round trip for one lease: Ok(ttl) (0 or less means the lease is gone).
async fn keep_alive_once(
    mut client: Client,
    slot: &mut Option<(LeaseKeeper, LeaseKeepAliveStream)>,
    id: i64,
    timeout: Duration,
) -> Result<i64, String> {
    let round = async {
        if let Some((keeper, stream)) = slot.as_mut() {
            keeper.keep_alive().await.map_err(|e| e.to_string())?;
            match stream.message().await {
                Ok(Some(resp)) => return Ok(resp.ttl()),
                Ok(None) => return Err("keepalive stream closed".to_string()),
                Err(e) if is_lease_not_found(&e) => return Ok(0),
                Err(e) => return Err(e.to_string()),
            }
        }
        // Opening a stream sends a first keepalive and consumes its answer (an expired lease is
        // an error); one more round trip reads the TTL.
        let (mut keeper, mut stream) = match client.lease_keep_alive(id).await {
            Ok(pair) => pair,
            Err(e) if is_lease_not_found(&e) => return Ok(0),
            Err(e) => return Err(e.to_string()),
        };
        keeper.keep_alive().await.map_err(|e| e.to_string())?;
        let ttl = match stream.message().await {
            Ok(Some(resp)) => resp.ttl(),
            Ok(None) => return Err("keepalive stream closed".to_string()),
            Err(e) if is_lease_not_found(&e) => return Ok(0),
            Err(e) => return Err(e.to_string()),
        };
        *slot = Some((keeper, stream));
        Ok(ttl)
    };
    match tokio::time::timeout(timeout, round).await {
        Ok(Ok(ttl)) => Ok(ttl),
        Ok(Err(e)) => {
            *slot = None;
            Err(e)
        }
        Err(_) => {
            *slot = None;
            Err(format!("keepalive timed out after {timeout:?}"))
        }
    }
}
