//! What every benchmark reads from its environment, named once.

/// `FERRY_BENCH_QUICK`: `1` for a short smoke run (CI), `0` or unset for the full one.
pub const QUICK: &str = "FERRY_BENCH_QUICK";

/// Whether this is a quick smoke run ([`QUICK`] is `1`). Any other value than `0` or `1`
/// stops the benchmark, naming the variable: `FERRY_BENCH_QUICK=true` or `=yes` must not run
/// the full benchmark (or the quick one) by surprise.
pub fn quick() -> bool {
    parse_quick(std::env::var(QUICK).ok().as_deref()).unwrap_or_else(|e| panic!("{e}"))
}

fn parse_quick(v: Option<&str>) -> Result<bool, String> {
    match v {
        None | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(other) => Err(format!("{QUICK}={other:?}: use 1 (a quick smoke run) or 0 (the full run)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_1_is_quick_and_other_values_are_refused() {
        assert_eq!(parse_quick(None), Ok(false));
        assert_eq!(parse_quick(Some("0")), Ok(false));
        assert_eq!(parse_quick(Some("1")), Ok(true));
        for v in ["", "true", "yes", "2"] {
            assert!(parse_quick(Some(v)).expect_err(v).contains("use 1"), "{v}");
        }
    }
}
