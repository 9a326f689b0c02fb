//! The watch's pipeline, without IO: which origin revisions wait, which go to the peer in the next
//! Txn, when a Txn counts as landed, and what a failure or a timeout does to its keys. The watch
//! loop (`watch.rs`) feeds it what the origin sent and what the peer answered, and sends what it
//! says to send.
//!
//! The rules it keeps:
//! - Revisions apply whole, in the origin's order. A revision too large for one Txn goes alone,
//!   in parts, once everything before it has landed.
//! - Txns in flight together write disjoint keys, so the peer may apply them in any order and each
//!   key's writes still land in the origin's order. A Txn's keys stay busy until the peer answered
//!   that it applied: one that failed or timed out may still land late, and a later write of the
//!   same key must not land before it.
//! - Txns are taken as landed in the order they were sent, whatever order the peer answered in; a
//!   fenced or failed Txn ends the session when its turn comes.
//! - Each Txn raises the progress record to (the revision the peer held completely when it was
//!   sent, the newest revision any Txn sent so far carried). Both only grow in the order Txns are
//!   sent, so whichever Txn's record the peer keeps, the peer holds everything up to its first
//!   revision and nothing past its second (see `catch_up.rs`).
//! - A resumed watch applies nothing until it has caught up (see `catch_up.rs`).
use crate::mirror::leases::shards::Layout;
use crate::mirror::plan::{
    MAX_WATCH_INFLIGHT_BYTES, MirrorOp, Revision, TxnLimits, WatchBatch, next_watch_batch, watch_linger,
};
use crate::mirror::records::checkpoint::SENT_UNKNOWN;
use crate::mirror::streams::catch_up::{Absorbed, CatchUp};
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::time::{Duration, SystemTime};

/// What the peer answered to a Txn (or what became of it).
#[derive(Debug)]
pub(in crate::mirror) enum Outcome {
    Applied,
    /// Another session owns the peer's copy now: nothing of the Txn applied.
    Fenced(String),
    /// Failed or timed out: it may still land later.
    Failed(anyhow::Error),
}

/// A Txn to send: its ops, and the progress record it raises.
#[derive(Debug)]
pub(in crate::mirror) struct Dispatch {
    pub id: u64,
    pub ops: Vec<MirrorOp>,
    /// The revision the peer holds completely once everything sent before this Txn applied.
    pub progress: i64,
    /// The newest revision any Txn sent so far carried (this one included).
    pub sent_through: i64,
    /// The origin revisions the ops come from (first, last); for a part of a revision, both are
    /// that revision. None for a Txn that only records progress.
    pub revisions: Option<(i64, i64)>,
}

/// What the loop should do next about sending.
#[derive(Debug)]
pub(in crate::mirror) enum Next {
    Send(Dispatch),
    /// A batch that is not full waits this much longer for more revisions.
    Linger(Duration),
    /// Nothing to send now.
    Wait,
}

/// What the next Txn may be, as the loop sees it now.
#[derive(Clone, Copy, Debug)]
pub(in crate::mirror) struct Gate {
    /// Txns to keep in flight (`watch_depth`).
    pub depth: usize,
    pub limits: TxnLimits,
    /// Nothing but what is in flight may go: a verification is due.
    pub held: bool,
    /// A fragmented response is incomplete: its newest revision may be partial and does not go;
    /// the revisions before it are whole and may (a catch-up of large values arrives as one
    /// response of many fragments, and holding all of it would hold all of it in memory).
    pub last_partial: bool,
    /// Renewals are failing: only one Txn in flight at a time.
    pub renewals_failing: bool,
    pub linger: Duration,
    pub now: SystemTime,
}

/// A Txn taken as landed, in the order sent.
#[derive(Debug)]
pub(in crate::mirror) struct Landed {
    pub ops: usize,
    /// Key-count changes per shard of the revisions it completed.
    pub deltas: Vec<(usize, i64)>,
    /// A source revision too large for one Txn began to apply in parts: (revision, ops).
    pub split_started: Option<(i64, usize)>,
}

/// What [`Pipeline::take_landed`] found at the front.
#[derive(Debug)]
pub(in crate::mirror) enum Taken {
    Landed(Landed),
    Fenced(String),
    Failed(anyhow::Error),
}

/// What a pending revision changes once applied.
#[derive(Debug)]
struct RevisionMeta {
    /// Key-count changes: (shard, change, index of the op that made it in the revision's ops).
    deltas: Vec<(usize, i64, usize)>,
    bytes: usize,
    received: SystemTime,
}

/// A Txn in flight.
#[derive(Debug)]
struct InFlight {
    id: u64,
    revisions_consumed: usize,
    split_ops_consumed: usize,
    applied_through: i64,
    progress: i64,
    ops: usize,
    bytes: usize,
    /// Hashes of the keys it writes (a collision only makes a later batch wait longer).
    keys: Vec<u64>,
    outcome: Option<Outcome>,
    /// Its slot and keys are free again (the peer answered that it applied).
    released: bool,
}

#[derive(Debug, Default)]
pub(in crate::mirror) struct Pipeline {
    /// Revisions received and not yet landed, oldest first; the first `dispatched` are in flight.
    pending: VecDeque<Revision>,
    meta: VecDeque<RevisionMeta>,
    pending_ops: usize,
    pending_bytes: usize,
    /// Keys the pending revisions create less those they delete.
    pending_keys: i64,
    catch_up: CatchUp,
    dispatched: usize,
    /// The revision the Txns sent reach.
    through_dispatched: i64,
    /// The newest revision any Txn sent carried, if only part of it.
    sent_through: i64,
    /// Ops of the front revision already landed, while it applies in parts.
    split: usize,
    /// The revision the peer holds completely.
    applied: i64,
    /// The highest progress a landed Txn recorded.
    recorded: i64,
    /// The revision the watch said it delivered everything up to.
    delivered: i64,
    inflight: VecDeque<InFlight>,
    hasher: std::collections::hash_map::RandomState,
    busy: HashMap<u64, u32>,
    running: usize,
    bytes: usize,
    next_id: u64,
    sent: u64,
    landed: u64,
}

impl Pipeline {
    /// A pipeline for a watch from `applied + 1`; `peer_may_hold_through` as for [`CatchUp::new`].
    /// Every Txn records at least what the predecessor may have sent: a session that resumes
    /// keeps the bound its successor will need, whatever it lands itself.
    pub fn new(applied: i64, peer_may_hold_through: Option<i64>) -> Self {
        let predecessor_sent = peer_may_hold_through.filter(|through| *through != SENT_UNKNOWN).unwrap_or(applied);
        Pipeline {
            catch_up: CatchUp::new(peer_may_hold_through),
            through_dispatched: applied,
            sent_through: applied.max(predecessor_sent),
            applied,
            recorded: applied,
            ..Default::default()
        }
    }

    // --- What the origin sent -------------------------------------------------------------------

    /// The watch was created at the origin's `revision`.
    pub fn started(&mut self, revision: i64) {
        self.catch_up.started(revision, self.applied);
    }

    /// The watch delivered everything up to `revision` (a whole response's last event). Returns
    /// whether this ended a catch-up.
    pub fn delivered_through(&mut self, revision: i64) -> bool {
        self.catch_up.delivered_through(revision)
    }

    /// A progress notification: every event up to `revision` was sent. Returns whether this
    /// ended a catch-up.
    pub fn progress_notified(&mut self, revision: i64) -> bool {
        self.delivered = self.delivered.max(revision);
        self.catch_up.delivered_through(self.delivered)
    }

    /// One write of the origin at `revision`, on `shard`, changing the key count by `delta`.
    pub fn receive(&mut self, revision: i64, op: MirrorOp, shard: usize, delta: i64, received: SystemTime) {
        let bytes = op.wire_size();
        self.pending_ops += 1;
        self.pending_bytes += bytes;
        self.pending_keys += delta;
        let index = match self.catch_up.absorb(&mut self.pending, revision, op) {
            Absorbed::No(op) => match self.pending.back_mut() {
                Some(last) if last.revision == revision => {
                    last.ops.push(op);
                    last.ops.len() - 1
                }
                _ => {
                    self.pending.push_back(Revision { revision, ops: vec![op] });
                    0
                }
            },
            Absorbed::New(index) => index,
            Absorbed::Replacing(index, earlier) => {
                self.pending_ops -= 1;
                self.pending_bytes -= earlier.wire_size();
                if let Some(meta) = self.meta.back_mut() {
                    meta.bytes -= earlier.wire_size();
                }
                index
            }
        };
        if self.meta.len() < self.pending.len() {
            self.meta.push_back(RevisionMeta { deltas: Vec::new(), bytes: 0, received });
        }
        let meta = self.meta.back_mut().expect("parallel to pending");
        meta.deltas.push((shard, delta, index));
        meta.bytes += bytes;
    }

    /// Keys the revisions not landed up to `revision` create less those they delete: added to
    /// the count landed, the keys the peer holds once it holds `revision` completely.
    pub fn pending_keys_through(&self, revision: i64) -> i64 {
        self.pending
            .iter()
            .zip(&self.meta)
            .take_while(|(pending, _)| pending.revision <= revision)
            .flat_map(|(_, meta)| meta.deltas.iter().map(|(_, delta, _)| *delta))
            .sum()
    }

    /// Revisions received and not sent yet.
    pub fn undispatched(&self) -> usize {
        self.pending.len().saturating_sub(self.dispatched)
    }

    /// Bytes of the revisions received and not landed (in flight included).
    pub fn pending_bytes(&self) -> usize {
        self.pending_bytes
    }

    /// Whether the pending revisions are within the bounds (else the watch is not read).
    pub fn has_room(&self, max_ops: usize, max_bytes: usize) -> bool {
        self.pending_ops < max_ops && self.pending_bytes < max_bytes
    }

    /// The pending bounds were reached before a resumed watch caught up: what was coalesced is
    /// applied. Returns how many writes it coalesced, if it was catching up.
    pub fn give_up_catch_up(&mut self) -> Option<usize> {
        if !self.catch_up.holds_back() {
            return None;
        }
        self.catch_up.give_up();
        Some(self.catch_up.absorbed)
    }

    /// A lease split changed the layout: revisions not sent yet go to the keys' new shards.
    /// Those sent keep their leases.
    pub fn retarget(&mut self, layout: &Layout) {
        let waiting = self.pending.range_mut(self.dispatched..).zip(self.meta.range_mut(self.dispatched..));
        for (revision, meta) in waiting {
            for op in &mut revision.ops {
                let shard = layout.shard_of(op.key());
                if let MirrorOp::Put { shard: target, .. } = op {
                    *target = shard;
                }
            }
            for (shard, _, index) in &mut meta.deltas {
                *shard = layout.shard_of(revision.ops[*index].key());
            }
        }
    }

    // --- What to send ---------------------------------------------------------------------------

    /// The next Txn to send, if one may go now.
    pub fn next(&mut self, gate: Gate) -> Next {
        let full = self.running >= gate.depth || self.bytes >= MAX_WATCH_INFLIGHT_BYTES;
        // While renewals fail, or a revision applies in parts, one Txn at a time.
        let alone = (gate.renewals_failing && self.running > 0) || (self.split > 0 && !self.inflight.is_empty());
        if gate.held || self.catch_up.holds_back() || full || alone {
            return Next::Wait;
        }
        let already_split = if self.dispatched == 0 { self.split } else { 0 };
        let busy = |key: &[u8]| self.busy.contains_key(&self.hasher.hash_one(key));
        let whole = if gate.last_partial { self.pending.len().saturating_sub(1) } else { self.pending.len() };
        if self.dispatched >= whole {
            return Next::Wait;
        }
        let planned = next_watch_batch(
            self.pending.range(self.dispatched..whole),
            already_split,
            self.through_dispatched,
            gate.limits,
            busy,
        );
        let Some(batch) = planned else { return Next::Wait };
        // A part of a revision goes only once everything before it has landed.
        if batch.revisions_consumed == 0 && !self.inflight.is_empty() {
            return Next::Wait;
        }
        let waited = self.meta.get(self.dispatched).and_then(|m| gate.now.duration_since(m.received).ok());
        let cut_short = self.dispatched + batch.revisions_consumed < self.pending.len();
        let linger = watch_linger(
            gate.linger,
            gate.depth,
            self.running,
            batch.ops.len(),
            gate.limits.max_ops,
            cut_short,
            waited.unwrap_or_default(),
        );
        if let Some(wait) = linger {
            return Next::Linger(wait);
        }
        Next::Send(self.dispatch(batch, gate.depth))
    }

    /// Takes `batch` as sent.
    fn dispatch(&mut self, batch: WatchBatch, depth: usize) -> Dispatch {
        // One Txn in flight at a time (a peer next door): the peer holds everything before this
        // batch, and so all of it once it lands. With more, a Txn sent alone must not claim its
        // own batch either: the record keeps the highest (complete, sent) pair, and the Txns sent
        // right after it claim less, so its pair would win over theirs and hide what they sent.
        let progress =
            if depth <= 1 && self.inflight.is_empty() { batch.applied_through.max(self.applied) } else { self.applied };
        let first = self.pending[self.dispatched].revision;
        let carried = match batch.revisions_consumed {
            0 => first,
            _ => batch.applied_through,
        };
        self.through_dispatched = self.through_dispatched.max(batch.applied_through);
        self.sent_through = self.sent_through.max(carried);
        self.dispatched += batch.revisions_consumed;
        let revisions = Some((first, carried));
        self.push(batch, progress, revisions)
    }

    /// Once everything landed and nothing waits, a Txn that records what Txns sent together
    /// recorded less of, so that a successor resumes exactly here. None when not needed, or when
    /// `held`.
    pub fn flush(&mut self, held: bool) -> Option<Dispatch> {
        if held || !self.inflight.is_empty() || !self.pending.is_empty() || self.applied <= self.recorded {
            return None;
        }
        let batch =
            WatchBatch { ops: Vec::new(), applied_through: self.applied, revisions_consumed: 0, split_ops_consumed: 0 };
        Some(self.push(batch, self.applied, None))
    }

    fn push(&mut self, batch: WatchBatch, progress: i64, revisions: Option<(i64, i64)>) -> Dispatch {
        let keys: Vec<u64> = batch.ops.iter().map(|op| self.hasher.hash_one(op.key())).collect();
        let bytes = batch.ops.iter().map(MirrorOp::wire_size).sum();
        for key in &keys {
            *self.busy.entry(*key).or_default() += 1;
        }
        self.running += 1;
        self.bytes += bytes;
        self.next_id += 1;
        self.sent += 1;
        self.inflight.push_back(InFlight {
            id: self.next_id,
            revisions_consumed: batch.revisions_consumed,
            split_ops_consumed: batch.split_ops_consumed,
            applied_through: batch.applied_through,
            progress,
            ops: batch.ops.len(),
            bytes,
            keys,
            outcome: None,
            released: false,
        });
        Dispatch { id: self.next_id, ops: batch.ops, progress, sent_through: self.sent_through, revisions }
    }

    // --- What the peer answered -----------------------------------------------------------------

    /// The peer's answer to Txn `id`. One that applied frees its slot and keys at once, whichever
    /// order answers come in; one that failed keeps them busy, since it may still land.
    pub fn answered(&mut self, id: u64, outcome: Outcome) {
        let Some(index) = self.inflight.iter().position(|b| b.id == id) else { return };
        if matches!(outcome, Outcome::Applied) {
            self.release(index);
        }
        self.inflight[index].outcome = Some(outcome);
    }

    fn release(&mut self, index: usize) {
        let batch = &mut self.inflight[index];
        if batch.released {
            return;
        }
        batch.released = true;
        self.running -= 1;
        self.bytes -= batch.bytes;
        for key in &batch.keys {
            if let Some(n) = self.busy.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    self.busy.remove(key);
                }
            }
        }
    }

    /// The oldest Txn sent, once the peer answered it. Those answered after it wait their turn.
    pub fn take_landed(&mut self) -> Option<Taken> {
        let batch = self.inflight.front_mut()?;
        match batch.outcome.take()? {
            Outcome::Applied => {}
            Outcome::Fenced(by) => return Some(Taken::Fenced(by)),
            Outcome::Failed(error) => return Some(Taken::Failed(error)),
        }
        let batch = self.inflight.pop_front().expect("just seen");
        self.recorded = self.recorded.max(batch.progress);
        self.landed += 1;
        self.dispatched -= batch.revisions_consumed;
        let mut deltas = Vec::new();
        for _ in 0..batch.revisions_consumed {
            if let Some(revision) = self.pending.pop_front() {
                self.pending_ops -= revision.ops.len();
            }
            if let Some(meta) = self.meta.pop_front() {
                self.pending_bytes -= meta.bytes;
                for (shard, delta, _) in meta.deltas {
                    self.pending_keys -= delta;
                    deltas.push((shard, delta));
                }
            }
        }
        let split_started = match self.pending.front() {
            Some(next)
                if batch.split_ops_consumed > 0 && self.split == 0 && !self.catch_up.is_coalesced(next.revision) =>
            {
                Some((next.revision, next.ops.len()))
            }
            _ => None,
        };
        self.split = batch.split_ops_consumed;
        self.applied = self.applied.max(batch.applied_through);
        Some(Taken::Landed(Landed { ops: batch.ops, deltas, split_started }))
    }

    // --- What the loop reads --------------------------------------------------------------------

    /// The revision the peer holds completely.
    pub fn applied(&self) -> i64 {
        self.applied
    }

    /// Nothing in flight and nothing waiting.
    pub fn quiet(&self) -> bool {
        self.inflight.is_empty() && self.pending.is_empty()
    }

    pub fn in_flight(&self) -> bool {
        !self.inflight.is_empty()
    }

    /// Txns in flight that the peer has not answered as applied.
    pub fn running(&self) -> usize {
        self.running
    }

    /// A revision is applying in parts: the peer holds part of it.
    pub fn split_open(&self) -> bool {
        self.split > 0
    }

    pub fn catching_up(&self) -> bool {
        self.catch_up.holds_back()
    }

    /// Writes a resumed watch coalesced, and the keys they came to.
    pub fn coalesced(&self) -> (usize, usize) {
        (self.catch_up.absorbed, self.pending.front().map_or(0, |merged| merged.ops.len()))
    }

    pub fn pending_keys(&self) -> i64 {
        self.pending_keys
    }

    /// When the oldest revision not yet landed arrived.
    pub fn oldest_pending(&self) -> Option<SystemTime> {
        self.meta.front().map(|m| m.received)
    }

    /// Txns sent, and taken as landed, in this session.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    pub fn landed(&self) -> u64 {
        self.landed
    }

    /// Idle, and told that nothing is missing up to a revision past the applied one: the revision
    /// to report as applied (never to record: see `watch.rs`).
    pub fn idle_watermark(&self) -> Option<i64> {
        (self.quiet() && self.delivered > self.applied).then_some(self.delivered)
    }
}

#[cfg(test)]
mod tests;
