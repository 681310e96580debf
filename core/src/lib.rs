//! `ferry-core`: the words every Ferry crate shares, with nothing heavy under it (no gRPC,
//! no etcd, no async runtime; rustls alone, for its crypto provider), so that the data plane (`ferry-transfer`) depends on this
//! alone.
//!
//! - [`bench`]: what every benchmark reads from its environment;
//! - [`env`]: every environment variable a flag reads;
//! - [`ids`]: identities as newtypes (`Room`, `RoomSecret`, `RoomKey`, `PageId`, `WorkerId`,
//!   `RequestId`) and constant-time secret comparison;
//! - [`LayoutDescriptor`]: the KV layout both sides of a transfer must agree on;
//! - [`metrics`]: every Prometheus metric name Ferry emits, with its help text;
//! - [`tls`]: the crypto provider every TLS connection of Ferry's runs on;
//! - [`trace`]: the W3C trace context that follows one request across daemons.

pub mod bench;
pub mod env;
pub mod ids;
mod layout;
pub mod metrics;
pub mod tls;
pub mod trace;

pub use ids::{PageId, RequestId, Room, RoomKey, RoomSecret, WorkerId, secret_eq};
pub use layout::{LayoutDescriptor, fork_pages, fork_shared_pages};
pub use trace::TraceContext;
