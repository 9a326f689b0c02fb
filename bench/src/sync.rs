//! The full sync: 100k keys onto an empty peer (this mirror against the peer's own write limit,
//! make-mirror and a raw copy), over a WAN, and at scale (10k to 1M keys into one to three peers:
//! each against the peers' write limit at that size, with memory, time and the checkpoint's footprint).
use crate::fixtures::{
    MAKE_MIRROR_BUDGET, SYNC_KEYS, at_rtt, behind, bench_config, count, fill, make_mirror, rate, raw_copy,
    raw_copy_client, sizes_from_env, spawn_worker, tempfile_dir, wait_count, wait_synced,
};
use crate::limit::{limit_row, origin_floor, peer_write_limit, read_subtree};
use crate::process::{CpuSplit, WorkerProcess, busy_percent, cpu_seconds, etcd_pid, machine_ticks, sync_processes};
use crate::profile::Profiles;
use crate::sides::SideCosts;
use crate::table::Table;
use aether_harness::{EtcdFlavor, EtcdServer, ManagedProcess};
use aether_operator::keys;
use aether_operator::mirror::EtcdTarget;
use etcd_client::Client;
use std::collections::HashMap;
use std::time::{Duration, Instant};

pub async fn bench_sync(table: &mut Table) -> anyhow::Result<()> {
    println!("initial sync of {SYNC_KEYS} keys");
    let dir = tempfile_dir()?;
    let prefix = keys::region_prefix("a");
    for peers in [1usize, 2] {
        // This mirror, as its own process; its peak RSS is measured during the sync.
        let origin = EtcdServer::start("bench-origin").await?;
        let oc = Client::connect([origin.endpoint()], None).await?;
        fill(&oc, SYNC_KEYS, "v1").await?;
        let targets: Vec<EtcdServer> = futures::future::try_join_all(
            (0..peers)
                .map(|i| EtcdServer::start_with(if i == 0 { "bench-b" } else { "bench-c" }, EtcdFlavor::Default, &[])),
        )
        .await?;
        let peer_names = ["b", "c"];
        let specs: Vec<(String, String)> =
            targets.iter().enumerate().map(|(i, t)| (peer_names[i].to_string(), t.endpoint())).collect();
        let ticks = machine_ticks();
        let mut worker = WorkerProcess::start(&origin.endpoint(), &specs)?;
        let split = CpuSplit::start(sync_processes(&origin, &worker, &targets));
        let elapsed = worker.wait_synced()?;
        let (busy, worker_cpu) = (busy_percent(ticks, machine_ticks()), worker.cpu_seconds());
        let sync_cpu = split.report();
        let rss_kb = worker.peak_kb();
        drop(worker);
        for t in &targets {
            let tc = Client::connect([t.endpoint()], None).await?;
            anyhow::ensure!(count(&tc, &prefix).await == SYNC_KEYS as i64, "the mirror's copy is incomplete");
        }
        let mirror_rate = rate(SYNC_KEYS * peers, elapsed);
        // The peers' own write limit, measured in this run on the same machine.
        let kvs = read_subtree(&oc).await?;
        let limit = peer_write_limit(&kvs, peers).await?;
        drop(kvs);
        table.row_with(
            &format!("sync {SYNC_KEYS} keys, {peers} peer(s)"),
            "this mirror",
            format!("{mirror_rate:.0} keys/s"),
            format!(
                "{:.2}s, {:.0} % of the peer's write limit; peak RSS {:.1} MiB; its CPU {worker_cpu:.2} s ({:.1} µs a key copied), machine busy {busy:.0} %",
                elapsed.as_secs_f64(),
                100.0 * mirror_rate / limit.keys_per_s,
                rss_kb as f64 / 1024.0,
                worker_cpu * 1e6 / (SYNC_KEYS * peers) as f64
            ),
            serde_json::json!({"share_of_write_limit": mirror_rate / limit.keys_per_s}),
        );
        // Where the CPU went: what the 2 cores could give, and what the origin's reads cost
        // beside the peers' writes (the limit row reads nothing).
        table.row(
            &format!("sync {SYNC_KEYS} keys, {peers} peer(s)"),
            "this mirror: CPU by process (from the worker's start)",
            "-".into(),
            sync_cpu,
        );
        limit_row(table, &format!("sync {SYNC_KEYS} keys, {peers} peer(s)"), &limit);

        // make-mirror, same data, fresh peers.
        let fresh: Vec<EtcdServer> = futures::future::try_join_all(
            (0..peers).map(|i| EtcdServer::start_with(if i == 0 { "mm-b" } else { "mm-c" }, EtcdFlavor::Default, &[])),
        )
        .await?;
        let start = Instant::now();
        let _mms: Vec<ManagedProcess> = fresh
            .iter()
            .enumerate()
            .map(|(i, t)| make_mirror(&origin, &t.endpoint(), &dir.path().join(format!("mm-{peers}-{i}.log"))))
            .collect::<Result<_, _>>()?;
        let mut done = true;
        for t in &fresh {
            let tc = Client::connect([t.endpoint()], None).await?;
            done &= wait_count(&tc, &prefix, SYNC_KEYS, Duration::from_secs(600)).await.is_some();
        }
        let mm = start.elapsed();
        let mm_rate = rate(SYNC_KEYS * peers, mm);
        table.row(
            &format!("sync {SYNC_KEYS} keys, {peers} peer(s)"),
            "etcdctl make-mirror",
            format!("{mm_rate:.0} keys/s"),
            format!(
                "{:.2}s{}; mirror is {:.1}x",
                mm.as_secs_f64(),
                if done { "" } else { " (did not finish)" },
                mirror_rate / mm_rate
            ),
        );

        // A raw copy: the same pages read from the origin and written straight into fresh peers
        // in batched Txns, one connection, 4 in flight (no lease, no records).
        let raw_peers: Vec<EtcdServer> = futures::future::try_join_all(
            (0..peers)
                .map(|i| EtcdServer::start_with(if i == 0 { "raw-b" } else { "raw-c" }, EtcdFlavor::Default, &[])),
        )
        .await?;
        let (ticks, own_cpu) = (machine_ticks(), cpu_seconds("self"));
        let start = Instant::now();
        futures::future::try_join_all(raw_peers.iter().map(|p| raw_copy(&oc, p))).await?;
        let raw = start.elapsed();
        let (busy, copy_cpu) = (busy_percent(ticks, machine_ticks()), cpu_seconds("self") - own_cpu);
        let raw_rate = rate(SYNC_KEYS * peers, raw);
        table.row(
            &format!("sync {SYNC_KEYS} keys, {peers} peer(s)"),
            "raw copy (origin pages, 1 connection, 4 Txns in flight, no lease)",
            format!("{raw_rate:.0} keys/s"),
            format!(
                "{:.2}s; mirror is {:.0} % of it; the copy's CPU {copy_cpu:.2} s ({:.1} µs a key), machine busy {busy:.0} %",
                raw.as_secs_f64(),
                100.0 * mirror_rate / raw_rate,
                copy_cpu * 1e6 / (SYNC_KEYS * peers) as f64
            ),
        );
    }
    Ok(())
}

/// The initial sync of 100k keys into a peer next door and `rtt` away, in process, against
/// make-mirror the same way (within its budget).
pub async fn bench_wan_sync(table: &mut Table, rtt: Duration) -> anyhow::Result<()> {
    println!("sync {SYNC_KEYS} keys, peer next door and {rtt:?} away");
    let dir = tempfile_dir()?;
    let prefix = keys::region_prefix("a");
    let origin = EtcdServer::start("wan-a").await?;
    let oc = Client::connect([origin.endpoint()], None).await?;
    fill(&oc, SYNC_KEYS, "wan").await?;
    let mut rates = Vec::new();
    for delay in [Duration::ZERO, rtt] {
        let peer = EtcdServer::start("wan-b").await?;
        let (_proxy, endpoint) = behind(&peer, delay).await?;
        let start = Instant::now();
        let h = spawn_worker(bench_config("b"), &origin, EtcdTarget::plain([endpoint]));
        // Where the time goes: until the first key lands (the session's round trips: members,
        // records, ownership, leases), then the copy itself (from the peer's side, next door).
        let landing = Landing::sample(Client::connect([peer.endpoint()], None).await?, prefix.clone(), SYNC_KEYS);
        let finished = wait_synced(&h, Duration::from_secs(600)).await.is_ok();
        let elapsed = start.elapsed();
        let (connections, window, limit, cuts) = {
            let health = h.health();
            (health.peer_connections, health.sync_window, health.sync_window_limit, health.sync_window_cuts)
        };
        h.shutdown().await;
        let (first, copy_rate) = landing.stop(SYNC_KEYS);
        let done = count(&Client::connect([peer.endpoint()], None).await?, &prefix).await;
        let setup = first.unwrap_or(elapsed);
        rates.push(rate(done as usize, elapsed));
        let scenario = format!("sync {SYNC_KEYS} keys{}", at_rtt(delay));
        let vs = if delay.is_zero() {
            String::new()
        } else {
            format!("; {:.0} % of next door's rate", 100.0 * rates[1] / rates[0])
        };
        // The serial round trips before the first key: its time over the round trip (the
        // sampler reads the peer every 20 ms, so up to a seventh of one at 150 ms is the reading).
        let round_trips = match delay.is_zero() {
            true => String::new(),
            false => format!(" ({:.1} round trips)", setup.as_secs_f64() / delay.as_secs_f64()),
        };
        table.row_with(
            &scenario,
            "this mirror (in process)",
            format!("{:.0} keys/s", rates.last().copied().unwrap_or(0.0)),
            format!(
                "{:.2}s{}{vs}; first key after {:.2}s{round_trips}, then {copy_rate:.0} keys/s (10-90 %), window {window} of at most {limit} Txns at the end ({cuts} cuts by the peer's queue) over {connections} connection(s)",
                elapsed.as_secs_f64(),
                if finished { "" } else { " (did not finish)" },
                setup.as_secs_f64(),
            ),
            serde_json::json!({
                "keys": SYNC_KEYS, "rtt_ms": delay.as_millis() as u64, "seconds": elapsed.as_secs_f64(),
                "missing": SYNC_KEYS as i64 - done, "first_key_s": setup.as_secs_f64(), "copy_keys_per_s": copy_rate,
                "sync_window_end": window, "sync_window_cuts": cuts,
                "first_key_round_trips": if delay.is_zero() { 0.0 } else { setup.as_secs_f64() / delay.as_secs_f64() },
                "connections": connections,
            }),
        );
    }
    let peer = EtcdServer::start("wan-mm").await?;
    let (_proxy, endpoint) = behind(&peer, rtt).await?;
    let start = Instant::now();
    let _mm = make_mirror(&origin, &endpoint, &dir.path().join("mm-wan.log"))?;
    let pc = Client::connect([peer.endpoint()], None).await?;
    let finished = wait_count(&pc, &prefix, SYNC_KEYS, MAKE_MIRROR_BUDGET).await.is_some();
    let elapsed = start.elapsed();
    let done = count(&pc, &prefix).await;
    table.row(
        &format!("sync {SYNC_KEYS} keys{}", at_rtt(rtt)),
        "etcdctl make-mirror",
        format!("{:.0} keys/s", rate(done as usize, elapsed)),
        format!("{done} keys in {:.0}s{}", elapsed.as_secs_f64(), if finished { "" } else { " (budget reached)" }),
    );
    Ok(())
}

/// The scale curve: one origin synced at 10k, 100k and 1M keys into one peer and into two, 100k
/// into four and 1M into three (`AETHER_BENCH_SCALE_KEYS`, a comma-separated list, picks sizes),
/// the mirror as its own process (peak RSS sampled); each against the peers' own write limit at
/// that size, and each side's CPU a key against its floor, measured in the same run.
pub async fn bench_scale(table: &mut Table) -> anyhow::Result<()> {
    println!("scale curve: sync 10k, 100k, 1M keys into 1 peer and into 2; 1M into 3");
    let prefix = keys::region_prefix("a");
    let mut one_peer_rate = HashMap::new();
    let sizes = sizes_from_env("AETHER_BENCH_SCALE_KEYS", &[10_000, 100_000, 1_000_000])?;
    let curve = [
        (10_000usize, 1usize),
        (10_000, 2),
        (100_000, 1),
        (100_000, 2),
        (100_000, 4),
        (1_000_000, 1),
        (1_000_000, 2),
        (1_000_000, 3),
    ];
    for (keys_n, peers) in curve.into_iter().filter(|(keys_n, _)| sizes.contains(keys_n)) {
        let flags = [&["--quota-backend-bytes", "8589934592"], crate::profile::etcd_flags()].concat();
        let origin = EtcdServer::start_with("sc-a", EtcdFlavor::Default, &flags).await?;
        let oc = Client::connect([origin.endpoint()], None).await?;
        fill(&oc, keys_n, "sc").await?;
        let names: Vec<String> = (0..peers).map(|i| format!("sc-p{i}")).collect();
        let targets: Vec<EtcdServer> =
            futures::future::try_join_all(names.iter().map(|n| EtcdServer::start_with(n, EtcdFlavor::Default, &flags)))
                .await?;
        let specs: Vec<(String, String)> =
            targets.iter().enumerate().map(|(i, t)| (format!("p{i}"), t.endpoint())).collect();
        let profiles = Profiles::start(
            &format!("sync-{keys_n}-{peers}"),
            &[("origin etcd", &origin), ("peer etcd p0", &targets[0])],
        )?;
        let mut worker = WorkerProcess::start(&origin.endpoint(), &specs)?;
        let split = CpuSplit::start(sync_processes(&origin, &worker, &targets));
        let elapsed = worker.wait_synced()?;
        let (sync_cpu, used) = (split.report(), split.used());
        profiles.finish();
        let peak = worker.peak_kb();
        drop(worker);
        let mut unseen = 0i64;
        for t in &targets {
            let tc = Client::connect([t.endpoint()], None).await?;
            unseen += keys_n as i64 - count(&tc, &prefix).await;
        }
        let keys_per_s = rate(keys_n * peers, elapsed);
        // How the lease layout is recorded on the peer: one record, or a record and its parts.
        let recorded = {
            let tc = Client::connect([targets[0].endpoint()], None).await?;
            checkpoint_footprint(&tc, "a").await?
        };
        // What the peer etcd takes at this size with no mirror in the way: the same pages written
        // in plain Txns into a fresh peer.
        let raw = if peers == 1 {
            one_peer_rate.insert(keys_n, keys_per_s);
            let fresh =
                EtcdServer::start_with("sc-raw", EtcdFlavor::Default, &["--quota-backend-bytes", "8589934592"]).await?;
            let started = Instant::now();
            raw_copy_client(&oc, &Client::connect([fresh.endpoint()], None).await?).await?;
            Some(rate(keys_n, started.elapsed()))
        } else {
            None
        };
        // What every watch Txn carries besides the ops: the progress record (owner, revision,
        // what was sent, the keys then held), whatever the subtree's size; the lease layout is
        // written only when it changes.
        let progress = aether_operator::mirror::records::checkpoint::Progress {
            owner: "bench-p0".into(),
            revision: keys_n as i64 * 2,
            sent_through: keys_n as i64 * 2,
            keys: Some(keys_n as i64),
        };
        let bookkeeping = progress.encode().len() + keys::progress_key("a").len();
        let vs_100k = one_peer_rate.get(&100_000).map(|r| r / keys_per_s);
        // The origin's floor: its CPU for the cheapest full read of the subtree; and the peers'
        // own write limit at this size, measured in this run on the same machine.
        let kvs = read_subtree(&oc).await?;
        let origin_floor = origin_floor(&oc, etcd_pid(&origin), &kvs).await?;
        let limit = peer_write_limit(&kvs, peers).await?;
        drop(kvs);
        let scenario = format!("scale: sync {keys_n} keys, {peers} peer(s)");
        table.row_with(
            &scenario,
            "this mirror",
            format!("{keys_per_s:.0} keys/s"),
            format!(
                "{:.2}s, {:.0} % of the peers' write limit; peak RSS {:.1} MiB, {unseen} keys missing (failures), {bookkeeping} B bookkeeping per watch Txn, checkpoint {} B in {} part(s){}",
                elapsed.as_secs_f64(),
                100.0 * keys_per_s / limit.keys_per_s,
                peak as f64 / 1024.0,
                recorded.1,
                recorded.0,
                match (peers, vs_100k) {
                    (1, Some(ratio)) if keys_n > 100_000 => format!("; 100k's rate is {ratio:.2}x this"),
                    _ => String::new(),
                },
            ) + &raw.map_or(String::new(), |raw| {
                format!("; raw copy at this size {raw:.0} keys/s (mirror {:.0} % of it)", keys_per_s / raw * 100.0)
            }),
            serde_json::json!({
                "keys": keys_n, "peers": peers, "keys_per_s": keys_per_s, "seconds": elapsed.as_secs_f64(), "raw_keys_per_s": raw,
                "share_of_write_limit": keys_per_s / limit.keys_per_s,
                "peak_rss_mib": peak as f64 / 1024.0, "missing": unseen, "bookkeeping_bytes_per_watch_txn": bookkeeping,
                "checkpoint_parts": recorded.0, "checkpoint_bytes": recorded.1,
            }),
        );
        table.row(&scenario, "this mirror: CPU by process (from the worker's start)", "-".into(), sync_cpu);
        let sides = SideCosts {
            keys: keys_n,
            peers,
            origin: used[0],
            origin_floor,
            peer: used[2..].iter().sum(),
            peer_floor: limit.peer_cpu_seconds,
            mirror: used[1],
        };
        sides.row(table, &scenario);
        limit_row(table, &scenario, &limit);
    }
    Ok(())
}

/// The checkpoint of `origin` on a peer: its parts (0: recorded whole) and bytes, record included.
pub async fn checkpoint_footprint(peer: &Client, origin: &str) -> anyhow::Result<(usize, usize)> {
    let mut kv = peer.kv_client();
    let record = kv.get(keys::checkpoint_key(origin), None).await?;
    let parts =
        kv.get(keys::checkpoint_parts_prefix(origin), Some(etcd_client::GetOptions::new().with_prefix())).await?;
    let bytes = |kvs: &[etcd_client::KeyValue]| kvs.iter().map(|kv| kv.key().len() + kv.value().len()).sum::<usize>();
    Ok((parts.kvs().len(), bytes(record.kvs()) + bytes(parts.kvs())))
}

/// When a sync's first key, 10 % and 90 % of its keys landed on the peer, sampled from the
/// peer's side every 20 ms.
struct Landing {
    times: std::sync::Arc<std::sync::Mutex<[Option<Duration>; 3]>>,
    sampler: tokio::task::JoinHandle<()>,
}

impl Landing {
    fn sample(peer: Client, prefix: String, keys: usize) -> Self {
        let times = std::sync::Arc::new(std::sync::Mutex::new([None; 3]));
        let shared = times.clone();
        let sampler = tokio::spawn(async move {
            let start = Instant::now();
            loop {
                let n = count(&peer, &prefix).await as usize;
                let t = start.elapsed();
                for (slot, reached) in
                    shared.lock().unwrap().iter_mut().zip([n > 0, n >= keys / 10, n >= keys * 9 / 10])
                {
                    if reached && slot.is_none() {
                        *slot = Some(t);
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        Landing { times, sampler }
    }

    /// (first key, keys a second between 10 % and 90 %).
    fn stop(self, keys: usize) -> (Option<Duration>, f64) {
        self.sampler.abort();
        let [first, tenth, ninetieth] = *self.times.lock().unwrap();
        let copy_rate = match (tenth, ninetieth) {
            (Some(a), Some(b)) if b > a => rate(keys * 8 / 10, b - a),
            _ => 0.0,
        };
        (first, copy_rate)
    }
}

/// Idle, verification walks the subtree at the defaults (a page of 1,000 keys every 5 s): what it
/// costs the origin etcd, which counts a range's keys to its end whatever the limit.
async fn idle_verification_row(table: &mut Table, origin_pid: &str, keys: usize, rtt: Duration, walker: &str) {
    const WINDOW: Duration = Duration::from_secs(60);
    let (cpu_before, watched) = (cpu_seconds(origin_pid), Instant::now());
    tokio::time::sleep(WINDOW).await; // the window is the measurement: nothing to wait for
    let origin_cpu = cpu_seconds(origin_pid) - cpu_before;
    let share = origin_cpu / watched.elapsed().as_secs_f64() * 100.0;
    table.row_with(
        &format!("idle, {keys} keys synced{}", at_rtt(rtt)),
        &format!("the origin etcd while {walker} (defaults)"),
        format!("{share:.2} % of a core"),
        format!("{origin_cpu:.2} CPU s over {:.0} s, a page every 5 s", watched.elapsed().as_secs_f64()),
        serde_json::json!({"keys": keys, "walker": walker, "origin_cpu_percent": share, "window_s": watched.elapsed().as_secs_f64()}),
    );
}

/// A million keys into a peer `rtt` away, the mirror as its own process: the sync until the
/// canary says synced (peak RSS) and a minute idle (what verification costs the origin etcd), then
/// a handoff: the worker killed and a successor under another owner started, which adopts the
/// predecessor's leases (time until it holds the mirror, its peak RSS, the resyncs it needed),
/// and a minute idle again.
pub async fn bench_wan_million(table: &mut Table, rtt: Duration) -> anyhow::Result<()> {
    const KEYS: usize = 1_000_000;
    println!("sync {KEYS} keys into a peer {rtt:?} away, then a handoff");
    let quota = ["--quota-backend-bytes", "8589934592"];
    let prefix = keys::region_prefix("a");
    let origin = EtcdServer::start_with("wm-a", EtcdFlavor::Default, &quota).await?;
    let oc = Client::connect([origin.endpoint()], None).await?;
    fill(&oc, KEYS, "wm").await?;
    let peer = EtcdServer::start_with("wm-b", EtcdFlavor::Default, &quota).await?;
    let (_proxy, endpoint) = behind(&peer, rtt).await?;
    let specs = vec![("p0".to_string(), endpoint)];
    let pc = Client::connect([peer.endpoint()], None).await?;
    let mut first = WorkerProcess::start(&origin.endpoint(), &specs)?;
    let landing = Landing::sample(pc.clone(), prefix.clone(), KEYS);
    let synced = first.wait_synced()?;
    let (first_key, copy_rate) = landing.stop(KEYS);
    let peak = first.peak_kb();
    let missing = KEYS as i64 - count(&pc, &prefix).await;
    let recorded = checkpoint_footprint(&pc, "a").await?;
    table.row_with(
        &format!("sync {KEYS} keys{}", at_rtt(rtt)),
        "this mirror (own process)",
        format!("{:.0} keys/s", rate(KEYS, synced)),
        format!(
            "canary after {:.1}s; first key after {:.2}s ({:.1} round trips), then {copy_rate:.0} keys/s (10-90 %); peak RSS {:.1} MiB; {missing} keys missing; checkpoint {} B in {} part(s)",
            synced.as_secs_f64(),
            first_key.unwrap_or(synced).as_secs_f64(),
            first_key.unwrap_or(synced).as_secs_f64() / rtt.as_secs_f64(),
            peak as f64 / 1024.0,
            recorded.1,
            recorded.0,
        ),
        serde_json::json!({
            "keys": KEYS, "rtt_ms": rtt.as_millis() as u64, "canary_s": synced.as_secs_f64(),
            "first_key_s": first_key.map(|t| t.as_secs_f64()), "peak_rss_mib": peak as f64 / 1024.0, "missing": missing,
        }),
    );
    let origin_pid = origin.pid().map(|pid| pid.to_string()).unwrap_or_default();
    idle_verification_row(table, &origin_pid, KEYS, rtt, "the worker that synced verifies").await;
    // The handoff: killed, as a crashed Pod is; its leases stay alive only until their TTL.
    drop(first);
    let mut successor = WorkerProcess::start_successor(&origin.endpoint(), &specs)?;
    let taken_over = successor.wait_synced_counting()?;
    let adopted = taken_over.elapsed;
    let successor_peak = successor.peak_kb();
    let missing_after = KEYS as i64 - count(&pc, &prefix).await;
    // A successor verifies within the page ends its predecessor's sync recorded on the peer.
    // Two minutes: the first holds what a successor does once (the recount of the origin's keys).
    for minute in ["first", "second"] {
        let walker = format!("a successor that took over without a sync verifies, its {minute} minute");
        idle_verification_row(table, &origin_pid, KEYS, rtt, &walker).await;
    }
    table.row_with(
        &format!("handoff of {KEYS} keys{}", at_rtt(rtt)),
        "this mirror (own process, killed; a successor under another owner)",
        format!("{:.2} s", adopted.as_secs_f64()),
        format!(
            "until the successor held the mirror synced, from its start; {}; its peak RSS {:.1} MiB; {missing_after} keys missing on the peer after",
            taken_over.describe(),
            successor_peak as f64 / 1024.0,
        ),
        serde_json::json!({
            "keys": KEYS, "rtt_ms": rtt.as_millis() as u64, "adopted_s": adopted.as_secs_f64(), "resyncs": taken_over.resyncs,
            "session_failures": taken_over.session_failures,
            "peak_rss_mib": successor_peak as f64 / 1024.0, "missing": missing_after,
        }),
    );
    Ok(())
}
