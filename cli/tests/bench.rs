//! `ferry bench` against `ferry up --processes` (SmolLM2, loopback) for a few seconds, over
//! HTTP (closed loop, shared-prefix) and over gRPC (a Mooncake-format trace): it writes its
//! JSON and PNG, and the report is consistent — counts add up, percentiles are ordered, no
//! time is negative, the timeline holds every token, the chart decodes, and the phases each
//! request reported sum to its end-to-end latency within 5 %.

mod common;

use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn bench(args: &[&str], dir: &Path, name: &str) -> Value {
    let json = dir.join(format!("{name}.json"));
    let png = dir.join(format!("{name}.png"));
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .arg("bench")
        .args(args)
        .arg("--json")
        .arg(&json)
        .arg("--png")
        .arg(&png)
        .arg("--quiet")
        .output()
        .expect("run `ferry bench`");
    let table = String::from_utf8_lossy(&out.stdout);
    println!("{table}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "`ferry bench` failed");
    assert!(table.contains("TTFT") && table.contains("throughput"), "the table is printed");
    let bytes = std::fs::read(&png).expect("the PNG is written");
    let info = png::Decoder::new(std::io::Cursor::new(bytes)).read_info().expect("a PNG");
    assert!(info.info().width >= 800 && info.info().height >= 400);
    serde_json::from_str(&std::fs::read_to_string(&json).expect("the JSON is written")).expect("JSON")
}

fn f(v: &Value, path: &[&str]) -> f64 {
    path.iter().fold(v, |v, k| &v[*k]).as_f64().unwrap_or_else(|| panic!("{path:?} missing in {v}"))
}

/// The invariants every report keeps.
fn check(r: &Value, tokens_per_request: Option<u64>) {
    let (sent, done, failed) = (f(r, &["sent"]), f(r, &["completed"]), f(r, &["failed"]));
    assert_eq!(sent, done + failed, "counts add up");
    assert!(done > 0.0, "some requests completed");
    assert_eq!(failed, 0.0, "none failed: {}", r["errors"]);
    let dur = f(r, &["duration_s"]);
    assert!(dur > 0.0);
    for d in ["ttft_ms", "itl_ms", "e2e_ms"] {
        let q = |k: &str| f(r, &[d, k]);
        assert!(q("min") >= 0.0, "{d}: no negative time");
        assert!(
            q("min") <= q("p50") && q("p50") <= q("p90") && q("p90") <= q("p99") && q("p99") <= q("max"),
            "{d} ordered: {}",
            r[d]
        );
        assert!(q("mean") >= q("min") && q("mean") <= q("max"));
    }
    assert!(f(r, &["ttft_ms", "p50"]) <= f(r, &["e2e_ms", "p50"]), "first token before the end");
    assert_eq!(f(r, &["ttft_ms", "count"]), done);
    assert!((f(r, &["requests_per_s"]) - done / dur).abs() < 1e-6);
    let timeline = r["timeline"].as_array().expect("timeline");
    let tl_done: u64 = timeline.iter().map(|b| b["completed"].as_u64().unwrap_or(0)).sum();
    let tl_tokens: u64 = timeline.iter().map(|b| b["output_tokens"].as_u64().unwrap_or(0)).sum();
    assert_eq!(tl_done as f64, done, "the timeline holds every completion");
    assert_eq!(tl_tokens as f64, f(r, &["itl_ms", "count"]) + done, "one arrival per token: gaps + firsts");
    if let Some(n) = tokens_per_request {
        assert_eq!(tl_tokens, n * done as u64, "every request generated its {n} tokens");
    }
    let (cached, prompt) = (f(r, &["prefix_cache", "cached_tokens"]), f(r, &["prefix_cache", "prompt_tokens"]));
    assert!(cached <= prompt && prompt > 0.0);
    assert!(f(r, &["goodput", "requests"]) <= done);
    // Where the time went: every request reported its phases, and they account for its
    // end-to-end latency as the client saw it (less the connection and framing).
    assert_eq!(f(r, &["phases", "requests"]), done, "every completed request reported its phases");
    let ratio = f(r, &["phases", "sum_over_e2e"]);
    assert!((0.95..=1.0001).contains(&ratio), "the phases sum to {ratio} of end-to-end: {}", r["phases"]);
    let phases = r["phases"]["phases"].as_array().expect("phases");
    let mean = |name: &str| {
        let p = phases.iter().find(|p| p["phase"] == name).unwrap_or_else(|| panic!("{name} missing"));
        f(p, &["ms", "mean"])
    };
    let share: f64 = phases.iter().map(|p| f(p, &["share"])).sum();
    assert!((share - 1.0).abs() < 1e-6, "shares sum to 1: {share}");
    assert!(mean("prefill_compute") + mean("local_prefill") > 0.0, "the prompt was computed somewhere");
    assert!(mean("decode") > 0.0 && mean("placement") > 0.0, "{}", r["phases"]);
}

#[test]
fn bench_reports_are_consistent() {
    let up = common::Up::start(&[]);
    assert_eq!(up.pids.len(), 3);
    let dir = tempfile::tempdir().expect("temp dir");

    // HTTP, closed loop, shared prefixes, with an SLO.
    let url = format!("http://{}", up.http);
    let r = bench(
        &[
            "--url",
            &url,
            "--duration",
            "6",
            "--concurrency",
            "2",
            "--output-len",
            "6",
            "--prefix-words",
            "60",
            // One system prompt, so that the third request (the first not to run
            // alongside the opening two) already shares it, however slow the machine.
            "--system-prompts",
            "1",
            "--slo-ttft-ms",
            "60000",
        ],
        dir.path(),
        "http",
    );
    check(&r, Some(6));
    assert_eq!(r["workload"], "shared-prefix");
    assert!(f(&r, &["prefix_cache", "cached_tokens"]) > 0.0, "shared system prompts hit the prefix cache");
    assert_eq!(f(&r, &["goodput", "requests"]), f(&r, &["completed"]), "a 60 s TTFT SLO is met by all");

    // gRPC, a Mooncake-format trace replayed at its timestamps (blocks of 32 tokens).
    let trace = dir.path().join("trace.jsonl");
    let lines: Vec<String> = (0..6)
        .map(|i| {
            format!(
                r#"{{"timestamp": {}, "input_length": {}, "output_length": 4, "hash_ids": [1, 2, {}]}}"#,
                i * 300,
                70 + i,
                10 + i
            )
        })
        .collect();
    std::fs::write(&trace, lines.join("\n")).expect("write the trace");
    let url = format!("grpc://{}", up.grpc);
    let r = bench(
        &[
            "--url",
            &url,
            "--workload",
            "trace",
            "--trace",
            trace.to_str().expect("utf-8"),
            "--trace-block-size",
            "32",
            "--duration",
            "10",
        ],
        dir.path(),
        "grpc",
    );
    check(&r, Some(4));
    assert_eq!(f(&r, &["sent"]), 6.0, "every trace line was sent");
    assert!(f(&r, &["prefix_cache", "cached_tokens"]) > 0.0, "trace blocks 1 and 2 are shared");

    // Multi-turn conversations: each turn carries the conversation so far, the model's answers
    // (6 tokens each) included, and finds its earlier turns cached.
    let url = format!("http://{}", up.http);
    let r = bench(
        &[
            "--url",
            &url,
            "--workload",
            "multi-turn",
            "--turns",
            "3",
            "--requests",
            "6",
            "--concurrency",
            "2",
            "--think-time",
            "0.1",
            "--output-len",
            "6",
            "--prefix-words",
            "40",
            "--duration",
            "60",
        ],
        dir.path(),
        "multi-turn",
    );
    check(&r, Some(6));
    assert_eq!(r["workload"], "multi-turn");
    assert_eq!((f(&r, &["turns", "first", "requests"]), f(&r, &["turns", "later", "requests"])), (2.0, 4.0));
    let mut turns: Vec<(u64, u64, f64, f64)> = r["turns"]["samples"]
        .as_array()
        .expect("samples")
        .iter()
        .map(|s| {
            (
                s["conversation"].as_u64().unwrap_or(99),
                s["turn"].as_u64().unwrap_or(99),
                f(s, &["prompt_tokens"]),
                f(s, &["cached_tokens"]),
            )
        })
        .collect();
    turns.sort_by_key(|t| (t.0, t.1));
    for w in turns.windows(2).filter(|w| w[0].0 == w[1].0) {
        assert_eq!(w[1].1, w[0].1 + 1, "turns in order: {turns:?}");
        // The earlier prompt, its 6-token answer and a new question of 12 words at least.
        assert!(w[1].2 >= w[0].2 + 6.0 + 12.0, "a turn carries the conversation so far: {turns:?}");
        assert!(w[1].3 >= 16.0, "and finds its earlier turns cached: {turns:?}");
    }
    assert!(up.interrupt());
}

/// `ferry bench` fails (after printing its report) when more requests fail than
/// `--max-failed` allows, 0 by default, so a CI smoke run with failures is red.
#[test]
fn failed_requests_beyond_max_failed_make_the_bench_fail() {
    // A server refusing everything with 503.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for mut s in listener.incoming().map_while(Result::ok) {
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf);
            let _ = s.write_all(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    });
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(["bench", "--url", &format!("http://{addr}"), "--model", "m", "--duration", "1"])
            .args(["--requests", "3", "--concurrency", "1", "--quiet"])
            .args(extra)
            .output()
            .expect("run `ferry bench`")
    };
    let out = run(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "3 failed requests with --max-failed 0 must fail the bench");
    assert!(err.contains("3 requests failed (--max-failed 0)"), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("failed"), "the report is printed first");
    let out = run(&["--max-failed", "3"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
