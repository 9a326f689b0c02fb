//! A single-member etcd cluster on loopback.
use crate::process::{Managed, free_port, wait_until};
use crate::tools::tool_path;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::Command;

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
}

pub struct EtcdServer {
    name: String,
    flavor: EtcdFlavor,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    extra_args: Vec<String>,
    process: Option<Managed>,
}

impl EtcdServer {
    /// Starts an etcd of the flavor `AETHER_ETCD` selects and waits until it serves.
    pub async fn start(name: &str) -> anyhow::Result<Self> {
        Self::start_with(name, EtcdFlavor::from_env(), &[]).await
    }

    pub async fn start_with(name: &str, flavor: EtcdFlavor, extra_args: &[&str]) -> anyhow::Result<Self> {
        let mut server = EtcdServer {
            name: name.to_string(),
            flavor,
            dir: tempfile::Builder::new().prefix(&format!("aether-etcd-{name}-")).tempdir()?,
            client_port: free_port(),
            peer_port: free_port(),
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
            process: None,
        };
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
                    let _ = std::fs::remove_dir_all(server.dir.path().join("data"));
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn launch(&mut self) -> anyhow::Result<()> {
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = Command::new(self.flavor.binary()?);
        cmd.args(["--name", &self.name])
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("{}={peer}", self.name)])
            .args(["--logger", "zap", "--log-level", "warn"])
            .args(&self.extra_args);
        let log = self.dir.path().join("etcd.log");
        self.process = Some(Managed::spawn(&format!("etcd {}", self.name), cmd, &log)?);
        let port = self.client_port;
        let process = self.process.as_mut().expect("just spawned");
        wait_until(&format!("etcd {}", self.name), crate::STARTUP_DEADLINE, || {
            let running = process.check_running();
            async move {
                running?;
                Ok(health_ok(port))
            }
        })
        .await
    }

    /// `http://127.0.0.1:<port>`, the one client URL.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn flavor(&self) -> EtcdFlavor {
        self.flavor
    }

    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().and_then(|p| p.pid())
    }

    pub fn is_running(&self) -> bool {
        self.process.as_ref().is_some_and(|p| p.is_running())
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

    /// Starts the stopped or killed server again on the same ports and data.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.stop();
        self.launch().await
    }
}

/// GET /health over a plain TCP connection: true once etcd says it is healthy.
fn health_ok(port: u16) -> bool {
    let probe = || -> std::io::Result<String> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(2)))?;
        s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
        let mut body = String::new();
        s.read_to_string(&mut body)?;
        Ok(body)
    };
    probe().map(|b| b.contains("\"health\":\"true\"")).unwrap_or(false)
}
