// Routed integer GEMVs of block-format experts (the experts of a GGUF file:
// Q4_K and Q6_K in a Q4_K_M Qwen3-30B-A3B), for decode steps of up to
// MOE_GEMV_MAX_ROWS rows (moe.rs): the experts stay in their format and are
// read once, as the dense layers' integer GEMVs read theirs (mmvq.cu), where
// the kernels of any storage type in moe.cu decode every weight through
// `load_elem` on its own.
//
// A step: the input rows quantized to 8 bits (`q8_quantize`, or the copy the
// norm before wrote), `moe_route_sort` as for bf16 experts, then
//   moe_q8_gate_up_<fmt>: each chosen expert's gate and up rows dotted with
//     the 8-bit rows of its pairs, their SiLU product into `act` (f32, one
//     row per pair in sorted position) by mmvq_body's gate/up form;
//   q8_quantize over every pair's product row;
//   moe_q8_down_<fmt>: each pair's down rows into `ys` (one row per pair);
//   moe_combine: each row's weighted sum of its pairs' rows.
//
// Block (x, y): the y-th expert in use (`active`: expert, first position, end
// position, as moe_route_sort writes them; a block past `n_active` leaves at
// once), its weight-row groups x as mmvq_body lays them out (`groups` groups
// of 2 rows a block). The expert's pairs go one at a time through the
// one-row GEMV: a second pair of the same expert (rare at a few rows: 8 of
// 128 experts a token) re-reads the block's rows from L1 and L2, not from
// memory. Each result is mmvq_body's for that row alone, so it does not
// depend on which other rows share the expert.

// The gate/up/SiLU products of expert slot blockIdx.y's pairs: act[p] =
// silu(x[row(p)] . gate) * (x[row(p)] . up) for its positions p, where
// row(p) = pair_of_pos[p] / k; x given 8-bit as `xq` [rows][hidden] and `xs`
// [rows][hidden / 32].
template <int DT>
__device__ __forceinline__ void moe_q8_gate_up(const u64* __restrict__ table, long long rb,
                                               const signed char* __restrict__ xq, const float2* __restrict__ xs,
                                               int hidden, int ef, int k, const int* __restrict__ pair_of_pos,
                                               const int* __restrict__ n_active, const int* __restrict__ active,
                                               float* __restrict__ act, int groups) {
    pdl_enter();
    int y = blockIdx.y;
    if (y >= *n_active) return;
    int e = active[3 * y], end = active[3 * y + 2];
    const u8* gate = (const u8*)table[3 * e];
    const u8* up = (const u8*)table[3 * e + 1];
    for (int p = active[3 * y + 1]; p < end; p++) {
        long long row = pair_of_pos[p] / k;
        mmvq_body<DT, 1, 2, true, 32>(gate, up, nullptr, act + (long long)p * ef, nullptr, nullptr, nullptr, nullptr,
                                      nullptr, ef, 0, 0, rb, xq + row * hidden, xs + row * (hidden >> 5), hidden, 1,
                                      groups, 1, nullptr, nullptr, 0);
        // The next pair's partial sums reuse the shared memory this one read last.
        __syncthreads();
    }
}

// The down rows of expert slot blockIdx.y's pairs: ys[p] = down . act[p],
// act given 8-bit as `aq` [pairs][ef] and `as` [pairs][ef / 32].
template <int DT>
__device__ __forceinline__ void moe_q8_down(const u64* __restrict__ table, long long rb,
                                            const signed char* __restrict__ aq, const float2* __restrict__ as,
                                            int ef, int hidden, const int* __restrict__ n_active,
                                            const int* __restrict__ active, float* __restrict__ ys, int groups) {
    pdl_enter();
    int y = blockIdx.y;
    if (y >= *n_active) return;
    int e = active[3 * y], end = active[3 * y + 2];
    const u8* down = (const u8*)table[3 * e + 2];
    for (int p = active[3 * y + 1]; p < end; p++) {
        mmvq_body<DT, 1, 2, true, 32>(down, nullptr, nullptr, ys + (long long)p * hidden, nullptr, nullptr, nullptr,
                                      nullptr, nullptr, hidden, 0, 0, rb, aq + (long long)p * ef,
                                      as + (long long)p * (ef >> 5), ef, 1, groups, 0, nullptr, nullptr, 0);
        __syncthreads();
    }
}

// One pair of kernels a format, with the register budget of its one-row
// integer GEMV (mmvq.cu MMVQ_ALL's MINB1).
#define MOE_Q8(NAME, DT, MINB)                                                                                     \
    extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, MINB)                                          \
        moe_q8_gate_up_##NAME(const u64* __restrict__ table, long long rb, const signed char* __restrict__ xq,    \
                              const float2* __restrict__ xs, int hidden, int ef, int k,                           \
                              const int* __restrict__ pair_of_pos, const int* __restrict__ n_active,              \
                              const int* __restrict__ active, float* __restrict__ act, int groups) {              \
        moe_q8_gate_up<DT>(table, rb, xq, xs, hidden, ef, k, pair_of_pos, n_active, active, act, groups);         \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, MINB)                                          \
        moe_q8_down_##NAME(const u64* __restrict__ table, long long rb, const signed char* __restrict__ aq,       \
                           const float2* __restrict__ as, int ef, int hidden, const int* __restrict__ n_active,   \
                           const int* __restrict__ active, float* __restrict__ ys, int groups) {                  \
        moe_q8_down<DT>(table, rb, aq, as, ef, hidden, n_active, active, ys, groups);                             \
    }
MOE_Q8(q8_0, DT_Q8_0, 8)
MOE_Q8(q4_0, DT_Q4_0, 8)
MOE_Q8(q4_1, DT_Q4_1, 8)
MOE_Q8(q5_0, DT_Q5_0, 8)
MOE_Q8(q5_1, DT_Q5_1, 8)
MOE_Q8(iq4_nl, DT_IQ4_NL, 8)
MOE_Q8(q2_k, DT_Q2_K, 8)
MOE_Q8(q3_k, DT_Q3_K, 8)
MOE_Q8(q4_k, DT_Q4_K, 8)
MOE_Q8(q5_k, DT_Q5_K, 6)
MOE_Q8(q6_k, DT_Q6_K, 8)
MOE_Q8(iq4_xs, DT_IQ4_XS, 8)
