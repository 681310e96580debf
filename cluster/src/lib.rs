//! `ferry-cluster`: what every Ferry daemon shares.
//!
//! Now: identities as newtypes ([`ids`]: `Room`, `RoomSecret`, `RoomKey`, `WorkerId`,
//! `RequestId`), the KV [`LayoutDescriptor`] both sides of a transfer must agree on, and
//! [`wire`] — the one module where generated `ferry.v1` types are converted to and from
//! domain types, validating as it goes. Nothing else in Ferry touches generated types.
//!
//! [`metrics`] holds every Prometheus metric name Ferry emits, with its help text;
//! [`exporter`] installs the process's recorder and serves `/metrics`; [`status`] maps refusals
//! to gRPC codes and counts them; [`shutdown`] is the graceful-shutdown signal; [`daemon`]
//! serves and stops a daemon the same way for every role; [`notify`] tells systemd when it is
//! ready.
//!
//! [`discovery`]: static (flags or a file) and through etcd. [`mtls`]: mutual TLS between
//! daemons.

pub mod args;
pub mod daemon;
mod device;
pub mod discovery;
pub mod exporter;
pub mod ids;
mod layout;
pub mod metrics;
pub mod mtls;
pub mod notify;
pub mod pki;
pub mod shutdown;
pub mod status;
pub mod wire;

pub use args::WorkerArgs;
pub use device::{Device, NO_CUDA_BUILD};
pub use ids::{RequestId, Room, RoomKey, RoomSecret, WorkerId, secret_eq};
pub use layout::LayoutDescriptor;
pub use shutdown::{Shutdown, ShutdownTrigger};
pub use status::Refused;
