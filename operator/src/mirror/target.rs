//! How to reach one etcd cluster, and connecting to it in a way that survives a member being
//! down: every endpoint is probed first, and the client is built over the members that answer and
//! know a leader. etcd-client balances over all endpoints it is given and keeps a dead member in
//! rotation, so a share of requests would fail for as long as that member stays down.
use etcd_client::{Client, ConnectOptions, KvClient, TlsOptions, WatchClient};
use std::time::Duration;

/// The largest response the mirror decodes. Pages are sized to stay well under it (see
/// `plan::next_page_limit`); one value alone may be as large as the origin's request limit.
pub const MAX_DECODE_BYTES: usize = 256 << 20;

/// How long a member may take to answer the probe before it is left out.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// How to reach one etcd: endpoints, TLS, credentials.
#[derive(Clone)]
pub struct EtcdTarget {
    pub endpoints: Vec<String>,
    /// TLS for `https://` endpoints; without it they are verified against the public web roots.
    pub tls: Option<TlsOptions>,
    /// User and password, if the etcd has auth on (a client certificate's CN also names a user).
    pub user: Option<(String, String)>,
}

impl std::fmt::Debug for EtcdTarget {
    // Credentials: never print them.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTarget")
            .field("endpoints", &self.endpoints)
            .field("tls", &self.tls.is_some())
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .finish()
    }
}

impl EtcdTarget {
    pub fn plain(endpoints: impl IntoIterator<Item = impl Into<String>>) -> Self {
        EtcdTarget { endpoints: endpoints.into_iter().map(Into::into).collect(), tls: None, user: None }
    }

    pub fn with_tls(mut self, tls: TlsOptions) -> Self {
        self.tls = Some(tls);
        self
    }

    pub fn with_user(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.user = Some((user.into(), password.into()));
        self
    }

    /// Options without the user: probing a member needs no Authenticate (a bcrypt check on the
    /// server for every call).
    fn base_options(&self) -> ConnectOptions {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(5))
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
            .with_keep_alive_while_idle(true)
            // A member cut off from its quorum refuses instead of serving stale reads or hanging.
            .with_require_leader(true);
        let https = self.endpoints.iter().any(|e| e.starts_with("https://"));
        match &self.tls {
            Some(tls) => options = options.with_tls(tls.clone()),
            None if https => options = options.with_tls(TlsOptions::new().with_webpki_roots()),
            None => {}
        }
        options
    }

    /// Connects over the members that answer now and know a leader. Fails, naming each member's
    /// problem, when none does.
    pub async fn connect(&self) -> Result<Client, etcd_client::Error> {
        let base = self.base_options();
        let probes = self.endpoints.iter().map(|endpoint| {
            let options = base.clone();
            async move {
                let probe = async {
                    let mut client = Client::connect([endpoint], Some(options)).await?;
                    let status = client.status().await?;
                    if status.leader() == 0 {
                        return Err(etcd_client::Error::InvalidArgs("the member has no leader".into()));
                    }
                    Ok(())
                };
                match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
                    Ok(Ok(())) => Ok(endpoint.clone()),
                    // The member answered (with auth on, status wants a user): it serves.
                    Ok(Err(etcd_client::Error::GRpcStatus(s))) if answered(&s) => Ok(endpoint.clone()),
                    Ok(Err(e)) => Err(format!("{endpoint}: {e}")),
                    Err(_) => Err(format!("{endpoint}: no answer in {PROBE_TIMEOUT:?}")),
                }
            }
        });
        let results = futures::future::join_all(probes).await;
        let healthy: Vec<String> = results.iter().filter_map(|r| r.as_ref().ok().cloned()).collect();
        if healthy.is_empty() {
            let problems: Vec<String> = results.into_iter().filter_map(Result::err).collect();
            return Err(etcd_client::Error::InvalidArgs(format!("no member answers: {}", problems.join("; "))));
        }
        let mut options = base;
        if let Some((user, password)) = &self.user {
            options = options.with_user(user.clone(), password.clone());
        }
        Client::connect(&healthy, Some(options)).await
    }
}

/// Whether a gRPC error came from a member that is up and has a leader (as opposed to one that
/// is down, cut off or without a leader).
fn answered(status: &tonic::Status) -> bool {
    !matches!(status.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown)
        && !status.message().contains("no leader")
}

/// A KV client that decodes responses up to [`MAX_DECODE_BYTES`] (the default is 4 MiB, which a
/// page of large values or one value near etcd's request limit can exceed).
pub fn kv(client: &Client) -> KvClient {
    client.kv_client().max_decoding_message_size(MAX_DECODE_BYTES)
}

/// A watch client with the same decode limit.
pub fn watcher(client: &Client) -> WatchClient {
    client.watch_client().max_decoding_message_size(MAX_DECODE_BYTES)
}
