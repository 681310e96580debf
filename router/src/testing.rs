//! What the crate's unit tests share.

/// A xorshift generator from `seed`: each call gives a number in `0..n`.
pub(crate) fn rng(mut seed: u64) -> impl FnMut(u64) -> u64 {
    move |n| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    }
}
