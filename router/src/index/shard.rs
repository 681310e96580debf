//! One shard of the router's prefix index: the prefixes of up to [`SHARD_WORKERS`] prefill
//! workers (a bit each); [`super::PrefixIndex`] keeps one shard per 64 worker slots.
//!
//! A page-granular [`RadixTree`] over token ids holds every prefix some worker of the shard
//! caches; each node's payload is the chained hash of each of its pages (the same hash the
//! workers' KV events carry, `ferry_radix::events::page_hash`). A side table keyed by page hash
//! records, per page, its parent, its tokens, and which workers hold it — for real (from their
//! KV events) or provisionally (the router placed a prompt there and its events have not
//! arrived yet). A worker's pages are prefix-closed (a cache never holds a page without its
//! parent), so a page nobody holds has no held page below it, and is pruned with its subtree.
//! Past `max_pages` pages, new pages are dropped (and counted) until pages are removed.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::time::{Duration, Instant};

use ferry_radix::events::{ROOT_HASH, page_hashes};
use ferry_radix::{NodeId, Payload, RadixTree};

use super::IndexError;

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

type PageMap = HashMap<u64, Page, BuildHasherDefault<PageHasher>>;

#[derive(Debug, Clone, Default)]
struct Hashes(Vec<u64>);

impl Payload for Hashes {
    fn split_off(&mut self, at: usize) -> Self {
        Self(self.0.split_off(at.min(self.0.len())))
    }
}

struct Page {
    parent: u64,
    /// Where its tokens are in the shard's [`Slab`].
    slot: u32,
    held: u64,
    provisional: u64,
}

/// Every page's tokens in one buffer of fixed-size slots, reused as pages come and go: adding
/// a page allocates nothing once the buffer has grown (a boxed slice per page was a third of
/// a placement's time in the allocator).
#[derive(Default)]
struct Slab {
    tokens: Vec<u32>,
    free: Vec<u32>,
}

impl Slab {
    fn put(&mut self, page: &[u32]) -> u32 {
        match self.free.pop() {
            Some(s) => {
                let at = s as usize * page.len();
                self.tokens[at..at + page.len()].copy_from_slice(page);
                s
            }
            None => {
                let s = (self.tokens.len() / page.len().max(1)) as u32;
                self.tokens.extend_from_slice(page);
                s
            }
        }
    }

    fn get(&self, slot: u32, ps: usize) -> &[u32] {
        &self.tokens[slot as usize * ps..(slot as usize + 1) * ps]
    }
}

/// Which of a shard's workers hold which prefixes.
pub struct Shard {
    tree: RadixTree<Hashes>,
    pages: PageMap,
    slab: Slab,
    /// The most pages this shard may hold now (the index sets it from its whole budget).
    pub(super) max_pages: usize,
    dropped: u64,
    /// Provisional marks to expire: (deadline, page, worker bit).
    expiry: VecDeque<(Instant, u64, u64)>,
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
            pages: PageMap::default(),
            slab: Slab::default(),
            max_pages,
            dropped: 0,
            expiry: VecDeque::new(),
        }
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.tree.page_size()
    }

    /// Pages indexed.
    pub fn pages(&self) -> usize {
        self.pages.len()
    }

    /// Stored pages dropped because the index was full.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// The tokens from the root to the end of page `hash` (None when unknown, or when the
    /// parent links loop: events are a worker's word, so a malformed stream could make one).
    fn path_of(&self, hash: u64) -> Option<Vec<u32>> {
        let mut chain = Vec::new();
        let mut h = hash;
        while h != ROOT_HASH {
            let p = self.pages.get(&h)?;
            if chain.len() > self.pages.len() {
                return None;
            }
            chain.push(self.slab.get(p.slot, self.page_size()));
            h = p.parent;
        }
        Some(chain.into_iter().rev().flat_map(|t| t.iter().copied()).collect())
    }

    /// Adds the pages of `tokens` (whole pages, hashes chained from `parent`) to the tree and
    /// the table; returns their hashes. Marks nothing.
    fn add_path(&mut self, prefix: &[u32], tokens: &[u32], hashes: &[u64]) -> Result<(), IndexError> {
        let ps = self.page_size();
        if tokens.len() != hashes.len() * ps {
            return Err(IndexError::Malformed(format!("{} tokens for {} pages of {ps}", tokens.len(), hashes.len())));
        }
        let mut full = prefix.to_vec();
        full.extend_from_slice(tokens);
        // The hashes of every page on the path, for the payload of whatever node is new.
        let mut all = page_hashes(ROOT_HASH, prefix, ps);
        all.extend_from_slice(hashes);
        self.add_pages(&full, &all, prefix.len() / ps);
        Ok(())
    }

    /// Adds the whole pages of `full` (hashes `all`, one per page) from page `from` on to the
    /// tree and the table, unless that would pass `max_pages` (then they are dropped and
    /// counted). Marks nothing.
    fn add_pages(&mut self, full: &[u32], all: &[u64], from: usize) {
        let ps = self.page_size();
        let new = all[from..].iter().filter(|h| !self.pages.contains_key(h)).count();
        if new == 0 {
            return;
        }
        if self.pages.len() + new > self.max_pages {
            self.dropped += new as u64;
            return;
        }
        self.tree.insert(full, |existing| Hashes(all[existing..].to_vec()));
        let mut up = if from == 0 { ROOT_HASH } else { all[from - 1] };
        for (h, page) in all[from..].iter().zip(full[from * ps..].chunks_exact(ps)) {
            if !self.pages.contains_key(h) {
                let slot = self.slab.put(page);
                self.pages.insert(*h, Page { parent: up, slot, held: 0, provisional: 0 });
            }
            up = *h;
        }
    }

    /// The hashes of the leading whole pages of `tokens` the tree holds, in order (read from
    /// the tree's nodes, not computed).
    fn known_hashes(&self, tokens: &[u32]) -> Vec<u64> {
        let m = self.tree.match_prefix(tokens);
        let mut out = Vec::with_capacity(tokens.len() / self.page_size());
        for &(node, pages) in &m.path {
            match self.tree.value(node) {
                Some(Hashes(hs)) => out.extend(hs.iter().take(pages)),
                None => break,
            }
        }
        out
    }

    /// A worker's KV event: it cached `tokens` (whole pages with `hashes`) below `parent`.
    pub fn stored(&mut self, worker: usize, parent: u64, hashes: &[u64], tokens: &[u32]) -> Result<(), IndexError> {
        let b = bit(worker)?;
        let prefix = if parent == ROOT_HASH {
            Vec::new()
        } else {
            self.path_of(parent).ok_or(IndexError::UnknownParent(parent))?
        };
        self.add_path(&prefix, tokens, hashes)?;
        let mut h = parent;
        while h != ROOT_HASH {
            // A worker holding a page holds its parents: mark them too (they may be known only
            // provisionally or through another worker).
            match self.pages.get_mut(&h) {
                Some(p) if p.held & b == 0 => {
                    p.held |= b;
                    h = p.parent;
                }
                _ => break,
            }
        }
        for hash in hashes {
            if let Some(p) = self.pages.get_mut(hash) {
                p.held |= b;
            }
        }
        Ok(())
    }

    /// A worker's KV event: it evicted these pages.
    pub fn removed(&mut self, worker: usize, hashes: &[u64]) -> Result<(), IndexError> {
        let b = bit(worker)?;
        let mut gone = Vec::new();
        for h in hashes {
            if let Some(p) = self.pages.get_mut(h) {
                p.held &= !b;
                if p.held | p.provisional == 0 {
                    gone.push(*h);
                }
            }
        }
        self.prune(gone);
        Ok(())
    }

    /// Forgets everything `worker` holds (it resyncs, restarted, or died).
    pub fn clear_worker(&mut self, worker: usize) -> Result<(), IndexError> {
        let b = bit(worker)?;
        let mut gone = Vec::new();
        for (h, p) in &mut self.pages {
            p.held &= !b;
            p.provisional &= !b;
            if p.held | p.provisional == 0 {
                gone.push(*h);
            }
        }
        self.prune(gone);
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
        let until = now + ttl;
        let b = bit(worker)?;
        let ps = self.page_size();
        let full = &prompt[..prompt.len() / ps * ps];
        // Pages the tree has keep their hashes; only the rest are hashed, chained on.
        let mut hashes = self.known_hashes(full);
        let known = hashes.len();
        for h in &hashes {
            if let Some(p) = self.pages.get_mut(h)
                && p.provisional & b == 0
            {
                p.provisional |= b;
                self.expiry.push_back((until, *h, b));
            }
        }
        let fresh = full.len() / ps - known;
        if fresh == 0 {
            return Ok(());
        }
        if self.pages.len() + fresh > self.max_pages {
            self.dropped += fresh as u64;
            return Ok(());
        }
        let mut up = hashes.last().copied().unwrap_or(ROOT_HASH);
        hashes.extend(page_hashes(up, &full[known * ps..], ps));
        self.tree.insert(full, |existing| Hashes(hashes[existing..].to_vec()));
        // Past the tree's match no page of this path is known (the table and the tree hold
        // the same pages): each is one insert, marked at once.
        for (&h, page) in hashes[known..].iter().zip(full[known * ps..].chunks_exact(ps)) {
            let slot = self.slab.put(page);
            self.pages.insert(h, Page { parent: up, slot, held: 0, provisional: b });
            self.expiry.push_back((until, h, b));
            up = h;
        }
        Ok(())
    }

    /// Drops provisional marks whose time has come.
    pub fn expire(&mut self, now: Instant) {
        let mut gone = Vec::new();
        while let Some(&(when, h, b)) = self.expiry.front() {
            if when > now {
                break;
            }
            self.expiry.pop_front();
            if let Some(p) = self.pages.get_mut(&h) {
                p.provisional &= !b;
                if p.held | p.provisional == 0 {
                    gone.push(h);
                }
            }
        }
        self.prune(gone);
    }

    /// Removes pages nobody holds, with everything below them.
    fn prune(&mut self, gone: Vec<u64>) {
        for h in gone {
            if !self.pages.contains_key(&h) {
                continue; // already removed with an ancestor
            }
            let Some(path) = self.path_of(h) else { continue };
            let m = self.tree.match_prefix(&path);
            if m.tokens != path.len() {
                self.forget(h);
                continue;
            }
            let Some(&(node, matched)) = m.path.last() else { continue };
            // The page is the `matched`-th page of `node`: cut the node before it (the lower
            // part keeps the id) and drop that part with everything below.
            if matched > 1 {
                self.tree.split(node, matched - 1);
            }
            self.remove_subtree(node);
        }
    }

    /// Drops page `h` from the table, its slot to be reused.
    fn forget(&mut self, h: u64) {
        if let Some(p) = self.pages.remove(&h) {
            self.slab.free.push(p.slot);
        }
    }

    fn remove_subtree(&mut self, root: NodeId) {
        let mut stack = vec![root];
        let mut order = Vec::new();
        while let Some(n) = stack.pop() {
            order.push(n);
            stack.extend(self.tree.children(n));
        }
        for n in order.into_iter().rev() {
            if let Some(Hashes(hs)) = self.tree.remove_leaf(n) {
                for h in hs {
                    self.forget(h);
                }
            }
        }
    }

    /// For each worker slot `0..workers`, how many tokens of `prompt` it holds (whole pages,
    /// provisional marks included).
    pub fn matched(&self, prompt: &[u32], workers: usize) -> Vec<usize> {
        let ps = self.page_size();
        let mut out = vec![0; workers.min(SHARD_WORKERS)];
        let m = self.tree.match_prefix(prompt);
        let mut alive = if out.len() == SHARD_WORKERS { u64::MAX } else { (1u64 << out.len()) - 1 };
        let mut depth = 0;
        'path: for &(node, pages) in &m.path {
            let Some(Hashes(hs)) = self.tree.value(node) else { break };
            for h in hs.iter().take(pages) {
                let holders = self.pages.get(h).map_or(0, |p| p.held | p.provisional);
                alive &= holders;
                if alive == 0 {
                    break 'path;
                }
                depth += 1;
                let mut a = alive;
                while a != 0 {
                    let w = a.trailing_zeros() as usize;
                    if w < out.len() {
                        out[w] = depth * ps;
                    }
                    a &= a - 1;
                }
            }
        }
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

    /// Pages' tokens live in reused slots: a page added after others were removed takes their
    /// slot, and a run chained below it still finds its path (the tokens, not the old ones).
    #[test]
    fn reused_token_slots_hold_the_new_pages_tokens() {
        let mut ix = Shard::new(PS, 1000);
        let a: Vec<u32> = (0..8).collect();
        let ha = hashes(&a, ROOT_HASH);
        ix.stored(0, ROOT_HASH, &ha, &a).expect("stored");
        ix.removed(0, &ha).expect("evicted");
        assert_eq!((ix.pages(), ix.slab.free.len()), (0, 2), "both slots free");
        let b: Vec<u32> = (100..112).collect();
        let hb = hashes(&b, ROOT_HASH);
        ix.stored(1, ROOT_HASH, &hb[..2], &b[..8]).expect("takes the freed slots");
        assert!(ix.slab.free.is_empty());
        ix.stored(1, hb[1], &hb[2..], &b[8..]).expect("its parent's path is b's, from the reused slots");
        assert_eq!(ix.matched(&b, 2), vec![0, 12]);
        assert_eq!(ix.matched(&a, 2), vec![0, 0]);
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
