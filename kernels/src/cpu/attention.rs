//! Causal attention over page-major KV pages, tiled: one rayon task per (block of up to
//! [`ROWS_PER_TASK`] query rows of one sequence, KV head). A task walks its positions a page
//! at a time, reads that page's K and V once for every row of its block and every query head
//! sharing the KV head (grouped-query attention), and keeps each (row, head)'s softmax online
//! (running maximum and sum, the output rescaled when the maximum grows), so a 2 k-token
//! prefill reads its K/V once per block of rows rather than once per row and head.

use rayon::prelude::*;

use super::arena::KvArena;
use super::attention_step::{Run, State, chooser};
use super::matmul::SendPtr;
use crate::{AttnSeq, AttnShape, KernelError, KvLayout, plan};

/// Query rows of one sequence per task.
const ROWS_PER_TASK: usize = 8;
/// Positions per task: longer rows are attended in spans of this many, merged after.
const SPAN: usize = 256;

pub(super) fn attention(
    q: &[f32],
    pool: &KvArena,
    layout: &KvLayout,
    layer: usize,
    shape: AttnShape,
    seqs: &[AttnSeq<'_>],
    out: &mut [f32],
) -> Result<(), KernelError> {
    attention_in_spans(q, pool, layout, layer, shape, seqs, out, SPAN)
}

/// [`attention`] with rows split into spans of `span` positions (≥ 1).
#[allow(clippy::too_many_arguments)]
fn attention_in_spans(
    q: &[f32],
    pool: &KvArena,
    layout: &KvLayout,
    layer: usize,
    shape: AttnShape,
    seqs: &[AttnSeq<'_>],
    out: &mut [f32],
    span_len: usize,
) -> Result<(), KernelError> {
    let span_len = span_len.max(1);
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
    let step = chooser(head_dim);
    let blocks: Vec<(usize, usize, usize)> = seqs
        .iter()
        .enumerate()
        .flat_map(|(s, seq)| {
            (0..seq.n_q).step_by(ROWS_PER_TASK).map(move |r0| (s, r0, ROWS_PER_TASK.min(seq.n_q - r0)))
        })
        .collect();
    // Tasks: (block, KV head, span of positions). A block whose positions reach past the span length is
    // split into spans that are attended apart and merged after (one decode row of a long
    // sequence is otherwise one task per KV head: 3 tasks on 2 threads for SmolLM2). Spans
    // are fixed multiples of SPAN from position 0, so a row's result depends on its own
    // positions only, not on its batch or chunk.
    let spans_of = |&(s, r0, rows): &(usize, usize, usize)| (seqs[s].pos0 + r0 + rows).div_ceil(span_len).max(1);
    let mut tasks = Vec::new();
    // Where each split task's partial results go: per (row, head) max, sum and head_dim values.
    let mut partial_at = Vec::new();
    let mut partial_len = 0;
    // (block, KV head, its first span's partial results) of each split block.
    let mut merges = Vec::new();
    for (b, blk) in blocks.iter().enumerate() {
        let spans = spans_of(blk);
        for kvh in 0..n_kv_heads {
            if spans > 1 {
                merges.push((b, kvh, partial_len));
            }
            for span in 0..spans {
                tasks.push((b, kvh, span));
                partial_at.push(if spans > 1 { partial_len } else { usize::MAX });
                if spans > 1 {
                    partial_len += blk.2 * group * (head_dim + 2);
                }
            }
        }
    }
    let mut partials = super::zeroed(partial_len);
    let ptr = SendPtr(out.as_mut_ptr());
    let part_ptr = SendPtr(partials.as_mut_ptr());
    (0..tasks.len()).into_par_iter().for_each_init(Vec::new, |scratch: &mut Vec<f32>, t| {
        let (b, kvh, span) = tasks[t];
        let (s, r0, rows) = blocks[b];
        let seq = &seqs[s];
        let states = rows * group;
        // Per (row, head): running maximum and sum (in the task's partial results when the
        // block is split, else in scratch); then one page's scores.
        let split = partial_at[t] != usize::MAX;
        scratch.clear();
        scratch.resize(if split { ps } else { 2 * states + ps }, 0.0);
        let (state, scores) = if split {
            // SAFETY: this task alone owns its partial region (disjoint offsets above).
            (unsafe { std::slice::from_raw_parts_mut(part_ptr.at(partial_at[t]), 2 * states) }, &mut scratch[..])
        } else {
            scratch.split_at_mut(2 * states)
        };
        let (max, sum) = state.split_at_mut(states);
        max.fill(f32::NEG_INFINITY);
        sum.fill(0.0);
        // The output of row `i`, head `h` of the group (unnormalised while split).
        let out_of = |i: usize, h: usize| {
            if split {
                let at = partial_at[t] + 2 * states + (i * group + h) * head_dim;
                // SAFETY: this task's own partial region.
                unsafe { std::slice::from_raw_parts_mut(part_ptr.at(at), head_dim) }
            } else {
                let at = (seq.q_row + r0 + i) * width + (kvh * group + h) * head_dim;
                // SAFETY: this task alone writes these rows' heads of this KV head's group.
                unsafe { std::slice::from_raw_parts_mut(ptr.at(at), head_dim) }
            }
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
        let (lo, hi) = (span * span_len, ((span + 1) * span_len).min(positions));
        for pi in lo / ps..hi.div_ceil(ps) {
            let (page, t0) = (seq.pages[pi], pi * ps);
            let len = ps.min(positions - t0);
            let (kb, vb) = (block(page, false, len), block(page, true, len));
            if kb.len() < len * slot || vb.len() < len * slot {
                continue;
            }
            // This span's slots of the page.
            let first = lo.saturating_sub(t0);
            let at = |j: usize| j * slot + kvh * head_dim;
            for i in 0..rows {
                let pos = seq.pos0 + r0 + i;
                if pos < t0 + first {
                    continue;
                }
                let seen = len.min(pos + 1 - t0).min(hi - t0);
                for h in 0..group {
                    let st = i * group + h;
                    let run =
                        Run { q: q_of(i, h), k: &kb[at(first)..], v: &vb[at(first)..], slot, n: seen - first, scale };
                    let state = State { max: &mut max[st], sum: &mut sum[st], out: out_of(i, h) };
                    // SAFETY: `chooser` picked a step this CPU runs for this head size; the run's
                    // positions are the page's slots `first..seen`, within its `len`.
                    unsafe { step(&run, state, scores) };
                }
            }
        }
        if !split {
            for i in 0..rows {
                for h in 0..group {
                    let l = sum[i * group + h];
                    if l > 0.0 {
                        let inv = 1.0 / l;
                        out_of(i, h).iter_mut().for_each(|o| *o *= inv);
                    }
                }
            }
        }
    });
    // Split blocks: each (row, head)'s spans merged in order into the output.
    merges.par_iter().for_each(|&(b, kvh, base)| {
        let (s, r0, rows) = blocks[b];
        let seq = &seqs[s];
        let (states, spans) = (rows * group, spans_of(&blocks[b]));
        let stride = states * (head_dim + 2);
        for i in 0..rows {
            for h in 0..group {
                let st = i * group + h;
                let part = |sp: usize| &partials[base + sp * stride..base + (sp + 1) * stride];
                let m = (0..spans).map(|sp| part(sp)[st]).fold(f32::NEG_INFINITY, f32::max);
                let at = (seq.q_row + r0 + i) * width + (kvh * group + h) * head_dim;
                // SAFETY: this merge alone writes these rows' heads of this KV head's group.
                let o = unsafe { std::slice::from_raw_parts_mut(ptr.at(at), head_dim) };
                let mut l = 0.0;
                for sp in 0..spans {
                    let p = part(sp);
                    if p[st] == f32::NEG_INFINITY {
                        continue;
                    }
                    let c = (p[st] - m).exp();
                    l += p[states + st] * c;
                    let v = &p[2 * states + st * head_dim..2 * states + (st + 1) * head_dim];
                    o.iter_mut().zip(v).for_each(|(o, v)| *o += c * v);
                }
                if l > 0.0 {
                    let inv = 1.0 / l;
                    o.iter_mut().for_each(|o| *o *= inv);
                }
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::attention_in_spans;
    use crate::cpu::CpuBackend;
    use crate::{AttnSeq, AttnShape, Backend, KvLayout, PoolLayer};

    /// Query heads, KV heads, page size.
    const N_HEADS: usize = 6;
    const N_KV: usize = 2;
    const PS: usize = 4;
    /// Head sizes: 8 takes the portable step; 16 and 64 (1 and 4 output registers) the
    /// AVX-512 one where the CPU has it.
    const HEAD_DIMS: [usize; 3] = [8, 16, 64];

    fn val(i: usize, salt: usize) -> f32 {
        ((i * 2_654_435_761 + salt * 97) % 1000) as f32 / 500.0 - 1.0
    }

    /// Two sequences' (pages, first position, query rows).
    fn specs() -> [(Vec<u32>, usize, usize); 2] {
        [(vec![3, 0, 7], 0, 11), (vec![1, 2, 4, 5, 6, 9], 5, 13)]
    }

    /// Sequence `s`'s K and V for its first `n` positions.
    fn kv(s: usize, n: usize, hd: usize) -> (Vec<f32>, Vec<f32>) {
        let slot = N_KV * hd;
        ((0..n * slot).map(|i| val(i, 2 * s)).collect(), (0..n * slot).map(|i| val(i, 2 * s + 1)).collect())
    }

    fn queries(hd: usize) -> Vec<f32> {
        (0..24 * N_HEADS * hd).map(|i| val(i, 9)).collect()
    }

    /// The tiled kernel against naive f64 attention: two sequences (the second a later chunk,
    /// starting at position 5), three query heads per KV head, pages out of order, and more
    /// rows than one task's block (11 and 13 against 8); whole, and with rows split into
    /// spans of positions merged after (spans of whole pages, spans that cut pages, one
    /// position each); every head size of [`HEAD_DIMS`].
    #[test]
    fn tiled_attention_matches_naive_attention() {
        for hd in HEAD_DIMS {
            attention_matches_naive_attention(hd);
        }
    }

    fn attention_matches_naive_attention(hd: usize) {
        let layer = 1;
        let layout = KvLayout { num_layers: 2, num_kv_heads: N_KV, head_dim: hd, page_size: PS };
        let be = CpuBackend::default();
        let pool = be.kv_pool(&layout, 16).expect("pool");
        let specs = specs();
        for (s, (pages, pos0, n_q)) in specs.iter().enumerate() {
            let n = pos0 + n_q;
            let slots: Vec<(u32, u32)> = (0..n).map(|p| (pages[p / PS], (p % PS) as u32)).collect();
            let (k, v) = kv(s, n, hd);
            be.write_kv(&pool, &layout, layer, &slots, &k, &v).expect("write");
        }
        let q = queries(hd);
        let seqs: Vec<AttnSeq<'_>> = specs
            .iter()
            .scan(0, |row, (pages, pos0, n_q)| {
                let seq = AttnSeq { pages, q_row: *row, n_q: *n_q, pos0: *pos0 };
                *row += n_q;
                Some(seq)
            })
            .collect();
        let shape = AttnShape { n_heads: N_HEADS, n_kv_heads: N_KV, head_dim: hd };
        let mut out = vec![0.0; q.len()];
        be.attention(&q, PoolLayer { pool: &pool, layout: &layout, layer }, shape, &seqs, &mut out).expect("attend");
        check(&q, &seqs, &out, hd, &format!("head size {hd}, whole"));
        for span in [4, 6, 1] {
            let mut split = vec![0.0; q.len()];
            attention_in_spans(&q, &pool, &layout, layer, shape, &seqs, &mut split, span).expect("attend");
            check(&q, &seqs, &split, hd, &format!("head size {hd}, spans of {span}"));
        }
    }

    /// `out` against naive f64 attention over [`kv`]'s values.
    fn check(q: &[f32], seqs: &[AttnSeq<'_>], out: &[f32], hd: usize, what: &str) {
        let (slot, width) = (N_KV * hd, N_HEADS * hd);
        for (s, seq) in seqs.iter().enumerate() {
            let (k, v) = kv(s, seq.pos0 + seq.n_q, hd);
            for i in 0..seq.n_q {
                let (row, pos) = (seq.q_row + i, seq.pos0 + i);
                for h in 0..N_HEADS {
                    let kvh = h / (N_HEADS / N_KV);
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
                        assert!(
                            (got - want).abs() < 1e-5,
                            "{what}: sequence {s} row {i} head {h} dim {d}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
