//! GitOps as users run it: real Argo CD (built here, hack/argocd/) in each region's kind cluster
//! syncs the chart and that region's RegionPeering from a git repository served in the cluster.
//! Each scenario asserts through Argo CD's own view (the Application's status its controller
//! writes: sync status and revision, health, each resource's health and message) and through the
//! etcds.
//!
//! hack/kind/e2e.sh provisions it (the clusters, an Argo CD and a git server in each, each
//! region's base values) and runs this test, ignored otherwise. The first region is the one the
//! scenarios change; the others' Argo CDs sync their regions beside it, and their Applications
//! must stay Synced all along. The scenarios, in order (each needs the first): first_sync (every
//! region, into clusters without the project's CRDs), no_drift (every region), change_committed,
//! peer_added (a peer removed by a commit and added back by the next), peer_fault (the stopped peer's own
//! Application back Healthy too), self_heal, upgrade_reverted, delete_application (every region).
//! Its environment:
//!   AETHER_GITOPS_REGIONS                 the regions with an Argo CD (a,b,...), the changed one first
//!   AETHER_GITOPS_DIR                     per region R: R/repo (the URL this host pushes to) and
//!                                         R/values.yaml (its values as the repository starts with them)
//!   GITOPS_REPO_IN_CLUSTER                where each Argo CD reads its repository
//!   AETHER_GITOPS_DRIFT_SECONDS           how long every Application must stay Synced after the
//!                                         first sync (default 300); a drift watch asserts the same
//!                                         from every later sync to the next change, for the whole run
//!   AETHER_GITOPS_UPGRADE_TAG             an operator image tag loaded in the first region's cluster,
//!                                         to upgrade to
//!   AETHER_E2E_SCENARIOS                  the scenarios to run, by name (all by default)
use aether_e2e::NAMESPACE;
use aether_e2e::load::{Writer, first_key_missing};
use aether_e2e::substrate::{KindFederation, Substrate, peering, subtree, wait_copy_whole};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::Value;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const APP: &str = "aether-federation";
const VALUES_FILE: &str = "values-region.yaml";

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: hack/kind/e2e.sh runs this test"))
}

/// What Argo CD shows of the Application.
#[derive(Clone, Debug, Default, PartialEq)]
struct View {
    sync: String,
    revision: String,
    health: String,
    phase: String,
    /// Each resource not Synced or not Healthy: "Kind/name sync health: message".
    unwell: Vec<String>,
    /// The Application's conditions (why it cannot compare or sync): "type: message".
    conditions: Vec<String>,
}

impl View {
    fn of(app: &DynamicObject) -> View {
        let status = &app.data["status"];
        let text = |v: &Value| v.as_str().unwrap_or("").to_string();
        let unwell = status["resources"]
            .as_array()
            .map(|resources| {
                resources
                    .iter()
                    .filter(|r| {
                        r["status"] != "Synced" || (!r["health"].is_null() && r["health"]["status"] != "Healthy")
                    })
                    .map(|r| {
                        format!(
                            "{}/{} {} {}: {}",
                            text(&r["kind"]),
                            text(&r["name"]),
                            text(&r["status"]),
                            text(&r["health"]["status"]),
                            text(&r["health"]["message"])
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let conditions = status["conditions"]
            .as_array()
            .map(|all| all.iter().map(|c| format!("{}: {}", text(&c["type"]), text(&c["message"]))).collect())
            .unwrap_or_default();
        View {
            conditions,
            sync: text(&status["sync"]["status"]),
            revision: text(&status["sync"]["revision"]),
            health: text(&status["health"]["status"]),
            phase: text(&status["operationState"]["phase"]),
            unwell,
        }
    }

    fn line(&self) -> String {
        let revision: String = self.revision.chars().take(8).collect();
        let mut line = format!("{}/{} at {revision}, operation {}", self.sync, self.health, self.phase);
        for r in self.conditions.iter().chain(&self.unwell) {
            line.push_str(&format!("\n      {r}"));
        }
        line
    }

    fn settled_at(&self, revision: &str) -> bool {
        self.sync == "Synced" && self.health == "Healthy" && self.revision == revision && self.phase == "Succeeded"
    }
}

/// What a wait saw.
struct Waited {
    view: View,
    seconds: f64,
    /// The first view on the way that was Degraded, with when.
    degraded: Option<String>,
}

impl Waited {
    /// Fails when Argo CD showed Degraded on the way: a deploy, a rollout, a change is progress.
    fn never_degraded(self, what: &str) -> anyhow::Result<f64> {
        match self.degraded {
            Some(view) => anyhow::bail!("{what}: Argo CD showed Degraded on the way: {view}"),
            None => Ok(self.seconds),
        }
    }
}

/// Watches Argo CD's view of the Application for the whole run. Between a sync the scenarios saw
/// settle and the next change they make (a commit, a hand edit, the deletion) the Application is
/// *quiet*: any view there that is not Synced is drift, and fails the run.
#[derive(Clone, Default)]
struct DriftWatch(std::sync::Arc<std::sync::Mutex<Drift>>);

#[derive(Default)]
struct Drift {
    /// Since when the Application is quiet; None while a change is under way.
    quiet_since: Option<Instant>,
    /// The longest quiet spell, and all of them together.
    longest: Duration,
    total: Duration,
    /// Distinct comparisons (`status.reconciledAt`) seen while quiet.
    compared: u64,
    last_reconciled: String,
    /// The first drift seen.
    drift: Option<String>,
}

impl DriftWatch {
    /// Polls the Application once a second until the run ends.
    fn start(&self, apps: Api<DynamicObject>) -> tokio::task::JoinHandle<()> {
        let watch = self.clone();
        tokio::spawn(async move {
            loop {
                let asked = Instant::now();
                // An API server that does not answer for a moment is no verdict.
                if let Ok(Some(app)) = apps.get_opt(APP).await {
                    watch.saw(asked, &View::of(&app), app.data["status"]["reconciledAt"].as_str().unwrap_or(""));
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    }

    /// A view asked for at `asked`: drift if the Application was quiet since before then.
    fn saw(&self, asked: Instant, view: &View, reconciled_at: &str) {
        let mut d = self.0.lock().unwrap();
        let Some(since) = d.quiet_since.filter(|since| *since <= asked) else { return };
        if reconciled_at != d.last_reconciled {
            d.compared += 1;
            d.last_reconciled = reconciled_at.to_string();
        }
        if view.sync != "Synced" && d.drift.is_none() {
            d.drift = Some(format!(
                "{:.0} s after a settled sync Argo CD shows a diff: {}",
                since.elapsed().as_secs_f64(),
                view.line()
            ));
        }
    }

    /// The scenario saw the Application settle: quiet from now on.
    fn settled(&self) {
        let mut d = self.0.lock().unwrap();
        d.quiet_since.get_or_insert_with(Instant::now);
    }

    /// The scenario is about to change the Application: not quiet until it settles again.
    fn changing(&self) {
        let mut d = self.0.lock().unwrap();
        if let Some(since) = d.quiet_since.take() {
            let spell = since.elapsed();
            d.longest = d.longest.max(spell);
            d.total += spell;
        }
    }

    fn quiet_for(&self) -> Option<Duration> {
        self.0.lock().unwrap().quiet_since.map(|since| since.elapsed())
    }

    fn compared(&self) -> u64 {
        self.0.lock().unwrap().compared
    }

    fn verdict(&self) -> anyhow::Result<()> {
        match &self.0.lock().unwrap().drift {
            Some(drift) => anyhow::bail!("drift: {drift}"),
            None => Ok(()),
        }
    }

    /// "quiet N s in all, the longest M s, K comparisons".
    fn summary(&self) -> String {
        let d = self.0.lock().unwrap();
        let current = d.quiet_since.map(|since| since.elapsed()).unwrap_or_default();
        format!(
            "quiet {:.0} s in all, the longest spell {:.0} s, {} comparisons by Argo CD meanwhile, no diff",
            (d.total + current).as_secs_f64(),
            d.longest.max(current).as_secs_f64(),
            d.compared
        )
    }
}

/// One region's Argo CD: its Application, the repository it syncs from, the values in it.
struct Gitops {
    kind: KindFederation,
    region: String,
    peers: Vec<String>,
    apps: Api<DynamicObject>,
    work: tempfile::TempDir,
    push_to: String,
    values: serde_yaml::Value,
    drift: DriftWatch,
}

impl Gitops {
    /// The region's Argo CD, as hack/kind/e2e.sh wrote it in AETHER_GITOPS_DIR; its peers are the
    /// other `regions`.
    async fn new(region: &str, regions: &[String]) -> Gitops {
        let kind = KindFederation::from_env().unwrap();
        let peers = regions.iter().filter(|r| *r != region).cloned().collect();
        let resource = ApiResource {
            group: "argoproj.io".into(),
            version: "v1alpha1".into(),
            api_version: "argoproj.io/v1alpha1".into(),
            kind: "Application".into(),
            plural: "applications".into(),
        };
        let apps = Api::namespaced_with(kind.kube(region).await.unwrap(), "argocd", &resource);
        let dir = Path::new(&env("AETHER_GITOPS_DIR")).join(region);
        let read = |name: &str| {
            std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("{}: {e}", dir.join(name).display()))
        };
        let values = serde_yaml::from_str(&read("values.yaml")).unwrap();
        let push_to = read("repo").trim().to_string();
        let work = tempfile::Builder::new().prefix("aether-gitops-").tempdir().unwrap();
        Gitops { kind, region: region.into(), peers, apps, work, push_to, values, drift: DriftWatch::default() }
    }

    fn git(&self, args: &[&str]) -> String {
        let out = Command::new("git")
            .arg("-C")
            .arg(self.work.path())
            .args(["-c", "user.name=aether e2e", "-c", "user.email=e2e@aether.invalid"])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Commits the values as they are now (and the chart, the first time) and pushes; the commit.
    fn commit(&self, message: &str) -> String {
        self.drift.changing();
        let chart = self.work.path().join("charts/aether-federation");
        if !chart.exists() {
            self.git(&["init", "-q", "-b", "main"]);
            copy_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/aether-federation"), &chart);
        }
        std::fs::write(chart.join(VALUES_FILE), serde_yaml::to_string(&self.values).unwrap()).unwrap();
        self.git(&["add", "-A"]);
        self.git(&["commit", "-q", "-m", message]);
        self.git(&["push", "-q", "--force", &self.push_to, "main"]);
        self.git(&["rev-parse", "HEAD"])
    }

    fn set(&mut self, path: &[&str], value: serde_yaml::Value) {
        let mut at = &mut self.values;
        for key in &path[..path.len() - 1] {
            at = &mut at[*key];
        }
        at[path[path.len() - 1]] = value;
    }

    async fn view(&self) -> anyhow::Result<Option<View>> {
        Ok(self.apps.get_opt(APP).await?.map(|app| View::of(&app)))
    }

    /// Polls Argo CD's view until `done`, printing each view it passes through with the time;
    /// the last view, the seconds it took, and the first Degraded view on the way.
    async fn wait(&self, what: &str, deadline: Duration, done: impl Fn(&View) -> bool) -> anyhow::Result<Waited> {
        let start = Instant::now();
        let mut last = None;
        let mut degraded = None;
        loop {
            // An API server that does not answer for a moment is no verdict: asked again.
            let Ok(view) = self.view().await else {
                anyhow::ensure!(start.elapsed() < deadline, "{what}: the API server of {} did not answer", self.region);
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            };
            if degraded.is_none() && view.as_ref().is_some_and(|v| v.health == "Degraded") {
                degraded = view.as_ref().map(|v| format!("+{:.1} s: {}", start.elapsed().as_secs_f64(), v.line()));
            }
            if view != last {
                println!(
                    "gitops: {}: {what}: +{:.1} s: {}",
                    self.region,
                    start.elapsed().as_secs_f64(),
                    view.as_ref().map_or("no Application".into(), View::line)
                );
                last = view.clone();
            }
            if let Some(view) = view.filter(|v| done(v)) {
                return Ok(Waited { view, seconds: start.elapsed().as_secs_f64(), degraded });
            }
            anyhow::ensure!(
                start.elapsed() < deadline,
                "{what}: not within {} s; Argo CD in {} shows {}",
                deadline.as_secs(),
                self.region,
                last.as_ref().map_or("no Application".into(), View::line)
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The copy of the region on every peer is its subtree, key for key.
    async fn copies_whole(&self, deadline: Duration) -> anyhow::Result<()> {
        for peer in &self.peers {
            wait_copy_whole(&self.kind, &self.region, peer, deadline).await?;
        }
        Ok(())
    }

    /// What a person reads when a scenario fails: the Application's status and the RegionPeering's.
    async fn report(&self) {
        if let Ok(Some(app)) = self.apps.get_opt(APP).await {
            println!(
                "gitops: the Application's status:\n{}",
                serde_yaml::to_string(&app.data["status"]).unwrap_or_default()
            );
        }
        match peering(&self.kind, &self.region).await {
            Ok(rp) => {
                println!("gitops: regionpeering/{}:\n{}", self.region, serde_yaml::to_string(&rp).unwrap_or_default())
            }
            Err(e) => println!("gitops: regionpeering/{}: {e}", self.region),
        }
    }
}

/// Whether `message` names `region` as a word (a region name is a DNS label).
fn names(message: &str, region: &str) -> bool {
    message.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-')).any(|word| word == region)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Whether AETHER_E2E_SCENARIOS names the scenario (or names none); first_sync, which the others
/// stand on, always runs.
fn selected(name: &str) -> bool {
    if name == "first_sync" {
        return true;
    }
    match std::env::var("AETHER_E2E_SCENARIOS") {
        Ok(names) if !names.trim().is_empty() => names.split(',').any(|n| n.trim() == name),
        _ => true,
    }
}

/// The Application docs/operating.md gives, reading this repository's chart and the region's
/// values file from it.
fn application(repo: &str) -> DynamicObject {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Application",
        "metadata": {"name": APP, "namespace": "argocd", "finalizers": ["resources-finalizer.argocd.argoproj.io"]},
        "spec": {
            "project": "default",
            "source": {
                "repoURL": repo,
                "path": "charts/aether-federation",
                "targetRevision": "main",
                "helm": {"releaseName": "aether", "valueFiles": [VALUES_FILE]},
            },
            "destination": {"server": "https://kubernetes.default.svc", "namespace": NAMESPACE},
            "syncPolicy": {"automated": {"prune": true, "selfHeal": true}, "syncOptions": ["ServerSideApply=true"]},
        },
    }))
    .unwrap()
}

const SYNC: Duration = Duration::from_secs(300);
const COPY: Duration = Duration::from_secs(120);

/// Writes `n` endpoints of a cluster `gitops` into the region's subtree.
async fn write_endpoints(g: &Gitops, n: usize) -> anyhow::Result<()> {
    let mut client = g.kind.registry(&g.region).await?;
    for i in 0..n {
        let key = format!(
            "{}clusters/gitops/services/echo/protocols/http/endpoints/10.200.0.{}",
            aether_operator::keys::region_prefix(&g.region),
            i + 1
        );
        client.put(key, format!(r#"{{"clusterName":"gitops","i":{i}}}"#), None).await?;
    }
    Ok(())
}

/// Makes `g`'s cluster one the chart was never installed in: the project's CRDs deleted (the Helm
/// era before left them, as Helm does), so the Application creates them as on a new cluster. No
/// object of theirs may be left: deleting a CRD deletes its objects, and a RegionPeering's
/// finalizer would wait for an operator that is gone.
async fn without_crds(g: &Gitops) -> anyhow::Result<()> {
    use aether_operator::api::{RegionPeering, RegistrySchema};
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let client = g.kind.kube(&g.region).await?;
    let peerings = Api::<RegionPeering>::all(client.clone()).list(&Default::default()).await?.items.len();
    let schemas = Api::<RegistrySchema>::all(client.clone()).list(&Default::default()).await?.items.len();
    anyhow::ensure!(
        peerings + schemas == 0,
        "{}: {peerings} RegionPeerings and {schemas} RegistrySchemas left before the first sync",
        g.region
    );
    let crds: Api<CustomResourceDefinition> = Api::all(client);
    let names: Vec<String> = aether_operator::api::all_crds().into_iter().filter_map(|crd| crd.metadata.name).collect();
    for name in &names {
        if crds.get_opt(name).await?.is_some() {
            crds.delete(name, &DeleteParams::default()).await?;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    for name in &names {
        while crds.get_opt(name).await?.is_some() {
            anyhow::ensure!(Instant::now() < deadline, "{}: CRD {name} not gone within 60 s", g.region);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(())
}

/// Every region's Argo CD syncs its region from git at once, into a cluster without the project's
/// CRDs: each Application goes Synced/Healthy at its commit without showing Degraded on the way
/// (a CRD being established is progress: config/argocd/crd-health.lua), and every region's copy is
/// whole on every peer.
async fn first_sync(g: &mut Gitops, others: &mut [Gitops]) -> anyhow::Result<()> {
    let sites: Vec<&Gitops> = std::iter::once(&*g).chain(others.iter()).collect();
    let repo = env("GITOPS_REPO_IN_CLUSTER");
    futures::future::try_join_all(sites.iter().map(|site| without_crds(site))).await?;
    let mut revisions = Vec::new();
    for site in &sites {
        revisions.push(site.commit("the chart and the region's RegionPeering"));
        write_endpoints(site, 50).await?;
        site.apps.create(&PostParams::default(), &application(&repo)).await?;
    }
    let took = futures::future::try_join_all(sites.iter().zip(&revisions).map(|(site, revision)| async move {
        site.wait("first sync", SYNC, |v| v.settled_at(revision)).await?.never_degraded("the first sync")
    }))
    .await?;
    for site in &sites {
        site.drift.settled();
    }
    for (site, took) in sites.iter().zip(took) {
        site.copies_whole(COPY).await?;
        println!(
            "gitops: {}: first sync: Synced/Healthy {took:.1} s after the Application; the copy whole on {:?}",
            site.region, site.peers
        );
    }
    Ok(())
}

/// Every region's Application stays Synced for AETHER_GITOPS_DRIFT_SECONDS (five minutes) after
/// the first sync, while its Argo CD compares it again and again: nothing the operator or the API server writes
/// or defaults shows as a diff. (The drift watch asserts the same between every later sync and the
/// next change, for the whole run.)
async fn no_drift(g: &mut Gitops, others: &mut [Gitops]) -> anyhow::Result<()> {
    let seconds: u64 = std::env::var("AETHER_GITOPS_DRIFT_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(300);
    let window = Duration::from_secs(seconds);
    let sites: Vec<&Gitops> = std::iter::once(&*g).chain(others.iter()).collect();
    let compared_before: Vec<u64> = sites.iter().map(|site| site.drift.compared()).collect();
    loop {
        let mut quiet = window;
        for site in &sites {
            site.drift.verdict()?;
            let since =
                site.drift.quiet_for().ok_or_else(|| anyhow::anyhow!("{}: no settled sync to watch", site.region))?;
            quiet = quiet.min(since);
        }
        if quiet >= window {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    for (site, before) in sites.iter().zip(compared_before) {
        let compared = site.drift.compared() - before;
        // A window in which Argo CD never compared proves nothing.
        anyhow::ensure!(
            compared >= 2,
            "Argo CD in {} compared the Application {compared} times in {seconds} s",
            site.region
        );
        println!(
            "gitops: {}: no drift: Synced for {seconds} s after the sync, through {compared} comparisons by Argo CD",
            site.region
        );
    }
    Ok(())
}

/// A TTL change committed to git reaches the cluster; the copy never loses a key meanwhile.
async fn change_committed(g: &mut Gitops) -> anyhow::Result<()> {
    let peer = g.peers[0].clone();
    let before = subtree(&g.kind, &peer, &g.region).await?;
    g.set(&["regionPeering", "lease", "ttlSeconds"], 45.into());
    let revision = g.commit("lease TTL 30 -> 45 s");
    let reading = tokio::spawn(first_key_missing(g.kind.clone(), g.region.clone(), peer.clone(), before));
    let waited = g.wait("the TTL change", SYNC, |v| v.settled_at(&revision)).await;
    if reading.is_finished() {
        anyhow::bail!("{}", reading.await?);
    }
    reading.abort();
    let took = waited?.never_degraded("the TTL change")?;
    g.drift.settled();
    let rp = peering(&g.kind, &g.region).await?;
    anyhow::ensure!(rp.spec.lease.ttl_seconds == 45, "the RegionPeering's TTL is {}", rp.spec.lease.ttl_seconds);
    g.copies_whole(COPY).await?;
    println!(
        "gitops: the TTL change: Synced/Healthy at its commit {took:.1} s after the push; no key missing on {peer}"
    );
    Ok(())
}

/// A peer taken out of the region's values by one commit and added back by the next: each commit
/// reaches the cluster and comes back Synced/Healthy at its revision without showing Degraded, the
/// RegionPeering names the peers the commit named, the peer that stayed loses no key all along, and
/// the added one ends with the copy whole. Needs two peers (the one added is the second).
async fn peer_added(g: &mut Gitops) -> anyhow::Result<()> {
    let Some(added) = g.peers.get(1).cloned() else {
        println!("gitops: a peer added: SKIPPED ({} has one peer; the scenario needs two)", g.region);
        return Ok(());
    };
    let kept = g.peers[0].clone();
    let before = subtree(&g.kind, &kept, &g.region).await?;
    let reading = tokio::spawn(first_key_missing(g.kind.clone(), g.region.clone(), kept.clone(), before));
    let all = g.values["regionPeering"].clone();
    let names_added = |e: &serde_yaml::Value| e.as_str().is_some_and(|s| s.starts_with(&format!("{added}=")));
    let etcds: Vec<serde_yaml::Value> =
        all["peerEtcd"].as_sequence().into_iter().flatten().filter(|e| !names_added(e)).cloned().collect();
    anyhow::ensure!(
        all["peerEtcd"].as_sequence().map_or(0, Vec::len) == etcds.len() + 1,
        "the values name {added} once in regionPeering.peerEtcd: {:?}",
        all["peerEtcd"]
    );
    let mut secrets = all["peerTlsSecrets"].clone();
    if let Some(secrets) = secrets.as_mapping_mut() {
        secrets.remove(added.as_str());
    }
    g.set(&["regionPeering", "peerEtcd"], serde_yaml::Value::Sequence(etcds));
    g.set(&["regionPeering", "peerTlsSecrets"], secrets);
    let mut took = Vec::new();
    for (what, peers) in
        [(format!("peer {added} removed"), vec![kept.clone()]), (format!("peer {added} added"), g.peers.clone())]
    {
        if peers.len() == g.peers.len() {
            g.set(&["regionPeering", "peerEtcd"], all["peerEtcd"].clone());
            g.set(&["regionPeering", "peerTlsSecrets"], all["peerTlsSecrets"].clone());
        }
        let revision = g.commit(&what);
        let waited = g.wait(&what, SYNC, |v| v.settled_at(&revision)).await;
        if reading.is_finished() {
            anyhow::bail!("{what}: {}", reading.await?);
        }
        took.push(waited?.never_degraded(&what)?);
        g.drift.settled();
        let mut named: Vec<String> =
            peering(&g.kind, &g.region).await?.spec.peers.into_iter().map(|p| p.region).collect();
        named.sort();
        let mut expected = peers;
        expected.sort();
        anyhow::ensure!(
            named == expected,
            "{what}: the RegionPeering's peers are {named:?}, the commit's {expected:?}"
        );
    }
    g.copies_whole(COPY).await?;
    if reading.is_finished() {
        anyhow::bail!("{}", reading.await?);
    }
    reading.abort();
    println!(
        "gitops: a peer added: {added} removed, Synced/Healthy {:.1} s after the push; added back, Synced/Healthy {:.1} s after the push, the copy whole on it; no key missing on {kept}",
        took[0], took[1]
    );
    Ok(())
}

/// A peer's etcd stopped shows as Degraded in Argo CD, the peer named; Healthy again once it is back.
/// The peer's own Argo CD shows its region Healthy again too, with its copies whole.
async fn peer_fault(g: &mut Gitops, others: &mut [Gitops]) -> anyhow::Result<()> {
    let peer = g.peers[0].clone();
    let etcds: Api<k8s_openapi::api::apps::v1::StatefulSet> = Api::namespaced(g.kind.kube(&peer).await?, NAMESPACE);
    let scale = |replicas: i32| serde_json::json!({"spec": {"replicas": replicas}});
    etcds.patch("registry-etcd", &PatchParams::default(), &Patch::Merge(scale(0))).await?;
    let named = |v: &View| {
        v.health == "Degraded"
            && v.unwell.iter().any(|r| r.starts_with("RegionPeering/") && r.contains("Degraded") && names(r, &peer))
    };
    let degraded = g.wait(&format!("{peer}'s etcd stopped"), SYNC, named).await;
    etcds.patch("registry-etcd", &PatchParams::default(), &Patch::Merge(scale(1))).await?;
    let degraded = degraded?;
    println!("gitops: {peer}'s etcd stopped: Degraded after {:.1} s: {}", degraded.seconds, degraded.view.line());
    let back = g.wait(&format!("{peer}'s etcd back"), SYNC, |v| v.sync == "Synced" && v.health == "Healthy").await?;
    let took = back.seconds;
    g.copies_whole(COPY).await?;
    println!("gitops: {peer}'s etcd back: Healthy after {took:.1} s; the copy whole");
    if let Some(site) = others.iter().find(|site| site.region == peer) {
        let back = site.wait("its etcd back", SYNC, |v| v.sync == "Synced" && v.health == "Healthy").await?;
        site.copies_whole(COPY).await?;
        println!(
            "gitops: {peer}: its own Application Healthy {:.1} s later; its copy whole on {:?}",
            back.seconds, site.peers
        );
    }
    Ok(())
}

/// A hand edit of the RegionPeering is undone by Argo CD (self-heal): git decides.
async fn self_heal(g: &mut Gitops) -> anyhow::Result<()> {
    let api: Api<aether_operator::api::RegionPeering> = Api::namespaced(g.kind.kube(&g.region).await?, NAMESPACE);
    let edit = serde_json::json!({"spec": {"lease": {"keepaliveIntervalSeconds": 7}}});
    g.drift.changing();
    api.patch(&g.region, &PatchParams::default(), &Patch::Merge(edit)).await?;
    let start = Instant::now();
    loop {
        let rp = api.get(&g.region).await?;
        if rp.spec.lease.keepalive_interval_seconds == 10 {
            break;
        }
        anyhow::ensure!(start.elapsed() < SYNC, "the hand edit (keepalive 7 s) still there after {} s", SYNC.as_secs());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let took = start.elapsed().as_secs_f64();
    g.wait("after the self-heal", SYNC, |v| v.sync == "Synced" && v.health == "Healthy").await?;
    g.drift.settled();
    println!("gitops: self-heal: the hand edit undone {took:.1} s after it");
    Ok(())
}

/// Every operator pod runs `image` and none is going away.
async fn operator_on(g: &Gitops, image: &str) -> anyhow::Result<bool> {
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(g.kind.kube(&g.region).await?, NAMESPACE);
    let selector = aether_e2e::substrate::KIND_OPERATOR_PODS;
    let pods = pods.list(&kube::api::ListParams::default().labels(selector)).await?.items;
    Ok(!pods.is_empty()
        && pods.iter().all(|pod| {
            let ready = pod
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            let images = pod.spec.as_ref().map(|s| s.containers.iter().all(|c| c.image.as_deref() == Some(image)));
            pod.metadata.deletion_timestamp.is_none() && ready && images == Some(true)
        }))
}

/// An upgrade committed to git (the image tag), then `git revert`ed, rolls the operator forth and
/// back under 100 writes a second: no key the peer held is ever missing, no put fails, and the
/// copy is whole once the writes stop.
async fn upgrade_reverted(g: &mut Gitops) -> anyhow::Result<()> {
    let Some(new_tag) = std::env::var("AETHER_GITOPS_UPGRADE_TAG").ok().filter(|t| !t.is_empty()) else {
        println!(
            "gitops: upgrade_reverted SKIPPED: no upgraded image in the cluster (the kind e2e's upgrade step loads it)"
        );
        return Ok(());
    };
    let repository = g.values["image"]["repository"].as_str().unwrap_or_default().to_string();
    let old_image = format!("{repository}:{}", g.values["image"]["tag"].as_str().unwrap_or_default());
    let new_image = format!("{repository}:{new_tag}");
    let peer = g.peers[0].clone();
    let before = subtree(&g.kind, &peer, &g.region).await?;
    let writer = Writer::start(g.kind.clone(), &g.region, "gitops-load", 100, 1, 200);
    let reading = tokio::spawn(first_key_missing(g.kind.clone(), g.region.clone(), peer.clone(), before));
    let start = Instant::now();
    let rolled = async {
        g.set(&["image", "tag"], new_tag.clone().into());
        let revision = g.commit(&format!("operator {new_tag}"));
        let up = g.wait("the upgrade", SYNC, |v| v.settled_at(&revision)).await?.never_degraded("the upgrade")?;
        g.drift.settled();
        aether_harness::wait_until(&format!("every operator pod on {new_image}"), SYNC, || operator_on(g, &new_image))
            .await?;
        g.drift.changing();
        g.git(&["revert", "--no-edit", "HEAD"]);
        g.git(&["push", "-q", &g.push_to, "main"]);
        let revision = g.git(&["rev-parse", "HEAD"]);
        let back = g.wait("the revert", SYNC, |v| v.settled_at(&revision)).await?.never_degraded("the revert")?;
        g.drift.settled();
        aether_harness::wait_until(&format!("every operator pod on {old_image}"), SYNC, || operator_on(g, &old_image))
            .await?;
        anyhow::Ok((up, back))
    }
    .await;
    let tally = writer.stop();
    let (puts, failed) = (tally.puts, tally.failed);
    if reading.is_finished() {
        anyhow::bail!("{}", reading.await?);
    }
    reading.abort();
    let (up, back) = rolled?;
    g.values = serde_yaml::from_str(&std::fs::read_to_string(
        g.work.path().join("charts/aether-federation").join(VALUES_FILE),
    )?)?;
    anyhow::ensure!(failed == 0, "{failed} of {} puts into {} failed", puts + failed, g.region);
    g.copies_whole(COPY).await?;
    println!(
        "gitops: upgrade to {new_image} Synced/Healthy in {up:.1} s, the revert in {back:.1} s; {puts} puts in {:.0} s, none failed; no key missing on {peer}",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Deleting the Application applies the RegionPeering's deletion policy (Delete: the copy goes from
/// every peer at once) while the operator still runs, and leaves nothing Terminating: the first
/// region's, then the other regions' together.
async fn delete_application(g: &mut Gitops, others: &mut [Gitops]) -> anyhow::Result<()> {
    delete_one(g).await?;
    futures::future::try_join_all(others.iter().map(delete_one)).await?;
    Ok(())
}

async fn delete_one(g: &Gitops) -> anyhow::Result<()> {
    anyhow::ensure!(
        g.values["regionPeering"]["deletionPolicy"] == "Delete",
        "the scenario needs deletionPolicy Delete"
    );
    g.drift.changing();
    let start = Instant::now();
    g.apps.delete(APP, &DeleteParams::default()).await?;
    loop {
        if g.apps.get_opt(APP).await?.is_none() {
            break;
        }
        if start.elapsed() > SYNC {
            let peerings: Api<aether_operator::api::RegionPeering> =
                Api::namespaced(g.kind.kube(&g.region).await?, NAMESPACE);
            let left: Vec<String> = peerings
                .list(&Default::default())
                .await?
                .items
                .iter()
                .map(|rp| {
                    format!(
                        "{} (deleting since {:?})",
                        rp.metadata.name.clone().unwrap_or_default(),
                        rp.metadata.deletion_timestamp
                    )
                })
                .collect();
            anyhow::bail!(
                "{}: the Application still there {} s after its deletion; RegionPeerings: {left:?}",
                g.region,
                SYNC.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let took = start.elapsed().as_secs_f64();
    let client = g.kind.kube(&g.region).await?;
    let peerings: Api<aether_operator::api::RegionPeering> = Api::namespaced(client.clone(), NAMESPACE);
    let left = peerings.list(&Default::default()).await?.items.len();
    anyhow::ensure!(left == 0, "{}: {left} RegionPeerings left after the Application went", g.region);
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> = Api::namespaced(client.clone(), NAMESPACE);
    anyhow::ensure!(
        deployments.get_opt("aether").await?.is_none(),
        "{}: the operator's Deployment is still there",
        g.region
    );
    // The CRDs the Application created stay (Argo CD never deletes a CRD on a cascade, as Helm
    // never deletes crds/): another namespace's RegionPeerings keep running.
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(client);
    for crd in aether_operator::api::all_crds() {
        let name = crd.metadata.name.unwrap_or_default();
        anyhow::ensure!(crds.get_opt(&name).await?.is_some(), "{}: CRD {name} went with the Application", g.region);
    }
    // The policy ran: the copies went at once, not a TTL later.
    for peer in &g.peers {
        let copy = subtree(&g.kind, peer, &g.region).await?;
        anyhow::ensure!(
            copy.is_empty(),
            "{} keys of {} still on {peer} after the Application went",
            copy.len(),
            g.region
        );
    }
    println!(
        "gitops: {}: delete: the Application gone {took:.1} s after its deletion; no RegionPeering left, the CRDs kept; the copies deleted from {:?}",
        g.region, g.peers
    );
    Ok(())
}

async fn main_scenarios() {
    let regions: Vec<String> = env("AETHER_GITOPS_REGIONS").split(',').map(String::from).collect();
    let mut sites = Vec::new();
    for region in &regions {
        sites.push(Gitops::new(region, &regions).await);
    }
    let watching: Vec<_> = sites.iter().map(|site| site.drift.start(site.apps.clone())).collect();
    let (g, others) = sites.split_first_mut().expect("AETHER_GITOPS_REGIONS names a region");
    macro_rules! scenario {
        ($name:ident $(, $arg:expr)?) => {
            if selected(stringify!($name)) {
                println!("gitops: --- {} ---", stringify!($name));
                let result = $name(g $(, $arg)?).await;
                let verdicts = std::iter::once(&*g).chain(others.iter()).try_for_each(|site| site.drift.verdict().map_err(|e| e.context(format!("Argo CD in {}", site.region))));
                if let Err(e) = result.and(verdicts) {
                    for site in std::iter::once(&*g).chain(others.iter()) {
                        site.report().await;
                    }
                    panic!("gitops: {} failed: {e:#}", stringify!($name));
                }
            }
        };
    }
    scenario!(first_sync, others);
    scenario!(no_drift, others);
    scenario!(change_committed);
    scenario!(peer_added);
    scenario!(peer_fault, others);
    scenario!(self_heal);
    scenario!(upgrade_reverted);
    scenario!(delete_application, others);
    for (site, watch) in std::iter::once(&*g).chain(others.iter()).zip(watching) {
        watch.abort();
        println!("gitops: {}: drift watch: {}", site.region, site.drift.summary());
    }
}

#[tokio::test]
#[ignore = "needs the kind clusters and Argo CD that hack/kind/e2e.sh provisions"]
async fn argo_cd_syncs_the_chart_and_the_region_from_git() {
    main_scenarios().await;
}

#[test]
fn argo_cds_view_lists_each_resource_not_synced_or_not_healthy() {
    let app: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "argoproj.io/v1alpha1", "kind": "Application", "metadata": {"name": APP},
        "status": {
            "sync": {"status": "Synced", "revision": "0123456789abcdef"},
            "health": {"status": "Degraded"},
            "operationState": {"phase": "Succeeded"},
            "resources": [
                {"kind": "ConfigMap", "name": "quiet", "status": "Synced"},
                {"kind": "Deployment", "name": "aether", "status": "Synced", "health": {"status": "Healthy"}},
                {"kind": "RegionPeering", "name": "a", "status": "Synced",
                 "health": {"status": "Degraded", "message": "no round trip to b within 20s"}},
                {"kind": "Service", "name": "metrics", "status": "OutOfSync"},
            ],
        },
    }))
    .unwrap();
    let view = View::of(&app);
    assert_eq!(
        view.unwell,
        ["RegionPeering/a Synced Degraded: no round trip to b within 20s", "Service/metrics OutOfSync : "]
    );
    assert!(!view.settled_at("0123456789abcdef"), "Degraded is not settled");
    assert!(view.line().starts_with("Synced/Degraded at 01234567, operation Succeeded"), "{}", view.line());
    assert!(names(&view.unwell[0], "b") && !names(&view.unwell[0], "ro") && !names("bookkeeping", "b"));
}

#[test]
fn the_drift_watch_fails_only_a_diff_seen_while_quiet() {
    let synced = View { sync: "Synced".into(), health: "Healthy".into(), ..View::default() };
    let diff = View { sync: "OutOfSync".into(), ..synced.clone() };
    let watch = DriftWatch::default();
    // Before the first sync settles, and while a change is under way, a diff is the change.
    watch.saw(Instant::now(), &diff, "t0");
    watch.settled();
    watch.saw(Instant::now(), &synced, "t1");
    watch.saw(Instant::now(), &synced, "t1");
    watch.saw(Instant::now(), &synced, "t2");
    assert_eq!(watch.compared(), 2, "two distinct comparisons while quiet");
    let asked = Instant::now();
    watch.changing();
    watch.saw(Instant::now(), &diff, "t3");
    assert!(watch.verdict().is_ok());
    // A view asked for during the change and answered after the next settle is not drift.
    watch.settled();
    watch.saw(asked, &diff, "t3");
    assert!(watch.verdict().is_ok() && watch.quiet_for().is_some());
    // A diff asked for while quiet is.
    watch.saw(Instant::now(), &diff, "t4");
    let verdict = watch.verdict().unwrap_err().to_string();
    assert!(verdict.contains("after a settled sync Argo CD shows a diff: OutOfSync/Healthy"), "{verdict}");
    assert!(watch.summary().starts_with("quiet "), "{}", watch.summary());
}
