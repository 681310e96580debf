//! Dequantisation of GGUF / safetensors tensor data to f32.
//!
//! Block formats (ggml): Q4_0, Q4_1 and Q8_0 as [`BlockFormat`] defines them (the kernels
//! compute with those blocks as they are). Q4_K: super-blocks of 256 with 8 sub-blocks whose 6-bit
//! scales and mins are packed in 12 bytes. Q6_K: 256 weights as 4 low bits (`ql`) + 2 high
//! bits (`qh`) with 16 signed 8-bit scales.

use ferry_kernels::quant::BlockFormat;
use half::{bf16, f16};

/// Element types Ferry can turn into f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
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

impl DType {
    /// The type of a GGML type id, if supported.
    pub fn from_ggml(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            14 => Self::Q6K,
            30 => Self::BF16,
            _ => return None,
        })
    }

    /// `(bytes per block, elements per block)`.
    pub fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (4, 1),
            Self::F16 | Self::BF16 => (2, 1),
            Self::Q4_0 => (18, 32),
            Self::Q4_1 => (20, 32),
            Self::Q8_0 => (34, 32),
            Self::Q4K => (144, 256),
            Self::Q6K => (210, 256),
        }
    }

    /// The block format a backend may keep as it is (Q4_0, Q4_1, Q8_0).
    pub fn block_format(self) -> Option<BlockFormat> {
        match self {
            Self::Q4_0 => Some(BlockFormat::Q4_0),
            Self::Q4_1 => Some(BlockFormat::Q4_1),
            Self::Q8_0 => Some(BlockFormat::Q8_0),
            _ => None,
        }
    }

    /// Bytes needed for `n` elements, or None when `n` is not whole blocks.
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        let (b, e) = self.block();
        n.is_multiple_of(e).then(|| n / e * b)
    }
}

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Dequantises `data` (exactly `dtype.bytes_for(out.len())` bytes) into `out`.
///
/// # Panics
/// Never for matching sizes; callers check sizes with [`DType::bytes_for`] first.
pub fn dequantize(dtype: DType, data: &[u8], out: &mut [f32]) {
    let (bs, es) = dtype.block();
    for (blk, o) in data.chunks_exact(bs).zip(out.chunks_exact_mut(es)) {
        match dtype {
            DType::F32 => o[0] = f32::from_le_bytes([blk[0], blk[1], blk[2], blk[3]]),
            DType::F16 => o[0] = h(blk, 0),
            DType::BF16 => o[0] = bf16::from_le_bytes([blk[0], blk[1]]).to_f32(),
            DType::Q4_0 => BlockFormat::Q4_0.dequantize_block(blk, o),
            DType::Q4_1 => BlockFormat::Q4_1.dequantize_block(blk, o),
            DType::Q8_0 => BlockFormat::Q8_0.dequantize_block(blk, o),
            DType::Q4K => q4k(blk, o),
            DType::Q6K => q6k(blk, o),
        }
    }
}

/// Scale and min of sub-block `j` (0..8) from the 12 packed bytes of a Q4_K block.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

fn q4k(blk: &[u8], o: &mut [f32]) {
    let (d, dmin) = (h(blk, 0), h(blk, 2));
    let scales = &blk[4..16];
    let qs = &blk[16..144];
    for c in 0..4 {
        let (s1, m1) = scale_min_k4(2 * c, scales);
        let (s2, m2) = scale_min_k4(2 * c + 1, scales);
        let q = &qs[c * 32..c * 32 + 32];
        let y = &mut o[c * 64..c * 64 + 64];
        for l in 0..32 {
            y[l] = d * s1 as f32 * (q[l] & 0xF) as f32 - dmin * m1 as f32;
            y[l + 32] = d * s2 as f32 * (q[l] >> 4) as f32 - dmin * m2 as f32;
        }
    }
}

fn q6k(blk: &[u8], o: &mut [f32]) {
    let ql = &blk[0..128];
    let qh = &blk[128..192];
    let sc = &blk[192..208];
    let d = h(blk, 208);
    for n in 0..2 {
        let (ql, qh, sc) = (&ql[n * 64..], &qh[n * 32..], &sc[n * 8..]);
        let y = &mut o[n * 128..n * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

/// Quantises f32 values to Q8_0 (for writing test models).
pub fn quantize_q8_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / 32 * 34);
    for b in x.chunks(32) {
        let amax = b.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend(b.iter().map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8));
    }
    out
}

/// Quantises f32 values to Q4_1 (for writing test models).
pub fn quantize_q4_1(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / 32 * 20);
    for b in x.chunks(32) {
        let (min, max) = b.iter().fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let d = (max - min) / 15.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let (dh, mh) = (f16::from_f32(d), f16::from_f32(min));
        out.extend_from_slice(&dh.to_le_bytes());
        out.extend_from_slice(&mh.to_le_bytes());
        let q = |v: f32| ((v - min) * inv).round().clamp(0.0, 15.0) as u8;
        for j in 0..16 {
            out.push(q(b[j]) | (q(b[j + 16]) << 4));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_low_nibbles_are_the_first_half() {
        let mut blk = Vec::new();
        blk.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
        blk.extend_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        blk.extend((0..16u8).map(|j| j | (15 - j) << 4));
        let mut o = [0.0; 32];
        dequantize(DType::Q4_1, &blk, &mut o);
        assert_eq!(o[0], -1.0);
        assert_eq!(o[3], 0.5);
        assert_eq!(o[16], 6.5);
        assert_eq!(o[31], -1.0);
    }

    #[test]
    fn q8_0_and_q4_1_round_trip_within_their_step() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 37 % 64) as f32 - 32.0) / 10.0).collect();
        let mut o = vec![0.0; 64];
        dequantize(DType::Q8_0, &quantize_q8_0(&x), &mut o);
        assert!(x.iter().zip(&o).all(|(a, b)| (a - b).abs() < 3.2 / 127.0));
        dequantize(DType::Q4_1, &quantize_q4_1(&x), &mut o);
        assert!(x.iter().zip(&o).all(|(a, b)| (a - b).abs() < 6.4 / 15.0));
    }

    #[test]
    fn q4_k_unpacks_six_bit_scales() {
        let mut blk = vec![0u8; 144];
        blk[0..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        blk[2..4].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        // Sub-block 0: scale 3, min 2. Sub-block 5: scale 0b01_0111 = 23, min 0b10_0001 = 33.
        blk[4] = 3;
        blk[4 + 4] = 2;
        blk[4 + 1] |= 1 << 6; // high bits of scale 5 live in q[1]
        blk[4 + 5] |= 2 << 6; // high bits of min 5 live in q[5]
        blk[4 + 9] = 0x17 & 0xF | (0x1 << 4); // low nibble: scale 5 low bits (7); high: min low bits (1)
        blk[16] = 0x0F; // weight 0 → q=15; weight 32 → q=0
        blk[16 + 64 + 2] = 0xA0; // sub-block 5 (chunk 2, high nibbles) weight 2 → q=10
        let mut o = vec![0.0; 256];
        dequantize(DType::Q4K, &blk, &mut o);
        assert_eq!(o[0], 3.0 * 15.0 - 0.5 * 2.0);
        let (s5, m5) = scale_min_k4(5, &blk[4..16]);
        assert_eq!((s5, m5), (23, 33));
        assert_eq!(o[128 + 32 + 2], 23.0 * 10.0 - 0.5 * 33.0);
    }

    #[test]
    fn q6_k_combines_low_and_high_bits() {
        let mut blk = vec![0u8; 210];
        blk[208..210].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        for s in 0..16 {
            blk[192 + s] = (s as i8 - 8) as u8;
        }
        blk[0] = 0x5 | (0x3 << 4); // weight 0 low = 5, weight 64 low = 3
        blk[128] = 0b10_00_00_01; // weight 0 high = 1, weight 96 high = 2
        let mut o = vec![0.0; 256];
        dequantize(DType::Q6K, &blk, &mut o);
        assert_eq!(o[0], 0.25 * -8.0 * ((5 | 1 << 4) - 32) as f32);
        assert_eq!(o[64], 0.25 * -4.0 * (3 - 32) as f32);
        assert_eq!(o[96], 0.25 * -2.0 * ((2 << 4) - 32) as f32);
    }
}
