//! `ferry-cluster`: what every Ferry daemon shares.
//!
//! Planned layout (DESIGN.md §1, §7, §8): identities as newtypes (`RequestId`, `Room`,
//! `WorkerId`), errors with stable codes, discovery (static configuration or etcd leases),
//! health, the Prometheus exporter with every metric name defined in one module, TLS, and
//! graceful shutdown.
//!
//! Nothing is implemented yet: the daemons that need it arrive with the issue
//! "Prefill and decode daemons with their queues".
