//! Where a scenario runs: the local federation of processes (`make e2e`) or the kind clusters
//! (`make e2e-kind`). A scenario step written against [`Substrate`] runs on both, once.
use crate::{Federation, NAMESPACE};
use aether_operator::api::RegionPeering;
use aether_operator::keys;
use etcd_client::{Client, GetOptions};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// What a scenario needs of the regions it runs on.
pub trait Substrate {
    /// A client of `region`'s registry etcd with the rights to read and write every subtree.
    fn registry(&self, region: &str) -> impl Future<Output = anyhow::Result<Client>>;
    /// A client of `region`'s Kubernetes API.
    fn kube(&self, region: &str) -> impl Future<Output = anyhow::Result<kube::Client>>;
}

/// How a region's leader goes away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaderLoss {
    /// Stopped as a rolling update or a drain stops it (SIGTERM; on kind its Pod deleted): it
    /// releases the leader Lease and revokes nothing of the mirror's.
    Graceful,
    /// On kind its Pod force-deleted (`--force --grace-period=0`): a replacement starts while the
    /// old container may still run, given the kubelet's 2 s minimum after its SIGTERM. Locally, as
    /// there is no Pod object to remove at once, a SIGTERM as for `Graceful`.
    Forced,
    /// SIGKILL, as an OOM kill or a node's crash: nothing released, nothing revoked. On kind the
    /// kubelet restarts the container in its Pod under the same identity; locally nothing does.
    Crashed,
    /// Frozen (SIGSTOP), as a leader behind a lost node: it renews nothing and releases nothing,
    /// and the standby must wait its Lease out. On kind its Pod is then force-deleted, so nothing
    /// restarts it; locally it stays frozen until the federation is torn down.
    Lost,
}

impl std::fmt::Display for LeaderLoss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LeaderLoss::Graceful => "graceful handoff",
            LeaderLoss::Forced => "forced handoff",
            LeaderLoss::Crashed => "crash of the leader",
            LeaderLoss::Lost => "loss of the leader",
        })
    }
}

/// The faults a scenario causes in a region: its operators and its registry etcd lost, as when a
/// region goes away, and brought back; its leader lost while a standby runs.
pub trait Faults: Substrate {
    /// The name of the leader Lease the operators of a region elect their leader with (in
    /// [`NAMESPACE`]).
    fn leader_lease(&self) -> String {
        "aether-operator-leader".to_string()
    }
    /// Takes `leader` (an operator of `region`, by identity) away as `how` says, returning once
    /// the loss is done (the signal sent, the Pod deleted), not once anyone noticed it.
    fn lose_leader(&mut self, region: &str, leader: &str, how: LeaderLoss) -> impl Future<Output = anyhow::Result<()>>;
    /// Returns once `region` runs its operators as configured, a standby beside the leader (on
    /// kind, the Deployment's replicas all Ready; locally, a second operator started if the last
    /// loss left one).
    fn await_standby(&mut self, region: &str) -> impl Future<Output = anyhow::Result<()>>;
    /// Takes every operator of `region` away as a lost region loses them (nothing revoked, nothing
    /// released), returning once none runs.
    fn lose_operators(&mut self, region: &str) -> impl Future<Output = anyhow::Result<()>>;
    /// Stops `region`'s registry etcd, returning once it is gone.
    fn lose_registry(&mut self, region: &str) -> impl Future<Output = anyhow::Result<()>>;
    /// Starts `region`'s registry etcd again with its data, returning once it answers.
    fn restore_registry(&mut self, region: &str) -> impl Future<Output = anyhow::Result<()>>;
    /// Starts one operator of `region` again.
    fn restore_operator(&mut self, region: &str) -> impl Future<Output = anyhow::Result<()>>;
}

impl Faults for Federation {
    async fn lose_leader(&mut self, region: &str, leader: &str, how: LeaderLoss) -> anyhow::Result<()> {
        let known = self.operators.get(region).is_some_and(|ops| ops.iter().any(|o| o.name == leader));
        anyhow::ensure!(known, "{leader} is no operator of {region} here");
        match how {
            LeaderLoss::Graceful | LeaderLoss::Forced => self.stop_operator(leader),
            LeaderLoss::Crashed => self.kill_operator(leader),
            LeaderLoss::Lost => self.pause_operator(leader),
        }
        Ok(())
    }
    async fn await_standby(&mut self, region: &str) -> anyhow::Result<()> {
        let running = self.operators.get(region).map_or(0, |ops| ops.iter().filter(|o| o.process.is_running()).count());
        for _ in running..2 {
            self.start_operator(region)?;
        }
        Ok(())
    }
    async fn lose_operators(&mut self, region: &str) -> anyhow::Result<()> {
        let names: Vec<String> = self.operators.get(region).into_iter().flatten().map(|o| o.name.clone()).collect();
        for name in names {
            self.kill_operator(&name);
        }
        Ok(())
    }
    async fn lose_registry(&mut self, region: &str) -> anyhow::Result<()> {
        self.region_mut(region).registry.kill();
        Ok(())
    }
    async fn restore_registry(&mut self, region: &str) -> anyhow::Result<()> {
        self.region_mut(region).registry.restart().await
    }
    async fn restore_operator(&mut self, region: &str) -> anyhow::Result<()> {
        self.start_operator(region)
    }
}

impl Substrate for Federation {
    async fn registry(&self, region: &str) -> anyhow::Result<Client> {
        self.registry_client(region).await
    }
    async fn kube(&self, region: &str) -> anyhow::Result<kube::Client> {
        self.region(region).apiserver.client().await
    }
}

/// The kind clusters `hack/kind/federation.sh up` made: a context `kind-aether-<region>` in its
/// kubeconfig, and each region's registry etcd on its node's NodePort over mTLS, as root.
#[derive(Clone)]
pub struct KindFederation {
    dir: PathBuf,
    nodeport: u16,
}

impl KindFederation {
    /// The federation of `AETHER_KIND_FED_DIR` (federation.sh's default: /tmp/aether-kind-federation).
    pub fn from_env() -> anyhow::Result<Self> {
        let dir = PathBuf::from(
            std::env::var("AETHER_KIND_FED_DIR").unwrap_or_else(|_| "/tmp/aether-kind-federation".into()),
        );
        anyhow::ensure!(
            dir.join("kubeconfig").is_file(),
            "{}: no kubeconfig (hack/kind/federation.sh up)",
            dir.display()
        );
        let nodeport = match std::env::var("AETHER_KIND_ETCD_NODEPORT") {
            Ok(port) => port.parse()?,
            Err(_) => 32379,
        };
        Ok(KindFederation { dir, nodeport })
    }

    /// The kubeconfig with a context `kind-aether-<region>` per region.
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.join("kubeconfig")
    }

    /// A command of the shipped tool `tool` (helm, kubectl) against `region`'s cluster, in the
    /// operator's namespace.
    pub fn tool(&self, tool: &str, region: &str) -> anyhow::Result<tokio::process::Command> {
        let mut command = tokio::process::Command::new(aether_harness::tool_path(tool)?);
        let context = format!("kind-aether-{region}");
        let context_flag = if tool == "helm" { "--kube-context" } else { "--context" };
        command.arg("--kubeconfig").arg(self.kubeconfig()).args([context_flag, &context, "-n", NAMESPACE]);
        Ok(command)
    }

    fn region_file(&self, region: &str, name: &str) -> anyhow::Result<Vec<u8>> {
        let path = self.dir.join(format!("region-{region}")).join(name);
        std::fs::read(&path)
            .map_err(|e| anyhow::anyhow!("{}: {e} (hack/kind/federation.sh up {region})", path.display()))
    }
}

impl KindFederation {
    /// A client of `region`'s registry etcd as the user whose client certificate (PEM) and key
    /// are given (the etcd takes the user from the certificate's CN).
    pub async fn registry_as(&self, region: &str, cert: &[u8], key: &[u8]) -> anyhow::Result<Client> {
        let ip = String::from_utf8(self.region_file(region, "node-ip")?)?;
        let tls = etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(self.region_file(region, "ca.crt")?))
            .identity(etcd_client::Identity::from_pem(cert, key));
        let options = etcd_client::ConnectOptions::new()
            .with_tls(tls)
            .with_connect_timeout(Duration::from_secs(5))
            .with_timeout(Duration::from_secs(10));
        Ok(Client::connect([format!("https://{}:{}", ip.trim(), self.nodeport)], Some(options)).await?)
    }

    /// A new client certificate for `user`, signed by `region`'s CA as federation.sh signs its
    /// users' (P-256, clientAuth): (certificate, key), PEM.
    pub fn client_certificate(&self, region: &str, user: &str) -> anyhow::Result<(String, String)> {
        use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose};
        let ca_key = KeyPair::from_pem(&String::from_utf8(self.region_file(region, "ca.key")?)?)?;
        let issuer = Issuer::from_ca_cert_pem(&String::from_utf8(self.region_file(region, "ca.crt")?)?, ca_key)?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, user);
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

impl Substrate for KindFederation {
    async fn registry(&self, region: &str) -> anyhow::Result<Client> {
        self.registry_as(
            region,
            &self.region_file(region, "client-root.crt")?,
            &self.region_file(region, "client-root.key")?,
        )
        .await
    }
    async fn kube(&self, region: &str) -> anyhow::Result<kube::Client> {
        let kubeconfig = kube::config::Kubeconfig::read_from(self.dir.join("kubeconfig"))?;
        let options =
            kube::config::KubeConfigOptions { context: Some(format!("kind-aether-{region}")), ..Default::default() };
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &options).await?;
        Ok(kube::Client::try_from(config)?)
    }
}

/// The chart's release in every kind region (hack/kind/e2e.sh installs it as `aether`).
pub const KIND_RELEASE: &str = "aether";
/// The label selector of the release's operator Pods.
pub const KIND_OPERATOR_PODS: &str = "app.kubernetes.io/name=aether-operator,app.kubernetes.io/instance=aether";

impl KindFederation {
    /// `replicas` for the workload `name` of `region` (a Deployment or a StatefulSet), as `kubectl
    /// scale` sets it.
    async fn scale<K>(&self, region: &str, name: &str, replicas: i32) -> anyhow::Result<()>
    where
        K: kube::Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
            + Clone
            + k8s_openapi::serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        let api: Api<K> = Api::namespaced(self.kube(region).await?, NAMESPACE);
        let patch = serde_json::json!({"spec": {"replicas": replicas}});
        api.patch_scale(name, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch)).await?;
        Ok(())
    }
}

/// The node container of a kind region (one node per cluster).
fn kind_node(region: &str) -> String {
    format!("aether-{region}-control-plane")
}

/// `docker exec` in a kind region's node: what it printed, or why it failed.
fn in_node(region: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = std::process::Command::new("docker").arg("exec").arg(kind_node(region)).args(args).output()?;
    anyhow::ensure!(
        out.status.success(),
        "docker exec {} {}: {}",
        kind_node(region),
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Faults for KindFederation {
    async fn lose_leader(&mut self, region: &str, leader: &str, how: LeaderLoss) -> anyhow::Result<()> {
        let pods: Api<Pod> = Api::namespaced(self.kube(region).await?, NAMESPACE);
        let container = || async {
            let pod = pods.get(leader).await?;
            let id = pod
                .status
                .and_then(|s| s.container_statuses)
                .into_iter()
                .flatten()
                .find(|c| c.name == "operator")
                .and_then(|c| c.container_id)
                .ok_or_else(|| anyhow::anyhow!("no running operator container in the leader Pod {leader}"))?;
            anyhow::Ok(id.trim_start_matches("containerd://").to_string())
        };
        let forced = kube::api::DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
        match how {
            LeaderLoss::Graceful => {
                pods.delete(leader, &Default::default()).await?;
            }
            LeaderLoss::Forced => {
                pods.delete(leader, &forced).await?;
            }
            LeaderLoss::Crashed => {
                // SIGKILL straight to the container's process: no SIGTERM, so the leader Lease is not
                // released and the mirror's leases are not touched.
                let id = container().await?;
                in_node(region, &["ctr", "-n", "k8s.io", "task", "kill", "--signal", "SIGKILL", &id])?;
            }
            LeaderLoss::Lost => {
                // Every process of the container stopped (after a SIGKILL alone the kubelet restarts
                // it under the same identity within seconds), then its Pod force-deleted: the
                // kubelet's SIGTERM stays pending behind the stop, and nothing restarts a container
                // of a deleted Pod.
                let id = container().await?;
                let listed = in_node(region, &["ctr", "-n", "k8s.io", "task", "ps", &id])?;
                let pids: Vec<&str> = listed
                    .lines()
                    .skip(1)
                    .filter_map(|l| l.split_whitespace().next())
                    .filter(|p| p.chars().all(|c| c.is_ascii_digit()))
                    .collect();
                anyhow::ensure!(!pids.is_empty(), "ctr task ps {id} listed no process of {leader}'s operator");
                in_node(region, &["sh", "-c", &format!("kill -STOP {}", pids.join(" "))])?;
                pods.delete(leader, &forced).await?;
            }
        }
        Ok(())
    }
    async fn await_standby(&mut self, region: &str) -> anyhow::Result<()> {
        let deployments: Api<Deployment> = Api::namespaced(self.kube(region).await?, NAMESPACE);
        let deployments = &deployments;
        let what = format!("every replica of {region}'s operator Deployment Ready and current");
        aether_harness::wait_until(&what, Duration::from_secs(120), || async move {
            let deployment = deployments.get(KIND_RELEASE).await?;
            let want = deployment.spec.and_then(|s| s.replicas).unwrap_or(1);
            let status = deployment.status.unwrap_or_default();
            Ok(want >= 2
                && status.replicas == Some(want)
                && status.ready_replicas == Some(want)
                && status.updated_replicas == Some(want))
        })
        .await
    }
    /// The operator's Deployment scaled to 0 (SIGTERM: the operator revokes and releases nothing
    /// of the mirror's), until none of its Pods is left.
    async fn lose_operators(&mut self, region: &str) -> anyhow::Result<()> {
        self.scale::<Deployment>(region, KIND_RELEASE, 0).await?;
        let pods: Api<Pod> = Api::namespaced(self.kube(region).await?, NAMESPACE);
        let operators = ListParams::default().labels(KIND_OPERATOR_PODS);
        let (pods, operators) = (&pods, &operators);
        let what = format!("no operator Pod left in {region}");
        aether_harness::wait_until(&what, Duration::from_secs(60), || async move {
            Ok(pods.list(operators).await?.items.is_empty())
        })
        .await
    }
    /// The registry etcd's StatefulSet scaled to 0, until its Pod is gone (its data stays on the node).
    async fn lose_registry(&mut self, region: &str) -> anyhow::Result<()> {
        self.scale::<StatefulSet>(region, "registry-etcd", 0).await?;
        let pods: Api<Pod> = Api::namespaced(self.kube(region).await?, NAMESPACE);
        let pods = &pods;
        let what = format!("registry-etcd-0 gone from {region}");
        aether_harness::wait_until(&what, Duration::from_secs(120), || async move {
            Ok(pods.get_opt("registry-etcd-0").await?.is_none())
        })
        .await
    }
    async fn restore_registry(&mut self, region: &str) -> anyhow::Result<()> {
        self.scale::<StatefulSet>(region, "registry-etcd", 1).await?;
        let this = &*self;
        let what = format!("{region}'s registry etcd answering");
        aether_harness::wait_until(&what, Duration::from_secs(120), || async move {
            Ok(match this.registry(region).await {
                Ok(mut client) => client.status().await.is_ok(),
                Err(_) => false,
            })
        })
        .await
    }
    async fn restore_operator(&mut self, region: &str) -> anyhow::Result<()> {
        self.scale::<Deployment>(region, KIND_RELEASE, 1).await
    }
}

/// `origin`'s subtree as `region`'s registry etcd holds it: key to value.
pub async fn subtree(sub: &impl Substrate, region: &str, origin: &str) -> anyhow::Result<BTreeMap<Vec<u8>, Vec<u8>>> {
    subtree_through(&mut sub.registry(region).await?, origin).await
}

/// `origin`'s subtree as the etcd behind `client` holds it (a reader polling keeps its client).
pub async fn subtree_through(client: &mut Client, origin: &str) -> anyhow::Result<BTreeMap<Vec<u8>, Vec<u8>>> {
    let response = client.get(keys::region_prefix(origin), Some(GetOptions::new().with_prefix())).await?;
    Ok(response.kvs().iter().map(|kv| (kv.key().to_vec(), kv.value().to_vec())).collect())
}

/// Why `peer`'s copy of `origin` is not the origin's own subtree (missing, extra or different
/// keys, at most five of each named), or None when it is.
pub async fn copy_difference(sub: &impl Substrate, origin: &str, peer: &str) -> anyhow::Result<Option<String>> {
    let own = subtree(sub, origin, origin).await?;
    let copy = subtree(sub, peer, origin).await?;
    if own == copy {
        return Ok(None);
    }
    let name = |k: &Vec<u8>| String::from_utf8_lossy(k).into_owned();
    let missing: Vec<String> = own.keys().filter(|k| !copy.contains_key(*k)).take(5).map(name).collect();
    let extra: Vec<String> = copy.keys().filter(|k| !own.contains_key(*k)).take(5).map(name).collect();
    let changed: Vec<String> =
        own.iter().filter(|(k, v)| copy.get(*k).is_some_and(|c| c != *v)).take(5).map(|(k, _)| name(k)).collect();
    Ok(Some(format!(
        "{origin} holds {} keys of its own, {peer}'s copy {}: missing {missing:?}, extra {extra:?}, other values {changed:?}",
        own.len(),
        copy.len()
    )))
}

/// Waits until `peer`'s copy of `origin` is the origin's subtree, key for key and value for value.
pub async fn wait_copy_whole(sub: &impl Substrate, origin: &str, peer: &str, deadline: Duration) -> anyhow::Result<()> {
    let last = std::sync::Mutex::new(None);
    let what = format!("{peer}'s copy of {origin} equal to {origin}'s subtree");
    let waited = aether_harness::wait_until(&what, deadline, || {
        let last = &last;
        async move {
            let difference = copy_difference(sub, origin, peer).await?;
            let whole = difference.is_none();
            *last.lock().unwrap() = difference;
            Ok(whole)
        }
    })
    .await;
    if let Err(e) = waited {
        anyhow::bail!("{e}; last seen: {}", last.lock().unwrap().take().unwrap_or_default());
    }
    Ok(())
}

/// Waits until every peer's copy of every origin among `regions` is whole.
pub async fn wait_copies_whole(sub: &impl Substrate, regions: &[&str], deadline: Duration) -> anyhow::Result<()> {
    for origin in regions {
        for peer in regions.iter().filter(|p| *p != origin) {
            wait_copy_whole(sub, origin, peer, deadline).await?;
        }
    }
    Ok(())
}

/// `region`'s RegionPeering.
pub async fn peering(sub: &impl Substrate, region: &str) -> anyhow::Result<RegionPeering> {
    let api: Api<RegionPeering> = Api::namespaced(sub.kube(region).await?, NAMESPACE);
    Ok(api.get(region).await?)
}
