//! What every benchmark reads from its environment, named once.

/// `FERRY_BENCH_QUICK`: `1` for a short smoke run (CI), `0` or unset for the full one.
pub const QUICK: &str = "FERRY_BENCH_QUICK";

/// Whether this is a quick smoke run ([`QUICK`] is `1`). Any other value than `0` or `1`
/// stops the benchmark, naming the variable: `FERRY_BENCH_QUICK=true` or `=yes` must not run
/// the full benchmark (or the quick one) by surprise.
pub fn quick() -> bool {
    let v = std::env::var(QUICK).ok();
    parse_quick(v.as_deref())
        .unwrap_or_else(|| panic!("{QUICK}={:?}: use 1 (a quick smoke run) or 0 (the full run)", v.unwrap_or_default()))
}

/// `Some(quick)` for a value of [`QUICK`] (or none), `None` for one it does not know.
fn parse_quick(v: Option<&str>) -> Option<bool> {
    match v {
        None | Some("0") => Some(false),
        Some("1") => Some(true),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_1_is_quick_and_other_values_are_refused() {
        assert_eq!(parse_quick(None), Some(false));
        assert_eq!(parse_quick(Some("0")), Some(false));
        assert_eq!(parse_quick(Some("1")), Some(true));
        for v in ["", "true", "yes", "2"] {
            assert_eq!(parse_quick(Some(v)), None, "{v}");
        }
    }
}
