//! One leader per region: a coordination.k8s.io Lease decides which operator replica runs the
//! mirror workers and writes status. Followers stand by. Timings are aggressive inside a region
//! (seconds); losing the lease stops the workers without revoking anything.
use std::future::Future;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

#[derive(Clone, Debug)]
pub struct LeaderSettings {
    pub lease_name: String,
    pub namespace: String,
    pub identity: String,
    /// How long a lease stays valid after its last renewal.
    pub duration_seconds: u64,
    /// How long before expiry the holder renews.
    pub grace_seconds: u64,
}

/// Runs `lead` each time this instance becomes leader; the token given to it is cancelled when
/// leadership is lost or on shutdown, and `lead` must then return. Returns on shutdown.
pub async fn run_elected<F, Fut>(
    client: kube::Client,
    settings: LeaderSettings,
    metrics: &crate::metrics::Metrics,
    shutdown: CancellationToken,
    mut lead: F,
) -> anyhow::Result<()>
where
    F: FnMut(CancellationToken) -> Fut,
    Fut: Future<Output = ()>,
{
    let manager = kube_lease_manager::LeaseManagerBuilder::new(client, &settings.lease_name)
        .with_namespace(&settings.namespace)
        .with_identity(&settings.identity)
        .with_duration(settings.duration_seconds)
        .with_grace(settings.grace_seconds)
        .build()
        .await?;
    let (mut leading, task) = manager.watch().await;
    info!(lease = %settings.lease_name, identity = %settings.identity, "standing by for leadership");
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            changed = leading.wait_for(|l| *l) => {
                if changed.is_err() {
                    anyhow::bail!("the leader election task stopped");
                }
            }
        }
        info!(identity = %settings.identity, "elected leader");
        metrics.is_leader.set(1);
        let term = CancellationToken::new();
        let work = lead(term.clone());
        tokio::pin!(work);
        tokio::select! {
            _ = &mut work => {}
            _ = shutdown.cancelled() => { term.cancel(); work.await; }
            _ = leading.wait_for(|l| !*l) => {
                warn!("leadership lost; stopping the mirror workers (nothing is revoked)");
                term.cancel();
                work.await;
            }
        }
        metrics.is_leader.set(0);
        if shutdown.is_cancelled() {
            break;
        }
    }
    // Dropping the receiver makes the manager release the lease, so a successor takes over at once.
    drop(leading);
    let _ = task.await;
    Ok(())
}
