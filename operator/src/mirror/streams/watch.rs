//! Watching the origin and applying: the subtree is watched from the revision after the last one
//! the peer holds, and pending revisions are applied whole in coalesced Txns, each raising the
//! small progress record. Next door one Txn is in flight at a time. Across distance several are,
//! and Txns in flight together write disjoint keys: the peer may apply them in any order, each
//! key's writes still land in the origin's order, and each Txn records only the revision the
//! peer held completely when it was sent.
//!
//! The watch asks etcd to fragment large responses and does not ask for previous values, so a
//! worker resuming behind many large values gets messages it can decode; a revision is applied
//! only once its last fragment has arrived. A watch that answers nothing, not even a progress
//! request, for longer than the stall timeout is treated as broken, never as an idle subtree.
use crate::keys;
use crate::mirror::context::{State, Worker};
use crate::mirror::health::{MirrorEvent, Phase, ResyncCause};
use crate::mirror::leases::keeper::KeeperSignal;
use crate::mirror::leases::shards::{MAX_DEPTH, outgrown, overfull_shards};
use crate::mirror::plan::{
    MAX_WATCH_INFLIGHT_BYTES, MirrorOp, Revision, SyncBatcher, WatchBatch, enforce_request_limit, next_watch_batch,
    verify_overdue, watch_connections, watch_depth, watch_linger,
};
use crate::mirror::streams::apply::Applied;
use crate::mirror::streams::catch_up::{Absorbed, CatchUp};
use crate::mirror::streams::split::{Advance, Split, retarget};
use crate::mirror::streams::spread::Spread;
use crate::mirror::streams::sync::{RESERVED_REQUEST_BYTES, page_kvs};
use crate::mirror::verify::{advance, page_range, repairs};
use anyhow::{Context, anyhow};
use etcd_client::{Client, EventType, WatchOptions};
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{Notify, mpsc};
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

/// A watch batch Txn in flight, with what it consumes once it lands.
struct InFlight {
    task: tokio::task::JoinHandle<anyhow::Result<Applied>>,
    revisions_consumed: usize,
    split_ops_consumed: usize,
    applied_through: i64,
    ops: usize,
    bytes: usize,
    /// Hashes of the keys it writes (see `Pipeline`).
    keys: Vec<u64>,
    /// The revision it records as held completely.
    progress: i64,
    /// Finished (its keys no longer busy, its slot free), though not yet taken as landed: batches
    /// are taken in order, so one slow Txn does not hold back the slots of those after it.
    released: bool,
    /// Set when the peer answered that the Txn applied. A Txn that failed or timed out may still
    /// land later, so its keys stay busy: a later batch of the same key could land first and be
    /// overwritten by it.
    succeeded: Arc<std::sync::atomic::AtomicBool>,
}

/// What the batches still running share: how many there are and their bytes, the keys they
/// write, by hash (a batch that would write one of them waits; a collision only makes it wait
/// longer), and the signal that any of them finished, not only the oldest.
#[derive(Default)]
struct Pipeline {
    hasher: std::collections::hash_map::RandomState,
    counts: HashMap<u64, u32>,
    running: usize,
    bytes: usize,
    finished: Arc<Notify>,
}

impl Pipeline {
    fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    fn busy(&self, key: &[u8]) -> bool {
        self.counts.contains_key(&self.hash(key))
    }

    fn add(&mut self, keys: &[u64], bytes: usize) {
        for k in keys {
            *self.counts.entry(*k).or_default() += 1;
        }
        self.running += 1;
        self.bytes += bytes;
    }

    /// Frees the slots and keys of the batches the peer answered as applied, whichever order
    /// they finished in. One that failed keeps its keys busy until the session ends.
    fn release_landed(&mut self, inflight: &mut VecDeque<InFlight>) {
        for batch in inflight.iter_mut() {
            let landed = batch.task.is_finished() && batch.succeeded.load(std::sync::atomic::Ordering::SeqCst);
            if landed {
                self.release(batch);
            }
        }
    }

    /// Frees a finished batch's slot and keys, once.
    fn release(&mut self, batch: &mut InFlight) {
        if batch.released {
            return;
        }
        batch.released = true;
        self.running -= 1;
        self.bytes -= batch.bytes;
        for k in &batch.keys {
            if let Some(n) = self.counts.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    self.counts.remove(k);
                }
            }
        }
    }
}

/// What a pending revision changes once applied.
struct RevisionMeta {
    /// Key-count changes per shard.
    deltas: Vec<(usize, i64)>,
    bytes: usize,
    received: SystemTime,
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
        let prefix = keys::region_prefix(&self.config.origin);
        let watch_from = state.applied + 1;
        let options =
            WatchOptions::new().with_prefix().with_start_revision(watch_from).with_progress_notify().with_fragment();
        let mut stream = self
            .rpc("start watch", crate::mirror::target::watcher(local).watch(prefix.as_str(), Some(options)))
            .await?;
        self.shared.update(|h| h.phase = Phase::Watching);

        let epoch = state.ownership.epoch.ok_or_else(|| anyhow!("watch without ownership"))?;
        let limits = self.limits(state);
        let stall_after = (self.config.progress_interval * 4).max(self.config.rpc_timeout);
        let mut pending: VecDeque<Revision> = VecDeque::new();
        let mut pending_meta: VecDeque<RevisionMeta> = VecDeque::new();
        let (mut pending_ops, mut pending_bytes) = (0usize, 0usize);
        // Keys the pending revisions create less those they delete, and whether, with them, the
        // subtree outgrew its leases under auth (see below).
        let mut pending_keys = 0i64;
        let mut outgrew = false;
        let mut split = 0usize;
        let mut progress_revision = 0i64;
        let mut fragment_open = false;
        let mut last_message = Instant::now();
        // Batch Txns in flight, oldest first: enough to cover the peer's round trip. They are
        // taken as landed in this order, whatever order the peer applied them in.
        let mut inflight: VecDeque<InFlight> = VecDeque::new();
        let mut pipeline = Pipeline::default();
        let finished = pipeline.finished.clone();
        let round_trip = self.peer_distance(local, peer).await;
        let depth = watch_depth(round_trip);
        let verify_forced_after = verify_overdue(self.config.verify_interval, round_trip);
        let mut last_verified = Instant::now();
        // The highest revision a landed batch recorded: the progress record holds at least it.
        let mut recorded = state.applied;
        let mut peak = 0usize;
        // A far peer's batch that is not full waits a little for more revisions (`watch_linger`).
        let mut linger = Box::pin(tokio::time::sleep(Duration::ZERO));
        let mut lingering = false;
        // Revisions (from the front of `pending`) in flight, and the revision they reach.
        let (mut dispatched, mut through_dispatched) = (0usize, state.applied);
        // The newest revision any batch sent carried, if only part of it: recorded with the
        // progress, it bounds what a successor finds landed past the record (see `catch_up.rs`).
        let mut sent_through = state.applied;
        // Batches sent and landed; a split lists its old lease once those sent before it landed.
        let (mut sent, mut landed, mut split_barrier) = (0u64, 0u64, 0u64);
        let mut ticker = tokio::time::interval(self.config.progress_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Resumed from the records, the watch applies nothing until it has caught up with where
        // it began, and asks for progress often until then (see `catch_up.rs`).
        let mut catch_up = CatchUp::new(state.peer_may_hold_through);
        let mut nudge = tokio::time::interval(CATCH_UP_NUDGE);
        nudge.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The next page waits for the verify interval and for its slot in the origin's budget.
        let verifying = !self.config.verify_interval.is_zero();
        let next_page = || {
            let size = self.config.verify_page_size.max(1) as u64;
            let slot = self.config.verify_budget.reserve(size, Instant::now() + self.config.verify_interval);
            Box::pin(tokio::time::sleep_until(slot.filter(|_| verifying).unwrap_or_else(far_future).into()))
        };
        let mut verify_slot = next_page();
        let mut verify_due = false;
        // A lease shard being split beside the watch (see `split.rs`).
        let mut splitting: Option<Split> = None;
        // Drifted shard counts being recorded beside the watch: inline, each record held the
        // batches back a round trip, and a far peer caught up at a few Txns a second.
        let mut recording: Option<Recording> = None;

        loop {
            let room = pending_ops < self.config.max_pending_ops && pending_bytes < self.config.max_pending_bytes;
            if !room {
                last_message = Instant::now();
                if catch_up.holds_back() {
                    warn!(
                        writes = catch_up.absorbed,
                        "the catch-up outgrew the pending bounds before the watch caught up: applying what it holds"
                    );
                    catch_up.give_up();
                }
            }
            tokio::select! {
                _ = self.cancel.cancelled() => return Ok(WatchEnd::Shutdown),
                Some(signal) = lost_rx.recv() => {
                    let lost = match signal {
                        KeeperSignal::LeaseLost(id) => id,
                        KeeperSignal::PeerChanged { from, to } => anyhow::bail!(
                            "the peer etcd changed under the mirror (cluster id {from:x} -> {to:x}: restored from a backup, or replaced); resuming from what it records"
                        ),
                    };
                    if let Some(shard) = state.leases.iter().position(|id| *id == lost) {
                        warn!(lease = lost, shard, "lease lost; its keys are gone from the peer");
                        // The sync grants its replacement and records it before moving keys.
                        state.leases[shard] = 0;
                        settle_inflight(std::mem::take(&mut inflight)).await?;
                        if let Some(by) = settle_writers(splitting.take(), recording.take(), state).await? {
                            return Ok(WatchEnd::Fenced(by));
                        }
                        return Ok(WatchEnd::Resync(ResyncCause::LeaseLost));
                    }
                }
                result = async { (&mut inflight.front_mut().expect("guarded").task).await }, if !inflight.is_empty() => {
                    let mut batch = inflight.pop_front().expect("guarded");
                    pipeline.release(&mut batch);
                    if let Applied::Fenced(by) = result.map_err(|e| anyhow!("a peer Txn task ended: {e}"))?? {
                        return Ok(WatchEnd::Fenced(by));
                    }
                    recorded = recorded.max(batch.progress);
                    landed += 1;
                    dispatched -= batch.revisions_consumed;
                    for _ in 0..batch.revisions_consumed {
                        if let Some(rev) = pending.pop_front() {
                            pending_ops -= rev.ops.len();
                        }
                        if let Some(meta) = pending_meta.pop_front() {
                            pending_bytes -= meta.bytes;
                            for (shard, delta) in meta.deltas {
                                pending_keys -= delta;
                                state.keys[shard] = (state.keys[shard] + delta).max(0);
                                if delta != 0 && state.count_drifted(shard) {
                                    state.drifted.insert(shard);
                                }
                            }
                        }
                    }
                    if batch.split_ops_consumed > split && split == 0
                        && let Some(rev) = pending.front()
                        && !catch_up.is_coalesced(rev.revision) {
                        warn!(revision = rev.revision, ops = rev.ops.len(), "a source revision exceeds the peer's Txn limits; applying it in parts");
                        self.shared.emit(MirrorEvent::RevisionSplit { revision: rev.revision, ops: rev.ops.len() });
                        self.shared.update(|h| h.split_revisions += 1);
                    }
                    split = batch.split_ops_consumed;
                    state.applied = state.applied.max(batch.applied_through);
                    backoff.reset();
                    self.shared.progressed();
                    let (applied_rev, total) = (state.applied, state.keys.iter().sum::<i64>());
                    let oldest_pending = pending_meta.front().map(|m| m.received);
                    self.shared.update(|h| {
                        h.last_applied_revision = h.last_applied_revision.max(applied_rev);
                        h.keys = total;
                        h.txns += 1;
                        h.ops += batch.ops as u64;
                        h.pending_since = oldest_pending;
                    });
                }
                // A fragmented response is read to its end even past the bounds: nothing can be
                // applied before it is complete.
                first = stream.message(), if room || fragment_open => {
                    // Whatever else has arrived is read at once, within the bounds: a watcher
                    // that etcd cannot hand its responses to (128 of them) falls behind, and etcd
                    // then serves it from history at 1,000 revisions per 100 ms until it is
                    // back at the head.
                    let mut message = first;
                    let mut seen = 0;
                    let mut read = 0;
                    let mut caught_up = false;
                    loop {
                        read += 1;
                        let Some(response) = message.context("watching the origin")? else {
                            anyhow::bail!("the origin closed the watch");
                        };
                        last_message = Instant::now();
                        if response.canceled() {
                            if response.compact_revision() > 0 {
                                warn!(compacted = response.compact_revision(), needed = state.applied + 1, "origin compacted past the mirror's revision");
                                settle_inflight(std::mem::take(&mut inflight)).await?;
                                if let Some(by) = settle_writers(splitting.take(), recording.take(), state).await? {
                                    return Ok(WatchEnd::Fenced(by));
                                }
                                return Ok(WatchEnd::Resync(ResyncCause::Compacted));
                            }
                            anyhow::bail!("the origin cancelled the watch: {}", response.cancel_reason());
                        }
                        fragment_open = response.0.fragment;
                        let header_revision = response.header().map(|h| h.revision()).unwrap_or(0);
                        if response.created() {
                            catch_up.started(header_revision, state.applied);
                        }
                        if response.events().is_empty() {
                            // A progress notification: every event up to this revision was sent.
                            if !response.created() {
                                progress_revision = progress_revision.max(header_revision);
                                caught_up |= catch_up.delivered_through(progress_revision);
                            }
                        } else {
                            let received = SystemTime::now();
                            let mut newest = 0;
                            let (mut found, mut fixed) = (Vec::new(), Vec::new());
                            for event in response.events() {
                                let Some(kv) = event.kv() else { continue };
                                let revision = kv.mod_revision();
                                newest = revision;
                                let shard = state.layout.shard_of(kv.key());
                                let (op, delta) = match event.event_type() {
                                    // Version 1: the key was created (or re-created) at this revision.
                                    EventType::Put => (
                                        MirrorOp::Put { key: kv.key().to_vec(), value: kv.value().to_vec(), shard },
                                        i64::from(kv.version() == 1),
                                    ),
                                    EventType::Delete => (MirrorOp::Delete { key: kv.key().to_vec() }, -1),
                                };
                                let (op, too_large) =
                                    enforce_request_limit(op, self.config.max_request_bytes, RESERVED_REQUEST_BYTES);
                                match too_large {
                                    Some(o) => found.push(o),
                                    None if state.oversized.contains_key(String::from_utf8_lossy(kv.key()).as_ref()) => {
                                        fixed.push(String::from_utf8_lossy(kv.key()).into_owned());
                                    }
                                    None => {}
                                }
                                let bytes = op.wire_size();
                                pending_ops += 1;
                                pending_bytes += bytes;
                                pending_keys += delta;
                                let op = match catch_up.absorb(&mut pending, revision, op) {
                                    Absorbed::No(op) => Some(op),
                                    Absorbed::New => None,
                                    Absorbed::Replacing(earlier) => {
                                        pending_ops -= 1;
                                        pending_bytes -= earlier.wire_size();
                                        if let Some(meta) = pending_meta.back_mut() {
                                            meta.bytes -= earlier.wire_size();
                                        }
                                        None
                                    }
                                };
                                match op {
                                    // Coalesced into the catch-up's entry, new or not.
                                    None if pending_meta.len() < pending.len() => {
                                        pending_meta.push_back(RevisionMeta { deltas: vec![(shard, delta)], bytes, received });
                                    }
                                    None => {
                                        let meta = pending_meta.back_mut().expect("parallel to pending");
                                        meta.deltas.push((shard, delta));
                                        meta.bytes += bytes;
                                    }
                                    Some(op) => match pending.back_mut() {
                                        Some(last) if last.revision == revision => {
                                            last.ops.push(op);
                                            let meta = pending_meta.back_mut().expect("parallel to pending");
                                            meta.deltas.push((shard, delta));
                                            meta.bytes += bytes;
                                        }
                                        _ => {
                                            pending.push_back(Revision { revision, ops: vec![op] });
                                            pending_meta.push_back(RevisionMeta { deltas: vec![(shard, delta)], bytes, received });
                                        }
                                    },
                                }
                            }
                            if !fragment_open {
                                caught_up |= catch_up.delivered_through(newest);
                            }
                            if !found.is_empty() || !fixed.is_empty() {
                                self.report_oversized(state, found, fixed);
                            }
                            seen = seen.max(newest);
                        }
                        let room = pending_ops < self.config.max_pending_ops && pending_bytes < self.config.max_pending_bytes;
                        if read >= WATCH_DRAIN_RESPONSES || !(room || fragment_open) {
                            break;
                        }
                        match if_ready(stream.message()).await {
                            Some(next) => message = next,
                            None => break,
                        }
                    }
                    if caught_up {
                        let keys = pending.front().map_or(0, |merged| merged.ops.len());
                        info!(writes = catch_up.absorbed, keys, "resumed watch caught up; applying each key's newest write");
                    }
                    if state.auth_binds && pending_keys > 0 {
                        let projected = state.keys.iter().sum::<i64>() + pending_keys;
                        outgrew = outgrown(state.layout.len(), projected.max(0) as u64, state.lease_cap);
                    }
                    let oldest_pending = pending_meta.front().map(|m| m.received);
                    self.shared.update(|h| {
                        h.last_seen_revision = h.last_seen_revision.max(seen);
                        h.pending_since = oldest_pending;
                    });
                }
                _ = finished.notified(), if !inflight.is_empty() => {}
                () = spread.opened(), if spread.opening() => {
                    let connections = spread.len();
                    debug!(connections, "watch batches spread over more connections to the peer");
                    self.shared.update(|h| h.peer_connections = connections);
                }
                done = async { recording.as_mut().expect("guarded").await }, if recording.is_some() => {
                    recording = None;
                    if let Some(by) = counts_recorded(done)? {
                        return Ok(WatchEnd::Fenced(by));
                    }
                }
                () = &mut linger, if lingering => lingering = false,
                _ = nudge.tick(), if catch_up.holds_back() => {
                    self.rpc("request watch progress", stream.request_progress()).await?;
                }
                _ = &mut verify_slot, if !verify_due => verify_due = true,
                done = async { splitting.as_mut().expect("guarded").step().await }, if splitting.as_ref().is_some_and(Split::running) => {
                    let task = splitting.as_mut().expect("guarded");
                    match self.advance_split(task, done?, peer, state, epoch)? {
                        (Advance::Fenced(by), _) => return Ok(WatchEnd::Fenced(by)),
                        (Advance::Done, _) => splitting = None,
                        (Advance::Going, true) => {
                            // Revisions already sent keep their leases; the split lists the old
                            // lease once they landed.
                            retarget(
                                pending.range_mut(dispatched..).zip(pending_meta.range_mut(dispatched..).map(|m| &mut m.deltas)),
                                &state.layout,
                            );
                            split_barrier = sent;
                        }
                        (Advance::Going, false) => {}
                    }
                }
                _ = ticker.tick() => {
                    if spread.close_idle() {
                        debug!("the watch's extra connections to the peer closed: unused for a while");
                        self.shared.update(|h| h.peer_connections = 1);
                    }
                    // Not reading (the pending bounds are reached) is not a stalled watch.
                    if room && last_message.elapsed() > stall_after {
                        // etcd (3.6 at least) answers no progress request while a watcher starts
                        // past the store's revision: an origin etcd nobody wrote to since the
                        // watch began is silent, not stalled.
                        let now = self.rpc("read the origin's revision", local.status()).await?;
                        let revision = now.header().map_or(i64::MAX, |h| h.revision());
                        if revision >= watch_from {
                            anyhow::bail!(
                                "the origin's watch stalled: no event and no answer to progress requests for {:?}",
                                last_message.elapsed()
                            );
                        }
                        last_message = Instant::now();
                    }
                    // Bounded, so that a stalled watch stream cannot stall the loop.
                    self.rpc("request watch progress", stream.request_progress()).await?;
                }
            }

            // Idle and told that nothing is missing up to a revision: the reported watermark
            // advances, so an idle subtree does not look stale. It is never recorded nor resumed
            // from: etcd before 3.4.24 and 3.5.8 can send a progress notification ahead of events
            // still on their way (etcd issue 15220), and a successor would skip them.
            if inflight.is_empty() && pending.is_empty() && progress_revision > state.applied {
                let watermark = progress_revision;
                self.shared.update(|h| {
                    h.last_applied_revision = h.last_applied_revision.max(watermark);
                    h.last_seen_revision = h.last_seen_revision.max(watermark);
                    h.pending_since = None;
                });
            }
            // Between batches the peer holds exactly the origin's subtree at the applied revision:
            // the moment to compare a page.
            // Not between the parts of a split revision either: the peer then holds part of one.
            // Nor while a split moves keys: a key between two leases is not drift.
            // It holds back new batches for about two round trips: across distance it waits for a
            // quiet moment, and is forced only when long overdue.
            let quiet = inflight.is_empty() && pending.is_empty();
            let verify_now = verify_due
                && (quiet || last_verified.elapsed() >= verify_forced_after)
                && !fragment_open
                && split == 0
                && splitting.is_none()
                && !catch_up.holds_back();
            if verify_now && inflight.is_empty() {
                verify_due = false;
                last_verified = Instant::now();
                if let Some(by) = self.verify_page(local, peer, state, epoch).await? {
                    return Ok(WatchEnd::Fenced(by));
                }
                verify_slot = next_page();
            }
            // A shard past the cap splits, online, beside the watch; otherwise counts that
            // drifted from the checkpoint's are recorded, so that a successor starts from them.
            // One checkpoint writer at a time: a split waits for a record in flight, and the
            // reverse.
            if splitting.is_none() && split == 0 && recording.is_none() {
                match self.shard_to_split(state) {
                    Some(shard) => splitting = Some(self.start_split(peer, shard)),
                    None if !state.drifted.is_empty() || state.left_out_unrecorded => {
                        recording = Some(self.record_drifted_counts(peer, state, epoch))
                    }
                    None => {}
                }
            }
            if let Some(task) = splitting.as_mut() {
                self.drive_split(task, peer, state, epoch, landed < split_barrier);
            }
            // While a fragmented response is incomplete, its last revision may be partial; a
            // verification due waits for the batches in flight to land.
            pipeline.release_landed(&mut inflight);
            // Under auth, keys arriving faster than splits can follow would pile onto leases
            // whose every put then checks every key on them: a resync lays the leases out for
            // the subtree as it is now, and fills each at once.
            if outgrew {
                info!(
                    shards = state.layout.len(),
                    keys = state.keys.iter().sum::<i64>() + pending_keys,
                    "the subtree outgrew its leases; resyncing to a new layout"
                );
                settle_inflight(std::mem::take(&mut inflight)).await?;
                if let Some(by) = settle_writers(splitting.take(), recording.take(), state).await? {
                    return Ok(WatchEnd::Fenced(by));
                }
                return Ok(WatchEnd::Resync(ResyncCause::Reshard));
            }
            // Renewals first: while they fail, only what is in flight goes on (the progress tick
            // looks again).
            let renewals_failing = self.renewals_failing();
            // Nor while a verification is due, or a resumed watch is catching up.
            let may_send = !verify_now && !catch_up.holds_back();
            while may_send
                && pipeline.running < depth
                && pipeline.bytes < MAX_WATCH_INFLIGHT_BYTES
                && !fragment_open
                && !(renewals_failing && pipeline.running > 0)
            {
                // A revision larger than one Txn goes alone, in parts.
                if split > 0 && !inflight.is_empty() {
                    break;
                }
                let Some(batch) = next_watch_batch(
                    pending.range(dispatched..),
                    if dispatched == 0 { split } else { 0 },
                    through_dispatched,
                    limits,
                    |key| pipeline.busy(key),
                ) else {
                    break;
                };
                if batch.revisions_consumed == 0 && !inflight.is_empty() {
                    break;
                }
                let waited = pending_meta.get(dispatched).and_then(|m| m.received.elapsed().ok()).unwrap_or_default();
                let cut_short = dispatched + batch.revisions_consumed < pending.len();
                if let Some(wait) = watch_linger(
                    self.config.watch_linger,
                    depth,
                    pipeline.running,
                    batch.ops.len(),
                    limits.max_ops,
                    cut_short,
                    waited,
                ) {
                    linger.as_mut().reset(tokio::time::Instant::now() + wait);
                    lingering = true;
                    break;
                }
                // With nothing else in flight, the peer holds everything before this batch.
                let progress =
                    if inflight.is_empty() { batch.applied_through.max(state.applied) } else { state.applied };
                through_dispatched = through_dispatched.max(batch.applied_through);
                let carried = match batch.revisions_consumed {
                    0 => pending.get(dispatched).map_or(batch.applied_through, |part_of| part_of.revision),
                    _ => batch.applied_through,
                };
                sent_through = sent_through.max(carried);
                dispatched += batch.revisions_consumed;
                sent += 1;
                let alone = batch.revisions_consumed == 0;
                tracing::trace!(
                    ops = batch.ops.len(),
                    running = pipeline.running,
                    depth,
                    pending = pending.len() - dispatched,
                    "watch batch sent"
                );
                inflight.push_back(self.send_batch(
                    spread.next(),
                    epoch,
                    batch,
                    (progress, sent_through),
                    state,
                    &mut pipeline,
                ));
                if pipeline.running > peak {
                    peak = pipeline.running;
                    self.shared.update(|h| h.batches_in_flight_peak = h.batches_in_flight_peak.max(peak));
                }
                if alone {
                    break;
                }
            }
            // Across distance, Txns in flight that outgrow the connections open get more.
            let wanted = watch_connections(round_trip, pipeline.running, depth, spread.len());
            spread.want(wanted, &self.peer, self.config.rpc_timeout);
            // Batches sent together recorded less than they applied: once all have landed and
            // nothing waits, one Txn records the rest, so that a successor resumes exactly here.
            if inflight.is_empty() && pending.is_empty() && state.applied > recorded && !verify_now {
                let flush = WatchBatch {
                    ops: Vec::new(),
                    applied_through: state.applied,
                    revisions_consumed: 0,
                    split_ops_consumed: 0,
                };
                sent += 1;
                inflight.push_back(self.send_batch(
                    peer,
                    epoch,
                    flush,
                    (state.applied, sent_through),
                    state,
                    &mut pipeline,
                ));
            }
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
        let origin = match self.page_of(size, local, &from, &subtree_end, Some(state.applied), &mut largest).await {
            Ok(page) => page,
            // Compacted past the applied revision: the next page starts a new pass later.
            Err(e) if format!("{e:#}").contains("compacted") => {
                state.walk = Default::default();
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let origin_more = origin.more();
        let origin: Vec<_> = page_kvs(origin).collect();
        let range_end = match origin.last() {
            Some(last) if origin_more => {
                let mut end = last.key.clone();
                end.push(0);
                end
            }
            _ => subtree_end.clone(),
        };
        let peer_page = self.page_of(size, peer, &from, &range_end, None, &mut largest).await?;
        self.shared.detector_success();
        let peer_more = peer_page.more();
        let peer_kvs: Vec<_> = page_kvs(peer_page).collect();
        let peer_last = peer_kvs.last().map(|kv| kv.key.clone());
        let (end, origin) = page_range(origin, origin_more, peer_last.as_deref(), peer_more, &subtree_end);
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

    /// Sends one batch, in its own task so that several can be in flight, recording `progress`
    /// and what was sent: (the revision the peer holds completely, the newest any batch carried).
    fn send_batch(
        &self,
        peer: &Client,
        epoch: i64,
        batch: WatchBatch,
        (progress, sent_through): (i64, i64),
        state: &State,
        pipeline: &mut Pipeline,
    ) -> InFlight {
        let keys: Vec<u64> = batch.ops.iter().map(|op| pipeline.hash(op.key())).collect();
        let ops = batch.ops.len();
        let bytes = batch.ops.iter().map(MirrorOp::wire_size).sum();
        pipeline.add(&keys, bytes);
        let bookkeeping = vec![self.raise_progress_op(progress, sent_through)];
        let send = self.apply(peer, epoch, batch.ops, &state.leases, bookkeeping);
        let finished = pipeline.finished.clone();
        let succeeded = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let answered = succeeded.clone();
        let task = tokio::spawn(async move {
            let applied = send.await;
            if matches!(applied, Ok(Applied::Yes)) {
                answered.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            finished.notify_one();
            applied
        });
        InFlight {
            task,
            revisions_consumed: batch.revisions_consumed,
            split_ops_consumed: batch.split_ops_consumed,
            applied_through: batch.applied_through,
            ops,
            bytes,
            keys,
            progress,
            released: false,
            succeeded,
        }
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

/// Waits for the batch Txns sent before a resync: they may still commit, and under this
/// session's epoch nothing would fence them against the sync's writes.
async fn settle_inflight(inflight: VecDeque<InFlight>) -> anyhow::Result<()> {
    for batch in inflight {
        batch.task.await.map_err(|e| anyhow!("a peer Txn task ended: {e}"))??;
    }
    Ok(())
}

/// A time that never comes: the verification slot of a worker that does not verify.
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(100 * 365 * 86_400)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn in_flight(pipeline: &mut Pipeline, key: &[u8], outcome: anyhow::Result<Applied>) -> InFlight {
        let keys = vec![pipeline.hash(key)];
        pipeline.add(&keys, 10);
        let succeeded = Arc::new(std::sync::atomic::AtomicBool::new(matches!(outcome, Ok(Applied::Yes))));
        InFlight {
            task: tokio::spawn(async move { outcome }),
            revisions_consumed: 1,
            split_ops_consumed: 0,
            applied_through: 0,
            ops: 1,
            bytes: 10,
            keys,
            progress: 0,
            released: false,
            succeeded,
        }
    }

    #[tokio::test]
    async fn a_batch_that_timed_out_keeps_its_keys_busy_so_no_later_write_of_them_can_land_first() {
        let mut pipeline = Pipeline::default();
        let mut inflight = VecDeque::new();
        inflight.push_back(in_flight(&mut pipeline, b"k1", Err(anyhow!("peer txn: timed out after 3s"))));
        inflight.push_back(in_flight(&mut pipeline, b"k2", Ok(Applied::Yes)));
        while !inflight.iter().all(|b| b.task.is_finished()) {
            tokio::task::yield_now().await;
        }
        pipeline.release_landed(&mut inflight);
        assert!(pipeline.busy(b"k1"), "the timed-out Txn may still land: its key must stay busy");
        assert!(!pipeline.busy(b"k2"), "an applied batch frees its key at once, out of order");
        assert_eq!(pipeline.running, 1);
        pipeline.release_landed(&mut inflight);
        assert_eq!(pipeline.running, 1, "released once");
    }
}
