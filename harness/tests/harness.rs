//! The harness itself: three regions at once, and an etcd that can be killed and restarted.
use aether_harness::{EtcdServer, Region};
use std::time::Instant;

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
