//! What the other regions mirror into the local etcd, observed read-only: per origin, its keys,
//! the remaining TTL of its leases, its sync canary and its checkpoint's revision.
//!
//! Its cost does not grow with the registry: an origin whose canary says its copy is complete
//! and whose progress record counts its keys (every watch batch writes it) is read as three small
//! records and one lease's TTL, the canary's. Only an origin without those (syncing, lapsed, or of
//! an earlier version) has its keys counted, a walk of the etcd's index over its subtree.
//!
//! Another region's mirror user may write anything under its own `/aether/v1/federation/<r>/`
//! here, so every read is bounded: origins are found one keys-only read each (at most
//! [`MAX_ORIGINS`], names that are not region names skipped, so they never reach a metric label),
//! and of each origin's records only the progress record, the canary, the checkpoint's header and,
//! without a canary, its first part (four lease ids) and their TTLs are read, whatever they say.
use crate::keys;
use crate::mirror::records::checkpoint::{Checkpoint, Progress};
use etcd_client::{Client, GetOptions, Txn, TxnOp, TxnOpResponse};
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
        out.push(observe_origin(local, &origin).await?);
    }
    Ok(out)
}

/// One origin's records here, read in one Txn: its progress record, its canary and its
/// checkpoint's header.
struct Records {
    progress: Option<Progress>,
    /// The canary's value and lease (0: none).
    canary: Option<(Vec<u8>, i64)>,
    checkpoint: Option<Checkpoint>,
}

async fn observe_origin(local: &mut Client, origin: &str) -> anyhow::Result<InboundOrigin> {
    let records = read_records(local, origin).await?;
    let synced = records.canary.as_ref().is_some_and(|(value, _)| canary_says_synced(value));
    let keys = match recorded_keys(synced, records.progress.as_ref()) {
        Some(keys) => keys,
        None => {
            let options = GetOptions::new().with_prefix().with_count_only();
            local.get(keys::region_prefix(origin), Some(options)).await?.count()
        }
    };
    // The canary is on the first shard's lease; without it, a few of the checkpoint's leases tell
    // the story (every shard shares the same keepalive).
    let leases = match &records.canary {
        Some((_, lease)) if *lease != 0 => vec![*lease],
        _ => match &records.checkpoint {
            Some(header) => first_leases(local, origin, header).await?,
            None => Vec::new(),
        },
    };
    let mut ttl: Option<i64> = None;
    for lease in leases.into_iter().take(4) {
        if let Ok(resp) = local.lease_time_to_live(lease, None).await {
            let remaining = resp.ttl().max(0);
            ttl = Some(ttl.map_or(remaining, |t: i64| t.min(remaining)));
        }
    }
    Ok(InboundOrigin {
        origin: origin.to_string(),
        keys,
        lease_ttl_remaining: ttl,
        synced,
        checkpoint_revision: records.checkpoint.map(|c| c.revision),
    })
}

/// The origin's keys here as its writer recorded them, when the record can be trusted without
/// counting (pure): the canary says the copy is complete (it is on the origin's lease, so it is
/// gone once the copy lapses, and a resync marks it before moving any key), and the progress
/// record counts the keys (every batch of this version writes the count with its revision).
pub fn recorded_keys(synced: bool, progress: Option<&Progress>) -> Option<i64> {
    if !synced {
        return None;
    }
    progress.and_then(|p| p.keys).filter(|keys| *keys >= 0)
}

async fn read_records(local: &mut Client, origin: &str) -> anyhow::Result<Records> {
    let txn = Txn::new().and_then([
        TxnOp::get(keys::progress_key(origin), None),
        TxnOp::get(keys::canary_key(origin), None),
        TxnOp::get(keys::checkpoint_key(origin), None),
    ]);
    let resp = crate::mirror::target::kv(local).txn(txn).await?;
    let mut values = resp.op_responses().into_iter().map(|op| match op {
        TxnOpResponse::Get(get) => get.kvs().first().map(|kv| (kv.value().to_vec(), kv.lease())),
        _ => None,
    });
    let (progress, canary, checkpoint) = (values.next().flatten(), values.next().flatten(), values.next().flatten());
    Ok(Records {
        progress: progress.and_then(|(value, _)| Progress::decode(&value)),
        canary,
        checkpoint: checkpoint.and_then(|(value, _)| Checkpoint::decode(&value)),
    })
}

/// The first few lease ids of the origin's checkpoint: the header's, and of a layout kept in
/// parts the first part's only, whatever the header says of the others.
async fn first_leases(local: &mut Client, origin: &str, header: &Checkpoint) -> anyhow::Result<Vec<i64>> {
    let first_part = match header.parts {
        None => None,
        Some(parts) => {
            let key = crate::mirror::records::checkpoint::part_key(origin, parts.id, 0);
            local.get(key, None).await?.kvs().first().map(|kv| kv.value().to_vec())
        }
    };
    Ok(crate::mirror::records::checkpoint::first_leases(header, first_part.as_deref()))
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
    fn the_recorded_count_is_read_only_of_a_complete_copy_whose_writer_counts() {
        let progress = |keys| Progress { owner: "a/1".into(), revision: 9, sent_through: 9, keys };
        assert_eq!(recorded_keys(true, Some(&progress(Some(300)))), Some(300));
        assert_eq!(recorded_keys(true, Some(&progress(Some(0)))), Some(0));
        assert_eq!(recorded_keys(false, Some(&progress(Some(300)))), None, "syncing, lapsed or resyncing: counted");
        assert_eq!(recorded_keys(true, Some(&progress(None))), None, "an earlier version's record: counted");
        assert_eq!(recorded_keys(true, Some(&progress(Some(-1)))), None, "a record that makes no sense: counted");
        assert_eq!(recorded_keys(true, None), None);
    }

    #[test]
    fn only_a_canary_that_says_synced_counts() {
        assert!(canary_says_synced(br#"{"synced":true,"revision":9,"syncedAt":"t"}"#));
        assert!(!canary_says_synced(br#"{"synced":false,"cause":"a lease was lost"}"#));
        assert!(!canary_says_synced(b"garbage"));
    }
}
