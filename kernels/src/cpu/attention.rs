//! Causal attention over page-major KV pages, one rayon task per (query row, head).

use rayon::prelude::*;

use super::arena::KvArena;
use super::dot::{axpy, dot};
use crate::{AttnSeq, AttnShape, KernelError, KvLayout, plan};

pub(super) fn attention(
    q: &[f32],
    pool: &KvArena,
    layout: &KvLayout,
    layer: usize,
    shape: AttnShape,
    seqs: &[AttnSeq<'_>],
    out: &mut [f32],
) -> Result<(), KernelError> {
    let AttnShape { n_heads, n_kv_heads, head_dim } = shape;
    let width = n_heads * head_dim;
    let pages_in_pool = pool.len() / layout.page_floats().max(1);
    // Row → (sequence, position) for every query row; rows not in any sequence stay zero.
    let plan = plan::attention(layout, shape, seqs, q.len(), out.len(), pages_in_pool)?;
    let row_seq: Vec<Option<(usize, usize)>> = plan
        .row_seq
        .iter()
        .zip(&plan.row_pos)
        .map(|(&s, &p)| usize::try_from(s).ok().map(|s| (s, p as usize)))
        .collect();
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    out.par_chunks_mut(head_dim).enumerate().for_each(|(idx, o)| {
        let (row, head) = (idx / n_heads, idx % n_heads);
        o.fill(0.0);
        let Some((s, pos)) = row_seq[row] else { return };
        let seq = &seqs[s];
        let kvh = head / group;
        let qv = &q[row * width + head * head_dim..row * width + (head + 1) * head_dim];
        let n = pos + 1;
        let mut scores = Vec::with_capacity(n);
        let mut max = f32::NEG_INFINITY;
        for t in 0..n {
            let page = seq.pages[t / layout.page_size];
            let ko = layout.offset(page, layer, false, t % layout.page_size) + kvh * head_dim;
            // SAFETY: the sequence's pages are read by its forward pass only (arena docs);
            // bounds were checked above.
            let k = unsafe { pool.read(ko, head_dim) }.unwrap_or(&[]);
            let sc = dot(qv, k) * scale;
            max = max.max(sc);
            scores.push(sc);
        }
        let mut sum = 0.0f32;
        for sc in scores.iter_mut() {
            *sc = (*sc - max).exp();
            sum += *sc;
        }
        let inv = 1.0 / sum;
        for (t, &p) in scores.iter().enumerate() {
            let page = seq.pages[t / layout.page_size];
            let vo = layout.offset(page, layer, true, t % layout.page_size) + kvh * head_dim;
            // SAFETY: as for K.
            let v = unsafe { pool.read(vo, head_dim) }.unwrap_or(&[]);
            axpy(p * inv, v, o);
        }
    });
    Ok(())
}
