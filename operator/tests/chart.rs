//! The Helm chart: lint, render, validate the rendered manifests with kubeconform (strict, with
//! the CRD schemas) and apply them with a server-side dry run to a real kube-apiserver. The same
//! server-side dry run covers `kubectl apply -k config/default`.
mod support;

use aether_harness::{KubeApiserver, tool_path};
use std::path::{Path, PathBuf};
use std::process::Command;
use support::*;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("tool runs");
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// JSON schemas of our CRDs in the layout kubeconform reads.
fn crd_schemas(dir: &Path) {
    for crd in aether_operator::api::all_crds() {
        let kind = crd.spec.names.kind.to_lowercase();
        for version in crd.spec.versions {
            let mut schema = serde_json::to_value(version.schema.unwrap().open_api_v3_schema.unwrap()).unwrap();
            let props = schema["properties"].as_object_mut().unwrap();
            props.insert("apiVersion".into(), serde_json::json!({"type": "string"}));
            props.insert("kind".into(), serde_json::json!({"type": "string"}));
            props.insert("metadata".into(), serde_json::json!({"type": "object"}));
            std::fs::write(dir.join(format!("{kind}_{}.json", version.name)), schema.to_string()).unwrap();
        }
    }
}

#[tokio::test]
async fn the_chart_lints_validates_and_applies() {
    let helm = tool_path("helm").unwrap();
    let chart = repo("charts/aether-federation");
    run(Command::new(&helm).arg("lint").arg(&chart).args(["--kube-version", "1.35.0"]));
    let rendered = run(Command::new(&helm)
        .args(["template", "aether", "--namespace", "aether-system", "--kube-version", "1.35.0", "--include-crds"])
        .arg(&chart)
        .args(["--set", "regionPeering.enabled=true", "--set", "regionPeering.region=eu-west"])
        .args(["--set", "regionPeering.localEtcd.endpoints={https://registry-etcd:2379}"])
        .args(["--set", "regionPeering.peerEtcd={us-east=https://e1.us-east:2379\\,https://e2.us-east:2379,ap-south=https://e.ap-south:2379}"])
        .args(["--set", "metrics.serviceMonitor.enabled=false"]));
    // The restricted pod security profile.
    for needle in [
        "runAsNonRoot: true",
        "readOnlyRootFilesystem: true",
        "allowPrivilegeEscalation: false",
        "RuntimeDefault",
        r#"drop: ["ALL"]"#,
    ] {
        assert!(rendered.contains(needle), "rendered chart lacks {needle}");
    }
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("rendered.yaml");
    std::fs::write(&manifest, &rendered).unwrap();
    crd_schemas(dir.path());
    // No network here: built-in kinds are checked by the API server below, ours by kubeconform.
    let schemas = format!("{}/{{{{.ResourceKind}}}}_{{{{.ResourceAPIVersion}}}}.json", dir.path().display());
    let report = run(Command::new(tool_path("kubeconform").unwrap())
        .args(["-strict", "-summary", "-ignore-missing-schemas", "-schema-location", &schemas])
        .arg(&manifest));
    assert!(report.contains("Invalid: 0") && report.contains("Errors: 0"), "{report}");

    let apiserver = KubeApiserver::start("chart").await.unwrap();
    let client = apiserver.client().await.unwrap();
    install_crds(&client).await.unwrap();
    ensure_namespace(&client, "aether-system").await.unwrap();
    let crd_free: String = rendered
        .split("\n---")
        .filter(|doc| !doc.contains("kind: CustomResourceDefinition"))
        .collect::<Vec<_>>()
        .join("\n---");
    std::fs::write(&manifest, crd_free).unwrap();
    let applied = run(apiserver.kubectl().unwrap().args(["apply", "--dry-run=server", "-f"]).arg(&manifest));
    for kind in [
        "deployment.apps/aether",
        "clusterrole.rbac.authorization.k8s.io/aether",
        "regionpeering.federation.aether.dev/eu-west",
        "poddisruptionbudget.policy/aether",
    ] {
        assert!(applied.contains(kind), "{kind} not applied:\n{applied}");
    }
    let kustomized =
        run(apiserver.kubectl().unwrap().args(["apply", "--dry-run=server", "-k"]).arg(repo("config/default")));
    assert!(kustomized.contains("deployment.apps/aether-operator"), "{kustomized}");
}
