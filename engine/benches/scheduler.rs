//! Scheduler benchmarks, no model (token counting): run with
//! `cargo bench -p ferry-engine --bench scheduler`.
//!
//! 1. Multi-turn conversations sharing system prompts against a KV budget too small to hold
//!    them all, then one large enough: prefill tokens computed under fcfs, lpm and dfs-weight.
//! 2. One scheduling pass (schedule + complete) at 128, 1,000 and 10,000 waiting requests of
//!    4k-token prompts with shared prefixes, under lpm.
//! 3. A cache match on a 4,096-token shared prefix, against a token-by-token walk.
//!
//! `FERRY_BENCH_QUICK=1` shrinks the sizes (CI smoke run).

use std::time::Instant;

use ferry_engine::scheduler::{Policy, Scheduler, SchedulerConfig};
use ferry_engine::{PagePool, RadixCache};
use ferry_kernels::KvLayout;
use ferry_kernels::cpu::CpuBackend;

const PS: usize = 16;

fn pool(pages: usize) -> PagePool<CpuBackend> {
    let layout = KvLayout { num_layers: 1, num_kv_heads: 1, head_dim: 2, page_size: PS };
    PagePool::new(&CpuBackend::default(), layout, pages).unwrap_or_else(|e| panic!("pool: {e}"))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Deterministic "random" token stream.
fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 49_000) as u32 + 17
        })
        .collect()
}

/// Runs every request to completion; returns prompt tokens computed.
fn run(s: &mut Scheduler, cache: &mut RadixCache, pool: &PagePool<CpuBackend>) -> usize {
    let mut computed = 0;
    while s.waiting_len() + s.prefilling_len() > 0 {
        let chunks = s.schedule(cache, pool);
        if chunks.is_empty() {
            break;
        }
        computed += chunks.iter().map(|c| c.end - c.start).sum::<usize>();
        for p in s.complete(&chunks, cache) {
            cache.unlock(p.node);
        }
    }
    computed
}

fn conversations(policy: Policy, pages: usize, quick: bool) -> usize {
    let (systems, convs, turns) = if quick { (4, 16, 3) } else { (8, 64, 4) };
    let pool = pool(pages);
    let mut cache = RadixCache::new(PS, 1);
    let mut s = Scheduler::new(SchedulerConfig { policy, chunk_size: 512, in_queue_threshold: 32 }, PS);
    let sys: Vec<Vec<u32>> = (0..systems).map(|g| tokens(1000 + g as u64, 256)).collect();
    let mut history: Vec<Vec<u32>> = (0..convs).map(|c| sys[c % systems].clone()).collect();
    let mut computed = 0;
    let mut id = 0;
    for t in 0..turns {
        // Every conversation's next turn arrives, in an interleaved order.
        let mut order: Vec<usize> = (0..convs).collect();
        order.sort_by_key(|&c| (c * 7919 + t * 31) % convs);
        for &c in &order {
            history[c].extend(tokens((c * 100 + t) as u64, 64)); // user message
            id += 1;
            s.add(id, history[c].clone(), &cache);
        }
        computed += run(&mut s, &mut cache, &pool);
        for (c, h) in history.iter_mut().enumerate() {
            h.extend(tokens((c * 100 + t) as u64 + 50_000, 64)); // the answer
        }
    }
    computed
}

fn cache_effect(quick: bool) {
    println!("Multi-turn conversations sharing system prompts: prefill tokens computed");
    println!(
        "{:>14} {:>10} {:>10} {:>12} {:>10} {:>12}",
        "KV budget", "fcfs", "lpm", "lpm/fcfs", "dfs-weight", "dfs/fcfs"
    );
    for (name, pages) in [("400 pages", 400), ("1000 pages", 1000), ("8192 pages", 8192)] {
        let f = conversations(Policy::Fcfs, pages, quick);
        let l = conversations(Policy::Lpm, pages, quick);
        let d = conversations(Policy::DfsWeight, pages, quick);
        println!("{name:>14} {f:>10} {l:>10} {:>12.3} {d:>10} {:>12.3}", l as f64 / f as f64, d as f64 / f as f64);
    }
}

fn pass_cost(quick: bool) {
    println!("\nOne lpm scheduling pass (schedule + complete, chunk 2048), 4k-token prompts, 16 shared 3k prefixes");
    println!("{:>10} {:>14} {:>14} {:>16}", "waiting", "add all (ms)", "pass p50 (us)", "re-matches/pass");
    let sizes: &[usize] = if quick { &[128, 1000] } else { &[128, 1000, 10_000] };
    for &n in sizes {
        let pool = pool(4096 / PS * 64);
        let mut cache = RadixCache::new(PS, 1);
        let prefixes: Vec<Vec<u32>> = (0..16).map(|i| tokens(i, 3072)).collect();
        let mut s =
            Scheduler::new(SchedulerConfig { policy: Policy::Lpm, chunk_size: 2048, in_queue_threshold: 32 }, PS);
        for (i, p) in prefixes.iter().enumerate() {
            s.add(1_000_000 + i as u64, p.clone(), &cache);
        }
        run(&mut s, &mut cache, &pool);
        let t = Instant::now();
        for i in 0..n as u64 {
            let mut p = prefixes[(i % 16) as usize].clone();
            p.extend(tokens(10_000 + i, 1024));
            s.add(i, p, &cache);
        }
        let add_ms = t.elapsed().as_secs_f64() * 1e3;
        let mut times = Vec::new();
        let before = s.rematch_count();
        let passes = 20;
        for _ in 0..passes {
            let t = Instant::now();
            let chunks = s.schedule(&mut cache, &pool);
            for p in s.complete(&chunks, &mut cache) {
                cache.unlock(p.node);
            }
            times.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let rematch = (s.rematch_count() - before) as f64 / passes as f64;
        println!("{n:>10} {add_ms:>14.1} {:>14.1} {rematch:>16.1}", median(times));
    }
}

fn match_cost() {
    let pool = pool(1024);
    let mut cache = RadixCache::new(PS, 1);
    let prompt = tokens(77, 4096);
    let mut s = Scheduler::new(SchedulerConfig::default(), PS);
    let mut full = prompt.clone();
    full.push(1);
    s.add(1, full, &cache);
    run(&mut s, &mut cache, &pool);
    let mut q = prompt.clone();
    q.extend(tokens(78, 512));
    let iters = 20_000;
    let t = Instant::now();
    let mut total = 0;
    for _ in 0..iters {
        total += cache.peek(std::hint::black_box(&q));
    }
    let ns = t.elapsed().as_secs_f64() * 1e9 / iters as f64;
    assert_eq!(total, 4096 * iters);
    let t = Instant::now();
    let mut naive = 0;
    for _ in 0..iters {
        naive += std::hint::black_box(&q).iter().zip(&prompt).take_while(|(a, b)| a == b).count();
    }
    let naive_ns = t.elapsed().as_secs_f64() * 1e9 / iters as f64;
    assert_eq!(naive, 4096 * iters);
    println!(
        "\nMatch of a 4,096-token shared prefix: {ns:.0} ns (galloping radix match), {naive_ns:.0} ns (token-by-token walk), ratio {:.2}",
        naive_ns / ns
    );
}

fn main() {
    let quick = ferry_core::bench::quick();
    cache_effect(quick);
    pass_cost(quick);
    match_cost();
}
