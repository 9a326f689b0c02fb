//! Many origins syncing at once into one peer etcd that cannot apply as fast as they write (its
//! CPU throttled through a cgroup v1 cpu controller, so it needs root): every copy must arrive at
//! the peer's pace, and the leases of live origins must not lapse.
//!
//! Known to fail, so ignored until the sync paces itself by the peer (docs/scaling.md, "What the
//! convergence at 32 is made of"): run with `cargo test -p aether-operator --test overload --
//! --ignored --nocapture`. On 2026-12-03, 8 origins of 5,000 keys into a peer throttled to 3 % of
//! a core (the fault tests' settings: TTL 6 s, RPC timeout 3 s): none synced in 240 s, 430
//! sessions ended by an error and 38 resyncs for lost leases. Each session's Txns that timed out
//! stay queued in the peer and are applied later, each new session queues its window again, and
//! etcd answers no renewal while it is more than 1 s behind in applying. At 10 % of a core all
//! 8 synced in 12 s with 10 failed sessions and no lease lost.
mod support;

use aether_harness::EtcdServer;
use aether_operator::mirror::{EtcdTarget, MirrorConfig, MirrorEvent, MirrorHandle};
use std::time::{Duration, Instant};
use support::etcd::write_keys;
use support::mirror::{fast_config, start};

const ORIGINS: usize = 8;
const KEYS: usize = 5_000;

/// Moves a process into a cpu cgroup limited to `percent` of one core; removed on drop.
struct Throttle {
    dir: std::path::PathBuf,
}

impl Throttle {
    fn new(pid: u32, percent: u64) -> std::io::Result<Self> {
        let dir = std::path::PathBuf::from(format!("/sys/fs/cgroup/cpu/aether-throttle-{pid}"));
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("cpu.cfs_period_us"), "100000")?;
        std::fs::write(dir.join("cpu.cfs_quota_us"), (percent * 1000).to_string())?;
        std::fs::write(dir.join("cgroup.procs"), pid.to_string())?;
        Ok(Throttle { dir })
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        if let Ok(procs) = std::fs::read_to_string(self.dir.join("cgroup.procs")) {
            for pid in procs.lines() {
                let _ = std::fs::write("/sys/fs/cgroup/cpu/cgroup.procs", pid);
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// What the workers went through so far.
#[derive(Debug)]
struct Tally {
    synced: usize,
    lease_lost: u64,
    session_failures: u64,
}

fn tally(workers: &[(MirrorHandle, tokio::sync::mpsc::Receiver<MirrorEvent>)]) -> Tally {
    let healths: Vec<_> = workers.iter().map(|(h, _)| h.health()).collect();
    Tally {
        synced: healths.iter().filter(|h| h.synced).count(),
        lease_lost: healths.iter().map(|h| h.resyncs_by_cause.get("lease_lost").copied().unwrap_or(0)).sum(),
        session_failures: healths.iter().map(|h| h.session_failures).sum(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known to fail: the sync does not pace itself by a peer that falls behind in applying (docs/scaling.md)"]
async fn origins_syncing_at_once_into_a_peer_that_falls_behind_keep_their_leases() {
    let peer = EtcdServer::start("p").await.expect("peer etcd");
    let mut origins = Vec::new();
    for i in 0..ORIGINS {
        let region = format!("r{i}");
        let etcd = EtcdServer::start(&region).await.expect("origin etcd");
        let mut c = etcd_client::Client::connect([etcd.endpoint()], None).await.expect("connect");
        write_keys(&mut c, &region, 0..KEYS, "v1").await;
        origins.push((region, etcd));
    }
    let percent: u64 = std::env::var("AETHER_THROTTLE_PERCENT").ok().and_then(|p| p.parse().ok()).unwrap_or(3);
    let _throttle = Throttle::new(peer.pid().expect("peer pid"), percent)
        .expect("moving the peer etcd into a cpu cgroup (needs root and cgroup v1's cpu controller)");
    let mut workers = Vec::new();
    for (region, etcd) in &origins {
        let config = MirrorConfig { origin: region.clone(), ..fast_config(&format!("w-{region}")) };
        workers.push(start(config, EtcdTarget::plain([etcd.endpoint()]), EtcdTarget::plain([peer.endpoint()])));
    }
    let started = Instant::now();
    let mut seen = tally(&workers);
    while seen.synced < ORIGINS && started.elapsed() < Duration::from_secs(240) {
        tokio::time::sleep(Duration::from_secs(2)).await;
        seen = tally(&workers);
        println!(
            "{:>5.1}s synced {}/{ORIGINS}, lease_lost {}, session_failures {}",
            started.elapsed().as_secs_f64(),
            seen.synced,
            seen.lease_lost,
            seen.session_failures
        );
    }
    assert_eq!(seen.lease_lost, 0, "leases of live origins lapsed on a peer that fell behind: {seen:?}");
    assert_eq!(seen.synced, ORIGINS, "not every origin synced into a peer that fell behind within 240 s: {seen:?}");
}
