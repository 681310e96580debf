//! A loaded model: configuration, weights on a backend, RoPE table and tokenizer.

use std::path::{Path, PathBuf};

use ferry_kernels::{Backend, KvLayout, RopeTable};
use ferry_tokenize::gguf::GgufFile;
use std::sync::Arc;

use ferry_grammar::Grammars;
use ferry_tokenize::{TokenizeError, Tokenizer};

use crate::guide::{Guide, guide};

use crate::EngineError;
use crate::config::ModelConfig;
use crate::source::{GgufSource, HfSource};
use crate::weights::Weights;

/// Where a model was loaded from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelFormat {
    /// An HF directory of safetensors.
    HfDir,
    /// A GGUF file.
    Gguf,
}

/// A model ready to run.
pub struct Model<B: Backend> {
    pub(crate) config: ModelConfig,
    pub(crate) backend: B,
    pub(crate) weights: Weights<B>,
    pub(crate) rope: RopeTable,
    tokenizer: Tokenizer,
    grammars: Arc<Grammars>,
    format: ModelFormat,
    fingerprint: String,
    path: PathBuf,
}

impl<B: Backend> std::fmt::Debug for Model<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("path", &self.path).field("config", &self.config).finish()
    }
}

impl<B: Backend> Model<B> {
    /// Loads an HF directory or a GGUF file onto `backend`.
    pub fn load(path: &Path, backend: B) -> Result<Self, EngineError> {
        let meta = std::fs::metadata(path)
            .map_err(|e| EngineError::ModelNotFound { path: path.to_path_buf(), reason: e.to_string() })?;
        if meta.is_dir() { Self::load_hf(path, backend) } else { Self::load_gguf(path, backend) }
    }

    fn load_hf(dir: &Path, backend: B) -> Result<Self, EngineError> {
        let config_path = dir.join("config.json");
        if !config_path.exists() {
            return Err(EngineError::ModelNotFound { path: dir.to_path_buf(), reason: "no config.json".into() });
        }
        let config = ModelConfig::from_hf_json(&config_path)?;
        let src = HfSource::open(dir)?;
        let tokenizer = Tokenizer::from_hf_dir(dir, config.vocab_size)?;
        let (weights, fingerprint) = Weights::load(&backend, &config, &src)?;
        Ok(Self::assemble(config, backend, weights, tokenizer, ModelFormat::HfDir, fingerprint, dir))
    }

    fn load_gguf(path: &Path, backend: B) -> Result<Self, EngineError> {
        let file = GgufFile::open(path).map_err(|e| match e {
            TokenizeError::Gguf(reason) => EngineError::invalid(path, reason),
            TokenizeError::Io { path, source } => EngineError::Io { path, source },
            other => other.into(),
        })?;
        let config = ModelConfig::from_gguf(&file.header, path)?;
        let tokenizer = Tokenizer::from_gguf(&file.header, config.vocab_size)?;
        let src = GgufSource::new(file, path, config.clone());
        let (weights, fingerprint) = Weights::load(&backend, &config, &src)?;
        Ok(Self::assemble(config, backend, weights, tokenizer, ModelFormat::Gguf, fingerprint, path))
    }

    fn assemble(
        config: ModelConfig,
        backend: B,
        weights: Weights<B>,
        tokenizer: Tokenizer,
        format: ModelFormat,
        fingerprint: String,
        path: &Path,
    ) -> Self {
        let rope =
            RopeTable::new(config.head_dim, config.rope_theta, config.max_position_embeddings, config.rope_scaling);
        let grammars = Arc::new(Grammars::new(tokenizer.clone()));
        Self { config, backend, weights, rope, tokenizer, grammars, format, fingerprint, path: path.to_path_buf() }
    }

    /// The architecture.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The model's constraint compiler (structured outputs): share it with the threads that
    /// compile constraints so the engine's thread does not.
    pub fn grammars(&self) -> &Arc<Grammars> {
        &self.grammars
    }

    /// A fresh guide for `params`' constraint, if it has one (compiled here, or copied from
    /// the compiler's cache).
    pub fn guide(&self, params: &ferry_tokenize::SamplingParams) -> Result<Option<Guide>, EngineError> {
        guide(&self.grammars, params)
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// HF directory or GGUF.
    pub fn format(&self) -> &ModelFormat {
        &self.format
    }

    /// "gguf" or "hf", for messages.
    pub fn format_name(&self) -> &'static str {
        match self.format {
            ModelFormat::Gguf => "gguf",
            ModelFormat::HfDir => "hf",
        }
    }

    /// A short hash identifying the architecture and weights, for layout checks between nodes.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The KV layout of this model with `page_size` tokens per page.
    pub fn kv_layout(&self, page_size: usize) -> KvLayout {
        KvLayout {
            num_layers: self.config.num_layers,
            num_kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            page_size,
        }
    }
}

impl Model<ferry_kernels::cpu::CpuBackend> {
    /// Bytes the weight matrices take in memory ([`Weights::matrix_bytes`]).
    pub fn matrix_bytes(&self) -> usize {
        self.weights.matrix_bytes()
    }
}
