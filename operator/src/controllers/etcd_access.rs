//! Turning an `EtcdConnection` and its Secret into something the mirror can dial, without IO.
//! Secret material never reaches logs, events or status; only the Secret's name and key do.
use crate::api::EtcdConnection;
use crate::mirror::EtcdTarget;
use k8s_openapi::api::core::v1::Secret;
use std::hash::{Hash, Hasher};

/// Why a connection cannot be built, naming the Secret and key a person must fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    #[error("Secret {secret} not found")]
    SecretMissing { secret: String },
    #[error("Secret {secret} has no key {key}")]
    KeyMissing { secret: String, key: &'static str },
    #[error("Secret {secret} key {key} is not PEM")]
    NotPem { secret: String, key: &'static str },
    #[error("Secret {secret}: {key} needs its pair ({pair}) as well")]
    Unpaired { secret: String, key: &'static str, pair: &'static str },
    #[error("endpoints mix http:// and https://; use one scheme")]
    MixedSchemes,
    #[error("Secret {secret}: reading it is forbidden to the operator (grant it get on this Secret)")]
    SecretForbidden { secret: String },
    #[error("Secret {secret} could not be read: {error}")]
    SecretUnreadable { secret: String, error: String },
    #[error(
        "Secret {secret} holds a username and password but the endpoints are http://: the password would cross the network in clear; use https:// endpoints"
    )]
    PlaintextCredentials { secret: String },
}

/// How reading a referenced Secret went.
pub enum SecretRead {
    Found(Box<Secret>),
    Missing,
    Failed(AccessError),
}

impl SecretRead {
    /// Maps the API's answer for Secret `name`.
    pub fn from_result(name: &str, result: Result<Option<Secret>, kube::Error>) -> Self {
        match result {
            Ok(Some(secret)) => SecretRead::Found(Box::new(secret)),
            Ok(None) => SecretRead::Missing,
            Err(kube::Error::Api(status)) if status.code == 403 => {
                SecretRead::Failed(AccessError::SecretForbidden { secret: name.to_string() })
            }
            Err(e) => {
                SecretRead::Failed(AccessError::SecretUnreadable { secret: name.to_string(), error: e.to_string() })
            }
        }
    }
}

impl AccessError {
    /// A condition reason for this error.
    pub fn reason(&self) -> &'static str {
        match self {
            AccessError::SecretMissing { .. } => "SecretNotFound",
            AccessError::SecretForbidden { .. } => "SecretForbidden",
            AccessError::SecretUnreadable { .. } => "SecretUnreadable",
            AccessError::PlaintextCredentials { .. } => "InsecureCredentials",
            AccessError::MixedSchemes => "EndpointsInvalid",
            _ => "SecretInvalid",
        }
    }
}

/// An etcd target and a fingerprint of everything that, when changed, must restart a worker.
#[derive(Clone)]
pub struct Access {
    pub target: EtcdTarget,
    pub fingerprint: u64,
    /// What it is made of, as a person names it (never the Secret's material).
    pub described: Described,
}

/// A connection as a person names it: its endpoints, and its Secret with a hash of each key it
/// supplied, so that a change can say which keys changed without showing them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Described {
    pub endpoints: Vec<String>,
    pub secret: Option<String>,
    pub secret_keys: std::collections::BTreeMap<&'static str, u64>,
}

impl Described {
    /// What differs from `other`, as "field: old -> new" lines; `field` is the spec path of the
    /// connection (`spec.localEtcd`, `spec.peers[b]`).
    pub fn changes_from(&self, other: &Described, field: &str) -> Vec<String> {
        let mut changes = Vec::new();
        if self.endpoints != other.endpoints {
            changes.push(format!("{field}.endpoints: {:?} -> {:?}", other.endpoints, self.endpoints));
        }
        if self.secret != other.secret {
            let name = |s: &Option<String>| s.clone().unwrap_or_else(|| "none".into());
            changes.push(format!("{field}.tls.secretRef: {} -> {}", name(&other.secret), name(&self.secret)));
        } else if self.secret_keys != other.secret_keys {
            let keys: Vec<&str> = self
                .secret_keys
                .keys()
                .chain(other.secret_keys.keys())
                .filter(|k| self.secret_keys.get(*k) != other.secret_keys.get(*k))
                .copied()
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            changes.push(format!(
                "Secret {} ({field}.tls.secretRef): {} changed",
                name_or_none(&self.secret),
                keys.join(", ")
            ));
        }
        changes
    }

    /// How to put this connection back, for a change refused.
    pub fn undo(&self, other: &Described, field: &str) -> Vec<String> {
        let mut undo = Vec::new();
        if self.endpoints != other.endpoints {
            undo.push(format!("set {field}.endpoints back to {:?}", self.endpoints));
        }
        if self.secret != other.secret {
            undo.push(format!("set {field}.tls.secretRef back to {}", name_or_none(&self.secret)));
        } else if self.secret_keys != other.secret_keys {
            undo.push(format!(
                "restore Secret {}'s previous contents (the running worker still uses them)",
                name_or_none(&self.secret)
            ));
        }
        undo
    }
}

fn name_or_none(secret: &Option<String>) -> String {
    secret.clone().unwrap_or_else(|| "none".into())
}

fn hash_of(bytes: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

/// Builds the target for a connection. `secret` is the referenced Secret as read (None when the
/// connection names none, or when it is missing).
pub fn access(connection: &EtcdConnection, secret: Option<&Secret>) -> Result<Access, AccessError> {
    let https = connection.endpoints.iter().filter(|e| e.starts_with("https://")).count();
    if https != 0 && https != connection.endpoints.len() {
        return Err(AccessError::MixedSchemes);
    }
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    connection.endpoints.hash(&mut hasher);
    let mut target = EtcdTarget::plain(connection.endpoints.clone());
    let mut described = Described { endpoints: connection.endpoints.clone(), ..Described::default() };

    if let Some(tls) = &connection.tls {
        let name = tls.secret_ref.name.clone();
        let secret = secret.ok_or_else(|| AccessError::SecretMissing { secret: name.clone() })?;
        let namespace = secret.metadata.namespace.as_deref().map(|ns| format!("{ns}/")).unwrap_or_default();
        target = target.with_credentials_from(format!("Secret {namespace}{name}"));
        described.secret = Some(format!("{namespace}{name}"));
        let read = |key: &'static str| -> Option<Vec<u8>> {
            secret
                .data
                .as_ref()
                .and_then(|d| d.get(key))
                .map(|b| b.0.clone())
                .or_else(|| secret.string_data.as_ref().and_then(|d| d.get(key)).map(|s| s.clone().into_bytes()))
        };
        let keys = std::cell::RefCell::new(std::collections::BTreeMap::new());
        let get = |key: &'static str| -> Option<Vec<u8>> {
            let value = read(key);
            if let Some(v) = &value {
                keys.borrow_mut().insert(key, hash_of(v));
            }
            value
        };
        let pem = |key: &'static str, bytes: Vec<u8>| -> Result<Vec<u8>, AccessError> {
            if String::from_utf8_lossy(&bytes).contains("-----BEGIN ") {
                Ok(bytes)
            } else {
                Err(AccessError::NotPem { secret: name.clone(), key })
            }
        };
        if https > 0 {
            let ca = get("ca.crt").ok_or_else(|| AccessError::KeyMissing { secret: name.clone(), key: "ca.crt" })?;
            let ca = pem("ca.crt", ca)?;
            ca.hash(&mut hasher);
            let mut tls_options = etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(ca));
            match (get("tls.crt"), get("tls.key")) {
                (Some(cert), Some(key)) => {
                    let (cert, key) = (pem("tls.crt", cert)?, pem("tls.key", key)?);
                    cert.hash(&mut hasher);
                    key.hash(&mut hasher);
                    target = target.with_client_certificate(&cert);
                    tls_options = tls_options.identity(etcd_client::Identity::from_pem(cert, key));
                }
                (Some(_), None) => return Err(AccessError::Unpaired { secret: name, key: "tls.crt", pair: "tls.key" }),
                (None, Some(_)) => return Err(AccessError::Unpaired { secret: name, key: "tls.key", pair: "tls.crt" }),
                (None, None) => {}
            }
            target = target.with_tls(tls_options);
        }
        match (get("username"), get("password")) {
            (Some(_), Some(_)) if https == 0 => return Err(AccessError::PlaintextCredentials { secret: name }),
            (Some(user), Some(password)) => {
                user.hash(&mut hasher);
                password.hash(&mut hasher);
                target = target.with_user(String::from_utf8_lossy(&user), String::from_utf8_lossy(&password));
            }
            (Some(_), None) => return Err(AccessError::Unpaired { secret: name, key: "username", pair: "password" }),
            (None, Some(_)) => return Err(AccessError::Unpaired { secret: name, key: "password", pair: "username" }),
            (None, None) => {}
        }
        described.secret_keys = keys.into_inner();
    }
    Ok(Access { target, fingerprint: hasher.finish(), described })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{EtcdTls, SecretRef};
    use k8s_openapi::ByteString;
    use std::collections::BTreeMap;

    fn conn(endpoints: &[&str], secret: Option<&str>) -> EtcdConnection {
        EtcdConnection {
            endpoints: endpoints.iter().map(|s| s.to_string()).collect(),
            tls: secret.map(|s| EtcdTls { secret_ref: SecretRef { name: s.into() } }),
        }
    }

    fn secret(entries: &[(&str, &str)]) -> Secret {
        let data: BTreeMap<String, ByteString> =
            entries.iter().map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec()))).collect();
        Secret { data: Some(data), ..Secret::default() }
    }

    const PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";

    #[test]
    fn errors_name_the_secret_and_key() {
        let c = conn(&["https://e:2379"], Some("creds"));
        assert_eq!(access(&c, None).err().unwrap().to_string(), "Secret creds not found");
        assert_eq!(access(&c, Some(&secret(&[]))).err().unwrap().to_string(), "Secret creds has no key ca.crt");
        assert_eq!(
            access(&c, Some(&secret(&[("ca.crt", "garbage")]))).err().unwrap().to_string(),
            "Secret creds key ca.crt is not PEM"
        );
        let half = secret(&[("ca.crt", PEM), ("tls.crt", PEM)]);
        assert!(access(&c, Some(&half)).err().unwrap().to_string().contains("tls.crt needs its pair (tls.key)"));
        assert_eq!(access(&conn(&["https://a:1", "http://b:1"], None), None).err(), Some(AccessError::MixedSchemes));
    }

    #[test]
    fn errors_never_contain_secret_material() {
        let c = conn(&["https://e:2379"], Some("creds"));
        let err = access(&c, Some(&secret(&[("ca.crt", "s3cr3t-not-pem")]))).err().unwrap();
        assert!(!err.to_string().contains("s3cr3t"));
    }

    #[test]
    fn a_secret_change_changes_the_fingerprint() {
        let c = conn(&["https://e:2379"], Some("creds"));
        let a = access(&c, Some(&secret(&[("ca.crt", PEM)]))).unwrap().fingerprint;
        let b = access(&c, Some(&secret(&[("ca.crt", &PEM.replace("MIIB", "MIIC"))]))).unwrap().fingerprint;
        assert_ne!(a, b);
        let plain = access(&conn(&["http://e:2379"], None), None).unwrap();
        assert!(
            plain.target.tls.is_none() && plain.target.user.is_none(),
            "plain http only where the endpoint says so, and then no TLS"
        );
    }

    #[test]
    fn a_change_names_the_field_both_sides_and_how_to_undo_it() {
        let c = conn(&["https://e:2379"], Some("creds"));
        let old = access(&c, Some(&secret(&[("ca.crt", PEM), ("username", "u"), ("password", "p")]))).unwrap();
        let rotated = secret(&[("ca.crt", &PEM.replace("MIIB", "MIIC")), ("username", "u"), ("password", "p")]);
        let new = access(&c, Some(&rotated)).unwrap();
        assert_eq!(
            new.described.changes_from(&old.described, "spec.peers[b]"),
            vec!["Secret creds (spec.peers[b].tls.secretRef): ca.crt changed".to_string()]
        );
        assert_eq!(
            old.described.undo(&new.described, "spec.peers[b]"),
            vec!["restore Secret creds's previous contents (the running worker still uses them)".to_string()]
        );
        let moved = access(&conn(&["https://f:2379/"], Some("creds")), Some(&rotated)).unwrap();
        let changes = moved.described.changes_from(&new.described, "spec.peers[b]");
        assert_eq!(changes, vec![r#"spec.peers[b].endpoints: ["https://e:2379"] -> ["https://f:2379/"]"#.to_string()]);
        assert_eq!(
            new.described.undo(&moved.described, "spec.peers[b]"),
            vec![r#"set spec.peers[b].endpoints back to ["https://e:2379"]"#.to_string()]
        );
        // Nothing of the material shows.
        assert!(!format!("{:?}", new.described).contains("MIIC"));
    }

    #[test]
    fn a_password_is_never_sent_over_plain_http() {
        let s = secret(&[("username", "u"), ("password", "p")]);
        let err = access(&conn(&["http://e:2379"], Some("creds")), Some(&s)).err().expect("refused");
        assert_eq!(err.reason(), "InsecureCredentials");
        assert!(err.to_string().contains("Secret creds"), "{err}");
    }

    #[test]
    fn a_forbidden_secret_is_not_a_missing_one() {
        let forbidden = kube::Error::Api(
            serde_json::from_value(
                serde_json::json!({"status": "Failure", "message": "forbidden", "reason": "Forbidden", "code": 403}),
            )
            .unwrap(),
        );
        match SecretRead::from_result("creds", Err(forbidden)) {
            SecretRead::Failed(e) => assert_eq!(e.reason(), "SecretForbidden"),
            _ => panic!("a 403 is its own error"),
        }
        assert!(matches!(SecretRead::from_result("creds", Ok(None)), SecretRead::Missing));
    }
}
