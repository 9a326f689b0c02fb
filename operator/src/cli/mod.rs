//! Commands for people: `status` (the whole federation through several kubeconfig contexts) and
//! `doctor` (one RegionPeering's credentials against each etcd). Installed as a kubectl plugin
//! too: the same binary, named `kubectl-aether`, answers `kubectl aether status`.
pub mod doctor;
pub mod in_cluster;
pub mod status;

use kube::config::{KubeConfigOptions, Kubeconfig};
use std::path::Path;

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
