//! The mirror against real etcd servers: sync, watch, pruning, compaction, lease expiry, handoff,
//! fencing, faults, least privilege, and a randomized run. `AETHER_ETCD=3.4` runs it on 3.4.
mod support;

use aether_harness::{EtcdServer, FaultProxy, wait_until};
use aether_operator::keys;
use aether_operator::mirror::{self, EtcdTarget, MirrorConfig, MirrorEvent, MirrorHandle, Phase};
use etcd_client::{Client, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use support::etcd::{endpoint_key, endpoint_value, subtree, values, write_keys};
use tokio::sync::mpsc;

const DEADLINE: Duration = Duration::from_secs(60);

fn config(owner: &str) -> MirrorConfig {
    let mut c = MirrorConfig::new("a", "b", owner);
    c.lease_ttl_seconds = 4;
    c.keepalive_interval = Duration::from_secs(1);
    c.backoff_base = Duration::from_millis(50);
    c.backoff_cap = Duration::from_secs(1);
    c.rpc_timeout = Duration::from_secs(3);
    c.acceptable_pause = Duration::from_secs(2);
    c.progress_interval = Duration::from_millis(500);
    c.page_size = 500;
    c
}

struct Pair {
    origin: EtcdServer,
    peer: EtcdServer,
}

async fn pair() -> Pair {
    let (origin, peer) = tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b")).expect("etcd starts");
    Pair { origin, peer }
}

async fn client(etcd: &EtcdServer) -> Client {
    Client::connect([etcd.endpoint()], None).await.expect("connect")
}

fn start(config: MirrorConfig, pair: &Pair) -> (MirrorHandle, mpsc::Receiver<MirrorEvent>) {
    let (tx, rx) = mpsc::channel(1024);
    let handle = mirror::spawn(
        config,
        EtcdTarget::plain([pair.origin.endpoint()]),
        EtcdTarget::plain([pair.peer.endpoint()]),
        tx,
    );
    (handle, rx)
}

/// Waits until the peer's copy of the origin's subtree equals the origin's.
async fn converged(pair: &Pair) {
    let (mut o, mut p) = (client(&pair.origin).await, client(&pair.peer).await);
    let prefix = keys::region_prefix("a");
    wait_until("peer == origin", DEADLINE, || {
        let (mut o, mut p, prefix) = (o.clone(), p.clone(), prefix.clone());
        async move { Ok(values(&mut o, &prefix).await == values(&mut p, &prefix).await) }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    // Keep the clients used so that the borrow checker sees them live until here.
    let _ = (o.status().await, p.status().await);
}

async fn wait_phase(handle: &MirrorHandle, phase: Phase) {
    let mut rx = handle.subscribe();
    tokio::time::timeout(DEADLINE, rx.wait_for(|h| h.phase == phase))
        .await
        .unwrap_or_else(|_| panic!("phase {phase:?} not reached; health: {:?}", handle.health()))
        .expect("worker alive");
}

async fn wait_synced(handle: &MirrorHandle) {
    let mut rx = handle.subscribe();
    tokio::time::timeout(DEADLINE, rx.wait_for(|h| h.synced && h.phase == Phase::Watching))
        .await
        .unwrap_or_else(|_| panic!("not synced; health: {:?}", handle.health()))
        .expect("worker alive");
}

/// A burst that reaches the worker all at once (the origin's answers held on the way, then
/// released) is read in runs, and no revision is lost between runs. Verification is off, so
/// nothing else would bring a lost one back.
#[tokio::test]
async fn a_burst_arriving_at_once_is_applied_whole_with_verification_off() {
    use futures::StreamExt;
    let pair = pair().await;
    let proxy = FaultProxy::start(pair.origin.client_addr()).await.expect("proxy starts");
    let mut cfg = config("w1");
    cfg.verify_interval = Duration::ZERO;
    let (tx, _events) = mpsc::channel(1024);
    let handle =
        mirror::spawn(cfg, EtcdTarget::plain([proxy.endpoint("http")]), EtcdTarget::plain([pair.peer.endpoint()]), tx);
    wait_synced(&handle).await;
    // 5,000 single-key revisions (one watch response each) while the origin's answers are held.
    proxy.set_blackhole(true);
    let origin = client(&pair.origin).await;
    let written: Vec<_> = futures::stream::iter(0..5_000)
        .map(|i| {
            let mut c = origin.clone();
            async move { c.put(endpoint_key("a", i), endpoint_value("a", i, "burst"), None).await }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    assert!(written.iter().all(Result::is_ok), "the origin took every write");
    proxy.set_blackhole(false);
    converged(&pair).await;
    handle.shutdown().await;
}

/// The leases a worker's checkpoint names on the peer.
async fn checkpoint_leases(peer: &mut Client) -> Vec<i64> {
    let resp = peer.get(keys::checkpoint_key("a"), None).await.expect("get checkpoint");
    let cp = mirror::records::checkpoint::Checkpoint::decode(resp.kvs()[0].value()).expect("checkpoint decodes");
    cp.leases
}

#[tokio::test]
async fn sync_spans_pages_and_source_revisions_arrive_whole() {
    let pair = pair().await;
    let mut origin = client(&pair.origin).await;
    let mut peer = client(&pair.peer).await;
    write_keys(&mut origin, "a", 0..5200, "v1").await;

    let mut cfg = config("w1");
    cfg.page_size = 300;
    cfg.max_keys_per_lease = 1000;
    // The peer is paused below for as long as 200 origin Txns take: 4 s in a crowded run, when the
    // leases (at the suite's 4 s TTL) lapsed on it and the resync rewrote every key page by page.
    // At the CRD's TTL the pause is far inside it, and the copy's atomicity is what is measured.
    cfg.lease_ttl_seconds = 30;
    let (handle, _events) = start(cfg, &pair);
    wait_synced(&handle).await;
    converged(&pair).await;
    let peer_keys = subtree(&mut peer, &keys::region_prefix("a")).await;
    assert_eq!(peer_keys.len(), 5200);
    let leases = checkpoint_leases(&mut peer).await;
    assert!(leases.len() > 1, "5200 keys with at most 1000 a lease need several leases");
    assert!(
        peer_keys.values().all(|(_, lease)| leases.contains(lease)),
        "every key carries one of the worker's leases"
    );
    assert!(peer.get(keys::canary_key("a"), None).await.unwrap().count() == 1, "the sync canary is written");

    // Record every peer revision's events under the mirrored prefix.
    let start_rev = peer.status().await.unwrap().header().unwrap().revision() + 1;
    let mut watch = peer
        .watch(keys::region_prefix("a"), Some(WatchOptions::new().with_prefix().with_start_revision(start_rev)))
        .await
        .unwrap();

    // Multi-key origin Txns, each tagged with its own version, plus deletes, written while the
    // peer answers nothing (a stalled member): they pile up behind the batch in flight, and must
    // then land together. A peer that keeps pace would take them one by one, which is fine, so
    // the pause is what makes coalescing observable rather than a matter of timing.
    pair.peer.pause();
    for t in 0..200usize {
        let members: Vec<usize> = (0..5).map(|j| (t * 37 + j * 1009) % 5200).collect();
        let mut ops: Vec<TxnOp> = members
            .iter()
            .map(|i| TxnOp::put(endpoint_key("a", *i), endpoint_value("a", *i, &format!("t{t}")), None))
            .collect();
        if t % 10 == 0 {
            ops.push(TxnOp::delete(endpoint_key("a", 5000 + t / 10), None));
        }
        origin.txn(Txn::new().and_then(ops)).await.unwrap();
    }
    pair.peer.resume();
    converged(&pair).await;

    // Group the peer's events by peer revision: every origin Txn's keys land in one peer revision.
    let mut txn_revisions: HashMap<String, std::collections::HashSet<i64>> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = 0;
    while seen < 200 * 5 && Instant::now() < deadline {
        let Ok(Ok(Some(resp))) = tokio::time::timeout(Duration::from_secs(5), watch.message()).await else { break };
        for event in resp.events() {
            let kv = event.kv().unwrap();
            if event.event_type() == EventType::Put {
                let value = String::from_utf8_lossy(kv.value()).to_string();
                if let Some(tag) = value.split("\"version\":\"").nth(1).and_then(|r| r.split('"').next())
                    && tag.starts_with('t')
                {
                    seen += 1;
                    txn_revisions.entry(tag.to_string()).or_default().insert(kv.mod_revision());
                }
            }
        }
    }
    assert!(!txn_revisions.is_empty());
    assert_eq!(handle.health().resyncs, 0, "no full sync rewrote the copy meanwhile: {:?}", handle.health());
    for (tag, revisions) in &txn_revisions {
        assert_eq!(revisions.len(), 1, "origin txn {tag} was split across peer revisions {revisions:?}");
    }
    let health = handle.health();
    assert!(health.txns < 50, "revisions that piled up are coalesced: {} peer txns for 200 origin txns", health.txns);
    assert_eq!(
        health.keys,
        key_count(&mut peer, &keys::region_prefix("a")).await,
        "the reported key count is the peer's"
    );
    handle.shutdown().await;
}

#[tokio::test]
async fn stale_peer_keys_are_pruned_and_nothing_else_is_touched() {
    let pair = pair().await;
    let mut origin = client(&pair.origin).await;
    let mut peer = client(&pair.peer).await;
    write_keys(&mut origin, "a", 0..50, "v1").await;
    // On the peer: a stale copy of a's subtree, the peer's own keys, another origin's mirror.
    write_keys(&mut peer, "a", 40..80, "old").await;
    write_keys(&mut peer, "b", 0..30, "own").await;
    write_keys(&mut peer, "c", 0..30, "mirrored").await;
    peer.put("/aether/services/legacy/protocols/tcp/endpoints/1.1.1.1", "x", None).await.unwrap();
    // Keys that share a's prefix as a string but belong to another region.
    peer.put("/aether/v1/regions/ab/clusters/c/services/s/protocols/tcp/endpoints/1.1.1.1", "ab", None).await.unwrap();
    let before_b = values(&mut peer, &keys::region_prefix("b")).await;
    let before_c = values(&mut peer, &keys::region_prefix("c")).await;

    let (handle, _events) = start(config("w1"), &pair);
    wait_synced(&handle).await;
    converged(&pair).await;
    assert_eq!(values(&mut peer, &keys::region_prefix("b")).await, before_b);
    assert_eq!(values(&mut peer, &keys::region_prefix("c")).await, before_c);
    assert_eq!(peer.get("/aether/services/", Some(GetOptions::new().with_prefix())).await.unwrap().count(), 1);
    assert_eq!(peer.get(keys::region_prefix("ab"), Some(GetOptions::new().with_prefix())).await.unwrap().count(), 1);
    // The origin's subtree on the peer is a's exactly: the 10 keys beyond 50 are gone.
    assert_eq!(values(&mut peer, &keys::region_prefix("a")).await.len(), 50);
    handle.shutdown().await;
}

#[tokio::test]
async fn compaction_while_disconnected_leads_to_a_resync() {
    let pair = pair().await;
    let mut origin = client(&pair.origin).await;
    write_keys(&mut origin, "a", 0..100, "v1").await;
    let (first, _e) = start(config("w1"), &pair);
    wait_synced(&first).await;
    first.shutdown().await;

    // While no worker runs: changes, then a compaction past them.
    write_keys(&mut origin, "a", 50..150, "v2").await;
    origin.delete(endpoint_key("a", 3), None).await.unwrap();
    let rev = origin.status().await.unwrap().header().unwrap().revision();
    origin.compact(rev, None).await.unwrap();

    // The successor adopts the checkpoint, finds its revision compacted, and resyncs.
    let (second, mut events) = start(config("w2"), &pair);
    converged(&pair).await;
    wait_synced(&second).await;
    let mut saw_compaction = false;
    while let Ok(event) = events.try_recv() {
        saw_compaction |= event == MirrorEvent::ResyncStarted { cause: mirror::ResyncCause::Compacted };
    }
    assert!(saw_compaction, "a ResyncStarted event names the compaction");
    assert_eq!(second.health().resyncs, 1);
    second.shutdown().await;
}

async fn key_count(c: &mut Client, prefix: &str) -> i64 {
    c.get(prefix, Some(GetOptions::new().with_prefix().with_count_only())).await.map(|r| r.count()).unwrap_or(-1)
}

/// Polls until the origin's mirror is gone from the peer; returns how long that took.
async fn time_until_mirror_lapses(peer: &Client) -> Duration {
    let start = Instant::now();
    let prefix = keys::region_prefix("a");
    wait_until("mirror lapses", DEADLINE, || {
        let (mut p, prefix) = (peer.clone(), prefix.clone());
        async move { Ok(key_count(&mut p, &prefix).await == 0) }
    })
    .await
    .unwrap();
    start.elapsed()
}

#[tokio::test]
async fn a_crashed_worker_and_a_stopped_one_both_let_the_mirror_lapse_with_the_ttl() {
    let pair = pair().await;
    let mut origin = client(&pair.origin).await;
    let peer = client(&pair.peer).await;
    write_keys(&mut origin, "a", 0..200, "v1").await;
    let cfg = config("w1");
    let ttl = Duration::from_secs(cfg.lease_ttl_seconds as u64);
    let interval = cfg.keepalive_interval;

    // A crash: no further request of any kind.
    let (handle, _e) = start(cfg.clone(), &pair);
    wait_synced(&handle).await;
    handle.abort();
    let lapsed = time_until_mirror_lapses(&peer).await;
    assert!(lapsed <= ttl + interval + Duration::from_secs(4), "crash: lapsed after {lapsed:?}");

    // A clean shutdown: no revoke, so nothing disappears before the TTL.
    let (handle, _e) = start(config("w2"), &pair);
    wait_synced(&handle).await;
    handle.shutdown().await;
    let lapsed = time_until_mirror_lapses(&peer).await;
    assert!(lapsed + interval >= ttl, "clean shutdown: keys vanished after {lapsed:?}, before the TTL of {ttl:?}");
    assert!(lapsed <= ttl + interval + Duration::from_secs(4), "clean shutdown: lapsed after {lapsed:?}");
}

#[tokio::test]
async fn a_successor_adopts_the_leases_and_resumes_without_reputting() {
    let pair = pair().await;
    let mut origin = client(&pair.origin).await;
    let mut peer = client(&pair.peer).await;
    write_keys(&mut origin, "a", 0..1000, "v1").await;
    let (first, _e) = start(config("leader-1"), &pair);
    wait_synced(&first).await;
    let leases_before = checkpoint_leases(&mut peer).await;

    let rev = peer.status().await.unwrap().header().unwrap().revision() + 1;
    let mut watch = peer
        .watch(keys::region_prefix("a"), Some(WatchOptions::new().with_prefix().with_start_revision(rev)))
        .await
        .unwrap();

    // Leader handoff: the old one stops (no revoke), a new one starts within the TTL.
    first.shutdown().await;
    let (second, mut events) = start(config("leader-2"), &pair);
    wait_phase(&second, Phase::Watching).await;
    let adopted = tokio::time::timeout(DEADLINE, async {
        loop {
            match events.recv().await {
                Some(MirrorEvent::LeasesAdopted { .. }) => return true,
                Some(MirrorEvent::ResyncStarted { .. }) | None => return false,
                _ => {}
            }
        }
    })
    .await
    .unwrap();
    assert!(adopted, "the successor adopts the leases instead of resyncing");
    assert_eq!(checkpoint_leases(&mut peer).await, leases_before);

    // Outlive the old keepalives: the successor keeps the adopted leases alive.
    tokio::time::sleep(Duration::from_secs(6)).await; // longer than the 4 s TTL, on purpose
    origin.put(endpoint_key("a", 5000), endpoint_value("a", 5000, "new"), None).await.unwrap();
    converged(&pair).await;
    assert_eq!(key_count(&mut peer, &keys::region_prefix("a")).await, 1001);

    // The peer saw exactly one write under the prefix (the new key), no re-put and no delete.
    let mut writes = Vec::new();
    while let Ok(Ok(Some(resp))) = tokio::time::timeout(Duration::from_millis(500), watch.message()).await {
        writes.extend(resp.events().iter().map(|e| (e.event_type(), e.kv().unwrap().key().to_vec())));
    }
    assert_eq!(writes, vec![(EventType::Put, endpoint_key("a", 5000).into_bytes())]);
    second.shutdown().await;
}

#[tokio::test]
async fn a_successor_reports_the_exact_key_count_where_the_checkpoint_counted_fewer() {
    let pair = pair().await;
    let mut origin = client(&pair.origin).await;
    let mut peer = client(&pair.peer).await;
    write_keys(&mut origin, "a", 0..100, "v1").await;
    let (first, _e) = start(config("leader-1"), &pair);
    wait_synced(&first).await;
    // Fewer changes than a shard may drift before its count is recorded (an eighth of the cap of
    // 1,000): the checkpoint keeps the sync's count of 100.
    write_keys(&mut origin, "a", 100..140, "v1").await;
    for i in 0..10 {
        origin.delete(endpoint_key("a", i), None).await.unwrap();
    }
    converged(&pair).await;
    let mut health = first.subscribe();
    tokio::time::timeout(DEADLINE, health.wait_for(|h| h.keys == 130))
        .await
        .unwrap_or_else(|_| panic!("the first worker counts 130 keys; it says {}", first.health().keys))
        .unwrap();
    first.shutdown().await;

    let (second, _e2) = start(config("leader-2"), &pair);
    wait_phase(&second, Phase::Watching).await;
    let mut health = second.subscribe();
    // Not holding the health's read guard: the worker writes it.
    let exact = tokio::time::timeout(DEADLINE, health.wait_for(|h| h.keys == 130)).await.is_ok_and(|r| r.is_ok());
    assert!(
        exact,
        "the successor reports {} keys; the peer holds {}",
        second.health().keys,
        key_count(&mut peer, &keys::region_prefix("a")).await
    );
    second.shutdown().await;
}

#[tokio::test]
async fn of_two_workers_for_one_pair_only_the_newer_writes() {
    let pair = pair().await;
    let mut origin = client(&pair.origin).await;
    let mut peer = client(&pair.peer).await;
    write_keys(&mut origin, "a", 0..100, "v1").await;
    let (old, mut old_events) = start(config("deposed"), &pair);
    wait_synced(&old).await;
    let (new, _e) = start(config("current"), &pair);
    wait_synced(&new).await;

    // The next origin write reaches both; only the owner may apply it.
    origin.put(endpoint_key("a", 7), endpoint_value("a", 7, "after-handoff"), None).await.unwrap();
    wait_phase(&old, Phase::Fenced).await;
    converged(&pair).await;
    let mut fenced_by = None;
    while let Ok(event) = old_events.try_recv() {
        if let MirrorEvent::Fenced { by } = event {
            fenced_by = Some(by);
        }
    }
    assert_eq!(fenced_by.as_deref(), Some("current"));
    let owner = peer.get(keys::owner_key("a"), None).await.unwrap();
    assert!(String::from_utf8_lossy(owner.kvs()[0].value()).contains("current"));
    assert_eq!(new.health().phase, Phase::Watching);
    old.shutdown().await;
    new.shutdown().await;
}

#[tokio::test]
async fn the_mirror_recovers_from_peer_and_origin_restarts_and_lost_leases() {
    let mut pair = pair().await;
    let mut origin = client(&pair.origin).await;
    write_keys(&mut origin, "a", 0..300, "v1").await;
    let (handle, mut events) = start(config("w1"), &pair);
    wait_synced(&handle).await;

    // The peer dies hard and comes back.
    pair.peer.kill();
    write_keys(&mut origin, "a", 0..20, "while-peer-down").await;
    pair.peer.restart().await.unwrap();
    converged(&pair).await;

    // The origin restarts.
    pair.origin.stop();
    pair.origin.restart().await.unwrap();
    let mut origin = client(&pair.origin).await;
    write_keys(&mut origin, "a", 300..320, "after-origin-restart").await;
    converged(&pair).await;
    let health = handle.health();
    assert!(health.session_failures > 0, "the outages were counted");
    assert_eq!(health.last_error, None, "the error clears once the mirror applies again");

    // A lease disappears (an operator revoked it, or it expired while the peer was away).
    let mut peer = client(&pair.peer).await;
    let lost = checkpoint_leases(&mut peer).await[0];
    peer.lease_revoke(lost).await.unwrap();
    wait_until("new lease", DEADLINE, || {
        let mut p = peer.clone();
        async move { Ok(!checkpoint_leases(&mut p).await.contains(&lost)) }
    })
    .await
    .unwrap();
    converged(&pair).await;
    let leases = checkpoint_leases(&mut peer).await;
    assert!(subtree(&mut peer, &keys::region_prefix("a")).await.values().all(|(_, l)| leases.contains(l)));
    let mut saw = (false, false);
    while let Ok(event) = events.try_recv() {
        match event {
            MirrorEvent::ResyncStarted { cause: mirror::ResyncCause::LeaseLost } => saw.0 = true,
            MirrorEvent::LeasesGranted { .. } => saw.1 = true,
            _ => {}
        }
    }
    assert!(saw.0 && saw.1, "lease loss leads to a new lease and a resync: {saw:?}");
    handle.shutdown().await;
}

#[tokio::test]
async fn least_privilege_role_suffices_and_confines_the_mirror() {
    let pair = pair().await;
    let mut origin = client(&pair.origin).await;
    write_keys(&mut origin, "a", 0..100, "v1").await;

    // hack/etcd-mirror-role.sh does the same with etcdctl.
    let mut admin = client(&pair.peer).await;
    admin.user_add("root", "rootpw", None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.role_add("mirror-a").await.unwrap();
    for prefix in [keys::region_prefix("a"), keys::federation_prefix("a")] {
        let perm = etcd_client::Permission::read_write(prefix.as_str()).with_prefix();
        admin.role_grant_permission("mirror-a", perm).await.unwrap();
    }
    admin.user_add("mirror-a", "mirrorpw", None).await.unwrap();
    admin.user_grant_role("mirror-a", "mirror-a").await.unwrap();
    admin.auth_enable().await.unwrap();

    let peer_target = EtcdTarget::plain([pair.peer.endpoint()]).with_user("mirror-a", "mirrorpw");
    let (tx, _rx) = mpsc::channel(64);
    let handle = mirror::spawn(config("w1"), EtcdTarget::plain([pair.origin.endpoint()]), peer_target.clone(), tx);
    wait_synced(&handle).await;
    let mut root =
        Client::connect([pair.peer.endpoint()], Some(etcd_client::ConnectOptions::new().with_user("root", "rootpw")))
            .await
            .unwrap();
    assert_eq!(key_count(&mut root, &keys::region_prefix("a")).await, 100);

    let mut confined = peer_target.connect().await.unwrap();
    let refused = confined.put(endpoint_key("b", 1), "x", None).await;
    assert!(refused.is_err_and(|e| e.to_string().contains("permission denied")));
    handle.shutdown().await;
}

#[tokio::test]
async fn randomized_writes_and_restarts_converge() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = std::env::var("AETHER_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random);
    eprintln!("randomized mirror test: AETHER_SEED={seed}");
    // The workers' logs go with the test's output, shown when it fails.
    let _ = tracing_subscriber::fmt()
        .with_env_filter("aether_operator=debug")
        .with_test_writer()
        .with_ansi(false)
        .try_init();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut pair = pair().await;
    let mut origin = client(&pair.origin).await;
    write_keys(&mut origin, "a", 0..500, "v0").await;
    let mut cfg = config("w0");
    cfg.max_txn_ops = 16;
    let (mut handle, _e) = start(cfg.clone(), &pair);

    for round in 0..30 {
        match rng.random_range(0..10) {
            0 => {
                // A worker restart (leader handoff) or a crash.
                if rng.random_bool(0.5) {
                    handle.shutdown().await
                } else {
                    handle.abort()
                }
                cfg.owner_id = format!("w{round}");
                handle = start(cfg.clone(), &pair).0;
            }
            1 => {
                pair.peer.kill();
                for _ in 0..rng.random_range(1..20) {
                    let i = rng.random_range(0..600);
                    origin.put(endpoint_key("a", i), endpoint_value("a", i, &format!("r{round}")), None).await.unwrap();
                }
                pair.peer.restart().await.unwrap();
            }
            _ => {
                let n = rng.random_range(1..40);
                for _ in 0..n {
                    let i = rng.random_range(0..600);
                    match rng.random_range(0..4) {
                        0 => {
                            origin.delete(endpoint_key("a", i), None).await.unwrap();
                        }
                        1 => {
                            let ops: Vec<TxnOp> = (0..rng.random_range(2..30usize))
                                .map(|j| (i + j * 7) % 600)
                                .collect::<std::collections::BTreeSet<_>>()
                                .into_iter()
                                .map(|k| {
                                    TxnOp::put(
                                        endpoint_key("a", k),
                                        endpoint_value("a", k, &format!("txn{round}")),
                                        None,
                                    )
                                })
                                .collect();
                            origin.txn(Txn::new().and_then(ops)).await.unwrap();
                        }
                        _ => {
                            origin
                                .put(endpoint_key("a", i), endpoint_value("a", i, &format!("r{round}")), None)
                                .await
                                .unwrap();
                        }
                    }
                }
            }
        }
    }
    // Under a loaded machine the last restarts can take a while to settle; say what differs if
    // the mirror does not converge.
    let (mut o, mut p) = (client(&pair.origin).await, client(&pair.peer).await);
    let prefix = keys::region_prefix("a");
    let settled = wait_until("peer == origin", Duration::from_secs(120), || {
        let (mut o, mut p, prefix) = (o.clone(), p.clone(), prefix.clone());
        async move { Ok(values(&mut o, &prefix).await == values(&mut p, &prefix).await) }
    })
    .await;
    if settled.is_err() {
        let (ov, pv) = (values(&mut o, &prefix).await, values(&mut p, &prefix).await);
        let missing = ov.keys().filter(|k| !pv.contains_key(*k)).count();
        let extra = pv.keys().filter(|k| !ov.contains_key(*k)).count();
        let stale = ov.iter().filter(|(k, v)| pv.get(*k).is_some_and(|pv| pv != *v)).count();
        panic!(
            "seed {seed}: no convergence: {missing} missing, {extra} extra, {stale} stale; worker {:?}",
            handle.health()
        );
    }

    let mut peer = client(&pair.peer).await;
    wait_until("keys on live leases", DEADLINE, || {
        let mut p = peer.clone();
        async move {
            let leases = checkpoint_leases(&mut p).await;
            let all = subtree(&mut p, &keys::region_prefix("a")).await;
            let mut live = true;
            for id in leases.iter() {
                live &= p.lease_time_to_live(*id, None).await.map(|r| r.ttl() > 0).unwrap_or(false);
            }
            Ok(live && all.values().all(|(_, l)| leases.contains(l)))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    assert_eq!(
        values(&mut peer, &keys::region_prefix("a")).await,
        values(&mut origin, &keys::region_prefix("a")).await
    );
    handle.shutdown().await;
    let _ = PutOptions::new();
}

/// Counts the puts the peer receives under the origin's subtree.
fn count_peer_puts(peer: Client) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
    let puts = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = puts.clone();
    tokio::spawn(async move {
        let mut peer = peer;
        let options = WatchOptions::new().with_prefix();
        let mut stream = peer.watch(keys::region_prefix("a"), Some(options)).await.expect("watch the peer");
        while let Ok(Some(resp)) = stream.message().await {
            let n = resp.events().iter().filter(|e| e.event_type() == EventType::Put).count();
            counter.fetch_add(n, std::sync::atomic::Ordering::SeqCst);
        }
    });
    puts
}

#[tokio::test]
async fn a_shard_past_the_cap_splits_online_without_a_resync_and_moves_few_keys() {
    let pair = pair().await;
    let mut cfg = config("w1");
    cfg.max_keys_per_lease = 50;
    let (handle, _events) = start(cfg, &pair);
    wait_synced(&handle).await;
    let mut p = client(&pair.peer).await;
    let puts = count_peer_puts(p.clone());
    // Growth from empty to 600 keys, 10 at a time as the mirror keeps up: the one shard splits
    // again and again.
    let mut o = client(&pair.origin).await;
    let mut updates = 0;
    for chunk in 0..60 {
        write_keys(&mut o, "a", chunk * 10..(chunk + 1) * 10, "v1").await;
        // Keys being moved are rewritten meanwhile: a move must never put back an older value.
        for i in (0..chunk * 10).step_by(7) {
            o.put(endpoint_key("a", i), endpoint_value("a", i, &format!("u{chunk}")), None).await.unwrap();
            updates += 1;
        }
        if chunk % 10 == 9 {
            converged(&pair).await;
        }
    }
    converged(&pair).await;
    let health = handle.health();
    assert_eq!(health.resyncs, 0, "no resync: {health:?}");
    assert!(health.shard_splits >= 4, "the shard split as the subtree grew: {health:?}");
    // Every key sits on the lease the recorded layout names, and no lease carries more than the cap.
    wait_until("every split complete", DEADLINE, || {
        let mut p = p.clone();
        async move {
            let resp = p.get(keys::checkpoint_key("a"), None).await?;
            let cp =
                mirror::records::checkpoint::Checkpoint::decode(resp.kvs()[0].value()).expect("checkpoint decodes");
            let layout = mirror::leases::shards::Layout::recorded(&cp.slots, cp.leases.len());
            let mut per_lease: HashMap<i64, usize> = HashMap::new();
            let mut misplaced = 0;
            for (key, (_, lease)) in subtree(&mut p, &keys::region_prefix("a")).await {
                misplaced += usize::from(cp.leases[layout.shard_of(&key)] != lease);
                *per_lease.entry(lease).or_default() += 1;
            }
            let done = misplaced == 0 && per_lease.values().all(|n| *n <= 50) && per_lease.len() == cp.leases.len();
            anyhow::ensure!(
                done,
                "misplaced {misplaced}, keys per lease {per_lease:?}, recorded leases {:?}",
                cp.leases
            );
            Ok(true)
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}; health: {:?}", handle.health()));
    // A split moves part of one shard (at most the cap and what arrived meanwhile), never the
    // whole subtree as a resync would.
    let moved = puts.load(std::sync::atomic::Ordering::SeqCst).saturating_sub(600 + updates);
    let splits = handle.health().shard_splits as usize;
    assert!(moved <= splits * (50 + 10), "{moved} keys moved in {splits} splits");
    assert_eq!(handle.health().drift_repaired_keys, 0, "verification found nothing to repair");
    let _ = p.status().await;
    handle.shutdown().await;
}

#[tokio::test]
async fn an_idle_origin_is_silent_not_stalled_and_keepalives_over_one_stream_succeed() {
    let pair = pair().await;
    let mut o = client(&pair.origin).await;
    write_keys(&mut o, "a", 0..640, "v1").await;
    let mut cfg = config("w1");
    cfg.max_keys_per_lease = 20; // 64 leases on one keepalive stream
    let (handle, _events) = start(cfg, &pair);
    wait_synced(&handle).await;
    let rounds = handle.health().keepalive_rounds;
    let mut rx = handle.subscribe();
    tokio::time::timeout(DEADLINE, rx.wait_for(|h| h.keepalive_rounds >= rounds + 6))
        .await
        .unwrap_or_else(|_| panic!("keepalive rounds did not go on: {:?}", handle.health()))
        .unwrap();
    let health = handle.health();
    assert_eq!(health.keepalive_failures, 0, "{health:?}");
    assert_eq!(health.session_failures, 0, "{health:?}");
    assert!(health.leases >= 32, "{health:?}");
    handle.shutdown().await;
}

/// An origin that owes more peers a full sync than it has turns (a region's first start in a
/// mesh) syncs them in turns: the syncs' starts and ends, in the order the workers reported
/// them on one channel, never overlap more than the turns allow, and every copy completes.
#[tokio::test]
async fn an_origin_with_more_peers_than_turns_syncs_them_in_turns_and_completes_every_copy() {
    let (origin, b, c, d) = tokio::try_join!(
        EtcdServer::start("a"),
        EtcdServer::start("b"),
        EtcdServer::start("c"),
        EtcdServer::start("d")
    )
    .expect("etcd starts");
    let mut o = client(&origin).await;
    write_keys(&mut o, "a", 0..1_500, "v1").await;
    let turns = std::sync::Arc::new(mirror::SyncSlots::new(1));
    let (tx, mut events) = mpsc::channel(4096);
    let workers: Vec<(MirrorHandle, &EtcdServer)> = [("b", &b), ("c", &c), ("d", &d)]
        .into_iter()
        .map(|(name, peer)| {
            let mut cfg = config(&format!("w-{name}"));
            cfg.peer = name.into();
            cfg.sync_slots = turns.clone();
            let handle = mirror::spawn(
                cfg,
                EtcdTarget::plain([origin.endpoint()]),
                EtcdTarget::plain([peer.endpoint()]),
                tx.clone(),
            );
            (handle, peer)
        })
        .collect();
    for (handle, _) in &workers {
        wait_synced(handle).await;
    }
    let mut running = 0i32;
    let (mut started, mut ended) = (0, 0);
    while let Ok(event) = events.try_recv() {
        match event {
            MirrorEvent::ResyncStarted { .. } => {
                running += 1;
                started += 1;
                assert!(running <= 1, "two syncs ran at once with one turn");
            }
            MirrorEvent::Synced { .. } => {
                running -= 1;
                ended += 1;
            }
            _ => {}
        }
    }
    assert_eq!((started, ended), (3, 3), "each peer synced once");
    let prefix = keys::region_prefix("a");
    let want = values(&mut o, &prefix).await;
    for (handle, peer) in &workers {
        let mut p = client(peer).await;
        assert_eq!(values(&mut p, &prefix).await, want, "{}'s copy", handle.health().peer);
        assert_eq!(handle.health().session_failures, 0, "{:?}", handle.health());
    }
    for (handle, _) in workers {
        handle.shutdown().await;
    }
}

/// The peer's inbound view (the status's INBOUND column and `aether_federation_inbound_keys`)
/// reads the origin's keys from the progress record its worker writes with every batch instead of
/// walking the peer's index; that count is the peer's through writes, deletes and lease splits, and
/// once the copy lapses the view says so.
#[tokio::test]
async fn the_inbound_view_reads_the_recorded_count_which_follows_writes_deletes_and_splits_and_a_lapse() {
    let pair = pair().await;
    let mut origin = client(&pair.origin).await;
    let mut peer = client(&pair.peer).await;
    write_keys(&mut origin, "a", 0..500, "v1").await;
    let mut cfg = config("w1");
    cfg.max_keys_per_lease = 64; // the copy grows past its leases' cap: shards split online
    let (handle, _events) = start(cfg, &pair);
    wait_synced(&handle).await;

    let recorded = |mut peer: Client| async move {
        let resp = peer.get(keys::progress_key("a"), None).await.unwrap();
        resp.kvs().first().and_then(|kv| aether_operator::mirror::records::checkpoint::Progress::decode(kv.value()))
    };
    let view_matches = |expected: i64| {
        let peer = peer.clone();
        move || {
            let mut peer = peer.clone();
            async move {
                let view = mirror::inbound::observe(&mut peer, "b", &["a".to_string()]).await?;
                let held = key_count(&mut peer, &keys::region_prefix("a")).await;
                let a = view.iter().find(|o| o.origin == "a").cloned();
                Ok(held == expected
                    && a.is_some_and(|a| {
                        a.keys == expected && a.synced && a.lease_ttl_remaining.is_some_and(|ttl| ttl > 0)
                    }))
            }
        }
    };
    wait_until("the view shows the synced copy", DEADLINE, view_matches(500)).await.unwrap();
    assert_eq!(recorded(peer.clone()).await.and_then(|p| p.keys), Some(500), "the sync records its count");

    // Writes, updates and deletes in many batches, past the leases' cap.
    write_keys(&mut origin, "a", 500..900, "v1").await;
    write_keys(&mut origin, "a", 100..150, "v2").await;
    for i in 0..60 {
        origin.delete(endpoint_key("a", i), None).await.unwrap();
    }
    converged(&pair).await;
    if let Err(e) = wait_until("the view follows the copy", DEADLINE, view_matches(840)).await {
        let view = mirror::inbound::observe(&mut peer, "b", &["a".to_string()]).await;
        let held = key_count(&mut peer, &keys::region_prefix("a")).await;
        panic!(
            "{e}: the view {view:?}, the peer holds {held}, the record {:?}, the worker {:?}",
            recorded(peer.clone()).await,
            handle.health()
        );
    }
    assert_eq!(recorded(peer.clone()).await.and_then(|p| p.keys), Some(840), "the watch records its count");
    assert!(handle.health().leases > 500 / 64, "the shards split: {:?}", handle.health());

    // The worker dies: once the copy lapses, the view shows it gone, not the last count recorded.
    handle.abort();
    let lapsed = wait_until("the view shows the lapse", DEADLINE, || {
        let mut peer = peer.clone();
        async move {
            let view = mirror::inbound::observe(&mut peer, "b", &["a".to_string()]).await?;
            Ok(view.iter().any(|o| o.origin == "a" && o.keys == 0 && !o.synced))
        }
    })
    .await;
    if let Err(e) = lapsed {
        let view = mirror::inbound::observe(&mut peer, "b", &["a".to_string()]).await;
        let canary = peer.get(keys::canary_key("a"), None).await.map(|r| format!("{:?}", r.kvs()));
        panic!("{e}: the view {view:?}, the canary {canary:?}");
    }
    assert_eq!(key_count(&mut peer, &keys::region_prefix("a")).await, 0);
}

/// The full syncs a region owes several peers at once read the origin once between them: two
/// workers sharing their object's reads (as an operator's workers of one RegionPeering do) sync
/// 3,000 keys into two peers while the origin takes more writes; each peer's copy ends equal to
/// the origin's, and each page of the origin was read by one of the two only.
#[tokio::test]
async fn syncs_into_two_peers_at_once_read_each_page_of_the_origin_once_and_both_copies_are_whole() {
    two_peers_read_each_page_of_the_origin_once(None).await;
}

/// Production's peers are at different distances: the worker of the far one (150 ms) owns its
/// peer and pins its snapshot several round trips after the near one's sync has read its pages,
/// or even ended. It is still given those pages rather than reading them again.
#[tokio::test]
async fn a_peer_farther_away_is_given_the_pages_the_near_peers_sync_read_before_it_started() {
    two_peers_read_each_page_of_the_origin_once(Some(Duration::from_millis(150))).await;
}

/// Syncs 3,000 keys (and 400 written meanwhile) into peers b and c, c `c_rtt` away, and checks
/// that both copies are whole and that each page of the origin was read once.
async fn two_peers_read_each_page_of_the_origin_once(c_rtt: Option<Duration>) {
    let (origin, b, c) =
        tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("b"), EtcdServer::start("c")).expect("etcd starts");
    let far = match c_rtt {
        Some(rtt) => {
            let proxy = FaultProxy::start(c.client_addr()).await.expect("proxy starts");
            proxy.set_rtt(rtt);
            Some(proxy)
        }
        None => None,
    };
    let mut o = client(&origin).await;
    write_keys(&mut o, "a", 0..3000, "v1").await;
    let reads = std::sync::Arc::new(mirror::OriginReads::default());
    let spawn = |peer: &str, target: EtcdTarget| {
        let mut cfg = config(&format!("w-{peer}"));
        cfg.peer = peer.to_string();
        cfg.origin_reads = reads.clone();
        let (tx, rx) = mpsc::channel(1024);
        (mirror::spawn(cfg, EtcdTarget::plain([origin.endpoint()]), target, tx), rx)
    };
    let c_target = far.as_ref().map_or_else(|| EtcdTarget::plain([c.endpoint()]), support::mirror::through);
    let ((to_b, _eb), (to_c, _ec)) = (spawn("b", EtcdTarget::plain([b.endpoint()])), spawn("c", c_target));
    write_keys(&mut o, "a", 2900..3300, "v2").await; // while the syncs run
    wait_synced(&to_b).await;
    wait_synced(&to_c).await;
    for peer in [&b, &c] {
        support::etcd::converged(&o, &client(peer).await, "a", DEADLINE).await;
    }
    let (hb, hc) = (to_b.health(), to_c.health());
    let pages = hb.origin_pages_read + hb.origin_pages_shared;
    assert!(pages > 1, "the sync spans pages: {hb:?}");
    assert_eq!(pages, hc.origin_pages_read + hc.origin_pages_shared, "both syncs copy the same snapshot");
    assert_eq!(
        hb.origin_pages_read + hc.origin_pages_read,
        pages,
        "a page read twice: b read {} and was given {}, c read {} and was given {}",
        hb.origin_pages_read,
        hb.origin_pages_shared,
        hc.origin_pages_read,
        hc.origin_pages_shared
    );
}

/// An operator Pod taking a peer's mirror over from the Pod that led before, while that one's sync
/// was copying: what the cut-short sync put on the peer is newer than a snapshot the new Pod's
/// worker for another peer pinned moments before. Copied from that shared snapshot, the new sync's
/// merge deleted on the peer keys the origin never deleted (its watch put them back later): a
/// consumer of the peer saw them go. It pins its own snapshot instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_taking_over_from_another_pods_cut_short_sync_never_deletes_what_that_one_copied() {
    let (origin, p, q) =
        tokio::try_join!(EtcdServer::start("a"), EtcdServer::start("p"), EtcdServer::start("q")).expect("etcd starts");
    let mut o = client(&origin).await;
    write_keys(&mut o, "a", 0..6000, "v1").await;
    let spawn = |owner: &str, peer: &str, reads: Option<std::sync::Arc<mirror::OriginReads>>, target: EtcdTarget| {
        let mut cfg = config(owner);
        cfg.peer = peer.to_string();
        cfg.lease_ttl_seconds = 10;
        cfg.keepalive_interval = Duration::from_secs(2);
        if let Some(reads) = reads {
            cfg.origin_reads = reads;
        }
        let (tx, rx) = mpsc::channel(1024);
        (mirror::spawn(cfg, EtcdTarget::plain([origin.endpoint()]), target, tx), rx)
    };
    // The new Pod's reads, shared by its workers: its worker for q pins the snapshot first.
    let reads = std::sync::Arc::new(mirror::OriginReads::default());
    let (to_q, _eq) = spawn("new-pod", "q", Some(reads.clone()), EtcdTarget::plain([q.endpoint()]));
    let pinned_at = Instant::now();
    wait_until("the new Pod's sync into q reads its first page", DEADLINE, || async {
        Ok(to_q.health().origin_pages_read > 0)
    })
    .await
    .expect("q's sync starts");
    // Keys created after that snapshot, first in the subtree's order.
    let new_key = |i: usize| format!("{}clusters/a/services/new/endpoints/{i:03}", keys::region_prefix("a"));
    for i in 0..50 {
        o.put(new_key(i), "v", None).await.expect("origin put");
    }
    // The Pod that led before, still copying into p (150 ms away): the new keys are on p before
    // its copy is done, then p stops answering it.
    let proxy = FaultProxy::start(p.client_addr()).await.expect("proxy starts");
    proxy.set_rtt(Duration::from_millis(150));
    let (old, _eo) = spawn("old-pod", "p", None, support::mirror::through(&proxy));
    let mut reader = client(&p).await;
    wait_until("the old Pod's sync put the new keys on p", DEADLINE, || {
        let (mut reader, key) = (reader.clone(), new_key(49));
        async move { Ok(!reader.get(key, None).await?.kvs().is_empty()) }
    })
    .await
    .expect("the new keys reach p");
    proxy.set_blackhole(true);
    assert!(!old.health().synced, "the old Pod's sync ended before the takeover: {:?}", old.health());
    // A consumer of p from here on; the origin deletes nothing.
    let from = reader.get("x", None).await.expect("p's revision").header().expect("header").revision() + 1;
    let prefix = keys::region_prefix("a");
    let mut events = reader
        .watch(prefix.as_str(), Some(WatchOptions::new().with_prefix().with_start_revision(from)))
        .await
        .expect("watch p");
    // The new Pod takes p over; its sync starts within the window of q's snapshot.
    let (to_p, _ep) = spawn("new-pod", "p", Some(reads.clone()), EtcdTarget::plain([p.endpoint()]));
    wait_synced(&to_p).await;
    println!(
        "the takeover's sync started {:.1} s after q's snapshot was pinned (window {:?}); p's worker: {:?}",
        pinned_at.elapsed().as_secs_f64(),
        mirror::origin_reads::SHARE_WINDOW,
        to_p.health()
    );
    support::etcd::converged(&o, &client(&p).await, "a", DEADLINE).await;
    let mut deleted = Vec::new();
    while let Ok(Some(resp)) = tokio::time::timeout(Duration::from_secs(1), events.message()).await.unwrap_or(Ok(None))
    {
        for event in resp.events() {
            if event.event_type() == EventType::Delete
                && let Some(kv) = event.kv()
            {
                deleted.push(String::from_utf8_lossy(kv.key()).into_owned());
            }
        }
    }
    assert!(
        deleted.is_empty(),
        "the takeover's sync deleted on p {} keys the origin still holds: {deleted:?}",
        deleted.len()
    );
    drop(old);
}
