//! How a session starts, without IO: whether this worker may write (ownership), and from where
//! it resumes. Every session decides both afresh from what the peer records and what the origin
//! says now, never from memory alone: a peer restored from a backup, an origin restored or
//! replaced, or a successor that came and went are all seen this way.
use crate::mirror::health::{Refusal, ResyncCause};
use crate::mirror::records::checkpoint::{Checkpoint, Owner, OwningObject, Progress};

/// The owner record as read from the peer: its mod revision and its decoded value (None when the
/// value is not an owner record).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnerRecord {
    pub mod_revision: i64,
    pub owner: Option<Owner>,
}

/// Whether the owner record names someone other than `owner_id`: another process (an operator
/// Pod that led before, or one still running), whose last Txns this session's takeover fenced.
/// A record that does not decode is someone else's too. No record: nobody wrote the mirror.
pub fn taken_from_another(record: Option<&OwnerRecord>, owner_id: &str) -> bool {
    record.is_some_and(|r| r.owner.as_ref().is_none_or(|o| o.owner != owner_id))
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

/// Who claims the mirror in a session: this worker, the object it mirrors for, and its name for
/// the peer.
#[derive(Clone, Copy, Debug)]
pub struct Claimant<'a> {
    pub owner_id: &'a str,
    /// None for a worker run without an object (compatible with every record).
    pub object: Option<&'a OwningObject>,
    pub peer: &'a str,
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
    /// Another claim owns it: refused while that owner's leases live (see [`decide_contest`]),
    /// taken over (with this generation) once they have lapsed.
    Contested { contest: Contest, generation: u64 },
}

/// A claim on this origin's mirror on this peer that is not this worker's object's own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Contest {
    /// Another object claims the region: a duplicate RegionPeering, here or in another
    /// Kubernetes cluster, or two origin etcds both configured as this region.
    DuplicateOrigin { owner: Owner },
    /// This object already mirrors into this etcd under another peer name: one etcd listed
    /// twice in `spec.peers`.
    DuplicatePeer { other_peer: String },
}

/// Whether two owners are of one object: the same UID, or either not known (records of earlier
/// versions, workers run without an object).
fn same_object(a: Option<&OwningObject>, b: Option<&OwningObject>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a.uid == b.uid,
        _ => true,
    }
}

/// Whether to take (or keep) ownership in a new session.
pub fn decide_ownership(me: &Claimant, mine: &Ownership, record: Option<&OwnerRecord>) -> OwnerDecision {
    let Some(record) = record else {
        // Nobody owns it (first start, the key was deleted, or a restore from before any owner).
        return OwnerDecision::Take { generation: mine.generation.max(1), restored: mine.epoch.is_some() };
    };
    let theirs = record.owner.as_ref();
    let generation = theirs.map_or(0, |o| o.generation);
    let ours_still = mine.epoch == Some(record.mod_revision);
    if let Some(owner) = theirs.filter(|_| !ours_still) {
        let same = same_object(me.object, owner.object.as_ref());
        if owner.retired {
            // A tombstone of this object stops a worker that owned the mirror; a tombstone of
            // another object (deleted) leaves the mirror to whoever claims it now.
            if same && mine.epoch.is_some() {
                return OwnerDecision::Retired { by: owner.owner.clone() };
            }
            return OwnerDecision::Take { generation: generation + 1, restored: false };
        }
        if !same {
            return OwnerDecision::Contested {
                contest: Contest::DuplicateOrigin { owner: owner.clone() },
                generation: generation.max(mine.generation) + 1,
            };
        }
        if !owner.released && !owner.peer.is_empty() && owner.peer != me.peer {
            return OwnerDecision::Contested {
                contest: Contest::DuplicatePeer { other_peer: owner.peer.clone() },
                generation: generation.max(mine.generation) + 1,
            };
        }
        if owner.released {
            // Its owner stopped cleanly and renews nothing: take over now, before anything lapses.
            return OwnerDecision::Take { generation: generation.max(mine.generation) + 1, restored: false };
        }
    }
    if ours_still {
        return OwnerDecision::Take { generation: mine.generation, restored: false };
    }
    if mine.epoch.is_none() || mine.take_over {
        return OwnerDecision::Take { generation: generation + 1, restored: false };
    }
    // We owned it and the record changed: our own older record, or an older generation, is a
    // restore of the peer; our own newer one is a take whose answer never came (it timed out
    // here and landed at a peer that fell behind); anything else is a successor.
    let ours = theirs.is_some_and(|o| o.owner == me.owner_id);
    if ours || (theirs.is_some() && generation < mine.generation) {
        let landed_late = ours && mine.epoch.is_some_and(|epoch| record.mod_revision > epoch);
        return OwnerDecision::Take { generation: mine.generation, restored: !landed_late };
    }
    OwnerDecision::Fenced {
        by: theirs.map(|o| o.owner.clone()).unwrap_or_else(|| "an unreadable owner record".to_string()),
    }
}

impl Contest {
    /// What the refused worker reports: both claims, and what to do. `peer_cluster` is the peer
    /// etcd's cluster id.
    pub fn refusal(&self, me: &Claimant, origin: &str, peer_cluster: u64, ttl_seconds: i64) -> Refusal {
        let mine = me.object.map_or_else(|| "this worker".to_string(), OwningObject::describe);
        match self {
            Contest::DuplicateOrigin { owner } => {
                let theirs = owner.object.as_ref().map_or_else(|| owner.owner.clone(), OwningObject::describe);
                let from = if owner.origin_cluster_id == 0 {
                    String::new()
                } else {
                    format!(" from origin etcd cluster {:x}", owner.origin_cluster_id)
                };
                Refusal {
                    reason: "DuplicateOrigin",
                    message: format!(
                        "region {origin} on peer {} (etcd cluster {peer_cluster:x}) is already mirrored by {theirs}{from}; {mine} claims the same region: nothing is written while that claim's leases live (they lapse {ttl_seconds}s after it stops renewing). Delete the duplicate RegionPeering, or give each origin etcd its own region name",
                        me.peer
                    ),
                }
            }
            Contest::DuplicatePeer { other_peer } => Refusal {
                reason: "DuplicatePeer",
                message: format!(
                    "peers {other_peer} and {} of {mine} are one etcd (cluster {peer_cluster:x}): region {origin} already mirrors into it as peer {other_peer}, so nothing is written as {}. Remove one of them from spec.peers",
                    me.peer, me.peer
                ),
            },
        }
    }
}

/// The refusal of a peer that is the origin's own etcd (their cluster ids are equal).
pub fn peer_is_origin(me: &Claimant, origin: &str, cluster_id: u64) -> Refusal {
    Refusal {
        reason: "PeerIsOrigin",
        message: format!(
            "peer {}'s endpoints reach region {origin}'s own etcd (cluster {cluster_id:x}): a region never mirrors into itself, and nothing was written. Point spec.peers[{}].endpoints at that region's etcd, or remove the peer",
            me.peer, me.peer
        ),
    }
}

/// Whether a contested claim is refused: while the owner's leases live (`alive`: whether any of
/// the recorded leases is alive; None when it records none, or the peer could not say), and for
/// two TTLs after the claim was first seen without a lease to tell by (an owner that just took
/// the mirror grants its leases within a round trip or two).
pub fn decide_contest(alive: Option<bool>, seen_for: std::time::Duration, ttl: std::time::Duration) -> bool {
    match alive {
        Some(alive) => alive,
        None => seen_for < 2 * ttl,
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
    /// Origin keys the peer lacks because they are too large for it, as recorded.
    pub left_out: Vec<crate::mirror::records::checkpoint::LeftOut>,
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
            left_out: Vec::new(),
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
        left_out: cp.left_out.clone(),
    }
}

/// A full sync the records do not vouch for (the origin replaced or restored, no records of the
/// copy, records lost) that would delete more than `max_percent` of a live copy waits for a
/// person: an origin etcd that is not the one the copy came from (a `spec.localEtcd` pointing at
/// a new, empty etcd, or a restore from long ago), mirrored as it is, would empty the region on
/// every peer. It deletes at least `copy - origin` keys. None when the sync may go on.
pub fn resync_held(
    cause: ResyncCause,
    origin_keys: i64,
    copy_keys: i64,
    max_percent: u8,
    origin: &str,
    peer: &str,
) -> Option<Refusal> {
    let vouched = !matches!(cause, ResyncCause::OriginChanged | ResyncCause::Initial | ResyncCause::RecordsLost);
    let deletes = copy_keys.saturating_sub(origin_keys);
    if vouched || copy_keys <= 0 || deletes.saturating_mul(100) <= i64::from(max_percent).saturating_mul(copy_keys) {
        return None;
    }
    Some(Refusal {
        reason: "ResyncWouldDelete",
        message: format!(
            "a full sync ({}) from the origin etcd as it is now would delete at least {deletes} of the {copy_keys} keys of region {origin}'s copy on peer {peer} ({}%, more than spec.sync.maxResyncDeletePercent = {max_percent}). Nothing was written; the copy is kept alive as it is. If the origin was restored or replaced on purpose, raise spec.sync.maxResyncDeletePercent to 100 until the sync is done; if spec.localEtcd points at the wrong etcd, point it back",
            cause.as_str(),
            deletes * 100 / copy_keys
        ),
    })
}

/// The local etcd holds a copy of the origin's region mirrored in from elsewhere (`holder`
/// recorded it): it is a peer's etcd, and mirroring from it would mirror a copy, and delete what
/// it lacks, everywhere. The worker keeps the copy it has alive and reads nothing.
pub fn local_holds_copy(origin: &str, holder: &str) -> Refusal {
    Refusal {
        reason: "LocalEtcdHoldsCopy",
        message: format!(
            "spec.localEtcd reaches an etcd that holds a copy of region {origin} mirrored in from elsewhere (recorded by {holder}): it is a peer's etcd, not region {origin}'s. Nothing was read or written; the copies are kept alive as they are. Point spec.localEtcd back at region {origin}'s own etcd"
        ),
    }
}

/// Whether any live recorded lease was granted under another TTL than `configured`: `granted[i]`
/// is what the peer's answers said of lease i (None: not known), `alive[i]` whether it lives.
pub fn granted_under_another_ttl(
    granted: &[Option<std::time::Duration>],
    alive: &[bool],
    configured: std::time::Duration,
) -> bool {
    granted.iter().zip(alive).any(|(ttl, alive)| *alive && ttl.is_some_and(|ttl| ttl != configured))
}

/// The copy moves onto new leases (the TTL changed): every recorded lease becomes a retiring one,
/// kept alive until a resync has moved its keys, and the layout's shards are granted anew. A
/// resync the records owe anyway keeps its cause when it says more (an origin replaced).
pub fn onto_new_leases(mut resume: Resume) -> Resume {
    if resume.leases.is_empty() {
        return resume;
    }
    let old: Vec<i64> = resume.leases.iter().copied().filter(|id| *id != 0 && !resume.retiring.contains(id)).collect();
    resume.retiring.extend(old);
    resume.leases = vec![0; resume.leases.len()];
    resume.applied = 0;
    resume.resync = Some(match resume.resync {
        Some(ResyncCause::OriginChanged) => ResyncCause::OriginChanged,
        _ => ResyncCause::LeaseTtlChanged,
    });
    resume
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mirror_is_taken_from_another_when_its_owner_record_names_someone_else_or_cannot_be_read() {
        let record = |owner: Option<&str>| OwnerRecord {
            mod_revision: 9,
            owner: owner.map(|o| Owner { owner: o.into(), ..Default::default() }),
        };
        assert!(!taken_from_another(None, "aether-1"), "nobody wrote the mirror yet");
        assert!(!taken_from_another(Some(&record(Some("aether-1"))), "aether-1"), "this Pod's own, restarted");
        assert!(taken_from_another(Some(&record(Some("aether-0"))), "aether-1"), "the Pod that led before");
        assert!(taken_from_another(Some(&record(None)), "aether-1"), "a record that does not decode");
    }

    #[test]
    fn a_resync_the_records_do_not_vouch_for_waits_before_deleting_most_of_a_live_copy() {
        let held = |cause, origin, copy, max| resync_held(cause, origin, copy, max, "a", "b");
        // An empty origin etcd in place of the one the copy came from: held, saying how to go on.
        let refusal = held(ResyncCause::OriginChanged, 0, 500, 50).expect("held");
        assert_eq!(refusal.reason, "ResyncWouldDelete");
        for said in ["500 of the 500 keys", "100%", "spec.sync.maxResyncDeletePercent = 50", "spec.localEtcd"] {
            assert!(refusal.message.contains(said), "{said:?} missing from {}", refusal.message);
        }
        assert!(held(ResyncCause::Initial, 10, 500, 50).is_some(), "no records to vouch for the origin");
        assert!(held(ResyncCause::RecordsLost, 10, 500, 50).is_some());
        // A restore from minutes ago deletes little; raised to 100, nothing is held.
        assert_eq!(held(ResyncCause::OriginChanged, 480, 500, 50), None);
        assert_eq!(held(ResyncCause::OriginChanged, 0, 500, 100), None);
        assert_eq!(held(ResyncCause::OriginChanged, 250, 500, 50), None, "exactly the bound may go");
        // An empty copy has nothing to lose; resyncs the records vouch for are the origin's own deletes.
        assert_eq!(held(ResyncCause::OriginChanged, 0, 0, 50), None);
        for vouched in
            [ResyncCause::Compacted, ResyncCause::LeaseLost, ResyncCause::Reshard, ResyncCause::LeaseTtlChanged]
        {
            assert_eq!(held(vouched, 0, 500, 50), None, "{vouched:?}");
        }
    }

    #[test]
    fn leases_of_another_ttl_move_the_copy_onto_new_ones_kept_alive_meanwhile() {
        let s = std::time::Duration::from_secs;
        assert!(granted_under_another_ttl(&[Some(s(30)), Some(s(60))], &[true, true], s(60)));
        assert!(!granted_under_another_ttl(&[Some(s(60)), None], &[true, true], s(60)), "unknown is not another");
        assert!(!granted_under_another_ttl(&[Some(s(30))], &[false], s(60)), "a lapsed lease is not renewed anyway");
        let c = Checkpoint { revision: 40, synced: true, leases: vec![7, 8], keys: vec![3, 4], ..Default::default() };
        let resume = decide_resume(Some(&c), None, &[true, true], &[(5, true)], ORIGIN, None, false);
        assert_eq!((resume.resync, resume.applied), (None, 40));
        let moved = onto_new_leases(resume);
        assert_eq!(moved.leases, vec![0, 0], "the layout's shards are granted anew");
        assert_eq!(moved.retiring, vec![5, 7, 8], "every old lease kept alive until the resync moved its keys");
        assert_eq!((moved.resync, moved.applied), (Some(ResyncCause::LeaseTtlChanged), 0));
        assert_eq!(moved.keys, vec![3, 4]);
        // An origin replaced says more than the TTL.
        let other = OriginStatus { cluster_id: 99, ..ORIGIN };
        let c = Checkpoint { origin_cluster_id: 1, ..c };
        let replaced = onto_new_leases(decide_resume(Some(&c), None, &[true, true], &[], other, None, false));
        assert_eq!(replaced.resync, Some(ResyncCause::OriginChanged));
        // Nothing laid out yet: nothing to move.
        let fresh = onto_new_leases(decide_resume(None, None, &[], &[], ORIGIN, None, false));
        assert_eq!((fresh.leases.len(), fresh.resync), (0, Some(ResyncCause::Initial)));
    }

    fn owner(name: &str, generation: u64) -> Option<Owner> {
        Some(Owner { owner: name.into(), acquired_at: "t".into(), generation, ..Default::default() })
    }

    fn who(owner_id: &str) -> Claimant<'_> {
        Claimant { owner_id, object: None, peer: "b" }
    }

    fn record(mod_revision: i64, name: &str, generation: u64) -> OwnerRecord {
        OwnerRecord { mod_revision, owner: owner(name, generation) }
    }

    #[test]
    fn a_first_session_takes_the_next_generation() {
        let mine = Ownership::default();
        assert_eq!(decide_ownership(&who("me"), &mine, None), OwnerDecision::Take { generation: 1, restored: false });
        assert_eq!(
            decide_ownership(&who("me"), &mine, Some(&record(5, "old", 7))),
            OwnerDecision::Take { generation: 8, restored: false }
        );
    }

    #[test]
    fn every_later_session_keeps_its_generation_while_the_record_is_its_own() {
        let mine = Ownership { epoch: Some(5), generation: 8, take_over: false };
        assert_eq!(
            decide_ownership(&who("me"), &mine, Some(&record(5, "me", 8))),
            OwnerDecision::Take { generation: 8, restored: false }
        );
        // Newer than the epoch this worker knows: its last take timed out here and landed at a
        // peer that fell behind. Not a restore of the peer.
        assert_eq!(
            decide_ownership(&who("me"), &mine, Some(&record(12, "me", 8))),
            OwnerDecision::Take { generation: 8, restored: false }
        );
    }

    #[test]
    fn a_successor_fences_and_a_rolled_back_record_does_not() {
        let mine = Ownership { epoch: Some(5), generation: 8, take_over: false };
        assert_eq!(
            decide_ownership(&who("me"), &mine, Some(&record(9, "next", 9))),
            OwnerDecision::Fenced { by: "next".into() }
        );
        // A restore of the peer brings back our own older record, or a predecessor's.
        assert_eq!(
            decide_ownership(&who("me"), &mine, Some(&record(3, "me", 8))),
            OwnerDecision::Take { generation: 8, restored: true }
        );
        assert_eq!(
            decide_ownership(&who("me"), &mine, Some(&record(3, "old", 7))),
            OwnerDecision::Take { generation: 8, restored: true }
        );
        assert_eq!(decide_ownership(&who("me"), &mine, None), OwnerDecision::Take { generation: 8, restored: true });
        let garbage = OwnerRecord { mod_revision: 9, owner: None };
        assert!(matches!(decide_ownership(&who("me"), &mine, Some(&garbage)), OwnerDecision::Fenced { .. }));
    }

    #[test]
    fn a_tombstone_stops_a_worker_that_owned_the_mirror_and_yields_to_a_new_one() {
        let tombstone = OwnerRecord {
            mod_revision: 9,
            owner: Some(Owner {
                owner: "retired".into(),
                acquired_at: "t".into(),
                generation: 4,
                retired: true,
                ..Default::default()
            }),
        };
        let standing_by = Ownership { epoch: Some(5), generation: 3, take_over: true };
        assert_eq!(
            decide_ownership(&who("me"), &standing_by, Some(&tombstone)),
            OwnerDecision::Retired { by: "retired".into() }
        );
        assert_eq!(
            decide_ownership(&who("new"), &Ownership::default(), Some(&tombstone)),
            OwnerDecision::Take { generation: 5, restored: false }
        );
    }

    #[test]
    fn taking_over_after_standing_by_outranks_the_record() {
        let mine = Ownership { epoch: Some(5), generation: 8, take_over: true };
        assert_eq!(
            decide_ownership(&who("me"), &mine, Some(&record(9, "ghost", 1000))),
            OwnerDecision::Take { generation: 1001, restored: false }
        );
    }

    fn object(uid: &str) -> OwningObject {
        OwningObject {
            namespace: "aether-system".into(),
            name: format!("rp-{uid}"),
            uid: uid.into(),
            cluster: "k1".into(),
        }
    }

    /// A live owner record of `uid`'s object, mirroring into `peer`.
    fn claimed(mod_revision: i64, uid: &str, peer: &str) -> OwnerRecord {
        OwnerRecord {
            mod_revision,
            owner: Some(Owner {
                owner: format!("{uid}-worker"),
                generation: 3,
                object: Some(object(uid)),
                origin_cluster_id: 11,
                peer: peer.into(),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn a_claim_of_another_object_is_contested_never_taken_over_at_once() {
        let x = object("x");
        let me = Claimant { owner_id: "x-2", object: Some(&x), peer: "b" };
        let theirs = claimed(9, "y", "b");
        for mine in [Ownership::default(), Ownership { epoch: Some(5), generation: 8, take_over: true }] {
            match decide_ownership(&me, &mine, Some(&theirs)) {
                OwnerDecision::Contested { contest: Contest::DuplicateOrigin { owner }, generation } => {
                    assert_eq!(owner.object, Some(object("y")));
                    assert!(generation > 3 && generation > mine.generation);
                }
                other => panic!("{mine:?}: {other:?}"),
            }
        }
        // Released by its owner: still another object's, so still contested.
        let mut released = theirs.clone();
        released.owner.as_mut().unwrap().released = true;
        assert!(matches!(
            decide_ownership(&me, &Ownership::default(), Some(&released)),
            OwnerDecision::Contested { .. }
        ));
        // The same object (another worker of it, a successor leader) is the usual handoff.
        let same = claimed(9, "x", "b");
        assert_eq!(
            decide_ownership(&me, &Ownership::default(), Some(&same)),
            OwnerDecision::Take { generation: 4, restored: false }
        );
        // Records of earlier versions, and workers without an object, are compatible.
        assert_eq!(
            decide_ownership(&me, &Ownership::default(), Some(&record(9, "old", 3))),
            OwnerDecision::Take { generation: 4, restored: false }
        );
        let anonymous = Claimant { owner_id: "w", object: None, peer: "b" };
        assert!(matches!(
            decide_ownership(&anonymous, &Ownership::default(), Some(&theirs)),
            OwnerDecision::Take { .. }
        ));
    }

    #[test]
    fn one_etcd_under_two_peer_names_is_contested_until_released() {
        let x = object("x");
        let me = Claimant { owner_id: "x-c", object: Some(&x), peer: "c" };
        let as_b = claimed(9, "x", "b");
        assert_eq!(
            decide_ownership(&me, &Ownership::default(), Some(&as_b)),
            OwnerDecision::Contested { contest: Contest::DuplicatePeer { other_peer: "b".into() }, generation: 4 }
        );
        // A worker stopped cleanly (its peer renamed or removed) leaves the mirror to take.
        let mut released = as_b.clone();
        released.owner.as_mut().unwrap().released = true;
        assert_eq!(
            decide_ownership(&me, &Ownership::default(), Some(&released)),
            OwnerDecision::Take { generation: 4, restored: false }
        );
    }

    #[test]
    fn a_released_record_of_this_object_is_taken_at_once_even_standing_by() {
        let x = object("x");
        let me = Claimant { owner_id: "x-1", object: Some(&x), peer: "b" };
        let standing_by = Ownership { epoch: Some(5), generation: 8, take_over: false };
        let mut released = claimed(12, "x", "b");
        released.owner.as_mut().unwrap().released = true;
        assert_eq!(
            decide_ownership(&me, &standing_by, Some(&released)),
            OwnerDecision::Take { generation: 9, restored: false }
        );
        // Not released: a live successor of the same object (a newer generation) fences.
        let mut successor = claimed(12, "x", "b");
        successor.owner.as_mut().unwrap().generation = 9;
        assert!(matches!(decide_ownership(&me, &standing_by, Some(&successor)), OwnerDecision::Fenced { .. }));
    }

    #[test]
    fn a_tombstone_stops_only_the_object_it_names() {
        let x = object("x");
        let me = Claimant { owner_id: "x-1", object: Some(&x), peer: "b" };
        let owned = Ownership { epoch: Some(5), generation: 3, take_over: false };
        let tombstone = |uid: &str| OwnerRecord {
            mod_revision: 9,
            owner: Some(Owner {
                owner: "retired".into(),
                generation: 4,
                retired: true,
                object: Some(object(uid)),
                ..Default::default()
            }),
        };
        assert_eq!(
            decide_ownership(&me, &owned, Some(&tombstone("x"))),
            OwnerDecision::Retired { by: "retired".into() }
        );
        assert_eq!(
            decide_ownership(&me, &owned, Some(&tombstone("y"))),
            OwnerDecision::Take { generation: 5, restored: false },
            "another object's retirement is not this one's"
        );
        assert_eq!(
            decide_ownership(&me, &Ownership::default(), Some(&tombstone("x"))),
            OwnerDecision::Take { generation: 5, restored: false },
            "a worker started again for an object that still exists takes its mirror back"
        );
    }

    #[test]
    fn a_contest_is_refused_while_the_owner_lives() {
        let ttl = std::time::Duration::from_secs(30);
        assert!(decide_contest(Some(true), std::time::Duration::from_secs(3600), ttl));
        assert!(!decide_contest(Some(false), std::time::Duration::ZERO, ttl), "every recorded lease lapsed");
        assert!(decide_contest(None, std::time::Duration::from_secs(59), ttl), "no lease to tell by yet");
        assert!(!decide_contest(None, std::time::Duration::from_secs(60), ttl));
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
            left_out: vec![],
        }
    }

    const ORIGIN: OriginStatus = OriginStatus { cluster_id: 7, revision: 100 };

    #[test]
    fn resumes_from_the_newest_record_the_peer_holds() {
        let c = cp(40, vec![11, 12], true, 7);
        let p = Progress { owner: "w".into(), revision: 60, sent_through: 60, keys: None };
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
