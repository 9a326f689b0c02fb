//! The lease promise over minutes: partitions at the CRD defaults (TTL 30 s, keepalive 10 s), and
//! tens of thousands of leases on a three-member peer whose keepalives go through followers. These
//! tests mostly wait, so they run side by side (one binary, one thread each).
mod support;

use aether_harness::{EtcdCluster, EtcdServer, FaultProxy};
use aether_operator::mirror::{EtcdTarget, MirrorConfig, MirrorEvent};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use support::etcd::*;
use support::mirror::*;

/// The CRD's defaults; only the backoff is shortened so that the test does not wait on it.
fn defaults(owner: &str) -> MirrorConfig {
    let mut c = MirrorConfig::new("a", "b", owner);
    c.backoff_cap = Duration::from_secs(2);
    c
}

#[tokio::test]
#[ignore = "soak: minutes at the CRD defaults; `make test` runs it beside the other suites (hack/test.sh)"]
async fn at_the_defaults_three_25s_partitions_healed_with_reset_connections_delete_nothing() {
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..500, "v1").await;
    let p = connect(&[peer.endpoint()], None).await;
    let proxy = FaultProxy::start(peer.client_addr()).await.unwrap();
    let cfg = defaults("w1");
    assert_eq!((cfg.lease_ttl_seconds, cfg.keepalive_interval), (30, Duration::from_secs(10)));
    let (handle, _e) = start(cfg, EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain([proxy.endpoint("http")]));
    wait_synced(&handle).await;
    let deletes = count_peer_deletes(&p, "a").await;
    let ttl = LowestTtl::watch(&p).await;

    partition_after_rounds(&handle, &proxy, Duration::from_secs(25), 3).await;
    converged(&o, &p, "a", DEADLINE).await;
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "a 25 s partition lapsed keys at the defaults");
    // Renewed within seconds of each heal, not at the TTL's edge.
    assert!(ttl.lowest() >= 3, "the leases came within {} s of lapsing", ttl.lowest());
    assert_eq!(handle.health().resyncs, 0, "{:?}", handle.health());
    handle.shutdown().await;
}

/// 16,000 keys at two keys a lease make 16,384 leases on a three-member peer, reached through its
/// followers only (each renewal forwarded to the leader); the region grows by 600 keys (splits,
/// each adding a lease to the running keeper) while three TTLs pass.
async fn many_leases_through_followers_hold(cfg: MirrorConfig) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("aether_operator=info")
        .with_test_writer()
        .with_ansi(false)
        .try_init();
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdCluster::start("b", 3)).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..16_000, "v1").await;
    let leader = peer.leader().await.unwrap();
    let followers: Vec<String> = (0..3).filter(|i| *i != leader).map(|i| peer.members()[i].endpoint()).collect();
    let ttl = Duration::from_secs(cfg.lease_ttl_seconds as u64);
    let (handle, mut events) = start(cfg, EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain(followers.clone()));
    wait_health_for(&handle, "synced with 16k leases", Duration::from_secs(600), |h| {
        h.synced && h.phase == aether_operator::mirror::Phase::Watching
    })
    .await;
    let p = connect(&peer.endpoints(), None).await;
    let deletes = count_peer_deletes(&p, "a").await;
    eprintln!("synced: {:?}", handle.health());
    assert!(handle.health().leases >= 16_000, "{:?}", handle.health());
    drain_events(&mut events);

    let held = Instant::now();
    let mut next = 16_000;
    while held.elapsed() < 3 * ttl {
        write_keys(&mut o, "a", next..next + 20, "growth").await;
        next += 20;
        tokio::time::sleep(Duration::from_secs(1)).await; // the pace of the growth
        if next >= 16_600 {
            next = 16_000;
        }
    }
    converged(&o, &p, "a", Duration::from_secs(300)).await;
    let health = handle.health();
    let lost: Vec<MirrorEvent> =
        drain_events(&mut events).into_iter().filter(|e| matches!(e, MirrorEvent::ResyncStarted { .. })).collect();
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "leases lapsed: {health:?}");
    assert!(lost.is_empty(), "{lost:?}; {health:?}");
    eprintln!("held {:?}: {health:?}", held.elapsed());
    handle.shutdown().await;
}

#[tokio::test]
#[ignore = "soak: minutes at the CRD defaults; `make test` runs it beside the other suites (hack/test.sh)"]
async fn sixteen_thousand_leases_through_followers_are_renewed_at_the_defaults() {
    let mut cfg = defaults("w1");
    cfg.max_keys_per_lease = 2;
    many_leases_through_followers_hold(cfg).await;
}
