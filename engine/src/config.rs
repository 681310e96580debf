//! The architecture of a Llama-family model, read from HF `config.json` or GGUF metadata.

use std::path::Path;

use ferry_kernels::RopeScaling;
use ferry_tokenize::gguf::{GgufHeader, MetadataExt, Value};
use serde_json::Value as Json;

use crate::EngineError;

/// Architectures the engine runs; they differ only in details of the same forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3, SmolLM2, TinyLlama.
    Llama,
    /// Mistral (Llama with sliding-window metadata; full attention here).
    Mistral,
    /// Qwen2: biases on Q, K and V.
    Qwen2,
}

impl Arch {
    /// The architecture named by HF `model_type` or GGUF `general.architecture`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Self::Llama),
            "mistral" => Some(Self::Mistral),
            "qwen2" => Some(Self::Qwen2),
            _ => None,
        }
    }
}

/// Model hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Architecture.
    pub arch: Arch,
    /// Embedding rows.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// MLP inner width.
    pub intermediate_size: usize,
    /// Transformer blocks.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// RoPE base.
    pub rope_theta: f32,
    /// Llama-3 RoPE scaling, when present.
    pub rope_scaling: Option<RopeScaling>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Context length.
    pub max_position_embeddings: usize,
    /// LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Q, K and V projections carry biases.
    pub qkv_bias: bool,
}

impl ModelConfig {
    /// Reads an HF `config.json`.
    pub fn from_hf_json(path: &Path) -> Result<Self, EngineError> {
        let bytes = std::fs::read(path).map_err(|source| EngineError::Io { path: path.to_path_buf(), source })?;
        let j: Json = serde_json::from_slice(&bytes).map_err(|e| EngineError::invalid(path, e.to_string()))?;
        let model_type = j.get("model_type").and_then(Json::as_str).unwrap_or("llama");
        let arch = Arch::from_name(model_type).ok_or_else(|| {
            EngineError::Unsupported(format!("model_type {model_type:?} (supported: llama, mistral, qwen2)"))
        })?;
        let num = |k: &str| -> Result<usize, EngineError> {
            j.get(k)
                .and_then(Json::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| EngineError::invalid(path, format!("{k} missing")))
        };
        let float = |k: &str, d: f64| j.get(k).and_then(Json::as_f64).unwrap_or(d) as f32;
        let hidden = num("hidden_size")?;
        let heads = num("num_attention_heads")?;
        let rope_scaling = match j.get("rope_scaling") {
            Some(s) if s.get("rope_type").or_else(|| s.get("type")).and_then(Json::as_str) == Some("llama3") => {
                let f = |k: &str| s.get(k).and_then(Json::as_f64).map(|v| v as f32);
                Some(RopeScaling {
                    factor: f("factor").unwrap_or(8.0),
                    low_freq_factor: f("low_freq_factor").unwrap_or(1.0),
                    high_freq_factor: f("high_freq_factor").unwrap_or(4.0),
                    original_max_position_embeddings: f("original_max_position_embeddings").unwrap_or(8192.0),
                })
            }
            Some(Json::Null) | None => None,
            Some(other) => return Err(EngineError::Unsupported(format!("rope_scaling {other}"))),
        };
        let cfg = Self {
            arch,
            vocab_size: num("vocab_size")?,
            hidden_size: hidden,
            intermediate_size: num("intermediate_size")?,
            num_layers: num("num_hidden_layers")?,
            num_heads: heads,
            num_kv_heads: num("num_key_value_heads").unwrap_or(heads),
            head_dim: num("head_dim").unwrap_or(hidden / heads.max(1)),
            rope_theta: float("rope_theta", 10000.0),
            rope_scaling,
            rms_norm_eps: float("rms_norm_eps", 1e-6),
            max_position_embeddings: num("max_position_embeddings").unwrap_or(4096),
            tie_word_embeddings: j.get("tie_word_embeddings").and_then(Json::as_bool).unwrap_or(false),
            qkv_bias: arch == Arch::Qwen2 || j.get("attention_bias").and_then(Json::as_bool).unwrap_or(false),
        };
        if !cfg.consistent() {
            return Err(EngineError::invalid(path, format!("inconsistent architecture: {cfg:?}")));
        }
        Ok(cfg)
    }

    /// Reads GGUF `<arch>.*` metadata. `tie_word_embeddings` is set by the loader from the
    /// presence of `output.weight`.
    pub fn from_gguf(h: &GgufHeader, path: &Path) -> Result<Self, EngineError> {
        let md = &h.metadata;
        let arch_name = md.req_str("general.architecture")?;
        let arch = Arch::from_name(arch_name).ok_or_else(|| {
            EngineError::Unsupported(format!("GGUF architecture {arch_name:?} (supported: llama, mistral, qwen2)"))
        })?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let num = |k: &str| md.req_u64(&key(k)).map(|v| v as usize);
        let float = |k: &str, d: f64| md.get(&key(k)).and_then(Value::as_f64).unwrap_or(d) as f32;
        let hidden = num("embedding_length")?;
        let heads = num("attention.head_count")?;
        let vocab = match md.get(&key("vocab_size")).and_then(Value::as_u64) {
            Some(v) => v as usize,
            None => md.req_array("tokenizer.ggml.tokens")?.len(),
        };
        let head_dim =
            md.get(&key("attention.key_length")).and_then(Value::as_u64).map_or(hidden / heads.max(1), |v| v as usize);
        if let Some(rd) = md.get(&key("rope.dimension_count")).and_then(Value::as_u64)
            && rd as usize != head_dim
        {
            return Err(EngineError::Unsupported(format!("partial rotary embedding ({rd} of {head_dim} dims)")));
        }
        let rope_scaling = match md.get(&key("rope.scaling.type")).and_then(Value::as_str) {
            None | Some("none") => None,
            Some(other) => return Err(EngineError::Unsupported(format!("GGUF rope scaling {other:?}"))),
        };
        let cfg = Self {
            arch,
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: num("feed_forward_length")?,
            num_layers: num("block_count")?,
            num_heads: heads,
            num_kv_heads: md.get(&key("attention.head_count_kv")).and_then(Value::as_u64).map_or(heads, |v| v as usize),
            head_dim,
            rope_theta: float("rope.freq_base", 10000.0),
            rope_scaling,
            rms_norm_eps: float("attention.layer_norm_rms_epsilon", 1e-5),
            max_position_embeddings: num("context_length").unwrap_or(4096),
            tie_word_embeddings: !h.tensors.iter().any(|t| t.name == "output.weight"),
            qkv_bias: arch == Arch::Qwen2,
        };
        if !cfg.consistent() {
            return Err(EngineError::invalid(path, format!("inconsistent architecture: {cfg:?}")));
        }
        Ok(cfg)
    }

    /// Whether its sizes fit together and stay within what any real model has.
    fn consistent(&self) -> bool {
        let bad = self.vocab_size == 0
            || self.hidden_size == 0
            || self.num_layers == 0
            || self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
            || self.head_dim == 0
            || !self.head_dim.is_multiple_of(2)
            || self.max_position_embeddings == 0;
        // Far beyond any real model: a file claiming more is corrupt (and would make the
        // loader size vectors from it).
        let huge = self.num_layers > 4096
            || self.hidden_size > 1 << 20
            || self.num_heads > 1 << 14
            || self.num_kv_heads > 1 << 14
            || self.head_dim > 1 << 14
            || self.intermediate_size > 1 << 22
            || self.vocab_size > 1 << 24
            || self.max_position_embeddings > 1 << 24;
        !(bad || huge)
    }

    /// Width of the query projection.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of the key / value projections.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}
