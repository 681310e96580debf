//! The sending side: one RC queue pair to one receiver; page runs go out as RDMA WRITEs from
//! the registered arena into the memory windows the receiver granted for their room, each
//! chunk's headers follow in SENDs with immediate data.

use ferry_core::{Room, RoomSecret};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::RdmaConfig;
use super::cm::{self, RemoteRegion, Window};
use super::verbs::{Completion, MemKeys, QueuePair, Sge, Verbs, WcStatus};
use crate::frame::{Aux, HEADER_LEN, Header, Kind, MAX_SMALL_PAYLOAD};
use crate::memory::HostPages;
use crate::runs::PageRun;
use crate::secure::{DataStream, Security};

/// A room's windows on the receiver, and when they were granted.
type Granted = (Arc<[Window]>, Instant);

struct QpState<Q> {
    qp: Q,
    /// Completed work requests not yet collected by their waiter.
    done: HashMap<u64, WcStatus>,
    /// Message slot each SEND uses, returned to `free` when it completes.
    slot_of: HashMap<u64, usize>,
    free: Vec<usize>,
    outstanding: u32,
    broken: Option<String>,
}

impl<Q: QueuePair> QpState<Q> {
    fn poll(&mut self) -> std::io::Result<usize> {
        let mut got: Vec<Completion> = Vec::new();
        let n = self.qp.poll(64, &mut got).map_err(std::io::Error::other)?;
        for c in got {
            self.outstanding = self.outstanding.saturating_sub(1);
            if let Some(slot) = self.slot_of.remove(&c.wr_id) {
                self.free.push(slot);
            }
            if c.status != WcStatus::Success && self.broken.is_none() {
                self.broken = Some(format!("{:?} of work request {} failed: {:?}", c.op, c.wr_id, c.status));
            }
            self.done.insert(c.wr_id, c.status);
        }
        Ok(n)
    }
}

/// Sends rooms' pages to one receiver over RDMA.
pub struct RdmaSender<V: Verbs> {
    verbs: Arc<V>,
    state: Mutex<QpState<V::Qp>>,
    region: RemoteRegion,
    mem: Arc<HostPages>,
    mem_keys: MemKeys,
    /// Registered buffers for outgoing messages: one `msg_bytes` "page" each.
    msgs: HostPages,
    msg_keys: MemKeys,
    msg_bytes: usize,
    next_wr: AtomicU64,
    cfg: RdmaConfig,
    /// Kept open for the queue pair's life (closing it tells the receiver we are gone); rooms'
    /// grants are asked for on it.
    cm: tokio::sync::Mutex<DataStream>,
    /// Rooms' windows on the receiver, and when they were granted.
    grants: Mutex<HashMap<Room, Granted>>,
    /// A grant exchange broke off (an error, a timeout, a cancelled send): the stream may hold
    /// an answer no request will read, so this sender asks for no more grants.
    broken: std::sync::atomic::AtomicBool,
}

/// Marks the sender broken unless disarmed: dropped mid-exchange (a cancelled future) or on
/// an error, the exchange leaves the stream out of step.
struct Exchange<'a>(&'a std::sync::atomic::AtomicBool, bool);

impl Drop for Exchange<'_> {
    fn drop(&mut self) {
        if !self.1 {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

impl<V: Verbs> std::fmt::Debug for RdmaSender<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaSender").field("region", &self.region).finish_non_exhaustive()
    }
}

impl<V: Verbs> Drop for RdmaSender<V> {
    fn drop(&mut self) {
        self.verbs.deregister(self.mem_keys);
        self.verbs.deregister(self.msg_keys);
    }
}

fn io_err(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

impl<V: Verbs> RdmaSender<V> {
    /// Connects to the receiver whose connection exchange listens at `addr`, registering
    /// `mem` (the arena pages are sent from). `room` and `secret` are the key of a room the
    /// receiver has open for us: it answers no one else. The exchange runs inside the TLS
    /// (or not) that `security` says.
    pub async fn connect(
        addr: SocketAddr,
        verbs: Arc<V>,
        mem: Arc<HostPages>,
        cfg: RdmaConfig,
        (room, secret): (Room, &RoomSecret),
        security: &Security,
    ) -> std::io::Result<Self> {
        let mut qp = verbs.create_qp(cfg.depth.max(2)).map_err(io_err)?;
        let mut stream = security.connect(addr).await?;
        let (peer, region) = cm::hello(&mut stream, &qp.endpoint(), room, secret).await?;
        if region.page_bytes != mem.page_bytes() as u64 {
            return Err(io_err(format!(
                "page size mismatch: receiver pages are {} bytes, ours {}",
                region.page_bytes,
                mem.page_bytes()
            )));
        }
        qp.connect(&peer).map_err(io_err)?;
        // SAFETY: the arena outlives the registration (we hold an Arc and deregister on drop);
        // the sender only reads it.
        let mem_keys = unsafe { verbs.register(mem.base_ptr(), mem.len_bytes()) }.map_err(io_err)?;
        let msg_bytes = region.msg_bytes.clamp(HEADER_LEN as u32 * 2, 1 << 16) as usize;
        let slots = cfg.depth.max(2) as usize;
        let msgs = HostPages::new(msg_bytes, slots).ok_or_else(|| io_err("cannot allocate message buffers"))?;
        // SAFETY: the buffers are owned by the sender and deregistered before they are freed.
        let msg_keys = match unsafe { verbs.register(msgs.base_ptr(), msgs.len_bytes()) } {
            Ok(k) => k,
            Err(e) => {
                verbs.deregister(mem_keys);
                return Err(io_err(e));
            }
        };
        let state = QpState {
            qp,
            done: HashMap::new(),
            slot_of: HashMap::new(),
            free: (0..slots).rev().collect(),
            outstanding: 0,
            broken: None,
        };
        Ok(Self {
            verbs,
            state: Mutex::new(state),
            region,
            mem,
            mem_keys,
            msgs,
            msg_keys,
            msg_bytes,
            next_wr: AtomicU64::new(1),
            cfg,
            cm: tokio::sync::Mutex::new(stream),
            grants: Mutex::new(HashMap::new()),
            broken: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The receiver's region.
    pub fn region(&self) -> RemoteRegion {
        self.region
    }

    /// Polls until `ready` holds, yielding between polls; fails when the queue pair broke or
    /// `op_timeout` passes.
    async fn wait(&self, mut ready: impl FnMut(&mut QpState<V::Qp>) -> bool) -> std::io::Result<()> {
        let deadline = tokio::time::Instant::now() + self.cfg.op_timeout;
        let mut idle = 0u32;
        loop {
            {
                let mut st = self.state.lock();
                let n = st.poll()?;
                if let Some(why) = &st.broken {
                    return Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, why.clone()));
                }
                if ready(&mut st) {
                    return Ok(());
                }
                idle = if n > 0 { 0 } else { idle + 1 };
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "rdma completions did not arrive"));
            }
            if idle < 64 {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
        }
    }

    /// Posts one work request once the queue has room; returns its id.
    async fn post(&self, f: impl Fn(&mut V::Qp, u64) -> Result<(), super::verbs::VerbsError>) -> std::io::Result<u64> {
        let depth = self.cfg.depth.max(2);
        self.wait(|st| st.outstanding < depth).await?;
        let id = self.next_wr.fetch_add(1, Ordering::Relaxed);
        let mut st = self.state.lock();
        f(&mut st.qp, id).map_err(io_err)?;
        st.outstanding += 1;
        Ok(id)
    }

    /// Sends `bytes` as one message with immediate data `imm`.
    async fn post_msg(&self, bytes: &[u8], imm: u32) -> std::io::Result<u64> {
        let mut slot = None;
        self.wait(|st| {
            slot = st.free.pop();
            slot.is_some()
        })
        .await?;
        let slot = slot.ok_or_else(|| io_err("no message slot"))?;
        let len = bytes.len().min(self.msg_bytes);
        // SAFETY: the slot is ours alone until its SEND completes (it is off the free list).
        let buf = unsafe { self.msgs.slice_mut(slot as u32, 1) }.map_err(io_err)?;
        buf[..len].copy_from_slice(&bytes[..len]);
        let sge = Sge { addr: buf.as_ptr() as u64, len: len as u32, lkey: self.msg_keys.lkey };
        let id = self
            .post(|qp, id| {
                // SAFETY: the slot stays unchanged until the completion frees it.
                unsafe { qp.post_send(id, sge, imm) }
            })
            .await;
        match id {
            Ok(id) => {
                self.state.lock().slot_of.insert(id, slot);
                Ok(id)
            }
            Err(e) => {
                self.state.lock().free.push(slot);
                Err(e)
            }
        }
    }

    async fn wait_all(&self, ids: &[u64]) -> std::io::Result<()> {
        self.wait(|st| ids.iter().all(|id| st.done.contains_key(id))).await?;
        let mut st = self.state.lock();
        for id in ids {
            st.done.remove(id);
        }
        Ok(())
    }

    /// Whether a grant exchange broke off: a pool should connect anew.
    pub fn broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }

    /// `room`'s windows: asked for (within `op_timeout`) on its first send.
    async fn windows(&self, room: Room, secret: &RoomSecret) -> std::io::Result<Arc<[Window]>> {
        if let Some((w, _)) = self.grants.lock().get(&room) {
            return Ok(Arc::clone(w));
        }
        let ask = async {
            let mut cm = self.cm.lock().await;
            if self.broken() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::BrokenPipe,
                    "an earlier grant exchange broke off: connect anew",
                ));
            }
            let mut exchange = Exchange(&self.broken, false);
            let got = cm::ask_grant(&mut cm, room, secret).await;
            // A refusal is an answer read whole; anything else leaves the stream out of step.
            exchange.1 = got.is_ok() || got.as_ref().is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied);
            got
        };
        let windows: Arc<[Window]> = tokio::time::timeout(self.cfg.op_timeout, ask)
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no grant for {room} in time")))??
            .into();
        let now = Instant::now();
        // A room lives no longer than its timeouts: grants of rooms that ended without a `Done`
        // or an `Abort` from here are forgotten after that.
        let t = self.cfg.timeouts;
        let life = t.bootstrap + t.waiting + t.transferring;
        let mut grants = self.grants.lock();
        grants.retain(|_, (_, at)| now.duration_since(*at) < life);
        grants.insert(room, (Arc::clone(&windows), now));
        Ok(windows)
    }

    /// Sends the pages of `runs` (source pages in `mem`, which must be the registered arena)
    /// for `room`: one WRITE per run piece into the room's windows, then the pieces' headers
    /// in SENDs.
    pub async fn send_pages(
        &self,
        room: Room,
        secret: RoomSecret,
        runs: &[PageRun],
        mem: &HostPages,
    ) -> std::io::Result<()> {
        if !std::ptr::eq(mem, &*self.mem) {
            return Err(io_err("rdma sends only from the arena registered at connect"));
        }
        let pb = self.region.page_bytes;
        let max = self.cfg.max_write_pages.max(1);
        let windows = self.windows(room, &secret).await?;
        let mut ids = Vec::new();
        let mut headers = Vec::new();
        for r in runs {
            if u64::from(r.dst) + u64::from(r.len) > self.region.pages {
                return Err(io_err(format!("destination pages {}..+{} outside the receiver's arena", r.dst, r.len)));
            }
            let mut off = 0;
            while off < r.len {
                let n = max.min(r.len - off);
                // SAFETY: the request owns its computed pages until the transfer ends.
                let payload = unsafe { self.mem.read(r.src + off, n) }.map_err(io_err)?;
                let dst = r.dst + off;
                let Some(w) = windows.iter().find(|w| w.covers(dst, n)) else {
                    return Err(io_err(format!("destination pages {dst}..+{n} are not {room}'s")));
                };
                headers.push(Header::pages(room, secret, dst, n, payload));
                let sge = Sge { addr: payload.as_ptr() as u64, len: payload.len() as u32, lkey: self.mem_keys.lkey };
                let remote = self.region.base + u64::from(dst) * pb;
                let rkey = w.rkey;
                // SAFETY: the pages stay unchanged until the completion (the request owns them).
                ids.push(self.post(|qp, id| unsafe { qp.post_write(id, sge, remote, rkey) }).await?);
                off += n;
            }
        }
        let per_msg = self.msg_bytes / HEADER_LEN;
        for chunk in headers.chunks(per_msg.max(1)) {
            let bytes: Vec<u8> = chunk.iter().flat_map(|h| h.encode()).collect();
            ids.push(self.post_msg(&bytes, room.get() as u32).await?);
        }
        self.wait_all(&ids).await
    }

    async fn control(&self, kind: Kind, room: Room, secret: RoomSecret, payload: &[u8]) -> std::io::Result<()> {
        let payload = &payload[..payload.len().min(MAX_SMALL_PAYLOAD as usize).min(self.msg_bytes - HEADER_LEN)];
        let mut bytes = Header::with(kind, room, secret, 0, 0, payload).encode().to_vec();
        bytes.extend_from_slice(payload);
        let id = self.post_msg(&bytes, room.get() as u32).await?;
        self.wait_all(&[id]).await
    }

    /// Sends the room's last message: the aux data (its windows end with it).
    pub async fn send_done(&self, room: Room, secret: RoomSecret, aux: Aux) -> std::io::Result<()> {
        self.grants.lock().remove(&room);
        self.control(Kind::Done, room, secret, &aux.encode()).await
    }

    /// Tells the receiver the room is abandoned.
    pub async fn send_abort(&self, room: Room, secret: RoomSecret, reason: &str) -> std::io::Result<()> {
        self.grants.lock().remove(&room);
        self.control(Kind::Abort, room, secret, reason.as_bytes()).await
    }
}
