//! One session of a worker: connect, read the peer's records, decide ownership and where to
//! resume (`resume.rs`), keep the recorded leases alive before checking them, take a new fencing
//! epoch, then sync and watch. Also the fenced batch Txn every write of the mirror goes through.
use crate::keys;
use crate::mirror::context::{State, Worker};
use crate::mirror::health::{MirrorEvent, Phase, ResyncCause};
use crate::mirror::leases::keeper::{KeeperSignal, leases_alive};
use crate::mirror::records::checkpoint::Owner;
use crate::mirror::records::resume::{
    OriginStatus, OwnerDecision, OwnerRecord, Ownership, decide_ownership, decide_resume,
};
use crate::mirror::records::store::{Records, read_records};
use crate::mirror::streams::watch::WatchEnd;
use anyhow::{Context, anyhow};
use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};
use tokio::sync::mpsc;
use tracing::{info, warn};

/// How a session ended without an error.
pub(super) enum SessionEnd {
    Shutdown,
    Fenced(String),
}

impl Worker {
    pub(super) async fn session(
        &self,
        state: &mut State,
        lost_tx: &mpsc::Sender<KeeperSignal>,
        lost_rx: &mut mpsc::Receiver<KeeperSignal>,
        backoff: &mut crate::mirror::backoff::Backoff,
    ) -> anyhow::Result<SessionEnd> {
        self.shared.phase(Phase::Connecting);
        let (mut local, mut peer) =
            tokio::try_join!(async { self.local.connect().await.context("connecting to the local etcd") }, async {
                self.peer.connect().await.context("connecting to the peer etcd")
            },)?;
        let origin = self.origin_status(&mut local).await?;
        state.auth_binds = self.auth_binds(&peer).await?;
        state.lease_cap = crate::mirror::plan::lease_cap(self.config.max_keys_per_lease, state.auth_binds);
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
        let alive = leases_alive(&peer, &recorded.leases, self.config.rpc_timeout).await?;
        let retiring_alive = leases_alive(&peer, &recorded.retiring, self.config.rpc_timeout).await?;
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
        state.layout = crate::mirror::leases::shards::Layout::recorded(&resume.slots, resume.leases.len());
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
        match tokio::time::timeout(self.config.rpc_timeout, crate::mirror::target::kv(peer).txn(txn)).await {
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
        let resp = self.rpc("take ownership", crate::mirror::target::kv(peer).txn(txn)).await?;
        if !resp.succeeded() {
            anyhow::bail!("another worker changed the owner of this mirror while this one took over; retrying");
        }
        resp.header().map(|h| h.revision()).ok_or_else(|| anyhow!("txn response without header"))
    }

    /// The peer's records for this origin, within the RPC deadline.
    pub(super) async fn read_records(&self, peer: &Client) -> anyhow::Result<Records> {
        self.rpc("read the mirror's records", read_records(peer, &self.config.origin)).await
    }
}
