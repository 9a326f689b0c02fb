//! The promises over minutes, at the CRD defaults (TTL 30 s, keepalive 10 s, the detector's pause
//! twice the interval): partitions shorter than the TTL cost no key, tens of thousands of leases
//! on a three-member peer are renewed through its followers (or reported too slow to renew before
//! any lapses, through one follower at a short TTL), an idle federation neither reports a
//! healthy peer unreachable nor writes anything nor loses a connection, a partition is reported
//! once, a successor waiting its turn at a resync keeps the copy it inherits alive, and a quiet
//! connection is not closed by the etcd for its pings, and the peer's inbound view shows the copy
//! renewed, then gone a whole TTL after the origin's last renewal. These tests
//! mostly wait, so they run side by side (one binary, one thread each), beside the e2e.
mod support;

use aether_harness::{EtcdCluster, EtcdServer, FaultProxy};
use aether_operator::mirror::{EtcdTarget, MirrorConfig, MirrorEvent, Phase};
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
/// each adding a lease to the running keeper) while three TTLs pass. Every keeper round keeps
/// the renewal streams the layout needs open, those that renew only a split's new lease too.
async fn many_leases_through_followers_hold(cfg: MirrorConfig) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "aether_operator=info".into()))
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

    // The streams the synced layout needs (8 for 16,384 leases); the rounds watched from here.
    let needed = handle.health().leases.div_ceil(aether_operator::mirror::leases::renewal::LEASES_PER_STREAM);
    let rounds = rounds_seen(&handle);
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
    // Every round kept the streams the layout needs open, the rounds of a few leases a split's
    // new lease makes off the rounds' beat too (`keepalive.streams` said 1 after each before).
    let rounds = rounds.take();
    let longest = rounds.iter().map(|(_, rtt)| *rtt).fold(0.0, f64::max);
    assert!(
        rounds.iter().any(|(_, rtt)| *rtt * 10.0 < longest),
        "no round of a few leases while the region grew, so nothing here tests them: {rounds:?}"
    );
    let fewest = rounds.iter().map(|(streams, _)| *streams).min().unwrap_or(0);
    assert!(fewest >= needed, "a round said {fewest} stream(s) where the layout needs {needed}: {rounds:?}");
}

/// Each keeper round of `handle` from now on: the streams it said open, and its round trip in
/// seconds (`Rounds::take`).
fn rounds_seen(handle: &aether_operator::mirror::MirrorHandle) -> Rounds {
    let mut rx = handle.subscribe();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = seen.clone();
    let watcher = tokio::spawn(async move {
        let mut last = rx.borrow().keepalive_rounds;
        while rx.changed().await.is_ok() {
            let h = rx.borrow_and_update();
            if h.keepalive_rounds > last {
                last = h.keepalive_rounds;
                record.lock().unwrap().push((h.keepalive_streams, h.keepalive_rtts.back().copied().unwrap_or(0.0)));
            }
        }
    });
    Rounds { seen, watcher }
}

struct Rounds {
    seen: std::sync::Arc<std::sync::Mutex<Vec<(usize, f64)>>>,
    watcher: tokio::task::JoinHandle<()>,
}

impl Rounds {
    fn take(self) -> Vec<(usize, f64)> {
        self.watcher.abort();
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}

#[tokio::test]
#[ignore = "soak: minutes at the CRD defaults; `make test` runs it beside the other suites (hack/test.sh)"]
async fn sixteen_thousand_leases_through_followers_are_renewed_at_the_defaults() {
    let mut cfg = defaults("w1");
    cfg.max_keys_per_lease = 2;
    many_leases_through_followers_hold(cfg).await;
}

/// A layout too large for what one follower renews within a third of the TTL (how a cluster
/// behind a load balancer looks): 4,096 leases at the shortest TTL etcd grants (2 s; the same
/// leases a second as 16,384 at 6 s). The keeper spreads the renewals over streams, and if the
/// peer still cannot keep up, the shortfall is said (health and a `RenewalsTooSlow` event, with
/// the numbers) before any lease lapses.
#[tokio::test]
#[ignore = "soak: a peer renewing too slowly; `make test` runs it beside the other suites (hack/test.sh)"]
async fn a_layout_one_follower_cannot_renew_in_time_is_reported_before_any_lease_lapses() {
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdCluster::start("b", 3)).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..4_000, "v1").await;
    let leader = peer.leader().await.unwrap();
    let follower = peer.members()[(leader + 1) % 3].endpoint();
    let p = connect(&peer.endpoints(), None).await;
    let deletes = count_peer_deletes(&p, "a").await;
    let mut cfg = defaults("w1");
    cfg.max_keys_per_lease = 2;
    cfg.lease_ttl_seconds = 2;
    cfg.keepalive_interval = Duration::from_millis(600);
    cfg.acceptable_pause = Duration::from_millis(1200);
    let (handle, mut events) = start(cfg, EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain([follower]));
    // The deletes the peer had seen when the shortfall was first said.
    let said = {
        let (mut health, deletes) = (handle.subscribe(), deletes.clone());
        tokio::spawn(async move {
            let short = health.wait_for(|h| h.renewal_shortfall.is_some()).await.ok()?.renewal_shortfall;
            Some((deletes.load(Ordering::SeqCst), short))
        })
    };
    let is_lapse = |e: &MirrorEvent| match e {
        MirrorEvent::ResyncStarted { cause } => *cause == aether_operator::mirror::ResyncCause::LeaseLost,
        MirrorEvent::SessionFailed { message, .. } => message.contains("lease not found"),
        _ => false,
    };
    // Until it has renewed everything for ten TTLs, or something lapsed.
    let (mut seen, deadline) = (Vec::new(), Instant::now() + Duration::from_secs(300));
    let mut rounds_after_sync = None;
    loop {
        let h = handle.health();
        if h.synced && rounds_after_sync.is_none() {
            rounds_after_sync = Some(h.keepalive_rounds);
        }
        if rounds_after_sync.is_some_and(|r| h.keepalive_rounds >= r + 30) {
            break;
        }
        if deletes.load(Ordering::SeqCst) > 0 || seen.iter().any(is_lapse) {
            break;
        }
        assert!(Instant::now() < deadline, "neither renewed for ten TTLs nor lapsed: {h:?}");
        if let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(100), events.recv()).await {
            seen.push(e);
        }
    }
    let (lapsed, health) = (deletes.load(Ordering::SeqCst) > 0 || seen.iter().any(is_lapse), handle.health());
    if lapsed {
        let (deletes_then, short) = tokio::time::timeout(DEADLINE, said)
            .await
            .unwrap_or_else(|_| panic!("leases lapsed and no shortfall was ever said: {seen:?}; {health:?}"))
            .unwrap()
            .expect("the worker ended");
        assert_eq!(deletes_then, 0, "keys lapsed on the peer before the shortfall was said ({short:?})");
        // One channel carries both, in the order they happened.
        seen.extend(drain_events(&mut events));
        let said_at = seen.iter().position(|e| matches!(e, MirrorEvent::RenewalsTooSlow(_)));
        let lapsed_at = seen.iter().position(is_lapse);
        assert!(
            said_at.is_some_and(|s| lapsed_at.is_none_or(|l| s < l)),
            "the RenewalsTooSlow event did not come before the first lapse: {seen:?}"
        );
        // Said on the streams it had measured: a round projected past half the TTL is said at
        // once (no time is left to find out whether more streams help), so on a slow enough peer
        // the leases can lapse before a round on more streams ends.
        let short = short.expect("said");
        assert!(short.round > short.ttl / 3, "said without a shortfall: {short:?}");
        eprintln!("said before anything lapsed: {}", short.describe());
    } else {
        // 4,096 leases take at least two streams (2,048 a stream), and more at this rate.
        assert!(health.keepalive_streams > 1, "the renewals were not spread over streams: {health:?}");
        eprintln!("renewed in time through one follower, nothing lapsed: {health:?}");
    }
    handle.shutdown().await;
}

/// The etcd's revision now: it moves with every write.
async fn revision(c: &mut etcd_client::Client) -> i64 {
    c.status().await.expect("status").header().expect("header").revision()
}

#[tokio::test]
#[ignore = "soak: minutes at the CRD defaults; `make test` runs it beside the other suites (hack/test.sh)"]
async fn an_idle_federation_at_the_defaults_reports_no_unreachable_peer_writes_nothing_and_keeps_its_connections_for_ten_minutes()
 {
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..300, "v1").await;
    let mut p = connect(&[peer.endpoint()], None).await;
    let cfg = defaults("w1");
    assert_eq!(cfg.acceptable_pause, 2 * cfg.keepalive_interval, "the CRD's default pause");
    let (handle, mut events) = start(cfg, EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain([peer.endpoint()]));
    wait_synced(&handle).await;
    // Settle: the last batch's progress is recorded once everything has landed.
    converged(&o, &p, "a", DEADLINE).await;
    let rounds = handle.health().keepalive_rounds;
    wait_health(&handle, "a keepalive round after the sync", |h| h.keepalive_rounds > rounds).await;
    drain_events(&mut events);
    let (origin_before, peer_before) = (revision(&mut o).await, revision(&mut p).await);
    let ports = [origin.client_addr().port(), peer.client_addr().port()];
    let open_before = ports.map(client_connections);
    let idle = Duration::from_secs(600);
    tokio::time::sleep(idle).await; // the idle period itself: nothing may happen in it
    let seen = drain_events(&mut events);
    for (before, now) in open_before.iter().zip(ports.map(client_connections)) {
        let closed: Vec<&u16> = before.difference(&now).collect();
        assert!(closed.is_empty(), "connections closed while idle (by client port): {closed:?}; open now: {now:?}");
    }
    let flaps: Vec<&MirrorEvent> =
        seen.iter().filter(|e| matches!(e, MirrorEvent::RegionUnreachable | MirrorEvent::RegionReachable)).collect();
    assert!(flaps.is_empty(), "a healthy idle peer was reported unreachable: {flaps:?}");
    let slow: Vec<&MirrorEvent> = seen.iter().filter(|e| matches!(e, MirrorEvent::RenewalsTooSlow(_))).collect();
    assert!(slow.is_empty(), "a healthy idle peer was reported too slow to renew: {slow:?}");
    assert_eq!(revision(&mut o).await, origin_before, "the origin etcd was written while idle");
    assert_eq!(revision(&mut p).await, peer_before, "the peer etcd was written while idle: {seen:?}");
    let health = handle.health();
    assert!(health.reachable && health.phase == Phase::Watching, "{health:?}");
    assert!(health.renewal_shortfall.is_none(), "{health:?}");
    assert!(health.keepalive_rounds >= rounds + 50, "renewals went on: {health:?}");
    handle.shutdown().await;
}

#[tokio::test]
#[ignore = "soak: minutes at the CRD defaults; `make test` runs it beside the other suites (hack/test.sh)"]
async fn at_the_defaults_a_35s_partition_is_reported_unreachable_once_and_reachable_once() {
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..300, "v1").await;
    let p = connect(&[peer.endpoint()], None).await;
    let proxy = FaultProxy::start(peer.client_addr()).await.unwrap();
    let (handle, mut events) =
        start(defaults("w1"), EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain([proxy.endpoint("http")]));
    wait_synced(&handle).await;
    drain_events(&mut events);

    proxy.set_blackhole(true);
    tokio::time::sleep(Duration::from_secs(35)).await; // the partition itself
    proxy.reset_connections();
    proxy.set_blackhole(false);
    // Past the TTL the mirror lapsed on the peer; it comes back by a resync.
    converged(&o, &p, "a", DEADLINE).await;
    wait_health(&handle, "reachable again", |h| h.reachable).await;
    let rounds = handle.health().keepalive_rounds;
    wait_health(&handle, "renewals after the heal", |h| h.keepalive_rounds >= rounds + 2).await;
    let pairs: Vec<MirrorEvent> = drain_events(&mut events)
        .into_iter()
        .filter(|e| matches!(e, MirrorEvent::RegionUnreachable | MirrorEvent::RegionReachable))
        .collect();
    assert_eq!(pairs, vec![MirrorEvent::RegionUnreachable, MirrorEvent::RegionReachable], "{:?}", handle.health());
    handle.shutdown().await;
}

/// At the defaults, a successor that owes the peer a resync waits its turn among its origin's
/// full syncs for three TTLs: the leases of the copy it inherits are renewed all along (sampled
/// twice a second, never closer than a keepalive interval and a margin to lapsing), nothing is
/// deleted, and the copy is whole once its turn comes.
#[tokio::test]
#[ignore = "soak: minutes at the CRD defaults; `make test` runs it beside the other suites (hack/test.sh)"]
async fn at_the_defaults_a_successor_waiting_its_turn_at_a_resync_keeps_the_copy_alive() {
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..500, "v1").await;
    let mut p = connect(&[peer.endpoint()], None).await;
    let plain = |server: &EtcdServer| EtcdTarget::plain([server.endpoint()]);
    let (first, _e) = start(defaults("w1"), plain(&origin), plain(&peer));
    wait_synced(&first).await;
    first.shutdown().await;
    let mut leases: Vec<i64> =
        subtree(&mut p, &aether_operator::keys::region_prefix("a")).await.values().map(|(_, lease)| *lease).collect();
    leases.sort_unstable();
    leases.dedup();
    assert!(!leases.is_empty() && !leases.contains(&0), "the copy sits on leases: {leases:?}");
    // The records are damaged: the successor owes a resync.
    p.put(aether_operator::keys::checkpoint_key("a"), "{\"not\": \"a checkpoint\"", None).await.unwrap();
    let deletes = count_peer_deletes(&p, "a").await;

    let mut cfg = defaults("w2");
    cfg.sync_slots = std::sync::Arc::new(aether_operator::mirror::SyncSlots::new(1));
    let (ttl, interval) = (cfg.lease_ttl_seconds, cfg.keepalive_interval);
    // The origin's other peers hold its only turn.
    let others = cfg.sync_slots.try_take().expect("a free turn");
    let (second, _e) = start(cfg, plain(&origin), plain(&peer));
    wait_health(&second, "waits its turn", |h| h.phase == Phase::Queued).await;
    let queued = Instant::now();
    let mut lowest = i64::MAX;
    while queued.elapsed() < Duration::from_secs(3 * ttl as u64) {
        for lease in &leases {
            let left = p.lease_time_to_live(*lease, None).await.map(|r| r.ttl()).unwrap_or(-1);
            lowest = lowest.min(left);
        }
        tokio::time::sleep(Duration::from_millis(500)).await; // sampling the TTLs, not waiting on them
    }
    assert_eq!(second.health().phase, Phase::Queued, "synced without a turn: {:?}", second.health());
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "the copy lapsed while its successor waited for a turn");
    let margin = ttl - interval.as_secs() as i64 - 5;
    assert!(lowest >= margin, "a lease came within {lowest} s of lapsing while queued (renewed every {interval:?})");

    drop(others);
    wait_synced(&second).await;
    converged(&o, &p, "a", DEADLINE).await;
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "keys lapsed before the resync re-put them");
    second.shutdown().await;
}

/// etcd closes a connection its client pings with no call open on it (gRPC's keepalive policy,
/// which etcd does not relax: the third such ping, about 40 s into a quiet spell at a 10 s
/// interval, ends the connection, and a call sent meanwhile is refused "too_many_pings" or cut by
/// a broken pipe). The operator's connections ping every 10 s; a quiet minute must leave them open.
#[tokio::test]
#[ignore = "soak: minutes at the CRD defaults; `make test` runs it beside the other suites (hack/test.sh)"]
async fn a_connection_to_an_etcd_left_quiet_for_a_minute_stays_open() {
    let peer = EtcdServer::start("b").await.unwrap();
    let port = peer.client_addr().port();
    let before = client_connections(port);
    let mut client = EtcdTarget::plain([peer.endpoint()]).connect().await.expect("connect");
    client.get("k", None).await.expect("a first call");
    // The probes' connections close once they are dropped; the client's own stays.
    let started = Instant::now();
    let ours = loop {
        let new: Vec<u16> = client_connections(port).difference(&before).copied().collect();
        if new.len() == 1 || started.elapsed() > DEADLINE {
            break new;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(ours.len(), 1, "the client holds one connection to the etcd: {ours:?}");
    tokio::time::sleep(Duration::from_secs(60)).await; // the quiet spell itself: no call at all
    let now = client_connections(port);
    assert!(now.contains(&ours[0]), "the etcd closed the quiet connection {ours:?}; open now: {now:?}");
    client.get("k", None).await.expect("a call after the quiet minute");
}

/// The granted TTL of each lease the peer's checkpoint for region a records.
async fn recorded_granted_ttls(p: &mut etcd_client::Client) -> Vec<i64> {
    let leases = checkpoint(p, "a").await.map(|c| c.leases).unwrap_or_default();
    let mut ttls = Vec::new();
    for lease in leases {
        ttls.push(p.lease_time_to_live(lease, None).await.map_or(-1, |r| r.granted_ttl()));
    }
    ttls
}

/// Waits until every lease the checkpoint records was granted with `ttl` seconds.
async fn wait_recorded_ttl(p: &etcd_client::Client, ttl: i64, handle: &aether_operator::mirror::MirrorHandle) {
    aether_harness::wait_until(&format!("the copy on leases of {ttl} s"), Duration::from_secs(120), || {
        let mut p = p.clone();
        async move {
            let ttls = recorded_granted_ttls(&mut p).await;
            Ok(!ttls.is_empty() && ttls.iter().all(|t| *t == ttl))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}; health: {:?}", handle.health()));
}

#[tokio::test]
#[ignore = "soak: minutes at the CRD defaults; `make test` runs it beside the other suites (hack/test.sh)"]
async fn at_the_defaults_a_ttl_change_moves_the_copy_onto_leases_of_the_new_ttl_with_no_key_missing() {
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..2_000, "v1").await;
    let mut p = connect(&[peer.endpoint()], None).await;
    let proxy = FaultProxy::start(peer.client_addr()).await.unwrap();
    let (handle, _e) =
        start(defaults("w1"), EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain([proxy.endpoint("http")]));
    wait_synced(&handle).await;
    assert_eq!(recorded_granted_ttls(&mut p).await.iter().max(), Some(&30));
    let deletes = count_peer_deletes(&p, "a").await;

    // Raised to 60 s (keepalive 20 s): the successor adopts the 30 s leases, renews them by their
    // own TTL, and moves the copy onto 60 s leases.
    handle.shutdown().await;
    let mut raised = defaults("w2");
    (raised.lease_ttl_seconds, raised.keepalive_interval) = (60, Duration::from_secs(20));
    raised.acceptable_pause = Duration::from_secs(40);
    let (handle, _e) =
        start(raised, EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain([proxy.endpoint("http")]));
    wait_recorded_ttl(&p, 60, &handle).await;
    wait_health(&handle, "watching on the new leases, status by their TTL", |h| {
        h.synced && h.phase == Phase::Watching && h.lease_ttl_reported == Some(60)
    })
    .await;
    assert_eq!(handle.health().keys, 2_000);
    // A 35 s partition: inside the new TTL, outside the old one.
    partition_after_rounds(&handle, &proxy, Duration::from_secs(35), 1).await;
    converged(&o, &p, "a", DEADLINE).await;
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "keys lapsed after the TTL was raised");

    // Lowered to 12 s (keepalive 4 s): the copy moves onto 12 s leases, and a region that dies
    // lapses within 12 s, not the 60 s of the leases it had.
    handle.shutdown().await;
    let mut lowered = defaults("w3");
    (lowered.lease_ttl_seconds, lowered.keepalive_interval) = (12, Duration::from_secs(4));
    lowered.acceptable_pause = Duration::from_secs(8);
    let (handle, _e) = start(lowered, EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain([peer.endpoint()]));
    wait_recorded_ttl(&p, 12, &handle).await;
    wait_health(&handle, "watching on the 12 s leases", |h| h.synced && h.phase == Phase::Watching).await;
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "keys lapsed while the TTL was lowered");
    // The old 60 s leases hold nothing any more.
    let mut old_holding = 0;
    for (_, (_, lease)) in subtree(&mut p, &aether_operator::keys::region_prefix("a")).await {
        old_holding += usize::from(p.lease_time_to_live(lease, None).await.map_or(0, |r| r.granted_ttl()) != 12);
    }
    assert_eq!(old_holding, 0, "keys still on leases of another TTL");
    handle.abort();
    let died = Instant::now();
    aether_harness::wait_until("the dead region's copy lapses", Duration::from_secs(60), || {
        let mut p = p.clone();
        async move { Ok(subtree(&mut p, &aether_operator::keys::region_prefix("a")).await.is_empty()) }
    })
    .await
    .unwrap();
    assert!(died.elapsed() < Duration::from_secs(16), "lapsed {:?} after the region died (TTL 12 s)", died.elapsed());
}

/// At the defaults the peer's inbound view (the status's INBOUND, `aether_federation_inbound_*`)
/// reads the TTL left on the origin's canary lease: while the origin renews every 10 s it shows the
/// whole copy and a TTL never near its end, and once the origin stops renewing the copy stays whole
/// until the TTL it had left has run out, then the view shows it gone, with no partial state in
/// between.
#[tokio::test]
#[ignore = "soak: minutes at the CRD defaults; `make test` runs it beside the other suites (hack/test.sh)"]
async fn at_the_defaults_the_inbound_view_shows_the_copy_renewed_then_lapsed_a_whole_ttl_after_the_last_renewal() {
    use aether_operator::mirror::inbound;
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..200, "v1").await;
    let p = connect(&[peer.endpoint()], None).await;
    let cfg = defaults("w1");
    let (ttl, interval) = (cfg.lease_ttl_seconds, cfg.keepalive_interval);
    let (handle, _e) = start(cfg, EtcdTarget::plain([origin.endpoint()]), EtcdTarget::plain([peer.endpoint()]));
    wait_synced(&handle).await;
    converged(&o, &p, "a", DEADLINE).await;
    let view = |mut p: etcd_client::Client| async move {
        let seen = inbound::observe(&mut p, "b", &["a".to_string()]).await.expect("the inbound view");
        seen.into_iter().find(|i| i.origin == "a").expect("origin a listed")
    };

    // Longer than a TTL while the origin renews: the whole copy, and the TTL renewed each interval.
    let watched = Instant::now();
    let mut lowest = i64::MAX;
    while watched.elapsed() < Duration::from_secs(ttl as u64 + 15) {
        let a = view(p.clone()).await;
        assert!(a.synced && a.keys == 200, "a live origin's copy as the view shows it: {a:?}");
        lowest = lowest.min(a.lease_ttl_remaining.expect("the canary's lease"));
        tokio::time::sleep(Duration::from_millis(500)).await; // sampling the view, not waiting on it
    }
    let margin = ttl - interval.as_secs() as i64 - 5;
    assert!(lowest >= margin, "the view's TTL came within {lowest} s of lapsing (renewed every {interval:?})");

    // The origin stops renewing: the copy stays whole while its lease has time left, then goes.
    handle.abort();
    let stopped = Instant::now();
    let left = view(p.clone()).await.lease_ttl_remaining.expect("the canary's lease") as u64;
    let lapsed = loop {
        let a = view(p.clone()).await;
        if !a.synced && a.keys == 0 {
            break stopped.elapsed();
        }
        assert!(
            a.synced && a.keys == 200,
            "a state the origin never had, {:?} after it stopped: {a:?}",
            stopped.elapsed()
        );
        assert!(
            stopped.elapsed() < Duration::from_secs(ttl as u64 + 10),
            "not lapsed a whole TTL after the last renewal: {a:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await; // sampling the view, not waiting on it
    };
    eprintln!("lowest TTL seen while renewed {lowest} s; {left} s left when stopped, lapsed after {lapsed:?}");
    assert!(
        lapsed + Duration::from_secs(1) >= Duration::from_secs(left),
        "lapsed {lapsed:?} after the origin stopped, with {left} s of its TTL left"
    );
}
