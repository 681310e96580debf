//! `ferry-router`: the cluster's front door (DESIGN.md §6).
//!
//! Built so far: [`index`], the prefix index — a radix tree over token ids whose pages record
//! which prefill workers hold them, fed by the workers' KV events and by provisional marks for
//! the router's own placements.
//!
//! To come (issue "Router: cache-aware placement, gRPC and OpenAI APIs, etcd discovery"):
//! placement, the public gRPC `ferry.v1.Router` service, the OpenAI-compatible HTTP API,
//! etcd discovery.

pub mod index;
