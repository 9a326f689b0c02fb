//! The lease promise: a region's copy on a peer lapses only when the region stopped renewing it
//! for a whole TTL. Partitions shorter than the TTL, a handoff while the origin's etcd is away, a
//! split cut short, an unreadable checkpoint, a predecessor that changes the records while its
//! successor takes over, counts across sessions, a deleted peering, and records of another
//! format: none of them may delete a key whose origin key exists. (Tests that run for minutes,
//! at the CRD defaults and at scale, are in `soak.rs`.)
mod support;

use aether_harness::{EtcdServer, FaultProxy, wait_until};
use aether_operator::keys;
use aether_operator::mirror::leases::shards::Layout;
use aether_operator::mirror::{MirrorEvent, Phase};
use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use std::sync::atomic::Ordering;
use std::time::Duration;
use support::etcd::*;
use support::mirror::*;

async fn origin_and_peer(keys: usize) -> (EtcdServer, EtcdServer, Client, Client) {
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..keys, "v1").await;
    let p = connect(&[peer.endpoint()], None).await;
    (origin, peer, o, p)
}

async fn key_count(c: &mut Client, prefix: &str) -> i64 {
    c.get(prefix, Some(GetOptions::new().with_prefix().with_count_only())).await.map(|r| r.count()).unwrap_or(-1)
}

#[tokio::test]
async fn partitions_shorter_than_the_ttl_healed_with_reset_connections_delete_nothing() {
    let (origin, peer, o, p) = origin_and_peer(500).await;
    let proxy = FaultProxy::start(peer.client_addr()).await.unwrap();
    let cfg = fast_config("w1");
    let outage = Duration::from_secs(cfg.lease_ttl_seconds as u64 - 2);
    let (handle, _events) = start(cfg, plain(&origin), through(&proxy));
    wait_synced(&handle).await;
    let deletes = count_peer_deletes(&p, "a").await;
    let ttl = LowestTtl::watch(&p).await;

    partition_after_rounds(&handle, &proxy, outage, 3).await;
    converged(&o, &p, "a", DEADLINE).await;
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "a partition shorter than the TTL lapsed keys");
    // Renewed at once after each heal, not at the TTL's edge.
    assert!(ttl.lowest() >= 1, "the leases came within {} s of lapsing", ttl.lowest());
    assert_eq!(handle.health().resyncs, 0, "{:?}", handle.health());
    handle.shutdown().await;
}

#[tokio::test]
async fn a_handoff_while_the_origin_etcd_is_paused_deletes_nothing() {
    let (origin, peer, o, p) = origin_and_peer(500).await;
    let cfg = fast_config("w1");
    let outage = Duration::from_secs(cfg.lease_ttl_seconds as u64 + 2);
    let (first, _e) = start(cfg, plain(&origin), plain(&peer));
    wait_synced(&first).await;
    let deletes = count_peer_deletes(&p, "a").await;

    // The node running the origin's etcd member and the operator's leader is drained: the etcd
    // is away while the leader hands off.
    origin.pause();
    first.shutdown().await;
    let (second, _e) = start(fast_config("w2"), plain(&origin), plain(&peer));
    tokio::time::sleep(outage).await; // the origin's outage, longer than the TTL on purpose
    origin.resume();
    wait_synced(&second).await;
    converged(&o, &p, "a", DEADLINE).await;
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "the successor let the mirror lapse while the origin was away");
    second.shutdown().await;
}

#[tokio::test]
async fn a_split_cut_short_then_a_lower_cap_converges_without_panicking() {
    let (origin, peer, o, p) = origin_and_peer(2_000).await;
    let mut cfg = fast_config("w1");
    cfg.max_keys_per_lease = 1_000;
    let (first, _e) = start(cfg, plain(&origin), plain(&peer));
    wait_synced(&first).await;
    first.shutdown().await;
    let deletes = count_peer_deletes(&p, "a").await;

    // The cap drops (auth was detected, or a user lowered it); the first worker under the new cap
    // dies as soon as its first split has recorded a new lease.
    let mut cfg = fast_config("w2");
    cfg.max_keys_per_lease = 64;
    let (second, mut events) = start(cfg.clone(), plain(&origin), plain(&peer));
    wait_event(&mut events, "a lease granted by a split", |e| matches!(e, MirrorEvent::LeaseGranted { .. })).await;
    second.abort();

    cfg.owner_id = "w3".into();
    let (third, _e) = start(cfg, plain(&origin), plain(&peer));
    wait_placed_under_cap(&p, 64, &third).await;
    converged(&o, &p, "a", DEADLINE).await;
    assert!(!third.is_finished(), "the worker is alive: {:?}", third.health());
    assert_eq!(third.health().resyncs, 0, "splits, not a resync: {:?}", third.health());
    assert_eq!(deletes.load(Ordering::SeqCst), 0);
    third.shutdown().await;
}

/// An endpoint key of about 540 bytes: long, legal cluster and service names.
fn long_key(i: usize) -> String {
    format!(
        "{}clusters/{}-{}/services/{}-{}/protocols/tcp/endpoints/10.0.{}.{}",
        keys::region_prefix("a"),
        "c".repeat(220),
        i % 3,
        "s".repeat(240),
        i % 50,
        i / 250,
        i % 250
    )
}

async fn write_long_keys(o: &mut Client, range: std::ops::Range<usize>) {
    let all: Vec<usize> = range.collect();
    for chunk in all.chunks(100) {
        let ops: Vec<TxnOp> =
            chunk.iter().map(|i| TxnOp::put(long_key(*i), endpoint_value("a", *i, "v1"), None)).collect();
        o.txn(Txn::new().and_then(ops)).await.unwrap();
    }
}

#[tokio::test]
async fn a_shard_whose_listing_passes_4_mib_splits_without_failing_a_session() {
    let (origin, peer, mut o, p) = origin_and_peer(0).await;
    write_long_keys(&mut o, 0..4_000).await;
    let mut cfg = fast_config("w1");
    cfg.max_keys_per_lease = 9_000; // one lease for 4,000 keys
    let (handle, _e) = start(cfg, plain(&origin), plain(&peer));
    wait_synced(&handle).await;
    assert_eq!(handle.health().leases, 1, "{:?}", handle.health());

    // 9,100 keys of 540 bytes on one lease: listing it answers about 4.9 MB.
    write_long_keys(&mut o, 4_000..9_100).await;
    wait_placed_under_cap(&p, 9_000, &handle).await;
    converged(&o, &p, "a", DEADLINE).await;
    let health = handle.health();
    assert!(health.shard_splits >= 1, "{health:?}");
    assert_eq!(health.session_failures, 0, "{health:?}");
    handle.shutdown().await;
}

#[tokio::test]
async fn an_unreadable_checkpoint_keeps_the_leases_of_the_peers_keys_through_a_slow_resync() {
    let (origin, peer, o, mut p) = origin_and_peer(2_000).await;
    let (first, _e) = start(fast_config("w1"), plain(&origin), plain(&peer));
    wait_synced(&first).await;
    first.shutdown().await;
    p.put(keys::checkpoint_key("a"), "{\"not\": \"a checkpoint\"", None).await.unwrap();
    let deletes = count_peer_deletes(&p, "a").await;

    // The successor reaches the peer through a thin link: re-putting every key takes longer than
    // the TTL.
    let proxy = FaultProxy::start(peer.client_addr()).await.unwrap();
    proxy.set_bandwidth(Some(60_000));
    let mut cfg = fast_config("w2");
    // Small pages and Txns: each crosses the link in well under the pace's queue target (500
    // ms). The sync's pace reads the time a Txn takes beyond the peer's round trip as the peer's
    // queue, so Txns of 24 KB behind pages of 41 KB (0.7 s here) spaced the sync out to minutes.
    cfg.page_size = 20;
    cfg.max_txn_ops = 16;
    let (second, _e) = start(cfg, plain(&origin), through(&proxy));
    wait_synced(&second).await;
    proxy.set_bandwidth(None);
    converged(&o, &p, "a", DEADLINE).await;
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "keys lapsed before the resync re-put them");
    assert!(second.health().resyncs + 1 >= 1);
    second.shutdown().await;
}

/// A successor that owes the peer a full sync waits its turn among its origin's syncs (a mesh's
/// start, every peer at once) for longer than the TTL: the copy it inherits stays whole, because
/// it renews the recorded leases from before it waits, and the owner record stays the
/// predecessor's until its turn comes.
#[tokio::test]
async fn a_successor_waiting_its_turn_at_a_resync_keeps_the_copy_alive_past_the_ttl() {
    let (origin, peer, o, mut p) = origin_and_peer(500).await;
    let (first, _e) = start(fast_config("w1"), plain(&origin), plain(&peer));
    wait_synced(&first).await;
    first.shutdown().await;
    // The records are damaged: the successor owes a resync.
    p.put(keys::checkpoint_key("a"), "{\"not\": \"a checkpoint\"", None).await.unwrap();
    let deletes = count_peer_deletes(&p, "a").await;

    let mut cfg = fast_config("w2");
    cfg.sync_slots = std::sync::Arc::new(aether_operator::mirror::SyncSlots::new(1));
    let ttl = Duration::from_secs(cfg.lease_ttl_seconds as u64);
    // The origin's other peers hold its only turn.
    let others = cfg.sync_slots.try_take().expect("a free turn");
    let (second, _e) = start(cfg, plain(&origin), plain(&peer));
    wait_health(&second, "waits its turn", |h| h.phase == Phase::Queued).await;
    // Three TTLs in the queue: a copy nobody renewed would have lapsed twice over.
    tokio::time::sleep(ttl * 3).await; // on purpose: the time a lapse takes
    assert_eq!(second.health().phase, Phase::Queued, "synced without a turn: {:?}", second.health());
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "the copy lapsed while its successor waited for a turn");
    let owner = p.get(keys::owner_key("a"), None).await.unwrap();
    let record = String::from_utf8_lossy(owner.kvs().first().expect("an owner record").value()).to_string();
    assert!(record.contains("\"w1\""), "the successor took ownership before its turn: {record}");

    drop(others);
    wait_synced(&second).await;
    converged(&o, &p, "a", DEADLINE).await;
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "keys lapsed before the resync re-put them");
    second.shutdown().await;
}

/// The TTL the peer reports for `lease` now.
async fn ttl_of(p: &mut Client, lease: i64) -> i64 {
    p.lease_time_to_live(lease, None).await.map(|r| r.ttl()).unwrap_or(-1)
}

#[tokio::test]
async fn a_successor_never_adopts_records_its_predecessor_changed_after_they_were_read() {
    let (origin, peer, o, mut p) = origin_and_peer(2_000).await;
    let mut cfg = fast_config("w1");
    cfg.max_keys_per_lease = 10; // 512 leases: checking them across distance takes a while
    let (first, _e) = start(cfg.clone(), plain(&origin), plain(&peer));
    wait_synced(&first).await;
    first.shutdown().await;
    let recorded = checkpoint(&mut p, "a").await.expect("a checkpoint");
    let watched = recorded.leases[0];
    // The predecessor's fence: its Txns hold only while its owner record is the last written.
    let owner = p.get(keys::owner_key("a"), None).await.unwrap();
    let epoch = owner.kvs().first().expect("an owner record").mod_revision();
    let full = cfg.lease_ttl_seconds;
    // The predecessor's last renewal ages, so that the successor's first one shows.
    wait_until("the predecessor's renewal ages", DEADLINE, || {
        let mut p = p.clone();
        async move { Ok(ttl_of(&mut p, watched).await < full - 1) }
    })
    .await
    .unwrap();
    let deletes = count_peer_deletes(&p, "a").await;

    let proxy = FaultProxy::start(peer.client_addr()).await.unwrap();
    proxy.set_rtt(Duration::from_millis(200));
    cfg.owner_id = "w2".into();
    let (second, _e) = start(cfg.clone(), plain(&origin), through(&proxy));
    // The successor has read the records once it renews them.
    wait_until("the successor renews the recorded leases", DEADLINE, || {
        let mut p = p.clone();
        async move { Ok(ttl_of(&mut p, watched).await >= full - 1) }
    })
    .await
    .unwrap();
    // Meanwhile the predecessor, still running and still the owner, splits a shard: a new lease,
    // recorded, and some of the shard's keys moved onto it, in a Txn fenced like its own. It then
    // sees its successor and stops renewing. The successor's next messages (the renewals'
    // answers, its ownership Txn) are held meanwhile, so that it has read the records before
    // the change and takes ownership after it, however busy the machine.
    proxy.set_blackhole(true);
    let lease = p.lease_grant(full, None).await.unwrap().id();
    let mut layout = Layout::recorded(&recorded.slots, recorded.leases.len());
    let new_shard = layout.split(1).expect("a shard at depth 9 splits");
    let moved: Vec<(Vec<u8>, Vec<u8>)> = subtree(&mut p, &keys::region_prefix("a"))
        .await
        .into_iter()
        .filter(|(k, _)| layout.shard_of(k) == new_shard)
        .map(|(k, (v, _))| (k, v))
        .collect();
    let mut changed = recorded.clone();
    changed.leases.push(lease);
    changed.slots = layout.slots().to_vec();
    changed.keys[1] -= moved.len() as i64;
    changed.keys.push(moved.len() as i64);
    let mut ops: Vec<TxnOp> = vec![TxnOp::put(keys::checkpoint_key("a"), changed.encode(), None)];
    ops.extend(moved.iter().map(|(k, v)| TxnOp::put(k.clone(), v.clone(), Some(PutOptions::new().with_lease(lease)))));
    let fence = Compare::mod_revision(keys::owner_key("a"), CompareOp::Equal, epoch);
    let split = p.txn(Txn::new().when([fence]).and_then(ops)).await.unwrap();
    proxy.set_blackhole(false);
    assert!(split.succeeded(), "the successor took ownership before the predecessor's split: no change after the read");
    assert!(!moved.is_empty());

    wait_synced(&second).await;
    // Outlive the predecessor's lease: only the successor can keep it alive now.
    tokio::time::sleep(Duration::from_secs(full as u64 + 2)).await; // one TTL and a margin, on purpose
    assert_eq!(
        deletes.load(Ordering::SeqCst),
        0,
        "keys on the lease the predecessor recorded lapsed: the successor never kept it alive"
    );
    converged(&o, &p, "a", DEADLINE).await;
    second.shutdown().await;
}

#[tokio::test]
async fn shard_counts_survive_sessions_so_no_lease_passes_the_cap() {
    let (origin, peer, mut o, p) = origin_and_peer(60).await;
    let origin_proxy = FaultProxy::start(origin.client_addr()).await.unwrap();
    let mut cfg = fast_config("w1");
    cfg.max_keys_per_lease = 100; // two shards of about 30 keys
    let (handle, _e) = start(cfg, through(&origin_proxy), plain(&peer));
    wait_synced(&handle).await;
    // Each session adds about 20 keys a shard, then ends.
    for round in 0..6 {
        write_keys(&mut o, "a", 60 + round * 40..100 + round * 40, "v1").await;
        converged(&o, &p, "a", DEADLINE).await;
        let failures = handle.health().session_failures;
        origin_proxy.reset_connections();
        wait_health(&handle, "the session ended", |h| h.session_failures > failures).await;
        wait_synced(&handle).await;
    }
    wait_placed_under_cap(&p, 100, &handle).await;
    handle.shutdown().await;
}

#[tokio::test]
async fn a_deleted_peering_is_not_brought_back_by_a_deposed_worker_standing_by() {
    let (origin, peer, mut o, mut p) = origin_and_peer(200).await;
    let peering = object("a");
    let cfg = claim("deposed", &peering, "b");
    let (deposed, _e) = start(cfg.clone(), plain(&origin), plain(&peer));
    wait_synced(&deposed).await;
    let (current, _e) = start(claim("current", &peering, "b"), plain(&origin), plain(&peer));
    wait_synced(&current).await;
    write_keys(&mut o, "a", 0..10, "v2").await;
    wait_health(&deposed, "the deposed worker stands by", |h| h.phase == Phase::Fenced).await;

    // The RegionPeering is deleted with deletionPolicy Delete: its worker stops, the mirror goes.
    current.shutdown().await;
    let retired = aether_operator::mirror::retire::retire(
        &plain(&peer),
        "a",
        aether_operator::mirror::retire::RetirePolicy::Delete,
        &peering,
    )
    .await
    .unwrap();
    assert!(matches!(retired, aether_operator::mirror::retire::Retired::Deleted { .. }), "{retired:?}");
    write_keys(&mut o, "a", 0..10, "v3").await;
    // Longer than the deposed worker's patience and a TTL: it must not take the mirror back.
    tokio::time::sleep(Duration::from_secs(3 * cfg.lease_ttl_seconds as u64)).await; // the observation window
    assert_eq!(key_count(&mut p, &keys::region_prefix("a")).await, 0, "health: {:?}", deposed.health());
    assert_ne!(deposed.health().phase, Phase::Watching, "{:?}", deposed.health());
    deposed.shutdown().await;
}

/// The records as the released format wrote them (no format version): the checkpoint, the
/// progress record and the owner record of a mirror with `leases`, synced at `revision`.
fn released_format_records(leases: &[i64], counts: &[i64], revision: i64, cluster: u64) -> [(String, String); 3] {
    let checkpoint = serde_json::json!({
        "owner": "w1", "revision": revision, "leases": leases, "keys": counts,
        "synced": true, "retiring": [], "originClusterId": cluster,
    });
    let progress = format!(r#"{{"rev":"{revision:020}","owner":"w1","revision":{revision}}}"#);
    let owner = r#"{"owner":"w1","acquiredAt":"2026-11-01T00:00:00Z","generation":1}"#.to_string();
    [
        (keys::checkpoint_key("a"), checkpoint.to_string()),
        (keys::progress_key("a"), progress),
        (keys::owner_key("a"), owner),
    ]
}

#[tokio::test]
async fn records_of_the_released_format_are_adopted_without_a_resync() {
    let (origin, peer, o, mut p) = origin_and_peer(300).await;
    let (first, _e) = start(fast_config("w1"), plain(&origin), plain(&peer));
    wait_synced(&first).await;
    let revision = first.health().last_applied_revision;
    first.shutdown().await;
    let cp = checkpoint(&mut p, "a").await.unwrap();
    for (key, value) in released_format_records(&cp.leases, &cp.keys, revision, cp.origin_cluster_id) {
        p.put(key, value, None).await.unwrap();
    }
    let (second, mut events) = start(fast_config("w2"), plain(&origin), plain(&peer));
    wait_synced(&second).await;
    let seen = drain_events(&mut events);
    assert!(seen.iter().any(|e| matches!(e, MirrorEvent::LeasesAdopted { .. })), "{seen:?}");
    assert!(!seen.iter().any(|e| matches!(e, MirrorEvent::ResyncStarted { .. })), "{seen:?}");
    converged(&o, &p, "a", DEADLINE).await;
    second.shutdown().await;
}

#[tokio::test]
async fn records_of_a_newer_format_are_resynced_under_new_leases_and_nothing_lapses() {
    let (origin, peer, o, mut p) = origin_and_peer(300).await;
    let (first, _e) = start(fast_config("w1"), plain(&origin), plain(&peer));
    wait_synced(&first).await;
    first.shutdown().await;
    let old = checkpoint(&mut p, "a").await.unwrap();
    // A later version wrote the checkpoint: same fields, and a format this version does not know.
    let raw = p.get(keys::checkpoint_key("a"), None).await.unwrap();
    let mut newer: serde_json::Value = serde_json::from_slice(raw.kvs()[0].value()).unwrap();
    newer["format"] = serde_json::json!(99);
    p.put(keys::checkpoint_key("a"), newer.to_string(), None).await.unwrap();
    let deletes = count_peer_deletes(&p, "a").await;

    let (second, mut events) = start(fast_config("w2"), plain(&origin), plain(&peer));
    wait_event(&mut events, "a resync", |e| matches!(e, MirrorEvent::ResyncStarted { .. })).await;
    wait_synced(&second).await;
    converged(&o, &p, "a", DEADLINE).await;
    let now = checkpoint(&mut p, "a").await.unwrap();
    assert!(now.leases.iter().all(|l| !old.leases.contains(l)), "new leases: {:?} vs {:?}", now.leases, old.leases);
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "nothing lapsed while the resync ran");
    second.shutdown().await;
}

#[tokio::test]
async fn a_wiped_peer_is_taken_back_at_once_and_the_resync_is_counted_with_its_cause() {
    let (origin, peer, mut o, mut p) = origin_and_peer(300).await;
    // The defaults' keepalive interval (10 s): standing by must not wait for it.
    let mut cfg = aether_operator::mirror::MirrorConfig::new("a", "b", "w1");
    cfg.backoff_cap = Duration::from_secs(2);
    let interval = cfg.keepalive_interval;
    let (handle, _e) = start(cfg, plain(&origin), plain(&peer));
    wait_synced(&handle).await;

    // Someone wipes the peer (or restores it from before the mirror); then the origin changes.
    p.delete("/aether/v1/", Some(etcd_client::DeleteOptions::new().with_prefix())).await.unwrap();
    let wiped = std::time::Instant::now();
    write_keys(&mut o, "a", 0..10, "v2").await;
    converged(&o, &p, "a", DEADLINE).await;
    let took = wiped.elapsed();
    assert!(took < interval / 2, "the mirror came back {took:?} after the wipe, not at once");
    let health = handle.health();
    assert_eq!(health.resyncs, 1, "{health:?}");
    assert_eq!(health.resyncs_by_cause.get("records_lost"), Some(&1), "{health:?}");
    handle.shutdown().await;
}

/// A peer that answers a round's renewals slowly but steadily (a narrow link, a busy member) for
/// longer than the acceptable pause is reachable: the failure detector hears of the answers as
/// they come, not only at the end of the round. Before, such a peer was reported unreachable
/// (a `RegionUnreachable` event and alert) at every long round while nothing was wrong.
#[tokio::test]
async fn a_long_round_the_peer_keeps_answering_is_not_an_unreachable_peer() {
    let (origin, peer, _o, _p) = origin_and_peer(2_000).await;
    let proxy = FaultProxy::start(peer.client_addr()).await.unwrap();
    let mut cfg = fast_config("w1");
    cfg.max_keys_per_lease = 2;
    cfg.lease_ttl_seconds = 15;
    cfg.keepalive_interval = Duration::from_millis(500);
    // Four intervals: between two rounds the peer is asked nothing for an interval, and the
    // proxy holds each read back for its whole transfer time, so a round's first answers come
    // after the renewals' bytes pass (a pause of 1.5 intervals was missed on a loaded machine).
    cfg.acceptable_pause = Duration::from_secs(2);
    cfg.verify_interval = Duration::ZERO;
    let pause = cfg.acceptable_pause.as_secs_f64();
    let (handle, mut events) = start(cfg, plain(&origin), through(&proxy));
    wait_synced(&handle).await;
    drain_events(&mut events);
    // About 1,000 renewals a round through a narrow link: rounds of about 2.5 s.
    proxy.set_bandwidth(Some(56_000));
    let mut rounds = handle.health().keepalive_rounds;
    let mut rx = handle.subscribe();
    let (mut unreachable_seen, mut long_rounds) = (false, 0);
    // Three rounds longer than the acceptable pause (rounds of a split's few leases are short).
    tokio::time::timeout(DEADLINE, async {
        while long_rounds < 3 {
            rx.changed().await.expect("worker alive");
            let h = rx.borrow_and_update().clone();
            unreachable_seen |= !h.reachable;
            if h.keepalive_rounds > rounds {
                rounds = h.keepalive_rounds;
                long_rounds += usize::from(h.keepalive_rtts.back().is_some_and(|s| *s > pause));
            }
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!("three rounds longer than the pause: {long_rounds} in {DEADLINE:?}; {:?}", handle.health())
    });
    assert!(!unreachable_seen, "a peer answering a long round was reported unreachable");
    let said: Vec<_> =
        drain_events(&mut events).into_iter().filter(|e| matches!(e, MirrorEvent::RegionUnreachable)).collect();
    assert!(said.is_empty(), "{said:?}");
    handle.shutdown().await;
}

/// The streams the renewals use stay open from round to round. A split grants its new lease off
/// the rounds' beat, and the round that renews it alone a few moments later is a round of one
/// lease: it uses one stream and closes none. Before, such a round closed the others, for the
/// next full round to open them again, and the health, the status (`keepalive.streams`) and the
/// metric said 1 stream for a layout that needs 2 (a soak test read it so in a CI run).
#[tokio::test]
async fn rounds_of_a_few_leases_keep_every_renewal_stream_open() {
    let (origin, peer, mut o, _p) = origin_and_peer(2_000).await;
    let mut cfg = fast_config("w1");
    // 2,048 shards, a lease each (`shard_count` keeps shards at half the cap); the splits that
    // follow make more: at least two streams (2,048 leases a stream).
    cfg.max_keys_per_lease = 2;
    cfg.lease_ttl_seconds = 15;
    cfg.keepalive_interval = Duration::from_millis(500);
    cfg.verify_interval = Duration::ZERO;
    let (handle, _events) = start(cfg, plain(&origin), plain(&peer));
    wait_synced(&handle).await;
    wait_health(&handle, "a round over the whole layout", |h| h.keepalive_streams >= 2).await;
    // More keys: more shards past the cap of 2, split one at a time while the rounds go on.
    write_keys(&mut o, "a", 2_000..2_600, "v1").await;
    let mut rx = handle.subscribe();
    let (mut rounds, mut seen, mut fewest) = (rx.borrow().keepalive_rounds, Vec::new(), usize::MAX);
    // A round of one lease answers in a few milliseconds; one of 2,000 in tens of them or more.
    let a_short_one = |seen: &[f64]| seen.iter().any(|s| *s * 10.0 < seen.iter().copied().fold(0.0, f64::max));
    // Thirty rounds, and on until one of them renewed a few leases: how often that happens is the
    // machine's to say (under load, with etcd 3.4, thirty rounds in a row renewed every lease).
    tokio::time::timeout(DEADLINE, async {
        while seen.len() < 30 || !a_short_one(&seen) {
            rx.changed().await.expect("worker alive");
            let h = rx.borrow_and_update().clone();
            if h.keepalive_rounds > rounds {
                rounds = h.keepalive_rounds;
                fewest = fewest.min(h.keepalive_streams);
                seen.extend(h.keepalive_rtts.back().copied());
            }
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "no round of a few leases, or fewer than 30 rounds, in {DEADLINE:?}: the test proves nothing; \
             rounds took {seen:?} s; {:?}",
            handle.health()
        )
    });
    let health = handle.health();
    assert!(health.shard_splits > 0, "no split happened, so no round of a few leases: {health:?}");
    let leases = health.leases;
    assert!(fewest >= 2, "a round said {fewest} stream(s) for {leases} leases; rounds took {seen:?} s");
    handle.shutdown().await;
}

/// Authentications the etcd member has answered, whatever the outcome (its gRPC metrics).
fn authentications(etcd: &EtcdServer) -> u64 {
    etcd.metrics()
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("grpc_server_handled_total{") && l.contains("grpc_method=\"Authenticate\""))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum::<f64>() as u64
}

#[tokio::test]
async fn a_password_rotated_on_the_peer_costs_it_a_few_authentications_not_a_storm() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "aether_operator=info".into()))
        .with_test_writer()
        .try_init();
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..100, "v1").await;
    let mut admin = connect(&[peer.endpoint()], None).await;
    enable_auth_with_mirror_user(&mut admin, "a", "mirrorpw").await;
    let target = aether_operator::mirror::EtcdTarget::plain([peer.endpoint()]).with_user("mirror-a", "mirrorpw");
    let mut config = fast_config("w1");
    config.backoff_cap = Duration::from_secs(30); // production's: the storm is about what it retries
    let (handle, _e) = start(config, plain(&origin), target);
    wait_synced(&handle).await;

    // The password is changed on the peer, and the worker still has the old one.
    let options = etcd_client::ConnectOptions::new().with_user("root", "rootpw");
    let mut root = connect(&[peer.endpoint()], Some(options)).await;
    root.user_change_password("mirror-a", "rotated").await.unwrap();
    // Seen by the keeper, or first by a session: a keepalive stream opened before the change may
    // go on renewing over its token for a while (on a loaded machine, past 90 s).
    wait_health(&handle, "the refusal seen", |h| {
        h.keepalive_failures > 0 || h.last_error.as_deref().is_some_and(|e| e.contains("refused user mirror-a"))
    })
    .await;
    let before = authentications(&peer);
    tokio::time::sleep(Duration::from_secs(20)).await; // the window the attempts are counted in
    let attempts = authentications(&peer) - before;
    eprintln!("{attempts} authentications in 20 s with the password refused");
    // The keeper backs off to 10 s, the sessions to their cap: a storm would be dozens a second.
    assert!(attempts <= 20, "{attempts} authentications in 20 s: the refused password is retried in a storm");
    handle.shutdown().await;
}
