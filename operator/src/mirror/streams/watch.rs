//! Watching the origin and applying: the subtree is watched from the revision after the last one
//! the peer holds, and pending revisions are applied whole in coalesced Txns, each raising the
//! small progress record. Next door one Txn is in flight at a time. Across distance several are,
//! and Txns in flight together write disjoint keys: the peer may apply them in any order, each
//! key's writes still land in the origin's order, and each Txn records only the revision the
//! peer held completely when it was sent. Those decisions are made in `pipeline.rs`, without IO;
//! this loop feeds it what the origin sends and the peer answers, and sends what it says.
//!
//! The watch asks etcd to fragment large responses and does not ask for previous values, so a
//! worker resuming behind many large values gets messages it can decode; a revision is applied
//! only once its last fragment has arrived. A watch that answers nothing, not even a progress
//! request, for longer than the stall timeout is treated as broken, never as an idle subtree.
use crate::keys;
use crate::mirror::context::{State, Worker, rescale_counts};
use crate::mirror::health::{MirrorEvent, Phase, ResyncCause};
use crate::mirror::leases::keeper::KeeperSignal;
use crate::mirror::leases::shards::{MAX_DEPTH, outgrown, overfull_shards};
use crate::mirror::plan::{
    Kv, MirrorOp, SyncBatcher, enforce_request_limit, verify_overdue, watch_connections, watch_depth,
};
use crate::mirror::streams::apply::Applied;
use crate::mirror::streams::pipeline::{Dispatch, Gate, Landed, Next, Outcome, Pipeline, Taken};
use crate::mirror::streams::split::{Advance, Split, StepDone};
use crate::mirror::streams::spread::Spread;
use crate::mirror::streams::sync::{RESERVED_REQUEST_BYTES, page_kvs};
use crate::mirror::target::kv;
use crate::mirror::verify::{Walk, advance, learn_page, page_range, read_end, read_on, repairs};
use anyhow::{Context, anyhow};
use etcd_client::{Client, EventType, GetOptions, WatchOptions, WatchResponse, WatchStream};
use std::pin::Pin;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::mpsc;
use tokio::task::{JoinError, JoinSet};
use tokio::time::{Interval, MissedTickBehavior, Sleep};
use tracing::{debug, info, warn};

/// How often a resumed watch asks for progress until it has caught up: etcd answers only once the
/// watcher has sent its history.
const CATCH_UP_NUDGE: Duration = Duration::from_millis(100);

/// Watch responses read in one go before the rest of the loop runs again.
const WATCH_DRAIN_RESPONSES: usize = 1024;

/// The output of `future` if it is ready now, or None. Polled with this task's waker, so that
/// what arrives later wakes the task (`now_or_never` would leave a waker that wakes nobody).
async fn if_ready<F: std::future::Future>(future: F) -> Option<F::Output> {
    tokio::select! {
        biased;
        output = future => Some(output),
        () = std::future::ready(()) => None,
    }
}

/// How a watch ended without an error.
pub(in crate::mirror) enum WatchEnd {
    Shutdown,
    Fenced(String),
    Resync(ResyncCause),
}

/// A batch Txn's answer, with its id in the pipeline.
type Answer = (u64, anyhow::Result<Applied>);

/// What woke the watch loop.
enum Wake {
    Cancelled,
    Keeper(KeeperSignal),
    Answered(Result<Answer, JoinError>),
    Message(Result<Option<WatchResponse>, etcd_client::Error>),
    ConnectionsOpened,
    CountsRecorded(Result<anyhow::Result<Applied>, JoinError>),
    Lingered,
    Nudge,
    VerifyDue,
    SplitStepped(anyhow::Result<StepDone>),
    Tick,
}

/// When the next verification page is compared.
struct Verifying {
    /// The next page waits for the verify interval and for its slot in the origin's budget.
    slot: Pin<Box<Sleep>>,
    due: bool,
    last: Instant,
    /// How late it may get waiting for a quiet moment (`verify_overdue`).
    forced_after: Duration,
}

/// What a running watch holds besides the pipeline's decisions: the stream, the Txns in flight,
/// the timers and the checkpoint's writers beside it.
struct Watching {
    stream: WatchStream,
    pipeline: Pipeline,
    /// The pending revisions' share of the process's memory budget.
    held: crate::mirror::memory::Held,
    txns: JoinSet<Answer>,
    epoch: i64,
    watch_from: i64,
    round_trip: Option<Duration>,
    /// Batch Txns to keep in flight: enough to cover the peer's round trip.
    depth: usize,
    stall_after: Duration,
    /// A fragmented response is incomplete: its last revision may be partial.
    fragment_open: bool,
    last_message: Instant,
    /// With the pending revisions, the subtree outgrew its leases under auth.
    outgrew: bool,
    peak: usize,
    /// A far peer's batch that is not full waits a little for more revisions (`watch_linger`).
    linger: Pin<Box<Sleep>>,
    lingering: bool,
    ticker: Interval,
    nudge: Interval,
    verify: Verifying,
    /// A lease shard being split beside the watch (see `split.rs`).
    splitting: Option<Split>,
    /// Drifted shard counts being recorded beside the watch: inline, each record held the
    /// batches back a round trip, and a far peer caught up at a few Txns a second.
    recording: Option<Recording>,
    /// Txns sent before the split's layout took effect: the split lists its old lease once they
    /// landed.
    split_barrier: u64,
    /// Resumed from the records: the key counts are the checkpoint's, made exact at the first
    /// quiet moment (`recount`).
    recount_due: bool,
}

impl Worker {
    pub(in crate::mirror) async fn watch(
        &self,
        local: &mut Client,
        peer: &mut Client,
        spread: &mut Spread,
        state: &mut State,
        lost_rx: &mut mpsc::Receiver<KeeperSignal>,
        backoff: &mut crate::mirror::backoff::Backoff,
    ) -> anyhow::Result<WatchEnd> {
        let mut w = self.start_watch(local, peer, state).await?;
        loop {
            let end = match self.wake(&mut w, spread, lost_rx).await {
                Wake::Cancelled => return Ok(WatchEnd::Shutdown),
                Wake::Keeper(signal) => self.on_keeper_signal(signal, &mut w, state).await?,
                Wake::Answered(answer) => {
                    let end = self.on_answer(answer, &mut w, state)?;
                    if w.pipeline.landed() > 0 {
                        backoff.reset();
                    }
                    end
                }
                Wake::Message(first) => self.on_messages(first, &mut w, state).await?,
                Wake::ConnectionsOpened => {
                    let connections = spread.len();
                    debug!(connections, "watch batches spread over more connections to the peer");
                    self.shared.update(|h| h.peer_connections = connections);
                    None
                }
                Wake::CountsRecorded(done) => {
                    w.recording = None;
                    counts_recorded(done)?.map(WatchEnd::Fenced)
                }
                Wake::Lingered => {
                    w.lingering = false;
                    None
                }
                Wake::Nudge => {
                    self.rpc("request watch progress", w.stream.request_progress()).await?;
                    None
                }
                Wake::VerifyDue => {
                    w.verify.due = true;
                    None
                }
                Wake::SplitStepped(done) => self.on_split_step(done, &mut w, peer, state)?,
                Wake::Tick => {
                    self.on_tick(&mut w, local, spread).await?;
                    None
                }
            };
            if let Some(end) = end {
                return Ok(end);
            }
            if let Some(end) = self.between_wakes(&mut w, local, peer, spread, state).await? {
                return Ok(end);
            }
        }
    }

    async fn start_watch(&self, local: &mut Client, peer: &mut Client, state: &State) -> anyhow::Result<Watching> {
        let prefix = keys::region_prefix(&self.config.origin);
        let watch_from = state.applied + 1;
        let options =
            WatchOptions::new().with_prefix().with_start_revision(watch_from).with_progress_notify().with_fragment();
        let stream = self
            .rpc("start watch", crate::mirror::target::watcher(local).watch(prefix.as_str(), Some(options)))
            .await?;
        self.shared.update(|h| h.phase = Phase::Watching);
        let epoch = state.ownership.epoch.ok_or_else(|| anyhow!("watch without ownership"))?;
        let round_trip = self.peer_distance(local, peer).await;
        let mut ticker = tokio::time::interval(self.config.progress_interval);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        // Resumed from the records, the watch applies nothing until it has caught up with where
        // it began, and asks for progress often until then (see `catch_up.rs`).
        let mut nudge = tokio::time::interval(CATCH_UP_NUDGE);
        nudge.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let verify = Verifying {
            slot: self.next_verify_slot(),
            due: false,
            last: Instant::now(),
            forced_after: verify_overdue(self.config.verify_interval, round_trip),
        };
        Ok(Watching {
            stream,
            pipeline: Pipeline::new(state.applied, state.peer_may_hold_through),
            held: self.config.memory.share(),
            txns: JoinSet::new(),
            epoch,
            watch_from,
            round_trip,
            depth: watch_depth(round_trip),
            stall_after: (self.config.progress_interval * 4).max(self.config.rpc_timeout),
            fragment_open: false,
            last_message: Instant::now(),
            outgrew: false,
            peak: 0,
            linger: Box::pin(tokio::time::sleep(Duration::ZERO)),
            lingering: false,
            ticker,
            nudge,
            verify,
            splitting: None,
            recording: None,
            split_barrier: 0,
            recount_due: state.counts_estimated,
        })
    }

    /// The next verification page's slot: after the verify interval and in the origin's budget.
    fn next_verify_slot(&self) -> Pin<Box<Sleep>> {
        let verifying = !self.config.verify_interval.is_zero();
        let size = self.config.verify_page_size.max(1) as u64;
        let slot = self.config.verify_budget.reserve(size, Instant::now() + self.config.verify_interval);
        Box::pin(tokio::time::sleep_until(slot.filter(|_| verifying).unwrap_or_else(far_future).into()))
    }

    /// Waits for whatever comes first.
    async fn wake(&self, w: &mut Watching, spread: &mut Spread, lost_rx: &mut mpsc::Receiver<KeeperSignal>) -> Wake {
        // A fragmented response is read to its end even past the bounds: nothing can be applied
        // before it is complete.
        let reading = self.has_room(w) || self.must_complete(w);
        let Watching { stream, pipeline, txns, recording, linger, lingering, nudge, verify, splitting, ticker, .. } = w;
        let split_running = splitting.as_ref().is_some_and(Split::running);
        tokio::select! {
            _ = self.cancel.cancelled() => Wake::Cancelled,
            Some(signal) = lost_rx.recv() => Wake::Keeper(signal),
            Some(answer) = txns.join_next(), if !txns.is_empty() => Wake::Answered(answer),
            first = stream.message(), if reading => Wake::Message(first),
            () = spread.opened(), if spread.opening() => Wake::ConnectionsOpened,
            done = async { recording.as_mut().expect("guarded").await }, if recording.is_some() => Wake::CountsRecorded(done),
            () = linger.as_mut(), if *lingering => Wake::Lingered,
            _ = nudge.tick(), if pipeline.catching_up() => Wake::Nudge,
            () = verify.slot.as_mut(), if !verify.due => Wake::VerifyDue,
            done = async { splitting.as_mut().expect("guarded").step().await }, if split_running => Wake::SplitStepped(done),
            _ = ticker.tick() => Wake::Tick,
        }
    }

    /// Whether the pending revisions are within their bounds, so that the watch is read. A watch
    /// not read is not stalled; a catch-up that reached the bounds applies what it holds.
    fn has_room(&self, w: &mut Watching) -> bool {
        if self.room(w) {
            return true;
        }
        w.last_message = Instant::now();
        if let Some(writes) = w.pipeline.give_up_catch_up() {
            warn!(writes, "the catch-up outgrew the pending bounds before the watch caught up: applying what it holds");
        }
        false
    }

    /// Whether the watch must be read past the pending bounds: a fragmented response is open and
    /// nothing before its partial revision is left to send (a revision larger than the bounds
    /// must still arrive whole). With whole revisions left, they go first and make room.
    fn must_complete(&self, w: &Watching) -> bool {
        w.fragment_open && w.pipeline.undispatched() <= 1
    }

    /// Whether the pending revisions may grow: within this worker's bounds, and the process's
    /// memory budget has room (or this watch holds nothing pending).
    fn room(&self, w: &mut Watching) -> bool {
        w.held.set(w.pipeline.pending_bytes());
        w.pipeline.has_room(self.config.max_pending_ops, self.config.max_pending_bytes) && w.held.may_grow()
    }

    async fn on_keeper_signal(
        &self,
        signal: KeeperSignal,
        w: &mut Watching,
        state: &mut State,
    ) -> anyhow::Result<Option<WatchEnd>> {
        let lost = match signal {
            KeeperSignal::LeaseLost(id) => id,
            KeeperSignal::PeerChanged { from, to } => anyhow::bail!(
                "the peer etcd changed under the mirror (cluster id {from:x} -> {to:x}: restored from a backup, or replaced); resuming from what it records"
            ),
        };
        let Some(shard) = state.leases.iter().position(|id| *id == lost) else { return Ok(None) };
        warn!(lease = lost, shard, "lease lost; its keys are gone from the peer");
        // The sync grants its replacement and records it before moving keys.
        state.leases[shard] = 0;
        self.end_for_resync(w, state, ResyncCause::LeaseLost).await.map(Some)
    }

    /// Ends the watch for a resync once every writer of this session has settled: Txns in flight
    /// may still commit, and under this session's epoch nothing would fence them against the
    /// sync's writes.
    async fn end_for_resync(
        &self,
        w: &mut Watching,
        state: &mut State,
        cause: ResyncCause,
    ) -> anyhow::Result<WatchEnd> {
        while let Some(done) = w.txns.join_next().await {
            let (_, applied) = done.map_err(|e| anyhow!("a peer Txn task ended: {e}"))?;
            applied?;
        }
        if let Some(by) = settle_writers(w.splitting.take(), w.recording.take(), state).await? {
            return Ok(WatchEnd::Fenced(by));
        }
        Ok(WatchEnd::Resync(cause))
    }

    /// A Txn answered: the pipeline takes what has landed, in the order sent.
    fn on_answer(
        &self,
        answer: Result<Answer, JoinError>,
        w: &mut Watching,
        state: &mut State,
    ) -> anyhow::Result<Option<WatchEnd>> {
        let (id, applied) = answer.map_err(|e| anyhow!("a peer Txn task ended: {e}"))?;
        let outcome = match applied {
            Ok(Applied::Yes) => Outcome::Applied,
            Ok(Applied::Fenced(by)) => Outcome::Fenced(by),
            Err(error) => Outcome::Failed(error),
        };
        w.pipeline.answered(id, outcome);
        while let Some(taken) = w.pipeline.take_landed() {
            match taken {
                Taken::Landed(landed) => self.on_landed(landed, w, state),
                Taken::Fenced(by) => return Ok(Some(WatchEnd::Fenced(by))),
                Taken::Failed(error) => return Err(error),
            }
        }
        Ok(None)
    }

    fn on_landed(&self, landed: Landed, w: &Watching, state: &mut State) {
        for (shard, delta) in landed.deltas {
            // Not floored at 0: while a split has not moved its keys' counts yet, a key of the new
            // shard deleted is counted off a shard that does not count it yet (the total stays exact).
            state.keys[shard] += delta;
            if delta != 0 && state.count_drifted(shard) {
                state.drifted.insert(shard);
            }
        }
        if let Some((revision, ops)) = landed.split_started {
            warn!(revision, ops, "a source revision exceeds the peer's Txn limits; applying it in parts");
            self.shared.emit(MirrorEvent::RevisionSplit { revision, ops });
            self.shared.update(|h| h.split_revisions += 1);
        }
        state.applied = state.applied.max(w.pipeline.applied());
        self.shared.progressed();
        let (applied, total) = (state.applied, state.keys.iter().sum::<i64>());
        let oldest_pending = w.pipeline.oldest_pending();
        self.shared.update(|h| {
            h.last_applied_revision = h.last_applied_revision.max(applied);
            h.keys = total;
            h.txns += 1;
            h.ops += landed.ops as u64;
            h.pending_since = oldest_pending;
        });
    }

    /// Reads the responses that have arrived, within the bounds: a watcher that etcd cannot hand
    /// its responses to (128 of them) falls behind, and etcd then serves it from history at
    /// 1,000 revisions per 100 ms until it is back at the head.
    async fn on_messages(
        &self,
        first: Result<Option<WatchResponse>, etcd_client::Error>,
        w: &mut Watching,
        state: &mut State,
    ) -> anyhow::Result<Option<WatchEnd>> {
        let mut message = first;
        let (mut read, mut seen, mut caught_up) = (0, 0, false);
        loop {
            read += 1;
            let Some(response) = message.context("watching the origin")? else {
                anyhow::bail!("the origin closed the watch");
            };
            w.last_message = Instant::now();
            if response.canceled() {
                if response.compact_revision() > 0 {
                    warn!(
                        compacted = response.compact_revision(),
                        needed = state.applied + 1,
                        "origin compacted past the mirror's revision"
                    );
                    return self.end_for_resync(w, state, ResyncCause::Compacted).await.map(Some);
                }
                anyhow::bail!("the origin cancelled the watch: {}", response.cancel_reason());
            }
            let (newest, ended_catch_up) = self.take_response(&response, w, state);
            seen = seen.max(newest);
            caught_up |= ended_catch_up;
            let room = self.room(w);
            if read >= WATCH_DRAIN_RESPONSES || !(room || self.must_complete(w)) {
                break;
            }
            match if_ready(w.stream.message()).await {
                Some(next) => message = next,
                None => break,
            }
        }
        if caught_up {
            let (writes, keys) = w.pipeline.coalesced();
            info!(writes, keys, "resumed watch caught up; applying each key's newest write");
        }
        // Under auth, keys arriving faster than splits can follow would pile onto leases whose
        // every put then checks every key on them (see `between_wakes`).
        let pending_keys = w.pipeline.pending_keys();
        if state.auth_binds && pending_keys > 0 {
            let projected = state.keys.iter().sum::<i64>() + pending_keys;
            w.outgrew = outgrown(state.layout.len(), projected.max(0) as u64, state.lease_cap);
        }
        let oldest_pending = w.pipeline.oldest_pending();
        self.shared.update(|h| {
            h.last_seen_revision = h.last_seen_revision.max(seen);
            h.pending_since = oldest_pending;
        });
        Ok(None)
    }

    /// Gives one watch response to the pipeline. Returns its newest revision (0 for a progress
    /// notification) and whether it ended a catch-up.
    fn take_response(&self, response: &WatchResponse, w: &mut Watching, state: &mut State) -> (i64, bool) {
        w.fragment_open = response.0.fragment;
        let header_revision = response.header().map(|h| h.revision()).unwrap_or(0);
        if response.created() {
            w.pipeline.started(header_revision);
        }
        if response.events().is_empty() {
            // A progress notification: every event up to this revision was sent.
            let caught_up = !response.created() && w.pipeline.progress_notified(header_revision);
            return (0, caught_up);
        }
        let received = SystemTime::now();
        let (mut newest, mut found, mut fixed) = (0, Vec::new(), Vec::new());
        for event in response.events() {
            let Some(kv) = event.kv() else { continue };
            newest = kv.mod_revision();
            let shard = state.layout.shard_of(kv.key());
            let (op, delta) = match event.event_type() {
                // Version 1: the key was created (or re-created) at this revision.
                EventType::Put => (
                    MirrorOp::Put { key: kv.key().to_vec(), value: kv.value().to_vec(), shard },
                    i64::from(kv.version() == 1),
                ),
                EventType::Delete => (MirrorOp::Delete { key: kv.key().to_vec() }, -1),
            };
            let (op, too_large) = enforce_request_limit(op, self.config.max_request_bytes, RESERVED_REQUEST_BYTES);
            match too_large {
                Some(o) => found.push(o),
                None if state.oversized.contains_key(String::from_utf8_lossy(kv.key()).as_ref()) => {
                    fixed.push(String::from_utf8_lossy(kv.key()).into_owned());
                }
                None => {}
            }
            w.pipeline.receive(newest, op, shard, delta, received);
        }
        let caught_up = !w.fragment_open && w.pipeline.delivered_through(newest);
        if !found.is_empty() || !fixed.is_empty() {
            self.report_oversized(state, found, fixed);
        }
        (newest, caught_up)
    }

    fn on_split_step(
        &self,
        done: anyhow::Result<StepDone>,
        w: &mut Watching,
        peer: &Client,
        state: &mut State,
    ) -> anyhow::Result<Option<WatchEnd>> {
        let task = w.splitting.as_mut().expect("a step of a running split");
        match self.advance_split(task, done?, peer, state, w.epoch)? {
            (Advance::Fenced(by), _) => return Ok(Some(WatchEnd::Fenced(by))),
            (Advance::Done, _) => w.splitting = None,
            (Advance::Going, true) => {
                // Revisions already sent keep their leases; the split lists the old lease once
                // they landed.
                w.pipeline.retarget(&state.layout);
                w.split_barrier = w.pipeline.sent();
            }
            (Advance::Going, false) => {}
        }
        Ok(None)
    }

    async fn on_tick(&self, w: &mut Watching, local: &mut Client, spread: &mut Spread) -> anyhow::Result<()> {
        if spread.close_idle() {
            debug!("the watch's extra connections to the peer closed: unused for a while");
            self.shared.update(|h| h.peer_connections = 1);
        }
        // Not reading (the pending bounds are reached) is not a stalled watch.
        let room = self.room(w);
        if room && w.last_message.elapsed() > w.stall_after {
            // etcd (3.6 at least) answers no progress request while a watcher starts past the
            // store's revision: an origin etcd nobody wrote to since the watch began is silent,
            // not stalled.
            let now = self.rpc("read the origin's revision", local.status()).await?;
            let revision = now.header().map_or(i64::MAX, |h| h.revision());
            if revision >= w.watch_from {
                anyhow::bail!(
                    "the origin's watch stalled: no event and no answer to progress requests for {:?}",
                    w.last_message.elapsed()
                );
            }
            w.last_message = Instant::now();
        }
        // Bounded, so that a stalled watch stream cannot stall the loop.
        self.rpc("request watch progress", w.stream.request_progress()).await?;
        Ok(())
    }

    /// What runs after every wake: the idle watermark, a verification page, the checkpoint's
    /// writers, a resync when the subtree outgrew its leases, and the next batches.
    async fn between_wakes(
        &self,
        w: &mut Watching,
        local: &Client,
        peer: &Client,
        spread: &mut Spread,
        state: &mut State,
    ) -> anyhow::Result<Option<WatchEnd>> {
        // Idle and told that nothing is missing up to a revision: the reported watermark
        // advances, so an idle subtree does not look stale. It is never recorded nor resumed
        // from: etcd before 3.4.24 and 3.5.8 can send a progress notification ahead of events
        // still on their way (etcd issue 15220), and a successor would skip them.
        if let Some(watermark) = w.pipeline.idle_watermark() {
            self.shared.update(|h| {
                h.last_applied_revision = h.last_applied_revision.max(watermark);
                h.last_seen_revision = h.last_seen_revision.max(watermark);
                h.pending_since = None;
            });
        }
        let quiet = w.pipeline.quiet() && !w.pipeline.catching_up() && !w.pipeline.split_open();
        if w.recount_due && quiet && w.splitting.is_none() {
            w.recount_due = false;
            self.recount(local, state, w.pipeline.applied()).await;
        }
        let verify_now = verify_now(w);
        if verify_now && !w.pipeline.in_flight() {
            w.verify.due = false;
            w.verify.last = Instant::now();
            if let Some(by) = self.verify_page(local, peer, state, w.epoch).await? {
                return Ok(Some(WatchEnd::Fenced(by)));
            }
            w.verify.slot = self.next_verify_slot();
        }
        self.drive_checkpoint_writers(w, peer, state);
        // Under auth, keys arriving faster than splits can follow would pile onto leases whose
        // every put then checks every key on them: a resync lays the leases out for the subtree
        // as it is now, and fills each at once.
        if w.outgrew {
            info!(
                shards = state.layout.len(),
                keys = state.keys.iter().sum::<i64>() + w.pipeline.pending_keys(),
                "the subtree outgrew its leases; resyncing to a new layout"
            );
            return self.end_for_resync(w, state, ResyncCause::Reshard).await.map(Some);
        }
        self.send_batches(w, peer, spread, state, verify_now);
        Ok(None)
    }

    /// Makes the key counts of a session resumed from the records exact. The checkpoint's counts
    /// lag the peer's by up to the drift a shard may have before it is recorded (an eighth of the
    /// cap), and a catch-up counts again what the predecessor had landed; at a quiet moment the
    /// peer holds exactly the origin's subtree at the applied revision, less the values left
    /// out, so the origin's count there is the peer's. A count that fails leaves the estimates.
    async fn recount(&self, local: &Client, state: &mut State, applied: i64) {
        let prefix = keys::region_prefix(&self.config.origin);
        let options = GetOptions::new().with_prefix().with_count_only().with_revision(applied);
        let counted = match self.rpc("count the origin's keys", kv(local).get(prefix.as_str(), Some(options))).await {
            Ok(response) => response.count(),
            Err(e) => {
                debug!(error = %format!("{e:#}"), "the origin's keys could not be counted; the counts stay the checkpoint's");
                return;
            }
        };
        state.counts_estimated = false;
        let exact = (counted - state.oversized.len() as i64).max(0);
        let estimated = state.keys.iter().sum::<i64>();
        if exact == estimated {
            return;
        }
        debug!(estimated, exact, "the resumed session's key counts made exact");
        rescale_counts(&mut state.keys, exact);
        for shard in 0..state.keys.len() {
            if state.count_drifted(shard) {
                state.drifted.insert(shard);
            }
        }
        self.shared.update(|h| h.keys = exact);
    }

    /// A shard past the cap splits, online, beside the watch; otherwise counts that drifted from
    /// the checkpoint's are recorded, so that a successor starts from them. One checkpoint
    /// writer at a time: a split waits for a record in flight, and the reverse.
    fn drive_checkpoint_writers(&self, w: &mut Watching, peer: &Client, state: &mut State) {
        if w.splitting.is_none() && !w.pipeline.split_open() && w.recording.is_none() {
            match self.shard_to_split(state) {
                Some(shard) => w.splitting = Some(self.start_split(peer, shard)),
                None if !state.drifted.is_empty() || state.left_out_unrecorded => {
                    w.recording = Some(self.record_drifted_counts(peer, state, w.epoch))
                }
                None => {}
            }
        }
        if let Some(task) = w.splitting.as_mut() {
            let sent_before_it_landed = w.pipeline.landed() < w.split_barrier;
            self.drive_split(task, peer, state, w.epoch, sent_before_it_landed);
        }
    }

    /// Sends what the pipeline says may go. Renewals first: while they fail, one Txn at a time
    /// (the progress tick looks again). Nothing new while a verification is due.
    fn send_batches(&self, w: &mut Watching, peer: &Client, spread: &mut Spread, state: &State, verify_now: bool) {
        let gate = Gate {
            depth: w.depth,
            limits: self.limits(state),
            held: verify_now,
            last_partial: w.fragment_open,
            renewals_failing: self.renewals_failing(),
            linger: self.config.watch_linger,
            now: SystemTime::now(),
        };
        loop {
            match w.pipeline.next(gate) {
                Next::Send(dispatch) => self.send(w, spread.next(), dispatch, state),
                Next::Linger(wait) => {
                    w.linger.as_mut().reset(tokio::time::Instant::now() + wait);
                    w.lingering = true;
                    break;
                }
                Next::Wait => break,
            }
        }
        // Across distance, Txns in flight that outgrow the connections open get more.
        let wanted = watch_connections(w.round_trip, w.pipeline.running(), w.depth, spread.len(), self.spread_cap());
        spread.want(wanted, &self.peer, self.config.rpc_timeout);
        if let Some(flush) = w.pipeline.flush(verify_now) {
            self.send(w, peer, flush, state);
        }
    }

    /// Sends one Txn in its own task, so that several can be in flight.
    fn send(&self, w: &mut Watching, peer: &Client, dispatch: Dispatch, state: &State) {
        tracing::trace!(
            ops = dispatch.ops.len(),
            running = w.pipeline.running(),
            depth = w.depth,
            revisions = ?dispatch.revisions,
            "watch batch sent"
        );
        // The keys the peer holds at the recorded revision: those landed, and what the revisions
        // not landed up to it add.
        let keys = state.keys.iter().sum::<i64>() + w.pipeline.pending_keys_through(dispatch.progress);
        let bookkeeping = vec![self.raise_progress_op(dispatch.progress, dispatch.sent_through, keys)];
        let apply = self.apply(peer, w.epoch, dispatch.ops, &state.leases, bookkeeping);
        let id = dispatch.id;
        w.txns.spawn(async move { (id, apply.await) });
        if w.pipeline.running() > w.peak {
            w.peak = w.pipeline.running();
            let peak = w.peak;
            self.shared.update(|h| h.batches_in_flight_peak = h.batches_in_flight_peak.max(peak));
        }
    }

    /// The first shard past the cap that can still split. One that cannot (its keys' hashes
    /// agree on every bit a split could use) is reported, never split.
    fn shard_to_split(&self, state: &State) -> Option<usize> {
        let cap = state.lease_cap.max(1);
        let mut stuck = None;
        for shard in overfull_shards(&state.keys, cap) {
            if state.layout.depth(shard) < MAX_DEPTH {
                return Some(shard);
            }
            stuck.get_or_insert(shard);
        }
        let problem = stuck.map(|shard| {
            format!(
                "lease shard {shard} holds {} keys, more than the cap of {cap}, and cannot split further (its keys share {MAX_DEPTH} hash bits)",
                state.keys[shard]
            )
        });
        self.shared.update(|h| h.layout_problem = problem);
        None
    }

    /// Records the counts of the shards that drifted (`State::count_drifted`), in the parts
    /// holding them, in a task beside the watch (its Txn compares the epoch like every other).
    fn record_drifted_counts(&self, peer: &Client, state: &mut State, epoch: i64) -> Recording {
        let mut recorded = state.recorded_keys.clone();
        recorded.resize(state.keys.len(), 0);
        for shard in &state.drifted {
            recorded[*shard] = state.keys[*shard];
        }
        debug!(shards = state.drifted.len(), "recording shard counts that drifted");
        let record = self.checkpoint_for(state, &state.layout, &state.leases, &recorded, state.applied, true);
        let write = self.checkpoint_write(state, &record);
        tokio::spawn(self.apply_checkpoint(peer, epoch, write, Vec::new()))
    }

    /// The origin's keys of one verification page from `from`, pinned at `revision`: reads each
    /// bounded (`verify::read_end`), read on while they come back short (`verify::read_on`), so
    /// that a page holds its size in keys. Returns the keys, whether the origin holds more before
    /// the last read's end, and that end.
    async fn origin_page(
        &self,
        local: &Client,
        walk: &mut Walk,
        from: &[u8],
        subtree_end: &[u8],
        revision: i64,
        largest: &mut usize,
    ) -> anyhow::Result<(Vec<Kv>, bool, Vec<u8>)> {
        let size = self.config.verify_page_size.max(1);
        let (mut kvs, mut cursor) = (Vec::new(), from.to_vec());
        loop {
            let end = read_end(walk, &cursor, subtree_end);
            let wanted = size - kvs.len() as i64;
            let page = self.page_of(wanted, local, &cursor, &end, Some(revision), largest).await?;
            let more = page.more();
            let read: Vec<_> = page_kvs(page).collect();
            let first_last = read.first().zip(read.last()).map(|(f, l)| (f.key.as_slice(), l.key.as_slice()));
            learn_page(walk, &cursor, first_last, more, &end, subtree_end);
            kvs.extend(read);
            if !read_on(kvs.len(), size, more, &end, subtree_end) {
                return Ok((kvs, more, end));
            }
            cursor = end;
        }
    }

    /// Compares one page of the peer's copy with the origin at the applied revision and repairs
    /// what differs. Returns who fenced us, if someone did.
    async fn verify_page(
        &self,
        local: &Client,
        peer: &Client,
        state: &mut State,
        epoch: i64,
    ) -> anyhow::Result<Option<String>> {
        let prefix = keys::region_prefix(&self.config.origin);
        let subtree_end = keys::prefix_range_end(prefix.as_bytes());
        let from = state.walk.cursor.clone().unwrap_or_else(|| prefix.clone().into_bytes());
        let mut largest = 0;
        let size = self.config.verify_page_size;
        let (origin, origin_more, read_end) =
            match self.origin_page(local, &mut state.walk, &from, &subtree_end, state.applied, &mut largest).await {
                Ok(page) => page,
                // Compacted past the applied revision: the next page starts a new pass later.
                Err(e) if format!("{e:#}").contains("compacted") => {
                    state.walk.restart();
                    return Ok(None);
                }
                Err(e) => return Err(e),
            };
        let range_end = match origin.last() {
            Some(last) if origin_more => {
                let mut end = last.key.clone();
                end.push(0);
                end
            }
            _ => read_end.clone(),
        };
        let peer_page = self.page_of(size, peer, &from, &range_end, None, &mut largest).await?;
        self.shared.detector_success();
        let peer_more = peer_page.more();
        let peer_kvs: Vec<_> = page_kvs(peer_page).collect();
        let peer_last = peer_kvs.last().map(|kv| kv.key.clone());
        let (end, origin) = page_range(origin, origin_more, peer_last.as_deref(), peer_more, &read_end);
        let compared = origin.len() as u64;
        let layout = state.layout.clone();
        let leases = state.leases.clone();
        let ops = repairs(origin, peer_kvs, |k| layout.shard_of(k), |s| leases[s], &state.oversized);
        let repaired = ops.len();
        if repaired > 0 {
            let first_key = String::from_utf8_lossy(ops[0].key()).into_owned();
            warn!(keys = repaired, first = %first_key, "the peer's copy differs from the origin; repairing");
            // Through the same limits as every other write: Txn size, and values too large.
            let mut batcher = SyncBatcher::new(self.limits(state));
            let mut batches = Vec::new();
            let mut too_large = Vec::new();
            for op in ops {
                let (op, oversized) = enforce_request_limit(op, self.config.max_request_bytes, RESERVED_REQUEST_BYTES);
                too_large.extend(oversized);
                batches.extend(batcher.push(op));
            }
            batches.extend(batcher.take());
            if !too_large.is_empty() {
                self.report_oversized(state, too_large, Vec::new());
            }
            for batch in batches {
                if let Applied::Fenced(by) = self.apply(peer, epoch, batch, &leases, Vec::new()).await? {
                    return Ok(Some(by));
                }
            }
            self.shared.emit(MirrorEvent::DriftRepaired { keys: repaired, first_key });
        }
        let pass_done = advance(&mut state.walk, &end, &subtree_end, repaired);
        let drift_in_pass = state.walk.repaired_this_pass > 0;
        self.shared.update(|h| {
            h.drift_repaired_keys += repaired as u64;
            h.verified_keys += compared;
            if repaired > 0 {
                h.drift_detected = true;
            }
            if pass_done {
                h.verify_passes += 1;
                h.drift_detected = drift_in_pass;
            }
        });
        if pass_done {
            state.walk.repaired_this_pass = 0;
        }
        Ok(None)
    }
}

/// A record of drifted shard counts in flight.
type Recording = tokio::task::JoinHandle<anyhow::Result<Applied>>;

/// What a record of drifted counts came to: who fenced it, if someone did; an error ends the
/// session (a Txn that timed out may still land: only a new epoch fences it).
fn counts_recorded(done: Result<anyhow::Result<Applied>, tokio::task::JoinError>) -> anyhow::Result<Option<String>> {
    match done.map_err(|e| anyhow!("recording shard counts: {e}"))?? {
        Applied::Yes => Ok(None),
        Applied::Fenced(by) => Ok(Some(by)),
    }
}

/// Lets the checkpoint's writers (a split's step, a record of counts) land before a resync
/// writes a new layout in the same epoch. Who fenced one, if someone did; an error when an
/// outcome is unknown, so that the session ends instead of racing a late write.
async fn settle_writers(
    splitting: Option<Split>,
    recording: Option<Recording>,
    state: &mut State,
) -> anyhow::Result<Option<String>> {
    let fenced = match recording {
        Some(task) => counts_recorded(task.await)?,
        None => None,
    };
    let split_fenced = settle_split(splitting, state).await?;
    Ok(fenced.or(split_fenced))
}

/// Lets a split's step finish before a resync: a move Txn may still land. Which parts of the
/// checkpoint it wrote is not tracked, so how the peer stores the checkpoint is not known any
/// more: the sync's record is then written in full.
async fn settle_split(splitting: Option<Split>, state: &mut State) -> anyhow::Result<Option<String>> {
    let Some(task) = splitting else { return Ok(None) };
    let fenced = task.settle().await;
    state.stored_checkpoint = crate::mirror::records::checkpoint::Stored::Unknown;
    fenced
}

/// Between batches the peer holds exactly the origin's subtree at the applied revision: the
/// moment to compare a page. Not between the parts of a split revision either: the peer then
/// holds part of one. Nor while a split moves keys: a key between two leases is not drift. It
/// holds back new batches for about two round trips: across distance it waits for a quiet
/// moment, and is forced only when long overdue.
fn verify_now(w: &Watching) -> bool {
    w.verify.due
        && (w.pipeline.quiet() || w.verify.last.elapsed() >= w.verify.forced_after)
        && !w.fragment_open
        && !w.pipeline.split_open()
        && w.splitting.is_none()
        && !w.pipeline.catching_up()
}

/// A time that never comes: the verification slot of a worker that does not verify.
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(100 * 365 * 86_400)
}
