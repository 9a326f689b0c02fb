//! Starting the operator binary against a real kube-apiserver, and what its tests wait for.
use super::*;
use aether_harness::{EtcdServer, KubeApiserver, ManagedProcess};
use aether_operator::api::RegionPeering;
use aether_operator::keys;
use etcd_client::{Client, GetOptions, Txn, TxnOp};
use kube::api::Api;
use serde_json::json;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

pub const NS: &str = "fed";
pub const WAIT: Duration = Duration::from_secs(60);

/// The operator, as a ServiceAccount bound to config/rbac.
pub fn start_operator(apiserver: &KubeApiserver, dir: &Path, name: &str, metrics_port: u16) -> ManagedProcess {
    start_operator_in(apiserver, dir, name, metrics_port, NS)
}

/// The operator watching `namespaces` (comma-separated).
pub fn start_operator_in(
    apiserver: &KubeApiserver,
    dir: &Path,
    name: &str,
    metrics_port: u16,
    namespaces: &str,
) -> ManagedProcess {
    start_operator_via(apiserver, dir, name, metrics_port, namespaces, None)
}

/// The operator, reaching the API server through `via` (a fault proxy's address) if given.
pub fn start_operator_via(
    apiserver: &KubeApiserver,
    dir: &Path,
    name: &str,
    metrics_port: u16,
    namespaces: &str,
    via: Option<std::net::SocketAddr>,
) -> ManagedProcess {
    let kubeconfig = service_account_kubeconfig(apiserver, "aether-system", "aether-operator", name);
    if let Some(via) = via {
        let text = std::fs::read_to_string(&kubeconfig).unwrap();
        let direct = apiserver.url().trim_start_matches("https://").to_string();
        std::fs::write(&kubeconfig, text.replace(&direct, &via.to_string())).unwrap();
    }
    start_operator_as(&kubeconfig, dir, name, metrics_port, namespaces, &[])
}

/// The operator with the credentials of `kubeconfig` and `extra` arguments.
pub fn start_operator_as(
    kubeconfig: &Path,
    dir: &Path,
    name: &str,
    metrics_port: u16,
    namespaces: &str,
    extra: &[&str],
) -> ManagedProcess {
    let cmd = operator_command(kubeconfig, name, metrics_port, namespaces, extra);
    ManagedProcess::spawn(name, cmd, &dir.join(format!("{name}.log"))).unwrap()
}

/// The operator as its ServiceAccount, with the faults `faults` injected (`AETHER_FAULTS`, see
/// `aether_operator::faults`).
pub fn start_operator_with_faults(
    apiserver: &KubeApiserver,
    dir: &Path,
    name: &str,
    metrics_port: u16,
    faults: &str,
) -> ManagedProcess {
    let kubeconfig = service_account_kubeconfig(apiserver, "aether-system", "aether-operator", name);
    let mut cmd = operator_command(&kubeconfig, name, metrics_port, NS, &[]);
    cmd.env("AETHER_FAULTS", faults);
    ManagedProcess::spawn(name, cmd, &dir.join(format!("{name}.log"))).unwrap()
}

fn operator_command(kubeconfig: &Path, name: &str, metrics_port: u16, namespaces: &str, extra: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_aether-operator"));
    cmd.arg("run")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["--namespaces", namespaces, "--identity", name, "--refresh-seconds", "1"])
        .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
        .args(extra)
        .env("RUST_LOG", "info,aether_operator=debug");
    cmd
}

pub async fn put_endpoints(etcd: &EtcdServer, region: &str, n: usize) {
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    let ops: Vec<TxnOp> = (0..n)
        .map(|i| {
            let key = format!(
                "{}clusters/c1/services/s{}/protocols/tcp/endpoints/10.1.0.{}",
                keys::region_prefix(region),
                i % 5,
                i
            );
            TxnOp::put(key, format!(r#"{{"region":"{region}","clusterName":"c1"}}"#), None)
        })
        .collect();
    for chunk in ops.chunks(100) {
        c.txn(Txn::new().and_then(chunk.to_vec())).await.unwrap();
    }
}

pub async fn mirrored(etcd: &EtcdServer, origin: &str) -> i64 {
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    c.get(keys::region_prefix(origin), Some(GetOptions::new().with_prefix().with_count_only())).await.unwrap().count()
}

/// CRDs, namespaces and config/rbac on a fresh apiserver; an admin client.
pub async fn prepare(apiserver: &KubeApiserver) -> kube::Client {
    let client = apiserver.client().await.unwrap();
    install_crds(&client).await.unwrap();
    ensure_namespace(&client, "aether-system").await.unwrap();
    ensure_namespace(&client, NS).await.unwrap();
    kubectl(apiserver, &["apply", "-k", repo("config/rbac").to_str().unwrap()]);
    client
}

pub fn condition(rp: &RegionPeering, type_: &str) -> Option<(String, String, String)> {
    rp.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

pub async fn wait_condition(
    api: &Api<RegionPeering>,
    name: &str,
    type_: &str,
    status: &str,
    reason: Option<&str>,
) -> RegionPeering {
    let mut last = None;
    let deadline = std::time::Instant::now() + WAIT;
    while std::time::Instant::now() < deadline {
        if let Ok(rp) = api.get(name).await {
            if let Some((s, r, _)) = condition(&rp, type_)
                && s == status
                && reason.is_none_or(|want| want == r)
            {
                return rp;
            }
            last = Some(rp);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!(
        "{name}: condition {type_}={status} ({reason:?}) not reached; last status: {:?}",
        last.and_then(|r| r.status)
    );
}

pub fn peering(name: &str, region: &str, local: &EtcdServer, peers: &[(&str, &EtcdServer)]) -> serde_json::Value {
    json!({
        "apiVersion": "federation.aether.dev/v1alpha1",
        "kind": "RegionPeering",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "region": region,
            "localEtcd": {"endpoints": [local.endpoint()]},
            "peers": peers.iter().map(|(r, e)| json!({"region": r, "endpoints": [e.endpoint()]})).collect::<Vec<_>>(),
            "lease": {"ttlSeconds": 6, "keepaliveIntervalSeconds": 2},
            "failureDetector": {"acceptablePauseSeconds": 3},
        }
    })
}

/// One unlabelled gauge of the operator's metrics; None when it does not answer.
pub async fn gauge(port: u16, name: &str) -> Option<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").await.ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).await.ok()?;
    body.lines().find(|l| l.starts_with(&format!("{name} ")))?.rsplit(' ').next()?.parse().ok()
}

pub async fn scrape_metrics(port: u16) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").await.unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    body
}
