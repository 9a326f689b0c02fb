//! Upgrading from the previous release (the last one RELEASES lists, built from its commit by
//! hack/previous-release.sh) to this tree, and rolling back, the way a Deployment's rolling update
//! does it (a new replica ready, then an old one stopped), while region a writes 50 endpoints a
//! second: no key of a goes missing on b at any read, nothing is deleted, no full sync runs but
//! each region's first (each new leader adopts the leases its predecessor recorded), and every
//! write arrives.
use aether_e2e::{Federation, LEASE_TTL_SECONDS, endpoint_key, endpoint_value, operator_binary};
use aether_harness::wait_until;
use aether_operator::keys;
use etcd_client::{EventType, GetOptions, WatchOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(120);

/// The previous release's operator binary (built once, cached by commit).
fn previous_release() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../hack/previous-release.sh");
    let out = std::process::Command::new(&script).output().expect("hack/previous-release.sh runs");
    assert!(out.status.success(), "hack/previous-release.sh: {}", String::from_utf8_lossy(&out.stderr));
    let path = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().trim().to_string();
    assert!(Path::new(&path).is_file(), "hack/previous-release.sh printed {path:?}");
    PathBuf::from(path)
}

/// Whether an operator answers on its metrics port (its /readyz).
async fn ready(port: u16) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else { return false };
    if s.write_all(b"GET /readyz HTTP/1.0\r\nHost: x\r\n\r\n").await.is_err() {
        return false;
    }
    let mut body = String::new();
    s.read_to_string(&mut body).await.is_ok() && body.lines().next().is_some_and(|status| status.contains(" 200"))
}

/// Replaces every operator of `region` with one of `binary`, one at a time: the new one ready
/// first, then an old one stopped cleanly.
async fn roll(fed: &mut Federation, region: &str, binary: &Path) {
    let old: Vec<String> =
        fed.operators[region].iter().filter(|o| o.process.is_running()).map(|o| o.name.clone()).collect();
    for name in old {
        fed.start_operator_from(region, binary).unwrap();
        let port = fed.operators[region].last().unwrap().metrics_port;
        wait_until("the new replica ready", WAIT, || async move { Ok(ready(port).await) }).await.unwrap();
        tokio::task::block_in_place(|| fed.stop_operator(&name));
        // What a rollout waits between pods (minReadySeconds): the leadership may move meanwhile.
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_from_the_previous_release_and_a_rollback_under_writes_lose_no_key_and_resync_nothing() {
    let previous = previous_release();
    let current = operator_binary().unwrap();
    let mut fed = Federation::start(&["a", "b"]).await.expect("regions start");
    fed.apply_peerings().unwrap();
    fed.write_endpoints("a", 500).await.unwrap();
    fed.write_endpoints("b", 500).await.unwrap();
    for region in ["a", "a", "b"] {
        fed.start_operator_from(region, &previous).unwrap();
    }
    fed.wait_condition("a", "Ready", "True", WAIT).await.unwrap();
    fed.wait_condition("b", "Ready", "True", WAIT).await.unwrap();
    assert_eq!(fed.keys_of("b", "a").await.unwrap(), 500);

    // b's view of a from now on: every put and delete, and the count at every read.
    let mut b = fed.registry_client("b").await.unwrap();
    let (puts, deletes) = (Arc::new(AtomicI64::new(0)), Arc::new(AtomicI64::new(0)));
    let mut watch = b.watch(keys::region_prefix("a"), Some(WatchOptions::new().with_prefix())).await.unwrap();
    let (p, d) = (puts.clone(), deletes.clone());
    tokio::spawn(async move {
        while let Ok(Some(resp)) = watch.message().await {
            for e in resp.events() {
                let counter = if e.event_type() == EventType::Put { &p } else { &d };
                counter.fetch_add(1, Ordering::SeqCst);
            }
        }
    });
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicI64::new(0));
    let writer = {
        let (mut a, stop, written) = (fed.registry_client("a").await.unwrap(), stop.clone(), written.clone());
        tokio::spawn(async move {
            let mut i = 500;
            while !stop.load(Ordering::SeqCst) {
                a.put(endpoint_key("a", i), endpoint_value("a", i), None).await.unwrap();
                written.fetch_add(1, Ordering::SeqCst);
                i += 1;
                tokio::time::sleep(Duration::from_millis(20)).await; // 50 endpoints a second
            }
        })
    };
    let shrank = Arc::new(AtomicI64::new(0));
    let reader = {
        let (mut b, stop, shrank) = (b.clone(), stop.clone(), shrank.clone());
        tokio::spawn(async move {
            let mut most = 0;
            while !stop.load(Ordering::SeqCst) {
                let count = b
                    .get(keys::region_prefix("a"), Some(GetOptions::new().with_prefix().with_count_only()))
                    .await
                    .map(|r| r.count())
                    .unwrap_or(most);
                if count < most {
                    shrank.fetch_add(1, Ordering::SeqCst);
                }
                most = most.max(count);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };

    let settle = Duration::from_secs(2 * LEASE_TTL_SECONDS as u64);
    roll(&mut fed, "a", &current).await;
    roll(&mut fed, "b", &current).await;
    tokio::time::sleep(settle).await; // two TTLs on the new release
    roll(&mut fed, "a", &previous).await;
    roll(&mut fed, "b", &previous).await;
    tokio::time::sleep(settle).await; // two TTLs back on the previous release
    stop.store(true, Ordering::SeqCst);
    writer.await.unwrap();
    reader.await.unwrap();

    let total = 500 + written.load(Ordering::SeqCst);
    wait_until("every write in b", WAIT, || {
        let fed = &fed;
        async move { Ok(fed.keys_of("b", "a").await? == total) }
    })
    .await
    .unwrap();
    // What the operators said of their sessions: full syncs (ResyncStarted, counted through the
    // event series each recorder folds repeats into) and adoptions.
    let mut said = String::new();
    let mut full_syncs = 0;
    for region in ["a", "b"] {
        let out = fed
            .region(region)
            .apiserver
            .kubectl()
            .unwrap()
            .args(["get", "events", "-A", "-o", "json"])
            .output()
            .unwrap();
        let events: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        for e in events["items"].as_array().cloned().unwrap_or_default() {
            let reason = e["reason"].as_str().unwrap_or_default().to_string();
            let count = e["series"]["count"].as_i64().or(e["count"].as_i64()).unwrap_or(1);
            if reason == "ResyncStarted" {
                full_syncs += count;
            }
            let from = e["reportingInstance"].as_str().unwrap_or_default();
            said.push_str(&format!(
                "{region}: {reason} x{count} from {from}: {}\n",
                e["message"].as_str().unwrap_or_default()
            ));
        }
    }
    println!("{said}");
    let (puts, written) = (puts.load(Ordering::SeqCst), written.load(Ordering::SeqCst));
    println!(
        "{written} endpoints written in a during the rolls; {puts} puts on b (the rest moved by online shard splits)"
    );
    assert_eq!(shrank.load(Ordering::SeqCst), 0, "a's copy on b went short at some read\n{said}");
    assert_eq!(deletes.load(Ordering::SeqCst), 0, "keys of a were deleted on b\n{said}");
    assert_eq!(
        full_syncs, 2,
        "a full sync besides each region's first: a resync in the upgrade or the rollback\n{said}"
    );
    assert!(puts >= written, "{puts} puts on b for {written} writes");
    fed.wait_condition("a", "Ready", "True", WAIT).await.unwrap();
}
