//! An independent, straightforward forward pass — f64, no pages, no batching, weights read
//! straight from the safetensors file — agrees with the engine; and the GGUF copy of the same
//! weights (Q/K rows permuted the llama.cpp way, optionally quantised) gives the same logits.

use std::collections::HashMap;
use std::path::Path;

use crate::common::{TinyModel, load, pool, prompt, rel_diff};
use ferry_engine::tiny::TinySpec;
use ferry_engine::{Arch, SeqChunk};

struct Reference {
    w: HashMap<String, Vec<f64>>,
    cfg: serde_json::Value,
}

impl Reference {
    fn open(dir: &Path) -> Self {
        let bytes = std::fs::read(dir.join("model.safetensors")).expect("read");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
        let w = st
            .tensors()
            .into_iter()
            .map(|(n, v)| {
                (n, v.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64).collect())
            })
            .collect();
        let cfg = serde_json::from_slice(&std::fs::read(dir.join("config.json")).expect("config")).expect("json");
        Self { w, cfg }
    }
    fn n(&self, k: &str) -> usize {
        self.cfg[k].as_u64().expect(k) as usize
    }
    fn t(&self, k: &str) -> &[f64] {
        &self.w[k]
    }
    /// y = W x for W (rows, cols) row-major.
    fn mv(&self, k: &str, x: &[f64]) -> Vec<f64> {
        let w = self.t(k);
        let cols = x.len();
        (0..w.len() / cols).map(|r| (0..cols).map(|c| w[r * cols + c] * x[c]).sum()).collect()
    }
    fn norm(&self, k: &str, x: &[f64]) -> Vec<f64> {
        let eps = self.cfg["rms_norm_eps"].as_f64().expect("eps");
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let s = 1.0 / (ms + eps).sqrt();
        x.iter().zip(self.t(k)).map(|(v, w)| v * s * w).collect()
    }
    fn inv_freq(&self, hd: usize) -> Vec<f64> {
        let theta = self.cfg["rope_theta"].as_f64().expect("theta");
        (0..hd / 2)
            .map(|i| {
                let f = theta.powf(-(2.0 * i as f64) / hd as f64);
                let Some(s) = self.cfg.get("rope_scaling").filter(|s| !s.is_null()) else { return f };
                let g = |k: &str| s[k].as_f64().expect(k);
                let (factor, lo, hi, old) =
                    (g("factor"), g("low_freq_factor"), g("high_freq_factor"), g("original_max_position_embeddings"));
                let wl = 2.0 * std::f64::consts::PI / f;
                if wl < old / hi {
                    f
                } else if wl > old / lo {
                    f / factor
                } else {
                    let sm = (old / wl - lo) / (hi - lo);
                    (1.0 - sm) * f / factor + sm * f
                }
            })
            .collect()
    }
    /// rotate_half RoPE on every head of `x`.
    fn rope(&self, x: &mut [f64], hd: usize, pos: usize) {
        let inv = self.inv_freq(hd);
        for h in x.chunks_mut(hd) {
            for i in 0..hd / 2 {
                let (c, s) = ((pos as f64 * inv[i]).cos(), (pos as f64 * inv[i]).sin());
                let (a, b) = (h[i], h[i + hd / 2]);
                h[i] = a * c - b * s;
                h[i + hd / 2] = b * c + a * s;
            }
        }
    }
    fn add_bias(&self, k: &str, x: &mut [f64]) {
        if let Some(b) = self.w.get(k) {
            x.iter_mut().zip(b).for_each(|(a, b)| *a += b);
        }
    }
    /// Logits after every prompt position.
    fn logits(&self, ids: &[u32]) -> Vec<Vec<f64>> {
        let d = self.n("hidden_size");
        let (nh, nkv) = (self.n("num_attention_heads"), self.n("num_key_value_heads"));
        let hd = d / nh;
        let emb = self.t("model.embed_tokens.weight");
        let mut xs: Vec<Vec<f64>> = ids.iter().map(|&i| emb[i as usize * d..(i as usize + 1) * d].to_vec()).collect();
        for l in 0..self.n("num_hidden_layers") {
            let p = format!("model.layers.{l}");
            let mut ks = Vec::new();
            let mut vs = Vec::new();
            let mut qs = Vec::new();
            for (pos, x) in xs.iter().enumerate() {
                let h = self.norm(&format!("{p}.input_layernorm.weight"), x);
                let mut q = self.mv(&format!("{p}.self_attn.q_proj.weight"), &h);
                let mut k = self.mv(&format!("{p}.self_attn.k_proj.weight"), &h);
                let mut v = self.mv(&format!("{p}.self_attn.v_proj.weight"), &h);
                self.add_bias(&format!("{p}.self_attn.q_proj.bias"), &mut q);
                self.add_bias(&format!("{p}.self_attn.k_proj.bias"), &mut k);
                self.add_bias(&format!("{p}.self_attn.v_proj.bias"), &mut v);
                self.rope(&mut q, hd, pos);
                self.rope(&mut k, hd, pos);
                qs.push(q);
                ks.push(k);
                vs.push(v);
            }
            for (pos, x) in xs.iter_mut().enumerate() {
                let mut att = vec![0.0; nh * hd];
                for h in 0..nh {
                    let kh = h / (nh / nkv);
                    let q = &qs[pos][h * hd..(h + 1) * hd];
                    let sc: Vec<f64> = (0..=pos)
                        .map(|t| {
                            q.iter().zip(&ks[t][kh * hd..(kh + 1) * hd]).map(|(a, b)| a * b).sum::<f64>()
                                / (hd as f64).sqrt()
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for t in 0..=pos {
                        for j in 0..hd {
                            att[h * hd + j] += e[t] / z * vs[t][kh * hd + j];
                        }
                    }
                }
                let o = self.mv(&format!("{p}.self_attn.o_proj.weight"), &att);
                x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
                let h = self.norm(&format!("{p}.post_attention_layernorm.weight"), x);
                let g = self.mv(&format!("{p}.mlp.gate_proj.weight"), &h);
                let u = self.mv(&format!("{p}.mlp.up_proj.weight"), &h);
                let a: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
                let dn = self.mv(&format!("{p}.mlp.down_proj.weight"), &a);
                x.iter_mut().zip(&dn).for_each(|(a, b)| *a += b);
            }
        }
        let head = if self.w.contains_key("lm_head.weight") { "lm_head.weight" } else { "model.embed_tokens.weight" };
        xs.iter().map(|x| self.mv(head, &self.norm("model.norm.weight", x))).collect()
    }
}

fn engine_logits_per_prefix(model: &ferry_engine::Model<ferry_kernels::cpu::CpuBackend>, ids: &[u32]) -> Vec<Vec<f32>> {
    // One token per pass: the logits after each position.
    let mut pool = pool(model, 4, ids.len().div_ceil(4));
    let alloc = pool.alloc(ids.len().div_ceil(4)).expect("pages");
    let pages = alloc.pages().to_vec();
    (0..ids.len())
        .map(|i| {
            model
                .forward(&mut pool, &[SeqChunk { tokens: &ids[i..=i], start: i, pages: &pages, logits: true }])
                .expect("forward")
                .remove(0)
        })
        .collect()
}

fn check_against_reference(spec: TinySpec) {
    let tiny = TinyModel::new(spec.clone());
    let model = load(&tiny.hf());
    let reference = Reference::open(&tiny.hf());
    let ids = prompt(40, 9, model.config().vocab_size);
    let want = reference.logits(&ids);
    let got = engine_logits_per_prefix(&model, &ids);
    for (pos, (g, w)) in got.iter().zip(&want).enumerate() {
        let w32: Vec<f32> = w.iter().map(|&v| v as f32).collect();
        let d = rel_diff(g, &w32);
        assert!(d < 1e-4, "{spec:?} position {pos}: relative difference {d}");
    }
}

#[test]
fn engine_matches_f64_reference_llama_tied() {
    check_against_reference(TinySpec::default());
}

#[test]
fn engine_matches_f64_reference_untied_with_llama3_rope_scaling() {
    check_against_reference(TinySpec { tie: false, rope_scaling: true, ..TinySpec::default() });
}

#[test]
fn engine_matches_f64_reference_qwen2_biases_no_gqa() {
    check_against_reference(TinySpec { arch: Arch::Qwen2, kv_heads: 4, ..TinySpec::default() });
}

#[test]
fn gguf_and_hf_copies_give_the_same_logits_and_tokens() {
    for ty in [0u32, 1, 30, 8, 3, 12, 14] {
        for arch in [Arch::Llama, Arch::Qwen2] {
            // The K formats' blocks are 256 weights: every width a multiple of 256.
            let (hidden, ffn) = if matches!(ty, 12 | 14) { (256, 512) } else { (64, 128) };
            let tiny = TinyModel::new(TinySpec { gguf_matrix_type: ty, arch, hidden, ffn, ..TinySpec::default() });
            let hf = load(&tiny.hf());
            let gg = load(&tiny.gguf());
            let text = "Once upon a time, 2024 ferries <|im_end|> crossed the river.";
            let ids = hf.tokenizer().encode(text).expect("encode");
            assert_eq!(gg.tokenizer().encode(text).expect("encode"), ids, "tokenizers differ");
            assert!(ids.contains(&2), "control token recognised");
            let a = engine_logits_per_prefix(&hf, &ids);
            let b = engine_logits_per_prefix(&gg, &ids);
            for (pos, (a, b)) in a.iter().zip(&b).enumerate() {
                let d = rel_diff(b, a);
                assert!(d < 1e-4, "type {ty} {arch:?} position {pos}: relative difference {d}");
            }
            assert_eq!(hf.fingerprint(), gg.fingerprint(), "same weights, same fingerprint");
        }
    }
}
