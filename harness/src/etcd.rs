//! etcd servers on loopback: a single member, or a member of an N-member cluster
//! ([`crate::EtcdCluster`]), in plaintext or with TLS and client-certificate authentication.
use crate::pki::CertFiles;
use crate::process::{Managed, free_port};
use crate::tools::tool_path;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

/// Which etcd to run. The default is the etcd `make tools` builds (3.6); `V3_4` is Debian's, for
/// the compatibility pass. `AETHER_ETCD=3.4` switches the default for a whole test run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EtcdFlavor {
    Default,
    V3_4,
}

impl EtcdFlavor {
    /// The flavor a test run asked for through `AETHER_ETCD`.
    pub fn from_env() -> Self {
        match std::env::var("AETHER_ETCD").as_deref() {
            Ok("3.4") => EtcdFlavor::V3_4,
            _ => EtcdFlavor::Default,
        }
    }

    fn binary(self) -> anyhow::Result<PathBuf> {
        match self {
            EtcdFlavor::Default => tool_path("etcd"),
            EtcdFlavor::V3_4 => tool_path("etcd-3.4"),
        }
    }

    fn etcdctl(self) -> anyhow::Result<PathBuf> {
        match self {
            EtcdFlavor::Default => tool_path("etcdctl"),
            EtcdFlavor::V3_4 => tool_path("etcdctl-3.4"),
        }
    }
}

/// The serving side of TLS: the server certificate and the CA that client certificates must be
/// signed by (`--client-cert-auth`).
#[derive(Clone, Debug)]
pub struct ServerTls {
    pub ca_cert: PathBuf,
    pub server: Arc<CertFiles>,
    /// A client certificate for the `root` user, for the harness's own etcdctl calls.
    pub root_client: Arc<CertFiles>,
}

/// Membership of a cluster: the whole initial cluster and its token.
#[derive(Clone, Debug)]
pub(crate) struct Membership {
    pub initial_cluster: String,
    pub token: String,
}

pub struct EtcdServer {
    name: String,
    flavor: EtcdFlavor,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    metrics_port: u16,
    extra_args: Vec<String>,
    membership: Option<Membership>,
    tls: Option<ServerTls>,
    process: Option<Managed>,
}

impl EtcdServer {
    /// Starts an etcd of the flavor `AETHER_ETCD` selects and waits until it serves.
    pub async fn start(name: &str) -> anyhow::Result<Self> {
        Self::start_with(name, EtcdFlavor::from_env(), &[]).await
    }

    pub async fn start_with(name: &str, flavor: EtcdFlavor, extra_args: &[&str]) -> anyhow::Result<Self> {
        let mut server = Self::unstarted(name, flavor, extra_args, None)?;
        // A port that was free a moment ago may be taken by the time etcd binds it: retry with
        // fresh ports.
        let mut attempt = 0;
        loop {
            match server.launch().await {
                Ok(()) => return Ok(server),
                Err(e) if attempt < 2 => {
                    eprintln!("etcd {name} did not start ({e}); retrying on other ports");
                    attempt += 1;
                    server.kill();
                    server.client_port = free_port();
                    server.peer_port = free_port();
                    server.metrics_port = free_port();
                    let _ = std::fs::remove_dir_all(server.data_dir());
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// A server that is configured but not running yet (the cluster wires its members first).
    pub(crate) fn unstarted(
        name: &str,
        flavor: EtcdFlavor,
        extra_args: &[&str],
        tls: Option<ServerTls>,
    ) -> anyhow::Result<Self> {
        Ok(EtcdServer {
            name: name.to_string(),
            flavor,
            dir: tempfile::Builder::new().prefix(&format!("aether-etcd-{name}-")).tempdir()?,
            client_port: free_port(),
            peer_port: free_port(),
            metrics_port: free_port(),
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
            membership: None,
            tls,
            process: None,
        })
    }

    pub(crate) fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer_port)
    }

    pub(crate) fn set_membership(&mut self, membership: Membership) {
        self.membership = Some(membership);
    }

    pub(crate) fn reassign_ports(&mut self) {
        self.client_port = free_port();
        self.peer_port = free_port();
        self.metrics_port = free_port();
    }

    pub(crate) fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Spawns the process without waiting for it to serve.
    pub(crate) fn spawn(&mut self) -> anyhow::Result<()> {
        let client = self.endpoint();
        let peer = self.peer_url();
        let initial_cluster = match &self.membership {
            Some(m) => m.initial_cluster.clone(),
            None => format!("{}={peer}", self.name),
        };
        let mut cmd = Command::new(self.flavor.binary()?);
        cmd.args(["--name", &self.name])
            .arg("--data-dir")
            .arg(self.data_dir())
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--listen-metrics-urls", &format!("http://127.0.0.1:{}", self.metrics_port)])
            .args(["--initial-cluster", &initial_cluster])
            .args(["--logger", "zap", "--log-level", "warn"]);
        if let Some(m) = &self.membership {
            cmd.args(["--initial-cluster-token", &m.token]);
        }
        if let Some(tls) = &self.tls {
            cmd.arg("--cert-file")
                .arg(&tls.server.cert)
                .arg("--key-file")
                .arg(&tls.server.key)
                .arg("--trusted-ca-file")
                .arg(&tls.ca_cert)
                .arg("--client-cert-auth");
        }
        cmd.args(&self.extra_args);
        let log = self.dir.path().join("etcd.log");
        self.process = Some(Managed::spawn(&format!("etcd {}", self.name), cmd, &log)?);
        Ok(())
    }

    /// Waits until the server says it is healthy (a member: once its cluster has a leader). The
    /// answer counts only from a metrics port this server's process holds: etcd binds it last,
    /// after serving clients, and a port taken by another test's etcd in the meantime would
    /// otherwise answer for it while this one exits on the failed bind (the image's test once
    /// talked to a registry etcd that had already exited).
    pub(crate) async fn wait_serving(&mut self) -> anyhow::Result<()> {
        let port = self.metrics_port;
        let member_dir = self.data_dir().join("member");
        let process = self.process.as_mut().ok_or_else(|| anyhow::anyhow!("etcd {} is not running", self.name))?;
        let pid = process.pid().ok_or_else(|| anyhow::anyhow!("etcd {} is not running", self.name))?;
        let started = std::time::Instant::now();
        loop {
            // Exited (a port taken): fail now, so that a start on other ports follows at once.
            process.check_running()?;
            if member_dir.exists()
                && crate::process::listens_on(pid, port)
                && http_get(port, "/health?exclude=NOSPACE").is_some_and(|b| b.contains("\"health\":\"true\""))
            {
                return Ok(());
            }
            if started.elapsed() > crate::STARTUP_DEADLINE {
                anyhow::bail!("etcd {} not serving after {:?}", self.name, crate::STARTUP_DEADLINE);
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    async fn launch(&mut self) -> anyhow::Result<()> {
        self.spawn()?;
        self.wait_serving().await
    }

    /// `http://127.0.0.1:<port>` (or `https://` with TLS), the one client URL.
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    /// `127.0.0.1:<port>`, for a proxy in front of this server.
    pub fn client_addr(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.client_port))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn flavor(&self) -> EtcdFlavor {
        self.flavor
    }

    pub fn tls(&self) -> Option<&ServerTls> {
        self.tls.as_ref()
    }

    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().and_then(|p| p.pid())
    }

    pub fn is_running(&self) -> bool {
        self.process.as_ref().is_some_and(|p| p.is_running())
    }

    /// The member's Prometheus exposition (its metrics listener), if it answers.
    pub fn metrics(&self) -> Option<String> {
        http_get(self.metrics_port, "/metrics")
    }

    /// Whether this member leads its cluster now (from its metrics).
    pub fn is_leader(&self) -> bool {
        self.is_running()
            && http_get(self.metrics_port, "/metrics")
                .is_some_and(|m| m.lines().any(|l| l.trim() == "etcd_server_is_leader 1"))
    }

    /// A clean stop (SIGTERM); the data directory stays for `restart`.
    pub fn stop(&mut self) {
        if let Some(p) = self.process.as_mut() {
            p.terminate();
        }
    }

    /// kill -9; the data directory stays for `restart`.
    pub fn kill(&mut self) {
        if let Some(p) = self.process.as_mut() {
            p.kill();
        }
    }

    /// SIGSTOP: the process holds its sockets and answers nothing (a paused VM, a long GC).
    pub fn pause(&self) {
        if let Some(pid) = self.pid() {
            crate::process::signal(pid, "STOP");
        }
    }

    /// SIGCONT after `pause`.
    pub fn resume(&self) {
        if let Some(pid) = self.pid() {
            crate::process::signal(pid, "CONT");
        }
    }

    /// Starts the stopped or killed server again on the same ports and data.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.stop();
        self.launch().await
    }

    /// `etcdctl` pointed at this server (with the root client certificate under TLS).
    pub fn etcdctl(&self) -> anyhow::Result<Command> {
        let mut cmd = Command::new(self.flavor.etcdctl()?);
        cmd.env("ETCDCTL_API", "3").arg(format!("--endpoints={}", self.endpoint()));
        if let Some(tls) = &self.tls {
            cmd.arg(format!("--cacert={}", tls.ca_cert.display()))
                .arg(format!("--cert={}", tls.root_client.cert.display()))
                .arg(format!("--key={}", tls.root_client.key.display()));
        }
        Ok(cmd)
    }

    /// Saves a snapshot of this member's data to `path` (`etcdctl snapshot save`).
    pub fn snapshot_save(&self, path: &Path) -> anyhow::Result<()> {
        let mut cmd = self.etcdctl()?;
        cmd.arg("snapshot").arg("save").arg(path);
        run(cmd, "etcdctl snapshot save")
    }

    /// Replaces this member's data with a snapshot (`etcdutl snapshot restore`): a new cluster id,
    /// the revision of the snapshot, or that plus `bump_revision` (restored with
    /// `--bump-revision --mark-compacted`, as etcd's restore guide recommends). Waits until it
    /// serves when it is a single member; a cluster's members are restored together.
    pub(crate) fn restore_data(&mut self, snapshot: &Path, bump_revision: Option<u64>) -> anyhow::Result<()> {
        self.kill();
        let data = self.data_dir();
        let _ = std::fs::remove_dir_all(&data);
        let initial_cluster = match &self.membership {
            Some(m) => m.initial_cluster.clone(),
            None => format!("{}={}", self.name, self.peer_url()),
        };
        let token = self.membership.as_ref().map(|m| m.token.clone()).unwrap_or_else(|| "etcd-cluster".into());
        let mut cmd = Command::new(tool_path("etcdutl")?);
        cmd.arg("snapshot")
            .arg("restore")
            .arg(snapshot)
            .arg("--data-dir")
            .arg(&data)
            .args(["--name", &self.name])
            .args(["--initial-cluster", &initial_cluster])
            .args(["--initial-cluster-token", &format!("{token}-restored")])
            .args(["--initial-advertise-peer-urls", &self.peer_url()]);
        if let Some(bump) = bump_revision {
            cmd.args(["--bump-revision", &bump.to_string(), "--mark-compacted"]);
        }
        run(cmd, "etcdutl snapshot restore")
    }

    /// Restores a single server from a snapshot and starts it.
    pub async fn restore(&mut self, snapshot: &Path, bump_revision: Option<u64>) -> anyhow::Result<()> {
        self.restore_data(snapshot, bump_revision)?;
        self.launch().await
    }
}

fn run(mut cmd: Command, what: &str) -> anyhow::Result<()> {
    let out = cmd.output()?;
    if !out.status.success() {
        anyhow::bail!(
            "{what} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// A plain HTTP/1.0 GET on 127.0.0.1 (etcd's metrics listener): the response, if any.
fn http_get(port: u16, path: &str) -> Option<String> {
    let probe = || -> std::io::Result<String> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(2)))?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
        let mut body = String::new();
        s.read_to_string(&mut body)?;
        Ok(body)
    };
    probe().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// Another test's etcd holds the metrics port this one was given, and says it is healthy:
    /// this one exits on the failed bind after serving clients for a moment, and must not be
    /// taken for serving.
    #[tokio::test]
    async fn an_etcd_whose_metrics_port_another_process_answers_on_is_not_taken_for_serving() {
        let squatter = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = squatter.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for mut stream in squatter.incoming().flatten() {
                let mut request = [0u8; 1024];
                let _ = stream.read(&mut request);
                let _ = stream.write_all(b"HTTP/1.0 200 OK\r\n\r\n{\"health\":\"true\"}");
            }
        });
        let mut server = EtcdServer::unstarted("squatted", EtcdFlavor::from_env(), &[], None).unwrap();
        server.metrics_port = port;
        server.spawn().unwrap();
        let outcome = server.wait_serving().await;
        let error =
            format!("{:#}", outcome.expect_err("an etcd that could not bind its metrics port was taken for serving"));
        assert!(error.contains("exited"), "the failed start says the etcd exited: {error}");
    }
}
