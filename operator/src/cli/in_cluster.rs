//! `doctor --in-cluster`: the same checks, run by the region's leader from its pod, with the
//! operator's network, identity and credentials (what the mirror itself uses), instead of from
//! the person's machine. The leader serves them on its metrics port (`/debug/doctor`, behind the
//! same TokenReview and SubjectAccessReview as /metrics, and only for objects the caller may read
//! itself); this reaches it through a port-forward to the leader's pod (found from the leader
//! Lease, not from a status field anyone with status access could write), or at a URL given. The
//! bearer token goes only to a server whose certificate verifies against `--metrics-ca`, unless
//! the person says `--insecure-skip-tls-verify`.
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
    /// A port-forward to the pod holding the leader Lease `lease` ("namespace/name") on `port`.
    Leader { port: u16, https: bool, lease: String },
    /// A URL of the operator's metrics listener (`https://host:8443`).
    Url(String),
}

/// How the operator's certificate is trusted.
pub enum Trust {
    /// Verified against these CA certificates (PEM), for this server name.
    Ca { pem: Vec<u8>, server_name: Option<String> },
    /// Not verified: the person said so.
    Insecure,
    /// Nothing given: the token is not sent over HTTPS.
    None,
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
    trust: Trust,
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
            let host = authority.rsplit_once(':').map_or(authority.as_str(), |(h, _)| h).to_string();
            get(stream, https, &authority, &host, &path, trust, token)
                .await
                .map_err(|e| anyhow::anyhow!("the operator at {url}: {e:#}"))
        }
        Reach::Leader { port, https, lease } => {
            let (namespace, name) = lease
                .split_once('/')
                .ok_or_else(|| anyhow::anyhow!("--leader-lease {lease}: give it as namespace/name"))?;
            let leases: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(client.clone(), namespace);
            let held =
                leases.get_opt(name).await.map_err(|e| anyhow::anyhow!("reading the leader Lease {lease}: {e}"))?;
            let pod = held.and_then(|l| l.spec).and_then(|s| s.holder_identity).filter(|h| !h.is_empty()).ok_or_else(
                || anyhow::anyhow!("the leader Lease {lease} is held by nobody: is the operator running?"),
            )?;
            let namespace = namespace.to_string();
            let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
            let mut forward = pods
                .portforward(&pod, &[port])
                .await
                .map_err(|e| anyhow::anyhow!("port-forwarding to the leader {namespace}/{pod}:{port}: {e}"))?;
            let stream = forward
                .take_stream(port)
                .ok_or_else(|| anyhow::anyhow!("port-forwarding to the leader {namespace}/{pod}:{port}: no stream"))?;
            get(stream, https, "localhost", "localhost", &path, trust, token)
                .await
                .map_err(|e| anyhow::anyhow!("the leader {namespace}/{pod}: {e:#}"))
        }
    }
}

/// GET `path` over `stream` (HTTP/1.1, in TLS when `https`, verifying the certificate as `trust`
/// says for `host`).
async fn get<S>(
    stream: S,
    https: bool,
    authority: &str,
    host: &str,
    path: &str,
    trust: Trust,
    token: Option<&str>,
) -> anyhow::Result<Answer>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut request = http::Request::get(path).header(http::header::HOST, authority);
    if let Some(token) = token {
        request = request.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let request = request.body(http_body_util::Empty::<bytes::Bytes>::new())?;
    let response = if https {
        let builder = tokio_rustls::rustls::ClientConfig::builder_with_provider(Arc::new(
            tokio_rustls::rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?;
        let (config, name) = match trust {
            Trust::Ca { pem, server_name } => {
                use rustls_pki_types::pem::PemObject;
                let mut roots = tokio_rustls::rustls::RootCertStore::empty();
                for cert in rustls_pki_types::CertificateDer::pem_slice_iter(&pem) {
                    roots.add(cert.map_err(|e| anyhow::anyhow!("--metrics-ca: {e}"))?)?;
                }
                anyhow::ensure!(!roots.is_empty(), "--metrics-ca holds no certificate");
                let config = builder.with_root_certificates(roots).with_no_client_auth();
                (config, server_name.unwrap_or_else(|| host.to_string()))
            }
            Trust::Insecure => {
                let config = builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(AnyCertificate))
                    .with_no_client_auth();
                (config, "localhost".to_string())
            }
            Trust::None => anyhow::bail!(
                "the operator's certificate cannot be verified, and the bearer token is not sent to a server that is not: give --metrics-ca (the CA of the certificate in metrics.certSecret) or, knowing what it means, --insecure-skip-tls-verify"
            ),
        };
        let name = rustls_pki_types::ServerName::try_from(name)?.to_owned();
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

/// Accepts the operator's certificate whatever it is: only with `--insecure-skip-tls-verify`.
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
