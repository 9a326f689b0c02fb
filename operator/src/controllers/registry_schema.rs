//! The RegistrySchema reconciler: runs the v0 -> v1 drain (leader only) and reports its phases
//! and counters in status.
use super::region_peering::ControllerSettings;
use crate::api::{DrainCounts, RegistrySchema, RegistrySchemaStatus};
use crate::drain::{DrainPhase, DrainReport, DrainSettings, drain};
use crate::metrics::{DrainLabels, Metrics};
use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

struct RunningDrain {
    fingerprint: u64,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    progress: watch::Receiver<DrainReport>,
    /// The last error of the drain task, which retries with backoff.
    error: Arc<Mutex<Option<String>>>,
}

pub struct Context {
    client: kube::Client,
    settings: ControllerSettings,
    metrics: Arc<Metrics>,
    drains: Mutex<HashMap<String, RunningDrain>>,
}

impl Context {
    pub fn new(client: kube::Client, settings: ControllerSettings, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Context { client, settings, metrics, drains: Mutex::new(HashMap::new()) })
    }

    /// Stops every drain; each resumes where it stands under the next leader.
    pub async fn stop_all(&self) {
        for (_, d) in self.drains.lock().expect("drains lock").drain() {
            d.cancel.cancel();
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("finalizer: {0}")]
    Finalizer(Box<kube::runtime::finalizer::Error<Error>>),
}

/// The finalizer that lets a deleted RegistrySchema stop its drain at a safe point.
pub const FINALIZER: &str = "federation.aether.dev/drain";

/// How long deletion waits for a drain to reach a safe point.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

pub async fn run(ctx: Arc<Context>, namespace: Option<String>, stop: CancellationToken) {
    let api: Api<RegistrySchema> = match &namespace {
        Some(ns) => Api::namespaced(ctx.client.clone(), ns),
        None => Api::all(ctx.client.clone()),
    };
    let controller = Controller::new(api, watcher::Config::default());
    // A drain follows its legacy prefix for as long as its RegistrySchema exists: stop the drains
    // of objects that are gone (nothing reconciles an object after its deletion).
    let store = controller.store();
    let sweeper = {
        let (ctx, stop, namespace) = (ctx.clone(), stop.clone(), namespace.clone());
        tokio::spawn(async move {
            // Until the store has listed once, "absent" means "not seen yet".
            if store.wait_until_ready().await.is_err() {
                return;
            }
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(2)) => {}
                }
                {
                    let present: std::collections::HashSet<String> = store
                        .state()
                        .iter()
                        .map(|rs| format!("{}/{}", rs.namespace().unwrap_or_default(), rs.name_any()))
                        .collect();
                    // Each namespace's controller sweeps its own namespace only.
                    let mine = |key: &str| namespace.as_ref().is_none_or(|ns| key.starts_with(&format!("{ns}/")));
                    ctx.drains.lock().expect("lock").retain(|key, d| {
                        let keep = present.contains(key) || !mine(key);
                        if !keep {
                            info!(object = %key, "RegistrySchema deleted; its drain stops");
                            d.cancel.cancel();
                        }
                        keep
                    });
                }
            }
        })
    };
    controller
        .graceful_shutdown_on(stop.cancelled_owned())
        .run(
            reconcile,
            |_, error: &Error, _| {
                warn!(%error, "registry schema reconcile failed");
                Action::requeue(Duration::from_secs(5))
            },
            ctx,
        )
        .for_each(|_| async {})
        .await;
    sweeper.abort();
}

async fn reconcile(rs: Arc<RegistrySchema>, ctx: Arc<Context>) -> Result<Action, Error> {
    use kube::runtime::finalizer::{Event, finalizer};
    let api: Api<RegistrySchema> = Api::namespaced(ctx.client.clone(), &rs.namespace().unwrap_or_default());
    let started = std::time::Instant::now();
    let result = finalizer(&api, FINALIZER, rs, |event| async {
        match event {
            Event::Apply(rs) => apply(rs, ctx.clone()).await,
            Event::Cleanup(rs) => cleanup(rs, ctx.clone()).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)));
    ctx.metrics.reconciled("registryschema", started.elapsed(), result.is_ok());
    result
}

/// The object was deleted: stop its drain between two steps (every step is recorded, so a
/// later RegistrySchema for the prefix resumes from there) and release the prefix's lock.
async fn cleanup(rs: Arc<RegistrySchema>, ctx: Arc<Context>) -> Result<Action, Error> {
    let key = format!("{}/{}", rs.namespace().unwrap_or_default(), rs.name_any());
    let running = ctx.drains.lock().expect("lock").remove(&key);
    ctx.metrics.forget_drain(&rs.spec.region);
    if let Some(running) = running {
        running.cancel.cancel();
        if tokio::time::timeout(STOP_TIMEOUT, running.task).await.is_err() {
            warn!(object = %key, "the drain did not stop within {STOP_TIMEOUT:?}; its lock lapses with its lease");
        }
        info!(object = %key, "RegistrySchema deleted; its drain stopped");
    }
    Ok(Action::await_change())
}

async fn apply(rs: Arc<RegistrySchema>, ctx: Arc<Context>) -> Result<Action, Error> {
    let namespace = rs.namespace().unwrap_or_default();
    let key = format!("{namespace}/{}", rs.name_any());
    let spec = &rs.spec;
    let api: Api<RegistrySchema> = Api::namespaced(ctx.client.clone(), &namespace);

    let previous = rs.status.clone().unwrap_or_default();

    let target = match super::region_peering::resolve_connection(&ctx.client, &namespace, &spec.etcd).await {
        Ok(a) => a,
        Err(e) => {
            let status = failed_status(&previous, rs.metadata.generation, e.reason(), &e.to_string());
            patch(&api, &rs.name_any(), &previous, status).await?;
            // The phase metric says Failed too, so that the drain-failed alert can fire.
            ctx.metrics.record_drain_phase(&spec.region, DrainPhase::Failed);
            return Ok(Action::requeue(Duration::from_secs(10)));
        }
    };
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (serde_json::to_string(spec).unwrap_or_default(), target.fingerprint).hash(&mut hasher);
    let fingerprint = hasher.finish();

    let restart = ctx.drains.lock().expect("lock").get(&key).is_none_or(|d| d.fingerprint != fingerprint);
    if restart {
        if let Some(old) = ctx.drains.lock().expect("lock").remove(&key) {
            old.cancel.cancel();
        }
        let mut settings = DrainSettings::new(&spec.region, &spec.cluster);
        settings.legacy_prefix = spec.legacy_prefix.clone();
        settings.batch_size = spec.drain.batch_size.clamp(1, 128) as usize;
        settings.rate_limit_per_second = spec.drain.rate_limit_per_second.max(0) as u64;
        settings.quiet_period = Duration::from_secs(spec.drain.quiet_period_seconds.max(0) as u64);
        settings.dry_run = spec.dry_run;
        // After Complete the drain keeps following the legacy prefix while this object exists:
        // registrars still on v0 that write late are migrated too.
        settings.follow = true;
        settings.holder = format!("RegistrySchema {key} (operator {})", ctx.settings.identity);
        let (tx, rx) = watch::channel(DrainReport {
            phase: Some(DrainPhase::Pending),
            dry_run: spec.dry_run,
            ..Default::default()
        });
        let cancel = CancellationToken::new();
        let error = Arc::new(Mutex::new(None));
        let (cancel2, error2, etcd) = (cancel.clone(), error.clone(), target.target.clone());
        let task = tokio::spawn(async move {
            let mut backoff = crate::mirror::backoff::Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
            while !cancel2.is_cancelled() {
                let result = match etcd.connect().await {
                    Ok(client) => drain(&client, &settings, &tx, &cancel2).await,
                    Err(e) => Err(anyhow::anyhow!(e).context("connecting to the registry etcd")),
                };
                match result {
                    Ok(_) => {
                        *error2.lock().expect("lock") = None;
                        return;
                    }
                    Err(e) => {
                        let message = format!("{e:#}");
                        warn!(error = %message, "drain failed; it resumes after a backoff");
                        *error2.lock().expect("lock") = Some(message);
                        tokio::select! {
                            _ = cancel2.cancelled() => return,
                            _ = tokio::time::sleep(backoff.next_delay(rand::random::<f64>() * 0.5 + 0.5)) => {}
                        }
                    }
                }
            }
        });
        info!(object = %key, dry_run = spec.dry_run, "drain started");
        ctx.drains
            .lock()
            .expect("lock")
            .insert(key.clone(), RunningDrain { fingerprint, cancel, task, progress: rx, error });
    }

    let (report, error) = {
        let drains = ctx.drains.lock().expect("lock");
        let d = drains.get(&key).expect("just ensured");
        let report = d.progress.borrow().clone();
        let error = d.error.lock().expect("lock").clone();
        (report, error)
    };
    // The drain's counters are cumulative (kept in its record), published as they grow.
    for (outcome, n) in [
        ("copied", report.copied),
        ("already_present", report.already_present),
        ("skipped", report.skipped),
        ("foreign", report.foreign),
        ("deleted", report.deleted),
    ] {
        ctx.metrics.advance_drain(DrainLabels { region: spec.region.clone(), outcome: outcome.into() }, n);
    }
    ctx.metrics.record_drain_phase(&spec.region, report.phase.unwrap_or(DrainPhase::Pending));
    let status = status_from(&previous, rs.metadata.generation, &report, error.as_deref());
    patch(&api, &rs.name_any(), &previous, status).await?;
    Ok(Action::requeue(ctx.settings.refresh_interval.min(Duration::from_secs(2))))
}

async fn patch(
    api: &Api<RegistrySchema>,
    name: &str,
    previous: &RegistrySchemaStatus,
    status: RegistrySchemaStatus,
) -> Result<(), Error> {
    if &status != previous {
        let body = serde_json::json!({
            "apiVersion": "federation.aether.dev/v1alpha1",
            "kind": "RegistrySchema",
            "status": status,
        });
        let params = PatchParams::apply(super::region_peering::FIELD_MANAGER).force();
        api.patch_status(name, &params, &Patch::Apply(body)).await?;
    }
    Ok(())
}

fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

fn condition(
    previous: &RegistrySchemaStatus,
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
) -> Condition {
    let status = if status { "True" } else { "False" }.to_string();
    let last_transition_time = match previous.conditions.iter().find(|c| c.type_ == type_) {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => now(),
    };
    Condition {
        type_: type_.into(),
        status,
        reason: reason.into(),
        message: message.into(),
        observed_generation: generation,
        last_transition_time,
    }
}

/// The status a drain report implies.
pub fn status_from(
    previous: &RegistrySchemaStatus,
    generation: Option<i64>,
    report: &DrainReport,
    error: Option<&str>,
) -> RegistrySchemaStatus {
    let phase = report.phase.unwrap_or(DrainPhase::Pending);
    let copied_all = matches!(phase, DrainPhase::Draining | DrainPhase::Complete);
    let complete = phase == DrainPhase::Complete;
    // An error belongs to the phase it happened in: once the drain is complete it is history.
    let error = error.filter(|_| !complete && phase != DrainPhase::DryRunComplete);
    let dry = if report.dry_run { " (dry run: nothing written)" } else { "" };
    let migrated = condition(
        previous,
        "Migrated",
        copied_all && !report.dry_run,
        if copied_all { "SnapshotCopied" } else { "Copying" },
        &format!(
            "{} copied, {} already in v1, {} skipped, {} naming another region (left in place){dry}",
            report.copied, report.already_present, report.skipped, report.foreign
        ),
        generation,
    );
    let drained = condition(
        previous,
        "Drained",
        complete && !report.dry_run,
        if complete {
            "LegacyPrefixEmpty"
        } else if copied_all {
            "WaitingForQuiet"
        } else {
            "Copying"
        },
        &format!("{} legacy keys deleted; malformed keys are left in place{dry}", report.deleted),
        generation,
    );
    // Ready: the registry is on v1 (the legacy prefix drained); a dry run is never Ready.
    let ready = if report.dry_run {
        condition(
            previous,
            "Ready",
            false,
            "DryRun",
            "a dry run: nothing was migrated; set dryRun to false to migrate",
            generation,
        )
    } else if complete {
        condition(
            previous,
            "Ready",
            true,
            "Migrated",
            "the registry is on v1; late legacy writes are migrated too",
            generation,
        )
    } else if let Some(e) = error {
        condition(previous, "Ready", false, "Retrying", &format!("the drain retries after: {e}"), generation)
    } else {
        condition(previous, "Ready", false, phase.as_str(), "the drain is running", generation)
    };
    RegistrySchemaStatus {
        observed_generation: generation,
        phase: Some(phase.as_str().to_string()),
        conditions: vec![ready, migrated, drained],
        counts: DrainCounts {
            legacy_seen: report.legacy_seen,
            copied: report.copied,
            already_present: report.already_present,
            skipped: report.skipped,
            deleted: report.deleted,
            conflicts: report.conflicts,
            foreign: report.foreign,
        },
        skipped_keys: report.skipped_keys.clone(),
        foreign_keys: report.foreign_keys.clone(),
        started_time: previous.started_time.clone().or_else(|| Some(now())),
        completed_time: if complete { previous.completed_time.clone().or_else(|| Some(now())) } else { None },
        message: error.map(|e| format!("retrying after: {e}")).or_else(|| report.message.clone()),
    }
}

fn failed_status(
    previous: &RegistrySchemaStatus,
    generation: Option<i64>,
    reason: &str,
    message: &str,
) -> RegistrySchemaStatus {
    RegistrySchemaStatus {
        observed_generation: generation,
        phase: Some(DrainPhase::Failed.as_str().to_string()),
        conditions: vec![
            condition(previous, "Ready", false, reason, message, generation),
            condition(previous, "Migrated", false, reason, message, generation),
            condition(previous, "Drained", false, reason, message, generation),
        ],
        message: Some(message.to_string()),
        ..previous.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_map_to_conditions() {
        let prev = RegistrySchemaStatus::default();
        let mut report = DrainReport { phase: Some(DrainPhase::Copying), copied: 5, ..Default::default() };
        let s = status_from(&prev, Some(1), &report, None);
        assert_eq!(s.phase.as_deref(), Some("Copying"));
        assert!(s.conditions.iter().all(|c| c.status == "False"));
        report.phase = Some(DrainPhase::Draining);
        let s = status_from(&s, Some(1), &report, None);
        assert_eq!(s.conditions[1].status, "True");
        assert_eq!(s.conditions[2].reason, "WaitingForQuiet");
        report.phase = Some(DrainPhase::Complete);
        let s = status_from(&s, Some(1), &report, None);
        assert!(s.conditions.iter().all(|c| c.status == "True"));
        let dry = DrainReport { phase: Some(DrainPhase::DryRunComplete), dry_run: true, ..Default::default() };
        let d = status_from(&RegistrySchemaStatus::default(), Some(1), &dry, None);
        assert_eq!(d.phase.as_deref(), Some("DryRunComplete"), "a dry run never reads as Complete");
        assert!(d.conditions.iter().all(|c| c.status == "False"));
        assert_eq!(d.conditions[0].reason, "DryRun");
        assert!(s.completed_time.is_some());
        // An error of an earlier phase does not outlive it.
        let s = status_from(&s, Some(1), &report, Some("another drain holds the legacy prefix"));
        assert_eq!(s.message, report.message, "{:?}", s.message);
        report.phase = Some(DrainPhase::Draining);
        let s = status_from(&s, Some(1), &report, Some("etcd down"));
        assert!(s.message.unwrap().contains("etcd down"));
    }

    #[test]
    fn a_failed_drain_is_not_ready_with_its_reason() {
        let s = failed_status(&RegistrySchemaStatus::default(), Some(2), "InvalidSpec", "legacyPrefix is not a prefix");
        let ready = s.conditions.iter().find(|c| c.type_ == "Ready").expect("a Ready condition");
        assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("False", "InvalidSpec"));
        assert_eq!(s.phase.as_deref(), Some("Failed"));
    }
}
