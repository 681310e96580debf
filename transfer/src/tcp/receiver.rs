//! The receiving side: accepts connections, checks every frame against the room table and
//! reads page payloads straight into the claimed destination pages.

use ferry_core::{Room, RoomSecret};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::TcpConfig;
use crate::frame::{FrameError, HEADER_LEN, Header, Kind, Limits, MAX_SMALL_PAYLOAD};
use crate::inbox::Inbox;
use crate::memory::HostPages;
use crate::room::{FailReason, State};
use crate::secure::{DataStream, Security};
use crate::table::{Outcome, Refusal};

struct Shared {
    inbox: Inbox,
    mem: Arc<HostPages>,
    limits: Limits,
    /// Longest a frame may go without a byte arriving, once it started (the rooms'
    /// transferring timeout): a sender stalled mid-frame loses its connection, and the
    /// claimed pages come back, instead of being held by a read that never ends.
    progress: Duration,
}

/// Receives rooms' pages into a page arena.
pub struct TcpReceiver {
    addr: SocketAddr,
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for TcpReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpReceiver").field("addr", &self.addr).finish()
    }
}

impl Drop for TcpReceiver {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl TcpReceiver {
    /// Listens on `addr` (port 0 for any) and writes arriving pages into `mem`; plaintext
    /// (see [`bind_secure`](Self::bind_secure)).
    pub async fn bind(addr: SocketAddr, mem: Arc<HostPages>, cfg: TcpConfig) -> std::io::Result<Self> {
        Self::bind_secure(addr, mem, cfg, Security::Plain).await
    }

    /// Like [`bind`](Self::bind), each connection secured as `security` says.
    pub async fn bind_secure(
        addr: SocketAddr,
        mem: Arc<HostPages>,
        cfg: TcpConfig,
        security: Security,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let page_bytes = u32::try_from(mem.page_bytes()).map_err(std::io::Error::other)?;
        let limits = Limits { page_bytes, max_payload: page_bytes.saturating_mul(cfg.max_frame_pages.max(1)) };
        let progress = cfg.timeouts.transferring;
        let shared = Arc::new(Shared { inbox: Inbox::new(cfg.timeouts, "tcp"), mem, limits, progress });
        let tasks = crate::inbox::spawn_receiver_tasks(listener, Arc::clone(&shared), |s| &s.inbox, security, serve);
        Ok(Self { addr, shared, tasks })
    }

    /// The data-plane address to hand to senders.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The page arena.
    pub fn memory(&self) -> &Arc<HostPages> {
        &self.shared.mem
    }

    /// Opens a room that may fill `dest`; the receiver resolves with its outcome.
    pub fn open(&self, room: Room, secret: RoomSecret, dest: &[u32]) -> Result<oneshot::Receiver<Outcome>, Refusal> {
        self.shared.inbox.open_in(self.shared.mem.pages(), room, secret, dest)
    }

    /// Forgets a room (after its outcome, or to abort it from this side); its pages may be
    /// reused and later frames for it are refused.
    pub fn close(&self, room: Room) -> Option<State> {
        self.shared.inbox.close(room)
    }

    /// The rooms and their counters.
    pub fn inbox(&self) -> &Inbox {
        &self.shared.inbox
    }

    /// Refusals so far for `r`.
    pub fn refusals(&self, r: Refusal) -> u64 {
        self.shared.inbox.refusals(r)
    }

    /// `(open rooms, destination pages they hold)`.
    pub fn open_rooms(&self) -> (usize, usize) {
        self.shared.inbox.open_rooms()
    }
}

/// Fills `buf`, failing with `TimedOut` when no byte arrives for `progress`, and with
/// `UnexpectedEof` when the peer closes first.
async fn read_within(stream: &mut DataStream, buf: &mut [u8], progress: Duration) -> std::io::Result<()> {
    let mut off = 0;
    while off < buf.len() {
        match tokio::time::timeout(progress, stream.read(&mut buf[off..])).await {
            Ok(Ok(0)) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(Ok(n)) => off += n,
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                let why = format!("stalled: no byte for {progress:?} with {} of {} left", buf.len() - off, buf.len());
                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, why));
            }
        }
    }
    Ok(())
}

/// Reads a frame header: waits as long as it takes for its first byte (connections idle
/// between rooms), then for the rest with the progress timeout.
async fn read_header(stream: &mut DataStream, hb: &mut [u8; HEADER_LEN], progress: Duration) -> std::io::Result<()> {
    if stream.read(&mut hb[..1]).await? == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    read_within(stream, &mut hb[1..], progress).await
}

/// Reads and discards `n` bytes.
async fn skip(stream: &mut DataStream, mut n: usize, progress: Duration) -> std::io::Result<()> {
    let mut buf = [0u8; 8192];
    while n > 0 {
        let k = n.min(buf.len());
        read_within(stream, &mut buf[..k], progress).await?;
        n -= k;
    }
    Ok(())
}

/// Rooms a connection has carried are pruned to those still open past this many.
const SEEN_PRUNE_AT: usize = 256;

/// One connection: frames until EOF, a framing error or a stall mid-frame. Rooms this
/// connection carried that have not ended fail when it breaks.
async fn serve(s: Arc<Shared>, mut stream: DataStream) {
    let mut seen: HashSet<Room> = HashSet::new();
    let reason = loop {
        if seen.len() >= SEEN_PRUNE_AT {
            // A long-lived connection carries room after room: keep only the open ones.
            seen.retain(|&room| s.inbox.state(room).is_some());
        }
        let mut hb = [0u8; HEADER_LEN];
        match read_header(&mut stream, &mut hb, s.progress).await {
            Ok(_) => {}
            // Senders keep their connections for as long as they live: a close means the
            // peer is gone, and the rooms it was carrying here cannot finish.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                break FailReason::PeerGone("connection closed".into());
            }
            Err(e) => break FailReason::PeerGone(e.to_string()),
        }
        let h = match Header::decode(&hb, &s.limits) {
            Ok(h) => h,
            Err(e @ (FrameError::BadMagic(_) | FrameError::HeaderCrc)) => {
                break FailReason::Corrupt(format!("framing lost: {e}"));
            }
            Err(e) => {
                tracing::warn!(error = %e, "refused frame");
                break FailReason::Corrupt(e.to_string());
            }
        };
        let result = match h.kind {
            Kind::Pages => pages(&s, &mut stream, &h, &mut seen).await,
            Kind::Done | Kind::Abort => control(&s, &mut stream, &h, &mut seen).await,
        };
        let whole = match result {
            Ok(whole) => whole,
            Err(e) => break FailReason::PeerGone(format!("connection broke mid-frame: {e}")),
        };
        // This frame completed the room: tell the sender, whose `send_done` waits for it.
        if whole {
            let ack = async {
                stream.write_all(&super::ack(h.room)).await?;
                stream.flush().await
            };
            let sent = tokio::time::timeout(s.progress, ack).await;
            if !matches!(sent, Ok(Ok(()))) {
                break FailReason::PeerGone("the sender reads no acknowledgement".into());
            }
        }
    };
    s.inbox.fail_all(seen, &reason);
}

/// A `Pages` frame; true when it made its room whole.
async fn pages(s: &Shared, stream: &mut DataStream, h: &Header, seen: &mut HashSet<Room>) -> std::io::Result<bool> {
    let claim = match s.inbox.with_table(|t| t.claim(h, Instant::now())) {
        Ok(c) => c,
        Err(refusal) => {
            tracing::debug!(room = %h.room, reason = refusal.label(), "frame refused");
            return skip(stream, h.payload_len as usize, s.progress).await.map(|()| false);
        }
    };
    seen.insert(h.room);
    // SAFETY: the table granted this claim to us alone: no one else reads or writes these
    // pages until the room is closed.
    let dest = match unsafe { s.mem.slice_mut(claim.first, claim.n) } {
        Ok(d) => d,
        Err(e) => {
            s.inbox.with_table(|t| t.fail(h.room, FailReason::Refused(e.to_string())));
            return skip(stream, h.payload_len as usize, s.progress).await.map(|()| false);
        }
    };
    if let Err(e) = read_within(stream, dest, s.progress).await {
        // The connection broke mid-run: the claim ends; the caller fails the rooms it carried.
        s.inbox.with_table(|t| t.unclaim(claim));
        return Err(e);
    }
    Ok(s.inbox.settle(h, claim, crc32c::crc32c(dest) == h.payload_crc))
}

/// A `Done` or `Abort` frame; true when it made its room whole.
async fn control(s: &Shared, stream: &mut DataStream, h: &Header, seen: &mut HashSet<Room>) -> std::io::Result<bool> {
    let mut payload = vec![0u8; (h.payload_len).min(MAX_SMALL_PAYLOAD) as usize];
    read_within(stream, &mut payload, s.progress).await?;
    let handled = s.inbox.control(h, &payload);
    if handled.is_some() {
        seen.insert(h.room);
    }
    Ok(handled == Some(true))
}
