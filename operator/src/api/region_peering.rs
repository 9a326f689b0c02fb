//! `RegionPeering`: "this region is X; its etcd is here; its peers are Y and Z with their etcds".
// Every `printcolumn(...)` repeats the same keys, which clippy mistakes for duplicated attributes.
#![allow(clippy::duplicated_attributes)]
use super::common::{EtcdConnection, EtcdTls, conditions_schema};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// The pattern of a region name: a DNS label.
pub const REGION_PATTERN: &str = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$";

/// The federation topology of one region. The operator, leader-elected once per region, mirrors
/// this region's subtree `/aether/v1/regions/<region>/` of the local etcd into every peer's etcd
/// under an origin-heartbeat lease, and reports per-peer health.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "federation.aether.dev",
    version = "v1alpha1",
    kind = "RegionPeering",
    doc = "The federation topology of one region: its registry etcd and its peers. The region's leader mirrors the region's subtree into every peer's etcd under an origin-heartbeat lease and reports per-peer replication and keepalive health.",
    namespaced,
    status = "RegionPeeringStatus",
    shortname = "rpeer",
    category = "aether",
    printcolumn(name = "Region", type_ = "string", json_path = ".spec.region"),
    printcolumn(
        name = "Peers",
        type_ = "string",
        json_path = ".status.peersReady",
        description = "peers ready / total"
    ),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
    printcolumn(
        name = "Lag",
        type_ = "string",
        json_path = ".status.worstLag",
        description = "the worst replication lag over all peers"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    printcolumn(name = "Reason", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].reason"),
    printcolumn(name = "Leader", type_ = "string", json_path = ".status.leader", priority = "1"),
    printcolumn(
        name = "Inbound",
        type_ = "string",
        json_path = ".status.inboundSummary",
        priority = "1",
        description = "origins mirrored into this region"
    ),
    printcolumn(name = "Suspended", type_ = "boolean", json_path = ".spec.suspend", priority = "1")
)]
#[x_kube(validation = Rule::new("!has(self.peers) || self.peers.all(p, p.region != self.region)").message("a peer may not be the own region").field_path(".peers").reason(Reason::FieldValueInvalid))]
#[x_kube(validation = Rule::new("!has(self.peers) || self.peers.all(p, p.endpoints.all(e, !self.localEtcd.endpoints.exists(l, l.lowerAscii().replace('/', '') == e.lowerAscii().replace('/', ''))))").message("a peer's endpoints may not be the local etcd's (however spelled: case and a trailing slash do not matter): the region would mirror into itself").field_path(".peers").reason(Reason::FieldValueInvalid))]
#[x_kube(validation = Rule::new("!has(self.failureDetector) || !has(self.failureDetector.acceptablePauseSeconds) || self.failureDetector.acceptablePauseSeconds < (has(self.lease) ? self.lease.ttlSeconds : 30)").message("failureDetector.acceptablePauseSeconds must be shorter than lease.ttlSeconds, or a peer is reported unreachable only after its mirror has lapsed").field_path(".failureDetector.acceptablePauseSeconds").reason(Reason::FieldValueInvalid))]
#[x_kube(validation = Rule::new("!has(self.failureDetector) || !has(self.failureDetector.acceptablePauseSeconds) || self.failureDetector.acceptablePauseSeconds > (has(self.lease) ? self.lease.keepaliveIntervalSeconds : 10)").message("failureDetector.acceptablePauseSeconds must be longer than lease.keepaliveIntervalSeconds: an idle, healthy peer answers once an interval, so a shorter pause reports it unreachable between two answers (leave it unset for twice the interval)").field_path(".failureDetector.acceptablePauseSeconds").reason(Reason::FieldValueInvalid))]
#[serde(rename_all = "camelCase")]
pub struct RegionPeeringSpec {
    /// This region's name, a DNS label. The operator mirrors `/aether/v1/regions/<region>/` of the
    /// local etcd, and nothing else. Immutable.
    #[schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("region is immutable: create a new RegionPeering instead"))]
    pub region: String,
    /// This region's registry etcd: the source of the mirror.
    pub local_etcd: EtcdConnection,
    /// The peer regions this region's subtree is mirrored into. Empty for a single region: then
    /// nothing is mirrored and nothing changes.
    #[serde(default)]
    #[schemars(length(max = 32), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["region"]))]
    pub peers: Vec<PeerRegion>,
    /// The origin-heartbeat leases this region holds on every peer.
    #[serde(default)]
    pub lease: LeaseSettings,
    /// How a peer region is judged unreachable. It only reports; it never deletes anything.
    #[serde(default)]
    pub failure_detector: FailureDetectorSettings,
    /// Paging and batching of the mirror.
    #[serde(default)]
    pub sync: SyncSettings,
    /// Stops every mirror worker. The mirrors on the peers then lapse with their leases.
    #[serde(default)]
    pub suspend: bool,
    /// What deleting this RegionPeering does on the peers. `Lapse` (the default): the workers
    /// stop, the mirrored keys expire on every peer within the lease TTL, and the bookkeeping
    /// records are attached to a lease so they go with them. `Delete`: the mirrored subtree and
    /// the bookkeeping are deleted from every reachable peer at once. An unreachable peer never
    /// blocks the deletion: its copy lapses with the lease.
    #[serde(default)]
    pub deletion_policy: DeletionPolicy,
}

/// What deleting a RegionPeering does on the peers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum DeletionPolicy {
    /// Stop the heartbeat: the mirror expires on every peer within the lease TTL.
    #[default]
    Lapse,
    /// Delete the mirror from every reachable peer now.
    Delete,
}

/// One peer region and its registry etcd.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.endpoints.all(e, e.startsWith('https://')) || self.endpoints.all(e, e.startsWith('http://'))").message("endpoints mix http:// and https://; use one scheme").field_path(".endpoints"))]
pub struct PeerRegion {
    /// The peer's region name, a DNS label; it may not be this region's own.
    #[schemars(length(min = 1, max = 63), regex(pattern = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"))]
    pub region: String,
    /// Client URLs of the peer's registry etcd.
    #[schemars(length(min = 1, max = 16), inner(regex(pattern = r"^https?://[^\s/]+/?$"), length(max = 253)))]
    pub endpoints: Vec<String>,
    /// Client credentials for the peer's etcd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<EtcdTls>,
}

impl PeerRegion {
    pub fn connection(&self) -> EtcdConnection {
        EtcdConnection { endpoints: self.endpoints.clone(), tls: self.tls.clone() }
    }
}

/// Lease settings. Every mirrored key on a peer is attached to a lease that this region's leader
/// keeps alive; when the region goes away, its mirror expires on every peer within the TTL.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.keepaliveIntervalSeconds * 3 <= self.ttlSeconds").message("keepaliveIntervalSeconds must be at most a third of ttlSeconds, so that two keepalives may fail before the lease expires").field_path(".keepaliveIntervalSeconds"))]
pub struct LeaseSettings {
    /// Lease TTL in seconds: how long a peer keeps this region's mirror after the last keepalive.
    #[serde(default = "default_ttl")]
    #[schemars(range(min = 5, max = 3600))]
    pub ttl_seconds: i64,
    /// Seconds between keepalives; about a third of the TTL.
    #[serde(default = "default_keepalive")]
    #[schemars(range(min = 1, max = 1200))]
    pub keepalive_interval_seconds: i64,
    /// The most keys attached to one lease. Every put attached to a lease costs etcd time linear
    /// in the keys already on it when auth is on (it checks the writer may write them all), and
    /// always before 3.5.10 (etcd issue 15993), so subtrees are sharded over several leases. On a
    /// peer with auth enabled the mirror uses at most 64 keys a lease, whatever this says.
    #[serde(default = "default_max_keys_per_lease")]
    #[schemars(range(min = 100, max = 1000000))]
    pub max_keys_per_lease: i64,
}

fn default_ttl() -> i64 {
    30
}
fn default_keepalive() -> i64 {
    10
}
fn default_max_keys_per_lease() -> i64 {
    1_000
}

impl Default for LeaseSettings {
    fn default() -> Self {
        LeaseSettings {
            ttl_seconds: default_ttl(),
            keepalive_interval_seconds: default_keepalive(),
            max_keys_per_lease: default_max_keys_per_lease(),
        }
    }
}

/// The cross-region failure detector: a deadline on successful round trips to the peer
/// (keepalive answers, Txns, reads). It only reports.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct FailureDetectorSettings {
    /// A peer with no successful round trip for this long is reported unreachable. Unset, twice
    /// the keepalive interval (20 s at the defaults): an idle, healthy peer answers once an
    /// interval, so the pause must be longer than the interval, and shorter than the TTL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 2, max = 600))]
    pub acceptable_pause_seconds: Option<i64>,
}

impl FailureDetectorSettings {
    /// The pause in force: the one set, or twice the keepalive interval, kept under the TTL.
    pub fn effective_pause_seconds(&self, lease: &LeaseSettings) -> i64 {
        self.acceptable_pause_seconds
            .unwrap_or_else(|| (2 * lease.keepalive_interval_seconds).min(lease.ttl_seconds - 1))
            .max(1)
    }
}

/// Paging and batching of the mirror.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.maxTxnBytes < self.maxRequestBytes").message("maxTxnBytes must be below maxRequestBytes (the peers' --max-request-bytes): a Txn that fills maxTxnBytes would be refused as too large").field_path(".maxTxnBytes"))]
pub struct SyncSettings {
    /// Keys per range page in a full sync, at least: a larger subtree is read in at most 64 pages of up to 16,384 keys (etcd counts every key to a range's end for each page), and pages shrink when values are large.
    #[serde(default = "default_page_size")]
    #[schemars(range(min = 10, max = 10000))]
    pub page_size: i64,
    /// The most operations in one peer Txn (etcd's `--max-txn-ops`, 128 by default).
    #[serde(default = "default_max_txn_ops")]
    #[schemars(range(min = 4, max = 100000))]
    pub max_txn_ops: i64,
    /// The most bytes in one peer Txn; keep it under etcd's `--max-request-bytes` (1.5 MiB).
    #[serde(default = "default_max_txn_bytes")]
    #[schemars(range(min = 65536, max = 67108864))]
    pub max_txn_bytes: i64,
    /// The peers' `--max-request-bytes`. An origin value too large for one request under it is
    /// left out of the mirror and reported (condition ValuesTooLarge) instead of blocking it.
    #[serde(default = "default_max_request_bytes")]
    #[schemars(range(min = 65536, max = 2147483647))]
    pub max_request_bytes: i64,
    /// How long a batch for a peer far away waits for more revisions while other batches are on
    /// their way (a peer next door gets one batch at a time and never waits). Each worker sends at
    /// most one batch that is not half full per linger: raise it in a large mesh to send fewer Txns
    /// into each peer, at the cost of as much replication latency; 0 sends each revision at once.
    #[serde(default = "default_watch_linger")]
    #[schemars(range(min = 0, max = 1000))]
    pub watch_linger_milliseconds: i64,
    /// Keys a second the mirror reads to verify the peers' copies against this region's subtree,
    /// shared by all its peers: the local etcd serves at most this many (and each peer's etcd
    /// about as many from all the regions together, when every region uses the same budget),
    /// whatever the number of peers. A pass over the subtree takes keys x peers / budget seconds
    /// (at least 5 s per 1,000-key page and peer). 0 turns verification off: drift on a peer
    /// (out-of-band writes, a restore) is then not repaired until the next resync.
    #[serde(default = "default_verify_keys_per_second")]
    #[schemars(range(min = 0, max = 1000000))]
    pub verify_keys_per_second: i64,
    /// A peer whose lag exceeds this many seconds is not Ready.
    #[serde(default = "default_max_ready_lag")]
    #[schemars(range(min = 1, max = 86400))]
    pub max_ready_lag_seconds: i64,
    /// The most of a peer's live copy, in percent, that a full sync from an origin the records
    /// do not vouch for (its etcd replaced or restored, or spec.localEtcd now reaching another
    /// etcd) may delete. Past it the sync waits, the copy is kept alive as it is, and the peer is
    /// Held (reason ResyncWouldDelete) until this is raised: set 100 to let an origin restored or
    /// replaced on purpose be mirrored as it is, and set it back after.
    #[serde(default = "default_max_resync_delete_percent")]
    #[schemars(range(min = 0, max = 100))]
    pub max_resync_delete_percent: i64,
}

fn default_page_size() -> i64 {
    1000
}
fn default_max_txn_ops() -> i64 {
    128
}
fn default_max_txn_bytes() -> i64 {
    1_048_576
}
fn default_max_request_bytes() -> i64 {
    1_572_864
}
fn default_watch_linger() -> i64 {
    5
}
fn default_verify_keys_per_second() -> i64 {
    crate::mirror::DEFAULT_VERIFY_KEYS_PER_SECOND as i64
}
fn default_max_ready_lag() -> i64 {
    30
}
fn default_max_resync_delete_percent() -> i64 {
    crate::mirror::DEFAULT_MAX_RESYNC_DELETE_PERCENT as i64
}

impl Default for SyncSettings {
    fn default() -> Self {
        SyncSettings {
            page_size: default_page_size(),
            max_txn_ops: default_max_txn_ops(),
            max_txn_bytes: default_max_txn_bytes(),
            max_request_bytes: default_max_request_bytes(),
            watch_linger_milliseconds: default_watch_linger(),
            verify_keys_per_second: default_verify_keys_per_second(),
            max_ready_lag_seconds: default_max_ready_lag(),
            max_resync_delete_percent: default_max_resync_delete_percent(),
        }
    }
}

/// What the operator observes of the federation, as this region sees it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RegionPeeringStatus {
    /// The generation the status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Ready, Replicating, PeersReachable, KeepaliveDegraded, DriftDetected, ValuesTooLarge,
    /// ChangeRefused and HandoffCovered, and Conflict or Suspended when they apply; each with a
    /// reason and a message that says what to do.
    #[serde(default)]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// The operator instance that holds this region's leadership.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leader: Option<String>,
    /// The coordination.k8s.io Lease electing the leader ("namespace/name"): `aether-operator
    /// status` reads it to tell a stale status from a current one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leader_lease: Option<String>,
    /// When the leader last wrote this status. It writes on every visible change and at least
    /// every `refreshIntervalSeconds`: older than that (and the Lease's duration), nobody updates it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refreshed_time: Option<Time>,
    /// Seconds between the leader's refreshes of this status when nothing changes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refresh_interval_seconds: Option<i64>,
    /// "ready/total" peers, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peers_ready: Option<String>,
    /// The worst lag over all peers, such as "1s" or "12s/340rev", for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worst_lag: Option<String>,
    /// Origins mirrored into this region and their key counts, such as "b:120 c:98".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inbound_summary: Option<String>,
    /// One entry per peer this region mirrors into.
    #[serde(default)]
    pub peers: Vec<PeerStatus>,
    /// What the other regions mirror into this region's etcd, one entry per origin.
    #[serde(default)]
    pub inbound: Vec<InboundStatus>,
}

/// The mirror into one peer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PeerStatus {
    /// The peer region (one of `spec.peers`).
    pub region: String,
    /// Connecting, Queued (a full sync waits its turn among the region's peers), Syncing, Watching, Resyncing, Backoff, Fenced, Retired, Refused, Held (what comes next waits for a person; the copy is kept alive) or Stopped.
    pub phase: String,
    /// The cross-region failure detector's verdict.
    pub reachable: bool,
    pub keepalive: KeepaliveStatus,
    pub replication: ReplicationStatus,
    /// Origin values larger than the peer accepts in one request (at most 10 shown): left out
    /// of the mirror until they shrink.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub oversized_values: Vec<OversizedValue>,
    /// The last error, with the time it happened; cleared once the mirror applies again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// A hash of the configuration the peer's worker runs on (the spec's fields that restart it
    /// and the credentials it uses). A new leader starts a worker on the same configuration
    /// without trying it first, and so renews the region's leases sooner after a handoff.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub configuration: Option<String>,
}

/// An origin key whose value no request to the peer can carry.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct OversizedValue {
    /// The origin key.
    pub key: String,
    /// Its value's size in bytes.
    pub bytes: i64,
}

/// The origin-heartbeat leases on one peer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct KeepaliveStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_success_time: Option<Time>,
    /// Keepalive rounds failed in a row since the last success.
    pub consecutive_failures: i64,
    /// Seconds the stalest lease has left if no renewal succeeds from now on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_remaining_seconds: Option<i64>,
    /// How many leases (shards) this region holds on the peer.
    pub leases: i64,
    /// How long the last keepalive round took (every lease renewed once). Past a third of the TTL,
    /// KeepaliveDegraded fires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_round_milliseconds: Option<i64>,
    /// LeaseKeepAlive streams the renewals go over: more when one cannot renew every lease in time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub streams: Option<i64>,
}

/// Replication progress into one peer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReplicationStatus {
    /// Seconds the oldest origin revision not yet on the peer has waited (0 when caught up).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag_seconds: Option<i64>,
    /// Origin revisions seen but not yet applied on the peer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag_revisions: Option<i64>,
    /// The last origin revision the peer holds completely.
    pub last_applied_revision: i64,
    /// Keys of this region's subtree on the peer.
    pub keys: i64,
    /// Full resyncs since the worker started (compaction, lost lease).
    pub resyncs: i64,
    /// The same resyncs by cause (`compacted`, `lease_lost`, `reshard`, `origin_changed`,
    /// `records_lost`, `lease_ttl_changed`, `initial`): what to look into when `resyncs` grows.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub resyncs_by_cause: std::collections::BTreeMap<String, i64>,
    /// Whether the initial sync has completed and the canary is written.
    pub synced: bool,
    /// Keys that continuous verification found different on the peer and repaired.
    #[serde(default)]
    pub drift_repaired_keys: i64,
}

/// One origin region's mirror inside this region's etcd.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct InboundStatus {
    /// The origin region.
    pub region: String,
    /// Keys of the origin's subtree in this region's etcd.
    pub keys: i64,
    /// The shortest remaining TTL over the origin's leases here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ttl_remaining_seconds: Option<i64>,
    /// Whether the origin's sync canary is present: its complete snapshot has arrived.
    pub synced: bool,
    /// The origin revision the checkpoint records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_revision: Option<i64>,
}
