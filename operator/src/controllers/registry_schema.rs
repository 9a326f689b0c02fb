//! The RegistrySchema reconciler: runs the v0 -> v1 drain (leader only) and reports its phases
//! and counters in status.
use super::plan::{SchemaClaim, schema_conflict};
use super::region_peering::ControllerSettings;
use super::schema_status::{failed_status, status_from};
use crate::api::{RegistrySchema, RegistrySchemaSpec, RegistrySchemaStatus};
use crate::drain::{DrainPhase, DrainReport, DrainSettings, drain};
use crate::metrics::{DrainLabels, Metrics};
use futures::StreamExt;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::Store;
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
    /// The RegionPeerings this leader serves: which etcd each says its region's origin is.
    peerings: Arc<super::region_peering::Context>,
    drains: Mutex<HashMap<String, RunningDrain>>,
    /// One store per watched namespace (or one for all): claims look at every RegistrySchema.
    stores: Mutex<Vec<Store<RegistrySchema>>>,
    /// Reconciles run one at a time: a drain started for one object is seen by the next.
    serial: tokio::sync::Mutex<()>,
}

impl Context {
    pub fn new(
        client: kube::Client,
        settings: ControllerSettings,
        metrics: Arc<Metrics>,
        peerings: Arc<super::region_peering::Context>,
    ) -> Arc<Self> {
        Arc::new(Context {
            client,
            settings,
            metrics,
            peerings,
            drains: Mutex::new(HashMap::new()),
            stores: Mutex::new(Vec::new()),
            serial: tokio::sync::Mutex::new(()),
        })
    }

    /// Every RegistrySchema's claim, once the watched stores have listed them all: before that,
    /// an older object not seen yet would let a newer one drain.
    async fn claims(&self) -> Vec<SchemaClaim> {
        let stores = self.stores.lock().expect("store lock").clone();
        for store in &stores {
            let _ = store.wait_until_ready().await;
        }
        stores.iter().flat_map(|s| s.state()).map(|rs| claim(self, &rs)).collect()
    }

    /// A new term of the controllers begins: the stores of the last one are gone.
    pub fn new_term(&self) {
        self.stores.lock().expect("store lock").clear();
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
    #[error("the reconcile took too long; it is tried again")]
    TimedOut,
    #[error("writing status: {0}")]
    WriteStatus(#[source] kube::Error),
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
    ctx.stores.lock().expect("store lock").push(controller.store());
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
    let _serial = ctx.serial.lock().await;
    let api: Api<RegistrySchema> = Api::namespaced(ctx.client.clone(), &rs.namespace().unwrap_or_default());
    let started = std::time::Instant::now();
    let reconciling = finalizer(&api, FINALIZER, rs, |event| async {
        match event {
            Event::Apply(rs) => apply(rs, ctx.clone()).await,
            Event::Cleanup(rs) => cleanup(rs, ctx.clone()).await,
        }
    });
    // Bounded: reconciles run one at a time, and one that hung would hold every other.
    let result = match tokio::time::timeout(super::region_peering::RECONCILE_TIMEOUT, reconciling).await {
        Ok(result) => result.map_err(|e| Error::Finalizer(Box::new(e))),
        Err(_) => Err(Error::TimedOut),
    };
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

/// One reconcile: read (the registry etcd's connection), decide (restart the drain when its
/// configuration changed), act (start it), report (status and metrics from its progress).
async fn apply(rs: Arc<RegistrySchema>, ctx: Arc<Context>) -> Result<Action, Error> {
    let namespace = rs.namespace().unwrap_or_default();
    let key = format!("{namespace}/{}", rs.name_any());
    let spec = &rs.spec;
    let previous = rs.status.clone().unwrap_or_default();

    // What the CRD's rules refuse, for an object created before them.
    if let Some(problem) = crate::keys::legacy_prefix_problem(&spec.legacy_prefix) {
        let status =
            failed_status(&previous, rs.metadata.generation, "InvalidSpec", &format!("spec.legacyPrefix: {problem}"));
        write_status(&ctx, &rs, &previous, status).await?;
        return Ok(Action::requeue(Duration::from_secs(60)));
    }
    let target = match super::region_peering::resolve_connection(&ctx.client, &namespace, &spec.etcd).await {
        Ok(a) => a,
        Err(e) => {
            let status = failed_status(&previous, rs.metadata.generation, e.reason(), &e.to_string());
            write_status(&ctx, &rs, &previous, status).await?;
            // The phase metric says Failed too, so that the drain-failed alert can fire.
            ctx.metrics.record_drain_phase(&spec.region, DrainPhase::Failed);
            return Ok(Action::requeue(Duration::from_secs(10)));
        }
    };
    // Decide: an older RegistrySchema migrating this region of this etcd drains; this one
    // drains nothing (its running drain stops) and says whose it is.
    if let Some(message) = schema_conflict(&claim(&ctx, &rs), &ctx.claims().await) {
        if let Some(running) = ctx.drains.lock().expect("lock").remove(&key) {
            running.cancel.cancel();
            warn!(object = %key, %message, "drain refused");
        }
        let status = failed_status(&previous, rs.metadata.generation, SCHEMA_CLAIMED, &message);
        write_status(&ctx, &rs, &previous, status).await?;
        ctx.metrics.record_drain_phase(&spec.region, DrainPhase::Failed);
        return Ok(Action::requeue(Duration::from_secs(10)));
    }
    let fingerprint = drain_fingerprint(spec, target.fingerprint);
    let restart = ctx.drains.lock().expect("lock").get(&key).is_none_or(|d| d.fingerprint != fingerprint);
    if restart {
        // Before anything is read or written: the etcd must be the region's origin.
        if let Some((reason, message)) = check_target(&ctx, &rs, &key, &target).await {
            if let Some(running) = ctx.drains.lock().expect("lock").remove(&key) {
                running.cancel.cancel();
            }
            warn!(object = %key, reason, %message, "drain refused");
            let status = failed_status(&previous, rs.metadata.generation, &reason, &message);
            write_status(&ctx, &rs, &previous, status).await?;
            ctx.metrics.record_drain_phase(&spec.region, DrainPhase::Failed);
            return Ok(Action::requeue(Duration::from_secs(10)));
        }
        let settings = drain_settings(spec, &key, &ctx.settings.identity);
        start_drain(&ctx, &key, fingerprint, settings, target.target);
    }

    let progress = {
        let drains = ctx.drains.lock().expect("lock");
        drains.get(&key).map(|d| (d.progress.borrow().clone(), d.error.lock().expect("lock").clone()))
    };
    // Stopped since by the sweeper (the object was deleted meanwhile): nothing to report.
    let Some((report, error)) = progress else { return Ok(Action::requeue(Duration::from_secs(1))) };
    record_metrics(&ctx.metrics, &spec.region, &report);
    let status = status_from(&previous, rs.metadata.generation, &report, error.as_deref());
    write_status(&ctx, &rs, &previous, status).await?;
    Ok(Action::requeue(ctx.settings.refresh_interval.min(Duration::from_secs(2))))
}

/// The reason of a RegistrySchema refused because an older one migrates the same region of the
/// same etcd.
pub const SCHEMA_CLAIMED: &str = "SchemaClaimed";

/// The reasons a RegistrySchema drains nothing for: another claim comes first, or its etcd is
/// not its region's origin.
const REFUSALS: [&str; 4] = [SCHEMA_CLAIMED, "EtcdHoldsCopy", "EtcdOfAnotherRegion", "NotTheRegionsEtcd"];

/// Why the drain may not run on its etcd (`plan::drain_target_refusal`), or that it could not be
/// told (the etcd does not answer, the RegionPeerings are not listed yet): (reason, message).
async fn check_target(
    ctx: &Context,
    rs: &RegistrySchema,
    key: &str,
    access: &super::etcd_access::Access,
) -> Option<(String, String)> {
    let Some(peerings) = ctx.peerings.peering_views() else {
        return Some(("NotChecked".into(), "waiting for the RegionPeerings to be listed before draining".into()));
    };
    let timeout = Duration::from_secs(10);
    let read = async {
        let client = access.target.connect().await.map_err(|e| e.classified())?;
        let owner = crate::keys::owner_key(&rs.spec.region);
        let resp =
            crate::mirror::target::kv(&client).get(owner, None).await.map_err(|e| access.target.classify(&e, None))?;
        Ok::<_, crate::mirror::problem::Classified>(resp)
    };
    let resp = match tokio::time::timeout(timeout, read).await {
        Ok(Ok(resp)) => resp,
        Ok(Err(c)) => return Some((c.problem.reason().into(), format!("spec.etcd: {}", c.message))),
        Err(_) => return Some(("Unreachable".into(), format!("spec.etcd: no answer within {timeout:?}"))),
    };
    let holds_copy = resp.kvs().first().map(|kv| {
        crate::mirror::records::checkpoint::Owner::decode(kv.value())
            .map(|o| o.object.as_ref().map_or(o.owner.clone(), |obj| obj.describe()))
            .unwrap_or_else(|| "an unreadable owner record".into())
            .chars()
            .take(200)
            .collect()
    });
    let target = super::plan::DrainTarget {
        object: key.to_string(),
        region: rs.spec.region.clone(),
        endpoints: rs.spec.etcd.endpoints.clone(),
        cluster_id: resp.header().map_or(0, |h| h.cluster_id()),
        holds_copy,
    };
    super::plan::drain_target_refusal(&target, &peerings)
}

/// `rs`'s claim on its region's legacy keys. It runs when its drain runs here, or its status says
/// it started and was not refused (what a new leader knows).
fn claim(ctx: &Context, rs: &RegistrySchema) -> SchemaClaim {
    let object = format!("{}/{}", rs.namespace().unwrap_or_default(), rs.name_any());
    let started = rs.status.as_ref().is_some_and(|s| {
        let refused = s.conditions.iter().any(|c| c.type_ == "Ready" && REFUSALS.contains(&c.reason.as_str()));
        s.started_time.is_some() && !refused
    });
    SchemaClaim {
        running: started || ctx.drains.lock().expect("lock").contains_key(&object),
        object,
        region: rs.spec.region.clone(),
        endpoints: rs.spec.etcd.endpoints.clone(),
        legacy_prefix: rs.spec.legacy_prefix.clone(),
        created: rs.metadata.creation_timestamp.as_ref().map(|t| t.0.to_string()).unwrap_or_default(),
    }
}

/// Everything that, when changed, restarts the drain.
fn drain_fingerprint(spec: &RegistrySchemaSpec, connection: u64) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (serde_json::to_string(spec).unwrap_or_default(), connection).hash(&mut hasher);
    hasher.finish()
}

/// The drain's settings from the spec, with the CRD's bounds enforced again.
fn drain_settings(spec: &RegistrySchemaSpec, key: &str, identity: &str) -> DrainSettings {
    let mut settings = DrainSettings::new(&spec.region, &spec.cluster);
    settings.legacy_prefix = spec.legacy_prefix.clone();
    settings.batch_size = spec.drain.batch_size.clamp(1, 128) as usize;
    settings.rate_limit_per_second = spec.drain.rate_limit_per_second.max(0) as u64;
    settings.quiet_period = Duration::from_secs(spec.drain.quiet_period_seconds.max(0) as u64);
    settings.dry_run = spec.dry_run;
    // After Complete the drain keeps following the legacy prefix while this object exists:
    // registrars still on v0 that write late are migrated too.
    settings.follow = true;
    settings.holder = format!("RegistrySchema {key} (operator {identity})");
    settings
}

/// Replaces the object's drain (if any) with one on `settings`; it retries with backoff until it
/// completes or is cancelled, keeping its last error for status.
fn start_drain(ctx: &Context, key: &str, fingerprint: u64, settings: DrainSettings, etcd: crate::mirror::EtcdTarget) {
    if let Some(old) = ctx.drains.lock().expect("lock").remove(key) {
        old.cancel.cancel();
    }
    let dry_run = settings.dry_run;
    let (tx, rx) = watch::channel(DrainReport { phase: Some(DrainPhase::Pending), dry_run, ..Default::default() });
    let cancel = CancellationToken::new();
    let error = Arc::new(Mutex::new(None));
    let (cancel2, error2) = (cancel.clone(), error.clone());
    let supervision = ctx.peerings.supervision();
    let task = tokio::spawn(async move {
        use futures::FutureExt;
        let mut backoff = crate::mirror::backoff::Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
        while !cancel2.is_cancelled() {
            // A panic is counted and taken as a failed attempt: the drain resumes from its record.
            let attempt = async {
                match etcd.connect().await {
                    Ok(client) => drain(&client, &settings, &tx, &cancel2).await,
                    Err(e) => Err(anyhow::anyhow!(e).context("connecting to the registry etcd")),
                }
            };
            let result = match std::panic::AssertUnwindSafe(attempt).catch_unwind().await {
                Ok(result) => result,
                Err(panic) => {
                    let what = crate::supervise::panic_message(panic.as_ref());
                    supervision.panicked("drain", &what);
                    Err(anyhow::anyhow!("the drain panicked ({what})"))
                }
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
    info!(object = %key, dry_run, "drain started");
    ctx.drains
        .lock()
        .expect("lock")
        .insert(key.to_string(), RunningDrain { fingerprint, cancel, task, progress: rx, error });
}

/// The drain's counters are cumulative (kept in its record), published as they grow.
fn record_metrics(metrics: &Metrics, region: &str, report: &DrainReport) {
    for (outcome, n) in [
        ("copied", report.copied),
        ("already_present", report.already_present),
        ("skipped", report.skipped),
        ("foreign", report.foreign),
        ("deleted", report.deleted),
    ] {
        metrics.advance_drain(DrainLabels { region: region.to_string(), outcome: outcome.into() }, n);
    }
    metrics.record_drain_phase(region, report.phase.unwrap_or(DrainPhase::Pending));
}

/// Writes the status when it differs from what the object shows.
async fn write_status(
    ctx: &Context,
    rs: &RegistrySchema,
    previous: &RegistrySchemaStatus,
    status: RegistrySchemaStatus,
) -> Result<(), Error> {
    if &status == previous {
        return Ok(());
    }
    let api: Api<RegistrySchema> = Api::namespaced(ctx.client.clone(), &rs.namespace().unwrap_or_default());
    let body = serde_json::json!({
        "apiVersion": "federation.aether.dev/v1alpha1",
        "kind": "RegistrySchema",
        "status": status,
    });
    let params = PatchParams::apply(super::region_peering::FIELD_MANAGER).force();
    api.patch_status(&rs.name_any(), &params, &Patch::Apply(body)).await.map_err(Error::WriteStatus)?;
    Ok(())
}
