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
    pub keepalive_rtt: Family<PeerLabels, Histogram>,
    /// The drain's current phase (1) per region.
    pub drain_phase: Family<DrainPhaseLabels, Gauge>,
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

fn duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 12))
}

/// Keepalive rounds: a millisecond on a LAN to seconds across a stalled WAN.
fn round_trip_histogram() -> Histogram {
    Histogram::new([0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0])
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
            keepalive_rtt: Family::new_with_constructor(round_trip_histogram),
            drain_phase: Family::default(),
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
        registry.register(
            "keepalive_rtt_seconds",
            "Seconds a keepalive round to the peer takes (tune acceptablePauseSeconds from it)",
            m.keepalive_rtt.clone(),
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
        registry.register("drain_phase", "1 for the v0 -> v1 drain's current phase", m.drain_phase.clone());
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
        self.observe_keepalive_rtts(h, &l);
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

    /// Observes the keepalive rounds this series has not seen yet.
    fn observe_keepalive_rtts(&self, h: &PeerHealth, l: &PeerLabels) {
        let seen = self.seen.lock().expect("metrics lock").insert(("keepalive_rounds", l.clone()), h.keepalive_rounds);
        let histogram = self.keepalive_rtt.get_or_create(l);
        h.keepalive_rtts_since(seen.unwrap_or(0)).for_each(|rtt| histogram.observe(rtt));
    }

    /// Sets the drain's phase series of a region: 1 for `phase`, 0 for the others.
    pub fn record_drain_phase(&self, region: &str, phase: crate::drain::DrainPhase) {
        for candidate in crate::drain::DrainPhase::ALL {
            let labels = DrainPhaseLabels { region: region.to_string(), phase: candidate.as_str().to_string() };
            self.drain_phase.get_or_create(&labels).set(i64::from(candidate == phase));
        }
    }

    /// Drops a region's drain phase series (its RegistrySchema is gone).
    pub fn forget_drain(&self, region: &str) {
        for candidate in crate::drain::DrainPhase::ALL {
            self.drain_phase
                .remove(&DrainPhaseLabels { region: region.to_string(), phase: candidate.as_str().to_string() });
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
        self.keepalive_rtt.remove(&l);
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
        m.record_drain_phase("a", crate::drain::DrainPhase::Copying);
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
        m.record_peer(&h, SystemTime::now());
        m.inbound_keys.get_or_create(&PeerLabels { region: "a".into(), peer: "b".into() }).set(1);
        m.inbound_lease_ttl_seconds.get_or_create(&PeerLabels { region: "a".into(), peer: "b".into() }).set(1);
        m.status_patches.get_or_create(&RegionLabels { region: "a".into() }).inc();
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
