//! Turns a GGUF vocabulary (`tokenizer.ggml.*`) into an HF `tokenizers` definition.
//!
//! Only byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`: GPT-2, Llama 3,
//! SmolLM2, Qwen2, ...) are supported; the pre-tokenizer is chosen by `tokenizer.ggml.pre`.
//! SentencePiece vocabularies (`"llama"`) give a clear error: load such models from their HF
//! directory.

use std::collections::BTreeMap;

use serde_json::{Value as Json, json};

use crate::TokenizeError;
use crate::gguf::{MetadataExt, Value};

/// GGUF token types that mark special tokens (control and user-defined).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Llama 3's pre-tokenizer split pattern.
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's pre-tokenizer split pattern.
const QWEN2_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Builds `tokenizer.json` content from GGUF metadata.
pub(crate) fn tokenizer_json(md: &BTreeMap<String, Value>) -> Result<String, TokenizeError> {
    let model = md.req_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(TokenizeError::Tokenizer(format!(
            "GGUF tokenizer model {model:?} is not supported (only byte-level BPE \"gpt2\"); load this model from its HF directory"
        )));
    }
    let tokens = md.req_array("tokenizer.ggml.tokens")?;
    let merges = md.req_array("tokenizer.ggml.merges")?;
    let types = md.get("tokenizer.ggml.token_type").and_then(Value::as_array).unwrap_or(&[]);
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        let s = t.as_str().ok_or_else(|| TokenizeError::Tokenizer(format!("token {id} is not a string")))?;
        vocab.insert(s.to_string(), json!(id));
        let ty = types.get(id).and_then(|v| match v {
            Value::I64(i) => Some(*i),
            Value::U64(u) => i64::try_from(*u).ok(),
            _ => None,
        });
        if matches!(ty, Some(TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED)) {
            added.push(json!({
                "id": id, "content": s, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": ty == Some(TOKEN_TYPE_CONTROL),
            }));
        }
    }
    let merges: Vec<Json> = merges.iter().filter_map(|m| m.as_str().map(|s| json!(s))).collect();
    let pre = md.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("default");
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |pattern: &str| json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
    let pre_tokenizer = match pre {
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        "llama-bpe" | "llama3" | "smaug-bpe" => {
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_PATTERN), byte_level(false)]})
        }
        "qwen2" => {
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_PATTERN), byte_level(false)]})
        }
        "gpt-2" | "gpt2" | "default" => byte_level(true),
        other => {
            return Err(TokenizeError::Tokenizer(format!(
                "GGUF pre-tokenizer {other:?} is not supported; load this model from its HF directory"
            )));
        }
    };
    let doc = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    });
    Ok(doc.to_string())
}
