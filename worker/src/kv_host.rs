//! How the transfer reaches a worker's KV pages.
//!
//! - **Shared**: the pool is host memory (the CPU backend), and the transfer reads and writes
//!   its pages in place.
//! - **Mirrored**: the pool is device memory (`--device cuda`), or `--kv-host-mirror` asks for
//!   a mirror on the CPU (which is how the path is tested without a GPU). The transfer then
//!   works on a host arena holding the same pages under the same ids, pinned on a GPU.
//!   - Prefill copies each chunk's pages device → host just before they are sent
//!     ([`KvHost::to_host`]).
//!   - Decode copies a room's pages host → device once all of them have arrived
//!     ([`KvHost::to_device`]), before the request joins the running batch.
//!
//! Same ids on both sides keep the page-ownership rule as it was: a mirror page is touched
//! only by whoever owns the pool page of that id.

use std::sync::Arc;
use std::time::Instant;

use ferry_cluster::metrics as m;
use ferry_engine::PagePool;
use ferry_kernels::{Backend, KernelError};
use ferry_transfer::memory::HostPages;

/// The pages as the transfer sees them, and the copies that keep them in step with the pool.
pub struct KvHost {
    mem: Arc<HostPages>,
    mirrored: bool,
    role: &'static str,
}

impl std::fmt::Debug for KvHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvHost").field("mirrored", &self.mirrored).field("pages", &self.mem.pages()).finish()
    }
}

impl KvHost {
    /// The pool's own memory when the backend keeps it on the host and `mirror` is off;
    /// else a host mirror of it (allocated, pinned where the backend can, and touched now).
    pub fn new<B: Backend>(
        backend: &B,
        pool: &PagePool<B>,
        mirror: bool,
        role: &'static str,
    ) -> Result<Self, KernelError> {
        let page_bytes = pool.layout().page_floats() * 4;
        let pages = pool.num_pages();
        let empty = || KernelError::OutOfMemory { bytes: 0 };
        let (mem, mirrored) = match backend.kv_host_ptr(pool.storage()).filter(|_| !mirror) {
            Some(ptr) => {
                let owner: Arc<dyn Send + Sync> = Arc::new(pool.storage().clone());
                // SAFETY: the pool's storage holds `pages` pages of `page_bytes` bytes and lives
                // as long as `owner`. Page ownership keeps the engine and the transfer apart:
                // a prefill room's pages stay locked until its transfer ended; a decode room's
                // pages are written only by the transfer until the room completed, and a closed
                // room's pages are reused only once no write is in flight.
                (unsafe { HostPages::external(ptr, page_bytes, pages, owner) }.ok_or_else(empty)?, false)
            }
            None => {
                let arena = backend.host_arena(page_bytes * pages)?;
                let ptr = arena.base_ptr();
                // SAFETY: the arena holds `pages * page_bytes` bytes while it lives (kept by the
                // HostPages); its pages follow the pool's ownership (module docs).
                (unsafe { HostPages::external(ptr, page_bytes, pages, Arc::new(arena)) }.ok_or_else(empty)?, true)
            }
        };
        Ok(Self { mem: Arc::new(mem), mirrored, role })
    }

    /// The memory the transfer sends from and receives into.
    pub fn mem(&self) -> &Arc<HostPages> {
        &self.mem
    }

    /// Whether pages are copied between the pool and a host mirror.
    pub fn mirrored(&self) -> bool {
        self.mirrored
    }

    /// Copies `pages` of the pool to the mirror (nothing when shared), before they are sent.
    ///
    /// # Safety
    /// The caller owns these pages: nobody reads their mirror pages meanwhile (a page being
    /// sent must not be copied again while it is on the wire).
    pub unsafe fn to_host<B: Backend>(&self, b: &B, pool: &PagePool<B>, pages: &[u32]) -> Result<(), KernelError> {
        self.copy(pages, "to_host", |first, host| b.kv_to_host(pool.storage(), pool.layout(), first, host))
    }

    /// Copies `pages` of the mirror into the pool (nothing when shared), once they arrived.
    ///
    /// # Safety
    /// The caller owns these pages: no transfer writes their mirror pages meanwhile.
    pub unsafe fn to_device<B: Backend>(&self, b: &B, pool: &PagePool<B>, pages: &[u32]) -> Result<(), KernelError> {
        self.copy(pages, "to_device", |first, host| b.kv_from_host(pool.storage(), pool.layout(), first, host))
    }

    fn copy(
        &self,
        pages: &[u32],
        direction: &'static str,
        mut f: impl FnMut(u32, &mut [f32]) -> Result<(), KernelError>,
    ) -> Result<(), KernelError> {
        if !self.mirrored || pages.is_empty() {
            return Ok(());
        }
        let t0 = Instant::now();
        for (first, n) in runs(pages) {
            // SAFETY: the caller owns these pages (see `to_host` / `to_device`).
            let bytes = unsafe { self.mem.slice_mut(first, n) }
                .map_err(|e| KernelError::Shape { op: "kv mirror", detail: e.to_string() })?;
            // SAFETY: any bit pattern is an f32; `align_to_mut` only hands out aligned values.
            let (head, floats, tail) = unsafe { bytes.align_to_mut::<f32>() };
            if !head.is_empty() || !tail.is_empty() {
                return Err(KernelError::Shape { op: "kv mirror", detail: "pages are not f32-aligned".into() });
            }
            f(first, floats)?;
        }
        let bytes = pages.len() * self.mem.page_bytes();
        metrics::counter!(m::KV_MIRROR_BYTES, "role" => self.role, "direction" => direction).increment(bytes as u64);
        metrics::histogram!(m::KV_MIRROR_SECONDS, "role" => self.role, "direction" => direction)
            .record(t0.elapsed().as_secs_f64());
        Ok(())
    }
}

/// Maximal runs of consecutive page ids, as `(first, count)`.
fn runs(pages: &[u32]) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    for &p in pages {
        match out.last_mut() {
            Some((first, n)) if first.checked_add(*n) == Some(p) => *n += 1,
            _ => out.push((p, 1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_kernels::KvLayout;
    use ferry_kernels::cpu::CpuBackend;

    #[test]
    fn runs_coalesce_consecutive_ids() {
        assert_eq!(runs(&[3, 4, 5, 9, 2, 3]), vec![(3, 3), (9, 1), (2, 2)]);
        assert_eq!(runs(&[u32::MAX, 0]), vec![(u32::MAX, 1), (0, 1)]);
        assert!(runs(&[]).is_empty());
    }

    #[test]
    fn a_mirror_moves_pages_both_ways_and_a_shared_pool_needs_no_copy() {
        let layout = KvLayout { num_layers: 2, num_kv_heads: 1, head_dim: 4, page_size: 2 };
        let pf = layout.page_floats();
        let b = CpuBackend::default();
        let pool = PagePool::new(&b, layout, 6).expect("pool");
        let shared = KvHost::new(&b, &pool, false, "test").expect("shared");
        assert!(!shared.mirrored());
        assert_eq!(shared.mem().base_ptr(), pool.storage().base_ptr(), "the transfer sees the pool itself");

        let mirror = KvHost::new(&b, &pool, true, "test").expect("mirror");
        assert!(mirror.mirrored());
        let page = |v: f32| vec![v.to_le_bytes(); pf].concat();
        // Pages 1, 2 and 4 arrive in the mirror; the pool sees them only after to_device.
        // SAFETY: this test owns every page.
        unsafe {
            for (p, v) in [(1u32, 1.0f32), (2, 2.0), (4, 4.0)] {
                mirror.mem().write(p, &page(v)).expect("in bounds");
            }
            let mut got = vec![0.0; pf];
            b.kv_to_host(pool.storage(), &layout, 4, &mut got).expect("read");
            assert!(got.iter().all(|&x| x == 0.0));
            mirror.to_device(&b, &pool, &[1, 2, 4]).expect("to device");
            b.kv_to_host(pool.storage(), &layout, 4, &mut got).expect("read");
            assert!(got.iter().all(|&x| x == 4.0));
            // The pool's page 2 changes; the mirror follows on to_host of that page only.
            b.kv_from_host(pool.storage(), &layout, 2, &vec![7.0; pf]).expect("write");
            b.kv_from_host(pool.storage(), &layout, 1, &vec![8.0; pf]).expect("write");
            mirror.to_host(&b, &pool, &[2]).expect("to host");
            assert_eq!(mirror.mem().read(1, 2).expect("in bounds"), &[page(1.0), page(7.0)].concat()[..]);
            assert!(mirror.to_host(&b, &pool, &[6]).is_err(), "outside the pool");
        }
    }
}
