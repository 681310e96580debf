//! OpenAI's logprobs shapes, built from the tokens a request generated:
//!
//! - chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
//!   "bytes"}]}], "refusal": null}`;
//! - completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
//!   "text_offset"}` (each alternatives map also holds the chosen token, as vLLM's does).
//!
//! A token's `token` is its text, or `bytes:\xNN...` when it is part of a character; `bytes`
//! are its raw bytes (the tokenizer's vocabulary, decoded).

use ferry_tokenize::{Tokenizer, token_display};
use serde_json::{Value, json};

use crate::generate::Scored;

fn entry(tok: &Tokenizer, id: u32, logprob: f32) -> Value {
    let bytes = tok.token_bytes(id);
    json!({"token": token_display(&bytes), "logprob": finite(logprob), "bytes": bytes})
}

/// JSON has no -inf: a token the sampler could not pick reports the lowest finite value, as
/// vLLM does.
fn finite(x: f32) -> f32 {
    if x.is_finite() { x } else { -9999.0 }
}

/// A chat choice's `logprobs` for `tokens`.
pub fn chat(tok: &Tokenizer, tokens: &[Scored]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(tok, t.id, t.logprob);
            e["top_logprobs"] = t.top.iter().map(|&(id, lp)| entry(tok, id, lp)).collect();
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// A completion choice's `logprobs` for `tokens`; `offset` is the text offset of the first
/// (advanced past the last, so a stream's chunks continue it).
pub fn completion(tok: &Tokenizer, tokens: &[Scored], offset: &mut usize) -> Value {
    completion_entries(tok, tokens.iter().map(|t| (t.id, Some(t))), offset)
}

/// [`completion`] with the prompt first (`echo`): its first token has no logprob (`null`), the
/// others those of `prompt` (the prompt tokens after the first, scored by the model).
pub fn completion_echo(tok: &Tokenizer, first: u32, prompt: &[Scored], tokens: &[Scored], offset: &mut usize) -> Value {
    let entries = std::iter::once((first, None)).chain(prompt.iter().chain(tokens).map(|t| (t.id, Some(t))));
    completion_entries(tok, entries, offset)
}

fn completion_entries<'a>(
    tok: &Tokenizer,
    entries: impl Iterator<Item = (u32, Option<&'a Scored>)>,
    offset: &mut usize,
) -> Value {
    let (mut texts, mut lps, mut tops, mut offsets) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (id, scored) in entries {
        let text = token_display(&tok.token_bytes(id));
        offsets.push(*offset);
        *offset += text.len();
        texts.push(text);
        let Some(t) = scored else {
            lps.push(Value::Null);
            tops.push(Value::Null);
            continue;
        };
        let mut top = serde_json::Map::new();
        for &(id, lp) in t.top.iter().chain(std::iter::once(&(t.id, t.logprob))) {
            top.entry(token_display(&tok.token_bytes(id))).or_insert(json!(finite(lp)));
        }
        lps.push(json!(finite(t.logprob)));
        tops.push(Value::Object(top));
    }
    json!({"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}
