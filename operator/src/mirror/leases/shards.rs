//! Lease sharding, without IO. Each key's lease is chosen by a stable hash of the key, so a key
//! stays on its lease until a lease is lost or its shard is split, and a new leader computes the
//! same placement from the checkpoint alone. A shard past the cap is split online in two
//! (extendible hashing): only about half of its keys move, while the watch goes on. etcd before 3.5.10 pays time linear in a lease's
//! keys on every attached put (etcd issue 15993), so no lease should carry too many keys.

/// Shards for `keys` keys: a power of two that keeps the expected load at half the cap or less,
/// so that hash imbalance stays far from the cap.
pub fn shard_count(keys: u64, max_keys_per_lease: u64) -> usize {
    let max = max_keys_per_lease.max(1);
    let needed = (keys.saturating_mul(2)).div_ceil(max).max(1);
    needed.next_power_of_two() as usize
}

/// Whether the current shard count can stay for `keys` keys: enough shards, and not grossly
/// more than needed (reshards move keys, so they happen only when they must).
pub fn shard_count_fits(current: usize, keys: u64, max_keys_per_lease: u64) -> bool {
    let wanted = shard_count(keys, max_keys_per_lease);
    current >= wanted && current <= wanted.saturating_mul(8)
}

/// Whether a shard holds more keys than the cap: the sync's trigger for a reshard.
pub fn overfull(keys_per_shard: &[i64], max_keys_per_lease: u64) -> bool {
    keys_per_shard.iter().any(|n| *n > 0 && *n as u64 > max_keys_per_lease)
}

/// Whether `keys` keys outgrow a layout of `shards` shards: more than three quarters of the cap
/// on average (pure). Past that a growing share of the shards passes the cap, and splits, a few
/// round trips each and one at a time, fall behind: with 8,000 keys on 128 shards of 64, 150 ms
/// away, a lease still held 89 keys after 25 splits and 90 s. Under auth the watch then resyncs
/// to a new layout rather than pile keys onto leases whose every put checks every key on them.
/// A sync lays out at least twice the shards its keys need at the cap, so the subtree grows by
/// half before this holds.
pub fn outgrown(shards: usize, keys: u64, max_keys_per_lease: u64) -> bool {
    let capacity = (shards.max(1) as u64).saturating_mul(max_keys_per_lease.max(1));
    keys.saturating_mul(4) > capacity.saturating_mul(3)
}

/// Whether a sync must lay the leases out anew: none yet, a shard past the cap (the watch's
/// trigger, so the two never disagree and loop), or a shard count far from what the keys need.
pub fn needs_reshard(current: usize, keys_per_shard: &[i64], total_keys: u64, max_keys_per_lease: u64) -> bool {
    current == 0
        || overfull(keys_per_shard, max_keys_per_lease)
        || !shard_count_fits(current, total_keys, max_keys_per_lease)
}

/// The shard of a key among `shards` by hash modulo their count (a uniform layout).
pub fn shard_of(key: &[u8], shards: usize) -> usize {
    (key_hash(key) % shards.max(1) as u64) as usize
}

/// One lease's share of the key space: the keys whose hash, modulo 2^depth, is `index`
/// (extendible hashing). A uniform layout of 2^d shards is every index at depth d; splitting a
/// shard makes two at depth + 1, one keeping its lease and half its keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Slot {
    pub depth: u8,
    pub index: u64,
}

/// Which shard each key belongs to: slots aligned with the worker's leases.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    slots: Vec<Slot>,
    by_slot: std::collections::HashMap<Slot, usize>,
    /// The depths present, deepest first.
    depths: Vec<u8>,
}

impl Layout {
    /// `count` shards by hash modulo `count` (a power of two, as `shard_count` gives).
    pub fn uniform(count: usize) -> Layout {
        let count = count.max(1).next_power_of_two();
        let depth = count.trailing_zeros() as u8;
        Layout::from_slots((0..count as u64).map(|index| Slot { depth, index }).collect())
    }

    pub fn from_slots(slots: Vec<Slot>) -> Layout {
        let by_slot = slots.iter().enumerate().map(|(i, s)| (*s, i)).collect();
        let mut depths: Vec<u8> = slots.iter().map(|s| s.depth).collect();
        depths.sort_unstable_by(|a, b| b.cmp(a));
        depths.dedup();
        Layout { slots, by_slot, depths }
    }

    /// The layout a checkpoint records: its slots, or (recorded before splits existed, or
    /// uniform) `leases` shards by hash modulo their count.
    pub fn recorded(slots: &[Slot], leases: usize) -> Layout {
        if slots.len() == leases && leases > 0 { Layout::from_slots(slots.to_vec()) } else { Layout::uniform(leases) }
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// Whether shard j is index j at one depth, as `uniform` lays them out (a checkpoint then
    /// need not list the slots). Splits append shards, so equal depths alone do not say it.
    pub fn is_uniform(&self) -> bool {
        self.depths.len() <= 1 && self.slots.iter().enumerate().all(|(j, slot)| slot.index == j as u64)
    }

    /// The shard a key belongs to.
    pub fn shard_of(&self, key: &[u8]) -> usize {
        let hash = key_hash(key);
        for depth in &self.depths {
            let slot = Slot { depth: *depth, index: hash & mask(*depth) };
            if let Some(shard) = self.by_slot.get(&slot) {
                return *shard;
            }
        }
        0 // not reached for a layout that covers the key space, as every layout here does
    }

    /// How many hash bits decide whether a key is in `shard`.
    pub fn depth(&self, shard: usize) -> u8 {
        self.slots.get(shard).map_or(0, |s| s.depth)
    }

    /// Splits `shard` in two: it keeps the keys whose next hash bit is 0; the new shard,
    /// appended (its index returned), takes the others. None when the shard is at [`MAX_DEPTH`].
    pub fn split(&mut self, shard: usize) -> Option<usize> {
        let Slot { depth, index } = *self.slots.get(shard)?;
        if depth >= MAX_DEPTH {
            return None;
        }
        let mut slots = self.slots.clone();
        slots[shard] = Slot { depth: depth + 1, index };
        slots.push(Slot { depth: depth + 1, index: index | (1u64 << depth) });
        *self = Layout::from_slots(slots);
        Some(self.slots.len() - 1)
    }

    /// Whether `slots` split the key space exactly: each a valid index at a depth up to
    /// [`MAX_DEPTH`], none inside another, together covering all of it. A recorded layout that
    /// does not would place keys on shards that do not exist.
    pub fn partitions(slots: &[Slot]) -> bool {
        if slots.is_empty() || slots.iter().any(|s| s.depth > MAX_DEPTH || s.index > mask(s.depth)) {
            return false;
        }
        let covered: u128 = slots.iter().map(|s| 1u128 << (MAX_DEPTH - s.depth)).sum();
        let set: std::collections::HashSet<Slot> = slots.iter().copied().collect();
        if covered != 1u128 << MAX_DEPTH || set.len() != slots.len() {
            return false;
        }
        let depths: std::collections::BTreeSet<u8> = slots.iter().map(|s| s.depth).collect();
        slots
            .iter()
            .all(|s| depths.range(..s.depth).all(|d| !set.contains(&Slot { depth: *d, index: s.index & mask(*d) })))
    }
}

/// The deepest a shard splits: 2^40 shards is far past any subtree. A shard still past the cap
/// there holds keys whose hashes agree on 40 bits, which no split separates; it is reported, not
/// split.
pub const MAX_DEPTH: u8 = 40;

fn mask(depth: u8) -> u64 {
    if depth >= 64 { u64::MAX } else { (1u64 << depth) - 1 }
}

/// FNV-1a, stable across processes and versions.
fn key_hash(key: &[u8]) -> u64 {
    key.iter().fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3))
}

/// The shards holding more keys than the cap, in order: the first that can split is split.
pub fn overfull_shards(keys_per_shard: &[i64], max_keys_per_lease: u64) -> impl Iterator<Item = usize> + '_ {
    keys_per_shard.iter().enumerate().filter(move |(_, n)| **n > 0 && **n as u64 > max_keys_per_lease).map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layout_is_outgrown_once_its_leases_average_past_three_quarters_of_the_cap() {
        assert!(!outgrown(1, 48, 64), "an empty subtree's one lease takes up to 48 keys");
        assert!(outgrown(1, 49, 64));
        assert!(!outgrown(128, 6144, 64));
        assert!(outgrown(128, 6145, 64));
        // A sync lays out 128 shards for 2,653 keys at 64 a lease; the watch resyncs past 6,144.
        assert_eq!(shard_count(2653, 64), 128);
        assert!(!outgrown(0, 0, 64));
        // What a sync lays out is never outgrown by the keys it was laid out for.
        for keys in [0u64, 1, 63, 64, 1000, 20_000, 1 << 20] {
            assert!(!outgrown(shard_count(keys, 64), keys, 64), "{keys} keys");
        }
    }

    fn endpoint(i: u64) -> Vec<u8> {
        format!(
            "/aether/v1/regions/a/clusters/c{}/services/s{}/protocols/tcp/endpoints/10.{}.{}.{}",
            i % 7,
            i % 97,
            (i >> 16) & 255,
            (i >> 8) & 255,
            i & 255
        )
        .into_bytes()
    }

    #[test]
    fn a_uniform_layout_places_keys_as_recorded_before_splits_existed() {
        for count in [1usize, 2, 32, 2048] {
            let layout = Layout::uniform(count);
            for i in 0..2_000 {
                assert_eq!(layout.shard_of(&endpoint(i)), shard_of(&endpoint(i), count));
            }
        }
        assert_eq!(Layout::recorded(&[], 16), Layout::uniform(16), "a checkpoint without slots is uniform");
    }

    #[test]
    fn a_split_moves_only_part_of_the_split_shards_keys() {
        let mut layout = Layout::uniform(4);
        let before: Vec<usize> = (0..20_000).map(|i| layout.shard_of(&endpoint(i))).collect();
        let new = layout.split(2);
        assert_eq!(new, Some(4));
        assert!(!layout.is_uniform());
        let mut moved = 0;
        for (i, old) in before.iter().enumerate() {
            let now = layout.shard_of(&endpoint(i as u64));
            if *old != 2 {
                assert_eq!(now, *old, "a key of another shard stays");
            } else {
                assert!(now == 2 || now == 4);
                moved += usize::from(now == 4);
            }
        }
        let in_shard = before.iter().filter(|s| **s == 2).count();
        assert!(moved > in_shard / 3 && moved < in_shard * 2 / 3, "about half moves: {moved} of {in_shard}");
        assert_eq!(Layout::recorded(layout.slots(), 5), layout, "the recorded slots give the same layout back");
        // Split back to one depth, the shards are not in index order: still not uniform.
        for shard in [0, 1, 3] {
            layout.split(shard);
        }
        assert!(!layout.is_uniform(), "{:?}", layout.slots());
        assert!(Layout::uniform(8).is_uniform());
    }

    #[test]
    fn repeated_splits_keep_every_key_placed_and_under_the_cap() {
        let cap = 1_000i64;
        let keys: Vec<Vec<u8>> = (0..40_000).map(endpoint).collect();
        let mut layout = Layout::uniform(1);
        loop {
            let mut counts = vec![0i64; layout.len()];
            for k in &keys {
                counts[layout.shard_of(k)] += 1;
            }
            match overfull_shards(&counts, cap as u64).next() {
                Some(shard) => {
                    layout.split(shard);
                }
                None => {
                    assert!(counts.iter().all(|n| *n <= cap));
                    assert!(layout.len() <= 4 * 40, "{} shards for 40 full ones", layout.len());
                    break;
                }
            }
        }
    }

    #[test]
    fn a_shard_splits_down_to_the_deepest_depth_and_no_further() {
        let mut layout = Layout::uniform(1);
        let mut shard = 0;
        for _ in 0..MAX_DEPTH {
            layout.split(shard).expect("splits");
            shard = 0;
        }
        assert_eq!(layout.depth(0), MAX_DEPTH);
        assert_eq!(layout.split(0), None, "no deeper than MAX_DEPTH, and no overflow");
        assert!(Layout::partitions(layout.slots()));
        assert!(layout.shard_of(b"/aether/v1/regions/a/x") < layout.len());
    }

    #[test]
    fn only_layouts_that_split_the_key_space_exactly_are_accepted() {
        let mut layout = Layout::uniform(4);
        layout.split(1);
        layout.split(4);
        assert!(Layout::partitions(layout.slots()));
        assert!(Layout::partitions(Layout::uniform(8).slots()));
        let slot = |depth, index| Slot { depth, index };
        assert!(!Layout::partitions(&[]), "nothing covered");
        assert!(!Layout::partitions(&[slot(1, 0)]), "half covered");
        assert!(!Layout::partitions(&[slot(1, 0), slot(1, 1), slot(2, 1)]), "overlapping");
        assert!(!Layout::partitions(&[slot(1, 0), slot(1, 2)]), "an index past its depth");
        assert!(!Layout::partitions(&[slot(0, 0), slot(0, 0)]), "twice");
        assert!(!Layout::partitions(&[slot(200, 0)]), "past the deepest depth");
        // Covering all of it by measure, with one slot inside another and a hole.
        assert!(!Layout::partitions(&[slot(1, 0), slot(2, 0), slot(2, 1)]), "inside another");
    }

    #[test]
    fn shard_counts_grow_with_keys() {
        assert_eq!(shard_count(0, 10_000), 1);
        assert_eq!(shard_count(5_000, 10_000), 1);
        assert_eq!(shard_count(5_001, 10_000), 2);
        assert_eq!(shard_count(100_000, 10_000), 32);
        assert!(shard_count_fits(32, 100_000, 10_000));
        assert!(!shard_count_fits(16, 100_000, 10_000));
        assert!(!shard_count_fits(1024, 100, 10_000));
    }

    #[test]
    fn no_shard_exceeds_the_cap_for_realistic_keys() {
        for (keys, cap) in [(100_000u64, 10_000u64), (100_000, 1_000), (5_000, 100)] {
            let shards = shard_count(keys, cap);
            let mut counts = vec![0u64; shards];
            for i in 0..keys {
                counts[shard_of(&endpoint(i), shards)] += 1;
            }
            let max = counts.iter().max().copied().unwrap_or(0);
            assert!(max <= cap, "{keys} keys over {shards} shards: a shard holds {max} > {cap}");
        }
    }

    #[test]
    fn the_watch_trigger_and_the_sync_rule_agree() {
        // An overfull shard makes the watch ask for a reshard, and the sync then reshards.
        assert!(overfull(&[1001, 10], 1000));
        assert_eq!(overfull_shards(&[10, 1001, 5, 2000], 1000).collect::<Vec<_>>(), vec![1, 3]);
        assert!(needs_reshard(2, &[1001, 10], 1011, 1000));
        // Growing past half the capacity alone does not reshard in the watch.
        assert!(!overfull(&[600, 600], 1000));
        assert!(needs_reshard(0, &[], 0, 1000));
    }

    #[test]
    fn placement_is_stable() {
        assert_eq!(shard_of(b"/aether/v1/regions/a/x", 16), shard_of(b"/aether/v1/regions/a/x", 16));
        assert_eq!(shard_of(b"anything", 1), 0);
    }
}
