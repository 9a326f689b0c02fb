//! What a worker reports: a cheap snapshot the operator reads for status and metrics, and the
//! events it turns into Kubernetes Events.
use std::time::SystemTime;

/// Where a worker is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    Connecting,
    /// A full sync is owed and waits its turn: an origin's workers run `FULL_SYNCS_AT_ONCE`
    /// syncs at once (`sync_slots.rs`). The leases the peer's records name are renewed meanwhile.
    Queued,
    Syncing,
    Watching,
    Resyncing,
    Backoff,
    Fenced,
    /// The mirror was retired from the peer (its RegionPeering deleted) after this worker owned
    /// it; the worker stopped for good.
    Retired,
    /// The worker writes nothing: its claim on the peer is refused (see `PeerHealth::refusal`).
    Refused,
    /// The worker writes nothing but keeps the copy's leases alive: what it would do next is held
    /// for a person (a resync that would delete most of the copy, a local etcd that holds a copy
    /// of this region); `PeerHealth::refusal` says what and how to go on.
    Held,
    Stopped,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Connecting => "Connecting",
            Phase::Queued => "Queued",
            Phase::Syncing => "Syncing",
            Phase::Watching => "Watching",
            Phase::Resyncing => "Resyncing",
            Phase::Backoff => "Backoff",
            Phase::Fenced => "Fenced",
            Phase::Retired => "Retired",
            Phase::Refused => "Refused",
            Phase::Held => "Held",
            Phase::Stopped => "Stopped",
        }
    }

    pub const ALL: [Phase; 11] = [
        Phase::Connecting,
        Phase::Queued,
        Phase::Syncing,
        Phase::Watching,
        Phase::Resyncing,
        Phase::Backoff,
        Phase::Fenced,
        Phase::Retired,
        Phase::Refused,
        Phase::Held,
        Phase::Stopped,
    ];
}

/// Why a worker writes nothing to its peer: a claim on the peer it must not take. `reason` is a
/// condition reason; the message names both sides and says what to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub reason: &'static str,
    pub message: String,
}

impl Refusal {
    /// Every reason a claim is refused for.
    pub const REASONS: [&'static str; 3] = ["DuplicateOrigin", "DuplicatePeer", "PeerIsOrigin"];
}

/// The health of one (origin, peer) mirror.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerHealth {
    pub origin: String,
    pub peer: String,
    pub phase: Phase,
    /// The cross-region failure detector's verdict.
    pub reachable: bool,
    pub keepalive_last_success: Option<SystemTime>,
    pub keepalive_failures: u64,
    /// The TTL the leases were renewed with (None while none is kept). The leases' time left is
    /// this less the age of `keepalive_last_success`, the stalest lease's last renewal.
    pub lease_ttl_reported: Option<i64>,
    pub lease_ttl_seconds: i64,
    pub leases: usize,
    /// The origin revision the peer holds completely.
    pub last_applied_revision: i64,
    /// The newest origin revision the worker has received.
    pub last_seen_revision: i64,
    /// When the oldest revision not yet applied was received; None when caught up.
    pub pending_since: Option<SystemTime>,
    /// Keys of the origin's subtree on the peer.
    pub keys: i64,
    pub resyncs: u64,
    /// Full resyncs by cause (`ResyncCause::label`): every sync after the worker's first.
    pub resyncs_by_cause: std::collections::BTreeMap<&'static str, u64>,
    /// The peer has held a complete snapshot since the last (re)sync, and the canary is written.
    pub synced: bool,
    pub last_error: Option<String>,
    pub last_error_time: Option<SystemTime>,
    /// The class of the last error (`problem::Problem::reason`), a condition reason.
    pub last_error_reason: Option<&'static str>,
    /// Set while the worker's claim on the peer is refused (phase `Refused`).
    pub refusal: Option<Refusal>,
    /// Source revisions too large for one Txn, applied in parts.
    pub split_revisions: u64,
    pub txns: u64,
    pub ops: u64,
    /// Sessions that ended in an error since the worker started.
    pub session_failures: u64,
    /// Origin keys whose value cannot fit in a request the peer accepts: key and size. They are
    /// left out of the mirror (and removed from the peer) until they shrink.
    pub oversized: Vec<(String, usize)>,
    /// Complete verification passes over the subtree.
    pub verify_passes: u64,
    /// Origin keys compared with the peer's copy, since the worker started.
    pub verified_keys: u64,
    /// Keys found different on the peer and repaired, since the worker started.
    pub drift_repaired_keys: u64,
    /// Whether the current or the last complete verification pass found drift.
    pub drift_detected: bool,
    /// Seconds each of the latest successful keepalive rounds took (oldest first, at most
    /// `KEEPALIVE_RTT_SAMPLES`), and how many succeeded since the worker started: the metrics
    /// observe the rounds they have not seen yet.
    pub keepalive_rtts: std::collections::VecDeque<f64>,
    pub keepalive_rounds: u64,
    /// LeaseKeepAlive streams the last round used.
    pub keepalive_streams: usize,
    /// The peer members the keepalive streams go to, and whether that is the leader alone.
    pub keepalive_endpoint: Option<String>,
    pub keepalive_on_leader: bool,
    /// The peer renews the leases too slowly for the TTL (at the last measured rate).
    pub renewal_shortfall: Option<RenewalShortfall>,
    /// A lease shard past the cap that cannot split further: said in status, never a panic.
    pub layout_problem: Option<String>,
    /// Lease shards split online because they passed the cap.
    pub shard_splits: u64,
    /// The most watch batch Txns that were in flight at once (more than one only across
    /// distance).
    pub batches_in_flight_peak: usize,
    /// Connections to the peer the session spreads its Txns over now (see
    /// `plan::spread_connections`).
    pub peer_connections: usize,
    /// The sync's window when its last Txn landed, the most it may reach (`plan::sync_window`),
    /// and how often the peer's queue halved it in the worker's life (`streams::pace`).
    pub sync_window: usize,
    pub sync_window_limit: usize,
    pub sync_window_cuts: u64,
    /// The origin's pages this worker's syncs read themselves, and those another worker of the
    /// region read for them (`origin_reads`), in the worker's life.
    pub origin_pages_read: u64,
    pub origin_pages_shared: u64,
}

/// Round-trip samples a health snapshot keeps; far more than happen between two refreshes.
pub const KEEPALIVE_RTT_SAMPLES: usize = 32;

impl PeerHealth {
    /// Records a successful keepalive round that took `rtt`.
    pub fn record_keepalive_rtt(&mut self, rtt: std::time::Duration) {
        if self.keepalive_rtts.len() == KEEPALIVE_RTT_SAMPLES {
            self.keepalive_rtts.pop_front();
        }
        self.keepalive_rtts.push_back(rtt.as_secs_f64());
        self.keepalive_rounds += 1;
    }

    /// Seconds the last successful keepalive round took.
    pub fn last_keepalive_round(&self) -> Option<f64> {
        self.keepalive_rtts.back().copied()
    }

    /// The round trips of the rounds after the first `seen` (all kept ones if the worker started
    /// over, its count below `seen`).
    pub fn keepalive_rtts_since(&self, seen: u64) -> impl Iterator<Item = f64> + '_ {
        let new = if self.keepalive_rounds >= seen { self.keepalive_rounds - seen } else { self.keepalive_rounds };
        let kept = self.keepalive_rtts.len();
        self.keepalive_rtts.iter().copied().skip(kept.saturating_sub(new.min(kept as u64) as usize))
    }

    pub fn new(origin: &str, peer: &str, lease_ttl_seconds: i64) -> Self {
        PeerHealth {
            origin: origin.to_string(),
            peer: peer.to_string(),
            phase: Phase::Connecting,
            reachable: true,
            keepalive_last_success: None,
            keepalive_failures: 0,
            lease_ttl_reported: None,
            lease_ttl_seconds,
            keepalive_rtts: Default::default(),
            keepalive_rounds: 0,
            keepalive_streams: 0,
            keepalive_endpoint: None,
            keepalive_on_leader: false,
            renewal_shortfall: None,
            layout_problem: None,
            shard_splits: 0,
            batches_in_flight_peak: 0,
            peer_connections: 0,
            sync_window: 0,
            sync_window_limit: 0,
            sync_window_cuts: 0,
            origin_pages_read: 0,
            origin_pages_shared: 0,
            leases: 0,
            last_applied_revision: 0,
            last_seen_revision: 0,
            pending_since: None,
            keys: 0,
            resyncs: 0,
            resyncs_by_cause: Default::default(),
            synced: false,
            last_error: None,
            last_error_time: None,
            last_error_reason: None,
            refusal: None,
            split_revisions: 0,
            txns: 0,
            ops: 0,
            session_failures: 0,
            oversized: Vec::new(),
            verify_passes: 0,
            verified_keys: 0,
            drift_repaired_keys: 0,
            drift_detected: false,
        }
    }

    /// Seconds the oldest unapplied revision has waited (0 when caught up).
    pub fn lag_seconds(&self, now: SystemTime) -> f64 {
        self.pending_since.map(|t| now.duration_since(t).unwrap_or_default().as_secs_f64()).unwrap_or(0.0)
    }

    /// Origin revisions received but not yet applied.
    pub fn lag_revisions(&self) -> i64 {
        (self.last_seen_revision - self.last_applied_revision).max(0)
    }

    /// Seconds left on the leases if no keepalive succeeds from now on.
    pub fn lease_ttl_remaining(&self, now: SystemTime) -> Option<i64> {
        let since = now.duration_since(self.keepalive_last_success?).unwrap_or_default().as_secs() as i64;
        Some((self.lease_ttl_reported.unwrap_or(self.lease_ttl_seconds) - since).max(0))
    }
}

/// Why a full resync started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResyncCause {
    /// The first sync of this worker.
    Initial,
    /// The origin compacted past the revision the mirror needed.
    Compacted,
    /// A lease was lost (expired or revoked); its keys are gone from the peer.
    LeaseLost,
    /// The subtree outgrew its leases; keys move to more leases.
    Reshard,
    /// The origin etcd was restored from a backup or replaced: its revisions mean something else.
    OriginChanged,
    /// The peer lost this mirror's records after it had synced: wiped, or restored from before them.
    RecordsLost,
    /// The leases were granted under another TTL than `spec.lease.ttlSeconds` now says: the copy
    /// moves onto leases of the new TTL, the old ones renewed until it has.
    LeaseTtlChanged,
}

impl ResyncCause {
    pub fn as_str(self) -> &'static str {
        match self {
            ResyncCause::Initial => "initial sync",
            ResyncCause::Compacted => "origin compacted past the mirror's revision",
            ResyncCause::LeaseLost => "a lease was lost",
            ResyncCause::Reshard => "the subtree outgrew its leases",
            ResyncCause::OriginChanged => "the origin etcd was restored or replaced",
            ResyncCause::RecordsLost => "the peer lost the mirror's records (wiped, or restored from before them)",
            ResyncCause::LeaseTtlChanged => {
                "the lease TTL changed: the copy moves onto leases of the new TTL, the old ones renewed until it has"
            }
        }
    }

    /// A short name, for metric labels.
    pub fn label(self) -> &'static str {
        match self {
            ResyncCause::Initial => "initial",
            ResyncCause::Compacted => "compacted",
            ResyncCause::LeaseLost => "lease_lost",
            ResyncCause::Reshard => "reshard",
            ResyncCause::OriginChanged => "origin_changed",
            ResyncCause::RecordsLost => "records_lost",
            ResyncCause::LeaseTtlChanged => "lease_ttl_changed",
        }
    }
}

/// What to change when the peer renews too slowly for the TTL.
pub const RENEWAL_ADVICE: &str = "raise spec.lease.ttlSeconds (the copy moves onto leases of the new TTL with no key missing), raise spec.lease.maxKeysPerLease (fewer leases; with etcd auth on, at most 64 keys go on a lease whatever it says), or list the peer's members (not a load balancer or a single follower) in its endpoints so that renewals reach its leader";

/// A layout the peer cannot renew within a third of the TTL at the rate it answers renewals.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RenewalShortfall {
    pub leases: usize,
    /// Renewals a second the peer answered in the last measured round.
    pub rate: u64,
    /// Streams that round used.
    pub streams: usize,
    /// What a round of every lease takes at that rate, and the TTL it must fit a third of.
    pub round: std::time::Duration,
    pub ttl: std::time::Duration,
}

impl RenewalShortfall {
    /// What a person reads: the numbers and what to change.
    pub fn describe(&self) -> String {
        format!(
            "renewing {} leases takes {:.1}s at the {} renewals/s the peer answers over {} streams, more than a third of the {}s TTL; {RENEWAL_ADVICE}",
            self.leases,
            self.round.as_secs_f64(),
            self.rate,
            self.streams,
            self.ttl.as_secs()
        )
    }
}

/// Something a person may want to see as a Kubernetes Event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MirrorEvent {
    ResyncStarted {
        cause: ResyncCause,
    },
    Synced {
        revision: i64,
        keys: i64,
    },
    /// A lease granted by a split.
    LeaseGranted {
        lease: i64,
        shard: usize,
    },
    /// The leases a sync granted for its layout, together (one event, not one per lease).
    LeasesGranted {
        leases: usize,
    },
    LeasesAdopted {
        leases: usize,
        revision: i64,
    },
    Fenced {
        by: String,
    },
    /// The worker's claim on the peer is refused; it writes nothing there.
    Refused(Refusal),
    RegionUnreachable,
    RegionReachable,
    RevisionSplit {
        revision: i64,
        ops: usize,
    },
    /// An origin value larger than any request the peer accepts: left out of the mirror.
    ValueTooLarge {
        key: String,
        bytes: usize,
    },
    /// A session failed: its class (a condition reason) and what to do, naming the endpoint and
    /// the Secret.
    SessionFailed {
        reason: &'static str,
        message: String,
    },
    /// The peer renews the leases too slowly for the TTL: said before anything lapses.
    RenewalsTooSlow(RenewalShortfall),
    /// Verification found the peer's copy different from the origin's and repaired it.
    DriftRepaired {
        keys: usize,
        first_key: String,
    },
}
