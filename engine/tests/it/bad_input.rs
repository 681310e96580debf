//! Bad input gives a clear error naming the problem, never a panic.

use crate::common::{TinyModel, load, pool};
use ferry_engine::tiny::TinySpec;
use ferry_engine::{BatchOptions, EngineError, Model, Request, SamplingParams, generate};
use ferry_kernels::cpu::CpuBackend;
use ferry_tokenize::gguf::Value;
use ferry_tokenize::gguf_write::{self, TensorData};

fn load_err(path: &std::path::Path) -> String {
    match Model::load(path, CpuBackend::default()) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_model_paths_are_named() {
    let dir = tempfile::tempdir().expect("tmp");
    let e = load_err(&dir.path().join("nope.gguf"));
    assert!(e.contains("model not found") && e.contains("nope.gguf"), "{e}");
    let e = load_err(dir.path());
    assert!(e.contains("no config.json"), "{e}");
}

#[test]
fn truncated_files_are_refused() {
    let tiny = TinyModel::new(TinySpec::default());
    let bytes = std::fs::read(tiny.gguf()).expect("read");
    let cut = tiny.dir.path().join("cut.gguf");
    for len in [0, 3, 20, 200, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&cut, &bytes[..len]).expect("write");
        let e = load_err(&cut);
        assert!(e.contains("invalid model file") && e.contains("cut.gguf"), "len {len}: {e}");
    }
    let st = tiny.hf().join("model.safetensors");
    let b = std::fs::read(&st).expect("read");
    std::fs::write(&st, &b[..b.len() / 2]).expect("write");
    let e = load_err(&tiny.hf());
    assert!(e.contains("model.safetensors"), "{e}");
}

/// The tiny model's GGUF with tensor `name` changed by `edit`, written as `file`.
fn with_tensor(tiny: &TinyModel, name: &str, file: &str, edit: impl Fn(&mut TensorData)) -> std::path::PathBuf {
    let gguf = ferry_tokenize::gguf::GgufFile::open(&tiny.gguf()).expect("open");
    let md: Vec<(String, Value)> = gguf.header.metadata.clone().into_iter().collect();
    let tensors: Vec<TensorData> = gguf
        .header
        .tensors
        .iter()
        .map(|t| {
            let (bs, _) = ferry_tokenize::gguf::type_block(t.ggml_type).expect("known");
            let len = t.elements as usize * bs;
            let mut td = TensorData {
                name: t.name.clone(),
                dims: t.dims.clone(),
                ggml_type: t.ggml_type,
                data: gguf.bytes()[t.offset as usize..t.offset as usize + len].to_vec(),
            };
            if t.name == name {
                edit(&mut td);
            }
            td
        })
        .collect();
    let path = tiny.dir.path().join(file);
    gguf_write::write(&path, &md, &tensors).expect("write");
    path
}

#[test]
fn unsupported_tensor_types_are_named() {
    let tiny = TinyModel::new(TinySpec::default());
    // Re-type the first Q projection as Q5_0 (type 6): same block count, unsupported here.
    let path = with_tensor(&tiny, "blk.0.attn_q.weight", "q5.gguf", |td| {
        let elements: u64 = td.dims.iter().product();
        td.ggml_type = 6;
        td.data.truncate(elements as usize / 32 * 22);
    });
    let e = load_err(&path);
    assert!(e.contains("Q5_0") && e.contains("blk.0.attn_q.weight"), "{e}");
}

/// A Q or K projection that cannot be split into its heads (zero-sized: the row permutation
/// divided by zero) is refused naming the tensor.
#[test]
fn q_and_k_projections_that_do_not_split_into_heads_are_refused() {
    let tiny = TinyModel::new(TinySpec::default());
    // (tensor, dims [in, out], what the error names): a zero-sized out dimension splits into
    // empty heads and is caught by the shape check, under the tensor's HF name.
    let cases = [
        ("blk.0.attn_q.weight", [0u64, 64], "blk.0.attn_q.weight"),
        ("blk.1.attn_k.weight", [64, 0], "layers.1.self_attn.k_proj"),
        ("blk.0.attn_k.weight", [64, 3], "blk.0.attn_k.weight"),
    ];
    for (name, dims, named) in cases {
        let path = with_tensor(&tiny, name, "bad-qk.gguf", |td| {
            let elements: u64 = dims.iter().product();
            let (bs, _) = ferry_tokenize::gguf::type_block(td.ggml_type).expect("known");
            td.dims = dims.to_vec();
            td.data.truncate(elements as usize * bs);
        });
        let e = load_err(&path);
        assert!(e.contains(named), "{name} {dims:?}: {e}");
    }
}

#[test]
fn bad_requests_are_refused_and_leave_the_pool_whole() {
    let tiny = TinyModel::new(TinySpec { ctx: 64, ..TinySpec::default() });
    let model = load(&tiny.hf());
    let mut pool = pool(&model, 16, 16);
    let vocab = model.config().vocab_size as u32;
    let cases: Vec<(Vec<u32>, SamplingParams, &str)> = vec![
        (vec![], SamplingParams::default(), "empty"),
        (vec![5; 64], SamplingParams::default(), "context"),
        (vec![5, vocab], SamplingParams::default(), "outside the vocabulary"),
        (vec![5], SamplingParams { temperature: -1.0, ..Default::default() }, "temperature"),
        (vec![5], SamplingParams { top_p: 1.5, ..Default::default() }, "top_p"),
    ];
    for (prompt, params, needle) in cases {
        let good =
            Request { prompt: vec![7, 8, 9], params: SamplingParams { max_new_tokens: 2, ..Default::default() } };
        let bad = Request { prompt, params };
        let e = generate(&model, &mut pool, &[good, bad], BatchOptions::default()).expect_err("refused");
        assert!(e.to_string().contains(needle), "{needle}: {e}");
        assert!(matches!(e, EngineError::InvalidRequest(_) | EngineError::Sampling(_)));
        assert_eq!(pool.free_pages(), 16);
    }
    // A long generation stops at the context length rather than failing.
    let req = Request {
        prompt: vec![5; 60],
        params: SamplingParams { max_new_tokens: 100, ignore_eos: true, ..Default::default() },
    };
    let out = generate(&model, &mut pool, &[req], BatchOptions::default()).expect("runs");
    assert_eq!(out[0].tokens.len(), 4);
    assert_eq!(out[0].finish, ferry_engine::FinishReason::Length);
    assert_eq!(pool.free_pages(), 16);
}
