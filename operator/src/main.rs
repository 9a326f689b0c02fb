//! `aether-operator`: the operator binary.
use aether_operator::controllers::{leader, region_peering};
use aether_operator::metrics::Metrics;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

#[derive(Parser)]
#[command(
    name = "aether-operator",
    version,
    about = "Federates the aether endpoint registry across regions",
    after_help = "Examples:
  kubectl aether status --all-contexts --etcd     # every region, each peer's copy checked on its etcd
  kubectl aether doctor <name> -n aether-system   # why a region's mirror does not come up
  kubectl aether report --all-contexts            # a support bundle to attach to a bug report

Reading the output: docs/status.md; from a symptom to its cause: docs/troubleshooting.md"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The whole federation as an origin x peer matrix; exit 0 healthy, 1 not, 2 could not check.
    ///
    /// Every region's RegionPeering through kubeconfig contexts (the current one, those named
    /// with --context, or --all-contexts). With --etcd, each peer's copy is checked on its etcd.
    Status(StatusArgs),
    /// Check a RegionPeering's credentials and permissions on each etcd it names.
    ///
    /// Exits 0 when every check passed, 1 when one failed, 2 when it could not check (as
    /// `status`).
    Doctor(DoctorArgs),
    /// Collect a support bundle (objects, events, logs, status) into a directory.
    ///
    /// The RegionPeerings and RegistrySchemas, their events, the operator's Lease, Deployments,
    /// Pods and logs, and `status`, one subdirectory per context. Secrets are never read;
    /// environment values are redacted.
    Report(ReportArgs),
    /// This client's version, and whether each context's CRDs and operator match it.
    ///
    /// Exits 0 when they agree, 1 when not, 2 when it could not check.
    Version(VersionArgs),
    /// Print a shell completion script (bash, zsh, fish, powershell, elvish).
    ///
    /// `source <(aether-operator completion bash)`, or write it where the shell loads completions
    /// from.
    Completion {
        /// bash, zsh, fish, powershell or elvish.
        shell: clap_complete::Shell,
    },
    /// Run the operator (what the chart's Deployment runs).
    ///
    /// Leader election, the RegionPeering and RegistrySchema reconcilers, the mirror workers.
    Run(RunArgs),
    /// Run the v0 -> v1 drain once against an etcd, without the CRD, and print its report.
    Drain(DrainArgs),
    /// Write every generated manifest (CRDs, RBAC) under a repository root (`make manifests`).
    #[command(hide = true)]
    Manifests {
        #[arg(long, default_value = ".")]
        root: PathBuf,
    },
}

#[derive(clap::Args)]
struct DrainArgs {
    /// Client URLs of the registry etcd (comma separated).
    #[arg(long, value_delimiter = ',', required = true)]
    etcd: Vec<String>,
    /// Region for legacy values that carry none.
    #[arg(long)]
    region: String,
    /// Cluster for legacy values that carry no clusterName.
    #[arg(long)]
    cluster: String,
    /// The legacy prefix to drain (keys /aether/services/... by default).
    #[arg(long, default_value = aether_operator::keys::V0_ROOT)]
    legacy_prefix: String,
    /// Report what would happen and write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Seconds the legacy prefix must be quiet before its keys are deleted.
    #[arg(long, default_value_t = 10)]
    quiet_period_seconds: u64,
    /// Legacy keys per Txn (1 to 128).
    #[arg(long, default_value_t = 100)]
    batch_size: usize,
    /// Keys per second at most; 0 for no limit.
    #[arg(long, default_value_t = 0)]
    rate_limit: u64,
    /// CA certificate (PEM) for https endpoints.
    #[arg(long)]
    cacert: Option<PathBuf>,
    /// Client certificate and key (PEM).
    #[arg(long, requires = "key")]
    cert: Option<PathBuf>,
    /// Client key (PEM), with --cert.
    #[arg(long, requires = "cert")]
    key: Option<PathBuf>,
    /// etcd user (the password comes from ETCD_PASSWORD).
    #[arg(long)]
    user: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OutputFormat {
    Table,
    Json,
    Yaml,
}

#[derive(clap::Args)]
struct StatusArgs {
    /// The kubeconfig; KUBECONFIG or ~/.kube/config otherwise.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// A context to read (repeat for each region); the current context when none is given.
    #[arg(long = "context", conflicts_with = "all_contexts")]
    contexts: Vec<String>,
    /// Read every context of the kubeconfig.
    #[arg(long)]
    all_contexts: bool,
    /// How long all the contexts together may take to answer (30s, 2m; bare seconds too); they
    /// are read at once.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = aether_operator::cli::parse_duration)]
    timeout: Duration,
    /// Only this namespace; all namespaces otherwise.
    #[arg(short, long)]
    namespace: Option<String>,
    /// Also check each peer's copy directly on its etcd: the canary, the checkpoint, and that it
    /// holds as many keys as the origin.
    #[arg(long)]
    etcd: bool,
    /// Where --etcd reads the etcds from.
    #[arg(long, value_enum, value_name = "WHERE", default_value = "auto", requires = "etcd")]
    etcd_from: aether_operator::cli::status::EtcdFrom,
    /// table, json or yaml.
    #[arg(short, long, value_enum, default_value = "table")]
    output: OutputFormat,
    /// Wait up to this long for the federation to be healthy (5m, 300s; bare seconds too).
    #[arg(long, value_name = "DURATION", value_parser = aether_operator::cli::parse_duration)]
    wait: Option<Duration>,
}

#[derive(clap::Args)]
struct VersionArgs {
    /// The kubeconfig; KUBECONFIG or ~/.kube/config otherwise.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// A context to check (repeat for each region); the current context when none is given.
    #[arg(long = "context", conflicts_with_all = ["all_contexts", "client"])]
    contexts: Vec<String>,
    /// Check every context of the kubeconfig.
    #[arg(long, conflicts_with = "client")]
    all_contexts: bool,
    /// This client's version only.
    #[arg(long)]
    client: bool,
    /// The leader Lease ("namespace/name") whose holder is the operator that runs.
    #[arg(long, default_value = "aether-system/aether-operator-leader")]
    leader_lease: String,
}

#[derive(clap::Args)]
struct ReportArgs {
    /// The kubeconfig; KUBECONFIG or ~/.kube/config otherwise.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// A context to collect from (repeat for each region); the current context when none is given.
    #[arg(long = "context", conflicts_with = "all_contexts")]
    contexts: Vec<String>,
    /// Collect from every context of the kubeconfig.
    #[arg(long)]
    all_contexts: bool,
    /// Only this namespace's RegionPeerings and RegistrySchemas; all namespaces otherwise.
    #[arg(short, long)]
    namespace: Option<String>,
    /// The leader Lease ("namespace/name"); its namespace is where the operator's pods are.
    #[arg(long, default_value = "aether-system/aether-operator-leader")]
    leader_lease: String,
    /// The logs of this long ago to now (1h, 30m).
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = aether_operator::cli::parse_duration)]
    since: Duration,
    /// The directory to write (it must not exist); aether-report-<unix time> otherwise.
    #[arg(short = 'd', long)]
    directory: Option<PathBuf>,
}

#[derive(clap::Args)]
struct DoctorArgs {
    /// The RegionPeering; the only one in the namespace when not given.
    name: Option<String>,
    /// The kubeconfig; KUBECONFIG or ~/.kube/config otherwise.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// The context; the current one when not given.
    #[arg(long)]
    context: Option<String>,
    /// The RegionPeering's namespace; the context's namespace (or default) when not given.
    #[arg(short, long)]
    namespace: Option<String>,
    /// table, json or yaml.
    #[arg(short, long, value_enum, default_value = "table")]
    output: OutputFormat,
    /// Where the checks run.
    #[arg(long, value_enum, value_name = "WHERE", default_value = "auto", conflicts_with = "in_cluster")]
    from: aether_operator::cli::status::EtcdFrom,
    /// Run the checks from the region's leader pod, with the operator's network and credentials
    /// (through a port-forward to its metrics port, with a bearer token), instead of from this machine.
    #[arg(long)]
    in_cluster: bool,
    /// With --in-cluster: reach the operator's metrics listener at this URL instead of through a
    /// port-forward to the leader.
    #[arg(long, requires = "in_cluster")]
    operator_url: Option<String>,
    /// With --in-cluster: the leader's metrics port.
    #[arg(long, default_value_t = 8443)]
    metrics_port: u16,
    /// With --in-cluster: the metrics listener serves plain HTTP (metrics.secure=false).
    #[arg(long)]
    metrics_plain: bool,
    /// With --in-cluster: the bearer token the operator reviews (the kubeconfig's, when it has one).
    #[arg(long, env = "AETHER_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// With --in-cluster: the leader Lease ("namespace/name") whose holder runs the checks.
    #[arg(long, default_value = "aether-system/aether-operator-leader")]
    leader_lease: String,
    /// With --in-cluster: the CA (PEM file) the operator's metrics certificate is verified against
    /// (the chart's metrics.certSecret ca.crt); the token goes only to a server that verifies.
    #[arg(long, requires = "in_cluster")]
    metrics_ca: Option<PathBuf>,
    /// With --in-cluster and --metrics-ca: the name the certificate is verified for (the URL's
    /// host, or localhost through a port-forward, when not given).
    #[arg(long, requires = "metrics_ca")]
    metrics_server_name: Option<String>,
    /// With --in-cluster: do not verify the operator's certificate (a self-signed one); the bearer
    /// token is then sent to whatever answers.
    #[arg(long, requires = "in_cluster", conflicts_with = "metrics_ca")]
    insecure_skip_tls_verify: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Namespaces to watch (comma separated); empty watches all.
    #[arg(long, env = "AETHER_WATCH_NAMESPACES", value_delimiter = ',')]
    namespaces: Vec<String>,
    /// This instance's identity (the pod name).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Name of the coordination.k8s.io Lease used for leader election.
    #[arg(long, env = "AETHER_LEADER_LEASE", default_value = "aether-operator-leader")]
    leader_lease_name: String,
    /// Namespace of the leader-election Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "aether-system")]
    leader_lease_namespace: String,
    /// Seconds the leader lease stays valid after a renewal.
    #[arg(long, env = "AETHER_LEADER_LEASE_DURATION", default_value_t = 8)]
    leader_lease_duration: u64,
    /// Seconds before expiry the leader renews.
    #[arg(long, env = "AETHER_LEADER_LEASE_GRACE", default_value_t = 3)]
    leader_lease_grace: u64,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "AETHER_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: String,
    /// Serve HTTPS, and /metrics only to bearer tokens the API server authenticates (TokenReview)
    /// and allows `get` on the non-resource URL /metrics (SubjectAccessReview). /healthz and
    /// /readyz stay open.
    #[arg(long, env = "AETHER_METRICS_SECURE")]
    metrics_secure: bool,
    /// Directory with tls.crt and tls.key for the secure endpoint; a self-signed certificate is
    /// generated at start without it.
    #[arg(long, env = "AETHER_METRICS_CERT_DIR", requires = "metrics_secure")]
    metrics_cert_dir: Option<PathBuf>,
    /// text, or json for log collectors.
    #[arg(long, env = "AETHER_LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Path of a kubeconfig; in-cluster config or ~/.kube/config otherwise.
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Seconds between status refreshes from the workers' health.
    #[arg(long, default_value_t = 5)]
    refresh_seconds: u64,
    /// This Kubernetes cluster's name, recorded on the peers with each mirror's owner, so that a
    /// refused duplicate claim on a region names the cluster the other claim lives in.
    #[arg(long, env = "AETHER_CLUSTER_NAME", default_value = "")]
    cluster_name: String,
    /// MiB the mirror holds at most for writes on their way (revisions received and not applied,
    /// Txns in flight, sync pages read ahead), all workers together; about a third of the pod's
    /// memory limit (the chart's is 256Mi).
    #[arg(long, env = "AETHER_MEMORY_BUDGET_MIB", default_value_t = 96)]
    memory_budget_mib: usize,
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,kube=warn,tower=warn,hyper=warn".into());
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

/// The command line, with help and errors under the name this binary was called by
/// (`kubectl aether` when installed as the kubectl plugin `kubectl-aether`).
/// The executable's file name (`aether-operator`, or `kubectl-aether` as the plugin).
fn executable_name() -> String {
    std::env::args_os()
        .next()
        .and_then(|a| std::path::Path::new(&a).file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "aether-operator".into())
}

fn parse_command_line() -> Cli {
    let called = executable_name();
    let name = match called.strip_prefix("kubectl-") {
        Some(plugin) => format!("kubectl {plugin}"),
        None => called,
    };
    // clap keeps the name for the life of the program.
    let name: &'static str = Box::leak(name.into_boxed_str());
    let matches = Cli::command().name(name).bin_name(name).get_matches();
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// How `status` ends: its exit code.
enum StatusOutcome {
    Healthy,
    Unhealthy,
    CouldNotCheck,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match parse_command_line().command {
        Command::Manifests { root } => {
            for (path, contents) in aether_operator::manifests::generated_files() {
                let path = root.join(path);
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir)?;
                }
                std::fs::write(&path, contents)?;
                println!("wrote {}", path.display());
            }
            Ok(())
        }
        Command::Status(args) => {
            let code = match run_status(args).await {
                Ok(StatusOutcome::Healthy) => 0,
                Ok(StatusOutcome::Unhealthy) => 1,
                Ok(StatusOutcome::CouldNotCheck) => 2,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    2
                }
            };
            std::process::exit(code);
        }
        Command::Doctor(args) => {
            let code = match run_doctor(args).await {
                Ok(true) => 0,
                Ok(false) => 1,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    2
                }
            };
            std::process::exit(code);
        }
        Command::Version(args) => {
            let code = match run_version(args).await {
                Ok(true) => 0,
                Ok(false) => 1,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    2
                }
            };
            std::process::exit(code);
        }
        Command::Completion { shell } => {
            // For the executable as the shell finds it on the PATH (a plugin's is `kubectl-aether`).
            let name = executable_name();
            clap_complete::generate(shell, &mut Cli::command(), name, &mut std::io::stdout());
            Ok(())
        }
        Command::Report(args) => match run_report(args).await {
            Ok(dir) => {
                println!("{}", dir.display());
                Ok(())
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                std::process::exit(2);
            }
        },
        Command::Drain(args) => {
            init_tracing(LogFormat::Text);
            let report = run_drain(args).await?;
            print!("{}", report.render());
            use aether_operator::drain::DrainPhase;
            if !matches!(report.phase, Some(DrainPhase::Complete | DrainPhase::DryRunComplete)) {
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Run(args) => {
            init_tracing(args.log_format);
            if let Err(e) = run(args).await {
                error!("{e:#}");
                std::process::exit(1);
            }
            Ok(())
        }
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let client = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)?;
            let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?;
            kube::Client::try_from(config)?
        }
        None => kube::Client::try_default().await?,
    };
    let namespaces: Vec<Option<String>> = if args.namespaces.iter().all(|n| n.is_empty()) {
        vec![None]
    } else {
        args.namespaces.iter().filter(|n| !n.is_empty()).cloned().map(Some).collect()
    };
    if namespaces != [None] {
        let served: Vec<&str> = namespaces.iter().flatten().map(String::as_str).collect();
        info!(
            namespaces = %served.join(","),
            "serving RegionPeerings and RegistrySchemas in these namespaces only; objects in any other namespace are ignored"
        );
    }
    aether_operator::preflight::check_crds(&client, &namespaces).await?;

    let identity = args.identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/etc/hostname").unwrap_or_default().trim().to_string();
        format!("{}-{:04x}", if host.is_empty() { "aether-operator" } else { &host }, rand::random::<u16>())
    });
    let metrics = Arc::new(Metrics::default());
    let supervision = aether_operator::supervise::Supervision::new(metrics.clone());
    let shutdown = CancellationToken::new();
    let access = if args.metrics_secure {
        let identity = match &args.metrics_cert_dir {
            Some(dir) => aether_operator::http::ServerIdentity::from_dir(dir)?,
            None => aether_operator::http::ServerIdentity::self_signed()?,
        };
        aether_operator::http::MetricsAccess::Secure { identity, client: client.clone() }
    } else {
        aether_operator::http::MetricsAccess::Open
    };
    let doctor = Some((client.clone(), identity.clone()));
    let server = aether_operator::http::serve(
        &args.metrics_addr,
        access,
        metrics.clone(),
        supervision.clone(),
        doctor,
        shutdown.clone(),
    )
    .await?;
    info!(identity = %identity, addr = %args.metrics_addr, "aether-operator starting");

    let signal = shutdown.clone();
    tokio::spawn(async move {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        info!("shutting down");
        signal.cancel();
    });

    let settings = region_peering::ControllerSettings {
        identity: identity.clone(),
        refresh_interval: Duration::from_secs(args.refresh_seconds.max(1)),
        leader_lease: format!("{}/{}", args.leader_lease_namespace, args.leader_lease_name),
        leader_lease_duration: Duration::from_secs(args.leader_lease_duration),
        cluster_name: args.cluster_name.clone(),
        memory: aether_operator::mirror::MemoryBudget::new(args.memory_budget_mib.max(8) << 20),
    };
    let leader_settings = leader::LeaderSettings {
        lease_name: args.leader_lease_name.clone(),
        namespace: args.leader_lease_namespace.clone(),
        identity: identity.clone(),
        duration_seconds: args.leader_lease_duration,
        grace_seconds: args.leader_lease_grace.min(args.leader_lease_duration.saturating_sub(1)).max(1),
    };
    // The workers outlive a term of the controllers: a leader that loses sight of the API server
    // keeps renewing (leader.rs), and leads again over the same workers when it comes back.
    let peering = region_peering::Context::new(client.clone(), settings.clone(), metrics.clone(), supervision.clone());
    let schema = aether_operator::controllers::registry_schema::Context::new(
        client.clone(),
        settings.clone(),
        metrics.clone(),
        peering.clone(),
    );
    let lead = |term: CancellationToken| {
        let (peering, schema, namespaces) = (peering.clone(), schema.clone(), namespaces.clone());
        let supervision = supervision.clone();
        async move {
            peering.new_term();
            schema.new_term();
            // Supervised: a controller that panicked runs again (a new watch, a fresh store).
            let mut controllers = Vec::new();
            for ns in namespaces {
                let (peering, schema, term, supervision) =
                    (peering.clone(), schema.clone(), term.clone(), supervision.clone());
                let ns2 = ns.clone();
                let term2 = term.clone();
                controllers.push(tokio::spawn(aether_operator::supervise::supervised(
                    "controller",
                    supervision.clone(),
                    move || region_peering::run(peering.clone(), ns.clone(), term.clone()),
                )));
                controllers.push(tokio::spawn(aether_operator::supervise::supervised(
                    "controller",
                    supervision,
                    move || {
                        aether_operator::controllers::registry_schema::run(schema.clone(), ns2.clone(), term2.clone())
                    },
                )));
            }
            term.cancelled().await;
            // A reconcile in flight may wait on an API server that no longer answers (the reason a
            // term ends): the controllers stop now, not after its request times out. The next term
            // reconciles everything again.
            for c in &controllers {
                c.abort();
            }
            for c in controllers {
                let _ = c.await;
            }
            // Drains resume from their records under the next term.
            schema.stop_all().await;
        }
    };
    let release = || {
        let peering = peering.clone();
        async move { peering.stop_all().await }
    };
    leader::run_elected(client.clone(), leader_settings, &metrics, shutdown.clone(), lead, release).await?;
    shutdown.cancel();
    let _ = server.await;
    Ok(())
}

/// Prints the federation; while `--wait` lasts and it is not healthy, reads it again every 2 s,
/// saying on stderr what it waits for.
/// The contexts a command reads: every one, those named, or the current one.
fn contexts_of(kubeconfig: &kube::config::Kubeconfig, named: &[String], all: bool) -> anyhow::Result<Vec<String>> {
    let contexts: Vec<String> = if all {
        kubeconfig.contexts.iter().map(|c| c.name.clone()).collect()
    } else if named.is_empty() {
        let current = kubeconfig.current_context.clone().filter(|c| !c.is_empty());
        vec![current.ok_or_else(|| anyhow::anyhow!("the kubeconfig has no current context: name one with --context"))?]
    } else {
        named.to_vec()
    };
    anyhow::ensure!(!contexts.is_empty(), "the kubeconfig has no context");
    for context in &contexts {
        anyhow::ensure!(
            kubeconfig.contexts.iter().any(|c| &c.name == context),
            "the kubeconfig has no context {context}"
        );
    }
    Ok(contexts)
}

async fn run_version(args: VersionArgs) -> anyhow::Result<bool> {
    use aether_operator::cli::{client_for, load_kubeconfig, version};
    let ours = env!("CARGO_PKG_VERSION");
    println!("client: {ours}");
    if args.client {
        return Ok(true);
    }
    let kubeconfig = load_kubeconfig(args.kubeconfig.as_deref())?;
    let contexts = contexts_of(&kubeconfig, &args.contexts, args.all_contexts)?;
    let mut agree = true;
    for context in &contexts {
        let client = client_for(&kubeconfig, Some(context)).await?;
        let (lines, agrees) = version::judge(context, &version::read(&client, &args.leader_lease).await, ours);
        lines.iter().for_each(|l| println!("{l}"));
        agree &= agrees;
    }
    Ok(agree)
}

async fn run_report(args: ReportArgs) -> anyhow::Result<PathBuf> {
    use aether_operator::cli::{client_for, load_kubeconfig, report, status};
    let kubeconfig = load_kubeconfig(args.kubeconfig.as_deref())?;
    let contexts = contexts_of(&kubeconfig, &args.contexts, args.all_contexts)?;
    let dir = args.directory.clone().unwrap_or_else(|| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        PathBuf::from(format!("aether-report-{}", now.as_secs()))
    });
    anyhow::ensure!(!dir.exists(), "{} exists: name a new directory with --directory", dir.display());
    let write = |path: PathBuf, text: &str| -> anyhow::Result<()> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&path, text).map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))
    };
    write(dir.join("README.txt"), &report::readme(&contexts, args.since))?;
    let scope =
        report::Scope { namespace: args.namespace.as_deref(), leader_lease: &args.leader_lease, since: args.since };
    for context in &contexts {
        let base = dir.join(report::directory_of(context));
        let mut collected = match client_for(&kubeconfig, Some(context)).await {
            Ok(client) => report::collect(&client, &scope).await,
            Err(e) => report::Collected { errors: vec![format!("connecting: {e:#}")], ..Default::default() },
        };
        let federation = status::gather(
            &kubeconfig,
            std::slice::from_ref(context),
            args.namespace.as_deref(),
            None,
            Duration::from_secs(30),
        )
        .await;
        collected.files.push(("status.txt".into(), status::render_table(&federation)));
        for (path, text) in &collected.files {
            write(base.join(path), text)?;
        }
        write(base.join("errors.txt"), &collected.errors.iter().map(|e| format!("{e}\n")).collect::<String>())?;
        eprintln!("{context}: {} files, {} not readable (errors.txt)", collected.files.len(), collected.errors.len());
    }
    Ok(dir)
}

async fn run_status(args: StatusArgs) -> anyhow::Result<StatusOutcome> {
    use aether_operator::cli::{load_kubeconfig, status};
    let kubeconfig = load_kubeconfig(args.kubeconfig.as_deref())?;
    let contexts = contexts_of(&kubeconfig, &args.contexts, args.all_contexts)?;
    let started = tokio::time::Instant::now();
    let deadline = args.wait.map(|wait| started + wait);
    loop {
        let federation = status::gather(
            &kubeconfig,
            &contexts,
            args.namespace.as_deref(),
            args.etcd.then_some(args.etcd_from),
            args.timeout.max(Duration::from_secs(1)),
        )
        .await;
        let problems = status::problems(&federation);
        let healthy = problems.is_empty();
        let waiting = deadline.is_some_and(|d| tokio::time::Instant::now() < d);
        if healthy || !waiting {
            match args.output {
                OutputFormat::Table => print!("{}", status::render_table(&federation)),
                OutputFormat::Json | OutputFormat::Yaml => {
                    let mut value = serde_json::to_value(&federation)?;
                    value["healthy"] = healthy.into();
                    value["problems"] = serde_json::to_value(&problems)?;
                    if args.output == OutputFormat::Json {
                        println!("{}", serde_json::to_string_pretty(&value)?);
                    } else {
                        print!("{}", serde_yaml::to_string(&value)?);
                    }
                }
            }
            let none_read = federation.regions.is_empty() && federation.unreachable.len() == contexts.len();
            return Ok(if healthy {
                StatusOutcome::Healthy
            } else if none_read {
                StatusOutcome::CouldNotCheck
            } else {
                StatusOutcome::Unhealthy
            });
        }
        let left = deadline.map_or(0, |d| d.saturating_duration_since(tokio::time::Instant::now()).as_secs());
        eprintln!(
            "waiting for the federation ({}s, {left}s left): {} problem(s), first: {}",
            started.elapsed().as_secs(),
            problems.len(),
            problems.first().map(String::as_str).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// Prints the findings; whether none failed.
async fn run_doctor(args: DoctorArgs) -> anyhow::Result<bool> {
    use aether_operator::api::RegionPeering;
    use aether_operator::cli::status::EtcdFrom;
    use aether_operator::cli::{client_for, doctor, from_leader, load_kubeconfig};
    /// How long the region's leader may take to run the checks.
    const LEADER_TIMEOUT: Duration = Duration::from_secs(60);
    let kubeconfig = load_kubeconfig(args.kubeconfig.as_deref())?;
    let client = client_for(&kubeconfig, args.context.as_deref()).await?;
    let namespace = args.namespace.clone().unwrap_or_else(|| client.default_namespace().to_string());
    let api: kube::Api<RegionPeering> = kube::Api::namespaced(client.clone(), &namespace);
    let rp = match &args.name {
        Some(name) => api.get(name).await.map_err(|e| anyhow::anyhow!("RegionPeering {namespace}/{name}: {e}"))?,
        None => {
            let mut all = api.list(&Default::default()).await?.items;
            anyhow::ensure!(
                all.len() == 1,
                "{} RegionPeerings in namespace {namespace}; name the one to check",
                all.len()
            );
            all.remove(0)
        }
    };
    let (checked_from, findings) = if args.in_cluster {
        let token = match args.token.clone() {
            Some(token) => Some(token),
            None => kubeconfig_token(&kubeconfig, args.context.as_deref()).await,
        };
        use aether_operator::cli::in_cluster::{Reach, Trust};
        let reach = match args.operator_url.clone() {
            Some(url) => Reach::Url(url),
            None => {
                Reach::Leader { port: args.metrics_port, https: !args.metrics_plain, lease: args.leader_lease.clone() }
            }
        };
        let trust = match (&args.metrics_ca, args.insecure_skip_tls_verify) {
            (Some(ca), _) => Trust::Ca { pem: std::fs::read(ca)?, server_name: args.metrics_server_name.clone() },
            (None, true) => Trust::Insecure,
            (None, false) => Trust::None,
        };
        let answer = aether_operator::cli::in_cluster::ask(&client, &rp, reach, trust, token.as_deref()).await?;
        (answer.checked_from, answer.findings)
    } else if args.from == EtcdFrom::Leader {
        let (pod, findings) = from_leader::doctor(&client, &rp, LEADER_TIMEOUT).await.map_err(anyhow::Error::msg)?;
        (format!("the region's leader, pod {pod}, with the operator's network and identity"), findings)
    } else {
        let host = std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
        let from = format!(
            "this machine{}, with your kubeconfig's identity",
            if host.is_empty() { String::new() } else { format!(" ({host})") }
        );
        let here = doctor::run(&client, &rp).await;
        let unreachable = doctor::unreachable_targets(&here);
        if args.from == EtcdFrom::Auto && !unreachable.is_empty() {
            let asked = from_leader::doctor(&client, &rp, LEADER_TIMEOUT).await;
            let leader =
                asked.as_ref().map_or_else(|_| "could not be asked".to_string(), |(pod, _)| format!("pod {pod}"));
            let from = format!("{from}; {} from the region's leader ({leader})", unreachable.join(", "));
            (from, doctor::with_leaders(here, asked))
        } else {
            (from, here)
        }
    };
    if args.output == OutputFormat::Table {
        println!(
            "checked from {checked_from}{}",
            if args.in_cluster || args.from == EtcdFrom::Leader {
                ""
            } else {
                "; --from leader checks from the region's leader's pod"
            }
        );
    }
    match args.output {
        OutputFormat::Table => print!("{}", doctor::render(&findings)),
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&findings)?),
        OutputFormat::Yaml => print!("{}", serde_yaml::to_string(&findings)?),
    }
    Ok(!findings.iter().any(|f| f.level == doctor::Level::Fail))
}

/// The bearer token of a context's user, when the kubeconfig has one.
async fn kubeconfig_token(kubeconfig: &kube::config::Kubeconfig, context: Option<&str>) -> Option<String> {
    use secrecy::ExposeSecret;
    let options = kube::config::KubeConfigOptions { context: context.map(String::from), ..Default::default() };
    let config = kube::Config::from_custom_kubeconfig(kubeconfig.clone(), &options).await.ok()?;
    config.auth_info.token.as_ref().map(|t| t.expose_secret().to_string())
}

async fn run_drain(args: DrainArgs) -> anyhow::Result<aether_operator::drain::DrainReport> {
    if let Some(problem) = aether_operator::keys::legacy_prefix_problem(&args.legacy_prefix) {
        anyhow::bail!("--legacy-prefix: {problem}");
    }
    anyhow::ensure!(
        aether_operator::keys::is_key_segment(&args.cluster),
        "--cluster {:?} cannot be a key segment (no '/', whitespace or control characters)",
        args.cluster
    );
    let mut target = aether_operator::mirror::EtcdTarget::plain(args.etcd.clone());
    if let Some(ca) = &args.cacert {
        let mut tls =
            etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(std::fs::read(ca)?));
        if let (Some(cert), Some(key)) = (&args.cert, &args.key) {
            tls = tls.identity(etcd_client::Identity::from_pem(std::fs::read(cert)?, std::fs::read(key)?));
        }
        target = target.with_tls(tls);
    }
    if let Some(user) = &args.user {
        target = target.with_user(user, std::env::var("ETCD_PASSWORD").unwrap_or_default());
    }
    let client = target.connect().await?;
    let mut settings = aether_operator::drain::DrainSettings::new(&args.region, &args.cluster);
    settings.legacy_prefix = args.legacy_prefix.clone();
    settings.dry_run = args.dry_run;
    settings.quiet_period = Duration::from_secs(args.quiet_period_seconds);
    let host = std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
    settings.holder = format!("the aether-operator drain CLI on {host} (pid {})", std::process::id());
    settings.batch_size = args.batch_size.clamp(1, 128);
    settings.rate_limit_per_second = args.rate_limit;
    let (progress, _) = tokio::sync::watch::channel(Default::default());
    let cancel = CancellationToken::new();
    let on_signal = cancel.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        on_signal.cancel();
    });
    aether_operator::drain::drain(&client, &settings, &progress, &cancel).await
}
