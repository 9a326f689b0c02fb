//! The trials of peers' configurations that the RegionPeering reconciler runs beside its workers:
//! verify, then switch. `mirror::trial` does the checking; `plan::decide` decides from where each
//! trial stands; this keeps them between reconciles, tries a verdict again once it is old enough
//! (a refusal may be fixed outside the spec: a role granted on the peer, a CA replaced), and says
//! what a held change is in terms a person can undo.
use super::etcd_access::Described;
use super::plan::{HeldChange, Trial};
use crate::api::RegionPeeringSpec;
use crate::mirror::trial::{Verdict, try_configuration};
use crate::mirror::{EtcdTarget, MirrorConfig};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a refusal stands before the configuration is tried again.
pub const RETRY_REFUSED: Duration = Duration::from_secs(30);
/// How long "not known" stands before the configuration is tried again.
pub const RETRY_UNVERIFIED: Duration = Duration::from_secs(10);

type Verdicts = Arc<Mutex<Option<(Verdict, Instant)>>>;

struct Run {
    fingerprint: u64,
    /// The last verdict and when it came; kept while the same configuration is tried again.
    verdict: Verdicts,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Run {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The trials, by (object, peer).
#[derive(Default)]
pub struct Trials {
    runs: Mutex<HashMap<(String, String), Run>>,
}

impl Trials {
    fn runs(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Run>> {
        self.runs.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Where the trial of `fingerprint` stands for this peer; a trial of another configuration
    /// is dropped (the spec moved on).
    pub fn state(&self, object: &str, peer: &str, fingerprint: u64) -> Trial {
        let mut runs = self.runs();
        let key = (object.to_string(), peer.to_string());
        let Some(run) = runs.get(&key) else { return Trial::Untried };
        if run.fingerprint != fingerprint {
            runs.remove(&key);
            return Trial::Untried;
        }
        let verdict = run.verdict.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        match verdict {
            None => Trial::Running,
            Some((Verdict::Verified, _)) => Trial::Verified,
            Some((Verdict::Refused { reason, message }, _)) => Trial::Refused((reason, message)),
            Some((Verdict::Unverified { reason, message }, _)) => Trial::Unverified((reason, message)),
        }
    }

    /// Whether the trial of `fingerprint` has a verdict old enough to try the configuration
    /// again (a verified one is used at once, never tried again).
    pub fn due_again(&self, object: &str, peer: &str, fingerprint: u64) -> bool {
        let runs = self.runs();
        let Some(run) = runs.get(&(object.to_string(), peer.to_string())) else { return false };
        let verdict = run.verdict.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        run.fingerprint == fingerprint
            && run.task.is_finished()
            && match verdict.as_ref() {
                Some((Verdict::Refused { .. }, at)) => at.elapsed() >= RETRY_REFUSED,
                Some((Verdict::Unverified { .. }, at)) => at.elapsed() >= RETRY_UNVERIFIED,
                _ => false,
            }
    }

    /// Tries `config` on the two etcds; the last verdict of the same configuration stands until
    /// the new one comes.
    pub fn start(&self, object: &str, fingerprint: u64, config: MirrorConfig, local: EtcdTarget, peer: EtcdTarget) {
        let key = (object.to_string(), config.peer.clone());
        let mut runs = self.runs();
        let verdict: Verdicts = match runs.get(&key) {
            Some(run) if run.fingerprint == fingerprint => run.verdict.clone(),
            _ => Arc::new(Mutex::new(None)),
        };
        let into = verdict.clone();
        let span = tracing::info_span!("trial", region = %config.origin, peer = %config.peer);
        let task = tokio::spawn(tracing::Instrument::instrument(
            async move {
                let found = try_configuration(&config, &local, &peer).await;
                match &found {
                    Verdict::Verified => tracing::info!("the configuration verified"),
                    Verdict::Refused { reason, message } => {
                        tracing::warn!(reason, message, "the configuration is refused")
                    }
                    Verdict::Unverified { reason, message } => {
                        tracing::info!(reason, message, "the configuration could not be verified yet")
                    }
                }
                *into.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some((found, Instant::now()));
            },
            span,
        ));
        runs.insert(key, Run { fingerprint, verdict, task });
    }

    /// The peer's worker runs on its configuration now (or the peer is gone): its trial is done.
    pub fn forget(&self, object: &str, peer: &str) {
        self.runs().remove(&(object.to_string(), peer.to_string()));
    }

    /// Whether any of the object's peers is being tried: it was decided to run.
    pub fn has_object(&self, object: &str) -> bool {
        self.runs().keys().any(|(o, _)| o == object)
    }

    pub fn forget_object(&self, object: &str) {
        self.runs().retain(|(o, _), _| o != object);
    }
}

/// A worker's configuration as a person names it: both connections and the settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    pub local: Described,
    pub peer: Described,
    /// `spec.lease`, `spec.sync` and `spec.failureDetector`, each as JSON.
    pub settings: Vec<(&'static str, String)>,
}

impl Applied {
    pub fn of(spec: &RegionPeeringSpec, local: &Described, peer: &Described) -> Applied {
        let json = |v: serde_json::Result<String>| v.unwrap_or_default();
        Applied {
            local: local.clone(),
            peer: peer.clone(),
            settings: vec![
                ("spec.lease", json(serde_json::to_string(&spec.lease))),
                ("spec.sync", json(serde_json::to_string(&spec.sync))),
                ("spec.failureDetector", json(serde_json::to_string(&spec.failure_detector))),
            ],
        }
    }
}

/// A held change as status and events say it: the fields that changed with both sides, why it is
/// held, that the peer keeps running, and how to undo it.
pub fn explain(held: &HeldChange, running: &Applied, asked: &Applied) -> HeldChange {
    let peer_field = format!("spec.peers[{}]", held.peer);
    let mut changes = asked.local.changes_from(&running.local, "spec.localEtcd");
    changes.extend(asked.peer.changes_from(&running.peer, &peer_field));
    let mut undo = running.local.undo(&asked.local, "spec.localEtcd");
    undo.extend(running.peer.undo(&asked.peer, &peer_field));
    for ((field, was), (_, now)) in running.settings.iter().zip(&asked.settings) {
        if was != now {
            changes.push(format!("{field}: {was} -> {now}"));
            undo.push(format!("set {field} back to {was}"));
        }
    }
    if changes.is_empty() {
        changes.push("its configuration".into());
    }
    let (reason, why) = &held.why;
    let message = if held.refused {
        format!(
            "{}: refused: {why}. Peer {} keeps running on its previous configuration; to undo: {}",
            changes.join(", "),
            held.peer,
            if undo.is_empty() { "revert the change".to_string() } else { undo.join("; ") }
        )
    } else {
        format!(
            "{}: not verified yet ({why}); peer {} keeps running on its previous configuration until it is",
            changes.join(", "),
            held.peer
        )
    };
    HeldChange { peer: held.peer.clone(), refused: held.refused, why: (reason.clone(), message) }
}

/// The configuration a trial tries: the worker's, under a name of its own.
pub fn trial_config(mut config: MirrorConfig) -> MirrorConfig {
    config.owner_id = format!("{}/trial", config.owner_id);
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    fn described(endpoints: &[&str]) -> Described {
        Described { endpoints: endpoints.iter().map(|e| e.to_string()).collect(), ..Described::default() }
    }

    #[test]
    fn a_refused_change_names_both_sides_and_the_way_back() {
        let spec: RegionPeeringSpec = serde_json::from_value(serde_json::json!({
            "region": "a", "localEtcd": {"endpoints": ["http://a:2379"]}, "peers": []
        }))
        .unwrap();
        let running = Applied::of(&spec, &described(&["http://a:2379"]), &described(&["http://b:2379"]));
        let mut raised = spec.clone();
        raised.lease.ttl_seconds = 60;
        let asked = Applied::of(&raised, &described(&["http://a:2379"]), &described(&["http://c:2379"]));
        let held = HeldChange {
            peer: "b".into(),
            refused: true,
            why: ("DuplicatePeer".into(), "peers c and b are one etcd".into()),
        };
        let said = explain(&held, &running, &asked);
        assert_eq!(said.why.0, "DuplicatePeer");
        for part in [
            r#"spec.peers[b].endpoints: ["http://b:2379"] -> ["http://c:2379"]"#,
            "spec.lease: {\"ttlSeconds\":30",
            "-> {\"ttlSeconds\":60",
            "refused: peers c and b are one etcd",
            "Peer b keeps running on its previous configuration",
            r#"to undo: set spec.peers[b].endpoints back to ["http://b:2379"]; set spec.lease back to {"ttlSeconds":30"#,
        ] {
            assert!(said.why.1.contains(part), "{part:?} missing from {}", said.why.1);
        }
        let waiting = explain(&HeldChange { refused: false, ..held }, &running, &asked);
        assert!(waiting.why.1.contains("not verified yet"), "{}", waiting.why.1);
    }
}
