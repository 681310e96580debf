//! Host memory for a KV pool's mirror: where a device backend's pages stop on their way to
//! and from the network (the tcp transfer reads and writes host memory).

use std::ptr::NonNull;

/// A zeroed, touched, 64-byte-aligned host allocation. A device backend page-locks it
/// (pinned memory: its copies to and from the device are direct DMA).
pub struct HostArena {
    ptr: NonNull<u8>,
    bytes: usize,
    pinned: bool,
    /// What frees the memory when dropped.
    _owner: Box<dyn Send + Sync>,
}

// SAFETY: plain bytes; who touches which page is the pool's page-ownership rule.
unsafe impl Send for HostArena {}
// SAFETY: as above.
unsafe impl Sync for HostArena {}

impl std::fmt::Debug for HostArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostArena").field("bytes", &self.bytes).field("pinned", &self.pinned).finish()
    }
}

impl HostArena {
    /// An arena over `bytes` bytes at `ptr`, freed when `owner` drops.
    ///
    /// # Safety
    /// `ptr` must point to `bytes` bytes, 64-byte aligned, valid until `owner` drops.
    pub(crate) unsafe fn new(ptr: NonNull<u8>, bytes: usize, pinned: bool, owner: Box<dyn Send + Sync>) -> Self {
        Self { ptr, bytes, pinned, _owner: owner }
    }

    /// The first byte. Accesses through it follow the KV pool's page-ownership rule.
    pub fn base_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Bytes in the arena.
    pub fn len_bytes(&self) -> usize {
        self.bytes
    }

    /// Whether the memory is page-locked.
    pub fn pinned(&self) -> bool {
        self.pinned
    }
}
