//! `ferry-tests`: cluster tests that run real daemons in-process on port 0 and as separate
//! processes, with fault filters and chaos.
//!
//! The engine's own tests live in `engine/tests`; the cluster harness arrives with the
//! daemons (issue "Prefill and decode daemons with their queues").
