//! A deterministic tiny random Llama-family model, written as an HF directory and as GGUF,
//! so tests need no download.
//!
//! The tokenizer is a real byte-level BPE (GPT-2 byte alphabet, merges learnt from a fixed
//! text, ChatML control tokens at ids 0–2) with SmolLM2's pre-tokenizer (digits split one by
//! one). The GGUF copy stores Q/K rows permuted the way llama.cpp's converter does, so loading
//! both copies and comparing logits checks the un-permutation.

use std::collections::HashMap;
use std::path::Path;

use ferry_tokenize::gguf::Value;
use ferry_tokenize::gguf_write::{self, TensorData};
use serde_json::json;

use crate::config::Arch;
use crate::dequant::{DType, dequantize, quantize_q4_1, quantize_q4_k, quantize_q6_k, quantize_q8_0};
use crate::source::{GgufSource, permute_rows};

/// The tiny model's shape.
#[derive(Debug, Clone)]
pub struct TinySpec {
    /// Llama or Qwen2 (Q/K/V biases).
    pub arch: Arch,
    /// Model width.
    pub hidden: usize,
    /// MLP width.
    pub ffn: usize,
    /// Blocks.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Context length.
    pub ctx: usize,
    /// Share the LM head with the embedding.
    pub tie: bool,
    /// BPE merges to learn (vocabulary = 3 control tokens + 256 bytes + merges).
    pub merges: usize,
    /// Llama-3 RoPE scaling in the HF config.
    pub rope_scaling: bool,
    /// GGUF type for matrices (0 = F32, 1 = F16, 30 = BF16, 8 = Q8_0, 3 = Q4_1, 12 = Q4_K,
    /// 14 = Q6_K: widths then whole blocks of 256). The HF copy then holds the dequantised values, so both copies
    /// describe the same weights.
    pub gguf_matrix_type: u32,
    /// Seed of the weights.
    pub seed: u64,
    /// The GGUF's `tokenizer.ggml.pre` (pre-tokenizer): `smollm`, `llama-bpe`, `qwen2`, `gpt2`.
    pub tokenizer_pre: &'static str,
}

impl Default for TinySpec {
    fn default() -> Self {
        Self {
            arch: Arch::Llama,
            hidden: 64,
            ffn: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            ctx: 2048,
            tie: true,
            merges: 100,
            rope_scaling: false,
            gguf_matrix_type: 0,
            seed: 42,
            tokenizer_pre: "smollm",
        }
    }
}

/// Text the BPE merges are learnt from.
const CORPUS: &str = "Once upon a time there was a little ferry that carried people across the river. \
Every morning the ferry left the dock at seven, and every evening it came back with the sun. \
The people of the town loved the ferry, and the ferry loved the river. Numbers like 2024 and 42 \
are split into digits. Hello world! The quick brown fox jumps over the lazy dog.";

const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}\
{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// GPT-2's byte → printable character map.
pub fn bytes_to_unicode() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut map = vec![' '; 256];
    for (b, c) in bs.iter().zip(cs) {
        map[*b as usize] = char::from_u32(c).unwrap_or(' ');
    }
    map
}

/// Vocabulary (id order) and merges of the tiny tokenizer.
fn learn_bpe(n_merges: usize) -> (Vec<String>, Vec<(String, String)>) {
    let map = bytes_to_unicode();
    let mut vocab: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    vocab.extend((0..256).map(|b| map[b].to_string()));
    // Words as the GPT-2 regex would roughly split them: a leading space joins the word.
    let mut words: Vec<Vec<String>> = Vec::new();
    for (i, w) in CORPUS.split(' ').enumerate() {
        let w = if i == 0 { w.to_string() } else { format!(" {w}") };
        words.push(w.bytes().map(|b| map[b as usize].to_string()).collect());
    }
    let mut merges = Vec::new();
    for _ in 0..n_merges {
        let mut counts: HashMap<(String, String), usize> = HashMap::new();
        for w in &words {
            for p in w.windows(2) {
                *counts.entry((p[0].clone(), p[1].clone())).or_default() += 1;
            }
        }
        let Some(best) = counts.into_iter().max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(&a.0))).map(|(p, _)| p)
        else {
            break;
        };
        let joined = format!("{}{}", best.0, best.1);
        for w in &mut words {
            let mut i = 0;
            while i + 1 < w.len() {
                if w[i] == best.0 && w[i + 1] == best.1 {
                    w[i] = joined.clone();
                    w.remove(i + 1);
                }
                i += 1;
            }
        }
        vocab.push(joined);
        merges.push(best);
    }
    (vocab, merges)
}

/// SplitMix64: a tiny, stable pseudo-random stream.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn fill(&mut self, n: usize, scale: f32, offset: f32) -> Vec<f32> {
        (0..n).map(|_| offset + scale * self.next()).collect()
    }
}

/// One tensor of the tiny model, HF name and layout.
struct Named {
    name: String,
    shape: Vec<usize>,
    data: Vec<f32>,
}

fn tensors(spec: &TinySpec, vocab: usize) -> Vec<Named> {
    let mut rng = Rng(spec.seed);
    let (d, hd) = (spec.hidden, spec.hidden / spec.heads);
    let (q, kv, ff) = (spec.heads * hd, spec.kv_heads * hd, spec.ffn);
    let mut out = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32, rng: &mut Rng| {
        let n = shape.iter().product();
        out.push(Named { name, shape, data: rng.fill(n, scale, offset) });
    };
    let ws = 1.0 / (d as f32).sqrt();
    add("model.embed_tokens.weight".into(), vec![vocab, d], 1.0, 0.0, &mut rng);
    for i in 0..spec.layers {
        let p = format!("model.layers.{i}");
        add(format!("{p}.input_layernorm.weight"), vec![d], 0.2, 1.0, &mut rng);
        add(format!("{p}.self_attn.q_proj.weight"), vec![q, d], 2.0 * ws, 0.0, &mut rng);
        add(format!("{p}.self_attn.k_proj.weight"), vec![kv, d], 2.0 * ws, 0.0, &mut rng);
        add(format!("{p}.self_attn.v_proj.weight"), vec![kv, d], ws, 0.0, &mut rng);
        if spec.arch == Arch::Qwen2 {
            add(format!("{p}.self_attn.q_proj.bias"), vec![q], 0.1, 0.0, &mut rng);
            add(format!("{p}.self_attn.k_proj.bias"), vec![kv], 0.1, 0.0, &mut rng);
            add(format!("{p}.self_attn.v_proj.bias"), vec![kv], 0.1, 0.0, &mut rng);
        }
        add(format!("{p}.self_attn.o_proj.weight"), vec![d, q], ws, 0.0, &mut rng);
        add(format!("{p}.post_attention_layernorm.weight"), vec![d], 0.2, 1.0, &mut rng);
        add(format!("{p}.mlp.gate_proj.weight"), vec![ff, d], ws, 0.0, &mut rng);
        add(format!("{p}.mlp.up_proj.weight"), vec![ff, d], ws, 0.0, &mut rng);
        add(format!("{p}.mlp.down_proj.weight"), vec![d, ff], 1.0 / (ff as f32).sqrt(), 0.0, &mut rng);
    }
    add("model.norm.weight".into(), vec![d], 0.2, 1.0, &mut rng);
    if !spec.tie {
        add("lm_head.weight".into(), vec![vocab, d], ws, 0.0, &mut rng);
    }
    // Quantise matrices once so that the HF copy holds exactly what the GGUF copy decodes to.
    for t in &mut out {
        if t.shape.len() == 2 && spec.gguf_matrix_type != 0 {
            let (dtype, bytes) = quantize(spec.gguf_matrix_type, &t.data);
            dequantize(dtype, &bytes, &mut t.data);
        }
    }
    out
}

fn quantize(ty: u32, x: &[f32]) -> (DType, Vec<u8>) {
    match ty {
        8 => (DType::Q8_0, quantize_q8_0(x)),
        3 => (DType::Q4_1, quantize_q4_1(x)),
        1 => (DType::F16, x.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect()),
        30 => (DType::BF16, x.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect()),
        12 => (DType::Q4K, quantize_q4_k(x)),
        14 => (DType::Q6K, quantize_q6_k(x)),
        _ => (DType::F32, x.iter().flat_map(|v| v.to_le_bytes()).collect()),
    }
}

fn io(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// Writes the HF directory: `config.json`, `model.safetensors`, `tokenizer.json`,
/// `tokenizer_config.json`, `generation_config.json`.
pub fn write_hf(dir: &Path, spec: &TinySpec) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let (vocab, merges) = learn_bpe(spec.merges);
    let n_vocab = vocab.len();
    let ts = tensors(spec, n_vocab);
    let mut config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": if spec.arch == Arch::Qwen2 { "qwen2" } else { "llama" },
        "vocab_size": n_vocab, "hidden_size": spec.hidden, "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": spec.ctx,
        "tie_word_embeddings": spec.tie, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    });
    if spec.rope_scaling {
        config["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
    }
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(&config).map_err(io)?)?;
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = ts
        .iter()
        .map(|t| (t.name.clone(), t.data.iter().flat_map(|v| v.to_le_bytes()).collect(), t.shape.clone()))
        .collect();
    let views = bytes
        .iter()
        .map(|(n, b, s)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(io)
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).map_err(io)?;
    let vocab_map: serde_json::Map<String, serde_json::Value> =
        vocab.iter().enumerate().map(|(i, t)| (t.clone(), json!(i))).collect();
    let added: Vec<_> = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, s)| json!({"id": i, "content": s, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab_map, "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()},
    });
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_vec(&tokenizer).map_err(io)?)?;
    let tcfg = json!({"add_bos_token": false, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML});
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_vec_pretty(&tcfg).map_err(io)?)?;
    let gcfg = json!({"bos_token_id": 1, "eos_token_id": 2});
    std::fs::write(dir.join("generation_config.json"), serde_json::to_vec_pretty(&gcfg).map_err(io)?)?;
    Ok(())
}

/// Writes the same model as a GGUF file (llama.cpp's names, dims and Q/K permutation).
pub fn write_gguf(path: &Path, spec: &TinySpec) -> std::io::Result<()> {
    let (vocab, merges) = learn_bpe(spec.merges);
    let ts = tensors(spec, vocab.len());
    let arch = if spec.arch == Arch::Qwen2 { "qwen2" } else { "llama" };
    let s = |v: &str| Value::Str(v.to_string());
    let u = |v: usize| Value::U64(v as u64);
    let k = |key: &str| format!("{arch}.{key}");
    let md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), s(arch)),
        ("general.name".into(), s("ferry-tiny")),
        (k("context_length"), u(spec.ctx)),
        (k("embedding_length"), u(spec.hidden)),
        (k("feed_forward_length"), u(spec.ffn)),
        (k("block_count"), u(spec.layers)),
        (k("attention.head_count"), u(spec.heads)),
        (k("attention.head_count_kv"), u(spec.kv_heads)),
        (k("rope.freq_base"), Value::F64(10000.0)),
        (k("rope.dimension_count"), u(spec.hidden / spec.heads)),
        (k("attention.layer_norm_rms_epsilon"), Value::F64(1e-5)),
        ("tokenizer.ggml.model".into(), s("gpt2")),
        ("tokenizer.ggml.pre".into(), s(spec.tokenizer_pre)),
        ("tokenizer.ggml.tokens".into(), Value::Array(vocab.iter().map(|t| s(t)).collect())),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array((0..vocab.len()).map(|i| Value::I64(if i < SPECIALS.len() { 3 } else { 1 })).collect()),
        ),
        ("tokenizer.ggml.merges".into(), Value::Array(merges.iter().map(|(a, b)| s(&format!("{a} {b}"))).collect())),
        ("tokenizer.ggml.bos_token_id".into(), u(1)),
        ("tokenizer.ggml.eos_token_id".into(), u(2)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
        ("tokenizer.chat_template".into(), s(CHATML)),
    ];
    let hd = spec.hidden / spec.heads;
    let mut out = Vec::new();
    for t in ts {
        let Some(name) = GgufSource::gguf_name(&t.name) else { continue };
        let mut data = t.data;
        if arch == "llama" && (name.ends_with("attn_q.weight") || name.ends_with("attn_k.weight")) {
            let heads = if name.ends_with("attn_q.weight") { spec.heads } else { spec.kv_heads };
            debug_assert_eq!(t.shape[0], heads * hd);
            data = permute_rows(&data, heads, t.shape[1]);
        }
        let ty = if t.shape.len() == 2 { spec.gguf_matrix_type } else { 0 };
        let (_, bytes) = quantize(ty, &data);
        let dims = t.shape.iter().rev().map(|&d| d as u64).collect();
        out.push(TensorData { name, dims, ggml_type: ty, data: bytes });
    }
    gguf_write::write(path, &md, &out)
}
