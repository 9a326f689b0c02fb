//! The RegionPeering reconciler: turns the spec into running mirror workers, and what they report
//! into status, events and metrics. Only the region's leader runs it.
use super::etcd_access::{Access, AccessError, SecretRead, access};
use super::plan::{self, Claim, WorkerChange, conflict};
use super::status::{self, Observation, STATUS_HEARTBEAT};
use super::trials::{Applied, Trials, explain, trial_config};
use crate::api::{EtcdConnection, RegionPeering, RegionPeeringSpec};
use crate::metrics::Metrics;
use crate::mirror::{self, MirrorConfig, MirrorEvent, MirrorHandle, inbound};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Settings of the controller (from the command line).
#[derive(Clone, Debug)]
pub struct ControllerSettings {
    /// This instance's name (the pod name): the leader in status and the owner of the mirrors.
    pub identity: String,
    /// How often status and metrics are refreshed from the workers' health.
    pub refresh_interval: Duration,
    /// The Lease electing this region's leader ("namespace/name"), named in status.
    pub leader_lease: String,
    /// How long that Lease stays valid after a renewal: how long a crashed leader's successor
    /// waits before it starts the workers (the `HandoffCovered` condition).
    pub leader_lease_duration: Duration,
    /// This Kubernetes cluster's name ("": not given), recorded with each mirror's owner.
    pub cluster_name: String,
    /// The bytes every worker of the process holds for writes on their way, together.
    pub memory: Arc<mirror::MemoryBudget>,
}

struct Running {
    fingerprint: u64,
    /// The configuration it runs on, as a person names it.
    applied: Applied,
    /// The local etcd it mirrors from: while a change of `spec.localEtcd` is held, the inbound
    /// view and the claim on the region stay with the etcd the workers actually read.
    local: Access,
    /// The peer it writes, with the credentials it writes with: deletion retires the copy with
    /// them even when the namespace's deletion took the Secret first.
    peer: Access,
    handle: MirrorHandle,
    events: tokio::task::JoinHandle<()>,
}

/// What the reconciler keeps between runs.
pub struct Context {
    client: kube::Client,
    recorder: Recorder,
    settings: ControllerSettings,
    metrics: Arc<Metrics>,
    /// One store per watched namespace (or one for all): claims and deletions look at all.
    stores: Mutex<Vec<Store<RegionPeering>>>,
    /// Consecutive reconcile failures by object, for the error backoff.
    failures: Mutex<HashMap<String, u32>>,
    /// Workers by object (namespace/name), then by peer region.
    workers: Mutex<HashMap<String, BTreeMap<String, Running>>>,
    /// A client of each object's local etcd, for the inbound view.
    locals: tokio::sync::Mutex<HashMap<String, (u64, etcd_client::Client)>>,
    /// When each object's status was last written, and the region it named.
    patched: Mutex<HashMap<String, Instant>>,
    announced: Mutex<std::collections::HashSet<String>>,
    /// The local etcd cluster id of each object, once seen.
    cluster_ids: Mutex<HashMap<String, u64>>,
    /// What each object's workers share.
    budgets: Mutex<HashMap<String, Shares>>,
    /// Each peer's configuration tried before a worker runs on it.
    trials: Trials,
    /// Reconciles run one at a time: a claim decided for one object (its trials started) is seen
    /// by the next, so two objects claiming a region never both start.
    serial: tokio::sync::Mutex<()>,
    /// Warnings published lately: (object, reason, note) -> when.
    warned: Mutex<HashMap<(String, String, String), Instant>>,
    /// Where the workers' and keepers' panics are counted.
    supervision: Arc<crate::supervise::Supervision>,
}

impl Context {
    pub fn new(
        client: kube::Client,
        settings: ControllerSettings,
        metrics: Arc<Metrics>,
        supervision: Arc<crate::supervise::Supervision>,
    ) -> Arc<Self> {
        let reporter = Reporter { controller: "aether-operator".into(), instance: Some(settings.identity.clone()) };
        Arc::new(Context {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            settings,
            metrics,
            stores: Mutex::new(Vec::new()),
            failures: Mutex::new(HashMap::new()),
            workers: Mutex::new(HashMap::new()),
            locals: tokio::sync::Mutex::new(HashMap::new()),
            patched: Mutex::new(HashMap::new()),
            announced: Mutex::new(Default::default()),
            warned: Mutex::new(HashMap::new()),
            cluster_ids: Mutex::new(HashMap::new()),
            budgets: Mutex::new(HashMap::new()),
            trials: Trials::default(),
            serial: tokio::sync::Mutex::new(()),
            supervision,
        })
    }

    /// A new term of the controllers begins: the stores of the last one are gone, and the
    /// leadership is announced again. The workers (and what the context knows of them) stay.
    pub fn new_term(&self) {
        self.stores.lock().expect("store lock").clear();
        self.announced.lock().expect("lock").clear();
    }

    /// Whether every watched namespace has been listed: before that, an object not seen yet is
    /// not an object that is gone, nor a claim that does not exist.
    fn stores_ready(&self) -> bool {
        use futures::FutureExt;
        let stores = self.stores.lock().expect("store lock").clone();
        !stores.is_empty() && stores.iter().all(|s| s.wait_until_ready().now_or_never().is_some_and(|r| r.is_ok()))
    }

    /// Where the process's tasks' panics are counted.
    pub fn supervision(&self) -> Arc<crate::supervise::Supervision> {
        self.supervision.clone()
    }

    /// What every RegionPeering this leader serves says of its region's origin etcd (with its
    /// cluster id once seen); None until every watched namespace has been listed.
    pub fn peering_views(&self) -> Option<Vec<plan::PeeringView>> {
        if !self.stores_ready() {
            return None;
        }
        let stores = self.stores.lock().expect("store lock").clone();
        let ids = self.cluster_ids.lock().expect("lock").clone();
        let views = stores
            .iter()
            .flat_map(|s| s.state())
            .map(|rp| {
                let object = object_key(&rp);
                plan::PeeringView {
                    cluster_id: ids.get(&object).copied(),
                    object,
                    region: rp.spec.region.clone(),
                    endpoints: rp.spec.local_etcd.endpoints.clone(),
                }
            })
            .collect();
        Some(views)
    }

    /// Stops every worker (leadership lost, or shutdown). Nothing is revoked: the mirrors stay on
    /// the peers until a successor adopts their leases or they lapse.
    pub async fn stop_all(&self) {
        let all: Vec<(String, BTreeMap<String, Running>)> =
            self.workers.lock().expect("workers lock").drain().collect();
        // All at once: each clean stop releases its mirror on its peer, and a peer that does not
        // answer holds its own worker's stop for a few seconds, not everyone's.
        let stopping = all
            .into_iter()
            .flat_map(|(object, workers)| {
                workers.into_iter().map(move |(peer, running)| (object.clone(), peer, running))
            })
            .map(|(object, peer, running)| async move { self.stop_worker(&object, &peer, running).await });
        futures::future::join_all(stopping).await;
        self.announced.lock().expect("lock").clear();
        self.metrics.forget_inbound();
    }

    async fn stop_worker(&self, object: &str, peer: &str, running: Running) {
        let region = running.handle.health().origin;
        running.handle.shutdown().await;
        running.events.abort();
        self.metrics.forget_peer(&region, peer);
        info!(object, peer, "mirror worker stopped");
    }
}

/// The finalizer that lets a deleted RegionPeering stop its workers and retire its mirrors.
pub const FINALIZER: &str = "federation.aether.dev/mirror";

/// Reconciles on changes of the spec, the finalizers and the deletion mark, not of the status
/// this controller writes itself; the periodic requeue refreshes the status.
fn spec_changes(rp: &RegionPeering) -> Option<u64> {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (rp.meta().generation, rp.finalizers(), rp.meta().deletion_timestamp.is_some(), rp.meta().uid.as_deref())
        .hash(&mut h);
    Some(h.finish())
}

/// Runs the controller until `stop` fires. `namespace` None watches every namespace.
pub async fn run(ctx: Arc<Context>, namespace: Option<String>, stop: CancellationToken) {
    let api: Api<RegionPeering> = match &namespace {
        Some(ns) => Api::namespaced(ctx.client.clone(), ns),
        None => Api::all(ctx.client.clone()),
    };
    let (reader, writer) = kube::runtime::reflector::store();
    let trigger = watcher(api, watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .applied_objects()
        .predicate_filter(spec_changes, Default::default());
    ctx.stores.lock().expect("store lock").push(reader.clone());
    Controller::for_stream(trigger, reader)
        .graceful_shutdown_on(stop.cancelled_owned())
        .run(reconcile, error_policy, ctx.clone())
        .for_each(|result| async move {
            if let Err(error) = result {
                warn!(%error, "reconcile failed");
            }
        })
        .await;
}

/// The longest one reconcile may take (a deletion waits up to 15 s for each peer).
pub const RECONCILE_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the reconcile took longer than {RECONCILE_TIMEOUT:?}; it is tried again")]
    TimedOut,
    #[error("writing status: {0}")]
    WriteStatus(#[source] kube::Error),
    #[error("finalizer: {0}")]
    Finalizer(Box<kube::runtime::finalizer::Error<Error>>),
}

/// Retries with exponential backoff from the refresh interval up to five minutes.
fn error_policy(rp: Arc<RegionPeering>, error: &Error, ctx: Arc<Context>) -> Action {
    let n = {
        let mut failures = ctx.failures.lock().expect("lock");
        let n = failures.entry(object_key(&rp)).or_insert(0);
        *n = n.saturating_add(1);
        *n
    };
    let delay = ctx.settings.refresh_interval.saturating_mul(1 << n.min(8)).min(Duration::from_secs(300));
    warn!(%error, attempt = n, retry_in = ?delay, "reconcile failed; will retry");
    Action::requeue(delay)
}

fn object_key(rp: &RegionPeering) -> String {
    format!("{}/{}", rp.namespace().unwrap_or_default(), rp.name_any())
}

async fn reconcile(rp: Arc<RegionPeering>, ctx: Arc<Context>) -> Result<Action, Error> {
    use kube::runtime::finalizer::{Event, finalizer};
    let _serial = ctx.serial.lock().await;
    crate::faults::point("controller");
    let api: Api<RegionPeering> = Api::namespaced(ctx.client.clone(), &rp.namespace().unwrap_or_default());
    let started = Instant::now();
    let reconciling = finalizer(&api, FINALIZER, rp, |event| async {
        match event {
            Event::Apply(rp) => apply(rp, ctx.clone()).await,
            Event::Cleanup(rp) => cleanup(rp, ctx.clone()).await,
        }
    });
    // Bounded: reconciles run one at a time, and one that hung would hold every other.
    let result = match tokio::time::timeout(RECONCILE_TIMEOUT, reconciling).await {
        Ok(result) => result.map_err(|e| Error::Finalizer(Box::new(e))),
        Err(_) => Err(Error::TimedOut),
    };
    ctx.metrics.reconciled("regionpeering", started.elapsed(), result.is_ok());
    result
}

/// The object was deleted: stop its workers, then retire its mirror from every peer as
/// `spec.deletionPolicy` says. A peer that cannot be reached in time does not block the
/// deletion (its copy lapses with the lease); an Event says so.
async fn cleanup(rp: Arc<RegionPeering>, ctx: Arc<Context>) -> Result<Action, Error> {
    let key = object_key(&rp);
    let namespace = rp.namespace().unwrap_or_default();
    let workers = ctx.workers.lock().expect("workers lock").remove(&key).unwrap_or_default();
    // The credentials the workers wrote with: a namespace's deletion removes its Secrets first.
    let mut writing: BTreeMap<String, Access> =
        workers.iter().map(|(peer, running)| (peer.clone(), running.peer.clone())).collect();
    for (peer, running) in workers {
        ctx.stop_worker(&key, &peer, running).await;
    }
    ctx.locals.lock().await.remove(&key);
    ctx.trials.forget_object(&key);
    ctx.announced.lock().expect("lock").remove(&key);
    ctx.patched.lock().expect("lock").remove(&key);
    ctx.failures.lock().expect("lock").remove(&key);
    ctx.cluster_ids.lock().expect("lock").remove(&key);
    ctx.budgets.lock().expect("lock").remove(&key);
    let spec = &rp.spec;
    let policy = match spec.deletion_policy {
        crate::api::DeletionPolicy::Lapse => mirror::retire::RetirePolicy::Lapse,
        crate::api::DeletionPolicy::Delete => mirror::retire::RetirePolicy::Delete,
    };
    // Only what this object owns is retired: a refused duplicate's deletion touches nothing.
    let object = owning_object(&ctx, &rp);
    for peer in &spec.peers {
        let access = match writing.remove(&peer.region) {
            Some(access) => Ok(access),
            None => resolve(&ctx, &namespace, &peer.connection()).await,
        };
        let outcome = match access {
            Err(e) => Err(anyhow::anyhow!("{e}")),
            Ok(access) => {
                let retiring = mirror::retire::retire(&access.target, &spec.region, policy, &object);
                match tokio::time::timeout(RETIRE_TIMEOUT, retiring).await {
                    Ok(r) => r,
                    Err(_) => Err(anyhow::anyhow!("no answer within {RETIRE_TIMEOUT:?}")),
                }
            }
        };
        let (region, peer_region) = (&spec.region, &peer.region);
        match outcome {
            Ok(retired) => {
                info!(object = key, peer = %peer_region, ?retired, "mirror retired from the peer");
            }
            Err(error) => {
                warn!(object = key, peer = %peer_region, %error, "could not retire the mirror from the peer");
                publish(
                    &ctx,
                    &rp,
                    EventType::Warning,
                    "RetireFailed",
                    format!(
                        "{region} -> {peer_region}: {error:#}; the mirror there lapses with its leases within {}s, its bookkeeping under {} stays",
                        spec.lease.ttl_seconds,
                        crate::keys::federation_prefix(region)
                    ),
                )
                .await;
            }
        }
    }
    Ok(Action::await_change())
}

/// How long deletion waits for one peer.
const RETIRE_TIMEOUT: Duration = Duration::from_secs(15);

/// One reconcile of a live object: read, decide (pure, `plan::decide`), act, report. Each step
/// reads only what the one before it produced.
async fn apply(rp: Arc<RegionPeering>, ctx: Arc<Context>) -> Result<Action, Error> {
    let key = object_key(&rp);
    if !ctx.stores_ready() {
        // Another namespace's objects (claims on this region) are not listed yet.
        return Ok(Action::requeue(Duration::from_millis(500)));
    }
    sweep_deleted(&ctx).await;
    announce_leadership(&ctx, &rp, &key).await;
    let read = read(&ctx, &rp, &key).await;
    if read.facts.conflict.is_some() || rp.spec.suspend {
        // Decided not to run: nothing of it is on its way to run either.
        ctx.trials.forget_object(&key);
    }
    let decision = plan::decide(&read.facts);
    let held = explain_held(&ctx, &rp.spec, &key, &decision.held, &read.peers);
    act(&ctx, &rp, &key, &decision, &held, read.peers).await;
    let problems = Problems { conflict: read.facts.conflict, config_errors: decision.config_errors, held };
    report(&ctx, &rp, &key, &read.running_local, problems).await?;
    ctx.failures.lock().expect("lock").remove(&key);
    Ok(Action::requeue(ctx.settings.refresh_interval))
}

/// The first reconcile of an object under this leader says so, once.
async fn announce_leadership(ctx: &Context, rp: &RegionPeering, key: &str) {
    if ctx.announced.lock().expect("lock").insert(key.to_string()) {
        let note = format!("{} leads region {} and runs its mirrors", ctx.settings.identity, rp.spec.region);
        publish(ctx, rp, EventType::Normal, "LeaderElected", note).await;
    }
}

/// What a reconcile read: the facts for the decision, and the accesses its actions use.
struct Read {
    facts: plan::Facts,
    /// The access of the local etcd the workers read (the spec's while none runs), or why it
    /// cannot be built.
    running_local: Result<Access, AccessError>,
    /// Each resolved peer's (worker fingerprint, local access, peer access).
    peers: BTreeMap<String, (u64, Access, Access)>,
}

/// Reads the connections (Secrets), every claim on this region and the running workers. A
/// worker that ended on its own (only a panic ends one) is dropped here, so it starts again.
async fn read(ctx: &Context, rp: &RegionPeering, key: &str) -> Read {
    let namespace = rp.namespace().unwrap_or_default();
    let spec = &rp.spec;
    let local = resolve(ctx, &namespace, &spec.local_etcd).await;
    // The etcd the workers read (the spec's until they run: a change of it waits for its trial).
    let running_local = ctx
        .workers
        .lock()
        .expect("workers lock")
        .get(key)
        .and_then(|w| w.values().next().map(|r| r.local.clone()))
        .map_or_else(|| local.clone(), Ok);
    // Claims compare etcd cluster ids once they are known.
    if let Ok(local_access) = &running_local
        && let Some(id) = local_cluster_id(ctx, key, local_access).await
    {
        ctx.cluster_ids.lock().expect("lock").insert(key.to_string(), id);
    }
    let objects: Vec<RegionPeering> = ctx
        .stores
        .lock()
        .expect("store lock")
        .iter()
        .flat_map(|s| s.state().iter().map(|o| (**o).clone()).collect::<Vec<_>>())
        .collect();
    let claims: Vec<Claim> = objects.iter().map(|o| claim(ctx, o)).collect();
    let mut peers = BTreeMap::new();
    let mut peer_facts = Vec::new();
    for peer in &spec.peers {
        let resolved = match (&local, resolve(ctx, &namespace, &peer.connection()).await) {
            (_, Err(e)) => Err(problem(&e)),
            (Err(_), Ok(_)) => Ok(0),
            (Ok(local_access), Ok(peer_access)) => {
                let fingerprint =
                    worker_fingerprint(spec, &peer.region, local_access.fingerprint, peer_access.fingerprint);
                peers.insert(peer.region.clone(), (fingerprint, local_access.clone(), peer_access));
                Ok(fingerprint)
            }
        };
        peer_facts.push((peer.region.clone(), resolved));
    }
    let running = {
        let mut workers = ctx.workers.lock().expect("workers lock");
        let workers = workers.entry(key.to_string()).or_default();
        workers.retain(|peer, r| {
            let finished = r.handle.is_finished();
            if finished {
                warn!(object = key, peer, "mirror worker ended on its own; starting it again");
            }
            // Retired while its object exists (a retirement it did not ask for): a new worker
            // takes the mirror back. Dropping the handle stops this one.
            let retired = r.handle.health().phase == mirror::Phase::Retired;
            if retired {
                warn!(
                    object = key,
                    peer, "the mirror was retired from the peer while its RegionPeering exists; starting it again"
                );
                r.events.abort();
            }
            !finished && !retired
        });
        workers.iter().map(|(peer, r)| (peer.clone(), r.fingerprint)).collect()
    };
    let trials = peers.iter().map(|(peer, (fingerprint, local, remote))| {
        let tried = ctx.trials.state(key, peer, *fingerprint);
        // A refusal, or "not known", old enough is tried again beside what it says now.
        if ctx.trials.due_again(key, peer, *fingerprint) {
            start_trial(ctx, rp, key, peer, *fingerprint, local, remote);
        }
        (peer.clone(), tried)
    });
    let facts = plan::Facts {
        suspend: spec.suspend,
        conflict: conflict(&claim(ctx, rp), &claims),
        local: local.as_ref().map(|_| ()).map_err(problem),
        peers: peer_facts,
        trials: trials.collect(),
        running,
        recorded: recorded_configurations(rp),
    };
    Read { facts, running_local, peers }
}

/// Tries a peer's configuration beside its running worker (if any).
fn start_trial(
    ctx: &Context,
    rp: &RegionPeering,
    key: &str,
    peer: &str,
    fingerprint: u64,
    local: &Access,
    remote: &Access,
) {
    let mut config = mirror_config(&rp.spec, peer, &ctx.settings.identity, shares(ctx, key, &rp.spec));
    config.object = Some(owning_object(ctx, rp));
    info!(object = key, peer, "trying the peer's configuration before a worker runs on it");
    ctx.trials.start(key, fingerprint, trial_config(config), local.target.clone(), remote.target.clone());
}

/// The held changes, each with the fields that changed (both sides) and how to undo it.
fn explain_held(
    ctx: &Context,
    spec: &RegionPeeringSpec,
    key: &str,
    held: &[plan::HeldChange],
    accesses: &BTreeMap<String, (u64, Access, Access)>,
) -> Vec<plan::HeldChange> {
    let workers = ctx.workers.lock().expect("workers lock");
    held.iter()
        .map(|h| {
            let running = workers.get(key).and_then(|w| w.get(&h.peer)).map(|r| r.applied.clone()).unwrap_or_default();
            let asked = accesses
                .get(&h.peer)
                .map(|(_, local, remote)| Applied::of(spec, &local.described, &remote.described))
                .unwrap_or_default();
            explain(h, &running, &asked)
        })
        .collect()
}

fn problem(error: &AccessError) -> plan::Problem {
    (error.reason().to_string(), error.to_string())
}

/// Publishes the decision's warnings and refused changes (each once), tries configurations, and
/// starts, restarts and stops workers.
async fn act(
    ctx: &Arc<Context>,
    rp: &RegionPeering,
    key: &str,
    decision: &plan::Decision,
    held: &[plan::HeldChange],
    mut accesses: BTreeMap<String, (u64, Access, Access)>,
) {
    for (reason, message) in &decision.warnings {
        publish_once(ctx, rp, reason, message.clone()).await;
    }
    for refused in held.iter().filter(|h| h.refused) {
        publish_once(ctx, rp, &refused.why.0, format!("peer {}: {}", refused.peer, refused.why.1)).await;
    }
    for peer in &decision.trials {
        if let Some((fingerprint, local, remote)) = accesses.get(peer) {
            start_trial(ctx, rp, key, peer, *fingerprint, local, remote);
        }
    }
    // A peer no longer in the spec has no trial to finish.
    for peer in rp.spec.peers.iter().map(|p| &p.region).filter(|p| !accesses.contains_key(*p)) {
        ctx.trials.forget(key, peer);
    }
    for change in &decision.changes {
        let peer = match change {
            WorkerChange::Start(p) | WorkerChange::Restart(p) | WorkerChange::Stop(p) => p,
        };
        if !matches!(change, WorkerChange::Start(_)) {
            let old = ctx.workers.lock().expect("workers lock").get_mut(key).and_then(|w| w.remove(peer));
            if let Some(old) = old {
                ctx.stop_worker(key, peer, old).await;
            }
        }
        ctx.trials.forget(key, peer);
        if !matches!(change, WorkerChange::Stop(_))
            && let Some((fingerprint, local, remote)) = accesses.remove(peer)
        {
            start_worker(ctx, rp, key, peer, fingerprint, local, remote);
        }
    }
}

/// Status, metrics and the inbound view from the workers' health; the status is written only
/// when something visible changed or the heartbeat is due.
async fn report(
    ctx: &Context,
    rp: &RegionPeering,
    key: &str,
    local: &Result<Access, AccessError>,
    problems: Problems,
) -> Result<(), Error> {
    let Problems { conflict, config_errors, held } = problems;
    let spec = &rp.spec;
    let now = SystemTime::now();
    let (peers, configurations): (Vec<mirror::PeerHealth>, BTreeMap<String, u64>) = ctx
        .workers
        .lock()
        .expect("workers lock")
        .get(key)
        .map(|w| {
            let health = w.values().map(|r| r.handle.health()).collect();
            (health, w.iter().map(|(peer, r)| (peer.clone(), r.fingerprint)).collect())
        })
        .unwrap_or_default();
    for h in &peers {
        ctx.metrics.record_peer(h, now);
    }
    let inbound = match local {
        Ok(local_access) => observe_inbound(ctx, key, spec, local_access).await,
        Err(_) => Vec::new(),
    };
    ctx.metrics.record_inbound(&spec.region, &inbound);
    let observation = Observation {
        spec,
        generation: rp.metadata.generation,
        peers,
        inbound,
        conflict,
        config_errors,
        held,
        leader: Some(ctx.settings.identity.clone()),
        leader_lease: Some(ctx.settings.leader_lease.clone()),
        leader_lease_duration: Some(ctx.settings.leader_lease_duration),
        configurations,
        now,
    };
    let new_status = status::compute(rp.status.as_ref(), &observation);
    if let Some(c) = new_status.conditions.iter().find(|c| c.type_ == status::HANDOFF_COVERED && c.status == "False") {
        publish_once(ctx, rp, &c.reason, c.message.clone()).await;
    }
    let stale = ctx.patched.lock().expect("lock").get(key).is_none_or(|t| t.elapsed() >= STATUS_HEARTBEAT);
    if !status::visible_change(rp.status.as_ref(), &new_status) && !stale {
        return Ok(());
    }
    let api: Api<RegionPeering> = Api::namespaced(ctx.client.clone(), &rp.namespace().unwrap_or_default());
    // Server-side apply of the whole status: fields no longer set are removed.
    let body = serde_json::json!({
        "apiVersion": "federation.aether.dev/v1alpha1",
        "kind": "RegionPeering",
        "status": new_status,
    });
    api.patch_status(&rp.name_any(), &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(body))
        .await
        .map_err(Error::WriteStatus)?;
    ctx.patched.lock().expect("lock").insert(key.to_string(), Instant::now());
    ctx.metrics.status_patched(&spec.region);
    Ok(())
}

/// What keeps the spec from running as it says, for status.
struct Problems {
    conflict: Option<String>,
    config_errors: Vec<plan::Problem>,
    held: Vec<plan::HeldChange>,
}

/// The field manager of everything this operator writes.
pub const FIELD_MANAGER: &str = "aether-operator";

fn claim(ctx: &Context, rp: &RegionPeering) -> Claim {
    let object = object_key(rp);
    let has_workers = ctx.workers.lock().expect("workers lock").get(&object).is_some_and(|w| !w.is_empty());
    Claim {
        cluster_id: ctx.cluster_ids.lock().expect("lock").get(&object).copied(),
        // Workers, or trials on their way to become workers: it was decided to run.
        running: has_workers || ctx.trials.has_object(&object) || ran(rp),
        object,
        region: rp.spec.region.clone(),
        endpoints: rp.spec.local_etcd.endpoints.clone(),
        created: rp.metadata.creation_timestamp.as_ref().map(|t| t.0.to_string()).unwrap_or_default(),
    }
}

/// Whether the object's status says its workers ran and were not refused as a duplicate claim
/// (what a new leader, which runs nothing yet, knows of who was running).
fn ran(rp: &RegionPeering) -> bool {
    let Some(status) = &rp.status else { return false };
    let refused = status.conditions.iter().any(|c| c.type_ == status::CONFLICT && c.status == "True");
    !refused && status.peers.iter().any(|p| p.phase != mirror::Phase::Stopped.as_str())
}

/// The configuration each peer's worker ran on, as the status says (written by the leader
/// before, or by this one before its worker ended): only a worker that was past its claim
/// (syncing, watching, or queued for its sync) and not in conflict.
fn recorded_configurations(rp: &RegionPeering) -> BTreeMap<String, u64> {
    let Some(status) = rp.status.as_ref().filter(|_| ran(rp)) else { return BTreeMap::new() };
    let ran_on = |phase: &str| {
        [mirror::Phase::Watching, mirror::Phase::Syncing, mirror::Phase::Resyncing, mirror::Phase::Queued]
            .iter()
            .any(|p| p.as_str() == phase)
    };
    status
        .peers
        .iter()
        .filter(|p| ran_on(&p.phase))
        .filter_map(|p| {
            let hash = u64::from_str_radix(p.configuration.as_deref()?, 16).ok()?;
            Some((p.region.clone(), hash))
        })
        .collect()
}

/// Everything that, when changed, restarts a worker.
fn worker_fingerprint(spec: &RegionPeeringSpec, peer: &str, local: u64, remote: u64) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (peer, &spec.region, local, remote).hash(&mut h);
    serde_json::to_string(&(&spec.lease, &spec.sync, &spec.failure_detector)).unwrap_or_default().hash(&mut h);
    h.finish()
}

/// Reads the connection's Secret (if any) and builds the access.
async fn resolve(ctx: &Context, namespace: &str, connection: &EtcdConnection) -> Result<Access, AccessError> {
    resolve_connection(&ctx.client, namespace, connection).await
}

/// Reads the connection's Secret (if any) and builds the access; a Secret that is missing,
/// forbidden or unreadable is each its own error.
pub(crate) async fn resolve_connection(
    client: &kube::Client,
    namespace: &str,
    connection: &EtcdConnection,
) -> Result<Access, AccessError> {
    let secret = match &connection.tls {
        None => None,
        Some(tls) => {
            let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
            let name = &tls.secret_ref.name;
            match SecretRead::from_result(name, api.get_opt(name).await) {
                SecretRead::Found(secret) => Some(*secret),
                SecretRead::Missing => None,
                SecretRead::Failed(e) => return Err(e),
            }
        }
    };
    access(connection, secret.as_ref())
}

/// What the workers of one object share.
#[derive(Clone)]
struct Shares {
    /// The verification budget.
    verify: Arc<mirror::VerifyBudget>,
    /// How many peers they mirror into, for their share of each peer etcd's connections.
    peers: Arc<std::sync::atomic::AtomicUsize>,
    /// The full syncs they take turns at.
    syncs: Arc<mirror::SyncSlots>,
    /// The origin's pages their syncs read once.
    reads: Arc<mirror::OriginReads>,
    /// Where their panics are counted (the process's).
    supervision: Arc<crate::supervise::Supervision>,
    /// The process's memory budget.
    memory: Arc<mirror::MemoryBudget>,
}

/// The object's shares: one for all its workers; the budget replaced when its rate changes, the
/// peer count kept current for the workers already running.
fn shares(ctx: &Context, key: &str, spec: &RegionPeeringSpec) -> Shares {
    let rate = spec.sync.verify_keys_per_second.max(0) as u64;
    let mut budgets = ctx.budgets.lock().expect("lock");
    let shares = budgets.entry(key.to_string()).or_insert_with(|| Shares {
        verify: Arc::new(mirror::VerifyBudget::new(rate)),
        peers: Default::default(),
        syncs: Default::default(),
        reads: Default::default(),
        supervision: ctx.supervision.clone(),
        memory: ctx.settings.memory.clone(),
    });
    if shares.verify.keys_per_second() != rate {
        shares.verify = Arc::new(mirror::VerifyBudget::new(rate));
    }
    shares.peers.store(spec.peers.len(), std::sync::atomic::Ordering::Relaxed);
    shares.clone()
}

fn mirror_config(spec: &RegionPeeringSpec, peer: &str, owner: &str, shares: Shares) -> MirrorConfig {
    let mut c = MirrorConfig::new(&spec.region, peer, owner);
    c.supervision = shares.supervision;
    c.memory = shares.memory;
    c.verify_budget = shares.verify;
    c.origin_peers = shares.peers;
    c.sync_slots = shares.syncs;
    c.origin_reads = shares.reads;
    c.lease_ttl_seconds = spec.lease.ttl_seconds;
    c.keepalive_interval = Duration::from_secs(spec.lease.keepalive_interval_seconds.max(1) as u64);
    c.max_keys_per_lease = spec.lease.max_keys_per_lease.max(1) as u64;
    c.page_size = spec.sync.page_size;
    c.max_txn_ops = spec.sync.max_txn_ops.max(4) as usize;
    c.max_txn_bytes = spec.sync.max_txn_bytes.max(65536) as usize;
    c.max_request_bytes = spec.sync.max_request_bytes.max(65536) as usize;
    c.watch_linger = Duration::from_millis(spec.sync.watch_linger_milliseconds.clamp(0, 1000) as u64);
    c.acceptable_pause = Duration::from_secs(spec.failure_detector.effective_pause_seconds(&spec.lease) as u64);
    c.max_resync_delete_percent = spec.sync.max_resync_delete_percent.clamp(0, 100) as u8;
    c
}

/// The object a worker mirrors for, as the peers record it.
fn owning_object(ctx: &Context, rp: &RegionPeering) -> mirror::OwningObject {
    mirror::OwningObject {
        namespace: rp.namespace().unwrap_or_default(),
        name: rp.name_any(),
        uid: rp.uid().unwrap_or_default(),
        cluster: ctx.settings.cluster_name.clone(),
    }
}

fn start_worker(
    ctx: &Arc<Context>,
    rp: &RegionPeering,
    key: &str,
    peer: &str,
    fingerprint: u64,
    local: Access,
    remote: Access,
) {
    let owner = format!("{}/{:08x}", ctx.settings.identity, rand::random::<u32>());
    let mut config = mirror_config(&rp.spec, peer, &owner, shares(ctx, key, &rp.spec));
    config.object = Some(owning_object(ctx, rp));
    let (tx, mut rx) = tokio::sync::mpsc::channel::<MirrorEvent>(256);
    let applied = Applied::of(&rp.spec, &local.described, &remote.described);
    let (local_access, peer_access) = (local.clone(), remote.clone());
    let handle = mirror::spawn(config, local.target, remote.target, tx);
    let reference = rp.object_ref(&());
    let (ctx2, region, peer_name) = (ctx.clone(), rp.spec.region.clone(), peer.to_string());
    let events = tokio::spawn(async move {
        while let Some(event) = rx.recv().await {
            let (type_, reason, note) = describe(&event, &region, &peer_name);
            let action = event_action(&event, &peer_name);
            let event = KubeEvent { type_, reason: reason.into(), note: Some(note), action, secondary: None };
            if let Err(error) = ctx2.recorder.publish(&event, &reference).await {
                warn!(%error, "could not publish an event");
            }
        }
    });
    info!(object = key, peer, "mirror worker started");
    ctx.workers.lock().expect("workers lock").entry(key.to_string()).or_default().insert(
        peer.to_string(),
        Running { fingerprint, applied, local: local_access, peer: peer_access, handle, events },
    );
}

/// The action of a mirror event's Kubernetes Event. The recorder folds events by type, reason and
/// action (not the note) into one series, whose note stays the first's: the action names the peer,
/// or a second peer's events would vanish into the first's, and a full sync's cause, or a run of
/// reshards would read as the lost lease that started the series.
pub fn event_action(event: &MirrorEvent, peer: &str) -> String {
    match event {
        MirrorEvent::ResyncStarted { cause } => format!("Mirror:{peer}:{}", cause.label()),
        _ => format!("Mirror:{peer}"),
    }
}

/// A mirror event as a Kubernetes Event: type, reason and a note naming region and peer.
pub fn describe(event: &MirrorEvent, region: &str, peer: &str) -> (EventType, &'static str, String) {
    match event {
        MirrorEvent::ResyncStarted { cause } => {
            (EventType::Normal, "ResyncStarted", format!("{region} -> {peer}: full sync ({})", cause.as_str()))
        }
        MirrorEvent::Synced { revision, keys } => (
            EventType::Normal,
            "Synced",
            format!("{region} -> {peer}: {keys} keys at revision {revision}; canary written"),
        ),
        MirrorEvent::LeaseGranted { lease, shard } => {
            (EventType::Normal, "LeaseGranted", format!("{region} -> {peer}: lease {lease:x} for shard {shard}"))
        }
        MirrorEvent::LeasesAdopted { leases, revision } => (
            EventType::Normal,
            "LeasesAdopted",
            format!("{region} -> {peer}: adopted {leases} leases, resuming after revision {revision}"),
        ),
        MirrorEvent::Fenced { by } => (
            EventType::Warning,
            "Fenced",
            format!("{region} -> {peer}: {by} owns this mirror now; this worker stopped writing"),
        ),
        MirrorEvent::Refused(refusal) => {
            (EventType::Warning, refusal.reason, format!("{region} -> {peer}: {}", refusal.message))
        }
        MirrorEvent::RegionUnreachable => (
            EventType::Warning,
            "RegionUnreachable",
            format!("{region} -> {peer}: peer unreachable; nothing is deleted"),
        ),
        MirrorEvent::RegionReachable => {
            (EventType::Normal, "RegionReachable", format!("{region} -> {peer}: peer reachable again"))
        }
        MirrorEvent::RevisionSplit { revision, ops } => (
            EventType::Warning,
            "RevisionSplit",
            format!(
                "{region} -> {peer}: revision {revision} has {ops} writes, more than one peer Txn holds; applied in parts"
            ),
        ),
        MirrorEvent::RenewalsTooSlow(short) => {
            (EventType::Warning, "RenewalsTooSlow", format!("{region} -> {peer}: {}", short.describe()))
        }
        MirrorEvent::DriftRepaired { keys, first_key } => (
            EventType::Warning,
            "DriftRepaired",
            format!(
                "{region} -> {peer}: {keys} keys differed from the origin on the peer (first: {first_key}) and were repaired; something besides this mirror writes there, or the peer was restored"
            ),
        ),
        MirrorEvent::SessionFailed { reason, message } => {
            (EventType::Warning, reason, format!("{region} -> {peer}: the mirror fails: {message}"))
        }
        MirrorEvent::LeasesGranted { leases } => (
            EventType::Normal,
            "LeaseGranted",
            format!("{region} -> {peer}: {leases} leases granted for the sync's layout"),
        ),
        MirrorEvent::ValueTooLarge { key, bytes } => (
            EventType::Warning,
            "ValueTooLarge",
            format!(
                "{region} -> {peer}: {key} holds {bytes} bytes, more than the peer accepts in one request; it is left out of the mirror until it shrinks (or raise the peer's --max-request-bytes and spec.sync.maxRequestBytes)"
            ),
        ),
    }
}

async fn publish(ctx: &Context, rp: &RegionPeering, type_: EventType, reason: &str, note: String) {
    let event =
        KubeEvent { type_, reason: reason.into(), note: Some(note), action: "Reconcile".into(), secondary: None };
    if let Err(error) = ctx.recorder.publish(&event, &rp.object_ref(&())).await {
        warn!(%error, "could not publish an event");
    }
}

/// Publishes a warning once: the same reason and note for the same object again only after
/// `WARNING_REPEAT`, not on every reconcile.
async fn publish_once(ctx: &Context, rp: &RegionPeering, reason: &str, note: String) {
    let key = (object_key(rp), reason.to_string(), note.clone());
    {
        let mut warned = ctx.warned.lock().expect("lock");
        if warned.get(&key).is_some_and(|at| at.elapsed() < WARNING_REPEAT) {
            return;
        }
        warned.retain(|_, at| at.elapsed() < WARNING_REPEAT);
        warned.insert(key, Instant::now());
    }
    publish(ctx, rp, EventType::Warning, reason, note).await;
}

/// How long a repeated warning stays quiet.
const WARNING_REPEAT: Duration = Duration::from_secs(600);

async fn observe_inbound(
    ctx: &Context,
    key: &str,
    spec: &RegionPeeringSpec,
    local: &Access,
) -> Vec<inbound::InboundOrigin> {
    let Some(mut client) = local_client(ctx, key, local).await else { return Vec::new() };
    let expected: Vec<String> = spec.peers.iter().map(|p| p.region.clone()).collect();
    match tokio::time::timeout(Duration::from_secs(5), inbound::observe(&mut client, &spec.region, &expected)).await {
        Ok(Ok(v)) => v,
        _ => Vec::new(),
    }
}

/// A client of the object's local etcd, kept between reconciles.
async fn local_client(ctx: &Context, key: &str, local: &Access) -> Option<etcd_client::Client> {
    let mut locals = ctx.locals.lock().await;
    if !matches!(locals.get(key), Some((f, _)) if *f == local.fingerprint) {
        let client = tokio::time::timeout(Duration::from_secs(5), local.target.connect()).await.ok()?.ok()?;
        locals.insert(key.to_string(), (local.fingerprint, client));
    }
    locals.get(key).map(|(_, c)| c.clone())
}

/// The local etcd's cluster id, if it answers.
async fn local_cluster_id(ctx: &Context, key: &str, local: &Access) -> Option<u64> {
    let mut client = local_client(ctx, key, local).await?;
    let status = tokio::time::timeout(Duration::from_secs(5), client.status()).await.ok()?.ok()?;
    status.header().map(|h| h.cluster_id())
}

/// Stops the workers of objects that no longer exist (deleted objects are not reconciled).
async fn sweep_deleted(ctx: &Arc<Context>) {
    if !ctx.stores_ready() {
        return;
    }
    let stores = ctx.stores.lock().expect("store lock").clone();
    let gone: Vec<String> = ctx
        .workers
        .lock()
        .expect("workers lock")
        .keys()
        .filter(|key| {
            let (ns, name) = key.split_once('/').unwrap_or(("", key));
            let object = ObjectRef::<RegionPeering>::new(name).within(ns);
            stores.iter().all(|store| store.get(&object).is_none())
        })
        .cloned()
        .collect();
    for key in gone {
        let workers = ctx.workers.lock().expect("workers lock").remove(&key).unwrap_or_default();
        for (peer, running) in workers {
            ctx.stop_worker(&key, &peer, running).await;
        }
        ctx.locals.lock().await.remove(&key);
        ctx.trials.forget_object(&key);
        ctx.announced.lock().expect("lock").remove(&key);
        ctx.cluster_ids.lock().expect("lock").remove(&key);
        ctx.budgets.lock().expect("lock").remove(&key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_peer_and_each_cause_of_a_full_sync_is_a_series_of_events_of_its_own() {
        use mirror::ResyncCause;
        let resync = |cause| MirrorEvent::ResyncStarted { cause };
        let (lost, reshard) = (resync(ResyncCause::LeaseLost), resync(ResyncCause::Reshard));
        assert_eq!(
            event_action(&lost, "b"),
            event_action(&resync(ResyncCause::LeaseLost), "b"),
            "the same cause folds"
        );
        assert_ne!(event_action(&lost, "b"), event_action(&reshard, "b"), "reshards after a lost lease stay visible");
        assert_ne!(event_action(&lost, "b"), event_action(&lost, "c"), "another peer's");
        let synced = MirrorEvent::Synced { revision: 7, keys: 3 };
        assert_eq!(event_action(&synced, "b"), "Mirror:b");
        // events.k8s.io caps the action at 128 characters; a region name is at most 63.
        assert!(event_action(&lost, &"r".repeat(63)).len() <= 128);
    }

    fn spec(sync: serde_json::Value) -> RegionPeeringSpec {
        serde_json::from_value(serde_json::json!({
            "region": "a",
            "localEtcd": {"endpoints": ["https://etcd-a:2379"]},
            "peers": [],
            "sync": sync,
        }))
        .expect("a spec")
    }

    #[test]
    fn the_crds_defaults_are_the_workers_and_the_linger_is_honoured() {
        let budget = || Shares {
            verify: Arc::new(mirror::VerifyBudget::new(1_000)),
            peers: Default::default(),
            syncs: Default::default(),
            reads: Default::default(),
            supervision: Default::default(),
            memory: Default::default(),
        };
        let defaults = mirror_config(&spec(serde_json::json!({})), "b", "w", budget());
        let worker = MirrorConfig::new("a", "b", "w");
        assert_eq!(defaults.watch_linger, worker.watch_linger);
        assert_eq!(
            (defaults.max_txn_ops, defaults.max_txn_bytes, defaults.max_request_bytes, defaults.page_size),
            (worker.max_txn_ops, worker.max_txn_bytes, worker.max_request_bytes, worker.page_size)
        );
        let large_mesh = mirror_config(&spec(serde_json::json!({"watchLingerMilliseconds": 50})), "b", "w", budget());
        assert_eq!(large_mesh.watch_linger, Duration::from_millis(50));
    }

    #[test]
    fn only_a_readable_hash_of_a_worker_past_its_claim_counts_as_a_recorded_configuration() {
        let peer = |region: &str, phase: &str, configuration: &str| {
            serde_json::json!({"region": region, "phase": phase, "reachable": true, "keepalive": {"consecutiveFailures": 0, "leases": 1},
                               "replication": {"lastAppliedRevision": 1, "keys": 1, "resyncs": 0, "synced": true, "driftRepairedKeys": 0},
                               "configuration": configuration})
        };
        let object = |peers: Vec<serde_json::Value>, conditions: serde_json::Value| -> RegionPeering {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "federation.aether.dev/v1alpha1", "kind": "RegionPeering",
                "metadata": {"name": "a", "namespace": "fed"},
                "spec": {"region": "a", "localEtcd": {"endpoints": ["https://etcd-a:2379"]}, "peers": []},
                "status": {"conditions": conditions, "peers": peers},
            }))
            .expect("a RegionPeering")
        };
        let peers = vec![
            peer("b", "Watching", "00000000000000ff"),
            peer("c", "Refused", "0000000000000001"),
            peer("d", "Syncing", "not a hash; a hostile or corrupt status"),
            peer("e", "Queued", &"f".repeat(64)),
        ];
        let recorded = recorded_configurations(&object(peers.clone(), serde_json::json!([])));
        assert_eq!(recorded, [("b".to_string(), 255)].into(), "only b ran on a hash that reads");
        // In conflict, nothing ran as the status says.
        let conflict = serde_json::json!([{"type": "Conflict", "status": "True", "reason": "DuplicatePeer", "message": "m",
                                          "lastTransitionTime": "2026-01-01T00:00:00Z"}]);
        assert!(recorded_configurations(&object(peers, conflict)).is_empty());
    }
}
