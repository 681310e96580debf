//! KV events: what a prefix cache publishes so that an index elsewhere (the router's) can
//! follow its contents.
//!
//! Pages are named by a chained hash: `hash(page) = H(hash(parent page), tokens of page)`, so
//! equal hashes mean equal prefixes up to and including that page. Each event carries a
//! per-worker `sequence`, strictly increasing within an `epoch`; the epoch changes whenever the
//! cache is created anew (a restart), and a follower that sees a gap or a new epoch asks for a
//! snapshot.

/// Hash of the page before the first one (the empty prefix).
pub const ROOT_HASH: u64 = 0;

/// The chained hash of a page of `tokens` following a page whose hash is `parent`.
pub fn page_hash(parent: u64, tokens: &[u32]) -> u64 {
    // One multiply per token (each step a bijection of the state, the rotation feeding high
    // bits back down), then a final avalanche (SplitMix64), so the values spread well even
    // for short pages. Stable across runs and builds. The router hashes every new page of
    // every prompt it places with this: it was byte-wise FNV-1a, 4 multiplies per token.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ parent.rotate_left(17);
    for &t in tokens {
        h = (h.rotate_left(23) ^ u64::from(t)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    let h = h ^ (h >> 31);
    if h == ROOT_HASH { 1 } else { h }
}

/// The chained hashes of the whole pages of `tokens` (`page_size` tokens each) following a
/// page whose hash is `parent`; a partial last page is ignored.
pub fn page_hashes(parent: u64, tokens: &[u32], page_size: usize) -> Vec<u64> {
    let mut h = parent;
    tokens
        .chunks_exact(page_size.max(1))
        .map(|page| {
            h = page_hash(h, page);
            h
        })
        .collect()
}

/// Pages added to the cache, as one run below `parent_hash`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// Hash of the page before the run ([`ROOT_HASH`] at the root).
    pub parent_hash: u64,
    /// The chained hash of each page of the run.
    pub page_hashes: Vec<u64>,
    /// The tokens of the run, page after page.
    pub token_ids: Vec<u32>,
}

/// What changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventKind {
    /// Pages were cached.
    Stored(Stored),
    /// Pages were evicted.
    Removed {
        /// Their hashes.
        page_hashes: Vec<u64>,
    },
    /// The whole cache, parents before children.
    Snapshot(Vec<Stored>),
}

/// One event with its place in the worker's stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEvent {
    /// Changes when the cache is recreated.
    pub epoch: u64,
    /// Strictly increasing within an epoch.
    pub sequence: u64,
    /// The change.
    pub kind: EventKind,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_and_differ() {
        let a = page_hash(ROOT_HASH, &[1, 2, 3, 4]);
        assert_eq!(a, page_hash(ROOT_HASH, &[1, 2, 3, 4]));
        assert_ne!(a, page_hash(ROOT_HASH, &[1, 2, 3, 5]));
        assert_ne!(page_hash(a, &[9]), page_hash(ROOT_HASH, &[9]));
        assert_ne!(a, ROOT_HASH);
    }
}
