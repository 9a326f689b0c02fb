//! Day two at the CRD defaults (TTL 30 s, keepalive 10 s), with the operator binary against a real
//! kube-apiserver: the changes and outages users live through never lapse a live region's copy.
//! These tests mostly wait (three TTLs each), so they run side by side with the soak tests
//! (`hack/test.sh`).
mod support;

use aether_harness::{EtcdServer, KubeApiserver, free_port, wait_until};
use aether_operator::api::RegionPeering;
use etcd_client::Client;
use kube::api::Api;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant};
use support::operator::*;
use support::*;

/// The CRD's defaults.
const TTL: Duration = Duration::from_secs(30);

/// A RegionPeering at the CRD defaults (no lease or detector settings).
fn at_the_defaults(name: &str, region: &str, local: &EtcdServer, peers: &[(&str, &EtcdServer)]) -> serde_json::Value {
    let mut rp = peering(name, region, local, peers);
    let spec = rp["spec"].as_object_mut().unwrap();
    spec.remove("lease");
    spec.remove("failureDetector");
    rp
}

/// Reads the count of `origin`'s keys on each peer every 250 ms until stopped, and keeps the
/// fewest seen: "no key missing at any read".
struct Reads {
    fewest: Vec<Arc<AtomicI64>>,
    reads: Arc<AtomicI64>,
    stop: Arc<AtomicBool>,
}

impl Reads {
    async fn start(peers: &[&EtcdServer], origin: &str) -> Reads {
        let stop = Arc::new(AtomicBool::new(false));
        let reads = Arc::new(AtomicI64::new(0));
        let mut fewest = Vec::new();
        for peer in peers {
            let least = Arc::new(AtomicI64::new(i64::MAX));
            fewest.push(least.clone());
            let (endpoint, origin, stop, reads) = (peer.endpoint(), origin.to_string(), stop.clone(), reads.clone());
            tokio::spawn(async move {
                let mut c = Client::connect([endpoint], None).await.unwrap();
                let options = etcd_client::GetOptions::new().with_prefix().with_count_only();
                while !stop.load(Ordering::SeqCst) {
                    if let Ok(r) = c.get(aether_operator::keys::region_prefix(&origin), Some(options.clone())).await {
                        least.fetch_min(r.count(), Ordering::SeqCst);
                        reads.fetch_add(1, Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            });
        }
        Reads { fewest, reads, stop }
    }

    fn finish(self) -> (Vec<i64>, i64) {
        self.stop.store(true, Ordering::SeqCst);
        (self.fewest.iter().map(|f| f.load(Ordering::SeqCst)).collect(), self.reads.load(Ordering::SeqCst))
    }
}

/// An API server (prepared: CRDs, namespace) and three registry etcds named `<tag>-<region>`,
/// started together; the directory the operators keep their files in.
async fn api_server_and_etcds(
    tag: &str,
    regions: [&str; 3],
) -> (KubeApiserver, [EtcdServer; 3], tempfile::TempDir, kube::Client) {
    let names = regions.map(|r| format!("{tag}-{r}"));
    let (apiserver, x, y, z) = tokio::try_join!(
        KubeApiserver::start(tag),
        EtcdServer::start(&names[0]),
        EtcdServer::start(&names[1]),
        EtcdServer::start(&names[2])
    )
    .unwrap();
    let client = prepare(&apiserver).await;
    (apiserver, [x, y, z], tempfile::tempdir().unwrap(), client)
}

/// Region a (5,000 keys) mirrors into b and c at the defaults; its control plane is paused for
/// three TTLs (the API server's etcd stopped: every API call hangs) while its registry etcd and
/// its operators are fine. No key of a may be missing on b or c at any read, nothing may resync,
/// and status catches up once the API returns.
async fn control_plane_paused_for_three_ttls(replicas: usize) {
    let name = format!("cp{replicas}");
    let (apiserver, [a, b, c], dir, client) = api_server_and_etcds(&name, ["a", "b", "c"]).await;
    put_endpoints(&a, "a", 5_000).await;
    let ports: Vec<u16> = (0..replicas).map(|_| free_port()).collect();
    let _operators: Vec<_> = ports
        .iter()
        .enumerate()
        .map(|(i, port)| start_operator(&apiserver, dir.path(), &format!("operator-{name}-{i}"), *port))
        .collect();
    let api: Api<RegionPeering> = Api::namespaced(client.clone(), NS);
    create_json(&client, NS, at_the_defaults("a", "a", &a, &[("b", &b), ("c", &c)])).await.unwrap();
    wait_condition(&api, "a", "Ready", "True", Some("AllPeersReady")).await;
    assert_eq!((mirrored(&b, "a").await, mirrored(&c, "a").await), (5_000, 5_000));
    let deletes = [
        support::etcd::count_peer_deletes(&Client::connect([b.endpoint()], None).await.unwrap(), "a").await,
        support::etcd::count_peer_deletes(&Client::connect([c.endpoint()], None).await.unwrap(), "a").await,
    ];
    let reads = Reads::start(&[&b, &c], "a").await;

    apiserver.etcd().pause();
    let paused = Instant::now();
    // The outage under test: three TTLs. A leader says it went headless (its controllers stopped,
    // its workers renewing) within the Lease's duration.
    let mut headless_after = None;
    while paused.elapsed() < 3 * TTL {
        for port in &ports {
            if headless_after.is_none() && gauge(*port, "aether_federation_leader_headless").await == Some(1.0) {
                headless_after = Some(paused.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    apiserver.etcd().resume();

    // Status catches up: a leader writes it again (refreshed after the outage), Ready.
    let resumed = std::time::SystemTime::now();
    wait_until("status written again after the outage", Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            let rp = api.get("a").await?;
            let status = rp.status.unwrap_or_default();
            let fresh = status
                .refreshed_time
                .is_some_and(|t| std::time::SystemTime::from(t.0) >= resumed - Duration::from_secs(1));
            let ready = status.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True");
            Ok(fresh && ready && status.peers.iter().all(|p| p.replication.keys == 5_000))
        }
    })
    .await
    .unwrap();
    let (fewest, n) = reads.finish();
    eprintln!("{n} reads; fewest keys of a seen on b and c: {fewest:?}");
    assert_eq!(fewest, vec![5_000, 5_000], "a key of a went missing on a peer during the control-plane outage");
    assert!(n > 600, "only {n} reads in three TTLs");
    let headless_after = headless_after.expect("no leader said it went headless");
    assert!(headless_after < Duration::from_secs(10), "headless only {headless_after:?} into the outage");
    assert_eq!(deletes.iter().map(|d| d.load(Ordering::SeqCst)).sum::<usize>(), 0, "keys of a deleted on a peer");
    let status = api.get("a").await.unwrap().status.unwrap();
    for p in &status.peers {
        assert_eq!(p.replication.resyncs, 0, "{} resynced after the outage: {p:?}", p.region);
    }
}

#[tokio::test]
#[ignore = "soak: minutes at the CRD defaults; `make test` runs it beside the other suites (hack/test.sh)"]
async fn at_the_defaults_a_control_plane_paused_for_three_ttls_costs_no_key_with_one_replica() {
    control_plane_paused_for_three_ttls(1).await;
}

#[tokio::test]
#[ignore = "soak: minutes at the CRD defaults; `make test` runs it beside the other suites (hack/test.sh)"]
async fn at_the_defaults_a_control_plane_paused_for_three_ttls_costs_no_key_with_two_replicas() {
    control_plane_paused_for_three_ttls(2).await;
}

/// How long a scenario holds a bad change: three TTLs, at the CRD defaults or the fault tests'.
#[derive(Clone, Copy)]
enum Timing {
    /// TTL 6 s, keepalive 2 s (the operator tests' settings).
    Fast,
    /// TTL 30 s, keepalive 10 s.
    Defaults,
}

impl Timing {
    fn ttl(self) -> Duration {
        match self {
            Timing::Fast => Duration::from_secs(6),
            Timing::Defaults => TTL,
        }
    }

    fn peering(self, name: &str, region: &str, local: &EtcdServer, peers: &[(&str, &EtcdServer)]) -> serde_json::Value {
        match self {
            Timing::Fast => peering(name, region, local, peers),
            Timing::Defaults => at_the_defaults(name, region, local, peers),
        }
    }
}

/// Waits for the ChangeRefused condition to say `status`/`reason`, and returns its message.
async fn change_condition(api: &Api<RegionPeering>, status: &str, reason: &str) -> String {
    let rp = wait_condition(api, "a", "ChangeRefused", status, Some(reason)).await;
    condition(&rp, "ChangeRefused").unwrap().2
}

async fn patch_spec(api: &Api<RegionPeering>, spec: serde_json::Value) {
    api.patch("a", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(serde_json::json!({ "spec": spec })))
        .await
        .unwrap();
}

/// A Secret `peer-b` with the CA of the TLS cluster `peer` and a client certificate.
fn peer_secret(
    peer: &aether_harness::EtcdCluster,
    cert: &aether_harness::CertFiles,
) -> k8s_openapi::api::core::v1::Secret {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "peer-b", "namespace": NS},
        "stringData": {
            "ca.crt": std::fs::read_to_string(peer.ca_cert().unwrap()).unwrap(),
            "tls.crt": std::fs::read_to_string(&cert.cert).unwrap(),
            "tls.key": std::fs::read_to_string(&cert.key).unwrap(),
        }
    }))
    .unwrap()
}

/// A client of the TLS cluster `peer`, as root.
async fn root_of(peer: &aether_harness::EtcdCluster) -> Client {
    let tls = etcd_client::ConnectOptions::new().with_tls(support::etcd::tls_for(peer, "root"));
    support::etcd::connect(&peer.endpoints(), Some(tls)).await
}

/// The count of `origin`'s keys in an etcd.
async fn copy_of(peer: &Client, origin: &str) -> i64 {
    let options = etcd_client::GetOptions::new().with_prefix().with_count_only();
    peer.clone().get(aether_operator::keys::region_prefix(origin), Some(options)).await.unwrap().count()
}

/// Holds the copies for three TTLs while a refused change stands: every read must see them whole.
async fn hold_three_ttls(timing: Timing, peers: &[&Client], keys: i64, what: &str) {
    let held = Instant::now();
    while held.elapsed() < 3 * timing.ttl() {
        for peer in peers {
            assert_eq!(copy_of(peer, "a").await, keys, "a's copy shrank while {what} was refused");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Region a (500 keys) mirrors into b (mTLS, its Secret) and c. Three changes a user makes by
/// mistake are each refused for three TTLs with a condition naming the field, both sides and how
/// to undo it, while the running workers keep both copies whole; undone, each clears; a change
/// that verifies applies. No key of a goes missing and nothing resyncs.
async fn bad_changes_are_refused_and_the_copies_stay_whole(timing: Timing) {
    let tag = match timing {
        Timing::Fast => "vf",
        Timing::Defaults => "vd",
    };
    let names = [format!("{tag}-a"), format!("{tag}-b"), format!("{tag}-c")];
    let (apiserver, a, b, c) = tokio::try_join!(
        KubeApiserver::start(tag),
        EtcdServer::start(&names[0]),
        aether_harness::EtcdCluster::start_with(&names[1], aether_harness::ClusterOptions::new(1).with_tls()),
        EtcdServer::start(&names[2])
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let client = prepare(&apiserver).await;
    put_endpoints(&a, "a", 500).await;
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), NS);
    let secret = |cert: &aether_harness::CertFiles| peer_secret(&b, cert);
    let good = b.client_cert("root").unwrap();
    secrets.create(&Default::default(), &secret(&good)).await.unwrap();
    let _operator = start_operator(&apiserver, dir.path(), &format!("operator-{tag}"), free_port());
    let api: Api<RegionPeering> = Api::namespaced(client.clone(), NS);
    let mut rp = timing.peering("a", "a", &a, &[("c", &c)]);
    let b_peer =
        serde_json::json!({"region": "b", "endpoints": b.endpoints(), "tls": {"secretRef": {"name": "peer-b"}}});
    let c_peer = rp["spec"]["peers"][0].clone();
    rp["spec"]["peers"] = serde_json::json!([b_peer.clone(), c_peer.clone()]);
    create_json(&client, NS, rp).await.unwrap();
    wait_condition(&api, "a", "Ready", "True", Some("AllPeersReady")).await;
    let b_reader = root_of(&b).await;
    let c_reader = Client::connect([c.endpoint()], None).await.unwrap();
    let deletes = [
        support::etcd::count_peer_deletes(&b_reader, "a").await,
        support::etcd::count_peer_deletes(&c_reader, "a").await,
    ];
    let readers = [&b_reader, &c_reader];
    assert_eq!((copy_of(&b_reader, "a").await, copy_of(&c_reader, "a").await), (500, 500));

    // 1. b's endpoints edited to c's etcd: one etcd under two peer names.
    let mut to_c = b_peer.clone();
    to_c["endpoints"] = serde_json::json!([c.endpoint()]);
    patch_spec(&api, serde_json::json!({"peers": [to_c, c_peer.clone()]})).await;
    hold_three_ttls(timing, &readers, 500, "b's endpoints pointing at c").await;
    let message = change_condition(&api, "True", "DuplicatePeer").await;
    let back = format!("set spec.peers[b].endpoints back to {:?}", b.endpoints());
    for said in ["spec.peers[b].endpoints", &c.endpoint(), "Peer b keeps running on its previous configuration", &back]
    {
        assert!(message.contains(said), "{said:?} missing from {message}");
    }
    let ready = condition(&api.get("a").await.unwrap(), "Ready").unwrap();
    assert_eq!((ready.0.as_str(), ready.1.as_str()), ("False", "DuplicatePeer"));
    patch_spec(&api, serde_json::json!({"peers": [b_peer.clone(), c_peer.clone()]})).await;
    change_condition(&api, "False", "AllApplied").await;

    // 2. b's Secret replaced by a client certificate of another CA.
    let stranger = aether_harness::Pki::new(dir.path()).unwrap();
    let foreign = stranger.client("foreign", "root", &[]).unwrap();
    secrets.replace("peer-b", &Default::default(), &secret(&foreign)).await.unwrap();
    hold_three_ttls(timing, &readers, 500, "b's Secret of another CA").await;
    let message = change_condition(&api, "True", "TLSUntrusted").await;
    for said in ["Secret fed/peer-b", "tls.crt", "tls.key", "restore Secret fed/peer-b's previous contents"] {
        assert!(message.contains(said), "{said:?} missing from {message}");
    }
    secrets.replace("peer-b", &Default::default(), &secret(&good)).await.unwrap();
    change_condition(&api, "False", "AllApplied").await;

    // 3. localEtcd edited to c's etcd, spelled another way: c holds a's copy.
    let c_spelled = c.endpoint().replace("127.0.0.1", "localhost");
    patch_spec(&api, serde_json::json!({"localEtcd": {"endpoints": [c_spelled]}})).await;
    hold_three_ttls(timing, &readers, 500, "localEtcd pointing at c").await;
    let message = change_condition(&api, "True", "LocalEtcdHoldsCopy").await;
    let back = format!("set spec.localEtcd.endpoints back to [\"{}\"]", a.endpoint());
    for said in ["spec.localEtcd.endpoints", &back, "a peer's etcd"] {
        assert!(message.contains(said), "{said:?} missing from {message}");
    }
    // Writes into a still reach both peers: the workers read a, not c.
    put_endpoints(&a, "a", 501).await;
    wait_until("a write into a mirrored while the localEtcd change is refused", Duration::from_secs(60), || async {
        Ok(copy_of(&b_reader, "a").await == 501 && copy_of(&c_reader, "a").await == 501)
    })
    .await
    .unwrap();
    patch_spec(&api, serde_json::json!({"localEtcd": {"endpoints": [a.endpoint()]}})).await;
    change_condition(&api, "False", "AllApplied").await;

    // 4. A change that verifies applies: c's endpoint spelled with a trailing slash.
    let mut c_slash = c_peer.clone();
    c_slash["endpoints"] = serde_json::json!([format!("{}/", c.endpoint())]);
    patch_spec(&api, serde_json::json!({"peers": [b_peer.clone(), c_slash]})).await;
    wait_until("the verified change applied", Duration::from_secs(60), || {
        let api = api.clone();
        async move {
            let rp = api.get("a").await?;
            let applied = condition(&rp, "ChangeRefused").is_some_and(|c| c.1 == "AllApplied");
            let observed = rp.status.as_ref().and_then(|s| s.observed_generation) == rp.metadata.generation;
            Ok(applied && observed && condition(&rp, "Ready").is_some_and(|c| c.0 == "True"))
        }
    })
    .await
    .unwrap();

    assert_eq!(deletes.iter().map(|d| d.load(Ordering::SeqCst)).sum::<usize>(), 0, "keys of a deleted on a peer");
    let status = api.get("a").await.unwrap().status.unwrap();
    for p in &status.peers {
        assert_eq!((p.replication.keys, p.replication.resyncs), (501, 0), "{p:?}");
    }

    // 5. localEtcd edited to a new, empty etcd: nothing tells the trial it is the wrong one, but
    // mirroring it would delete the whole region on every peer. The workers hold that resync and
    // keep the copies alive until the spec raises maxResyncDeletePercent.
    let empty = EtcdServer::start(&format!("{tag}-empty")).await.unwrap();
    patch_spec(&api, serde_json::json!({"localEtcd": {"endpoints": [empty.endpoint()]}})).await;
    hold_three_ttls(timing, &readers, 501, "a resync from an empty origin").await;
    let rp = wait_condition(&api, "a", "Ready", "False", Some("ResyncWouldDelete")).await;
    let message = condition(&rp, "Ready").unwrap().2;
    for said in ["501 of the 501 keys", "spec.sync.maxResyncDeletePercent = 50", "point it back"] {
        assert!(message.contains(said), "{said:?} missing from {message}");
    }
    assert!(rp.status.is_some_and(|s| s.peers.iter().any(|p| p.phase == "Held")));
    // Each peer's worker holds it on its own: the other may still be on its way there (a loaded
    // machine showed Ready=False with one peer Held and the other not yet).
    wait_until("every peer's worker holds the resync", Duration::from_secs(60), || async {
        let status = api.get("a").await?.status.unwrap_or_default();
        Ok(!status.peers.is_empty() && status.peers.iter().all(|p| p.phase == "Held"))
    })
    .await
    .unwrap();
    // Acknowledged: the origin as it is now is mirrored (empty).
    patch_spec(&api, serde_json::json!({"sync": {"maxResyncDeletePercent": 100}})).await;
    wait_until("the acknowledged resync mirrors the empty origin", Duration::from_secs(120), || async {
        Ok(copy_of(&b_reader, "a").await == 0 && copy_of(&c_reader, "a").await == 0)
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn bad_changes_are_refused_for_three_ttls_while_the_copies_stay_whole_and_undoing_them_clears_the_refusal() {
    bad_changes_are_refused_and_the_copies_stay_whole(Timing::Fast).await;
}

#[tokio::test]
#[ignore = "soak: minutes at the CRD defaults; `make test` runs it beside the other suites (hack/test.sh)"]
async fn at_the_defaults_bad_changes_are_refused_for_three_ttls_while_the_copies_stay_whole() {
    bad_changes_are_refused_and_the_copies_stay_whole(Timing::Defaults).await;
}

/// Writes `n` legacy endpoints of region `region` into an etcd.
/// The lease of each of `origin`'s keys on a peer, by key.
async fn leases_of(peer: &Client, origin: &str) -> std::collections::BTreeMap<Vec<u8>, i64> {
    let options = etcd_client::GetOptions::new().with_prefix().with_keys_only();
    let r = peer.clone().get(aether_operator::keys::region_prefix(origin), Some(options)).await.unwrap();
    r.kvs().iter().map(|kv| (kv.key().to_vec(), kv.lease())).collect()
}

/// Region a (300 keys) mirrors into b and c. A person takes b out of `spec.peers` by mistake (b's
/// worker stops, revoking nothing) and puts it back a third of a TTL later. b's copy of a is whole
/// at every read, from before the mistake to a TTL and a half after it (when the leases as they
/// were at the mistake would have lapsed), and stays on the leases it had: the new worker adopted
/// them, nothing was rewritten or deleted. c is untouched throughout. Fast: TTL 15 s, keepalive
/// 3 s; at the defaults: 30 s and 10 s.
async fn a_peer_removed_and_added_back_within_the_ttl(timing: Timing) {
    let (tag, ttl, keepalive) = match timing {
        Timing::Fast => ("backf", Duration::from_secs(15), Duration::from_secs(3)),
        Timing::Defaults => ("backd", TTL, Duration::from_secs(10)),
    };
    let (apiserver, [a, b, c], dir, client) = api_server_and_etcds(tag, ["a", "b", "c"]).await;
    put_endpoints(&a, "a", 300).await;
    let _operator = start_operator(&apiserver, dir.path(), &format!("operator-{tag}"), free_port());
    let api: Api<RegionPeering> = Api::namespaced(client.clone(), NS);
    let mut rp = timing.peering("a", "a", &a, &[("b", &b), ("c", &c)]);
    if matches!(timing, Timing::Fast) {
        rp["spec"]["lease"] =
            serde_json::json!({"ttlSeconds": ttl.as_secs(), "keepaliveIntervalSeconds": keepalive.as_secs()});
        rp["spec"]["failureDetector"] = serde_json::json!({"acceptablePauseSeconds": 2 * keepalive.as_secs()});
    }
    let (b_peer, c_peer) = (rp["spec"]["peers"][0].clone(), rp["spec"]["peers"][1].clone());
    create_json(&client, NS, rp).await.unwrap();
    wait_condition(&api, "a", "Ready", "True", Some("AllPeersReady")).await;
    let b_reader = Client::connect([b.endpoint()], None).await.unwrap();
    let c_reader = Client::connect([c.endpoint()], None).await.unwrap();
    assert_eq!((copy_of(&b_reader, "a").await, copy_of(&c_reader, "a").await), (300, 300));
    let leases_before = leases_of(&b_reader, "a").await;
    let deletes = support::etcd::count_peer_deletes(&b_reader, "a").await;
    let reads = Reads::start(&[&b, &c], "a").await;

    // The mistake: b taken out. Its worker stops (b leaves the status) and revokes nothing.
    let removed = Instant::now();
    patch_spec(&api, serde_json::json!({"peers": [c_peer.clone()]})).await;
    wait_until("b's worker stops", WAIT, || {
        let api = api.clone();
        async move { Ok(api.get("a").await?.status.is_some_and(|s| !s.peers.iter().any(|p| p.region == "b"))) }
    })
    .await
    .unwrap();
    // A third of a TTL without a worker for b: the time a person takes to notice and undo it.
    tokio::time::sleep((ttl / 3).saturating_sub(removed.elapsed())).await;
    patch_spec(&api, serde_json::json!({"peers": [b_peer.clone(), c_peer.clone()]})).await;
    wait_condition(&api, "a", "Ready", "True", Some("AllPeersReady")).await;
    // The leases had at least a TTL less a keepalive left when the worker stopped.
    assert!(
        removed.elapsed() < ttl - keepalive,
        "b was back only {:?} after it went: its leases may have lapsed on their own, the test proves nothing",
        removed.elapsed()
    );
    while removed.elapsed() < ttl + ttl / 2 {
        assert_eq!(copy_of(&b_reader, "a").await, 300, "a's copy on b went short after b was added back");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (fewest, n) = reads.finish();
    assert_eq!(fewest, vec![300, 300], "a key of a missing on b or c at some read ({n} reads)");
    assert!(n > 20, "only {n} reads");
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "keys of a deleted on b");
    assert_eq!(leases_of(&b_reader, "a").await, leases_before, "b's copy was rewritten onto other leases");
}

#[tokio::test]
async fn a_peer_removed_by_mistake_and_added_back_within_the_ttl_loses_no_key_and_keeps_its_leases() {
    a_peer_removed_and_added_back_within_the_ttl(Timing::Fast).await;
}

#[tokio::test]
#[ignore = "soak: minutes at the CRD defaults; `make test` runs it beside the other suites (hack/test.sh)"]
async fn at_the_defaults_a_peer_removed_by_mistake_and_added_back_within_the_ttl_loses_no_key_and_keeps_its_leases() {
    a_peer_removed_and_added_back_within_the_ttl(Timing::Defaults).await;
}

async fn put_legacy(etcd: &EtcdServer, region: &str, n: usize) {
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    for i in 0..n {
        let key = format!("/aether/services/s{}/protocols/tcp/endpoints/10.7.{}.{}", i % 3, i / 200, i % 200);
        let value = format!(r#"{{"region":"{region}","clusterName":"c1"}}"#);
        c.put(key, value, None).await.unwrap();
    }
}

async fn count_prefix(etcd: &EtcdServer, prefix: &str) -> i64 {
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    c.get(prefix, Some(etcd_client::GetOptions::new().with_prefix().with_count_only())).await.unwrap().count()
}

fn registry_schema(name: &str, region: &str, etcd: &EtcdServer) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "federation.aether.dev/v1alpha1",
        "kind": "RegistrySchema",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"etcd": {"endpoints": [etcd.endpoint()]}, "region": region, "cluster": "c1",
                 "drain": {"quietPeriodSeconds": 1}},
    })
}

/// Waits for a RegistrySchema's Ready condition to be False with `reason`; its message.
async fn schema_refused(api: &Api<aether_operator::api::RegistrySchema>, name: &str, reason: &str) -> String {
    let mut last = None;
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        let rs = api.get(name).await.unwrap();
        let ready = rs.status.as_ref().and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready").cloned());
        if let Some(c) = ready.as_ref().filter(|c| c.status == "False" && c.reason == reason) {
            return c.message.clone();
        }
        last = ready;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("{name}: Ready=False ({reason}) not reached; last: {last:?}");
}

#[tokio::test]
async fn a_registry_schema_on_an_etcd_that_is_not_its_regions_origin_is_refused_before_anything_is_written() {
    let (apiserver, a, b) = tokio::try_join!(
        KubeApiserver::start("drainto"),
        EtcdServer::start("drainto-a"),
        EtcdServer::start("drainto-b")
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let client = prepare(&apiserver).await;
    // a and b mirror into each other; each etcd also holds 350 legacy endpoints of its own region.
    put_endpoints(&a, "a", 50).await;
    put_endpoints(&b, "b", 50).await;
    put_legacy(&a, "a", 350).await;
    put_legacy(&b, "b", 350).await;
    let _operator = start_operator(&apiserver, dir.path(), "operator-drainto", free_port());
    let peerings: Api<RegionPeering> = Api::namespaced(client.clone(), NS);
    create_json(&client, NS, peering("a", "a", &a, &[("b", &b)])).await.unwrap();
    create_json(&client, NS, peering("b", "b", &b, &[("a", &a)])).await.unwrap();
    wait_condition(&peerings, "a", "Ready", "True", None).await;
    wait_condition(&peerings, "b", "Ready", "True", None).await;
    let before = [
        count_prefix(&a, "/aether/").await,
        count_prefix(&b, "/aether/").await,
        count_prefix(&a, "/aether/services/").await,
    ];
    let schemas: Api<aether_operator::api::RegistrySchema> = Api::namespaced(client.clone(), NS);

    // Region b drained in a's etcd, where b's copy lives; and region a in b's etcd.
    create_json(&client, NS, registry_schema("b-in-a", "b", &a)).await.unwrap();
    let message = schema_refused(&schemas, "b-in-a", "EtcdHoldsCopy").await;
    assert!(message.contains("copy of region b") && message.contains("spec.etcd"), "{message}");
    create_json(&client, NS, registry_schema("a-in-b", "a", &b)).await.unwrap();
    let message = schema_refused(&schemas, "a-in-b", "EtcdHoldsCopy").await;
    assert!(message.contains("copy of region a"), "{message}");
    // Region c (no copy of it anywhere) in a's etcd, which RegionPeering fed/a says is a's.
    create_json(&client, NS, registry_schema("c-in-a", "c", &a)).await.unwrap();
    let message = schema_refused(&schemas, "c-in-a", "EtcdOfAnotherRegion").await;
    assert!(message.contains("fed/a") && message.contains("fed/c-in-a"), "{message}");

    // Nothing was read into v1 or deleted from the legacy layout; no drain lock was taken. The
    // copies only change if a mirror wrote (it did not: no origin changed).
    tokio::time::sleep(Duration::from_secs(3)).await; // a window in which a drain that ran would copy
    let after = [
        count_prefix(&a, "/aether/").await,
        count_prefix(&b, "/aether/").await,
        count_prefix(&a, "/aether/services/").await,
    ];
    assert_eq!(after, before, "a refused drain wrote or deleted something");
    assert_eq!(count_prefix(&a, "/aether/v1/drain/").await + count_prefix(&b, "/aether/v1/drain/").await, 0);

    // The region's own etcd drains.
    create_json(&client, NS, registry_schema("a-in-a", "a", &a)).await.unwrap();
    wait_until("a's legacy endpoints migrated in a's etcd", WAIT, || async {
        Ok(count_prefix(&a, "/aether/services/").await == 0
            && count_prefix(&a, &aether_operator::keys::cluster_prefix("a", "c1")).await == 400)
    })
    .await
    .unwrap();
    assert_eq!(count_prefix(&b, "/aether/services/").await, 350, "b's legacy endpoints untouched");
}

#[tokio::test]
async fn a_namespace_deleted_with_its_secrets_first_still_retires_every_copy_and_leaves_no_record() {
    let (apiserver, a, b, c) = tokio::try_join!(
        KubeApiserver::start("nsdel"),
        EtcdServer::start("nsdel-a"),
        aether_harness::EtcdCluster::start_with("nsdel-b", aether_harness::ClusterOptions::new(1).with_tls()),
        EtcdServer::start("nsdel-c")
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let client = prepare(&apiserver).await;
    put_endpoints(&a, "a", 200).await;
    let secret = peer_secret(&b, &b.client_cert("root").unwrap());
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), NS);
    secrets.create(&Default::default(), &secret).await.unwrap();
    let _operator = start_operator(&apiserver, dir.path(), "operator-nsdel", free_port());
    let api: Api<RegionPeering> = Api::namespaced(client.clone(), NS);
    let mut rp = peering("a", "a", &a, &[("c", &c)]);
    let c_peer = rp["spec"]["peers"][0].clone();
    rp["spec"]["peers"] = serde_json::json!([
        {"region": "b", "endpoints": b.endpoints(), "tls": {"secretRef": {"name": "peer-b"}}}, c_peer
    ]);
    // A long TTL: a copy that only lapses would still be there long after a retirement.
    rp["spec"]["lease"] = serde_json::json!({"ttlSeconds": 120, "keepaliveIntervalSeconds": 10});
    rp["spec"]["failureDetector"] = serde_json::json!({"acceptablePauseSeconds": 20});
    rp["spec"]["deletionPolicy"] = serde_json::json!("Delete");
    create_json(&client, NS, rp).await.unwrap();
    wait_condition(&api, "a", "Ready", "True", Some("AllPeersReady")).await;
    let b_reader = root_of(&b).await;
    let c_reader = Client::connect([c.endpoint()], None).await.unwrap();
    // The copy, and the records besides the owner record (which stays as a tombstone, so that a
    // deposed worker never takes the retired mirror back).
    let held = |peer: &Client| {
        let peer = peer.clone();
        async move { (copy_of(&peer, "a").await, records_besides_the_tombstone(&peer).await) }
    };
    assert_eq!((copy_of(&b_reader, "a").await, copy_of(&c_reader, "a").await), (200, 200));

    // What the namespace controller does: every Secret of the namespace goes, then the
    // RegionPeering (this API server runs no controller manager, so the test deletes in its order).
    secrets.delete("peer-b", &Default::default()).await.unwrap();
    api.delete("a", &Default::default()).await.unwrap();
    let deleted = Instant::now();
    wait_until("the RegionPeering is gone", Duration::from_secs(60), || {
        let api = api.clone();
        async move { Ok(api.get_opt("a").await?.is_none()) }
    })
    .await
    .unwrap();
    // Retired from both peers, long before the leases (120 s) would lapse: no key, no record.
    assert_eq!(held(&b_reader).await, (0, 0), "b kept a's copy or its records after the namespace's deletion");
    assert_eq!(held(&c_reader).await, (0, 0), "c kept a's copy or its records after the namespace's deletion");
    assert!(deleted.elapsed() < Duration::from_secs(60), "{:?}", deleted.elapsed());
}

/// Region a's records on a peer other than its owner record, and whether that is a tombstone.
async fn records_besides_the_tombstone(peer: &Client) -> i64 {
    use aether_operator::keys;
    let options = etcd_client::GetOptions::new().with_prefix();
    let records = peer.clone().get(keys::federation_prefix("a"), Some(options)).await.unwrap();
    let owner = keys::owner_key("a");
    let tombstone = records.kvs().iter().find(|kv| kv.key() == owner.as_bytes()).is_some_and(|kv| {
        aether_operator::mirror::records::checkpoint::Owner::decode(kv.value()).is_some_and(|o| o.retired)
    });
    assert!(tombstone, "the owner record is a retirement's tombstone");
    records.kvs().iter().filter(|kv| kv.key() != owner.as_bytes()).count() as i64
}

/// Sleeps until 100 ms past the next whole second: two objects created from then on within
/// 800 ms share their creation second.
async fn at_the_start_of_a_second() {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    let into = Duration::from_nanos(u64::from(now.subsec_nanos()));
    tokio::time::sleep(Duration::from_millis(1_100) - into).await; // to the next second's start
}

fn created(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    meta.creation_timestamp.as_ref().map(|t| t.0.to_string()).unwrap_or_default()
}

#[tokio::test]
async fn of_two_region_peerings_created_in_one_second_the_one_that_runs_keeps_running_and_no_key_lapses() {
    let (apiserver, [a, b, w], dir, client) = api_server_and_etcds("twice", ["a", "b", "w"]).await;
    put_endpoints(&a, "a", 300).await;
    let _operator = start_operator(&apiserver, dir.path(), "operator-twice", free_port());
    let api: Api<RegionPeering> = Api::namespaced(client.clone(), NS);
    // The operator runs a RegionPeering before the race begins: a just-elected leader lists its
    // objects first, and one that saw zz and aa only together would have no running claim to
    // prefer (region w, on an etcd of its own, claims nothing of a's).
    create_json(&client, NS, peering("warm", "w", &w, &[("b", &b)])).await.unwrap();
    wait_condition(&api, "warm", "Ready", "True", None).await;
    // "zz" starts first; "aa", created in the same second, sorts before it.
    at_the_start_of_a_second().await;
    let second_ends = Instant::now() + Duration::from_millis(800);
    create_json(&client, NS, peering("zz", "a", &a, &[("b", &b)])).await.unwrap();
    // zz runs (its reconcile has acted and reported) before aa exists, within the same second.
    while api.get("zz").await.unwrap().status.is_none() {
        assert!(Instant::now() < second_ends, "zz did not run within its second: the test proves nothing");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    create_json(&client, NS, peering("aa", "a", &a, &[("b", &b)])).await.unwrap();
    let (zz, aa) = (api.get("zz").await.unwrap(), api.get("aa").await.unwrap());
    assert_eq!(created(&zz.metadata), created(&aa.metadata), "not created in one second: the test proves nothing");

    let running = wait_condition(&api, "zz", "Ready", "True", None).await;
    let refused = wait_condition(&api, "aa", "Conflict", "True", Some("RegionClaimed")).await;
    assert!(condition(&refused, "Conflict").unwrap().2.contains("fed/zz"));
    let uid = running.metadata.uid.clone().unwrap();
    let b_reader = Client::connect([b.endpoint()], None).await.unwrap();
    let deletes = support::etcd::count_peer_deletes(&b_reader, "a").await;
    // Three TTLs (6 s): the copy whole at every read, zz owning it on the peer throughout.
    let held = Instant::now();
    while held.elapsed() < Duration::from_secs(18) {
        assert_eq!(copy_of(&b_reader, "a").await, 300, "a's copy on b went short");
        let owner = b_reader.clone().get(aether_operator::keys::owner_key("a"), None).await.unwrap();
        let object = owner
            .kvs()
            .first()
            .and_then(|kv| aether_operator::mirror::records::checkpoint::Owner::decode(kv.value()))
            .and_then(|o| o.object);
        assert_eq!(object.map(|o| o.uid), Some(uid.clone()), "the mirror on b changed hands");
        assert_eq!(condition(&api.get("zz").await.unwrap(), "Ready").unwrap().0, "True", "the running one stopped");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(deletes.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn of_two_registry_schemas_created_in_one_second_the_running_drain_keeps_running() {
    let (apiserver, a, w) = tokio::try_join!(
        KubeApiserver::start("twodrains"),
        EtcdServer::start("twodrains-a"),
        EtcdServer::start("twodrains-w")
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let client = prepare(&apiserver).await;
    put_legacy(&a, "a", 400).await;
    let _operator = start_operator(&apiserver, dir.path(), "operator-twodrains", free_port());
    let schemas: Api<aether_operator::api::RegistrySchema> = Api::namespaced(client.clone(), NS);
    // The operator reconciles RegistrySchemas before the race begins: a just-elected leader lists
    // them first, and one that saw zz and aa only together would have no running drain to prefer
    // (region w, on an etcd of its own, claims nothing of a's).
    create_json(&client, NS, registry_schema("warm", "w", &w)).await.unwrap();
    wait_until("the operator reconciles a RegistrySchema", WAIT, || async {
        Ok(schemas.get("warm").await?.status.is_some_and(|s| s.phase.is_some()))
    })
    .await
    .unwrap();
    let slow = |name: &str| {
        let mut s = registry_schema(name, "a", &a);
        s["spec"]["drain"]["rateLimitPerSecond"] = serde_json::json!(100);
        s
    };
    at_the_start_of_a_second().await;
    let second_ends = Instant::now() + Duration::from_millis(800);
    create_json(&client, NS, slow("zz")).await.unwrap();
    // zz's drain runs (it holds the drain lock) before aa exists, within the same second.
    let mut etcd = Client::connect([a.endpoint()], None).await.unwrap();
    let lock = aether_operator::keys::drain_lock_key(aether_operator::keys::V0_ROOT);
    while etcd.get(lock.as_str(), None).await.unwrap().kvs().is_empty() {
        assert!(Instant::now() < second_ends, "zz's drain did not start within its second: the test proves nothing");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    create_json(&client, NS, slow("aa")).await.unwrap();
    let (zz, aa) = (schemas.get("zz").await.unwrap(), schemas.get("aa").await.unwrap());
    assert_eq!(created(&zz.metadata), created(&aa.metadata), "not created in one second: the test proves nothing");

    let message = schema_refused(&schemas, "aa", "SchemaClaimed").await;
    assert!(message.contains("fed/zz"), "{message}");
    // zz, which ran first, is never refused on the way to completing the drain.
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let zz = schemas.get("zz").await.unwrap();
        let status = zz.status.unwrap_or_default();
        let ready = status.conditions.iter().find(|c| c.type_ == "Ready");
        assert!(ready.is_none_or(|c| c.reason != "SchemaClaimed"), "the running drain was refused: {ready:?}");
        if status.phase.as_deref() == Some("Complete") {
            break;
        }
        assert!(Instant::now() < deadline, "zz did not complete: {status:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(count_prefix(&a, "/aether/services/").await, 0);
    assert_eq!(count_prefix(&a, &aether_operator::keys::cluster_prefix("a", "c1")).await, 400);
}
