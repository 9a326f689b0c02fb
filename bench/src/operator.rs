//! The operator at rest: status writes and reconciles per minute of an idle federation.
use crate::table::Table;
use std::time::{Duration, Instant};

/// The operator end to end: `kubectl apply` of a RegionPeering with 2 peers over 10,000 keys until
/// Ready, then a minute idle: status patches and the operator's memory.
pub async fn bench_operator(table: &mut Table) -> anyhow::Result<()> {
    const KEYS: usize = 10_000;
    println!("operator: apply -> Ready for {KEYS} keys and 2 peers, then idle");
    let mut fed = aether_e2e::Federation::start(&["a", "b", "c"]).await?;
    fed.write_endpoints("a", KEYS).await?;
    fed.start_operator("a")?;
    // Let the operator start and take its leadership before the clock starts.
    let port = fed.operators["a"][0].metrics_port;
    aether_harness::wait_until("operator leads", Duration::from_secs(60), || async move {
        Ok(scrape(port).await.contains("aether_federation_leader 1"))
    })
    .await?;
    let start = Instant::now();
    fed.apply_peering("a")?;
    fed.wait_condition("a", "Ready", "True", Duration::from_secs(300)).await?;
    let ready = start.elapsed();
    table.row(
        &format!("operator: {KEYS} keys, 2 peers"),
        "kubectl apply -> Ready",
        format!("{:.2}s", ready.as_secs_f64()),
        "including CRD watch, worker start, initial syncs and the status patch".into(),
    );

    tokio::time::sleep(Duration::from_secs(5)).await;
    let before = patches(&scrape(port).await);
    let idle = Duration::from_secs(60);
    tokio::time::sleep(idle).await;
    let after = patches(&scrape(port).await);
    table.row(
        "operator: idle",
        "status patches",
        format!("{:.1} per minute", (after - before) * 60.0 / idle.as_secs_f64()),
        "one RegionPeering, 2 peers, nothing changing".into(),
    );
    let pid = fed.operators["a"][0].process.pid().ok_or_else(|| anyhow::anyhow!("operator not running"))?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
            / 1024.0
    };
    table.row(
        "operator: memory",
        "RSS",
        format!("{:.1} MiB", field("VmRSS:")),
        format!("peak {:.1} MiB", field("VmHWM:")),
    );
    Ok(())
}

pub async fn scrape(port: u16) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else { return String::new() };
    let _ = s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").await;
    let mut body = String::new();
    let _ = s.read_to_string(&mut body).await;
    body
}

pub fn patches(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("aether_federation_status_patches_total"))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum()
}
