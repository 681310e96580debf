//! `ferry-cluster`: the control plane every Ferry daemon shares (the router and both
//! workers): it builds no compute kernels and no data plane (`.ci/run` checks that the router
//! builds neither).
//!
//! The vocabulary — ids, the KV layout, metric names — lives in `ferry-core` and is
//! re-exported here. [`wire`] is the one module where generated `ferry.v1` types are converted
//! to and from domain types, validating as it goes. Nothing else in Ferry touches generated
//! types.
//!
//! [`exporter`] installs the process's recorder and serves `/metrics`; [`status`] maps refusals
//! to gRPC codes and counts them; [`shutdown`] is the graceful-shutdown signal; [`daemon`]
//! serves and stops a daemon the same way for every role; [`notify`] tells systemd when it is
//! ready.
//!
//! [`discovery`]: static (flags or a file) and through etcd. [`mtls`]: mutual TLS between
//! daemons; [`roles`]: which daemon may call which worker service under it; [`dial`]: channels
//! to another daemon that check its role too. [`args`]: flag helpers every daemon uses (timeouts,
//! defaults, etcd's flags); [`telemetry`], [`traces`], [`phases`]: logs, spans and each
//! request's phase clock; [`pki`]: a throwaway cluster CA.

pub mod accept;
pub mod args;
pub mod daemon;
pub mod dial;
pub mod discovery;
pub mod exporter;
pub mod mtls;
pub mod notify;
pub mod phases;
pub mod pki;
pub mod roles;
pub mod shutdown;
pub mod status;
pub mod telemetry;
pub mod traces;
pub mod wire;

// The shared vocabulary lives in `ferry-core`; re-exported so daemons name it one way.
pub use ferry_core::{
    LayoutDescriptor, PageId, RequestId, Room, RoomKey, RoomSecret, TraceContext, WorkerId, env, fork_pages,
    fork_shared_pages, ids, metrics, secret_eq, trace,
};
pub use shutdown::{Shutdown, ShutdownTrigger};
pub use status::Refused;
