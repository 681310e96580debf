//! Rotary position embedding frequencies, with Llama-3 `rope_scaling`.

/// Llama-3 style frequency scaling (`rope_type = "llama3"` in HF `config.json`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeScaling {
    /// Context scaling factor.
    pub factor: f32,
    /// Wavelengths longer than `original_max / low_freq_factor` are divided by `factor`.
    pub low_freq_factor: f32,
    /// Wavelengths shorter than `original_max / high_freq_factor` are kept.
    pub high_freq_factor: f32,
    /// Context length of the original training.
    pub original_max_position_embeddings: f32,
}

/// Precomputed cos/sin for every position up to the context length.
#[derive(Debug, Clone)]
pub struct RopeTable {
    head_dim: usize,
    max_positions: usize,
    /// `[position][head_dim / 2]` cosines.
    cos: Vec<f32>,
    /// `[position][head_dim / 2]` sines.
    sin: Vec<f32>,
}

impl RopeTable {
    /// Builds the table for `head_dim` (rotated in full), `theta` base and `max_positions`.
    pub fn new(head_dim: usize, theta: f32, max_positions: usize, scaling: Option<RopeScaling>) -> Self {
        let half = head_dim / 2;
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| {
                let f = 1.0 / (theta as f64).powf(2.0 * i as f64 / head_dim as f64);
                match scaling {
                    Some(s) => llama3_scale(f, s),
                    None => f,
                }
            })
            .collect();
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for p in 0..max_positions {
            for f in &inv_freq {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Self { head_dim, max_positions, cos, sin }
    }

    /// Dimension of one head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Positions the table covers.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// `(cos, sin)` rows for `position`, each `head_dim / 2` long.
    pub fn row(&self, position: usize) -> (&[f32], &[f32]) {
        let half = self.head_dim / 2;
        let r = position * half..(position + 1) * half;
        (&self.cos[r.clone()], &self.sin[r])
    }
}

fn llama3_scale(freq: f64, s: RopeScaling) -> f64 {
    let old = s.original_max_position_embeddings as f64;
    let low_wavelen = old / s.low_freq_factor as f64;
    let high_wavelen = old / s.high_freq_factor as f64;
    let wavelen = 2.0 * std::f64::consts::PI / freq;
    if wavelen < high_wavelen {
        freq
    } else if wavelen > low_wavelen {
        freq / s.factor as f64
    } else {
        let smooth =
            (old / wavelen - s.low_freq_factor as f64) / (s.high_freq_factor as f64 - s.low_freq_factor as f64);
        (1.0 - smooth) * freq / s.factor as f64 + smooth * freq
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_zero_is_identity() {
        let t = RopeTable::new(8, 10000.0, 4, None);
        let (c, s) = t.row(0);
        assert!(c.iter().all(|&x| x == 1.0) && s.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let s = RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        assert_eq!(llama3_scale(1.0, s), 1.0);
        let low = 2.0 * std::f64::consts::PI / 100_000.0;
        assert!((llama3_scale(low, s) - low / 8.0).abs() < 1e-15);
    }
}
