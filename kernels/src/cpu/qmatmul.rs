//! `out = x · wᵀ` with `w` kept block-quantized ([`BlockFormat`]): ~4–8× fewer bytes read per
//! token than f32 weights, which is what batch-1 decode is bound by.
//!
//! Exact: every weight is dequantized in registers by the operations of
//! [`BlockFormat::dequantize_block`] (mul, then add: no fused rounding), and the dot products
//! accumulate in the order of [`super::dot::dot`] (two 8-lane accumulators over 16-weight
//! chunks with AVX2 + FMA, eight over 8-weight chunks without), so the results are bit for bit
//! those of the f32 path on the dequantized matrix. More rows than [`super::matmul`]'s GEMV
//! takes go to the same SGEMM on columns dequantized a slice at a time.

use rayon::prelude::*;

use crate::quant::{BLOCK, BlockFormat};

use super::matmul::{GEMV_MAX_ROWS, SendPtr, gemm_block, gemm_blocks, gemv_by};

/// Columns dequantized at a time on the SGEMM path.
const GEMM_SLICE: usize = 256;

pub(super) fn qmatmul_t(x: &[f32], m: usize, w: &[u8], fmt: BlockFormat, n: usize, k: usize, out: &mut [f32]) {
    if m == 0 || n == 0 {
        return;
    }
    if m <= GEMV_MAX_ROWS {
        qgemv(x, m, w, fmt, n, k, out);
    } else {
        qgemm(x, m, w, fmt, n, k, out);
    }
}

fn qgemv(x: &[f32], m: usize, w: &[u8], fmt: BlockFormat, n: usize, k: usize, out: &mut [f32]) {
    let rb = fmt.row_bytes(k);
    let dot = qdot_fn();
    gemv_by(m, n, out, |r, col| dot(&x[r * k..(r + 1) * k], &w[col * rb..(col + 1) * rb], fmt));
}

fn qgemm(x: &[f32], m: usize, w: &[u8], fmt: BlockFormat, n: usize, k: usize, out: &mut [f32]) {
    let rb = fmt.row_bytes(k);
    let dequantize = dequantize_fn();
    let (block, nblocks) = gemm_blocks(n);
    let ptr = SendPtr(out.as_mut_ptr());
    (0..nblocks).into_par_iter().for_each(|b| {
        let c0 = b * block;
        let nb = block.min(n - c0);
        let mut cols = vec![0.0f32; GEMM_SLICE.min(nb) * k];
        for s0 in (0..nb).step_by(GEMM_SLICE) {
            let ns = GEMM_SLICE.min(nb - s0);
            let first = c0 + s0;
            let f = &mut cols[..ns * k];
            dequantize(fmt, &w[first * rb..(first + ns) * rb], f);
            // SAFETY: columns first..first + ns of the output are written by this task only.
            unsafe { gemm_block(x, m, f, ns, k, ptr, first, n) };
        }
    });
}

type QDot = fn(&[f32], &[u8], BlockFormat) -> f32;

/// Whether the SIMD kernels here can run.
#[cfg(target_arch = "x86_64")]
fn avx2_fma_f16c() -> bool {
    std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
}

/// The dot product for this CPU, chosen once per call of the matmul.
fn qdot_fn() -> QDot {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_fma_f16c() {
            // SAFETY: the features `qdot_avx2` is compiled for were detected just above.
            return |x, w, f| unsafe { qdot_avx2(x, w, f) };
        }
    }
    qdot_portable
}

/// `Σ x[i] · w[i]` over a row of quantized weights, in `dot_portable`'s order.
fn qdot_portable(x: &[f32], w: &[u8], fmt: BlockFormat) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut blk = [0.0f32; BLOCK];
    for (b, q) in w.chunks_exact(fmt.block_bytes()).enumerate() {
        fmt.dequantize_block(q, &mut blk);
        let xs = &x[b * BLOCK..(b + 1) * BLOCK];
        for c in 0..BLOCK / 8 {
            for j in 0..8 {
                acc[j] += xs[c * 8 + j] * blk[c * 8 + j];
            }
        }
    }
    acc.iter().sum()
}

/// The same in `dot_avx2`'s order, the weights dequantized in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qdot_avx2(x: &[f32], w: &[u8], fmt: BlockFormat) -> f32 {
    use std::arch::x86_64::*;
    let bs = fmt.block_bytes();
    let blocks = w.len() / bs;
    assert!(x.len() >= blocks * BLOCK, "a row of {} weights against {} inputs", blocks * BLOCK, x.len());
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    for b in 0..blocks {
        let q = &w[b * bs..(b + 1) * bs];
        // SAFETY: `q` is one whole block.
        let v = unsafe { block_avx2(q, fmt) };
        // SAFETY: b * 32 + 32 <= x.len(), checked above.
        unsafe {
            let px = x.as_ptr().add(b * BLOCK);
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(px), v[0], acc0);
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(px.add(8)), v[1], acc1);
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(px.add(16)), v[2], acc0);
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(px.add(24)), v[3], acc1);
        }
    }
    let acc = _mm256_add_ps(acc0, acc1);
    let mut lanes = [0.0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    lanes.iter().sum()
}

/// The 32 weights of block `q` as four 8-lane vectors, each exactly as
/// [`BlockFormat::dequantize_block`] makes it (the products `q·d` are exact in f32: a 4- or
/// 8-bit integer times an f16 scale).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `q` is one whole block of `fmt`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block_avx2(q: &[u8], fmt: BlockFormat) -> [std::arch::x86_64::__m256; 4] {
    use std::arch::x86_64::*;
    // The f16 at byte `at`, widened (exactly) by the F16C instruction.
    let half =
        |at: usize| _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le_bytes([q[at], q[at + 1]])))));
    match fmt {
        BlockFormat::Q4_1 | BlockFormat::Q4_0 => {
            let (d, off) = match fmt {
                BlockFormat::Q4_1 => (half(0), 4),
                _ => (half(0), 2),
            };
            // SAFETY: `off + 16 <= bs`: the 16 nibble bytes of the block.
            let raw = unsafe { _mm_loadu_si128(q.as_ptr().add(off).cast()) };
            let mask = _mm_set1_epi8(0x0F);
            let lo = _mm_and_si128(raw, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
            let ints = [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)].map(|b| _mm256_cvtepu8_epi32(b));
            let dv = _mm256_set1_ps(d);
            match fmt {
                BlockFormat::Q4_1 => {
                    let mv = _mm256_set1_ps(half(2));
                    ints.map(|i| _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(i), dv), mv))
                }
                _ => {
                    let eight = _mm256_set1_epi32(8);
                    ints.map(|i| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(i, eight)), dv))
                }
            }
        }
        BlockFormat::Q8_0 => {
            let dv = _mm256_set1_ps(half(0));
            // SAFETY: bytes 2..34 of the block: four runs of 8.
            let ints =
                [2, 10, 18, 26].map(|at| unsafe { _mm256_cvtepi8_epi32(_mm_loadl_epi64(q.as_ptr().add(at).cast())) });
            ints.map(|i| _mm256_mul_ps(_mm256_cvtepi32_ps(i), dv))
        }
    }
}

/// [`BlockFormat::dequantize`] with [`block_avx2`].
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `out.len()` is 32 × the blocks in `data`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_avx2(fmt: BlockFormat, data: &[u8], out: &mut [f32]) {
    use std::arch::x86_64::*;
    for (q, o) in data.chunks_exact(fmt.block_bytes()).zip(out.chunks_exact_mut(BLOCK)) {
        // SAFETY: `q` is a whole block; `o` holds 32 floats.
        unsafe {
            let v = block_avx2(q, fmt);
            for (i, v) in v.into_iter().enumerate() {
                _mm256_storeu_ps(o.as_mut_ptr().add(8 * i), v);
            }
        }
    }
}

/// The dequantization for this CPU.
fn dequantize_fn() -> fn(BlockFormat, &[u8], &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_fma_f16c() {
            // SAFETY: the features `dequantize_avx2` is compiled for were detected just above.
            return |f, d, o| unsafe { dequantize_avx2(f, d, o) };
        }
    }
    |f, d, o| f.dequantize(d, o)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::matmul::matmul_t;

    /// Random blocks of `fmt` for `n` rows of `k` weights (scales kept modest).
    fn blocks(fmt: BlockFormat, n: usize, k: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut out = Vec::new();
        for _ in 0..n * k / BLOCK {
            let scale = half::f16::from_f32((next() % 1000) as f32 / 20_000.0 + 1e-4).to_le_bytes();
            let min = half::f16::from_f32(-((next() % 1000) as f32) / 30_000.0).to_le_bytes();
            out.extend_from_slice(&scale);
            if fmt == BlockFormat::Q4_1 {
                out.extend_from_slice(&min);
            }
            let q = fmt.block_bytes() - out.len() % fmt.block_bytes();
            out.extend((0..q).map(|_| next() as u8));
        }
        out
    }

    fn floats(n: usize, seed: u64) -> Vec<f32> {
        (0..n).map(|i| ((i as u64 * 2_654_435_761 + seed) % 2000) as f32 / 1000.0 - 1.0).collect()
    }

    /// Bit for bit the f32 path on the dequantized matrix: GEMV (1–4 rows) and SGEMM (more),
    /// every format, on this CPU's dot product and the portable one.
    #[test]
    fn quantized_products_equal_the_f32_path_on_the_dequantized_weights_bit_for_bit() {
        for fmt in [BlockFormat::Q4_0, BlockFormat::Q4_1, BlockFormat::Q8_0] {
            for (m, n, k) in [(1, 70, 64), (3, 130, 96), (4, 5, 576), (5, 300, 64), (17, 600, 160)] {
                let w = blocks(fmt, n, k, (m * n * k) as u64);
                let mut wf = vec![0.0; n * k];
                fmt.dequantize(&w, &mut wf);
                let x = floats(m * k, n as u64);
                let (mut a, mut b) = (vec![0.0; m * n], vec![0.0; m * n]);
                qmatmul_t(&x, m, &w, fmt, n, k, &mut a);
                matmul_t(&x, m, &wf, n, k, &mut b);
                let differ = a.iter().zip(&b).filter(|(p, q)| p.to_bits() != q.to_bits()).count();
                assert_eq!(differ, 0, "{fmt:?} {m}x{n}x{k}: {differ} of {} outputs differ", m * n);
                let rb = fmt.row_bytes(k);
                for col in 0..n {
                    let want = crate::cpu::dot::dot_portable(&x[..k], &wf[col * k..(col + 1) * k]);
                    let got = qdot_portable(&x[..k], &w[col * rb..(col + 1) * rb], fmt);
                    assert_eq!(got.to_bits(), want.to_bits(), "{fmt:?} portable, column {col}");
                }
            }
        }
    }
}
