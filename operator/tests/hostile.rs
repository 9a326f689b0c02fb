//! Hostile input from a peer: another region's mirror user may write anything under its own
//! `/aether/v1/federation/<region>/` in this region's etcd, and a misbehaving peer anything
//! anywhere it can. Nothing it writes may crash the operator, grow its memory without bound,
//! break its metrics, or cost this region its copies.
mod support;

use aether_harness::{EtcdServer, KubeApiserver, free_port, wait_until};
use aether_operator::api::RegionPeering;
use aether_operator::keys;
use aether_operator::mirror::records::checkpoint::{Checkpoint, PartsRef, Progress};
use etcd_client::{Client, GetOptions, Txn, TxnOp};
use kube::api::Api;
use std::time::{Duration, Instant};
use support::operator::*;
use support::*;

/// Origins (named to sort among the first the view lists) and the counts their records claim.
const LYING_COUNTS: [(&str, &str); 3] = [("a-minus", "-5"), ("a-text", "\"lots\""), ("a-huge", "1e30")];

/// What region b's user (or a broken peer) writes into a's etcd: a checkpoint naming 40 parts of
/// 1.4 MiB, a garbage canary, 300 origin names of which most are not region names (quotes,
/// newlines, upper case, invalid UTF-8, paths) and 200 that are, and a copy of b with a key that
/// is not UTF-8.
async fn write_garbage(a: &mut Client) {
    let parts = 40;
    let checkpoint = Checkpoint {
        owner: "b-operator/evil".into(),
        revision: 7,
        synced: true,
        parts: Some(PartsRef { id: 1, count: parts }),
        ..Default::default()
    };
    a.put(keys::checkpoint_key("b"), checkpoint.encode(), None).await.unwrap();
    let leases: Vec<String> = (0..180_000u64).map(|i| (1_000_000 + i).to_string()).collect();
    let part = format!(r#"{{"first":0,"leases":[{}]}}"#, leases.join(","));
    assert!(part.len() > 1_300_000 && part.len() < 1_500_000, "{}", part.len());
    for index in 0..parts {
        let key = aether_operator::mirror::records::checkpoint::part_key("b", 1, index);
        a.put(key, part.as_str(), None).await.unwrap();
    }
    a.put(keys::canary_key("b"), vec![0xffu8; 1 << 20], None).await.unwrap();
    let weird: Vec<Vec<u8>> = (0..300)
        .map(|i| match i % 5 {
            0 => format!("evil{i}\"}} 1\n# HELP x\n{{a=\"").into_bytes(),
            1 => format!("UPPER{i}").into_bytes(),
            2 => [vec![0xff, 0xfe], i.to_string().into_bytes()].concat(),
            3 => format!("../../{i}").into_bytes(),
            _ => "x".repeat(70 + i).into_bytes(),
        })
        .collect();
    let mut ops: Vec<TxnOp> = Vec::new();
    for name in &weird {
        let mut key = keys::FEDERATION_ROOT.as_bytes().to_vec();
        key.extend_from_slice(name);
        key.extend_from_slice(b"/owner");
        ops.push(TxnOp::put(key, "garbage", None));
    }
    for i in 0..200 {
        ops.push(TxnOp::put(keys::owner_key(&format!("c{i}")), "garbage", None));
    }
    for chunk in ops.chunks(100) {
        a.txn(Txn::new().and_then(chunk.to_vec())).await.unwrap();
    }
    // Three origins whose copies here look complete but whose progress records claim counts that
    // are none (negative, text, out of range): the view counts their keys instead.
    for (origin, claim) in LYING_COUNTS {
        let mut progress: serde_json::Value =
            serde_json::from_slice(&Progress { owner: "evil/1".into(), revision: 9, ..Default::default() }.encode())
                .unwrap();
        progress["keys"] = serde_json::from_str(claim).unwrap();
        a.put(keys::progress_key(origin), progress.to_string(), None).await.unwrap();
        a.put(keys::canary_key(origin), r#"{"synced":true}"#, None).await.unwrap();
        for i in 0..3 {
            a.put(format!("{}svc/tcp/{i}", keys::region_prefix(origin)), "{}", None).await.unwrap();
        }
    }
    let mut bad_key = keys::region_prefix("b").into_bytes();
    bad_key.extend_from_slice(&[0xff, 0xfe, 0xfd]);
    a.put(bad_key, vec![b'v'; 1 << 20], None).await.unwrap();
}

#[tokio::test]
async fn garbage_written_under_the_federation_root_leaves_memory_bounded_metrics_whole_and_the_region_ready() {
    let (apiserver, a, b) = tokio::try_join!(
        KubeApiserver::start("hostile"),
        EtcdServer::start("hostile-a"),
        EtcdServer::start("hostile-b")
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let client = prepare(&apiserver).await;
    put_endpoints(&a, "a", 300).await;
    let port = free_port();
    let operator = start_operator(&apiserver, dir.path(), "operator-hostile", port);
    let pid = operator.pid().unwrap();
    let api: Api<RegionPeering> = Api::namespaced(client.clone(), NS);
    create_json(&client, NS, peering("a", "a", &a, &[("b", &b)])).await.unwrap();
    wait_condition(&api, "a", "Ready", "True", None).await;
    tokio::time::sleep(Duration::from_secs(3)).await; // a few refreshes, for the baseline
    let baseline = rss(pid);

    let mut local = Client::connect([a.endpoint()], None).await.unwrap();
    write_garbage(&mut local).await;
    // Twenty refreshes (one a second) with the garbage in place: Ready and the copy at every look,
    // and the memory sampled.
    let b_reader = Client::connect([b.endpoint()], None).await.unwrap();
    let started = Instant::now();
    let (mut peak, mut looks) = (0u64, 0);
    while started.elapsed() < Duration::from_secs(20) {
        peak = peak.max(rss(pid));
        let rp = api.get("a").await.unwrap();
        assert_eq!(condition(&rp, "Ready").map(|c| c.0), Some("True".into()), "not Ready with garbage in the etcd");
        let options = GetOptions::new().with_prefix().with_count_only();
        assert_eq!(b_reader.clone().get(keys::region_prefix("a"), Some(options)).await.unwrap().count(), 300);
        looks += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    eprintln!("RSS {} -> peak {} MiB over {looks} looks", baseline >> 20, peak >> 20);
    assert!(peak.saturating_sub(baseline) < 40 << 20, "RSS grew {} MiB", (peak - baseline) >> 20);

    // The exposition stays whole: every origin label is a region name.
    let metrics = scrape_metrics(port).await;
    for line in metrics.lines().filter(|l| l.contains("origin=\"")) {
        let origin = line.split("origin=\"").nth(1).and_then(|r| r.split('"').next()).unwrap_or_default();
        assert!(aether_operator::keys::is_dns_label(origin), "a label that is not a region name: {line:?}");
    }
    assert!(metrics.contains("aether_federation_leader 1"), "the exposition broke");
    // The inbound view names region names only, at most 64 of them.
    wait_until("the inbound view lists the origins", WAIT, || {
        let api = api.clone();
        async move {
            let inbound = api.get("a").await?.status.unwrap_or_default().inbound;
            anyhow::ensure!(
                inbound.iter().all(|i| aether_operator::keys::is_dns_label(&i.region)),
                "a name that is not a region's: {:?}",
                inbound.iter().map(|i| &i.region).collect::<Vec<_>>()
            );
            let counted =
                LYING_COUNTS.iter().all(|(origin, _)| inbound.iter().any(|i| i.region == *origin && i.keys == 3));
            Ok(inbound.len() > 1 && inbound.len() <= 64 && counted)
        }
    })
    .await
    .unwrap();
}
