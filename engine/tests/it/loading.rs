//! Model loading paths beyond the single-file case: sharded safetensors with an index,
//! half-precision tensors, HF configs of other families.

use std::collections::BTreeMap;

use crate::common::{TinyModel, load, pool, prompt, rel_diff};
use ferry_engine::tiny::TinySpec;
use ferry_engine::{Arch, ModelConfig, SeqChunk};

fn last_logits(model: &ferry_engine::Model<ferry_kernels::cpu::CpuBackend>, ids: &[u32]) -> Vec<f32> {
    let mut pool = pool(model, 16, 8);
    let a = pool.alloc(ids.len().div_ceil(16)).expect("pages");
    let pages = a.pages().to_vec();
    model
        .forward(&mut pool, &[SeqChunk { tokens: ids, start: 0, pages: &pages, logits: true }])
        .expect("forward")
        .remove(0)
}

/// Rewrites `model.safetensors` as `dtype` shards of about `n` tensors each plus an index.
fn reshard(dir: &std::path::Path, shards: usize, half: bool) {
    let bytes = std::fs::read(dir.join("model.safetensors")).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    let mut weight_map = BTreeMap::new();
    let per = names.len().div_ceil(shards);
    for (i, chunk) in names.chunks(per).enumerate() {
        let file = format!("model-{:05}-of-{shards:05}.safetensors", i + 1);
        let data: Vec<(String, Vec<u8>, Vec<usize>)> = chunk
            .iter()
            .map(|n| {
                let v = st.tensor(n).expect("tensor");
                let f: Vec<f32> =
                    v.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
                let raw = if half {
                    f.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect()
                } else {
                    f.iter().flat_map(|x| x.to_le_bytes()).collect()
                };
                (n.clone(), raw, v.shape().to_vec())
            })
            .collect();
        let dtype = if half { safetensors::Dtype::BF16 } else { safetensors::Dtype::F32 };
        let views: Vec<_> = data
            .iter()
            .map(|(n, raw, shape)| {
                (n.clone(), safetensors::tensor::TensorView::new(dtype, shape.clone(), raw).expect("view"))
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(&file)).expect("write shard");
        for n in chunk {
            weight_map.insert(n.clone(), file.clone());
        }
    }
    std::fs::remove_file(dir.join("model.safetensors")).expect("remove");
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).expect("index");
}

#[test]
fn sharded_safetensors_load_like_one_file() {
    let single = TinyModel::new(TinySpec::default());
    let sharded = TinyModel::new(TinySpec::default());
    reshard(&sharded.hf(), 3, false);
    let a = load(&single.hf());
    let b = load(&sharded.hf());
    let ids = prompt(20, 2, a.config().vocab_size);
    assert_eq!(last_logits(&a, &ids), last_logits(&b, &ids));
}

/// GGUF matrices stay as the file has them on the CPU: Q4_1 repacked in at most 4/3 of the
/// file's bytes, Q4_K in 1.06× where the CPU takes tiled weights (AVX2, AVX-512), 4/3
/// elsewhere, Q6_K in 1.01× (f32 would be 6–7× the file); F16, BF16 and F32 as they are.
#[test]
fn quantized_matrices_stay_quantized_in_memory() {
    #[cfg(target_arch = "x86_64")]
    let tiled = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    let tiled = false;
    let q4k = if tiled { 1.06 } else { 1.34 };
    for (ty, most) in [(3u32, 1.34), (12, q4k), (14, 1.01), (1, 1.0), (30, 1.0), (0, 1.0)] {
        let tiny =
            TinyModel::new(TinySpec { gguf_matrix_type: ty, hidden: 256, ffn: 512, tie: false, ..TinySpec::default() });
        let file = std::fs::metadata(tiny.gguf()).expect("file").len() as f64;
        for math in [ferry_kernels::cpu::CpuMath::Exact, ferry_kernels::cpu::CpuMath::Fast] {
            let model =
                ferry_engine::Model::load(&tiny.gguf(), ferry_kernels::cpu::CpuBackend::new(math)).expect("load");
            let held = model.matrix_bytes() as f64;
            assert!(
                held <= most * file && held >= 0.5 * file,
                "type {ty} {math}: {held} bytes held for a {file}-byte file"
            );
        }
    }
}

#[test]
fn bf16_weights_load_and_stay_close() {
    let f32m = TinyModel::new(TinySpec::default());
    let bf16m = TinyModel::new(TinySpec::default());
    reshard(&bf16m.hf(), 2, true);
    let a = load(&f32m.hf());
    let b = load(&bf16m.hf());
    let ids = prompt(20, 2, a.config().vocab_size);
    let d = rel_diff(&last_logits(&b, &ids), &last_logits(&a, &ids));
    assert!(d > 0.0 && d < 0.05, "bf16 rounding should move logits a little: {d}");
    // The bf16 matrices stay bf16 in memory: half the f32 copy's bytes.
    assert_eq!(2 * b.matrix_bytes(), a.matrix_bytes());
}

#[test]
fn hf_configs_of_other_families_parse() {
    let dir = tempfile::tempdir().expect("tmp");
    let write = |j: serde_json::Value| {
        let p = dir.path().join("config.json");
        std::fs::write(&p, j.to_string()).expect("write");
        ModelConfig::from_hf_json(&p)
    };
    // Llama 3.1: GQA, rope_scaling llama3, untied.
    let c = write(serde_json::json!({"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, "tie_word_embeddings": false}))
    .expect("llama3");
    assert_eq!((c.head_dim, c.num_kv_heads, c.tie_word_embeddings), (128, 8, false));
    assert!(c.rope_scaling.is_some());
    let c = write(serde_json::json!({"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}))
    .expect("mistral");
    assert_eq!(c.arch, Arch::Mistral);
    let c = write(serde_json::json!({"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "tie_word_embeddings": true}))
    .expect("qwen2");
    assert!(c.qkv_bias && c.tie_word_embeddings);
    let e = write(serde_json::json!({"model_type": "gpt_neox", "vocab_size": 10})).expect_err("unsupported");
    assert!(e.to_string().contains("gpt_neox"), "{e}");
    let e = write(serde_json::json!({"model_type": "llama", "vocab_size": 10, "hidden_size": 64,
        "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 3, "num_key_value_heads": 2}))
    .expect_err("inconsistent");
    assert!(e.to_string().contains("inconsistent"), "{e}");
}
