//! Host-side preparation of attention and K/V writes, shared by the backends: the shape and
//! bounds checks, and the index tables (row → sequence and position, flattened
//! page tables, slot offsets) that a device kernel reads. Pure functions, tested here without a
//! GPU.

use crate::error::check;
use crate::{AttnSeq, AttnShape, KernelError, KvLayout};

/// What the attention kernel reads besides Q and the pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttnPlan {
    /// Query rows.
    pub rows: usize,
    /// Per row: its sequence (-1: in none; its output is zero).
    pub row_seq: Vec<i32>,
    /// Per row: its position (it attends to positions `0..=pos`).
    pub row_pos: Vec<i32>,
    /// Every sequence's pages, one after another.
    pub pages: Vec<u32>,
    /// Per sequence: where its pages start in `pages`.
    pub seq_page0: Vec<u32>,
}

/// Checks an attention call and builds its tables; `q_len` values of Q, `pool_pages` pages.
pub fn attention(
    layout: &KvLayout,
    shape: AttnShape,
    seqs: &[AttnSeq<'_>],
    q_len: usize,
    out_len: usize,
    pool_pages: usize,
) -> Result<AttnPlan, KernelError> {
    let AttnShape { n_heads, n_kv_heads, head_dim } = shape;
    let width = n_heads * head_dim;
    check(
        "attention",
        n_kv_heads == layout.num_kv_heads
            && head_dim == layout.head_dim
            && n_kv_heads > 0
            && n_heads % n_kv_heads == 0
            && width > 0,
        || format!("{n_heads} heads / {n_kv_heads} kv heads of {head_dim} against {layout:?}"),
    )?;
    check("attention", q_len == out_len && q_len.is_multiple_of(width), || format!("q {q_len} out {out_len}"))?;
    let rows = q_len / width;
    let mut plan =
        AttnPlan { rows, row_seq: vec![-1; rows], row_pos: vec![0; rows], pages: Vec::new(), seq_page0: Vec::new() };
    for (s, seq) in seqs.iter().enumerate() {
        check("attention", seq.q_row + seq.n_q <= rows, || format!("sequence {s} rows past {rows}"))?;
        let need = (seq.pos0 + seq.n_q).div_ceil(layout.page_size);
        check("attention", seq.pages.len() >= need, || {
            format!("sequence {s} has {} pages, needs {need}", seq.pages.len())
        })?;
        if let Some(&p) = seq.pages[..need].iter().find(|&&p| p as usize >= pool_pages) {
            return Err(KernelError::PageOutOfRange { page: p, slot: 0 });
        }
        let pos_max = seq.pos0 + seq.n_q;
        check("attention", i32::try_from(pos_max).is_ok() && u32::try_from(plan.pages.len() + need).is_ok(), || {
            format!("sequence {s} is too long for the kernel's indices")
        })?;
        plan.seq_page0.push(plan.pages.len() as u32);
        plan.pages.extend_from_slice(&seq.pages[..need]);
        // Each query row belongs to one sequence: kernels write a sequence's rows from
        // several threads on that promise.
        let taken = plan.row_seq[seq.q_row..seq.q_row + seq.n_q].iter().find(|&&o| o >= 0);
        check("attention", taken.is_none(), || {
            format!("sequence {s} shares query rows with sequence {}", taken.copied().unwrap_or_default())
        })?;
        for i in 0..seq.n_q {
            plan.row_seq[seq.q_row + i] = s as i32;
            plan.row_pos[seq.q_row + i] = (seq.pos0 + i) as i32;
        }
    }
    Ok(plan)
}

/// Checks a K/V write and returns, per slot, the pool offset (in values) of its K; its V is
/// `page_size * slot_floats` further.
pub fn kv_offsets(
    layout: &KvLayout,
    layer: usize,
    slots: &[(u32, u32)],
    k_len: usize,
    v_len: usize,
    pool_pages: usize,
) -> Result<Vec<u64>, KernelError> {
    let w = layout.slot_floats();
    check("write_kv", k_len == slots.len() * w && v_len == k_len && layer < layout.num_layers, || {
        format!("k {k_len} v {v_len} for {} slots of {w}, layer {layer}", slots.len())
    })?;
    slots
        .iter()
        .map(|&(page, slot)| {
            if page as usize >= pool_pages || slot as usize >= layout.page_size {
                return Err(KernelError::PageOutOfRange { page, slot });
            }
            Ok(layout.offset(page, layer, false, slot as usize) as u64)
        })
        .collect()
}

/// Checks a copy of whole pages `first..` (`len` values) between the pool (`pool_pages`
/// pages) and the host; the values' range in the pool.
pub fn page_span(layout: &KvLayout, first: u32, len: usize, pool_pages: usize) -> Result<(usize, usize), KernelError> {
    let pf = layout.page_floats();
    check("kv copy", pf > 0 && len.is_multiple_of(pf), || format!("{len} values are not whole pages of {pf}"))?;
    let n = len / pf;
    if first as usize + n > pool_pages {
        return Err(KernelError::PageOutOfRange { page: (first as usize + n).saturating_sub(1) as u32, slot: 0 });
    }
    Ok((first as usize * pf, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout { num_layers: 2, num_kv_heads: 2, head_dim: 4, page_size: 4 }
    }

    #[test]
    fn attention_tables_map_rows_to_sequences_and_pages() {
        let shape = AttnShape { n_heads: 4, n_kv_heads: 2, head_dim: 4 };
        let a = [7u32, 3, 9];
        let b = [1u32];
        let seqs = [
            AttnSeq { pages: &a, q_row: 0, n_q: 3, pos0: 6 }, // positions 6..9: pages 7, 3, 9
            AttnSeq { pages: &b, q_row: 4, n_q: 1, pos0: 0 },
        ];
        let p = attention(&layout(), shape, &seqs, 5 * 16, 5 * 16, 10).expect("a plan");
        assert_eq!(p.rows, 5);
        assert_eq!(p.row_seq, vec![0, 0, 0, -1, 1]);
        assert_eq!(p.row_pos, vec![6, 7, 8, 0, 0]);
        assert_eq!(p.pages, vec![7, 3, 9, 1]);
        assert_eq!(p.seq_page0, vec![0, 3]);
    }

    #[test]
    fn attention_refusals_match_the_cpu_backend() {
        let shape = AttnShape { n_heads: 4, n_kv_heads: 2, head_dim: 4 };
        let short = [0u32];
        let e = attention(&layout(), shape, &[AttnSeq { pages: &short, q_row: 0, n_q: 5, pos0: 0 }], 80, 80, 10);
        assert!(matches!(e, Err(KernelError::Shape { .. })));
        let far = [10u32];
        let e = attention(&layout(), shape, &[AttnSeq { pages: &far, q_row: 0, n_q: 1, pos0: 0 }], 16, 16, 10);
        assert!(matches!(e, Err(KernelError::PageOutOfRange { page: 10, .. })));
        let bad = AttnShape { n_heads: 3, n_kv_heads: 2, head_dim: 4 };
        assert!(attention(&layout(), bad, &[], 12, 12, 10).is_err());
        // Two sequences claiming query row 1: refused (the CPU kernel writes a sequence's
        // rows from its own threads).
        let p = [0u32];
        let overlap =
            [AttnSeq { pages: &p, q_row: 0, n_q: 2, pos0: 0 }, AttnSeq { pages: &p, q_row: 1, n_q: 1, pos0: 0 }];
        let e = attention(&layout(), shape, &overlap, 48, 48, 10).expect_err("overlap refused");
        assert!(e.to_string().contains("shares query rows with sequence 0"), "{e}");
    }

    #[test]
    fn page_spans_are_whole_pages_inside_the_pool() {
        let l = layout();
        let pf = l.page_floats();
        assert_eq!(page_span(&l, 2, 2 * pf, 4).expect("in bounds"), (2 * pf, 2 * pf));
        assert!(matches!(page_span(&l, 3, 2 * pf, 4), Err(KernelError::PageOutOfRange { page: 4, .. })));
        assert!(matches!(page_span(&l, 0, pf + 1, 4), Err(KernelError::Shape { .. })));
        assert_eq!(page_span(&l, 4, 0, 4).expect("empty"), (4 * pf, 0));
    }

    #[test]
    fn kv_offsets_follow_the_layout() {
        let l = layout();
        let o = kv_offsets(&l, 1, &[(2, 3), (0, 0)], 16, 16, 4).expect("offsets");
        assert_eq!(o, vec![l.offset(2, 1, false, 3) as u64, l.offset(0, 1, false, 0) as u64]);
        // V sits page_size slots after K.
        assert_eq!(l.offset(2, 1, true, 3) as u64, o[0] + (l.page_size * l.slot_floats()) as u64);
        assert!(matches!(kv_offsets(&l, 0, &[(4, 0)], 8, 8, 4), Err(KernelError::PageOutOfRange { page: 4, .. })));
        assert!(kv_offsets(&l, 2, &[(0, 0)], 8, 8, 4).is_err());
    }
}
