//! `ferry-transfer`: moves KV pages from a prefill node into the pages a decode node
//! preallocated for the same request.
//!
//! Built so far (the hardware-free core, all pure):
//! - [`runs`]: coalescing (source, destination) page lists into maximal runs where both sides
//!   are consecutive — one run is one contiguous region on each side (pages are page-major),
//!   so a chunk becomes a few large writes;
//! - [`frame`]: the data-plane frame header (room, secret, destination run, length, CRC32C)
//!   and its bounded decoder;
//! - [`room`]: the forward-only room state machine with a timeout in every state.
//!
//! Still to come (issue "KV transfer engine"): the `tcp`, `rdma` (feature) and `fake` backends
//! behind one trait, sender / receiver objects driving [`room`], fault filters, metrics.

pub mod frame;
pub mod room;
pub mod runs;
