//! The drain's IO. It holds the prefix's lock (`lock.rs`) and records where it stands after
//! every step (`DrainRecord`), so a kill, a compaction or a new leader resumes it.
//!
//! 1. Copying: the legacy prefix, paged at one revision R, copied in batches of nested Txns; each
//!    copy compares the legacy key's mod revision and the v1 key's state, so that neither a
//!    legacy writer's nor a new registrar's concurrent write is lost or overwritten. If R is
//!    compacted mid-copy, the copy goes on from where it stands at a later revision, and a
//!    catch-up scan then copies again every key written since R.
//! 2. Draining: a watch on the legacy prefix from the last forwarded revision forwards legacy
//!    puts (and deletes, to v1 copies that still hold the deleted value) until the prefix has
//!    been quiet for the quiet period. The drain's own deletes are recognised by their revision
//!    and never forwarded.
//! 3. Deleting: every legacy key whose v1 key is newer is deleted with a compare on its mod
//!    revision; a key written meanwhile fails its compare and is forwarded by the next round.
//!    Malformed keys and keys naming another region are never deleted.
//!
//! The drain is Complete once a delete pass left nothing and a forwarding round after it saw
//! nothing. A RegistrySchema's drain then keeps following the prefix (`follow`): late writes of
//! registrars still on v0 are migrated and counted. The CLI stops at Complete.
use super::lock::DrainLock;
use super::plan::{Decision, DrainPhase, DrainRecord, DrainReport, V1State, decide, v1_key_for};
use crate::keys::{drain_deletes_prefix, drain_record_key, prefix_range_end};
// Responses of large registries exceed the client's default 4 MiB decode limit.
use crate::mirror::target::{kv, watcher};
use anyhow::{Context, anyhow};
use etcd_client::{Client, Compare, CompareOp, EventType, GetOptions, Txn, TxnOp, TxnOpResponse, WatchOptions};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use std::collections::HashSet;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

#[derive(Clone, Debug)]
pub struct DrainSettings {
    pub legacy_prefix: String,
    /// The drain's region: legacy values naming another are left in place.
    pub default_region: String,
    pub default_cluster: String,
    /// Legacy keys per Txn (one nested Txn each).
    pub batch_size: usize,
    /// Keys per second at most; 0 for no limit.
    pub rate_limit_per_second: u64,
    pub quiet_period: Duration,
    pub dry_run: bool,
    /// Batches in flight at once (their keys are distinct).
    pub parallelism: usize,
    pub rpc_timeout: Duration,
    /// Who runs this drain, as the lock names it to anyone else who tries.
    pub holder: String,
    /// Keep following the legacy prefix after Complete (a RegistrySchema does; the CLI does not).
    pub follow: bool,
    /// How long the prefix's lock outlives a drain that died without releasing it.
    pub lock_ttl_seconds: i64,
}

impl DrainSettings {
    pub fn new(default_region: &str, default_cluster: &str) -> Self {
        DrainSettings {
            legacy_prefix: crate::keys::V0_ROOT.to_string(),
            default_region: default_region.to_string(),
            default_cluster: default_cluster.to_string(),
            batch_size: 100,
            rate_limit_per_second: 0,
            quiet_period: Duration::from_secs(300),
            dry_run: false,
            parallelism: 8,
            rpc_timeout: Duration::from_secs(10),
            holder: format!("aether-operator drain (pid {})", std::process::id()),
            follow: false,
            lock_ttl_seconds: super::lock::LOCK_TTL_SECONDS,
        }
    }
}

/// A legacy key as read.
#[derive(Clone, Debug)]
struct Legacy {
    /// The key as text (a key that is not UTF-8 never parses as an endpoint: it is skipped).
    key: String,
    /// The key as etcd has it: the next page starts after these bytes, not after the text's.
    raw_key: Vec<u8>,
    value: Vec<u8>,
    mod_revision: i64,
}

/// What the drain's writes compare: the lock's epoch (None for a dry run, which writes nothing).
type Fence = Option<Compare>;

/// Runs the drain to completion (or, for a dry run, through the copy pass), publishing progress
/// on `progress`. Returns the final report; stops early, with the report so far, on `cancel`.
/// Fails at once, naming the holder, when another drain holds the prefix.
pub async fn drain(
    client: &Client,
    settings: &DrainSettings,
    progress: &watch::Sender<DrainReport>,
    cancel: &CancellationToken,
) -> anyhow::Result<DrainReport> {
    if settings.dry_run {
        return dry_run(client, settings, progress, cancel).await;
    }
    let lock = DrainLock::acquire(client, &settings.legacy_prefix, &settings.holder, settings.lock_ttl_seconds).await?;
    let result = drain_locked(client, settings, &lock, progress, cancel).await;
    lock.release(client).await;
    result
}

/// A dry run: the copy pass's decisions, counted, nothing written and no lock taken.
async fn dry_run(
    client: &Client,
    settings: &DrainSettings,
    progress: &watch::Sender<DrainReport>,
    cancel: &CancellationToken,
) -> anyhow::Result<DrainReport> {
    let mut record = DrainRecord {
        report: DrainReport { phase: Some(DrainPhase::Copying), dry_run: true, ..DrainReport::default() },
        ..DrainRecord::default()
    };
    progress.send_replace(record.report.clone());
    copy_pass(client, settings, &None, &mut record, progress, cancel).await?;
    let mut report = record.report;
    report.phase = Some(DrainPhase::DryRunComplete);
    report.message = Some("dry run: nothing was written".to_string());
    progress.send_replace(report.clone());
    Ok(report)
}

async fn drain_locked(
    client: &Client,
    settings: &DrainSettings,
    lock: &DrainLock,
    progress: &watch::Sender<DrainReport>,
    cancel: &CancellationToken,
) -> anyhow::Result<DrainReport> {
    let fence: Fence = Some(lock.compare());
    let started = Instant::now();
    let mut record = read_record(client, settings).await?.unwrap_or_default();
    let mut saved = Saved::default();
    record.report.dry_run = false;
    record.report.message = None;
    if record.report.phase.is_none() || record.report.phase == Some(DrainPhase::Pending) {
        record.report.phase = Some(DrainPhase::Copying);
    }
    progress.send_replace(record.report.clone());

    // 1. Copy the snapshot (resuming where a previous run stood).
    if record.copying() {
        copy_pass(client, settings, &fence, &mut record, progress, cancel).await?;
        if cancel.is_cancelled() {
            return Ok(record.report);
        }
        if let Some(since) = record.catch_up_from.take() {
            let at = catch_up(client, settings, &fence, &mut record, since, progress).await?;
            record.copy_revision = at;
        }
        record.watermark = record.copy_revision;
        record.report.phase = Some(DrainPhase::Draining);
        save_record(client, settings, &fence, &record, &mut saved).await?;
        progress.send_replace(record.report.clone());
    }

    // 2 and 3, until a delete pass leaves nothing and the forwarding round after it sees nothing.
    // The drain's own deletes, also those of a run before a restart, are never forwarded.
    let mut own_deletes: HashSet<i64> = own_delete_marks(client, settings).await?.into_iter().map(|(_, r)| r).collect();
    let mut deleted_everything = false;
    loop {
        let Some(forwarded) =
            forward_until_quiet(client, settings, &fence, &mut record, &own_deletes, progress, cancel).await?
        else {
            return Ok(record.report);
        };
        save_record(client, settings, &fence, &record, &mut saved).await?;
        forget_own_deletes(client, settings, &fence, record.watermark, &mut own_deletes).await?;
        if deleted_everything && forwarded == 0 {
            if record.report.phase != Some(DrainPhase::Complete) {
                record.report.phase = Some(DrainPhase::Complete);
                info!(
                    copied = record.report.copied,
                    deleted = record.report.deleted,
                    skipped = record.report.skipped,
                    foreign = record.report.foreign,
                    "drain complete"
                );
            }
            let took = started.elapsed().as_secs_f64();
            record.report.message = Some(if settings.follow {
                format!("legacy prefix {} drained; following it for late writes", settings.legacy_prefix)
            } else {
                format!("legacy prefix {} drained in {took:.1}s", settings.legacy_prefix)
            });
            save_record(client, settings, &fence, &record, &mut saved).await?;
            progress.send_replace(record.report.clone());
            if !settings.follow {
                return Ok(record.report);
            }
            continue;
        }
        if record.report.phase != Some(DrainPhase::Complete) {
            record.report.phase = Some(DrainPhase::Draining);
        }
        let pending = delete_pass(client, settings, &fence, &mut record, &mut own_deletes, progress, cancel).await?;
        if cancel.is_cancelled() {
            return Ok(record.report);
        }
        save_record(client, settings, &fence, &record, &mut saved).await?;
        deleted_everything = pending == 0;
    }
}

async fn rpc<T>(
    timeout: Duration,
    what: &str,
    call: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(timeout, call).await {
        Err(_) => Err(anyhow!("{what}: timed out after {timeout:?}")),
        Ok(r) => r.with_context(|| what.to_string()),
    }
}

fn is_compacted(e: &anyhow::Error) -> bool {
    format!("{e:#}").contains("required revision has been compacted")
}

/// A Txn of the drain: applies only while this drain holds the lock.
async fn fenced_txn(
    kv: &mut etcd_client::KvClient,
    settings: &DrainSettings,
    fence: &Fence,
    what: &str,
    ops: Vec<TxnOp>,
) -> anyhow::Result<etcd_client::TxnResponse> {
    let txn = match fence {
        Some(compare) => Txn::new().when([compare.clone()]).and_then(ops),
        None => Txn::new().and_then(ops),
    };
    let resp = rpc(settings.rpc_timeout, what, kv.txn(txn)).await?;
    if !resp.succeeded() {
        anyhow::bail!(
            "the drain lock on {} was lost (another drain took it over); this drain stops writing",
            settings.legacy_prefix
        );
    }
    Ok(resp)
}

async fn read_record(client: &Client, settings: &DrainSettings) -> anyhow::Result<Option<DrainRecord>> {
    let mut kv = kv(client);
    let resp =
        rpc(settings.rpc_timeout, "read the drain's record", kv.get(drain_record_key(&settings.legacy_prefix), None))
            .await?;
    Ok(resp.kvs().first().and_then(|kv| DrainRecord::decode(kv.value())))
}

/// What the drain last recorded, so that a loop with nothing new writes nothing: an idle registry
/// must see no write. The watermark alone (it follows the etcd's revision, which other writers
/// move) is recorded at most once a minute; a restart then replays at most a minute's writes,
/// which forwarding does idempotently.
#[derive(Default)]
struct Saved {
    record: Option<DrainRecord>,
    at: Option<std::time::Instant>,
}

/// How often at most a record that only moved its watermark is written.
const WATERMARK_SAVE_EVERY: Duration = Duration::from_secs(60);

impl Saved {
    fn needs(&self, record: &DrainRecord) -> bool {
        let Some(last) = &self.record else { return true };
        let same_but_watermark = DrainRecord { watermark: last.watermark, ..record.clone() } == *last;
        !same_but_watermark
            || (record.watermark != last.watermark && self.at.is_none_or(|t| t.elapsed() >= WATERMARK_SAVE_EVERY))
    }
}

async fn save_record(
    client: &Client,
    settings: &DrainSettings,
    fence: &Fence,
    record: &DrainRecord,
    saved: &mut Saved,
) -> anyhow::Result<()> {
    if fence.is_none() || !saved.needs(record) {
        return Ok(());
    }
    let mut kv = kv(client);
    let put = TxnOp::put(drain_record_key(&settings.legacy_prefix), record.encode(), None);
    fenced_txn(&mut kv, settings, fence, "record the drain's progress", vec![put]).await?;
    *saved = Saved { record: Some(record.clone()), at: Some(std::time::Instant::now()) };
    Ok(())
}

/// The marks of the drain's own delete Txns: (key, the delete's revision).
async fn own_delete_marks(client: &Client, settings: &DrainSettings) -> anyhow::Result<Vec<(Vec<u8>, i64)>> {
    let mut kv = kv(client);
    let prefix = drain_deletes_prefix(&settings.legacy_prefix);
    let resp = rpc(
        settings.rpc_timeout,
        "read the drain's delete marks",
        kv.get(prefix.as_str(), Some(GetOptions::new().with_prefix().with_keys_only())),
    )
    .await?;
    Ok(resp.kvs().iter().map(|kv| (kv.key().to_vec(), kv.mod_revision())).collect())
}

/// Once the forwarder is past a delete of the drain's own, its mark is no longer needed.
async fn forget_own_deletes(
    client: &Client,
    settings: &DrainSettings,
    fence: &Fence,
    watermark: i64,
    own_deletes: &mut HashSet<i64>,
) -> anyhow::Result<()> {
    own_deletes.retain(|r| *r > watermark);
    let done: Vec<Vec<u8>> = own_delete_marks(client, settings)
        .await?
        .into_iter()
        .filter(|(_, r)| *r <= watermark)
        .map(|(k, _)| k)
        .collect();
    let mut kv = kv(client);
    for chunk in done.chunks(100) {
        let ops = chunk.iter().map(|k| TxnOp::delete(k.clone(), None)).collect();
        fenced_txn(&mut kv, settings, fence, "forget delete marks", ops).await?;
    }
    Ok(())
}

/// Pages the legacy prefix at the record's copy revision from its cursor and copies it. A
/// compacted revision moves the copy to the current one (and schedules a catch-up scan).
async fn copy_pass(
    client: &Client,
    settings: &DrainSettings,
    fence: &Fence,
    record: &mut DrainRecord,
    progress: &watch::Sender<DrainReport>,
    cancel: &CancellationToken,
) -> anyhow::Result<()> {
    let mut kv = kv(client);
    let end = prefix_range_end(settings.legacy_prefix.as_bytes());
    if record.copy_revision == 0 {
        record.copy_revision = head_revision(&mut kv, settings).await?;
        record.copy_cursor = Some(settings.legacy_prefix.clone());
    }
    let mut cursor = record
        .copy_cursor
        .as_deref()
        .map(super::plan::decode_cursor)
        .unwrap_or_else(|| settings.legacy_prefix.clone().into_bytes());
    let most = (settings.batch_size * settings.parallelism.max(1) * 2) as i64;
    let mut largest = 0usize;
    let started = Instant::now();
    let seen_before = record.report.legacy_seen;
    loop {
        if cancel.is_cancelled() {
            return Ok(());
        }
        let page = super::plan::next_page(largest, most);
        let (legacy, more) = match legacy_page(&mut kv, settings, &end, &cursor, record.copy_revision, page).await {
            Ok(page) => page,
            Err(e) if is_compacted(&e) => {
                let now = head_revision(&mut kv, settings).await?;
                warn!(
                    from = record.copy_revision,
                    to = now,
                    "the copy's revision was compacted; going on at a later one"
                );
                record.catch_up_from.get_or_insert(record.copy_revision);
                record.copy_revision = now;
                continue;
            }
            Err(e) => return Err(e),
        };
        largest = largest.max(legacy.iter().map(|l| l.raw_key.len() + l.value.len()).max().unwrap_or(0));
        copy_all(client, settings, fence, &legacy, &mut record.report).await?;
        match legacy.last() {
            Some(last) if more => {
                cursor = last.raw_key.clone();
                cursor.push(0);
                record.copy_cursor = Some(super::plan::encode_cursor(&cursor));
            }
            _ => record.copy_cursor = None,
        }
        save_record(client, settings, fence, record, &mut Saved::default()).await?;
        progress.send_replace(record.report.clone());
        pace(settings, record.report.legacy_seen - seen_before, started).await;
        if record.copy_cursor.is_none() {
            return Ok(());
        }
    }
}

/// Copies again every legacy key written after `since` (the copy moved past a compaction);
/// returns the revision it read at.
async fn catch_up(
    client: &Client,
    settings: &DrainSettings,
    fence: &Fence,
    record: &mut DrainRecord,
    since: i64,
    progress: &watch::Sender<DrainReport>,
) -> anyhow::Result<i64> {
    let mut kv = kv(client);
    let end = prefix_range_end(settings.legacy_prefix.as_bytes());
    let at = head_revision(&mut kv, settings).await?;
    let mut cursor = settings.legacy_prefix.clone().into_bytes();
    let most = (settings.batch_size * settings.parallelism.max(1) * 2) as i64;
    let mut largest = 0usize;
    loop {
        let (legacy, more) =
            legacy_page(&mut kv, settings, &end, &cursor, at, super::plan::next_page(largest, most)).await?;
        largest = largest.max(legacy.iter().map(|l| l.raw_key.len() + l.value.len()).max().unwrap_or(0));
        let changed: Vec<Legacy> = legacy.iter().filter(|l| l.mod_revision > since).cloned().collect();
        // Counted once already by the copy: a catch-up copy is a conflict resolved, not a new key.
        let mut report = DrainReport::default();
        copy_all(client, settings, fence, &changed, &mut report).await?;
        record.report.copied += report.copied;
        record.report.conflicts += report.copied;
        progress.send_replace(record.report.clone());
        match legacy.last() {
            Some(last) if more => {
                cursor = last.raw_key.clone();
                cursor.push(0);
            }
            _ => return Ok(at),
        }
    }
}

/// Copies keys in parallel batches.
async fn copy_all(
    client: &Client,
    settings: &DrainSettings,
    fence: &Fence,
    legacy: &[Legacy],
    report: &mut DrainReport,
) -> anyhow::Result<()> {
    let mut inflight = FuturesUnordered::new();
    // Batches by count and by bytes: a batch of mebibyte values in one Txn is past any request
    // etcd takes, and would fail for ever.
    let sizes: Vec<usize> = legacy.iter().map(|l| l.raw_key.len() * 2 + l.value.len()).collect();
    for range in super::plan::batches_by_bytes(&sizes, settings.batch_size.max(1), super::plan::DRAIN_TXN_BYTES) {
        while inflight.len() >= settings.parallelism.max(1) {
            merge(report, inflight.next().await.expect("non-empty")?);
        }
        inflight.push(copy_batch(client.clone(), settings.clone(), fence.clone(), legacy[range].to_vec()));
    }
    while let Some(result) = inflight.next().await {
        merge(report, result?);
    }
    Ok(())
}

async fn head_revision(kv: &mut etcd_client::KvClient, settings: &DrainSettings) -> anyhow::Result<i64> {
    let prefix = settings.legacy_prefix.as_bytes().to_vec();
    let end = prefix_range_end(&prefix);
    let head = rpc(
        settings.rpc_timeout,
        "count legacy keys",
        kv.get(prefix, Some(GetOptions::new().with_range(end).with_count_only())),
    )
    .await?;
    head.header().map(|h| h.revision()).ok_or_else(|| anyhow!("range response without header"))
}

/// One page of legacy keys at `revision` from `cursor`; and whether more follow.
async fn legacy_page(
    kv: &mut etcd_client::KvClient,
    settings: &DrainSettings,
    end: &[u8],
    cursor: &[u8],
    revision: i64,
    limit: i64,
) -> anyhow::Result<(Vec<Legacy>, bool)> {
    let opts = GetOptions::new().with_range(end.to_vec()).with_revision(revision).with_limit(limit);
    let resp = rpc(settings.rpc_timeout, "range legacy page", kv.get(cursor.to_vec(), Some(opts))).await?;
    Ok((resp.kvs().iter().map(Legacy::from_kv).collect(), resp.more()))
}

impl Legacy {
    fn from_kv(kv: &etcd_client::KeyValue) -> Self {
        Legacy {
            key: String::from_utf8_lossy(kv.key()).to_string(),
            raw_key: kv.key().to_vec(),
            value: kv.value().to_vec(),
            mod_revision: kv.mod_revision(),
        }
    }

    fn target(&self, settings: &DrainSettings) -> Option<String> {
        v1_key_for(&self.key, &settings.legacy_prefix, &self.value, &settings.default_region, &settings.default_cluster)
            .ok()
            .map(|k| k.to_string())
    }
}

/// Holds back so that at most `rate_limit_per_second` keys are handled per second.
async fn pace(settings: &DrainSettings, handled: i64, started: Instant) {
    if settings.rate_limit_per_second > 0 {
        let due = Duration::from_secs_f64(handled as f64 / settings.rate_limit_per_second as f64);
        if let Some(wait) = due.checked_sub(started.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
}

/// What one batch did; merged into the report.
#[derive(Default)]
struct BatchOutcome {
    report: DrainReport,
    /// Keys whose compare failed (someone wrote meanwhile): to be read and handled again.
    retry: Vec<String>,
}

fn merge(report: &mut DrainReport, outcome: BatchOutcome) {
    let o = outcome.report;
    report.legacy_seen += o.legacy_seen;
    report.copied += o.copied;
    report.already_present += o.already_present;
    report.skipped += o.skipped;
    report.foreign += o.foreign;
    report.conflicts += o.conflicts;
    for k in o.skipped_keys {
        if report.skipped_keys.len() < super::plan::SKIPPED_KEYS_SHOWN && !report.skipped_keys.contains(&k) {
            report.skipped_keys.push(k);
        }
    }
    for k in o.foreign_keys {
        if report.foreign_keys.len() < super::plan::SKIPPED_KEYS_SHOWN && !report.foreign_keys.contains(&k) {
            report.foreign_keys.push(k);
        }
    }
}

/// Copies one batch of legacy keys, retrying the keys whose compares failed until none is left.
async fn copy_batch(
    client: Client,
    settings: DrainSettings,
    fence: Fence,
    mut batch: Vec<Legacy>,
) -> anyhow::Result<BatchOutcome> {
    let mut total = BatchOutcome::default();
    let mut kv = kv(&client);
    loop {
        let outcome = copy_once(&mut kv, &settings, &fence, &batch).await?;
        merge(&mut total.report, BatchOutcome { report: outcome.report, retry: Vec::new() });
        if outcome.retry.is_empty() {
            return Ok(total);
        }
        // Re-read the conflicting keys: a legacy writer or a new registrar wrote meanwhile.
        let ops: Vec<TxnOp> = outcome.retry.iter().map(|k| TxnOp::get(k.as_str(), None)).collect();
        let resp = rpc(settings.rpc_timeout, "re-read conflicting keys", kv.txn(Txn::new().and_then(ops))).await?;
        batch = resp
            .op_responses()
            .into_iter()
            .filter_map(|r| match r {
                TxnOpResponse::Get(g) => g.kvs().first().map(Legacy::from_kv),
                _ => None,
            })
            .collect();
        // A re-read key is counted again as seen; do not count it twice.
        total.report.legacy_seen -= batch.len() as i64;
        if batch.is_empty() {
            return Ok(total);
        }
    }
}

/// One attempt at a batch: read the v1 keys, decide, write the copies in nested Txns.
async fn copy_once(
    kv: &mut etcd_client::KvClient,
    settings: &DrainSettings,
    fence: &Fence,
    batch: &[Legacy],
) -> anyhow::Result<BatchOutcome> {
    let mut outcome = BatchOutcome::default();
    let targets: Vec<_> = batch
        .iter()
        .map(|l| {
            v1_key_for(&l.key, &settings.legacy_prefix, &l.value, &settings.default_region, &settings.default_cluster)
        })
        .collect();
    let v1_keys: Vec<String> = targets.iter().flatten().map(|k| k.to_string()).collect();
    let states = read_states(kv, settings, &v1_keys).await?;

    let mut writes: Vec<(usize, TxnOp)> = Vec::new();
    for (i, (legacy, target)) in batch.iter().zip(targets).enumerate() {
        let state = target.as_ref().ok().and_then(|k| states.get(&k.to_string()));
        let decision = decide(target, legacy.mod_revision, state);
        if let Decision::Copy { v1_key } = &decision
            && fence.is_some()
        {
            let v1 = v1_key.to_string();
            let v1_compare = match state {
                Some(s) => Compare::mod_revision(v1.as_str(), CompareOp::Equal, s.mod_revision),
                None => Compare::version(v1.as_str(), CompareOp::Equal, 0),
            };
            let nested = Txn::new()
                .when([Compare::mod_revision(legacy.key.as_str(), CompareOp::Equal, legacy.mod_revision), v1_compare])
                .and_then([TxnOp::put(v1.as_str(), legacy.value.clone(), None)]);
            writes.push((i, TxnOp::txn(nested)));
        }
        outcome.report.record(&legacy.key, &decision);
    }
    if writes.is_empty() {
        return Ok(outcome);
    }
    let (indices, ops): (Vec<usize>, Vec<TxnOp>) = writes.into_iter().unzip();
    let resp = fenced_txn(kv, settings, fence, "copy batch", ops).await?;
    for (i, r) in indices.into_iter().zip(resp.op_responses()) {
        if let TxnOpResponse::Txn(nested) = r
            && !nested.succeeded()
        {
            outcome.report.copied -= 1;
            outcome.report.conflicts += 1;
            outcome.retry.push(batch[i].key.clone());
        }
    }
    Ok(outcome)
}

/// The current state of each v1 key, read in one Txn.
async fn read_states(
    kv: &mut etcd_client::KvClient,
    settings: &DrainSettings,
    v1_keys: &[String],
) -> anyhow::Result<std::collections::HashMap<String, V1State>> {
    let mut states = std::collections::HashMap::new();
    if v1_keys.is_empty() {
        return Ok(states);
    }
    let ops: Vec<TxnOp> = v1_keys.iter().map(|k| TxnOp::get(k.as_str(), None)).collect();
    let resp = rpc(settings.rpc_timeout, "read v1 keys", kv.txn(Txn::new().and_then(ops))).await?;
    for r in resp.op_responses() {
        if let TxnOpResponse::Get(g) = r
            && let Some(kv) = g.kvs().first()
        {
            states.insert(
                String::from_utf8_lossy(kv.key()).to_string(),
                V1State { mod_revision: kv.mod_revision(), value: kv.value().to_vec() },
            );
        }
    }
    Ok(states)
}

/// Forwards legacy writes from the record's watermark until the prefix has been quiet for the
/// quiet period; returns how many it forwarded (None when cancelled). Deletes at the revisions
/// of the drain's own delete Txns are its own and are not forwarded. A watermark compacted away
/// is answered with a catch-up scan (legacy deletes in the compacted window cannot be forwarded:
/// said in the report's message).
#[allow(clippy::too_many_arguments)]
async fn forward_until_quiet(
    client: &Client,
    settings: &DrainSettings,
    fence: &Fence,
    record: &mut DrainRecord,
    own_deletes: &HashSet<i64>,
    progress: &watch::Sender<DrainReport>,
    cancel: &CancellationToken,
) -> anyhow::Result<Option<u64>> {
    let mut watch_client = watcher(client);
    let options = WatchOptions::new().with_prefix().with_start_revision(record.watermark + 1).with_prev_key();
    let mut stream = rpc(
        settings.rpc_timeout,
        "watch legacy prefix",
        watch_client.watch(settings.legacy_prefix.as_str(), Some(options)),
    )
    .await?;
    let mut kv = kv(client);
    let mut last_write = Instant::now();
    let mut forwarded = 0u64;
    loop {
        let quiet_left = settings.quiet_period.saturating_sub(last_write.elapsed());
        if quiet_left.is_zero() {
            return Ok(Some(forwarded));
        }
        tokio::select! {
            _ = cancel.cancelled() => return Ok(None),
            _ = tokio::time::sleep(quiet_left) => {}
            message = stream.message() => {
                let Some(resp) = message.context("watching the legacy prefix")? else { anyhow::bail!("the legacy watch closed") };
                if resp.canceled() {
                    if resp.compact_revision() > 0 {
                        let since = record.watermark;
                        warn!(since, compacted = resp.compact_revision(), "the legacy watch was compacted; catching up by a scan");
                        let at = catch_up(client, settings, fence, record, since, progress).await?;
                        record.watermark = at;
                        record.report.message = Some(format!(
                            "legacy deletes between revisions {since} and {at} were compacted before they could be forwarded; their v1 copies may remain"
                        ));
                        return Ok(Some(forwarded + 1));
                    }
                    anyhow::bail!("the legacy watch was cancelled ({}); the drain resumes", resp.cancel_reason());
                }
                let mut puts = Vec::new();
                for event in resp.events() {
                    let Some(kv_) = event.kv() else { continue };
                    match event.event_type() {
                        EventType::Put => {
                            last_write = Instant::now();
                            forwarded += 1;
                            let put = Legacy::from_kv(kv_);
                            // The endpoint moved (another cluster in its value): its copy under
                            // the old v1 key goes, if it still holds the old value.
                            if let Some(prev) = event.prev_kv()
                                && Legacy::from_kv(prev).target(settings).is_some_and(|old| Some(old) != put.target(settings))
                            {
                                forward_delete(&mut kv, settings, fence, prev).await?;
                            }
                            puts.push(put);
                        }
                        // The drain's own delete: nothing to forward.
                        EventType::Delete if own_deletes.contains(&kv_.mod_revision()) => {}
                        EventType::Delete => {
                            last_write = Instant::now();
                            forwarded += 1;
                            if let Some(prev) = event.prev_kv() {
                                forward_delete(&mut kv, settings, fence, prev).await?;
                            }
                        }
                    }
                }
                // Only the latest write of a key matters; it carries the newest mod revision.
                puts.reverse();
                let mut seen = std::collections::HashSet::new();
                puts.retain(|l| seen.insert(l.key.clone()));
                copy_all(client, settings, fence, &puts, &mut record.report).await?;
                if let Some(h) = resp.header() {
                    record.watermark = record.watermark.max(h.revision());
                }
                progress.send_replace(record.report.clone());
            }
        }
    }
}

/// A legacy registrar deleted an endpoint: delete its v1 copy too, if the copy still holds the
/// deleted value (a newer registrar's write is left alone).
async fn forward_delete(
    kv: &mut etcd_client::KvClient,
    settings: &DrainSettings,
    fence: &Fence,
    prev: &etcd_client::KeyValue,
) -> anyhow::Result<()> {
    let Some(v1) = Legacy::from_kv(prev).target(settings) else {
        return Ok(());
    };
    let nested = Txn::new()
        .when([Compare::value(v1.as_str(), CompareOp::Equal, prev.value().to_vec())])
        .and_then([TxnOp::delete(v1.as_str(), None)]);
    fenced_txn(kv, settings, fence, "forward legacy delete", vec![TxnOp::txn(nested)]).await?;
    Ok(())
}

/// What deleting one batch did.
struct DeleteOutcome {
    deleted: i64,
    conflicts: i64,
    /// Keys that still need a delete round (copied just now, or written meanwhile).
    pending: usize,
    copied: BatchOutcome,
    /// The revision of the delete Txn, when it deleted something.
    revision: Option<i64>,
}

/// Deletes the keys of one batch whose v1 key is newer (each with a compare on its mod revision),
/// and copies the ones not copied yet.
async fn delete_batch(
    client: Client,
    settings: DrainSettings,
    fence: Fence,
    batch: Vec<Legacy>,
) -> anyhow::Result<DeleteOutcome> {
    let mut kv = kv(&client);
    let mut outcome =
        DeleteOutcome { deleted: 0, conflicts: 0, pending: 0, copied: BatchOutcome::default(), revision: None };
    let targets: Vec<Option<String>> = batch.iter().map(|l| l.target(&settings)).collect();
    let v1_keys: Vec<String> = targets.iter().flatten().cloned().collect();
    let states = read_states(&mut kv, &settings, &v1_keys).await?;
    let mut deletes: Vec<(&str, i64)> = Vec::new();
    let mut to_copy: Vec<Legacy> = Vec::new();
    for (legacy, target) in batch.iter().zip(&targets) {
        // Malformed and foreign keys stay forever; keys not copied yet are copied now and
        // deleted in the next round.
        let Some(target) = target else { continue };
        match states.get(target) {
            Some(s) if s.mod_revision > legacy.mod_revision => deletes.push((&legacy.key, legacy.mod_revision)),
            _ => to_copy.push(legacy.clone()),
        }
    }
    if !deletes.is_empty() {
        let mut ops: Vec<TxnOp> = deletes
            .iter()
            .map(|(key, mod_revision)| {
                let guarded = Txn::new()
                    .when([Compare::mod_revision(*key, CompareOp::Equal, *mod_revision)])
                    .and_then([TxnOp::delete(*key, None)]);
                TxnOp::txn(guarded)
            })
            .collect();
        // The mark's mod revision is this Txn's: it tells the forwarder, even after a restart,
        // that these deletes are the drain's own.
        let mark = format!("{}{:016x}", drain_deletes_prefix(&settings.legacy_prefix), rand::random::<u64>());
        ops.push(TxnOp::put(mark, "", None));
        let resp = fenced_txn(&mut kv, &settings, &fence, "delete legacy batch", ops).await?;
        for r in resp.op_responses() {
            if let TxnOpResponse::Txn(nested) = r {
                if nested.succeeded() {
                    outcome.deleted += 1;
                } else {
                    // Written meanwhile: never lost; the next forwarding round copies it.
                    outcome.conflicts += 1;
                    outcome.pending += 1;
                }
            }
        }
        if outcome.deleted > 0 {
            outcome.revision = resp.header().map(|h| h.revision());
        }
    }
    if !to_copy.is_empty() {
        outcome.pending += to_copy.len();
        outcome.copied = copy_batch(client.clone(), settings.clone(), fence.clone(), to_copy).await?;
    }
    Ok(outcome)
}

/// Deletes every legacy key whose v1 key holds it (or something newer), each with a compare on
/// its mod revision, remembering the revisions of its own deletes. Returns how many legacy keys
/// still need a round.
async fn delete_pass(
    client: &Client,
    settings: &DrainSettings,
    fence: &Fence,
    record: &mut DrainRecord,
    own_deletes: &mut HashSet<i64>,
    progress: &watch::Sender<DrainReport>,
    cancel: &CancellationToken,
) -> anyhow::Result<usize> {
    let mut kv = kv(client);
    let end = prefix_range_end(settings.legacy_prefix.as_bytes());
    let revision = head_revision(&mut kv, settings).await?;
    let mut cursor = settings.legacy_prefix.clone().into_bytes();
    let mut pending = 0usize;
    let mut inflight = FuturesUnordered::new();
    let parallelism = settings.parallelism.max(1);
    let most = (settings.batch_size.max(1) * parallelism * 2) as i64;
    let mut largest = 0usize;
    let report = &mut record.report;
    let mut settle = |report: &mut DrainReport, outcome: DeleteOutcome| {
        report.deleted += outcome.deleted;
        report.conflicts += outcome.conflicts;
        pending += outcome.pending;
        own_deletes.extend(outcome.revision);
        merge(report, outcome.copied);
    };
    loop {
        if cancel.is_cancelled() {
            break;
        }
        let (legacy, more) =
            legacy_page(&mut kv, settings, &end, &cursor, revision, super::plan::next_page(largest, most)).await?;
        largest = largest.max(legacy.iter().map(|l| l.raw_key.len() + l.value.len()).max().unwrap_or(0));
        // Keys seen by the copy are not seen again: only what a delete round copies counts.
        // One op of each delete Txn is the drain's mark: 127 deletes at most beside it.
        for batch in legacy.chunks(settings.batch_size.clamp(1, 127)) {
            while inflight.len() >= parallelism {
                settle(report, inflight.next().await.expect("non-empty")?);
            }
            inflight.push(delete_batch(client.clone(), settings.clone(), fence.clone(), batch.to_vec()));
        }
        progress.send_replace(report.clone());
        match legacy.last() {
            Some(last) if more => {
                cursor = last.raw_key.clone();
                cursor.push(0);
            }
            _ => break,
        }
    }
    while let Some(outcome) = inflight.next().await {
        settle(report, outcome?);
    }
    progress.send_replace(report.clone());
    Ok(pending)
}
