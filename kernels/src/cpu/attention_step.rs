//! One (query row, head)'s online-softmax step over a run of positions — the inner loop of
//! [`attention`](super::attention): the run's scores, the running maximum and sum, and the
//! output rescaled and accumulated. A portable step, an AVX-512 one (16-lane dots, a 16-lane
//! `exp`, the output held in registers while the run's values are added) and its 8-lane AVX2
//! twin, chosen once per attention call ([`chooser`]).

/// A run of positions for one (row, head).
#[derive(Clone, Copy)]
pub(super) struct Run<'a> {
    /// The head's query (`head_dim` values).
    pub(super) q: &'a [f32],
    /// Keys: position `j`'s at `k[j·slot..j·slot + head_dim]`.
    pub(super) k: &'a [f32],
    /// Values, laid out as the keys.
    pub(super) v: &'a [f32],
    /// Floats from one position to the next.
    pub(super) slot: usize,
    /// Positions in the run.
    pub(super) n: usize,
    /// The scores' factor (`1/√head_dim`).
    pub(super) scale: f32,
}

/// The running state of one (row, head): its maximum score, its sum of `exp(score − max)`
/// and its output (unnormalised: `Σ exp(score − max)·v`).
pub(super) struct State<'a> {
    pub(super) max: &'a mut f32,
    pub(super) sum: &'a mut f32,
    pub(super) out: &'a mut [f32],
}

/// A step: the run's positions folded into the state. `scores` is scratch of at least `n`.
/// Unsafe to call only in that the SIMD step needs its CPU features: [`chooser`] returns
/// one only where they exist.
pub(super) type Step = unsafe fn(&Run<'_>, State<'_>, &mut [f32]);

/// The step for heads of `head_dim` values on this CPU.
pub(super) fn chooser(head_dim: usize) -> Step {
    #[cfg(target_arch = "x86_64")]
    {
        if head_dim.is_multiple_of(16) && super::exp512::here() {
            return avx512::step;
        }
        if head_dim.is_multiple_of(8) && super::exp256::here() {
            return avx2::step;
        }
    }
    portable
}

/// # Safety
/// None: `unsafe` only to be a [`Step`].
pub(super) unsafe fn portable(r: &Run<'_>, s: State<'_>, scores: &mut [f32]) {
    if r.n == 0 {
        return;
    }
    let hd = r.q.len();
    let sc = &mut scores[..r.n];
    let mut top = f32::NEG_INFINITY;
    for (j, v) in sc.iter_mut().enumerate() {
        *v = super::dot::dot(r.q, &r.k[j * r.slot..j * r.slot + hd]) * r.scale;
        top = top.max(*v);
    }
    let m = s.max.max(top);
    let c = (*s.max - m).exp();
    if c != 1.0 {
        s.out.iter_mut().for_each(|o| *o *= c);
    }
    let mut l = *s.sum * c;
    for (j, &v) in sc.iter().enumerate() {
        let p = (v - m).exp();
        l += p;
        s.out.iter_mut().zip(&r.v[j * r.slot..j * r.slot + hd]).for_each(|(o, v)| *o += p * v);
    }
    *s.max = m;
    *s.sum = l;
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    use std::arch::x86_64::*;

    use super::{Run, State};
    use crate::cpu::exp512::exp;

    /// The AVX-512 [`Step`](super::Step): `head_dim` a multiple of 16.
    ///
    /// # Safety
    /// AVX-512F and FMA; `r.q.len()` a multiple of 16; `r.k` and `r.v` hold `r.n` positions;
    /// `s.out` holds `head_dim` values; `scores` at least `r.n`.
    #[target_feature(enable = "avx512f,fma")]
    pub(in crate::cpu) unsafe fn step(r: &Run<'_>, s: State<'_>, scores: &mut [f32]) {
        let (hd, n, slot) = (r.q.len(), r.n, r.slot);
        if n == 0 {
            return;
        }
        assert!(hd.is_multiple_of(16) && s.out.len() >= hd && scores.len() >= n);
        assert!(r.k.len() >= (n - 1) * slot + hd && r.v.len() >= (n - 1) * slot + hd);
        let (q, k, v) = (r.q.as_ptr(), r.k.as_ptr(), r.v.as_ptr());
        // SAFETY (every load and store below): within the slices, asserted above.
        let mut top = f32::NEG_INFINITY;
        for (j, sc) in scores[..n].iter_mut().enumerate() {
            let mut acc = _mm512_setzero_ps();
            for u in (0..hd).step_by(16) {
                acc = unsafe { _mm512_fmadd_ps(_mm512_loadu_ps(q.add(u)), _mm512_loadu_ps(k.add(j * slot + u)), acc) };
            }
            *sc = _mm512_reduce_add_ps(acc) * r.scale;
            top = top.max(*sc);
        }
        let m = s.max.max(top);
        let c = (*s.max - m).exp();
        let mut l = *s.sum * c;
        // The scores become exp(score − max), 16 at a time.
        let mv = _mm512_set1_ps(m);
        for j0 in (0..n).step_by(16) {
            let mask: __mmask16 = if n - j0 >= 16 { 0xFFFF } else { (1u16 << (n - j0)) - 1 };
            let p = unsafe {
                let x = _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), mask, scores.as_ptr().add(j0));
                _mm512_maskz_mov_ps(mask, exp(_mm512_sub_ps(x, mv)))
            };
            unsafe { _mm512_mask_storeu_ps(scores.as_mut_ptr().add(j0), mask, p) };
            l += _mm512_reduce_add_ps(p);
        }
        // out·c + Σ_j p_j·v_j, up to 64 output values in registers at a time.
        let o = s.out.as_mut_ptr();
        let mut u = 0;
        while u < hd {
            // SAFETY: values u.. of the output and of every position's V, as above.
            unsafe {
                match (hd - u) / 16 {
                    1 => accumulate::<1>(o.add(u), v.add(u), slot, &scores[..n], c),
                    2 => accumulate::<2>(o.add(u), v.add(u), slot, &scores[..n], c),
                    3 => accumulate::<3>(o.add(u), v.add(u), slot, &scores[..n], c),
                    _ => accumulate::<4>(o.add(u), v.add(u), slot, &scores[..n], c),
                }
            }
            u += 64;
        }
        *s.max = m;
        *s.sum = l;
    }

    /// `o[..16·V] = o·c + Σ_j p_j·v_j[..16·V]`, the output in `V` registers.
    ///
    /// # Safety
    /// AVX-512F and FMA; `o` holds `16·V` values; `v + j·slot` too for every `j < p.len()`.
    #[target_feature(enable = "avx512f,fma")]
    #[inline]
    unsafe fn accumulate<const V: usize>(o: *mut f32, v: *const f32, slot: usize, p: &[f32], c: f32) {
        // SAFETY (every load and store): the caller's promise.
        let mut acc: [__m512; V] = std::array::from_fn(|i| unsafe { _mm512_loadu_ps(o.add(16 * i)) });
        if c != 1.0 {
            acc = acc.map(|a| _mm512_mul_ps(a, _mm512_set1_ps(c)));
        }
        for (j, &pj) in p.iter().enumerate() {
            let pv = _mm512_set1_ps(pj);
            for (i, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(pv, unsafe { _mm512_loadu_ps(v.add(j * slot + 16 * i)) }, *a);
            }
        }
        for (i, a) in acc.iter().enumerate() {
            unsafe { _mm512_storeu_ps(o.add(16 * i), *a) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use std::arch::x86_64::*;

    use super::{Run, State};
    use crate::cpu::exp256::exp;
    use crate::cpu::qdot::avx2::hsum;

    /// The AVX2 [`Step`](super::Step): `head_dim` a multiple of 8.
    ///
    /// # Safety
    /// AVX2 and FMA; `r.q.len()` a multiple of 8; `r.k` and `r.v` hold `r.n` positions;
    /// `s.out` holds `head_dim` values; `scores` at least `r.n`.
    #[target_feature(enable = "avx2,fma")]
    pub(in crate::cpu) unsafe fn step(r: &Run<'_>, s: State<'_>, scores: &mut [f32]) {
        let (hd, n, slot) = (r.q.len(), r.n, r.slot);
        if n == 0 {
            return;
        }
        assert!(hd.is_multiple_of(8) && s.out.len() >= hd && scores.len() >= n);
        assert!(r.k.len() >= (n - 1) * slot + hd && r.v.len() >= (n - 1) * slot + hd);
        let (q, k, v) = (r.q.as_ptr(), r.k.as_ptr(), r.v.as_ptr());
        // SAFETY (every load and store below): within the slices, asserted above.
        let mut top = f32::NEG_INFINITY;
        for (j, sc) in scores[..n].iter_mut().enumerate() {
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut u = 0;
            while u + 16 <= hd {
                unsafe {
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(u)), _mm256_loadu_ps(k.add(j * slot + u)), a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(u + 8)), _mm256_loadu_ps(k.add(j * slot + u + 8)), a1);
                }
                u += 16;
            }
            if u < hd {
                a0 = unsafe { _mm256_fmadd_ps(_mm256_loadu_ps(q.add(u)), _mm256_loadu_ps(k.add(j * slot + u)), a0) };
            }
            *sc = hsum(_mm256_add_ps(a0, a1)) * r.scale;
            top = top.max(*sc);
        }
        let m = s.max.max(top);
        let c = (*s.max - m).exp();
        let mut l = *s.sum * c;
        // The scores become exp(score − max), 8 at a time (a last partial vector through a
        // buffer, its spare lanes neither stored nor summed).
        let mv = _mm256_set1_ps(m);
        for j0 in (0..n).step_by(8) {
            let len = (n - j0).min(8);
            let mut buf = [f32::NEG_INFINITY; 8];
            buf[..len].copy_from_slice(&scores[j0..j0 + len]);
            let mut p = [0.0f32; 8];
            unsafe { _mm256_storeu_ps(p.as_mut_ptr(), exp(_mm256_sub_ps(_mm256_loadu_ps(buf.as_ptr()), mv))) };
            scores[j0..j0 + len].copy_from_slice(&p[..len]);
            l += if len == 8 { hsum(unsafe { _mm256_loadu_ps(p.as_ptr()) }) } else { p[..len].iter().sum() };
        }
        // out·c + Σ_j p_j·v_j, up to 64 output values in registers at a time.
        let o = s.out.as_mut_ptr();
        let mut u = 0;
        while u < hd {
            // SAFETY: values u.. of the output and of every position's V, as above.
            unsafe {
                match (hd - u) / 8 {
                    1 => accumulate::<1>(o.add(u), v.add(u), slot, &scores[..n], c),
                    2 => accumulate::<2>(o.add(u), v.add(u), slot, &scores[..n], c),
                    3 => accumulate::<3>(o.add(u), v.add(u), slot, &scores[..n], c),
                    4 => accumulate::<4>(o.add(u), v.add(u), slot, &scores[..n], c),
                    5 => accumulate::<5>(o.add(u), v.add(u), slot, &scores[..n], c),
                    6 => accumulate::<6>(o.add(u), v.add(u), slot, &scores[..n], c),
                    7 => accumulate::<7>(o.add(u), v.add(u), slot, &scores[..n], c),
                    _ => accumulate::<8>(o.add(u), v.add(u), slot, &scores[..n], c),
                }
            }
            u += 64;
        }
        *s.max = m;
        *s.sum = l;
    }

    /// `o[..8·V] = o·c + Σ_j p_j·v_j[..8·V]`, the output in `V` registers.
    ///
    /// # Safety
    /// AVX2 and FMA; `o` holds `8·V` values; `v + j·slot` too for every `j < p.len()`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn accumulate<const V: usize>(o: *mut f32, v: *const f32, slot: usize, p: &[f32], c: f32) {
        // SAFETY (every load and store): the caller's promise.
        let mut acc: [__m256; V] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(o.add(8 * i)) });
        if c != 1.0 {
            acc = acc.map(|a| _mm256_mul_ps(a, _mm256_set1_ps(c)));
        }
        for (j, &pj) in p.iter().enumerate() {
            let pv = _mm256_set1_ps(pj);
            for (i, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(pv, unsafe { _mm256_loadu_ps(v.add(j * slot + 8 * i)) }, *a);
            }
        }
        for (i, a) in acc.iter().enumerate() {
            unsafe { _mm256_storeu_ps(o.add(8 * i), *a) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vals(n: usize, seed: u64, amp: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
            })
            .collect()
    }

    /// The SIMD steps this CPU runs (AVX-512, AVX2) against the portable one: runs of 0–40
    /// positions (a partial last vector of scores, several vectors), head sizes 8–160 (1–8
    /// output registers and a tail), a fresh and a running state, positions further apart
    /// than a head.
    #[test]
    fn the_steps_agree() {
        let mut steps: Vec<(&str, usize, Step)> = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if crate::cpu::exp512::here() {
                steps.push(("avx512", 16, avx512::step));
            }
            if crate::cpu::exp256::here() {
                steps.push(("avx2", 8, avx2::step));
            }
        }
        if steps.is_empty() {
            eprintln!("no SIMD step here: nothing to compare");
            return;
        }
        for (name, width, step) in steps {
            for hd in [8, 16, 24, 64, 80, 128, 160].into_iter().filter(|hd| hd % width == 0) {
                for n in [0, 1, 5, 8, 16, 17, 40] {
                    let slot = hd * 3;
                    let q = vals(hd, hd as u64, 1.0);
                    let k = vals(n.max(1) * slot, 7 + n as u64, 2.0);
                    let v = vals(n.max(1) * slot, 11 + n as u64, 1.0);
                    let run = Run { q: &q, k: &k, v: &v, slot, n, scale: 1.0 / (hd as f32).sqrt() };
                    for fresh in [true, false] {
                        let init = |out: &mut Vec<f32>| -> (f32, f32) {
                            out.clear();
                            out.extend(vals(hd, 3, if fresh { 0.0 } else { 0.7 }));
                            if fresh { (f32::NEG_INFINITY, 0.0) } else { (0.4, 1.7) }
                        };
                        let mut got = Vec::new();
                        let mut want = Vec::new();
                        let (mut gm, mut gs) = init(&mut got);
                        let (mut wm, mut ws) = init(&mut want);
                        let mut scratch = vec![0.0; 64];
                        // SAFETY: the steps listed run on this CPU; the shapes hold.
                        unsafe {
                            step(&run, State { max: &mut gm, sum: &mut gs, out: &mut got }, &mut scratch);
                            portable(&run, State { max: &mut wm, sum: &mut ws, out: &mut want }, &mut scratch);
                        }
                        let what = format!("{name} hd {hd} n {n} fresh {fresh}");
                        assert!((gm - wm).abs() <= 1e-5 * wm.abs().max(1.0) || gm == wm, "{what}: max {gm} vs {wm}");
                        assert!((gs - ws).abs() <= 1e-5 * ws.abs().max(1.0), "{what}: sum {gs} vs {ws}");
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{what}: out {i} {g} vs {w}");
                        }
                    }
                }
            }
        }
    }
}
