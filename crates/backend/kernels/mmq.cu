// Block-format weights on the tensor cores, for a few to a few hundred input
// rows: out[r][j] = x[r] . w[j], the weights kept quantized in memory and
// every weight byte read once per launch for each group of input rows.
//
// Layout: a block of MMQ_WARPS warps owns MMQ_BN weight rows, 16 per warp
// (the M of mma.m16n8k16), one group of up to 8 NT input rows (NT = 1, 2, 4
// or 8 tiles of 8, each an N of the mma) and one slice of K (blockIdx.y). blockIdx.x
// counts the row groups fastest, so the blocks that share a weight tile run
// side by side and its second read comes from L2. The block walks its slice
// in chunks of 256 weights (one K-quant super-block, or 8 blocks of the
// 32-weight formats): the raw bytes of the next chunk of all its weight
// rows, and the same 256 k of all its input rows as bf16, are copied to
// shared memory with cp.async while the threads decode the current chunk
// (`deq8_bf16`: 8 consecutive weights of rows g and g + 8) straight into mma
// fragments. Every weight is decoded once per block and every input value
// read from global memory once per block; the warps share the staged input.
// Splitting K over the grid's y (`kslice`) gives a card enough blocks even
// for a 1024-row projection; each slice then writes its partial sums to
// `part[y]` and `mmq_reduce` adds the slices in a fixed order, so the result
// does not depend on the scheduling.
//
// K order inside a 32-weight group: thread (g, t) holds weights 32q + 8t ..
// + 7 of its rows and the same 8 k of its input row (one 16-byte shared
// load), and uses elements 0..3 for the first k-step of the group and 4..7
// for the second: the fragment's logical k (2t, 2t+1, 2t+8, 2t+9) maps to
// physical k 32q + 8t + 4s + (0..3), the same for A and B, so the product is
// the plain dot product (as in gemv.cu `gemv_tc_body`).
//
// Shared memory is dynamic (its size is `mmq_smem_bytes` below, which the
// host computes the same way, `matmul::mmq_smem_bytes`): two weight stages
// [MMQ_BN][slot] bytes, then two input stages [8 NT][MMQ_XSTRIDE] bf16.
// A staged input row is 576 bytes (256 k and a 64-byte pad), 64 mod 128, so
// the eight lanes of a quarter-warp (rows g, g + 1, four 16-byte columns
// t each) read eight distinct groups of four banks.
//
// The activations come as bf16 (the host rounds them, as for cuBLASLt); the
// products accumulate in f32.

#define MMQ_BN 64
#define MMQ_WARPS 4
#define MMQ_XSTRIDE 288

// Bytes of 256 weights of each format, and the shared-memory slot a row's
// chunk takes: its bytes from the 16-byte boundary at or below their start
// (blocks of 34, 18 or 210 bytes are not 16-byte aligned) to the one above
// their end, made an odd number of 16-byte pieces so that the rows a warp
// decodes together start in different banks.
template <int DT>
struct MmqFmt {
    static const int b256 = DT == DT_Q8_0 ? 272 : DT == DT_Q4_0 ? 144 : DT == DT_Q4_1 ? 160 : DT == DT_Q5_0 ? 176
                          : DT == DT_Q5_1 ? 192 : DT == DT_IQ4_NL ? 144 : DT == DT_Q2_K ? 84 : DT == DT_Q3_K ? 110
                          : DT == DT_Q4_K ? 144 : DT == DT_Q5_K ? 176 : DT == DT_Q6_K ? 210 : 136;
    static const int pieces0 = (b256 + 15) / 16 + 1;
    static const int slot = 16 * (pieces0 | 1);
};

template <int DT, int NT>
__device__ __forceinline__ int mmq_smem_bytes() {
    return 2 * MMQ_BN * MmqFmt<DT>::slot + 2 * 8 * NT * MMQ_XSTRIDE * 2;
}

// The copies of one chunk are issued by every thread with its addresses
// worked out once per block (`MmqStageW`, `MmqStageX`): a chunk then costs a
// thread a few integer operations per 16-byte piece. Worked out per piece
// (divisions, clamps, 64-bit products) they took more instructions than the
// decode and the mma together.
//
// Weights: two threads per row (MMQ_BN = 64 rows, 128 threads), thread
// 2 r + h taking pieces h, h + 2, ... of row r's slot. The pieces of chunk
// kc start at the 16-byte boundary at or below the chunk's first byte. Where
// the row holds all of them (every chunk but a row's last) they are copied
// whole, bytes past the chunk included (the decode reads none of those);
// in the row's last chunk the piece with the chunk's last byte is copied up
// to it (zero-filled after) and those past it are not copied.
template <int DT>
struct MmqStageW {
    const u8* row;  // this thread's row (clamped to the last), plus 16 h
    long long left; // the row's bytes from there on
    int dst;        // its slot's byte offset in a weight stage, plus 16 h
    __device__ __forceinline__ MmqStageW(const u8* __restrict__ w, long long row_bytes, int n, int j0) {
        int r = threadIdx.x >> 1, h = threadIdx.x & 1;
        row = w + (long long)imin(j0 + r, n - 1) * row_bytes + 16 * h;
        left = row_bytes - 16 * h;
        dst = r * MmqFmt<DT>::slot + 16 * h;
    }
    // Chunk kc (a multiple of 256) of kw weights into the stage at `stage`.
    __device__ __forceinline__ void copy(u8* stage, int kc, int kw) const {
        const int pieces = MmqFmt<DT>::slot / 16, mine = (pieces + 1 - (threadIdx.x & 1)) / 2;
        long long off = (long long)(kc / 256) * MmqFmt<DT>::b256;
        const u8* start = row + off;
        int sh = (int)((unsigned long long)start & 15ull);
        const u8* src = start - sh;
        u32 d = smem_u32(stage + dst);
        if (left - off + sh >= 32 * mine - 16) {
#pragma unroll
            for (int v = 0; v < (pieces + 1) / 2; v++)
                if (v < mine) cp_async16(d + 32 * v, src + 32 * v, 16);
        } else {
            int take0 = sh + (kw * MmqFmt<DT>::b256 + 255) / 256 - 16 * (threadIdx.x & 1);
#pragma unroll
            for (int v = 0; v < (pieces + 1) / 2; v++) {
                int take = take0 - 32 * v;
                if (v < mine && take > 0) cp_async16(d + 32 * v, src + 32 * v, imin(take, 16));
            }
        }
    }
};

// Input rows: 32 threads per row (256 k as 16-byte pieces of 8 bf16),
// thread 32 u + i taking piece i of rows u, u + 4, ... of the group's 8 NT.
// Rows past the group's last (`gr` rows, from r0) and pieces past a short
// last chunk (kw a multiple of 8) are not copied: what their slots hold
// reaches only products that are never stored (an output is the dot of one
// input row) or k the decode loop stops before.
template <int NT>
struct MmqStageX {
    const bf16_t* src; // piece i of the group's row u at k = 0
    long long step;    // 4 rows of xb
    int dst, i, live;  // live: how many of this thread's rows (u + 4 v < gr) are the group's
    __device__ __forceinline__ MmqStageX(const bf16_t* __restrict__ xb, int k, int r0, int gr) {
        i = threadIdx.x & 31;
        int u = threadIdx.x >> 5;
        live = u < gr ? (gr - u + 3) / 4 : 0;
        src = xb + (long long)(r0 + u) * k + 8 * i;
        step = 4ll * k;
        dst = (u * MMQ_XSTRIDE + 8 * i) * 2;
    }
    __device__ __forceinline__ void copy(bf16_t* stage, int kc, int kw) const {
        u32 d = smem_u32(stage) + dst;
        const bf16_t* s = src + kc;
        int n = 8 * i < kw ? live : 0;
#pragma unroll
        for (int v = 0; v < 2 * NT; v++, s += step)
            if (v < n) cp_async16(d + 4 * v * MMQ_XSTRIDE * 2, s, 16);
    }
};

// NT: tiles of 8 input rows one group holds; `groups`: the groups of 8 NT
// input rows (blockIdx.x % groups), the last one possibly short.
template <int DT, int NT>
__device__ __forceinline__ void mmq_body(const u8* __restrict__ w, long long row_bytes, const bf16_t* __restrict__ xb,
                                         float* __restrict__ out, int n, int k, int rows, int kslice, int groups) {
    const int slot = MmqFmt<DT>::slot;
    extern __shared__ __align__(16) u8 mmq_smem[];
    u8* raw = mmq_smem;
    bf16_t* xs = (bf16_t*)(mmq_smem + 2 * MMQ_BN * slot);
    const int xstage = 8 * NT * MMQ_XSTRIDE;
#ifdef __CUDA_ARCH__
    // A launch with less shared memory than this layout would write past it.
    u32 have;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < (u32)mmq_smem_bytes<DT, NT>()) __trap();
#endif
    pdl_enter();
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int g = lane >> 2, t = lane & 3;
    int grp = blockIdx.x % groups;
    int jb0 = (blockIdx.x / groups) * MMQ_BN;
    int r0 = grp * 8 * NT, gr = imin(8 * NT, rows - r0);
    int k0 = blockIdx.y * kslice, k1 = imin(k, k0 + kslice);
    // This thread's two weight rows in the slot layout.
    int ra = 16 * wid + g, rb = ra + 8;
    const u8* wa = w + (long long)imin(jb0 + ra, n - 1) * row_bytes;
    const u8* wb = w + (long long)imin(jb0 + rb, n - 1) * row_bytes;
    float c[NT][4];
#pragma unroll
    for (int i = 0; i < NT; i++) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
    const MmqStageW<DT> stage_w(w, row_bytes, n, jb0);
    const MmqStageX<NT> stage_x(xb, k, r0, gr);
    stage_w.copy(raw, k0, imin(256, k1 - k0));
    stage_x.copy(xs, k0, imin(256, k1 - k0));
    cp_async_commit();
    int buf = 0;
    for (int kc = k0; kc < k1; kc += 256, buf ^= 1) {
        int kw = imin(256, k1 - kc);
        if (kc + 256 < k1) {
            int kn = imin(256, k1 - kc - 256);
            stage_w.copy(raw + (buf ^ 1) * MMQ_BN * slot, kc + 256, kn);
            stage_x.copy(xs + (buf ^ 1) * xstage, kc + 256, kn);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        // Where each row's chunk starts past its 16-byte boundary (it moves
        // from chunk to chunk when 256 weights are not whole 16 bytes: Q6_K).
        long long off = (long long)(kc / 256) * MmqFmt<DT>::b256;
        const u8* sa = raw + buf * MMQ_BN * slot + ra * slot + (int)((unsigned long long)(wa + off) & 15ull);
        const u8* sb = raw + buf * MMQ_BN * slot + rb * slot + (int)((unsigned long long)(wb + off) & 15ull);
        const bf16_t* xr = xs + buf * xstage + g * MMQ_XSTRIDE + 8 * t;
        // Unrolled so that each group's sub-block index is a constant and
        // the K-quants' scale unpacking folds to a few shifts.
#pragma unroll
        for (int q = 0; q < 8; q++) {
            if (q >= (kw >> 5)) break;
            u32 pa[4], pb[4];
            deq8_bf16<DT>(sa, 32 * q + 8 * t, pa);
            deq8_bf16<DT>(sb, 32 * q + 8 * t, pb);
            u32 a0 = pa[0], a1 = pa[1], a2 = pa[2], a3 = pa[3];
            u32 b0 = pb[0], b1 = pb[1], b2 = pb[2], b3 = pb[3];
            // Every tile, also those past a short group's rows: their
            // products are never stored, and a predicate per tile cost more
            // than the mma it saved.
            // The first k-step of every tile, then the second: a tile's two
            // mma are dependent (one accumulator), so they are not issued
            // back to back.
            uint4 xv[NT];
#pragma unroll
            for (int i = 0; i < NT; i++) {
                xv[i] = *(const uint4*)(xr + 8 * i * MMQ_XSTRIDE + 32 * q);
                mma_bf16_m16n8k16(c[i], a0, b0, a1, b1, xv[i].x, xv[i].y);
            }
#pragma unroll
            for (int i = 0; i < NT; i++) mma_bf16_m16n8k16(c[i], a2, b2, a3, b3, xv[i].z, xv[i].w);
        }
        __syncthreads(); // every warp is done with this stage before it is refilled
    }
    // c0, c1: weight row g, input rows 2t, 2t + 1 of the tile; c2, c3: weight row g + 8.
    float* o = out + (long long)blockIdx.y * rows * n + (long long)r0 * n;
    int ja = jb0 + ra, jb = jb0 + rb;
#pragma unroll
    for (int i = 0; i < NT; i++) {
        int xr = 8 * i + 2 * t;
        if (ja < n) {
            if (xr < gr) o[(long long)xr * n + ja] = c[i][0];
            if (xr + 1 < gr) o[(long long)(xr + 1) * n + ja] = c[i][1];
        }
        if (jb < n) {
            if (xr < gr) o[(long long)xr * n + jb] = c[i][2];
            if (xr + 1 < gr) o[(long long)(xr + 1) * n + jb] = c[i][3];
        }
    }
}

// MINB: the blocks per SM the register budget must allow, about what shared
// memory allows anyway (left to itself this NVRTC caps some at 128
// registers, where the 64-row groups spill).
#define MMQ(NAME, DT, NT, MINB)                                                                                   \
    extern "C" __global__ void __launch_bounds__(MMQ_WARPS * 32, MINB)                                             \
        mmq_##NAME##_n##NT(const u8* __restrict__ w, long long row_bytes, const bf16_t* __restrict__ xb,          \
                           float* __restrict__ out, int n, int k, int rows, int kslice, int groups) {             \
        mmq_body<DT, NT>(w, row_bytes, xb, out, n, k, rows, kslice, groups);                                      \
    }
// Instantiations for groups of up to 8, 16, 32 and 64 input rows.
#define MMQ_ALL(NAME, DT) MMQ(NAME, DT, 1, 5) MMQ(NAME, DT, 2, 4) MMQ(NAME, DT, 4, 3) MMQ(NAME, DT, 8, 2)
MMQ_ALL(q8_0, DT_Q8_0)
MMQ_ALL(q4_0, DT_Q4_0)
MMQ_ALL(q4_1, DT_Q4_1)
MMQ_ALL(q5_0, DT_Q5_0)
MMQ_ALL(q5_1, DT_Q5_1)
MMQ_ALL(iq4_nl, DT_IQ4_NL)
MMQ_ALL(q2_k, DT_Q2_K)
MMQ_ALL(q3_k, DT_Q3_K)
MMQ_ALL(q4_k, DT_Q4_K)
MMQ_ALL(q5_k, DT_Q5_K)
MMQ_ALL(q6_k, DT_Q6_K)
MMQ_ALL(iq4_xs, DT_IQ4_XS)

// out[i] = the sum over the `slices` K slices of part[s][i], in slice order.
extern "C" __global__ void mmq_reduce(const float* __restrict__ part, float* __restrict__ out, int slices,
                                      long long len) {
    pdl_enter();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < len;
         i += (long long)gridDim.x * blockDim.x) {
        float s = 0.f;
        for (int y = 0; y < slices; y++) s += part[y * len + i];
        out[i] = s;
    }
}
