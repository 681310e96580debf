//! `ferry-router`: the cluster's front door (DESIGN.md §6).
//!
//! Built so far, both pure:
//! - [`index`]: the prefix index — a radix tree over token ids whose pages record which
//!   prefill workers hold them, fed by the workers' KV events and by provisional marks for the
//!   router's own placements;
//! - [`placement`]: least estimated time to first token (cached prefix against queue and
//!   measured rate) with a jitter against herding; round-robin and least-load for comparison;
//!   decode by admissible room; conditional disaggregation.
//!
//! To come (issue "Router: cache-aware placement, gRPC and OpenAI APIs, etcd discovery"): the
//! daemon around them — event subscriptions, the public gRPC `ferry.v1.Router` service, the
//! OpenAI-compatible HTTP API, health checks and circuit breakers, etcd discovery.

pub mod index;
pub mod placement;
