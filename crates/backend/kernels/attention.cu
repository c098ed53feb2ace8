// Paged attention over the bf16 KV cache (per layer [pages, page_size,
// kv_heads, head_dim] for K and for V), causal, with grouped-query heads.
//
// Every query row carries its own position (row_pos) and sequence (row_seq),
// so one launch serves decode rows, prefill rows and prefill rows that follow
// a prefix-cached part: row r attends to positions 0..=row_pos[r].
//
// Long contexts are split over blockIdx.x (flash-decoding): each split keeps
// an online-softmax state (max, sum, unnormalized output) and attn_combine
// merges the splits. With a single split the kernel normalizes and writes
// the output itself.

#define ATT_WARPS 4
#define ATT_MAX_D 8 // head_dim <= 32 * ATT_MAX_D = 256

extern "C" __global__ void attn_partial(const float* __restrict__ q, const bf16_t* __restrict__ kc,
                                        const bf16_t* __restrict__ vc, const u32* __restrict__ row_pos,
                                        const u32* __restrict__ row_seq, const u32* __restrict__ seq_pt_off,
                                        const u32* __restrict__ page_table, float* __restrict__ out,
                                        float* __restrict__ part_o, float* __restrict__ part_ml, int heads,
                                        int kv_heads, int head_dim, int page_size, float scale, int chunk,
                                        int nsplit) {
    __shared__ float sm_m[ATT_WARPS], sm_l[ATT_WARPS];
    __shared__ float sm_o[ATT_WARPS][32 * ATT_MAX_D];
    int s = blockIdx.x, h = blockIdx.y, r = blockIdx.z;
    if (row_seq[r] == 0xffffffffu) return;
    int kvh = h / (heads / kv_heads);
    int ctx = (int)row_pos[r] + 1;
    const u32* pt = page_table + seq_pt_off[row_seq[r]];
    int start = s * chunk;
    int end = imin(ctx, start + chunk);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int D = (head_dim + 31) / 32;
    const float* qr = q + ((long long)r * heads + h) * head_dim;
    float qv[ATT_MAX_D], o[ATT_MAX_D];
#pragma unroll
    for (int d = 0; d < ATT_MAX_D; d++) {
        int e = lane * D + d;
        qv[d] = (d < D && e < head_dim) ? qr[e] * scale : 0.f;
        o[d] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    int kvw = kv_heads * head_dim;
    for (int t = start + wid; t < end; t += ATT_WARPS) {
        long long base = ((long long)pt[t / page_size] * page_size + t % page_size) * kvw + kvh * head_dim;
        float sc = 0.f;
#pragma unroll
        for (int d = 0; d < ATT_MAX_D; d++) {
            int e = lane * D + d;
            if (d < D && e < head_dim) sc += qv[d] * bf16_to_f32(kc[base + e]);
        }
        sc = warp_sum(sc);
        float mn = fmaxf(m, sc);
        float corr = expf(m - mn);
        float p = expf(sc - mn);
        l = l * corr + p;
#pragma unroll
        for (int d = 0; d < ATT_MAX_D; d++) {
            int e = lane * D + d;
            float vv = (d < D && e < head_dim) ? bf16_to_f32(vc[base + e]) : 0.f;
            o[d] = o[d] * corr + p * vv;
        }
        m = mn;
    }
    if (lane == 0) {
        sm_m[wid] = m;
        sm_l[wid] = l;
    }
#pragma unroll
    for (int d = 0; d < ATT_MAX_D; d++) {
        int e = lane * D + d;
        if (d < D && e < head_dim) sm_o[wid][e] = o[d];
    }
    __syncthreads();
    float M = NEG_INF;
    for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, sm_m[w]);
    float L = 0.f;
    float wt[ATT_WARPS];
    for (int w = 0; w < ATT_WARPS; w++) {
        wt[w] = sm_l[w] > 0.f ? expf(sm_m[w] - M) : 0.f;
        L += wt[w] * sm_l[w];
    }
    long long pidx = ((long long)r * heads + h) * nsplit + s;
    for (int e = threadIdx.x; e < head_dim; e += blockDim.x) {
        float acc = 0.f;
        for (int w = 0; w < ATT_WARPS; w++) acc += wt[w] * sm_o[w][e];
        if (nsplit == 1) out[((long long)r * heads + h) * head_dim + e] = L > 0.f ? acc / L : 0.f;
        else part_o[pidx * head_dim + e] = acc;
    }
    if (nsplit > 1 && threadIdx.x == 0) {
        part_ml[2 * pidx] = M;
        part_ml[2 * pidx + 1] = L;
    }
}

extern "C" __global__ void attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                        const u32* __restrict__ row_seq, float* __restrict__ out, int heads,
                                        int head_dim, int nsplit) {
    int h = blockIdx.x, r = blockIdx.y;
    if (row_seq[r] == 0xffffffffu) return;
    long long p0 = ((long long)r * heads + h) * nsplit;
    float M = NEG_INF;
    for (int s = 0; s < nsplit; s++)
        if (part_ml[2 * (p0 + s) + 1] > 0.f) M = fmaxf(M, part_ml[2 * (p0 + s)]);
    for (int e = threadIdx.x; e < head_dim; e += blockDim.x) {
        float acc = 0.f, L = 0.f;
        for (int s = 0; s < nsplit; s++) {
            float ls = part_ml[2 * (p0 + s) + 1];
            if (ls > 0.f) {
                float w = expf(part_ml[2 * (p0 + s)] - M);
                acc += w * part_o[(p0 + s) * head_dim + e];
                L += w * ls;
            }
        }
        out[((long long)r * heads + h) * head_dim + e] = L > 0.f ? acc / L : 0.f;
    }
}
