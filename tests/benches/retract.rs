//! Decode under memory pressure, side by side in one run on SmolLM2: a fixed decode
//! reservation per request (`--decode-admission reserved`, 256 tokens) against the adaptive
//! estimate (`adaptive`); both retract instead of cutting answers.
//!
//! Workload: a closed loop of `C` clients, each sending its next request as soon as the last
//! ended, for a fixed time, straight to one colocated decode worker over gRPC. Text prompts of
//! 8–30 tokens, greedy, EOS honoured (answers end at their own length), `max_tokens` 512. The
//! pool holds about a third of what the clients' requests could want at once
//! (C × (prompt + max_tokens)). Printed per mode: throughput (tokens received in the window
//! per second), the mean running batch and prealloc queue (sampled every 20 ms), p50/p99
//! inter-token latency, retractions, tokens recomputed, the answers that ended and their mean
//! length, and truncated answers (ended with fewer tokens than asked for and no stop: the old
//! behaviour under pressure, never now). A third mode, *bound*, admits whenever a request's
//! context fits and promises nothing for its decoding (ratio 0, but for the step after a
//! retraction): close to the most requests any admission rule can run at once, so it shows
//! what memory allows.
//!
//! `cargo bench -p ferry-tests --bench retract`; `FERRY_BENCH_QUICK=1`: 8 clients, 64 tokens,
//! 15 s (a smoke run); `FERRY_BENCH_CLIENTS`, `FERRY_BENCH_SECS` override the clients and the
//! window; `FERRY_BENCH_POOL_SHARE` the pool's share of the demand (default 0.333; 1 runs
//! without memory pressure: what the full batch would give); `FERRY_BENCH_DEVICE=cuda` runs
//! the decode worker on a GPU (a build with `--features ferry-decode/cuda`). The model comes from `FERRY_SMOLLM2` or the fetch cache.

use std::time::{Duration, Instant};

use ferry_decode::{AdmissionKind, DecodeArgs};
use ferry_engine::{Model, SamplingParams};
use ferry_kernels::cpu::CpuBackend;
use ferry_tests::closed_loop::{Outcome, client, percentile};
use ferry_tests::{metric_sum, scrape, smollm2};

const SUBJECTS: [&str; 8] = [
    "a lighthouse keeper",
    "the history of bread",
    "a robot learning to paint",
    "volcanoes",
    "a chess match",
    "the moon",
    "an old library",
    "bees",
];
const ASKS: [&str; 4] =
    ["Write a story about", "Explain in detail", "Describe, step by step,", "Tell me everything you know about"];

struct Figures {
    tok_s: f64,
    batch: f64,
    queued: f64,
    itl_p50: f64,
    itl_p99: f64,
    retractions: f64,
    recomputed: f64,
    finished: usize,
    /// Mean length of the answers that ended in the window.
    answer: f64,
    truncated: usize,
}

async fn run(edit: &dyn Fn(&mut DecodeArgs), load: &Load) -> Figures {
    let path = smollm2();
    let mut a = DecodeArgs::for_model(&path);
    a.worker.pool_pages = load.pages;
    if let Ok(dev) = std::env::var("FERRY_BENCH_DEVICE") {
        a.worker.device = dev.parse().expect("FERRY_BENCH_DEVICE: cpu, cuda or cuda:N");
    }
    edit(&mut a);
    let d = ferry_decode::start(a).await.expect("decode up");
    let params = SamplingParams { temperature: 0.0, max_new_tokens: load.max_new, ..SamplingParams::default() };
    let t0 = Instant::now();
    let deadline = t0 + load.window;
    let calls =
        (0..load.clients).map(|c| tokio::spawn(client(d.grpc_addr, load.prompts.clone(), c, params.clone(), deadline)));
    let all = futures::future::join_all(calls);
    tokio::pin!(all);
    let (mut running, mut queued) = (Vec::new(), Vec::new());
    let outs: Vec<Outcome> = loop {
        tokio::select! {
            outs = &mut all => break outs.into_iter().flat_map(|r| r.expect("task")).collect(),
            () = tokio::time::sleep(Duration::from_millis(20)) => {
                let depth = d.load().depth;
                let at = |q: &str| depth.iter().find(|x| x.0 == q).map_or(0, |x| x.1) as f64;
                running.push(at("running"));
                queued.push(at("prealloc"));
            }
        }
    };
    let secs = load.window.as_secs_f64();
    let m = scrape(d.metrics_addr).await;
    let w = format!("worker=\"{}\"", d.worker_id);
    let mut itl: Vec<f64> = outs
        .iter()
        .flat_map(|o| o.arrivals.windows(2).map(|x| x[1].duration_since(x[0]).as_secs_f64() * 1e3))
        .collect();
    let f = Figures {
        tok_s: outs.iter().map(|o| o.tokens).sum::<usize>() as f64 / secs,
        batch: running.iter().sum::<f64>() / running.len().max(1) as f64,
        queued: queued.iter().sum::<f64>() / queued.len().max(1) as f64,
        itl_p50: percentile(&mut itl, 0.5),
        itl_p99: percentile(&mut itl, 0.99),
        // (+ 0.0: an empty sum is -0.)
        retractions: metric_sum(&m, "ferry_decode_retractions_total", &w) + 0.0,
        recomputed: metric_sum(&m, "ferry_decode_retracted_tokens_total", &w) + 0.0,
        finished: outs.iter().filter(|o| o.ended).count(),
        answer: outs.iter().filter(|o| o.ended).map(|o| o.tokens as f64).sum::<f64>()
            / outs.iter().filter(|o| o.ended).count().max(1) as f64,
        truncated: outs.iter().filter(|o| o.ended && o.tokens < load.max_new as usize && !o.stopped).count(),
    };
    d.stop().await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    f
}

/// The workload.
struct Load {
    prompts: Vec<Vec<u32>>,
    clients: usize,
    max_new: u32,
    pages: usize,
    window: Duration,
}

type Edit = Box<dyn Fn(&mut DecodeArgs)>;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let quick = ferry_core::bench::quick();
    let (clients, max_new, secs) = if quick { (8, 64u32, 15) } else { (32, 512, 120) };
    let env = |k: &str, d: u64| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let (clients, secs) = (env("FERRY_BENCH_CLIENTS", clients as u64) as usize, env("FERRY_BENCH_SECS", secs));
    let tok = Model::load(&smollm2(), CpuBackend::default())
        .expect("SmolLM2 (ferry model fetch smollm2-135m)")
        .tokenizer()
        .clone();
    let prompts: Vec<Vec<u32>> = (0..SUBJECTS.len() * ASKS.len())
        .map(|i| tok.encode(&format!("{} {}.", ASKS[i % ASKS.len()], SUBJECTS[i % SUBJECTS.len()])).expect("encode"))
        .collect();
    let mean_prompt = prompts.iter().map(Vec::len).sum::<usize>() / prompts.len();
    let demand = clients * (mean_prompt + max_new as usize).div_ceil(16);
    let share: f64 = std::env::var("FERRY_BENCH_POOL_SHARE").ok().and_then(|v| v.parse().ok()).unwrap_or(1.0 / 3.0);
    let pages = (demand as f64 * share) as usize;
    let load = Load { prompts, clients, max_new, pages, window: Duration::from_secs(secs) };
    println!(
        "Decode under memory pressure: SmolLM2, {clients} clients in a closed loop for {secs} s, max_tokens {max_new}, greedy,\n\
         EOS honoured; pool {} pages of 16 tokens ({:.0} % of the {demand} pages the clients' requests could want)",
        load.pages,
        load.pages as f64 / demand as f64 * 100.0
    );
    println!(
        "{:<26} {:>8} {:>8} {:>8} {:>10} {:>10} {:>10} {:>11} {:>9} {:>7} {:>10}",
        "mode",
        "tok/s",
        "batch",
        "queued",
        "ITL p50",
        "ITL p99",
        "retracted",
        "recomputed",
        "finished",
        "answer",
        "truncated"
    );
    // FERRY_BENCH_ADAPTIVE=init:min:steps,... runs these adaptive settings instead of the
    // defaults (for tuning).
    let variants: Vec<(f64, f64, u32)> = std::env::var("FERRY_BENCH_ADAPTIVE")
        .ok()
        .map(|v| {
            v.split(',')
                .filter_map(|x| {
                    let f: Vec<&str> = x.split(':').collect();
                    Some((f.first()?.parse().ok()?, f.get(1)?.parse().ok()?, f.get(2)?.parse().ok()?))
                })
                .collect()
        })
        .unwrap_or_default();
    let mut modes: Vec<(String, Edit)> = vec![(
        "reserved 256 + retraction".into(),
        Box::new(|a: &mut DecodeArgs| a.decode_admission = AdmissionKind::Reserved),
    )];
    if variants.is_empty() {
        modes.push((
            "adaptive + retraction".into(),
            Box::new(|a: &mut DecodeArgs| a.decode_admission = AdmissionKind::Adaptive),
        ));
        // About the most any admission rule could run at once: admit whenever the context
        // fits, promise nothing for decoding, and let retraction make room.
        modes.push((
            "bound: context only".into(),
            Box::new(|a: &mut DecodeArgs| {
                a.decode_admission = AdmissionKind::Adaptive;
                (a.init_new_token_ratio, a.min_new_token_ratio, a.new_token_ratio_decay_steps) = (0.0, 0.0, 1);
            }),
        ));
    }
    for (init, min, steps) in variants {
        modes.push((
            format!("adaptive {init}/{min}/{steps}"),
            Box::new(move |a: &mut DecodeArgs| {
                a.decode_admission = AdmissionKind::Adaptive;
                (a.init_new_token_ratio, a.min_new_token_ratio, a.new_token_ratio_decay_steps) = (init, min, steps);
            }),
        ));
    }
    let mut base = None;
    for (name, edit) in &modes {
        let f = run(edit.as_ref(), &load).await;
        println!(
            "{name:<26} {:>8.1} {:>8.2} {:>8.2} {:>8.0}ms {:>8.0}ms {:>10} {:>11} {:>9} {:>7.0} {:>10}",
            f.tok_s,
            f.batch,
            f.queued,
            f.itl_p50,
            f.itl_p99,
            f.retractions,
            f.recomputed,
            f.finished,
            f.answer,
            f.truncated
        );
        match base {
            None => base = Some(f.tok_s),
            Some(b) => println!("{:<26} {:.2}x the reserved throughput", "", f.tok_s / b),
        }
    }
}
