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
