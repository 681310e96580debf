//! Per-pass tables kept on the device between calls.
//!
//! A forward pass hands every layer the same index tables: the rows' positions (RoPE), the
//! slots their K/V go to, the attention plan. Uploading them per call cost the first GPU
//! measurement most of a decode step (seven small synchronous copies per layer, 210 per
//! SmolLM2 step). Each kind of table now keeps its last upload; a call whose table equals it
//! (compared on the host, a few hundred values) reuses the device copy, so only the first
//! layer of a pass uploads.
//!
//! Safe on one stream: a replaced table is freed stream-ordered, after the kernels that read
//! it, and a kept table is never written by a kernel.

use parking_lot::{Mutex, MutexGuard};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};

use crate::KernelError;

/// A table's host values and their device copy.
type Kept<T> = (Vec<T>, Arc<CudaSlice<T>>);

/// The last upload of one kind of table.
pub(super) struct Memo<T> {
    last: Mutex<Option<Kept<T>>>,
}

impl<T> Default for Memo<T> {
    fn default() -> Self {
        Self { last: Mutex::new(None) }
    }
}

impl<T: DeviceRepr + PartialEq> Memo<T> {
    /// `host` on the device: the kept copy when it holds the same values, else a new upload
    /// (which replaces it).
    pub(super) fn get(&self, stream: &Arc<CudaStream>, host: Vec<T>) -> Result<Arc<CudaSlice<T>>, KernelError> {
        let mut last = self.last.lock();
        if let Some((h, d)) = last.as_ref()
            && *h == host
        {
            return Ok(Arc::clone(d));
        }
        let dev = Arc::new(
            stream.clone_htod(&host).map_err(|e| KernelError::Unavailable(format!("CUDA table upload: {e}")))?,
        );
        *last = Some((host, Arc::clone(&dev)));
        Ok(dev)
    }
}

/// The tables a forward pass repeats per layer.
#[derive(Default)]
pub(super) struct Tables {
    /// RoPE cos then sin rows of the pass's positions.
    pub rope: Memo<f32>,
    /// K offsets of the pass's slots in layer 0 (a layer adds a fixed offset).
    pub kv_slots: Memo<u64>,
    /// Attention plan: rows' sequences, rows' positions, pages, sequences' first page.
    pub row_seq: Memo<i32>,
    pub row_pos: Memo<i32>,
    pub pages: Memo<u32>,
    pub seq_page0: Memo<u32>,
}

/// A scratch buffer reused by every matrix product (the bf16 copy of its input): one
/// allocation that grows, instead of one per product.
#[derive(Default)]
pub(super) struct Scratch {
    buf: Mutex<Option<CudaSlice<u16>>>,
}

impl Scratch {
    /// At least `len` values; its old contents are garbage. Kernels on the one stream use it
    /// in turn, so reusing it is ordered.
    pub(super) fn take(
        &self,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<MutexGuard<'_, Option<CudaSlice<u16>>>, KernelError> {
        let mut g = self.buf.lock();
        if g.as_ref().is_none_or(|b| b.len() < len) {
            *g = None;
            // SAFETY: every user writes the values it reads (to_bf16 fills it before the GEMM).
            let b =
                unsafe { stream.alloc::<u16>(len.max(1)) }.map_err(|_| KernelError::OutOfMemory { bytes: len * 2 })?;
            *g = Some(b);
        }
        Ok(g)
    }
}
