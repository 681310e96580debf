//! The sending side: frames out of pool memory onto a few reused connections.

use ferry_core::{Room, RoomSecret};
use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::Mutex;

use super::{Fault, FaultFilter, NoFaults, TcpConfig};
use crate::frame::{Aux, Header, Kind};
use crate::memory::HostPages;
use crate::runs::PageRun;

/// Preferred frame size.
const TARGET_FRAME_BYTES: usize = 1 << 20;

struct Conn {
    stream: Option<TcpStream>,
    /// A frame held back by [`Fault::Reorder`], sent after the next one.
    held: Option<(Header, Vec<u8>)>,
}

/// Sends rooms' pages to one receiver.
pub struct TcpSender {
    conns: Vec<Mutex<Conn>>,
    next: AtomicUsize,
    frames: AtomicU64,
    cfg: TcpConfig,
    fault: Arc<dyn FaultFilter>,
}

impl std::fmt::Debug for TcpSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpSender").field("connections", &self.conns.len()).finish()
    }
}

fn broken() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::BrokenPipe, "connection closed")
}

async fn write_frame(stream: &mut TcpStream, header: &[u8], payload: &[u8]) -> std::io::Result<()> {
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
    Ok(())
}

impl TcpSender {
    /// Opens `cfg.connections` connections to `addr`.
    pub async fn connect(addr: SocketAddr, cfg: TcpConfig) -> std::io::Result<Self> {
        Self::connect_with_faults(addr, cfg, Arc::new(NoFaults)).await
    }

    /// Like [`connect`](Self::connect), with a fault filter on every frame (tests).
    pub async fn connect_with_faults(
        addr: SocketAddr,
        cfg: TcpConfig,
        fault: Arc<dyn FaultFilter>,
    ) -> std::io::Result<Self> {
        let mut conns = Vec::with_capacity(cfg.connections.max(1));
        for _ in 0..cfg.connections.max(1) {
            let stream = TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            conns.push(Mutex::new(Conn { stream: Some(stream), held: None }));
        }
        Ok(Self { conns, next: AtomicUsize::new(0), frames: AtomicU64::new(0), cfg, fault })
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

    /// Sends the room's last message: the aux data.
    pub async fn send_done(&self, room: Room, secret: RoomSecret, aux: Aux) -> std::io::Result<()> {
        let c = self.next.fetch_add(1, Ordering::Relaxed) % self.conns.len();
        let payload = aux.encode();
        self.send(c, Header::with(Kind::Done, room, secret, 0, 0, &payload), &payload).await
    }

    /// Tells the receiver the room is abandoned.
    pub async fn send_abort(&self, room: Room, secret: RoomSecret, reason: &str) -> std::io::Result<()> {
        let c = self.next.fetch_add(1, Ordering::Relaxed) % self.conns.len();
        let payload = &reason.as_bytes()[..reason.len().min(crate::frame::MAX_SMALL_PAYLOAD as usize)];
        self.send(c, Header::with(Kind::Abort, room, secret, 0, 0, payload), payload).await
    }
}
