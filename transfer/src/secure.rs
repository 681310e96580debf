//! Who may use the data plane, and what an observer of it sees: [`Security::Tls`] runs every
//! data-plane connection (tcp frames, the rdma connection exchange) inside mutual TLS with the
//! cluster's certificates, and checks the peer's role both ways — a receiver (decode node)
//! serves only senders whose certificate names a prefill node, a sender talks only to a
//! receiver whose certificate names a decode node. [`Security::Plain`] is the explicit
//! `--insecure-internal` mode: plaintext, no identities (room secrets still guard each room).
//!
//! The daemons build the TLS side from their internal certificates
//! (`ferry_cluster::mtls::InternalTls::data_plane`); the roles are read there, so this crate
//! takes them as two checks. Connections that fail the handshake or the role check are dropped
//! and counted in `ferry_transfer_connections_refused_total{reason="tls_handshake"|"wrong_role"}`.
//! The data plane offers its own ALPN protocol id ([`ALPN`]), so it cannot be mistaken for the
//! daemons' gRPC (h2) nor the other way round.

use std::io::IoSlice;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, ServerConfig};
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// The data plane's ALPN protocol id.
pub const ALPN: &[u8] = b"ferry-kv/1";

/// Longest a TLS handshake on the data plane may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Checks a peer's certificate chain (leaf first); `Err` says what the peer is instead.
pub type PeerCheck = Arc<dyn Fn(&[CertificateDer<'_>]) -> Result<(), PeerRefused> + Send + Sync>;

/// Why a peer's certificate chain was refused: what the peer is instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PeerRefused(pub String);

/// Mutual TLS for the data plane: this node's certificate, the cluster CA, and the roles a
/// peer must have on each side.
pub struct DataTls {
    acceptor: TlsAcceptor,
    connector: TlsConnector,
    server_name: Option<String>,
    sender_check: PeerCheck,
    receiver_check: PeerCheck,
}

impl std::fmt::Debug for DataTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataTls").field("server_name", &self.server_name).finish_non_exhaustive()
    }
}

impl DataTls {
    /// From the daemon's TLS configurations (the server side must verify client certificates
    /// against the cluster CA); `server_name` is the name a receiver's certificate is checked
    /// against (None: the host of the address dialled). `sender_check` is what a receiver
    /// asks of a sender's chain, `receiver_check` what a sender asks of a receiver's.
    pub fn new(
        server: &ServerConfig,
        client: &ClientConfig,
        server_name: Option<String>,
        sender_check: PeerCheck,
        receiver_check: PeerCheck,
    ) -> Self {
        let mut s = server.clone();
        s.alpn_protocols = vec![ALPN.to_vec()];
        let mut c = client.clone();
        c.alpn_protocols = vec![ALPN.to_vec()];
        Self {
            acceptor: TlsAcceptor::from(Arc::new(s)),
            connector: TlsConnector::from(Arc::new(c)),
            server_name,
            sender_check,
            receiver_check,
        }
    }
}

/// How the data plane is protected.
#[derive(Debug, Clone, Default)]
pub enum Security {
    /// Plaintext, no identities (`--insecure-internal`; tests of the protocol itself).
    #[default]
    Plain,
    /// Mutual TLS with role checks.
    Tls(Arc<DataTls>),
}

fn refused(kind: std::io::ErrorKind, why: String) -> std::io::Error {
    std::io::Error::new(kind, why)
}

impl Security {
    /// Whether connections run mutual TLS.
    pub fn is_tls(&self) -> bool {
        matches!(self, Self::Tls(_))
    }

    /// Receiver side: the TLS handshake (within [`HANDSHAKE_TIMEOUT`]) and the sender's role.
    /// A refusal is counted (`tls_handshake`, `wrong_role`) and returned.
    pub async fn accept(&self, tcp: TcpStream) -> std::io::Result<DataStream> {
        let Self::Tls(t) = self else { return Ok(DataStream::Plain(tcp)) };
        let peer = tcp.peer_addr().ok();
        let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, t.acceptor.accept(tcp)).await {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                crate::metrics::connection_refused("tls_handshake");
                tracing::warn!(?peer, error = %e, "data-plane TLS handshake failed");
                return Err(e);
            }
            Err(_) => {
                crate::metrics::connection_refused("tls_handshake");
                return Err(refused(std::io::ErrorKind::TimedOut, "data-plane TLS handshake timed out".into()));
            }
        };
        let chain = tls.get_ref().1.peer_certificates().unwrap_or(&[]);
        if let Err(why) = (t.sender_check)(chain) {
            crate::metrics::connection_refused("wrong_role");
            tracing::warn!(?peer, %why, "data-plane peer refused: not a prefill node");
            return Err(refused(std::io::ErrorKind::PermissionDenied, format!("data-plane peer refused: {why}")));
        }
        Ok(DataStream::Tls(Box::new(tls.into())))
    }

    /// Sender side: connects to `addr`, then (under TLS) shakes hands and checks that the
    /// receiver is a decode node.
    pub async fn connect(&self, addr: SocketAddr) -> std::io::Result<DataStream> {
        let tcp = TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        let Self::Tls(t) = self else { return Ok(DataStream::Plain(tcp)) };
        let host = addr.ip().to_string();
        let name = t.server_name.clone().unwrap_or(host);
        let name = ServerName::try_from(name.clone())
            .map_err(|e| refused(std::io::ErrorKind::InvalidInput, format!("server name {name:?}: {e}")))?;
        let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, t.connector.connect(name, tcp)).await {
            Ok(r) => r?,
            Err(_) => return Err(refused(std::io::ErrorKind::TimedOut, format!("{addr}: TLS handshake timed out"))),
        };
        let chain = tls.get_ref().1.peer_certificates().unwrap_or(&[]);
        if let Err(why) = (t.receiver_check)(chain) {
            crate::metrics::connection_refused("wrong_role");
            return Err(refused(std::io::ErrorKind::PermissionDenied, format!("{addr} is not a decode node: {why}")));
        }
        Ok(DataStream::Tls(Box::new(tls.into())))
    }
}

/// A data-plane connection: plain TCP or TLS over it.
#[derive(Debug)]
pub enum DataStream {
    /// Plaintext.
    Plain(TcpStream),
    /// Mutual TLS.
    Tls(Box<tokio_rustls::TlsStream<TcpStream>>),
}

impl DataStream {
    /// The TCP connection underneath.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Self::Plain(s) => s,
            Self::Tls(s) => s.get_ref().0,
        }
    }
}

impl AsyncRead for DataStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for DataStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Plain(s) => s.is_write_vectored(),
            Self::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_flush(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
