//! Block-quantized weights laid out for outer-product kernels (AVX-512 VNNI and AVX2 in both
//! modes, AMX in fast mode): rows in groups of [`LANES`], each block of a group stored as the
//! `B` operand of an int8 dot-product instruction — for every 4 consecutive weights of the
//! block (a *quad*), the 16 rows' 4 values side by side (64 bytes). A kernel multiplies one
//! quad vector by 4 activation values broadcast to all 16 lanes (`vpdpbusd`), or a whole block
//! by 16 activation rows at once (AMX `tdpbsud`); either way lane `c` sums row `c`'s products.
//!
//! Q4 blocks keep their nibbles: byte `4c + j` of a group's chunk `p` (of 4) is ggml's byte
//! `4p + j` of row `c`'s block — weight `4p + j` in its low nibble, `16 + 4p + j` in its high
//! one — so a chunk's low nibbles are quad `p`, its high nibbles quad `p + 4`. Q8_0 blocks are 8
//! chunks, one a quad. Scales (and Q4_1's mins) are f32, 16 a block, one per row. Memory is
//! [`Packed`](super::packed::Packed)'s, plus the zero rows that fill the last group.

use super::packed::Wide;
use crate::quant::{BLOCK, BlockFormat};

/// Rows per group: the lanes of a 512-bit vector of i32 or f32.
pub(crate) const LANES: usize = 16;

/// A `(rows, cols)` matrix of one [`BlockFormat`] in groups of [`LANES`] rows.
#[derive(Debug, Clone)]
pub(crate) struct Tiled {
    pub(crate) fmt: BlockFormat,
    /// Rows (the last group's lanes past them are zeros).
    pub(crate) rows: usize,
    /// Blocks per row.
    pub(crate) blocks: usize,
    /// Every group's blocks, [`Tiled::group_block_bytes`] each, group after group.
    pub(crate) quants: Vec<u8>,
    /// `d` of every block, 16 (the group's rows) per block, group after group.
    pub(crate) scales: Vec<f32>,
    /// Q4_1's `m`, as `scales` (empty for the other formats).
    pub(crate) mins: Vec<f32>,
}

impl Tiled {
    /// Bytes of a group's block: 16 rows' quantized values.
    pub(crate) fn group_block_bytes(fmt: BlockFormat) -> usize {
        match fmt {
            BlockFormat::Q4_0 | BlockFormat::Q4_1 => LANES * BLOCK / 2,
            BlockFormat::Q8_0 => LANES * BLOCK,
        }
    }

    /// Groups of rows.
    #[cfg(test)]
    pub(crate) fn groups(&self) -> usize {
        self.rows.div_ceil(LANES)
    }

    /// The whole matrix as the kernels take it.
    pub(crate) fn view(&self) -> TiledRef<'_> {
        TiledRef {
            fmt: self.fmt,
            rows: self.rows,
            blocks: self.blocks,
            quants: &self.quants,
            scales: &self.scales,
            mins: &self.mins,
        }
    }

    /// Lays out ggml blocks (`rows * fmt.row_bytes(cols)` bytes; the backend goes through
    /// [`blocks_of`](super::packed::blocks_of), which takes the K formats too).
    #[cfg(test)]
    pub(crate) fn new(fmt: BlockFormat, rows: usize, cols: usize, data: &[u8]) -> Self {
        let (blocks, bb) = (cols / BLOCK, fmt.block_bytes());
        Self::from_wide(fmt, rows, blocks, |r, b| Wide::ggml(fmt, &data[(r * blocks + b) * bb..][..bb]))
    }

    /// Lays out `rows` rows of `blocks` blocks each, `block(r, b)` giving one.
    pub(crate) fn from_wide(
        fmt: BlockFormat,
        rows: usize,
        blocks: usize,
        block: impl Fn(usize, usize) -> Wide,
    ) -> Self {
        let n = rows.div_ceil(LANES) * blocks * LANES;
        let (mut scales, mut mins) = (vec![0.0; n], vec![0.0; if fmt == BlockFormat::Q4_1 { n } else { 0 }]);
        let t = Self::values_only(fmt, rows, blocks, |r, b| {
            let w = block(r, b);
            let at = ((r / LANES) * blocks + b) * LANES + r % LANES;
            scales[at] = w.d;
            if let Some(m) = mins.get_mut(at) {
                *m = w.m;
            }
            w.q
        });
        Self { scales, mins, ..t }
    }

    /// Lays out only the values of `rows` rows of `blocks` blocks (scales and mins empty),
    /// `q(r, b)` giving a block's values as ggml's block of `fmt` has them; called once per
    /// block, row by row.
    pub(crate) fn values_only(
        fmt: BlockFormat,
        rows: usize,
        blocks: usize,
        mut q: impl FnMut(usize, usize) -> [u8; BLOCK],
    ) -> Self {
        let gb = Self::group_block_bytes(fmt);
        let mut quants = vec![0; rows.div_ceil(LANES) * blocks * gb];
        let qb = gb / LANES;
        for r in 0..rows {
            let (g, c) = (r / LANES, r % LANES);
            for b in 0..blocks {
                let v = q(r, b);
                let out = &mut quants[(g * blocks + b) * gb..(g * blocks + b + 1) * gb];
                // Chunk p (64 bytes) holds bytes 4p..4p + 4 of every row's block.
                for (p, quad) in v[..qb].chunks_exact(4).enumerate() {
                    out[p * 64 + 4 * c..p * 64 + 4 * c + 4].copy_from_slice(quad);
                }
            }
        }
        Self { fmt, rows, blocks, quants, scales: Vec::new(), mins: Vec::new() }
    }

    /// Row `r`'s block `b` as [`Tiled::from_wide`] took it.
    fn wide_block(&self, r: usize, b: usize) -> Wide {
        let at = ((r / LANES) * self.blocks + b) * LANES + r % LANES;
        let m = if self.fmt == BlockFormat::Q4_1 { self.mins[at] } else { 0.0 };
        Wide { d: self.scales[at], m, q: self.block_values(r, b) }
    }

    /// Row `r`'s block `b`'s values as ggml's block of the format has them.
    pub(crate) fn block_values(&self, r: usize, b: usize) -> [u8; BLOCK] {
        let (g, c) = (r / LANES, r % LANES);
        let gb = Self::group_block_bytes(self.fmt);
        let mut q = [0; BLOCK];
        let chunks = &self.quants[(g * self.blocks + b) * gb..(g * self.blocks + b + 1) * gb];
        for p in 0..gb / 64 {
            q[4 * p..4 * p + 4].copy_from_slice(&chunks[p * 64 + 4 * c..p * 64 + 4 * c + 4]);
        }
        q
    }

    /// Puts `other`'s rows (same format and width) after this matrix's: the groups as they
    /// are when this matrix fills its last one, else laid out again.
    pub(crate) fn append(&mut self, other: Tiled) {
        assert!(self.fmt == other.fmt && self.blocks == other.blocks, "stacking unlike matrices");
        if self.rows.is_multiple_of(LANES) {
            self.quants.extend_from_slice(&other.quants);
            self.scales.extend_from_slice(&other.scales);
            self.mins.extend_from_slice(&other.mins);
            self.rows += other.rows;
            return;
        }
        let a = self.rows;
        let (me, nb) = (&*self, self.blocks);
        let all = Self::from_wide(self.fmt, a + other.rows, nb, |r, k| {
            if r < a { me.wide_block(r, k) } else { other.wide_block(r - a, k) }
        });
        *self = all;
    }

    /// Bytes it takes in memory.
    pub(crate) fn resident_bytes(&self) -> usize {
        self.quants.len() + 4 * (self.scales.len() + self.mins.len())
    }

    /// Row `r`'s weights (`q·d + c`, the values of [`BlockFormat::dequantize_block`]).
    pub(crate) fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let (g, c) = (r / LANES, r % LANES);
        let gb = Self::group_block_bytes(self.fmt);
        for (b, o) in out.chunks_exact_mut(BLOCK).enumerate().take(self.blocks) {
            let at = (g * self.blocks + b) * LANES + c;
            let d = self.scales[at];
            let off = match self.fmt {
                BlockFormat::Q4_1 => self.mins[at],
                BlockFormat::Q4_0 => -8.0 * d,
                BlockFormat::Q8_0 => 0.0,
            };
            let chunks = &self.quants[(g * self.blocks + b) * gb..(g * self.blocks + b + 1) * gb];
            dequantize_lane(self.fmt, chunks, c, d, off, o);
        }
    }
}

/// Lane `c`'s block in a group's block `chunks` as weights `q·d + off` into `o` (32): its 4
/// bytes of each chunk, no per-weight dispatch (the exact-mode SGEMM dequantizes through
/// here).
pub(crate) fn dequantize_lane(fmt: BlockFormat, chunks: &[u8], c: usize, d: f32, off: f32, o: &mut [f32]) {
    match fmt {
        BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
            for p in 0..4 {
                for (t, &q) in chunks[p * 64 + 4 * c..p * 64 + 4 * c + 4].iter().enumerate() {
                    o[4 * p + t] = f32::from(q & 0xF) * d + off;
                    o[16 + 4 * p + t] = f32::from(q >> 4) * d + off;
                }
            }
        }
        BlockFormat::Q8_0 => {
            for p in 0..8 {
                for (t, &q) in chunks[p * 64 + 4 * c..p * 64 + 4 * c + 4].iter().enumerate() {
                    o[4 * p + t] = f32::from(q as i8) * d + off;
                }
            }
        }
    }
}

/// Groups of rows of a [`Tiled`] matrix as the kernels read them: the whole matrix, or (for
/// [`TiledK`](super::tiled_k::TiledK)) one group with its scales and mins widened for the call.
/// Group `g` of the view is at `g · blocks · group_block_bytes` in `quants` and at
/// `g · blocks · 16` in `scales` and `mins`; `rows` counts from the view's first group.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TiledRef<'a> {
    pub(crate) fmt: BlockFormat,
    pub(crate) rows: usize,
    pub(crate) blocks: usize,
    pub(crate) quants: &'a [u8],
    pub(crate) scales: &'a [f32],
    pub(crate) mins: &'a [f32],
}

impl TiledRef<'_> {
    /// Panics unless the view holds groups `..end` whole: their values, scales and (Q4_1)
    /// mins. The SIMD kernels load them unchecked after this.
    pub(crate) fn assert_groups(&self, end: usize) {
        let (nb, gb) = (self.blocks, Tiled::group_block_bytes(self.fmt));
        let mins = if self.fmt == BlockFormat::Q4_1 { self.mins.len() } else { usize::MAX };
        assert!(
            end * nb * gb <= self.quants.len() && end * nb * LANES <= self.scales.len().min(mins),
            "a tiled view short of {end} groups"
        );
    }

    /// Weight `j` (of 32) of lane `c` in a group's block `chunks`: 0..16 for Q4, −128..128 for
    /// Q8_0.
    #[inline]
    pub(crate) fn int(&self, chunks: &[u8], c: usize, j: usize) -> i32 {
        match self.fmt {
            BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
                let (p, hi) = ((j % 16) / 4, j >= 16);
                let byte = chunks[p * 64 + 4 * c + j % 4];
                i32::from(if hi { byte >> 4 } else { byte & 0xF })
            }
            BlockFormat::Q8_0 => i32::from(chunks[(j / 4) * 64 + 4 * c + j % 4] as i8),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::packed::tests::blocks;
    use super::*;

    /// Rows dequantize to ggml's values bit for bit, whatever group and lane they landed in,
    /// before and after stacking (a first matrix that fills its last group and one that does
    /// not); memory stays within Packed's plus the last group's padding.
    #[test]
    fn tiled_rows_dequantize_to_ggml_values_bit_for_bit() {
        for fmt in [BlockFormat::Q4_0, BlockFormat::Q4_1, BlockFormat::Q8_0] {
            let k = 96;
            for (n1, n2) in [(37, 5), (32, 20)] {
                let (d1, d2) = (blocks(fmt, n1, k, 11), blocks(fmt, n2, k, 12));
                let mut want = vec![0.0; (n1 + n2) * k];
                fmt.dequantize(&d1, &mut want[..n1 * k]);
                fmt.dequantize(&d2, &mut want[n1 * k..]);
                let mut t = Tiled::new(fmt, n1, k, &d1);
                t.append(Tiled::new(fmt, n2, k, &d2));
                assert_eq!((t.rows, t.groups()), (n1 + n2, (n1 + n2).div_ceil(LANES)));
                let mut got = vec![0.0; k];
                for r in 0..n1 + n2 {
                    t.dequantize_row(r, &mut got);
                    let w = &want[r * k..(r + 1) * k];
                    assert!(got.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()), "{fmt:?} {n1}+{n2} row {r}");
                }
                let ggml = d1.len() + d2.len();
                let pad = (t.groups() * LANES - t.rows) * k / BLOCK * (Tiled::group_block_bytes(fmt) / LANES + 8);
                assert!(t.resident_bytes() <= ggml * 6 / 5 + pad, "{fmt:?}: {} vs {ggml}", t.resident_bytes());
            }
        }
    }
}
