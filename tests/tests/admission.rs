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
    // The router says it queued the second (not a clock: the third must find it queued).
    let outcome =
        |m: &str, o: &str| ferry_tests::metric_sum(m, "ferry_router_admission_total", &format!("outcome=\"{o}\""));
    let mut queued = 0.0;
    for _ in 0..1000 {
        queued = ferry_tests::metric_sum(&scrape(r.metrics_addr).await, "ferry_router_queued_requests", "");
        if queued == 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(queued, 1.0, "the second request never queued");
    // The third finds the queue full and is refused without waiting for a place.
    let body = serde_json::json!({"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}).to_string();
    let (s, h, text) = http(a, "POST", "/v1/completions", body.as_bytes()).await;
    assert_eq!(s, 429, "{text}");
    assert!(text.contains("at capacity"), "{text}");
    assert!(h.iter().any(|(k, _)| k == "retry-after"), "{h:?}");
    let m = scrape(r.metrics_addr).await;
    assert_eq!((outcome(&m, "queue_full"), outcome(&m, "timeout")), (1.0, 0.0), "refused as the queue was full:\n{m}");
    let ((s, _, text), waited) = waiting.await.expect("join");
    assert_eq!(s, 429, "{text}");
    assert!(text.contains("admission queue"), "{text}");
    assert!(waited >= Duration::from_millis(400), "waited {waited:?}");
    assert_eq!(outcome(&scrape(r.metrics_addr).await, "timeout"), 1.0, "the second timed out in the queue");
    assert_eq!(tokenized().await, before, "refused requests were tokenized");

    // Freeing the slot admits the next request: once the router has seen the held stream go
    // (its slot is given back as its task ends, after the client's cancel reaches it).
    let running =
        || async { ferry_tests::metric_sum(&scrape(r.metrics_addr).await, "ferry_router_running_requests", "") };
    assert_eq!(running().await, 1.0, "the held request runs");
    drop(held);
    let mut left = 1.0;
    for _ in 0..1000 {
        left = running().await;
        if left == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(left, 0.0, "the held request's slot was never given back");
    let (s, _, text) = http(a, "POST", "/v1/completions", body.as_bytes()).await;
    assert_eq!(s, 200, "{text}");

    let m = scrape(r.metrics_addr).await;
    // The held request and the last were admitted at once; the refusals counted once each.
    let counted = ["immediate", "queue_full", "timeout"].map(|o| outcome(&m, o));
    assert_eq!(counted, [2.0, 1.0, 1.0], "admissions immediate / queue_full / timeout:\n{m}");
    settle(&p, std::slice::from_ref(&d)).await;
}
