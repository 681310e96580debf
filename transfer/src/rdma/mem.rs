//! Verbs in memory: queue pairs of one process connected through a shared fabric. RDMA WRITEs
//! copy bytes into the target memory window after the checks a NIC makes (the key names a
//! window in force, bound to the queue pair the write arrives at, and the bytes lie inside it); SENDs
//! land in the peer's posted RECVs in order (waiting for one, as RC with infinite RNR retry
//! does). Faults can be injected by operation count: a failed or corrupted write, a
//! disconnect, a stall. Used by the RDMA protocol tests; needs no hardware.

use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::verbs::{Completion, MemKeys, QpEndpoint, QueuePair, Sge, Verbs, VerbsError, WcOp, WcStatus};

/// A fault, triggered by the fabric-wide count of posted WRITEs and SENDs (from 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerbsFault {
    /// That operation completes with a remote access error and its queue pair fails.
    FailAt(u64),
    /// That WRITE lands with one byte flipped and completes successfully.
    CorruptAt(u64),
    /// From that operation on, both queue pairs are in error: posts are flushed and the
    /// peer's posted RECVs flush too.
    DisconnectAt(u64),
    /// From that operation on, nothing completes or arrives (a hung peer).
    StallAt(u64),
}

#[derive(Default)]
struct Slot {
    peer: Option<u32>,
    recvs: VecDeque<(u64, Sge)>,
    /// SENDs waiting for a RECV: (payload, imm, sender qpn, sender wr_id).
    incoming: VecDeque<(Vec<u8>, u32, u32, u64)>,
    cq: VecDeque<Completion>,
    error: bool,
}

/// A memory window in force: bound on queue pair `qpn` over `addr..addr + len`.
struct Window {
    qpn: u32,
    addr: u64,
    len: u64,
}

#[derive(Default)]
struct Fabric {
    regions: HashMap<u32, (u64, usize)>,
    windows: HashMap<u32, Window>,
    next_key: u32,
    next_qpn: u32,
    qps: HashMap<u32, Slot>,
    faults: Vec<VerbsFault>,
    ops: u64,
    stalled: bool,
}

fn done(wr_id: u64, status: WcStatus, op: WcOp) -> Completion {
    Completion { wr_id, status, op, byte_len: 0, imm: None }
}

impl Fabric {
    fn region(&self, key: u32, addr: u64, len: usize) -> Option<*mut u8> {
        let &(base, size) = self.regions.get(&key)?;
        let end = addr.checked_add(len as u64)?;
        (addr >= base && end <= base + size as u64).then_some(addr as *mut u8)
    }

    /// Where a remote write of `len` bytes at `addr` under `rkey` lands, when it arrives at
    /// queue pair `at`: inside a window in force, bound on `at`.
    fn window(&self, rkey: u32, at: u32, addr: u64, len: usize) -> Option<*mut u8> {
        let w = self.windows.get(&rkey)?;
        let end = addr.checked_add(len as u64)?;
        (w.qpn == at && addr >= w.addr && end <= w.addr + w.len).then_some(addr as *mut u8)
    }

    /// Puts `qpn` and its peer in the error state, flushing the peer's RECVs.
    fn break_pair(&mut self, qpn: u32) {
        let peer = self.qps.get(&qpn).and_then(|s| s.peer);
        for q in [Some(qpn), peer].into_iter().flatten() {
            if let Some(s) = self.qps.get_mut(&q) {
                s.error = true;
                while let Some((id, _)) = s.recvs.pop_front() {
                    s.cq.push_back(done(id, WcStatus::Flushed, WcOp::Recv));
                }
            }
        }
    }

    /// Counts an operation and returns the fault that applies to it.
    fn next_op(&mut self, qpn: u32) -> Option<VerbsFault> {
        let n = self.ops;
        self.ops += 1;
        let hit = self.faults.iter().copied().find(|f| match *f {
            VerbsFault::FailAt(k) | VerbsFault::CorruptAt(k) => k == n,
            VerbsFault::DisconnectAt(k) | VerbsFault::StallAt(k) => n >= k,
        });
        match hit {
            Some(VerbsFault::DisconnectAt(_)) => self.break_pair(qpn),
            Some(VerbsFault::StallAt(_)) => self.stalled = true,
            _ => {}
        }
        hit
    }

    /// Moves queued SENDs into posted RECVs of `qpn`.
    fn deliver(&mut self, qpn: u32) {
        loop {
            let Some(slot) = self.qps.get_mut(&qpn) else { return };
            if slot.recvs.is_empty() || slot.incoming.is_empty() {
                return;
            }
            let (Some((rid, sge)), Some((payload, imm, from, wid))) =
                (slot.recvs.pop_front(), slot.incoming.pop_front())
            else {
                return;
            };
            let status = if payload.len() <= sge.len as usize {
                // SAFETY: the RECV's buffer was posted for exactly this and is not read until
                // its completion is polled (post_recv's contract).
                unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), sge.addr as *mut u8, payload.len()) };
                WcStatus::Success
            } else {
                WcStatus::Other(1) // local length error
            };
            slot.cq.push_back(Completion {
                wr_id: rid,
                status,
                op: WcOp::Recv,
                byte_len: payload.len() as u32,
                imm: Some(imm),
            });
            if let Some(s) = self.qps.get_mut(&from) {
                s.cq.push_back(done(wid, status, WcOp::Send));
            }
        }
    }
}

/// An in-memory verbs context; clones share one fabric.
#[derive(Clone, Default)]
pub struct MemVerbs {
    fabric: Arc<Mutex<Fabric>>,
}

impl std::fmt::Debug for MemVerbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemVerbs").finish_non_exhaustive()
    }
}

impl MemVerbs {
    /// A fabric with no faults.
    pub fn new() -> Self {
        Self::default()
    }

    /// A fabric that injects `faults`.
    pub fn with_faults(faults: Vec<VerbsFault>) -> Self {
        let v = Self::default();
        v.fabric.lock().faults = faults;
        v
    }

    /// WRITEs and SENDs posted so far.
    pub fn ops(&self) -> u64 {
        self.fabric.lock().ops
    }

    /// Memory windows in force.
    pub fn windows(&self) -> usize {
        self.fabric.lock().windows.len()
    }
}

impl Verbs for MemVerbs {
    type Qp = MemQp;

    unsafe fn register(&self, addr: *mut u8, len: usize) -> Result<MemKeys, VerbsError> {
        let mut f = self.fabric.lock();
        f.next_key += 1;
        let key = f.next_key;
        f.regions.insert(key, (addr as u64, len));
        Ok(MemKeys { lkey: key, rkey: key })
    }

    fn deregister(&self, keys: MemKeys) {
        self.fabric.lock().regions.remove(&keys.rkey);
    }

    fn create_qp(&self, _depth: u32) -> Result<MemQp, VerbsError> {
        let mut f = self.fabric.lock();
        f.next_qpn += 1;
        let qpn = f.next_qpn;
        f.qps.insert(qpn, Slot::default());
        Ok(MemQp { qpn, fabric: Arc::clone(&self.fabric) })
    }
}

/// A queue pair on a [`MemVerbs`] fabric.
pub struct MemQp {
    qpn: u32,
    fabric: Arc<Mutex<Fabric>>,
}

impl Drop for MemQp {
    fn drop(&mut self) {
        let mut f = self.fabric.lock();
        f.qps.remove(&self.qpn);
        // Windows die with the queue pair they were bound on.
        f.windows.retain(|_, w| w.qpn != self.qpn);
    }
}

impl MemQp {
    /// Common checks of a post: connected, not in error, fault injection. Returns the peer
    /// and the fault, or pushes the flushed completion and returns None.
    fn begin(&self, f: &mut Fabric, wr_id: u64, op: WcOp) -> Option<(u32, Option<VerbsFault>)> {
        let fault = f.next_op(self.qpn);
        if f.stalled {
            return None;
        }
        let slot = f.qps.get_mut(&self.qpn)?;
        let peer = match (slot.error, slot.peer) {
            (false, Some(p)) => p,
            (true, _) => {
                slot.cq.push_back(done(wr_id, WcStatus::Flushed, op));
                return None;
            }
            (false, None) => {
                slot.cq.push_back(done(wr_id, WcStatus::Other(2), op));
                return None;
            }
        };
        if let Some(VerbsFault::FailAt(_)) = fault {
            slot.cq.push_back(done(wr_id, WcStatus::RemoteAccess, op));
            f.break_pair(self.qpn);
            return None;
        }
        if !f.qps.contains_key(&peer) {
            if let Some(s) = f.qps.get_mut(&self.qpn) {
                s.cq.push_back(done(wr_id, WcStatus::RetryExceeded, op));
            }
            f.break_pair(self.qpn);
            return None;
        }
        Some((peer, fault))
    }
}

impl QueuePair for MemQp {
    fn endpoint(&self) -> QpEndpoint {
        QpEndpoint { qpn: self.qpn, lid: 1, gid: [0; 16], psn: self.qpn.wrapping_mul(7919) & 0xff_ffff }
    }

    fn connect(&mut self, remote: &QpEndpoint) -> Result<(), VerbsError> {
        let mut f = self.fabric.lock();
        let slot = f.qps.get_mut(&self.qpn).ok_or(VerbsError::Call { call: "modify_qp", detail: "gone".into() })?;
        slot.peer = Some(remote.qpn);
        Ok(())
    }

    unsafe fn post_write(&mut self, wr_id: u64, local: Sge, remote_addr: u64, rkey: u32) -> Result<(), VerbsError> {
        let mut f = self.fabric.lock();
        let Some((peer, fault)) = self.begin(&mut f, wr_id, WcOp::Write) else { return Ok(()) };
        let (Some(src), Some(dst)) = (
            f.region(local.lkey, local.addr, local.len as usize),
            f.window(rkey, peer, remote_addr, local.len as usize),
        ) else {
            if let Some(s) = f.qps.get_mut(&self.qpn) {
                s.cq.push_back(done(wr_id, WcStatus::RemoteAccess, WcOp::Write));
            }
            f.break_pair(self.qpn);
            return Ok(());
        };
        // SAFETY: the source lies inside a registered region and the target inside a window in
        // force (checked above); the source stays valid until this completion is polled
        // (post_write's contract), and a remote write into a window is what binding it allowed.
        unsafe {
            std::ptr::copy(src, dst, local.len as usize);
            if let (Some(VerbsFault::CorruptAt(_)), true) = (fault, local.len > 0) {
                *dst.add(local.len as usize / 2) ^= 0x5a;
            }
        }
        if let Some(s) = f.qps.get_mut(&self.qpn) {
            s.cq.push_back(done(wr_id, WcStatus::Success, WcOp::Write));
        }
        Ok(())
    }

    unsafe fn post_send(&mut self, wr_id: u64, local: Sge, imm: u32) -> Result<(), VerbsError> {
        let mut f = self.fabric.lock();
        let Some((peer, _)) = self.begin(&mut f, wr_id, WcOp::Send) else { return Ok(()) };
        let Some(src) = f.region(local.lkey, local.addr, local.len as usize) else {
            return Err(VerbsError::Call { call: "post_send", detail: "local buffer not registered".into() });
        };
        // SAFETY: inside a registered region, valid until the completion (post_send's contract).
        let payload = unsafe { std::slice::from_raw_parts(src, local.len as usize) }.to_vec();
        if let Some(s) = f.qps.get_mut(&peer) {
            s.incoming.push_back((payload, imm, self.qpn, wr_id));
        }
        f.deliver(peer);
        Ok(())
    }

    unsafe fn post_recv(&mut self, wr_id: u64, local: Sge) -> Result<(), VerbsError> {
        let mut f = self.fabric.lock();
        if f.region(local.lkey, local.addr, local.len as usize).is_none() {
            return Err(VerbsError::Call { call: "post_recv", detail: "buffer not registered".into() });
        }
        let Some(slot) = f.qps.get_mut(&self.qpn) else { return Ok(()) };
        if slot.error {
            slot.cq.push_back(done(wr_id, WcStatus::Flushed, WcOp::Recv));
            return Ok(());
        }
        slot.recvs.push_back((wr_id, local));
        if !f.stalled {
            f.deliver(self.qpn);
        }
        Ok(())
    }

    fn bind_window(&mut self, wr_id: u64, mr: MemKeys, addr: u64, len: u64) -> Result<u32, VerbsError> {
        let mut f = self.fabric.lock();
        if f.region(mr.lkey, addr, len as usize).is_none() {
            return Err(VerbsError::Call { call: "bind_mw", detail: "outside the memory region".into() });
        }
        f.next_key += 1;
        let rkey = f.next_key;
        f.windows.insert(rkey, Window { qpn: self.qpn, addr, len });
        if let Some(s) = f.qps.get_mut(&self.qpn) {
            s.cq.push_back(done(wr_id, WcStatus::Success, WcOp::Window));
        }
        Ok(rkey)
    }

    fn invalidate_window(&mut self, wr_id: u64, rkey: u32) -> Result<(), VerbsError> {
        let mut f = self.fabric.lock();
        if f.windows.get(&rkey).is_some_and(|w| w.qpn == self.qpn) {
            f.windows.remove(&rkey);
        }
        if let Some(s) = f.qps.get_mut(&self.qpn) {
            s.cq.push_back(done(wr_id, WcStatus::Success, WcOp::Window));
        }
        Ok(())
    }

    fn poll(&mut self, max: usize, out: &mut Vec<Completion>) -> Result<usize, VerbsError> {
        let mut f = self.fabric.lock();
        let Some(slot) = f.qps.get_mut(&self.qpn) else { return Ok(0) };
        let n = max.min(slot.cq.len());
        out.extend(slot.cq.drain(..n));
        Ok(n)
    }
}
