//! Splitting an overfull lease shard online, beside the watch. The shard splits in two (see
//! `shards::Layout`): it keeps its lease and the keys whose next hash bit is 0; a new lease takes
//! the others. Each step's IO runs while the watch goes on applying:
//!
//! 1. grant the new lease (kept alive from then on);
//! 2. record the new layout in the checkpoint; only then do writes use the new lease (a successor
//!    must know every lease that may hold keys);
//! 3. once the batch in flight at that moment has landed, list the old lease's keys: every one
//!    the layout places elsewhere moves, to whichever shard it belongs to, so that keys an
//!    earlier split cut short left behind move now too;
//! 4. move them a batch at a time: read them from the peer, re-put each under its shard's lease in
//!    a Txn that compares the owner's epoch and each key's mod revision, so a batch that lost a
//!    race with the watch changes nothing and is read again;
//! 5. count the keys on every lease that took part (by lease membership) and record the counts,
//!    as the shares of those shards in what the watch counts for them: the count runs beside the
//!    watch, and a batch landing beside it would otherwise be counted twice, or not at all, in the
//!    worker's key count (which its status, its metrics and the peer's inbound view show). A split
//!    moves keys; it never adds or removes one.
//!
//! A worker that dies anywhere in a split leaves every key on a live, recorded lease, and the
//! checkpoint still counts the keys the old lease carries: the shard stays over the cap, so the
//! successor splits it again, and that split moves what the first left behind. Listings are
//! decoded up to the KV client's limit (`leases::rpc`), past the lease client's 4 MiB.
use crate::keys;
use crate::mirror::context::{State, Worker};
use crate::mirror::leases::rpc::lease_keys;
use crate::mirror::leases::shards::Layout;
use crate::mirror::plan::TxnLimits;
use crate::mirror::streams::apply::Applied;
use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};
use std::collections::{BTreeSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;
use tracing::info;

type StepFuture = Pin<Box<dyn Future<Output = anyhow::Result<StepDone>> + Send>>;

/// What a step's IO found.
pub(in crate::mirror) enum StepDone {
    /// The new lease, and when it was asked for.
    Granted(i64, std::time::Instant),
    Recorded(Applied),
    Listed(Vec<Vec<u8>>),
    /// Keys moved; keys to read again (a race with the watch, or past the batch's bytes).
    Moved {
        again: Vec<Vec<u8>>,
    },
    Fenced(String),
    /// Keys on each counted shard's lease.
    Counted(Vec<(usize, i64)>),
}

enum Stage {
    Granting,
    /// The layout the split makes, being recorded.
    Recording {
        layout: Layout,
        lease: i64,
    },
    /// Recorded and in use; the old lease is listed once the batch in flight has landed.
    ToList,
    Listing,
    Moving(VecDeque<Vec<u8>>),
    Counting,
    Finishing,
}

/// A split in progress.
pub(in crate::mirror) struct Split {
    from: usize,
    to: usize,
    /// Every shard whose lease took keys in this split (`to`, and those of keys an earlier split
    /// left behind): their leases are counted at the end.
    touched: BTreeSet<usize>,
    stage: Stage,
    step: Option<StepFuture>,
}

/// What the watch loop does after a step.
pub(in crate::mirror) enum Advance {
    Going,
    Done,
    Fenced(String),
}

impl Split {
    /// Whether a step's IO is running.
    pub fn running(&self) -> bool {
        self.step.is_some()
    }

    /// The running step's outcome.
    pub async fn step(&mut self) -> anyhow::Result<StepDone> {
        match self.step.as_mut() {
            Some(step) => step.await,
            None => std::future::pending().await,
        }
    }

    /// Lets the running step finish (its Txn may still land) before the watch ends. Who fenced
    /// it, if someone did; an error when its outcome is unknown (a Txn that timed out may still
    /// land, so the session must end and the next one fence it under a new epoch).
    pub async fn settle(mut self) -> anyhow::Result<Option<String>> {
        match self.step.take() {
            None => Ok(None),
            Some(step) => match step.await? {
                StepDone::Fenced(by) | StepDone::Recorded(Applied::Fenced(by)) => Ok(Some(by)),
                _ => Ok(None),
            },
        }
    }
}

/// The keys on `lease`, listed through a raw channel that decodes past 4 MiB (none when the lease
/// is gone).
async fn list_lease(target: &crate::mirror::EtcdTarget, lease: i64, timeout: Duration) -> anyhow::Result<Vec<Vec<u8>>> {
    let listing = async {
        let raw = target.connect_raw(false).await.map_err(|e| anyhow::anyhow!("connecting to list a lease: {e}"))?;
        lease_keys(&raw, lease).await.map_err(|e| anyhow::anyhow!("listing the keys of lease {lease}: {}", e.message()))
    };
    match tokio::time::timeout(timeout, listing).await {
        Err(_) => anyhow::bail!("listing the keys of lease {lease}: timed out after {timeout:?}"),
        Ok(listed) => Ok(listed?.unwrap_or_default()),
    }
}

/// The counted shards' new counts (pure): the count's shares of what the watch counts on those
/// shards, whose sum a split cannot change.
fn counts_as_shares(watched: &[i64], counted: &[(usize, i64)]) -> Vec<(usize, i64)> {
    let total: i64 = counted.iter().map(|(shard, _)| watched.get(*shard).copied().unwrap_or(0)).sum();
    let mut shares: Vec<i64> = counted.iter().map(|(_, count)| *count).collect();
    crate::mirror::context::rescale_counts(&mut shares, total);
    counted.iter().map(|(shard, _)| *shard).zip(shares).collect()
}

async fn bounded<T>(
    timeout: Duration,
    what: &str,
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(timeout, call).await {
        Err(_) => anyhow::bail!("{what}: timed out after {timeout:?}"),
        Ok(r) => Ok(r.map_err(|e| anyhow::anyhow!("{what}: {e}"))?),
    }
}

impl Worker {
    /// Starts splitting `shard` (one that can still split): grants the new lease.
    pub(in crate::mirror) fn start_split(&self, peer: &Client, shard: usize) -> Split {
        let (mut peer, ttl, timeout) = (peer.clone(), self.config.lease_ttl_seconds, self.config.rpc_timeout);
        let step: StepFuture = Box::pin(async move {
            let asked = std::time::Instant::now();
            let granted = bounded(timeout, "grant lease", peer.lease_grant(ttl, None)).await?;
            Ok(StepDone::Granted(granted.id(), asked))
        });
        Split { from: shard, to: 0, touched: BTreeSet::new(), stage: Stage::Granting, step: Some(step) }
    }

    /// Takes a step's outcome and moves the split on. Returns what the watch does, and whether
    /// the layout in use changed (the pending ops are then re-targeted).
    pub(in crate::mirror) fn advance_split(
        &self,
        task: &mut Split,
        done: StepDone,
        peer: &Client,
        state: &mut State,
        epoch: i64,
    ) -> anyhow::Result<(Advance, bool)> {
        task.step = None;
        let stage = std::mem::replace(&mut task.stage, Stage::Granting);
        match (stage, done) {
            (_, StepDone::Fenced(by)) | (_, StepDone::Recorded(Applied::Fenced(by))) => {
                return Ok((Advance::Fenced(by), false));
            }
            (Stage::Granting, StepDone::Granted(lease, asked)) => {
                self.keeper.granted(lease, asked);
                // Recorded before any write uses it: a successor keeps every lease that may hold keys.
                let mut layout = state.layout.clone();
                task.to = layout
                    .split(task.from)
                    .ok_or_else(|| anyhow::anyhow!("lease shard {} cannot split any deeper", task.from))?;
                let mut leases = state.leases.clone();
                leases.push(lease);
                let mut keys = state.recorded_keys.clone();
                keys.resize(leases.len() - 1, 0);
                keys.push(0);
                let record = self.checkpoint_for(state, &layout, &leases, &keys, state.applied, true);
                let write = self.checkpoint_write(state, &record);
                let apply = self.apply_checkpoint(peer, epoch, write, Vec::new());
                task.step = Some(Box::pin(async move { apply.await.map(StepDone::Recorded) }));
                task.stage = Stage::Recording { layout, lease };
            }
            (Stage::Recording { layout, lease }, StepDone::Recorded(Applied::Yes)) => {
                state.layout = layout;
                state.leases.push(lease);
                state.keys.push(0);
                self.keep_alive(state);
                info!(
                    shard = task.from,
                    new_shard = task.to,
                    lease,
                    "splitting an overfull lease shard; its keys move while the watch goes on"
                );
                self.shared.emit(crate::mirror::MirrorEvent::LeaseGranted { lease, shard: task.to });
                let leases = state.leases.len();
                self.shared.update(|h| {
                    h.shard_splits += 1;
                    h.leases = leases;
                });
                task.stage = Stage::ToList;
                return Ok((Advance::Going, true));
            }
            (Stage::Listing, StepDone::Listed(listed)) => {
                // Every key of the old lease that the layout places elsewhere moves: the new
                // shard's, and any an earlier split cut short left behind.
                let subtree = keys::region_prefix(&self.config.origin);
                let mut moving = VecDeque::new();
                for key in listed.into_iter().filter(|k| k.starts_with(subtree.as_bytes())) {
                    let shard = state.layout.shard_of(&key);
                    if shard != task.from {
                        state.keys[task.from] = (state.keys[task.from] - 1).max(0);
                        state.keys[shard] += 1;
                        task.touched.insert(shard);
                        moving.push_back(key);
                    }
                }
                task.touched.insert(task.to);
                task.stage = Stage::Moving(moving);
            }
            (Stage::Moving(mut moving), StepDone::Moved { again }) => {
                moving.extend(again);
                task.stage = Stage::Moving(moving);
            }
            (Stage::Counting, StepDone::Counted(counts)) => {
                let mut recorded = state.recorded_keys.clone();
                recorded.resize(state.leases.len(), 0);
                for (shard, count) in counts_as_shares(&state.keys, &counts) {
                    state.keys[shard] = count;
                    recorded[shard] = count;
                }
                let record = self.checkpoint_for(state, &state.layout, &state.leases, &recorded, state.applied, true);
                let write = self.checkpoint_write(state, &record);
                let apply = self.apply_checkpoint(peer, epoch, write, Vec::new());
                task.step = Some(Box::pin(async move { apply.await.map(StepDone::Recorded) }));
                task.stage = Stage::Finishing;
            }
            (Stage::Finishing, StepDone::Recorded(Applied::Yes)) => {
                info!(shard = task.from, new_shard = task.to, keys = state.keys[task.to], "lease shard split complete");
                return Ok((Advance::Done, false));
            }
            _ => anyhow::bail!("a lease shard split got a step out of order"),
        }
        Ok((Advance::Going, false))
    }

    /// Starts the split's next step when none is running and its turn has come
    /// (`sent_before_it_in_flight`: a batch sent before the new layout took effect has not landed).
    pub(in crate::mirror) fn drive_split(
        &self,
        task: &mut Split,
        peer: &Client,
        state: &State,
        epoch: i64,
        sent_before_it_in_flight: bool,
    ) {
        if task.running() {
            return;
        }
        let timeout = self.config.rpc_timeout;
        let subtree = keys::region_prefix(&self.config.origin);
        match &mut task.stage {
            // A batch sent before the layout changed may still put a key of the new shard on the
            // old lease: list the old lease once it has landed.
            Stage::ToList if !sent_before_it_in_flight => {
                let (target, lease) = (self.peer.clone(), state.leases[task.from]);
                task.step = Some(Box::pin(async move {
                    let listed = list_lease(&target, lease, timeout).await?;
                    Ok(StepDone::Listed(listed))
                }));
                task.stage = Stage::Listing;
            }
            Stage::Moving(moving) if moving.is_empty() => {
                let target = self.peer.clone();
                let shards: Vec<(usize, i64)> = std::iter::once(task.from)
                    .chain(task.touched.iter().copied())
                    .map(|shard| (shard, state.leases[shard]))
                    .collect();
                task.step = Some(Box::pin(async move {
                    let mut counts = Vec::with_capacity(shards.len());
                    for (shard, lease) in shards {
                        let listed = list_lease(&target, lease, timeout).await?;
                        counts
                            .push((shard, listed.iter().filter(|k| k.starts_with(subtree.as_bytes())).count() as i64));
                    }
                    Ok(StepDone::Counted(counts))
                }));
                task.stage = Stage::Counting;
            }
            Stage::Moving(moving) if !moving.is_empty() => {
                let limits = self.limits(state);
                let take = moving.len().min(limits.max_ops.max(1));
                let batch: Vec<Vec<u8>> = moving.drain(..take).collect();
                task.step = Some(self.move_step(peer, batch, state, epoch, limits));
            }
            _ => {}
        }
    }

    /// Reads `batch` from the peer and re-puts each key not on its shard's lease, in one Txn that
    /// compares the owner's epoch and each key's mod revision.
    fn move_step(
        &self,
        peer: &Client,
        batch: Vec<Vec<u8>>,
        state: &State,
        epoch: i64,
        limits: TxnLimits,
    ) -> StepFuture {
        let (layout, leases) = (state.layout.clone(), state.leases.clone());
        let owner_key = keys::owner_key(&self.config.origin);
        let timeout = self.config.rpc_timeout;
        let mut kv = crate::mirror::target::kv(peer);
        Box::pin(async move {
            let reads: Vec<TxnOp> = batch.iter().map(|k| TxnOp::get(k.clone(), None)).collect();
            let read = bounded(timeout, "read keys to move", kv.txn(Txn::new().and_then(reads))).await?;
            let mut compares = vec![Compare::mod_revision(owner_key.as_str(), CompareOp::Equal, epoch)];
            let (mut puts, mut put_keys, mut again, mut bytes) = (Vec::new(), Vec::new(), Vec::new(), 0usize);
            for response in read.op_responses() {
                let TxnOpResponse::Get(get) = response else { continue };
                for found in get.kvs() {
                    let target = leases[layout.shard_of(found.key())];
                    if found.lease() == target {
                        continue; // put by the watch already (a deleted key is not found at all)
                    }
                    let size = found.key().len() + found.value().len() + 24;
                    if !puts.is_empty() && bytes + size > limits.max_bytes {
                        again.push(found.key().to_vec());
                        continue;
                    }
                    bytes += size;
                    compares.push(Compare::mod_revision(found.key(), CompareOp::Equal, found.mod_revision()));
                    puts.push(TxnOp::put(found.key(), found.value(), Some(PutOptions::new().with_lease(target))));
                    put_keys.push(found.key().to_vec());
                }
            }
            if puts.is_empty() {
                return Ok(StepDone::Moved { again });
            }
            let txn = Txn::new().when(compares).and_then(puts).or_else([TxnOp::get(owner_key.as_str(), None)]);
            let resp = bounded(timeout, "move keys to their new lease", kv.txn(txn)).await?;
            if resp.succeeded() {
                return Ok(StepDone::Moved { again });
            }
            match crate::mirror::streams::apply::owner_of(&resp) {
                // Still ours: a key changed under the move; read them again.
                (revision, _) if revision == epoch => {
                    again.extend(put_keys);
                    Ok(StepDone::Moved { again })
                }
                (_, by) => Ok(StepDone::Fenced(by)),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_splits_count_moves_keys_between_its_shards_and_never_changes_their_total() {
        // The watch counts 100 keys on shards 0 and 3 (all still on 0's lease when the split began).
        let watched = [100, 5, 70, 0];
        // A batch that created a key of shard 3 landed just before the count read the leases, and
        // its delta is taken just after: the count says 101.
        let shares = counts_as_shares(&watched, &[(0, 60), (3, 41)]);
        assert_eq!(shares.iter().map(|(_, c)| c).sum::<i64>(), 100, "{shares:?}");
        assert_eq!(shares, vec![(0, 60), (3, 40)]);
        // Counted exactly: the count as it is.
        assert_eq!(counts_as_shares(&watched, &[(0, 58), (3, 42)]), vec![(0, 58), (3, 42)]);
    }
}
