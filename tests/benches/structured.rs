//! Structured outputs on the decode path users run, SmolLM2 on one colocated decode worker
//! over gRPC, 8 clients in a closed loop (a batch of 8), greedy, side by side in one run:
//!
//! 1. free text (`ignore_eos`, so answers run to `max_tokens`) against the same requests
//!    constrained by a JSON schema of long free-text fields, jump-forward off: the
//!    inter-token latency ratio is what masking costs (issue 19's goal: ≤ 1.10×);
//! 2. a schema with long fixed keys, jump-forward off and on: output tokens per second (the
//!    goal: ≥ 1.5× with it);
//! 3. the grammar's cost for a request whose schema was seen before: `Grammars::matcher` on a
//!    hit (a copy of the compiled parser) against the first compile, in process (the goal:
//!    ≤ 1 ms).
//!
//! `cargo bench -p ferry-tests --bench structured`; `FERRY_BENCH_QUICK=1` for a smoke run
//! (8 s per mode); `FERRY_BENCH_SECS` sets the window per mode (default 40 s).

use std::time::{Duration, Instant};

use ferry_decode::DecodeArgs;
use ferry_engine::Constraint;
use ferry_engine::{Model, SamplingParams};
use ferry_kernels::cpu::CpuBackend;
use ferry_proto::v1 as pb;
use ferry_tests::closed_loop::{Outcome, client, one, percentile};
use ferry_tests::{channel, metric_sum, scrape, smollm2};

/// Long free-text values: the mask is computed at every token, little is forced, and (the
/// story being at least 1,000 characters) every answer runs to `max_tokens` as the free-text
/// ones do, so both modes interleave the same number of prompts with their decode steps.
const PROSE: &str = r#"{"type": "object", "properties": {"story": {"type": "string", "minLength": 1000, "maxLength": 2000},
  "moral": {"type": "string", "maxLength": 2000}}, "required": ["story", "moral"], "additionalProperties": false}"#;

/// Long fixed keys around short values: much of the output is forced.
const RECORD: &str = r#"{"type": "object", "properties": {
  "full_legal_name_of_the_person_described": {"type": "string", "maxLength": 12},
  "age_in_completed_years_at_last_birthday": {"type": "integer", "minimum": 0, "maximum": 120},
  "primary_country_of_residence_and_citizenship": {"enum": ["France", "Japan", "Brazil", "Kenya"]},
  "is_currently_employed_in_a_full_time_position": {"type": "boolean"},
  "favourite_colour_among_the_primary_colours": {"enum": ["red", "yellow", "blue"]},
  "number_of_siblings_including_half_siblings": {"type": "integer", "minimum": 0, "maximum": 20}},
  "required": ["full_legal_name_of_the_person_described", "age_in_completed_years_at_last_birthday",
    "primary_country_of_residence_and_citizenship", "is_currently_employed_in_a_full_time_position",
    "favourite_colour_among_the_primary_colours", "number_of_siblings_including_half_siblings"],
  "additionalProperties": false}"#;

struct Figures {
    tok_s: f64,
    itl_p50: f64,
    itl_mean: f64,
    forced: f64,
    requests: usize,
}

async fn run(prompt: &[u32], params: &SamplingParams, jump_forward: bool, window: Duration) -> Figures {
    let mut a = DecodeArgs::for_model(smollm2());
    a.worker.pool_pages = 1024;
    a.disable_jump_forward = !jump_forward;
    let d = ferry_decode::start(a).await.expect("decode up");
    // One request first: the worker compiles the schema and warms up outside the window.
    let warm = SamplingParams { max_new_tokens: 4, ..params.clone() };
    let mut c = pb::decode_client::DecodeClient::new(channel(d.grpc_addr).await);
    one(&mut c, prompt.to_vec(), &warm, Instant::now() + Duration::from_secs(60)).await;
    let before = metric_sum(&scrape(d.metrics_addr).await, "ferry_decode_jump_forward_tokens_total", "");
    let deadline = Instant::now() + window;
    let calls = (0..8).map(|_| tokio::spawn(client(d.grpc_addr, vec![prompt.to_vec()], 0, params.clone(), deadline)));
    let outs: Vec<Outcome> =
        futures::future::join_all(calls).await.into_iter().flat_map(|r| r.expect("task")).collect();
    let after = metric_sum(&scrape(d.metrics_addr).await, "ferry_decode_jump_forward_tokens_total", "");
    let mut itl: Vec<f64> = outs
        .iter()
        .flat_map(|o| o.arrivals.windows(2).map(|x| x[1].duration_since(x[0]).as_secs_f64() * 1e3))
        .collect();
    let itl_mean = itl.iter().sum::<f64>() / itl.len().max(1) as f64;
    let f = Figures {
        tok_s: outs.iter().map(|o| o.tokens).sum::<usize>() as f64 / window.as_secs_f64(),
        itl_p50: percentile(&mut itl, 0.5),
        itl_mean,
        forced: after - before,
        requests: outs.len(),
    };
    d.stop().await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    f
}

fn row(name: &str, f: &Figures) {
    println!(
        "{name:<40} {:>8.1} {:>9.1}ms {:>9.1}ms {:>9} {:>8}",
        f.tok_s, f.itl_p50, f.itl_mean, f.forced, f.requests
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let quick = ferry_core::bench::quick();
    let secs =
        std::env::var("FERRY_BENCH_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(if quick { 8 } else { 40 });
    let window = Duration::from_secs(secs);
    let model = Model::load(&smollm2(), CpuBackend::default()).expect("SmolLM2 (ferry model fetch smollm2-135m)");
    let tok = model.tokenizer();
    let chat = |q: &str| {
        let t = tok.chat_template().expect("template");
        let text = t.render(&[ferry_engine::ChatMessage::new("user", q)], true).expect("render");
        tok.encode(&text).expect("encode")
    };
    println!(
        "Structured outputs: SmolLM2 on one colocated decode worker, 8 clients in a closed loop, greedy, {secs} s per mode"
    );
    println!("{:<40} {:>8} {:>11} {:>11} {:>9} {:>8}", "mode", "tok/s", "ITL p50", "ITL mean", "forced", "requests");

    // 1. What masking costs per token.
    let story = chat("Tell me a long story about a lighthouse keeper, as JSON.");
    let free = SamplingParams { max_new_tokens: 96, ignore_eos: true, ..SamplingParams::default() };
    let prose = SamplingParams { constraint: Some(Constraint::JsonSchema(PROSE.into())), ..free.clone() };
    let a = run(&story, &free, false, window).await;
    row("free text", &a);
    let b = run(&story, &prose, false, window).await;
    row("JSON schema (long strings), no jump-fwd", &b);
    println!(
        "  inter-token latency with the schema: {:.2}x p50, {:.2}x mean (goal <= 1.10x)",
        b.itl_p50 / a.itl_p50,
        b.itl_mean / a.itl_mean
    );

    // 2. Jump-forward on fixed keys.
    let person = chat("Describe a person as a JSON record.");
    let record = SamplingParams {
        max_new_tokens: 200,
        constraint: Some(Constraint::JsonSchema(RECORD.into())),
        ..SamplingParams::default()
    };
    let c = run(&person, &record, false, window).await;
    row("JSON schema (long keys), no jump-fwd", &c);
    let d = run(&person, &record, true, window).await;
    row("JSON schema (long keys), jump-forward", &d);
    println!("  output tokens/s with jump-forward: {:.2}x (goal >= 1.5x)", d.tok_s / c.tok_s);

    // 3. A schema seen before.
    let g = ferry_engine::Grammars::new(tok.clone());
    let rec = Constraint::JsonSchema(RECORD.into());
    let t = Instant::now();
    let mut m = g.matcher(&rec).expect("compiles");
    let _ = m.compute_mask();
    let cold = t.elapsed().as_secs_f64() * 1e3;
    let mut warm: Vec<f64> = (0..200)
        .map(|_| {
            let t = Instant::now();
            let mut m = g.matcher(&rec).expect("cached");
            let _ = m.compute_mask();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    println!(
        "grammar for the long-keys schema, incl. the first mask: first request {cold:.2} ms (with the token table), \
         seen before p50 {:.3} ms, p99 {:.3} ms (goal <= 1 ms)",
        percentile(&mut warm, 0.5),
        percentile(&mut warm, 0.99)
    );
}
