// Ferry's CUDA kernels, compiled at run time with NVRTC (no nvcc at build time, no headers).
// Activations and the KV pool are f32; weights are bf16 (stored as raw u16). Every kernel
// checks its own bounds; shapes were checked on the host.

typedef unsigned short bf16_t;

// No headers under NVRTC: negative infinity by its bits.
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf2f(bf16_t x) { return __uint_as_float(((unsigned int)x) << 16); }

// Round to nearest even, NaN kept a NaN.
__device__ __forceinline__ bf16_t f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

extern "C" __global__ void to_bf16(const float* x, bf16_t* y, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = f2bf(x[i]);
}

// One block per id.
extern "C" __global__ void embed(const bf16_t* table, const unsigned int* ids, float* out, unsigned int cols) {
    const bf16_t* src = table + (size_t)ids[blockIdx.x] * cols;
    float* dst = out + (size_t)blockIdx.x * cols;
    for (unsigned int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = bf2f(src[c]);
}

extern "C" __global__ void add_bias(float* x, const float* b, unsigned int n, unsigned int width) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += b[i % width];
}

// One block of 256 threads per row.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, unsigned int width, float eps) {
    __shared__ float part[256];
    const float* row = x + (size_t)blockIdx.x * width;
    float* o = out + (size_t)blockIdx.x * width;
    float s = 0.0f;
    for (unsigned int c = threadIdx.x; c < width; c += blockDim.x) s += row[c] * row[c];
    part[threadIdx.x] = s;
    __syncthreads();
    for (unsigned int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) part[threadIdx.x] += part[threadIdx.x + k];
        __syncthreads();
    }
    float scale = 1.0f / sqrtf(part[0] / (float)width + eps);
    for (unsigned int c = threadIdx.x; c < width; c += blockDim.x) o[c] = row[c] * scale * w[c];
}

// cs: the cos rows then the sin rows, [rows][half] each. One thread per (row, head, i < half).
extern "C" __global__ void rope(float* x, const float* cs, unsigned int rows, unsigned int n_heads, unsigned int head_dim) {
    unsigned int half = head_dim / 2;
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * n_heads * half) return;
    unsigned int row = i / (n_heads * half);
    unsigned int head = (i / half) % n_heads;
    unsigned int k = i % half;
    float c = cs[row * half + k];
    float s = cs[(rows + row) * half + k];
    float* h = x + (size_t)row * n_heads * head_dim + head * head_dim;
    float x0 = h[k], x1 = h[k + half];
    h[k] = x0 * c - x1 * s;
    h[k + half] = x1 * c + x0 * s;
}

extern "C" __global__ void silu_mul(const float* g, const float* u, float* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

extern "C" __global__ void add_assign(float* x, const float* y, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// k_off[i]: pool offset of slot i's K in layer 0; layer_off moves it to the layer's K block;
// its V is v_skip further. One thread per value.
extern "C" __global__ void write_kv(float* pool, const float* k, const float* v, const unsigned long long* k_off,
                                   unsigned long long layer_off, unsigned long long v_skip, unsigned int n_slots,
                                   unsigned int w) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_slots * w) return;
    unsigned int s = i / w, c = i % w;
    unsigned long long o = k_off[s] + layer_off + c;
    pool[o] = k[i];
    pool[o + v_skip] = v[i];
}

extern "C" __global__ void gather_rows(const float* x, float* out, const unsigned int* rows, unsigned int n,
                                       unsigned int width) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * width) return;
    out[i] = x[(size_t)rows[i / width] * width + i % width];
}

// Causal attention over page-major KV pages. One block per (query row, head); its ATT_WARPS
// warps split the row's positions (warp w takes w, w + ATT_WARPS, ...), each keeping its own
// online softmax, and the warps' partial states are merged in shared memory at the end. Each
// lane holds head_dim / 32 dimensions (head_dim <= 256). One warp per (row, head) walking
// every position in turn was latency-bound: 135 us per call for a 72-token SmolLM2 decode row
// on an H200, a third of the step.
#define MAX_PER_LANE 8
#define ATT_WARPS 8
extern "C" __global__ void attention(const float* q, const float* pool, float* out, const int* row_seq,
                                     const int* row_pos, const unsigned int* pages, const unsigned int* seq_page0,
                                     unsigned int rows, unsigned int n_heads, unsigned int n_kv_heads,
                                     unsigned int head_dim, unsigned int page_size, unsigned long long page_floats,
                                     unsigned int layer, unsigned int slot_floats, float scale) {
    __shared__ float part_m[ATT_WARPS], part_l[ATT_WARPS];
    __shared__ float part_acc[ATT_WARPS * 256];
    unsigned int w = threadIdx.x / 32, lane = threadIdx.x & 31;
    if (blockIdx.x >= rows * n_heads) return;
    unsigned int row = blockIdx.x / n_heads, head = blockIdx.x % n_heads;
    size_t width = (size_t)n_heads * head_dim;
    float* o = out + row * width + head * head_dim;
    int s = row_seq[row];
    if (s < 0) {
        if (w == 0)
            for (unsigned int d = lane; d < head_dim; d += 32) o[d] = 0.0f;
        return;
    }
    int n = row_pos[row] + 1;
    unsigned int kvh = head / (n_heads / n_kv_heads);
    const float* qv = q + row * width + head * head_dim;
    unsigned int per = (head_dim + 31) / 32;
    float qr[MAX_PER_LANE], acc[MAX_PER_LANE];
    for (unsigned int i = 0; i < per; i++) {
        unsigned int d = lane + 32 * i;
        qr[i] = d < head_dim ? qv[d] : 0.0f;
        acc[i] = 0.0f;
    }
    const unsigned int* sp = pages + seq_page0[s];
    size_t k_block = (size_t)(layer * 2) * page_size * slot_floats;
    size_t v_skip = (size_t)page_size * slot_floats;
    float m = NEG_INF, l = 0.0f;
    for (int t = w; t < n; t += ATT_WARPS) {
        size_t ko = (size_t)sp[t / page_size] * page_floats + k_block + (size_t)(t % page_size) * slot_floats +
                    (size_t)kvh * head_dim;
        float part = 0.0f;
        for (unsigned int i = 0; i < per; i++) {
            unsigned int d = lane + 32 * i;
            if (d < head_dim) part += qr[i] * pool[ko + d];
        }
        for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
        float sc = part * scale;
        float mn = fmaxf(m, sc);
        float corr = expf(m - mn);
        float p = expf(sc - mn);
        l = l * corr + p;
        for (unsigned int i = 0; i < per; i++) {
            unsigned int d = lane + 32 * i;
            float vv = d < head_dim ? pool[ko + v_skip + d] : 0.0f;
            acc[i] = acc[i] * corr + p * vv;
        }
        m = mn;
    }
    if (lane == 0) {
        part_m[w] = m;
        part_l[w] = l;
    }
    for (unsigned int i = 0; i < per; i++) {
        unsigned int d = lane + 32 * i;
        if (d < head_dim) part_acc[w * 256 + d] = acc[i];
    }
    __syncthreads();
    if (w != 0) return;
    // Warp 0 merges: warps that saw no position (l = 0) add nothing.
    float big = NEG_INF;
    for (unsigned int j = 0; j < ATT_WARPS; j++)
        if (part_l[j] > 0.0f) big = fmaxf(big, part_m[j]);
    float total = 0.0f;
    for (unsigned int j = 0; j < ATT_WARPS; j++)
        if (part_l[j] > 0.0f) total += part_l[j] * expf(part_m[j] - big);
    for (unsigned int i = 0; i < per; i++) {
        unsigned int d = lane + 32 * i;
        if (d >= head_dim) continue;
        float a = 0.0f;
        for (unsigned int j = 0; j < ATT_WARPS; j++)
            if (part_l[j] > 0.0f) a += part_acc[j * 256 + d] * expf(part_m[j] - big);
        o[d] = a / total;
    }
}

// Greedy decoding on the device: per row of logits, the arg max (first on ties) and its log
// probability (the row's max minus its log-sum-exp). One block of 256 threads per row.
extern "C" __global__ void greedy_rows(const float* logits, unsigned int* token, float* logprob, unsigned int vocab) {
    __shared__ float best[256];
    __shared__ unsigned int at[256];
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float b = NEG_INF;
    unsigned int a = 0xffffffffu;
    for (unsigned int c = threadIdx.x; c < vocab; c += blockDim.x) {
        if (row[c] > b || a == 0xffffffffu) { b = row[c]; a = c; }
    }
    best[threadIdx.x] = b;
    at[threadIdx.x] = a;
    __syncthreads();
    for (unsigned int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) {
            float ob = best[threadIdx.x + k];
            unsigned int oa = at[threadIdx.x + k];
            if (oa != 0xffffffffu && (ob > best[threadIdx.x] || (ob == best[threadIdx.x] && oa < at[threadIdx.x]) ||
                                      at[threadIdx.x] == 0xffffffffu)) {
                best[threadIdx.x] = ob;
                at[threadIdx.x] = oa;
            }
        }
        __syncthreads();
    }
    const float m = best[0];
    const unsigned int t = at[0];
    __syncthreads();
    float sum = 0.0f;
    for (unsigned int c = threadIdx.x; c < vocab; c += blockDim.x) sum += expf(row[c] - m);
    best[threadIdx.x] = sum;
    __syncthreads();
    for (unsigned int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) best[threadIdx.x] += best[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        token[blockIdx.x] = t;
        logprob[blockIdx.x] = -logf(best[0]);
    }
}
