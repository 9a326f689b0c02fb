//! The peer's own write limit: how fast fresh etcds take the subtree's keys when nothing but the
//! writes runs. The keys are read from the origin once, before the clock starts, and written in
//! Txns of the mirror's size (126 puts: 128 ops less the progress record and the canary) over
//! several client connections, each with several Txns in flight. A sweep of connections and
//! depths finds what drives the peer hardest; its best is the ceiling a sync's rate is read
//! against (a copy that reads the origin while it writes can only come below it).
use crate::fixtures::rate;
use crate::process::{CpuSplit, etcd_pid};
use crate::table::Table;
use aether_harness::{EtcdFlavor, EtcdServer};
use aether_operator::keys;
use etcd_client::{Client, GetOptions, Txn, TxnOp};
use futures::StreamExt;
use std::time::{Duration, Instant};

/// Puts per Txn: the mirror's `max_txn_ops` default (128) less its two bookkeeping ops.
const PUTS_PER_TXN: usize = 126;

/// (client connections per peer, Txns in flight per peer). The first is what the old "raw
/// ceiling" row ran.
const SWEEP: [(usize, usize); 4] = [(1, 4), (4, 16), (16, 64), (32, 128)];

/// What the sweep found.
pub struct WriteLimit {
    /// The best rate over all peers together, keys/s.
    pub keys_per_s: f64,
    pub connections: usize,
    pub depth: usize,
    /// Every point of the sweep: "C conn x D deep: R keys/s".
    pub sweep: Vec<String>,
    /// Where the CPU went at the best point (the peers' etcds, this writer).
    pub cpu: String,
    /// The peers' etcds' CPU seconds together at the best point: the floor of a copy's peer side.
    pub peer_cpu_seconds: f64,
}

/// The subtree of region a on `origin`, in memory.
pub async fn read_subtree(origin: &Client) -> anyhow::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let prefix = keys::region_prefix("a");
    let end = keys::prefix_range_end(prefix.as_bytes());
    let mut cursor = prefix.into_bytes();
    let mut oc = origin.clone();
    let mut all = Vec::new();
    loop {
        let mut resp =
            oc.get(cursor.clone(), Some(GetOptions::new().with_range(end.clone()).with_limit(10_000))).await?;
        let more = resp.more();
        let kvs = resp.take_kvs();
        if let Some(last) = kvs.last() {
            cursor = last.key().to_vec();
            cursor.push(0);
        }
        all.extend(kvs.into_iter().map(|kv| (kv.key().to_vec(), kv.value().to_vec())));
        if !more {
            return Ok(all);
        }
    }
}

/// Reads of the origin a floor is the cheapest of (the CPU clock ticks every 10 ms, and one read
/// of 100k keys costs the etcd about 0.3-0.5 s).
const FLOOR_READS: usize = 3;

/// The origin etcd's CPU seconds for the cheapest full read of the subtree whose keys are `kvs`
/// (read before, in order): pages of 10k keys, each range ending at the next page's first key, so
/// that etcd counts each key once (a page read to the subtree's end counts the rest of it, 5.5 x K
/// keys at 100k). The least of `FLOOR_READS`; an error when a read does not return every key.
pub async fn origin_floor(origin: &Client, pid: String, kvs: &[(Vec<u8>, Vec<u8>)]) -> anyhow::Result<f64> {
    let prefix = keys::region_prefix("a");
    let end = keys::prefix_range_end(prefix.as_bytes());
    let bounds: Vec<Vec<u8>> = std::iter::once(prefix.into_bytes())
        .chain(kvs.iter().skip(10_000).step_by(10_000).map(|(k, _)| k.clone()))
        .chain(std::iter::once(end))
        .collect();
    let mut oc = origin.clone();
    let mut least = f64::MAX;
    for _ in 0..FLOOR_READS {
        let cpu = CpuSplit::start(vec![("origin etcd".into(), pid.clone())]);
        let mut read = 0;
        for page in bounds.windows(2) {
            let opts = GetOptions::new().with_range(page[1].clone());
            read += oc.get(page[0].clone(), Some(opts)).await?.kvs().len();
        }
        least = least.min(cpu.used()[0]);
        anyhow::ensure!(read == kvs.len(), "the floor's read returned {read} of {} keys", kvs.len());
    }
    Ok(least)
}

/// Sweeps connections and depths, writing `kvs` into `peers` fresh etcds at once at each point.
pub async fn peer_write_limit(kvs: &[(Vec<u8>, Vec<u8>)], peers: usize) -> anyhow::Result<WriteLimit> {
    let mut best: Option<WriteLimit> = None;
    let mut sweep = Vec::new();
    for (connections, depth) in SWEEP {
        let fresh: Vec<EtcdServer> = futures::future::try_join_all(
            ["limit-b", "limit-c", "limit-d", "limit-e"]
                .into_iter()
                .take(peers)
                .map(|name| EtcdServer::start_with(name, EtcdFlavor::Default, &[])),
        )
        .await?;
        let mut clients = Vec::new();
        for peer in &fresh {
            let mut each = Vec::new();
            for _ in 0..connections {
                each.push(Client::connect([peer.endpoint()], None).await?);
            }
            clients.push(each);
        }
        let mut pids: Vec<(String, String)> =
            fresh.iter().map(|p| (format!("peer etcd {}", p.name()), etcd_pid(p))).collect();
        pids.push(("writer".into(), "self".into()));
        let split = CpuSplit::start(pids);
        let start = Instant::now();
        futures::future::try_join_all(clients.iter().map(|each| write_all(kvs, each, depth))).await?;
        let took = start.elapsed();
        let (cpu, peer_cpu_seconds) = (split.report(), split.used()[..peers].iter().sum());
        let keys_per_s = rate(kvs.len() * peers, took);
        sweep.push(format!("{connections} conn x {depth} deep: {keys_per_s:.0} keys/s"));
        if best.as_ref().is_none_or(|b| keys_per_s > b.keys_per_s) {
            best = Some(WriteLimit { keys_per_s, connections, depth, sweep: Vec::new(), cpu, peer_cpu_seconds });
        }
    }
    let mut best = best.expect("the sweep has points");
    best.sweep = sweep;
    Ok(best)
}

/// Writes every key in Txns of the mirror's size, `depth` in flight, dealt over the connections.
async fn write_all(kvs: &[(Vec<u8>, Vec<u8>)], clients: &[Client], depth: usize) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let txns: Vec<(usize, Vec<TxnOp>)> = kvs
        .chunks(PUTS_PER_TXN)
        .enumerate()
        .map(|(i, chunk)| {
            (i % clients.len(), chunk.iter().map(|(k, v)| TxnOp::put(k.clone(), v.clone(), None)).collect())
        })
        .collect();
    futures::stream::iter(txns)
        .map(|(connection, ops)| {
            let mut client = clients[connection].clone();
            async move { client.txn(Txn::new().and_then(ops)).await }
        })
        .buffer_unordered(depth)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    Ok(start.elapsed())
}

/// The limit's row under `scenario`: its rate, the point of the sweep that reached it, every
/// point, and where the CPU went at the best one.
pub fn limit_row(table: &mut Table, scenario: &str, limit: &WriteLimit) {
    table.row_with(
        scenario,
        "the peer's write limit (keys pre-read; Txns of 126 puts)",
        format!("{:.0} keys/s", limit.keys_per_s),
        format!(
            "best at {} connections x {} in flight per peer; sweep: {}; at the best, {}",
            limit.connections,
            limit.depth,
            limit.sweep.join(", "),
            limit.cpu
        ),
        serde_json::json!({"keys_per_s": limit.keys_per_s, "connections": limit.connections, "depth": limit.depth}),
    );
}
