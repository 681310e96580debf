//! A decode worker that holds a prompt's history — its KV events say its cache has the
//! prompt's whole pages — and fails every `Generate` with UNAVAILABLE before the first token:
//! how a router's retry of a request it placed for a decode cache is tested. It serves gRPC
//! health, `Load` (an empty pool of 4,096 pages), `KvEvents` (one snapshot, then nothing) and
//! `Decode`.

use std::net::SocketAddr;
use std::pin::Pin;

use ferry_proto::v1 as pb;
use futures::Stream;
use tonic::{Request, Response, Status};

/// The mock: the whole pages of `tokens` are what its cache holds.
#[derive(Clone)]
struct Holder {
    tokens: Vec<u32>,
    page_size: usize,
}

type Boxed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl pb::decode_server::Decode for Holder {
    type GenerateStream = Boxed<pb::DecodeResponse>;

    async fn generate(&self, _: Request<pb::DecodeRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        Err(Status::unavailable("failing holder: no first token"))
    }

    async fn abort(&self, _: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
        Ok(Response::new(pb::AbortResponse::default()))
    }
}

#[tonic::async_trait]
impl pb::load_server::Load for Holder {
    async fn report(&self, _: Request<pb::LoadRequest>) -> Result<Response<pb::LoadReport>, Status> {
        let report = pb::LoadReport {
            worker_id: "failing-holder".into(),
            free_pages: 4096,
            total_pages: 4096,
            ..Default::default()
        };
        Ok(Response::new(report))
    }
}

#[tonic::async_trait]
impl pb::kv_events_server::KvEvents for Holder {
    type SubscribeStream = Boxed<pb::KvEventBatch>;

    async fn subscribe(&self, _: Request<pb::SubscribeRequest>) -> Result<Response<Self::SubscribeStream>, Status> {
        let whole = self.tokens.len() / self.page_size * self.page_size;
        let tokens = self.tokens[..whole].to_vec();
        let root = ferry_radix::events::ROOT_HASH;
        let run = pb::KvStored {
            parent_hash: root,
            page_hashes: ferry_radix::events::page_hashes(root, &tokens, self.page_size),
            token_ids: tokens,
        };
        let snapshot =
            pb::KvEvent { sequence: 1, kind: Some(pb::kv_event::Kind::Snapshot(pb::KvSnapshot { pages: vec![run] })) };
        let batch = pb::KvEventBatch { worker_id: "failing-holder".into(), epoch: 1, events: vec![snapshot] };
        let stream = futures::stream::iter([Ok(batch)]).chain(futures::stream::pending());
        Ok(Response::new(Box::pin(stream)))
    }
}

use futures::StreamExt as _;

/// Serves the mock on a fresh loopback port, holding `tokens` in pages of `page_size`; returns
/// its address (the server lives as long as the runtime).
pub async fn serve(tokens: Vec<u32>, page_size: usize) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let h = Holder { tokens, page_size };
    let (_, health) = tonic_health::server::health_reporter();
    let server = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(pb::decode_server::DecodeServer::new(h.clone()))
        .add_service(pb::load_server::LoadServer::new(h.clone()))
        .add_service(pb::kv_events_server::KvEventsServer::new(h))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l));
    tokio::spawn(server);
    addr
}
