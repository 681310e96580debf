//! One interface over the backends: which one to use (`--transfer tcp | rdma | fake | auto`),
//! and [`Sender`] / [`Receiver`] enums whose calls are the same whatever moves the bytes,
//! with the transfer metrics recorded here once for all of them.

use ferry_core::{Room, RoomSecret};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::oneshot;

use crate::fake::{FakeReceiver, FakeSender};
use crate::frame::Aux;
use crate::inbox::Inbox;
use crate::memory::HostPages;
use crate::rdma::mem::MemVerbs;
use crate::rdma::verbs::VerbsError;
use crate::rdma::{RdmaReceiver, RdmaSender};
use crate::room::State;
use crate::runs::PageRun;
use crate::secure::Security;
use crate::table::{Outcome, Refusal};
use crate::tcp::{TcpReceiver, TcpSender};

/// A transfer backend, as an operator names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum BackendKind {
    /// Raw TCP.
    Tcp,
    /// RDMA over ibverbs (feature `rdma`).
    Rdma,
    /// Moves nothing, completes at once (tests, warm-up).
    Fake,
    /// RDMA when a device is present, else TCP.
    Auto,
}

impl BackendKind {
    /// The name used in flags and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Rdma => "rdma",
            Self::Fake => "fake",
            Self::Auto => "auto",
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Not a backend name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown transfer backend {0:?}: expected tcp, rdma, fake or auto")]
pub struct UnknownBackend(pub String);

impl std::str::FromStr for BackendKind {
    type Err = UnknownBackend;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "tcp" => Ok(Self::Tcp),
            "rdma" => Ok(Self::Rdma),
            "fake" => Ok(Self::Fake),
            "auto" => Ok(Self::Auto),
            other => Err(UnknownBackend(other.to_string())),
        }
    }
}

/// Picks the backend for `requested`, given whether an RDMA device is usable: `auto` becomes
/// `rdma` or `tcp` (saying which, and why, in the log); `rdma` without a device is an error.
/// Records the choice in `ferry_transfer_backend`.
pub fn choose(requested: BackendKind, rdma_device: Result<(), VerbsError>) -> Result<BackendKind, VerbsError> {
    let chosen = match (requested, rdma_device) {
        (BackendKind::Auto, Ok(())) => {
            tracing::info!("transfer backend: rdma (auto: an RDMA device is present)");
            BackendKind::Rdma
        }
        (BackendKind::Auto, Err(e)) => {
            tracing::warn!(reason = %e, "transfer backend: tcp (auto: falling back from rdma)");
            BackendKind::Tcp
        }
        (BackendKind::Rdma, Err(e)) => return Err(e),
        (other, _) => other,
    };
    crate::metrics::backend_chosen(chosen.as_str(), requested.as_str());
    Ok(chosen)
}

/// Whether real RDMA is usable here: built in, and a device present.
pub fn rdma_usable() -> Result<(), VerbsError> {
    usable(cfg!(feature = "rdma"), crate::rdma::device_count())
}

/// Whether real RDMA is usable in a build with the `rdma` feature or without (`built`), on a
/// machine with `devices` RDMA devices.
fn usable(built: bool, devices: usize) -> Result<(), VerbsError> {
    if !built {
        return Err(VerbsError::NotBuilt);
    }
    if devices == 0 {
        return Err(VerbsError::NoDevice("no RDMA device on this machine".into()));
    }
    Ok(())
}

/// The sending end to one receiver.
#[derive(Debug)]
pub enum Sender {
    /// tcp.
    Tcp(TcpSender),
    /// fake.
    Fake(FakeSender),
    /// rdma, on in-memory verbs (tests).
    RdmaMem(Box<RdmaSender<MemVerbs>>),
    /// rdma, on ibverbs.
    #[cfg(feature = "rdma")]
    Rdma(Box<RdmaSender<crate::rdma::IbVerbs>>),
}

impl Sender {
    /// Whether its connection is known to have ended (tcp) or to be out of step (rdma: a grant
    /// exchange broke off); the other cases are found out at the next send.
    pub fn closed(&self) -> bool {
        match self {
            Self::Tcp(s) => s.closed(),
            Self::RdmaMem(s) => s.broken(),
            #[cfg(feature = "rdma")]
            Self::Rdma(s) => s.broken(),
            Self::Fake(_) => false,
        }
    }

    /// The backend's name (a metrics label; in-memory verbs count as rdma).
    pub fn backend(&self) -> &'static str {
        match self {
            Self::Tcp(_) => "tcp",
            Self::Fake(_) => "fake",
            Self::RdmaMem(_) => "rdma",
            #[cfg(feature = "rdma")]
            Self::Rdma(_) => "rdma",
        }
    }

    /// Sends one chunk: the pages of `runs` (source pages in `mem`), then, when `last` is
    /// given, the room's aux data. Records bytes, runs and time.
    pub async fn send(
        &self,
        room: Room,
        secret: RoomSecret,
        runs: &[PageRun],
        mem: &HostPages,
        last: Option<Aux>,
    ) -> std::io::Result<()> {
        let t0 = Instant::now();
        match self {
            Self::Tcp(s) => s.send_pages(room, secret, runs, mem).await?,
            Self::Fake(s) => s.send_pages(room, secret, runs).map_err(refused)?,
            Self::RdmaMem(s) => s.send_pages(room, secret, runs, mem).await?,
            #[cfg(feature = "rdma")]
            Self::Rdma(s) => s.send_pages(room, secret, runs, mem).await?,
        }
        if let Some(aux) = last {
            match self {
                Self::Tcp(s) => s.send_done(room, secret, aux).await?,
                Self::Fake(s) => s.send_done(room, secret, aux).map_err(refused)?,
                Self::RdmaMem(s) => s.send_done(room, secret, aux).await?,
                #[cfg(feature = "rdma")]
                Self::Rdma(s) => s.send_done(room, secret, aux).await?,
            }
        }
        let pages: u64 = runs.iter().map(|r| u64::from(r.len)).sum();
        crate::metrics::chunk_sent(self.backend(), pages * mem.page_bytes() as u64, runs.len() as u64, t0.elapsed());
        Ok(())
    }

    /// Tells the receiver the room is abandoned.
    pub async fn abort(&self, room: Room, secret: RoomSecret, reason: &str) -> std::io::Result<()> {
        match self {
            Self::Tcp(s) => s.send_abort(room, secret, reason).await,
            Self::Fake(s) => s.send_abort(room, secret, reason).map_err(refused),
            Self::RdmaMem(s) => s.send_abort(room, secret, reason).await,
            #[cfg(feature = "rdma")]
            Self::Rdma(s) => s.send_abort(room, secret, reason).await,
        }
    }
}

fn refused(r: Refusal) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::PermissionDenied, format!("refused by the receiver: {}", r.label()))
}

/// The receiving end: one per decode node, rooms opened per request.
#[derive(Debug)]
pub enum Receiver {
    /// tcp.
    Tcp(TcpReceiver),
    /// fake.
    Fake(FakeReceiver),
    /// rdma, on in-memory verbs (tests).
    RdmaMem(RdmaReceiver<MemVerbs>),
    /// rdma, on ibverbs.
    #[cfg(feature = "rdma")]
    Rdma(RdmaReceiver<crate::rdma::IbVerbs>),
}

impl Receiver {
    /// The rooms and their counters.
    pub fn inbox(&self) -> &Inbox {
        match self {
            Self::Tcp(r) => r.inbox(),
            Self::Fake(r) => r.inbox(),
            Self::RdmaMem(r) => r.inbox(),
            #[cfg(feature = "rdma")]
            Self::Rdma(r) => r.inbox(),
        }
    }

    /// Where senders connect (None for fake: senders are made from the receiver).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        match self {
            Self::Tcp(r) => Some(r.local_addr()),
            Self::Fake(_) => None,
            Self::RdmaMem(r) => Some(r.local_addr()),
            #[cfg(feature = "rdma")]
            Self::Rdma(r) => Some(r.local_addr()),
        }
    }

    /// Opens a room that may fill `dest`; resolves with its outcome.
    pub fn open(&self, room: Room, secret: RoomSecret, dest: &[u32]) -> Result<oneshot::Receiver<Outcome>, Refusal> {
        match self {
            Self::Tcp(r) => r.open(room, secret, dest),
            Self::Fake(r) => r.open(room, secret, dest),
            Self::RdmaMem(r) => r.open(room, secret, dest),
            #[cfg(feature = "rdma")]
            Self::Rdma(r) => r.open(room, secret, dest),
        }
    }

    /// Where a room stands (None once closed, or never opened).
    pub fn poll(&self, room: Room) -> Option<State> {
        self.inbox().tick();
        self.inbox().state(room)
    }

    /// Forgets a room: aborts it when still open, releases its pages, refuses later frames
    /// (rdma: invalidates its memory windows).
    pub fn close(&self, room: Room) -> Option<State> {
        match self {
            Self::RdmaMem(r) => r.close(room),
            #[cfg(feature = "rdma")]
            Self::Rdma(r) => r.close(room),
            Self::Tcp(_) | Self::Fake(_) => self.inbox().close(room),
        }
    }
}

/// Settings shared by the backends.
#[derive(Debug, Clone, Default)]
pub struct TransferConfig {
    /// tcp settings (connections per peer, frame size, receiver room timeouts).
    pub tcp: crate::tcp::TcpConfig,
    /// rdma settings.
    pub rdma: crate::rdma::RdmaConfig,
    /// Mutual TLS and peer roles on every connection, or plaintext.
    pub security: Security,
}

/// Opens the receiving end of `kind` (a chosen backend, not `auto`) on `addr`, writing into
/// `mem`. Returns it with the endpoint senders connect to.
pub async fn bind(
    kind: BackendKind,
    addr: SocketAddr,
    mem: Arc<HostPages>,
    cfg: TransferConfig,
) -> std::io::Result<(Receiver, String)> {
    match kind {
        BackendKind::Tcp => {
            let r = TcpReceiver::bind_secure(addr, mem, cfg.tcp, cfg.security).await?;
            let at = r.local_addr().to_string();
            Ok((Receiver::Tcp(r), at))
        }
        BackendKind::Fake => {
            let r = FakeReceiver::new(cfg.tcp.timeouts);
            let at = r.register();
            Ok((Receiver::Fake(r), at))
        }
        BackendKind::Rdma => {
            let r = rdma_receiver(addr, mem, cfg.rdma, cfg.security).await?;
            let at = r.local_addr().map(|a| a.to_string()).unwrap_or_default();
            Ok((r, at))
        }
        BackendKind::Auto => Err(std::io::Error::other("choose a backend before binding (see `choose`)")),
    }
}

/// Connects a sender of `kind` to the receiver at `endpoint`, sending from `mem`. `room` and
/// `secret` are the key of a room the receiver has open for this sender (the one the
/// connection is made for): the rdma connection exchange answers no one without one.
pub async fn connect(
    kind: BackendKind,
    endpoint: &str,
    mem: Arc<HostPages>,
    cfg: TransferConfig,
    room: Room,
    secret: &RoomSecret,
) -> std::io::Result<Sender> {
    let addr = || {
        endpoint.parse::<SocketAddr>().map_err(|e| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("data endpoint {endpoint:?}: {e}"))
        })
    };
    match kind {
        BackendKind::Tcp => {
            let faults = Arc::new(crate::tcp::NoFaults);
            Ok(Sender::Tcp(TcpSender::connect_secure(addr()?, cfg.tcp, &cfg.security, faults).await?))
        }
        BackendKind::Fake => FakeSender::lookup(endpoint).map(Sender::Fake).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, format!("no fake receiver {endpoint:?} in this process"))
        }),
        #[cfg(feature = "rdma")]
        BackendKind::Rdma => {
            let verbs = Arc::new(crate::rdma::IbVerbs::open(None, 0).map_err(std::io::Error::other)?);
            let s = RdmaSender::connect(addr()?, verbs, mem, cfg.rdma, (room, secret), &cfg.security).await?;
            Ok(Sender::Rdma(Box::new(s)))
        }
        #[cfg(not(feature = "rdma"))]
        BackendKind::Rdma => {
            let _ = (mem, addr, room, secret);
            Err(std::io::Error::other(VerbsError::NotBuilt))
        }
        BackendKind::Auto => Err(std::io::Error::other("choose a backend before connecting (see `choose`)")),
    }
}

/// Opens an RDMA receiver on real ibverbs, or says why it cannot.
#[cfg(feature = "rdma")]
pub async fn rdma_receiver(
    addr: SocketAddr,
    mem: Arc<HostPages>,
    cfg: crate::rdma::RdmaConfig,
    security: Security,
) -> Result<Receiver, std::io::Error> {
    let verbs = Arc::new(crate::rdma::IbVerbs::open(None, 0).map_err(std::io::Error::other)?);
    Ok(Receiver::Rdma(RdmaReceiver::bind(addr, verbs, mem, cfg, security).await?))
}

/// Opens an RDMA receiver on real ibverbs, or says why it cannot.
#[cfg(not(feature = "rdma"))]
pub async fn rdma_receiver(
    _addr: SocketAddr,
    _mem: Arc<HostPages>,
    _cfg: crate::rdma::RdmaConfig,
    _security: Security,
) -> Result<Receiver, std::io::Error> {
    Err(std::io::Error::other(VerbsError::NotBuilt))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_auto_falls_back() {
        for k in [BackendKind::Tcp, BackendKind::Rdma, BackendKind::Fake, BackendKind::Auto] {
            assert_eq!(k.as_str().parse::<BackendKind>(), Ok(k));
        }
        assert!("udp".parse::<BackendKind>().is_err());
        let none = || Err(VerbsError::NoDevice("none".into()));
        assert_eq!(choose(BackendKind::Auto, none()), Ok(BackendKind::Tcp));
        assert_eq!(choose(BackendKind::Auto, Ok(())), Ok(BackendKind::Rdma));
        assert!(choose(BackendKind::Rdma, none()).is_err(), "rdma asked for explicitly never falls back");
        assert_eq!(choose(BackendKind::Tcp, none()), Ok(BackendKind::Tcp));
    }

    #[test]
    fn rdma_is_usable_only_built_in_and_with_a_device_and_says_what_is_missing() {
        let e = usable(false, 2).expect_err("not built").to_string();
        assert!(e.contains("--features rdma"), "{e}");
        let e = usable(true, 0).expect_err("no device").to_string();
        assert!(e.contains("no RDMA device on this machine"), "{e}");
        assert_eq!(usable(true, 1), Ok(()));
    }
}
