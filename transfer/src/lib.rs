//! `ferry-transfer`: moves KV pages from a prefill node into the pages a decode node
//! preallocated for the same request.
//!
//! - [`runs`]: coalescing (source, destination) page lists into maximal runs where both sides
//!   are consecutive — one run is one contiguous region on each side (pages are page-major),
//!   so a chunk becomes a few large writes;
//! - [`frame`]: the data-plane frame header (room, secret, destination run, length, CRC32C)
//!   and its bounded decoder (fuzzed: `transfer/fuzz`);
//! - [`room`]: the forward-only room state machine with a timeout in every state;
//! - [`memory`]: the host page arena shared by engine, sender and receiver;
//! - [`table`]: the receiver's open rooms — secrets, page ownership, claims and commits,
//!   refusals counted by reason; [`inbox`] shares it between a receiver's connections;
//! - backends: [`tcp`] (raw TCP, fault filters for tests), [`rdma`] (RDMA WRITE + SEND with
//!   immediate, over a narrow verbs trait with an in-memory implementation; real ibverbs
//!   with feature `rdma`), [`fake`] (moves nothing);
//! - [`backend`]: `--transfer tcp | rdma | fake | auto` and the [`Sender`] / [`Receiver`]
//!   enums over the backends; [`send_room`]: the sender's per-room object;
//! - [`secure`]: mutual TLS and peer roles on every data-plane connection (or plaintext, asked
//!   for explicitly);
//! - [`metrics`]: bytes, runs, chunk latency and throughput per backend, room outcomes by
//!   reason, refusals.

pub mod backend;
pub mod fake;
pub mod frame;
pub mod inbox;
pub mod memory;
pub mod metrics;
pub mod rdma;
pub mod room;
pub mod runs;
pub mod secure;
pub mod send_room;
pub mod table;
pub mod tcp;

pub use backend::{BackendKind, Receiver, Sender};
pub use send_room::SendRoom;
