//! `ferry-transfer`: moves KV pages from a prefill node into the pages a decode node
//! preallocated for the same request.
//!
//! Built so far (the hardware-free core, all pure):
//! - [`runs`]: coalescing (source, destination) page lists into maximal runs where both sides
//!   are consecutive — one run is one contiguous region on each side (pages are page-major),
//!   so a chunk becomes a few large writes;
//! - [`frame`]: the data-plane frame header (room, secret, destination run, length, CRC32C)
//!   and its bounded decoder;
//! - [`room`]: the forward-only room state machine with a timeout in every state;
//! - [`memory`]: the host page arena shared by engine, sender and receiver;
//! - [`table`]: the receiver's open rooms — secrets, page ownership, claims and commits,
//!   refusals counted by reason.
//!
//! - [`tcp`]: the raw-TCP data plane (sender, receiver, fault filters for tests).
//!
//! Still to come (issue "KV transfer engine"): one backend trait over `tcp`, `rdma` (feature)
//! and `fake`, metrics, the benchmark and the fuzz target.

pub mod frame;
pub mod memory;
pub mod room;
pub mod runs;
pub mod table;
pub mod tcp;
