//! The forward pass over a batch of sequences at mixed stages: prefill chunks of any length
//! and single decode steps run together, every sequence reading its earlier tokens from its
//! KV pages and writing this pass's K/V into them.

use ferry_kernels::{AttnSeq, AttnShape, Backend, PoolLayer};

use crate::EngineError;
use crate::model::Model;
use crate::pool::PagePool;

/// One sequence's part of a forward pass.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    /// Tokens computed in this pass (a prefill chunk, or one decode token).
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; positions before it are already in `pages`.
    pub start: usize,
    /// The sequence's pages, covering at least `start + tokens.len()` tokens.
    pub pages: &'a [u32],
    /// Return the logits of the last token.
    pub logits: bool,
}

impl<B: Backend> Model<B> {
    /// Runs `batch` through the model, writing K/V into `pool`; returns the last-token logits
    /// of each sequence that asked for them, in batch order.
    pub fn forward(&self, pool: &mut PagePool<B>, batch: &[SeqChunk<'_>]) -> Result<Vec<Vec<f32>>, EngineError> {
        self.forward_rows(pool, batch, &[])
    }

    /// [`forward`](Self::forward), with the logits of every token of the sequences whose
    /// `every` entry is true (in order: a chunk of n tokens gives n rows, the last its last
    /// token's), for prompt logprobs. Each row is `vocab_size` floats on the host: ask for
    /// them for what needs them only.
    pub fn forward_rows(
        &self,
        pool: &mut PagePool<B>,
        batch: &[SeqChunk<'_>],
        every: &[bool],
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        self.backend.pass(|| {
            let Some((logits, _)) = self.logits(pool, batch, every)? else { return Ok(Vec::new()) };
            let host = self.backend.download(&logits)?;
            Ok(host.chunks_exact(self.config.vocab_size).map(<[f32]>::to_vec).collect())
        })
    }

    /// [`forward`](Self::forward), then greedy decoding of each logits row on the backend:
    /// `(token, logprob)` per sequence that asked for logits, the lowest index among equal
    /// maxima, as [`crate::Sampler`] picks at temperature 0 without penalties. Only the tokens
    /// leave a device.
    pub fn forward_greedy(
        &self,
        pool: &mut PagePool<B>,
        batch: &[SeqChunk<'_>],
    ) -> Result<Vec<(u32, f32)>, EngineError> {
        self.backend.pass(|| {
            let Some((logits, n)) = self.logits(pool, batch, &[])? else { return Ok(Vec::new()) };
            Ok(self.backend.greedy_rows(&logits, n, self.config.vocab_size)?)
        })
    }

    /// The pass itself: the logits rows (on the backend) and how many there are.
    fn logits(
        &self,
        pool: &mut PagePool<B>,
        batch: &[SeqChunk<'_>],
        every: &[bool],
    ) -> Result<Option<(B::Buf, usize)>, EngineError> {
        let cfg = &self.config;
        let be = &self.backend;
        let layout = *pool.layout();
        if layout != self.kv_layout(layout.page_size) {
            return Err(EngineError::InvalidRequest(format!("pool layout {layout:?} does not fit the model")));
        }
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut slots = Vec::new();
        let mut seqs = Vec::with_capacity(batch.len());
        let mut logit_rows = Vec::new();
        for (i, s) in batch.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(EngineError::InvalidRequest(format!("sequence {i} has no tokens")));
            }
            let end = s.start + s.tokens.len();
            if end > cfg.max_position_embeddings {
                return Err(EngineError::InvalidRequest(format!(
                    "sequence {i} reaches position {end}, past the context of {}",
                    cfg.max_position_embeddings
                )));
            }
            if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(EngineError::InvalidRequest(format!(
                    "token id {bad} is outside the vocabulary of {}",
                    cfg.vocab_size
                )));
            }
            if s.pages.len() * layout.page_size < end {
                return Err(EngineError::InvalidRequest(format!(
                    "sequence {i}: {} pages cannot hold {end} tokens",
                    s.pages.len()
                )));
            }
            seqs.push(AttnSeq { pages: s.pages, q_row: ids.len(), n_q: s.tokens.len(), pos0: s.start });
            for (j, &t) in s.tokens.iter().enumerate() {
                let p = s.start + j;
                ids.push(t);
                positions.push(p as u32);
                slots.push((s.pages[p / layout.page_size], (p % layout.page_size) as u32));
            }
            if every.get(i).copied().unwrap_or(false) {
                logit_rows.extend(ids.len() - s.tokens.len()..ids.len());
            } else if s.logits {
                logit_rows.push(ids.len() - 1);
            }
        }
        let t = ids.len();
        let (d, qd, kvd, ff) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.intermediate_size);
        let shape = AttnShape { n_heads: cfg.num_heads, n_kv_heads: cfg.num_kv_heads, head_dim: cfg.head_dim };
        let w = &self.weights;

        let mut x = be.zeros(t * d)?;
        be.embed(&w.embed, &ids, &mut x)?;
        let mut h = be.zeros(t * d)?;
        let mut q = be.zeros(t * qd)?;
        let mut k = be.zeros(t * kvd)?;
        let mut v = be.zeros(t * kvd)?;
        let mut attn = be.zeros(t * qd)?;
        let mut gate = be.zeros(t * ff)?;
        let mut up = be.zeros(t * ff)?;
        let mut act = be.zeros(t * ff)?;
        for (li, l) in w.layers.iter().enumerate() {
            be.rms_norm(&x, &l.attn_norm, cfg.rms_norm_eps, &mut h)?;
            l.qkv.matmul(be, &h, t, &mut [&mut q, &mut k, &mut v])?;
            if let (Some(bq), Some(bk), Some(bv)) = (&l.bq, &l.bk, &l.bv) {
                be.add_bias(&mut q, bq)?;
                be.add_bias(&mut k, bk)?;
                be.add_bias(&mut v, bv)?;
            }
            be.rope(&mut q, cfg.num_heads, &positions, &self.rope)?;
            be.rope(&mut k, cfg.num_kv_heads, &positions, &self.rope)?;
            be.write_kv(pool.storage(), &layout, li, &slots, &k, &v)?;
            be.attention(&q, PoolLayer { pool: pool.storage(), layout: &layout, layer: li }, shape, &seqs, &mut attn)?;
            be.matmul(&attn, t, &l.wo, &mut h)?;
            be.add_assign(&mut x, &h)?;
            be.rms_norm(&x, &l.ffn_norm, cfg.rms_norm_eps, &mut h)?;
            l.gate_up.matmul(be, &h, t, &mut [&mut gate, &mut up])?;
            be.silu_mul(&gate, &up, &mut act)?;
            be.matmul(&act, t, &l.w_down, &mut h)?;
            be.add_assign(&mut x, &h)?;
        }
        if logit_rows.is_empty() {
            return Ok(None);
        }
        let n = logit_rows.len();
        let mut last = be.zeros(n * d)?;
        be.gather_rows(&x, d, &logit_rows, &mut last)?;
        let mut normed = be.zeros(n * d)?;
        be.rms_norm(&last, &w.norm, cfg.rms_norm_eps, &mut normed)?;
        let mut logits = be.zeros(n * cfg.vocab_size)?;
        be.matmul(&normed, n, w.lm_head.as_ref().unwrap_or(&w.embed), &mut logits)?;
        Ok(Some((logits, n)))
    }
}
