//! `ferry-kernels`: the compute backends of Ferry's Llama-family forward pass.
//!
//! - [`Backend`]: the operations one forward pass needs — embedding, matmul against a weight
//!   matrix, RMSNorm, RoPE (with Llama-3 scaling), the SiLU-gated MLP product, residual adds,
//!   writing K/V into pool pages and attention that reads K/V back from those pages.
//! - [`KvLayout`]: where a token's K and V live inside the page pool. Pages are **page-major**:
//!   one page holds `page_size` tokens of K and V for every layer, so a run of consecutive
//!   pages is one contiguous region (one write on the wire).
//! - [`RopeTable`]: rotary embedding frequencies, including Llama-3 `rope_scaling`.
//! - [`cpu::CpuBackend`]: f32 on the CPU, GEMMs with `matrixmultiply`, both cores via rayon.
//! - `cuda::CudaBackend` (feature `cuda`): an NVIDIA GPU through cudarc (cuBLAS GEMMs in bf16
//!   with f32 accumulation, NVRTC-compiled kernels), loading CUDA at run time.
//!
//! The trait works on backend-owned buffers (`Backend::Buf`, `Backend::Mat`) so that a GPU
//! backend keeps activations, weights and the KV pool in device memory.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
mod host;
mod layout;
mod plan;
pub mod quant;
mod quant_k;
mod rope;

pub use error::KernelError;
pub use host::HostArena;
pub use layout::KvLayout;
pub use rope::{RopeScaling, RopeTable};

/// One sequence's share of a batched attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnSeq<'a> {
    /// The sequence's pages, in position order; they must cover `pos0 + n_q` tokens.
    pub pages: &'a [u32],
    /// First row of this sequence in the batch's query matrix.
    pub q_row: usize,
    /// Number of query rows (tokens computed in this pass).
    pub n_q: usize,
    /// Position of the first query row; row `i` attends to positions `0..=pos0 + i`.
    pub pos0: usize,
}

/// One layer of a KV pool, as attention reads it.
#[derive(Debug)]
pub struct PoolLayer<'a, Kv> {
    /// The pool memory.
    pub pool: &'a Kv,
    /// Its layout.
    pub layout: &'a KvLayout,
    /// The layer to read.
    pub layer: usize,
}

/// Shapes of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_heads`).
    pub n_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
}

/// The operations a Llama-family forward pass needs, on buffers the backend owns.
///
/// Matrices follow the `(out, in)` row-major convention: `y = x · Wᵀ`. Every activation
/// buffer is a row-major `[rows, width]` matrix of f32 values (a backend may store them in
/// a narrower type).
pub trait Backend: Send + Sync + 'static {
    /// An activation buffer.
    type Buf: Send + Sync;
    /// A weight matrix `(rows = out, cols = in)`.
    type Mat: Send + Sync;
    /// The KV page pool's memory. Shared (`Clone`) so a transfer backend can move pages in
    /// and out of it while the forward pass works on other pages.
    type Kv: Send + Sync + Clone + 'static;

    /// Short name for logs ("cpu", "cuda").
    fn name(&self) -> &'static str;
    /// Runs one forward pass's calls (`f`) where this backend drives them best. The CPU
    /// backend runs them on a thread of its rayon pool, so that each kernel's fork-join
    /// starts inside the pool rather than waking it from outside (~400 per decode step).
    fn pass<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }
    /// A zeroed buffer of `len` values.
    fn zeros(&self, len: usize) -> Result<Self::Buf, KernelError>;
    /// A buffer holding `data`.
    fn upload(&self, data: &[f32]) -> Result<Self::Buf, KernelError>;
    /// Copies a buffer back to the host.
    fn download(&self, buf: &Self::Buf) -> Result<Vec<f32>, KernelError>;
    /// Number of values in a buffer.
    fn len(&self, buf: &Self::Buf) -> usize;
    /// Uploads a row-major `(rows, cols)` matrix.
    fn matrix(&self, rows: usize, cols: usize, data: Vec<f32>) -> Result<Self::Mat, KernelError>;
    /// Uploads a row-major `(rows, cols)` matrix of `format` blocks (`cols` a multiple of
    /// `format.block_weights()`; each row `format.row_bytes(cols)` bytes). A backend that
    /// computes with quantized weights keeps them so; the default dequantizes them to f32.
    fn matrix_quantized(
        &self,
        rows: usize,
        cols: usize,
        format: quant::WeightFormat,
        data: Vec<u8>,
    ) -> Result<Self::Mat, KernelError> {
        check_quantized(rows, cols, format, &data)?;
        let mut f = vec![0.0; rows * cols];
        format.dequantize(&data, &mut f);
        self.matrix(rows, cols, f)
    }
    /// `(rows, cols)` of a matrix.
    fn mat_shape(&self, mat: &Self::Mat) -> (usize, usize);
    /// Stacks matrices of one width by rows (`[a; b; …]`) so that
    /// [`matmul_parts`](Self::matmul_parts) computes their products with one input as one
    /// larger product (fewer, better balanced parallel regions). `Err` gives them back where
    /// this backend does not stack them (the default) or their storage differs.
    fn stack(&self, mats: Vec<Self::Mat>) -> Result<Self::Mat, Vec<Self::Mat>> {
        Err(mats)
    }
    /// `outs[i] = x · w_iᵀ` for the matrices [`stack`](Self::stack) put into `w`, in order:
    /// `x` is `[rows, w.cols]`, `outs[i]` is `[rows, w_i.rows]`.
    fn matmul_parts(
        &self,
        x: &Self::Buf,
        rows: usize,
        w: &Self::Mat,
        outs: &mut [&mut Self::Buf],
    ) -> Result<(), KernelError> {
        let _ = (x, rows, w, outs);
        Err(KernelError::Shape {
            op: "matmul_parts",
            detail: format!("the {} backend stacks no matrices", self.name()),
        })
    }

    /// `out[i] = table[ids[i]]`; `out` is `[ids.len(), cols]`.
    fn embed(&self, table: &Self::Mat, ids: &[u32], out: &mut Self::Buf) -> Result<(), KernelError>;
    /// `out = x · wᵀ`, `x` is `[rows, w.cols]`, `out` is `[rows, w.rows]`.
    fn matmul(&self, x: &Self::Buf, rows: usize, w: &Self::Mat, out: &mut Self::Buf) -> Result<(), KernelError>;
    /// Adds `bias` (length `width`) to every row of `x`.
    fn add_bias(&self, x: &mut Self::Buf, bias: &Self::Buf) -> Result<(), KernelError>;
    /// Row-wise RMSNorm of `x` (`[rows, weight.len]`) scaled by `weight`, into `out`.
    fn rms_norm(&self, x: &Self::Buf, weight: &Self::Buf, eps: f32, out: &mut Self::Buf) -> Result<(), KernelError>;
    /// Rotates each head of each row of `x` (`[positions.len(), n_heads * head_dim]`) by its
    /// position, pairing dimensions `(i, i + head_dim / 2)` (the HF `rotate_half` layout).
    fn rope(&self, x: &mut Self::Buf, n_heads: usize, positions: &[u32], table: &RopeTable) -> Result<(), KernelError>;
    /// `out = silu(gate) * up`, element-wise.
    fn silu_mul(&self, gate: &Self::Buf, up: &Self::Buf, out: &mut Self::Buf) -> Result<(), KernelError>;
    /// `x += y`, element-wise.
    fn add_assign(&self, x: &mut Self::Buf, y: &Self::Buf) -> Result<(), KernelError>;

    /// A zeroed KV page pool of `num_pages` pages, allocated and touched once.
    fn kv_pool(&self, layout: &KvLayout, num_pages: usize) -> Result<Self::Kv, KernelError>;
    /// Writes row `i` of `k` and `v` (`[slots.len(), kv_heads * head_dim]`) into page
    /// `slots[i].0`, slot `slots[i].1`, of layer `layer`.
    fn write_kv(
        &self,
        pool: &Self::Kv,
        layout: &KvLayout,
        layer: usize,
        slots: &[(u32, u32)],
        k: &Self::Buf,
        v: &Self::Buf,
    ) -> Result<(), KernelError>;
    /// Causal attention of the query rows of every sequence over that sequence's K/V pages
    /// (which must already hold this pass's K/V), into `out` (`[q rows, n_heads * head_dim]`).
    fn attention(
        &self,
        q: &Self::Buf,
        kv: PoolLayer<'_, Self::Kv>,
        shape: AttnShape,
        seqs: &[AttnSeq<'_>],
        out: &mut Self::Buf,
    ) -> Result<(), KernelError>;
    /// Copies rows `rows` of `x` (`[_, width]`) into `out` (`[rows.len(), width]`).
    fn gather_rows(&self, x: &Self::Buf, width: usize, rows: &[usize], out: &mut Self::Buf) -> Result<(), KernelError>;

    /// Greedy decoding of each of `rows` rows of `logits` (`[rows, vocab]`): the arg max (the
    /// lowest index among equals) and its log probability, without the logits leaving the
    /// backend.
    fn greedy_rows(&self, logits: &Self::Buf, rows: usize, vocab: usize) -> Result<Vec<(u32, f32)>, KernelError>;
    /// Bytes of device memory, for sizing the KV pool; None when the backend computes in
    /// host memory.
    fn device_memory(&self) -> Option<usize>;
    /// The pool's first byte when its memory is host memory that a transfer may read and
    /// write in place (pages then need no copy). None for device memory: pages travel
    /// through a host mirror ([`Backend::host_arena`], [`Backend::kv_to_host`],
    /// [`Backend::kv_from_host`]).
    fn kv_host_ptr(&self, pool: &Self::Kv) -> Option<*mut u8>;
    /// A zeroed, touched host arena of `bytes` bytes for a pool's mirror; page-locked
    /// (pinned) when the backend has a device.
    fn host_arena(&self, bytes: usize) -> Result<HostArena, KernelError>;
    /// Copies whole pages `first..` of the pool (`dst.len()` values) to the host; returns
    /// once the copy has landed.
    fn kv_to_host(&self, pool: &Self::Kv, layout: &KvLayout, first: u32, dst: &mut [f32]) -> Result<(), KernelError>;
    /// Copies `src` (whole pages) into pages `first..` of the pool; returns once the copy has
    /// landed.
    fn kv_from_host(&self, pool: &Self::Kv, layout: &KvLayout, first: u32, src: &[f32]) -> Result<(), KernelError>;
}

/// Checks the size of a quantized matrix's data.
pub(crate) fn check_quantized(
    rows: usize,
    cols: usize,
    format: quant::WeightFormat,
    data: &[u8],
) -> Result<(), KernelError> {
    error::check(
        "matrix_quantized",
        cols.is_multiple_of(format.block_weights()) && data.len() == rows * format.row_bytes(cols),
        || format!("{} bytes of {format:?} for {rows}x{cols}", data.len()),
    )
}
