//! The decode node's prefix cache (issue 20, first step): the same radix cache and page
//! accounting as a prefill node's. A request that ends, or is retracted, leaves the whole
//! pages of what it computed — prompt and generated tokens — in the cache, evictable; a
//! request prefilled here (colocated, a short prompt, a retracted request's recomputation)
//! starts from the longest cached prefix of its context, locked while it runs, and computes
//! the rest. Pages are taken from the free list first, then by evicting the least recently
//! used unlocked leaves.
//!
//! The queues do not see the cache: to them a cached page is free (it is, once evicted),
//! and a request's cached prefix counts among the pages it holds. Two requests reading one
//! cached prefix are counted as holding it twice, so the queues' free pages never exceed
//! what the pool can give (free plus evictable; exactly that when no request reads the cache).
//! A prompt prefilled on a prefill node finds its prefix here too: the handshake tells that
//! node how many leading pages the decode node holds, and it sends only the rest (delta
//! transfer). The cache's KV events are published (`KvEvents`): the router places a
//! conversation's next turn where its history is.

use ferry_cluster::Room;
use ferry_engine::{CacheMatch, EngineError, PageAlloc, RadixCache};
use ferry_kernels::Backend;

use super::{Engine, Req};

impl<B: Backend> Engine<B> {
    /// `n` pages, evicting cached ones when the free list is short.
    pub(super) fn take_pages(&mut self, n: usize) -> Result<PageAlloc, EngineError> {
        self.cache.alloc(&self.pool, n)
    }

    /// At least `n` pages on the free list, evicting cached ones when it is short (before a
    /// request grows).
    pub(super) fn make_free(&mut self, n: usize) {
        let free = self.pool.free_pages();
        if free < n {
            self.cache.evict(n - free);
        }
    }

    /// The cached prefix of what `r` is about to compute here, locked (None: nothing cached,
    /// the cache off, or a request that must compute its whole prompt: one reporting prompt
    /// logprobs, or one forking later, whose sequences share pages it must own). At least
    /// its last token is always computed.
    pub(super) fn lookup(&mut self, room: Room) -> Option<CacheMatch> {
        let r = self.reqs.get(&room)?;
        let fresh = r.generated.is_empty();
        if !self.cfg.decode_cache || !r.forks.is_empty() || fresh && r.sampler.params().prompt_logprobs.is_some() {
            return None;
        }
        let tokens: Vec<u32> = (0..r.kv_target().saturating_sub(1)).map(|i| r.token_at(i)).collect();
        let m = self.cache.match_prefix(&tokens);
        if m.tokens == 0 {
            return None;
        }
        self.cache.lock(m.node);
        Some(m)
    }

    /// `r` gives up its pages (`pages`, their first `kv` tokens' KV computed): their whole
    /// pages stay in the cache (a fork's shared pages are not its own to give: dropped), and
    /// its lock on the prefix it read is released.
    pub(super) fn keep(&mut self, r: &mut Req, pages: Option<PageAlloc>, kv: usize) {
        if let Some(p) = pages {
            keep_pages(&mut self.cache, r, p, kv, self.cfg.decode_cache);
        }
        if let Some(node) = r.cached.take() {
            self.cache.unlock(node);
        }
        // Its held pages may be evicted and reused from now on: a pull reading them is spoiled.
        for id in r.pulls.drain(..) {
            self.pulls.remove(&id);
        }
    }
}

/// Inserts the whole pages of `r`'s first `kv` tokens held in `pages` (its cached prefix
/// first, still locked) into `cache`; the rest go back to the pool.
fn keep_pages(cache: &mut RadixCache, r: &Req, mut pages: PageAlloc, kv: usize, on: bool) {
    let ps = cache.page_size();
    let full = (kv / ps).min(pages.len());
    let lent = pages.lent();
    if !on || pages.shared() > 0 || full <= lent {
        return;
    }
    let mut own = pages.split_off(lent);
    drop(own.split_off(full - lent));
    let tokens: Vec<u32> = (0..full * ps).map(|i| r.token_at(i)).collect();
    cache.insert(&tokens, lent, own, 0);
}
