//! Types shared by both kinds.
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// How to reach one etcd cluster.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.endpoints.all(e, e.startsWith('https://')) || self.endpoints.all(e, e.startsWith('http://'))").message("endpoints mix http:// and https://; use one scheme").field_path(".endpoints"))]
pub struct EtcdConnection {
    /// Client URLs of the etcd members, such as `https://etcd-0.etcd:2379`. Plain `http://` is used
    /// only where the URL says so.
    #[schemars(length(min = 1, max = 16), inner(regex(pattern = r"^https?://[^\s/]+/?$"), length(max = 253)))]
    pub endpoints: Vec<String>,
    /// Client credentials for TLS. Without it, `https://` endpoints are verified against the
    /// public web PKI roots and no client certificate is sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<EtcdTls>,
}

/// TLS material for an etcd connection.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct EtcdTls {
    /// A Secret in the object's namespace with `ca.crt`, and optionally `tls.crt` and `tls.key`
    /// for a client certificate. A change to the Secret is picked up without a restart.
    pub secret_ref: SecretRef,
}

/// A reference to a Secret in the same namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
pub struct SecretRef {
    /// The Secret's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// Schema for `conditions`: the metav1.Condition list, a list-map keyed by `type`.
pub fn conditions_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let mut schema = generator.subschema_for::<Vec<Condition>>();
    schema.insert("x-kubernetes-list-type".into(), "map".into());
    schema.insert("x-kubernetes-list-map-keys".into(), serde_json::json!(["type"]));
    schema
}
