//! Following the origin: catching up on revisions missed while down, and the steady state under a
//! constant write rate (lag, CPU, memory), next door and over a WAN.
use crate::fixtures::{
    MAKE_MIRROR_BUDGET, at_rtt, behind, bench_config, fill, key, make_mirror, spawn_worker, tempfile_dir, value,
    wait_count, wait_synced,
};
use crate::table::Table;
use aether_harness::EtcdServer;
use aether_operator::keys;
use aether_operator::mirror::EtcdTarget;
use etcd_client::{Client, PutOptions, WatchOptions};
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const CATCHUP_REVISIONS: usize = 20_000;

pub const STEADY_RATE: u64 = 1_000;

pub const STEADY_SECONDS: u64 = 30;

/// Keys the origin already holds in the second steady scenario.
pub const STEADY_PRELOAD: usize = 100_000;

pub async fn bench_catchup(table: &mut Table, rtt: Duration) -> anyhow::Result<()> {
    println!("catch-up of {CATCHUP_REVISIONS} single-key revisions (64 in flight), peer {rtt:?} away");
    let dir = tempfile_dir()?;
    let prefix = keys::region_prefix("a");
    for subject in subjects() {
        let (origin, peer) = tokio::try_join!(EtcdServer::start("cu-a"), EtcdServer::start("cu-b"))?;
        let (_proxy, peer_endpoint) = behind(&peer, rtt).await?;
        let oc = Client::connect([origin.endpoint()], None).await?;
        let pc = Client::connect([peer.endpoint()], None).await?;
        let handle;
        let _mm;
        if subject == "this mirror" {
            handle = Some(spawn_worker(bench_config("b"), &origin, EtcdTarget::plain([peer_endpoint.clone()])));
            wait_synced(handle.as_ref().expect("set"), Duration::from_secs(60)).await?;
            _mm = None;
        } else {
            handle = None;
            _mm = Some(make_mirror(&origin, &peer_endpoint, &dir.path().join("mm-catchup.log"))?);
            tokio::time::sleep(Duration::from_secs(1)).await; // let make-mirror start its watch
        }
        let before = handle.as_ref().map(|h| h.health());
        let slow = SlowWatchers::sample(&origin);
        let start = Instant::now();
        futures::stream::iter(0..CATCHUP_REVISIONS)
            .map(|i| {
                let mut c = oc.clone();
                async move { c.put(key("a", i), value(i, "cu"), None).await }
            })
            .buffer_unordered(64)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<Vec<_>, _>>()?;
        let wrote = start.elapsed();
        let caught = wait_count(&pc, &prefix, CATCHUP_REVISIONS, MAKE_MIRROR_BUDGET * 3).await;
        let total = start.elapsed();
        let unsynced = slow.stop().await;
        // What carried them: peer Txns (and so revisions per Txn) and the splits the growth made,
        // once the worker took every batch as landed (in order, a little after the peer holds
        // the keys).
        let carried = match (&handle, before) {
            (Some(h), Some(before)) => {
                let count_only = etcd_client::GetOptions::new().with_prefix().with_count_only();
                let head =
                    oc.clone().get(prefix.as_str(), Some(count_only)).await?.header().map_or(0, |h| h.revision());
                let mut rx = h.subscribe();
                let landed =
                    tokio::time::timeout(Duration::from_secs(30), rx.wait_for(|h| h.last_applied_revision >= head))
                        .await
                        .is_ok_and(|r| r.is_ok());
                if !landed {
                    println!("  the worker did not take every batch as landed within 30 s");
                }
                let after = h.health();
                let txns = after.txns - before.txns;
                format!(
                    "; {txns} peer Txns ({:.0}/s, {:.1} revisions each), shard splits {}",
                    txns as f64 / total.as_secs_f64(),
                    CATCHUP_REVISIONS as f64 / txns.max(1) as f64,
                    after.shard_splits - before.shard_splits
                )
            }
            _ => String::new(),
        };
        table.row(
            &format!("catch-up {CATCHUP_REVISIONS} revisions{}", at_rtt(rtt)),
            subject,
            format!("{:.2}s", total.as_secs_f64()),
            format!(
                "origin wrote them in {:.2}s; ratio {:.2}{}{carried}; {unsynced}",
                wrote.as_secs_f64(),
                total.as_secs_f64() / wrote.as_secs_f64(),
                if caught.is_some() { "" } else { " (did not finish)" }
            ),
        );
        if let Some(h) = handle {
            h.shutdown().await;
        }
    }
    Ok(())
}

/// etcd's gauge of watchers that fell behind the store (`slow_watcher_total`), sampled on the
/// origin while a scenario runs. A watcher behind is served from the store at most 1,000
/// revisions per 100 ms (etcd's `watchBatchMaxRevs` and `watchResyncPeriod`), whoever watches.
struct SlowWatchers {
    sampler: tokio::task::JoinHandle<Duration>,
    stop: Arc<tokio::sync::Notify>,
}

impl SlowWatchers {
    const EVERY: Duration = Duration::from_millis(50);

    fn sample(origin: &EtcdServer) -> Self {
        let port = origin.client_addr().port();
        let stop = Arc::new(tokio::sync::Notify::new());
        let stopped = stop.clone();
        let sampler = tokio::spawn(async move {
            let mut behind = Duration::ZERO;
            loop {
                let metrics = crate::operator::scrape(port).await;
                let slow = metrics
                    .lines()
                    .find(|l| l.starts_with("etcd_debugging_mvcc_slow_watcher_total "))
                    .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .unwrap_or(0.0);
                if slow > 0.0 {
                    behind += Self::EVERY;
                }
                tokio::select! {
                    _ = stopped.notified() => return behind,
                    _ = tokio::time::sleep(Self::EVERY) => {}
                }
            }
        });
        SlowWatchers { sampler, stop }
    }

    /// What the samples saw, for the table.
    async fn stop(self) -> String {
        self.stop.notify_one();
        match self.sampler.await {
            Ok(behind) if behind.is_zero() => "the origin's watch never fell behind".to_string(),
            Ok(behind) => format!(
                "the origin's watch was behind the store for {:.2}s (etcd then serves it 1,000 revisions per 100 ms)",
                behind.as_secs_f64()
            ),
            Err(e) => format!("origin's metrics unread: {e}"),
        }
    }
}

/// New keys at a steady rate into a subtree that starts with `preload` keys (the shards split as
/// it grows); replication latency from each put's completion to the peer's watch seeing it.
pub async fn bench_steady(table: &mut Table, preload: usize, rtt: Duration) -> anyhow::Result<()> {
    println!("steady state: {STEADY_RATE} new keys/s for {STEADY_SECONDS}s onto {preload} keys, peer {rtt:?} away");
    let dir = tempfile_dir()?;
    let scenario = if preload == 0 {
        format!("steady {STEADY_RATE}/s for {STEADY_SECONDS}s, growing from empty{}", at_rtt(rtt))
    } else {
        format!("steady {STEADY_RATE}/s for {STEADY_SECONDS}s onto {preload} keys{}", at_rtt(rtt))
    };
    for subject in subjects() {
        let (origin, peer) = tokio::try_join!(EtcdServer::start("st-a"), EtcdServer::start("st-b"))?;
        let (_proxy, peer_endpoint) = behind(&peer, rtt).await?;
        let oc = Client::connect([origin.endpoint()], None).await?;
        fill(&oc, preload, "pre").await?;
        let mut pc = Client::connect([peer.endpoint()], None).await?;
        let handle = if subject == "this mirror" {
            let h = spawn_worker(bench_config("b"), &origin, EtcdTarget::plain([peer_endpoint.clone()]));
            wait_synced(&h, Duration::from_secs(300)).await?;
            Some(h)
        } else {
            None
        };
        let _mm = if handle.is_none() {
            Some(make_mirror(&origin, &peer_endpoint, &dir.path().join("mm-steady.log"))?)
        } else {
            None
        };
        tokio::time::sleep(Duration::from_secs(1)).await;

        let acked: Arc<Mutex<HashMap<Vec<u8>, Instant>>> = Arc::default();
        let seen: Arc<Mutex<HashMap<Vec<u8>, Instant>>> = Arc::default();
        // The origin's own put latencies: the disk's share of any replication latency.
        let put_times: Arc<Mutex<Vec<f64>>> = Arc::default();
        let mut watch = pc.watch(keys::region_prefix("a"), Some(WatchOptions::new().with_prefix())).await?;
        let watcher = {
            let seen = seen.clone();
            tokio::spawn(async move {
                while let Ok(Some(resp)) = watch.message().await {
                    let now = Instant::now();
                    let mut seen = seen.lock().unwrap();
                    for e in resp.events() {
                        if let Some(kv) = e.kv() {
                            seen.entry(kv.key().to_vec()).or_insert(now);
                        }
                    }
                }
            })
        };
        let total = (STEADY_RATE * STEADY_SECONDS) as usize;
        let before = handle.as_ref().map(|h| h.health());
        let mut ticker = tokio::time::interval(Duration::from_micros(1_000_000 / STEADY_RATE));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut inflight = futures::stream::FuturesUnordered::new();
        for i in 0..total {
            ticker.tick().await;
            let (mut c, acked, put_times) = (oc.clone(), acked.clone(), put_times.clone());
            inflight.push(async move {
                let k = key("a", preload + i);
                let sent = Instant::now();
                c.put(k.clone(), value(preload + i, "st"), Some(PutOptions::new())).await?;
                let now = Instant::now();
                acked.lock().unwrap().insert(k.into_bytes(), now);
                put_times.lock().unwrap().push((now - sent).as_secs_f64() * 1000.0);
                Ok::<_, etcd_client::Error>(())
            });
            while let Some(Some(r)) = futures::FutureExt::now_or_never(inflight.next()) {
                r?;
            }
        }
        while let Some(r) = inflight.next().await {
            r?;
        }
        let deadline = Instant::now() + MAKE_MIRROR_BUDGET / 2;
        while seen.lock().unwrap().len() < total && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        watcher.abort();
        let (acked, seen) = (acked.lock().unwrap().clone(), seen.lock().unwrap().clone());
        // A key the peer never showed is a failure, not a key left out: it counts as infinitely late.
        let unseen = acked.keys().filter(|k| !seen.contains_key(*k)).count() + (total - acked.len());
        let mut latencies: Vec<f64> = acked
            .iter()
            .map(|(k, a)| seen.get(k).map_or(f64::INFINITY, |s| s.saturating_duration_since(*a).as_secs_f64() * 1000.0))
            .collect();
        latencies.extend(std::iter::repeat_n(f64::INFINITY, total - acked.len()));
        latencies.sort_by(|a, b| a.total_cmp(b));
        let pct = |p: f64| {
            latencies
                .get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)))
                .copied()
                .unwrap_or(f64::NAN)
        };
        let mut puts = put_times.lock().unwrap().clone();
        puts.sort_by(|a, b| a.total_cmp(b));
        let put_p99 = puts.get(puts.len() * 99 / 100).copied().unwrap_or(f64::NAN);
        let (p50, p99, max) = (pct(0.5), pct(0.99), latencies.last().copied().unwrap_or(f64::NAN));
        let worker = handle.as_ref().map(|h| {
            let (after, before) = (h.health(), before.clone().unwrap_or_else(|| h.health()));
            (
                after.resyncs - before.resyncs,
                after.shard_splits - before.shard_splits,
                after.split_revisions - before.split_revisions,
                after.leases,
                after.txns - before.txns,
            )
        });
        let counters = match worker {
            Some((resyncs, splits, split_revisions, leases, txns)) => format!(
                "; resyncs {resyncs}, shard splits {splits}, split revisions {split_revisions}, {leases} leases; {txns} peer Txns ({:.0}/s)",
                txns as f64 / STEADY_SECONDS as f64
            ),
            None => String::new(),
        };
        // Next door: 1.5x the origin's own put p99 + 5 ms; across regions: the round trip + 1.5x.
        let target = if rtt.is_zero() { 1.5 * put_p99 + 5.0 } else { rtt.as_secs_f64() * 1000.0 + 1.5 * put_p99 };
        table.row_with(
            &scenario,
            subject,
            format!("p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms"),
            format!(
                "{unseen} of {total} keys never seen (failures); the origin's own put p99 {put_p99:.1} ms, target p99 <= {target:.1} ms{counters}"
            ),
            serde_json::json!({
                "p50_ms": p50, "p99_ms": p99, "max_ms": max, "unseen": unseen, "keys": total,
                "put_p99_ms": put_p99, "target_p99_ms": target,
                "resyncs": worker.map(|w| w.0), "shard_splits": worker.map(|w| w.1),
                "split_revisions": worker.map(|w| w.2), "leases": worker.map(|w| w.3),
            }),
        );
        if let Some(h) = handle {
            h.shutdown().await;
        }
    }
    Ok(())
}

/// The subjects of the catch-up and steady scenarios: this mirror and make-mirror, or only this
/// mirror with `AETHER_BENCH_ONLY_THIS=1` (for quick runs; the table then has no make-mirror row).
pub fn subjects() -> Vec<&'static str> {
    if std::env::var_os("AETHER_BENCH_ONLY_THIS").is_some() {
        vec!["this mirror"]
    } else {
        vec!["this mirror", "etcdctl make-mirror"]
    }
}
