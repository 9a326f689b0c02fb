//! Scenario steps written once, run on every substrate: the local processes (`make e2e`,
//! e2e/tests/e2e.rs) and the kind clusters (`make e2e-kind`, e2e/tests/kind.rs, which
//! hack/kind/e2e.sh runs by name).
pub mod handoff;
pub mod join;
pub mod metrics;
pub mod plugin;
pub mod rotation;
pub mod uninstall;
pub mod upgrade;

use crate::substrate::{Faults, Substrate, subtree, wait_copy_whole};
use aether_operator::keys;
use etcd_client::GetOptions;
use std::time::{Duration, Instant};

/// What the data path took.
#[derive(Debug)]
pub struct DataPath {
    /// From the first put to every key visible on the peer.
    pub first_put_to_visible: Duration,
    /// From the last put to every key visible on the peer.
    pub last_put_to_visible: Duration,
    /// From the last delete to every deleted key gone from the peer.
    pub last_delete_to_gone: Duration,
}

/// The key of endpoint `i` of `cluster` in `origin`'s subtree (the v1 layout).
fn data_path_key(origin: &str, cluster: &str, i: usize) -> String {
    format!(
        "{}clusters/{cluster}/services/echo/protocols/http/endpoints/10.99.{}.{}",
        keys::region_prefix(origin),
        i / 250,
        i % 250 + 1
    )
}

/// `n` endpoints of `cluster` put into `origin` appear on `peer` verbatim (the peer's copy of the
/// subtree equal to the origin's, keys and values); `deletes` of them deleted in the origin
/// disappear from it; the other `n - deletes` stay. Each wait polls until `deadline`.
pub async fn data_path(
    sub: &impl Substrate,
    origin: &str,
    peer: &str,
    cluster: &str,
    n: usize,
    deletes: usize,
    deadline: Duration,
) -> anyhow::Result<DataPath> {
    anyhow::ensure!(deletes < n, "{deletes} deletes of {n} keys");
    let mut client = sub.registry(origin).await?;
    let prefix = format!("{}clusters/{cluster}/", keys::region_prefix(origin));
    // A clean start: a rerun on kept clusters finds the last run's keys.
    client.delete(prefix.as_str(), Some(etcd_client::DeleteOptions::new().with_prefix())).await?;
    let start = Instant::now();
    for i in 0..n {
        let value = format!(r#"{{"clusterName":"{cluster}","region":"{origin}","port":8080,"i":{i}}}"#);
        client.put(data_path_key(origin, cluster, i), value, None).await?;
    }
    let last_put = Instant::now();
    let held = client.get(prefix.as_str(), Some(GetOptions::new().with_prefix().with_count_only())).await?.count();
    anyhow::ensure!(held == n as i64, "{origin} holds {held} of the {n} keys just put");
    wait_copy_whole(sub, origin, peer, deadline).await?;
    let (first_put_to_visible, last_put_to_visible) = (start.elapsed(), last_put.elapsed());
    for i in 0..deletes {
        client.delete(data_path_key(origin, cluster, i * n / deletes), None).await?;
    }
    let last_delete = Instant::now();
    wait_copy_whole(sub, origin, peer, deadline).await?;
    Ok(DataPath { first_put_to_visible, last_put_to_visible, last_delete_to_gone: last_delete.elapsed() })
}

/// The bounds a region's loss is held to, beyond what its RegionPeerings say.
#[derive(Clone, Debug)]
pub struct LossBounds {
    /// Added to the lease TTL and the keepalive interval: the copy lapses within their sum of the
    /// operators being gone.
    pub lapse_margin: Duration,
    /// The peer's status refresh (`--refresh-seconds`).
    pub refresh: Duration,
    /// Added to the acceptable pause and a refresh: the peer reports the region unreachable within
    /// their sum of its etcd being gone.
    pub status_margin: Duration,
}

/// What a region's loss took on one peer.
#[derive(Debug)]
pub struct RegionLoss {
    /// From the lost region's operators gone to its copy gone from the peer.
    pub lapsed: Duration,
    /// Its bound: the lease TTL + the keepalive interval + the margin.
    pub lapse_bound: Duration,
    /// From the lost region's etcd gone to the peer reporting it unreachable.
    pub unreachable: Duration,
    /// Its bound: the peer's acceptable pause + a refresh + the margin.
    pub unreachable_bound: Duration,
    /// From the copy gone to the peer's status counting 0 keys of the region.
    pub inbound_zero: Duration,
    /// The keys of its own subtree the lost region held: its etcd comes back with them.
    pub own_keys: usize,
}

/// What the peer's RegionPeering says of `lost`: (PeersReachable False and the peer unreachable,
/// the inbound keys counted), and one line for a person.
async fn peer_view_of(sub: &impl Substrate, peer: &str, lost: &str) -> anyhow::Result<(bool, Option<i64>, String)> {
    let status = crate::substrate::peering(sub, peer).await?.status.unwrap_or_default();
    let reachable_condition = status.conditions.iter().find(|c| c.type_ == "PeersReachable");
    let of_lost = status.peers.iter().find(|p| p.region == lost);
    let inbound = status.inbound.iter().find(|i| i.region == lost).map(|i| i.keys);
    let unreachable = reachable_condition.is_some_and(|c| c.status == "False") && of_lost.is_some_and(|p| !p.reachable);
    let line = format!(
        "PeersReachable={} ({}); peers[{lost}]: phase {}, reachable {}; inbound[{lost}].keys {inbound:?}",
        reachable_condition.map_or("none", |c| c.status.as_str()),
        reachable_condition.map_or("", |c| c.message.as_str()),
        of_lost.map_or("none", |p| p.phase.as_str()),
        of_lost.is_some_and(|p| p.reachable),
    );
    Ok((unreachable, inbound, line))
}

/// `lost` goes away: its operators, then its registry etcd. Its copy on `peer` lapses within the
/// lease TTL + keepalive interval (+ margin) of the operators being gone (the operator revokes
/// nothing when it stops: a lapse comes from the leases alone, at the latest a TTL after the last
/// renewal); `peer` reports it unreachable within its acceptable pause + a refresh (+ margin) of
/// its etcd being gone, and counts 0 of its keys within a refresh (+ margin) of the lapse.
pub async fn region_loss(
    sub: &mut impl Faults,
    lost: &str,
    peer: &str,
    bounds: &LossBounds,
) -> anyhow::Result<RegionLoss> {
    let spec = crate::substrate::peering(sub, lost).await?.spec;
    let (ttl, keepalive) = (spec.lease.ttl_seconds as u64, spec.lease.keepalive_interval_seconds as u64);
    let peer_spec = crate::substrate::peering(sub, peer).await?.spec;
    let pause = peer_spec.failure_detector.effective_pause_seconds(&peer_spec.lease) as u64;
    let lapse_bound = Duration::from_secs(ttl + keepalive) + bounds.lapse_margin;
    let unreachable_bound = Duration::from_secs(pause) + bounds.refresh + bounds.status_margin;
    let held = subtree(sub, peer, lost).await?.len();
    anyhow::ensure!(held > 0, "{peer} holds no key of {lost} before {lost}'s loss");
    let own_keys = subtree(sub, lost, lost).await?.len();

    sub.lose_operators(lost).await?;
    let operators_gone = Instant::now();
    sub.lose_registry(lost).await?;
    let etcd_gone = Instant::now();

    let give_up = operators_gone + lapse_bound.max(unreachable_bound) + Duration::from_secs(20);
    let (mut lapsed, mut unreachable, mut inbound_zero, mut last) = (None, None, None, String::new());
    while lapsed.is_none() || unreachable.is_none() || inbound_zero.is_none() {
        anyhow::ensure!(
            Instant::now() < give_up,
            "{lost}'s loss not seen whole on {peer} within {:.0} s of its operators going: the copy lapsed after {lapsed:?}, \
             {lost} reported unreachable after {unreachable:?}, 0 inbound keys after {inbound_zero:?}; {peer} says: {last}",
            (give_up - operators_gone).as_secs_f64()
        );
        let now = Instant::now();
        if lapsed.is_none() && subtree(sub, peer, lost).await.is_ok_and(|copy| copy.is_empty()) {
            lapsed = Some(now);
        }
        if let Ok((gone, inbound, line)) = peer_view_of(sub, peer, lost).await {
            if unreachable.is_none() && gone {
                unreachable = Some(now);
            }
            if inbound_zero.is_none() && inbound == Some(0) {
                inbound_zero = Some(now);
            }
            last = line;
        }
        tokio::time::sleep(Duration::from_millis(250)).await; // the poll's pace
    }
    let (lapsed, unreachable, inbound_zero) = (lapsed.unwrap(), unreachable.unwrap(), inbound_zero.unwrap());
    let took = RegionLoss {
        lapsed: lapsed - operators_gone,
        lapse_bound,
        unreachable: unreachable.saturating_duration_since(etcd_gone),
        unreachable_bound,
        inbound_zero: inbound_zero.saturating_duration_since(lapsed),
        own_keys,
    };
    anyhow::ensure!(
        took.lapsed <= lapse_bound,
        "{lost}'s copy on {peer} lapsed {:.1} s after its operators were gone: over TTL {ttl} s + keepalive {keepalive} s + \
         margin = {:.0} s",
        took.lapsed.as_secs_f64(),
        lapse_bound.as_secs_f64()
    );
    anyhow::ensure!(
        took.unreachable <= unreachable_bound,
        "{peer} reported {lost} unreachable {:.1} s after its etcd was gone: over the pause {pause} s + a refresh + margin \
         = {:.0} s",
        took.unreachable.as_secs_f64(),
        unreachable_bound.as_secs_f64()
    );
    anyhow::ensure!(
        took.inbound_zero <= bounds.refresh + bounds.status_margin,
        "{peer}'s status counted 0 keys of {lost} {:.1} s after the copy was gone: more than a refresh + margin late",
        took.inbound_zero.as_secs_f64()
    );
    Ok(took)
}

/// `lost` comes back: its etcd with the `own_keys` it held (`RegionLoss::own_keys`), then one
/// operator. Its copy on every peer is its subtree again, every RegionPeering Ready, every peer
/// reaches it again, and every peer's copy in it is whole. Each wait polls until `deadline`.
pub async fn region_recovery(
    sub: &mut impl Faults,
    lost: &str,
    own_keys: usize,
    peers: &[&str],
    deadline: Duration,
) -> anyhow::Result<()> {
    sub.restore_registry(lost).await?;
    let back = subtree(sub, lost, lost).await?.len();
    anyhow::ensure!(
        back == own_keys,
        "{lost}'s etcd came back with {back} keys of its own, not the {own_keys} it held"
    );
    sub.restore_operator(lost).await?;
    for peer in peers {
        wait_copy_whole(sub, lost, peer, deadline).await?;
        wait_copy_whole(sub, peer, lost, deadline).await?;
    }
    let sub = &*sub;
    for region in std::iter::once(&lost).chain(peers) {
        aether_harness::wait_until(&format!("{region} Ready, every peer reachable"), deadline, || async move {
            let status = crate::substrate::peering(sub, region).await?.status.unwrap_or_default();
            let is = |type_: &str| status.conditions.iter().any(|c| c.type_ == type_ && c.status == "True");
            Ok(is("Ready") && is("PeersReachable") && status.leader.is_some())
        })
        .await?;
    }
    Ok(())
}
