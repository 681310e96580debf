//! `ferry-radix`: a page-granular radix tree over token ids with a generic payload, shared by
//! the prefill node's prefix cache and the router's prefix index. It does no I/O.
//!
//! Planned (DESIGN.md §5, issue "Prefill radix cache and cache-aware scheduling"): insert,
//! match, split at the divergence point, remove and walk; children keyed by their first page;
//! prefix comparison that gallops (doubling windows, then binary search).
//!
//! Nothing is implemented yet.
