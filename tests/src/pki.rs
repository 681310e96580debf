//! A throwaway certificate authority for TLS tests: [`ferry_cluster::pki`], failing loudly.

pub use ferry_cluster::pki::Leaf;
pub use ferry_cluster::roles::PeerRole;

/// A CA whose files live as long as it does.
pub struct Pki(ferry_cluster::pki::Pki);

impl Pki {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Self {
        Self(ferry_cluster::pki::Pki::new(name).expect("a CA"))
    }

    /// The CA certificate, PEM.
    pub fn ca_pem(&self) -> &str {
        &self.0.ca_pem
    }

    /// The CA certificate file.
    pub fn ca(&self) -> std::path::PathBuf {
        self.0.ca()
    }

    /// A certificate for `names` (DNS names or IPs) signed by this CA, for `role` (its common
    /// name; none: `file`).
    pub fn issue(&self, file: &str, role: Option<PeerRole>, names: &[&str]) -> Leaf {
        self.0.issue(file, role, names).expect("a certificate")
    }

    /// Mutual TLS flags presenting `leaf`, trusting this CA.
    pub fn args(&self, leaf: &Leaf) -> ferry_cluster::mtls::InternalTlsArgs {
        self.0.args(leaf)
    }
}
