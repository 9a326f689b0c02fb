//! Prometheus metrics, all prefixed `aether_federation_` and labelled by region and peer.
use crate::mirror::{PeerHealth, Phase};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use std::time::SystemTime;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PeerLabels {
    pub region: String,
    pub peer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub region: String,
    pub peer: String,
    pub phase: String,
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

type FloatGauge = Gauge<f64, AtomicU64>;

pub struct Metrics {
    registry: Registry,
    pub lag_seconds: Family<PeerLabels, FloatGauge>,
    pub lag_revisions: Family<PeerLabels, Gauge>,
    pub last_applied_revision: Family<PeerLabels, Gauge>,
    pub keys: Family<PeerLabels, Gauge>,
    /// Cumulative counts kept by the workers, exposed as counters (`_total`).
    pub resyncs: Family<PeerLabels, Counter>,
    pub session_failures: Family<PeerLabels, Counter>,
    pub drift_repaired_keys: Family<PeerLabels, Counter>,
    /// The configured lease TTL, so alerts can be relative to it.
    pub lease_ttl_seconds: Family<PeerLabels, Gauge>,
    /// The values the counters above were last brought up to, per series.
    seen: std::sync::Mutex<std::collections::HashMap<(&'static str, PeerLabels), u64>>,
    pub build_info: Family<BuildLabels, Gauge>,
    pub reconcile_errors: Family<ControllerLabels, Counter>,
    pub reconcile_duration: Family<ControllerLabels, Histogram>,
    pub keepalive_failures: Family<PeerLabels, Gauge>,
    pub lease_ttl_remaining_seconds: Family<PeerLabels, Gauge>,
    pub leases: Family<PeerLabels, Gauge>,
    pub reachable: Family<PeerLabels, Gauge>,
    pub synced: Family<PeerLabels, Gauge>,
    pub split_revisions: Family<PeerLabels, Counter>,
    pub txns: Family<PeerLabels, Counter>,
    pub phase: Family<PhaseLabels, Gauge>,
    /// Keys another region (label `peer`) mirrors into this region (label `region`).
    pub inbound_keys: Family<PeerLabels, Gauge>,
    pub inbound_lease_ttl_seconds: Family<PeerLabels, Gauge>,
    pub status_patches: Family<RegionLabels, Counter>,
    pub is_leader: Gauge,
    pub drain_keys: Family<DrainLabels, Counter>,
    drain_seen: std::sync::Mutex<std::collections::HashMap<DrainLabels, u64>>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    pub controller: String,
}

fn duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 12))
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("aether_federation");
        let m = Metrics {
            lag_seconds: Family::default(),
            lag_revisions: Family::default(),
            last_applied_revision: Family::default(),
            keys: Family::default(),
            resyncs: Family::default(),
            session_failures: Family::default(),
            drift_repaired_keys: Family::default(),
            lease_ttl_seconds: Family::default(),
            seen: Default::default(),
            build_info: Family::default(),
            reconcile_errors: Family::default(),
            reconcile_duration: Family::new_with_constructor(duration_histogram),
            keepalive_failures: Family::default(),
            lease_ttl_remaining_seconds: Family::default(),
            leases: Family::default(),
            reachable: Family::default(),
            synced: Family::default(),
            split_revisions: Family::default(),
            txns: Family::default(),
            phase: Family::default(),
            inbound_keys: Family::default(),
            inbound_lease_ttl_seconds: Family::default(),
            status_patches: Family::default(),
            is_leader: Gauge::default(),
            drain_keys: Family::default(),
            drain_seen: Default::default(),
            registry: Registry::default(),
        };
        registry.register(
            "replication_lag_seconds",
            "Age of the oldest origin revision not yet applied on the peer",
            m.lag_seconds.clone(),
        );
        registry.register(
            "replication_lag_revisions",
            "Origin revisions received but not yet applied on the peer",
            m.lag_revisions.clone(),
        );
        registry.register(
            "last_applied_revision",
            "The origin revision the peer holds completely",
            m.last_applied_revision.clone(),
        );
        registry.register("mirrored_keys", "Keys of the region's subtree on the peer", m.keys.clone());
        registry.register("resyncs", "Full resyncs after the initial sync", m.resyncs.clone());
        registry.register("session_failures", "Worker sessions ended by an error", m.session_failures.clone());
        registry.register(
            "drift_repaired_keys",
            "Keys continuous verification found different on the peer and repaired",
            m.drift_repaired_keys.clone(),
        );
        registry.register(
            "lease_ttl_seconds",
            "The configured TTL of the origin-heartbeat leases",
            m.lease_ttl_seconds.clone(),
        );
        registry.register("build_info", "1, labelled with the operator's version", m.build_info.clone());
        registry.register("reconcile_errors", "Reconciles that failed, by controller", m.reconcile_errors.clone());
        registry.register(
            "reconcile_duration_seconds",
            "How long reconciles take, by controller",
            m.reconcile_duration.clone(),
        );
        m.build_info.get_or_create(&BuildLabels { version: env!("CARGO_PKG_VERSION").to_string() }).set(1);
        registry.register(
            "keepalive_consecutive_failures",
            "Keepalive rounds failed in a row",
            m.keepalive_failures.clone(),
        );
        registry.register(
            "lease_ttl_remaining_seconds",
            "Seconds left on the leases if no keepalive succeeds",
            m.lease_ttl_remaining_seconds.clone(),
        );
        registry.register("leases", "Leases (shards) held on the peer", m.leases.clone());
        registry.register(
            "peer_reachable",
            "1 when the cross-region failure detector deems the peer reachable",
            m.reachable.clone(),
        );
        registry.register("peer_synced", "1 when the peer holds a complete snapshot", m.synced.clone());
        registry.register("split_revisions", "Origin revisions too large for one peer Txn", m.split_revisions.clone());
        registry.register("peer_txns", "Batch Txns applied on the peer", m.txns.clone());
        registry.register("worker_phase", "1 for the worker's current phase", m.phase.clone());
        registry.register("inbound_keys", "Keys a peer region mirrors into this region", m.inbound_keys.clone());
        registry.register(
            "inbound_lease_ttl_seconds",
            "Remaining TTL of a peer region's leases in this region",
            m.inbound_lease_ttl_seconds.clone(),
        );
        registry.register("status_patches", "RegionPeering status patches written", m.status_patches.clone());
        registry.register("leader", "1 while this instance leads its region", m.is_leader.clone());
        registry.register("drain_keys", "Legacy keys handled by the v0 -> v1 drain, by outcome", m.drain_keys.clone());
        Metrics { registry, ..m }
    }
}

impl Metrics {
    pub fn record_peer(&self, h: &PeerHealth, now: SystemTime) {
        let l = PeerLabels { region: h.origin.clone(), peer: h.peer.clone() };
        self.lag_seconds.get_or_create(&l).set(h.lag_seconds(now));
        self.lag_revisions.get_or_create(&l).set(h.lag_revisions());
        self.last_applied_revision.get_or_create(&l).set(h.last_applied_revision);
        self.keys.get_or_create(&l).set(h.keys);
        self.advance(&self.resyncs, "resyncs", &l, h.resyncs);
        self.advance(&self.session_failures, "session_failures", &l, h.session_failures);
        self.advance(&self.drift_repaired_keys, "drift_repaired_keys", &l, h.drift_repaired_keys);
        self.lease_ttl_seconds.get_or_create(&l).set(h.lease_ttl_seconds);
        self.keepalive_failures.get_or_create(&l).set(h.keepalive_failures as i64);
        self.lease_ttl_remaining_seconds.get_or_create(&l).set(h.lease_ttl_remaining(now).unwrap_or(0));
        self.leases.get_or_create(&l).set(h.leases as i64);
        self.reachable.get_or_create(&l).set(i64::from(h.reachable));
        self.synced.get_or_create(&l).set(i64::from(h.synced));
        self.advance(&self.split_revisions, "split_revisions", &l, h.split_revisions);
        self.advance(&self.txns, "txns", &l, h.txns);
        for phase in Phase::ALL {
            let labels =
                PhaseLabels { region: h.origin.clone(), peer: h.peer.clone(), phase: phase.as_str().to_string() };
            self.phase.get_or_create(&labels).set(i64::from(phase == h.phase));
        }
    }

    /// Brings a counter up to a worker's cumulative count. A count below the last one means the
    /// worker started over: the counter goes up by the whole new count.
    fn advance(&self, counter: &Family<PeerLabels, Counter>, name: &'static str, l: &PeerLabels, now: u64) {
        let mut seen = self.seen.lock().expect("metrics lock");
        let last = seen.insert((name, l.clone()), now).unwrap_or(0);
        let delta = if now >= last { now - last } else { now };
        if delta > 0 || counter.get(l).is_none() {
            counter.get_or_create(l).inc_by(delta);
        }
    }

    /// Brings a drain counter up to the drain's cumulative count (kept across restarts).
    pub fn advance_drain(&self, labels: DrainLabels, now: i64) {
        let now = now.max(0) as u64;
        let mut seen = self.drain_seen.lock().expect("metrics lock");
        let last = seen.insert(labels.clone(), now).unwrap_or(0);
        self.drain_keys.get_or_create(&labels).inc_by(now.saturating_sub(last));
    }

    /// Drops a stopped worker's series.
    pub fn forget_peer(&self, region: &str, peer: &str) {
        let l = PeerLabels { region: region.to_string(), peer: peer.to_string() };
        for family in [
            &self.lag_revisions,
            &self.last_applied_revision,
            &self.keys,
            &self.keepalive_failures,
            &self.lease_ttl_remaining_seconds,
            &self.leases,
            &self.reachable,
            &self.synced,
            &self.lease_ttl_seconds,
        ] {
            family.remove(&l);
        }
        for family in
            [&self.resyncs, &self.session_failures, &self.drift_repaired_keys, &self.split_revisions, &self.txns]
        {
            family.remove(&l);
        }
        self.seen.lock().expect("metrics lock").retain(|(_, labels), _| labels != &l);
        self.lag_seconds.remove(&l);
        for phase in Phase::ALL {
            self.phase.remove(&PhaseLabels {
                region: region.to_string(),
                peer: peer.to_string(),
                phase: phase.as_str().to_string(),
            });
        }
    }

    /// Records one reconcile of `controller`.
    pub fn reconciled(&self, controller: &str, took: std::time::Duration, ok: bool) {
        let labels = ControllerLabels { controller: controller.to_string() };
        self.reconcile_duration.get_or_create(&labels).observe(took.as_secs_f64());
        let errors = self.reconcile_errors.get_or_create(&labels);
        if !ok {
            errors.inc();
        }
    }

    /// Drops what this instance reports of other regions' mirrors into its own: a standby must
    /// not report them beside the leader.
    pub fn forget_inbound(&self) {
        self.inbound_keys.clear();
        self.inbound_lease_ttl_seconds.clear();
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
        m.record_peer(&h, SystemTime::now());
        m.inbound_keys.get_or_create(&PeerLabels { region: "a".into(), peer: "b".into() }).set(1);
        m.inbound_lease_ttl_seconds.get_or_create(&PeerLabels { region: "a".into(), peer: "b".into() }).set(1);
        m.status_patches.get_or_create(&RegionLabels { region: "a".into() }).inc();
        m.reconciled("regionpeering", std::time::Duration::from_millis(3), false);
        m.advance_drain(DrainLabels { region: "a".into(), outcome: "copied".into() }, 5);
        let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/operating.md")).unwrap();
        let documented: std::collections::BTreeSet<String> = docs
            .lines()
            .filter(|l| l.starts_with("| `aether_federation_"))
            .filter_map(|l| l.split('`').nth(1))
            .map(|n| n.split('{').next().unwrap_or(n).to_string())
            .collect();
        assert_eq!(exposed(&m), documented, "docs/operating.md's metrics table and the exposition differ");
    }

    #[test]
    fn counters_follow_the_workers_counts_across_restarts() {
        let m = Metrics::default();
        let mut h = PeerHealth::new("a", "b", 30);
        h.resyncs = 3;
        m.record_peer(&h, SystemTime::now());
        h.resyncs = 1; // the worker started over
        m.record_peer(&h, SystemTime::now());
        let l = PeerLabels { region: "a".into(), peer: "b".into() };
        assert_eq!(m.resyncs.get_or_create(&l).get(), 4, "never goes down");
        m.forget_peer("a", "b");
        assert!(!m.encode().contains("aether_federation_resyncs_total{"), "a stopped worker's series go");
    }
}
