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
        let healthy: Vec<String> = self.probe_members().await?.into_iter().map(|m| m.endpoint).collect();
        let mut options = self.base_options();
        if let Some((user, password)) = &self.user {
            options = options.with_user(user.clone(), password.clone());
        }
        Client::connect(&healthy, Some(options)).await
    }

    /// A raw gRPC channel over the members that answer now, for the calls etcd-client cannot
    /// make (see `leases::rpc`). With `prefer_leader`, over the leader alone when a probe saw
    /// which member leads: a follower forwards every lease renewal to the leader, one at a time.
    pub async fn connect_raw(&self, prefer_leader: bool) -> Result<RawChannel, etcd_client::Error> {
        let members = self.probe_members().await?;
        let leader = members.iter().find(|m| m.leads == Some(true)).map(|m| m.endpoint.clone());
        let on_leader = prefer_leader && leader.is_some();
        let endpoints: Vec<String> = match leader {
            Some(leader) if prefer_leader => vec![leader],
            _ => members.into_iter().map(|m| m.endpoint).collect(),
        };
        let mut built = Vec::with_capacity(endpoints.len());
        for url in &endpoints {
            built.push(self.raw_endpoint(url)?);
        }
        let channel = tonic::transport::Channel::balance_list(built.into_iter());
        let token = match &self.user {
            None => None,
            Some((user, password)) => {
                let options = ConnectOptions::new().with_require_leader(true);
                let client = Client::from_channel(etcd_client::Channel::Tonic(channel.clone()), Some(options)).await?;
                let resp = client.auth_client().authenticate(user.clone(), password.clone()).await?;
                let token = resp.token().parse().map_err(|_| {
                    etcd_client::Error::InvalidArgs(
                        "the etcd answered an authentication token that is not ASCII".into(),
                    )
                })?;
                Some(token)
            }
        };
        Ok(RawChannel { channel, token, endpoints, on_leader })
    }

    /// One endpoint of a raw channel, set up as etcd-client sets up its own.
    fn raw_endpoint(&self, url: &str) -> Result<tonic::transport::Endpoint, etcd_client::Error> {
        let invalid = |e: &dyn std::fmt::Display| etcd_client::Error::InvalidArgs(format!("endpoint {url}: {e}"));
        let mut endpoint = tonic::transport::Endpoint::from_shared(url.to_string())
            .map_err(|e| invalid(&e))?
            .connect_timeout(Duration::from_secs(5))
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(true);
        if url.starts_with("https://") {
            let tls = self.tls.clone().unwrap_or_else(|| TlsOptions::new().with_webpki_roots());
            endpoint = endpoint.tls_config(tls).map_err(|e| invalid(&e))?;
        }
        Ok(endpoint)
    }

    /// Probes every member in parallel: the ones that answer and know a leader, and whether each
    /// leads (unknown when status is refused, as it is to a non-root user under auth). Fails,
    /// naming each member's problem, when none answers.
    async fn probe_members(&self) -> Result<Vec<Member>, etcd_client::Error> {
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
                    Ok(status.header().map(|h| h.member_id() == status.leader()))
                };
                match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
                    Ok(Ok(leads)) => Ok(Member { endpoint: endpoint.clone(), leads }),
                    // The member answered (with auth on, status wants a user): it serves.
                    Ok(Err(etcd_client::Error::GRpcStatus(s))) if answered(&s) => {
                        Ok(Member { endpoint: endpoint.clone(), leads: None })
                    }
                    Ok(Err(e)) => Err(format!("{endpoint}: {e}")),
                    Err(_) => Err(format!("{endpoint}: no answer in {PROBE_TIMEOUT:?}")),
                }
            }
        });
        let results = futures::future::join_all(probes).await;
        let healthy: Vec<Member> = results.iter().filter_map(|r| r.as_ref().ok().cloned()).collect();
        if healthy.is_empty() {
            let problems: Vec<String> = results.into_iter().filter_map(Result::err).collect();
            return Err(etcd_client::Error::InvalidArgs(format!("no member answers: {}", problems.join("; "))));
        }
        Ok(healthy)
    }
}

/// A member that answered a probe.
#[derive(Clone, Debug)]
struct Member {
    endpoint: String,
    /// Whether it leads its cluster (None: status was refused).
    leads: Option<bool>,
}

/// A gRPC channel to an etcd, with its credentials, for calls made without etcd-client.
#[derive(Clone)]
pub struct RawChannel {
    pub channel: tonic::transport::Channel,
    /// The auth token every call carries when the etcd has auth on.
    pub token: Option<tonic::metadata::AsciiMetadataValue>,
    /// The members it balances over.
    pub endpoints: Vec<String>,
    /// It goes to the member that led when it was opened.
    pub on_leader: bool,
}

impl RawChannel {
    /// A request carrying the token and, as every call of the mirror does, `hasleader`: a member
    /// cut off from its quorum refuses instead of hanging.
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if let Some(token) = &self.token {
            request.metadata_mut().insert("token", token.clone());
        }
        request.metadata_mut().insert("hasleader", tonic::metadata::AsciiMetadataValue::from_static("true"));
        request
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
