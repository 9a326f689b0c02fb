//! Prometheus metrics, all prefixed `aether_federation_`. A mirror's series are labelled `origin`
//! (the region whose subtree it is) and `target` (the region it is mirrored into), the same way on
//! both sides: this region's workers report `origin` = this region, what other regions mirror in
//! reports `target` = this region. The families are grouped by what they describe, each group
//! registering its own.
use crate::mirror::inbound::InboundOrigin;
use crate::mirror::{PeerHealth, Phase};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry};
use std::sync::atomic::AtomicU64;
use std::time::SystemTime;

/// One mirror: the region it comes from and the region it goes into.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MirrorLabels {
    pub origin: String,
    pub target: String,
}

impl MirrorLabels {
    pub fn new(origin: &str, target: &str) -> Self {
        MirrorLabels { origin: origin.to_string(), target: target.to_string() }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CauseLabels {
    pub origin: String,
    pub target: String,
    pub cause: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub origin: String,
    pub target: String,
    pub phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub origin: String,
    pub target: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RegionLabels {
    pub region: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DrainLabels {
    pub region: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DrainPhaseLabels {
    pub region: String,
    pub phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    pub controller: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TaskLabels {
    pub task: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// Registers `metric` under `name` and hands it back.
fn add<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

fn duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 12))
}

/// Keepalive rounds: a millisecond on a LAN to seconds across a stalled WAN.
fn round_trip_histogram() -> Histogram {
    Histogram::new([0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0])
}

/// This region's mirrors into its peers: progress, sessions, verification.
pub struct ReplicationMetrics {
    pub lag_seconds: Family<MirrorLabels, FloatGauge>,
    pub lag_revisions: Family<MirrorLabels, Gauge>,
    pub last_applied_revision: Family<MirrorLabels, Gauge>,
    pub keys: Family<MirrorLabels, Gauge>,
    pub synced: Family<MirrorLabels, Gauge>,
    pub reachable: Family<MirrorLabels, Gauge>,
    pub phase: Family<PhaseLabels, Gauge>,
    pub claim_refused: Family<ReasonLabels, Gauge>,
    pub values_left_out: Family<MirrorLabels, Gauge>,
    pub resyncs: Family<CauseLabels, Counter>,
    pub session_failures: Family<MirrorLabels, Counter>,
    pub drift_repaired_keys: Family<MirrorLabels, Counter>,
    pub verified_keys: Family<MirrorLabels, Counter>,
    pub split_revisions: Family<MirrorLabels, Counter>,
    pub txns: Family<MirrorLabels, Counter>,
}

impl ReplicationMetrics {
    fn register(r: &mut Registry) -> Self {
        ReplicationMetrics {
            lag_seconds: add(
                r,
                "replication_lag_seconds",
                "Age of the oldest origin revision not yet applied on the target",
                Family::default(),
            ),
            lag_revisions: add(
                r,
                "replication_lag_revisions",
                "Origin revisions received but not yet applied on the target",
                Family::default(),
            ),
            last_applied_revision: add(
                r,
                "last_applied_revision",
                "The origin revision the target holds completely",
                Family::default(),
            ),
            keys: add(r, "mirrored_keys", "Keys of the origin's subtree on the target", Family::default()),
            synced: add(r, "peer_synced", "1 when the target holds a complete snapshot", Family::default()),
            reachable: add(
                r,
                "peer_reachable",
                "1 when the cross-region failure detector deems the target reachable",
                Family::default(),
            ),
            phase: add(r, "worker_phase", "1 for the worker's current phase", Family::default()),
            claim_refused: add(
                r,
                "claim_refused",
                "1 while the worker's claim on the target is refused for this reason (DuplicateOrigin, DuplicatePeer, PeerIsOrigin): it writes nothing there",
                Family::default(),
            ),
            values_left_out: add(
                r,
                "values_left_out",
                "Origin values too large for any request the target accepts, left out of the mirror",
                Family::default(),
            ),
            resyncs: add(r, "resyncs", "Full resyncs after the initial sync", Family::default()),
            session_failures: add(r, "session_failures", "Worker sessions ended by an error", Family::default()),
            drift_repaired_keys: add(
                r,
                "drift_repaired_keys",
                "Keys continuous verification found different on the target and repaired",
                Family::default(),
            ),
            verified_keys: add(
                r,
                "verified_keys",
                "Origin keys continuous verification compared with the target's copy",
                Family::default(),
            ),
            split_revisions: add(
                r,
                "split_revisions",
                "Origin revisions too large for one target Txn",
                Family::default(),
            ),
            txns: add(r, "peer_txns", "Batch Txns applied on the target", Family::default()),
        }
    }
}

/// The origin-heartbeat leases this region holds on its peers.
pub struct KeepaliveMetrics {
    pub failures: Family<MirrorLabels, Gauge>,
    pub round: Family<MirrorLabels, Histogram>,
    pub streams: Family<MirrorLabels, Gauge>,
    pub leases: Family<MirrorLabels, Gauge>,
    pub ttl_seconds: Family<MirrorLabels, Gauge>,
    pub ttl_remaining_seconds: Family<MirrorLabels, Gauge>,
}

impl KeepaliveMetrics {
    fn register(r: &mut Registry) -> Self {
        KeepaliveMetrics {
            failures: add(r, "keepalive_consecutive_failures", "Keepalive rounds failed in a row", Family::default()),
            round: add(
                r,
                "keepalive_rtt_seconds",
                "Seconds a keepalive round (every lease renewed once) takes; past a third of the TTL, KeepaliveDegraded fires",
                Family::new_with_constructor(round_trip_histogram),
            ),
            streams: add(r, "keepalive_streams", "LeaseKeepAlive streams the renewals use", Family::default()),
            leases: add(r, "leases", "Leases (shards) held on the target", Family::default()),
            ttl_seconds: add(
                r,
                "lease_ttl_seconds",
                "The TTL the origin-heartbeat leases on the peer were granted with (the configured one until the peer answered)",
                Family::default(),
            ),
            ttl_remaining_seconds: add(
                r,
                "lease_ttl_remaining_seconds",
                "Seconds the stalest lease has left if no renewal succeeds from now on",
                Family::default(),
            ),
        }
    }
}

/// What other regions mirror into this region, as this region's etcd holds it.
pub struct InboundMetrics {
    pub keys: Family<MirrorLabels, Gauge>,
    pub lease_ttl_remaining_seconds: Family<MirrorLabels, Gauge>,
    pub synced: Family<MirrorLabels, Gauge>,
    /// The series shown now, so that an origin's go when it is gone.
    shown: std::sync::Mutex<std::collections::HashSet<MirrorLabels>>,
}

impl InboundMetrics {
    fn forget(&self, l: &MirrorLabels) {
        self.keys.remove(l);
        self.lease_ttl_remaining_seconds.remove(l);
        self.synced.remove(l);
    }
}

impl InboundMetrics {
    fn register(r: &mut Registry) -> Self {
        InboundMetrics {
            keys: add(r, "inbound_keys", "Keys an origin region mirrors into this region", Family::default()),
            lease_ttl_remaining_seconds: add(
                r,
                "inbound_lease_ttl_remaining_seconds",
                "Seconds an origin region's leases here have left: its mirror lapses at 0 unless the origin renews",
                Family::default(),
            ),
            synced: add(
                r,
                "inbound_synced",
                "1 while an origin region's sync canary here says its snapshot is complete",
                Family::default(),
            ),
            shown: Default::default(),
        }
    }
}

/// The v0 -> v1 drain.
pub struct DrainMetrics {
    pub keys: Family<DrainLabels, Counter>,
    pub phase: Family<DrainPhaseLabels, Gauge>,
    seen: std::sync::Mutex<std::collections::HashMap<DrainLabels, u64>>,
}

impl DrainMetrics {
    fn register(r: &mut Registry) -> Self {
        DrainMetrics {
            keys: add(r, "drain_keys", "Legacy keys handled by the v0 -> v1 drain, by outcome", Family::default()),
            phase: add(r, "drain_phase", "1 for the v0 -> v1 drain's current phase", Family::default()),
            seen: Default::default(),
        }
    }
}

/// The operator process: leadership, reconciles, status writes, its build.
pub struct OperatorMetrics {
    pub leader: Gauge,
    pub headless: Gauge,
    pub token_reviews: Family<OutcomeLabels, Counter>,
    pub task_panics: Family<TaskLabels, Counter>,
    pub reconcile_errors: Family<ControllerLabels, Counter>,
    pub reconcile_duration: Family<ControllerLabels, Histogram>,
    pub status_patches: Family<RegionLabels, Counter>,
    pub build_info: Family<BuildLabels, Gauge>,
}

impl OperatorMetrics {
    fn register(r: &mut Registry) -> Self {
        let m = OperatorMetrics {
            leader: add(r, "leader", "1 while this instance leads its region", Gauge::default()),
            headless: add(
                r,
                "leader_headless",
                "1 while this instance's mirror workers keep renewing without the Kubernetes API server confirming its leadership",
                Gauge::default(),
            ),
            token_reviews: add(
                r,
                "token_reviews",
                "Bearer tokens of callers of the secure metrics port reviewed with the API server, by outcome (throttled: not reviewed, too many unknown tokens lately)",
                Family::default(),
            ),
            task_panics: add(
                r,
                "task_panics",
                "Panics caught in the operator's tasks (controller, keeper, worker, drain), each run again",
                Family::default(),
            ),
            reconcile_errors: add(r, "reconcile_errors", "Reconciles that failed, by controller", Family::default()),
            reconcile_duration: add(
                r,
                "reconcile_duration_seconds",
                "How long reconciles take, by controller",
                Family::new_with_constructor(duration_histogram),
            ),
            status_patches: add(r, "status_patches", "RegionPeering status patches written", Family::default()),
            build_info: add(r, "build_info", "1, labelled with the operator's version", Family::default()),
        };
        m.build_info.get_or_create(&BuildLabels { version: env!("CARGO_PKG_VERSION").to_string() }).set(1);
        m
    }
}

pub struct Metrics {
    registry: Registry,
    pub replication: ReplicationMetrics,
    pub keepalive: KeepaliveMetrics,
    pub inbound: InboundMetrics,
    pub drain: DrainMetrics,
    pub operator: OperatorMetrics,
    /// The last cumulative count of each worker counter seen, by series.
    seen: std::sync::Mutex<std::collections::HashMap<(&'static str, MirrorLabels), u64>>,
    seen_causes: std::sync::Mutex<std::collections::HashMap<CauseLabels, u64>>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("aether_federation");
        Metrics {
            replication: ReplicationMetrics::register(&mut registry),
            keepalive: KeepaliveMetrics::register(&mut registry),
            inbound: InboundMetrics::register(&mut registry),
            drain: DrainMetrics::register(&mut registry),
            operator: OperatorMetrics::register(&mut registry),
            seen: Default::default(),
            seen_causes: Default::default(),
            registry,
        }
    }
}

impl Metrics {
    /// One of this region's workers, as its health says now.
    pub fn record_peer(&self, h: &PeerHealth, now: SystemTime) {
        let l = MirrorLabels::new(&h.origin, &h.peer);
        let r = &self.replication;
        r.lag_seconds.get_or_create(&l).set(h.lag_seconds(now));
        r.lag_revisions.get_or_create(&l).set(h.lag_revisions());
        r.last_applied_revision.get_or_create(&l).set(h.last_applied_revision);
        r.keys.get_or_create(&l).set(h.keys);
        r.synced.get_or_create(&l).set(i64::from(h.synced));
        r.reachable.get_or_create(&l).set(i64::from(h.reachable));
        r.values_left_out.get_or_create(&l).set(h.oversized.len() as i64);
        for (cause, count) in &h.resyncs_by_cause {
            let labels = CauseLabels { origin: h.origin.clone(), target: h.peer.clone(), cause: cause.to_string() };
            self.advance_by_cause(&r.resyncs, labels, *count);
        }
        self.advance(&r.session_failures, "session_failures", &l, h.session_failures);
        self.advance(&r.drift_repaired_keys, "drift_repaired_keys", &l, h.drift_repaired_keys);
        self.advance(&r.verified_keys, "verified_keys", &l, h.verified_keys);
        self.advance(&r.split_revisions, "split_revisions", &l, h.split_revisions);
        self.advance(&r.txns, "txns", &l, h.txns);
        for phase in Phase::ALL {
            let labels =
                PhaseLabels { origin: h.origin.clone(), target: h.peer.clone(), phase: phase.as_str().to_string() };
            r.phase.get_or_create(&labels).set(i64::from(phase == h.phase));
        }
        for reason in crate::mirror::Refusal::REASONS {
            let labels = ReasonLabels { origin: h.origin.clone(), target: h.peer.clone(), reason: reason.to_string() };
            let now = h.refusal.as_ref().is_some_and(|r| r.reason == reason);
            r.claim_refused.get_or_create(&labels).set(i64::from(now));
        }
        let k = &self.keepalive;
        k.failures.get_or_create(&l).set(h.keepalive_failures as i64);
        self.observe_keepalive_rounds(h, &l);
        k.streams.get_or_create(&l).set(h.keepalive_streams as i64);
        k.leases.get_or_create(&l).set(h.leases as i64);
        k.ttl_seconds.get_or_create(&l).set(h.lease_ttl_reported.unwrap_or(h.lease_ttl_seconds));
        k.ttl_remaining_seconds.get_or_create(&l).set(h.lease_ttl_remaining(now).unwrap_or(0));
    }

    /// What every origin mirrors into `region` (this one), as observed now: the series of an
    /// origin no longer there go.
    pub fn record_inbound(&self, region: &str, origins: &[InboundOrigin]) {
        let now: std::collections::HashSet<MirrorLabels> =
            origins.iter().map(|o| MirrorLabels::new(&o.origin, region)).collect();
        let mut shown = self.inbound.shown.lock().expect("metrics lock");
        for gone in shown.iter().filter(|l| l.target == region && !now.contains(l)) {
            self.inbound.forget(gone);
        }
        shown.retain(|l| l.target != region || now.contains(l));
        for origin in origins {
            let l = MirrorLabels::new(&origin.origin, region);
            self.inbound.keys.get_or_create(&l).set(origin.keys);
            self.inbound.lease_ttl_remaining_seconds.get_or_create(&l).set(origin.lease_ttl_remaining.unwrap_or(0));
            self.inbound.synced.get_or_create(&l).set(i64::from(origin.synced));
            shown.insert(l);
        }
    }

    /// Observes the keepalive rounds this series has not seen yet.
    fn observe_keepalive_rounds(&self, h: &PeerHealth, l: &MirrorLabels) {
        let seen = self.seen.lock().expect("metrics lock").insert(("keepalive_rounds", l.clone()), h.keepalive_rounds);
        let histogram = self.keepalive.round.get_or_create(l);
        h.keepalive_rtts_since(seen.unwrap_or(0)).for_each(|rtt| histogram.observe(rtt));
    }

    /// Sets the drain's phase series of a region: 1 for `phase`, 0 for the others.
    pub fn record_drain_phase(&self, region: &str, phase: crate::drain::DrainPhase) {
        for candidate in crate::drain::DrainPhase::ALL {
            let labels = DrainPhaseLabels { region: region.to_string(), phase: candidate.as_str().to_string() };
            self.drain.phase.get_or_create(&labels).set(i64::from(candidate == phase));
        }
    }

    /// Drops a region's drain phase series (its RegistrySchema is gone).
    pub fn forget_drain(&self, region: &str) {
        for candidate in crate::drain::DrainPhase::ALL {
            self.drain
                .phase
                .remove(&DrainPhaseLabels { region: region.to_string(), phase: candidate.as_str().to_string() });
        }
    }

    /// Brings a counter up to a worker's cumulative count. A count below the last one means the
    /// worker started over: the counter goes up by the whole new count.
    fn advance(&self, counter: &Family<MirrorLabels, Counter>, name: &'static str, l: &MirrorLabels, now: u64) {
        let mut seen = self.seen.lock().expect("metrics lock");
        let last = seen.insert((name, l.clone()), now).unwrap_or(0);
        let delta = if now >= last { now - last } else { now };
        if delta > 0 || counter.get(l).is_none() {
            counter.get_or_create(l).inc_by(delta);
        }
    }

    /// As `advance`, for the resync counter, labelled with its cause as well.
    fn advance_by_cause(&self, counter: &Family<CauseLabels, Counter>, labels: CauseLabels, now: u64) {
        let mut seen = self.seen_causes.lock().expect("metrics lock");
        let last = seen.insert(labels.clone(), now).unwrap_or(0);
        let delta = if now >= last { now - last } else { now };
        counter.get_or_create(&labels).inc_by(delta);
    }

    /// Brings a drain counter up to the drain's cumulative count (kept across restarts).
    pub fn advance_drain(&self, labels: DrainLabels, now: i64) {
        let now = now.max(0) as u64;
        let mut seen = self.drain.seen.lock().expect("metrics lock");
        let last = seen.insert(labels.clone(), now).unwrap_or(0);
        self.drain.keys.get_or_create(&labels).inc_by(now.saturating_sub(last));
    }

    /// Drops a stopped worker's series.
    pub fn forget_peer(&self, origin: &str, target: &str) {
        let l = MirrorLabels::new(origin, target);
        let (r, k) = (&self.replication, &self.keepalive);
        for family in [
            &r.lag_revisions,
            &r.last_applied_revision,
            &r.keys,
            &r.synced,
            &r.reachable,
            &r.values_left_out,
            &k.failures,
            &k.streams,
            &k.leases,
            &k.ttl_seconds,
            &k.ttl_remaining_seconds,
        ] {
            family.remove(&l);
        }
        for family in [&r.session_failures, &r.drift_repaired_keys, &r.verified_keys, &r.split_revisions, &r.txns] {
            family.remove(&l);
        }
        self.seen_causes.lock().expect("metrics lock").retain(|labels, _| {
            let ours = labels.origin == origin && labels.target == target;
            if ours {
                r.resyncs.remove(labels);
            }
            !ours
        });
        r.lag_seconds.remove(&l);
        k.round.remove(&l);
        self.seen.lock().expect("metrics lock").retain(|(_, labels), _| labels != &l);
        for phase in Phase::ALL {
            r.phase.remove(&PhaseLabels {
                origin: origin.to_string(),
                target: target.to_string(),
                phase: phase.as_str().to_string(),
            });
        }
        for reason in crate::mirror::Refusal::REASONS {
            r.claim_refused.remove(&ReasonLabels {
                origin: origin.to_string(),
                target: target.to_string(),
                reason: reason.to_string(),
            });
        }
    }

    /// Records one reconcile of `controller`.
    pub fn reconciled(&self, controller: &str, took: std::time::Duration, ok: bool) {
        let labels = ControllerLabels { controller: controller.to_string() };
        self.operator.reconcile_duration.get_or_create(&labels).observe(took.as_secs_f64());
        let errors = self.operator.reconcile_errors.get_or_create(&labels);
        if !ok {
            errors.inc();
        }
    }

    /// Counts a panic caught in a task of kind `task`.
    pub fn task_panicked(&self, task: &str) {
        self.operator.task_panics.get_or_create(&TaskLabels { task: task.to_string() }).inc();
    }

    /// Counts a caller's token reviewed (or throttled) by the secure metrics port.
    pub fn token_reviewed(&self, outcome: &str) {
        self.operator.token_reviews.get_or_create(&OutcomeLabels { outcome: outcome.to_string() }).inc();
    }

    /// Counts a status patch of `region`'s RegionPeering.
    pub fn status_patched(&self, region: &str) {
        self.operator.status_patches.get_or_create(&RegionLabels { region: region.to_string() }).inc();
    }

    /// Drops what this instance reports of other regions' mirrors into its own: a standby must
    /// not report them beside the leader.
    pub fn forget_inbound(&self) {
        self.inbound.keys.clear();
        self.inbound.lease_ttl_remaining_seconds.clear();
        self.inbound.synced.clear();
        self.inbound.shown.lock().expect("metrics lock").clear();
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("encoding to a String cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inbound_b() -> InboundOrigin {
        InboundOrigin {
            origin: "b".into(),
            keys: 1,
            lease_ttl_remaining: Some(20),
            synced: true,
            checkpoint_revision: Some(3),
        }
    }

    #[test]
    fn every_mirror_series_says_origin_and_target_the_same_way_on_both_sides() {
        let m = Metrics::default();
        m.record_peer(&PeerHealth::new("a", "b", 30), SystemTime::now());
        m.record_inbound("a", &[inbound_b()]);
        let text = m.encode();
        assert!(text.contains(r#"aether_federation_mirrored_keys{origin="a",target="b"}"#), "{text}");
        assert!(text.contains(r#"aether_federation_inbound_keys{origin="b",target="a"}"#), "{text}");
        assert!(text.contains(r#"aether_federation_inbound_lease_ttl_remaining_seconds{origin="b",target="a"} 20"#));
        assert!(!text.contains("region=\"a\",peer="), "no series says region/peer any more");
        // An origin no longer mirroring here loses its series.
        m.record_inbound("a", &[]);
        assert!(!m.encode().contains(r#"inbound_keys{origin="b""#), "{}", m.encode());
    }

    /// Every family the operator exposes, by its sample name (counters with `_total`).
    fn exposed(m: &Metrics) -> std::collections::BTreeSet<String> {
        m.encode()
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| {
                let mut parts = l.split(' ');
                let (name, kind) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
                if kind == "counter" { format!("{name}_total") } else { name.to_string() }
            })
            .collect()
    }

    #[test]
    fn the_documented_metrics_are_the_exposed_ones() {
        let m = Metrics::default();
        let mut h = PeerHealth::new("a", "b", 30);
        h.resyncs = 2;
        h.resyncs_by_cause.insert("compacted", 2);
        m.record_peer(&h, SystemTime::now());
        m.record_inbound("a", &[inbound_b()]);
        m.status_patched("a");
        m.reconciled("regionpeering", std::time::Duration::from_millis(3), false);
        m.advance_drain(DrainLabels { region: "a".into(), outcome: "copied".into() }, 5);
        m.record_drain_phase("a", crate::drain::DrainPhase::Copying);
        m.token_reviewed("allowed");
        m.task_panicked("keeper");
        let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/operating.md")).unwrap();
        let documented: std::collections::BTreeSet<String> = docs
            .lines()
            .filter(|l| l.starts_with("| `aether_federation_"))
            .filter_map(|l| l.split('`').nth(1))
            .map(|n| n.split('{').next().unwrap_or(n).to_string())
            .collect();
        assert_eq!(exposed(&m), documented, "docs/operating.md's metrics table and the exposition differ");
    }

    /// The metric names an alert rule or a dashboard query refers to, by the family they sample.
    fn referenced(text: &str) -> std::collections::BTreeSet<String> {
        let mut names = std::collections::BTreeSet::new();
        let mut rest = text;
        while let Some(at) = rest.find("aether_federation_") {
            let tail = &rest[at..];
            let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
            names.insert(tail[..end].to_string());
            rest = &tail[end..];
        }
        names
    }

    #[test]
    fn the_alerts_and_the_dashboard_use_only_exposed_metrics() {
        let m = Metrics::default();
        let mut h = PeerHealth::new("a", "b", 30);
        h.record_keepalive_rtt(std::time::Duration::from_millis(3));
        h.resyncs_by_cause.insert("lease_lost", 1);
        m.record_peer(&h, SystemTime::now());
        m.record_inbound("a", &[inbound_b()]);
        m.status_patched("a");
        m.reconciled("regionpeering", std::time::Duration::from_millis(3), false);
        m.advance_drain(DrainLabels { region: "a".into(), outcome: "copied".into() }, 5);
        m.record_drain_phase("a", crate::drain::DrainPhase::Copying);
        let families = exposed(&m);
        let samples: std::collections::BTreeSet<String> = m
            .encode()
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split(['{', ' ']).next())
            .map(String::from)
            .collect();
        let chart = concat!(env!("CARGO_MANIFEST_DIR"), "/../charts/aether-federation/files/");
        for file in ["prometheus-rules.yaml", "dashboard.json"] {
            let text = std::fs::read_to_string(format!("{chart}{file}")).unwrap();
            let names = referenced(&text);
            assert!(names.len() >= 5, "{file} refers to the operator's metrics");
            for name in names {
                assert!(
                    families.contains(&name) || samples.contains(&name),
                    "{file} uses {name}, which the operator does not expose"
                );
            }
        }
    }

    #[test]
    fn keepalive_round_trips_are_observed_once_each_and_after_a_restart() {
        let m = Metrics::default();
        let mut h = PeerHealth::new("a", "b", 30);
        let count = |m: &Metrics| {
            let text = m.encode();
            text.lines()
                .find(|line| line.starts_with("aether_federation_keepalive_rtt_seconds_count"))
                .and_then(|line| line.rsplit(' ').next())
                .map(|n| n.parse::<u64>().unwrap())
        };
        h.record_keepalive_rtt(std::time::Duration::from_millis(2));
        h.record_keepalive_rtt(std::time::Duration::from_millis(40));
        m.record_peer(&h, SystemTime::now());
        m.record_peer(&h, SystemTime::now());
        assert_eq!(count(&m), Some(2), "a refresh without new rounds observes nothing");
        let mut restarted = PeerHealth::new("a", "b", 30);
        restarted.record_keepalive_rtt(std::time::Duration::from_millis(5));
        m.record_peer(&restarted, SystemTime::now());
        assert_eq!(count(&m), Some(3), "a worker that started over is observed from its first round");
        m.forget_peer("a", "b");
        assert_eq!(count(&m), None, "a stopped worker's histogram goes");
    }

    #[test]
    fn counters_follow_the_workers_counts_across_restarts() {
        let m = Metrics::default();
        let mut h = PeerHealth::new("a", "b", 30);
        h.resyncs_by_cause.insert("compacted", 3);
        m.record_peer(&h, SystemTime::now());
        h.resyncs_by_cause.insert("compacted", 1); // the worker started over
        m.record_peer(&h, SystemTime::now());
        let l = CauseLabels { origin: "a".into(), target: "b".into(), cause: "compacted".into() };
        assert_eq!(m.replication.resyncs.get_or_create(&l).get(), 4, "never goes down");
        m.forget_peer("a", "b");
        assert!(!m.encode().contains("aether_federation_resyncs_total{"), "a stopped worker's series go");
    }
}
