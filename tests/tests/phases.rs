//! Issue 18's per-phase latency, in a test binary of its own: the metrics recorder is
//! process-wide, and a request here would move the figures another test asserts exactly.

use ferry_proto::v1 as pb;
use ferry_tests::{TinyModel, scrape, settle};

/// A whole completion of `body` asking for its phases (`ferry-phases: 1`), once the workers
/// `settle`: its response headers, its body, and the seconds the router's phase histograms
/// gained meanwhile.
async fn asked<F: std::future::Future<Output = ()>>(
    r: &ferry_router::Running,
    body: &serde_json::Value,
    settle: impl FnOnce() -> F,
) -> (Vec<(String, String)>, serde_json::Value, f64) {
    let before = router_total(&scrape(r.metrics_addr).await);
    let (status, headers, text) = ferry_tests::http_with(
        r.http_addr,
        "POST",
        "/v1/completions",
        &[("ferry-phases", "1")],
        body.to_string().as_bytes(),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    settle().await;
    let gained = router_total(&scrape(r.metrics_addr).await) - before;
    (headers, serde_json::from_str(&text).expect("JSON"), gained)
}

/// The router's phase histograms' sums, together (seconds).
fn router_total(text: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with("ferry_request_phase_seconds_sum") && l.contains(r#"role="router""#))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

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

    // Asked for (`ferry-phases: 1`), a whole completion says where its time went, in a
    // header and in the body; the breakdown sums to what the router's histograms gained.
    let (headers, v, gained) = asked(&r, &body, || settle(&p, std::slice::from_ref(&d))).await;
    let phases = v["ferry_phases"].as_object().unwrap_or_else(|| panic!("no ferry_phases in {v}"));
    let names: Vec<&str> = phases.keys().map(String::as_str).collect();
    let want: Vec<&str> = ferry_cluster::phases::BREAKDOWN.to_vec();
    assert_eq!(names, want, "every phase of the breakdown, in its order");
    let sum: f64 = phases.values().map(|x| x.as_f64().expect("seconds")).sum();
    assert!((sum - gained).abs() < 1e-3, "the breakdown sums to {sum:.6} s, the router recorded {gained:.6} s");
    for p in ["prefill_queue", "prefill_compute", "decode_admission", "first_decode_step", "decode"] {
        assert!(phases[p].as_f64().is_some_and(|s| s > 0.0), "{p} measured: {v}");
    }
    let header = headers.iter().find(|(k, _)| k == "ferry-phases").map(|(_, v)| v.clone());
    let header = header.unwrap_or_else(|| panic!("no ferry-phases header: {headers:?}"));
    assert!(header.starts_with("tokenize=") && header.contains(", prefill_compute="), "{header}");

    // Not asked for: neither.
    let (_, headers, text) =
        ferry_tests::http(r.http_addr, "POST", "/v1/completions", body.to_string().as_bytes()).await;
    assert!(!text.contains("ferry_phases") && !headers.iter().any(|(k, _)| k == "ferry-phases"), "{text}");

    // Cut by a stop string the router finds, the answer drops the decode stream before its
    // last message: decode's laps up to the first token came with that token, and the
    // breakdown still sums to the router's time. (Greedy: the same text again, so a stop
    // string from its middle cuts it there.)
    let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let full: Vec<char> = v["choices"][0]["text"].as_str().expect("text").chars().collect();
    assert!(full.len() >= 8, "a long enough answer to cut: {v}");
    let stop: String = full[5..7].iter().collect();
    let mut cut = body.clone();
    cut["stop"] = serde_json::json!([stop]);
    let (_, v, gained) = asked(&r, &cut, || settle(&p, std::slice::from_ref(&d))).await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let phases = v["ferry_phases"].as_object().unwrap_or_else(|| panic!("no ferry_phases in {v}"));
    let sum: f64 = phases.values().map(|x| x.as_f64().expect("seconds")).sum();
    assert!((sum - gained).abs() < 1e-3, "cut by a stop string: {sum:.6} s of {gained:.6} s: {v}");
    assert!(phases["first_decode_step"].as_f64().is_some_and(|s| s > 0.0), "decode's laps arrived: {v}");

    // Over gRPC: on the last message, when return_phases is set, in the breakdown's order.
    let mut c = pb::router_client::RouterClient::new(ferry_tests::channel(r.grpc_addr).await);
    let req = pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: prompt.clone() })),
        sampling: Some(ferry_cluster::wire::sampling_to_proto(&ferry_tests::greedy(8))),
        return_phases: true,
        ..Default::default()
    };
    let mut s = c.generate(req).await.expect("generate").into_inner();
    let mut last = pb::GenerateResponse::default();
    while let Some(m) = s.message().await.expect("stream") {
        assert!(m.finish_reason == 0 || !m.phases.is_empty(), "phases come with the finish reason");
        assert!(m.finish_reason != 0 || m.phases.is_empty(), "and only then");
        last = m;
    }
    let got: Vec<&str> = last.phases.iter().map(|p| p.phase.as_str()).collect();
    assert_eq!(got, ferry_cluster::phases::BREAKDOWN, "{last:?}");
    // And as the `ferry-phases` trailer, the stream's status OK.
    let trailers = s.trailers().await.expect("an OK status").expect("trailing metadata");
    let value = trailers.get("ferry-phases").and_then(|v| v.to_str().ok()).unwrap_or_default();
    assert!(value.starts_with("tokenize=") && value.contains(", decode="), "{trailers:?}");
    r.stop().await;
    d.stop().await;
    p.stop().await;
}
