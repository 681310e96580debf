//! The weights of a Llama-family model on a backend.

use ferry_kernels::Backend;

use crate::EngineError;
use crate::config::ModelConfig;
use crate::source::{Tensor, TensorSource};

/// One transformer block.
pub struct Layer<B: Backend> {
    pub(crate) attn_norm: B::Buf,
    /// Q, K and V projections.
    pub(crate) qkv: Proj<B>,
    pub(crate) bq: Option<B::Buf>,
    pub(crate) bk: Option<B::Buf>,
    pub(crate) bv: Option<B::Buf>,
    pub(crate) wo: B::Mat,
    pub(crate) ffn_norm: B::Buf,
    /// Gate and up projections.
    pub(crate) gate_up: Proj<B>,
    pub(crate) w_down: B::Mat,
}

/// Matrices multiplied by one input: one stacked product where the backend stacks them
/// ([`Backend::stack`]: the CPU does, for matrices stored alike), else one product each.
pub(crate) enum Proj<B: Backend> {
    Stacked(B::Mat),
    Apart(Vec<B::Mat>),
}

impl<B: Backend> Proj<B> {
    fn new(backend: &B, mats: Vec<B::Mat>) -> Self {
        match backend.stack(mats) {
            Ok(w) => Self::Stacked(w),
            Err(mats) => Self::Apart(mats),
        }
    }

    /// `outs[i] = x · w_iᵀ`, in the order the matrices were given.
    pub(crate) fn matmul(
        &self,
        backend: &B,
        x: &B::Buf,
        rows: usize,
        outs: &mut [&mut B::Buf],
    ) -> Result<(), ferry_kernels::KernelError> {
        match self {
            Self::Stacked(w) => backend.matmul_parts(x, rows, w, outs),
            Self::Apart(mats) => mats.iter().zip(outs.iter_mut()).try_for_each(|(w, o)| backend.matmul(x, rows, w, o)),
        }
    }
}

/// All weights. With tied embeddings `lm_head` is `None` and the embedding matrix is used.
pub struct Weights<B: Backend> {
    pub(crate) embed: B::Mat,
    pub(crate) layers: Vec<Layer<B>>,
    pub(crate) norm: B::Buf,
    pub(crate) lm_head: Option<B::Mat>,
}

impl<B: Backend> Weights<B> {
    /// Reads every tensor the architecture needs from `src` and uploads it to `backend`.
    /// Also returns the model's fingerprint, taken from the tensors as they pass by.
    pub fn load(backend: &B, cfg: &ModelConfig, src: &dyn TensorSource) -> Result<(Self, String), EngineError> {
        let d = cfg.hidden_size;
        let fp = Fingerprint::new(cfg);
        let get = |name: &str, shape: &[usize]| -> Result<Tensor, EngineError> {
            let t = src.tensor(name)?.ok_or_else(|| EngineError::MissingTensor(name.to_string()))?;
            if FINGERPRINT_TENSORS.contains(&name) {
                fp.sample(&t);
            }
            if t.shape != shape {
                return Err(EngineError::Unsupported(format!(
                    "tensor {name} has shape {:?}, expected {shape:?}",
                    t.shape
                )));
            }
            Ok(t)
        };
        let mat = |name: &str, rows: usize, cols: usize| -> Result<B::Mat, EngineError> {
            let t = get(name, &[rows, cols])?;
            Ok(match t.blocks {
                // Kept as the file has it where the backend computes with it.
                Some((format, blocks)) => backend.matrix_quantized(rows, cols, format, blocks)?,
                None => backend.matrix(rows, cols, t.into_f32())?,
            })
        };
        let vec =
            |name: &str, n: usize| -> Result<B::Buf, EngineError> { Ok(backend.upload(&get(name, &[n])?.into_f32())?) };
        let opt_vec = |name: &str, n: usize| -> Result<Option<B::Buf>, EngineError> {
            if !cfg.qkv_bias {
                return Ok(None);
            }
            vec(name, n).map(Some)
        };
        let (q, kv, ff) = (cfg.q_dim(), cfg.kv_dim(), cfg.intermediate_size);
        let mut layers = Vec::new();
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            layers.push(Layer {
                attn_norm: vec(&format!("{p}.input_layernorm.weight"), d)?,
                qkv: Proj::new(
                    backend,
                    vec![
                        mat(&format!("{p}.self_attn.q_proj.weight"), q, d)?,
                        mat(&format!("{p}.self_attn.k_proj.weight"), kv, d)?,
                        mat(&format!("{p}.self_attn.v_proj.weight"), kv, d)?,
                    ],
                ),
                bq: opt_vec(&format!("{p}.self_attn.q_proj.bias"), q)?,
                bk: opt_vec(&format!("{p}.self_attn.k_proj.bias"), kv)?,
                bv: opt_vec(&format!("{p}.self_attn.v_proj.bias"), kv)?,
                wo: mat(&format!("{p}.self_attn.o_proj.weight"), d, q)?,
                ffn_norm: vec(&format!("{p}.post_attention_layernorm.weight"), d)?,
                gate_up: Proj::new(
                    backend,
                    vec![
                        mat(&format!("{p}.mlp.gate_proj.weight"), ff, d)?,
                        mat(&format!("{p}.mlp.up_proj.weight"), ff, d)?,
                    ],
                ),
                w_down: mat(&format!("{p}.mlp.down_proj.weight"), d, ff)?,
            });
        }
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            match src.tensor("lm_head.weight")? {
                Some(t) if t.shape == [cfg.vocab_size, d] => Some(match t.blocks {
                    Some((format, blocks)) => backend.matrix_quantized(cfg.vocab_size, d, format, blocks)?,
                    None => backend.matrix(cfg.vocab_size, d, t.into_f32())?,
                }),
                Some(t) => return Err(EngineError::Unsupported(format!("lm_head.weight has shape {:?}", t.shape))),
                None => return Err(EngineError::MissingTensor("lm_head.weight".into())),
            }
        };
        let weights = Self {
            embed: mat("model.embed_tokens.weight", cfg.vocab_size, d)?,
            layers,
            norm: vec("model.norm.weight", d)?,
            lm_head,
        };
        Ok((weights, fp.finish()))
    }
}

impl Weights<ferry_kernels::cpu::CpuBackend> {
    /// Bytes the matrices take in memory as the CPU backend holds them (norms and biases,
    /// a few vectors of f32, left out).
    pub fn matrix_bytes(&self) -> usize {
        let proj = |p: &Proj<ferry_kernels::cpu::CpuBackend>| match p {
            Proj::Stacked(m) => m.resident_bytes(),
            Proj::Apart(ms) => ms.iter().map(|m| m.resident_bytes()).sum(),
        };
        let layers: usize = self
            .layers
            .iter()
            .map(|l| proj(&l.qkv) + proj(&l.gate_up) + l.wo.resident_bytes() + l.w_down.resident_bytes())
            .sum();
        layers + self.embed.resident_bytes() + self.lm_head.as_ref().map_or(0, |m| m.resident_bytes())
    }
}

/// Tensors whose sampled values enter the fingerprint.
const FINGERPRINT_TENSORS: [&str; 3] =
    ["model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight", "model.norm.weight"];

/// FNV-1a over the configuration and a sample of a few tensors' values: cheap, stable across
/// runs and Rust versions, and different for different weights.
struct Fingerprint(std::cell::Cell<u64>);

impl Fingerprint {
    fn new(cfg: &ModelConfig) -> Self {
        let fp = Self(std::cell::Cell::new(0xcbf2_9ce4_8422_2325));
        fp.eat(format!("{cfg:?}").as_bytes());
        fp
    }

    fn eat(&self, bytes: &[u8]) {
        let mut h = self.0.get();
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        self.0.set(h);
    }

    /// About 4,096 of `t`'s values, evenly strided (the embedding is not dequantized whole).
    fn sample(&self, t: &Tensor) {
        let n: usize = t.shape.iter().product();
        for v in t.strided((n / 4096).max(1)) {
            self.eat(&v.to_le_bytes());
        }
    }

    fn finish(&self) -> String {
        format!("{:016x}", self.0.get())
    }
}
