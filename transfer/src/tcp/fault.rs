//! Fault filters a test puts on a sender's frames: drop, delay, reorder, truncate, corrupt,
//! cut. They simulate a bad network; nothing else in Ferry uses them.

use std::time::Duration;

use crate::frame::Header;

/// What to do to one frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Send it as it is.
    Pass,
    /// Do not send it.
    Drop,
    /// Wait, then send it.
    Delay(Duration),
    /// Send it after the next frame on the same connection.
    Reorder,
    /// Flip one payload byte (at this offset, modulo the length) after the checksum was taken.
    Corrupt(usize),
    /// Send the header and this many payload bytes, then close the connection.
    Truncate(usize),
    /// Close the connection instead of sending.
    Cut,
}

/// Decides the fault for each frame; `index` counts the sender's frames from 0.
pub trait FaultFilter: Send + Sync {
    /// The fault for this frame.
    fn on_frame(&self, index: u64, header: &Header) -> Fault;
}

/// No faults.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoFaults;

impl FaultFilter for NoFaults {
    fn on_frame(&self, _: u64, _: &Header) -> Fault {
        Fault::Pass
    }
}

impl<F: Fn(u64, &Header) -> Fault + Send + Sync> FaultFilter for F {
    fn on_frame(&self, index: u64, header: &Header) -> Fault {
        self(index, header)
    }
}
