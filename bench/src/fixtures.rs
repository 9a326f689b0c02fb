//! What the scenarios share: the registry's keys and values, filling an origin, counting a peer,
//! starting a mirror worker or `etcdctl make-mirror`, a peer behind a delaying proxy.
use aether_harness::{EtcdServer, FaultProxy, ManagedProcess, tool_path};
use aether_operator::keys;
use aether_operator::mirror::{self, EtcdTarget, MirrorConfig, MirrorHandle, Phase};
use etcd_client::{Client, GetOptions, Txn, TxnOp};
use futures::StreamExt;
use std::process::Command;
use std::time::{Duration, Instant};

pub const SYNC_KEYS: usize = 100_000;

/// make-mirror puts one key at a time; on this machine it would take many minutes for the full
/// data set, so its rate is measured over this much time (keys copied / time).
pub const MAKE_MIRROR_BUDGET: Duration = Duration::from_secs(60);

pub fn key(region: &str, i: usize) -> String {
    format!(
        "{}clusters/c{}/services/svc-{}/protocols/http/endpoints/10.{}.{}.{}",
        keys::region_prefix(region),
        i % 4,
        i % 97,
        (i >> 16) & 255,
        (i >> 8) & 255,
        i & 255
    )
}

/// About 250 bytes of endpoint JSON.
pub fn value(i: usize, tag: &str) -> String {
    format!(
        r#"{{"clusterName":"c{}","region":"a","zone":"a-zone-{}","address":"10.{}.{}.{}","port":8080,"protocol":"http","weight":100,"labels":{{"app":"svc-{}","version":"v1","tier":"backend"}},"tag":"{tag}","pad":"{}"}}"#,
        i % 4,
        i % 3,
        (i >> 16) & 255,
        (i >> 8) & 255,
        i & 255,
        i % 97,
        "x".repeat(40)
    )
}

pub async fn fill(origin: &Client, n: usize, tag: &str) -> anyhow::Result<()> {
    fill_region(origin, "a", n, tag).await
}

/// Puts keys 0..n of `region`'s subtree (120 to a Txn, 8 Txns in flight).
pub async fn fill_region(origin: &Client, region: &str, n: usize, tag: &str) -> anyhow::Result<()> {
    let chunks: Vec<Vec<usize>> = (0..n).collect::<Vec<_>>().chunks(120).map(|c| c.to_vec()).collect();
    futures::stream::iter(chunks)
        .map(|chunk| {
            let mut c = origin.clone();
            let tag = tag.to_string();
            async move {
                let ops: Vec<TxnOp> =
                    chunk.iter().map(|i| TxnOp::put(key(region, *i), value(*i, &tag), None)).collect();
                c.txn(Txn::new().and_then(ops)).await
            }
        })
        .buffer_unordered(8)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    Ok(())
}

pub async fn count(c: &Client, prefix: &str) -> i64 {
    let mut c = c.clone();
    let get = c.get(prefix, Some(GetOptions::new().with_prefix().with_count_only()));
    match tokio::time::timeout(Duration::from_secs(5), get).await {
        Ok(Ok(r)) => r.count(),
        _ => 0,
    }
}

pub async fn wait_count(c: &Client, prefix: &str, n: usize, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        let got = count(c, prefix).await;
        if got >= n as i64 {
            return Some(start.elapsed());
        }

        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

pub fn bench_config(peer: &str) -> MirrorConfig {
    let mut c = MirrorConfig::new("a", peer, &format!("bench-{peer}"));
    c.lease_ttl_seconds = 60;
    c.keepalive_interval = Duration::from_secs(10);
    c
}

pub fn spawn_worker(config: MirrorConfig, origin: &EtcdServer, peer: EtcdTarget) -> MirrorHandle {
    let (tx, _rx) = tokio::sync::mpsc::channel(1024);
    std::mem::forget(_rx); // keep events flowing nowhere without blocking
    mirror::spawn(config, EtcdTarget::plain([origin.endpoint()]), peer, tx)
}

pub async fn wait_synced(handle: &MirrorHandle, limit: Duration) -> anyhow::Result<()> {
    let mut rx = handle.subscribe();
    tokio::time::timeout(limit, rx.wait_for(|h| h.synced && h.phase == Phase::Watching))
        .await
        .map_err(|_| anyhow::anyhow!("sync did not finish: {:?}", handle.health()))??;
    Ok(())
}

pub fn rate(keys: usize, d: Duration) -> f64 {
    keys as f64 / d.as_secs_f64()
}

/// make-mirror of a's subtree from `origin` into `peer`.
pub fn make_mirror(origin: &EtcdServer, peer: &str, log: &std::path::Path) -> anyhow::Result<ManagedProcess> {
    let mut cmd = Command::new(tool_path("etcdctl")?);
    // Keys land under the same prefix on the peer, as with this mirror.
    let prefix = keys::region_prefix("a");
    cmd.args(["--endpoints", &origin.endpoint(), "make-mirror", "--prefix", &prefix, "--dest-prefix", &prefix, peer]);
    ManagedProcess::spawn("make-mirror", cmd, log)
}

/// The peer as the mirror reaches it: directly, or through a proxy `rtt` away.
pub async fn behind(peer: &EtcdServer, rtt: Duration) -> anyhow::Result<(Option<FaultProxy>, String)> {
    if rtt.is_zero() {
        return Ok((None, peer.endpoint()));
    }
    let proxy = FaultProxy::start(peer.client_addr()).await?;
    proxy.set_rtt(rtt);
    let endpoint = proxy.endpoint("http");
    Ok((Some(proxy), endpoint))
}

pub fn at_rtt(rtt: Duration) -> String {
    if rtt.is_zero() { String::new() } else { format!(", peer {} ms away", rtt.as_millis()) }
}

/// The raw ceiling into a peer server.
pub async fn raw_copy(origin: &Client, peer: &EtcdServer) -> anyhow::Result<()> {
    raw_copy_client(origin, &Client::connect([peer.endpoint()], None).await?).await
}

/// Pages the origin and writes each page into the peer in Txns of 126 puts, 4 in flight.
pub async fn raw_copy_client(origin: &Client, peer: &Client) -> anyhow::Result<()> {
    let prefix = keys::region_prefix("a");
    let end = keys::prefix_range_end(prefix.as_bytes());
    let mut cursor = prefix.clone().into_bytes();
    let mut oc = origin.clone();
    loop {
        let mut resp = oc.get(cursor.clone(), Some(GetOptions::new().with_range(end.clone()).with_limit(1000))).await?;
        let more = resp.more();
        let kvs = resp.take_kvs();
        if let Some(last) = kvs.last() {
            cursor = last.key().to_vec();
            cursor.push(0);
        }
        let batches: Vec<Vec<TxnOp>> =
            kvs.chunks(126).map(|c| c.iter().map(|kv| TxnOp::put(kv.key(), kv.value(), None)).collect()).collect();
        futures::stream::iter(batches)
            .map(|ops| {
                let mut pc = peer.clone();
                async move { pc.txn(Txn::new().and_then(ops)).await }
            })
            .buffer_unordered(4)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<Vec<_>, _>>()?;
        if !more {
            return Ok(());
        }
    }
}

pub fn tempfile_dir() -> anyhow::Result<tempfile::TempDir> {
    Ok(tempfile::Builder::new().prefix("aether-bench-").tempdir()?)
}

/// The sizes a bench runs at: `var` as a comma-separated list of key counts, else `default`.
pub fn sizes_from_env(var: &str, default: &[usize]) -> anyhow::Result<Vec<usize>> {
    match std::env::var(var) {
        Ok(v) => v.split(',').map(|k| k.trim().parse().map_err(|e| anyhow::anyhow!("{var}={v}: {k:?}: {e}"))).collect(),
        Err(_) => Ok(default.to_vec()),
    }
}
