//! Commands for people: `status` (the whole federation through several kubeconfig contexts),
//! `doctor` (one RegionPeering's credentials against each etcd) and `report` (a support bundle). Installed as a kubectl plugin
//! too: the same binary, named `kubectl-aether`, answers `kubectl aether status`.
pub mod doctor;
pub mod from_leader;
pub mod in_cluster;
pub mod report;
pub mod status;
pub mod version;

use kube::config::{KubeConfigOptions, Kubeconfig};
use std::path::Path;
use std::time::Duration;

/// The kubeconfig named by `--kubeconfig`, or the one kubectl would use (KUBECONFIG, then
/// ~/.kube/config), or, in a pod with neither, the pod's own service account as the context
/// `in-cluster` (as kubectl does in a pod).
pub fn load_kubeconfig(path: Option<&Path>) -> anyhow::Result<Kubeconfig> {
    match path {
        Some(path) => Kubeconfig::read_from(path).map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display())),
        None => Kubeconfig::read().or_else(|e| {
            in_cluster_kubeconfig(
                std::env::var("KUBERNETES_SERVICE_HOST").ok(),
                std::env::var("KUBERNETES_SERVICE_PORT").ok(),
            )
            .ok_or_else(|| anyhow::anyhow!("reading the kubeconfig (KUBECONFIG or ~/.kube/config): {e}"))
        }),
    }
}

/// Where a pod finds its service account's token, CA and namespace.
const SERVICE_ACCOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The pod's service account as a one-context kubeconfig, when in a pod (the API server's address
/// in the environment and the account's token mounted).
fn in_cluster_kubeconfig(host: Option<String>, port: Option<String>) -> Option<Kubeconfig> {
    let token = format!("{SERVICE_ACCOUNT}/token");
    if !Path::new(&token).exists() {
        return None;
    }
    let namespace = std::fs::read_to_string(format!("{SERVICE_ACCOUNT}/namespace")).ok();
    in_cluster_config(&host?, &port.unwrap_or_else(|| "443".into()), namespace.as_deref().map(str::trim))
}

/// The kubeconfig of an API server at `host`:`port`, with the mounted token and CA (pure).
fn in_cluster_config(host: &str, port: &str, namespace: Option<&str>) -> Option<Kubeconfig> {
    let host = if host.contains(':') { format!("[{host}]") } else { host.to_string() };
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "in-cluster", "cluster": {
            "server": format!("https://{host}:{port}"),
            "certificate-authority": format!("{SERVICE_ACCOUNT}/ca.crt"),
        }}],
        "users": [{"name": "in-cluster", "user": {"tokenFile": format!("{SERVICE_ACCOUNT}/token")}}],
        "contexts": [{"name": "in-cluster", "context": {"cluster": "in-cluster", "user": "in-cluster", "namespace": namespace}}],
        "current-context": "in-cluster",
    }))
    .ok()
}

/// A client for one context of `kubeconfig` (its current context when `context` is None).
pub async fn client_for(kubeconfig: &Kubeconfig, context: Option<&str>) -> anyhow::Result<kube::Client> {
    let options = KubeConfigOptions { context: context.map(String::from), ..Default::default() };
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig.clone(), &options).await?;
    config.connect_timeout = Some(std::time::Duration::from_secs(5));
    config.read_timeout = Some(std::time::Duration::from_secs(15));
    Ok(kube::Client::try_from(config)?)
}

/// A duration as kubectl takes one (`30s`, `5m`, `1h30m`, `1.5s`), or bare seconds (`300`).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if let Ok(seconds) = text.parse::<u64>() {
        return Ok(Duration::from_secs(seconds));
    }
    let invalid = || format!("{text:?} is not a duration: give e.g. 30s, 5m or 1h30m (or bare seconds)");
    let mut total = 0f64;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).ok_or_else(invalid)?;
        let number: f64 = rest[..digits].parse().map_err(|_| invalid())?;
        rest = &rest[digits..];
        let unit = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let scale = match &rest[..unit] {
            "ms" => 0.001,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(invalid()),
        };
        total += number * scale;
        rest = &rest[unit..];
    }
    if text.is_empty() || !total.is_finite() || total > 1e9 {
        return Err(invalid());
    }
    Ok(Duration::from_secs_f64(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_a_pod_the_service_account_is_the_context() {
        let config = in_cluster_config("10.96.0.1", "443", Some("aether-system")).unwrap();
        assert_eq!(config.current_context.as_deref(), Some("in-cluster"));
        let cluster = config.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(cluster.server.as_deref(), Some("https://10.96.0.1:443"));
        assert_eq!(
            cluster.certificate_authority.as_deref(),
            Some("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
        );
        let user = config.auth_infos[0].auth_info.as_ref().unwrap();
        assert_eq!(user.token_file.as_deref(), Some("/var/run/secrets/kubernetes.io/serviceaccount/token"));
        assert_eq!(config.contexts[0].context.as_ref().unwrap().namespace.as_deref(), Some("aether-system"));
        let v6 = in_cluster_config("fd00::1", "6443", None).unwrap();
        assert_eq!(v6.clusters[0].cluster.as_ref().unwrap().server.as_deref(), Some("https://[fd00::1]:6443"));
    }

    #[test]
    fn durations_read_as_kubectl_writes_them_or_as_bare_seconds() {
        let d = |s| parse_duration(s).map(|d| d.as_millis());
        assert_eq!(d("300"), Ok(300_000));
        assert_eq!(d("30s"), Ok(30_000));
        assert_eq!(d("5m"), Ok(300_000));
        assert_eq!(d("1h30m"), Ok(5_400_000));
        assert_eq!(d("1.5s"), Ok(1_500));
        assert_eq!(d("250ms"), Ok(250));
        for bad in ["", "5x", "m", "-3s", "1e400s", "5m3"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }
}
