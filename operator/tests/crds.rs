//! The CRDs against a real kube-apiserver: generation drift, installation, validation and the
//! printer columns users read.
mod support;

use aether_harness::KubeApiserver;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use support::*;

#[test]
fn every_generated_file_is_committed_as_generated() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for (path, generated) in aether_operator::manifests::generated_files() {
        let committed = std::fs::read_to_string(root.join(&path)).unwrap_or_default();
        assert!(
            committed == generated,
            "{path} is out of date with operator/src: run `make manifests` and commit the result"
        );
    }
}

/// Every field path written as `spec.a.b` (or `status.a.b`, in backticks, as the docs, the chart's
/// values and the operator's messages write them), with the file naming it. The changelog may
/// name fields that were renamed.
fn named_paths() -> Vec<(String, String)> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files: Vec<std::path::PathBuf> =
        ["README.md", "charts/aether-federation/values.yaml"].iter().map(|p| root.join(p)).collect();
    for dir in [
        "docs",
        "operator/src",
        "operator/src/mirror",
        "operator/src/controllers",
        "operator/src/cli",
        "operator/src/drain",
    ] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "md" || e == "rs") {
                files.push(path);
            }
        }
    }
    let mut found = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for (i, _) in text.match_indices("`spec.").chain(text.match_indices("`status.")) {
            let named: String = text[i + 1..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || ['.', '[', ']', '-', '_'].contains(c))
                .collect();
            // spec.peers[b].endpoints and spec.peers[].endpoints are spec.peers.endpoints.
            let mut path = String::new();
            let mut depth = 0;
            for c in named.chars() {
                match c {
                    '[' => depth += 1,
                    ']' => depth -= 1,
                    c if depth == 0 => path.push(c),
                    _ => {}
                }
            }
            let path = path.trim_end_matches('.').to_string();
            if path.ends_with(".rs") || path.ends_with(".md") {
                continue; // status.rs: a file
            }
            if path.split('.').count() >= 2 && path.split('.').nth(1).is_some_and(|f| !f.is_empty()) {
                found.push((path, file.strip_prefix(&root).unwrap_or(&file).display().to_string()));
            }
        }
    }
    found
}

/// The field paths of one CRD's schema, `spec.lease.ttlSeconds` and the like (array items are
/// looked through).
fn schema_paths(schema: &serde_json::Value, prefix: &str, out: &mut std::collections::BTreeSet<String>) {
    let schema = if schema["type"] == "array" { &schema["items"] } else { schema };
    for (name, field) in schema["properties"].as_object().into_iter().flatten() {
        let path = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
        out.insert(path.clone());
        schema_paths(field, &path, out);
    }
}

#[test]
fn every_field_the_docs_and_messages_name_exists_in_the_crds() {
    let mut known = std::collections::BTreeSet::new();
    for crd in aether_operator::api::all_crds() {
        let crd = serde_json::to_value(&crd).unwrap();
        for version in crd["spec"]["versions"].as_array().unwrap() {
            schema_paths(&version["schema"]["openAPIV3Schema"], "", &mut known);
        }
    }
    // Kubernetes' own objects named beside ours.
    let theirs = ["spec.holderIdentity", "spec.template", "spec.replicas", "spec.versions", "status.conditions"];
    let unknown: Vec<String> = named_paths()
        .into_iter()
        .filter(|(path, _)| !known.contains(path) && !theirs.iter().any(|t| path.starts_with(t)))
        .map(|(path, file)| format!("{path} ({file})"))
        .collect();
    assert!(unknown.is_empty(), "named but not in the CRDs: {unknown:#?}");
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
            "local endpoints of both schemes",
            with(valid_spec(), &["localEtcd", "endpoints"], json!(["http://a:2379", "https://b:2379"])),
            "spec.localEtcd.endpoints",
        ),
        (
            "peer endpoints of both schemes",
            with(valid_spec(), &["peers"], json!([{"region": "b", "endpoints": ["https://a:2379", "http://b:2379"]}])),
            "spec.peers[0].endpoints",
        ),
        (
            "Txns larger than a request",
            with(valid_spec(), &["sync"], json!({"maxTxnBytes": 2097152, "maxRequestBytes": 1572864})),
            "spec.sync.maxTxnBytes",
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
