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
        &self.parts[part_of(h)]
    }

    fn part_mut(&mut self, h: u64) -> &mut PageMap {
        &mut self.parts[part_of(h)]
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

/// A page's part: 6 bits of its hash that neither the map's bucket (the low bits, tables
/// under 2^32 buckets) nor its tag (`hashbrown` keeps the top 7 bits of the hash in a control
/// byte and compares keys only where the tag matches) uses. Parts by the top 6 bits left every
/// tag in a part one of two values: half the occupied slots of each probed group matched, and
/// an insert compared keys in memory at several of them (a cache miss each).
fn part_of(h: u64) -> usize {
    ((h >> 32) & 63) as usize
}

/// What a shard's page lookups found, in order, as one copy of the shared events' index made a
/// change with the one table the writer keeps; the other copy makes the same change again from
/// these answers, with no table (`super::shared`).
#[derive(Debug, Default)]
pub struct Trace {
    found: Vec<Option<(NodeId, u32)>>,
    next: usize,
    /// A second making asked for more answers than the first left.
    overrun: bool,
}

impl Trace {
    /// Empty, its room kept. False when the second makings did not take exactly the answers
    /// the first left: they looked up otherwise, and the copies may differ.
    pub(super) fn finish(&mut self) -> bool {
        let whole = !self.overrun && self.next == self.found.len();
        self.found.clear();
        self.next = 0;
        self.overrun = false;
        whole
    }

    pub(super) fn push(&mut self, found: Option<(NodeId, usize)>) {
        self.found.push(found.map(|(n, k)| (n, k as u32)));
    }

    /// The next answer, in the order they were pushed (none, noted, past the last).
    pub(super) fn pop(&mut self) -> Option<(NodeId, usize)> {
        let Some(&found) = self.found.get(self.next) else {
            self.overrun = true;
            return None;
        };
        self.next += 1;
        found.map(|(n, k)| (n, k as usize))
    }
}

/// Which page table a shard uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum Mode {
    /// Its own (an index used alone).
    #[default]
    Own,
    /// The shared index's one table, lent for a change; lookups are traced.
    Record,
    /// None: the change is made again from the trace of its first making.
    Replay,
}

/// Where a page that came in a KV event is: in `node`, at index `at` — or, after a split cut
/// the node's head off, at a smaller index.
#[derive(Debug, Clone, Copy)]
pub(super) struct Loc {
    pub(super) node: NodeId,
    pub(super) at: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second making that looks up other than the first did is told (the copies may differ).
    #[test]
    fn a_trace_tells_when_it_was_not_taken_whole() {
        let mut t = Trace::default();
        let (a, b) = (Some((NodeId::ROOT, 3)), None);
        t.push(a);
        t.push(b);
        assert_eq!((t.pop(), t.pop()), (a, b));
        assert!(t.finish(), "taken whole");
        t.push(a);
        t.push(b);
        assert_eq!(t.pop(), a);
        assert!(!t.finish(), "one answer left");
        t.push(a);
        assert_eq!((t.pop(), t.pop()), (a, None));
        assert!(!t.finish(), "asked past the last");
        assert!(t.finish(), "finished: empty");
    }

    /// The pages of one part must not share the bits `hashbrown` tags slots with, or nearly
    /// every probe compares keys in memory (a performance bug no answer shows).
    #[test]
    fn pages_of_one_part_keep_varied_tags() {
        let hashes = ferry_radix::events::page_hashes(
            ferry_radix::events::ROOT_HASH,
            &(0..16 * 20_000).map(|t| t as u32 * 7919 % 50_000).collect::<Vec<_>>(),
            16,
        );
        let mut tags = std::collections::HashSet::new();
        let in_part: Vec<u64> = hashes.into_iter().filter(|&h| part_of(h) == 5).collect();
        assert!(in_part.len() > 100, "{} pages in the part", in_part.len());
        for h in in_part {
            tags.insert(h >> 57);
        }
        assert!(tags.len() > 100, "{} of 128 tags in one part", tags.len());
    }
}
