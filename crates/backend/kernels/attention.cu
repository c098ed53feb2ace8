// Paged attention over the bf16 KV cache (per layer and page [page_size,
// kv_heads, head_dim] for K and for V; page-table entries are page offsets in
// KV units, see kv_page_elems), causal, with grouped-query heads.
//
// Every query row carries its own position (row_pos) and sequence (row_seq),
// so one launch serves decode rows, prefill rows and prefill rows that follow
// a prefix-cached part: row r attends to positions 0..=row_pos[r].
//
// Long contexts are split over blockIdx.z (flash-decoding; x is the block of
// query heads, y the row, so a row's live splits are dispatched first): each split keeps
// an online-softmax state (max, sum, unnormalized output) and attn_combine
// merges the splits. With a single split the kernel normalizes and writes
// the output itself. A row's split length is found on the device from its
// own context (`split_len`), so a step captured for the longest context
// still spreads a short one over as many blocks as it can use.

#define ATT_WARPS 4
#define ATT_MAX_D 8        // head_dim <= 32 * ATT_MAX_D = 256
#define ATT_MAX_SPLITS 256 // the host never splits further

// Tokens per split of a row with `ctx` tokens over `nsplit` splits: an even
// share, at least `min_chunk`. Only the first ceil(ctx / len) splits hold any.
__device__ __forceinline__ int split_len(int ctx, int nsplit, int min_chunk) {
    return max(min_chunk, (ctx + nsplit - 1) / nsplit);
}

// How many of a row's splits hold some of its context (each of those writes a
// state; the rest have nothing to do).
__device__ __forceinline__ int splits_used(int ctx, int nsplit, int min_chunk) {
    int len = split_len(ctx, nsplit, min_chunk);
    return imin(imin(nsplit, ATT_MAX_SPLITS), (ctx + len - 1) / len);
}

// One lane's D elements of a bf16 row, starting at element `e0` (a multiple
// of D): one 4-, 8- or 16-byte load when the row is exactly 32 * D wide.
template <int D>
__device__ __forceinline__ void load_bf16_lane(const bf16_t* __restrict__ p, float (&f)[D]) {
    if (D == 2) {
        u32 w = *(const u32*)p;
        f[0] = __uint_as_float(w << 16), f[1] = __uint_as_float(w & 0xffff0000u);
    } else if (D == 4) {
        uint2 w = *(const uint2*)p;
        u32 a[2] = {w.x, w.y};
#pragma unroll
        for (int i = 0; i < 2; i++)
            f[2 * i] = __uint_as_float(a[i] << 16), f[2 * i + 1] = __uint_as_float(a[i] & 0xffff0000u);
    } else if (D == 8) {
        uint4 w = *(const uint4*)p;
        u32 a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; i++)
            f[2 * i] = __uint_as_float(a[i] << 16), f[2 * i + 1] = __uint_as_float(a[i] & 0xffff0000u);
    } else {
#pragma unroll
        for (int d = 0; d < D; d++) f[d] = bf16_to_f32(p[d]);
    }
}

// A 16-byte chunk of a bf16 K row (8 elements) dotted with 8 f32 q values at `qp`
// (shared memory, 16-byte aligned): the score step of the token-per-lane and tile kernels.
__device__ __forceinline__ float dot8_k_q(uint4 k, const float* qp) {
    u32 w[4] = {k.x, k.y, k.z, k.w};
    float kf[8];
#pragma unroll
    for (int i = 0; i < 4; i++)
        kf[2 * i] = __uint_as_float(w[i] << 16), kf[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    float4 a = *(const float4*)qp, b = *(const float4*)(qp + 4);
    return a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3] + b.x * kf[4] + b.y * kf[5] + b.z * kf[6] +
           b.w * kf[7];
}

// Whether split s of row r holds tokens: false for a row of no sequence or a
// split past its row's context (a captured step's grid is sized for the
// longest context the backend serves, so at a short one most of its blocks
// hold none; attn_combine reads only the splits that hold some). This reads
// only the step's metadata (uploaded before the step, written by no kernel),
// so a block asks before it waits on the previous kernel and, when empty,
// leaves at once: its slot is free while that kernel still runs, where a wait
// first held 900 such blocks of one decode row through the previous kernel's
// tail (captured attention at 640 tokens, 32/8 heads: 17.4 µs, against 10.8
// µs with splits for the context). Splits are the grid's slowest index
// (blockIdx.z), so the live ones are dispatched first.
__device__ __forceinline__ bool split_live(int r, int s, const u32* __restrict__ row_pos,
                                           const u32* __restrict__ row_seq, int min_chunk, int nsplit) {
    if (row_seq[r] == 0xffffffffu) return false;
    int ctx = (int)row_pos[r] + 1;
    return s * split_len(ctx, nsplit, min_chunk) < ctx;
}

// Split s of row r for the query heads from h0, one `split_live` found live:
// the KV head they read, the row's page table and the tokens [start, end) of
// its context.
struct Split {
    int kvh, start, end, used;
    const u32* pt;
};
__device__ __forceinline__ Split split_of(int r, int s, int h0, int heads, int kv_heads,
                                          const u32* __restrict__ row_pos, const u32* __restrict__ row_seq,
                                          const u32* __restrict__ seq_pt_off, const u32* __restrict__ page_table,
                                          int min_chunk, int nsplit) {
    Split sp;
    int ctx = (int)row_pos[r] + 1;
    int len = split_len(ctx, nsplit, min_chunk);
    sp.kvh = h0 / (heads / kv_heads);
    sp.pt = page_table + seq_pt_off[row_seq[r]];
    sp.start = s * len;
    sp.end = imin(ctx, sp.start + len);
    sp.used = splits_used(ctx, nsplit, min_chunk);
    return sp;
}

// The end of a split, shared by the decode kernels: each warp's online-softmax
// state (m, l and its lanes' output elements e = lane * Dr + d) meets in shared
// memory, and the block writes the split's merged state (or, with one split,
// the normalized output).
template <int G, int D>
__device__ __forceinline__ void attn_finish(float (&m)[G], float (&l)[G], float (&o)[G][D], int Dr, bool exact,
                                            float (*sm_m)[G], float (*sm_l)[G], float (*sm_o)[G][32 * D],
                                            float* __restrict__ out, float* __restrict__ part_o,
                                            float* __restrict__ part_ml, int r, int h0, int s, int heads,
                                            int head_dim, int nsplit) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
#pragma unroll
    for (int g = 0; g < G; g++) {
        if (lane == 0) {
            sm_m[wid][g] = m[g];
            sm_l[wid][g] = l[g];
        }
#pragma unroll
        for (int d = 0; d < D; d++) {
            int e = lane * Dr + d;
            if (exact || (d < Dr && e < head_dim)) sm_o[wid][g][e] = o[g][d];
        }
    }
    __syncthreads();
    for (int g = 0; g < G; g++) {
        int h = h0 + g;
        float M = NEG_INF;
        for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, sm_m[w][g]);
        float L = 0.f;
        float wt[ATT_WARPS];
        for (int w = 0; w < ATT_WARPS; w++) {
            wt[w] = sm_l[w][g] > 0.f ? expf(sm_m[w][g] - M) : 0.f;
            L += wt[w] * sm_l[w][g];
        }
        long long pidx = ((long long)r * heads + h) * nsplit + s;
        for (int e = threadIdx.x; e < head_dim; e += blockDim.x) {
            float acc = 0.f;
            for (int w = 0; w < ATT_WARPS; w++) acc += wt[w] * sm_o[w][g][e];
            if (nsplit == 1) out[((long long)r * heads + h) * head_dim + e] = L > 0.f ? acc / L : 0.f;
            else part_o[pidx * head_dim + e] = acc;
        }
        if (nsplit > 1 && threadIdx.x == 0) {
            part_ml[2 * pidx] = M;
            part_ml[2 * pidx + 1] = L;
        }
    }
}

// The splits' states of query heads h0 .. h0 + G - 1 of row r merged into
// their output, and into its 8-bit copy when `oq` is set (head_dim a multiple
// of 32): a thread per W consecutive output elements of a head walks the
// `used` splits once with an online softmax. Measured on an H100 it waits on
// about one L2 round trip per split (BENCHMARKS.md), slower than attn_combine,
// which is why the host asks for it only behind a switch. The states were written by other
// blocks of the same launch, so they are read through L2 (__ldcg), never from
// this SM's L1. The order over splits is fixed: the result does not depend on
// which block merges.
template <int W>
__device__ __forceinline__ void attn_merge_heads(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                                 int r, int h0, int G, int used, float* __restrict__ out,
                                                 u32* __restrict__ oq, float2* __restrict__ oqs, int heads,
                                                 int head_dim, int nsplit) {
    const int chunks = head_dim / W, total = G * chunks;
    for (int x0 = 0; x0 < total; x0 += blockDim.x) {
        // Warp-uniform: a warp with any live lane runs whole (q8_store4's shuffles).
        if (x0 + (int)(threadIdx.x & ~31u) >= total) break;
        int x = x0 + (int)threadIdx.x;
        bool live = x < total;
        int g = live ? x / chunks : 0, c = live ? x % chunks : 0;
        long long p0 = ((long long)r * heads + h0 + g) * nsplit;
        float m = NEG_INF, l = 0.f, acc[W];
#pragma unroll
        for (int j = 0; j < W; j++) acc[j] = 0.f;
#pragma unroll 8
        for (int s = 0; s < (live ? used : 0); s++) {
            float2 ml = __ldcg((const float2*)part_ml + p0 + s);
            const float* po = part_o + (p0 + s) * head_dim + W * c;
            float v[W];
            if (W == 4) {
                float4 t = __ldcg((const float4*)po);
                v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
            } else {
                v[0] = __ldcg(po);
            }
            if (ml.y > 0.f) {
                float mn = fmaxf(m, ml.x);
                float a = expf(m - mn), b = expf(ml.x - mn);
                l = l * a + b * ml.y;
#pragma unroll
                for (int j = 0; j < W; j++) acc[j] = acc[j] * a + b * v[j];
                m = mn;
            }
        }
        long long at = ((long long)r * heads + h0 + g) * head_dim + W * c;
        float o[W];
#pragma unroll
        for (int j = 0; j < W; j++) {
            o[j] = l > 0.f ? acc[j] / l : 0.f;
            if (live) out[at + j] = o[j];
        }
        if (W == 4 && oq) q8_store4(make_float4(o[0], o[1], o[2], o[3]), live, oq, oqs, live ? at >> 2 : 0);
    }
}

// The end of a split when the launch merges its own splits (`counts` set, a
// zeroed counter per row and block of heads): once the block's state is
// written, every thread fences its stores, and one thread counts the block in;
// the last of the row's `used` splits to arrive merges them all (no combine
// launch) and rearms the counter for the next launch. Every thread of the
// block calls this, with the same arguments.
template <int G>
__device__ __forceinline__ void attn_arrive(u32* __restrict__ counts, const float* __restrict__ part_o,
                                            const float* __restrict__ part_ml, int r, int h0, int used,
                                            float* __restrict__ out, u32* __restrict__ oq,
                                            float2* __restrict__ oqs, int heads, int head_dim, int nsplit) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        u32* c = counts + (long long)r * (heads / G) + h0 / G;
        last = atomicAdd(c, 1u) == (u32)(used - 1);
        if (last) *c = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    if ((head_dim & 3) == 0)
        attn_merge_heads<4>(part_o, part_ml, r, h0, G, used, out, oq, oqs, heads, head_dim, nsplit);
    else
        attn_merge_heads<1>(part_o, part_ml, r, h0, G, used, out, nullptr, nullptr, heads, head_dim, nsplit);
}

// One block serves G query heads that share a KV head (grouped-query
// attention), so each K and V row is read once for all of them: G = 1, 2, 4
// or 8, the largest that divides the group. Grid: (splits, heads / G, rows).
//
// Lane l holds elements [l * D, l * D + D) of a head. EXACT: head_dim is
// 32 * D, the lane's elements are one vector load, and each warp loads U
// tokens' K and V before it uses any (a decode step waits on these loads, not
// on the arithmetic). Otherwise D = ceil(head_dim / 32) is found at run time
// (up to ATT_MAX_D) and a token is loaded element by element.
template <int G, int D, int U, bool EXACT>
__device__ __forceinline__ void attn_partial_body(const float* __restrict__ q, const bf16_t* __restrict__ kc,
                                                  const bf16_t* __restrict__ vc, const u32* __restrict__ row_pos,
                                                  const u32* __restrict__ row_seq, const u32* __restrict__ seq_pt_off,
                                                  const u32* __restrict__ page_table, float* __restrict__ out,
                                                  float* __restrict__ part_o, float* __restrict__ part_ml, int heads,
                                                  int kv_heads, int head_dim, int page_size, float scale,
                                                  int min_chunk, int nsplit, u32* __restrict__ counts,
                                                  u32* __restrict__ oq, float2* __restrict__ oqs) {
    if (!split_live(blockIdx.y, blockIdx.z, row_pos, row_seq, min_chunk, nsplit)) return;
    pdl_enter();
    __shared__ float sm_m[ATT_WARPS][G], sm_l[ATT_WARPS][G];
    __shared__ float sm_o[ATT_WARPS][G][32 * D];
    int s = blockIdx.z, h0 = blockIdx.x * G, r = blockIdx.y;
    const Split sp = split_of(r, s, h0, heads, kv_heads, row_pos, row_seq, seq_pt_off, page_table, min_chunk, nsplit);
    const int kvh = sp.kvh, start = sp.start, end = sp.end;
    const u32* pt = sp.pt;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int Dr = EXACT ? D : (head_dim + 31) / 32;
    float qv[G][D], o[G][D], m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
        const float* qr = q + ((long long)r * heads + h0 + g) * head_dim;
#pragma unroll
        for (int d = 0; d < D; d++) {
            int e = lane * Dr + d;
            qv[g][d] = (EXACT || (d < Dr && e < head_dim)) ? qr[e] * scale : 0.f;
            o[g][d] = 0.f;
        }
        m[g] = NEG_INF;
        l[g] = 0.f;
    }
    int kvw = kv_heads * head_dim;
    for (int t0 = start + wid; t0 < end; t0 += ATT_WARPS * U) {
        float kf[U][D], vf[U][D];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int t = t0 + u * ATT_WARPS;
            if (t < end) {
                long long base =
                    kv_page_elems(pt[t / page_size]) + (long long)(t % page_size) * kvw + kvh * head_dim;
                if (EXACT) {
                    load_bf16_lane<D>(kc + base + lane * D, kf[u]);
                    load_bf16_lane<D>(vc + base + lane * D, vf[u]);
                } else {
#pragma unroll
                    for (int d = 0; d < D; d++) {
                        int e = lane * Dr + d;
                        bool in = d < Dr && e < head_dim;
                        kf[u][d] = in ? bf16_to_f32(kc[base + e]) : 0.f;
                        vf[u][d] = in ? bf16_to_f32(vc[base + e]) : 0.f;
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (t0 + u * ATT_WARPS < end) {
#pragma unroll
                for (int g = 0; g < G; g++) {
                    float sc = 0.f;
#pragma unroll
                    for (int d = 0; d < D; d++) sc += qv[g][d] * kf[u][d];
                    sc = warp_sum(sc);
                    float mn = fmaxf(m[g], sc);
                    float corr = expf(m[g] - mn);
                    float p = expf(sc - mn);
                    l[g] = l[g] * corr + p;
#pragma unroll
                    for (int d = 0; d < D; d++) o[g][d] = o[g][d] * corr + p * vf[u][d];
                    m[g] = mn;
                }
            }
        }
    }
    attn_finish<G, D>(m, l, o, Dr, EXACT, sm_m, sm_l, sm_o, out, part_o, part_ml, r, h0, s, heads, head_dim,
                      nsplit);
    if (nsplit > 1 && counts)
        attn_arrive<G>(counts, part_o, part_ml, r, h0, sp.used, out, oq, oqs, heads, head_dim, nsplit);
}

// attn_partial_g{G}: any head_dim up to 32 * ATT_MAX_D; attn_partial_g{G}_d{D}:
// head_dim exactly 32 * D (64, 128, 256), U tokens in flight per warp.
#define ATTN_PARTIAL(NAME, G, D, U, EXACT)                                                                      \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)                                                \
        NAME(const float* __restrict__ q, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,         \
             const u32* __restrict__ row_pos, const u32* __restrict__ row_seq,                                  \
             const u32* __restrict__ seq_pt_off, const u32* __restrict__ page_table, float* __restrict__ out,   \
             float* __restrict__ part_o, float* __restrict__ part_ml, int heads, int kv_heads, int head_dim,    \
             int page_size, float scale, int min_chunk, int nsplit, u32* __restrict__ counts,                  \
             u32* __restrict__ oq, float2* __restrict__ oqs) {                                                  \
        attn_partial_body<G, D, U, EXACT>(q, kc, vc, row_pos, row_seq, seq_pt_off, page_table, out, part_o,    \
                                          part_ml, heads, kv_heads, head_dim, page_size, scale, min_chunk,      \
                                          nsplit, counts, oq, oqs);                                             \
    }
ATTN_PARTIAL(attn_partial_g1, 1, ATT_MAX_D, 1, false)
ATTN_PARTIAL(attn_partial_g2, 2, ATT_MAX_D, 1, false)
ATTN_PARTIAL(attn_partial_g4, 4, ATT_MAX_D, 1, false)
ATTN_PARTIAL(attn_partial_g8, 8, ATT_MAX_D, 1, false)
#define ATTN_PARTIAL_EXACT(D, U)                                                                                \
    ATTN_PARTIAL(attn_partial_g1_d##D, 1, D, U, true)                                                           \
    ATTN_PARTIAL(attn_partial_g2_d##D, 2, D, U, true)                                                           \
    ATTN_PARTIAL(attn_partial_g4_d##D, 4, D, U, true)                                                           \
    ATTN_PARTIAL(attn_partial_g8_d##D, 8, D, U, true)
ATTN_PARTIAL_EXACT(2, 4)
ATTN_PARTIAL_EXACT(4, 4)
ATTN_PARTIAL_EXACT(8, 2)

// The same splits with a token per lane, for batches of decode rows, where
// the arithmetic (not the loads' latency) is what a step waits on: the kernel
// above spends a warp-wide reduction per token and query head. Here each warp
// takes 32 tokens at a time: lane t computes its token's score for the G query
// heads on its own (K row in 16-byte loads, q from shared memory), the tile's
// softmax update costs two reductions per head, and then every lane adds the
// 32 weighted V rows into its D output elements (p from shared memory, V in
// one vector load per token). head_dim is exactly 32 * D.
template <int G, int D>
__device__ __forceinline__ void attn_lanes_body(const float* __restrict__ q, const bf16_t* __restrict__ kc,
                                                const bf16_t* __restrict__ vc, const u32* __restrict__ row_pos,
                                                const u32* __restrict__ row_seq, const u32* __restrict__ seq_pt_off,
                                                const u32* __restrict__ page_table, float* __restrict__ out,
                                                float* __restrict__ part_o, float* __restrict__ part_ml, int heads,
                                                int kv_heads, int page_size, float scale, int min_chunk,
                                                int nsplit, u32* __restrict__ counts, u32* __restrict__ oq,
                                                float2* __restrict__ oqs) {
    if (!split_live(blockIdx.y, blockIdx.z, row_pos, row_seq, min_chunk, nsplit)) return;
    pdl_enter();
    const int HD = 32 * D, CH = HD / 8; // 16-byte chunks of a K row
    __shared__ __align__(16) float qs[G][HD];
    __shared__ float ps[ATT_WARPS][G][32];
    __shared__ float sm_m[ATT_WARPS][G], sm_l[ATT_WARPS][G];
    __shared__ float sm_o[ATT_WARPS][G][HD];
    int s = blockIdx.z, h0 = blockIdx.x * G, r = blockIdx.y;
    const Split sp = split_of(r, s, h0, heads, kv_heads, row_pos, row_seq, seq_pt_off, page_table, min_chunk, nsplit);
    const int kvh = sp.kvh, start = sp.start, end = sp.end;
    const u32* pt = sp.pt;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    for (int i = threadIdx.x; i < G * HD; i += blockDim.x)
        qs[i / HD][i % HD] = q[((long long)r * heads + h0 + i / HD) * HD + i % HD] * scale;
    __syncthreads();
    float m[G], l[G], o[G][D];
#pragma unroll
    for (int g = 0; g < G; g++) {
        m[g] = NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int d = 0; d < D; d++) o[g][d] = 0.f;
    }
    int kvw = kv_heads * HD;
    for (int t0 = start + wid * 32; t0 < end; t0 += ATT_WARPS * 32) {
        int t = t0 + lane;
        bool valid = t < end;
        long long base = valid ? kv_page_elems(pt[t / page_size]) + (long long)(t % page_size) * kvw + kvh * HD : 0;
        float sc[G];
#pragma unroll
        for (int g = 0; g < G; g++) sc[g] = 0.f;
        if (valid) {
            const uint4* kr = (const uint4*)(kc + base);
#pragma unroll
            for (int c0 = 0; c0 < CH; c0 += 8) {
                uint4 kw[8];
#pragma unroll
                for (int c = 0; c < 8; c++) kw[c] = kr[c0 + c];
#pragma unroll
                for (int c = 0; c < 8; c++)
#pragma unroll
                    for (int g = 0; g < G; g++) sc[g] += dot8_k_q(kw[c], &qs[g][(c0 + c) * 8]);
            }
        }
        // The tile's softmax update: lane 0's token is always in range, so the
        // tile's maximum is finite.
#pragma unroll
        for (int g = 0; g < G; g++) {
            float x = valid ? sc[g] : NEG_INF;
            float mn = fmaxf(m[g], warp_max(x));
            float corr = expf(m[g] - mn);
            float p = valid ? expf(x - mn) : 0.f;
            l[g] = l[g] * corr + warp_sum(p);
#pragma unroll
            for (int d = 0; d < D; d++) o[g][d] *= corr;
            m[g] = mn;
            ps[wid][g][lane] = p;
        }
        __syncwarp();
        int nv = imin(32, end - t0);
        u32 blo = (u32)base, bhi = (u32)(base >> 32);
#pragma unroll 4
        for (int j = 0; j < nv; j++) {
            long long bj = ((long long)__shfl_sync(0xffffffffu, bhi, j) << 32) | __shfl_sync(0xffffffffu, blo, j);
            float vf[D];
            load_bf16_lane<D>(vc + bj + lane * D, vf);
#pragma unroll
            for (int g = 0; g < G; g++) {
                float p = ps[wid][g][j];
#pragma unroll
                for (int d = 0; d < D; d++) o[g][d] += p * vf[d];
            }
        }
        __syncwarp();
    }
    attn_finish<G, D>(m, l, o, D, true, sm_m, sm_l, sm_o, out, part_o, part_ml, r, h0, s, heads, HD, nsplit);
    if (nsplit > 1 && counts)
        attn_arrive<G>(counts, part_o, part_ml, r, h0, sp.used, out, oq, oqs, heads, HD, nsplit);
}

#define ATTN_LANES(G, D)                                                                                        \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)                                                \
        attn_lanes_g##G##_d##D(const float* __restrict__ q, const bf16_t* __restrict__ kc,                     \
                               const bf16_t* __restrict__ vc, const u32* __restrict__ row_pos,                 \
                               const u32* __restrict__ row_seq, const u32* __restrict__ seq_pt_off,            \
                               const u32* __restrict__ page_table, float* __restrict__ out,                    \
                               float* __restrict__ part_o, float* __restrict__ part_ml, int heads,             \
                               int kv_heads, int head_dim, int page_size, float scale, int min_chunk,          \
                               int nsplit, u32* __restrict__ counts, u32* __restrict__ oq,                      \
                               float2* __restrict__ oqs) {                                                      \
        attn_lanes_body<G, D>(q, kc, vc, row_pos, row_seq, seq_pt_off, page_table, out, part_o, part_ml, heads,  \
                              kv_heads, page_size, scale, min_chunk, nsplit, counts, oq, oqs);                  \
    }
#define ATTN_LANES_ALL_G(D) ATTN_LANES(1, D) ATTN_LANES(2, D) ATTN_LANES(4, D) ATTN_LANES(8, D)
ATTN_LANES_ALL_G(2)
ATTN_LANES_ALL_G(4)
ATTN_LANES_ALL_G(8)

// Decode rows in tiles of 32 tokens, for steps of few rows (the batch-1
// decode of a model whose layers move few bytes, where attention's latency
// is the step's): the same splits, output and combine as attn_partial, but a
// block issues every load of a tile at once. Thread t takes token t / 4 of the
// tile and a quarter of its K and V rows (one round of 16-byte loads after
// one round of page-table loads, where attn_partial waits on a round per four
// tokens of a warp), scores the quarter against the G query heads (q in
// shared memory), and the four quarters meet in two shuffles; V goes to
// shared memory, and then thread t owns OPT output elements of one head and
// adds the tile's 32 weighted V rows into them with its head's online
// softmax. Splits are at least one tile (ATT_TILE_SPLIT in attention.rs).
//
// attn_tile_rope_*: the same for a step of decode rows only (each sequence
// one row), from the q/k/v projections' raw output: each block rotates (and,
// with Qwen3's head norms, first normalizes) its query heads itself, and the
// blocks of a row's last split, the one that holds its new token, store that
// token's K and V in the cache before they read it. The arithmetic is
// rope_write_kv's, so a decode step's RoPE and KV store take no launch of
// their own (that kernel moved a few kilobytes and cost a launch a layer).
// Only the last split reads the new token, and every block that stores it
// stores the same bytes. The launch also carries the L2 prefetch that
// rope_write_kv carried.
#define ATT_TILE 32
struct TileRope {
    const float *k, *v, *inv_freq, *qn, *kn;
    const u32* positions;
    float eps;
    int npos, half, interleaved;
};

// Element e of a head whose raw values are `x` after the head norm (`inv`,
// weights `w`; none when null) and RoPE at `pos` (pairs below 2 * half; none
// when !rotate), as rope_write_kv computes it.
__device__ __forceinline__ float rope_elem(const float* x, int e, float inv, const float* __restrict__ w,
                                           const float* __restrict__ inv_freq, float pos, bool rotate, int half,
                                           int interleaved) {
    if (!rotate || e >= 2 * half) return w ? x[e] * inv * w[e] : x[e];
    int i = interleaved ? e >> 1 : (e < half ? e : e - half);
    int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
    float x0 = x[a], x1 = x[b];
    if (w) x0 = x0 * inv * w[a], x1 = x1 * inv * w[b];
    float sn, cs;
    sincosf(pos * inv_freq[i], &sn, &cs);
    return e == a ? x0 * cs - x1 * sn : x0 * sn + x1 * cs;
}

template <int G, int D, bool ROPE>
__device__ __forceinline__ void attn_tile_body(const float* __restrict__ q, const bf16_t* kc, const bf16_t* vc,
                                               const u32* __restrict__ row_pos,
                                               const u32* __restrict__ row_seq, const u32* __restrict__ seq_pt_off,
                                               const u32* __restrict__ page_table, float* __restrict__ out,
                                               float* __restrict__ part_o, float* __restrict__ part_ml, int heads,
                                               int kv_heads, int page_size, float scale, int min_chunk,
                                               int nsplit, u32* __restrict__ counts, u32* __restrict__ oq,
                                               float2* __restrict__ oqs, TileRope rp, const u8* pf,
                                               long long pf_bytes) {
    // The L2 prefetch (weights only) is every block's share, empty or not.
    if (ROPE) l2_prefetch(pf, pf_bytes);
    if (!split_live(blockIdx.y, blockIdx.z, row_pos, row_seq, min_chunk, nsplit)) return;
    pdl_enter();
    const int HD = 32 * D, QD = HD / 4;        // a thread's quarter of a K or V row
    const int QC = QD / 8;                     // its 16-byte chunks
    const int QP = QD + 4;                     // padded quarter stride of q in shared memory
    const int OPT = (G * HD + 127) / 128;      // output elements per thread
    const int TPH = HD / OPT;                  // threads per head
    __shared__ __align__(16) float qs[G][4 * QP];
    __shared__ __align__(16) bf16_t vs[ATT_TILE][HD];
    __shared__ float ss[G][ATT_TILE];
    int s = blockIdx.z, h0 = blockIdx.x * G, r = blockIdx.y;
    const int t = threadIdx.x, j = t >> 2, qd = t & 3;
    // q is loaded before the rest of the split's metadata (its page table's
    // offset), so the two loads overlap.
    const int QT = (G * HD + 127) / 128;
    float qv[QT];
#pragma unroll
    for (int i = 0; i < QT; i++)
        if (t + 128 * i < G * HD) qv[i] = q[((long long)r * heads + h0) * HD + t + 128 * i];
    const Split sp = split_of(r, s, h0, heads, kv_heads, row_pos, row_seq, seq_pt_off, page_table, min_chunk, nsplit);
    const int kvw = kv_heads * HD;
    if (ROPE) {
        __shared__ float kr[HD], hinv[G + 1];
        // The raw q heads wait in the V tile's memory (64 * HD bytes, at least G * HD floats).
        float* xr = (float*)&vs[0][0];
        const int lane = t & 31, wid = t >> 5;
        const int slot = (int)row_pos[r];
        const bool last = sp.end == slot + 1; // this split holds the new token
        const long long kv_at = (long long)r * kvw + (long long)sp.kvh * HD;
#pragma unroll
        for (int i = 0; i < QT; i++)
            if (t + 128 * i < G * HD) xr[t + 128 * i] = qv[i];
        if (last)
            for (int e = t; e < HD; e += 128) kr[e] = rp.k[kv_at + e];
        __syncthreads();
        if (rp.qn) {
            // A warp per head (the k head last): its norm factor.
            for (int g = wid; g < G + (last ? 1 : 0); g += 4) {
                const float* x = g < G ? xr + g * HD : kr;
                float ssq = 0.f;
                for (int e = lane; e < HD; e += 32) ssq += x[e] * x[e];
                ssq = warp_sum(ssq);
                if (lane == 0) hinv[g] = 1.0f / sqrtf(ssq / (float)HD + rp.eps);
            }
            __syncthreads();
        }
        const bool rot = r < rp.npos;
        const float pos = rot ? (float)rp.positions[r] : 0.f;
#pragma unroll
        for (int i = 0; i < QT; i++) {
            int x = t + 128 * i, g = x / HD;
            if (x < G * HD)
                qv[i] = rope_elem(xr + g * HD, x % HD, rp.qn ? hinv[g] : 1.f, rp.qn, rp.inv_freq, pos, rot, rp.half,
                                  rp.interleaved);
        }
        if (last) {
            long long dst = kv_page_elems(sp.pt[slot / page_size]) + (long long)(slot % page_size) * kvw +
                            (long long)sp.kvh * HD;
            for (int e = t; e < HD; e += 128) {
                float y = rope_elem(kr, e, rp.kn ? hinv[G] : 1.f, rp.kn, rp.inv_freq, pos, rot, rp.half,
                                    rp.interleaved);
                ((bf16_t*)kc)[dst + e] = f32_to_bf16(y);
                ((bf16_t*)vc)[dst + e] = f32_to_bf16(rp.v[kv_at + e]);
            }
        }
        // Every raw q is read before the V tile's memory is reused, and the
        // new K and V are in the cache before the tile below loads them.
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < QT; i++) {
        int x = t + 128 * i, g = x / HD, e = x % HD;
        if (x < G * HD) qs[g][(e / QD) * QP + e % QD] = qv[i] * scale;
    }
    // This thread's outputs: head og, elements [oe, oe + OPT).
    const int og = t / TPH, oe = (t % TPH) * OPT;
    const bool owner = t < G * TPH;
    float o[OPT], m = NEG_INF, l = 0.f;
#pragma unroll
    for (int i = 0; i < OPT; i++) o[i] = 0.f;
    for (int t0 = sp.start; t0 < sp.end; t0 += ATT_TILE) {
        int tok = t0 + j;
        bool valid = tok < sp.end;
        uint4 kq[QC], vq[QC];
        if (valid) {
            long long base = kv_page_elems(sp.pt[tok / page_size]) + (long long)(tok % page_size) * kvw +
                             (long long)sp.kvh * HD + qd * QD;
            const uint4* kr = (const uint4*)(kc + base);
            const uint4* vr = (const uint4*)(vc + base);
#pragma unroll
            for (int c = 0; c < QC; c++) kq[c] = kr[c], vq[c] = vr[c];
        } else {
#pragma unroll
            for (int c = 0; c < QC; c++) kq[c] = vq[c] = make_uint4(0u, 0u, 0u, 0u);
        }
        __syncthreads(); // q is in place; the previous tile's V and scores are used up
#pragma unroll
        for (int c = 0; c < QC; c++) *(uint4*)&vs[j][qd * QD + 8 * c] = vq[c];
        float sc[G];
#pragma unroll
        for (int g = 0; g < G; g++) sc[g] = 0.f;
#pragma unroll
        for (int c = 0; c < QC; c++)
#pragma unroll
            for (int g = 0; g < G; g++) sc[g] += dot8_k_q(kq[c], &qs[g][qd * QP + 8 * c]);
#pragma unroll
        for (int g = 0; g < G; g++) {
            sc[g] += __shfl_xor_sync(0xffffffffu, sc[g], 1);
            sc[g] += __shfl_xor_sync(0xffffffffu, sc[g], 2);
            if (qd == 0) ss[g][j] = valid ? sc[g] : NEG_INF;
        }
        __syncthreads();
        if (owner) {
            // The tile's softmax update for head og (every thread of the head
            // computes the same m and l), then its weighted V rows.
            float mx = m;
#pragma unroll 8
            for (int i = 0; i < ATT_TILE; i++) mx = fmaxf(mx, ss[og][i]);
            float corr = expf(m - mx);
            l *= corr;
#pragma unroll
            for (int i = 0; i < OPT; i++) o[i] *= corr;
            int nv = imin(ATT_TILE, sp.end - t0);
            for (int i = 0; i < nv; i++) {
                float p = expf(ss[og][i] - mx);
                l += p;
#pragma unroll
                for (int e = 0; e < OPT; e++) o[e] += p * bf16_to_f32(vs[i][oe + e]);
            }
            m = mx;
        }
    }
    if (owner) {
        int h = h0 + og;
        long long pidx = ((long long)r * heads + h) * nsplit + s;
#pragma unroll
        for (int e = 0; e < OPT; e++) {
            if (nsplit == 1) out[((long long)r * heads + h) * HD + oe + e] = l > 0.f ? o[e] / l : 0.f;
            else part_o[pidx * HD + oe + e] = o[e];
        }
        if (nsplit > 1 && t % TPH == 0) {
            part_ml[2 * pidx] = m;
            part_ml[2 * pidx + 1] = l;
        }
    }
    if (nsplit > 1 && counts)
        attn_arrive<G>(counts, part_o, part_ml, r, h0, sp.used, out, oq, oqs, heads, HD, nsplit);
}

#define ATTN_TILE(G, D)                                                                                         \
    extern "C" __global__ void __launch_bounds__(128)                                                           \
        attn_tile_g##G##_d##D(const float* __restrict__ q, const bf16_t* __restrict__ kc,                      \
                              const bf16_t* __restrict__ vc, const u32* __restrict__ row_pos,                  \
                              const u32* __restrict__ row_seq, const u32* __restrict__ seq_pt_off,             \
                              const u32* __restrict__ page_table, float* __restrict__ out,                     \
                              float* __restrict__ part_o, float* __restrict__ part_ml, int heads, int kv_heads, \
                              int head_dim, int page_size, float scale, int min_chunk, int nsplit,              \
                              u32* __restrict__ counts, u32* __restrict__ oq, float2* __restrict__ oqs) {       \
        attn_tile_body<G, D, false>(q, kc, vc, row_pos, row_seq, seq_pt_off, page_table, out, part_o, part_ml,   \
                                    heads, kv_heads, page_size, scale, min_chunk, nsplit, counts, oq, oqs,      \
                                    TileRope{}, nullptr, 0);                                                     \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(128) attn_tile_rope_g##G##_d##D(                                \
        const float* __restrict__ q, bf16_t* kc, bf16_t* vc, const u32* __restrict__ row_pos,                    \
        const u32* __restrict__ row_seq, const u32* __restrict__ seq_pt_off, const u32* __restrict__ page_table, \
        float* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml, int heads,            \
        int kv_heads, int head_dim, int page_size, float scale, int min_chunk, int nsplit,                      \
        u32* __restrict__ counts, u32* __restrict__ oq, float2* __restrict__ oqs, const float* __restrict__ k,   \
        const float* __restrict__ v, const float* __restrict__ inv_freq, const u32* __restrict__ positions,      \
        int npos, int half, int interleaved, const float* __restrict__ qn, const float* __restrict__ kn,         \
        float eps, const u8* pf, long long pf_bytes) {                                                           \
        TileRope rp{k, v, inv_freq, qn, kn, positions, eps, npos, half, interleaved};                            \
        attn_tile_body<G, D, true>(q, kc, vc, row_pos, row_seq, seq_pt_off, page_table, out, part_o, part_ml,    \
                                   heads, kv_heads, page_size, scale, min_chunk, nsplit, counts, oq, oqs, rp,   \
                                   pf, pf_bytes);                                                               \
    }
#define ATTN_TILE_ALL_G(D) ATTN_TILE(1, D) ATTN_TILE(2, D) ATTN_TILE(4, D) ATTN_TILE(8, D)
ATTN_TILE_ALL_G(2)
ATTN_TILE_ALL_G(4)
ATTN_TILE_ALL_G(8)

// The largest `v` over the block (every thread gets it); `partial` holds 32 floats.
__device__ __forceinline__ float block_max(float v, float* partial) {
    v = warp_max(v);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        float w = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : NEG_INF;
        w = warp_max(w);
        if (threadIdx.x == 0) partial[0] = w;
    }
    __syncthreads();
    float m = partial[0];
    __syncthreads();
    return m;
}

// Merge the splits of each (row, head): only the ones attn_partial wrote.
// The block first weighs every split at once (a thread per split), then
// sums the weighted outputs with every load in flight at once: a thread owns
// W consecutive output elements (one 16-byte load per split when head_dim is
// a multiple of 4) and a 1/SL share of the splits, ATT_COMBINE_ILP loads
// issued before any is used, and the SL shares meet in shared memory in a
// fixed order. (A thread per element walking all splits, eight loads at a
// time, waited on five rounds of L2 latency for a 38-split decode row and
// took 9 µs on the H200.)
#define ATT_COMBINE_ILP 16
// The weighted-output loads of one batch of splits: v[i] = part_o of split
// s0 + i * per at element W * c (splits past `used` are not read).
template <int W>
__device__ __forceinline__ void attn_combine_load(const float* __restrict__ po, int head_dim, int s0, int per,
                                                  int used, float (&v)[ATT_COMBINE_ILP][W]) {
#pragma unroll
    for (int i = 0; i < ATT_COMBINE_ILP; i++) {
        int s = s0 + i * per;
        if (s < used) {
            if (W == 4) {
                float4 x = *(const float4*)(po + (long long)s * head_dim);
                v[i][0] = x.x, v[i][1] = x.y, v[i][2] = x.z, v[i][3] = x.w;
            } else {
                v[i][0] = po[(long long)s * head_dim];
            }
        }
    }
}

template <int W>
__device__ __forceinline__ void attn_combine_body(const float* __restrict__ part_o,
                                                  const float* __restrict__ part_ml, const u32* __restrict__ row_pos,
                                                  const u32* __restrict__ row_seq, float* __restrict__ out,
                                                  u32* __restrict__ oq, float2* __restrict__ oqs, int heads,
                                                  int head_dim, int nsplit, int min_chunk) {
    pdl_enter();
    __shared__ float weight[ATT_MAX_SPLITS];
    __shared__ float partial[32];
    __shared__ __align__(16) float share[ATT_WARPS * 32 * W];
    int h = blockIdx.x, r = blockIdx.y;
    if (row_seq[r] == 0xffffffffu) return;
    long long p0 = ((long long)r * heads + h) * nsplit;
    int ctx = (int)row_pos[r] + 1;
    int used = splits_used(ctx, nsplit, min_chunk);
    // Thread t: the W elements of chunk c0 + t % span, the splits s = t / span (mod per).
    int chunks = (head_dim + W - 1) / W;
    int span = imin(chunks, (int)blockDim.x), per = (int)blockDim.x / span;
    int ci = (int)threadIdx.x % span, sl = (int)threadIdx.x / span;
    // The first batch of outputs is loaded with the splits' (m, l) below, not after them.
    float v[ATT_COMBINE_ILP][W];
    if (sl < per) attn_combine_load<W>(part_o + p0 * head_dim + W * ci, head_dim, sl, per, used, v);
    float m = NEG_INF;
    for (int s = threadIdx.x; s < used; s += blockDim.x)
        if (part_ml[2 * (p0 + s) + 1] > 0.f) m = fmaxf(m, part_ml[2 * (p0 + s)]);
    float M = block_max(m, partial);
    float l = 0.f;
    for (int s = threadIdx.x; s < used; s += blockDim.x) {
        float ls = part_ml[2 * (p0 + s) + 1];
        float w = ls > 0.f ? expf(part_ml[2 * (p0 + s)] - M) : 0.f;
        weight[s] = w;
        l += w * ls;
    }
    float L = block_sum(l, partial); // its barrier also publishes `weight`
    for (int c0 = 0; c0 < chunks; c0 += span) {
        int c = c0 + ci;
        bool mine = sl < per && c < chunks;
        float acc[W];
#pragma unroll
        for (int j = 0; j < W; j++) acc[j] = 0.f;
        if (mine) {
            const float* po = part_o + p0 * head_dim + W * c;
            for (int s0 = sl; s0 < used; s0 += per * ATT_COMBINE_ILP) {
                if (c0 > 0 || s0 > sl) attn_combine_load<W>(po, head_dim, s0, per, used, v);
#pragma unroll
                for (int i = 0; i < ATT_COMBINE_ILP; i++) {
                    int s = s0 + i * per;
                    if (s < used)
#pragma unroll
                        for (int j = 0; j < W; j++) acc[j] += weight[s] * v[i][j];
                }
            }
        }
        if (sl < per)
#pragma unroll
            for (int j = 0; j < W; j++) share[(sl * span + ci) * W + j] = acc[j];
        __syncthreads();
        for (int e = threadIdx.x; e < span * W; e += blockDim.x) {
            float a = 0.f;
            for (int q = 0; q < per; q++) a += share[q * span * W + e];
            int oe = c0 * W + e;
            long long at = ((long long)r * heads + h) * head_dim + oe;
            float o = L > 0.f ? a / L : 0.f;
            if (oe < head_dim) out[at] = o;
            // A warp holds 32 consecutive outputs (the host asks only for
            // head_dim a multiple of 32, where span * W is too).
            if (oq) q8_store1(o, oe < head_dim, oq, oqs, at - (threadIdx.x & 31));
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
    attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml, const u32* __restrict__ row_pos,
                 const u32* __restrict__ row_seq, float* __restrict__ out, u32* __restrict__ oq,
                 float2* __restrict__ oqs, int heads, int head_dim, int nsplit, int min_chunk) {
    if ((head_dim & 3) == 0)
        attn_combine_body<4>(part_o, part_ml, row_pos, row_seq, out, oq, oqs, heads, head_dim, nsplit, min_chunk);
    else
        attn_combine_body<1>(part_o, part_ml, row_pos, row_seq, out, nullptr, nullptr, heads, head_dim, nsplit,
                             min_chunk);
}

// ---------------------------------------------------------------------------
// Tiled prefill attention (flash-attention style) on the tensor cores.
//
// One block of FA_WARPS warps takes a tile of up to FA_BM consecutive query
// rows of one sequence and one query head; each warp owns 16 rows. K and V are
// streamed from the paged cache through shared memory BN tokens at a time
// (cp.async, K of the next tile loading while P.V of this one runs), S = Q.K^T
// and O += P.V run as bf16 mma.sync m16n8k16 with f32 accumulators, and the
// softmax is online (running max and sum per row), so nothing of size
// rows x context is ever stored. Q is rounded to bf16 after scaling, P to bf16
// before P.V: the same precision as the bf16 cache it reads.
//
// The tile list (row0, nrows) comes from the host, one entry per FA_BM rows of
// every sequence that is prefilled in this step; every row carries its own
// position, so a tile that follows a prefix-cached part attends to the whole
// cached history. Tiles are taken longest-first so the long ones start early.
//
// A block writes DV of the head's HD output dimensions and reads BN tokens per
// K/V tile. Head dims 64 and 128 take the whole head (DV = HD, BN = FA_BN).
// Head dim 256 does not fit that way: its Q fragments (64 registers) and O
// accumulators (128) leave no room for S, and 64-token K and V tiles take
// 67 KB of shared memory (the static limit is 48 KB). So HD 256 splits the
// output in two halves, each its own block (blockIdx.x = tile * 2 + half, so
// both halves of a tile run side by side and share the K tile in L2): each
// computes the full-width S = Q.K^T and P.V for its 128 dimensions of V, over
// tiles of 32 tokens (K 16.5 KB + half V 8.5 KB). The S recompute costs 1.5x
// the FLOPs of one block per head, all of it on the tensor cores.

#define FA_BM 64
#define FA_BN 64
#define FA_WARPS 4

// Tokens t0..t0+BN-1 of KV head kvh, its W dimensions from d0, into shared
// memory [BN][W + 8] (the 8-element pad puts the rows of an 8x8 fragment on
// distinct banks). Tokens at or past `ctx` are zero-filled and never read from
// the page table.
template <int HD, int W, int BN>
__device__ __forceinline__ void fa_load_tile(bf16_t* dst, const bf16_t* __restrict__ cache,
                                             const u32* __restrict__ pt, int t0, int ctx, int page_size, int kvw,
                                             int kvh, int d0) {
    const int CH = W / 8;
#pragma unroll
    for (int c = threadIdx.x; c < BN * CH; c += FA_WARPS * 32) {
        int tok = c / CH, part = c % CH;
        int t = t0 + tok;
        const bf16_t* src = cache;
        int bytes = 0;
        if (t < ctx) {
            src = cache + kv_page_elems(pt[t / page_size]) + (long long)(t % page_size) * kvw + kvh * HD + d0 +
                  part * 8;
            bytes = 16;
        }
        cp_async16(smem_u32(dst + tok * (W + 8) + part * 8), src, bytes);
    }
}

// Q and K are HD wide; this block writes output dimensions [d0, d0 + DV) of
// its head, d0 = (blockIdx.x % (HD / DV)) * DV.
template <int HD, int DV, int BN>
__device__ __forceinline__ void attn_prefill_body(const float* __restrict__ q, const bf16_t* __restrict__ kc,
                                                  const bf16_t* __restrict__ vc, const u32* __restrict__ row_pos,
                                                  const u32* __restrict__ row_seq, const u32* __restrict__ seq_pt_off,
                                                  const u32* __restrict__ page_table, const u32* __restrict__ tiles,
                                                  float* __restrict__ out, int heads, int kv_heads, int page_size,
                                                  float scale_log2, int ntiles) {
    static_assert(HD % DV == 0 && DV % 16 == 0 && BN % 16 == 0, "whole mma fragments");
    const int PARTS = HD / DV;
    pdl_enter();
    __shared__ __align__(16) bf16_t ks[BN * (HD + 8)];
    __shared__ __align__(16) bf16_t vs[BN * (DV + 8)];
    const int LD = HD + 8, LDV = DV + 8;
    int tile = ntiles - 1 - (int)blockIdx.x / PARTS;
    int d0 = (int)blockIdx.x % PARTS * DV;
    int h = blockIdx.y;
    int row0 = (int)tiles[2 * tile], nrows = (int)tiles[2 * tile + 1];
    const u32* pt = page_table + seq_pt_off[row_seq[row0]];
    int kvh = h / (heads / kv_heads);
    int kvw = kv_heads * HD;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int g = lane >> 2, t4 = lane & 3;
    int last = nrows - 1;
    // This thread's two rows (tile-relative); padding rows borrow the last real row.
    int ra = imin(wid * 16 + g, last), rb = imin(wid * 16 + g + 8, last);
    int pa = (int)row_pos[row0 + ra], pb = (int)row_pos[row0 + rb];
    int w_first = (int)row_pos[row0 + imin(wid * 16, last)];
    int w_last = (int)row_pos[row0 + imin(wid * 16 + 15, last)];
    int ctx = (int)row_pos[row0 + last] + 1;

    // Q as A fragments, scaled by softmax_scale * log2(e) so the softmax uses exp2.
    u32 qf[HD / 16][4];
    {
        const float* qa = q + ((long long)(row0 + ra) * heads + h) * HD + 2 * t4;
        const float* qb = q + ((long long)(row0 + rb) * heads + h) * HD + 2 * t4;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            float2 x0 = *(const float2*)(qa + kk * 16), x1 = *(const float2*)(qb + kk * 16);
            float2 x2 = *(const float2*)(qa + kk * 16 + 8), x3 = *(const float2*)(qb + kk * 16 + 8);
            qf[kk][0] = pack_bf16x2(x0.x * scale_log2, x0.y * scale_log2);
            qf[kk][1] = pack_bf16x2(x1.x * scale_log2, x1.y * scale_log2);
            qf[kk][2] = pack_bf16x2(x2.x * scale_log2, x2.y * scale_log2);
            qf[kk][3] = pack_bf16x2(x3.x * scale_log2, x3.y * scale_log2);
        }
    }
    float o[DV / 8][4];
#pragma unroll
    for (int nt = 0; nt < DV / 8; nt++) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.f, l_b = 0.f;

    // ldmatrix addressing: lane l reads row l % 8 of matrix l / 8.
    int mi = lane >> 3, ri = lane & 7;
    // K (non-transposed): matrices (tokens nt*8.., d kk*16), (nt*8.., kk*16+8), ((nt+1)*8.., kk*16), ((nt+1)*8.., kk*16+8).
    u32 k_addr = smem_u32(ks + ((mi >> 1) * 8 + ri) * LD + (mi & 1) * 8);
    // V (transposed): matrices (tokens kk*16.., d nt*8), (kk*16+8.., nt*8), (kk*16.., (nt+1)*8), (kk*16+8.., (nt+1)*8).
    u32 v_addr = smem_u32(vs + ((mi & 1) * 8 + ri) * LDV + (mi >> 1) * 8);

    int nkt = (ctx + BN - 1) / BN;
    fa_load_tile<HD, HD, BN>(ks, kc, pt, 0, ctx, page_size, kvw, kvh, 0);
    cp_async_commit();
    for (int j = 0; j < nkt; j++) {
        int t0 = j * BN;
        fa_load_tile<HD, DV, BN>(vs, vc, pt, t0, ctx, page_size, kvw, kvh, d0);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        // Tiles wholly after this warp's last row are masked for all its rows.
        bool active = t0 <= w_last;
        float s[BN / 8][4];
        if (active) {
#pragma unroll
            for (int nt = 0; nt < BN / 8; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk++) {
#pragma unroll
                for (int nt = 0; nt < BN / 8; nt += 2) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4(k_addr + (u32)((nt * 8 * LD + kk * 16) * 2), b0, b1, b2, b3);
                    mma_bf16_16816(s[nt], qf[kk], b0, b1);
                    mma_bf16_16816(s[nt + 1], qf[kk], b2, b3);
                }
            }
            if (t0 + BN - 1 > w_first) {
#pragma unroll
                for (int nt = 0; nt < BN / 8; nt++) {
                    int key = t0 + nt * 8 + 2 * t4;
                    if (key > pa) s[nt][0] = NEG_INF;
                    if (key + 1 > pa) s[nt][1] = NEG_INF;
                    if (key > pb) s[nt][2] = NEG_INF;
                    if (key + 1 > pb) s[nt][3] = NEG_INF;
                }
            }
            float mxa = m_a, mxb = m_b;
#pragma unroll
            for (int nt = 0; nt < BN / 8; nt++) {
                mxa = fmaxf(mxa, fmaxf(s[nt][0], s[nt][1]));
                mxb = fmaxf(mxb, fmaxf(s[nt][2], s[nt][3]));
            }
            mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 1));
            mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 2));
            mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 1));
            mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 2));
            // Key 0 is visible to every row and tile 0 comes first, so the max
            // is finite here; the guard keeps a NaN out if that ever changes.
            float ba = mxa == NEG_INF ? 0.f : mxa, bb = mxb == NEG_INF ? 0.f : mxb;
            float ca = exp2f(m_a - ba), cb = exp2f(m_b - bb);
            m_a = mxa;
            m_b = mxb;
            l_a *= ca;
            l_b *= cb;
#pragma unroll
            for (int nt = 0; nt < DV / 8; nt++) {
                o[nt][0] *= ca;
                o[nt][1] *= ca;
                o[nt][2] *= cb;
                o[nt][3] *= cb;
            }
#pragma unroll
            for (int nt = 0; nt < BN / 8; nt++) {
                s[nt][0] = exp2f(s[nt][0] - ba);
                s[nt][1] = exp2f(s[nt][1] - ba);
                s[nt][2] = exp2f(s[nt][2] - bb);
                s[nt][3] = exp2f(s[nt][3] - bb);
                l_a += s[nt][0] + s[nt][1];
                l_b += s[nt][2] + s[nt][3];
            }
        }
        // Every warp is done with K: load the next tile's K while P.V runs.
        __syncthreads();
        if (j + 1 < nkt) {
            fa_load_tile<HD, HD, BN>(ks, kc, pt, t0 + BN, ctx, page_size, kvw, kvh, 0);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (active) {
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                // The S accumulators of tokens kk*16..kk*16+15 are exactly P's A fragment.
                u32 a[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                            pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                            pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
                for (int nt = 0; nt < DV / 8; nt += 2) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4_t(v_addr + (u32)((kk * 16 * LDV + nt * 8) * 2), b0, b1, b2, b3);
                    mma_bf16_16816(o[nt], a, b0, b1);
                    mma_bf16_16816(o[nt + 1], a, b2, b3);
                }
            }
        }
        // Every warp is done with V before the next iteration overwrites it.
        __syncthreads();
    }
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    float ia = l_a > 0.f ? 1.f / l_a : 0.f, ib = l_b > 0.f ? 1.f / l_b : 0.f;
    int wa = wid * 16 + g, wb = wa + 8;
    if (wa < nrows) {
        float* oa = out + ((long long)(row0 + wa) * heads + h) * HD + d0 + 2 * t4;
#pragma unroll
        for (int nt = 0; nt < DV / 8; nt++) *(float2*)(oa + nt * 8) = make_float2(o[nt][0] * ia, o[nt][1] * ia);
    }
    if (wb < nrows) {
        float* ob = out + ((long long)(row0 + wb) * heads + h) * HD + d0 + 2 * t4;
#pragma unroll
        for (int nt = 0; nt < DV / 8; nt++) *(float2*)(ob + nt * 8) = make_float2(o[nt][2] * ib, o[nt][3] * ib);
    }
}

// attn_prefill_hd{HD}: grid (tiles * HD / DV, heads); HD / DV blocks per tile and head.
#define ATTN_PREFILL(HD, DV, BN)                                                                                  \
    extern "C" __global__ void __launch_bounds__(FA_WARPS * 32)                                                   \
        attn_prefill_hd##HD(const float* __restrict__ q, const bf16_t* __restrict__ kc,                          \
                            const bf16_t* __restrict__ vc, const u32* __restrict__ row_pos,                      \
                            const u32* __restrict__ row_seq, const u32* __restrict__ seq_pt_off,                 \
                            const u32* __restrict__ page_table, const u32* __restrict__ tiles,                   \
                            float* __restrict__ out, int heads, int kv_heads, int page_size, float scale_log2,   \
                            int ntiles) {                                                                         \
        attn_prefill_body<HD, DV, BN>(q, kc, vc, row_pos, row_seq, seq_pt_off, page_table, tiles, out, heads,   \
                                      kv_heads, page_size, scale_log2, ntiles);                                   \
    }
ATTN_PREFILL(64, 64, FA_BN)
ATTN_PREFILL(128, 128, FA_BN)
ATTN_PREFILL(256, 128, 32)
