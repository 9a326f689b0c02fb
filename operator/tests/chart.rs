//! The Helm chart: lint, render each variant of its values, check what each renders, validate the
//! rendered manifests with kubeconform (strict, with the CRD schemas) and apply them with a
//! server-side dry run to a real kube-apiserver. The same server-side dry run covers
//! `kubectl apply -k config/default`.
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
            assert!(name(doc).starts_with(SCOPED), "{} does not carry the release namespace", applied_name(doc));
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
    let peering = one(docs, "RegionPeering");
    assert_eq!(peering["spec"]["sync"], serde_json::json!({"pageSize": 500}), "only the sync settings given");
    assert_eq!(peering["spec"]["deletionPolicy"], "Delete");
    assert_eq!(peering["spec"]["peers"].as_array().unwrap().len(), 2);
    assert!(of_kind(docs, "NetworkPolicy").is_empty() && of_kind(docs, "ServiceMonitor").is_empty());
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
    assert!(endpoint["bearerTokenFile"].is_null() && endpoint["tlsConfig"].is_null(), "{endpoint}");
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
    assert_eq!(endpoint["bearerTokenFile"], "/var/run/secrets/kubernetes.io/serviceaccount/token");
    assert_eq!(endpoint["tlsConfig"], serde_json::json!({"insecureSkipVerify": true}));
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

/// prometheusRule.enabled: the alerting rules as a PrometheusRule.
fn check_prometheus_rule(docs: &[Value]) {
    let rule = one(docs, "PrometheusRule");
    assert_eq!(namespace(rule), NAMESPACE);
    assert!(!rule["spec"]["groups"].as_array().map(Vec::is_empty).unwrap_or(true), "no rule groups");
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

/// replicaCount=1: no PodDisruptionBudget (it would block every drain, or protect nothing).
fn check_one_replica(docs: &[Value]) {
    assert_eq!(one(docs, "Deployment")["spec"]["replicas"], 1);
    assert!(of_kind(docs, "PodDisruptionBudget").is_empty());
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
        Variant { name: "grafana dashboard", sets: &["grafanaDashboard.enabled=true"], check: check_grafana_dashboard },
        Variant { name: "one replica", sets: &["replicaCount=1"], check: check_one_replica },
    ]
}

#[tokio::test]
async fn the_chart_lints_validates_and_applies() {
    let helm = tool_path("helm").unwrap();
    let chart = repo("charts/aether-federation");
    run(Command::new(&helm).arg("lint").arg(&chart).args(["--kube-version", "1.35.0"]));

    // values.schema.json rejects what the chart cannot render, naming the value.
    let rejected =
        fails(&mut render_in(NAMESPACE, &["logFormat=xml", "metrics.port=0", "podDisruptionBudget.minAvailable=1"]));
    for value in ["logFormat", "metrics/port", "minAvailable"] {
        assert!(rejected.contains(value), "the schema does not name {value}:\n{rejected}");
    }
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
    let stand_ins = dir.path().join("monitoring-crds.yaml");
    std::fs::write(&stand_ins, MONITORING_STAND_INS).unwrap();
    run(apiserver.kubectl().unwrap().args(["apply", "-f"]).arg(&stand_ins));
    run(apiserver.kubectl().unwrap().args([
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/servicemonitors.monitoring.coreos.com",
        "crd/prometheusrules.monitoring.coreos.com",
    ]));

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
