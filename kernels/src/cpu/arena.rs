//! The CPU KV pool: one f32 arena, allocated and touched at start, addressed through a raw
//! pointer so that the forward pass and the KV transfer can use *different* pages of it at
//! the same time. No `&`/`&mut` to the whole arena is ever formed.
//!
//! Soundness rests on page ownership, which the engine and the workers enforce: a page is
//! written by at most one party at a time (the forward pass of the sequence owning it, or the
//! one transfer room it was preallocated for), and nobody reads a page while it is written.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

use crate::KernelError;

/// An f32 arena of `len` values.
pub struct KvArena {
    ptr: NonNull<f32>,
    len: usize,
    layout: Layout,
}

// SAFETY: plain memory; concurrent use is of disjoint pages (module docs).
unsafe impl Send for KvArena {}
// SAFETY: as above.
unsafe impl Sync for KvArena {}

impl std::fmt::Debug for KvArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvArena").field("len", &self.len).finish()
    }
}

impl KvArena {
    /// Allocates `len` zeroed values, touching every page of memory now (first touch of fresh
    /// memory is slow and must not happen on the request path).
    pub fn new(len: usize) -> Result<Self, KernelError> {
        let bytes = len.checked_mul(4).ok_or(KernelError::OutOfMemory { bytes: usize::MAX })?;
        let layout = Layout::from_size_align(bytes.max(4), 64).map_err(|_| KernelError::OutOfMemory { bytes })?;
        // SAFETY: non-zero size.
        let ptr =
            NonNull::new(unsafe { alloc_zeroed(layout) }.cast::<f32>()).ok_or(KernelError::OutOfMemory { bytes })?;
        // Before the first touch, so the kernel can fault the arena in as 2 MiB pages.
        super::huge::advise(ptr.as_ptr().cast(), bytes);
        // alloc_zeroed may map lazily-zeroed pages; write them to really touch them.
        // SAFETY: the allocation holds `len` values.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(Self { ptr, len, layout })
    }

    /// Values in the arena.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the arena is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte, for sharing the arena with a transfer backend or registering it with
    /// a NIC; uses follow the page-ownership rule.
    pub fn base_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr().cast()
    }

    /// Bytes in the arena.
    pub fn len_bytes(&self) -> usize {
        self.len * 4
    }

    fn check(&self, off: usize, n: usize) -> Result<(), KernelError> {
        match off.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(KernelError::Shape { op: "kv arena", detail: format!("values {off}..+{n} of {}", self.len) }),
        }
    }

    /// Values `off..off + n`.
    ///
    /// # Safety
    /// Nobody may write them while the slice lives.
    pub unsafe fn read(&self, off: usize, n: usize) -> Result<&[f32], KernelError> {
        self.check(off, n)?;
        // SAFETY: in bounds; no concurrent writer (caller's contract).
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), n) })
    }

    /// Copies `src` to values `off..`.
    ///
    /// # Safety
    /// Nobody else may read or write them meanwhile.
    pub unsafe fn write(&self, off: usize, src: &[f32]) -> Result<(), KernelError> {
        self.check(off, src.len())?;
        // SAFETY: in bounds; exclusive (caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(off), src.len()) };
        Ok(())
    }
}

impl Drop for KvArena {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr().cast(), self.layout) };
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The arena's memory carries the huge-page advice (`hg`): whether the kernel then finds
    /// free 2 MiB pages depends on the machine's memory at the time (a CI run after heavy
    /// builds found none), so the advice is what is checked.
    #[test]
    fn the_arena_is_advised_onto_huge_pages() {
        let arena = KvArena::new(16 << 20).expect("64 MiB");
        let flags = crate::cpu::huge::vm_flags_at(arena.base_ptr() as usize + (32 << 20));
        assert!(flags.iter().any(|f| f == "hg"), "VmFlags of the arena: {flags:?}");
    }
}
