//! An attempt's two calls carry the same prompt ids (`PrefillRequest.token_ids`,
//! `DecodeRequest.token_ids`). They are encoded once, as the packed varints protobuf writes for
//! a `repeated uint32`, and each call's message is written without them and then the field
//! appended: protobuf readers accept a message's fields in any order. prost encoded the ids
//! for each call one varint at a time (~5 ns an id: ~45 µs of a 4,600-token request's router
//! CPU for the two calls); once, a byte at a time, ~32 µs in the router at c = 1; now without
//! a branch on each varint's length, ~15 µs (docs/performance.md, "W3 at c = 1, sixth pass").

use std::marker::PhantomData;

use crate::h2_calls::Calls;
use ferry_proto::v1 as pb;
use prost::Message;
use prost::bytes::Bytes;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint};
use tonic::codec::{BufferSettings, Codec, EncodeBuf, Encoder};
use tonic::{Response, Status, Streaming};
use tonic_prost::ProstDecoder;

/// `PrefillRequest.token_ids`' field number (`proto/proto/ferry/v1/worker.proto`).
const PREFILL_IDS: u32 = 3;
/// `DecodeRequest.token_ids`' field number.
const DECODE_IDS: u32 = 4;

/// A prompt's ids as packed varints, shared by the calls of an attempt.
#[derive(Debug, Clone)]
pub(super) struct PackedIds(Bytes);

impl PackedIds {
    /// Each id's varint is built in a `u64` and written as 8 bytes, of which the next id
    /// overwrites all but its length: no branch on the length, which a byte-at-a-time loop
    /// mispredicts about every other id of a prompt (1 to 3 bytes each, in no order). Written
    /// a block at a time into a buffer on the stack, so that the output is never zeroed first
    /// (zeroing it cost as much as the packing).
    pub(super) fn new(ids: &[u32]) -> Self {
        const BLOCK: usize = 256;
        let mut out = Vec::with_capacity(ids.len() * 3);
        let mut block = [0u8; BLOCK * 5 + 8];
        for chunk in ids.chunks(BLOCK) {
            let mut at = 0;
            for &id in chunk {
                let (word, len) = varint(id);
                block[at..at + 8].copy_from_slice(&word.to_le_bytes());
                at += len;
            }
            out.extend_from_slice(&block[..at]);
        }
        Self(out.into())
    }
}

/// The continuation bits of a varint by its length: set on every byte but the last.
const MORE_BY_LEN: [u64; 6] = [0, 0, 0x80, 0x8080, 0x80_8080, 0x8080_8080];

/// `id` as a protobuf varint in the low bytes of a `u64` (little-endian), and its length.
fn varint(id: u32) -> (u64, usize) {
    let v = u64::from(id);
    let groups = (v & 0x7f)
        | ((v << 1) & 0x7f00)
        | ((v << 2) & 0x7f_0000)
        | ((v << 3) & 0x7f00_0000)
        | ((v << 4) & 0x0f_0000_0000);
    let len = encoded_len_varint(v);
    (groups | MORE_BY_LEN[len], len)
}

/// A request whose `token_ids` (left empty in `msg`) are written from [`PackedIds`].
#[derive(Debug)]
pub(super) struct WithIds<M> {
    msg: M,
    field: u32,
    ids: PackedIds,
}

impl WithIds<pb::PrefillRequest> {
    pub(super) fn prefill(msg: pb::PrefillRequest, ids: PackedIds) -> Self {
        debug_assert!(msg.token_ids.is_empty(), "the ids go in `ids`");
        Self { msg, field: PREFILL_IDS, ids }
    }
}

impl WithIds<pb::DecodeRequest> {
    pub(super) fn decode(msg: pb::DecodeRequest, ids: PackedIds) -> Self {
        debug_assert!(msg.token_ids.is_empty(), "the ids go in `ids`");
        Self { msg, field: DECODE_IDS, ids }
    }
}

impl<M: Message> WithIds<M> {
    fn write(&self, buf: &mut impl prost::bytes::BufMut) {
        // Only fails for want of space; the buffers here grow.
        let _ = self.msg.encode(buf);
        if !self.ids.0.is_empty() {
            encode_key(self.field, WireType::LengthDelimited, buf);
            encode_varint(self.ids.0.len() as u64, buf);
            buf.put_slice(&self.ids.0);
        }
    }
}

/// Writes [`WithIds`] requests; reads answers as the generated clients do (tonic-prost).
struct IdsCodec<M, R>(PhantomData<(M, R)>);

struct IdsEncoder<M>(PhantomData<M>);

impl<M: Message + Send + 'static> Encoder for IdsEncoder<M> {
    type Item = WithIds<M>;
    type Error = Status;

    fn encode(&mut self, item: Self::Item, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.write(buf);
        Ok(())
    }
}

impl<M: Message + Send + 'static, R: Message + Default + Send + 'static> Codec for IdsCodec<M, R> {
    type Encode = WithIds<M>;
    type Decode = R;
    type Encoder = IdsEncoder<M>;
    type Decoder = ProstDecoder<R>;

    fn encoder(&mut self) -> Self::Encoder {
        IdsEncoder(PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::new(BufferSettings::default())
    }
}

fn client(calls: Calls, max_answer: usize) -> tonic::client::Grpc<Calls> {
    let origin = calls.origin().clone();
    tonic::client::Grpc::with_origin(calls, origin).max_decoding_message_size(max_answer)
}

/// `ferry.v1.Prefill/Prefill`, as the generated client calls it (over [`Calls`]: one write).
pub(super) async fn prefill(
    calls: Calls,
    max_answer: usize,
    mut req: tonic::Request<WithIds<pb::PrefillRequest>>,
) -> Result<Response<pb::PrefillResponse>, Status> {
    let mut grpc = client(calls, max_answer);
    req.extensions_mut().insert(tonic::GrpcMethod::new("ferry.v1.Prefill", "Prefill"));
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/ferry.v1.Prefill/Prefill");
    grpc.unary(req, path, IdsCodec(PhantomData)).await
}

/// `ferry.v1.Decode/Generate`, as the generated client calls it (over [`Calls`]: one write).
pub(super) async fn generate(
    calls: Calls,
    max_answer: usize,
    mut req: tonic::Request<WithIds<pb::DecodeRequest>>,
) -> Result<Response<Streaming<pb::DecodeResponse>>, Status> {
    let mut grpc = client(calls, max_answer);
    req.extensions_mut().insert(tonic::GrpcMethod::new("ferry.v1.Decode", "Generate"));
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/ferry.v1.Decode/Generate");
    grpc.server_streaming(req, path, IdsCodec(PhantomData)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ids of every varint length, and none.
    fn ids(n: usize) -> Vec<u32> {
        let mut x = 0x9e37_79b9u32;
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                [x % 128, x % 16_384, x % 2_097_152, x % 268_435_456, x, u32::MAX][i % 6]
            })
            .collect()
    }

    /// Every varint length's edges, each against prost's own encoding.
    #[test]
    fn varints_are_protobufs() {
        let edges = [0, 1, 127, 128, 16_383, 16_384, 2_097_151, 2_097_152, 268_435_455, 268_435_456, u32::MAX];
        for id in edges {
            let mut want = Vec::new();
            encode_varint(u64::from(id), &mut want);
            let (word, len) = varint(id);
            assert_eq!(&word.to_le_bytes()[..len], want.as_slice(), "{id}");
            assert_eq!(word >> (8 * len), 0, "{id}: bytes past its length");
        }
    }

    #[test]
    fn written_messages_read_back_as_the_generated_types() {
        for n in [0, 1, 5, 4_645] {
            let want = ids(n);
            let packed = PackedIds::new(&want);
            let room = Some(pb::RoomKey { room: 7, secret: vec![1; 32] });
            let p = pb::PrefillRequest {
                request_id: "r".into(),
                room: room.clone(),
                pull_from: "x:1".into(),
                priority: 3,
                ..Default::default()
            };
            let mut buf = Vec::new();
            WithIds::prefill(p.clone(), packed.clone()).write(&mut buf);
            let got = pb::PrefillRequest::decode(buf.as_slice()).expect("decode");
            assert_eq!(got, pb::PrefillRequest { token_ids: want.clone(), ..p }, "{n} ids");
            let d = pb::DecodeRequest { request_id: "r".into(), room, ..Default::default() };
            let mut buf = Vec::new();
            WithIds::decode(d.clone(), packed).write(&mut buf);
            let got = pb::DecodeRequest::decode(buf.as_slice()).expect("decode");
            assert_eq!(got, pb::DecodeRequest { token_ids: want.clone(), ..d }, "{n} ids");
            // The same bytes as prost's own encoding of the ids.
            let mut direct = Vec::new();
            pb::DecodeRequest { token_ids: want, ..Default::default() }.encode(&mut direct).expect("encode");
            let mut ours = Vec::new();
            WithIds::decode(pb::DecodeRequest::default(), PackedIds::new(&ids(n))).write(&mut ours);
            assert_eq!(ours, direct);
        }
    }
}
