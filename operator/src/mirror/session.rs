//! One session of a worker. The peer first: its records are read and every lease they name is
//! kept alive (or, when they cannot be read, every lease the origin's keys on the peer sit on)
//! before anything else, the origin included: a successor whose origin etcd is away must not let
//! the mirror lapse. Then the origin, ownership (a new fencing epoch, taken only if the records
//! are still what was read) and where to resume (`records::resume`), then sync and watch.
use super::context::{State, Worker};
use super::health::Refusal;
use super::health::{MirrorEvent, Phase, ResyncCause};
use super::leases::keeper::KeeperSignal;
use super::leases::keeper::{most_ttl_left, same_etcd};
use super::plan::Oversized;
use super::records::checkpoint::{Owner, Progress, SENT_UNKNOWN};
use super::records::resume::{
    Claimant, Contest, OriginStatus, OwnerDecision, Ownership, decide_contest, decide_ownership, decide_resume,
    granted_under_another_ttl, local_holds_copy, onto_new_leases, peer_is_origin, taken_from_another,
};
use super::records::store::{Records, read_records};
use super::streams::spread::Spread;
use super::streams::watch::WatchEnd;
use super::sync_slots::SyncSlot;
use crate::keys;
use anyhow::{Context, anyhow};
use etcd_client::{Client, Compare, CompareOp, GetOptions, Txn, TxnOp, TxnOpResponse};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing::{info, warn};

/// How a session ended without an error.
pub(super) enum SessionEnd {
    Shutdown,
    Fenced(String),
    /// The mirror was retired from the peer (its RegionPeering deleted): never take it back.
    Retired(String),
    /// The claim on the peer is refused: nothing was kept alive or written.
    Refused(Refusal),
    /// What comes next waits for a person: nothing was written, the recorded leases stay kept.
    Held(Refusal),
}

/// The leases kept alive from the records before anything else.
struct KeptLeases {
    leases: Vec<i64>,
    retiring: Vec<i64>,
}

/// What a session takes ownership with.
struct Taking {
    generation: u64,
    origin: OriginStatus,
    kept: KeptLeases,
    first_session: bool,
}

impl Worker {
    pub(super) async fn session(
        &self,
        state: &mut State,
        lost_rx: &mut mpsc::Receiver<KeeperSignal>,
        backoff: &mut crate::mirror::backoff::Backoff,
    ) -> anyhow::Result<SessionEnd> {
        self.shared.phase(Phase::Connecting);
        let mut peer = self.peer.connect().await.context("connecting to the peer etcd")?;
        // The Txns of the sync and the watch spread over more connections across distance.
        let mut spread = Spread::new(peer.clone());
        self.shared.update(|h| h.peer_connections = 1);
        // The auth probe writes nothing, so it flies beside the records' reads (a round trip less
        // across distance); the leases are kept without waiting for its answer. So does the
        // origin's status, which tells a peer that is the origin itself before anything is kept
        // or written when the origin answers by then.
        let probing = peer.clone();
        let probe = self.auth_binds(&probing);
        let origin = self.connect_origin();
        tokio::pin!(probe, origin);
        let (mut auth_binds, mut origin_early) = (None, None);
        let records = {
            let reading = self.read_records(&peer);
            tokio::pin!(reading);
            loop {
                tokio::select! {
                    records = &mut reading => break records?,
                    answer = &mut probe, if auth_binds.is_none() => auth_binds = Some(answer),
                    answer = &mut origin, if origin_early.is_none() => origin_early = Some(answer),
                }
            }
        };
        if let Some(Ok((local, _))) = &origin_early {
            self.measure_beside(state, local, &peer);
        }
        let claimant = self.claimant();
        if let Some(Ok((local, status))) = &origin_early
            && status.cluster_id == records.cluster_id
            && self.is_the_origin(local, &peer).await
        {
            return Ok(SessionEnd::Refused(peer_is_origin(&claimant, &self.config.origin, records.cluster_id)));
        }
        state.stored_checkpoint = records.stored.clone();
        let first_session = state.ownership.epoch.is_none();
        let generation = match self.decide_owner(state, &peer, &records, &claimant).await {
            Ok(generation) => generation,
            Err(end) => return Ok(end),
        };
        let kept = self.keep_recorded_leases(&peer, &records).await?;
        state.auth_binds = match auth_binds {
            Some(answer) => answer?,
            None => probe.await?,
        };
        let (mut local, origin) = match origin_early {
            Some(answer) => answer?,
            None => {
                let (local, origin) = origin.await?;
                self.measure_beside(state, &local, &peer);
                (local, origin)
            }
        };
        if origin.cluster_id == records.cluster_id && self.is_the_origin(&local, &peer).await {
            return Ok(SessionEnd::Refused(peer_is_origin(&claimant, &self.config.origin, records.cluster_id)));
        }
        // Before anything of the origin is read: an etcd holding a copy of this region is a
        // peer's, and what it lacks would be deleted everywhere. The copy is kept alive meanwhile.
        if let Some(holder) = self.local_holds_copy(&local).await? {
            return Ok(SessionEnd::Held(local_holds_copy(&self.config.origin, &holder)));
        }
        state.lease_cap = crate::mirror::plan::lease_cap(self.config.max_keys_per_lease, state.auth_binds);
        let taking = Taking { generation, origin, kept, first_session };
        state.sync_turn = match self.take_ownership(state, &local, &peer, &records, taking).await? {
            Ok(slot) => slot,
            Err(held) => return Ok(SessionEnd::Held(held)),
        };
        self.sync_and_watch(state, &mut local, &mut peer, &mut spread, lost_rx, backoff).await
    }

    /// Measures the peer's distance beside the session's next steps (status calls only), for
    /// the first sync's window and connections: not in round trips of its own after them.
    fn measure_beside(&self, state: &mut State, local: &Client, peer: &Client) {
        let measuring =
            crate::mirror::streams::sync::measure_distance(local.clone(), peer.clone(), self.config.rpc_timeout);
        if let Some(stale) = state.distance_ahead.replace(tokio::spawn(measuring)) {
            stale.abort();
        }
    }

    /// Whether this worker may own the mirror on the peer, from the owner record: the generation
    /// it takes, or how the session ends (fenced, retired, refused).
    async fn decide_owner(
        &self,
        state: &mut State,
        peer: &Client,
        records: &Records,
        claimant: &Claimant<'_>,
    ) -> Result<u64, SessionEnd> {
        let (generation, restored) = match decide_ownership(claimant, &state.ownership, records.owner.as_ref()) {
            OwnerDecision::Fenced { by } => return Err(SessionEnd::Fenced(by)),
            OwnerDecision::Retired { by } => return Err(SessionEnd::Retired(by)),
            OwnerDecision::Take { generation, restored } => (generation, restored),
            OwnerDecision::Contested { contest, generation } => {
                match self.contest(state, peer, records, &contest).await {
                    Some(refusal) => return Err(SessionEnd::Refused(refusal)),
                    None => (generation, false),
                }
            }
        };
        state.contest_seen = None;
        if restored {
            warn!("the peer's owner record went back (a restore of the peer?); resuming from what the peer holds");
        }
        Ok(generation)
    }

    /// Keeps alive, before anything else, every recorded lease, or, when the records cannot say,
    /// every lease the origin's keys on the peer are attached to.
    async fn keep_recorded_leases(&self, peer: &Client, records: &Records) -> anyhow::Result<KeptLeases> {
        let recorded = records.checkpoint.clone().unwrap_or_default();
        let orphans = match &records.checkpoint {
            Some(_) => Vec::new(),
            None if records.copy_empty => Vec::new(),
            None => self.leases_of_the_peers_copy(peer).await?,
        };
        let mut retiring = recorded.retiring.clone();
        retiring.extend(orphans.iter().filter(|id| !retiring.contains(id)).copied().collect::<Vec<_>>());
        self.keeper.keep(&recorded.leases, &retiring);
        if !orphans.is_empty() {
            warn!(
                leases = orphans.len(),
                "the peer's records of this mirror are unreadable: keeping every lease its keys are on alive until a resync moves them"
            );
        }
        Ok(KeptLeases { leases: recorded.leases, retiring })
    }

    /// Decides where to resume from the records and the leases still alive, takes a new epoch,
    /// and sets the session's state from both. When a full sync is owed, waits its turn first
    /// (`sync_slots.rs`) and returns the slot: the recorded leases are renewed meanwhile, and the
    /// owner record stays as it is until this worker is about to write.
    async fn take_ownership(
        &self,
        state: &mut State,
        local: &Client,
        peer: &Client,
        records: &Records,
        taking: Taking,
    ) -> anyhow::Result<Result<Option<SyncSlot>, Refusal>> {
        let Taking { generation, origin, kept, first_session } = taking;
        // Whether each lease is alive, from the peer's answers to the renewals.
        let ttl = Duration::from_secs(self.config.lease_ttl_seconds.max(1) as u64);
        let alive = self.keeper.liveness(&kept.leases, ttl, ttl).await?;
        let retiring_alive = self.keeper.liveness(&kept.retiring, ttl, ttl).await?;
        let resume = decide_resume(
            records.checkpoint.as_ref(),
            records.progress.as_ref(),
            &alive,
            &kept.retiring.iter().copied().zip(retiring_alive).collect::<Vec<_>>(),
            origin,
            state.resync_cause,
            state.synced_once,
        );
        // Leases live by the TTL they were granted: a TTL changed since moves the copy onto new
        // leases, the old ones renewed (by their own TTL) until it has.
        let granted = self.keeper.granted_ttls(&kept.leases);
        let resume = if granted_under_another_ttl(&granted, &alive, ttl) {
            let was: Vec<u64> = granted.iter().flatten().map(|t| t.as_secs()).collect();
            info!(granted = ?was, ttl = ttl.as_secs(), "the leases were granted under another TTL; the copy moves onto new leases");
            onto_new_leases(resume)
        } else {
            resume
        };
        if resume.resync == Some(ResyncCause::OriginChanged) {
            warn!(
                cluster_id = origin.cluster_id,
                revision = origin.revision,
                "the origin etcd was restored or replaced; full sync"
            );
        }
        // A copy found empty with the records needs no count: a sync deletes nothing of it (a
        // round trip less before a new peer's first key).
        if let Some(cause) = resume.resync.filter(|_| !records.copy_empty)
            && let Some(held) = self.resync_held(cause, local, peer).await?
        {
            warn!(reason = held.reason, message = %held.message, "a full sync would delete most of the copy; held");
            return Ok(Err(held));
        }
        let slot = match resume.resync {
            Some(cause) => Some(self.sync_slot(cause).await),
            None => None,
        };
        let (epoch, may_hold_through) =
            self.acquire(peer, records, generation, resume.applied, origin.cluster_id).await?;
        self.shared.update(|h| h.refusal = None);
        state.ownership = Ownership { epoch: Some(epoch), generation, take_over: false };
        state.layout = crate::mirror::leases::shards::Layout::recorded(&resume.slots, resume.leases.len());
        state.leases = resume.leases;
        state.keys = resume.keys;
        state.recorded_keys = state.keys.clone();
        state.drifted.clear();
        state.retiring = resume.retiring;
        state.applied = resume.applied;
        state.synced = resume.resync.is_none();
        state.peer_may_hold_through = may_hold_through.filter(|_| state.synced);
        state.predecessor_copy_unknown =
            resume.resync.is_some() && taken_from_another(records.owner.as_ref(), &self.config.owner_id);
        state.synced_once |= state.synced;
        state.resync_cause = resume.resync;
        state.origin_cluster_id = origin.cluster_id;
        state.counts_estimated = state.synced;
        // Until a pass of its own, the walk's reads are bounded by the last sync's page ends.
        if state.walk.last_page_ends.is_empty() {
            state.walk.last_page_ends = records.page_ends.clone();
        }
        self.keep_alive(state);
        // The peer still lacks the values recorded as too large for it: said again by this
        // worker (a sync, if one follows, says which still are).
        let left_out = resume.left_out.into_iter().map(|l| Oversized { key: l.key, bytes: l.bytes }).collect();
        self.report_oversized(state, left_out, Vec::new());
        state.left_out_unrecorded = false;
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
        Ok(Ok(slot))
    }

    /// Whether a full sync of `cause` would delete more of the peer's live copy than the spec
    /// lets it without a person (`records::resume::resync_held`): counts both sides first.
    async fn resync_held(&self, cause: ResyncCause, local: &Client, peer: &Client) -> anyhow::Result<Option<Refusal>> {
        let prefix = keys::region_prefix(&self.config.origin);
        let count = GetOptions::new().with_prefix().with_count_only();
        let copy = self
            .rpc("count the peer's copy", crate::mirror::target::kv(peer).get(prefix.as_str(), Some(count.clone())))
            .await?;
        if copy.count() == 0 {
            return Ok(None);
        }
        let origin = self
            .rpc("count the origin's keys", crate::mirror::target::kv(local).get(prefix.as_str(), Some(count)))
            .await?;
        Ok(crate::mirror::records::resume::resync_held(
            cause,
            origin.count(),
            copy.count(),
            self.config.max_resync_delete_percent,
            &self.config.origin,
            &self.config.peer,
        ))
    }

    /// Who recorded a copy of this region in the local etcd, if it holds one (a user that may not
    /// read the records cannot tell, and nothing is held on a guess).
    async fn local_holds_copy(&self, local: &Client) -> anyhow::Result<Option<String>> {
        let key = keys::owner_key(&self.config.origin);
        let read = tokio::time::timeout(self.config.rpc_timeout, crate::mirror::target::kv(local).get(key, None)).await;
        match read {
            Ok(Ok(resp)) => Ok(resp.kvs().first().map(|kv| {
                Owner::decode(kv.value())
                    .map(|o| o.object.as_ref().map_or(o.owner.clone(), |obj| obj.describe()))
                    .unwrap_or_else(|| "an unreadable owner record".into())
                    .chars()
                    .take(200)
                    .collect()
            })),
            Ok(Err(e)) if e.to_string().contains("permission denied") => Ok(None),
            Ok(Err(e)) => Err(anyhow::Error::new(e).context("reading the local etcd's records")),
            Err(_) => anyhow::bail!("reading the local etcd's records: timed out after {:?}", self.config.rpc_timeout),
        }
    }

    /// A turn at a full sync among the origin's workers: at once when one is free, otherwise
    /// after waiting as `Queued`.
    async fn sync_slot(&self, cause: ResyncCause) -> SyncSlot {
        let slots = &self.config.sync_slots;
        if let Some(slot) = slots.try_take() {
            return slot;
        }
        self.shared.phase(Phase::Queued);
        info!(
            cause = cause.as_str(),
            at_once = slots.size(),
            "a full sync is owed; waiting for the origin's other syncs"
        );
        let waited = Instant::now();
        let slot = slots.take().await;
        info!(waited_ms = waited.elapsed().as_millis() as u64, "the full sync's turn came");
        slot
    }

    /// Syncs when a sync is owed, then watches, until the session ends.
    async fn sync_and_watch(
        &self,
        state: &mut State,
        local: &mut Client,
        peer: &mut Client,
        spread: &mut Spread,
        lost_rx: &mut mpsc::Receiver<KeeperSignal>,
        backoff: &mut crate::mirror::backoff::Backoff,
    ) -> anyhow::Result<SessionEnd> {
        loop {
            // The cause stays until a sync completes: a sync cut short by an error is redone by
            // the next session, never skipped for the watch.
            if let Some(cause) = state.resync_cause {
                // A turn among the origin's syncs, held until this one ends (`sync_slots.rs`).
                let _turn = match state.sync_turn.take() {
                    Some(turn) => turn,
                    None => self.sync_slot(cause).await,
                };
                // Every full sync but the worker's first is a resync, counted with its cause.
                if cause != ResyncCause::Initial || state.synced_once {
                    self.shared.update(|h| {
                        h.resyncs += 1;
                        *h.resyncs_by_cause.entry(cause.label()).or_default() += 1;
                    });
                }
                self.shared.emit(MirrorEvent::ResyncStarted { cause });
                info!(cause = cause.as_str(), "full sync");
                let origin_cluster_id = state.origin_cluster_id;
                match self.sync(local, peer, spread, state, cause, origin_cluster_id).await? {
                    Some(by) => return Ok(SessionEnd::Fenced(by)),
                    None => {
                        state.resync_cause = None;
                        state.synced_once = true;
                        backoff.reset();
                    }
                }
            }
            match self.watch(local, peer, spread, state, lost_rx, backoff).await? {
                WatchEnd::Shutdown => return Ok(SessionEnd::Shutdown),
                WatchEnd::Fenced(by) => return Ok(SessionEnd::Fenced(by)),
                WatchEnd::Resync(cause) => {
                    self.keep_alive(state);
                    state.synced = false;
                    state.resync_cause = Some(cause);
                }
            }
        }
    }

    /// The leases the origin's keys on the peer are attached to, read page by page (keys only)
    /// and each page's kept alive at once: the records could not say which leases hold keys.
    async fn leases_of_the_peers_copy(&self, peer: &Client) -> anyhow::Result<Vec<i64>> {
        let prefix = keys::region_prefix(&self.config.origin);
        let end = keys::prefix_range_end(prefix.as_bytes());
        let mut from = prefix.into_bytes();
        let mut found: Vec<i64> = Vec::new();
        loop {
            let options = GetOptions::new().with_range(end.clone()).with_keys_only().with_limit(self.config.page_size);
            let page = self
                .rpc("list the peer's copy", crate::mirror::target::kv(peer).get(from.clone(), Some(options)))
                .await?;
            let fresh: Vec<i64> =
                page.kvs().iter().map(|kv| kv.lease()).filter(|l| *l != 0 && !found.contains(l)).collect();
            let mut fresh_unique = fresh.clone();
            fresh_unique.sort_unstable();
            fresh_unique.dedup();
            self.keeper.add_retiring(&fresh_unique);
            found.extend(fresh_unique);
            match page.kvs().last() {
                Some(last) if page.more() => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => return Ok(found),
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

    /// This worker's claim on the peer.
    pub(super) fn claimant(&self) -> Claimant<'_> {
        Claimant { owner_id: &self.config.owner_id, object: self.config.object.as_ref(), peer: &self.config.peer }
    }

    /// Whether the peer, which answers with the origin's cluster id, is the origin etcd itself
    /// rather than another etcd bootstrapped from the same configuration. When the probe gets no
    /// answer it counts as the origin: refusing is safe, mirroring a region into itself is not.
    async fn is_the_origin(&self, local: &Client, peer: &Client) -> bool {
        match same_etcd(local, peer, self.config.rpc_timeout).await {
            Some(same) => {
                if !same {
                    warn!(
                        "the peer's etcd has the origin's cluster id but is another etcd (both were bootstrapped from the same configuration); mirroring into it"
                    );
                }
                same
            }
            None => true,
        }
    }

    /// A connection to the origin etcd and what it answers now.
    async fn connect_origin(&self) -> anyhow::Result<(Client, OriginStatus)> {
        let mut local = self.local.connect().await.context("connecting to the local etcd")?;
        let status = self.origin_status(&mut local).await?;
        Ok((local, status))
    }

    /// Another claim owns the mirror: refused while its leases live, taken over once they have
    /// all lapsed (its owner is gone). Reads the leases' time to live without renewing them.
    async fn contest(&self, state: &mut State, peer: &Client, records: &Records, contest: &Contest) -> Option<Refusal> {
        let epoch = records.owner.as_ref().map_or(0, |r| r.mod_revision);
        let seen_since = match state.contest_seen {
            Some((seen, at)) if seen == epoch => at,
            _ => state.contest_seen.insert((epoch, Instant::now())).1,
        };
        let leases: Vec<i64> = records
            .checkpoint
            .iter()
            .flat_map(|c| c.leases.iter().chain(&c.retiring))
            .copied()
            .filter(|id| *id != 0)
            .collect();
        let alive = match leases.is_empty() {
            true => None,
            // A peer that cannot say counts as alive: never take over on a guess.
            false => Some(most_ttl_left(peer, &leases, self.config.rpc_timeout).await.is_none_or(|ttl| ttl > 0)),
        };
        let ttl = Duration::from_secs(self.config.lease_ttl_seconds.max(1) as u64);
        if decide_contest(alive, seen_since.elapsed(), ttl) {
            return Some(contest.refusal(
                &self.claimant(),
                &self.config.origin,
                records.cluster_id,
                self.config.lease_ttl_seconds,
            ));
        }
        warn!(?contest, "the other claim on this mirror renews nothing any more (its leases lapsed); taking it over");
        None
    }

    /// The origin's cluster id and current revision.
    async fn origin_status(&self, local: &mut Client) -> anyhow::Result<OriginStatus> {
        let status = self.rpc("origin status", local.status()).await?;
        let header = status.header().ok_or_else(|| anyhow!("status response without header"))?;
        Ok(OriginStatus { cluster_id: header.cluster_id(), revision: header.revision() })
    }

    /// Writes the owner record (a new epoch: its mod revision) and the progress record under this
    /// worker's name, if the records are still what this session read: a predecessor still
    /// running may have recorded a lease since (a split), which this session must keep alive.
    async fn acquire(
        &self,
        peer: &Client,
        read: &Records,
        generation: u64,
        applied: i64,
        origin_cluster_id: u64,
    ) -> anyhow::Result<(i64, Option<i64>)> {
        let origin = &self.config.origin;
        let key = keys::owner_key(origin);
        let owner_unchanged = match &read.owner {
            Some(r) => Compare::mod_revision(key.as_str(), CompareOp::Equal, r.mod_revision),
            None => Compare::version(key.as_str(), CompareOp::Equal, 0),
        };
        let parts = keys::checkpoint_parts_prefix(origin);
        let not_since = read.revision + 1;
        let checkpoint_unchanged = Compare::mod_revision(keys::checkpoint_key(origin), CompareOp::Less, not_since);
        let parts_unchanged = Compare::mod_revision(parts.as_str(), CompareOp::Less, not_since)
            .with_range(keys::prefix_range_end(parts.as_bytes()));
        let owner = Owner {
            owner: self.config.owner_id.clone(),
            acquired_at: k8s_openapi::jiff::Timestamp::now().to_string(),
            generation,
            object: self.config.object.clone(),
            origin_cluster_id,
            peer: self.config.peer.clone(),
            ..Default::default()
        };
        // The progress record as the predecessor left it, read in the Txn that fences it: no Txn
        // of its lands after this one, so what it sent past `applied` is known. The record stays
        // as it is: every batch of this session records at least that much (see `pipeline.rs`),
        // so a session that dies before any of its batches lands leaves its successor the same
        // bound, not an unknown one that would make a successor next door coalesce, and split,
        // everything up to the origin's head.
        let progress = keys::progress_key(origin);
        let txn = Txn::new()
            .when([owner_unchanged, checkpoint_unchanged, parts_unchanged])
            .and_then([TxnOp::get(progress.as_str(), None), TxnOp::put(key.as_str(), owner.encode(), None)]);
        let resp = self.rpc("take ownership", crate::mirror::target::kv(peer).txn(txn)).await?;
        self.shared.detector_success();
        if !resp.succeeded() {
            anyhow::bail!(
                "the mirror's records on the peer changed while this worker took over (a predecessor still writing?); reading them again"
            );
        }
        let epoch = resp.header().map(|h| h.revision()).ok_or_else(|| anyhow!("txn response without header"))?;
        let left = resp.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(get) => get.kvs().first().map(|kv| Progress::decode(kv.value())),
            _ => None,
        });
        let may_hold_through = match left.flatten() {
            Some(record) => record.peer_may_hold_through(applied),
            None => Some(SENT_UNKNOWN),
        };
        Ok((epoch, may_hold_through))
    }

    /// The peer's records for this origin, within the RPC deadline.
    pub(super) async fn read_records(&self, peer: &Client) -> anyhow::Result<Records> {
        let records = self.rpc("read the mirror's records", read_records(peer, &self.config.origin)).await?;
        self.shared.detector_success();
        Ok(records)
    }
}
