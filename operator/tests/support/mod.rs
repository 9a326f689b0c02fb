//! Helpers shared by the integration tests.
#![allow(dead_code, unused_imports)]
use kube::api::{Api, DynamicObject, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use std::time::Duration;

pub const DEADLINE: Duration = Duration::from_secs(30);

/// Installs the generated CRDs and waits until each is Established.
pub async fn install_crds(client: &kube::Client) -> anyhow::Result<()> {
    aether_harness::install_crds(client, aether_operator::api::all_crds()).await
}

pub use aether_harness::ensure_namespace;

pub mod consumer;
pub mod etcd;
pub mod mirror;
pub mod operator;

/// The resident memory of a process, in bytes.
pub fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb: u64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    kb * 1024
}

/// A path in the repository.
pub fn repo(path: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

/// Runs kubectl as the admin; its stdout, or the test fails with its stderr.
pub fn kubectl(apiserver: &aether_harness::KubeApiserver, args: &[&str]) -> String {
    let out = apiserver.kubectl().unwrap().args(args).output().unwrap();
    assert!(out.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// A kubeconfig (`<name>.kubeconfig`) authenticating as a ServiceAccount with a one-hour token.
pub fn service_account_kubeconfig(
    apiserver: &aether_harness::KubeApiserver,
    namespace: &str,
    service_account: &str,
    name: &str,
) -> std::path::PathBuf {
    let token = service_account_token(apiserver, namespace, service_account);
    apiserver.kubeconfig_for_token(&format!("{name}.kubeconfig"), &token).unwrap()
}

/// A one-hour token of a ServiceAccount.
pub fn service_account_token(
    apiserver: &aether_harness::KubeApiserver,
    namespace: &str,
    service_account: &str,
) -> String {
    kubectl(apiserver, &["create", "token", service_account, "-n", namespace, "--duration", "1h"]).trim().to_string()
}

/// An untyped API for one of our kinds, so tests can send objects the Rust types cannot express.
pub fn dynamic_api(client: &kube::Client, kind: &str, namespace: &str) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(aether_operator::api::GROUP, "v1alpha1", kind));
    Api::namespaced_with(client.clone(), namespace, &resource)
}

/// Creates an object from a JSON value; the server's error message on rejection.
pub async fn create_json(
    client: &kube::Client,
    namespace: &str,
    object: serde_json::Value,
) -> Result<DynamicObject, String> {
    let kind = object["kind"].as_str().unwrap_or_default().to_string();
    let object: DynamicObject = serde_json::from_value(object).map_err(|e| e.to_string())?;
    dynamic_api(client, &kind, namespace).create(&PostParams::default(), &object).await.map_err(|e| match e {
        kube::Error::Api(status) => status.message.clone(),
        other => other.to_string(),
    })
}

/// Every YAML document under a directory of the repository, parsed.
pub fn yaml_documents(dir: &str) -> Vec<(String, serde_json::Value)> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(dir);
    let mut out = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(&root).expect("read dir").flatten().map(|e| e.path()).collect();
    files.sort();
    for path in files {
        if path.extension().is_some_and(|e| e == "yaml") {
            let text = std::fs::read_to_string(&path).expect("read yaml");
            for doc in serde_yaml::Deserializer::from_str(&text) {
                let value = <serde_json::Value as serde::Deserialize>::deserialize(doc).expect("valid YAML");
                if !value.is_null() {
                    out.push((path.display().to_string(), value));
                }
            }
        }
    }
    out
}
