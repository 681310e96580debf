//! The receiving side: registers the page arena, accepts senders' connection exchanges (only
//! from a peer showing a live room's key), binds each granted room's memory windows on the
//! asking sender's queue pair ([`super::windows`]), keeps RECVs posted on each queue pair and
//! checks every run a SEND reports against the room table and its checksum.

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
use super::cm::{self, RemoteRegion, Window};
use super::verbs::{Completion, MemKeys, QueuePair, Sge, Verbs, WcOp, WcStatus};
use super::windows::{Grants, Link, SharedLink};
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
    grants: Grants<V::Qp>,
    /// Where lease timeouts run (`close` is called from the engine's thread).
    rt: tokio::runtime::Handle,
}

impl<V: Verbs> Shared<V> {
    /// `room`'s sender can write no more: its windows are invalidated, and a closed room's
    /// pages released.
    fn end_lease(&self, room: Room) {
        self.grants.revoke(room);
        self.inbox.with_table(|t| t.end_lease(room));
    }
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
        // remote writes land only through the windows of granted rooms.
        let keys = unsafe { verbs.register(mem.base_ptr(), mem.len_bytes()) }.map_err(io_err)?;
        let inbox = Inbox::new(cfg.timeouts, "rdma");
        let rt = tokio::runtime::Handle::current();
        let shared = Arc::new(Shared { inbox, mem, keys, verbs, limits, cfg, grants: Grants::default(), rt });
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

    /// Forgets a room; later messages for it are refused. A room whose sender may still be
    /// writing (granted, not ended by it) keeps its windows and its pages (`inbox().released`
    /// says when they are free) until the sender ends it or the transferring timeout passes;
    /// otherwise its windows are invalidated before this returns.
    pub fn close(&self, room: Room) -> Option<State> {
        let state = self.shared.inbox.close(room);
        if self.shared.inbox.with_table(|t| t.leased_closing(room)) {
            let (s, after) = (Arc::clone(&self.shared), self.shared.cfg.timeouts.transferring);
            self.shared.rt.spawn(async move {
                tokio::time::sleep(after).await;
                s.end_lease(room);
            });
        } else {
            self.shared.grants.revoke(room);
        }
        state
    }

    /// Rooms whose pages a sender may write now (memory windows in force).
    pub fn granted_rooms(&self) -> usize {
        self.shared.grants.rooms()
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

/// A connection's queue pair and receive buffers.
struct Conn<'a, V: Verbs> {
    s: &'a Shared<V>,
    link: SharedLink<V::Qp>,
    bufs: HostPages,
    keys: MemKeys,
    msg_bytes: usize,
    got: Vec<Completion>,
}

impl<V: Verbs> Conn<'_, V> {
    fn sge(&self, i: u32) -> Sge {
        Sge {
            addr: self.bufs.base_ptr() as u64 + u64::from(i) * self.msg_bytes as u64,
            len: self.msg_bytes as u32,
            lkey: self.keys.lkey,
        }
    }

    /// Polls the queue pair once, handling what arrived; how many completions there were, or
    /// why the connection ends.
    fn round(&mut self, seen: &mut HashSet<Room>) -> std::io::Result<Result<usize, FailReason>> {
        self.got.clear();
        {
            let mut l = self.link.lock();
            if l.poisoned {
                return Ok(Err(FailReason::PeerGone("a memory window could not be invalidated".into())));
            }
            l.qp.poll(64, &mut self.got).map_err(io_err)?;
        }
        let mut ended = Vec::new();
        for c in std::mem::take(&mut self.got) {
            if c.op == WcOp::Window {
                self.link.lock().window_done();
                if c.status != WcStatus::Success {
                    return Ok(Err(FailReason::PeerGone(format!("a memory window operation failed: {:?}", c.status))));
                }
                continue;
            }
            if c.op != WcOp::Recv {
                continue;
            }
            if c.status != WcStatus::Success {
                return Ok(Err(FailReason::PeerGone(format!("queue pair failed: {:?}", c.status))));
            }
            let slot = c.wr_id as u32;
            // SAFETY: the RECV completed: the NIC is done with this slot until we repost it.
            let msg = unsafe { self.bufs.read(slot, 1) }.map_err(io_err)?;
            handle(self.s, &msg[..(c.byte_len as usize).min(self.msg_bytes)], c.imm.unwrap_or(0), seen, &mut ended);
            let sge = self.sge(slot);
            // SAFETY: as above; the slot is handed back to the NIC.
            unsafe { self.link.lock().qp.post_recv(c.wr_id, sge) }.map_err(io_err)?;
            self.got.push(c);
        }
        // A room that ended on this connection needs its windows no more.
        for room in ended {
            self.s.end_lease(room);
        }
        Ok(Ok(self.got.len()))
    }

    /// Polls (handling what arrives) until `ready` holds for the link.
    async fn until(
        &mut self,
        seen: &mut HashSet<Room>,
        ready: impl Fn(&Link<V::Qp>) -> bool,
    ) -> std::io::Result<Result<(), FailReason>> {
        let deadline = tokio::time::Instant::now() + self.s.cfg.op_timeout;
        loop {
            if let Err(why) = self.round(seen)? {
                return Ok(Err(why));
            }
            if ready(&self.link.lock()) {
                return Ok(Ok(()));
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(Err(FailReason::PeerGone("memory window operations did not complete".into())));
            }
            tokio::task::yield_now().await;
        }
    }

    /// A sender asks for a room's windows: binds one per run of the room's pages on this queue
    /// pair and answers with their keys once they are in force, or refuses.
    async fn grant(
        &mut self,
        stream: &mut DataStream,
        q: &[u8; cm::GRANT_REQUEST_LEN],
        seen: &mut HashSet<Room>,
    ) -> std::io::Result<Result<(), FailReason>> {
        let (room, secret) = cm::parse_grant_request(q)?;
        let runs = match self.s.inbox.with_table(|t| t.grant(room, &secret)) {
            Ok(pages) => cm::page_runs(&pages),
            Err(r) => {
                tracing::warn!(%room, reason = r.label(), "rdma grant refused");
                return cm::grant(stream, room, None).await.map(Ok);
            }
        };
        // This connection carries the room from now on: it fails with it.
        seen.insert(room);
        if runs.len() > cm::MAX_WINDOWS {
            tracing::warn!(%room, runs = runs.len(), "rdma grant refused: too many separate page runs");
            self.s.end_lease(room);
            return cm::grant(stream, room, None).await.map(Ok);
        }
        let (base, pb) = (self.s.mem.base_ptr() as u64, self.s.mem.page_bytes() as u64);
        let depth = self.s.cfg.depth.max(2);
        let mut windows = Vec::with_capacity(runs.len());
        for (first, pages) in runs {
            if let Err(why) = self.until(seen, |l| l.in_flight < depth && !l.waiting()).await? {
                return Ok(Err(why));
            }
            let rkey = self
                .link
                .lock()
                .bind(self.s.keys, base + u64::from(first) * pb, u64::from(pages) * pb)
                .map_err(io_err)?;
            windows.push(Window { first, pages, rkey });
        }
        self.s.grants.insert(room, &self.link, windows.iter().map(|w| w.rkey).collect());
        // In force before the sender may write.
        if let Err(why) = self.until(seen, |l| l.in_flight == 0).await? {
            return Ok(Err(why));
        }
        // Closed meanwhile: the sender gets no keys, and the lease ends here.
        if self.s.inbox.state(room).is_none() {
            self.s.end_lease(room);
            return cm::grant(stream, room, None).await.map(Ok);
        }
        cm::grant(stream, room, Some(&windows)).await.map(Ok)
    }
}

async fn serve_qp<V: Verbs>(
    s: &Shared<V>,
    stream: &mut DataStream,
    seen: &mut HashSet<Room>,
) -> std::io::Result<FailReason> {
    let (peer, room, secret) = tokio::time::timeout(HELLO_TIMEOUT, cm::read_hello(stream))
        .await
        .map_err(|_| io_err(format!("no connection exchange within {HELLO_TIMEOUT:?}")))??;
    // Nothing (no queue pair, no address) for a peer without a live room's key.
    if let Err(r) = s.inbox.with_table(|t| t.admit_peer(room, &secret)) {
        tracing::warn!(%room, reason = r.label(), "rdma connection exchange refused");
        return Ok(FailReason::PeerGone(format!("connection exchange refused: {}", r.label())));
    }
    let slots = s.cfg.recv_slots.max(1);
    let msg_bytes = s.cfg.msg_bytes.max(HEADER_LEN as u32 * 2) as usize;
    let qp = s.verbs.create_qp(slots.max(s.cfg.depth)).map_err(io_err)?;
    let bufs = HostPages::new(msg_bytes, slots as usize).ok_or_else(|| io_err("cannot allocate receive buffers"))?;
    // SAFETY: the buffers live until the end of this function, after the queue pair is gone.
    let keys = unsafe { s.verbs.register(bufs.base_ptr(), bufs.len_bytes()) }.map_err(io_err)?;
    let mut conn = Conn { s, link: Link::new(qp, slots.max(s.cfg.depth)), bufs, keys, msg_bytes, got: Vec::new() };
    let result = async {
        for i in 0..slots {
            let sge = conn.sge(i);
            // SAFETY: slot i is not read until its completion is polled.
            unsafe { conn.link.lock().qp.post_recv(u64::from(i), sge) }.map_err(io_err)?;
        }
        conn.link.lock().qp.connect(&peer).map_err(io_err)?;
        let region = RemoteRegion {
            base: s.mem.base_ptr() as u64,
            page_bytes: s.mem.page_bytes() as u64,
            pages: s.mem.pages() as u64,
            msg_bytes: msg_bytes as u32,
        };
        let ours = conn.link.lock().qp.endpoint();
        cm::reply(stream, &ours, &region).await?;
        let mut q = [0u8; cm::GRANT_REQUEST_LEN];
        let mut filled = 0;
        let mut gone: Option<FailReason> = None;
        loop {
            let n = match conn.round(seen)? {
                Ok(n) => n,
                Err(why) => return Ok(why),
            };
            if n > 0 {
                tokio::task::yield_now().await;
                continue;
            }
            // Nothing left to read: if the peer has gone, what it sent before going is handled.
            if let Some(reason) = gone.take() {
                return Ok(reason);
            }
            tokio::select! {
                r = stream.read(&mut q[filled..]) => match r {
                    Ok(0) => gone = Some(FailReason::PeerGone("connection exchange socket closed".into())),
                    Err(e) => gone = Some(FailReason::PeerGone(e.to_string())),
                    Ok(k) => {
                        filled += k;
                        if filled == q.len() {
                            filled = 0;
                            if let Err(why) = conn.grant(stream, &q, seen).await? {
                                return Ok(why);
                            }
                        }
                    }
                },
                () = tokio::time::sleep(Duration::from_micros(200)) => {}
            }
        }
    }
    .await;
    // The queue pair goes, and its windows with it: the leases end.
    let granted = s.grants.forget(&conn.link);
    drop(conn.link);
    for room in granted {
        s.inbox.with_table(|t| t.end_lease(room));
    }
    s.verbs.deregister(keys);
    result
}

/// One control message: headers of runs already written, or a `Done` / `Abort` with payload
/// (its room goes in `ended`).
fn handle<V: Verbs>(s: &Shared<V>, msg: &[u8], imm: u32, seen: &mut HashSet<Room>, ended: &mut Vec<Room>) {
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
                // Its sender is done with a room this connection carries (granted, or closed
                // here since): its windows go and its lease ends before the outcome is known,
                // so a closing room's pages are free at once and no window outlives the room.
                let mine = seen.contains(&h.room);
                if mine {
                    s.end_lease(h.room);
                }
                if s.inbox.control(&h, &msg[at..end]).is_some() {
                    seen.insert(h.room);
                    if !mine {
                        ended.push(h.room);
                    }
                }
                at = end;
            }
        }
    }
}
