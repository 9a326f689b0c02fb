//! `helm uninstall` as the chart ships it: before Helm deletes anything, the chart's pre-delete
//! hook (a Job running kubectl) deletes the RegionPeering and waits until the still-running operator
//! has run its finalizer; only then does Helm delete the operator. Afterwards nothing of the release
//! is left, nothing in the namespace is stuck Terminating, and the CRDs stay (Helm never deletes
//! `crds/`). On kind only: the local federation has no Helm release.
use crate::NAMESPACE;
use crate::substrate::{KIND_RELEASE, KindFederation, Substrate};
use aether_operator::api::RegionPeering;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Event;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, ListParams};
use kube::discovery::{Discovery, Scope, verbs};
use serde::Deserialize;
use std::time::{Duration, Instant};

/// What an uninstall took.
#[derive(Debug)]
pub struct Uninstall {
    /// `helm uninstall --wait`, from its start to its return.
    pub helm: Duration,
    /// From the start to the hook Job seen succeeded; None when `hook-succeeded` deleted it before
    /// a poll saw it (its Completed event is then checked).
    pub hook: Option<Duration>,
    /// From the start to the RegionPeering gone (its finalizer run).
    pub peering_gone: Duration,
    /// From helm's return to nothing of the release left and nothing Terminating.
    pub clean: Duration,
}

/// The name of the release's pre-delete hook Job (`helm get hooks`).
async fn hook_job(kind: &KindFederation, region: &str) -> anyhow::Result<String> {
    let out = kind.tool("helm", region)?.args(["get", "hooks", KIND_RELEASE]).output().await?;
    anyhow::ensure!(out.status.success(), "helm get hooks: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout)?;
    for document in serde_yaml::Deserializer::from_str(&text) {
        let object = serde_yaml::Value::deserialize(document)?;
        if object["kind"] == "Job"
            && let Some(name) = object["metadata"]["name"].as_str()
        {
            return Ok(name.to_string());
        }
    }
    anyhow::bail!("helm get hooks {KIND_RELEASE} in {region}: no Job (regionPeering.uninstallHook.enabled renders one)")
}

/// What of the release is still in `region`, and what in the namespace is Terminating: one line
/// each, none when all is gone.
async fn leftovers(kube: &kube::Client, discovery: &Discovery) -> anyhow::Result<Vec<String>> {
    let mut left = Vec::new();
    let release = ListParams::default().labels(&format!("app.kubernetes.io/instance={KIND_RELEASE}"));
    for group in discovery.groups() {
        for (resource, caps) in group.recommended_resources() {
            if !caps.supports_operation(verbs::LIST) || resource.plural == "events" {
                continue;
            }
            let namespaced = caps.scope == Scope::Namespaced;
            let api: Api<DynamicObject> = if namespaced {
                Api::namespaced_with(kube.clone(), NAMESPACE, &resource)
            } else {
                Api::all_with(kube.clone(), &resource)
            };
            // The release's objects by its label; RegionPeerings in every namespace.
            let Ok(labelled) = api.list(&release).await else { continue };
            left.extend(
                labelled
                    .items
                    .iter()
                    .map(|o| format!("left: {}/{}", resource.kind, o.metadata.name.clone().unwrap_or_default())),
            );
            if resource.kind == "RegionPeering" {
                let all: Api<DynamicObject> = Api::all_with(kube.clone(), &resource);
                for o in all.list(&ListParams::default()).await?.items {
                    left.push(format!(
                        "left: RegionPeering {}/{}",
                        o.metadata.namespace.unwrap_or_default(),
                        o.metadata.name.unwrap_or_default()
                    ));
                }
            }
            if namespaced {
                let Ok(every) = api.list(&ListParams::default()).await else { continue };
                for o in every.items.iter().filter(|o| o.metadata.deletion_timestamp.is_some()) {
                    left.push(format!(
                        "terminating: {}/{} since {:?}, finalizers {:?}",
                        resource.kind,
                        o.metadata.name.clone().unwrap_or_default(),
                        o.metadata.deletion_timestamp,
                        o.metadata.finalizers
                    ));
                }
            }
        }
    }
    left.sort();
    left.dedup();
    Ok(left)
}

/// `helm uninstall --wait` of `region`'s release, checked as the module says.
pub async fn helm_uninstall(kind: &KindFederation, region: &str, timeout: Duration) -> anyhow::Result<Uninstall> {
    let kube = kind.kube(region).await?;
    let jobs: Api<Job> = Api::namespaced(kube.clone(), NAMESPACE);
    let peerings: Api<RegionPeering> = Api::namespaced(kube.clone(), NAMESPACE);
    let job = hook_job(kind, region).await?;
    anyhow::ensure!(peerings.get_opt(region).await?.is_some(), "regionpeering/{region} is gone before the uninstall");

    let start = Instant::now();
    let mut helm = kind
        .tool("helm", region)?
        .args(["uninstall", KIND_RELEASE, "--wait", "--timeout", &format!("{}s", timeout.as_secs())])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let (mut hook, mut peering_gone) = (None, None);
    let status = loop {
        if hook.is_none() && jobs.get_opt(&job).await?.and_then(|j| j.status).and_then(|s| s.succeeded) == Some(1) {
            hook = Some(start.elapsed());
            println!(
                "uninstall {region}: hook Job {job} succeeded {:.1} s after helm uninstall began",
                start.elapsed().as_secs_f64()
            );
        }
        if peering_gone.is_none() && peerings.get_opt(region).await?.is_none() {
            peering_gone = Some(start.elapsed());
            println!(
                "uninstall {region}: regionpeering/{region} gone {:.1} s after helm uninstall began",
                start.elapsed().as_secs_f64()
            );
        }
        if let Some(status) = helm.try_wait()? {
            break status;
        }
        anyhow::ensure!(
            start.elapsed() < timeout + Duration::from_secs(30),
            "helm uninstall in {region} did not return within {} s (hook Job {job} succeeded: {})",
            timeout.as_secs() + 30,
            hook.is_some()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let helm_took = start.elapsed();
    let out = helm.wait_with_output().await?;
    anyhow::ensure!(
        status.success(),
        "helm uninstall {KIND_RELEASE} in {region}: {status}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let peering_gone = match peering_gone {
        Some(t) => t,
        None if peerings.get_opt(region).await?.is_none() => helm_took,
        None => anyhow::bail!("regionpeering/{region} still there after helm uninstall returned"),
    };
    if hook.is_none() {
        // hook-succeeded deletes the Job at once; its Completed event stays.
        let events: Api<Event> = Api::namespaced(kube.clone(), NAMESPACE);
        let selector = format!("involvedObject.kind=Job,involvedObject.name={job},reason=Completed");
        let completed = events.list(&ListParams::default().fields(&selector)).await?.items.len();
        anyhow::ensure!(completed > 0, "the hook Job {job} was never seen succeeding and has no Completed event");
        println!("uninstall {region}: hook Job {job}: gone (hook-succeeded), with a Completed event");
    }

    // Nothing left, nothing Terminating.
    let returned = Instant::now();
    let discovery = Discovery::new(kube.clone()).run().await?;
    let mut left = leftovers(&kube, &discovery).await?;
    while !left.is_empty() {
        anyhow::ensure!(
            returned.elapsed() < Duration::from_secs(120),
            "120 s after helm uninstall in {region} returned, still there:\n  {}",
            left.join("\n  ")
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        left = leftovers(&kube, &discovery).await?;
    }
    let clean = returned.elapsed();
    let listed = kind.tool("helm", region)?.args(["list", "-a", "-q"]).output().await?;
    anyhow::ensure!(listed.status.success(), "helm list: {}", String::from_utf8_lossy(&listed.stderr));
    anyhow::ensure!(
        !String::from_utf8_lossy(&listed.stdout).lines().any(|l| l.trim() == KIND_RELEASE),
        "helm list -a in {region} still lists {KIND_RELEASE}"
    );
    // The CRDs stay, Established and not being deleted.
    let crds: Api<CustomResourceDefinition> = Api::all(kube);
    for name in ["regionpeerings.federation.aether.dev", "registryschemas.federation.aether.dev"] {
        let crd = crds.get_opt(name).await?.ok_or_else(|| {
            anyhow::anyhow!("CRD {name} gone from {region} after helm uninstall: the chart keeps its CRDs (crds/)")
        })?;
        let established = crd
            .status
            .and_then(|s| s.conditions)
            .into_iter()
            .flatten()
            .any(|c| c.type_ == "Established" && c.status == "True");
        anyhow::ensure!(
            established && crd.metadata.deletion_timestamp.is_none(),
            "CRD {name} in {region} after helm uninstall: Established {established}, deleting since {:?}",
            crd.metadata.deletion_timestamp
        );
    }
    Ok(Uninstall { helm: helm_took, hook, peering_gone, clean })
}
