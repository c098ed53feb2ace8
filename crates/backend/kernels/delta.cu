// The gated delta-net layer of Qwen3.5's linear attention: the depthwise
// causal convolution with SiLU, the gated delta rule (the recurrent state
// update), the gated RMS norm of its read-out, and the sigmoid gate of the
// hybrid's full-attention layers. The host side is crates/backend/src/cuda/delta.rs;
// the reference is crates/backend/src/cpu/delta.rs, whose arithmetic these
// follow (f32 throughout, the same epsilons, softplus threshold and order of
// normalization), so both agree to rounding.
//
// Per-sequence metadata comes from one u32 array of DELTA_SEQ_FIELDS entries
// per sequence (first row, rows, tokens cached before the step, state slot),
// indexed by the launch's sequence coordinate. A decode step's array is
// padded to its rows with entries whose slot is DELTA_NO_SLOT, which launch
// blocks that do nothing: a captured step launches one per row it may be
// replayed with, whatever number of sequences the replay brings.
//
// Slot s of a layer's state starts at state + s * slot_stride (floats): the
// row width of a [slots, elems] buffer, or the size of a whole slot when
// the slots hold every layer's state side by side (a slot-major pool, where
// `state` points at this layer's offset inside slot 0).

#define DELTA_SEQ_FIELDS 4
#define DELTA_NO_SLOT 0xffffffffu
// transformers' (and FLA's) epsilon of the q/k L2 norm; cpu/delta.rs L2_EPS.
#define DELTA_L2_EPS 1e-6f

__device__ __forceinline__ float delta_silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float delta_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
// torch's softplus (beta 1, threshold 20: linear above it).
__device__ __forceinline__ float delta_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// x[i] *= sigmoid(gate[i]) over n elements (the output gate of full attention).
extern "C" __global__ void sigmoid_mul(float* x, const float* gate, long long n) {
    pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] *= delta_sigmoid(gate[i]);
}

// RMS-normalize every head_dim-wide head of x in place with the shared
// weight w, then multiply by silu(z). One warp per head.
extern "C" __global__ void gated_rms_norm(float* x, const float* z, const float* w, int head_dim, float eps,
                                          long long total_heads) {
    pdl_enter();
    int lane = threadIdx.x & 31;
    long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long head = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); head < total_heads;
         head += warps) {
        float* h = x + head * head_dim;
        const float* zh = z + head * head_dim;
        float s = 0.f;
        for (int j = lane; j < head_dim; j += 32) s += h[j] * h[j];
        s = warp_sum(s);
        float inv = 1.0f / sqrtf(s / (float)head_dim + eps);
        for (int j = lane; j < head_dim; j += 32) h[j] = h[j] * inv * w[j] * delta_silu(zh[j]);
    }
}

// ---------------------------------------------------------------- causal convolution
//
// Block (channel group of 32, sequence): 32 channels, one per lane, and
// blockDim.x / 32 warps that split the sequence's rows into chunks of
// CONV_CHUNK rows each. The rows are processed in passes of (warps x
// CONV_CHUNK) rows: every thread first loads its chunk's raw inputs into
// registers and leaves its last TAPS-1 of them in shared memory, so after one
// barrier each chunk finds the inputs before it (its halo) there, even though
// the convolution overwrites x in place. The halo of a pass's first chunk is
// the last chunk of the pass before (or the slot's state, zeros for a
// sequence with nothing cached). The state is left holding the last TAPS-1
// raw inputs of the stream [state, rows], oldest first.
#define CONV_CHUNK 8
#define CONV_MAX_WARPS 8

template <int TAPS>
__device__ __forceinline__ void conv_body(float* __restrict__ x, const u8* __restrict__ w, int wdt,
                                          float* __restrict__ state, long long slot_stride,
                                          const u32* __restrict__ seqs, int channels) {
    constexpr int KEEP = TAPS - 1;
    static_assert(KEEP >= 1 && KEEP <= CONV_CHUNK, "a chunk must hold a whole halo");
    __shared__ float tail[CONV_MAX_WARPS + 1][KEEP][32];
    __shared__ float init[KEEP][32];
    pdl_enter();
    const u32* sq = seqs + DELTA_SEQ_FIELDS * blockIdx.y;
    if (sq[3] == DELTA_NO_SLOT) return;
    const int cx = threadIdx.x & 31, ty = threadIdx.x >> 5, ny = blockDim.x >> 5;
    const int c = blockIdx.x * 32 + cx;
    const int row0 = (int)sq[0], n = (int)sq[1], cached = (int)sq[2];
    const long long slot = sq[3];
    const bool live = c < channels;
    float wt[TAPS];
#pragma unroll
    for (int j = 0; j < TAPS; j++) {
        long long at = (long long)c * TAPS + j;
        wt[j] = !live ? 0.f : wdt == DT_BF16 ? bf16_to_f32(((const bf16_t*)w)[at]) : ((const float*)w)[at];
    }
    float* st = state + slot * slot_stride;
    if (ty == 0) {
#pragma unroll
        for (int j = 0; j < KEEP; j++) {
            float v = (live && cached > 0) ? st[(long long)j * channels + c] : 0.f;
            init[j][cx] = v;
            tail[0][j][cx] = v;
        }
    }
    __syncthreads();
    const int per_pass = CONV_CHUNK * ny;
    for (int base = 0; base < n; base += per_pass) {
        const int r0 = base + ty * CONV_CHUNK;
        float in[CONV_CHUNK];
#pragma unroll
        for (int i = 0; i < CONV_CHUNK; i++) {
            int r = r0 + i;
            in[i] = (live && r < n) ? x[(long long)(row0 + r) * channels + c] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < KEEP; j++) tail[ty + 1][j][cx] = in[CONV_CHUNK - KEEP + j];
        __syncthreads();
        float win[KEEP];
#pragma unroll
        for (int j = 0; j < KEEP; j++) win[j] = tail[ty][j][cx];
#pragma unroll
        for (int i = 0; i < CONV_CHUNK; i++) {
            // The same order of terms as the CPU: oldest input first.
            float acc = 0.f;
#pragma unroll
            for (int j = 0; j < KEEP; j++) acc += wt[j] * win[j];
            acc += wt[KEEP] * in[i];
#pragma unroll
            for (int j = 0; j + 1 < KEEP; j++) win[j] = win[j + 1];
            win[KEEP - 1] = in[i];
            int r = r0 + i;
            if (live && r < n) {
                x[(long long)(row0 + r) * channels + c] = delta_silu(acc);
                if (r >= n - KEEP) st[(long long)(r - (n - KEEP)) * channels + c] = in[i];
            }
        }
        __syncthreads();
        if (ty == 0) {
#pragma unroll
            for (int j = 0; j < KEEP; j++) tail[0][j][cx] = tail[ny][j][cx];
        }
        __syncthreads();
    }
    // A sequence shorter than the window keeps the newest of the old inputs.
    if (ty == 0 && live) {
#pragma unroll
        for (int j = 0; j < KEEP; j++)
            if (n - KEEP + j < 0) st[(long long)j * channels + c] = init[n + j][cx];
    }
}

#define CONV_KERNEL(T)                                                                                            \
    extern "C" __global__ void causal_conv_silu_t##T(float* x, const u8* w, int wdt, float* state,               \
                                                     long long slot_stride, const u32* seqs, int channels) {      \
        conv_body<T>(x, w, wdt, state, slot_stride, seqs, channels);                                              \
    }
CONV_KERNEL(2)
CONV_KERNEL(3)
CONV_KERNEL(4)
CONV_KERNEL(5)
CONV_KERNEL(6)

// ---------------------------------------------------------------- gated delta rule
//
// Block (value-column tile of 32, value head, sequence), NW warps: lane j
// owns column tile*32 + j of the head's [k_dim, v_dim] state and warp w its
// rows w*32 .. w*32+31, so the 32 x 32*NW slice of the state lives in
// registers for the whole sequence, read from the slot once and written back
// once. Per token: Sᵀk (a column sum: per thread over its rows, across warps
// through shared memory), the correction towards v, the rank-one update and
// Sᵀq, with two barriers.
//
// Nothing on the path from one token's state to the next waits for device
// memory: the tokens come in chunks of DELTA_CHUNK, and while a chunk is
// computed the next one's inputs are loaded into registers (issued at the
// chunk's start, so their latency hides behind its tokens), then published
// at its last token into the other half of a double buffer in shared memory
// with their squared norms, gates and decays. k_dim up to 32*NW; any v_dim.
#define DELTA_CHUNK 8

template <int NW>
__device__ __forceinline__ void delta_body(const float* __restrict__ qkv, const float* __restrict__ a,
                                           const float* __restrict__ b, const float* __restrict__ decay,
                                           const float* __restrict__ dt_bias, float* __restrict__ state,
                                           long long slot_stride, const u32* __restrict__ seqs, float* __restrict__ out, int qkv_cols,
                                           int out_cols, int v_heads, int k_heads, int dk, int dv, int tiled,
                                           float scale) {
    constexpr int L = DELTA_CHUNK;
    static_assert(L <= 32 * NW, "a thread per token of a chunk publishes its gate");
    __shared__ float qs[2][L][32 * NW], ks[2][L][32 * NW];
    // [buffer][q, k][token][warp]: each warp's share of the squared norms.
    __shared__ float norms[2][2][L][NW];
    // [buffer][beta, keep][token]
    __shared__ float gates[2][2][L];
    __shared__ float red[NW][32], red2[NW][32];
    pdl_enter();
    const u32* sq = seqs + DELTA_SEQ_FIELDS * blockIdx.z;
    if (sq[3] == DELTA_NO_SLOT) return;
    const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, tid = threadIdx.x;
    const int h = blockIdx.y;
    const int row0 = (int)sq[0], n = (int)sq[1], cached = (int)sq[2];
    const long long slot = sq[3];
    const int j = blockIdx.x * 32 + lane;
    const bool jl = j < dv;
    const int kh = tiled ? h % k_heads : h / (v_heads / k_heads);
    const int key = k_heads * dk;
    float* S = state + slot * slot_stride + (long long)h * dk * dv;
    float s[32];
#pragma unroll
    for (int r = 0; r < 32; r++) {
        int i = wp * 32 + r;
        s[r] = (cached > 0 && jl && i < dk) ? S[(long long)i * dv + j] : 0.f;
    }
    const float dec = decay[h], dtb = dt_bias[h];
    // The chunk being loaded: element tid of q and k, this column's v, and
    // (thread u) token u's gate inputs. The chunk being computed: its v.
    float fq[L], fk[L], fv[L], cv[L];
    float fa = 0.f, fb = 0.f;
    auto fetch = [&](int t0) {
#pragma unroll
        for (int u = 0; u < L; u++) {
            const bool in = t0 + u < n;
            const float* row = qkv + (long long)(row0 + t0 + u) * qkv_cols;
            fq[u] = in && tid < dk ? row[kh * dk + tid] : 0.f;
            fk[u] = in && tid < dk ? row[key + kh * dk + tid] : 0.f;
            fv[u] = in && jl ? row[2 * key + h * dv + j] : 0.f;
        }
        const bool in = tid < L && t0 + tid < n;
        fa = in ? a[(long long)(row0 + t0 + tid) * v_heads + h] : 0.f;
        fb = in ? b[(long long)(row0 + t0 + tid) * v_heads + h] : 0.f;
    };
    auto publish = [&](int p) {
#pragma unroll
        for (int u = 0; u < L; u++) {
            float q2 = warp_sum(fq[u] * fq[u]), k2 = warp_sum(fk[u] * fk[u]);
            qs[p][u][tid] = fq[u];
            ks[p][u][tid] = fk[u];
            if (lane == 0) {
                norms[p][0][u][wp] = q2;
                norms[p][1][u][wp] = k2;
            }
            cv[u] = fv[u];
        }
        if (tid < L) {
            gates[p][0][tid] = delta_sigmoid(fb);
            gates[p][1][tid] = expf(-dec * delta_softplus(fa + dtb));
        }
    };
    if (n > 0) {
        fetch(0);
        publish(0);
    }
    __syncthreads();
    const int chunks = (n + L - 1) / L;
    for (int c = 0; c < chunks; c++) {
        const int p = c & 1;
        const bool more = c + 1 < chunks;
        if (more) fetch((c + 1) * L);
#pragma unroll
        for (int u = 0; u < L; u++) {
            const int t = c * L + u;
            if (t >= n) break;
            float tq = 0.f, tk = 0.f;
#pragma unroll
            for (int w = 0; w < NW; w++) {
                tq += norms[p][0][u][w];
                tk += norms[p][1][u][w];
            }
            const float qn = 1.0f / sqrtf(tq + DELTA_L2_EPS) * scale;
            const float kn = 1.0f / sqrtf(tk + DELTA_L2_EPS);
            const float beta = gates[p][0][u], keep = gates[p][1][u];
            const float* kr = &ks[p][u][wp * 32];
            const float* qr = &qs[p][u][wp * 32];
            // Decay the state and read what it holds for k (four partial
            // sums: a shorter dependent chain).
            float m4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int r = 0; r < 32; r++) {
                s[r] *= keep;
                m4[r & 3] += s[r] * kr[r];
            }
            red[wp][lane] = ((m4[0] + m4[1]) + (m4[2] + m4[3])) * kn;
            __syncthreads();
            float mem = 0.f;
#pragma unroll
            for (int w = 0; w < NW; w++) mem += red[w][lane];
            // Write the correction towards v, then read with q.
            const float d = (cv[u] - mem) * beta;
            float o4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int r = 0; r < 32; r++) {
                s[r] += (kr[r] * kn) * d;
                o4[r & 3] += s[r] * qr[r];
            }
            red2[wp][lane] = ((o4[0] + o4[1]) + (o4[2] + o4[3])) * qn;
            // The next chunk into the other buffer, after this chunk's last use of cv.
            if (u == L - 1 && more) publish(p ^ 1);
            __syncthreads();
            if (wp == 0 && jl) {
                float tot = 0.f;
#pragma unroll
                for (int w = 0; w < NW; w++) tot += red2[w][lane];
                out[(long long)(row0 + t) * out_cols + h * dv + j] = tot;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 32; r++) {
        int i = wp * 32 + r;
        if (jl && i < dk) S[(long long)i * dv + j] = s[r];
    }
}

#define DELTA_KERNEL(NW)                                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * NW) gated_delta_rule_w##NW(                                 \
        const float* qkv, const float* a, const float* b, const float* decay, const float* dt_bias, float* state, \
        long long slot_stride, const u32* seqs, float* out, int qkv_cols, int out_cols, int v_heads, int k_heads, \
        int dk, int dv, int tiled, float scale) {                                                                 \
        delta_body<NW>(qkv, a, b, decay, dt_bias, state, slot_stride, seqs, out, qkv_cols, out_cols, v_heads,     \
                       k_heads, dk, dv, tiled, scale);                                                            \
    }
DELTA_KERNEL(1)
DELTA_KERNEL(2)
DELTA_KERNEL(4)
DELTA_KERNEL(8)

// ---------------------------------------------------------------- chunked gated delta rule (prefill)
//
// The same recurrence over DELTA_C tokens at a time. Inside a chunk, with
// G_t the running sum of log keep from the chunk's start, gamma_t = exp(G_t),
// S0 the state at its start and k, q normalized (q scaled):
//   A[t][s] = beta_t exp(G_t - G_s) k_t.k_s for s < t, else 0
//   (I + A) D = diag(beta) (V - diag(gamma) K S0)        (D's rows: the corrections d_t)
//   O = diag(gamma) Q S0 + P D,  P[t][s] = exp(G_t - G_s) q_t.k_s for s <= t, else 0
//   S_end = gamma_C S0 + sum_s exp(G_C - G_s) k_s d_s^T
// (unrolling S_t = keep_t S_{t-1} + k_t d_t^T with d_t = beta_t (v_t -
// (keep_t S_{t-1})^T k_t) over the chunk gives these; every exponent is a
// difference G_t - G_s <= 0, so nothing overflows). The triangular system is
// solved by forward substitution, a column per lane of one warp.
//
// Block (value-column tile of 32, value head, sequence), 4 warps: the
// 32-column slice of the state lives in shared memory ([dk][32], f32), the
// chunk's q and k rows beside it. Each chunk takes five barriers (the scan
// takes two per token) and its products are blocked over registers: thread
// (warp w, lane j) computes column j of tokens 4w .. 4w+3 of K S0 and Q S0
// and of the output, and rows 4w + 16m .. 4w + 16m + 3 (every m) of column
// j of the new state. k_dim up to DELTA_C_MAX_K; any v_dim.
#define DELTA_C 16
#define DELTA_C_MAX_K 128
#define DELTA_C_THREADS 128

extern "C" __global__ void __launch_bounds__(DELTA_C_THREADS)
    gated_delta_rule_chunked(const float* __restrict__ qkv, const float* __restrict__ a,
                             const float* __restrict__ b, const float* __restrict__ decay,
                             const float* __restrict__ dt_bias, float* __restrict__ state, long long slot_stride,
                             const u32* __restrict__ seqs, float* __restrict__ out, int qkv_cols, int out_cols,
                             int v_heads, int k_heads, int dk, int dv, int tiled, float scale) {
    constexpr int C = DELTA_C, KP = DELTA_C_MAX_K + 4;
    constexpr int TOK = C / (DELTA_C_THREADS / 32);
    static_assert(C * 8 == DELTA_C_THREADS, "thread t*8+p computes entries (t, 2p), (t, 2p+1) of K K^T and Q K^T");
    static_assert(TOK == 4, "a warp's four tokens");
    // The state slice [dk][32]; the chunk's normalized q (scaled) and k, rows
    // padded to keep float4 reads aligned and rows on different banks.
    __shared__ __align__(16) float Ss[DELTA_C_MAX_K][32];
    __shared__ __align__(16) float Qs[C][KP], Ks[C][KP];
    // A (strictly lower, with beta and decay folded in) and P (lower).
    __shared__ float As[C][C], Ps[C][C];
    // The right-hand side, then the solved corrections D.
    __shared__ float Rs[C][32];
    // beta, log keep, then G (running sum of log keep).
    __shared__ float beta_s[C], G_s[C];
    pdl_enter();
    const u32* sq = seqs + DELTA_SEQ_FIELDS * blockIdx.z;
    if (sq[3] == DELTA_NO_SLOT) return;
    const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, tid = threadIdx.x;
    const int h = blockIdx.y;
    const int row0 = (int)sq[0], n = (int)sq[1], cached = (int)sq[2];
    const long long slot = sq[3];
    const int j = blockIdx.x * 32 + lane;
    const bool jl = j < dv;
    const int kh = tiled ? h % k_heads : h / (v_heads / k_heads);
    const int key = k_heads * dk;
    // Rows rounded up to whole float4s; rows dk .. dk4-1 hold zeros.
    const int dk4 = (dk + 3) & ~3;
    float* S = state + slot * slot_stride + (long long)h * dk * dv;
    for (int i = wp; i < dk4; i += 4) Ss[i][lane] = (cached > 0 && jl && i < dk) ? S[(long long)i * dv + j] : 0.f;
    const float dec = decay[h], dtb = dt_bias[h];
    for (int c0 = 0; c0 < n; c0 += C) {
        // Load the chunk: q and k rows (zeros past the sequence), this thread's
        // v, and (thread t) token t's gates; a token past the end keeps the
        // state (log keep 0) and writes nothing (beta 0).
        for (int e = tid; e < C * dk4; e += DELTA_C_THREADS) {
            const int t = e / dk4, i = e - t * dk4;
            const bool in = c0 + t < n && i < dk;
            const float* row = qkv + (long long)(row0 + c0 + t) * qkv_cols;
            Qs[t][i] = in ? row[kh * dk + i] : 0.f;
            Ks[t][i] = in ? row[key + kh * dk + i] : 0.f;
        }
        float v[TOK];
#pragma unroll
        for (int u = 0; u < TOK; u++) {
            const int t = c0 + wp * TOK + u;
            v[u] = (t < n && jl) ? qkv[(long long)(row0 + t) * qkv_cols + 2 * key + h * dv + j] : 0.f;
        }
        if (tid < C) {
            const bool in = c0 + tid < n;
            const long long r = (long long)(row0 + c0 + tid) * v_heads + h;
            beta_s[tid] = in ? delta_sigmoid(b[r]) : 0.f;
            G_s[tid] = in ? -dec * delta_softplus(a[r] + dtb) : 0.f;
        }
        __syncthreads();
        // Normalize the warp's tokens' q and k; one thread sums the log keeps.
        for (int u = 0; u < TOK; u++) {
            const int t = wp * TOK + u;
            float q2 = 0.f, k2 = 0.f;
            for (int i = lane; i < dk4; i += 32) {
                q2 += Qs[t][i] * Qs[t][i];
                k2 += Ks[t][i] * Ks[t][i];
            }
            q2 = warp_sum(q2);
            k2 = warp_sum(k2);
            const float qn = 1.0f / sqrtf(q2 + DELTA_L2_EPS) * scale;
            const float kn = 1.0f / sqrtf(k2 + DELTA_L2_EPS);
            for (int i = lane; i < dk4; i += 32) {
                Qs[t][i] *= qn;
                Ks[t][i] *= kn;
            }
        }
        if (tid == 0)
            for (int t = 1; t < C; t++) G_s[t] += G_s[t - 1];
        __syncthreads();
        // K K^T and Q K^T, two entries of each per thread, decays and beta folded in.
        {
            const int t = tid >> 3, s = (tid & 7) * 2;
            float kk0 = 0.f, kk1 = 0.f, qk0 = 0.f, qk1 = 0.f;
            for (int i = 0; i < dk4; i += 4) {
                const float4 kt = *(const float4*)&Ks[t][i], qt = *(const float4*)&Qs[t][i];
                const float4 k0 = *(const float4*)&Ks[s][i], k1 = *(const float4*)&Ks[s + 1][i];
                kk0 += kt.x * k0.x + kt.y * k0.y + kt.z * k0.z + kt.w * k0.w;
                kk1 += kt.x * k1.x + kt.y * k1.y + kt.z * k1.z + kt.w * k1.w;
                qk0 += qt.x * k0.x + qt.y * k0.y + qt.z * k0.z + qt.w * k0.w;
                qk1 += qt.x * k1.x + qt.y * k1.y + qt.z * k1.z + qt.w * k1.w;
            }
            const float gt = G_s[t], bt = beta_s[t];
            const float e0 = s <= t ? expf(gt - G_s[s]) : 0.f, e1 = s + 1 <= t ? expf(gt - G_s[s + 1]) : 0.f;
            As[t][s] = s < t ? bt * e0 * kk0 : 0.f;
            As[t][s + 1] = s + 1 < t ? bt * e1 * kk1 : 0.f;
            Ps[t][s] = e0 * qk0;
            Ps[t][s + 1] = e1 * qk1;
        }
        // K S0 and Q S0 for the warp's tokens, column j.
        float oq[TOK];
        {
            float ks[TOK], qs[TOK];
#pragma unroll
            for (int u = 0; u < TOK; u++) ks[u] = qs[u] = 0.f;
            for (int i = 0; i < dk4; i += 4) {
                const float s0 = Ss[i][lane], s1 = Ss[i + 1][lane], s2 = Ss[i + 2][lane], s3 = Ss[i + 3][lane];
#pragma unroll
                for (int u = 0; u < TOK; u++) {
                    const float4 k4 = *(const float4*)&Ks[wp * TOK + u][i];
                    const float4 q4 = *(const float4*)&Qs[wp * TOK + u][i];
                    ks[u] += k4.x * s0 + k4.y * s1 + k4.z * s2 + k4.w * s3;
                    qs[u] += q4.x * s0 + q4.y * s1 + q4.z * s2 + q4.w * s3;
                }
            }
#pragma unroll
            for (int u = 0; u < TOK; u++) {
                const int t = wp * TOK + u;
                const float gamma = expf(G_s[t]);
                Rs[t][lane] = beta_s[t] * (v[u] - gamma * ks[u]);
                oq[u] = gamma * qs[u];
            }
        }
        __syncthreads();
        // (I + A) D = R by forward substitution, column j on lane j of warp 0.
        if (wp == 0) {
            float d[C];
#pragma unroll
            for (int t = 0; t < C; t++) {
                float x = Rs[t][lane];
#pragma unroll
                for (int s = 0; s < t; s++) x -= As[t][s] * d[s];
                d[t] = x;
                Rs[t][lane] = x;
            }
        }
        __syncthreads();
        // The warp's tokens' output, column j.
#pragma unroll
        for (int u = 0; u < TOK; u++) {
            const int t = wp * TOK + u;
            float o = oq[u];
#pragma unroll
            for (int s = 0; s < C; s++) o += Ps[t][s] * Rs[s][lane];
            if (c0 + t < n && jl) out[(long long)(row0 + c0 + t) * out_cols + h * dv + j] = o;
        }
        // The state at the chunk's end: the warp's groups of four rows of
        // column j, each correction weighted by the decay from its token on.
        {
            const float gc = G_s[C - 1], gamma_c = expf(gc);
            float d[C];
#pragma unroll
            for (int s = 0; s < C; s++) d[s] = expf(gc - G_s[s]) * Rs[s][lane];
            for (int i = wp * 4; i < dk4; i += 16) {
                float s0 = Ss[i][lane] * gamma_c, s1 = Ss[i + 1][lane] * gamma_c;
                float s2 = Ss[i + 2][lane] * gamma_c, s3 = Ss[i + 3][lane] * gamma_c;
#pragma unroll
                for (int s = 0; s < C; s++) {
                    const float4 k4 = *(const float4*)&Ks[s][i];
                    s0 += k4.x * d[s];
                    s1 += k4.y * d[s];
                    s2 += k4.z * d[s];
                    s3 += k4.w * d[s];
                }
                Ss[i][lane] = s0;
                Ss[i + 1][lane] = s1;
                Ss[i + 2][lane] = s2;
                Ss[i + 3][lane] = s3;
            }
        }
        __syncthreads();
    }
    for (int i = wp; i < dk; i += 4)
        if (jl) S[(long long)i * dv + j] = Ss[i][lane];
}
