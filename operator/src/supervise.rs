//! Tasks that must not die quietly. A leader whose controller, keeper, worker or drain died keeps
//! its Lease and does nothing: no worker restarts, no Secret rotation, hung finalizers, and a dead
//! keeper lets the region's copies lapse while everything looks alive. So every such task runs
//! supervised: a panic in it is caught, logged, counted (`aether_federation_task_panics_total`)
//! and the task run again; one that keeps panicking (more than [`PANICS_TOLERATED`] within
//! [`PANIC_WINDOW`]) makes `/healthz` and `/readyz` fail, so that the kubelet restarts the process
//! and a standby leads, rather than leaving a leader that panics in a loop.
use futures::FutureExt;
use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::error;

pub const PANICS_TOLERATED: usize = 5;
pub const PANIC_WINDOW: Duration = Duration::from_secs(600);
/// How long a task that panicked waits before it runs again.
pub const RESTART_DELAY: Duration = Duration::from_secs(1);

/// The panics of the process's tasks, by task kind.
#[derive(Default)]
pub struct Supervision {
    panics: Mutex<HashMap<&'static str, Vec<Instant>>>,
    metrics: Option<Arc<crate::metrics::Metrics>>,
}

impl std::fmt::Debug for Supervision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervision").field("panics", &*self.panics()).finish()
    }
}

impl Supervision {
    pub fn new(metrics: Arc<crate::metrics::Metrics>) -> Arc<Supervision> {
        Arc::new(Supervision { panics: Mutex::default(), metrics: Some(metrics) })
    }

    fn panics(&self) -> std::sync::MutexGuard<'_, HashMap<&'static str, Vec<Instant>>> {
        self.panics.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A task of kind `task` panicked (`what` it said).
    pub fn panicked(&self, task: &'static str, what: &str) {
        error!(task, panic = what, "a task panicked; it runs again");
        self.panics().entry(task).or_default().push(Instant::now());
        if let Some(metrics) = &self.metrics {
            metrics.task_panicked(task);
        }
    }

    /// Healthy, or which task keeps panicking.
    pub fn verdict(&self, now: Instant) -> Result<(), String> {
        let mut panics = self.panics();
        for times in panics.values_mut() {
            times.retain(|t| now.saturating_duration_since(*t) < PANIC_WINDOW);
        }
        match panics.iter().find(|(_, times)| times.len() > PANICS_TOLERATED) {
            Some((task, times)) => Err(format!(
                "the {task} task panicked {} times in the last {} minutes",
                times.len(),
                PANIC_WINDOW.as_secs() / 60
            )),
            None => Ok(()),
        }
    }
}

/// What a panic said.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into());
    text.chars().take(500).collect()
}

/// Runs `make()`'s future until it returns; a panic is counted and `make()` runs again after
/// [`RESTART_DELAY`].
pub async fn supervised<F, Fut>(task: &'static str, supervision: Arc<Supervision>, mut make: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    loop {
        match AssertUnwindSafe(make()).catch_unwind().await {
            Ok(()) => return,
            Err(panic) => {
                supervision.panicked(task, &panic_message(panic.as_ref()));
                tokio::time::sleep(RESTART_DELAY).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn a_task_that_panics_runs_again_and_is_counted() {
        let supervision = Arc::new(Supervision::default());
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = runs.clone();
        supervised("keeper", supervision.clone(), move || {
            let runs = counted.clone();
            async move {
                if runs.fetch_add(1, Ordering::SeqCst) < 2 {
                    panic!("boom");
                }
            }
        })
        .await;
        assert_eq!(runs.load(Ordering::SeqCst), 3, "ran until it returned");
        assert_eq!(supervision.panics()["keeper"].len(), 2);
        assert_eq!(supervision.verdict(Instant::now()), Ok(()), "two panics are tolerated");
    }

    #[test]
    fn a_task_that_keeps_panicking_makes_the_process_unhealthy_until_the_window_passes() {
        let supervision = Supervision::default();
        for _ in 0..=PANICS_TOLERATED {
            supervision.panicked("controller", "boom");
        }
        let verdict = supervision.verdict(Instant::now());
        assert!(verdict.as_ref().is_err_and(|e| e.contains("controller task panicked 6 times")), "{verdict:?}");
        assert_eq!(supervision.verdict(Instant::now() + PANIC_WINDOW + Duration::from_secs(1)), Ok(()));
    }

    #[test]
    fn a_panic_says_what_it_said() {
        let caught = std::panic::catch_unwind(|| panic!("the {} said", "value")).unwrap_err();
        assert_eq!(panic_message(caught.as_ref()), "the value said");
    }
}
