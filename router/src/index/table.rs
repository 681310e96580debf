//! The shard's page table: where each page that came in a KV event is, by its hash.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use ferry_radix::NodeId;

/// Page hashes are already mixed (`page_hash` ends in an avalanche): a map keyed by them
/// uses the key as its hash instead of hashing it again with SipHash.
#[derive(Default)]
struct PageHasher(u64);

impl Hasher for PageHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys come here; anything else still spreads.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type PageMap = HashMap<u64, Loc, BuildHasherDefault<PageHasher>>;

/// The page table in 64 parts by the hash's top bits, each growing on its own: growing one
/// rehashes a 64th of the entries under the index lock, not all of them (one table paused
/// placements 7, 14, 27, 54 ms as a million-page snapshot went in; sizing it for the whole
/// budget up front cost its full size in memory, inserts landing all over it).
pub(super) struct PageTable {
    parts: Vec<PageMap>,
}

impl Default for PageTable {
    fn default() -> Self {
        Self { parts: (0..64).map(|_| PageMap::default()).collect() }
    }
}

impl PageTable {
    fn part(&self, h: u64) -> &PageMap {
        &self.parts[(h >> 58) as usize]
    }

    fn part_mut(&mut self, h: u64) -> &mut PageMap {
        &mut self.parts[(h >> 58) as usize]
    }

    /// Pages in the table.
    pub(super) fn len(&self) -> usize {
        self.parts.iter().map(HashMap::len).sum()
    }

    pub(super) fn get(&self, h: &u64) -> Option<&Loc> {
        self.part(*h).get(h)
    }

    pub(super) fn get_mut(&mut self, h: &u64) -> Option<&mut Loc> {
        self.part_mut(*h).get_mut(h)
    }

    pub(super) fn insert(&mut self, h: u64, loc: Loc) {
        self.part_mut(h).insert(h, loc);
    }

    pub(super) fn remove(&mut self, h: &u64) {
        self.part_mut(*h).remove(h);
    }
}

/// Where a page that came in a KV event is: in `node`, at index `at` — or, after a split cut
/// the node's head off, at a smaller index.
#[derive(Debug, Clone, Copy)]
pub(super) struct Loc {
    pub(super) node: NodeId,
    pub(super) at: u32,
}
