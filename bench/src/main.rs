//! `make bench`: measures the mirror against `etcdctl make-mirror` and against the raw ceiling of
//! batched Txns, on real etcd servers on this machine, and the drain's re-keying rate. It prints a
//! table; it asserts nothing (the targets are read off the table).
//!
//! `aether-bench worker ...` is the mirror under test as its own process, so that its memory can
//! be measured.
mod drain;
mod fanout;
mod fixtures;
mod follow;
mod idle;
mod keepalive;
mod leases;
mod limit;
mod memory;
mod mesh;
mod operator;
mod process;
mod profile;
mod sides;
mod sockets;
mod sync;
mod table;
mod verify;

use crate::drain::bench_drain;
use crate::fanout::bench_fanout;
use crate::follow::{STEADY_PRELOAD, bench_catchup, bench_steady};
use crate::leases::{bench_auth_at_scale, bench_leases};
use crate::operator::bench_operator;
use crate::process::worker_process;
use crate::sync::{bench_scale, bench_sync, bench_wan_sync};
use crate::table::Table;
use aether_harness::EtcdFlavor;
use std::time::Duration;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    // AETHER_BENCH_LOG (a tracing filter, e.g. `aether_operator=debug`): the workers' logs on
    // stderr, to see where a scenario's time goes; the worker processes' too (they inherit it).
    if let Ok(filter) = std::env::var("AETHER_BENCH_LOG") {
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    }
    if args.get(1).map(String::as_str) == Some("worker") {
        return worker_process(&args[2..]).await;
    }
    // `aether-bench [scenario...]`: sync, catchup, steady, leases, keepalive, drain, operator, fanout, verify, mesh, idle, memory, scale,
    // wan (sync, catch-up and steady with the peer behind a 50 and a 150 ms proxy); all by default.
    // `wan-sync`, `wan-catchup` and `wan-steady` (never by default) run only those rows of `wan`; `auth-1m` (never by
    // default) syncs 1M keys under least-privilege auth; `wan-1m` (never by default) syncs 1M keys
    // into a peer 150 ms away and hands them off.
    let only: Vec<String> = args[1..].to_vec();
    let want = |name: &str| only.is_empty() || only.iter().any(|o| o == name);
    let mut table = Table::default();
    if want("sync") {
        bench_sync(&mut table).await?;
    }
    if want("catchup") {
        bench_catchup(&mut table, Duration::ZERO).await?;
    }
    if want("steady") {
        bench_steady(&mut table, 0, Duration::ZERO).await?;
        bench_steady(&mut table, STEADY_PRELOAD, Duration::ZERO).await?;
    }
    if want("leases") {
        bench_leases(&mut table).await?;
        bench_auth_at_scale(&mut table, 100_000, EtcdFlavor::Default).await?;
        bench_auth_at_scale(&mut table, 100_000, EtcdFlavor::V3_4).await?;
    }
    // The 100k-key rows under least-privilege auth alone (`auth-100k`, never by default).
    if only.iter().any(|o| o == "auth-100k") {
        bench_auth_at_scale(&mut table, 100_000, EtcdFlavor::Default).await?;
        bench_auth_at_scale(&mut table, 100_000, EtcdFlavor::V3_4).await?;
    }
    // 1M keys under least-privilege auth: about ten minutes, only when asked.
    if only.iter().any(|o| o == "auth-1m") {
        bench_auth_at_scale(&mut table, 1_000_000, EtcdFlavor::Default).await?;
    }
    if want("keepalive") {
        keepalive::bench_keepalive(&mut table).await?;
    }
    if want("drain") {
        bench_drain(&mut table).await?;
    }
    if want("operator") {
        bench_operator(&mut table).await?;
    }
    if want("fanout") {
        bench_fanout(&mut table).await?;
    }
    if want("verify") {
        verify::bench_verify(&mut table).await?;
    }
    if want("mesh") {
        mesh::bench_mesh(&mut table).await?;
    }
    if want("idle") {
        idle::bench_idle(&mut table).await?;
    }
    if want("memory") {
        memory::bench_memory(&mut table).await?;
    }
    if want("scale") {
        bench_scale(&mut table).await?;
    }
    if want("wan") {
        for rtt in [Duration::from_millis(50), Duration::from_millis(150)] {
            bench_wan_sync(&mut table, rtt).await?;
            bench_catchup(&mut table, rtt).await?;
            bench_steady(&mut table, 0, rtt).await?;
        }
    }
    if only.iter().any(|o| o == "wan-sync") {
        for rtt in [Duration::from_millis(50), Duration::from_millis(150)] {
            bench_wan_sync(&mut table, rtt).await?;
        }
    }
    if only.iter().any(|o| o == "wan-catchup") {
        for rtt in [Duration::from_millis(50), Duration::from_millis(150)] {
            bench_catchup(&mut table, rtt).await?;
        }
    }
    // 1M keys 150 ms away, sync and handoff: a few minutes, only when asked.
    if only.iter().any(|o| o == "wan-1m") {
        sync::bench_wan_million(&mut table, Duration::from_millis(150)).await?;
    }
    if only.iter().any(|o| o == "wan-steady") {
        for rtt in [Duration::from_millis(50), Duration::from_millis(150)] {
            bench_steady(&mut table, 0, rtt).await?;
        }
    }
    println!("\n{}", table.render());
    let json = std::env::var_os("AETHER_BENCH_JSON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("target/bench-results.jsonl"));
    table.write_json(&json)?;
    println!("\nresults as JSON lines: {}", json.display());
    Ok(())
}
