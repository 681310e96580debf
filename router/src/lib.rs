//! `ferry-router`: the cluster's front door.
//!
//! Planned (DESIGN.md §6): a prefix index over token ids fed by the prefill workers' KV
//! events, cache-aware placement, the public gRPC `ferry.v1.Router` service and an
//! OpenAI-compatible HTTP API.
//!
//! Nothing is implemented yet (issue "Router: cache-aware placement, gRPC and OpenAI APIs,
//! etcd discovery").
