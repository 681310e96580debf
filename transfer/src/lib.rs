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
//! - [`inbox`]: the room table and the owners awaiting outcomes, shared by receivers;
//! - [`tcp`]: the raw-TCP data plane (sender, receiver, fault filters for tests);
//! - [`fake`]: moves nothing, completes at once, same room accounting.
//!
//! Still to come (issue "KV transfer engine"): the `rdma` backend (feature) over a narrow
//! verbs trait, `--transfer auto`, metrics, and the fuzz target.

pub mod fake;
pub mod frame;
pub mod inbox;
pub mod memory;
pub mod room;
pub mod runs;
pub mod table;
pub mod tcp;
