// Matrix-vector products for decode: `out[r][j] = x[r] . w[j]` for up to
// GEMV_MAX_ROWS input rows, one warp per weight row, so every weight byte is
// read from memory exactly once per step however many rows share it.

#define GEMV_MAX_ROWS 8
#define GEMV_UNROLL 8

// Weights are read once per step: bypass L1 so the activations stay there.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// bf16 weights, k a multiple of 8: each lane streams 16-byte chunks, with
// GEMV_UNROLL loads in flight before any arithmetic (memory-level parallelism
// is what decode needs to reach the copy bandwidth).
extern "C" __global__ void gemv_bf16(const bf16_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ out,
                                     int n, int k, int rows) {
    int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (j >= n) return;
    int lane = threadIdx.x & 31;
    float acc[GEMV_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; r++) acc[r] = 0.f;
    const uint4* w4 = (const uint4*)(w + (long long)j * k);
    int chunks = k >> 3;
    for (int base = lane; base < chunks; base += 32 * GEMV_UNROLL) {
        uint4 p[GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            int c = base + 32 * u;
            if (c < chunks) p[u] = ld_stream(w4 + c);
            else p[u].x = p[u].y = p[u].z = p[u].w = 0u;
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            int c = base + 32 * u;
            if (c >= chunks) break;
            float wf[8];
            u32 words[4] = {p[u].x, p[u].y, p[u].z, p[u].w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                wf[2 * i] = __uint_as_float(words[i] << 16);
                wf[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
            }
#pragma unroll
            for (int r = 0; r < GEMV_MAX_ROWS; r++) {
                if (r < rows) {
                    const float4* xr = (const float4*)(x + (long long)r * k + c * 8);
                    float4 a = xr[0], b = xr[1];
                    acc[r] += wf[0] * a.x + wf[1] * a.y + wf[2] * a.z + wf[3] * a.w + wf[4] * b.x + wf[5] * b.y +
                              wf[6] * b.z + wf[7] * b.w;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; r++) {
        if (r < rows) {
            float s = warp_sum(acc[r]);
            if (lane == 0) out[(long long)r * n + j] = s;
        }
    }
}

// Any storage type, any k (bf16 rows of odd width, f32, and the ggml block
// formats): one lane per 32-element block, scales applied once per block.
extern "C" __global__ void gemv_any(const u8* __restrict__ w, int dtype, long long row_bytes,
                                    const float* __restrict__ x, float* __restrict__ out, int n, int k, int rows) {
    int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (j >= n) return;
    int lane = threadIdx.x & 31;
    const u8* row = w + (long long)j * row_bytes;
    float acc[GEMV_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; r++) acc[r] = 0.f;
    int blocks = (k + 31) / 32;
    for (int b = lane; b < blocks; b += 32) {
        int e0 = b * 32;
        if (dtype == DT_Q8_0 || dtype == DT_Q4_0 || dtype == DT_Q4_1) {
            int bytes = dtype == DT_Q8_0 ? 34 : (dtype == DT_Q4_0 ? 18 : 20);
            const u8* blk = row + (long long)b * bytes;
            float d = f16_at(blk);
            float m = dtype == DT_Q4_1 ? f16_at(blk + 2) : 0.f;
            float dot[GEMV_MAX_ROWS], sx[GEMV_MAX_ROWS];
#pragma unroll
            for (int r = 0; r < GEMV_MAX_ROWS; r++) dot[r] = sx[r] = 0.f;
            for (int i = 0; i < 32; i++) {
                float q;
                if (dtype == DT_Q8_0) q = (float)(signed char)blk[2 + i];
                else {
                    const u8* qs = blk + (dtype == DT_Q4_0 ? 2 : 4);
                    int v = i < 16 ? (qs[i] & 0x0f) : (qs[i - 16] >> 4);
                    q = (float)(dtype == DT_Q4_0 ? v - 8 : v);
                }
#pragma unroll
                for (int r = 0; r < GEMV_MAX_ROWS; r++) {
                    if (r < rows) {
                        float xv = x[(long long)r * k + e0 + i];
                        dot[r] += q * xv;
                        sx[r] += xv;
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < GEMV_MAX_ROWS; r++) acc[r] += d * dot[r] + m * sx[r];
        } else {
            int e1 = imin(e0 + 32, k);
            for (int e = e0; e < e1; e++) {
                float wv = load_elem(row, dtype, e);
#pragma unroll
                for (int r = 0; r < GEMV_MAX_ROWS; r++)
                    if (r < rows) acc[r] += wv * x[(long long)r * k + e];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; r++) {
        if (r < rows) {
            float s = warp_sum(acc[r]);
            if (lane == 0) out[(long long)r * n + j] = s;
        }
    }
}
