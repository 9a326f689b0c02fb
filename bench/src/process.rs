//! The mirror under test as its own process (`aether-bench worker ...`), so that its CPU time and
//! memory are its own, and the machine's load while it runs.
use crate::fixtures::{bench_config, wait_synced};
use aether_operator::mirror::{self, EtcdTarget, MirrorConfig};
use std::io::BufRead;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The mirror under test as its own process (`aether-bench worker`), its peak RSS sampled.
pub struct WorkerProcess {
    child: std::process::Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
    peers: usize,
    started: Instant,
    peak: Arc<Mutex<u64>>,
    sampler: Option<std::thread::JoinHandle<()>>,
}

/// What a worker process's peers went through until each held the mirror synced, from the lines
/// it prints ("synced <peer> resyncs <n> causes <label>:<n>,... session_failures <m> error <class>").
#[derive(Debug, Default)]
pub struct Synced {
    /// From the process's start until its last peer was synced.
    pub elapsed: Duration,
    pub resyncs: u64,
    /// The resyncs by cause (`ResyncCause::label`).
    pub resync_causes: std::collections::BTreeMap<String, u64>,
    /// Sessions that ended in an error (each is retried after a backoff).
    pub session_failures: u64,
    /// The class of each peer's last error, for the peers that had one.
    pub errors: std::collections::BTreeMap<String, u64>,
}

impl Synced {
    fn add_line(&mut self, line: &str) {
        let tokens: Vec<&str> = line.split_whitespace().collect();
        let after = |name: &str| tokens.iter().position(|t| *t == name).and_then(|i| tokens.get(i + 1)).copied();
        let number = |name: &str| after(name).and_then(|n| n.parse::<u64>().ok()).unwrap_or(0);
        self.resyncs += number("resyncs");
        self.session_failures += number("session_failures");
        if let Some(class) = after("error").filter(|class| *class != "-") {
            *self.errors.entry(class.to_string()).or_default() += 1;
        }
        for cause in after("causes").filter(|causes| *causes != "-").into_iter().flat_map(|c| c.split(',')) {
            if let Some((label, n)) = cause.split_once(':') {
                *self.resync_causes.entry(label.to_string()).or_default() += n.parse::<u64>().unwrap_or(0);
            }
        }
    }

    /// Adds another process's figures (the elapsed time is the later of the two).
    pub fn merge(&mut self, other: Synced) {
        self.elapsed = self.elapsed.max(other.elapsed);
        self.resyncs += other.resyncs;
        self.session_failures += other.session_failures;
        for (class, n) in other.errors {
            *self.errors.entry(class).or_default() += n;
        }
        for (cause, n) in other.resync_causes {
            *self.resync_causes.entry(cause).or_default() += n;
        }
    }

    /// "2 resync(s) (lease_lost x2), 5 session(s) ended by an error (last errors: Unreachable x3)".
    pub fn describe(&self) -> String {
        let listed = |counts: &std::collections::BTreeMap<String, u64>| -> Vec<String> {
            counts.iter().map(|(name, n)| format!("{name} x{n}")).collect()
        };
        let (causes, errors) = (listed(&self.resync_causes), listed(&self.errors));
        format!(
            "{} resync(s){}, {} session(s) ended by an error{}",
            self.resyncs,
            if causes.is_empty() { String::new() } else { format!(" ({})", causes.join(", ")) },
            self.session_failures,
            if errors.is_empty() { String::new() } else { format!(" (last errors: {})", errors.join(", ")) }
        )
    }
}

/// CPU seconds (user + system) a process has used, from /proc/<pid>/stat (100 ticks a second).
pub fn cpu_seconds(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name, which is in parentheses: utime and stime are the 12th and 13th
    // (the state comes first).
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let tick = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    (tick(11) + tick(12)) as f64 / 100.0
}

/// An etcd's pid as /proc names it ("" when it has none: its CPU then reads 0).
pub fn etcd_pid(etcd: &aether_harness::EtcdServer) -> String {
    etcd.pid().map_or_else(String::new, |pid| pid.to_string())
}

/// CPU seconds of each of a few processes and of the machine over a window: where a copy's CPU
/// went (the origin etcd serving pages, the peers taking writes, the copier itself).
pub struct CpuSplit {
    pids: Vec<(String, String)>,
    before: Vec<f64>,
    ticks: (u64, u64),
    started: Instant,
}

impl CpuSplit {
    /// Starts the window over these (label, pid) pairs.
    pub fn start(pids: Vec<(String, String)>) -> Self {
        let before = pids.iter().map(|(_, pid)| cpu_seconds(pid)).collect();
        Self { pids, before, ticks: machine_ticks(), started: Instant::now() }
    }

    /// CPU seconds each process used since the start, in the order given.
    pub fn used(&self) -> Vec<f64> {
        self.pids.iter().zip(&self.before).map(|((_, pid), before)| cpu_seconds(pid) - before).collect()
    }

    /// "origin etcd 1.2 s, peer etcd 3.4 s, mirror 0.5 s = 5.1 CPU s of 6.0 the machine had (2 cores x
    /// 3.0 s), machine busy 85 %".
    pub fn report(&self) -> String {
        let used = self.used();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let wall = self.started.elapsed().as_secs_f64();
        let parts: Vec<String> =
            self.pids.iter().zip(&used).map(|((label, _), s)| format!("{label} {s:.2} s")).collect();
        format!(
            "CPU: {} = {:.2} s of the {:.2} s the machine had ({cores:.0} cores x {wall:.2} s), machine busy {:.0} %",
            parts.join(", "),
            used.iter().sum::<f64>(),
            cores * wall,
            busy_percent(self.ticks, machine_ticks())
        )
    }
}

/// The (label, pid) pairs of a sync's processes: the origin etcd, the mirror, each peer etcd.
pub fn sync_processes(
    origin: &aether_harness::EtcdServer,
    mirror: &WorkerProcess,
    peers: &[aether_harness::EtcdServer],
) -> Vec<(String, String)> {
    let mut pids = vec![("origin etcd".to_string(), etcd_pid(origin)), ("mirror".into(), mirror.pid())];
    pids.extend(peers.iter().map(|t| (format!("peer etcd {}", t.name()), etcd_pid(t))));
    pids
}

/// The machine's busy and total CPU ticks so far (/proc/stat), to show how busy it was between two
/// readings.
pub fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<u64> =
        stat.lines().next().unwrap_or_default().split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
    let total: u64 = ticks.iter().sum();
    let idle = ticks.get(3).copied().unwrap_or(0) + ticks.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

pub fn busy_percent(before: (u64, u64), after: (u64, u64)) -> f64 {
    100.0 * (after.0 - before.0) as f64 / (after.1 - before.1).max(1) as f64
}

/// A field of /proc/<pid>/status in KiB (VmHWM: peak, VmRSS: now).
pub fn proc_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find(|l| l.starts_with(field)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok())
}

impl WorkerProcess {
    /// The worker's pid as /proc names it.
    pub fn pid(&self) -> String {
        self.child.id().to_string()
    }

    /// The CPU time the worker process used so far.
    pub fn cpu_seconds(&self) -> f64 {
        cpu_seconds(&self.child.id().to_string())
    }

    pub fn start(origin: &str, peers: &[(String, String)]) -> anyhow::Result<Self> {
        Self::start_as(None, origin, peers)
    }

    /// A successor of `start`'s workers: the same settings under another owner, so that it
    /// takes the mirrors over (a handoff) instead of resuming them as their own.
    pub fn start_successor(origin: &str, peers: &[(String, String)]) -> anyhow::Result<Self> {
        Self::spawn(&["--successor"], origin, peers)
    }

    /// With `region`, the workers mirror that region's subtree with the CRD's defaults (TTL 30 s,
    /// keepalive 10 s, verification on), as an operator of that region would.
    pub fn start_as(region: Option<&str>, origin: &str, peers: &[(String, String)]) -> anyhow::Result<Self> {
        match region {
            Some(region) => Self::spawn(&["--region", region], origin, peers),
            None => Self::spawn(&[], origin, peers),
        }
    }

    /// As `start_as` with a region, with verification off (the CRD's `verifyKeysPerSecond: 0`).
    pub fn start_unverified(region: &str, origin: &str, peers: &[(String, String)]) -> anyhow::Result<Self> {
        Self::spawn_with(&["--region", region], origin, peers, &[("AETHER_BENCH_VERIFY_KEYS_PER_SECOND", "0".into())])
    }

    /// A successor as `start_successor`, with a memory budget of `mib` for all its workers.
    pub fn start_successor_within(origin: &str, peers: &[(String, String)], mib: usize) -> anyhow::Result<Self> {
        Self::spawn_with(&["--successor"], origin, peers, &[("AETHER_BENCH_MEMORY_MIB", mib.to_string())])
    }

    fn spawn(flags: &[&str], origin: &str, peers: &[(String, String)]) -> anyhow::Result<Self> {
        Self::spawn_with(flags, origin, peers, &[])
    }

    fn spawn_with(
        flags: &[&str],
        origin: &str,
        peers: &[(String, String)],
        env: &[(&str, String)],
    ) -> anyhow::Result<Self> {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.envs(env.iter().map(|(k, v)| (*k, v.as_str())));
        cmd.arg("worker").args(flags);
        cmd.arg(origin);
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
    pub fn wait_synced(&mut self) -> anyhow::Result<Duration> {
        Ok(self.wait_synced_counting()?.elapsed)
    }

    /// Time from start until every peer reported it holds the mirror synced, and what the workers
    /// went through on the way: resyncs, sessions ended by an error, their last errors' classes.
    pub fn wait_synced_counting(&mut self) -> anyhow::Result<Synced> {
        let mut synced = Synced::default();
        let mut peers = 0;
        while peers < self.peers {
            let Some(line) = self.lines.next() else {
                anyhow::bail!("the worker process exited before every peer synced");
            };
            let line = line?;
            if line.starts_with("synced") {
                peers += 1;
                synced.add_line(&line);
            }
        }
        synced.elapsed = self.started.elapsed();
        Ok(synced)
    }

    pub fn peak_kb(&self) -> u64 {
        *self.peak.lock().unwrap()
    }

    pub fn rss_kb(&self) -> u64 {
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

/// The mirror under test, as a process: `worker [--region <r> | --successor] <origin>
/// <peer>=<endpoint>...`. Prints "synced <peer> resyncs <n> causes <label>:<n>,...
/// session_failures <m> error <class>" for each peer once it holds the mirror synced (its initial
/// sync complete, or a predecessor's adopted), then keeps running.
pub async fn worker_process(args: &[String]) -> anyhow::Result<()> {
    let (region, successor, args) = match args {
        [flag, region, rest @ ..] if flag == "--region" => (Some(region.clone()), false, rest),
        [flag, rest @ ..] if flag == "--successor" => (None, true, rest),
        _ => (None, false, args),
    };
    let origin =
        args.first().ok_or_else(|| anyhow::anyhow!("usage: worker [--region <r>] <origin> <peer>=<endpoint>..."))?;
    let mut handles = Vec::new();
    // One verification budget for all the workers of the origin, as the operator has.
    // AETHER_BENCH_VERIFY_KEYS_PER_SECOND sets another (0: off).
    let verify = std::env::var("AETHER_BENCH_VERIFY_KEYS_PER_SECOND")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(mirror::DEFAULT_VERIFY_KEYS_PER_SECOND);
    let budget = std::sync::Arc::new(mirror::VerifyBudget::new(verify));
    // And how many peers it mirrors into, for each worker's share of a peer etcd's connections.
    let peers = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(args.len().saturating_sub(1)));
    // And the full syncs they take turns at.
    let syncs = std::sync::Arc::new(mirror::SyncSlots::default());
    // And the origin's pages their syncs read once (AETHER_BENCH_OWN_READS=1: each its own, as
    // before the region's syncs shared them).
    let reads = std::sync::Arc::new(mirror::OriginReads::default());
    let own_reads = std::env::var_os("AETHER_BENCH_OWN_READS").is_some();
    // And one memory budget, the operator's default unless AETHER_BENCH_MEMORY_MIB says otherwise.
    let memory_mib = std::env::var("AETHER_BENCH_MEMORY_MIB").ok().and_then(|m| m.parse::<usize>().ok()).unwrap_or(96);
    let memory = mirror::MemoryBudget::new(memory_mib << 20);
    for spec in &args[1..] {
        let (peer, endpoint) = spec.split_once('=').ok_or_else(|| anyhow::anyhow!("peer as region=endpoint"))?;
        let (tx, rx) = tokio::sync::mpsc::channel(1024);
        std::mem::forget(rx);
        handles.push((
            peer.to_string(),
            mirror::spawn(
                MirrorConfig {
                    verify_budget: budget.clone(),
                    origin_peers: peers.clone(),
                    sync_slots: syncs.clone(),
                    origin_reads: if own_reads { Default::default() } else { reads.clone() },
                    memory: memory.clone(),
                    ..match &region {
                        Some(region) => MirrorConfig::new(region, peer, &format!("mesh-{region}-{peer}")),
                        None if successor => {
                            MirrorConfig { owner_id: format!("bench-{peer}-successor"), ..bench_config(peer) }
                        }
                        None => bench_config(peer),
                    }
                },
                EtcdTarget::plain([origin.clone()]),
                EtcdTarget::plain([endpoint.to_string()]),
                tx,
            ),
        ));
    }
    // As an operator of the region does, the inbound view of its etcd every status refresh.
    if let Some(region) = &region {
        let expected: Vec<String> =
            args[1..].iter().filter_map(|spec| spec.split_once('=').map(|(peer, _)| peer.to_string())).collect();
        tokio::spawn(inbound_view(origin.clone(), region.clone(), expected));
    }
    // Each peer's line as soon as it is synced, whatever the order.
    let mut synced: futures::stream::FuturesUnordered<_> = handles
        .iter()
        .map(|(peer, h)| async move { wait_synced(h, Duration::from_secs(600)).await.map(|()| (peer, h.health())) })
        .collect();
    while let Some(done) = futures::StreamExt::next(&mut synced).await {
        let (peer, health) = done?;
        let causes: Vec<String> = health.resyncs_by_cause.iter().map(|(label, n)| format!("{label}:{n}")).collect();
        println!(
            "synced {peer} resyncs {} causes {} session_failures {} error {}",
            health.resyncs,
            if causes.is_empty() { "-".to_string() } else { causes.join(",") },
            health.session_failures,
            health.last_error_reason.unwrap_or("-")
        );
    }
    drop(synced);
    std::future::pending::<()>().await;
    Ok(())
}

/// Reads the inbound view of the region's etcd every 5 s (the status refresh's default), as the
/// operator's controller does.
async fn inbound_view(endpoint: String, region: String, expected: Vec<String>) {
    let Ok(mut local) = etcd_client::Client::connect([endpoint], None).await else { return };
    let mut refresh = tokio::time::interval(Duration::from_secs(5));
    loop {
        refresh.tick().await;
        let _ = aether_operator::mirror::inbound::observe(&mut local, &region, &expected).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_processs_synced_lines_add_up_to_what_its_peers_went_through() {
        let mut synced = Synced::default();
        synced.add_line("synced b resyncs 0 causes - session_failures 0 error -");
        synced.add_line("synced c resyncs 2 causes lease_lost:1,compacted:1 session_failures 5 error Unreachable");
        let mut other = Synced::default();
        other.add_line("synced a resyncs 1 causes lease_lost:1 session_failures 1 error EtcdError");
        synced.merge(other);
        assert_eq!((synced.resyncs, synced.session_failures), (3, 6));
        assert_eq!(synced.resync_causes.get("lease_lost"), Some(&2));
        assert_eq!(
            synced.describe(),
            "3 resync(s) (compacted x1, lease_lost x2), 6 session(s) ended by an error (last errors: EtcdError x1, Unreachable x1)"
        );
    }
}
