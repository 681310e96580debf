//! `ferry-transfer`: moves KV pages from a prefill node into the pages a decode node
//! preallocated for the same request.
//!
//! Planned layout (DESIGN.md §4, issue "KV transfer engine"):
//! - `room`: the handshake content (room id, secret, destination pages, endpoint, layout) and
//!   the sender / receiver state machines, which only move forward
//!   (bootstrapping → waiting for input → transferring → success; failed overrides all);
//! - `runs`: coalescing (source, destination) page lists into maximal contiguous runs;
//! - backends behind one trait: `tcp` (raw framed TCP, CRC32C per run), `rdma` (ibverbs,
//!   feature `rdma`) and `fake` (completes at once, moves nothing);
//! - fault filters (drop, delay, reorder, truncate, corrupt, cut) for tests.
//!
//! Nothing is implemented yet: this crate is a placeholder so that the workspace has its
//! final shape. It exports no behaviour.
