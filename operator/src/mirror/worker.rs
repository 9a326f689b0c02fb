//! The mirror worker for one (origin region, peer region) pair: its life across sessions.
//!
//! A session (`session.rs`) connects, decides from the peer's records whether this worker owns
//! the mirror and where to resume, takes a new fencing epoch, syncs when it must (`sync.rs`),
//! then watches the origin and applies whole revisions (`watch.rs`); the leases are kept alive by
//! `keepalive.rs` across sessions. An error ends the session; the worker backs off (the backoff
//! only resets once something was applied) and starts another. A fenced worker stands by, keeping
//! the leases alive until a successor shows itself, and takes over again if none does.
use crate::mirror::backoff::Backoff;
use crate::mirror::context::{State, Worker};
use crate::mirror::detector::ReachabilityDetector;
use crate::mirror::health::{MirrorEvent, PeerHealth, Phase, Refusal};
use crate::mirror::leases::keeper::{Keeper, KeeperSignal, most_ttl_left};
use crate::mirror::problem::{Classified, Problem};
use crate::mirror::records::resume::{OwnerDecision, decide_ownership};
use crate::mirror::session::SessionEnd;
use crate::mirror::shared::Shared;
use crate::mirror::target::ConnectError;
use crate::mirror::{EtcdTarget, MirrorConfig};
use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span, warn};

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
    /// until the leases lapse or a successor adopts them. Ownership is released on the peer, so
    /// that a worker of the same object standing by takes over at once.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        let _ = (&mut self.task).await;
    }

    /// Stops the worker as a crash would: no further request of any kind.
    pub fn abort(self) {
        self.task.abort();
    }

    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

/// A handle dropped without a stop (an aborted reconcile, say) stops its worker as `shutdown`
/// does, instead of leaving it running where nobody sees or stops it.
impl Drop for MirrorHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
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
    let (signals, lost_rx) = mpsc::channel::<KeeperSignal>(64);
    let keeper = span.in_scope(|| Keeper::spawn(peer.clone(), &config, shared.clone(), signals));
    let worker = Worker {
        config,
        local,
        peer,
        shared,
        cancel: cancel.clone(),
        keeper,
        nearest: Default::default(),
        last_sync_pace: Default::default(),
    };
    // A panic ends the worker as a crash would (no release, leases left to the TTL), but said:
    // counted, in its health, so that the controller starts it again and status names it.
    let (supervision, said) = (worker.config.supervision.clone(), worker.shared.clone());
    let task = tokio::spawn(
        async move {
            use futures::FutureExt;
            if let Err(panic) = std::panic::AssertUnwindSafe(worker.run(lost_rx)).catch_unwind().await {
                let what = crate::supervise::panic_message(panic.as_ref());
                supervision.panicked("worker", &what);
                said.update(|h| {
                    h.phase = Phase::Stopped;
                    h.last_error = Some(format!("the worker panicked ({what}); it is started again"));
                    h.last_error_reason = Some("WorkerPanicked");
                    h.last_error_time = Some(SystemTime::now());
                });
            }
        }
        .instrument(span),
    );
    MirrorHandle { health: health_rx, cancel, task }
}

/// The least a worker waits after a session the peer refused the credentials or a permission of.
const REFUSED_SESSION_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// How long a clean stop waits for the peer to take the release.
const RELEASE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// How standing by ended.
enum StandBy {
    Resume,
    Shutdown,
    Retired(String),
}

impl Worker {
    async fn run(self, mut lost_rx: mpsc::Receiver<KeeperSignal>) {
        let mut state = State::default();
        let mut backoff = Backoff::new(self.config.backoff_base, self.config.backoff_cap);
        loop {
            let outcome = tokio::select! {
                _ = self.cancel.cancelled() => Ok(SessionEnd::Shutdown),
                r = self.session(&mut state, &mut lost_rx, &mut backoff) => r,
            };
            // A turn at a sync that a session took and did not use goes to the origin's next worker.
            state.sync_turn = None;
            match outcome {
                Ok(SessionEnd::Shutdown) => break,
                Ok(SessionEnd::Retired(by)) => {
                    self.retired(&by).await;
                    break;
                }
                Ok(SessionEnd::Refused(refusal)) => {
                    if !self.refused(refusal).await {
                        break;
                    }
                }
                Ok(SessionEnd::Held(held)) => {
                    if !self.held(held).await {
                        break;
                    }
                }
                Ok(SessionEnd::Fenced(by)) => {
                    warn!(%by, "fenced: another worker owns this mirror now; this one stops writing and stands by");
                    self.shared.update(|h| {
                        h.phase = Phase::Fenced;
                        h.synced = false;
                    });
                    self.shared.emit(MirrorEvent::Fenced { by });
                    match self.stand_by(&mut state).await {
                        StandBy::Shutdown => break,
                        StandBy::Retired(by) => {
                            self.retired(&by).await;
                            break;
                        }
                        StandBy::Resume => {
                            state.ownership.take_over = true;
                            backoff.reset();
                        }
                    }
                }
                Err(error) => {
                    let message = format!("{error:#}");
                    let classified = self.classify_failure(&error);
                    warn!(error = %message, reason = classified.problem.reason(), "mirror session failed; backing off");
                    if message.contains("too many operations in txn request") {
                        // The peer's --max-txn-ops is lower than ours: halve until it fits.
                        let cap = state.txn_ops_cap.unwrap_or(self.config.max_txn_ops) / 2;
                        state.txn_ops_cap = Some(cap.max(4));
                        warn!(max_ops = cap.max(4), "the peer takes fewer operations per Txn; batching smaller");
                    }
                    let now = SystemTime::now();
                    let (reason, text) = (classified.problem.reason(), classified.message.clone());
                    self.shared.emit(MirrorEvent::SessionFailed { reason, message: text.clone() });
                    self.shared.update(|h| {
                        h.phase = Phase::Backoff;
                        h.last_error = Some(text);
                        h.last_error_reason = Some(reason);
                        h.last_error_time = Some(now);
                        h.session_failures += 1;
                        // Nothing is confirmed applied from here on: the lag keeps growing.
                        h.pending_since = h.pending_since.or(Some(now));
                    });
                    let mut delay = backoff.next_delay(rand::random::<f64>() * 0.5 + 0.5);
                    // Refused credentials stay refused until someone changes them, and every
                    // attempt costs the peer an authentication (a bcrypt check).
                    if matches!(classified.problem, Problem::AuthenticationFailed | Problem::PermissionDenied) {
                        delay = delay.max(REFUSED_SESSION_WAIT);
                    }
                    tokio::select! {
                        _ = self.cancel.cancelled() => break,
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
        // No revoke: the leases lapse on their own unless a successor adopts them (the keeper
        // stops with the worker).
        self.release(&state).await;
        self.shared.phase(Phase::Stopped);
    }

    /// A clean stop marks the owner record released (if it is still this worker's), so that a
    /// worker of the same object standing by takes over at once rather than when the leases run
    /// low. Bounded: a peer that does not answer is left to the leases.
    async fn release(&self, state: &State) {
        let Some(epoch) = state.ownership.epoch else { return };
        let key = crate::keys::owner_key(&self.config.origin);
        let owner = crate::mirror::records::checkpoint::Owner {
            owner: self.config.owner_id.clone(),
            acquired_at: k8s_openapi::jiff::Timestamp::now().to_string(),
            generation: state.ownership.generation,
            released: true,
            object: self.config.object.clone(),
            origin_cluster_id: state.origin_cluster_id,
            peer: self.config.peer.clone(),
            ..Default::default()
        };
        let release = async {
            let peer = self.peer.connect().await.ok()?;
            let still_ours = Compare::mod_revision(key.as_str(), CompareOp::Equal, epoch);
            let txn = Txn::new().when([still_ours]).and_then([TxnOp::put(key.as_str(), owner.encode(), None)]);
            crate::mirror::target::kv(&peer).txn(txn).await.ok().map(|r| r.succeeded())
        };
        match tokio::time::timeout(self.config.rpc_timeout.min(RELEASE_TIMEOUT), release).await {
            Ok(Some(true)) => info!("ownership released on the peer"),
            Ok(Some(false)) => {}
            _ => warn!("could not release ownership on the peer; a successor takes over when the leases run low"),
        }
    }

    /// The claim on the peer is refused: reports it (an event when it is new), keeps nothing
    /// alive, and looks again after a keepalive interval. False when the worker is stopped
    /// meanwhile.
    async fn refused(&self, refusal: Refusal) -> bool {
        self.keeper.keep(&[], &[]);
        let new = self.shared.health.borrow().refusal.as_ref() != Some(&refusal);
        if new {
            warn!(reason = refusal.reason, message = %refusal.message, "the claim on the peer is refused; nothing is written");
            self.shared.emit(MirrorEvent::Refused(refusal.clone()));
        }
        self.shared.update(|h| {
            h.phase = Phase::Refused;
            h.synced = false;
            h.refusal = Some(refusal);
        });
        tokio::select! {
            _ = self.cancel.cancelled() => false,
            _ = tokio::time::sleep(self.config.keepalive_interval) => true,
        }
    }

    /// What comes next waits for a person: reports it (an event when it is new), keeps renewing
    /// the leases the session kept, writes nothing, and looks again after a keepalive interval.
    /// False when the worker is stopped meanwhile.
    async fn held(&self, held: Refusal) -> bool {
        let new = self.shared.health.borrow().refusal.as_ref() != Some(&held);
        if new {
            warn!(reason = held.reason, message = %held.message, "held for a person; the copy is kept alive");
            self.shared.emit(MirrorEvent::Refused(held.clone()));
        }
        self.shared.update(|h| {
            h.phase = Phase::Held;
            h.refusal = Some(held);
        });
        tokio::select! {
            _ = self.cancel.cancelled() => false,
            _ = tokio::time::sleep(self.config.keepalive_interval) => true,
        }
    }

    /// Classifies a failed session: a connection that failed says which etcd; any other failure
    /// is the origin's when its context says so, the peer's otherwise (only the peer is written).
    fn classify_failure(&self, error: &anyhow::Error) -> Classified {
        if let Some(connect) = error.chain().find_map(|e| e.downcast_ref::<ConnectError>()) {
            return connect.classified();
        }
        let local = error.chain().any(|e| {
            let words = e.to_string();
            words.contains("origin") || words.contains("local etcd")
        });
        let target = if local { &self.local } else { &self.peer };
        target.classify(error.as_ref(), None)
    }

    /// The mirror was retired from the peer after this worker owned it (its RegionPeering was
    /// deleted): it stops renewing and never takes the mirror back. Waits for its stop.
    async fn retired(&self, by: &str) {
        warn!(%by, "the mirror was retired from the peer (its RegionPeering deleted): this worker stops for good");
        self.keeper.keep(&[], &[]);
        self.shared.update(|h| {
            h.phase = Phase::Retired;
            h.synced = false;
        });
        self.cancel.cancelled().await;
    }

    /// Fenced: keeps the leases alive until a successor shows itself (it writes the progress
    /// record under its own name when it takes over), then lets them go. Resumes when the owner
    /// record turns out to be a restored old one, when it is gone or released (the successor
    /// stopped cleanly), when nobody takes over within two TTLs, or when the successor's leases
    /// have gone unrenewed for half a TTL (it died or lost the peer): never after they lapsed.
    async fn stand_by(&self, state: &mut State) -> StandBy {
        let started = Instant::now();
        let ttl = self.config.lease_ttl_seconds.max(1);
        let patience = std::time::Duration::from_secs(2 * ttl as u64);
        // Watching a successor's leases, look often enough to take over with a third of the
        // TTL still left.
        let watching = self.config.keepalive_interval.min(std::time::Duration::from_secs(ttl as u64) / 6);
        let mut successor_seen = false;
        let mut first = true;
        loop {
            // The first look is at once: a peer wiped or restored to before any owner is taken
            // back now, not an interval later.
            if !first {
                let interval = if successor_seen { watching } else { self.config.keepalive_interval };
                tokio::select! {
                    _ = self.cancel.cancelled() => return StandBy::Shutdown,
                    _ = tokio::time::sleep(interval) => {}
                }
            }
            first = false;
            let Ok(peer) = self.peer.connect().await else { continue };
            let Ok(records) = self.read_records(&peer).await else { continue };
            let decision = decide_ownership(&self.claimant(), &state.ownership, records.owner.as_ref());
            match decision {
                OwnerDecision::Take { .. } => {
                    info!("the owner record is gone, released, or an old one came back; resuming");
                    return StandBy::Resume;
                }
                // Another object's claim: the session looks at it (and refuses it while it lives).
                OwnerDecision::Contested { .. } => return StandBy::Resume,
                OwnerDecision::Retired { by } => return StandBy::Retired(by),
                OwnerDecision::Fenced { .. } => {}
            }
            let progress_owner = records.progress.as_ref().map(|p| p.owner.as_str());
            if !successor_seen && progress_owner.is_some_and(|o| o != self.config.owner_id) {
                info!(successor = progress_owner.unwrap_or_default(), "a successor took over; keepalives stop here");
                successor_seen = true;
                self.keeper.keep(&[], &[]);
            }
            if !successor_seen && started.elapsed() > patience {
                warn!(waited = ?started.elapsed(), "nobody took over this mirror; resuming");
                return StandBy::Resume;
            }
            if successor_seen {
                let leases: Vec<i64> = records.checkpoint.as_ref().map(|c| c.leases.clone()).unwrap_or_default();
                let left = most_ttl_left(&peer, &leases, self.config.rpc_timeout).await;
                if !leases.is_empty() && left.is_some_and(|left| left * 2 <= ttl) {
                    warn!(
                        ttl_left = left.unwrap_or_default(),
                        "the successor stopped renewing the mirror's leases; resuming before they lapse"
                    );
                    return StandBy::Resume;
                }
            }
        }
    }
}
