//! A 16-lane `exp` (AVX-512) and what is built on it: SiLU-gated products. Attention's
//! softmax uses it too ([`attention_step`](super::attention_step)).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Whether this CPU runs the functions here.
pub(super) fn here() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `exp` of 16 lanes: `2ⁿ·exp(r)`, `n = round(x·log₂e)`, `r = x − n·ln 2` in two parts
/// (Cody–Waite), `exp(r)` by Cephes' `expf` polynomial; within 2 ulp of `f32::exp` over
/// [−87, 88] (tested), 0 below −104, `+∞` past 88.73 and for `+∞`, NaN for NaN.
///
/// # Safety
/// AVX-512F and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
#[inline]
pub(super) unsafe fn exp(x: __m512) -> __m512 {
    // Clamped so that n stays finite (x = +∞ would make r = ∞ − ∞); the bound is the second
    // operand, so a NaN (the first) passes through as NaN.
    let x = _mm512_min_ps(_mm512_set1_ps(89.0), _mm512_max_ps(_mm512_set1_ps(-104.0), x));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.987_569_1e-4);
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0)));
    _mm512_scalef_ps(p, n)
}

/// `out = g·sigmoid(g)·u` (SiLU of the gate times up), 16 lanes at a time and the rest in
/// plain arithmetic.
///
/// # Safety
/// AVX-512F and FMA ([`here`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
    let n = g.len().min(u.len()).min(out.len());
    let done = n - n % 16;
    let one = _mm512_set1_ps(1.0);
    for i in (0..done).step_by(16) {
        // SAFETY: lanes i..i + 16 of all three, within n.
        unsafe {
            let gv = _mm512_loadu_ps(g.as_ptr().add(i));
            let e = exp(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            let s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
            _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_mul_ps(s, _mm512_loadu_ps(u.as_ptr().add(i))));
        }
    }
    silu_mul_plain(&g[done..n], &u[done..n], &mut out[done..n]);
}

/// `out = g·sigmoid(g)·u` in plain arithmetic (the CPU backend's product without AVX-512,
/// and the vector one's tail).
pub(super) fn silu_mul_plain(g: &[f32], u: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 16-lane `exp` within 2 ulp of `f32::exp` where both are normal, 0 far below, and
    /// `+∞` above the range.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_exp_is_within_two_ulp() {
        use std::arch::x86_64::*;
        if !here() {
            eprintln!("no AVX-512 here: nothing to check");
            return;
        }
        let mut xs: Vec<f32> = (0..200_000).map(|i| -87.0 + 175.0 * i as f32 / 200_000.0).collect();
        xs.extend([0.0, -0.0, 1e-8, -1e-8, 88.0, -87.0, 0.5, -0.5]);
        let mut worst = 0u32;
        for c in xs.chunks(16) {
            let mut buf = [0.0f32; 16];
            buf[..c.len()].copy_from_slice(c);
            let mut got = [0.0f32; 16];
            // SAFETY: the features were detected above.
            unsafe { _mm512_storeu_ps(got.as_mut_ptr(), exp(_mm512_loadu_ps(buf.as_ptr()))) };
            for (&x, &g) in c.iter().zip(&got) {
                let want = (x as f64).exp() as f32;
                let ulps = (g.to_bits() as i64 - want.to_bits() as i64).unsigned_abs() as u32;
                assert!(ulps <= 2, "exp({x}) = {g}, want {want} ({ulps} ulp)");
                worst = worst.max(ulps);
            }
        }
        let mut got = [0.0f32; 16];
        let far = [
            -104.0,
            -200.0,
            f32::NEG_INFINITY,
            89.0,
            100.0,
            f32::INFINITY,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
        ];
        // SAFETY: as above.
        unsafe { _mm512_storeu_ps(got.as_mut_ptr(), exp(_mm512_loadu_ps(far.as_ptr()))) };
        assert!(got[..3].iter().all(|&g| g < 1e-44), "{got:?}");
        assert!(got[3..6].iter().all(|&g| g == f32::INFINITY), "{got:?}");
        let nan = [f32::NAN; 16];
        // SAFETY: as above.
        unsafe { _mm512_storeu_ps(got.as_mut_ptr(), exp(_mm512_loadu_ps(nan.as_ptr()))) };
        assert!(got.iter().all(|g| g.is_nan()), "{got:?}");
        eprintln!("worst {worst} ulp");
    }

    /// The vector SiLU product against the plain one, lengths with and without a tail.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_silu_product_matches_the_plain_one() {
        if !here() {
            eprintln!("no AVX-512 here: nothing to compare");
            return;
        }
        for n in [1, 15, 16, 100, 1536] {
            let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 12.0).collect();
            let u: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() * 3.0).collect();
            let mut got = vec![0.0; n];
            let mut want = vec![0.0; n];
            // SAFETY: `here` said this CPU runs it.
            unsafe { silu_mul(&g, &u, &mut got) };
            silu_mul_plain(&g, &u, &mut want);
            for (i, (&got, &want)) in got.iter().zip(&want).enumerate() {
                assert!((got - want).abs() <= 4e-7 * want.abs().max(1e-3), "n {n} at {i}: {got} vs {want}");
            }
        }
    }
}
