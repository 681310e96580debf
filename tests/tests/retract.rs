//! Decode under memory pressure: a pool too small for the batch makes the decode worker
//! retract running requests and recompute them later; every request still ends with all the
//! tokens it asked for, exactly those of an unconstrained run, and every page comes back.
//! Through the router, on SmolLM2, the measurement of issue 24: 12 concurrent completions of
//! 300 tokens on a 96-page pool (3 of 12 completed before retraction) all complete; a request
//! larger than the pool is refused at once with a 400.

use std::time::Duration;

use ferry_decode::{AdmissionKind, DecodeArgs};
use ferry_engine::SamplingParams;
use ferry_tests::{Client, TinyModel, colocated, greedy, metric_sum, scrape};

fn prompts(n: usize, len: usize, vocab: u32) -> Vec<Vec<u32>> {
    (0..n).map(|r| (0..len).map(|i| 3 + ((i * 31 + r * 17 + 5) as u32 % (vocab - 3))).collect()).collect()
}

/// Runs `prompts` concurrently on a colocated decode worker of `pages` pages; returns the
/// outputs and the retractions counted.
async fn squeezed(
    m: &TinyModel,
    pages: usize,
    admission: AdmissionKind,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
) -> (Vec<Vec<u32>>, f64) {
    let mut a = DecodeArgs::for_model(m.path());
    a.worker.pool_pages = pages;
    a.worker.chunked_prefill_size = 32;
    a.decode_admission = admission;
    a.num_reserved_decode_tokens = 8;
    let d = ferry_decode::start(a).await.expect("decode up");
    let c = Client::new(d.grpc_addr, None).await;
    let runs = prompts.iter().map(|p| {
        let (c, p, params) = (c.clone(), p.clone(), params.clone());
        tokio::spawn(async move { c.generate(&p, &params).await })
    });
    let mut out = Vec::new();
    for r in futures::future::join_all(runs).await {
        out.push(r.expect("task").expect("every request completes"));
    }
    let worker = format!("worker=\"{}\"", d.worker_id);
    let retractions = metric_sum(&scrape(d.metrics_addr).await, "ferry_decode_retractions_total", &worker);
    ferry_tests::settle_decode(std::slice::from_ref(&d)).await;
    d.stop().await;
    (out, retractions)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_too_small_for_the_batch_retracts_and_every_answer_is_whole() {
    let m = TinyModel::new();
    // 8 requests of 20 + 60 tokens: 5 pages each, 40 in all, on a 16-page pool.
    let ps = prompts(8, 20, 300);
    let params = greedy(60);
    let want = colocated(&m.path(), &ps, &params);
    for admission in [AdmissionKind::Adaptive, AdmissionKind::Reserved] {
        let (got, retractions) = squeezed(&m, 16, admission, &ps, &params).await;
        assert!(retractions >= 1.0, "{admission:?}: the pool was meant to run short ({retractions} retractions)");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.len(), 60, "{admission:?}: request {i} was cut");
            assert_eq!(g, w, "{admission:?}: request {i} differs from the unconstrained run");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_continues_its_random_stream_across_a_retraction() {
    let m = TinyModel::new();
    let ps = prompts(6, 24, 300);
    let params = SamplingParams {
        temperature: 0.9,
        top_k: 40,
        seed: Some(11),
        max_new_tokens: 56,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let want = colocated(&m.path(), &ps, &params);
    let (got, retractions) = squeezed(&m, 12, AdmissionKind::Adaptive, &ps, &params).await;
    assert!(retractions >= 1.0, "the pool was meant to run short");
    assert_eq!(got, want, "seeded samples after a retraction differ from an unconstrained run");
}

/// The name the router serves SmolLM2's GGUF under: its file stem.
const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";

/// Issue 24's measurement, through the router: `ferry up --prefill 0 --pool-pages 96`, 12
/// concurrent completions of ~15-token prompts, 300 tokens each, greedy, EOS ignored (about
/// 3,800 tokens of KV wanted, 1,536 held). Before retraction, 3 of 12 completed; now every
/// answer is whole and its text exactly an unconstrained run's. Also: a request that cannot
/// fit the pool even alone gets a 400 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_under_memory_pressure_completes_every_request_through_the_router() {
    let path = ferry_tests::smollm2();
    let mut a = DecodeArgs::for_model(&path);
    a.worker.pool_pages = 96;
    let d = ferry_decode::start(a).await.expect("decode up");
    let ra = ferry_router::RouterArgs::new(&path, vec![], vec![d.grpc_addr.to_string()]);
    let r = ferry_router::start(ra).await.expect("router up");
    for _ in 0..500 {
        if r.ready(0, 1) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let t = std::time::Instant::now();
    let topics = ["rivers", "mountains", "cities", "the sea", "forests", "deserts"];
    let texts: Vec<String> =
        (0..12).map(|i| format!("Write a long story about {} number {i}.", topics[i % topics.len()])).collect();
    let calls = texts.iter().map(|text| {
        let body = serde_json::json!({
            "model": MODEL, "prompt": text, "max_tokens": 300, "temperature": 0, "ignore_eos": true,
        });
        let addr = r.http_addr;
        tokio::spawn(
            async move { ferry_tests::http(addr, "POST", "/v1/completions", body.to_string().as_bytes()).await },
        )
    });
    let answers = futures::future::join_all(calls).await;
    let elapsed = t.elapsed();
    // The reference: one unconstrained colocated run of the same prompts (the engine's tokens
    // do not depend on batching or paging, so a retraction must not change a single one).
    let tok =
        ferry_engine::Model::load(&path, ferry_kernels::cpu::CpuBackend::default()).expect("load").tokenizer().clone();
    let ids: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t).expect("encode")).collect();
    let want = ferry_tests::blocking(|| colocated(&path, &ids, &greedy(300)));
    for (i, (c, w)) in answers.into_iter().zip(&want).enumerate() {
        let (status, _, body) = c.expect("task");
        assert_eq!(status, 200, "request {i}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("json");
        assert_eq!(v["usage"]["completion_tokens"], 300, "request {i}: {body}");
        assert_eq!(v["choices"][0]["finish_reason"], "length", "request {i}");
        let text = v["choices"][0]["text"].as_str().expect("text");
        assert_eq!(text, tok.decode(w, true).expect("decode"), "request {i} differs from the unconstrained run");
    }
    let m = scrape(d.metrics_addr).await;
    let worker = format!("worker=\"{}\"", d.worker_id);
    let retractions = metric_sum(&m, "ferry_decode_retractions_total", &worker);
    let recomputed = metric_sum(&m, "ferry_decode_retracted_tokens_total", &worker);
    let steps = metric_sum(&m, "ferry_decode_batch_requests_count", &worker);
    let batched = metric_sum(&m, "ferry_decode_batch_requests_sum", &worker);
    eprintln!(
        "{retractions} retractions, {recomputed} tokens recomputed, {steps} decode steps, mean batch {:.1}, {:.1} s",
        batched / steps.max(1.0),
        elapsed.as_secs_f64()
    );
    assert!(retractions >= 1.0, "96 pages for ~3,800 tokens of KV: retractions were expected");

    // 8,000 tokens cannot fit 96 pages of 16: refused before any work, naming the way out.
    let body = serde_json::json!({"model": MODEL, "prompt": "Hi", "max_tokens": 8000});
    let t = std::time::Instant::now();
    let (status, _, text) =
        ferry_tests::http(r.http_addr, "POST", "/v1/completions", body.to_string().as_bytes()).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("max_tokens") && text.contains("96"), "{text}");
    assert!(t.elapsed() < Duration::from_secs(2), "refused at once");
    ferry_tests::settle_decode(std::slice::from_ref(&d)).await;
    r.stop().await;
    d.stop().await;
}

/// Two requests for 4 sequences each (a 40-token prompt, 60 tokens a sequence, seeded
/// sampling) on a 24-page pool: each fits alone (22 pages: the prompt's 2 full pages shared,
/// 5 own a sequence), together they need 44, so forked sequences are retracted mid-decode —
/// leaving their group, recomputing their whole context alone — and resumed. Every sequence
/// still ends with exactly the tokens of a request for it alone (seed + its index), and every
/// page, shared ones included, comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forked_sequences_retracted_under_pressure_resume_exactly() {
    use ferry_proto::v1 as pb;
    let m = TinyModel::new();
    let ps = prompts(2, 40, 300);
    let params = SamplingParams {
        temperature: 0.9,
        seed: Some(21),
        max_new_tokens: 60,
        ignore_eos: true,
        n: 4,
        ..SamplingParams::default()
    };
    let mut a = DecodeArgs::for_model(m.path());
    a.worker.pool_pages = 24;
    a.worker.chunked_prefill_size = 32;
    a.decode_admission = AdmissionKind::Reserved;
    a.num_reserved_decode_tokens = 8;
    // A node that stops computing while sequences wait for pages fails them after this: a
    // retracted sequence whose siblings all ended once waited out the whole timeout (its
    // request's stream stayed open, so nothing woke the engine to admit it).
    a.prealloc_timeout = 5.0;
    let d = ferry_decode::start(a).await.expect("decode up");
    let dc = pb::decode_client::DecodeClient::new(ferry_tests::channel(d.grpc_addr).await);
    let runs = ps.iter().map(|p| {
        let (mut dc, p, params) = (dc.clone(), p.clone(), params.clone());
        tokio::spawn(async move {
            let key = ferry_cluster::RoomKey::random();
            let req = pb::DecodeRequest {
                request_id: format!("fork-{}", key.room.get()),
                room: Some(ferry_cluster::wire::room_key_to_proto(&key)),
                prefill_bootstrap_addr: String::new(),
                token_ids: p,
                sampling: Some(ferry_cluster::wire::sampling_to_proto(&params)),
            };
            let mut s = dc.generate(req).await.expect("generate").into_inner();
            let mut out = vec![Vec::new(); params.n as usize];
            while let Some(msg) = s.message().await.expect("every sequence completes") {
                out[msg.index as usize].extend(msg.token_ids);
            }
            out
        })
    });
    let got: Vec<Vec<Vec<u32>>> = futures::future::join_all(runs).await.into_iter().map(|r| r.expect("task")).collect();
    let worker = format!("worker=\"{}\"", d.worker_id);
    let retractions = metric_sum(&scrape(d.metrics_addr).await, "ferry_decode_retractions_total", &worker);
    ferry_tests::settle_decode(std::slice::from_ref(&d)).await;
    d.stop().await;
    assert!(retractions >= 1.0, "the pool was meant to run short ({retractions} retractions)");
    for (r, (p, seqs)) in ps.iter().zip(&got).enumerate() {
        for (i, g) in seqs.iter().enumerate() {
            let want = colocated(&m.path(), std::slice::from_ref(p), &params.sequence(i as u32));
            assert_eq!(g, &want[0], "request {r}, sequence {i}: differs from a request for it alone");
        }
    }
}
