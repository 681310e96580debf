//! Engine benchmarks, printed as tables (run: `cargo bench -p ferry-engine --bench engine`).
//!
//! 1. SmolLM2-135M on the CPU backend: prefill and decode tokens/s at batch 1, 8 and 32
//!    (median of several runs).
//! 2. Copying page runs out of the KV pool into a send buffer, page-major (Ferry's layout:
//!    one copy per run) against layer-major (one copy per layer, K/V and run), same pages.
//!
//! `FERRY_BENCH_QUICK=1` shortens both (for CI smoke runs). The model comes from
//! `FERRY_SMOLLM2` or the `ferry model fetch smollm2-135m` cache.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ferry_engine::{Model, PagePool, SeqChunk};
use ferry_kernels::KvLayout;
use ferry_kernels::cpu::CpuBackend;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn model_path() -> PathBuf {
    if let Ok(p) = std::env::var("FERRY_SMOLLM2") {
        return p.into();
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let cache = std::env::var("FERRY_CACHE_DIR").unwrap_or_else(|_| format!("{home}/.cache/ferry"));
    PathBuf::from(cache).join("models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn throughput(quick: bool) -> Result<(), Box<dyn std::error::Error>> {
    let path = model_path();
    let model = Model::load(&path, CpuBackend)?;
    let page: usize = 16;
    let prompt_len: usize = 64;
    let steps = if quick { 4 } else { 16 };
    let reps = if quick { 1 } else { 3 };
    println!(
        "SmolLM2-135M ({}), CPU backend, {} threads, prompt {prompt_len} tokens, {steps} decode steps",
        model.format_name(),
        rayon_threads()
    );
    println!("{:>6} {:>16} {:>16} {:>18}", "batch", "prefill tok/s", "decode tok/s", "decode ms/step");
    for batch in [1usize, 8, 32] {
        let mut pre = Vec::new();
        let mut dec = Vec::new();
        for _ in 0..reps {
            let per_seq = (prompt_len + steps).div_ceil(page);
            let mut pool = PagePool::new(model.backend(), model.kv_layout(page), batch * per_seq)?;
            let allocs: Vec<_> = (0..batch).map(|_| pool.alloc(per_seq)).collect::<Result<_, _>>()?;
            let prompts: Vec<Vec<u32>> = (0..batch)
                .map(|b| (0..prompt_len as u32).map(|i| 1000 + (i * 31 + b as u32 * 7) % 20000).collect())
                .collect();
            let t = Instant::now();
            let chunks: Vec<SeqChunk<'_>> = prompts
                .iter()
                .zip(&allocs)
                .map(|(p, a)| SeqChunk { tokens: p, start: 0, pages: a.pages(), logits: true })
                .collect();
            let logits = model.forward(&mut pool, &chunks)?;
            pre.push((batch * prompt_len) as f64 / t.elapsed().as_secs_f64());
            let mut next: Vec<u32> = logits.iter().map(|l| ferry_engine::sampler::argmax(l)).collect();
            let t = Instant::now();
            for s in 0..steps {
                let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
                let chunks: Vec<SeqChunk<'_>> = toks
                    .iter()
                    .zip(&allocs)
                    .map(|(t, a)| SeqChunk { tokens: t, start: prompt_len + s, pages: a.pages(), logits: true })
                    .collect();
                next = model.forward(&mut pool, &chunks)?.iter().map(|l| ferry_engine::sampler::argmax(l)).collect();
            }
            dec.push((batch * steps) as f64 / t.elapsed().as_secs_f64());
        }
        let (p, d) = (median(pre), median(dec));
        println!("{batch:>6} {p:>16.1} {d:>16.1} {:>18.1}", batch as f64 / d * 1e3);
    }
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Copies the pages of `runs` into `out`, page-major: one copy per run.
fn copy_page_major(pool: &[f32], l: &KvLayout, runs: &[(u32, u32)], out: &mut Vec<f32>) {
    out.clear();
    let pf = l.page_floats();
    for &(start, len) in runs {
        let s = start as usize * pf;
        out.extend_from_slice(&pool[s..s + len as usize * pf]);
    }
}

/// The same pages from a layer-major pool (`[layer][K|V][page][slot]`): a copy per layer,
/// K/V and run.
fn copy_layer_major(pool: &[f32], l: &KvLayout, pages: usize, runs: &[(u32, u32)], out: &mut Vec<f32>) {
    out.clear();
    let per_page = l.page_size * l.slot_floats();
    for layer in 0..l.num_layers {
        for kv in 0..2 {
            let base = (layer * 2 + kv) * pages * per_page;
            for &(start, len) in runs {
                let s = base + start as usize * per_page;
                out.extend_from_slice(&pool[s..s + len as usize * per_page]);
            }
        }
    }
}

fn page_copy(quick: bool) {
    let l = KvLayout { num_layers: 30, num_kv_heads: 3, head_dim: 64, page_size: 16 };
    let pages = if quick { 512 } else { 2048 };
    let pool: Vec<f32> = (0..pages * l.page_floats()).map(|i| i as f32).collect();
    println!("\nPage-run copy, SmolLM2 layout ({} KiB per page), pool {pages} pages", l.page_floats() * 4 / 1024);
    println!(
        "{:>10} {:>6} {:>15} {:>16} {:>6} {:>19}",
        "run pages", "runs", "page-major GB/s", "layer-major GB/s", "ratio", "copies (page/layer)"
    );
    let mut out = Vec::with_capacity(pages * l.page_floats());
    for run_len in [1u32, 4, 16, 64] {
        // Runs spread over the pool, every other slot of run_len pages.
        let runs: Vec<(u32, u32)> =
            (0..pages as u32 / (2 * run_len)).map(|i| (i * 2 * run_len, run_len)).take(64).collect();
        let bytes = runs.iter().map(|r| r.1 as usize).sum::<usize>() * l.page_floats() * 4;
        let time = |f: &mut dyn FnMut()| {
            let mut v = Vec::new();
            for _ in 0..if quick { 3 } else { 9 } {
                let t = Instant::now();
                f();
                v.push(t.elapsed().max(Duration::from_nanos(1)).as_secs_f64());
            }
            bytes as f64 / median(v) / 1e9
        };
        let pm = time(&mut || copy_page_major(&pool, &l, &runs, &mut out));
        let lm = time(&mut || copy_layer_major(&pool, &l, pages, &runs, &mut out));
        let copies = format!("{} / {}", runs.len(), runs.len() * l.num_layers * 2);
        println!("{run_len:>10} {:>6} {pm:>15.2} {lm:>16.2} {:>6.2} {copies:>19}", runs.len(), pm / lm);
    }
}

fn main() {
    let quick = std::env::var("FERRY_BENCH_QUICK").is_ok_and(|v| v == "1");
    if let Err(e) = throughput(quick) {
        eprintln!("throughput benchmark skipped: {e} (run `ferry model fetch smollm2-135m`)");
        std::process::exit(1);
    }
    page_copy(quick);
}
