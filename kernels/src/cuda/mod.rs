//! The NVIDIA backend (cargo feature `cuda`), on cudarc with the CUDA libraries loaded at run
//! time: the workspace builds without CUDA, and [`CudaBackend::new`] fails with a clear
//! [`KernelError::Unavailable`] where the driver, NVRTC or cuBLAS is missing.
//!
//! - Weights live on the device in bf16; GEMMs are cuBLAS `GemmEx` with bf16 inputs and f32
//!   accumulation and output (activations are rounded to bf16 on the way in).
//! - Activations and the KV page pool are f32 in device memory, in the same page-major layout
//!   as the CPU backend (so pages move between backends unchanged).
//! - Everything else is our own kernels (`kernels.cu`), compiled once per backend with NVRTC:
//!   embedding, RMSNorm, RoPE, SiLU-gate, residual adds, K/V page writes, paged attention (a
//!   block per query row and head whose warps split the positions, online softmax merged
//!   across warps; decode and prefill-chunk shapes alike),
//!   row gathers and a greedy arg max.
//! - Shapes are checked and index tables built on the host ([`crate::plan`]), as the CPU
//!   backend does, so a bad call is an error, never a device fault.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

use crate::error::check;
use crate::{AttnSeq, AttnShape, Backend, HostArena, KernelError, KvLayout, PoolLayer, RopeTable, plan};

mod host;
mod profile;
mod tables;

pub use profile::OpTime;

/// The kernels' source, compiled at run time.
const SOURCE: &str = include_str!("kernels.cu");
const KERNELS: [&str; 11] = [
    "to_bf16",
    "embed",
    "add_bias",
    "rms_norm",
    "rope",
    "silu_mul",
    "add_assign",
    "write_kv",
    "gather_rows",
    "attention",
    "greedy_rows",
];
/// Threads per block of the element-wise kernels.
const BLOCK: u32 = 256;
/// Warps per attention block (`ATT_WARPS` in kernels.cu).
const ATTENTION_WARPS: u32 = 8;

/// A weight matrix on the device: `(rows, cols)` row-major bf16 (raw bits).
pub struct CudaMat {
    rows: usize,
    cols: usize,
    data: CudaSlice<u16>,
}

/// The KV page pool in device memory (f32, page-major).
pub type CudaKv = Arc<CudaSlice<f32>>;

/// One NVIDIA GPU.
pub struct CudaBackend {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: HashMap<&'static str, CudaFunction>,
    name: String,
    /// Per-pass index tables kept between layers.
    tables: tables::Tables,
    /// The bf16 copy of a matrix product's input.
    scratch: tables::Scratch,
    /// Per-operation times (FERRY_CUDA_PROFILE=1).
    profile: Option<profile::Profile>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend").field("device", &self.name).finish_non_exhaustive()
    }
}

fn driver(what: &str) -> impl Fn(cudarc::driver::DriverError) -> KernelError + '_ {
    move |e| KernelError::Unavailable(format!("CUDA {what}: {e}"))
}

/// Whether this machine has the libraries the CUDA backend loads (the driver, NVRTC, cuBLAS);
/// the first missing one otherwise.
pub fn missing_library() -> Option<&'static str> {
    // SAFETY: these only try to open shared libraries by name.
    unsafe {
        if !cudarc::driver::sys::is_culib_present() {
            return Some("the NVIDIA driver library (libcuda.so)");
        }
        if !cudarc::nvrtc::sys::is_culib_present() {
            return Some("NVRTC (libnvrtc.so, CUDA toolkit)");
        }
        if !cudarc::cublas::sys::is_culib_present() {
            return Some("cuBLAS (libcublas.so, CUDA toolkit)");
        }
    }
    None
}

/// Compiles the kernels to PTX with NVRTC (no GPU needed for this step).
pub fn compile() -> Result<cudarc::nvrtc::Ptx, KernelError> {
    cudarc::nvrtc::compile_ptx_with_opts(
        SOURCE,
        cudarc::nvrtc::CompileOptions { name: Some("ferry_kernels.cu".into()), ..Default::default() },
    )
    .map_err(|e| KernelError::Unavailable(format!("compiling the CUDA kernels with NVRTC: {e}")))
}

impl CudaBackend {
    /// Opens GPU `ordinal`, compiles the kernels and creates the cuBLAS handle. Fails with
    /// [`KernelError::Unavailable`] naming the device flag and what is missing on a machine
    /// without a GPU, its driver or the CUDA libraries, or without GPU `ordinal`.
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        Self::open(ordinal).map_err(|e| match e {
            KernelError::Unavailable(why) if !why.starts_with("--device cuda") => {
                KernelError::Unavailable(format!("--device cuda:{ordinal}: {why}"))
            }
            other => other,
        })
    }

    fn open(ordinal: usize) -> Result<Self, KernelError> {
        if let Some(lib) = missing_library() {
            return Err(KernelError::Unavailable(format!(
                "--device cuda needs an NVIDIA GPU with its driver and the CUDA 12 libraries; {lib} was not found"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("device"))?;
        let name = ctx.name().unwrap_or_else(|_| format!("GPU {ordinal}"));
        let stream = ctx.default_stream();
        let ptx = compile()?;
        let module = ctx.load_module(ptx).map_err(driver("module"))?;
        let mut kernels = HashMap::new();
        for k in KERNELS {
            kernels.insert(k, module.load_function(k).map_err(driver("kernel"))?);
        }
        let blas = CudaBlas::new(Arc::clone(&stream)).map_err(|e| KernelError::Unavailable(format!("cuBLAS: {e}")))?;
        Ok(Self {
            stream,
            blas,
            kernels,
            name,
            tables: Default::default(),
            scratch: Default::default(),
            profile: profile::Profile::from_env(),
        })
    }

    /// GPU 0 for the GPU tests (feature `gpu-tests`, which only a GPU machine builds): a
    /// missing GPU, driver or library, or a module or kernel that does not load, fails the test
    /// that asked, with the reason.
    #[cfg(feature = "gpu-tests")]
    pub fn for_tests() -> Self {
        Self::new(0).unwrap_or_else(|e| panic!("the GPU tests (feature gpu-tests) need a working GPU 0: {e}"))
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// Per-operation times since the last call, with FERRY_CUDA_PROFILE=1 (else empty).
    pub fn take_profile(&self) -> Vec<(String, OpTime)> {
        self.profile.as_ref().map(profile::Profile::take).unwrap_or_default()
    }

    /// Times the rest of the calling operation when profiling.
    fn timed(&self, op: impl FnOnce() -> String) -> Option<profile::Timed<'_>> {
        self.profile.as_ref().map(|p| p.start(&self.stream, op()))
    }

    fn f(&self, name: &'static str) -> &CudaFunction {
        &self.kernels[name]
    }

    fn err(e: cudarc::driver::DriverError) -> KernelError {
        KernelError::Unavailable(format!("CUDA: {e}"))
    }

    fn upload_u32(&self, v: &[u32]) -> Result<CudaSlice<u32>, KernelError> {
        self.stream.clone_htod(v).map_err(Self::err)
    }
}

/// The cos rows then the sin rows (`[positions.len()][head_dim / 2]` each) of `positions`.
fn rope_rows(table: &RopeTable, positions: &[u32]) -> Result<Vec<f32>, KernelError> {
    let half = table.head_dim() / 2;
    let mut cos = Vec::with_capacity(positions.len() * half * 2);
    let mut sin = Vec::with_capacity(positions.len() * half);
    for &p in positions {
        check("rope", (p as usize) < table.max_positions(), || {
            format!("position {p} past the table's {}", table.max_positions())
        })?;
        let (c, s) = table.row(p as usize);
        cos.extend_from_slice(c);
        sin.extend_from_slice(s);
    }
    cos.extend_from_slice(&sin);
    Ok(cos)
}

fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: ((n as u32).div_ceil(BLOCK).max(1), 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

fn fits_u32(op: &'static str, n: usize) -> Result<u32, KernelError> {
    u32::try_from(n)
        .map_err(|_| KernelError::Shape { op, detail: format!("{n} values exceed the kernel's 32-bit index") })
}

impl Backend for CudaBackend {
    type Buf = CudaSlice<f32>;
    type Mat = CudaMat;
    type Kv = CudaKv;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn zeros(&self, len: usize) -> Result<Self::Buf, KernelError> {
        let _t = self.timed(|| "zeros".into());
        self.stream.alloc_zeros(len).map_err(|_| KernelError::OutOfMemory { bytes: len * 4 })
    }

    fn upload(&self, data: &[f32]) -> Result<Self::Buf, KernelError> {
        self.stream.clone_htod(data).map_err(Self::err)
    }

    fn download(&self, buf: &Self::Buf) -> Result<Vec<f32>, KernelError> {
        self.stream.clone_dtoh(buf).map_err(Self::err)
    }

    fn len(&self, buf: &Self::Buf) -> usize {
        buf.len()
    }

    fn matrix(&self, rows: usize, cols: usize, data: Vec<f32>) -> Result<CudaMat, KernelError> {
        check("matrix", data.len() == rows * cols, || format!("{} values for {rows}x{cols}", data.len()))?;
        let bits: Vec<u16> = data.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
        let data = self.stream.clone_htod(&bits).map_err(|_| KernelError::OutOfMemory { bytes: bits.len() * 2 })?;
        Ok(CudaMat { rows, cols, data })
    }

    fn mat_shape(&self, mat: &CudaMat) -> (usize, usize) {
        (mat.rows, mat.cols)
    }

    fn embed(&self, table: &CudaMat, ids: &[u32], out: &mut Self::Buf) -> Result<(), KernelError> {
        let _t = self.timed(|| "embed".into());
        let d = table.cols;
        check("embed", out.len() == ids.len() * d, || format!("out {} for {} ids of {d}", out.len(), ids.len()))?;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= table.rows) {
            return Err(KernelError::TokenOutOfRange { id, vocab: table.rows });
        }
        if ids.is_empty() {
            return Ok(());
        }
        let dev_ids = self.upload_u32(ids)?;
        let cols = fits_u32("embed", d)?;
        let mut b = self.stream.launch_builder(self.f("embed"));
        b.arg(&table.data).arg(&dev_ids).arg(out).arg(&cols);
        let cfg = LaunchConfig { grid_dim: (ids.len() as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: every id is inside the table and `out` holds `ids.len() * cols` values.
        unsafe { b.launch(cfg) }.map_err(Self::err)?;
        Ok(())
    }

    fn matmul(&self, x: &Self::Buf, rows: usize, w: &CudaMat, out: &mut Self::Buf) -> Result<(), KernelError> {
        let _t = self.timed(|| format!("matmul {}x{}", w.rows, w.cols));
        let (n, k) = (w.rows, w.cols);
        check("matmul", x.len() == rows * k && out.len() == rows * n, || {
            format!("x {} out {} for {rows} rows through {n}x{k}", x.len(), out.len())
        })?;
        if rows == 0 {
            return Ok(());
        }
        let len = fits_u32("matmul", x.len())?;
        let (m_, n_, k_) = (
            i32::try_from(n).map_err(|_| KernelError::Shape { op: "matmul", detail: format!("{n} rows") })?,
            i32::try_from(rows).map_err(|_| KernelError::Shape { op: "matmul", detail: format!("{rows} rows") })?,
            i32::try_from(k).map_err(|_| KernelError::Shape { op: "matmul", detail: format!("{k} cols") })?,
        );
        let mut scratch = self.scratch.take(&self.stream, x.len())?;
        let Some(xb) = scratch.as_mut() else { return Err(KernelError::OutOfMemory { bytes: x.len() * 2 }) };
        let mut b = self.stream.launch_builder(self.f("to_bf16"));
        b.arg(x).arg(&mut *xb).arg(&len);
        // SAFETY: both buffers hold `len` values.
        unsafe { b.launch(elementwise(x.len())) }.map_err(Self::err)?;
        // Row-major out[rows, n] = x[rows, k] · Wᵀ is column-major outᵀ = op(W) · xᵀ with W's
        // (n, k) row-major storage read as a k×n column-major matrix, transposed.
        let (alpha, beta) = (1.0f32, 0.0f32);
        use cudarc::cublas::sys;
        let (wp, _w) = w.data.device_ptr(&self.stream);
        let (xp, _x) = xb.device_ptr(&self.stream);
        let (op, _o) = out.device_ptr_mut(&self.stream);
        // SAFETY: the pointers are live device buffers of the checked sizes, on the handle's
        // stream; alpha and beta are host scalars (the handle's default pointer mode).
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                m_,
                n_,
                k_,
                (&alpha as *const f32).cast(),
                wp as *const _,
                sys::cudaDataType::CUDA_R_16BF,
                k_,
                xp as *const _,
                sys::cudaDataType::CUDA_R_16BF,
                k_,
                (&beta as *const f32).cast(),
                op as *mut _,
                sys::cudaDataType::CUDA_R_32F,
                m_,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| KernelError::Unavailable(format!("cuBLAS GemmEx: {e}")))?;
        Ok(())
    }

    fn add_bias(&self, x: &mut Self::Buf, bias: &Self::Buf) -> Result<(), KernelError> {
        check("add_bias", !bias.is_empty() && x.len() % bias.len() == 0, || format!("{} by {}", x.len(), bias.len()))?;
        let (n, width) = (fits_u32("add_bias", x.len())?, bias.len() as u32);
        let cfg = elementwise(x.len());
        let mut b = self.stream.launch_builder(self.f("add_bias"));
        b.arg(x).arg(bias).arg(&n).arg(&width);
        // SAFETY: sizes checked.
        unsafe { b.launch(cfg) }.map_err(Self::err)?;
        Ok(())
    }

    fn rms_norm(&self, x: &Self::Buf, weight: &Self::Buf, eps: f32, out: &mut Self::Buf) -> Result<(), KernelError> {
        let _t = self.timed(|| "rms_norm".into());
        let d = weight.len();
        check("rms_norm", d > 0 && x.len() % d == 0 && out.len() == x.len(), || format!("x {} w {d}", x.len()))?;
        let rows = x.len() / d;
        if rows == 0 {
            return Ok(());
        }
        let width = fits_u32("rms_norm", d)?;
        let mut b = self.stream.launch_builder(self.f("rms_norm"));
        b.arg(x).arg(weight).arg(out).arg(&width).arg(&eps);
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: sizes checked; the kernel's reduction assumes 256 threads per block.
        unsafe { b.launch(cfg) }.map_err(Self::err)?;
        Ok(())
    }

    fn rope(&self, x: &mut Self::Buf, n_heads: usize, positions: &[u32], table: &RopeTable) -> Result<(), KernelError> {
        let _t = self.timed(|| "rope".into());
        let hd = table.head_dim();
        check("rope", x.len() == positions.len() * n_heads * hd, || {
            format!("x {} for {} rows", x.len(), positions.len())
        })?;
        let cs = rope_rows(table, positions)?;
        if positions.is_empty() {
            return Ok(());
        }
        let cs = self.tables.rope.get(&self.stream, cs)?;
        let (rows, heads, head_dim) = (positions.len() as u32, n_heads as u32, hd as u32);
        let cfg = elementwise(positions.len() * n_heads * (hd / 2));
        let mut b = self.stream.launch_builder(self.f("rope"));
        b.arg(x).arg(&*cs).arg(&rows).arg(&heads).arg(&head_dim);
        // SAFETY: sizes checked; `cs` holds the cos and sin rows of every position.
        unsafe { b.launch(cfg) }.map_err(Self::err)?;
        Ok(())
    }

    fn silu_mul(&self, gate: &Self::Buf, up: &Self::Buf, out: &mut Self::Buf) -> Result<(), KernelError> {
        let _t = self.timed(|| "silu_mul".into());
        check("silu_mul", gate.len() == up.len() && out.len() == up.len(), || {
            format!("{} {} {}", gate.len(), up.len(), out.len())
        })?;
        let n = fits_u32("silu_mul", out.len())?;
        let cfg = elementwise(out.len());
        let mut b = self.stream.launch_builder(self.f("silu_mul"));
        b.arg(gate).arg(up).arg(out).arg(&n);
        // SAFETY: sizes checked.
        unsafe { b.launch(cfg) }.map_err(Self::err)?;
        Ok(())
    }

    fn add_assign(&self, x: &mut Self::Buf, y: &Self::Buf) -> Result<(), KernelError> {
        let _t = self.timed(|| "add_assign".into());
        check("add_assign", x.len() == y.len(), || format!("{} vs {}", x.len(), y.len()))?;
        let n = fits_u32("add_assign", x.len())?;
        let cfg = elementwise(x.len());
        let mut b = self.stream.launch_builder(self.f("add_assign"));
        b.arg(x).arg(y).arg(&n);
        // SAFETY: sizes checked.
        unsafe { b.launch(cfg) }.map_err(Self::err)?;
        Ok(())
    }

    fn kv_pool(&self, layout: &KvLayout, num_pages: usize) -> Result<CudaKv, KernelError> {
        let len = layout.page_floats().checked_mul(num_pages).ok_or(KernelError::OutOfMemory { bytes: usize::MAX })?;
        // Zeroed once here: the first touch happens at start, not under load.
        let pool = self.stream.alloc_zeros::<f32>(len).map_err(|_| KernelError::OutOfMemory { bytes: len * 4 })?;
        Ok(Arc::new(pool))
    }

    fn write_kv(
        &self,
        pool: &CudaKv,
        layout: &KvLayout,
        layer: usize,
        slots: &[(u32, u32)],
        k: &Self::Buf,
        v: &Self::Buf,
    ) -> Result<(), KernelError> {
        let _t = self.timed(|| "write_kv".into());
        let pages = pool.len() / layout.page_floats().max(1);
        check("write_kv", layer < layout.num_layers, || format!("layer {layer} of {}", layout.num_layers))?;
        // Layer 0's offsets, the same table for every layer of a pass; the layer's K block
        // is a fixed offset further.
        let offsets = plan::kv_offsets(layout, 0, slots, k.len(), v.len(), pages)?;
        if slots.is_empty() {
            return Ok(());
        }
        let offsets = self.tables.kv_slots.get(&self.stream, offsets)?;
        let layer_off = layout.offset(0, layer, false, 0) as u64;
        let v_skip = (layout.page_size * layout.slot_floats()) as u64;
        let (n, w) = (slots.len() as u32, fits_u32("write_kv", layout.slot_floats())?);
        // The pool is shared with the transfer side; its pages are written by their owner only.
        let (pp, _p) = pool.device_ptr(&self.stream);
        let cfg = elementwise(k.len());
        let mut b = self.stream.launch_builder(self.f("write_kv"));
        b.arg(&pp).arg(k).arg(v).arg(&*offsets).arg(&layer_off).arg(&v_skip).arg(&n).arg(&w);
        // SAFETY: every offset (plus the layer's, and its V `v_skip` further) plus a slot lies
        // inside the pool (checked by the plan for layer 0, and layer < num_layers); k and v
        // hold `n * w` values.
        unsafe { b.launch(cfg) }.map_err(Self::err)?;
        Ok(())
    }

    fn attention(
        &self,
        q: &Self::Buf,
        kv: PoolLayer<'_, CudaKv>,
        shape: AttnShape,
        seqs: &[AttnSeq<'_>],
        out: &mut Self::Buf,
    ) -> Result<(), KernelError> {
        let _t = self.timed(|| "attention".into());
        let layout = kv.layout;
        let pages = kv.pool.len() / layout.page_floats().max(1);
        let p = plan::attention(layout, shape, seqs, q.len(), out.len(), pages)?;
        check("attention", shape.head_dim <= 256 && kv.layer < layout.num_layers, || {
            format!("head_dim {} (at most 256), layer {}", shape.head_dim, kv.layer)
        })?;
        if p.rows == 0 {
            return Ok(());
        }
        let t = &self.tables;
        let row_seq = t.row_seq.get(&self.stream, p.row_seq)?;
        let row_pos = t.row_pos.get(&self.stream, p.row_pos)?;
        let page_list = t.pages.get(&self.stream, if p.pages.is_empty() { vec![0] } else { p.pages })?;
        let page0 = t.seq_page0.get(&self.stream, if p.seq_page0.is_empty() { vec![0] } else { p.seq_page0 })?;
        let (rows, n_heads, n_kv, hd) =
            (p.rows as u32, shape.n_heads as u32, shape.n_kv_heads as u32, shape.head_dim as u32);
        let (page_size, page_floats) = (layout.page_size as u32, layout.page_floats() as u64);
        let (layer, slot_floats) = (kv.layer as u32, layout.slot_floats() as u32);
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        let (pp, _p) = kv.pool.device_ptr(&self.stream);
        // One block of ATTENTION_WARPS warps per (row, head).
        let blocks = fits_u32("attention", p.rows * shape.n_heads)?;
        let cfg =
            LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (32 * ATTENTION_WARPS, 1, 1), shared_mem_bytes: 0 };
        let mut b = self.stream.launch_builder(self.f("attention"));
        b.arg(q).arg(&pp).arg(out).arg(&*row_seq).arg(&*row_pos).arg(&*page_list).arg(&*page0);
        b.arg(&rows).arg(&n_heads).arg(&n_kv).arg(&hd).arg(&page_size).arg(&page_floats);
        b.arg(&layer).arg(&slot_floats).arg(&scale);
        // SAFETY: the plan checked every sequence's rows and pages against Q and the pool.
        unsafe { b.launch(cfg) }.map_err(Self::err)?;
        Ok(())
    }

    fn gather_rows(&self, x: &Self::Buf, width: usize, rows: &[usize], out: &mut Self::Buf) -> Result<(), KernelError> {
        let _t = self.timed(|| "gather_rows".into());
        check(
            "gather_rows",
            out.len() == rows.len() * width && rows.iter().all(|&r| (r + 1) * width <= x.len()),
            || format!("{} rows of {width} from {}", rows.len(), x.len()),
        )?;
        if rows.is_empty() || width == 0 {
            return Ok(());
        }
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx = self.upload_u32(&idx)?;
        let (n, w) = (rows.len() as u32, fits_u32("gather_rows", width)?);
        let cfg = elementwise(out.len());
        let mut b = self.stream.launch_builder(self.f("gather_rows"));
        b.arg(x).arg(out).arg(&idx).arg(&n).arg(&w);
        // SAFETY: every row lies inside `x`; `out` holds `n * w` values.
        unsafe { b.launch(cfg) }.map_err(Self::err)?;
        Ok(())
    }

    fn greedy_rows(&self, logits: &Self::Buf, rows: usize, vocab: usize) -> Result<Vec<(u32, f32)>, KernelError> {
        let _t = self.timed(|| "greedy_rows".into());
        check("greedy_rows", logits.len() == rows * vocab && vocab > 0, || {
            format!("{} values for {rows} rows of {vocab}", logits.len())
        })?;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let mut token = self.stream.alloc_zeros::<u32>(rows).map_err(Self::err)?;
        let mut logprob = self.stream.alloc_zeros::<f32>(rows).map_err(Self::err)?;
        let vocab = fits_u32("greedy_rows", vocab)?;
        let mut b = self.stream.launch_builder(self.f("greedy_rows"));
        b.arg(logits).arg(&mut token).arg(&mut logprob).arg(&vocab);
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: sizes checked above; the kernel reads `rows * vocab` values, writes `rows` of each.
        unsafe { b.launch(cfg) }.map_err(Self::err)?;
        let token = self.stream.clone_dtoh(&token).map_err(Self::err)?;
        let logprob = self.stream.clone_dtoh(&logprob).map_err(Self::err)?;
        Ok(token.into_iter().zip(logprob).collect())
    }

    fn device_memory(&self) -> Option<usize> {
        self.stream.context().bind_to_thread().ok()?;
        cudarc::driver::result::mem_get_info().ok().map(|(_free, total)| total)
    }

    fn kv_host_ptr(&self, _pool: &CudaKv) -> Option<*mut u8> {
        None
    }

    fn host_arena(&self, bytes: usize) -> Result<HostArena, KernelError> {
        self.pinned_arena(bytes)
    }

    fn kv_to_host(&self, pool: &CudaKv, layout: &KvLayout, first: u32, dst: &mut [f32]) -> Result<(), KernelError> {
        self.pages_to_host(pool, layout, first, dst)
    }

    fn kv_from_host(&self, pool: &CudaKv, layout: &KvLayout, first: u32, src: &[f32]) -> Result<(), KernelError> {
        self.pages_from_host(pool, layout, first, src)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where no GPU stack is installed (as on the development machines), asking for the
    /// backend is a clear error naming what is missing, never a panic. On a GPU machine the
    /// engine's parity test (`ferry-engine`, feature `cuda`) exercises the backend itself.
    #[test]
    fn without_the_cuda_libraries_new_fails_clearly() {
        match missing_library() {
            Some(lib) => {
                let e = CudaBackend::new(0).expect_err("no CUDA here");
                let text = e.to_string();
                assert!(text.contains("--device cuda") && text.contains(lib), "{text}");
            }
            None => {
                // A CUDA stack is present: opening a device that cannot exist is still an error.
                let e = CudaBackend::new(1 << 20).expect_err("no such device");
                assert!(matches!(e, KernelError::Unavailable(_)), "{e}");
            }
        }
    }

    /// NVRTC needs no GPU, so this runs everywhere the `cuda` feature is built: `scripts/setup`
    /// installs NVIDIA's `nvidia-cuda-nvrtc-cu12` wheel and `scripts/test` puts its library on
    /// the library path; without it this fails rather than pass unchecked.
    #[test]
    fn the_kernels_compile_with_nvrtc() {
        // SAFETY: only tries to open the library.
        let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
        assert!(
            present,
            "libnvrtc.so is not on the library path: run the tests with ./scripts/test, which installs NVRTC and points LD_LIBRARY_PATH at it"
        );
        let ptx = compile().expect("kernels.cu compiles").to_src();
        for k in KERNELS {
            assert!(ptx.contains(&format!(".entry {k}(")), "{k} is not an entry point of the PTX");
        }
    }

    #[test]
    fn rope_rows_are_cos_then_sin() {
        let t = RopeTable::new(4, 10_000.0, 8, None);
        let r = rope_rows(&t, &[0, 3]).expect("rows");
        assert_eq!(r.len(), 8);
        assert_eq!(&r[..2], &[1.0, 1.0]); // cos at position 0
        assert_eq!(&r[4..6], &[0.0, 0.0]); // sin at position 0
        assert_eq!(&r[2..4], t.row(3).0);
        assert_eq!(&r[6..8], t.row(3).1);
        assert!(rope_rows(&t, &[8]).is_err());
    }

    #[test]
    fn the_attention_block_matches_the_kernels_warp_count() {
        assert!(SOURCE.contains(&format!("#define ATT_WARPS {ATTENTION_WARPS}\n")));
    }

    #[test]
    fn every_kernel_named_is_defined_in_the_source() {
        for k in KERNELS {
            assert!(SOURCE.contains(&format!("__global__ void {k}(")), "{k} is not in kernels.cu");
        }
    }
}
