//! Errors of the engine.

use std::path::PathBuf;

use ferry_kernels::KernelError;
use ferry_tokenize::{SamplingError, TokenizeError};

/// What loading a model or running a request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model path does not exist or holds no model.
    #[error("model not found at {path}: {reason}")]
    ModelNotFound {
        /// The path given.
        path: PathBuf,
        /// What was looked for.
        reason: String,
    },
    /// A model file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A model file is malformed, truncated or inconsistent.
    #[error("invalid model file {path}: {reason}")]
    InvalidModel {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The model uses something Ferry does not support.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// A tensor the architecture needs is missing.
    #[error("tensor {0} is missing from the model")]
    MissingTensor(String),
    /// Tokenizer, chat template or GGUF metadata problem.
    #[error(transparent)]
    Tokenize(#[from] TokenizeError),
    /// A request is invalid.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A sampling parameter is out of range.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The page pool has no room for the request.
    #[error("out of KV pages: {needed} needed, {free} free")]
    OutOfPages {
        /// Pages asked for.
        needed: usize,
        /// Pages free.
        free: usize,
    },
    /// A backend operation failed.
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

impl EngineError {
    pub(crate) fn invalid(path: &std::path::Path, reason: impl Into<String>) -> Self {
        Self::InvalidModel { path: path.to_path_buf(), reason: reason.into() }
    }
}
