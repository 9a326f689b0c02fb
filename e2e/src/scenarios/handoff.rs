//! A region's leader goes away while its standby runs, in one of the ways a leader goes
//! ([`LeaderLoss`]): the peer's copy of the region keeps every key in every read for at least a
//! lease TTL and a keepalive interval; a worker under the new leader (or the same identity,
//! restarted) runs the mirror, having adopted the leases rather than resynced; the leader Lease
//! changes hands the way the loss allows (a frozen leader's Lease is waited out, never taken
//! early).
use crate::NAMESPACE;
use crate::substrate::{Faults, LeaderLoss, Substrate, peering};
use aether_operator::keys;
use etcd_client::{EventType, GetOptions, WatchOptions};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, ListParams};
use std::collections::BTreeSet;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The bounds a handoff is held to.
#[derive(Clone, Debug)]
pub struct HandoffBounds {
    /// Added to the lease TTL and the keepalive interval: how long the peer's copy is read after the
    /// leader went, at the least.
    pub watch_margin: Duration,
    /// From the loss to Ready under a worker that adopted the leases, for every loss but a
    /// graceful one (a graceful one is bounded by `timeout` only).
    pub ready: Duration,
    /// Give up on a new leader Ready after this long.
    pub timeout: Duration,
}

/// What a handoff took. Every read of the peer's copy held every key, and no key of it was
/// deleted, from the loss until at least a lease TTL and a keepalive interval later.
#[derive(Debug)]
pub struct Handoff {
    pub old_leader: String,
    /// Who holds the leader Lease after it: the standby, or (a crash restarted in place) the same
    /// identity.
    pub new_leader: String,
    /// From the loss to the Lease held by another holder, or, for a leader restarted in place, to
    /// its new worker adopting the leases.
    pub takeover: Duration,
    /// From the loss to the region's RegionPeering Ready under the new leader.
    pub ready: Duration,
    /// How the Lease changed hands, for a person.
    pub lease: String,
    /// Reads of the peer's copy, each holding every key.
    pub reads: usize,
    pub keys: usize,
    /// peers[peer].replication.resyncs before and after.
    pub resyncs: (i64, i64),
    /// Keys of the region on the peer with another mod revision or lease after (0: adopted, nothing
    /// re-put).
    pub reput: usize,
}

/// The leader Lease as the API server holds it: holder, last renewal (ms since the epoch) and
/// duration (s).
struct LeaseView {
    holder: Option<String>,
    renewed_ms: Option<i64>,
    duration_s: Option<i64>,
}

async fn lease_view(leases: &Api<Lease>, name: &str) -> anyhow::Result<LeaseView> {
    let spec = leases.get(name).await?.spec.unwrap_or_default();
    Ok(LeaseView {
        holder: spec.holder_identity.filter(|h| !h.is_empty()),
        renewed_ms: spec.renew_time.map(|t| t.0.as_millisecond()),
        duration_s: spec.lease_duration_seconds.map(i64::from),
    })
}

/// Events of `region`'s RegionPeering with `reason`, repetitions counted (the recorder folds
/// them into a series).
pub(crate) async fn event_count(kube: &kube::Client, region: &str, reason: &str) -> anyhow::Result<i64> {
    let events: Api<Event> = Api::namespaced(kube.clone(), NAMESPACE);
    let selector = format!("involvedObject.kind=RegionPeering,involvedObject.name={region},reason={reason}");
    let listed = events.list(&ListParams::default().fields(&selector)).await?;
    Ok(listed
        .items
        .iter()
        .map(|e| {
            let series = e.series.as_ref().and_then(|s| s.count).unwrap_or(0);
            i64::from(series.max(e.count.unwrap_or(0)).max(1))
        })
        .sum())
}

/// The peer's copy of `origin`: each key with its mod revision and lease.
async fn copy_meta(peer: &mut etcd_client::Client, origin: &str) -> anyhow::Result<BTreeSet<(Vec<u8>, i64, i64)>> {
    let got = peer.get(keys::region_prefix(origin), Some(GetOptions::new().with_prefix())).await?;
    Ok(got.kvs().iter().map(|kv| (kv.key().to_vec(), kv.mod_revision(), kv.lease())).collect())
}

/// The peer etcd's revision as a read of the copy sees it.
async fn copy_revision(peer: &mut etcd_client::Client, origin: &str) -> anyhow::Result<i64> {
    let got = peer.get(keys::region_prefix(origin), Some(GetOptions::new().with_prefix().with_count_only())).await?;
    got.header().map(|h| h.revision()).ok_or_else(|| anyhow::anyhow!("a read of {origin}'s copy without a header"))
}

async fn copy_keys(peer: &mut etcd_client::Client, origin: &str) -> anyhow::Result<BTreeSet<Vec<u8>>> {
    let got = peer.get(keys::region_prefix(origin), Some(GetOptions::new().with_prefix().with_keys_only())).await?;
    Ok(got.kvs().iter().map(|kv| kv.key().to_vec()).collect())
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// What `region`'s RegionPeering says: its leader, Ready, and peers[peer].replication.resyncs.
async fn leader_view(sub: &impl Substrate, region: &str, peer: &str) -> anyhow::Result<(Option<String>, bool, i64)> {
    let status = peering(sub, region).await?.status.unwrap_or_default();
    let ready = status.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True");
    let resyncs = status.peers.iter().find(|p| p.region == peer).map_or(-1, |p| p.replication.resyncs);
    Ok((status.leader, ready, resyncs))
}

/// `region`'s leader goes away as `how` says while its standby runs; `peer` holds `region`'s copy.
pub async fn leader_handoff(
    sub: &mut impl Faults,
    region: &str,
    peer: &str,
    how: LeaderLoss,
    bounds: &HandoffBounds,
) -> anyhow::Result<Handoff> {
    let kube = sub.kube(region).await?;
    let leases: Api<Lease> = Api::namespaced(kube.clone(), NAMESPACE);
    let lease_name = sub.leader_lease();
    // The status names the leader the Lease names (the status may lag a moment behind an election).
    let leader = {
        let (leases, sub, lease_name) = (&leases, &*sub, lease_name.as_str());
        let seen = std::sync::Mutex::new(None);
        let what = format!("{region}'s leader Lease and its status naming the same leader");
        let seen_ref = &seen;
        aether_harness::wait_until(&what, Duration::from_secs(60), || async move {
            let holder = lease_view(leases, lease_name).await?.holder;
            let (status_leader, _, _) = leader_view(sub, region, peer).await?;
            let same = holder.is_some() && holder == status_leader;
            *seen_ref.lock().unwrap() = holder;
            Ok(same)
        })
        .await?;
        seen.into_inner().unwrap().expect("a holder, as waited for")
    };
    let spec = peering(sub, region).await?.spec;
    let (ttl, keepalive) = (spec.lease.ttl_seconds as u64, spec.lease.keepalive_interval_seconds as u64);
    let min_watch = Duration::from_secs(ttl + keepalive) + bounds.watch_margin;
    let (_, _, resyncs_before) = leader_view(sub, region, peer).await?;
    let resync_events_before = event_count(&kube, region, "ResyncStarted").await?;
    let adopted_before = event_count(&kube, region, "LeasesAdopted").await?;
    let mut peer_etcd = sub.registry(peer).await?;
    let meta_before = copy_meta(&mut peer_etcd, region).await?;
    let expected: BTreeSet<Vec<u8>> = meta_before.iter().map(|(k, _, _)| k.clone()).collect();
    anyhow::ensure!(!expected.is_empty(), "{peer} holds no key of {region} before the handoff");
    // The Lease as the leader last renewed it before the loss (a released Lease may never show the
    // old holder again).
    let before = lease_view(&leases, &lease_name).await?;
    let (mut last_renew, mut last_duration) = if before.holder.as_deref() == Some(leader.as_str()) {
        (before.renewed_ms, before.duration_s)
    } else {
        (None, None)
    };
    // Every change to the copy from here on, not only what the reads below happen to see: a key
    // that lapsed and was put again between two reads shows as its delete.
    let from = copy_revision(&mut peer_etcd, region).await? + 1;
    let mut changes = peer_etcd
        .watch(keys::region_prefix(region), Some(WatchOptions::new().with_prefix().with_start_revision(from)))
        .await?;

    let lost_at = Instant::now();
    sub.lose_leader(region, &leader, how).await?;
    let (mut reads, mut errors) = (0usize, 0usize);
    let (mut takeover, mut ready, mut new_leader, mut emptied_ms) = (None, None, None::<String>, None);
    let mut takeover_ms = 0;
    loop {
        match copy_keys(&mut peer_etcd, region).await {
            Ok(held) => {
                reads += 1;
                if held != expected {
                    let missing: Vec<String> =
                        expected.difference(&held).take(10).map(|k| String::from_utf8_lossy(k).into_owned()).collect();
                    let extra: Vec<String> =
                        held.difference(&expected).take(10).map(|k| String::from_utf8_lossy(k).into_owned()).collect();
                    anyhow::bail!(
                        "{:.1} s into the {how}, {peer}'s copy of {region} changed: missing {missing:?}, extra {extra:?}",
                        lost_at.elapsed().as_secs_f64()
                    );
                }
            }
            Err(e) => {
                errors += 1;
                anyhow::ensure!(errors <= 5, "reading {peer}'s etcd failed {errors} times during the {how}: {e}");
                peer_etcd = sub.registry(peer).await.unwrap_or(peer_etcd);
            }
        }
        if takeover.is_none()
            && let Ok(view) = lease_view(&leases, &lease_name).await
        {
            match view.holder.as_deref() {
                None => {
                    emptied_ms.get_or_insert(now_ms());
                }
                Some(holder) if holder == leader => {
                    (last_renew, last_duration) = (view.renewed_ms, view.duration_s);
                    // A crashed leader is restarted in place under its identity: it holds the
                    // Lease again once its new worker adopted the leases.
                    if how == LeaderLoss::Crashed
                        && event_count(&kube, region, "LeasesAdopted").await.is_ok_and(|n| n > adopted_before)
                    {
                        (takeover, takeover_ms, new_leader) = (Some(lost_at.elapsed()), now_ms(), Some(leader.clone()));
                    }
                }
                Some(holder) => {
                    (takeover, takeover_ms, new_leader) = (Some(lost_at.elapsed()), now_ms(), Some(holder.to_string()));
                }
            }
        }
        if let (Some(successor), None) = (&new_leader, ready) {
            let (status_leader, is_ready, _) = leader_view(sub, region, peer).await.unwrap_or((None, false, 0));
            // After a crash or a freeze the status may still say Ready under the old leader (nobody
            // wrote it since): a new worker runs the mirror once it adopted the leases.
            let adopted = match how {
                LeaderLoss::Crashed | LeaderLoss::Lost => {
                    event_count(&kube, region, "LeasesAdopted").await.is_ok_and(|n| n > adopted_before)
                }
                LeaderLoss::Graceful | LeaderLoss::Forced => true,
            };
            if adopted && is_ready && status_leader.as_deref() == Some(successor.as_str()) {
                ready = Some(lost_at.elapsed());
            }
        }
        if ready.is_some() && lost_at.elapsed() >= min_watch {
            break;
        }
        anyhow::ensure!(
            lost_at.elapsed() < bounds.timeout,
            "{region}'s RegionPeering not Ready under a new leader within {:.0} s of the {how} of {leader}; \
             the Lease is held by {new_leader:?}",
            bounds.timeout.as_secs_f64()
        );
        tokio::time::sleep(Duration::from_millis(300)).await; // the poll's pace
    }
    let (takeover, ready, new_leader) = (takeover.unwrap(), ready.unwrap(), new_leader.unwrap());

    // Released or waited out? A standby takes a Lease before it expires only once its holder
    // released it (on SIGTERM). A release is also seen as an empty holder before the expiry; an
    // empty holder after it is a standby clearing the expired Lease before it locks it.
    let expiry_ms = last_renew.zip(last_duration).map(|(renewed, duration)| renewed + duration * 1000);
    let before_expiry =
        |at: i64, expiry: i64| format!("{:.1} s before it would have expired", (expiry - at) as f64 / 1e3);
    let lease = match expiry_ms {
        _ if new_leader == leader => {
            format!("kept by {leader}: restarted in place, it holds it under the same identity (never released)")
        }
        Some(expiry) if takeover_ms < expiry => {
            format!("released by {leader}: {new_leader} held it {}", before_expiry(takeover_ms, expiry))
        }
        Some(expiry) if emptied_ms.is_some_and(|e| e < expiry) => {
            format!("released by {leader}: seen empty {}", before_expiry(emptied_ms.unwrap_or(expiry), expiry))
        }
        Some(expiry) => {
            format!("waited out: {new_leader} took it {:.1} s after it expired", (takeover_ms - expiry) as f64 / 1e3)
        }
        None if emptied_ms.is_some() => format!("released by {leader} (seen empty; its last renewal not seen)"),
        None => format!("never seen released by {leader}; its last renewal not seen"),
    };
    if how == LeaderLoss::Lost {
        // A frozen leader says nothing more: a Lease released before it expired means the freeze
        // did not hold; one taken before it expired would be two leaders at once.
        let expiry =
            expiry_ms.ok_or_else(|| anyhow::anyhow!("the lost leader {leader}'s last renewal was never seen"))?;
        if let Some(emptied) = emptied_ms {
            anyhow::ensure!(
                emptied >= expiry,
                "the lost leader {leader}'s Lease was released before it expired: {lease}"
            );
        }
        anyhow::ensure!(
            takeover_ms >= expiry,
            "{new_leader} took the lost leader {leader}'s Lease {:.1} s before it expired",
            (expiry - takeover_ms) as f64 / 1e3
        );
    }
    if how != LeaderLoss::Graceful {
        anyhow::ensure!(
            ready <= bounds.ready,
            "{region} Ready under {new_leader} {:.1} s after the {how} of {leader}: over the bound of {:.0} s",
            ready.as_secs_f64(),
            bounds.ready.as_secs_f64()
        );
    }
    let (_, _, resyncs_after) = leader_view(sub, region, peer).await?;
    let resync_events_after = event_count(&kube, region, "ResyncStarted").await?;
    let adopted_after = event_count(&kube, region, "LeasesAdopted").await?;
    anyhow::ensure!(
        resync_events_after == resync_events_before,
        "ResyncStarted events of {region}: {resync_events_before} before the {how}, {resync_events_after} after: the new \
         leader ran a full sync"
    );
    // The field counts the full resyncs since the worker started: a new leader's starts at 0.
    anyhow::ensure!(
        resyncs_after == resyncs_before || (resyncs_after == 0 && adopted_after > adopted_before),
        "peers[{peer}].replication.resyncs of {region} was {resyncs_before} before the {how}, {resyncs_after} under \
         {new_leader} (LeasesAdopted events {adopted_before} -> {adopted_after})"
    );
    let mut deletes = 0;
    while let Ok(Ok(Some(response))) = tokio::time::timeout(Duration::from_millis(500), changes.message()).await {
        deletes += response.events().iter().filter(|e| e.event_type() == EventType::Delete).count();
    }
    anyhow::ensure!(deletes == 0, "{deletes} keys of {region} deleted on {peer} during the {how}");
    let meta_after = copy_meta(&mut peer_etcd, region).await?;
    Ok(Handoff {
        old_leader: leader,
        new_leader,
        takeover,
        ready,
        lease,
        reads,
        keys: expected.len(),
        resyncs: (resyncs_before, resyncs_after),
        reput: meta_after.difference(&meta_before).count(),
    })
}
