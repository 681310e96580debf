//! The narrow verbs interface the RDMA protocol is written against: register memory, create
//! and connect an RC queue pair, bind and invalidate memory windows, post RDMA WRITE / SEND /
//! RECV work requests and poll their completions. Two implementations: [`super::mem::MemVerbs`] (in memory, with failure
//! injection, always built) and `IbVerbs` (real ibverbs, feature `rdma`).

/// A verbs call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    /// No RDMA device on this machine (or none with the requested name).
    #[error("no RDMA device: {0}")]
    NoDevice(String),
    /// The backend was not compiled in.
    #[error("the rdma backend is not built in: rebuild with `--features rdma` (needs libibverbs)")]
    NotBuilt,
    /// A verbs call returned an error.
    #[error("{call} failed: {detail}")]
    Call {
        /// The verbs function.
        call: &'static str,
        /// errno or a description.
        detail: String,
    },
}

/// Keys of a registered memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemKeys {
    /// For local scatter/gather entries.
    pub lkey: u32,
    /// For remote peers' RDMA WRITEs.
    pub rkey: u32,
}

/// What a peer needs to connect its queue pair to ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpEndpoint {
    /// Queue pair number.
    pub qpn: u32,
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// GID (RoCE; zero on InfiniBand without GRH).
    pub gid: [u8; 16],
    /// Initial packet sequence number.
    pub psn: u32,
}

/// Encoded size of a [`QpEndpoint`].
pub const ENDPOINT_LEN: usize = 26;

impl QpEndpoint {
    /// Fixed little-endian encoding.
    pub fn encode(&self) -> [u8; ENDPOINT_LEN] {
        let mut b = [0u8; ENDPOINT_LEN];
        b[0..4].copy_from_slice(&self.qpn.to_le_bytes());
        b[4..6].copy_from_slice(&self.lid.to_le_bytes());
        b[6..22].copy_from_slice(&self.gid);
        b[22..26].copy_from_slice(&self.psn.to_le_bytes());
        b
    }

    /// Decodes [`encode`](Self::encode)'s output.
    pub fn decode(b: &[u8; ENDPOINT_LEN]) -> Self {
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[6..22]);
        Self {
            qpn: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            lid: u16::from_le_bytes([b[4], b[5]]),
            gid,
            psn: u32::from_le_bytes([b[22], b[23], b[24], b[25]]),
        }
    }
}

/// A local buffer: registered memory at `addr..addr + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Start address.
    pub addr: u64,
    /// Bytes.
    pub len: u32,
    /// The region's local key.
    pub lkey: u32,
}

/// How a work request ended (the subset of `ibv_wc_status` the protocol tells apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    /// Completed.
    Success,
    /// The remote side refused the access (bad key or out of the region's bounds).
    RemoteAccess,
    /// The queue pair went to the error state; outstanding requests are flushed.
    Flushed,
    /// Retries exhausted: the peer is unreachable.
    RetryExceeded,
    /// Any other failure, with the provider's status code.
    Other(u32),
}

/// What completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcOp {
    /// An RDMA WRITE we posted.
    Write,
    /// A SEND we posted.
    Send,
    /// A RECV we posted received a SEND.
    Recv,
    /// A memory window we bound or invalidated.
    Window,
}

/// One work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The id the request was posted with.
    pub wr_id: u64,
    /// How it ended.
    pub status: WcStatus,
    /// What it was.
    pub op: WcOp,
    /// Bytes received (RECV).
    pub byte_len: u32,
    /// Immediate data (RECV of a SEND with immediate).
    pub imm: Option<u32>,
}

/// A device context: memory registration and queue pairs.
pub trait Verbs: Send + Sync + 'static {
    /// This implementation's queue pair.
    type Qp: QueuePair;

    /// Registers `len` bytes at `addr` for local access and for binding memory windows. The
    /// region's own remote key grants no remote access: a peer writes only through a window
    /// ([`QueuePair::bind_window`]).
    ///
    /// # Safety
    /// The memory must stay allocated until the registration is dropped with the context.
    unsafe fn register(&self, addr: *mut u8, len: usize) -> Result<MemKeys, VerbsError>;

    /// Drops a registration made by [`register`](Self::register).
    fn deregister(&self, keys: MemKeys);

    /// Creates an RC queue pair with room for `depth` outstanding requests each way.
    fn create_qp(&self, depth: u32) -> Result<Self::Qp, VerbsError>;
}

/// An RC queue pair with its own completion queue.
pub trait QueuePair: Send + 'static {
    /// What a peer needs to connect to this queue pair.
    fn endpoint(&self) -> QpEndpoint;

    /// Connects to the peer (INIT → RTR → RTS).
    fn connect(&mut self, remote: &QpEndpoint) -> Result<(), VerbsError>;

    /// Posts an RDMA WRITE of `local` to `remote_addr` under `rkey`; signalled.
    ///
    /// # Safety
    /// `local` must stay valid and unchanged until the request's completion is polled.
    unsafe fn post_write(&mut self, wr_id: u64, local: Sge, remote_addr: u64, rkey: u32) -> Result<(), VerbsError>;

    /// Posts a SEND of `local` with immediate data `imm`; signalled.
    ///
    /// # Safety
    /// As for [`post_write`](Self::post_write).
    unsafe fn post_send(&mut self, wr_id: u64, local: Sge, imm: u32) -> Result<(), VerbsError>;

    /// Posts a RECV into `local`.
    ///
    /// # Safety
    /// `local` must stay valid, and not be read, until the request's completion is polled.
    unsafe fn post_recv(&mut self, wr_id: u64, local: Sge) -> Result<(), VerbsError>;

    /// Binds a fresh memory window over `len` bytes at `addr` of the region `mr` for remote
    /// writes by this queue pair's peer only (a type 2 window: no other queue pair can use its
    /// key); returns the window's remote key. Signalled: its completion (`WcOp::Window`) says the
    /// window is in force.
    fn bind_window(&mut self, wr_id: u64, mr: MemKeys, addr: u64, len: u64) -> Result<u32, VerbsError>;

    /// Invalidates the window with remote key `rkey` (bound on this queue pair): writes under it
    /// fail from then on. Signalled, completing as `WcOp::Window`.
    fn invalidate_window(&mut self, wr_id: u64, rkey: u32) -> Result<(), VerbsError>;

    /// Appends up to `max` completions to `out`; returns how many.
    fn poll(&mut self, max: usize, out: &mut Vec<Completion>) -> Result<usize, VerbsError>;
}
