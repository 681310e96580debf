//! Zero-cost workers that speak Ferry's worker protocol on loopback (real gRPC), for measuring
//! the router alone: a prefill worker answers `Prefill` at once (nothing cached), a decode
//! worker answers `Generate` with the asked number of tokens in one message; both answer gRPC
//! health and `Load` (an empty worker with a million free pages), and a prefill worker's
//! `KvEvents` subscription stays open and silent.

use std::pin::Pin;

use ferry_proto::v1 as pb;
use futures::Stream;
use tonic::{Request, Response, Status};

/// Token ids a mock decode worker answers with (plain words in SmolLM2's vocabulary).
const FIRST_ID: u32 = 300;

/// The calls a router makes to these workers for a prompt of `ids`, in room `room`, asking
/// decode for `max_new_tokens`.
pub fn requests(ids: Vec<u32>, room: u64, max_new_tokens: u32) -> (pb::PrefillRequest, pb::DecodeRequest) {
    let sampling = Some(pb::SamplingParams { max_new_tokens, ..Default::default() });
    let room = Some(pb::RoomKey { room, secret: vec![7; 32] });
    let preq = pb::PrefillRequest {
        room: room.clone(),
        token_ids: ids.clone(),
        sampling: sampling.clone(),
        ..Default::default()
    };
    (preq, pb::DecodeRequest { room, token_ids: ids, sampling, ..Default::default() })
}

#[derive(Clone, Copy)]
struct Mock;

type Boxed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl pb::prefill_server::Prefill for Mock {
    async fn prefill(&self, req: Request<pb::PrefillRequest>) -> Result<Response<pb::PrefillResponse>, Status> {
        let room = req.into_inner().room.map_or(0, |r| r.room);
        Ok(Response::new(pb::PrefillResponse { room, ..Default::default() }))
    }

    async fn abort(&self, _: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        Ok(Response::new(pb::AbortResponse { found: false }))
    }
}

/// What a mock decode worker answers to `req`: `max_new_tokens` ids, finished by length.
pub fn answer(req: &pb::DecodeRequest) -> pb::DecodeResponse {
    let n = req.sampling.as_ref().map_or(16, |s| s.max_new_tokens).max(1);
    pb::DecodeResponse {
        token_ids: (FIRST_ID..FIRST_ID + n).collect(),
        finish_reason: pb::FinishReason::Length as i32,
        ..Default::default()
    }
}

#[tonic::async_trait]
impl pb::decode_server::Decode for Mock {
    type GenerateStream = Boxed<pb::DecodeResponse>;

    async fn generate(&self, req: Request<pb::DecodeRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        let out = answer(req.get_ref());
        Ok(Response::new(Box::pin(futures::stream::iter([Ok(out)]))))
    }

    async fn abort(&self, _: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        Ok(Response::new(pb::AbortResponse { found: false }))
    }
}

#[tonic::async_trait]
impl pb::load_server::Load for Mock {
    async fn report(&self, _: Request<pb::LoadRequest>) -> Result<Response<pb::LoadReport>, Status> {
        Ok(Response::new(pb::LoadReport { free_pages: 1 << 20, total_pages: 1 << 20, ..Default::default() }))
    }
}

#[tonic::async_trait]
impl pb::kv_events_server::KvEvents for Mock {
    type SubscribeStream = Boxed<pb::KvEventBatch>;

    async fn subscribe(&self, _: Request<pb::SubscribeRequest>) -> Result<Response<Self::SubscribeStream>, Status> {
        Ok(Response::new(Box::pin(futures::stream::pending())))
    }
}

/// Starts a mock worker of `role` ("prefill" or "decode") on a loopback port; returns its
/// `host:port`.
pub async fn serve(role: &str) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_service_status("", tonic_health::ServingStatus::Serving).await;
    let incoming = ferry_cluster::accept::incoming(listener);
    let router =
        tonic::transport::Server::builder().add_service(health).add_service(pb::load_server::LoadServer::new(Mock));
    let router = if role == "prefill" {
        router
            .add_service(pb::prefill_server::PrefillServer::new(Mock).max_decoding_message_size(64 << 20))
            .add_service(pb::kv_events_server::KvEventsServer::new(Mock))
    } else {
        router.add_service(pb::decode_server::DecodeServer::new(Mock).max_decoding_message_size(64 << 20))
    };
    tokio::spawn(async move {
        let _keep = reporter;
        router.serve_with_incoming(incoming).await
    });
    addr
}
