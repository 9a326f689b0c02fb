//! The drain's re-keying rate: the legacy layout into v1.
use crate::fixtures::{rate, value};
use crate::table::Table;
use aether_harness::EtcdServer;
use etcd_client::{Client, Txn, TxnOp};
use futures::StreamExt;
use std::time::{Duration, Instant};

pub async fn bench_drain(table: &mut Table) -> anyhow::Result<()> {
    const N: usize = 100_000;
    println!("drain of {N} legacy keys");
    let etcd = EtcdServer::start("drain-bench").await?;
    let c = Client::connect([etcd.endpoint()], None).await?;
    let chunks: Vec<Vec<usize>> = (0..N).collect::<Vec<_>>().chunks(120).map(|c| c.to_vec()).collect();
    futures::stream::iter(chunks)
        .map(|chunk| {
            let mut c = c.clone();
            async move {
                let ops: Vec<TxnOp> = chunk
                    .iter()
                    .map(|i| {
                        let k = format!(
                            "/aether/services/svc-{}/protocols/http/endpoints/10.{}.{}.{}",
                            i % 97,
                            (i >> 16) & 255,
                            (i >> 8) & 255,
                            i & 255
                        );
                        TxnOp::put(k, value(*i, "legacy"), None)
                    })
                    .collect();
                c.txn(Txn::new().and_then(ops)).await
            }
        })
        .buffer_unordered(8)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    // The values name region a: the drain of region a (a drain writes only its own region).
    let mut settings = aether_operator::drain::DrainSettings::new("a", "dflt");
    settings.quiet_period = Duration::ZERO;
    let (tx, _rx) = tokio::sync::watch::channel(Default::default());
    let start = Instant::now();
    let report = aether_operator::drain::drain(&c, &settings, &tx, &tokio_util::sync::CancellationToken::new()).await?;
    let d = start.elapsed();
    anyhow::ensure!(report.copied == N as i64 && report.deleted == N as i64, "drain incomplete: {report:?}");
    table.row(
        &format!("drain {N} legacy keys"),
        "copy + delete",
        format!("{:.0} keys/s", rate(N, d)),
        format!("{:.2}s end to end (copy pass, quiet period 0, delete pass)", d.as_secs_f64()),
    );
    Ok(())
}
