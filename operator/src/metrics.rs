//! Prometheus metrics, all prefixed `aether_federation_` and labelled by region and peer.
use crate::mirror::{PeerHealth, Phase};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
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
    pub resyncs: Family<PeerLabels, Gauge>,
    pub keepalive_failures: Family<PeerLabels, Gauge>,
    pub lease_ttl_remaining_seconds: Family<PeerLabels, Gauge>,
    pub leases: Family<PeerLabels, Gauge>,
    pub reachable: Family<PeerLabels, Gauge>,
    pub synced: Family<PeerLabels, Gauge>,
    pub split_revisions: Family<PeerLabels, Gauge>,
    pub txns: Family<PeerLabels, Gauge>,
    pub phase: Family<PhaseLabels, Gauge>,
    /// Keys another region (label `peer`) mirrors into this region (label `region`).
    pub inbound_keys: Family<PeerLabels, Gauge>,
    pub inbound_lease_ttl_seconds: Family<PeerLabels, Gauge>,
    pub status_patches: Family<RegionLabels, Counter>,
    pub is_leader: Gauge,
    pub drain_keys: Family<DrainLabels, Gauge>,
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
        registry.register("resyncs", "Full resyncs since the worker started", m.resyncs.clone());
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
        self.resyncs.get_or_create(&l).set(h.resyncs as i64);
        self.keepalive_failures.get_or_create(&l).set(h.keepalive_failures as i64);
        self.lease_ttl_remaining_seconds.get_or_create(&l).set(h.lease_ttl_remaining(now).unwrap_or(0));
        self.leases.get_or_create(&l).set(h.leases as i64);
        self.reachable.get_or_create(&l).set(i64::from(h.reachable));
        self.synced.get_or_create(&l).set(i64::from(h.synced));
        self.split_revisions.get_or_create(&l).set(h.split_revisions as i64);
        self.txns.get_or_create(&l).set(h.txns as i64);
        for phase in Phase::ALL {
            let labels =
                PhaseLabels { region: h.origin.clone(), peer: h.peer.clone(), phase: phase.as_str().to_string() };
            self.phase.get_or_create(&labels).set(i64::from(phase == h.phase));
        }
    }

    /// Drops a stopped worker's series.
    pub fn forget_peer(&self, region: &str, peer: &str) {
        let l = PeerLabels { region: region.to_string(), peer: peer.to_string() };
        for family in
            [&self.lag_revisions, &self.last_applied_revision, &self.keys, &self.resyncs, &self.keepalive_failures]
        {
            family.remove(&l);
        }
        for family in [
            &self.lease_ttl_remaining_seconds,
            &self.leases,
            &self.reachable,
            &self.synced,
            &self.split_revisions,
            &self.txns,
        ] {
            family.remove(&l);
        }
        self.lag_seconds.remove(&l);
        for phase in Phase::ALL {
            self.phase.remove(&PhaseLabels {
                region: region.to_string(),
                peer: peer.to_string(),
                phase: phase.as_str().to_string(),
            });
        }
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("encoding to a String cannot fail");
        out
    }
}
