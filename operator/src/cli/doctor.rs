//! `aether-operator doctor`: one RegionPeering's credentials checked against each etcd it names,
//! each finding with what to do about it.
use crate::api::{EtcdConnection, RegionPeering};
use crate::controllers::region_peering::resolve_connection;
use crate::keys;
use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Finding {
    /// "local etcd" or "peer <region>".
    pub target: String,
    pub check: String,
    pub level: Level,
    pub detail: String,
    /// What to do, when something is wrong.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
}

/// What to do about an etcd no member of which answers from where the checks ran.
pub const UNREACHABLE: &str =
    "check the endpoints and the network path (the region's leader checks from its pod: --from leader)";

/// The targets ("local etcd", "peer b") that could not be reached from where the checks ran (pure).
pub fn unreachable_targets(findings: &[Finding]) -> Vec<String> {
    findings
        .iter()
        .filter(|f| f.check == "connect" && f.level == Level::Fail && f.action.as_deref() == Some(UNREACHABLE))
        .map(|f| f.target.clone())
        .collect()
}

/// The findings after asking the region's leader about the targets unreachable from here (pure):
/// each such target's findings are the leader's, saying so; when the leader could not be asked,
/// a finding says why beside what was found here.
pub fn with_leaders(here: Vec<Finding>, asked: Result<(String, Vec<Finding>), String>) -> Vec<Finding> {
    let unreachable = unreachable_targets(&here);
    match asked {
        Err(why) => {
            let mut out = here;
            out.push(Finding {
                target: "region's leader".into(),
                check: "checks from its pod".into(),
                level: Level::Warn,
                detail: format!("could not ask it about {}: {why}", unreachable.join(", ")),
                action: Some(
                    "give --from here to skip it; asking runs this executable in the leader's container (pods/exec)"
                        .into(),
                ),
            });
            out
        }
        Ok((pod, theirs)) => {
            let mut out: Vec<Finding> = here.into_iter().filter(|f| !unreachable.contains(&f.target)).collect();
            for target in &unreachable {
                out.extend(
                    theirs.iter().filter(|f| &f.target == target).cloned().map(|f| Finding {
                        detail: format!("{} (checked from the leader's pod {pod})", f.detail),
                        ..f
                    }),
                );
            }
            out
        }
    }
}

/// Certificates closer to expiry than this are reported.
const EXPIRY_WARNING: Duration = Duration::from_secs(30 * 24 * 3600);
/// A clock further off than this is reported: the lag and lease arithmetic reads the peer's time.
const SKEW_WARNING: Duration = Duration::from_secs(2);

pub use crate::mirror::problem::not_after;

/// What a certificate's expiry means for the mirror (pure).
pub fn expiry_finding(target: &str, what: &str, not_after: i64, now: i64) -> Finding {
    let left = not_after - now;
    let (level, detail, action) = if left <= 0 {
        (
            Level::Fail,
            format!("{what} expired {} days ago", -left / 86_400),
            Some(format!("renew {what} and update the Secret")),
        )
    } else if left < EXPIRY_WARNING.as_secs() as i64 {
        (
            Level::Warn,
            format!("{what} expires in {} days", left / 86_400),
            Some(format!("renew {what} before it expires")),
        )
    } else {
        (Level::Ok, format!("{what} valid for {} more days", left / 86_400), None)
    };
    Finding { target: target.into(), check: "certificate".into(), level, detail, action }
}

/// The lease layout that suits what the permission probes found (pure). Under auth, etcd checks
/// for every put attached to a lease that a non-root writer may write every key already on it,
/// so large shards cost writes linear in their size.
pub fn lease_layout_finding(target: &str, auth_enforced: bool, root: bool, max_keys_per_lease: i64) -> Finding {
    let check = "lease layout".to_string();
    if auth_enforced && !root && max_keys_per_lease > 250 {
        Finding {
            target: target.into(),
            check,
            level: Level::Warn,
            detail: format!(
                "auth is on and the user is not root: etcd checks every key of a lease at each put on it, so {max_keys_per_lease} keys per lease make writes slow"
            ),
            action: Some("set spec.lease.maxKeysPerLease to 100-250".into()),
        }
    } else {
        Finding {
            target: target.into(),
            check,
            level: Level::Ok,
            detail: format!("{max_keys_per_lease} keys per lease suits this auth mode"),
            action: None,
        }
    }
}

/// The skew between this machine's clock and an etcd member's (pure).
pub fn skew_finding(target: &str, skew_seconds: i64) -> Finding {
    let level = if skew_seconds.unsigned_abs() > SKEW_WARNING.as_secs() { Level::Warn } else { Level::Ok };
    Finding {
        target: target.into(),
        check: "clock".into(),
        level,
        detail: format!("the member's clock is {skew_seconds:+} s from this machine's"),
        action: (level == Level::Warn).then(|| "check NTP on the etcd members and on the operator's nodes".into()),
    }
}

pub fn render(findings: &[Finding]) -> String {
    let mut out = String::new();
    for f in findings {
        let mark = match f.level {
            Level::Ok => "ok  ",
            Level::Warn => "WARN",
            Level::Fail => "FAIL",
        };
        let _ = writeln!(out, "{mark} {:<12} {:<14} {}", f.target, f.check, f.detail);
        if let Some(action) = &f.action {
            let _ = writeln!(out, "     -> {action}");
        }
    }
    out
}

fn finding(target: &str, check: &str, level: Level, detail: impl Into<String>, action: Option<&str>) -> Finding {
    Finding {
        target: target.into(),
        check: check.into(),
        level,
        detail: detail.into(),
        action: action.map(String::from),
    }
}

/// Runs every check of one RegionPeering.
pub async fn run(client: &kube::Client, rp: &RegionPeering) -> Vec<Finding> {
    let namespace = kube::ResourceExt::namespace(rp).unwrap_or_default();
    let mut findings = Vec::new();
    let origin = rp.spec.region.clone();
    let mut targets = vec![("local etcd".to_string(), rp.spec.local_etcd.clone(), None)];
    for peer in &rp.spec.peers {
        targets.push((format!("peer {}", peer.region), peer.connection(), Some(peer.region.clone())));
    }
    for (name, connection, peer_region) in targets {
        findings.extend(check_etcd(client, &namespace, &name, &connection, &origin, peer_region.as_deref(), rp).await);
    }
    findings
}

async fn check_etcd(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    connection: &EtcdConnection,
    origin: &str,
    peer_region: Option<&str>,
    rp: &RegionPeering,
) -> Vec<Finding> {
    let mut out = Vec::new();
    let secret = match &connection.tls {
        None => None,
        Some(tls) => match Api::<Secret>::namespaced(client.clone(), namespace).get(&tls.secret_ref.name).await {
            Ok(s) => Some(s),
            Err(e) => {
                out.push(finding(
                    name,
                    "secret",
                    Level::Fail,
                    format!("cannot read Secret {}: {e}", tls.secret_ref.name),
                    Some("create the Secret, or grant yourself get on it"),
                ));
                return out;
            }
        },
    };
    let data: BTreeMap<String, Vec<u8>> =
        secret.and_then(|s| s.data).unwrap_or_default().into_iter().map(|(k, v)| (k, v.0)).collect();
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    for (key, what) in [("ca.crt", "the CA certificate"), ("tls.crt", "the client certificate")] {
        if let Some(pem) = data.get(key) {
            match CertificateDer::pem_slice_iter(pem).next() {
                Some(Ok(der)) => match not_after(&der) {
                    Some(at) => out.push(expiry_finding(name, what, at, now)),
                    None => out.push(finding(
                        name,
                        "certificate",
                        Level::Warn,
                        format!("cannot read the expiry of {key}"),
                        None,
                    )),
                },
                _ => out.push(finding(
                    name,
                    "certificate",
                    Level::Fail,
                    format!("{key} is not a PEM certificate"),
                    Some("fix the Secret"),
                )),
            }
        }
    }
    let access = match resolve_connection(client, namespace, connection).await {
        Ok(a) => a,
        Err(e) => {
            out.push(finding(
                name,
                "credentials",
                Level::Fail,
                e.to_string(),
                Some("fix the Secret the RegionPeering names"),
            ));
            return out;
        }
    };
    let user = access.target.user.as_ref().map(|(u, _)| u.clone());
    let mut etcd = match tokio::time::timeout(Duration::from_secs(10), access.target.connect()).await {
        Ok(Ok(c)) => {
            out.push(finding(
                name,
                "connect",
                Level::Ok,
                format!("connected to {}", connection.endpoints.join(",")),
                None,
            ));
            c
        }
        Ok(Err(e)) if e.classified().problem != crate::mirror::problem::Problem::Unreachable => {
            out.push(finding(
                name,
                "connect",
                Level::Fail,
                e.to_string(),
                Some("check the endpoints, the network path and TLS (CA and client certificate)"),
            ));
            return out;
        }
        Ok(Err(e)) => {
            out.push(finding(name, "connect", Level::Fail, e.to_string(), Some(UNREACHABLE)));
            return out;
        }
        Err(_) => {
            out.push(finding(name, "connect", Level::Fail, "no member answered within 10 s", Some(UNREACHABLE)));
            return out;
        }
    };
    match etcd.status().await {
        Ok(s) => {
            let level =
                if s.version().starts_with("3.4") || s.version().starts_with("3.5") || s.version().starts_with("3.6") {
                    Level::Ok
                } else {
                    Level::Warn
                };
            out.push(finding(
                name,
                "version",
                level,
                format!("etcd {} (leader {:x}, db {} MiB)", s.version(), s.leader(), s.db_size() >> 20),
                (level == Level::Warn).then_some("the tests cover etcd 3.4 and 3.6"),
            ));
        }
        Err(e) => out.push(finding(name, "version", Level::Warn, format!("status refused: {e}"), None)),
    }
    // Permission probes: Txns whose compare never holds (a key's version below 0), so nothing is
    // written, but etcd checks the permission of every op in them all the same.
    let probe = |key: String| {
        let mut etcd = etcd.clone();
        async move {
            let never = Compare::version(key.clone(), CompareOp::Less, 0);
            etcd.txn(Txn::new().when([never]).and_then([TxnOp::put(key, "", None)])).await.map(|_| ())
        }
    };
    let denied = |e: &etcd_client::Error| e.to_string().contains("permission denied");
    let mut auth_enforced = false;
    match peer_region {
        Some(peer) => {
            for (what, key) in [
                ("its own subtree", format!("{}doctor-probe", keys::region_prefix(origin))),
                ("its checkpoint", keys::checkpoint_key(origin)),
            ] {
                match probe(key).await {
                    Ok(()) => out.push(finding(name, "write", Level::Ok, format!("may write {what}"), None)),
                    Err(e) => out.push(finding(
                        name,
                        "write",
                        Level::Fail,
                        format!("may not write {what}: {e}"),
                        Some("grant the role readwrite on the region's prefixes (hack/etcd-mirror-role.sh)"),
                    )),
                }
            }
            match probe(format!("{}doctor-probe", keys::region_prefix(peer))).await {
                Err(e) if denied(&e) => {
                    auth_enforced = true;
                    out.push(finding(
                        name,
                        "least privilege",
                        Level::Ok,
                        format!("may not write region {peer}'s own subtree"),
                        None,
                    ));
                }
                Err(e) => out.push(finding(name, "least privilege", Level::Warn, format!("probe failed: {e}"), None)),
                Ok(()) => out.push(finding(
                    name,
                    "least privilege",
                    Level::Warn,
                    format!("may write region {peer}'s own subtree: auth is off or the role grants too much"),
                    Some("enable auth and use a role limited to the origin's prefixes"),
                )),
            }
        }
        None => {
            let range = etcd
                .get(keys::region_prefix(origin), Some(etcd_client::GetOptions::new().with_prefix().with_count_only()))
                .await;
            match range {
                Ok(r) => out.push(finding(
                    name,
                    "read",
                    Level::Ok,
                    format!("may read the region's subtree ({} keys)", r.count()),
                    None,
                )),
                Err(e) => out.push(finding(
                    name,
                    "read",
                    Level::Fail,
                    format!("may not read the region's subtree: {e}"),
                    Some("grant the role read on the region's prefix"),
                )),
            }
        }
    }
    if peer_region.is_some() {
        let root = user.as_deref() == Some("root");
        out.push(lease_layout_finding(name, auth_enforced, root, rp.spec.lease.max_keys_per_lease));
    }
    match clock_skew(&connection.endpoints, &data).await {
        Ok(skew) => out.push(skew_finding(name, skew)),
        Err(e) => out.push(finding(name, "clock", Level::Warn, format!("cannot read the member's clock: {e:#}"), None)),
    }
    out
}

/// The member's clock minus this machine's, from the Date header of its /version endpoint.
async fn clock_skew(endpoints: &[String], secret: &BTreeMap<String, Vec<u8>>) -> anyhow::Result<i64> {
    let endpoint = endpoints.first().ok_or_else(|| anyhow::anyhow!("no endpoint"))?;
    let (https, authority) = match endpoint.split_once("://") {
        Some(("https", rest)) => (true, rest.trim_end_matches('/')),
        Some((_, rest)) => (false, rest.trim_end_matches('/')),
        None => (false, endpoint.as_str()),
    };
    let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h).to_string();
    let tcp = tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(authority)).await??;
    let request = format!("GET /version HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
    let mut response = Vec::new();
    let before = SystemTime::now();
    if https {
        let mut roots = tokio_rustls::rustls::RootCertStore::empty();
        let ca = secret.get("ca.crt").ok_or_else(|| anyhow::anyhow!("no ca.crt to verify the member with"))?;
        for cert in CertificateDer::pem_slice_iter(ca) {
            roots.add(cert?)?;
        }
        let builder = tokio_rustls::rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
            tokio_rustls::rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
        let config = match (secret.get("tls.crt"), secret.get("tls.key")) {
            (Some(crt), Some(key)) => builder.with_client_auth_cert(
                CertificateDer::pem_slice_iter(crt).collect::<Result<Vec<_>, _>>()?,
                PrivateKeyDer::from_pem_slice(key)?,
            )?,
            _ => builder.with_no_client_auth(),
        };
        let name = rustls_pki_types::ServerName::try_from(host)?;
        let mut tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config)).connect(name, tcp).await?;
        tls.write_all(request.as_bytes()).await?;
        let _ = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut response)).await;
    } else {
        let mut tcp = tcp;
        tcp.write_all(request.as_bytes()).await?;
        let _ = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut response)).await;
    }
    let after = SystemTime::now();
    let text = String::from_utf8_lossy(&response);
    let date = text
        .lines()
        .find_map(|l| l.strip_prefix("Date: ").or_else(|| l.strip_prefix("date: ")))
        .ok_or_else(|| anyhow::anyhow!("no Date header in the answer"))?;
    let theirs = httpdate::parse_http_date(date.trim())?;
    // Our clock at the middle of the exchange; the header has a resolution of one second.
    let ours = before + after.duration_since(before).unwrap_or_default() / 2;
    let secs = |t: SystemTime| t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    Ok(secs(theirs) - secs(ours))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_expiry_of_a_certificate_is_read_from_its_der() {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["x".to_string()]).unwrap();
        params.not_after = rcgen::date_time_ymd(2031, 7, 14);
        let cert = params.self_signed(&key).unwrap();
        // 2031-07-14T00:00:00Z
        assert_eq!(not_after(cert.der()), Some(1_941_753_600));
        params.not_after = rcgen::date_time_ymd(2051, 1, 2); // GeneralizedTime from 2050 on
        let cert = params.self_signed(&key).unwrap();
        assert_eq!(not_after(cert.der()), Some(2_556_230_400));
        assert_eq!(not_after(b"not a certificate"), None);
        assert_eq!(not_after(&[]), None);
    }

    #[test]
    fn the_targets_unreachable_here_take_the_leaders_findings_and_the_rest_stay() {
        let f = |target: &str, check: &str, level, action: Option<&str>| Finding {
            target: target.into(),
            check: check.into(),
            level,
            detail: "d".into(),
            action: action.map(String::from),
        };
        let here = vec![
            f("local etcd", "connect", Level::Fail, Some(UNREACHABLE)),
            f("peer b", "connect", Level::Ok, None),
            f("peer c", "connect", Level::Fail, Some("check the endpoints, the network path and TLS")),
        ];
        assert_eq!(unreachable_targets(&here), ["local etcd"], "a TLS failure is not for the leader to check");
        let theirs = vec![
            f("local etcd", "connect", Level::Ok, None),
            f("local etcd", "read", Level::Ok, None),
            f("peer b", "connect", Level::Ok, None),
        ];
        let merged = with_leaders(here.clone(), Ok(("ns/op-0".into(), theirs)));
        let targets: Vec<(&str, &str, Level)> =
            merged.iter().map(|f| (f.target.as_str(), f.check.as_str(), f.level)).collect();
        assert_eq!(
            targets,
            [
                ("peer b", "connect", Level::Ok),
                ("peer c", "connect", Level::Fail),
                ("local etcd", "connect", Level::Ok),
                ("local etcd", "read", Level::Ok)
            ]
        );
        assert!(merged[2].detail.ends_with("(checked from the leader's pod ns/op-0)"));
        let refused = with_leaders(here, Err("the leader Lease x/y is held by nobody".into()));
        assert_eq!(refused.len(), 4);
        assert_eq!(refused[0].level, Level::Fail, "what was found here stays");
        assert!(refused[3].detail.contains("local etcd") && refused[3].detail.contains("held by nobody"));
    }

    #[test]
    fn findings_say_what_to_do() {
        let day = 86_400;
        assert_eq!(expiry_finding("peer b", "the CA", 10 * day, 11 * day).level, Level::Fail);
        assert_eq!(expiry_finding("peer b", "the CA", 20 * day, 11 * day).level, Level::Warn);
        assert_eq!(expiry_finding("peer b", "the CA", 200 * day, 11 * day).level, Level::Ok);
        let slow = lease_layout_finding("peer b", true, false, 1000);
        assert_eq!(slow.level, Level::Warn);
        assert!(slow.action.unwrap().contains("maxKeysPerLease"));
        assert_eq!(lease_layout_finding("peer b", true, true, 1000).level, Level::Ok, "root skips the check");
        assert_eq!(lease_layout_finding("peer b", false, false, 1000).level, Level::Ok);
        assert_eq!(lease_layout_finding("peer b", true, false, 200).level, Level::Ok);
        assert_eq!(skew_finding("peer b", 5).level, Level::Warn);
        assert_eq!(skew_finding("peer b", -1).level, Level::Ok);
        let text = render(&[slow_finding()]);
        assert!(text.contains("WARN") && text.contains("->"), "{text}");
    }

    fn slow_finding() -> Finding {
        lease_layout_finding("peer b", true, false, 1000)
    }
}
