// Row-wise and element-wise kernels: embedding, norms, RoPE, SiLU, residual
// adds, bias, row gathers, f32 -> bf16 conversion and the KV store.

extern "C" __global__ void embedding(const u8* table, int dtype, long long row_bytes, const u32* ids, float* out,
                                     int cols) {
    pdl_enter();
    const u8* row = table + (long long)ids[blockIdx.x] * row_bytes;
    float* o = out + (long long)blockIdx.x * cols;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) o[j] = load_elem(row, dtype, j);
}

// RMSNorm of row blockIdx.x: out = x / rms(x) * w, after x += y when y is
// given. Sum of squares in f32, as the CPU backend does. Rows of whole float4s
// that fit NORM_V4 per thread are held in registers: every load of the row is
// in flight at once, which is what a decode step's one-row norm waits on.
// With `out_bf` the result is also stored rounded to bf16 (as f32_to_bf16_rows
// rounds it): the input the next matmuls take on the tensor cores, so they
// need no conversion launch of their own. With `oq` it is also stored
// quantized to 8 bits (codes `oq`, scales `oqs`, as `q8_quantize` writes
// them), the input of the integer GEMVs: only for rows of whole blocks of 32
// that take the register path.
#define NORM_V4 4
__device__ __forceinline__ void norm_row(float* __restrict__ x, const float* __restrict__ y,
                                         const float* __restrict__ w, float* __restrict__ out,
                                         bf16_t* __restrict__ out_bf, u32* __restrict__ oq,
                                         float2* __restrict__ oqs, int cols, float eps) {
    __shared__ float partial[32];
    float* xr = x + (long long)blockIdx.x * cols;
    const float* yr = y ? y + (long long)blockIdx.x * cols : nullptr;
    float* o = out + (long long)blockIdx.x * cols;
    bf16_t* ob = out_bf ? out_bf + (long long)blockIdx.x * cols : nullptr;
    int n4 = cols >> 2;
    if ((cols & 3) == 0 && n4 <= NORM_V4 * (int)blockDim.x) {
        float4 v[NORM_V4], wv[NORM_V4];
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < NORM_V4; i++) {
            int c = threadIdx.x + i * blockDim.x;
            if (c < n4) {
                v[i] = ((const float4*)xr)[c];
                wv[i] = __ldg((const float4*)w + c);
                if (yr) {
                    float4 b = ((const float4*)yr)[c];
                    v[i].x += b.x, v[i].y += b.y, v[i].z += b.z, v[i].w += b.w;
                }
            }
        }
#pragma unroll
        for (int i = 0; i < NORM_V4; i++) {
            int c = threadIdx.x + i * blockDim.x;
            if (c < n4) {
                if (yr) ((float4*)xr)[c] = v[i];
                s += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
            }
        }
        float inv = 1.0f / sqrtf(block_sum(s, partial) / (float)cols + eps);
#pragma unroll
        for (int i = 0; i < NORM_V4; i++) {
            int c = threadIdx.x + i * blockDim.x;
            bool live = c < n4;
            float4 r = live ? make_float4(v[i].x * inv * wv[i].x, v[i].y * inv * wv[i].y, v[i].z * inv * wv[i].z,
                                          v[i].w * inv * wv[i].w)
                            : make_float4(0.f, 0.f, 0.f, 0.f);
            if (live) {
                ((float4*)o)[c] = r;
                if (ob) {
                    uint2 b;
                    b.x = (u32)f32_to_bf16(r.x) | ((u32)f32_to_bf16(r.y) << 16);
                    b.y = (u32)f32_to_bf16(r.z) | ((u32)f32_to_bf16(r.w) << 16);
                    ((uint2*)ob)[c] = b;
                }
            }
            // Every thread of a warp takes part; blocks of 32 are whole (the host asks only then).
            if (oq) q8_store4(r, live, oq, oqs, (long long)blockIdx.x * n4 + c);
        }
        return;
    }
    float s = 0.f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        float v = yr ? xr[j] + yr[j] : xr[j];
        if (yr) xr[j] = v;
        s += v * v;
    }
    float inv = 1.0f / sqrtf(block_sum(s, partial) / (float)cols + eps);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        float r = xr[j] * inv * w[j];
        o[j] = r;
        if (ob) ob[j] = f32_to_bf16(r);
    }
}

// One block per row.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, bf16_t* out_bf, u32* oq,
                                    float2* oqs, int cols, float eps) {
    pdl_enter();
    norm_row((float*)x, nullptr, w, out, out_bf, oq, oqs, cols, eps);
}

// The residual add and the next RMSNorm in one pass: x += y, out = norm(x) * w.
extern "C" __global__ void add_rms_norm(float* x, const float* y, const float* w, float* out, bf16_t* out_bf,
                                        u32* oq, float2* oqs, int cols, float eps) {
    pdl_enter();
    norm_row(x, y, w, out, out_bf, oq, oqs, cols, eps);
}

// One warp per head, in place (Qwen3's per-head q/k norm).
extern "C" __global__ void head_rms_norm(float* x, const float* w, int head_dim, float eps, int total_heads) {
    pdl_enter();
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

// Rotate every head of one row by `pos`; the block's threads share the
// (head, pair) items. The angle is computed in f32 as pos * inv_freq and fed
// to the precise sincos, as the CPU reference does, so long positions agree.
__device__ __forceinline__ void rope_row(float* row, const float* inv_freq, float pos, int cols, int head_dim,
                                         int half, int interleaved) {
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

// One block per row.
extern "C" __global__ void rope(float* x, const float* inv_freq, const u32* positions, int cols, int head_dim,
                                int half, int interleaved) {
    pdl_enter();
    rope_row(x + (long long)blockIdx.x * cols, inv_freq, (float)positions[blockIdx.x], cols, head_dim, half,
             interleaved);
}

// With `out_bf`, the product is also stored rounded to bf16, as `norm_row` does.
extern "C" __global__ void silu_mul(const float* g, const float* u, float* out, bf16_t* out_bf, long long n) {
    pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float v = g[i];
        float r = v / (1.0f + expf(-v)) * u[i];
        out[i] = r;
        if (out_bf) out_bf[i] = f32_to_bf16(r);
    }
}

extern "C" __global__ void add_assign(float* x, const float* y, long long n) {
    pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] += y[i];
}

extern "C" __global__ void add_bias(float* out, const float* b, int cols, long long n) {
    pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] += b[i % cols];
}

extern "C" __global__ void gather_rows(const float* x, const u32* idx, float* out, int cols) {
    pdl_enter();
    const float* src = x + (long long)idx[blockIdx.x] * cols;
    float* dst = out + (long long)blockIdx.x * cols;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) dst[j] = src[j];
}

extern "C" __global__ void f32_to_bf16_rows(const float* x, bf16_t* out, long long n) {
    pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16(x[i]);
}

// Widen `nrows` stored rows starting at `row0` to a bf16 tile [nrows, k].
extern "C" __global__ void dequant_rows(const u8* w, int dtype, long long row_bytes, bf16_t* out, int row0, int k) {
    pdl_enter();
    const u8* row = w + (long long)(row0 + blockIdx.x) * row_bytes;
    bf16_t* o = out + (long long)blockIdx.x * k;
    for (int j = threadIdx.x; j < k; j += blockDim.x) o[j] = f32_to_bf16(load_elem(row, dtype, j));
}

// Store row r's K and V (width = kv_heads * head_dim) at its cache slot,
// found from the row's position and its sequence's page table. Rows that
// belong to no sequence carry row_seq = 0xffffffff and are skipped.
__device__ __forceinline__ void store_kv_row(int r, const float* k, const float* v, bf16_t* kc, bf16_t* vc,
                                             const u32* row_pos, const u32* row_seq, const u32* seq_pt_off,
                                             const u32* page_table, int page_size, int width) {
    u32 seq = row_seq[r];
    if (seq == 0xffffffffu) return;
    u32 pos = row_pos[r];
    u32 page = page_table[seq_pt_off[seq] + pos / page_size];
    long long dst = kv_page_elems(page) + (long long)(pos % page_size) * width;
    long long src = (long long)r * width;
    for (int j = threadIdx.x; j < width; j += blockDim.x) {
        kc[dst + j] = f32_to_bf16(k[src + j]);
        vc[dst + j] = f32_to_bf16(v[src + j]);
    }
}

extern "C" __global__ void write_kv(const float* k, const float* v, bf16_t* kc, bf16_t* vc, const u32* row_pos,
                                    const u32* row_seq, const u32* seq_pt_off, const u32* page_table, int page_size,
                                    int width) {
    pdl_enter();
    store_kv_row(blockIdx.x, k, v, kc, vc, row_pos, row_seq, seq_pt_off, page_table, page_size, width);
}

// rope(q), rope(k) and write_kv in one launch, the same arithmetic as the
// three kernels, q and k rotated in place. Block (r, h) serves one head of
// row r: h < heads a query head, then the KV heads' k, then their v, so a
// decode row's heads all run at once (each thread one rotary pair) instead of
// one after another in one block. Rows at or past `npos` (the step's
// positions) are not rotated, rows at or past `nkv` (the rows the step's maps
// cover) or of no sequence not stored. With `qn` given (Qwen3's per-head
// q/k norm, `kn` and `eps` beside it), each q and k head is first normalized
// as head_rms_norm does (x * inv * w), so the two norm launches of a layer
// become none: at batch 1 each was a few microseconds of a step that moves
// almost no bytes. For the same reason the launch carries the prefetch of
// the weights the attention output's GEMV reads next (`pf`, `pf_bytes`;
// none when null): attention and this kernel leave memory idle.
extern "C" __global__ void rope_write_kv(float* q, float* k, const float* v, bf16_t* kc, bf16_t* vc,
                                         const float* inv_freq, const u32* positions, int npos, int nkv,
                                         const u32* row_pos, const u32* row_seq, const u32* seq_pt_off,
                                         const u32* page_table, int page_size, int heads, int kv_heads,
                                         int head_dim, int half, int interleaved, const float* qn,
                                         const float* kn, float eps, const u8* pf, long long pf_bytes) {
    __shared__ float partial[32];
    pdl_enter();
    l2_prefetch(pf, pf_bytes);
    int r = blockIdx.x, h = blockIdx.y;
    int kvw = kv_heads * head_dim;
    bool is_q = h < heads, is_k = !is_q && h < heads + kv_heads;
    int kvh = is_q ? 0 : (is_k ? h - heads : h - heads - kv_heads);
    long long dst = -1;
    if (!is_q && r < nkv) {
        u32 seq = row_seq[r];
        if (seq != 0xffffffffu) {
            u32 pos = row_pos[r];
            u32 page = page_table[seq_pt_off[seq] + pos / page_size];
            dst = kv_page_elems(page) + (long long)(pos % page_size) * kvw + (long long)kvh * head_dim;
        }
    }
    if (is_q || is_k) {
        float* hp = is_q ? q + ((long long)r * heads + h) * head_dim : k + (long long)r * kvw + kvh * head_dim;
        bf16_t* cache = kc + dst;
        // The head's norm (block-uniform: every thread of the block serves this head).
        const float* nw = qn ? (is_q ? qn : kn) : nullptr;
        float inv = 1.f;
        if (nw) {
            float s = 0.f;
            for (int e = threadIdx.x; e < head_dim; e += blockDim.x) s += hp[e] * hp[e];
            inv = 1.0f / sqrtf(block_sum(s, partial) / (float)head_dim + eps); // its barrier: read before written
        }
        if (r < npos) {
            float pos = (float)positions[r];
            for (int i = threadIdx.x; i < half; i += blockDim.x) {
                float sn, cs;
                sincosf(pos * inv_freq[i], &sn, &cs);
                int a = interleaved ? 2 * i : i;
                int b = interleaved ? 2 * i + 1 : i + half;
                float x0 = hp[a], x1 = hp[b];
                if (nw) x0 = x0 * inv * nw[a], x1 = x1 * inv * nw[b];
                float y0 = x0 * cs - x1 * sn, y1 = x0 * sn + x1 * cs;
                hp[a] = y0;
                hp[b] = y1;
                if (is_k && dst >= 0) {
                    cache[a] = f32_to_bf16(y0);
                    cache[b] = f32_to_bf16(y1);
                }
            }
        }
        // The dimensions past the rotary ones (partial rotary), or all of
        // them for a row without a position, are stored as they are (after
        // the norm, which also leaves them normalized in place; a thread
        // stores the elements it normalized itself).
        int from = r < npos ? 2 * half : 0;
        if (nw)
            for (int e = from + threadIdx.x; e < head_dim; e += blockDim.x) hp[e] = hp[e] * inv * nw[e];
        if (is_k && dst >= 0) {
            for (int e = from + threadIdx.x; e < head_dim; e += blockDim.x) cache[e] = f32_to_bf16(hp[e]);
        }
    } else if (dst >= 0) {
        const float* vp = v + (long long)r * kvw + kvh * head_dim;
        for (int e = threadIdx.x; e < head_dim; e += blockDim.x) vc[dst + e] = f32_to_bf16(vp[e]);
    }
}
