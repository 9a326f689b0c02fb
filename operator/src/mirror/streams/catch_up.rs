//! Resuming without replaying what the peer already holds (pure).
//!
//! A successor resumes after the revision the progress record holds, but its predecessor's last
//! Txns may have landed past it: batches in flight together record only what the peer held
//! completely when they were sent. Replayed one by one, those revisions would take a key back to
//! a value older than one a consumer already read. So a resumed watch first coalesces every
//! revision up to the newest the predecessor may have sent (the record says, or else the origin's
//! revision when the watch began: the predecessor was fenced before) into one entry, each key's
//! last write only, and applies that entry only once the watch has delivered everything up to
//! it. Each key then moves from whatever the predecessor left straight to its value at that
//! revision, never backwards. A predecessor that kept one Txn in flight at a time (a peer next
//! door) sent nothing past its record: its successor replays nothing and coalesces nothing.
use crate::mirror::plan::{MirrorOp, Revision};
use std::collections::{HashMap, VecDeque};

/// Where a resumed watch is in its catch-up.
#[derive(Debug, Default)]
pub(in crate::mirror) struct CatchUp {
    stage: Stage,
    /// Where each key's op sits in the coalesced entry.
    index: HashMap<Vec<u8>, usize>,
    /// The coalesced entry's revision (its newest write's), once it holds one.
    merged: Option<i64>,
    /// Writes the coalesced entry absorbed.
    pub absorbed: usize,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Nothing to catch up: the watch follows a sync, or the origin had nothing new.
    #[default]
    Done,
    /// Resumed: the watch has not said yet which revision it started at; the peer may hold
    /// writes up to `bound`.
    Starting { bound: i64 },
    /// Coalescing every revision up to `through`, the origin's revision when the watch began.
    Coalescing { through: i64 },
}

impl CatchUp {
    /// A watch that resumes after `applied` from the records, where the peer may hold writes up
    /// to `peer_may_hold_through`; None after a sync, which left the peer at exactly `applied`.
    pub fn new(peer_may_hold_through: Option<i64>) -> Self {
        let stage = match peer_may_hold_through {
            Some(bound) => Stage::Starting { bound },
            None => Stage::Done,
        };
        CatchUp { stage, ..Default::default() }
    }

    /// The watch was created at the origin's `revision`; the peer holds at least `applied`.
    pub fn started(&mut self, revision: i64, applied: i64) {
        if let Stage::Starting { bound } = self.stage {
            let through = revision.min(bound);
            self.stage = if through > applied { Stage::Coalescing { through } } else { Stage::Done };
        }
    }

    /// Whether batches wait: until the watch delivered everything up to where it began.
    pub fn holds_back(&self) -> bool {
        self.stage != Stage::Done
    }

    /// The watch's delivery is known complete through `revision` (a whole response's last event,
    /// or a progress notification): from the revision the watch began at, the catch-up ends.
    /// Returns whether this ended it.
    pub fn delivered_through(&mut self, revision: i64) -> bool {
        if let Stage::Coalescing { through } = self.stage
            && revision >= through
        {
            self.stage = Stage::Done;
            return true;
        }
        false
    }

    /// The pending revisions' bounds were reached before the watch caught up: what was coalesced
    /// is applied, and later revisions follow one by one.
    pub fn give_up(&mut self) {
        self.stage = Stage::Done;
    }

    /// Adds `op`, written at `revision`, to the coalesced entry at the back of `pending` if it
    /// belongs there, and returns whether it did and the op it replaced (its key's earlier write).
    pub fn absorb(&mut self, pending: &mut VecDeque<Revision>, revision: i64, op: MirrorOp) -> Absorbed {
        let Stage::Coalescing { through } = self.stage else { return Absorbed::No(op) };
        if revision > through {
            return Absorbed::No(op);
        }
        self.absorbed += 1;
        // Revisions arrive in order, so the coalesced entry stays at the back until it is done.
        if self.merged.is_none() {
            pending.push_back(Revision { revision, ops: Vec::new() });
        }
        self.merged = Some(revision);
        let merged = pending.back_mut().expect("the coalesced entry is at the back");
        merged.revision = revision;
        match self.index.get(op.key()) {
            Some(&i) => Absorbed::Replacing(i, std::mem::replace(&mut merged.ops[i], op)),
            None => {
                let i = merged.ops.len();
                self.index.insert(op.key().to_vec(), i);
                merged.ops.push(op);
                Absorbed::New(i)
            }
        }
    }

    /// Whether the pending entry at `revision` is the coalesced one: split into parts, it is not
    /// an origin revision too large for one Txn.
    pub fn is_coalesced(&self, revision: i64) -> bool {
        self.merged == Some(revision)
    }
}

/// What [`CatchUp::absorb`] did with an op.
#[derive(Debug, PartialEq, Eq)]
pub(in crate::mirror) enum Absorbed {
    /// Not part of the catch-up: the caller queues it as usual.
    No(MirrorOp),
    /// Coalesced, the first write of its key, at this index of the entry's ops.
    New(usize),
    /// Coalesced over its key's earlier write (returned), at this index of the entry's ops.
    Replacing(usize, MirrorOp),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mirror::plan::{TxnLimits, next_watch_batch};
    use crate::mirror::records::checkpoint::SENT_UNKNOWN;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn put(key: &str, value: &str) -> MirrorOp {
        MirrorOp::Put { key: key.into(), value: value.into(), shard: 0 }
    }

    fn feed(catch_up: &mut CatchUp, pending: &mut VecDeque<Revision>, revision: i64, op: MirrorOp) {
        if let Absorbed::No(op) = catch_up.absorb(pending, revision, op) {
            pending.push_back(Revision { revision, ops: vec![op] });
        }
    }

    #[test]
    fn a_watch_after_a_sync_applies_revisions_as_they_come() {
        let mut catch_up = CatchUp::new(None);
        catch_up.started(50, 10);
        assert!(!catch_up.holds_back());
        let mut pending = VecDeque::new();
        assert_eq!(catch_up.absorb(&mut pending, 11, put("k", "1")), Absorbed::No(put("k", "1")));
    }

    #[test]
    fn a_resumed_watch_holds_back_until_it_has_seen_where_it_began() {
        let mut catch_up = CatchUp::new(Some(i64::MAX));
        assert!(catch_up.holds_back(), "nothing is applied before the watch says where it began");
        catch_up.started(20, 10);
        let mut pending = VecDeque::new();
        feed(&mut catch_up, &mut pending, 11, put("a", "1"));
        feed(&mut catch_up, &mut pending, 12, put("b", "1"));
        feed(&mut catch_up, &mut pending, 13, put("a", "2"));
        catch_up.delivered_through(19);
        assert!(catch_up.holds_back());
        catch_up.delivered_through(20);
        assert!(!catch_up.holds_back());
        assert_eq!(pending.len(), 1, "one coalesced entry");
        assert_eq!(pending[0].revision, 13);
        assert_eq!(pending[0].ops, vec![put("a", "2"), put("b", "1")], "each key's last write, once");
        assert!(catch_up.is_coalesced(13));
        assert_eq!(catch_up.absorbed, 3);
        feed(&mut catch_up, &mut pending, 21, put("a", "3"));
        assert_eq!(pending.len(), 2, "revisions after the catch-up are queued one by one");
    }

    #[test]
    fn only_what_the_predecessor_may_have_sent_is_coalesced() {
        let mut catch_up = CatchUp::new(Some(12));
        catch_up.started(20, 10);
        let mut pending = VecDeque::new();
        feed(&mut catch_up, &mut pending, 11, put("a", "1"));
        feed(&mut catch_up, &mut pending, 12, put("a", "2"));
        assert!(catch_up.delivered_through(12), "caught up at what was sent, not at the head");
        feed(&mut catch_up, &mut pending, 13, put("a", "3"));
        assert_eq!(pending.len(), 2);
        let mut exact = CatchUp::new(Some(10));
        exact.started(20, 10);
        assert!(!exact.holds_back(), "a record that says nothing was sent past it: plain replay");
    }

    #[test]
    fn an_origin_with_nothing_new_has_nothing_to_catch_up() {
        let mut catch_up = CatchUp::new(Some(i64::MAX));
        catch_up.started(10, 10);
        assert!(!catch_up.holds_back());
    }

    #[test]
    fn the_coalesced_entry_returns_the_write_it_replaced() {
        let mut catch_up = CatchUp::new(Some(i64::MAX));
        catch_up.started(20, 10);
        let mut pending = VecDeque::new();
        assert_eq!(catch_up.absorb(&mut pending, 11, put("a", "1")), Absorbed::New(0));
        let delete = MirrorOp::Delete { key: b"a".to_vec() };
        assert_eq!(catch_up.absorb(&mut pending, 12, delete.clone()), Absorbed::Replacing(0, put("a", "1")));
        assert_eq!(pending[0].ops, vec![delete]);
    }

    /// One origin write: a key and its value (None deletes it).
    type Write = (u8, Option<u8>);

    /// A key's value as a consumer reads it, with the index of the origin write that set it.
    type Seen = BTreeMap<u8, (Option<u8>, usize)>;

    fn apply(peer: &mut Seen, key: u8, value: Option<u8>, at: usize, consumer: &mut Vec<(u8, usize)>) {
        peer.insert(key, (value, at));
        consumer.push((key, at));
    }

    proptest! {
        /// Whatever the predecessor landed past its record (any prefix of each key's writes: Txns
        /// in flight together write disjoint keys), the successor's catch-up, in Txns of any size
        /// and its parts in any order, moves every key forward only, and ends at the origin's state.
        #[test]
        fn a_successor_moves_every_key_forward_only(
            writes in proptest::collection::vec((0u8..6, proptest::option::of(0u8..4)), 1..60),
            recorded_frac in 0.0f64..1.0,
            landed in proptest::collection::vec(0usize..60, 6),
            head_extra in 0usize..10,
            max_ops in 1usize..5,
            reversed in any::<bool>(),
            recorded_bound in any::<bool>(),
        ) {
            // Origin revision of write i is i + 1.
            let recorded = (writes.len() as f64 * recorded_frac) as usize;
            let head = (recorded + head_extra).min(writes.len());
            // The peer holds the recorded prefix, and per key up to `landed[key]` more of that
            // key's writes among those before the head (the predecessor was fenced before the head).
            let mut peer: Seen = BTreeMap::new();
            let mut consumer = Vec::new();
            for (i, (k, v)) in writes[..recorded].iter().enumerate() {
                apply(&mut peer, *k, *v, i, &mut consumer);
            }
            let mut more = [0usize; 6];
            for (i, (k, v)) in writes.iter().enumerate().take(head).skip(recorded) {
                let k_index = *k as usize;
                if more[k_index] < landed[k_index] {
                    more[k_index] += 1;
                    apply(&mut peer, *k, *v, i, &mut consumer);
                } else {
                    more[k_index] = usize::MAX;  // a key's writes land in order: none after a gap
                }
            }
            consumer.clear();
            let start: Seen = peer.clone();
            // The successor: watch from recorded + 1, begun at the head.
            // The record bounds what the predecessor sent, or does not say.
            let sent = writes.iter().enumerate().take(head).skip(recorded).filter(|(i, (k, _))| {
                let before = writes[recorded..*i].iter().filter(|(k2, _)| k2 == k).count();
                before < landed[*k as usize]
            }).map(|(i, _)| i as i64 + 1).max().unwrap_or(recorded as i64);
            let mut catch_up = CatchUp::new(Some(if recorded_bound { sent } else { SENT_UNKNOWN }));
            catch_up.started(head as i64, recorded as i64);
            let mut pending = VecDeque::new();
            let op = |(k, v): Write| match v {
                Some(v) => MirrorOp::Put { key: vec![k], value: vec![v], shard: 0 },
                None => MirrorOp::Delete { key: vec![k] },
            };
            for (i, w) in writes.iter().enumerate().skip(recorded) {
                feed(&mut catch_up, &mut pending, i as i64 + 1, op(*w));
                catch_up.delivered_through(i as i64 + 1);
            }
            catch_up.delivered_through(head as i64);
            prop_assert!(!catch_up.holds_back());
            let index_of = |revision: i64, key: u8| -> usize {
                // The origin write that set `key` at or before `revision`.
                (0..revision as usize).rev().find(|i| writes[*i].0 == key).expect("written")
            };
            let limits = TxnLimits { max_ops, max_bytes: usize::MAX };
            let mut split = 0;
            while let Some(batch) = next_watch_batch(pending.iter(), split, 0, limits, |_| false) {
                let mut ops = batch.ops.clone();
                if reversed { ops.reverse(); }
                let through = if batch.revisions_consumed > 0 { pending[batch.revisions_consumed - 1].revision } else { pending[0].revision };
                for o in ops {
                    let key = o.key()[0];
                    let value = match o { MirrorOp::Put { value, .. } => Some(value[0]), MirrorOp::Delete { .. } => None };
                    apply(&mut peer, key, value, index_of(through, key), &mut consumer);
                }
                split = batch.split_ops_consumed;
                for _ in 0..batch.revisions_consumed { pending.pop_front(); }
                if pending.is_empty() { break; }
            }
            // Forward only: each key's writes as the consumer saw them never go back.
            let mut last: BTreeMap<u8, usize> = start.iter().map(|(k, (_, at))| (*k, *at)).collect();
            for (key, at) in consumer {
                if let Some(before) = last.get(&key) {
                    prop_assert!(at >= *before, "key {} went back from write {} to {}", key, before, at);
                }
                last.insert(key, at);
            }
            // And the peer ends at the origin's state.
            let mut origin: BTreeMap<u8, Option<u8>> = BTreeMap::new();
            for (k, v) in &writes { origin.insert(*k, *v); }
            let peer_values: BTreeMap<u8, Option<u8>> = peer.into_iter().map(|(k, (v, _))| (k, v)).collect();
            prop_assert_eq!(peer_values, origin);
        }
    }
}
