//! The workers' other services: KV events stream the prefix caches' changes, Load reports
//! queues and pages, and gRPC health says SERVING.

use std::time::Duration;

use ferry_proto::v1 as pb;
use ferry_tests::{Client, TinyModel, channel, greedy, settle};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

/// The tokens of a batch's stored runs, in order.
fn stored_tokens(batch: &pb::KvEventBatch) -> Vec<u32> {
    let runs = batch.events.iter().filter_map(|e| match &e.kind {
        Some(pb::kv_event::Kind::Stored(s)) => Some(s.token_ids.clone()),
        _ => None,
    });
    runs.flatten().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_load_reports_and_health() {
    let m = TinyModel::new();
    let mut pa = ferry_prefill::PrefillArgs::for_model(m.path());
    pa.worker.pool_pages = 256;
    let mut da = ferry_decode::DecodeArgs::for_model(m.path());
    da.worker.pool_pages = 256;
    let p = ferry_prefill::start(pa).await.expect("prefill up");
    let d = ferry_decode::start(da).await.expect("decode up");

    for (addr, service) in
        [(p.grpc_addr, "ferry.v1.Prefill"), (p.grpc_addr, "ferry.v1.Bootstrap"), (d.grpc_addr, "ferry.v1.Decode")]
    {
        let mut h = HealthClient::new(channel(addr).await);
        let r = h.check(HealthCheckRequest { service: service.into() }).await.expect("health").into_inner();
        assert_eq!(r.status(), ServingStatus::Serving, "{service}");
    }

    let mut events = pb::kv_events_client::KvEventsClient::new(channel(p.grpc_addr).await);
    let sub = pb::SubscribeRequest { epoch: 0, after_sequence: 0, want_snapshot: true };
    let mut stream = events.subscribe(sub).await.expect("subscribe").into_inner();
    let first = stream.message().await.expect("stream").expect("a snapshot first");
    assert!(matches!(first.events[0].kind, Some(pb::kv_event::Kind::Snapshot(ref s)) if s.pages.is_empty()));
    // The decode worker's cache too (what its finished requests computed).
    let mut decode_events = pb::kv_events_client::KvEventsClient::new(channel(d.grpc_addr).await);
    let mut decode_stream = decode_events.subscribe(sub).await.expect("subscribe").into_inner();
    let decode_first = decode_stream.message().await.expect("stream").expect("a snapshot first");
    assert!(matches!(decode_first.events[0].kind, Some(pb::kv_event::Kind::Snapshot(ref s)) if s.pages.is_empty()));

    let prompt: Vec<u32> = (0..70).map(|i| (i * 5 % 300) as u32).collect();
    let c = Client::new(d.grpc_addr, Some(p.grpc_addr)).await;
    c.generate(&prompt, &greedy(2)).await.expect("request");
    let batch = tokio::time::timeout(Duration::from_secs(5), stream.message())
        .await
        .expect("an event")
        .expect("ok")
        .expect("open");
    let stored = stored_tokens(&batch);
    assert_eq!(stored, prompt[..64], "the prompt's 4 whole pages were cached");
    assert_eq!(batch.epoch, first.epoch);
    assert!(batch.events[0].sequence > first.events[0].sequence);
    let batch = tokio::time::timeout(Duration::from_secs(5), decode_stream.message())
        .await
        .expect("an event from the decode worker")
        .expect("ok")
        .expect("open");
    let stored = stored_tokens(&batch);
    // 70 prompt tokens and 2 generated, the last of which has no KV yet: 4 whole pages.
    assert_eq!(stored, prompt[..64], "the decode worker cached the request's whole pages");
    assert_eq!(batch.epoch, decode_first.epoch);

    settle(&p, std::slice::from_ref(&d)).await;
    let mut load = pb::load_client::LoadClient::new(channel(p.grpc_addr).await);
    let r = load.report(pb::LoadRequest {}).await.expect("load").into_inner();
    assert_eq!((r.total_pages, r.evictable_pages, r.free_pages), (256, 4, 252));
    assert!(r.prefill_tokens_per_second > 0.0);
    assert_eq!(r.queue_depth.get("waiting"), Some(&0));
    let mut load = pb::load_client::LoadClient::new(channel(d.grpc_addr).await);
    let r = load.report(pb::LoadRequest {}).await.expect("load").into_inner();
    // The decode worker's prefix cache keeps the request's KV, prompt and answer (71 tokens:
    // 4 whole pages), evictable.
    assert_eq!((r.total_pages, r.evictable_pages, r.free_pages), (256, 4, 252));
    assert_eq!(r.queue_depth.get("running"), Some(&0));
    p.stop().await;
    d.stop().await;
}
