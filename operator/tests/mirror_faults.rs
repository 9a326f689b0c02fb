//! The mirror in production's shape: multi-member etcd clusters, cross-region latency through a
//! fault proxy, large values, TLS with a least-privilege user, restores from backup, a full peer.
//! Every scenario ends with the peer's copy equal to the origin's subtree, every key on a live
//! lease the checkpoint names.
mod support;

use aether_harness::{ClusterOptions, EtcdCluster, EtcdFlavor, EtcdServer, FaultProxy, wait_until};
use aether_operator::keys;
use aether_operator::mirror::{self, EtcdTarget, MirrorConfig, MirrorEvent, MirrorHandle, Phase};
use etcd_client::{Client, EventType, Txn, TxnOp, WatchOptions};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use support::consumer::{Consistency, Consumer};
use support::etcd::*;
use tokio::sync::mpsc;

use support::mirror::{DEADLINE, fast_config as config, start};

/// A worker mirroring `origin` into `peer`, both single servers, plain.
fn start_between(
    config: MirrorConfig,
    origin: &EtcdServer,
    peer: &EtcdServer,
) -> (MirrorHandle, mpsc::Receiver<MirrorEvent>) {
    start(config, EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain([peer.endpoint()]))
}

/// Puts a value of about a mebibyte under each endpoint key in `range`, one revision each.
async fn put_mebibytes(o: &mut Client, range: std::ops::Range<usize>, version: &str) {
    for i in range {
        o.put(endpoint_key("a", i), large_value("a", i, version, 1 << 20), None).await.unwrap();
    }
}

async fn wait_health(handle: &MirrorHandle, what: &str, f: impl Fn(&mirror::PeerHealth) -> bool) {
    let mut rx = handle.subscribe();
    tokio::time::timeout(DEADLINE, rx.wait_for(|h| f(h)))
        .await
        .unwrap_or_else(|_| panic!("{what}: not reached; health: {:?}", handle.health()))
        .expect("worker alive");
}

async fn wait_synced(handle: &MirrorHandle) {
    wait_health(handle, "synced and watching", |h| h.synced && h.phase == Phase::Watching).await;
}

fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("aether_operator=debug")
        .with_test_writer()
        .with_ansi(false)
        .try_init();
}

#[tokio::test]
async fn a_peer_cluster_losing_its_leader_mid_sync_converges() {
    logs();
    let (origin, mut peer) = tokio::try_join!(EtcdServer::start("a"), EtcdCluster::start("b", 3)).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..20_000, "v1").await;
    let (handle, _events) =
        start(config("w1"), EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain(peer.endpoints()));
    wait_health(&handle, "the sync has begun writing", |h| h.ops > 0 || h.txns > 0 || h.phase == Phase::Syncing).await;
    let leader = peer.leader().await.unwrap();
    peer.kill_member(leader);
    let started = Instant::now();
    let survivors: Vec<String> = (0..3).filter(|i| *i != leader).map(|i| peer.members()[i].endpoint()).collect();
    let p = connect(&survivors, None).await;
    converged(&o, &p, "a", DEADLINE).await;
    eprintln!("converged {:?} after the peer's leader was killed; health {:?}", started.elapsed(), handle.health());
    // The member comes back; writes keep flowing.
    peer.restart_member(leader).await.unwrap();
    write_keys(&mut o, "a", 20_000..20_100, "v2").await;
    converged(&o, &p, "a", DEADLINE).await;
    handle.shutdown().await;
}

#[tokio::test]
async fn an_origin_cluster_losing_its_leader_mid_watch_converges() {
    let (mut origin, peer) = tokio::try_join!(EtcdCluster::start("a", 3), EtcdServer::start("b")).unwrap();
    let mut o = connect(&origin.endpoints(), None).await;
    write_keys(&mut o, "a", 0..500, "v1").await;
    let (handle, _events) =
        start(config("w1"), EtcdTarget::plain(origin.endpoints()), EtcdTarget::plain([peer.endpoint()]));
    wait_synced(&handle).await;
    let leader = origin.leader().await.unwrap();
    origin.kill_member(leader);
    origin.leader().await.unwrap();
    let survivors: Vec<String> = (0..3).filter(|i| *i != leader).map(|i| origin.members()[i].endpoint()).collect();
    let o = connect(&survivors, None).await;
    // The registrar retries what the election interrupted; so does this writer.
    wait_until("writes after the election", DEADLINE, || {
        let mut o = o.clone();
        async move {
            for chunk in (0..800usize).collect::<Vec<_>>().chunks(100) {
                let ops: Vec<TxnOp> = chunk
                    .iter()
                    .map(|i| TxnOp::put(endpoint_key("a", *i), endpoint_value("a", *i, "v2"), None))
                    .collect();
                o.txn(Txn::new().and_then(ops)).await?;
            }
            Ok(true)
        }
    })
    .await
    .unwrap();
    let p = connect(&[peer.endpoint()], None).await;
    converged(&o, &p, "a", DEADLINE).await;
    handle.shutdown().await;
}

#[tokio::test]
async fn a_handoff_with_256_leases_at_100ms_rtt_deletes_nothing() {
    logs();
    let (origin, peer, proxy, mut o) = origin_and_far_peer(Duration::from_millis(100), 200).await;
    let mut cfg = config("w1");
    cfg.lease_ttl_seconds = 10;
    cfg.keepalive_interval = Duration::from_secs(3);
    cfg.max_keys_per_lease = 2;
    let peer_target = EtcdTarget::plain([proxy.endpoint("http")]);
    let (old, _e1) = start(cfg.clone(), EtcdTarget::plain([origin.endpoint()]), peer_target.clone());
    wait_synced(&old).await;
    let p = connect(&[peer.endpoint()], None).await;
    let leases = checkpoint(&mut p.clone(), "a").await.expect("checkpoint").leases;
    assert!(leases.len() >= 256, "{} leases", leases.len());
    let deletes = count_peer_deletes(&p, "a").await;

    old.shutdown().await;
    cfg.owner_id = "w2".into();
    let started = Instant::now();
    let (new, mut events) = start(cfg.clone(), EtcdTarget::plain([origin.endpoint()]), peer_target);
    wait_synced(&new).await;
    eprintln!("successor watching {:?} after the handoff", started.elapsed());
    let mut adopted = false;
    while let Ok(e) = events.try_recv() {
        adopted |= matches!(e, MirrorEvent::LeasesAdopted { .. });
    }
    assert!(adopted, "the successor adopts the leases");
    // Past a full TTL: nothing lapsed, nothing was deleted.
    write_keys(&mut o, "a", 0..10, "v2").await;
    converged(&o, &p, "a", DEADLINE).await;
    tokio::time::sleep_until((started + Duration::from_secs(cfg.lease_ttl_seconds as u64 + 2)).into()).await;
    converged(&o, &p, "a", Duration::from_secs(1)).await;
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "no key was deleted on the peer during the handoff");
    new.shutdown().await;
}

#[tokio::test]
async fn mebibyte_values_sync_overwrite_and_resume_behind_several() {
    // The origin takes larger requests than the peer (etcd's default 1.5 MiB), so that one of its
    // revisions can carry more than a peer Txn may.
    let (origin, peer) = tokio::try_join!(
        EtcdServer::start_with("a", EtcdFlavor::from_env(), &["--max-request-bytes", "8388608"]),
        EtcdServer::start("b")
    )
    .unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    const MIB: usize = 1 << 20;
    put_mebibytes(&mut o, 0..12, "v1").await;
    write_keys(&mut o, "a", 100..400, "small").await;
    let (handle, _e) = start_between(config("w1"), &origin, &peer);
    let p = connect(&[peer.endpoint()], None).await;
    converged(&o, &p, "a", DEADLINE).await;

    // Overwrites through the watch, one revision of three of them together.
    put_mebibytes(&mut o, 0..6, "v2").await;
    let ops: Vec<TxnOp> =
        (6..9).map(|i| TxnOp::put(endpoint_key("a", i), large_value("a", i, "v2", MIB), None)).collect();
    o.txn(Txn::new().and_then(ops)).await.unwrap();
    converged(&o, &p, "a", DEADLINE).await;

    // The worker stops; the origin moves on by several mebibytes; a successor resumes behind them.
    handle.shutdown().await;
    put_mebibytes(&mut o, 0..12, "v3").await;
    let (handle, _e) = start_between(config("w2"), &origin, &peer);
    converged(&o, &p, "a", DEADLINE).await;
    let h = handle.health();
    assert_eq!(h.last_error, None, "no error on the way: {h:?}");
    handle.shutdown().await;
}

#[tokio::test]
async fn a_value_larger_than_the_peer_accepts_is_reported_and_the_rest_flows() {
    let (origin, peer, mut o) = origin_taking_large_values(100).await;
    let too_big = endpoint_key("a", 7);
    o.put(too_big.as_str(), large_value("a", 7, "huge", 2 << 20), None).await.unwrap();
    let (handle, mut events) = start_between(config("w1"), &origin, &peer);
    wait_health(&handle, "the oversized value is reported", |h| h.oversized.iter().any(|(k, _)| k == &too_big)).await;
    // Everything else arrives, and keeps arriving.
    write_keys(&mut o, "a", 100..150, "v2").await;
    let mut p = connect(&[peer.endpoint()], None).await;
    wait_until("the rest mirrored", DEADLINE, || {
        let (mut o, mut p) = (o.clone(), p.clone());
        let too_big = too_big.clone();
        async move {
            let mut ov = values(&mut o, &keys::region_prefix("a")).await;
            ov.remove(too_big.as_bytes());
            Ok(ov == values(&mut p, &keys::region_prefix("a")).await)
        }
    })
    .await
    .unwrap();
    assert!(p.get(too_big.as_str(), None).await.unwrap().kvs().is_empty(), "no stale copy of it stays");
    let mut reported = false;
    while let Ok(e) = events.try_recv() {
        reported |= matches!(&e, MirrorEvent::ValueTooLarge { key, bytes } if key == &too_big && *bytes > 2 << 20);
    }
    assert!(reported, "an event names the key and its size");
    // Once it shrinks, it is mirrored and the report clears.
    o.put(too_big.as_str(), endpoint_value("a", 7, "fits"), None).await.unwrap();
    converged(&o, &p, "a", DEADLINE).await;
    wait_health(&handle, "the report clears", |h| h.oversized.is_empty()).await;
    handle.shutdown().await;
}

#[tokio::test]
async fn a_value_left_out_is_still_reported_by_a_successor_that_resumes_without_a_sync() {
    let (origin, peer, mut o) = origin_taking_large_values(100).await;
    let (first, _events) = start_between(config("w1"), &origin, &peer);
    wait_synced(&first).await;
    // Too large once the mirror is watching: seen by the watch, not by a sync.
    let too_big = endpoint_key("a", 7);
    o.put(too_big.as_str(), large_value("a", 7, "huge", 2 << 20), None).await.unwrap();
    wait_health(&first, "the oversized value is reported", |h| h.oversized.iter().any(|(k, _)| k == &too_big)).await;
    let p = connect(&[peer.endpoint()], None).await;
    wait_until("the left-out key recorded on the peer", DEADLINE, || {
        let (mut p, too_big) = (p.clone(), too_big.clone());
        async move {
            let cp = checkpoint(&mut p, "a").await;
            Ok(cp.is_some_and(|c| c.left_out.iter().any(|l| l.key == too_big)))
        }
    })
    .await
    .unwrap();
    first.shutdown().await;

    // A successor adopts the mirror (no sync) and still says the peer lacks the value.
    let (second, mut events) = start_between(config("w2"), &origin, &peer);
    wait_health(&second, "the successor reports the left-out value", |h| {
        h.synced && h.oversized.iter().any(|(k, b)| k == &too_big && *b > 2 << 20)
    })
    .await;
    support::mirror::wait_event(
        &mut events,
        "a ValueTooLarge event from the successor",
        |e| matches!(e, MirrorEvent::ValueTooLarge { key, .. } if key == &too_big),
    )
    .await;
    assert_eq!(second.health().resyncs, 0, "adopted, not resynced: {:?}", second.health());
    assert!(
        !support::mirror::drain_events(&mut events).iter().any(|e| matches!(e, MirrorEvent::DriftRepaired { .. })),
        "the known gap is not drift"
    );
    // Once it shrinks, it is mirrored and the record clears.
    o.put(too_big.as_str(), endpoint_value("a", 7, "fits"), None).await.unwrap();
    converged(&o, &p, "a", DEADLINE).await;
    wait_health(&second, "the report clears", |h| h.oversized.is_empty()).await;
    wait_until("the record clears", DEADLINE, || {
        let mut p = p.clone();
        async move { Ok(checkpoint(&mut p, "a").await.is_some_and(|c| c.left_out.is_empty())) }
    })
    .await
    .unwrap();
    second.shutdown().await;
}

#[tokio::test]
async fn a_least_privilege_user_over_mtls_mirrors_into_a_three_member_peer() {
    let MtlsPeer { origin, peer, mut o, root } = mtls_peer_with_mirror_user(1000).await;
    let peer_target =
        EtcdTarget::plain(peer.endpoints()).with_tls(tls_for(&peer, "mirror-a")).with_user("mirror-a", "mirrorpw");
    let (handle, _e) = start(config("w1"), EtcdTarget::plain([origin.endpoint()]), peer_target.clone());
    converged(&o, &root, "a", DEADLINE).await;
    // etcd checks a put's lease against the keys already on it before the Txn: the sync fills
    // each lease in one Txn (two where a Txn ends amid its keys), not a key per Txn.
    let synced =
        root.clone().get(keys::region_prefix("a"), Some(etcd_client::GetOptions::new().with_prefix())).await.unwrap();
    let mut txns_per_lease: std::collections::BTreeMap<i64, std::collections::BTreeSet<i64>> = Default::default();
    for kv in synced.kvs() {
        txns_per_lease.entry(kv.lease()).or_default().insert(kv.mod_revision());
    }
    let most = txns_per_lease.values().map(|revisions| revisions.len()).max().unwrap_or(0);
    assert!(most <= 2, "a lease filled over {most} Txns ({} leases)", txns_per_lease.len());
    write_keys(&mut o, "a", 500..1200, "v2").await;
    converged(&o, &root, "a", DEADLINE).await;
    // Auth binds this user: every put attached to a lease costs a check per key on it, so the
    // worker keeps shards small whatever the configured cap.
    let cp = checkpoint(&mut root.clone(), "a").await.expect("checkpoint");
    assert!(
        cp.keys.iter().all(|n| *n as u64 <= aether_operator::mirror::plan::AUTH_MAX_KEYS_PER_LEASE),
        "keys per lease under auth: {:?}",
        cp.keys
    );

    // The user can write nothing outside the origin's subtree and bookkeeping. A member that has
    // not applied the user's authentication yet answers "invalid auth token" (a simple token is
    // assigned as each member applies it): asked again, never accepted.
    let mut confined = peer_target.connect().await.unwrap();
    let (deadline, mut answers) = (Instant::now() + DEADLINE, Vec::new());
    loop {
        let refused = confined.put(endpoint_key("b", 1), "x", None).await;
        let refused = refused.expect_err("a put outside the user's range was accepted").to_string();
        if refused.contains("permission denied") {
            break;
        }
        answers.push(refused);
        assert!(Instant::now() < deadline, "a put outside the user's range not refused for its range: {answers:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    handle.shutdown().await;
}

/// Production's shape across an ocean: a three-member peer over mTLS, a non-root user, every
/// member 150 ms away. The sync spreads its Txns over connections of their own (each one
/// authenticated), and the copy is whole.
#[tokio::test]
async fn a_least_privilege_user_over_mtls_syncs_into_a_peer_150ms_away_over_several_connections() {
    let MtlsPeer { origin, peer, mut o, root } = mtls_peer_with_mirror_user(5000).await;
    let (_proxies, peer_target) = far_members_as_mirror_user(&peer, Duration::from_millis(150)).await;
    let (handle, _e) = start(config("w1"), EtcdTarget::plain([origin.endpoint()]), peer_target);
    converged(&o, &root, "a", DEADLINE).await;
    wait_health(&handle, "synced", |h| h.synced).await;
    let spread = handle.health().peer_connections;
    assert!(spread > 1, "the sync went over {spread} connection(s)");
    write_keys(&mut o, "a", 2500..6000, "v2").await;
    converged(&o, &root, "a", DEADLINE).await;
    assert_eq!(handle.health().resyncs, 0, "no resync");
    handle.shutdown().await;
}

/// A region of a 32-region mesh is one of 31 writing into each peer etcd: a burst to a far peer
/// spreads over its share of that etcd's connections (`plan::spread_cap`: 4), not the 16 a
/// worker alone takes, and still lands whole.
#[tokio::test]
async fn a_worker_of_a_large_mesh_spreads_a_burst_over_only_its_share_of_the_peers_connections() {
    let config = MirrorConfig { origin_peers: Arc::new(AtomicUsize::new(31)), ..config("w1") };
    let (_, most) = burst_after_an_empty_sync_to_a_far_peer(config).await;
    assert!(most <= 4, "the burst spread over {most} connections; its share of the peer's is 4");
}

/// An empty sync into a three-member peer 150 ms away, then a burst of 8,000 keys: it lands whole,
/// over more than the session's connection, with no resync. Returns the connections after the
/// sync and the most the worker reported during the burst.
async fn burst_after_an_empty_sync_to_a_far_peer(config: MirrorConfig) -> (usize, usize) {
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdCluster::start("b", 3)).unwrap();
    let (_proxies, far) = far_members(&peer, Duration::from_millis(150), "http").await;
    let o = connect(&[origin.endpoint()], None).await;
    let p = connect(&peer.endpoints(), None).await;
    let (handle, _e) = start(config, EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain(far));
    wait_synced(&handle).await;
    let after_sync = handle.health().peer_connections;
    // Every connection count the worker reports, from now on.
    let (mut health, most) = (handle.subscribe(), Arc::new(AtomicUsize::new(0)));
    let watching = tokio::spawn({
        let most = most.clone();
        async move {
            while health.changed().await.is_ok() {
                most.fetch_max(health.borrow().peer_connections, Ordering::SeqCst);
            }
        }
    });
    burst(&o, 0..8_000).await;
    converged(&o, &p, "a", DEADLINE).await;
    wait_health(&handle, "the watch spread over more connections", |h| h.peer_connections > 1).await;
    assert_eq!(handle.health().resyncs, 0, "no resync");
    let most = most.load(Ordering::SeqCst).max(handle.health().peer_connections);
    watching.abort();
    handle.shutdown().await;
    (after_sync, most)
}

/// A partition that leaves the leases a few seconds, healed with every connection reset, to a
/// three-member peer over mTLS 150 ms away as the least-privilege user: the keeper's new
/// connection (TLS, a password, several round trips) must not count against the round's
/// deadline, or every retry fails once a third of what is left is under it, and the mirror lapses.
#[tokio::test]
async fn a_far_mtls_peer_healed_with_little_ttl_left_is_renewed_before_anything_lapses() {
    let MtlsPeer { origin, peer, root, .. } = mtls_peer_with_mirror_user(500).await;
    let (proxies, peer_target) = far_members_as_mirror_user(&peer, Duration::from_millis(150)).await;
    let cfg = config("w1");
    let (handle, _e) = start(cfg.clone(), EtcdTarget::plain([origin.endpoint()]), peer_target);
    wait_synced(&handle).await;
    let deletes = count_peer_deletes(&root, "a").await;
    let ttl = support::mirror::LowestTtl::watch(&root).await;
    let rounds = handle.health().keepalive_rounds;
    wait_health(&handle, "a keepalive round before the partition", |h| h.keepalive_rounds > rounds).await;
    for proxy in &proxies {
        proxy.set_blackhole(true);
    }
    // The partition itself: the leases keep about 2.5 of their 6 s.
    tokio::time::sleep(Duration::from_millis(cfg.lease_ttl_seconds as u64 * 1000 - 3500)).await;
    for proxy in &proxies {
        proxy.reset_connections();
        proxy.set_blackhole(false);
    }
    let rounds = handle.health().keepalive_rounds;
    wait_health(&handle, "a keepalive round after the heal", |h| h.keepalive_rounds > rounds).await;
    assert!(ttl.lowest() > 0, "the leases lapsed ({} s left at the lowest)", ttl.lowest());
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "keys lapsed on the peer");
    assert_eq!(handle.health().resyncs, 0, "no resync: {:?}", handle.health());
    handle.shutdown().await;
}

/// A region whose subtree was empty at the sync, then written in a burst (64 puts at a time),
/// into a three-member peer, every member 150 ms away. The empty sync needs only the session's
/// connection; the watch's Txns in flight then outgrow it and spread over more (a fresh
/// connection's flow-control window lets a few Txns out a round trip), and the burst lands whole
/// with no resync.
#[tokio::test]
async fn a_burst_after_an_empty_sync_spreads_the_watch_over_more_connections_to_a_far_peer() {
    let (after_sync, _) = burst_after_an_empty_sync_to_a_far_peer(config("w1")).await;
    assert_eq!(after_sync, 1, "an empty subtree syncs over the session's connection");
}

/// Under least-privilege auth etcd checks, at every put attached to a lease, every key already
/// on it. A region whose subtree was empty at the sync, then written in a burst of 8,000 keys
/// (64 puts at a time), into a three-member peer over mTLS 150 ms away: piled onto the one lease
/// the empty sync laid out, each Txn took the peer up to a second to apply, its leader answered
/// no lease renewal behind the queue, and nothing converged in 90 s. The watch resyncs to a
/// layout sized for the keys instead, and no lease passes the cap.
#[tokio::test]
async fn a_burst_into_an_empty_subtree_under_auth_resyncs_to_more_leases_instead_of_piling_keys_onto_one() {
    let MtlsPeer { origin, peer, o, root } = mtls_peer_with_mirror_user(0).await;
    let (_proxies, peer_target) = far_members_as_mirror_user(&peer, Duration::from_millis(150)).await;
    // The CRD defaults (TTL 30 s, keepalive 10 s): with both cores busy the three members answered
    // no renewal for over 6 s while the resyncs' Txns were applied, and the fast TTL lapsed.
    let mut cfg = config("w1");
    cfg.lease_ttl_seconds = 30;
    cfg.keepalive_interval = Duration::from_secs(10);
    let (handle, _e) = start(cfg, EtcdTarget::plain([origin.endpoint()]), peer_target);
    wait_synced(&handle).await;
    burst(&o, 0..8_000).await;
    converged(&o, &root, "a", DEADLINE).await;
    let cap = aether_operator::mirror::plan::AUTH_MAX_KEYS_PER_LEASE as usize;
    support::mirror::wait_placed_under_cap(&root, cap, &handle).await;
    let health = handle.health();
    assert!(health.resyncs_by_cause.get("reshard").is_some_and(|n| *n >= 1), "resyncs: {:?}", health.resyncs_by_cause);
    assert!(!health.resyncs_by_cause.contains_key("lease_lost"), "resyncs: {:?}", health.resyncs_by_cause);
    handle.shutdown().await;
}

/// A subtree that grows under auth by steady Txns after a small sync (as a writer creating 100
/// keys a second does; on kind, the upgrade step's) outgrows its layout and reshards. Each reshard
/// is a full sync, and a sync may share a snapshot another sync of the region pinned moments ago,
/// but never one older than what the worker already sent: copied from it, the merge would delete
/// from the peer the keys created since, and the watch would put them back. Before that rule the
/// worker looped through dozens of reshards in ten seconds, each taking the copy back to the
/// first one's snapshot (93 on kind in 33 s).
#[tokio::test]
async fn a_subtree_growing_under_auth_reshards_from_snapshots_no_older_than_the_copy_and_its_keys_never_go_back() {
    let MtlsPeer { origin, peer, mut o, root } = mtls_peer_with_mirror_user(40).await;
    let (_proxies, peer_target) = far_members_as_mirror_user(&peer, Duration::ZERO).await;
    let mut cfg = config("w1");
    cfg.lease_ttl_seconds = 30;
    cfg.keepalive_interval = Duration::from_secs(10);
    let (handle, _e) = start(cfg, EtcdTarget::plain([origin.endpoint()]), peer_target);
    wait_synced(&handle).await;
    let consumer = Consumer::watch(&o, &root, "a").await;
    // 200 creates, ten to a Txn, ten Txns a second: the pace of a writer, not a wait for anything.
    for first in (40..240).step_by(10) {
        let puts: Vec<TxnOp> =
            (first..first + 10).map(|i| TxnOp::put(endpoint_key("a", i), endpoint_value("a", i, "v1"), None)).collect();
        o.txn(Txn::new().and_then(puts)).await.expect("origin txn");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    converged(&o, &root, "a", DEADLINE).await;
    let cap = aether_operator::mirror::plan::AUTH_MAX_KEYS_PER_LEASE as usize;
    support::mirror::wait_placed_under_cap(&root, cap, &handle).await;
    let health = handle.health();
    let reshards = health.resyncs_by_cause.get("reshard").copied().unwrap_or(0);
    assert!(
        (1..=4).contains(&reshards),
        "40 -> 240 keys under a lease cap of {cap}: {reshards} reshards ({:?})",
        health.resyncs_by_cause
    );
    consumer.verdict(Consistency::PerKey).await.unwrap_or_else(|e| panic!("a consumer of the peer saw {e}"));
    handle.shutdown().await;
}

/// Puts endpoint keys `range` on the origin, 64 at a time, one revision each.
async fn burst(o: &Client, range: std::ops::Range<usize>) {
    use futures::StreamExt;
    futures::stream::iter(range)
        .map(|i| {
            let mut o = o.clone();
            async move { o.put(endpoint_key("a", i), endpoint_value("a", i, "v1"), None).await.expect("origin put") }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await;
}

/// Fault proxies `rtt` in front of each member of `peer`, and their endpoints.
async fn far_members(peer: &EtcdCluster, rtt: Duration, scheme: &str) -> (Vec<FaultProxy>, Vec<String>) {
    let mut proxies = Vec::new();
    for member in peer.members() {
        let proxy = FaultProxy::start(member.client_addr()).await.unwrap();
        proxy.set_rtt(rtt);
        proxies.push(proxy);
    }
    let endpoints = proxies.iter().map(|p| p.endpoint(scheme)).collect();
    (proxies, endpoints)
}

/// `far_members` of an mTLS peer, reached as the least-privilege user `mirror-a`.
async fn far_members_as_mirror_user(peer: &EtcdCluster, rtt: Duration) -> (Vec<FaultProxy>, EtcdTarget) {
    let (proxies, far) = far_members(peer, rtt, "https").await;
    let target = EtcdTarget::plain(far).with_tls(tls_for(peer, "mirror-a")).with_user("mirror-a", "mirrorpw");
    (proxies, target)
}

/// An origin holding endpoint keys and a three-member peer over mTLS with auth on, where the
/// least-privilege user `mirror-a` (password `mirrorpw`) may write the origin's subtree; `root`
/// reads the peer as root.
struct MtlsPeer {
    origin: EtcdServer,
    peer: EtcdCluster,
    o: Client,
    root: Client,
}

async fn mtls_peer_with_mirror_user(keys: usize) -> MtlsPeer {
    let (origin, peer) =
        tokio::try_join!(EtcdServer::start("a"), EtcdCluster::start_with("b", ClusterOptions::new(3).with_tls()))
            .unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..keys, "v1").await;
    let root_tls = tls_for(&peer, "root");
    let mut admin =
        connect(&peer.endpoints(), Some(etcd_client::ConnectOptions::new().with_tls(root_tls.clone()))).await;
    enable_auth_with_mirror_user(&mut admin, "a", "mirrorpw").await;
    let root = connect(
        &peer.endpoints(),
        Some(etcd_client::ConnectOptions::new().with_tls(root_tls).with_user("root", "rootpw")),
    )
    .await;
    MtlsPeer { origin, peer, o, root }
}

/// An origin that takes requests of up to 4 MiB, holding `keys` endpoint keys, and a peer with
/// etcd's default limit (1.5 MiB).
async fn origin_taking_large_values(keys: usize) -> (EtcdServer, EtcdServer, Client) {
    let (origin, peer) = tokio::try_join!(
        EtcdServer::start_with("a", EtcdFlavor::from_env(), &["--max-request-bytes", "4194304"]),
        EtcdServer::start("b")
    )
    .unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..keys, "v1").await;
    (origin, peer, o)
}

/// An origin holding `keys` endpoint keys (version "v1") and a peer reached through a fault proxy
/// `rtt` away.
/// The fault tests' settings with the production RPC timeout (10 s), for the tests that count
/// failed sessions to prove the pipeline never trips itself: under `make test` on a fresh machine
/// the kind node image builds beside them, and a peer's fsync stalled past the fault tests' 3 s
/// once ended a session there for a reason that was the disk's, not the pipeline's.
fn patient_config(owner: &str) -> MirrorConfig {
    let mut c = config(owner);
    c.rpc_timeout = MirrorConfig::new("a", "b", owner).rpc_timeout;
    c
}

async fn origin_and_far_peer(rtt: Duration, keys: usize) -> (EtcdServer, EtcdServer, FaultProxy, Client) {
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).unwrap();
    let proxy = FaultProxy::start(peer.client_addr()).await.unwrap();
    proxy.set_rtt(rtt);
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..keys, "v1").await;
    (origin, peer, proxy, o)
}

/// An origin holding `keys` keys and a peer started with `peer_flags` (a small quota, a small
/// request limit), both plain and next door.
async fn origin_and_peer_with(peer_flags: &[&str], keys: usize) -> (EtcdServer, EtcdServer, Client) {
    let (origin, peer) =
        tokio::try_join!(EtcdServer::start("a"), EtcdServer::start_with("b", EtcdFlavor::from_env(), peer_flags))
            .unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..keys, "v1").await;
    (origin, peer, o)
}

/// An origin with 300 keys mirrored into a peer 50 ms away through a fault proxy, synced.
struct Behind {
    origin: EtcdServer,
    peer: EtcdServer,
    proxy: FaultProxy,
    o: Client,
    cfg: MirrorConfig,
    handle: MirrorHandle,
}

async fn synced_behind_a_proxy() -> Behind {
    let (origin, peer, proxy, o) = origin_and_far_peer(Duration::from_millis(50), 300).await;
    let cfg = config("w1");
    let (handle, _events) =
        start(cfg.clone(), EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain([proxy.endpoint("http")]));
    wait_synced(&handle).await;
    Behind { origin, peer, proxy, o, cfg, handle }
}

#[tokio::test]
async fn a_blackhole_shorter_than_the_ttl_loses_nothing() {
    let Behind { origin: _origin, peer, proxy, mut o, cfg, handle } = synced_behind_a_proxy().await;
    let p = connect(&[peer.endpoint()], None).await;
    let deletes = count_peer_deletes(&p, "a").await;

    proxy.set_blackhole(true);
    write_keys(&mut o, "a", 0..50, "during").await;
    tokio::time::sleep(Duration::from_secs(cfg.lease_ttl_seconds as u64 / 2)).await; // the outage itself
    proxy.set_blackhole(false);
    converged(&o, &p, "a", DEADLINE).await;
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "nothing lapsed in an outage shorter than the TTL");
    handle.shutdown().await;
}

#[tokio::test]
async fn a_blackhole_longer_than_twice_the_ttl_lapses_the_mirror_and_it_recovers() {
    let Behind { origin: _origin, peer, proxy, mut o, cfg: _, handle } = synced_behind_a_proxy().await;
    let mut p = connect(&[peer.endpoint()], None).await;

    proxy.set_blackhole(true);
    // The origin's heartbeat no longer reaches the peer: the mirror lapses there, as designed.
    wait_until("the mirror lapses on the peer", DEADLINE, || {
        let mut p = p.clone();
        async move { Ok(values(&mut p, &keys::region_prefix("a")).await.is_empty()) }
    })
    .await
    .unwrap();
    wait_health(&handle, "the peer is reported unreachable", |h| !h.reachable).await;
    write_keys(&mut o, "a", 300..350, "during").await;
    proxy.set_blackhole(false);
    converged(&o, &p, "a", DEADLINE).await;
    wait_health(&handle, "reachable again", |h| h.reachable).await;
    let _ = p.status().await;
    handle.shutdown().await;
}

#[tokio::test]
async fn a_peer_restored_from_a_backup_is_repaired() {
    let (origin, mut peer) =
        tokio::try_join!(EtcdServer::start("a"), EtcdServer::start_with("b", EtcdFlavor::Default, &[])).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..300, "v1").await;
    let (handle, _e) = start_between(config("w1"), &origin, &peer);
    wait_synced(&handle).await;
    let dir = tempfile::tempdir().unwrap();
    let backup = dir.path().join("peer.db");
    peer.snapshot_save(&backup).unwrap();
    // After the backup: changes and deletes that the restore will undo on the peer.
    write_keys(&mut o, "a", 0..100, "v2").await;
    for i in 200..250 {
        o.delete(endpoint_key("a", i), None).await.unwrap();
    }
    let p = connect(&[peer.endpoint()], None).await;
    converged(&o, &p, "a", DEADLINE).await;

    peer.restore(&backup, None).await.unwrap();
    let p = connect(&[peer.endpoint()], None).await;
    converged(&o, &p, "a", DEADLINE).await;
    handle.shutdown().await;
}

#[tokio::test]
async fn an_origin_restored_from_a_backup_is_mirrored_as_restored_unless_that_deletes_most_of_the_copy() {
    let (mut origin, peer) =
        tokio::try_join!(EtcdServer::start_with("a", EtcdFlavor::Default, &[]), EtcdServer::start("b")).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..300, "v1").await;
    let (handle, _e) = start_between(config("w1"), &origin, &peer);
    wait_synced(&handle).await;
    let dir = tempfile::tempdir().unwrap();
    let backup = dir.path().join("origin.db");
    origin.snapshot_save(&backup).unwrap();
    // Many revisions after the backup, so that the restored origin's revision is far behind; the
    // restore loses a quarter of the keys.
    for round in 0..20 {
        write_keys(&mut o, "a", 300..400, &format!("after-backup-{round}")).await;
    }
    let p = connect(&[peer.endpoint()], None).await;
    converged(&o, &p, "a", DEADLINE).await;

    // Restored without --bump-revision: its revisions start over below what the mirror applied.
    // A quarter of the copy to delete is within the bound: mirrored as restored.
    origin.restore(&backup, None).await.unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 5000..5010, "after-restore").await;
    converged(&o, &p, "a", DEADLINE).await;

    // The region grows to 2,310 keys; restored again to the 300 of the backup, mirroring it would
    // delete 87 % of the copy: held, the copy kept alive as it is, until the bound is raised.
    write_keys(&mut o, "a", 400..2400, "grown").await;
    converged(&o, &p, "a", DEADLINE).await;
    let count = |p: &etcd_client::Client| {
        let mut p = p.clone();
        async move {
            let options = etcd_client::GetOptions::new().with_prefix().with_count_only();
            p.get(aether_operator::keys::region_prefix("a"), Some(options)).await.unwrap().count()
        }
    };
    let grown = count(&p).await;
    origin.restore(&backup, None).await.unwrap();
    wait_health(&handle, "the resync held", |h| {
        h.phase == Phase::Held && h.refusal.as_ref().is_some_and(|r| r.reason == "ResyncWouldDelete")
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3 * config("x").lease_ttl_seconds as u64)).await; // three TTLs held
    assert_eq!(count(&p).await, grown, "the held copy lapsed or shrank");
    handle.shutdown().await;
    let mut acknowledged = config("w2");
    acknowledged.max_resync_delete_percent = 100;
    let (handle, _e) = start_between(acknowledged, &origin, &peer);
    let o = connect(&[origin.endpoint()], None).await;
    converged(&o, &p, "a", DEADLINE).await;
    assert_eq!(count(&p).await, 300);
    handle.shutdown().await;
}

#[tokio::test]
async fn a_full_peer_backs_off_instead_of_spinning_and_recovers_after_disarm() {
    logs();
    let (origin, peer, mut o) = origin_and_peer_with(&["--quota-backend-bytes", "16777216"], 100).await;
    let (handle, _e) = start_between(config("w1"), &origin, &peer);
    wait_synced(&handle).await;

    // Someone fills the peer until its quota alarm goes off.
    let mut p = connect(&[peer.endpoint()], None).await;
    let junk = "j".repeat(1 << 20);
    for i in 0..64 {
        if p.put(format!("/junk/{i}"), junk.as_str(), None).await.is_err() {
            break;
        }
    }
    write_keys(&mut o, "a", 100..200, "v2").await;
    wait_health(&handle, "NOSPACE reported", |h| h.last_error_reason == Some("NoSpace")).await;
    let reported = handle.health().last_error.unwrap_or_default();
    assert!(reported.contains("space quota") && reported.contains(&peer.endpoint()), "{reported}");
    let before = handle.health().session_failures;
    tokio::time::sleep(Duration::from_secs(4)).await; // the window in which retries are counted
    let failures = handle.health().session_failures - before;
    // Backoff 50 ms doubling to 1 s: about 6 attempts in 4 s; a spin would make dozens.
    assert!(failures <= 10, "{failures} failed sessions in 4 s: the worker spins");

    p.delete("/junk/", Some(etcd_client::DeleteOptions::new().with_prefix())).await.unwrap();
    let rev = p.status().await.unwrap().header().unwrap().revision();
    p.compact(rev, Some(etcd_client::CompactionOptions::new().with_physical())).await.unwrap();
    p.defragment().await.unwrap();
    let alarms = p.alarm(etcd_client::AlarmAction::Get, etcd_client::AlarmType::None, None).await.unwrap();
    for alarm in alarms.alarms() {
        let mut options = etcd_client::AlarmOptions::new();
        options.with_member(alarm.member_id());
        p.alarm(etcd_client::AlarmAction::Deactivate, alarm.alarm(), Some(options)).await.unwrap();
    }
    converged(&o, &p, "a", DEADLINE).await;
    wait_health(&handle, "the error clears once it applies again", |h| h.last_error.is_none()).await;
    handle.shutdown().await;
}

#[tokio::test]
async fn each_session_fences_the_late_txns_of_its_predecessors() {
    let (origin, peer, proxy, mut o) = origin_and_far_peer(Duration::ZERO, 50).await;
    let (handle, _e) =
        start(config("w1"), EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain([proxy.endpoint("http")]));
    wait_synced(&handle).await;
    let mut p = connect(&[peer.endpoint()], None).await;
    let owner_revision =
        |mut p: Client| async move { p.get(keys::owner_key("a"), None).await.unwrap().kvs()[0].mod_revision() };
    let first_epoch = owner_revision(p.clone()).await;

    // A batch fails (the peer stops answering while a write waits), and the connections break:
    // the session ends and the next one takes a new epoch.
    let failures = handle.health().session_failures;
    proxy.set_blackhole(true);
    write_keys(&mut o, "a", 0..10, "v1b").await;
    wait_health(&handle, "a session ended", |h| h.session_failures > failures).await;
    proxy.reset_connections();
    proxy.set_blackhole(false);
    wait_until("a new session epoch", DEADLINE, || {
        let p = p.clone();
        async move { Ok(owner_revision(p).await > first_epoch) }
    })
    .await
    .unwrap();
    write_keys(&mut o, "a", 0..50, "v2").await;
    converged(&o, &p, "a", DEADLINE).await;

    // A Txn of the first session arriving late (as a batch carries it) cannot land.
    let late = Txn::new()
        .when([etcd_client::Compare::mod_revision(keys::owner_key("a"), etcd_client::CompareOp::Equal, first_epoch)])
        .and_then([TxnOp::put(endpoint_key("a", 1), endpoint_value("a", 1, "v1"), None)]);
    assert!(!p.txn(late).await.unwrap().succeeded(), "a late Txn of an earlier session is fenced");
    converged(&o, &p, "a", Duration::from_secs(5)).await;
    handle.shutdown().await;
}

#[tokio::test]
async fn a_fenced_worker_whose_successor_never_comes_takes_over_again() {
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..200, "v1").await;
    let cfg = config("w1");
    let (handle, _e) = start(cfg.clone(), EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain([peer.endpoint()]));
    wait_synced(&handle).await;
    let mut p = connect(&[peer.endpoint()], None).await;
    let deletes = count_peer_deletes(&p, "a").await;

    // Someone overwrites the owner record, and nobody ever takes over.
    let owner = serde_json::json!({"owner": "ghost", "acquiredAt": "2026-01-01T00:00:00Z", "generation": 1_000_000});
    p.put(keys::owner_key("a"), owner.to_string(), None).await.unwrap();
    write_keys(&mut o, "a", 0..20, "v2").await;
    wait_health(&handle, "fenced", |h| h.phase == Phase::Fenced).await;
    // The worker keeps the leases alive, notices nobody took over, and resumes.
    wait_synced(&handle).await;
    converged(&o, &p, "a", DEADLINE).await;
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "the mirror never lapsed");
    let _ = p.status().await;
    handle.shutdown().await;
}

#[tokio::test]
async fn bookkeeping_per_watch_batch_is_small_and_constant() {
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..1000, "v1").await;
    let mut cfg = config("w1");
    cfg.max_keys_per_lease = 16; // 128 leases
    let (handle, _e) = start(cfg, EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain([peer.endpoint()]));
    wait_synced(&handle).await;
    let mut p = connect(&[peer.endpoint()], None).await;
    let layout_revision = p.get(keys::checkpoint_key("a"), None).await.unwrap().kvs()[0].mod_revision();
    for i in 0..20 {
        o.put(endpoint_key("a", i), endpoint_value("a", i, "v2"), None).await.unwrap();
    }
    converged(&o, &p, "a", DEADLINE).await;
    let progress = p.get(keys::progress_key("a"), None).await.unwrap();
    let progress = progress.kvs().first().expect("a progress record");
    assert!(progress.value().len() <= 160, "progress record of {} bytes", progress.value().len());
    assert!(progress.mod_revision() > layout_revision, "each batch records its progress");
    let layout = p.get(keys::checkpoint_key("a"), None).await.unwrap();
    assert_eq!(layout.kvs()[0].mod_revision(), layout_revision, "the lease layout is not rewritten per batch");
    handle.shutdown().await;
}

#[tokio::test]
async fn lag_keeps_growing_while_the_peer_is_down_and_a_stalled_origin_watch_is_noticed() {
    let (origin, mut peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).unwrap();
    let origin_proxy = FaultProxy::start(origin.client_addr()).await.unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..100, "v1").await;
    let (handle, _e) =
        start(config("w1"), EtcdTarget::plain([origin_proxy.endpoint("http")]), EtcdTarget::plain([peer.endpoint()]));
    wait_synced(&handle).await;

    peer.kill();
    write_keys(&mut o, "a", 0..10, "v2").await;
    wait_health(&handle, "lag above 3 s while the peer is down", |h| h.lag_seconds(std::time::SystemTime::now()) > 3.0)
        .await;
    peer.restart().await.unwrap();
    let p = connect(&[peer.endpoint()], None).await;
    converged(&o, &p, "a", DEADLINE).await;
    wait_health(&handle, "lag back to 0", |h| h.pending_since.is_none()).await;

    // The origin stops answering (a stalled watch): not "Watching, lag 0".
    origin_proxy.set_blackhole(true);
    wait_health(&handle, "a stalled watch is reported", |h| {
        h.phase != Phase::Watching && h.lag_seconds(std::time::SystemTime::now()) > 1.0
    })
    .await;
    origin_proxy.set_blackhole(false);
    write_keys(&mut o, "a", 0..10, "v3").await;
    converged(&o, &p, "a", DEADLINE).await;
    handle.shutdown().await;
}

#[tokio::test]
async fn the_canary_says_resyncing_while_a_resync_runs() {
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..100, "v1").await;
    let (handle, mut events) = start_between(config("w1"), &origin, &peer);
    wait_synced(&handle).await;
    let mut p = connect(&[peer.endpoint()], None).await;
    let canary = |mut p: Client| async move {
        let resp = p.get(keys::canary_key("a"), None).await.unwrap();
        resp.kvs().first().map(|kv| serde_json::from_slice::<serde_json::Value>(kv.value()).unwrap())
    };
    assert_eq!(canary(p.clone()).await.expect("canary")["synced"], true);
    // A lease is lost: its keys are gone, and the canary must not claim a complete copy.
    let lease = checkpoint(&mut p, "a").await.unwrap().leases[0];
    let mut watch_client = p.watch_client();
    let mut canary_watch =
        watch_client.watch(keys::canary_key("a"), Some(WatchOptions::new().with_prev_key())).await.unwrap();
    p.lease_revoke(lease).await.unwrap();
    let mut saw_unsynced = false;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !saw_unsynced {
        let msg = tokio::time::timeout_at(deadline, canary_watch.message()).await.expect("canary changes").unwrap();
        for e in msg.expect("watch open").events() {
            if let Some(kv) = e.kv().filter(|_| e.event_type() == EventType::Put) {
                let v: serde_json::Value = serde_json::from_slice(kv.value()).unwrap();
                saw_unsynced |= v["synced"] == false;
            }
        }
    }
    converged(&o, &p, "a", DEADLINE).await;
    wait_until("canary synced again", DEADLINE, || {
        let p = p.clone();
        async move { Ok(canary(p).await.is_some_and(|c| c["synced"] == true)) }
    })
    .await
    .unwrap();
    let mut resynced = false;
    while let Ok(e) = events.try_recv() {
        resynced |= matches!(e, MirrorEvent::ResyncStarted { cause: mirror::ResyncCause::LeaseLost });
    }
    assert!(resynced);
    handle.shutdown().await;
}

#[tokio::test]
async fn out_of_band_changes_on_the_peer_are_detected_and_repaired() {
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..400, "v1").await;
    let mut cfg = config("w1");
    cfg.verify_interval = Duration::from_millis(100);
    cfg.verify_page_size = 50;
    let (handle, mut events) = start(cfg, EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain([peer.endpoint()]));
    wait_synced(&handle).await;
    wait_health(&handle, "a clean verification pass", |h| h.verify_passes >= 1 && !h.drift_detected).await;

    // Someone edits the peer behind the mirror's back: a changed value, a deleted key, a key
    // the origin never had, and a key re-put without its lease (it would outlive the region).
    let mut p = connect(&[peer.endpoint()], None).await;
    p.put(endpoint_key("a", 10), "tampered", None).await.unwrap();
    p.delete(endpoint_key("a", 200), None).await.unwrap();
    p.put(endpoint_key("a", 9999), endpoint_value("a", 9999, "ghost"), None).await.unwrap();
    p.put(endpoint_key("a", 300), endpoint_value("a", 300, "v1"), None).await.unwrap();
    wait_health(&handle, "drift detected", |h| h.drift_detected && h.drift_repaired_keys >= 4).await;
    converged(&o, &p, "a", DEADLINE).await;
    let mut repaired = 0;
    while let Ok(e) = events.try_recv() {
        if let MirrorEvent::DriftRepaired { keys, .. } = e {
            repaired += keys;
        }
    }
    assert!(repaired >= 4, "events name the repairs: {repaired} keys");
    // A later pass finds the copy clean again.
    let passes = handle.health().verify_passes;
    wait_health(&handle, "a clean pass after the repair", |h| h.verify_passes > passes && !h.drift_detected).await;
    handle.shutdown().await;
}

/// A worker whose sync reads pages of 100 keys (their ends bound verification's first pass) and
/// whose verification walks pages of 50 every 50 ms.
fn walking_in_small_pages(owner: &str) -> MirrorConfig {
    let mut cfg = config(owner);
    cfg.page_size = 100;
    cfg.verify_interval = Duration::from_millis(50);
    cfg.verify_page_size = 50;
    cfg
}

/// Deletes region a's endpoints `range` from the origin, 100 to a Txn.
async fn delete_keys(o: &mut Client, range: std::ops::Range<usize>) {
    let gone: Vec<usize> = range.collect();
    for chunk in gone.chunks(100) {
        let deletes = chunk.iter().map(|i| TxnOp::delete(endpoint_key("a", *i), None)).collect::<Vec<_>>();
        o.txn(Txn::new().and_then(deletes)).await.unwrap();
    }
}

/// Verification reads an origin page only up to two page ends ahead (the sync's, then the last
/// pass's), or two key spans of its last full page if that is nearer: etcd counts every key to a
/// range's end. A subtree that doubled since, with drift old
/// and new, at its start, middle and end, is still compared whole and repaired.
#[tokio::test]
async fn verification_bounded_by_known_page_ends_still_compares_a_grown_subtree_whole() {
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..400, "v1").await;
    let cfg = walking_in_small_pages("w1");
    let (handle, _events) = start(cfg, EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain([peer.endpoint()]));
    wait_synced(&handle).await;
    wait_health(&handle, "a clean verification pass", |h| h.verify_passes >= 1 && !h.drift_detected).await;
    // Keys the origin holds throughout: the peer must never delete one.
    let kept = (781..799).filter(|i| *i != 790).map(|i| endpoint_key("a", i).into_bytes()).collect();
    let wrong_deletes = count_deletes_of(vec![peer.endpoint()], kept).await;

    // The subtree doubles, its new keys among the old ones (the watch copies them), and then the
    // peer's copy is edited behind the mirror's back, old keys and new.
    write_keys(&mut o, "a", 400..800, "v1").await;
    let p = connect(&[peer.endpoint()], None).await;
    converged(&o, &p, "a", DEADLINE).await;
    let mut tamper = p.clone();
    for i in [0, 399, 450, 777] {
        tamper.delete(endpoint_key("a", i), None).await.unwrap();
    }
    tamper.put(endpoint_key("a", 600), "tampered", None).await.unwrap();
    tamper.put(endpoint_key("a", 9999), endpoint_value("a", 9999, "ghost"), None).await.unwrap();
    wait_health(&handle, "every drift repaired", |h| h.drift_repaired_keys >= 6).await;
    converged(&o, &p, "a", DEADLINE).await;
    let passes = handle.health().verify_passes;
    wait_health(&handle, "a clean pass after the repair", |h| h.verify_passes > passes && !h.drift_detected).await;

    // Then it shrinks to 20 keys: between two of the last pass's page ends now lies less than a
    // page, which must not end the pass there.
    delete_keys(&mut o, 0..780).await;
    converged(&o, &p, "a", DEADLINE).await;
    for i in [780, 799] {
        tamper.delete(endpoint_key("a", i), None).await.unwrap();
    }
    tamper.put(endpoint_key("a", 790), "tampered", None).await.unwrap();
    tamper.put(endpoint_key("a", 9998), endpoint_value("a", 9998, "ghost"), None).await.unwrap();
    wait_health(&handle, "the shrunk subtree's drift repaired", |h| h.drift_repaired_keys >= 10).await;
    converged(&o, &p, "a", DEADLINE).await;
    let passes = handle.health().verify_passes;
    wait_health(&handle, "a clean pass after the repair", |h| h.verify_passes > passes && !h.drift_detected).await;
    assert_eq!(wrong_deletes.load(Ordering::SeqCst), 0, "verification deleted keys the origin holds");
    handle.shutdown().await;
}

/// The sync records where its origin pages ended on the peer; a successor that takes over without
/// a sync bounds its first verification pass by them, and still finds and repairs drift anywhere.
#[tokio::test]
async fn a_successor_verifies_within_the_page_ends_its_predecessors_sync_recorded() {
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..400, "v1").await;
    let mut cfg = walking_in_small_pages("w1");
    let (local, remote) = (EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain([peer.endpoint()]));
    let (first, _events) = start(cfg.clone(), local.clone(), remote.clone());
    wait_synced(&first).await;
    let p = connect(&[peer.endpoint()], None).await;
    // Four pages of 100 keys: four ends (the last at the subtree's end).
    wait_until("the sync's page ends on the peer", DEADLINE, || {
        let mut p = p.clone();
        async move {
            let resp = p.get(aether_operator::keys::page_ends_key("a"), None).await?;
            let ends = resp.kvs().first().and_then(|kv| mirror::verify::decode_page_ends(kv.value()));
            Ok(ends.is_some_and(|ends| ends.len() >= 4))
        }
    })
    .await
    .unwrap();
    // The subtree shrinks to 100 keys: between two recorded ends now lies less than a page.
    delete_keys(&mut o, 0..300).await;
    converged(&o, &p, "a", DEADLINE).await;
    first.shutdown().await;

    cfg.owner_id = "w2".into();
    let (successor, mut events) = start(cfg, local, remote);
    wait_synced(&successor).await;
    let kept = (300..400).filter(|i| ![350, 399].contains(i)).map(|i| endpoint_key("a", i).into_bytes()).collect();
    let wrong_deletes = count_deletes_of(vec![peer.endpoint()], kept).await;
    let mut tamper = p.clone();
    tamper.delete(endpoint_key("a", 399), None).await.unwrap();
    tamper.put(endpoint_key("a", 350), "tampered", None).await.unwrap();
    tamper.put(endpoint_key("a", 9997), endpoint_value("a", 9997, "ghost"), None).await.unwrap();
    wait_health(&successor, "the drift repaired", |h| h.drift_repaired_keys >= 3).await;
    converged(&o, &p, "a", DEADLINE).await;
    let passes = successor.health().verify_passes;
    wait_health(&successor, "a clean pass after the repair", |h| h.verify_passes > passes && !h.drift_detected).await;
    assert_eq!(wrong_deletes.load(Ordering::SeqCst), 0, "verification deleted keys the origin holds");
    while let Ok(e) = events.try_recv() {
        assert!(!matches!(e, MirrorEvent::ResyncStarted { .. }), "the successor took over without a sync: {e:?}");
    }
    successor.shutdown().await;
}

/// Across regions (20-60 ms) the peer converges and no key the origin keeps is ever deleted.
#[tokio::test]
async fn randomized_writes_member_kills_and_network_faults_converge() {
    randomized_faults(20..60, None).await;
}

/// Across regions watch Txns land in any order, each key's writes in the origin's: a consumer
/// sees every key move forward only, through handoffs and crashes among Txns in flight (the
/// successor coalesces what its predecessor may have landed past its record).
#[tokio::test]
async fn randomized_faults_far_away_show_a_consumer_every_key_moving_forward_only() {
    randomized_faults(20..60, Some(Consistency::PerKey)).await;
}

/// Next door one watch Txn is in flight at a time: a consumer sees only states the origin had,
/// in order, through the same faults.
#[tokio::test]
async fn randomized_faults_next_door_show_a_consumer_only_origin_states_in_order() {
    randomized_faults(0..1, Some(Consistency::Snapshot)).await;
}

/// Writes, deletes, handoffs, crashes, member kills, resets and blackholes in a random order
/// (`AETHER_SEED` replays one); with `consistency`, a consumer reads the peer throughout.
async fn randomized_faults(rtt_ms: std::ops::Range<u64>, consistency: Option<Consistency>) {
    use rand::{Rng, SeedableRng};
    let seed: u64 = std::env::var("AETHER_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random);
    eprintln!("randomized fault test: AETHER_SEED={seed}");
    logs();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (origin, mut peer) = tokio::try_join!(EtcdServer::start("a"), EtcdCluster::start("b", 3)).unwrap();
    // Every peer member sits behind its own proxy.
    let mut proxies = Vec::new();
    for m in peer.members() {
        let proxy = FaultProxy::start(m.client_addr()).await.unwrap();
        proxy.set_rtt(Duration::from_millis(rng.random_range(rtt_ms.clone())));
        proxies.push(proxy);
    }
    let peer_target = EtcdTarget::plain(proxies.iter().map(|p| p.endpoint("http")));
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..500, "v0").await;
    // Keys the origin keeps for the whole run: no fault here outlasts the TTL, so the peer must
    // never delete one (a lapse of a live region).
    let stable = 1_000..1_100;
    write_keys(&mut o, "a", stable.clone(), "v0").await;
    let stable_deletes =
        count_deletes_of(peer.endpoints(), stable.clone().map(|i| endpoint_key("a", i).into_bytes()).collect()).await;
    let consumer = match consistency {
        Some(_) => Some(Consumer::watch(&o, &connect(&peer.endpoints(), None).await, "a").await),
        None => None,
    };
    let mut cfg = config("w0");
    cfg.max_txn_ops = 16;
    cfg.verify_interval = Duration::from_millis(300);
    let local = EtcdTarget::plain([origin.endpoint()]);
    let (mut handle, _e) = start(cfg.clone(), local.clone(), peer_target.clone());
    let mut down: Option<usize> = None;
    // The consumer's runs check the watch, not only the initial sync: the faults start once the
    // peer is synced, and hit the watch with writes in flight.
    if consistency.is_some() {
        wait_synced(&handle).await;
    }

    for round in 0..25 {
        match rng.random_range(0..10) {
            0 => {
                // A leader handoff or a crash of the worker.
                if rng.random_bool(0.5) {
                    handle.shutdown().await
                } else {
                    handle.abort()
                }
                cfg.owner_id = format!("w{round}");
                handle = start(cfg.clone(), local.clone(), peer_target.clone()).0;
            }
            1 => match down.take() {
                // One member at a time is down, so the peer keeps its quorum.
                Some(i) => peer.restart_member(i).await.unwrap(),
                None => {
                    let i = rng.random_range(0..3);
                    peer.kill_member(i);
                    down = Some(i);
                }
            },
            2 => proxies[rng.random_range(0..3)].reset_connections(),
            3 => {
                let proxy = &proxies[rng.random_range(0..3)];
                proxy.set_blackhole(true);
                tokio::time::sleep(Duration::from_millis(rng.random_range(100..1500))).await; // the outage
                proxy.set_blackhole(false);
            }
            _ => {
                for _ in 0..rng.random_range(1..40) {
                    let i = rng.random_range(0..600);
                    if rng.random_bool(0.1) {
                        let s = rng.random_range(stable.clone());
                        o.put(endpoint_key("a", s), endpoint_value("a", s, &format!("r{round}")), None).await.unwrap();
                    } else if rng.random_bool(0.25) {
                        o.delete(endpoint_key("a", i), None).await.unwrap();
                    } else {
                        o.put(endpoint_key("a", i), endpoint_value("a", i, &format!("r{round}")), None).await.unwrap();
                    }
                }
            }
        }
    }
    if let Some(i) = down {
        peer.restart_member(i).await.unwrap();
    }
    let p = connect(&peer.endpoints(), None).await;
    converged(&o, &p, "a", Duration::from_secs(120)).await;
    assert_eq!(stable_deletes.load(Ordering::SeqCst), 0, "a key the origin kept was deleted on the peer");
    if let (Some(consumer), Some(consistency)) = (consumer, consistency) {
        let seen = consumer
            .verdict(consistency)
            .await
            .unwrap_or_else(|e| panic!("a consumer of the peer saw {e} (AETHER_SEED={seed})"));
        assert!(seen.distinct_states > 1, "the consumer saw the copy move through too few states: {seen:?}");
        eprintln!("the consumer's reads: {seen:?}");
    }
    handle.shutdown().await;
}

#[tokio::test]
async fn a_peer_far_away_gets_batches_in_flight_together_and_a_crash_among_them_loses_nothing() {
    // New keys and overwrites of a few, fast, through 120 ms: several batches are in flight at
    // once. The worker crashes among them; its successor resumes from the progress record, which
    // never claims a batch that had not landed, and at rest says exactly what the peer holds.
    // The batches that landed past the record are not replayed one by one: a consumer reading
    // the peer throughout sees each hot key move forward only.
    let (origin, peer, proxy, mut o) = origin_and_far_peer(Duration::from_millis(120), 20).await;
    let far = || EtcdTarget::plain([proxy.endpoint("http")]);
    let (first, _e1) = start(config("w1"), EtcdTarget::plain([origin.endpoint()]), far());
    wait_synced(&first).await;
    let consumer = Consumer::watch(&o, &connect(&[peer.endpoint()], None).await, "a").await;
    let writer = {
        let o = o.clone();
        tokio::spawn(async move {
            use futures::StreamExt;
            let writes = futures::stream::iter(0..3000usize).map(|i| {
                let mut o = o.clone();
                // Every tenth write overwrites one of 20 hot keys.
                let (k, version) = if i % 10 == 0 { (i / 10 % 20, format!("hot{i}")) } else { (20 + i, "v1".into()) };
                async move { o.put(endpoint_key("a", k), endpoint_value("a", k, &version), None).await.map(|_| ()) }
            });
            writes.buffer_unordered(32).collect::<Vec<_>>().await
        })
    };
    wait_health(&first, "batches in flight together", |h| h.batches_in_flight_peak >= 2).await;
    first.abort();
    let (second, _e2) = start(patient_config("w2"), EtcdTarget::plain([origin.endpoint()]), far());
    for put in writer.await.unwrap() {
        put.unwrap();
    }
    let p = connect(&[peer.endpoint()], None).await;
    converged(&o, &p, "a", DEADLINE).await;
    let newest = o
        .get(
            keys::region_prefix("a"),
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_sort(etcd_client::SortTarget::Mod, etcd_client::SortOrder::Descend)
                    .with_limit(1),
            ),
        )
        .await
        .unwrap()
        .kvs()[0]
        .mod_revision();
    wait_until("the progress record at the origin's newest revision", DEADLINE, || {
        let mut p = p.clone();
        async move {
            let resp = p.get(keys::progress_key("a"), None).await?;
            let recorded = resp.kvs().first().and_then(|kv| mirror::records::checkpoint::Progress::decode(kv.value()));
            Ok(recorded.is_some_and(|r| r.revision == newest))
        }
    })
    .await
    .unwrap();
    assert_eq!(second.health().session_failures, 0, "{:?}", second.health());
    let seen = consumer.verdict(Consistency::PerKey).await.unwrap_or_else(|e| panic!("a consumer of the peer saw {e}"));
    assert!(seen.distinct_states > 1, "the consumer saw the copy move through too few states: {seen:?}");
    second.shutdown().await;
}

#[tokio::test]
async fn a_peer_far_away_gets_pipelined_batches_applied_in_order() {
    // Overwrites of few keys, fast: batches in flight together must still apply in order, or a
    // key would end with an older value.
    let (origin, peer, proxy, o) = origin_and_far_peer(Duration::from_millis(120), 20).await;
    let (handle, _e) = start(
        patient_config("w1"),
        EtcdTarget::plain([origin.endpoint()]),
        EtcdTarget::plain([proxy.endpoint("http")]),
    );
    wait_synced(&handle).await;
    let writers: Vec<_> = (0..8)
        .map(|w| {
            let mut o = o.clone();
            tokio::spawn(async move {
                for round in 0..60 {
                    let i = (w * 7 + round) % 20;
                    o.put(endpoint_key("a", i), endpoint_value("a", i, &format!("w{w}r{round}")), None).await.unwrap();
                }
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    let p = connect(&[peer.endpoint()], None).await;
    converged(&o, &p, "a", DEADLINE).await;
    let health = handle.health();
    assert!(health.txns < 480, "{} peer Txns for 480 origin writes", health.txns);
    assert_eq!(health.session_failures, 0, "{health:?}");
    handle.shutdown().await;
}

#[tokio::test]
async fn a_lease_layout_larger_than_one_request_is_checkpointed_in_parts_and_adopted() {
    // A layout of 1,024 shards records about 23 KB of lease ids; this peer takes requests of 16
    // KiB at most (1M keys at the least-privilege cap of 64 a lease make 1.6 MB, past etcd's
    // default 1.5 MiB). The checkpoint must still be written, and grow, and be adopted. Parts of
    // 64 shards (3 KB) let a split rewrite its parts in place within a request.
    let (origin, peer, mut o) = origin_and_peer_with(&["--max-request-bytes", "16384"], 1000).await;
    let mut cfg = config("w1");
    cfg.max_keys_per_lease = 2;
    cfg.max_txn_bytes = 12 << 10;
    cfg.checkpoint_shards_per_part = 64;
    let (first, _e1) = start_between(cfg.clone(), &origin, &peer);
    wait_synced(&first).await;
    let mut p = connect(&[peer.endpoint()], None).await;
    converged(&o, &p, "a", DEADLINE).await;

    // Growth splits shards online; each split records the grown layout.
    write_keys(&mut o, "a", 1000..1100, "v1").await;
    wait_health(&first, "shards split", |h| h.shard_splits > 0).await;
    converged(&o, &p, "a", DEADLINE).await;
    let leases = first.health().leases;
    assert!(leases > 1024, "{leases} leases after growth");
    wait_until("the grown layout is recorded", DEADLINE, || {
        let mut p = p.clone();
        async move { Ok(checkpoint(&mut p, "a").await.is_some_and(|c| c.leases.len() >= leases)) }
    })
    .await
    .unwrap();
    first.shutdown().await;
    let parts =
        p.get(keys::checkpoint_parts_prefix("a"), Some(etcd_client::GetOptions::new().with_prefix())).await.unwrap();
    assert!(parts.kvs().len() > 16, "{} parts for more than 1,024 shards", parts.kvs().len());
    assert!(parts.kvs().iter().any(|kv| kv.version() > 1), "a split rewrote a part in place");

    // A successor adopts the recorded layout instead of syncing anew.
    let recorded = recorded_leases(&mut p).await;
    cfg.owner_id = "w2".into();
    let (second, mut events) = start_between(cfg, &origin, &peer);
    let adopted = tokio::time::timeout(DEADLINE, async {
        while let Some(e) = events.recv().await {
            if let MirrorEvent::LeasesAdopted { leases, .. } = e {
                return Some(leases);
            }
        }
        None
    })
    .await
    .unwrap_or_else(|_| panic!("no LeasesAdopted event; health: {:?}", second.health()));
    assert_eq!(adopted, Some(recorded), "the successor adopts every recorded lease");
    wait_synced(&second).await;
    assert_eq!(second.health().resyncs, 0, "{:?}", second.health());
    write_keys(&mut o, "a", 0..10, "v2").await;
    converged(&o, &p, "a", DEADLINE).await;
    second.shutdown().await;
}

async fn recorded_leases(p: &mut Client) -> usize {
    checkpoint(p, "a").await.expect("checkpoint").leases.len()
}
