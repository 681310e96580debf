//! Causal attention over page-major KV pages, one rayon task per (query row, head).

use rayon::prelude::*;

use super::arena::KvArena;
use super::dot::{axpy, dot};
use crate::error::check;
use crate::{AttnSeq, AttnShape, KernelError, KvLayout};

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
    check(
        "attention",
        n_kv_heads == layout.num_kv_heads && head_dim == layout.head_dim && n_heads % n_kv_heads == 0,
        || format!("{n_heads} heads / {n_kv_heads} kv heads of {head_dim} against {layout:?}"),
    )?;
    check("attention", q.len() == out.len() && q.len() % width == 0, || format!("q {} out {}", q.len(), out.len()))?;
    let rows = q.len() / width;
    let pages_in_pool = pool.len() / layout.page_floats().max(1);
    // Row → (sequence, position) for every query row; rows not in any sequence stay zero.
    let mut row_seq = vec![None; rows];
    for (s, seq) in seqs.iter().enumerate() {
        check("attention", seq.q_row + seq.n_q <= rows, || format!("sequence {s} rows past {rows}"))?;
        let need = (seq.pos0 + seq.n_q).div_ceil(layout.page_size);
        check("attention", seq.pages.len() >= need, || {
            format!("sequence {s} has {} pages, needs {need}", seq.pages.len())
        })?;
        if let Some(&p) = seq.pages[..need].iter().find(|&&p| p as usize >= pages_in_pool) {
            return Err(KernelError::PageOutOfRange { page: p, slot: 0 });
        }
        for i in 0..seq.n_q {
            row_seq[seq.q_row + i] = Some((s, seq.pos0 + i));
        }
    }
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
