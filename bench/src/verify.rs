//! Verification's cost as the mesh grows: one origin of 100k keys mirrored into 1, 7 and 15 peers
//! (2, 8 and 16 regions) by workers in this process sharing one budget, as one operator's do.
//! Printed: the keys a second each worker verifies and so the time of one pass over the subtree,
//! the verification keys a second the origin etcd serves (summed over the workers), and the same
//! without a budget (every worker on its own interval), which grows with the peers.
use crate::fixtures::{fill, rate};
use crate::table::Table;
use aether_harness::EtcdServer;
use aether_operator::mirror::{self, DEFAULT_VERIFY_KEYS_PER_SECOND, EtcdTarget, MirrorConfig, VerifyBudget};
use std::sync::Arc;
use std::time::{Duration, Instant};

const KEYS: usize = 100_000;
const PEER_COUNTS: [usize; 3] = [1, 7, 15];
/// How long verification is watched, after every peer synced.
const WINDOW: Duration = Duration::from_secs(60);
/// A budget no mesh reaches: each worker is bound by its interval alone.
const UNBOUNDED: u64 = 1 << 40;

pub async fn bench_verify(table: &mut Table) -> anyhow::Result<()> {
    println!("verification: {KEYS} keys into 1, 7 and 15 peers, one shared budget");
    let origin = EtcdServer::start("verify-origin").await?;
    let oc = etcd_client::Client::connect([origin.endpoint()], None).await?;
    fill(&oc, KEYS, "v1").await?;
    let most = *PEER_COUNTS.iter().max().unwrap_or(&1);
    let names: Vec<String> = (0..most).map(|i| format!("verify-peer-{i}")).collect();
    let peers = futures::future::try_join_all(names.iter().map(|name| EtcdServer::start(name))).await?;
    for count in PEER_COUNTS {
        for (label, budget) in [("budget 1,000 keys/s", DEFAULT_VERIFY_KEYS_PER_SECOND), ("no budget", UNBOUNDED)] {
            if budget == UNBOUNDED && count == 1 {
                continue; // one worker is bound by its interval either way
            }
            let budget = Arc::new(VerifyBudget::new(budget));
            let (tx, rx) = tokio::sync::mpsc::channel(4096);
            std::mem::forget(rx);
            let handles: Vec<mirror::MirrorHandle> = peers[..count]
                .iter()
                .enumerate()
                .map(|(i, peer)| {
                    let config = MirrorConfig {
                        verify_budget: budget.clone(),
                        ..MirrorConfig::new("a", &format!("p{i}"), &format!("verify-{count}-{i}"))
                    };
                    mirror::spawn(
                        config,
                        EtcdTarget::plain([origin.endpoint()]),
                        EtcdTarget::plain([peer.endpoint()]),
                        tx.clone(),
                    )
                })
                .collect();
            for h in &handles {
                crate::fixtures::wait_synced(h, Duration::from_secs(900)).await?;
            }
            let before: Vec<u64> = handles.iter().map(|h| h.health().verified_keys).collect();
            let started = Instant::now();
            // The window is the measurement: nothing to wait for.
            tokio::time::sleep(WINDOW).await;
            let elapsed = started.elapsed();
            let per_worker: Vec<f64> = handles
                .iter()
                .zip(&before)
                .map(|(h, b)| rate((h.health().verified_keys - b) as usize, elapsed))
                .collect();
            for h in handles {
                h.shutdown().await;
            }
            let total: f64 = per_worker.iter().sum();
            let slowest = per_worker.iter().cloned().fold(f64::INFINITY, f64::min);
            let pass = if slowest > 0.0 { format!("{:.0}s", KEYS as f64 / slowest) } else { "never".into() };
            table.row_with(
                &format!("verification, {KEYS} keys, {} regions", count + 1),
                label,
                format!("{total:.0} keys/s from the origin etcd"),
                format!(
                    "{:.0} keys/s per worker (slowest {slowest:.0}); a pass over {KEYS} keys every {pass}",
                    total / count as f64
                ),
                serde_json::json!({"regions": count + 1, "origin_keys_per_s": total, "per_worker": per_worker}),
            );
        }
    }
    Ok(())
}
