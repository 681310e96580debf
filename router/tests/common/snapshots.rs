//! Fake prefill workers that speak only `KvEvents`: each answers a subscription with one
//! snapshot batch of a given number of pages (chains of 64 pages of 16 random tokens), then
//! stays silent. Real gRPC on loopback, for the router's own event-following code.

use std::pin::Pin;

use ferry_proto::v1 as pb;
use ferry_radix::events::{ROOT_HASH, page_hashes};
use futures::Stream;
use tonic::{Request, Response, Status};

/// Tokens per page.
pub const PS: usize = 16;

struct Snapshots(pb::KvEventBatch);

#[tonic::async_trait]
impl pb::kv_events_server::KvEvents for Snapshots {
    type SubscribeStream = Pin<Box<dyn Stream<Item = Result<pb::KvEventBatch, Status>> + Send>>;

    async fn subscribe(&self, _: Request<pb::SubscribeRequest>) -> Result<Response<Self::SubscribeStream>, Status> {
        let batch = self.0.clone();
        let once = futures::stream::once(async move { Ok(batch) });
        Ok(Response::new(Box::pin(futures::StreamExt::chain(once, futures::stream::pending()))))
    }
}

/// One snapshot batch of `pages` pages (whole chains of 64), from token seed `seed`.
pub fn snapshot(pages: usize, seed: u64) -> pb::KvEventBatch {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut runs = Vec::new();
    for _ in 0..pages.div_ceil(64) {
        let tokens: Vec<u32> = (0..64 * PS)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 50_000) as u32
            })
            .collect();
        let hashes = page_hashes(ROOT_HASH, &tokens, PS);
        runs.push(pb::KvStored { parent_hash: ROOT_HASH, page_hashes: hashes, token_ids: tokens });
    }
    let kind = pb::kv_event::Kind::Snapshot(pb::KvSnapshot { pages: runs });
    pb::KvEventBatch { worker_id: String::new(), epoch: 1, events: vec![pb::KvEvent { sequence: 0, kind: Some(kind) }] }
}

/// Serves `batch` to every subscriber on a loopback port; returns `host:port`.
pub async fn serve(batch: pb::KvEventBatch) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let svc = pb::kv_events_server::KvEventsServer::new(Snapshots(batch)).max_encoding_message_size(usize::MAX);
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(tonic::transport::Server::builder().add_service(svc).serve_with_incoming(incoming));
    addr
}
