//! A full mesh: N regions on this machine, each an etcd holding 1,000 endpoints of its own and one
//! operator's data plane as its own process (`aether-bench worker --region`, the mirror workers of
//! one operator with the CRD's defaults, without the Kubernetes side), mirroring into every other
//! region: N processes, N(N-1) workers. Printed for N = 4, 8 and 16: the time until every region
//! holds every other region's copy (and what the workers went through: resyncs, failed sessions,
//! CPU), each process's RSS and CPU idle and under 100 writes/s per region (fewer past 16 regions:
//! `load_rate`), the RPCs each etcd serves, and the time until the last write of the load is everywhere.
use crate::fixtures::{count, fill_region, key, value};
use crate::operator::scrape;
use crate::process::{Synced, WorkerProcess, busy_percent, cpu_seconds, etcd_pid, machine_ticks};
use crate::sockets::PeakSampler;
use crate::table::Table;
use aether_harness::EtcdServer;
use aether_operator::keys;
use etcd_client::Client;
use std::time::{Duration, Instant};

pub const MESH_SIZES: [usize; 3] = [4, 8, 16];
const ENDPOINTS_PER_REGION: usize = 1_000;
/// How long each of the idle and the loaded windows is measured.
const WINDOW: Duration = Duration::from_secs(30);
/// Writes per second into each region's own subtree in the loaded window...
const LOAD_RATE: u64 = 100;
/// ...unless the copies they cause on this one machine (each write lands on N-1 peers) would pass
/// this many key writes a second: 16 regions at 100/s. At 32, 100/s each is 99,200 copies a second,
/// past what 32 etcds on 2 cores take; the window then ran for over 20 minutes, measuring a
/// backlog rather than the mesh.
const LOAD_COPIES_PER_SECOND: u64 = 24_000;

/// The loaded window's writes per second into each region of a mesh of `n`.
fn load_rate(n: usize) -> u64 {
    let copies_per_write = (n.saturating_sub(1)).max(1) as u64;
    LOAD_RATE.min(LOAD_COPIES_PER_SECOND / (n as u64 * copies_per_write)).max(1)
}
/// How long the mesh may take to converge before the row says it did not.
const CONVERGE_LIMIT: Duration = Duration::from_secs(300);

pub async fn bench_mesh(table: &mut Table) -> anyhow::Result<()> {
    for n in mesh_sizes()? {
        mesh(table, n).await?;
    }
    Ok(())
}

/// The sizes `AETHER_BENCH_MESH` asks for, else [`MESH_SIZES`].
fn mesh_sizes() -> anyhow::Result<Vec<usize>> {
    let Ok(sizes) = std::env::var("AETHER_BENCH_MESH") else { return Ok(MESH_SIZES.to_vec()) };
    sizes
        .split(',')
        .map(|n| n.trim().parse().map_err(|e| anyhow::anyhow!("AETHER_BENCH_MESH={sizes}: {n:?} is not a size: {e}")))
        .collect()
}

/// Each region's etcd client port.
fn client_ports(regions: &[Region]) -> Vec<u16> {
    regions.iter().map(|r| r.etcd.endpoint().rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or(0)).collect()
}

/// "mean M, max X" of per-etcd counts.
fn spread_of(counts: &[usize]) -> String {
    let mean = counts.iter().sum::<usize>() as f64 / counts.len().max(1) as f64;
    format!("mean {mean:.0}, max {}", counts.iter().max().unwrap_or(&0))
}

struct Region {
    name: String,
    etcd: EtcdServer,
    client: Client,
}

async fn mesh(table: &mut Table, n: usize) -> anyhow::Result<()> {
    println!("mesh: {n} regions, {ENDPOINTS_PER_REGION} endpoints each, every region into every other");
    let names: Vec<String> = (0..n).map(|i| format!("m{n}r{i:02}")).collect();
    let servers = futures::future::try_join_all(names.iter().map(|name| EtcdServer::start(name))).await?;
    let mut regions = Vec::new();
    for (name, etcd) in names.into_iter().zip(servers) {
        let client = Client::connect([etcd.endpoint()], None).await?;
        fill_region(&client, &name, ENDPOINTS_PER_REGION, "v0").await?;
        regions.push(Region { name, etcd, client });
    }

    // Convergence: every process started at once; each says when all its peers are synced.
    let etcd_cpu_before: Vec<f64> = regions.iter().map(|r| cpu_seconds(&etcd_pid(&r.etcd))).collect();
    let rpc_before = futures::future::join_all(regions.iter().map(|r| rpcs(&r.etcd))).await;
    let ticks = machine_ticks();
    let mut processes = Vec::new();
    for region in &regions {
        let peers: Vec<(String, String)> = regions
            .iter()
            .filter(|other| other.name != region.name)
            .map(|other| (other.name.clone(), other.etcd.endpoint()))
            .collect();
        processes.push(WorkerProcess::start_as(Some(&region.name), &region.etcd.endpoint(), &peers)?);
    }
    let sampler = PeakSampler::start(client_ports(&regions));
    let mut synced = Synced::default();
    let mut each = Vec::new();
    for process in &mut processes {
        let this = process.wait_synced_counting()?;
        each.push(this.elapsed.as_secs_f64());
        synced.merge(this);
    }
    let converging_connections = sampler.stop();
    let busy = busy_percent(ticks, machine_ticks());
    let etcd_cpu: f64 =
        regions.iter().zip(&etcd_cpu_before).map(|(r, before)| cpu_seconds(&etcd_pid(&r.etcd)) - before).sum();
    let operator_cpu: f64 = processes.iter().map(WorkerProcess::cpu_seconds).sum();
    let rpc_after = futures::future::join_all(regions.iter().map(|r| rpcs(&r.etcd))).await;
    let per_etcd = |pick: fn(&(f64, f64)) -> f64| -> f64 {
        rpc_before.iter().zip(&rpc_after).map(|(b, a)| pick(a) - pick(b)).sum::<f64>() / n as f64
    };
    let (reads, writes) = (per_etcd(|r| r.0), per_etcd(|r| r.1));
    each.sort_by(f64::total_cmp);
    let converged = synced.elapsed;
    let missing = missing_copies(&regions, ENDPOINTS_PER_REGION as i64).await;
    table.row_with(
        &format!("mesh {n} regions x {ENDPOINTS_PER_REGION} endpoints"),
        "converged",
        format!("{:.1}s", converged.as_secs_f64()),
        format!(
            "{} processes, {} workers (one per ordered pair); {}; processes whole after {:.1} s (first) / {:.1} s (median) / {:.1} s (last); {}; CPU meanwhile: etcds {etcd_cpu:.1} s, operators {operator_cpu:.1} s, machine {busy:.0} % busy; per etcd {reads:.0} reads and {writes:.0} writes as RPCs; client connections per etcd at their peak while converging: {}",
            n,
            n * (n - 1),
            if missing == 0 { "every copy complete".to_string() } else { format!("{missing} copies INCOMPLETE") },
            each.first().unwrap_or(&0.0),
            each[each.len() / 2],
            each.last().unwrap_or(&0.0),
            synced.describe(),
            spread_of(&converging_connections),
        ),
        serde_json::json!({
            "regions": n, "converged_s": converged.as_secs_f64(), "incomplete_copies": missing,
            "process_synced_s": each, "resyncs": synced.resyncs, "resync_causes": synced.resync_causes, "session_failures": synced.session_failures,
            "last_errors": synced.errors, "etcd_cpu_s": etcd_cpu, "operator_cpu_s": operator_cpu,
            "machine_busy_percent": busy, "reads_per_etcd": reads, "writes_per_etcd": writes,
            "peak_connections_per_etcd": converging_connections,
        }),
    );

    let idle = measure(&regions, &processes, None).await;
    idle.report(table, n, "idle");
    let rate = load_rate(n);
    let loaded = measure(&regions, &processes, Some(rate)).await;
    loaded.report(table, n, &format!("{rate} writes/s per region"));

    // The load's last write of every region, on every peer.
    let started = Instant::now();
    let mut behind = usize::MAX;
    while behind > 0 && started.elapsed() < CONVERGE_LIMIT {
        behind = stale_copies(&regions, loaded.last_index).await;
        if behind > 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    table.row(
        &format!("mesh {n} regions, after the load"),
        "last write everywhere",
        if behind == 0 { format!("{:.2}s", started.elapsed().as_secs_f64()) } else { "NOT REACHED".into() },
        format!("after the writers stopped; {behind} copies still behind"),
    );
    drop(processes);
    Ok(())
}

/// Copies (origin, peer) whose key count differs from the origin's.
async fn missing_copies(regions: &[Region], expected: i64) -> usize {
    let mut missing = 0;
    for peer in regions {
        for origin in regions.iter().filter(|o| o.name != peer.name) {
            if count(&peer.client, &keys::region_prefix(&origin.name)).await != expected {
                missing += 1;
            }
        }
    }
    missing
}

/// Copies whose last written key does not hold the origin's value yet.
async fn stale_copies(regions: &[Region], last_index: Option<usize>) -> usize {
    let Some(i) = last_index else { return 0 };
    let mut stale = 0;
    for origin in regions {
        let k = key(&origin.name, i % ENDPOINTS_PER_REGION);
        let want = value_at(&origin.client, &k).await;
        for peer in regions.iter().filter(|p| p.name != origin.name) {
            let got = value_at(&peer.client, &k).await;
            if got != want {
                stale += 1;
            }
        }
    }
    stale
}

/// One window's figures.
struct Window {
    /// Each process's CPU over the window, in % of one core.
    cpu: Vec<f64>,
    /// Each process's RSS at the end, KiB.
    rss: Vec<u64>,
    /// Each etcd's read and write RPCs per second over the window.
    reads: Vec<f64>,
    writes: Vec<f64>,
    /// The machine's busy share over the window.
    busy: f64,
    /// The index of the last key the load wrote (None when idle).
    last_index: Option<usize>,
    written: u64,
    /// How long the window took (the load's writers may fall behind on a busy machine).
    elapsed: f64,
    /// Each etcd's peak of client connections over the window.
    connections: Vec<usize>,
}

/// Measures a window; with `rate`, a writer per region puts that many writes a second into the
/// region's own subtree meanwhile.
async fn measure(regions: &[Region], processes: &[WorkerProcess], rate: Option<u64>) -> Window {
    let cpu_before: Vec<f64> = processes.iter().map(WorkerProcess::cpu_seconds).collect();
    let rpc_before = futures::future::join_all(regions.iter().map(|r| rpcs(&r.etcd))).await;
    let ticks = machine_ticks();
    let sampler = PeakSampler::start(client_ports(regions));
    let started = Instant::now();
    let (last_index, written) = match rate {
        None => {
            // Nothing to wait for: the window is the measurement.
            tokio::time::sleep(WINDOW).await;
            (None, 0)
        }
        Some(rate) => load(regions, rate).await,
    };
    let elapsed = started.elapsed().as_secs_f64();
    let connections = sampler.stop();
    let busy = busy_percent(ticks, machine_ticks());
    let cpu =
        processes.iter().zip(&cpu_before).map(|(p, before)| 100.0 * (p.cpu_seconds() - before) / elapsed).collect();
    let rss = processes.iter().map(WorkerProcess::rss_kb).collect();
    let rpc_after = futures::future::join_all(regions.iter().map(|r| rpcs(&r.etcd))).await;
    let per_second = |pick: fn(&(f64, f64)) -> f64| -> Vec<f64> {
        rpc_before.iter().zip(&rpc_after).map(|(b, a)| (pick(a) - pick(b)) / elapsed).collect()
    };
    Window {
        cpu,
        rss,
        reads: per_second(|r| r.0),
        writes: per_second(|r| r.1),
        busy,
        last_index,
        written,
        elapsed,
        connections,
    }
}

/// Writes `rate` puts a second into each region's own subtree for the window; returns the index
/// of the last key written and how many writes were made.
async fn load(regions: &[Region], rate: u64) -> (Option<usize>, u64) {
    let writes = (rate * WINDOW.as_secs()) as usize;
    let every = Duration::from_secs_f64(1.0 / rate as f64);
    let writers = regions.iter().map(|region| {
        let mut client = region.client.clone();
        let name = region.name.clone();
        async move {
            let mut ticker = tokio::time::interval(every);
            let mut done = 0u64;
            for i in 0..writes {
                ticker.tick().await;
                let value = value(i, &format!("load-{i}"));
                if client.put(key(&name, i % ENDPOINTS_PER_REGION), value, None).await.is_ok() {
                    done += 1;
                }
            }
            done
        }
    });
    let done: u64 = futures::future::join_all(writers).await.into_iter().sum();
    (writes.checked_sub(1), done)
}

/// An etcd's read (Range) and write (Txn, Put, DeleteRange) RPCs served so far.
async fn rpcs(etcd: &EtcdServer) -> (f64, f64) {
    let port = etcd.endpoint().rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let metrics = scrape(port).await;
    let mut totals = (0.0, 0.0);
    for line in metrics.lines().filter(|l| l.starts_with("grpc_server_handled_total{")) {
        let value: f64 = line.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or(0.0);
        if line.contains("grpc_method=\"Range\"") {
            totals.0 += value;
        } else if ["Txn", "Put", "DeleteRange"].iter().any(|m| line.contains(&format!("grpc_method=\"{m}\""))) {
            totals.1 += value;
        }
    }
    totals
}

impl Window {
    fn report(&self, table: &mut Table, n: usize, what: &str) {
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let max = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
        let rss: Vec<f64> = self.rss.iter().map(|kb| *kb as f64 / 1024.0).collect();
        let load = match self.last_index {
            Some(_) => format!(
                "{} writes made, {:.0}/s per region; ",
                self.written,
                self.written as f64 / self.elapsed / n as f64
            ),
            None => String::new(),
        };
        table.row_with(
            &format!("mesh {n} regions, {what}"),
            "per operator process",
            format!("CPU {:.2}% of a core (max {:.2}%), RSS {:.1} MiB (max {:.1})", mean(&self.cpu), max(&self.cpu), mean(&rss), max(&rss)),
            format!(
                "{load}per etcd: {:.1} reads/s (max {:.1}), {:.1} writes/s (max {:.1}) as RPCs (a read is a page of up to 1,000 keys, a write a Txn of up to 125), client connections at their peak {}; machine {:.0}% busy over {:.0}s",
                mean(&self.reads),
                max(&self.reads),
                mean(&self.writes),
                max(&self.writes),
                spread_of(&self.connections),
                self.busy,
                self.elapsed
            ),
            serde_json::json!({
                "regions": n, "window": what, "cpu_percent": self.cpu, "rss_mib": rss,
                "etcd_reads_per_s": self.reads, "etcd_writes_per_s": self.writes, "machine_busy_percent": self.busy,
                "writes_made": self.written, "window_s": self.elapsed,
                "peak_connections_per_etcd": self.connections,
            }),
        );
    }
}

/// The value of `key` on one region's etcd (None when absent or unreadable).
async fn value_at(client: &Client, key: &str) -> Option<Vec<u8>> {
    client.clone().get(key, None).await.ok().and_then(|r| r.kvs().first().map(|kv| kv.value().to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_load_keeps_100_writes_per_region_up_to_16_regions_and_the_machines_copy_budget_past_it() {
        assert_eq!(load_rate(4), 100);
        assert_eq!(load_rate(16), 100);
        assert_eq!(load_rate(32), 24, "32 x 31 x 24 = 23,808 copies/s");
        assert_eq!(load_rate(64), 5);
        assert!(load_rate(1) >= 1);
    }
}
