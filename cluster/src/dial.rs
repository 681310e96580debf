//! Dialing another daemon: a lazily connecting gRPC channel whose mutual TLS also checks the
//! role the peer's certificate names ([`crate::roles`]). The router expects a prefill
//! worker's certificate at a prefill address and a decode worker's at a decode address; a
//! decode worker expects a prefill worker's at a bootstrap address. So a cluster member
//! holding another role's certificate cannot stand in for a worker (registered in etcd, say)
//! and receive prompts or room secrets.
//!
//! tonic's own TLS checks the chain and the name but offers no hook for the role, so under
//! mutual TLS the channel connects through our connector (TCP, then rustls with the cluster's
//! client configuration, then the role check) and speaks HTTP/2 over the finished stream.
//! Tested through real daemons in `tests/tests/mtls.rs`.

use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls::pki_types::ServerName;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::mtls::{BadAddress, InternalTls};
use crate::roles::{PeerRole, role_of};

/// A channel to the daemon of role `expect` at `addr` (`host:port` or a URI), connecting on
/// first use; `configure` sets its timeouts. Pinged while calls are open
/// ([`crate::mtls::KEEPALIVE_INTERVAL`]). Under mutual TLS a peer whose certificate names
/// another role fails the connection (counted as `wrong_role`, role `client`).
pub fn channel(
    addr: &str,
    tls: Option<&InternalTls>,
    expect: PeerRole,
    configure: impl FnOnce(Endpoint) -> Endpoint,
) -> Result<Channel, BadAddress> {
    let Some(tls) = tls else {
        crate::mtls::check_scheme(addr, false)?;
        return Ok(configure(crate::mtls::endpoint(addr)?).connect_lazy());
    };
    crate::mtls::check_scheme(addr, true)?;
    let target = Target::new(addr, tls, expect)?;
    // http:// because this connector already did TLS: tonic must not try again.
    let ep = configure(crate::mtls::endpoint(&format!("http://{}", target.host_port))?);
    let dial = tower::service_fn(move |_: Uri| {
        let target = target.clone();
        async move { target.connect().await.map(TokioIo::new) }
    });
    Ok(ep.connect_with_connector_lazy(dial))
}

/// `addr` (`host:port` or a URI) as `host:port`, without a scheme or a path.
pub fn host_port(addr: &str) -> String {
    let rest = addr.split_once("://").map_or(addr, |(_, rest)| rest);
    rest.split('/').next().unwrap_or(rest).to_string()
}

/// Where a mutual TLS connection goes: `host:port`, the name its certificate must carry, and
/// the role it must name.
#[derive(Clone)]
pub struct Target {
    /// `host:port`.
    pub host_port: String,
    name: ServerName<'static>,
    connector: TlsConnector,
    expect: PeerRole,
}

impl Target {
    /// `addr` (`host:port` or an `https://` URI) under `tls`, its certificate to name `expect`.
    pub fn new(addr: &str, tls: &InternalTls, expect: PeerRole) -> Result<Self, BadAddress> {
        let host_port = host_port(addr);
        let host = host_port.rsplit_once(':').map_or(host_port.as_str(), |(h, _)| h);
        let name = tls.server_name().unwrap_or_else(|| host.trim_start_matches('[').trim_end_matches(']'));
        let name = ServerName::try_from(name.to_string())
            .map_err(|e| BadAddress(format!("{addr}: server name {name:?}: {e}")))?;
        Ok(Self { host_port, name, connector: TlsConnector::from(tls.client_config()), expect })
    }

    /// TCP (no delay), then rustls, then the role check; a peer whose certificate names
    /// another role is refused (counted as `wrong_role`, role `client`).
    pub async fn connect(&self) -> std::io::Result<TlsStream<TcpStream>> {
        let (expect, host_port) = (self.expect, &self.host_port);
        let tcp = TcpStream::connect(host_port).await?;
        tcp.set_nodelay(true)?;
        let stream = self.connector.connect(self.name.clone(), tcp).await?;
        let leaf = stream.get_ref().1.peer_certificates().and_then(|c| c.first());
        let role = leaf.map(role_of).unwrap_or_else(|| Err(crate::roles::RoleError::no_certificate()));
        if role != Ok(expect) {
            let why = match role {
                Ok(r) => format!("a certificate for the {r}"),
                Err(e) => format!("a certificate with {e}"),
            };
            metrics::counter!(crate::metrics::BAD_REQUESTS, "role" => "client", "reason" => "wrong_role").increment(1);
            // At debug: a misplaced worker is dialled on every health check; the check's
            // failure (with this message) is what the caller reports.
            tracing::debug!(peer = %host_port, expected = %expect, %why, "peer refused: wrong role");
            return Err(std::io::Error::other(format!("{host_port} is not a {expect} worker: it presents {why}")));
        }
        Ok(stream)
    }
}

/// Lazily connecting channels to the daemons of one role, one per address: a worker's calls
/// to its peers (a decode worker's handshakes with prefill workers, a prefill worker's pulls
/// from decode workers). A channel connects on first use, outside the map's lock, within the
/// configured timeout: an address that never answers delays only the calls sent to it.
pub struct Channels {
    expect: PeerRole,
    tls: Option<Arc<InternalTls>>,
    connect_timeout: std::time::Duration,
    by_addr: Mutex<std::collections::HashMap<String, Channel>>,
}

impl Channels {
    /// Channels to daemons of role `expect` (over mutual TLS when `tls` is given), each
    /// connect bounded by `connect_timeout`.
    pub fn new(expect: PeerRole, tls: Option<Arc<InternalTls>>, connect_timeout: std::time::Duration) -> Self {
        Self { expect, tls, connect_timeout, by_addr: Default::default() }
    }

    fn by_addr(&self) -> MutexGuard<'_, std::collections::HashMap<String, Channel>> {
        self.by_addr.lock()
    }

    /// The channel to `addr`, made on first use ([`channel`]'s error for a bad address).
    pub fn get(&self, addr: &str) -> Result<Channel, BadAddress> {
        let mut c = self.by_addr();
        if let Some(ch) = c.get(addr) {
            return Ok(ch.clone());
        }
        let timeout = self.connect_timeout;
        let ch = channel(addr, self.tls.as_deref(), self.expect, |ep| ep.connect_timeout(timeout))?;
        c.insert(addr.to_string(), ch.clone());
        Ok(ch)
    }

    /// Forgets the channel to `addr` (its connection broke or never came): the next call
    /// dials anew.
    pub fn forget(&self, addr: &str) {
        self.by_addr().remove(addr);
    }
}

impl InternalTls {
    /// The configured `--internal-tls-server-name`.
    pub fn server_name(&self) -> Option<&str> {
        self.server_name.as_deref()
    }

    /// The rustls client side: this daemon's certificate, the cluster CA, HTTP/2.
    pub fn client_config(&self) -> Arc<tokio_rustls::rustls::ClientConfig> {
        Arc::clone(&self.client)
    }
}
