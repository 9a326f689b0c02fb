//! The records a worker keeps on the peer, outside `regions/`:
//! - the checkpoint: the lease of every shard with its key count, whether the peer holds a
//!   complete snapshot, and the origin cluster it came from; written when the layout changes and
//!   when a sync starts and ends;
//! - the progress: the origin revision the peer holds completely, written in the same Txn as
//!   every watch batch (a few dozen bytes, whatever the number of leases);
//! - the owner: who writes this origin's mirror; its mod revision is the fencing epoch.
//!
//! A new leader adopts the leases and resumes from them instead of re-putting every key.
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Checkpoint {
    /// The worker instance that wrote it.
    pub owner: String,
    /// The origin revision the peer holds completely (0 before the first complete sync).
    pub revision: i64,
    /// The lease id of each shard.
    pub leases: Vec<i64>,
    /// Each shard's share of the key space once shards were split (aligned with `leases`);
    /// empty for a uniform layout, where a key's shard is its hash modulo `leases.len()`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slots: Vec<super::shards::Slot>,
    /// Keys on each shard's lease.
    pub keys: Vec<i64>,
    /// Whether the peer held a complete snapshot at `revision`.
    pub synced: bool,
    /// Leases of a previous layout that may still hold keys while a resync moves them; a
    /// successor keeps them alive until its own sync is complete.
    #[serde(default)]
    pub retiring: Vec<i64>,
    /// The origin etcd's cluster id when the snapshot was taken: a restored or replaced origin
    /// has another, and its revisions mean something else (0: unknown).
    #[serde(default)]
    pub origin_cluster_id: u64,
}

impl Checkpoint {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a checkpoint always serializes")
    }

    /// Decodes a checkpoint; a value that is not one reads as none, so that a damaged key leads to
    /// a full resync rather than a stuck worker.
    pub fn decode(bytes: &[u8]) -> Option<Checkpoint> {
        serde_json::from_slice(bytes).ok()
    }

    pub fn total_keys(&self) -> i64 {
        self.keys.iter().sum()
    }
}

/// The progress record: the origin revision the peer holds completely, and who wrote it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Progress {
    pub owner: String,
    pub revision: i64,
}

/// The progress record as written: the revision first again, zero-padded, so that comparing two
/// records' bytes (which etcd can do in a Txn) compares their revisions. Records without it
/// (written by earlier versions, starting `{"owner"`) compare lower than any with it.
#[derive(Serialize)]
struct OrderedProgress<'a> {
    rev: String,
    owner: &'a str,
    revision: i64,
}

impl Progress {
    pub fn encode(&self) -> Vec<u8> {
        let ordered =
            OrderedProgress { rev: format!("{:020}", self.revision), owner: &self.owner, revision: self.revision };
        serde_json::to_vec(&ordered).expect("progress always serializes")
    }

    pub fn decode(bytes: &[u8]) -> Option<Progress> {
        serde_json::from_slice(bytes).ok()
    }
}

/// The owner record: who writes this origin's mirror on this peer. Its mod revision is the
/// fencing epoch every batch compares; every session of every worker takes a new one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Owner {
    pub owner: String,
    pub acquired_at: String,
    /// Grows by one with every new owner. A record with a lower generation than a worker's own
    /// is an old one brought back by a restore of the peer, not a successor.
    #[serde(default)]
    pub generation: u64,
}

impl Owner {
    pub fn decode(bytes: &[u8]) -> Option<Owner> {
        serde_json::from_slice(bytes).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrips_and_tolerates_garbage() {
        let c = Checkpoint {
            owner: "a/1".into(),
            revision: 42,
            leases: vec![7, 8],
            slots: vec![],
            keys: vec![3, 4],
            synced: true,
            retiring: vec![],
            origin_cluster_id: 9,
        };
        assert_eq!(Checkpoint::decode(&c.encode()), Some(c.clone()));
        assert!(!String::from_utf8(c.encode()).unwrap().contains("slots"), "a uniform layout records no slots");
        let split = Checkpoint {
            slots: vec![
                super::super::shards::Slot { depth: 1, index: 0 },
                super::super::shards::Slot { depth: 1, index: 1 },
            ],
            ..c.clone()
        };
        assert_eq!(Checkpoint::decode(&split.encode()), Some(split.clone()));
        assert_eq!(c.total_keys(), 7);
        assert_eq!(Checkpoint::decode(b"not json"), None);
        let p = Progress { owner: "a/1".into(), revision: 1 << 40 };
        assert_eq!(Progress::decode(&p.encode()), Some(p.clone()));
        assert!(p.encode().len() < 96, "progress stays small");
        assert_eq!(
            Progress::decode(br#"{"owner":"x","revision":3}"#).map(|p| p.revision),
            Some(3),
            "earlier versions' records"
        );
    }

    #[test]
    fn progress_records_compare_as_their_revisions_do() {
        let at = |owner: &str, revision: i64| Progress { owner: owner.into(), revision }.encode();
        assert!(at("a/1", 99) < at("a/1", 100), "more digits");
        assert!(at("b/2", 7) < at("a/1", 8), "whoever wrote them");
        assert!(at("a/1", 0) < at("a/1", i64::MAX));
        assert!(
            br#"{"owner":"a/1","revision":900}"#.as_slice() < at("a/1", 1).as_slice(),
            "an earlier version's record"
        );
    }

    #[test]
    fn records_of_earlier_versions_still_decode() {
        let c = Checkpoint::decode(br#"{"owner":"x","revision":3,"leases":[1],"keys":[2],"synced":true}"#);
        assert_eq!(c.map(|c| (c.origin_cluster_id, c.retiring.len())), Some((0, 0)));
        let o = Owner::decode(br#"{"owner":"x","acquiredAt":"t"}"#).expect("decodes");
        assert_eq!(o.generation, 0);
    }
}
