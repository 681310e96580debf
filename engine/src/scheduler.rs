//! Prefill batch scheduling over the prefix cache. No I/O: the caller runs the forward pass
//! for the chunks a pass returns and reports them back.
//!
//! A pass spends a token budget (`chunk_size`): the requests already being prefilled continue
//! first, then waiting requests are admitted in policy order:
//! - `lpm`: longest cached prefix first (ties by arrival);
//! - `dfs-weight`: depth-first over the cache tree, heavier subtrees (more waiting requests)
//!   first and deeper matches before shallower ones, so requests sharing a prefix run back
//!   to back;
//! - `fcfs`: arrival order.
//!
//! Admission matches the prompt (minus its last token, which is always computed) against the
//! cache, locks the match, and takes pages for the rest, evicting cached pages when needed. A
//! prompt longer than the remaining budget is computed in chunks over several passes.
//!
//! **In-queue prefix check**: a request whose uncached part shares at least
//! `in_queue_threshold` tokens with a prompt already being prefilled waits, so that the shared
//! prefix is computed once and found in the cache afterwards.
//!
//! **Incremental matching**: every waiting request remembers how much of it is cached and at
//! which node its match ends. The cache reports the nodes whose neighbourhood changed (split,
//! extended, evicted); a pass re-matches only the requests indexed at those nodes, so `lpm`
//! stays on at any queue depth.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap, HashSet};

use ferry_kernels::Backend;
use ferry_radix::{NodeId, Payload, RadixTree};

use crate::cache::{CacheMatch, Dirty, RadixCache};
use crate::pool::{PageAlloc, PagePool};

/// How waiting requests are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Policy {
    /// Longest cached prefix first.
    #[default]
    Lpm,
    /// Depth-first over the cache tree, heaviest subtree first.
    DfsWeight,
    /// First come, first served.
    Fcfs,
}

/// A scheduling policy name that is none of them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown schedule policy {0:?} (lpm, dfs-weight, fcfs)")]
pub struct UnknownPolicy(String);

impl std::str::FromStr for Policy {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, UnknownPolicy> {
        match s {
            "lpm" => Ok(Self::Lpm),
            "dfs-weight" => Ok(Self::DfsWeight),
            "fcfs" => Ok(Self::Fcfs),
            other => Err(UnknownPolicy(other.to_string())),
        }
    }
}

/// Scheduler limits.
#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    /// Ordering of waiting requests.
    pub policy: Policy,
    /// Prompt tokens computed per pass (the chunked-prefill size).
    pub chunk_size: usize,
    /// A request sharing at least this many uncached tokens with a prompt being prefilled
    /// waits for it; 0 disables the check.
    pub in_queue_threshold: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self { policy: Policy::Lpm, chunk_size: 2048, in_queue_threshold: 32 }
    }
}

/// A request id, chosen by the caller.
pub type ReqId = u64;

/// One request's share of a pass: compute `tokens[start..end]` into `pages`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// The request.
    pub id: ReqId,
    /// First token of the chunk (positions before it are in `pages`).
    pub start: usize,
    /// One past the last token.
    pub end: usize,
    /// The request's pages for its whole prompt, in order.
    pub pages: Vec<u32>,
    /// Whether this chunk completes the prompt.
    pub last: bool,
    /// Prompt tokens found in the cache at admission.
    pub cached: usize,
}

/// A request whose prompt is fully computed.
#[derive(Debug)]
pub struct Prefilled {
    /// The request.
    pub id: ReqId,
    /// The cache node now holding the prompt's whole pages, locked for the caller: unlock it
    /// (`RadixCache::unlock`) once the pages are no longer needed (transfer done).
    pub node: NodeId,
    /// All the prompt's pages, in order (cached pages, then `tail`).
    pub pages: Vec<u32>,
    /// The partly filled last page, owned by the request.
    pub tail: PageAlloc,
    /// Pages this request computed that turned out to duplicate pages another request cached
    /// meanwhile: not cached, but kept alive here while a transfer may still read them.
    pub duplicates: PageAlloc,
    /// Prompt tokens that came from the cache.
    pub cached: usize,
}

struct Waiting {
    tokens: Vec<u32>,
    priority: i32,
    arrival: u64,
    matched: usize,
    node: NodeId,
    /// Computed whole, the cache ignored (a request that reports prompt logprobs).
    uncached: bool,
}

struct Prefilling {
    id: ReqId,
    tokens: Vec<u32>,
    priority: i32,
    prefix: CacheMatch,
    alloc: PageAlloc,
    computed: usize,
}

/// Count of prompts sharing a prefix, for the in-queue check.
#[derive(Debug, Clone, Copy)]
struct Count;

impl Payload for Count {
    fn split_off(&mut self, _at: usize) -> Self {
        Count
    }
}

/// The prefill scheduler.
pub struct Scheduler {
    cfg: SchedulerConfig,
    waiting: HashMap<ReqId, Waiting>,
    /// Waiting requests by the node their match ends at, then by their next page (empty when
    /// the prompt has no further whole page).
    by_node: HashMap<NodeId, HashMap<Box<[u32]>, HashSet<ReqId>>>,
    lpm: BTreeSet<(Reverse<usize>, u64, ReqId)>,
    fcfs: BTreeSet<(u64, ReqId)>,
    prefilling: Vec<Prefilling>,
    computing: RadixTree<Count>,
    computing_prompts: Vec<(ReqId, Vec<u32>)>,
    arrivals: u64,
    rematched: u64,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("waiting", &self.waiting.len())
            .field("prefilling", &self.prefilling.len())
            .finish()
    }
}

impl Scheduler {
    /// A scheduler for a cache of `page_size`-token pages.
    pub fn new(cfg: SchedulerConfig, page_size: usize) -> Self {
        Self {
            cfg,
            waiting: HashMap::new(),
            by_node: HashMap::new(),
            lpm: BTreeSet::new(),
            fcfs: BTreeSet::new(),
            prefilling: Vec::new(),
            computing: RadixTree::new(page_size),
            computing_prompts: Vec::new(),
            arrivals: 0,
            rematched: 0,
        }
    }

    /// Requests waiting for admission.
    pub fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    /// Requests admitted and not yet fully computed.
    pub fn prefilling_len(&self) -> usize {
        self.prefilling.len()
    }

    /// Prompt tokens still to compute, waiting and admitted (for load reports).
    pub fn queued_tokens(&self) -> usize {
        let w: usize = self.waiting.values().map(|w| w.tokens.len() - w.matched).sum();
        let p: usize = self.prefilling.iter().map(|p| p.tokens.len() - p.computed).sum();
        w + p
    }

    /// Re-matches done so far (a measure of the incremental matching's work).
    pub fn rematch_count(&self) -> u64 {
        self.rematched
    }

    /// Applies pending cache changes, then counts waiting requests whose remembered match
    /// differs from a fresh one (always 0 unless incremental matching is broken; for tests).
    pub fn stale_matches(&mut self, cache: &mut RadixCache) -> usize {
        self.refresh(cache);
        self.waiting.values().filter(|w| Self::peek(cache, &w.tokens, w.uncached) != (w.matched, w.node)).count()
    }

    /// Queues a request with priority 0. Prompts must be non-empty (the engine validates
    /// them first).
    pub fn add(&mut self, id: ReqId, tokens: Vec<u32>, cache: &RadixCache) {
        self.add_with_priority(id, tokens, 0, cache);
    }

    /// Queues a request; its cached pages are evicted after those of lower priorities.
    pub fn add_with_priority(&mut self, id: ReqId, tokens: Vec<u32>, priority: i32, cache: &RadixCache) {
        self.add_request(id, tokens, priority, false, cache);
    }

    /// Queues a request; `uncached`: its whole prompt is computed, whatever the cache holds
    /// (every position's logits are wanted), though what it computes is cached after.
    pub fn add_request(&mut self, id: ReqId, tokens: Vec<u32>, priority: i32, uncached: bool, cache: &RadixCache) {
        self.arrivals += 1;
        let (matched, node) = Self::peek(cache, &tokens, uncached);
        let w = Waiting { tokens, priority, arrival: self.arrivals, matched, node, uncached };
        self.index(id, &w);
        self.waiting.insert(id, w);
    }

    /// Drops a request wherever it is, releasing its lock and pages. False when unknown.
    pub fn abort(&mut self, id: ReqId, cache: &mut RadixCache) -> bool {
        if let Some(w) = self.waiting.remove(&id) {
            self.unindex(id, &w);
            return true;
        }
        if let Some(i) = self.prefilling.iter().position(|p| p.id == id) {
            let p = self.prefilling.swap_remove(i);
            cache.unlock(p.prefix.node);
            self.forget_computing(id);
            return true;
        }
        false
    }

    fn peek(cache: &RadixCache, tokens: &[u32], uncached: bool) -> (usize, NodeId) {
        if uncached {
            return (0, NodeId::ROOT);
        }
        let m = cache.tree().match_prefix(&tokens[..tokens.len().saturating_sub(1)]);
        (m.tokens, m.last().unwrap_or(NodeId::ROOT))
    }

    /// The page after a waiting request's match (what an extension of its node must start
    /// with for the match to grow).
    fn next_page(w: &Waiting, page_size: usize) -> Box<[u32]> {
        let usable = w.tokens.len().saturating_sub(1);
        if w.matched + page_size <= usable { w.tokens[w.matched..w.matched + page_size].into() } else { Box::new([]) }
    }

    fn index(&mut self, id: ReqId, w: &Waiting) {
        let key = Self::next_page(w, self.computing.page_size());
        self.by_node.entry(w.node).or_default().entry(key).or_default().insert(id);
        self.lpm.insert((Reverse(w.matched), w.arrival, id));
        self.fcfs.insert((w.arrival, id));
    }

    fn unindex(&mut self, id: ReqId, w: &Waiting) {
        let key = Self::next_page(w, self.computing.page_size());
        if let Some(by_page) = self.by_node.get_mut(&w.node) {
            if let Some(s) = by_page.get_mut(&key) {
                s.remove(&id);
                if s.is_empty() {
                    by_page.remove(&key);
                }
            }
            if by_page.is_empty() {
                self.by_node.remove(&w.node);
            }
        }
        self.lpm.remove(&(Reverse(w.matched), w.arrival, id));
        self.fcfs.remove(&(w.arrival, id));
    }

    /// Re-matches the waiting requests whose match could have changed.
    fn refresh(&mut self, cache: &mut RadixCache) {
        for d in cache.drain_dirty() {
            let ids: Vec<ReqId> = match d {
                Dirty::Node(node) => {
                    self.by_node.get(&node).map(|m| m.values().flatten().copied().collect()).unwrap_or_default()
                }
                Dirty::Child(node, page) => self
                    .by_node
                    .get(&node)
                    .and_then(|m| m.get(&page))
                    .map(|s| s.iter().copied().collect())
                    .unwrap_or_default(),
            };
            for id in ids {
                let Some(mut w) = self.waiting.remove(&id) else { continue };
                self.unindex(id, &w);
                (w.matched, w.node) = Self::peek(cache, &w.tokens, w.uncached);
                self.rematched += 1;
                self.index(id, &w);
                self.waiting.insert(id, w);
            }
        }
    }

    /// Waiting request ids in policy order.
    fn order(&self, cache: &RadixCache) -> Vec<ReqId> {
        match self.cfg.policy {
            Policy::Lpm => self.lpm.iter().map(|k| k.2).collect(),
            Policy::Fcfs => self.fcfs.iter().map(|k| k.1).collect(),
            Policy::DfsWeight => self.dfs_weight_order(cache),
        }
    }

    fn dfs_weight_order(&self, cache: &RadixCache) -> Vec<ReqId> {
        let tree = cache.tree();
        let mut weight: HashMap<NodeId, usize> = HashMap::new();
        for (&node, by_page) in &self.by_node {
            let count: usize = by_page.values().map(HashSet::len).sum();
            let mut cur = Some(node);
            while let Some(c) = cur {
                *weight.entry(c).or_default() += count;
                cur = tree.parent(c);
            }
        }
        // Post-order: a node's heavier subtrees first, then the requests ending at the node
        // itself, so deeper matches run before shallower ones of the same group.
        let mut out = Vec::with_capacity(self.waiting.len());
        let mut stack = vec![(NodeId::ROOT, false)];
        while let Some((n, expanded)) = stack.pop() {
            if expanded {
                if let Some(by_page) = self.by_node.get(&n) {
                    let mut here: Vec<(u64, ReqId)> = by_page
                        .values()
                        .flatten()
                        .filter_map(|id| self.waiting.get(id).map(|w| (w.arrival, *id)))
                        .collect();
                    here.sort_unstable();
                    out.extend(here.into_iter().map(|p| p.1));
                }
                continue;
            }
            stack.push((n, true));
            let mut kids: Vec<(usize, NodeId)> =
                tree.children(n).filter_map(|c| weight.get(&c).map(|&w| (w, c))).collect();
            // Heaviest first: push the lightest first onto the stack.
            kids.sort_unstable_by_key(|&(w, c)| (w, Reverse(c)));
            stack.extend(kids.into_iter().map(|k| (k.1, false)));
        }
        out
    }

    fn forget_computing(&mut self, id: ReqId) {
        self.computing_prompts.retain(|(i, _)| *i != id);
        // Rebuild the small tree of prompts being computed (few entries).
        let mut t = RadixTree::new(self.computing.page_size());
        for (_, p) in &self.computing_prompts {
            t.insert(p, |_| Count);
        }
        self.computing = t;
    }

    /// Plans one pass: chunks of admitted requests, within the token budget.
    pub fn schedule<B: Backend>(&mut self, cache: &mut RadixCache, pool: &PagePool<B>) -> Vec<Chunk> {
        self.refresh(cache);
        let mut budget = self.cfg.chunk_size.max(1);
        let mut out = Vec::new();
        for p in &self.prefilling {
            if budget == 0 {
                break;
            }
            let n = (p.tokens.len() - p.computed).min(budget);
            budget -= n;
            out.push(chunk_of(p, n));
        }
        if budget == 0 {
            return out;
        }
        for id in self.order(cache) {
            if budget == 0 {
                break;
            }
            let Some(w) = self.waiting.get(&id) else { continue };
            let len = w.tokens.len();
            // In-queue prefix check against prompts being computed.
            if self.cfg.in_queue_threshold > 0 && !w.uncached {
                let shared = self.computing.match_prefix(&w.tokens).tokens;
                if shared >= w.matched + self.cfg.in_queue_threshold {
                    continue;
                }
            }
            let Some(w) = self.waiting.remove(&id) else { continue };
            self.unindex(id, &w);
            let m = cache.match_prefix(if w.uncached { &[] } else { &w.tokens[..len - 1] });
            cache.lock(m.node);
            let ps = cache.page_size();
            let need = len.div_ceil(ps) - m.tokens / ps;
            let alloc = match cache.alloc(pool, need) {
                Ok(a) => a,
                Err(_) => {
                    // No room: put it back and stop admitting (head of line waits).
                    cache.unlock(m.node);
                    let (matched, node) = Self::peek(cache, &w.tokens, w.uncached);
                    let w = Waiting { matched, node, ..w };
                    self.index(id, &w);
                    self.waiting.insert(id, w);
                    break;
                }
            };
            self.computing.insert(&w.tokens, |_| Count);
            self.computing_prompts.push((id, w.tokens.clone()));
            let p = Prefilling { id, computed: m.tokens, prefix: m, alloc, tokens: w.tokens, priority: w.priority };
            let n = (len - p.computed).min(budget);
            budget -= n;
            out.push(chunk_of(&p, n));
            self.prefilling.push(p);
        }
        out
    }

    /// Records that `chunks` (from the last [`schedule`](Self::schedule)) were computed;
    /// returns the requests whose prompt is now complete, their whole pages cached.
    pub fn complete(&mut self, chunks: &[Chunk], cache: &mut RadixCache) -> Vec<Prefilled> {
        let mut done = Vec::new();
        for c in chunks {
            let Some(i) = self.prefilling.iter().position(|p| p.id == c.id) else { continue };
            self.prefilling[i].computed = c.end;
            if c.end < self.prefilling[i].tokens.len() {
                continue;
            }
            let mut p = self.prefilling.swap_remove(i);
            self.forget_computing(p.id);
            let ps = cache.page_size();
            let prefix_pages = p.prefix.tokens / ps;
            let full = p.tokens.len() / ps;
            let tail = p.alloc.split_off(full - prefix_pages);
            let (node, _, duplicates) = cache.insert_keeping(&p.tokens, prefix_pages, p.alloc, p.priority);
            let (node, mut pages) = if node == NodeId::ROOT {
                (p.prefix.node, p.prefix.pages.clone())
            } else {
                let m = cache.match_prefix(&p.tokens[..full * ps]);
                (m.node, m.pages)
            };
            cache.lock(node);
            cache.unlock(p.prefix.node);
            pages.extend_from_slice(tail.pages());
            done.push(Prefilled { id: p.id, node, pages, tail, duplicates, cached: p.prefix.tokens });
        }
        done
    }
}

fn chunk_of(p: &Prefilling, n: usize) -> Chunk {
    let mut pages = p.prefix.pages.clone();
    pages.extend_from_slice(p.alloc.pages());
    Chunk {
        id: p.id,
        start: p.computed,
        end: p.computed + n,
        pages,
        last: p.computed + n == p.tokens.len(),
        cached: p.prefix.tokens,
    }
}
