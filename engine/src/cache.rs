//! The prefix cache: a radix tree over token ids whose nodes own KV pages of the pool.
//!
//! Pages are in exactly one of three places: the pool's free list, a cache node, or a
//! request's own [`PageAlloc`]. A node's pages are **protected** while any request's matched
//! path includes the node (`lock_ref > 0`) and **evictable** otherwise, so
//! `evictable + protected = cached` always. Eviction pops leaves from a priority heap (lower
//! request priority first, then least recently used); removing a leaf makes its parent a
//! candidate when that parent is left childless and unlocked (cascade). A locked node is never
//! evicted, however great the pressure. Dropping an evicted node's payload returns its pages
//! to the pool, so nothing can leak.
//!
//! The cache records KV events (stored / removed pages with chained hashes, a sequence number
//! and an epoch) and the nodes whose neighbourhood changed, for the scheduler's incremental
//! matching.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use ferry_kernels::Backend;
use ferry_radix::events::{EventKind, KvEvent, ROOT_HASH, Stored, page_hashes};
use ferry_radix::{NodeId, Payload, RadixTree};

use crate::EngineError;
use crate::pool::{PageAlloc, PagePool};

/// What a cache node holds.
#[derive(Debug)]
pub struct CacheEntry {
    pages: PageAlloc,
    hashes: Vec<u64>,
    lock_ref: u32,
    last_access: u64,
    priority: i32,
    /// Identifies this node's current heap entry; older entries are stale.
    heap_gen: u64,
}

impl Payload for CacheEntry {
    fn split_off(&mut self, at: usize) -> Self {
        CacheEntry {
            pages: self.pages.split_off(at),
            hashes: self.hashes.split_off(at.min(self.hashes.len())),
            lock_ref: self.lock_ref,
            last_access: self.last_access,
            priority: self.priority,
            heap_gen: self.heap_gen,
        }
    }
}

/// A prompt's cached prefix, ending on a node boundary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheMatch {
    /// The deepest matched node ([`NodeId::ROOT`] when nothing matched).
    pub node: NodeId,
    /// Tokens matched (whole pages).
    pub tokens: usize,
    /// The matched pages, in prompt order.
    pub pages: Vec<u32>,
}

/// A place in the tree where matches may have changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dirty {
    /// The node was split or evicted: every match ending at it may change.
    Node(NodeId),
    /// A child starting with this page was added below the node: matches ending at the node
    /// whose next page is this one may grow.
    Child(NodeId, Box<[u32]>),
}

type HeapKey = Reverse<(i32, u64, u64, NodeId)>;

/// The radix prefix cache of a prefill node.
pub struct RadixCache {
    tree: RadixTree<CacheEntry>,
    evictable: usize,
    protected: usize,
    heap: BinaryHeap<HeapKey>,
    clock: u64,
    next_gen: u64,
    epoch: u64,
    sequence: u64,
    events: Vec<KvEvent>,
    dirty: Vec<Dirty>,
}

impl std::fmt::Debug for RadixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RadixCache").field("evictable", &self.evictable).field("protected", &self.protected).finish()
    }
}

impl RadixCache {
    /// An empty cache of `page_size`-token pages. `epoch` must differ between restarts.
    pub fn new(page_size: usize, epoch: u64) -> Self {
        Self {
            tree: RadixTree::new(page_size),
            evictable: 0,
            protected: 0,
            heap: BinaryHeap::new(),
            clock: 0,
            next_gen: 0,
            epoch,
            sequence: 0,
            events: Vec::new(),
            dirty: Vec::new(),
        }
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.tree.page_size()
    }

    /// Cached pages that no request uses.
    pub fn evictable_pages(&self) -> usize {
        self.evictable
    }

    /// Cached pages on some request's matched path.
    pub fn protected_pages(&self) -> usize {
        self.protected
    }

    /// All cached pages.
    pub fn cached_pages(&self) -> usize {
        self.evictable + self.protected
    }

    /// The tree, for reading.
    pub fn tree(&self) -> &RadixTree<CacheEntry> {
        &self.tree
    }

    /// Lock count of a node (0 for the root and dead ids).
    pub fn lock_ref(&self, node: NodeId) -> u32 {
        self.tree.value(node).map_or(0, |e| e.lock_ref)
    }

    /// Pages of a node.
    pub fn node_pages(&self, node: NodeId) -> &[u32] {
        self.tree.value(node).map_or(&[], |e| e.pages.pages())
    }

    /// Cached tokens of `tokens`, without changing anything.
    pub fn peek(&self, tokens: &[u32]) -> usize {
        self.tree.match_prefix(tokens).tokens
    }

    /// Matches `tokens`, splitting the last node so the match ends on a node boundary, and
    /// marks the path as recently used. Lock the returned node to keep the pages.
    pub fn match_prefix(&mut self, tokens: &[u32]) -> CacheMatch {
        self.clock += 1;
        let m = self.tree.match_prefix(tokens);
        let mut node = NodeId::ROOT;
        if let Some(&(last, pages)) = m.path.last() {
            node = if pages < self.tree.pages(last) {
                self.dirty.push(Dirty::Node(last));
                self.tree.split(last, pages)
            } else {
                last
            };
        }
        let mut path = Vec::new();
        let mut cur = node;
        while cur != NodeId::ROOT {
            path.push(cur);
            cur = self.tree.parent(cur).unwrap_or(NodeId::ROOT);
        }
        let mut pages = Vec::with_capacity(m.tokens / self.page_size());
        for &n in path.iter().rev() {
            if let Some(e) = self.tree.value_mut(n) {
                e.last_access = self.clock;
                pages.extend_from_slice(e.pages.pages());
            }
        }
        if self.tree.child_count(node) == 0 && self.lock_ref(node) == 0 {
            self.push_candidate(node);
        }
        CacheMatch { node, tokens: m.tokens, pages }
    }

    fn for_path(&mut self, node: NodeId, mut f: impl FnMut(&mut CacheEntry, &mut usize, &mut usize)) {
        let mut cur = node;
        while cur != NodeId::ROOT {
            let parent = self.tree.parent(cur).unwrap_or(NodeId::ROOT);
            if let Some(e) = self.tree.value_mut(cur) {
                f(e, &mut self.evictable, &mut self.protected);
            }
            cur = parent;
        }
    }

    /// Protects `node` and its ancestors from eviction.
    pub fn lock(&mut self, node: NodeId) {
        self.for_path(node, |e, ev, pr| {
            e.lock_ref += 1;
            if e.lock_ref == 1 {
                *ev -= e.pages.len();
                *pr += e.pages.len();
            }
        });
    }

    /// Releases one [`lock`](Self::lock) of `node`.
    pub fn unlock(&mut self, node: NodeId) {
        self.for_path(node, |e, ev, pr| {
            e.lock_ref = e.lock_ref.saturating_sub(1);
            if e.lock_ref == 0 {
                *pr -= e.pages.len();
                *ev += e.pages.len();
            }
        });
        if node != NodeId::ROOT && self.tree.child_count(node) == 0 && self.lock_ref(node) == 0 {
            self.push_candidate(node);
        }
    }

    fn push_candidate(&mut self, node: NodeId) {
        self.next_gen += 1;
        let g = self.next_gen;
        if let Some(e) = self.tree.value_mut(node) {
            e.heap_gen = g;
            self.heap.push(Reverse((e.priority, e.last_access, g, node)));
        }
        if self.heap.len() > 4 * self.tree.len() + 64 {
            self.rebuild_heap();
        }
    }

    fn rebuild_heap(&mut self) {
        self.heap.clear();
        for n in self.tree.walk() {
            if self.tree.child_count(n) == 0
                && self.lock_ref(n) == 0
                && let Some(e) = self.tree.value(n)
            {
                self.heap.push(Reverse((e.priority, e.last_access, e.heap_gen, n)));
            }
        }
    }

    /// Caches the whole pages of `tokens`. The caller owns pages `start_page..` in `alloc`
    /// (pages before `start_page` came from this cache and must still be locked). Pages that
    /// are already cached are dropped (freed). Returns the deepest node covering the
    /// inserted pages and the number of pages newly cached.
    pub fn insert(&mut self, tokens: &[u32], start_page: usize, alloc: PageAlloc, priority: i32) -> (NodeId, usize) {
        let (node, new_pages, _duplicates) = self.insert_keeping(tokens, start_page, alloc, priority);
        (node, new_pages)
    }

    /// Like [`insert`](Self::insert), but hands back the pages that were not cached
    /// (duplicates of cached ones, or all of them when nothing fit) instead of freeing them:
    /// a transfer may still be reading them.
    pub fn insert_keeping(
        &mut self,
        tokens: &[u32],
        start_page: usize,
        alloc: PageAlloc,
        priority: i32,
    ) -> (NodeId, usize, PageAlloc) {
        let ps = self.page_size();
        let full = tokens.len() / ps;
        let tokens = &tokens[..full * ps];
        let existing = self.tree.match_prefix(tokens).tokens / ps;
        if existing < start_page || alloc.len() != full - start_page {
            // The prefix the caller built on is gone, or the pages do not fit: keep nothing.
            return (NodeId::ROOT, 0, alloc);
        }
        self.clock += 1;
        let clock = self.clock;
        let mut parent_hash = ROOT_HASH;
        let mut new_pages = 0;
        let counted = &mut new_pages;
        // The first `existing` pages are cached already: those of `alloc` are duplicates,
        // handed back; the rest become the new node's pages.
        let mut duplicates = alloc;
        let fresh = duplicates.split_off(existing - start_page);
        let ins = self.tree.insert(tokens, move |at| {
            debug_assert_eq!(at, existing, "the tree did not change between match and insert");
            *counted = fresh.len();
            CacheEntry { pages: fresh, hashes: Vec::new(), lock_ref: 0, last_access: clock, priority, heap_gen: 0 }
        });
        if let Some((_, lower)) = ins.split {
            self.dirty.push(Dirty::Node(lower));
        }
        let Some(new) = ins.new_node else {
            return (ins.last().unwrap_or(NodeId::ROOT), 0, duplicates);
        };
        let parent = self.tree.parent(new).unwrap_or(NodeId::ROOT);
        self.dirty.push(Dirty::Child(parent, self.tree.first_page(new).into()));
        if let Some(e) = self.tree.value(parent) {
            parent_hash = e.hashes.last().copied().unwrap_or(ROOT_HASH);
        }
        let key = self.tree.key(new);
        let hashes = page_hashes(parent_hash, &key, ps);
        if let Some(e) = self.tree.value_mut(new) {
            e.hashes = hashes.clone();
        }
        self.evictable += new_pages;
        self.push_candidate(new);
        self.emit(EventKind::Stored(Stored { parent_hash, page_hashes: hashes, token_ids: key }));
        (new, new_pages, duplicates)
    }

    /// Evicts unlocked leaves until at least `pages` pages are freed or nothing is evictable.
    /// Returns the pages freed.
    pub fn evict(&mut self, pages: usize) -> usize {
        let mut freed = 0;
        while freed < pages {
            let Some(Reverse((_, _, g, id))) = self.heap.pop() else { break };
            let live = self.tree.value(id).is_some_and(|e| e.heap_gen == g && e.lock_ref == 0);
            if !live || self.tree.child_count(id) > 0 {
                continue;
            }
            let parent = self.tree.parent(id).unwrap_or(NodeId::ROOT);
            let Some(entry) = self.tree.remove_leaf(id) else { continue };
            freed += entry.pages.len();
            self.evictable -= entry.pages.len();
            self.dirty.push(Dirty::Node(id));
            self.emit(EventKind::Removed { page_hashes: entry.hashes.clone() });
            drop(entry);
            if parent != NodeId::ROOT && self.tree.child_count(parent) == 0 && self.lock_ref(parent) == 0 {
                self.push_candidate(parent);
            }
        }
        freed
    }

    /// Takes `n` pages from `pool`, evicting cached pages when the free list is short.
    pub fn alloc<B: Backend>(&mut self, pool: &PagePool<B>, n: usize) -> Result<PageAlloc, EngineError> {
        let free = pool.free_pages();
        if free < n {
            self.evict(n - free);
        }
        pool.alloc(n)
    }

    fn emit(&mut self, kind: EventKind) {
        self.sequence += 1;
        self.events.push(KvEvent { epoch: self.epoch, sequence: self.sequence, kind });
    }

    /// Events since the last call.
    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// The whole cache as one snapshot event (parents before children), in the current
    /// sequence position.
    pub fn snapshot(&self) -> KvEvent {
        let mut runs = Vec::with_capacity(self.tree.len());
        for n in self.tree.walk() {
            let parent = self.tree.parent(n).unwrap_or(NodeId::ROOT);
            let parent_hash = self.tree.value(parent).and_then(|e| e.hashes.last().copied()).unwrap_or(ROOT_HASH);
            let hashes = self.tree.value(n).map(|e| e.hashes.clone()).unwrap_or_default();
            runs.push(Stored { parent_hash, page_hashes: hashes, token_ids: self.tree.key(n) });
        }
        KvEvent { epoch: self.epoch, sequence: self.sequence, kind: EventKind::Snapshot(runs) }
    }

    /// Where matches may have changed since the last call.
    pub fn drain_dirty(&mut self) -> Vec<Dirty> {
        std::mem::take(&mut self.dirty)
    }
}
