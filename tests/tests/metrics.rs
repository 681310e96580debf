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
    pa.worker.worker_id = Some("p0".into());
    let mut da = ferry_decode::DecodeArgs::for_model(m.path());
    da.worker.pool_pages = 512;
    da.worker.worker_id = Some("d0".into());
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

/// Issue 18's per-phase latency: one request through the router leaves a sample in every
/// phase on each daemon (`ferry_request_phase_seconds{role, phase}`, histograms with buckets),
/// and the router's phases add up to nearly all of the request's time as the client saw it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_phase_of_a_request_is_measured_on_each_daemon() {
    let m = TinyModel::new();
    let (p, d, r) = ferry_tests::one_of_each(&m, 512, |_| {}).await;
    let prompt: Vec<u32> = (1..300).collect();
    let body = serde_json::json!({"model": "hf", "prompt": prompt, "max_tokens": 40, "temperature": 0});
    let t = std::time::Instant::now();
    let (status, _, text) =
        ferry_tests::http(r.http_addr, "POST", "/v1/completions", body.to_string().as_bytes()).await;
    let e2e = t.elapsed().as_secs_f64();
    assert_eq!(status, 200, "{text}");
    settle(&p, std::slice::from_ref(&d)).await;
    let all = scrape(r.metrics_addr).await;
    let phase = |role: &str, phase: &str, what: &str| {
        sample(
            &all,
            &format!("ferry_request_phase_seconds_{what}"),
            &[&format!("role=\"{role}\""), &format!("phase=\"{phase}\"")],
        )
    };
    let want = [
        ("router", &["tokenize", "queue", "placement", "first_token", "decode"][..]),
        ("prefill", &["prefill_queue", "prefill_compute", "transfer"][..]),
        ("decode", &["admission", "transfer", "first_token", "decode"][..]),
    ];
    // (The other test of this binary shares the process's recorder and may add worker samples.)
    for (role, phases) in want {
        for ph in phases {
            let n = phase(role, ph, "count");
            assert!(n >= 1.0 && (role != "router" || n == 1.0), "{role} {ph}: {n} samples\n{all}");
        }
    }
    assert!(all.contains(r#"ferry_request_phase_seconds_bucket{role="router",phase="decode",le="0.005"}"#), "{all}");
    let router: f64 = want[0].1.iter().map(|ph| phase("router", ph, "sum")).sum();
    assert!(router <= e2e && router >= 0.5 * e2e, "the router's phases add up to {router:.4} s of {e2e:.4} s");
    println!("router phases {router:.4} s of {e2e:.4} s end to end ({:.1} %)", 100.0 * router / e2e);
    r.stop().await;
    d.stop().await;
    p.stop().await;
}
