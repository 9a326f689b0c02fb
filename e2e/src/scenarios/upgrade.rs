//! A Helm roll of the operator under writes, as users upgrade and roll back: `helm upgrade` to a new
//! image (or `helm rollback` to the revision before) while a writer puts 100 keys a second into the
//! region and the peer's copy is read throughout. No key the region held before the roll is ever
//! missing on the peer (from the roll's start until a lease TTL and a keepalive interval and 5 s
//! after the last old Pod went), every Pod ends on the wanted image unrestarted, the RegionPeering
//! is Ready under a leader on it, no full sync runs (the new leader adopts the leases), no put
//! fails, and with the writer stopped the copy is whole. On kind only: Helm is the thing under test.
use crate::NAMESPACE;
use crate::load::{Tally, Writer, first_key_missing};
use crate::scenarios::handoff::event_count;
use crate::substrate::{
    KIND_OPERATOR_PODS, KIND_RELEASE, KindFederation, Substrate, peering, subtree, wait_copy_whole,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// The load and the bounds of a roll.
#[derive(Clone, Debug)]
pub struct RollBounds {
    /// The writer: keys a second, puts to a transaction, distinct keys.
    pub rate: u32,
    pub batch: u32,
    pub pool: u32,
    /// Give up on the roll (and on the copy settling before it) after this long.
    pub timeout: Duration,
}

/// Full syncs allowed while the writer's first keys settle, before a roll: the pool's keys grow a
/// small subtree a few doublings, and each may lay the leases out anew once.
const SETTLE_RESYNCS_MAX: i64 = 8;

/// What a roll took.
#[derive(Debug)]
pub struct Roll {
    /// From helm's start to the Deployment rolled out.
    pub rolled: Duration,
    /// From helm's start to the RegionPeering Ready under a leader on the wanted image.
    pub ready: Duration,
    /// Every holder of the leader Lease seen during the roll.
    pub leaders: Vec<String>,
    /// The keys of the region the peer held before, present in each read.
    pub keys: usize,
    /// peers[peer].replication.resyncs before and after; LeasesAdopted events before and after.
    pub resyncs: (i64, i64),
    pub adopted: (i64, i64),
    pub writer: Tally,
    /// From the writer stopped to the copy whole.
    pub settled_after: Duration,
}

/// `helm ARGS` against `region`: its output, or why it failed.
async fn helm(kind: &KindFederation, region: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = kind.tool("helm", region)?.args(args).output().await?;
    anyhow::ensure!(
        out.status.success(),
        "helm {}: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// The release's current revision in `region`.
pub async fn revision(kind: &KindFederation, region: &str) -> anyhow::Result<i64> {
    let status: serde_json::Value =
        serde_json::from_str(&helm(kind, region, &["status", KIND_RELEASE, "-o", "json"]).await?)?;
    status["version"].as_i64().ok_or_else(|| anyhow::anyhow!("helm status {KIND_RELEASE}: no version"))
}

/// The operator's image in the release's Deployment now.
pub async fn deployed_image(kind: &KindFederation, region: &str) -> anyhow::Result<String> {
    let deployments: Api<Deployment> = Api::namespaced(kind.kube(region).await?, NAMESPACE);
    deployments
        .get(KIND_RELEASE)
        .await?
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|s| s.containers.into_iter().find(|c| c.name == "operator"))
        .and_then(|c| c.image)
        .ok_or_else(|| anyhow::anyhow!("deployment/{KIND_RELEASE} in {region}: no operator image"))
}

/// The Deployment at the chart's replica count (the region loss leaves it at one), rolled out.
pub async fn restore_replicas(kind: &KindFederation, region: &str, timeout: Duration) -> anyhow::Result<i32> {
    let values: serde_json::Value =
        serde_json::from_str(&helm(kind, region, &["get", "values", KIND_RELEASE, "--all", "-o", "json"]).await?)?;
    let replicas = values["replicaCount"].as_i64().and_then(|r| i32::try_from(r).ok()).unwrap_or(1);
    let deployments: Api<Deployment> = Api::namespaced(kind.kube(region).await?, NAMESPACE);
    let patch = serde_json::json!({"spec": {"replicas": replicas}});
    deployments.patch_scale(KIND_RELEASE, &Default::default(), &kube::api::Patch::Merge(&patch)).await?;
    let deployments = &deployments;
    aether_harness::wait_until(&format!("{replicas} operator replicas Ready in {region}"), timeout, || async move {
        Ok(rolled_out(&deployments.get(KIND_RELEASE).await?))
    })
    .await?;
    Ok(replicas)
}

/// Whether the Deployment's controller has seen its spec and every replica is updated and ready.
fn rolled_out(deployment: &Deployment) -> bool {
    let want = deployment.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    let Some(status) = deployment.status.as_ref() else { return false };
    status.observed_generation >= deployment.metadata.generation
        && status.replicas == Some(want)
        && status.updated_replicas == Some(want)
        && status.ready_replicas == Some(want)
        && status.available_replicas == Some(want)
}

/// The operator Pods: name to (image, restarts, going away).
async fn operator_pods(pods: &Api<Pod>) -> anyhow::Result<BTreeMap<String, (String, i32, bool)>> {
    Ok(pods
        .list(&ListParams::default().labels(KIND_OPERATOR_PODS))
        .await?
        .items
        .into_iter()
        .map(|pod| {
            let image =
                pod.spec.as_ref().and_then(|s| s.containers.first()).and_then(|c| c.image.clone()).unwrap_or_default();
            let restarts = pod
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .map_or(0, |c| c.iter().map(|c| c.restart_count).sum());
            (pod.metadata.name.unwrap_or_default(), (image, restarts, pod.metadata.deletion_timestamp.is_some()))
        })
        .collect())
}

/// Runs `helm helm_args` on `origin`'s release under load, as the module says, wanting every
/// operator Pod on `want` after it; `peer` holds `origin`'s copy.
pub async fn roll_under_load(
    kind: &KindFederation,
    origin: &str,
    peer: &str,
    label: &str,
    want: &str,
    helm_args: &[String],
    bounds: &RollBounds,
) -> anyhow::Result<Roll> {
    let kube = kind.kube(origin).await?;
    let pods: Api<Pod> = Api::namespaced(kube.clone(), NAMESPACE);
    let deployments: Api<Deployment> = Api::namespaced(kube.clone(), NAMESPACE);
    let leases: Api<Lease> = Api::namespaced(kube.clone(), NAMESPACE);
    let writer = Writer::start(kind.clone(), origin, "kind-load", bounds.rate, bounds.batch, bounds.pool);

    // Settled: the peer's copy equal to the origin's, Ready, and no new full sync for 10 s (the
    // writer's first pass creates keys, which may lay the leases out anew before the baseline).
    let settle = Instant::now();
    let resyncs_at_start = event_count(&kube, origin, "ResyncStarted").await?;
    let (mut stable_since, mut last_resyncs) = (Instant::now(), -1);
    loop {
        let resyncs = event_count(&kube, origin, "ResyncStarted").await?;
        if resyncs != last_resyncs {
            (stable_since, last_resyncs) = (Instant::now(), resyncs);
        }
        let own = subtree(kind, origin, origin).await?;
        let copy = subtree(kind, peer, origin).await?;
        let ready = peering(kind, origin)
            .await?
            .status
            .is_some_and(|s| s.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        let same = own.keys().eq(copy.keys());
        if same && ready && stable_since.elapsed() >= Duration::from_secs(10) {
            break;
        }
        anyhow::ensure!(
            settle.elapsed() < bounds.timeout,
            "{label}: with the writer running, {peer}'s key set of {origin} not equal to {origin}'s (equal: {same}), Ready {ready}, or a full sync within 10 s, for {} s",
            bounds.timeout.as_secs()
        );
        anyhow::ensure!(writer.tally().failed == 0, "{label}: the writer failed: {}", writer.tally().last_error);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // The writer's new keys may lay the leases out anew a few times (a reshard per doubling);
    // dozens are a loop (a resync copying a snapshot older than the copy took it back, and the
    // watch's next batch asked for another: 93 in 33 s before the fix).
    let settle_resyncs = last_resyncs - resyncs_at_start;
    anyhow::ensure!(
        settle_resyncs <= SETTLE_RESYNCS_MAX,
        "{label}: {settle_resyncs} full syncs while the writer's first keys settled (at most {SETTLE_RESYNCS_MAX}): a resync loop"
    );
    println!(
        "{label}: settled under load after {:.0} s, {settle_resyncs} full syncs meanwhile",
        settle.elapsed().as_secs_f64()
    );

    let status = peering(kind, origin).await?;
    let resyncs_of = |rp: &aether_operator::api::RegionPeering| {
        rp.status.as_ref().and_then(|s| s.peers.iter().find(|p| p.region == peer)).map_or(-1, |p| p.replication.resyncs)
    };
    let resyncs_before = resyncs_of(&status);
    let resync_events_before = event_count(&kube, origin, "ResyncStarted").await?;
    let adopted_before = event_count(&kube, origin, "LeasesAdopted").await?;
    let before = subtree(kind, origin, origin).await?;
    let old_pods: BTreeSet<String> = operator_pods(&pods).await?.into_keys().collect();
    let lease = &status.spec.lease;
    let watch = Duration::from_secs((lease.ttl_seconds + lease.keepalive_interval_seconds + 5).max(0) as u64);
    println!(
        "{label}: {} keys of {origin}, all on {peer}; pods {old_pods:?}; resyncs {resyncs_before}; now helm {}",
        before.len(),
        helm_args.join(" ")
    );

    let keys = before.len();
    let mut reading = tokio::spawn(first_key_missing(kind.clone(), origin.to_string(), peer.to_string(), before));
    let start = Instant::now();
    let args: Vec<&str> = helm_args.iter().map(String::as_str).collect();
    let mut rolling = kind.tool("helm", origin)?;
    rolling.args(&args).kill_on_drop(true);
    let mut helm_run = rolling.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn()?;
    let (mut helm_done, mut rolled, mut old_gone, mut ready) = (false, None, None, None);
    let mut leaders: Vec<String> = Vec::new();
    let outcome = loop {
        if reading.is_finished() {
            break Err(anyhow::anyhow!("{label}: {}", (&mut reading).await?));
        }
        if !helm_done && let Some(status) = helm_run.try_wait()? {
            helm_done = true;
            if !status.success() {
                let out = helm_run.wait_with_output().await?;
                break Err(anyhow::anyhow!(
                    "{label}: helm {}: {status}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
            println!("{label}: helm returned after {:.1} s", start.elapsed().as_secs_f64());
        }
        let holder = leases
            .get("aether-operator-leader")
            .await
            .ok()
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity)
            .filter(|h| !h.is_empty());
        if let Some(holder) = &holder
            && !leaders.contains(holder)
        {
            println!("{label}: the leader Lease held by {holder} at {:.1} s", start.elapsed().as_secs_f64());
            leaders.push(holder.clone());
        }
        let now = operator_pods(&pods).await?;
        if helm_done && rolled.is_none() && rolled_out(&deployments.get(KIND_RELEASE).await?) {
            rolled = Some(start.elapsed());
        }
        if helm_done && old_gone.is_none() && !now.keys().any(|name| old_pods.contains(name)) {
            old_gone = Some(start.elapsed());
            println!("{label}: the old Pods gone after {:.1} s", start.elapsed().as_secs_f64());
        }
        if ready.is_none()
            && let Some(holder) = &holder
            && now.get(holder).is_some_and(|(image, _, _)| image == want)
        {
            let rp = peering(kind, origin).await?;
            let status = rp.status.unwrap_or_default();
            if status.leader.as_deref() == Some(holder.as_str())
                && status.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True")
            {
                ready = Some(start.elapsed());
                println!(
                    "{label}: regionpeering/{origin} Ready under {holder} ({want}) after {:.1} s",
                    start.elapsed().as_secs_f64()
                );
            }
        }
        if let (Some(rolled), Some(gone), Some(ready)) = (rolled, old_gone, ready)
            && start.elapsed() >= gone + watch
        {
            break Ok((rolled, ready));
        }
        if start.elapsed() > bounds.timeout {
            break Err(anyhow::anyhow!(
                "{label}: not done within {} s: helm returned {helm_done}, rolled out {}, old Pods gone {}, Ready under a leader on {want} {}; pods {now:?}",
                bounds.timeout.as_secs(),
                rolled.is_some(),
                old_gone.is_some(),
                ready.is_some()
            ));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    reading.abort();
    let (rolled, ready) = match outcome {
        Ok(times) => times,
        Err(e) => {
            writer.stop();
            return Err(e);
        }
    };

    // Every Pod on the wanted image, none restarted, none going away.
    let now = operator_pods(&pods).await?;
    anyhow::ensure!(
        !now.is_empty() && now.values().all(|(image, restarts, going)| image == want && *restarts == 0 && !going),
        "{label}: the operator's Pods are not all on {want}, unrestarted: {now:?}"
    );
    // No full sync: the same count, or 0 under a new leader that adopted the leases.
    let resyncs_after = resyncs_of(&peering(kind, origin).await?);
    let resync_events_after = event_count(&kube, origin, "ResyncStarted").await?;
    let adopted_after = event_count(&kube, origin, "LeasesAdopted").await?;
    anyhow::ensure!(
        resync_events_after == resync_events_before,
        "{label}: ResyncStarted events {resync_events_before} before, {resync_events_after} after: a full sync ran"
    );
    anyhow::ensure!(
        resyncs_after == resyncs_before || (resyncs_after == 0 && adopted_after > adopted_before),
        "{label}: peers[{peer}].replication.resyncs {resyncs_before} before, {resyncs_after} after (LeasesAdopted {adopted_before} -> {adopted_after})"
    );
    let tally = writer.stop();
    anyhow::ensure!(
        tally.failed == 0,
        "{label}: {} of the writer's transactions failed, the last: {}",
        tally.failed,
        tally.last_error
    );
    let stopped = Instant::now();
    wait_copy_whole(kind, origin, peer, bounds.timeout).await?;
    Ok(Roll {
        rolled,
        ready,
        leaders,
        keys,
        resyncs: (resyncs_before, resyncs_after),
        adopted: (adopted_before, adopted_after),
        writer: tally,
        settled_after: stopped.elapsed(),
    })
}
