//! The multi-region scenario on local real parts, with two regions and then three: visibility,
//! the data path, a leader handoff, the loss of a region and its recovery; then, on the two
//! regions, a third one joining. Every step is checked through the RegionPeering status as well as
//! through etcd.
use aether_e2e::scenarios::handoff::{HandoffBounds, leader_handoff};
use aether_e2e::scenarios::join::{JoinBounds, region_joins};
use aether_e2e::scenarios::{LossBounds, region_loss, region_recovery};
use aether_e2e::substrate::{Faults, LeaderLoss};
use aether_e2e::{Federation, endpoint_key, endpoint_value};
use aether_harness::wait_until;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(90);

/// Waits until `region` holds `n` keys of `origin`.
async fn wait_keys(fed: &Federation, region: &str, origin: &str, n: i64, what: &str) {
    wait_until(&format!("{what}: {n} keys of {origin} in {region}"), WAIT, || async move {
        Ok(fed.keys_of(region, origin).await? == n)
    })
    .await
    .unwrap();
}

async fn scenario(names: &[&str]) -> Federation {
    let mut fed = Federation::start(names).await.expect("regions start");
    fed.apply_peerings().unwrap();
    for r in names {
        fed.write_endpoints(r, 200).await.unwrap();
    }
    // Two replicas in a (for the handoff), one elsewhere.
    fed.start_operator("a").unwrap();
    fed.start_operator("a").unwrap();
    for r in &names[1..] {
        fed.start_operator(r).unwrap();
    }

    // 1. Visibility: every region Ready, every region holds every other's subtree.
    for r in names {
        fed.wait_condition(r, "Ready", "True", WAIT).await.unwrap();
    }
    // Every copy is its origin's subtree, key for key (the same step the kind e2e runs).
    aether_e2e::substrate::wait_copies_whole(&fed, names, WAIT).await.unwrap();
    for r in names {
        for origin in names {
            assert_eq!(fed.keys_of(r, origin).await.unwrap(), 200, "{origin}'s keys in {r}");
        }
        let status = fed.peering(r).await.unwrap().status.unwrap();
        assert_eq!(status.peers_ready, Some(format!("{0}/{0}", names.len() - 1)));
        assert!(status.peers.iter().all(|p| p.replication.keys == 200 && p.replication.synced));
    }
    // One command shows the whole federation, checked on every peer etcd too.
    let contexts: Vec<String> = names.iter().flat_map(|r| ["--context".to_string(), r.to_string()]).collect();
    let with_contexts =
        |first: &[&str]| first.iter().map(|s| s.to_string()).chain(contexts.clone()).collect::<Vec<_>>();
    let args = with_contexts(&["status", "--etcd"]);
    let (healthy, table) = fed.operator_cli(&args.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
    assert!(healthy, "status of a healthy federation exits 0:\n{table}");
    println!("{table}");
    for origin in names {
        for peer in names.iter().filter(|p| *p != origin) {
            assert!(
                table.lines().any(|l| l.split_whitespace().take(3).collect::<Vec<_>>() == [*origin, *peer, "Watching"]),
                "{origin} -> {peer} in:\n{table}"
            );
        }
    }
    let args = with_contexts(&["status", "-o", "json"]);
    let (_, json) = fed.kubectl_plugin(&args.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
    let json: serde_json::Value = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {json}"));
    assert_eq!(json["healthy"], true, "{json}");
    assert_eq!(json["mirrors"].as_array().unwrap().len(), names.len() * (names.len() - 1));
    let (passed, findings) = fed.operator_cli(&["doctor", "a", "--context", "a"]).unwrap();
    assert!(passed && findings.contains("connect") && !findings.contains("FAIL"), "{findings}");

    // 2. Data path: written in a, seen everywhere; deleted in a, gone everywhere.
    let mut a = fed.registry_client("a").await.unwrap();
    a.put(endpoint_key("a", 9999), endpoint_value("a", 9999), None).await.unwrap();
    for r in &names[1..] {
        let r = *r;
        wait_keys(&fed, r, "a", 201, "put mirrored").await;
    }
    a.delete(endpoint_key("a", 9999), None).await.unwrap();
    for r in &names[1..] {
        let r = *r;
        wait_keys(&fed, r, "a", 200, "delete mirrored").await;
    }

    // 3. Leader handoffs in a: the leader crashed (SIGKILL), then frozen (SIGSTOP) while a standby
    // runs; no mirrored key of a disappears in b, the successor adopts the leases (the same step the
    // kind e2e runs, there also with a graceful and a forced one).
    let bounds = HandoffBounds { watch_margin: Duration::from_secs(5), ready: WAIT, timeout: WAIT * 2 };
    for how in [LeaderLoss::Crashed, LeaderLoss::Lost] {
        fed.await_standby("a").await.unwrap();
        let handoff = leader_handoff(&mut fed, "a", "b", how, &bounds).await.unwrap_or_else(|e| panic!("{how}: {e:#}"));
        println!("{how}: {handoff:?}");
        assert_ne!(handoff.new_leader, handoff.old_leader, "nothing restarts a local operator in place");
    }
    for r in &names[1..] {
        assert_eq!(fed.keys_of(r, "a").await.unwrap(), 200);
    }

    // 4. Region loss: a's operators and a's registry etcd go away; a's copy lapses on b within the
    // lease's bounds and b reports a unreachable (the same step the kind e2e runs).
    let bounds = LossBounds {
        lapse_margin: Duration::from_secs(5),
        refresh: Duration::from_secs(1), // the operators' --refresh-seconds here
        status_margin: Duration::from_secs(10),
    };
    let loss = region_loss(&mut fed, "a", "b", &bounds).await.unwrap();
    println!("region loss: {loss:?}");
    for r in &names[1..] {
        let r = *r;
        wait_keys(&fed, r, "a", 0, "a's mirror expires").await;
        fed.wait_condition(r, "PeersReachable", "False", WAIT).await.unwrap();
        let status = fed.peering(r).await.unwrap().status.unwrap();
        let a_peer = status.peers.iter().find(|p| p.region == "a").unwrap();
        assert!(!a_peer.reachable);
        // Their own mirrors are unaffected.
        for other in names.iter().filter(|o| **o != "a" && **o != r) {
            assert_eq!(fed.keys_of(other, r).await.unwrap(), 200, "{r}'s mirror in {other}");
        }
        assert_eq!(fed.keys_of(r, r).await.unwrap(), 200);
    }
    // Nobody refreshes a's status now: `status` says so, within a refresh and the Lease's
    // duration of the operators going, instead of reading its last words as healthy.
    let args = with_contexts(&["status"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    wait_until("status names a's status stale", Duration::from_secs(60 + 8 + 10), || {
        let (fed, args) = (&fed, &args);
        async move {
            let (code, table) = fed.operator_cli_exit(args)?;
            let stale = table.lines().any(|l| l.starts_with("region a (") && l.contains("STALE"));
            Ok(code == Some(1) && stale)
        }
    })
    .await
    .unwrap();
    // A kubeconfig it cannot read is no verdict on the federation: exit 2, naming the file.
    let out = std::process::Command::new(aether_e2e::operator_binary().unwrap())
        .args(["status", "--kubeconfig", "/nonexistent/kubeconfig"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/kubeconfig"), "{out:?}");
    let args = with_contexts(&["status"]);
    let (healthy, table) = fed.kubectl_plugin(&args.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
    assert!(!healthy, "status exits non-zero while a region is down:\n{table}");
    assert!(table.contains("not healthy") && table.contains("-> a"), "{table}");

    // 5. Recovery: a comes back, resyncs and is Ready; the others reach it again (the same step the
    // kind e2e runs).
    region_recovery(&mut fed, "a", loss.own_keys, &names[1..], WAIT).await.unwrap();
    for r in &names[1..] {
        assert_eq!(fed.keys_of(r, "a").await.unwrap(), 200, "a's keys back in {r}");
    }
    let args = with_contexts(&["status", "--wait", "60"]);
    let (healthy, table) = fed.operator_cli(&args.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
    assert!(healthy, "status --wait returns once the federation recovered:\n{table}");

    // 6. The data path both ways after the recovery: the same step the kind e2e runs.
    for (origin, peer) in [("a", "b"), ("b", "a")] {
        aether_e2e::scenarios::data_path(&fed, origin, peer, "data-path", 50, 10, WAIT).await.unwrap();
    }
    fed
}

/// Step 7: `new` joins the running federation (the same scenario the kind e2e runs with Helm): its API
/// server, etcd and operator come up, then its RegionPeering and every existing region's, each now
/// peering with it, are applied. No existing copy loses a key in any read, every RegionPeering is
/// Ready with every peer, the keys flow both ways, and no existing mirror re-syncs.
async fn a_region_joins(mut fed: Federation, new: &str) {
    let existing: Vec<String> = fed.regions.iter().map(|r| r.name.clone()).collect();
    let existing: Vec<&str> = existing.iter().map(String::as_str).collect();
    fed.add_region(new).await.unwrap();
    fed.write_endpoints(new, 200).await.unwrap();
    fed.start_operator(new).unwrap();
    let apply = async {
        for region in std::iter::once(new).chain(existing.iter().copied()) {
            fed.apply_peering(region)?;
        }
        Ok(())
    };
    let bounds = JoinBounds { ready: WAIT, propagation: WAIT, keys: 50 };
    let join = region_joins(&fed, new, &existing, || {}, apply, &bounds).await.unwrap_or_else(|e| panic!("{e:#}"));
    println!("{new} joins {existing:?}: {join:?}");
    assert!(join.reads > 0, "the existing copies were never read while {new} joined");
}

#[tokio::test]
async fn two_regions() {
    let fed = scenario(&["a", "b"]).await;
    a_region_joins(fed, "c").await;
}

#[tokio::test]
async fn three_regions() {
    scenario(&["a", "b", "c"]).await;
}
