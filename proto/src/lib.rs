//! `ferry-proto`: Ferry's gRPC contract, package `ferry.v1`, compiled with protox and
//! tonic-prost-build (no system `protoc`).
//!
//! - `proto/ferry/v1/common.proto`: sampling parameters, finish reasons, the KV layout
//!   descriptor;
//! - `proto/ferry/v1/router.proto`: the public `Router` service (Generate stream, Tokenize,
//!   ListWorkers) and load reports;
//! - `proto/ferry/v1/worker.proto`: `Prefill`, `Decode`, `Bootstrap` (the handshake),
//!   `KvEvents` and `Load`.
//!
//! Generated types stay at the edge: the conversions to and from Ferry's domain types live in
//! one module, `ferry_cluster::wire`, and nothing else touches them.

#![allow(missing_docs)] // generated code

/// Generated messages and services of package `ferry.v1`.
pub mod v1 {
    tonic::include_proto!("ferry.v1");
}

/// The encoded file descriptor set, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("ferry_descriptor");
