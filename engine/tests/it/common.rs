//! Helpers shared by the engine's integration tests.

use std::path::{Path, PathBuf};

use ferry_engine::tiny::{TinySpec, write_gguf, write_hf};
use ferry_engine::{EngineError, Model, PagePool, SeqChunk};
use ferry_kernels::Backend;
use ferry_kernels::cpu::{CpuBackend, CpuMath};

/// A tiny model written to a temporary directory (kept alive by the returned guard).
pub struct TinyModel {
    pub dir: tempfile::TempDir,
}

impl TinyModel {
    pub fn new(spec: TinySpec) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        write_hf(&dir.path().join("hf"), &spec).expect("write hf");
        write_gguf(&dir.path().join("tiny.gguf"), &spec).expect("write gguf");
        Self { dir }
    }
    pub fn hf(&self) -> PathBuf {
        self.dir.path().join("hf")
    }
    pub fn gguf(&self) -> PathBuf {
        self.dir.path().join("tiny.gguf")
    }
}

pub fn load(path: &Path) -> Model<CpuBackend> {
    Model::load(path, CpuBackend::default()).expect("load model")
}

/// The tiny model of `spec` as each CPU engine variant computes it: f32 weights (its HF
/// copy), and Q4_1 blocks (its GGUF copy) multiplied in exact and in fast math.
pub fn variants(spec: TinySpec) -> Vec<(&'static str, Model<CpuBackend>)> {
    let f32s = TinyModel::new(spec.clone());
    let q4 = TinyModel::new(TinySpec { gguf_matrix_type: 3, ..spec });
    let with = |path: &Path, math| Model::load(path, CpuBackend::new(math)).expect("load model");
    vec![
        ("f32", load(&f32s.hf())),
        ("q4_1 exact", with(&q4.gguf(), CpuMath::Exact)),
        ("q4_1 fast", with(&q4.gguf(), CpuMath::Fast)),
    ]
}

/// A tiny model of `spec` widened to whole Q4_K / Q6_K blocks (256 wide, MLP 512) in each
/// K format and math: Q4_K and Q6_K blocks, exact and fast.
pub fn k_variants(spec: TinySpec) -> Vec<(&'static str, Model<CpuBackend>)> {
    let spec = TinySpec { hidden: 256, ffn: 512, ..spec };
    let with = |path: &Path, math| Model::load(path, CpuBackend::new(math)).expect("load model");
    let (q4k, q6k) = (
        TinyModel::new(TinySpec { gguf_matrix_type: 12, ..spec.clone() }),
        TinyModel::new(TinySpec { gguf_matrix_type: 14, ..spec }),
    );
    vec![
        ("q4_k exact", with(&q4k.gguf(), CpuMath::Exact)),
        ("q4_k fast", with(&q4k.gguf(), CpuMath::Fast)),
        ("q6_k exact", with(&q6k.gguf(), CpuMath::Exact)),
        ("q6_k fast", with(&q6k.gguf(), CpuMath::Fast)),
    ]
}

pub fn pool(model: &Model<CpuBackend>, page_size: usize, pages: usize) -> PagePool<CpuBackend> {
    PagePool::new(model.backend(), model.kv_layout(page_size), pages).expect("pool")
}

/// Runs every prompt whole in one batch, each asking for its last-token logits, through
/// `pass` (`Model::forward` or `Model::forward_greedy`) on a fresh pool of 16-token pages.
pub fn whole_prompts<B: Backend, T>(
    model: &Model<B>,
    prompts: &[Vec<u32>],
    pass: impl FnOnce(&Model<B>, &mut PagePool<B>, &[SeqChunk<'_>]) -> Result<Vec<T>, EngineError>,
) -> Vec<T> {
    let need: usize = prompts.iter().map(|p| p.len().div_ceil(16)).sum();
    let mut pool = PagePool::new(model.backend(), model.kv_layout(16), need + 1).expect("pool");
    let allocs: Vec<_> = prompts.iter().map(|p| pool.alloc(p.len().div_ceil(16)).expect("pages")).collect();
    let batch: Vec<SeqChunk<'_>> = prompts
        .iter()
        .zip(&allocs)
        .map(|(p, a)| SeqChunk { tokens: p, start: 0, pages: a.pages(), logits: true })
        .collect();
    pass(model, &mut pool, &batch).expect("forward")
}

/// Largest |a − b| relative to the largest |b| (at least 1).
pub fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Deterministic prompt ids in `3..vocab` (no control tokens).
pub fn prompt(len: usize, seed: u32, vocab: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 3 + (i.wrapping_mul(2654435761).wrapping_add(seed.wrapping_mul(40503)) >> 7) % (vocab as u32 - 3))
        .collect()
}

/// Path of the SmolLM2 GGUF: `FERRY_SMOLLM2` or the `ferry model fetch` cache.
pub fn smollm2() -> PathBuf {
    if let Ok(p) = std::env::var("FERRY_SMOLLM2") {
        return PathBuf::from(p);
    }
    let cache = std::env::var("FERRY_CACHE_DIR").map(PathBuf::from).unwrap_or_else(|_| {
        PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into())).join(".cache/ferry")
    });
    let p = cache.join("models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.exists(), "{} is missing: run `cargo run -p ferry -- model fetch smollm2-135m` first", p.display());
    p
}

/// Runs one of the Python reference scripts in `tests/reference/` and returns its stdout.
/// They need `pip install gguf numpy` (done by `.ci/run`).
pub fn python_reference(script: &str, args: &[&str]) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference").join(script);
    let out = std::process::Command::new(std::env::var("FERRY_PYTHON").unwrap_or_else(|_| "python3".into()))
        .arg(&path)
        .args(args)
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "{script} failed (needs `pip install gguf numpy`): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}
