//! `ferry-tokenize`: everything needed to understand a request without the model code, so
//! that the router can depend on it without pulling in the kernels.
//!
//! - [`gguf`]: the GGUF container — header, metadata and tensor directory (no dequantising;
//!   that is the engine's job);
//! - [`Tokenizer`]: the HF `tokenizers` tokenizer, loaded from `tokenizer.json` or built from a
//!   GGUF vocabulary and merges, with the model's BOS/EOS rules;
//! - [`HeadCache`]: a prompt's shared head (system prompt, earlier turns) tokenized once;
//! - [`ChatTemplate`]: the model's own Jinja chat template, rendered with minijinja;
//! - [`Detokenizer`]: incremental decoding that never emits half a UTF-8 character;
//! - [`SamplingParams`] and [`FinishReason`]: what a request asks for and how it ended;
//! - [`ServedModel`]: name, tokenizer, vocabulary and context of a model, from its metadata
//!   alone (what the router needs).

#[cfg(test)]
mod bpe_fixtures;
mod byte_decode;
mod char_class;
mod chat;
mod detok;
mod error;
mod fast_bpe;
pub mod gguf;
mod gguf_vocab;
pub mod gguf_write;
mod gpt2_by_hand;
mod head_cache;
mod llama3_by_hand;
mod request;
mod served;
mod token_bytes;
mod tokenizer;
mod word_cache;
mod word_cuts;

pub use chat::{ChatMessage, ChatTemplate};
pub use detok::Detokenizer;
pub use error::TokenizeError;
pub use head_cache::{HeadCache, HeadCacheStats};
pub use request::{Constraint, FinishReason, MAX_LOGIT_BIAS, MAX_N, MAX_TOP_LOGPROBS, SamplingError, SamplingParams};
pub use served::ServedModel;
pub use token_bytes::display as token_display;
pub use tokenizer::Tokenizer;
