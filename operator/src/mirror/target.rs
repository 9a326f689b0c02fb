//! How to reach one etcd cluster, and connecting to it in a way that survives a member being
//! down: every endpoint is probed first, and the client is built over the members that answer and
//! know a leader. etcd-client balances over all endpoints it is given and keeps a dead member in
//! rotation, so a share of requests would fail for as long as that member stays down.
use super::problem::{Classified, Connection, Problem, classify, served};
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
    /// Where the TLS material and the password come from, as a person finds them ("Secret
    /// ns/name"): failures name it.
    pub credentials: Option<String>,
    /// The client certificate's notAfter (seconds since the epoch), when one is given.
    pub client_cert_not_after: Option<i64>,
}

impl std::fmt::Debug for EtcdTarget {
    // Credentials: never print them.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTarget")
            .field("endpoints", &self.endpoints)
            .field("tls", &self.tls.is_some())
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .field("credentials", &self.credentials)
            .finish()
    }
}

impl EtcdTarget {
    pub fn plain(endpoints: impl IntoIterator<Item = impl Into<String>>) -> Self {
        EtcdTarget {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            tls: None,
            user: None,
            credentials: None,
            client_cert_not_after: None,
        }
    }

    /// Says where the credentials come from, for the messages of failures.
    pub fn with_credentials_from(mut self, source: impl Into<String>) -> Self {
        self.credentials = Some(source.into());
        self
    }

    /// Remembers when the client certificate (PEM) given in the TLS options expires.
    pub fn with_client_certificate(mut self, pem: &[u8]) -> Self {
        self.client_cert_not_after = super::problem::certificate_not_after(pem);
        self
    }

    /// What a failure's classification knows of this target (for `endpoint`, or all of them).
    pub fn connection(&self, endpoint: Option<&str>) -> Connection {
        Connection {
            endpoint: endpoint.map_or_else(|| self.endpoints.join(","), str::to_string),
            credentials: self.credentials.clone(),
            tls: self.tls.is_some() || self.endpoints.iter().any(|e| e.starts_with("https://")),
            client_cert_not_after: self.client_cert_not_after,
            user: self.user.as_ref().map(|(u, _)| u.clone()),
        }
    }

    /// Classifies a failure talking to this target, now.
    pub fn classify(&self, error: &(dyn std::error::Error + 'static), endpoint: Option<&str>) -> Classified {
        classify(error, &self.connection(endpoint), now_seconds())
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
            // Pings only while a call is open: etcd closes a connection pinged with none open
            // (the third such ping, "too_many_pings"), cutting the call that crosses it.
            .with_keep_alive_while_idle(false)
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
    pub async fn connect(&self) -> Result<Client, ConnectError> {
        let healthy: Vec<String> = self.probe_members().await?.into_iter().map(|m| m.endpoint).collect();
        self.connect_members(&healthy).await
    }

    /// `n` clients, each over its own connections to the members that answer now (probed once):
    /// requests spread over them are not held to one connection's flow-control window.
    /// Those that connected are kept when others fail; it fails only when none did.
    pub async fn connect_many(&self, n: usize) -> Result<Vec<Client>, ConnectError> {
        let healthy: Vec<String> = self.probe_members().await?.into_iter().map(|m| m.endpoint).collect();
        let attempts = futures::future::join_all((0..n).map(|_| self.connect_members(&healthy))).await;
        let mut first_error = None;
        let clients: Vec<Client> =
            attempts.into_iter().filter_map(|a| a.map_err(|e| first_error.get_or_insert(e).clone()).ok()).collect();
        match (clients.is_empty(), first_error) {
            (true, Some(e)) => Err(e),
            _ => Ok(clients),
        }
    }

    async fn connect_members(&self, members: &[String]) -> Result<Client, ConnectError> {
        let mut options = self.base_options();
        if let Some((user, password)) = &self.user {
            options = options.with_user(user.clone(), password.clone());
        }
        Client::connect(members, Some(options)).await.map_err(|e| self.failed(&e, None))
    }

    /// A connection error of one classified failure.
    fn failed(&self, error: &(dyn std::error::Error + 'static), endpoint: Option<&str>) -> ConnectError {
        ConnectError { problems: vec![self.classify(error, endpoint)] }
    }

    /// A raw gRPC channel over the members that answer now, for the calls etcd-client cannot
    /// make (see `leases::rpc`). With `prefer_leader`, over the leader alone when a probe saw
    /// which member leads: a follower forwards every lease renewal to the leader, one at a time.
    pub async fn connect_raw(&self, prefer_leader: bool) -> Result<RawChannel, ConnectError> {
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
                let authenticated = async {
                    let client =
                        Client::from_channel(etcd_client::Channel::Tonic(channel.clone()), Some(options)).await?;
                    let resp = client.auth_client().authenticate(user.clone(), password.clone()).await?;
                    resp.token().parse().map_err(|_| {
                        etcd_client::Error::InvalidArgs(
                            "the etcd answered an authentication token that is not ASCII".into(),
                        )
                    })
                };
                Some(authenticated.await.map_err(|e| self.failed(&e, None))?)
            }
        };
        Ok(RawChannel { channel, token, endpoints, on_leader })
    }

    /// One endpoint of a raw channel, set up as etcd-client sets up its own.
    fn raw_endpoint(&self, url: &str) -> Result<tonic::transport::Endpoint, ConnectError> {
        let invalid = |e: &dyn std::fmt::Display| ConnectError {
            problems: vec![Classified { problem: Problem::Other, message: format!("endpoint {url}: {e}") }],
        };
        let mut endpoint = tonic::transport::Endpoint::from_shared(url.to_string())
            .map_err(|e| invalid(&e))?
            .connect_timeout(Duration::from_secs(5))
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(false); // as in `base_options`
        if url.starts_with("https://") {
            let tls = self.tls.clone().unwrap_or_else(|| TlsOptions::new().with_webpki_roots());
            endpoint = endpoint.tls_config(tls).map_err(|e| invalid(&e))?;
        }
        Ok(endpoint)
    }

    /// Probes every member in parallel: the ones that answer and know a leader, and whether each
    /// leads (unknown when status is refused, as it is to a non-root user under auth). Fails,
    /// naming each member's problem, when none answers.
    async fn probe_members(&self) -> Result<Vec<Member>, ConnectError> {
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
                    // The member answered (with auth on, status wants a user): it serves. A
                    // cancelled call (a connection ended after TLS) is no answer.
                    Ok(Err(etcd_client::Error::GRpcStatus(s))) if served(&s) => {
                        Ok(Member { endpoint: endpoint.clone(), leads: None })
                    }
                    Ok(Err(e)) => Err(self.classify(&e, Some(endpoint))),
                    Err(_) => Err(self.classify(&NoAnswer(PROBE_TIMEOUT), Some(endpoint))),
                }
            }
        });
        let results = futures::future::join_all(probes).await;
        let healthy: Vec<Member> = results.iter().filter_map(|r| r.as_ref().ok().cloned()).collect();
        if healthy.is_empty() {
            return Err(ConnectError { problems: results.into_iter().filter_map(Result::err).collect() });
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

/// No member of an etcd could be used: each one's classified failure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectError {
    pub problems: Vec<Classified>,
}

impl ConnectError {
    /// The failure to report: the first member's (they are alike more often than not).
    pub fn classified(&self) -> Classified {
        self.problems
            .first()
            .cloned()
            .unwrap_or(Classified { problem: Problem::Other, message: "no endpoint to connect to".into() })
    }
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let messages: Vec<String> =
            self.problems.iter().map(|p| format!("{} ({})", p.message, p.problem.reason())).collect();
        write!(f, "no member of the etcd can be used: {}", messages.join("; "))
    }
}

impl std::error::Error for ConnectError {}

/// A probe that got no answer in time.
#[derive(Debug)]
struct NoAnswer(Duration);

impl std::fmt::Display for NoAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "no answer in {:?}", self.0)
    }
}

impl std::error::Error for NoAnswer {}

fn now_seconds() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
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
