//! Block-quantized weights as model files store them ([`WeightFormat`]: ggml's Q4_0, Q4_1,
//! Q8_0, Q4_K, Q6_K), kept quantized in memory by backends that can compute with them and
//! dequantized at upload by the others. [`BlockFormat`] is the first three: blocks of 32
//! weights sharing an f16 scale.
//!
//! Formats: Q4_0 `d:f16, qs[16]` → `(q − 8)·d`; Q4_1 `d:f16, m:f16, qs[16]` → `q·d + m`; in
//! both, weight `j < 16` is the low nibble of `qs[j]` and `16 + j` the high one. Q8_0
//! `d:f16, q:i8[32]` → `q·d`. [`BlockFormat::dequantize_block`] is the definition of the
//! values; the CPU backend repacks the blocks (`cpu::packed`) and its dequantization is tested
//! to equal this one bit for bit.

use half::f16;

pub use crate::quant_k::WeightFormat;

/// Weights per block.
pub const BLOCK: usize = 32;

/// A block-quantized format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockFormat {
    /// ggml Q4_0.
    Q4_0,
    /// ggml Q4_1.
    Q4_1,
    /// ggml Q8_0.
    Q8_0,
}

#[inline(always)]
fn half(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

impl BlockFormat {
    /// Bytes per block of [`BLOCK`] weights.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
        }
    }

    /// Bytes of a row of `cols` weights (`cols` a multiple of [`BLOCK`]).
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / BLOCK * self.block_bytes()
    }

    /// The 32 weights of one block (`blk` is [`block_bytes`](Self::block_bytes) long).
    #[inline]
    pub fn dequantize_block(self, blk: &[u8], o: &mut [f32]) {
        match self {
            Self::Q4_0 => {
                let d = half(blk, 0);
                for j in 0..16 {
                    o[j] = ((blk[2 + j] & 0xF) as i32 - 8) as f32 * d;
                    o[j + 16] = ((blk[2 + j] >> 4) as i32 - 8) as f32 * d;
                }
            }
            Self::Q4_1 => {
                let (d, m) = (half(blk, 0), half(blk, 2));
                for j in 0..16 {
                    o[j] = (blk[4 + j] & 0xF) as f32 * d + m;
                    o[j + 16] = (blk[4 + j] >> 4) as f32 * d + m;
                }
            }
            Self::Q8_0 => {
                let d = half(blk, 0);
                for j in 0..32 {
                    o[j] = blk[2 + j] as i8 as f32 * d;
                }
            }
        }
    }

    /// Dequantizes whole blocks: `out.len()` weights from `data`.
    pub fn dequantize(self, data: &[u8], out: &mut [f32]) {
        for (blk, o) in data.chunks_exact(self.block_bytes()).zip(out.chunks_exact_mut(BLOCK)) {
            self.dequantize_block(blk, o);
        }
    }
}
