//! `out = x · wᵀ` with `w` kept block-quantized in rows ([`Packed`]: CPUs without AVX2; the
//! others lay weights out in groups of 16 rows, [`qtile`](super::qtile)): ~4–8×
//! fewer bytes read per token than f32 weights, which is what batch-1 decode is bound by.
//!
//! - Fast mode, any number of rows, and exact mode up to [`GEMV_MAX_ROWS`] rows: each weight
//!   row is dotted with every prepared activation row by the [`qdot`](super::qdot) kernel of
//!   the backend's [`CpuMath`]. In fast mode a row's result so depends on that row alone, not
//!   on the batch it came in: chunked and whole prefills, batched and lone decodes agree bit
//!   for bit. (An f32 SGEMM on the rounded activations computes the same sums in another
//!   order, but a last-bit difference can flip the next layer's rounding: 0.2 % apart after
//!   two layers of the tiny test model.)
//! - Exact mode, more rows: the f32 SGEMM of [`super::matmul`] on columns dequantized a slice
//!   at a time (the dequantized weights are exactly the model's).

use rayon::prelude::*;

use super::CpuMath;
use super::matmul::{GEMV_MAX_ROWS, SendPtr, gemm_block, gemm_blocks};
use super::packed::Packed;
use super::qdot::{Prepared, rows_kernel};

/// Columns dequantized at a time on the SGEMM path.
const GEMM_SLICE: usize = 256;
/// Output cells per rayon task on the kernel path (about; at least one column).
const CELLS_PER_TASK: usize = 4096;

pub(super) fn qmatmul_t(math: CpuMath, x: &[f32], m: usize, w: &Packed, n: usize, k: usize, out: &mut [f32]) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(x.len() >= m * k && out.len() >= m * n && w.blocks * crate::quant::BLOCK == k, "qmatmul shapes");
    if math == CpuMath::Fast || m <= GEMV_MAX_ROWS {
        by_kernel(math, x, m, w, n, k, out);
    } else {
        qgemm(x, m, w, n, k, out);
    }
}

/// Every cell by the mode's dot-product kernel, tasks owning runs of columns (each weight
/// row read once per task, against every activation row).
fn by_kernel(math: CpuMath, x: &[f32], m: usize, w: &Packed, n: usize, k: usize, out: &mut [f32]) {
    let prep = Prepared::new(math, x, m, k);
    let rows: Vec<_> = (0..m).map(|r| prep.row(x, r)).collect();
    let dot = rows_kernel(math);
    let ptr = SendPtr(out.as_mut_ptr());
    column_runs(m, n, |c0, c1| {
        // SAFETY: `out` is (m, n); columns c0..c1 of every row are written by this task only;
        // `rows_kernel` picked a kernel this CPU runs.
        unsafe { dot(&rows, w, c0, c1 - c0, ptr.at(c0), n) };
    });
}

/// Runs `task(c0, c1)` in parallel over runs of the `n` output columns of an `m`-row product:
/// as many runs as there are runs of at most 64 columns (fewer rows' worth of cells when the
/// batch is big), rounded up to a multiple of the threads, the columns dealt out evenly in
/// whole groups of 4 (a kernel's rows): 576 columns on 2 threads are 10 tasks of 56–60, not 9
/// of 64 (one thread idle for a ninth of the product), 192 are 4 of 48, not 3 of 64.
pub(super) fn column_runs(m: usize, n: usize, task: impl Fn(usize, usize) + Sync + Send) {
    let most = (CELLS_PER_TASK / m.max(1)).clamp(4, 64);
    let tasks = n.div_ceil(most).next_multiple_of(rayon::current_num_threads().max(1));
    let edge = |t: usize| if t >= tasks { n } else { (t * n / tasks).next_multiple_of(4).min(n) };
    (0..tasks).into_par_iter().for_each(|t| task(edge(t), edge(t + 1)));
}

fn qgemm(x: &[f32], m: usize, w: &Packed, n: usize, k: usize, out: &mut [f32]) {
    gemm_dequantized(x, m, n, k, out, |first, f| w.dequantize_rows(first, f));
}

/// The f32 SGEMM of `x` with a quantized `(n, k)` matrix, `rows(first, f)` dequantizing rows
/// `first..first + f.len() / k` into `f`, a slice of columns at a time.
pub(super) fn gemm_dequantized(
    x: &[f32],
    m: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
    rows: impl Fn(usize, &mut [f32]) + Sync,
) {
    let (block, nblocks) = gemm_blocks(n);
    let ptr = SendPtr(out.as_mut_ptr());
    (0..nblocks).into_par_iter().for_each(|b| {
        let c0 = b * block;
        let nb = block.min(n - c0);
        let mut cols = super::zeroed(GEMM_SLICE.min(nb) * k);
        for s0 in (0..nb).step_by(GEMM_SLICE) {
            let ns = GEMM_SLICE.min(nb - s0);
            let first = c0 + s0;
            let f = &mut cols[..ns * k];
            rows(first, f);
            // SAFETY: columns first..first + ns of the output are written by this task only.
            unsafe { gemm_block(x, m, f, ns, k, ptr, first, n) };
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::matmul::matmul_t;
    use crate::cpu::packed::tests::{blocks, floats};
    use crate::quant::BlockFormat;

    /// Exact mode against the f32 path on the dequantized matrix, GEMV (1–4 rows) and SGEMM
    /// (more), every format: the SGEMM path is bit for bit the same computation; the GEMV path
    /// agrees within f32 summation error.
    #[test]
    fn exact_quantized_products_match_the_f32_path_on_the_dequantized_weights() {
        for fmt in [BlockFormat::Q4_0, BlockFormat::Q4_1, BlockFormat::Q8_0] {
            for (m, n, k) in [(1, 70, 64), (3, 130, 96), (4, 5, 576), (5, 300, 64), (17, 600, 160)] {
                let w = Packed::new(fmt, n, k, &blocks(fmt, n, k, (m * n * k) as u64));
                let mut wf = vec![0.0; n * k];
                w.dequantize_rows(0, &mut wf);
                let x = floats(m * k, n as u64);
                let (mut a, mut b) = (vec![0.0; m * n], vec![0.0; m * n]);
                qmatmul_t(CpuMath::Exact, &x, m, &w, n, k, &mut a);
                matmul_t(&x, m, &wf, n, k, &mut b);
                for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                    let (r, col) = (i / n, i % n);
                    let mag: f32 =
                        x[r * k..(r + 1) * k].iter().zip(&wf[col * k..(col + 1) * k]).map(|(u, v)| (u * v).abs()).sum();
                    let sgemm = m > GEMV_MAX_ROWS;
                    assert!(
                        if sgemm { p.to_bits() == q.to_bits() } else { (p - q).abs() <= 1e-5 * mag },
                        "{fmt:?} {m}x{n}x{k} output {i}: {p} vs {q}"
                    );
                }
            }
        }
    }

    /// Fast mode: a row's results do not depend on the rows it is batched with (one kernel
    /// for every batch size), and they stay within the activations' rounding of exact mode.
    #[test]
    fn fast_rows_are_independent_of_their_batch() {
        let fmt = BlockFormat::Q4_1;
        for (n, k) in [(37, 64), (300, 128), (130, 96)] {
            let w = Packed::new(fmt, n, k, &blocks(fmt, n, k, 4));
            let x = floats(150 * k, 21);
            let mut big = vec![0.0; 150 * n];
            qmatmul_t(CpuMath::Fast, &x, 150, &w, n, k, &mut big);
            let mut all = vec![0.0; 9 * n];
            qmatmul_t(CpuMath::Fast, &x, 9, &w, n, k, &mut all);
            assert_eq!(all, big[..9 * n], "9 rows alone and in a batch of 150 (other column groups)");
            let mut exact = vec![0.0; 9 * n];
            qmatmul_t(CpuMath::Exact, &x, 9, &w, n, k, &mut exact);
            for r in [0, 4, 8] {
                let mut one = vec![0.0; n];
                qmatmul_t(CpuMath::Fast, &x[r * k..(r + 1) * k], 1, &w, n, k, &mut one);
                assert_eq!(one, all[r * n..(r + 1) * n], "row {r}");
            }
            let worst = all.iter().zip(&exact).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(worst > 0.0 && worst < 0.05, "fast vs exact: worst difference {worst}");
        }
    }
}
