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
//! What the receiver CPU cannot do with RDMA: refuse a WRITE. So nothing in the arena is
//! writable from the network but through memory windows ([`windows`]): a sender first shows a
//! live room's key in the connection exchange ([`cm`], inside the data plane's mutual TLS,
//! `crate::secure`), then asks for each room's grant with that room's key, once; the receiver
//! binds one window per run of the room's pages on that sender's queue pair and invalidates
//! them when the room ends or closes. A write anywhere else fails the queue pair and the rooms
//! it carried. The WRITEs and SENDs themselves are not encrypted (RDMA NICs carry them below
//! TLS): keep the RDMA fabric to the workers.

pub mod cm;
#[cfg(feature = "rdma")]
mod ibv;
pub mod mem;
mod receiver;
mod sender;
pub mod verbs;
mod windows;

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
