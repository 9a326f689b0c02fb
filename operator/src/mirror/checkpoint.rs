//! The checkpoint a worker keeps on the peer, outside `regions/`: the last origin revision the
//! peer holds completely, the lease of every shard with its key count, and the owner. A new leader
//! adopts the leases and resumes from it instead of re-putting every key.
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Checkpoint {
    /// The worker instance that wrote it.
    pub owner: String,
    /// The origin revision the peer holds completely (0 before the first complete sync).
    pub revision: i64,
    /// The lease id of each shard; a key's shard is `shard_of(key, leases.len())`.
    pub leases: Vec<i64>,
    /// Keys on each shard's lease.
    pub keys: Vec<i64>,
    /// Whether the peer held a complete snapshot at `revision`.
    pub synced: bool,
    /// Leases of a previous layout that may still hold keys while a resync moves them; a
    /// successor keeps them alive until its own sync is complete.
    #[serde(default)]
    pub retiring: Vec<i64>,
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

/// The owner record: who writes this origin's mirror on this peer. Its mod revision is the
/// fencing epoch every batch compares.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Owner {
    pub owner: String,
    pub acquired_at: String,
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
            keys: vec![3, 4],
            synced: true,
            retiring: vec![],
        };
        assert_eq!(Checkpoint::decode(&c.encode()), Some(c.clone()));
        assert_eq!(c.total_keys(), 7);
        assert_eq!(Checkpoint::decode(b"not json"), None);
    }
}
