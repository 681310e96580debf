//! The [`qdot`](super::qdot) kernels with AVX-512: exact with 16-lane f32 (AVX-512F), fast
//! with VNNI (`vpdpbusd`: 64 byte products summed into 16 lanes per instruction, two blocks
//! at a time). Same formulas and results as the AVX2 kernels up to summation order.

use std::arch::x86_64::*;

use super::packed::{Packed, Row};
use super::qdot::{Prep, offsets};
use crate::quant::{BLOCK, BlockFormat};

/// Exact: `Σ_b d_b·(Σ_j x_j·q_j) + c_b·Σ_j x_j`, a block's 32 products in two 16-lane halves.
///
/// # Safety
/// The CPU has AVX-512F and FMA.
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn exact_avx512(p: &Prep<'_>, w: &Row<'_>) -> f32 {
    let nb = w.scales.len();
    assert!(p.x.len() >= nb * BLOCK && w.quants.len() >= nb * Packed::quant_bytes(w.fmt));
    let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let x = p.x.as_ptr();
    let mask = _mm_set1_epi8(0x0F);
    for b in 0..nb {
        // SAFETY: block b's 32 activations and its values are in bounds (asserted above).
        let s = unsafe {
            let px = x.add(b * BLOCK);
            let (lo, hi) = match w.fmt {
                BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
                    let raw = _mm_loadu_si128(w.quants.as_ptr().add(b * 16).cast());
                    let lo = _mm512_cvtepu8_epi32(_mm_and_si128(raw, mask));
                    (lo, _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask)))
                }
                BlockFormat::Q8_0 => {
                    let q = w.quants.as_ptr().add(b * 32);
                    (
                        _mm512_cvtepi8_epi32(_mm_loadu_si128(q.cast())),
                        _mm512_cvtepi8_epi32(_mm_loadu_si128(q.add(16).cast())),
                    )
                }
            };
            let s = _mm512_mul_ps(_mm512_loadu_ps(px), _mm512_cvtepi32_ps(lo));
            _mm512_fmadd_ps(_mm512_loadu_ps(px.add(16)), _mm512_cvtepi32_ps(hi), s)
        };
        let d = _mm512_set1_ps(w.scales[b]);
        if b % 2 == 0 {
            acc0 = _mm512_fmadd_ps(s, d, acc0);
        } else {
            acc1 = _mm512_fmadd_ps(s, d, acc1);
        }
    }
    // SAFETY: AVX2 and FMA come with this function's AVX-512F CPUs (checked by the caller).
    _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + offsets(w, p.sums, |a, b| unsafe { super::dot::dot_avx2(a, b) })
}

/// Fast: two blocks per `vpdpbusd` (weights as unsigned bytes, activations signed), each
/// block's 8 lanes scaled by its `d·δ`.
///
/// # Safety
/// The CPU has AVX-512F, AVX-512BW, AVX-512VNNI, AVX2 and FMA.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
pub(super) unsafe fn fast_avx512(p: &Prep<'_>, w: &Row<'_>) -> f32 {
    let nb = w.scales.len();
    assert!(p.q.len() >= nb * BLOCK && p.deltas.len() >= nb && w.quants.len() >= nb * Packed::quant_bytes(w.fmt));
    let mut acc = _mm512_setzero_ps();
    let mask = _mm256_set1_epi8(0x0F);
    // 64-bit lanes [lo_b, lo_b+1, hi_b, hi_b+1] (two each) → [lo_b, hi_b, lo_b+1, hi_b+1].
    let order = _mm512_set_epi64(7, 6, 3, 2, 5, 4, 1, 0);
    let pairs = nb / 2;
    for i in 0..pairs {
        let b = 2 * i;
        // SAFETY: blocks b and b + 1 are in bounds (asserted above).
        let v = unsafe {
            let qx = _mm512_loadu_si512(p.q.as_ptr().add(b * BLOCK).cast());
            match w.fmt {
                BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
                    let raw = _mm256_loadu_si256(w.quants.as_ptr().add(b * 16).cast());
                    let lo = _mm256_and_si256(raw, mask);
                    let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
                    let both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_permutexvar_epi64(order, both), qx)
                }
                BlockFormat::Q8_0 => {
                    let qw = _mm512_loadu_si512(w.quants.as_ptr().add(b * 32).cast());
                    let neg = _mm512_movepi8_mask(qw);
                    let sx = _mm512_mask_sub_epi8(qx, neg, _mm512_setzero_si512(), qx);
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(qw), sx)
                }
            }
        };
        let (s0, s1) = (w.scales[b] * p.deltas[b], w.scales[b + 1] * p.deltas[b + 1]);
        let scale = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s0), _mm512_set1_ps(s1));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), scale, acc);
    }
    let mut sum = _mm512_reduce_add_ps(acc);
    if nb % 2 == 1 {
        // The last, odd block: integer products in plain arithmetic.
        let b = nb - 1;
        let s: i32 = p.q[b * BLOCK..(b + 1) * BLOCK].iter().zip(w.ints(b)).map(|(&x, q)| i32::from(x) * q).sum();
        sum += s as f32 * (w.scales[b] * p.deltas[b]);
    }
    // SAFETY: AVX2 and FMA are among this function's features.
    sum + offsets(w, p.sums, |a, b| unsafe { super::dot::dot_avx2(a, b) })
}
