//! The CPU backend: f32 activations, block-quantized weights kept quantized (repacked once at
//! load: in rows, [`packed`], or in groups of 16 rows, [`tiled`], where [`qtile`] has a SIMD
//! kernel for the mode — both modes with AVX-512 VNNI (AMX tiles included) or AVX2; Q4_K as Q4_1 blocks of 32 with f32 scales and mins, Q6_K in its own layout, [`q6k`]), GEMMs with `matrixmultiply` (runtime-dispatched AVX/FMA kernels),
//! small-batch GEMV and attention with hand-vectorised dot products, and every core through
//! rayon.

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
        Ok(vec![0.0; len])
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
        let mut all = vec![0.0; rows * w.rows];
        self.matmul(x, rows, w, &mut all)?;
        for (r, row) in all.chunks_exact(w.rows).enumerate() {
            let mut at = 0;
            for (o, &n) in outs.iter_mut().zip(&w.parts) {
                o[r * n..(r + 1) * n].copy_from_slice(&row[at..at + n]);
                at += n;
            }
        }
        Ok(())
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
mod tests {
    use super::*;

    #[test]
    fn greedy_rows_pick_the_first_maximum_with_its_logprob() {
        let rows = vec![1.0, 3.0, 3.0, 0.0, /* row 2 */ -1.0, -2.0, -3.0, -4.0];
        let got = CpuBackend::default().greedy_rows(&rows, 2, 4).expect("shapes fit");
        assert_eq!((got[0].0, got[1].0), (1, 0));
        let lse = |r: &[f32]| r.iter().map(|v| v.exp()).sum::<f32>().ln();
        assert!((got[0].1 - (3.0 - lse(&rows[..4]))).abs() < 1e-6);
        assert!((got[1].1 - (-1.0 - lse(&rows[4..]))).abs() < 1e-6);
        assert!(CpuBackend::default().greedy_rows(&rows, 3, 4).is_err());
    }

    /// Stacked products give each matrix's own product to the bit (quantized and f32, one
    /// row and a batch); unlike matrices are given back.
    #[test]
    fn stacked_products_equal_the_products_apart() {
        use crate::quant::BlockFormat;
        use packed::tests::{blocks, floats};
        for math in [CpuMath::Exact, CpuMath::Fast] {
            let b = CpuBackend::new(math);
            let k = 96;
            let q =
                |n: usize, seed| b.matrix_quantized(n, k, WeightFormat::Q4_1, blocks(BlockFormat::Q4_1, n, k, seed));
            let f = |n: usize, seed| b.matrix(n, k, floats(n * k, seed));
            for (mats, again) in [
                (vec![q(40, 1), q(12, 2), q(12, 3)], vec![q(40, 1), q(12, 2), q(12, 3)]),
                (vec![f(33, 4), f(7, 5)], vec![f(33, 4), f(7, 5)]),
            ] {
                let mats: Vec<CpuMat> = mats.into_iter().map(|m| m.expect("matrix")).collect();
                let apart: Vec<CpuMat> = again.into_iter().map(|m| m.expect("matrix")).collect();
                let stacked = b.stack(mats).expect("alike matrices stack");
                for rows in [1, 9] {
                    let x = floats(rows * k, 7 + rows as u64);
                    let mut want: Vec<Vec<f32>> = apart.iter().map(|m| vec![0.0; rows * m.rows]).collect();
                    for (m, o) in apart.iter().zip(&mut want) {
                        b.matmul(&x, rows, m, o).expect("product");
                    }
                    let mut got: Vec<Vec<f32>> = want.iter().map(|o| vec![0.0; o.len()]).collect();
                    let mut outs: Vec<&mut Vec<f32>> = got.iter_mut().collect();
                    b.matmul_parts(&x, rows, &stacked, &mut outs).expect("stacked product");
                    assert_eq!(got, want, "{math:?} {rows} rows");
                    let mut short = vec![0.0; 1];
                    assert!(b.matmul_parts(&x, rows, &stacked, &mut [&mut short]).is_err());
                }
            }
            let unlike = vec![q(8, 1).expect("q"), f(8, 2).expect("f")];
            assert_eq!(b.stack(unlike).map(|_| ()).map_err(|m| m.len()), Err(2));
            let narrow = b.matrix(4, 64, floats(256, 1)).expect("f");
            assert!(b.stack(vec![f(4, 1).expect("f"), narrow]).is_err());
        }
    }

    /// Q4_K and Q6_K matrices through the backend, both modes: embedded rows are ggml's
    /// values bit for bit; products agree with the f32 matrix of those values (exact mode
    /// within 1e-5 of `Σ|x·w|`, fast within 5 %); stacked, each matrix's own product to the
    /// bit; a width that is not whole blocks of 256 is refused.
    #[test]
    fn k_formats_multiply_as_their_values() {
        use crate::quant_k::tests::k_blocks;
        use packed::tests::floats;
        let (n, k) = (32, 512);
        for math in [CpuMath::Exact, CpuMath::Fast] {
            let b = CpuBackend::new(math);
            for fmt in [WeightFormat::Q4K, WeightFormat::Q6K] {
                let data = |seed| k_blocks(fmt, n, k, seed);
                let mut values = vec![0.0; n * k];
                fmt.dequantize(&data(1), &mut values);
                let q = b.matrix_quantized(n, k, fmt, data(1)).expect("quantized");
                assert!(
                    q.resident_bytes() * 100 <= data(1).len() * 134,
                    "{math} {fmt:?} {} vs {}",
                    q.resident_bytes(),
                    data(1).len()
                );
                let f = b.matrix(n, k, values.clone()).expect("f32");
                let mut row = vec![0.0; 2 * k];
                b.embed(&q, &[3, 17], &mut row).expect("rows");
                assert_eq!(row[..k], values[3 * k..4 * k], "{fmt:?} row 3");
                assert_eq!(row[k..], values[17 * k..18 * k], "{fmt:?} row 17");
                for rows in [1, 7] {
                    let x = floats(rows * k, 5 + rows as u64);
                    let (mut got, mut want) = (vec![0.0; rows * n], vec![0.0; rows * n]);
                    b.matmul(&x, rows, &q, &mut got).expect("product");
                    b.matmul(&x, rows, &f, &mut want).expect("product");
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        let (xa, wc) = (&x[i / n * k..][..k], &values[i % n * k..][..k]);
                        let abs: f32 = xa.iter().zip(wc).map(|(p, q)| (p * q).abs()).sum();
                        let bound = if math == CpuMath::Exact { 1e-5 * abs } else { 0.05 * abs };
                        assert!((g - w).abs() <= bound, "{math} {fmt:?} {rows} rows cell {i}: {g} vs {w}");
                    }
                    let stacked = b
                        .stack(vec![
                            b.matrix_quantized(n, k, fmt, data(1)).expect("q"),
                            b.matrix_quantized(n, k, fmt, data(2)).expect("q"),
                        ])
                        .expect("alike matrices stack");
                    let (mut one, mut two) = (vec![0.0; rows * n], vec![0.0; rows * n]);
                    b.matmul_parts(&x, rows, &stacked, &mut [&mut one, &mut two]).expect("stacked");
                    let mut apart = vec![0.0; rows * n];
                    b.matmul(&x, rows, &b.matrix_quantized(n, k, fmt, data(2)).expect("q"), &mut apart)
                        .expect("product");
                    assert_eq!((&one, &two), (&got, &apart), "{math} {fmt:?} stacked, {rows} rows");
                }
                assert!(b.matrix_quantized(2, 288, fmt, vec![0; 2 * 288 / 256 * fmt.block_bytes()]).is_err());
            }
        }
    }

    #[test]
    fn pages_copy_to_a_host_arena_and_back() {
        let l = KvLayout { num_layers: 2, num_kv_heads: 1, head_dim: 4, page_size: 2 };
        let pf = l.page_floats();
        let b = CpuBackend::default();
        let pool = b.kv_pool(&l, 4).expect("pool");
        let data: Vec<f32> = (0..2 * pf).map(|i| i as f32).collect();
        b.kv_from_host(&pool, &l, 1, &data).expect("in bounds");
        let mut back = vec![0.0; 2 * pf];
        b.kv_to_host(&pool, &l, 1, &mut back).expect("in bounds");
        assert_eq!(back, data);
        let mut page0 = vec![1.0; pf];
        b.kv_to_host(&pool, &l, 0, &mut page0).expect("in bounds");
        assert!(page0.iter().all(|&v| v == 0.0), "page 0 untouched");
        assert!(matches!(b.kv_to_host(&pool, &l, 3, &mut back), Err(KernelError::PageOutOfRange { .. })));
        assert!(b.kv_from_host(&pool, &l, 0, &data[..pf - 1]).is_err());
        let host = b.host_arena(3 * pf * 4).expect("arena");
        assert_eq!((host.len_bytes(), host.pinned()), (3 * pf * 4, false));
        assert_eq!(host.base_ptr() as usize % 64, 0);
        assert_eq!(b.kv_host_ptr(&pool), Some(pool.base_ptr()));
    }

    /// Issue 23: weight matrices go on huge pages where the kernel allows, as the KV arena
    /// does. Each kind of matrix big enough to hold whole 2 MiB pages carries the advice (`hg`)
    /// once built and once stacked; whether the kernel then finds free huge pages depends on
    /// the machine's memory at the time, so the advice is what is checked.
    #[cfg(target_os = "linux")]
    #[test]
    fn big_weight_matrices_are_advised_onto_huge_pages() {
        use crate::quant::BlockFormat;
        use packed::tests::{blocks, floats};
        let (n, k) = (2048, 2048);
        let advised = |what: &str, values: *const u8, len: usize| {
            let mid = values as usize + len / 2;
            let flags = huge::vm_flags_at(mid);
            assert!(flags.iter().any(|f| f == "hg"), "{what}: VmFlags {flags:?}");
        };
        let check = |what: &str, m: &CpuMat| match &m.data {
            Weights::F32(v) => advised(what, v.as_ptr().cast(), 4 * v.len()),
            Weights::Blocks(p) => advised(what, p.quants.as_ptr(), p.quants.len()),
            Weights::Tiled(t) => advised(what, t.quants.as_ptr(), t.quants.len()),
            Weights::Q6(q) => advised(what, q.values_ptr(), m.rows * m.cols * 3 / 4),
            Weights::Half(h) => advised(what, h.values_ptr(), 2 * m.rows * m.cols),
        };
        for math in [CpuMath::Exact, CpuMath::Fast] {
            let b = CpuBackend::new(math);
            check("f32", &b.matrix(n, k, floats(n * k, 1)).expect("f32"));
            let q8 = |seed| b.matrix_quantized(n, k, WeightFormat::Q8_0, blocks(BlockFormat::Q8_0, n, k, seed));
            check("q8_0", &q8(1).expect("q8_0"));
            let stacked = b.stack(vec![q8(2).expect("q8_0"), q8(3).expect("q8_0")]).expect("stacked");
            check("stacked q8_0", &stacked);
            let q6 = crate::quant_k::tests::k_blocks(WeightFormat::Q6K, n, k, 4);
            check("q6_k", &b.matrix_quantized(n, k, WeightFormat::Q6K, q6).expect("q6_k"));
            let half: Vec<u8> = (0..n * k).flat_map(|i| half::f16::from_f32(i as f32 * 1e-6).to_le_bytes()).collect();
            check("f16", &b.matrix_quantized(n, k, WeightFormat::F16, half).expect("f16"));
        }
    }
}
