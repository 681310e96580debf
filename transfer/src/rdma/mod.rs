//! The `rdma` backend: RC queue pairs, the decode node's page arena registered for remote
//! writes, each page run sent as one RDMA WRITE straight from the prefill node's arena into
//! the room's preallocated pages, and every chunk closed by a SEND with immediate data (the
//! room) carrying the runs' headers — room, secret, destination, length, CRC32C. RC delivers
//! a SEND after the WRITEs posted before it, so when the receiver sees the SEND the bytes are
//! in place: it checks each run against the room table and its checksum before it counts.
//!
//! The protocol is written against [`verbs::Verbs`]. [`mem::MemVerbs`] implements it in
//! memory, with failure injection, for tests on any machine; `IbVerbs` (feature `rdma`)
//! implements it on libibverbs and fails with a clear error when no device is present.
//!
//! What the receiver CPU cannot do with RDMA: refuse a WRITE. A peer holding the region's key
//! can write anywhere in the arena, so the key goes only to peers that completed the
//! connection exchange, which asks for the key of a room open on the receiver (handed out over
//! the daemons' mutual TLS; one key, one exchange); a run that fails its room's checks or
//! checksum fails the room. The data plane itself is not encrypted. Per-room memory regions, which would bound a peer to its rooms' pages, are
//! not built yet.

pub mod cm;
#[cfg(feature = "rdma")]
mod ibv;
pub mod mem;
mod receiver;
mod sender;
pub mod verbs;

use std::time::Duration;

#[cfg(feature = "rdma")]
pub use ibv::IbVerbs;
pub use receiver::RdmaReceiver;
pub use sender::RdmaSender;

use crate::room::Timeouts;

/// Settings of the rdma backend.
#[derive(Debug, Clone, Copy)]
pub struct RdmaConfig {
    /// Outstanding work requests per queue pair.
    pub depth: u32,
    /// Most pages in one RDMA WRITE (and one checksummed run).
    pub max_write_pages: u32,
    /// Bytes of one control message (a receive buffer).
    pub msg_bytes: u32,
    /// RECVs the receiver keeps posted per queue pair.
    pub recv_slots: u32,
    /// How long a send may wait for its completions.
    pub op_timeout: Duration,
    /// Room timeouts on the receiver.
    pub timeouts: Timeouts,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            depth: 256,
            max_write_pages: 64,
            msg_bytes: 4096,
            recv_slots: 64,
            op_timeout: Duration::from_secs(30),
            timeouts: Timeouts::default(),
        }
    }
}

/// Whether an RDMA device is present (always false without the `rdma` feature).
pub fn device_present() -> bool {
    #[cfg(feature = "rdma")]
    {
        ibv::device_count() > 0
    }
    #[cfg(not(feature = "rdma"))]
    {
        false
    }
}
