//! A local federation on real parts: N regions, each a kube-apiserver (with its own etcd) and a
//! registry etcd, with the CRDs installed, a RegionPeering per region peering with every other
//! region, and operator processes. Used by `make demo` and `make e2e`.
pub mod load;
pub mod scenarios;
pub mod substrate;

use aether_harness::{ManagedProcess, Region, free_port, tool_path, wait_until};
use aether_operator::api::RegionPeering;
use aether_operator::keys;
use etcd_client::{Client, GetOptions, Txn, TxnOp};
use kube::api::Api;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The namespace the federation's objects live in.
pub const NAMESPACE: &str = "aether-system";
/// Lease settings of the local federation: short, so that a lapse shows within seconds, and long
/// enough for a handoff from a crashed or frozen leader. Its standby waits the leader Lease (8 s)
/// out and starts its workers a second or two later, all within TTL - keepalive (16 s) of the last
/// renewal. At 10 s and 2 s a frozen leader let a's copy lapse 9.3 s after the freeze, its
/// successor elected at 8.6 s (`three_regions`, the leader handoffs, on a loaded machine).
pub const LEASE_TTL_SECONDS: i64 = 20;
pub const KEEPALIVE_SECONDS: i64 = 4;

/// The operator binary next to the running executable (target/<profile>/aether-operator).
pub fn operator_binary() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("AETHER_OPERATOR_BIN") {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe()?;
    for dir in exe.ancestors().skip(1).take(3) {
        let candidate = dir.join("aether-operator");
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    anyhow::bail!("aether-operator is not built next to {}: run `cargo build -p aether-operator` first", exe.display())
}

/// One operator process.
pub struct Operator {
    pub name: String,
    pub metrics_port: u16,
    pub process: ManagedProcess,
}

/// A region's API server and registry etcd, the CRDs installed and the namespace made.
async fn start_region(name: &str) -> anyhow::Result<Region> {
    let region = Region::start(name).await?;
    let client = region.apiserver.client().await?;
    aether_harness::install_crds(&client, aether_operator::api::all_crds()).await?;
    aether_harness::ensure_namespace(&client, NAMESPACE).await?;
    Ok(region)
}

pub struct Federation {
    pub regions: Vec<Region>,
    /// Operator processes by region name.
    pub operators: BTreeMap<String, Vec<Operator>>,
    /// Operators frozen by `pause_operator`, out of their region's list: killed with the
    /// federation, never woken (a woken one would run its shutdown as if it still led).
    frozen: Vec<Operator>,
    dir: tempfile::TempDir,
}

impl Federation {
    /// Starts the regions and installs the CRDs in each; no operator runs yet.
    pub async fn start(names: &[&str]) -> anyhow::Result<Self> {
        let regions = futures::future::try_join_all(names.iter().map(|n| start_region(n))).await?;
        Ok(Federation {
            regions,
            operators: BTreeMap::new(),
            frozen: Vec::new(),
            dir: tempfile::Builder::new().prefix("aether-federation-").tempdir()?,
        })
    }

    /// Starts one more region (its API server with the CRDs, its registry etcd) beside the running
    /// ones; no operator and no RegionPeering yet. Every RegionPeering applied from now on peers
    /// with it too.
    pub async fn add_region(&mut self, name: &str) -> anyhow::Result<()> {
        anyhow::ensure!(self.regions.iter().all(|r| r.name != name), "region {name} runs already");
        self.regions.push(start_region(name).await?);
        Ok(())
    }

    pub fn region(&self, name: &str) -> &Region {
        self.regions.iter().find(|r| r.name == name).expect("a region of this federation")
    }

    pub fn region_mut(&mut self, name: &str) -> &mut Region {
        self.regions.iter_mut().find(|r| r.name == name).expect("a region of this federation")
    }

    /// The RegionPeering of `region`, peering with every other region, as YAML.
    pub fn peering_yaml(&self, region: &str) -> String {
        let own = self.region(region);
        let peers: Vec<serde_json::Value> = self
            .regions
            .iter()
            .filter(|r| r.name != region)
            .map(|r| serde_json::json!({"region": r.name, "endpoints": [r.registry.endpoint()]}))
            .collect();
        let object = serde_json::json!({
            "apiVersion": "federation.aether.dev/v1alpha1",
            "kind": "RegionPeering",
            "metadata": {"name": region, "namespace": NAMESPACE},
            "spec": {
                "region": region,
                "localEtcd": {"endpoints": [own.registry.endpoint()]},
                "peers": peers,
                "lease": {"ttlSeconds": LEASE_TTL_SECONDS, "keepaliveIntervalSeconds": KEEPALIVE_SECONDS},
                "failureDetector": {"acceptablePauseSeconds": 8},
            }
        });
        serde_yaml::to_string(&object).expect("serializable")
    }

    /// `kubectl apply -f` of every region's RegionPeering, in its own region.
    pub fn apply_peerings(&self) -> anyhow::Result<()> {
        for region in &self.regions {
            self.apply_peering(&region.name)?;
        }
        Ok(())
    }

    /// `kubectl apply -f` of one region's RegionPeering.
    pub fn apply_peering(&self, region: &str) -> anyhow::Result<()> {
        let path = self.dir.path().join(format!("{region}-peering.yaml"));
        std::fs::write(&path, self.peering_yaml(region))?;
        let out = self.region(region).apiserver.kubectl()?.arg("apply").arg("-f").arg(&path).output()?;
        anyhow::ensure!(out.status.success(), "kubectl apply: {}", String::from_utf8_lossy(&out.stderr));
        Ok(())
    }

    /// Starts one more operator replica in `region`.
    pub fn start_operator(&mut self, region: &str) -> anyhow::Result<()> {
        self.start_operator_from(region, &operator_binary()?)
    }

    /// Starts one more operator replica in `region` from `binary` (another release's, say).
    pub fn start_operator_from(&mut self, region: &str, binary: &Path) -> anyhow::Result<()> {
        let index = self.operators.get(region).map_or(0, Vec::len);
        let name = format!("{region}-operator-{index}");
        let metrics_port = free_port();
        let kubeconfig = self.region(region).apiserver.kubeconfig().to_path_buf();
        let mut cmd = Command::new(binary);
        cmd.arg("run")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["--identity", &name, "--namespaces", NAMESPACE, "--refresh-seconds", "1"])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .env("RUST_LOG", "info");
        let process = ManagedProcess::spawn(&name, cmd, &self.dir.path().join(format!("{name}.log")))?;
        self.operators.entry(region.to_string()).or_default().push(Operator { name, metrics_port, process });
        Ok(())
    }

    /// A clean stop of one operator (by name): SIGTERM, as a rolling update sends, then its exit.
    pub fn stop_operator(&mut self, name: &str) {
        for ops in self.operators.values_mut() {
            if let Some(op) = ops.iter_mut().find(|o| o.name == name) {
                op.process.terminate();
            }
        }
    }

    /// SIGSTOP of one operator (by name): frozen, it renews and releases nothing until it is
    /// killed with the federation; its region no longer counts it.
    pub fn pause_operator(&mut self, name: &str) {
        for ops in self.operators.values_mut() {
            if let Some(at) = ops.iter().position(|o| o.name == name) {
                let op = ops.remove(at);
                op.process.pause();
                self.frozen.push(op);
            }
        }
    }

    /// kill -9 of one operator (by name).
    pub fn kill_operator(&mut self, name: &str) {
        for ops in self.operators.values_mut() {
            if let Some(op) = ops.iter_mut().find(|o| o.name == name) {
                op.process.kill();
            }
        }
    }

    /// Writes `n` endpoints into `region`'s own subtree: keys `.../endpoints/10.<i>` style.
    pub async fn write_endpoints(&self, region: &str, n: usize) -> anyhow::Result<()> {
        let mut c = self.registry_client(region).await?;
        let all: Vec<usize> = (0..n).collect();
        for chunk in all.chunks(100) {
            let ops: Vec<TxnOp> =
                chunk.iter().map(|i| TxnOp::put(endpoint_key(region, *i), endpoint_value(region, *i), None)).collect();
            c.txn(Txn::new().and_then(ops)).await?;
        }
        Ok(())
    }

    pub async fn registry_client(&self, region: &str) -> anyhow::Result<Client> {
        Ok(Client::connect([self.region(region).registry.endpoint()], None).await?)
    }

    /// Keys of `origin`'s subtree in `region`'s registry etcd.
    pub async fn keys_of(&self, region: &str, origin: &str) -> anyhow::Result<i64> {
        let mut c = self.registry_client(region).await?;
        Ok(c.get(keys::region_prefix(origin), Some(GetOptions::new().with_prefix().with_count_only())).await?.count())
    }

    pub async fn peering(&self, region: &str) -> anyhow::Result<RegionPeering> {
        let api: Api<RegionPeering> = Api::namespaced(self.region(region).apiserver.client().await?, NAMESPACE);
        Ok(api.get(region).await?)
    }

    /// The status of a condition of `region`'s RegionPeering: (status, reason).
    pub async fn condition(&self, region: &str, type_: &str) -> anyhow::Result<Option<(String, String)>> {
        let rp = self.peering(region).await?;
        Ok(rp.status.and_then(|s| s.conditions.into_iter().find(|c| c.type_ == type_)).map(|c| (c.status, c.reason)))
    }

    /// Waits until `region`'s condition has this status.
    pub async fn wait_condition(
        &self,
        region: &str,
        type_: &str,
        status: &str,
        deadline: Duration,
    ) -> anyhow::Result<()> {
        wait_until(&format!("{region}: {type_}={status}"), deadline, || async move {
            Ok(self.condition(region, type_).await?.is_some_and(|(s, _)| s == status))
        })
        .await
    }

    /// `kubectl get regionpeerings -o wide` in a region.
    pub fn get_wide(&self, region: &str) -> anyhow::Result<String> {
        let out = self
            .region(region)
            .apiserver
            .kubectl()?
            .args(["get", "regionpeerings", "-n", NAMESPACE, "-o", "wide"])
            .output()?;
        Ok(String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr))
    }

    pub fn workdir(&self) -> &Path {
        self.dir.path()
    }

    /// One kubeconfig with a context per region, named after it (as an SRE's kubeconfig has one
    /// per cluster).
    pub fn kubeconfig_with_contexts(&self) -> anyhow::Result<PathBuf> {
        let (mut clusters, mut users, mut contexts) = (Vec::new(), Vec::new(), Vec::new());
        for region in &self.regions {
            let text = std::fs::read_to_string(region.apiserver.kubeconfig())?;
            let own: serde_json::Value = serde_yaml::from_str(&text)?;
            let name = region.name.as_str();
            clusters.push(serde_json::json!({"name": name, "cluster": own["clusters"][0]["cluster"]}));
            users.push(serde_json::json!({"name": name, "user": own["users"][0]["user"]}));
            contexts.push(
                serde_json::json!({"name": name, "context": {"cluster": name, "user": name, "namespace": NAMESPACE}}),
            );
        }
        let merged = serde_json::json!({
            "apiVersion": "v1", "kind": "Config", "clusters": clusters, "users": users, "contexts": contexts,
            "current-context": self.regions[0].name,
        });
        let path = self.dir.path().join("federation.kubeconfig");
        std::fs::write(&path, serde_yaml::to_string(&merged)?)?;
        Ok(path)
    }

    /// `aether-operator <args> --kubeconfig <every region's context>`: whether it exited 0, and
    /// what it printed.
    pub fn operator_cli(&self, args: &[&str]) -> anyhow::Result<(bool, String)> {
        let (code, out) = self.operator_cli_exit(args)?;
        Ok((code == Some(0), out))
    }

    /// As `operator_cli`, with the exit code.
    pub fn operator_cli_exit(&self, args: &[&str]) -> anyhow::Result<(Option<i32>, String)> {
        let out = Command::new(operator_binary()?)
            .args(args)
            .arg("--kubeconfig")
            .arg(self.kubeconfig_with_contexts()?)
            .output()?;
        Ok((
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr),
        ))
    }

    /// `kubectl aether <args>`: the binary installed as a kubectl plugin (named `kubectl-aether`
    /// on the PATH).
    pub fn kubectl_plugin(&self, args: &[&str]) -> anyhow::Result<(bool, String)> {
        let (code, out) = self.kubectl_plugin_exit(args)?;
        Ok((code == Some(0), out))
    }

    /// As `kubectl_plugin`, with the exit code.
    pub fn kubectl_plugin_exit(&self, args: &[&str]) -> anyhow::Result<(Option<i32>, String)> {
        let plugins = self.dir.path().join("plugins");
        let plugin = plugins.join("kubectl-aether");
        if !plugin.exists() {
            std::fs::create_dir_all(&plugins)?;
            std::os::unix::fs::symlink(operator_binary()?, &plugin)?;
        }
        let path = format!("{}:{}", plugins.display(), std::env::var("PATH").unwrap_or_default());
        let out = Command::new(tool_path("kubectl")?)
            .arg("aether")
            .args(args)
            .arg("--kubeconfig")
            .arg(self.kubeconfig_with_contexts()?)
            .env("PATH", path)
            .output()?;
        Ok((
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr),
        ))
    }
}

pub fn endpoint_key(region: &str, i: usize) -> String {
    format!(
        "{}clusters/{region}-1/services/svc-{}/protocols/http/endpoints/10.{}.{}.{}",
        keys::region_prefix(region),
        i % 12,
        (i / 65536) % 256,
        (i / 256) % 256,
        i % 256
    )
}

pub fn endpoint_value(region: &str, i: usize) -> String {
    format!(
        r#"{{"clusterName":"{region}-1","region":"{region}","zone":"{region}-z{}","address":"10.{}.{}.{}","port":8080}}"#,
        i % 3,
        (i / 65536) % 256,
        (i / 256) % 256,
        i % 256
    )
}

/// Whether the tools `make tools` builds are there; a clear error otherwise.
pub fn check_tools() -> anyhow::Result<()> {
    for tool in ["etcd", "kube-apiserver", "kubectl"] {
        tool_path(tool)?;
    }
    Ok(())
}
