//! Q6_K matrices on the CPU, kept quantized: each weight's 6-bit `q` in blocks of 32 (16 bytes
//! of low nibbles, 8 of high bit pairs: [`pack`]), each 16-weight sub-block's signed scale `s`
//! as it is, each 256-weight block's `d` widened to f32 — 212 bytes per 256 weights against
//! the file's 210 (1.01×; bytes of `q − 32` took 276, f32 would be 4.9×). A block unpacks to
//! 32 bytes of `q − 32` in a few SIMD instructions. A weight is `(q − 32)·(d·s)`, ggml's value
//! bit for bit.
//!
//! Products in the backend's [`CpuMath`], as for the 32-weight formats ([`super::qmatmul`]):
//! - **exact**: `Σ_sub (d·s)·Σ_j x_j·q_j` in f32 (the model's values up to summation order);
//!   up to 4 activation rows cell by cell, more by the f32 SGEMM on columns dequantized a
//!   slice at a time;
//! - **fast**: the activations' 8-bit blocks of 32 ([`Prepared`]), integer sums per sub-block,
//!   `Σ_sub (d·s)·δ·Σ_j q_j·q_x,j`; every batch cell by cell, so a row's result does not
//!   depend on its batch.

use super::CpuMath;
use super::matmul::{GEMV_MAX_ROWS, SendPtr};
use super::qdot::{Prep, Prepared};
use super::qmatmul::{column_runs, gemm_dequantized};
use crate::quant::BLOCK;
use crate::quant_k::{SUPER, q6k_ints};

/// Weights per sub-block.
const SUB: usize = 16;

/// Bytes of a packed block of [`BLOCK`] weights: 16 of low nibbles, 8 of high bit pairs.
const PACKED: usize = 24;

/// Packs a block of 32 values `q − 32` (−32..32): weight `j < 16`'s low nibble is the low
/// nibble of byte `j`, weight `16 + j`'s the high one; weight `j`'s top two bits are bits
/// `2·(j / 8)` of byte `16 + j % 8`.
fn pack(v: &[i8]) -> [u8; PACKED] {
    let mut out = [0u8; PACKED];
    for (j, &v) in v.iter().enumerate().take(BLOCK) {
        let u = (v + 32) as u8;
        out[j % 16] |= (u & 0xF) << (4 * (j / 16));
        out[16 + j % 8] |= (u >> 4) << (2 * (j / 8));
    }
    out
}

/// The 32 values `q − 32` of a block [`pack`]ed.
#[inline(always)]
fn unpack(b: &[u8]) -> [i8; BLOCK] {
    std::array::from_fn(|j| {
        let lo = (b[j % 16] >> (4 * (j / 16))) & 0xF;
        let hi = (b[16 + j % 8] >> (2 * (j / 8))) & 3;
        (lo | hi << 4) as i8 - 32
    })
}

/// A `(rows, cols)` Q6_K matrix (`cols` a multiple of 256).
#[derive(Debug, Clone)]
pub(crate) struct Q6 {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// Every block of 32 weights [`pack`]ed, row after row.
    values: Vec<u8>,
    /// Every sub-block's scale `s`, row after row.
    subs: Vec<i8>,
    /// Every block's `d`, row after row.
    d: Vec<f32>,
}

/// One row of a [`Q6`] matrix.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Q6Row<'a> {
    values: &'a [u8],
    subs: &'a [i8],
    d: &'a [f32],
}

impl Q6Row<'_> {
    /// Weights in the row.
    #[inline(always)]
    fn len(&self) -> usize {
        self.values.len() / PACKED * BLOCK
    }

    /// Block `b`'s 32 values `q − 32`.
    #[inline(always)]
    fn block(&self, b: usize) -> [i8; BLOCK] {
        unpack(&self.values[b * PACKED..(b + 1) * PACKED])
    }

    /// Sub-block `s`'s scale `d·s` (exact in f32).
    #[inline(always)]
    fn scale(&self, s: usize) -> f32 {
        self.d[s / (SUPER / SUB)] * f32::from(self.subs[s])
    }
}

impl Q6 {
    /// Repacks ggml Q6_K blocks (`rows · cols / 256 · 210` bytes, checked by the caller).
    pub(crate) fn new(rows: usize, cols: usize, data: &[u8]) -> Self {
        let n = rows * cols;
        let mut m = Self {
            rows,
            cols,
            values: Vec::with_capacity(n / BLOCK * PACKED),
            subs: Vec::with_capacity(n / SUB),
            d: Vec::with_capacity(n / SUPER),
        };
        for blk in data.chunks_exact(210).take(n / SUPER) {
            q6k_ints(blk).chunks_exact(BLOCK).for_each(|v| m.values.extend_from_slice(&pack(v)));
            m.subs.extend(blk[192..208].iter().map(|&s| s as i8));
            m.d.push(half::f16::from_le_bytes([blk[208], blk[209]]).to_f32());
        }
        m
    }

    /// Puts `other`'s rows (same width) after this matrix's.
    pub(crate) fn append(&mut self, other: Q6) {
        assert_eq!(self.cols, other.cols, "stacking unlike matrices");
        self.rows += other.rows;
        self.values.extend_from_slice(&other.values);
        self.subs.extend_from_slice(&other.subs);
        self.d.extend_from_slice(&other.d);
    }

    /// Puts its buffers on huge pages where the kernel allows.
    pub(crate) fn settle(&self) {
        super::huge::collapse(&self.values);
        super::huge::collapse(&self.subs);
        super::huge::collapse(&self.d);
    }

    /// The first byte of its values (tests read the mapping's flags there).
    #[cfg(test)]
    pub(crate) fn values_ptr(&self) -> *const u8 {
        self.values.as_ptr().cast()
    }

    /// Bytes it takes in memory.
    pub(crate) fn resident_bytes(&self) -> usize {
        self.values.len() + self.subs.len() + 4 * self.d.len()
    }

    #[inline]
    fn row(&self, r: usize) -> Q6Row<'_> {
        let k = self.cols;
        Q6Row {
            values: &self.values[r * k / BLOCK * PACKED..(r + 1) * k / BLOCK * PACKED],
            subs: &self.subs[r * k / SUB..(r + 1) * k / SUB],
            d: &self.d[r * k / SUPER..(r + 1) * k / SUPER],
        }
    }

    /// Dequantizes rows `first..first + out.len() / cols` into `out`.
    pub(crate) fn dequantize_rows(&self, first: usize, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if exact_is_avx2() {
            for (i, o) in out.chunks_exact_mut(self.cols).enumerate() {
                // SAFETY: the CPU has AVX2 and FMA (the exact kernel chosen is AVX2's).
                unsafe { avx2::dequantize_row(&self.row(first + i), o) };
            }
            return;
        }
        for (i, o) in out.chunks_exact_mut(self.cols).enumerate() {
            dequantize_row_portable(&self.row(first + i), o);
        }
    }
}

/// Whether exact mode's kernel here is AVX2's (chosen once).
#[cfg(target_arch = "x86_64")]
fn exact_is_avx2() -> bool {
    static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX2.get_or_init(|| kernels(CpuMath::Exact)[0].0 == "avx2")
}

/// One row of [`Q6::dequantize_rows`], portably.
fn dequantize_row_portable(w: &Q6Row<'_>, out: &mut [f32]) {
    for (b, o) in out.chunks_exact_mut(BLOCK).take(w.len() / BLOCK).enumerate() {
        let v = w.block(b);
        for (s, (o, v)) in o.chunks_exact_mut(SUB).zip(v.chunks_exact(SUB)).enumerate() {
            let scale = w.scale(2 * b + s);
            for (o, &v) in o.iter_mut().zip(v) {
                *o = f32::from(v) * scale;
            }
        }
    }
}

/// `out = x · wᵀ` for `m` rows of `x` (`(m, cols)`), `out` `(m, rows)`.
pub(super) fn matmul(math: CpuMath, x: &[f32], m: usize, w: &Q6, out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    if m == 0 || n == 0 {
        return;
    }
    assert!(x.len() >= m * k && out.len() >= m * n, "q6 matmul shapes");
    if math == CpuMath::Exact && m > GEMV_MAX_ROWS {
        return gemm_dequantized(x, m, n, k, out, |first, f| w.dequantize_rows(first, f));
    }
    let prep = Prepared::new(math, x, m, k);
    let rows: Vec<_> = (0..m).map(|r| prep.row(x, r)).collect();
    let dot = rows_kernel(math);
    let ptr = SendPtr(out.as_mut_ptr());
    column_runs(m, n, |c0, c1| {
        let mut cells = [0.0f32; ROWS];
        for c in c0..c1 {
            let wr = w.row(c);
            for (g, group) in rows.chunks(ROWS).enumerate() {
                // SAFETY: `rows_kernel` picked a kernel this CPU runs.
                unsafe { dot(group, &wr, &mut cells) };
                for (i, &v) in cells[..group.len()].iter().enumerate() {
                    // SAFETY: cell (g·ROWS + i, c) is in `out` and written by this task only
                    // (its columns are c0..c1).
                    unsafe { *ptr.at((g * ROWS + i) * n + c) = v };
                }
            }
        }
    });
}

/// Activation rows a rows kernel takes at once.
const ROWS: usize = 4;

/// Up to [`ROWS`] prepared activation rows against one weight row, each cell into `out` the
/// bits the mode's [`Kernel`] gives for it alone (unsafe: as [`Kernel`]).
type RowsKernel = unsafe fn(&[Prep<'_>], &Q6Row<'_>, &mut [f32; ROWS]);

/// The rows kernel of `math` for this CPU, chosen once: AVX2's decode each weight once for
/// the rows, else a loop over [`kernel`].
fn rows_kernel(math: CpuMath) -> RowsKernel {
    static CHOSEN: std::sync::OnceLock<[RowsKernel; 2]> = std::sync::OnceLock::new();
    let chosen = |math| -> RowsKernel {
        #[cfg(target_arch = "x86_64")]
        if kernels(math)[0].0 == "avx2" {
            return if math == CpuMath::Exact { avx2::exact_rows } else { avx2::fast_rows };
        }
        if math == CpuMath::Exact { by_kernel::<false> } else { by_kernel::<true> }
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
/// As [`Kernel`].
unsafe fn by_kernel<const FAST: bool>(ps: &[Prep<'_>], w: &Q6Row<'_>, out: &mut [f32; ROWS]) {
    let dot = kernel(if FAST { CpuMath::Fast } else { CpuMath::Exact });
    for (o, p) in out.iter_mut().zip(ps) {
        // SAFETY: `kernel` picked a dot product this CPU runs.
        *o = unsafe { dot(p, w) };
    }
}

/// A dot product of one prepared activation row with one weight row (unsafe: the SIMD ones
/// need their CPU features; [`kernel`] returns only kernels this CPU runs).
type Kernel = unsafe fn(&Prep<'_>, &Q6Row<'_>) -> f32;

/// The kernel of `math` for this CPU, chosen once.
fn kernel(math: CpuMath) -> Kernel {
    static CHOSEN: std::sync::OnceLock<[Kernel; 2]> = std::sync::OnceLock::new();
    let [exact, fast] = *CHOSEN.get_or_init(|| [kernels(CpuMath::Exact)[0].1, kernels(CpuMath::Fast)[0].1]);
    match math {
        CpuMath::Exact => exact,
        CpuMath::Fast => fast,
    }
}

/// Every kernel of `math` this CPU runs, widest first, with its name.
fn kernels(math: CpuMath) -> Vec<(&'static str, Kernel)> {
    let mut all: Vec<(&'static str, Kernel)> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        all.push(("avx2", if math == CpuMath::Exact { avx2::exact } else { avx2::fast }));
    }
    all.push(("portable", if math == CpuMath::Exact { exact_portable } else { fast_portable }));
    all
}

/// # Safety
/// None: `unsafe` only to be a [`Kernel`].
unsafe fn exact_portable(p: &Prep<'_>, w: &Q6Row<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, x) in p.x.chunks_exact(BLOCK).take(w.len() / BLOCK).enumerate() {
        let v = w.block(b);
        for (h, (x, v)) in x.chunks_exact(SUB).zip(v.chunks_exact(SUB)).enumerate() {
            let t: f32 = x.iter().zip(v).map(|(x, &v)| x * f32::from(v)).sum();
            acc += t * w.scale(2 * b + h);
        }
    }
    acc
}

/// # Safety
/// None: `unsafe` only to be a [`Kernel`].
unsafe fn fast_portable(p: &Prep<'_>, w: &Q6Row<'_>) -> f32 {
    let mut acc = 0.0f32;
    for (b, qx) in p.q.chunks_exact(BLOCK).take(w.len() / BLOCK).enumerate() {
        let v = w.block(b);
        for (h, (qx, v)) in qx.chunks_exact(SUB).zip(v.chunks_exact(SUB)).enumerate() {
            let t: i32 = qx.iter().zip(v).map(|(&a, &b)| i32::from(a) * i32::from(b)).sum();
            acc += t as f32 * (w.scale(2 * b + h) * p.deltas[b]);
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{PACKED, Prep, Q6Row, ROWS, SUB};
    use crate::cpu::qdot::avx2::hsum;
    use crate::quant::BLOCK;

    /// The 32 values `q − 32` of the block [`super::pack`]ed at `b`, as bytes: the low
    /// nibbles split into two halves, the high bit pairs shifted out of one broadcast word.
    ///
    /// # Safety
    /// `b` holds [`PACKED`] bytes.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) unsafe fn unpack(b: *const u8) -> __m256i {
        // SAFETY: 24 bytes at `b` (the caller's contract).
        let (lo, h) = unsafe { (_mm_loadu_si128(b.cast()), b.add(16).cast::<i64>().read_unaligned()) };
        let m4 = _mm_set1_epi8(0x0F);
        let nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(lo, 4), m4), _mm_and_si128(lo, m4));
        // Lane l of four 64-bit lanes: the 8 bytes of pairs shifted right by 2·l, so its byte
        // i holds weight 8·l + i's pair in its low two bits.
        let pairs = _mm256_srlv_epi64(_mm256_set1_epi64x(h), _mm256_set_epi64x(6, 4, 2, 0));
        let high = _mm256_slli_epi16(_mm256_and_si256(pairs, _mm256_set1_epi8(3)), 4);
        _mm256_sub_epi8(_mm256_or_si256(nibbles, high), _mm256_set1_epi8(32))
    }

    /// [`super::Q6::dequantize_rows`] for one row: each block unpacked once, its values
    /// widened and scaled 8 at a time (the same products as the portable loop).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dequantize_row(w: &Q6Row<'_>, out: &mut [f32]) {
        let n = w.len();
        assert!(out.len() >= n && w.subs.len() * SUB >= n);
        let (v, o) = (w.values.as_ptr(), out.as_mut_ptr());
        for b in 0..n / BLOCK {
            // SAFETY: block b's packed bytes are in bounds (`n` counts them).
            let q = unsafe { unpack(v.add(b * PACKED)) };
            for (h, q) in [_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q)].into_iter().enumerate() {
                let s = 2 * b + h;
                let d = _mm256_set1_ps(w.scale(s));
                let (lo, hi) = (_mm256_cvtepi8_epi32(q), _mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
                // SAFETY: sub-block s's 16 outputs are in bounds (asserted above).
                unsafe {
                    _mm256_storeu_ps(o.add(s * SUB), _mm256_mul_ps(_mm256_cvtepi32_ps(lo), d));
                    _mm256_storeu_ps(o.add(s * SUB + 8), _mm256_mul_ps(_mm256_cvtepi32_ps(hi), d));
                }
            }
        }
    }

    /// [`super::exact_portable`] with AVX2 + FMA: a sub-block's 16 bytes widened to two
    /// vectors of f32, its sum scaled into one of two accumulators.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exact(p: &Prep<'_>, w: &Q6Row<'_>) -> f32 {
        let n = w.len();
        assert!(p.x.len() >= n && w.subs.len() * SUB >= n);
        let (x, v) = (p.x.as_ptr(), w.values.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 2];
        let ps = |q: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        for b in 0..n / BLOCK {
            // SAFETY: block b's packed bytes are in bounds (`n` counts them).
            let q = unsafe { unpack(v.add(b * PACKED)) };
            for (h, q) in [_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q)].into_iter().enumerate() {
                let s = 2 * b + h;
                // SAFETY: sub-block s's activations are in bounds (asserted above).
                let t = unsafe {
                    let t = _mm256_mul_ps(_mm256_loadu_ps(x.add(s * SUB)), ps(q));
                    _mm256_fmadd_ps(_mm256_loadu_ps(x.add(s * SUB + 8)), ps(_mm_srli_si128(q, 8)), t)
                };
                acc[h] = _mm256_fmadd_ps(t, _mm256_set1_ps(w.scale(s)), acc[h]);
            }
        }
        hsum(_mm256_add_ps(acc[0], acc[1]))
    }

    /// [`exact`] for up to [`ROWS`] activation rows, each sub-block widened once for all
    /// of them; each cell the bits [`exact`] gives it alone (same products, same order).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exact_rows(ps: &[Prep<'_>], w: &Q6Row<'_>, out: &mut [f32; ROWS]) {
        // SAFETY: this function's features are the callee's.
        unsafe {
            match ps.len() {
                1 => exact_group::<1>(ps, w, out),
                2 => exact_group::<2>(ps, w, out),
                3 => exact_group::<3>(ps, w, out),
                _ => exact_group::<4>(ps, w, out),
            }
        }
    }

    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exact_group<const R: usize>(ps: &[Prep<'_>], w: &Q6Row<'_>, out: &mut [f32; ROWS]) {
        let n = w.len();
        assert!(ps.len() >= R && ps[..R].iter().all(|p| p.x.len() >= n) && w.subs.len() * SUB >= n);
        let v = w.values.as_ptr();
        let xs: [*const f32; R] = std::array::from_fn(|r| ps[r].x.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let ps_ = |q: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        for b in 0..n / BLOCK {
            // SAFETY: block b's packed bytes are in bounds (`n` counts them).
            let q = unsafe { unpack(v.add(b * PACKED)) };
            for (h, q) in [_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q)].into_iter().enumerate() {
                let s = 2 * b + h;
                let (lo, hi) = (ps_(q), ps_(_mm_srli_si128(q, 8)));
                let d = _mm256_set1_ps(w.scale(s));
                for r in 0..R {
                    // SAFETY: row r's activations of sub-block s are in bounds (asserted above).
                    let t = unsafe {
                        let x = xs[r].add(s * SUB);
                        _mm256_fmadd_ps(_mm256_loadu_ps(x.add(8)), hi, _mm256_mul_ps(_mm256_loadu_ps(x), lo))
                    };
                    acc[r][h] = _mm256_fmadd_ps(t, d, acc[r][h]);
                }
            }
        }
        for r in 0..R {
            out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
        }
    }

    /// [`fast`] for up to [`ROWS`] activation rows, each block's values and their signs
    /// loaded once for all of them; each cell the bits [`fast`] gives it alone.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fast_rows(ps: &[Prep<'_>], w: &Q6Row<'_>, out: &mut [f32; ROWS]) {
        // SAFETY: this function's features are the callee's.
        unsafe {
            match ps.len() {
                1 => fast_group::<1>(ps, w, out),
                2 => fast_group::<2>(ps, w, out),
                3 => fast_group::<3>(ps, w, out),
                _ => fast_group::<4>(ps, w, out),
            }
        }
    }

    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn fast_group<const R: usize>(ps: &[Prep<'_>], w: &Q6Row<'_>, out: &mut [f32; ROWS]) {
        let n = w.len();
        let nb = n / BLOCK;
        assert!(
            ps.len() >= R && ps[..R].iter().all(|p| p.q.len() >= n && p.deltas.len() >= nb) && w.subs.len() * SUB >= n
        );
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for b in 0..nb {
            // SAFETY: block b's packed bytes are in bounds (`n` counts them).
            let qw = unsafe { unpack(w.values.as_ptr().add(b * PACKED)) };
            let aw = _mm256_sign_epi8(qw, qw);
            let scales = _mm256_set_m128(_mm_set1_ps(w.scale(2 * b + 1)), _mm_set1_ps(w.scale(2 * b)));
            for r in 0..R {
                // SAFETY: row r's block b of activation bytes is in bounds (asserted above).
                let qx = unsafe { _mm256_loadu_si256(ps[r].q.as_ptr().add(b * BLOCK).cast()) };
                let prod = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(qx, qw));
                let v = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
                // Each lane's scale·δ rounds as [`fast`]'s scalar product does.
                let d = _mm256_mul_ps(scales, _mm256_set1_ps(ps[r].deltas[b]));
                acc[r][b % 2] = _mm256_fmadd_ps(v, d, acc[r][b % 2]);
            }
        }
        for r in 0..R {
            out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
        }
    }

    /// [`super::fast_portable`] with AVX2: a block of 32 values against the activations'
    /// block by `maddubs` (signs moved onto the activations), the low four i32 lanes summing
    /// the first sub-block, the high four the second.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn fast(p: &Prep<'_>, w: &Q6Row<'_>) -> f32 {
        let n = w.len();
        let nb = n / BLOCK;
        assert!(p.q.len() >= n && p.deltas.len() >= nb && w.subs.len() * SUB >= n);
        let ones = _mm256_set1_epi16(1);
        let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for b in 0..nb {
            // SAFETY: block b's packed bytes (`n` counts them) and activation bytes (asserted
            // above) are in bounds.
            let (qw, qx) = unsafe {
                (unpack(w.values.as_ptr().add(b * PACKED)), _mm256_loadu_si256(p.q.as_ptr().add(b * BLOCK).cast()))
            };
            let prod = _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qx, qw));
            let v = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
            let delta = p.deltas[b];
            let d = _mm256_set_m128(_mm_set1_ps(w.scale(2 * b + 1) * delta), _mm_set1_ps(w.scale(2 * b) * delta));
            if b % 2 == 0 {
                acc0 = _mm256_fmadd_ps(v, d, acc0);
            } else {
                acc1 = _mm256_fmadd_ps(v, d, acc1);
            }
        }
        hsum(_mm256_add_ps(acc0, acc1))
    }
}

#[cfg(test)]
mod tests;
