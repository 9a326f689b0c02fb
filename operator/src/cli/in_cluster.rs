//! `doctor --in-cluster`: the same checks, run by the region's leader from its pod, with the
//! operator's network, identity and credentials (what the mirror itself uses), instead of from
//! the person's machine. The leader serves them on its metrics port (`/debug/doctor`, behind the
//! same TokenReview and SubjectAccessReview as /metrics); this reaches it through a port-forward
//! to the leader's pod, or at a URL given.
use super::doctor::Finding;
use crate::api::RegionPeering;
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::Api;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};

/// Where the operator is reached.
pub enum Reach {
    /// A port-forward to the leader's pod (named by the RegionPeering's status) on `port`.
    Leader { port: u16, https: bool },
    /// A URL of the operator's metrics listener (`https://host:8443`).
    Url(String),
}

/// The operator's answer: who checked, and the findings.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Answer {
    pub checked_from: String,
    pub findings: Vec<Finding>,
}

/// Asks the operator to check `rp`, authenticating with `token` (a bearer token the API server
/// knows: the operator reviews it).
pub async fn ask(
    client: &kube::Client,
    rp: &RegionPeering,
    reach: Reach,
    token: Option<&str>,
) -> anyhow::Result<Answer> {
    let path = format!("/debug/doctor/{}/{}", rp.namespace().unwrap_or_default(), rp.name_any());
    match reach {
        Reach::Url(url) => {
            let (https, authority) = match url.split_once("://") {
                Some(("https", rest)) => (true, rest.trim_end_matches('/').to_string()),
                Some(("http", rest)) => (false, rest.trim_end_matches('/').to_string()),
                _ => anyhow::bail!("--operator-url {url}: give it as https://host:port or http://host:port"),
            };
            let stream = tokio::net::TcpStream::connect(&authority)
                .await
                .map_err(|e| anyhow::anyhow!("connecting to the operator at {url}: {e}"))?;
            get(stream, https, &authority, &path, token)
                .await
                .map_err(|e| anyhow::anyhow!("the operator at {url}: {e:#}"))
        }
        Reach::Leader { port, https } => {
            let status = rp.status.clone().unwrap_or_default();
            let pod = status.leader.ok_or_else(|| {
                anyhow::anyhow!("the RegionPeering's status names no leader: is the operator running?")
            })?;
            let namespace = status
                .leader_lease
                .as_deref()
                .and_then(|l| l.split_once('/'))
                .map(|(ns, _)| ns.to_string())
                .ok_or_else(|| anyhow::anyhow!("the RegionPeering's status does not say where the operator runs"))?;
            let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
            let mut forward = pods
                .portforward(&pod, &[port])
                .await
                .map_err(|e| anyhow::anyhow!("port-forwarding to the leader {namespace}/{pod}:{port}: {e}"))?;
            let stream = forward
                .take_stream(port)
                .ok_or_else(|| anyhow::anyhow!("port-forwarding to the leader {namespace}/{pod}:{port}: no stream"))?;
            get(stream, https, "localhost", &path, token)
                .await
                .map_err(|e| anyhow::anyhow!("the leader {namespace}/{pod}: {e:#}"))
        }
    }
}

/// GET `path` over `stream` (HTTP/1.1, in TLS when `https`).
async fn get<S>(stream: S, https: bool, authority: &str, path: &str, token: Option<&str>) -> anyhow::Result<Answer>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut request = http::Request::get(path).header(http::header::HOST, authority);
    if let Some(token) = token {
        request = request.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let request = request.body(http_body_util::Empty::<bytes::Bytes>::new())?;
    let response = if https {
        // The operator's certificate is its own (self-signed unless a Secret gives one): the
        // channel to it is the API server's port-forward to the named pod, or a URL the person
        // chose, so the certificate is not verified; the bearer token is still reviewed there.
        let config = tokio_rustls::rustls::ClientConfig::builder_with_provider(Arc::new(
            tokio_rustls::rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCertificate))
        .with_no_client_auth();
        let name = rustls_pki_types::ServerName::try_from("localhost")?.to_owned();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, stream).await?;
        send(tls, request).await?
    } else {
        send(stream, request).await?
    };
    let (parts, body) = response.into_parts();
    let body = body.collect().await?.to_bytes();
    let text = String::from_utf8_lossy(&body);
    match parts.status {
        http::StatusCode::OK => Ok(serde_json::from_slice(&body)?),
        http::StatusCode::UNAUTHORIZED => anyhow::bail!(
            "refused the token ({}): --in-cluster needs a bearer token the API server knows (--token, or a token in the kubeconfig)",
            text.trim()
        ),
        http::StatusCode::FORBIDDEN => {
            anyhow::bail!("{} (the chart's ClusterRole <namespace>-<release>-doctor allows it)", text.trim())
        }
        other => anyhow::bail!("answered {other}: {}", text.trim()),
    }
}

async fn send<S>(
    stream: S,
    request: http::Request<http_body_util::Empty<bytes::Bytes>>,
) -> anyhow::Result<http::Response<hyper::body::Incoming>>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    Ok(sender.send_request(request).await?)
}

/// Accepts the operator's certificate whatever it is (see `get`).
#[derive(Debug)]
struct AnyCertificate;

impl tokio_rustls::rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &rustls_pki_types::CertificateDer<'_>,
        _: &[rustls_pki_types::CertificateDer<'_>],
        _: &rustls_pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls_pki_types::UnixTime,
    ) -> Result<tokio_rustls::rustls::client::danger::ServerCertVerified, tokio_rustls::rustls::Error> {
        Ok(tokio_rustls::rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls_pki_types::CertificateDer<'_>,
        dss: &tokio_rustls::rustls::DigitallySignedStruct,
    ) -> Result<tokio_rustls::rustls::client::danger::HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        tokio_rustls::rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &tokio_rustls::rustls::crypto::ring::default_provider().signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls_pki_types::CertificateDer<'_>,
        dss: &tokio_rustls::rustls::DigitallySignedStruct,
    ) -> Result<tokio_rustls::rustls::client::danger::HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        tokio_rustls::rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &tokio_rustls::rustls::crypto::ring::default_provider().signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<tokio_rustls::rustls::SignatureScheme> {
        tokio_rustls::rustls::crypto::ring::default_provider().signature_verification_algorithms.supported_schemes()
    }
}
