//! How a session starts, without IO: whether this worker may write (ownership), and from where
//! it resumes. Every session decides both afresh from what the peer records and what the origin
//! says now, never from memory alone: a peer restored from a backup, an origin restored or
//! replaced, or a successor that came and went are all seen this way.
use crate::mirror::health::ResyncCause;
use crate::mirror::records::checkpoint::{Checkpoint, Owner, Progress};

/// The owner record as read from the peer: its mod revision and its decoded value (None when the
/// value is not an owner record).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnerRecord {
    pub mod_revision: i64,
    pub owner: Option<Owner>,
}

/// What this worker knows of its own ownership.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ownership {
    /// The owner key's mod revision this worker last wrote (its last session's epoch).
    pub epoch: Option<i64>,
    /// The generation this worker owns under.
    pub generation: u64,
    /// Take over even from a newer owner: the worker stood by and nobody else keeps the mirror.
    pub take_over: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OwnerDecision {
    /// Write the owner record with this generation; its mod revision is the new epoch.
    Take { generation: u64, restored: bool },
    /// Someone else owns the mirror now.
    Fenced { by: String },
    /// The mirror was retired from the peer (its RegionPeering deleted) after this worker owned
    /// it: it never takes it back.
    Retired { by: String },
}

/// Whether to take (or keep) ownership in a new session.
pub fn decide_ownership(me: &str, mine: &Ownership, record: Option<&OwnerRecord>) -> OwnerDecision {
    let Some(record) = record else {
        // Nobody owns it (first start, the key was deleted, or a restore from before any owner).
        return OwnerDecision::Take { generation: mine.generation.max(1), restored: mine.epoch.is_some() };
    };
    let theirs = record.owner.as_ref();
    let generation = theirs.map_or(0, |o| o.generation);
    if let Some(tombstone) = theirs.filter(|o| o.retired)
        && mine.epoch.is_some()
    {
        return OwnerDecision::Retired { by: tombstone.owner.clone() };
    }
    if mine.epoch == Some(record.mod_revision) {
        return OwnerDecision::Take { generation: mine.generation, restored: false };
    }
    if mine.epoch.is_none() || mine.take_over {
        return OwnerDecision::Take { generation: generation + 1, restored: false };
    }
    // We owned it and the record changed: our own older record, or an older generation, is a
    // restore of the peer; anything else is a successor.
    let ours = theirs.is_some_and(|o| o.owner == me);
    if ours || (theirs.is_some() && generation < mine.generation) {
        return OwnerDecision::Take { generation: mine.generation, restored: true };
    }
    OwnerDecision::Fenced {
        by: theirs.map(|o| o.owner.clone()).unwrap_or_else(|| "an unreadable owner record".to_string()),
    }
}

/// The origin as it answers now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OriginStatus {
    pub cluster_id: u64,
    pub revision: i64,
}

/// Where a session resumes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resume {
    /// One lease per shard, 0 where the recorded lease is gone (empty: no layout yet).
    pub leases: Vec<i64>,
    /// The recorded split layout (empty: uniform).
    pub slots: Vec<crate::mirror::leases::shards::Slot>,
    pub keys: Vec<i64>,
    /// Leases of an earlier layout that are still alive and may hold keys.
    pub retiring: Vec<i64>,
    /// The origin revision the peer holds completely (meaningless when `resync` is set).
    pub applied: i64,
    pub resync: Option<ResyncCause>,
}

/// Resumes from the peer's records. `alive[i]` says whether `checkpoint.leases[i]` is alive;
/// `retiring` are the leases that may hold keys outside the layout (the checkpoint's retiring
/// ones, or the leases of the peer's keys when there is no checkpoint), each with whether it is
/// alive. `pending` is a resync this worker still owes (one cut short). `synced_before`: this
/// worker had the peer synced in an earlier session, so a peer without records lost them.
pub fn decide_resume(
    checkpoint: Option<&Checkpoint>,
    progress: Option<&Progress>,
    alive: &[bool],
    retiring: &[(i64, bool)],
    origin: OriginStatus,
    pending: Option<ResyncCause>,
    synced_before: bool,
) -> Resume {
    let initial = pending.unwrap_or(ResyncCause::Initial);
    // Kept alive until a sync has moved their keys, and recorded so that a successor does too.
    let retiring: Vec<i64> = retiring.iter().filter(|(_, alive)| *alive).map(|(id, _)| *id).collect();
    let Some(cp) = checkpoint.filter(|cp| !cp.leases.is_empty()) else {
        return Resume {
            leases: Vec::new(),
            slots: Vec::new(),
            keys: Vec::new(),
            retiring,
            applied: 0,
            resync: Some(pending.unwrap_or(if synced_before {
                ResyncCause::RecordsLost
            } else {
                ResyncCause::Initial
            })),
        };
    };
    let leases: Vec<i64> = cp
        .leases
        .iter()
        .zip(alive.iter().chain(std::iter::repeat(&false)))
        .map(|(id, a)| if *a { *id } else { 0 })
        .collect();
    let keys = if cp.keys.len() == leases.len() { cp.keys.clone() } else { vec![0; leases.len()] };
    let recorded = progress.map_or(cp.revision, |p| p.revision.max(cp.revision));
    let origin_changed =
        (cp.origin_cluster_id != 0 && cp.origin_cluster_id != origin.cluster_id) || origin.revision < recorded;
    let resync = if origin_changed {
        Some(ResyncCause::OriginChanged)
    } else if leases.contains(&0) {
        Some(ResyncCause::LeaseLost)
    } else if !cp.synced || cp.revision <= 0 {
        Some(initial)
    } else {
        pending
    };
    Resume {
        leases,
        slots: cp.slots.clone(),
        keys,
        retiring,
        applied: if resync.is_some() { 0 } else { recorded },
        resync,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(name: &str, generation: u64) -> Option<Owner> {
        Some(Owner { owner: name.into(), acquired_at: "t".into(), generation, retired: false })
    }

    fn record(mod_revision: i64, name: &str, generation: u64) -> OwnerRecord {
        OwnerRecord { mod_revision, owner: owner(name, generation) }
    }

    #[test]
    fn a_first_session_takes_the_next_generation() {
        let mine = Ownership::default();
        assert_eq!(decide_ownership("me", &mine, None), OwnerDecision::Take { generation: 1, restored: false });
        assert_eq!(
            decide_ownership("me", &mine, Some(&record(5, "old", 7))),
            OwnerDecision::Take { generation: 8, restored: false }
        );
    }

    #[test]
    fn every_later_session_keeps_its_generation_while_the_record_is_its_own() {
        let mine = Ownership { epoch: Some(5), generation: 8, take_over: false };
        assert_eq!(
            decide_ownership("me", &mine, Some(&record(5, "me", 8))),
            OwnerDecision::Take { generation: 8, restored: false }
        );
    }

    #[test]
    fn a_successor_fences_and_a_rolled_back_record_does_not() {
        let mine = Ownership { epoch: Some(5), generation: 8, take_over: false };
        assert_eq!(
            decide_ownership("me", &mine, Some(&record(9, "next", 9))),
            OwnerDecision::Fenced { by: "next".into() }
        );
        // A restore of the peer brings back our own older record, or a predecessor's.
        assert_eq!(
            decide_ownership("me", &mine, Some(&record(3, "me", 8))),
            OwnerDecision::Take { generation: 8, restored: true }
        );
        assert_eq!(
            decide_ownership("me", &mine, Some(&record(3, "old", 7))),
            OwnerDecision::Take { generation: 8, restored: true }
        );
        assert_eq!(decide_ownership("me", &mine, None), OwnerDecision::Take { generation: 8, restored: true });
        let garbage = OwnerRecord { mod_revision: 9, owner: None };
        assert!(matches!(decide_ownership("me", &mine, Some(&garbage)), OwnerDecision::Fenced { .. }));
    }

    #[test]
    fn a_tombstone_stops_a_worker_that_owned_the_mirror_and_yields_to_a_new_one() {
        let tombstone = OwnerRecord {
            mod_revision: 9,
            owner: Some(Owner { owner: "retired".into(), acquired_at: "t".into(), generation: 4, retired: true }),
        };
        let standing_by = Ownership { epoch: Some(5), generation: 3, take_over: true };
        assert_eq!(
            decide_ownership("me", &standing_by, Some(&tombstone)),
            OwnerDecision::Retired { by: "retired".into() }
        );
        assert_eq!(
            decide_ownership("new", &Ownership::default(), Some(&tombstone)),
            OwnerDecision::Take { generation: 5, restored: false }
        );
    }

    #[test]
    fn taking_over_after_standing_by_outranks_the_record() {
        let mine = Ownership { epoch: Some(5), generation: 8, take_over: true };
        assert_eq!(
            decide_ownership("me", &mine, Some(&record(9, "ghost", 1000))),
            OwnerDecision::Take { generation: 1001, restored: false }
        );
    }

    fn cp(revision: i64, leases: Vec<i64>, synced: bool, cluster: u64) -> Checkpoint {
        Checkpoint {
            owner: "w".into(),
            revision,
            keys: vec![1; leases.len()],
            leases,
            slots: vec![],
            synced,
            retiring: vec![],
            origin_cluster_id: cluster,
            parts: None,
        }
    }

    const ORIGIN: OriginStatus = OriginStatus { cluster_id: 7, revision: 100 };

    #[test]
    fn resumes_from_the_newest_record_the_peer_holds() {
        let c = cp(40, vec![11, 12], true, 7);
        let p = Progress { owner: "w".into(), revision: 60 };
        let r = decide_resume(Some(&c), Some(&p), &[true, true], &[], ORIGIN, None, false);
        assert_eq!((r.applied, r.resync, r.leases), (60, None, vec![11, 12]));
    }

    #[test]
    fn nothing_recorded_or_an_unfinished_sync_means_a_sync() {
        let r = decide_resume(None, None, &[], &[], ORIGIN, None, false);
        assert_eq!((r.resync, r.leases.len()), (Some(ResyncCause::Initial), 0));
        let c = cp(40, vec![11], false, 7);
        let r = decide_resume(Some(&c), None, &[true], &[], ORIGIN, Some(ResyncCause::Compacted), false);
        assert_eq!(r.resync, Some(ResyncCause::Compacted));
    }

    #[test]
    fn a_lost_lease_is_zeroed_and_resynced() {
        let c = cp(40, vec![11, 12], true, 7);
        let r = decide_resume(Some(&c), None, &[true, false], &[], ORIGIN, None, false);
        assert_eq!((r.leases, r.resync), (vec![11, 0], Some(ResyncCause::LeaseLost)));
    }

    #[test]
    fn a_restored_or_replaced_origin_is_resynced() {
        let c = cp(40, vec![11], true, 7);
        let other = OriginStatus { cluster_id: 8, revision: 1000 };
        assert_eq!(
            decide_resume(Some(&c), None, &[true], &[], other, None, false).resync,
            Some(ResyncCause::OriginChanged)
        );
        let behind = OriginStatus { cluster_id: 7, revision: 30 };
        assert_eq!(
            decide_resume(Some(&c), None, &[true], &[], behind, None, false).resync,
            Some(ResyncCause::OriginChanged)
        );
        // A checkpoint from before cluster ids were recorded trusts the revision alone.
        let legacy = cp(40, vec![11], true, 0);
        assert_eq!(decide_resume(Some(&legacy), None, &[true], &[], other, None, false).resync, None);
    }

    #[test]
    fn only_live_retiring_leases_are_kept() {
        let mut c = cp(40, vec![11], true, 7);
        c.retiring = vec![5, 6];
        let r = decide_resume(Some(&c), None, &[true], &[(5, false), (6, true)], ORIGIN, None, false);
        assert_eq!(r.retiring, vec![6]);
        // Without a checkpoint, the live leases the peer's keys are on are kept as retiring.
        let r = decide_resume(None, None, &[], &[(8, true), (9, false)], ORIGIN, None, false);
        assert_eq!((r.retiring, r.resync), (vec![8], Some(ResyncCause::Initial)));
        // A peer that lost the records of a mirror this worker had synced: counted as such.
        let r = decide_resume(None, None, &[], &[], ORIGIN, None, true);
        assert_eq!(r.resync, Some(ResyncCause::RecordsLost));
        let c = cp(40, vec![11], true, 7);
        assert_eq!(
            decide_resume(Some(&c), None, &[true], &[], ORIGIN, None, true).resync,
            None,
            "records there: no resync"
        );
    }
}
