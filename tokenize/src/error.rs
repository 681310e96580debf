//! Errors of tokenizer, template and GGUF metadata handling.

use std::path::PathBuf;

/// What loading or using a tokenizer can fail with.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A GGUF file is malformed or truncated.
    #[error("malformed GGUF: {0}")]
    Gguf(String),
    /// A required metadata key is missing or has the wrong type.
    #[error("GGUF metadata key {key}: {problem}")]
    Metadata {
        /// The key.
        key: String,
        /// What is wrong.
        problem: String,
    },
    /// The tokenizer definition is invalid or unsupported.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to parse or render.
    #[error("chat template: {0}")]
    Template(String),
    /// The model has no chat template.
    #[error("the model has no chat template")]
    NoChatTemplate,
}
