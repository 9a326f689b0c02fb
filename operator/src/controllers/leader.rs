//! One leader per region: a coordination.k8s.io Lease decides which operator replica runs the
//! mirror workers and writes status. Followers stand by. Timings are aggressive inside a region
//! (seconds).
//!
//! Losing sight of the API server is not losing the region. The lease manager only logs when
//! renewals fail, so the leader confirms its Lease every half second itself. When the API server
//! has not confirmed it for the Lease's duration less a margin (before any other instance could
//! acquire it), the leader goes *headless*: its controllers stop (they need the API), but its
//! mirror workers keep renewing the region's leases on the peers and keep mirroring. Every write
//! they make is fenced in etcd by the owner record, so a successor that does take over fences
//! them there, and nothing of theirs lands after its first write. They stop when the API server
//! shows the Lease held by another instance, or when the process ends; when it shows the Lease
//! renewed by this instance again, the controllers start again over the same workers. A managed
//! control plane that is away for minutes during its own upgrade therefore costs a status that
//! is late, never a copy that lapses. The decisions are `Standing::next` (pure); the IO is
//! `run_elected`.
use k8s_openapi::api::coordination::v1::Lease;
use std::future::Future;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How often the leader confirms its lease.
const CONFIRM_INTERVAL: Duration = Duration::from_millis(500);

/// The local deadline: how long after the last renewal it has seen a leader may keep its
/// controllers running. Short of the lease duration by three confirmation intervals, so they stop
/// before a standby can acquire the lease even though it sees each renewal up to one interval late.
pub fn renew_deadline(duration_seconds: u64) -> Duration {
    Duration::from_secs(duration_seconds).saturating_sub(CONFIRM_INTERVAL * 3).max(CONFIRM_INTERVAL)
}

/// What one look at the lease says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseView {
    /// Held by this instance, renewed at this time (as the holder wrote it).
    Ours(String),
    Theirs(String),
    /// No answer (the API server is away), or only the clock was consulted.
    Unknown,
}

/// Where this instance stands while it has workers running.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Standing {
    /// Controllers and workers run; `renewal` is the last renewal time seen, at `seen_at`.
    Leading { renewal: String, seen_at: Instant },
    /// The API server has not confirmed the Lease within the deadline: the controllers stopped,
    /// the workers keep renewing. `renewal` is the last renewal seen before.
    Headless { renewal: String, since: Instant },
    /// Nothing of this instance runs.
    Standby,
}

/// What to do after a look at the Lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Stay,
    /// Stop the controllers; keep the workers.
    GoHeadless,
    /// Start the controllers again over the workers that kept running.
    LeadAgain,
    /// Another instance holds the Lease: stop the workers (it takes the mirrors over).
    Release,
}

impl Standing {
    /// A leader that has just seen its Lease renewed at `renewal`.
    pub fn leading(renewal: String, now: Instant) -> Standing {
        Standing::Leading { renewal, seen_at: now }
    }

    /// What a look at the Lease (or, with `Unknown`, the clock alone) changes. A renewal counts
    /// only when it is new: the lease manager of this instance renewed it since.
    pub fn next(&self, view: &LeaseView, now: Instant, deadline: Duration) -> (Standing, Step) {
        match (self, view) {
            (Standing::Standby, _) => (Standing::Standby, Step::Stay),
            (_, LeaseView::Theirs(_)) => (Standing::Standby, Step::Release),
            (Standing::Leading { renewal, .. }, LeaseView::Ours(seen)) if seen != renewal => {
                (Standing::leading(seen.clone(), now), Step::Stay)
            }
            (Standing::Leading { renewal, seen_at }, _) => {
                if now.saturating_duration_since(*seen_at) > deadline {
                    (Standing::Headless { renewal: renewal.clone(), since: now }, Step::GoHeadless)
                } else {
                    (self.clone(), Step::Stay)
                }
            }
            (Standing::Headless { renewal, .. }, LeaseView::Ours(seen)) if seen != renewal => {
                (Standing::leading(seen.clone(), now), Step::LeadAgain)
            }
            (Standing::Headless { .. }, _) => (self.clone(), Step::Stay),
        }
    }
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

/// Confirms the Lease every interval while leading; returns the first step that is not `Stay`.
async fn confirm(api: &kube::Api<Lease>, settings: &LeaderSettings, standing: &mut Standing) -> Step {
    let deadline = renew_deadline(settings.duration_seconds);
    loop {
        tokio::time::sleep(CONFIRM_INTERVAL).await;
        // The clock first: after a pause (SIGSTOP, a long GC) the deadline may already be gone,
        // and the controllers must stop before anything else of theirs runs.
        let (next, step) = standing.next(&LeaseView::Unknown, Instant::now(), deadline);
        *standing = next;
        if step != Step::Stay {
            return step;
        }
        let view = look(api, &settings.lease_name, &settings.identity).await;
        if let LeaseView::Theirs(holder) = &view {
            warn!(%holder, "the leader lease is held by another instance; standing down");
        }
        let (next, step) = standing.next(&view, Instant::now(), deadline);
        *standing = next;
        if step != Step::Stay {
            return step;
        }
    }
}

/// Headless: looks at the Lease every interval until it is this instance's again (`LeadAgain`)
/// or another's (`Release`); None on shutdown.
async fn headless(
    api: &kube::Api<Lease>,
    settings: &LeaderSettings,
    standing: &mut Standing,
    shutdown: &CancellationToken,
) -> Option<Step> {
    let deadline = renew_deadline(settings.duration_seconds);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(CONFIRM_INTERVAL) => {}
        }
        let view = look(api, &settings.lease_name, &settings.identity).await;
        let (next, step) = standing.next(&view, Instant::now(), deadline);
        *standing = next;
        if matches!(step, Step::LeadAgain | Step::Release) {
            return Some(step);
        }
    }
}

/// Returns once the lease manager says this instance no longer holds the Lease (it read it held
/// by another), counting only changes after the call.
async fn lost(leading: &mut tokio::sync::watch::Receiver<bool>) {
    leading.borrow_and_update();
    loop {
        if leading.changed().await.is_err() || !*leading.borrow_and_update() {
            return;
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

/// How a term of the controllers ended.
enum TermEnd {
    Shutdown,
    Release,
    Headless,
}

/// Runs `lead` each time this instance becomes leader (or leads again after going headless):
/// the token given to it is cancelled when the term ends, and `lead` must then return, stopping
/// its controllers but not the workers. `release` stops the workers: when another instance holds
/// the Lease, and on shutdown. Returns on shutdown.
pub async fn run_elected<L, LF, R, RF>(
    client: kube::Client,
    settings: LeaderSettings,
    metrics: &crate::metrics::Metrics,
    shutdown: CancellationToken,
    mut lead: L,
    mut release: R,
) -> anyhow::Result<()>
where
    L: FnMut(CancellationToken) -> LF,
    LF: Future<Output = ()>,
    R: FnMut() -> RF,
    RF: Future<Output = ()>,
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
    'standby: loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            changed = leading.wait_for(|l| *l) => {
                if changed.is_err() {
                    anyhow::bail!("the leader election task stopped");
                }
            }
        }
        // Lead only on a lease this instance sees itself holding now.
        let LeaseView::Ours(renewal) = look(&leases, &settings.lease_name, &settings.identity).await else {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(CONFIRM_INTERVAL) => continue,
            }
        };
        info!(identity = %settings.identity, "elected leader");
        let mut standing = Standing::leading(renewal, Instant::now());
        loop {
            metrics.operator.leader.set(1);
            let term = CancellationToken::new();
            let work = lead(term.clone());
            tokio::pin!(work);
            let mut finished = false;
            let end = tokio::select! {
                _ = &mut work => {
                    finished = true;
                    warn!("the controllers ended on their own; standing down");
                    TermEnd::Release
                }
                _ = shutdown.cancelled() => TermEnd::Shutdown,
                _ = lost(&mut leading) => {
                    warn!("leadership lost to another instance; stopping the mirror workers (nothing is revoked)");
                    TermEnd::Release
                }
                step = confirm(&leases, &settings, &mut standing) => match step {
                    Step::GoHeadless => TermEnd::Headless,
                    _ => TermEnd::Release,
                },
            };
            term.cancel();
            if !finished {
                work.await;
            }
            metrics.operator.leader.set(0);
            match end {
                TermEnd::Shutdown => {
                    release().await;
                    break 'standby;
                }
                TermEnd::Release => {
                    release().await;
                    // Stand by until the lease manager has seen the lease again, whoever holds it.
                    tokio::time::sleep(CONFIRM_INTERVAL * 2).await;
                    continue 'standby;
                }
                TermEnd::Headless => {
                    warn!(
                        deadline = ?renew_deadline(settings.duration_seconds),
                        "the API server has not confirmed this leader's Lease within the local deadline: the controllers stop; the mirror workers keep renewing the region's leases on its peers (fenced there) until the Lease is seen again"
                    );
                    metrics.operator.headless.set(1);
                    let step = headless(&leases, &settings, &mut standing, &shutdown).await;
                    metrics.operator.headless.set(0);
                    match step {
                        Some(Step::LeadAgain) => {
                            info!(
                                "the API server confirms this instance's Lease again: leading again over the same workers"
                            );
                        }
                        Some(_) => {
                            warn!(
                                "another instance holds the leader lease: stopping the mirror workers (it takes them over)"
                            );
                            release().await;
                            tokio::time::sleep(CONFIRM_INTERVAL * 2).await;
                            continue 'standby;
                        }
                        None => {
                            release().await;
                            break 'standby;
                        }
                    }
                }
            }
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

    const DEADLINE: Duration = Duration::from_secs(6);

    fn ours(r: &str) -> LeaseView {
        LeaseView::Ours(r.into())
    }

    #[test]
    fn a_leader_without_answers_goes_headless_at_the_deadline_and_keeps_its_workers() {
        let t0 = Instant::now();
        let leading = Standing::leading("r1".into(), t0);
        // Within the deadline: nothing changes, with or without an answer.
        assert_eq!(leading.next(&LeaseView::Unknown, t0 + Duration::from_secs(5), DEADLINE).1, Step::Stay);
        assert_eq!(leading.next(&ours("r1"), t0 + Duration::from_secs(5), DEADLINE).1, Step::Stay);
        // A renewal moves the deadline.
        let (renewed, step) = leading.next(&ours("r2"), t0 + Duration::from_secs(5), DEADLINE);
        assert_eq!(step, Step::Stay);
        assert_eq!(renewed.next(&LeaseView::Unknown, t0 + Duration::from_secs(10), DEADLINE).1, Step::Stay);
        // Past it without a renewal (no answer, or the same renewal again): headless, not released.
        let (headless, step) = leading.next(&LeaseView::Unknown, t0 + Duration::from_secs(7), DEADLINE);
        assert_eq!(step, Step::GoHeadless);
        assert_eq!(leading.next(&ours("r1"), t0 + Duration::from_secs(7), DEADLINE).1, Step::GoHeadless);
        // Headless for as long as the API server says nothing: the workers keep renewing.
        for minutes in [1, 10, 60] {
            let later = t0 + Duration::from_secs(60 * minutes);
            assert_eq!(headless.next(&LeaseView::Unknown, later, DEADLINE), (headless.clone(), Step::Stay));
            // Its own old renewal (the Lease lapsed, nobody took it) is not a new one.
            assert_eq!(headless.next(&ours("r1"), later, DEADLINE).1, Step::Stay);
        }
    }

    #[test]
    fn a_headless_leader_leads_again_on_its_own_renewal_and_releases_on_anothers() {
        let t0 = Instant::now();
        let headless = Standing::Headless { renewal: "r1".into(), since: t0 };
        let later = t0 + Duration::from_secs(90);
        let (again, step) = headless.next(&ours("r9"), later, DEADLINE);
        assert_eq!(step, Step::LeadAgain);
        assert_eq!(again, Standing::leading("r9".into(), later));
        assert_eq!(headless.next(&LeaseView::Theirs("b".into()), later, DEADLINE), (Standing::Standby, Step::Release));
        // A leader that sees another holder releases at once, deadline or not.
        let leading = Standing::leading("r1".into(), t0);
        assert_eq!(leading.next(&LeaseView::Theirs("b".into()), t0, DEADLINE).1, Step::Release);
        assert_eq!(Standing::Standby.next(&ours("r1"), t0, DEADLINE).1, Step::Stay);
    }
}
