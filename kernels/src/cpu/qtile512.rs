//! The [`qtile`](super::qtile) product with AVX-512 VNNI: for each block of a group, its 8
//! quad vectors (16 weight rows × 4 values) are unpacked once and multiplied by each of up to
//! [`ACTS`] activation rows' 4 values broadcast to every lane (`vpdpbusd`, weights as unsigned
//! bytes; Q8_0's signed weights as `|w|` against `x` with `w`'s sign), giving lane `c` row
//! `c`'s exact integer sum; then the block's scaling in 16 lanes, the arithmetic of
//! [`qtile`](super::qtile)'s portable kernel lane by lane.

use std::arch::x86_64::*;

use super::qdot::Prep;
use super::qtile::offset_parts;
use super::tiled::{LANES, Tiled, TiledRef};
use crate::quant::{BLOCK, BlockFormat};

/// Activation rows per pass over a group's blocks.
pub(super) const ACTS: usize = 4;

/// A group's block as 8 quad vectors (weights as unsigned bytes) and, for Q8_0, the lanes'
/// signs (a bit per byte: the weight is negative).
///
/// # Safety
/// AVX-512F and BW; `at` points at a group's block of `fmt`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(super) unsafe fn quads(fmt: BlockFormat, at: *const u8) -> ([__m512i; 8], [__mmask64; 8]) {
    let mut q = [_mm512_setzero_si512(); 8];
    let mut neg = [0; 8];
    match fmt {
        BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
            let mask = _mm512_set1_epi8(0x0F);
            for p in 0..4 {
                // SAFETY: chunk p of the block (the caller's promise).
                let raw = unsafe { _mm512_loadu_si512(at.add(64 * p).cast()) };
                q[p] = _mm512_and_si512(raw, mask);
                q[p + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
            }
        }
        BlockFormat::Q8_0 => {
            for p in 0..8 {
                // SAFETY: as above.
                let raw = unsafe { _mm512_loadu_si512(at.add(64 * p).cast()) };
                neg[p] = _mm512_movepi8_mask(raw);
                q[p] = _mm512_abs_epi8(raw);
            }
        }
    }
    (q, neg)
}

/// Lane `c`: `Σ_j q_j·x_j` over row `c`'s block (`q` from [`quads`]) and the block's 32
/// activation bytes at `x`.
///
/// # Safety
/// AVX-512F, BW and VNNI; `x` points at 32 readable bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
pub(super) unsafe fn block_sums(q: &[__m512i; 8], neg: &[__mmask64; 8], signed: bool, x: *const i8) -> __m512i {
    let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    for p in (0..8).step_by(2) {
        // SAFETY: quads p and p + 1 of the block's activations (the caller's promise).
        let (u, v) = unsafe {
            (
                _mm512_set1_epi32(x.add(4 * p).cast::<i32>().read_unaligned()),
                _mm512_set1_epi32(x.add(4 * p + 4).cast::<i32>().read_unaligned()),
            )
        };
        let (u, v) = if signed {
            let z = _mm512_setzero_si512();
            (_mm512_mask_sub_epi8(u, neg[p], z, u), _mm512_mask_sub_epi8(v, neg[p + 1], z, v))
        } else {
            (u, v)
        };
        s0 = _mm512_dpbusd_epi32(s0, q[p], u);
        s1 = _mm512_dpbusd_epi32(s1, q[p + 1], v);
    }
    _mm512_add_epi32(s0, s1)
}

/// The cells' last step, lane by lane: `acc + off·factor` (`None`: Q8_0, `acc`).
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn finish(acc: __m512, off: __m512, factor: Option<f32>) -> __m512 {
    match factor {
        Some(f) => _mm512_add_ps(acc, _mm512_mul_ps(off, _mm512_set1_ps(f))),
        None => acc,
    }
}

/// The lanes of group `g` that are rows of `w`.
#[inline]
pub(super) fn lanes(w: &TiledRef<'_>, g: usize) -> __mmask16 {
    let live = (w.rows - g * LANES).min(LANES);
    if live == LANES { 0xFFFF } else { (1u16 << live) - 1 }
}

/// `A` activation rows against group `g`: each row's 16 cells.
///
/// # Safety
/// AVX-512F, BW, VNNI and FMA; `w` has group `g`; every row of `ps` has `w.blocks` blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
#[inline]
unsafe fn group<const A: usize>(ps: [&Prep<'_>; A], w: &TiledRef<'_>, g: usize) -> [__m512; A] {
    let (nb, gb) = (w.blocks, Tiled::group_block_bytes(w.fmt));
    for p in ps {
        assert!(p.q.len() >= nb * BLOCK && p.deltas.len() >= nb && p.sums.len() >= nb);
    }
    w.assert_groups(g + 1);
    let offsets = offset_parts(w);
    let signed = w.fmt == BlockFormat::Q8_0;
    let mut acc = [_mm512_setzero_ps(); A];
    let mut off = [_mm512_setzero_ps(); A];
    for b in 0..nb {
        let at = (g * nb + b) * LANES;
        // SAFETY: group g's block b, its scales and offset coefficients (asserted above: the
        // vectors hold whole groups).
        let (q, neg) = unsafe { quads(w.fmt, w.quants.as_ptr().add(at / LANES * gb)) };
        let d = unsafe { _mm512_loadu_ps(w.scales.as_ptr().add(at)) };
        let c = offsets.map(|(cs, _)| unsafe { _mm512_loadu_ps(cs.as_ptr().add(at)) });
        for a in 0..A {
            // SAFETY: block b of row a's activations (asserted).
            let s = unsafe { block_sums(&q, &neg, signed, ps[a].q.as_ptr().add(b * BLOCK)) };
            let scale = _mm512_mul_ps(d, _mm512_set1_ps(ps[a].deltas[b]));
            acc[a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[a]);
            if let Some(c) = c {
                off[a] = _mm512_fmadd_ps(c, _mm512_set1_ps(ps[a].sums[b]), off[a]);
            }
        }
    }
    std::array::from_fn(|a| finish(acc[a], off[a], offsets.map(|(_, f)| f)))
}

/// Activation rows `ps` against group `g`, their cells into `out` (row `a` at `a·stride`),
/// [`ACTS`] rows a pass.
///
/// # Safety
/// As [`group`]; `out` valid for writes of the group's live lanes in each row.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
pub(super) unsafe fn group_rows(ps: &[Prep<'_>], w: &TiledRef<'_>, g: usize, out: *mut f32, stride: usize) {
    let live = lanes(w, g);
    for (i, t) in ps.chunks(ACTS).enumerate() {
        // SAFETY: the caller's promises; rows i·ACTS.. of the output.
        unsafe {
            let o = out.add(i * ACTS * stride);
            match t {
                [a, b, c, d] => store(group::<4>([a, b, c, d], w, g), o, stride, live),
                [a, b, c] => store(group::<3>([a, b, c], w, g), o, stride, live),
                [a, b] => store(group::<2>([a, b], w, g), o, stride, live),
                [a] => store(group::<1>([a], w, g), o, stride, live),
                _ => unreachable!("chunks of 1..=ACTS"),
            }
        }
    }
}

/// Row `a`'s `live` lanes of `cells` to `out + a·stride`.
///
/// # Safety
/// AVX-512F; those cells writable.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store<const A: usize>(cells: [__m512; A], out: *mut f32, stride: usize, live: __mmask16) {
    for (a, v) in cells.into_iter().enumerate() {
        // SAFETY: the caller's cells.
        unsafe { _mm512_mask_storeu_ps(out.add(a * stride), live, v) };
    }
}

/// A [`TiledKernel`](super::qtile::TiledKernel): every group, [`ACTS`] activation rows a pass.
///
/// # Safety
/// AVX-512F, BW, VNNI and FMA; as [`TiledKernel`](super::qtile::TiledKernel).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
pub(super) unsafe fn rows(ps: &[Prep<'_>], w: &TiledRef<'_>, g0: usize, g1: usize, out: *mut f32, stride: usize) {
    for g in g0..g1 {
        // SAFETY: the caller's promises; group g's cells start 16·(g − g0) into each row.
        unsafe { group_rows(ps, w, g, out.add((g - g0) * LANES), stride) };
    }
}

/// Exact mode on tiled weights, `A` activation rows (f32) against group `g`: per block, each
/// of its 32 weights as 16 lanes of f32 (shifted out of its quad vector) times the activation
/// broadcast, four partial sums (one a position in the quad), then `acc = fma(s, d, acc)` and the offsets as in fast mode.
///
/// # Safety
/// AVX-512F and FMA; `w` has group `g`; every row of `ps` has `w.blocks` blocks (`x`, `sums`).
#[target_feature(enable = "avx512f,avx512bw,fma")]
#[inline]
unsafe fn exact_group<const A: usize>(ps: [&Prep<'_>; A], w: &TiledRef<'_>, g: usize) -> [__m512; A] {
    let (nb, gb) = (w.blocks, Tiled::group_block_bytes(w.fmt));
    for p in ps {
        assert!(p.x.len() >= nb * BLOCK && p.sums.len() >= nb);
    }
    w.assert_groups(g + 1);
    let offsets = offset_parts(w);
    let signed = w.fmt == BlockFormat::Q8_0;
    let nibbles = _mm512_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0);
    let mut acc = [_mm512_setzero_ps(); A];
    let mut off = [_mm512_setzero_ps(); A];
    for b in 0..nb {
        let at = (g * nb + b) * LANES;
        let base = w.quants.as_ptr().wrapping_add(at / LANES * gb);
        // Quad vector p holds weights 4p..4p + 4 of every row (Q4: chunk p's low nibbles, then
        // its high ones as quads 4..8; Q8_0: chunk p, signed).
        let quad = |p: usize| -> __m512i {
            // SAFETY: group g's block b (asserted).
            unsafe {
                match w.fmt {
                    BlockFormat::Q8_0 => _mm512_loadu_si512(base.add(64 * p).cast()),
                    // Only each byte's low 4 bits are read (below): no masking.
                    _ => {
                        let raw = _mm512_loadu_si512(base.add(64 * (p % 4)).cast());
                        if p < 4 { raw } else { _mm512_srli_epi32::<4>(raw) }
                    }
                }
            }
        };
        let mut s = [[_mm512_setzero_ps(); 4]; A];
        for p in 0..8 {
            let v = quad(p);
            let ws: [__m512; 4] = if signed {
                [
                    _mm512_srai_epi32::<24>(_mm512_slli_epi32::<24>(v)),
                    _mm512_srai_epi32::<24>(_mm512_slli_epi32::<16>(v)),
                    _mm512_srai_epi32::<24>(_mm512_slli_epi32::<8>(v)),
                    _mm512_srai_epi32::<24>(v),
                ]
                .map(|i| _mm512_cvtepi32_ps(i))
            } else {
                // A nibble is the low 4 bits of its lane once shifted down: a permutation of
                // 0.0..=15.0 reads only those, so it converts without masking.
                [v, _mm512_srli_epi32::<8>(v), _mm512_srli_epi32::<16>(v), _mm512_srli_epi32::<24>(v)]
                    .map(|i| _mm512_permutexvar_ps(i, nibbles))
            };
            for a in 0..A {
                for (j, wj) in ws.iter().enumerate() {
                    // SAFETY: activation 32b + 4p + j of row a (asserted).
                    let x = unsafe { *ps[a].x.get_unchecked(b * BLOCK + 4 * p + j) };
                    s[a][j] = _mm512_fmadd_ps(*wj, _mm512_set1_ps(x), s[a][j]);
                }
            }
        }
        // SAFETY: group g's scales and offset coefficients of block b.
        let d = unsafe { _mm512_loadu_ps(w.scales.as_ptr().add(at)) };
        let c = offsets.map(|(cs, _)| unsafe { _mm512_loadu_ps(cs.as_ptr().add(at)) });
        for a in 0..A {
            let sum = _mm512_add_ps(_mm512_add_ps(s[a][0], s[a][1]), _mm512_add_ps(s[a][2], s[a][3]));
            acc[a] = _mm512_fmadd_ps(sum, d, acc[a]);
            if let Some(c) = c {
                off[a] = _mm512_fmadd_ps(c, _mm512_set1_ps(ps[a].sums[b]), off[a]);
            }
        }
    }
    std::array::from_fn(|a| finish(acc[a], off[a], offsets.map(|(_, f)| f)))
}

/// Exact mode, a [`TiledKernel`](super::qtile::TiledKernel) (for a few rows: more go to the
/// SGEMM): every group, [`ACTS`] activation rows a pass.
///
/// # Safety
/// AVX-512F, BW and FMA; as [`TiledKernel`](super::qtile::TiledKernel), the rows prepared for
/// exact mode.
#[target_feature(enable = "avx512f,avx512bw,fma")]
pub(super) unsafe fn exact_rows(ps: &[Prep<'_>], w: &TiledRef<'_>, g0: usize, g1: usize, out: *mut f32, stride: usize) {
    for g in g0..g1 {
        let live = lanes(w, g);
        for (i, t) in ps.chunks(ACTS).enumerate() {
            // SAFETY: the caller's promises; rows i·ACTS.. of the output, group g's cells.
            unsafe {
                let o = out.add(i * ACTS * stride + (g - g0) * LANES);
                match t {
                    [a, b, c, d] => store(exact_group::<4>([a, b, c, d], w, g), o, stride, live),
                    [a, b, c] => store(exact_group::<3>([a, b, c], w, g), o, stride, live),
                    [a, b] => store(exact_group::<2>([a, b], w, g), o, stride, live),
                    [a] => store(exact_group::<1>([a], w, g), o, stride, live),
                    _ => unreachable!("chunks of 1..=ACTS"),
                }
            }
        }
    }
}
