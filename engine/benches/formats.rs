//! Weight formats on the CPU backend (run: `cargo bench -p ferry-engine --bench formats`).
//!
//! One random Llama-shaped model (1,024 wide, MLP 2,816, 8 layers, 16 query and 4 KV heads;
//! every width whole blocks of 256, so the K formats apply) written as GGUF in F32, F16,
//! BF16, Q4_1, Q4_K and Q6_K, loaded in exact and fast math (the float formats in one: they
//! multiply alike in both). Per format and math: the matrices' bytes in
//! memory against their bytes in the file, prefill of a 64-token prompt, and decode tokens/s
//! at batch 1 and 8 (greedy, contexts 64–80), medians of several interleaved rounds, with
//! the ratio to F32 weights — what F16, BF16, Q4_K and Q6_K files were multiplied as before
//! the CPU kept them as they are (widened or dequantized to f32 at load).
//!
//! `FERRY_BENCH_QUICK=1`: one round of few steps (CI smoke). `FERRY_BENCH_FORMATS_DIR=DIR`
//! keeps the models as `DIR/formats-<ggml type>.gguf` (12: Q4_K, 14: Q6_K, …) for
//! `scripts/cpu-vs-llamacpp --model`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use ferry_engine::tiny::{TinySpec, write_gguf};
use ferry_engine::{Model, PagePool, SeqChunk};
use ferry_kernels::cpu::{CpuBackend, CpuMath};

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

const PROMPT: usize = 64;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The model in GGUF type `ty`.
fn write(dir: &Path, ty: u32) -> BenchResult<PathBuf> {
    let spec = TinySpec {
        hidden: 1024,
        ffn: 2816,
        layers: 8,
        heads: 16,
        kv_heads: 4,
        ctx: 4096,
        tie: false,
        merges: 200,
        gguf_matrix_type: ty,
        ..TinySpec::default()
    };
    let path = dir.join(format!("formats-{ty}.gguf"));
    write_gguf(&path, &spec)?;
    Ok(path)
}

/// (prefill tok/s at batch 1, decode tok/s at batch 1, at batch 8).
fn measure(model: &Model<CpuBackend>, steps: usize) -> BenchResult<(f64, f64, f64)> {
    let vocab = model.config().vocab_size as u32;
    let mut out = [0.0; 3];
    for (i, batch) in [1usize, 8].into_iter().enumerate() {
        let per_seq = (PROMPT + steps).div_ceil(16);
        let mut pool = PagePool::new(model.backend(), model.kv_layout(16), batch * per_seq)?;
        let allocs: Vec<_> = (0..batch).map(|_| pool.alloc(per_seq)).collect::<Result<_, _>>()?;
        let prompts: Vec<Vec<u32>> = (0..batch)
            .map(|b| (0..PROMPT as u32).map(|t| 3 + (t * 31 + b as u32 * 7) % (vocab - 3)).collect())
            .collect();
        let chunks: Vec<SeqChunk<'_>> = prompts
            .iter()
            .zip(&allocs)
            .map(|(p, a)| SeqChunk { tokens: p, start: 0, pages: a.pages(), logits: true })
            .collect();
        let t = Instant::now();
        let mut next: Vec<u32> = model.forward_greedy(&mut pool, &chunks)?.iter().map(|p| p.0).collect();
        if batch == 1 {
            out[0] = PROMPT as f64 / t.elapsed().as_secs_f64();
        }
        let t = Instant::now();
        for s in 0..steps {
            let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
            let chunks: Vec<SeqChunk<'_>> = toks
                .iter()
                .zip(&allocs)
                .map(|(t, a)| SeqChunk { tokens: t, start: PROMPT + s, pages: a.pages(), logits: true })
                .collect();
            next = model.forward_greedy(&mut pool, &chunks)?.iter().map(|p| p.0).collect();
        }
        out[1 + i] = (batch * steps) as f64 / t.elapsed().as_secs_f64();
    }
    Ok((out[0], out[1], out[2]))
}

fn main() -> BenchResult<()> {
    let quick = ferry_core::bench::quick();
    let (rounds, steps) = if quick { (1, 2) } else { (5, 16) };
    let tmp = tempfile::tempdir()?;
    let dir = std::env::var_os("FERRY_BENCH_FORMATS_DIR").map_or_else(|| tmp.path().to_path_buf(), PathBuf::from);
    let formats = [(0u32, "F32"), (1, "F16"), (30, "BF16"), (3, "Q4_1"), (12, "Q4_K"), (14, "Q6_K")];
    let mut models = Vec::new();
    for (ty, name) in formats {
        let path = write(&dir, ty)?;
        for math in [CpuMath::Exact, CpuMath::Fast] {
            if matches!(ty, 0 | 1 | 30) && math == CpuMath::Fast {
                continue; // float weights multiply alike in both modes
            }
            let model = Model::load(&path, CpuBackend::new(math))?;
            models.push((name, math, std::fs::metadata(&path)?.len() as f64, model));
        }
    }
    // Rounds interleave the models: a noisy minute touches each alike.
    let mut figures = vec![(Vec::new(), Vec::new(), Vec::new()); models.len()];
    for _ in 0..rounds {
        for ((_, _, _, model), f) in models.iter().zip(&mut figures) {
            let (p, d1, d8) = measure(model, steps)?;
            f.0.push(p);
            f.1.push(d1);
            f.2.push(d8);
        }
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("weight formats, 1024 wide × 8 layers (MLP 2816), CPU backend, {threads} threads, medians of {rounds}");
    println!(
        "{:<6} {:<6} {:>10} {:>8} {:>14} {:>8} {:>13} {:>8} {:>13} {:>8}",
        "format",
        "math",
        "matrix MB",
        "× file",
        "prefill tok/s",
        "vs f32",
        "decode b=1",
        "vs f32",
        "decode b=8",
        "vs f32"
    );
    let base: Vec<f64> = [&figures[0].0, &figures[0].1, &figures[0].2].iter().map(|v| median((*v).clone())).collect();
    for ((name, math, file, model), (p, d1, d8)) in models.iter().zip(figures) {
        let (p, d1, d8) = (median(p), median(d1), median(d8));
        let held = model.matrix_bytes() as f64;
        println!(
            "{name:<6} {math:<6} {:>10.1} {:>8.2} {p:>14.1} {:>7.2}× {d1:>13.1} {:>7.2}× {d8:>13.1} {:>7.2}×",
            held / 1e6,
            held / file,
            p / base[0],
            d1 / base[1],
            d8 / base[2]
        );
    }
    Ok(())
}
