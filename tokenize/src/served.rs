//! What a router needs to know of the served model without loading its weights: its name,
//! tokenizer (with chat template), vocabulary size and context length — from an HF directory's
//! `config.json` or a GGUF file's metadata.

use std::path::Path;

use crate::gguf::{GgufFile, Value};
use crate::{TokenizeError, Tokenizer};

/// The served model, as requests see it.
pub struct ServedModel {
    /// The name clients use: the file's or directory's name without extension (as llama.cpp's
    /// server does; `general.name` is free text, often with spaces).
    pub name: String,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// Token ids below this are valid.
    pub vocab_size: usize,
    /// Prompt plus output tokens must stay below this.
    pub context_length: usize,
}

impl std::fmt::Debug for ServedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServedModel").field("name", &self.name).field("context_length", &self.context_length).finish()
    }
}

fn meta(key: &str, problem: &str) -> TokenizeError {
    TokenizeError::Metadata { key: key.into(), problem: problem.into() }
}

impl ServedModel {
    /// Reads an HF model directory or a GGUF file (metadata only: the weights stay on disk).
    pub fn load(path: &Path) -> Result<Self, TokenizeError> {
        let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
        if path.is_dir() {
            let cfg_path = path.join("config.json");
            let text =
                std::fs::read_to_string(&cfg_path).map_err(|source| TokenizeError::Io { path: cfg_path, source })?;
            let cfg: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| TokenizeError::Tokenizer(format!("config.json: {e}")))?;
            let num = |k: &str| cfg.get(k).and_then(serde_json::Value::as_u64).map(|v| v as usize);
            let vocab_size = num("vocab_size").ok_or_else(|| meta("vocab_size", "missing from config.json"))?;
            let context_length = num("max_position_embeddings").unwrap_or(4096);
            let tokenizer = Tokenizer::from_hf_dir(path, vocab_size)?;
            return Ok(Self { name: stem, tokenizer, vocab_size, context_length });
        }
        let file = GgufFile::open(path)?;
        let md = &file.header.metadata;
        let arch = md
            .get("general.architecture")
            .and_then(Value::as_str)
            .ok_or_else(|| meta("general.architecture", "missing"))?;
        let key = |k: &str| format!("{arch}.{k}");
        let vocab_size = match md.get(&key("vocab_size")).and_then(Value::as_u64) {
            Some(v) => v as usize,
            None => md
                .get("tokenizer.ggml.tokens")
                .and_then(Value::as_array)
                .map(<[Value]>::len)
                .ok_or_else(|| meta("tokenizer.ggml.tokens", "missing"))?,
        };
        let context_length = md.get(&key("context_length")).and_then(Value::as_u64).map_or(4096, |v| v as usize);
        let name = stem;
        let tokenizer = Tokenizer::from_gguf(&file.header, vocab_size)?;
        Ok(Self { name, tokenizer, vocab_size, context_length })
    }
}
