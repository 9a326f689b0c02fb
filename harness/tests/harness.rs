//! The harness itself: three regions at once, an etcd that can be killed and restarted, a
//! 3-member cluster losing its leader, the fault proxy, TLS, and snapshot restore.
use aether_harness::{ClusterOptions, EtcdCluster, EtcdFlavor, EtcdServer, FaultProxy, Region, wait_until};
use std::time::{Duration, Instant};

#[tokio::test]
async fn three_regions_run_at_once() -> anyhow::Result<()> {
    let start = Instant::now();
    let (a, b, c) = tokio::try_join!(Region::start("a"), Region::start("b"), Region::start("c"))?;
    eprintln!("three regions started in {:?}", start.elapsed());
    for region in [&a, &b, &c] {
        let client = region.apiserver.client().await?;
        let version = client.apiserver_version().await?;
        assert!(!version.git_version.is_empty());
        let mut etcd = etcd_client::Client::connect([region.registry.endpoint()], None).await?;
        etcd.put(format!("/hello/{}", region.name), "x", None).await?;
    }
    // Each region's registry etcd is its own.
    let mut etcd = etcd_client::Client::connect([a.registry.endpoint()], None).await?;
    let resp = etcd.get("/hello/", Some(etcd_client::GetOptions::new().with_prefix())).await?;
    assert_eq!(resp.kvs().len(), 1);
    Ok(())
}

#[tokio::test]
async fn etcd_survives_kill_and_restart_with_its_data() -> anyhow::Result<()> {
    let mut etcd = EtcdServer::start("restart").await?;
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await?;
    client.put("/k", "v", None).await?;
    etcd.kill();
    assert!(!etcd.is_running());
    etcd.restart().await?;
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await?;
    let resp = client.get("/k", None).await?;
    assert_eq!(resp.kvs()[0].value(), b"v");
    etcd.stop();
    etcd.restart().await?;
    Ok(())
}

#[tokio::test]
async fn a_three_member_cluster_serves_with_its_leader_killed_and_takes_it_back() -> anyhow::Result<()> {
    let mut cluster = EtcdCluster::start("trio", 3).await?;
    let mut client = etcd_client::Client::connect(cluster.endpoints(), None).await?;
    client.put("/k", "before", None).await?;
    let leader = cluster.leader().await?;
    cluster.kill_member(leader);
    // The two that are left elect a leader and keep serving through their own endpoints.
    let survivors: Vec<String> = (0..3).filter(|i| *i != leader).map(|i| cluster.members()[i].endpoint()).collect();
    let new_leader = cluster.leader().await?;
    assert_ne!(new_leader, leader);
    let mut client = etcd_client::Client::connect(survivors, None).await?;
    client.put("/k", "during", None).await?;
    cluster.restart_member(leader).await?;
    let mut back = etcd_client::Client::connect([cluster.members()[leader].endpoint()], None).await?;
    wait_until("the restarted member catches up", std::time::Duration::from_secs(30), || {
        let mut back = back.clone();
        async move {
            let resp = back.get("/k", Some(etcd_client::GetOptions::new().with_serializable())).await?;
            Ok(resp.kvs().first().is_some_and(|kv| kv.value() == b"during"))
        }
    })
    .await?;
    let _ = back.status().await?;
    Ok(())
}

#[tokio::test]
async fn the_fault_proxy_adds_latency_holds_bytes_and_resets() -> anyhow::Result<()> {
    let etcd = EtcdServer::start("proxied").await?;
    let proxy = FaultProxy::start(etcd.client_addr()).await?;
    let mut client = etcd_client::Client::connect([proxy.endpoint("http")], None).await?;
    client.put("/k", "v", None).await?;

    proxy.set_rtt(Duration::from_millis(200));
    let start = Instant::now();
    client.get("/k", None).await?;
    assert!(start.elapsed() >= Duration::from_millis(200), "a round trip takes the RTT: {:?}", start.elapsed());

    proxy.set_rtt(Duration::ZERO);
    proxy.set_blackhole(true);
    let held = tokio::time::timeout(Duration::from_millis(500), client.get("/k", None)).await;
    assert!(held.is_err(), "nothing answers through a blackhole");
    proxy.set_blackhole(false);
    client.get("/k", None).await?;

    proxy.reset_connections();
    // The connection is gone; a fresh client (or the channel's reconnect) gets through.
    let mut fresh = etcd_client::Client::connect([proxy.endpoint("http")], None).await?;
    assert_eq!(fresh.get("/k", None).await?.kvs()[0].value(), b"v");
    Ok(())
}

#[tokio::test]
async fn a_tls_cluster_requires_a_client_certificate() -> anyhow::Result<()> {
    let cluster = EtcdCluster::start_with("tls", ClusterOptions::new(1).with_tls()).await?;
    assert!(cluster.endpoints()[0].starts_with("https://"));
    let ca = std::fs::read(cluster.ca_cert().expect("a CA"))?;
    let cert = cluster.client_cert("someone")?;
    let tls = etcd_client::TlsOptions::new()
        .ca_certificate(etcd_client::Certificate::from_pem(&ca))
        .identity(etcd_client::Identity::from_pem(std::fs::read(&cert.cert)?, std::fs::read(&cert.key)?));
    let mut client =
        etcd_client::Client::connect(cluster.endpoints(), Some(etcd_client::ConnectOptions::new().with_tls(tls)))
            .await?;
    client.put("/k", "v", None).await?;

    let no_cert = etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(&ca));
    let refused = async {
        let mut c = etcd_client::Client::connect(
            cluster.endpoints(),
            Some(
                etcd_client::ConnectOptions::new()
                    .with_tls(no_cert)
                    .with_connect_timeout(Duration::from_secs(2))
                    .with_timeout(Duration::from_secs(2)),
            ),
        )
        .await?;
        c.get("/k", None).await
    };
    assert!(refused.await.is_err(), "a client without a certificate is refused");
    Ok(())
}

#[tokio::test]
async fn a_restored_snapshot_has_a_new_cluster_id_and_the_old_data() -> anyhow::Result<()> {
    let mut etcd = EtcdServer::start_with("snap", EtcdFlavor::Default, &[]).await?;
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await?;
    client.put("/k", "old", None).await?;
    let before = client.status().await?.header().expect("header").cluster_id();
    let dir = tempfile::tempdir()?;
    let snapshot = dir.path().join("backup.db");
    etcd.snapshot_save(&snapshot)?;
    client.put("/k", "new", None).await?;
    let revision = client.get("/k", None).await?.header().expect("header").revision();

    etcd.restore(&snapshot, None).await?;
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await?;
    let resp = client.get("/k", None).await?;
    assert_eq!(resp.kvs()[0].value(), b"old");
    assert!(resp.header().expect("header").revision() < revision, "the revision went back");
    assert_ne!(client.status().await?.header().expect("header").cluster_id(), before);
    Ok(())
}
