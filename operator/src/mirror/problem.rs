//! What went wrong talking to an etcd, in terms a person can act on, without IO. Every failure is
//! classified once, here, from the error chain and what the mirror knows of the connection
//! (whether it sent a client certificate, when that expires, which Secret the credentials came
//! from): the class is a condition reason, the message names the endpoint and the Secret and says
//! what to do. No Debug dump reaches a person.
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use std::error::Error as StdError;

/// A class of failure, each with its own remedy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Problem {
    /// Nothing answers at the endpoint: refused, timed out, not resolvable, no leader.
    Unreachable,
    /// One side does not trust the other's certificate.
    TlsUntrusted,
    /// A certificate has expired (the client's, or the etcd's).
    CertificateExpired,
    /// The etcd wants a client certificate and none was given.
    ClientCertificateRequired,
    /// Wrong username or password.
    AuthenticationFailed,
    /// The user may not do this.
    PermissionDenied,
    /// The etcd's space quota is exhausted (the NOSPACE alarm).
    NoSpace,
    /// Anything else.
    Other,
}

impl Problem {
    /// The condition reason.
    pub fn reason(self) -> &'static str {
        match self {
            Problem::Unreachable => "Unreachable",
            Problem::TlsUntrusted => "TLSUntrusted",
            Problem::CertificateExpired => "CertificateExpired",
            Problem::ClientCertificateRequired => "ClientCertificateRequired",
            Problem::AuthenticationFailed => "AuthenticationFailed",
            Problem::PermissionDenied => "PermissionDenied",
            Problem::NoSpace => "NoSpace",
            Problem::Other => "EtcdError",
        }
    }
}

/// What the mirror knows of the connection that failed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Connection {
    /// The endpoint (or endpoints) it talked to.
    pub endpoint: String,
    /// Where the credentials come from, as a person finds them ("Secret ns/name").
    pub credentials: Option<String>,
    pub tls: bool,
    /// The client certificate's notAfter (seconds since the epoch), when one was given.
    pub client_cert_not_after: Option<i64>,
    pub user: Option<String>,
}

/// A classified failure: its class and a message that names where and says what to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Classified {
    pub problem: Problem,
    pub message: String,
}

/// The notAfter of the first certificate of a PEM bundle, in seconds since the epoch.
pub fn certificate_not_after(pem: &[u8]) -> Option<i64> {
    let der = CertificateDer::pem_slice_iter(pem).next()?.ok()?;
    not_after(&der)
}

/// The notAfter of a DER certificate, in seconds since the epoch (pure; None when it cannot be
/// read).
pub fn not_after(der: &[u8]) -> Option<i64> {
    // (tag, contents, rest) of one DER element.
    fn element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
        let (&tag, rest) = input.split_first()?;
        let (&first, rest) = rest.split_first()?;
        let (len, rest) = if first < 0x80 {
            (first as usize, rest)
        } else {
            let n = (first & 0x7f) as usize;
            if n == 0 || n > 4 || rest.len() < n {
                return None;
            }
            (rest[..n].iter().fold(0usize, |acc, b| (acc << 8) | *b as usize), &rest[n..])
        };
        (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
    }
    let (_, certificate, _) = element(der)?;
    let (_, tbs, _) = element(certificate)?;
    let mut rest = tbs;
    let (tag, _, after) = element(rest)?;
    if tag == 0xa0 {
        rest = after; // the explicit version
    }
    for _ in 0..3 {
        rest = element(rest)?.2; // serial, signature algorithm, issuer
    }
    let (_, validity, _) = element(rest)?;
    let (_, after_not_before) = element(validity).map(|(_, _, r)| ((), r))?;
    let (tag, time, _) = element(after_not_before)?;
    let text = std::str::from_utf8(time).ok()?;
    let digits = |s: &str| s.parse::<i64>().ok();
    let (year, rest) = match tag {
        0x17 => {
            let yy = digits(text.get(0..2)?)?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, text.get(2..)?)
        }
        0x18 => (digits(text.get(0..4)?)?, text.get(4..)?),
        _ => return None,
    };
    let field = |i: usize| rest.get(i..i + 2).and_then(digits);
    let (month, day, hour, minute, second) = (field(0)?, field(2)?, field(4)?, field(6)?, field(8)?);
    Some(days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn date(seconds: i64) -> String {
    k8s_openapi::jiff::Timestamp::from_second(seconds)
        .map(|t| t.strftime("%Y-%m-%d").to_string())
        .unwrap_or_else(|_| seconds.to_string())
}

/// What the error chain says, gathered from each link.
#[derive(Default)]
struct Symptoms {
    codes: Vec<tonic::Code>,
    text: String,
    untrusted_server: Option<String>,
    server_cert_expired: bool,
    alert: Option<String>,
    unreachable: bool,
}

fn symptoms(error: &(dyn StdError + 'static)) -> Symptoms {
    let mut s = Symptoms::default();
    let mut link: Option<&(dyn StdError + 'static)> = Some(error);
    while let Some(e) = link {
        s.text.push_str(&e.to_string().to_lowercase());
        s.text.push(' ');
        if let Some(status) = e.downcast_ref::<tonic::Status>() {
            s.codes.push(status.code());
            s.text.push_str(&status.message().to_lowercase());
            s.text.push(' ');
        }
        if let Some(etcd_client::Error::GRpcStatus(status)) = e.downcast_ref::<etcd_client::Error>() {
            s.codes.push(status.code());
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            s.unreachable |= matches!(
                io.kind(),
                ConnectionRefused | TimedOut | HostUnreachable | NetworkUnreachable | AddrNotAvailable
            );
            if let Some(inner) = io.get_ref() {
                rustls_symptoms(inner, &mut s);
            }
        }
        rustls_symptoms(e, &mut s);
        link = e.source();
    }
    // tonic's connector error does not expose its source: read rustls's own words then.
    if s.untrusted_server.is_none()
        && !s.server_cert_expired
        && let Some(at) = s.text.find("invalid peer certificate: ")
    {
        let why =
            s.text[at + "invalid peer certificate: ".len()..].split([' ', ',', ')', '"']).next().unwrap_or_default();
        if why.contains("expired") {
            s.server_cert_expired = true;
        } else {
            s.untrusted_server = Some(why.to_string());
        }
    }
    if s.alert.is_none()
        && let Some(at) = s.text.find("received fatal alert: ")
    {
        let alert =
            s.text[at + "received fatal alert: ".len()..].split([' ', ',', ')', '"']).next().unwrap_or_default();
        s.alert = Some(match alert {
            "certificaterequired" => "certificate required".into(),
            "certificateexpired" => "certificate expired".into(),
            "badcertificate" | "unknownca" | "unsupportedcertificate" => "bad certificate".into(),
            other => other.to_string(),
        });
    }
    s
}

fn rustls_symptoms(e: &(dyn StdError + 'static), s: &mut Symptoms) {
    use tokio_rustls::rustls::{AlertDescription, CertificateError, Error as Tls};
    match e.downcast_ref::<Tls>() {
        Some(Tls::InvalidCertificate(CertificateError::Expired | CertificateError::ExpiredContext { .. })) => {
            s.server_cert_expired = true
        }
        Some(Tls::InvalidCertificate(other)) => s.untrusted_server = Some(format!("{other:?}")),
        Some(Tls::AlertReceived(alert)) => {
            s.alert = Some(match alert {
                AlertDescription::CertificateRequired => "certificate required".into(),
                AlertDescription::CertificateExpired => "certificate expired".into(),
                AlertDescription::BadCertificate
                | AlertDescription::UnknownCA
                | AlertDescription::UnsupportedCertificate => "bad certificate".into(),
                other => format!("{other:?}").to_lowercase(),
            })
        }
        _ => {}
    }
}

/// A certificate or TLS problem of `connection`, if that is what failed.
fn certificate_problem(s: &Symptoms, connection: &Connection, now: i64) -> Option<Classified> {
    let at = &connection.endpoint;
    let secret = connection.credentials.as_deref().unwrap_or("the connection (it names no Secret)");
    let expired_client = connection.client_cert_not_after.filter(|t| *t <= now);
    let has = |needle: &str| s.text.contains(needle);
    let code = |c: tonic::Code| s.codes.contains(&c);
    let classified = |problem, message: String| Some(Classified { problem, message });

    if let Some(expired) = expired_client {
        return classified(
            Problem::CertificateExpired,
            format!("{at}: the client certificate (tls.crt of {secret}) expired on {}: renew it", date(expired)),
        );
    }
    if s.server_cert_expired || has("certificate expired") && s.alert.is_none() {
        return classified(
            Problem::CertificateExpired,
            format!("{at}: the etcd's serving certificate has expired: renew it on the etcd"),
        );
    }
    if let Some(why) = &s.untrusted_server {
        return classified(
            Problem::TlsUntrusted,
            format!(
                "{at}: the etcd's certificate is not trusted by ca.crt of {secret} ({why}): put the CA that signed the etcd's serving certificate in ca.crt"
            ),
        );
    }
    // The etcd ended the connection right after TLS (or said why): it refused the client's side.
    let closed_after_tls = connection.tls
        && (s.alert.is_some()
            || code(tonic::Code::Cancelled)
            || has("connection closed")
            || has("broken pipe")
            || has("connection reset"));
    if closed_after_tls {
        let no_client_cert = connection.client_cert_not_after.is_none();
        if s.alert.as_deref() == Some("certificate required") || (no_client_cert && s.alert.is_none()) {
            return classified(
                Problem::ClientCertificateRequired,
                format!(
                    "{at}: the etcd requires a client certificate (--client-cert-auth) and {secret} gives none: add tls.crt and tls.key"
                ),
            );
        }
        if s.alert.as_deref() == Some("certificate expired") {
            return classified(
                Problem::CertificateExpired,
                format!("{at}: the etcd says the client certificate (tls.crt of {secret}) has expired: renew it"),
            );
        }
        return classified(
            Problem::TlsUntrusted,
            format!(
                "{at}: the etcd refused the client certificate (tls.crt of {secret}): it must be signed by the CA the etcd trusts (--trusted-ca-file)"
            ),
        );
    }
    None
}

/// Classifies a failure of `connection`, at `now` (seconds since the epoch).
pub fn classify(error: &(dyn StdError + 'static), connection: &Connection, now: i64) -> Classified {
    let s = symptoms(error);
    if let Some(tls) = certificate_problem(&s, connection, now) {
        return tls;
    }
    let at = &connection.endpoint;
    let secret = connection.credentials.as_deref().unwrap_or("the connection (it names no Secret)");
    let has = |needle: &str| s.text.contains(needle);
    let code = |c: tonic::Code| s.codes.contains(&c);
    let classified = |problem, message: String| Classified { problem, message };
    if has("authentication failed")
        || has("invalid user id or password")
        || has("invalid auth token")
        || code(tonic::Code::Unauthenticated)
    {
        let user = connection.user.as_deref().unwrap_or("(none)");
        return classified(
            Problem::AuthenticationFailed,
            format!("{at}: the etcd refused user {user} (username and password of {secret}): correct them"),
        );
    }
    if has("permission denied") || code(tonic::Code::PermissionDenied) {
        let user = connection.user.as_deref().unwrap_or("the client certificate's common name");
        return classified(
            Problem::PermissionDenied,
            format!(
                "{at}: user {user} may not do this: grant it read-write on its region's subtree and bookkeeping (hack/etcd-mirror-role.sh)"
            ),
        );
    }
    if has("database space exceeded") || has("nospace") {
        return classified(
            Problem::NoSpace,
            format!(
                "{at}: the etcd's space quota is exhausted (NOSPACE alarm): compact and defragment it, then disarm the alarm, or raise --quota-backend-bytes"
            ),
        );
    }
    if s.unreachable
        || code(tonic::Code::Unavailable)
        || code(tonic::Code::DeadlineExceeded)
        || has("tcp connect error")
        || has("dns error")
        || has("no answer in")
        || has("timed out")
        || has("no leader")
    {
        let what = if has("no leader") {
            "the member has no leader (it is cut off from its cluster's quorum)"
        } else if has("connection refused") {
            "nothing listens there (connection refused)"
        } else if has("dns error") || has("failed to lookup") {
            "the name does not resolve"
        } else {
            "no answer in time"
        };
        return classified(
            Problem::Unreachable,
            format!("{at}: {what}: check the endpoint and the network path from the operator's pod to it"),
        );
    }
    classified(Problem::Other, format!("{at}: {}", plain(error)))
}

/// An error chain as a person reads it: each link's own words, a gRPC status as its message, no
/// Debug dump of the transport underneath.
pub fn plain(error: &(dyn StdError + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut link: Option<&(dyn StdError + 'static)> = Some(error);
    while let Some(e) = link {
        let words = match (e.downcast_ref::<etcd_client::Error>(), e.downcast_ref::<tonic::Status>()) {
            (Some(etcd_client::Error::GRpcStatus(s)), _) | (_, Some(s)) => Some(s.message().to_string()),
            (Some(etcd_client::Error::TransportError(t)), _) => Some(t.to_string()),
            (Some(other), _) => Some(other.to_string()),
            _ => None,
        };
        let stop = words.is_some();
        let words = words.unwrap_or_else(|| e.to_string());
        if !words.is_empty() && !parts.iter().any(|p| p.contains(&words)) {
            parts.push(words);
        }
        if stop {
            break;
        }
        link = e.source();
    }
    parts.join(": ")
}

/// Whether a gRPC error came from a member that is up and serving (as opposed to one that is
/// down, cut off, without a leader, or that ended the connection): the codes a serving etcd
/// answers with.
pub fn served(status: &tonic::Status) -> bool {
    use tonic::Code::*;
    matches!(
        status.code(),
        InvalidArgument | Unauthenticated | PermissionDenied | FailedPrecondition | NotFound | OutOfRange
    ) && !status.message().contains("no leader")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tls_connection() -> Connection {
        Connection {
            endpoint: "https://etcd-0:2379".into(),
            credentials: Some("Secret aether-system/b-etcd".into()),
            tls: true,
            client_cert_not_after: Some(4_000_000_000),
            user: Some("mirror-a".into()),
        }
    }

    fn status(code: tonic::Code, message: &str) -> etcd_client::Error {
        etcd_client::Error::GRpcStatus(tonic::Status::new(code, message))
    }

    #[test]
    fn each_failure_gets_its_class_and_names_the_endpoint_and_the_secret() {
        let now = 1_800_000_000;
        let c = tls_connection();
        let cases = [
            (
                status(tonic::Code::InvalidArgument, "etcdserver: authentication failed, invalid user ID or password"),
                Problem::AuthenticationFailed,
            ),
            (status(tonic::Code::PermissionDenied, "etcdserver: permission denied"), Problem::PermissionDenied),
            (status(tonic::Code::ResourceExhausted, "etcdserver: mvcc: database space exceeded"), Problem::NoSpace),
            (status(tonic::Code::Unavailable, "tcp connect error"), Problem::Unreachable),
            (status(tonic::Code::Cancelled, "operation was canceled"), Problem::TlsUntrusted),
        ];
        for (error, problem) in cases {
            let got = classify(&error, &c, now);
            assert_eq!(got.problem, problem, "{error}: {got:?}");
            assert!(got.message.contains("https://etcd-0:2379"), "{got:?}");
            assert!(!got.message.contains("Status {"), "no Debug dump: {got:?}");
        }
        let auth = classify(&cases_auth(), &c, now);
        assert!(auth.message.contains("Secret aether-system/b-etcd") && auth.message.contains("mirror-a"), "{auth:?}");
    }

    fn cases_auth() -> etcd_client::Error {
        status(tonic::Code::InvalidArgument, "etcdserver: authentication failed, invalid user ID or password")
    }

    #[test]
    fn rustls_words_say_which_side_of_tls_failed() {
        let c = tls_connection();
        let untrusted = status(tonic::Code::Unavailable, "invalid peer certificate: BadSignature");
        let got = classify(&untrusted, &c, 0);
        assert_eq!(got.problem, Problem::TlsUntrusted, "{got:?}");
        assert!(got.message.contains("(badsignature)") && got.message.contains("ca.crt of Secret"), "{got:?}");
        let expired = status(tonic::Code::Unavailable, "invalid peer certificate: Expired");
        assert_eq!(classify(&expired, &c, 0).problem, Problem::CertificateExpired);
        let required = status(tonic::Code::Unknown, "received fatal alert: CertificateRequired");
        assert_eq!(classify(&required, &c, 0).problem, Problem::ClientCertificateRequired);
    }

    #[test]
    fn a_connection_ended_after_tls_is_the_client_certificate() {
        let now = 1_800_000_000;
        let closed = status(tonic::Code::Cancelled, "operation was canceled");
        let none = Connection { client_cert_not_after: None, ..tls_connection() };
        assert_eq!(classify(&closed, &none, now).problem, Problem::ClientCertificateRequired);
        let expired = Connection { client_cert_not_after: Some(now - 86_400), ..tls_connection() };
        let got = classify(&closed, &expired, now);
        assert_eq!(got.problem, Problem::CertificateExpired);
        assert!(got.message.contains("expired on 2027-01-14"), "{got:?}");
        assert_eq!(classify(&closed, &tls_connection(), now).problem, Problem::TlsUntrusted, "a valid one it refused");
        // Without TLS, a cancelled call is nothing of the sort.
        let plain = Connection { tls: false, client_cert_not_after: None, ..tls_connection() };
        assert_eq!(classify(&closed, &plain, now).problem, Problem::Other);
    }

    #[test]
    fn other_failures_read_as_their_words_without_a_debug_dump() {
        let error = anyhow::Error::new(status(tonic::Code::Internal, "etcdserver: something odd")).context("peer txn");
        let got = classify(error.as_ref(), &tls_connection(), 0);
        assert_eq!(got.problem, Problem::Other);
        assert_eq!(got.message, "https://etcd-0:2379: peer txn: etcdserver: something odd");
    }

    #[test]
    fn only_the_codes_a_serving_etcd_answers_with_count_as_an_answer() {
        assert!(served(&tonic::Status::invalid_argument("etcdserver: user name is empty")));
        assert!(!served(&tonic::Status::cancelled("operation was canceled")));
        assert!(!served(&tonic::Status::unavailable("tcp connect error")));
        assert!(!served(&tonic::Status::unknown("transport error")));
        assert!(!served(&tonic::Status::failed_precondition("etcdserver: no leader")));
    }

    #[test]
    fn not_after_reads_utc_and_generalized_times() {
        // 2021-01-01T00:00:00Z
        assert_eq!(days_from_civil(2021, 1, 1) * 86_400, 1_609_459_200);
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(date(1_609_459_200), "2021-01-01");
    }
}
