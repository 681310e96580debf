//! One shard of the router's prefix index: the prefixes of up to [`SHARD_WORKERS`] prefill
//! workers (a bit each); [`super::PrefixIndex`] keeps one shard per 64 worker slots.
//!
//! A page-granular [`RadixTree`] over token ids holds every prefix some worker of the shard
//! caches. Each node is a run of pages that the same workers hold — for real (from their KV
//! events) or provisionally (the router placed a prompt there and its events have not arrived
//! yet) — and carries the chained hash of each page (the hash the workers' KV events carry,
//! `ferry_radix::events::page_hash`). A placement or an event that covers part of a node
//! splits it first, so a match reads one holder set per node, not per page, and a placement
//! of fresh tokens adds one node, not a table entry per page.
//!
//! Pages that came in a KV event are also in a table keyed by their hash: their node and
//! their index in it (a split moves the node's head into a new node and renames those pages;
//! the tail's indexes are brought up to date when next looked up), which is how a later event
//! finds its parent page without walking from the root. A worker's pages are
//! prefix-closed (a cache never holds a page without its parent), so a node nobody holds has
//! no held node below it, and is pruned with its subtree. Provisional marks lapse at their
//! deadline (a heap of node deadlines, drained by every placement and by the router's
//! housekeeping). Past `max_pages` pages, new pages are dropped (and counted) until pages are
//! removed.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::time::{Duration, Instant};

use ferry_radix::events::{ROOT_HASH, page_hashes};
use ferry_radix::{NodeId, Payload, RadixTree};

use super::IndexError;
use super::lru::{List, Lru};

/// Worker slots in one shard (a bit each).
pub const SHARD_WORKERS: usize = 64;

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
#[derive(Default)]
struct PageTable {
    parts: Vec<PageMap>,
    len: usize,
}

impl PageTable {
    const PARTS: usize = 64;

    fn part(&self, h: u64) -> Option<&PageMap> {
        self.parts.get((h >> 58) as usize)
    }

    fn part_mut(&mut self, h: u64) -> &mut PageMap {
        if self.parts.is_empty() {
            self.parts.resize_with(Self::PARTS, PageMap::default);
        }
        &mut self.parts[(h >> 58) as usize]
    }

    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, h: &u64) -> Option<&Loc> {
        self.part(*h)?.get(h)
    }

    fn get_mut(&mut self, h: &u64) -> Option<&mut Loc> {
        self.part_mut(*h).get_mut(h)
    }

    fn insert(&mut self, h: u64, loc: Loc) {
        if self.part_mut(h).insert(h, loc).is_none() {
            self.len += 1;
        }
    }

    fn remove(&mut self, h: &u64) {
        if self.part_mut(*h).remove(h).is_some() {
            self.len -= 1;
        }
    }
}

/// A node's pages and the workers that hold every one of them.
#[derive(Debug, Clone, Default)]
struct Run {
    /// The chained hash of each page, or nothing until some event covers the node (a
    /// placement adds nodes without hashing them: only the workers' events need the hashes).
    hashes: Vec<u64>,
    /// Workers whose KV events say they hold these pages.
    held: u64,
    /// Workers the router placed these pages on, neither confirmed nor lapsed: the bits of
    /// `marks`.
    provisional: u64,
    /// Each provisional worker's bit and deadline.
    marks: Vec<(u64, Instant)>,
    /// The deadline of this node's entry in the shard's expiry heap, when it has one.
    queued: Option<Instant>,
    /// Pages of this node came in a KV event: their hashes are in the page table.
    confirmed: bool,
}

impl Run {
    fn holders(&self) -> u64 {
        self.held | self.provisional
    }
}

impl Payload for Run {
    /// `self` keeps pages `..at` and moves to a new node; the lower part keeps the node's id,
    /// and with it the node's entry in the expiry heap.
    fn split_off(&mut self, at: usize) -> Self {
        Run {
            hashes: self.hashes.split_off(at.min(self.hashes.len())),
            held: self.held,
            provisional: self.provisional,
            marks: self.marks.clone(),
            queued: self.queued.take(),
            confirmed: self.confirmed,
        }
    }
}

/// Where a page that came in a KV event is: in `node`, at index `at` — or, after a split cut
/// the node's head off, at a smaller index.
#[derive(Debug, Clone, Copy)]
struct Loc {
    node: NodeId,
    at: u32,
}

/// Which of a shard's workers hold which prefixes.
pub struct Shard {
    tree: RadixTree<Run>,
    /// The pages that came in KV events, by hash.
    pages: PageTable,
    /// Pages in the tree.
    count: usize,
    /// The most pages this shard may hold now (the index sets it from its whole budget).
    pub(super) max_pages: usize,
    dropped: u64,
    evicted: u64,
    /// The nodes from the least to the most recently covered by a placement or an event.
    lru: Lru,
    /// Pages some event named are gone from the index though a worker may hold them
    /// (evicted, or dropped for want of room): a later run below one of them is expected.
    lost: bool,
    /// Workers given pages since they were last cleared (clearing the others walks nothing:
    /// a worker's first snapshot clears it).
    dirty: u64,
    /// Nodes with provisional marks, by their earliest deadline (entries a node no longer
    /// names in `Run::queued` are stale and skipped).
    expiry: BinaryHeap<Reverse<(Instant, NodeId)>>,
}

/// The bit of shard slot `worker` (`< SHARD_WORKERS`).
fn bit(worker: usize) -> Result<u64, IndexError> {
    if worker >= SHARD_WORKERS {
        return Err(IndexError::Slot(worker));
    }
    Ok(1u64 << worker)
}

impl Shard {
    /// An empty index over pages of `page_size` tokens holding at most `max_pages` pages.
    pub fn new(page_size: usize, max_pages: usize) -> Self {
        Self {
            tree: RadixTree::new(page_size.max(1)),
            pages: PageTable::default(),
            count: 0,
            max_pages,
            dropped: 0,
            evicted: 0,
            lru: Lru::default(),
            dirty: 0,
            lost: false,
            expiry: BinaryHeap::new(),
        }
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.tree.page_size()
    }

    /// Pages indexed.
    pub fn pages(&self) -> usize {
        self.count
    }

    /// New pages dropped because the index was full and nothing could be evicted.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Pages evicted (least recently used first) to make room for new ones.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Pages some worker's KV events say it holds (the rest are provisional only).
    pub fn confirmed(&self) -> usize {
        self.pages.len()
    }

    /// Where page `h` is, when some event brought it and it is still indexed: its node and
    /// its index in the node.
    fn locate(&mut self, h: u64) -> Option<(NodeId, usize)> {
        let loc = *self.pages.get(&h)?;
        let hashes = &self.tree.value(loc.node)?.hashes;
        if hashes.get(loc.at as usize) == Some(&h) {
            return Some((loc.node, loc.at as usize));
        }
        let k = hashes.iter().position(|&x| x == h)?;
        self.pages.insert(h, Loc { node: loc.node, at: k as u32 });
        Some((loc.node, k))
    }

    /// The nodes from the root (excluded) down to `id` (included).
    fn ancestors(&self, id: NodeId) -> Vec<NodeId> {
        let mut path = Vec::new();
        let mut at = Some(id).filter(|&n| n != NodeId::ROOT);
        while let Some(n) = at {
            path.push(n);
            at = self.tree.parent(n).filter(|&p| p != NodeId::ROOT);
        }
        path.reverse();
        path
    }

    /// Gives the nodes of `path` (from the root down) the hashes they lack, chained from the
    /// root; returns the hash of the path's last page.
    fn hash_path(&mut self, path: &[NodeId]) -> u64 {
        let ps = self.page_size();
        let mut prev = ROOT_HASH;
        for &id in path {
            let pages = self.tree.pages(id);
            let missing = self.tree.value(id).is_some_and(|r| r.hashes.len() != pages);
            if missing {
                let hs = page_hashes(prev, self.tree.key(id), ps);
                if let Some(r) = self.tree.value_mut(id) {
                    r.hashes = hs;
                }
            }
            prev = self.tree.value(id).and_then(|r| r.hashes.last().copied()).unwrap_or(prev);
        }
        prev
    }

    /// Gives node `id` an entry in the expiry heap at its earliest mark, unless it has one as
    /// early already.
    fn queue(&mut self, id: NodeId) {
        let Some(r) = self.tree.value_mut(id) else { return };
        let Some(first) = r.marks.iter().map(|m| m.1).min() else { return };
        if r.queued.is_none_or(|q| first < q) {
            r.queued = Some(first);
            self.expiry.push(Reverse((first, id)));
        }
    }

    /// Makes the whole pages `full`, which follow `path` (the nodes from the root down to
    /// where `full` begins, root excluded), a path of whole nodes below it and returns the
    /// whole path, marked used now: adds the pages the tree lacks — with the hashes
    /// `fresh(their number)` gives, or none yet — and splits the node where `full` ends. New
    /// pages past `max_pages` evict the least recently used ones first; when that cannot make
    /// room, they are dropped (and counted) and the path ends where the tree did.
    fn cover(&mut self, mut path: Vec<NodeId>, full: &[u32], fresh: impl FnOnce(usize) -> Vec<u64>) -> Vec<NodeId> {
        let ps = self.page_size();
        let below = path.last().copied().unwrap_or(NodeId::ROOT);
        let m = self.tree.match_from(below, 0, full);
        let new = full.len() / ps - m.tokens / ps;
        // Every node off the path can go (leaves first): evict only when that makes room.
        let on_path = path.iter().copied().chain(m.path.iter().map(|p| p.0));
        let kept: usize = on_path.clone().map(|id| self.tree.pages(id)).sum();
        if self.count + new > self.max_pages && kept + new <= self.max_pages {
            let keep: Vec<NodeId> = on_path.collect();
            self.evict(self.count + new - self.max_pages, &keep);
        }
        let take = if self.count + new <= self.max_pages {
            self.count += new;
            full.len()
        } else {
            self.dropped += new as u64;
            self.lost = true;
            m.tokens
        };
        let mut hashes = (take > m.tokens).then(|| fresh(new));
        let ins = self.tree.insert_below(below, &full[..take], &m, |_| Run {
            hashes: hashes.take().unwrap_or_default(),
            ..Run::default()
        });
        if let Some((upper, lower)) = ins.split {
            self.split_done(upper, lower);
        }
        path.extend(ins.path);
        path.extend(ins.new_node);
        self.touch(&path);
        path
    }

    /// Node `upper` was split off above `lower`: it has `lower`'s marks and place in the
    /// recency order, just newer, and its pages' entries in the table name it.
    fn split_done(&mut self, upper: NodeId, lower: NodeId) {
        if upper == lower {
            return;
        }
        self.queue(upper);
        self.lru.after(lower, upper);
        let Shard { tree, pages, .. } = self;
        if let Some(r) = tree.value(upper).filter(|r| r.confirmed) {
            for (k, h) in r.hashes.iter().enumerate() {
                if let Some(loc) = pages.get_mut(h) {
                    *loc = Loc { node: upper, at: k as u32 };
                }
            }
        }
    }

    /// Makes `path` (from the root down) the most recently used, deepest node first, so that
    /// a parent is always newer than its children.
    fn touch(&mut self, path: &[NodeId]) {
        for &id in path.iter().rev() {
            let held = self.tree.value(id).is_some_and(|r| r.held != 0);
            self.lru.touch(id, if held { List::Held } else { List::Provisional });
        }
    }

    /// Evicts leaves, least recently used first and pages only placed before pages some worker
    /// confirmed, until `need` pages are free; never a node of `keep` (the path being covered).
    fn evict(&mut self, need: usize, keep: &[NodeId]) {
        let mut freed = 0;
        for list in [List::Provisional, List::Held] {
            let mut at = self.lru.oldest(list);
            while let Some(id) = at {
                if freed >= need {
                    break;
                }
                // A parent is newer than its children: once they go it is met again, a leaf.
                at = self.lru.newer(id);
                if !keep.contains(&id) && self.tree.child_count(id) == 0 {
                    freed += self.tree.pages(id);
                    self.lost |= list == List::Held;
                    self.remove_subtree(id);
                }
            }
        }
        self.evicted += freed as u64;
    }

    /// A worker's KV event: it cached `tokens` (whole pages with `hashes`) below `parent`.
    pub fn stored(&mut self, worker: usize, parent: u64, hashes: &[u64], tokens: &[u32]) -> Result<(), IndexError> {
        let b = bit(worker)?;
        let ps = self.page_size();
        if tokens.len() != hashes.len() * ps {
            return Err(IndexError::Malformed(format!("{} tokens for {} pages of {ps}", tokens.len(), hashes.len())));
        }
        let head = if parent == ROOT_HASH {
            Vec::new()
        } else {
            let (node, k) = match self.locate(parent) {
                Some(at) => at,
                // Below a page the index gave up: dropped too (counted), not an error.
                // Resyncing the worker would send its whole cache into a full index, which
                // would evict other workers' pages, and their next runs would fail in turn.
                None if self.lost => {
                    self.dropped += hashes.len() as u64;
                    return Ok(());
                }
                None => return Err(IndexError::UnknownParent(parent)),
            };
            // The run goes below the parent page: make it end its node.
            let end = self.tree.split(node, k + 1);
            self.split_done(end, node);
            self.ancestors(end)
        };
        let from = head.len();
        // The tree's pages below the parent are the run's head, so whatever is new is the
        // run's tail.
        let path = self.cover(head, tokens, |k| hashes[hashes.len() - k.min(hashes.len())..].to_vec());
        self.hash_path(&path);
        // A worker holding a page holds its parents: mark the whole path (its head may be
        // known provisionally or through another worker).
        self.dirty |= b;
        for &id in &path {
            if let Some(r) = self.tree.value_mut(id) {
                r.held |= b;
                r.confirmed = true;
            }
        }
        self.touch(&path);
        let Shard { tree, pages, .. } = self;
        for &id in &path[from..] {
            for (k, &h) in tree.value(id).map_or(&[][..], |r| &r.hashes).iter().enumerate() {
                pages.insert(h, Loc { node: id, at: k as u32 });
            }
        }
        Ok(())
    }

    /// A worker's KV event: it evicted these pages.
    pub fn removed(&mut self, worker: usize, hashes: &[u64]) -> Result<(), IndexError> {
        let b = bit(worker)?;
        // The first page named in each node: one cut per node, whatever the event's order
        // (removing a run's pages from its end, each cut renamed every page before it).
        let mut first: HashMap<NodeId, (usize, u64)> = HashMap::new();
        for &h in hashes {
            match self.locate(h) {
                Some((node, k)) => {
                    let f = first.entry(node).or_insert((k, h));
                    if k < f.0 {
                        *f = (k, h);
                    }
                }
                // Unknown: never indexed, dropped, or gone with an ancestor.
                None => self.forget(h),
            }
        }
        for (_, (_, h)) in first {
            // Looked up again: removing an earlier node may have pruned this one.
            let Some((node, k)) = self.locate(h) else { continue };
            if self.tree.value(node).is_none_or(|r| r.held & b == 0) {
                continue; // none of the worker's
            }
            // Cut the node before page `h` (the lower part keeps the id), so that the worker's
            // bit goes from `h` down (it holds nothing below `h`).
            let upper = self.tree.split(node, k);
            self.split_done(upper, node);
            let Some(r) = self.tree.value_mut(node) else { continue };
            r.held &= !b;
            if r.holders() == 0 {
                self.remove_subtree(node);
            } else if r.held == 0 {
                // Placed only, now: its children are too (whoever holds one holds it).
                self.lru.touch(node, List::Provisional);
            }
        }
        Ok(())
    }

    /// Forgets everything `worker` holds (it resyncs, restarted, or died).
    pub fn clear_worker(&mut self, worker: usize) -> Result<(), IndexError> {
        let b = bit(worker)?;
        if self.dirty & b == 0 {
            return Ok(());
        }
        self.dirty &= !b;
        let mut gone = Vec::new();
        // Deepest first, so that parents that move lists stay newer than their children.
        for id in self.tree.walk().into_iter().rev() {
            let Some(r) = self.tree.value_mut(id) else { continue };
            let was_held = r.held != 0;
            r.held &= !b;
            if r.provisional & b != 0 {
                r.marks.retain(|m| m.0 != b);
                r.provisional &= !b;
            }
            if r.holders() == 0 {
                gone.push(id);
            } else if was_held && r.held == 0 {
                self.lru.touch(id, List::Provisional);
            }
        }
        // No node is made while pruning, so an id that is gone stays gone.
        for id in gone {
            if self.tree.contains(id) {
                self.remove_subtree(id);
            }
        }
        Ok(())
    }

    /// The router placed `prompt` on `worker` at `now`: its whole pages count as held there
    /// for `ttl` (the worker's own events confirm them sooner). Marks whose time has come are
    /// dropped first, so an index fed by placements forgets what no worker confirmed.
    pub fn provisional(
        &mut self,
        worker: usize,
        prompt: &[u32],
        now: Instant,
        ttl: Duration,
    ) -> Result<(), IndexError> {
        self.expire(now);
        let b = bit(worker)?;
        let ps = self.page_size();
        let full = &prompt[..prompt.len() / ps * ps];
        let until = now + ttl;
        self.dirty |= b;
        for id in self.cover(Vec::new(), full, |_| Vec::new()) {
            let Some(r) = self.tree.value_mut(id) else { continue };
            match r.marks.iter_mut().find(|m| m.0 == b) {
                Some(m) => m.1 = until,
                None => r.marks.push((b, until)),
            }
            r.provisional |= b;
            self.queue(id);
        }
        Ok(())
    }

    /// Drops provisional marks whose time has come.
    pub fn expire(&mut self, now: Instant) {
        while let Some(&Reverse((when, id))) = self.expiry.peek() {
            if when > now {
                break;
            }
            self.expiry.pop();
            let Some(r) = self.tree.value_mut(id).filter(|r| r.queued == Some(when)) else { continue };
            r.queued = None;
            r.marks.retain(|m| m.1 > now);
            r.provisional = r.marks.iter().fold(0, |a, m| a | m.0);
            if r.holders() == 0 {
                self.remove_subtree(id);
            } else {
                self.queue(id);
            }
        }
    }

    /// Drops page `h` from the table.
    fn forget(&mut self, h: u64) {
        self.pages.remove(&h);
    }

    fn remove_subtree(&mut self, root: NodeId) {
        let mut stack = vec![root];
        let mut order = Vec::new();
        while let Some(n) = stack.pop() {
            order.push(n);
            stack.extend(self.tree.children(n));
        }
        for n in order.into_iter().rev() {
            let pages = self.tree.pages(n);
            self.lru.unlink(n);
            if let Some(r) = self.tree.remove_leaf(n) {
                self.count -= pages;
                if r.confirmed {
                    for h in r.hashes {
                        self.forget(h);
                    }
                }
            }
        }
    }

    /// For each worker slot `0..workers`, how many tokens of `prompt` it holds (whole pages,
    /// provisional marks included).
    pub fn matched(&self, prompt: &[u32], workers: usize) -> Vec<usize> {
        let ps = self.page_size();
        let mut out = vec![0; workers.min(SHARD_WORKERS)];
        let mut set = |mut bits: u64, tokens: usize| {
            while bits != 0 {
                out[bits.trailing_zeros() as usize] = tokens;
                bits &= bits - 1;
            }
        };
        let m = self.tree.match_prefix(prompt);
        let mut alive = if workers >= SHARD_WORKERS { u64::MAX } else { (1u64 << workers) - 1 };
        let mut depth = 0;
        for &(node, pages) in &m.path {
            let holders = self.tree.value(node).map_or(0, Run::holders);
            set(alive & !holders, depth * ps);
            alive &= holders;
            if alive == 0 {
                break;
            }
            depth += pages;
        }
        set(alive, depth * ps);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const PS: usize = 4;

    fn hashes(tokens: &[u32], parent: u64) -> Vec<u64> {
        page_hashes(parent, tokens, PS)
    }

    #[test]
    fn stored_runs_chain_and_matches_are_per_worker() {
        let mut ix = Shard::new(PS, 1000);
        let a: Vec<u32> = (0..12).collect();
        let ha = hashes(&a, ROOT_HASH);
        ix.stored(0, ROOT_HASH, &ha[..2], &a[..8]).expect("stored");
        ix.stored(0, ha[1], &ha[2..], &a[8..]).expect("chained below its parent");
        ix.stored(1, ROOT_HASH, &ha[..1], &a[..4]).expect("another worker, shorter");
        assert_eq!(ix.matched(&a, 3), vec![12, 4, 0]);
        let mut b = a[..8].to_vec();
        b.extend([99, 98, 97, 96]);
        assert_eq!(ix.matched(&b, 2), vec![8, 4], "diverges after two pages");
        assert_eq!(ix.stored(0, 12345, &[1], &[1, 2, 3, 4]), Err(IndexError::UnknownParent(12345)));
        assert!(matches!(ix.stored(0, ROOT_HASH, &ha[..1], &a[..5]), Err(IndexError::Malformed(_))));
        assert_eq!(ix.pages(), 3);
    }

    /// An event finds its parent page where splits moved it: into a new parent node (the
    /// node's head), or further down the node it was in (its tail); mid-node parents split.
    #[test]
    fn events_find_their_parent_pages_after_splits() {
        let mut ix = Shard::new(PS, 1000);
        let a: Vec<u32> = (0..16).collect();
        let ha = hashes(&a, ROOT_HASH);
        ix.stored(0, ROOT_HASH, &ha, &a).expect("one node of 4 pages");
        ix.stored(1, ROOT_HASH, &ha[..2], &a[..8]).expect("worker 1 holds its head: split after page 2");
        assert_eq!(ix.tree.len(), 2);
        let b: Vec<u32> = (100..108).collect();
        let hb = hashes(&b, ha[3]);
        ix.stored(0, ha[3], &hb, &b).expect("below page 4, now page 2 of the lower node");
        let c: Vec<u32> = (200..204).collect();
        ix.stored(1, ha[1], &hashes(&c, ha[1]), &c).expect("below page 2, the end of the upper node");
        let d: Vec<u32> = (300..304).collect();
        ix.stored(2, ha[0], &hashes(&d, ha[0]), &d).expect("below page 1: splits the upper node");
        let cat = |x: &[u32], y: &[u32]| -> Vec<u32> { x.iter().chain(y).copied().collect() };
        assert_eq!(ix.matched(&cat(&a, &b), 3), vec![24, 8, 4]);
        assert_eq!(ix.matched(&cat(&a[..8], &c), 3), vec![8, 12, 4]);
        assert_eq!(ix.matched(&cat(&a[..4], &d), 3), vec![4, 4, 8]);
        ix.removed(0, &hb[1..]).expect("b's last page");
        ix.removed(0, &hb[..1]).expect("and its first");
        assert_eq!(ix.matched(&cat(&a, &b), 3), vec![16, 8, 4]);
        assert_eq!(ix.pages(), 4 + 1 + 1);
        assert_eq!(ix.stored(0, hb[0], &hb[1..], &b[4..]), Err(IndexError::UnknownParent(hb[0])), "gone");
    }

    #[test]
    fn removals_prune_what_nobody_holds() {
        let mut ix = Shard::new(PS, 1000);
        let a: Vec<u32> = (0..16).collect();
        let ha = hashes(&a, ROOT_HASH);
        ix.stored(0, ROOT_HASH, &ha, &a).expect("stored");
        ix.stored(1, ROOT_HASH, &ha[..2], &a[..8]).expect("stored");
        ix.removed(0, &ha[2..]).expect("evicted tail");
        assert_eq!(ix.pages(), 2, "pages 3 and 4 were only worker 0's");
        assert_eq!(ix.matched(&a, 2), vec![8, 8]);
        ix.clear_worker(1).expect("cleared");
        assert_eq!(ix.matched(&a, 2), vec![8, 0]);
        ix.removed(0, &ha[..2]).expect("evicted");
        assert_eq!(ix.pages(), 0);
        assert!(ix.tree.is_empty() || ix.tree.len() <= 1, "only the root is left");
    }

    #[test]
    fn provisional_marks_count_until_they_expire_or_are_confirmed() {
        let t0 = Instant::now();
        let mut ix = Shard::new(PS, 1000);
        let p: Vec<u32> = (100..110).collect();
        ix.provisional(2, &p, t0, Duration::from_secs(1)).expect("placed");
        assert_eq!(ix.matched(&p, 3), vec![0, 0, 8], "two whole pages");
        let hp = hashes(&p[..8], ROOT_HASH);
        ix.stored(1, ROOT_HASH, &hp[..1], &p[..4]).expect("another worker caches one page");
        ix.expire(t0 + Duration::from_secs(1));
        assert_eq!(ix.matched(&p, 3), vec![0, 4, 0]);
        assert_eq!(ix.pages(), 1, "the unconfirmed second page is gone");
    }

    /// Issue 17: nothing but a unit test called `expire`, so provisional marks never lapsed.
    /// Placements now expire what is due before they mark.
    #[test]
    fn placements_forget_marks_no_worker_confirmed() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(10);
        let mut ix = Shard::new(PS, 1000);
        let a: Vec<u32> = (100..112).collect();
        let b: Vec<u32> = (200..212).collect();
        ix.provisional(0, &a, t0, ttl).expect("placed");
        ix.provisional(1, &b, t0 + ttl / 2, ttl).expect("placed");
        assert_eq!((ix.matched(&a, 2), ix.pages()), (vec![12, 0], 6));
        ix.provisional(1, &b, t0 + ttl, ttl).expect("placed again");
        assert_eq!(ix.matched(&a, 2), vec![0, 0], "a's marks lapsed");
        assert_eq!(ix.matched(&b, 2), vec![0, 12], "b's were renewed");
        assert_eq!(ix.pages(), 3);
    }

    /// A placement hashes only the pages the tree lacks, chained from the last known one: the
    /// hashes must be those the worker's events will carry (computed from the root), or its
    /// confirmation would add a second copy of every page.
    #[test]
    fn placements_below_known_pages_hash_as_the_workers_do() {
        let t0 = Instant::now();
        let mut ix = Shard::new(PS, 1000);
        let p: Vec<u32> = (0..24).collect();
        let hp = hashes(&p, ROOT_HASH);
        ix.stored(0, ROOT_HASH, &hp[..2], &p[..8]).expect("a known prefix");
        ix.provisional(1, &p, t0, Duration::from_secs(5)).expect("placed below it");
        assert_eq!((ix.pages(), ix.matched(&p, 2)), (6, vec![8, 24]));
        ix.stored(1, hp[1], &hp[2..], &p[8..]).expect("worker 1 confirms");
        assert_eq!(ix.pages(), 6, "the same pages, not new ones");
        ix.expire(t0 + Duration::from_secs(5));
        assert_eq!(ix.matched(&p, 2), vec![8, 24], "confirmed: held, not provisional");
    }

    /// Issue 17: a full index dropped new pages, so placement quality decayed with uptime. It
    /// now evicts: pages only placed before pages a worker confirmed, least recently used first.
    #[test]
    fn a_full_index_evicts_the_least_recently_used_placements_first() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(60);
        let mut ix = Shard::new(PS, 5);
        let a: Vec<u32> = (0..4).collect();
        ix.stored(0, ROOT_HASH, &hashes(&a, ROOT_HASH), &a).expect("confirmed");
        let [b, c, d, e]: [Vec<u32>; 4] = [100, 200, 300, 400].map(|x| (x..x + 8).collect());
        ix.provisional(1, &b, t0, ttl).expect("placed");
        ix.provisional(1, &c, t0, ttl).expect("placed");
        assert_eq!(ix.pages(), 5, "full");
        ix.provisional(1, &b, t0, ttl).expect("b used again");
        ix.provisional(2, &d, t0, ttl).expect("placed: c goes, the least recently used");
        assert_eq!(
            (ix.matched(&c, 3), ix.matched(&b, 3), ix.matched(&d, 3)),
            (vec![0; 3], vec![0, 8, 0], vec![0, 0, 8])
        );
        assert_eq!((ix.pages(), ix.evicted(), ix.dropped()), (5, 2, 0));
        ix.provisional(2, &e, t0, ttl).expect("placed: b goes");
        ix.provisional(2, &b, t0, ttl).expect("placed again: d goes, the confirmed page stays");
        assert_eq!(ix.matched(&a, 3), vec![4, 0, 0]);
        assert_eq!(
            (ix.matched(&d, 3), ix.matched(&e, 3), ix.matched(&b, 3)),
            (vec![0; 3], vec![0, 0, 8], vec![0, 0, 8])
        );
        assert_eq!((ix.pages(), ix.evicted(), ix.dropped()), (5, 6, 0));
        let long: Vec<u32> = (1000..1024).collect();
        ix.provisional(1, &long, t0, ttl).expect("six pages never fit five: dropped, counted");
        assert_eq!((ix.dropped(), ix.matched(&long, 3)), (6, vec![0; 3]));
        assert_eq!((ix.pages(), ix.evicted()), (5, 6), "nothing was evicted for pages that could not fit");
        check_order(&ix);
    }

    /// The recency lists hold every node once, in the list its holders say, each node older
    /// than its parent when both are in one list; the page count is the tree's.
    fn check_order(ix: &Shard) {
        let mut seen = std::collections::HashMap::new();
        for list in [List::Provisional, List::Held] {
            let mut at = ix.lru.oldest(list);
            let mut rank = 0;
            while let Some(id) = at {
                let r = ix.tree.value(id).expect("a listed node is alive");
                assert_eq!(ix.lru.list(id), Some(list));
                assert_eq!(r.held != 0, list == List::Held, "node {id:?} is in the list of its holders");
                assert!(seen.insert(id, (list, rank)).is_none(), "listed once");
                rank += 1;
                at = ix.lru.newer(id);
            }
        }
        let nodes = ix.tree.walk();
        assert_eq!(seen.len(), nodes.len(), "every node is listed");
        for &id in &nodes {
            if let Some(p) = ix.tree.parent(id).filter(|&p| p != NodeId::ROOT) {
                let (child, parent) = (seen[&id], seen[&p]);
                assert!(child.0 != parent.0 || child.1 < parent.1, "a parent is newer than its children");
            }
        }
        assert_eq!(nodes.iter().map(|&id| ix.tree.pages(id)).sum::<usize>(), ix.pages());
    }

    /// Random placements, events (each worker's pages prefix-closed, evicted leaf first, as a
    /// cache's are), expiries and resyncs over a small alphabet (so paths share and split)
    /// into a shard too small for them: the recency order stays whole and the bound holds.
    #[test]
    fn the_recency_order_survives_random_traffic() {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let t0 = Instant::now();
        let mut ix = Shard::new(PS, 40);
        // Each worker's cached prefixes, whole pages.
        let mut held: Vec<std::collections::BTreeSet<Vec<u32>>> = vec![Default::default(); 3];
        for step in 0..3000u64 {
            let w = next(3) as usize;
            let pages = 1 + next(6) as usize;
            let t: Vec<u32> = (0..pages * PS).map(|_| next(2) as u32).collect();
            let now = t0 + Duration::from_millis(step);
            match next(6) {
                0 | 1 => ix.provisional(w, &t, now, Duration::from_millis(50)).expect("placed"),
                2 | 3 => {
                    ix.stored(w, ROOT_HASH, &hashes(&t, ROOT_HASH), &t).expect("stored");
                    held[w].extend((1..=pages).map(|k| t[..k * PS].to_vec()));
                }
                4 => {
                    let leaves: Vec<&Vec<u32>> = held[w]
                        .iter()
                        .filter(|p| !held[w].iter().any(|q| q.len() > p.len() && q.starts_with(p)))
                        .collect();
                    if !leaves.is_empty() {
                        let leaf = leaves[next(leaves.len() as u64) as usize].clone();
                        let last = *hashes(&leaf, ROOT_HASH).last().expect("a page");
                        ix.removed(w, &[last]).expect("removed");
                        held[w].remove(&leaf);
                    }
                }
                _ => {
                    if next(8) == 0 {
                        ix.clear_worker(w).expect("cleared");
                        held[w].clear();
                    } else {
                        ix.expire(now);
                    }
                }
            }
            assert!(ix.pages() <= 40);
            check_order(&ix);
        }
        assert!(ix.evicted() > 0, "the traffic overflowed the shard");
    }

    /// A run's pages removed from its end, one by one in one event, while another worker
    /// still holds them: one cut, not one per page (each cut renamed every page before it).
    #[test]
    fn removing_a_run_from_its_end_cuts_its_node_once() {
        let mut ix = Shard::new(PS, 1000);
        let a: Vec<u32> = (0..64 * PS as u32).collect();
        let ha = hashes(&a, ROOT_HASH);
        ix.stored(0, ROOT_HASH, &ha, &a).expect("stored");
        ix.stored(1, ROOT_HASH, &ha, &a).expect("stored");
        let backwards: Vec<u64> = ha[8..].iter().rev().copied().collect();
        ix.removed(0, &backwards).expect("removed");
        assert_eq!(ix.tree.len(), 2, "cut once, after page 8");
        assert_eq!(ix.matched(&a, 2), vec![8 * PS, 64 * PS]);
        ix.removed(0, &ha[..8]).expect("removed");
        assert_eq!((ix.tree.len(), ix.matched(&a, 2)), (2, vec![0, 64 * PS]), "none of worker 0's left");
    }

    /// Once the index evicted pages a worker holds, that worker's next run below one of them
    /// is dropped (counted), not refused: refusing made the worker resync its whole cache into
    /// the full index, evicting other workers' pages in turn.
    #[test]
    fn a_run_below_an_evicted_page_is_dropped_not_refused() {
        let t0 = Instant::now();
        let mut ix = Shard::new(PS, 2);
        let a: Vec<u32> = (0..4).collect();
        let ha = hashes(&a, ROOT_HASH);
        ix.stored(0, ROOT_HASH, &ha, &a).expect("stored");
        let b: Vec<u32> = (100..108).collect();
        ix.provisional(1, &b, t0, Duration::from_secs(5)).expect("placed: evicts a, the only page");
        assert_eq!((ix.matched(&a, 2), ix.evicted()), (vec![0, 0], 1));
        let a2: Vec<u32> = (4..8).collect();
        ix.stored(0, ha[0], &hashes(&a2, ha[0]), &a2).expect("dropped, not an error");
        assert_eq!((ix.dropped(), ix.pages()), (1, 2));
        let mut fresh = Shard::new(PS, 100);
        let e = fresh.stored(0, ha[0], &hashes(&a2, ha[0]), &a2);
        assert_eq!(e, Err(IndexError::UnknownParent(ha[0])), "an index that lost nothing still refuses a gap");
    }

    #[test]
    fn a_full_index_drops_new_pages_and_counts_them() {
        let mut ix = Shard::new(PS, 2);
        let a: Vec<u32> = (0..12).collect();
        let ha = hashes(&a, ROOT_HASH);
        ix.stored(0, ROOT_HASH, &ha[..2], &a[..8]).expect("fits");
        ix.stored(0, ha[1], &ha[2..], &a[8..]).expect("dropped, not an error");
        assert_eq!((ix.pages(), ix.dropped()), (2, 1));
        assert!(matches!(ix.stored(64, ROOT_HASH, &ha[..1], &a[..4]), Err(IndexError::Slot(64))));
    }
}
