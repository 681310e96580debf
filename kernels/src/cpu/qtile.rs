//! Products on weights in groups of 16 rows ([`Tiled`], and Q4_K's [`TiledK`](super::tiled_k::TiledK),
//! both seen by the kernels as [`TiledRef`] views): `out = x · wᵀ`, a group per vector.
//!
//! Exact mode: each weight of a
//! block as 16 lanes of f32 times the activation broadcast ([`qtile512`](super::qtile512)'s
//! `exact_rows`; 8 lanes, half a group, in [`qtile256`](super::qtile256)'s), or the portable
//! loop; within f32 summation error of the dequantized product.
//!
//! Fast mode: activations quantized per 32-value block ([`Prepared`]). Every kernel computes each
//! cell the same way, so they agree bit for bit and a row's result does not depend on its
//! batch or on which kernel took it:
//!
//! ```text
//! acc = 0; off = 0
//! for each block b:  acc = fma(f32(Σ_j q_j·q_x,j), d_b·δ_b, acc)   (the integer sum is exact)
//!                    off = fma(c_b, δ_b·Σ_j q_x,j, off)            (c_b: Q4_1's m, Q4_0's d)
//! cell = acc + off (Q4_1), acc + off·(−8) (Q4_0), acc (Q8_0)
//! ```
//!
//! Kernels: AMX (`tdpbsud` on 16 activation rows × 16 weight rows × one block, then the same
//! vector arithmetic), AVX-512 VNNI (`vpdpbusd` on a quad vector against 4 broadcast
//! activation values), AVX2 (`vpmaddubsw` on half a quad vector, [`qtile256`](super::qtile256)),
//! and a portable one that defines the arithmetic (and the tests' reference).

use rayon::prelude::*;

use super::CpuMath;
use super::matmul::SendPtr;
use super::qdot::{Prep, Prepared};
use super::qmatmul::gemm_dequantized;
use super::tiled::{LANES, Tiled, TiledRef};
use crate::quant::{BLOCK, BlockFormat};

/// Groups `g0..g1` of `w` dotted with every prepared row `ps[a]`: the cell of activation row
/// `a` and matrix row `16·g + c` into `out[a·stride + 16·(g − g0) + c]`, for matrix rows that
/// exist (the last group's padding lanes are not written).
///
/// # Safety (of a call)
/// The kernel's CPU features ([`kernel`] returns only kernels this CPU runs); every row of `ps`
/// has `w.blocks` blocks of fast-mode preparation; `out` valid for writes of those cells, which
/// nothing else reads or writes during the call. (The view's groups `..g1` are checked whole,
/// [`TiledRef::assert_groups`].)
pub(super) type TiledKernel = unsafe fn(&[Prep<'_>], &TiledRef<'_>, usize, usize, *mut f32, usize);

/// Output cells per rayon task (about; at least one group).
const CELLS_PER_TASK: usize = 4096;

/// Whether this CPU has a SIMD kernel for tiled weights in `math` (else the weights keep the
/// row layout and its kernels: CPUs without AVX2).
pub(super) fn available(math: CpuMath) -> bool {
    kernels(math)[0].0 != "portable"
}

/// The widest kernel of `math` this CPU runs.
pub(super) fn kernel(math: CpuMath) -> TiledKernel {
    static CHOSEN: std::sync::OnceLock<[TiledKernel; 2]> = std::sync::OnceLock::new();
    let [exact, fast] = *CHOSEN.get_or_init(|| [kernels(CpuMath::Exact)[0].1, kernels(CpuMath::Fast)[0].1]);
    match math {
        CpuMath::Exact => exact,
        CpuMath::Fast => fast,
    }
}

/// Whether exact mode's kernel here is AVX2's (read once).
fn exact_is_avx2() -> bool {
    static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX2.get_or_init(|| kernels(CpuMath::Exact)[0].0 == "avx2")
}

/// Every kernel of `math` this CPU runs, widest first, with its name.
pub(super) fn kernels(math: CpuMath) -> Vec<(&'static str, TiledKernel)> {
    let mut all: Vec<(&'static str, TiledKernel)> = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        use std::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512bw") && has!("avx512vnni") && has!("fma") {
            match math {
                CpuMath::Exact => all.push(("avx512", super::qtile512::exact_rows)),
                CpuMath::Fast => {
                    if super::amx::usable() {
                        all.push(("amx", super::amx::rows));
                    }
                    all.push(("avx512-vnni", super::qtile512::rows));
                }
            }
        }
        if has!("avx2") && has!("fma") {
            all.push((
                "avx2",
                if math == CpuMath::Exact { super::qtile256::exact_rows } else { super::qtile256::rows },
            ));
        }
    }
    all.push(("portable", if math == CpuMath::Exact { exact_portable } else { portable }));
    all
}

/// Most rows exact mode's AVX2 kernel takes; more go to the f32 SGEMM on rows dequantized a
/// slice at a time. SmolLM2 exact prefill on an AVX2 EPYC, 2 threads, tok/s SGEMM → kernel:
/// 32 rows 385 → 490, 64 511 → 547, 128 593 → 535, 256 623 → 508, 512 ~570 → ~455.
pub(super) const AVX2_EXACT_MAX_ROWS: usize = 64;

/// `out (m, w.rows) = x (m, k) · wᵀ` in `math`, by the mode's kernel: in fast mode for any
/// number of rows, so a row's result does not depend on its batch; in exact mode too with
/// AVX-512 (its kernel outran the f32 SGEMM on dequantized slices at every batch measured, 5
/// to 512 rows: 1.1–15× on two threads), with AVX2 up to [`AVX2_EXACT_MAX_ROWS`] rows (past
/// them the SGEMM is faster there; exact mode's results are the model's up to summation
/// order either way).
pub(super) fn qmatmul_tiled(math: CpuMath, x: &[f32], m: usize, w: &impl TiledWeights, out: &mut [f32]) {
    let (n, k) = (w.rows(), w.blocks() * BLOCK);
    if m == 0 || n == 0 {
        return;
    }
    assert!(x.len() >= m * k && out.len() >= m * n, "qmatmul shapes");
    if math == CpuMath::Exact && m > AVX2_EXACT_MAX_ROWS && exact_is_avx2() {
        return gemm_dequantized(x, m, n, k, out, |first, f| {
            for (i, row) in f.chunks_exact_mut(k).enumerate() {
                w.dequantize_row(first + i, row);
            }
        });
    }
    let prep = Prepared::new(math, x, m, k);
    let rows: Vec<_> = (0..m).map(|r| prep.row(x, r)).collect();
    let dot = kernel(math);
    // As many tasks as runs of at most 4 groups (fewer when the batch is big), rounded up to a
    // multiple of the threads, the groups dealt out evenly.
    let groups = n.div_ceil(LANES);
    let most = (CELLS_PER_TASK / (m * LANES)).clamp(1, 4);
    let tasks = groups.div_ceil(most).next_multiple_of(rayon::current_num_threads().max(1)).min(groups);
    let edge = |t: usize| t * groups / tasks;
    let ptr = SendPtr(out.as_mut_ptr());
    (0..tasks).into_par_iter().for_each(|t| {
        w.views(edge(t), edge(t + 1), &mut |v, g0, g1, first| {
            // SAFETY: `out` is (m, n); columns 16·first.. of every row, for the view's groups
            // g0..g1 (this task's), are this task's only; `kernel` picked a kernel this CPU
            // runs; the rows are `math`'s preparations of k.
            unsafe { dot(&rows, v, g0, g1, ptr.at(first * LANES), n) };
        });
    });
}

/// Weights in groups of 16 rows, as the tiled kernels read them ([`TiledRef`]).
pub(super) trait TiledWeights: Sync {
    /// Rows.
    fn rows(&self) -> usize;
    /// Blocks of 32 per row.
    fn blocks(&self) -> usize;
    /// Row `r`'s weights, dequantized.
    fn dequantize_row(&self, r: usize, out: &mut [f32]);
    /// Groups `g0..g1` as views: `f(view, from, to, first)` for each, the view's groups
    /// `from..to` being the matrix's `first..first + to − from`. `f` must not call back into
    /// `views` on the same thread (a view may borrow a per-thread scratch): the kernels
    /// compute and return.
    fn views(&self, g0: usize, g1: usize, f: &mut dyn FnMut(&TiledRef<'_>, usize, usize, usize));
}

impl TiledWeights for Tiled {
    fn rows(&self) -> usize {
        self.rows
    }

    fn blocks(&self) -> usize {
        self.blocks
    }

    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        Tiled::dequantize_row(self, r, out);
    }

    fn views(&self, g0: usize, g1: usize, f: &mut dyn FnMut(&TiledRef<'_>, usize, usize, usize)) {
        f(&self.view(), g0, g1, g0);
    }
}

/// The offsets' coefficient per block and the factor applied to their sum (`None`: Q8_0).
pub(super) fn offset_parts<'a>(w: &TiledRef<'a>) -> Option<(&'a [f32], f32)> {
    match w.fmt {
        BlockFormat::Q4_1 => Some((w.mins, 1.0)),
        BlockFormat::Q4_0 => Some((w.scales, -8.0)),
        BlockFormat::Q8_0 => None,
    }
}

/// The arithmetic every kernel follows, one cell at a time.
///
/// # Safety
/// None: `unsafe` only to be a [`TiledKernel`] (its contract on `out` and `ps` still holds).
unsafe fn portable(ps: &[Prep<'_>], w: &TiledRef<'_>, g0: usize, g1: usize, out: *mut f32, stride: usize) {
    let (nb, gb) = (w.blocks, Tiled::group_block_bytes(w.fmt));
    let offsets = offset_parts(w);
    for g in g0..g1 {
        for (a, p) in ps.iter().enumerate() {
            for c in 0..(w.rows - g * LANES).min(LANES) {
                let (mut acc, mut off) = (0.0f32, 0.0f32);
                for b in 0..nb {
                    let chunks = &w.quants[(g * nb + b) * gb..(g * nb + b + 1) * gb];
                    let qx = &p.q[b * BLOCK..(b + 1) * BLOCK];
                    let s: i32 = qx.iter().enumerate().map(|(j, &v)| i32::from(v) * w.int(chunks, c, j)).sum();
                    let at = (g * nb + b) * LANES + c;
                    acc = (s as f32).mul_add(w.scales[at] * p.deltas[b], acc);
                    if let Some((cs, _)) = offsets {
                        off = cs[at].mul_add(p.sums[b], off);
                    }
                }
                let cell = offsets.map_or(acc, |(_, f)| acc + off * f);
                // SAFETY: the caller's cell.
                unsafe { *out.add(a * stride + (g - g0) * LANES + c) = cell };
            }
        }
    }
}

/// Exact mode, one cell at a time: per block `s = Σ_j x_j·q_j`, `acc = fma(s, d, acc)`, the
/// offsets as in fast mode (the SIMD kernel sums `s` in another order).
///
/// # Safety
/// None: `unsafe` only to be a [`TiledKernel`] (its contract on `out` and `ps` still holds).
unsafe fn exact_portable(ps: &[Prep<'_>], w: &TiledRef<'_>, g0: usize, g1: usize, out: *mut f32, stride: usize) {
    let (nb, gb) = (w.blocks, Tiled::group_block_bytes(w.fmt));
    let offsets = offset_parts(w);
    for g in g0..g1 {
        for (a, p) in ps.iter().enumerate() {
            for c in 0..(w.rows - g * LANES).min(LANES) {
                let (mut acc, mut off) = (0.0f32, 0.0f32);
                for b in 0..nb {
                    let chunks = &w.quants[(g * nb + b) * gb..(g * nb + b + 1) * gb];
                    let xs = &p.x[b * BLOCK..(b + 1) * BLOCK];
                    let s: f32 = xs.iter().enumerate().map(|(j, &v)| v * w.int(chunks, c, j) as f32).sum();
                    let at = (g * nb + b) * LANES + c;
                    acc = s.mul_add(w.scales[at], acc);
                    if let Some((cs, _)) = offsets {
                        off = cs[at].mul_add(p.sums[b], off);
                    }
                }
                let cell = offsets.map_or(acc, |(_, f)| acc + off * f);
                // SAFETY: the caller's cell.
                unsafe { *out.add(a * stride + (g - g0) * LANES + c) = cell };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::packed::Packed;
    use super::super::packed::tests::{blocks, floats};
    use super::*;

    /// Every kernel this CPU runs gives the portable kernel's bits for every cell it owns —
    /// activation rows 1–40 (AMX tiles of 16 and the rows after them), groups from any first
    /// one, a last group with padding lanes, a strided output — and writes no other cell.
    #[test]
    fn every_tiled_kernel_gives_the_portable_bits() {
        for fmt in [BlockFormat::Q4_0, BlockFormat::Q4_1, BlockFormat::Q8_0] {
            for k in [32, 96, 576] {
                let n = 37;
                let w = Tiled::new(fmt, n, k, &blocks(fmt, n, k, 7));
                for m in [1, 3, 4, 5, 16, 17, 35, 40] {
                    let x = floats(m * k, 29 + m as u64);
                    let prep = Prepared::new(CpuMath::Fast, &x, m, k);
                    let rows: Vec<_> = (0..m).map(|r| prep.row(&x, r)).collect();
                    for (g0, g1) in [(0, 3), (1, 3), (2, 3), (0, 1)] {
                        let width = (n.min(g1 * LANES)) - g0 * LANES;
                        let stride = width + 5;
                        let run = |kern: TiledKernel| {
                            let mut got = vec![f32::NAN; m * stride];
                            // SAFETY: `got` holds m rows of `stride` ≥ the groups' cells.
                            unsafe { kern(&rows, &w.view(), g0, g1, got.as_mut_ptr(), stride) };
                            got
                        };
                        let want = run(portable);
                        for (name, kern) in kernels(CpuMath::Fast) {
                            let got = run(kern);
                            for (r, (got, want)) in got.chunks(stride).zip(want.chunks(stride)).enumerate() {
                                let what = format!("{fmt:?} {name} k {k} m {m} row {r} groups {g0}..{g1}");
                                let same =
                                    got[..width].iter().zip(&want[..width]).all(|(a, b)| a.to_bits() == b.to_bits());
                                assert!(same, "{what}: {:?} vs {:?}", &got[..width], &want[..width]);
                                assert!(got[width..].iter().all(|v| v.is_nan()), "{what}: wrote past its cells");
                            }
                        }
                    }
                }
            }
        }
    }

    /// The tiled product against the f64 product on the dequantized weights, within the
    /// activations' rounding (the bound of fast mode on rows), and batch-independent: 9 rows
    /// alone equal the same rows in a batch of 50.
    #[test]
    fn tiled_products_are_within_fast_modes_bound_and_batch_independent() {
        for fmt in [BlockFormat::Q4_0, BlockFormat::Q4_1, BlockFormat::Q8_0] {
            let (n, k) = (70, 352);
            let data = blocks(fmt, n, k, 5);
            let w = Tiled::new(fmt, n, k, &data);
            let packed = Packed::new(fmt, n, k, &data);
            let mut wf = vec![0.0; n * k];
            packed.dequantize_rows(0, &mut wf);
            let x = floats(50 * k, 17);
            let mut big = vec![0.0; 50 * n];
            qmatmul_tiled(CpuMath::Fast, &x, 50, &w, &mut big);
            let mut few = vec![0.0; 9 * n];
            qmatmul_tiled(CpuMath::Fast, &x, 9, &w, &mut few);
            assert_eq!(few, big[..9 * n], "{fmt:?}: 9 rows alone and in a batch of 50");
            let prep = Prepared::new(CpuMath::Fast, &x, 9, k);
            for r in 0..9 {
                let p = prep.row(&x, r);
                for col in 0..n {
                    let (xr, wr) = (&x[r * k..(r + 1) * k], &wf[col * k..(col + 1) * k]);
                    let want: f64 = xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let round: f64 = (0..k / BLOCK)
                        .map(|b| {
                            p.deltas[b] as f64 / 2.0
                                * wr[b * 32..(b + 1) * 32].iter().map(|v| v.abs() as f64).sum::<f64>()
                        })
                        .sum();
                    let mag = conditioning(&packed, xr, col);
                    let got = few[r * n + col] as f64;
                    assert!(
                        (got - want).abs() <= round * 1.001 + 1e-5 * mag,
                        "{fmt:?} row {r} col {col}: {got} vs {want}"
                    );
                }
            }
        }
    }

    /// The factored sum's conditioning for activations `xr` and row `col`,
    /// `Σ |x|·(|q·d| + |c|)`, as for the row kernels.
    fn conditioning(packed: &Packed, xr: &[f32], col: usize) -> f64 {
        let row = packed.row(col);
        (0..xr.len() / BLOCK)
            .map(|b| {
                let (d, c, q) = (row.scales[b] as f64, row.offset(b) as f64, row.ints(b));
                (0..BLOCK).map(|j| (xr[b * BLOCK + j] as f64).abs() * ((q[j] as f64 * d).abs() + c.abs())).sum::<f64>()
            })
            .sum()
    }

    /// Exact mode on tiled weights, every kernel and the whole product (1–9 rows), against the
    /// f64 product on the dequantized weights: within 1e-5 of the conditioning; and a row's
    /// result is the same bits alone as in a batch.
    #[test]
    fn exact_tiled_products_match_the_dequantized_reference() {
        for fmt in [BlockFormat::Q4_0, BlockFormat::Q4_1, BlockFormat::Q8_0] {
            let (n, k) = (37, 352);
            let data = blocks(fmt, n, k, 6);
            let (w, packed) = (Tiled::new(fmt, n, k, &data), Packed::new(fmt, n, k, &data));
            let mut wf = vec![0.0; n * k];
            packed.dequantize_rows(0, &mut wf);
            for m in [1, 3, 4, 9, AVX2_EXACT_MAX_ROWS + 3] {
                let x = floats(m * k, 40 + m as u64);
                let prep = Prepared::new(CpuMath::Exact, &x, m, k);
                let rows: Vec<_> = (0..m).map(|r| prep.row(&x, r)).collect();
                let mut runs = vec![("qmatmul_tiled".to_string(), vec![0.0; m * n])];
                qmatmul_tiled(CpuMath::Exact, &x, m, &w, &mut runs[0].1);
                for (name, kern) in kernels(CpuMath::Exact) {
                    let mut got = vec![0.0; m * n];
                    // SAFETY: `got` holds (m, n); the kernel runs on this CPU.
                    unsafe { kern(&rows, &w.view(), 0, w.groups(), got.as_mut_ptr(), n) };
                    runs.push((name.to_string(), got));
                }
                let mut alone = vec![0.0; n];
                qmatmul_tiled(CpuMath::Exact, &x[(m - 1) * k..], 1, &w, &mut alone);
                if m <= AVX2_EXACT_MAX_ROWS {
                    assert_eq!(alone, runs[0].1[(m - 1) * n..], "{fmt:?}: row {} alone and in a batch of {m}", m - 1);
                }
                for (name, got) in &runs {
                    for r in 0..m {
                        for col in 0..n {
                            let (xr, wr) = (&x[r * k..(r + 1) * k], &wf[col * k..(col + 1) * k]);
                            let want: f64 = xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum();
                            let g = got[r * n + col] as f64;
                            let bound = 1e-5 * conditioning(&packed, xr, col);
                            assert!((g - want).abs() <= bound, "{fmt:?} {name} m {m} row {r} col {col}: {g} vs {want}");
                        }
                    }
                }
            }
        }
    }
}
