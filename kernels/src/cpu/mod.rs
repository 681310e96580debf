//! The CPU backend: f32 activations, block-quantized weights kept quantized (repacked once at
//! load: in rows, [`packed`], or in groups of 16 rows, [`tiled`], where [`qtile`] has a SIMD
//! kernel for the mode — both modes with AVX-512 VNNI (AMX tiles included) or AVX2; Q4_K as
//! Q4_1 blocks of 32, its scales and mins kept as the file has them where tiled ([`tiled_k`])
//! and widened to f32 in rows; Q6_K in its own layout, [`q6k`]), GEMMs with `matrixmultiply`
//! (runtime-dispatched AVX/FMA kernels), small-batch GEMV and attention with hand-vectorised
//! dot products, and every core through rayon.

#[cfg(target_arch = "x86_64")]
mod amx;
mod arena;
mod attention;
mod attention_step;
mod dot;
mod exp256;
mod exp512;
mod half16;
mod huge;
mod math;
mod matmul;
mod packed;
mod q6k;
mod qdot;
#[cfg(target_arch = "x86_64")]
mod qdot512;
mod qmatmul;
mod qtile;
#[cfg(target_arch = "x86_64")]
mod qtile256;
#[cfg(target_arch = "x86_64")]
mod qtile512;
mod quantize;
mod tiled;
mod tiled_k;

use std::cell::RefCell;
use std::sync::Arc;

use rayon::prelude::*;

use crate::error::check;
use crate::quant::WeightFormat;
use crate::{AttnSeq, AttnShape, Backend, HostArena, KernelError, KvLayout, PoolLayer, RopeTable, plan};

pub use arena::KvArena;
pub use dot::dot;
pub use math::CpuMath;

/// A weight matrix in host memory, row-major `(rows, cols)`: f32, or block-quantized as the
/// model file has it (dequantized in registers by the kernels).
#[derive(Debug, Clone)]
pub struct CpuMat {
    rows: usize,
    cols: usize,
    data: Weights,
    /// Rows of each matrix [`Backend::stack`] put in (empty: not stacked).
    parts: Vec<usize>,
}

#[derive(Debug, Clone)]
enum Weights {
    F32(Vec<f32>),
    /// Row after row (CPUs without AVX2).
    Blocks(packed::Packed),
    /// In groups of 16 rows (CPUs with AVX2 or AVX-512 VNNI: [`qtile`]).
    Tiled(tiled::Tiled),
    /// Q4_K with AVX2 or AVX-512 VNNI: as `Tiled` Q4_1, its scales and mins kept as the file
    /// has them and widened a group at a time ([`tiled_k`]).
    TiledK(tiled_k::TiledK),
    /// Q6_K, its own layout ([`q6k`]).
    Q6(q6k::Q6),
    /// F16 or BF16 as the file has them ([`half16`]).
    Half(half16::Half16),
}

impl CpuMat {
    /// Puts its weights on huge pages where the kernel allows ([`huge`]): done once a matrix
    /// is built or stacked, as it is read whole on every step.
    fn settled(self) -> Self {
        match &self.data {
            Weights::F32(v) => huge::collapse(v),
            Weights::Blocks(p) => {
                huge::collapse(&p.quants);
                huge::collapse(&p.scales);
                huge::collapse(&p.mins);
            }
            Weights::Tiled(t) => {
                huge::collapse(&t.quants);
                huge::collapse(&t.scales);
                huge::collapse(&t.mins);
            }
            Weights::TiledK(t) => t.settle(),
            Weights::Q6(q) => q.settle(),
            Weights::Half(h) => h.settle(),
        }
        self
    }

    /// Bytes its weights take in memory.
    pub fn resident_bytes(&self) -> usize {
        match &self.data {
            Weights::F32(v) => v.len() * 4,
            Weights::Blocks(p) => p.resident_bytes(),
            Weights::Tiled(t) => t.resident_bytes(),
            Weights::TiledK(t) => t.resident_bytes(),
            Weights::Q6(q) => q.resident_bytes(),
            Weights::Half(h) => h.resident_bytes(),
        }
    }
}

/// The CPU: f32 activations, quantized weights multiplied in the backend's [`CpuMath`].
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend {
    math: CpuMath,
}

impl CpuBackend {
    /// A backend multiplying quantized weights in `math`.
    pub fn new(math: CpuMath) -> Self {
        Self { math }
    }

    /// Its numeric mode.
    pub fn math(&self) -> CpuMath {
        self.math
    }
}

/// Rows per rayon task in element-wise kernels.
const ROWS_PER_TASK: usize = 16;

/// `len` zeros, written rather than asked of the allocator zeroed. `vec![0.0; len]` is
/// `calloc`, and jemalloc (the router's allocator, and the engine's in a process that picks
/// it) zeroes a reused extent of 16 KiB or more by handing its pages back to the system
/// (`MADV_DONTNEED`), so every page of every such buffer faulted in again on its first write,
/// each forward pass. Written zeros reuse memory that is already there.
pub(crate) fn zeroed(len: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(len);
    v.resize(len, 0.0);
    v
}

thread_local! {
    /// `matmul_parts`' stacked product (the fused QKV or gate-and-up projection), kept
    /// between calls: a new one each call, every layer of every pass, was memory for the
    /// product to fault in (a prefill chunk of 2,048 rows: 25 MB of gate and up per layer;
    /// under jemalloc, every call's, see [`zeroed`]).
    static STACKED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Mat = CpuMat;
    type Kv = Arc<KvArena>;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn pass<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        if rayon::current_thread_index().is_some() {
            return f();
        }
        // From outside the pool, a scope's body runs on one of its threads.
        rayon::scope(|_| f())
    }

    fn zeros(&self, len: usize) -> Result<Vec<f32>, KernelError> {
        Ok(zeroed(len))
    }

    fn upload(&self, data: &[f32]) -> Result<Vec<f32>, KernelError> {
        Ok(data.to_vec())
    }

    fn download(&self, buf: &Vec<f32>) -> Result<Vec<f32>, KernelError> {
        Ok(buf.clone())
    }

    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }

    fn matrix(&self, rows: usize, cols: usize, data: Vec<f32>) -> Result<CpuMat, KernelError> {
        check("matrix", data.len() == rows * cols, || format!("{} values for {rows}x{cols}", data.len()))?;
        Ok(CpuMat { rows, cols, data: Weights::F32(data), parts: Vec::new() }.settled())
    }

    fn matrix_quantized(
        &self,
        rows: usize,
        cols: usize,
        format: WeightFormat,
        data: Vec<u8>,
    ) -> Result<CpuMat, KernelError> {
        crate::check_quantized(rows, cols, format, &data)?;
        let blocks = cols / crate::quant::BLOCK;
        let data = match format {
            WeightFormat::F16 | WeightFormat::BF16 => Weights::Half(half16::Half16::new(format, rows, cols, &data)),
            WeightFormat::Q6K => Weights::Q6(q6k::Q6::new(rows, cols, &data)),
            WeightFormat::Q4K if qtile::available(self.math) => {
                Weights::TiledK(tiled_k::TiledK::new(rows, cols, &data))
            }
            // Q4_K here only in rows (no tiled kernel for this CPU): f32 scales and mins.
            WeightFormat::Q4_0 | WeightFormat::Q4_1 | WeightFormat::Q8_0 | WeightFormat::Q4K => {
                let (fmt, block) = packed::blocks_of(format, cols, &data)
                    .ok_or(KernelError::Shape { op: "matrix_quantized", detail: format!("{format:?} in blocks") })?;
                if qtile::available(self.math) {
                    Weights::Tiled(tiled::Tiled::from_wide(fmt, rows, blocks, block))
                } else {
                    Weights::Blocks(packed::Packed::from_wide(fmt, rows, blocks, block))
                }
            }
        };
        Ok(CpuMat { rows, cols, data, parts: Vec::new() }.settled())
    }

    fn mat_shape(&self, mat: &CpuMat) -> (usize, usize) {
        (mat.rows, mat.cols)
    }

    fn stack(&self, mats: Vec<CpuMat>) -> Result<CpuMat, Vec<CpuMat>> {
        let alike = |a: &CpuMat, b: &CpuMat| {
            a.cols == b.cols
                && a.parts.is_empty()
                && b.parts.is_empty()
                && match (&a.data, &b.data) {
                    (Weights::F32(_), Weights::F32(_)) => true,
                    (Weights::Blocks(p), Weights::Blocks(q)) => p.fmt == q.fmt,
                    (Weights::Tiled(p), Weights::Tiled(q)) => p.fmt == q.fmt,
                    (Weights::TiledK(_), Weights::TiledK(_)) => true,
                    (Weights::Q6(_), Weights::Q6(_)) => true,
                    (Weights::Half(p), Weights::Half(q)) => p.bf16 == q.bf16,
                    _ => false,
                }
        };
        if mats.len() < 2 || !mats.iter().all(|m| alike(&mats[0], m)) {
            return Err(mats);
        }
        let (rows, cols) = (mats.iter().map(|m| m.rows).sum(), mats[0].cols);
        let parts = mats.iter().map(|m| m.rows).collect();
        let mut all = mats.into_iter().map(|m| m.data);
        let data = match all.next() {
            Some(Weights::F32(mut v)) => {
                all.for_each(|w| {
                    if let Weights::F32(u) = w {
                        v.extend(u)
                    }
                });
                Weights::F32(v)
            }
            Some(Weights::Blocks(mut p)) => {
                all.for_each(|w| {
                    if let Weights::Blocks(q) = w {
                        p.append(q)
                    }
                });
                Weights::Blocks(p)
            }
            Some(Weights::Tiled(mut p)) => {
                all.for_each(|w| {
                    if let Weights::Tiled(q) = w {
                        p.append(q)
                    }
                });
                Weights::Tiled(p)
            }
            Some(Weights::TiledK(mut p)) => {
                all.for_each(|w| {
                    if let Weights::TiledK(q) = w {
                        p.append(q)
                    }
                });
                Weights::TiledK(p)
            }
            Some(Weights::Q6(mut p)) => {
                all.for_each(|w| {
                    if let Weights::Q6(q) = w {
                        p.append(q)
                    }
                });
                Weights::Q6(p)
            }
            Some(Weights::Half(mut p)) => {
                all.for_each(|w| {
                    if let Weights::Half(q) = w {
                        p.append(q)
                    }
                });
                Weights::Half(p)
            }
            None => return Err(Vec::new()),
        };
        Ok(CpuMat { rows, cols, data, parts }.settled())
    }

    fn matmul_parts(
        &self,
        x: &Vec<f32>,
        rows: usize,
        w: &CpuMat,
        outs: &mut [&mut Vec<f32>],
    ) -> Result<(), KernelError> {
        check("matmul_parts", w.parts.len() == outs.len() && x.len() == rows * w.cols, || {
            format!("{} parts, {} outputs; x {} for {rows} rows of {}", w.parts.len(), outs.len(), x.len(), w.cols)
        })?;
        for (o, &n) in outs.iter().zip(&w.parts) {
            check("matmul_parts", o.len() == rows * n, || format!("an output of {} for {rows} rows of {n}", o.len()))?;
        }
        // One product into the stacked width, then each row's parts to their outputs.
        STACKED.with(|held| {
            // A pass run on this thread while another waits inside its product (rayon steals
            // work) finds the scratch taken and uses a fresh one.
            let (mut held, mut fresh) = (held.try_borrow_mut(), Vec::new());
            let all = held.as_deref_mut().unwrap_or(&mut fresh);
            all.clear();
            all.resize(rows * w.rows, 0.0);
            self.matmul(x, rows, w, all)?;
            for (r, row) in all.chunks_exact(w.rows).enumerate() {
                let mut at = 0;
                for (o, &n) in outs.iter_mut().zip(&w.parts) {
                    o[r * n..(r + 1) * n].copy_from_slice(&row[at..at + n]);
                    at += n;
                }
            }
            Ok(())
        })
    }

    fn embed(&self, table: &CpuMat, ids: &[u32], out: &mut Vec<f32>) -> Result<(), KernelError> {
        let d = table.cols;
        check("embed", out.len() == ids.len() * d, || format!("out {} for {} ids of {d}", out.len(), ids.len()))?;
        for (row, &id) in out.chunks_exact_mut(d).zip(ids) {
            if id as usize >= table.rows {
                return Err(KernelError::TokenOutOfRange { id, vocab: table.rows });
            }
            let i = id as usize;
            match &table.data {
                Weights::F32(v) => row.copy_from_slice(&v[i * d..(i + 1) * d]),
                Weights::Blocks(p) => p.dequantize_rows(i, row),
                Weights::Tiled(t) => t.dequantize_row(i, row),
                Weights::TiledK(t) => qtile::TiledWeights::dequantize_row(t, i, row),
                Weights::Q6(q) => q.dequantize_rows(i, row),
                Weights::Half(h) => h.dequantize_rows(i, row),
            }
        }
        Ok(())
    }

    fn matmul(&self, x: &Vec<f32>, rows: usize, w: &CpuMat, out: &mut Vec<f32>) -> Result<(), KernelError> {
        check("matmul", x.len() == rows * w.cols && out.len() == rows * w.rows, || {
            format!("x {} out {} for {rows} rows and {}x{}", x.len(), out.len(), w.rows, w.cols)
        })?;
        match &w.data {
            Weights::F32(v) => matmul::matmul_t(x, rows, v, w.rows, w.cols, out),
            Weights::Blocks(p) => qmatmul::qmatmul_t(self.math, x, rows, p, w.rows, w.cols, out),
            Weights::Tiled(t) => qtile::qmatmul_tiled(self.math, x, rows, t, out),
            Weights::TiledK(t) => qtile::qmatmul_tiled(self.math, x, rows, t, out),
            Weights::Q6(q) => q6k::matmul(self.math, x, rows, q, out),
            Weights::Half(h) => half16::matmul(x, rows, h, out),
        }
        Ok(())
    }

    fn add_bias(&self, x: &mut Vec<f32>, bias: &Vec<f32>) -> Result<(), KernelError> {
        check("add_bias", !bias.is_empty() && x.len().is_multiple_of(bias.len()), || {
            format!("{} by {}", x.len(), bias.len())
        })?;
        for row in x.chunks_exact_mut(bias.len()) {
            row.iter_mut().zip(bias).for_each(|(a, b)| *a += b);
        }
        Ok(())
    }

    fn rms_norm(&self, x: &Vec<f32>, weight: &Vec<f32>, eps: f32, out: &mut Vec<f32>) -> Result<(), KernelError> {
        let d = weight.len();
        check("rms_norm", d > 0 && x.len().is_multiple_of(d) && out.len() == x.len(), || {
            format!("x {} w {d}", x.len())
        })?;
        out.par_chunks_mut(d * ROWS_PER_TASK).zip(x.par_chunks(d * ROWS_PER_TASK)).for_each(|(o, x)| {
            for (o, x) in o.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
                let ms = x.iter().map(|v| v * v).sum::<f32>() / d as f32;
                let scale = 1.0 / (ms + eps).sqrt();
                o.iter_mut().zip(x).zip(weight).for_each(|((o, x), w)| *o = x * scale * w);
            }
        });
        Ok(())
    }

    fn rope(&self, x: &mut Vec<f32>, n_heads: usize, positions: &[u32], table: &RopeTable) -> Result<(), KernelError> {
        let hd = table.head_dim();
        let width = n_heads * hd;
        check("rope", x.len() == positions.len() * width, || format!("x {} for {} rows", x.len(), positions.len()))?;
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= table.max_positions()) {
            return Err(KernelError::Shape { op: "rope", detail: format!("position {p} past the table") });
        }
        let half = hd / 2;
        x.par_chunks_mut(width).zip(positions.par_iter()).for_each(|(row, &p)| {
            let (cos, sin) = table.row(p as usize);
            for head in row.chunks_exact_mut(hd) {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (x0, x1) = (a[i], b[i]);
                    a[i] = x0 * cos[i] - x1 * sin[i];
                    b[i] = x1 * cos[i] + x0 * sin[i];
                }
            }
        });
        Ok(())
    }

    fn silu_mul(&self, gate: &Vec<f32>, up: &Vec<f32>, out: &mut Vec<f32>) -> Result<(), KernelError> {
        check("silu_mul", gate.len() == up.len() && out.len() == up.len(), || {
            format!("{} {} {}", gate.len(), up.len(), out.len())
        })?;
        #[cfg(target_arch = "x86_64")]
        let (wide, narrow) = (exp512::here(), exp256::here());
        out.par_chunks_mut(4096).zip(gate.par_chunks(4096).zip(up.par_chunks(4096))).for_each(|(o, (g, u))| {
            #[cfg(target_arch = "x86_64")]
            {
                if wide {
                    // SAFETY: `here` said this CPU runs it.
                    return unsafe { exp512::silu_mul(g, u, o) };
                }
                if narrow {
                    // SAFETY: as above.
                    return unsafe { exp256::silu_mul(g, u, o) };
                }
            }
            exp512::silu_mul_plain(g, u, o);
        });
        Ok(())
    }

    fn add_assign(&self, x: &mut Vec<f32>, y: &Vec<f32>) -> Result<(), KernelError> {
        check("add_assign", x.len() == y.len(), || format!("{} vs {}", x.len(), y.len()))?;
        x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn kv_pool(&self, layout: &KvLayout, num_pages: usize) -> Result<Arc<KvArena>, KernelError> {
        let len = layout.page_floats().checked_mul(num_pages).ok_or(KernelError::OutOfMemory { bytes: usize::MAX })?;
        Ok(Arc::new(KvArena::new(len)?))
    }

    fn write_kv(
        &self,
        pool: &Arc<KvArena>,
        layout: &KvLayout,
        layer: usize,
        slots: &[(u32, u32)],
        k: &Vec<f32>,
        v: &Vec<f32>,
    ) -> Result<(), KernelError> {
        let w = layout.slot_floats();
        let pages = pool.len() / layout.page_floats().max(1);
        let offsets = plan::kv_offsets(layout, layer, slots, k.len(), v.len(), pages)?;
        let v_skip = layout.page_size * w;
        for (i, &ko) in offsets.iter().enumerate() {
            // SAFETY: the forward pass owns the pages of the sequences it computes; the plan
            // checked every page and slot against the pool.
            unsafe {
                pool.write(ko as usize, &k[i * w..(i + 1) * w])?;
                pool.write(ko as usize + v_skip, &v[i * w..(i + 1) * w])?;
            }
        }
        Ok(())
    }

    fn attention(
        &self,
        q: &Vec<f32>,
        kv: PoolLayer<'_, Arc<KvArena>>,
        shape: AttnShape,
        seqs: &[AttnSeq<'_>],
        out: &mut Vec<f32>,
    ) -> Result<(), KernelError> {
        attention::attention(q, kv.pool, kv.layout, kv.layer, shape, seqs, out)
    }

    fn gather_rows(&self, x: &Vec<f32>, width: usize, rows: &[usize], out: &mut Vec<f32>) -> Result<(), KernelError> {
        check(
            "gather_rows",
            out.len() == rows.len() * width && rows.iter().all(|&r| (r + 1) * width <= x.len()),
            || format!("{} rows of {width} from {}", rows.len(), x.len()),
        )?;
        for (o, &r) in out.chunks_exact_mut(width).zip(rows) {
            o.copy_from_slice(&x[r * width..(r + 1) * width]);
        }
        Ok(())
    }

    fn greedy_rows(&self, logits: &Vec<f32>, rows: usize, vocab: usize) -> Result<Vec<(u32, f32)>, KernelError> {
        check("greedy_rows", logits.len() == rows * vocab && vocab > 0, || {
            format!("{} values for {rows} rows of {vocab}", logits.len())
        })?;
        Ok(logits.chunks_exact(vocab).map(greedy).collect())
    }

    fn device_memory(&self) -> Option<usize> {
        None
    }

    fn kv_host_ptr(&self, pool: &Arc<KvArena>) -> Option<*mut u8> {
        Some(pool.base_ptr())
    }

    fn host_arena(&self, bytes: usize) -> Result<HostArena, KernelError> {
        let arena = KvArena::new(bytes.div_ceil(4))?;
        let ptr = std::ptr::NonNull::new(arena.base_ptr()).ok_or(KernelError::OutOfMemory { bytes })?;
        // SAFETY: the arena holds at least `bytes` bytes, 64-byte aligned, until it drops.
        Ok(unsafe { HostArena::new(ptr, bytes, false, Box::new(arena)) })
    }

    fn kv_to_host(
        &self,
        pool: &Arc<KvArena>,
        layout: &KvLayout,
        first: u32,
        dst: &mut [f32],
    ) -> Result<(), KernelError> {
        let (off, n) = plan::page_span(layout, first, dst.len(), pool.len() / layout.page_floats().max(1))?;
        // SAFETY: whoever copies pages out owns them (page-ownership rule): no writer meanwhile.
        dst.copy_from_slice(unsafe { pool.read(off, n) }?);
        Ok(())
    }

    fn kv_from_host(&self, pool: &Arc<KvArena>, layout: &KvLayout, first: u32, src: &[f32]) -> Result<(), KernelError> {
        let (off, _) = plan::page_span(layout, first, src.len(), pool.len() / layout.page_floats().max(1))?;
        // SAFETY: whoever copies pages in owns them (page-ownership rule): nobody else touches them.
        unsafe { pool.write(off, src) }
    }
}

/// The arg max of `row` (the lowest index among equals) and its log-softmax.
fn greedy(row: &[f32]) -> (u32, f32) {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    let m = row[best];
    let sum: f32 = row.iter().map(|v| (v - m).exp()).sum();
    (best as u32, -sum.ln())
}

#[cfg(test)]
mod tests;
