//! What the other regions mirror into the local etcd, observed read-only: per origin, its keys,
//! the remaining TTL of its leases, its sync canary and its checkpoint's revision.
use crate::keys;
use etcd_client::{Client, GetOptions};
use std::collections::BTreeSet;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InboundOrigin {
    pub origin: String,
    pub keys: i64,
    /// The smallest remaining TTL over the origin's leases; None when it holds none here.
    pub lease_ttl_remaining: Option<i64>,
    /// The origin's canary is here: its complete snapshot arrived.
    pub synced: bool,
    pub checkpoint_revision: Option<i64>,
}

/// Observes every origin other than `own_region` that mirrors into this etcd, plus the
/// `expected` ones (the configured peers) even before they have written anything.
pub async fn observe(local: &mut Client, own_region: &str, expected: &[String]) -> anyhow::Result<Vec<InboundOrigin>> {
    let listing = local.get(keys::FEDERATION_ROOT, Some(GetOptions::new().with_prefix().with_keys_only())).await?;
    let mut origins: BTreeSet<String> = expected.iter().cloned().collect();
    for kv in listing.kvs() {
        if let Some(rest) = kv.key().strip_prefix(keys::FEDERATION_ROOT.as_bytes())
            && let Some(end) = rest.iter().position(|b| *b == b'/')
            && let Ok(origin) = std::str::from_utf8(&rest[..end])
        {
            origins.insert(origin.to_string());
        }
    }
    origins.remove(own_region);

    let mut out = Vec::with_capacity(origins.len());
    for origin in origins {
        let count =
            local.get(keys::region_prefix(&origin), Some(GetOptions::new().with_prefix().with_count_only())).await?;
        let checkpoint = crate::mirror::records::store::read_checkpoint(local, &origin).await?;
        let canary = local.get(keys::canary_key(&origin), None).await?;
        let synced = canary.kvs().first().is_some_and(|kv| canary_says_synced(kv.value()));
        let mut ttl: Option<i64> = None;
        // A few leases tell the story; every shard shares the same keepalive.
        for lease in checkpoint.iter().flat_map(|c| c.leases.iter()).take(4) {
            if let Ok(resp) = local.lease_time_to_live(*lease, None).await {
                let remaining = resp.ttl().max(0);
                ttl = Some(ttl.map_or(remaining, |t: i64| t.min(remaining)));
            }
        }
        out.push(InboundOrigin {
            origin,
            keys: count.count(),
            lease_ttl_remaining: ttl,
            synced,
            checkpoint_revision: checkpoint.map(|c| c.revision),
        });
    }
    Ok(out)
}

/// Whether a canary's value says the origin's snapshot is complete (`{"synced": true, ...}`);
/// `{"synced": false, "cause": ...}` is written before a resync moves any key.
pub fn canary_says_synced(value: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(value).is_ok_and(|v| v["synced"] == serde_json::Value::Bool(true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_canary_that_says_synced_counts() {
        assert!(canary_says_synced(br#"{"synced":true,"revision":9,"syncedAt":"t"}"#));
        assert!(!canary_says_synced(br#"{"synced":false,"cause":"a lease was lost"}"#));
        assert!(!canary_says_synced(b"garbage"));
    }
}
