//! Checks at start: the CRDs must be installed by the user (the operator never installs them).
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::Api;

pub async fn check_crds(client: &kube::Client) -> anyhow::Result<()> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut missing = Vec::new();
    for crd in crate::api::all_crds() {
        let name = crd.metadata.name.unwrap_or_default();
        match api.get_opt(&name).await {
            Ok(Some(_)) => {}
            Ok(None) => missing.push(name),
            Err(e) => anyhow::bail!(
                "cannot check the CRD {name}: {e} (the operator's role needs get on customresourcedefinitions)"
            ),
        }
    }
    if !missing.is_empty() {
        anyhow::bail!(
            "the CRDs {} are not installed; install them with `kubectl apply -f crds/` (or the Helm chart) and start the operator again",
            missing.join(", ")
        );
    }
    Ok(())
}
