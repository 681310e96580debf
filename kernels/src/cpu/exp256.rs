//! An 8-lane `exp` (AVX2 + FMA) and the SiLU-gated product built on it: what
//! [`exp512`](super::exp512) is for CPUs with AVX-512, for those with AVX2 only (AMD Zen 1–3,
//! Intel client cores). Attention's softmax uses it too
//! ([`attention_step`](super::attention_step)).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Whether this CPU runs the functions here.
pub(super) fn here() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `exp` of 8 lanes, the same arithmetic as [`exp512::exp`](super::exp512::exp) (Cody–Waite
/// reduction, Cephes' polynomial) with `2ⁿ` applied as two exact powers of two, `2^⌊n/2⌋` then
/// `2^(n−⌊n/2⌋)` (each a normal float for every `n` of the clamped range, so only the last
/// product rounds, into a subnormal where the result is one): within 2 ulp of `f32::exp` over
/// [−87, 88] (tested), ~0 below −104, `+∞` past 88.73 and for `+∞`, NaN for NaN.
///
/// # Safety
/// AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) unsafe fn exp(x: __m256) -> __m256 {
    // Clamped so that n stays finite; the bound is the first operand, so a NaN (the second,
    // which `min`/`max` return when either is NaN) passes through.
    let x = _mm256_min_ps(_mm256_set1_ps(89.0), _mm256_max_ps(_mm256_set1_ps(-104.0), x));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0)));
    // n ∈ [−150, 129]: halves in [−75, 65], each 2^half a normal float built from its bits.
    let ni = _mm256_cvtps_epi32(n);
    let n1 = _mm256_srai_epi32::<1>(ni);
    let n2 = _mm256_sub_epi32(ni, n1);
    let pow = |e: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(e, _mm256_set1_epi32(127))));
    _mm256_mul_ps(_mm256_mul_ps(p, pow(n1)), pow(n2))
}

/// `out = g·sigmoid(g)·u` (SiLU of the gate times up), 8 lanes at a time and the rest in
/// plain arithmetic.
///
/// # Safety
/// AVX2 and FMA ([`here`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
    let n = g.len().min(u.len()).min(out.len());
    let done = n - n % 8;
    let one = _mm256_set1_ps(1.0);
    for i in (0..done).step_by(8) {
        // SAFETY: lanes i..i + 8 of all three, within n.
        unsafe {
            let gv = _mm256_loadu_ps(g.as_ptr().add(i));
            let e = exp(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            let s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(i))));
        }
    }
    super::exp512::silu_mul_plain(&g[done..n], &u[done..n], &mut out[done..n]);
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    fn exp8(x: &[f32; 8]) -> [f32; 8] {
        let mut got = [0.0f32; 8];
        // SAFETY: the callers checked `here`.
        unsafe { _mm256_storeu_ps(got.as_mut_ptr(), exp(_mm256_loadu_ps(x.as_ptr()))) };
        got
    }

    /// The 8-lane `exp` within 2 ulp of `f32::exp` where both are normal, (almost) 0 far
    /// below, `+∞` above the range, NaN for NaN.
    #[test]
    fn the_vector_exp_is_within_two_ulp() {
        if !here() {
            eprintln!("no AVX2 here: nothing to check");
            return;
        }
        let mut xs: Vec<f32> = (0..200_000).map(|i| -87.0 + 175.0 * i as f32 / 200_000.0).collect();
        xs.extend([0.0, -0.0, 1e-8, -1e-8, 88.0, -87.0, 0.5, -0.5]);
        let mut worst = 0u32;
        for c in xs.chunks(8) {
            let mut buf = [0.0f32; 8];
            buf[..c.len()].copy_from_slice(c);
            for (&x, &g) in c.iter().zip(&exp8(&buf)) {
                let want = (x as f64).exp() as f32;
                let ulps = (g.to_bits() as i64 - want.to_bits() as i64).unsigned_abs() as u32;
                assert!(ulps <= 2, "exp({x}) = {g}, want {want} ({ulps} ulp)");
                worst = worst.max(ulps);
            }
        }
        let got = exp8(&[-104.0, -200.0, f32::NEG_INFINITY, 89.0, 100.0, f32::INFINITY, -100.0, 88.7]);
        assert!(got[..3].iter().all(|&g| g < 1e-44), "{got:?}");
        assert!(got[3..6].iter().all(|&g| g == f32::INFINITY), "{got:?}");
        let want = (-100.0f64).exp() as f32;
        assert!(got[6] > 0.0 && (got[6] - want).abs() <= f32::from_bits(1), "subnormal exp(-100) {} vs {want}", got[6]);
        assert!(got[7].is_finite() && got[7] > 3e38, "exp(88.7) {}", got[7]);
        assert!(exp8(&[f32::NAN; 8]).iter().all(|g| g.is_nan()));
        eprintln!("worst {worst} ulp");
    }

    /// The vector SiLU product against the plain one, lengths with and without a tail.
    #[test]
    fn the_vector_silu_product_matches_the_plain_one() {
        if !here() {
            eprintln!("no AVX2 here: nothing to compare");
            return;
        }
        for n in [1, 7, 8, 100, 1536] {
            let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 12.0).collect();
            let u: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() * 3.0).collect();
            let mut got = vec![0.0; n];
            let mut want = vec![0.0; n];
            // SAFETY: `here` said this CPU runs it.
            unsafe { silu_mul(&g, &u, &mut got) };
            super::super::exp512::silu_mul_plain(&g, &u, &mut want);
            for (i, (&got, &want)) in got.iter().zip(&want).enumerate() {
                assert!((got - want).abs() <= 4e-7 * want.abs().max(1e-3), "n {n} at {i}: {got} vs {want}");
            }
        }
    }
}
