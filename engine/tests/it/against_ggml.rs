//! Ferry against llama.cpp's own Python reference (gguf-py): dequantisation of every
//! supported type, and SmolLM2's greedy tokens and logprobs from an independent numpy
//! forward pass that keeps GGUF's Q/K layout and rotates adjacent pairs.

use crate::common::{load, pool, python_reference, rel_diff, smollm2};
use ferry_engine::dequant::{DType, dequantize};
use ferry_engine::{BatchOptions, Request, SamplingParams, SeqChunk, generate};
use ferry_tokenize::gguf::GgufFile;

#[test]
fn dequantisation_matches_gguf_py_for_every_supported_type() {
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path().to_str().expect("utf-8 path");
    python_reference("ggml_quants.py", &[d]);
    let file = GgufFile::open(&dir.path().join("quants.gguf")).expect("open");
    let mut seen = 0;
    for t in &file.header.tensors {
        let dtype = DType::from_ggml(t.ggml_type).expect("supported type");
        let n = t.elements as usize;
        let bytes = dtype.bytes_for(n).expect("whole blocks");
        let mut got = vec![0.0f32; n];
        dequantize(dtype, &file.bytes()[t.offset as usize..t.offset as usize + bytes], &mut got);
        let want: Vec<f32> = std::fs::read(dir.path().join(format!("{}.f32", t.name)))
            .expect("expected values")
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(got.len(), want.len(), "{}", t.name);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{} element {i}: {g} vs {w}", t.name);
        }
        seen += 1;
    }
    assert_eq!(seen, 7, "one tensor per supported type");
}

#[derive(serde::Deserialize)]
struct RefOut {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
}

#[test]
fn smollm2_greedy_tokens_match_an_independent_numpy_forward() {
    let path = smollm2();
    let model = load(&path);
    let prompt = model.tokenizer().encode("Once upon a time").expect("encode");
    assert_eq!(prompt.len(), 4, "{prompt:?}");
    let n = 24;
    let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let stdout =
        python_reference("smollm2_reference.py", &[path.to_str().expect("path"), &ids.join(","), &n.to_string()]);
    let want: RefOut = serde_json::from_str(&stdout).expect("reference json");
    let mut pool = pool(&model, 16, 8);
    let req = Request { prompt, params: SamplingParams { max_new_tokens: n, ignore_eos: true, ..Default::default() } };
    let got = generate(&model, &mut pool, &[req], BatchOptions::default()).expect("generate").remove(0);
    assert_eq!(got.tokens, want.tokens, "greedy tokens differ from the reference");
    for (i, (g, w)) in got.sampled.iter().zip(&want.logprobs).enumerate() {
        assert!((g.logprob - w).abs() < 2e-3, "token {i}: logprob {} vs {w}", g.logprob);
    }
    let text = model.tokenizer().decode(&got.tokens, true).expect("decode");
    let words =
        text.split_whitespace().filter(|w| w.chars().all(|c| c.is_ascii_alphabetic() || ",.;'".contains(c))).count();
    assert!(words >= 12, "not English-looking: {text:?}");
}

#[test]
fn smollm2_chunked_paged_prefill_matches_whole_prefill() {
    let model = load(&smollm2());
    let text = "The quick brown fox jumps over the lazy dog. Ferry moves KV pages between machines, chunk after chunk, \
                while the router keeps track of which prefill node holds which prefix.";
    let p = model.tokenizer().encode(text).expect("encode");
    assert!(p.len() > 30);
    let run = |chunk: usize, page: usize| {
        let mut pool = pool(&model, page, p.len().div_ceil(page));
        let alloc = pool.alloc(p.len().div_ceil(page)).expect("pages");
        let pages = alloc.pages().to_vec();
        let mut last = Vec::new();
        for start in (0..p.len()).step_by(chunk) {
            let end = (start + chunk).min(p.len());
            let mut out = model
                .forward(
                    &mut pool,
                    &[SeqChunk { tokens: &p[start..end], start, pages: &pages, logits: end == p.len() }],
                )
                .expect("forward");
            if end == p.len() {
                last = out.remove(0);
            }
        }
        last
    };
    let whole = run(p.len(), 16);
    for (chunk, page) in [(1, 1), (7, 16), (64, 64)] {
        let d = rel_diff(&run(chunk, page), &whole);
        assert!(d < 1e-4, "chunk {chunk} page {page}: {d}");
    }
}
