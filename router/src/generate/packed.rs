//! An attempt's two calls carry the same prompt ids (`PrefillRequest.token_ids`,
//! `DecodeRequest.token_ids`). They are encoded once, as the packed varints protobuf writes for
//! a `repeated uint32`, and each call's message is written without them and then the field
//! appended: protobuf readers accept a message's fields in any order. prost encoded the ids
//! for each call one varint at a time (~5 ns an id: ~45 µs of a 4,600-token request's router
//! CPU for the two calls).

use std::marker::PhantomData;
use std::sync::Arc;

use ferry_cluster::h2_calls::Calls;
use ferry_proto::v1 as pb;
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint};
use tonic::codec::{BufferSettings, Codec, EncodeBuf, Encoder};
use tonic::{Response, Status, Streaming};
use tonic_prost::ProstDecoder;

/// `PrefillRequest.token_ids`' field number (`proto/proto/ferry/v1/worker.proto`).
const PREFILL_IDS: u32 = 3;
/// `DecodeRequest.token_ids`' field number.
const DECODE_IDS: u32 = 4;

/// A prompt's ids as packed varints, shared by the calls of an attempt.
#[derive(Debug, Clone)]
pub(super) struct PackedIds(Arc<[u8]>);

impl PackedIds {
    pub(super) fn new(ids: &[u32]) -> Self {
        let mut out = Vec::with_capacity(ids.len() * 3);
        for &id in ids {
            let mut v = id;
            while v >= 0x80 {
                out.push(v as u8 | 0x80);
                v >>= 7;
            }
            out.push(v as u8);
        }
        Self(out.into())
    }
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
