//! Causal attention over page-major KV pages, tiled: one rayon task per (block of up to
//! [`ROWS_PER_TASK`] query rows of one sequence, KV head). A task walks its positions a page
//! at a time, reads that page's K and V once for every row of its block and every query head
//! sharing the KV head (grouped-query attention), and keeps each (row, head)'s softmax online
//! (running maximum and sum, the output rescaled when the maximum grows), so a 2 k-token
//! prefill reads its K/V once per block of rows rather than once per row and head.

use rayon::prelude::*;

use super::arena::KvArena;
use super::dot::dot;
use super::matmul::SendPtr;
use crate::{AttnSeq, AttnShape, KernelError, KvLayout, plan};

/// Query rows of one sequence per task.
const ROWS_PER_TASK: usize = 8;

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
    // Checks every sequence's rows and pages against the buffers and the pool.
    plan::attention(layout, shape, seqs, q.len(), out.len(), pages_in_pool)?;
    // Rows in no sequence stay zero.
    out.fill(0.0);
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let (ps, slot) = (layout.page_size, layout.slot_floats());
    let blocks: Vec<(usize, usize, usize)> = seqs
        .iter()
        .enumerate()
        .flat_map(|(s, seq)| {
            (0..seq.n_q).step_by(ROWS_PER_TASK).map(move |r0| (s, r0, ROWS_PER_TASK.min(seq.n_q - r0)))
        })
        .collect();
    let ptr = SendPtr(out.as_mut_ptr());
    (0..blocks.len() * n_kv_heads).into_par_iter().for_each_init(Vec::new, |scratch: &mut Vec<f32>, idx| {
        let (s, r0, rows) = blocks[idx / n_kv_heads];
        let kvh = idx % n_kv_heads;
        let seq = &seqs[s];
        // Per (row, head): running maximum and sum; then one page's scores.
        let states = rows * group;
        scratch.clear();
        scratch.resize(2 * states + ps, 0.0);
        let (max, rest) = scratch.split_at_mut(states);
        let (sum, scores) = rest.split_at_mut(states);
        max.fill(f32::NEG_INFINITY);
        // The output of row `i`, head `h` of the group.
        let out_of = |i: usize, h: usize| {
            let at = (seq.q_row + r0 + i) * width + (kvh * group + h) * head_dim;
            // SAFETY: this task alone writes these rows' heads of this KV head's group.
            unsafe { std::slice::from_raw_parts_mut(ptr.at(at), head_dim) }
        };
        let q_of = |i: usize, h: usize| {
            let at = (seq.q_row + r0 + i) * width + (kvh * group + h) * head_dim;
            &q[at..at + head_dim]
        };
        // The K (or V) vectors of page `page`'s first `len` slots.
        let block = |page: u32, v: bool, len: usize| {
            // SAFETY: the sequence's pages are read by its forward pass only (arena docs); the
            // plan checked every page against the pool.
            unsafe { pool.read(layout.offset(page, layer, v, 0), len * slot) }.unwrap_or(&[])
        };
        let positions = seq.pos0 + r0 + rows;
        for (pi, &page) in seq.pages[..positions.div_ceil(ps)].iter().enumerate() {
            let t0 = pi * ps;
            let len = ps.min(positions - t0);
            let (kb, vb) = (block(page, false, len), block(page, true, len));
            if kb.len() < len * slot || vb.len() < len * slot {
                continue;
            }
            let at = |j: usize| j * slot + kvh * head_dim;
            for i in 0..rows {
                let pos = seq.pos0 + r0 + i;
                if pos < t0 {
                    continue;
                }
                let seen = len.min(pos + 1 - t0);
                for h in 0..group {
                    let qh = q_of(i, h);
                    let sc = &mut scores[..seen];
                    let mut top = f32::NEG_INFINITY;
                    for (j, v) in sc.iter_mut().enumerate() {
                        *v = dot(qh, &kb[at(j)..at(j) + head_dim]) * scale;
                        top = top.max(*v);
                    }
                    let st = i * group + h;
                    let m = max[st].max(top);
                    let o = out_of(i, h);
                    let c = (max[st] - m).exp();
                    if c != 1.0 {
                        o.iter_mut().for_each(|o| *o *= c);
                    }
                    let mut l = sum[st] * c;
                    for (j, &v) in sc.iter().enumerate() {
                        let p = (v - m).exp();
                        l += p;
                        o.iter_mut().zip(&vb[at(j)..at(j) + head_dim]).for_each(|(o, v)| *o += p * v);
                    }
                    max[st] = m;
                    sum[st] = l;
                }
            }
        }
        for i in 0..rows {
            for h in 0..group {
                let l = sum[i * group + h];
                if l > 0.0 {
                    let inv = 1.0 / l;
                    out_of(i, h).iter_mut().for_each(|o| *o *= inv);
                }
            }
        }
    });
    Ok(())
}
