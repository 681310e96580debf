//! Issue 18's per-phase latency, in a test binary of its own: the metrics recorder is
//! process-wide, and a request here would move the figures another test asserts exactly.

use ferry_tests::{TinyModel, scrape, settle};

/// The value of the sample of `name` whose labels contain all of `labels` (0 when absent).
fn sample(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && labels.iter().all(|x| l.contains(x)))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
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
    for (role, phases) in want {
        for ph in phases {
            assert_eq!(phase(role, ph, "count"), 1.0, "{role} {ph}: one sample\n{all}");
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
