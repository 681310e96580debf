//! Optional TLS on the router's public endpoints: one PEM certificate chain and key serve the
//! gRPC API (through tonic, ALPN h2) and the OpenAI HTTP API (through rustls, ALPN
//! http/1.1). Handshakes run off the accept loop, bounded by a timeout, so a slow or broken
//! client cannot hold up the others.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::server::TlsStream;

/// A certificate chain and its key, PEM.
#[derive(Clone)]
pub struct Tls {
    cert: Vec<u8>,
    key: Vec<u8>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("cert_bytes", &self.cert.len()).finish_non_exhaustive()
    }
}

/// Why the router's TLS could not be set up (`--tls-cert`, `--tls-key`): a file, its
/// contents, or the listener.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TlsError(String);

impl Tls {
    /// Reads and checks `cert` and `key`.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let read = |p: &Path| std::fs::read(p).map_err(|e| TlsError(format!("{}: {e}", p.display())));
        let t = Self { cert: read(cert)?, key: read(key)? };
        t.server_config(Vec::new()).map_err(|e| TlsError(format!("{} / {}: {e}", cert.display(), key.display())))?;
        Ok(t)
    }

    fn server_config(&self, alpn: Vec<Vec<u8>>) -> Result<ServerConfig, TlsError> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&self.cert)
            .collect::<Result<_, _>>()
            .map_err(|e| TlsError(format!("certificate: {e}")))?;
        if certs.is_empty() {
            return Err(TlsError("no certificate in the PEM file".into()));
        }
        let key = PrivateKeyDer::from_pem_slice(&self.key).map_err(|e| TlsError(format!("private key: {e}")))?;
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let mut c = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(|e| TlsError(e.to_string()))?;
        c.alpn_protocols = alpn;
        Ok(c)
    }

    /// tonic's server TLS configuration.
    pub fn grpc(&self) -> tonic::transport::ServerTlsConfig {
        tonic::transport::ServerTlsConfig::new().identity(tonic::transport::Identity::from_pem(&self.cert, &self.key))
    }

    /// Wraps `listener` so that it yields finished TLS connections (for axum).
    pub fn http_listener(&self, listener: TcpListener) -> Result<TlsListener, TlsError> {
        let addr = listener.local_addr().map_err(|e| TlsError(e.to_string()))?;
        let acceptor = TlsAcceptor::from(Arc::new(self.server_config(vec![b"http/1.1".to_vec()])?));
        let (rx, task) = ferry_cluster::mtls::accept_tls(listener, acceptor, "router", "tls_handshake");
        Ok(TlsListener { rx, addr, task })
    }
}

/// Finished TLS connections of one listener.
pub struct TlsListener {
    rx: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accept task only ends when this listener is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.addr)
    }
}
