//! The full sync: the origin's subtree at one revision, diffed page by page against the peer's
//! copy (value and lease), applied in parallel batches. Pages are sized by bytes as well as keys,
//! so that large values never make a response the client cannot decode.
//!
//! The canary on the peer says whether the peer holds the origin's complete snapshot: it is
//! written `synced: false` (with the cause) before any key moves and `synced: true` with the
//! revision once every key is in place, in the same Txn as the checkpoint. A consumer that finds
//! no canary, or `synced: false`, must not read "no endpoints" as "the origin has none".
use crate::keys;
use crate::mirror::context::{State, Worker};
use crate::mirror::health::{MirrorEvent, Phase, ResyncCause};
use crate::mirror::leases::shards::{Layout, needs_reshard, shard_count};
use crate::mirror::origin_reads::{Copying, PageKey, Pinned, Reuse, SharedPage};
use crate::mirror::plan::{
    Kv, MAX_SYNC_INFLIGHT_BYTES, MirrorOp, Oversized, SYNC_GROUP_BYTES, SyncBatcher, SyncReads, distance,
    enforce_request_limit, group_by_shard, merge_step, next_page_limit, spread_connections, sync_page_size,
    sync_window,
};
use crate::mirror::records::checkpoint::SENT_UNKNOWN;
use crate::mirror::streams::apply::Applied;
use crate::mirror::streams::pace::SyncPace;
use crate::mirror::streams::spread::Spread;
use crate::mirror::target::kv;
use crate::mirror::verify::Walk;
use anyhow::anyhow;
use etcd_client::{Client, GetOptions, GetResponse, PutOptions, TxnOp};
use futures::StreamExt;
use std::collections::VecDeque;
use tracing::{Instrument, debug, info, warn};

/// How long a sync's page reader waits for the process's memory budget to have room.
const PAGE_ROOM_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Lease grants in flight at once when a sync lays out its leases: the layout of 100k keys
/// (256 leases) in one round trip, 16k in 64 rather than all at once.
const GRANTS_IN_FLIGHT: usize = 256;

/// Room kept in every request for the bookkeeping puts and framing.
pub(in crate::mirror) const RESERVED_REQUEST_BYTES: usize = 64 * 1024;

/// What of a snapshot another sync of the region pinned moments ago this one may copy (pure):
/// nothing after the origin was restored or replaced, nor after taking the mirror over from
/// another process whose sync was cut short (`predecessor_copy_unknown`: that sync's snapshot is
/// recorded nowhere, and may be newer than one this process pinned before the takeover, while a
/// snapshot pinned after it is newer than anything the fenced predecessor landed); otherwise one
/// no older than anything the worker may have sent its peer (what it applied, what its watch saw,
/// what a predecessor's last Txns may have landed). A resync the watch asks for (a reshard, a lost
/// lease) comes after the watch sent newer revisions than the snapshot the last sync copied.
pub fn reuse(
    cause: ResyncCause,
    applied: i64,
    seen: i64,
    may_hold_through: Option<i64>,
    predecessor_copy_unknown: bool,
) -> Reuse {
    if cause == ResyncCause::OriginChanged || predecessor_copy_unknown {
        return Reuse::Never;
    }
    let predecessor = may_hold_through.filter(|through| *through != SENT_UNKNOWN).unwrap_or(0);
    Reuse::NoOlderThan(applied.max(seen).max(predecessor))
}

impl Worker {
    /// The full sync. Returns who fenced us, if someone did.
    pub(in crate::mirror) async fn sync(
        &self,
        local: &mut Client,
        peer: &mut Client,
        spread: &mut Spread,
        state: &mut State,
        cause: ResyncCause,
        origin_cluster_id: u64,
    ) -> anyhow::Result<Option<String>> {
        let phase = if cause == ResyncCause::Initial { Phase::Syncing } else { Phase::Resyncing };
        self.shared.update(|h| {
            h.phase = phase;
            h.synced = false;
        });
        state.synced = false;
        let epoch = state.ownership.epoch.ok_or_else(|| anyhow!("sync without ownership"))?;
        let seen = self.shared.health.borrow().last_seen_revision;
        let reuse = reuse(cause, state.applied, seen, state.peer_may_hold_through, state.predecessor_copy_unknown);
        let snapshot = self.snapshot_head(local, epoch, cause, reuse, origin_cluster_id).await?;
        plan_layout(state, snapshot.total);
        let (mut copy, reads) = match self.start_copy(local, peer, spread, state, &snapshot).await? {
            Started::Copying(copy, reads) => (copy, reads),
            Started::Fenced(by) => return Ok(Some(by)),
        };
        if let Some(by) = self.run_copy(&mut copy, reads, peer, spread, state, epoch).await? {
            return Ok(Some(by));
        }
        self.finish_sync(*copy, peer, state, &snapshot, origin_cluster_id).await
    }

    /// Pins the snapshot: the revision and size of the origin's subtree now, or those of the
    /// snapshot another of the region's syncs pinned moments ago (`origin_reads`).
    async fn snapshot_head(
        &self,
        local: &Client,
        epoch: i64,
        cause: ResyncCause,
        reuse: Reuse,
        cluster_id: u64,
    ) -> anyhow::Result<Snapshot> {
        let prefix = keys::region_prefix(&self.config.origin);
        let (pinned, copying) = self
            .config
            .origin_reads
            .pin(cluster_id, reuse, || async {
                let count = GetOptions::new().with_prefix().with_count_only();
                let head = self.rpc("count origin keys", kv(local).get(prefix.as_str(), Some(count))).await?;
                let revision =
                    head.header().map(|h| h.revision()).ok_or_else(|| anyhow!("range response without header"))?;
                Ok(Pinned { cluster_id, revision, total: head.count().max(0) as u64 })
            })
            .await?;
        Ok(Snapshot { revision: pinned.revision, total: pinned.total, epoch, cause, _copying: copying })
    }

    /// Lays out and records the leases, and reads the first pages of both sides meanwhile.
    async fn start_copy(
        &self,
        local: &Client,
        peer: &mut Client,
        spread: &mut Spread,
        state: &mut State,
        snapshot: &Snapshot,
    ) -> anyhow::Result<Started> {
        let prefix = keys::region_prefix(&self.config.origin);
        let range_end = keys::prefix_range_end(prefix.as_bytes());
        // The peer's distance sizes the window, and across distance the Txns spread over
        // connections of their own (as many as the subtree's Txns can use): measured while the
        // layout is granted and recorded (the status calls write nothing), not in more round
        // trips after; the connections open beside the first Txns, which go over those open.
        let (measure_local, measure_peer) = (local.clone(), peer.clone());
        let subtree_txns = (snapshot.total as usize).div_ceil(self.limits(state).max_ops.max(1));
        let measured_ahead = state.distance_ahead.take();
        let spread_more = async {
            let distance = match measured_ahead {
                Some(measuring) => self.nearest_of(measuring.await.ok().flatten()),
                None => self.peer_distance(&measure_local, &measure_peer).await,
            };
            let window = sync_window(self.config.sync_parallelism, distance);
            let wanted = spread_connections(distance, window.min(subtree_txns), self.spread_cap());
            spread.want(wanted, &self.peer, self.config.rpc_timeout);
            let last = self.last_sync_pace.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            SyncPace::resume(window, distance, last.as_ref())
        };
        // The peer's first page too (only this session writes the peer's copy now), and the
        // origin's first pages: under auth a group's worth, which the sync holds back anyway to
        // group it by lease (at 20k keys the grants took 55 ms and that read 73 ms, one after
        // the other).
        let page_size = sync_page_size(self.config.page_size, snapshot.total);
        let mut peer_pages = Pages::peer(&prefix, page_size);
        let first_peer_page = self.next_page(peer, &mut peer_pages, &range_end);
        let mut origin_pages = Pages::origin(&prefix, snapshot.revision, page_size);
        let ahead = if state.auth_binds { SYNC_GROUP_BYTES } else { 0 };
        let read_ahead = self.read_ahead(local, &mut origin_pages, &range_end, ahead);
        let lay_out = self.lay_out(peer, state, snapshot.epoch, snapshot.cause);
        let (pace, laid_out, first_peer_page, read_ahead) =
            tokio::join!(spread_more, lay_out, first_peer_page, read_ahead);
        if let Some(by) = laid_out? {
            return Ok(Started::Fenced(by));
        }
        let spread_over = spread.len();
        self.shared.update(|h| h.peer_connections = spread_over);
        let layout = state.layout.clone();
        let mut counts = vec![0i64; state.leases.len()];
        let origin_buf: VecDeque<Kv> = read_ahead?.into();
        for kv in &origin_buf {
            counts[layout.shard_of(&kv.key)] += 1;
        }
        let origin_page_ends = origin_buf.back().map(|kv| next_key(&kv.key)).into_iter().collect();
        let peer_buf: VecDeque<Kv> = first_peer_page?.into();
        self.shared.detector_success();
        let copy = SyncCopy {
            origin_done: origin_pages.done,
            peer_done: peer_pages.done,
            origin_page_ends,
            origin_buf,
            peer_buf,
            layout,
            leases: state.leases.clone(),
            counts,
            oversized: Vec::new(),
            pace,
        };
        let reads = Reads { local: local.clone(), origin: origin_pages, peer: peer_pages, range_end };
        Ok(Started::Copying(Box::new(copy), Box::new(reads)))
    }

    /// Copies the snapshot: both sides read page by page, merged into ops, the ops applied in
    /// a window of batch Txns. Each side's next page is read while the last one's ops are sent
    /// (`read_pages`): read only once the last was merged, every page's read left the window
    /// draining. Returns who fenced us, if someone did.
    async fn run_copy(
        &self,
        copy: &mut SyncCopy,
        reads: Box<Reads>,
        peer: &Client,
        spread: &mut Spread,
        state: &State,
        epoch: i64,
    ) -> anyhow::Result<Option<String>> {
        let (origin_tx, origin_rx) = tokio::sync::mpsc::channel(1);
        let (peer_tx, peer_rx) = tokio::sync::mpsc::channel(1);
        let readers = futures::future::join(
            self.read_pages(&reads.local, reads.origin, &reads.range_end, origin_tx),
            self.read_pages(peer, reads.peer, &reads.range_end, peer_tx),
        );
        let feeds = Feeds { origin: origin_rx, peer: peer_rx };
        let copying = self.copy_pages(copy, feeds, spread, state, epoch);
        tokio::pin!(readers, copying);
        // The readers end with their side's last page, or with the copy (it stopped listening).
        tokio::select! {
            copied = &mut copying => copied,
            _ = &mut readers => copying.await,
        }
    }

    /// The copy's merge and writes, fed the pages by `read_pages`; the pace they ended at is
    /// kept for the worker's next sync, however this one ends.
    async fn copy_pages(
        &self,
        copy: &mut SyncCopy,
        feeds: Feeds,
        spread: &mut Spread,
        state: &State,
        epoch: i64,
    ) -> anyhow::Result<Option<String>> {
        let mut txns = SyncTxns::new(copy.pace.clone(), self.config.memory.share());
        let copied = self.merge_and_write(copy, feeds, &mut txns, spread, state, epoch).await;
        let (window, limit, cuts) = (txns.pace.window(), txns.pace.limit(), txns.pace.cuts());
        self.shared.update(|h| {
            h.sync_window = window;
            h.sync_window_limit = limit;
            h.sync_window_cuts = cuts;
        });
        *self.last_sync_pace.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(txns.pace);
        copied
    }

    /// Merges the pages of both sides into ops and writes them in batch Txns, paced by `txns`.
    async fn merge_and_write(
        &self,
        copy: &mut SyncCopy,
        mut feeds: Feeds,
        txns: &mut SyncTxns,
        spread: &mut Spread,
        state: &State,
        epoch: i64,
    ) -> anyhow::Result<Option<String>> {
        let mut batcher = SyncBatcher::new(self.limits(state));
        let (mut staged, mut staged_bytes) = (Vec::new(), 0usize);
        loop {
            let read_all = self.read_and_merge(copy, &mut feeds, &mut staged, &mut staged_bytes).await?;
            // Under auth, ops wait to be grouped by lease (see `group_by_shard`).
            if state.auth_binds && staged_bytes < SYNC_GROUP_BYTES && !read_all {
                continue;
            }
            if state.auth_binds {
                group_by_shard(&mut staged);
            }
            staged_bytes = 0;
            for op in staged.drain(..) {
                let Some(batch) = batcher.push(op) else { continue };
                let bytes: usize = batch.iter().map(MirrorOp::wire_size).sum();
                if let Some(by) = txns.make_room(bytes, spread).await? {
                    return Ok(Some(by));
                }
                // Renewals first: while they fail, what is in flight lands before more is sent.
                if self.renewals_failing() {
                    if let Some(by) = txns.settle_all().await? {
                        return Ok(Some(by));
                    }
                    self.renewals_first().await?;
                }
                txns.push(self.apply(spread.next(), epoch, batch, &copy.leases, Vec::new()), bytes);
                if let Some(by) = txns.take_ready()? {
                    return Ok(Some(by));
                }
            }
            if read_all {
                break;
            }
        }
        if let Some(batch) = batcher.take() {
            let bytes: usize = batch.iter().map(MirrorOp::wire_size).sum();
            if let Some(by) = txns.make_room(bytes, spread).await? {
                return Ok(Some(by));
            }
            txns.push(self.apply(spread.next(), epoch, batch, &copy.leases, Vec::new()), bytes);
        }
        let spread_over = spread.len();
        self.shared.update(|h| h.peer_connections = spread_over);
        txns.settle_all().await
    }

    /// Takes the next page of each side whose read-ahead is used up, and merges what both hold
    /// into ops, staged. Returns whether both sides are read to the end.
    async fn read_and_merge(
        &self,
        copy: &mut SyncCopy,
        feeds: &mut Feeds,
        staged: &mut Vec<MirrorOp>,
        staged_bytes: &mut usize,
    ) -> anyhow::Result<bool> {
        if copy.origin_buf.is_empty() && !copy.origin_done {
            let (page, last) = next_fed(&mut feeds.origin).await?;
            for kv in &page {
                copy.counts[copy.layout.shard_of(&kv.key)] += 1;
            }
            copy.origin_page_ends.extend(page.last().map(|kv| next_key(&kv.key)));
            copy.origin_buf.extend(page);
            copy.origin_done = last;
        }
        if copy.peer_buf.is_empty() && !copy.peer_done {
            let (page, last) = next_fed(&mut feeds.peer).await?;
            self.shared.detector_success();
            copy.peer_buf.extend(page);
            copy.peer_done = last;
        }
        let mut ops = Vec::new();
        let (layout, leases) = (&copy.layout, &copy.leases);
        merge_step(
            &mut copy.origin_buf,
            copy.origin_done,
            &mut copy.peer_buf,
            copy.peer_done,
            |key| layout.shard_of(key),
            |shard| leases[shard],
            &mut ops,
        );
        for op in ops {
            let (op, too_large) = enforce_request_limit(op, self.config.max_request_bytes, RESERVED_REQUEST_BYTES);
            if let Some(o) = too_large {
                copy.counts[copy.layout.shard_of(o.key.as_bytes())] -= 1;
                copy.oversized.push(o);
            }
            *staged_bytes += op.wire_size();
            staged.push(op);
        }
        Ok(copy.origin_done && copy.peer_done && copy.origin_buf.is_empty() && copy.peer_buf.is_empty())
    }

    /// Reads one side's pages one ahead of the merge: the next page is read once the last one
    /// is taken, and sent with whether it is the last. A failed read is sent too, and ends it.
    async fn read_pages(&self, client: &Client, mut pages: Pages, range_end: &[u8], feed: PageFeed) {
        // The last page read, as a share of the process's memory budget: the next one is read
        // once the process has room, or after a second at most (the merge waits for it, and a
        // share that waited for the others' could wait for ever).
        let mut held = self.config.memory.share();
        while !pages.done {
            let Ok(room) = feed.reserve().await else { return }; // the copy ended
            let waited = std::time::Instant::now();
            while !held.may_grow() && waited.elapsed() < PAGE_ROOM_WAIT {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            let read = self.next_page(client, &mut pages, range_end).await;
            if let Ok(kvs) = &read {
                held.set(kvs.iter().map(|kv| kv.key.len() + kv.value.len()).sum());
            }
            let failed = read.is_err();
            room.send(read.map(|kvs| (kvs, pages.done)));
            if failed {
                return;
            }
        }
    }

    /// The last Txn records the complete snapshot and writes the canary. The old layout's leases
    /// hold nothing now: not recorded any more, they lapse on their own.
    async fn finish_sync(
        &self,
        copy: SyncCopy,
        peer: &Client,
        state: &mut State,
        snapshot: &Snapshot,
        origin_cluster_id: u64,
    ) -> anyhow::Result<Option<String>> {
        let revision = snapshot.revision;
        let retired = !state.retiring.is_empty();
        state.retiring.clear();
        state.keys = copy.counts;
        state.counts_estimated = false;
        state.origin_cluster_id = origin_cluster_id;
        // Every key the origin holds was compared in this sync: it alone says which are too large,
        // and the checkpoint records them for a successor.
        let oversized = copy.oversized;
        let fixed: Vec<String> =
            state.oversized.keys().filter(|k| !oversized.iter().any(|o| &o.key == *k)).cloned().collect();
        self.report_oversized(state, oversized, fixed);
        let synced_at = k8s_openapi::jiff::Timestamp::now().to_string();
        let canary = serde_json::json!({"synced": true, "revision": revision, "syncedAt": synced_at});
        let record = self.checkpoint(state, revision, true);
        let write = self.checkpoint_write(state, &record);
        let page_ends_budget = crate::mirror::verify::page_ends_budget(self.config.max_txn_bytes);
        let page_ends = crate::mirror::verify::recorded_page_ends(&copy.origin_page_ends, page_ends_budget);
        let bookkeeping = vec![
            self.progress_op(revision, revision, state.keys.iter().sum()),
            self.canary_op(state, canary),
            TxnOp::put(
                keys::page_ends_key(&self.config.origin),
                crate::mirror::verify::encode_page_ends(&page_ends),
                None,
            ),
        ];
        if let Applied::Fenced(by) = self.apply_checkpoint(peer, snapshot.epoch, write, bookkeeping).await? {
            return Ok(Some(by));
        }
        state.applied = revision;
        state.peer_may_hold_through = None;
        state.predecessor_copy_unknown = false;
        state.synced = true;
        state.walk = Walk { last_page_ends: copy.origin_page_ends, ..Walk::default() };
        let total_keys = state.keys.iter().sum::<i64>();
        self.shared.update(|h| {
            h.last_applied_revision = revision;
            h.last_seen_revision = h.last_seen_revision.max(revision);
            h.keys = total_keys;
            h.synced = true;
            h.pending_since = None;
        });
        self.shared.progressed();
        self.shared.emit(MirrorEvent::Synced { revision, keys: total_keys });
        info!(revision, keys = total_keys, "peer holds the complete snapshot; canary written");
        if retired {
            self.keep_alive(state);
        }
        Ok(None)
    }

    /// Grants the layout's missing leases and records the layout, not synced, before any key
    /// moves: a successor taking over mid-sync keeps every lease that may hold keys alive, and
    /// syncs again. The canary says so too. Returns who fenced us, if someone did.
    async fn lay_out(
        &self,
        peer: &Client,
        state: &mut State,
        epoch: i64,
        cause: ResyncCause,
    ) -> anyhow::Result<Option<String>> {
        // Many grants at a time, not one round trip each, but not all at once either: 16k
        // grants at once through a follower each outlive the RPC deadline.
        let missing: Vec<usize> = (0..state.leases.len()).filter(|s| state.leases[*s] == 0).collect();
        self.keeper.expect_layout(state.leases.len() + state.retiring.len());
        let mut grants = futures::stream::iter(missing)
            .map(|shard| {
                let mut peer = peer.clone();
                async move { self.grant(&mut peer, shard).await.map(|granted| (shard, granted)) }
            })
            .buffer_unordered(GRANTS_IN_FLIGHT);
        let mut granted_now = 0;
        while let Some(granted) = grants.next().await {
            let (shard, (lease, at)) = granted?;
            self.keeper.granted(lease, at);
            state.leases[shard] = lease;
            granted_now += 1;
        }
        drop(grants);
        self.keeper.expect_layout(0); // every lease of it is kept now
        if granted_now > 0 {
            info!(leases = granted_now, "leases granted for the layout");
            self.shared.emit(MirrorEvent::LeasesGranted { leases: granted_now });
        }
        self.keep_alive(state);
        let canary = serde_json::json!({"synced": false, "cause": cause.as_str()});
        let record = self.checkpoint(state, 0, false);
        let write = self.checkpoint_write(state, &record);
        let bookkeeping = vec![self.canary_op(state, canary)];
        Ok(match self.apply_checkpoint(peer, epoch, write, bookkeeping).await? {
            Applied::Fenced(by) => Some(by),
            Applied::Yes => None,
        })
    }

    /// One range page of at most `page_size` keys from `from`, fewer when the largest key-value
    /// seen so far is large. A response the client cannot decode is asked for again with a tenth
    /// of the keys.
    pub(in crate::mirror) async fn page_of(
        &self,
        page_size: i64,
        client: &Client,
        from: &[u8],
        range_end: &[u8],
        revision: Option<i64>,
        largest: &mut usize,
    ) -> anyhow::Result<GetResponse> {
        let mut limit = next_page_limit(page_size, *largest, self.config.page_bytes);
        loop {
            let mut opts = GetOptions::new().with_range(range_end.to_vec()).with_limit(limit);
            if let Some(revision) = revision {
                opts = opts.with_revision(revision);
            }
            // Origin pages are pinned at a revision, the peer's are not: the context says which.
            let what = if revision.is_some() { "range page of the origin" } else { "range page of the peer" };
            match self.rpc(what, kv(client).get(from.to_vec(), Some(opts))).await {
                Ok(resp) => {
                    let page_largest = resp.kvs().iter().map(|kv| kv.key().len() + kv.value().len()).max();
                    *largest = (*largest).max(page_largest.unwrap_or(0));
                    return Ok(resp);
                }
                Err(e) if limit > 1 && format!("{e:#}").contains("message length too large") => {
                    warn!(limit, "a range page was too large to decode; asking for fewer keys");
                    limit = (limit / 10).max(1);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// How far the peer is (`measure_distance`), and the nearest of the worker's life
    /// (`plan::nearest`).
    pub(in crate::mirror) async fn peer_distance(&self, local: &Client, peer: &Client) -> Option<std::time::Duration> {
        let measured = measure_distance(local.clone(), peer.clone(), self.config.rpc_timeout).await;
        self.nearest_of(measured)
    }

    /// The nearest distance to the peer of the worker's life, `measured` included.
    pub(in crate::mirror) fn nearest_of(&self, measured: Option<std::time::Duration>) -> Option<std::time::Duration> {
        let mut nearest = self.nearest.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *nearest = crate::mirror::plan::nearest(*nearest, measured);
        *nearest
    }

    /// The next page of a subtree read page by page (the origin's reads bounded, `SyncReads`).
    async fn next_page(&self, client: &Client, pages: &mut Pages, range_end: &[u8]) -> anyhow::Result<Vec<Kv>> {
        let read_end = match &pages.bounds {
            Some(bounds) => bounds.read_end(&pages.cursor, range_end),
            None => range_end.to_vec(),
        };
        let (kvs, more) = self.read_page(client, pages, &read_end).await?;
        let first_last = kvs.first().zip(kvs.last()).map(|(f, l)| (f.key.as_slice(), l.key.as_slice()));
        let next = match &mut pages.bounds {
            Some(bounds) => bounds.after_page(&pages.cursor, first_last, more, &read_end, range_end),
            None => more.then(|| first_last.map_or_else(|| pages.cursor.clone(), |(_, last)| next_key(last))),
        };
        match next {
            Some(cursor) => pages.cursor = cursor,
            None => pages.done = true,
        }
        Ok(kvs)
    }

    /// One page of `pages` to `read_end`. The origin's, at its pinned snapshot, are the region's
    /// syncs' to share (`origin_reads`): read here only when no other worker read it first.
    async fn read_page(&self, client: &Client, pages: &mut Pages, read_end: &[u8]) -> anyhow::Result<(Vec<Kv>, bool)> {
        let Some(revision) = pages.revision else {
            let page = self.page_of(pages.size, client, &pages.cursor, read_end, None, &mut pages.largest).await?;
            let more = page.more();
            return Ok((page_kvs(page).collect(), more));
        };
        let limit = next_page_limit(pages.size, pages.largest, self.config.page_bytes);
        let key = PageKey { from: pages.cursor.clone(), read_end: read_end.to_vec(), limit };
        let mut largest = pages.largest;
        let (page, read_here) = self
            .config
            .origin_reads
            .page(revision, key, || async {
                let page =
                    self.page_of(pages.size, client, &pages.cursor, read_end, Some(revision), &mut largest).await?;
                let more = page.more();
                Ok(SharedPage { kvs: page_kvs(page).collect(), more })
            })
            .await?;
        let page_largest = page.kvs.iter().map(|kv| kv.key.len() + kv.value.len()).max().unwrap_or(0);
        pages.largest = largest.max(page_largest);
        self.shared.update(|h| match read_here {
            true => h.origin_pages_read += 1,
            false => h.origin_pages_shared += 1,
        });
        // A page nobody else holds is taken as it is; one another sync holds too, copied.
        let more = page.more;
        let kvs = std::sync::Arc::try_unwrap(page).map_or_else(|shared| shared.kvs.clone(), |page| page.kvs);
        Ok((kvs, more))
    }

    /// The origin's first pages, at least one, until they hold `bytes`.
    async fn read_ahead(
        &self,
        local: &Client,
        pages: &mut Pages,
        range_end: &[u8],
        bytes: usize,
    ) -> anyhow::Result<Vec<Kv>> {
        let (mut read, mut held) = (Vec::new(), 0usize);
        loop {
            let page = self.next_page(local, pages, range_end).await?;
            held += page.iter().map(|kv| kv.key.len() + kv.value.len()).sum::<usize>();
            read.extend(page);
            if pages.done || held >= bytes {
                return Ok(read);
            }
        }
    }

    /// Grants a lease for `shard`; its id, and when it was asked for (its TTL runs from then).
    async fn grant(&self, peer: &mut Client, shard: usize) -> anyhow::Result<(i64, std::time::Instant)> {
        let asked = std::time::Instant::now();
        let resp = self.rpc("grant lease", peer.lease_grant(self.config.lease_ttl_seconds, None)).await?;
        debug!(lease = resp.id(), shard, "lease granted");
        Ok((resp.id(), asked))
    }

    /// The canary put, on the first shard's lease: it lapses with the mirror.
    fn canary_op(&self, state: &State, value: serde_json::Value) -> TxnOp {
        let lease = state.leases.first().copied().unwrap_or(0);
        let options = (lease != 0).then(|| PutOptions::new().with_lease(lease));
        TxnOp::put(keys::canary_key(&self.config.origin), value.to_string(), options)
    }
}

/// The origin's subtree as a sync copies it, and the session it copies under.
struct Snapshot {
    revision: i64,
    total: u64,
    epoch: i64,
    cause: ResyncCause,
    /// The region's other syncs may share its pages while this one copies it.
    _copying: Copying,
}

/// Lease layout: keep the current one while it fits, else reshard.
fn plan_layout(state: &mut State, total: u64) {
    let max_per_lease = state.lease_cap.max(1);
    if needs_reshard(state.leases.len(), &state.keys, total, max_per_lease) {
        let shards = shard_count(total, max_per_lease);
        if !state.leases.is_empty() {
            info!(from = state.leases.len(), to = shards, keys = total, "resharding leases");
            state.retiring.extend(state.leases.iter().copied().filter(|id| *id != 0));
        }
        state.leases = vec![0; shards];
        state.keys = vec![0; shards];
        state.layout = Layout::uniform(shards);
    }
    if state.layout.len() != state.leases.len() {
        state.layout = Layout::uniform(state.leases.len());
    }
}

enum Started {
    Copying(Box<SyncCopy>, Box<Reads>),
    Fenced(String),
}

/// A sync's copy under way: what each side's pages hold and is not merged yet, whether a side is
/// read to its end, and what the origin's keys come to per shard.
struct SyncCopy {
    origin_buf: VecDeque<Kv>,
    peer_buf: VecDeque<Kv>,
    origin_done: bool,
    peer_done: bool,
    /// Where the origin's pages ended: they bound verification's reads (`verify::read_end`).
    origin_page_ends: Vec<Vec<u8>>,
    layout: Layout,
    leases: Vec<i64>,
    counts: Vec<i64>,
    oversized: Vec<Oversized>,
    /// How many batch Txns may be in flight, from how long they take.
    pace: SyncPace,
}

/// A batch Txn's answer: the bytes it carried, how long it took, and when it landed.
struct Landed {
    result: anyhow::Result<Applied>,
    bytes: usize,
    took: std::time::Duration,
    at: std::time::Instant,
}

/// A sync's batch Txns in flight, with their bytes, paced by how long they take.
struct SyncTxns {
    /// Each Txn a task of its own, sent at once and timed when it lands, not when the sync next
    /// looks (it may be waiting for the origin's next page meanwhile: a Txn timed then looks
    /// queued at a peer that has no queue). Aborted when the sync ends.
    txns: tokio::task::JoinSet<Landed>,
    bytes: usize,
    /// The bytes in flight as a share of the process's memory budget.
    held: crate::mirror::memory::Held,
    pace: SyncPace,
    /// When the last Txn landed: below one Txn in flight the next waits from then.
    last_landed: Option<std::time::Instant>,
}

impl SyncTxns {
    fn new(pace: SyncPace, held: crate::mirror::memory::Held) -> Self {
        SyncTxns { txns: tokio::task::JoinSet::new(), bytes: 0, held, pace, last_landed: None }
    }

    /// Sends a Txn.
    fn push(
        &mut self,
        apply: impl std::future::Future<Output = anyhow::Result<Applied>> + Send + 'static,
        bytes: usize,
    ) {
        self.bytes += bytes;
        self.held.set(self.bytes);
        let sent = std::time::Instant::now();
        let timed = async move {
            let result = apply.await;
            Landed { result, bytes, took: sent.elapsed(), at: std::time::Instant::now() }
        };
        self.txns.spawn(timed.in_current_span());
    }

    /// Counts a Txn that landed, or failed, into the bytes in flight and the pace.
    fn take(&mut self, joined: Result<Landed, tokio::task::JoinError>) -> anyhow::Result<Option<String>> {
        let Landed { result, bytes, took, at } =
            joined.map_err(|e| anyhow!("a sync Txn's task ended without an answer: {e}"))?;
        self.bytes -= bytes;
        self.held.set(self.bytes);
        // Counted by cuts, not by the whole window: cuts below one Txn in flight (waits between
        // Txns) change no whole window, and went unsaid.
        let cuts = self.pace.cuts();
        match &result {
            Ok(_) => self.pace.landed(took),
            Err(_) => self.pace.failed(took),
        }
        if self.pace.cuts() > cuts {
            let wait = self.pace.hold(std::time::Duration::ZERO);
            debug!(?took, queued = ?self.pace.queued(took), window = self.pace.window(), ?wait, "the peer queues the sync's Txns; fewer in flight, or a wait between them");
        }
        self.last_landed = Some(at);
        match result? {
            Applied::Yes => Ok(None),
            Applied::Fenced(by) => Ok(Some(by)),
        }
    }

    /// Waits until a batch of `bytes` fits in the window, and in what the connections open
    /// carry while more are being opened (`Spread::carries`); below one Txn in flight, until
    /// the pace's wait after the last one is over.
    async fn make_room(&mut self, bytes: usize, spread: &mut Spread) -> anyhow::Result<Option<String>> {
        loop {
            let window = self.pace.window().min(spread.carries());
            let fits = self.bytes + bytes <= MAX_SYNC_INFLIGHT_BYTES && self.held.may_grow();
            if self.txns.len() < window && (self.txns.is_empty() || fits) {
                let since = self.last_landed.map_or(std::time::Duration::MAX, |at| at.elapsed());
                let hold = self.pace.hold(since);
                if !hold.is_zero() {
                    tokio::time::sleep(hold).await;
                }
                return Ok(None);
            }
            tokio::select! {
                done = self.txns.join_next(), if !self.txns.is_empty() => {
                    if let Some(by) = self.take(done.expect("not empty"))? {
                        return Ok(Some(by));
                    }
                }
                () = spread.opened(), if spread.opening() => {}
            }
        }
    }

    /// Takes what has landed by now.
    fn take_ready(&mut self) -> anyhow::Result<Option<String>> {
        while let Some(done) = self.txns.try_join_next() {
            if let Some(by) = self.take(done)? {
                return Ok(Some(by));
            }
        }
        Ok(None)
    }

    /// Waits for every Txn in flight.
    async fn settle_all(&mut self) -> anyhow::Result<Option<String>> {
        while let Some(done) = self.txns.join_next().await {
            if let Some(by) = self.take(done)? {
                return Ok(Some(by));
            }
        }
        Ok(None)
    }
}

/// Where each side's read has got to when the copy starts; read on by `read_pages`.
struct Reads {
    /// The origin's client.
    local: Client,
    origin: Pages,
    peer: Pages,
    range_end: Vec<u8>,
}

/// A page read ahead, and whether it is its side's last.
type FedPage = anyhow::Result<(Vec<Kv>, bool)>;
type PageFeed = tokio::sync::mpsc::Sender<FedPage>;

/// The pages each side's reader sends the merge.
struct Feeds {
    origin: tokio::sync::mpsc::Receiver<FedPage>,
    peer: tokio::sync::mpsc::Receiver<FedPage>,
}

/// The next page of a side not read to its end. Its reader sends pages until the last, so the
/// feed closing before means the reader is gone.
async fn next_fed(feed: &mut tokio::sync::mpsc::Receiver<FedPage>) -> anyhow::Result<(Vec<Kv>, bool)> {
    feed.recv().await.unwrap_or_else(|| Err(anyhow!("the sync's page reader stopped before the last page")))
}

/// Where the sync's read of a subtree (the origin's or the peer's copy) has got to.
struct Pages {
    cursor: Vec<u8>,
    /// Read at this revision (the origin's snapshot), or the latest (the peer).
    revision: Option<i64>,
    done: bool,
    /// The largest key-value seen so far (pages shrink to stay decodable).
    largest: usize,
    /// Keys a page asks for (`plan::sync_page_size`).
    size: i64,
    /// Where each read stops short of the subtree's end: the origin's, next door, where a read
    /// that comes back short costs a local round trip (`SyncReads`). The peer's read to the end:
    /// a short read there costs the distance.
    bounds: Option<SyncReads>,
}

impl Pages {
    fn origin(prefix: &str, revision: i64, size: i64) -> Self {
        Pages { revision: Some(revision), bounds: Some(SyncReads::default()), ..Pages::peer(prefix, size) }
    }

    fn peer(prefix: &str, size: i64) -> Self {
        Pages { cursor: prefix.as_bytes().to_vec(), revision: None, done: false, largest: 0, size, bounds: None }
    }
}

/// A batch Txn with the bytes it carries, released from the in-flight budget when it lands.
pub(in crate::mirror) fn page_kvs(mut page: GetResponse) -> impl Iterator<Item = Kv> {
    page.take_kvs().into_iter().map(|kv| {
        let lease = kv.lease();
        let (key, value) = kv.into_key_value();
        Kv { key, value, lease }
    })
}

/// The smallest key after `key`.
fn next_key(key: &[u8]) -> Vec<u8> {
    let mut next = key.to_vec();
    next.push(0);
    next
}

/// How far the peer is: its round trip less the origin's, each the fastest of three status
/// calls, so that a busy machine, which slows both, is not taken for distance (None if the peer
/// never answered). A free function, so that a session can measure it beside its first steps.
pub(in crate::mirror) async fn measure_distance(
    local: Client,
    peer: Client,
    timeout: std::time::Duration,
) -> Option<std::time::Duration> {
    // Three of each at once: one round trip, not three.
    let (peer_best, local_best) = tokio::join!(fastest_round_trip(&peer, timeout), fastest_round_trip(&local, timeout));
    let first = distance(peer_best, local_best);
    if first.is_none_or(|rtt| rtt < crate::mirror::plan::WATCH_PIPELINE_FROM) {
        return first;
    }
    // Far, or a busy moment (a member electing, a loaded machine): asked again, the faster answer
    // counts.
    let (peer_again, local_again) =
        tokio::join!(fastest_round_trip(&peer, timeout), fastest_round_trip(&local, timeout));
    first.min(distance(peer_again, local_again).or(first))
}

/// The fastest of three status calls made at once (None when none answered in time).
async fn fastest_round_trip(client: &Client, timeout: std::time::Duration) -> Option<std::time::Duration> {
    let calls = (0..3).map(|_| {
        let mut client = client.clone();
        async move {
            let started = std::time::Instant::now();
            match tokio::time::timeout(timeout, client.status()).await {
                Ok(Ok(_)) => Some(started.elapsed()),
                _ => None,
            }
        }
    });
    futures::future::join_all(calls).await.into_iter().flatten().min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sync_may_copy_only_a_snapshot_as_new_as_anything_its_worker_may_have_sent() {
        // A reshard after the watch saw 140 and applied 130: nothing older than 140.
        assert_eq!(reuse(ResyncCause::Reshard, 130, 140, None, false), Reuse::NoOlderThan(140));
        // A new session resuming a predecessor whose last Txns may have landed through 150.
        assert_eq!(reuse(ResyncCause::LeaseLost, 0, 0, Some(150), false), Reuse::NoOlderThan(150));
        // A new mirror: nobody sent anything, any snapshot of the window will do.
        assert_eq!(reuse(ResyncCause::Initial, 0, 0, Some(SENT_UNKNOWN), false), Reuse::NoOlderThan(0));
        // The origin restored: never an earlier snapshot.
        assert_eq!(reuse(ResyncCause::OriginChanged, 130, 140, None, false), Reuse::Never);
    }

    #[test]
    fn a_sync_after_taking_over_from_another_process_mid_sync_pins_its_own_snapshot() {
        // The operator Pod that led before was copying a snapshot recorded nowhere (its sync cut
        // short by the takeover), perhaps newer than one this process pinned moments before it:
        // copied from that one, the merge would delete on the peer what the predecessor had
        // already put there. A snapshot pinned now is newer than anything the fenced one landed.
        for cause in [ResyncCause::Initial, ResyncCause::LeaseLost, ResyncCause::Reshard] {
            assert_eq!(reuse(cause, 0, 0, None, true), Reuse::Never, "{cause:?}");
        }
    }
}
