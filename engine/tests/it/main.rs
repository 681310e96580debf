//! The engine's integration tests, as one test binary (one link, shared helpers).

mod common;

mod against_ggml;
mod bad_input;
mod cache_props;
mod cuda_parity;
mod loading;
mod parity;
mod pool_props;
mod reference;
mod scheduler;
mod structured;
mod tokenizer;
