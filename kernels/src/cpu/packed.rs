//! Block-quantized weights repacked once at load for the CPU kernels: a row's quantized
//! values contiguous, its block scales as f32 beside them.
//!
//! ggml interleaves each block's f16 scale(s) with its 16 or 32 bytes of values. Reading them
//! back costs a scalar f16 conversion per block inside the innermost loop; here each block's
//! `d` (and Q4_1's `m`) is widened once (exactly: every f16 is an f32), so a block's scale is
//! one broadcast load. A block's weights stay `q·d + c` with `c = m` (Q4_1), `−8·d` (Q4_0) or
//! 0 (Q8_0), the values of [`BlockFormat::dequantize_block`] bit for bit: `q·d` and `8·d` are
//! exact in f32 and so is their difference. Memory: Q4_0 20 bytes per 32 weights (ggml 18),
//! Q4_1 24 (20), Q8_0 36 (34).

use crate::quant::{BLOCK, BlockFormat, WeightFormat};
use crate::quant_k::SUPER;

/// A `(rows, cols)` matrix of one [`BlockFormat`], repacked.
#[derive(Debug, Clone)]
pub(crate) struct Packed {
    pub(crate) fmt: BlockFormat,
    /// Blocks per row.
    pub(crate) blocks: usize,
    /// Quantized values, [`Packed::quant_bytes`] per block, row after row: Q4 blocks keep
    /// ggml's nibble order (weight `j < 16` the low nibble of byte `j`, `16 + j` the high
    /// one), Q8_0 blocks their 32 signed bytes.
    pub(crate) quants: Vec<u8>,
    /// `d` of every block, row after row.
    pub(crate) scales: Vec<f32>,
    /// `m` of every Q4_1 block (empty for the other formats).
    pub(crate) mins: Vec<f32>,
}

impl Packed {
    /// Bytes of quantized values per block.
    pub(crate) fn quant_bytes(fmt: BlockFormat) -> usize {
        match fmt {
            BlockFormat::Q4_0 | BlockFormat::Q4_1 => BLOCK / 2,
            BlockFormat::Q8_0 => BLOCK,
        }
    }

    /// Repacks ggml blocks (`rows * fmt.row_bytes(cols)` bytes; the backend goes through
    /// [`blocks_of`], which takes the K formats too).
    #[cfg(test)]
    pub(crate) fn new(fmt: BlockFormat, rows: usize, cols: usize, data: &[u8]) -> Self {
        let (blocks, bb) = (cols / BLOCK, fmt.block_bytes());
        Self::from_wide(fmt, rows, blocks, |r, b| Wide::ggml(fmt, &data[(r * blocks + b) * bb..][..bb]))
    }

    /// Packs `rows` rows of `blocks` blocks each, `block(r, b)` giving one.
    pub(crate) fn from_wide(
        fmt: BlockFormat,
        rows: usize,
        blocks: usize,
        block: impl Fn(usize, usize) -> Wide,
    ) -> Self {
        let qb = Self::quant_bytes(fmt);
        let n = rows * blocks;
        let mut p = Self {
            fmt,
            blocks,
            quants: Vec::with_capacity(n * qb),
            scales: Vec::with_capacity(n),
            mins: Vec::with_capacity(if fmt == BlockFormat::Q4_1 { n } else { 0 }),
        };
        for r in 0..rows {
            for b in 0..blocks {
                let w = block(r, b);
                p.scales.push(w.d);
                if fmt == BlockFormat::Q4_1 {
                    p.mins.push(w.m);
                }
                p.quants.extend_from_slice(&w.q[..qb]);
            }
        }
        p
    }

    /// Puts `other`'s rows (same format and width) after this matrix's.
    pub(crate) fn append(&mut self, other: Packed) {
        assert!(self.fmt == other.fmt && self.blocks == other.blocks, "stacking unlike matrices");
        self.quants.extend_from_slice(&other.quants);
        self.scales.extend_from_slice(&other.scales);
        self.mins.extend_from_slice(&other.mins);
    }

    /// Bytes it takes in memory.
    pub(crate) fn resident_bytes(&self) -> usize {
        self.quants.len() + 4 * (self.scales.len() + self.mins.len())
    }

    /// One row's quantized values, scales and mins (mins empty unless Q4_1).
    #[inline]
    pub(crate) fn row(&self, r: usize) -> Row<'_> {
        let (nb, qb) = (self.blocks, Self::quant_bytes(self.fmt));
        Row {
            fmt: self.fmt,
            quants: &self.quants[r * nb * qb..(r + 1) * nb * qb],
            scales: &self.scales[r * nb..(r + 1) * nb],
            mins: if self.mins.is_empty() { &[] } else { &self.mins[r * nb..(r + 1) * nb] },
        }
    }

    /// Dequantizes rows `first..first + out.len() / cols` into `out`.
    pub(crate) fn dequantize_rows(&self, first: usize, out: &mut [f32]) {
        let cols = self.blocks * BLOCK;
        for (i, o) in out.chunks_exact_mut(cols).enumerate() {
            self.row(first + i).dequantize(o);
        }
    }
}

/// One block of 32 weights as both CPU layouts hold it: `d` and Q4_1's `m` as f32 (their
/// weights `q·d + m`), the values as a ggml block of the format has them (Q4: 16 bytes of
/// nibbles, weight `j < 16` the low nibble of byte `j`; Q8_0: 32 signed bytes).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Wide {
    pub(crate) d: f32,
    pub(crate) m: f32,
    pub(crate) q: [u8; BLOCK],
}

impl Wide {
    /// A ggml block of `fmt`.
    #[inline]
    pub(crate) fn ggml(fmt: BlockFormat, blk: &[u8]) -> Self {
        let half = |at: usize| half::f16::from_le_bytes([blk[at], blk[at + 1]]).to_f32();
        let qb = Packed::quant_bytes(fmt);
        let mut q = [0u8; BLOCK];
        q[..qb].copy_from_slice(&blk[blk.len() - qb..]);
        Self { d: half(0), m: if fmt == BlockFormat::Q4_1 { half(2) } else { 0.0 }, q }
    }

    /// Sub-block `j` (0..8) of a Q4_K block as a Q4_1 block: `d = d·s`, `m = −dmin·m`, the
    /// same weights bit for bit (`q·a − b` and `q·a + (−b)` round alike).
    #[inline]
    pub(crate) fn q4k(blk: &[u8], j: usize) -> Self {
        let (d, min, v) = crate::quant_k::q4k_sub_block(blk, j);
        let mut q = [0u8; BLOCK];
        for i in 0..16 {
            q[i] = v[i] | (v[16 + i] << 4);
        }
        Self { d, m: -min, q }
    }
}

/// The 32-weight block format the CPU computes `format` in, with `block(r, b)` giving block
/// `b` (of `cols / 32`) of row `r` of `data`: the block formats as they are, Q4_K as Q4_1
/// (each 32-weight sub-block's scale and min widened to f32). None for the others (Q6_K's
/// sub-blocks of 16 have their own matrix type, [`super::q6k`]; so have F16 and BF16,
/// [`super::half16`]).
pub(crate) fn blocks_of(
    format: WeightFormat,
    cols: usize,
    data: &[u8],
) -> Option<(BlockFormat, impl Fn(usize, usize) -> Wide)> {
    let (fmt, bb, nb) = match (format, format.block()) {
        (WeightFormat::Q4K, _) => (BlockFormat::Q4_1, format.block_bytes(), cols / SUPER),
        (_, Some(f)) => (f, f.block_bytes(), cols / BLOCK),
        (_, None) => return None,
    };
    let k = format == WeightFormat::Q4K;
    let per = if k { SUPER / BLOCK } else { 1 };
    Some((fmt, move |r: usize, b: usize| {
        let blk = &data[(r * nb + b / per) * bb..][..bb];
        if k { Wide::q4k(blk, b % per) } else { Wide::ggml(fmt, blk) }
    }))
}

/// One row of a [`Packed`] matrix.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Row<'a> {
    pub(crate) fmt: BlockFormat,
    pub(crate) quants: &'a [u8],
    pub(crate) scales: &'a [f32],
    pub(crate) mins: &'a [f32],
}

impl Row<'_> {
    /// The integer values of block `b` (0..16 for Q4, −128..128 for Q8_0).
    #[inline]
    pub(crate) fn ints(&self, b: usize) -> [i32; BLOCK] {
        let mut q = [0i32; BLOCK];
        match self.fmt {
            BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
                let s = &self.quants[b * 16..(b + 1) * 16];
                for j in 0..16 {
                    q[j] = i32::from(s[j] & 0xF);
                    q[j + 16] = i32::from(s[j] >> 4);
                }
            }
            BlockFormat::Q8_0 => {
                for (q, &v) in q.iter_mut().zip(&self.quants[b * 32..(b + 1) * 32]) {
                    *q = i32::from(v as i8);
                }
            }
        }
        q
    }

    /// How many mins the row must have: one per block for Q4_1, none otherwise.
    #[inline]
    pub(crate) fn min_blocks(&self) -> usize {
        if self.fmt == BlockFormat::Q4_1 { self.scales.len() } else { 0 }
    }

    /// Block `b`'s offset `c` (its weights are `q·d + c`).
    #[inline]
    pub(crate) fn offset(&self, b: usize) -> f32 {
        match self.fmt {
            BlockFormat::Q4_1 => self.mins[b],
            BlockFormat::Q4_0 => -8.0 * self.scales[b],
            BlockFormat::Q8_0 => 0.0,
        }
    }

    /// The row's weights.
    pub(crate) fn dequantize(&self, out: &mut [f32]) {
        for (b, o) in out.chunks_exact_mut(BLOCK).enumerate() {
            let (d, c) = (self.scales[b], self.offset(b));
            for (o, q) in o.iter_mut().zip(self.ints(b)) {
                *o = q as f32 * d + c;
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Random ggml blocks of `fmt` for `n` rows of `k` weights (scales kept modest).
    pub(crate) fn blocks(fmt: BlockFormat, n: usize, k: usize, seed: u64) -> Vec<u8> {
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

    /// `n` activations in [-1, 1), varied by `seed`.
    pub(crate) fn floats(n: usize, seed: u64) -> Vec<f32> {
        (0..n).map(|i| ((i as u64 * 2_654_435_761 + seed) % 2000) as f32 / 1000.0 - 1.0).collect()
    }

    #[test]
    fn repacked_rows_dequantize_to_ggml_values_bit_for_bit() {
        for fmt in [BlockFormat::Q4_0, BlockFormat::Q4_1, BlockFormat::Q8_0] {
            let (n, k) = (7, 96);
            let data = blocks(fmt, n, k, 11);
            let mut want = vec![0.0; n * k];
            fmt.dequantize(&data, &mut want);
            let p = Packed::new(fmt, n, k, &data);
            let mut got = vec![0.0; n * k];
            p.dequantize_rows(0, &mut got);
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{fmt:?}");
            let mut row3 = vec![0.0; k];
            p.dequantize_rows(3, &mut row3);
            assert_eq!(row3, want[3 * k..4 * k], "{fmt:?} row 3");
            let ggml = data.len();
            assert!(p.resident_bytes() <= ggml * 6 / 5, "{fmt:?}: {} vs {ggml}", p.resident_bytes());
        }
    }

    /// Q4_K keeps its values as Q4_1 blocks whose f32 scale and min are the sub-block's `d·s`
    /// and `−dmin·m`: ggml's weights bit for bit, in at most 4/3 of the file's bytes.
    #[test]
    fn q4_k_repacks_into_q4_1_blocks_bit_for_bit() {
        let (n, k) = (5, 512);
        let data = crate::quant_k::tests::k_blocks(WeightFormat::Q4K, n, k, 3);
        let mut want = vec![0.0; n * k];
        WeightFormat::Q4K.dequantize(&data, &mut want);
        let (fmt, block) = blocks_of(WeightFormat::Q4K, k, &data).expect("Q4_K packs in blocks");
        assert_eq!(fmt, BlockFormat::Q4_1);
        let p = Packed::from_wide(fmt, n, k / BLOCK, block);
        let mut got = vec![0.0; n * k];
        p.dequantize_rows(0, &mut got);
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(p.resident_bytes() * 3 <= data.len() * 4, "{} vs {}", p.resident_bytes(), data.len());
        assert!(blocks_of(WeightFormat::Q6K, k, &data).is_none());
    }
}
