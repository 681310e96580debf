//! Pages between the device pool and host memory: pinned host arenas for a pool's mirror and
//! the page copies in both directions.

use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{CudaContext, DevicePtr, result};

use super::{CudaBackend, CudaKv};
use crate::{HostArena, KernelError, KvLayout, plan};

/// Page-locked host memory from `cuMemHostAlloc`, freed on drop.
struct Pinned {
    ctx: Arc<CudaContext>,
    ptr: NonNull<u8>,
}

// SAFETY: a plain host allocation; the arena that owns this guards access.
unsafe impl Send for Pinned {}
// SAFETY: as above.
unsafe impl Sync for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by `cuMemHostAlloc` in `host_arena`, freed once, here.
        let _ = unsafe { result::free_host(self.ptr.as_ptr().cast()) };
    }
}

impl CudaBackend {
    pub(super) fn pinned_arena(&self, bytes: usize) -> Result<HostArena, KernelError> {
        let ctx = Arc::clone(self.stream.context());
        ctx.bind_to_thread().map_err(Self::err)?;
        // Flags 0: pinned and cached, so the CPU reads it at full speed too (write-combined
        // memory would make the tcp sender's reads crawl).
        // SAFETY: a plain allocation of `bytes` bytes.
        let raw = unsafe { result::malloc_host(bytes.max(1), 0) }.map_err(|_| KernelError::OutOfMemory { bytes })?;
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or(KernelError::OutOfMemory { bytes })?;
        // SAFETY: `bytes` bytes were just allocated; touching them now keeps first-touch
        // faults off the request path.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, bytes) };
        // SAFETY: page-aligned (so 64-byte aligned), `bytes` long, valid until `Pinned` drops.
        Ok(unsafe { HostArena::new(ptr, bytes, true, Box::new(Pinned { ctx, ptr })) })
    }

    /// The device address of whole pages `first..` (`len` values) of `pool`, checked; None
    /// for an empty span. Binds the context to this thread for the raw copies that follow.
    fn page_addr(&self, pool: &CudaKv, layout: &KvLayout, first: u32, len: usize) -> Result<Option<u64>, KernelError> {
        let (off, n) = plan::page_span(layout, first, len, pool.len() / layout.page_floats().max(1))?;
        if n == 0 {
            return Ok(None);
        }
        self.stream.context().bind_to_thread().map_err(Self::err)?;
        let (base, _p) = pool.device_ptr(&self.stream);
        Ok(Some(base + (off * 4) as u64))
    }

    pub(super) fn pages_to_host(
        &self,
        pool: &CudaKv,
        layout: &KvLayout,
        first: u32,
        dst: &mut [f32],
    ) -> Result<(), KernelError> {
        let Some(src) = self.page_addr(pool, layout, first, dst.len())? else { return Ok(()) };
        // SAFETY: the span lies inside the pool (checked); `dst` holds as many values and
        // outlives the copy (we wait for the stream below).
        unsafe { result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }.map_err(Self::err)?;
        self.stream.synchronize().map_err(Self::err)
    }

    pub(super) fn pages_from_host(
        &self,
        pool: &CudaKv,
        layout: &KvLayout,
        first: u32,
        src: &[f32],
    ) -> Result<(), KernelError> {
        // The pool is shared with the transfer side; its pages are written by their owner only.
        let Some(dst) = self.page_addr(pool, layout, first, src.len())? else { return Ok(()) };
        // SAFETY: in bounds (checked); `src` outlives the copy (we wait for the stream below).
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }.map_err(Self::err)?;
        self.stream.synchronize().map_err(Self::err)
    }
}
