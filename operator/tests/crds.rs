//! The CRDs against a real kube-apiserver: generation drift, installation, validation and the
//! printer columns users read.
mod support;

use aether_harness::KubeApiserver;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use support::*;

#[test]
fn committed_crds_match_the_rust_types() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds");
    for (name, generated) in aether_operator::api::crd_files() {
        let committed = std::fs::read_to_string(dir.join(&name)).unwrap_or_default();
        assert!(
            committed == generated,
            "crds/{name} is out of date with operator/src/api: run `make crds` and commit the result"
        );
    }
}

fn peering(spec: serde_json::Value) -> serde_json::Value {
    json!({
        "apiVersion": "federation.aether.dev/v1alpha1",
        "kind": "RegionPeering",
        "metadata": {"generateName": "bad-"},
        "spec": spec,
    })
}

fn valid_spec() -> serde_json::Value {
    json!({
        "region": "eu-west",
        "localEtcd": {"endpoints": ["http://127.0.0.1:2379"]},
        "peers": [{"region": "us-east", "endpoints": ["https://10.0.0.1:2379"]}],
    })
}

fn with(mut spec: serde_json::Value, path: &[&str], value: serde_json::Value) -> serde_json::Value {
    let mut node = &mut spec;
    for (i, segment) in path.iter().enumerate() {
        if i + 1 == path.len() {
            node[*segment] = value.clone();
        } else {
            node = &mut node[*segment];
        }
    }
    spec
}

#[tokio::test]
async fn crds_install_validate_and_print() -> anyhow::Result<()> {
    let apiserver = KubeApiserver::start("crds").await?;
    let client = apiserver.client().await?;
    install_crds(&client).await?;
    ensure_namespace(&client, "aether-system").await?;

    // Every sample is accepted.
    for (file, doc) in yaml_documents("config/samples") {
        create_json(&client, "aether-system", doc).await.unwrap_or_else(|e| panic!("sample {file} rejected: {e}"));
    }

    // Each invalid object is rejected with a message naming the field.
    let invalid: Vec<(&str, serde_json::Value, &str)> = vec![
        ("region not a DNS label", with(valid_spec(), &["region"], json!("EU_West")), "spec.region"),
        ("region too long", with(valid_spec(), &["region"], json!("a".repeat(64))), "spec.region"),
        (
            "peer is the own region",
            with(valid_spec(), &["peers"], json!([{"region": "eu-west", "endpoints": ["http://x:1"]}])),
            "spec.peers",
        ),
        (
            "duplicate peers",
            with(
                valid_spec(),
                &["peers"],
                json!([{"region": "b", "endpoints": ["http://x:1"]}, {"region": "b", "endpoints": ["http://y:1"]}]),
            ),
            "spec.peers[1]",
        ),
        (
            "a peer that is the local etcd spelled with a trailing slash",
            with(valid_spec(), &["peers"], json!([{"region": "b", "endpoints": ["http://127.0.0.1:2379/"]}])),
            "spec.peers",
        ),
        (
            "peer name not a DNS label",
            with(valid_spec(), &["peers"], json!([{"region": "-b", "endpoints": ["http://x:1"]}])),
            "spec.peers[0].region",
        ),
        ("no local endpoints", with(valid_spec(), &["localEtcd", "endpoints"], json!([])), "spec.localEtcd.endpoints"),
        (
            "endpoint without scheme",
            with(valid_spec(), &["localEtcd", "endpoints"], json!(["127.0.0.1:2379"])),
            "spec.localEtcd.endpoints[0]",
        ),
        (
            "peer endpoint without scheme",
            with(valid_spec(), &["peers"], json!([{"region": "b", "endpoints": ["etcd:2379"]}])),
            "spec.peers[0].endpoints[0]",
        ),
        (
            "peer without endpoints",
            with(valid_spec(), &["peers"], json!([{"region": "b", "endpoints": []}])),
            "spec.peers[0].endpoints",
        ),
        (
            "TTL too short",
            with(valid_spec(), &["lease"], json!({"ttlSeconds": 2, "keepaliveIntervalSeconds": 1})),
            "spec.lease.ttlSeconds",
        ),
        (
            "TTL too long",
            with(valid_spec(), &["lease"], json!({"ttlSeconds": 7200, "keepaliveIntervalSeconds": 10})),
            "spec.lease.ttlSeconds",
        ),
        (
            "keepalive not shorter than TTL",
            with(valid_spec(), &["lease"], json!({"ttlSeconds": 10, "keepaliveIntervalSeconds": 10})),
            "spec.lease.keepaliveIntervalSeconds",
        ),
        (
            "too few keys per lease",
            with(valid_spec(), &["lease"], json!({"maxKeysPerLease": 5})),
            "spec.lease.maxKeysPerLease",
        ),
        ("missing region", json!({"localEtcd": {"endpoints": ["http://a:1"]}}), "spec.region"),
        (
            "zero acceptable pause",
            with(valid_spec(), &["failureDetector"], json!({"acceptablePauseSeconds": 0})),
            "spec.failureDetector.acceptablePauseSeconds",
        ),
        (
            "acceptable pause not shorter than the TTL",
            with(valid_spec(), &["failureDetector"], json!({"acceptablePauseSeconds": 30})),
            "spec.failureDetector.acceptablePauseSeconds",
        ),
        (
            "acceptable pause not longer than the keepalive interval",
            with(valid_spec(), &["failureDetector"], json!({"acceptablePauseSeconds": 10})),
            "spec.failureDetector.acceptablePauseSeconds",
        ),
        (
            "keepalive more than a third of the TTL",
            with(valid_spec(), &["lease"], json!({"ttlSeconds": 10, "keepaliveIntervalSeconds": 4})),
            "spec.lease.keepaliveIntervalSeconds",
        ),
        (
            "a peer that is the local etcd",
            with(valid_spec(), &["peers"], json!([{"region": "b", "endpoints": ["http://127.0.0.1:2379"]}])),
            "spec.peers",
        ),
    ];
    assert!(invalid.len() >= 10);
    for (what, spec, field) in invalid {
        match create_json(&client, "aether-system", peering(spec)).await {
            Ok(_) => panic!("{what}: accepted, expected a rejection naming {field}"),
            Err(message) => assert!(message.contains(field), "{what}: message {message:?} does not name {field}"),
        }
    }

    // RegistrySchema: the legacy prefix can be neither the root nor inside the v1 layout.
    for (prefix, needle) in [("/", "spec.legacyPrefix"), ("/aether/v1/regions/", "spec.legacyPrefix")] {
        let schema = json!({
            "apiVersion": "federation.aether.dev/v1alpha1",
            "kind": "RegistrySchema",
            "metadata": {"generateName": "bad-"},
            "spec": {"etcd": {"endpoints": ["http://127.0.0.1:2379"]}, "region": "eu", "cluster": "c", "legacyPrefix": prefix},
        });
        match create_json(&client, "aether-system", schema).await {
            Ok(_) => panic!("legacyPrefix {prefix} accepted"),
            Err(message) => assert!(message.contains(needle), "{prefix}: {message}"),
        }
    }

    // `kubectl explain` says what the kind is, in sentences.
    let output = apiserver.kubectl()?.args(["explain", "regionpeering"]).output()?;
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("The federation topology of one region"), "{text}");
    assert!(!text.contains("Auto-generated derived type"), "{text}");

    // The region is immutable.
    let rp = dynamic_api(&client, "RegionPeering", "aether-system");
    let err = rp
        .patch("eu-west", &PatchParams::default(), &Patch::Merge(json!({"spec": {"region": "elsewhere"}})))
        .await
        .expect_err("changing the region must be refused");
    assert!(err.to_string().contains("region is immutable"), "{err}");

    // Values written through the status subresource show in `kubectl get`.
    let status = json!({"status": {
        "peersReady": "1/2",
        "worstLag": "3s",
        "leader": "operator-0",
        "inboundSummary": "us-east:120",
        "conditions": [{"type": "Ready", "status": "False", "reason": "PeerNotSynced", "message": "ap-south is syncing",
                        "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1}],
    }});
    rp.patch_status("eu-west", &PatchParams::default(), &Patch::Merge(status)).await?;
    let output = apiserver.kubectl()?.args(["get", "regionpeerings", "-n", "aether-system", "-o", "wide"]).output()?;
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "kubectl failed: {}", String::from_utf8_lossy(&output.stderr));
    let header = text.lines().next().unwrap_or_default();
    for column in ["NAME", "REGION", "PEERS", "READY", "LAG", "AGE", "REASON", "LEADER", "INBOUND", "SUSPENDED"] {
        assert!(header.contains(column), "header {header:?} lacks {column}");
    }
    let row = text.lines().find(|l| l.starts_with("eu-west")).expect("a row for eu-west");
    for value in ["eu-west", "1/2", "False", "3s", "PeerNotSynced", "operator-0", "us-east:120"] {
        assert!(row.contains(value), "row {row:?} lacks {value}");
    }

    // Plain `kubectl get` says why a region is not Ready, without -o wide.
    let output = apiserver.kubectl()?.args(["get", "regionpeerings", "-n", "aether-system"]).output()?;
    let text = String::from_utf8_lossy(&output.stdout);
    let row = text.lines().find(|l| l.starts_with("eu-west")).expect("a row for eu-west");
    assert!(text.lines().next().unwrap_or_default().contains("REASON") && row.contains("PeerNotSynced"), "{text}");

    // The short name and the registry schema's columns work too.
    let output = apiserver.kubectl()?.args(["get", "regschema", "-n", "aether-system"]).output()?;
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.lines().next().unwrap_or_default().contains("PHASE"), "{text}");
    Ok(())
}
