//! Each side's CPU a key during a sync, beside its floor measured in the same run on the same
//! etcds' data: the origin against the cheapest full read of the subtree (one connection, pages of
//! 10,000 keys), the peers against the write limit's (the same keys in plain Txns of the mirror's
//! size, at the sweep's best point), and the mirror's own. Each ratio is judged against its target;
//! a target not met says so in the row instead of being read off it.
use crate::table::Table;

/// The most the origin's CPU a key may be over its floor (issue: one read of the origin).
pub const ORIGIN_TARGET: f64 = 1.3;
/// The most the peers' CPU a key may be over the plain writes'.
pub const PEER_TARGET: f64 = 1.15;
/// The mirror's own CPU a key copied, µs.
pub const MIRROR_TARGET_US: f64 = 2.0;

/// CPU seconds of one sync of `keys` keys into `peers` peers, and of its floors.
#[derive(Clone, Debug, PartialEq)]
pub struct SideCosts {
    pub keys: usize,
    pub peers: usize,
    /// The origin etcd during the sync (every worker's reads and watches).
    pub origin: f64,
    /// The origin etcd reading the subtree once, in large pages on one connection.
    pub origin_floor: f64,
    /// The peers' etcds together during the sync.
    pub peer: f64,
    /// The peers' etcds together taking the same keys in plain Txns.
    pub peer_floor: f64,
    /// The mirror's process.
    pub mirror: f64,
}

impl SideCosts {
    /// The origin's CPU a key of its subtree, µs: however many peers read it.
    pub fn origin_us(&self) -> f64 {
        per_key_us(self.origin, self.keys)
    }
    pub fn origin_floor_us(&self) -> f64 {
        per_key_us(self.origin_floor, self.keys)
    }
    /// The peers' CPU a key written, µs.
    pub fn peer_us(&self) -> f64 {
        per_key_us(self.peer, self.keys * self.peers)
    }
    pub fn peer_floor_us(&self) -> f64 {
        per_key_us(self.peer_floor, self.keys * self.peers)
    }
    /// The mirror's CPU a key copied, µs.
    pub fn mirror_us(&self) -> f64 {
        per_key_us(self.mirror, self.keys * self.peers)
    }

    /// "origin etcd 13.20 µs a key of its subtree against its floor's 5.10 (...): 2.59x (target <= 1.3x: not met); ...".
    pub fn describe(&self) -> String {
        format!(
            "origin etcd {:.2} µs a key of its subtree against its floor's {:.2} (the least of three reads in 10k-key pages, each range ending at the next page): {}; peers' etcds {:.2} µs a key written against the plain writes' {:.2}: {}; the mirror {:.2} µs a key copied {}",
            self.origin_us(),
            self.origin_floor_us(),
            judge_ratio(self.origin_us(), self.origin_floor_us(), ORIGIN_TARGET),
            self.peer_us(),
            self.peer_floor_us(),
            judge_ratio(self.peer_us(), self.peer_floor_us(), PEER_TARGET),
            self.mirror_us(),
            judge_at_most(self.mirror_us(), MIRROR_TARGET_US, "µs"),
        )
    }

    /// Every target met.
    pub fn all_met(&self) -> bool {
        ratio(self.origin_us(), self.origin_floor_us()) <= ORIGIN_TARGET
            && ratio(self.peer_us(), self.peer_floor_us()) <= PEER_TARGET
            && self.mirror_us() <= MIRROR_TARGET_US
    }

    pub fn figures(&self) -> serde_json::Value {
        serde_json::json!({
            "keys": self.keys, "peers": self.peers,
            "origin_us_per_key": self.origin_us(), "origin_floor_us_per_key": self.origin_floor_us(),
            "origin_ratio": ratio(self.origin_us(), self.origin_floor_us()), "origin_target": ORIGIN_TARGET,
            "peer_us_per_key": self.peer_us(), "peer_floor_us_per_key": self.peer_floor_us(),
            "peer_ratio": ratio(self.peer_us(), self.peer_floor_us()), "peer_target": PEER_TARGET,
            "mirror_us_per_key": self.mirror_us(), "mirror_target_us": MIRROR_TARGET_US,
            "all_met": self.all_met(),
        })
    }

    /// The row under `scenario`.
    pub fn row(&self, table: &mut Table, scenario: &str) {
        table.row_with(
            scenario,
            "each side's CPU a key against its floor",
            format!(
                "origin {:.2}x, peers {:.2}x, mirror {:.2} µs",
                ratio(self.origin_us(), self.origin_floor_us()),
                ratio(self.peer_us(), self.peer_floor_us()),
                self.mirror_us()
            ),
            self.describe(),
            self.figures(),
        );
    }
}

fn per_key_us(seconds: f64, keys: usize) -> f64 {
    seconds * 1e6 / keys.max(1) as f64
}

/// `cost` over `floor`; a floor too small to measure reads as no ratio at all (infinite).
fn ratio(cost: f64, floor: f64) -> f64 {
    if floor > 0.0 { cost / floor } else { f64::INFINITY }
}

/// "1.42x (target <= 1.3x: not met)".
fn judge_ratio(cost: f64, floor: f64, target: f64) -> String {
    let r = ratio(cost, floor);
    format!("{r:.2}x (target <= {target}x: {})", if r <= target { "met" } else { "not met" })
}

fn judge_at_most(value: f64, target: f64, unit: &str) -> String {
    format!("(target <= {target} {unit}: {})", if value <= target { "met" } else { "not met" })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs(origin: f64, peer: f64, mirror: f64) -> SideCosts {
        SideCosts { keys: 100_000, peers: 2, origin, origin_floor: 0.5, peer, peer_floor: 2.0, mirror }
    }

    #[test]
    fn the_origin_is_judged_per_key_of_its_subtree_and_the_peers_per_key_written() {
        // Read once per peer: twice the floor whatever the number of peers.
        let c = costs(1.0, 2.2, 0.3);
        assert_eq!((c.origin_us(), c.origin_floor_us()), (10.0, 5.0));
        assert!((c.peer_us() - 11.0).abs() < 1e-9 && (c.peer_floor_us() - 10.0).abs() < 1e-9);
        assert!((c.mirror_us() - 1.5).abs() < 1e-9);
        assert!(!c.all_met(), "the origin at 2x its floor");
        assert!(c.describe().contains("2.00x (target <= 1.3x: not met)"), "{}", c.describe());
        assert!(c.describe().contains("1.10x (target <= 1.15x: met)"), "{}", c.describe());
    }

    #[test]
    fn every_target_is_met_only_when_each_is() {
        assert!(costs(0.6, 2.2, 0.3).all_met());
        assert!(!costs(0.6, 2.4, 0.3).all_met(), "peers over 1.15x");
        assert!(!costs(0.6, 2.2, 0.5).all_met(), "the mirror over 2 µs");
        let unmeasured = SideCosts { origin_floor: 0.0, ..costs(0.6, 2.2, 0.3) };
        assert!(!unmeasured.all_met(), "a floor that measured nothing meets nothing");
    }
}
