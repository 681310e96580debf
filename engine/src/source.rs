//! Where tensors come from: an HF safetensors directory or a GGUF file. Both hand out f32
//! tensors named and laid out the HF way (`(out, in)` row-major, Q/K rows in HF order).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ferry_tokenize::gguf::{self, GgufFile};
use safetensors::SafeTensors;
use safetensors::tensor::Dtype as StDtype;

use crate::EngineError;
use crate::config::{Arch, ModelConfig};
use crate::dequant::{DType, dequantize};
use ferry_kernels::quant::WeightFormat;

/// A tensor in f32 with its shape (`[rows, cols]` for matrices, `[n]` for vectors).
#[derive(Debug, Clone)]
pub struct Tensor {
    /// Shape, outermost first.
    pub shape: Vec<usize>,
    /// Values, row-major; empty when `blocks` holds them.
    pub data: Vec<f32>,
    /// The values as the file's blocks, row-major, when the file holds a matrix in a block
    /// format a backend may keep as it is ([`DType::weight_format`]).
    pub blocks: Option<(WeightFormat, Vec<u8>)>,
}

impl Tensor {
    /// The values in f32 (dequantized from the blocks when the tensor has them).
    pub fn into_f32(self) -> Vec<f32> {
        match self.values() {
            std::borrow::Cow::Owned(v) => v,
            std::borrow::Cow::Borrowed(_) => self.data,
        }
    }

    /// Every `step`th value from the first (`step` ≥ 1), dequantizing only the blocks they
    /// lie in: a sample of a large quantized tensor without its f32 copy.
    pub fn strided(&self, step: usize) -> Vec<f32> {
        match &self.blocks {
            Some((f, b)) if self.data.is_empty() => {
                let n: usize = self.shape.iter().product();
                let (bb, mut block) = (f.block_bytes(), vec![0.0f32; f.block_weights()]);
                (0..n)
                    .step_by(step.max(1))
                    .map(|i| {
                        let (bi, j) = (i / block.len(), i % block.len());
                        f.dequantize_block(&b[bi * bb..(bi + 1) * bb], &mut block);
                        block[j]
                    })
                    .collect()
            }
            _ => self.data.iter().step_by(step.max(1)).copied().collect(),
        }
    }

    /// The values in f32, borrowed when the tensor holds them so.
    pub fn values(&self) -> std::borrow::Cow<'_, [f32]> {
        match &self.blocks {
            Some((f, b)) if self.data.is_empty() => {
                let mut out = vec![0.0; self.shape.iter().product()];
                f.dequantize(b, &mut out);
                std::borrow::Cow::Owned(out)
            }
            _ => std::borrow::Cow::Borrowed(&self.data),
        }
    }
}

/// Hands out tensors by HF name.
pub trait TensorSource {
    /// The tensor `name`, or None when the model has no such tensor.
    fn tensor(&self, name: &str) -> Result<Option<Tensor>, EngineError>;
}

/// An HF directory: `model.safetensors` or shards listed in `model.safetensors.index.json`.
pub struct HfSource {
    maps: Vec<(PathBuf, memmap2::Mmap)>,
    /// Tensor name → where it lies, read once from each file's header.
    index: HashMap<String, StEntry>,
}

/// A tensor's place in one of the mapped files.
struct StEntry {
    file: usize,
    dtype: StDtype,
    shape: Vec<usize>,
    /// Byte range within the file.
    range: std::ops::Range<usize>,
}

impl HfSource {
    /// Maps every safetensors file of `dir`.
    pub fn open(dir: &Path) -> Result<Self, EngineError> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index_path.exists() {
            let bytes =
                std::fs::read(&index_path).map_err(|source| EngineError::Io { path: index_path.clone(), source })?;
            let j: serde_json::Value =
                serde_json::from_slice(&bytes).map_err(|e| EngineError::invalid(&index_path, e.to_string()))?;
            let map = j
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| EngineError::invalid(&index_path, "no weight_map"))?;
            let mut files: Vec<PathBuf> = map.values().filter_map(|v| v.as_str()).map(|f| dir.join(f)).collect();
            files.sort();
            files.dedup();
            files
        } else {
            let single = dir.join("model.safetensors");
            if !single.exists() {
                return Err(EngineError::ModelNotFound {
                    path: dir.to_path_buf(),
                    reason: "no model.safetensors or model.safetensors.index.json".into(),
                });
            }
            vec![single]
        };
        let mut maps = Vec::new();
        let mut index = HashMap::new();
        for path in files {
            let file = std::fs::File::open(&path).map_err(|source| EngineError::Io { path: path.clone(), source })?;
            // SAFETY: read-only map of a model file that is not modified while loaded.
            let map = unsafe { memmap2::Mmap::map(&file) }
                .map_err(|source| EngineError::Io { path: path.clone(), source })?;
            let bad = |e: safetensors::SafeTensorError| EngineError::invalid(&path, e.to_string());
            // Validates the header against the file's length (offsets, sizes) once.
            SafeTensors::deserialize(&map).map_err(bad)?;
            let (header_len, metadata) = SafeTensors::read_metadata(&map).map_err(bad)?;
            let data_start = 8 + header_len;
            for (name, info) in metadata.tensors() {
                let (a, b) = info.data_offsets;
                let entry = StEntry {
                    file: maps.len(),
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    range: data_start + a..data_start + b,
                };
                index.insert(name, entry);
            }
            maps.push((path, map));
        }
        Ok(Self { maps, index })
    }
}

impl TensorSource for HfSource {
    fn tensor(&self, name: &str) -> Result<Option<Tensor>, EngineError> {
        let Some(e) = self.index.get(name) else { return Ok(None) };
        let (path, map) = &self.maps[e.file];
        let dtype = match e.dtype {
            StDtype::F32 => DType::F32,
            StDtype::F16 => DType::F16,
            StDtype::BF16 => DType::BF16,
            other => {
                return Err(EngineError::Unsupported(format!("{}: tensor {name} has dtype {other:?}", path.display())));
            }
        };
        let n: usize = e.shape.iter().product();
        let raw = map.get(e.range.clone()).filter(|r| Some(r.len()) == dtype.bytes_for(n));
        let raw =
            raw.ok_or_else(|| EngineError::invalid(path, format!("tensor {name}: data does not match its shape")))?;
        // Half-precision matrices stay so for a backend that keeps them ([`Tensor::into_f32`]
        // widens them for one that does not).
        if let (Some(f), [_, _]) = (dtype.weight_format(), &e.shape[..]) {
            return Ok(Some(Tensor { shape: e.shape.clone(), data: Vec::new(), blocks: Some((f, raw.to_vec())) }));
        }
        let mut data = vec![0.0; n];
        dequantize(dtype, raw, &mut data);
        Ok(Some(Tensor { shape: e.shape.clone(), data, blocks: None }))
    }
}

/// A GGUF file, its tensors renamed to HF names and Q/K rows put back in HF order.
pub struct GgufSource {
    file: GgufFile,
    path: PathBuf,
    /// GGUF name → tensor index.
    by_name: HashMap<String, usize>,
    cfg: ModelConfig,
}

impl GgufSource {
    /// Wraps an opened GGUF file.
    pub fn new(file: GgufFile, path: &Path, cfg: ModelConfig) -> Self {
        let by_name = file.header.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Self { file, path: path.to_path_buf(), by_name, cfg }
    }

    /// The GGUF name of an HF tensor name.
    pub(crate) fn gguf_name(name: &str) -> Option<String> {
        if let Some(rest) = name.strip_prefix("model.layers.") {
            let (layer, rest) = rest.split_once('.')?;
            let n = match rest {
                "self_attn.q_proj.weight" => "attn_q.weight",
                "self_attn.k_proj.weight" => "attn_k.weight",
                "self_attn.v_proj.weight" => "attn_v.weight",
                "self_attn.o_proj.weight" => "attn_output.weight",
                "self_attn.q_proj.bias" => "attn_q.bias",
                "self_attn.k_proj.bias" => "attn_k.bias",
                "self_attn.v_proj.bias" => "attn_v.bias",
                "mlp.gate_proj.weight" => "ffn_gate.weight",
                "mlp.up_proj.weight" => "ffn_up.weight",
                "mlp.down_proj.weight" => "ffn_down.weight",
                "input_layernorm.weight" => "attn_norm.weight",
                "post_attention_layernorm.weight" => "ffn_norm.weight",
                _ => return None,
            };
            return Some(format!("blk.{layer}.{n}"));
        }
        Some(
            match name {
                "model.embed_tokens.weight" => "token_embd.weight",
                "model.norm.weight" => "output_norm.weight",
                "lm_head.weight" => "output.weight",
                _ => return None,
            }
            .to_string(),
        )
    }
}

impl TensorSource for GgufSource {
    fn tensor(&self, name: &str) -> Result<Option<Tensor>, EngineError> {
        let Some(gname) = Self::gguf_name(name) else { return Ok(None) };
        let Some(&i) = self.by_name.get(&gname) else { return Ok(None) };
        let info = &self.file.header.tensors[i];
        let dtype = DType::from_ggml(info.ggml_type).ok_or_else(|| {
            EngineError::Unsupported(format!(
                "{}: tensor {gname} has type {} (supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)",
                self.path.display(),
                gguf::type_name(info.ggml_type)
            ))
        })?;
        let n = info.elements as usize;
        let bytes =
            dtype.bytes_for(n).ok_or_else(|| EngineError::invalid(&self.path, format!("{gname}: partial block")))?;
        let start = info.offset as usize;
        let raw = self
            .file
            .bytes()
            .get(start..start + bytes)
            .ok_or_else(|| EngineError::invalid(&self.path, format!("{gname}: data past the end of the file")))?;
        // GGUF lists [ne0 = in, ne1 = out]; the data is row-major (out, in).
        let shape: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
        // Matrices of whole blocks per row keep their blocks (and are not dequantized here:
        // [`Tensor::into_f32`] does it for a backend that wants f32).
        let mut blocks = match (dtype.weight_format(), &shape[..]) {
            (Some(f), [_, cols]) if cols % f.block_weights() == 0 => Some((f, raw.to_vec())),
            _ => None,
        };
        let mut data = Vec::new();
        if blocks.is_none() {
            data = vec![0.0; n];
            dequantize(dtype, raw, &mut data);
        }
        // Copied out: the file's pages need not stay resident beside the copy.
        self.file.release(start, bytes);
        let is_llama = matches!(self.cfg.arch, Arch::Llama | Arch::Mistral);
        if is_llama && (gname.ends_with("attn_q.weight") || gname.ends_with("attn_k.weight")) {
            let heads = if gname.ends_with("attn_q.weight") { self.cfg.num_heads } else { self.cfg.num_kv_heads };
            // Whole heads of an even size, or the row permutation cannot be undone (a
            // zero-sized tensor divided by zero here).
            match shape[..] {
                [rows, cols] if cols > 0 && heads > 0 && rows % heads == 0 && (rows / heads) % 2 == 0 => {
                    if !data.is_empty() {
                        data = unpermute_rows(&data, heads, cols);
                    }
                    // The blocks of a row are that row's alone: whole rows move.
                    blocks = blocks.map(|(f, b)| {
                        let rb = f.row_bytes(cols);
                        (f, reorder_rows(&b, heads, rb, false))
                    });
                }
                _ => {
                    let why = format!("{gname}: shape {shape:?} does not split into {heads} heads of an even size");
                    return Err(EngineError::invalid(&self.path, why));
                }
            }
        }
        Ok(Some(Tensor { shape, data, blocks }))
    }
}

/// Undoes llama.cpp's Q/K row permutation: within each head, GGUF row `2i + j` is HF row
/// `j · head_dim/2 + i`, which makes RoPE pairs adjacent in GGUF and `(i, i + head_dim/2)` in HF.
pub fn unpermute_rows(data: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    reorder_rows(data, heads, cols, false)
}

/// llama.cpp's Q/K row permutation (HF → GGUF), for writing test models.
pub fn permute_rows(data: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    reorder_rows(data, heads, cols, true)
}

fn reorder_rows<T: Copy + Default>(data: &[T], heads: usize, cols: usize, to_gguf: bool) -> Vec<T> {
    let rows = data.len() / cols;
    let hd = rows / heads;
    let half = hd / 2;
    let mut out = vec![T::default(); data.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let (gguf, hf) = (h * hd + 2 * i + j, h * hd + j * half + i);
                let (src, dst) = if to_gguf { (hf, gguf) } else { (gguf, hf) };
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_strided_sample_of_blocks_is_the_dequantized_values_strided() {
        let f = WeightFormat::Q8_0;
        let (rows, cols) = (3, 64);
        // Q8_0 blocks: an f16 scale (0.5), then 32 signed bytes.
        let blocks: Vec<u8> = (0..rows * cols / 32)
            .flat_map(|b| {
                let mut blk = half::f16::from_f32(0.5).to_le_bytes().to_vec();
                blk.extend((0..32).map(|j| (b * 32 + j) as u8 ^ 0x5a));
                blk
            })
            .collect();
        let t = Tensor { shape: vec![rows, cols], data: Vec::new(), blocks: Some((f, blocks)) };
        let all = t.values().into_owned();
        for step in [1, 5, 32, 33, 200] {
            assert_eq!(t.strided(step), all.iter().step_by(step).copied().collect::<Vec<_>>(), "step {step}");
        }
        let plain = Tensor { shape: vec![4], data: vec![1.0, 2.0, 3.0, 4.0], blocks: None };
        assert_eq!(plain.strided(3), vec![1.0, 4.0]);
    }
}
