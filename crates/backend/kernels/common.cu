// Shared helpers for every kernel of the CUDA backend.
//
// The kernels are compiled at run time by NVRTC and must not need the CUDA
// headers (a machine may have the driver and NVRTC but no toolkit), so bf16
// and f16 are handled as raw 16-bit patterns with the conversions below.

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned char u8;

// Storage codes shared with the host (crates/backend/src/cuda/mod.rs, `dtype_code`).
#define DT_F32 0
#define DT_BF16 1
#define DT_Q8_0 2
#define DT_Q4_0 3
#define DT_Q4_1 4

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

// KV page tables hold where each page starts, in KV units of 256 bytes from
// the layer's K (or V) base pointer, not page ids: the host translates ids
// once per step, so the same kernels address a per-layer buffer and a page of
// the card's KV arena (whose chunks may leave a gap after their last page).
// Must match KV_UNIT_BYTES in crates/backend/src/cuda/mod.rs.
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
    default: { // DT_Q4_1
        const u8* b = row + (j / 32) * 20;
        int i = j % 32;
        int q = i < 16 ? (b[4 + i] & 0x0f) : (b[4 + i - 16] >> 4);
        return f16_at(b) * (float)q + f16_at(b + 2);
    }
    }
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
