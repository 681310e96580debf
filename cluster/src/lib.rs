//! `ferry-cluster`: what every Ferry daemon shares.
//!
//! Now: identities as newtypes ([`ids`]: `Room`, `RoomSecret`, `RoomKey`, `WorkerId`,
//! `RequestId`), the KV [`LayoutDescriptor`] both sides of a transfer must agree on, and
//! [`wire`] — the one module where generated `ferry.v1` types are converted to and from
//! domain types, validating as it goes. Nothing else in Ferry touches generated types.
//!
//! [`metrics`] holds every Prometheus metric name Ferry emits, with its help text.
//!
//! Planned (DESIGN.md §1, §7, §8): errors with stable codes, discovery (static | etcd), health,
//! the Prometheus exporter, TLS, graceful shutdown — they arrive with the daemons.

pub mod ids;
mod layout;
pub mod metrics;
pub mod wire;

pub use ids::{RequestId, Room, RoomKey, RoomSecret, WorkerId};
pub use layout::LayoutDescriptor;
