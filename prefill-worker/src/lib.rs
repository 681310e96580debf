//! `ferry-prefill`: the prefill daemon.
//!
//! Planned (DESIGN.md §2–§3): a library with `run(config, shutdown)` keeping the
//! bootstrap → waiting → inflight queues as I/O-free state machines, computing prompts in
//! chunks and streaming each chunk's finished KV pages to the decode node.
//!
//! Nothing is implemented yet (issue "Prefill and decode daemons with their queues").
