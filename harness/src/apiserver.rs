//! A real kube-apiserver on loopback, backed by its own etcd, with a generated CA, serving
//! certificate and an admin client certificate, and an admin kubeconfig.
use crate::etcd::{EtcdFlavor, EtcdServer};
use crate::pki::Pki;
use crate::process::{Managed, free_port, wait_until};
use crate::tools::tool_path;
use std::path::{Path, PathBuf};
use std::process::Command;

pub struct KubeApiserver {
    name: String,
    // Dropped in field order: the apiserver stops before its etcd and its directory go away.
    process: Managed,
    etcd: EtcdServer,
    port: u16,
    kubeconfig: PathBuf,
    ca_cert: PathBuf,
    dir: tempfile::TempDir,
}

impl KubeApiserver {
    /// Starts the apiserver and its etcd, and waits until /readyz passes and the default
    /// namespace exists.
    pub async fn start(name: &str) -> anyhow::Result<Self> {
        // A port that was free a moment ago may be taken by the time the server binds it: retry.
        let mut attempt = 0;
        loop {
            match Self::start_once(name).await {
                Ok(server) => return Ok(server),
                Err(e) if attempt < 2 => {
                    eprintln!("kube-apiserver {name} did not start ({e}); retrying on other ports");
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn start_once(name: &str) -> anyhow::Result<Self> {
        let etcd = EtcdServer::start_with(&format!("{name}-apiserver"), EtcdFlavor::Default, &[]).await?;
        let dir = tempfile::Builder::new().prefix(&format!("aether-apiserver-{name}-")).tempdir()?;
        let pki = Pki::new(dir.path())?;
        let serving = pki.server("apiserver")?;
        let admin = pki.client("admin", "admin", &["system:masters"])?;
        let sa = pki.service_account_key()?;
        let port = free_port();

        let mut cmd = Command::new(tool_path("kube-apiserver")?);
        cmd.arg(format!("--etcd-servers={}", etcd.endpoint()))
            .args(["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1"])
            .arg(format!("--secure-port={port}"))
            .arg(format!("--cert-dir={}", dir.path().display()))
            .arg(format!("--tls-cert-file={}", serving.cert.display()))
            .arg(format!("--tls-private-key-file={}", serving.key.display()))
            .arg(format!("--client-ca-file={}", pki.ca_cert.display()))
            .arg("--service-account-issuer=https://kubernetes.default.svc.cluster.local")
            .arg(format!("--service-account-key-file={}", sa.cert.display()))
            .arg(format!("--service-account-signing-key-file={}", sa.key.display()))
            .args(["--service-cluster-ip-range=10.96.0.0/16", "--authorization-mode=RBAC"])
            // No nodes or kubelets here; nothing reconciles the kubernetes Service's endpoints.
            .args(["--endpoint-reconciler-type=none", "--enable-priority-and-fairness=false"])
            .arg("--v=1");
        let process = Managed::spawn(&format!("kube-apiserver {name}"), cmd, &dir.path().join("apiserver.log"))?;

        let kubeconfig = dir.path().join("admin.kubeconfig");
        std::fs::write(
            &kubeconfig,
            kubeconfig_yaml(
                port,
                &pki.ca_cert,
                &format!("client-certificate: {}\n    client-key: {}", admin.cert.display(), admin.key.display()),
            ),
        )?;

        let mut server = KubeApiserver {
            name: name.to_string(),
            process,
            etcd,
            port,
            kubeconfig,
            ca_cert: pki.ca_cert.clone(),
            dir,
        };
        server.wait_ready().await?;
        Ok(server)
    }

    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let client = self.client().await?;
        let process = &mut self.process;
        wait_until(&format!("kube-apiserver {}", self.name), crate::STARTUP_DEADLINE, || {
            let running = process.check_running();
            let client = client.clone();
            async move {
                running?;
                let req = http::Request::get("/readyz").body(Vec::new())?;
                if client.request_text(req).await.is_err() {
                    return Ok(false);
                }
                let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(client);
                Ok(namespaces.get_opt("default").await?.is_some())
            }
        })
        .await
    }

    /// An admin client (system:masters).
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        client_from_kubeconfig(&self.kubeconfig).await
    }

    /// The admin kubeconfig's path.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Writes a kubeconfig that authenticates with a bearer token (a ServiceAccount's).
    pub fn kubeconfig_for_token(&self, file_name: &str, token: &str) -> anyhow::Result<PathBuf> {
        let path = self.dir.path().join(file_name);
        std::fs::write(&path, kubeconfig_yaml(self.port, &self.ca_cert, &format!("token: {token}")))?;
        Ok(path)
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// `kubectl --kubeconfig <admin>`, ready for more arguments.
    pub fn kubectl(&self) -> anyhow::Result<Command> {
        let mut cmd = Command::new(tool_path("kubectl")?);
        cmd.arg("--kubeconfig").arg(&self.kubeconfig);
        Ok(cmd)
    }

    /// The apiserver's own etcd.
    pub fn etcd(&self) -> &EtcdServer {
        &self.etcd
    }
}

pub async fn client_from_kubeconfig(path: &Path) -> anyhow::Result<kube::Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(path)?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &kube::config::KubeConfigOptions::default()).await?;
    Ok(kube::Client::try_from(config)?)
}

fn kubeconfig_yaml(port: u16, ca: &Path, user_fields: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    server: https://127.0.0.1:{port}\n    certificate-authority: {ca}\n\
users:\n- name: user\n  user:\n    {user_fields}\ncontexts:\n- name: local\n  context:\n    cluster: local\n    user: user\n    namespace: default\ncurrent-context: local\n",
        ca = ca.display()
    )
}
