//! Dot products of f32 activation rows with [`Packed`] weight rows, in two numeric modes
//! ([`CpuMath`]):
//!
//! - **exact**: `Σ_b d_b·(Σ_j x_j·q_j) + c_b·Σ_j x_j` per 32-weight block `b`, f32 throughout:
//!   the value of the f32 product on the dequantized weights up to summation order (the block
//!   scale is factored out of its block's sum).
//! - **fast**: each 32-value block of the activations quantized to 8 bits
//!   (`x ≈ q_x·δ`, round to nearest), integer products of the weights' and activations' values
//!   (`maddubs` on AVX2), `Σ_b d_b·δ_b·(Σ_j q_j·q_x,j) + c_b·δ_b·Σ_j q_x,j`. Its error against
//!   exact is at most `Σ_b δ_b/2 · Σ_j |w_j|` (the activations' rounding), llama.cpp's scheme.
//!
//! The SIMD kernel is chosen once per product ([`kernel`]); each mode has a portable twin.

use super::CpuMath;
use super::packed::{Packed, Row};
use crate::quant::{BLOCK, BlockFormat};

/// One activation row prepared for a mode's kernel.
#[derive(Debug, Clone, Copy)]
pub(super) struct Prep<'a> {
    /// The row itself (exact mode).
    pub(super) x: &'a [f32],
    /// Per block: `Σ x` (exact) or `δ·Σ q_x` (fast).
    pub(super) sums: &'a [f32],
    /// Per block `δ` (fast; empty in exact mode).
    pub(super) deltas: &'a [f32],
    /// The 8-bit values (fast; empty in exact mode).
    pub(super) q: &'a [i8],
}

/// `m` activation rows of `k` values prepared for one mode (`k` a multiple of [`BLOCK`]).
#[derive(Debug, Default)]
pub(super) struct Prepared {
    k: usize,
    sums: Vec<f32>,
    deltas: Vec<f32>,
    q: Vec<i8>,
}

impl Prepared {
    pub(super) fn new(math: CpuMath, x: &[f32], m: usize, k: usize) -> Self {
        let nb = k / BLOCK;
        let mut p = Self { k, sums: Vec::with_capacity(m * nb), ..Self::default() };
        match math {
            CpuMath::Exact => p.sums.extend(x[..m * k].chunks_exact(BLOCK).map(|b| b.iter().sum::<f32>())),
            CpuMath::Fast => {
                p.deltas.reserve(m * nb);
                p.q.resize(m * k, 0);
                let simd = super::quantize::simd();
                for (b, q) in x[..m * k].chunks_exact(BLOCK).zip(p.q.chunks_exact_mut(BLOCK)) {
                    let (b, q): (&[f32; BLOCK], &mut [i8; BLOCK]) =
                        (b.try_into().expect("a block"), q.try_into().expect("a block"));
                    // SAFETY: `simd` returned a quantizer this CPU runs.
                    let fast = match simd {
                        Some(f) => unsafe { f(b, &mut *q) },
                        None => None,
                    };
                    let (delta, sum) = fast.unwrap_or_else(|| super::quantize::plain(b, q));
                    p.deltas.push(delta);
                    p.sums.push(delta * sum as f32);
                }
            }
        }
        p
    }

    /// Row `r`, with `x` the activations it was made from.
    #[inline]
    pub(super) fn row<'a>(&'a self, x: &'a [f32], r: usize) -> Prep<'a> {
        let (k, nb) = (self.k, self.k / BLOCK);
        let part = |v: &'a [f32]| if v.is_empty() { v } else { &v[r * nb..(r + 1) * nb] };
        Prep {
            x: &x[r * k..(r + 1) * k],
            sums: &self.sums[r * nb..(r + 1) * nb],
            deltas: part(&self.deltas),
            q: if self.q.is_empty() { &[] } else { &self.q[r * k..(r + 1) * k] },
        }
    }
}

/// A dot product of one prepared row with one weight row. Unsafe to call only in that the
/// SIMD kernels need their CPU features: [`kernel`] returns one only where they exist.
pub(super) type Kernel = unsafe fn(&Prep<'_>, &Row<'_>) -> f32;

/// Rows `first..first + len` of a matrix dotted with every prepared row `ps[a]`, row `a`'s
/// results into `out[a·stride..a·stride + len]`. Each cell equals what the mode's [`kernel`]
/// gives for it, bit for bit, whatever rows came with it.
///
/// # Safety (of a call)
/// The kernel's CPU features ([`rows_kernel`] returns only kernels this CPU runs); `out` valid
/// for writes of those cells, which nothing else reads or writes during the call.
pub(super) type RowsKernel = unsafe fn(&[Prep<'_>], &Packed, usize, usize, *mut f32, usize);

/// The rows kernel of `math` for this CPU: AVX-512's (exact mode), which shares its loads
/// across a group of rows, else a loop over [`kernel`]. (CPUs with AVX2 or AVX-512 VNNI
/// multiply [`Tiled`](super::tiled::Tiled) weights instead, in both modes:
/// [`qtile`](super::qtile); these row kernels serve the others.)
pub(super) fn rows_kernel(math: CpuMath) -> RowsKernel {
    static CHOSEN: std::sync::OnceLock<[RowsKernel; 2]> = std::sync::OnceLock::new();
    let chosen = |math| -> RowsKernel {
        #[cfg(target_arch = "x86_64")]
        if kernels(math)[0].0 == "avx512" {
            return super::qdot512::exact_rows;
        }
        match math {
            CpuMath::Exact => rows_by_kernel::<false>,
            CpuMath::Fast => rows_by_kernel::<true>,
        }
    };
    let [exact, fast] = *CHOSEN.get_or_init(|| [chosen(CpuMath::Exact), chosen(CpuMath::Fast)]);
    match math {
        CpuMath::Exact => exact,
        CpuMath::Fast => fast,
    }
}

/// [`RowsKernel`] as a loop over the mode's [`kernel`].
///
/// # Safety
/// As [`RowsKernel`].
unsafe fn rows_by_kernel<const FAST: bool>(
    ps: &[Prep<'_>],
    w: &Packed,
    first: usize,
    len: usize,
    out: *mut f32,
    stride: usize,
) {
    let dot = kernel(if FAST { CpuMath::Fast } else { CpuMath::Exact });
    for (a, p) in ps.iter().enumerate() {
        for c in 0..len {
            // SAFETY: `kernel` picked a dot product this CPU runs; cell (a, c) is the caller's.
            unsafe { *out.add(a * stride + c) = dot(p, &w.row(first + c)) };
        }
    }
}

/// The kernel of `math` for this CPU, the widest it runs (a plain function pointer: no shim
/// per call; the CPU's features are read once, not per product).
pub(super) fn kernel(math: CpuMath) -> Kernel {
    // Chosen once per process: the CPU does not change under us.
    static CHOSEN: std::sync::OnceLock<[Kernel; 2]> = std::sync::OnceLock::new();
    let [exact, fast] = *CHOSEN.get_or_init(|| [kernels(CpuMath::Exact)[0].1, kernels(CpuMath::Fast)[0].1]);
    match math {
        CpuMath::Exact => exact,
        CpuMath::Fast => fast,
    }
}

/// Every kernel of `math` this CPU runs, widest first, with its name.
pub(super) fn kernels(math: CpuMath) -> Vec<(&'static str, Kernel)> {
    let mut all: Vec<(&'static str, Kernel)> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        use std::is_x86_feature_detected as has;
        let avx2 = has!("avx2") && has!("fma");
        match math {
            CpuMath::Exact if avx2 && has!("avx512f") => all.push(("avx512", super::qdot512::exact_avx512)),
            _ => {}
        }
        if avx2 {
            all.push(("avx2", if math == CpuMath::Exact { exact_avx2 } else { fast_avx2 }));
        }
    }
    all.push(("portable", portable(math)));
    all
}

/// The portable kernel of `math`.
pub(super) fn portable(math: CpuMath) -> Kernel {
    match math {
        CpuMath::Exact => exact_portable,
        CpuMath::Fast => fast_portable,
    }
}

/// `Σ_b c_b·sums_b`: the blocks' offsets against the row's per-block sums.
#[inline]
pub(super) fn offsets(w: &Row<'_>, sums: &[f32], dot: impl Fn(&[f32], &[f32]) -> f32) -> f32 {
    match w.fmt {
        BlockFormat::Q4_1 => dot(w.mins, sums),
        BlockFormat::Q4_0 => -8.0 * dot(w.scales, sums),
        BlockFormat::Q8_0 => 0.0,
    }
}

/// # Safety
/// None: `unsafe` only to be a [`Kernel`].
unsafe fn exact_portable(p: &Prep<'_>, w: &Row<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, xs) in p.x.chunks_exact(BLOCK).enumerate().take(w.scales.len()) {
        let s: f32 = xs.iter().zip(w.ints(b)).map(|(x, q)| x * q as f32).sum();
        acc += s * w.scales[b];
    }
    acc + offsets(w, p.sums, super::dot::dot_portable)
}

/// # Safety
/// None: `unsafe` only to be a [`Kernel`].
unsafe fn fast_portable(p: &Prep<'_>, w: &Row<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, qx) in p.q.chunks_exact(BLOCK).enumerate().take(w.scales.len()) {
        let s: i32 = qx.iter().zip(w.ints(b)).map(|(&x, q)| i32::from(x) * q).sum();
        acc += s as f32 * (w.scales[b] * p.deltas[b]);
    }
    acc + offsets(w, p.sums, super::dot::dot_portable)
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use std::arch::x86_64::*;

    /// The sum of the 8 lanes.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(in crate::cpu) fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }

    /// The 32 nibbles of a Q4 block's 16 bytes as bytes, in weight order.
    ///
    /// # Safety
    /// `p` points at 16 readable bytes.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) unsafe fn nibbles(p: *const u8) -> (__m128i, __m128i) {
        // SAFETY: the caller's promise.
        let raw = unsafe { _mm_loadu_si128(p.cast()) };
        let mask = _mm_set1_epi8(0x0F);
        (_mm_and_si128(raw, mask), _mm_and_si128(_mm_srli_epi16(raw, 4), mask))
    }

    /// Eight bytes (the low half of `v`) widened to f32.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) fn u8_ps(v: __m128i) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
    }
}

/// [`exact_portable`] with AVX2 + FMA.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exact_avx2(p: &Prep<'_>, w: &Row<'_>) -> f32 {
    use std::arch::x86_64::*;
    let nb = w.scales.len();
    assert!(p.x.len() >= nb * BLOCK && w.quants.len() >= nb * super::packed::Packed::quant_bytes(w.fmt));
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let x = p.x.as_ptr();
    for b in 0..nb {
        // SAFETY: block b's 32 activations and its values are in bounds (asserted above).
        let (s, t) = unsafe {
            let px = x.add(b * BLOCK);
            let ld = |i: usize| _mm256_loadu_ps(px.add(i));
            match w.fmt {
                BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
                    let (lo, hi) = avx2::nibbles(w.quants.as_ptr().add(b * 16));
                    let s = _mm256_mul_ps(ld(0), avx2::u8_ps(lo));
                    let t = _mm256_mul_ps(ld(8), avx2::u8_ps(_mm_srli_si128(lo, 8)));
                    (
                        _mm256_fmadd_ps(ld(16), avx2::u8_ps(hi), s),
                        _mm256_fmadd_ps(ld(24), avx2::u8_ps(_mm_srli_si128(hi, 8)), t),
                    )
                }
                BlockFormat::Q8_0 => {
                    let q = w.quants.as_ptr().add(b * 32);
                    let f = |i: usize| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(q.add(i).cast())));
                    let s = _mm256_mul_ps(ld(0), f(0));
                    let t = _mm256_mul_ps(ld(8), f(8));
                    (_mm256_fmadd_ps(ld(16), f(16), s), _mm256_fmadd_ps(ld(24), f(24), t))
                }
            }
        };
        let d = _mm256_set1_ps(w.scales[b]);
        if b % 2 == 0 {
            acc0 = _mm256_fmadd_ps(_mm256_add_ps(s, t), d, acc0);
        } else {
            acc1 = _mm256_fmadd_ps(_mm256_add_ps(s, t), d, acc1);
        }
    }
    // SAFETY: the features `dot_avx2` needs are this function's.
    avx2::hsum(_mm256_add_ps(acc0, acc1)) + offsets(w, p.sums, |a, b| unsafe { super::dot::dot_avx2(a, b) })
}

/// [`fast_portable`] with AVX2 (`maddubs`) + FMA.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fast_avx2(p: &Prep<'_>, w: &Row<'_>) -> f32 {
    use std::arch::x86_64::*;
    let nb = w.scales.len();
    assert!(
        p.q.len() >= nb * BLOCK
            && p.deltas.len() >= nb
            && w.quants.len() >= nb * super::packed::Packed::quant_bytes(w.fmt)
    );
    let ones = _mm256_set1_epi16(1);
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for b in 0..nb {
        // SAFETY: block b's 32 activation bytes and its values are in bounds (asserted above).
        let prod = unsafe {
            let qx = _mm256_loadu_si256(p.q.as_ptr().add(b * BLOCK).cast());
            match w.fmt {
                BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
                    let (lo, hi) = avx2::nibbles(w.quants.as_ptr().add(b * 16));
                    _mm256_maddubs_epi16(_mm256_set_m128i(hi, lo), qx)
                }
                BlockFormat::Q8_0 => {
                    let qw = _mm256_loadu_si256(w.quants.as_ptr().add(b * 32).cast());
                    _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qx, qw))
                }
            }
        };
        let v = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
        let d = _mm256_set1_ps(w.scales[b] * p.deltas[b]);
        if b % 2 == 0 {
            acc0 = _mm256_fmadd_ps(v, d, acc0);
        } else {
            acc1 = _mm256_fmadd_ps(v, d, acc1);
        }
    }
    // SAFETY: the features `dot_avx2` needs are this function's.
    avx2::hsum(_mm256_add_ps(acc0, acc1)) + offsets(w, p.sums, |a, b| unsafe { super::dot::dot_avx2(a, b) })
}

#[cfg(test)]
mod tests {
    use super::super::packed::Packed;
    use super::super::packed::tests::{blocks, floats};
    use super::*;

    /// Every kernel (this CPU's and the portable one, both modes, every format) against the
    /// f64 dot product of the activations with the dequantized weights: exact within 1e-5 of
    /// the factored sum's magnitude `Σ|x|·(|q·d| + |c|)`, fast within the activations'
    /// rounding bound.
    #[test]
    fn quantized_dots_match_the_dequantized_reference_within_their_bounds() {
        for fmt in [BlockFormat::Q4_0, BlockFormat::Q4_1, BlockFormat::Q8_0] {
            let (n, k) = (40, 352); // 11 blocks: pairs and an odd last one
            let p = Packed::new(fmt, n, k, &blocks(fmt, n, k, 5));
            let mut wf = vec![0.0; n * k];
            p.dequantize_rows(0, &mut wf);
            let x = floats(2 * k, 17);
            for math in [CpuMath::Exact, CpuMath::Fast] {
                let prep = Prepared::new(math, &x, 2, k);
                for (name, kern) in kernels(math) {
                    for r in 0..2 {
                        let pr = prep.row(&x, r);
                        for col in 0..n {
                            let (xr, wr) = (&x[r * k..(r + 1) * k], &wf[col * k..(col + 1) * k]);
                            let want: f64 = xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum();
                            // The factored sum's conditioning: Σ |x|·(|q·d| + |c|) per block
                            // (≥ Σ |x·w|; the offset term is summed apart).
                            let row = p.row(col);
                            let mag: f64 = (0..k / BLOCK)
                                .map(|b| {
                                    let (d, c) = (row.scales[b] as f64, row.offset(b) as f64);
                                    let q = row.ints(b);
                                    (0..BLOCK)
                                        .map(|j| (xr[b * BLOCK + j] as f64).abs() * ((q[j] as f64 * d).abs() + c.abs()))
                                        .sum::<f64>()
                                })
                                .sum();
                            let bound = match math {
                                CpuMath::Exact => 1e-5 * mag,
                                CpuMath::Fast => {
                                    let round: f64 = (0..k / BLOCK)
                                        .map(|b| {
                                            let w1: f64 = wr[b * 32..(b + 1) * 32].iter().map(|v| v.abs() as f64).sum();
                                            pr.deltas[b] as f64 / 2.0 * w1
                                        })
                                        .sum();
                                    round * 1.001 + 1e-5 * mag
                                }
                            };
                            // SAFETY: `kernel` picked a kernel this CPU runs.
                            let got = unsafe { kern(&pr, &p.row(col)) } as f64;
                            assert!(
                                (got - want).abs() <= bound,
                                "{fmt:?} {math:?} {name} row {r} col {col}: {got} vs {want} (bound {bound})"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The rows kernel (tiles of activation rows by groups of weight rows, and the tails after
    /// them, from any first row) gives each cell exactly the per-row kernel's bits, in both
    /// modes, and writes no cell outside its own: a product's cells do not change with how
    /// its tasks group columns or activation rows.
    #[test]
    fn the_rows_kernel_gives_the_per_row_kernels_bits() {
        for fmt in [BlockFormat::Q4_0, BlockFormat::Q4_1, BlockFormat::Q8_0] {
            for k in [32, 64, 96, 352, 576] {
                let n = 23;
                let p = Packed::new(fmt, n, k, &blocks(fmt, n, k, 7));
                for m in [1, 2, 3, 4, 7, 9] {
                    let x = floats(m * k, 29 + m as u64);
                    for math in [CpuMath::Exact, CpuMath::Fast] {
                        let prep = Prepared::new(math, &x, m, k);
                        let rows: Vec<_> = (0..m).map(|r| prep.row(&x, r)).collect();
                        // SAFETY: both kernels were picked for this CPU.
                        let one: Vec<Vec<f32>> = rows
                            .iter()
                            .map(|row| (0..n).map(|c| unsafe { kernel(math)(row, &p.row(c)) }).collect())
                            .collect();
                        for (first, len) in [(0, n), (3, 9), (5, 4), (22, 1)] {
                            let stride = len + 3;
                            let mut got = vec![f32::NAN; m * stride];
                            // SAFETY: `got` holds m rows of `stride` cells.
                            unsafe { rows_kernel(math)(&rows, &p, first, len, got.as_mut_ptr(), stride) };
                            for (r, (got, one)) in got.chunks(stride).zip(&one).enumerate() {
                                let what = format!("{fmt:?} {math:?} k {k} m {m} row {r} cols {first}+{len}");
                                assert_eq!(got[..len], one[first..first + len], "{what}");
                                assert!(got[len..].iter().all(|v| v.is_nan()), "{what}: wrote past its cells");
                            }
                        }
                    }
                }
            }
        }
    }

    /// The fast mode's error is real (it is not exact mode under another name) and all its
    /// kernels do the same integer arithmetic.
    #[test]
    fn fast_mode_rounds_the_activations_and_both_fast_kernels_agree() {
        let fmt = BlockFormat::Q4_1;
        let (n, k) = (8, 256);
        let p = Packed::new(fmt, n, k, &blocks(fmt, n, k, 9));
        let x = floats(k, 3);
        let (e, f) = (Prepared::new(CpuMath::Exact, &x, 1, k), Prepared::new(CpuMath::Fast, &x, 1, k));
        let mut differ = 0;
        for col in 0..n {
            let w = p.row(col);
            // SAFETY: `kernel` picks kernels this CPU runs.
            let (exact, fast, fast_portable) = unsafe {
                (
                    kernel(CpuMath::Exact)(&e.row(&x, 0), &w),
                    kernel(CpuMath::Fast)(&f.row(&x, 0), &w),
                    portable(CpuMath::Fast)(&f.row(&x, 0), &w),
                )
            };
            differ += usize::from(exact != fast);
            assert!(
                (fast - fast_portable).abs() <= 1e-5 * fast.abs().max(1e-3),
                "col {col}: {fast} vs {fast_portable}"
            );
        }
        assert!(differ > n / 2, "fast equals exact in {} of {n} columns", n - differ);
    }
}
