//! What a RegionPeering reconcile decides, without IO: which workers run (`decide`), how the
//! running ones change (`worker_changes`), and which claim on a region wins (`conflict`). The
//! reconciler reads (Secrets, claims, running workers), decides here, acts, then reports status.
use std::collections::BTreeMap;

/// A configuration problem as status and events show it: (reason, message).
pub type Problem = (String, String);

/// Where the trial of a peer's configuration (the one the spec asks for now) stands: a worker
/// runs on a configuration only once a trial verified it (`mirror::trial`). A peer whose running
/// worker already has that configuration needs none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Trial {
    /// None of this configuration yet (or the last one is old enough to try again).
    #[default]
    Untried,
    Running,
    Verified,
    /// The configuration cannot be right: (reason, message).
    Refused(Problem),
    /// Nothing answered: not known yet.
    Unverified(Problem),
}

/// A change of a running peer's configuration that waits or was refused: the worker keeps
/// running on the configuration it has.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldChange {
    pub peer: String,
    /// Refused (true), or waiting for a trial that could not finish (false).
    pub refused: bool,
    /// Why: (reason, message).
    pub why: Problem,
}

/// What a reconcile read, as the decision needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Facts {
    pub suspend: bool,
    /// Another RegionPeering's older claim on this region of this etcd, if any.
    pub conflict: Option<String>,
    /// The local etcd's connection: resolved, or why not.
    pub local: Result<(), Problem>,
    /// Each peer of the spec, in order: its worker's fingerprint (everything that restarts it),
    /// or why its connection cannot be resolved.
    pub peers: Vec<(String, Result<u64, Problem>)>,
    /// The workers running now (and alive), with their fingerprints.
    pub running: BTreeMap<String, u64>,
    /// The trial of each peer's configuration as the spec asks for it now.
    pub trials: BTreeMap<String, Trial>,
    /// The configuration each peer's worker ran on under the leader before (its status): a
    /// new leader, or a worker started again, runs that one without trying it again.
    pub recorded: BTreeMap<String, u64>,
}

impl Default for Facts {
    fn default() -> Self {
        Facts {
            suspend: false,
            conflict: None,
            local: Ok(()),
            peers: Vec::new(),
            running: BTreeMap::new(),
            trials: BTreeMap::new(),
            recorded: BTreeMap::new(),
        }
    }
}

/// What a reconcile does.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decision {
    /// The workers to start, restart and stop.
    pub changes: Vec<WorkerChange>,
    /// Configuration problems, for status (each also a Warning, once).
    pub config_errors: Vec<Problem>,
    /// Warnings to publish once: the conflict and the configuration problems.
    pub warnings: Vec<Problem>,
    /// Peers whose configuration is to be tried now.
    pub trials: Vec<String>,
    /// Changes of running peers that wait for their trial or were refused.
    pub held: Vec<HeldChange>,
}

/// Decides which workers run. Nothing runs while the object is suspended or conflicts with an
/// older claim. A peer whose connection cannot be resolved (a Secret being rotated, say) keeps its
/// worker as it runs: only a worker whose configuration is known changes. Verify, then switch: a
/// running worker is replaced only once a trial verified the new configuration; until then, or
/// when it is refused, the worker keeps running on the configuration it has. A new peer starts
/// once its trial verified it, or could not finish (an unreachable peer starts, and says so as it
/// runs); a refused one does not start.
pub fn decide(facts: &Facts) -> Decision {
    let mut decision = Decision::default();
    if let Some(message) = &facts.conflict {
        decision.warnings.push(("Conflict".into(), message.clone()));
    }
    let may_run = facts.conflict.is_none() && !facts.suspend;
    let mut desired: BTreeMap<String, u64> = BTreeMap::new();
    if may_run {
        match &facts.local {
            Err((reason, message)) => decision.config_errors.push((reason.clone(), format!("localEtcd: {message}"))),
            Ok(()) => {
                for (peer, resolved) in &facts.peers {
                    match resolved {
                        Ok(fingerprint) => decide_peer(facts, peer, *fingerprint, &mut desired, &mut decision),
                        Err((reason, message)) => {
                            decision.config_errors.push((reason.clone(), format!("peer {peer}: {message}")))
                        }
                    }
                }
            }
        }
        for (peer, fingerprint) in &facts.running {
            if !desired.contains_key(peer) && facts.peers.iter().any(|(p, _)| p == peer) {
                desired.insert(peer.clone(), *fingerprint);
            }
        }
    }
    decision.warnings.extend(decision.config_errors.iter().cloned());
    decision.changes = worker_changes(&desired, &facts.running);
    decision
}

/// One resolved peer: which configuration its worker runs on, whether a trial is due, and what is
/// held.
fn decide_peer(facts: &Facts, peer: &str, fingerprint: u64, desired: &mut BTreeMap<String, u64>, d: &mut Decision) {
    let trial = facts.trials.get(peer).cloned().unwrap_or_default();
    match facts.running.get(peer) {
        Some(current) if *current == fingerprint => {
            desired.insert(peer.to_string(), fingerprint);
        }
        Some(current) => {
            let held = |refused, why: &Problem| HeldChange { peer: peer.to_string(), refused, why: why.clone() };
            match &trial {
                Trial::Verified => {
                    desired.insert(peer.to_string(), fingerprint);
                }
                Trial::Refused(why) => {
                    desired.insert(peer.to_string(), *current);
                    d.held.push(held(true, why));
                }
                Trial::Unverified(why) => {
                    desired.insert(peer.to_string(), *current);
                    d.held.push(held(false, why));
                }
                Trial::Untried | Trial::Running => {
                    desired.insert(peer.to_string(), *current);
                    if trial == Trial::Untried {
                        d.trials.push(peer.to_string());
                    }
                }
            }
        }
        // A configuration a worker already ran on (a new leader after a handoff) starts at once:
        // the successor renews the region's leases a trial sooner.
        None if facts.recorded.get(peer) == Some(&fingerprint) => {
            desired.insert(peer.to_string(), fingerprint);
        }
        None => match &trial {
            Trial::Verified | Trial::Unverified(_) => {
                desired.insert(peer.to_string(), fingerprint);
            }
            Trial::Refused((reason, message)) => {
                d.config_errors.push((reason.clone(), format!("peer {peer}: {message}")))
            }
            Trial::Untried => d.trials.push(peer.to_string()),
            Trial::Running => {}
        },
    }
}

/// What to do with one peer's worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkerChange {
    Start(String),
    /// Endpoints, TLS material or settings changed.
    Restart(String),
    /// The peer was removed (its mirror on that peer lapses with its lease), or nothing may run.
    Stop(String),
}

/// Compares the desired workers (peer -> fingerprint of its whole configuration) with the
/// running ones.
pub fn worker_changes(desired: &BTreeMap<String, u64>, running: &BTreeMap<String, u64>) -> Vec<WorkerChange> {
    let mut changes = Vec::new();
    for (peer, fingerprint) in desired {
        match running.get(peer) {
            None => changes.push(WorkerChange::Start(peer.clone())),
            Some(current) if current != fingerprint => changes.push(WorkerChange::Restart(peer.clone())),
            Some(_) => {}
        }
    }
    for peer in running.keys() {
        if !desired.contains_key(peer) {
            changes.push(WorkerChange::Stop(peer.clone()));
        }
    }
    changes
}

/// One RegionPeering's claim on a region of a local etcd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    /// namespace/name.
    pub object: String,
    pub region: String,
    pub endpoints: Vec<String>,
    /// RFC 3339 creation time; the oldest claim wins.
    pub created: String,
    /// The local etcd's cluster id, once known: two claims naming one etcd by different URLs
    /// (a Service name and a pod IP, say) are the same target.
    pub cluster_id: Option<u64>,
    /// It runs (its workers own the mirrors on the peers): it keeps running whatever the age of
    /// a claim that comes later.
    pub running: bool,
}

/// The order claims on one target are decided in: only a claim that runs (it owns the mirrors, or
/// is on its way to: trials, workers, a drain) keeps another from running, so an object that
/// cannot run (a planted one whose Secret or etcd is not there, a refused one) never blocks a
/// region; between two that run (they should not both), the oldest, then the name. Reconciles
/// run one at a time, so the first to be decided runs and the next sees it running: two objects
/// created in the same second, or applied together, are decided the same way everywhere, and the
/// one already running is never stopped for the other.
fn comes_first(other: (bool, &str, &str), me: (bool, &str, &str)) -> bool {
    let (other_running, other_created, other_object) = other;
    let (me_running, me_created, me_object) = me;
    other_running && (!me_running || (other_created, other_object) < (me_created, me_object))
}

impl Claim {
    fn same_target(&self, other: &Claim) -> bool {
        let norm = |e: &[String]| {
            let mut v: Vec<String> = e.iter().map(|s| s.trim_end_matches('/').to_string()).collect();
            v.sort();
            v
        };
        let same_cluster = matches!((self.cluster_id, other.cluster_id), (Some(a), Some(b)) if a == b);
        self.region == other.region
            && (same_cluster || norm(&self.endpoints).iter().any(|e| norm(&other.endpoints).contains(e)))
    }
}

/// Why `me` may not run: a claim on the same region of the same etcd that comes first (see
/// [`comes_first`]), if any.
pub fn conflict(me: &Claim, all: &[Claim]) -> Option<String> {
    let order = |c: &Claim| (!c.running, c.created.clone(), c.object.clone());
    all.iter()
        .filter(|other| other.object != me.object && other.same_target(me))
        .filter(|other| {
            comes_first((other.running, &other.created, &other.object), (me.running, &me.created, &me.object))
        })
        .min_by_key(|c| order(c))
        .map(|winner| {
            format!(
                "region {} on this etcd is already federated by {}; this object runs nothing until that one is deleted",
                me.region, winner.object
            )
        })
}

/// One RegistrySchema's claim on a region's legacy keys in a registry etcd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchemaClaim {
    /// namespace/name.
    pub object: String,
    pub region: String,
    pub endpoints: Vec<String>,
    pub legacy_prefix: String,
    /// RFC 3339 creation time; the oldest claim wins.
    pub created: String,
    /// Its drain runs (or ran, as its status says): it keeps running whatever comes later.
    pub running: bool,
}

/// Why RegistrySchema `me` may not drain: one migrating the same region of the same etcd that
/// comes first (see [`comes_first`]).
/// The v1 key of an endpoint does not name the legacy prefix, so two prefixes drained into one
/// region would map their endpoints onto the same v1 keys, and one of the two values would be
/// lost (and its legacy key deleted); the same prefix twice would race for its lock.
pub fn schema_conflict(me: &SchemaClaim, all: &[SchemaClaim]) -> Option<String> {
    let norm = |e: &[String]| e.iter().map(|s| s.trim_end_matches('/').to_string()).collect::<Vec<_>>();
    let mine = norm(&me.endpoints);
    let winner = all
        .iter()
        .filter(|o| o.object != me.object && o.region == me.region)
        .filter(|o| norm(&o.endpoints).iter().any(|e| mine.contains(e)))
        .filter(|o| comes_first((o.running, &o.created, &o.object), (me.running, &me.created, &me.object)))
        .min_by_key(|o| (!o.running, o.created.clone(), o.object.clone()))?;
    Some(if winner.legacy_prefix == me.legacy_prefix {
        format!(
            "legacy prefix {} of region {} on this etcd is already drained by {}; this object drains nothing until that one is deleted",
            me.legacy_prefix, me.region, winner.object
        )
    } else {
        format!(
            "region {} on this etcd is already migrated by {} from legacy prefix {}; draining {} too would map endpoints under both prefixes onto the same v1 keys and lose one of their values, so nothing of it is drained: move its keys under {}, or migrate it with that object deleted",
            me.region, winner.object, winner.legacy_prefix, me.legacy_prefix, winner.legacy_prefix
        )
    })
}

/// The etcd a RegistrySchema would drain, as a reconcile found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrainTarget {
    /// namespace/name of the RegistrySchema.
    pub object: String,
    pub region: String,
    pub endpoints: Vec<String>,
    pub cluster_id: u64,
    /// Who recorded a mirrored copy of the region in it, if it holds one.
    pub holds_copy: Option<String>,
}

/// A RegionPeering as a drain's check needs it: which region's origin it says which etcd is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeeringView {
    pub object: String,
    pub region: String,
    pub endpoints: Vec<String>,
    /// Its local etcd's cluster id, once known.
    pub cluster_id: Option<u64>,
}

/// Why a RegistrySchema may not drain into its etcd, before anything is read or written: the
/// etcd holds a copy of the region mirrored in from elsewhere (it is a peer's: the drain's v1
/// writes would be overwritten by the mirror, and its legacy deletes lose endpoints), or a
/// RegionPeering says the region's origin is another etcd, or this etcd is another region's.
pub fn drain_target_refusal(target: &DrainTarget, peerings: &[PeeringView]) -> Option<Problem> {
    let (object, region) = (&target.object, &target.region);
    if let Some(holder) = &target.holds_copy {
        return Some((
            "EtcdHoldsCopy".into(),
            format!(
                "spec.etcd reaches an etcd (cluster {:x}) that holds a copy of region {region} mirrored in from elsewhere (recorded by {holder}): it is a peer's etcd, not region {region}'s. Nothing was read or written; point RegistrySchema {object}'s spec.etcd at region {region}'s own etcd, or set spec.region to the region this etcd is the origin of",
                target.cluster_id
            ),
        ));
    }
    let norm = |e: &[String]| e.iter().map(|s| s.trim_end_matches('/').to_ascii_lowercase()).collect::<Vec<_>>();
    let same_etcd = |p: &PeeringView| match p.cluster_id {
        Some(id) => id == target.cluster_id,
        None => norm(&p.endpoints).iter().any(|e| norm(&target.endpoints).contains(e)),
    };
    let known = |p: &PeeringView| p.cluster_id.is_some() || same_etcd(p);
    if let Some(other) = peerings.iter().find(|p| p.region != *region && same_etcd(p)) {
        return Some((
            "EtcdOfAnotherRegion".into(),
            format!(
                "RegistrySchema {object} drains region {region} on etcd cluster {:x} ({:?}), but RegionPeering {} says that etcd is region {}'s origin: nothing was read or written. Set spec.region to {}, or point spec.etcd at region {region}'s own etcd",
                target.cluster_id, target.endpoints, other.object, other.region, other.region
            ),
        ));
    }
    let peerings_of_region: Vec<&PeeringView> = peerings.iter().filter(|p| p.region == *region).collect();
    if !peerings_of_region.is_empty()
        && peerings_of_region.iter().all(|p| known(p) && !same_etcd(p))
        && let Some(other) = peerings_of_region.first()
    {
        return Some((
            "NotTheRegionsEtcd".into(),
            format!(
                "RegistrySchema {object} drains region {region} on etcd cluster {:x} ({:?}), but RegionPeering {} says region {region}'s origin is etcd {}({:?}): nothing was read or written. Point spec.etcd at {:?}",
                target.cluster_id,
                target.endpoints,
                other.object,
                other.cluster_id.map(|id| format!("cluster {id:x} ")).unwrap_or_default(),
                other.endpoints,
                other.endpoints
            ),
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(peers: &[(&str, Result<u64, Problem>)], running: &[(&str, u64)]) -> Facts {
        Facts {
            peers: peers.iter().map(|(p, r)| (p.to_string(), r.clone())).collect(),
            running: running.iter().map(|(p, f)| (p.to_string(), *f)).collect(),
            ..Facts::default()
        }
    }

    #[test]
    fn every_resolved_peer_runs_a_worker_and_changed_ones_restart() {
        let all = facts(&[("b", Ok(1)), ("c", Ok(7))], &[("b", 1), ("c", 2), ("gone", 3)]);
        let d = decide(&tried(all, &[("c", Trial::Verified)]));
        assert_eq!(
            d.changes,
            vec![WorkerChange::Restart("c".into()), WorkerChange::Stop("gone".into())],
            "c's configuration changed and verified; gone left the spec"
        );
        assert!(d.config_errors.is_empty() && d.warnings.is_empty());
        let d = decide(&tried(facts(&[("b", Ok(1))], &[]), &[("b", Trial::Verified)]));
        assert_eq!(d.changes, vec![WorkerChange::Start("b".into())]);
    }

    fn tried(facts: Facts, trials: &[(&str, Trial)]) -> Facts {
        Facts { trials: trials.iter().map(|(p, t)| (p.to_string(), t.clone())).collect(), ..facts }
    }

    #[test]
    fn a_changed_peer_keeps_its_worker_until_a_trial_verified_the_change() {
        let changed = facts(&[("b", Ok(2))], &[("b", 1)]);
        // Not tried yet: tried now, and the worker runs on as it is.
        let d = decide(&changed);
        assert_eq!((d.changes.clone(), d.trials.clone()), (vec![], vec!["b".to_string()]));
        assert!(d.held.is_empty());
        assert!(decide(&tried(changed.clone(), &[("b", Trial::Running)])).changes.is_empty());
        // Verified: switched.
        let d = decide(&tried(changed.clone(), &[("b", Trial::Verified)]));
        assert_eq!(d.changes, vec![WorkerChange::Restart("b".into())]);
        // Refused: the worker keeps running, and the refusal is held.
        let why = ("DuplicatePeer".to_string(), "peers b and c are one etcd".to_string());
        let d = decide(&tried(changed.clone(), &[("b", Trial::Refused(why.clone()))]));
        assert!(d.changes.is_empty(), "{:?}", d.changes);
        assert_eq!(d.held, vec![HeldChange { peer: "b".into(), refused: true, why: why.clone() }]);
        assert!(d.config_errors.is_empty(), "the running configuration is fine");
        // Not known (the new endpoints do not answer): the worker keeps running, nothing is warned.
        let silent = ("Unreachable".to_string(), "no answer".to_string());
        let d = decide(&tried(changed, &[("b", Trial::Unverified(silent.clone()))]));
        assert!(d.changes.is_empty() && d.warnings.is_empty());
        assert_eq!(d.held, vec![HeldChange { peer: "b".into(), refused: false, why: silent }]);
    }

    #[test]
    fn a_new_peer_starts_once_tried_unless_refused_and_a_removed_one_stops_at_once() {
        let new = facts(&[("b", Ok(1))], &[]);
        assert_eq!(decide(&new).trials, vec!["b".to_string()]);
        assert!(decide(&new).changes.is_empty(), "nothing starts untried");
        assert_eq!(
            decide(&tried(new.clone(), &[("b", Trial::Verified)])).changes,
            vec![WorkerChange::Start("b".into())]
        );
        let silent = ("Unreachable".to_string(), "no answer".to_string());
        assert_eq!(
            decide(&tried(new.clone(), &[("b", Trial::Unverified(silent))])).changes,
            vec![WorkerChange::Start("b".into())],
            "an unreachable peer starts, and says so as it runs"
        );
        let why = ("LocalEtcdHoldsCopy".to_string(), "a peer's etcd".to_string());
        let d = decide(&tried(new, &[("b", Trial::Refused(why))]));
        assert!(d.changes.is_empty());
        assert_eq!(d.config_errors, vec![("LocalEtcdHoldsCopy".into(), "peer b: a peer's etcd".into())]);
        // Removing a peer needs no trial.
        let d = decide(&facts(&[], &[("b", 1)]));
        assert_eq!(d.changes, vec![WorkerChange::Stop("b".into())]);
    }

    #[test]
    fn a_new_leader_starts_the_workers_a_worker_ran_before_at_once_and_tries_anything_else() {
        // The leader before ran b on configuration 1 and c on 2 (their status says so); the spec
        // now asks for 1 and 3 (c's Secret was rotated meanwhile), and d is new.
        let mut f = facts(&[("b", Ok(1)), ("c", Ok(3)), ("d", Ok(4))], &[]);
        f.recorded = [("b".to_string(), 1), ("c".to_string(), 2)].into();
        let d = decide(&f);
        assert_eq!(d.changes, vec![WorkerChange::Start("b".into())], "b runs on what it ran, untried");
        assert_eq!(d.trials, vec!["c".to_string(), "d".to_string()], "a changed and a new configuration are tried");
        // Once running, b is left as it runs; nothing restarts it.
        f.running = [("b".to_string(), 1)].into();
        assert_eq!(decide(&f).changes, vec![], "{:?}", decide(&f));
    }

    #[test]
    fn an_unreadable_peer_keeps_its_worker_and_says_why() {
        let broken = Err(("SecretNotFound".to_string(), "Secret b-etcd not found".to_string()));
        let d = decide(&facts(&[("b", broken.clone()), ("c", Ok(1))], &[("b", 5), ("c", 1)]));
        assert!(d.changes.is_empty(), "b keeps running as it was: {:?}", d.changes);
        assert_eq!(d.config_errors, vec![("SecretNotFound".into(), "peer b: Secret b-etcd not found".into())]);
        assert_eq!(d.warnings, d.config_errors);
        // Not running yet: it waits for its configuration.
        let d = decide(&facts(&[("b", broken)], &[]));
        assert!(d.changes.is_empty());
    }

    #[test]
    fn an_unreadable_local_etcd_starts_nothing_and_stops_nothing() {
        let mut f = facts(&[("b", Ok(1)), ("c", Ok(2))], &[("b", 1)]);
        f.local = Err(("SecretInvalid".into(), "tls.crt is not PEM".into()));
        let d = decide(&f);
        assert!(d.changes.is_empty(), "{:?}", d.changes);
        assert_eq!(d.config_errors, vec![("SecretInvalid".into(), "localEtcd: tls.crt is not PEM".into())]);
    }

    #[test]
    fn a_suspended_or_conflicting_object_runs_nothing() {
        let mut f = facts(&[("b", Ok(1))], &[("b", 1)]);
        f.suspend = true;
        assert_eq!(decide(&f).changes, vec![WorkerChange::Stop("b".into())]);
        f.suspend = false;
        f.conflict = Some("region a on this etcd is already federated by ns/first".into());
        let d = decide(&f);
        assert_eq!(d.changes, vec![WorkerChange::Stop("b".into())]);
        assert_eq!(d.warnings, vec![("Conflict".into(), f.conflict.clone().unwrap())]);
        assert!(d.config_errors.is_empty(), "a conflict is not a configuration error");
    }

    #[test]
    fn spec_changes_map_to_worker_changes() {
        let running: BTreeMap<String, u64> = [("b".to_string(), 1), ("c".to_string(), 2)].into();
        let desired: BTreeMap<String, u64> = [("b".to_string(), 1), ("c".to_string(), 3), ("d".to_string(), 4)].into();
        assert_eq!(
            worker_changes(&desired, &running),
            vec![WorkerChange::Restart("c".into()), WorkerChange::Start("d".into())]
        );
        assert_eq!(
            worker_changes(&BTreeMap::new(), &running),
            vec![WorkerChange::Stop("b".into()), WorkerChange::Stop("c".into())]
        );
        assert!(worker_changes(&running, &running).is_empty());
    }

    fn claim(object: &str, region: &str, endpoint: &str, created: &str) -> Claim {
        Claim {
            object: object.into(),
            region: region.into(),
            endpoints: vec![endpoint.into()],
            created: created.into(),
            cluster_id: None,
            running: false,
        }
    }

    #[test]
    fn the_claim_that_runs_keeps_running_whatever_comes_later() {
        // Created in the same second; the one whose name sorts last happened to start first.
        let first = Claim { running: true, ..claim("ns/zz", "a", "http://e:1", "2026-01-01T00:00:00Z") };
        let second = claim("ns/aa", "a", "http://e:1", "2026-01-01T00:00:00Z");
        let all = vec![first.clone(), second.clone()];
        assert_eq!(conflict(&first, &all), None, "the running one keeps running");
        assert!(conflict(&second, &all).unwrap().contains("ns/zz"));
        // Even an older claim that comes later does not stop it.
        let older = claim("ns/old", "a", "http://e:1", "2025-01-01T00:00:00Z");
        assert_eq!(conflict(&first, &[first.clone(), older.clone()]), None);
        assert!(conflict(&older, &[first.clone(), older.clone()]).unwrap().contains("ns/zz"));
        // A claim that does not run blocks nothing: the first to be decided runs.
        let idle = Claim { running: false, ..first.clone() };
        assert!(conflict(&second, &[idle.clone(), second.clone()]).is_none());
        assert!(conflict(&idle, &[idle.clone(), second.clone()]).is_none());
    }

    #[test]
    fn of_two_running_claims_on_a_region_and_etcd_the_oldest_wins() {
        let first = Claim { running: true, ..claim("ns/first", "a", "http://e:1", "2026-01-01T00:00:00Z") };
        let second = Claim { running: true, ..claim("ns/second", "a", "http://e:1/", "2026-01-02T00:00:00Z") };
        let other_region = claim("ns/other", "b", "http://e:1", "2025-01-01T00:00:00Z");
        let other_etcd = claim("ns/elsewhere", "a", "http://f:1", "2025-01-01T00:00:00Z");
        let all = vec![first.clone(), second.clone(), other_region, other_etcd];
        assert_eq!(conflict(&first, &all), None);
        assert!(conflict(&second, &all).unwrap().contains("ns/first"));
    }

    fn schema(object: &str, region: &str, endpoint: &str, prefix: &str, created: &str) -> SchemaClaim {
        SchemaClaim {
            object: object.into(),
            region: region.into(),
            endpoints: vec![endpoint.into()],
            legacy_prefix: prefix.into(),
            created: created.into(),
            running: false,
        }
    }

    #[test]
    fn a_running_drain_keeps_its_region_against_a_claim_created_in_the_same_second() {
        let running =
            SchemaClaim { running: true, ..schema("ns/zz", "a", "http://e:1", "/r/", "2026-01-01T00:00:00Z") };
        let later = schema("ns/aa", "a", "http://e:1", "/r/", "2026-01-01T00:00:00Z");
        let all = vec![running.clone(), later.clone()];
        assert_eq!(schema_conflict(&running, &all), None);
        assert!(schema_conflict(&later, &all).unwrap().contains("already drained by ns/zz"));
    }

    #[test]
    fn a_second_legacy_prefix_drained_into_the_same_region_is_refused_naming_both() {
        let first = SchemaClaim {
            running: true,
            ..schema("ns/registry", "a", "http://e:1", "/registry/", "2026-01-01T00:00:00Z")
        };
        let second = schema("ns/old", "a", "http://e:1/", "/old-registry/", "2026-01-02T00:00:00Z");
        let all = vec![first.clone(), second.clone()];
        assert_eq!(schema_conflict(&first, &all), None, "the oldest drains");
        let refused = schema_conflict(&second, &all).expect("refused");
        for said in ["ns/registry", "/registry/", "/old-registry/", "same v1 keys"] {
            assert!(refused.contains(said), "{said:?} missing from {refused:?}");
        }
        // The same prefix twice: refused too, naming the one that drains it.
        let again = schema("ns/again", "a", "http://e:1", "/registry/", "2026-01-03T00:00:00Z");
        let refused = schema_conflict(&again, &[first.clone(), again.clone()]).expect("refused");
        assert!(refused.contains("already drained by ns/registry"), "{refused}");
        // Another region, or another etcd, is no conflict: their v1 keys differ.
        let other_region = schema("ns/b", "b", "http://e:1", "/old-registry/", "2026-01-02T00:00:00Z");
        let other_etcd = schema("ns/f", "a", "http://f:1", "/old-registry/", "2026-01-02T00:00:00Z");
        assert_eq!(schema_conflict(&other_region, &[first.clone(), other_region.clone()]), None);
        assert_eq!(schema_conflict(&other_etcd, &[first, other_etcd.clone()]), None);
    }

    fn target(region: &str, holds_copy: Option<&str>) -> DrainTarget {
        DrainTarget {
            object: "ns/registry".into(),
            region: region.into(),
            endpoints: vec!["http://etcd-a:2379".into()],
            cluster_id: 0xa,
            holds_copy: holds_copy.map(String::from),
        }
    }

    fn view(object: &str, region: &str, endpoint: &str, cluster_id: Option<u64>) -> PeeringView {
        PeeringView { object: object.into(), region: region.into(), endpoints: vec![endpoint.into()], cluster_id }
    }

    #[test]
    fn a_drain_is_refused_on_an_etcd_that_is_not_its_regions_origin_naming_both() {
        // Region b on a's etcd, where b's copy lives: the record of the copy says so.
        let (reason, message) = drain_target_refusal(&target("b", Some("RegionPeering ns/b")), &[]).expect("refused");
        assert_eq!(reason, "EtcdHoldsCopy");
        assert!(message.contains("RegionPeering ns/b") && message.contains("spec.etcd"), "{message}");
        // A RegionPeering says a's etcd is a's: draining b there is refused.
        let a = view("ns/a", "a", "http://etcd-a:2379/", Some(0xa));
        let (reason, message) = drain_target_refusal(&target("b", None), std::slice::from_ref(&a)).expect("refused");
        assert_eq!(reason, "EtcdOfAnotherRegion");
        assert!(message.contains("ns/a") && message.contains("ns/registry"), "{message}");
        // Region a, but a RegionPeering says a's origin is another etcd.
        let elsewhere = view("ns/a", "a", "http://etcd-x:2379", Some(0xf));
        let (reason, message) = drain_target_refusal(&target("a", None), &[elsewhere]).expect("refused");
        assert_eq!(reason, "NotTheRegionsEtcd");
        assert!(message.contains("etcd-x") && message.contains("etcd-a"), "{message}");
        // The region's own etcd, by id or by URL; or no RegionPeering at all: drained.
        assert_eq!(drain_target_refusal(&target("a", None), &[a]), None);
        assert_eq!(drain_target_refusal(&target("a", None), &[view("ns/a", "a", "http://etcd-a:2379", None)]), None);
        assert_eq!(drain_target_refusal(&target("a", None), &[]), None);
        // Not known (another URL, its id not seen yet): not refused on a guess.
        assert_eq!(drain_target_refusal(&target("a", None), &[view("ns/a", "a", "http://10.0.0.7:2379", None)]), None);
    }

    #[test]
    fn one_etcd_under_two_urls_is_one_target() {
        let mut first =
            Claim { running: true, ..claim("ns/first", "a", "http://etcd.svc:2379", "2026-01-01T00:00:00Z") };
        let mut second = claim("ns/second", "a", "http://10.0.0.7:2379", "2026-01-02T00:00:00Z");
        assert_eq!(conflict(&second, &[first.clone(), second.clone()]), None, "unknown ids: URLs decide");
        first.cluster_id = Some(42);
        second.cluster_id = Some(42);
        assert!(conflict(&second, &[first.clone(), second.clone()]).unwrap().contains("ns/first"));
        second.cluster_id = Some(43);
        assert_eq!(conflict(&second, &[first.clone(), second.clone()]), None);
    }
}
