//! `version`: this client's version, and per context whether the installed CRDs are the ones it
//! was built with and which version the leading operator runs, so that skew between the three is
//! seen before it bites (a plugin older than the CRDs misreads status; CRDs older than the
//! operator reject what it writes).
use crate::preflight::{CrdState, crd_state};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::Api;

/// The label the chart puts on the operator's pods: the version it runs.
const VERSION_LABEL: &str = "app.kubernetes.io/version";

/// What one context runs.
#[derive(Debug, Default, PartialEq)]
pub struct Installed {
    /// Each CRD's state against this client's.
    pub crds: Vec<(String, CrdState)>,
    /// The leader's pod and the version it runs (its label, else its image's tag).
    pub operator: Option<(String, String)>,
    /// What could not be read.
    pub errors: Vec<String>,
}

/// Reads the CRDs and the leader named by `leader_lease` ("namespace/name").
pub async fn read(client: &Client, leader_lease: &str) -> Installed {
    let mut installed = Installed::default();
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for ours in crate::api::all_crds() {
        let name = ours.metadata.name.clone().unwrap_or_default();
        match crds.get_opt(&name).await {
            Ok(theirs) => installed.crds.push((name, crd_state(theirs.as_ref(), &ours))),
            Err(e) => installed.errors.push(format!("the CRD {name}: {e}")),
        }
    }
    let (namespace, lease) = leader_lease.split_once('/').unwrap_or(("aether-system", leader_lease));
    let holder = match Api::<Lease>::namespaced(client.clone(), namespace).get_opt(lease).await {
        Ok(found) => found.and_then(|l| l.spec?.holder_identity).filter(|h| !h.is_empty()),
        Err(e) => {
            installed.errors.push(format!("the Lease {leader_lease}: {e}"));
            None
        }
    };
    let Some(holder) = holder else {
        installed.errors.push(format!("no operator holds the Lease {leader_lease}"));
        return installed;
    };
    match Api::<Pod>::namespaced(client.clone(), namespace).get_opt(&holder).await {
        Ok(Some(pod)) => installed.operator = Some((holder, version_of(&pod))),
        Ok(None) => installed.errors.push(format!("the leader {holder} is not a pod in {namespace}")),
        Err(e) => installed.errors.push(format!("the leader's pod {namespace}/{holder}: {e}")),
    }
    installed
}

/// The version a pod of the operator runs: its version label, else its image's tag.
pub fn version_of(pod: &Pod) -> String {
    if let Some(v) = pod.metadata.labels.as_ref().and_then(|l| l.get(VERSION_LABEL)) {
        return v.clone();
    }
    let image = pod.spec.as_ref().and_then(|s| s.containers.first()).and_then(|c| c.image.clone()).unwrap_or_default();
    let image = image.split('@').next().unwrap_or_default();
    match image.rsplit_once(':') {
        Some((_, tag)) if !tag.contains('/') => tag.to_string(),
        _ => "unknown".into(),
    }
}

/// The lines to print for one context, and whether it agrees with this client.
pub fn judge(context: &str, installed: &Installed, client_version: &str) -> (Vec<String>, bool) {
    let mut lines = Vec::new();
    let mut agrees = true;
    for (name, state) in &installed.crds {
        let said = match state {
            CrdState::Current => "as this client's".to_string(),
            CrdState::Missing => {
                agrees = false;
                "not installed".to_string()
            }
            CrdState::Different(_) => {
                agrees = false;
                format!(
                    "differs from this client's: apply the CRDs of {client_version}, or use the client of the installed release"
                )
            }
            CrdState::Unreadable => "not readable with these credentials".to_string(),
        };
        lines.push(format!("{context}: CRD {name}: {said}"));
    }
    match &installed.operator {
        Some((pod, version)) if version == client_version => {
            lines.push(format!("{context}: operator {version} ({pod})"))
        }
        Some((pod, version)) => {
            agrees = false;
            lines.push(format!("{context}: operator {version} ({pod}): differs from this client's {client_version}"));
        }
        None => {}
    }
    lines.extend(installed.errors.iter().map(|e| format!("{context}: {e}")));
    (lines, agrees)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(labels: &[(&str, &str)], image: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"labels": labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<std::collections::BTreeMap<_, _>>()},
            "spec": {"containers": [{"name": "operator", "image": image}]},
        }))
        .unwrap()
    }

    #[test]
    fn the_operators_version_is_its_label_else_its_tag() {
        assert_eq!(version_of(&pod(&[(VERSION_LABEL, "0.2.0")], "r/aether:latest")), "0.2.0");
        assert_eq!(version_of(&pod(&[], "registry:5000/aether/aether-operator:0.3.0")), "0.3.0");
        assert_eq!(version_of(&pod(&[], "registry:5000/aether/aether-operator@sha256:ab")), "unknown");
    }

    #[test]
    fn skew_between_client_crds_and_operator_is_said_and_judged() {
        let installed = Installed {
            crds: vec![("regionpeerings.federation.aether.dev".into(), CrdState::Different(None))],
            operator: Some(("op-0".into(), "0.2.0".into())),
            errors: vec![],
        };
        let (lines, agrees) = judge("a", &installed, "0.3.0");
        assert!(!agrees);
        assert!(lines[0].contains("differs") && lines[1].contains("operator 0.2.0 (op-0): differs"), "{lines:?}");
        let current = Installed {
            crds: vec![("regionpeerings.federation.aether.dev".into(), CrdState::Current)],
            operator: Some(("op-0".into(), "0.3.0".into())),
            errors: vec![],
        };
        assert!(judge("a", &current, "0.3.0").1);
    }
}
