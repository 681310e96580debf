//! Dequantisation of GGUF / safetensors tensor data to f32.
//!
//! Block formats (ggml): Q4_0, Q4_1, Q8_0, Q4_K and Q6_K as [`WeightFormat`] defines them (the
//! CPU backend computes with those blocks, repacked; others dequantize them at upload).

use ferry_kernels::quant::WeightFormat;
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

    /// The format a backend may keep a matrix of this type in as it is (all but F32, which
    /// is f32 already).
    pub fn weight_format(self) -> Option<WeightFormat> {
        match self {
            Self::F16 => Some(WeightFormat::F16),
            Self::BF16 => Some(WeightFormat::BF16),
            Self::Q4_0 => Some(WeightFormat::Q4_0),
            Self::Q4_1 => Some(WeightFormat::Q4_1),
            Self::Q8_0 => Some(WeightFormat::Q8_0),
            Self::Q4K => Some(WeightFormat::Q4K),
            Self::Q6K => Some(WeightFormat::Q6K),
            Self::F32 => None,
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
            DType::Q4_0 => WeightFormat::Q4_0.dequantize_block(blk, o),
            DType::Q4_1 => WeightFormat::Q4_1.dequantize_block(blk, o),
            DType::Q8_0 => WeightFormat::Q8_0.dequantize_block(blk, o),
            DType::Q4K => WeightFormat::Q4K.dequantize_block(blk, o),
            DType::Q6K => WeightFormat::Q6K.dequantize_block(blk, o),
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

/// Quantises f32 values to Q4_K (for writing test models; `x.len()` a multiple of 256): per
/// sub-block of 32 a range from min(0, lowest) to the highest, 6-bit scale and min against the
/// block's largest.
pub fn quantize_q4_k(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / 256 * 144);
    for b in x.chunks(256) {
        let subs: Vec<(f32, f32)> = b
            .chunks(32)
            .map(|s| {
                let lo = s.iter().fold(0.0f32, |m, &v| m.min(v));
                let hi = s.iter().fold(lo, |m, &v| m.max(v));
                ((hi - lo) / 15.0, -lo)
            })
            .collect();
        let top = |f: fn(&(f32, f32)) -> f32| subs.iter().map(f).fold(0.0f32, f32::max) / 63.0;
        let (d, dmin) = (f16::from_f32(top(|s| s.0)), f16::from_f32(top(|s| s.1)));
        let q6 = |v: f32, by: f16| if by.to_f32() > 0.0 { (v / by.to_f32()).round().clamp(0.0, 63.0) as u8 } else { 0 };
        let (sc, mn): (Vec<u8>, Vec<u8>) = subs.iter().map(|&(s, m)| (q6(s, d), q6(m, dmin))).unzip();
        out.extend_from_slice(&d.to_le_bytes());
        out.extend_from_slice(&dmin.to_le_bytes());
        let mut packed = [0u8; 12];
        for j in 0..4 {
            packed[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            packed[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
            packed[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
        }
        out.extend_from_slice(&packed);
        let q: Vec<u8> = b
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let (s, m) = (d.to_f32() * f32::from(sc[i / 32]), dmin.to_f32() * f32::from(mn[i / 32]));
                if s > 0.0 { ((v + m) / s).round().clamp(0.0, 15.0) as u8 } else { 0 }
            })
            .collect();
        for c in 0..4 {
            out.extend((0..32).map(|l| q[c * 64 + l] | (q[c * 64 + 32 + l] << 4)));
        }
    }
    out
}

/// Quantises f32 values to Q6_K (for writing test models; `x.len()` a multiple of 256): per
/// sub-block of 16 a signed scale putting its largest magnitude at 31, 8-bit against the
/// block's largest.
pub fn quantize_q6_k(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / 256 * 210);
    for b in x.chunks(256) {
        let scales: Vec<f32> = b.chunks(16).map(|s| s.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 31.0).collect();
        let d = f16::from_f32(scales.iter().fold(0.0f32, |m, &v| m.max(v)) / 127.0);
        let sc: Vec<i8> = scales
            .iter()
            .map(|&s| if d.to_f32() > 0.0 { (s / d.to_f32()).round().clamp(-128.0, 127.0) as i8 } else { 0 })
            .collect();
        let q: Vec<u8> = b
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let s = d.to_f32() * f32::from(sc[i / 16]);
                let q = if s != 0.0 { (v / s).round().clamp(-32.0, 31.0) as i32 } else { 0 };
                (q + 32) as u8
            })
            .collect();
        let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
        for n in 0..2 {
            let y = &q[n * 128..];
            for l in 0..32 {
                ql[n * 64 + l] = (y[l] & 0xF) | ((y[l + 64] & 0xF) << 4);
                ql[n * 64 + l + 32] = (y[l + 32] & 0xF) | ((y[l + 96] & 0xF) << 4);
                qh[n * 32 + l] =
                    (y[l] >> 4) | ((y[l + 32] >> 4) << 2) | ((y[l + 64] >> 4) << 4) | ((y[l + 96] >> 4) << 6);
            }
        }
        out.extend_from_slice(&ql);
        out.extend_from_slice(&qh);
        out.extend(sc.iter().map(|&s| s as u8));
        out.extend_from_slice(&d.to_le_bytes());
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
    fn q4_k_and_q6_k_round_trip_within_their_step() {
        let x: Vec<f32> = (0..512).map(|i| ((i * 37 % 101) as f32 - 50.0) / 20.0).collect();
        let mut o = vec![0.0; 512];
        dequantize(DType::Q4K, &quantize_q4_k(&x), &mut o);
        let worst = x.iter().zip(&o).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(worst < 5.0 / 15.0, "Q4_K off by {worst}");
        dequantize(DType::Q6K, &quantize_q6_k(&x), &mut o);
        let worst = x.iter().zip(&o).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(worst < 2.5 / 31.0, "Q6_K off by {worst}");
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
