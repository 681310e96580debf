//! `out = x · wᵀ` for row-major `x (m, k)` and `w (n, k)`.
//!
//! Few rows (decode) are memory bound: each weight row is read once and dotted with every
//! input row. More rows (prefill) go to `matrixmultiply`'s packed SGEMM. Either way the output
//! columns are split across rayon threads.

use rayon::prelude::*;

use super::dot::dot;

/// Below this many input rows the GEMV path is used.
pub(super) const GEMV_MAX_ROWS: usize = 4;
/// Output columns per rayon task.
const COLS_PER_TASK: usize = 64;

pub(super) fn matmul_t(x: &[f32], m: usize, w: &[f32], n: usize, k: usize, out: &mut [f32]) {
    if m == 0 || n == 0 {
        return;
    }
    if m <= GEMV_MAX_ROWS {
        gemv(x, m, w, n, k, out);
    } else {
        gemm(x, m, w, n, k, out);
    }
}

fn gemv(x: &[f32], m: usize, w: &[f32], n: usize, k: usize, out: &mut [f32]) {
    gemv_by(m, n, out, |r, col| dot(&x[r * k..(r + 1) * k], &w[col * k..(col + 1) * k]));
}

/// `out[r, col] = cell(r, col)` for `m` rows and `n` columns (row-major), the columns split
/// across rayon tasks: the GEMV shape, whatever computes a cell.
pub(super) fn gemv_by(m: usize, n: usize, out: &mut [f32], cell: impl Fn(usize, usize) -> f32 + Sync) {
    if m == 1 {
        // One row: the output is its columns, written in place (no scratch to fault in).
        out[..n].par_chunks_mut(COLS_PER_TASK).enumerate().for_each(|(t, chunk)| {
            for (j, o) in chunk.iter_mut().enumerate() {
                *o = cell(0, t * COLS_PER_TASK + j);
            }
        });
        return;
    }
    let mut cols = super::zeroed(n * m);
    cols.par_chunks_mut(COLS_PER_TASK * m).enumerate().for_each(|(t, chunk)| {
        for (j, o) in chunk.chunks_exact_mut(m).enumerate() {
            for (r, o) in o.iter_mut().enumerate() {
                *o = cell(r, t * COLS_PER_TASK + j);
            }
        }
    });
    for col in 0..n {
        for r in 0..m {
            out[r * n + col] = cols[col * m + r];
        }
    }
}

/// A raw pointer that may cross threads; each task writes a disjoint set of columns.
#[derive(Clone, Copy)]
pub(super) struct SendPtr(pub(super) *mut f32);
// SAFETY: used only to write disjoint column ranges of one output from several threads.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The `i`-th value's address (a method, so closures capture the whole `Send` pointer).
    pub(super) fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// Column blocks of the SGEMM path: several per thread for balance, but wide enough to
/// amortise packing. Returns (columns per block, blocks).
pub(super) fn gemm_blocks(n: usize) -> (usize, usize) {
    let threads = rayon::current_num_threads().max(1);
    let block = n.div_ceil(threads * 2).max(64).min(n);
    (block, n.div_ceil(block))
}

fn gemm(x: &[f32], m: usize, w: &[f32], n: usize, k: usize, out: &mut [f32]) {
    let (block, nblocks) = gemm_blocks(n);
    let ptr = SendPtr(out.as_mut_ptr());
    (0..nblocks).into_par_iter().for_each(|b| {
        let c0 = b * block;
        let nb = block.min(n - c0);
        // SAFETY: columns c0..c0 + nb of the output are written by this task only.
        unsafe { gemm_block(x, m, &w[c0 * k..(c0 + nb) * k], nb, k, ptr, c0, n) };
    });
}

/// `out[:, c0..c0 + nb] = x · wᵀ` for the `nb` weight rows `w` (row-major `(nb, k)`).
///
/// # Safety
/// `out` is an `(m, n)` row-major matrix with `c0 + nb <= n`, and no other thread writes its
/// columns `c0..c0 + nb` meanwhile.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_block(
    x: &[f32],
    m: usize,
    w: &[f32],
    nb: usize,
    k: usize,
    out: SendPtr,
    c0: usize,
    n: usize,
) {
    // SAFETY: `x` is (m, k) row-major; `w` is (nb, k) row-major, read as a (k, nb) matrix with
    // strides (1, k); the caller owns columns c0..c0 + nb of `out`.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            nb,
            1.0,
            x.as_ptr(),
            k as isize,
            1,
            w.as_ptr(),
            1,
            k as isize,
            0.0,
            out.0.add(c0),
            n as isize,
            1,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut o = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                o[i * n + j] = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum::<f64>() as f32;
            }
        }
        o
    }

    #[test]
    fn both_paths_match_naive() {
        for (m, n, k) in [(1, 3, 5), (3, 130, 17), (9, 200, 33), (40, 7, 64)] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0).collect();
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 5 % 11) as f32 - 5.0) / 7.0).collect();
            let mut out = vec![0.0; m * n];
            matmul_t(&x, m, &w, n, k, &mut out);
            for (a, b) in out.iter().zip(naive(&x, m, &w, n, k)) {
                assert!((a - b).abs() < 1e-4, "{m}x{n}x{k}: {a} vs {b}");
            }
        }
    }
}
