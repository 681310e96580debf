//! `--device`: which backend a process computes on, parsed once for every binary.

use std::fmt;
use std::str::FromStr;

/// A compute device named on the command line: `cpu`, `cuda` (GPU 0) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The CPU backend.
    Cpu,
    /// The CUDA backend on GPU `N`.
    Cuda(usize),
}

impl FromStr for Device {
    type Err = ferry_cluster::args::FlagError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        use ferry_cluster::args::FlagError;
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => match s.strip_prefix("cuda:") {
                Some(n) => n
                    .parse()
                    .map(Self::Cuda)
                    .map_err(|_| FlagError(format!("--device {s}: N in cuda:N must be a GPU index"))),
                None => Err(FlagError(format!("--device {s}: use cpu, cuda or cuda:N"))),
            },
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// Why `--device cuda` cannot work in a build without the `cuda` feature.
pub const NO_CUDA_BUILD: &str =
    "--device cuda: this ferry was built without CUDA support; rebuild with `--features cuda`";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print_back() {
        assert_eq!("cpu".parse(), Ok(Device::Cpu));
        assert_eq!("cuda".parse(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:3".parse::<Device>().map(|d| d.to_string()), Ok("cuda:3".to_string()));
        assert!("cuda:x".parse::<Device>().expect_err("refused").0.contains("GPU index"));
        assert!("tpu".parse::<Device>().expect_err("refused").0.contains("use cpu, cuda or cuda:N"));
    }
}
