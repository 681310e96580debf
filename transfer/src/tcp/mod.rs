//! The `tcp` backend: raw TCP, not gRPC. Each frame is a 52-byte header and the payload,
//! written with one vectored write straight from pool memory; the receiver reads a run's
//! payload straight into the room's destination pages and checks its CRC32C there (a failed
//! check fails the room, whose pages no request will read). Several connections per peer
//! carry one room's runs in parallel; connections are reused across rooms.
//!
//! The receiver acknowledges each room it received whole ([`ACK_LEN`] bytes back on the
//! connection that completed it), and the sender's `send_done` waits for that: a room whose
//! frames were lost with a connection (behind a frame that stalled, say) fails on the sender
//! within the transferring timeout, instead of counting as sent while the receiver waits. A
//! connection's end fails the rooms it carried at once, on both sides.

mod fault;
mod receiver;
mod sender;

pub use fault::{Fault, FaultFilter, NoFaults};
pub use receiver::TcpReceiver;
pub use sender::{MAX_CONNECTIONS, TcpSender};

use crate::room::Timeouts;

/// An acknowledgement: the room id (little-endian) and 1 (received whole).
pub const ACK_LEN: usize = 9;

fn ack(room: ferry_core::Room) -> [u8; ACK_LEN] {
    let mut a = [1u8; ACK_LEN];
    a[..8].copy_from_slice(&room.get().to_le_bytes());
    a
}

/// Settings of the tcp backend.
#[derive(Debug, Clone, Copy)]
pub struct TcpConfig {
    /// Connections per peer (1 to [`MAX_CONNECTIONS`]; clamped).
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
