//! `--cpu-math`: how the CPU backend multiplies activations by quantized weights.

use std::fmt;
use std::str::FromStr;

/// The numeric mode of the CPU's quantized products (f32 weights and every other operation
/// are the same in both).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CpuMath {
    /// f32 activations against the dequantized weights (in registers): the model's values,
    /// up to summation order.
    #[default]
    Exact,
    /// Activations quantized to 8 bits per 32-value block and integer dot products
    /// (llama.cpp's scheme): faster batch-1 decode, results within the activations' rounding.
    Fast,
}

/// A `--cpu-math` value that is neither `exact` nor `fast`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--cpu-math {0}: use exact or fast")]
pub struct UnknownCpuMath(String);

impl FromStr for CpuMath {
    type Err = UnknownCpuMath;

    fn from_str(s: &str) -> Result<Self, UnknownCpuMath> {
        match s {
            "exact" => Ok(Self::Exact),
            "fast" => Ok(Self::Fast),
            _ => Err(UnknownCpuMath(s.to_string())),
        }
    }
}

impl fmt::Display for CpuMath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Exact => "exact",
            Self::Fast => "fast",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_print_back() {
        for m in [CpuMath::Exact, CpuMath::Fast] {
            assert_eq!(m.to_string().parse(), Ok(m));
        }
        assert!("quick".parse::<CpuMath>().expect_err("refused").to_string().contains("use exact or fast"));
    }
}
