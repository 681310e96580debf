//! The formats a model file may store a weight matrix in and a backend may keep
//! ([`WeightFormat`]: half precision and ggml's block formats), with ggml's super-block
//! formats defined here:
//!
//! - **Q4_K**, 144 bytes per 256 weights: `d:f16, dmin:f16, scales[12], qs[128]`. Eight
//!   sub-blocks of 32 weights, each with a 6-bit scale `s` and min `m` packed in `scales`
//!   ([`q4k_scale_min`]); weight `q·(d·s) − dmin·m`. The 128 bytes are four runs of 32: run `c`
//!   holds sub-block `2c` in its low nibbles and `2c + 1` in its high ones.
//! - **Q6_K**, 210 bytes per 256 weights: `ql[128], qh[64], scales:i8[16], d:f16`. Sixteen
//!   sub-blocks of 16 weights, each with a signed 8-bit scale `s`; weight `(q − 32)·(d·s)` with
//!   `q` 6 bits: its low 4 in `ql`, its high 2 in `qh` ([`q6k_ints`]).
//!
//! Both are ggml's `dequantize_row_q4_K` / `dequantize_row_q6_K` bit for bit: `d·s` and
//! `dmin·m` (an f16 times an integer of at most 8 bits) are exact in f32.

use half::f16;

use crate::quant::BlockFormat;

/// Weights per Q4_K / Q6_K super-block.
pub const SUPER: usize = 256;

/// A weight matrix's format as the model file stores it, for backends that keep it so (the
/// CPU keeps all of these; f32 matrices go through [`Backend::matrix`](crate::Backend::matrix)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    /// IEEE half precision, one value per 2 bytes.
    F16,
    /// bfloat16, one value per 2 bytes.
    BF16,
    /// ggml Q4_0.
    Q4_0,
    /// ggml Q4_1.
    Q4_1,
    /// ggml Q8_0.
    Q8_0,
    /// ggml Q4_K.
    Q4K,
    /// ggml Q6_K.
    Q6K,
}

impl From<BlockFormat> for WeightFormat {
    fn from(f: BlockFormat) -> Self {
        match f {
            BlockFormat::Q4_0 => Self::Q4_0,
            BlockFormat::Q4_1 => Self::Q4_1,
            BlockFormat::Q8_0 => Self::Q8_0,
        }
    }
}

/// The little-endian f16 at `b[at..]`, widened.
#[inline(always)]
pub(crate) fn half(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

impl WeightFormat {
    /// The 32-weight block format it is, if it is one.
    pub fn block(self) -> Option<BlockFormat> {
        match self {
            Self::Q4_0 => Some(BlockFormat::Q4_0),
            Self::Q4_1 => Some(BlockFormat::Q4_1),
            Self::Q8_0 => Some(BlockFormat::Q8_0),
            Self::F16 | Self::BF16 | Self::Q4K | Self::Q6K => None,
        }
    }

    /// Weights per block (1 for the half formats, 32, or 256 for the K formats).
    pub fn block_weights(self) -> usize {
        match self {
            Self::F16 | Self::BF16 => 1,
            Self::Q4K | Self::Q6K => SUPER,
            Self::Q4_0 | Self::Q4_1 | Self::Q8_0 => crate::quant::BLOCK,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F16 | Self::BF16 => 2,
            Self::Q4K => 144,
            Self::Q6K => 210,
            _ => self.block().map_or(0, BlockFormat::block_bytes),
        }
    }

    /// Bytes of a row of `cols` weights (`cols` a multiple of [`block_weights`](Self::block_weights)).
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_weights() * self.block_bytes()
    }

    /// The weights of one block (`blk` is [`block_bytes`](Self::block_bytes) long, `o`
    /// [`block_weights`](Self::block_weights)).
    pub fn dequantize_block(self, blk: &[u8], o: &mut [f32]) {
        match self {
            Self::F16 => o[0] = half(blk, 0),
            Self::BF16 => o[0] = half::bf16::from_le_bytes([blk[0], blk[1]]).to_f32(),
            Self::Q4K => {
                for (j, o) in o.chunks_exact_mut(32).enumerate() {
                    let (d, m, q) = q4k_sub_block(blk, j);
                    for (o, q) in o.iter_mut().zip(q) {
                        *o = q as f32 * d - m;
                    }
                }
            }
            Self::Q6K => {
                let (q, d) = (q6k_ints(blk), half(blk, 208));
                for (s, (o, q)) in o.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
                    let scale = d * f32::from(blk[192 + s] as i8);
                    for (o, &q) in o.iter_mut().zip(q) {
                        *o = f32::from(q) * scale;
                    }
                }
            }
            _ => {
                if let Some(f) = self.block() {
                    f.dequantize_block(blk, o)
                }
            }
        }
    }

    /// Dequantizes whole blocks: `out.len()` weights from `data`.
    pub fn dequantize(self, data: &[u8], out: &mut [f32]) {
        for (blk, o) in data.chunks_exact(self.block_bytes()).zip(out.chunks_exact_mut(self.block_weights())) {
            self.dequantize_block(blk, o);
        }
    }
}

/// Scale and min (6 bits each) of sub-block `j` (0..8) from a Q4_K block's 12 packed bytes.
#[inline]
pub fn q4k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Sub-block `j` (0..8) of a Q4_K block as a Q4_1-like block: `(d·s, dmin·m, values 0..16)`,
/// its weights `q·(d·s) − dmin·m`.
#[inline]
pub fn q4k_sub_block(blk: &[u8], j: usize) -> (f32, f32, [u8; 32]) {
    let (d, dmin) = (half(blk, 0), half(blk, 2));
    let (s, m) = q4k_scale_min(j, &blk[4..16]);
    let run = &blk[16 + (j / 2) * 32..16 + (j / 2) * 32 + 32];
    let mut q = [0u8; 32];
    for (q, &b) in q.iter_mut().zip(run) {
        *q = if j.is_multiple_of(2) { b & 0xF } else { b >> 4 };
    }
    (d * f32::from(s), dmin * f32::from(m), q)
}

/// The 256 values `q − 32` (−32..32) of a Q6_K block, in weight order.
pub fn q6k_ints(blk: &[u8]) -> [i8; SUPER] {
    let (ql, qh) = (&blk[0..128], &blk[128..192]);
    let mut out = [0i8; SUPER];
    for n in 0..2 {
        let (ql, qh, y) = (&ql[n * 64..], &qh[n * 32..], &mut out[n * 128..]);
        for l in 0..32 {
            y[l] = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
            y[l + 32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            y[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            y[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Random K-format blocks for `n` rows of `k` weights: random bytes with finite, modest
    /// f16 scales.
    pub(crate) fn k_blocks(fmt: WeightFormat, n: usize, k: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let scale = |v: u64, div: f32| f16::from_f32((v % 1000) as f32 / div + 1e-4).to_le_bytes();
        let mut out = Vec::new();
        for _ in 0..n * k / SUPER {
            let mut blk: Vec<u8> = (0..fmt.block_bytes()).map(|_| next() as u8).collect();
            match fmt {
                WeightFormat::Q4K => {
                    blk[0..2].copy_from_slice(&scale(next(), 300_000.0));
                    blk[2..4].copy_from_slice(&scale(next(), 600_000.0));
                }
                _ => blk[208..210].copy_from_slice(&scale(next(), 400_000.0)),
            }
            out.extend_from_slice(&blk);
        }
        out
    }

    /// ggml's reference decoders, written as ggml writes them.
    fn ggml_q4k(blk: &[u8], y: &mut [f32]) {
        let (d, min) = (half(blk, 0), half(blk, 2));
        let (scales, mut q) = (&blk[4..16], &blk[16..]);
        let mut is = 0;
        for j in (0..SUPER).step_by(64) {
            let (sc, m) = q4k_scale_min(is, scales);
            let (d1, m1) = (d * sc as f32, min * m as f32);
            let (sc, m) = q4k_scale_min(is + 1, scales);
            let (d2, m2) = (d * sc as f32, min * m as f32);
            for l in 0..32 {
                y[j + l] = d1 * (q[l] & 0xF) as f32 - m1;
                y[j + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
            }
            q = &q[32..];
            is += 2;
        }
    }

    fn ggml_q6k(blk: &[u8], y: &mut [f32]) {
        let d = half(blk, 208);
        for n in 0..2 {
            let (ql, qh, sc) = (&blk[n * 64..], &blk[128 + n * 32..], &blk[192 + n * 8..]);
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
                let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                let s = |i: usize| d * (sc[i] as i8) as f32;
                y[n * 128 + l] = s(is) * q1 as f32;
                y[n * 128 + l + 32] = s(is + 2) * q2 as f32;
                y[n * 128 + l + 64] = s(is + 4) * q3 as f32;
                y[n * 128 + l + 96] = s(is + 6) * q4 as f32;
            }
        }
    }

    #[test]
    fn k_formats_dequantize_as_ggml_does_bit_for_bit() {
        for (fmt, reference) in [(WeightFormat::Q4K, ggml_q4k as fn(&[u8], &mut [f32])), (WeightFormat::Q6K, ggml_q6k)]
        {
            let data = k_blocks(fmt, 3, 512, 7);
            let mut got = vec![0.0; 3 * 512];
            fmt.dequantize(&data, &mut got);
            for (blk, g) in data.chunks_exact(fmt.block_bytes()).zip(got.chunks_exact(SUPER)) {
                let mut want = [0.0f32; SUPER];
                reference(blk, &mut want);
                assert!(g.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "{fmt:?}");
            }
            assert!(got.iter().any(|v| *v != 0.0) && got.iter().all(|v| v.is_finite()), "{fmt:?}");
            assert_eq!(fmt.row_bytes(512), 2 * fmt.block_bytes());
        }
    }
}
