//! Continuous verification, without IO: the worker walks the origin's subtree one page at a time
//! at a low rate, compares each page with the peer's copy of the same key range at the revision
//! the peer holds, and repairs what differs with a targeted write of that range. Nothing else in
//! the mirror notices an out-of-band write or delete on the peer, a partial restore, or a bug.
//!
//! A page is compared only while no batch is in flight, so the peer holds exactly the origin's
//! subtree at the applied revision; the origin side is read pinned at that revision.
use crate::mirror::plan::{Kv, MirrorOp, merge_step};
use std::collections::{BTreeMap, VecDeque};

/// Where the walk is, and what the current pass found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Walk {
    /// The first key of the next page (None: start a new pass at the prefix).
    pub cursor: Option<Vec<u8>>,
    /// Keys repaired in the current pass.
    pub repaired_this_pass: u64,
}

/// The key range one page compares: from the cursor to just after the origin page's last key (or
/// to the subtree's end after the last origin page), cut short at the peer page's last key when
/// the peer holds more keys in that range than one page, so both sides stay bounded. Returns the
/// range end, and the origin keys that fall inside it.
pub fn page_range(
    origin_page: Vec<Kv>,
    origin_more: bool,
    peer_last_key: Option<&[u8]>,
    peer_more: bool,
    subtree_end: &[u8],
) -> (Vec<u8>, Vec<Kv>) {
    let after = |key: &[u8]| {
        let mut end = key.to_vec();
        end.push(0);
        end
    };
    let mut end = match origin_page.last() {
        Some(last) if origin_more => after(&last.key),
        _ => subtree_end.to_vec(),
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
        true
    } else {
        walk.cursor = Some(end.to_vec());
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
    fn the_walk_moves_page_by_page_and_wraps() {
        let mut walk = Walk::default();
        assert!(!advance(&mut walk, b"a/1\0", b"a0", 2));
        assert_eq!(walk.cursor, Some(b"a/1\0".to_vec()));
        assert!(advance(&mut walk, b"a0", b"a0", 1));
        assert_eq!((walk.cursor, walk.repaired_this_pass), (None, 3));
    }
}
