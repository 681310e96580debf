//! `ferry-radix`: a page-granular radix tree over token ids with a generic payload, shared by
//! the prefill node's prefix cache (payload: the KV pages) and the router's prefix index
//! (payload: which workers hold the prefix). It does no I/O.
//!
//! - [`RadixTree`]: nodes in an arena; each node's key is a whole number of pages of tokens
//!   (the root's is empty), kept in one piece or in chunks of a bounded size; children are
//!   keyed by their first page, so a lookup step is one hash probe. Insert splits a node at the divergence point; match reports how far a prompt
//!   is cached, at page granularity; leaves can be removed; nodes can be walked.
//! - [`common_prefix`]: prefix comparison that gallops — windows of doubling size compared as
//!   slices (memcmp), then a binary search inside the window that differs — so a 4,096-token
//!   shared prefix costs about a dozen slice comparisons instead of 4,096 steps.
//! - [`events`]: the KV events a cache publishes (stored / removed pages with a chained page
//!   hash, per-worker sequence number and epoch) for an index elsewhere to follow.
//!
//! Invariants: every non-root node has a non-empty key of whole pages and a payload covering
//! exactly those pages; no two children of a node share a first page; a node's children keys
//! diverge in their first page (otherwise they would have been merged into one path).

pub mod events;
mod gallop;
mod stream;
mod tree;

pub use gallop::common_prefix;
pub use tree::{Insert, Match, NodeId, Payload, PrefixWalk, RadixTree};
