//! The KV page pool: one arena of pages allocated and touched at start, a free list, and
//! page allocations that return their pages when dropped.
//!
//! Invariants: a page is either on the free list or owned by exactly one [`PageAlloc`];
//! `free_pages() + pages held by live allocations == num_pages()` at all times. Sequences
//! forked from one prompt (`n` > 1) share its full pages: an allocation may begin with a
//! prefix it shares ([`PageAlloc::share_prefix`], [`PageAlloc::fork`]), itself one
//! allocation, owned by all of them together and returned when the last goes. A decode
//! node's request may also begin with pages *lent* by its prefix cache ([`PageAlloc::lending`]):
//! the cache owns them (and keeps them while the request holds its lock); dropping the
//! request's allocation returns only its own pages.

use parking_lot::Mutex;
use std::sync::Arc;

use ferry_kernels::{Backend, KvLayout};

use crate::EngineError;

/// The free list, shared between the pool and its allocations.
#[derive(Debug)]
struct FreeList {
    free: Vec<u32>,
}

/// Pages owned by one sequence. Dropping it frees them (a shared prefix: once no other
/// sequence holds it).
#[derive(Debug)]
pub struct PageAlloc {
    /// Every page id in position order, the shared prefix's first.
    pages: Vec<u32>,
    /// The pages `..prefix.len()`, shared with other sequences (read only: nobody writes a
    /// full page of a prompt again).
    prefix: Option<Arc<PageAlloc>>,
    /// The first `lent` pages belong to someone else (a prefix cache's nodes): read only here,
    /// never returned by this allocation. Not combined with a shared prefix.
    lent: usize,
    list: Arc<Mutex<FreeList>>,
}

impl PageAlloc {
    /// The page ids, in position order (the shared prefix's first).
    pub fn pages(&self) -> &[u32] {
        &self.pages
    }

    /// Pages at the front shared with other sequences (0 when none).
    pub fn shared(&self) -> usize {
        self.prefix.as_ref().map_or(0, |p| p.pages.len())
    }

    /// Pages at the front lent by their owner (0 when none).
    pub fn lent(&self) -> usize {
        self.lent
    }

    /// Pages at the front this allocation does not own.
    fn borrowed(&self) -> usize {
        self.shared() + self.lent
    }

    /// A sequence's pages: `lent` (owned elsewhere, a prefix cache's, read only), then the
    /// pages of `own` (taken).
    pub fn lending(lent: &[u32], mut own: PageAlloc) -> PageAlloc {
        let mut pages = lent.to_vec();
        pages.append(&mut own.pages);
        PageAlloc { pages, prefix: None, lent: lent.len(), list: Arc::clone(&own.list) }
    }

    /// Makes pages `..at` a prefix that [`fork`](Self::fork)s share; nothing when one is
    /// shared already.
    pub fn share_prefix(&mut self, at: usize) {
        debug_assert_eq!(self.lent, 0, "a fork shares only pages it owns");
        if self.prefix.is_some() {
            return;
        }
        let at = at.min(self.pages.len());
        let prefix =
            PageAlloc { pages: self.pages[..at].to_vec(), prefix: None, lent: 0, list: Arc::clone(&self.list) };
        self.prefix = Some(Arc::new(prefix));
    }

    /// A new sequence's pages: this one's shared prefix, then the pages of `own` (taken).
    pub fn fork(&self, mut own: PageAlloc) -> PageAlloc {
        let mut pages = self.pages[..self.shared()].to_vec();
        pages.append(&mut own.pages);
        PageAlloc { pages, prefix: self.prefix.clone(), lent: 0, list: Arc::clone(&self.list) }
    }

    /// Number of pages held.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether no page is held.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Splits off pages `at..` into a new allocation; `self` keeps `..at` (and its shared or
    /// lent pages whole: `at` is at least their number).
    pub fn split_off(&mut self, at: usize) -> PageAlloc {
        let at = at.clamp(self.borrowed(), self.pages.len());
        PageAlloc { pages: self.pages.split_off(at), prefix: None, lent: 0, list: Arc::clone(&self.list) }
    }

    /// Appends `n` more pages, or fails without taking any.
    pub fn grow(&mut self, n: usize) -> Result<(), EngineError> {
        let mut l = self.list.lock();
        if l.free.len() < n {
            return Err(EngineError::OutOfPages { needed: n, free: l.free.len() });
        }
        let at = l.free.len() - n;
        // The free list holds low ids at its end: take them in ascending order, so fresh
        // allocations are runs of consecutive pages.
        self.pages.extend(l.free.drain(at..).rev());
        Ok(())
    }
}

impl Drop for PageAlloc {
    fn drop(&mut self) {
        // The shared prefix goes back when its `Arc`'s last holder drops it; lent pages are
        // their owner's.
        let own = self.borrowed().min(self.pages.len());
        self.list.lock().free.extend_from_slice(&self.pages[own..]);
    }
}

/// A pool of KV pages in backend memory.
pub struct PagePool<B: Backend> {
    layout: KvLayout,
    num_pages: usize,
    storage: B::Kv,
    list: Arc<Mutex<FreeList>>,
}

impl<B: Backend> PagePool<B> {
    /// Allocates and touches `num_pages` pages of `layout`.
    pub fn new(backend: &B, layout: KvLayout, num_pages: usize) -> Result<Self, EngineError> {
        if u32::try_from(num_pages).is_err() || layout.page_size == 0 {
            return Err(EngineError::InvalidRequest(format!(
                "pool of {num_pages} pages of {} tokens",
                layout.page_size
            )));
        }
        let storage = backend.kv_pool(&layout, num_pages)?;
        // Hand out low page ids first (pop takes from the end).
        let free = (0..num_pages as u32).rev().collect();
        Ok(Self { layout, num_pages, storage, list: Arc::new(Mutex::new(FreeList { free })) })
    }

    /// The page layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Pages in the pool.
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Pages on the free list.
    pub fn free_pages(&self) -> usize {
        self.list.lock().free.len()
    }

    /// Pages needed for `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.layout.page_size)
    }

    /// Takes `n` pages, or none when fewer are free.
    pub fn alloc(&self, n: usize) -> Result<PageAlloc, EngineError> {
        let mut a = PageAlloc { pages: Vec::with_capacity(n), prefix: None, lent: 0, list: Arc::clone(&self.list) };
        a.grow(n)?;
        Ok(a)
    }

    /// Copies page `from`'s contents (every layer's K and V) into page `to`: a forked
    /// sequence's own copy of the prompt's partial last page (copy-on-write). Whoever calls it
    /// owns `to` and no one writes `from` meanwhile.
    pub fn copy_page(&self, backend: &B, from: u32, to: u32) -> Result<(), EngineError> {
        let mut page = vec![0.0f32; self.layout.page_floats()];
        backend.kv_to_host(&self.storage, &self.layout, from, &mut page)?;
        backend.kv_from_host(&self.storage, &self.layout, to, &page)?;
        Ok(())
    }

    /// The pool memory (shared: a transfer backend moves pages of it while the forward pass
    /// computes others; page ownership decides who touches which page).
    pub fn storage(&self) -> &B::Kv {
        &self.storage
    }
}

#[cfg(test)]
mod tests {
    use ferry_kernels::cpu::CpuBackend;

    use super::*;

    #[test]
    fn allocations_return_their_pages_on_drop() -> Result<(), EngineError> {
        let layout = KvLayout { num_layers: 1, num_kv_heads: 1, head_dim: 2, page_size: 4 };
        let pool = PagePool::new(&CpuBackend::default(), layout, 10)?;
        let mut a = pool.alloc(3)?;
        assert_eq!(a.pages(), &[0, 1, 2]);
        let b = pool.alloc(5)?;
        assert_eq!(pool.free_pages(), 2);
        assert!(matches!(pool.alloc(3), Err(EngineError::OutOfPages { needed: 3, free: 2 })));
        assert!(a.grow(3).is_err());
        a.grow(2)?;
        assert_eq!(pool.free_pages(), 0);
        drop(b);
        drop(a);
        assert_eq!(pool.free_pages(), 10);
        Ok(())
    }

    #[test]
    fn a_shared_prefix_goes_back_with_its_last_holder() -> Result<(), EngineError> {
        let layout = KvLayout { num_layers: 1, num_kv_heads: 1, head_dim: 2, page_size: 4 };
        let pool = PagePool::new(&CpuBackend::default(), layout, 10)?;
        // A prompt of 3 pages (the last partial) and a page for each of two more sequences.
        let mut a = pool.alloc(5)?;
        let mut extra = a.split_off(3);
        a.share_prefix(2);
        assert_eq!(a.shared(), 2);
        let b = a.fork(extra.split_off(1));
        let c = a.fork(extra);
        assert_eq!((b.pages(), c.pages()), (&[0, 1, 4][..], &[0, 1, 3][..]));
        // The prefix stays whole when an owner splits its own pages.
        assert_eq!(a.split_off(1).len(), 1);
        assert_eq!(a.pages(), &[0, 1]);
        assert_eq!(pool.free_pages(), 6);
        drop(a);
        drop(b);
        assert_eq!(pool.free_pages(), 7, "c still reads the prefix");
        drop(c);
        assert_eq!(pool.free_pages(), 10);
        Ok(())
    }

    #[test]
    fn lent_pages_stay_with_their_owner() -> Result<(), EngineError> {
        let layout = KvLayout { num_layers: 1, num_kv_heads: 1, head_dim: 2, page_size: 4 };
        let pool = PagePool::new(&CpuBackend::default(), layout, 10)?;
        let owner = pool.alloc(3)?;
        let mut seq = PageAlloc::lending(owner.pages(), pool.alloc(4)?);
        assert_eq!((seq.len(), seq.lent()), (7, 3));
        assert_eq!(seq.split_off(1).len(), 4, "the lent pages stay whole");
        seq.grow(2)?;
        assert_eq!(pool.free_pages(), 5);
        drop(seq);
        assert_eq!(pool.free_pages(), 7, "its own pages back, the lent ones not");
        drop(owner);
        assert_eq!(pool.free_pages(), 10);
        Ok(())
    }

    #[test]
    fn copy_page_copies_every_value() -> Result<(), EngineError> {
        let backend = CpuBackend::default();
        let layout = KvLayout { num_layers: 2, num_kv_heads: 1, head_dim: 2, page_size: 4 };
        let pool = PagePool::new(&backend, layout, 3)?;
        let n = layout.page_floats();
        let src: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
        backend.kv_from_host(pool.storage(), &layout, 1, &src)?;
        pool.copy_page(&backend, 1, 2)?;
        let mut got = vec![0.0; n];
        backend.kv_to_host(pool.storage(), &layout, 2, &mut got)?;
        assert_eq!(got, src);
        Ok(())
    }
}
