//! Mutual TLS between Ferry's daemons: the workers' gRPC (prefill, decode, bootstrap, load, KV
//! events, health) accepts only clients presenting a certificate signed by the cluster's CA,
//! and the router and decode workers present theirs and check the worker's against the same
//! CA. Certificates and keys come from PEM files. Failed handshakes are counted as bad input
//! (`reason="mtls_handshake"`). The KV data plane runs under the same certificates
//! ([`InternalTls::data_plane`](crate::mtls::InternalTls::data_plane): decode receivers serve
//! prefill senders only), and each room's secret is handed out over this channel.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::server::TlsStream;
use tonic::transport::Endpoint;

/// Mutual TLS flags, shared by every daemon.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct InternalTlsArgs {
    /// PEM certificate chain this daemon presents to the other Ferry daemons, as a gRPC server
    /// (workers) and as a client (router, decode → prefill); with --internal-tls-key and
    /// --internal-tls-ca it turns on mutual TLS between daemons. Unset: plaintext.
    #[arg(long, env = ferry_core::env::INTERNAL_TLS_CERT, requires_all = ["internal_tls_key", "internal_tls_ca"], help_heading = "TLS")]
    pub internal_tls_cert: Option<PathBuf>,
    /// PEM private key of --internal-tls-cert.
    #[arg(long, env = ferry_core::env::INTERNAL_TLS_KEY, requires = "internal_tls_cert", help_heading = "TLS")]
    pub internal_tls_key: Option<PathBuf>,
    /// PEM CA certificate(s) of the cluster: peers must present a certificate it signed.
    #[arg(long, env = ferry_core::env::INTERNAL_TLS_CA, requires = "internal_tls_cert", help_heading = "TLS")]
    pub internal_tls_ca: Option<PathBuf>,
    /// The name workers' certificates are checked against. Default: the host of the address
    /// the worker is reached at (its certificate must then name that host or IP).
    #[arg(long, env = ferry_core::env::INTERNAL_TLS_SERVER_NAME, help_heading = "TLS")]
    pub internal_tls_server_name: Option<String>,
    /// Run the gRPC and the KV data plane between the daemons in plaintext, without
    /// identities: anyone who reaches a worker's port can call it (read cached prompts, skip the
    /// router), and anyone who watches the data network reads KV pages and room keys. A daemon
    /// refuses to start without either this or --internal-tls-cert/-key/-ca. Logged at warn and
    /// exported as `ferry_insecure_internal` 1.
    #[arg(long, env = ferry_core::env::INSECURE_INTERNAL, help_heading = "TLS")]
    pub insecure_internal: bool,
}

impl InternalTlsArgs {
    /// Plaintext between the daemons (`--insecure-internal`).
    pub fn insecure() -> Self {
        Self { insecure_internal: true, ..Self::default() }
    }
}

/// Why the TLS files are unusable.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The PEM contents are wrong.
    #[error("{0}")]
    Invalid(String),
}

/// Loaded mutual TLS material.
#[derive(Clone)]
pub struct InternalTls {
    pub(crate) server_name: Option<String>,
    server: Arc<ServerConfig>,
    pub(crate) client: Arc<ClientConfig>,
}

impl std::fmt::Debug for InternalTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InternalTls").field("server_name", &self.server_name).finish_non_exhaustive()
    }
}

fn read(p: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(p).map_err(|source| TlsError::Read { path: p.to_path_buf(), source })
}

fn certs(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let c: Vec<_> = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Invalid(format!("{what}: {e}")))?;
    if c.is_empty() {
        return Err(TlsError::Invalid(format!("{what}: no certificate in the PEM file")));
    }
    Ok(c)
}

/// Logs that the daemons' gRPC runs plaintext, when `tls` is None (`--insecure-internal`).
pub fn warn_plaintext(tls: Option<&Arc<InternalTls>>) {
    if tls.is_none() {
        tracing::warn!(
            "--insecure-internal: gRPC and the KV data plane between the daemons are plaintext; anyone who reaches a worker's port can call it"
        );
    }
}

impl InternalTls {
    /// Reads and checks the files named by `args`; None when mutual TLS is off, which needs
    /// `--insecure-internal` (warned about and exported as `ferry_insecure_internal`).
    pub fn load(args: &InternalTlsArgs) -> Result<Option<Arc<Self>>, TlsError> {
        // Checked here, not by clap: clap counts FERRY_INSECURE_INTERNAL=false as present.
        if args.insecure_internal && args.internal_tls_cert.is_some() {
            return Err(TlsError::Invalid("--insecure-internal and --internal-tls-cert contradict each other".into()));
        }
        let (cert, key, ca) = match (&args.internal_tls_cert, &args.internal_tls_key, &args.internal_tls_ca) {
            (None, None, None) if args.insecure_internal => {
                // Warned about by the daemon once its logging is up (`warn_plaintext`): flags
                // are checked before that.
                crate::exporter::handle();
                metrics::gauge!(crate::metrics::INSECURE_INTERNAL).set(1.0);
                return Ok(None);
            }
            (None, None, None) => {
                return Err(TlsError::Invalid(
                    "the daemons' gRPC runs mutual TLS unless told otherwise: give --internal-tls-cert, \
                     --internal-tls-key and --internal-tls-ca, or --insecure-internal for plaintext"
                        .into(),
                ));
            }
            (Some(c), Some(k), Some(a)) => (read(c)?, read(k)?, read(a)?),
            _ => {
                return Err(TlsError::Invalid(
                    "--internal-tls-cert, --internal-tls-key and --internal-tls-ca go together".into(),
                ));
            }
        };
        let server = Arc::new(server_config(&cert, &key, &ca)?);
        let client = Arc::new(client_config(&cert, &key, &ca)?);
        Ok(Some(Arc::new(Self { server_name: args.internal_tls_server_name.clone(), server, client })))
    }

    /// The rustls server side (client certificates checked against the cluster CA).
    pub fn server_config(&self) -> &ServerConfig {
        &self.server
    }

    /// Wraps `listener`: yields connections whose client presented a certificate the CA
    /// signed; failed handshakes are counted for `role` and dropped.
    pub fn incoming(&self, listener: TcpListener, role: &'static str) -> Incoming {
        let acceptor = TlsAcceptor::from(Arc::clone(&self.server));
        let (rx, task) = accept_tls(listener, acceptor, role, "mtls_handshake");
        Incoming { rx, task }
    }
}

/// Accepts on `listener` and runs each TLS handshake off the accept loop, bounded by 10 s, so
/// that a slow or broken client holds up no other; finished connections come out of the
/// receiver, failed handshakes are counted as bad input (`role`, `reason`) and dropped. The
/// task ends when aborted.
pub fn accept_tls(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    role: &'static str,
    reason: &'static str,
) -> (mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel(64);
    let task = tokio::spawn(async move {
        loop {
            let (tcp, peer) = match listener.accept().await {
                Ok(c) => {
                    crate::accept::nodelay(&c.0);
                    c
                }
                Err(e) => {
                    tracing::debug!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => {
                        let _ = tx.send((tls, peer)).await;
                    }
                    // A connection closed during the handshake without an alert (a TCP probe, a
                    // port scan; also a client that gave up) is not counted nor warned about:
                    // probes would drown the real failures.
                    Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                        tracing::debug!(%peer, "connection closed before a TLS handshake");
                    }
                    Ok(Err(e)) => {
                        metrics::counter!(crate::metrics::BAD_REQUESTS, "role" => role, "reason" => reason)
                            .increment(1);
                        tracing::warn!(%peer, error = %e, reason, "TLS handshake failed");
                    }
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    (rx, task)
}

fn server_config(cert: &[u8], key: &[u8], ca: &[u8]) -> Result<ServerConfig, TlsError> {
    let chain = certs(cert, "--internal-tls-cert")?;
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| TlsError::Invalid(format!("--internal-tls-key: {e}")))?;
    let provider = ferry_core::tls::crypto_provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), Arc::clone(&provider))
        .build()
        .map_err(|e| TlsError::Invalid(format!("--internal-tls-ca: {e}")))?;
    let mut c = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Invalid(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| TlsError::Invalid(format!("--internal-tls-cert / --internal-tls-key: {e}")))?;
    c.alpn_protocols = vec![b"h2".to_vec()];
    Ok(c)
}

fn roots(ca: &[u8]) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in certs(ca, "--internal-tls-ca")? {
        roots.add(c).map_err(|e| TlsError::Invalid(format!("--internal-tls-ca: {e}")))?;
    }
    Ok(roots)
}

/// The client side ([`crate::dial`]): presents `cert`, trusts `ca`, speaks HTTP/2.
fn client_config(cert: &[u8], key: &[u8], ca: &[u8]) -> Result<ClientConfig, TlsError> {
    let chain = certs(cert, "--internal-tls-cert")?;
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| TlsError::Invalid(format!("--internal-tls-key: {e}")))?;
    let provider = ferry_core::tls::crypto_provider();
    let mut c = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Invalid(e.to_string()))?
        .with_root_certificates(roots(ca)?)
        .with_client_auth_cert(chain, key)
        .map_err(|e| TlsError::Invalid(format!("--internal-tls-cert / --internal-tls-key: {e}")))?;
    c.alpn_protocols = vec![b"h2".to_vec()];
    Ok(c)
}

/// How often a connection to another daemon is pinged (HTTP/2 PING) while a call is open on
/// it, and how long an answer may take before the connection, and every call on it, fails
/// with UNAVAILABLE. A frozen or partitioned peer (SIGSTOP, a dead host: no FIN, no RST; its
/// kernel may even keep TCP alive) then ends the calls waiting on it within 8 s, where they
/// used to wait for the worker's own timeouts (300 s) or forever.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(3);
/// See [`KEEPALIVE_INTERVAL`].
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// An address another daemon cannot be dialled at (its scheme, its form, its server name).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BadAddress(pub String);

/// Refuses an address whose scheme contradicts the cluster's internal TLS mode: with mutual
/// TLS on, `http://` would have made the connection plaintext (tonic applies TLS to `https`
/// only), so one discovery entry could downgrade it; with it off, `https://` cannot work.
/// Addresses without a scheme take the cluster's.
pub fn check_scheme(addr: &str, tls: bool) -> Result<(), BadAddress> {
    let Some((scheme, _)) = addr.split_once("://") else { return Ok(()) };
    match (scheme.to_ascii_lowercase().as_str(), tls) {
        ("https", true) | ("http", false) => Ok(()),
        ("http", true) => Err(BadAddress(format!("{addr}: plaintext http:// refused: internal mutual TLS is on"))),
        (s, on) => Err(BadAddress(format!(
            "{addr}: scheme {s:?} does not match internal TLS ({})",
            if on { "on" } else { "off" }
        ))),
    }
}

/// A plaintext endpoint for another daemon's gRPC at `addr` (`host:port` or `http://`), pinged
/// while calls are open ([`KEEPALIVE_INTERVAL`]). Under mutual TLS, [`crate::dial::channel`]
/// connects through it with its own TLS connector.
pub(crate) fn endpoint(addr: &str) -> Result<Endpoint, BadAddress> {
    let uri = if addr.contains("://") { addr.to_string() } else { format!("http://{addr}") };
    Ok(Endpoint::from_shared(uri)
        .map_err(|e| BadAddress(format!("{addr}: {e}")))?
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(false))
}

/// Finished mutual TLS connections of one listener (a stream for tonic's
/// `serve_with_incoming`).
pub struct Incoming {
    rx: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Incoming {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Stream for Incoming {
    type Item = std::io::Result<TlsStream<TcpStream>>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx).map(|c| c.map(|(tls, _)| Ok(tls)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plaintext_is_asked_for_explicitly_and_never_with_certificates() {
        let pki = crate::pki::Pki::new("mtls test CA").expect("ca");
        let leaf = pki.issue("w", Some(crate::roles::PeerRole::Prefill), &["localhost"]).expect("leaf");
        let e = InternalTls::load(&InternalTlsArgs::default()).expect_err("neither");
        assert!(e.to_string().contains("--insecure-internal"), "{e}");
        assert!(InternalTls::load(&InternalTlsArgs::insecure()).expect("plaintext").is_none());
        // FERRY_INSECURE_INTERNAL=false beside the certificate flags: mutual TLS.
        assert!(InternalTls::load(&pki.args(&leaf)).expect("mutual TLS").is_some());
        let both = InternalTlsArgs { insecure_internal: true, ..pki.args(&leaf) };
        assert!(InternalTls::load(&both).expect_err("contradiction").to_string().contains("contradict"));
    }

    #[test]
    fn an_address_cannot_downgrade_internal_tls() {
        assert!(check_scheme("10.0.0.1:7000", true).is_ok());
        assert!(check_scheme("https://w:7000", true).is_ok());
        assert!(check_scheme("HTTP://w:7000", true).expect_err("downgrade").to_string().contains("plaintext"));
        assert!(check_scheme("http://w:7000", false).is_ok());
        assert!(check_scheme("https://w:7000", false).is_err());
        assert!(check_scheme("ftp://w:7000", true).is_err());
        assert!(endpoint("http://w:7000").is_ok());
    }
}
