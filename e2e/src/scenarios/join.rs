//! A region joins a running federation: its cluster, its etcd and its operator come up, the chart
//! is installed in it with every existing region as a peer, and every existing region's release is
//! upgraded with it as one more peer. Meanwhile every existing copy is read throughout: none loses a
//! key. Afterwards every RegionPeering is Ready with all its peers, the new region's keys reach
//! every existing region and theirs reach it, and no existing mirror ran a full sync for it.
use crate::scenarios::data_path;
use crate::substrate::{Substrate, peering, subtree, wait_copy_whole};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// The bounds a join is held to.
#[derive(Clone, Debug)]
pub struct JoinBounds {
    /// From the join done to every RegionPeering Ready with all its peers.
    pub ready: Duration,
    /// How long keys may take to reach a peer.
    pub propagation: Duration,
    /// Keys the new region writes for the data path.
    pub keys: usize,
}

/// What a join took.
#[derive(Debug)]
pub struct Join {
    /// The join itself (provisioning, installs, upgrades).
    pub joined: Duration,
    /// From the join done to every RegionPeering Ready with all its peers.
    pub ready: Duration,
    /// Reads of the existing copies, each holding every key it held before.
    pub reads: usize,
    pub kept_keys: usize,
    /// From the new region's first put to its keys on every existing region.
    pub new_to_peers: Duration,
    /// Each existing mirror "origin -> peer" with its resyncs, unchanged.
    pub resyncs: BTreeMap<String, i64>,
}

/// Each existing mirror's resync count, by "origin -> peer".
async fn resyncs(sub: &impl Substrate, existing: &[&str]) -> anyhow::Result<BTreeMap<String, i64>> {
    let mut counts = BTreeMap::new();
    for origin in existing {
        let status = peering(sub, origin).await?.status.unwrap_or_default();
        for peer in existing.iter().filter(|p| *p != origin) {
            let n = status.peers.iter().find(|p| p.region == *peer).map_or(-1, |p| p.replication.resyncs);
            counts.insert(format!("{origin} -> {peer}"), n);
        }
    }
    Ok(counts)
}

/// Every existing copy's keys: (origin, peer) to the keys the peer holds of the origin.
async fn copies(
    sub: &impl Substrate,
    existing: &[&str],
) -> anyhow::Result<BTreeMap<(String, String), BTreeSet<Vec<u8>>>> {
    let mut all = BTreeMap::new();
    for origin in existing {
        for peer in existing.iter().filter(|p| *p != origin) {
            let keys = subtree(sub, peer, origin).await?.into_keys().collect();
            all.insert((origin.to_string(), peer.to_string()), keys);
        }
    }
    Ok(all)
}

/// Fails on the first key of `before` missing now; a read that fails is no verdict.
async fn check_copies(
    sub: &impl Substrate,
    existing: &[&str],
    before: &BTreeMap<(String, String), BTreeSet<Vec<u8>>>,
) -> anyhow::Result<bool> {
    let Ok(now) = copies(sub, existing).await else { return Ok(false) };
    for ((origin, peer), keys) in before {
        let held = &now[&(origin.clone(), peer.clone())];
        if let Some(missing) = keys.iter().find(|k| !held.contains(*k)) {
            anyhow::bail!(
                "a key of {origin} went missing on {peer} while the region joined: {}",
                String::from_utf8_lossy(missing)
            );
        }
    }
    Ok(true)
}

/// Whether every region's RegionPeering is Ready with `regions.len() - 1` peers.
async fn all_ready(sub: &impl Substrate, regions: &[&str]) -> bool {
    for region in regions {
        let Ok(rp) = peering(sub, region).await else { return false };
        let status = rp.status.unwrap_or_default();
        let ready = status.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True");
        if !ready || status.peers.len() != regions.len() - 1 {
            return false;
        }
    }
    true
}

/// `new` joins `existing` by `join` (which returns once it is provisioned and every release is
/// installed or upgraded), checked as the module says. `started` is called once the baseline is
/// read, before anything changes.
pub async fn region_joins(
    sub: &impl Substrate,
    new: &str,
    existing: &[&str],
    started: impl FnOnce(),
    join: impl Future<Output = anyhow::Result<()>>,
    bounds: &JoinBounds,
) -> anyhow::Result<Join> {
    let resyncs_before = resyncs(sub, existing).await?;
    let before = copies(sub, existing).await?;
    let kept_keys = before.values().map(BTreeSet::len).sum();
    started();
    let start = Instant::now();
    let mut reads = 0;
    tokio::pin!(join);
    loop {
        tokio::select! {
            done = &mut join => { done?; break; }
            read = check_copies(sub, existing, &before) => {
                reads += usize::from(read?);
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    }
    let joined = start.elapsed();
    let mut regions = existing.to_vec();
    regions.push(new);
    let ready_from = Instant::now();
    while !all_ready(sub, &regions).await {
        reads += usize::from(check_copies(sub, existing, &before).await?);
        anyhow::ensure!(
            ready_from.elapsed() < bounds.ready,
            "not every RegionPeering of {regions:?} Ready with {} peers within {} s of the join",
            regions.len() - 1,
            bounds.ready.as_secs()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let ready = ready_from.elapsed();
    // The new region's keys reach every existing region; theirs reach it.
    let cluster = format!("joining-{new}");
    let (first, rest) = existing.split_first().ok_or_else(|| anyhow::anyhow!("no existing region"))?;
    let writing = Instant::now();
    data_path(sub, new, first, &cluster, bounds.keys, 0, bounds.propagation).await?;
    for peer in rest {
        wait_copy_whole(sub, new, peer, bounds.propagation).await?;
    }
    let new_to_peers = writing.elapsed();
    for origin in existing {
        wait_copy_whole(sub, origin, new, bounds.propagation).await?;
    }
    // Adding a peer is no reason to re-sync the others.
    let resyncs_after = resyncs(sub, existing).await?;
    anyhow::ensure!(
        resyncs_after == resyncs_before,
        "{new} joining re-synced an existing mirror: resyncs {resyncs_before:?} before, {resyncs_after:?} after"
    );
    Ok(Join { joined, ready, reads, kept_keys, new_to_peers, resyncs: resyncs_after })
}
