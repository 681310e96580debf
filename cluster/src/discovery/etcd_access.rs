//! How a daemon reaches etcd: TLS (the CA etcd's certificate must chain to, and optionally a
//! client certificate for etcd's `--client-cert-auth`) and user/password authentication
//! (etcd's role-based access control). Loaded from the `--etcd-*` flags; the password comes
//! from a file so it shows in neither `ps` nor a unit's environment.

use std::path::Path;

use etcd_client::ConnectOptions;

use super::etcd::EtcdError;

/// TLS and authentication towards etcd. The default is plaintext without authentication.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct EtcdAccess {
    tls: Option<EtcdTls>,
    user: Option<(String, String)>,
}

#[derive(Clone, PartialEq, Eq)]
struct EtcdTls {
    ca: Vec<u8>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for EtcdAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdAccess")
            .field("tls", &self.tls.as_ref().map(|t| if t.identity.is_some() { "mutual" } else { "server" }))
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .finish()
    }
}

fn read(flag: &str, p: &Path) -> Result<Vec<u8>, EtcdError> {
    std::fs::read(p).map_err(|e| EtcdError::Invalid(format!("{flag} {}: {e}", p.display())))
}

impl EtcdAccess {
    /// Reads the files: `ca` turns TLS on, `cert_key` adds a client certificate, `user` a
    /// user and the file holding its password (its first line).
    pub fn load(
        ca: Option<&Path>,
        cert_key: Option<(&Path, &Path)>,
        user: Option<(&str, &Path)>,
    ) -> Result<Self, EtcdError> {
        let tls = match (ca, cert_key) {
            (None, None) => None,
            (None, Some(_)) => return Err(EtcdError::Invalid("--etcd-cert needs --etcd-ca".into())),
            (Some(ca), ck) => Some(EtcdTls {
                ca: read("--etcd-ca", ca)?,
                identity: match ck {
                    None => None,
                    Some((c, k)) => Some((read("--etcd-cert", c)?, read("--etcd-key", k)?)),
                },
            }),
        };
        let user = match user {
            None => None,
            Some((name, file)) => {
                let raw = read("--etcd-password-file", file)?;
                let text = String::from_utf8(raw)
                    .map_err(|_| EtcdError::Invalid(format!("--etcd-password-file {}: not UTF-8", file.display())))?;
                let password = text.lines().next().unwrap_or("").to_string();
                if password.is_empty() {
                    return Err(EtcdError::Invalid(format!("--etcd-password-file {}: empty", file.display())));
                }
                Some((name.to_string(), password))
            }
        };
        Ok(Self { tls, user })
    }

    /// Whether the connection to etcd is TLS.
    pub fn tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Refuses an endpoint whose scheme contradicts the TLS mode (`http://` with TLS on would
    /// be refused by the client anyway, `https://` with it off would fail on connect).
    pub fn check_endpoint(&self, endpoint: &str) -> Result<(), EtcdError> {
        let tls = self.tls();
        match endpoint.split_once("://").map(|(s, _)| s.to_ascii_lowercase()) {
            None => Ok(()),
            Some(s) if (s == "https" && tls) || (s == "http" && !tls) => Ok(()),
            Some(s) => Err(EtcdError::Invalid(format!(
                "--etcd {endpoint}: scheme {s}:// does not match TLS to etcd ({})",
                if tls { "on: --etcd-ca is set" } else { "off: no --etcd-ca" }
            ))),
        }
    }

    /// Refuses to send a password in plaintext: a user without `--etcd-ca` is allowed only
    /// when every endpoint is on this machine (loopback).
    pub fn check_password_route(&self, endpoints: &[String]) -> Result<(), EtcdError> {
        if self.user.is_none() || self.tls() {
            return Ok(());
        }
        match endpoints.iter().find(|e| !loopback(e)) {
            None => Ok(()),
            Some(e) => Err(EtcdError::Invalid(format!(
                "--etcd-user without --etcd-ca would send the password in plaintext to {e}: turn on TLS to etcd"
            ))),
        }
    }

    /// `opts` with TLS and the user added.
    pub fn apply(&self, mut opts: ConnectOptions) -> ConnectOptions {
        if let Some(t) = &self.tls {
            let mut c = etcd_client::TlsOptions::new().ca_certificate(etcd_client::Certificate::from_pem(&t.ca));
            if let Some((cert, key)) = &t.identity {
                c = c.identity(etcd_client::Identity::from_pem(cert, key));
            }
            opts = opts.with_tls(c);
        }
        if let Some((user, password)) = &self.user {
            opts = opts.with_user(user.clone(), password.clone());
        }
        opts
    }

    /// `e` with what it likely means for these flags, where etcd's words alone do not say
    /// which flag to look at (an error of another kind is returned as it is).
    pub fn explain(&self, e: EtcdError) -> EtcdError {
        let EtcdError::Client(source) = e else { return e };
        let tls = self.tls.as_ref().map(|t| t.identity.is_some());
        match hint(&source.to_string(), tls) {
            Some(hint) => EtcdError::Access { hint, source },
            None => EtcdError::Client(source),
        }
    }
}

/// What a client error's text means for access flags, given TLS off (`None`) or on, with a
/// client certificate or without.
fn hint(error: &str, tls: Option<bool>) -> Option<&'static str> {
    let closed = error.contains("hyper::Error")
        && ["BrokenPipe", "ConnectionReset", "\"connection closed\""].iter().any(|k| error.contains(k));
    let refused_cert = ["BadCertificate", "CertificateRequired", "UnknownCA"].iter().any(|a| error.contains(a));
    if error.contains("user name is empty") {
        Some("etcd's authentication is on and no user was given (--etcd-user, --etcd-password-file)")
    } else if error.contains("invalid user ID or password") {
        Some("etcd refused the user name or password (--etcd-user, --etcd-password-file)")
    } else if tls == Some(false) && (refused_cert || closed) {
        Some("etcd wants a client certificate and none was given (--etcd-cert, --etcd-key)")
    } else if refused_cert {
        Some("etcd refused this client's TLS certificate (--etcd-cert, --etcd-key: signed by a CA etcd trusts?)")
    } else if tls.is_none() && closed {
        Some("etcd closed the connection (if it serves TLS, give --etcd-ca)")
    } else {
        None
    }
}

/// Whether an endpoint (`host:port`, maybe with a scheme) is on this machine.
fn loopback(endpoint: &str) -> bool {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    let host = rest.rsplit_once(':').map_or(rest, |(h, _)| h).trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost") || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_errors_name_the_access_flags_behind_them() {
        // etcd 3.4's and the TLS stack's words, as a worker meets them; a plaintext client
        // refused by a TLS etcd, or a client without the certificate etcd asks for, sees
        // either a broken pipe or a closed connection (11 and 1 of 12 tries).
        let pipe = "tonic::transport::Error(Transport, hyper::Error(Io, Custom { kind: BrokenPipe, .. }))";
        let closed = "tonic::transport::Error(Transport, hyper::Error(Canceled, \"connection closed\"))";
        let alert = "transport error ... received fatal alert: BadCertificate";
        let cases = [
            ("message: \"etcdserver: user name is empty\"", None, Some("no user was given")),
            (
                "etcdserver: authentication failed, invalid user ID or password",
                Some(true),
                Some("user name or password"),
            ),
            (pipe, None, Some("if it serves TLS, give --etcd-ca")),
            (closed, None, Some("if it serves TLS, give --etcd-ca")),
            (pipe, Some(false), Some("wants a client certificate and none was given")),
            (closed, Some(false), Some("wants a client certificate and none was given")),
            (alert, Some(false), Some("wants a client certificate and none was given")),
            (alert, Some(true), Some("refused this client's TLS certificate")),
            (closed, Some(true), None),
            ("etcdserver: request timed out", None, None),
        ];
        for (error, tls, says) in cases {
            let got = hint(error, tls);
            assert_eq!(got.is_some(), says.is_some(), "{error} ({tls:?}): {got:?}");
            if let (Some(got), Some(says)) = (got, says) {
                assert!(got.contains(says), "{error} ({tls:?}): {got}");
            }
        }
    }

    #[test]
    fn files_are_read_and_schemes_checked() {
        let dir = tempfile::tempdir().expect("dir");
        let (ca, pw, empty) = (dir.path().join("ca.pem"), dir.path().join("pw"), dir.path().join("empty"));
        std::fs::write(&ca, "not checked until connect").expect("write");
        std::fs::write(&pw, "s3cret\nignored\n").expect("write");
        std::fs::write(&empty, "\n").expect("write");
        let a = EtcdAccess::load(Some(&ca), None, Some(("ferry", &pw))).expect("loads");
        assert!(a.tls());
        assert_eq!(a.user.as_ref().map(|(u, p)| (u.as_str(), p.as_str())), Some(("ferry", "s3cret")));
        assert!(!format!("{a:?}").contains("s3cret"), "the password stays out of logs: {a:?}");
        assert!(a.check_endpoint("https://e:2379").is_ok() && a.check_endpoint("e:2379").is_ok());
        assert!(a.check_endpoint("http://e:2379").is_err(), "no downgrade to plaintext");
        assert!(EtcdAccess::default().check_endpoint("https://e:2379").is_err());
        let e = EtcdAccess::load(None, None, Some(("ferry", &empty))).expect_err("empty password");
        assert!(e.to_string().contains("empty"), "{e}");
        let e = EtcdAccess::load(Some(&dir.path().join("nope")), None, None).expect_err("missing CA");
        assert!(e.to_string().contains("--etcd-ca"), "{e}");

        // A password goes in plaintext only to a loopback etcd.
        let plain = EtcdAccess::load(None, None, Some(("ferry", &pw))).expect("loads");
        let eps = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(plain.check_password_route(&eps(&["127.0.0.1:2379", "http://localhost:2379", "[::1]:2379"])).is_ok());
        let e = plain.check_password_route(&eps(&["127.0.0.1:2379", "10.0.0.2:2379"])).expect_err("remote");
        assert!(e.to_string().contains("10.0.0.2:2379"), "{e}");
        assert!(a.check_password_route(&eps(&["10.0.0.2:2379"])).is_ok(), "over TLS");
    }
}
