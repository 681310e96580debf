//! F16 and BF16 matrices on the CPU, kept as the file has them: 2 bytes a weight, half of
//! f32, widened to f32 in registers (exactly: every f16 and bf16 is an f32). Products are
//! f32's in both numeric modes, up to summation order: up to 4 activation rows against each
//! weight row by a kernel that widens a weight once for all of them, more by the f32 SGEMM on
//! columns widened a slice at a time.

use super::matmul::{GEMV_MAX_ROWS, SendPtr};
use super::qmatmul::{column_runs, gemm_dequantized};
use crate::quant::WeightFormat;

/// Activation rows a kernel call takes at once.
const ROWS: usize = GEMV_MAX_ROWS;

/// A `(rows, cols)` matrix of 16-bit floats.
#[derive(Debug, Clone)]
pub(crate) struct Half16 {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// bfloat16 (else IEEE half).
    pub(crate) bf16: bool,
    /// The values' bits, row after row.
    values: Vec<u16>,
}

impl Half16 {
    /// The matrix of `rows · cols` little-endian values of `fmt` (F16 or BF16; sizes checked
    /// by the caller).
    pub(crate) fn new(fmt: WeightFormat, rows: usize, cols: usize, data: &[u8]) -> Self {
        let values = data.chunks_exact(2).take(rows * cols).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
        Self { rows, cols, bf16: fmt == WeightFormat::BF16, values }
    }

    /// Puts `other`'s rows (same kind and width) after this matrix's.
    pub(crate) fn append(&mut self, other: Half16) {
        assert!(self.cols == other.cols && self.bf16 == other.bf16, "stacking unlike matrices");
        self.rows += other.rows;
        self.values.extend_from_slice(&other.values);
    }

    /// Puts its values on huge pages where the kernel allows.
    pub(crate) fn settle(&self) {
        super::huge::collapse(&self.values);
    }

    /// The first byte of its values (tests read the mapping's flags there).
    #[cfg(test)]
    pub(crate) fn values_ptr(&self) -> *const u8 {
        self.values.as_ptr().cast()
    }

    /// Bytes it takes in memory.
    pub(crate) fn resident_bytes(&self) -> usize {
        2 * self.values.len()
    }

    /// Widens rows `first..first + out.len() / cols` into `out` (the `half` crate's slice
    /// conversion: SIMD where the CPU has it).
    pub(crate) fn dequantize_rows(&self, first: usize, out: &mut [f32]) {
        use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
        let bits = &self.values[first * self.cols..first * self.cols + out.len()];
        if self.bf16 {
            bits.reinterpret_cast::<half::bf16>().convert_to_f32_slice(out);
        } else {
            bits.reinterpret_cast::<half::f16>().convert_to_f32_slice(out);
        }
    }
}

/// The f32 value of a weight's bits.
fn widen(bf16: bool) -> fn(u16) -> f32 {
    if bf16 { |v| half::bf16::from_bits(v).to_f32() } else { |v| half::f16::from_bits(v).to_f32() }
}

/// `out = x · wᵀ` for `m` rows of `x` (`(m, cols)`), `out` `(m, rows)`.
pub(super) fn matmul(x: &[f32], m: usize, w: &Half16, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    if m == 0 || n == 0 {
        return;
    }
    assert!(x.len() >= m * k && out.len() >= m * n, "half matmul shapes");
    if m > GEMV_MAX_ROWS {
        return gemm_dequantized(x, m, n, k, out, |first, f| w.dequantize_rows(first, f));
    }
    let xs: Vec<&[f32]> = x[..m * k].chunks_exact(k).collect();
    let dot = kernel(w.bf16);
    let ptr = SendPtr(out.as_mut_ptr());
    column_runs(m, n, |c0, c1| {
        let mut cells = [0.0f32; ROWS];
        for c in c0..c1 {
            // SAFETY: `kernel` picked a kernel this CPU runs.
            unsafe { dot(&xs, &w.values[c * k..(c + 1) * k], &mut cells) };
            for (a, &v) in cells[..m].iter().enumerate() {
                // SAFETY: cell (a, c) is in `out` and written by this task only (its columns
                // are c0..c1).
                unsafe { *ptr.at(a * n + c) = v };
            }
        }
    });
}

/// Up to [`ROWS`] activation rows dotted with one weight row into `out` (unsafe: the SIMD
/// kernels need their CPU features; [`kernel`] returns only kernels this CPU runs).
type Kernel = unsafe fn(&[&[f32]], &[u16], &mut [f32; ROWS]);

/// The kernel for `bf16` (else f16) weights on this CPU, chosen once.
fn kernel(bf16: bool) -> Kernel {
    static CHOSEN: std::sync::OnceLock<[Kernel; 2]> = std::sync::OnceLock::new();
    let [f16, bf] = *CHOSEN.get_or_init(|| [kernels(false)[0].1, kernels(true)[0].1]);
    if bf16 { bf } else { f16 }
}

/// Every kernel for `bf16` (else f16) weights this CPU runs, widest first, with its name.
fn kernels(bf16: bool) -> Vec<(&'static str, Kernel)> {
    let mut all: Vec<(&'static str, Kernel)> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        use std::is_x86_feature_detected as has;
        // Both kinds need F16C: the AVX2 kernel is compiled with it (a virtual CPU may offer
        // AVX2 without it).
        if has!("avx2") && has!("fma") && has!("f16c") {
            all.push(("avx2", if bf16 { avx2::rows::<true> } else { avx2::rows::<false> }));
        }
    }
    all.push(("portable", if bf16 { portable::<true> } else { portable::<false> }));
    all
}

/// # Safety
/// None: `unsafe` only to be a [`Kernel`].
unsafe fn portable<const BF16: bool>(xs: &[&[f32]], w: &[u16], out: &mut [f32; ROWS]) {
    let widen = widen(BF16);
    for (o, x) in out.iter_mut().zip(xs) {
        *o = x.iter().zip(w).map(|(&x, &v)| x * widen(v)).sum();
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::ROWS;
    use crate::cpu::qdot::avx2::hsum;

    /// Eight weights at `p` widened to f32.
    ///
    /// # Safety
    /// `p` points at 8 readable values; the CPU has AVX2 and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load<const BF16: bool>(p: *const u16) -> __m256 {
        // SAFETY: the caller's promise.
        let v = unsafe { _mm_loadu_si128(p.cast()) };
        if BF16 { _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)) } else { _mm256_cvtph_ps(v) }
    }

    /// [`super::Kernel`] with AVX2 + FMA (+ F16C for f16): 16 weights a step widened once
    /// for every row, two accumulators a row.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and (for f16 weights) F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows<const BF16: bool>(xs: &[&[f32]], w: &[u16], out: &mut [f32; ROWS]) {
        // SAFETY: this function's features are the callee's.
        unsafe {
            match xs.len() {
                1 => group::<BF16, 1>(xs, w, out),
                2 => group::<BF16, 2>(xs, w, out),
                3 => group::<BF16, 3>(xs, w, out),
                _ => group::<BF16, 4>(xs, w, out),
            }
        }
    }

    /// # Safety
    /// As [`rows`].
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group<const BF16: bool, const R: usize>(xs: &[&[f32]], w: &[u16], out: &mut [f32; ROWS]) {
        let k = w.len();
        assert!(xs.len() >= R && xs[..R].iter().all(|x| x.len() >= k));
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let body = k / 16 * 16;
        for j in (0..body).step_by(16) {
            // SAFETY: weights and activations j..j + 16 are in bounds (j + 16 ≤ k, asserted).
            unsafe {
                let (w0, w1) = (load::<BF16>(w.as_ptr().add(j)), load::<BF16>(w.as_ptr().add(j + 8)));
                for r in 0..R {
                    let x = xs[r].as_ptr().add(j);
                    acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x), w0, acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(8)), w1, acc[r][1]);
                }
            }
        }
        let widen = super::widen(BF16);
        for r in 0..R {
            let tail: f32 = xs[r][body..k].iter().zip(&w[body..]).map(|(&x, &v)| x * widen(v)).sum();
            out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + tail;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::matmul::matmul_t;
    use crate::cpu::packed::tests::floats;

    /// A matrix of `fmt` from `n·k` values, with those values as the f32 they widen to.
    fn matrix(fmt: WeightFormat, n: usize, k: usize, seed: u64) -> (Half16, Vec<f32>) {
        let bits: Vec<u16> = floats(n * k, seed)
            .iter()
            .map(|&v| {
                if fmt == WeightFormat::BF16 {
                    half::bf16::from_f32(v).to_bits()
                } else {
                    half::f16::from_f32(v).to_bits()
                }
            })
            .collect();
        let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        let mut f = vec![0.0; n * k];
        fmt.dequantize(&bytes, &mut f);
        (Half16::new(fmt, n, k, &bytes), f)
    }

    /// Both kinds: rows widen to the file's values bit for bit (stacked too); products of
    /// 1–9 rows against the f32 path on those values — past 4 rows the same bits (the same
    /// SGEMM), up to 4 within 1e-5 of `Σ|x·w|` by every kernel, cell for cell the same bits
    /// whatever the batch; a width with a tail past the last 16.
    #[test]
    fn half_matrices_multiply_as_their_f32_values() {
        for fmt in [WeightFormat::F16, WeightFormat::BF16] {
            for k in [256, 72] {
                let (mut w, mut f) = matrix(fmt, 30, k, 3);
                let (w2, f2) = matrix(fmt, 10, k, 4);
                w.append(w2);
                f.extend(f2);
                let n = 40;
                let mut back = vec![0.0; n * k];
                w.dequantize_rows(0, &mut back);
                assert!(back.iter().zip(&f).all(|(a, b)| a.to_bits() == b.to_bits()), "{fmt:?}");
                assert_eq!(w.resident_bytes(), 2 * n * k);
                let mut alone = vec![0.0; n];
                for m in [1usize, 2, 3, 4, 5, 9] {
                    let x: Vec<f32> = (0..m).flat_map(|r| floats(k, 10 + r as u64)).collect();
                    let (mut got, mut want) = (vec![0.0; m * n], vec![0.0; m * n]);
                    matmul(&x, m, &w, &mut got);
                    matmul_t(&x, m, &f, n, k, &mut want);
                    if m > GEMV_MAX_ROWS {
                        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{fmt:?} m={m}");
                        continue;
                    }
                    if m == 1 {
                        alone.copy_from_slice(&got);
                    }
                    assert_eq!(got[..n], alone[..], "{fmt:?}: row 0 in a batch of {m}");
                    for (name, kern) in kernels(fmt == WeightFormat::BF16) {
                        let xs: Vec<&[f32]> = x.chunks_exact(k).collect();
                        for c in 0..n {
                            let mut cells = [0.0; ROWS];
                            // SAFETY: `kernels` lists only kernels this CPU runs.
                            unsafe { kern(&xs, &f_bits(&w, c), &mut cells) };
                            for (a, &g) in cells[..m].iter().enumerate() {
                                let wc = &f[c * k..(c + 1) * k];
                                let want: f64 = xs[a].iter().zip(wc).map(|(&p, &q)| f64::from(p) * f64::from(q)).sum();
                                let abs: f64 = xs[a].iter().zip(wc).map(|(&p, &q)| f64::from((p * q).abs())).sum();
                                assert!((f64::from(g) - want).abs() <= 1e-5 * abs, "{fmt:?} {name} m={m} ({a}, {c})");
                            }
                        }
                    }
                }
            }
        }
    }

    fn f_bits(w: &Half16, c: usize) -> Vec<u16> {
        w.values[c * w.cols..(c + 1) * w.cols].to_vec()
    }
}
