//! Q4_K weights for the tiled kernels in (about) the file's bytes.
//!
//! The kernels multiply Q4_K as Q4_1 blocks of 32 whose f32 scale and min are each sub-block's
//! `d·s` and `−dmin·m` ([`Wide::q4k`]). Kept as f32 for every block, those took 8 bytes per 32
//! weights beside the 16 of nibbles: 1.33× the file. Here they stay as the file has them —
//! a 6-bit code each per sub-block (a byte here) and `d`, `dmin` per 256 weights (f32 here) —
//! and are widened for one group of 16 rows at a time into a per-thread scratch, which the
//! kernel then reads from L1 or L2 (128 bytes per block of 32 columns: 16 KiB at 4,096
//! columns): `152 / 144` = 1.06× the file. `d·s` has at most 17 significant bits (an f16
//! times a 6-bit integer), so the product in f32 is exact and the widened values are the bits
//! the f32 arrays held: every kernel's results are unchanged.
//!
//! Layout, groups of [`LANES`] rows as [`Tiled`]: the nibbles as [`Tiled`]'s Q4_1 quants;
//! per group block 16 scale codes then 16 min codes; per group super-block (8 blocks) 16 `d`
//! then 16 `dmin`.

use std::cell::RefCell;

use super::packed::Wide;
use super::qtile::TiledWeights;
use super::tiled::{LANES, Tiled, TiledRef, dequantize_lane};
use crate::quant::{BLOCK, BlockFormat};
use crate::quant_k::{SUPER, half, q4k_scale_min};

/// Blocks of 32 in a super-block.
const PER: usize = SUPER / BLOCK;

/// A Q4_K matrix in groups of [`LANES`] rows.
#[derive(Debug, Clone)]
pub(crate) struct TiledK {
    /// The nibbles (its `scales` and `mins` empty).
    pub(crate) base: Tiled,
    /// Per group block: 16 scale codes, then 16 min codes.
    pub(crate) codes: Vec<u8>,
    /// Per group super-block: 16 `d`, then 16 `dmin`.
    pub(crate) supers: Vec<f32>,
}

thread_local! {
    /// One group's widened scales, then its mins.
    static WIDE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl TiledK {
    /// Lays out `rows` rows of ggml Q4_K blocks (`cols / 256` a row) from `data`.
    pub(crate) fn new(rows: usize, cols: usize, data: &[u8]) -> Self {
        let (nsb, bb) = (cols / SUPER, crate::quant::WeightFormat::Q4K.block_bytes());
        let blk = |r: usize, sb: usize| &data[(r * nsb + sb) * bb..][..bb];
        Self::build(
            rows,
            cols / BLOCK,
            |r, b| Wide::q4k(blk(r, b / PER), b % PER).q,
            |r, b| q4k_scale_min(b % PER, &blk(r, b / PER)[4..16]),
            |r, sb| (half(blk(r, sb), 0), half(blk(r, sb), 2)),
        )
    }

    /// Lays out `rows` rows of `blocks` blocks: `q(r, b)` the nibbles of a block as ggml's
    /// Q4_1 has them, `code(r, b)` its scale and min codes, `sup(r, s)` super-block `s`'s `d`
    /// and `dmin`.
    fn build(
        rows: usize,
        blocks: usize,
        q: impl Fn(usize, usize) -> [u8; BLOCK],
        code: impl Fn(usize, usize) -> (u8, u8),
        sup: impl Fn(usize, usize) -> (f32, f32),
    ) -> Self {
        assert!(blocks.is_multiple_of(PER), "Q4_K rows are whole super-blocks");
        let base = Tiled::values_only(BlockFormat::Q4_1, rows, blocks, q);
        let (groups, nsb) = (rows.div_ceil(LANES), blocks / PER);
        let mut codes = vec![0u8; groups * blocks * 2 * LANES];
        let mut supers = vec![0.0f32; groups * nsb * 2 * LANES];
        for r in 0..rows {
            let (g, c) = (r / LANES, r % LANES);
            for b in 0..blocks {
                let (s, m) = code(r, b);
                let at = (g * blocks + b) * 2 * LANES + c;
                (codes[at], codes[at + LANES]) = (s, m);
            }
            for sb in 0..nsb {
                let at = (g * nsb + sb) * 2 * LANES + c;
                (supers[at], supers[at + LANES]) = sup(r, sb);
            }
        }
        Self { base, codes, supers }
    }

    /// Row `r`'s block `b`'s codes and super-block `s`'s `d`, `dmin`, as laid out.
    fn code(&self, r: usize, b: usize) -> (u8, u8) {
        let at = ((r / LANES) * self.base.blocks + b) * 2 * LANES + r % LANES;
        (self.codes[at], self.codes[at + LANES])
    }

    fn sup(&self, r: usize, s: usize) -> (f32, f32) {
        let at = ((r / LANES) * (self.base.blocks / PER) + s) * 2 * LANES + r % LANES;
        (self.supers[at], self.supers[at + LANES])
    }

    /// Group `g`'s scales (`d·s`) into `scales` and mins (`−dmin·m`) into `mins`, 16 a block:
    /// the values [`Wide::q4k`] gives, bit for bit.
    fn widen(&self, g: usize, scales: &mut [f32], mins: &mut [f32]) {
        let nb = self.base.blocks;
        let codes = &self.codes[g * nb * 2 * LANES..(g + 1) * nb * 2 * LANES];
        let supers = &self.supers[g * (nb / PER) * 2 * LANES..(g + 1) * (nb / PER) * 2 * LANES];
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2, checked.
            return unsafe { widen_avx2(codes, supers, scales, mins) };
        }
        widen_blocks(codes, supers, scales, mins);
    }

    /// Puts `other`'s rows (same width) after this matrix's: appended as they are when this
    /// matrix fills its last group, else laid out again.
    pub(crate) fn append(&mut self, other: TiledK) {
        assert!(self.base.blocks == other.base.blocks, "stacking unlike matrices");
        if self.base.rows.is_multiple_of(LANES) {
            self.base.quants.extend_from_slice(&other.base.quants);
            self.base.rows += other.base.rows;
            self.codes.extend_from_slice(&other.codes);
            self.supers.extend_from_slice(&other.supers);
            return;
        }
        let a = self.base.rows;
        let (me, you) = (&*self, &other);
        let pick = |r: usize| if r < a { (me, r) } else { (you, r - a) };
        *self = Self::build(
            a + other.base.rows,
            self.base.blocks,
            |r, b| {
                let (t, r) = pick(r);
                t.base.block_values(r, b)
            },
            |r, b| {
                let (t, r) = pick(r);
                t.code(r, b)
            },
            |r, s| {
                let (t, r) = pick(r);
                t.sup(r, s)
            },
        );
    }

    /// Bytes it takes in memory.
    pub(crate) fn resident_bytes(&self) -> usize {
        self.base.quants.len() + self.codes.len() + 4 * self.supers.len()
    }

    /// Puts its buffers on huge pages where the kernel allows.
    pub(crate) fn settle(&self) {
        super::huge::collapse(&self.base.quants);
        super::huge::collapse(&self.codes);
        super::huge::collapse(&self.supers);
    }
}

impl TiledWeights for TiledK {
    fn rows(&self) -> usize {
        self.base.rows
    }

    fn blocks(&self) -> usize {
        self.base.blocks
    }

    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let (g, c) = (r / LANES, r % LANES);
        let (nb, gb) = (self.base.blocks, Tiled::group_block_bytes(BlockFormat::Q4_1));
        for (b, o) in out.chunks_exact_mut(BLOCK).enumerate().take(nb) {
            let ((s, m), (d, dmin)) = (self.code(r, b), self.sup(r, b / PER));
            let (scale, min) = (d * f32::from(s), -(dmin * f32::from(m)));
            let chunks = &self.base.quants[(g * nb + b) * gb..(g * nb + b + 1) * gb];
            dequantize_lane(BlockFormat::Q4_1, chunks, c, scale, min, o);
        }
    }

    fn views(&self, g0: usize, g1: usize, f: &mut dyn FnMut(&TiledRef<'_>, usize, usize, usize)) {
        let nb = self.base.blocks;
        let gb = Tiled::group_block_bytes(BlockFormat::Q4_1);
        WIDE.with_borrow_mut(|wide| {
            wide.resize(2 * nb * LANES, 0.0);
            let (scales, mins) = wide.split_at_mut(nb * LANES);
            for g in g0..g1 {
                self.widen(g, scales, mins);
                let v = TiledRef {
                    fmt: BlockFormat::Q4_1,
                    rows: self.base.rows - g * LANES,
                    blocks: nb,
                    quants: &self.base.quants[g * nb * gb..(g + 1) * nb * gb],
                    scales,
                    mins,
                };
                f(&v, 0, 1, g);
            }
        });
    }
}

/// [`TiledK::widen`] for one group's `codes` and `supers` (written so the compiler
/// vectorizes it: 16 lanes of fixed size).
#[inline(always)]
fn widen_blocks(codes: &[u8], supers: &[f32], scales: &mut [f32], mins: &mut [f32]) {
    let blocks = codes.chunks_exact(2 * LANES).zip(scales.chunks_exact_mut(LANES)).zip(mins.chunks_exact_mut(LANES));
    for (b, ((code, s), m)) in blocks.enumerate() {
        let sup = &supers[(b / PER) * 2 * LANES..][..2 * LANES];
        let (d, dmin) = sup.split_at(LANES);
        let (sc, mc) = code.split_at(LANES);
        for c in 0..LANES {
            s[c] = d[c] * f32::from(sc[c]);
            m[c] = -(dmin[c] * f32::from(mc[c]));
        }
    }
}

/// [`widen_blocks`] compiled for AVX2.
///
/// # Safety
/// AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen_avx2(codes: &[u8], supers: &[f32], scales: &mut [f32], mins: &mut [f32]) {
    widen_blocks(codes, supers, scales, mins);
}

#[cfg(test)]
mod tests {
    use super::super::CpuMath;
    use super::super::packed::blocks_of;
    use super::super::packed::tests::floats;
    use super::super::qdot::Prepared;
    use super::super::qtile::{kernels, qmatmul_tiled};
    use super::*;
    use crate::quant::WeightFormat;
    use crate::quant_k::tests::k_blocks;

    /// The same rows with f32 scales and mins for every block, as the kernels took Q4_K before.
    fn wide(n: usize, k: usize, data: &[u8]) -> Tiled {
        let (fmt, block) = blocks_of(WeightFormat::Q4K, k, data).expect("Q4_K in blocks");
        Tiled::from_wide(fmt, n, k / BLOCK, block)
    }

    /// Rows dequantize to ggml's values bit for bit, before and after stacking (a first matrix
    /// that fills its last group, and one that does not: laid out again), in the file's bytes
    /// plus a scale per super-block and the last group's padding.
    #[test]
    fn q4_k_rows_are_ggmls_values_in_the_files_bytes() {
        let k = 512;
        for (n1, n2) in [(19, 6), (32, 20)] {
            let (d1, d2) = (k_blocks(WeightFormat::Q4K, n1, k, 5), k_blocks(WeightFormat::Q4K, n2, k, 6));
            let mut t = TiledK::new(n1, k, &d1);
            t.append(TiledK::new(n2, k, &d2));
            let n = n1 + n2;
            let mut want = vec![0.0; n * k];
            WeightFormat::Q4K.dequantize(&d1, &mut want[..n1 * k]);
            WeightFormat::Q4K.dequantize(&d2, &mut want[n1 * k..]);
            let mut got = vec![0.0; k];
            for r in 0..n {
                t.dequantize_row(r, &mut got);
                let same = got.iter().zip(&want[r * k..]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{n1}+{n2} row {r}");
            }
            let padded = n.div_ceil(LANES) * LANES;
            assert_eq!(t.resident_bytes(), padded * (k / SUPER) * 152, "{n1}+{n2}");
        }
        let data = k_blocks(WeightFormat::Q4K, 64, 1024, 7);
        let held = TiledK::new(64, 1024, &data).resident_bytes();
        assert!(held * 100 <= data.len() * 106, "{held} bytes for a {}-byte file", data.len());
    }

    /// Every kernel on the widened groups gives, cell for cell, the bits it gives on the f32
    /// scales and mins (so Q4_K's results are those of before), in both modes, from any
    /// first group, with a padded last group; and so does the whole product (exact mode past
    /// AVX2's rows through the dequantized SGEMM).
    #[test]
    fn q4_k_products_are_those_of_f32_scales_to_the_bit() {
        let (n, k) = (37, 512);
        let data = k_blocks(WeightFormat::Q4K, n, k, 9);
        let (compact, wide) = (TiledK::new(n, k, &data), wide(n, k, &data));
        for math in [CpuMath::Exact, CpuMath::Fast] {
            for m in [1, 3, 5, 17, 70] {
                let x = floats(m * k, 11 + m as u64);
                let prep = Prepared::new(math, &x, m, k);
                let rows: Vec<_> = (0..m).map(|r| prep.row(&x, r)).collect();
                for (name, kern) in kernels(math) {
                    for (g0, g1) in [(0, 3), (1, 3), (2, 3)] {
                        let width = n.min(g1 * LANES) - g0 * LANES;
                        let mut want = vec![f32::NAN; m * width];
                        // SAFETY: `want` holds m rows of the groups' cells; the kernel runs here.
                        unsafe { kern(&rows, &wide.view(), g0, g1, want.as_mut_ptr(), width) };
                        let mut got = vec![f32::NAN; m * width];
                        compact.views(g0, g1, &mut |v, a, b, first| {
                            // SAFETY: as above, the view's groups at their columns.
                            unsafe { kern(&rows, v, a, b, got.as_mut_ptr().add((first - g0) * LANES), width) };
                        });
                        let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{math} {name} m {m} groups {g0}..{g1}");
                    }
                }
                let (mut got, mut want) = (vec![0.0; m * n], vec![0.0; m * n]);
                qmatmul_tiled(math, &x, m, &compact, &mut got);
                qmatmul_tiled(math, &x, m, &wide, &mut want);
                assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{math} m {m} product");
            }
        }
    }
}
