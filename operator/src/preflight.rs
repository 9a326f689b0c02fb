//! Checks at start: the CRDs must be installed by the user (the operator never installs them), and
//! should be the ones this binary was built with.
use crate::api::{RegionPeering, SCHEMA_DIGEST_ANNOTATION};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams};
use tracing::{info, warn};

/// What the start-up check found about one CRD.
#[derive(Debug, PartialEq, Eq)]
pub enum CrdState {
    Current,
    /// Installed, but its schema differs from this binary's (installed digest, if any).
    Different(Option<String>),
    Missing,
    /// The operator may not read CRDs (a namespaced install).
    Unreadable,
}

/// Pure: compares an installed CRD with the binary's.
pub fn crd_state(installed: Option<&CustomResourceDefinition>, ours: &CustomResourceDefinition) -> CrdState {
    let Some(installed) = installed else { return CrdState::Missing };
    let digest = |crd: &CustomResourceDefinition| {
        crd.metadata.annotations.as_ref().and_then(|a| a.get(SCHEMA_DIGEST_ANNOTATION)).cloned()
    };
    let theirs = digest(installed);
    if theirs.is_some() && theirs == digest(ours) { CrdState::Current } else { CrdState::Different(theirs) }
}

pub async fn check_crds(client: &kube::Client, namespaces: &[Option<String>]) -> anyhow::Result<()> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut missing = Vec::new();
    for ours in crate::api::all_crds() {
        let name = ours.metadata.name.clone().unwrap_or_default();
        let state = match api.get_opt(&name).await {
            Ok(installed) => crd_state(installed.as_ref(), &ours),
            Err(kube::Error::Api(e)) if e.code == 403 => CrdState::Unreadable,
            Err(e) => anyhow::bail!("cannot check the CRD {name}: {e}"),
        };
        match state {
            CrdState::Current => {}
            CrdState::Missing => missing.push(name),
            CrdState::Different(_) => warn!(
                crd = %name,
                "the installed CRD differs from this operator's; apply the CRDs of this version: \
                 `kubectl apply --server-side -f crds/` (Helm never upgrades the chart's crds/)"
            ),
            CrdState::Unreadable => {
                // A namespaced install: listing what we serve tells whether the kinds exist.
                let ns = namespaces.iter().flatten().next();
                let peerings: Api<RegionPeering> = match ns {
                    Some(ns) => Api::namespaced(client.clone(), ns),
                    None => Api::all(client.clone()),
                };
                match peerings.list_metadata(&ListParams::default().limit(1)).await {
                    Ok(_) => info!(crd = %name, "may not read CRDs (a namespaced install): not checking their version"),
                    Err(kube::Error::Api(e)) if e.code == 404 => missing.push(name),
                    Err(e) => anyhow::bail!("cannot check the CRD {name}: {e}"),
                }
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crd_is_current_only_when_its_digest_matches() {
        let ours = crate::api::all_crds().remove(0);
        assert_eq!(crd_state(Some(&ours), &ours), CrdState::Current);
        assert_eq!(crd_state(None, &ours), CrdState::Missing);
        let mut older = ours.clone();
        older.spec.versions[0].served = false;
        older
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(SCHEMA_DIGEST_ANNOTATION.into(), crate::api::schema_digest(&older.spec));
        assert!(matches!(crd_state(Some(&older), &ours), CrdState::Different(Some(_))));
        let mut unannotated = ours.clone();
        unannotated.metadata.annotations = None;
        assert_eq!(crd_state(Some(&unannotated), &ours), CrdState::Different(None));
    }
}
