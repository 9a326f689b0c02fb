//! What the other regions mirror into the local etcd, observed read-only: per origin, its keys,
//! the remaining TTL of its leases, its sync canary and its checkpoint's revision.
//!
//! Another region's mirror user may write anything under its own `/aether/v1/federation/<r>/`
//! here, so every read is bounded: origins are found one keys-only read each (at most
//! [`MAX_ORIGINS`], names that are not region names skipped, so they never reach a metric label),
//! and of each origin's records only the checkpoint's header and its first part (four lease ids
//! are all the view uses), the canary and one lease's TTL are read, whatever the records say.
use crate::keys;
use etcd_client::{Client, GetOptions};
use std::collections::BTreeSet;

/// The most origins the view lists in one etcd (a mesh holds at most 33 regions).
pub const MAX_ORIGINS: usize = 64;

/// The names right under `root` in an etcd (`<root><name>/...`), one keys-only read each: at
/// most `max`, a key without a name under the root, or a name that is not a region name,
/// stepped over.
pub async fn names_under(local: &mut Client, root: &str, max: usize) -> Result<Vec<String>, etcd_client::Error> {
    let end = keys::prefix_range_end(root.as_bytes());
    let mut from = root.as_bytes().to_vec();
    let mut names = Vec::new();
    let mut steps = 0;
    while names.len() < max && steps < 4 * max {
        steps += 1;
        let options = GetOptions::new().with_range(end.clone()).with_keys_only().with_limit(1);
        let page = crate::mirror::target::kv(local).get(from.clone(), Some(options)).await?;
        let Some(first) = page.kvs().first() else { break };
        let rest = &first.key()[root.len()..];
        match rest.iter().position(|b| *b == b'/').map(|end| &rest[..end]) {
            Some(name) => {
                let mut prefix = root.as_bytes().to_vec();
                prefix.extend_from_slice(name);
                prefix.push(b'/');
                from = keys::prefix_range_end(&prefix);
                if let Ok(name) = std::str::from_utf8(name)
                    && keys::is_dns_label(name)
                {
                    names.push(name.to_string());
                }
            }
            None => {
                from = first.key().to_vec();
                from.push(0);
            }
        }
    }
    Ok(names)
}

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
    let mut origins: BTreeSet<String> = expected.iter().cloned().collect();
    origins.extend(names_under(local, keys::FEDERATION_ROOT, MAX_ORIGINS).await?);
    origins.remove(own_region);

    let mut out = Vec::with_capacity(origins.len());
    for origin in origins.into_iter().take(MAX_ORIGINS) {
        let count =
            local.get(keys::region_prefix(&origin), Some(GetOptions::new().with_prefix().with_count_only())).await?;
        let (revision, leases) = first_leases(local, &origin).await?;
        let canary = local.get(keys::canary_key(&origin), None).await?;
        let synced = canary.kvs().first().is_some_and(|kv| canary_says_synced(kv.value()));
        let mut ttl: Option<i64> = None;
        // A few leases tell the story; every shard shares the same keepalive.
        for lease in leases.into_iter().take(4) {
            if let Ok(resp) = local.lease_time_to_live(lease, None).await {
                let remaining = resp.ttl().max(0);
                ttl = Some(ttl.map_or(remaining, |t: i64| t.min(remaining)));
            }
        }
        out.push(InboundOrigin {
            origin,
            keys: count.count(),
            lease_ttl_remaining: ttl,
            synced,
            checkpoint_revision: revision,
        });
    }
    Ok(out)
}

/// The origin's checkpoint revision and its first few lease ids: the header, and of a layout kept
/// in parts the first part only, whatever the header says of the others.
async fn first_leases(local: &mut Client, origin: &str) -> anyhow::Result<(Option<i64>, Vec<i64>)> {
    let header = local.get(keys::checkpoint_key(origin), None).await?;
    let Some(header) =
        header.kvs().first().and_then(|kv| crate::mirror::records::checkpoint::Checkpoint::decode(kv.value()))
    else {
        return Ok((None, Vec::new()));
    };
    let first_part = match header.parts {
        None => None,
        Some(parts) => {
            let key = crate::mirror::records::checkpoint::part_key(origin, parts.id, 0);
            local.get(key, None).await?.kvs().first().map(|kv| kv.value().to_vec())
        }
    };
    let leases = crate::mirror::records::checkpoint::first_leases(&header, first_part.as_deref());
    Ok((Some(header.revision), leases))
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
