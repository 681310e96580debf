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
//! housekeeping). Past `max_pages` pages a shard evicts leaves, least recently used first
//! ([`super::lru`]), and drops (and counts) only new pages that cannot fit even then.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::time::{Duration, Instant};

use ferry_radix::events::{ROOT_HASH, page_hash};
use ferry_radix::{NodeId, Payload, RadixTree};

use super::IndexError;
use super::lru::{List, Lru};
use super::table::{Loc, Mode, PageTable, Trace};

/// Worker slots in one shard (a bit each).
pub const SHARD_WORKERS: usize = 64;

/// The most tokens in one chunk of a node's key ([`RadixTree::with_chunks`]): the whole
/// chunks of an evicted long node then fit the long parts of new ones, whatever their lengths.
#[cfg(not(test))]
const KEY_CHUNK: usize = 2048;
/// Unit tests use pages of 4 tokens and short prompts: chunks of two pages, so that their
/// matches, splits and evictions cross chunks.
#[cfg(test)]
const KEY_CHUNK: usize = 8;

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

/// Which of a shard's workers hold which prefixes.
pub struct Shard {
    tree: RadixTree<Run>,
    /// The pages that came in KV events, by hash (empty in a copy of the shared events'
    /// index, which is lent the writer's one table for each change: `mode`).
    pages: PageTable,
    /// Whose table this shard looks pages up in, now.
    mode: Mode,
    /// The lookups of the change being made, when it is traced or made again from a trace.
    trace: Trace,
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
            tree: RadixTree::with_chunks(page_size.max(1), KEY_CHUNK),
            pages: PageTable::default(),
            mode: Mode::Own,
            trace: Trace::default(),
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

    /// Makes a change (`f`) with `table` as the page table, pushing what each lookup found to
    /// `trace`: the first copy of the shared events' index to make it.
    pub(super) fn recording<R>(
        &mut self,
        table: &mut PageTable,
        trace: &mut Trace,
        f: impl FnOnce(&mut Self) -> R,
    ) -> R {
        let lent = lent::Lent::new(self, Mode::Record, Some(table), trace);
        f(lent.shard)
    }

    /// Makes a change (`f`) again, as [`Self::recording`] made it in the other copy from the
    /// same state: lookups answer from `trace`, in order, and no table changes.
    pub(super) fn replaying<R>(&mut self, trace: &mut Trace, f: impl FnOnce(&mut Self) -> R) -> R {
        let lent = lent::Lent::new(self, Mode::Replay, None, trace);
        f(lent.shard)
    }

    /// Where page `h` is, when some event brought it and it is still indexed: its node and
    /// its index in the node.
    fn locate(&mut self, h: u64) -> Option<(NodeId, usize)> {
        match self.mode {
            Mode::Own => self.lookup(h),
            Mode::Record => {
                let found = self.lookup(h);
                self.trace.push(found);
                found
            }
            Mode::Replay => self.trace.pop(),
        }
    }

    /// [`Self::locate`] in the table.
    fn lookup(&mut self, h: u64) -> Option<(NodeId, usize)> {
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
    /// root.
    fn hash_path(&mut self, path: &[NodeId]) {
        let ps = self.page_size();
        let mut prev = ROOT_HASH;
        for &id in path {
            let pages = self.tree.pages(id);
            let missing = self.tree.value(id).is_some_and(|r| r.hashes.len() != pages);
            if missing {
                let mut hs = Vec::with_capacity(pages);
                let mut h = prev;
                for page in self.tree.key_chunks(id).flat_map(|c| c.chunks_exact(ps)) {
                    h = page_hash(h, page);
                    hs.push(h);
                }
                if let Some(r) = self.tree.value_mut(id) {
                    r.hashes = hs;
                }
            }
            prev = self.tree.value(id).and_then(|r| r.hashes.last().copied()).unwrap_or(prev);
        }
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
        if self.mode == Mode::Replay {
            return;
        }
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
        if self.mode == Mode::Replay {
            return Ok(());
        }
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
        // In node order, not a hash map's: the router keeps two copies of its events' index,
        // which must make the same cuts in the same order (`super::published`).
        let mut first: BTreeMap<NodeId, (usize, u64)> = BTreeMap::new();
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

    /// For each worker slot `0..workers`, how many tokens of `prompt` it holds (whole pages,
    /// provisional marks included).
    #[cfg(test)]
    pub fn matched(&self, prompt: &[u32], workers: usize) -> Vec<usize> {
        let mut out = vec![0; workers.min(SHARD_WORKERS)];
        self.matched_into(prompt, &mut out);
        out
    }

    /// [`Self::matched`] into `out` (one entry per slot, at most [`SHARD_WORKERS`]): each
    /// entry becomes the larger of what it held and the slot's match. A slot whose workers
    /// hold nothing of the prompt is not written, so a shard holding nothing of it costs one
    /// lookup at its root.
    pub fn matched_into(&self, prompt: &[u32], out: &mut [usize]) {
        let ps = self.page_size();
        let workers = out.len().min(SHARD_WORKERS);
        let mut set = |mut bits: u64, tokens: usize| {
            if tokens == 0 {
                return;
            }
            while bits != 0 {
                let o = &mut out[bits.trailing_zeros() as usize];
                *o = (*o).max(tokens);
                bits &= bits - 1;
            }
        };
        let mut alive = if workers >= SHARD_WORKERS { u64::MAX } else { (1u64 << workers) - 1 };
        let mut depth = 0;
        for (node, pages) in self.tree.walk_prefix(prompt) {
            let holders = self.tree.value(node).map_or(0, Run::holders);
            set(alive & !holders, depth * ps);
            alive &= holders;
            if alive == 0 {
                return;
            }
            depth += pages;
        }
        set(alive, depth * ps);
    }
}

mod evict;
mod lent;
#[cfg(test)]
mod tests;
