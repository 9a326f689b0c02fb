//! An N-member etcd cluster on loopback, as production runs them (3 or 5 members), optionally
//! with TLS and client-certificate authentication.
use crate::etcd::{EtcdFlavor, EtcdServer, Membership, ServerTls};
use crate::pki::{CertFiles, Pki};
use std::path::Path;
use std::sync::Arc;

/// How to start a cluster.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    pub members: usize,
    pub flavor: EtcdFlavor,
    /// Serve clients over TLS and require client certificates signed by the cluster's CA.
    pub tls: bool,
    pub extra_args: Vec<String>,
}

impl ClusterOptions {
    pub fn new(members: usize) -> Self {
        ClusterOptions { members, flavor: EtcdFlavor::from_env(), tls: false, extra_args: Vec::new() }
    }

    pub fn with_tls(mut self) -> Self {
        self.tls = true;
        self
    }

    pub fn with_args(mut self, args: &[&str]) -> Self {
        self.extra_args.extend(args.iter().map(|a| a.to_string()));
        self
    }
}

pub struct EtcdCluster {
    name: String,
    members: Vec<EtcdServer>,
    pki: Option<(Pki, tempfile::TempDir)>,
}

impl EtcdCluster {
    /// Starts `members` plaintext members of the flavor `AETHER_ETCD` selects.
    pub async fn start(name: &str, members: usize) -> anyhow::Result<Self> {
        Self::start_with(name, ClusterOptions::new(members)).await
    }

    pub async fn start_with(name: &str, options: ClusterOptions) -> anyhow::Result<Self> {
        anyhow::ensure!(options.members >= 1, "a cluster needs a member");
        let pki = if options.tls {
            let dir = tempfile::Builder::new().prefix(&format!("aether-pki-{name}-")).tempdir()?;
            Some((Pki::new(dir.path())?, dir))
        } else {
            None
        };
        let tls = match &pki {
            Some((pki, _)) => Some(ServerTls {
                ca_cert: pki.ca_cert.clone(),
                server: Arc::new(pki.server(&format!("{name}-server"))?),
                root_client: Arc::new(pki.client(&format!("{name}-root"), "root", &[])?),
            }),
            None => None,
        };
        let args: Vec<&str> = options.extra_args.iter().map(String::as_str).collect();
        let mut members = (0..options.members)
            .map(|i| EtcdServer::unstarted(&format!("{name}-{i}"), options.flavor, &args, tls.clone()))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut cluster = EtcdCluster { name: name.to_string(), members: Vec::new(), pki };
        // A port that was free a moment ago may be taken by the time a member binds it: retry
        // the whole cluster on fresh ports.
        let mut attempt = 0;
        loop {
            match Self::launch_all(name, &mut members).await {
                Ok(()) => break,
                Err(e) if attempt < 2 => {
                    eprintln!("etcd cluster {name} did not start ({e}); retrying on other ports");
                    attempt += 1;
                    for m in members.iter_mut() {
                        m.kill();
                        let _ = std::fs::remove_dir_all(m.data_dir());
                        m.reassign_ports();
                    }
                }
                Err(e) => return Err(e),
            }
        }
        cluster.members = members;
        Ok(cluster)
    }

    async fn launch_all(name: &str, members: &mut [EtcdServer]) -> anyhow::Result<()> {
        let initial_cluster =
            members.iter().map(|m| format!("{}={}", m.name(), m.peer_url())).collect::<Vec<_>>().join(",");
        let membership = Membership { initial_cluster, token: format!("{name}-{}", std::process::id()) };
        for m in members.iter_mut() {
            m.set_membership(membership.clone());
            m.spawn()?;
        }
        wait_all_serving(members).await
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Every member's client URL.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.endpoint()).collect()
    }

    pub fn members(&self) -> &[EtcdServer] {
        &self.members
    }

    pub fn member(&mut self, i: usize) -> &mut EtcdServer {
        &mut self.members[i]
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The index of the member that leads now, polled until one does.
    pub async fn leader(&self) -> anyhow::Result<usize> {
        let mut found = None;
        crate::wait_until(&format!("a leader in {}", self.name), crate::STARTUP_DEADLINE, || {
            found = self.members.iter().position(|m| m.is_leader());
            let ok = found.is_some();
            async move { Ok(ok) }
        })
        .await?;
        found.ok_or_else(|| anyhow::anyhow!("no leader"))
    }

    /// kill -9 of member `i`; its data stays for `restart_member`.
    pub fn kill_member(&mut self, i: usize) {
        self.members[i].kill();
    }

    /// Starts a killed or stopped member again and waits until it serves.
    pub async fn restart_member(&mut self, i: usize) -> anyhow::Result<()> {
        self.members[i].restart().await
    }

    /// The CA that signed the server certificate (TLS clusters).
    pub fn ca_cert(&self) -> Option<&Path> {
        self.pki.as_ref().map(|(p, _)| p.ca_cert.as_path())
    }

    /// A client certificate for `user` (its common name is the etcd user under
    /// `--client-cert-auth`), signed by the cluster's CA.
    pub fn client_cert(&self, user: &str) -> anyhow::Result<CertFiles> {
        let (pki, _) = self.pki.as_ref().ok_or_else(|| anyhow::anyhow!("cluster {} has no TLS", self.name))?;
        pki.client(&format!("{}-client-{user}", self.name), user, &[])
    }

    /// A client certificate for `user`, signed by the cluster's CA, that expired in 2021.
    pub fn expired_client_cert(&self, user: &str) -> anyhow::Result<CertFiles> {
        let (pki, _) = self.pki.as_ref().ok_or_else(|| anyhow::anyhow!("cluster {} has no TLS", self.name))?;
        pki.expired_client(&format!("{}-expired-{user}", self.name), user)
    }

    /// Saves a snapshot through the first running member.
    pub fn snapshot_save(&self, path: &Path) -> anyhow::Result<()> {
        let member = self
            .members
            .iter()
            .find(|m| m.is_running())
            .ok_or_else(|| anyhow::anyhow!("no member of {} runs", self.name))?;
        member.snapshot_save(path)
    }

    /// Restores every member from one snapshot (a new cluster id) and starts the cluster again,
    /// as a restore from backup does. `bump_revision`: see [`EtcdServer::restore`].
    pub async fn restore(&mut self, snapshot: &Path, bump_revision: Option<u64>) -> anyhow::Result<()> {
        for m in self.members.iter_mut() {
            m.restore_data(snapshot, bump_revision)?;
        }
        for m in self.members.iter_mut() {
            m.spawn()?;
        }
        wait_all_serving(&mut self.members).await
    }
}

/// Waits until every spawned member serves. Members need each other for a quorum, so all are
/// spawned before any is waited on; waiting on them one after the other is then enough.
async fn wait_all_serving(members: &mut [EtcdServer]) -> anyhow::Result<()> {
    for m in members.iter_mut() {
        m.wait_serving().await?;
    }
    Ok(())
}
