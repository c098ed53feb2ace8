// Row-wise and element-wise kernels: embedding, norms, RoPE, SiLU, residual
// adds, bias, row gathers, f32 -> bf16 conversion and the KV store.

extern "C" __global__ void embedding(const u8* table, int dtype, long long row_bytes, const u32* ids, float* out,
                                     int cols) {
    const u8* row = table + (long long)ids[blockIdx.x] * row_bytes;
    float* o = out + (long long)blockIdx.x * cols;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) o[j] = load_elem(row, dtype, j);
}

// One block per row. Sum of squares in f32, as the CPU backend does.
// The sum of `v` over the block (every thread gets it); `partial` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* partial) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        float w = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0.f;
        w = warp_sum(w);
        if (threadIdx.x == 0) partial[0] = w;
    }
    __syncthreads();
    return partial[0];
}

extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int cols, float eps) {
    __shared__ float partial[32];
    const float* xr = x + (long long)blockIdx.x * cols;
    float* o = out + (long long)blockIdx.x * cols;
    float s = 0.f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) s += xr[j] * xr[j];
    float inv = 1.0f / sqrtf(block_sum(s, partial) / (float)cols + eps);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) o[j] = xr[j] * inv * w[j];
}

// The residual add and the next RMSNorm in one pass: x += y, out = norm(x) * w.
// One block per row; the same sums in the same order as rms_norm.
extern "C" __global__ void add_rms_norm(float* x, const float* y, const float* w, float* out, int cols, float eps) {
    __shared__ float partial[32];
    float* xr = x + (long long)blockIdx.x * cols;
    const float* yr = y + (long long)blockIdx.x * cols;
    float* o = out + (long long)blockIdx.x * cols;
    float s = 0.f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        float v = xr[j] + yr[j];
        xr[j] = v;
        s += v * v;
    }
    float inv = 1.0f / sqrtf(block_sum(s, partial) / (float)cols + eps);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) o[j] = xr[j] * inv * w[j];
}

// One warp per head, in place (Qwen3's per-head q/k norm).
extern "C" __global__ void head_rms_norm(float* x, const float* w, int head_dim, float eps, int total_heads) {
    int head = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (head >= total_heads) return;
    int lane = threadIdx.x & 31;
    float* h = x + (long long)head * head_dim;
    float s = 0.f;
    for (int j = lane; j < head_dim; j += 32) s += h[j] * h[j];
    s = warp_sum(s);
    float inv = 1.0f / sqrtf(s / (float)head_dim + eps);
    for (int j = lane; j < head_dim; j += 32) h[j] = h[j] * inv * w[j];
}

// One block per row; each thread rotates (head, pair) items. The angle is
// computed in f32 as pos * inv_freq and fed to the precise sincos, as the CPU
// reference does, so long positions agree.
extern "C" __global__ void rope(float* x, const float* inv_freq, const u32* positions, int cols, int head_dim,
                                int half, int interleaved) {
    float* row = x + (long long)blockIdx.x * cols;
    float pos = (float)positions[blockIdx.x];
    int heads = cols / head_dim;
    for (int it = threadIdx.x; it < heads * half; it += blockDim.x) {
        int h = it / half, i = it % half;
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        int a = interleaved ? 2 * i : i;
        int b = interleaved ? 2 * i + 1 : i + half;
        float* hp = row + h * head_dim;
        float x0 = hp[a], x1 = hp[b];
        hp[a] = x0 * c - x1 * s;
        hp[b] = x0 * s + x1 * c;
    }
}

extern "C" __global__ void silu_mul(const float* g, const float* u, float* out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float v = g[i];
        out[i] = v / (1.0f + expf(-v)) * u[i];
    }
}

extern "C" __global__ void add_assign(float* x, const float* y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] += y[i];
}

extern "C" __global__ void add_bias(float* out, const float* b, int cols, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] += b[i % cols];
}

extern "C" __global__ void gather_rows(const float* x, const u32* idx, float* out, int cols) {
    const float* src = x + (long long)idx[blockIdx.x] * cols;
    float* dst = out + (long long)blockIdx.x * cols;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) dst[j] = src[j];
}

extern "C" __global__ void f32_to_bf16_rows(const float* x, bf16_t* out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16(x[i]);
}

// Widen `nrows` stored rows starting at `row0` to a bf16 tile [nrows, k].
extern "C" __global__ void dequant_rows(const u8* w, int dtype, long long row_bytes, bf16_t* out, int row0, int k) {
    const u8* row = w + (long long)(row0 + blockIdx.x) * row_bytes;
    bf16_t* o = out + (long long)blockIdx.x * k;
    for (int j = threadIdx.x; j < k; j += blockDim.x) o[j] = f32_to_bf16(load_elem(row, dtype, j));
}

// Store each new row's K and V (width = kv_heads * head_dim) at its cache
// slot, found from the row's position and its sequence's page table. Rows that
// belong to no sequence carry row_seq = 0xffffffff and are skipped.
extern "C" __global__ void write_kv(const float* k, const float* v, bf16_t* kc, bf16_t* vc, const u32* row_pos,
                                    const u32* row_seq, const u32* seq_pt_off, const u32* page_table, int page_size,
                                    int width) {
    u32 seq = row_seq[blockIdx.x];
    if (seq == 0xffffffffu) return;
    u32 pos = row_pos[blockIdx.x];
    u32 page = page_table[seq_pt_off[seq] + pos / page_size];
    long long dst = kv_page_elems(page) + (long long)(pos % page_size) * width;
    long long src = (long long)blockIdx.x * width;
    for (int j = threadIdx.x; j < width; j += blockDim.x) {
        kc[dst + j] = f32_to_bf16(k[src + j]);
        vc[dst + j] = f32_to_bf16(v[src + j]);
    }
}
