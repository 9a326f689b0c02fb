//! Computing a RegionPeering's status from what the workers report, without IO. Ready comes from
//! replication progress and keepalive age, never from "connected".
use crate::api::{
    InboundStatus, KeepaliveStatus, OversizedValue, PeerStatus, RegionPeeringSpec, RegionPeeringStatus,
    ReplicationStatus,
};
use crate::mirror::health::RENEWAL_ADVICE;
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
pub const DRIFT_DETECTED: &str = "DriftDetected";
pub const VALUES_TOO_LARGE: &str = "ValuesTooLarge";
pub const CHANGE_REFUSED: &str = "ChangeRefused";
pub const HANDOFF_COVERED: &str = "HandoffCovered";

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
    /// Changes of running peers' configurations that were refused or wait for their trial; the
    /// message names the fields, both sides and how to undo it.
    pub held: Vec<crate::controllers::plan::HeldChange>,
    pub leader: Option<String>,
    pub leader_lease: Option<String>,
    /// How long the leader Lease stays valid after a renewal (None: not known).
    pub leader_lease_duration: Option<Duration>,
    /// The configuration each running worker runs on (its fingerprint), by peer.
    pub configurations: std::collections::BTreeMap<String, u64>,
    pub now: SystemTime,
}

/// What one condition says: status, reason, message.
type Verdict = (bool, String, String);

/// The observation and what every condition needs from it.
struct Facts<'a> {
    obs: &'a Observation<'a>,
    /// Workers are meant to run (no conflict, not suspended).
    running: bool,
    /// Peers that are synced, kept alive and within the lag bound.
    ready_count: usize,
}

impl Facts<'_> {
    fn ready_peer(&self, h: &PeerHealth) -> bool {
        let now = self.obs.now;
        h.synced
            && h.phase == Phase::Watching
            && h.lag_seconds(now) <= self.obs.spec.sync.max_ready_lag_seconds as f64
            && h.lease_ttl_remaining(now).is_some_and(|t| t > 0)
    }

    fn mirroring(&self) -> bool {
        self.running && !self.obs.spec.peers.is_empty()
    }
}

fn verdict(status: bool, reason: &str, message: impl Into<String>) -> Verdict {
    (status, reason.to_string(), message.into())
}

/// The status the observation implies. Conditions keep their lastTransitionTime from `previous`
/// while their status does not change.
pub fn compute(previous: Option<&RegionPeeringStatus>, obs: &Observation) -> RegionPeeringStatus {
    let spec = obs.spec;
    let peers: Vec<PeerStatus> = spec
        .peers
        .iter()
        .map(|p| match obs.peers.iter().find(|h| h.peer == p.region) {
            Some(h) => peer_status(h, obs.configurations.get(&p.region).copied(), obs.now),
            None => PeerStatus {
                region: p.region.clone(),
                phase: Phase::Stopped.as_str().into(),
                reachable: false,
                ..PeerStatus::default()
            },
        })
        .collect();
    let running = obs.conflict.is_none() && !spec.suspend;
    let mut facts = Facts { obs, running, ready_count: 0 };
    if running {
        facts.ready_count =
            obs.peers.iter().filter(|h| spec.peers.iter().any(|p| p.region == h.peer) && facts.ready_peer(h)).count();
    }

    let mut verdicts = vec![
        (READY, ready(&facts)),
        (REPLICATING, replicating(&facts)),
        (PEERS_REACHABLE, peers_reachable(&facts)),
        (KEEPALIVE_DEGRADED, keepalive_degraded(&facts)),
        (DRIFT_DETECTED, drift_detected(&facts)),
        (VALUES_TOO_LARGE, values_too_large(&facts)),
        (CHANGE_REFUSED, change_refused(&facts)),
        (HANDOFF_COVERED, handoff_covered(&facts)),
    ];
    if let Some(conflict) = &obs.conflict {
        verdicts.push((CONFLICT, verdict(true, "RegionClaimed", conflict.clone())));
    } else if let Some(refusal) = refused(&facts) {
        verdicts.push((CONFLICT, verdict(true, refusal.reason, refusal.message.clone())));
    }
    if spec.suspend {
        verdicts.push((SUSPENDED, verdict(true, "SuspendedBySpec", "spec.suspend is true")));
    }
    let conditions = verdicts
        .into_iter()
        .map(|(type_, (status, reason, message))| {
            condition(previous, type_, status, &reason, message, obs.generation, obs.now)
        })
        .collect();

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
        leader_lease: obs.leader_lease.clone(),
        refreshed_time: Some(to_time(obs.now)),
        refresh_interval_seconds: Some(STATUS_HEARTBEAT.as_secs() as i64),
        peers_ready: Some(format!("{}/{}", facts.ready_count, spec.peers.len())),
        worst_lag: facts.mirroring().then(|| format_lag(worst.0, worst.1)),
        inbound_summary: (!inbound.is_empty())
            .then(|| inbound.iter().map(|i| format!("{}:{}", i.region, i.keys)).collect::<Vec<_>>().join(" ")),
        peers,
        inbound,
    }
}

/// Ready, and why not.
fn ready(f: &Facts) -> Verdict {
    let (obs, spec) = (f.obs, f.obs.spec);
    if let Some(conflict) = &obs.conflict {
        return verdict(false, "Conflict", conflict.clone());
    }
    if spec.suspend {
        return verdict(
            false,
            "Suspended",
            "spec.suspend is true: no worker runs; the mirrors on the peers lapse with their leases",
        );
    }
    if let Some((reason, message)) = obs.config_errors.first() {
        return verdict(false, reason, message.clone());
    }
    if let Some(held) = obs.held.iter().find(|h| h.refused) {
        return verdict(false, &held.why.0, format!("a spec change was refused: {}", held.why.1));
    }
    if spec.peers.is_empty() {
        return verdict(true, "NoPeers", "single region: nothing to mirror");
    }
    if let Some(refusal) = refused(f) {
        return verdict(false, refusal.reason, refusal.message.clone());
    }
    if let Some((peer, held)) = held(f) {
        return verdict(false, held.reason, format!("{peer}: {}", held.message));
    }
    if let Some(h) = obs.peers.iter().find(|h| h.phase == Phase::Fenced) {
        return verdict(
            false,
            "Fenced",
            format!("another operator instance owns the mirror into {}; this one stopped writing", h.peer),
        );
    }
    if f.ready_count == spec.peers.len() {
        return verdict(
            true,
            "AllPeersReady",
            format!(
                "{} of {} peers synced, kept alive and within {}s of lag",
                f.ready_count,
                spec.peers.len(),
                spec.sync.max_ready_lag_seconds
            ),
        );
    }
    let not_ready: Vec<String> = spec
        .peers
        .iter()
        .filter(|p| !obs.peers.iter().any(|h| h.peer == p.region && f.ready_peer(h)))
        .map(|p| match obs.peers.iter().find(|h| h.peer == p.region) {
            None => format!("{}: not running yet (its worker is starting)", p.region),
            Some(h) if h.phase == Phase::Queued => format!(
                "{}: Queued (its full sync waits for the region's other syncs to end: {} run at once)",
                p.region,
                crate::mirror::FULL_SYNCS_AT_ONCE
            ),
            Some(h) if !h.synced => format!("{}: {} (initial sync not complete)", p.region, h.phase.as_str()),
            Some(h) if h.lease_ttl_remaining(obs.now).is_none_or(|t| t <= 0) => {
                format!("{}: lease not kept alive", p.region)
            }
            Some(h) if h.phase != Phase::Watching => format!("{}: {}", p.region, h.phase.as_str()),
            Some(h) => {
                format!("{}: lag {:.0}s over {}s", p.region, h.lag_seconds(obs.now), spec.sync.max_ready_lag_seconds)
            }
        })
        .collect();
    // A peer whose sessions fail says why, in a reason a person can act on (`problem.rs`).
    // The class stays until the peer applies something again, so the reason does not flip
    // between a failed session and the next attempt.
    let failing = obs
        .peers
        .iter()
        .find(|h| h.last_error_reason.is_some() && spec.peers.iter().any(|p| p.region == h.peer) && !f.ready_peer(h));
    if let Some((reason, h)) = failing.and_then(|h| h.last_error_reason.map(|r| (r, h))) {
        let message = h.last_error.clone().unwrap_or_default();
        return verdict(false, reason, format!("{}: {message}; {}", h.peer, not_ready.join("; ")));
    }
    // A peer whose worker has not reported yet is starting (a new leader, a rollout): progress,
    // as a sync is, not a peer that fails to keep up.
    let starting = spec.peers.iter().any(|p| !obs.peers.iter().any(|h| h.peer == p.region));
    let reason = if starting || obs.peers.iter().any(|h| !h.synced) { "PeerNotSynced" } else { "PeerNotReady" };
    verdict(false, reason, not_ready.join("; "))
}

/// The first refused claim of a running worker on a peer of the spec: a duplicate RegionPeering,
/// a peer that is the origin itself, one etcd under two peer names.
fn refused<'a>(f: &Facts<'a>) -> Option<&'a crate::mirror::Refusal> {
    let spec = f.obs.spec;
    f.obs
        .peers
        .iter()
        .filter(|h| h.phase == Phase::Refused && spec.peers.iter().any(|p| p.region == h.peer))
        .find_map(|h| h.refusal.as_ref())
        .filter(|_| f.running)
}

/// The first peer whose worker holds what comes next for a person (a resync that would delete
/// most of the copy, a local etcd holding a copy of this region), and what it says.
fn held<'a>(f: &Facts<'a>) -> Option<(&'a str, &'a crate::mirror::Refusal)> {
    f.obs
        .peers
        .iter()
        .filter(|h| h.phase == Phase::Held && f.obs.spec.peers.iter().any(|p| p.region == h.peer))
        .find_map(|h| h.refusal.as_ref().map(|r| (h.peer.as_str(), r)))
        .filter(|_| f.running)
}

/// ChangeRefused: a change of a running peer's configuration that did not verify (True, with the
/// fields, both sides and how to undo it: the peer keeps running on its previous configuration),
/// or one that waits for a trial that could not finish (False, `Verifying`).
fn change_refused(f: &Facts) -> Verdict {
    let held = &f.obs.held;
    let refused: Vec<&str> = held.iter().filter(|h| h.refused).map(|h| h.why.1.as_str()).collect();
    if let Some(first) = held.iter().find(|h| h.refused) {
        return verdict(true, &first.why.0, refused.join("; "));
    }
    if !held.is_empty() {
        let waiting: Vec<&str> = held.iter().map(|h| h.why.1.as_str()).collect();
        return verdict(false, "Verifying", waiting.join("; "));
    }
    verdict(false, "AllApplied", "every peer runs on the configuration the spec asks for")
}

/// Replicating: every worker is past its sync and watching.
fn replicating(f: &Facts) -> Verdict {
    let spec = f.obs.spec;
    if !f.mirroring() {
        let reason = if spec.peers.is_empty() { "NoPeers" } else { "NotRunning" };
        return verdict(false, reason, "no mirror worker runs");
    }
    let watching = f.obs.peers.iter().filter(|h| h.phase == Phase::Watching && h.synced).count();
    let all = watching == spec.peers.len();
    let message = format!("{watching} of {} peers watching the origin after a complete sync", spec.peers.len());
    verdict(all, if all { "Watching" } else { "Syncing" }, message)
}

/// PeersReachable: the cross-region failure detector; it reports and never acts.
fn peers_reachable(f: &Facts) -> Verdict {
    if !f.mirroring() {
        return verdict(true, "NotMonitored", "no mirror worker runs");
    }
    let unreachable: Vec<&str> = f.obs.peers.iter().filter(|h| !h.reachable).map(|h| h.peer.as_str()).collect();
    if unreachable.is_empty() {
        return verdict(true, "Reachable", "every peer answered within the acceptable pause");
    }
    verdict(
        false,
        "PeerUnreachable",
        format!(
            "no round trip to {} within {}s; nothing is deleted, the mirrors lapse only with their leases",
            unreachable.join(", "),
            f.obs.spec.failure_detector.effective_pause_seconds(&f.obs.spec.lease)
        ),
    )
}

/// KeepaliveDegraded: keepalives are failing and the leases are past half their TTL
/// (`KeepaliveFailing`); or the peer renews too slowly for the TTL (`RenewalsTooSlow`): a round
/// took more than a third of it, or the measured rate could not renew every lease within a third
/// (two slow rounds and a retry would not fit), so it fires before the leases would expire.
fn keepalive_degraded(f: &Facts) -> Verdict {
    let now = f.obs.now;
    // Each peer's leases by the TTL they were granted (after a TTL change, the old ones until
    // the copy has moved), the configured one until the peer said.
    let ttl_of = |h: &PeerHealth| h.lease_ttl_reported.unwrap_or(f.obs.spec.lease.ttl_seconds);
    let failing: Vec<String> = f
        .obs
        .peers
        .iter()
        .filter(|h| h.keepalive_failures > 0 && h.lease_ttl_remaining(now).is_none_or(|t| t * 2 <= ttl_of(h)))
        .map(|h| {
            format!(
                "{} ({} failed keepalives, {}s of lease left)",
                h.peer,
                h.keepalive_failures,
                h.lease_ttl_remaining(now).unwrap_or(0)
            )
        })
        .collect();
    if f.running && !failing.is_empty() {
        return verdict(true, "KeepaliveFailing", format!("leases at risk: {}", failing.join(", ")));
    }
    let slow: Vec<String> = f
        .obs
        .peers
        .iter()
        .filter_map(|h| match (&h.renewal_shortfall, h.last_keepalive_round()) {
            (Some(short), _) => Some(format!("{}: {}", h.peer, short.describe())),
            (None, Some(round)) if round * 3.0 > ttl_of(h) as f64 => Some(format!(
                "{}: a round of {} leases took {round:.1}s of a {}s TTL; {RENEWAL_ADVICE}",
                h.peer,
                h.leases,
                ttl_of(h)
            )),
            _ => None,
        })
        .collect();
    if f.running && !slow.is_empty() {
        return verdict(true, "RenewalsTooSlow", format!("leases at risk: {}", slow.join("; ")));
    }
    verdict(false, "KeepalivesHealthy", "leases are kept alive")
}

/// What a successor needs, past the leader Lease, before its workers renew: to see the Lease
/// expired, take it, start its controllers and the workers (and try a configuration that changed
/// meanwhile); about two seconds measured (docs/operating.md "Room for a handoff").
pub const HANDOFF_MARGIN: Duration = Duration::from_secs(5);

/// HandoffCovered: whether the leases outlive a leader lost without a release. A crashed or
/// frozen leader (a lost node) renews nothing and releases nothing: its successor waits the
/// leader Lease out, then starts the workers. The copies were last renewed up to a keepalive
/// interval before the loss, so they survive only when the TTL covers a keepalive interval, the
/// leader Lease and `HANDOFF_MARGIN`; otherwise a live region's copies lapse on every such loss.
/// Said before anything is lost, with the numbers and what to change.
fn handoff_covered(f: &Facts) -> Verdict {
    let lease = &f.obs.spec.lease;
    let Some(leader) = f.obs.leader_lease_duration else {
        return verdict(true, "NotChecked", "the leader Lease's duration is not known");
    };
    let (ttl, keepalive, leader) = (lease.ttl_seconds, lease.keepalive_interval_seconds, leader.as_secs() as i64);
    let needed = leader + keepalive + HANDOFF_MARGIN.as_secs() as i64;
    if ttl >= needed {
        return verdict(
            true,
            "TtlCoversHandoff",
            format!(
                "a leader lost without a release is replaced after its {leader}s Lease; the leases, renewed every {keepalive}s, last {ttl}s: {}s to spare",
                ttl - needed
            ),
        );
    }
    verdict(
        false,
        "TtlShorterThanHandoff",
        format!(
            "a leader lost without a release (a crash, a lost node) is replaced only after its {leader}s Lease and a few seconds more, while the leases, renewed every {keepalive}s, last {ttl}s: every copy of {} on the peers would lapse while the region is live. Raise spec.lease.ttlSeconds to at least {needed} (the leader Lease {leader}s + spec.lease.keepaliveIntervalSeconds {keepalive}s + {}s), or lower the keepalive interval or the operator's --leader-lease-duration (the chart's leaderElection.durationSeconds)",
            f.obs.spec.region,
            HANDOFF_MARGIN.as_secs()
        ),
    )
}

/// DriftDetected: continuous verification found a peer's copy different from the origin (and
/// repaired it); it stays True until a whole pass over the subtree finds it clean.
fn drift_detected(f: &Facts) -> Verdict {
    let drifted: Vec<String> = f
        .obs
        .peers
        .iter()
        .filter(|h| h.drift_detected)
        .map(|h| format!("{} ({} keys repaired so far)", h.peer, h.drift_repaired_keys))
        .collect();
    if f.running && !drifted.is_empty() {
        return verdict(
            true,
            "PeerCopyDiffered",
            format!(
                "the copy on {} differed from the origin and was repaired; something besides this mirror writes there, or the peer was restored",
                drifted.join(", ")
            ),
        );
    }
    verdict(false, "CopiesMatch", "every verified page of the peers' copies matched the origin")
}

/// ValuesTooLarge: origin values no request to the peer can carry; they are left out of the
/// mirror (and removed from the peer) until they shrink.
fn values_too_large(f: &Facts) -> Verdict {
    let large: Vec<String> = f
        .obs
        .peers
        .iter()
        .flat_map(|h| h.oversized.iter().map(move |(k, b)| format!("{k} ({b} bytes, into {})", h.peer)))
        .collect();
    if f.running && !large.is_empty() {
        let shown: Vec<&str> = large.iter().take(5).map(String::as_str).collect();
        let more = if large.len() > 5 { format!(" and {} more", large.len() - 5) } else { String::new() };
        return verdict(
            true,
            "ValueOverPeerLimit",
            format!(
                "left out of the mirror: {}{more}; shrink them, or raise the peer's --max-request-bytes and spec.sync.maxRequestBytes",
                shown.join(", ")
            ),
        );
    }
    verdict(false, "AllValuesFit", "every value fits in a request the peers accept")
}

fn peer_status(h: &PeerHealth, configuration: Option<u64>, now: SystemTime) -> PeerStatus {
    PeerStatus {
        configuration: configuration.map(|f| format!("{f:016x}")),
        region: h.peer.clone(),
        phase: h.phase.as_str().to_string(),
        reachable: h.reachable,
        keepalive: KeepaliveStatus {
            last_success_time: h.keepalive_last_success.map(to_time),
            consecutive_failures: h.keepalive_failures as i64,
            ttl_remaining_seconds: h.lease_ttl_remaining(now),
            leases: h.leases as i64,
            last_round_milliseconds: h.last_keepalive_round().map(|r| (r * 1000.0).round() as i64),
            streams: (h.keepalive_streams > 0).then_some(h.keepalive_streams as i64),
        },
        replication: ReplicationStatus {
            lag_seconds: Some(h.lag_seconds(now).round() as i64),
            lag_revisions: Some(h.lag_revisions()),
            last_applied_revision: h.last_applied_revision,
            keys: h.keys,
            resyncs: h.resyncs as i64,
            resyncs_by_cause: h.resyncs_by_cause.iter().map(|(cause, n)| (cause.to_string(), *n as i64)).collect(),
            synced: h.synced,
            drift_repaired_keys: h.drift_repaired_keys as i64,
        },
        oversized_values: h
            .oversized
            .iter()
            .take(10)
            .map(|(key, bytes)| OversizedValue { key: key.clone(), bytes: *bytes as i64 })
            .collect(),
        last_error: h
            .refusal
            .as_ref()
            .map(|r| format!("{}: {}", r.reason, r.message))
            .or_else(|| {
                h.last_error.as_ref().map(|e| match h.last_error_time {
                    Some(t) => format!("{}: {e}", to_time(t).0.strftime("%Y-%m-%dT%H:%M:%SZ")),
                    None => e.clone(),
                })
            })
            .or_else(|| h.layout_problem.clone()),
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
        s.refreshed_time = None;
        for p in &mut s.peers {
            p.keepalive.last_success_time = None;
            p.keepalive.ttl_remaining_seconds = None;
            p.keepalive.last_round_milliseconds = None;
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
    use crate::mirror::RenewalShortfall;

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
            deletion_policy: Default::default(),
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
            held: vec![],
            leader: Some("op-0".into()),
            leader_lease: None,
            leader_lease_duration: Some(Duration::from_secs(8)),
            configurations: Default::default(),
            now,
        }
    }

    #[test]
    fn a_refused_change_is_not_ready_and_names_what_to_undo_while_a_waiting_one_is_only_said() {
        use crate::controllers::plan::HeldChange;
        let now = SystemTime::now();
        let spec = spec(&["b", "c"]);
        let mut obs = observe(&spec, vec![healthy("b", now), healthy("c", now)], now);
        let applied = compute(None, &obs);
        assert_eq!(get(&applied, CHANGE_REFUSED).status, "False");
        assert_eq!(get(&applied, CHANGE_REFUSED).reason, "AllApplied");
        let message = "spec.peers[b].endpoints: [\"x\"] -> [\"y\"]: peers b and c are one etcd; peer b keeps running on its previous configuration; to undo: set spec.peers[b].endpoints back to [\"x\"]";
        obs.held = vec![HeldChange { peer: "b".into(), refused: true, why: ("DuplicatePeer".into(), message.into()) }];
        let refused = compute(Some(&applied), &obs);
        let c = get(&refused, CHANGE_REFUSED);
        assert_eq!((c.status.as_str(), c.reason.as_str(), c.message.as_str()), ("True", "DuplicatePeer", message));
        let ready = get(&refused, READY);
        assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("False", "DuplicatePeer"));
        assert!(ready.message.contains("to undo"), "{}", ready.message);
        assert_eq!(refused.peers_ready.as_deref(), Some("2/2"), "the copies themselves are fine");
        obs.held[0].refused = false;
        let waiting = compute(Some(&refused), &obs);
        assert_eq!(get(&waiting, CHANGE_REFUSED).reason, "Verifying");
        assert_eq!(get(&waiting, READY).status, "True");
    }

    fn get<'a>(s: &'a RegionPeeringStatus, t: &str) -> &'a Condition {
        s.conditions.iter().find(|c| c.type_ == t).unwrap_or_else(|| panic!("no {t} condition"))
    }

    /// Asserts the condition's status and reason, and that its message says each of `said`.
    fn says(c: &Condition, status: &str, reason: &str, said: &[&str]) {
        assert_eq!((c.status.as_str(), c.reason.as_str()), (status, reason), "{}", c.message);
        for s in said {
            assert!(c.message.contains(s), "{s:?} missing from {:?}", c.message);
        }
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

    /// A person reading the status sees why a peer resynced, not only how often: the events fold a
    /// series and expire, the status keeps each cause since the worker started.
    #[test]
    fn the_status_counts_each_peers_resyncs_by_cause() {
        let now = SystemTime::now();
        let spec = spec(&["b", "c"]);
        let mut looping = healthy("b", now);
        looping.resyncs = 3;
        looping.resyncs_by_cause.insert("lease_lost", 2);
        looping.resyncs_by_cause.insert("reshard", 1);
        let status = compute(None, &observe(&spec, vec![looping, healthy("c", now)], now));
        let replication = |peer: &str| &status.peers.iter().find(|p| p.region == peer).unwrap().replication;
        assert_eq!(replication("b").resyncs, 3);
        let by_cause: Vec<(&str, i64)> =
            replication("b").resyncs_by_cause.iter().map(|(cause, n)| (cause.as_str(), *n)).collect();
        assert_eq!(by_cause, [("lease_lost", 2), ("reshard", 1)]);
        // A peer that never resynced shows no causes, and the field is left out of what is written.
        assert!(replication("c").resyncs_by_cause.is_empty());
        let written = serde_json::to_value(replication("c")).unwrap();
        assert!(written.get("resyncsByCause").is_none(), "{written}");
        assert_eq!(serde_json::to_value(replication("b")).unwrap()["resyncsByCause"]["lease_lost"], 2);
    }

    #[test]
    fn a_peer_waiting_its_turn_at_a_full_sync_is_named_queued_and_not_ready() {
        let now = SystemTime::now();
        let spec = spec(&["b", "c"]);
        let mut queued = healthy("c", now);
        queued.synced = false;
        queued.phase = Phase::Queued;
        let status = compute(None, &observe(&spec, vec![healthy("b", now), queued], now));
        let ready = get(&status, READY);
        assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("False", "PeerNotSynced"));
        assert!(ready.message.contains("c: Queued (its full sync waits"), "{}", ready.message);
        assert!(!ready.message.contains("b:"), "{}", ready.message);
    }

    /// A leader that has just started (a rollout, a handoff, the first install) has workers that
    /// have not reported yet: that is progress, not a fault (Argo CD reads PeerNotReady as
    /// Degraded, PeerNotSynced as Progressing).
    #[test]
    fn a_peer_whose_worker_has_not_reported_yet_is_syncing_not_failing() {
        let now = SystemTime::now();
        let spec = spec(&["b", "c"]);
        let status = compute(None, &observe(&spec, vec![], now));
        let ready = get(&status, READY);
        assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("False", "PeerNotSynced"), "{}", ready.message);
        assert!(ready.message.contains("b: not running yet (its worker is starting)"), "{}", ready.message);
        // One reported and watching, the other not yet: still starting.
        let status = compute(None, &observe(&spec, vec![healthy("b", now)], now));
        let ready = get(&status, READY);
        assert_eq!(ready.reason, "PeerNotSynced", "{}", ready.message);
        assert!(ready.message.starts_with("c: not running yet") && !ready.message.contains("b:"), "{}", ready.message);
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
        assert_eq!(get(&compute(None, &observe(&spec, vec![h.clone()], now)), KEEPALIVE_DEGRADED).status, "False");
        // Rounds that take more than a third of the TTL fire it too, with nothing failing yet.
        h.keepalive_failures = 0;
        h.record_keepalive_rtt(Duration::from_millis(10_500));
        let status = compute(None, &observe(&spec, vec![h.clone()], now));
        let degraded = get(&status, KEEPALIVE_DEGRADED);
        assert_eq!(degraded.status, "True", "a 10.5 s round of a 30 s TTL");
        assert!(degraded.message.contains("took 10.5s"), "{}", degraded.message);
        assert_eq!(degraded.reason, "RenewalsTooSlow");
        assert_eq!(status.peers[0].keepalive.last_round_milliseconds, Some(10_500));
        h.record_keepalive_rtt(Duration::from_millis(900));
        assert_eq!(get(&compute(None, &observe(&spec, vec![h], now)), KEEPALIVE_DEGRADED).status, "False");
    }

    #[test]
    fn a_layout_the_peer_cannot_renew_in_time_is_reported_with_its_numbers_and_what_to_change() {
        let now = SystemTime::now();
        let spec = spec(&["b"]);
        let mut h = healthy("b", now);
        // The last round was quick (a part of the layout), but the rate it measured cannot renew
        // every lease within a third of the TTL: said while nothing has failed yet.
        h.record_keepalive_rtt(Duration::from_millis(900));
        h.renewal_shortfall = Some(RenewalShortfall {
            leases: 16_384,
            rate: 1_500,
            streams: 32,
            round: Duration::from_millis(10_923),
            ttl: Duration::from_secs(30),
        });
        let status = compute(None, &observe(&spec, vec![h.clone()], now));
        let said = [
            "16384 leases",
            "10.9s",
            "1500 renewals/s",
            "32 streams",
            "30s TTL",
            "spec.lease.ttlSeconds",
            "maxKeysPerLease",
            "endpoints",
        ];
        says(get(&status, KEEPALIVE_DEGRADED), "True", "RenewalsTooSlow", &said);
        // Failing keepalives with little lease left take precedence: the more urgent reason.
        h.keepalive_failures = 3;
        h.keepalive_last_success = Some(now - Duration::from_secs(20));
        assert_eq!(get(&compute(None, &observe(&spec, vec![h], now)), KEEPALIVE_DEGRADED).reason, "KeepaliveFailing");
    }

    #[test]
    fn a_ttl_that_a_lost_leader_would_outlast_is_said_with_the_numbers_while_the_region_stays_ready() {
        let now = SystemTime::now();
        let mut spec = spec(&["b"]);
        // The defaults (30 s, 10 s) against the default leader Lease (8 s): covered.
        let status = compute(None, &observe(&spec, vec![healthy("b", now)], now));
        says(get(&status, HANDOFF_COVERED), "True", "TtlCoversHandoff", &["7s to spare"]);
        // 10 s and 2 s: the copies last 8 s past a renewal, the successor starts after 8 s and more.
        spec.lease.ttl_seconds = 10;
        spec.lease.keepalive_interval_seconds = 2;
        let status = compute(None, &observe(&spec, vec![healthy("b", now)], now));
        let said = [
            "8s Lease",
            "renewed every 2s",
            "last 10s",
            "spec.lease.ttlSeconds to at least 15",
            "leaderElection.durationSeconds",
        ];
        says(get(&status, HANDOFF_COVERED), "False", "TtlShorterThanHandoff", &said);
        // A hazard, not a failure: the region is as ready as its peers.
        assert_eq!(get(&status, READY).status, "True");
        // The bound itself: 15 s is enough at a 2 s keepalive, 14 s is not; a longer leader Lease
        // moves it.
        spec.lease.ttl_seconds = 15;
        assert_eq!(get(&compute(None, &observe(&spec, vec![], now)), HANDOFF_COVERED).status, "True");
        spec.lease.ttl_seconds = 14;
        assert_eq!(get(&compute(None, &observe(&spec, vec![], now)), HANDOFF_COVERED).status, "False");
        spec.lease.ttl_seconds = 30;
        let mut obs = observe(&spec, vec![], now);
        obs.leader_lease_duration = Some(Duration::from_secs(30));
        says(get(&compute(None, &obs), HANDOFF_COVERED), "False", "TtlShorterThanHandoff", &["at least 37"]);
    }

    #[test]
    fn a_refused_claim_is_a_conflict_that_names_both_sides_and_ready_says_so() {
        let now = SystemTime::now();
        let spec = spec(&["b", "c"]);
        let mut refused = PeerHealth::new("a", "c", 30);
        refused.phase = Phase::Refused;
        let message = "peers b and c of RegionPeering fed/a (uid 1) are one etcd (cluster 7): remove one of them";
        refused.refusal = Some(crate::mirror::Refusal { reason: "DuplicatePeer", message: message.into() });
        let status = compute(None, &observe(&spec, vec![healthy("b", now), refused], now));
        let ready = get(&status, READY);
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str(), ready.message.as_str()),
            ("False", "DuplicatePeer", message)
        );
        let conflict = get(&status, CONFLICT);
        assert_eq!((conflict.status.as_str(), conflict.reason.as_str()), ("True", "DuplicatePeer"));
        assert_eq!(status.peers_ready.as_deref(), Some("1/2"));
        assert_eq!(status.peers[1].phase, "Refused");
        // Once the claim is taken, the condition goes.
        let status = compute(Some(&status), &observe(&spec, vec![healthy("b", now), healthy("c", now)], now));
        assert!(status.conditions.iter().all(|c| c.type_ != CONFLICT));
        assert_eq!(get(&status, READY).status, "True");
    }

    #[test]
    fn a_failing_peer_makes_ready_say_why_until_it_applies_again() {
        let now = SystemTime::now();
        let spec = spec(&["b"]);
        let mut h = healthy("b", now);
        h.synced = false;
        h.phase = Phase::Connecting; // between two failed sessions
        h.last_error_reason = Some("TLSUntrusted");
        h.last_error =
            Some("https://etcd-b:2379: the etcd's certificate is not trusted by ca.crt of Secret fed/b".into());
        let ready = get(&compute(None, &observe(&spec, vec![h.clone()], now)), READY).clone();
        assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("False", "TLSUntrusted"));
        assert!(
            ready.message.contains("b: https://etcd-b:2379") && ready.message.contains("Secret fed/b"),
            "{}",
            ready.message
        );
        h.last_error_reason = None;
        assert_eq!(get(&compute(None, &observe(&spec, vec![h], now)), READY).reason, "PeerNotSynced");
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
    fn drift_and_values_too_large_are_reported_with_what_to_do() {
        let now = SystemTime::now();
        let spec = spec(&["b"]);
        let status = compute(None, &observe(&spec, vec![healthy("b", now)], now));
        assert_eq!(get(&status, DRIFT_DETECTED).status, "False");
        assert_eq!(get(&status, VALUES_TOO_LARGE).status, "False");
        let mut h = healthy("b", now);
        h.drift_detected = true;
        h.drift_repaired_keys = 4;
        h.oversized = vec![("/aether/v1/regions/a/x".into(), 2_000_000)];
        let status = compute(None, &observe(&spec, vec![h], now));
        assert_eq!(get(&status, DRIFT_DETECTED).status, "True");
        assert!(get(&status, DRIFT_DETECTED).message.contains("b (4 keys repaired"));
        let large = get(&status, VALUES_TOO_LARGE);
        assert_eq!(large.status, "True");
        assert!(large.message.contains("/aether/v1/regions/a/x (2000000 bytes, into b)"), "{}", large.message);
        assert!(large.message.contains("--max-request-bytes"));
        assert_eq!(status.peers[0].oversized_values[0].bytes, 2_000_000);
        assert_eq!(get(&status, READY).status, "True", "the rest of the subtree is mirrored");
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
