//! The operator binary against a real kube-apiserver, running as a ServiceAccount bound to exactly
//! the RBAC in config/rbac, with real registry etcds for the region and its peers.
mod support;

use aether_harness::{EtcdServer, KubeApiserver, free_port, wait_until};
use aether_operator::api::{RegionPeering, RegistrySchema};
use aether_operator::keys;
use aether_operator::mirror::records::checkpoint::Owner;
use etcd_client::{Client, GetOptions, Txn, TxnOp};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use std::process::Command;
use std::time::Duration;
use support::operator::*;
use support::*;

#[tokio::test]
async fn the_operator_runs_as_its_service_account_and_follows_the_spec() {
    let (apiserver, a, b, c) = tokio::try_join!(
        KubeApiserver::start("op"),
        EtcdServer::start("op-a"),
        EtcdServer::start("op-b"),
        EtcdServer::start("op-c")
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let client = prepare(&apiserver).await;
    put_endpoints(&a, "a", 100).await;
    put_endpoints(&b, "b", 40).await;

    let metrics_port = free_port();
    let _operator = start_operator(&apiserver, dir.path(), "operator-0", metrics_port);
    let api: Api<RegionPeering> = Api::namespaced(client.clone(), NS);
    create_json(&client, NS, peering("a", "a", &a, &[("b", &b), ("c", &c)])).await.unwrap();

    // Ready means synced everywhere, not merely connected.
    let rp = wait_condition(&api, "a", "Ready", "True", Some("AllPeersReady")).await;
    assert_eq!((mirrored(&b, "a").await, mirrored(&c, "a").await), (100, 100));
    let status = rp.status.clone().unwrap();
    assert_eq!(status.peers_ready.as_deref(), Some("2/2"));
    assert_eq!(status.leader.as_deref(), Some("operator-0"));
    assert_eq!(status.observed_generation, rp.metadata.generation);
    for p in &status.peers {
        assert_eq!(
            (p.phase.as_str(), p.replication.keys, p.replication.synced, p.reachable),
            ("Watching", 100, true, true)
        );
        assert!(p.keepalive.leases >= 1);
    }
    assert_eq!(condition(&rp, "Replicating").unwrap().0, "True");
    assert_eq!(condition(&rp, "PeersReachable").unwrap().0, "True");
    assert_eq!(condition(&rp, "KeepaliveDegraded").unwrap().0, "False");
    // These leases (TTL 6 s, keepalive 2 s) would not outlive a crashed leader's 8 s Lease: said,
    // with the TTL to set, while the region is Ready.
    let (covered, why, message) = condition(&rp, "HandoffCovered").unwrap();
    assert_eq!((covered.as_str(), why.as_str()), ("False", "TtlShorterThanHandoff"), "{message}");
    assert!(message.contains("spec.lease.ttlSeconds to at least 15"), "{message}");
    let table = kubectl(&apiserver, &["get", "regionpeerings", "-n", NS, "-o", "wide"]);
    assert!(table.lines().any(|l| l.starts_with("a ") && l.contains("2/2") && l.contains("True")), "{table}");

    // An endpoint written in a appears in b and c.
    put_endpoints(&a, "a", 101).await;
    wait_until("new key mirrored", WAIT, || async {
        Ok(mirrored(&b, "a").await == 101 && mirrored(&c, "a").await == 101)
    })
    .await
    .unwrap();

    // Events and metrics say what happened, with region and peer.
    // Events are written asynchronously: poll for them.
    let mut events = String::new();
    let seen = wait_until("events", WAIT, || {
        events = kubectl(&apiserver, &["get", "events", "-n", NS, "-o", "custom-columns=REASON:.reason,NOTE:.message"]);
        let all = ["LeaderElected", "LeaseGranted", "Synced", "ResyncStarted", "TtlShorterThanHandoff"]
            .iter()
            .all(|r| events.contains(r))
            && events.contains("a -> b")
            && events.contains("a -> c");
        async move { Ok(all) }
    })
    .await;
    assert!(seen.is_ok(), "events missing in\n{events}");
    wait_until("metrics", WAIT, || async {
        let metrics = scrape_metrics(metrics_port).await;
        Ok(metrics.contains(r#"aether_federation_mirrored_keys{origin="a",target="b"} 101"#)
            && metrics.contains("aether_federation_leader 1"))
    })
    .await
    .unwrap();

    // The inbound view: what b mirrors into a shows up in a's status once b runs too.
    create_json(&client, NS, peering("b", "b", &b, &[("a", &a)])).await.unwrap();
    wait_condition(&api, "b", "Ready", "True", None).await;
    let inbound_seen = wait_until("inbound view", WAIT, || {
        let api = api.clone();
        async move {
            let rp = api.get("a").await?;
            Ok(rp
                .status
                .and_then(|s| s.inbound.into_iter().find(|i| i.region == "b"))
                .is_some_and(|i| i.keys == 40 && i.synced))
        }
    })
    .await;
    if let Err(e) = inbound_seen {
        panic!("{e}: {:?}", api.get("a").await.map(|r| r.status));
    }

    // Removing a peer stops its worker; its mirror lapses with the lease (TTL 6 s).
    api.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"peers": [{"region": "b", "endpoints": [b.endpoint()]}]}})),
    )
    .await
    .unwrap();
    wait_until("c's mirror lapses", WAIT, || async { Ok(mirrored(&c, "a").await == 0) }).await.unwrap();
    let rp = wait_condition(&api, "a", "Ready", "True", None).await;
    assert_eq!(rp.status.unwrap().peers.iter().map(|p| p.region.as_str()).collect::<Vec<_>>(), vec!["b"]);
    assert_eq!(mirrored(&b, "a").await, 101, "the remaining peer is untouched");

    // A second RegionPeering for the same region on the same etcd runs nothing.
    create_json(&client, NS, peering("a-again", "a", &a, &[("c", &c)])).await.unwrap();
    let dup = wait_condition(&api, "a-again", "Conflict", "True", Some("RegionClaimed")).await;
    assert!(condition(&dup, "Conflict").unwrap().2.contains("fed/a"));
    assert_eq!(mirrored(&c, "a").await, 0);
    api.delete("a-again", &DeleteParams::default()).await.unwrap();

    // A missing Secret is named in the condition, and nothing crashes.
    let mut broken = peering("tls", "t", &a, &[("b", &b)]);
    broken["spec"]["peers"][0]["endpoints"] = json!(["https://127.0.0.1:1"]);
    broken["spec"]["peers"][0]["tls"] = json!({"secretRef": {"name": "peer-creds"}});
    create_json(&client, NS, broken).await.unwrap();
    let rp = wait_condition(&api, "tls", "Ready", "False", Some("SecretNotFound")).await;
    assert!(condition(&rp, "Ready").unwrap().2.contains("Secret peer-creds not found"));
    // A malformed Secret names the key; its content never shows in status.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    let secret = serde_json::from_value(
        json!({"metadata": {"name": "peer-creds"}, "stringData": {"ca.crt": "top-secret-not-pem"}}),
    )
    .unwrap();
    secrets.create(&PostParams::default(), &secret).await.unwrap();
    let rp = wait_condition(&api, "tls", "Ready", "False", Some("SecretInvalid")).await;
    let message = condition(&rp, "Ready").unwrap().2;
    assert!(message.contains("ca.crt") && !message.contains("top-secret"), "{message}");
    api.delete("tls", &DeleteParams::default()).await.unwrap();

    // Suspend stops the workers and says so.
    api.patch("a", &PatchParams::default(), &Patch::Merge(json!({"spec": {"suspend": true}}))).await.unwrap();
    let rp = wait_condition(&api, "a", "Suspended", "True", None).await;
    assert_eq!(condition(&rp, "Ready").unwrap().1, "Suspended");
    wait_until("suspended mirror lapses", WAIT, || async { Ok(mirrored(&b, "a").await == 0) }).await.unwrap();
}

#[tokio::test]
async fn without_crds_the_operator_says_how_to_install_them() {
    let apiserver = KubeApiserver::start("nocrd").await.unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_aether-operator"))
        .args(["run", "--metrics-addr", &format!("127.0.0.1:{}", free_port())])
        .arg("--kubeconfig")
        .arg(apiserver.kubeconfig())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(text.contains("kubectl apply -f crds/") && text.contains("regionpeerings.federation.aether.dev"), "{text}");
}

/// A kube-apiserver with the CRDs, a registry etcd, a temp dir for the operator, and clients of both.
async fn registry_and_apiserver(name: &str) -> (KubeApiserver, EtcdServer, tempfile::TempDir, kube::Client, Client) {
    let etcd_name = format!("{name}-etcd");
    let (apiserver, etcd) = tokio::try_join!(KubeApiserver::start(name), EtcdServer::start(&etcd_name)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let client = prepare(&apiserver).await;
    let c = Client::connect([etcd.endpoint()], None).await.unwrap();
    (apiserver, etcd, dir, client, c)
}

#[tokio::test]
async fn registry_schema_status_follows_the_drain() {
    let (apiserver, etcd, dir, client, mut c) = registry_and_apiserver("schema").await;
    for i in 0..300 {
        c.put(
            format!("/aether/services/s/protocols/tcp/endpoints/10.2.{}.{}", i / 200, i % 200),
            r#"{"clusterName":"c7"}"#,
            None,
        )
        .await
        .unwrap();
    }
    c.put("/aether/services/s/protocols/tcp/endpoints/bogus", "{}", None).await.unwrap();
    let _operator = start_operator(&apiserver, dir.path(), "operator-0", free_port());
    let schema = json!({
        "apiVersion": "federation.aether.dev/v1alpha1",
        "kind": "RegistrySchema",
        "metadata": {"name": "registry", "namespace": NS},
        "spec": {"etcd": {"endpoints": [etcd.endpoint()]}, "region": "eu", "cluster": "dflt", "drain": {"quietPeriodSeconds": 1}},
    });
    create_json(&client, NS, schema).await.unwrap();
    let api: Api<RegistrySchema> = Api::namespaced(client.clone(), NS);
    let mut phases = std::collections::BTreeSet::new();
    let done = tokio::time::timeout(WAIT, async {
        loop {
            let rs = api.get("registry").await.unwrap();
            if let Some(s) = rs.status {
                phases.extend(s.phase.clone());
                if s.phase.as_deref() == Some("Complete") {
                    return s;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the drain completes");
    assert_eq!(
        (done.counts.legacy_seen, done.counts.copied, done.counts.skipped, done.counts.deleted),
        (301, 300, 1, 300)
    );
    assert!(done.skipped_keys[0].contains("bogus"));
    assert!(done.conditions.iter().all(|c| c.status == "True"), "{:?}", done.conditions);
    assert!(done.started_time.is_some() && done.completed_time.is_some());
    assert!(phases.contains("Complete") && phases.len() >= 2, "phases seen: {phases:?}");
    let v1 =
        c.get(keys::cluster_prefix("eu", "c7"), Some(GetOptions::new().with_prefix().with_count_only())).await.unwrap();
    assert_eq!(v1.count(), 300);
    let table = kubectl(&apiserver, &["get", "registryschemas", "-n", NS]);
    assert!(table.contains("Complete") && table.contains("300"), "{table}");
}

#[tokio::test]
async fn a_second_legacy_prefix_migrated_into_the_same_region_is_refused_and_drains_nothing() {
    let (apiserver, etcd, dir, client, mut c) = registry_and_apiserver("schemas").await;
    // The same endpoints under two legacy prefixes, with different values: each maps to the
    // same v1 key, so draining both would lose one of the two values.
    for (prefix, zone) in [("/aether/services/", "z1"), ("/old-registry/", "z2")] {
        for i in 0..20 {
            let key = format!("{prefix}s/protocols/tcp/endpoints/10.2.0.{i}");
            c.put(key, format!(r#"{{"clusterName":"c7","zone":"{zone}"}}"#), None).await.unwrap();
        }
    }
    let _operator = start_operator(&apiserver, dir.path(), "operator-0", free_port());
    let schema = |name: &str, prefix: &str| {
        json!({
            "apiVersion": "federation.aether.dev/v1alpha1",
            "kind": "RegistrySchema",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"etcd": {"endpoints": [etcd.endpoint()]}, "region": "eu", "cluster": "dflt",
                     "legacyPrefix": prefix, "drain": {"quietPeriodSeconds": 1}},
        })
    };
    create_json(&client, NS, schema("registry", "/aether/services/")).await.unwrap();
    let api: Api<RegistrySchema> = Api::namespaced(client.clone(), NS);
    let phase = |rs: &RegistrySchema| rs.status.as_ref().and_then(|s| s.phase.clone()).unwrap_or_default();
    let first = poll_until(&api, "registry", |rs| phase(rs) == "Complete").await;
    assert_eq!(first.status.unwrap().counts.copied, 20);
    create_json(&client, NS, schema("old", "/old-registry/")).await.unwrap();
    let refused = poll_until(&api, "old", |rs| {
        rs.status.as_ref().is_some_and(|s| s.conditions.iter().any(|c| c.reason == "SchemaClaimed"))
    })
    .await;
    let ready = refused.status.unwrap().conditions.into_iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!(ready.status, "False");
    for said in [format!("{NS}/registry"), "/aether/services/".to_string(), "/old-registry/".to_string()] {
        assert!(ready.message.contains(&said), "{said:?} missing from {:?}", ready.message);
    }
    // Nothing of the second prefix was drained: its keys are all there, and the v1 keys still
    // hold the first prefix's values.
    let old = c.get("/old-registry/", Some(GetOptions::new().with_prefix().with_count_only())).await.unwrap();
    assert_eq!(old.count(), 20);
    let v1 = c.get(keys::cluster_prefix("eu", "c7"), Some(GetOptions::new().with_prefix())).await.unwrap();
    assert_eq!(v1.kvs().len(), 20);
    for kv in v1.kvs() {
        assert!(kv.value_str().unwrap().contains("z1"), "{}: {}", kv.key_str().unwrap(), kv.value_str().unwrap());
    }
}

/// Polls `name` until `f` holds.
async fn poll_until(api: &Api<RegistrySchema>, name: &str, f: impl Fn(&RegistrySchema) -> bool) -> RegistrySchema {
    tokio::time::timeout(WAIT, async {
        loop {
            if let Ok(rs) = api.get(name).await
                && f(&rs)
            {
                return rs;
            }
            tokio::time::sleep(Duration::from_millis(100)).await; // the poll's pace
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{name}: not reached in {WAIT:?}"))
}

/// The mirror's records on the peer but its owner record.
async fn bookkeeping(etcd: &EtcdServer, origin: &str) -> i64 {
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    let records = c.get(keys::federation_prefix(origin), Some(GetOptions::new().with_prefix())).await.unwrap();
    records.kvs().iter().filter(|kv| kv.key() != keys::owner_key(origin).as_bytes()).count() as i64
}

/// Whether the owner record is a retirement's tombstone, which stays: a deposed worker standing
/// by must never take a deleted mirror back.
async fn retired(etcd: &EtcdServer, origin: &str) -> bool {
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    let owner = c.get(keys::owner_key(origin), None).await.unwrap();
    owner.kvs().first().and_then(|kv| Owner::decode(kv.value())).is_some_and(|o| o.retired)
}

async fn wait_gone(api: &Api<RegionPeering>, name: &str) {
    wait_until(&format!("{name} deleted"), WAIT, || async { Ok(api.get_opt(name).await?.is_none()) }).await.unwrap();
}

#[tokio::test]
async fn deleting_a_region_peering_retires_its_mirror_under_each_policy() {
    let (apiserver, a, b, c) = tokio::try_join!(
        KubeApiserver::start("del"),
        EtcdServer::start("del-a"),
        EtcdServer::start("del-b"),
        EtcdServer::start("del-c")
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let client = prepare(&apiserver).await;
    put_endpoints(&a, "a", 50).await;
    let _operator = start_operator(&apiserver, dir.path(), "operator-del", free_port());
    let api: Api<RegionPeering> = Api::namespaced(client.clone(), NS);

    // Lapse (the default): the only RegionPeering goes; its mirror expires on every peer within
    // the TTL plus a keepalive interval, bookkeeping included.
    create_json(&client, NS, peering("a", "a", &a, &[("b", &b), ("c", &c)])).await.unwrap();
    wait_condition(&api, "a", "Ready", "True", None).await;
    assert_eq!((mirrored(&b, "a").await, mirrored(&c, "a").await), (50, 50));
    let deleted_at = std::time::Instant::now();
    api.delete("a", &DeleteParams::default()).await.unwrap();
    wait_gone(&api, "a").await;
    eprintln!("Lapse: the RegionPeering was gone {:?} after the delete", deleted_at.elapsed());
    let lapse_bound = Duration::from_secs(6 + 2 + 3); // TTL + keepalive interval + scheduling slack
    let left = || async {
        [mirrored(&b, "a").await, mirrored(&c, "a").await, bookkeeping(&b, "a").await, bookkeeping(&c, "a").await]
    };
    let lapsed =
        wait_until("the mirror lapses on every peer", lapse_bound, || async { Ok(left().await == [0; 4]) }).await;
    assert!(lapsed.is_ok(), "{lapsed:?}: left on b and c (keys, keys, records, records): {:?}", left().await);
    assert!(retired(&b, "a").await && retired(&c, "a").await, "the owner records are tombstones");
    eprintln!("Lapse: the mirror was gone from both peers {:?} after the delete", deleted_at.elapsed());

    // Delete: gone from every peer at once, long before a 30 s TTL could lapse.
    let mut object = peering("a2", "a", &a, &[("b", &b), ("c", &c)]);
    object["spec"]["lease"] = json!({"ttlSeconds": 30, "keepaliveIntervalSeconds": 10});
    object["spec"]["failureDetector"] = json!({}); // the default pause: twice the interval
    object["spec"]["deletionPolicy"] = json!("Delete");
    create_json(&client, NS, object).await.unwrap();
    wait_condition(&api, "a2", "Ready", "True", None).await;
    let deleted_at = std::time::Instant::now();
    api.delete("a2", &DeleteParams::default()).await.unwrap();
    wait_gone(&api, "a2").await;
    assert_eq!((mirrored(&b, "a").await, mirrored(&c, "a").await), (0, 0), "deleted with the object");
    assert_eq!((bookkeeping(&b, "a").await, bookkeeping(&c, "a").await), (0, 0));
    assert!(retired(&b, "a").await && retired(&c, "a").await, "the owner records are tombstones");
    assert!(deleted_at.elapsed() < Duration::from_secs(30));

    // A peer that cannot be reached does not block the deletion; an Event says what remains.
    let mut object = peering("a3", "a", &a, &[("b", &b)]);
    object["spec"]["peers"] =
        json!([{"region": "b", "endpoints": [b.endpoint()]}, {"region": "gone", "endpoints": ["http://127.0.0.1:1"]}]);
    create_json(&client, NS, object).await.unwrap();
    wait_until("a3 mirrors into b", WAIT, || async { Ok(mirrored(&b, "a").await == 50) }).await.unwrap();
    api.delete("a3", &DeleteParams::default()).await.unwrap();
    wait_gone(&api, "a3").await;
    let mut events = String::new();
    let seen = wait_until("RetireFailed event", WAIT, || {
        events = kubectl(&apiserver, &["get", "events", "-n", NS, "-o", "custom-columns=REASON:.reason,NOTE:.message"]);
        let found = events.lines().any(|l| l.contains("RetireFailed") && l.contains("a -> gone"));
        async move { Ok(found) }
    })
    .await;
    assert!(seen.is_ok(), "no RetireFailed event in\n{events}");
}

#[tokio::test]
async fn deleting_a_refused_duplicate_leaves_the_live_region_alone() {
    let (apiserver, a, b) =
        tokio::try_join!(KubeApiserver::start("dup"), EtcdServer::start("dup-a"), EtcdServer::start("dup-b")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let client = prepare(&apiserver).await;
    put_endpoints(&a, "a", 120).await;
    let _operator = start_operator(&apiserver, dir.path(), "operator-dup", free_port());
    let api: Api<RegionPeering> = Api::namespaced(client.clone(), NS);
    create_json(&client, NS, peering("a", "a", &a, &[("b", &b)])).await.unwrap();
    wait_condition(&api, "a", "Ready", "True", None).await;
    assert_eq!(mirrored(&b, "a").await, 120);

    // A second RegionPeering for region a on the same etcds, set to delete its mirror when it
    // goes: refused, then deleted by the user.
    let mut duplicate = peering("a-duplicate", "a", &a, &[("b", &b)]);
    duplicate["spec"]["deletionPolicy"] = json!("Delete");
    create_json(&client, NS, duplicate).await.unwrap();
    wait_condition(&api, "a-duplicate", "Conflict", "True", Some("RegionClaimed")).await;
    api.delete("a-duplicate", &DeleteParams::default()).await.unwrap();
    wait_gone(&api, "a-duplicate").await;
    assert_eq!(mirrored(&b, "a").await, 120, "deleting the refused duplicate deleted the live region's mirror");
    assert!(!retired(&b, "a").await, "the live owner's record was retired");

    // Three TTLs later region a still mirrors, writes still arrive, and it is Ready.
    tokio::time::sleep(Duration::from_secs(3 * 6)).await; // the observation window
    put_endpoints(&a, "a", 121).await;
    wait_until("a write after the deletion reaches b", WAIT, || async { Ok(mirrored(&b, "a").await == 121) })
        .await
        .unwrap();
    let rp = wait_condition(&api, "a", "Ready", "True", None).await;
    assert_eq!(rp.status.unwrap().peers[0].phase, "Watching");
}

#[tokio::test]
async fn status_is_applied_server_side_at_most_once_per_refresh_under_load() {
    let (apiserver, a, b) =
        tokio::try_join!(KubeApiserver::start("ssa"), EtcdServer::start("ssa-a"), EtcdServer::start("ssa-b")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let client = prepare(&apiserver).await;
    put_endpoints(&a, "a", 20).await;
    let metrics_port = free_port();
    let _operator = start_operator(&apiserver, dir.path(), "operator-ssa", metrics_port);
    let api: Api<RegionPeering> = Api::namespaced(client.clone(), NS);

    // The user applies the spec server-side, as GitOps tools do; re-applying never conflicts
    // with the operator's status writes.
    let manifest = dir.path().join("a.json");
    std::fs::write(&manifest, peering("a", "a", &a, &[("b", &b)]).to_string()).unwrap();
    let path = manifest.to_str().unwrap();
    kubectl(&apiserver, &["apply", "--server-side", "--field-manager", "gitops", "-f", path]);
    wait_condition(&api, "a", "Ready", "True", None).await;
    kubectl(&apiserver, &["apply", "--server-side", "--field-manager", "gitops", "-f", path]);
    let rp = api.get("a").await.unwrap();
    let managers: Vec<(String, String)> = rp
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .map(|m| (m.manager.unwrap_or_default(), m.subresource.unwrap_or_default()))
        .collect();
    assert!(managers.contains(&("aether-operator".into(), "status".into())), "{managers:?}");

    // 1,000 origin writes a second for 10 s, an inbound mirror too: patches stay at one per
    // refresh interval (1 s here) at most.
    let patches = |text: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with("aether_federation_status_patches_total{region=\"a\"}"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    let before = patches(&scrape_metrics(metrics_port).await);
    let started = std::time::Instant::now();
    let mut c = Client::connect([a.endpoint()], None).await.unwrap();
    let mut i = 0usize;
    while started.elapsed() < Duration::from_secs(10) {
        let tick = std::time::Instant::now();
        let ops: Vec<TxnOp> = (0..100)
            .map(|j| {
                let key = format!(
                    "{}clusters/c1/services/load/protocols/tcp/endpoints/10.2.{}.{}",
                    keys::region_prefix("a"),
                    (i / 250) % 250,
                    i % 250
                );
                i += 1;
                TxnOp::put(key, format!("{{\"n\":{j}}}"), None)
            })
            .collect();
        c.txn(Txn::new().and_then(ops)).await.unwrap();
        if let Some(rest) = Duration::from_millis(100).checked_sub(tick.elapsed()) {
            tokio::time::sleep(rest).await; // pacing the load at 1,000 writes/s
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let after = patches(&scrape_metrics(metrics_port).await);
    let rate = (after - before) / elapsed;
    eprintln!("{} status patches in {elapsed:.1}s under 1,000 writes/s: {rate:.2}/s", after - before);
    assert!(after - before <= elapsed.ceil() + 2.0, "{} patches in {elapsed:.1}s", after - before);

    // Fields that no longer apply are removed: suspended, there is no lag to show.
    api.patch("a", &PatchParams::default(), &Patch::Merge(json!({"spec": {"suspend": true}}))).await.unwrap();
    wait_condition(&api, "a", "Suspended", "True", None).await;
    let rp = api.get("a").await.unwrap();
    let status = rp.status.unwrap();
    assert_eq!(status.worst_lag, None, "no stale lag after suspend");
    assert!(status.peers.iter().all(|p| p.replication.lag_seconds.is_none()), "{:?}", status.peers);
}

#[tokio::test]
async fn two_namespaces_run_side_by_side_and_see_each_others_claims() {
    let (apiserver, a, b, c) = tokio::try_join!(
        KubeApiserver::start("ns2"),
        EtcdServer::start("ns2-a"),
        EtcdServer::start("ns2-b"),
        EtcdServer::start("ns2-c")
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let client = prepare(&apiserver).await;
    ensure_namespace(&client, "fed2").await.unwrap();
    put_endpoints(&a, "a", 10).await;
    put_endpoints(&b, "b", 10).await;
    let _operator = start_operator_in(&apiserver, dir.path(), "operator-ns", free_port(), &format!("{NS},fed2"));
    let api1: Api<RegionPeering> = Api::namespaced(client.clone(), NS);
    let api2: Api<RegionPeering> = Api::namespaced(client.clone(), "fed2");
    create_json(&client, NS, peering("a", "a", &a, &[("c", &c)])).await.unwrap();
    let mut in_fed2 = peering("b", "b", &b, &[("c", &c)]);
    in_fed2["metadata"]["namespace"] = json!("fed2");
    create_json(&client, "fed2", in_fed2).await.unwrap();
    let first_a = wait_condition(&api1, "a", "Ready", "True", None).await;
    let first_b = wait_condition(&api2, "b", "Ready", "True", None).await;
    assert_eq!((mirrored(&c, "a").await, mirrored(&c, "b").await), (10, 10));

    // Neither controller sweeps the other namespace's workers: Ready never flaps.
    let since = |rp: &RegionPeering| {
        rp.status.as_ref().unwrap().conditions.iter().find(|c| c.type_ == "Ready").unwrap().last_transition_time.clone()
    };
    tokio::time::sleep(Duration::from_secs(8)).await; // an observation window of several refreshes
    assert_eq!(since(&api1.get("a").await.unwrap()), since(&first_a));
    assert_eq!(since(&api2.get("b").await.unwrap()), since(&first_b));

    // A claim on region a's etcd in the other namespace is a conflict, even under another URL
    // (the same etcd, reached through a proxy): claims compare cluster ids.
    let other_url = aether_harness::FaultProxy::start(a.client_addr()).await.unwrap();
    let mut dup = peering("a-dup", "a", &a, &[("c", &c)]);
    dup["metadata"]["namespace"] = json!("fed2");
    dup["spec"]["localEtcd"]["endpoints"] = json!([other_url.endpoint("http")]);
    create_json(&client, "fed2", dup).await.unwrap();
    wait_condition(&api2, "a-dup", "Conflict", "True", Some("RegionClaimed")).await;
}

async fn leader_gauge(port: u16) -> Option<f64> {
    gauge(port, "aether_federation_leader").await
}

#[tokio::test]
async fn a_paused_leader_stands_down_and_none_of_its_writes_land_after_the_successor() {
    let (apiserver, a, b) =
        tokio::try_join!(KubeApiserver::start("pause"), EtcdServer::start("pause-a"), EtcdServer::start("pause-b"))
            .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let client = prepare(&apiserver).await;
    put_endpoints(&a, "a", 30).await;
    let ports = [free_port(), free_port()];
    let operators = [
        start_operator(&apiserver, dir.path(), "operator-p0", ports[0]),
        start_operator(&apiserver, dir.path(), "operator-p1", ports[1]),
    ];
    let api: Api<RegionPeering> = Api::namespaced(client.clone(), NS);
    create_json(&client, NS, peering("a", "a", &a, &[("b", &b)])).await.unwrap();
    let rp = wait_condition(&api, "a", "Ready", "True", None).await;
    let old = rp.status.unwrap().leader.unwrap();
    let (old_i, new_i) = if old == "operator-p0" { (0, 1) } else { (1, 0) };
    let new = format!("operator-p{new_i}");

    // Every owner that writes progress on the peer, in order.
    let mut peer = Client::connect([b.endpoint()], None).await.unwrap();
    let mut watch =
        peer.watch(keys::progress_key("a"), Some(etcd_client::WatchOptions::new().with_prev_key())).await.unwrap();
    let owners = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let seen = owners.clone();
    tokio::spawn(async move {
        while let Ok(Some(resp)) = watch.message().await {
            for e in resp.events() {
                if let Some(kv) = e.kv() {
                    let v: serde_json::Value = serde_json::from_slice(kv.value()).unwrap_or_default();
                    seen.lock().unwrap().push(v["owner"].as_str().unwrap_or_default().to_string());
                }
            }
        }
    });

    // The leader freezes past the lease duration (8 s) while the origin keeps changing.
    let pid = operators[old_i].pid().unwrap();
    Command::new("kill").args(["-STOP", &pid.to_string()]).status().unwrap();
    let mut origin = Client::connect([a.endpoint()], None).await.unwrap();
    let paused = std::time::Instant::now();
    let mut n = 0;
    while paused.elapsed() < Duration::from_secs(12) {
        let key =
            format!("{}clusters/c1/services/p/protocols/tcp/endpoints/10.3.0.{}", keys::region_prefix("a"), n % 250);
        origin.put(key, format!("{{\"n\":{n}}}"), None).await.unwrap();
        n += 1;
        tokio::time::sleep(Duration::from_millis(200)).await; // the registrar's pace
    }
    wait_until("the standby took over", WAIT, || {
        let (api, new) = (api.clone(), new.clone());
        async move { Ok(api.get("a").await?.status.and_then(|s| s.leader).as_deref() == Some(new.as_str())) }
    })
    .await
    .unwrap();
    Command::new("kill").args(["-CONT", &pid.to_string()]).status().unwrap();

    // The old leader stands down and stays a standby.
    wait_until("the old leader stands down", WAIT, || async { Ok(leader_gauge(ports[old_i]).await == Some(0.0)) })
        .await
        .unwrap();
    let more = format!("{}clusters/c1/services/p/protocols/tcp/endpoints/10.3.1.1", keys::region_prefix("a"));
    origin.put(more, "{}", None).await.unwrap();
    let total = origin
        .get(keys::region_prefix("a"), Some(GetOptions::new().with_prefix().with_count_only()))
        .await
        .unwrap()
        .count();
    wait_until("the successor mirrors everything", WAIT, || async { Ok(mirrored(&b, "a").await == total) })
        .await
        .unwrap();
    assert_eq!(leader_gauge(ports[new_i]).await, Some(1.0));
    // The successor ran the worker on the configuration the status recorded, without trying it
    // first: a trial's round trips sooner, its leases renewed.
    let log = std::fs::read_to_string(dir.path().join(format!("{new}.log"))).unwrap();
    assert!(log.contains("mirror worker started"), "the successor's log:\n{log}");
    assert!(
        !log.contains("trying the peer's configuration"),
        "the successor tried a configuration its predecessor ran on:\n{log}"
    );
    let recorded = api.get("a").await.unwrap().status.unwrap().peers[0].configuration.clone();
    assert!(recorded.is_some_and(|c| c.len() == 16), "the status records the worker's configuration");
    let owners = owners.lock().unwrap().clone();
    let first_new = owners.iter().position(|o| o.starts_with(&format!("{new}/"))).expect("the successor wrote");
    assert!(
        owners[first_new..].iter().all(|o| o.starts_with(&format!("{new}/"))),
        "a write of the old leader landed after the successor's first: {owners:?}"
    );
    let _ = peer.status().await;
}

#[tokio::test]
async fn a_leader_cut_off_from_the_api_server_keeps_the_copy_alive_and_leads_again_over_the_same_workers() {
    let (apiserver, a, b) =
        tokio::try_join!(KubeApiserver::start("cut"), EtcdServer::start("cut-a"), EtcdServer::start("cut-b")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let client = prepare(&apiserver).await;
    put_endpoints(&a, "a", 10).await;
    let api_addr: std::net::SocketAddr = apiserver.url().trim_start_matches("https://").parse().unwrap();
    let proxy = aether_harness::FaultProxy::start(api_addr).await.unwrap();
    let port = free_port();
    // The only operator: it leads, and then loses the API server (not its etcds).
    let _operator = start_operator_via(&apiserver, dir.path(), "operator-cut", port, NS, Some(proxy.addr()));
    let api: Api<RegionPeering> = Api::namespaced(client.clone(), NS);
    create_json(&client, NS, peering("a", "a", &a, &[("b", &b)])).await.unwrap();
    wait_condition(&api, "a", "Ready", "True", None).await;
    assert_eq!(leader_gauge(port).await, Some(1.0));
    let peer = Client::connect([b.endpoint()], None).await.unwrap();
    let deletes = support::etcd::count_peer_deletes(&peer, "a").await;

    proxy.set_blackhole(true);
    let cut = std::time::Instant::now();
    // Three TTLs (6 s) without the API server: the copy stays whole at every read, and new
    // endpoints still reach the peer. The lease lasts 8 s from its last renewal: the controllers
    // stop before then (the leader gauge drops), the workers do not (the headless gauge rises).
    let mut headless_after = None;
    let mut origin = Client::connect([a.endpoint()], None).await.unwrap();
    let (mut expected, mut reads) = (10, 0);
    while cut.elapsed() < Duration::from_secs(18) {
        let seen = mirrored(&b, "a").await;
        assert!(seen >= expected, "{} of a's {expected} keys on b without the API server", seen);
        reads += 1;
        if headless_after.is_none()
            && leader_gauge(port).await == Some(0.0)
            && gauge(port, "aether_federation_leader_headless").await == Some(1.0)
        {
            headless_after = Some(cut.elapsed());
        }
        if expected == 10 && cut.elapsed() > Duration::from_secs(10) {
            let key = format!("{}clusters/c1/services/late/protocols/tcp/endpoints/10.9.0.1", keys::region_prefix("a"));
            origin.put(key, "{}", None).await.unwrap();
            expected = 11;
            wait_until("written without the API server, mirrored", WAIT, || async {
                Ok(mirrored(&b, "a").await == 11)
            })
            .await
            .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(reads > 20, "{reads} reads");
    let headless_after = headless_after.expect("the leader never said it went headless");
    assert!(headless_after < Duration::from_secs(8), "headless only {headless_after:?} after the cut");
    assert_eq!(deletes.load(std::sync::atomic::Ordering::SeqCst), 0, "keys of a were deleted on b");

    // The API server is back: the same instance leads again, over the same worker (no resync,
    // the same session's counters), and status catches up.
    proxy.set_blackhole(false);
    proxy.reset_connections();
    wait_until("it leads again", WAIT, || async { Ok(leader_gauge(port).await == Some(1.0)) }).await.unwrap();
    assert_eq!(gauge(port, "aether_federation_leader_headless").await, Some(0.0));
    let back = std::time::SystemTime::now() - Duration::from_secs(1);
    wait_until("status written again", WAIT, || {
        let api = api.clone();
        async move {
            let refreshed = api.get("a").await?.status.and_then(|s| s.refreshed_time);
            Ok(refreshed.is_some_and(|t| std::time::SystemTime::from(t.0) >= back))
        }
    })
    .await
    .unwrap();
    let rp = wait_condition(&api, "a", "Ready", "True", None).await;
    let status = rp.status.unwrap();
    let b_status = status.peers.iter().find(|p| p.region == "b").unwrap();
    assert_eq!((b_status.replication.keys, b_status.replication.resyncs), (11, 0), "{b_status:?}");
    assert_eq!(mirrored(&b, "a").await, 11);
}

#[tokio::test]
async fn deleting_a_registry_schema_mid_drain_stops_it_and_releases_the_prefix() {
    let (apiserver, etcd, dir, client, mut c) = registry_and_apiserver("schema-del").await;
    let ops: Vec<TxnOp> = (0..2000)
        .map(|i| {
            TxnOp::put(
                format!("/aether/services/s{}/protocols/tcp/endpoints/10.3.{}.{}", i % 7, i / 200, i % 200),
                r#"{"clusterName":"c7"}"#,
                None,
            )
        })
        .collect();
    for chunk in ops.chunks(100) {
        c.txn(Txn::new().and_then(chunk.to_vec())).await.unwrap();
    }
    let _operator = start_operator(&apiserver, dir.path(), "operator-0", free_port());
    // Slow on purpose (100 keys a second), so that it is deleted mid-copy.
    let schema = json!({
        "apiVersion": "federation.aether.dev/v1alpha1",
        "kind": "RegistrySchema",
        "metadata": {"name": "registry", "namespace": NS},
        "spec": {"etcd": {"endpoints": [etcd.endpoint()]}, "region": "eu", "cluster": "dflt",
                 "drain": {"quietPeriodSeconds": 1, "rateLimitPerSecond": 100}},
    });
    create_json(&client, NS, schema).await.unwrap();
    let api: Api<RegistrySchema> = Api::namespaced(client.clone(), NS);
    wait_until("the drain copies", WAIT, || {
        let api = api.clone();
        async move { Ok(api.get("registry").await?.status.is_some_and(|s| s.counts.copied > 0)) }
    })
    .await
    .unwrap();
    let lock = keys::drain_lock_key("/aether/services/");
    assert_eq!(c.get(lock.as_str(), None).await.unwrap().count(), 1, "the running drain holds the prefix");

    api.delete("registry", &DeleteParams::default()).await.unwrap();
    wait_until("the RegistrySchema is gone", WAIT, || {
        let api = api.clone();
        async move { Ok(api.get_opt("registry").await?.is_none()) }
    })
    .await
    .unwrap();
    // Stopped at a safe point: the prefix is free at once (not after the lock's lease), and
    // nothing is written any more.
    assert_eq!(c.get(lock.as_str(), None).await.unwrap().count(), 0, "the prefix's lock is released");
    let v1 = || async {
        let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
        c.get(keys::cluster_prefix("eu", "c7"), Some(GetOptions::new().with_prefix().with_count_only()))
            .await
            .unwrap()
            .count()
    };
    let copied = v1().await;
    assert!(copied < 2000, "deleted mid-copy: {copied} of 2000 copied");
    tokio::time::sleep(Duration::from_secs(3)).await; // a window in which a running drain would copy 300 more
    assert_eq!(v1().await, copied, "the drain stopped");
    let record = c.get(keys::drain_record_key("/aether/services/"), None).await.unwrap();
    assert_eq!(record.count(), 1, "its progress is recorded for a later RegistrySchema to resume from");
}

/// How many times the operator's tasks of kind `task` panicked, from its metrics.
async fn panics(port: u16, task: &str) -> u64 {
    let line = format!("aether_federation_task_panics_total{{task=\"{task}\"}} ");
    scrape_metrics(port).await.lines().find_map(|l| l.strip_prefix(&line)?.parse().ok()).unwrap_or(0)
}

/// `/healthz`'s status code and body (0 while it does not answer).
async fn healthz(port: u16) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else { return (0, String::new()) };
    let mut answer = String::new();
    if s.write_all(b"GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n").await.is_err()
        || s.read_to_string(&mut answer).await.is_err()
    {
        return (0, String::new());
    }
    let code = answer.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, answer.rsplit("\r\n\r\n").next().unwrap_or_default().to_string())
}

#[tokio::test]
async fn a_keeper_or_controller_that_panics_runs_again_and_one_that_keeps_panicking_fails_the_health_checks() {
    let (apiserver, a, b) =
        tokio::try_join!(KubeApiserver::start("panics"), EtcdServer::start("panics-a"), EtcdServer::start("panics-b"))
            .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let client = prepare(&apiserver).await;
    put_endpoints(&a, "a", 10).await;
    let port = free_port();
    // The reconciler panics twice, the keeper at its first renewal round: a keeper that died
    // would let the copy on b lapse one TTL (6 s) later while the leader looks alive.
    let mut operator =
        start_operator_with_faults(&apiserver, dir.path(), "operator-panics", port, "controller=2,keeper=1");
    let api: Api<RegionPeering> = Api::namespaced(client.clone(), NS);
    create_json(&client, NS, peering("a", "a", &a, &[("b", &b)])).await.unwrap();
    wait_condition(&api, "a", "Ready", "True", None).await;
    let peer = Client::connect([b.endpoint()], None).await.unwrap();
    let deletes = support::etcd::count_peer_deletes(&peer, "a").await;
    let watched = std::time::Instant::now();
    let mut reads = 0;
    while watched.elapsed() < Duration::from_secs(18) {
        assert_eq!(mirrored(&b, "a").await, 10, "a's copy on b after a panic");
        reads += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(reads > 20, "{reads} reads");
    assert_eq!(deletes.load(std::sync::atomic::Ordering::SeqCst), 0, "keys of a were deleted on b");
    assert_eq!((panics(port, "keeper").await, panics(port, "controller").await), (1, 2));
    assert_eq!(healthz(port).await.0, 200, "a few panics are tolerated");
    operator.terminate();

    // A reconciler that panics every time: the health checks fail, naming it, so that the kubelet
    // restarts the process (and a standby leads) rather than keeping a leader that does nothing.
    let port = free_port();
    let _operator = start_operator_with_faults(&apiserver, dir.path(), "operator-loops", port, "controller=always");
    wait_until("the health checks fail", WAIT, || async { Ok(healthz(port).await.0 == 503) }).await.unwrap();
    let (_, why) = healthz(port).await;
    assert!(why.contains("the controller task panicked"), "{why}");
    assert!(panics(port, "controller").await > 5);
}

#[tokio::test]
async fn a_report_holds_the_objects_their_events_and_the_operators_pods_and_no_secret() {
    let (apiserver, a) = tokio::try_join!(KubeApiserver::start("report"), EtcdServer::start("report-a")).unwrap();
    let client = prepare(&apiserver).await;
    // A Secret the RegionPeering names, and an operator pod whose environment carries a credential.
    kubectl(&apiserver, &["-n", NS, "create", "secret", "generic", "peer-b", "--from-literal=password=s3cr3t-value"]);
    let mut rp = peering("a", "a", &a, &[]);
    rp["spec"]["peers"] =
        json!([{"region": "b", "endpoints": ["https://127.0.0.1:1"], "tls": {"secretRef": {"name": "peer-b"}}}]);
    create_json(&client, NS, rp).await.unwrap();
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "aether-operator-0", "namespace": "aether-system", "labels": {"app.kubernetes.io/name": "aether-operator"}},
        "spec": {"serviceAccountName": "aether-operator", "automountServiceAccountToken": false,
                 "containers": [{"name": "operator", "image": "aether-operator:test",
                                 "env": [{"name": "ETCD_PASSWORD", "value": "hunter2"}]}]},
    });
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), "aether-system");
    pods.create(&PostParams::default(), &serde_json::from_value(pod).unwrap()).await.unwrap();

    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report");
    let out = Command::new(env!("CARGO_BIN_EXE_aether-operator"))
        .args(["report", "--kubeconfig"])
        .arg(apiserver.kubeconfig())
        .arg("--directory")
        .arg(&report)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let read = |path: &str| std::fs::read_to_string(report.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
    assert!(read("local/regionpeerings.yaml").contains("secretRef"), "the object as it stands");
    let pods = read("local/operator/pods.yaml");
    assert!(pods.contains("ETCD_PASSWORD") && pods.contains("<redacted>") && !pods.contains("hunter2"), "{pods}");
    assert!(read("local/status.txt").contains("region a"), "{}", read("local/status.txt"));
    // What could not be read is said, not fatal: here, no leader Lease.
    assert!(report.join("local/operator/logs/aether-operator-0.operator.log").exists(), "each operator pod's log");
    let errors = read("local/errors.txt");
    assert!(errors.contains("the Lease aether-system/aether-operator-leader: leases.coordination.k8s.io"), "{errors}");
    // No Secret's value anywhere in the report, plain or base64.
    let mut files = vec![report.clone()];
    while let Some(path) = files.pop() {
        if path.is_dir() {
            files.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
        } else {
            let text = std::fs::read_to_string(&path).unwrap();
            assert!(!text.contains("s3cr3t-value") && !text.contains("czNjcjN0LXZhbHVl"), "{}", path.display());
        }
    }
    // A report never overwrites one.
    let again = Command::new(env!("CARGO_BIN_EXE_aether-operator"))
        .args(["report", "--kubeconfig"])
        .arg(apiserver.kubeconfig())
        .arg("--directory")
        .arg(&report)
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(2));
}

#[tokio::test]
async fn version_says_whether_the_crds_and_the_leading_operator_are_this_clients() {
    let apiserver = KubeApiserver::start("version").await.unwrap();
    let client = prepare(&apiserver).await;
    let version = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_aether-operator"))
            .arg("version")
            .args(args)
            .arg("--kubeconfig")
            .arg(apiserver.kubeconfig())
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).to_string())
    };
    // No operator yet: the CRDs are this client's, and nobody leads.
    let (code, out) = version(&[]);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("CRD regionpeerings.federation.aether.dev: as this client's") && out.contains("no operator holds"),
        "{out}"
    );
    // An operator of the previous release leads.
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "aether-operator-0", "namespace": "aether-system", "labels": {"app.kubernetes.io/version": "0.2.0"}},
        "spec": {"serviceAccountName": "aether-operator", "automountServiceAccountToken": false,
                 "containers": [{"name": "operator", "image": "ghcr.io/aether/aether-operator:0.2.0"}]},
    });
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), "aether-system");
    pods.create(&PostParams::default(), &serde_json::from_value(pod).unwrap()).await.unwrap();
    let lease = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                       "metadata": {"name": "aether-operator-leader", "namespace": "aether-system"},
                       "spec": {"holderIdentity": "aether-operator-0"}});
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(client.clone(), "aether-system");
    leases.create(&PostParams::default(), &serde_json::from_value(lease).unwrap()).await.unwrap();
    let (code, out) = version(&[]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("operator 0.2.0 (aether-operator-0): differs"), "{out}");
    let (code, out) = version(&["--client"]);
    assert_eq!((code, out.trim()), (Some(0), format!("client: {}", env!("CARGO_PKG_VERSION")).as_str()));
}

#[test]
fn the_bash_completion_completes_the_commands() {
    let script = Command::new(env!("CARGO_BIN_EXE_aether-operator")).args(["completion", "bash"]).output().unwrap();
    assert!(script.status.success());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("aether-operator.bash");
    std::fs::write(&path, &script.stdout).unwrap();
    // What bash does on `aether-operator st<TAB>` and `aether-operator <TAB>`.
    let complete = |word: &str| {
        let program = format!(
            "source {}; COMP_WORDS=(aether-operator '{word}'); COMP_CWORD=1; COMP_LINE='aether-operator {word}'; \
             COMP_POINT=${{#COMP_LINE}}; _aether__operator aether-operator '{word}' aether-operator; echo \"${{COMPREPLY[@]}}\"",
            path.display()
        );
        let out = Command::new("bash").args(["-c", &program]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert_eq!(complete("st"), "status");
    let all = complete("");
    for command in ["status", "doctor", "report", "version", "completion"] {
        assert!(all.split_whitespace().any(|c| c == command), "{command} in {all:?}");
    }
}
