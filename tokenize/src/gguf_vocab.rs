//! Turns a GGUF vocabulary (`tokenizer.ggml.*`) into an HF `tokenizers` definition.
//!
//! - Byte-level BPE (`tokenizer.ggml.model = "gpt2"`: GPT-2, Llama 3, SmolLM2, Qwen2, ...);
//!   the pre-tokenizer is chosen by `tokenizer.ggml.pre`.
//! - SentencePiece BPE (`"llama"`: Llama 2, Mistral, TinyLlama): turned into the same BPE with
//!   byte fallback that HF's `LlamaTokenizerFast` uses — `▁` for spaces, a `▁` prepended, and
//!   merges derived from the piece scores the way HF's converter does (every split of a piece
//!   into two pieces of the vocabulary is a merge, ranked by the piece's score).

use std::collections::BTreeMap;

use serde_json::{Value as Json, json};

use crate::TokenizeError;
use crate::gguf::{MetadataExt, Value};

/// GGUF token types that mark special tokens (control and user-defined).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Llama 3's pre-tokenizer split pattern.
pub(crate) const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's pre-tokenizer split pattern.
pub(crate) const QWEN2_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Builds `tokenizer.json` content from GGUF metadata.
pub(crate) fn tokenizer_json(md: &BTreeMap<String, Value>) -> Result<String, TokenizeError> {
    let model = md.req_str("tokenizer.ggml.model")?;
    match model {
        "gpt2" => {}
        "llama" => return sentencepiece_json(md),
        other => {
            return Err(TokenizeError::Tokenizer(format!(
                "GGUF tokenizer model {other:?} is not supported (byte-level BPE \"gpt2\" and SentencePiece \"llama\" are); load this model from its HF directory"
            )));
        }
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

/// GGUF token type of byte-fallback pieces (`<0x0A>`).
const TOKEN_TYPE_BYTE: i64 = 6;

fn token_types(md: &BTreeMap<String, Value>, n: usize) -> Vec<i64> {
    let types = md.get("tokenizer.ggml.token_type").and_then(Value::as_array).unwrap_or(&[]);
    (0..n)
        .map(|i| match types.get(i) {
            Some(Value::I64(t)) => *t,
            Some(Value::U64(t)) => i64::try_from(*t).unwrap_or(1),
            _ => 1,
        })
        .collect()
}

fn sentencepiece_json(md: &BTreeMap<String, Value>) -> Result<String, TokenizeError> {
    let tokens = md.req_array("tokenizer.ggml.tokens")?;
    let pieces: Vec<&str> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| t.as_str().ok_or_else(|| TokenizeError::Tokenizer(format!("token {i} is not a string"))))
        .collect::<Result<_, _>>()?;
    let scores: Vec<f64> = match md.get("tokenizer.ggml.scores").and_then(Value::as_array) {
        Some(s) => s.iter().map(|v| v.as_f64().unwrap_or(0.0)).collect(),
        None => vec![0.0; pieces.len()],
    };
    let types = token_types(md, pieces.len());
    let unk = md.get("tokenizer.ggml.unknown_token_id").and_then(Value::as_u64).unwrap_or(0) as usize;
    let ids: std::collections::HashMap<&str, usize> = pieces.iter().enumerate().map(|(i, p)| (*p, i)).collect();
    // Merges: every split of a normal piece into two pieces of the vocabulary, ranked by the
    // merged piece's score (higher first), then by the ids of the two halves.
    let mut merges: Vec<(f64, usize, usize, &str, &str)> = Vec::new();
    for (i, p) in pieces.iter().enumerate() {
        if types[i] != 1 {
            continue;
        }
        for (at, _) in p.char_indices().skip(1) {
            let (l, r) = p.split_at(at);
            if let (Some(&li), Some(&ri)) = (ids.get(l), ids.get(r)) {
                merges.push((scores.get(i).copied().unwrap_or(0.0), li, ri, l, r));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges: Vec<Json> = merges.iter().map(|m| json!([m.3, m.4])).collect();
    let vocab: serde_json::Map<String, Json> =
        pieces.iter().enumerate().map(|(i, p)| (p.to_string(), json!(i))).collect();
    let added: Vec<Json> = pieces
        .iter()
        .enumerate()
        .filter(|(i, _)| matches!(types[*i], TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED) || *i == unk)
        .map(|(i, p)| {
            json!({"id": i, "content": p, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": types[i] != TOKEN_TYPE_USER_DEFINED})
        })
        .collect();
    let has_bytes = types.contains(&TOKEN_TYPE_BYTE);
    let doc = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}]},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": pieces.get(unk), "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": has_bytes, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    });
    Ok(doc.to_string())
}
