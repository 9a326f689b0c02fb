//! Continuous verification, without IO: the worker walks the origin's subtree one page at a time
//! at a low rate, compares each page with the peer's copy of the same key range at the revision
//! the peer holds, and repairs what differs with a targeted write of that range. Nothing else in
//! the mirror notices an out-of-band write or delete on the peer, a partial restore, or a bug.
//!
//! A page is compared only while no batch is in flight, so the peer holds exactly the origin's
//! subtree at the applied revision; the origin side is read pinned at that revision.
//!
//! Every worker of one origin (one RegionPeering) draws its pages from one `VerifyBudget`, so the
//! origin serves at most that many verification keys a second whatever the number of peers, and
//! each peer etcd about as much (every region verifying at the same budget, each of its N-1
//! workers gets a 1/(N-1) share).
use crate::mirror::plan::{Kv, MirrorOp, SyncReads, merge_step};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The verification reads of one origin, shared by all its workers: pages are handed out in slots
/// so that together they read at most `keys_per_second`. A worker reserves its next page's slot
/// when the last one is done, so the workers take turns.
#[derive(Debug)]
pub struct VerifyBudget {
    keys_per_second: u64,
    next_free: Mutex<Option<Instant>>,
}

impl VerifyBudget {
    /// A budget of `keys_per_second` (0: no verification).
    pub fn new(keys_per_second: u64) -> Self {
        VerifyBudget { keys_per_second, next_free: Mutex::new(None) }
    }

    pub fn keys_per_second(&self) -> u64 {
        self.keys_per_second
    }

    /// When a page of `keys` may be read: the next free slot, and never before `earliest`. None
    /// when verification is off.
    pub fn reserve(&self, keys: u64, earliest: Instant) -> Option<Instant> {
        if self.keys_per_second == 0 {
            return None;
        }
        let mut next_free = self.next_free.lock().unwrap_or_else(|e| e.into_inner());
        let at = next_free.map_or(earliest, |free| free.max(earliest));
        *next_free = Some(at + Duration::from_secs_f64(keys as f64 / self.keys_per_second as f64));
        Some(at)
    }
}

/// Where the walk is, and what the current pass found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Walk {
    /// The first key of the next page (None: start a new pass at the prefix).
    pub cursor: Option<Vec<u8>>,
    /// Keys repaired in the current pass.
    pub repaired_this_pass: u64,
    /// Where this pass's pages ended, in order.
    pub page_ends: Vec<Vec<u8>>,
    /// Where the last whole pass's pages ended: they bound the next pass's reads (`read_end`).
    pub last_page_ends: Vec<Vec<u8>>,
    /// This pass's reads bounded by the key span of its last full page (`read_end`).
    pub reads: SyncReads,
}

impl Walk {
    /// Starts over at the prefix (after a sync, or a compaction past the applied revision),
    /// keeping what the last whole pass learned of where pages end.
    pub fn restart(&mut self) {
        *self = Walk { last_page_ends: std::mem::take(&mut self.last_page_ends), ..Walk::default() };
    }
}

/// Where a page's read of the origin stops. etcd counts every key from a range's start to its
/// end whatever the limit (3.6's `treeIndex.Revisions`), so a page read to the subtree's end costs
/// the rest of the subtree: at a million keys, a pass costs the origin etcd half a billion key
/// visits. The read stops at the nearer of two bounds, each of which holds about two pages of
/// keys unless the subtree grew there (then the page holds fewer, and the next one starts where
/// it ended, so no key is skipped):
/// - two of the last pass's page ends past `from`. After a sync those are the sync's pages, up
///   to 16,384 keys each (a 64th of the subtree): in the first pass they alone would make each
///   read count 2 x K/64 keys, a pass that lasts K/V seconds;
/// - two key spans of this pass's last full page past its last key (`plan::SyncReads`, as the
///   sync bounds its own reads).
///
/// With neither, at the subtree's end.
pub fn read_end(walk: &Walk, from: &[u8], subtree_end: &[u8]) -> Vec<u8> {
    let after = walk.last_page_ends.partition_point(|end| end.as_slice() <= from);
    let recorded = match walk.last_page_ends.get(after + 1) {
        Some(end) if end.as_slice() < subtree_end => end.clone(),
        _ => subtree_end.to_vec(),
    };
    recorded.min(walk.reads.read_end(from, subtree_end))
}

/// After a page read from `from` to `read_end` returned the origin keys `first..=last` (None:
/// none), `more` when the origin held more in that range: the span the next reads are bounded by.
pub fn learn_page(
    walk: &mut Walk,
    from: &[u8],
    keys: Option<(&[u8], &[u8])>,
    more: bool,
    read_end: &[u8],
    subtree_end: &[u8],
) {
    walk.reads.after_page(from, keys, more, read_end, subtree_end);
}

/// Whether a page reads on past a read that ended at `read_end` holding `held` of its `size`
/// keys, `more` when the origin held more in that read's range. A read bounded by a guess (a
/// span stretched over text keys falls short at a digit's carry) would otherwise make a short
/// page, and a short page costs a whole slot of the budget: the next read starts where this one
/// ended, so no key is skipped. Each read ends past its start, and a short one stretches the next
/// (`SyncReads`), so a page takes a few reads at most.
pub fn read_on(held: usize, size: i64, more: bool, read_end: &[u8], subtree_end: &[u8]) -> bool {
    !more && (held as i64) < size && read_end < subtree_end
}

/// The most page ends recorded on the peer, and their most bytes encoded: the record rides in the
/// sync's last Txn, beside the checkpoint.
pub const RECORDED_PAGE_ENDS: usize = 128;
pub const RECORDED_PAGE_ENDS_BYTES: usize = 32 * 1024;

/// The bytes the page ends record may take in a Txn of at most `max_txn_bytes`: a sixteenth, so
/// that a peer taking small requests still takes the sync's last Txn.
pub fn page_ends_budget(max_txn_bytes: usize) -> usize {
    (max_txn_bytes / 16).min(RECORDED_PAGE_ENDS_BYTES)
}

/// The page ends to record in at most `max_bytes`: every k-th of `ends`, k the smallest that
/// fits (the reads they bound then span up to 2k pages, still far less than the subtree).
pub fn recorded_page_ends(ends: &[Vec<u8>], max_bytes: usize) -> Vec<Vec<u8>> {
    (1..=ends.len())
        .map(|k| ends.iter().skip(k - 1).step_by(k).cloned().collect::<Vec<_>>())
        .find(|kept| kept.len() <= RECORDED_PAGE_ENDS && encode_page_ends(kept).len() <= max_bytes)
        .unwrap_or_default()
}

/// The page ends record: a JSON array of hex keys (keys are bytes).
pub fn encode_page_ends(ends: &[Vec<u8>]) -> Vec<u8> {
    let hex: Vec<String> = ends.iter().map(|end| end.iter().map(|b| format!("{b:02x}")).collect()).collect();
    serde_json::to_vec(&hex).unwrap_or_default()
}

/// The page ends a record holds, in order; None when it is damaged (a walk then starts unbounded).
pub fn decode_page_ends(value: &[u8]) -> Option<Vec<Vec<u8>>> {
    let hex: Vec<String> = serde_json::from_slice(value).ok()?;
    let ends = hex
        .iter()
        .map(|h| {
            let digits = h.as_bytes();
            if digits.len() % 2 != 0 {
                return None;
            }
            digits.chunks(2).map(|pair| u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()).collect()
        })
        .collect::<Option<Vec<Vec<u8>>>>()?;
    ends.is_sorted().then_some(ends)
}

/// The key range one page compares: from the cursor to just after the origin page's last key (or
/// to the read's end, `read_end`, when the origin holds no more before it), cut short at the peer page's last key when
/// the peer holds more keys in that range than one page, so both sides stay bounded. Returns the
/// range end, and the origin keys that fall inside it.
pub fn page_range(
    origin_page: Vec<Kv>,
    origin_more: bool,
    peer_last_key: Option<&[u8]>,
    peer_more: bool,
    read_end: &[u8],
) -> (Vec<u8>, Vec<Kv>) {
    let after = |key: &[u8]| {
        let mut end = key.to_vec();
        end.push(0);
        end
    };
    let mut end = match origin_page.last() {
        Some(last) if origin_more => after(&last.key),
        _ => read_end.to_vec(),
    };
    if peer_more && let Some(last) = peer_last_key {
        end = end.min(after(last));
    }
    let origin = origin_page.into_iter().filter(|kv| kv.key < end).collect();
    (end, origin)
}

/// The writes that make the peer's page equal the origin's: missing, changed or wrongly leased
/// keys are put, extra keys deleted. Keys left out of the mirror for their size are neither.
pub fn repairs(
    origin_page: Vec<Kv>,
    peer_page: Vec<Kv>,
    desired_shard: impl Fn(&[u8]) -> usize,
    shard_lease: impl Fn(usize) -> i64,
    left_out: &BTreeMap<String, usize>,
) -> Vec<MirrorOp> {
    let (mut origin, mut peer) = (VecDeque::from(origin_page), VecDeque::from(peer_page));
    let mut ops = Vec::new();
    merge_step(&mut origin, true, &mut peer, true, desired_shard, shard_lease, &mut ops);
    ops.retain(|op| {
        !(matches!(op, MirrorOp::Put { .. }) && left_out.contains_key(String::from_utf8_lossy(op.key()).as_ref()))
    });
    ops
}

/// Advances the walk to `end` (the page's range end); returns true when a pass just completed.
pub fn advance(walk: &mut Walk, end: &[u8], subtree_end: &[u8], repaired: usize) -> bool {
    walk.repaired_this_pass += repaired as u64;
    if end >= subtree_end {
        walk.cursor = None;
        walk.last_page_ends = std::mem::take(&mut walk.page_ends);
        // The next pass starts at the prefix: the span of this one's last page says nothing there.
        walk.reads = SyncReads::default();
        true
    } else {
        walk.cursor = Some(end.to_vec());
        walk.page_ends.push(end.to_vec());
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(key: &str, value: &str, lease: i64) -> Kv {
        Kv { key: key.into(), value: value.into(), lease }
    }

    #[test]
    fn a_page_range_ends_after_its_last_key_or_at_the_subtree_end() {
        let page = || vec![kv("a/1", "x", 7), kv("a/5", "x", 7)];
        assert_eq!(page_range(page(), true, None, false, b"a0").0, b"a/5\0".to_vec());
        assert_eq!(page_range(page(), false, None, false, b"a0").0, b"a0".to_vec());
        assert_eq!(page_range(vec![], false, None, false, b"a0").0, b"a0".to_vec());
        // The peer holds more than a page in the range: the range stops at its last key.
        let (end, origin) = page_range(page(), false, Some(b"a/3"), true, b"a0");
        assert_eq!(end, b"a/3\0".to_vec());
        assert_eq!(origin.len(), 1, "only origin keys inside the range are compared");
    }

    #[test]
    fn repairs_cover_missing_changed_extra_and_unleased_keys_but_not_left_out_ones() {
        let origin = vec![kv("a/1", "x", 0), kv("a/2", "new", 0), kv("a/3", "x", 0), kv("a/big", "x", 0)];
        let peer = vec![kv("a/2", "old", 7), kv("a/3", "x", 0), kv("a/9", "x", 7)];
        let mut left_out = BTreeMap::new();
        left_out.insert("a/big".to_string(), 5_000_000);
        let ops = repairs(origin, peer, |_| 0, |_| 7, &left_out);
        let keys: Vec<(&str, bool)> =
            ops.iter().map(|o| (std::str::from_utf8(o.key()).unwrap(), matches!(o, MirrorOp::Put { .. }))).collect();
        assert_eq!(keys, vec![("a/1", true), ("a/2", true), ("a/3", true), ("a/9", false)]);
    }

    #[test]
    fn equal_pages_need_nothing() {
        let page = vec![kv("a/1", "x", 7)];
        assert!(repairs(page.clone(), page, |_| 0, |_| 7, &BTreeMap::new()).is_empty());
    }

    #[test]
    fn workers_of_one_origin_share_its_budget_in_turns() {
        let budget = VerifyBudget::new(1_000);
        let t0 = Instant::now();
        let s = |d: f64| t0 + Duration::from_secs_f64(d);
        // Three workers ask at once for 1,000-key pages: one a second between them.
        let slots: Vec<_> = (0..3).map(|_| budget.reserve(1_000, t0).unwrap()).collect();
        assert_eq!(slots, vec![s(0.0), s(1.0), s(2.0)]);
        // The first asks again right after its page: after the others, so each reads a third.
        assert_eq!(budget.reserve(1_000, s(0.1)), Some(s(3.0)));
        // Alone and idle, a worker is bound only by its own earliest time (its interval).
        assert_eq!(budget.reserve(500, s(60.0)), Some(s(60.0)));
        assert_eq!(budget.reserve(500, s(60.0)), Some(s(60.5)));
        assert_eq!(VerifyBudget::new(0).reserve(1_000, t0), None, "0 turns verification off");
    }

    #[test]
    fn the_walk_moves_page_by_page_and_wraps() {
        let mut walk = Walk::default();
        assert!(!advance(&mut walk, b"a/1\0", b"a0", 2));
        assert_eq!(walk.cursor, Some(b"a/1\0".to_vec()));
        assert!(advance(&mut walk, b"a0", b"a0", 1));
        assert_eq!((walk.cursor.clone(), walk.repaired_this_pass), (None, 3));
        assert_eq!(walk.last_page_ends, vec![b"a/1\0".to_vec()], "the pass's page ends are kept for the next");
    }

    #[test]
    fn page_ends_are_recorded_within_bounds_and_read_back() {
        let ends: Vec<Vec<u8>> = (0..200u32).map(|i| format!("/a/{i:05}\0").into_bytes()).collect();
        let kept = recorded_page_ends(&ends, RECORDED_PAGE_ENDS_BYTES);
        assert!(kept.len() <= RECORDED_PAGE_ENDS && kept.len() >= RECORDED_PAGE_ENDS / 2, "{} kept", kept.len());
        assert_eq!((kept[0].clone(), kept[1].clone()), (ends[1].clone(), ends[3].clone()), "every 2nd");
        assert_eq!(decode_page_ends(&encode_page_ends(&kept)), Some(kept));
        // Long keys: fewer, to fit the bytes.
        let long: Vec<Vec<u8>> = (0..128u32).map(|i| format!("/a/{i:05}/{}", "x".repeat(500)).into_bytes()).collect();
        let kept = recorded_page_ends(&long, RECORDED_PAGE_ENDS_BYTES);
        assert!(!kept.is_empty() && encode_page_ends(&kept).len() <= RECORDED_PAGE_ENDS_BYTES);
        assert!(recorded_page_ends(&[], RECORDED_PAGE_ENDS_BYTES).is_empty());
        // A peer taking small requests gets a small record, or none.
        assert_eq!(page_ends_budget(12 << 10), 768);
        assert!(encode_page_ends(&recorded_page_ends(&ends, 768)).len() <= 768);
        assert!(recorded_page_ends(&long, 768).is_empty(), "no end of 500 bytes fits in 768 as hex");
        // A damaged record is none at all, never ends out of order.
        assert_eq!(decode_page_ends(b"not json"), None);
        assert_eq!(decode_page_ends(br#"["2f62","2f61"]"#), None, "out of order");
        assert_eq!(decode_page_ends(br#"["2f6"]"#), None);
        assert_eq!(decode_page_ends(br#"["zz"]"#), None);
    }

    #[test]
    fn a_page_read_stops_two_of_the_last_passs_page_ends_ahead() {
        let subtree_end = b"a0".as_slice();
        let mut walk = Walk::default();
        assert_eq!(read_end(&walk, b"a/", subtree_end), subtree_end, "no pass yet: to the subtree's end");
        for end in [b"a/2\0".as_slice(), b"a/4\0", b"a/6\0"] {
            advance(&mut walk, end, subtree_end, 0);
        }
        advance(&mut walk, subtree_end, subtree_end, 0);
        // The pass's first page: from the prefix, to the second page's end.
        assert_eq!(read_end(&walk, b"a/", subtree_end), b"a/4\0".to_vec());
        // From a page end of the last pass, two ends ahead.
        assert_eq!(read_end(&walk, b"a/2\0", subtree_end), b"a/6\0".to_vec());
        // From between ends (the subtree grew and a page ended early): still two ahead of it.
        assert_eq!(read_end(&walk, b"a/3", subtree_end), b"a/6\0".to_vec());
        // Near the end: the subtree's end.
        assert_eq!(read_end(&walk, b"a/4\0", subtree_end), subtree_end);
        assert_eq!(read_end(&walk, b"a/7", subtree_end), subtree_end);
        // A restart keeps what the pass learned, and forgets where it was.
        walk.cursor = Some(b"a/2\0".to_vec());
        walk.restart();
        assert_eq!((walk.cursor.clone(), walk.last_page_ends.len()), (None, 3));
    }

    /// One pass over `keys` (sorted) in pages of `size`, each read of the origin as `origin_page`
    /// makes them: bounded by `read_end`, read on by `read_on`. Returns each page's keys, and the
    /// keys etcd counted for each page (every key from a read's start to its end).
    fn simulated_pass(
        walk: &mut Walk,
        keys: &[Vec<u8>],
        size: usize,
        prefix: &[u8],
        end: &[u8],
    ) -> Vec<(usize, usize)> {
        let mut pages = Vec::new();
        loop {
            let from = walk.cursor.clone().unwrap_or_else(|| prefix.to_vec());
            let (mut held, mut counted, mut cursor) = (Vec::<Vec<u8>>::new(), 0, from);
            let (more, read_to) = loop {
                let read_to = read_end(walk, &cursor, end);
                let in_range: Vec<_> = keys.iter().filter(|k| **k >= cursor && **k < read_to).collect();
                counted += in_range.len();
                let wanted = size - held.len();
                let more = in_range.len() > wanted;
                let read: Vec<Vec<u8>> = in_range.into_iter().take(wanted).cloned().collect();
                let first_last = read.first().zip(read.last()).map(|(f, l)| (f.as_slice(), l.as_slice()));
                learn_page(walk, &cursor, first_last, more, &read_to, end);
                held.extend(read);
                if !read_on(held.len(), size as i64, more, &read_to, end) {
                    break (more, read_to);
                }
                cursor = read_to;
            };
            let page_end = match held.last() {
                Some(last) if more => [last.as_slice(), &[0]].concat(),
                _ => read_to,
            };
            pages.push((held.len(), counted));
            if advance(walk, &page_end, end, 0) {
                return pages;
            }
        }
    }

    #[test]
    fn over_text_keys_pages_stay_full_and_a_pass_counts_a_few_times_the_subtree() {
        // Decimal names: a span stretched over them falls short at each carry of a digit.
        let (prefix, end) = (b"/a/".to_vec(), b"/a0".to_vec());
        let keys: Vec<Vec<u8>> = (0..40_000).map(|i| format!("/a/svc-{i:06}/endpoints").into_bytes()).collect();
        // The sync read pages of 4,000 keys and recorded where they ended.
        let sync_ends = keys.iter().skip(3_999).step_by(4_000).map(|k| [k.as_slice(), &[0]].concat()).collect();
        let mut walk = Walk { last_page_ends: sync_ends, ..Walk::default() };
        for pass in ["the first pass, bounded by the sync's pages", "the next, by the last pass's"] {
            let pages = simulated_pass(&mut walk, &keys, 500, &prefix, &end);
            let held: usize = pages.iter().map(|(held, _)| held).sum();
            let counted: usize = pages.iter().map(|(_, counted)| counted).sum();
            assert_eq!(held, keys.len(), "{pass}: every key compared once");
            assert!(pages[..pages.len() - 1].iter().all(|(held, _)| *held == 500), "{pass}: a short page: {pages:?}");
            assert!(counted <= 4 * keys.len(), "{pass}: etcd counted {counted} keys for a pass of {}", keys.len());
        }
    }

    #[test]
    fn a_page_reads_on_until_it_holds_its_size_the_origin_holds_more_or_the_subtree_ends() {
        let end = b"/a/5".as_slice();
        assert!(read_on(10, 1_000, false, end, b"/a0"), "short, nothing more there, the subtree goes on");
        assert!(!read_on(1_000, 1_000, false, end, b"/a0"), "full");
        assert!(!read_on(10, 1_000, true, end, b"/a0"), "the origin holds more before the read's end");
        assert!(!read_on(10, 1_000, false, b"/a0", b"/a0"), "read to the subtree's end");
    }

    #[test]
    fn in_the_first_pass_after_a_sync_a_read_stops_about_two_pages_ahead_not_two_sync_pages() {
        // Key i is the prefix and i in four bytes: key spans measure exactly.
        let key = |i: u32| [b"/a/".as_slice(), &i.to_be_bytes()].concat();
        let after = |i: u32| [key(i), vec![0]].concat();
        let (prefix, subtree_end) = (b"/a/".to_vec(), b"/a0".to_vec());
        // The sync of 100,000 keys read pages of 10,000 (a 64th of a larger subtree is as many).
        let mut walk = Walk { last_page_ends: (1..=10).map(|p| after(p * 10_000 - 1)).collect(), ..Walk::default() };
        let end = read_end(&walk, &prefix, &subtree_end);
        assert_eq!(end, after(19_999), "no page read yet: two of the sync's page ends");
        // The first page returned keys 0..=999, and the origin held more.
        learn_page(&mut walk, &prefix, Some((&key(0), &key(999))), true, &end, &subtree_end);
        advance(&mut walk, &after(999), &subtree_end, 0);
        let end = read_end(&walk, &after(999), &subtree_end);
        assert!(end > key(2_990) && end < key(3_010), "about two pages past key 999: {end:?}");
        // A read that came back short (the keys sparser there) reaches further the next time.
        learn_page(&mut walk, &after(999), Some((&key(1_000), &key(1_500))), false, &end, &subtree_end);
        advance(&mut walk, &end, &subtree_end, 0);
        let further = read_end(&walk, &end, &subtree_end);
        assert!(further > key(8_900) && further < key(9_100), "eight spans further: {further:?}");
        // Never past two of the sync's page ends, however far the span reaches.
        learn_page(&mut walk, &end, Some((&key(3_000), &key(13_000))), true, &further, &subtree_end);
        assert_eq!(read_end(&walk, &after(13_000), &subtree_end), after(29_999));
        // A whole pass forgets the span: the next starts at the prefix, bounded by its own ends.
        advance(&mut walk, &subtree_end, &subtree_end, 0);
        assert_eq!(walk.reads, SyncReads::default());
        assert_eq!(read_end(&walk, &prefix, &subtree_end), end, "the second of the pass's page ends");
    }
}
