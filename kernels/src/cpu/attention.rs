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

#[cfg(test)]
mod tests {
    use crate::cpu::CpuBackend;
    use crate::{AttnSeq, AttnShape, Backend, KvLayout, PoolLayer};

    fn val(i: usize, salt: usize) -> f32 {
        ((i * 2_654_435_761 + salt * 97) % 1000) as f32 / 500.0 - 1.0
    }

    /// The tiled kernel against naive f64 attention: two sequences (the second a later chunk,
    /// starting at position 5), three query heads per KV head, pages out of order, and more
    /// rows than one task's block (11 and 13 against 8).
    #[test]
    fn tiled_attention_matches_naive_attention() {
        let (n_heads, n_kv, hd, ps, layer) = (6, 2, 8, 4, 1);
        let layout = KvLayout { num_layers: 2, num_kv_heads: n_kv, head_dim: hd, page_size: ps };
        let (slot, width) = (n_kv * hd, n_heads * hd);
        let be = CpuBackend::default();
        let pool = be.kv_pool(&layout, 16).expect("pool");
        let specs: [(Vec<u32>, usize, usize); 2] = [(vec![3, 0, 7], 0, 11), (vec![1, 2, 4, 5, 6, 9], 5, 13)];
        let kv = |s: usize, n: usize| -> (Vec<f32>, Vec<f32>) {
            ((0..n * slot).map(|i| val(i, 2 * s)).collect(), (0..n * slot).map(|i| val(i, 2 * s + 1)).collect())
        };
        for (s, (pages, pos0, n_q)) in specs.iter().enumerate() {
            let n = pos0 + n_q;
            let slots: Vec<(u32, u32)> = (0..n).map(|p| (pages[p / ps], (p % ps) as u32)).collect();
            let (k, v) = kv(s, n);
            be.write_kv(&pool, &layout, layer, &slots, &k, &v).expect("write");
        }
        let rows = 11 + 13;
        let q: Vec<f32> = (0..rows * width).map(|i| val(i, 9)).collect();
        let seqs = [
            AttnSeq { pages: &specs[0].0, q_row: 0, n_q: 11, pos0: 0 },
            AttnSeq { pages: &specs[1].0, q_row: 11, n_q: 13, pos0: 5 },
        ];
        let mut out = vec![0.0; rows * width];
        let shape = AttnShape { n_heads, n_kv_heads: n_kv, head_dim: hd };
        be.attention(&q, PoolLayer { pool: &pool, layout: &layout, layer }, shape, &seqs, &mut out).expect("attend");
        for (s, seq) in seqs.iter().enumerate() {
            let (k, v) = kv(s, seq.pos0 + seq.n_q);
            for i in 0..seq.n_q {
                let (row, pos) = (seq.q_row + i, seq.pos0 + i);
                for h in 0..n_heads {
                    let kvh = h / (n_heads / n_kv);
                    let qh = &q[row * width + h * hd..row * width + (h + 1) * hd];
                    let at = |t: usize, d: usize| t * slot + kvh * hd + d;
                    let sc: Vec<f64> = (0..=pos)
                        .map(|t| (0..hd).map(|d| qh[d] as f64 * k[at(t, d)] as f64).sum::<f64>() / (hd as f64).sqrt())
                        .collect();
                    let top = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = sc.iter().map(|x| (x - top).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for d in 0..hd {
                        let want: f64 = (0..=pos).map(|t| e[t] / z * v[at(t, d)] as f64).sum();
                        let got = out[row * width + h * hd + d] as f64;
                        assert!((got - want).abs() < 1e-5, "sequence {s} row {i} head {h} dim {d}: {got} vs {want}");
                    }
                }
            }
        }
    }
}
