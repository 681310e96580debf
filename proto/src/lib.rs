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

#[cfg(test)]
mod tests {
    #[test]
    fn descriptor_set_names_every_service() {
        let text = String::from_utf8_lossy(super::FILE_DESCRIPTOR_SET);
        for service in ["Router", "Prefill", "Decode", "Bootstrap", "KvEvents", "Load"] {
            assert!(text.contains(service), "{service} missing from the descriptor set");
        }
    }

    #[test]
    fn messages_round_trip_through_prost() -> Result<(), prost::DecodeError> {
        use prost::Message;
        let req = super::v1::HandshakeRequest {
            room: Some(super::v1::RoomKey { room: 7, secret: vec![1; 16] }),
            dest_pages: vec![3, 4, 5],
            data_endpoint: "127.0.0.1:9000".into(),
            transfer_backend: "tcp".into(),
            layout: None,
            registration: vec![],
            held_pages: 2,
        };
        let back = super::v1::HandshakeRequest::decode(req.encode_to_vec().as_slice())?;
        assert_eq!(back, req);
        Ok(())
    }
}
