// A host emulation of the CUDA features the kernels use, so that they run on
// a machine without a GPU (tests/kernels_emulated.rs): one std::thread per
// CUDA thread, the blocks of a grid one after another, __syncthreads as a
// barrier of the block's threads, and the warp-wide instructions (warp_sum,
// the shuffles; the tensor-core ones are in mma.h) as barrier-separated
// exchanges among a warp's 32 threads. CUDA's vector types are aligned
// structs, and the bit casts and byte permute are written out from their
// definitions. Shared memory is a function-local static: every thread of the
// block sees the same array, and blocks never overlap in time. What this
// cannot show is a missing barrier's race (threads interleave, but rarely at
// the bad moment) or a device limit; the GPU check (cuda/check.rs) covers
// those.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned char u8;
// Storage codes, the kernels' own table.
#include "../../kernels/dtypes.cu"

struct Dim3 {
    unsigned x = 0, y = 0, z = 0;
};
thread_local Dim3 threadIdx, blockIdx;
Dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

// CUDA's vector types, with their alignment.
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(8) uint2 {
    u32 x, y;
};
struct alignas(16) uint4 {
    u32 x, y, z, w;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline uint2 make_uint2(u32 x, u32 y) { return {x, y}; }
inline uint4 make_uint4(u32 x, u32 y, u32 z, u32 w) { return {x, y, z, w}; }

// What kernels/common.cu defines ahead of the kernels, and CUDA built-ins.
inline int imin(int a, int b) { return a < b ? a : b; }
inline int imax(int a, int b) { return a > b ? a : b; }
inline float __uint_as_float(u32 u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline u32 __float_as_uint(float f) {
    u32 u;
    memcpy(&u, &f, 4);
    return u;
}
inline float __int_as_float(int i) { return __uint_as_float((u32)i); }
// ld.global.nc (with or without L1 allocation, streaming or not) reads
// memory nobody writes during the kernel: a plain load.
template <class T>
T __ldg(const T* p) {
    return *p;
}
inline uint4 ld_stream(const uint4* p) { return *p; }
// ld.global.cg (through L2, not L1): blocks run one after another here, so a plain load.
template <class T>
T __ldcg(const T* p) {
    return *p;
}
// Blocks never overlap in time and a block's stores are its threads' own, so
// a fence orders nothing here; the atomics are real (a block's threads run at once).
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline u32 atomicAdd(u32* p, u32 v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
// prmt.b32 (default mode): byte i of the result is byte s_i & 7 of {b, a},
// or that byte's sign replicated when s_i & 8.
inline u32 __byte_perm(u32 a, u32 b, u32 s) {
    unsigned long long v = ((unsigned long long)b << 32) | a;
    u32 r = 0;
    for (int i = 0; i < 4; i++) {
        u32 c = (s >> (4 * i)) & 15, byte = (u32)(v >> (8 * (c & 7))) & 0xff;
        if (c & 8) byte = (byte & 0x80) ? 0xff : 0;
        r |= byte << (8 * i);
    }
    return r;
}

namespace emu {
std::barrier<>* block_barrier;
std::vector<std::unique_ptr<std::barrier<>>>* warp_barriers;
float warp_values[32][32];
// One 64-byte slot per lane of each warp for the warp-wide exchanges.
alignas(16) unsigned char board[32][32][64];
inline void warp_sync() { (*warp_barriers)[threadIdx.x >> 5]->arrive_and_wait(); }
// Publish this lane's `v`, then let `read` look at every lane's.
template <class T, class F>
void exchange(const T& v, F read) {
    static_assert(sizeof(T) <= 64);
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    memcpy(board[w][lane], &v, sizeof(T));
    warp_sync();
    read([w](int l) {
        T x;
        memcpy(&x, board[w][l], sizeof(T));
        return x;
    });
    warp_sync();
}
} // namespace emu

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }
// Without programmatic dependent launch there is nothing to wait for; the
// blocks that would have waited are counted (a block's thread 0 counts it),
// so a test can check which blocks reach the wait.
inline std::atomic<long> pdl_waits{0};
inline void pdl_enter() {
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) pdl_waits++;
}

inline float bf16_to_f32(bf16_t v) {
    u32 u = ((u32)v) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// A double rounded once to the nearest even bf16, by way of a float rounded
// to odd (truncated, its last bit set when inexact: with 16 more bits than
// bf16, rounding that float is rounding the double).
inline bf16_t bf16_of_double(double v) {
    float f = (float)v;
    if ((double)f != v) {
        if (std::fabs((double)f) > std::fabs(v)) f = std::nextafter(f, 0.0f);
        u32 odd;
        memcpy(&odd, &f, 4);
        odd |= 1u;
        memcpy(&f, &odd, 4);
    }
    u32 u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return (bf16_t)(u >> 16);
}

inline float warp_sum(float v) {
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    auto& b = *(*emu::warp_barriers)[w];
    emu::warp_values[w][lane] = v;
    b.arrive_and_wait();
    float s = 0.f;
    for (int i = 0; i < 32; i++) s += emu::warp_values[w][i];
    // Nobody writes the next value before every lane has read this one.
    b.arrive_and_wait();
    return s;
}

inline void __syncwarp() { emu::warp_sync(); }
// shfl.sync.idx: lane l reads lane src.
template <class T>
T __shfl_sync(u32, T v, int src) {
    T r;
    emu::exchange(v, [&](auto at) { r = at(src & 31); });
    return r;
}
// shfl.sync.bfly: lane l reads lane l ^ o.
template <class T>
T __shfl_xor_sync(u32, T v, int o) {
    T r;
    emu::exchange(v, [&](auto at) { r = at((threadIdx.x & 31) ^ o); });
    return r;
}
// shfl.sync.down: lane l reads lane l + o, lanes past 31 - o keep their own value.
template <class T>
T __shfl_down_sync(u32, T v, int o) {
    T r = v;
    int lane = threadIdx.x & 31;
    emu::exchange(v, [&](auto at) {
        if (lane + o < 32) r = at(lane + o);
    });
    return r;
}
// shfl.sync.up: lane l reads lane l - o, lanes below o keep their own value.
template <class T>
T __shfl_up_sync(u32, T v, int o) {
    T r = v;
    int lane = threadIdx.x & 31;
    emu::exchange(v, [&](auto at) {
        if (lane >= o) r = at(lane - o);
    });
    return r;
}
inline float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Run `kernel` over `grid` with `block` threads per block (a multiple of 32).
inline void launch(Dim3 grid, unsigned block, const std::function<void()>& kernel) {
    gridDim = grid;
    blockDim = {block, 1, 1};
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                std::barrier<> whole(block);
                std::vector<std::unique_ptr<std::barrier<>>> warps;
                for (unsigned w = 0; w < block / 32; w++) warps.emplace_back(new std::barrier<>(32));
                emu::block_barrier = &whole;
                emu::warp_barriers = &warps;
                std::vector<std::thread> threads;
                for (unsigned t = 0; t < block; t++)
                    threads.emplace_back([&, t] {
                        threadIdx = {t, 0, 0};
                        blockIdx = {x, y, z};
                        kernel();
                    });
                for (auto& t : threads) t.join();
            }
}
