//! A GET as a scraper or a probe makes it: to an HTTPS (or HTTP) endpoint, trusting a CA or not
//! verifying at all, with a bearer token or none. Built on kube's client, which already speaks TLS
//! and bearer tokens.
use std::path::Path;

/// GETs `path` from `server` (`https://host:port`), verifying it with `ca` (or not at all), with
/// `token` as the bearer token if given: the body, or the HTTP status it was refused with (0 when
/// the request got no answer).
pub async fn get(server: &str, ca: Option<&Path>, token: Option<&str>, path: &str) -> Result<String, u16> {
    let mut cluster = serde_json::json!({"server": server});
    match ca {
        Some(ca) => cluster["certificate-authority"] = ca.display().to_string().into(),
        None if server.starts_with("https:") => cluster["insecure-skip-tls-verify"] = true.into(),
        None => {}
    }
    let user = token.map_or_else(|| serde_json::json!({}), |t| serde_json::json!({"token": t}));
    let kubeconfig = serde_json::json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "m", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "m", "context": {"cluster": "m", "user": "u"}}],
        "current-context": "m",
    });
    let Ok(kubeconfig) = serde_json::from_value::<kube::config::Kubeconfig>(kubeconfig) else { return Err(0) };
    let Ok(config) = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await else { return Err(0) };
    let Ok(client) = kube::Client::try_from(config) else { return Err(0) };
    let Ok(request) = http::Request::get(path).body(Vec::new()) else { return Err(0) };
    match client.request_text(request).await {
        Ok(body) => Ok(body),
        Err(kube::Error::Api(e)) => Err(e.code),
        Err(_) => Err(0),
    }
}
