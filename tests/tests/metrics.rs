//! /metrics scraped over HTTP while requests run: queue depths, pages and transfer figures
//! move, and settle back.

use std::time::Duration;

use ferry_tests::{Client, TinyModel, greedy, scrape, settle};

/// The value of the sample of `name` whose labels contain all of `labels` (0 when absent).
fn sample(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && labels.iter().all(|x| l.contains(x)))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_queues_and_transfers_moving() {
    let m = TinyModel::new();
    let mut pa = ferry_prefill::PrefillArgs::for_model(m.path());
    pa.worker.pool_pages = 512;
    pa.worker.worker_id = Some("p0".parse().expect("a worker id"));
    let mut da = ferry_decode::DecodeArgs::for_model(m.path());
    da.worker.pool_pages = 512;
    da.worker.worker_id = Some("d0".parse().expect("a worker id"));
    let p = ferry_prefill::start(pa).await.expect("prefill up");
    let d = ferry_decode::start(da).await.expect("decode up");
    let before = scrape(d.metrics_addr).await;
    let bytes = |t: &str| sample(t, "ferry_transfer_bytes_total", &[r#"backend="tcp""#]);
    let running = |t: &str| sample(t, "ferry_queue_depth", &[r#"worker="d0""#, r#"state="running""#]);
    let used = |t: &str| sample(t, "ferry_pages", &[r#"worker="d0""#, r#"kind="used""#]);
    assert_eq!(running(&before), 0.0);
    let c = Client::new(d.grpc_addr, Some(p.grpc_addr)).await;
    let prompt: Vec<u32> = (0..400).map(|i| (i * 13 % 350) as u32).collect();
    let job = tokio::spawn({
        let c = c.clone();
        async move { c.generate(&prompt, &greedy(3000)).await }
    });
    let mut during = String::new();
    for _ in 0..400 {
        during = scrape(d.metrics_addr).await;
        if running(&during) == 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(running(&during), 1.0, "the request shows as running:\n{during}");
    assert!(used(&during) >= 25.0, "its 25 prompt pages are in use");
    assert_eq!(bytes(&during) - bytes(&before), 25.0 * page_bytes(&p), "the 400-token prompt is 25 pages of KV");
    assert!(sample(&during, "ferry_transfer_rooms_total", &[r#"side="receiver""#, r#"outcome="success""#]) >= 1.0);
    job.abort();
    settle(&p, std::slice::from_ref(&d)).await;
    let mut after = String::new();
    for _ in 0..200 {
        after = scrape(d.metrics_addr).await;
        if running(&after) == 0.0 && used(&after) == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!((running(&after), used(&after)), (0.0, 0.0), "{after}");
    assert!(sample(&after, "ferry_requests_total", &[r#"role="decode""#, r#"outcome="abort""#]) >= 1.0);
    let prefill_text = scrape(p.metrics_addr).await;
    assert!(sample(&prefill_text, "ferry_prefill_tokens_total", &[r#"role="prefill""#]) >= 400.0);
    p.stop().await;
    d.stop().await;
}

fn page_bytes(p: &ferry_prefill::Running) -> f64 {
    let l = &p.layout;
    f64::from(l.num_layers * 2 * l.page_size * l.num_kv_heads * l.head_dim * 4)
}
