// The routed expert FFN of a sparse mixture-of-experts layer (Qwen3-MoE),
// with routing on the device so a decode step needs no host sync and can be
// captured. Host side: crates/backend/src/cuda/moe.rs.
//
// One layer's FFN, after the router matmul:
//   moe_route   per row: softmax over the experts, the top k (ties to the
//               lower index), their weights (renormalized when asked);
//   moe_sort    one block: the (row, slot) pairs grouped by expert (a count,
//               an offset and a position per pair), the list of experts in
//               use and the work tiles of the grouped GEMM;
//               (moe_route_sort: both in one block, for decode's few rows)
//   gate/up     per chosen expert, silu(gate x) * up x for each of its pairs;
//   down        per chosen expert, down · act for each of its pairs;
//   moe_combine per row, the weighted sum of its pairs' outputs in slot order
//               (moe_gemv_down_combine[_bf16]: down and the sum in one, for
//               1-2 rows).
// gate/up and down come in two forms: routed GEMVs for decode, which read
// each chosen expert's weights once and no other expert's at all, and a
// grouped GEMM for prefill (bf16 mma.sync tiles of MOE_BM pairs of one
// expert, all experts' tiles in one launch). The routed GEMVs of bf16
// experts keep many 16-byte loads in flight per thread, a block's threads
// splitting the K range of a few weight rows (and, for down at few rows,
// the row's experts) as the dense GEMVs of gemv.cu do; other types take a
// warp per weight row.
//
// Experts are addressed through a table of device pointers per layer,
// `table[3 e + {0, 1, 2}]` = gate, up, down of expert e. gate and up share a
// storage type and row stride, down has its own (GGUF files often keep it
// wider). bf16 rows of a multiple of 8 weights take 16-byte loads; every
// other type, and bf16 of other widths, goes through `load_elem`
// (common.cu), which is correct for all and fast for none.
//
// Every pair's result depends only on its own row and its expert's weights,
// computed in a fixed order, so the order `moe_sort` gives pairs within an
// expert (atomics) does not change any value.

// The bf16 routed GEMVs (see their section below).
#define MOE_GU_WARPS 4 // warps per gate/up block (MOE_GU_WARPS in moe.rs)
#define MOE_GU_COLS 4  // outputs per gate/up block (MOE_GU_COLS in moe.rs)
#define MOE_GU_U 1     // passes of 128 chunks of K a gate/up thread loads at once
#define MOE_DN_ROWS 4  // down rows per warp (MOE_DN_ROWS in moe.rs)
#define MOE_DN_U 3     // passes of 32 chunks of K a down lane loads at once: all of ffn 768
#define MOE_DN_WARPS 8 // warps per down block (MOE_DN_WARPS in moe.rs)
// The routed GEMVs of any storage type.
#define MOE_GEMV_WARPS 8 // warps per block (MOE_GEMV_WARPS in moe.rs)
#define MOE_GEMV_PAIRS 4 // pairs one warp carries through a weight row at a time
#define MOE_MAX_EXPERTS 1024
#define MOE_BM 64 // pairs per grouped-GEMM tile (MOE_TILE_ROWS in moe.rs)
#define MOE_BN 64 // outputs per grouped-GEMM tile
#define MOE_BK 32
#define MOE_LDS (MOE_BK + 8) // shared row stride in bf16: 80 bytes, conflict-free fragment loads

typedef unsigned long long u64;

__device__ __forceinline__ float moe_silu(float v) { return v / (1.0f + expf(-v)); }

// The ordering of Rust's f32::total_cmp as a signed integer key.
__device__ __forceinline__ int moe_total_key(float v) {
    int b = __float_as_int(v);
    return b ^ (int)(((unsigned)(b >> 31)) >> 1);
}

// The value whose key is `key` (the map flips no sign bit, so it is its own inverse).
__device__ __forceinline__ float moe_key_value(int key) {
    return __int_as_float(key ^ (int)(((unsigned)(key >> 31)) >> 1));
}

// Whether (ka, ea) ranks before (kb, eb): higher key first, then lower index.
__device__ __forceinline__ bool moe_before(int ka, int ea, int kb, int eb) {
    return ka > kb || (ka == kb && ea < eb);
}

// Route row r of the router logits with one warp: writes ids[r k + s] and
// w[r k + s] for the row's s-th ranked expert. Each lane holds its experts'
// logits (lane + 32 i) in registers, loaded at once, so the k rounds of the
// selection compare registers and shuffle instead of re-reading the row
// (the routing launch of a one-row step, 128 experts top 8, measured 8.2 µs
// by Nsight Compute on the H200 against 8.9 µs re-reading the row: the k
// dependent rounds of shuffles, not the loads, are most of it).
#define MOE_ROUTE_REGS 8 // logits per lane in registers: up to 256 experts; more take the loop below
__device__ __forceinline__ void moe_route_row(const float* __restrict__ logits, int r, int E, int k, int norm,
                                              int* __restrict__ ids, float* __restrict__ wts) {
    int lane = threadIdx.x & 31;
    const float* l = logits + (long long)r * E;
    bool regs = E <= 32 * MOE_ROUTE_REGS;
    float v[MOE_ROUTE_REGS];
    int key[MOE_ROUTE_REGS];
    float m = NEG_INF, s = 0.f;
    if (regs) {
#pragma unroll
        for (int i = 0; i < MOE_ROUTE_REGS; i++) {
            int e = lane + 32 * i;
            v[i] = e < E ? l[e] : NEG_INF;
            key[i] = moe_total_key(v[i]);
            m = fmaxf(m, v[i]);
        }
        m = warp_max(m);
#pragma unroll
        for (int i = 0; i < MOE_ROUTE_REGS; i++)
            if (lane + 32 * i < E) s += expf(v[i] - m);
    } else {
        for (int e = lane; e < E; e += 32) m = fmaxf(m, l[e]);
        m = warp_max(m);
        for (int e = lane; e < E; e += 32) s += expf(l[e] - m);
    }
    s = warp_sum(s);
    u32 used = 0; // bit i: this lane's expert lane + 32 i is taken
    float kept = 0.f, mine_p = 0.f;
    int mine_e = 0;
    for (int t = 0; t < k; t++) {
        int bk = 0, be = E; // be == E: nothing yet
        if (regs) {
#pragma unroll
            for (int i = 0; i < MOE_ROUTE_REGS; i++) {
                int e = lane + 32 * i;
                if (e < E && !((used >> i) & 1u) && (be == E || moe_before(key[i], e, bk, be))) {
                    bk = key[i];
                    be = e;
                }
            }
        } else {
            for (int i = 0, e = lane; e < E; i++, e += 32) {
                if ((used >> i) & 1u) continue;
                int ke = moe_total_key(l[e]);
                if (be == E || moe_before(ke, e, bk, be)) {
                    bk = ke;
                    be = e;
                }
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            int ok = __shfl_xor_sync(0xffffffffu, bk, o);
            int oe = __shfl_xor_sync(0xffffffffu, be, o);
            if (oe < E && (be == E || moe_before(ok, oe, bk, be))) {
                bk = ok;
                be = oe;
            }
        }
        if ((be & 31) == lane) used |= 1u << (be >> 5);
        // The winner's logit is its key's (no lane reads it again: that load
        // was a dependent round trip a round). Lane t keeps round t's pick;
        // rounds past 32 are stored as they come.
        float p = expf(moe_key_value(bk) - m) / s;
        kept += p;
        if (t < 32) {
            if (lane == t) mine_e = be, mine_p = p;
        } else if (lane == 0) {
            ids[r * k + t] = be;
            wts[r * k + t] = p;
        }
    }
    if (lane < imin(k, 32)) {
        ids[r * k + lane] = mine_e;
        wts[r * k + lane] = norm ? mine_p / kept : mine_p;
    }
    if (lane == 0 && norm)
        for (int t = 32; t < k; t++) wts[r * k + t] /= kept;
}

// Grid: rows / 4 blocks of 128 threads, a warp per row.
extern "C" __global__ void __launch_bounds__(128) moe_route(const float* __restrict__ logits, int rows, int E,
                                                            int k, int norm, int* __restrict__ ids,
                                                            float* __restrict__ wts) {
    pdl_enter();
    int r = blockIdx.x * 4 + (threadIdx.x >> 5);
    if (r < rows) moe_route_row(logits, r, E, k, norm, ids, wts);
}

// The exclusive prefix sum of `v` over a block of 1024 threads (`sh`: 32
// ints of shared scratch); `total` gets the sum. Every thread must call it.
__device__ __forceinline__ int moe_block_scan(int v, int* sh, int& total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads(); // `sh` may still be read by a previous scan
    if (lane == 31) sh[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = sh[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        sh[lane] = w; // inclusive over warps
    }
    __syncthreads();
    total = sh[31];
    return x - v + (warp > 0 ? sh[warp - 1] : 0);
}

// Group the P pairs by expert with a block of 1024 threads (a thread per
// expert for the offsets). Writes pos_of_pair / pair_of_pos, the experts in
// use as (e, first, end) triples (`active`, `n_active` of them) and the
// grouped GEMM's tiles as (e, first, end) triples of at most MOE_BM pairs
// (`tiles`, `n_tiles`), both in expert order.
__device__ __forceinline__ void moe_sort_body(const int* __restrict__ ids, int P, int E,
                                              int* __restrict__ pos_of_pair, int* __restrict__ pair_of_pos,
                                              int* __restrict__ n_active, int* __restrict__ active,
                                              int* __restrict__ n_tiles, int* __restrict__ tiles) {
    __shared__ int cnt[MOE_MAX_EXPERTS];
    __shared__ int cur[MOE_MAX_EXPERTS];
    __shared__ int scan[32];
    int tid = threadIdx.x;
    for (int e = tid; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int p = tid; p < P; p += blockDim.x) atomicAdd(&cnt[ids[p]], 1);
    __syncthreads();
    int c = tid < E ? cnt[tid] : 0;
    int nt = (c + MOE_BM - 1) / MOE_BM, used = c > 0;
    int n_pairs, n_t, n_a;
    int off = moe_block_scan(c, scan, n_pairs);
    int toff = moe_block_scan(nt, scan, n_t);
    int aoff = moe_block_scan(used, scan, n_a);
    if (tid < E) {
        cur[tid] = off;
        if (used) {
            active[3 * aoff] = tid;
            active[3 * aoff + 1] = off;
            active[3 * aoff + 2] = off + c;
        }
        for (int s = 0; s < nt; s++) {
            tiles[3 * (toff + s)] = tid;
            tiles[3 * (toff + s) + 1] = off + s * MOE_BM;
            tiles[3 * (toff + s) + 2] = off + imin((s + 1) * MOE_BM, c);
        }
    }
    if (tid == 0) {
        *n_active = n_a;
        *n_tiles = n_t;
    }
    __syncthreads();
    for (int p = tid; p < P; p += blockDim.x) {
        int pos = atomicAdd(&cur[ids[p]], 1);
        pos_of_pair[p] = pos;
        pair_of_pos[pos] = p;
    }
}

// Grid: one block of 1024 threads.
extern "C" __global__ void __launch_bounds__(1024) moe_sort(const int* __restrict__ ids, int P, int E,
                                                             int* __restrict__ pos_of_pair,
                                                             int* __restrict__ pair_of_pos,
                                                             int* __restrict__ n_active, int* __restrict__ active,
                                                             int* __restrict__ n_tiles, int* __restrict__ tiles) {
    pdl_enter();
    moe_sort_body(ids, P, E, pos_of_pair, pair_of_pos, n_active, active, n_tiles, tiles);
}

// Routing and grouping in one launch, for decode's few rows: the block's 32
// warps route the rows, then it groups the pairs. Grid: one block of 1024.
extern "C" __global__ void __launch_bounds__(1024)
    moe_route_sort(const float* __restrict__ logits, int rows, int E, int k, int norm, int* __restrict__ ids,
                   float* __restrict__ wts, int* __restrict__ pos_of_pair, int* __restrict__ pair_of_pos,
                   int* __restrict__ n_active, int* __restrict__ active, int* __restrict__ n_tiles,
                   int* __restrict__ tiles) {
    pdl_enter();
    if (rows == 1) {
        // One row's k experts are distinct: pair s is expert ids[s] alone,
        // at position s, so the first warp groups them without the sort.
        if (threadIdx.x >= 32) return;
        moe_route_row(logits, 0, E, k, norm, ids, wts);
        __syncwarp();
        for (int s = threadIdx.x; s < k; s += 32) {
            pos_of_pair[s] = s;
            pair_of_pos[s] = s;
            active[3 * s] = tiles[3 * s] = ids[s];
            active[3 * s + 1] = tiles[3 * s + 1] = s;
            active[3 * s + 2] = tiles[3 * s + 2] = s + 1;
        }
        if (threadIdx.x == 0) *n_active = *n_tiles = k;
        return;
    }
    for (int r = threadIdx.x >> 5; r < rows; r += 32) moe_route_row(logits, r, E, k, norm, ids, wts);
    __syncthreads();
    moe_sort_body(ids, rows * k, E, pos_of_pair, pair_of_pos, n_active, active, n_tiles, tiles);
}

// ---- Routed GEMVs of bf16 experts (decode) ----
//
// A decode step reads each chosen expert's weights once, so these kernels
// are limited by the bytes each SM keeps in flight: at 4.3 TB/s and about
// 1 us of memory latency an H200 SM (of 132) needs ~32 KB outstanding. A warp
// per weight row with a few loads per lane keeps far less (the any-type
// kernels below: ~2 KB per SM at Qwen3-30B-A3B's 1 row). So, as the dense
// GEMVs of gemv.cu: every thread issues all of a pass's 16-byte weight loads
// (`ld_stream`, gemv.cu: L1 no-allocate, so the activations keep L1) before
// any arithmetic, uses each activation value it reads for every weight row
// it holds, and accumulates in f32; partial sums meet over the warp and then
// in shared memory, in a fixed order. Weight rows are addressed as 32-bit
// offsets in 16-byte units from their matrix (rows of a multiple of 16
// bytes): a 64-bit pointer per row would not fit the register budgets below.
// No weight load is issued before `pdl_enter`: which expert a block reads is
// written by the routing kernel ahead.
//
// gate/up/SiLU (moe_gemv_gate_up_bf16_p{1,4}): a block of MOE_GU_WARPS warps
// owns MOE_GU_COLS outputs j of one expert in use, i.e. 2 x MOE_GU_COLS
// weight rows (gate and up), and splits K = hidden between all its threads,
// interleaved so that each load instruction of the block reads one
// contiguous 2 KB span. A thread holds MOE_GU_U x 8 loads (128 B) in flight
// and uses each x value for all 8 rows: the layout of the dense GLU of
// gemv.cu (where, for the plain GEMV, 8 loads per thread at 8 blocks per SM
// measured faster than 16 at 5). _p1 fits 64 registers, so 8 blocks (32
// warps) per SM: 128 KB in flight per SM. Qwen3-30B-A3B at 1 row: 192 blocks
// per expert, 1536 in all.
//
// down (moe_gemv_down_combine_bf16 for few rows, moe_gemv_down_bf16_p{1,4}
// per expert): a warp holds MOE_DN_ROWS down rows and splits K = ffn between
// its lanes, each lane MOE_DN_U x MOE_DN_ROWS loads (192 B) in flight, each
// act value used for all its rows. Down rows are short (ffn 768: 96 chunks,
// 3 per lane), so the K split stops at the warp; the fused form instead gives
// a block's warps the k experts of one token row for the same MOE_DN_ROWS
// outputs, so all of a row's experts are read at once and their products
// meet in shared memory, weighted and summed in slot order. 80 registers, 3
// blocks (24 warps) per SM: 144 KB in flight per SM. Qwen3-30B-A3B at 1 row:
// 512 blocks, each of its warps 6 KB of loads at once.
//
// _p1 takes an expert's pairs one at a time, re-reading its weights (from
// L2) for a second pair: a decode step's experts mostly have one. _p4 takes
// four at a time, sharing each weight load between them, at the cost of the
// registers of four accumulator sets (half the blocks per SM).

// The dot product of 8 bf16 weights (one 16-byte chunk) with 8 f32 values.
__device__ __forceinline__ float moe_dot8_bf16(uint4 w, float4 a, float4 b) {
    float s = __uint_as_float(w.x << 16) * a.x;
    s += __uint_as_float(w.x & 0xffff0000u) * a.y;
    s += __uint_as_float(w.y << 16) * a.z;
    s += __uint_as_float(w.y & 0xffff0000u) * a.w;
    s += __uint_as_float(w.z << 16) * b.x;
    s += __uint_as_float(w.z & 0xffff0000u) * b.y;
    s += __uint_as_float(w.w << 16) * b.z;
    s += __uint_as_float(w.w & 0xffff0000u) * b.w;
    return s;
}

// NP pairs of one expert at a time through the block's gate and up rows:
// act[pos][j] = silu(gate_e[j] · x[row]) * (up_e[j] · x[row]). With NP > 1
// the pairs share every weight load; pairs past the expert's last are skipped.
template <int NP>
__device__ __forceinline__ void moe_gate_up_bf16(const u64* __restrict__ table, long long rb,
                                                 const float* __restrict__ x, int hidden, int ef, int k,
                                                 const int* __restrict__ pair_of_pos,
                                                 const int* __restrict__ n_active, const int* __restrict__ active,
                                                 float* __restrict__ act) {
    const int NR = 2 * MOE_GU_COLS; // gate rows j0.., then up rows j0..
    const int step = MOE_GU_WARPS * 32;
    __shared__ float red[MOE_GU_WARPS][NP * NR];
    pdl_enter();
    int y = blockIdx.y;
    if (y >= *n_active) return;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int e = active[3 * y], p = active[3 * y + 1], end = active[3 * y + 2];
    int j0 = blockIdx.x * MOE_GU_COLS;
    const uint4* gate = (const uint4*)table[3 * e];
    const uint4* up = (const uint4*)table[3 * e + 1];
    unsigned off[MOE_GU_COLS];
#pragma unroll
    for (int i = 0; i < MOE_GU_COLS; i++) off[i] = (unsigned)(imin(j0 + i, ef - 1) * (rb >> 4));
    int chunks = hidden >> 3;
    for (; p < end; p += NP) {
        int np = imin(NP, end - p);
        const float4* xr[NP];
#pragma unroll
        for (int q = 0; q < NP; q++) xr[q] = (const float4*)(x + (long long)(pair_of_pos[p + imin(q, np - 1)] / k) * hidden);
        float acc[NP][NR];
#pragma unroll
        for (int q = 0; q < NP; q++)
#pragma unroll
            for (int i = 0; i < NR; i++) acc[q][i] = 0.f;
        for (int base = wid * 32 + lane; base < chunks; base += step * MOE_GU_U) {
            uint4 v[MOE_GU_U][NR];
#pragma unroll
            for (int u = 0; u < MOE_GU_U; u++) {
                int c = base + u * step;
#pragma unroll
                for (int i = 0; i < NR; i++) {
                    const uint4* row = (i < MOE_GU_COLS ? gate : up) + off[i % MOE_GU_COLS] + c;
                    if (c < chunks) v[u][i] = ld_stream(row);
                    else v[u][i].x = v[u][i].y = v[u][i].z = v[u][i].w = 0u;
                }
            }
#pragma unroll
            for (int u = 0; u < MOE_GU_U; u++) {
                int c = base + u * step;
                if (c < chunks) {
#pragma unroll
                    for (int q = 0; q < NP; q++) {
                        if (q < np) {
                            float4 a = __ldg(xr[q] + 2 * c), b = __ldg(xr[q] + 2 * c + 1);
#pragma unroll
                            for (int i = 0; i < NR; i++) acc[q][i] += moe_dot8_bf16(v[u][i], a, b);
                        }
                    }
                }
            }
        }
        warp_sums_store<NP, NR>(acc, red[wid], np);
        __syncthreads();
        int t = threadIdx.x;
        if (t < np * MOE_GU_COLS) {
            int q = t / MOE_GU_COLS, i = t % MOE_GU_COLS, j = j0 + i;
            if (j < ef) {
                float g = 0.f, u = 0.f;
#pragma unroll
                for (int w = 0; w < MOE_GU_WARPS; w++) {
                    g += red[w][q * NR + i];
                    u += red[w][q * NR + MOE_GU_COLS + i];
                }
                act[(long long)(p + q) * ef + j] = moe_silu(g) * u;
            }
        }
        __syncthreads(); // `red` is read before the next pairs overwrite it
    }
}

// Grid: (ceil(ef / MOE_GU_COLS), min(E, P)) blocks of MOE_GU_WARPS warps;
// block y serves the y-th expert in use. hidden a multiple of 8, rows
// 16-byte aligned. _p1 takes an expert's pairs one at a time (decode's
// experts mostly have one), _p4 four at a time.
extern "C" __global__ void __launch_bounds__(MOE_GU_WARPS * 32, 8)
    moe_gemv_gate_up_bf16_p1(const u64* __restrict__ table, long long rb, const float* __restrict__ x, int hidden,
                             int ef, int k, const int* __restrict__ pair_of_pos, const int* __restrict__ n_active,
                             const int* __restrict__ active, float* __restrict__ act) {
    moe_gate_up_bf16<1>(table, rb, x, hidden, ef, k, pair_of_pos, n_active, active, act);
}
extern "C" __global__ void __launch_bounds__(MOE_GU_WARPS * 32, 4)
    moe_gemv_gate_up_bf16_p4(const u64* __restrict__ table, long long rb, const float* __restrict__ x, int hidden,
                             int ef, int k, const int* __restrict__ pair_of_pos, const int* __restrict__ n_active,
                             const int* __restrict__ active, float* __restrict__ act) {
    moe_gate_up_bf16<4>(table, rb, x, hidden, ef, k, pair_of_pos, n_active, active, act);
}

// d[q][i] = (bf16 row w[i]) · (f32 row a[q]) for q < np, over a row of
// `chunks` 16-byte chunks of which this lane takes first, first + stride,
// ...; summed over the warp (every lane gets the sums).
template <int NP>
__device__ __forceinline__ void moe_down_dots_bf16(const uint4* w, const unsigned (&off)[MOE_DN_ROWS],
                                                   const float4* const (&a)[NP], int np, int chunks, int first,
                                                   int stride, float (&d)[NP][MOE_DN_ROWS]) {
#pragma unroll
    for (int q = 0; q < NP; q++)
#pragma unroll
        for (int i = 0; i < MOE_DN_ROWS; i++) d[q][i] = 0.f;
    for (int base = first; base < chunks; base += stride * MOE_DN_U) {
        uint4 v[MOE_DN_U][MOE_DN_ROWS];
#pragma unroll
        for (int u = 0; u < MOE_DN_U; u++) {
            int c = base + u * stride;
#pragma unroll
            for (int i = 0; i < MOE_DN_ROWS; i++) {
                if (c < chunks) v[u][i] = ld_stream(w + off[i] + c);
                else v[u][i].x = v[u][i].y = v[u][i].z = v[u][i].w = 0u;
            }
        }
#pragma unroll
        for (int u = 0; u < MOE_DN_U; u++) {
            int c = base + u * stride;
            if (c < chunks) {
#pragma unroll
                for (int q = 0; q < NP; q++) {
                    if (q < np) {
                        float4 x0 = __ldg(a[q] + 2 * c), x1 = __ldg(a[q] + 2 * c + 1);
#pragma unroll
                        for (int i = 0; i < MOE_DN_ROWS; i++) d[q][i] += moe_dot8_bf16(v[u][i], x0, x1);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int q = 0; q < NP; q++)
        if (q < np)
#pragma unroll
            for (int i = 0; i < MOE_DN_ROWS; i++) d[q][i] = warp_sum(d[q][i]);
}

// Down and the weighted sum in one launch, for few token rows:
// out[r][i] = sum over slots s = 0..k-1, in order, of
// w[r k + s] * (down_{e_s}[i] · act[pos of (r, s)]).
// Block (x, r) computes outputs x*MOE_DN_ROWS.. of row r. Its warps take the
// row's slots ks = min(k, MOE_DN_WARPS) at a time: warp w slot w % ks of the
// round and part w / ks of the K range (with fewer slots than warps, a slot's
// K is split between MOE_DN_WARPS / ks warps; warps past those idle). Every
// sum has a fixed order, so the result does not depend on scheduling.
// Grid: (ceil(hidden / MOE_DN_ROWS), rows) blocks of MOE_DN_WARPS warps;
// ffn a multiple of 8, rows 16-byte aligned.
extern "C" __global__ void __launch_bounds__(MOE_DN_WARPS * 32, 3)
    moe_gemv_down_combine_bf16(const u64* __restrict__ table, long long rb, const float* __restrict__ act, int ef,
                               int hidden, int k, const int* __restrict__ ids, const float* __restrict__ wts,
                               const int* __restrict__ pos_of_pair, float* __restrict__ out) {
    __shared__ float red[MOE_DN_WARPS][MOE_DN_ROWS];
    pdl_enter();
    int r = blockIdx.y, lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int i0 = blockIdx.x * MOE_DN_ROWS;
    int ks = imin(k, MOE_DN_WARPS), parts = MOE_DN_WARPS / ks;
    int slot = wid % ks, part = wid / ks;
    int chunks = ef >> 3;
    float acc = 0.f; // thread t < MOE_DN_ROWS: output i0 + t
    for (int s0 = 0; s0 < k; s0 += ks) {
        int s = s0 + slot;
        float d[1][MOE_DN_ROWS];
#pragma unroll
        for (int i = 0; i < MOE_DN_ROWS; i++) d[0][i] = 0.f;
        if (part < parts && s < k) {
            int pr = r * k + s;
            const uint4* down = (const uint4*)table[3 * ids[pr] + 2];
            unsigned off[MOE_DN_ROWS];
#pragma unroll
            for (int i = 0; i < MOE_DN_ROWS; i++) off[i] = (unsigned)(imin(i0 + i, hidden - 1) * (rb >> 4));
            const float4* a[1] = {(const float4*)(act + (long long)pos_of_pair[pr] * ef)};
            moe_down_dots_bf16<1>(down, off, a, 1, chunks, part * 32 + lane, parts * 32, d);
        }
        if (lane == 0)
#pragma unroll
            for (int i = 0; i < MOE_DN_ROWS; i++) red[wid][i] = d[0][i];
        __syncthreads();
        if (threadIdx.x < MOE_DN_ROWS) {
            int t = threadIdx.x;
            for (int q = 0; q < ks && s0 + q < k; q++) {
                float v = 0.f;
                for (int pt = 0; pt < parts; pt++) v += red[pt * ks + q][t];
                acc += wts[r * k + s0 + q] * v;
            }
        }
        __syncthreads(); // `red` is read before the next round overwrites it
    }
    int t = threadIdx.x;
    if (t < MOE_DN_ROWS && i0 + t < hidden) out[(long long)r * hidden + i0 + t] = acc;
}

// Down per expert in use: ys[pos][i] = down_e[i] · act[pos] for every pair
// of the y-th expert, NP pairs at a time (sharing the weight loads). Warp w
// of block x holds rows (x MOE_DN_WARPS + w) MOE_DN_ROWS..
template <int NP>
__device__ __forceinline__ void moe_down_bf16(const u64* __restrict__ table, long long rb,
                                              const float* __restrict__ act, int ef, int hidden,
                                              const int* __restrict__ n_active, const int* __restrict__ active,
                                              float* __restrict__ ys) {
    pdl_enter();
    int y = blockIdx.y;
    if (y >= *n_active) return;
    int lane = threadIdx.x & 31;
    int i0 = (blockIdx.x * MOE_DN_WARPS + (threadIdx.x >> 5)) * MOE_DN_ROWS;
    if (i0 >= hidden) return;
    int e = active[3 * y], p = active[3 * y + 1], end = active[3 * y + 2];
    const uint4* down = (const uint4*)table[3 * e + 2];
    unsigned off[MOE_DN_ROWS];
#pragma unroll
    for (int i = 0; i < MOE_DN_ROWS; i++) off[i] = (unsigned)(imin(i0 + i, hidden - 1) * (rb >> 4));
    int chunks = ef >> 3;
    for (; p < end; p += NP) {
        int np = imin(NP, end - p);
        const float4* a[NP];
#pragma unroll
        for (int q = 0; q < NP; q++) a[q] = (const float4*)(act + (long long)(p + imin(q, np - 1)) * ef);
        float d[NP][MOE_DN_ROWS];
        moe_down_dots_bf16<NP>(down, off, a, np, chunks, lane, 32, d);
        if (lane == 0)
#pragma unroll
            for (int q = 0; q < NP; q++)
                if (q < np)
#pragma unroll
                    for (int i = 0; i < MOE_DN_ROWS; i++)
                        if (i0 + i < hidden) ys[(long long)(p + q) * hidden + i0 + i] = d[q][i];
    }
}

// Grid: (ceil(hidden / (MOE_DN_WARPS MOE_DN_ROWS)), min(E, P)) blocks of
// MOE_DN_WARPS warps; ffn a multiple of 8, rows 16-byte aligned.
extern "C" __global__ void __launch_bounds__(MOE_DN_WARPS * 32, 3)
    moe_gemv_down_bf16_p1(const u64* __restrict__ table, long long rb, const float* __restrict__ act, int ef,
                          int hidden, const int* __restrict__ n_active, const int* __restrict__ active,
                          float* __restrict__ ys) {
    moe_down_bf16<1>(table, rb, act, ef, hidden, n_active, active, ys);
}
extern "C" __global__ void __launch_bounds__(MOE_DN_WARPS * 32, 2)
    moe_gemv_down_bf16_p4(const u64* __restrict__ table, long long rb, const float* __restrict__ act, int ef,
                          int hidden, const int* __restrict__ n_active, const int* __restrict__ active,
                          float* __restrict__ ys) {
    moe_down_bf16<4>(table, rb, act, ef, hidden, n_active, active, ys);
}

// ---- Routed GEMVs of any storage type (decode) ----
//
// The experts the bf16 kernels above do not take (the block formats, bf16
// rows whose width is not a multiple of 8): a warp per weight row, every pair
// of the expert against that row (MOE_GEMV_PAIRS at a time), so each chosen
// expert's weights are read once; weights through `load_elem`.

__device__ __forceinline__ void moe_unpack8(uint4 v, float (&f)[8]) {
    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ float moe_dot8(const float (&w)[8], const float* x) {
    float4 a = *(const float4*)x, b = *(const float4*)(x + 4);
    return w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y + w[6] * b.z + w[7] * b.w;
}

// NP pairs of one expert through gate row g and up row u (a warp):
// act[pos][j] = silu(g · x[row]) * (u · x[row]) for pos = p0..p0+NP.
template <int NP>
__device__ __forceinline__ void moe_gate_up_rows(const u8* g, const u8* u, int dt, const float* __restrict__ x,
                                                 int hidden, int ef, int k, int j, int p0,
                                                 const int* __restrict__ pair_of_pos, float* __restrict__ act) {
    int lane = threadIdx.x & 31;
    const float* xr[NP];
#pragma unroll
    for (int q = 0; q < NP; q++) xr[q] = x + (long long)(pair_of_pos[p0 + q] / k) * hidden;
    float ag[NP], au[NP];
#pragma unroll
    for (int q = 0; q < NP; q++) ag[q] = au[q] = 0.f;
    if (dt == DT_BF16 && (hidden & 7) == 0) {
        // Unrolled so that several 16-byte loads per lane are in flight.
#pragma unroll 4
        for (int c = lane * 8; c < hidden; c += 256) {
            float gw[8], uw[8];
            moe_unpack8(*(const uint4*)(g + 2 * c), gw);
            moe_unpack8(*(const uint4*)(u + 2 * c), uw);
#pragma unroll
            for (int q = 0; q < NP; q++) {
                ag[q] += moe_dot8(gw, xr[q] + c);
                au[q] += moe_dot8(uw, xr[q] + c);
            }
        }
    } else {
        for (int c = lane; c < hidden; c += 32) {
            float gw = load_elem(g, dt, c), uw = load_elem(u, dt, c);
#pragma unroll
            for (int q = 0; q < NP; q++) {
                ag[q] += gw * xr[q][c];
                au[q] += uw * xr[q][c];
            }
        }
    }
#pragma unroll
    for (int q = 0; q < NP; q++) {
        float gs = warp_sum(ag[q]), us = warp_sum(au[q]);
        if (lane == 0) act[(long long)(p0 + q) * ef + j] = moe_silu(gs) * us;
    }
}

// Routed GEMV, gate/up/SiLU: block (x, y) serves weight rows
// x*MOE_GEMV_WARPS.. (a warp each) of the y-th expert in use, for every pair
// routed to it, MOE_GEMV_PAIRS at a time. act is f32 [pairs, ef].
// Grid: (ceil(ef / MOE_GEMV_WARPS), min(E, P)).
extern "C" __global__ void __launch_bounds__(MOE_GEMV_WARPS * 32)
    moe_gemv_gate_up(const u64* __restrict__ table, int dt, long long rb, const float* __restrict__ x, int hidden,
                     int ef, int k, const int* __restrict__ pair_of_pos, const int* __restrict__ n_active,
                     const int* __restrict__ active, float* __restrict__ act) {
    pdl_enter();
    int y = blockIdx.y;
    if (y >= *n_active) return;
    int j = blockIdx.x * MOE_GEMV_WARPS + (threadIdx.x >> 5);
    if (j >= ef) return;
    int e = active[3 * y], p = active[3 * y + 1], end = active[3 * y + 2];
    const u8* g = (const u8*)table[3 * e] + (long long)j * rb;
    const u8* u = (const u8*)table[3 * e + 1] + (long long)j * rb;
    for (; p + MOE_GEMV_PAIRS <= end; p += MOE_GEMV_PAIRS)
        moe_gate_up_rows<MOE_GEMV_PAIRS>(g, u, dt, x, hidden, ef, k, j, p, pair_of_pos, act);
    switch (end - p) {
    case 1: moe_gate_up_rows<1>(g, u, dt, x, hidden, ef, k, j, p, pair_of_pos, act); break;
    case 2: moe_gate_up_rows<2>(g, u, dt, x, hidden, ef, k, j, p, pair_of_pos, act); break;
    case 3: moe_gate_up_rows<3>(g, u, dt, x, hidden, ef, k, j, p, pair_of_pos, act); break;
    default: break;
    }
}

// The dot products of down row w (a warp) with NP act rows, reduced over the warp.
template <int NP>
__device__ __forceinline__ void moe_down_dots(const u8* w, int dt, const float* const (&ar)[NP], int ef,
                                              float (&out)[NP]) {
    int lane = threadIdx.x & 31;
    float acc[NP];
#pragma unroll
    for (int q = 0; q < NP; q++) acc[q] = 0.f;
    if (dt == DT_BF16 && (ef & 7) == 0) {
#pragma unroll 4
        for (int c = lane * 8; c < ef; c += 256) {
            float wv[8];
            moe_unpack8(*(const uint4*)(w + 2 * c), wv);
#pragma unroll
            for (int q = 0; q < NP; q++) acc[q] += moe_dot8(wv, ar[q] + c);
        }
    } else {
        for (int c = lane; c < ef; c += 32) {
            float wv = load_elem(w, dt, c);
#pragma unroll
            for (int q = 0; q < NP; q++) acc[q] += wv * ar[q][c];
        }
    }
#pragma unroll
    for (int q = 0; q < NP; q++) out[q] = warp_sum(acc[q]);
}

template <int NP>
__device__ __forceinline__ void moe_down_rows(const u8* w, int dt, const float* __restrict__ act, int ef, int hidden,
                                              int i, int p0, float* __restrict__ ys) {
    const float* ar[NP];
#pragma unroll
    for (int q = 0; q < NP; q++) ar[q] = act + (long long)(p0 + q) * ef;
    float d[NP];
    moe_down_dots<NP>(w, dt, ar, ef, d);
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int q = 0; q < NP; q++) ys[(long long)(p0 + q) * hidden + i] = d[q];
}

// Routed GEMV, down: ys[pos][i] = down_e[i] · act[pos] for every pair of the
// y-th expert in use. Grid: (ceil(hidden / MOE_GEMV_WARPS), min(E, P)).
extern "C" __global__ void __launch_bounds__(MOE_GEMV_WARPS * 32)
    moe_gemv_down(const u64* __restrict__ table, int dt, long long rb, const float* __restrict__ act, int ef,
                  int hidden, const int* __restrict__ n_active, const int* __restrict__ active,
                  float* __restrict__ ys) {
    pdl_enter();
    int y = blockIdx.y;
    if (y >= *n_active) return;
    int i = blockIdx.x * MOE_GEMV_WARPS + (threadIdx.x >> 5);
    if (i >= hidden) return;
    int e = active[3 * y], p = active[3 * y + 1], end = active[3 * y + 2];
    const u8* w = (const u8*)table[3 * e + 2] + (long long)i * rb;
    for (; p + MOE_GEMV_PAIRS <= end; p += MOE_GEMV_PAIRS)
        moe_down_rows<MOE_GEMV_PAIRS>(w, dt, act, ef, hidden, i, p, ys);
    switch (end - p) {
    case 1: moe_down_rows<1>(w, dt, act, ef, hidden, i, p, ys); break;
    case 2: moe_down_rows<2>(w, dt, act, ef, hidden, i, p, ys); break;
    case 3: moe_down_rows<3>(w, dt, act, ef, hidden, i, p, ys); break;
    default: break;
    }
}

// Down and the weighted sum in one launch, for a step of few rows: the warp
// of (row r, output i) reads down row i of each of the row's k experts.
// out[r][i] = sum over slots s of w[r k + s] * (down_{e_s}[i] · act[pos of (r, s)]),
// in slot order and with the same dot products as moe_gemv_down, so the
// sums are those of moe_gemv_down + moe_combine, in the same order.
// Grid: (ceil(hidden / MOE_GEMV_WARPS), rows).
extern "C" __global__ void __launch_bounds__(MOE_GEMV_WARPS * 32)
    moe_gemv_down_combine(const u64* __restrict__ table, int dt, long long rb, const float* __restrict__ act,
                          int ef, int hidden, int k, const int* __restrict__ ids, const float* __restrict__ wts,
                          const int* __restrict__ pos_of_pair, float* __restrict__ out) {
    pdl_enter();
    int r = blockIdx.y, lane = threadIdx.x & 31;
    int i = blockIdx.x * MOE_GEMV_WARPS + (threadIdx.x >> 5);
    if (i >= hidden) return;
    bool vec = dt == DT_BF16 && (ef & 7) == 0;
    float acc = 0.f;
    // Four slots at a time, their loads interleaved so that they are in
    // flight together (a slot past k repeats the last one, unused).
    for (int s0 = 0; s0 < k; s0 += 4) {
        int n = imin(4, k - s0);
        const u8* w[4];
        const float* ar[4];
        float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int q = 0; q < 4; q++) {
            int p = r * k + s0 + imin(q, n - 1);
            w[q] = (const u8*)table[3 * ids[p] + 2] + (long long)i * rb;
            ar[q] = act + (long long)pos_of_pair[p] * ef;
        }
        if (vec) {
#pragma unroll 2
            for (int c = lane * 8; c < ef; c += 256) {
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    float wv[8];
                    moe_unpack8(*(const uint4*)(w[q] + 2 * c), wv);
                    d[q] += moe_dot8(wv, ar[q] + c);
                }
            }
        } else {
            for (int c = lane; c < ef; c += 32)
#pragma unroll
                for (int q = 0; q < 4; q++) d[q] += load_elem(w[q], dt, c) * ar[q][c];
        }
#pragma unroll
        for (int q = 0; q < 4; q++) {
            float sum = warp_sum(d[q]);
            if (q < n) acc += wts[r * k + s0 + q] * sum;
        }
    }
    if (lane == 0) out[(long long)r * hidden + i] = acc;
}

// out[r][i] = sum over the row's slots s of w[r k + s] * ys[pos of (r, s)][i].
// Grid: rows blocks of 256 threads.
extern "C" __global__ void moe_combine(const float* __restrict__ ys, const float* __restrict__ wts,
                                       const int* __restrict__ pos_of_pair, int k, int hidden,
                                       float* __restrict__ out) {
    pdl_enter();
    int r = blockIdx.x;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < k; s++) {
            int p = r * k + s;
            acc += wts[p] * ys[(long long)pos_of_pair[p] * hidden + i];
        }
        out[(long long)r * hidden + i] = acc;
    }
}

__device__ __forceinline__ u32 moe_pack2(float a, float b) {
    return (u32)f32_to_bf16(a) | ((u32)f32_to_bf16(b) << 16);
}

// Eight weights of row `row` (K columns) from column k0 (a multiple of 8) as
// bf16, zeros past K. Block formats with a word-wise decoder (blocks.cu
// `deq8_bf16`: Q4_K, Q5_K, Q6_K, Q4_0, Q8_0, Q4_1, the types of llama.cpp's
// default mixes) decode the eight from their group's scales at once; the
// others, and bf16 rows of other widths, element by element (`load_elem`).
// A block format's K is whole blocks, so its eight never cross K; a Q4_K or
// Q5_K row that is not 16-byte aligned takes the element-wise decode.
__device__ __forceinline__ uint4 moe_load_b8(const u8* row, int dt, int K, int k0, bool vec) {
    if (vec && k0 + 8 <= K) return *(const uint4*)(row + 2 * k0);
    u32 p[4];
    // Q4_K and Q5_K read words of 4 and 8 bytes: rows 16-byte aligned, as the arena places them.
    bool done = k0 + 8 <= K && ((dt != DT_Q4_K && dt != DT_Q5_K) || ((unsigned long long)row & 15) == 0);
    switch (done ? dt : -1) {
    case DT_Q4_K: deq8_bf16<DT_Q4_K>(row, k0, p); break;
    case DT_Q5_K: deq8_bf16<DT_Q5_K>(row, k0, p); break;
    case DT_Q6_K: deq8_bf16<DT_Q6_K>(row, k0, p); break;
    case DT_Q4_0: deq8_bf16<DT_Q4_0>(row, k0, p); break;
    case DT_Q8_0: deq8_bf16<DT_Q8_0>(row, k0, p); break;
    case DT_Q4_1: deq8_bf16<DT_Q4_1>(row, k0, p); break;
    default: done = false;
    }
    if (done) return make_uint4(p[0], p[1], p[2], p[3]);
    float f[8];
#pragma unroll
    for (int i = 0; i < 8; i++) f[i] = k0 + i < K ? load_elem(row, dt, k0 + i) : 0.f;
    return make_uint4(moe_pack2(f[0], f[1]), moe_pack2(f[2], f[3]), moe_pack2(f[4], f[5]), moe_pack2(f[6], f[7]));
}

// The grouped GEMM: block (x, t) computes outputs x*MOE_BN.. of tile t (up
// to MOE_BM pairs of one expert). 4 warps in 2 x 2, each 32 pairs x 32
// outputs as 2 x 4 mma.m16n8k16 tiles, f32 accumulators.
// GLU: A = the pairs' input rows (f32 x, gathered by row, rounded to bf16),
//      B = gate and up; writes act[pos][n] = bf16(silu(gate) * up).
// !GLU: A = act rows (bf16, by position), B = down; writes ys[pos][n] (f32).
template <bool GLU>
__device__ __forceinline__ void moe_gemm_body(const u64* __restrict__ table, int dt, long long rb,
                                              const float* __restrict__ xf, const bf16_t* __restrict__ xb, int K,
                                              int N, int k_top, const int* __restrict__ pair_of_pos,
                                              const int* __restrict__ n_tiles, const int* __restrict__ tiles,
                                              bf16_t* __restrict__ act, float* __restrict__ ys) {
    __shared__ __align__(16) bf16_t As[MOE_BM * MOE_LDS];
    __shared__ __align__(16) bf16_t Bs[(GLU ? 2 : 1) * MOE_BN * MOE_LDS];
    pdl_enter();
    int t = blockIdx.y;
    if (t >= *n_tiles) return;
    int e = tiles[3 * t], p0 = tiles[3 * t + 1], p1 = tiles[3 * t + 2];
    int n0 = blockIdx.x * MOE_BN;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
    int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
    const u8* w0 = (const u8*)table[3 * e + (GLU ? 0 : 2)];
    const u8* w1 = (const u8*)table[3 * e + 1];
    bool vec_b = dt == DT_BF16 && (K & 7) == 0;
    float c0[2][4][4], c1[2][4][4];
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++)
#pragma unroll
            for (int v = 0; v < 4; v++) {
                c0[mi][ni][v] = 0.f;
                c1[mi][ni][v] = 0.f;
            }
    // The tile of step k0 + MOE_BK is loaded into registers while step k0
    // computes from shared memory, so the global loads overlap the mma work.
    // GLU A: 64 rows x 32 f32, four groups of 4 per thread; !GLU A: 64 rows
    // x 32 bf16, two groups of 8; B: 64 rows x 32 bf16, two groups of 8 per
    // matrix.
    uint2 a4[4];
    uint4 a8[2], b8[2][2];
    auto load = [&](int k0) {
        if (GLU) {
#pragma unroll
            for (int it = 0; it < 4; it++) {
                int idx = tid + it * 128, r = idx >> 3, c = (idx & 7) * 4, p = p0 + r;
                float v[4] = {0.f, 0.f, 0.f, 0.f};
                if (p < p1) {
                    const float* src = xf + (long long)(pair_of_pos[p] / k_top) * K + k0 + c;
                    if ((K & 3) == 0 && k0 + c + 4 <= K) {
                        float4 f = *(const float4*)src;
                        v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
                    } else {
#pragma unroll
                        for (int i = 0; i < 4; i++) v[i] = k0 + c + i < K ? src[i] : 0.f;
                    }
                }
                a4[it] = make_uint2(moe_pack2(v[0], v[1]), moe_pack2(v[2], v[3]));
            }
        } else {
#pragma unroll
            for (int it = 0; it < 2; it++) {
                int idx = tid + it * 128, r = idx >> 2, c = (idx & 3) * 8, p = p0 + r;
                uint4 v = make_uint4(0, 0, 0, 0);
                if (p < p1) {
                    const bf16_t* src = xb + (long long)p * K + k0 + c;
                    if ((K & 7) == 0 && k0 + c + 8 <= K) {
                        v = *(const uint4*)src;
                    } else {
                        u32 h[4];
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            u32 lo = k0 + c + 2 * i < K ? src[2 * i] : 0, hi = k0 + c + 2 * i + 1 < K ? src[2 * i + 1] : 0;
                            h[i] = lo | (hi << 16);
                        }
                        v = make_uint4(h[0], h[1], h[2], h[3]);
                    }
                }
                a8[it] = v;
            }
        }
#pragma unroll
        for (int m = 0; m < (GLU ? 2 : 1); m++) {
            const u8* w = m ? w1 : w0;
#pragma unroll
            for (int it = 0; it < 2; it++) {
                int idx = tid + it * 128, r = idx >> 2, c = (idx & 3) * 8, n = n0 + r;
                uint4 v = make_uint4(0, 0, 0, 0);
                if (n < N) v = moe_load_b8(w + (long long)n * rb, dt, K, k0 + c, vec_b);
                b8[m][it] = v;
            }
        }
    };
    load(0);
    for (int k0 = 0; k0 < K; k0 += MOE_BK) {
        __syncthreads(); // every warp is done with the previous tile
        if (GLU) {
#pragma unroll
            for (int it = 0; it < 4; it++) {
                int idx = tid + it * 128;
                *(uint2*)&As[(idx >> 3) * MOE_LDS + (idx & 7) * 4] = a4[it];
            }
        } else {
#pragma unroll
            for (int it = 0; it < 2; it++) {
                int idx = tid + it * 128;
                *(uint4*)&As[(idx >> 2) * MOE_LDS + (idx & 3) * 8] = a8[it];
            }
        }
#pragma unroll
        for (int m = 0; m < (GLU ? 2 : 1); m++)
#pragma unroll
            for (int it = 0; it < 2; it++) {
                int idx = tid + it * 128;
                *(uint4*)&Bs[m * MOE_BN * MOE_LDS + (idx >> 2) * MOE_LDS + (idx & 3) * 8] = b8[m][it];
            }
        __syncthreads();
        if (k0 + MOE_BK < K) load(k0 + MOE_BK);
#pragma unroll
        for (int kk = 0; kk < MOE_BK; kk += 16) {
            u32 a[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                const bf16_t* ap = As + (wm + mi * 16 + g) * MOE_LDS + kk + tq * 2;
                a[mi][0] = *(const u32*)ap;
                a[mi][1] = *(const u32*)(ap + 8 * MOE_LDS);
                a[mi][2] = *(const u32*)(ap + 8);
                a[mi][3] = *(const u32*)(ap + 8 * MOE_LDS + 8);
            }
#pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                const bf16_t* bp = Bs + (wn + ni * 8 + g) * MOE_LDS + kk + tq * 2;
                u32 b0 = *(const u32*)bp, b1 = *(const u32*)(bp + 8);
#pragma unroll
                for (int mi = 0; mi < 2; mi++) mma_bf16_16816(c0[mi][ni], a[mi], b0, b1);
                if (GLU) {
                    const bf16_t* bq = bp + MOE_BN * MOE_LDS;
                    u32 q0 = *(const u32*)bq, q1 = *(const u32*)(bq + 8);
#pragma unroll
                    for (int mi = 0; mi < 2; mi++) mma_bf16_16816(c1[mi][ni], a[mi], q0, q1);
                }
            }
        }
    }
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int p = p0 + wm + mi * 16 + g + h * 8;
                if (p >= p1) continue;
#pragma unroll
                for (int c2 = 0; c2 < 2; c2++) {
                    int n = n0 + wn + ni * 8 + tq * 2 + c2;
                    if (n >= N) continue;
                    float v = c0[mi][ni][h * 2 + c2];
                    if (GLU)
                        act[(long long)p * N + n] = f32_to_bf16(moe_silu(v) * c1[mi][ni][h * 2 + c2]);
                    else
                        ys[(long long)p * N + n] = v;
                }
            }
}

// Grid: (ceil(ef / MOE_BN), tile slots); K = hidden, N = ef.
extern "C" __global__ void __launch_bounds__(128)
    moe_gemm_gate_up(const u64* __restrict__ table, int dt, long long rb, const float* __restrict__ x, int hidden,
                     int ef, int k, const int* __restrict__ pair_of_pos, const int* __restrict__ n_tiles,
                     const int* __restrict__ tiles, bf16_t* __restrict__ act) {
    moe_gemm_body<true>(table, dt, rb, x, nullptr, hidden, ef, k, pair_of_pos, n_tiles, tiles, act, nullptr);
}

// Grid: (ceil(hidden / MOE_BN), tile slots); K = ef, N = hidden.
extern "C" __global__ void __launch_bounds__(128)
    moe_gemm_down(const u64* __restrict__ table, int dt, long long rb, const bf16_t* __restrict__ act, int ef,
                  int hidden, const int* __restrict__ n_tiles, const int* __restrict__ tiles,
                  float* __restrict__ ys) {
    moe_gemm_body<false>(table, dt, rb, nullptr, act, ef, hidden, 1, nullptr, n_tiles, tiles, nullptr, ys);
}
