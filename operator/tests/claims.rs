//! A user's mistake never deletes or lapses a live region's data: a duplicate claim on a region is
//! refused (naming both sides) and takes nothing over while the owner's leases live; a peer that
//! is the origin itself, or one etcd listed under two peer names, is refused before anything is
//! written; retiring a mirror retires only what the retiring object owns; a clean stop hands the
//! mirror over before anything lapses; a dropped handle stops its worker.
mod support;

use aether_harness::{EtcdServer, FaultProxy, wait_until};
use aether_operator::keys;
use aether_operator::mirror::retire::{RetirePolicy, Retired, retire};
use aether_operator::mirror::{MirrorEvent, OwningObject, Phase};
use etcd_client::{Client, GetOptions};
use std::sync::atomic::Ordering;
use std::time::Duration;
use support::etcd::*;
use support::mirror::*;

async fn key_count(c: &mut Client, prefix: &str) -> i64 {
    c.get(prefix, Some(GetOptions::new().with_prefix().with_count_only())).await.map(|r| r.count()).unwrap_or(-1)
}

async fn revision(c: &mut Client) -> i64 {
    c.get("/", None).await.unwrap().header().unwrap().revision()
}

async fn wait_refused(handle: &aether_operator::mirror::MirrorHandle, reason: &str) -> String {
    wait_health(handle, &format!("refused with {reason}"), |h| {
        h.phase == Phase::Refused && h.refusal.as_ref().is_some_and(|r| r.reason == reason)
    })
    .await;
    handle.health().refusal.unwrap().message
}

/// Region a's etcd holding `keys` endpoint keys, a peer etcd b, and clients of both.
async fn origin_and_peer(keys: usize) -> (EtcdServer, EtcdServer, Client, Client) {
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).unwrap();
    let (mut o, p) = (connect(&[origin.endpoint()], None).await, connect(&[peer.endpoint()], None).await);
    write_keys(&mut o, "a", 0..keys, "v1").await;
    (origin, peer, o, p)
}

#[tokio::test]
async fn retiring_as_another_object_touches_nothing_of_the_live_owner() {
    let (origin, peer, mut o, mut p) = origin_and_peer(300).await;
    let owner = object("a");
    let (handle, _events) = start(claim("w1", &owner, "b"), plain(&origin), plain(&peer));
    wait_synced(&handle).await;

    // The refused duplicate (another object) is deleted with deletionPolicy Delete, and a third
    // with Lapse: neither owns the mirror, so neither retires anything.
    for policy in [RetirePolicy::Delete, RetirePolicy::Lapse] {
        let retired = retire(&plain(&peer), "a", policy, &object("a-duplicate")).await.unwrap();
        assert!(matches!(&retired, Retired::NotOurs { owner } if owner.contains("aether-system/a ")), "{retired:?}");
    }
    assert_eq!(key_count(&mut p, &keys::region_prefix("a")).await, 300);
    write_keys(&mut o, "a", 300..301, "v1").await;
    converged(&o, &p, "a", DEADLINE).await;
    // Three TTLs later the owner still writes and keeps its leases.
    let ttl = LowestTtl::watch(&p).await;
    let deletes = count_peer_deletes(&p, "a").await;
    tokio::time::sleep(Duration::from_secs(3 * 6)).await; // the observation window
    assert!(ttl.lowest() > 0, "a lease came within {} s of lapsing", ttl.lowest());
    assert_eq!(deletes.load(Ordering::SeqCst), 0);
    assert_eq!(handle.health().phase, Phase::Watching, "{:?}", handle.health());

    // The owner's own deletion retires it.
    handle.shutdown().await;
    let retired = retire(&plain(&peer), "a", RetirePolicy::Delete, &owner).await.unwrap();
    assert_eq!(retired, Retired::Deleted { keys: 301 });
}

#[tokio::test]
async fn a_peer_that_is_the_origin_itself_is_refused_before_anything_is_written() {
    let origin = EtcdServer::start("a").await.unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..200, "v1").await;
    let before = revision(&mut o).await;
    // The same etcd under another address: what a peer's endpoint pointing back at the region's
    // own etcd looks like.
    let same_etcd = FaultProxy::start(origin.client_addr()).await.unwrap();
    let (handle, mut events) = start(claim("w1", &object("a"), "b"), plain(&origin), through(&same_etcd));
    let message = wait_refused(&handle, "PeerIsOrigin").await;
    assert!(message.contains("peer b") && message.contains("region a's own etcd"), "{message}");
    wait_event(&mut events, "a Refused event", |e| matches!(e, MirrorEvent::Refused(r) if r.reason == "PeerIsOrigin"))
        .await;
    // Looked again after an interval: still refused, and still nothing written.
    let failures = handle.health().session_failures;
    tokio::time::sleep(Duration::from_secs(3)).await; // the observation window: a keepalive interval and more
    assert_eq!(revision(&mut o).await, before, "the worker wrote into the region's own etcd");
    assert_eq!(handle.health().session_failures, failures, "a refusal is not a failing session");
    let registry = subtree(&mut o, &keys::region_prefix("a")).await;
    assert_eq!(registry.len(), 200);
    assert!(registry.values().all(|(_, lease)| *lease == 0), "a registrar's key was moved onto a lease");
    handle.shutdown().await;
    assert_eq!(key_count(&mut o, &keys::region_prefix("a")).await, 200);
}

/// Region etcds deployed from the same manifests (one member name, one peer URL, the default
/// token) share a cluster id; the peer is another etcd all the same, told apart by a lease, and
/// mirrored into: a cluster id alone must not refuse it as the origin.
#[tokio::test]
async fn a_peer_bootstrapped_like_the_origin_shares_its_cluster_id_and_is_still_mirrored_into() {
    let same = [
        "--name",
        "registry-etcd-0",
        "--initial-advertise-peer-urls",
        "http://10.255.0.1:2380",
        "--initial-cluster",
        "registry-etcd-0=http://10.255.0.1:2380",
    ];
    let flavor = aether_harness::EtcdFlavor::from_env();
    let (origin, peer) =
        tokio::try_join!(EtcdServer::start_with("a", flavor, &same), EtcdServer::start_with("b", flavor, &same))
            .unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    let mut p = connect(&[peer.endpoint()], None).await;
    let cluster_id = |s: etcd_client::StatusResponse| s.header().unwrap().cluster_id();
    let ids = (cluster_id(o.status().await.unwrap()), cluster_id(p.status().await.unwrap()));
    assert_eq!(ids.0, ids.1, "the two etcds were meant to share a cluster id");
    write_keys(&mut o, "a", 0..100, "v1").await;
    let (handle, _events) = start(claim("w1", &object("a"), "b"), plain(&origin), plain(&peer));
    wait_synced(&handle).await;
    converged(&o, &p, "a", DEADLINE).await;
    assert!(handle.health().refusal.is_none(), "{:?}", handle.health());
    handle.shutdown().await;
}

#[tokio::test]
async fn a_second_origin_claiming_the_region_is_refused_and_never_takes_the_peer_over_while_the_first_lives() {
    let (first, second, peer) =
        tokio::try_join!(EtcdServer::start("a1"), EtcdServer::start("a2"), EtcdServer::start("b")).unwrap();
    let mut o1 = connect(&[first.endpoint()], None).await;
    let mut o2 = connect(&[second.endpoint()], None).await;
    let p = connect(&[peer.endpoint()], None).await;
    write_keys(&mut o1, "a", 0..300, "first").await;
    write_keys(&mut o2, "a", 1000..1100, "second").await;
    let east = object("a");
    let west = OwningObject { cluster: "west".into(), ..object("a-west") };
    let (w1, _e1) = start(claim("east-1", &east, "b"), plain(&first), plain(&peer));
    wait_synced(&w1).await;
    let deletes = count_peer_deletes(&p, "a").await;

    let (w2, mut e2) = start(claim("west-1", &west, "b"), plain(&second), plain(&peer));
    let message = wait_refused(&w2, "DuplicateOrigin").await;
    for named in ["aether-system/a ", "uid-a", "east", "aether-system/a-west"] {
        assert!(message.contains(named), "{named} not named in: {message}");
    }
    wait_event(&mut e2, "a Refused event", |e| matches!(e, MirrorEvent::Refused(r) if r.reason == "DuplicateOrigin"))
        .await;

    // The first restarts (a roll: a clean stop, a new worker of the same object): it takes its
    // mirror back at once, and the second stays refused throughout.
    w1.shutdown().await;
    let (w1, _e1) = start(claim("east-2", &east, "b"), plain(&first), plain(&peer));
    wait_synced(&w1).await;
    write_keys(&mut o1, "a", 300..301, "first").await;
    converged(&o1, &p, "a", DEADLINE).await;
    tokio::time::sleep(Duration::from_secs(3)).await; // the observation window: the second looks again
    assert_eq!(w2.health().phase, Phase::Refused, "{:?}", w2.health());
    assert_eq!(w1.health().phase, Phase::Watching, "{:?}", w1.health());
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "the peer's copy of the first origin lost keys");
    converged(&o1, &p, "a", DEADLINE).await;

    // The first region dies (no clean stop): only once its leases have lapsed does the second
    // take the peer over.
    w1.abort();
    wait_synced(&w2).await;
    converged(&o2, &p, "a", DEADLINE).await;
    assert!(w2.health().refusal.is_none());
    w2.shutdown().await;
}

#[tokio::test]
async fn one_etcd_under_two_peer_names_is_refused_for_the_second_name() {
    let (origin, peer, mut o, p) = origin_and_peer(100).await;
    let a = object("a");
    let (as_b, _eb) = start(claim("w-b", &a, "b"), plain(&origin), plain(&peer));
    wait_synced(&as_b).await;
    let epoch = owner_epoch(&p).await;
    let also_b = FaultProxy::start(peer.client_addr()).await.unwrap();
    let (as_c, _ec) = start(claim("w-c", &a, "c"), plain(&origin), through(&also_b));
    let message = wait_refused(&as_c, "DuplicatePeer").await;
    assert!(message.contains("peers b and c"), "{message}");
    write_keys(&mut o, "a", 100..101, "v1").await;
    converged(&o, &p, "a", DEADLINE).await;
    assert_eq!(owner_epoch(&p).await, epoch, "the second name took the mirror over");
    assert_eq!(as_b.health().phase, Phase::Watching);
    as_c.shutdown().await;
    as_b.shutdown().await;
}

async fn owner_epoch(p: &Client) -> i64 {
    let owner = p.clone().get(keys::owner_key("a"), None).await.unwrap();
    owner.kvs().first().map_or(0, |kv| kv.mod_revision())
}

/// Two workers of one RegionPeering: `current` took the mirror over (200 keys, 10 rewritten),
/// `deposed` stands by; the peer's deletes and its leases' lowest TTL are watched from then on.
struct Standby {
    _servers: (EtcdServer, EtcdServer),
    o: Client,
    p: Client,
    deposed: aether_operator::mirror::MirrorHandle,
    current: aether_operator::mirror::MirrorHandle,
    deletes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ttl: LowestTtl,
}

async fn standing_by() -> Standby {
    let (origin, peer, mut o, p) = origin_and_peer(200).await;
    let a = object("a");
    let (deposed, _ed) = start(claim("deposed", &a, "b"), plain(&origin), plain(&peer));
    wait_synced(&deposed).await;
    let (current, _ec) = start(claim("current", &a, "b"), plain(&origin), plain(&peer));
    wait_synced(&current).await;
    write_keys(&mut o, "a", 0..10, "v2").await;
    wait_health(&deposed, "the deposed worker stands by", |h| h.phase == Phase::Fenced).await;
    let deletes = count_peer_deletes(&p, "a").await;
    let ttl = LowestTtl::watch(&p).await;
    Standby { _servers: (origin, peer), o, p, deposed, current, deletes, ttl }
}

#[tokio::test]
async fn a_successor_that_stops_cleanly_hands_over_to_the_worker_standing_by_before_anything_lapses() {
    let Standby { _servers, mut o, p, deposed, current, deletes, ttl } = standing_by().await;

    // The successor stops cleanly: the one standing by takes over before a TTL passes.
    current.shutdown().await;
    let stopped = std::time::Instant::now();
    wait_health_for(&deposed, "the worker standing by resumes", Duration::from_secs(6), |h| {
        h.phase == Phase::Watching && h.synced
    })
    .await;
    eprintln!("took over {:?} after the successor's clean stop", stopped.elapsed());
    write_keys(&mut o, "a", 200..201, "v1").await;
    converged(&o, &p, "a", DEADLINE).await;
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "keys lapsed in the handover");
    assert!(ttl.lowest() > 0, "a lease came within {} s of lapsing", ttl.lowest());
    deposed.shutdown().await;
}

#[tokio::test]
async fn a_successor_that_dies_is_replaced_by_the_worker_standing_by_before_its_leases_lapse() {
    let Standby { _servers, o, p, deposed, current, deletes, ttl } = standing_by().await;

    current.abort();
    wait_health(&deposed, "the worker standing by resumes", |h| h.phase == Phase::Watching && h.synced).await;
    converged(&o, &p, "a", DEADLINE).await;
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "keys lapsed before the worker standing by took over");
    // Taken over with time to spare, not in the last second of the TTL.
    assert!(ttl.lowest() >= 1, "the leases came within {} s of lapsing", ttl.lowest());
    deposed.shutdown().await;
}

#[tokio::test]
async fn a_dropped_handle_stops_its_worker() {
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).unwrap();
    let mut o = connect(&[origin.endpoint()], None).await;
    write_keys(&mut o, "a", 0..10, "v1").await;
    let (handle, _events) = start(claim("w1", &object("a"), "b"), plain(&origin), plain(&peer));
    wait_synced(&handle).await;
    let mut health = handle.subscribe();
    drop(handle);
    tokio::time::timeout(DEADLINE, health.wait_for(|h| h.phase == Phase::Stopped))
        .await
        .expect("the worker of a dropped handle stops")
        .ok();
    let p = connect(&[peer.endpoint()], None).await;
    wait_until("the released owner record", DEADLINE, || {
        let p = p.clone();
        async move {
            let owner = p.clone().get(keys::owner_key("a"), None).await?;
            let record = owner
                .kvs()
                .first()
                .and_then(|kv| aether_operator::mirror::records::checkpoint::Owner::decode(kv.value()));
            Ok(record.is_some_and(|r| r.released))
        }
    })
    .await
    .unwrap();
}

/// The same at the CRD defaults (TTL 30 s, keepalive 10 s): the worker standing by looks every
/// 5 s once its successor shows itself and takes over with about half the TTL left.
#[tokio::test]
async fn at_the_defaults_a_successor_that_dies_is_replaced_with_time_to_spare() {
    let (origin, peer, mut o, p) = origin_and_peer(200).await;
    let a = object("a");
    let at_defaults = |owner: &str| {
        let mut c = aether_operator::mirror::MirrorConfig::new("a", "b", owner);
        c.object = Some(a.clone());
        c
    };
    let (deposed, _ed) = start(at_defaults("deposed"), plain(&origin), plain(&peer));
    wait_synced(&deposed).await;
    let (current, _ec) = start(at_defaults("current"), plain(&origin), plain(&peer));
    wait_synced(&current).await;
    write_keys(&mut o, "a", 0..10, "v2").await;
    wait_health(&deposed, "the deposed worker stands by", |h| h.phase == Phase::Fenced).await;
    let deletes = count_peer_deletes(&p, "a").await;
    let ttl = LowestTtl::watch(&p).await;

    current.abort();
    wait_health(&deposed, "the worker standing by resumes", |h| h.phase == Phase::Watching && h.synced).await;
    converged(&o, &p, "a", DEADLINE).await;
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "keys lapsed before the worker standing by took over");
    assert!(ttl.lowest() >= 5, "the leases came within {} s of their 30 s lapsing", ttl.lowest());
    deposed.shutdown().await;
}
