//! Lease layouts (keys per lease against sync time and lease count) and the sync under
//! least-privilege etcd auth.
use crate::fixtures::{bench_config, count, fill, rate, raw_copy_client, spawn_worker, wait_synced};
use crate::sync::checkpoint_footprint;
use crate::table::Table;
use aether_harness::{EtcdFlavor, EtcdServer};
use aether_operator::keys;
use aether_operator::mirror::EtcdTarget;
use etcd_client::Client;
use std::time::{Duration, Instant};

pub const MATRIX_KEYS: usize = 20_000;

/// How long one lease layout may take to sync the matrix's keys.
pub const LEASE_BUDGET: Duration = Duration::from_secs(60);

pub async fn bench_leases(table: &mut Table) -> anyhow::Result<()> {
    println!("lease layouts: {MATRIX_KEYS} keys, one lease vs sharded, auth off/on, etcd 3.6 and 3.4");
    for flavor in [EtcdFlavor::Default, EtcdFlavor::V3_4] {
        for auth in [false, true] {
            let origin = EtcdServer::start_with("lm-a", flavor, &[]).await?;
            let oc = Client::connect([origin.endpoint()], None).await?;
            fill(&oc, MATRIX_KEYS, "lm").await?;
            let mut results = Vec::new();
            for (layout, per_lease) in [
                ("no lease (raw)", 0u64),
                ("one lease", u64::MAX / 4),
                ("default settings (1000 keys/lease; 64 when auth binds the user)", 1000),
                ("sharded, 100 keys/lease (64 when auth binds the user)", 100),
            ] {
                // Runs under a second vary by about 10 %: the rows a target is read from (the
                // no-lease time and the default settings) are the median of three.
                let runs = if per_lease == 0 || per_lease == 1000 { MEDIAN_OF } else { 1 };
                let mut measured = Vec::with_capacity(runs);
                for _ in 0..runs {
                    measured.push(sync_layout(&origin, &oc, flavor, auth, per_lease).await?);
                }
                results.push((layout, measured));
            }
            let base = median(results[0].1.iter().map(|r| r.seconds).collect());
            let interval = bench_config("b").keepalive_interval.as_secs_f64();
            for (asked, measured) in results {
                let seconds = median(measured.iter().map(|r| r.seconds).collect());
                let done = measured.iter().map(|r| r.done).min().unwrap_or(0);
                let leases = measured.last().map_or(0, |r| r.leases);
                // The label says what ran: auth caps the keys a lease may carry, so "one lease"
                // there runs as many leases as the cap needs.
                let layout = match asked {
                    "one lease" if leases > 1 => format!("one lease asked, {leases} ran (auth caps keys per lease)"),
                    _ => asked.to_string(),
                };
                let runs = if measured.len() > 1 {
                    let each: Vec<String> = measured.iter().map(|r| format!("{:.2}", r.seconds)).collect();
                    format!(" (median of {}: {} s)", measured.len(), each.join(" / "))
                } else {
                    String::new()
                };
                let note = if done == MATRIX_KEYS {
                    format!(
                        "{seconds:.2}s{runs}, {:.2}x the no-lease time; {leases} leases, {:.0} keepalive messages/s on one stream",
                        seconds / base,
                        leases as f64 / interval
                    )
                } else {
                    format!("did not finish: {done} keys in {seconds:.0}s{runs}")
                };
                table.row(
                    &format!(
                        "sync {MATRIX_KEYS} keys, etcd {}, auth {}",
                        if flavor == EtcdFlavor::V3_4 { "3.4" } else { "3.6" },
                        if auth { "on" } else { "off" }
                    ),
                    &layout,
                    format!("{:.0} keys/s", rate(done, Duration::from_secs_f64(seconds))),
                    note,
                );
            }
        }
    }
    Ok(())
}

/// Runs of a row whose ratio a target is read from.
const MEDIAN_OF: usize = 3;

/// One sync of the matrix's keys into a fresh peer.
struct LayoutRun {
    seconds: f64,
    /// Keys on the peer at the end (all of them unless the budget ran out).
    done: usize,
    leases: usize,
}

/// Syncs the origin's keys into a fresh peer: the plain copy (`per_lease` 0) or the mirror with
/// `per_lease` keys a lease.
async fn sync_layout(
    origin: &EtcdServer,
    oc: &Client,
    flavor: EtcdFlavor,
    auth: bool,
    per_lease: u64,
) -> anyhow::Result<LayoutRun> {
    let peer = EtcdServer::start_with("lm-b", flavor, &[]).await?;
    let target = if auth { enable_auth(&peer).await? } else { EtcdTarget::plain([peer.endpoint()]) };
    let start = Instant::now();
    let mut finished = true;
    let mut leases = 0;
    if per_lease == 0 {
        let pc = target.connect().await?;
        raw_copy_client(oc, &pc).await?;
    } else {
        let mut cfg = bench_config("b");
        cfg.max_keys_per_lease = per_lease;
        let h = spawn_worker(cfg, origin, target.clone());
        // With auth on, etcd checks every key already on a lease at each put attached to it:
        // one big lease is quadratic. Give it a budget.
        finished = wait_synced(&h, LEASE_BUDGET).await.is_ok();
        leases = h.health().leases;
        h.shutdown().await;
    }
    let seconds = start.elapsed().as_secs_f64();
    let done = if finished {
        MATRIX_KEYS
    } else {
        let options = if auth { Some(etcd_client::ConnectOptions::new().with_user("root", "rootpw")) } else { None };
        count(&Client::connect([peer.endpoint()], options).await?, &keys::region_prefix("a")).await as usize
    };
    Ok(LayoutRun { seconds, done, leases })
}

/// The middle value (of an odd count; the upper middle of an even one).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Sets up the least-privilege role on a peer and turns auth on; returns the mirror's target.
pub async fn enable_auth(peer: &EtcdServer) -> anyhow::Result<EtcdTarget> {
    let mut admin = Client::connect([peer.endpoint()], None).await?;
    admin.user_add("root", "rootpw", None).await?;
    admin.user_grant_role("root", "root").await?;
    admin.role_add("mirror-a").await?;
    for prefix in [keys::region_prefix("a"), keys::federation_prefix("a")] {
        admin
            .role_grant_permission("mirror-a", etcd_client::Permission::read_write(prefix.as_str()).with_prefix())
            .await?;
    }
    admin.user_add("mirror-a", "pw", None).await?;
    admin.user_grant_role("mirror-a", "mirror-a").await?;
    admin.auth_enable().await?;
    Ok(EtcdTarget::plain([peer.endpoint()]).with_user("mirror-a", "pw"))
}

/// A least-privilege user's sync at scale (default settings): the plain copy into a
/// fresh peer as the same user, then the mirror; the mirror's lease layout and how its checkpoint
/// is stored (at 1M keys and 64 keys a lease, 1.6 MB: in parts).
pub async fn bench_auth_at_scale(table: &mut Table, keys_n: usize, flavor: EtcdFlavor) -> anyhow::Result<()> {
    let version = if flavor == EtcdFlavor::V3_4 { "3.4" } else { "3.6" };
    println!("least-privilege auth at scale: sync {keys_n} keys, etcd {version}");
    let quota = ["--quota-backend-bytes", "8589934592"];
    let origin = EtcdServer::start_with("as-a", flavor, &quota).await?;
    let oc = Client::connect([origin.endpoint()], None).await?;
    fill(&oc, keys_n, "as").await?;
    // The median of three where a run takes seconds; 1M keys (minutes) once.
    let runs = if keys_n <= 100_000 { MEDIAN_OF } else { 1 };
    let (mut raws, mut mirrors) = (Vec::with_capacity(runs), Vec::with_capacity(runs));
    let (mut finished, mut last) = (true, None);
    for _ in 0..runs {
        let raw_peer = EtcdServer::start_with("as-raw", flavor, &quota).await?;
        let raw_target = enable_auth(&raw_peer).await?;
        let started = Instant::now();
        raw_copy_client(&oc, &raw_target.connect().await?).await?;
        raws.push(started.elapsed().as_secs_f64());
        drop(raw_peer);

        let peer = EtcdServer::start_with("as-b", flavor, &quota).await?;
        let target = enable_auth(&peer).await?;
        let started = Instant::now();
        let h = spawn_worker(bench_config("b"), &origin, target.clone());
        finished &= wait_synced(&h, Duration::from_secs(1200)).await.is_ok();
        mirrors.push(started.elapsed().as_secs_f64());
        let leases = h.health().leases;
        h.shutdown().await;
        let pc = target.connect().await?;
        let missing = keys_n as i64 - count(&pc, &keys::region_prefix("a")).await;
        let (parts, bytes) = checkpoint_footprint(&pc, "a").await?;
        // A key missing after any run is a failure of the row.
        let missing = last.map_or(missing, |(_, m, _, _): (usize, i64, usize, usize)| m.max(missing));
        last = Some((leases, missing, parts, bytes));
    }
    let (leases, missing, parts, bytes) = last.expect("at least one run");
    let (raw, elapsed) = (median(raws.clone()), median(mirrors.clone()));
    let each = |v: &[f64]| v.iter().map(|s| format!("{s:.2}")).collect::<Vec<_>>().join(" / ");
    let runs_note = if runs > 1 {
        format!(" (median of {runs}: the mirror {} s, the plain copy {} s)", each(&mirrors), each(&raws))
    } else {
        String::new()
    };
    table.row_with(
        &format!("sync {keys_n} keys, etcd {version}, auth on"),
        "this mirror, default settings",
        format!("{:.0} keys/s", rate(keys_n, Duration::from_secs_f64(elapsed))),
        format!(
            "{}{elapsed:.2}s, {:.2}x the no-lease time ({raw:.2}s){runs_note}; {leases} leases; {missing} keys missing (failures); checkpoint {bytes} B in {parts} part(s)",
            if finished { "" } else { "did not finish: " },
            elapsed / raw,
        ),
        serde_json::json!({
            "keys": keys_n, "seconds": elapsed, "raw_seconds": raw, "runs": runs, "seconds_each": mirrors,
            "raw_seconds_each": raws, "finished": finished, "leases": leases, "missing": missing,
            "checkpoint_parts": parts, "checkpoint_bytes": bytes,
        }),
    );
    Ok(())
}
