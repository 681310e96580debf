//! The receiving side: registers the page arena, accepts senders' connection exchanges (only
//! from a peer showing a live room's key), keeps RECVs posted on each queue pair and checks
//! every run a SEND reports against the room table and its checksum.

use ferry_core::{Room, RoomSecret};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::RdmaConfig;
use super::cm::{self, RemoteRegion};
use super::verbs::{MemKeys, QueuePair, Sge, Verbs, WcOp, WcStatus};
use crate::frame::{HEADER_LEN, Header, Kind, Limits};
use crate::inbox::Inbox;
use crate::memory::HostPages;
use crate::room::{FailReason, State};
use crate::secure::{DataStream, Security};
use crate::table::{Outcome, Refusal};

/// How long a peer may take to send its connection exchange.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

struct Shared<V: Verbs> {
    inbox: Inbox,
    mem: Arc<HostPages>,
    keys: MemKeys,
    verbs: Arc<V>,
    limits: Limits,
    cfg: RdmaConfig,
}

/// Receives rooms' pages by RDMA into a registered page arena.
pub struct RdmaReceiver<V: Verbs> {
    addr: SocketAddr,
    shared: Arc<Shared<V>>,
    tasks: Vec<JoinHandle<()>>,
}

impl<V: Verbs> std::fmt::Debug for RdmaReceiver<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaReceiver").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl<V: Verbs> Drop for RdmaReceiver<V> {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl<V: Verbs> Drop for Shared<V> {
    fn drop(&mut self) {
        self.verbs.deregister(self.keys);
    }
}

fn io_err(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

impl<V: Verbs> RdmaReceiver<V> {
    /// Registers `mem` and listens for senders' connection exchanges on `addr`, each inside
    /// the TLS (or not) that `security` says.
    pub async fn bind(
        addr: SocketAddr,
        verbs: Arc<V>,
        mem: Arc<HostPages>,
        cfg: RdmaConfig,
        security: Security,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let page_bytes = u32::try_from(mem.page_bytes()).map_err(io_err)?;
        let limits = Limits { page_bytes, max_payload: page_bytes.saturating_mul(cfg.max_write_pages.max(1)) };
        // SAFETY: the arena outlives the registration (held in `Shared`, deregistered on drop);
        // remote writes land only in pages the room table hands out, by the senders' protocol.
        let keys = unsafe { verbs.register(mem.base_ptr(), mem.len_bytes()) }.map_err(io_err)?;
        let shared = Arc::new(Shared { inbox: Inbox::new(cfg.timeouts, "rdma"), mem, keys, verbs, limits, cfg });
        let tasks = crate::inbox::spawn_receiver_tasks(listener, Arc::clone(&shared), |s| &s.inbox, security, serve);
        Ok(Self { addr, shared, tasks })
    }

    /// The connection-exchange address to hand to senders.
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

    /// Forgets a room; its pages may be reused and later messages for it are refused.
    pub fn close(&self, room: Room) -> Option<State> {
        self.shared.inbox.close(room)
    }

    /// The rooms and their counters.
    pub fn inbox(&self) -> &Inbox {
        &self.shared.inbox
    }
}

/// One sender: its queue pair, RECV buffers and the rooms it carried.
async fn serve<V: Verbs>(s: Arc<Shared<V>>, mut stream: DataStream) {
    let mut seen = HashSet::new();
    let reason = match serve_qp(&s, &mut stream, &mut seen).await {
        Ok(r) => r,
        Err(e) => FailReason::PeerGone(e.to_string()),
    };
    tracing::debug!(?reason, rooms = seen.len(), "rdma peer gone");
    s.inbox.fail_all(seen, &reason);
}

async fn serve_qp<V: Verbs>(
    s: &Shared<V>,
    stream: &mut DataStream,
    seen: &mut HashSet<Room>,
) -> std::io::Result<FailReason> {
    let (peer, room, secret) = tokio::time::timeout(HELLO_TIMEOUT, cm::read_hello(stream))
        .await
        .map_err(|_| io_err(format!("no connection exchange within {HELLO_TIMEOUT:?}")))??;
    // Nothing (no queue pair, no region key) for a peer without a live room's key.
    if let Err(r) = s.inbox.with_table(|t| t.admit_peer(room, &secret)) {
        tracing::warn!(%room, reason = r.label(), "rdma connection exchange refused");
        return Ok(FailReason::PeerGone(format!("connection exchange refused: {}", r.label())));
    }
    let slots = s.cfg.recv_slots.max(1);
    let msg_bytes = s.cfg.msg_bytes.max(HEADER_LEN as u32 * 2) as usize;
    let mut qp = s.verbs.create_qp(slots.max(s.cfg.depth)).map_err(io_err)?;
    let bufs = HostPages::new(msg_bytes, slots as usize).ok_or_else(|| io_err("cannot allocate receive buffers"))?;
    // SAFETY: the buffers live until the end of this function, after the queue pair is gone.
    let keys = unsafe { s.verbs.register(bufs.base_ptr(), bufs.len_bytes()) }.map_err(io_err)?;
    let result = async {
        let sge = |i: u32| Sge {
            addr: bufs.base_ptr() as u64 + u64::from(i) * msg_bytes as u64,
            len: msg_bytes as u32,
            lkey: keys.lkey,
        };
        for i in 0..slots {
            // SAFETY: slot i is not read until its completion is polled.
            unsafe { qp.post_recv(u64::from(i), sge(i)) }.map_err(io_err)?;
        }
        qp.connect(&peer).map_err(io_err)?;
        let region = RemoteRegion {
            base: s.mem.base_ptr() as u64,
            rkey: s.keys.rkey,
            page_bytes: s.mem.page_bytes() as u64,
            pages: s.mem.pages() as u64,
            msg_bytes: msg_bytes as u32,
        };
        cm::reply(stream, &qp.endpoint(), &region).await?;
        let mut got = Vec::new();
        let mut probe = [0u8; 1];
        let mut gone: Option<FailReason> = None;
        loop {
            got.clear();
            qp.poll(64, &mut got).map_err(io_err)?;
            for c in &got {
                if c.op != WcOp::Recv {
                    continue;
                }
                if c.status != WcStatus::Success {
                    return Ok(FailReason::PeerGone(format!("queue pair failed: {:?}", c.status)));
                }
                let slot = c.wr_id as u32;
                // SAFETY: the RECV completed: the NIC is done with this slot until we repost it.
                let msg = unsafe { bufs.read(slot, 1) }.map_err(io_err)?;
                handle(s, &msg[..(c.byte_len as usize).min(msg_bytes)], c.imm.unwrap_or(0), seen);
                // SAFETY: as above; the slot is handed back to the NIC.
                unsafe { qp.post_recv(c.wr_id, sge(slot)) }.map_err(io_err)?;
            }
            if !got.is_empty() {
                tokio::task::yield_now().await;
                continue;
            }
            // Nothing left to read: if the peer has gone, what it sent before going is handled.
            if let Some(reason) = gone {
                return Ok(reason);
            }
            tokio::select! {
                r = stream.read(&mut probe) => {
                    gone = Some(FailReason::PeerGone(match r {
                        Ok(_) => "connection exchange socket closed".into(),
                        Err(e) => e.to_string(),
                    }));
                }
                () = tokio::time::sleep(Duration::from_micros(200)) => {}
            }
        }
    }
    .await;
    drop(qp);
    s.verbs.deregister(keys);
    result
}

/// One control message: headers of runs already written, or a `Done` / `Abort` with payload.
fn handle<V: Verbs>(s: &Shared<V>, msg: &[u8], imm: u32, seen: &mut HashSet<Room>) {
    let mut at = 0;
    while at + HEADER_LEN <= msg.len() {
        let mut hb = [0u8; HEADER_LEN];
        hb.copy_from_slice(&msg[at..at + HEADER_LEN]);
        at += HEADER_LEN;
        let h = match Header::decode(&hb, &s.limits) {
            Ok(h) if h.room.get() as u32 == imm => h,
            other => {
                // A corrupt message: fail the rooms it could have been for.
                tracing::warn!(?other, imm, "corrupt rdma control message");
                let rooms: Vec<Room> = seen.iter().copied().filter(|&r| r.get() as u32 == imm).collect();
                s.inbox.fail_all(rooms, &FailReason::Corrupt("corrupt control message".into()));
                return;
            }
        };
        match h.kind {
            Kind::Pages => {
                let claim = match s.inbox.with_table(|t| t.claim(&h, Instant::now())) {
                    Ok(c) => c,
                    Err(r) => {
                        tracing::debug!(room = %h.room, reason = r.label(), "rdma run refused");
                        continue;
                    }
                };
                seen.insert(h.room);
                // SAFETY: the claim gives us these pages; the WRITE that filled them completed
                // before the SEND reporting it (RC ordering).
                let ok = unsafe { s.mem.read(claim.first, claim.n) }.is_ok_and(|b| crc32c::crc32c(b) == h.payload_crc);
                s.inbox.settle(&h, claim, ok);
            }
            Kind::Done | Kind::Abort => {
                let end = (at + h.payload_len as usize).min(msg.len());
                if s.inbox.control(&h, &msg[at..end]).is_some() {
                    seen.insert(h.room);
                }
                at = end;
            }
        }
    }
}
