//! `ferry-decode`: the decode daemon.
//!
//! Planned (DESIGN.md §2–§3): a library with `run(config, shutdown)` keeping the
//! prealloc → transfer → waiting → running queues as I/O-free state machines; it
//! preallocates pages before prefill computes and decodes with continuous batching.
//!
//! Nothing is implemented yet (issue "Prefill and decode daemons with their queues").
