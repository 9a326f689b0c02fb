//! Setting up a fresh kube-apiserver for a test: CRDs and namespaces.
use crate::process::wait_until;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, PostParams};
use std::time::Duration;

/// Creates the CRDs and waits until each is Established.
pub async fn install_crds(client: &kube::Client, crds: Vec<CustomResourceDefinition>) -> anyhow::Result<()> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in &crds {
        api.create(&PostParams::default(), crd).await?;
    }
    for crd in crds {
        let name = crd.metadata.name.unwrap_or_default();
        wait_until(&format!("CRD {name} Established"), Duration::from_secs(30), || {
            let (api, name) = (api.clone(), name.clone());
            async move {
                let crd = api.get(&name).await?;
                Ok(crd
                    .status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == "Established" && c.status == "True"))
            }
        })
        .await?;
    }
    Ok(())
}

/// Creates the namespace if it is missing.
pub async fn ensure_namespace(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    if api.get_opt(name).await?.is_none() {
        let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?;
        api.create(&PostParams::default(), &ns).await?;
    }
    Ok(())
}
