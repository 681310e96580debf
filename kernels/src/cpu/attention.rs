//! Causal attention over page-major KV pages, one rayon task per (query row, KV head): the
//! task reads each of its positions' K and V once for the whole query group sharing that KV
//! head (grouped-query attention), a page's slots at a time.

use rayon::prelude::*;

use super::arena::KvArena;
use super::dot::dot;
use super::matmul::SendPtr;
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
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let (ps, slot) = (layout.page_size, layout.slot_floats());
    let rows = out.len() / width;
    let ptr = SendPtr(out.as_mut_ptr());
    (0..rows * n_kv_heads).into_par_iter().for_each_init(Vec::new, |scores: &mut Vec<f32>, idx| {
        let (row, kvh) = (idx / n_kv_heads, idx % n_kv_heads);
        let heads = kvh * group..(kvh + 1) * group;
        // SAFETY: this task alone writes the group's heads of this row.
        let o =
            unsafe { std::slice::from_raw_parts_mut(ptr.at(row * width + heads.start * head_dim), group * head_dim) };
        o.fill(0.0);
        let Ok(s) = usize::try_from(plan.row_seq[row]) else { return };
        let seq = &seqs[s];
        let n = plan.row_pos[row] as usize + 1;
        let qs = &q[row * width + heads.start * head_dim..row * width + heads.end * head_dim];
        // scores[h * n + t]: head h of the group against position t.
        scores.clear();
        scores.resize(group * n, 0.0);
        // The K (or V) vectors of this KV head at positions `t0..t0 + len` of page `page`.
        let block = |page: u32, v: bool, len: usize| {
            // SAFETY: the sequence's pages are read by its forward pass only (arena docs); the
            // plan checked every page against the pool.
            unsafe { pool.read(layout.offset(page, layer, v, 0), len * slot) }.unwrap_or(&[])
        };
        for (pi, &page) in seq.pages[..n.div_ceil(ps)].iter().enumerate() {
            let t0 = pi * ps;
            let len = ps.min(n - t0);
            for (j, k) in block(page, false, len).chunks_exact(slot).enumerate() {
                let k = &k[kvh * head_dim..(kvh + 1) * head_dim];
                for (h, qh) in qs.chunks_exact(head_dim).enumerate() {
                    scores[h * n + t0 + j] = dot(qh, k) * scale;
                }
            }
        }
        for sc in scores.chunks_exact_mut(n) {
            let max = sc.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let mut sum = 0.0f32;
            for v in sc.iter_mut() {
                *v = (*v - max).exp();
                sum += *v;
            }
            let inv = 1.0 / sum;
            sc.iter_mut().for_each(|v| *v *= inv);
        }
        for (pi, &page) in seq.pages[..n.div_ceil(ps)].iter().enumerate() {
            let t0 = pi * ps;
            let len = ps.min(n - t0);
            for (j, v) in block(page, true, len).chunks_exact(slot).enumerate() {
                let v = &v[kvh * head_dim..(kvh + 1) * head_dim];
                for (h, oh) in o.chunks_exact_mut(head_dim).enumerate() {
                    let p = scores[h * n + t0 + j];
                    oh.iter_mut().zip(v).for_each(|(o, v)| *o += p * v);
                }
            }
        }
    });
    Ok(())
}
