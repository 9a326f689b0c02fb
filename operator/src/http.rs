//! /metrics (Prometheus text), /debug/doctor, /healthz and /readyz on one listener. Open (plain
//! HTTP), or secure: HTTPS, with /metrics and /debug/doctor served only to bearer tokens the API
//! server authenticates (TokenReview) and authorizes for `get` on that non-resource URL
//! (SubjectAccessReview), the way kubebuilder operators serve metrics. The probes stay open for
//! the kubelet.
//!
//! /debug/doctor/<namespace>/<name> runs `doctor`'s checks of that RegionPeering from here: with
//! the operator's network, identity and credentials, which is what the mirror uses
//! (`aether-operator doctor --in-cluster`).
use crate::metrics::Metrics;
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use kube::api::{Api, PostParams};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// Who may read /metrics.
pub enum MetricsAccess {
    Open,
    Secure { identity: ServerIdentity, client: kube::Client },
}

/// The certificate chain and key the secure endpoint presents.
pub struct ServerIdentity {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl ServerIdentity {
    /// tls.crt and tls.key from a directory (a mounted kubernetes.io/tls Secret).
    pub fn from_dir(dir: &Path) -> anyhow::Result<Self> {
        let (crt, key) = (dir.join("tls.crt"), dir.join("tls.key"));
        let chain = CertificateDer::pem_file_iter(&crt)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| anyhow::anyhow!("reading the metrics certificate {}: {e}", crt.display()))?;
        anyhow::ensure!(!chain.is_empty(), "{} holds no certificate", crt.display());
        let key = PrivateKeyDer::from_pem_file(&key)
            .map_err(|e| anyhow::anyhow!("reading the metrics key {}: {e}", key.display()))?;
        Ok(ServerIdentity { chain, key })
    }

    /// A self-signed certificate for this pod (scrapers skip verification or pin nothing).
    pub fn self_signed() -> anyhow::Result<Self> {
        let host = std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
        let names: Vec<String> = ["localhost".to_string(), host].into_iter().filter(|n| !n.is_empty()).collect();
        let generated = rcgen::generate_simple_self_signed(names)?;
        Ok(ServerIdentity {
            chain: vec![generated.cert.der().clone()],
            key: PrivateKeyDer::try_from(generated.signing_key.serialize_der())
                .map_err(|e| anyhow::anyhow!("the generated key: {e}"))?,
        })
    }

    fn acceptor(self) -> anyhow::Result<TlsAcceptor> {
        let config = tokio_rustls::rustls::ServerConfig::builder_with_provider(Arc::new(
            tokio_rustls::rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(self.chain, self.key)?;
        Ok(TlsAcceptor::from(Arc::new(config)))
    }
}

/// The outcome of checking a scraper's token.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Decision {
    Allowed,
    Unauthenticated,
    Forbidden(String),
}

/// Asks the API server who a token is and whether it may read /metrics; answers are kept for a
/// few seconds so a scrape costs no API call most of the time.
struct Authorizer {
    client: kube::Client,
    cache: Mutex<HashMap<Asked, (Instant, Decision)>>,
}

/// A token and the non-resource URL it asked for.
type Asked = (String, &'static str);

const DECISION_TTL: Duration = Duration::from_secs(10);
const DECISION_CACHE_ENTRIES: usize = 1024;

impl Authorizer {
    /// Whether `token` may `get` the non-resource URL `path`.
    async fn decide(&self, token: &str, path: &'static str) -> Result<Decision, kube::Error> {
        let key = (token.to_string(), path);
        if let Some((at, decision)) = self.cache.lock().expect("not poisoned").get(&key)
            && at.elapsed() < DECISION_TTL
        {
            return Ok(decision.clone());
        }
        let decision = self.ask(token, path).await?;
        let mut cache = self.cache.lock().expect("not poisoned");
        if cache.len() >= DECISION_CACHE_ENTRIES {
            cache.clear();
        }
        cache.insert(key, (Instant::now(), decision.clone()));
        Ok(decision)
    }

    async fn ask(&self, token: &str, path: &'static str) -> Result<Decision, kube::Error> {
        let review = TokenReview {
            spec: TokenReviewSpec { token: Some(token.to_string()), ..Default::default() },
            ..Default::default()
        };
        let reviewed = Api::<TokenReview>::all(self.client.clone()).create(&PostParams::default(), &review).await?;
        let Some(status) = reviewed.status.filter(|s| s.authenticated == Some(true)) else {
            return Ok(Decision::Unauthenticated);
        };
        let user = status.user.unwrap_or_default();
        let access = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username.clone(),
                uid: user.uid,
                groups: user.groups,
                extra: user.extra,
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some(path.into()),
                    verb: Some("get".into()),
                }),
                ..Default::default()
            },
            ..Default::default()
        };
        let reviewed =
            Api::<SubjectAccessReview>::all(self.client.clone()).create(&PostParams::default(), &access).await?;
        let allowed = reviewed.status.as_ref().is_some_and(|s| s.allowed);
        Ok(if allowed {
            Decision::Allowed
        } else {
            Decision::Forbidden(format!(
                "{} may not get {path} (bind it to the metrics reader ClusterRole)",
                user.username.unwrap_or_default()
            ))
        })
    }
}

#[derive(Clone)]
struct AppState {
    metrics: Arc<Metrics>,
    authorizer: Option<Arc<Authorizer>>,
    /// The operator's own client, for /debug/doctor.
    client: Option<kube::Client>,
    /// This instance's name, said with the doctor's findings.
    identity: String,
}

fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    (scheme.eq_ignore_ascii_case("bearer") && !token.trim().is_empty()).then(|| token.trim())
}

/// The refusal of a request the secure endpoint does not allow, if it does not.
async fn refused(state: &AppState, headers: &HeaderMap, path: &'static str) -> Option<Response> {
    let authorizer = state.authorizer.as_ref()?;
    let Some(token) = bearer_token(headers) else {
        return Some((StatusCode::UNAUTHORIZED, "a bearer token is required\n").into_response());
    };
    match authorizer.decide(token, path).await {
        Ok(Decision::Allowed) => None,
        Ok(Decision::Unauthenticated) => Some((StatusCode::UNAUTHORIZED, "the token is not valid\n").into_response()),
        Ok(Decision::Forbidden(why)) => {
            debug!(%why, path, "request refused");
            Some((StatusCode::FORBIDDEN, format!("{why}\n")).into_response())
        }
        Err(e) => {
            warn!(error = %e, path, "cannot review a caller's token");
            Some((StatusCode::SERVICE_UNAVAILABLE, "cannot reach the API server to check the token\n").into_response())
        }
    }
}

async fn metrics_handler(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if let Some(refusal) = refused(&state, &headers, "/metrics").await {
        return refusal;
    }
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], state.metrics.encode())
        .into_response()
}

/// `doctor`'s checks of one RegionPeering, run from this pod.
async fn doctor_handler(
    State(state): State<AppState>,
    headers: HeaderMap,
    axum::extract::Path((namespace, name)): axum::extract::Path<(String, String)>,
) -> Response {
    // The checks dial every etcd with the operator's credentials: never for an unauthenticated
    // caller, so not at all on the open listener.
    if state.authorizer.is_none() {
        return (
            StatusCode::FORBIDDEN,
            "/debug/doctor is served only on the secure endpoint (--metrics-secure), to callers allowed to get it\n",
        )
            .into_response();
    }
    if let Some(refusal) = refused(&state, &headers, DOCTOR_PATH).await {
        return refusal;
    }
    let Some(client) = state.client.clone() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "this instance has no API client\n").into_response();
    };
    let api: Api<crate::api::RegionPeering> = Api::namespaced(client.clone(), &namespace);
    let rp = match api.get_opt(&name).await {
        Ok(Some(rp)) => rp,
        Ok(None) => return (StatusCode::NOT_FOUND, format!("no RegionPeering {namespace}/{name}\n")).into_response(),
        Err(e) => {
            return (StatusCode::BAD_GATEWAY, format!("reading RegionPeering {namespace}/{name}: {e}\n"))
                .into_response();
        }
    };
    let findings = crate::cli::doctor::run(&client, &rp).await;
    let body = serde_json::json!({ "checkedFrom": format!("operator pod {}", state.identity), "findings": findings });
    ([(header::CONTENT_TYPE, "application/json")], body.to_string()).into_response()
}

/// The non-resource URL a caller of /debug/doctor must be allowed to `get`.
pub const DOCTOR_PATH: &str = "/debug/doctor";

/// Serves until `shutdown`; the listener is bound before this returns.
pub async fn serve(
    addr: &str,
    access: MetricsAccess,
    metrics: Arc<Metrics>,
    doctor: Option<(kube::Client, String)>,
    shutdown: CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let (tls, authorizer) = match access {
        MetricsAccess::Open => (None, None),
        MetricsAccess::Secure { identity, client } => {
            (Some(identity.acceptor()?), Some(Arc::new(Authorizer { client, cache: Mutex::new(HashMap::new()) })))
        }
    };
    let (client, identity) = doctor.map_or((None, String::new()), |(c, i)| (Some(c), i));
    let app = Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/debug/doctor/{namespace}/{name}", get(doctor_handler))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(|| async { "ok" }))
        .with_state(AppState { metrics, authorizer, client, identity });
    let listener = TcpListener::bind(addr).await.map_err(|e| anyhow::anyhow!("binding {addr}: {e}"))?;
    let stopped = async move { shutdown.cancelled().await };
    Ok(match tls {
        None => tokio::spawn(async move {
            let _ = axum::serve(listener, app).with_graceful_shutdown(stopped).await;
        }),
        Some(acceptor) => {
            let listener = TlsListener::start(listener, acceptor)?;
            tokio::spawn(async move {
                let _ = axum::serve(listener, app).with_graceful_shutdown(stopped).await;
            })
        }
    })
}

/// Connections whose TLS handshake completed. Handshakes run in their own tasks (with a
/// deadline), so a slow or silent client never holds up the others.
struct TlsListener {
    ready: tokio::sync::mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    accepting: tokio::task::JoinHandle<()>,
}

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

impl TlsListener {
    fn start(listener: TcpListener, acceptor: TlsAcceptor) -> anyhow::Result<Self> {
        let local = listener.local_addr()?;
        let (tx, ready) = tokio::sync::mpsc::channel(64);
        let accepting = tokio::spawn(async move {
            loop {
                let (stream, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        debug!(error = %e, "accepting a metrics connection");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => debug!(%peer, error = %e, "metrics TLS handshake failed"),
                        Err(_) => debug!(%peer, "metrics TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { ready, local, accepting })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(connection) => connection,
            // The accepting task ended (it only does when aborted): nothing more will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_bearer_token_is_taken() {
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::AUTHORIZATION, value.parse().unwrap());
            headers
        };
        assert_eq!(bearer_token(&with("Bearer abc")), Some("abc"));
        assert_eq!(bearer_token(&with("bearer  abc ")), Some("abc"));
        assert_eq!(bearer_token(&with("Basic abc")), None);
        assert_eq!(bearer_token(&with("Bearer ")), None);
        assert_eq!(bearer_token(&HeaderMap::new()), None);
    }

    #[tokio::test]
    async fn the_open_listener_serves_metrics_and_probes_but_never_the_doctor() {
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap().port()
        };
        let client = kube::Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap();
        let stop = CancellationToken::new();
        let server = serve(
            &format!("127.0.0.1:{port}"),
            MetricsAccess::Open,
            Arc::new(Metrics::default()),
            Some((client, "op-0".into())),
            stop.clone(),
        )
        .await
        .unwrap();
        let get = |path: &'static str| async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
            s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes()).await.unwrap();
            let mut response = String::new();
            s.read_to_string(&mut response).await.unwrap();
            response
        };
        let doctor = get("/debug/doctor/fed/a").await;
        assert!(doctor.starts_with("HTTP/1.0 403") && doctor.contains("--metrics-secure"), "{doctor}");
        assert!(get("/healthz").await.starts_with("HTTP/1.0 200"));
        assert!(get("/metrics").await.contains("aether_federation_"));
        stop.cancel();
        server.await.unwrap();
    }
}
