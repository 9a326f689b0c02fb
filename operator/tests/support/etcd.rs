//! Helpers for tests of the mirror against real etcd: registry keys and values, reading a
//! subtree, and the checks every fault scenario ends with.
use aether_harness::EtcdCluster;
use aether_operator::keys;
use aether_operator::mirror::records::checkpoint::Checkpoint;
use etcd_client::{Client, ConnectOptions, EventType, GetOptions, Txn, TxnOp, WatchOptions};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

pub async fn connect(endpoints: &[String], options: Option<ConnectOptions>) -> Client {
    Client::connect(endpoints, options).await.expect("connect")
}

pub fn endpoint_key(region: &str, i: usize) -> String {
    format!(
        "{}clusters/c{}/services/svc{}/protocols/tcp/endpoints/10.0.{}.{}",
        keys::region_prefix(region),
        i % 3,
        i % 50,
        i / 250,
        i % 250
    )
}

pub fn endpoint_value(region: &str, i: usize, version: &str) -> String {
    format!(
        r#"{{"clusterName":"c{}","region":"{region}","zone":"z1","address":"10.0.{}.{}","port":8080,"version":"{version}"}}"#,
        i % 3,
        i / 250,
        i % 250
    )
}

/// A value of about `bytes` bytes (an endpoint with a large metadata blob).
pub fn large_value(region: &str, i: usize, version: &str, bytes: usize) -> String {
    let base = endpoint_value(region, i, version);
    let pad = bytes.saturating_sub(base.len() + 16);
    format!(r#"{{"meta":"{}","endpoint":{base}}}"#, "x".repeat(pad))
}

/// key -> (value, lease) under a prefix, read page by page (values may be large).
pub async fn subtree(c: &mut Client, prefix: &str) -> BTreeMap<Vec<u8>, (Vec<u8>, i64)> {
    try_subtree(c, prefix).await.expect("range")
}

/// As [`subtree`], with the error (a cluster electing a leader answers "leader changed").
pub async fn try_subtree(
    c: &mut Client,
    prefix: &str,
) -> Result<BTreeMap<Vec<u8>, (Vec<u8>, i64)>, etcd_client::Error> {
    let end = keys::prefix_range_end(prefix.as_bytes());
    let mut out = BTreeMap::new();
    let mut from = prefix.as_bytes().to_vec();
    loop {
        let mut kv = c.kv_client().max_decoding_message_size(256 << 20);
        let resp = kv.get(from.clone(), Some(GetOptions::new().with_range(end.clone()).with_limit(50))).await?;
        for kv in resp.kvs() {
            out.insert(kv.key().to_vec(), (kv.value().to_vec(), kv.lease()));
        }
        match resp.kvs().last() {
            Some(last) if resp.more() => {
                from = last.key().to_vec();
                from.push(0);
            }
            _ => return Ok(out),
        }
    }
}

/// key -> value under a prefix.
pub async fn values(c: &mut Client, prefix: &str) -> BTreeMap<Vec<u8>, Vec<u8>> {
    subtree(c, prefix).await.into_iter().map(|(k, (v, _))| (k, v)).collect()
}

pub async fn write_keys(c: &mut Client, region: &str, range: std::ops::Range<usize>, version: &str) {
    let keys: Vec<usize> = range.collect();
    for chunk in keys.chunks(100) {
        let ops: Vec<TxnOp> = chunk
            .iter()
            .map(|i| TxnOp::put(endpoint_key(region, *i), endpoint_value(region, *i, version), None))
            .collect();
        c.txn(Txn::new().and_then(ops)).await.expect("origin txn");
    }
}

/// The checkpoint the origin's worker keeps on the peer.
pub async fn checkpoint(peer: &mut Client, origin: &str) -> Option<Checkpoint> {
    aether_operator::mirror::records::read_checkpoint(peer, origin).await.expect("read the checkpoint")
}

/// Describes how the peer's copy differs from the origin's subtree, or None when it is equal and
/// every peer key sits on a live lease that the checkpoint names.
pub async fn difference(origin: &mut Client, peer: &mut Client, region: &str) -> Option<String> {
    let prefix = keys::region_prefix(region);
    let (ov, pv) = match (try_subtree(origin, &prefix).await, try_subtree(peer, &prefix).await) {
        (Ok(o), Ok(p)) => (o.into_iter().map(|(k, (v, _))| (k, v)).collect::<BTreeMap<_, _>>(), p),
        (Err(e), _) | (_, Err(e)) => return Some(format!("reading failed: {e}")),
    };
    let missing = ov.keys().filter(|k| !pv.contains_key(*k)).count();
    let extra = pv.keys().filter(|k| !ov.contains_key(*k)).count();
    let stale = ov.iter().filter(|(k, v)| pv.get(*k).is_some_and(|(pv, _)| pv != *v)).count();
    if missing + extra + stale > 0 {
        return Some(format!("{missing} missing, {extra} extra, {stale} stale of {} keys", ov.len()));
    }
    let Some(cp) = checkpoint(peer, region).await else {
        return Some("no checkpoint on the peer".into());
    };
    let off_lease = pv.values().filter(|(_, lease)| !cp.leases.contains(lease)).count();
    if off_lease > 0 {
        return Some(format!("{off_lease} keys on leases the checkpoint does not name"));
    }
    for id in cp.leases.iter().filter(|id| **id != 0) {
        let alive = peer.lease_time_to_live(*id, None).await.map(|r| r.ttl() > 0).unwrap_or(false);
        if !alive {
            return Some(format!("lease {id} named by the checkpoint is not alive"));
        }
    }
    None
}

/// Waits until the peer's copy equals the origin's subtree, every key on a live checkpoint lease.
pub async fn converged(origin: &Client, peer: &Client, region: &str, deadline: Duration) {
    let start = std::time::Instant::now();
    loop {
        let (mut o, mut p) = (origin.clone(), peer.clone());
        let Some(difference) = difference(&mut o, &mut p, region).await else {
            eprintln!("peer == origin after {:?}", start.elapsed());
            return;
        };
        if start.elapsed() > deadline {
            panic!("peer != origin after {deadline:?}: {difference}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// On a peer with auth off: a root user, and the least-privilege user `mirror-<origin>` with
/// read-write on the origin's subtree and bookkeeping only (what hack/etcd-mirror-role.sh does);
/// then auth on.
pub async fn enable_auth_with_mirror_user(admin: &mut Client, origin: &str, password: &str) {
    admin.user_add("root", "rootpw", None).await.expect("root user");
    admin.user_grant_role("root", "root").await.expect("root role");
    let user = format!("mirror-{origin}");
    admin.role_add(user.as_str()).await.expect("role");
    for prefix in [keys::region_prefix(origin), keys::federation_prefix(origin)] {
        let perm = etcd_client::Permission::read_write(prefix.as_str()).with_prefix();
        admin.role_grant_permission(user.as_str(), perm).await.expect("grant");
    }
    admin.user_add(user.as_str(), password, None).await.expect("user");
    admin.user_grant_role(user.as_str(), user.as_str()).await.expect("user role");
    admin.auth_enable().await.expect("auth enable");
}

/// TLS options for a client of a TLS cluster, with a client certificate for `user`.
pub fn tls_for(cluster: &EtcdCluster, user: &str) -> etcd_client::TlsOptions {
    let ca = std::fs::read(cluster.ca_cert().expect("a TLS cluster")).expect("read CA");
    let cert = cluster.client_cert(user).expect("client cert");
    etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(ca)).identity(
        etcd_client::Identity::from_pem(
            std::fs::read(&cert.cert).expect("cert"),
            std::fs::read(&cert.key).expect("key"),
        ),
    )
}

/// Counts deletes of the origin's keys on the peer from now on.
pub async fn count_peer_deletes(peer: &Client, region: &str) -> Arc<AtomicUsize> {
    let deletes = Arc::new(AtomicUsize::new(0));
    let mut watch_client = peer.watch_client();
    let mut stream = watch_client
        .watch(keys::region_prefix(region), Some(WatchOptions::new().with_prefix()))
        .await
        .expect("watch the peer");
    let counter = deletes.clone();
    tokio::spawn(async move {
        while let Ok(Some(resp)) = stream.message().await {
            let n = resp.events().iter().filter(|e| e.event_type() == EventType::Delete).count();
            counter.fetch_add(n, Ordering::SeqCst);
        }
    });
    deletes
}

/// Deletes on the peer of any of `watched` (keys the origin never deletes) from now on, read from
/// the peer's own watch, which resumes after the member it was connected to dies.
pub async fn count_deletes_of(endpoints: Vec<String>, watched: Vec<Vec<u8>>) -> Arc<AtomicUsize> {
    let deletes = Arc::new(AtomicUsize::new(0));
    let watched: std::collections::HashSet<Vec<u8>> = watched.into_iter().collect();
    let start = {
        let mut c = connect(&endpoints, None).await;
        c.status().await.expect("peer status").header().expect("header").revision() + 1
    };
    let counter = deletes.clone();
    tokio::spawn(async move {
        let mut next = start;
        loop {
            let watch = async {
                let mut c = Client::connect(&endpoints, None).await?;
                let options = WatchOptions::new().with_prefix().with_start_revision(next);
                let mut stream = c.watch(keys::region_prefix("a"), Some(options)).await?;
                while let Some(resp) = stream.message().await? {
                    for e in resp.events() {
                        let key = e.kv().map(|kv| kv.key().to_vec()).unwrap_or_default();
                        if e.event_type() == EventType::Delete && watched.contains(&key) {
                            counter.fetch_add(1, Ordering::SeqCst);
                        }
                        next = next.max(e.kv().map_or(0, |kv| kv.mod_revision()) + 1);
                    }
                }
                Ok::<(), etcd_client::Error>(())
            };
            let _ = watch.await;
            tokio::time::sleep(Duration::from_millis(200)).await; // before watching again
        }
    });
    deletes
}

/// The connections open to a server's `port` from this machine's clients, by the client's port
/// (ESTABLISHED only). A connection the server closed and the client opened again shows as
/// another port.
pub fn client_connections(port: u16) -> BTreeSet<u16> {
    aether_harness::established_connections()
        .into_iter()
        .filter(|c| c.remote_port == port)
        .map(|c| c.local_port)
        .collect()
}
