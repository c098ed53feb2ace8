// kernels/sample.cu run on the host, for the test in ../sample_kernel.rs: one
// OS thread per CUDA thread of a block (the test compiles the kernel with 64
// threads a block instead of 1024), a barrier for __syncthreads and one per
// warp for the shuffles, and the CUDA intrinsics the kernel calls as the
// plain IEEE operations they are (compiled without fused multiply-adds,
// which the intrinsics rule out on the device too). Blocks run one after
// another, so the kernel's __shared__ variables become statics.
//
// Usage: sample_kernel_host IN OUT CHUNK. IN: u32 vocab, rows, specs, edits,
// then the logits (f32), the specs and the edits as crates/backend/src/sample.rs
// lays them out. CHUNK > 0: `sample_scan` first runs over slices of CHUNK
// tokens (a block per slice of each spec's row), and `sample_rows` starts
// from its results; 0: `sample_rows` alone. OUT: one summary per spec, then
// the logits as the kernels left them (sanitized and edited in place).
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

typedef unsigned int u32;

static inline float __int_as_float(u32 v) {
    float f;
    memcpy(&f, &v, 4);
    return f;
}
static inline u32 __float_as_uint(float f) {
    u32 v;
    memcpy(&v, &f, 4);
    return v;
}
static inline float __uint_as_float(u32 v) { return __int_as_float(v); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
#define NEG_INF __int_as_float(0xff800000)

struct Dim {
    u32 x, y;
};
thread_local Dim threadIdx, blockIdx;
static Dim gridDim;
static std::barrier<>* block_barrier;
static std::vector<std::barrier<>*> warp_barriers;
static inline void __syncthreads() { block_barrier->arrive_and_wait(); }
static inline void pdl_enter() {}

// A shuffle: every lane of the warp posts its value, waits, reads its
// source lane's, and waits again before the slots are reused.
static double posted[64][32];
template <class T> static T shuffle(T v, int from) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    memcpy(&posted[warp][lane], &v, sizeof(T));
    warp_barriers[warp]->arrive_and_wait();
    T r;
    memcpy(&r, &posted[warp][from], sizeof(T));
    warp_barriers[warp]->arrive_and_wait();
    return r;
}
#define __shfl_xor_sync(mask, v, o) shuffle(v, (threadIdx.x & 31) ^ (o))
#define __shfl_up_sync(mask, v, o) shuffle(v, (int)(threadIdx.x & 31) >= (o) ? (threadIdx.x & 31) - (o) : (threadIdx.x & 31))

static inline u32 atomicAdd(u32* p, u32 v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline u32 atomicMax(u32* p, u32 v) {
    u32 o = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (o < v && !__atomic_compare_exchange_n(p, &o, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return o;
}
using std::isinf;
using std::isnan;
using std::min;
using std::nextafter;
#define __device__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(n)
#define __shared__ static

#include "kernel.inc" // sample.cu as the test prepared it

// One block of `threads` threads, `body` run by each with its thread index.
template <class F> static void run_block(int threads, F body) {
    std::barrier<> block(threads);
    block_barrier = &block;
    std::vector<std::barrier<>*> warps;
    for (int w = 0; w < threads / 32; w++) warps.push_back(new std::barrier<>(32));
    warp_barriers = warps;
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; t++) {
        ts.emplace_back([&, t] {
            threadIdx.x = t;
            body();
        });
    }
    for (auto& t : ts) t.join();
    for (auto* w : warps) delete w;
}

int main(int argc, char** argv) {
    if (argc != 4) return 2;
    FILE* f = fopen(argv[1], "rb");
    if (!f) return 2;
    const int chunk = atoi(argv[3]);
    u32 hdr[4];
    if (fread(hdr, 4, 4, f) != 4) return 2;
    const u32 vocab = hdr[0], rows = hdr[1], nspecs = hdr[2], nedits = hdr[3];
    std::vector<float> logits((size_t)vocab * rows);
    std::vector<SampleSpec> specs(nspecs);
    std::vector<SampleEdit> edits(nedits + 1);
    if (fread(logits.data(), 4, logits.size(), f) != logits.size()) return 2;
    if (fread(specs.data(), sizeof(SampleSpec), nspecs, f) != nspecs) return 2;
    if (fread(edits.data(), sizeof(SampleEdit), nedits, f) != nedits) return 2;
    fclose(f);
    std::vector<SampleSummary> out(nspecs);
    const int slices = chunk > 0 ? (int)((vocab + chunk - 1) / chunk) : 0;
    std::vector<SampleSlice> scanned((size_t)nspecs * (slices > 0 ? slices : 1));
    if (slices > 0) {
        gridDim.x = slices;
        for (u32 b = 0; b < nspecs; b++) {
            for (int sl = 0; sl < slices; sl++) {
                run_block(SCAN_THREADS, [&] {
                    blockIdx.x = sl;
                    blockIdx.y = b;
                    sample_scan(logits.data(), (int)vocab, chunk, specs.data(), edits.data(), scanned.data());
                });
            }
        }
    }
    for (u32 b = 0; b < nspecs; b++) {
        run_block(SAMPLE_THREADS, [&] {
            blockIdx.x = b;
            if (slices > 0)
                sample_rows_sliced(logits.data(), (int)vocab, specs.data(), edits.data(), out.data(), scanned.data(),
                                   slices);
            else
                sample_rows(logits.data(), (int)vocab, specs.data(), edits.data(), out.data());
        });
    }
    FILE* o = fopen(argv[2], "wb");
    if (!o) return 2;
    fwrite(out.data(), sizeof(SampleSummary), nspecs, o);
    fwrite(logits.data(), 4, logits.size(), o);
    fclose(o);
    return 0;
}
