//! Admission rules on the decode queues without a model (issue 24): the real [`Queues`] driven
//! as the engine drives them — admit, make room (grow or retract), one forward pass, a token
//! for every running request — by a closed loop of clients, with the pass's time from a cost
//! model instead of a device. Deterministic and fast: it shows what an admission rule gains
//! where throughput grows with the batch (a GPU) apart from where it does not (two CPU
//! cores, `cargo bench -p ferry-tests --bench retract`), and costs no device time.
//!
//! Per cost model and answer-length mix it prints, for a fixed 256-token reservation, the
//! adaptive estimate (the daemon's defaults) and the *bound* (promise nothing, let
//! retraction make room): tokens per simulated second, mean running batch, retractions,
//! tokens recomputed, answers finished, and the ratio to the reservation. No answer is cut:
//! the queues retract instead, and a request ends here only at its own length.
//!
//! Workload (the retract bench's): `C` clients, prompts of 8–30 tokens, `max_tokens` 512,
//! a pool of a third of `C × (prompt + 512)` tokens in pages of 16. A retracted request
//! recomputes its context (prefill, chunked); the decode cache, which may keep some of it, is
//! left out (every recomputation is paid in full). Cost models, per forward pass:
//! - `cpu`: 4.5 ms + 4.2 ms per decoding row + 1.6 ms per prefilled token (SmolLM2 on this
//!   machine's two cores: ITL 28 ms at 5.6 rows, 54 ms at 11.8; ~600 tok/s of prefill);
//! - `gpu`: 12 ms + 0.05 ms per row + 0.01 ms per prefilled token (a pass whose time the
//!   weights' reading sets, as on an H200 at these batch sizes).
//!
//! `cargo bench -p ferry-decode --bench admission`; `FERRY_BENCH_CLIENTS` (default 32),
//! `FERRY_BENCH_SECS` (simulated seconds, default 600; `FERRY_BENCH_QUICK=1`: 20, a smoke run),
//! `FERRY_BENCH_ADAPTIVE=init:min:steps,...` (more adaptive settings, for tuning).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ferry_cluster::Room;
use ferry_decode::queues::{Action, Admission, Event, Limits, Queues, Stage};

const PAGE: usize = 16;
const MAX_NEW: usize = 512;
const CHUNK: usize = 512;
/// Prompts are 8–30 tokens (uniform): 19 on average.
const PROMPTS: (usize, usize) = (8, 30);

/// Seconds a forward pass takes.
#[derive(Clone, Copy)]
struct Cost {
    name: &'static str,
    base: f64,
    per_row: f64,
    per_prefill_token: f64,
}

const COSTS: [Cost; 2] = [
    Cost { name: "cpu", base: 4.5e-3, per_row: 4.2e-3, per_prefill_token: 1.6e-3 },
    Cost { name: "gpu", base: 12e-3, per_row: 0.05e-3, per_prefill_token: 0.01e-3 },
];

/// xorshift: the same requests for every rule.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// Answer lengths (tokens the request generates before its EOS; at most `MAX_NEW`).
#[derive(Clone, Copy)]
enum Answers {
    /// Uniform in 16..=512: every length equally likely (mean 264).
    Uniform,
    /// Mostly short (16–128), one in five runs to the limit.
    Short,
    /// Every answer runs to `max_tokens` (`ignore_eos`).
    Full,
}

impl Answers {
    fn name(self) -> &'static str {
        match self {
            Self::Uniform => "answers uniform 16-512",
            Self::Short => "answers mostly 16-128, 1 in 5 to 512",
            Self::Full => "answers all 512 (ignore_eos)",
        }
    }

    fn draw(self, rng: &mut Rng) -> usize {
        match self {
            Self::Uniform => 16 + rng.below(MAX_NEW - 15),
            Self::Short if rng.below(5) == 0 => MAX_NEW,
            Self::Short => 16 + rng.below(113),
            Self::Full => MAX_NEW,
        }
    }
}

/// A request in flight: what it must generate, what it generated, what it must still compute.
struct Req {
    answer: usize,
    generated: usize,
    /// Tokens left to compute before it decodes (its prompt, or its context after a retraction).
    to_compute: usize,
}

#[derive(Default)]
struct Figures {
    tokens: usize,
    seconds: f64,
    batch_sum: usize,
    passes: usize,
    retractions: usize,
    recomputed: usize,
    finished: usize,
}

fn simulate(admission: Admission, cost: Cost, answers: Answers, clients: usize, secs: f64) -> Figures {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let prompt = |rng: &mut Rng| PROMPTS.0 + rng.below(PROMPTS.1 - PROMPTS.0 + 1);
    let demand = clients * (PROMPTS.0.midpoint(PROMPTS.1) + MAX_NEW).div_ceil(PAGE);
    let pool = demand / 3;
    let limits = Limits {
        max_running: 256,
        prealloc_timeout: Duration::from_secs(3600),
        waiting_timeout: Duration::from_secs(3600),
        page_size: PAGE,
        admission,
    };
    let mut q = Queues::new(limits, pool);
    // The queues read time only for timeouts: a fixed clock keeps every run the same.
    let now = Instant::now();
    let mut reqs: HashMap<Room, Req> = HashMap::new();
    let mut next_room = 1u64;
    let mut f = Figures::default();
    let mut arrive = |q: &mut Queues, reqs: &mut HashMap<Room, Req>, rng: &mut Rng| {
        let room = Room::new(next_room).expect("63 bits");
        next_room += 1;
        let p = prompt(rng);
        let answer = answers.draw(rng);
        reqs.insert(room, Req { answer, generated: 0, to_compute: p });
        let refused = q.on(Event::Request { room, prompt: p, limit: MAX_NEW, local: true, n: 1, forks: 0 }, now);
        assert!(refused.is_empty(), "{refused:?}");
    };
    for _ in 0..clients {
        arrive(&mut q, &mut reqs, &mut rng);
    }
    while f.seconds < secs {
        for a in q.on(Event::Admit, now) {
            assert!(matches!(a, Action::Allocate { local: true, .. }), "{a:?}");
        }
        for a in q.on(Event::MakeRoom, now) {
            if let Action::Retract { room, context, .. } = a {
                let r = reqs.get_mut(&room).expect("retracted request");
                r.to_compute = context;
                // It recomputes its prompt and all its tokens but the last, which its next
                // pass after that feeds as any running request's.
                f.retractions += 1;
                f.recomputed += context;
            }
        }
        // One pass: prefill chunks first (up to CHUNK tokens), then every running row.
        let mut budget = CHUNK;
        let mut prefilled = 0;
        let mut computed = Vec::new();
        for room in q.in_stage(Stage::Prefill) {
            if budget == 0 {
                break;
            }
            let r = reqs.get_mut(&room).expect("prefilling request");
            let n = r.to_compute.min(budget);
            r.to_compute -= n;
            budget -= n;
            prefilled += n;
            if r.to_compute == 0 {
                computed.push(room);
            }
        }
        let running = q.in_stage(Stage::Running);
        let mut ended = Vec::new();
        for &room in &running {
            q.on(Event::Token(room), now);
            let r = reqs.get_mut(&room).expect("running request");
            r.generated += 1;
            f.tokens += 1;
            if r.generated == r.answer {
                ended.push(room);
            }
        }
        // A request whose prompt is computed samples its first token in the same pass.
        for room in computed {
            q.on(Event::Computed(room), now);
            let r = reqs.get_mut(&room).expect("computed request");
            if r.generated == 0 {
                q.on(Event::Token(room), now);
                r.generated = 1;
                f.tokens += 1;
            }
        }
        f.seconds += cost.base + cost.per_row * running.len() as f64 + cost.per_prefill_token * prefilled as f64;
        f.batch_sum += running.len();
        f.passes += 1;
        q.on(Event::Stepped { decoding: !running.is_empty() }, now);
        for room in ended {
            reqs.remove(&room).expect("ended request");
            q.on(Event::End { room, writing: false }, now);
            f.finished += 1;
            arrive(&mut q, &mut reqs, &mut rng);
        }
    }
    f
}

fn main() {
    let env = |k: &str, d: f64| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let quick = ferry_core::bench::quick();
    let (clients, secs) =
        (env("FERRY_BENCH_CLIENTS", 32.0) as usize, env("FERRY_BENCH_SECS", if quick { 20.0 } else { 600.0 }));
    let mut rules: Vec<(String, Admission)> = vec![
        ("reserved 256".into(), Admission::Reserved { tokens: 256 }),
        ("adaptive (defaults)".into(), Admission::Adaptive { init: 0.3, min: 0.05, steps: 200 }),
        ("bound: context only".into(), Admission::Adaptive { init: 0.0, min: 0.0, steps: 1 }),
    ];
    // FERRY_BENCH_ADAPTIVE=init:min:steps,... adds adaptive settings (for tuning).
    for v in std::env::var("FERRY_BENCH_ADAPTIVE").unwrap_or_default().split(',').filter(|v| !v.is_empty()) {
        let f: Vec<f64> = v.split(':').map(|x| x.parse().expect("FERRY_BENCH_ADAPTIVE: init:min:steps,...")).collect();
        let [init, min, steps] = f[..] else { panic!("FERRY_BENCH_ADAPTIVE: init:min:steps,...") };
        rules.push((format!("adaptive {v}"), Admission::Adaptive { init, min, steps: steps as u32 }));
    }
    println!(
        "Decode admission, simulated: the real queues, {clients} clients in a closed loop, {secs} simulated s, \
         max_tokens {MAX_NEW}, pool a third of the demand"
    );
    for cost in COSTS {
        for answers in [Answers::Uniform, Answers::Short, Answers::Full] {
            println!("\n{} cost, {}", cost.name, answers.name());
            println!(
                "{:<22} {:>9} {:>7} {:>10} {:>11} {:>9} {:>8}",
                "rule", "tok/s", "batch", "retracted", "recomputed", "finished", "ratio"
            );
            let mut base = None;
            for (name, rule) in &rules {
                let f = simulate(*rule, cost, answers, clients, secs);
                let tok_s = f.tokens as f64 / f.seconds;
                let b = *base.get_or_insert(tok_s);
                println!(
                    "{name:<22} {tok_s:>9.1} {:>7.2} {:>10} {:>11} {:>9} {:>7.2}x",
                    f.batch_sum as f64 / f.passes.max(1) as f64,
                    f.retractions,
                    f.recomputed,
                    f.finished,
                    tok_s / b
                );
            }
        }
    }
}
