//! `make bench`: measures the mirror against `etcdctl make-mirror` and against the raw ceiling of
//! batched Txns, on real etcd servers on this machine, and the drain's re-keying rate. It prints a
//! table; it asserts nothing (the targets are read off the table).
//!
//! `aether-bench worker ...` is the mirror under test as its own process, so that its memory can
//! be measured.
mod keepalive;

use aether_harness::{EtcdFlavor, EtcdServer, FaultProxy, ManagedProcess, tool_path};
use aether_operator::keys;
use aether_operator::mirror::{self, EtcdTarget, MirrorConfig, MirrorHandle, Phase};
use etcd_client::{Client, GetOptions, PutOptions, Txn, TxnOp, WatchOptions};
use futures::StreamExt;
use std::collections::HashMap;
use std::io::BufRead;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SYNC_KEYS: usize = 100_000;
const MATRIX_KEYS: usize = 20_000;
const CATCHUP_REVISIONS: usize = 20_000;
const STEADY_RATE: u64 = 1_000;
const STEADY_SECONDS: u64 = 30;
/// Keys the origin already holds in the second steady scenario.
const STEADY_PRELOAD: usize = 100_000;
/// make-mirror puts one key at a time; on this machine it would take many minutes for the full
/// data set, so its rate is measured over this much time (keys copied / time).
const MAKE_MIRROR_BUDGET: Duration = Duration::from_secs(60);
/// How long one lease layout may take to sync the matrix's keys.
const LEASE_BUDGET: Duration = Duration::from_secs(60);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("worker") {
        return worker_process(&args[2..]).await;
    }
    // `aether-bench [scenario...]`: sync, catchup, steady, leases, keepalive, drain, operator, fanout, scale,
    // wan (sync, catch-up and steady with the peer behind a 50 and a 150 ms proxy); all by default.
    // `wan-steady` (never by default) runs only the steady rows of `wan`; `auth-1m` (never by
    // default) syncs 1M keys under least-privilege auth.
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
        bench_auth_at_scale(&mut table, 100_000).await?;
    }
    // 1M keys under least-privilege auth: about ten minutes, only when asked.
    if only.iter().any(|o| o == "auth-1m") {
        bench_auth_at_scale(&mut table, 1_000_000).await?;
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

/// The subjects of the catch-up and steady scenarios: this mirror and make-mirror, or only this
/// mirror with `AETHER_BENCH_ONLY_THIS=1` (for quick runs; the table then has no make-mirror row).
fn subjects() -> Vec<&'static str> {
    if std::env::var_os("AETHER_BENCH_ONLY_THIS").is_some() {
        vec!["this mirror"]
    } else {
        vec!["this mirror", "etcdctl make-mirror"]
    }
}

#[derive(Default)]
struct Table {
    rows: Vec<[String; 4]>,
    /// Every row as a JSON object, with its numbers, so that two runs can be compared.
    json: Vec<serde_json::Value>,
}

impl Table {
    fn row(&mut self, scenario: &str, subject: &str, result: String, note: String) {
        self.row_with(scenario, subject, result, note, serde_json::json!({}));
    }

    /// A row and, in its JSON object, the figures behind it.
    fn row_with(&mut self, scenario: &str, subject: &str, result: String, note: String, figures: serde_json::Value) {
        println!("  {scenario} | {subject} | {result} | {note}");
        self.json.push(serde_json::json!({
            "scenario": scenario, "subject": subject, "result": result, "note": note, "figures": figures,
        }));
        self.rows.push([scenario.into(), subject.into(), result, note]);
    }

    /// Writes one JSON object per row to `path`.
    fn write_json(&self, path: &std::path::Path) -> anyhow::Result<()> {
        let lines: Vec<String> = self.json.iter().map(|row| row.to_string()).collect();
        std::fs::write(path, lines.join("\n") + "\n")?;
        Ok(())
    }

    fn render(&self) -> String {
        let header = ["scenario", "subject", "result", "note"];
        let widths: Vec<usize> =
            (0..4).map(|i| self.rows.iter().map(|r| r[i].len()).chain([header[i].len()]).max().unwrap_or(0)).collect();
        let line = |cells: [&str; 4]| {
            cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect::<Vec<_>>().join(" | ")
        };
        let mut out = vec![line(header), widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>().join("-|-")];
        for r in &self.rows {
            out.push(line([&r[0], &r[1], &r[2], &r[3]]));
        }
        out.join("\n")
    }
}

fn key(region: &str, i: usize) -> String {
    format!(
        "{}clusters/c{}/services/svc-{}/protocols/http/endpoints/10.{}.{}.{}",
        keys::region_prefix(region),
        i % 4,
        i % 97,
        (i >> 16) & 255,
        (i >> 8) & 255,
        i & 255
    )
}

/// About 250 bytes of endpoint JSON.
fn value(i: usize, tag: &str) -> String {
    format!(
        r#"{{"clusterName":"c{}","region":"a","zone":"a-zone-{}","address":"10.{}.{}.{}","port":8080,"protocol":"http","weight":100,"labels":{{"app":"svc-{}","version":"v1","tier":"backend"}},"tag":"{tag}","pad":"{}"}}"#,
        i % 4,
        i % 3,
        (i >> 16) & 255,
        (i >> 8) & 255,
        i & 255,
        i % 97,
        "x".repeat(40)
    )
}

async fn fill(origin: &Client, n: usize, tag: &str) -> anyhow::Result<()> {
    let chunks: Vec<Vec<usize>> = (0..n).collect::<Vec<_>>().chunks(120).map(|c| c.to_vec()).collect();
    futures::stream::iter(chunks)
        .map(|chunk| {
            let mut c = origin.clone();
            let tag = tag.to_string();
            async move {
                let ops: Vec<TxnOp> = chunk.iter().map(|i| TxnOp::put(key("a", *i), value(*i, &tag), None)).collect();
                c.txn(Txn::new().and_then(ops)).await
            }
        })
        .buffer_unordered(8)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    Ok(())
}

async fn count(c: &Client, prefix: &str) -> i64 {
    let mut c = c.clone();
    let get = c.get(prefix, Some(GetOptions::new().with_prefix().with_count_only()));
    match tokio::time::timeout(Duration::from_secs(5), get).await {
        Ok(Ok(r)) => r.count(),
        _ => 0,
    }
}

async fn wait_count(c: &Client, prefix: &str, n: usize, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if count(c, prefix).await >= n as i64 {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

fn bench_config(peer: &str) -> MirrorConfig {
    let mut c = MirrorConfig::new("a", peer, &format!("bench-{peer}"));
    c.lease_ttl_seconds = 60;
    c.keepalive_interval = Duration::from_secs(10);
    c
}

fn spawn_worker(config: MirrorConfig, origin: &EtcdServer, peer: EtcdTarget) -> MirrorHandle {
    let (tx, _rx) = tokio::sync::mpsc::channel(1024);
    std::mem::forget(_rx); // keep events flowing nowhere without blocking
    mirror::spawn(config, EtcdTarget::plain([origin.endpoint()]), peer, tx)
}

async fn wait_synced(handle: &MirrorHandle, limit: Duration) -> anyhow::Result<()> {
    let mut rx = handle.subscribe();
    tokio::time::timeout(limit, rx.wait_for(|h| h.synced && h.phase == Phase::Watching))
        .await
        .map_err(|_| anyhow::anyhow!("sync did not finish: {:?}", handle.health()))??;
    Ok(())
}

fn rate(keys: usize, d: Duration) -> f64 {
    keys as f64 / d.as_secs_f64()
}

/// make-mirror of a's subtree from `origin` into `peer`.
fn make_mirror(origin: &EtcdServer, peer: &str, log: &std::path::Path) -> anyhow::Result<ManagedProcess> {
    let mut cmd = Command::new(tool_path("etcdctl")?);
    // Keys land under the same prefix on the peer, as with this mirror.
    let prefix = keys::region_prefix("a");
    cmd.args(["--endpoints", &origin.endpoint(), "make-mirror", "--prefix", &prefix, "--dest-prefix", &prefix, peer]);
    ManagedProcess::spawn("make-mirror", cmd, log)
}

async fn bench_sync(table: &mut Table) -> anyhow::Result<()> {
    println!("initial sync of {SYNC_KEYS} keys");
    let dir = tempfile_dir()?;
    let prefix = keys::region_prefix("a");
    for peers in [1usize, 2] {
        // This mirror, as its own process; its peak RSS is measured during the sync.
        let origin = EtcdServer::start("bench-origin").await?;
        let oc = Client::connect([origin.endpoint()], None).await?;
        fill(&oc, SYNC_KEYS, "v1").await?;
        let targets: Vec<EtcdServer> = futures::future::try_join_all(
            (0..peers)
                .map(|i| EtcdServer::start_with(if i == 0 { "bench-b" } else { "bench-c" }, EtcdFlavor::Default, &[])),
        )
        .await?;
        let peer_names = ["b", "c"];
        let specs: Vec<(String, String)> =
            targets.iter().enumerate().map(|(i, t)| (peer_names[i].to_string(), t.endpoint())).collect();
        let ticks = machine_ticks();
        let mut worker = WorkerProcess::start(&origin.endpoint(), &specs)?;
        let elapsed = worker.wait_synced()?;
        let (busy, worker_cpu) = (busy_percent(ticks, machine_ticks()), cpu_seconds(&worker.child.id().to_string()));
        let rss_kb = worker.peak_kb();
        drop(worker);
        for t in &targets {
            let tc = Client::connect([t.endpoint()], None).await?;
            anyhow::ensure!(count(&tc, &prefix).await == SYNC_KEYS as i64, "the mirror's copy is incomplete");
        }
        let mirror_rate = rate(SYNC_KEYS * peers, elapsed);
        table.row(
            &format!("sync {SYNC_KEYS} keys, {peers} peer(s)"),
            "this mirror",
            format!("{mirror_rate:.0} keys/s"),
            format!(
                "{:.2}s, peak RSS {:.1} MiB; its CPU {worker_cpu:.2} s ({:.1} µs a key copied), machine busy {busy:.0} %",
                elapsed.as_secs_f64(),
                rss_kb as f64 / 1024.0,
                worker_cpu * 1e6 / (SYNC_KEYS * peers) as f64
            ),
        );

        // make-mirror, same data, fresh peers.
        let fresh: Vec<EtcdServer> = futures::future::try_join_all(
            (0..peers).map(|i| EtcdServer::start_with(if i == 0 { "mm-b" } else { "mm-c" }, EtcdFlavor::Default, &[])),
        )
        .await?;
        let start = Instant::now();
        let _mms: Vec<ManagedProcess> = fresh
            .iter()
            .enumerate()
            .map(|(i, t)| make_mirror(&origin, &t.endpoint(), &dir.path().join(format!("mm-{peers}-{i}.log"))))
            .collect::<Result<_, _>>()?;
        let mut done = true;
        for t in &fresh {
            let tc = Client::connect([t.endpoint()], None).await?;
            done &= wait_count(&tc, &prefix, SYNC_KEYS, Duration::from_secs(600)).await.is_some();
        }
        let mm = start.elapsed();
        let mm_rate = rate(SYNC_KEYS * peers, mm);
        table.row(
            &format!("sync {SYNC_KEYS} keys, {peers} peer(s)"),
            "etcdctl make-mirror",
            format!("{mm_rate:.0} keys/s"),
            format!(
                "{:.2}s{}; mirror is {:.1}x",
                mm.as_secs_f64(),
                if done { "" } else { " (did not finish)" },
                mirror_rate / mm_rate
            ),
        );

        // The raw ceiling: the same pages written straight into fresh peers in batched Txns.
        let raw_peers: Vec<EtcdServer> = futures::future::try_join_all(
            (0..peers)
                .map(|i| EtcdServer::start_with(if i == 0 { "raw-b" } else { "raw-c" }, EtcdFlavor::Default, &[])),
        )
        .await?;
        let (ticks, own_cpu) = (machine_ticks(), cpu_seconds("self"));
        let start = Instant::now();
        futures::future::try_join_all(raw_peers.iter().map(|p| raw_copy(&oc, p))).await?;
        let raw = start.elapsed();
        let (busy, copy_cpu) = (busy_percent(ticks, machine_ticks()), cpu_seconds("self") - own_cpu);
        let raw_rate = rate(SYNC_KEYS * peers, raw);
        table.row(
            &format!("sync {SYNC_KEYS} keys, {peers} peer(s)"),
            "raw ceiling (batched Txns, no lease)",
            format!("{raw_rate:.0} keys/s"),
            format!(
                "{:.2}s; mirror reaches {:.0}%; the copy's CPU {copy_cpu:.2} s ({:.1} µs a key), machine busy {busy:.0} %",
                raw.as_secs_f64(),
                100.0 * mirror_rate / raw_rate,
                copy_cpu * 1e6 / (SYNC_KEYS * peers) as f64
            ),
        );
    }
    Ok(())
}

/// The mirror under test as its own process (`aether-bench worker`), its peak RSS sampled.
struct WorkerProcess {
    child: std::process::Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
    peers: usize,
    started: Instant,
    peak: Arc<Mutex<u64>>,
    sampler: Option<std::thread::JoinHandle<()>>,
}

/// CPU seconds (user + system) a process has used, from /proc/<pid>/stat (100 ticks a second).
fn cpu_seconds(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name, which is in parentheses: utime and stime are the 12th and 13th
    // (the state comes first).
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let tick = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    (tick(11) + tick(12)) as f64 / 100.0
}

/// The machine's busy and total CPU ticks so far (/proc/stat), to show how busy it was between two
/// readings.
fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<u64> =
        stat.lines().next().unwrap_or_default().split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
    let total: u64 = ticks.iter().sum();
    let idle = ticks.get(3).copied().unwrap_or(0) + ticks.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

fn busy_percent(before: (u64, u64), after: (u64, u64)) -> f64 {
    100.0 * (after.0 - before.0) as f64 / (after.1 - before.1).max(1) as f64
}

/// A field of /proc/<pid>/status in KiB (VmHWM: peak, VmRSS: now).
fn proc_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find(|l| l.starts_with(field)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok())
}

impl WorkerProcess {
    fn start(origin: &str, peers: &[(String, String)]) -> anyhow::Result<Self> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg("worker").arg(origin);
        for (name, endpoint) in peers {
            cmd.arg(format!("{name}={endpoint}"));
        }
        let started = Instant::now();
        let mut child = cmd.stdout(Stdio::piped()).spawn()?;
        let pid = child.id();
        let peak = Arc::new(Mutex::new(0u64));
        let sampler = {
            let peak = peak.clone();
            std::thread::spawn(move || {
                while let Some(kb) = proc_kib(pid, "VmHWM:") {
                    *peak.lock().unwrap() = kb;
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        };
        let lines = std::io::BufReader::new(child.stdout.take().expect("piped")).lines();
        Ok(WorkerProcess { child, lines, peers: peers.len(), started, peak, sampler: Some(sampler) })
    }

    /// Time from start until every peer reported its initial sync complete.
    fn wait_synced(&mut self) -> anyhow::Result<Duration> {
        let mut synced = 0;
        while synced < self.peers {
            match self.lines.next() {
                Some(line) => synced += usize::from(line?.starts_with("synced")),
                None => anyhow::bail!("the worker process exited before every peer synced"),
            }
        }
        Ok(self.started.elapsed())
    }

    fn peak_kb(&self) -> u64 {
        *self.peak.lock().unwrap()
    }

    fn rss_kb(&self) -> u64 {
        proc_kib(self.child.id(), "VmRSS:").unwrap_or(0)
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(sampler) = self.sampler.take() {
            let _ = sampler.join();
        }
    }
}

const FANOUT_KEYS: usize = 10_000;
const FANOUT_PEERS: usize = 15;

/// One origin mirrored into 15 peers from one process (16 etcds), against the same with one peer:
/// aggregate throughput, memory per worker while syncing and once idle.
async fn bench_fanout(table: &mut Table) -> anyhow::Result<()> {
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

/// The scale curve: one origin synced into one peer at 10k, 100k and 1M keys, and 1M keys into
/// three peers, the mirror as its own process (peak RSS sampled).
async fn bench_scale(table: &mut Table) -> anyhow::Result<()> {
    println!("scale curve: sync 10k, 100k, 1M keys into 1 peer; 1M into 3");
    let prefix = keys::region_prefix("a");
    let mut one_peer_rate = HashMap::new();
    for (keys_n, peers) in [(10_000usize, 1usize), (100_000, 1), (1_000_000, 1), (1_000_000, 3)] {
        let origin =
            EtcdServer::start_with("sc-a", EtcdFlavor::Default, &["--quota-backend-bytes", "8589934592"]).await?;
        let oc = Client::connect([origin.endpoint()], None).await?;
        fill(&oc, keys_n, "sc").await?;
        let names: Vec<String> = (0..peers).map(|i| format!("sc-p{i}")).collect();
        let targets: Vec<EtcdServer> = futures::future::try_join_all(
            names
                .iter()
                .map(|n| EtcdServer::start_with(n, EtcdFlavor::Default, &["--quota-backend-bytes", "8589934592"])),
        )
        .await?;
        let specs: Vec<(String, String)> =
            targets.iter().enumerate().map(|(i, t)| (format!("p{i}"), t.endpoint())).collect();
        let mut worker = WorkerProcess::start(&origin.endpoint(), &specs)?;
        let elapsed = worker.wait_synced()?;
        let peak = worker.peak_kb();
        drop(worker);
        let mut unseen = 0i64;
        for t in &targets {
            let tc = Client::connect([t.endpoint()], None).await?;
            unseen += keys_n as i64 - count(&tc, &prefix).await;
        }
        let keys_per_s = rate(keys_n * peers, elapsed);
        // How the lease layout is recorded on the peer: one record, or a record and its parts.
        let recorded = {
            let tc = Client::connect([targets[0].endpoint()], None).await?;
            checkpoint_footprint(&tc, "a").await?
        };
        // What the peer etcd takes at this size with no mirror in the way: the same pages written
        // in plain Txns into a fresh peer.
        let raw = if peers == 1 {
            one_peer_rate.insert(keys_n, keys_per_s);
            let fresh =
                EtcdServer::start_with("sc-raw", EtcdFlavor::Default, &["--quota-backend-bytes", "8589934592"]).await?;
            let started = Instant::now();
            raw_copy_client(&oc, &Client::connect([fresh.endpoint()], None).await?).await?;
            Some(rate(keys_n, started.elapsed()))
        } else {
            None
        };
        // What every watch Txn carries besides the ops: the progress record (owner, revision),
        // whatever the subtree's size; the lease layout is written only when it changes.
        let progress = aether_operator::mirror::records::checkpoint::Progress {
            owner: "bench-p0".into(),
            revision: keys_n as i64 * 2,
        };
        let bookkeeping = progress.encode().len() + keys::progress_key("a").len();
        let vs_100k = one_peer_rate.get(&100_000).map(|r| r / keys_per_s);
        table.row_with(
            &format!("scale: sync {keys_n} keys, {peers} peer(s)"),
            "this mirror",
            format!("{keys_per_s:.0} keys/s"),
            format!(
                "{:.2}s, peak RSS {:.1} MiB, {unseen} keys missing (failures), {bookkeeping} B bookkeeping per watch Txn, checkpoint {} B in {} part(s){}",
                elapsed.as_secs_f64(),
                peak as f64 / 1024.0,
                recorded.1,
                recorded.0,
                match (peers, vs_100k) {
                    (1, Some(ratio)) if keys_n > 100_000 => format!("; 100k's rate is {ratio:.2}x this"),
                    _ => String::new(),
                },
            ) + &raw.map_or(String::new(), |raw| {
                format!("; raw ceiling at this size {raw:.0} keys/s ({:.0} %)", keys_per_s / raw * 100.0)
            }),
            serde_json::json!({
                "keys": keys_n, "peers": peers, "keys_per_s": keys_per_s, "seconds": elapsed.as_secs_f64(), "raw_keys_per_s": raw,
                "peak_rss_mib": peak as f64 / 1024.0, "missing": unseen, "bookkeeping_bytes_per_watch_txn": bookkeeping,
                "checkpoint_parts": recorded.0, "checkpoint_bytes": recorded.1,
            }),
        );
    }
    Ok(())
}

/// The checkpoint of `origin` on a peer: its parts (0: recorded whole) and bytes, record included.
async fn checkpoint_footprint(peer: &Client, origin: &str) -> anyhow::Result<(usize, usize)> {
    let mut kv = peer.kv_client();
    let record = kv.get(keys::checkpoint_key(origin), None).await?;
    let parts =
        kv.get(keys::checkpoint_parts_prefix(origin), Some(etcd_client::GetOptions::new().with_prefix())).await?;
    let bytes = |kvs: &[etcd_client::KeyValue]| kvs.iter().map(|kv| kv.key().len() + kv.value().len()).sum::<usize>();
    Ok((parts.kvs().len(), bytes(record.kvs()) + bytes(parts.kvs())))
}

/// The peer as the mirror reaches it: directly, or through a proxy `rtt` away.
async fn behind(peer: &EtcdServer, rtt: Duration) -> anyhow::Result<(Option<FaultProxy>, String)> {
    if rtt.is_zero() {
        return Ok((None, peer.endpoint()));
    }
    let proxy = FaultProxy::start(peer.client_addr()).await?;
    proxy.set_rtt(rtt);
    let endpoint = proxy.endpoint("http");
    Ok((Some(proxy), endpoint))
}

fn at_rtt(rtt: Duration) -> String {
    if rtt.is_zero() { String::new() } else { format!(", peer {} ms away", rtt.as_millis()) }
}

/// The initial sync of 100k keys into a peer next door and `rtt` away, in process, against
/// make-mirror the same way (within its budget).
async fn bench_wan_sync(table: &mut Table, rtt: Duration) -> anyhow::Result<()> {
    println!("sync {SYNC_KEYS} keys, peer next door and {rtt:?} away");
    let dir = tempfile_dir()?;
    let prefix = keys::region_prefix("a");
    let origin = EtcdServer::start("wan-a").await?;
    let oc = Client::connect([origin.endpoint()], None).await?;
    fill(&oc, SYNC_KEYS, "wan").await?;
    let mut rates = Vec::new();
    for delay in [Duration::ZERO, rtt] {
        let peer = EtcdServer::start("wan-b").await?;
        let (_proxy, endpoint) = behind(&peer, delay).await?;
        let start = Instant::now();
        let h = spawn_worker(bench_config("b"), &origin, EtcdTarget::plain([endpoint]));
        let finished = wait_synced(&h, Duration::from_secs(600)).await.is_ok();
        let elapsed = start.elapsed();
        h.shutdown().await;
        let done = count(&Client::connect([peer.endpoint()], None).await?, &prefix).await;
        rates.push(rate(done as usize, elapsed));
        let scenario = format!("sync {SYNC_KEYS} keys{}", at_rtt(delay));
        let vs = if delay.is_zero() {
            String::new()
        } else {
            format!("; {:.0} % of next door's rate", 100.0 * rates[1] / rates[0])
        };
        table.row_with(
            &scenario,
            "this mirror (in process)",
            format!("{:.0} keys/s", rates.last().copied().unwrap_or(0.0)),
            format!("{:.2}s{}{vs}", elapsed.as_secs_f64(), if finished { "" } else { " (did not finish)" }),
            serde_json::json!({"keys": SYNC_KEYS, "rtt_ms": delay.as_millis() as u64, "seconds": elapsed.as_secs_f64(), "missing": SYNC_KEYS as i64 - done}),
        );
    }
    let peer = EtcdServer::start("wan-mm").await?;
    let (_proxy, endpoint) = behind(&peer, rtt).await?;
    let start = Instant::now();
    let _mm = make_mirror(&origin, &endpoint, &dir.path().join("mm-wan.log"))?;
    let pc = Client::connect([peer.endpoint()], None).await?;
    let finished = wait_count(&pc, &prefix, SYNC_KEYS, MAKE_MIRROR_BUDGET).await.is_some();
    let elapsed = start.elapsed();
    let done = count(&pc, &prefix).await;
    table.row(
        &format!("sync {SYNC_KEYS} keys{}", at_rtt(rtt)),
        "etcdctl make-mirror",
        format!("{:.0} keys/s", rate(done as usize, elapsed)),
        format!("{done} keys in {:.0}s{}", elapsed.as_secs_f64(), if finished { "" } else { " (budget reached)" }),
    );
    Ok(())
}

/// The raw ceiling into a peer server.
async fn raw_copy(origin: &Client, peer: &EtcdServer) -> anyhow::Result<()> {
    raw_copy_client(origin, &Client::connect([peer.endpoint()], None).await?).await
}

/// The mirror under test, as a process: `worker <origin> <peer>=<endpoint>...`. Prints
/// "synced <peer>" for each peer once its initial sync is complete, then keeps running.
async fn worker_process(args: &[String]) -> anyhow::Result<()> {
    let origin = args.first().ok_or_else(|| anyhow::anyhow!("usage: worker <origin> <peer>=<endpoint>..."))?;
    let mut handles = Vec::new();
    for spec in &args[1..] {
        let (peer, endpoint) = spec.split_once('=').ok_or_else(|| anyhow::anyhow!("peer as region=endpoint"))?;
        let (tx, rx) = tokio::sync::mpsc::channel(1024);
        std::mem::forget(rx);
        handles.push((
            peer.to_string(),
            mirror::spawn(
                bench_config(peer),
                EtcdTarget::plain([origin.clone()]),
                EtcdTarget::plain([endpoint.to_string()]),
                tx,
            ),
        ));
    }
    for (peer, h) in &handles {
        wait_synced(h, Duration::from_secs(600)).await?;
        println!("synced {peer}");
    }
    std::future::pending::<()>().await;
    Ok(())
}

async fn bench_catchup(table: &mut Table, rtt: Duration) -> anyhow::Result<()> {
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
        table.row(
            &format!("catch-up {CATCHUP_REVISIONS} revisions{}", at_rtt(rtt)),
            subject,
            format!("{:.2}s", total.as_secs_f64()),
            format!(
                "origin wrote them in {:.2}s; ratio {:.2}{}",
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

/// New keys at a steady rate into a subtree that starts with `preload` keys (the shards split as
/// it grows); replication latency from each put's completion to the peer's watch seeing it.
async fn bench_steady(table: &mut Table, preload: usize, rtt: Duration) -> anyhow::Result<()> {
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

/// Sets up the least-privilege role on a peer and turns auth on; returns the mirror's target.
async fn enable_auth(peer: &EtcdServer) -> anyhow::Result<EtcdTarget> {
    let mut admin = Client::connect([peer.endpoint()], None).await?;
    admin.user_add("root", "rootpw", None).await?;
    admin.user_grant_role("root", "root").await?;
    admin.role_add("mirror-a").await?;
    for prefix in [keys::region_prefix("a"), keys::federation_prefix("a")] {
        admin
            .role_grant_permission("mirror-a", etcd_client::Permission::read_write(prefix.as_str()).with_prefix())
            .await?;
    }
    admin.user_add("mirror-a", "pw", None).await?;
    admin.user_grant_role("mirror-a", "mirror-a").await?;
    admin.auth_enable().await?;
    Ok(EtcdTarget::plain([peer.endpoint()]).with_user("mirror-a", "pw"))
}

/// A least-privilege user's sync at scale (etcd 3.6, default settings): the plain copy into a
/// fresh peer as the same user, then the mirror; the mirror's lease layout and how its checkpoint
/// is stored (at 1M keys and 64 keys a lease, 1.6 MB: in parts).
async fn bench_auth_at_scale(table: &mut Table, keys_n: usize) -> anyhow::Result<()> {
    println!("least-privilege auth at scale: sync {keys_n} keys");
    let quota = ["--quota-backend-bytes", "8589934592"];
    let origin = EtcdServer::start_with("as-a", EtcdFlavor::Default, &quota).await?;
    let oc = Client::connect([origin.endpoint()], None).await?;
    fill(&oc, keys_n, "as").await?;
    let raw_peer = EtcdServer::start_with("as-raw", EtcdFlavor::Default, &quota).await?;
    let raw_target = enable_auth(&raw_peer).await?;
    let started = Instant::now();
    raw_copy_client(&oc, &raw_target.connect().await?).await?;
    let raw = started.elapsed();
    drop(raw_peer);

    let peer = EtcdServer::start_with("as-b", EtcdFlavor::Default, &quota).await?;
    let target = enable_auth(&peer).await?;
    let started = Instant::now();
    let h = spawn_worker(bench_config("b"), &origin, target.clone());
    let finished = wait_synced(&h, Duration::from_secs(1200)).await.is_ok();
    let elapsed = started.elapsed();
    let leases = h.health().leases;
    h.shutdown().await;
    let pc = target.connect().await?;
    let missing = keys_n as i64 - count(&pc, &keys::region_prefix("a")).await;
    let (parts, bytes) = checkpoint_footprint(&pc, "a").await?;
    table.row_with(
        &format!("sync {keys_n} keys, etcd 3.6, auth on"),
        "this mirror, default settings",
        format!("{:.0} keys/s", rate(keys_n, elapsed)),
        format!(
            "{}{:.2}s, {:.2}x the no-lease time ({:.2}s); {leases} leases; {missing} keys missing (failures); checkpoint {bytes} B in {parts} part(s)",
            if finished { "" } else { "did not finish: " },
            elapsed.as_secs_f64(),
            elapsed.as_secs_f64() / raw.as_secs_f64(),
            raw.as_secs_f64(),
        ),
        serde_json::json!({
            "keys": keys_n, "seconds": elapsed.as_secs_f64(), "raw_seconds": raw.as_secs_f64(), "finished": finished,
            "leases": leases, "missing": missing, "checkpoint_parts": parts, "checkpoint_bytes": bytes,
        }),
    );
    Ok(())
}

async fn bench_leases(table: &mut Table) -> anyhow::Result<()> {
    println!("lease layouts: {MATRIX_KEYS} keys, one lease vs sharded, auth off/on, etcd 3.6 and 3.4");
    for flavor in [EtcdFlavor::Default, EtcdFlavor::V3_4] {
        for auth in [false, true] {
            let origin = EtcdServer::start_with("lm-a", flavor, &[]).await?;
            let oc = Client::connect([origin.endpoint()], None).await?;
            fill(&oc, MATRIX_KEYS, "lm").await?;
            let mut results = Vec::new();
            for (layout, per_lease) in [
                ("no lease (raw)", 0u64),
                ("one lease", u64::MAX / 4),
                ("default settings (1000 keys/lease; 64 when auth binds the user)", 1000),
                ("sharded, 100 keys/lease (64 when auth binds the user)", 100),
            ] {
                let peer = EtcdServer::start_with("lm-b", flavor, &[]).await?;
                let target = if auth { enable_auth(&peer).await? } else { EtcdTarget::plain([peer.endpoint()]) };
                let start = Instant::now();
                let mut finished = true;
                let mut leases = 0;
                if per_lease == 0 {
                    let pc = target.connect().await?;
                    raw_copy_client(&oc, &pc).await?;
                } else {
                    let mut cfg = bench_config("b");
                    cfg.max_keys_per_lease = per_lease;
                    let h = spawn_worker(cfg, &origin, target.clone());
                    // With auth on, etcd checks every key already on a lease at each put attached
                    // to it: one big lease is quadratic. Give it a budget.
                    finished = wait_synced(&h, LEASE_BUDGET).await.is_ok();
                    leases = h.health().leases;
                    h.shutdown().await;
                }
                let d = start.elapsed();
                let done = if finished {
                    MATRIX_KEYS
                } else {
                    let options =
                        if auth { Some(etcd_client::ConnectOptions::new().with_user("root", "rootpw")) } else { None };
                    count(&Client::connect([peer.endpoint()], options).await?, &keys::region_prefix("a")).await as usize
                };
                results.push((layout, d, done, leases));
            }
            let base = results[0].1.as_secs_f64();
            let interval = bench_config("b").keepalive_interval.as_secs_f64();
            for (layout, d, done, leases) in results {
                let note = if done == MATRIX_KEYS {
                    format!(
                        "{:.2}s, {:.2}x the no-lease time; {leases} leases, {:.0} keepalive messages/s on one stream",
                        d.as_secs_f64(),
                        d.as_secs_f64() / base,
                        leases as f64 / interval
                    )
                } else {
                    format!("did not finish: {done} keys in {:.0}s", d.as_secs_f64())
                };
                table.row(
                    &format!(
                        "sync {MATRIX_KEYS} keys, etcd {}, auth {}",
                        if flavor == EtcdFlavor::V3_4 { "3.4" } else { "3.6" },
                        if auth { "on" } else { "off" }
                    ),
                    layout,
                    format!("{:.0} keys/s", rate(done, d)),
                    note,
                );
            }
        }
    }
    Ok(())
}

/// Pages the origin and writes each page into the peer in Txns of 126 puts, 4 in flight.
async fn raw_copy_client(origin: &Client, peer: &Client) -> anyhow::Result<()> {
    let prefix = keys::region_prefix("a");
    let end = keys::prefix_range_end(prefix.as_bytes());
    let mut cursor = prefix.clone().into_bytes();
    let mut oc = origin.clone();
    loop {
        let mut resp = oc.get(cursor.clone(), Some(GetOptions::new().with_range(end.clone()).with_limit(1000))).await?;
        let more = resp.more();
        let kvs = resp.take_kvs();
        if let Some(last) = kvs.last() {
            cursor = last.key().to_vec();
            cursor.push(0);
        }
        let batches: Vec<Vec<TxnOp>> =
            kvs.chunks(126).map(|c| c.iter().map(|kv| TxnOp::put(kv.key(), kv.value(), None)).collect()).collect();
        futures::stream::iter(batches)
            .map(|ops| {
                let mut pc = peer.clone();
                async move { pc.txn(Txn::new().and_then(ops)).await }
            })
            .buffer_unordered(4)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<Vec<_>, _>>()?;
        if !more {
            return Ok(());
        }
    }
}

async fn bench_drain(table: &mut Table) -> anyhow::Result<()> {
    const N: usize = 100_000;
    println!("drain of {N} legacy keys");
    let etcd = EtcdServer::start("drain-bench").await?;
    let c = Client::connect([etcd.endpoint()], None).await?;
    let chunks: Vec<Vec<usize>> = (0..N).collect::<Vec<_>>().chunks(120).map(|c| c.to_vec()).collect();
    futures::stream::iter(chunks)
        .map(|chunk| {
            let mut c = c.clone();
            async move {
                let ops: Vec<TxnOp> = chunk
                    .iter()
                    .map(|i| {
                        let k = format!(
                            "/aether/services/svc-{}/protocols/http/endpoints/10.{}.{}.{}",
                            i % 97,
                            (i >> 16) & 255,
                            (i >> 8) & 255,
                            i & 255
                        );
                        TxnOp::put(k, value(*i, "legacy"), None)
                    })
                    .collect();
                c.txn(Txn::new().and_then(ops)).await
            }
        })
        .buffer_unordered(8)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    // The values name region a: the drain of region a (a drain writes only its own region).
    let mut settings = aether_operator::drain::DrainSettings::new("a", "dflt");
    settings.quiet_period = Duration::ZERO;
    let (tx, _rx) = tokio::sync::watch::channel(Default::default());
    let start = Instant::now();
    let report = aether_operator::drain::drain(&c, &settings, &tx, &tokio_util::sync::CancellationToken::new()).await?;
    let d = start.elapsed();
    anyhow::ensure!(report.copied == N as i64 && report.deleted == N as i64, "drain incomplete: {report:?}");
    table.row(
        &format!("drain {N} legacy keys"),
        "copy + delete",
        format!("{:.0} keys/s", rate(N, d)),
        format!("{:.2}s end to end (copy pass, quiet period 0, delete pass)", d.as_secs_f64()),
    );
    Ok(())
}

fn tempfile_dir() -> anyhow::Result<tempfile::TempDir> {
    Ok(tempfile::Builder::new().prefix("aether-bench-").tempdir()?)
}

/// The operator end to end: `kubectl apply` of a RegionPeering with 2 peers over 10,000 keys until
/// Ready, then a minute idle: status patches and the operator's memory.
async fn bench_operator(table: &mut Table) -> anyhow::Result<()> {
    const KEYS: usize = 10_000;
    println!("operator: apply -> Ready for {KEYS} keys and 2 peers, then idle");
    let mut fed = aether_e2e::Federation::start(&["a", "b", "c"]).await?;
    fed.write_endpoints("a", KEYS).await?;
    fed.start_operator("a")?;
    // Let the operator start and take its leadership before the clock starts.
    let port = fed.operators["a"][0].metrics_port;
    aether_harness::wait_until("operator leads", Duration::from_secs(60), || async move {
        Ok(scrape(port).await.contains("aether_federation_leader 1"))
    })
    .await?;
    let start = Instant::now();
    fed.apply_peering("a")?;
    fed.wait_condition("a", "Ready", "True", Duration::from_secs(300)).await?;
    let ready = start.elapsed();
    table.row(
        &format!("operator: {KEYS} keys, 2 peers"),
        "kubectl apply -> Ready",
        format!("{:.2}s", ready.as_secs_f64()),
        "including CRD watch, worker start, initial syncs and the status patch".into(),
    );

    tokio::time::sleep(Duration::from_secs(5)).await;
    let before = patches(&scrape(port).await);
    let idle = Duration::from_secs(60);
    tokio::time::sleep(idle).await;
    let after = patches(&scrape(port).await);
    table.row(
        "operator: idle",
        "status patches",
        format!("{:.1} per minute", (after - before) * 60.0 / idle.as_secs_f64()),
        "one RegionPeering, 2 peers, nothing changing".into(),
    );
    let pid = fed.operators["a"][0].process.pid().ok_or_else(|| anyhow::anyhow!("operator not running"))?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    table.row(
        "operator: memory",
        "RSS",
        format!("{:.1} MiB", field("VmRSS:")),
        format!("peak {:.1} MiB", field("VmHWM:")),
    );
    Ok(())
}

async fn scrape(port: u16) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else { return String::new() };
    let _ = s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").await;
    let mut body = String::new();
    let _ = s.read_to_string(&mut body).await;
    body
}

fn patches(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("aether_federation_status_patches_total"))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum()
}
