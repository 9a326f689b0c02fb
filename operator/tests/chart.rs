//! The Helm chart: lint, render each variant of its values, check what each renders, validate the
//! rendered manifests with kubeconform (strict, with the CRD schemas) and apply them with a
//! server-side dry run to a real kube-apiserver. The same server-side dry run covers
//! `kubectl apply -k config/default`. Then a release's life against a real kube-apiserver:
//! `helm install`, `helm upgrade` (refused over stale CRDs), `helm uninstall` with its pre-delete
//! hook, leaving no RegionPeering and nothing Terminating, and the CRDs in place.
mod support;

use aether_harness::{KubeApiserver, tool_path};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use support::*;

const RELEASE: &str = "aether";
const NAMESPACE: &str = "aether-system";
/// Names outside the release namespace: `<namespace>-<release>`.
const SCOPED: &str = "aether-system-aether";

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("tool runs");
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Runs a command that must fail; its stderr.
fn fails(cmd: &mut Command) -> String {
    let out = cmd.output().expect("tool runs");
    assert!(!out.status.success(), "{cmd:?} succeeded, expected a failure:\n{}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).to_string()
}

/// JSON schemas of our CRDs in the layout kubeconform reads.
fn crd_schemas(dir: &Path) {
    for crd in aether_operator::api::all_crds() {
        let kind = crd.spec.names.kind.to_lowercase();
        for version in crd.spec.versions {
            let mut schema = serde_json::to_value(version.schema.unwrap().open_api_v3_schema.unwrap()).unwrap();
            let props = schema["properties"].as_object_mut().unwrap();
            props.insert("apiVersion".into(), serde_json::json!({"type": "string"}));
            props.insert("kind".into(), serde_json::json!({"type": "string"}));
            props.insert("metadata".into(), serde_json::json!({"type": "object"}));
            std::fs::write(dir.join(format!("{kind}_{}.json", version.name)), schema.to_string()).unwrap();
        }
    }
}

/// Stand-ins for the Prometheus Operator's CRDs, so the dry run can take a ServiceMonitor and a
/// PrometheusRule. They accept any spec: the dry run checks the objects' metadata only.
const MONITORING_STAND_INS: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: servicemonitors.monitoring.coreos.com}
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: {kind: ServiceMonitor, listKind: ServiceMonitorList, plural: servicemonitors, singular: servicemonitor}
  versions:
    - name: v1
      served: true
      storage: true
      schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: prometheusrules.monitoring.coreos.com}
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: {kind: PrometheusRule, listKind: PrometheusRuleList, plural: prometheusrules, singular: prometheusrule}
  versions:
    - name: v1
      served: true
      storage: true
      schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
"#;

/// `helm template` of the chart in `namespace` with `--set` values.
fn render_in(namespace: &str, sets: &[&str]) -> Command {
    let mut cmd = Command::new(tool_path("helm").unwrap());
    cmd.args(["template", RELEASE, "--namespace", namespace, "--kube-version", "1.35.0", "--include-crds"])
        .arg(repo("charts/aether-federation"));
    for set in sets {
        cmd.args(["--set", set]);
    }
    cmd
}

/// The rendered documents, parsed, without the CRDs.
fn documents(rendered: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(rendered)
        .map(|doc| <Value as serde::Deserialize>::deserialize(doc).expect("the chart renders valid YAML"))
        .filter(|doc| !doc.is_null() && doc["kind"] != "CustomResourceDefinition")
        .collect()
}

/// The rendered text without the CRDs (they are installed separately).
fn without_crds(rendered: &str) -> String {
    rendered
        .split("\n---")
        .filter(|doc| !doc.contains("kind: CustomResourceDefinition"))
        .collect::<Vec<_>>()
        .join("\n---")
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|doc| doc["kind"] == kind).collect()
}

fn one<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found = of_kind(docs, kind);
    assert_eq!(found.len(), 1, "expected one {kind}, found {}", found.len());
    found[0]
}

fn name(doc: &Value) -> &str {
    doc["metadata"]["name"].as_str().unwrap_or_default()
}

fn namespace(doc: &Value) -> &str {
    doc["metadata"]["namespace"].as_str().unwrap_or_default()
}

/// Whether a Role or ClusterRole has a rule on `resource`.
fn grants(role: &Value, resource: &str) -> bool {
    role["rules"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|rule| rule["resources"].as_array().into_iter().flatten().any(|r| r == resource))
}

fn container(docs: &[Value]) -> &Value {
    &one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
}

fn args(docs: &[Value]) -> Vec<String> {
    container(docs)["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_string()).collect()
}

/// How `kubectl apply` names an object: `deployment.apps/aether`, `serviceaccount/aether`.
fn applied_name(doc: &Value) -> String {
    let kind = doc["kind"].as_str().unwrap_or_default().to_lowercase();
    match doc["apiVersion"].as_str().unwrap_or_default().split_once('/') {
        Some((group, _)) => format!("{kind}.{group}/{}", name(doc)),
        None => format!("{kind}/{}", name(doc)),
    }
}

/// What every variant renders: the chart's labels on every object and on the pods, the pods
/// selected by the two selector labels only, and cluster-scoped names that carry the namespace.
fn check_common(docs: &[Value]) {
    let with_labels = |what: String, labels: &Value| {
        for key in [
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/version",
            "app.kubernetes.io/managed-by",
            "app.kubernetes.io/part-of",
        ] {
            assert!(labels[key].is_string(), "{what} lacks the label {key}: {labels}");
        }
    };
    for doc in docs {
        with_labels(applied_name(doc), &doc["metadata"]["labels"]);
        if doc["kind"] == "ClusterRole" || doc["kind"] == "ClusterRoleBinding" {
            assert!(
                name(doc).starts_with(&format!("{NAMESPACE}-")),
                "{} does not carry the release namespace",
                applied_name(doc)
            );
        }
    }
    let deployment = one(docs, "Deployment");
    with_labels("the pod template".into(), &deployment["spec"]["template"]["metadata"]["labels"]);
    let selector = deployment["spec"]["selector"]["matchLabels"].as_object().unwrap();
    let mut keys: Vec<&str> = selector.keys().map(String::as_str).collect();
    keys.sort();
    assert_eq!(
        keys,
        ["app.kubernetes.io/instance", "app.kubernetes.io/name"],
        "the selector is the two selector labels"
    );
    let restricted = &container(docs)["securityContext"];
    assert_eq!(restricted["readOnlyRootFilesystem"], Value::Bool(true));
    assert_eq!(restricted["allowPrivilegeEscalation"], Value::Bool(false));
    assert_eq!(restricted["capabilities"]["drop"][0], "ALL");
    let pod = &deployment["spec"]["template"]["spec"]["securityContext"];
    assert_eq!(pod["runAsNonRoot"], Value::Bool(true));
    assert_eq!(pod["seccompProfile"]["type"], "RuntimeDefault");
}

/// The defaults, with a RegionPeering: all namespaces, secure metrics, two replicas.
fn check_default(docs: &[Value]) {
    let args = args(docs);
    for arg in ["--metrics-addr=0.0.0.0:8443", "--metrics-secure"] {
        assert!(args.iter().any(|a| a == arg), "{arg} not in {args:?}");
    }
    assert!(!args.iter().any(|a| a.starts_with("--namespaces")), "{args:?}");
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(container(docs)[probe]["httpGet"]["scheme"], "HTTPS", "{probe}");
    }
    let cluster_roles = of_kind(docs, "ClusterRole");
    let data = cluster_roles.iter().find(|r| name(r) == SCOPED).expect("the operator's ClusterRole");
    assert!(grants(data, "secrets") && grants(data, "regionpeerings") && grants(data, "customresourcedefinitions"));
    let auth = cluster_roles.iter().find(|r| name(r) == format!("{SCOPED}-metrics-auth")).expect("metrics-auth");
    assert!(grants(auth, "tokenreviews") && grants(auth, "subjectaccessreviews"));
    let reader = cluster_roles.iter().find(|r| name(r) == format!("{SCOPED}-metrics-reader")).expect("metrics-reader");
    assert_eq!(reader["rules"][0]["nonResourceURLs"][0], "/metrics");
    let bindings: Vec<&str> = of_kind(docs, "ClusterRoleBinding").into_iter().map(name).collect();
    assert!(
        bindings.contains(&SCOPED) && bindings.contains(&format!("{SCOPED}-metrics-auth").as_str()),
        "{bindings:?}"
    );
    assert!(of_kind(docs, "Role").iter().all(|r| namespace(r) == NAMESPACE && !grants(r, "secrets")));
    assert_eq!(one(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"], 1);
    let anti = &one(docs, "Deployment")["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"];
    assert_eq!(
        anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["topologyKey"],
        "kubernetes.io/hostname"
    );
    let spread = &one(docs, "Deployment")["spec"]["template"]["spec"]["topologySpreadConstraints"];
    assert_eq!(
        spread,
        &serde_json::json!([{
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "aether-operator", "app.kubernetes.io/instance": RELEASE}},
        }]),
        "a soft spread over zones by default"
    );
    assert_eq!(container(docs)["image"], format!("ghcr.io/aether/aether-operator:{}", env!("CARGO_PKG_VERSION")));
    assert_eq!(container(docs)["livenessProbe"]["periodSeconds"], 10);
    let peering = one(docs, "RegionPeering");
    assert_eq!(peering["spec"]["sync"], serde_json::json!({"pageSize": 500}), "only the sync settings given");
    assert_eq!(peering["spec"]["deletionPolicy"], "Delete");
    assert_eq!(peering["spec"]["peers"].as_array().unwrap().len(), 2);
    assert!(of_kind(docs, "NetworkPolicy").is_empty() && of_kind(docs, "ServiceMonitor").is_empty());
    check_uninstall_hook(docs);
    check_test_pod(docs);
}

/// The pre-delete hook of a chart-rendered RegionPeering: a Job deleting it and waiting for its
/// finalizer, on a ServiceAccount allowed that and nothing else, created before Helm deletes
/// anything, in pods no selector of the operator's picks up.
fn check_uninstall_hook(docs: &[Value]) {
    let hooked: Vec<&Value> =
        docs.iter().filter(|d| d["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete").collect();
    let mut kinds: Vec<&str> = hooked.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    kinds.sort();
    assert_eq!(kinds, ["Job", "Role", "RoleBinding", "ServiceAccount"], "the hook's objects");
    let job = one(docs, "Job");
    assert_eq!(job["metadata"]["annotations"]["helm.sh/hook-delete-policy"], "before-hook-creation,hook-succeeded");
    let pod = &job["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], format!("{RELEASE}-uninstall"));
    let hook = &pod["containers"][0];
    assert_eq!(hook["command"], serde_json::json!(["kubectl"]));
    let args: Vec<&str> = hook["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    assert_eq!(&args[..3], ["delete", "regionpeering", "eu-west"]);
    for arg in [format!("--namespace={NAMESPACE}"), "--wait".into(), "--ignore-not-found".into()] {
        assert!(args.contains(&arg.as_str()), "{arg} not in {args:?}");
    }
    assert!(hook["image"].as_str().unwrap().starts_with("registry.k8s.io/kubectl:"));
    assert_eq!(hook["securityContext"]["readOnlyRootFilesystem"], Value::Bool(true));
    assert_eq!(pod["securityContext"]["runAsNonRoot"], Value::Bool(true));
    let selector = &one(docs, "Deployment")["spec"]["selector"]["matchLabels"];
    let labels = &job["spec"]["template"]["metadata"]["labels"];
    assert!(
        selector.as_object().unwrap().iter().any(|(k, v)| &labels[k.as_str()] != v),
        "the hook's pod must not match the operator's selector: {labels}"
    );
    let role = of_kind(docs, "Role").into_iter().find(|r| name(r) == format!("{RELEASE}-uninstall")).unwrap();
    assert_eq!(role["rules"][0]["resourceNames"], serde_json::json!(["eu-west"]));
    assert!(!grants(role, "secrets") && !grants(role, "deployments"));
}

/// `helm test`: the operator's own `status --etcd`, waiting for the federation to be healthy from
/// inside the cluster, under the operator's ServiceAccount and image, in a pod no selector of the
/// operator's picks up; its arguments are ones the executable accepts.
fn check_test_pod(docs: &[Value]) {
    let pod = one(docs, "Pod");
    assert_eq!(pod["metadata"]["annotations"]["helm.sh/hook"], "test");
    // helm uninstall does not delete hook pods: one kept after it passed would outlive the release.
    assert_eq!(pod["metadata"]["annotations"]["helm.sh/hook-delete-policy"], "before-hook-creation,hook-succeeded");
    let deployment = &one(docs, "Deployment")["spec"]["template"]["spec"];
    assert_eq!(pod["spec"]["serviceAccountName"], deployment["serviceAccountName"]);
    let status = &pod["spec"]["containers"][0];
    assert_eq!(status["image"], container(docs)["image"]);
    assert_eq!(status["securityContext"]["readOnlyRootFilesystem"], Value::Bool(true));
    let args: Vec<String> = status["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().into()).collect();
    for arg in ["status", "--etcd", "--etcd-from=here", &format!("--namespace={NAMESPACE}"), "--wait=3m"] {
        assert!(args.iter().any(|a| a == arg), "{arg} not in {args:?}");
    }
    let selector = &one(docs, "Deployment")["spec"]["selector"]["matchLabels"];
    assert!(
        selector.as_object().unwrap().iter().any(|(k, v)| &pod["metadata"]["labels"][k.as_str()] != v),
        "the test pod must not match the operator's selector"
    );
    // The executable takes these arguments: it gets as far as reading the kubeconfig.
    let out = Command::new(env!("CARGO_BIN_EXE_aether-operator"))
        .args(&args)
        .args(["--kubeconfig", "/nonexistent/kubeconfig"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/nonexistent/kubeconfig"), "the test pod's arguments: {args:?}: {stderr}");
}

/// watchNamespaces={a,b}: a Role and a RoleBinding in exactly a and b, nothing cluster-wide for the data.
fn check_namespaced(docs: &[Value]) {
    let mut with_secrets: Vec<&str> =
        of_kind(docs, "Role").into_iter().filter(|r| grants(r, "secrets")).map(namespace).collect();
    with_secrets.sort();
    assert_eq!(with_secrets, ["a", "b"], "the data Roles");
    for role in of_kind(docs, "Role").into_iter().filter(|r| grants(r, "secrets")) {
        assert!(grants(role, "regionpeerings") && grants(role, "registryschemas/status") && grants(role, "events"));
        assert!(!grants(role, "customresourcedefinitions"), "a Role cannot grant a cluster-scoped resource");
    }
    let mut bound: Vec<&str> =
        of_kind(docs, "RoleBinding").into_iter().filter(|b| name(b) == SCOPED).map(namespace).collect();
    bound.sort();
    assert_eq!(bound, ["a", "b"]);
    for binding in of_kind(docs, "RoleBinding") {
        assert_eq!(binding["subjects"][0]["name"], RELEASE);
        assert_eq!(binding["subjects"][0]["namespace"], NAMESPACE);
    }
    for role in of_kind(docs, "ClusterRole") {
        assert!(
            !grants(role, "secrets") && !grants(role, "regionpeerings"),
            "{} grants the data cluster-wide",
            name(role)
        );
    }
    assert!(of_kind(docs, "ClusterRoleBinding").iter().all(|b| name(b) != SCOPED));
    let leader = of_kind(docs, "Role").into_iter().find(|r| grants(r, "leases")).expect("the leader-election Role");
    assert_eq!(namespace(leader), NAMESPACE);
    assert!(args(docs).iter().any(|a| a == "--namespaces=a,b"), "{:?}", args(docs));
}

/// metrics.secure=false, with a ServiceMonitor: plain HTTP, no metrics roles, no token.
fn check_insecure(docs: &[Value]) {
    assert!(!args(docs).iter().any(|a| a.starts_with("--metrics-secure") || a.starts_with("--metrics-cert-dir")));
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_ne!(container(docs)[probe]["httpGet"]["scheme"], "HTTPS", "{probe}");
    }
    for role in of_kind(docs, "ClusterRole") {
        assert!(!grants(role, "tokenreviews") && role["rules"][0]["nonResourceURLs"].is_null(), "{}", name(role));
    }
    let endpoint = &one(docs, "ServiceMonitor")["spec"]["endpoints"][0];
    assert_eq!(endpoint["scheme"], "http");
    assert!(endpoint["authorization"].is_null() && endpoint["tlsConfig"].is_null(), "{endpoint}");
    assert!(of_kind(docs, "Secret").is_empty(), "no token without the secure endpoint");
}

/// A ServiceMonitor of the secure endpoint, a certificate Secret and a bound scraper.
fn check_service_monitor(docs: &[Value]) {
    let monitor = one(docs, "ServiceMonitor");
    assert_eq!(monitor["metadata"]["labels"]["release"], "prometheus");
    let selector = monitor["spec"]["selector"]["matchLabels"].as_object().unwrap();
    assert_eq!(selector.len(), 2, "the selector labels only: {selector:?}");
    let service = one(docs, "Service");
    for (key, value) in selector {
        assert_eq!(&service["metadata"]["labels"][key.as_str()], value, "the Service carries {key}");
    }
    let endpoint = &monitor["spec"]["endpoints"][0];
    assert_eq!(endpoint["port"], "metrics");
    assert_eq!(endpoint["scheme"], "https");
    assert!(endpoint["bearerTokenFile"].is_null(), "the deprecated bearerTokenFile: {endpoint}");
    assert_eq!(
        endpoint["authorization"],
        serde_json::json!({"type": "Bearer", "credentials": {"name": format!("{RELEASE}-metrics-scraper-token"), "key": "token"}})
    );
    assert_eq!(
        endpoint["tlsConfig"],
        serde_json::json!({"ca": {"secret": {"name": "aether-metrics-tls", "key": "ca.crt"}}, "serverName": format!("{RELEASE}-metrics.{NAMESPACE}.svc")}),
        "the CA verifies the operator's certificate"
    );
    let token = one(docs, "Secret");
    assert_eq!(token["type"], "kubernetes.io/service-account-token");
    assert_eq!(
        token["metadata"]["annotations"]["kubernetes.io/service-account.name"],
        format!("{RELEASE}-metrics-scraper")
    );
    let scraper = of_kind(docs, "ClusterRoleBinding")
        .into_iter()
        .find(|b| name(b) == format!("{SCOPED}-metrics-scraper"))
        .expect("the chart's scraper bound to the reader role");
    assert_eq!(scraper["roleRef"]["name"], format!("{SCOPED}-metrics-reader"));
    assert_eq!(scraper["subjects"][0]["name"], format!("{RELEASE}-metrics-scraper"));
    assert!(args(docs).iter().any(|a| a == "--metrics-cert-dir=/etc/aether/metrics-tls"), "{:?}", args(docs));
    let mount = &container(docs)["volumeMounts"][0];
    assert_eq!(mount["mountPath"], "/etc/aether/metrics-tls");
    assert_eq!(mount["readOnly"], Value::Bool(true));
    let volume = &one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"][0];
    assert_eq!(volume["secret"]["secretName"], "aether-metrics-tls");
    let reader = of_kind(docs, "ClusterRoleBinding")
        .into_iter()
        .find(|b| name(b) == format!("{SCOPED}-metrics-reader"))
        .expect("the scraper's binding");
    assert_eq!(reader["subjects"][0]["name"], "prometheus-k8s");
}

/// networkPolicy.enabled: ingress to the metrics port only; egress to the API server, etcd and DNS.
fn check_network_policy(docs: &[Value]) {
    let policy = one(docs, "NetworkPolicy");
    let spec = &policy["spec"];
    assert_eq!(spec["podSelector"]["matchLabels"]["app.kubernetes.io/name"], "aether-operator");
    assert_eq!(spec["policyTypes"], serde_json::json!(["Ingress", "Egress"]));
    let ingress = spec["ingress"].as_array().unwrap();
    assert_eq!(ingress.len(), 1);
    assert_eq!(ingress[0]["ports"], serde_json::json!([{"protocol": "TCP", "port": 8443}]));
    let egress_ports: Vec<(String, i64)> = spec["egress"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|rule| rule["ports"].as_array().unwrap().iter())
        .map(|p| (p["protocol"].as_str().unwrap().to_string(), p["port"].as_i64().unwrap()))
        .collect();
    for (protocol, port) in [("TCP", 443), ("TCP", 6443), ("TCP", 2379), ("UDP", 53), ("TCP", 53)] {
        assert!(
            egress_ports.contains(&(protocol.to_string(), port)),
            "no egress to {protocol}/{port}: {egress_ports:?}"
        );
    }
    assert_eq!(egress_ports.len(), 5, "nothing else: {egress_ports:?}");
    let etcd = &spec["egress"][1]["to"];
    assert_eq!(
        etcd,
        &serde_json::json!([{"ipBlock": {"cidr": "10.20.0.0/16"}}, {"ipBlock": {"cidr": "192.0.2.10/32"}}])
    );
}

/// Every alert of a PrometheusRule, by name.
fn alerts(docs: &[Value]) -> std::collections::BTreeMap<String, Value> {
    one(docs, "PrometheusRule")["spec"]["groups"]
        .as_array()
        .expect("rule groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().iter())
        .filter_map(|r| Some((r["alert"].as_str()?.to_string(), r.clone())))
        .collect()
}

/// prometheusRule.enabled: the alerting rules as a PrometheusRule, each linking its runbook at the
/// chart version's tag.
fn check_prometheus_rule(docs: &[Value]) {
    let rule = one(docs, "PrometheusRule");
    assert_eq!(namespace(rule), NAMESPACE);
    let alerts = alerts(docs);
    assert!(alerts.len() >= 17, "{:?}", alerts.keys());
    let runbooks = std::fs::read_to_string(repo("docs/runbooks.md")).unwrap();
    for (name, alert) in &alerts {
        let url = format!(
            "https://github.com/aether/aether-federation/blob/v{}/docs/runbooks.md#{}",
            env!("CARGO_PKG_VERSION"),
            name.to_lowercase()
        );
        assert_eq!(alert["annotations"]["runbook_url"], url);
        assert!(runbooks.contains(&format!("\n## {name}\n")), "docs/runbooks.md has no section {name}");
        assert!(alert["labels"]["severity"].is_string(), "{name}");
    }
    assert!(alerts["AetherFederationReplicationLagHigh"]["expr"].as_str().unwrap().ends_with("> 60"));
    assert!(alerts.contains_key("AetherFederationRevisionsSplit"));
}

/// The rules from non-default values: thresholds, labels on every alert (an alert's own severity
/// wins), an alert left out, the runbooks elsewhere.
fn check_prometheus_rule_tuned(docs: &[Value]) {
    let alerts = alerts(docs);
    assert!(!alerts.contains_key("AetherFederationRevisionsSplit"), "disabled");
    let lag = &alerts["AetherFederationReplicationLagHigh"];
    assert!(lag["expr"].as_str().unwrap().ends_with("> 120"), "{lag}");
    assert!(lag["annotations"]["description"].as_str().unwrap().contains("older than 120 seconds"));
    let slow = &alerts["AetherFederationKeepaliveSlow"];
    assert!(slow["expr"].as_str().unwrap().trim_end().ends_with("> 2"), "{slow}");
    for (name, alert) in &alerts {
        assert_eq!(alert["labels"]["team"], "platform", "{name}");
        assert_ne!(alert["labels"]["severity"], "page", "{name}: its own severity wins");
        assert_eq!(
            alert["annotations"]["runbook_url"],
            format!("https://wiki.example.net/aether/runbooks#{}", name.to_lowercase())
        );
    }
}

/// grafanaDashboard.enabled: the dashboard as a ConfigMap for Grafana's sidecar.
fn check_grafana_dashboard(docs: &[Value]) {
    let map = one(docs, "ConfigMap");
    let data = map["data"].as_object().expect("the dashboard's data");
    assert!(
        data.values()
            .any(|v| v.as_str().and_then(|s| serde_json::from_str::<Value>(s).ok()).is_some_and(|j| j.is_object())),
        "no dashboard JSON in {}",
        name(map)
    );
}

/// What most clusters set: a priority class, a spread over zones that must hold, labels and
/// annotations for the pods, more flags and environment, an existing ServiceAccount, the image by
/// digest from a private registry (a parent chart's pull Secrets too), other names, probe timing,
/// tolerations and resources.
const CLUSTER_VALUES: &[&str] = &[
    "fullnameOverride=fed",
    "image.digest=sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    "imagePullSecrets[0].name=regcred",
    "global.imagePullSecrets[0]=regcred",
    "global.imagePullSecrets[1].name=mirror",
    "serviceAccount.create=false",
    "serviceAccount.name=platform-ops",
    "priorityClassName=system-cluster-critical",
    "podAnnotations.example\\.com/team=federation",
    "podLabels.tier=control",
    "podLabels.app\\.kubernetes\\.io/name=someone-else",
    "extraArgs={--refresh-seconds=10}",
    "extraEnv[0].name=RUST_BACKTRACE",
    "extraEnv[0].value=full",
    "livenessProbe.timeoutSeconds=5",
    "readinessProbe.periodSeconds=5",
    "tolerations[0].key=dedicated",
    "tolerations[0].operator=Equal",
    "tolerations[0].value=platform",
    "tolerations[0].effect=NoSchedule",
    "topologySpreadConstraints[0].maxSkew=1",
    "topologySpreadConstraints[0].topologyKey=topology.kubernetes.io/zone",
    "topologySpreadConstraints[0].whenUnsatisfiable=DoNotSchedule",
    "resources.requests.cpu=100m",
    "resources.limits.memory=512Mi",
    // A platform that assigns user ids (OpenShift's restricted SCC), and a volume's group.
    "podSecurityContext.runAsUser=null",
    "podSecurityContext.runAsGroup=null",
    "podSecurityContext.fsGroup=2000",
];

fn check_cluster_values(docs: &[Value]) {
    let deployment = one(docs, "Deployment");
    assert_eq!(name(deployment), "fed");
    assert_eq!(name(one(docs, "Service")), "fed-metrics");
    let pod = &deployment["spec"]["template"];
    let spec = &pod["spec"];
    assert_eq!(
        container(docs)["image"],
        "ghcr.io/aether/aether-operator@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    );
    assert_eq!(spec["imagePullSecrets"], serde_json::json!([{"name": "regcred"}, {"name": "mirror"}]));
    assert_eq!(spec["serviceAccountName"], "platform-ops");
    assert!(of_kind(docs, "ServiceAccount").is_empty(), "an existing ServiceAccount is not rendered");
    for binding in of_kind(docs, "ClusterRoleBinding").into_iter().chain(of_kind(docs, "RoleBinding")) {
        assert_eq!(binding["subjects"][0]["name"], "platform-ops", "{}", name(binding));
    }
    assert_eq!(spec["priorityClassName"], "system-cluster-critical");
    assert_eq!(pod["metadata"]["annotations"]["example.com/team"], "federation");
    assert_eq!(pod["metadata"]["labels"]["tier"], "control");
    assert_eq!(pod["metadata"]["labels"]["app.kubernetes.io/name"], "aether-operator", "the chart's labels win");
    assert_eq!(args(docs).last().map(String::as_str), Some("--refresh-seconds=10"));
    assert!(
        container(docs)["env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "RUST_BACKTRACE" && e["value"] == "full")
    );
    assert_eq!(container(docs)["livenessProbe"]["timeoutSeconds"], 5);
    assert_eq!(container(docs)["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(container(docs)["readinessProbe"]["periodSeconds"], 5);
    assert_eq!(
        spec["tolerations"],
        serde_json::json!([{"key": "dedicated", "operator": "Equal", "value": "platform", "effect": "NoSchedule"}])
    );
    let spread = &spec["topologySpreadConstraints"];
    assert_eq!(spread.as_array().unwrap().len(), 1, "the given constraints replace the default");
    assert_eq!(spread[0]["whenUnsatisfiable"], "DoNotSchedule");
    assert_eq!(
        spread[0]["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"], RELEASE,
        "the chart's selector"
    );
    assert_eq!(
        container(docs)["resources"],
        serde_json::json!({"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "512Mi"}})
    );
    assert_eq!(
        spec["securityContext"],
        serde_json::json!({"runAsNonRoot": true, "fsGroup": 2000, "seccompProfile": {"type": "RuntimeDefault"}}),
        "the user ids dropped, the rest of the default kept"
    );
    assert_eq!(container(docs)["securityContext"]["readOnlyRootFilesystem"], Value::Bool(true));
}

/// replicaCount=1: no PodDisruptionBudget (it would block every drain, or protect nothing).
fn check_one_replica(docs: &[Value]) {
    assert_eq!(one(docs, "Deployment")["spec"]["replicas"], 1);
    assert!(of_kind(docs, "PodDisruptionBudget").is_empty());
}

/// Peers as objects beside the string form: a multi-member peer given with `--set`, each with its
/// Secret.
const STRUCTURED_PEERS: &[&str] = &[
    "regionPeering.enabled=true",
    "regionPeering.region=eu-west",
    "regionPeering.localEtcd.endpoints={https://registry-etcd:2379}",
    "regionPeering.peerEtcd={us-east=https://e1.us-east:2379}",
    "regionPeering.peerTlsSecrets.us-east=us-east-client",
    "regionPeering.peers[0].region=ap-south",
    "regionPeering.peers[0].endpoints={https://e1.ap-south:2379,https://e2.ap-south:2379}",
    "regionPeering.peers[0].tlsSecret=ap-south-client",
];

fn check_structured_peers(docs: &[Value]) {
    assert_eq!(
        one(docs, "RegionPeering")["spec"]["peers"],
        serde_json::json!([
            {"region": "us-east", "endpoints": ["https://e1.us-east:2379"], "tls": {"secretRef": {"name": "us-east-client"}}},
            {"region": "ap-south", "endpoints": ["https://e1.ap-south:2379", "https://e2.ap-south:2379"],
             "tls": {"secretRef": {"name": "ap-south-client"}}},
        ])
    );
}

struct Variant {
    name: &'static str,
    sets: &'static [&'static str],
    check: fn(&[Value]),
}

const REGION_PEERING: &[&str] = &[
    "regionPeering.enabled=true",
    "regionPeering.region=eu-west",
    "regionPeering.localEtcd.endpoints={https://registry-etcd:2379}",
    "regionPeering.peerEtcd={us-east=https://e1.us-east:2379\\,https://e2.us-east:2379,ap-south=https://e.ap-south:2379}",
    "regionPeering.sync.pageSize=500",
    "regionPeering.deletionPolicy=Delete",
];

fn variants() -> Vec<Variant> {
    vec![
        Variant { name: "default", sets: REGION_PEERING, check: check_default },
        Variant { name: "namespaced", sets: &["watchNamespaces={a,b}"], check: check_namespaced },
        Variant {
            name: "insecure metrics",
            sets: &["metrics.secure=false", "metrics.port=8080", "metrics.serviceMonitor.enabled=true"],
            check: check_insecure,
        },
        Variant {
            name: "service monitor",
            sets: &[
                "metrics.serviceMonitor.enabled=true",
                "metrics.serviceMonitor.labels.release=prometheus",
                "metrics.certSecret=aether-metrics-tls",
                "metrics.readerSubjects[0].kind=ServiceAccount",
                "metrics.readerSubjects[0].name=prometheus-k8s",
                "metrics.readerSubjects[0].namespace=monitoring",
            ],
            check: check_service_monitor,
        },
        Variant {
            name: "network policy",
            sets: &["networkPolicy.enabled=true", "networkPolicy.etcd.cidrs={10.20.0.0/16,192.0.2.10/32}"],
            check: check_network_policy,
        },
        Variant { name: "prometheus rule", sets: &["prometheusRule.enabled=true"], check: check_prometheus_rule },
        Variant {
            name: "prometheus rule tuned",
            sets: &[
                "prometheusRule.enabled=true",
                "prometheusRule.thresholds.replicationLagSeconds=120",
                "prometheusRule.thresholds.keepaliveRoundTripSeconds=2",
                "prometheusRule.additionalRuleLabels.team=platform",
                "prometheusRule.additionalRuleLabels.severity=page",
                "prometheusRule.disabled.AetherFederationRevisionsSplit=true",
                "prometheusRule.runbookBaseURL=https://wiki.example.net/aether/runbooks/",
            ],
            check: check_prometheus_rule_tuned,
        },
        Variant { name: "cluster values", sets: CLUSTER_VALUES, check: check_cluster_values },
        Variant { name: "grafana dashboard", sets: &["grafanaDashboard.enabled=true"], check: check_grafana_dashboard },
        Variant { name: "one replica", sets: &["replicaCount=1"], check: check_one_replica },
        Variant { name: "structured peers", sets: STRUCTURED_PEERS, check: check_structured_peers },
    ]
}

#[tokio::test]
async fn the_chart_lints_validates_and_applies() {
    let helm = tool_path("helm").unwrap();
    let chart = repo("charts/aether-federation");
    run(Command::new(&helm).arg("lint").arg(&chart).args(["--kube-version", "1.35.0"]));

    // values.schema.json rejects what the chart cannot render, naming the value.
    let rejected = fails(&mut render_in(
        NAMESPACE,
        &[
            "logFormat=xml",
            "metrics.port=0",
            "podDisruptionBudget.minAvailable=1",
            "resources.requests.cpu=lots",
            "tolerations[0].operator=Sometimes",
            "image.digest=latest",
            "livenessProbe.httpGet.path=/elsewhere",
            "extraArgs={run}",
            "prometheusRule.disabled.AetherFederationNoSuchAlert=true",
            "prometheusRule.thresholds.replicationLagSeconds=soon",
        ],
    ));
    for value in [
        "logFormat",
        "metrics/port",
        "minAvailable",
        "resources/requests/cpu",
        "tolerations/0/operator",
        "image/digest",
        "httpGet",
        "extraArgs/0",
        "AetherFederationNoSuchAlert",
        "thresholds/replicationLagSeconds",
    ] {
        assert!(rejected.contains(value), "the schema does not name {value}:\n{rejected}");
    }
    // What the schema cannot say, the templates do.
    assert!(fails(&mut render_in(NAMESPACE, &["serviceAccount.create=false"])).contains("serviceAccount.name"));
    // A Secret named for a region that is not a peer (a typo) would leave the peer without TLS.
    let typo = [STRUCTURED_PEERS, &["regionPeering.peerTlsSecrets.us-eats=us-east-client"]].concat();
    assert!(fails(&mut render_in(NAMESPACE, &typo)).contains("peerTlsSecrets names us-eats"));
    let twice = [
        STRUCTURED_PEERS,
        &["regionPeering.peers[1].region=us-east", "regionPeering.peers[1].endpoints={https://x:2379}"],
    ]
    .concat();
    assert!(fails(&mut render_in(NAMESPACE, &twice)).contains("the peer us-east is given twice"));
    let unverified = fails(&mut render_in(NAMESPACE, &["metrics.serviceMonitor.enabled=true"]));
    assert!(
        unverified.contains("insecureSkipVerify"),
        "a self-signed certificate needs an explicit choice: {unverified}"
    );
    let skipping = documents(&run(&mut render_in(
        NAMESPACE,
        &["metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.insecureSkipVerify=true"],
    )));
    assert_eq!(
        one(&skipping, "ServiceMonitor")["spec"]["endpoints"][0]["tlsConfig"],
        serde_json::json!({"insecureSkipVerify": true})
    );
    // The schema's list of alerts one may disable is the chart's list of alerts.
    let schema: Value =
        serde_json::from_str(&std::fs::read_to_string(repo("charts/aether-federation/values.schema.json")).unwrap())
            .unwrap();
    let mut disableable: Vec<String> =
        schema["properties"]["prometheusRule"]["properties"]["disabled"]["propertyNames"]["enum"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .collect();
    disableable.sort();
    let rendered = alerts(&documents(&run(&mut render_in(NAMESPACE, &["prometheusRule.enabled=true"]))));
    assert_eq!(
        disableable,
        rendered.keys().cloned().collect::<Vec<_>>(),
        "values.schema.json's prometheusRule.disabled"
    );
    // A RegionPeering the operator would never serve.
    let mut outside = REGION_PEERING.to_vec();
    outside.push("watchNamespaces={a,b}");
    assert!(fails(&mut render_in(NAMESPACE, &outside)).contains("watchNamespaces"));
    // Two releases of one name in two namespaces share no cluster-scoped name.
    let cluster_scoped = |namespace: &str| -> Vec<String> {
        documents(&run(&mut render_in(namespace, &[])))
            .iter()
            .filter(|d| d["kind"] == "ClusterRole" || d["kind"] == "ClusterRoleBinding")
            .map(|d| name(d).to_string())
            .collect()
    };
    let theirs = cluster_scoped("tenant-b");
    assert!(cluster_scoped(NAMESPACE).iter().all(|n| !theirs.contains(n)), "{theirs:?}");

    let dir = tempfile::tempdir().unwrap();
    crd_schemas(dir.path());
    let apiserver = KubeApiserver::start("chart").await.unwrap();
    let client = apiserver.client().await.unwrap();
    install_crds(&client).await.unwrap();
    for namespace in [NAMESPACE, "a", "b"] {
        ensure_namespace(&client, namespace).await.unwrap();
    }
    install_monitoring_stand_ins(&apiserver, dir.path());

    // No network here: built-in kinds are checked by the API server below, ours by kubeconform.
    // There is no schema of the Prometheus Operator's kinds offline, so kubeconform skips them
    // (-skip); the dry run against the stand-ins above still takes them.
    let schemas = format!("{}/{{{{.ResourceKind}}}}_{{{{.ResourceAPIVersion}}}}.json", dir.path().display());
    for variant in variants() {
        let rendered = run(&mut render_in(NAMESPACE, variant.sets));
        let docs = documents(&rendered);
        check_common(&docs);
        (variant.check)(&docs);

        let manifest = dir.path().join(format!("{}.yaml", variant.name.replace(' ', "-")));
        std::fs::write(&manifest, &rendered).unwrap();
        let report = run(Command::new(tool_path("kubeconform").unwrap())
            .args(["-strict", "-summary", "-ignore-missing-schemas", "-schema-location", &schemas])
            .args(["-skip", "ServiceMonitor,PrometheusRule"])
            .arg(&manifest));
        assert!(report.contains("Invalid: 0") && report.contains("Errors: 0"), "{}: {report}", variant.name);

        std::fs::write(&manifest, without_crds(&rendered)).unwrap();
        // A Pod is admitted only under a ServiceAccount that exists (a dry run creates none): the
        // test pod's, which Helm creates with the release, is made for real first.
        for pod in of_kind(&docs, "Pod") {
            let account = pod["spec"]["serviceAccountName"].as_str().unwrap();
            let _ =
                apiserver.kubectl().unwrap().args(["create", "serviceaccount", account, "-n", namespace(pod)]).output();
        }
        let applied = run(apiserver.kubectl().unwrap().args(["apply", "--dry-run=server", "-f"]).arg(&manifest));
        for doc in &docs {
            let object = applied_name(doc);
            assert!(applied.contains(&object), "{}: {object} not applied:\n{applied}", variant.name);
        }
    }

    let kustomized =
        run(apiserver.kubectl().unwrap().args(["apply", "--dry-run=server", "-k"]).arg(repo("config/default")));
    for object in [
        "deployment.apps/aether-operator",
        "service/aether-operator-metrics",
        "clusterrole.rbac.authorization.k8s.io/aether-operator-metrics-auth",
        "clusterrole.rbac.authorization.k8s.io/aether-operator-metrics-reader",
        "clusterrole.rbac.authorization.k8s.io/aether-federation-regionpeering-editor",
        "clusterrole.rbac.authorization.k8s.io/aether-federation-registryschema-viewer",
    ] {
        assert!(kustomized.contains(object), "{object} not applied:\n{kustomized}");
    }
}

/// One version for everything: the crate's, the chart's version and appVersion (so the default
/// image tag), the kustomize image; and the chart's CRDs are the generated ones.
#[test]
fn the_crate_the_chart_and_the_image_share_one_version() {
    let version = env!("CARGO_PKG_VERSION");
    let chart = std::fs::read_to_string(repo("charts/aether-federation/Chart.yaml")).unwrap();
    let field = |key: &str| {
        chart
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key}:")))
            .map(|v| v.trim().trim_matches('"').to_string())
            .unwrap_or_default()
    };
    assert_eq!((field("version"), field("appVersion")), (version.to_string(), version.to_string()), "Chart.yaml");
    let manager = std::fs::read_to_string(repo("config/manager/deployment.yaml")).unwrap();
    assert!(manager.contains(&format!("image: ghcr.io/aether/aether-operator:{version}")), "config/manager");
    let kustomization = std::fs::read_to_string(repo("config/default/kustomization.yaml")).unwrap();
    assert!(kustomization.contains(&format!("newTag: {version}")), "config/default");
    let chart_crds = repo("charts/aether-federation/crds");
    let mut names: Vec<String> = std::fs::read_dir(&chart_crds)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut generated: Vec<String> = aether_operator::api::crd_files().into_iter().map(|(name, _)| name).collect();
    generated.sort();
    assert_eq!(names, generated, "the chart's crds/ holds the CRDs and nothing else");
    for (name, contents) in aether_operator::api::crd_files() {
        assert_eq!(
            std::fs::read_to_string(chart_crds.join(&name)).unwrap(),
            contents,
            "charts/aether-federation/crds/{name} is out of date: run `make manifests`"
        );
    }
}

/// `helm <args> --kubeconfig <the apiserver's>`.
fn helm_on(apiserver: &KubeApiserver, args: &[&str]) -> Command {
    let mut cmd = Command::new(tool_path("helm").unwrap());
    cmd.args(args).arg("--kubeconfig").arg(apiserver.kubeconfig());
    cmd
}

/// kubectl as the admin; its stdout, or None when it fails.
fn kubectl_ok(apiserver: &KubeApiserver, args: &[&str]) -> Option<String> {
    let out = apiserver.kubectl().unwrap().args(args).output().unwrap();
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).to_string())
}

/// Waits up to a minute for `what` to hold.
fn wait_for<T>(what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if let Some(value) = probe() {
            return value;
        }
        assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// Every object the API server lists, as JSON.
fn everything(apiserver: &KubeApiserver) -> Vec<Value> {
    let kinds = kubectl_ok(apiserver, &["api-resources", "--verbs=list", "-o", "name"]).unwrap();
    let kinds: Vec<&str> = kinds.lines().filter(|k| !k.starts_with("componentstatuses")).collect();
    let listed = kubectl_ok(apiserver, &["get", &kinds.join(","), "-A", "-o", "json"]).unwrap();
    serde_json::from_str::<Value>(&listed).unwrap()["items"].as_array().unwrap().clone()
}

const RELEASE_VALUES: &[&str] = &[
    "regionPeering.enabled=true",
    "regionPeering.region=eu-west",
    "regionPeering.localEtcd.endpoints={https://registry-etcd:2379}",
    "regionPeering.localEtcd.tlsSecret=registry-etcd-client",
    "regionPeering.peerEtcd={us-east=https://etcd.us-east.example.net:2379}",
    "regionPeering.peerTlsSecrets.us-east=us-east-etcd-client",
    "prometheusRule.enabled=true",
    "grafanaDashboard.enabled=true",
    "metrics.serviceMonitor.enabled=true",
    "metrics.certSecret=aether-metrics-tls",
];

/// A release's life against a real kube-apiserver, where nothing reconciles: the test plays the
/// operator (a finalizer on the RegionPeering, removed once it is being deleted) and the kubelet
/// (it runs the uninstall hook's command with the hook's own ServiceAccount, and completes its
/// Job). Install puts the CRDs in from crds/; upgrade changes what the values say and is refused
/// over CRDs of another version until they are applied; uninstall deletes the RegionPeering while
/// the operator and its RBAC are still there, then everything of the release but the CRDs, and
/// leaves nothing Terminating.
#[tokio::test]
async fn a_release_installs_upgrades_and_uninstalls_leaving_nothing_behind() {
    let apiserver = KubeApiserver::start("chart-release").await.unwrap();
    let client = apiserver.client().await.unwrap();
    ensure_namespace(&client, NAMESPACE).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    install_monitoring_stand_ins(&apiserver, dir.path());
    let chart = repo("charts/aether-federation");
    let chart = chart.to_str().unwrap();
    let with_values = |args: &[&str], extra: &[&str]| -> Command {
        let mut cmd = helm_on(&apiserver, args);
        for set in RELEASE_VALUES.iter().chain(extra) {
            cmd.arg("--set").arg(set);
        }
        cmd
    };

    // Install: the CRDs first (crds/), then the release.
    let installed = run(&mut with_values(&["install", RELEASE, chart, "--namespace", NAMESPACE], &[]));
    // The notes' commands run as printed: nothing left for the reader to fill in.
    let notes = installed.split("NOTES:").nth(1).unwrap_or_else(|| panic!("no notes: {installed}"));
    assert!(!notes.contains("<name>") && !notes.contains("<namespace>") && !notes.contains("pod>"), "{notes}");
    // How to verify: the whole federation from a workstation, and from inside the cluster.
    assert!(notes.contains("kubectl aether status --all-contexts --etcd"), "{notes}");
    assert!(notes.contains(&format!("helm test {RELEASE} -n {NAMESPACE}")), "{notes}");
    for crd in ["regionpeerings.federation.aether.dev", "registryschemas.federation.aether.dev"] {
        let annotations = kubectl(&apiserver, &["get", "crd", crd, "-o", "jsonpath={.metadata.annotations}"]);
        assert!(annotations.contains("federation.aether.dev/schema-digest"), "{crd}: {annotations}");
    }
    for object in ["deployment", "poddisruptionbudget", "prometheusrule", "servicemonitor", "configmap"] {
        let object =
            if object == "configmap" { format!("{object}/{RELEASE}-dashboard") } else { format!("{object}/{RELEASE}") };
        kubectl(&apiserver, &["-n", NAMESPACE, "get", &object]);
    }
    // Helm checked the chart's kubeVersion against the version this API server reports.
    assert!(kubectl(&apiserver, &["get", "--raw", "/version"]).contains("\"gitVersion\": \"v1.35"));
    let peering = kubectl(&apiserver, &["-n", NAMESPACE, "get", "regionpeering", "eu-west", "-o", "json"]);
    let peering: Value = serde_json::from_str(&peering).unwrap();
    assert_eq!(peering["spec"]["peers"][0]["tls"]["secretRef"]["name"], "us-east-etcd-client");
    // The operator would add its finalizer on its first reconcile.
    let finalize = r#"{"metadata":{"finalizers":["federation.aether.dev/mirror"]}}"#;
    kubectl(&apiserver, &["-n", NAMESPACE, "patch", "regionpeering", "eu-west", "--type=merge", "-p", finalize]);

    // Upgrade: what the new values say, and nothing the operator added is lost.
    let upgrade_values = [
        "replicaCount=1",
        "regionPeering.lease.ttlSeconds=60",
        "prometheusRule.thresholds.replicationLagSeconds=120",
        "podLabels.tier=control",
    ];
    run(&mut with_values(&["upgrade", RELEASE, chart, "--namespace", NAMESPACE], &upgrade_values));
    let deployment: Value =
        serde_json::from_str(&kubectl(&apiserver, &["-n", NAMESPACE, "get", "deployment", RELEASE, "-o", "json"]))
            .unwrap();
    assert_eq!(deployment["spec"]["replicas"], 1);
    assert_eq!(deployment["spec"]["template"]["metadata"]["labels"]["tier"], "control");
    assert!(
        kubectl_ok(&apiserver, &["-n", NAMESPACE, "get", "poddisruptionbudget", RELEASE]).is_none(),
        "one replica: the PDB goes"
    );
    let peering: Value =
        serde_json::from_str(&kubectl(&apiserver, &["-n", NAMESPACE, "get", "regionpeering", "eu-west", "-o", "json"]))
            .unwrap();
    assert_eq!(peering["spec"]["lease"]["ttlSeconds"], 60);
    assert_eq!(peering["metadata"]["finalizers"], serde_json::json!(["federation.aether.dev/mirror"]));
    let rules: Value =
        serde_json::from_str(&kubectl(&apiserver, &["-n", NAMESPACE, "get", "prometheusrule", RELEASE, "-o", "json"]))
            .unwrap();
    let lag = rules["spec"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().iter())
        .find(|r| r["alert"] == "AetherFederationReplicationLagHigh")
        .unwrap();
    assert!(lag["expr"].as_str().unwrap().ends_with("> 120"), "the new threshold: {lag}");

    // CRDs of another version: the upgrade is refused, naming the command; once the chart's
    // CRDs are applied, it goes through.
    let stale = "federation.aether.dev/schema-digest=0000000000000000";
    kubectl(&apiserver, &["annotate", "crd", "regionpeerings.federation.aether.dev", stale, "--overwrite"]);
    let refused = fails(&mut with_values(&["upgrade", RELEASE, chart, "--namespace", NAMESPACE], &upgrade_values));
    assert!(refused.contains("kubectl apply --server-side --force-conflicts"), "{refused}");
    let crds = repo("charts/aether-federation/crds");
    run(apiserver.kubectl().unwrap().args(["apply", "--server-side", "--force-conflicts", "-f"]).arg(&crds));
    run(&mut with_values(&["upgrade", RELEASE, chart, "--namespace", NAMESPACE], &upgrade_values));

    // Uninstall. Helm runs the pre-delete hook first and waits for its Job.
    let mut uninstall = helm_on(&apiserver, &["uninstall", RELEASE, "--namespace", NAMESPACE, "--timeout", "120s"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let job_name = format!("{RELEASE}-uninstall");
    let job: Value = wait_for("the uninstall hook's Job", || {
        kubectl_ok(&apiserver, &["-n", NAMESPACE, "get", "job", &job_name, "-o", "json"])
            .map(|j| serde_json::from_str(&j).unwrap())
    });
    let hook = &job["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(hook["command"], serde_json::json!(["kubectl"]));
    let hook_args: Vec<String> =
        hook["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_string()).collect();
    // The kubelet's part: the hook's command, with the hook's ServiceAccount's token.
    let account = job["spec"]["template"]["spec"]["serviceAccountName"].as_str().unwrap().to_string();
    let as_hook = service_account_kubeconfig(&apiserver, NAMESPACE, &account, "uninstall-hook");
    let hook_run = Command::new(tool_path("kubectl").unwrap())
        .arg("--kubeconfig")
        .arg(&as_hook)
        .args(&hook_args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The operator's part: the RegionPeering is being deleted while the operator, its
    // ServiceAccount and its RBAC are all still there; the finalizer runs and goes.
    wait_for("the RegionPeering being deleted", || {
        kubectl_ok(
            &apiserver,
            &["-n", NAMESPACE, "get", "regionpeering", "eu-west", "-o", "jsonpath={.metadata.deletionTimestamp}"],
        )
        .filter(|t| !t.is_empty())
    });
    for object in [
        format!("deployment/{RELEASE}"),
        format!("serviceaccount/{RELEASE}"),
        format!("rolebinding/{RELEASE}-leader-election"),
    ] {
        assert!(
            kubectl_ok(&apiserver, &["-n", NAMESPACE, "get", &object]).is_some(),
            "{object} went before the RegionPeering"
        );
    }
    assert!(kubectl_ok(&apiserver, &["get", "clusterrolebinding", SCOPED]).is_some(), "the operator's RBAC went first");
    let unfinalize = r#"{"metadata":{"finalizers":null}}"#;
    kubectl(&apiserver, &["-n", NAMESPACE, "patch", "regionpeering", "eu-west", "--type=merge", "-p", unfinalize]);
    let hook_out = hook_run.wait_with_output().unwrap();
    assert!(hook_out.status.success(), "the hook's command failed: {}", String::from_utf8_lossy(&hook_out.stderr));
    // The Job succeeded: the kubelet and the Job controller would say so.
    let at = run(Command::new("date").args(["-u", "+%Y-%m-%dT%H:%M:%SZ"])).trim().to_string();
    let complete = serde_json::json!({"status": {
        "startTime": at, "completionTime": at, "succeeded": 1,
        "conditions": [
            {"type": "SuccessCriteriaMet", "status": "True", "lastTransitionTime": at},
            {"type": "Complete", "status": "True", "lastTransitionTime": at},
        ],
    }})
    .to_string();
    kubectl(
        &apiserver,
        &["-n", NAMESPACE, "patch", "job", &job_name, "--subresource=status", "--type=merge", "-p", &complete],
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let status = loop {
        if let Some(status) = uninstall.try_wait().unwrap() {
            break status;
        }
        assert!(std::time::Instant::now() < deadline, "helm uninstall did not finish");
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let out = uninstall.wait_with_output().unwrap();
    assert!(status.success(), "helm uninstall: {}", String::from_utf8_lossy(&out.stderr));

    // Nothing of the release is left but the CRDs (Helm never deletes crds/), no RegionPeering,
    // and nothing is Terminating.
    assert!(run(&mut helm_on(&apiserver, &["list", "--all-namespaces", "-q"])).trim().is_empty());
    let left = everything(&apiserver);
    let terminating: Vec<String> = left
        .iter()
        .filter(|o| !o["metadata"]["deletionTimestamp"].is_null())
        .map(|o| format!("{} {}", o["kind"], name(o)))
        .collect();
    assert!(terminating.is_empty(), "Terminating: {terminating:?}");
    let of_release: Vec<String> = left
        .iter()
        .filter(|o| o["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE || o["kind"] == "RegionPeering")
        .map(|o| format!("{} {}", o["kind"], name(o)))
        .collect();
    assert!(of_release.is_empty(), "left behind: {of_release:?}");
    for crd in ["regionpeerings.federation.aether.dev", "registryschemas.federation.aether.dev"] {
        assert!(kubectl_ok(&apiserver, &["get", "crd", crd]).is_some(), "{crd}: the CRDs stay");
    }
}

/// The Prometheus Operator's CRDs (stand-ins) that the chart's ServiceMonitor and PrometheusRule
/// need, applied and Established.
fn install_monitoring_stand_ins(apiserver: &KubeApiserver, dir: &std::path::Path) {
    let stand_ins = dir.join("monitoring-crds.yaml");
    std::fs::write(&stand_ins, MONITORING_STAND_INS).unwrap();
    run(apiserver.kubectl().unwrap().args(["apply", "-f"]).arg(&stand_ins));
    run(apiserver.kubectl().unwrap().args([
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/servicemonitors.monitoring.coreos.com",
        "crd/prometheusrules.monitoring.coreos.com",
    ]));
}
