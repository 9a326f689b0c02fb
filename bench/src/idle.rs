//! An idle federation's cost to its etcds: 4 regions, each an etcd holding K endpoints of its own
//! and every other region's copy, each region's operator data plane as its own process at the
//! CRD's defaults (TTL 30 s, keepalive 10 s, verification at 1,000 keys/s, and the inbound view
//! the status refresh reads every 5 s). Each etcd's CPU is measured over four windows:
//! 1. before the operators start (the etcd with its own keys, no client);
//! 2. the federation idle: what it adds to each etcd, the target being under 1 % of a core;
//! 3. the same, plus the count-only range of each origin's subtree every 5 s that the inbound view
//!    read before it took the count from the origin's records: what counting cost, for
//!    comparison (it grows with K);
//! 4. the federation idle with verification off (the operators restarted with
//!    `verifyKeysPerSecond: 0`; they resume their mirrors): what the rest costs.
//!
//! Printed for K = 10k and 100k (`AETHER_BENCH_IDLE_KEYS`, a comma-separated list, sets others):
//! a cost flat in K is the same in both rows.
//!
//! The row also says whether the inbound view showed every copy whole (its keys equal to the
//! origin's), so that a cheaper view that is wrong cannot pass as a cheaper view.
use crate::fixtures::{count, fill_region};
use crate::process::{WorkerProcess, cpu_seconds, etcd_pid};
use crate::table::Table;
use aether_harness::{EtcdFlavor, EtcdServer};
use aether_operator::keys;
use aether_operator::mirror::inbound;
use etcd_client::{Client, GetOptions};
use std::time::{Duration, Instant};

const REGIONS: usize = 4;
/// Endpoints per region by default; `AETHER_BENCH_IDLE_KEYS` sets others (1000000 for 4 x 1M,
/// which needs about 10 GB of memory and half an hour here).
const KEYS: [usize; 2] = [10_000, 100_000];
const WINDOW: Duration = Duration::from_secs(60);
/// The status refresh's default interval (`--refresh-seconds`).
const REFRESH: Duration = Duration::from_secs(5);
/// The most an idle federation may add to an etcd, in % of one core.
const TARGET_PERCENT: f64 = 1.0;

struct Region {
    name: String,
    etcd: EtcdServer,
    client: Client,
}

pub async fn bench_idle(table: &mut Table) -> anyhow::Result<()> {
    for k in crate::fixtures::sizes_from_env("AETHER_BENCH_IDLE_KEYS", &KEYS)? {
        idle(table, k).await?;
    }
    Ok(())
}

async fn idle(table: &mut Table, k: usize) -> anyhow::Result<()> {
    println!("idle: {REGIONS} regions x {k} endpoints, every region into every other, then idle");
    let names: Vec<String> = (0..REGIONS).map(|i| format!("idle{k}r{i}")).collect();
    let servers = futures::future::try_join_all(
        names
            .iter()
            .map(|name| EtcdServer::start_with(name, EtcdFlavor::Default, &["--quota-backend-bytes", "8589934592"])),
    )
    .await?;
    let mut regions = Vec::new();
    for (name, etcd) in names.into_iter().zip(servers) {
        let client = Client::connect([etcd.endpoint()], None).await?;
        fill_region(&client, &name, k, "v0").await?;
        regions.push(Region { name, etcd, client });
    }

    let alone = etcd_cpu_percent(&regions, None).await;
    let started = Instant::now();
    let processes = operators(&regions, true)?;
    let synced_after = started.elapsed();
    // The syncs' last Txns, records and compactions settle before the idle windows.
    tokio::time::sleep(Duration::from_secs(30)).await;
    let federation = etcd_cpu_percent(&regions, None).await;
    let counting = etcd_cpu_percent(&regions, Some(&regions)).await;
    let (shown_whole, copies) = views_whole(&regions, k as i64).await;
    drop(processes);
    let processes = operators(&regions, false)?;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let unverified = etcd_cpu_percent(&regions, None).await;
    let (unverified_whole, _) = views_whole(&regions, k as i64).await;
    drop(processes);

    let added: Vec<f64> = federation.iter().zip(&alone).map(|(f, a)| f - a).collect();
    let counted: Vec<f64> = counting.iter().zip(&federation).map(|(c, f)| c - f).collect();
    let without_verification: Vec<f64> = unverified.iter().zip(&alone).map(|(u, a)| u - a).collect();
    let (added_mean, added_max) = (mean(&added), added.iter().cloned().fold(f64::MIN, f64::max));
    let verdict = if added_max < TARGET_PERCENT {
        format!("target < {TARGET_PERCENT} % met")
    } else {
        format!("target < {TARGET_PERCENT} % NOT met")
    };
    table.row_with(
        &format!("idle federation {REGIONS} regions x {k} keys"),
        "CPU added to each etcd",
        format!("{added_mean:.2} % of a core (max {added_max:.2} %)"),
        format!(
            "{verdict}; each etcd {:.2} % before the operators started, {:.2} % with the federation idle; of what it adds, {:.2} % (max {:.2} %) is left with verification off (keepalives, the status refresh's reads), the rest is verification comparing 1,000 keys/s of each origin (spec.sync.verifyKeysPerSecond); counting each origin's keys every {}s, as the inbound view did, would add {:.2} % more (max {:.2} %); the inbound view showed {shown_whole} of {copies} copies whole ({unverified_whole} after the operators restarted); synced after {:.0}s; {}s windows",
            mean(&alone),
            mean(&federation),
            mean(&without_verification),
            without_verification.iter().cloned().fold(f64::MIN, f64::max),
            REFRESH.as_secs(),
            mean(&counted),
            counted.iter().cloned().fold(f64::MIN, f64::max),
            synced_after.as_secs_f64(),
            WINDOW.as_secs(),
        ),
        serde_json::json!({
            "regions": REGIONS, "keys_per_region": k, "etcd_cpu_percent_alone": alone,
            "etcd_cpu_percent_federation": federation, "etcd_cpu_percent_counting": counting,
            "etcd_cpu_percent_unverified": unverified, "added_without_verification_percent": without_verification,
            "views_whole_after_restart": unverified_whole,
            "added_percent": added, "counting_adds_percent": counted, "target_percent": TARGET_PERCENT,
            "views_whole": shown_whole, "copies": copies, "synced_s": synced_after.as_secs_f64(),
        }),
    );
    Ok(())
}

/// One operator data plane per region, each mirroring into every other, once each says every peer
/// holds its copy (synced, or resumed from its records); `verify` at the CRD's default budget, or
/// off.
fn operators(regions: &[Region], verify: bool) -> anyhow::Result<Vec<WorkerProcess>> {
    let mut processes = Vec::new();
    for region in regions {
        let peers: Vec<(String, String)> = regions
            .iter()
            .filter(|other| other.name != region.name)
            .map(|other| (other.name.clone(), other.etcd.endpoint()))
            .collect();
        let endpoint = region.etcd.endpoint();
        processes.push(match verify {
            true => WorkerProcess::start_as(Some(&region.name), &endpoint, &peers)?,
            false => WorkerProcess::start_unverified(&region.name, &endpoint, &peers)?,
        });
    }
    for process in &mut processes {
        process.wait_synced()?;
    }
    Ok(processes)
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Each etcd's CPU over a window, in % of one core; with `count_in`, each etcd also serves the
/// count-only range of every other region's copy every [`REFRESH`] meanwhile.
async fn etcd_cpu_percent(regions: &[Region], count_in: Option<&[Region]>) -> Vec<f64> {
    let pids: Vec<String> = regions.iter().map(|r| etcd_pid(&r.etcd)).collect();
    let before: Vec<f64> = pids.iter().map(|p| cpu_seconds(p)).collect();
    let started = Instant::now();
    match count_in {
        None => tokio::time::sleep(WINDOW).await,
        Some(regions) => {
            let mut tick = tokio::time::interval(REFRESH);
            while started.elapsed() < WINDOW {
                tick.tick().await;
                for peer in regions {
                    for origin in regions.iter().filter(|o| o.name != peer.name) {
                        let options = GetOptions::new().with_prefix().with_count_only();
                        let _ = peer.client.kv_client().get(keys::region_prefix(&origin.name), Some(options)).await;
                    }
                }
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    pids.iter().zip(&before).map(|(p, b)| 100.0 * (cpu_seconds(p) - b) / elapsed).collect()
}

/// How many copies the inbound view of their region shows whole (the origin's keys, synced), of
/// how many there are; each also counted on the etcd, so that a view that is wrong shows here.
async fn views_whole(regions: &[Region], expected: i64) -> (usize, usize) {
    let (mut whole, mut copies) = (0, 0);
    for region in regions {
        let others: Vec<String> = regions.iter().filter(|o| o.name != region.name).map(|o| o.name.clone()).collect();
        let view = inbound::observe(&mut region.client.clone(), &region.name, &others).await.unwrap_or_default();
        for origin in &others {
            copies += 1;
            let held = count(&region.client, &keys::region_prefix(origin)).await;
            if view.iter().any(|o| &o.origin == origin && o.synced && o.keys == expected && held == expected) {
                whole += 1;
            }
        }
    }
    (whole, copies)
}
