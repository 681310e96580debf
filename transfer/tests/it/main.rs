//! Transfer tests over real loopback sockets: the tcp backend, and the rdma protocol on
//! in-memory verbs (its connection exchange still runs over TCP).

mod common;
mod rdma;
mod tcp;
