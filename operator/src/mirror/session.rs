//! One session of a worker: connect, read the peer's records, decide ownership and where to
//! resume (`resume.rs`), keep the recorded leases alive before checking them, take a new fencing
//! epoch, then sync and watch. Also the fenced batch Txn every write of the mirror goes through.
use super::checkpoint::{Checkpoint, Owner, Progress};
use super::health::{MirrorEvent, Phase, ResyncCause};
use super::keepalive::KeeperSignal;
use super::keepalive::is_lease_not_found;
use super::plan::MirrorOp;
use super::resume::{OriginStatus, OwnerDecision, OwnerRecord, Ownership, decide_ownership, decide_resume};
use super::worker::{SessionEnd, State, Worker};
use crate::keys;
use anyhow::{Context, anyhow};
use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};
use futures::StreamExt;
use std::future::Future;
use tokio::sync::mpsc;
use tracing::{info, warn};

/// Lease checks in flight at once when a session starts.
const LEASE_CHECKS_IN_FLIGHT: usize = 64;

/// The peer's records for this origin, read together in one Txn.
pub(super) struct Records {
    pub owner: Option<OwnerRecord>,
    pub checkpoint: Option<Checkpoint>,
    /// How the peer stores the checkpoint (whole or in parts).
    pub stored: super::checkpoint::Stored,
    pub progress: Option<Progress>,
}

/// The outcome of one batch Txn.
pub(super) enum Applied {
    Yes,
    Fenced(String),
}

/// How a watch ended without an error.
pub(super) enum WatchEnd {
    Shutdown,
    Fenced(String),
    Resync(ResyncCause),
}

impl Worker {
    pub(super) async fn session(
        &self,
        state: &mut State,
        lost_tx: &mpsc::Sender<KeeperSignal>,
        lost_rx: &mut mpsc::Receiver<KeeperSignal>,
        backoff: &mut super::backoff::Backoff,
    ) -> anyhow::Result<SessionEnd> {
        self.shared.phase(Phase::Connecting);
        let (mut local, mut peer) =
            tokio::try_join!(async { self.local.connect().await.context("connecting to the local etcd") }, async {
                self.peer.connect().await.context("connecting to the peer etcd")
            },)?;
        let origin = self.origin_status(&mut local).await?;
        state.auth_binds = self.auth_binds(&peer).await?;
        state.lease_cap = super::plan::lease_cap(self.config.max_keys_per_lease, state.auth_binds);
        let records = self.read_records(&peer).await?;
        state.stored_checkpoint = records.stored.clone();
        let first_session = state.ownership.epoch.is_none();
        let (generation, restored) =
            match decide_ownership(&self.config.owner_id, &state.ownership, records.owner.as_ref()) {
                OwnerDecision::Fenced { by } => return Ok(SessionEnd::Fenced(by)),
                OwnerDecision::Take { generation, restored } => (generation, restored),
            };
        if restored {
            warn!("the peer's owner record went back (a restore of the peer?); resuming from what the peer holds");
        }

        // Keep every recorded lease alive first: checking hundreds of them one round trip at a
        // time, across regions, would otherwise outlast their TTL.
        let recorded = records.checkpoint.clone().unwrap_or_default();
        state.leases = recorded.leases.clone();
        state.retiring = recorded.retiring.clone();
        self.ensure_keeper(state, lost_tx);
        let alive = self.leases_alive(&peer, &recorded.leases).await?;
        let retiring_alive = self.leases_alive(&peer, &recorded.retiring).await?;
        let resume = decide_resume(
            records.checkpoint.as_ref(),
            records.progress.as_ref(),
            &alive,
            &retiring_alive,
            origin,
            state.resync_cause,
        );
        if resume.resync == Some(ResyncCause::OriginChanged) {
            warn!(
                cluster_id = origin.cluster_id,
                revision = origin.revision,
                "the origin etcd was restored or replaced; full sync"
            );
        }

        let epoch = self.acquire(&peer, records.owner.as_ref(), generation, resume.applied).await?;
        state.ownership = Ownership { epoch: Some(epoch), generation, take_over: false };
        state.layout = super::shards::Layout::recorded(&resume.slots, resume.leases.len());
        state.leases = resume.leases;
        state.keys = resume.keys;
        state.recorded_keys = state.keys.clone();
        state.retiring = resume.retiring;
        state.applied = resume.applied;
        state.synced = resume.resync.is_none();
        state.resync_cause = resume.resync;
        state.origin_cluster_id = origin.cluster_id;
        self.ensure_keeper(state, lost_tx);
        info!(epoch, generation, "owns the mirror on the peer for this session");

        let predecessor = records.progress.as_ref().map(|p| p.owner.as_str()).filter(|o| *o != self.config.owner_id);
        if state.synced && (first_session || predecessor.is_some()) {
            info!(leases = state.leases.len(), revision = state.applied, "adopted the leases recorded on the peer");
            self.shared.emit(MirrorEvent::LeasesAdopted { leases: state.leases.len(), revision: state.applied });
        }
        let (applied, total, leases, synced) =
            (state.applied, state.keys.iter().sum::<i64>(), state.leases.len(), state.synced);
        self.shared.update(|h| {
            if synced {
                h.last_applied_revision = applied;
                h.keys = total;
            }
            h.leases = leases;
            h.synced = synced;
        });

        loop {
            // The cause stays until a sync completes: a sync cut short by an error is redone by
            // the next session, never skipped for the watch.
            if let Some(cause) = state.resync_cause {
                if cause != ResyncCause::Initial {
                    self.shared.update(|h| h.resyncs += 1);
                }
                self.shared.emit(MirrorEvent::ResyncStarted { cause });
                info!(cause = cause.as_str(), "full sync");
                match self.sync(&mut local, &mut peer, state, cause, origin.cluster_id, lost_tx).await? {
                    Some(by) => return Ok(SessionEnd::Fenced(by)),
                    None => {
                        state.resync_cause = None;
                        backoff.reset();
                    }
                }
            }
            match self.watch(&mut local, &mut peer, state, lost_tx, lost_rx, backoff).await? {
                WatchEnd::Shutdown => return Ok(SessionEnd::Shutdown),
                WatchEnd::Fenced(by) => return Ok(SessionEnd::Fenced(by)),
                WatchEnd::Resync(cause) => {
                    self.ensure_keeper(state, lost_tx);
                    state.synced = false;
                    state.resync_cause = Some(cause);
                }
            }
        }
    }

    /// Whether auth binds this worker's user on the peer: a write outside the origin's prefixes
    /// is refused. Then every put attached to a lease costs a check of each key already on it
    /// (see `plan::lease_cap`). The probe Txn's compare never holds, so it writes nothing.
    async fn auth_binds(&self, peer: &Client) -> anyhow::Result<bool> {
        let probe = "/aether/v1/auth-probe";
        let never = Compare::version(probe, CompareOp::Less, 0);
        let txn = Txn::new().when([never]).and_then([TxnOp::put(probe, "", None)]);
        match tokio::time::timeout(self.config.rpc_timeout, super::target::kv(peer).txn(txn)).await {
            Ok(Err(e)) if e.to_string().contains("permission denied") => {
                info!("auth binds this user on the peer: lease shards stay small and a sync fills each lease at once");
                Ok(true)
            }
            Ok(Err(e)) => Err(anyhow::Error::new(e).context("probing the peer's auth")),
            Err(_) => anyhow::bail!("probing the peer's auth: timed out after {:?}", self.config.rpc_timeout),
            Ok(Ok(_)) => Ok(false),
        }
    }

    /// The origin's cluster id and current revision.
    async fn origin_status(&self, local: &mut Client) -> anyhow::Result<OriginStatus> {
        let status = self.rpc("origin status", local.status()).await?;
        let header = status.header().ok_or_else(|| anyhow!("status response without header"))?;
        Ok(OriginStatus { cluster_id: header.cluster_id(), revision: header.revision() })
    }

    /// The owner, checkpoint and progress records, read at one revision.
    pub(super) async fn read_records(&self, peer: &Client) -> anyhow::Result<Records> {
        let origin = &self.config.origin;
        let txn = Txn::new().and_then([
            TxnOp::get(keys::owner_key(origin), None),
            TxnOp::get(keys::checkpoint_key(origin), None),
            TxnOp::get(keys::progress_key(origin), None),
        ]);
        let mut kv = super::target::kv(peer);
        let resp = self.rpc("read the mirror's records", kv.txn(txn)).await?;
        let revision = resp.header().map_or(0, |h| h.revision());
        let mut gets = resp.op_responses().into_iter().map(|r| match r {
            TxnOpResponse::Get(get) => get.kvs().first().map(|kv| (kv.mod_revision(), kv.value().to_vec())),
            _ => None,
        });
        let (owner, checkpoint, progress) = (gets.next().flatten(), gets.next().flatten(), gets.next().flatten());
        let header = checkpoint.and_then(|(_, v)| Checkpoint::decode(&v));
        let (checkpoint, stored) = self
            .rpc("read the checkpoint's parts", super::records::complete(&mut kv, origin, header, revision))
            .await?;
        Ok(Records {
            owner: owner.map(|(mod_revision, value)| OwnerRecord { mod_revision, owner: Owner::decode(&value) }),
            checkpoint,
            stored,
            progress: progress.and_then(|(_, v)| Progress::decode(&v)),
        })
    }

    /// Whether each lease is alive, checked in parallel (0 is never alive).
    pub(super) async fn leases_alive(&self, peer: &Client, ids: &[i64]) -> anyhow::Result<Vec<bool>> {
        let checks = futures::stream::iter(ids.iter().copied())
            .map(|id| {
                let mut peer = peer.clone();
                async move {
                    if id == 0 {
                        return Ok(false);
                    }
                    match tokio::time::timeout(self.config.rpc_timeout, peer.lease_time_to_live(id, None)).await {
                        Err(_) => Err(anyhow!("lease time-to-live: timed out after {:?}", self.config.rpc_timeout)),
                        Ok(Ok(resp)) => Ok(resp.ttl() > 0),
                        Ok(Err(e)) if is_lease_not_found(&e) => Ok(false),
                        Ok(Err(e)) => Err(anyhow!(e).context("lease time-to-live")),
                    }
                }
            })
            .buffered(LEASE_CHECKS_IN_FLIGHT);
        checks.collect::<Vec<_>>().await.into_iter().collect()
    }

    /// Writes the owner record (a new epoch: its mod revision) and the progress record under this
    /// worker's name, if the owner record is still what was read.
    async fn acquire(
        &self,
        peer: &Client,
        read: Option<&OwnerRecord>,
        generation: u64,
        applied: i64,
    ) -> anyhow::Result<i64> {
        let key = keys::owner_key(&self.config.origin);
        let compare = match read {
            Some(r) => Compare::mod_revision(key.as_str(), CompareOp::Equal, r.mod_revision),
            None => Compare::version(key.as_str(), CompareOp::Equal, 0),
        };
        let owner = Owner {
            owner: self.config.owner_id.clone(),
            acquired_at: k8s_openapi::jiff::Timestamp::now().to_string(),
            generation,
        };
        let txn = Txn::new()
            .when([compare])
            .and_then([TxnOp::put(key.as_str(), serde_json::to_vec(&owner)?, None), self.progress_op(applied)]);
        let resp = self.rpc("take ownership", super::target::kv(peer).txn(txn)).await?;
        if !resp.succeeded() {
            anyhow::bail!("another worker changed the owner of this mirror while this one took over; retrying");
        }
        resp.header().map(|h| h.revision()).ok_or_else(|| anyhow!("txn response without header"))
    }

    /// The progress record raised to `revision`, never lowered: a nested Txn that writes it only
    /// over a lower record (or none). Watch batches in flight together may land in any order;
    /// each carries a revision the peer held completely when it was sent.
    pub(super) fn raise_progress_op(&self, revision: i64) -> TxnOp {
        let key = keys::progress_key(&self.config.origin);
        let value = self.progress_value(revision);
        let put = || TxnOp::put(key.as_str(), value.clone(), None);
        let absent = Txn::new().when([Compare::version(key.as_str(), CompareOp::Equal, 0)]).and_then([put()]);
        TxnOp::txn(
            Txn::new()
                .when([Compare::value(key.as_str(), CompareOp::Less, value.clone())])
                .and_then([put()])
                .or_else([TxnOp::txn(absent)]),
        )
    }

    /// One batch Txn: `ops` (each put on its shard's lease) and `bookkeeping`, applied only while
    /// the owner key still has this session's epoch, so that neither a deposed worker nor a late
    /// Txn of this worker's own earlier session can interleave with the current writer.
    pub(super) fn apply(
        &self,
        peer: &Client,
        epoch: i64,
        ops: Vec<MirrorOp>,
        leases: &[i64],
        bookkeeping: Vec<TxnOp>,
    ) -> impl Future<Output = anyhow::Result<Applied>> + Send + 'static {
        let owner_key = keys::owner_key(&self.config.origin);
        let mut txn_ops: Vec<TxnOp> = ops
            .into_iter()
            .map(|op| match op {
                MirrorOp::Put { key, value, shard } => {
                    TxnOp::put(key, value, Some(PutOptions::new().with_lease(leases[shard])))
                }
                MirrorOp::Delete { key } => TxnOp::delete(key, None),
            })
            .collect();
        txn_ops.extend(bookkeeping);
        let fence = Compare::mod_revision(owner_key.as_str(), CompareOp::Equal, epoch);
        let txn = Txn::new().when([fence]).and_then(txn_ops).or_else([TxnOp::get(owner_key.as_str(), None)]);
        let timeout = self.config.rpc_timeout;
        let shared = self.shared.clone();
        let mut kv = super::target::kv(peer);
        async move {
            let resp = match tokio::time::timeout(timeout, kv.txn(txn)).await {
                Err(_) => anyhow::bail!("peer txn: timed out after {timeout:?}"),
                Ok(r) => r.context("peer txn")?,
            };
            shared.detector_success();
            if resp.succeeded() {
                return Ok(Applied::Yes);
            }
            Ok(Applied::Fenced(owner_of(&resp).1))
        }
    }
}

impl Worker {
    /// Writes a checkpoint as planned: the Txns that come first (parts under a new id), then the
    /// commit with `bookkeeping`; each fenced like every batch. Stops at the first fenced one.
    pub(super) fn apply_checkpoint(
        &self,
        peer: &Client,
        epoch: i64,
        write: super::checkpoint::CheckpointWrite,
        mut bookkeeping: Vec<TxnOp>,
    ) -> impl Future<Output = anyhow::Result<Applied>> + Send + 'static {
        let before: Vec<_> = write
            .before
            .into_iter()
            .map(|txn| self.apply(peer, epoch, Vec::new(), &[], super::records::txn_ops(txn)))
            .collect();
        bookkeeping.extend(super::records::txn_ops(write.commit));
        let commit = self.apply(peer, epoch, Vec::new(), &[], bookkeeping);
        async move {
            for txn in before {
                if let Applied::Fenced(by) = txn.await? {
                    return Ok(Applied::Fenced(by));
                }
            }
            commit.await
        }
    }
}

/// The owner record's mod revision and owner from a fenced Txn's failure branch (revision 0
/// when the owner key is gone).
pub(super) fn owner_of(resp: &etcd_client::TxnResponse) -> (i64, String) {
    resp.op_responses()
        .into_iter()
        .find_map(|r| match r {
            TxnOpResponse::Get(get) => get.kvs().first().map(|kv| {
                let owner = Owner::decode(kv.value()).map_or_else(|| "unknown".to_string(), |o| o.owner);
                (kv.mod_revision(), owner)
            }),
            _ => None,
        })
        .unwrap_or_else(|| (0, "nobody (the owner key was deleted)".to_string()))
}
