//! A worker's settings; `MirrorConfig::new` has the CRD's defaults.
use super::verify::VerifyBudget;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

/// The CRD's default verification budget of one origin, in keys a second: a peer's copy of 1,000
/// endpoints is compared in a second with one peer, and in 15 with 15.
pub const DEFAULT_VERIFY_KEYS_PER_SECOND: u64 = 1_000;

/// The CRD's default `spec.sync.maxResyncDeletePercent`.
pub const DEFAULT_MAX_RESYNC_DELETE_PERCENT: u8 = 50;

/// Settings of one worker.
#[derive(Clone, Debug)]
pub struct MirrorConfig {
    /// The region whose subtree is mirrored.
    pub origin: String,
    /// The region mirrored into.
    pub peer: String,
    /// This worker instance, unique across restarts and replicas (it is the fencing identity).
    pub owner_id: String,
    /// The object this worker mirrors for, recorded on the peer: a claim of another object on the
    /// same region is refused, and deleting an object retires only what it owns. None: a worker
    /// run without one (compatible with every claim).
    pub object: Option<super::records::checkpoint::OwningObject>,
    pub lease_ttl_seconds: i64,
    pub keepalive_interval: Duration,
    pub max_keys_per_lease: u64,
    pub page_size: i64,
    pub max_txn_ops: usize,
    pub max_txn_bytes: usize,
    /// The peer's `--max-request-bytes`: a value that cannot fit in a request under it is
    /// reported and left out instead of being retried forever.
    pub max_request_bytes: usize,
    /// Bytes a sync range page aims for (pages shrink when values are large).
    pub page_bytes: usize,
    /// Batch Txns in flight at once during a sync next door, more across distance
    /// (`plan::sync_window`); keys of one sync are distinct. At 16 a sync of 100k keys next door
    /// ran 27-28k keys/s where 4 ran 17.8k, on a day the peer's fsync was slow (`make bench`).
    pub sync_parallelism: usize,
    /// Ops received but not applied before the worker stops reading the watch.
    pub max_pending_ops: usize,
    /// Bytes received but not applied before the worker stops reading the watch.
    pub max_pending_bytes: usize,
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    /// The failure detector's acceptable pause.
    pub acceptable_pause: Duration,
    /// Deadline of each etcd request.
    pub rpc_timeout: Duration,
    /// How often the worker asks for watch progress, so an idle subtree still advances.
    pub progress_interval: Duration,
    /// How often one page of the peer's copy is compared with the origin (zero: never).
    pub verify_interval: Duration,
    /// Keys per verification page.
    pub verify_page_size: i64,
    /// The verification reads this worker shares with the other workers of its origin
    /// (`spec.sync.verifyKeysPerSecond`); `new` gives each worker its own.
    pub verify_budget: Arc<VerifyBudget>,
    /// How many peers the origin mirrors into (its object's workers), shared by those workers and
    /// kept current by the controller: in a full mesh as many regions write into each peer etcd,
    /// and they share its connections (`plan::spread_cap`). `new` counts one.
    pub origin_peers: Arc<AtomicUsize>,
    /// The full syncs the origin's workers take turns at (`sync_slots`): shared by the workers
    /// of one object; `new` gives each worker its own.
    pub sync_slots: Arc<super::sync_slots::SyncSlots>,
    /// The origin's pages the syncs running at once read once (`origin_reads`): shared by the
    /// workers of one object; `new` gives each worker its own.
    pub origin_reads: Arc<super::origin_reads::OriginReads>,
    /// How long a far peer's batch that is not full waits for more revisions while others are in
    /// flight (see `plan::watch_linger`).
    pub watch_linger: Duration,
    /// Shards per part of a checkpoint too large to be one record (`checkpoint::SHARDS_PER_PART`).
    pub checkpoint_shards_per_part: usize,
    /// The most of a live copy, in percent, that a full sync from an origin the records do not
    /// vouch for (replaced, restored, or not the one the copy came from) deletes without a person
    /// raising it (`spec.sync.maxResyncDeletePercent`); 100 never holds.
    pub max_resync_delete_percent: u8,
    /// Where the worker's and its keeper's panics are counted (the process's, from the
    /// controller; `new` gives each worker its own).
    pub supervision: Arc<crate::supervise::Supervision>,
    /// The bytes held for writes on their way, shared by the process's workers (`memory.rs`);
    /// `new` gives each worker its own.
    pub memory: Arc<super::memory::MemoryBudget>,
}

impl MirrorConfig {
    /// Defaults that match the CRD's.
    pub fn new(origin: &str, peer: &str, owner_id: &str) -> Self {
        MirrorConfig {
            origin: origin.to_string(),
            peer: peer.to_string(),
            owner_id: owner_id.to_string(),
            object: None,
            lease_ttl_seconds: 30,
            keepalive_interval: Duration::from_secs(10),
            max_keys_per_lease: 1_000,
            page_size: 1000,
            max_txn_ops: 128,
            max_txn_bytes: 1 << 20,
            max_request_bytes: 1_572_864,
            page_bytes: 8 << 20,
            sync_parallelism: 16,
            max_pending_ops: 200_000,
            max_pending_bytes: 64 << 20,
            backoff_base: Duration::from_millis(200),
            backoff_cap: Duration::from_secs(30),
            acceptable_pause: Duration::from_secs(20),
            rpc_timeout: Duration::from_secs(10),
            progress_interval: Duration::from_secs(2),
            verify_interval: Duration::from_secs(5),
            verify_page_size: 1000,
            verify_budget: Arc::new(VerifyBudget::new(DEFAULT_VERIFY_KEYS_PER_SECOND)),
            origin_peers: Arc::new(AtomicUsize::new(1)),
            sync_slots: Arc::default(),
            origin_reads: Arc::default(),
            watch_linger: super::plan::WATCH_LINGER,
            checkpoint_shards_per_part: super::records::checkpoint::SHARDS_PER_PART,
            max_resync_delete_percent: DEFAULT_MAX_RESYNC_DELETE_PERCENT,
            supervision: Arc::default(),
            memory: Arc::default(),
        }
    }
}
