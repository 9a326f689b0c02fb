//! A peer's client certificate rotated in place, as a person rotates it on day two: a new
//! certificate for the same user, signed by the peer's CA, written into the Secret the region's
//! RegionPeering names for that peer. The leader notices at its next reconcile (it fingerprints each
//! connection's Secret), restarts that peer's mirror worker over a new connection, and the new
//! worker adopts the leases: no Pod restarts, the leader stays, and writes keep reaching the peer.
//! On kind only: the local federation's etcds take no certificates.
use crate::NAMESPACE;
use crate::scenarios::handoff::event_count;
use crate::substrate::{KIND_OPERATOR_PODS, KIND_RELEASE, KindFederation, Substrate, peering, wait_copy_whole};
use aether_operator::keys;
use etcd_client::GetOptions;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, ListParams, LogParams, Patch, PatchParams};
use std::time::{Duration, Instant};

/// The bounds a rotation is held to.
#[derive(Clone, Debug)]
pub struct RotationBounds {
    /// The operator's `--refresh-seconds`: how often it reads the Secrets.
    pub refresh: Duration,
    /// Added to `refresh`: by when the worker must have restarted.
    pub margin: Duration,
    /// Give up on the new worker after this long.
    pub timeout: Duration,
    /// How long a key put after the rotation may take to reach the peer.
    pub propagation: Duration,
}

/// What a rotation took.
#[derive(Debug)]
pub struct Rotation {
    pub leader: String,
    /// From the Secret written to the leader logging the worker's stop and start.
    pub restarted: Duration,
    /// From the Secret written to the new worker adopting the leases (or starting a full sync).
    pub taken_up: Duration,
    /// Whether the new worker ran a full sync rather than adopting the leases.
    pub resynced: bool,
    /// From a put into the origin after the rotation to the peer's copy equal to the origin's.
    pub put_to_visible: Duration,
}

/// The Secret of `origin`'s connection to `peer`, as hack/kind/e2e.sh names it.
fn peer_secret(peer: &str) -> String {
    format!("registry-etcd-peer-{peer}")
}

/// `origin`'s operator Pods, each "name restarts", sorted; Pods on their way out left aside.
async fn operator_pods(pods: &Api<Pod>) -> anyhow::Result<Vec<String>> {
    let mut lines: Vec<String> = pods
        .list(&ListParams::default().labels(KIND_OPERATOR_PODS))
        .await?
        .items
        .into_iter()
        .filter(|pod| pod.metadata.deletion_timestamp.is_none())
        .map(|pod| {
            let restarts: i32 =
                pod.status.and_then(|s| s.container_statuses).into_iter().flatten().map(|c| c.restart_count).sum();
            format!("{} {restarts}", pod.metadata.name.unwrap_or_default())
        })
        .collect();
    lines.sort();
    Ok(lines)
}

/// How often `leader` logged `message` for `peer` (the operator logs one JSON object a line).
async fn logged(pods: &Api<Pod>, leader: &str, message: &str, peer: &str) -> anyhow::Result<usize> {
    let log = pods.logs(leader, &LogParams { container: Some("operator".into()), ..LogParams::default() }).await?;
    let (message, peer) = (format!(r#""message":"{message}""#), format!(r#""peer":"{peer}""#));
    Ok(log.lines().filter(|line| line.contains(&message) && line.contains(&peer)).count())
}

/// Replaces the client certificate of `origin`'s connection to `peer` with a new one for the same
/// user and checks that the operator takes it up as the module says.
pub async fn rotate_peer_certificate(
    kind: &KindFederation,
    origin: &str,
    peer: &str,
    bounds: &RotationBounds,
) -> anyhow::Result<Rotation> {
    let user = format!("mirror-{origin}");
    let (cert, key) = kind.client_certificate(peer, &user)?;
    // The new certificate reads the origin's copy on the peer as the mirror's user.
    let mut as_user = kind.registry_as(peer, cert.as_bytes(), key.as_bytes()).await?;
    let options = GetOptions::new().with_prefix().with_keys_only().with_limit(1);
    as_user
        .get(keys::region_prefix(origin), Some(options))
        .await
        .map_err(|e| anyhow::anyhow!("the new certificate for {user} does not read {origin}'s copy on {peer}: {e}"))?;

    let kube = kind.kube(origin).await?;
    let secrets: Api<Secret> = Api::namespaced(kube.clone(), NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(kube.clone(), NAMESPACE);
    let deployments: Api<Deployment> = Api::namespaced(kube.clone(), NAMESPACE);
    let leases: Api<Lease> = Api::namespaced(kube.clone(), NAMESPACE);
    let secret = peer_secret(peer);
    let old = secrets.get(&secret).await?.data.unwrap_or_default().remove("tls.crt").map(|c| c.0);
    anyhow::ensure!(old.as_deref() != Some(cert.as_bytes()), "{secret} already holds the new certificate");

    let deployments = &deployments;
    aether_harness::wait_until(&format!("{origin}'s operator rolled out"), bounds.timeout, || async move {
        let status = deployments.get(KIND_RELEASE).await?.status.unwrap_or_default();
        Ok(status.replicas.is_some()
            && status.replicas == status.ready_replicas
            && status.replicas == status.updated_replicas)
    })
    .await?;
    let holder = || async {
        let lease = leases.get("aether-operator-leader").await?;
        anyhow::Ok(lease.spec.and_then(|s| s.holder_identity).filter(|h| !h.is_empty()))
    };
    let leader = holder().await?.ok_or_else(|| anyhow::anyhow!("nobody holds {origin}'s leader Lease"))?;
    let pods_before = operator_pods(&pods).await?;
    let stopped_before = logged(&pods, &leader, "mirror worker stopped", peer).await?;
    let started_before = logged(&pods, &leader, "mirror worker started", peer).await?;
    let adopted_before = event_count(&kube, origin, "LeasesAdopted").await?;
    let resyncs_before = event_count(&kube, origin, "ResyncStarted").await?;
    println!(
        "rotation: {secret} in {origin}: a new certificate for {user} from {peer}'s CA; leader {leader}; pods {pods_before:?}"
    );

    let written = Instant::now();
    let patch = serde_json::json!({"stringData": {"tls.crt": cert, "tls.key": key}});
    secrets.patch(&secret, &PatchParams::default(), &Patch::Merge(&patch)).await?;
    let mut restarted = None;
    let (taken_up, resynced) = loop {
        if restarted.is_none()
            && logged(&pods, &leader, "mirror worker stopped", peer).await? > stopped_before
            && logged(&pods, &leader, "mirror worker started", peer).await? > started_before
        {
            restarted = Some(written.elapsed());
            println!(
                "rotation: {leader} restarted the worker for {peer} {:.1} s after the Secret changed",
                written.elapsed().as_secs_f64()
            );
        }
        if restarted.is_some() {
            if event_count(&kube, origin, "LeasesAdopted").await? > adopted_before {
                break (written.elapsed(), false);
            }
            if event_count(&kube, origin, "ResyncStarted").await? > resyncs_before {
                break (written.elapsed(), true);
            }
        }
        anyhow::ensure!(
            written.elapsed() < bounds.timeout,
            "{:.0} s after {secret} changed: the worker for {peer} {}",
            bounds.timeout.as_secs_f64(),
            if restarted.is_some() {
                "restarted, and neither adopted the leases nor started a sync"
            } else {
                "not restarted (the leader's log)"
            }
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let restarted = restarted.expect("set before the loop ends");
    anyhow::ensure!(
        restarted <= bounds.refresh + bounds.margin,
        "the worker restarted {:.1} s after the Secret changed: more than --refresh-seconds ({} s) + {} s",
        restarted.as_secs_f64(),
        bounds.refresh.as_secs(),
        bounds.margin.as_secs()
    );
    // No restart: the same Pods with the same restart counts, the same leader.
    let pods_after = operator_pods(&pods).await?;
    anyhow::ensure!(
        pods_after == pods_before,
        "the operator's Pods changed across the rotation: {pods_before:?} -> {pods_after:?}"
    );
    let now = holder().await?;
    anyhow::ensure!(
        now.as_deref() == Some(leader.as_str()),
        "the leader changed across the rotation: {leader} -> {now:?}"
    );

    // Writes still reach the peer, over the new connection.
    let mut client = kind.registry(origin).await?;
    let put = Instant::now();
    client
        .put(
            format!(
                "{}clusters/kind-{origin}/services/rotation/protocols/http/endpoints/10.98.0.1",
                keys::region_prefix(origin)
            ),
            format!(r#"{{"clusterName":"kind-{origin}","rotated":true}}"#),
            None,
        )
        .await?;
    wait_copy_whole(kind, origin, peer, bounds.propagation).await?;
    let put_to_visible = put.elapsed();
    aether_harness::wait_until(
        &format!("regionpeering/{origin} Ready with {peer} Watching"),
        Duration::from_secs(60),
        || async move {
            let status = peering(kind, origin).await?.status.unwrap_or_default();
            let ready = status.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True");
            Ok(ready && status.peers.iter().any(|p| p.region == peer && p.phase == "Watching"))
        },
    )
    .await?;
    Ok(Rotation { leader, restarted, taken_up, resynced, put_to_visible })
}
