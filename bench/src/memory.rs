//! Peak memory under a failover catch-up of large values into four peers: the origin's workers
//! are killed, the origin writes mebibyte values while nobody mirrors, and a successor process
//! adopts the four mirrors and catches each up from its checkpoint through the watch, all four at
//! once. With the process's memory budget (the operator's default, 96 MiB) and with only each
//! worker's own bounds (64 MiB pending, 16 MiB in flight each), the successor's peak RSS, how long
//! it took, and that every peer holds every key.
use crate::process::WorkerProcess;
use crate::table::Table;
use aether_harness::EtcdServer;
use aether_operator::keys;
use etcd_client::Client;
use std::time::{Duration, Instant};

const PEERS: usize = 4;
const LARGE_VALUES: usize = 150;

pub async fn bench_memory(table: &mut Table) -> anyhow::Result<()> {
    let only: Option<usize> = std::env::var("AETHER_BENCH_MEMORY_ONLY").ok().and_then(|m| m.parse().ok());
    for (label, mib) in [("process budget 96 MiB", 96usize), ("per-worker bounds only", 1 << 20)] {
        if only.is_some_and(|o| o != mib) {
            continue;
        }
        println!("memory: failover catch-up of {LARGE_VALUES} x 1 MiB into {PEERS} peers ({label})");
        let origin = EtcdServer::start("mem-a").await?;
        let names: Vec<String> = (0..PEERS).map(|i| format!("mem-p{i}")).collect();
        let peers = futures::future::try_join_all(names.iter().map(|n| EtcdServer::start(n))).await?;
        let listed: Vec<(String, String)> =
            peers.iter().enumerate().map(|(i, p)| (format!("p{i}"), p.endpoint())).collect();
        let mut o = Client::connect([origin.endpoint()], None).await?;
        let prefix = keys::region_prefix("a");
        for i in 0..10 {
            o.put(format!("{prefix}clusters/c1/services/s/protocols/tcp/endpoints/10.0.0.{i}"), "{}", None).await?;
        }
        let mut first = WorkerProcess::start(&origin.endpoint(), &listed)?;
        first.wait_synced()?;
        drop(first); // killed: its leases and checkpoints stay on the peers
        let value = format!(r#"{{"padding":"{}"}}"#, "p".repeat(1 << 20));
        for i in 0..LARGE_VALUES {
            o.put(
                format!("{prefix}clusters/c1/services/large/protocols/tcp/endpoints/10.1.0.{i}"),
                value.as_str(),
                None,
            )
            .await?;
        }
        let started = Instant::now();
        let successor = WorkerProcess::start_successor_within(&origin.endpoint(), &listed, mib)?;
        let total = (10 + LARGE_VALUES) as i64;
        let mut caught_up = true;
        for peer in &peers {
            let c = Client::connect([peer.endpoint()], None).await?;
            if crate::fixtures::wait_count(&c, &prefix, total as usize, Duration::from_secs(300)).await.is_none() {
                caught_up = false;
            }
        }
        let took = started.elapsed();
        let peak_mib = successor.peak_kb() / 1024;
        table.row_with(
            "memory: failover catch-up",
            label,
            format!("peak RSS {peak_mib} MiB"),
            format!(
                "{LARGE_VALUES} x 1 MiB into {PEERS} peers at once, {}; {:.1} s",
                if caught_up { "every peer holds every key" } else { "NOT every peer caught up within 300 s" },
                took.as_secs_f64()
            ),
            serde_json::json!({"peak_rss_mib": peak_mib, "seconds": took.as_secs_f64(), "caught_up": caught_up, "budget_mib": mib}),
        );
    }
    Ok(())
}
