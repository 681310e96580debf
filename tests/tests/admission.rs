//! The router's admission queue against real workers: with one running slot and one queue
//! place, a second request waits and is refused when its wait times out, a third is refused
//! at once while the queue is full (HTTP 429 with a message and `Retry-After`), and a freed
//! slot admits the next request. Refused requests were never tokenized (admission comes before
//! parsing). Refusals are counted and leave the workers clean.

use std::time::{Duration, Instant};

use ferry_engine::tiny::TinySpec;
use ferry_proto::v1 as pb;
use ferry_tests::{TinyModel, channel, greedy, http, one_of_each, scrape, settle};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admission_queue_bounds_concurrency_and_waiting() {
    // A long context, so the slot-holding request below runs for seconds.
    let m = TinyModel::with(TinySpec { ctx: 16_384, tie: false, ..TinySpec::default() });
    let (p, d, r) = one_of_each(&m, 1100, |ra| {
        ra.max_running_requests = 1;
        ra.max_queued_requests = 1;
        ra.queue_timeout = 0.4;
    })
    .await;

    // A long request takes the only slot: 16,000 tokens, several seconds of decoding (its
    // small messages fit the HTTP/2 windows, so it is the generation that holds the slot: 1,500
    // tokens took ~0.33 s, about the test's own length, and the test failed when they ended
    // first).
    let mut client = pb::router_client::RouterClient::new(channel(r.grpc_addr).await);
    let long = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: vec![5, 6, 7, 8] })),
        sampling: Some(ferry_cluster::wire::sampling_to_proto(&greedy(16_000))),
        ..Default::default()
    };
    let mut held = client.generate(long).await.expect("admitted").into_inner();
    held.message().await.expect("a message").expect("not ended");

    let a = r.http_addr;
    let (_, _, models) = http(a, "GET", "/v1/models", b"").await;
    let models: serde_json::Value = serde_json::from_str(&models).expect("JSON");
    let model = models["data"][0]["id"].as_str().expect("a model").to_string();
    let body = serde_json::json!({"model": model, "prompt": "Once upon a time", "max_tokens": 2, "temperature": 0})
        .to_string();
    // Requests that never get a slot are never tokenized: admission comes first.
    let tokenized = || async {
        let m = scrape(r.metrics_addr).await;
        ferry_tests::metric_sum(&m, "ferry_request_phase_seconds_count", "phase=\"tokenize\"")
    };
    let before = tokenized().await;
    // The second waits its 400 ms in the queue, then is refused.
    let waiting = tokio::spawn(async move {
        let t = Instant::now();
        let out = http(a, "POST", "/v1/completions", body.as_bytes()).await;
        (out, t.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The third finds the queue full and is refused at once.
    let body = serde_json::json!({"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}).to_string();
    let t = Instant::now();
    let (s, h, text) = http(a, "POST", "/v1/completions", body.as_bytes()).await;
    assert_eq!(s, 429, "{text}");
    assert!(t.elapsed() < Duration::from_millis(300), "refused without waiting: {:?}", t.elapsed());
    assert!(text.contains("at capacity"), "{text}");
    assert!(h.iter().any(|(k, _)| k == "retry-after"), "{h:?}");
    let ((s, _, text), waited) = waiting.await.expect("join");
    assert_eq!(s, 429, "{text}");
    assert!(text.contains("admission queue"), "{text}");
    assert!(waited >= Duration::from_millis(400), "waited {waited:?}");
    assert_eq!(tokenized().await, before, "refused requests were tokenized");

    // Freeing the slot admits the next request.
    drop(held);
    let (s, _, text) = http(a, "POST", "/v1/completions", body.as_bytes()).await;
    assert_eq!(s, 200, "{text}");

    let m = scrape(r.metrics_addr).await;
    for outcome in ["timeout", "queue_full", "immediate"] {
        assert!(
            m.lines().any(|l| l.starts_with("ferry_router_admission_total") && l.contains(&format!("outcome=\"{outcome}\""))),
            "{outcome} counted:\n{m}"
        );
    }
    settle(&p, std::slice::from_ref(&d)).await;
}
