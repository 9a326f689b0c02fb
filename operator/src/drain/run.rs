//! The drain's IO. Every step is idempotent, so a restart at any point simply runs it again:
//! a key already copied reads as "already present" (its v1 key is newer than the legacy write).
//!
//! 1. Copying: the legacy prefix, paged at one revision R, copied in batches of nested Txns; each
//!    copy compares the legacy key's mod revision and the v1 key's state, so that neither a
//!    legacy writer's nor a new registrar's concurrent write is lost or overwritten.
//! 2. Draining: a watch on the legacy prefix from R+1 forwards legacy puts (and deletes, to v1
//!    copies that still hold the deleted value) until the prefix has been quiet for the quiet period.
//! 3. Deleting: every legacy key whose v1 key is newer is deleted with a compare on its mod
//!    revision; a key written meanwhile fails its compare, is copied, and the drain goes on.
//!    Malformed keys are never deleted.
use super::plan::{Decision, DrainPhase, DrainReport, V1State, decide, v1_key_for};
use crate::keys::prefix_range_end;
use anyhow::{Context, anyhow};
use etcd_client::{Client, Compare, CompareOp, EventType, GetOptions, Txn, TxnOp, TxnOpResponse, WatchOptions};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::info;

#[derive(Clone, Debug)]
pub struct DrainSettings {
    pub legacy_prefix: String,
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
        }
    }
}

/// A legacy key as read.
#[derive(Clone, Debug)]
struct Legacy {
    key: String,
    value: Vec<u8>,
    mod_revision: i64,
}

/// Runs the drain to completion (or, for a dry run, through the copy pass), publishing progress
/// on `progress`. Returns the final report; stops early, with the report so far, on `cancel`.
pub async fn drain(
    client: &Client,
    settings: &DrainSettings,
    progress: &watch::Sender<DrainReport>,
    cancel: &CancellationToken,
) -> anyhow::Result<DrainReport> {
    let mut report =
        DrainReport { phase: Some(DrainPhase::Copying), dry_run: settings.dry_run, ..DrainReport::default() };
    progress.send_replace(report.clone());
    let started = Instant::now();

    // 1. Copy the snapshot at R.
    let revision = copy_pass(client, settings, &mut report, progress, cancel, started).await?;
    if settings.dry_run {
        report.phase = Some(DrainPhase::Complete);
        report.message = Some("dry run: nothing was written".to_string());
        progress.send_replace(report.clone());
        return Ok(report);
    }
    let mut from = revision + 1;
    loop {
        // 2. Forward legacy writes until the prefix has been quiet for the quiet period.
        report.phase = Some(DrainPhase::Draining);
        progress.send_replace(report.clone());
        if forward_until_quiet(client, settings, from, &mut report, progress, cancel).await?.is_none() {
            return Ok(report);
        }
        // 3. Delete what is copied; anything written meanwhile is copied and drained again.
        let (pending, next) = delete_pass(client, settings, &mut report, progress, cancel).await?;
        if cancel.is_cancelled() {
            return Ok(report);
        }
        if pending == 0 {
            report.phase = Some(DrainPhase::Complete);
            report.message = Some(format!(
                "legacy prefix {} drained in {:.1}s",
                settings.legacy_prefix,
                started.elapsed().as_secs_f64()
            ));
            progress.send_replace(report.clone());
            info!(copied = report.copied, deleted = report.deleted, skipped = report.skipped, "drain complete");
            return Ok(report);
        }
        from = next;
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

/// Pages the legacy prefix at one revision and copies it; returns that revision.
async fn copy_pass(
    client: &Client,
    settings: &DrainSettings,
    report: &mut DrainReport,
    progress: &watch::Sender<DrainReport>,
    cancel: &CancellationToken,
    started: Instant,
) -> anyhow::Result<i64> {
    let mut kv = client.kv_client();
    let (mut cursor, end, revision) = legacy_snapshot(&mut kv, settings).await?;
    let mut inflight = FuturesUnordered::new();
    let page = (settings.batch_size * settings.parallelism.max(1) * 2) as i64;
    loop {
        if cancel.is_cancelled() {
            return Ok(revision);
        }
        let (legacy, more) = legacy_page(&mut kv, settings, &end, &mut cursor, revision, page).await?;
        for batch in legacy.chunks(settings.batch_size.max(1)) {
            while inflight.len() >= settings.parallelism.max(1) {
                merge(report, inflight.next().await.expect("non-empty")?);
            }
            inflight.push(copy_batch(client.clone(), settings.clone(), batch.to_vec()));
        }
        while inflight.len() > settings.parallelism.max(1) {
            merge(report, inflight.next().await.expect("non-empty")?);
        }
        progress.send_replace(report.clone());
        pace(settings, report.legacy_seen, started).await;
        if !more {
            break;
        }
    }
    while let Some(result) = inflight.next().await {
        merge(report, result?);
    }
    progress.send_replace(report.clone());
    Ok(revision)
}

/// Where a pass over the legacy prefix starts: (first key, range end, the revision to pin).
async fn legacy_snapshot(
    kv: &mut etcd_client::KvClient,
    settings: &DrainSettings,
) -> anyhow::Result<(Vec<u8>, Vec<u8>, i64)> {
    let prefix = settings.legacy_prefix.as_bytes().to_vec();
    let end = prefix_range_end(&prefix);
    let head = rpc(
        settings.rpc_timeout,
        "count legacy keys",
        kv.get(prefix.clone(), Some(GetOptions::new().with_range(end.clone()).with_count_only())),
    )
    .await?;
    let revision = head.header().map(|h| h.revision()).ok_or_else(|| anyhow!("range response without header"))?;
    Ok((prefix, end, revision))
}

/// One page of legacy keys at `revision` from `cursor` (which it advances); and whether more follow.
async fn legacy_page(
    kv: &mut etcd_client::KvClient,
    settings: &DrainSettings,
    end: &[u8],
    cursor: &mut Vec<u8>,
    revision: i64,
    limit: i64,
) -> anyhow::Result<(Vec<Legacy>, bool)> {
    let opts = GetOptions::new().with_range(end.to_vec()).with_revision(revision).with_limit(limit);
    let mut resp = rpc(settings.rpc_timeout, "range legacy page", kv.get(cursor.clone(), Some(opts))).await?;
    let more = resp.more();
    let kvs = resp.take_kvs();
    if let Some(last) = kvs.last() {
        *cursor = last.key().to_vec();
        cursor.push(0);
    }
    Ok((kvs.iter().map(Legacy::from_kv).collect(), more))
}

impl Legacy {
    fn from_kv(kv: &etcd_client::KeyValue) -> Self {
        Legacy {
            key: String::from_utf8_lossy(kv.key()).to_string(),
            value: kv.value().to_vec(),
            mod_revision: kv.mod_revision(),
        }
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
    report.conflicts += o.conflicts;
    for k in o.skipped_keys {
        if report.skipped_keys.len() < super::plan::SKIPPED_KEYS_SHOWN {
            report.skipped_keys.push(k);
        }
    }
}

/// Copies one batch of legacy keys, retrying the keys whose compares failed until none is left.
async fn copy_batch(client: Client, settings: DrainSettings, mut batch: Vec<Legacy>) -> anyhow::Result<BatchOutcome> {
    let mut total = BatchOutcome::default();
    let mut kv = client.kv_client();
    loop {
        let outcome = copy_once(&mut kv, &settings, &batch).await?;
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
    batch: &[Legacy],
) -> anyhow::Result<BatchOutcome> {
    let mut outcome = BatchOutcome::default();
    let targets: Vec<Result<crate::keys::EndpointKeyV1, String>> = batch
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
            && !settings.dry_run
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
    let resp = rpc(settings.rpc_timeout, "copy batch", kv.txn(Txn::new().and_then(ops))).await?;
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

/// Forwards legacy writes from `from` until the prefix has been quiet for the quiet period.
/// Returns None when cancelled.
async fn forward_until_quiet(
    client: &Client,
    settings: &DrainSettings,
    from: i64,
    report: &mut DrainReport,
    progress: &watch::Sender<DrainReport>,
    cancel: &CancellationToken,
) -> anyhow::Result<Option<()>> {
    let mut watch_client = client.watch_client();
    let options = WatchOptions::new().with_prefix().with_start_revision(from).with_prev_key();
    let mut stream = rpc(
        settings.rpc_timeout,
        "watch legacy prefix",
        watch_client.watch(settings.legacy_prefix.as_str(), Some(options)),
    )
    .await?;
    let mut kv = client.kv_client();
    let mut last_write = Instant::now();
    loop {
        let quiet_left = settings.quiet_period.saturating_sub(last_write.elapsed());
        if quiet_left.is_zero() {
            return Ok(Some(()));
        }
        tokio::select! {
            _ = cancel.cancelled() => return Ok(None),
            _ = tokio::time::sleep(quiet_left) => {}
            message = stream.message() => {
                let Some(resp) = message.context("watching the legacy prefix")? else { anyhow::bail!("the legacy watch closed") };
                if resp.canceled() {
                    anyhow::bail!("the legacy watch was cancelled ({}); the drain restarts", resp.cancel_reason());
                }
                let mut puts = Vec::new();
                for event in resp.events() {
                    let Some(kv_) = event.kv() else { continue };
                    last_write = Instant::now();
                    match event.event_type() {
                        EventType::Put => puts.push(Legacy::from_kv(kv_)),
                        EventType::Delete => {
                            if let Some(prev) = event.prev_kv() {
                                forward_delete(&mut kv, settings, prev).await?;
                            }
                        }
                    }
                }
                // Only the latest write of a key matters; it carries the newest mod revision.
                puts.reverse();
                let mut seen = std::collections::HashSet::new();
                puts.retain(|l| seen.insert(l.key.clone()));
                for batch in puts.chunks(settings.batch_size.max(1)) {
                    merge(report, copy_batch(client.clone(), settings.clone(), batch.to_vec()).await?);
                }
                progress.send_replace(report.clone());
            }
        }
    }
}

/// A legacy registrar deleted an endpoint: delete its v1 copy too, if the copy still holds the
/// deleted value (a newer registrar's write is left alone).
async fn forward_delete(
    kv: &mut etcd_client::KvClient,
    settings: &DrainSettings,
    prev: &etcd_client::KeyValue,
) -> anyhow::Result<()> {
    let key = String::from_utf8_lossy(prev.key()).to_string();
    let Ok(v1) =
        v1_key_for(&key, &settings.legacy_prefix, prev.value(), &settings.default_region, &settings.default_cluster)
    else {
        return Ok(());
    };
    let v1 = v1.to_string();
    let txn = Txn::new()
        .when([Compare::value(v1.as_str(), CompareOp::Equal, prev.value().to_vec())])
        .and_then([TxnOp::delete(v1.as_str(), None)]);
    rpc(settings.rpc_timeout, "forward legacy delete", kv.txn(txn)).await?;
    Ok(())
}

/// What deleting one batch did.
struct DeleteOutcome {
    deleted: i64,
    conflicts: i64,
    /// Keys that still need a delete round (copied just now, or written meanwhile).
    pending: usize,
    copied: BatchOutcome,
}

/// Deletes the keys of one batch whose v1 key is newer (each with a compare on its mod revision),
/// and copies the ones not copied yet.
async fn delete_batch(client: Client, settings: DrainSettings, batch: Vec<Legacy>) -> anyhow::Result<DeleteOutcome> {
    let mut kv = client.kv_client();
    let mut outcome = DeleteOutcome { deleted: 0, conflicts: 0, pending: 0, copied: BatchOutcome::default() };
    let targets: Vec<Option<String>> = batch
        .iter()
        .map(|l| {
            v1_key_for(&l.key, &settings.legacy_prefix, &l.value, &settings.default_region, &settings.default_cluster)
                .ok()
                .map(|k| k.to_string())
        })
        .collect();
    let v1_keys: Vec<String> = targets.iter().flatten().cloned().collect();
    let states = read_states(&mut kv, &settings, &v1_keys).await?;
    let mut deletes: Vec<(&str, i64)> = Vec::new();
    let mut to_copy: Vec<Legacy> = Vec::new();
    for (legacy, target) in batch.iter().zip(&targets) {
        // Malformed keys stay forever; keys not copied yet are copied now and deleted in the
        // next round.
        let Some(target) = target else { continue };
        match states.get(target) {
            Some(s) if s.mod_revision > legacy.mod_revision => deletes.push((&legacy.key, legacy.mod_revision)),
            _ => to_copy.push(legacy.clone()),
        }
    }
    if !deletes.is_empty() {
        let ops: Vec<TxnOp> = deletes
            .iter()
            .map(|(key, mod_revision)| {
                let guarded = Txn::new()
                    .when([Compare::mod_revision(*key, CompareOp::Equal, *mod_revision)])
                    .and_then([TxnOp::delete(*key, None)]);
                TxnOp::txn(guarded)
            })
            .collect();
        let resp = rpc(settings.rpc_timeout, "delete legacy batch", kv.txn(Txn::new().and_then(ops))).await?;
        for r in resp.op_responses() {
            if let TxnOpResponse::Txn(nested) = r {
                if nested.succeeded() {
                    outcome.deleted += 1;
                } else {
                    // Written meanwhile: never lost; the watch from the next revision forwards it.
                    outcome.conflicts += 1;
                    outcome.pending += 1;
                }
            }
        }
    }
    if !to_copy.is_empty() {
        outcome.pending += to_copy.len();
        outcome.copied = copy_batch(client.clone(), settings.clone(), to_copy).await?;
    }
    Ok(outcome)
}

/// Deletes every legacy key whose v1 key holds it (or something newer), each with a compare on
/// its mod revision. Returns how many legacy keys still need copying, and the revision to watch
/// from for them.
async fn delete_pass(
    client: &Client,
    settings: &DrainSettings,
    report: &mut DrainReport,
    progress: &watch::Sender<DrainReport>,
    cancel: &CancellationToken,
) -> anyhow::Result<(usize, i64)> {
    let mut kv = client.kv_client();
    let (mut cursor, end, revision) = legacy_snapshot(&mut kv, settings).await?;
    let mut pending = 0usize;
    let mut inflight = FuturesUnordered::new();
    let parallelism = settings.parallelism.max(1);
    let page = (settings.batch_size.max(1) * parallelism * 2) as i64;
    let mut settle = |report: &mut DrainReport, outcome: DeleteOutcome| {
        report.deleted += outcome.deleted;
        report.conflicts += outcome.conflicts;
        pending += outcome.pending;
        merge(report, outcome.copied);
    };
    loop {
        if cancel.is_cancelled() {
            break;
        }
        let (legacy, more) = legacy_page(&mut kv, settings, &end, &mut cursor, revision, page).await?;
        for batch in legacy.chunks(settings.batch_size.max(1)) {
            while inflight.len() >= parallelism {
                settle(report, inflight.next().await.expect("non-empty")?);
            }
            inflight.push(delete_batch(client.clone(), settings.clone(), batch.to_vec()));
        }
        progress.send_replace(report.clone());
        if !more {
            break;
        }
    }
    while let Some(outcome) = inflight.next().await {
        settle(report, outcome?);
    }
    progress.send_replace(report.clone());
    Ok((pending, revision + 1))
}
