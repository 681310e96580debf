//! Roles under mutual TLS: which kind of Ferry daemon a peer is, read from its certificate,
//! and which worker services each kind may call.
//!
//! A certificate names its role in its subject's common name: `ferry-router`, `ferry-prefill`
//! or `ferry-decode` (the way Kubernetes reads a client certificate's CN as the user name; it
//! is also what Helm's `genSignedCert` can write). Under mutual TLS a worker serves:
//!
//! | service                          | callers        |
//! |----------------------------------|----------------|
//! | `Prefill`, `Decode`, `KvEvents`, `Load` | the router |
//! | `Bootstrap` (room handshakes)    | decode workers |
//! | `grpc.health.v1.Health`          | any certificate the CA signed |
//!
//! Any other caller gets `PERMISSION_DENIED` (reason `wrong_role`, counted in
//! `ferry_bad_requests_total`) before the call reaches the service. With mutual TLS off
//! (`--insecure-internal`) there is no identity to check and every call is served.

use tokio_rustls::rustls::pki_types::CertificateDer;
use tonic::{Code, Request, Status};

use crate::Refused;

/// The kind of daemon a certificate stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerRole {
    /// The router: calls every worker service but `Bootstrap`.
    Router,
    /// A prefill worker: calls no worker service (it writes KV on the data plane).
    Prefill,
    /// A decode worker: calls `Bootstrap` on prefill workers.
    Decode,
}

impl PeerRole {
    /// Every role.
    pub const ALL: [PeerRole; 3] = [PeerRole::Router, PeerRole::Prefill, PeerRole::Decode];

    /// `router`, `prefill`, `decode`.
    pub fn as_str(self) -> &'static str {
        match self {
            PeerRole::Router => "router",
            PeerRole::Prefill => "prefill",
            PeerRole::Decode => "decode",
        }
    }

    /// The subject common name a certificate for this role carries: `ferry-<role>`.
    pub fn common_name(self) -> &'static str {
        match self {
            PeerRole::Router => "ferry-router",
            PeerRole::Prefill => "ferry-prefill",
            PeerRole::Decode => "ferry-decode",
        }
    }

    /// The role whose [`common_name`](Self::common_name) is `cn`.
    pub fn from_common_name(cn: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.common_name() == cn)
    }
}

impl std::fmt::Display for PeerRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A certificate that names no role, or another role than the one expected: what it is
/// instead (for the refusal's message).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RoleError(String);

impl RoleError {
    /// A peer that presented no certificate.
    pub fn no_certificate() -> Self {
        Self("no certificate".into())
    }
}

/// The role `cert` (DER) names, or what it names instead.
pub fn role_of(cert: &CertificateDer<'_>) -> Result<PeerRole, RoleError> {
    let bad = |why: String| RoleError(why);
    let (_, parsed) =
        x509_parser::parse_x509_certificate(cert.as_ref()).map_err(|e| bad(format!("unreadable: {e}")))?;
    let mut names = parsed.subject().iter_common_name();
    let cn = match (names.next(), names.next()) {
        (Some(cn), None) => cn.as_str().map_err(|e| bad(format!("common name unreadable: {e}")))?,
        (None, _) => return Err(bad("no common name".into())),
        (Some(_), Some(_)) => return Err(bad("more than one common name".into())),
    };
    PeerRole::from_common_name(cn).ok_or_else(|| bad(format!("common name {cn:?} names no Ferry role")))
}

/// Whether `chain` (leaf first) belongs to a daemon of `role`; `Err` says what it is instead.
pub fn expect_role(chain: &[CertificateDer<'_>], role: PeerRole) -> Result<(), RoleError> {
    match chain.first().map(role_of) {
        Some(Ok(r)) if r == role => Ok(()),
        Some(Ok(r)) => Err(RoleError(format!("its certificate is for the {r}, not the {role}"))),
        Some(Err(why)) => Err(RoleError(format!("its certificate has {why}"))),
        None => Err(RoleError("it presented no certificate".into())),
    }
}

/// Serves a call to `service` only when the peer's certificate names one of `allowed`; an
/// interceptor for a generated server (`XServer::with_interceptor`).
#[derive(Debug, Clone, Copy)]
pub struct Only {
    service: &'static str,
    allowed: &'static [PeerRole],
    mtls: bool,
    daemon: &'static str,
}

/// [`Only`] for `service` on the daemon `daemon` (a metrics label); `mtls` says whether the
/// listener runs mutual TLS (without it there is no identity to check).
pub fn only(service: &'static str, allowed: &'static [PeerRole], mtls: bool, daemon: &'static str) -> Only {
    Only { service, allowed, mtls, daemon }
}

impl Only {
    /// Whether `certs` (the peer's chain, leaf first) may call the service.
    pub fn check(&self, certs: Option<&[CertificateDer<'static>]>) -> Result<PeerRole, Refused> {
        // The message is built only for a refusal: this runs on every call.
        let refuse = |why: String| {
            let wanted = self.allowed.iter().map(|r| r.as_str()).collect::<Vec<_>>().join(" or ");
            Refused::new(
                Code::PermissionDenied,
                "wrong_role",
                format!("{} is served to the {wanted} only: the caller's certificate {why}", self.service),
            )
        };
        let leaf = certs.and_then(|c| c.first()).ok_or_else(|| refuse("is missing".into()))?;
        match role_of(leaf) {
            Ok(role) if self.allowed.contains(&role) => Ok(role),
            Ok(role) => Err(refuse(format!("is for the {role}"))),
            Err(why) => Err(refuse(format!("has {why}"))),
        }
    }
}

impl tonic::service::Interceptor for Only {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        if !self.mtls {
            return Ok(req);
        }
        let certs = req.peer_certs();
        match self.check(certs.as_deref().map(|c| c.as_slice())) {
            Ok(_) => Ok(req),
            Err(refused) => Err(refused.status(self.daemon)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki::Pki;

    fn der(pem: &str) -> CertificateDer<'static> {
        use tokio_rustls::rustls::pki_types::pem::PemObject;
        CertificateDer::from_pem_slice(pem.as_bytes()).expect("pem")
    }

    #[test]
    fn a_certificate_names_its_role_in_its_common_name() {
        let pki = Pki::new("roles test CA").expect("ca");
        for role in PeerRole::ALL {
            let leaf = pki.issue(role.as_str(), Some(role), &["localhost"]).expect("leaf");
            assert_eq!(role_of(&der(&leaf.cert_pem)), Ok(role));
        }
        let plain = pki.issue("member", None, &["localhost"]).expect("leaf");
        let e = role_of(&der(&plain.cert_pem)).expect_err("no role");
        assert!(e.to_string().contains("\"member\""), "{e}");
    }

    #[test]
    fn only_the_allowed_roles_pass() {
        let pki = Pki::new("roles test CA").expect("ca");
        let n = std::cell::Cell::new(0);
        let leaf = |r| {
            n.set(n.get() + 1);
            vec![der(&pki.issue(&format!("w{}", n.get()), r, &["localhost"]).expect("leaf").cert_pem)]
        };
        let gate = only("Bootstrap", &[PeerRole::Decode], true, "prefill");
        assert_eq!(gate.check(Some(&leaf(Some(PeerRole::Decode)))), Ok(PeerRole::Decode));
        for wrong in [Some(PeerRole::Router), Some(PeerRole::Prefill), None] {
            let e = gate.check(Some(&leaf(wrong))).expect_err("refused");
            assert_eq!((e.code, e.reason), (Code::PermissionDenied, "wrong_role"));
            assert!(e.message.starts_with("Bootstrap is served to the decode only"), "{}", e.message);
        }
        assert!(gate.check(None).expect_err("no certificate").message.contains("missing"));
    }
}
