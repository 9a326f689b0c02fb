//! Least privilege in the cluster: metrics served over HTTPS only to scrapers the API server
//! authenticates and authorizes, and a namespaced install running on the chart's namespaced RBAC.
mod support;

use aether_harness::{EtcdServer, KubeApiserver, Pki, free_port, tool_path, wait_until};
use aether_operator::api::RegionPeering;
use futures::StreamExt;
use kube::api::{Api, PostParams};
use serde::Deserialize;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use support::operator::*;
use support::*;

/// GETs `path` from the operator's HTTPS endpoint, verifying it with `ca` (or not at all), with
/// `token` as the bearer token if given: the body, or the status it was refused with (0 when the
/// request did not get an answer).
async fn get_https(port: u16, ca: Option<&Path>, token: Option<&str>, path: &str) -> Result<String, u16> {
    aether_harness::https::get(&format!("https://127.0.0.1:{port}"), ca, token, path).await
}

async fn wait_healthy(port: u16, ca: Option<&Path>) {
    wait_until("the operator's HTTPS endpoint", WAIT, || async move {
        Ok(get_https(port, ca, None, "/healthz").await.is_ok_and(|body| body == "ok"))
    })
    .await
    .unwrap();
}

/// The metrics RBAC, a ServiceAccount `scraper` bound to the metrics reader (and the other
/// `accounts`), and a serving certificate from a CA the scraper trusts, mounted the way a
/// cert-manager Secret is: the PKI and the certificate directory.
fn secure_metrics(apiserver: &KubeApiserver, dir: &Path, accounts: &[&str]) -> (Pki, std::path::PathBuf) {
    for file in ["config/rbac/metrics_auth_role.yaml", "config/rbac/metrics_reader_role.yaml"] {
        kubectl(apiserver, &["apply", "-f", repo(file).to_str().unwrap()]);
    }
    for sa in std::iter::once(&"scraper").chain(accounts) {
        kubectl(apiserver, &["create", "serviceaccount", sa, "-n", "aether-system"]);
    }
    kubectl(
        apiserver,
        &[
            "create",
            "clusterrolebinding",
            "scraper-reads-metrics",
            "--clusterrole=aether-operator-metrics-reader",
            "--serviceaccount=aether-system:scraper",
        ],
    );
    let pki = Pki::new(dir).unwrap();
    let served = pki.server("metrics").unwrap();
    let certs = dir.join("metrics-certs");
    std::fs::create_dir_all(&certs).unwrap();
    std::fs::copy(&served.cert, certs.join("tls.crt")).unwrap();
    std::fs::copy(&served.key, certs.join("tls.key")).unwrap();
    (pki, certs)
}

#[tokio::test]
async fn metrics_are_served_over_https_only_to_scrapers_the_api_server_allows() {
    let apiserver = KubeApiserver::start("metrics-auth").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    prepare(&apiserver).await;
    let (pki, certs) = secure_metrics(&apiserver, dir.path(), &["stranger"]);

    let port = free_port();
    let kubeconfig = service_account_kubeconfig(&apiserver, "aether-system", "aether-operator", "op");
    let _operator = start_operator_as(
        &kubeconfig,
        dir.path(),
        "op",
        port,
        NS,
        &["--metrics-secure", "--metrics-cert-dir", certs.to_str().unwrap()],
    );
    let ca = Some(pki.ca_cert.as_path());
    wait_healthy(port, ca).await;
    assert_eq!(get_https(port, ca, None, "/readyz").await, Ok("ok".into()), "the probes stay open");

    assert_eq!(get_https(port, ca, None, "/metrics").await, Err(401), "no token");
    assert_eq!(get_https(port, ca, Some("not-a-token"), "/metrics").await, Err(401), "a token nobody issued");
    let stranger = service_account_token(&apiserver, "aether-system", "stranger");
    assert_eq!(get_https(port, ca, Some(&stranger), "/metrics").await, Err(403), "authenticated, not allowed");
    let scraper = service_account_token(&apiserver, "aether-system", "scraper");
    let body = get_https(port, ca, Some(&scraper), "/metrics").await.expect("the reader role may scrape");
    assert!(body.contains("aether_federation_build_info"), "{body}");
    // The same denials hold when the decision comes from the cache.
    assert_eq!(get_https(port, ca, Some(&stranger), "/metrics").await, Err(403));
    // Plain HTTP gets nothing from a secure endpoint.
    assert!(!scrape_metrics(port).await.contains("aether_federation_"));

    // `doctor --in-cluster`: the checks run from the operator, for a person bound to the doctor
    // role only; a scraper may read /metrics and not make the operator dial every etcd.
    kubectl(&apiserver, &["create", "serviceaccount", "oncall", "-n", "aether-system"]);
    kubectl(
        &apiserver,
        &[
            "create",
            "clusterrolebinding",
            "oncall-runs-doctor",
            "--clusterrole=aether-operator-doctor",
            "--serviceaccount=aether-system:oncall",
        ],
    );
    let etcd = EtcdServer::start("doctor-local").await.unwrap();
    let client = apiserver.client().await.unwrap();
    let api: Api<RegionPeering> = Api::namespaced(client.clone(), NS);
    let mut rp = peering("a", "a", &etcd, &[]);
    rp["spec"]["peers"] = serde_json::json!([{"region": "b", "endpoints": ["https://127.0.0.1:1"], "tls": {"secretRef": {"name": "peer-b"}}}]);
    let rp: RegionPeering = serde_json::from_value(rp).unwrap();
    api.create(&PostParams::default(), &rp).await.unwrap();
    let ca_arg = pki.ca_cert.to_str().unwrap().to_string();
    let doctor = |token: &str, trust: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_aether-operator"))
            .args(["doctor", "a", "-n", NS, "--in-cluster"])
            .args(["--operator-url", &format!("https://127.0.0.1:{port}"), "--token", token])
            .args(trust)
            .arg("--kubeconfig")
            .arg(apiserver.kubeconfig())
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr))
    };
    let verified = ["--metrics-ca", ca_arg.as_str()];
    let oncall = service_account_token(&apiserver, "aether-system", "oncall");
    // The doctor reads the RegionPeering and its Secrets with the operator's rights: not for a
    // caller who may not read them itself.
    let (code, out) = doctor(&oncall, &verified);
    assert_eq!(code, Some(2), "refused: it could not check\n{out}");
    assert!(out.contains("may not get regionpeerings fed/a"), "{out}");
    kubectl(
        &apiserver,
        &["create", "role", "oncall-reads", "-n", NS, "--verb=get", "--resource=regionpeerings.federation.aether.dev"],
    );
    kubectl(
        &apiserver,
        &[
            "create",
            "rolebinding",
            "oncall-reads",
            "-n",
            NS,
            "--role=oncall-reads",
            "--serviceaccount=aether-system:oncall",
        ],
    );
    let (code, out) = doctor(&oncall, &verified);
    assert!(code != Some(0) && out.contains("may not get secrets fed/peer-b"), "{out}");
    kubectl(
        &apiserver,
        &["create", "role", "oncall-secrets", "-n", NS, "--verb=get", "--resource=secrets", "--resource-name=peer-b"],
    );
    kubectl(
        &apiserver,
        &[
            "create",
            "rolebinding",
            "oncall-secrets",
            "-n",
            NS,
            "--role=oncall-secrets",
            "--serviceaccount=aether-system:oncall",
        ],
    );
    let (code, out) = doctor(&oncall, &verified);
    assert!(out.contains("checked from operator pod op") && out.contains("connect"), "{code:?}: {out}");
    // The token never goes to a server whose certificate is not verified, unless one says so.
    let (code, out) = doctor(&oncall, &[]);
    assert!(code != Some(0) && out.contains("--metrics-ca") && out.contains("not sent"), "{out}");
    std::fs::create_dir_all(dir.path().join("stranger")).unwrap();
    let stranger_ca = Pki::new(&dir.path().join("stranger")).unwrap();
    let (code, out) = doctor(&oncall, &["--metrics-ca", stranger_ca.ca_cert.to_str().unwrap()]);
    assert!(code != Some(0) && !out.contains("checked from operator pod"), "{out}");
    let (_, out) = doctor(&oncall, &["--insecure-skip-tls-verify"]);
    assert!(out.contains("checked from operator pod op"), "{out}");
    let (code, out) = doctor(&scraper, &verified);
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("may not get /debug/doctor"), "{out}");
}

/// The chart rendered for a namespaced install: only the objects that grant access.
fn chart_rbac(namespaces: &str, dir: &Path) -> (std::path::PathBuf, Vec<serde_json::Value>) {
    let out = Command::new(tool_path("helm").unwrap())
        .args(["template", "aether", repo("charts/aether-federation").to_str().unwrap()])
        .args(["--namespace", "aether-system", "--kube-version", "1.35.0"])
        .args(["--set", &format!("watchNamespaces={{{namespaces}}}")])
        .output()
        .unwrap();
    assert!(out.status.success(), "helm template: {}", String::from_utf8_lossy(&out.stderr));
    let kinds = ["ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"];
    let objects: Vec<serde_json::Value> = serde_yaml::Deserializer::from_str(&String::from_utf8_lossy(&out.stdout))
        .filter_map(|doc| serde_json::Value::deserialize(doc).ok())
        .filter(|o| kinds.contains(&o["kind"].as_str().unwrap_or_default()))
        .collect();
    let file = dir.join("chart-rbac.yaml");
    let text: Vec<String> = objects.iter().map(|o| serde_yaml::to_string(o).unwrap()).collect();
    std::fs::write(&file, text.join("---\n")).unwrap();
    (file, objects)
}

#[tokio::test]
async fn a_namespaced_install_runs_on_the_charts_roles_and_ignores_other_namespaces() {
    let (apiserver, local, peer) =
        tokio::join!(KubeApiserver::start("namespaced"), EtcdServer::start("ns-a"), EtcdServer::start("ns-b"));
    let (apiserver, local, peer) = (apiserver.unwrap(), local.unwrap(), peer.unwrap());
    let dir = tempfile::tempdir().unwrap();
    let client = apiserver.client().await.unwrap();
    install_crds(&client).await.unwrap();
    for ns in ["aether-system", NS, "elsewhere"] {
        ensure_namespace(&client, ns).await.unwrap();
    }
    let (rbac, objects) = chart_rbac(NS, dir.path());
    for cluster_role in objects.iter().filter(|o| o["kind"] == "ClusterRole") {
        let rules = cluster_role["rules"].to_string();
        assert!(
            !rules.contains("secrets") && !rules.contains("regionpeerings"),
            "a namespaced install grants nothing on data cluster-wide: {cluster_role}"
        );
    }
    assert!(
        objects.iter().any(|o| o["kind"] == "Role" && o["metadata"]["namespace"] == NS),
        "a Role in the watched namespace"
    );
    kubectl(&apiserver, &["apply", "-f", rbac.to_str().unwrap()]);
    let account =
        objects.iter().find(|o| o["kind"] == "ServiceAccount").expect("the chart's ServiceAccount")["metadata"]["name"]
            .as_str()
            .unwrap()
            .to_string();
    let as_operator = format!("--as=system:serviceaccount:aether-system:{account}");
    for (ns, expected) in [(NS, "yes"), ("elsewhere", "no")] {
        let out =
            apiserver.kubectl().unwrap().args(["auth", "can-i", "get", "secrets", "-n", ns, &as_operator]).output();
        assert_eq!(String::from_utf8_lossy(&out.unwrap().stdout).trim(), expected, "get secrets in {ns}");
    }

    put_endpoints(&local, "a", 20).await;
    let kubeconfig = service_account_kubeconfig(&apiserver, "aether-system", &account, "op");
    let port = free_port();
    let mut operator = start_operator_as(&kubeconfig, dir.path(), "op", port, NS, &["--metrics-secure"]);
    // The same object in a namespace the operator was not given, created first.
    let mut outside: RegionPeering = serde_json::from_value(peering("outside", "a", &local, &[("b", &peer)])).unwrap();
    outside.metadata.namespace = Some("elsewhere".into());
    Api::<RegionPeering>::namespaced(client.clone(), "elsewhere")
        .create(&PostParams::default(), &outside)
        .await
        .unwrap();
    let api: Api<RegionPeering> = Api::namespaced(client.clone(), NS);
    let inside: RegionPeering = serde_json::from_value(peering("a", "a", &local, &[("b", &peer)])).unwrap();
    api.create(&PostParams::default(), &inside).await.unwrap();

    wait_condition(&api, "a", "Ready", "True", None).await;
    assert_eq!(mirrored(&peer, "a").await, 20);
    wait_healthy(port, None).await;
    operator.check_running().expect("the operator runs on namespaced RBAC");
    let outside = Api::<RegionPeering>::namespaced(client.clone(), "elsewhere").get("outside").await.unwrap();
    assert!(outside.status.is_none(), "an object outside the watched namespaces gets no status");
    assert!(outside.metadata.finalizers.unwrap_or_default().is_empty(), "nor a finalizer");
    let log = std::fs::read_to_string(dir.path().join("op.log")).unwrap();
    assert!(log.contains("objects in any other namespace are ignored"), "{log}");
    assert!(log.contains("may not read CRDs"), "the CRD check falls back without cluster-wide reads: {log}");
}

/// `aether-operator doctor` as the admin: whether it passed, and its findings.
/// `doctor` as the region's leader runs it in its pod when asked (from where it stands, as JSON).
fn doctor(apiserver: &KubeApiserver, name: &str) -> (bool, Vec<serde_json::Value>) {
    doctor_with(apiserver, &aether_operator::cli::from_leader::doctor_args(name, NS))
}

fn doctor_with(apiserver: &KubeApiserver, args: &[String]) -> (bool, Vec<serde_json::Value>) {
    let out = Command::new(env!("CARGO_BIN_EXE_aether-operator"))
        .args(args)
        .arg("--kubeconfig")
        .arg(apiserver.kubeconfig())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let findings =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text} {}", String::from_utf8_lossy(&out.stderr)));
    (out.status.success(), findings)
}

fn found<'a>(findings: &'a [serde_json::Value], target: &str, check: &str) -> Vec<&'a serde_json::Value> {
    findings.iter().filter(|f| f["target"] == target && f["check"] == check).collect()
}

#[tokio::test]
async fn doctor_checks_a_least_privilege_mtls_peer_and_says_what_to_do() {
    let (apiserver, origin, peer) = tokio::try_join!(
        KubeApiserver::start("doctor"),
        EtcdServer::start("doc-a"),
        aether_harness::EtcdCluster::start_with("doc-b", aether_harness::ClusterOptions::new(1).with_tls())
    )
    .unwrap();
    let client = apiserver.client().await.unwrap();
    install_crds(&client).await.unwrap();
    ensure_namespace(&client, NS).await.unwrap();
    let root_tls = support::etcd::tls_for(&peer, "root");
    let mut admin =
        support::etcd::connect(&peer.endpoints(), Some(etcd_client::ConnectOptions::new().with_tls(root_tls))).await;
    support::etcd::enable_auth_with_mirror_user(&mut admin, "a", "mirrorpw").await;
    let cert = peer.client_cert("mirror-a").unwrap();
    let secret = serde_json::json!({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "peer-b", "namespace": NS},
        "stringData": {
            "ca.crt": std::fs::read_to_string(peer.ca_cert().unwrap()).unwrap(),
            "tls.crt": std::fs::read_to_string(&cert.cert).unwrap(),
            "tls.key": std::fs::read_to_string(&cert.key).unwrap(),
            "username": "mirror-a", "password": "mirrorpw",
        }
    });
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &serde_json::from_value(secret).unwrap())
        .await
        .unwrap();
    let mut rp = peering("a", "a", &origin, &[]);
    rp["spec"]["peers"] =
        serde_json::json!([{"region": "b", "endpoints": peer.endpoints(), "tls": {"secretRef": {"name": "peer-b"}}}]);
    create_json(&client, NS, rp).await.unwrap();

    let (passed, findings) = doctor(&apiserver, "a");
    assert!(passed, "{findings:#?}");
    let level = |check: &str| {
        found(&findings, "peer b", check).iter().map(|f| f["level"].as_str().unwrap().to_string()).collect::<Vec<_>>()
    };
    assert_eq!(level("connect"), ["Ok"]);
    assert_eq!(level("certificate"), ["Ok", "Ok"], "the CA and the client certificate");
    assert_eq!(level("write"), ["Ok", "Ok"], "its subtree and its checkpoint");
    assert_eq!(level("least privilege"), ["Ok"], "region b's own subtree is refused");
    assert_eq!(level("clock"), ["Ok"]);
    let layout = found(&findings, "peer b", "lease layout");
    assert_eq!(layout[0]["level"], "Warn", "1000 keys per lease under auth: {layout:?}");
    assert!(layout[0]["action"].as_str().unwrap().contains("maxKeysPerLease"));
    assert_eq!(level("version").len(), 1);
    assert_eq!(found(&findings, "local etcd", "read")[0]["level"], "Ok");
    // Nothing was written by the probes.
    let mut o = support::etcd::connect(&[origin.endpoint()], None).await;
    assert!(
        o.get("/", Some(etcd_client::GetOptions::new().with_prefix().with_count_only())).await.unwrap().count() == 0
    );

    // A peer nobody answers for: a failure naming what to check, and a non-zero exit.
    let mut gone = peering("gone", "c", &origin, &[]);
    gone["spec"]["peers"] =
        serde_json::json!([{"region": "d", "endpoints": [format!("http://127.0.0.1:{}", free_port())]}]);
    create_json(&client, NS, gone).await.unwrap();
    let (passed, findings) = doctor(&apiserver, "gone");
    assert!(!passed);
    let connect = found(&findings, "peer d", "connect");
    assert_eq!(connect[0]["level"], "Fail", "{findings:#?}");
    assert!(connect[0]["action"].as_str().unwrap().contains("endpoints"));
    // By default an etcd this machine cannot reach is the region's leader's to check; with no
    // operator leading the region, the findings say it could not be asked, beside the failure.
    let by_default = ["doctor", "gone", "-n", NS, "-o", "json"].map(String::from);
    let (passed, findings) = doctor_with(&apiserver, &by_default);
    assert!(!passed);
    assert_eq!(found(&findings, "peer d", "connect")[0]["level"], "Fail", "{findings:#?}");
    let asked = found(&findings, "region's leader", "checks from its pod");
    assert!(asked[0]["detail"].as_str().unwrap().contains("peer d: the status names no leader Lease"), "{findings:#?}");
    // A failed check exits 1; a RegionPeering it cannot find is a check it could not make: 2.
    let code = |name: &str| {
        Command::new(env!("CARGO_BIN_EXE_aether-operator"))
            .args(["doctor", name, "-n", NS, "--kubeconfig"])
            .arg(apiserver.kubeconfig())
            .output()
            .unwrap()
            .status
            .code()
    };
    assert_eq!((code("gone"), code("missing")), (Some(1), Some(2)));
}

/// A TLS connection to the operator's port, trusting `ca`.
async fn tls_to(port: u16, ca: &Path) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    use rustls_pki_types::pem::PemObject;
    let mut roots = tokio_rustls::rustls::RootCertStore::empty();
    for cert in rustls_pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = tokio_rustls::rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        tokio_rustls::rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    connector.connect(rustls_pki_types::ServerName::try_from("localhost").unwrap(), tcp).await
}

/// One GET of /metrics with `token`, over its own connection; the status line, or "" when the
/// connection ended without an answer.
async fn get_with_token(port: u16, ca: &Path, token: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tls_to(port, ca).await else { return String::new() };
    let request =
        format!("GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n");
    if s.write_all(request.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer).lines().next().unwrap_or_default().to_string()
}

fn random_token(bytes: usize) -> String {
    (0..bytes).map(|_| char::from(b'a' + rand::random::<u8>() % 26)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_huge_and_unknown_tokens_and_stalled_handshakes_leaves_memory_bounded_and_the_region_ready() {
    let (apiserver, a, b) =
        tokio::try_join!(KubeApiserver::start("flood"), EtcdServer::start("flood-a"), EtcdServer::start("flood-b"))
            .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let client = prepare(&apiserver).await;
    let (pki, certs) = secure_metrics(&apiserver, dir.path(), &[]);
    put_endpoints(&a, "a", 300).await;
    let port = free_port();
    let kubeconfig = service_account_kubeconfig(&apiserver, "aether-system", "aether-operator", "op");
    let operator = start_operator_as(
        &kubeconfig,
        dir.path(),
        "op",
        port,
        NS,
        &["--metrics-secure", "--metrics-cert-dir", certs.to_str().unwrap()],
    );
    let pid = operator.pid().unwrap();
    let ca = pki.ca_cert.clone();
    wait_healthy(port, Some(&ca)).await;
    let api: Api<RegionPeering> = Api::namespaced(client.clone(), NS);
    create_json(&client, NS, peering("a", "a", &a, &[("b", &b)])).await.unwrap();
    wait_condition(&api, "a", "Ready", "True", None).await;
    let scraper = service_account_token(&apiserver, "aether-system", "scraper");
    let reviews = |body: &str, outcome: &str| -> u64 {
        let series = format!("aether_federation_token_reviews_total{{outcome=\"{outcome}\"}} ");
        body.lines().find_map(|l| l.strip_prefix(series.as_str())).and_then(|v| v.parse().ok()).unwrap_or(0)
    };
    let before = get_https(port, Some(&ca), Some(&scraper), "/metrics").await.unwrap();
    let baseline = rss(pid);

    // Meanwhile: the region must stay Ready and its copy whole, and the memory is sampled.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watching = {
        let (api, stop) = (api.clone(), stop.clone());
        let b = etcd_client::Client::connect([b.endpoint()], None).await.unwrap();
        tokio::spawn(async move {
            let (mut polls, mut not_ready, mut short, mut peak) = (0, 0, 0, 0u64);
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                peak = peak.max(rss(pid));
                let ready =
                    api.get("a").await.ok().and_then(|rp| condition(&rp, "Ready")).is_some_and(|c| c.0 == "True");
                let options = etcd_client::GetOptions::new().with_prefix().with_count_only();
                let copy =
                    b.clone().get(aether_operator::keys::region_prefix("a"), Some(options)).await.unwrap().count();
                polls += 1;
                not_ready += usize::from(!ready);
                short += usize::from(copy != 300);
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            (polls, not_ready, short, peak)
        })
    };

    // 400 connections that start a TLS record and never finish it.
    let mut stalled = Vec::new();
    for _ in 0..400 {
        if let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            use tokio::io::AsyncWriteExt;
            let _ = s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03]).await;
            stalled.push(s);
        }
    }
    // 1,200 requests each with its own random 256 KiB token, then 1,000 with random 2 KiB ones,
    // 16 at a time.
    let attack = std::time::Instant::now();
    let huge = futures::stream::iter(0..1200)
        .map(|_| {
            let ca = ca.clone();
            async move { get_with_token(port, &ca, &random_token(256 * 1024)).await }
        })
        .buffer_unordered(16)
        .collect::<Vec<String>>()
        .await;
    let unknown = futures::stream::iter(0..1000)
        .map(|_| {
            let ca = ca.clone();
            async move { get_with_token(port, &ca, &random_token(2048)).await }
        })
        .buffer_unordered(16)
        .collect::<Vec<String>>()
        .await;
    let lasted = attack.elapsed();
    drop(stalled);
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (polls, not_ready, short, peak) = watching.await.unwrap();
    let after = get_https(port, Some(&ca), Some(&scraper), "/metrics").await.expect("the scraper still scrapes");

    let statuses = |answers: &[String]| {
        let mut by: std::collections::BTreeMap<String, usize> = Default::default();
        for a in answers {
            *by.entry(a.split_whitespace().nth(1).unwrap_or("none").to_string()).or_default() += 1;
        }
        by
    };
    let reviewed = reviews(&after, "unauthenticated") - reviews(&before, "unauthenticated");
    eprintln!(
        "flood of {lasted:?}: huge tokens {:?}, unknown tokens {:?}; {reviewed} reviews; RSS {} -> peak {} MiB; {polls} polls",
        statuses(&huge),
        statuses(&unknown),
        baseline >> 20,
        peak >> 20
    );
    assert_eq!((not_ready, short), (0, 0), "the region was not Ready, or its copy short, during the flood");
    assert!(peak.saturating_sub(baseline) < 48 << 20, "RSS grew {} MiB under the flood", (peak - baseline) >> 20);
    // No review for a token past the bound; unknown tokens reviewed at the bounded rate.
    let budget = 20.0 + 10.0 * lasted.as_secs_f64() + 5.0;
    assert!((reviewed as f64) <= budget, "{reviewed} reviews of unknown tokens in {lasted:?} (bound {budget:.0})");
    assert!(statuses(&huge).keys().all(|s| s != "200"), "a huge token was served");
}

/// What a workstation asks the region's leader to run in its pod (status --etcd, doctor) are
/// commands this executable accepts: they get as far as reading the kubeconfig.
#[test]
fn the_commands_the_leader_is_asked_to_run_are_ones_it_accepts() {
    use aether_operator::cli::from_leader::{doctor_args, status_args};
    for args in [status_args("fed", std::time::Duration::from_secs(20)), doctor_args("a", "fed")] {
        let out = Command::new(env!("CARGO_BIN_EXE_aether-operator"))
            .args(&args)
            .args(["--kubeconfig", "/nonexistent/kubeconfig"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("/nonexistent/kubeconfig"), "{args:?}: {stderr}");
    }
}
