//! Helpers for tests that drive mirror workers directly: the fault tests' settings, starting a
//! worker, waiting on its health, partitioning a peer, and reading how the peer's keys sit on the
//! leases.
use aether_harness::FaultProxy;
use aether_operator::keys;
use aether_operator::mirror::{self, EtcdTarget, MirrorConfig, MirrorEvent, MirrorHandle, PeerHealth, Phase};
use etcd_client::Client;
use std::collections::HashMap;
use std::time::Duration;
use tokio::sync::mpsc;

/// How long a worker may take to reach a state a test waits for.
pub const DEADLINE: Duration = Duration::from_secs(90);

/// The fault tests' settings: a TTL of 6 s renewed every 2 s, short backoffs and timeouts.
pub fn fast_config(owner: &str) -> MirrorConfig {
    let mut c = MirrorConfig::new("a", "b", owner);
    c.lease_ttl_seconds = 6;
    c.keepalive_interval = Duration::from_secs(2);
    c.backoff_base = Duration::from_millis(50);
    c.backoff_cap = Duration::from_secs(1);
    c.rpc_timeout = Duration::from_secs(3);
    c.acceptable_pause = Duration::from_secs(3);
    c.progress_interval = Duration::from_millis(500);
    c
}

/// An etcd reached directly.
pub fn plain(server: &aether_harness::EtcdServer) -> EtcdTarget {
    EtcdTarget::plain([server.endpoint()])
}

/// An etcd reached through a fault proxy.
pub fn through(proxy: &FaultProxy) -> EtcdTarget {
    EtcdTarget::plain([proxy.endpoint("http")])
}

/// A RegionPeering as the peers record its workers' claims.
pub fn object(name: &str) -> mirror::OwningObject {
    mirror::OwningObject {
        namespace: "aether-system".into(),
        name: name.into(),
        uid: format!("uid-{name}"),
        cluster: "east".into(),
    }
}

/// The fault tests' settings for a worker of `object`'s mirroring into `peer`.
pub fn claim(owner: &str, object: &mirror::OwningObject, peer: &str) -> MirrorConfig {
    let mut c = fast_config(owner);
    c.object = Some(object.clone());
    c.peer = peer.to_string();
    c
}

/// Starts a worker mirroring region "a" from `local` into `peer`.
pub fn start(config: MirrorConfig, local: EtcdTarget, peer: EtcdTarget) -> (MirrorHandle, mpsc::Receiver<MirrorEvent>) {
    let (tx, rx) = mpsc::channel(8192);
    (mirror::spawn(config, local, peer, tx), rx)
}

/// Waits until the worker's health satisfies `f`.
pub async fn wait_health(handle: &MirrorHandle, what: &str, f: impl Fn(&PeerHealth) -> bool) {
    wait_health_for(handle, what, DEADLINE, f).await
}

pub async fn wait_health_for(handle: &MirrorHandle, what: &str, deadline: Duration, f: impl Fn(&PeerHealth) -> bool) {
    let mut rx = handle.subscribe();
    tokio::time::timeout(deadline, rx.wait_for(|h| f(h)))
        .await
        .unwrap_or_else(|_| panic!("{what}: not reached in {deadline:?}; health: {:?}", handle.health()))
        .expect("worker alive");
}

pub async fn wait_synced(handle: &MirrorHandle) {
    wait_health(handle, "synced and watching", |h| h.synced && h.phase == Phase::Watching).await;
}

/// Waits for an event matching `f`; fails on the deadline.
pub async fn wait_event(events: &mut mpsc::Receiver<MirrorEvent>, what: &str, f: impl Fn(&MirrorEvent) -> bool) {
    tokio::time::timeout(DEADLINE, async {
        loop {
            match events.recv().await {
                Some(e) if f(&e) => return,
                Some(_) => {}
                None => panic!("{what}: the worker's events ended"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what}: no such event in {DEADLINE:?}"));
}

/// Every event received so far, without waiting.
pub fn drain_events(events: &mut mpsc::Receiver<MirrorEvent>) -> Vec<MirrorEvent> {
    let mut out = Vec::new();
    while let Ok(e) = events.try_recv() {
        out.push(e);
    }
    out
}

/// Partitions the peer behind `proxy` `times` times, each right after a successful keepalive
/// round, for `outage`; heals each with every connection reset (what a real partition leaves
/// behind) and waits for a successful round before the next.
pub async fn partition_after_rounds(handle: &MirrorHandle, proxy: &FaultProxy, outage: Duration, times: usize) {
    for i in 0..times {
        let rounds = handle.health().keepalive_rounds;
        wait_health(handle, "a keepalive round before the partition", |h| h.keepalive_rounds > rounds).await;
        proxy.set_blackhole(true);
        tokio::time::sleep(outage).await; // the partition itself
        proxy.reset_connections();
        proxy.set_blackhole(false);
        let rounds = handle.health().keepalive_rounds;
        wait_health(handle, "a keepalive round after the heal", |h| h.keepalive_rounds > rounds).await;
        eprintln!("partition {} of {times} ({outage:?}) healed; health: {:?}", i + 1, handle.health());
    }
}

/// How the peer's copy of region "a" sits on the leases: keys whose lease is not the one the
/// recorded layout names for them, and the keys on each lease.
pub struct Placement {
    pub misplaced: usize,
    pub keys_per_lease: HashMap<i64, usize>,
    pub recorded_leases: Vec<i64>,
}

pub async fn placement(p: &mut Client) -> Placement {
    let cp = super::etcd::checkpoint(p, "a").await.expect("a checkpoint");
    let layout = mirror::leases::shards::Layout::recorded(&cp.slots, cp.leases.len());
    let mut keys_per_lease: HashMap<i64, usize> = HashMap::new();
    let mut misplaced = 0;
    for (key, (_, lease)) in super::etcd::subtree(p, &keys::region_prefix("a")).await {
        misplaced += usize::from(cp.leases[layout.shard_of(&key)] != lease);
        *keys_per_lease.entry(lease).or_default() += 1;
    }
    Placement { misplaced, keys_per_lease, recorded_leases: cp.leases }
}

/// Waits until every key of region "a" on the peer sits on the lease its shard names and no lease
/// carries more than `cap` keys.
pub async fn wait_placed_under_cap(p: &Client, cap: usize, handle: &MirrorHandle) {
    aether_harness::wait_until("every key on its shard's lease, no lease past the cap", DEADLINE, || {
        let mut p = p.clone();
        async move {
            let placed = placement(&mut p).await;
            let fullest = placed.keys_per_lease.values().max().copied().unwrap_or(0);
            anyhow::ensure!(
                placed.misplaced == 0 && fullest <= cap,
                "{} keys misplaced, the fullest lease holds {fullest} keys (cap {cap}), {} leases recorded",
                placed.misplaced,
                placed.recorded_leases.len()
            );
            Ok(true)
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}; health: {:?}", handle.health()));
}

/// The least time to live the peer reports for region "a"'s recorded leases, sampled every
/// 100 ms from a direct connection until dropped: how close the mirror came to lapsing.
pub struct LowestTtl {
    lowest: std::sync::Arc<std::sync::atomic::AtomicI64>,
    task: tokio::task::JoinHandle<()>,
}

impl LowestTtl {
    pub async fn watch(p: &Client) -> LowestTtl {
        let lowest = std::sync::Arc::new(std::sync::atomic::AtomicI64::new(i64::MAX));
        let (seen, mut p) = (lowest.clone(), p.clone());
        let task = tokio::spawn(async move {
            loop {
                let leases = super::etcd::checkpoint(&mut p, "a").await.map(|c| c.leases).unwrap_or_default();
                for _ in 0..10 {
                    for lease in leases.iter().take(8) {
                        if let Ok(resp) = p.lease_time_to_live(*lease, None).await {
                            seen.fetch_min(resp.ttl(), std::sync::atomic::Ordering::SeqCst);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        });
        LowestTtl { lowest, task }
    }

    /// Seconds left at the closest call (i64::MAX when never sampled; below 0 when gone).
    pub fn lowest(&self) -> i64 {
        self.lowest.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for LowestTtl {
    fn drop(&mut self) {
        self.task.abort();
    }
}
