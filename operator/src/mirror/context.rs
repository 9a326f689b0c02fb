//! A worker's context and the state it keeps across sessions, with the small helpers every stream
//! uses (the records it writes, the Txn limits, the RPC deadline). Below the session and its
//! streams, above the lease machinery and the records.
use crate::keys;
use crate::mirror::health::{MirrorEvent, ResyncCause};
use crate::mirror::leases::keeper::Keeper;
use crate::mirror::plan::TxnLimits;
use crate::mirror::records::checkpoint::{
    Checkpoint, CheckpointWrite, LEFT_OUT_RECORDED, LeftOut, Progress, RecordBudget, plan_write,
};
use crate::mirror::records::resume::Ownership;
use crate::mirror::shared::Shared;
use crate::mirror::{EtcdTarget, MirrorConfig};
use etcd_client::TxnOp;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::SystemTime;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// What the worker keeps across sessions. The peer's records stay the truth: every session
/// re-reads them (see `resume.rs`).
#[derive(Default)]
pub(super) struct State {
    pub ownership: Ownership,
    /// One lease per shard (0 where none is granted yet).
    pub leases: Vec<i64>,
    /// The keys a lease may carry on this peer (see `plan::lease_cap`).
    pub lease_cap: u64,
    /// Auth binds this worker's user on the peer (see `session::auth_binds`).
    pub auth_binds: bool,
    /// Which shard each key belongs to (aligned with `leases`).
    pub layout: crate::mirror::leases::shards::Layout,
    /// Keys per shard.
    pub keys: Vec<i64>,
    /// Leases of a previous shard layout, kept alive until a resync has moved their keys.
    pub retiring: Vec<i64>,
    /// The origin revision the peer holds completely.
    pub applied: i64,
    /// Resumed from the records: the newest origin revision the predecessor's last Txns may have
    /// landed, past `applied` (see `catch_up.rs`). A sync clears it.
    pub peer_may_hold_through: Option<i64>,
    /// This session took the mirror over from another process whose sync was cut short: what that
    /// sync copied is recorded nowhere, and may be newer than a snapshot this process pinned
    /// before the takeover. Its sync pins its own snapshot (`sync::reuse`); a sync clears it.
    pub predecessor_copy_unknown: bool,
    pub synced: bool,
    /// This worker completed a sync (or adopted a synced mirror) in an earlier session: a peer
    /// without its records now lost them.
    pub synced_once: bool,
    /// A sync this worker owes; it stays until a sync completes.
    pub resync_cause: Option<ResyncCause>,
    /// The origin etcd's cluster id, recorded with every complete snapshot.
    pub origin_cluster_id: u64,
    /// Origin keys left out because the peer cannot take them: key -> bytes.
    pub oversized: BTreeMap<String, usize>,
    /// Where continuous verification is in the subtree.
    pub walk: crate::mirror::verify::Walk,
    /// Ops per Txn, lowered when the peer says its `--max-txn-ops` is lower than configured.
    pub txn_ops_cap: Option<usize>,
    /// How the peer stores the checkpoint, as last read or written (written optimistically: a
    /// write that fails ends the session, and the next one reads it again).
    pub stored_checkpoint: crate::mirror::records::checkpoint::Stored,
    /// Keys per shard as the checkpoint records them: each shard's count when it was last counted
    /// (by a sync, or by a split of it). A split records only its two shards' counts, so that it
    /// rewrites the parts holding them and not every part whose count moved since.
    pub recorded_keys: Vec<i64>,
    /// Shards whose count moved from the recorded one by more than the drift allowed
    /// (`State::count_drifted`): the watch records them.
    pub drifted: BTreeSet<usize>,
    /// A contested owner record (its mod revision) and when this worker first saw it: an owner
    /// that records no lease yet is given two TTLs to grant them before it counts as gone.
    pub contest_seen: Option<(i64, std::time::Instant)>,
    /// The keys left out (`oversized`) changed since the checkpoint last recorded them: the
    /// watch records them, so that a successor reports them too.
    pub left_out_unrecorded: bool,
    /// The key counts are the checkpoint's (resumed from the records), not counted by a sync: the
    /// watch makes them exact at its first quiet moment (`Worker::recount`).
    pub counts_estimated: bool,
    /// The peer's distance, measured beside the session's first steps for its first sync.
    pub distance_ahead: Option<tokio::task::JoinHandle<Option<std::time::Duration>>>,
    /// The turn at a full sync this session waited for before taking ownership
    /// (`sync_slots.rs`), until its sync starts. Never kept past a session (`Worker::run`).
    pub sync_turn: Option<crate::mirror::sync_slots::SyncSlot>,
}

/// How far a shard's count may move from the recorded one before it is recorded again: an eighth
/// of the cap, and at least 8, so that recording costs at most one record per eight changes to a
/// shard (growth spread over every shard rewrites the layout once per 8 keys a shard).
pub fn count_drift(lease_cap: u64) -> i64 {
    (lease_cap / 8).max(8) as i64
}

/// Scales estimated per-shard key counts so that they add up to `exact` (pure): each shard keeps
/// its share, the rounding goes to the largest; with no estimate at all, evenly.
pub fn rescale_counts(counts: &mut [i64], exact: i64) {
    if counts.is_empty() {
        return;
    }
    let estimated: i64 = counts.iter().map(|c| (*c).max(0)).sum();
    let shards = counts.len() as i64;
    let mut assigned = 0;
    for count in counts.iter_mut() {
        *count = if estimated > 0 { (*count).max(0) * exact / estimated } else { exact / shards };
        assigned += *count;
    }
    let largest = (0..counts.len()).max_by_key(|i| counts[*i]).unwrap_or(0);
    counts[largest] += exact - assigned;
}

impl State {
    /// Whether `shard`'s count has moved [`count_drift`] from the recorded one: then it is
    /// recorded, so that a session that ends soon after does not lose it (counts start from the
    /// record) and no lease passes the cap unsplit across sessions.
    pub fn count_drifted(&self, shard: usize) -> bool {
        let recorded = self.recorded_keys.get(shard).copied().unwrap_or(0);
        let now = self.keys.get(shard).copied().unwrap_or(0);
        (now - recorded).abs() >= count_drift(self.lease_cap)
    }
}

pub(super) struct Worker {
    pub config: MirrorConfig,
    pub local: EtcdTarget,
    pub peer: EtcdTarget,
    pub shared: Arc<Shared>,
    pub cancel: CancellationToken,
    /// Renews the mirror's leases for the worker's whole life, across sessions.
    pub keeper: Keeper,
    /// The shortest distance to the peer measured in this worker's life (`plan::nearest`).
    pub nearest: std::sync::Mutex<Option<std::time::Duration>>,
    /// Where the worker's last sync's pace ended: the next starts from it (`SyncPace::resume`).
    pub last_sync_pace: std::sync::Mutex<Option<crate::mirror::streams::pace::SyncPace>>,
}

impl Worker {
    /// The checkpoint record this worker would write now.
    pub(super) fn checkpoint(&self, state: &State, revision: i64, synced: bool) -> Checkpoint {
        self.checkpoint_for(state, &state.layout, &state.leases, &state.keys, revision, synced)
    }

    /// The checkpoint record of a lease layout (the current one, or one about to be used).
    pub(super) fn checkpoint_for(
        &self,
        state: &State,
        layout: &crate::mirror::leases::shards::Layout,
        leases: &[i64],
        keys: &[i64],
        revision: i64,
        synced: bool,
    ) -> Checkpoint {
        Checkpoint {
            owner: self.config.owner_id.clone(),
            revision,
            leases: leases.to_vec(),
            slots: if layout.is_uniform() { Vec::new() } else { layout.slots().to_vec() },
            keys: keys.to_vec(),
            synced,
            retiring: state.retiring.clone(),
            origin_cluster_id: state.origin_cluster_id,
            parts: None,
            left_out: state
                .oversized
                .iter()
                .take(LEFT_OUT_RECORDED)
                .map(|(key, bytes)| LeftOut { key: key.clone(), bytes: *bytes })
                .collect(),
        }
    }

    /// Plans writing `record` over what the peer stores, within what one Txn may carry beside
    /// the records written with it.
    pub(super) fn checkpoint_write(&self, state: &mut State, record: &Checkpoint) -> CheckpointWrite {
        let limits = self.limits(state);
        // Room in the commit for the bookkeeping beside it: progress, canary, the page ends.
        let budget = RecordBudget {
            ops: limits.max_ops.saturating_sub(4).max(1),
            bytes: limits
                .max_bytes
                .saturating_sub(4096 + crate::mirror::verify::page_ends_budget(self.config.max_txn_bytes))
                .max(1),
        };
        let fresh_id = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
        let per_part = self.config.checkpoint_shards_per_part;
        let write = plan_write(&self.config.origin, record, &state.stored_checkpoint, budget, per_part, fresh_id);
        state.stored_checkpoint = write.stored.clone();
        state.recorded_keys = record.keys.clone();
        state.left_out_unrecorded = false;
        let still: BTreeSet<usize> = state.drifted.iter().copied().filter(|s| state.count_drifted(*s)).collect();
        state.drifted = still;
        write
    }

    pub(super) fn progress_op(&self, revision: i64, sent_through: i64, keys: i64) -> TxnOp {
        TxnOp::put(keys::progress_key(&self.config.origin), self.progress_value(revision, sent_through, keys), None)
    }

    /// The progress record's value for `revision`, its writer having sent up to `sent_through`,
    /// the peer then holding `keys` of the origin's keys.
    pub(super) fn progress_value(&self, revision: i64, sent_through: i64, keys: i64) -> Vec<u8> {
        Progress { owner: self.config.owner_id.clone(), revision, sent_through, keys: Some(keys) }.encode()
    }

    /// What one peer Txn may carry: the configured limits (ops lowered if the peer said so), less
    /// room for the progress record.
    pub(super) fn limits(&self, state: &State) -> TxnLimits {
        let ops = state.txn_ops_cap.unwrap_or(self.config.max_txn_ops).min(self.config.max_txn_ops);
        TxnLimits::for_peer(ops, self.config.max_txn_bytes, 3, 1024)
    }

    /// The most connections this worker spreads its Txns over: its share of the peer etcd's
    /// budget among the regions writing into it (`plan::spread_cap`).
    pub(super) fn spread_cap(&self) -> usize {
        crate::mirror::plan::spread_cap(self.config.origin_peers.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Bounds an etcd call by the RPC timeout.
    pub(super) async fn rpc<T>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> anyhow::Result<T> {
        use anyhow::Context;
        match tokio::time::timeout(self.config.rpc_timeout, call).await {
            Err(_) => Err(anyhow::anyhow!("{what}: timed out after {:?}", self.config.rpc_timeout)),
            Ok(r) => r.with_context(|| what.to_string()),
        }
    }

    /// Whether the keeper's last renewal round failed. Renewals come first: the peer applies
    /// writes one at a time and may hold a renewal's answer back behind this worker's own Txns
    /// (etcd 3.5+ answers a renewal only once it has applied what it committed), so while rounds
    /// fail no new write is sent.
    pub(super) fn renewals_failing(&self) -> bool {
        self.shared.health.borrow().keepalive_failures > 0
    }

    /// Waits until a renewal round succeeds again; after a whole TTL without one the session
    /// ends (the leases are gone by then, and the next session says so).
    pub(super) async fn renewals_first(&self) -> anyhow::Result<()> {
        let mut health = self.shared.health.subscribe();
        let recovered = health.wait_for(|h| h.keepalive_failures == 0);
        let ttl = std::time::Duration::from_secs(self.config.lease_ttl_seconds.max(1) as u64);
        match tokio::time::timeout(ttl, recovered).await {
            Ok(_) => Ok(()),
            Err(_) => anyhow::bail!(
                "the peer answered no lease renewal within the lease TTL ({ttl:?}); writes were held back so that renewals come first"
            ),
        }
    }

    /// Keeps exactly the state's leases (and the retiring ones) alive from now on.
    pub(super) fn keep_alive(&self, state: &State) {
        self.keeper.keep(&state.leases, &state.retiring);
        let leases = state.leases.iter().filter(|id| **id != 0).count();
        self.shared.update(|h| h.leases = leases);
    }

    /// Records keys left out because the peer cannot take them, and says so once per key and size.
    pub(super) fn report_oversized(
        &self,
        state: &mut State,
        found: Vec<crate::mirror::plan::Oversized>,
        fixed: Vec<String>,
    ) {
        let mut changed = false;
        for key in fixed {
            changed |= state.oversized.remove(&key).is_some();
        }
        for o in found {
            if state.oversized.get(&o.key) != Some(&o.bytes) {
                warn!(key = %o.key, bytes = o.bytes, "a value is larger than the peer accepts; left out of the mirror");
                self.shared.emit(MirrorEvent::ValueTooLarge { key: o.key.clone(), bytes: o.bytes });
                state.oversized.insert(o.key, o.bytes);
                changed = true;
            }
        }
        if changed {
            state.left_out_unrecorded = true;
            let list: Vec<(String, usize)> = state.oversized.iter().map(|(k, v)| (k.clone(), *v)).collect();
            self.shared.update(|h| h.oversized = list);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::rescale_counts;

    #[test]
    fn estimated_counts_scale_to_the_exact_total_each_keeping_its_share() {
        let mut counts = vec![100, 300, 0];
        rescale_counts(&mut counts, 440);
        assert_eq!(counts.iter().sum::<i64>(), 440);
        assert_eq!(counts, vec![110, 330, 0]);
        let mut counts = vec![10, 11, 12];
        rescale_counts(&mut counts, 10);
        assert_eq!(counts.iter().sum::<i64>(), 10, "{counts:?}");
        assert!(counts.iter().all(|c| *c >= 0), "{counts:?}");
    }

    #[test]
    fn counts_with_no_estimate_are_spread_evenly() {
        let mut counts = vec![0, 0, 0, 0];
        rescale_counts(&mut counts, 10);
        assert_eq!(counts.iter().sum::<i64>(), 10, "{counts:?}");
        assert!(counts.iter().all(|c| *c >= 2), "{counts:?}");
    }
}
