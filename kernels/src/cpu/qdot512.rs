//! Exact mode's [`qdot`](super::qdot) products with AVX-512F (16-lane f32), `R` weight rows
//! against one activation row per call: the activations' loads, the call and the block loop
//! are shared by the rows, each row keeps its own accumulator, and the blocks' offsets
//! (`Σ_b c_b·sums_b`) are summed 16 blocks to a vector instead of by a second dot product per
//! row. A row's arithmetic is the same whatever `R` is, so a matrix product gives the same bits
//! however its columns are grouped. Also fast mode's activation quantizer. (Fast mode's
//! products with AVX-512 VNNI are [`qtile512`](super::qtile512)'s, on tiled weights.)

use std::arch::x86_64::*;

use super::packed::{Packed, Row};
use super::qdot::Prep;
use crate::quant::{BLOCK, BlockFormat};

/// Rows per call in a matrix product.
pub(super) const GROUP: usize = 4;

/// `R` consecutive rows of a [`Packed`] matrix as raw parts: the first row's values, scales
/// and mins (Q4_1), rows `blocks` blocks apart.
#[derive(Clone, Copy)]
struct Rows {
    fmt: BlockFormat,
    blocks: usize,
    quants: *const u8,
    scales: *const f32,
    mins: *const f32,
}

impl Rows {
    fn of_row(w: &Row<'_>) -> Self {
        Self {
            fmt: w.fmt,
            blocks: w.scales.len(),
            quants: w.quants.as_ptr(),
            scales: w.scales.as_ptr(),
            mins: w.mins.as_ptr(),
        }
    }

    /// Rows `first..first + r` of `w`. Panics unless they exist.
    fn of_packed(w: &Packed, first: usize, r: usize) -> Self {
        let nb = w.blocks;
        assert!((first + r) * nb <= w.scales.len(), "rows {first}..{} of {}", first + r, w.scales.len() / nb.max(1));
        let qb = Packed::quant_bytes(w.fmt);
        // SAFETY (of the pointer offsets): within the vectors, checked just above.
        Self {
            fmt: w.fmt,
            blocks: nb,
            quants: unsafe { w.quants.as_ptr().add(first * nb * qb) },
            scales: unsafe { w.scales.as_ptr().add(first * nb) },
            mins: if w.mins.is_empty() { w.mins.as_ptr() } else { unsafe { w.mins.as_ptr().add(first * nb) } },
        }
    }
}

/// `Σ_b c_b·sums_b` of row `r` in 16 lanes: `c_b` is Q4_1's min, Q4_0's `−8·d` (the factor
/// applied once, after: exact, a power of two), nothing for Q8_0.
///
/// # Safety
/// AVX-512F; `w` holds row `r` and `sums` its `w.blocks` values.
#[target_feature(enable = "avx512f,fma")]
#[inline]
unsafe fn offsets(w: Rows, r: usize, sums: &[f32]) -> __m512 {
    let nb = w.blocks;
    let (c, factor) = match w.fmt {
        BlockFormat::Q4_1 => (w.mins, 1.0),
        BlockFormat::Q4_0 => (w.scales, -8.0),
        BlockFormat::Q8_0 => return _mm512_setzero_ps(),
    };
    let mut acc = _mm512_setzero_ps();
    for c0 in (0..nb).step_by(16) {
        let m: __mmask16 = if nb - c0 >= 16 { 0xFFFF } else { (1u16 << (nb - c0)) - 1 };
        // SAFETY: the masked lanes read blocks c0..nb of row r and of `sums` only.
        unsafe {
            let cv = _mm512_maskz_loadu_ps(m, c.add(r * nb + c0));
            acc = _mm512_fmadd_ps(cv, _mm512_maskz_loadu_ps(m, sums.as_ptr().add(c0)), acc);
        }
    }
    _mm512_mul_ps(acc, _mm512_set1_ps(factor))
}

/// Exact mode, `R` rows: per row `Σ_b d_b·(Σ_j x_j·q_j)` in one 16-lane accumulator, plus its
/// offsets.
///
/// # Safety
/// AVX-512F and FMA; `w` holds `R` rows; `p` has `w.blocks` blocks.
#[target_feature(enable = "avx512f,fma")]
#[inline]
unsafe fn exact<const R: usize>(p: &Prep<'_>, w: Rows) -> [f32; R] {
    let nb = w.blocks;
    assert!(p.x.len() >= nb * BLOCK && p.sums.len() >= nb);
    let x = p.x.as_ptr();
    let mut acc = [_mm512_setzero_ps(); R];
    let mask = _mm_set1_epi8(0x0F);
    // SAFETY (every load below): block b of each of the R rows and of the activations exists
    // (the caller's promise and the assertion above).
    match w.fmt {
        BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
            for b in 0..nb {
                let (x0, x1) = unsafe { (_mm512_loadu_ps(x.add(b * BLOCK)), _mm512_loadu_ps(x.add(b * BLOCK + 16))) };
                for (r, acc) in acc.iter_mut().enumerate() {
                    let (raw, d) =
                        unsafe { (_mm_loadu_si128(w.quants.add((r * nb + b) * 16).cast()), *w.scales.add(r * nb + b)) };
                    let lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask)));
                    let hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask)));
                    let s = _mm512_fmadd_ps(x1, hi, _mm512_mul_ps(x0, lo));
                    *acc = _mm512_fmadd_ps(s, _mm512_set1_ps(d), *acc);
                }
            }
        }
        BlockFormat::Q8_0 => {
            for b in 0..nb {
                let (x0, x1) = unsafe { (_mm512_loadu_ps(x.add(b * BLOCK)), _mm512_loadu_ps(x.add(b * BLOCK + 16))) };
                for (r, acc) in acc.iter_mut().enumerate() {
                    let (q, d) = unsafe { (w.quants.add((r * nb + b) * 32), *w.scales.add(r * nb + b)) };
                    let (lo, hi) = unsafe { (_mm_loadu_si128(q.cast()), _mm_loadu_si128(q.add(16).cast())) };
                    let lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
                    let hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
                    let s = _mm512_fmadd_ps(x1, hi, _mm512_mul_ps(x0, lo));
                    *acc = _mm512_fmadd_ps(s, _mm512_set1_ps(d), *acc);
                }
            }
        }
    }
    let mut out = [0.0; R];
    for (r, o) in out.iter_mut().enumerate() {
        // SAFETY: row r exists; `p.sums` has nb values (asserted).
        *o = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], unsafe { offsets(w, r, p.sums) }));
    }
    out
}

/// Exact mode, one row (the per-row kernel; the same arithmetic as a row of a group).
///
/// # Safety
/// The CPU has AVX-512F and FMA.
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn exact_avx512(p: &Prep<'_>, w: &Row<'_>) -> f32 {
    assert!(w.quants.len() >= w.scales.len() * Packed::quant_bytes(w.fmt) && w.mins.len() >= w.min_blocks());
    // SAFETY: the row's parts are its own slices (asserted); the caller's features.
    unsafe { exact::<1>(p, Rows::of_row(w))[0] }
}

/// Exact mode, a [`RowsKernel`](super::qdot::RowsKernel): each activation row against rows
/// `first..first + len` of `w`, [`GROUP`] at a time.
///
/// # Safety
/// The CPU has AVX-512F and FMA; `out` as [`RowsKernel`](super::qdot::RowsKernel) says.
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn exact_rows(ps: &[Prep<'_>], w: &Packed, first: usize, len: usize, out: *mut f32, stride: usize) {
    let done = len - len % GROUP;
    for (a, p) in ps.iter().enumerate() {
        // SAFETY (every write): cell (a, c) with c < len, the caller's to give.
        let o = unsafe { out.add(a * stride) };
        for c in (0..done).step_by(GROUP) {
            // SAFETY: `of_packed` checked the rows exist; the caller's features.
            let t = unsafe { exact::<GROUP>(p, Rows::of_packed(w, first + c, GROUP)) };
            unsafe { std::ptr::copy_nonoverlapping(t.as_ptr(), o.add(c), GROUP) };
        }
        for c in done..len {
            // SAFETY: as above.
            unsafe { *o.add(c) = exact::<1>(p, Rows::of_packed(w, first + c, 1))[0] };
        }
    }
}

/// Fast mode's activation quantization of one 32-value block, as
/// [`Prepared`](super::qdot::Prepared) does it in plain arithmetic (`δ = max|x|/127`,
/// `q = round(x/δ)` half away from zero, clamped to ±127) and to the same bits: returns `δ`
/// and `Σ q`, or `None` for a block holding a NaN or an infinity, or whose `1/δ` is not
/// finite (subnormal values): the plain arithmetic handles those.
///
/// # Safety
/// AVX-512F and AVX-512BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn quantize_block(x: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> Option<(f32, i32)> {
    // SAFETY: two vectors of 16 within the block.
    let (a, b) = unsafe { (_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(x.as_ptr().add(16))) };
    let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(a, a) | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(b, b);
    let delta = amax / 127.0;
    let inv = if delta > 0.0 { 1.0 / delta } else { 0.0 };
    // Not finite values (NaN, ±∞) and subnormal blocks: the plain arithmetic's business.
    if nan != 0 || !amax.is_finite() || !inv.is_finite() {
        return None;
    }
    let (inv, half, one, lim) = (_mm512_set1_ps(inv), _mm512_set1_ps(0.5), _mm512_set1_ps(1.0), _mm512_set1_ps(127.0));
    let sign = _mm512_set1_ps(-0.0);
    let mut sum = 0;
    for (i, v) in [a, b].into_iter().enumerate() {
        let t = _mm512_mul_ps(v, inv);
        // Half away from zero, exactly: the fraction after truncation is exact.
        let whole = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(t);
        let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(_mm512_abs_ps(_mm512_sub_ps(t, whole)), half);
        let step = _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_and_si512(_mm512_castps_si512(t), _mm512_castps_si512(sign)),
            _mm512_castps_si512(one),
        ));
        let r = _mm512_mask_add_ps(whole, up, whole, step);
        let n = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(r, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim));
        sum += _mm512_reduce_add_epi32(n);
        // SAFETY: 16 bytes within the block's 32.
        unsafe { _mm_storeu_si128(q.as_mut_ptr().add(16 * i).cast(), _mm512_cvtepi32_epi8(n)) };
    }
    Some((delta, sum))
}
