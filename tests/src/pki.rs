//! A throwaway certificate authority for TLS tests: a CA and certificates it signs, written
//! as PEM files to a temporary directory.

use std::path::PathBuf;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

/// A CA whose files live as long as it does.
pub struct Pki {
    dir: tempfile::TempDir,
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate, PEM.
    pub ca_pem: String,
}

/// A certificate and key written by [`Pki::issue`].
#[derive(Debug, Clone)]
pub struct Leaf {
    /// Certificate chain file.
    pub cert: PathBuf,
    /// Private key file.
    pub key: PathBuf,
    /// The certificate, PEM.
    pub cert_pem: String,
    /// The key, PEM.
    pub key_pem: String,
}

impl Pki {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let ca_pem = params.self_signed(&key).expect("CA certificate").pem();
        std::fs::write(dir.path().join("ca.pem"), &ca_pem).expect("write the CA");
        Self { dir, issuer: Issuer::new(params, key), ca_pem }
    }

    /// The CA certificate file.
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// A certificate for `names` (DNS names or IPs) signed by this CA, written as
    /// `<file>.pem` / `<file>.key`.
    pub fn issue(&self, file: &str, names: &[&str]) -> Leaf {
        let key = KeyPair::generate().expect("key");
        let mut params =
            CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).expect("params");
        params.distinguished_name.push(DnType::CommonName, file);
        let cert_pem = params.signed_by(&key, &self.issuer).expect("signed").pem();
        let key_pem = key.serialize_pem();
        let cert = self.dir.path().join(format!("{file}.pem"));
        let keyf = self.dir.path().join(format!("{file}.key"));
        std::fs::write(&cert, &cert_pem).expect("write the certificate");
        std::fs::write(&keyf, &key_pem).expect("write the key");
        Leaf { cert, key: keyf, cert_pem, key_pem }
    }

    /// Mutual TLS flags presenting `leaf`, trusting this CA.
    pub fn args(&self, leaf: &Leaf) -> ferry_cluster::mtls::InternalTlsArgs {
        ferry_cluster::mtls::InternalTlsArgs {
            internal_tls_cert: Some(leaf.cert.clone()),
            internal_tls_key: Some(leaf.key.clone()),
            internal_tls_ca: Some(self.ca()),
            internal_tls_server_name: None,
        }
    }
}
