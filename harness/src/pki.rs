//! Certificates generated at start: a CA, a serving certificate for 127.0.0.1 and client
//! certificates signed by it, and the service-account signing key.
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};
use std::path::{Path, PathBuf};

pub struct Pki {
    pub ca_cert: PathBuf,
    ca_params: CertificateParams,
    ca_key: KeyPair,
    dir: PathBuf,
}

/// A certificate and key written to `<dir>/<name>.crt` and `<dir>/<name>.key`.
#[derive(Clone, Debug)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Pki {
    pub fn new(dir: &Path) -> anyhow::Result<Self> {
        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.distinguished_name.push(DnType::CommonName, "aether-test-ca");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key)?;
        let ca_cert = dir.join("ca.crt");
        std::fs::write(&ca_cert, ca.pem())?;
        Ok(Pki { ca_cert, ca_params, ca_key, dir: dir.to_path_buf() })
    }

    /// A serving certificate for 127.0.0.1 and localhost.
    pub fn server(&self, name: &str) -> anyhow::Result<CertFiles> {
        let mut params = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(name, params)
    }

    /// A client certificate for `user` in `groups`.
    pub fn client(&self, name: &str, user: &str, groups: &[&str]) -> anyhow::Result<CertFiles> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, user);
        for g in groups {
            params.distinguished_name.push(DnType::OrganizationName, *g);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(name, params)
    }

    /// A client certificate for `user` that expired in 2021.
    pub fn expired_client(&self, name: &str, user: &str) -> anyhow::Result<CertFiles> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, user);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        self.sign(name, params)
    }

    fn sign(&self, name: &str, params: CertificateParams) -> anyhow::Result<CertFiles> {
        let key = KeyPair::generate()?;
        let issuer = Issuer::from_params(&self.ca_params, &self.ca_key);
        let cert = params.signed_by(&key, &issuer)?;
        let files = CertFiles { cert: self.dir.join(format!("{name}.crt")), key: self.dir.join(format!("{name}.key")) };
        std::fs::write(&files.cert, cert.pem())?;
        std::fs::write(&files.key, key.serialize_pem())?;
        Ok(files)
    }

    /// An ECDSA key pair for signing service-account tokens: (private, public) PEM files.
    pub fn service_account_key(&self) -> anyhow::Result<CertFiles> {
        let key = KeyPair::generate()?;
        let files = CertFiles { cert: self.dir.join("sa.pub"), key: self.dir.join("sa.key") };
        std::fs::write(&files.cert, key.public_key_pem())?;
        std::fs::write(&files.key, key.serialize_pem())?;
        Ok(files)
    }
}
