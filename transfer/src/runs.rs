//! Page runs: maximal stretches where source and destination pages are both consecutive.

/// `len` pages from `src..src + len` to `dst..dst + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRun {
    /// First source page.
    pub src: u32,
    /// First destination page.
    pub dst: u32,
    /// Number of pages.
    pub len: u32,
}

/// Coalesces page `i` of `src` → page `i` of `dst` into maximal runs, in order. The lists
/// must have the same length (extra entries of the longer one are ignored).
pub fn coalesce(src: &[u32], dst: &[u32]) -> Vec<PageRun> {
    let mut runs: Vec<PageRun> = Vec::new();
    for (&s, &d) in src.iter().zip(dst) {
        if let Some(r) = runs.last_mut()
            && r.src.checked_add(r.len) == Some(s)
            && r.dst.checked_add(r.len) == Some(d)
        {
            r.len += 1;
            continue;
        }
        runs.push(PageRun { src: s, dst: d, len: 1 });
    }
    runs
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn consecutive_on_both_sides_merges() {
        let runs = coalesce(&[4, 5, 6, 9, 10, 11], &[0, 1, 2, 3, 4, 8]);
        assert_eq!(
            runs,
            vec![
                PageRun { src: 4, dst: 0, len: 3 },
                PageRun { src: 9, dst: 3, len: 2 },
                PageRun { src: 11, dst: 8, len: 1 },
            ]
        );
        assert!(coalesce(&[], &[]).is_empty());
        assert_eq!(coalesce(&[u32::MAX, 0], &[0, 1]).len(), 2, "no wrap-around");
    }

    proptest! {
        #[test]
        fn runs_expand_back_to_the_pairs_and_are_maximal(pairs in proptest::collection::vec((0u32..20, 0u32..20), 0..50)) {
            let (src, dst): (Vec<u32>, Vec<u32>) = pairs.iter().copied().unzip();
            let runs = coalesce(&src, &dst);
            let expanded: Vec<(u32, u32)> = runs.iter().flat_map(|r| (0..r.len).map(move |i| (r.src + i, r.dst + i))).collect();
            prop_assert_eq!(expanded, pairs);
            for w in runs.windows(2) {
                prop_assert!(!(w[0].src + w[0].len == w[1].src && w[0].dst + w[0].len == w[1].dst), "not maximal");
            }
        }
    }
}
