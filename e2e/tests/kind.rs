//! The kind e2e's steps written in Rust: hack/kind/e2e.sh runs each by name on the clusters it made
//! (`cargo test -p aether-e2e --test kind -- --ignored --exact <step>`); the same steps run on
//! local processes in e2e.rs. The environment: AETHER_KIND_FED_DIR (federation.sh's state),
//! AETHER_E2E_KEYS and AETHER_E2E_DELETE (default 50 and 10), AETHER_E2E_PROPAGATION_TIMEOUT (s,
//! default 120); for the region loss AETHER_E2E_LAPSE_MARGIN, AETHER_E2E_STATUS_MARGIN,
//! AETHER_E2E_REFRESH_SECONDS and AETHER_E2E_RECOVERY_TIMEOUT (5, 10, 5 and 180 s); for the
//! handoffs AETHER_E2E_FORCED_READY_BOUND and AETHER_E2E_HANDOFF_TIMEOUT (60 and 180 s); for the
//! rotation AETHER_E2E_REFRESH_SECONDS, AETHER_E2E_STATUS_MARGIN and AETHER_E2E_ROTATION_TIMEOUT
//! (5, 10 and 60 s); for the uninstall AETHER_E2E_REGIONS (the regions installed, default a,b) and
//! AETHER_E2E_UNINSTALL_TIMEOUT (300 s); for the upgrade AETHER_E2E_UPGRADE_CHART (the chart's
//! .tgz), AETHER_E2E_UPGRADE_IMAGE and AETHER_E2E_UPGRADE_FLAGS (the image to upgrade to, and the
//! helm flags that select it), AETHER_E2E_UPGRADE_TIMEOUT (300 s, each roll), AETHER_E2E_LOAD_RATE,
//! AETHER_E2E_LOAD_BATCH and AETHER_E2E_LOAD_POOL (100 keys/s, 10 puts a transaction, 200 keys);
//! for the third region AETHER_E2E_WATCHING_FILE (written once the baseline is read),
//! AETHER_E2E_JOINED_FILE (the provisioning done: "ok", or why not), AETHER_E2E_JOIN_TIMEOUT (900 s)
//! and AETHER_E2E_READY_TIMEOUT (300 s).
use aether_e2e::scenarios::handoff::{HandoffBounds, leader_handoff};
use aether_e2e::scenarios::join::{JoinBounds, region_joins};
use aether_e2e::scenarios::metrics::scrape_leader;
use aether_e2e::scenarios::plugin::{Plugin, reports_healthy, watch_stale};
use aether_e2e::scenarios::rotation::{RotationBounds, rotate_peer_certificate};
use aether_e2e::scenarios::uninstall::helm_uninstall;
use aether_e2e::scenarios::upgrade::{RollBounds, deployed_image, restore_replicas, revision, roll_under_load};
use aether_e2e::scenarios::{LossBounds, data_path, region_loss, region_recovery};
use aether_e2e::substrate::{Faults, KindFederation, LeaderLoss, subtree};
use std::time::Duration;

/// A variable hack/kind/e2e.sh sets for the step.
fn required(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: hack/kind/e2e.sh sets it"))
}

fn number(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Both ways between a and b: keys put into the origin reach the peer verbatim; deleted, they go.
#[tokio::test]
#[ignore = "needs the kind clusters hack/kind/e2e.sh makes"]
async fn data_path_both_ways() {
    let kind = KindFederation::from_env().unwrap();
    let (n, deletes) = (number("AETHER_E2E_KEYS", 50) as usize, number("AETHER_E2E_DELETE", 10) as usize);
    let deadline = Duration::from_secs(number("AETHER_E2E_PROPAGATION_TIMEOUT", 120));
    for (origin, peer) in [("a", "b"), ("b", "a")] {
        let took = data_path(&kind, origin, peer, &format!("kind-{origin}"), n, deletes, deadline)
            .await
            .unwrap_or_else(|e| panic!("{origin} -> {peer}: {e:#}"));
        let seconds = |d: Duration| format!("{:.2} s", d.as_secs_f64());
        println!(
            "time: propagation {origin} -> {peer}: {n} puts, first put to all visible = {}",
            seconds(took.first_put_to_visible)
        );
        println!(
            "time: propagation {origin} -> {peer}: last put to all visible = {}",
            seconds(took.last_put_to_visible)
        );
        println!(
            "time: deletes {origin} -> {peer}: last of {deletes} deletes to gone = {}",
            seconds(took.last_delete_to_gone)
        );
    }
}

/// a goes away (its operator, then its registry etcd) and comes back, seen from b: a's copy lapses
/// within the lease's bounds, b reports a unreachable and holding 0 keys; back, every copy whole
/// and both Ready.
#[tokio::test]
#[ignore = "needs the kind clusters hack/kind/e2e.sh makes"]
async fn region_loss_and_recovery() {
    let mut kind = KindFederation::from_env().unwrap();
    // `kubectl aether status --etcd`, polled from the loss's start, must call a STALE.
    let stale = Plugin::from_env(&kind).map(|plugin| {
        tokio::spawn(async move { watch_stale(&plugin, &["a", "b"], "a", Duration::from_secs(60)).await })
    });
    let bounds = LossBounds {
        lapse_margin: Duration::from_secs(number("AETHER_E2E_LAPSE_MARGIN", 5)),
        refresh: Duration::from_secs(number("AETHER_E2E_REFRESH_SECONDS", 5)),
        status_margin: Duration::from_secs(number("AETHER_E2E_STATUS_MARGIN", 10)),
    };
    let loss = region_loss(&mut kind, "a", "b", &bounds).await.unwrap_or_else(|e| panic!("region loss: {e:#}"));
    let seconds = |d: Duration| format!("{:.1} s", d.as_secs_f64());
    println!(
        "time: region loss: operator gone to a's copy gone from b (bound {}) = {}",
        seconds(loss.lapse_bound),
        seconds(loss.lapsed)
    );
    println!(
        "time: region loss: a's etcd gone to regionpeering/b reporting a unreachable (bound {}) = {}",
        seconds(loss.unreachable_bound),
        seconds(loss.unreachable)
    );
    println!(
        "time: region loss: a's copy gone to regionpeering/b inbound[a].keys = 0 = {}",
        seconds(loss.inbound_zero)
    );
    match stale {
        Some(watch) => {
            let (took, why) = watch.await.unwrap().unwrap_or_else(|e| panic!("{e:#}"));
            println!("kubectl aether status: a STALE ({why}), b not, exit 1");
            println!(
                "time: region loss: the loss's start to kubectl aether status calling a STALE = {}",
                seconds(took)
            );
        }
        None => println!("kubectl aether status during the loss: SKIPPED (no plugin)"),
    }
    let started = std::time::Instant::now();
    let deadline = Duration::from_secs(number("AETHER_E2E_RECOVERY_TIMEOUT", 180));
    region_recovery(&mut kind, "a", loss.own_keys, &["b"], deadline)
        .await
        .unwrap_or_else(|e| panic!("recovery: {e:#}"));
    println!(
        "time: recovery: a's etcd and operator scaled to 1 to both copies whole, both Ready, a reachable = {}",
        seconds(started.elapsed())
    );
}

/// a's leader goes away four ways while its standby runs (its Pod deleted, force-deleted, its
/// process SIGKILLed, its processes frozen and its Pod force-deleted): b's copy of a keeps every
/// key in every read and loses none for a lease TTL and a keepalive interval after each, and a
/// worker that adopted the leases runs the mirror again without a full sync.
#[tokio::test]
#[ignore = "needs the kind clusters hack/kind/e2e.sh makes"]
async fn leader_handoffs() {
    let mut kind = KindFederation::from_env().unwrap();
    let bounds = HandoffBounds {
        watch_margin: Duration::from_secs(5),
        ready: Duration::from_secs(number("AETHER_E2E_FORCED_READY_BOUND", 60)),
        timeout: Duration::from_secs(number("AETHER_E2E_HANDOFF_TIMEOUT", 180)),
    };
    let seconds = |d: Duration| format!("{:.1} s", d.as_secs_f64());
    for how in [LeaderLoss::Graceful, LeaderLoss::Forced, LeaderLoss::Crashed, LeaderLoss::Lost] {
        kind.await_standby("a").await.unwrap_or_else(|e| panic!("before the {how}: {e:#}"));
        let h = leader_handoff(&mut kind, "a", "b", how, &bounds).await.unwrap_or_else(|e| panic!("{how}: {e:#}"));
        println!(
            "time: {how}: the loss of {} to {} in charge (the Lease taken, or adopted by the restarted) = {}",
            h.old_leader,
            h.new_leader,
            seconds(h.takeover)
        );
        println!("time: {how}: leader Lease = {}", h.lease);
        println!(
            "time: {how}: the loss to regionpeering/a Ready under a worker that runs the mirror = {}",
            seconds(h.ready)
        );
        println!("time: {how}: peers[b].resyncs before / after = {} / {}", h.resyncs.0, h.resyncs.1);
        println!(
            "time: {how}: keys of a on b, every one in each of the reads, none deleted = {} keys, {} reads",
            h.keys, h.reads
        );
        println!("time: {how}: keys of a re-put on b by the new leader = {} of {}", h.reput, h.keys);
    }
}

/// a's client certificate for b replaced in its Secret by a new one for the same user: a's leader
/// restarts the worker for b within a refresh and a margin and the new worker adopts the leases, no
/// Pod restarts, the leader stays, and a key put into a afterwards reaches b.
#[tokio::test]
#[ignore = "needs the kind clusters hack/kind/e2e.sh makes"]
async fn secret_rotation() {
    let kind = KindFederation::from_env().unwrap();
    let refresh = number("AETHER_E2E_REFRESH_SECONDS", 5);
    let bounds = RotationBounds {
        refresh: Duration::from_secs(refresh),
        margin: Duration::from_secs(number("AETHER_E2E_STATUS_MARGIN", 10)),
        timeout: Duration::from_secs(number("AETHER_E2E_ROTATION_TIMEOUT", 60)),
        propagation: Duration::from_secs(number("AETHER_E2E_PROPAGATION_TIMEOUT", 120)),
    };
    let r = rotate_peer_certificate(&kind, "a", "b", &bounds).await.unwrap_or_else(|e| panic!("rotation: {e:#}"));
    let seconds = |d: Duration| format!("{:.1} s", d.as_secs_f64());
    println!(
        "time: rotation: registry-etcd-peer-b replaced to {}'s worker for b restarted (refresh {refresh} s) = {}",
        r.leader,
        seconds(r.restarted)
    );
    let how = if r.resynced { "ran a full sync (ResyncStarted)" } else { "adopted the leases (LeasesAdopted)" };
    println!("time: rotation: the new worker = {how} ({})", seconds(r.taken_up));
    println!("time: rotation: put after the rotation to visible on b = {}", seconds(r.put_to_visible));
}

/// `helm uninstall --wait` in every region, one after the other, through the chart's pre-delete
/// hook: the hook Job succeeds, the RegionPeering and every object of the release go, nothing is
/// left Terminating, helm lists no release, and the CRDs stay.
#[tokio::test]
#[ignore = "needs the kind clusters hack/kind/e2e.sh makes"]
async fn helm_uninstall_everywhere() {
    let kind = KindFederation::from_env().unwrap();
    let regions = std::env::var("AETHER_E2E_REGIONS").unwrap_or_else(|_| "a,b".into());
    let regions: Vec<&str> = regions.split(',').map(str::trim).filter(|r| !r.is_empty()).collect();
    let timeout = Duration::from_secs(number("AETHER_E2E_UNINSTALL_TIMEOUT", 300));
    let seconds = |d: Duration| format!("{:.1} s", d.as_secs_f64());
    for region in &regions {
        let u = helm_uninstall(&kind, region, timeout).await.unwrap_or_else(|e| panic!("uninstall {region}: {e:#}"));
        println!(
            "time: uninstall aether-{region}: helm uninstall --wait (hook Job, finalizer, the release's objects) = {}",
            seconds(u.helm)
        );
        if let Some(hook) = u.hook {
            println!("time: uninstall aether-{region}: hook Job succeeded = {}", seconds(hook));
        }
        println!(
            "time: uninstall aether-{region}: helm uninstall to regionpeering/{region} gone (finalizer run) = {}",
            seconds(u.peering_gone)
        );
        println!(
            "time: uninstall aether-{region}: helm returned to nothing of the release left, nothing Terminating = {}",
            seconds(u.clean)
        );
    }
    // deletionPolicy Lapse (the default) leaves the copies to lapse with their leases.
    for origin in &regions {
        for peer in regions.iter().filter(|p| *p != origin) {
            let held = subtree(&kind, peer, origin)
                .await
                .map(|copy| copy.len().to_string())
                .unwrap_or_else(|e| format!("? ({e})"));
            println!(
                "uninstall: {origin}'s copy on {peer} holds {held} keys now (deletionPolicy Lapse: they lapse with their leases)"
            );
        }
    }
}

/// a's leader's /metrics through the chart's defaults: HTTPS, a bound ServiceAccount's token gets
/// 200 and the operator's families (the mirror a -> b among them); no token, a token that is none
/// and an unbound ServiceAccount's token are refused.
#[tokio::test]
#[ignore = "needs the kind clusters hack/kind/e2e.sh makes"]
async fn metrics_scrape() {
    let kind = KindFederation::from_env().unwrap();
    let s = scrape_leader(&kind, "a", "b").await.unwrap_or_else(|e| panic!("metrics: {e:#}"));
    let scheme =
        if s.secure { "HTTPS with a ServiceAccount token" } else { "plain HTTP (no --metrics-secure): open to anyone" };
    println!(
        "time: metrics: scrape of the leader {} over {scheme} ({} families) = {:.2} s",
        s.leader,
        s.families,
        s.took.as_secs_f64()
    );
    for (what, status) in s.refused {
        println!("time: metrics: /metrics with token '{what}' = HTTP {status}");
    }
}

/// a's operator upgraded with `helm upgrade` to another image, then `helm rollback` to the
/// revision before, each under 100 writes a second: no key of a missing on b in any read, every
/// Pod on the wanted image unrestarted, Ready under a leader on it, no full sync, no failed put,
/// and b's copy whole once the writes stop.
#[tokio::test]
#[ignore = "needs the kind clusters hack/kind/e2e.sh makes"]
async fn helm_upgrade_and_rollback() {
    let kind = KindFederation::from_env().unwrap();
    let (chart, new_image) = (required("AETHER_E2E_UPGRADE_CHART"), required("AETHER_E2E_UPGRADE_IMAGE"));
    let flags: Vec<String> = required("AETHER_E2E_UPGRADE_FLAGS").split_whitespace().map(String::from).collect();
    let bounds = RollBounds {
        rate: number("AETHER_E2E_LOAD_RATE", 100) as u32,
        batch: number("AETHER_E2E_LOAD_BATCH", 10) as u32,
        pool: number("AETHER_E2E_LOAD_POOL", 200) as u32,
        timeout: Duration::from_secs(number("AETHER_E2E_UPGRADE_TIMEOUT", 300)),
    };
    let old_image = deployed_image(&kind, "a").await.unwrap();
    let replicas = restore_replicas(&kind, "a", Duration::from_secs(120)).await.unwrap_or_else(|e| panic!("{e:#}"));
    let before = revision(&kind, "a").await.unwrap();
    println!("upgrade: {old_image} at helm revision {before}, {replicas} replicas; upgrading to {new_image}");
    let upgrade: Vec<String> =
        ["upgrade", "aether", chart.as_str(), "--reuse-values"].into_iter().map(String::from).chain(flags).collect();
    let rollback: Vec<String> = vec!["rollback".into(), "aether".into(), before.to_string()];
    for (label, want, args) in [("upgrade", &new_image, upgrade), ("rollback", &old_image, rollback)] {
        let r = roll_under_load(&kind, "a", "b", label, want, &args, &bounds).await.unwrap_or_else(|e| panic!("{e:#}"));
        let seconds = |d: Duration| format!("{:.1} s", d.as_secs_f64());
        println!("time: {label}: helm {} to the Deployment rolled out = {}", args[0], seconds(r.rolled));
        println!(
            "time: {label}: helm {} to regionpeering/a Ready under a leader on the new Pods = {}",
            args[0],
            seconds(r.ready)
        );
        println!("time: {label}: leaders during the roll = {} ({})", r.leaders.len(), r.leaders.join(","));
        println!("time: {label}: keys of a missing on b (writer running) = 0 of {}", r.keys);
        println!(
            "time: {label}: peers[b].resyncs before / after; LeasesAdopted before / after = {} / {}; {} / {}",
            r.resyncs.0, r.resyncs.1, r.adopted.0, r.adopted.1
        );
        println!(
            "time: {label}: writer into aether-a (puts, puts/s, failed txns, slowest txn) = {}, {:.1}/s, {}, {} ms",
            r.writer.puts,
            r.writer.rate(),
            r.writer.failed,
            r.writer.slowest.as_millis()
        );
        println!("time: {label}: writer stopped to b's copy equal = {}", seconds(r.settled_after));
    }
}

/// c joins a and b while hack/kind/e2e.sh provisions it (federation.sh up a b c, the image, the
/// chart installed in c and a's and b's releases upgraded with c as a peer): a's copy on b and b's
/// on a keep every key in every read; then every RegionPeering Ready with two peers, c's keys on a
/// and b, theirs on c, and neither a -> b nor b -> a re-synced.
#[tokio::test]
#[ignore = "needs the kind clusters hack/kind/e2e.sh makes"]
async fn third_region_joins() {
    let kind = KindFederation::from_env().unwrap();
    let (watching, joined) = (required("AETHER_E2E_WATCHING_FILE"), required("AETHER_E2E_JOINED_FILE"));
    let join_timeout = Duration::from_secs(number("AETHER_E2E_JOIN_TIMEOUT", 900));
    let bounds = JoinBounds {
        ready: Duration::from_secs(number("AETHER_E2E_READY_TIMEOUT", 300)),
        propagation: Duration::from_secs(number("AETHER_E2E_PROPAGATION_TIMEOUT", 120)),
        keys: number("AETHER_E2E_KEYS", 50) as usize,
    };
    // The provisioning is hack/kind/e2e.sh's: it writes "ok" into the file once done, or why not.
    let provisioned = async {
        let start = std::time::Instant::now();
        loop {
            if let Ok(said) = std::fs::read_to_string(&joined) {
                anyhow::ensure!(said.trim() == "ok", "the provisioning of c failed: {said}");
                return Ok(());
            }
            anyhow::ensure!(start.elapsed() < join_timeout, "c not provisioned within {} s", join_timeout.as_secs());
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    let started = || std::fs::write(&watching, "watching").unwrap();
    let j =
        region_joins(&kind, "c", &["a", "b"], started, provisioned, &bounds).await.unwrap_or_else(|e| panic!("{e:#}"));
    let seconds = |d: Duration| format!("{:.1} s", d.as_secs_f64());
    println!(
        "time: third region: federation.sh up c, the image, helm install c and upgrade a and b = {}",
        seconds(j.joined)
    );
    println!("time: third region: helm done to a, b, c Ready with two peers each = {}", seconds(j.ready));
    println!("time: third region: keys put into c to visible on a and b = {}", seconds(j.new_to_peers));
    println!(
        "time: third region: keys of a and b kept on each other, in every read = {} keys, {} reads",
        j.kept_keys, j.reads
    );
    println!("time: third region: resyncs of the existing mirrors (unchanged) = {:?}", j.resyncs);
}

/// `kubectl aether status` (plain and `--etcd`) and `kubectl aether doctor a` on the healthy
/// federation, as the shipped plugin: healthy, every copy counted, the origins' local etcds checked
/// by their leaders.
#[tokio::test]
#[ignore = "needs the kind clusters hack/kind/e2e.sh makes"]
async fn plugin_reports_healthy() {
    let kind = KindFederation::from_env().unwrap();
    let Some(plugin) = Plugin::from_env(&kind) else {
        println!("kubectl aether: SKIPPED (no plugin)");
        return;
    };
    let mut on_peer = std::collections::BTreeMap::new();
    for (origin, peer) in [("a", "b"), ("b", "a")] {
        on_peer.insert(origin.to_string(), subtree(&kind, peer, origin).await.unwrap().len() as i64);
    }
    let (status, doctor) = reports_healthy(&plugin, &["a", "b"], &on_peer).await.unwrap_or_else(|e| panic!("{e:#}"));
    println!(
        "time: kubectl aether status --etcd over both contexts (healthy, origins checked by their leaders) = {:.1} s",
        status.as_secs_f64()
    );
    println!(
        "time: kubectl aether doctor a from this host (its local etcd checked by the leader) = {:.1} s",
        doctor.as_secs_f64()
    );
}
