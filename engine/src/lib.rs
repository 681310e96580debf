//! `ferry-engine`: the model engine every worker runs.
//!
//! - [`config`]: the architecture, from HF `config.json` or GGUF metadata;
//! - [`source`]: tensors from safetensors (single or sharded) or GGUF, named and laid out the
//!   HF way (GGUF Q/K rows un-permuted), dequantised by [`dequant`];
//! - [`Model`]: weights on a [`ferry_kernels::Backend`], RoPE table, tokenizer, fingerprint;
//! - [`PagePool`]: the page-major KV arena, touched at start; [`PageAlloc`] frees on drop;
//! - [`SeqChunk`] / `Model::forward`: one pass over sequences at mixed stages;
//! - [`RadixCache`]: the radix prefix cache on the pool (lock refs, cascading eviction, KV
//!   events); [`scheduler`]: prefill batch scheduling (lpm, dfs-weight, fcfs);
//! - [`Sampler`]: greedy, temperature, top-k/p, min-p, penalties, seeds, logprobs;
//! - [`generate()`]: colocated chunked prefill + continuous-batching decode;
//! - [`tiny`]: a deterministic tiny random model writer (HF layout and GGUF) for tests.
//!
//! Tokenizer, chat template and detokenizer come from `ferry-tokenize`, re-exported here.

pub mod cache;
pub mod config;
pub mod dequant;
mod error;
mod forward;
pub mod generate;
pub mod guide;
mod model;
mod pool;
pub mod sampler;
pub mod scheduler;
pub mod source;
pub mod tiny;
mod weights;

pub use cache::{CacheMatch, RadixCache};
pub use config::{Arch, ModelConfig};
pub use error::EngineError;
pub use ferry_grammar::Grammars;
pub use ferry_radix::NodeId;
pub use forward::SeqChunk;
pub use generate::{BatchOptions, Output, Request, generate, generate_streaming};
pub use guide::Guide;
pub use model::{Model, ModelFormat};
pub use pool::{PageAlloc, PagePool};
pub use sampler::{Sampled, Sampler, prompt_logprob};

pub use ferry_tokenize::{ChatMessage, ChatTemplate, Constraint, Detokenizer, FinishReason, SamplingParams, Tokenizer};
