//! Lease sharding, without IO. Each key's lease is chosen by a stable hash of the key, so a key
//! stays on its lease until a lease is lost or the keys are resharded, and a new leader computes
//! the same placement from the checkpoint alone. etcd before 3.5.10 pays time linear in a lease's
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

/// The shard of a key: FNV-1a, stable across processes and versions.
/// Whether a shard holds more keys than the cap: the watch's trigger for a reshard.
pub fn overfull(keys_per_shard: &[i64], max_keys_per_lease: u64) -> bool {
    keys_per_shard.iter().any(|n| *n > 0 && *n as u64 > max_keys_per_lease)
}

/// Whether a sync must lay the leases out anew: none yet, a shard past the cap (the watch's
/// trigger, so the two never disagree and loop), or a shard count far from what the keys need.
pub fn needs_reshard(current: usize, keys_per_shard: &[i64], total_keys: u64, max_keys_per_lease: u64) -> bool {
    current == 0
        || overfull(keys_per_shard, max_keys_per_lease)
        || !shard_count_fits(current, total_keys, max_keys_per_lease)
}

pub fn shard_of(key: &[u8], shards: usize) -> usize {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in key {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    (hash % shards.max(1) as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

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
                let key = format!(
                    "/aether/v1/regions/a/clusters/c{}/services/s{}/protocols/tcp/endpoints/10.{}.{}.{}",
                    i % 7,
                    i % 97,
                    (i >> 16) & 255,
                    (i >> 8) & 255,
                    i & 255
                );
                counts[shard_of(key.as_bytes(), shards)] += 1;
            }
            let max = counts.iter().max().copied().unwrap_or(0);
            assert!(max <= cap, "{keys} keys over {shards} shards: a shard holds {max} > {cap}");
        }
    }

    #[test]
    fn the_watch_trigger_and_the_sync_rule_agree() {
        // An overfull shard makes the watch ask for a reshard, and the sync then reshards.
        assert!(overfull(&[1001, 10], 1000));
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
