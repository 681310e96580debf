//! The `tcp` backend: raw TCP, not gRPC. Each frame is a 52-byte header and the payload,
//! written with one vectored write straight from pool memory; the receiver reads a run's
//! payload straight into the room's destination pages and checks its CRC32C there (a failed
//! check fails the room, whose pages no request will read). Several connections per peer
//! carry one room's runs in parallel; connections are reused across rooms.

mod fault;
mod receiver;
mod sender;

pub use fault::{Fault, FaultFilter, NoFaults};
pub use receiver::TcpReceiver;
pub use sender::TcpSender;

use crate::room::Timeouts;

/// Settings of the tcp backend.
#[derive(Debug, Clone, Copy)]
pub struct TcpConfig {
    /// Connections per peer.
    pub connections: usize,
    /// Most pages in one frame (bounds each write and the receiver's frame size).
    pub max_frame_pages: u32,
    /// Room timeouts on the receiver.
    pub timeouts: Timeouts,
}

impl Default for TcpConfig {
    fn default() -> Self {
        Self { connections: 4, max_frame_pages: 64, timeouts: Timeouts::default() }
    }
}
