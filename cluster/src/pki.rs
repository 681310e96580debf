//! A throwaway certificate authority: a cluster CA and the certificates it signs, written as
//! PEM files to a temporary directory that lives as long as the [`Pki`]. `ferry up` makes one
//! per run so every connection between its daemons is mutual TLS by default; the tests use it
//! too.

use std::path::PathBuf;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

use crate::mtls::InternalTlsArgs;
use crate::roles::PeerRole;

/// Why a CA or certificate could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// Generating a key or signing a certificate failed.
    #[error("certificate: {0}")]
    Cert(#[from] rcgen::Error),
    /// Writing the files failed.
    #[error("writing certificates: {0}")]
    Io(#[from] std::io::Error),
}

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
    pub fn new(name: &str) -> Result<Self, PkiError> {
        let dir = tempfile::Builder::new().prefix("ferry-pki-").tempdir()?;
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let ca_pem = params.self_signed(&key)?.pem();
        std::fs::write(dir.path().join("ca.pem"), &ca_pem)?;
        Ok(Self { dir, issuer: Issuer::new(params, key), ca_pem })
    }

    /// The CA certificate file.
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// A certificate for `names` (DNS names or IPs) signed by this CA, written as
    /// `<file>.pem` / `<file>.key` (the key readable by this user only). Its common name is
    /// the `role`'s (`ferry-router`, ...: [`crate::roles`]), or `file` when it has none.
    pub fn issue(&self, file: &str, role: Option<PeerRole>, names: &[&str]) -> Result<Leaf, PkiError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())?;
        params
            .distinguished_name
            .push(DnType::CommonName, role.map_or(file.to_string(), |r| r.common_name().to_string()));
        let cert_pem = params.signed_by(&key, &self.issuer)?.pem();
        let key_pem = key.serialize_pem();
        let cert = self.dir.path().join(format!("{file}.pem"));
        let keyf = self.dir.path().join(format!("{file}.key"));
        std::fs::write(&cert, &cert_pem)?;
        write_private(&keyf, &key_pem)?;
        Ok(Leaf { cert, key: keyf, cert_pem, key_pem })
    }

    /// Mutual TLS flags presenting `leaf`, trusting this CA.
    pub fn args(&self, leaf: &Leaf) -> InternalTlsArgs {
        InternalTlsArgs {
            internal_tls_cert: Some(leaf.cert.clone()),
            internal_tls_key: Some(leaf.key.clone()),
            internal_tls_ca: Some(self.ca()),
            internal_tls_server_name: None,
            insecure_internal: false,
        }
    }
}

fn write_private(path: &std::path::Path, contents: &str) -> std::io::Result<()> {
    use std::io::Write;
    #[cfg(unix)]
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    o.mode(0o600);
    o.open(path)?.write_all(contents.as_bytes())
}
