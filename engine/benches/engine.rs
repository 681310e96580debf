//! Engine benchmarks, printed as tables (run: `cargo bench -p ferry-engine --bench engine`).
//!
//! 1. Prefill and decode tokens/s at batch 1, 8, 32 and 128 (median of several runs), on
//!    each backend of `FERRY_BENCH_DEVICES` (default `cpu`; `cpu,cuda` with `--features
//!    cuda` on a GPU machine, with the CUDA/CPU ratio), for SmolLM2-135M and, with
//!    `FERRY_BENCH_SHAPES=smollm2,llama3-8b`, a random model shaped like Llama-3-8B (4096
//!    wide, 32 layers, 32 query and 8 KV heads, MLP 14336, Q4_1 weights; a small vocabulary,
//!    so its LM head is cheap).
//! 2. Sampling one token from a 49,152-token vocabulary (SmolLM2's) in each of the sampler's
//!    modes, against a sort of the whole vocabulary (what temperature draws did before they
//!    selected partially), median µs per token.
//! 3. Copying page runs out of the KV pool into a send buffer, page-major (Ferry's layout:
//!    one copy per run) against layer-major (one copy per layer, K/V and run), same pages.
//!
//! Decode steps pick greedily on the backend (`Model::forward_greedy`, the decode daemon's
//! path for greedy requests), so a GPU returns a token per sequence, not a row of logits.
//! Each decode row also shows the bytes one step must read (every weight matrix once, in the
//! backend's storage type, plus the batch's KV) and that figure divided by the step's time:
//! on a GPU, compare it with the device's memory bandwidth, the bound of small batches.
//!
//! `FERRY_BENCH_QUICK=1` shortens both (batch 1, 8 and 32; for CI smoke runs). The model
//! comes from `FERRY_SMOLLM2` or the `ferry model fetch smollm2-135m` cache.
//! `FERRY_BENCH_8B_LAYERS=N` builds the Llama-3-8B shape with N of its 32 layers (generating
//! and loading all 8 B random weights takes minutes).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ferry_engine::tiny::{TinySpec, write_gguf};
use ferry_engine::{Model, PagePool, Sampler, SamplingParams, SeqChunk};
use ferry_kernels::cpu::CpuBackend;
use ferry_kernels::{Backend, KvLayout};

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

/// A random model shaped like Llama-3-8B (but for its vocabulary), written as GGUF Q4_1.
fn llama3_8b_shape(dir: &std::path::Path) -> BenchResult<PathBuf> {
    let spec = TinySpec {
        hidden: 4096,
        ffn: 14336,
        layers: std::env::var("FERRY_BENCH_8B_LAYERS").ok().and_then(|v| v.parse().ok()).unwrap_or(32),
        heads: 32,
        kv_heads: 8,
        ctx: 8192,
        tie: false,
        merges: 256,
        rope_scaling: true,
        gguf_matrix_type: 3,
        ..TinySpec::default()
    };
    let path = dir.join("llama3-8b-shape.gguf");
    write_gguf(&path, &spec)?;
    Ok(path)
}

/// (batch, prefill tokens/s, decode tokens/s).
type Row = (usize, f64, f64);

/// Bytes a decode step reads at `batch` with `context` tokens per sequence: every weight
/// matrix once (`weight_bytes` per value: 2 for bf16 on a GPU, 4 for the CPU's f32) and the
/// batch's K and V (f32) of every layer.
fn step_bytes(c: &ferry_engine::ModelConfig, weight_bytes: usize, batch: usize, context: usize) -> f64 {
    let (h, kv) = (c.hidden_size, c.num_kv_heads * c.head_dim);
    let q = c.num_heads * c.head_dim;
    let per_layer = h * (q + 2 * kv) + q * h + 3 * h * c.intermediate_size;
    let weights = c.num_layers * per_layer + c.vocab_size * h;
    let kv_bytes = batch * context * c.num_layers * 2 * kv * 4;
    (weights * weight_bytes + kv_bytes) as f64
}
type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Prefill and decode tokens/s per batch.
fn throughput<B: Backend>(model: &Model<B>, quick: bool) -> BenchResult<Vec<Row>> {
    let page: usize = 16;
    let prompt_len: usize = 64;
    let steps = if quick { 4 } else { 16 };
    let reps = if quick { 1 } else { 3 };
    let vocab = model.config().vocab_size as u32;
    // One pass before timing: lazy initialisation (cuBLAS heuristics, first allocations)
    // stays out of the figures.
    {
        let mut pool = PagePool::new(model.backend(), model.kv_layout(page), 8)?;
        let a = pool.alloc(1)?;
        let p: Vec<u32> = (3..11).collect();
        model.forward_greedy(&mut pool, &[SeqChunk { tokens: &p, start: 0, pages: a.pages(), logits: true }])?;
    }
    let batches: &[usize] = if quick { &[1, 8, 32] } else { &[1, 8, 32, 128] };
    let mut rows = Vec::new();
    for &batch in batches {
        let mut pre = Vec::new();
        let mut dec = Vec::new();
        for _ in 0..reps {
            let per_seq = (prompt_len + steps).div_ceil(page);
            let mut pool = PagePool::new(model.backend(), model.kv_layout(page), batch * per_seq)?;
            let allocs: Vec<_> = (0..batch).map(|_| pool.alloc(per_seq)).collect::<Result<_, _>>()?;
            let prompts: Vec<Vec<u32>> = (0..batch)
                .map(|b| (0..prompt_len as u32).map(|i| 3 + (1000 + i * 31 + b as u32 * 7) % (vocab - 3)).collect())
                .collect();
            let t = Instant::now();
            let chunks: Vec<SeqChunk<'_>> = prompts
                .iter()
                .zip(&allocs)
                .map(|(p, a)| SeqChunk { tokens: p, start: 0, pages: a.pages(), logits: true })
                .collect();
            let picks = model.forward_greedy(&mut pool, &chunks)?;
            pre.push((batch * prompt_len) as f64 / t.elapsed().as_secs_f64());
            let mut next: Vec<u32> = picks.iter().map(|p| p.0).collect();
            let t = Instant::now();
            decode_steps(model, &mut pool, &allocs, &mut next, prompt_len, steps)?;
            dec.push((batch * steps) as f64 / t.elapsed().as_secs_f64());
        }
        rows.push((batch, median(pre), median(dec)));
    }
    Ok(rows)
}

/// `steps` greedy decode steps of every sequence (one per page allocation), from position
/// `start`, `next` holding each sequence's input token (and, after, its last pick).
fn decode_steps<B: Backend>(
    model: &Model<B>,
    pool: &mut PagePool<B>,
    allocs: &[ferry_engine::PageAlloc],
    next: &mut Vec<u32>,
    start: usize,
    steps: usize,
) -> BenchResult<()> {
    for s in 0..steps {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let chunks: Vec<SeqChunk<'_>> = toks
            .iter()
            .zip(allocs)
            .map(|(t, a)| SeqChunk { tokens: t, start: start + s, pages: a.pages(), logits: true })
            .collect();
        *next = model.forward_greedy(pool, &chunks)?.iter().map(|p| p.0).collect();
    }
    Ok(())
}

/// Prints the rows; `bytes(batch)` is what one decode step reads at that batch.
fn print_rows(title: &str, rows: &[Row], baseline: Option<&[Row]>, bytes: &dyn Fn(usize) -> f64) {
    println!("{title}");
    println!(
        "{:>6} {:>16} {:>16} {:>18} {:>15} {:>14} {:>14} {:>12}",
        "batch",
        "prefill tok/s",
        "decode tok/s",
        "decode ms/step",
        "prefill ratio",
        "decode ratio",
        "MB read/step",
        "read GB/s"
    );
    for (i, &(batch, p, d)) in rows.iter().enumerate() {
        let (rp, rd) = match baseline.and_then(|b| b.get(i)) {
            Some(&(_, bp, bd)) => (format!("{:.1}x", p / bp), format!("{:.1}x", d / bd)),
            None => ("-".into(), "-".into()),
        };
        let step = batch as f64 / d;
        let b = bytes(batch);
        println!(
            "{batch:>6} {p:>16.1} {d:>16.1} {:>18.2} {rp:>15} {rd:>14} {:>14.1} {:>12.1}",
            step * 1e3,
            b / 1e6,
            b / step / 1e9
        );
    }
}

/// Decode steps run at contexts 64..80 (the bench's prompt and steps): 72 on average.
const DECODE_CONTEXT: usize = 72;

fn throughput_all(quick: bool) -> BenchResult<()> {
    let devices = std::env::var("FERRY_BENCH_DEVICES").unwrap_or_else(|_| "cpu".into());
    let shapes = std::env::var("FERRY_BENCH_SHAPES").unwrap_or_else(|_| "smollm2".into());
    let tmp = tempfile::tempdir()?;
    for shape in shapes.split(',') {
        let path = match shape {
            "smollm2" => model_path(),
            "llama3-8b" => llama3_8b_shape(tmp.path())?,
            s => return Err(format!("FERRY_BENCH_SHAPES: unknown shape {s} (smollm2, llama3-8b)").into()),
        };
        let mut cpu_rows = None;
        for device in devices.split(',') {
            match device {
                "cpu" => {
                    let model = Model::load(&path, CpuBackend::default())?;
                    let rows = throughput(&model, quick)?;
                    let title = format!(
                        "\n{shape} ({}), CPU backend, {} threads, prompt 64 tokens",
                        model.format_name(),
                        rayon_threads()
                    );
                    let c = model.config().clone();
                    print_rows(&title, &rows, None, &|b| step_bytes(&c, 4, b, DECODE_CONTEXT));
                    cpu_rows = Some(rows);
                }
                "cuda" => cuda(&path, shape, quick, cpu_rows.as_deref())?,
                d => return Err(format!("FERRY_BENCH_DEVICES: unknown device {d} (cpu, cuda)").into()),
            }
        }
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn cuda(path: &std::path::Path, shape: &str, quick: bool, cpu: Option<&[Row]>) -> BenchResult<()> {
    let backend = ferry_kernels::cuda::CudaBackend::new(0)?;
    let name = backend.device_name().to_string();
    let model = Model::load(path, backend)?;
    let rows = throughput(&model, quick)?;
    let c = model.config().clone();
    let title =
        format!("\n{shape} ({} layers), CUDA backend on {name} (ratios against the CPU run above)", c.num_layers);
    print_rows(&title, &rows, cpu, &|b| step_bytes(&c, 2, b, DECODE_CONTEXT));
    if std::env::var("FERRY_CUDA_PROFILE").is_ok_and(|v| v == "1") {
        for batch in [1, 128] {
            let steps = 8;
            let ops = profile_decode(&model, batch, steps, &|| {
                model.backend().take_profile().into_iter().map(|(op, t)| (op, t.calls, t.host, t.total)).collect()
            })?;
            print_profile(&format!("{shape}, decode at batch {batch}, per step"), &ops, steps);
        }
    }
    Ok(())
}

#[cfg(feature = "cuda")]
/// (operation, calls, host time, total time).
type OpRow = (String, u64, Duration, Duration);

#[cfg(feature = "cuda")]
/// Profiled decode steps: a prefill, the profile cleared, `steps` decode steps; what `take`
/// collected over them.
fn profile_decode<B: Backend>(
    model: &Model<B>,
    batch: usize,
    steps: usize,
    take: &dyn Fn() -> Vec<OpRow>,
) -> BenchResult<Vec<OpRow>> {
    let (page, prompt_len) = (16, 64);
    let vocab = model.config().vocab_size as u32;
    let per_seq = (prompt_len + steps).div_ceil(page);
    let mut pool = PagePool::new(model.backend(), model.kv_layout(page), batch * per_seq)?;
    let allocs: Vec<_> = (0..batch).map(|_| pool.alloc(per_seq)).collect::<Result<_, _>>()?;
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|b| (0..prompt_len as u32).map(|i| 3 + (i * 31 + b as u32 * 7) % (vocab - 3)).collect())
        .collect();
    let chunks: Vec<SeqChunk<'_>> = prompts
        .iter()
        .zip(&allocs)
        .map(|(p, a)| SeqChunk { tokens: p, start: 0, pages: a.pages(), logits: true })
        .collect();
    let mut next: Vec<u32> = model.forward_greedy(&mut pool, &chunks)?.iter().map(|p| p.0).collect();
    take();
    decode_steps(model, &mut pool, &allocs, &mut next, prompt_len, steps)?;
    Ok(take())
}

#[cfg(feature = "cuda")]
fn print_profile(title: &str, ops: &[OpRow], steps: usize) {
    let all: f64 = ops.iter().map(|o| o.3.as_secs_f64()).sum();
    println!("\n{title} (each operation synchronised alone; {:.2} ms in all)", all / steps as f64 * 1e3);
    println!("{:<24} {:>10} {:>14} {:>14} {:>7}", "operation", "calls", "host µs", "total µs", "share");
    let mut ops = ops.to_vec();
    ops.sort_by_key(|o| std::cmp::Reverse(o.3));
    for (op, calls, host, total) in ops {
        let per = |d: Duration| d.as_secs_f64() / steps as f64 * 1e6;
        println!(
            "{op:<24} {:>10.1} {:>14.1} {:>14.1} {:>6.1}%",
            calls as f64 / steps as f64,
            per(host),
            per(total),
            total.as_secs_f64() / all * 100.0
        );
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &std::path::Path, _: &str, _: bool, _: Option<&[Row]>) -> BenchResult<()> {
    Err("FERRY_BENCH_DEVICES=cuda needs `cargo bench --features cuda`".into())
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
    let quick = ferry_core::bench::quick();
    if let Err(e) = throughput_all(quick) {
        eprintln!("throughput benchmark failed: {e} (SmolLM2 comes from `ferry model fetch smollm2-135m`)");
        std::process::exit(1);
    }
    sampling(quick);
    page_copy(quick);
}

/// Median µs per sampled token in each mode, and the full sort of the vocabulary beside them.
fn sampling(quick: bool) {
    let vocab = 49_152;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    // Logits shaped like a model's: most tokens far below a few likely ones.
    let logits: Vec<f32> = (0..vocab)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 40) as f32 / (1u64 << 24) as f32;
            -12.0 * u * u + if u < 0.001 { 14.0 } else { 0.0 }
        })
        .collect();
    let runs = if quick { 30 } else { 300 };
    let time = |f: &mut dyn FnMut()| {
        let v: Vec<f64> = (0..runs)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        median(v)
    };
    let sort = time(&mut || {
        let mut c: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
        c.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        std::hint::black_box(&c);
    });
    println!("\nsampling one token of {vocab} (median µs; the full sort is what draws did before)");
    println!("{:<34} {:>9} {:>12}", "mode", "µs", "vs sort");
    println!("{:<34} {sort:>9.1} {:>12}", "sort of the vocabulary (baseline)", "1.00");
    type Set = fn(&mut SamplingParams);
    let modes: [(&str, Set); 5] = [
        ("greedy", |_| {}),
        ("temperature 0.8", |p| p.temperature = 0.8),
        ("temperature 0.8, top-p 0.95", |p| (p.temperature, p.top_p) = (0.8, 0.95)),
        ("temperature 0.8, top-k 50", |p| (p.temperature, p.top_k) = (0.8, 50)),
        ("temperature 0.8, min-p 0.05", |p| (p.temperature, p.min_p) = (0.8, 0.05)),
    ];
    for (name, set) in modes {
        let mut p = SamplingParams { seed: Some(1), ..Default::default() };
        set(&mut p);
        let mut s = Sampler::new(p, &[]);
        let us = time(&mut || {
            std::hint::black_box(s.sample(&mut logits.clone()));
        });
        println!("{name:<34} {us:>9.1} {:>11.2}×", us / sort);
    }
}
