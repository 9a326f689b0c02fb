//! `report`: a support bundle, what an on-call collects by hand otherwise ("-o yaml, the events,
//! the leader's logs of the last hour"), written as a directory of plain files, one subdirectory
//! per context: the RegionPeerings and RegistrySchemas, the events of their namespaces, the
//! operator's Lease, Deployments and Pods, each operator pod's log (and its previous container's),
//! and `status` as it reads now. Secrets are never read; the values of the operator pods'
//! environment variables are replaced by `<redacted>` (their names stay). What could not be read
//! (a permission, a pod without a node) is listed in `errors.txt` rather than failing the report.
use crate::api::{RegionPeering, RegistrySchema};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, ListParams, LogParams};
use kube::{Client, ResourceExt};
use std::collections::BTreeSet;
use std::time::Duration;

/// The label the chart and config/default put on the operator's pods.
pub const OPERATOR_SELECTOR: &str = "app.kubernetes.io/name=aether-operator";
/// At most this much of each pod's log.
const LOG_BYTES: i64 = 16 << 20;
/// At most this many events a namespace.
const EVENTS: u32 = 1000;

/// What to collect from one context.
pub struct Scope<'a> {
    /// Only this namespace's RegionPeerings and RegistrySchemas; all otherwise.
    pub namespace: Option<&'a str>,
    /// The leader Lease, "namespace/name": its namespace is the operator's.
    pub leader_lease: &'a str,
    /// The logs of this long ago to now.
    pub since: Duration,
}

/// One context's files (relative path, contents), and what could not be read.
#[derive(Default)]
pub struct Collected {
    pub files: Vec<(String, String)>,
    pub errors: Vec<String>,
}

impl Collected {
    fn yaml<T: serde::Serialize>(&mut self, path: &str, what: &str, read: Result<T, kube::Error>) -> Option<T> {
        match read {
            Ok(value) => {
                match serde_yaml::to_string(&value) {
                    Ok(text) => self.files.push((path.to_string(), text)),
                    Err(e) => self.errors.push(format!("{what}: {e}")),
                }
                Some(value)
            }
            Err(e) => {
                self.errors.push(format!("{what}: {}", said(&e)));
                None
            }
        }
    }
}

/// Reads everything the report holds from one context.
pub async fn collect(client: &Client, scope: &Scope<'_>) -> Collected {
    let mut c = Collected::default();
    let (peerings, schemas): (Api<RegionPeering>, Api<RegistrySchema>) = match scope.namespace {
        Some(ns) => (Api::namespaced(client.clone(), ns), Api::namespaced(client.clone(), ns)),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let lp = ListParams::default();
    let mut namespaces = BTreeSet::new();
    if let Some(list) = c.yaml("regionpeerings.yaml", "RegionPeerings", peerings.list(&lp).await.map(|l| l.items)) {
        namespaces.extend(list.iter().filter_map(|o| o.namespace()));
    }
    if let Some(list) = c.yaml("registryschemas.yaml", "RegistrySchemas", schemas.list(&lp).await.map(|l| l.items)) {
        namespaces.extend(list.iter().filter_map(|o| o.namespace()));
    }
    let (operator_ns, lease_name) = scope.leader_lease.split_once('/').unwrap_or(("aether-system", scope.leader_lease));
    namespaces.insert(operator_ns.to_string());
    for ns in &namespaces {
        let events: Api<Event> = Api::namespaced(client.clone(), ns);
        let read = events.list(&ListParams::default().limit(EVENTS)).await.map(|l| sorted_events(l.items));
        c.yaml(&format!("events/{ns}.yaml"), &format!("the events of namespace {ns}"), read);
    }
    let leases: Api<Lease> = Api::namespaced(client.clone(), operator_ns);
    c.yaml("operator/lease.yaml", &format!("the Lease {operator_ns}/{lease_name}"), leases.get(lease_name).await);
    let selected = ListParams::default().labels(OPERATOR_SELECTOR);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), operator_ns);
    let read = deployments.list(&selected).await.map(|l| l.items);
    c.yaml("operator/deployments.yaml", &format!("the operator's Deployments in {operator_ns}"), read);
    let pods: Api<Pod> = Api::namespaced(client.clone(), operator_ns);
    let read = pods.list(&selected).await.map(|l| l.items.into_iter().map(redacted).collect::<Vec<_>>());
    for pod in c.yaml("operator/pods.yaml", &format!("the operator's pods in {operator_ns}"), read).unwrap_or_default()
    {
        logs(&pods, &pod, scope.since, &mut c).await;
    }
    c
}

/// Each container's log of `pod`, and its previous container's when it restarted.
async fn logs(pods: &Api<Pod>, pod: &Pod, since: Duration, c: &mut Collected) {
    let name = pod.name_any();
    let restarted: BTreeSet<String> = pod
        .status
        .iter()
        .flat_map(|s| s.container_statuses.iter().flatten())
        .filter(|s| s.restart_count > 0)
        .map(|s| s.name.clone())
        .collect();
    let containers = pod.spec.iter().flat_map(|s| s.containers.iter()).map(|c| c.name.clone());
    for container in containers {
        for previous in [false, true] {
            if previous && !restarted.contains(&container) {
                continue;
            }
            let params = LogParams {
                container: Some(container.clone()),
                previous,
                since_seconds: (!previous).then_some(since.as_secs().max(1) as i64),
                limit_bytes: Some(LOG_BYTES),
                timestamps: true,
                ..Default::default()
            };
            let suffix = if previous { ".previous" } else { "" };
            match pods.logs(&name, &params).await {
                Ok(text) => c.files.push((format!("operator/logs/{name}.{container}{suffix}.log"), text)),
                Err(e) => c.errors.push(format!("the log of {name}/{container}{suffix}: {}", said(&e))),
            }
        }
    }
}

/// What the API server said, without the debug dump of its Status.
fn said(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(status) => format!("{} ({})", status.message, status.code),
        e => e.to_string(),
    }
}

/// The pod with every environment variable's value replaced (names kept): a value set through
/// `extraEnv` may be a credential.
pub fn redacted(mut pod: Pod) -> Pod {
    pod.metadata.managed_fields = None;
    if let Some(spec) = pod.spec.as_mut() {
        for container in spec.containers.iter_mut().chain(spec.init_containers.iter_mut().flatten()) {
            for var in container.env.iter_mut().flatten() {
                if var.value.is_some() {
                    var.value = Some("<redacted>".into());
                }
            }
        }
    }
    pod
}

/// Oldest first, as a person reads a timeline.
fn sorted_events(mut events: Vec<Event>) -> Vec<Event> {
    let when = |e: &Event| {
        e.last_timestamp
            .as_ref()
            .map(|t| t.0.to_string())
            .or_else(|| e.event_time.as_ref().map(|t| t.0.to_string()))
            .unwrap_or_default()
    };
    events.sort_by_key(when);
    events
}

/// What the report's directory holds, written at its top.
pub fn readme(contexts: &[String], since: Duration) -> String {
    format!(
        "aether federation support report ({} {})\n\n\
         One directory per kubeconfig context ({}): the RegionPeerings and RegistrySchemas, the\n\
         events of their namespaces and of the operator's, the operator's Lease, Deployments and\n\
         Pods, each operator pod's log of the last {} s (and its previous container's), `status`\n\
         as it read, and errors.txt: what could not be read.\n\n\
         Secrets are never read. The values of the operator pods' environment variables are\n\
         replaced by <redacted>. Review the files before you send them: endpoints, region names and\n\
         log lines are as the cluster has them.\n",
        env!("CARGO_PKG_NAME"),
        env!("CARGO_PKG_VERSION"),
        contexts.join(", "),
        since.as_secs()
    )
}

/// A context's name as a directory name.
pub fn directory_of(context: &str) -> String {
    let name: String =
        context.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    if name.chars().all(|c| c == '.') { format!("_{name}") } else { name }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Container, EnvVar, PodSpec};

    #[test]
    fn environment_values_are_redacted_and_their_names_kept() {
        let var =
            |name: &str, value: &str| EnvVar { name: name.into(), value: Some(value.into()), ..Default::default() };
        let pod = Pod {
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "operator".into(),
                    env: Some(vec![var("ETCD_PASSWORD", "hunter2"), var("RUST_LOG", "debug")]),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let text = serde_yaml::to_string(&redacted(pod)).unwrap();
        assert!(!text.contains("hunter2") && !text.contains("debug"), "{text}");
        assert!(text.contains("ETCD_PASSWORD") && text.contains("<redacted>"), "{text}");
    }

    #[test]
    fn a_context_name_becomes_one_directory() {
        assert_eq!(directory_of("arn:aws:eks:eu-west-1:1:cluster/a"), "arn_aws_eks_eu-west-1_1_cluster_a");
        assert_eq!(directory_of("kind-aether-a"), "kind-aether-a");
        assert_eq!((directory_of(".."), directory_of("")), ("_..".to_string(), "_".to_string()));
    }
}
