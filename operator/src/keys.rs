//! The registry key schema: v1 (origin-first) and v0 (legacy, service-first) endpoint keys, the
//! prefixes the mirror and the drain work on, and the endpoint value.
//!
//! v1: `/aether/v1/regions/<region>/clusters/<cluster>/services/<svc>/protocols/<proto>/endpoints/<ip>`
//! v0: `/aether/services/<svc>/protocols/<proto>/endpoints/<ip>`
use serde::{Deserialize, Serialize};
use std::fmt;
use std::net::IpAddr;

/// Root of every region's authoritative subtree.
pub const V1_REGIONS_ROOT: &str = "/aether/v1/regions/";
/// Root of the legacy layout.
pub const V0_ROOT: &str = "/aether/services/";
/// Root of the federation's own bookkeeping (checkpoints, canaries), outside `regions/`.
pub const FEDERATION_ROOT: &str = "/aether/v1/federation/";

/// A key that does not follow the schema, with what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("key {key:?} does not start with {expected:?}")]
    WrongRoot { key: String, expected: &'static str },
    #[error("key {key:?}: expected segment {expected:?} at position {position}, found {found:?}")]
    UnexpectedSegment { key: String, position: usize, expected: &'static str, found: String },
    #[error("key {key:?} has {found} segments after the root, expected {expected}")]
    WrongLength { key: String, found: usize, expected: usize },
    #[error("key {key:?}: {what} {value:?} is not valid ({why})")]
    InvalidSegment { key: String, what: &'static str, value: String, why: &'static str },
}

/// A v1 endpoint key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EndpointKeyV1 {
    pub region: String,
    pub cluster: String,
    pub service: String,
    pub protocol: String,
    pub ip: IpAddr,
}

/// A v0 (legacy) endpoint key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EndpointKeyV0 {
    pub service: String,
    pub protocol: String,
    pub ip: IpAddr,
}

impl fmt::Display for EndpointKeyV1 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{V1_REGIONS_ROOT}{}/clusters/{}/services/{}/protocols/{}/endpoints/{}",
            self.region, self.cluster, self.service, self.protocol, self.ip
        )
    }
}

impl fmt::Display for EndpointKeyV0 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{V0_ROOT}{}/protocols/{}/endpoints/{}", self.service, self.protocol, self.ip)
    }
}

impl EndpointKeyV1 {
    pub fn parse(key: &str) -> Result<Self, KeyError> {
        let segments = split_under(key, V1_REGIONS_ROOT)?;
        // region, "clusters", cluster, "services", svc, "protocols", proto, "endpoints", ip
        expect_shape(
            key,
            &segments,
            &[None, Some("clusters"), None, Some("services"), None, Some("protocols"), None, Some("endpoints"), None],
        )?;
        let region = segments[0];
        if !is_dns_label(region) {
            return Err(invalid(key, "region", region, "a region is a DNS label"));
        }
        Ok(EndpointKeyV1 {
            region: region.to_string(),
            cluster: name_segment(key, "cluster", segments[2])?,
            service: name_segment(key, "service", segments[4])?,
            protocol: name_segment(key, "protocol", segments[6])?,
            ip: parse_ip(key, segments[8])?,
        })
    }

    /// The key in bytes, as etcd stores it.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.to_string().into_bytes()
    }
}

impl EndpointKeyV0 {
    pub fn parse(key: &str) -> Result<Self, KeyError> {
        Self::parse_under(key, V0_ROOT)
    }

    /// Parses a legacy key under a configurable legacy prefix (ending in '/').
    pub fn parse_under(key: &str, root: &str) -> Result<Self, KeyError> {
        let segments = split_under_dyn(key, root)?;
        expect_shape(key, &segments, &[None, Some("protocols"), None, Some("endpoints"), None])?;
        Ok(EndpointKeyV0 {
            service: name_segment(key, "service", segments[0])?,
            protocol: name_segment(key, "protocol", segments[2])?,
            ip: parse_ip(key, segments[4])?,
        })
    }

    /// The v1 key of this endpoint in the given origin.
    pub fn to_v1(&self, region: &str, cluster: &str) -> EndpointKeyV1 {
        EndpointKeyV1 {
            region: region.to_string(),
            cluster: cluster.to_string(),
            service: self.service.clone(),
            protocol: self.protocol.clone(),
            ip: self.ip,
        }
    }
}

/// `/aether/v1/regions/<region>/`: one region's authoritative subtree.
pub fn region_prefix(region: &str) -> String {
    format!("{V1_REGIONS_ROOT}{region}/")
}

/// `/aether/v1/regions/<region>/clusters/<cluster>/`.
pub fn cluster_prefix(region: &str, cluster: &str) -> String {
    format!("{}clusters/{cluster}/", region_prefix(region))
}

/// `/aether/v1/regions/<region>/clusters/<cluster>/services/<svc>/`.
pub fn service_prefix(region: &str, cluster: &str, service: &str) -> String {
    format!("{}services/{service}/", cluster_prefix(region, cluster))
}

/// `/aether/v1/federation/<origin>/`: the origin's bookkeeping on a peer.
pub fn federation_prefix(origin: &str) -> String {
    format!("{FEDERATION_ROOT}{origin}/")
}

/// The mirror's checkpoint for `origin` on a peer: last applied revision, lease ids, owner.
pub fn checkpoint_key(origin: &str) -> String {
    format!("{}checkpoint", federation_prefix(origin))
}

/// Where a checkpoint too large for one request keeps its lease layout, in parts (see
/// `mirror::records::checkpoint::plan_write`).
pub fn checkpoint_parts_prefix(origin: &str) -> String {
    format!("{}checkpoint-parts/", federation_prefix(origin))
}

/// The progress record for `origin` on a peer: the origin revision the peer holds, written with
/// every watch batch (small and constant, unlike the lease layout in the checkpoint).
pub fn progress_key(origin: &str) -> String {
    format!("{}progress", federation_prefix(origin))
}

/// The lock of the v0 -> v1 drain of one legacy prefix: one drain per prefix per etcd.
pub fn drain_lock_key(legacy_prefix: &str) -> String {
    format!("/aether/v1/drain/lock{legacy_prefix}")
}

/// Under this prefix the drain marks each of its delete Txns (a key written in the same Txn, so its
/// mod revision is the delete's): after a restart it still knows which deletes were its own.
pub fn drain_deletes_prefix(legacy_prefix: &str) -> String {
    format!("/aether/v1/drain/deleted{legacy_prefix}")
}

/// Where the drain of one legacy prefix records its progress.
pub fn drain_record_key(legacy_prefix: &str) -> String {
    format!("/aether/v1/drain/progress{legacy_prefix}")
}

/// The owner record for `origin` on a peer; its mod revision is the fencing epoch.
pub fn owner_key(origin: &str) -> String {
    format!("{}owner", federation_prefix(origin))
}

/// Where the last sync's origin pages ended, for `origin` on a peer: a successor bounds its
/// verification reads by them (`mirror::verify::read_end`) before a pass of its own.
pub fn page_ends_key(origin: &str) -> String {
    format!("{}page-ends", federation_prefix(origin))
}

/// The sync canary for `origin` on a peer: present once the peer holds a complete snapshot.
pub fn canary_key(origin: &str) -> String {
    format!("{}synced", federation_prefix(origin))
}

/// The region a key under `/aether/v1/regions/` belongs to, if any.
pub fn region_of(key: &[u8]) -> Option<&str> {
    let rest = key.strip_prefix(V1_REGIONS_ROOT.as_bytes())?;
    let end = rest.iter().position(|b| *b == b'/')?;
    std::str::from_utf8(&rest[..end]).ok()
}

/// The end of the etcd range covering every key that starts with `prefix`.
pub fn prefix_range_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // every key
}

/// Why a legacy prefix cannot be drained, if it cannot: it must start and end with `/`, and be
/// neither the root, nor `/aether/` (which holds the drain's own bookkeeping and the federation's),
/// nor inside the v1 layout `/aether/v1/` (whose keys are live endpoints and records).
pub fn legacy_prefix_problem(prefix: &str) -> Option<String> {
    if !prefix.starts_with('/') || !prefix.ends_with('/') || prefix.len() < 3 {
        return Some(format!("legacy prefix {prefix:?} must start and end with '/' and name something between"));
    }
    if prefix == "/aether/" || prefix.starts_with("/aether/v1/") || "/aether/v1/".starts_with(prefix) {
        return Some(format!(
            "legacy prefix {prefix:?} covers the v1 layout /aether/v1/ (live endpoints, the federation's records, the drain's own): drain a prefix outside it, such as {V0_ROOT}"
        ));
    }
    None
}

/// Whether a cluster name can be a key segment: not empty, no `/`, no whitespace or control
/// character, not `.` or `..`, at most 253 bytes.
pub fn is_key_segment(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s != "."
        && s != ".."
        && !s.chars().any(|c| c == '/' || c.is_whitespace() || c.is_control())
}

/// A DNS label (RFC 1123): what region names must be.
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// The endpoint value registrars write. Unknown fields are kept, so that rewriting a value never
/// drops what a newer registrar added.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointValue {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

impl EndpointValue {
    pub fn parse(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

fn split_under<'a>(key: &'a str, root: &'static str) -> Result<Vec<&'a str>, KeyError> {
    let rest = key.strip_prefix(root).ok_or_else(|| KeyError::WrongRoot { key: key.to_string(), expected: root })?;
    Ok(rest.split('/').collect())
}

fn split_under_dyn<'a>(key: &'a str, root: &str) -> Result<Vec<&'a str>, KeyError> {
    match key.strip_prefix(root) {
        Some(rest) => Ok(rest.split('/').collect()),
        None if root == V0_ROOT => Err(KeyError::WrongRoot { key: key.to_string(), expected: V0_ROOT }),
        None => Err(KeyError::WrongRoot { key: key.to_string(), expected: "the legacy prefix" }),
    }
}

fn expect_shape(key: &str, segments: &[&str], shape: &[Option<&'static str>]) -> Result<(), KeyError> {
    if segments.len() != shape.len() {
        return Err(KeyError::WrongLength { key: key.to_string(), found: segments.len(), expected: shape.len() });
    }
    for (position, (segment, expected)) in segments.iter().zip(shape).enumerate() {
        if let Some(expected) = expected
            && segment != expected
        {
            return Err(KeyError::UnexpectedSegment {
                key: key.to_string(),
                position,
                expected,
                found: segment.to_string(),
            });
        }
    }
    Ok(())
}

fn name_segment(key: &str, what: &'static str, value: &str) -> Result<String, KeyError> {
    if value.is_empty() {
        return Err(invalid(key, what, value, "empty"));
    }
    if value.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(invalid(key, what, value, "contains whitespace or control characters"));
    }
    Ok(value.to_string())
}

fn parse_ip(key: &str, value: &str) -> Result<IpAddr, KeyError> {
    let ip: IpAddr = value.parse().map_err(|_| invalid(key, "endpoint IP", value, "not an IPv4 or IPv6 address"))?;
    // Only the canonical spelling round-trips, so two spellings never name one endpoint.
    if ip.to_string() != value {
        return Err(invalid(key, "endpoint IP", value, "not in canonical form"));
    }
    Ok(ip)
}

fn invalid(key: &str, what: &'static str, value: &str, why: &'static str) -> KeyError {
    KeyError::InvalidSegment { key: key.to_string(), what, value: value.to_string(), why }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_legacy_prefix_over_the_v1_layout_or_the_bookkeeping_is_refused() {
        assert_eq!(legacy_prefix_problem("/aether/services/"), None);
        assert_eq!(legacy_prefix_problem("/old-registry/"), None);
        for bad in [
            "/",
            "//",
            "aether/",
            "/aether/",
            "/aether/v1/",
            "/aether/v1/regions/a/clusters/c1/",
            "/aether/v1/drain/",
            "/aether/v",
        ] {
            assert!(legacy_prefix_problem(bad).is_some(), "{bad:?} accepted");
        }
    }

    #[test]
    fn a_cluster_name_that_cannot_be_a_key_segment_is_told() {
        assert!(is_key_segment("eu-west-1a") && is_key_segment("cluster.example.com"));
        for bad in ["", ".", "..", "a/b", "a b", "a\0b", "tab\there", &"x".repeat(254)] {
            assert!(!is_key_segment(bad), "{bad:?} accepted");
        }
    }
    use proptest::prelude::*;

    fn segment() -> impl Strategy<Value = String> {
        "[a-z0-9][a-z0-9._-]{0,20}"
    }
    fn region() -> impl Strategy<Value = String> {
        "[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?"
    }
    fn ip() -> impl Strategy<Value = IpAddr> {
        prop_oneof![any::<[u8; 4]>().prop_map(IpAddr::from), any::<[u8; 16]>().prop_map(IpAddr::from)]
    }

    proptest! {
        #[test]
        fn v1_roundtrip(region in region(), cluster in segment(), service in segment(), protocol in segment(), ip in ip()) {
            let key = EndpointKeyV1 { region, cluster, service, protocol, ip };
            prop_assert_eq!(EndpointKeyV1::parse(&key.to_string()), Ok(key.clone()));
            prop_assert!(key.to_string().starts_with(&region_prefix(&key.region)));
            prop_assert!(key.to_string().starts_with(&service_prefix(&key.region, &key.cluster, &key.service)));
            let text = key.to_string();
            prop_assert_eq!(region_of(text.as_bytes()), Some(key.region.as_str()));
        }

        #[test]
        fn v0_roundtrip(service in segment(), protocol in segment(), ip in ip()) {
            let key = EndpointKeyV0 { service, protocol, ip };
            prop_assert_eq!(EndpointKeyV0::parse(&key.to_string()), Ok(key.clone()));
        }

        #[test]
        fn region_prefixes_are_disjoint(a in region(), b in region()) {
            prop_assume!(a != b);
            prop_assert!(!region_prefix(&a).starts_with(&region_prefix(&b)));
            prop_assert!(!federation_prefix(&a).starts_with(&federation_prefix(&b)));
        }

        #[test]
        fn arbitrary_keys_never_panic(key in ".{0,120}") {
            let _ = EndpointKeyV1::parse(&key);
            let _ = EndpointKeyV0::parse(&key);
            let _ = region_of(key.as_bytes());
        }

        #[test]
        fn arbitrary_v1_shaped_keys_never_panic(segments in proptest::collection::vec(".{0,8}", 0..12)) {
            let key = format!("{V1_REGIONS_ROOT}{}", segments.join("/"));
            let _ = EndpointKeyV1::parse(&key);
        }
    }

    #[test]
    fn malformed_keys_say_what_is_wrong() {
        let cases = [
            ("/aether/services/x/protocols/tcp/endpoints/1.2.3.4", "does not start with"),
            ("/aether/v1/regions/a/clusters/c/services/s/protocols/tcp/endpoints", "segments"),
            (
                "/aether/v1/regions/a/clusterz/c/services/s/protocols/tcp/endpoints/1.2.3.4",
                "expected segment \"clusters\"",
            ),
            ("/aether/v1/regions/A_B/clusters/c/services/s/protocols/tcp/endpoints/1.2.3.4", "DNS label"),
            ("/aether/v1/regions/a/clusters/c/services/s/protocols/tcp/endpoints/999.1.1.1", "not an IPv4 or IPv6"),
            ("/aether/v1/regions/a/clusters//services/s/protocols/tcp/endpoints/1.2.3.4", "empty"),
            ("/aether/v1/regions/a/clusters/c/services/s/protocols/tcp/endpoints/0:0::1", "canonical"),
        ];
        for (key, needle) in cases {
            let err = EndpointKeyV1::parse(key).unwrap_err().to_string();
            assert!(err.contains(needle), "{key}: {err} should mention {needle}");
        }
    }

    #[test]
    fn ipv6_keys_roundtrip() {
        let key = EndpointKeyV1::parse(
            "/aether/v1/regions/eu-west/clusters/c1/services/web/protocols/http/endpoints/fd00::5",
        )
        .unwrap();
        assert_eq!(key.ip, "fd00::5".parse::<IpAddr>().unwrap());
        assert_eq!(
            EndpointKeyV0::parse("/aether/services/web/protocols/http/endpoints/fd00::5")
                .unwrap()
                .to_v1("eu-west", "c1"),
            key
        );
    }

    #[test]
    fn prefix_range_end_covers_the_prefix() {
        assert_eq!(prefix_range_end(b"/a/"), b"/a0".to_vec());
        assert_eq!(prefix_range_end(&[b'a', 0xff]), b"b".to_vec());
        assert_eq!(prefix_range_end(&[0xff]), vec![0]);
    }

    #[test]
    fn values_keep_unknown_fields() {
        let raw = br#"{"clusterName":"c1","region":"eu","zone":"z1","address":"10.0.0.1","port":80,"future":{"x":1}}"#;
        let value = EndpointValue::parse(raw).unwrap();
        assert_eq!(value.cluster_name.as_deref(), Some("c1"));
        let back: serde_json::Value = serde_json::to_value(&value).unwrap();
        assert_eq!(back, serde_json::from_slice::<serde_json::Value>(raw).unwrap());
    }
}
