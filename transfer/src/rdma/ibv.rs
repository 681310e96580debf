//! [`Verbs`] on real libibverbs (feature `rdma`), through `ibverbs-sys`. The `ibverbs` crate's
//! safe layer registers only memory it allocates and posts only SENDs, so this talks to the raw
//! bindings under it: the page arena is registered in place and runs go out as RDMA WRITEs.
//!
//! Needs an RDMA device (InfiniBand, RoCE, or Soft-RoCE). Without one, [`IbVerbs::open`]
//! fails with [`VerbsError::NoDevice`] — `--transfer auto` then falls back to TCP.

use std::ptr;

use ibverbs_sys as ffi;

use super::verbs::{Completion, MemKeys, QpEndpoint, QueuePair, Sge, Verbs, VerbsError, WcOp, WcStatus};

const PORT: u8 = 1;

fn call_err(call: &'static str, errno: i32) -> VerbsError {
    VerbsError::Call { call, detail: std::io::Error::from_raw_os_error(errno).to_string() }
}

fn last_err(call: &'static str) -> VerbsError {
    VerbsError::Call { call, detail: std::io::Error::last_os_error().to_string() }
}

/// RDMA devices on this machine (0 when they cannot be listed).
pub fn device_count() -> usize {
    let mut n = 0i32;
    // SAFETY: plain call; the list is freed at once.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return 0;
    }
    // SAFETY: from ibv_get_device_list.
    unsafe { ffi::ibv_free_device_list(list) };
    n.max(0) as usize
}

/// An opened device context and its protection domain, with the memory regions registered
/// on it: shared by the [`IbVerbs`] and every queue pair made from it, and released when the
/// last of them goes (regions, then the domain, then the device: each after what was made on
/// it, as libibverbs requires).
struct Device {
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    /// Registered regions by remote key (their `ibv_mr` pointers).
    mrs: parking_lot::Mutex<std::collections::HashMap<u32, usize>>,
}

// SAFETY: libibverbs contexts, protection domains and memory regions are thread-safe; the
// region map is behind a mutex.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

impl Device {
    fn regions(&self) -> parking_lot::MutexGuard<'_, std::collections::HashMap<u32, usize>> {
        self.mrs.lock()
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: every queue pair, completion queue and window made on this domain holds an
        // `Arc<Device>` and is gone; the regions, the domain and the context are released once,
        // in that order.
        unsafe {
            for mr in self.regions().drain().map(|(_, mr)| mr) {
                ffi::ibv_dereg_mr(mr as *mut ffi::ibv_mr);
            }
            ffi::ibv_dealloc_pd(self.pd);
            ffi::ibv_close_device(self.ctx);
        }
    }
}

/// An opened device with one protection domain.
pub struct IbVerbs {
    dev: std::sync::Arc<Device>,
    lid: u16,
    gid: [u8; 16],
    gid_index: u8,
}

impl std::fmt::Debug for IbVerbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbVerbs").field("lid", &self.lid).finish_non_exhaustive()
    }
}

impl IbVerbs {
    /// Opens the device named `name` (or the first one) and queries port 1 and GID `gid_index`.
    pub fn open(name: Option<&str>, gid_index: u8) -> Result<Self, VerbsError> {
        let mut n = 0i32;
        // SAFETY: plain call; the list is freed below.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(VerbsError::NoDevice(format!(
                "no RDMA device on this machine (cannot list devices: {}); use --transfer tcp",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `list` holds `n` device pointers.
        let devices = unsafe { std::slice::from_raw_parts(list, n.max(0) as usize) };
        let names: Vec<String> = devices
            .iter()
            // SAFETY: a device from the list; its name is a C string owned by the list.
            .map(|&d| unsafe { std::ffi::CStr::from_ptr(ffi::ibv_get_device_name(d)) }.to_string_lossy().into_owned())
            .collect();
        // SAFETY: a device from the list may be opened before the list is freed.
        let raw = super::pick_device(&names, name).map(|i| unsafe { ffi::ibv_open_device(devices[i]) });
        // SAFETY: from ibv_get_device_list; opened contexts stay valid after this.
        unsafe { ffi::ibv_free_device_list(list) };
        let raw = raw?;
        if raw.is_null() {
            return Err(last_err("ibv_open_device"));
        }
        // SAFETY: `raw` is an open context.
        let pd = unsafe { ffi::ibv_alloc_pd(raw) };
        if pd.is_null() {
            let e = last_err("ibv_alloc_pd");
            // SAFETY: opened above, nothing made on it.
            unsafe { ffi::ibv_close_device(raw) };
            return Err(e);
        }
        // From here on, dropping `dev` releases the domain and the context.
        let dev = std::sync::Arc::new(Device { ctx: raw, pd, mrs: Default::default() });
        // SAFETY: an all-zero port attribute struct is valid for the call to fill.
        let mut port: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: valid context and out-pointer.
        let rc = unsafe { ffi::ibv_query_port(raw, PORT, ptr::from_mut(&mut port).cast()) };
        if rc != 0 {
            return Err(call_err("ibv_query_port", rc));
        }
        // SAFETY: as above.
        let mut gid: ffi::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: valid context and out-pointer.
        let rc = unsafe { ffi::ibv_query_gid(raw, PORT, i32::from(gid_index), &mut gid) };
        if rc != 0 {
            return Err(call_err("ibv_query_gid", rc));
        }
        // SAFETY: both union views are plain bytes.
        let gid = unsafe { gid.raw };
        Ok(Self { dev, lid: port.lid, gid, gid_index })
    }
}

impl Verbs for IbVerbs {
    type Qp = IbQp;

    unsafe fn register(&self, addr: *mut u8, len: usize) -> Result<MemKeys, VerbsError> {
        // No remote access through the region itself: peers write through windows bound on it.
        let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE | ffi::ibv_access_flags::IBV_ACCESS_MW_BIND;
        // SAFETY: the caller keeps the memory alive while registered (trait contract).
        let mr = unsafe { ffi::ibv_reg_mr(self.dev.pd, addr.cast(), len, access.0 as i32) };
        if mr.is_null() {
            return Err(last_err("ibv_reg_mr"));
        }
        // SAFETY: a registered region.
        let keys = unsafe { MemKeys { lkey: (*mr).lkey, rkey: (*mr).rkey } };
        self.dev.regions().insert(keys.rkey, mr as usize);
        Ok(keys)
    }

    fn deregister(&self, keys: MemKeys) {
        if let Some(mr) = self.dev.regions().remove(&keys.rkey) {
            // SAFETY: registered by `register` and not yet deregistered.
            unsafe { ffi::ibv_dereg_mr(mr as *mut ffi::ibv_mr) };
        }
    }

    fn create_qp(&self, depth: u32) -> Result<IbQp, VerbsError> {
        // SAFETY: valid context.
        let cq = unsafe { ffi::ibv_create_cq(self.dev.ctx, (2 * depth) as i32, ptr::null_mut(), ptr::null_mut(), 0) };
        if cq.is_null() {
            return Err(last_err("ibv_create_cq"));
        }
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: cq,
            recv_cq: cq,
            srq: ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: depth,
                max_recv_wr: depth,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: valid protection domain and attributes.
        let qp = unsafe { ffi::ibv_create_qp(self.dev.pd, &mut init) };
        if qp.is_null() {
            // SAFETY: created above, unused.
            unsafe { ffi::ibv_destroy_cq(cq) };
            return Err(last_err("ibv_create_qp"));
        }
        let psn = rand_psn();
        Ok(IbQp {
            qp,
            cq,
            dev: std::sync::Arc::clone(&self.dev),
            lid: self.lid,
            gid: self.gid,
            gid_index: self.gid_index,
            psn,
            bound: Default::default(),
            spare: Vec::new(),
        })
    }
}

fn rand_psn() -> u32 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(1);
    t & 0xff_ffff
}

/// An RC queue pair with its completion queue.
pub struct IbQp {
    qp: *mut ffi::ibv_qp,
    cq: *mut ffi::ibv_cq,
    /// The device it was made on, kept open until this is gone.
    dev: std::sync::Arc<Device>,
    lid: u16,
    gid: [u8; 16],
    gid_index: u8,
    psn: u32,
    /// Windows bound on this queue pair, by remote key.
    bound: std::collections::HashMap<u32, usize>,
    /// Windows allocated and invalidated, bound again before new ones are allocated.
    spare: Vec<usize>,
}

// SAFETY: a queue pair may be used from any thread; callers serialise access (`&mut self`).
unsafe impl Send for IbQp {}

impl Drop for IbQp {
    fn drop(&mut self) {
        // SAFETY: created in `create_qp`, destroyed once; the windows after the queue pair
        // they were bound on; the device (`self.dev`, dropped after this) after all of them.
        unsafe {
            ffi::ibv_destroy_qp(self.qp);
            ffi::ibv_destroy_cq(self.cq);
            for mw in self.bound.values().chain(&self.spare) {
                let mw = *mw as *mut ffi::ibv_mw;
                if let Some(f) = (*(*mw).context).ops.dealloc_mw {
                    f(mw);
                }
            }
        }
    }
}

impl IbQp {
    fn modify(&mut self, attr: &mut ffi::ibv_qp_attr, mask: ffi::ibv_qp_attr_mask) -> Result<(), VerbsError> {
        // SAFETY: valid queue pair and attributes.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, attr, mask.0 as i32) };
        if rc != 0 {
            return Err(call_err("ibv_modify_qp", rc));
        }
        Ok(())
    }

    fn post(&mut self, wr: &mut ffi::ibv_send_wr) -> Result<(), VerbsError> {
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: ibv_post_send is an inline dispatch through the context's ops table.
        let rc = unsafe {
            let ctx = (*self.qp).context;
            match (*ctx).ops.post_send {
                Some(f) => f(self.qp, wr, &mut bad),
                None => libc_enosys(),
            }
        };
        if rc != 0 {
            return Err(call_err("ibv_post_send", rc));
        }
        Ok(())
    }
}

fn libc_enosys() -> i32 {
    38
}

impl QueuePair for IbQp {
    fn endpoint(&self) -> QpEndpoint {
        // SAFETY: valid queue pair.
        let qpn = unsafe { (*self.qp).qp_num };
        QpEndpoint { qpn, lid: self.lid, gid: self.gid, psn: self.psn }
    }

    fn connect(&mut self, remote: &QpEndpoint) -> Result<(), VerbsError> {
        use ffi::ibv_qp_attr_mask as M;
        let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: PORT,
            qp_access_flags: access.0,
            ..Default::default()
        };
        self.modify(&mut a, M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS)?;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: ffi::IBV_MTU_1024,
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ..Default::default()
        };
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.port_num = PORT;
        if remote.gid != [0; 16] {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ffi::ibv_gid { raw: remote.gid };
            a.ah_attr.grh.hop_limit = 1;
            a.ah_attr.grh.sgid_index = self.gid_index;
        }
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
        )?;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            sq_psn: self.psn,
            max_rd_atomic: 1,
            ..Default::default()
        };
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }

    unsafe fn post_write(&mut self, wr_id: u64, local: Sge, remote_addr: u64, rkey: u32) -> Result<(), VerbsError> {
        let mut sge = ffi::ibv_sge { addr: local.addr, length: local.len, lkey: local.lkey };
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            sg_list: &mut sge,
            num_sge: 1,
            opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
        self.post(&mut wr)
    }

    unsafe fn post_send(&mut self, wr_id: u64, local: Sge, imm: u32) -> Result<(), VerbsError> {
        let mut sge = ffi::ibv_sge { addr: local.addr, length: local.len, lkey: local.lkey };
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            sg_list: &mut sge,
            num_sge: 1,
            opcode: ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        wr.__bindgen_anon_1.imm_data = imm.to_be();
        self.post(&mut wr)
    }

    unsafe fn post_recv(&mut self, wr_id: u64, local: Sge) -> Result<(), VerbsError> {
        let mut sge = ffi::ibv_sge { addr: local.addr, length: local.len, lkey: local.lkey };
        let mut wr = ffi::ibv_recv_wr { wr_id, next: ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
        let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
        // SAFETY: ibv_post_recv is an inline dispatch through the context's ops table.
        let rc = unsafe {
            let ctx = (*self.qp).context;
            match (*ctx).ops.post_recv {
                Some(f) => f(self.qp, &mut wr, &mut bad),
                None => libc_enosys(),
            }
        };
        if rc != 0 {
            return Err(call_err("ibv_post_recv", rc));
        }
        Ok(())
    }

    fn bind_window(&mut self, wr_id: u64, mr: MemKeys, addr: u64, len: u64) -> Result<u32, VerbsError> {
        let region = self.dev.regions().get(&mr.rkey).copied();
        let region = region.ok_or(VerbsError::Call { call: "ibv_bind_mw", detail: "unknown memory region".into() })?;
        let mw = match self.spare.pop() {
            Some(mw) => mw as *mut ffi::ibv_mw,
            None => {
                // SAFETY: ibv_alloc_mw is an inline dispatch through the context's ops table.
                let mw = unsafe {
                    match (*(*self.dev.pd).context).ops.alloc_mw {
                        Some(f) => f(self.dev.pd, ffi::IBV_MW_TYPE_2),
                        None => ptr::null_mut(),
                    }
                };
                if mw.is_null() {
                    return Err(last_err("ibv_alloc_mw"));
                }
                mw
            }
        };
        // ibv_inc_rkey: a new tag each bind, so a key from an earlier binding stops working.
        // SAFETY: an allocated window.
        let old = unsafe { (*mw).rkey };
        let rkey = (old & 0xffff_ff00) | (old.wrapping_add(1) & 0xff);
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            opcode: ffi::ibv_wr_opcode::IBV_WR_BIND_MW,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        wr.__bindgen_anon_2.bind_mw = ffi::ibv_send_wr__bindgen_ty_4__bindgen_ty_1 {
            mw,
            rkey,
            bind_info: ffi::ibv_mw_bind_info {
                mr: region as *mut ffi::ibv_mr,
                addr,
                length: len,
                mw_access_flags: ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
            },
        };
        if let Err(e) = self.post(&mut wr) {
            self.spare.push(mw as usize);
            return Err(e);
        }
        // Posted binds leave `ibv_mw.rkey` as it was (only `ibv_bind_mw` updates it): keep the
        // tag moving, so that a spare window's next key differs from every earlier one.
        // SAFETY: an allocated window, ours alone.
        unsafe { (*mw).rkey = rkey };
        self.bound.insert(rkey, mw as usize);
        Ok(rkey)
    }

    fn invalidate_window(&mut self, wr_id: u64, rkey: u32) -> Result<(), VerbsError> {
        let Some(mw) = self.bound.remove(&rkey) else {
            return Err(VerbsError::Call {
                call: "ibv_post_send",
                detail: format!("no window {rkey:#x} to invalidate"),
            });
        };
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            opcode: ffi::ibv_wr_opcode::IBV_WR_LOCAL_INV,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        wr.__bindgen_anon_1.invalidate_rkey = rkey;
        match self.post(&mut wr) {
            Ok(()) => {
                // Bound again only by a later work request, which the send queue runs after this.
                self.spare.push(mw);
                Ok(())
            }
            Err(e) => {
                self.bound.insert(rkey, mw);
                Err(e)
            }
        }
    }

    fn poll(&mut self, max: usize, out: &mut Vec<Completion>) -> Result<usize, VerbsError> {
        let mut wcs = vec![ffi::ibv_wc::default(); max.clamp(1, 64)];
        // SAFETY: ibv_poll_cq is an inline dispatch through the context's ops table; `wcs`
        // has room for the entries requested.
        let n = unsafe {
            let ctx = (*self.cq).context;
            match (*ctx).ops.poll_cq {
                Some(f) => f(self.cq, wcs.len() as i32, wcs.as_mut_ptr()),
                None => -libc_enosys(),
            }
        };
        if n < 0 {
            return Err(call_err("ibv_poll_cq", -n));
        }
        for wc in &wcs[..n as usize] {
            let status = match wc.error() {
                None => WcStatus::Success,
                Some((ffi::ibv_wc_status::IBV_WC_REM_ACCESS_ERR, _)) => WcStatus::RemoteAccess,
                Some((ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR, _)) => WcStatus::Flushed,
                Some((ffi::ibv_wc_status::IBV_WC_RETRY_EXC_ERR | ffi::ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR, _)) => {
                    WcStatus::RetryExceeded
                }
                Some((s, _)) => WcStatus::Other(s),
            };
            let op = match wc.opcode() {
                ffi::ibv_wc_opcode::IBV_WC_RDMA_WRITE => WcOp::Write,
                ffi::ibv_wc_opcode::IBV_WC_SEND => WcOp::Send,
                ffi::ibv_wc_opcode::IBV_WC_BIND_MW | ffi::ibv_wc_opcode::IBV_WC_LOCAL_INV => WcOp::Window,
                _ => WcOp::Recv,
            };
            let imm = wc.imm_data().map(u32::from_be);
            out.push(Completion { wr_id: wc.wr_id(), status, op, byte_len: wc.len() as u32, imm });
        }
        Ok(n as usize)
    }
}
