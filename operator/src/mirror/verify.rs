//! Continuous verification, without IO: the worker walks the origin's subtree one page at a time
//! at a low rate, compares each page with the peer's copy of the same key range at the revision
//! the peer holds, and repairs what differs with a targeted write of that range. Nothing else in
//! the mirror notices an out-of-band write or delete on the peer, a partial restore, or a bug.
//!
//! A page is compared only while no batch is in flight, so the peer holds exactly the origin's
//! subtree at the applied revision; the origin side is read pinned at that revision.
use super::plan::{Kv, MirrorOp, merge_step};
use std::collections::{BTreeMap, VecDeque};

/// Where the walk is, and what the current pass found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Walk {
    /// The first key of the next page (None: start a new pass at the prefix).
    pub cursor: Option<Vec<u8>>,
    /// Keys repaired in the current pass.
    pub repaired_this_pass: u64,
}

/// The key range one page covers on the peer: from the cursor to just after the origin page's
/// last key, or to the end of the subtree when the origin page was the last.
pub fn peer_range_end(origin_page: &[Kv], origin_more: bool, subtree_end: &[u8]) -> Vec<u8> {
    match origin_page.last() {
        Some(last) if origin_more => {
            let mut end = last.key.clone();
            end.push(0);
            end
        }
        _ => subtree_end.to_vec(),
    }
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

/// Advances the walk past a page; returns true when a pass just completed.
pub fn advance(walk: &mut Walk, origin_page: &[Kv], origin_more: bool, repaired: usize) -> bool {
    walk.repaired_this_pass += repaired as u64;
    match origin_page.last() {
        Some(last) if origin_more => {
            let mut next = last.key.clone();
            next.push(0);
            walk.cursor = Some(next);
            false
        }
        _ => {
            walk.cursor = None;
            true
        }
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
        let page = vec![kv("a/1", "x", 7), kv("a/5", "x", 7)];
        assert_eq!(peer_range_end(&page, true, b"a0"), b"a/5\0".to_vec());
        assert_eq!(peer_range_end(&page, false, b"a0"), b"a0".to_vec());
        assert_eq!(peer_range_end(&[], false, b"a0"), b"a0".to_vec());
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
    fn the_walk_moves_page_by_page_and_wraps() {
        let mut walk = Walk::default();
        assert!(!advance(&mut walk, &[kv("a/1", "x", 0)], true, 2));
        assert_eq!(walk.cursor, Some(b"a/1\0".to_vec()));
        assert!(advance(&mut walk, &[kv("a/2", "x", 0)], false, 1));
        assert_eq!((walk.cursor, walk.repaired_this_pass), (None, 3));
    }
}
