//! Commands for people: `status` (the whole federation through several kubeconfig contexts),
//! `doctor` (one RegionPeering's credentials against each etcd) and `report` (a support bundle). Installed as a kubectl plugin
//! too: the same binary, named `kubectl-aether`, answers `kubectl aether status`.
pub mod doctor;
pub mod in_cluster;
pub mod report;
pub mod status;
pub mod version;

use kube::config::{KubeConfigOptions, Kubeconfig};
use std::path::Path;
use std::time::Duration;

/// The kubeconfig named by `--kubeconfig`, or the one kubectl would use (KUBECONFIG, then
/// ~/.kube/config).
pub fn load_kubeconfig(path: Option<&Path>) -> anyhow::Result<Kubeconfig> {
    match path {
        Some(path) => Kubeconfig::read_from(path).map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display())),
        None => Kubeconfig::read()
            .map_err(|e| anyhow::anyhow!("reading the kubeconfig (KUBECONFIG or ~/.kube/config): {e}")),
    }
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
