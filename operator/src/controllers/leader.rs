//! One leader per region: a coordination.k8s.io Lease decides which operator replica runs the
//! mirror workers and writes status. Followers stand by. Timings are aggressive inside a region
//! (seconds); losing the lease stops the workers without revoking anything.
//!
//! The lease manager only logs when renewals fail, so a leader cut off from the API server (or
//! paused) would keep its workers running after a standby took over. A local deadline prevents
//! that: the leader confirms its lease every half second, and stands down once it has not seen
//! a fresh renewal for the lease duration less a margin, before any other instance can acquire it.
use k8s_openapi::api::coordination::v1::Lease;
use std::future::Future;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How often the leader confirms its lease.
const CONFIRM_INTERVAL: Duration = Duration::from_millis(500);

/// The local deadline: how long after the last renewal it has seen a leader may keep leading.
/// Short of the lease duration by three confirmation intervals, so it stops before a standby can
/// acquire the lease even though it sees each renewal up to one interval late.
pub fn renew_deadline(duration_seconds: u64) -> Duration {
    Duration::from_secs(duration_seconds).saturating_sub(CONFIRM_INTERVAL * 3).max(CONFIRM_INTERVAL)
}

/// What one look at the lease says.
#[derive(Clone, Debug, PartialEq, Eq)]
enum LeaseView {
    /// Held by this instance, renewed at this time (as the holder wrote it).
    Ours(String),
    Theirs(String),
    Unknown,
}

async fn look(api: &kube::Api<Lease>, name: &str, identity: &str) -> LeaseView {
    match tokio::time::timeout(CONFIRM_INTERVAL, api.get_opt(name)).await {
        Ok(Ok(Some(lease))) => {
            let spec = lease.spec.unwrap_or_default();
            match spec.holder_identity {
                Some(h) if h == identity => {
                    LeaseView::Ours(spec.renew_time.map(|t| t.0.to_string()).unwrap_or_default())
                }
                Some(h) => LeaseView::Theirs(h),
                None => LeaseView::Theirs(String::new()),
            }
        }
        _ => LeaseView::Unknown,
    }
}

/// Runs while this instance leads; returns once its local deadline passed or the lease is
/// someone else's.
async fn watch_deadline(api: kube::Api<Lease>, settings: &LeaderSettings) {
    let deadline = renew_deadline(settings.duration_seconds);
    let mut renewed_at = Instant::now();
    let mut last_renewal = String::new();
    loop {
        tokio::time::sleep(CONFIRM_INTERVAL).await;
        // Checked first: after a pause (SIGSTOP, a long GC) the deadline may already be gone.
        if renewed_at.elapsed() > deadline {
            warn!(since = ?renewed_at.elapsed(), ?deadline, "no lease renewal seen within the local deadline; standing down");
            return;
        }
        match look(&api, &settings.lease_name, &settings.identity).await {
            LeaseView::Ours(renew_time) => {
                if renew_time != last_renewal {
                    last_renewal = renew_time;
                    renewed_at = Instant::now();
                }
            }
            LeaseView::Theirs(holder) => {
                warn!(%holder, "the leader lease is held by another instance; standing down");
                return;
            }
            LeaseView::Unknown => {}
        }
    }
}

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
    let leases: kube::Api<Lease> = kube::Api::namespaced(client.clone(), &settings.namespace);
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
        // Lead only on a lease this instance sees itself holding now.
        if !matches!(look(&leases, &settings.lease_name, &settings.identity).await, LeaseView::Ours(_)) {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(CONFIRM_INTERVAL) => continue,
            }
        }
        info!(identity = %settings.identity, "elected leader");
        metrics.operator.leader.set(1);
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
            _ = watch_deadline(leases.clone(), &settings) => {
                term.cancel();
                work.await;
                metrics.operator.leader.set(0);
                // Stand by until the lease manager has seen the lease again, whoever holds it.
                tokio::time::sleep(CONFIRM_INTERVAL * 2).await;
            }
        }
        metrics.operator.leader.set(0);
        if shutdown.is_cancelled() {
            break;
        }
    }
    // Dropping the receiver makes the manager release the lease, so a successor takes over at once.
    drop(leading);
    let _ = task.await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_local_deadline_ends_before_a_standby_may_acquire() {
        let d = renew_deadline(8);
        assert!(d < Duration::from_secs(8) - CONFIRM_INTERVAL, "{d:?}");
        // Renewals come every duration - grace (5 s by default) and are seen within an interval.
        assert!(d > Duration::from_secs(5) + CONFIRM_INTERVAL, "{d:?}");
        assert_eq!(renew_deadline(0), CONFIRM_INTERVAL);
    }
}
