//! `RegistrySchema`: "this registry's schema is v1; migrate it from the legacy v0 layout".
// Every `printcolumn(...)` repeats the same keys, which clippy mistakes for duplicated attributes.
#![allow(clippy::duplicated_attributes)]
use super::common::{EtcdConnection, conditions_schema};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// The schema of one registry etcd. With `targetVersion: v1` the operator drains the legacy
/// flat keys (`/aether/services/<svc>/protocols/<proto>/endpoints/<ip>`) into the origin-first
/// layout, losslessly under concurrent legacy writers, and reports its progress.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "federation.aether.dev",
    version = "v1alpha1",
    kind = "RegistrySchema",
    doc = "The key layout of one registry etcd. With targetVersion v1 the operator drains the legacy flat keys into the origin-first layout, losslessly under concurrent legacy writers, and reports its progress.",
    namespaced,
    status = "RegistrySchemaStatus",
    shortname = "regschema",
    category = "aether",
    printcolumn(name = "Target", type_ = "string", json_path = ".spec.targetVersion"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
    printcolumn(name = "Copied", type_ = "integer", json_path = ".status.counts.copied"),
    printcolumn(name = "Skipped", type_ = "integer", json_path = ".status.counts.skipped"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    printcolumn(name = "Seen", type_ = "integer", json_path = ".status.counts.legacySeen", priority = "1"),
    printcolumn(name = "Deleted", type_ = "integer", json_path = ".status.counts.deleted", priority = "1"),
    printcolumn(name = "DryRun", type_ = "boolean", json_path = ".spec.dryRun", priority = "1")
)]
#[serde(rename_all = "camelCase")]
pub struct RegistrySchemaSpec {
    /// The registry etcd to migrate.
    pub etcd: EtcdConnection,
    /// The region for legacy values that carry none.
    #[schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"))]
    pub region: String,
    /// The cluster for legacy values that carry no `clusterName`.
    #[schemars(length(min = 1, max = 253), regex(pattern = r"^[^/\s]+$"))]
    pub cluster: String,
    /// The legacy prefix: a key prefix that starts and ends with `/`, neither the root nor inside
    /// the v1 layout.
    #[serde(default = "default_legacy_prefix")]
    #[schemars(regex(pattern = r"^/.+/$"), length(max = 253))]
    #[x_kube(validation = Rule::new("!self.startsWith('/aether/v1/') && !'/aether/v1/'.startsWith(self)").message("legacyPrefix may not cover the v1 layout /aether/v1/ (live endpoints and the federation's and the drain's own records)"))]
    pub legacy_prefix: String,
    /// The schema version to reach.
    #[serde(default)]
    pub target_version: SchemaVersion,
    #[serde(default)]
    pub drain: DrainSettings,
    /// Compute and report what the drain would do, and write nothing.
    #[serde(default)]
    pub dry_run: bool,
}

fn default_legacy_prefix() -> String {
    crate::keys::V0_ROOT.to_string()
}

/// A registry key layout version.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum SchemaVersion {
    #[default]
    #[serde(rename = "v1")]
    V1,
}

/// How the drain runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DrainSettings {
    /// Legacy keys per Txn (each key is one nested Txn; etcd allows 128 ops per Txn).
    #[serde(default = "default_batch_size")]
    #[schemars(range(min = 1, max = 128))]
    pub batch_size: i64,
    /// Keys per second at most; 0 for no limit.
    #[serde(default)]
    #[schemars(range(min = 0, max = 1000000))]
    pub rate_limit_per_second: i64,
    /// How long the legacy prefix must see no write before its keys are deleted and the drain is
    /// complete.
    #[serde(default = "default_quiet_period")]
    #[schemars(range(min = 0, max = 86400))]
    pub quiet_period_seconds: i64,
}

fn default_batch_size() -> i64 {
    100
}
fn default_quiet_period() -> i64 {
    300
}

impl Default for DrainSettings {
    fn default() -> Self {
        DrainSettings {
            batch_size: default_batch_size(),
            rate_limit_per_second: 0,
            quiet_period_seconds: default_quiet_period(),
        }
    }
}

/// Progress of the drain.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RegistrySchemaStatus {
    /// The generation the status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Pending, Copying, Draining, Complete, DryRunComplete or Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// Migrated and Drained.
    #[serde(default)]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    #[serde(default)]
    pub counts: DrainCounts,
    /// The first few legacy keys skipped as malformed; they are left in place.
    #[serde(default)]
    pub skipped_keys: Vec<String>,
    /// The first few legacy keys naming another region, with the region; left in place.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub foreign_keys: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_time: Option<Time>,
    /// What the drain is doing or why it stopped, for a person.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Counters of the drain.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DrainCounts {
    /// Legacy keys seen (the initial range and the watch).
    pub legacy_seen: i64,
    /// Copied to their v1 key.
    pub copied: i64,
    /// Whose v1 key already held a newer write, left as it was.
    pub already_present: i64,
    /// Malformed values, left in place.
    pub skipped: i64,
    /// Legacy keys deleted after their copy.
    pub deleted: i64,
    /// Compares that failed because a legacy writer changed the key meanwhile; retried.
    pub conflicts: i64,
    /// Legacy values naming another region: left in place, never deleted. Only that region
    /// writes its subtree; drain them from that region's etcd (or move them there).
    #[serde(default)]
    pub foreign: i64,
}
