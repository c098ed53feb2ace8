// Shared helpers for every kernel of the CUDA backend.
//
// The kernels are compiled at run time by NVRTC and must not need the CUDA
// headers (a machine may have the driver and NVRTC but no toolkit), so bf16
// and f16 are handled as raw 16-bit patterns with the conversions below.

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned char u8;

// The storage codes (DT_*) are in dtypes.cu, compiled ahead of this file.

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

// KV page tables hold where each page starts, in KV units of 256 bytes from
// the layer's K (or V) base pointer, not page ids: the host translates ids
// once per step, so the same kernels address a per-layer buffer and a page of
// the card's KV arena (whose chunks may leave a gap after their last page).
// Must match KV_UNIT_BYTES in crates/backend/src/kv_units.rs.
#define KV_UNIT_SHIFT 7 // 256 bytes = 128 bf16 elements
__device__ __forceinline__ long long kv_page_elems(u32 unit) { return (long long)unit << KV_UNIT_SHIFT; }

__device__ __forceinline__ float bf16_to_f32(bf16_t v) { return __uint_as_float(((u32)v) << 16); }

// Round to nearest even, as PyTorch and the `half` crate do; NaN stays NaN.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// Two f32 as one bf16 pair, `lo` in the low half (round to nearest even).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// a * b + c on two bf16 pairs, rounded once to nearest even (sm_80 on).
__device__ __forceinline__ u32 bf16x2_fma(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Block formats keep their f16 scales at 2-byte alignment (a Q8_0 block is 34
// bytes), so scales are read as two bytes.
__device__ __forceinline__ float f16_at(const u8* p) { return f16_to_f32((unsigned short)(p[0] | (p[1] << 8))); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The 16 levels of IQ4_NL and IQ4_XS (the ggml format's fixed grid).
__constant__ signed char kIQ4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                           1,    13,   25,  38,  53,  69,  89,  113};

// Bytes per block of the formats bq_weight decodes (32 or 256 weights).
__device__ __forceinline__ int bq_block_bytes(int dt) {
    switch (dt) {
    case DT_Q5_0: return 22;
    case DT_Q5_1: return 24;
    case DT_IQ4_NL: return 18;
    case DT_Q2_K: return 84;
    case DT_Q3_K: return 110;
    case DT_Q4_K: return 144;
    case DT_Q5_K: return 176;
    case DT_Q6_K: return 210;
    default: return 136; // DT_IQ4_XS
    }
}

// Weight `e` of a row of Q5_0, Q5_1, IQ4_NL, the K-quants or IQ4_XS, from
// the block layouts documented in cpu/quant.rs (`unpack_block`). Written per
// element so the dequantizing copy and the GEMVs share one definition; in
// the GEMVs `dt` is a constant and 32 consecutive `e` are unrolled, so the
// scale reads are loaded once per 32 weights.
__device__ __forceinline__ float bq_weight(int dt, const u8* row, int e) {
    if (dt == DT_Q5_0 || dt == DT_Q5_1 || dt == DT_IQ4_NL) {
        const u8* b = row + (e >> 5) * bq_block_bytes(dt);
        int i = e & 31, j = i & 15;
        float d = f16_at(b);
        if (dt == DT_IQ4_NL) {
            int q = i < 16 ? (b[2 + j] & 0x0f) : (b[2 + j] >> 4);
            return d * (float)kIQ4Levels[q];
        }
        int at = dt == DT_Q5_1 ? 4 : 2;
        u32 qh = (u32)b[at] | ((u32)b[at + 1] << 8) | ((u32)b[at + 2] << 16) | ((u32)b[at + 3] << 24);
        int q = (i < 16 ? (b[at + 4 + j] & 0x0f) : (b[at + 4 + j] >> 4)) | (int)(((qh >> i) & 1) << 4);
        return dt == DT_Q5_1 ? d * (float)q + f16_at(b + 2) : d * (float)(q - 16);
    }
    const u8* b = row + (e >> 8) * bq_block_bytes(dt);
    int i = e & 255, s = i >> 5, l = i & 31, g = i >> 4;
    switch (dt) {
    case DT_Q2_K: {
        int q = (b[16 + 32 * (s >> 2) + l] >> (2 * (s & 3))) & 3;
        int sc = b[g];
        return f16_at(b + 80) * (float)(sc & 15) * (float)q - f16_at(b + 82) * (float)(sc >> 4);
    }
    case DT_Q3_K: {
        int h = s >> 2, jj = s & 3;
        int low = (b[32 + 32 * h + l] >> (2 * jj)) & 3;
        int q = low - (((b[l] >> (4 * h + jj)) & 1) ? 0 : 4);
        const u8* sc = b + 96;
        int lo = g < 8 ? (sc[g] & 15) : (sc[g - 8] >> 4);
        int hi = (sc[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
        return f16_at(b + 108) * (float)((lo | (hi << 4)) - 32) * (float)q;
    }
    case DT_Q4_K:
    case DT_Q5_K: {
        const u8* sc = b + 4;
        int scale, min;
        if (s < 4) {
            scale = sc[s] & 63;
            min = sc[s + 4] & 63;
        } else {
            scale = (sc[s + 4] & 15) | ((sc[s - 4] >> 6) << 4);
            min = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
        }
        int qs = dt == DT_Q5_K ? 48 : 16;
        int v = b[qs + 32 * (s >> 1) + l];
        int q = (s & 1) ? (v >> 4) : (v & 15);
        if (dt == DT_Q5_K) q |= ((b[16 + l] >> s) & 1) << 4;
        return f16_at(b) * (float)scale * (float)q - f16_at(b + 2) * (float)min;
    }
    case DT_Q6_K: {
        int h = s >> 2, k4 = s & 3;
        int v = b[64 * h + l + 32 * (k4 & 1)];
        int low = k4 < 2 ? (v & 15) : (v >> 4);
        int high = (b[128 + 32 * h + l] >> (2 * k4)) & 3;
        return f16_at(b + 208) * (float)(signed char)b[192 + g] * (float)((low | (high << 4)) - 32);
    }
    default: { // DT_IQ4_XS
        u32 sh = (u32)b[2] | ((u32)b[3] << 8);
        int ls = ((b[4 + (s >> 1)] >> (4 * (s & 1))) & 15) | (int)(((sh >> (2 * s)) & 3) << 4);
        int v = b[8 + 16 * s + (l & 15)];
        int q = l < 16 ? (v & 15) : (v >> 4);
        return f16_at(b) * (float)(ls - 32) * (float)kIQ4Levels[q];
    }
    }
}

// Element `j` of a stored row in any storage type (slow path: embeddings and
// the dequantizing copy, never the decode GEMV).
__device__ __forceinline__ float load_elem(const u8* row, int dtype, int j) {
    switch (dtype) {
    case DT_F32: return ((const float*)row)[j];
    case DT_BF16: return bf16_to_f32(((const bf16_t*)row)[j]);
    case DT_Q8_0: {
        const u8* b = row + (j / 32) * 34;
        return f16_at(b) * (float)(signed char)b[2 + (j % 32)];
    }
    case DT_Q4_0: {
        const u8* b = row + (j / 32) * 18;
        int i = j % 32;
        int q = i < 16 ? (b[2 + i] & 0x0f) : (b[2 + i - 16] >> 4);
        return f16_at(b) * (float)(q - 8);
    }
    case DT_Q4_1: {
        const u8* b = row + (j / 32) * 20;
        int i = j % 32;
        int q = i < 16 ? (b[4 + i] & 0x0f) : (b[4 + i - 16] >> 4);
        return f16_at(b) * (float)q + f16_at(b + 2);
    }
    default: return bq_weight(dtype, row, j);
    }
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

// 16 bytes global -> shared, asynchronously; `bytes` = 0 writes zeros instead.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// c += a (16x16, row-major) . b (16x8, column-major), bf16 in, f32 accumulate.
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices from shared memory; lane l gives the address of row
// l % 8 of matrix l / 8.
__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// Programmatic dependent launch (sm_90 and later). The host may launch a
// kernel before the one ahead of it on the stream has finished; the kernel
// is then resident and waits in `pdl_wait` until every earlier kernel has
// finished and its writes are visible, so the launch and the block
// scheduling overlap the kernel ahead. Every kernel calls `pdl_enter` (or `pdl_wait`)
// before it reads or writes any buffer another kernel touches, so any kernel
// may be launched that way; without the launch attribute the wait returns at
// once. `pdl_release` lets the next kernel on the stream start launching: it
// is issued right after the wait, so at most one kernel waits ahead.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_release() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_release();
}

// Start reading [p, p + bytes) into the L2 cache: a hint, moving nothing a
// kernel sees, for weights the next kernels but one will stream (see
// `Backend::prefetch`). sm_90's bulk prefetch takes 16-byte multiples from a
// 16-byte aligned start (the host rounds `bytes` down); the chunks are dealt
// out over every thread of the grid, so that the copy units of as many SMs
// issue them, and a chunk's prefetch goes on after its thread exits. Called
// after the kernel's wait, so it never competes with the kernel ahead.
#define L2_PREFETCH_CHUNK 16384
__device__ __forceinline__ void l2_prefetch(const u8* p, long long bytes) {
#if __CUDA_ARCH__ >= 900
    if (p == nullptr || bytes <= 0) return;
    long long threads = (long long)gridDim.x * gridDim.y * gridDim.z * blockDim.x;
    long long t = ((long long)(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
    for (long long off = t * L2_PREFETCH_CHUNK; off < bytes; off += threads * L2_PREFETCH_CHUNK) {
        long long left = bytes - off;
        u32 n = (u32)(left < L2_PREFETCH_CHUNK ? left : L2_PREFETCH_CHUNK);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(n) : "memory");
    }
#endif
}
