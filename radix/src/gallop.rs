//! Galloping prefix comparison.

/// Length of the longest common prefix of `a` and `b`.
///
/// Compares windows of 16, 32, 64, ... tokens as whole slices (a memcmp each), then
/// binary-searches inside the first window that differs. Cost: O(log n) slice comparisons
/// whose total length is O(n), with the comparisons themselves vectorised.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    let n = a.len().min(b.len());
    let mut lo = 0;
    let mut w = 16;
    while lo < n {
        let hi = (lo + w).min(n);
        if a[lo..hi] == b[lo..hi] {
            lo = hi;
            w *= 2;
            continue;
        }
        // a[..lo] == b[..lo]; the first difference lies in [lo, hi).
        let (mut l, mut h) = (lo, hi);
        while h - l > 1 {
            let m = l + (h - l) / 2;
            if a[l..m] == b[l..m] {
                l = m;
            } else {
                h = m;
            }
        }
        return l;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[u32], b: &[u32]) -> usize {
        a.iter().zip(b).take_while(|(x, y)| x == y).count()
    }

    #[test]
    fn agrees_with_a_step_by_step_comparison() {
        let base: Vec<u32> = (0..5000).collect();
        for cut in [0, 1, 15, 16, 17, 31, 100, 4095, 4096, 4999] {
            let mut b = base.clone();
            b[cut] = u32::MAX;
            assert_eq!(common_prefix(&base, &b), cut);
            assert_eq!(common_prefix(&base, &b), naive(&base, &b));
        }
        assert_eq!(common_prefix(&base, &base[..300]), 300);
        assert_eq!(common_prefix(&[], &base), 0);
    }
}
