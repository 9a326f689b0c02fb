//! One origin mirrored to many peers at once: 15 workers in one process.
use crate::fixtures::{count, fill, rate};
use crate::process::WorkerProcess;
use crate::table::Table;
use aether_harness::{EtcdFlavor, EtcdServer};
use aether_operator::keys;
use etcd_client::Client;
use std::time::Duration;

pub const FANOUT_KEYS: usize = 10_000;
pub const FANOUT_PEERS: usize = 15;

/// One origin mirrored into 15 peers from one process (16 etcds), against the same with one peer:
/// aggregate throughput, memory per worker while syncing and once idle.
pub async fn bench_fanout(table: &mut Table) -> anyhow::Result<()> {
    println!("fan-out: {FANOUT_KEYS} keys into 1 and {FANOUT_PEERS} peers from one process");
    let prefix = keys::region_prefix("a");
    let origin = EtcdServer::start("fan-origin").await?;
    let oc = Client::connect([origin.endpoint()], None).await?;
    fill(&oc, FANOUT_KEYS, "v1").await?;
    let mut measured = Vec::new();
    for peers in [1usize, FANOUT_PEERS] {
        let names: Vec<String> = (0..peers).map(|i| format!("fan-{peers}-{i}")).collect();
        let targets: Vec<EtcdServer> = futures::future::try_join_all(
            names.iter().map(|name| EtcdServer::start_with(name, EtcdFlavor::Default, &[])),
        )
        .await?;
        let specs: Vec<(String, String)> =
            targets.iter().enumerate().map(|(i, t)| (format!("p{i}"), t.endpoint())).collect();
        let mut worker = WorkerProcess::start(&origin.endpoint(), &specs)?;
        let elapsed = worker.wait_synced()?;
        let mut incomplete = 0;
        for t in &targets {
            let tc = Client::connect([t.endpoint()], None).await?;
            if count(&tc, &prefix).await != FANOUT_KEYS as i64 {
                incomplete += 1;
            }
        }
        // Idle: several keepalive rounds and verification pages after the syncs.
        tokio::time::sleep(Duration::from_secs(12)).await;
        let (peak, idle) = (worker.peak_kb(), worker.rss_kb());
        drop(worker);
        let aggregate = rate(FANOUT_KEYS * peers, elapsed);
        table.row(
            &format!("fan-out {FANOUT_KEYS} keys, {peers} peer(s), one process"),
            "this mirror",
            format!("{aggregate:.0} keys/s aggregate"),
            format!(
                "{:.2}s, peak RSS {:.1} MiB, idle RSS {:.1} MiB{}",
                elapsed.as_secs_f64(),
                peak as f64 / 1024.0,
                idle as f64 / 1024.0,
                if incomplete == 0 { String::new() } else { format!(", {incomplete} peer(s) INCOMPLETE") }
            ),
        );
        measured.push((aggregate, peak, idle));
    }
    let ((one_rate, one_peak, one_idle), (many_rate, many_peak, many_idle)) = (measured[0], measured[1]);
    let per_worker = |many: u64, one: u64| many.saturating_sub(one) as f64 / 1024.0 / (FANOUT_PEERS - 1) as f64;
    table.row(
        &format!("fan-out {FANOUT_KEYS} keys, {FANOUT_PEERS} vs 1 peer"),
        "per extra worker",
        format!("{:.2} MiB idle", per_worker(many_idle, one_idle)),
        format!(
            "{:.2} MiB at peak; aggregate throughput {:.1}x one peer's",
            per_worker(many_peak, one_peak),
            many_rate / one_rate
        ),
    );
    Ok(())
}
