//! Computing a RegionPeering's status from what the workers report, without IO. Ready comes from
//! replication progress and keepalive age, never from "connected".
use crate::api::{
    InboundStatus, KeepaliveStatus, PeerStatus, RegionPeeringSpec, RegionPeeringStatus, ReplicationStatus,
};
use crate::mirror::inbound::InboundOrigin;
use crate::mirror::{PeerHealth, Phase};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use std::time::{Duration, SystemTime};

pub const READY: &str = "Ready";
pub const REPLICATING: &str = "Replicating";
pub const PEERS_REACHABLE: &str = "PeersReachable";
pub const KEEPALIVE_DEGRADED: &str = "KeepaliveDegraded";
pub const CONFLICT: &str = "Conflict";
pub const SUSPENDED: &str = "Suspended";

/// Everything the status is computed from.
pub struct Observation<'a> {
    pub spec: &'a RegionPeeringSpec,
    pub generation: Option<i64>,
    /// The health of each running worker, by peer region.
    pub peers: Vec<PeerHealth>,
    pub inbound: Vec<InboundOrigin>,
    /// Set when another RegionPeering already federates this region on this etcd.
    pub conflict: Option<String>,
    /// Configuration problems (a Secret, endpoints): (reason, message).
    pub config_errors: Vec<(String, String)>,
    pub leader: Option<String>,
    pub now: SystemTime,
}

/// The status the observation implies. Conditions keep their lastTransitionTime from `previous`
/// while their status does not change.
pub fn compute(previous: Option<&RegionPeeringStatus>, obs: &Observation) -> RegionPeeringStatus {
    let spec = obs.spec;
    let max_lag = spec.sync.max_ready_lag_seconds as f64;
    let ttl = spec.lease.ttl_seconds;
    let peers: Vec<PeerStatus> = spec
        .peers
        .iter()
        .map(|p| match obs.peers.iter().find(|h| h.peer == p.region) {
            Some(h) => peer_status(h, obs.now),
            None => PeerStatus {
                region: p.region.clone(),
                phase: Phase::Stopped.as_str().into(),
                reachable: false,
                ..PeerStatus::default()
            },
        })
        .collect();

    let ready_peer = |h: &PeerHealth| {
        h.synced
            && h.phase == Phase::Watching
            && h.lag_seconds(obs.now) <= max_lag
            && h.lease_ttl_remaining(obs.now).is_some_and(|t| t > 0)
    };
    let running = obs.conflict.is_none() && !spec.suspend;
    let ready_count = if running {
        obs.peers.iter().filter(|h| spec.peers.iter().any(|p| p.region == h.peer) && ready_peer(h)).count()
    } else {
        0
    };

    let mut conditions = Vec::new();
    let mut set = |type_: &str, status: bool, reason: &str, message: String| {
        conditions.push(condition(previous, type_, status, reason, message, obs.generation, obs.now));
    };

    // Ready, and why not.
    let (ready, reason, message) = if let Some(conflict) = &obs.conflict {
        (false, "Conflict".to_string(), conflict.clone())
    } else if spec.suspend {
        (
            false,
            "Suspended".to_string(),
            "spec.suspend is true: no worker runs; the mirrors on the peers lapse with their leases".to_string(),
        )
    } else if let Some((reason, message)) = obs.config_errors.first() {
        (false, reason.clone(), message.clone())
    } else if spec.peers.is_empty() {
        (true, "NoPeers".to_string(), "single region: nothing to mirror".to_string())
    } else if let Some(h) = obs.peers.iter().find(|h| h.phase == Phase::Fenced) {
        (
            false,
            "Fenced".to_string(),
            format!("another operator instance owns the mirror into {}; this one stopped writing", h.peer),
        )
    } else if ready_count == spec.peers.len() {
        (
            true,
            "AllPeersReady".to_string(),
            format!(
                "{} of {} peers synced, kept alive and within {}s of lag",
                ready_count,
                spec.peers.len(),
                spec.sync.max_ready_lag_seconds
            ),
        )
    } else {
        let not_ready: Vec<String> = spec
            .peers
            .iter()
            .filter(|p| !obs.peers.iter().any(|h| h.peer == p.region && ready_peer(h)))
            .map(|p| match obs.peers.iter().find(|h| h.peer == p.region) {
                None => format!("{}: not running", p.region),
                Some(h) if !h.synced => format!("{}: {} (initial sync not complete)", p.region, h.phase.as_str()),
                Some(h) if h.lease_ttl_remaining(obs.now).is_none_or(|t| t <= 0) => {
                    format!("{}: lease not kept alive", p.region)
                }
                Some(h) if h.phase != Phase::Watching => format!("{}: {}", p.region, h.phase.as_str()),
                Some(h) => format!(
                    "{}: lag {:.0}s over {}s",
                    p.region,
                    h.lag_seconds(obs.now),
                    spec.sync.max_ready_lag_seconds
                ),
            })
            .collect();
        let reason = if obs.peers.iter().any(|h| !h.synced) { "PeerNotSynced" } else { "PeerNotReady" };
        (false, reason.to_string(), not_ready.join("; "))
    };
    set(READY, ready, &reason, message);

    // Replicating: every worker is past its sync and watching.
    let watching = obs.peers.iter().filter(|h| h.phase == Phase::Watching && h.synced).count();
    if running && !spec.peers.is_empty() {
        let all = watching == spec.peers.len();
        let message = format!("{watching} of {} peers watching the origin after a complete sync", spec.peers.len());
        set(REPLICATING, all, if all { "Watching" } else { "Syncing" }, message);
    } else {
        set(
            REPLICATING,
            false,
            if spec.peers.is_empty() { "NoPeers" } else { "NotRunning" },
            "no mirror worker runs".to_string(),
        );
    }

    // PeersReachable: the cross-region failure detector; it reports and never acts.
    let unreachable: Vec<&str> = obs.peers.iter().filter(|h| !h.reachable).map(|h| h.peer.as_str()).collect();
    if !running || spec.peers.is_empty() {
        set(PEERS_REACHABLE, true, "NotMonitored", "no mirror worker runs".to_string());
    } else if unreachable.is_empty() {
        set(PEERS_REACHABLE, true, "Reachable", "every peer answered within the acceptable pause".to_string());
    } else {
        set(
            PEERS_REACHABLE,
            false,
            "PeerUnreachable",
            format!(
                "no round trip to {} within {}s; nothing is deleted, the mirrors lapse only with their leases",
                unreachable.join(", "),
                spec.failure_detector.acceptable_pause_seconds
            ),
        );
    }

    // KeepaliveDegraded: keepalives are failing and the leases are past half their TTL, so it
    // fires before they would expire.
    let degraded: Vec<String> = obs
        .peers
        .iter()
        .filter(|h| h.keepalive_failures > 0 && h.lease_ttl_remaining(obs.now).is_none_or(|t| t * 2 <= ttl))
        .map(|h| {
            format!(
                "{} ({} failed keepalives, {}s of lease left)",
                h.peer,
                h.keepalive_failures,
                h.lease_ttl_remaining(obs.now).unwrap_or(0)
            )
        })
        .collect();
    if running && !degraded.is_empty() {
        set(KEEPALIVE_DEGRADED, true, "KeepaliveFailing", format!("leases at risk: {}", degraded.join(", ")));
    } else {
        set(KEEPALIVE_DEGRADED, false, "KeepalivesHealthy", "leases are kept alive".to_string());
    }

    if let Some(conflict) = &obs.conflict {
        set(CONFLICT, true, "RegionClaimed", conflict.clone());
    }
    if spec.suspend {
        set(SUSPENDED, true, "SuspendedBySpec", "spec.suspend is true".to_string());
    }

    let worst = obs
        .peers
        .iter()
        .map(|h| (h.lag_seconds(obs.now), h.lag_revisions()))
        .fold((0.0f64, 0i64), |a, b| (a.0.max(b.0), a.1.max(b.1)));
    let inbound: Vec<InboundStatus> = obs
        .inbound
        .iter()
        .map(|o| InboundStatus {
            region: o.origin.clone(),
            keys: o.keys,
            lease_ttl_remaining_seconds: o.lease_ttl_remaining,
            synced: o.synced,
            checkpoint_revision: o.checkpoint_revision,
        })
        .collect();
    RegionPeeringStatus {
        observed_generation: obs.generation,
        conditions,
        leader: obs.leader.clone(),
        peers_ready: Some(format!("{}/{}", ready_count, spec.peers.len())),
        worst_lag: (running && !spec.peers.is_empty()).then(|| format_lag(worst.0, worst.1)),
        inbound_summary: (!inbound.is_empty())
            .then(|| inbound.iter().map(|i| format!("{}:{}", i.region, i.keys)).collect::<Vec<_>>().join(" ")),
        peers,
        inbound,
    }
}

fn peer_status(h: &PeerHealth, now: SystemTime) -> PeerStatus {
    PeerStatus {
        region: h.peer.clone(),
        phase: h.phase.as_str().to_string(),
        reachable: h.reachable,
        keepalive: KeepaliveStatus {
            last_success_time: h.keepalive_last_success.map(to_time),
            consecutive_failures: h.keepalive_failures as i64,
            ttl_remaining_seconds: h.lease_ttl_remaining(now),
            leases: h.leases as i64,
        },
        replication: ReplicationStatus {
            lag_seconds: Some(h.lag_seconds(now).round() as i64),
            lag_revisions: Some(h.lag_revisions()),
            last_applied_revision: h.last_applied_revision,
            keys: h.keys,
            resyncs: h.resyncs as i64,
            synced: h.synced,
        },
        last_error: h.last_error.as_ref().map(|e| match h.last_error_time {
            Some(t) => format!("{}: {e}", to_time(t).0.strftime("%Y-%m-%dT%H:%M:%SZ")),
            None => e.clone(),
        }),
    }
}

/// "0s", "12s", or "12s/340rev" when revisions are pending.
pub fn format_lag(seconds: f64, revisions: i64) -> String {
    if revisions > 0 { format!("{:.0}s/{revisions}rev", seconds) } else { format!("{:.0}s", seconds) }
}

fn condition(
    previous: Option<&RegionPeeringStatus>,
    type_: &str,
    status: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
    now: SystemTime,
) -> Condition {
    let status = if status { "True" } else { "False" }.to_string();
    let old = previous.and_then(|p| p.conditions.iter().find(|c| c.type_ == type_));
    let last_transition_time = match old {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => to_time(now),
    };
    Condition {
        type_: type_.to_string(),
        status,
        reason: reason.to_string(),
        message,
        observed_generation: generation,
        last_transition_time,
    }
}

fn to_time(t: SystemTime) -> Time {
    Time(k8s_openapi::jiff::Timestamp::try_from(t).unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH))
}

/// Whether `new` differs from `old` in something a person reads, leaving out what moves on
/// every keepalive (the last success time, the TTL remaining). Those are refreshed with the
/// next visible change or heartbeat, so that an idle federation does not patch in a loop.
pub fn visible_change(old: Option<&RegionPeeringStatus>, new: &RegionPeeringStatus) -> bool {
    let Some(old) = old else { return true };
    let strip = |s: &RegionPeeringStatus| {
        let mut s = s.clone();
        for p in &mut s.peers {
            p.keepalive.last_success_time = None;
            p.keepalive.ttl_remaining_seconds = None;
        }
        for i in &mut s.inbound {
            i.lease_ttl_remaining_seconds = None;
        }
        s
    };
    strip(old) != strip(new)
}

/// How often an unchanged status is refreshed anyway (the keepalive times in it).
pub const STATUS_HEARTBEAT: Duration = Duration::from_secs(60);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{EtcdConnection, PeerRegion};

    fn spec(peers: &[&str]) -> RegionPeeringSpec {
        RegionPeeringSpec {
            region: "a".into(),
            local_etcd: EtcdConnection { endpoints: vec!["http://l:1".into()], tls: None },
            peers: peers
                .iter()
                .map(|p| PeerRegion { region: p.to_string(), endpoints: vec!["http://p:1".into()], tls: None })
                .collect(),
            lease: Default::default(),
            failure_detector: Default::default(),
            sync: Default::default(),
            suspend: false,
        }
    }

    fn healthy(peer: &str, now: SystemTime) -> PeerHealth {
        let mut h = PeerHealth::new("a", peer, 30);
        h.phase = Phase::Watching;
        h.synced = true;
        h.keepalive_last_success = Some(now - Duration::from_secs(2));
        h.keys = 10;
        h
    }

    fn observe<'a>(spec: &'a RegionPeeringSpec, peers: Vec<PeerHealth>, now: SystemTime) -> Observation<'a> {
        Observation {
            spec,
            generation: Some(3),
            peers,
            inbound: vec![],
            conflict: None,
            config_errors: vec![],
            leader: Some("op-0".into()),
            now,
        }
    }

    fn get<'a>(s: &'a RegionPeeringStatus, t: &str) -> &'a Condition {
        s.conditions.iter().find(|c| c.type_ == t).unwrap_or_else(|| panic!("no {t} condition"))
    }

    #[test]
    fn ready_when_every_peer_is_synced_kept_alive_and_current() {
        let now = SystemTime::now();
        let spec = spec(&["b", "c"]);
        let status = compute(None, &observe(&spec, vec![healthy("b", now), healthy("c", now)], now));
        assert_eq!(get(&status, READY).status, "True");
        assert_eq!(get(&status, REPLICATING).status, "True");
        assert_eq!(get(&status, KEEPALIVE_DEGRADED).status, "False");
        assert_eq!(status.peers_ready.as_deref(), Some("2/2"));
        assert_eq!(status.worst_lag.as_deref(), Some("0s"));
        assert_eq!(status.observed_generation, Some(3));
    }

    #[test]
    fn connected_is_not_ready() {
        let now = SystemTime::now();
        let spec = spec(&["b"]);
        let mut syncing = healthy("b", now);
        syncing.synced = false;
        syncing.phase = Phase::Syncing;
        let status = compute(None, &observe(&spec, vec![syncing], now));
        assert_eq!(get(&status, READY).status, "False");
        assert_eq!(get(&status, READY).reason, "PeerNotSynced");
        assert!(get(&status, READY).message.contains("b: Syncing"));

        let mut lagging = healthy("b", now);
        lagging.pending_since = Some(now - Duration::from_secs(45));
        lagging.last_seen_revision = 500;
        lagging.last_applied_revision = 100;
        let status = compute(None, &observe(&spec, vec![lagging], now));
        assert_eq!(get(&status, READY).status, "False");
        assert!(get(&status, READY).message.contains("lag 45s"), "{}", get(&status, READY).message);
        assert_eq!(status.worst_lag.as_deref(), Some("45s/400rev"));
    }

    #[test]
    fn keepalive_degraded_fires_before_the_lease_expires() {
        let now = SystemTime::now();
        let spec = spec(&["b"]);
        let mut h = healthy("b", now);
        h.keepalive_failures = 2;
        h.keepalive_last_success = Some(now - Duration::from_secs(16));
        let status = compute(None, &observe(&spec, vec![h.clone()], now));
        assert_eq!(get(&status, KEEPALIVE_DEGRADED).status, "True", "16 s of a 30 s lease gone with failures");
        assert_eq!(get(&status, READY).status, "True", "the lease is still alive");
        h.keepalive_last_success = Some(now - Duration::from_secs(5));
        assert_eq!(get(&compute(None, &observe(&spec, vec![h], now)), KEEPALIVE_DEGRADED).status, "False");
    }

    #[test]
    fn unreachable_peers_are_reported() {
        let now = SystemTime::now();
        let spec = spec(&["b"]);
        let mut h = healthy("b", now);
        h.reachable = false;
        let status = compute(None, &observe(&spec, vec![h], now));
        assert_eq!(get(&status, PEERS_REACHABLE).status, "False");
        assert!(get(&status, PEERS_REACHABLE).message.contains("nothing is deleted"));
    }

    #[test]
    fn single_region_is_ready_with_nothing_to_do() {
        let now = SystemTime::now();
        let spec = spec(&[]);
        let status = compute(None, &observe(&spec, vec![], now));
        assert_eq!(get(&status, READY).status, "True");
        assert_eq!(get(&status, READY).reason, "NoPeers");
        assert_eq!(status.peers_ready.as_deref(), Some("0/0"));
    }

    #[test]
    fn conflict_suspend_and_config_errors_explain_themselves() {
        let now = SystemTime::now();
        let mut s = spec(&["b"]);
        let mut obs = observe(&s, vec![], now);
        obs.conflict = Some("region a on http://l:1 is federated by ns/first".into());
        let status = compute(None, &obs);
        assert_eq!(get(&status, CONFLICT).status, "True");
        assert_eq!(get(&status, READY).reason, "Conflict");

        s.suspend = true;
        let status = compute(None, &observe(&s, vec![], now));
        assert_eq!(get(&status, SUSPENDED).status, "True");
        assert_eq!(get(&status, READY).reason, "Suspended");

        let s = spec(&["b"]);
        let mut obs = observe(&s, vec![], now);
        obs.config_errors = vec![("SecretInvalid".into(), "Secret creds has no key ca.crt".into())];
        let status = compute(None, &obs);
        assert_eq!(get(&status, READY).reason, "SecretInvalid");
        assert!(get(&status, READY).message.contains("ca.crt"));
    }

    #[test]
    fn transition_times_move_only_with_the_status() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let spec = spec(&["b"]);
        let first = compute(None, &observe(&spec, vec![healthy("b", t0)], t0));
        let t1 = t0 + Duration::from_secs(30);
        let second = compute(Some(&first), &observe(&spec, vec![healthy("b", t1)], t1));
        assert_eq!(get(&first, READY).last_transition_time, get(&second, READY).last_transition_time);
        assert!(!visible_change(Some(&first), &second), "only keepalive times moved");
        let mut down = healthy("b", t1);
        down.phase = Phase::Backoff;
        let third = compute(Some(&second), &observe(&spec, vec![down], t1));
        assert_ne!(get(&second, READY).last_transition_time, get(&third, READY).last_transition_time);
        assert!(visible_change(Some(&second), &third));
    }
}
