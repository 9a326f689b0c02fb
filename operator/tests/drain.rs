//! The v0 -> v1 drain against a real etcd: concurrent legacy and v1 writers, restarts, malformed
//! values and dry runs.
use aether_harness::{EtcdServer, wait_until};
use aether_operator::drain::{DrainPhase, DrainReport, DrainSettings, drain};
use aether_operator::keys::{self, EndpointKeyV0};
use etcd_client::{Client, GetOptions, Txn, TxnOp};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

fn legacy_key(i: usize) -> String {
    format!(
        "/aether/services/svc{}/protocols/{}/endpoints/10.{}.{}.{}",
        i % 40,
        ["http", "grpc"][i % 2],
        i / 65536,
        (i / 256) % 256,
        i % 256
    )
}

/// The origin a legacy value names; every seventh value names none (the defaults apply).
fn origin(i: usize) -> Option<(String, String)> {
    (!i.is_multiple_of(7)).then(|| (format!("r{}", i % 3), format!("c{}", i % 4)))
}

fn legacy_value(i: usize, version: &str) -> String {
    match origin(i) {
        Some((r, c)) => {
            format!(r#"{{"region":"{r}","clusterName":"{c}","zone":"z","address":"x","version":"{version}"}}"#)
        }
        None => format!(r#"{{"zone":"z","address":"x","version":"{version}"}}"#),
    }
}

fn v1_key(i: usize) -> String {
    let (r, c) = origin(i).unwrap_or(("dflt".into(), "dflt-c".into()));
    EndpointKeyV0::parse(&legacy_key(i)).unwrap().to_v1(&r, &c).to_string()
}

fn settings() -> DrainSettings {
    let mut s = DrainSettings::new("dflt", "dflt-c");
    s.quiet_period = Duration::from_secs(1);
    s
}

async fn write_legacy(c: &mut Client, range: std::ops::Range<usize>, version: &str) {
    let all: Vec<usize> = range.collect();
    for chunk in all.chunks(120) {
        let ops: Vec<TxnOp> =
            chunk.iter().map(|i| TxnOp::put(legacy_key(*i), legacy_value(*i, version), None)).collect();
        c.txn(Txn::new().and_then(ops)).await.unwrap();
    }
}

async fn count(c: &mut Client, prefix: &str) -> i64 {
    c.get(prefix, Some(GetOptions::new().with_prefix().with_count_only())).await.unwrap().count()
}

async fn run_drain(client: &Client, settings: &DrainSettings) -> DrainReport {
    let (tx, _rx) = watch::channel(DrainReport::default());
    tokio::time::timeout(Duration::from_secs(120), drain(client, settings, &tx, &CancellationToken::new()))
        .await
        .expect("the drain finishes")
        .expect("the drain succeeds")
}

#[tokio::test]
async fn twenty_thousand_keys_drain_losslessly_under_concurrent_writers() {
    let etcd = EtcdServer::start("drain").await.unwrap();
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    const N: usize = 20_000;
    write_legacy(&mut c, 0..N, "v0").await;

    // The newest write of each endpoint, by revision, whichever layout it went to.
    let latest: Arc<Mutex<HashMap<usize, (i64, String)>>> = Arc::new(Mutex::new(HashMap::new()));
    let stop = CancellationToken::new();
    let legacy_writer = {
        let (mut c, latest, stop) = (c.clone(), latest.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0usize;
            while !stop.is_cancelled() {
                let i = (n * 7919) % N;
                let value = legacy_value(i, &format!("legacy-{n}"));
                let resp = c.put(legacy_key(i), value.clone(), None).await.unwrap();
                latest.lock().unwrap().insert(i, (resp.header().unwrap().revision(), value));
                n += 1;
            }
            n
        })
    };
    let v1_writer = {
        let (mut c, latest, stop) = (c.clone(), latest.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0usize;
            while !stop.is_cancelled() {
                // A new registrar writes its endpoints straight to v1.
                let i = (n * 104_729 + 3) % N;
                let value = legacy_value(i, &format!("v1-{n}"));
                let resp = c.put(v1_key(i), value.clone(), None).await.unwrap();
                latest.lock().unwrap().insert(i, (resp.header().unwrap().revision(), value));
                n += 1;
            }
            n
        })
    };

    let drained = {
        let client = c.clone();
        tokio::spawn(async move { run_drain(&client, &settings()).await })
    };
    // Keep writing while the drain copies, then go quiet so that it can finish.
    wait_until("some writes", Duration::from_secs(30), || {
        let latest = latest.clone();
        async move { Ok(latest.lock().unwrap().len() > 2000) }
    })
    .await
    .unwrap();
    stop.cancel();
    let (legacy_writes, v1_writes) = (legacy_writer.await.unwrap(), v1_writer.await.unwrap());
    let report = drained.await.unwrap();
    eprintln!("{}legacy writes during the drain: {legacy_writes}, v1 writes: {v1_writes}", report.render());

    assert_eq!(report.phase, Some(DrainPhase::Complete));
    assert_eq!(count(&mut c, "/aether/services/").await, 0, "the legacy prefix is empty");
    assert_eq!(count(&mut c, keys::V1_REGIONS_ROOT).await, N as i64, "every endpoint is in v1, none lost");
    let latest = latest.lock().unwrap().clone();
    for i in 0..N {
        let got = c.get(v1_key(i), None).await.unwrap();
        let value =
            String::from_utf8_lossy(got.kvs().first().unwrap_or_else(|| panic!("{} missing", v1_key(i))).value())
                .to_string();
        let expected = latest.get(&i).map(|(_, v)| v.clone()).unwrap_or_else(|| legacy_value(i, "v0"));
        assert_eq!(value, expected, "endpoint {i} does not hold its latest write");
    }
}

#[tokio::test]
async fn a_drain_restarted_midway_finishes_the_job() {
    let etcd = EtcdServer::start("drain-restart").await.unwrap();
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    write_legacy(&mut c, 0..5000, "v0").await;

    let mut slow = settings();
    slow.rate_limit_per_second = 2000;
    let (tx, rx) = watch::channel(DrainReport::default());
    let cancel = CancellationToken::new();
    let task = {
        let (client, cancel) = (c.clone(), cancel.clone());
        tokio::spawn(async move { drain(&client, &slow, &tx, &cancel).await })
    };
    let mut progress = rx.clone();
    tokio::time::timeout(Duration::from_secs(30), progress.wait_for(|r| r.copied >= 1000)).await.unwrap().unwrap();
    cancel.cancel(); // the operator restarts here
    let partial = task.await.unwrap().unwrap();
    assert_ne!(partial.phase, Some(DrainPhase::Complete));

    let report = run_drain(&c, &settings()).await;
    assert_eq!(report.phase, Some(DrainPhase::Complete));
    assert!(report.already_present >= 1000, "work done before the restart is recognized: {report:?}");
    assert_eq!(report.copied + report.already_present, 5000);
    assert_eq!(count(&mut c, "/aether/services/").await, 0);
    assert_eq!(count(&mut c, keys::V1_REGIONS_ROOT).await, 5000);

    // And once more: idempotent, nothing left to do.
    let again = run_drain(&c, &settings()).await;
    assert_eq!((again.legacy_seen, again.copied, again.deleted), (0, 0, 0));
}

#[tokio::test]
async fn malformed_values_are_skipped_reported_and_kept() {
    let etcd = EtcdServer::start("drain-malformed").await.unwrap();
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    write_legacy(&mut c, 0..100, "v0").await;
    let bad = [
        ("/aether/services/a/protocols/http/endpoints/10.9.9.1", "not json"),
        ("/aether/services/a/protocols/http/endpoints/not-an-ip", "{}"),
        ("/aether/services/a/endpoints/10.9.9.2", "{}"),
        ("/aether/services/a/protocols/http/endpoints/10.9.9.3", r#"{"region":"NOT A LABEL"}"#),
    ];
    for (k, v) in bad {
        c.put(k, v, None).await.unwrap();
    }
    let report = run_drain(&c, &settings()).await;
    assert_eq!(report.phase, Some(DrainPhase::Complete));
    assert_eq!((report.copied, report.skipped), (100, 4));
    for (k, _) in bad {
        assert!(report.skipped_keys.iter().any(|s| s.starts_with(k)), "{k} not reported in {:?}", report.skipped_keys);
        assert_eq!(c.get(k, None).await.unwrap().count(), 1, "{k} must never be deleted");
    }
    assert_eq!(count(&mut c, "/aether/services/").await, 4);
}

#[tokio::test]
async fn a_dry_run_writes_nothing() {
    let etcd = EtcdServer::start("drain-dry").await.unwrap();
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    write_legacy(&mut c, 0..500, "v0").await;
    c.put(v1_key(3), "newer", None).await.unwrap();
    c.put("/aether/services/x/protocols/p/endpoints/bad", "{}", None).await.unwrap();
    let before = c.status().await.unwrap().header().unwrap().revision();
    let mut dry = settings();
    dry.dry_run = true;
    let report = run_drain(&c, &dry).await;
    let after = c.status().await.unwrap().header().unwrap().revision();
    assert_eq!(before, after, "a dry run changes no revision");
    assert_eq!((report.legacy_seen, report.copied, report.already_present, report.skipped), (501, 499, 1, 1));
    assert!(report.render().contains("would be copied: 499"));
}
