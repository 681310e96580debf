//! The KV page pool: one arena of pages allocated and touched at start, a free list, and
//! page allocations that return their pages when dropped.
//!
//! Invariants: a page is either on the free list or owned by exactly one [`PageAlloc`];
//! `free_pages() + pages held by live allocations == num_pages()` at all times.

use std::sync::{Arc, Mutex, MutexGuard};

use ferry_kernels::{Backend, KvLayout};

use crate::EngineError;

/// The free list, shared between the pool and its allocations.
#[derive(Debug)]
struct FreeList {
    free: Vec<u32>,
}

fn lock(m: &Mutex<FreeList>) -> MutexGuard<'_, FreeList> {
    // A panic while holding the lock cannot leave the list half-updated (every update is a
    // single push/truncate), so a poisoned lock is still consistent.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Pages owned by one sequence. Dropping it frees them.
#[derive(Debug)]
pub struct PageAlloc {
    pages: Vec<u32>,
    list: Arc<Mutex<FreeList>>,
}

impl PageAlloc {
    /// The page ids, in position order.
    pub fn pages(&self) -> &[u32] {
        &self.pages
    }

    /// Number of pages held.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether no page is held.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Splits off pages `at..` into a new allocation; `self` keeps `..at`.
    pub fn split_off(&mut self, at: usize) -> PageAlloc {
        PageAlloc { pages: self.pages.split_off(at.min(self.pages.len())), list: Arc::clone(&self.list) }
    }

    /// Appends `n` more pages, or fails without taking any.
    pub fn grow(&mut self, n: usize) -> Result<(), EngineError> {
        let mut l = lock(&self.list);
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
        lock(&self.list).free.append(&mut self.pages);
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
        lock(&self.list).free.len()
    }

    /// Pages needed for `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.layout.page_size)
    }

    /// Takes `n` pages, or none when fewer are free.
    pub fn alloc(&self, n: usize) -> Result<PageAlloc, EngineError> {
        let mut a = PageAlloc { pages: Vec::with_capacity(n), list: Arc::clone(&self.list) };
        a.grow(n)?;
        Ok(a)
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
}
