//! Fast mode's activation quantization, one 32-value block at a time: `δ = max|x|/127`,
//! `q = round(x/δ)` half away from zero, clamped to ±127 — in plain arithmetic, which defines
//! the bits, and with AVX-512 ([`qdot512`](super::qdot512)) or AVX2 (here), which give the same
//! bits for every block they take.

use crate::quant::BLOCK;

/// Quantizes one block of activations to the same bits as [`plain`] (`None`: not this block;
/// use the plain arithmetic).
pub(super) type QuantizeBlock = unsafe fn(&[f32; BLOCK], &mut [i8; BLOCK]) -> Option<(f32, i32)>;

/// Fast mode's quantization of one block of activations: `δ = max|x|/127`, `q = round(x/δ)`
/// (half away from zero) clamped to ±127; returns `δ` and `Σ q`.
pub(super) fn plain(x: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> (f32, i32) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let delta = amax / 127.0;
    let inv = if delta > 0.0 { 1.0 / delta } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in q.iter_mut().zip(x) {
        // Clamped: a block of tiny values (δ subnormal) has an infinite `inv`.
        *q = (v * inv).round().clamp(-127.0, 127.0) as i8;
        sum += i32::from(*q);
    }
    (delta, sum)
}

/// The widest SIMD block quantizer of this CPU, if it has one (chosen once: every fast-mode
/// product asks).
pub(super) fn simd() -> Option<QuantizeBlock> {
    static CHOSEN: std::sync::OnceLock<Option<QuantizeBlock>> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| all().first().map(|&(_, q)| q))
}

/// Every SIMD block quantizer this CPU runs, widest first, with its name.
fn all() -> Vec<(&'static str, QuantizeBlock)> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::is_x86_feature_detected as has;
        let wide: (&'static str, QuantizeBlock) = ("avx512", super::qdot512::quantize_block);
        let narrow: (&'static str, QuantizeBlock) = ("avx2", avx2);
        let wide = (has!("avx512f") && has!("avx512bw")).then_some(wide);
        [wide, has!("avx2").then_some(narrow)].into_iter().flatten().collect()
    }
    #[cfg(not(target_arch = "x86_64"))]
    Vec::new()
}

/// [`plain`] with AVX2, to the same bits: returns `δ` and `Σ q`, or `None` for a block holding
/// a NaN or an infinity, or whose `1/δ` is not finite (subnormal values).
///
/// # Safety
/// AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2(x: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> Option<(f32, i32)> {
    use std::arch::x86_64::*;
    // SAFETY: four vectors of 8 within the block.
    let v: [__m256; 4] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * i)) });
    let sign = _mm256_set1_ps(-0.0);
    let abs = |v: __m256| _mm256_andnot_ps(sign, v);
    let m = _mm256_max_ps(_mm256_max_ps(abs(v[0]), abs(v[1])), _mm256_max_ps(abs(v[2]), abs(v[3])));
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
    let nan = v.iter().fold(0, |n, &v| n | _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v)));
    let delta = amax / 127.0;
    let inv = if delta > 0.0 { 1.0 / delta } else { 0.0 };
    // Not finite values (NaN, ±∞) and subnormal blocks: the plain arithmetic's business.
    if nan != 0 || !amax.is_finite() || !inv.is_finite() {
        return None;
    }
    let (inv, half, one, lim) = (_mm256_set1_ps(inv), _mm256_set1_ps(0.5), _mm256_set1_ps(1.0), _mm256_set1_ps(127.0));
    let n = v.map(|v| {
        let t = _mm256_mul_ps(v, inv);
        // Half away from zero, exactly: the fraction after truncation is exact.
        let whole = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(t);
        let up = _mm256_cmp_ps::<_CMP_GE_OQ>(abs(_mm256_sub_ps(t, whole)), half);
        let step = _mm256_or_ps(_mm256_and_ps(t, sign), one);
        let r = _mm256_blendv_ps(whole, _mm256_add_ps(whole, step), up);
        _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, _mm256_sub_ps(_mm256_setzero_ps(), lim)), lim))
    });
    let s = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01)));
    // i32 → i8 in two saturating packs (exact: |n| ≤ 127), which interleave 128-bit lanes;
    // the permutation puts the values back in order.
    let packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    let ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // SAFETY: the block's 32 bytes.
    unsafe { _mm256_storeu_si256(q.as_mut_ptr().cast(), ordered) };
    Some((delta, sum))
}

#[cfg(test)]
mod tests {
    use super::super::packed::tests::floats;
    use super::*;

    /// Every SIMD quantizer this CPU runs gives the plain arithmetic's bits: random blocks of every scale,
    /// values exactly half-way between two steps (either sign), just below half-way, zeros;
    /// blocks too tiny for a finite `1/δ` and blocks holding a NaN or an infinity (in either
    /// half) are left to the plain arithmetic.
    #[test]
    fn the_simd_quantizer_rounds_as_the_plain_one() {
        let all = all();
        if all.is_empty() {
            eprintln!("no SIMD quantizer here: nothing to compare");
        }
        let mut blocks: Vec<[f32; BLOCK]> = Vec::new();
        for seed in 0..2000u64 {
            let scale = [1e-3, 1.0, 37.0, 1e4][seed as usize % 4];
            let v = floats(BLOCK, seed * 7919);
            blocks.push(std::array::from_fn(|j| v[j] * scale * if j % 5 == 0 { 0.01 } else { 1.0 }));
        }
        // max|x| = 127, so x/δ = x: half-way values, and the float just below 0.5.
        let mut half = [0.0f32; BLOCK];
        half[0] = 127.0;
        for (j, h) in half.iter_mut().enumerate().skip(1) {
            *h = (j as f32 - 16.0) + 0.5;
        }
        half[1] = 0.5f32.next_down();
        half[2] = -(0.5f32.next_down());
        half[3] = 2.5f32.next_down();
        blocks.push(half);
        blocks.push([0.0; BLOCK]);
        blocks.push(std::array::from_fn(|j| if j == 3 { 1e-44 } else { 0.0 }));
        blocks.push(std::array::from_fn(|j| if j == 3 { -1e-37 } else { 0.0 }));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, 20] {
                blocks.push(std::array::from_fn(|j| if j == at { bad } else { j as f32 * 0.1 }));
            }
        }
        for (name, simd) in all {
            let mut tiny_left = 0;
            for (i, x) in blocks.iter().enumerate() {
                let (mut qs, mut qp) = ([0i8; BLOCK], [0i8; BLOCK]);
                let want = plain(x, &mut qp);
                // SAFETY: `all` lists quantizers this CPU runs.
                match unsafe { simd(x, &mut qs) } {
                    Some(got) => {
                        assert_eq!((got.0.to_bits(), got.1), (want.0.to_bits(), want.1), "{name} block {i}: δ, Σq");
                        assert_eq!(qs, qp, "{name} block {i}: values");
                    }
                    None => tiny_left += 1,
                }
            }
            assert_eq!(
                tiny_left, 7,
                "{name}: only the subnormal and the 6 non-finite blocks are left to the plain arithmetic"
            );
        }
    }
}
