//! Planning the mirror, without IO: the paged diff of the initial sync, and the packing of
//! operations into peer Txns that respect the peer's limits and never split a source revision
//! unless that one revision alone exceeds them.
use std::collections::{HashMap, VecDeque};

/// A key-value as the planner needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kv {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    /// The lease the key is attached to (0 for none).
    pub lease: i64,
}

/// One write on the peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MirrorOp {
    /// Put the key with this value, attached to the lease of `shard`.
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
        shard: usize,
    },
    Delete {
        key: Vec<u8>,
    },
}

impl MirrorOp {
    pub fn key(&self) -> &[u8] {
        match self {
            MirrorOp::Put { key, .. } | MirrorOp::Delete { key } => key,
        }
    }

    /// What the op adds to a request, approximately: key, value and protobuf framing.
    pub fn wire_size(&self) -> usize {
        const FRAMING: usize = 24;
        match self {
            MirrorOp::Put { key, value, .. } => key.len() + value.len() + FRAMING,
            MirrorOp::Delete { key } => key.len() + FRAMING,
        }
    }
}

/// One step of the sorted merge between the origin's snapshot and the peer's copy, over pages.
/// Keys are consumed from the fronts of both queues; the merge stops where it needs another page
/// of a side that is not exhausted. `desired_shard(key)` names the lease shard a key belongs on,
/// and `shard_lease(shard)` that shard's lease id.
pub fn merge_step(
    origin: &mut VecDeque<Kv>,
    origin_done: bool,
    peer: &mut VecDeque<Kv>,
    peer_done: bool,
    desired_shard: impl Fn(&[u8]) -> usize,
    shard_lease: impl Fn(usize) -> i64,
    out: &mut Vec<MirrorOp>,
) {
    loop {
        match (origin.front(), peer.front()) {
            (Some(o), Some(p)) => match o.key.cmp(&p.key) {
                std::cmp::Ordering::Less => {
                    let o = origin.pop_front().expect("front exists");
                    out.push(put(o, &desired_shard));
                }
                std::cmp::Ordering::Greater => {
                    let p = peer.pop_front().expect("front exists");
                    out.push(MirrorOp::Delete { key: p.key });
                }
                std::cmp::Ordering::Equal => {
                    let o = origin.pop_front().expect("front exists");
                    let p = peer.pop_front().expect("front exists");
                    let shard = desired_shard(&o.key);
                    // Compare the lease too: a value-equal key still on a lost or previous lease
                    // would silently expire with it.
                    if o.value != p.value || p.lease != shard_lease(shard) {
                        out.push(MirrorOp::Put { key: o.key, value: o.value, shard });
                    }
                }
            },
            (Some(_), None) if peer_done => {
                let o = origin.pop_front().expect("front exists");
                out.push(put(o, &desired_shard));
            }
            (None, Some(_)) if origin_done => {
                let p = peer.pop_front().expect("front exists");
                out.push(MirrorOp::Delete { key: p.key });
            }
            _ => return,
        }
    }
}

fn put(kv: Kv, desired_shard: &impl Fn(&[u8]) -> usize) -> MirrorOp {
    let shard = desired_shard(&kv.key);
    MirrorOp::Put { key: kv.key, value: kv.value, shard }
}

/// What one peer Txn may carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TxnLimits {
    /// Operations, after reserving room for the checkpoint and the canary.
    pub max_ops: usize,
    /// Bytes, after reserving room for the checkpoint and the canary.
    pub max_bytes: usize,
}

impl TxnLimits {
    /// Limits for mirror ops given the peer's totals, keeping room for the bookkeeping puts.
    pub fn for_peer(max_txn_ops: usize, max_txn_bytes: usize, reserved_ops: usize, reserved_bytes: usize) -> Self {
        TxnLimits {
            max_ops: max_txn_ops.saturating_sub(reserved_ops).max(1),
            max_bytes: max_txn_bytes.saturating_sub(reserved_bytes).max(1),
        }
    }
}

/// The round trip each sync Txn in flight covers: the window holds one per 1.25 ms of it. A peer
/// Txn of 126 puts costs the peer about 2.5 ms to apply (the loopback bench's 50,000 keys/s next
/// door), but the peer applies Txns from several connections at once: with one per 2.5 ms of the
/// round trip, 100k keys copied at 41k keys/s 50 ms away, with one per 1.25 ms at 57-66k, faster
/// than next door's window of 4. At 4 ms a peer 150 ms away copied 30k keys/s.
pub const PEER_TXN_SERVICE: std::time::Duration = std::time::Duration::from_micros(1250);
/// Sync Txns in flight hold at most this many bytes together (the sync waits for one to land
/// before sending more), whatever the window.
pub const MAX_SYNC_INFLIGHT_BYTES: usize = 32 << 20;
/// The most watch batch Txns in flight, however far the peer. Batches in flight together write
/// disjoint keys and only raise the progress record, so the order etcd applies them in does not
/// matter (an earlier design chained them through a compare on the progress record: etcd proposes
/// concurrent Txns in no fixed order, most arrived early and were resent in cascades, and the
/// steady p99 through a 50 ms proxy was 847.8 ms).
pub const MAX_WATCH_PIPELINE: usize = 256;
/// Watch batches in flight hold at most this many bytes together.
pub const MAX_WATCH_INFLIGHT_BYTES: usize = 16 << 20;

/// The peer's distance from its round trip and the origin's (pure): what the peer takes beyond
/// what any etcd on this machine takes now.
pub fn distance(peer: Option<std::time::Duration>, local: Option<std::time::Duration>) -> Option<std::time::Duration> {
    peer.map(|p| p.saturating_sub(local.unwrap_or_default()))
}

/// The distance to take (pure): the shortest measured in the worker's life. A peer does not move
/// closer, but a busy moment (a member electing, a loaded machine) makes one next door look far
/// for a session, and taken for far it gets Txns in flight together: a consumer could then read
/// states the origin never had.
pub fn nearest(
    so_far: Option<std::time::Duration>,
    measured: Option<std::time::Duration>,
) -> Option<std::time::Duration> {
    match (so_far, measured) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Below this round trip the watch keeps one batch in flight: the peer is in the same region
/// (or the measurement is a busy machine's noise), and revisions coalesce into few Txns.
pub const WATCH_PIPELINE_FROM: std::time::Duration = std::time::Duration::from_millis(20);

/// Round trip per watch batch Txn in flight. A busy origin's revisions arrive a few at a time, and
/// a free slot sends what has arrived at once: with one slot per 4 ms (a full Txn's service
/// time) a peer 150 ms away ran its pipeline full with Txns of 4 ops, and revisions waited up to a
/// round trip for a slot (steady p99 197.8 ms). One per millisecond keeps slots free.
pub const WATCH_SLOT_EVERY: std::time::Duration = std::time::Duration::from_millis(1);

/// Watch batch Txns to keep in flight (pure): one for a peer nearby, so that revisions coalesce
/// into few Txns; more as the round trip grows, so that a peer 150 ms away keeps up with a busy
/// origin and a revision rarely waits for a free slot.
pub fn watch_depth(rtt: Option<std::time::Duration>) -> usize {
    match rtt {
        Some(rtt) if rtt >= WATCH_PIPELINE_FROM => {
            (1 + (rtt.as_secs_f64() / WATCH_SLOT_EVERY.as_secs_f64()).floor() as usize).min(MAX_WATCH_PIPELINE)
        }
        _ => 1,
    }
}
/// How long a far peer's batch that is not full waits for more revisions while others are in
/// flight, by default: at most one such Txn per worker per linger (200/s), whatever the origin's
/// write rate, at the cost of as much latency (`spec.sync.watchLingerMilliseconds`).
pub const WATCH_LINGER: std::time::Duration = std::time::Duration::from_millis(5);

/// How much longer the next watch batch should wait before it is sent (pure). Next door one batch
/// is in flight and the next coalesces behind it. Across distance (`depth` > 1) a free slot
/// would send every revision alone; a batch that is not full waits until its oldest revision is
/// `linger` old, unless nothing is in flight. `cut_short`: revisions are left behind it.
pub fn watch_linger(
    linger: std::time::Duration,
    depth: usize,
    running: usize,
    ops: usize,
    max_ops: usize,
    cut_short: bool,
    waited: std::time::Duration,
) -> Option<std::time::Duration> {
    let full = cut_short || ops >= max_ops.div_ceil(2);
    if depth <= 1 || running == 0 || full || waited >= linger {
        return None;
    }
    Some(linger - waited)
}

/// Round trips between two verifications the watch is held back for (a verification waits for
/// the batches in flight, then reads a peer page: about two round trips), so that it holds the
/// watch back at most 0.2 % of the time: under a steady load at a far peer that delays 0.2 % of
/// the writes by a round trip or two, well below what a p99 sees. 1 % (200 round trips) put
/// the steady p99 at 150 ms at about 2.4 round trips in `aether-bench wan`.
pub const VERIFY_PAUSE_ROUND_TRIPS: u32 = 1000;

/// How late a verification may get while it waits for a quiet moment (nothing in flight, nothing
/// pending) before it holds the watch back anyway (pure): the configured interval next door,
/// longer across distance, where holding back costs round trips.
pub fn verify_overdue(interval: std::time::Duration, rtt: Option<std::time::Duration>) -> std::time::Duration {
    interval.max(rtt.unwrap_or_default() * VERIFY_PAUSE_ROUND_TRIPS)
}

/// The most sync Txns in flight, however far the peer: at 64 a peer 150 ms away copied 46k
/// keys/s, at 128 65k (both within `MAX_SYNC_INFLIGHT_BYTES`).
pub const MAX_SYNC_WINDOW: usize = 128;

/// Sync Txns to keep in flight: the configured number, plus enough to cover the peer's measured
/// round trip (so a peer 150 ms away is written about as fast as one next door, as far as the
/// peer keeps up), at most `MAX_SYNC_WINDOW` (pure).
pub fn sync_window(configured: usize, rtt: Option<std::time::Duration>) -> usize {
    let configured = configured.max(1);
    let covering = rtt.map_or(0, |rtt| (rtt.as_secs_f64() / PEER_TXN_SERVICE.as_secs_f64()).ceil() as usize);
    (configured + covering).min(MAX_SYNC_WINDOW.max(configured))
}

/// Txns in flight per connection to the peer across distance. An etcd's gRPC server opens each
/// connection's flow-control window at 64 KiB and widens it about once a round trip (Go gRPC's
/// bandwidth-delay estimate), so a window of Txns over one connection trickled out for the
/// first 1.5 s at 150 ms: about 3 Txns of 128 ops a round trip. Spread over several
/// connections they all leave at once (100k keys at 150 ms: 5.4 s on one connection, 4.1 s on
/// 9, 3.8 s on 17; a burst of 20k revisions caught up in 2.1 s on one fresh connection, 1.5 s
/// once its window was wide).
pub const TXNS_PER_CONNECTION: usize = 4;

/// The most connections a session opens to the peer.
pub const MAX_PEER_CONNECTIONS: usize = 16;

/// The connections the mirrors writing into one etcd may spread their Txns over, together: in a
/// full mesh of N regions, N-1 workers write into each etcd, and a mesh restarting at once
/// brought up to 488 client connections onto one etcd at 32 regions with 16 each.
pub const PEER_SPREAD_BUDGET: usize = 128;

/// The most connections one worker spreads its Txns over (pure): `PEER_SPREAD_BUDGET` shared by
/// the `peers` its origin mirrors into (in a full mesh, as many regions write into each peer),
/// at least the session's own, at most `MAX_PEER_CONNECTIONS`.
pub fn spread_cap(peers: usize) -> usize {
    (PEER_SPREAD_BUDGET / peers.max(1)).clamp(1, MAX_PEER_CONNECTIONS)
}

/// Connections to spread `in_flight` Txns over (pure): the session's own next door (a peer less
/// than `WATCH_PIPELINE_FROM` away: a busy machine's noise is not distance, and under auth every
/// connection costs the peer a password check); across distance one per
/// `TXNS_PER_CONNECTION` Txns in flight, at most `cap` (`spread_cap`).
pub fn spread_connections(distance: Option<std::time::Duration>, in_flight: usize, cap: usize) -> usize {
    match distance {
        Some(d) if d >= WATCH_PIPELINE_FROM => in_flight.div_ceil(TXNS_PER_CONNECTION).clamp(1, cap.max(1)),
        _ => 1,
    }
}

/// The most keys a lease carries when auth binds the mirror's user on the peer: at 100 keys per
/// lease a sync took 2.1x its time without leases on etcd 3.6 with auth, at 1,000 9.1x, growing
/// about linearly.
pub const AUTH_MAX_KEYS_PER_LEASE: u64 = 64;

/// The keys a lease may carry (pure). Under auth, etcd checks at every put attached to a lease
/// that a non-root writer may write every key already on it (etcd PRs 16005 and 16019), so a put
/// costs time linear in its lease's keys; root skips the check.
pub fn lease_cap(configured: u64, auth_binds: bool) -> u64 {
    if auth_binds { configured.min(AUTH_MAX_KEYS_PER_LEASE) } else { configured }
}

/// Sync ops a sync under auth holds back to group by shard, in bytes: a subtree that fits fills
/// each lease in one Txn. At 8 MiB a 100k-key subtree (15 MB) filled its leases over two groups,
/// every put of the second checking the keys the first had put, and synced in 1.37-1.43x the
/// plain copy's time on etcd 3.6; at 16 MiB, 1.19x. It is held once per syncing worker, beside
/// the 32 MiB a sync may have in flight.
pub const SYNC_GROUP_BYTES: usize = 16 << 20;

/// Orders sync ops by shard, keeping key order within a shard (pure). etcd checks a put's lease
/// against the keys on it before the Txn, so a lease whose keys all arrive in one Txn costs no
/// check at all; in key order (the hash spreads a Txn over as many leases as it has puts) each
/// lease is filled one key per Txn, every put checking all the keys before it.
pub fn group_by_shard(ops: &mut [MirrorOp]) {
    ops.sort_by_key(|op| match op {
        MirrorOp::Put { shard, .. } => *shard,
        MirrorOp::Delete { .. } => usize::MAX,
    });
}

/// Accumulates sync ops into Txn-sized batches. Keys of one sync pass are distinct, so batches
/// may be applied in any order (and so in parallel).
pub struct SyncBatcher {
    limits: TxnLimits,
    current: Vec<MirrorOp>,
    bytes: usize,
}

impl SyncBatcher {
    pub fn new(limits: TxnLimits) -> Self {
        SyncBatcher { limits, current: Vec::new(), bytes: 0 }
    }

    /// Adds an op; returns a full batch when this op did not fit into the current one.
    pub fn push(&mut self, op: MirrorOp) -> Option<Vec<MirrorOp>> {
        let size = op.wire_size();
        let full = !self.current.is_empty()
            && (self.current.len() + 1 > self.limits.max_ops || self.bytes + size > self.limits.max_bytes);
        let flushed = if full { self.take() } else { None };
        self.bytes += size;
        self.current.push(op);
        flushed
    }

    /// The partial batch, if any.
    pub fn take(&mut self) -> Option<Vec<MirrorOp>> {
        self.bytes = 0;
        if self.current.is_empty() { None } else { Some(std::mem::take(&mut self.current)) }
    }
}

/// The writes of one source revision, in the order the origin made them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Revision {
    pub revision: i64,
    pub ops: Vec<MirrorOp>,
}

/// A peer Txn planned from pending revisions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchBatch {
    /// Ops with at most one per key (the last write of the batch wins, as it would in order).
    pub ops: Vec<MirrorOp>,
    /// The origin revision the peer holds completely once this batch applies.
    pub applied_through: i64,
    /// How many pending revisions (from the front) this batch consumes completely.
    pub revisions_consumed: usize,
    /// Ops of the next revision consumed when that revision alone exceeds the limits (the
    /// revision is then split over several Txns).
    pub split_ops_consumed: usize,
}

/// Plans the next peer Txn from the pending revisions: as many whole revisions as fit. A single
/// revision that exceeds the limits on its own is split, and the split is reported through
/// `split_ops_consumed`, so that the caller can say so.
///
/// `applied_through` is the revision the peer already holds completely. A revision that writes a
/// key for which `busy` holds (a key a batch still in flight writes) ends the batch before it:
/// batches in flight together write disjoint keys, so the order in which the peer applies them
/// does not matter. None when there is nothing to send now.
pub fn next_watch_batch<'a>(
    pending: impl IntoIterator<Item = &'a Revision> + Clone,
    already_split: usize,
    applied_through: i64,
    limits: TxnLimits,
    busy: impl Fn(&[u8]) -> bool,
) -> Option<WatchBatch> {
    let first = pending.clone().into_iter().next()?;
    let touches_busy = |ops: &[MirrorOp]| ops.iter().any(|op| busy(op.key()));
    let mut ops: Vec<MirrorOp> = Vec::new();
    let mut index: HashMap<Vec<u8>, usize> = HashMap::new();
    let mut count = 0usize;
    let mut bytes = 0usize;
    let mut consumed = 0usize;
    let mut through = applied_through;

    let add = |op: &MirrorOp, ops: &mut Vec<MirrorOp>, index: &mut HashMap<Vec<u8>, usize>| match index.get(op.key()) {
        Some(&i) => ops[i] = op.clone(),
        None => {
            index.insert(op.key().to_vec(), ops.len());
            ops.push(op.clone());
        }
    };

    // A revision that was already partly applied, or that cannot fit in any Txn: split it.
    let first_cost: usize = first.ops[already_split..].iter().map(MirrorOp::wire_size).sum();
    if already_split > 0 || first.ops.len() > limits.max_ops || first_cost > limits.max_bytes {
        if touches_busy(&first.ops[already_split..]) {
            return None;
        }
        let mut taken = 0;
        for op in &first.ops[already_split..] {
            if taken > 0 && (count + 1 > limits.max_ops || bytes + op.wire_size() > limits.max_bytes) {
                break;
            }
            count += 1;
            bytes += op.wire_size();
            add(op, &mut ops, &mut index);
            taken += 1;
        }
        let finished = already_split + taken == first.ops.len();
        return Some(WatchBatch {
            ops,
            applied_through: if finished { first.revision } else { applied_through },
            revisions_consumed: usize::from(finished),
            split_ops_consumed: if finished { 0 } else { already_split + taken },
        });
    }

    for revision in pending {
        let cost: usize = revision.ops.iter().map(MirrorOp::wire_size).sum();
        if consumed > 0 && (count + revision.ops.len() > limits.max_ops || bytes + cost > limits.max_bytes) {
            break;
        }
        if touches_busy(&revision.ops) {
            if consumed == 0 {
                return None;
            }
            break;
        }
        count += revision.ops.len();
        bytes += cost;
        for op in &revision.ops {
            add(op, &mut ops, &mut index);
        }
        consumed += 1;
        through = revision.revision;
    }
    Some(WatchBatch { ops, applied_through: through, revisions_consumed: consumed, split_ops_consumed: 0 })
}

/// Pages a sync reads each side of a large subtree in. etcd counts every key from a page's first
/// to the range's end to answer it (3.6.16's index visits them all whatever the limit), so a
/// subtree read in pages of a fixed size costs the square of its size: 1M keys in pages of 1,000
/// synced at 2,562 keys/s into a peer 150 ms away, its origin etcd a core busy.
pub const SYNC_PAGES: u64 = 64;

/// The most keys a sync page asks for (values of 350 B make a page of about 5.6 MB; large
/// values shrink it, `next_page_limit`).
pub const MAX_SYNC_PAGE_KEYS: i64 = 16_384;

/// Keys per page of a sync of `total_keys` (pure): the configured page size, or a
/// `SYNC_PAGES`-th of the subtree when that is more, up to `MAX_SYNC_PAGE_KEYS`.
pub fn sync_page_size(configured: i64, total_keys: u64) -> i64 {
    let share = i64::try_from(total_keys / SYNC_PAGES).unwrap_or(i64::MAX);
    configured.max(share.min(MAX_SYNC_PAGE_KEYS)).max(1)
}

/// Where a sync's reads of one side of a subtree go next (pure). etcd counts every key from a
/// range's start to its end whatever the limit (3.6's `treeIndex.Revisions`, see
/// `verify::read_end`), so pages read to the subtree's end cost the rest of the subtree each: 100k
/// keys in 64 pages cost the origin 3.2M key visits, about half its CPU in a sync. So each read
/// stops where the last full page's stretch of key space, repeated `stretch` times past its last
/// key, ends: about `stretch` pages' worth of keys. A read that holds no more keys than it
/// returned moves the cursor to its end (no key is skipped) and stretches the next one further.
/// Before a full page, or for keys too alike to measure, a read goes to the subtree's end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncReads {
    /// The first and last key of the last full page.
    span: Option<(Vec<u8>, Vec<u8>)>,
    stretch: u32,
}

/// How many of the last full page's spans a read covers; each read that comes back short
/// multiplies it by `STRETCH_GROWTH`, so a sparse stretch of keys costs a few reads.
const FIRST_STRETCH: u32 = 2;
const STRETCH_GROWTH: u32 = 4;
/// Bytes of the keys' common prefix a stretch may carry into. Measured from where two keys part,
/// a stretch could never pass the end of the keys sharing their prefix: over decimal names
/// ("svc-000500" to "svc-000999") every carry of a digit would make reads that find nothing,
/// until one went to the end of the subtree, which etcd counts whole.
const CARRY_BYTES: usize = 4;

impl Default for SyncReads {
    fn default() -> Self {
        SyncReads { span: None, stretch: FIRST_STRETCH }
    }
}

impl SyncReads {
    /// Where the read from `cursor` stops.
    pub fn read_end(&self, cursor: &[u8], subtree_end: &[u8]) -> Vec<u8> {
        let stretched = self.span.as_ref().and_then(|(first, last)| stretched_end(first, last, self.stretch));
        match stretched {
            Some(end) if end.as_slice() > cursor && end.as_slice() < subtree_end => end,
            _ => subtree_end.to_vec(),
        }
    }

    /// After a read to `read_end` that returned keys `first..=last` (None: none), `more` when the
    /// range held more than the page: where the next read starts, or None once the subtree is read.
    pub fn after_page(
        &mut self,
        cursor: &[u8],
        keys: Option<(&[u8], &[u8])>,
        more: bool,
        read_end: &[u8],
        subtree_end: &[u8],
    ) -> Option<Vec<u8>> {
        match (keys, more) {
            (Some((first, last)), true) => {
                self.span = Some((first.to_vec(), last.to_vec()));
                self.stretch = FIRST_STRETCH;
                let mut next = last.to_vec();
                next.push(0);
                Some(next)
            }
            // "More" without a key is no answer: the same read again.
            (None, true) => Some(cursor.to_vec()),
            (_, false) if read_end < subtree_end => {
                self.stretch = self.stretch.saturating_mul(STRETCH_GROWTH);
                Some(read_end.to_vec())
            }
            (_, false) => None,
        }
    }
}

/// The key `stretch` spans of `first..=last` past `last`, the span measured on 16 bytes from
/// `CARRY_BYTES` before the end of the two keys' common prefix (None if they are equal there).
/// Past the end of the keys sharing the prefix before those 16 bytes, the end of them.
fn stretched_end(first: &[u8], last: &[u8], stretch: u32) -> Option<Vec<u8>> {
    let common = first.iter().zip(last).take_while(|(a, b)| a == b).count();
    let common = common.saturating_sub(CARRY_BYTES);
    let position = |key: &[u8]| {
        let mut bytes = [0u8; 16];
        let tail = &key[common..];
        let n = tail.len().min(16);
        bytes[..n].copy_from_slice(&tail[..n]);
        u128::from_be_bytes(bytes)
    };
    let to = position(last);
    let span = to.checked_sub(position(first)).filter(|span| *span > 0)?;
    let prefix = &last[..common];
    match span.checked_mul(u128::from(stretch)).and_then(|ahead| to.checked_add(ahead)) {
        Some(end) => Some([prefix, end.to_be_bytes().as_slice()].concat()),
        None if !prefix.is_empty() => Some(crate::keys::prefix_range_end(prefix)),
        None => None,
    }
}

/// How many keys the next sync range page asks for: the configured page size, fewer when values
/// are large, so that a page stays near `target_bytes` whatever the values weigh. `largest` is
/// the largest key-value seen so far in this sync.
pub fn next_page_limit(page_size: i64, largest: usize, target_bytes: usize) -> i64 {
    let by_bytes = (target_bytes / largest.max(1)).max(1) as i64;
    page_size.min(by_bytes).max(1)
}

/// A key whose write cannot fit in any request the peer accepts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Oversized {
    pub key: String,
    pub bytes: usize,
}

/// Checks one op against the peer's request limit (less `reserved` for the bookkeeping that goes
/// with it). A put that cannot fit becomes a delete, so that the peer drops its stale copy
/// instead of serving an old value, and is reported; it never blocks the ops after it.
pub fn enforce_request_limit(op: MirrorOp, max_request_bytes: usize, reserved: usize) -> (MirrorOp, Option<Oversized>) {
    let limit = max_request_bytes.saturating_sub(reserved);
    match op {
        MirrorOp::Put { key, value, .. } if key.len() + value.len() + 24 > limit => {
            let bytes = key.len() + value.len();
            let report = Oversized { key: String::from_utf8_lossy(&key).into_owned(), bytes };
            (MirrorOp::Delete { key }, Some(report))
        }
        op => (op, None),
    }
}

/// Connections the watch wants open (pure): those open while they carry its Txns in flight;
/// once the Txns outgrow them (a burst began), as many as its whole depth can use at once:
/// opened a few at a time, each step took round trips while the burst waited.
pub fn watch_connections(
    distance: Option<std::time::Duration>,
    in_flight: usize,
    depth: usize,
    open: usize,
    cap: usize,
) -> usize {
    if spread_connections(distance, in_flight, cap) > open { spread_connections(distance, depth, cap) } else { open }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A range read as etcd answers it: at most `limit` keys of `from..end`, whether the range
    /// held more, and how many keys etcd visited to answer (all of the range: it counts them).
    fn etcd_range(keys: &[Vec<u8>], from: &[u8], end: &[u8], limit: usize) -> (Vec<Vec<u8>>, bool, usize) {
        let start = keys.partition_point(|k| k.as_slice() < from);
        let stop = keys.partition_point(|k| k.as_slice() < end);
        let in_range = &keys[start..stop.max(start)];
        (in_range.iter().take(limit).cloned().collect(), in_range.len() > limit, in_range.len())
    }

    /// A subtree read as the sync reads it: the keys in the order read, the reads, the key visits.
    fn read_subtree(keys: &[Vec<u8>], prefix: &[u8], limit: usize) -> (Vec<Vec<u8>>, usize, usize) {
        let subtree_end = crate::keys::prefix_range_end(prefix);
        let (mut reads, mut cursor, mut seen, mut visits) = (SyncReads::default(), prefix.to_vec(), Vec::new(), 0);
        for n in 1.. {
            assert!(n < 100_000, "the reads of {} keys did not end", keys.len());
            let read_end = reads.read_end(&cursor, &subtree_end);
            assert!(read_end.as_slice() > cursor.as_slice(), "a read from {cursor:?} ends at {read_end:?}");
            let (page, more, visited) = etcd_range(keys, &cursor, &read_end, limit);
            visits += visited;
            let first_last = page.first().zip(page.last()).map(|(f, l)| (f.as_slice(), l.as_slice()));
            let next = reads.after_page(&cursor, first_last, more, &read_end, &subtree_end);
            seen.extend(page);
            match next {
                Some(next) => cursor = next,
                None => return (seen, n, visits),
            }
        }
        unreachable!()
    }

    #[test]
    fn a_syncs_reads_stop_near_a_page_and_still_return_every_key_once() {
        let prefix = b"/aether/v1/regions/a/".to_vec();
        let keys: Vec<Vec<u8>> = (0..100_000)
            .map(|i| format!("/aether/v1/regions/a/svc-{:04}/ep-{:05}", i / 97, i).into_bytes())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        let limit = sync_page_size(1000, keys.len() as u64) as usize;
        let (seen, reads, visits) = read_subtree(&keys, &prefix, limit);
        assert_eq!(seen, keys, "every key once, in order");
        let pages = keys.len().div_ceil(limit);
        // Read to the subtree's end every time, the 64 pages visit about n * pages / 2 keys (3.25M
        // here); bounded, 0.7M (decimal keys measured as bytes overshoot where a digit carries).
        let unbounded = keys.len() * pages / 2;
        assert!(visits * 4 < unbounded, "{visits} key visits for {} keys (unbounded: {unbounded})", keys.len());
        assert!(reads <= 2 * pages + 8, "{reads} reads for {pages} pages");
    }

    #[test]
    fn a_syncs_first_read_and_keys_too_alike_to_measure_go_to_the_subtrees_end() {
        let reads = SyncReads::default();
        assert_eq!(reads.read_end(b"/p/", b"/p0"), b"/p0".to_vec(), "no page yet: the subtree's end");
        let mut reads = SyncReads::default();
        // The second key extends the first with zero bytes: no span to measure.
        let (first, last) = (b"/p/a".to_vec(), b"/p/a\0\0".to_vec());
        assert_eq!(reads.after_page(b"/p/", Some((&first, &last)), true, b"/p0", b"/p0"), Some(b"/p/a\0\0\0".to_vec()));
        assert_eq!(reads.read_end(b"/p/a\0\0\0", b"/p0"), b"/p0".to_vec());
    }

    proptest::proptest! {
        #[test]
        fn a_syncs_bounded_reads_return_every_key_once_in_order(
            tails in proptest::collection::btree_set(proptest::collection::vec(proptest::prop_oneof![
                proptest::prelude::Just(0u8), proptest::prelude::Just(0xffu8), proptest::prelude::Just(b'x'), proptest::prelude::any::<u8>()
            ], 0..40), 0..300),
            limit in 1usize..40,
        ) {
            let prefix = b"/r/".to_vec();
            let keys: Vec<Vec<u8>> = tails.into_iter().map(|t| [prefix.as_slice(), &t].concat()).collect();
            let (seen, reads, _) = read_subtree(&keys, &prefix, limit);
            proptest::prop_assert_eq!(&seen, &keys);
            // Short reads stretch by 4 each: a handful per gap, whatever the keys.
            proptest::prop_assert!(reads <= 40 * (keys.len() / limit + 1), "{} reads for {} keys in pages of {}", reads, keys.len(), limit);
        }
    }

    #[test]
    fn the_watch_pipeline_deepens_only_across_distance() {
        let ms = std::time::Duration::from_millis;
        assert_eq!(watch_depth(None), 1);
        assert_eq!(watch_depth(Some(ms(1))), 1, "next door: one batch at a time, coalescing");
        assert_eq!(watch_depth(Some(ms(12))), 1, "a busy machine's slow answer is not distance");
        assert_eq!(watch_depth(Some(ms(50))), 51);
        assert_eq!(watch_depth(Some(ms(150))), 151);
        assert_eq!(watch_depth(Some(ms(400))), MAX_WATCH_PIPELINE);
    }

    #[test]
    fn a_far_batch_that_is_not_full_lingers_while_others_fly() {
        let ms = std::time::Duration::from_millis;
        assert_eq!(watch_linger(WATCH_LINGER, 1, 1, 1, 125, false, ms(0)), None, "next door: one in flight, no linger");
        assert_eq!(watch_linger(WATCH_LINGER, 51, 0, 1, 125, false, ms(0)), None, "nothing in flight: send now");
        assert_eq!(watch_linger(WATCH_LINGER, 51, 3, 1, 125, false, ms(2)), Some(ms(3)));
        assert_eq!(watch_linger(WATCH_LINGER, 51, 3, 1, 125, false, ms(5)), None, "waited long enough");
        assert_eq!(watch_linger(WATCH_LINGER, 51, 3, 63, 125, false, ms(0)), None, "half full");
        assert_eq!(watch_linger(WATCH_LINGER, 51, 3, 1, 125, true, ms(0)), None, "more revisions wait behind it");
        assert_eq!(
            watch_linger(ms(50), 51, 3, 1, 125, false, ms(5)),
            Some(ms(45)),
            "a longer linger, set for a large mesh"
        );
        assert_eq!(watch_linger(ms(0), 51, 3, 1, 125, false, ms(0)), None, "no linger: send at once");
    }

    #[test]
    fn verification_holds_a_far_watch_back_rarely() {
        let (ms, s) = (std::time::Duration::from_millis, std::time::Duration::from_secs);
        assert_eq!(verify_overdue(s(5), None), s(5));
        assert_eq!(verify_overdue(s(5), Some(ms(1))), s(5), "next door: the configured interval");
        assert_eq!(verify_overdue(s(5), Some(ms(50))), s(50));
        assert_eq!(verify_overdue(s(5), Some(ms(150))), s(150));
    }

    #[test]
    fn under_auth_shards_stay_small_and_sync_ops_come_grouped_by_lease() {
        assert_eq!(lease_cap(1000, false), 1000);
        assert_eq!(lease_cap(1000, true), AUTH_MAX_KEYS_PER_LEASE);
        assert_eq!(lease_cap(10, true), 10, "never above the configured cap");
        let put = |k: &str, shard| MirrorOp::Put { key: k.into(), value: vec![], shard };
        let mut ops = vec![put("a", 2), MirrorOp::Delete { key: b"b".to_vec() }, put("c", 0), put("d", 2), put("e", 0)];
        group_by_shard(&mut ops);
        let order: Vec<&[u8]> = ops.iter().map(MirrorOp::key).collect();
        assert_eq!(order, vec![b"c".as_slice(), b"e", b"a", b"d", b"b"]);
    }

    #[test]
    fn a_busy_machine_is_not_distance() {
        let ms = std::time::Duration::from_millis;
        assert_eq!(distance(Some(ms(30)), Some(ms(28))), Some(ms(2)), "both slowed by the machine");
        assert_eq!(distance(Some(ms(51)), Some(ms(1))), Some(ms(50)));
        assert_eq!(distance(Some(ms(5)), Some(ms(9))), Some(ms(0)));
        assert_eq!(distance(Some(ms(50)), None), Some(ms(50)));
        assert_eq!(distance(None, Some(ms(1))), None);
    }

    #[test]
    fn a_busy_moment_does_not_make_a_peer_next_door_far() {
        let ms = std::time::Duration::from_millis;
        assert_eq!(nearest(None, Some(ms(40))), Some(ms(40)), "the first measurement counts");
        assert_eq!(nearest(Some(ms(2)), Some(ms(45))), Some(ms(2)), "a busy session stays next door");
        assert_eq!(nearest(Some(ms(150)), Some(ms(148))), Some(ms(148)));
        assert_eq!(nearest(Some(ms(3)), None), Some(ms(3)), "no answer: what was measured");
        assert_eq!(nearest(None, None), None);
    }

    #[test]
    fn the_sync_window_covers_the_round_trip() {
        let ms = std::time::Duration::from_millis;
        assert_eq!(sync_window(4, None), 4);
        assert_eq!(sync_window(4, Some(ms(0))), 4, "next door: the configured window");
        assert_eq!(sync_window(4, Some(ms(50))), 4 + 40);
        assert_eq!(sync_window(4, Some(ms(150))), 4 + 120);
        assert_eq!(sync_window(4, Some(ms(1000))), MAX_SYNC_WINDOW);
        assert_eq!(sync_window(200, Some(ms(150))), 200, "never below the configured window");
    }

    #[test]
    fn a_far_peer_gets_its_txns_over_several_connections() {
        let ms = std::time::Duration::from_millis;
        let cap = spread_cap(1);
        assert_eq!(spread_connections(None, 4, cap), 1, "distance unknown: the session's connection");
        assert_eq!(spread_connections(Some(ms(3)), 6, cap), 1, "a busy machine's noise is not distance");
        assert_eq!(spread_connections(Some(ms(50)), sync_window(4, Some(ms(50))), cap), 11);
        assert_eq!(spread_connections(Some(ms(150)), sync_window(4, Some(ms(150))), cap), MAX_PEER_CONNECTIONS);
        assert_eq!(spread_connections(Some(ms(20)), 1, cap), 1);
        assert_eq!(spread_connections(Some(ms(150)), 0, cap), 1, "nothing in flight: the session's connection");
        assert_eq!(spread_connections(Some(ms(150)), 5, cap), 2);
    }

    #[test]
    fn a_large_subtree_is_read_in_a_bounded_number_of_pages() {
        assert_eq!(sync_page_size(1_000, 0), 1_000, "an empty subtree: the configured size");
        assert_eq!(sync_page_size(1_000, 100_000), 1_562);
        assert_eq!(sync_page_size(1_000, 1_000_000), 15_625, "a million keys in 64 pages");
        assert_eq!(sync_page_size(1_000, 10_000_000), MAX_SYNC_PAGE_KEYS);
        assert_eq!(sync_page_size(50_000, 1_000_000), 50_000, "never below the configured size");
    }

    #[test]
    fn the_writers_of_one_etcd_share_its_connection_budget() {
        let ms = std::time::Duration::from_millis;
        assert_eq!(spread_cap(0), MAX_PEER_CONNECTIONS, "no peer known: one worker");
        assert_eq!(spread_cap(4), MAX_PEER_CONNECTIONS, "a small mesh: each worker its most");
        assert_eq!(spread_cap(31), 4, "32 regions: 31 writers into each etcd");
        assert_eq!(spread_cap(63), 2);
        assert_eq!(spread_cap(500), 1, "at least the session's own connection");
        let far = sync_window(4, Some(ms(150)));
        assert_eq!(spread_connections(Some(ms(150)), far, spread_cap(31)), 4);
        for peers in 1..=600 {
            let per_etcd = peers * spread_connections(Some(ms(150)), far, spread_cap(peers));
            assert!(
                per_etcd <= PEER_SPREAD_BUDGET.max(peers),
                "{peers} writers spread over {per_etcd} connections into one etcd"
            );
        }
    }

    #[test]
    fn a_burst_opens_what_the_whole_watch_depth_can_use_at_once() {
        let ms = std::time::Duration::from_millis;
        let depth = watch_depth(Some(ms(150)));
        let cap = spread_cap(1);
        assert_eq!(watch_connections(Some(ms(150)), 4, depth, 1, cap), 1, "one connection carries 4 Txns");
        assert_eq!(watch_connections(Some(ms(150)), 5, depth, 1, cap), MAX_PEER_CONNECTIONS);
        assert_eq!(watch_connections(Some(ms(150)), 151, depth, MAX_PEER_CONNECTIONS, cap), MAX_PEER_CONNECTIONS);
        assert_eq!(watch_connections(Some(ms(5)), 1, 1, 1, cap), 1, "next door: the session's connection");
        assert_eq!(watch_connections(Some(ms(50)), 30, watch_depth(Some(ms(50))), 2, cap), 13);
        assert_eq!(watch_connections(Some(ms(150)), 5, depth, 1, spread_cap(31)), 4, "a large mesh: its share");
    }

    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn kv(key: &str, value: &str, lease: i64) -> Kv {
        Kv { key: key.into(), value: value.into(), lease }
    }

    fn run_merge(origin: Vec<Kv>, peer: Vec<Kv>, page: usize) -> Vec<MirrorOp> {
        // Feed both sides page by page, as the worker does.
        let (mut o_src, mut p_src) = (VecDeque::from(origin), VecDeque::from(peer));
        let (mut o, mut p) = (VecDeque::new(), VecDeque::new());
        let mut out = Vec::new();
        loop {
            if o.is_empty() {
                o.extend(o_src.drain(..page.min(o_src.len())));
            }
            if p.is_empty() {
                p.extend(p_src.drain(..page.min(p_src.len())));
            }
            let (o_done, p_done) = (o_src.is_empty(), p_src.is_empty());
            merge_step(&mut o, o_done, &mut p, p_done, |_| 0, |_| 7, &mut out);
            if o_done && p_done && o.is_empty() && p.is_empty() {
                return out;
            }
        }
    }

    #[test]
    fn merge_puts_missing_changed_and_wrongly_leased_keys_and_deletes_stale_ones() {
        let origin = vec![kv("a", "1", 0), kv("b", "2", 0), kv("c", "3", 0), kv("e", "5", 0)];
        let peer = vec![kv("b", "2", 7), kv("c", "3", 99), kv("d", "4", 7), kv("e", "old", 7)];
        let ops = run_merge(origin, peer, 1);
        assert_eq!(
            ops,
            vec![
                MirrorOp::Put { key: b"a".to_vec(), value: b"1".to_vec(), shard: 0 },
                MirrorOp::Put { key: b"c".to_vec(), value: b"3".to_vec(), shard: 0 },
                MirrorOp::Delete { key: b"d".to_vec() },
                MirrorOp::Put { key: b"e".to_vec(), value: b"5".to_vec(), shard: 0 },
            ]
        );
    }

    proptest! {
        /// Applying the merge's ops to the peer makes it equal to the origin, with every key on
        /// the desired lease, whatever the page size.
        #[test]
        fn merge_converges(origin in proptest::collection::btree_map("[a-e]{1,3}", "[xy]{0,2}", 0..40),
                           peer in proptest::collection::btree_map("[a-e]{1,3}", ("[xy]{0,2}", prop_oneof![Just(7i64), Just(3i64)]), 0..40),
                           page in 1usize..10) {
            let o: Vec<Kv> = origin.iter().map(|(k, v)| kv(k, v, 0)).collect();
            let p: Vec<Kv> = peer.iter().map(|(k, (v, l))| kv(k, v, *l)).collect();
            let mut state: BTreeMap<String, (String, i64)> = peer.clone();
            for op in run_merge(o, p, page) {
                match op {
                    MirrorOp::Put { key, value, .. } => { state.insert(String::from_utf8(key).unwrap(), (String::from_utf8(value).unwrap(), 7)); }
                    MirrorOp::Delete { key } => { state.remove(&String::from_utf8(key).unwrap()); }
                }
            }
            let expected: BTreeMap<String, (String, i64)> = origin.into_iter().map(|(k, v)| (k, (v, 7))).collect();
            prop_assert_eq!(state, expected);
        }
    }

    fn limits(ops: usize, bytes: usize) -> TxnLimits {
        TxnLimits { max_ops: ops, max_bytes: bytes }
    }

    fn rev(revision: i64, keys: &[&str]) -> Revision {
        Revision {
            revision,
            ops: keys
                .iter()
                .map(|k| MirrorOp::Put {
                    key: k.as_bytes().to_vec(),
                    value: revision.to_string().into_bytes(),
                    shard: 0,
                })
                .collect(),
        }
    }

    #[test]
    fn pages_shrink_for_large_values_and_never_below_one_key() {
        assert_eq!(next_page_limit(1000, 300, 8 << 20), 1000);
        assert_eq!(next_page_limit(1000, 1 << 20, 8 << 20), 8);
        assert_eq!(next_page_limit(1000, 64 << 20, 8 << 20), 1);
        assert_eq!(next_page_limit(1000, 0, 8 << 20), 1000);
    }

    #[test]
    fn a_put_over_the_request_limit_becomes_a_delete_and_is_reported() {
        let big = MirrorOp::Put { key: b"k".to_vec(), value: vec![b'x'; 2000], shard: 0 };
        let (op, report) = enforce_request_limit(big, 2048, 100);
        assert_eq!(op, MirrorOp::Delete { key: b"k".to_vec() });
        assert_eq!(report, Some(Oversized { key: "k".into(), bytes: 2001 }));
        let small = MirrorOp::Put { key: b"k".to_vec(), value: vec![b'x'; 10], shard: 0 };
        assert_eq!(enforce_request_limit(small.clone(), 2048, 100), (small, None));
        let delete = MirrorOp::Delete { key: b"k".to_vec() };
        assert_eq!(enforce_request_limit(delete.clone(), 10, 100), (delete, None));
    }

    #[test]
    fn batches_hold_whole_revisions_and_coalesce() {
        let pending: VecDeque<Revision> = vec![rev(5, &["a", "b"]), rev(6, &["a"]), rev(7, &["c", "d", "e"])].into();
        let batch = next_watch_batch(&pending, 0, 4, limits(4, 1 << 20), |_| false).unwrap();
        // Revisions 5 and 6 fit (3 ops); 7 would make 6 ops.
        assert_eq!(batch.revisions_consumed, 2);
        assert_eq!(batch.applied_through, 6);
        // "a" was written twice: the Txn carries only its last value.
        assert_eq!(batch.ops.len(), 2);
        assert!(batch.ops.contains(&MirrorOp::Put { key: b"a".to_vec(), value: b"6".to_vec(), shard: 0 }));
    }

    #[test]
    fn a_put_then_delete_in_one_batch_deletes() {
        let pending: VecDeque<Revision> =
            vec![rev(5, &["a"]), Revision { revision: 6, ops: vec![MirrorOp::Delete { key: b"a".to_vec() }] }].into();
        let batch = next_watch_batch(&pending, 0, 4, limits(10, 1 << 20), |_| false).unwrap();
        assert_eq!(batch.ops, vec![MirrorOp::Delete { key: b"a".to_vec() }]);
    }

    #[test]
    fn an_oversized_revision_is_split_and_reported() {
        let pending: VecDeque<Revision> = vec![rev(9, &["a", "b", "c", "d", "e"]), rev(10, &["f"])].into();
        let first = next_watch_batch(&pending, 0, 8, limits(2, 1 << 20), |_| false).unwrap();
        assert_eq!(
            (first.ops.len(), first.applied_through, first.split_ops_consumed, first.revisions_consumed),
            (2, 8, 2, 0)
        );
        let second = next_watch_batch(&pending, 2, 8, limits(2, 1 << 20), |_| false).unwrap();
        assert_eq!((second.ops.len(), second.applied_through, second.split_ops_consumed), (2, 8, 4));
        let third = next_watch_batch(&pending, 4, 8, limits(2, 1 << 20), |_| false).unwrap();
        assert_eq!(
            (third.ops.len(), third.applied_through, third.split_ops_consumed, third.revisions_consumed),
            (1, 9, 0, 1)
        );
    }

    #[test]
    fn byte_limits_are_respected() {
        let big = |r: i64, k: &str| Revision {
            revision: r,
            ops: vec![MirrorOp::Put { key: k.into(), value: vec![0; 400], shard: 0 }],
        };
        let pending: VecDeque<Revision> = vec![big(1, "a"), big(2, "b"), big(3, "c")].into();
        let batch = next_watch_batch(&pending, 0, 0, limits(100, 1000), |_| false).unwrap();
        assert_eq!(batch.revisions_consumed, 2);
        assert!(batch.ops.iter().map(MirrorOp::wire_size).sum::<usize>() <= 1000);
    }

    proptest! {
        /// Planning batch after batch consumes every revision exactly once, in order, never puts
        /// part of a revision that fits into a Txn, and respects the op limit.
        #[test]
        fn batches_cover_revisions_in_order(sizes in proptest::collection::vec(1usize..6, 1..30), max_ops in 1usize..8) {
            let mut pending: VecDeque<Revision> = sizes.iter().enumerate()
                .map(|(i, n)| rev(i as i64 + 1, &(0..*n).map(|k| ["a","b","c","d","e","f"][k]).collect::<Vec<_>>()))
                .collect();
            let (mut through, mut split) = (0i64, 0usize);
            while let Some(batch) = next_watch_batch(&pending, split, through, limits(max_ops, 1 << 20), |_| false) {
                prop_assert!(batch.ops.len() <= max_ops);
                prop_assert!(batch.applied_through >= through);
                if batch.split_ops_consumed == 0 && split == 0 {
                    // Whole revisions only.
                    prop_assert!(batch.revisions_consumed >= 1);
                } else {
                    prop_assert!(pending.front().unwrap().ops.len() > max_ops);
                }
                through = batch.applied_through;
                split = batch.split_ops_consumed;
                for _ in 0..batch.revisions_consumed { pending.pop_front(); }
            }
            prop_assert_eq!(through, sizes.len() as i64);
        }
    }

    #[test]
    fn a_batch_ends_before_a_revision_that_writes_a_key_in_flight() {
        let pending: VecDeque<Revision> = vec![rev(5, &["a"]), rev(6, &["b", "c"]), rev(7, &["d"])].into();
        let batch = next_watch_batch(&pending, 0, 4, limits(10, 1 << 20), |k| k == b"c").unwrap();
        assert_eq!((batch.revisions_consumed, batch.applied_through), (1, 5), "revision 6 waits whole");
        assert_eq!(next_watch_batch(pending.range(1..), 0, 5, limits(10, 1 << 20), |k| k == b"c"), None);
        let oversized: VecDeque<Revision> = vec![rev(9, &["a", "b", "c"])].into();
        assert_eq!(next_watch_batch(&oversized, 0, 8, limits(2, 1 << 20), |k| k == b"c"), None);
    }

    proptest! {
        /// Batches planned while others are in flight, landing in any order, leave every key with
        /// the origin's last value and never take a key back to an older one.
        #[test]
        fn pipelined_batches_land_in_any_order_and_keep_each_keys_order(
            revisions in proptest::collection::vec(proptest::collection::btree_set(0usize..6, 1..4), 1..40),
            choices in proptest::collection::vec(0usize..1000, 200),
            depth in 1usize..6,
        ) {
            let names = ["a", "b", "c", "d", "e", "f"];
            let pending: Vec<Revision> = revisions.iter().enumerate()
                .map(|(i, ks)| rev(i as i64 + 1, &ks.iter().map(|k| names[*k]).collect::<Vec<_>>()))
                .collect();
            let mut origin: BTreeMap<Vec<u8>, i64> = BTreeMap::new();
            for r in &pending {
                for op in &r.ops { origin.insert(op.key().to_vec(), r.revision); }
            }
            let (mut dispatched, mut through) = (0usize, 0i64);
            let mut inflight: Vec<WatchBatch> = Vec::new();
            let mut peer: BTreeMap<Vec<u8>, i64> = BTreeMap::new();
            let mut choices = choices.into_iter().cycle();
            loop {
                let busy = |k: &[u8]| inflight.iter().any(|b| b.ops.iter().any(|op| op.key() == k));
                let next = if inflight.len() < depth {
                    next_watch_batch(&pending[dispatched..], 0, through, limits(4, 1 << 20), busy)
                } else {
                    None
                };
                let dispatch = next.is_some() && (inflight.is_empty() || choices.next().unwrap() % 2 == 0);
                if dispatch {
                    let batch = next.unwrap();
                    dispatched += batch.revisions_consumed;
                    through = batch.applied_through;
                    inflight.push(batch);
                } else if !inflight.is_empty() {
                    let landed = inflight.remove(choices.next().unwrap() % inflight.len());
                    for op in landed.ops {
                        let MirrorOp::Put { key, value, .. } = op else { unreachable!() };
                        let value: i64 = String::from_utf8(value).unwrap().parse().unwrap();
                        let old = peer.insert(key, value).unwrap_or(0);
                        prop_assert!(old < value, "a key went back from revision {} to {}", old, value);
                    }
                } else {
                    break;
                }
            }
            prop_assert_eq!(dispatched, pending.len());
            prop_assert_eq!(peer, origin);
        }
    }

    #[test]
    fn sync_batches_respect_limits() {
        let mut batcher = SyncBatcher::new(limits(3, 1 << 20));
        let mut batches = Vec::new();
        for i in 0..10u8 {
            if let Some(b) = batcher.push(MirrorOp::Delete { key: vec![i] }) {
                batches.push(b);
            }
        }
        batches.extend(batcher.take());
        assert_eq!(batches.iter().map(Vec::len).collect::<Vec<_>>(), vec![3, 3, 3, 1]);
    }
}
