//! Router benchmark: KV events applied per second while building a prefix index of about
//! 1M pages over 64 prefill workers, then placements per second and the p50 / p99 latency of
//! one placement (index match + cache-aware choice over 64 workers).
//! Run with `cargo bench -p ferry-router --bench placement`; `FERRY_BENCH_QUICK=1` shrinks
//! the index to ~20k pages (CI smoke run).

use std::time::Instant;

use ferry_radix::events::{ROOT_HASH, page_hashes};
use ferry_router::index::PrefixIndex;
use ferry_router::placement::{Placer, Policy, PrefillState};

const PS: usize = 16;
const WORKERS: usize = 64;
const STEMS: usize = 100;
const STEM_PAGES: usize = 8;
const DOC_PAGES: usize = 49;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (self.next() % 49_000) as u32 + 17).collect()
    }
}

fn hashes(parent: u64, tokens: &[u32]) -> Vec<u64> {
    page_hashes(parent, tokens, PS)
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p) as usize]
}

fn main() {
    let quick = std::env::var("FERRY_BENCH_QUICK").is_ok();
    let docs = if quick { 400 } else { 20_000 };
    let mut rng = Rng(0x5eed);
    let stems: Vec<Vec<u32>> = (0..STEMS).map(|_| rng.tokens(STEM_PAGES * PS)).collect();
    let stem_hashes: Vec<Vec<u64>> = stems.iter().map(|s| hashes(ROOT_HASH, s)).collect();
    // Build the events first, then time only applying them.
    let mut events: Vec<(usize, u64, Vec<u64>, Vec<u32>)> = Vec::new();
    let mut has_stem = vec![vec![false; STEMS]; WORKERS];
    let mut doc_prompts = Vec::new();
    for d in 0..docs {
        let w = d % WORKERS;
        let s = (rng.next() % STEMS as u64) as usize;
        if !has_stem[w][s] {
            has_stem[w][s] = true;
            events.push((w, ROOT_HASH, stem_hashes[s].clone(), stems[s].clone()));
        }
        let body = rng.tokens(DOC_PAGES * PS);
        let parent = *stem_hashes[s].last().unwrap_or(&ROOT_HASH);
        events.push((w, parent, hashes(parent, &body), body.clone()));
        doc_prompts.push((s, body));
    }
    let pages: usize = events.iter().map(|e| e.2.len()).sum();
    let mut ix = PrefixIndex::new(PS, 2_000_000);
    let t0 = Instant::now();
    for (w, parent, hs, toks) in &events {
        ix.stored(*w, *parent, hs, toks).unwrap_or_else(|e| panic!("stored: {e}"));
    }
    let build = t0.elapsed().as_secs_f64();
    println!(
        "index: {} pages from {} stored events ({pages} pages) over {WORKERS} workers in {build:.2} s: {:.0} events/s, {:.0} pages/s",
        ix.pages(),
        events.len(),
        events.len() as f64 / build,
        pages as f64 / build
    );

    // Placements: a document's stem and part of its body (cached on one worker), or a fresh
    // prompt below a stem (cached on the workers holding that stem).
    let states: Vec<PrefillState> = (0..WORKERS)
        .map(|w| PrefillState { healthy: true, queued_tokens: (w as u64 * 37) % 4000, tokens_per_second: 5000.0 })
        .collect();
    // SmolLM2-135M: 720 KiB of KV per 16-token page; loopback TCP ~2.5 GB/s.
    let mut placer = Placer::new(Policy::CacheAware, 5000.0, 737_280.0 / 16.0, 2.5e9);
    let n = if quick { 2_000 } else { 50_000 };
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|i| {
            let (s, body) = &doc_prompts[(rng.next() % doc_prompts.len() as u64) as usize];
            let mut p = stems[*s].clone();
            if i % 2 == 0 {
                p.extend_from_slice(&body[..(rng.next() % (DOC_PAGES * PS) as u64) as usize]);
            } else {
                p.extend(rng.tokens(200));
            }
            p
        })
        .collect();
    let mut lat = Vec::with_capacity(n);
    let mut hits = 0usize;
    let t0 = Instant::now();
    for p in &prompts {
        let t = Instant::now();
        let m = ix.matched(p, WORKERS);
        let j = rng.next();
        let c = placer.prefill(p.len(), &m, &states, |w| ((j >> (w % 56)) & 0xff) as f64 / 256.0);
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        hits += c.map_or(0, |c| c.cached_tokens);
    }
    let total = t0.elapsed().as_secs_f64();
    lat.sort_by(f64::total_cmp);
    let tokens: usize = prompts.iter().map(Vec::len).sum();
    println!(
        "placement over {WORKERS} workers, index of {} pages: {:.0} placements/s; latency p50 {:.1} us, p99 {:.1} us; {:.0} % of prompt tokens cached on the chosen worker",
        ix.pages(),
        n as f64 / total,
        pct(&lat, 0.5),
        pct(&lat, 0.99),
        100.0 * hits as f64 / tokens as f64
    );
}
