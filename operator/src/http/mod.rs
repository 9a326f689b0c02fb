//! /metrics (Prometheus text), /debug/doctor, /healthz and /readyz on one listener. Open (plain
//! HTTP), or secure: HTTPS, with /metrics and /debug/doctor served only to bearer tokens the API
//! server authenticates (TokenReview) and authorizes for `get` on that non-resource URL
//! (SubjectAccessReview), the way kubebuilder operators serve metrics. The probes stay open for
//! the kubelet.
//!
//! /debug/doctor/<namespace>/<name> runs `doctor`'s checks of that RegionPeering from here: with
//! the operator's network, identity and credentials, which is what the mirror uses
//! (`aether-operator doctor --in-cluster`).
//!
//! What reaches the port is bounded: connections, handshakes, heads and lifetimes (`listener`),
//! and the tokens' cost to the API server (`authorize`).
mod authorize;
mod listener;

pub use authorize::{Decision, MAX_TOKEN_BYTES};
pub use listener::MAX_CONNECTIONS;

use crate::metrics::Metrics;
use authorize::Authorizer;
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use kube::api::Api;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::Path;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
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

#[derive(Clone)]
struct AppState {
    metrics: Arc<Metrics>,
    /// The tasks' panics: a process whose tasks keep panicking is not healthy.
    supervision: Arc<crate::supervise::Supervision>,
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
        Ok(Decision::Throttled) => Some(
            (StatusCode::TOO_MANY_REQUESTS, [(header::RETRY_AFTER, "1")], "too many unknown tokens lately; retry\n")
                .into_response(),
        ),
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

/// `/healthz` and `/readyz`: ok, unless a task keeps panicking (`supervise`), so that the kubelet
/// restarts the process and a standby leads.
async fn health_handler(State(state): State<AppState>) -> Response {
    match state.supervision.verdict(std::time::Instant::now()) {
        Ok(()) => "ok".into_response(),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response(),
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
    // The doctor reads the RegionPeering and its Secrets with the operator's rights: only for a
    // caller who may read each of them itself.
    let (Some(authorizer), Some(token)) = (state.authorizer.as_ref(), bearer_token(&headers)) else {
        return (StatusCode::UNAUTHORIZED, "a bearer token is required\n").into_response();
    };
    let mut objects = vec![("regionpeerings", namespace.clone(), name.clone())];
    let api: Api<crate::api::RegionPeering> = Api::namespaced(client.clone(), &namespace);
    if let Ok(Some(rp)) = api.get_opt(&name).await {
        let secrets = std::iter::once(&rp.spec.local_etcd.tls)
            .chain(rp.spec.peers.iter().map(|p| &p.tls))
            .flatten()
            .map(|tls| ("secrets", namespace.clone(), tls.secret_ref.name.clone()));
        objects.extend(secrets);
    }
    match authorizer.may_read(token, &objects).await {
        Ok(None) => {}
        Ok(Some(why)) => return (StatusCode::FORBIDDEN, format!("{why}\n")).into_response(),
        Err(e) => {
            warn!(error = %e, "cannot review a caller's access to the doctor's objects");
            return (StatusCode::SERVICE_UNAVAILABLE, "cannot reach the API server to check access\n").into_response();
        }
    }
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
    supervision: Arc<crate::supervise::Supervision>,
    doctor: Option<(kube::Client, String)>,
    shutdown: CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let (tls, authorizer) = match access {
        MetricsAccess::Open => (None, None),
        MetricsAccess::Secure { identity, client } => {
            (Some(identity.acceptor()?), Some(Arc::new(Authorizer::new(client, metrics.clone()))))
        }
    };
    let (client, identity) = doctor.map_or((None, String::new()), |(c, i)| (Some(c), i));
    let app = Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/debug/doctor/{namespace}/{name}", get(doctor_handler))
        .route("/healthz", get(health_handler))
        .route("/readyz", get(health_handler))
        .with_state(AppState { metrics, supervision, authorizer, client, identity });
    let listener = TcpListener::bind(addr).await.map_err(|e| anyhow::anyhow!("binding {addr}: {e}"))?;
    Ok(tokio::spawn(listener::serve(listener, tls, app, shutdown)))
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
            Arc::default(),
            Some((client, "op-0".into())),
            stop.clone(),
        )
        .await
        .unwrap();
        let get = |path: &'static str| async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
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
