//! Host memory holding KV pages, shared by the engine (which computes into pages), the
//! sender (which reads finished pages) and the receiver (which writes arriving pages).
//!
//! Soundness rests on page ownership, which the rest of Ferry enforces: a page is written by
//! at most one party at a time (its request's forward pass, or the one transfer room it was
//! preallocated for, which admits each page once), and nobody reads a page while it is being
//! written. Within that rule, access to *different* pages from several threads is fine: the
//! arena is one allocation addressed through a raw pointer, never through a `&mut` to the whole.

use std::alloc::{Layout, alloc, dealloc};
use std::ptr::NonNull;
use std::sync::Arc;

/// A fixed arena of `pages` pages of `page_bytes` bytes, allocated and touched at creation.
pub struct HostPages {
    ptr: NonNull<u8>,
    layout: Layout,
    page_bytes: usize,
    pages: usize,
    /// Set when the memory belongs to someone else (the engine's KV pool): kept alive here,
    /// never freed by us.
    owner: Option<Arc<dyn Send + Sync>>,
}

// SAFETY: the arena is plain bytes; concurrent access is to disjoint pages (module docs).
unsafe impl Send for HostPages {}
// SAFETY: as above.
unsafe impl Sync for HostPages {}

impl std::fmt::Debug for HostPages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPages").field("page_bytes", &self.page_bytes).field("pages", &self.pages).finish()
    }
}

/// A page range outside the arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("pages {first}..{first}+{n} are outside an arena of {pages} pages")]
pub struct OutOfArena {
    /// First page.
    pub first: u32,
    /// Number of pages.
    pub n: u32,
    /// Pages in the arena.
    pub pages: usize,
}

impl HostPages {
    /// Allocates and zero-fills (touches) the arena. None when the size overflows or the
    /// allocation fails.
    pub fn new(page_bytes: usize, pages: usize) -> Option<Self> {
        let size = page_bytes.checked_mul(pages)?.max(1);
        let layout = Layout::from_size_align(size, 64).ok()?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc(layout) })?;
        // SAFETY: the allocation is `size` bytes; touching it now keeps first-touch page
        // faults off the request path.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, size) };
        Some(Self { ptr, layout, page_bytes, pages, owner: None })
    }

    /// Pages over memory `owner` holds (the engine's KV pool arena), without copying it.
    ///
    /// # Safety
    /// `ptr` must point to `page_bytes * pages` bytes that stay valid while `owner` lives, and
    /// every use of those bytes, here and by their owner, must follow the page-ownership rule
    /// of this module.
    pub unsafe fn external(ptr: *mut u8, page_bytes: usize, pages: usize, owner: Arc<dyn Send + Sync>) -> Option<Self> {
        let ptr = NonNull::new(ptr)?;
        let layout = Layout::from_size_align(page_bytes.checked_mul(pages)?.max(1), 1).ok()?;
        Some(Self { ptr, layout, page_bytes, pages, owner: Some(owner) })
    }

    /// Bytes per page.
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Pages in the arena.
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// Bytes in the arena.
    pub fn len_bytes(&self) -> usize {
        self.layout.size()
    }

    /// Address of page 0, for registering the arena with a NIC. Accesses through it follow
    /// the page-ownership rule of this module.
    pub fn base_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn range(&self, first: u32, n: u32) -> Result<(usize, usize), OutOfArena> {
        let end = u64::from(first) + u64::from(n);
        if end > self.pages as u64 {
            return Err(OutOfArena { first, n, pages: self.pages });
        }
        Ok((first as usize * self.page_bytes, n as usize * self.page_bytes))
    }

    /// The bytes of pages `first..first + n`.
    ///
    /// # Safety
    /// Nobody may write these pages while the returned slice is alive.
    pub unsafe fn read(&self, first: u32, n: u32) -> Result<&[u8], OutOfArena> {
        let (off, len) = self.range(first, n)?;
        // SAFETY: in bounds (checked above); no concurrent writer (caller's contract).
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) })
    }

    /// The bytes of pages `first..first + n`, for writing in place.
    ///
    /// # Safety
    /// The caller must own these pages: nobody else reads or writes them while the slice is
    /// alive.
    #[allow(clippy::mut_from_ref)] // interior mutability through the raw arena pointer
    pub unsafe fn slice_mut(&self, first: u32, n: u32) -> Result<&mut [u8], OutOfArena> {
        let (off, len) = self.range(first, n)?;
        // SAFETY: in bounds; exclusive access (caller's contract).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) })
    }

    /// Copies `data` (whole pages) into pages `first..`.
    ///
    /// # Safety
    /// The caller must own these pages: nobody else reads or writes them meanwhile.
    pub unsafe fn write(&self, first: u32, data: &[u8]) -> Result<(), OutOfArena> {
        let n = (data.len() / self.page_bytes.max(1)) as u32;
        let (off, len) = self.range(first, n)?;
        debug_assert_eq!(len, data.len());
        // SAFETY: in bounds; exclusive access to these pages (caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.as_ptr().add(off), len.min(data.len())) };
        Ok(())
    }
}

impl Drop for HostPages {
    fn drop(&mut self) {
        if self.owner.is_none() {
            // SAFETY: allocated in `new` with this layout.
            unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_written_and_read_back_and_bounds_hold() {
        let m = HostPages::new(8, 4).expect("arena");
        // SAFETY: single-threaded test owns every page.
        unsafe {
            m.write(1, &[1u8; 16]).expect("in bounds");
            assert_eq!(m.read(0, 3).expect("in bounds"), &[[0u8; 8], [1; 8], [1; 8]].concat()[..]);
            assert!(m.write(3, &[0u8; 16]).is_err());
            assert!(m.read(4, 1).is_err());
            assert!(m.read(u32::MAX, 2).is_err());
        }
    }
}
