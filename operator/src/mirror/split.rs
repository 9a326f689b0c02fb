//! Splitting an overfull lease shard online. The shard splits in two (see `shards::Layout`): it
//! keeps its lease and the keys whose next hash bit is 0; a new lease, granted and recorded in the
//! checkpoint before any key moves, takes the others. The keys to move are listed from the old
//! lease itself and re-put under the new one a batch at a time, between the watch's batches, so
//! replication never stops; a worker that dies mid-move leaves every key on a live lease, and
//! continuous verification puts the rest on the lease the layout names.
use super::keepalive::KeeperSignal;
use super::plan::{MirrorOp, Revision, SyncBatcher, enforce_request_limit};
use super::session::Applied;
use super::sync::RESERVED_REQUEST_BYTES;
use super::target::kv;
use super::worker::{State, Worker};
use crate::keys;
use etcd_client::{Client, LeaseTimeToLiveOptions, Txn, TxnOp, TxnOpResponse};
use std::collections::VecDeque;
use tokio::sync::mpsc;
use tracing::info;

/// A split whose keys are still moving.
pub(super) struct Moving {
    /// The shard that was split, and the new one.
    pub from: usize,
    pub to: usize,
    /// Keys still on the old lease that belong to the new shard.
    pub keys: VecDeque<Vec<u8>>,
}

/// What a split or a move step found.
pub(super) enum Step<T> {
    Done(T),
    Fenced(String),
}

/// Re-targets the ops received but not applied yet at the layout as it is now (pure): a key of
/// the new shard goes straight onto the new lease. `shards` is parallel to each revision's ops.
pub(super) fn retarget<'a>(
    pending: impl Iterator<Item = (&'a mut Revision, &'a mut Vec<(usize, i64)>)>,
    layout: &super::shards::Layout,
) {
    for (revision, deltas) in pending {
        for (op, delta) in revision.ops.iter_mut().zip(deltas.iter_mut()) {
            let shard = layout.shard_of(op.key());
            if let MirrorOp::Put { shard: target, .. } = op {
                *target = shard;
            }
            delta.0 = shard;
        }
    }
}

impl Worker {
    /// Splits `shard`: grants the new lease, keeps it alive, records the layout, and lists the
    /// keys that must move.
    pub(super) async fn split_shard(
        &self,
        peer: &mut Client,
        state: &mut State,
        epoch: i64,
        shard: usize,
        lost_tx: &mpsc::Sender<KeeperSignal>,
    ) -> anyhow::Result<Step<Moving>> {
        let old_lease = state.leases[shard];
        let granted = self.rpc("grant lease", peer.lease_grant(self.config.lease_ttl_seconds, None)).await?;
        let to = state.layout.split(shard);
        state.leases.push(granted.id());
        state.keys.push(0);
        self.ensure_keeper(state, lost_tx);
        let record = vec![self.checkpoint_op(state, state.applied, true)];
        if let Applied::Fenced(by) = self.apply(peer, epoch, Vec::new(), &state.leases, record).await? {
            return Ok(Step::Fenced(by));
        }
        let listed = self
            .rpc(
                "list a lease's keys",
                peer.lease_time_to_live(old_lease, Some(LeaseTimeToLiveOptions::new().with_keys())),
            )
            .await?;
        let subtree = keys::region_prefix(&self.config.origin);
        let keys: VecDeque<Vec<u8>> = listed
            .keys()
            .iter()
            .filter(|k| k.starts_with(subtree.as_bytes()) && state.layout.shard_of(k) == to)
            .cloned()
            .collect();
        let moving = keys.len() as i64;
        state.keys[shard] = (state.keys[shard] - moving).max(0);
        state.keys[to] = moving;
        info!(
            shard,
            new_shard = to,
            lease = granted.id(),
            keys = moving,
            "splitting an overfull lease shard; its keys move while the watch goes on"
        );
        self.shared.emit(super::MirrorEvent::LeaseGranted { lease: granted.id(), shard: to });
        self.shared.update(|h| {
            h.shard_splits += 1;
            h.leases = state.leases.len();
        });
        Ok(Step::Done(Moving { from: shard, to, keys }))
    }

    /// Moves one batch of keys onto the lease their shard now has: reads them from the peer
    /// (which holds the origin's subtree at the applied revision between batches) and re-puts
    /// them in one fenced Txn. When the last key moved, recounts both shards from their leases
    /// and records the counts. Returns whether the split is complete.
    pub(super) async fn move_batch(
        &self,
        peer: &Client,
        state: &mut State,
        epoch: i64,
        moving: &mut Moving,
    ) -> anyhow::Result<Step<bool>> {
        let limits = self.limits(state);
        let take = moving.keys.len().min(limits.max_ops.max(1));
        let batch: Vec<Vec<u8>> = moving.keys.drain(..take).collect();
        let reads: Vec<TxnOp> = batch.iter().map(|k| TxnOp::get(k.clone(), None)).collect();
        let read = self.rpc("read keys to move", kv(peer).txn(Txn::new().and_then(reads))).await?;
        let mut batcher = SyncBatcher::new(limits);
        let mut txns = Vec::new();
        for response in read.op_responses() {
            let TxnOpResponse::Get(get) = response else { continue };
            for found in get.kvs() {
                let shard = state.layout.shard_of(found.key());
                // Re-put already by the watch (deleted keys are simply not found).
                if found.lease() == state.leases[shard] {
                    continue;
                }
                let op = MirrorOp::Put { key: found.key().to_vec(), value: found.value().to_vec(), shard };
                let (op, _) = enforce_request_limit(op, self.config.max_request_bytes, RESERVED_REQUEST_BYTES);
                txns.extend(batcher.push(op));
            }
        }
        txns.extend(batcher.take());
        for ops in txns {
            if let Applied::Fenced(by) = self.apply(peer, epoch, ops, &state.leases, Vec::new()).await? {
                return Ok(Step::Fenced(by));
            }
        }
        if !moving.keys.is_empty() {
            return Ok(Step::Done(false));
        }
        for shard in [moving.from, moving.to] {
            let listed = self
                .rpc(
                    "count a lease's keys",
                    peer.clone()
                        .lease_time_to_live(state.leases[shard], Some(LeaseTimeToLiveOptions::new().with_keys())),
                )
                .await?;
            let subtree = keys::region_prefix(&self.config.origin);
            state.keys[shard] = listed.keys().iter().filter(|k| k.starts_with(subtree.as_bytes())).count() as i64;
        }
        let record = vec![self.checkpoint_op(state, state.applied, true)];
        if let Applied::Fenced(by) = self.apply(peer, epoch, Vec::new(), &state.leases, record).await? {
            return Ok(Step::Fenced(by));
        }
        info!(shard = moving.from, new_shard = moving.to, keys = state.keys[moving.to], "lease shard split complete");
        Ok(Step::Done(true))
    }
}
