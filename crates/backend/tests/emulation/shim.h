// A host emulation of the CUDA features kernels/delta.cu uses (and, with the
// warp-wide instructions of emulation/attention.cpp, kernels/attention.cu), so
// those kernels run on a machine without a GPU (tests/*_kernels_emulated.rs):
// one std::thread per CUDA thread, the blocks of a grid one after another,
// __syncthreads as a barrier of the block's threads and warp_sum as a
// barrier-separated exchange among a warp's 32 threads; float4 is an aligned
// struct of four floats. Shared memory is a function-local static: every
// thread of the block sees the same array, and blocks never overlap in time. What this cannot show is a missing barrier's
// race (threads interleave, but rarely at the bad moment) or a device limit;
// the GPU check (cuda/check.rs) covers those.
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
// Storage codes, as in kernels/common.cu.
#define DT_F32 0
#define DT_BF16 1

struct Dim3 {
    unsigned x = 0, y = 0, z = 0;
};
thread_local Dim3 threadIdx, blockIdx;
Dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

// CUDA's vector type, as the kernels read four floats of shared memory at once.
struct alignas(16) float4 {
    float x, y, z, w;
};

namespace emu {
std::barrier<>* block_barrier;
std::vector<std::unique_ptr<std::barrier<>>>* warp_barriers;
float warp_values[32][32];
} // namespace emu

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }
// Without programmatic dependent launch there is nothing to wait for.
inline void pdl_enter() {}

inline float bf16_to_f32(bf16_t v) {
    u32 u = ((u32)v) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
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
