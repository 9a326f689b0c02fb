//! Turning a RegionPeering spec into worker changes, and resolving region claims, without IO.
use std::collections::BTreeMap;

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

/// Why `me` may not run: an older claim on the same region of the same etcd, if any.
pub fn conflict(me: &Claim, all: &[Claim]) -> Option<String> {
    all.iter()
        .filter(|other| other.object != me.object && other.same_target(me))
        .filter(|other| (&other.created, &other.object) < (&me.created, &me.object))
        .min_by(|a, b| (&a.created, &a.object).cmp(&(&b.created, &b.object)))
        .map(|winner| {
            format!(
                "region {} on this etcd is already federated by {}; this object runs nothing until that one is deleted",
                me.region, winner.object
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        }
    }

    #[test]
    fn the_oldest_claim_on_a_region_and_etcd_wins() {
        let first = claim("ns/first", "a", "http://e:1", "2026-01-01T00:00:00Z");
        let second = claim("ns/second", "a", "http://e:1/", "2026-01-02T00:00:00Z");
        let other_region = claim("ns/other", "b", "http://e:1", "2025-01-01T00:00:00Z");
        let other_etcd = claim("ns/elsewhere", "a", "http://f:1", "2025-01-01T00:00:00Z");
        let all = vec![first.clone(), second.clone(), other_region, other_etcd];
        assert_eq!(conflict(&first, &all), None);
        assert!(conflict(&second, &all).unwrap().contains("ns/first"));
    }

    #[test]
    fn one_etcd_under_two_urls_is_one_target() {
        let mut first = claim("ns/first", "a", "http://etcd.svc:2379", "2026-01-01T00:00:00Z");
        let mut second = claim("ns/second", "a", "http://10.0.0.7:2379", "2026-01-02T00:00:00Z");
        assert_eq!(conflict(&second, &[first.clone(), second.clone()]), None, "unknown ids: URLs decide");
        first.cluster_id = Some(42);
        second.cluster_id = Some(42);
        assert!(conflict(&second, &[first.clone(), second.clone()]).unwrap().contains("ns/first"));
        second.cluster_id = Some(43);
        assert_eq!(conflict(&second, &[first.clone(), second.clone()]), None);
    }
}
