//! The leader's metrics as a Prometheus in the cluster scrapes them, through the chart's defaults:
//! `metrics.secure` serves /metrics over HTTPS (self-signed) and answers only bearer tokens the API
//! server authenticates (TokenReview) and allows `get` on the non-resource URL /metrics
//! (SubjectAccessReview), which the chart's ClusterRole `*-metrics-reader` grants. Reached from the
//! host through the API server's port-forward to the leader Pod (no image pulled; the operator's
//! image has no shell). A bound ServiceAccount's token gets 200 and the operator's families; no
//! token, a token that is none, and an unbound ServiceAccount's token are refused. On kind only:
//! the local operators' metrics are tested by operator/tests/security.rs.
use crate::NAMESPACE;
use crate::substrate::{KIND_RELEASE, KindFederation, Substrate};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, RoleRef, Subject};
use kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use std::time::{Duration, Instant};

const SCRAPER: &str = "aether-e2e-metrics-scraper";
const UNBOUND: &str = "aether-e2e-metrics-unbound";

/// What a scrape of the leader found.
#[derive(Debug)]
pub struct Scrape {
    pub leader: String,
    /// Whether the chart serves HTTPS with authorization (`--metrics-secure`).
    pub secure: bool,
    /// The bound ServiceAccount's scrape: how long it took, and the operator's families in it.
    pub took: Duration,
    pub families: usize,
    /// Each refused scrape: what token, and the status.
    pub refused: Vec<(&'static str, u16)>,
}

/// Listens on 127.0.0.1 (an ephemeral port) and carries each connection to `pod`'s `port` over
/// the API server's port-forward, as `kubectl port-forward` does; the local port.
async fn forward(pods: Api<Pod>, pod: String, port: u16) -> anyhow::Result<(u16, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let local = listener.local_addr()?.port();
    let task = tokio::spawn(async move {
        while let Ok((mut connection, _)) = listener.accept().await {
            let (pods, pod) = (pods.clone(), pod.clone());
            tokio::spawn(async move {
                let Ok(mut forwarder) = pods.portforward(&pod, &[port]).await else { return };
                if let Some(mut upstream) = forwarder.take_stream(port) {
                    let _ = tokio::io::copy_bidirectional(&mut connection, &mut upstream).await;
                }
                forwarder.abort();
            });
        }
    });
    Ok((local, task))
}

/// A ServiceAccount's token, valid for ten minutes.
async fn token(accounts: &Api<ServiceAccount>, name: &str) -> anyhow::Result<String> {
    let request = TokenRequest {
        spec: TokenRequestSpec { expiration_seconds: Some(600), ..Default::default() },
        ..Default::default()
    };
    let issued = accounts.create_token_request(name, &PostParams::default(), &request).await?;
    Ok(issued.status.map(|s| s.token).unwrap_or_default())
}

/// Scrapes `origin`'s leader as the module says; `peer` is a region it mirrors into.
pub async fn scrape_leader(kind: &KindFederation, origin: &str, peer: &str) -> anyhow::Result<Scrape> {
    let kube = kind.kube(origin).await?;
    let leases: Api<Lease> = Api::namespaced(kube.clone(), NAMESPACE);
    let leader = leases
        .get("aether-operator-leader")
        .await?
        .spec
        .and_then(|s| s.holder_identity)
        .filter(|h| !h.is_empty())
        .ok_or_else(|| anyhow::anyhow!("nobody holds {origin}'s leader Lease"))?;
    let pods: Api<Pod> = Api::namespaced(kube.clone(), NAMESPACE);
    let deployment: Api<Deployment> = Api::namespaced(kube.clone(), NAMESPACE);
    let operator = deployment
        .get(KIND_RELEASE)
        .await?
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|s| s.containers.into_iter().find(|c| c.name == "operator"))
        .ok_or_else(|| anyhow::anyhow!("deployment/{KIND_RELEASE} in {origin} has no container named operator"))?;
    let secure = operator.args.iter().flatten().any(|a| a == "--metrics-secure" || a == "--metrics-secure=true");
    let port = operator
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("metrics"))
        .and_then(|p| u16::try_from(p.container_port).ok())
        .ok_or_else(|| anyhow::anyhow!("deployment/{KIND_RELEASE} in {origin} has no container port named metrics"))?;

    let accounts: Api<ServiceAccount> = Api::namespaced(kube.clone(), NAMESPACE);
    let apply = PatchParams::apply("aether-e2e").force();
    for name in [SCRAPER, UNBOUND] {
        let account = ServiceAccount {
            metadata: ObjectMeta { name: Some(name.into()), ..Default::default() },
            ..Default::default()
        };
        accounts.patch(name, &apply, &Patch::Apply(&account)).await?;
    }
    if secure {
        let roles: Api<ClusterRole> = Api::all(kube.clone());
        let listed =
            roles.list(&ListParams::default().labels(&format!("app.kubernetes.io/instance={KIND_RELEASE}"))).await?;
        let names: Vec<String> = listed.items.into_iter().filter_map(|r| r.metadata.name).collect();
        let role = names.iter().find(|n| n.ends_with("-metrics-reader")).ok_or_else(|| {
            anyhow::anyhow!(
                "the chart rendered no ClusterRole *-metrics-reader (metrics.secure is on); it has {names:?}"
            )
        })?;
        let binding = ClusterRoleBinding {
            metadata: ObjectMeta { name: Some(SCRAPER.into()), ..Default::default() },
            role_ref: RoleRef {
                api_group: "rbac.authorization.k8s.io".into(),
                kind: "ClusterRole".into(),
                name: role.clone(),
            },
            subjects: Some(vec![Subject {
                kind: "ServiceAccount".into(),
                name: SCRAPER.into(),
                namespace: Some(NAMESPACE.into()),
                ..Default::default()
            }]),
        };
        let bindings: Api<ClusterRoleBinding> = Api::all(kube.clone());
        bindings.patch(SCRAPER, &apply, &Patch::Apply(&binding)).await?;
    }
    let (bound, unbound) = (token(&accounts, SCRAPER).await?, token(&accounts, UNBOUND).await?);

    let (local, forwarding) = forward(pods, leader.clone(), port).await?;
    let server = format!("{}://127.0.0.1:{local}", if secure { "https" } else { "http" });
    let scraped = async {
        // The bound token: 200 (retried for 30 s, as the first connections may race the RBAC).
        let start = Instant::now();
        let body = loop {
            let asked = Instant::now();
            match aether_harness::https::get(&server, None, Some(&bound), "/metrics").await {
                Ok(body) => break (body, asked.elapsed()),
                Err(status) if start.elapsed() > Duration::from_secs(30) => {
                    anyhow::bail!("/metrics of {leader} with {SCRAPER}'s token: HTTP {status}, not 200")
                }
                Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
            }
        };
        let (body, took) = body;
        let families = body.lines().filter(|l| l.starts_with("# TYPE aether_federation_")).count();
        anyhow::ensure!(
            body.lines().any(|l| l.starts_with("aether_federation_build_info{")),
            "/metrics of {leader}: no aether_federation_build_info"
        );
        anyhow::ensure!(
            body.lines().any(|l| l == "aether_federation_leader 1"),
            "/metrics of {leader}: aether_federation_leader is not 1 on the leader"
        );
        let mirror = format!("aether_federation_mirrored_keys{{origin=\"{origin}\",target=\"{peer}\"}}");
        anyhow::ensure!(body.lines().any(|l| l.starts_with(&mirror)), "/metrics of {leader} has no {mirror}");
        // Refused: no token, a token that is none, an unbound ServiceAccount's token.
        let mut refused = Vec::new();
        for (what, token, expected) in [
            ("none", None, &[401, 403][..]),
            ("garbage", Some("not-a-token"), &[401][..]),
            ("unbound", Some(unbound.as_str()), &[403][..]),
        ] {
            let got = aether_harness::https::get(&server, None, token, "/metrics").await;
            match got {
                Err(status) if secure && expected.contains(&status) => refused.push((what, status)),
                Err(status) => {
                    anyhow::bail!("/metrics of {leader} with token '{what}': HTTP {status}, expected {expected:?}")
                }
                Ok(_) if !secure => refused.push((what, 200)),
                Ok(_) => anyhow::bail!("/metrics of {leader} with token '{what}' answered with the metrics"),
            }
        }
        anyhow::Ok(Scrape { leader: leader.clone(), secure, took, families, refused })
    }
    .await;
    forwarding.abort();
    scraped
}
