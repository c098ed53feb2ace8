// Matrix-vector products for decode: `out[r][j] = x[r] . w[j]` for up to
// GEMV_MAX_ROWS input rows, so every weight byte is read from memory exactly
// once per step however many rows share it.
//
// Layout of the fast kernels (bf16 and the ggml block formats): a block of
// GEMV_WARPS warps owns a few weight rows (GEMV_NW for bf16, GEMVQ_NW for the
// block formats) and splits their K range between its warps, the warps
// interleaved so that each load instruction of the block reads one contiguous
// span. Each thread keeps U x NW 16-byte loads in flight before any arithmetic
// (memory-level parallelism is what decode needs to reach the copy bandwidth),
// and reuses every activation value it reads for all NW weight rows: at 8 input
// rows the activations, read through L1, would otherwise cost more L1 bandwidth
// than the weights themselves. The per-warp partial sums meet in shared memory.
//
// The per-row kernels are instantiated for R = 1, 2, 4 and 8 input rows (the
// host picks the smallest R >= rows; rows beyond `rows` are skipped, never
// read). Their f32 FMAs (R per weight) become the limit from about 3 rows on;
// there `gemv_bf16_tc` below moves the products to the tensor cores.
// `gemv_any` is the slow general fallback.

#define GEMV_MAX_ROWS 8
#define GEMV_WARPS 4
#define GEMV_NW 4
#define GEMVQ_NW 2

// Weights are read once per step: bypass L1 so the activations stay there.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ unsigned short ld_stream_u16(const u8* p) {
    unsigned short v;
    asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

// Dot product of 8 bf16 weights (one 16-byte chunk) with 8 f32 activations.
__device__ __forceinline__ float dot8_bf16(uint4 p, float4 a, float4 b) {
    float s = __uint_as_float(p.x << 16) * a.x;
    s += __uint_as_float(p.x & 0xffff0000u) * a.y;
    s += __uint_as_float(p.y << 16) * a.z;
    s += __uint_as_float(p.y & 0xffff0000u) * a.w;
    s += __uint_as_float(p.z << 16) * b.x;
    s += __uint_as_float(p.z & 0xffff0000u) * b.y;
    s += __uint_as_float(p.w << 16) * b.z;
    s += __uint_as_float(p.w & 0xffff0000u) * b.w;
    return s;
}

// Sum each warp's partials over the block and store the NW x R results
// times `scale` (plus `bias[j]` when a bias is given).
template <int R, int NW>
__device__ __forceinline__ void gemv_finish(float (&acc)[R][NW], float* __restrict__ out,
                                            const float* __restrict__ bias, int n, int j0, int rows,
                                            float scale = 1.f) {
    __shared__ float red[GEMV_WARPS][R * NW];
    warp_sums_store<R, NW>(acc, red[threadIdx.x >> 5], rows);
    __syncthreads();
    int t = threadIdx.x;
    if (t < R * NW) {
        int r = t / NW, j = j0 + t % NW;
        if (r < rows && j < n) {
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < GEMV_WARPS; w++) s += red[w][t];
            s *= scale;
            if (bias) s += bias[j];
            out[(long long)r * n + j] = s;
        }
    }
}

// The U x NW weight chunks of one pass, from `base` (zeros past the row's end).
template <int U, int NW>
__device__ __forceinline__ void gemv_bf16_load(const uint4* const (&wr)[NW], int base, int chunks,
                                               uint4 (&p)[U][NW]) {
    const int step = GEMV_WARPS * 32;
#pragma unroll
    for (int u = 0; u < U; u++) {
        int c = base + u * step;
#pragma unroll
        for (int i = 0; i < NW; i++) {
            if (c < chunks) p[u][i] = ld_stream(wr[i] + c);
            else p[u][i].x = p[u][i].y = p[u][i].z = p[u][i].w = 0u;
        }
    }
}

// acc[r][i] = x[r] . (weight row behind wr[i]) over k (a multiple of 8), the
// K range split between the block's warps. Calls `pdl_enter` itself: with
// `early`, after the first pass's weight loads are issued. Weights are
// written by no kernel, so a kernel launched ahead of its time may read them
// while the kernel before it still runs; the loads are then in flight by the
// time the wait returns, instead of starting after it (every kernel of a
// batch-1 decode step is short enough that this start-up is a visible part
// of it). The arithmetic is the same either way.
template <int R, int U, int NW>
__device__ __forceinline__ void gemv_bf16_acc(const uint4* const (&wr)[NW], const float* __restrict__ x, int k,
                                              int rows, float (&acc)[R][NW], int early) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int i = 0; i < NW; i++) acc[r][i] = 0.f;
    int chunks = k >> 3;
    const int step = GEMV_WARPS * 32;
    int base = wid * 32 + lane;
    uint4 p[U][NW];
    if (!early) pdl_enter();
    gemv_bf16_load<U, NW>(wr, base, chunks, p);
    if (early) pdl_enter();
    while (base < chunks) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = base + u * step;
            if (c < chunks) {
#pragma unroll
                for (int r = 0; r < R; r++) {
                    if (r < rows) {
                        const float4* xr = (const float4*)(x + (long long)r * k) + 2 * c;
                        float4 a = __ldg(xr), b = __ldg(xr + 1);
#pragma unroll
                        for (int i = 0; i < NW; i++) acc[r][i] += dot8_bf16(p[u][i], a, b);
                    }
                }
            }
        }
        base += step * U;
        if (base < chunks) gemv_bf16_load<U, NW>(wr, base, chunks, p);
    }
}

// Up to three bf16 matrices that share one input (q/k/v) in one launch:
// blocks [0, nb0) serve matrix 0, the next nb1 matrix 1, the rest matrix 2
// (a plain matmul passes n1 = n2 = 0). Biases may be null. Rows 16-byte
// aligned, k a multiple of 8. A block owns NW weight rows. With FOLD (one
// row), `x` is a folded norm's x * w (fold.cu): the products are scaled by
// 1 / rms from the producer's `slots`, and the norm is stored into `h`.
template <int R, int U, int NW, bool FOLD = false>
__device__ __forceinline__ void gemv_bf16_body(const bf16_t* __restrict__ w0, const bf16_t* __restrict__ w1,
                                               const bf16_t* __restrict__ w2, float* __restrict__ o0,
                                               float* __restrict__ o1, float* __restrict__ o2,
                                               const float* __restrict__ b0, const float* __restrict__ b1,
                                               const float* __restrict__ b2, int n0, int n1, int n2,
                                               const float* __restrict__ x, int k, int rows, int early,
                                               const float* __restrict__ slots = nullptr, int n_slots = 0,
                                               float eps = 0.f, float* __restrict__ h = nullptr) {
    int blk = blockIdx.x;
    int p = launch_part(blk, n0, n1, NW);
    const bf16_t* w = w0;
    float* out = o0;
    const float* bias = b0;
    int n = n0;
    if (p == 1) w = w1, out = o1, bias = b1, n = n1;
    if (p == 2) w = w2, out = o2, bias = b2, n = n2;
    int j0 = blk * NW;
    const uint4* wr[NW];
#pragma unroll
    for (int i = 0; i < NW; i++) wr[i] = (const uint4*)(w + (long long)imin(j0 + i, n - 1) * k);
    float acc[R][NW];
    gemv_bf16_acc<R, U, NW>(wr, x, k, rows, acc, early);
    float inv = 1.f;
    if (FOLD) {
        inv = fold_inv_rms(slots, n_slots, k, eps);
        fold_store_norm(x, inv, h, k);
    }
    gemv_finish<R, NW>(acc, out, bias, n, j0, rows, inv);
}

// MINB: blocks per SM the register budget must allow. At one row, 2 x 4
// loads in flight per thread with 8 blocks per SM beat 4 x 4 loads with 5
// (measured on the H200: 4096x4096 76% against 67% of the copy bandwidth):
// a 4096-row matrix then runs in one wave of blocks instead of one and a half.
// (2 rows per block with 4 x 2 loads, twice the blocks for a fuller last wave,
// measured slower in serving: 4.78 -> 4.86 ms per batch-1 step.)
#define GEMV_BF16(NAME, R, U, NW, MINB)                                                                            \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MINB)                                            \
        NAME(const bf16_t* __restrict__ w0, const bf16_t* __restrict__ w1, const bf16_t* __restrict__ w2,          \
             float* __restrict__ o0, float* __restrict__ o1, float* __restrict__ o2,                               \
             const float* __restrict__ b0, const float* __restrict__ b1, const float* __restrict__ b2, int n0,    \
             int n1, int n2, const float* __restrict__ x, int k, int rows, int early) {                            \
        gemv_bf16_body<R, U, NW>(w0, w1, w2, o0, o1, o2, b0, b1, b2, n0, n1, n2, x, k, rows, early);              \
    }
GEMV_BF16(gemv_bf16_r1, 1, 2, GEMV_NW, 8)
// Two rows a block, for matrices whose four-row blocks would fill under half
// of one wave (attention.rs-sized projections of a MoE model: 2048 x 4096 is
// 512 blocks against 8 x 132 slots); the same 8 loads in flight per thread.
GEMV_BF16(gemv_bf16_r1_nw2, 1, 4, 2, 8)
// The two halves of a folded residual add + RMSNorm at one row (fold.cu).
// The producer: out = in . w[j] is added to the residual x, the products
// with the norm's weight `nw` go to `hw` and the block's squares to slots.
template <int U, int NW>
__device__ __forceinline__ void gemv_bf16_residual_body(const bf16_t* __restrict__ w, const float* __restrict__ in,
                                                        int k, int n, float* __restrict__ x,
                                                        const float* __restrict__ nw, float* __restrict__ hw,
                                                        float* __restrict__ slots, int early) {
    __shared__ float red[GEMV_WARPS][NW];
    int j0 = blockIdx.x * NW;
    const uint4* wr[NW];
#pragma unroll
    for (int i = 0; i < NW; i++) wr[i] = (const uint4*)(w + (long long)imin(j0 + i, n - 1) * k);
    float acc[1][NW];
    gemv_bf16_acc<1, U, NW>(wr, in, k, 1, acc, early);
    warp_sums_store<1, NW>(acc, red[threadIdx.x >> 5], 1);
    __syncthreads();
    if (threadIdx.x < 32) {
        int t = threadIdx.x;
        float s = 0.f;
        if (t < NW) {
#pragma unroll
            for (int v = 0; v < GEMV_WARPS; v++) s += red[v][t];
        }
        fold_residual(s, imin(NW, n - j0), j0, x, nw, hw, slots);
    }
}
#define GEMV_BF16_RESIDUAL(NAME, U, NW)                                                                            \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 8)                                               \
        NAME(const bf16_t* __restrict__ w, const float* __restrict__ in, int k, int n, float* __restrict__ x,      \
             const float* __restrict__ nw, float* __restrict__ hw, float* __restrict__ slots, int early) {         \
        gemv_bf16_residual_body<U, NW>(w, in, k, n, x, nw, hw, slots, early);                                     \
    }
GEMV_BF16_RESIDUAL(gemv_bf16_r1_residual, 2, GEMV_NW)
GEMV_BF16_RESIDUAL(gemv_bf16_r1_nw2_residual, 4, 2)
// The consumer: `gemv_bf16_r1` over x = hw, its products scaled by 1 / rms.
#define GEMV_BF16_FOLD(NAME, U, NW)                                                                                \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 8)                                               \
        NAME(const bf16_t* __restrict__ w0, const bf16_t* __restrict__ w1, const bf16_t* __restrict__ w2,          \
             float* __restrict__ o0, float* __restrict__ o1, float* __restrict__ o2,                               \
             const float* __restrict__ b0, const float* __restrict__ b1, const float* __restrict__ b2, int n0,    \
             int n1, int n2, const float* __restrict__ x, int k, const float* __restrict__ slots, int n_slots,    \
             float eps, float* __restrict__ h, int early) {                                                        \
        gemv_bf16_body<1, U, NW, true>(w0, w1, w2, o0, o1, o2, b0, b1, b2, n0, n1, n2, x, k, 1, early, slots,     \
                                       n_slots, eps, h);                                                           \
    }
GEMV_BF16_FOLD(gemv_bf16_r1_fold, 2, GEMV_NW)
GEMV_BF16_FOLD(gemv_bf16_r1_nw2_fold, 4, 2)
GEMV_BF16(gemv_bf16_r2, 2, 4, GEMV_NW, 1)
GEMV_BF16(gemv_bf16_r4, 4, 2, GEMV_NW, 1)
GEMV_BF16(gemv_bf16_r8, 8, 2, GEMV_NW, 1)

// The MLP's gate and up projections and SiLU in one launch:
// out[r][j] = silu(x[r] . gate[j]) * (x[r] . up[j]). A block owns GLU_NW
// output columns and reads their gate and up rows together (2 x GLU_NW
// loads in flight per thread, as the plain kernel's 2 x 4), so the products
// never leave the block. Same SiLU as `silu_mul`.
template <int R, int GLU_NW, int U, bool FOLD = false>
__device__ __forceinline__ void gemv_bf16_glu_body(const bf16_t* __restrict__ wg, const bf16_t* __restrict__ wu,
                                                   const float* __restrict__ x, float* __restrict__ out, int n,
                                                   int k, int rows, int early,
                                                   const float* __restrict__ slots = nullptr, int n_slots = 0,
                                                   float eps = 0.f, float* __restrict__ h = nullptr) {
    __shared__ float red[GEMV_WARPS][R * 2 * GLU_NW];
    int j0 = blockIdx.x * GLU_NW;
    const uint4* wr[2 * GLU_NW];
#pragma unroll
    for (int i = 0; i < GLU_NW; i++) {
        long long row = (long long)imin(j0 + i, n - 1) * k;
        wr[i] = (const uint4*)(wg + row);
        wr[GLU_NW + i] = (const uint4*)(wu + row);
    }
    float acc[R][2 * GLU_NW];
    gemv_bf16_acc<R, U, 2 * GLU_NW>(wr, x, k, rows, acc, early);
    float inv = 1.f;
    if (FOLD) {
        inv = fold_inv_rms(slots, n_slots, k, eps);
        fold_store_norm(x, inv, h, k);
    }
    warp_sums_store<R, 2 * GLU_NW>(acc, red[threadIdx.x >> 5], rows);
    __syncthreads();
    int t = threadIdx.x;
    if (t < R * GLU_NW) {
        int r = t / GLU_NW, i = t % GLU_NW, j = j0 + i;
        if (r < rows && j < n) {
            float g = 0.f, u = 0.f;
#pragma unroll
            for (int w = 0; w < GEMV_WARPS; w++) {
                g += red[w][r * 2 * GLU_NW + i];
                u += red[w][r * 2 * GLU_NW + GLU_NW + i];
            }
            if (FOLD) g *= inv, u *= inv;
            out[(long long)r * n + j] = g / (1.0f + expf(-g)) * u;
        }
    }
}

#define GEMV_GLU(NAME, R, NW, U, MINB)                                                                             \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MINB)                                            \
        NAME(const bf16_t* __restrict__ wg, const bf16_t* __restrict__ wu, const float* __restrict__ x,            \
             float* __restrict__ out, int n, int k, int rows, int early) {                                         \
        gemv_bf16_glu_body<R, NW, U>(wg, wu, x, out, n, k, rows, early);                                           \
    }
GEMV_GLU(gemv_bf16_glu_r1, 1, 4, 1, 8)
GEMV_GLU(gemv_bf16_glu_r2, 2, 4, 1, 1)
// gate/up/SiLU as the consumer of a folded norm (one row; fold.cu).
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 8)
    gemv_bf16_glu_r1_fold(const bf16_t* __restrict__ wg, const bf16_t* __restrict__ wu, const float* __restrict__ x,
                          float* __restrict__ out, int n, int k, const float* __restrict__ slots, int n_slots,
                          float eps, float* __restrict__ h, int early) {
    gemv_bf16_glu_body<1, 4, 1, true>(wg, wu, x, out, n, k, 1, early, slots, n_slots, eps, h);
}

// bf16 weights on the tensor cores, for 2..8 input rows, k a multiple of 32.
//
// A block of GEMVT_WARPS warps owns 16 weight rows (the M of mma.m16n8k16)
// and splits K between its warps in 32-element superblocks; the input rows
// are the N = 8 columns. The f32 activations are split into a bf16 high part
// and a bf16 remainder, each multiplied on the tensor cores with f32
// accumulation: x = hi + lo holds 16 significant bits, so the result carries
// a relative error near 2^-17, as close to the f32 GEMV as makes no
// difference, while the f32 FMA units (the limit of the per-row kernel above
// at 4 and more rows) do nothing but the split.
//
// The product is a sum over k, so any order of k works as long as A and B
// agree. Thread (g, t) loads 8 consecutive weights of rows g and g + 8 at
// k = 32 sb + 8 t (one 16-byte load each, contiguous across the quad) and
// uses elements 4s..4s+3 as its A fragment of k-step s; its B fragment holds
// the same 4 k of input row g. The logical k of the fragment layout
// (2t, 2t+1, 2t+8, 2t+9) thus maps to the physical 32 sb + 8 t + 4 s + 0..3.

#define GEMVT_WARPS 8

__device__ __forceinline__ void mma_bf16_m16n8k16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two f32 as a bf16 pair (lo in the low half) and the remainders x - bf16(x).
__device__ __forceinline__ void split_bf16x2(float x0, float x1, u32& hi, u32& lo) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(x1), "f"(x0));
    float r0 = x0 - __uint_as_float(hi << 16), r1 = x1 - __uint_as_float(hi & 0xffff0000u);
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(r1), "f"(r0));
}

template <int U, int MT>
__device__ __forceinline__ void gemv_tc_load(const uint4* const (&wr)[2 * MT], int sb0, int nsb,
                                             uint4 (&p)[U][2 * MT]) {
#pragma unroll
    for (int u = 0; u < U; u++) {
        int sb = sb0 + u * GEMVT_WARPS;
#pragma unroll
        for (int m = 0; m < 2 * MT; m++) {
            if (sb < nsb) p[u][m] = ld_stream(wr[m] + 4 * sb);
            else p[u][m].x = p[u][m].y = p[u][m].z = p[u][m].w = 0u;
        }
    }
}

// `early`: the first pass's weights are loaded before `pdl_enter`, as in
// `gemv_bf16_acc`.
template <int U, int MT>
__device__ __forceinline__ void gemv_tc_body(const bf16_t* __restrict__ w, const float* __restrict__ x,
                                             float* __restrict__ out, int n, int k, int rows, int early) {
    // MT tiles of 16 weight rows share every activation fragment.
    __shared__ float red[GEMVT_WARPS][16 * MT][8];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int g = lane >> 2, t = lane & 3;
    int j0 = blockIdx.x * 16 * MT;
    const uint4* wr[2 * MT];
#pragma unroll
    for (int m = 0; m < 2 * MT; m++) wr[m] = (const uint4*)(w + (long long)imin(j0 + 8 * m + g, n - 1) * k) + t;
    // Input row g feeds column g of B; rows past `rows` stay zero and are never read.
    bool has_x = g < rows;
    const float4* xr = (const float4*)(x + (long long)(has_x ? g : 0) * k) + 2 * t;
    float c[MT][4];
#pragma unroll
    for (int m = 0; m < MT; m++) c[m][0] = c[m][1] = c[m][2] = c[m][3] = 0.f;
    int nsb = k >> 5;
    int sb0 = wid;
    uint4 p[U][2 * MT];
    if (!early) pdl_enter();
    gemv_tc_load<U, MT>(wr, sb0, nsb, p);
    if (early) pdl_enter();
    while (sb0 < nsb) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            int sb = sb0 + u * GEMVT_WARPS;
            if (sb < nsb) {
                float4 xa = make_float4(0.f, 0.f, 0.f, 0.f), xb = xa;
                if (has_x) {
                    xa = __ldg(xr + 8 * sb);
                    xb = __ldg(xr + 8 * sb + 1);
                }
                u32 h0, l0, h1, l1, h2, l2, h3, l3;
                split_bf16x2(xa.x, xa.y, h0, l0);
                split_bf16x2(xa.z, xa.w, h1, l1);
                split_bf16x2(xb.x, xb.y, h2, l2);
                split_bf16x2(xb.z, xb.w, h3, l3);
#pragma unroll
                for (int m = 0; m < MT; m++) {
                    const uint4 &pa = p[u][2 * m], &pb = p[u][2 * m + 1];
                    // k-step 0: elements 0..3; k-step 1: elements 4..7.
                    mma_bf16_m16n8k16(c[m], pa.x, pb.x, pa.y, pb.y, h0, h1);
                    mma_bf16_m16n8k16(c[m], pa.x, pb.x, pa.y, pb.y, l0, l1);
                    mma_bf16_m16n8k16(c[m], pa.z, pb.z, pa.w, pb.w, h2, h3);
                    mma_bf16_m16n8k16(c[m], pa.z, pb.z, pa.w, pb.w, l2, l3);
                }
            }
        }
        sb0 += GEMVT_WARPS * U;
        if (sb0 < nsb) gemv_tc_load<U, MT>(wr, sb0, nsb, p);
    }
    // c0, c1: weight row g, input rows 2t, 2t + 1; c2, c3: weight row g + 8.
#pragma unroll
    for (int m = 0; m < MT; m++) {
        red[wid][16 * m + g][2 * t] = c[m][0];
        red[wid][16 * m + g][2 * t + 1] = c[m][1];
        red[wid][16 * m + g + 8][2 * t] = c[m][2];
        red[wid][16 * m + g + 8][2 * t + 1] = c[m][3];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 16 * MT * 8; i += GEMVT_WARPS * 32) {
        int wrow = i >> 3, xrow = i & 7, j = j0 + wrow;
        if (xrow < rows && j < n) {
            float s = 0.f;
#pragma unroll
            for (int v = 0; v < GEMVT_WARPS; v++) s += red[v][wrow][xrow];
            out[(long long)xrow * n + j] = s;
        }
    }
}

#define GEMV_TC(NAME, U, MT)                                                                                       \
    extern "C" __global__ void __launch_bounds__(GEMVT_WARPS * 32)                                                 \
        NAME(const bf16_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ out, int n, int k,      \
             int rows, int early) {                                                                                \
        gemv_tc_body<U, MT>(w, x, out, n, k, rows, early);                                                         \
    }
// One 16-row tile per block, 4 superblocks in flight per warp: measured
// against 8 in flight and against two tiles per block (32 rows), this one was
// the fastest or within 2% on every Llama-3-8B shape.
GEMV_TC(gemv_bf16_tc, 4, 1)

// ggml block formats. A thread handles "pieces" of 8 quants: a quarter of a
// 32-quant block. Q8_0 (34-byte blocks: f16 scale, 32 int8): a piece is 8
// consecutive quants. Q4_0 (18 bytes: scale, 16 bytes of nibbles, low nibble
// of byte i is quant i, high nibble quant i + 16) and Q4_1 (20 bytes: scale,
// min, nibbles): a piece is bytes 4s..4s+3, i.e. quants 4s..4s+3 and
// 16+4s..16+4s+3. Blocks are only 2-byte aligned, so the bytes are read as
// 16-bit words; a warp still reads one contiguous span per instruction.
template <int DT>
struct QFmt;
template <>
struct QFmt<DT_Q8_0> {
    static const int bytes = 34, qs = 2, words = 4;
};
template <>
struct QFmt<DT_Q4_0> {
    static const int bytes = 18, qs = 2, words = 2;
};
template <>
struct QFmt<DT_Q4_1> {
    static const int bytes = 20, qs = 4, words = 2;
};

// The raw bytes of one piece, loaded ahead of the arithmetic.
template <int DT>
struct QPiece {
    unsigned short d, m;
    unsigned short q[QFmt<DT>::words];
};

template <int DT>
__device__ __forceinline__ QPiece<DT> q_load(const u8* row, int piece) {
    QPiece<DT> p;
    const u8* blk = row + (long long)(piece >> 2) * QFmt<DT>::bytes;
    const int per = QFmt<DT>::words * 2;
    const u8* qs = blk + QFmt<DT>::qs + (piece & 3) * per;
    p.d = ld_stream_u16(blk);
    p.m = DT == DT_Q4_1 ? ld_stream_u16(blk + 2) : (unsigned short)0;
#pragma unroll
    for (int i = 0; i < QFmt<DT>::words; i++) p.q[i] = ld_stream_u16(qs + 2 * i);
    return p;
}

// The piece's 8 quants as floats, in the order of the activations they meet:
// Q8_0 x[8s..8s+7]; Q4 x[4s..4s+3] then x[16+4s..16+4s+3].
template <int DT>
__device__ __forceinline__ void q_decode(const QPiece<DT>& p, float (&v)[8]) {
    if (DT == DT_Q8_0) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = (float)(signed char)(p.q[i] & 0xff);
            v[2 * i + 1] = (float)(signed char)(p.q[i] >> 8);
        }
    } else {
        u32 b = (u32)p.q[0] | ((u32)p.q[1] << 16);
        float off = DT == DT_Q4_0 ? 8.f : 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[i] = (float)((b >> (8 * i)) & 0xf) - off;
            v[4 + i] = (float)((b >> (8 * i + 4)) & 0xf) - off;
        }
    }
}

template <int DT, int R, int U>
__device__ __forceinline__ void gemv_q_body(const u8* __restrict__ w, long long row_bytes, const float* __restrict__ x,
                                            float* __restrict__ out, int n, int k, int rows) {
    pdl_enter();
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int j0 = blockIdx.x * GEMVQ_NW;
    const u8* wr[GEMVQ_NW];
#pragma unroll
    for (int i = 0; i < GEMVQ_NW; i++) wr[i] = w + (long long)imin(j0 + i, n - 1) * row_bytes;
    float acc[R][GEMVQ_NW];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int i = 0; i < GEMVQ_NW; i++) acc[r][i] = 0.f;
    int pieces = k >> 3;
    const int step = GEMV_WARPS * 32;
    for (int base = wid * 32 + lane; base < pieces; base += step * U) {
        QPiece<DT> p[U][GEMVQ_NW];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = imin(base + u * step, pieces - 1);
#pragma unroll
            for (int i = 0; i < GEMVQ_NW; i++) p[u][i] = q_load<DT>(wr[i], c);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = base + u * step;
            if (c < pieces) {
                int e0 = (c >> 2) * 32 + (DT == DT_Q8_0 ? (c & 3) * 8 : (c & 3) * 4);
                int e1 = DT == DT_Q8_0 ? e0 + 4 : e0 + 16;
#pragma unroll
                for (int r = 0; r < R; r++) {
                    if (r < rows) {
                        const float* xr = x + (long long)r * k;
                        float4 a = __ldg((const float4*)(xr + e0)), b = __ldg((const float4*)(xr + e1));
                        float sx = a.x + a.y + a.z + a.w + b.x + b.y + b.z + b.w;
#pragma unroll
                        for (int i = 0; i < GEMVQ_NW; i++) {
                            float v[8];
                            q_decode<DT>(p[u][i], v);
                            float dot = v[0] * a.x + v[1] * a.y + v[2] * a.z + v[3] * a.w + v[4] * b.x +
                                        v[5] * b.y + v[6] * b.z + v[7] * b.w;
                            float d = f16_to_f32(p[u][i].d);
                            acc[r][i] += d * dot;
                            if (DT == DT_Q4_1) acc[r][i] += f16_to_f32(p[u][i].m) * sx;
                        }
                    }
                }
            }
        }
    }
    gemv_finish<R, GEMVQ_NW>(acc, out, nullptr, n, j0, rows);
}

#define GEMV_Q(NAME, DT, R, U)                                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                                 \
        gemv_##NAME##_r##R(const u8* __restrict__ w, long long row_bytes, const float* __restrict__ x,           \
                           float* __restrict__ out, int n, int k, int rows) {                                     \
        gemv_q_body<DT, R, U>(w, row_bytes, x, out, n, k, rows);                                                  \
    }
GEMV_Q(q8_0, DT_Q8_0, 1, 4)
GEMV_Q(q8_0, DT_Q8_0, 2, 4)
GEMV_Q(q8_0, DT_Q8_0, 4, 2)
GEMV_Q(q8_0, DT_Q8_0, 8, 2)
GEMV_Q(q4_0, DT_Q4_0, 1, 4)
GEMV_Q(q4_0, DT_Q4_0, 2, 4)
GEMV_Q(q4_0, DT_Q4_0, 4, 2)
GEMV_Q(q4_0, DT_Q4_0, 8, 2)
GEMV_Q(q4_1, DT_Q4_1, 1, 4)
GEMV_Q(q4_1, DT_Q4_1, 2, 4)
GEMV_Q(q4_1, DT_Q4_1, 4, 2)
GEMV_Q(q4_1, DT_Q4_1, 8, 2)

// Q5_0, Q5_1, IQ4_NL, the K-quants and IQ4_XS for decode rows: one warp per
// weight row, each lane two 32-weight groups at a time (a K-quant sub-block;
// blocks.cu `deq32` decodes its scales once and its quants a word at a
// time), dotted with every input row. Neighbouring lanes take neighbouring
// groups, so a warp's loads cover one contiguous stretch of the row, and both
// groups' loads are issued before either is used.
template <int DT, int R>
__device__ __forceinline__ void gemv_bq_body(const u8* __restrict__ w, long long row_bytes, const float* __restrict__ x,
                                             float* __restrict__ out, int n, int k, int rows) {
    pdl_enter();
    int lane = threadIdx.x & 31;
    int j = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (j >= n) return;
    const u8* row = w + (long long)j * row_bytes;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    int groups = k >> 5;
    for (int c0 = lane; c0 < groups; c0 += 64) {
        float wv[2][32];
        int cs[2] = {c0, c0 + 32};
        bool second = c0 + 32 < groups;
        deq32<DT>(row, 32 * c0, wv[0]);
        deq32<DT>(row, 32 * (second ? c0 + 32 : c0), wv[1]);
#pragma unroll
        for (int u = 0; u < 2; u++) {
            if (u == 1 && !second) break;
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r < rows) {
                    const float4* xr = (const float4*)(x + (long long)r * k + cs[u] * 32);
                    float s = 0.f;
#pragma unroll
                    for (int q = 0; q < 8; q++) {
                        float4 a = __ldg(xr + q);
                        s += wv[u][4 * q] * a.x + wv[u][4 * q + 1] * a.y + wv[u][4 * q + 2] * a.z +
                             wv[u][4 * q + 3] * a.w;
                    }
                    acc[r] += s;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        float s = warp_sum(acc[r]);
        if (lane == 0 && r < rows) out[(long long)r * n + j] = s;
    }
}

#define GEMV_BQ(NAME, DT, R)                                                                                      \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                                 \
        gemv_##NAME##_r##R(const u8* __restrict__ w, long long row_bytes, const float* __restrict__ x,           \
                           float* __restrict__ out, int n, int k, int rows) {                                     \
        gemv_bq_body<DT, R>(w, row_bytes, x, out, n, k, rows);                                                    \
    }
#define GEMV_BQ_ALL(NAME, DT) GEMV_BQ(NAME, DT, 1) GEMV_BQ(NAME, DT, 2) GEMV_BQ(NAME, DT, 4) GEMV_BQ(NAME, DT, 8)
GEMV_BQ_ALL(q5_0, DT_Q5_0)
GEMV_BQ_ALL(q5_1, DT_Q5_1)
GEMV_BQ_ALL(iq4_nl, DT_IQ4_NL)
GEMV_BQ_ALL(q2_k, DT_Q2_K)
GEMV_BQ_ALL(q3_k, DT_Q3_K)
GEMV_BQ_ALL(q4_k, DT_Q4_K)
GEMV_BQ_ALL(q5_k, DT_Q5_K)
GEMV_BQ_ALL(q6_k, DT_Q6_K)
GEMV_BQ_ALL(iq4_xs, DT_IQ4_XS)

// Any storage type, any k (bf16 rows of odd width, f32): one warp per weight
// row, one lane per 32-element stretch. Slow but general; the fast kernels
// above take every shape a real checkpoint has.
extern "C" __global__ void gemv_any(const u8* __restrict__ w, int dtype, long long row_bytes,
                                    const float* __restrict__ x, float* __restrict__ out, int n, int k, int rows) {
    pdl_enter();
    int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (j >= n) return;
    int lane = threadIdx.x & 31;
    const u8* row = w + (long long)j * row_bytes;
    float acc[GEMV_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; r++) acc[r] = 0.f;
    int blocks = (k + 31) / 32;
    for (int b = lane; b < blocks; b += 32) {
        int e0 = b * 32, e1 = imin(e0 + 32, k);
        for (int e = e0; e < e1; e++) {
            float wv = load_elem(row, dtype, e);
#pragma unroll
            for (int r = 0; r < GEMV_MAX_ROWS; r++)
                if (r < rows) acc[r] += wv * x[(long long)r * k + e];
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
