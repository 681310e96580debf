//! The sending side: frames out of pool memory onto a few reused connections.

use ferry_core::{Room, RoomSecret};
use std::collections::HashMap;
use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::{Mutex, oneshot};
use tokio::task::JoinHandle;

use super::{Fault, FaultFilter, NoFaults, TcpConfig};
use crate::frame::{Aux, Header, Kind};
use crate::memory::HostPages;
use crate::runs::PageRun;
use crate::secure::{DataStream, Security};

type Writer = WriteHalf<DataStream>;

/// Preferred frame size.
const TARGET_FRAME_BYTES: usize = 1 << 20;

/// Most connections one sender opens (a room's connections are tracked in a 64-bit mask).
pub const MAX_CONNECTIONS: usize = 64;

struct Conn {
    stream: Option<Writer>,
    /// A frame held back by [`Fault::Reorder`], sent after the next one.
    held: Option<(Header, Vec<u8>)>,
}

/// A room between its first frame and the receiver's acknowledgement (or its abort).
#[derive(Default)]
struct Pending {
    /// The connections that carried its frames (bit `c`: connection `c`).
    conns: u64,
    /// Set once its `Done` went out: woken by the acknowledgement, dropped (an error for the
    /// waiter) when a connection it used ends first.
    ack: Option<oneshot::Sender<()>>,
}

#[derive(Default)]
struct Rooms {
    pending: HashMap<Room, Pending>,
    /// Connections that have ended.
    dead: u64,
}

/// The rooms under way and the connections that ended. A connection's end fails the rooms it
/// carried at once (the receiver fails them too, so no acknowledgement will come), instead of
/// leaving their `send_done` to wait out the transferring timeout.
#[derive(Default, Clone)]
struct Waiting(Arc<parking_lot::Mutex<Rooms>>);

impl Waiting {
    fn rooms(&self) -> parking_lot::MutexGuard<'_, Rooms> {
        self.0.lock()
    }

    /// Notes that `room`'s frames go out on `conns`; fails when one of them has ended.
    fn carry(&self, room: Room, conns: u64) -> std::io::Result<()> {
        let mut r = self.rooms();
        if r.dead & conns != 0 {
            r.pending.remove(&room);
            return Err(ended());
        }
        r.pending.entry(room).or_default().conns |= conns;
        Ok(())
    }

    /// Arms `room`'s acknowledgement; fails when a connection it used has ended.
    fn arm(&self, room: Room, conn: u64, ack: oneshot::Sender<()>) -> std::io::Result<()> {
        let mut r = self.rooms();
        let conns = r.pending.get(&room).map_or(0, |p| p.conns) | conn;
        if r.dead & conns != 0 {
            r.pending.remove(&room);
            return Err(ended());
        }
        r.pending.insert(room, Pending { conns, ack: Some(ack) });
        Ok(())
    }

    fn forget(&self, room: Room) {
        self.rooms().pending.remove(&room);
    }

    /// The receiver holds `room` whole.
    fn acknowledged(&self, room: Room) {
        let woken = self.rooms().pending.remove(&room).and_then(|p| p.ack);
        if let Some(w) = woken {
            let _ = w.send(());
        }
    }

    /// Connection `c` ended: every room it carried fails now.
    fn connection_ended(&self, c: usize) {
        let bit = 1u64 << c;
        let mut r = self.rooms();
        r.dead |= bit;
        r.pending.retain(|_, p| p.conns & bit == 0);
    }
}

fn ended() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::BrokenPipe, "a connection that carried the room ended")
}

/// Sends rooms' pages to one receiver.
pub struct TcpSender {
    conns: Vec<Mutex<Conn>>,
    next: AtomicUsize,
    frames: AtomicU64,
    cfg: TcpConfig,
    fault: Arc<dyn FaultFilter>,
    waiting: Waiting,
    /// One per connection: reads the receiver's acknowledgements.
    readers: Vec<JoinHandle<()>>,
}

impl Drop for TcpSender {
    fn drop(&mut self) {
        for r in &self.readers {
            r.abort();
        }
    }
}

/// Reads acknowledgements on connection `c` until it ends, waking the room each names; then
/// fails the rooms it carried.
async fn read_acks(mut from: ReadHalf<DataStream>, c: usize, waiting: Waiting) {
    let mut a = [0u8; super::ACK_LEN];
    while from.read_exact(&mut a).await.is_ok() {
        let mut id = [0u8; 8];
        id.copy_from_slice(&a[..8]);
        if let Some(room) = Room::new(u64::from_le_bytes(id)) {
            waiting.acknowledged(room);
        }
    }
    waiting.connection_ended(c);
}

impl std::fmt::Debug for TcpSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpSender").field("connections", &self.conns.len()).finish()
    }
}

fn broken() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::BrokenPipe, "connection closed")
}

/// Writes one frame and flushes it (TLS may hold the tail of a write until flushed).
async fn write_frame(stream: &mut Writer, header: &[u8], payload: &[u8]) -> std::io::Result<()> {
    let (mut h, mut p) = (header, payload);
    while !h.is_empty() || !p.is_empty() {
        let n = stream.write_vectored(&[IoSlice::new(h), IoSlice::new(p)]).await?;
        if n == 0 {
            return Err(broken());
        }
        let from_h = n.min(h.len());
        h = &h[from_h..];
        p = &p[n - from_h..];
    }
    stream.flush().await
}

impl TcpSender {
    /// Whether one of its connections has ended (the receiver closed it, or it broke): a
    /// sender that cannot deliver whole rooms any more. Seen by the connection's reader as
    /// soon as the end arrives, so a pool can replace the sender before a room meets it.
    pub fn closed(&self) -> bool {
        self.waiting.rooms().dead != 0
    }

    /// Opens `cfg.connections` plaintext connections to `addr` (see
    /// [`connect_secure`](Self::connect_secure)).
    pub async fn connect(addr: SocketAddr, cfg: TcpConfig) -> std::io::Result<Self> {
        Self::connect_secure(addr, cfg, &Security::Plain, Arc::new(NoFaults)).await
    }

    /// Like [`connect`](Self::connect), with a fault filter on every frame (tests).
    pub async fn connect_with_faults(
        addr: SocketAddr,
        cfg: TcpConfig,
        fault: Arc<dyn FaultFilter>,
    ) -> std::io::Result<Self> {
        Self::connect_secure(addr, cfg, &Security::Plain, fault).await
    }

    /// Opens `cfg.connections` connections to `addr`, each secured as `security` says, with a
    /// fault filter on every frame.
    pub async fn connect_secure(
        addr: SocketAddr,
        cfg: TcpConfig,
        security: &Security,
        fault: Arc<dyn FaultFilter>,
    ) -> std::io::Result<Self> {
        let n = cfg.connections.clamp(1, MAX_CONNECTIONS);
        let (mut conns, mut readers) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let waiting = Waiting::default();
        for c in 0..cfg.connections.clamp(1, MAX_CONNECTIONS) {
            let (r, w) = tokio::io::split(security.connect(addr).await?);
            readers.push(tokio::spawn(read_acks(r, c, waiting.clone())));
            conns.push(Mutex::new(Conn { stream: Some(w), held: None }));
        }
        Ok(Self { conns, next: AtomicUsize::new(0), frames: AtomicU64::new(0), cfg, fault, waiting, readers })
    }

    /// Sends one frame on connection `c`, applying the fault filter.
    async fn send(&self, c: usize, header: Header, payload: &[u8]) -> std::io::Result<()> {
        let index = self.frames.fetch_add(1, Ordering::Relaxed);
        let fault = self.fault.on_frame(index, &header);
        let mut conn = self.conns[c].lock().await;
        let Conn { stream, held } = &mut *conn;
        let s = stream.as_mut().ok_or_else(broken)?;
        match fault {
            Fault::Pass => write_frame(s, &header.encode(), payload).await?,
            Fault::Drop => {}
            Fault::Delay(d) => {
                tokio::time::sleep(d).await;
                write_frame(s, &header.encode(), payload).await?;
            }
            Fault::Reorder => {
                *held = Some((header, payload.to_vec()));
                return Ok(());
            }
            Fault::Corrupt(at) => {
                let mut bad = payload.to_vec();
                if !bad.is_empty() {
                    let i = at % bad.len();
                    bad[i] ^= 0x5a;
                }
                write_frame(s, &header.encode(), &bad).await?;
            }
            Fault::Truncate(keep) => {
                write_frame(s, &header.encode(), &payload[..keep.min(payload.len())]).await?;
                let _ = s.shutdown().await;
                *stream = None;
                return Ok(());
            }
            Fault::Cut => {
                let _ = s.shutdown().await;
                *stream = None;
                return Err(broken());
            }
        }
        if let Some((h, p)) = held.take() {
            write_frame(s, &h.encode(), &p).await?;
        }
        Ok(())
    }

    /// Sends the pages of `runs` (source pages in `mem`) for `room`, spreading frames over the
    /// connections and writing them in parallel.
    pub async fn send_pages(
        &self,
        room: Room,
        secret: RoomSecret,
        runs: &[PageRun],
        mem: &HostPages,
    ) -> std::io::Result<()> {
        // Frames of about 1 MiB: the sender's checksum pass and the socket write then read the
        // payload while it is still in cache (measured: 720 KiB frames move ~2x the bytes/s of
        // 5.6 MiB frames on loopback; docs/performance.md).
        let by_bytes = (TARGET_FRAME_BYTES / mem.page_bytes().max(1)).max(1) as u32;
        let max = self.cfg.max_frame_pages.clamp(1, by_bytes);
        let n = self.conns.len();
        let mut per_conn: Vec<Vec<PageRun>> = vec![Vec::new(); n];
        for r in runs {
            let mut done = 0;
            while done < r.len {
                let len = max.min(r.len - done);
                let c = self.next.fetch_add(1, Ordering::Relaxed) % n;
                per_conn[c].push(PageRun { src: r.src + done, dst: r.dst + done, len });
                done += len;
            }
        }
        let used = per_conn.iter().enumerate().filter(|(_, p)| !p.is_empty()).fold(0u64, |m, (c, _)| m | 1 << c);
        self.waiting.carry(room, used)?;
        let sends = per_conn.into_iter().enumerate().map(|(c, pieces)| async move {
            for p in pieces {
                // SAFETY: the sender reads pages its request computed and owns until the
                // transfer ends; nobody writes them meanwhile.
                let payload = unsafe { mem.read(p.src, p.len) }.map_err(std::io::Error::other)?;
                self.send(c, Header::pages(room, secret, p.dst, p.len, payload), payload).await?;
            }
            Ok::<(), std::io::Error>(())
        });
        futures::future::try_join_all(sends).await?;
        Ok(())
    }

    /// Sends the room's last message, the aux data, and waits (the transferring timeout at
    /// most) for the receiver to acknowledge the room whole: pages lost with a connection
    /// fail the room here instead of counting as sent.
    pub async fn send_done(&self, room: Room, secret: RoomSecret, aux: Aux) -> std::io::Result<()> {
        let c = self.next.fetch_add(1, Ordering::Relaxed) % self.conns.len();
        let payload = aux.encode();
        let (tx, acked) = oneshot::channel();
        self.waiting.arm(room, 1 << c, tx)?;
        if let Err(e) = self.send(c, Header::with(Kind::Done, room, secret, 0, 0, &payload), &payload).await {
            self.waiting.forget(room);
            return Err(e);
        }
        let within = self.cfg.timeouts.transferring;
        match tokio::time::timeout(within, acked).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(ended()),
            Err(_) => {
                self.waiting.forget(room);
                let why = format!("room {room}: the receiver did not acknowledge it whole within {within:?}");
                Err(std::io::Error::new(std::io::ErrorKind::TimedOut, why))
            }
        }
    }

    /// Tells the receiver the room is abandoned.
    pub async fn send_abort(&self, room: Room, secret: RoomSecret, reason: &str) -> std::io::Result<()> {
        let c = self.next.fetch_add(1, Ordering::Relaxed) % self.conns.len();
        let payload = &reason.as_bytes()[..reason.len().min(crate::frame::MAX_SMALL_PAYLOAD as usize)];
        self.waiting.forget(room);
        self.send(c, Header::with(Kind::Abort, room, secret, 0, 0, payload), payload).await
    }
}
