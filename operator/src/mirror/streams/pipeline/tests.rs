//! The pipeline against a simulated peer that applies Txns in any order, times them out, lands
//! them late and gets fenced: each key moves forward only, the progress record never claims more
//! than the peer holds (nor less than it may hold), the applied revision never runs ahead of the
//! peer, and with every answer given the peer ends equal to the origin.
use super::*;
use crate::mirror::records::checkpoint::SENT_UNKNOWN;
use proptest::prelude::*;
use std::collections::BTreeMap;

fn put(key: &str, value: &str) -> MirrorOp {
    MirrorOp::Put { key: key.into(), value: value.into(), shard: 0 }
}

fn gate(depth: usize, max_ops: usize) -> Gate {
    Gate {
        depth,
        limits: TxnLimits { max_ops, max_bytes: usize::MAX },
        held: false,
        last_partial: false,
        renewals_failing: false,
        linger: Duration::ZERO,
        now: SystemTime::now(),
    }
}

fn send(pipeline: &mut Pipeline, gate: Gate) -> Dispatch {
    match pipeline.next(gate) {
        Next::Send(dispatch) => dispatch,
        other => panic!("expected a Txn to send, got {other:?}"),
    }
}

fn landed(pipeline: &mut Pipeline) -> Landed {
    match pipeline.take_landed() {
        Some(Taken::Landed(landed)) => landed,
        other => panic!("expected a landed Txn, got {other:?}"),
    }
}

#[test]
fn a_txn_that_timed_out_keeps_its_keys_busy_so_no_later_write_of_them_can_land_first() {
    let mut pipeline = Pipeline::new(0, None);
    let now = SystemTime::now();
    pipeline.receive(1, put("k1", "a"), 0, 1, now);
    pipeline.receive(2, put("k2", "a"), 0, 1, now);
    let first = send(&mut pipeline, gate(4, 1));
    let second = send(&mut pipeline, gate(4, 1));
    pipeline.answered(first.id, Outcome::Failed(anyhow::anyhow!("peer txn: timed out after 3s")));
    pipeline.answered(second.id, Outcome::Applied);
    // k2's next write may go at once (its Txn applied, though not yet taken); k1's may not.
    pipeline.receive(3, put("k2", "b"), 0, 0, now);
    let third = send(&mut pipeline, gate(4, 1));
    assert_eq!(third.ops, vec![put("k2", "b")], "the key whose Txn applied is free");
    pipeline.receive(4, put("k1", "b"), 0, 0, now);
    assert!(matches!(pipeline.next(gate(4, 1)), Next::Wait), "k1 stays busy behind its timed-out Txn");
    assert!(matches!(pipeline.take_landed(), Some(Taken::Failed(_))), "the failure ends the session in turn");
}

#[test]
fn txns_are_taken_as_landed_in_the_order_sent_whatever_order_the_peer_answered() {
    let mut pipeline = Pipeline::new(10, None);
    let now = SystemTime::now();
    for (revision, key) in [(11, "a"), (12, "b"), (13, "c")] {
        pipeline.receive(revision, put(key, "v"), 0, 1, now);
    }
    let ids: Vec<u64> = (0..3).map(|_| send(&mut pipeline, gate(8, 1)).id).collect();
    pipeline.answered(ids[2], Outcome::Applied);
    pipeline.answered(ids[1], Outcome::Applied);
    assert!(pipeline.take_landed().is_none(), "the oldest is not answered yet");
    assert_eq!(pipeline.applied(), 10);
    pipeline.answered(ids[0], Outcome::Applied);
    for expected in [11, 12, 13] {
        landed(&mut pipeline);
        assert_eq!(pipeline.applied(), expected);
    }
    assert!(pipeline.quiet());
}

#[test]
fn txns_in_flight_together_record_only_what_the_peer_held_when_they_were_sent_and_a_flush_records_the_rest() {
    let mut pipeline = Pipeline::new(10, None);
    let now = SystemTime::now();
    pipeline.receive(11, put("a", "v"), 0, 1, now);
    pipeline.receive(12, put("b", "v"), 0, 1, now);
    let first = send(&mut pipeline, gate(8, 1));
    let second = send(&mut pipeline, gate(8, 1));
    // Sent alone, the first would complete 11; but the record keeps the highest pair, and
    // (11, 11) over the second's (10, 12) would hide that 12 was sent.
    assert_eq!((first.progress, first.sent_through), (10, 11));
    assert_eq!((second.progress, second.sent_through), (10, 12), "sent beside the first: 11 may not have landed");
    pipeline.answered(first.id, Outcome::Applied);
    pipeline.answered(second.id, Outcome::Applied);
    landed(&mut pipeline);
    landed(&mut pipeline);
    let flush = pipeline.flush(false).expect("12 is applied and recorded only as 11");
    assert!(flush.ops.is_empty());
    assert_eq!((flush.progress, flush.sent_through), (12, 12));
    pipeline.answered(flush.id, Outcome::Applied);
    landed(&mut pipeline);
    assert!(pipeline.flush(false).is_none(), "everything is recorded");
}

#[test]
fn next_door_one_txn_at_a_time_records_exactly_what_it_applied() {
    let mut pipeline = Pipeline::new(10, None);
    let now = SystemTime::now();
    pipeline.receive(11, put("a", "v"), 0, 1, now);
    pipeline.receive(12, put("b", "v"), 0, 1, now);
    let first = send(&mut pipeline, gate(1, 1));
    assert!(matches!(pipeline.next(gate(1, 1)), Next::Wait), "one in flight");
    assert_eq!((first.progress, first.sent_through), (11, 11));
    pipeline.answered(first.id, Outcome::Applied);
    landed(&mut pipeline);
    let second = send(&mut pipeline, gate(1, 1));
    assert_eq!((second.progress, second.sent_through), (12, 12));
    pipeline.answered(second.id, Outcome::Applied);
    landed(&mut pipeline);
    assert!(pipeline.flush(false).is_none(), "nothing left to record: no extra Txn next door");
}

#[test]
fn a_revision_too_large_for_one_txn_goes_alone_in_parts_after_everything_before_it() {
    let mut pipeline = Pipeline::new(0, None);
    let now = SystemTime::now();
    pipeline.receive(1, put("x", "v"), 0, 1, now);
    for key in ["a", "b", "c"] {
        pipeline.receive(2, put(key, "v"), 0, 1, now);
    }
    let first = send(&mut pipeline, gate(8, 2));
    assert_eq!(first.revisions, Some((1, 1)));
    assert!(matches!(pipeline.next(gate(8, 2)), Next::Wait), "the large revision waits for 1 to land");
    pipeline.answered(first.id, Outcome::Applied);
    landed(&mut pipeline);
    let part = send(&mut pipeline, gate(8, 2));
    assert_eq!((part.ops.len(), part.revisions), (2, Some((2, 2))));
    assert!(matches!(pipeline.next(gate(8, 2)), Next::Wait), "one part at a time");
    pipeline.answered(part.id, Outcome::Applied);
    let landed_part = landed(&mut pipeline);
    assert_eq!(landed_part.split_started, Some((2, 3)), "said once, when the first part landed");
    assert_eq!(pipeline.applied(), 1, "the peer holds part of 2");
    assert!(pipeline.split_open());
    let rest = send(&mut pipeline, gate(8, 2));
    assert_eq!(rest.ops, vec![put("c", "v")]);
    pipeline.answered(rest.id, Outcome::Applied);
    assert_eq!(landed(&mut pipeline).split_started, None);
    assert_eq!(pipeline.applied(), 2);
    assert!(!pipeline.split_open());
}

#[test]
fn a_resumed_watch_sends_nothing_until_it_caught_up() {
    let mut pipeline = Pipeline::new(10, Some(12));
    pipeline.started(14);
    let now = SystemTime::now();
    pipeline.receive(11, put("a", "1"), 0, 1, now);
    pipeline.receive(12, put("a", "2"), 0, 0, now);
    assert!(matches!(pipeline.next(gate(8, 8)), Next::Wait), "the catch-up holds the batches back");
    assert!(pipeline.delivered_through(12), "12 is as far as the predecessor may have sent");
    let merged = send(&mut pipeline, gate(8, 8));
    assert_eq!(merged.ops, vec![put("a", "2")], "each key's newest write only");
}

#[test]
fn a_resumed_session_records_at_least_what_its_predecessor_may_have_sent() {
    // The predecessor recorded 10 complete and may have sent up to 14; the origin is at 20.
    let mut pipeline = Pipeline::new(10, Some(14));
    pipeline.started(20);
    let now = SystemTime::now();
    pipeline.receive(12, put("a", "12"), 0, 0, now);
    assert_eq!(pipeline.give_up_catch_up(), Some(1), "the pending bounds cut the catch-up short at 12");
    let first = send(&mut pipeline, gate(1, 8));
    assert_eq!((first.progress, first.sent_through), (12, 14), "still bounds what the predecessor may have landed");
    // Unknown (no record, or one of an earlier version): the catch-up's own Txns say.
    let mut unknown = Pipeline::new(10, Some(SENT_UNKNOWN));
    unknown.started(20);
    unknown.receive(12, put("a", "12"), 0, 0, now);
    assert!(unknown.delivered_through(20));
    let merged = send(&mut unknown, gate(1, 8));
    assert_eq!((merged.progress, merged.sent_through), (12, 12));
}

#[test]
fn renewals_failing_let_one_txn_go_at_a_time() {
    let mut pipeline = Pipeline::new(0, None);
    let now = SystemTime::now();
    pipeline.receive(1, put("a", "v"), 0, 1, now);
    pipeline.receive(2, put("b", "v"), 0, 1, now);
    let failing = Gate { renewals_failing: true, ..gate(8, 1) };
    send(&mut pipeline, failing);
    assert!(matches!(pipeline.next(failing), Next::Wait));
    assert!(matches!(pipeline.next(gate(8, 1)), Next::Send(_)), "renewals back: the window opens");
}

#[test]
fn a_lease_split_moves_waiting_writes_and_their_counts_to_the_new_shards() {
    let mut layout = Layout::uniform(1);
    let other = layout.split(0).expect("a uniform shard splits");
    let moved = (0..64)
        .map(|i| format!("k{i}"))
        .find(|key| layout.shard_of(key.as_bytes()) == other)
        .expect("some key hashes to the new shard");
    let stays =
        (0..64).map(|i| format!("k{i}")).find(|key| layout.shard_of(key.as_bytes()) != other).expect("some key stays");
    let mut pipeline = Pipeline::new(0, Some(2));
    pipeline.started(2);
    let now = SystemTime::now();
    // A catch-up's coalesced entry holds more counts than ops: each count must follow its key.
    pipeline.receive(1, put(&stays, "1"), 0, 1, now);
    pipeline.receive(2, put(&stays, "2"), 0, 0, now);
    pipeline.receive(2, put(&moved, "1"), 0, 1, now);
    pipeline.retarget(&layout);
    assert!(pipeline.delivered_through(2));
    let dispatch = send(&mut pipeline, gate(8, 8));
    let moved_put = MirrorOp::Put { key: moved.clone().into_bytes(), value: b"1".to_vec(), shard: other };
    assert!(dispatch.ops.contains(&moved_put), "{:?}", dispatch.ops);
    pipeline.answered(dispatch.id, Outcome::Applied);
    let deltas = landed(&mut pipeline).deltas;
    let kept = layout.shard_of(stays.as_bytes());
    assert_eq!(deltas, vec![(kept, 1), (kept, 0), (other, 1)]);
}

// --- The simulated peer ----------------------------------------------------------------------------

/// The origin's history: for each revision (1..), its writes (key, value or None for a delete).
type History = Vec<Vec<(u8, Option<u8>)>>;

fn key_of(k: u8) -> Vec<u8> {
    format!("k{k}").into_bytes()
}

/// A put's value names its revision, so the peer knows which write it holds.
fn value_of(revision: i64, v: u8) -> Vec<u8> {
    format!("{revision}:{v}").into_bytes()
}

/// The peer: per key the revision of the origin write it holds, the progress record, the fence.
#[derive(Default)]
struct Peer {
    held: BTreeMap<Vec<u8>, i64>,
    record: (i64, i64),
    fenced: bool,
}

/// A Txn on its way: sent, maybe applied, maybe answered.
struct Wire {
    dispatch: Dispatch,
    applied: bool,
    answered: bool,
}

struct Sim {
    history: History,
    fed: usize,
    pipeline: Pipeline,
    peer: Peer,
    wire: Vec<Wire>,
    /// The session ended (a fenced or failed Txn was taken): nothing more is fed or sent.
    ended: bool,
    /// The key-count changes of the Txns taken as landed, added up (the worker's count).
    landed_keys: i64,
    failures: bool,
    gate: Gate,
}

impl Sim {
    /// The revision of `key`'s newest write in `from..=to`, if any.
    fn write_in(&self, key: &[u8], from: i64, to: i64) -> Option<(i64, Option<u8>)> {
        (from..=to).rev().find_map(|revision| {
            self.history[(revision - 1) as usize].iter().find(|(k, _)| key_of(*k) == key).map(|(_, v)| (revision, *v))
        })
    }

    /// The revision of the write `key` holds at the origin's `revision` (0: never written).
    fn origin_at(&self, key: &[u8], revision: i64) -> i64 {
        self.write_in(key, 1, revision).map_or(0, |(r, _)| r)
    }

    /// The keys the origin holds at `revision`.
    fn origin_keys_at(&self, revision: i64) -> i64 {
        self.keys().iter().filter(|k| self.write_in(k, 1, revision).is_some_and(|(_, v)| v.is_some())).count() as i64
    }

    fn keys(&self) -> Vec<Vec<u8>> {
        let mut keys: Vec<_> = self.history.iter().flatten().map(|(k, _)| key_of(*k)).collect();
        keys.sort();
        keys.dedup();
        keys
    }

    /// Whether the peer holds at least the origin's state at `revision`.
    fn peer_holds(&self, revision: i64) -> bool {
        self.keys().iter().all(|k| self.peer.held.get(k).copied().unwrap_or(0) >= self.origin_at(k, revision))
    }

    fn feed(&mut self) {
        if self.ended || self.fed == self.history.len() {
            return;
        }
        self.fed += 1;
        let revision = self.fed as i64;
        for (k, v) in self.history[self.fed - 1].clone() {
            let existed = self.write_in(&key_of(k), 1, revision - 1).is_some_and(|(_, v)| v.is_some());
            let (op, delta) = match v {
                Some(v) => {
                    (MirrorOp::Put { key: key_of(k), value: value_of(revision, v), shard: 0 }, i64::from(!existed))
                }
                None => (MirrorOp::Delete { key: key_of(k) }, -i64::from(existed)),
            };
            self.pipeline.receive(revision, op, 0, delta, SystemTime::now());
        }
        self.pipeline.delivered_through(revision);
        self.pipeline.progress_notified(revision);
    }

    fn send(&mut self) -> Result<(), TestCaseError> {
        if self.ended {
            return Ok(());
        }
        while let Next::Send(dispatch) = self.pipeline.next(self.gate) {
            self.sent(dispatch)?;
        }
        if let Some(dispatch) = self.pipeline.flush(false) {
            self.sent(dispatch)?;
        }
        Ok(())
    }

    /// A Txn goes: the keys its progress record says the peer holds at its revision are the
    /// origin's at that revision.
    fn sent(&mut self, dispatch: Dispatch) -> Result<(), TestCaseError> {
        let recorded = self.landed_keys + self.pipeline.pending_keys_through(dispatch.progress);
        prop_assert_eq!(
            recorded,
            self.origin_keys_at(dispatch.progress),
            "the keys recorded with revision {}",
            dispatch.progress
        );
        self.wire.push(Wire { dispatch, applied: false, answered: false });
        Ok(())
    }

    /// The peer applies Txn `index` of the wire (fenced: nothing), checking each key moves
    /// forward to the very write the origin made.
    fn apply(&mut self, index: usize) -> Result<(), TestCaseError> {
        let Some(wire) = self.wire.get(index) else { return Ok(()) };
        if wire.applied || self.peer.fenced {
            return Ok(());
        }
        let dispatch = &wire.dispatch;
        for op in &dispatch.ops {
            let (from, to) = dispatch.revisions.expect("a Txn with ops names its revisions");
            let write = self.write_in(op.key(), from, to);
            let Some((revision, value)) = write else {
                return Err(TestCaseError::fail(format!("{op:?} is no write of revisions {from}..={to}")));
            };
            let expected = match value {
                Some(v) => MirrorOp::Put { key: op.key().to_vec(), value: value_of(revision, v), shard: 0 },
                None => MirrorOp::Delete { key: op.key().to_vec() },
            };
            prop_assert_eq!(op, &expected, "not the key's newest write in {}..={}", from, to);
            let held = self.peer.held.get(op.key()).copied().unwrap_or(0);
            prop_assert!(
                revision > held,
                "{:?} went back from the write of revision {} to that of {}",
                String::from_utf8_lossy(op.key()),
                held,
                revision
            );
            self.peer.held.insert(op.key().to_vec(), revision);
        }
        self.peer.record = self.peer.record.max((dispatch.progress, dispatch.sent_through));
        self.wire[index].applied = true;
        self.check_record()
    }

    /// The record never claims the peer holds more than it does, nor that it may hold less.
    fn check_record(&self) -> Result<(), TestCaseError> {
        let (complete, sent) = self.peer.record;
        prop_assert!(self.peer_holds(complete), "the record says {} is complete; the peer lacks part of it", complete);
        let newest = self.peer.held.values().copied().max().unwrap_or(0);
        prop_assert!(newest <= sent.max(complete), "the peer holds a write of {} past the record's {}", newest, sent);
        Ok(())
    }

    /// The client hears the answer to Txn `index`: applied, fenced, or (not applied, or the
    /// answer lost) a timeout.
    fn answer(&mut self, index: usize, time_out: bool) -> Result<(), TestCaseError> {
        let Some(wire) = self.wire.get_mut(index) else { return Ok(()) };
        if wire.answered || (!wire.applied && !time_out && !self.peer.fenced) {
            return Ok(());
        }
        wire.answered = true;
        let outcome = match (time_out, wire.applied) {
            (true, _) => Outcome::Failed(anyhow::anyhow!("peer txn: timed out")),
            (false, true) => Outcome::Applied,
            (false, false) => Outcome::Fenced("a successor".into()),
        };
        self.failures |= time_out;
        let id = wire.dispatch.id;
        if self.ended {
            return Ok(());
        }
        self.pipeline.answered(id, outcome);
        while let Some(taken) = self.pipeline.take_landed() {
            match taken {
                Taken::Landed(landed) => self.landed_keys += landed.deltas.iter().map(|(_, d)| d).sum::<i64>(),
                Taken::Fenced(_) | Taken::Failed(_) => {
                    self.ended = true;
                    break;
                }
            }
        }
        let applied = self.pipeline.applied();
        prop_assert!(self.peer_holds(applied), "the pipeline says {} is applied; the peer lacks part of it", applied);
        Ok(())
    }

    /// The `pick`th Txn on the wire for which `eligible` holds.
    fn pick(&self, pick: usize, eligible: impl Fn(&Wire) -> bool) -> Option<usize> {
        let candidates: Vec<usize> = (0..self.wire.len()).filter(|i| eligible(&self.wire[*i])).collect();
        (!candidates.is_empty()).then(|| candidates[pick % candidates.len()])
    }

    fn step(&mut self, action: u8, pick: usize) -> Result<(), TestCaseError> {
        match action % 10 {
            0 | 1 => self.feed(),
            2 | 3 => self.send()?,
            4 | 5 => {
                if let Some(i) = self.pick(pick, |w| !w.applied) {
                    self.apply(i)?;
                }
            }
            6 | 7 => {
                if let Some(i) = self.pick(pick, |w| w.applied && !w.answered) {
                    self.answer(i, false)?;
                }
            }
            8 => {
                if let Some(i) = self.pick(pick, |w| !w.answered) {
                    self.answer(i, true)?;
                }
            }
            _ if pick.is_multiple_of(20) => self.peer.fenced = true,
            _ => {}
        }
        Ok(())
    }

    /// Everything fed, sent, applied and answered.
    fn settle(&mut self) -> Result<(), TestCaseError> {
        for _ in 0..10_000 {
            self.feed();
            self.send()?;
            let open: Vec<usize> = (0..self.wire.len()).filter(|i| !self.wire[*i].answered).collect();
            if open.is_empty() && (self.ended || self.fed == self.history.len() && self.pipeline.quiet()) {
                break;
            }
            for i in open {
                self.apply(i)?;
                self.answer(i, false)?;
            }
        }
        Ok(())
    }
}

fn history() -> impl Strategy<Value = History> {
    let write = (0u8..8, prop::option::weighted(0.8, any::<u8>()));
    prop::collection::vec(prop::collection::vec(write, 1..7), 1..40).prop_map(|revisions| {
        // etcd writes a key at most once per revision.
        revisions
            .into_iter()
            .map(|writes| {
                let mut seen = std::collections::BTreeSet::new();
                writes.into_iter().filter(|(k, _)| seen.insert(*k)).collect()
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn a_peer_applying_txns_in_any_order_late_or_never_sees_each_key_move_forward_only(
        history in history(),
        depth in 1usize..6,
        max_ops in 1usize..5,
        steps in prop::collection::vec((any::<u8>(), any::<usize>()), 0..300),
    ) {
        let mut sim = Sim {
            history,
            fed: 0,
            pipeline: Pipeline::new(0, None),
            peer: Peer::default(),
            wire: Vec::new(),
            ended: false,
            landed_keys: 0,
            failures: false,
            gate: gate(depth, max_ops),
        };
        for (action, pick) in steps {
            sim.step(action, pick)?;
        }
        sim.settle()?;
        // Late Txns of a session that ended may still land: still forward only.
        for i in 0..sim.wire.len() {
            sim.apply(i)?;
        }
        if !sim.ended && !sim.peer.fenced {
            let last = sim.history.len() as i64;
            prop_assert_eq!(sim.pipeline.applied(), last, "every revision applied once every Txn was answered");
            prop_assert!(sim.peer_holds(last));
            prop_assert_eq!(sim.peer.record.0, last, "the record says where a successor resumes");
        }
        prop_assert!(!sim.ended || sim.failures || sim.peer.fenced, "a session ends only on a failure or a fence");
    }
}

#[test]
fn while_a_fragmented_response_is_open_its_whole_revisions_go_and_its_last_waits() {
    let mut pipeline = Pipeline::new(0, None);
    let now = SystemTime::now();
    for revision in 1..=3 {
        pipeline.receive(revision, put(&format!("k{revision}"), "v"), 0, 1, now);
    }
    let open = Gate { last_partial: true, ..gate(8, 1) };
    let sent: Vec<Vec<MirrorOp>> = (0..2).map(|_| send(&mut pipeline, open).ops).collect();
    assert_eq!(sent, vec![vec![put("k1", "v")], vec![put("k2", "v")]], "revisions 1 and 2 are whole");
    assert!(matches!(pipeline.next(open), Next::Wait), "revision 3 may have more in the next fragment");
    assert_eq!(pipeline.undispatched(), 1);
    pipeline.receive(3, put("k3b", "v"), 0, 1, now);
    let done = send(&mut pipeline, gate(8, 2));
    assert_eq!(done.ops, vec![put("k3", "v"), put("k3b", "v")], "the last fragment arrived: revision 3 goes whole");
}
