// Integer decode GEMVs of the ggml block formats: out[r][j] = x[r] . w[j] for
// up to GEMV_MAX_ROWS input rows, from the input rows quantized to 8 bits per
// 32 values (`q8_quantize`: d = max|x| / 127, q = round(x / d), rounding half
// away from zero, exactly the CPU's `quant::Q8Row`), every 4 products of a
// weight code and an activation code taken by one `__dp4a`.
//
// Why: the f32 GEMVs of gemv.cu dequantize every weight and read 4 bytes of
// activation per weight (against 0.56 bytes of a Q4_K weight), so L1 traffic
// and FMAs, not DRAM, are their limit. Here an input row costs 1.25 bytes per
// weight (32 codes and the 8 bytes of (d, d * sum q) per 32) and a quarter of
// an instruction per weight.
//
// Layout. A block of MMVQ_WARPS warps owns NW weight rows; its warps take
// turns over the rows' steps of MMVQ_STEP = 1024 weights (warp w: steps w,
// w + 4, ...) and meet in shared memory at the end (`mmvq_finish`). In a
// step each lane holds 32 weights of each of its NW rows as two halves of 16
// consecutive weights (`MvUnit`), and dots each half with 16 activation codes
// of every input row (one 16-byte load through L1, so a load serves the NW
// weight rows). The halves are placed so that the 32 lanes' loads of one half
// read whole 32-byte sectors: in the 32-weight formats lane l's halves are
// weights 16 l and 512 + 16 l of the step; in the 256-weight formats (4
// super-blocks a step, 8 lanes each) lane 8 s + i's are weights 16 i and
// 128 + 16 i of super-block s, or for Q4_K the two sub-blocks' 16 weights
// whose nibbles share the lane's 16 bytes (`mv_pos`).
//
// Every block format has its kernels here (`Mv`, one specialization a
// format, decoding as cpu/quant.rs `unpack_block` does).
//
// Weights are read once, by streaming loads (gemv.cu `ld_stream`), the next
// step's issued before the current step's arithmetic where registers allow
// (`PF`). Q4_K and Q5_K super-blocks are 16-byte aligned (rows of whole
// super-blocks in a 256-byte aligned arena), so they go straight into
// registers: each lane loads one 16-byte piece of quants per super-block (its
// 8 lanes together the whole 128 bytes), the header its 8 lanes share (one
// sector per instruction) and, for Q5_K, the high bits. A Q4_K lane uses both
// nibbles of its piece; a Q5_K lane needs one nibble of two pieces and swaps
// the other with the lane that loaded its second piece. Every other format is
// only 2-byte aligned: each warp copies its step's bytes of a row as aligned
// 16-byte pieces, contiguous across the lanes, into shared memory and decodes
// from there (`mv_stage_load`, `mv_stage_store`).
//
// Each half's integer dot (at most 16 * 128 * 127 in magnitude) starts from
// the bits of 1.5 * 2^23 (`MMVQ_MAGIC`), so the sum read as a float is
// 1.5 * 2^23 plus the dot exactly, and one subtraction converts it (the
// integer conversion runs at a quarter of the FMA rate). Then
// acc += (d_w * d_x) * dot + m_w * (d_x sum q_x), with d_w and m_w the scale
// and offset of the half's weights (cpu/quant.rs `Block::d` and `Block::m`),
// an offset per 32 weights added by the lane holding their first half (Q2_K's
// per 16: `MV_GROUP_OFFSETS`).

#define MMVQ_WARPS 4
#define MMVQ_STEP 1024
#define MMVQ_MAGIC 0x4B400000

// One lane's 32 weights of one row in one step: two halves of 16, each as
// four words of signed byte codes, a scale and an offset (zero where the
// format has none, or where the other half of the 32 weights adds it).
struct MvUnit {
    int q[2][4];
    float d[2], m[2];
};

// Where half h of `lane` starts in the row, in step t (`Mv::kq`): the
// 32-weight formats (MV_LANES_32) 16 weights a lane across the step; the
// 256-weight formats 8 lanes per super-block, lane i's halves either weights
// 16 i and 128 + 16 i (MV_LANES_KQ) or, where a lane holds one 16-byte
// piece of nibbles (MV_LANES_PIECE: piece i's low nibbles are weights
// 64 (i / 2) + 16 (i % 2) .. + 15 and its high ones the 16 at 32 past them),
// those two.
#define MV_LANES_32 0
#define MV_LANES_KQ 1
#define MV_LANES_PIECE 2
template <int L>
__device__ __forceinline__ int mv_pos(int t, int lane, int h) {
    int i = lane & 7, sb = t * MMVQ_STEP + 256 * (lane >> 3);
    if (L == MV_LANES_PIECE) return sb + 64 * (i >> 1) + 16 * (i & 1) + 32 * h;
    return L == MV_LANES_KQ ? sb + 128 * h + 16 * i : t * MMVQ_STEP + 512 * h + 16 * lane;
}

__device__ __forceinline__ uint4 mv_zero4() { return make_uint4(0u, 0u, 0u, 0u); }

// Per byte x - o (o: the same offset in every byte, x below 128 + o): the
// centred codes of Q4_0, Q5_0 and Q6_K as signed bytes. Adding 128 - o never
// carries out of a byte, and flipping the top bit subtracts 128 modulo 256.
__device__ __forceinline__ int mv_less(u32 x, u32 o) { return (int)((x + (0x80808080u - o)) ^ 0x80808080u); }

// The fifth bits of four weights as 0x10 in their bytes, from four bits.
__device__ __forceinline__ u32 mv_fifth(u32 bits4) { return ((bits4 * 0x00204081u) & 0x01010101u) << 4; }

// Four IQ4 nibble codes (one per byte) to their levels (common.cu kIQ4Levels)
// by byte permutes: the low three bits pick within each half of the table,
// the fourth bit which half.
__device__ __forceinline__ int mv_iq4(u32 x) {
    const u32 t0 = 0xBFAD9881u, t1 = 0xF6EADDCFu, t2 = 0x26190D01u, t3 = 0x71594535u;
    u32 y = x & 0x07070707u;
    u32 sel = __byte_perm(y | (y >> 4), 0u, 0x0020u);
    u32 lo = __byte_perm(t0, t1, sel), hi = __byte_perm(t2, t3, sel);
    u32 hi_mask = ((x >> 3) & 0x01010101u) * 0xffu;
    return (int)((hi & hi_mask) | (lo & ~hi_mask));
}

// The stage of one row's step in shared memory, read at byte offsets: words
// at 2-byte aligned offsets (read as the aligned words around them and
// shifted), halves and bytes.
__device__ __forceinline__ void mv_words(const u32* st, int off, u32 (&w)[4]) {
    const u32* a = st + (off >> 2);
    int sh = (off & 3) * 8;
    u32 v0 = a[0], v1 = a[1], v2 = a[2], v3 = a[3], v4 = a[4];
    w[0] = __funnelshift_r(v0, v1, sh);
    w[1] = __funnelshift_r(v1, v2, sh);
    w[2] = __funnelshift_r(v2, v3, sh);
    w[3] = __funnelshift_r(v3, v4, sh);
}
__device__ __forceinline__ unsigned short mv_half(const u32* st, int off) {
    return ((const unsigned short*)st)[off >> 1];
}
__device__ __forceinline__ int mv_byte(const u32* st, int off) { return ((const u8*)st)[off]; }

// A staged format's raw registers: P aligned 16-byte pieces and where the
// step starts in the first one.
template <int P>
struct MvPieces {
    uint4 p[P];
    int sh;
};

// Where step t of a row of `row_bytes` bytes lies: the 16-byte boundary at
// or below its start (`base`), how far past it the step starts (`sh`) and
// the 16-byte pieces from there that hold the step's bytes (`pieces`; a
// row's last step may be short).
struct MvSpan {
    const uint4* base;
    int sh, pieces;
};
__device__ __forceinline__ MvSpan mv_span(const u8* row, long long row_bytes, int t, int step_bytes) {
    long long off = (long long)t * step_bytes;
    long long left = row_bytes - off;
    int bytes = left < step_bytes ? (int)left : step_bytes;
    const u8* a = row + off;
    int sh = (int)((unsigned long long)a & 15ull);
    return {(const uint4*)(a - sh), sh, (sh + bytes + 15) >> 4};
}

// Load step t of a row: every piece of its span (`mv_span`), lane l taking
// pieces l, l + 32, ...; pieces past the row's end are not read.
template <int P, int STEP_BYTES>
__device__ __forceinline__ void mv_stage_load(const u8* row, long long row_bytes, int t, int lane, MvPieces<P>& r) {
    MvSpan sp = mv_span(row, row_bytes, t, STEP_BYTES);
    r.sh = sp.sh;
#pragma unroll
    for (int u = 0; u < P; u++) {
        int p = lane + 32 * u;
        r.p[u] = p < sp.pieces ? ld_stream(sp.base + p) : mv_zero4();
    }
}

// Store the pieces to the warp's stage for this row (PIECES slots) once every
// lane is done reading the previous step there, and wait for the whole warp's.
template <int P, int PIECES>
__device__ __forceinline__ void mv_stage_store(const MvPieces<P>& r, u32* st, int lane) {
    __syncwarp();
#pragma unroll
    for (int u = 0; u < P; u++) {
        int p = lane + 32 * u;
        if (p < PIECES) ((uint4*)st)[p] = r.p[u];
    }
    __syncwarp();
}


// How a format's weights carry an offset, the m * sum x term of a dot (as
// cpu/quant.rs `Offsets`): none; one per 32 weights (Q4_1, Q5_1, Q4_K, Q5_K),
// against the activation block's d * sum q, added by the lane of the first
// half; one per 16 (Q2_K), against the half's own sum of codes, which one
// more `dp4a` chain per input row takes.
#define MV_NO_OFFSETS 0
#define MV_BLOCK_OFFSETS 1
#define MV_GROUP_OFFSETS 2

// What a format tells the body: `staged` (decoded from shared memory) and
// its stage's size in words, `kq` (the 256-weight lane layout of `mv_pos`),
// `offsets` (`MV_*_OFFSETS`), its raw registers `Raw`,
// `load` (step t of a row into them) and `decode` (them into the lane's
// `MvUnit`, every lane of the warp together: shuffles or the stage).
template <int DT>
struct Mv;

// A format staged through shared memory: steps of BYTES bytes, decoded by
// D::decode_st from the stage of the step's bytes (which start `sh` bytes
// into it).
template <int BYTES, class D>
struct MvStaged {
    static const bool staged = true;
    static const int step_bytes = BYTES;
    static const int pieces = (BYTES + 30) / 16, loads = (pieces + 31) / 32;
    // The pieces and 16 bytes more: a word read at the last bytes may take
    // the aligned word after them.
    static const int stage_words = pieces * 4 + 4;
    typedef MvPieces<loads> Raw;
    static __device__ __forceinline__ void load(const u8* row, long long row_bytes, int t, int lane, int, Raw& r) {
        mv_stage_load<loads, BYTES>(row, row_bytes, t, lane, r);
    }
    static __device__ __forceinline__ void store(const Raw& r, u32* st, int lane) {
        mv_stage_store<loads, pieces>(r, st, lane);
    }
    static __device__ __forceinline__ void decode(const Raw& r, u32* st, int lane, MvUnit& u) {
        store(r, st, lane);
        D::decode_st(st, r.sh, lane, u);
    }
};

// The 16-byte aligned K-quants, loaded into registers. Lane 8 s + i of a
// step (super-block s) holds sub-blocks i / 2 and 4 + i / 2 (its halves 0
// and 1, weights 16 (i % 2) .. + 15 of each). Chunk c of the quants (32
// bytes) holds sub-block 2 c in its low nibbles and 2 c + 1 in its high ones,
// so lanes i and i ^ 2 need the same two 16-byte pieces, 2 (i / 4) + i % 2
// and the one 4 after it, at nibble (i / 2) % 2 and its other: each loads
// one (`kq4_piece`) and they swap what the other needs.
__device__ __forceinline__ int kq4_piece(int i) { return 2 * (i >> 2) + (i & 1) + 4 * ((i >> 1) & 1); }

__device__ __forceinline__ void kq4_nibbles(const uint4& q, int i, MvUnit& u) {
    int n = (i >> 1) & 1;
    u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int m = 0; m < 4; m++) {
        u32 keep = (w[m] >> (4 * n)) & 0x0f0f0f0fu;
        u32 send = (w[m] >> (4 - 4 * n)) & 0x0f0f0f0fu;
        u32 got = __shfl_xor_sync(0xffffffffu, send, 2);
        u.q[0][m] = (int)(n ? got : keep);
        u.q[1][m] = (int)(n ? keep : got);
    }
}

// The scale and offset of Q4_K / Q5_K sub-block j (0..7) from the header
// (d, dmin, 12 bytes of 6-bit scales and mins laid out as cpu/quant.rs
// `k4_scale_min` reads them), the offset only where `first` (the lane of the
// sub-block's first 16 weights).
__device__ __forceinline__ void kq4_scale(const uint4& h, int j, bool first, float& d, float& m) {
    int s = j & 3;
    u32 by = h.y >> (8 * s), bz = h.z >> (8 * s), bw = h.w >> (8 * s);
    bool low = j < 4;
    int sc = low ? (int)(by & 63u) : (int)((bw & 15u) | ((by >> 2) & 48u));
    int mn = low ? (int)(bz & 63u) : (int)(((bw >> 4) & 15u) | ((bz >> 2) & 48u));
    d = f16_to_f32((unsigned short)(h.x & 0xffffu)) * (float)sc;
    m = first ? -f16_to_f32((unsigned short)(h.x >> 16)) * (float)mn : 0.f;
}

// Q5_K's lane i: sub-blocks i / 2 and 4 + i / 2 (its halves 0 and 1).
__device__ __forceinline__ void kq4_scales(const uint4& h, int i, MvUnit& u) {
    bool first = (i & 1) == 0;
    kq4_scale(h, i >> 1, first, u.d[0], u.m[0]);
    kq4_scale(h, 4 + (i >> 1), first, u.d[1], u.m[1]);
}

// Q4_K (144 bytes: d, dmin, 12 scale bytes, 128 bytes of quants). Lane
// 8 s + i loads piece i of super-block s's quants (its 8 lanes read the 128
// bytes whole) and keeps both nibbles of every byte (MV_LANES_PIECE): the
// low ones are half 0, 16 weights of sub-block 2 (i / 2), the high ones half
// 1, the same 16 of sub-block 2 (i / 2) + 1; no lane needs another's bytes.
template <>
struct Mv<DT_Q4_K> {
    static const bool staged = false;
    static const int kq = MV_LANES_PIECE;
    static const int offsets = MV_BLOCK_OFFSETS;
    static const int stage_words = 4;
    struct Raw {
        uint4 h, q;
    };
    static __device__ __forceinline__ void load(const u8* row, long long, int t, int lane, int k, Raw& r) {
        int sb = 4 * t + (lane >> 3);
        const u8* b = row + (long long)sb * 144;
        bool live = sb < (k >> 8);
        r.h = live ? ld_stream((const uint4*)b) : mv_zero4();
        r.q = live ? ld_stream((const uint4*)(b + 16) + (lane & 7)) : mv_zero4();
    }
    static __device__ __forceinline__ void decode(const Raw& r, u32*, int lane, MvUnit& u) { unit(r.h, r.q, lane, u); }
    // From a stage of whole super-blocks (sh is 0: the rows are 16-byte aligned).
    static __device__ __forceinline__ void decode_st(const u32* st, int sh, int lane, MvUnit& u) {
        const uint4* b = (const uint4*)st + ((sh + 144 * (lane >> 3)) >> 4);
        unit(b[0], b[1 + (lane & 7)], lane, u);
    }
    static __device__ __forceinline__ void unit(const uint4& h, const uint4& q, int lane, MvUnit& u) {
        u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int m = 0; m < 4; m++) {
            u.q[0][m] = (int)(w[m] & 0x0f0f0f0fu);
            u.q[1][m] = (int)((w[m] >> 4) & 0x0f0f0f0fu);
        }
        int i = lane & 7, j = 2 * (i >> 1);
        bool first = (i & 1) == 0;
        kq4_scale(h, j, first, u.d[0], u.m[0]);
        kq4_scale(h, j + 1, first, u.d[1], u.m[1]);
    }
    static const int step_bytes = 4 * 144;
};

// Q5_K (176 bytes: Q4_K's header, 32 bytes of high bits, then the quants):
// the fifth bit of weight 32 s + l is bit s of qh[l], so both halves of a
// lane take the same 16 bytes of qh (piece i % 2), bits s and s + 4.
template <>
struct Mv<DT_Q5_K> {
    static const bool staged = false, kq = true;
    static const int offsets = MV_BLOCK_OFFSETS;
    static const int stage_words = 4;
    struct Raw {
        uint4 h, qh, q;
    };
    static __device__ __forceinline__ void load(const u8* row, long long, int t, int lane, int k, Raw& r) {
        int sb = 4 * t + (lane >> 3), i = lane & 7;
        const u8* b = row + (long long)sb * 176;
        bool live = sb < (k >> 8);
        r.h = live ? ld_stream((const uint4*)b) : mv_zero4();
        r.qh = live ? ld_stream((const uint4*)(b + 16) + (i & 1)) : mv_zero4();
        r.q = live ? ld_stream((const uint4*)(b + 48) + kq4_piece(i)) : mv_zero4();
    }
    static __device__ __forceinline__ void decode(const Raw& r, u32*, int lane, MvUnit& u) {
        unit(r.h, r.qh, r.q, lane, u);
    }
    // From a stage of whole super-blocks (sh is 0: the rows are 16-byte aligned).
    static __device__ __forceinline__ void decode_st(const u32* st, int sh, int lane, MvUnit& u) {
        int i = lane & 7;
        const uint4* b = (const uint4*)st + ((sh + 176 * (lane >> 3)) >> 4);
        unit(b[0], b[1 + (i & 1)], b[3 + kq4_piece(i)], lane, u);
    }
    static __device__ __forceinline__ void unit(const uint4& h, const uint4& qhv, const uint4& q, int lane,
                                                MvUnit& u) {
        int i = lane & 7, s = i >> 1;
        kq4_nibbles(q, i, u);
        u32 qh[4] = {qhv.x, qhv.y, qhv.z, qhv.w};
#pragma unroll
        for (int m = 0; m < 4; m++) {
            u.q[0][m] |= (int)(((qh[m] >> s) & 0x01010101u) << 4);
            u.q[1][m] |= (int)(((qh[m] >> (s + 4)) & 0x01010101u) << 4);
        }
        kq4_scales(h, i, u);
    }
    static const int step_bytes = 4 * 176;
};

// Q6_K (210 bytes: ql[128], qh[64], 16 i8 scales, d). Half h of lane 8 s + i
// is weights 128 h + 16 i .. + 15 of super-block s: nibble i / 4 of
// ql[64 h + 16 (i % 4) ..] below bits 2 (i / 2) of qh[32 h + 16 (i % 2) ..],
// minus 32, group scale scales[8 h + i] * d.
template <>
struct Mv<DT_Q6_K> : MvStaged<4 * 210, Mv<DT_Q6_K>> {
    static const bool kq = true;
    static const int offsets = MV_NO_OFFSETS;
    static __device__ __forceinline__ void decode_st(const u32* st, int sh, int lane, MvUnit& u) {
        int i = lane & 7, b = sh + 210 * (lane >> 3);
        float d = f16_to_f32(mv_half(st, b + 208));
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 lw[4], hw[4];
            mv_words(st, b + 64 * h + 16 * (i & 3), lw);
            mv_words(st, b + 128 + 32 * h + 16 * (i & 1), hw);
#pragma unroll
            for (int m = 0; m < 4; m++) {
                u32 lo = (lw[m] >> (4 * (i >> 2))) & 0x0f0f0f0fu, hi = (hw[m] >> (2 * (i >> 1))) & 0x03030303u;
                u.q[h][m] = mv_less(lo | (hi << 4), 0x20202020u);
            }
            u.d[h] = d * (float)(signed char)mv_byte(st, b + 192 + 8 * h + i);
            u.m[h] = 0.f;
        }
    }
};

// IQ4_XS (136 bytes: d, u16 of high scale bits, 4 bytes of low scale
// nibbles, 16 bytes of quants per sub-block, weight 32 s + j the low nibble
// of byte 16 s + j and 32 s + 16 + j the high one). Half h of lane 8 s + i:
// sub-block 4 h + i / 2, nibble i % 2.
template <>
struct Mv<DT_IQ4_XS> : MvStaged<4 * 136, Mv<DT_IQ4_XS>> {
    static const bool kq = true;
    static const int offsets = MV_NO_OFFSETS;
    static __device__ __forceinline__ void decode_st(const u32* st, int sh, int lane, MvUnit& u) {
        int i = lane & 7, b = sh + 136 * (lane >> 3);
        float d = f16_to_f32(mv_half(st, b));
        u32 high = mv_half(st, b + 2);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int sub = 4 * h + (i >> 1);
            u32 w[4];
            mv_words(st, b + 8 + 16 * sub, w);
#pragma unroll
            for (int m = 0; m < 4; m++) u.q[h][m] = mv_iq4((w[m] >> (4 * (i & 1))) & 0x0f0f0f0fu);
            int low = (mv_byte(st, b + 4 + (sub >> 1)) >> (4 * (sub & 1))) & 15;
            int ls = low | (int)(((high >> (2 * sub)) & 3u) << 4);
            u.d[h] = d * (float)(ls - 32);
            u.m[h] = 0.f;
        }
    }
};

// Q2_K (84 bytes: 16 bytes of group scales, the low nibble the scale (x d)
// and the high one the min (x dmin, subtracted), 64 bytes of 2-bit quants,
// d, dmin; weight 128 h + 32 j + l bits 2 j of qs[32 h + l]). Half h of lane
// 8 s + i is group 8 h + i: bits 2 (i / 2) of qs[32 h + 16 (i % 2) ..].
template <>
struct Mv<DT_Q2_K> : MvStaged<4 * 84, Mv<DT_Q2_K>> {
    static const bool kq = true;
    static const int offsets = MV_GROUP_OFFSETS;
    static __device__ __forceinline__ void decode_st(const u32* st, int sh, int lane, MvUnit& u) {
        int i = lane & 7, b = sh + 84 * (lane >> 3);
        float d = f16_to_f32(mv_half(st, b + 80)), dmin = f16_to_f32(mv_half(st, b + 82));
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 w[4];
            mv_words(st, b + 16 + 32 * h + 16 * (i & 1), w);
#pragma unroll
            for (int m = 0; m < 4; m++) u.q[h][m] = (int)((w[m] >> (2 * (i >> 1))) & 0x03030303u);
            int sc = mv_byte(st, b + 8 * h + i);
            u.d[h] = d * (float)(sc & 15);
            u.m[h] = -dmin * (float)(sc >> 4);
        }
    }
};

// Q3_K (110 bytes: 32 bytes of high bits, 64 of 2-bit quants as Q2_K's, 12
// bytes of 6-bit group scales, d; a weight's code is its two bits, less 4
// unless bit 4 h + j of hmask[l] is set; the scales as cpu/quant.rs
// `q3k_scale` reads them, less 32). Half h of lane 8 s + i: group 8 h + i,
// high bits from hmask[16 (i % 2) ..].
template <>
struct Mv<DT_Q3_K> : MvStaged<4 * 110, Mv<DT_Q3_K>> {
    static const bool kq = true;
    static const int offsets = MV_NO_OFFSETS;
    static __device__ __forceinline__ void decode_st(const u32* st, int sh, int lane, MvUnit& u) {
        int i = lane & 7, j = i >> 1, b = sh + 110 * (lane >> 3);
        float d = f16_to_f32(mv_half(st, b + 108));
        u32 hm[4];
        mv_words(st, b + 16 * (i & 1), hm);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 w[4];
            mv_words(st, b + 32 + 32 * h + 16 * (i & 1), w);
#pragma unroll
            for (int m = 0; m < 4; m++) {
                u32 low = (w[m] >> (2 * j)) & 0x03030303u, high = (hm[m] >> (4 * h + j)) & 0x01010101u;
                u.q[h][m] = mv_less(low | (high << 2), 0x04040404u);
            }
            int g = 8 * h + i;
            int lo = (mv_byte(st, b + 96 + (g & 7)) >> (4 * (g >> 3))) & 15;
            int hi = (mv_byte(st, b + 104 + (g & 3)) >> (2 * (g >> 2))) & 3;
            u.d[h] = d * (float)((lo | (hi << 4)) - 32);
            u.m[h] = 0.f;
        }
    }
};

// The 32-weight formats, staged: half h of lane l is weights 16 (l % 2) ..
// + 15 of block 16 h + l / 2 of the step (`mv_block`: its byte offset in the
// stage). In the nibble formats byte j of a block's 16 holds weight j (low
// nibble) and j + 16 (high), so half l % 2 takes nibble l % 2 of all 16.
template <int BYTES, class D>
struct MvBlock32 : MvStaged<32 * BYTES, D> {
    static const bool kq = false;
    static __device__ __forceinline__ int block(int sh, int lane, int h) { return sh + BYTES * (16 * h + (lane >> 1)); }
};

// Nibble j of each byte of w, in place.
__device__ __forceinline__ void mv_nibbles(u32 (&w)[4], int j) {
#pragma unroll
    for (int m = 0; m < 4; m++) w[m] = (w[m] >> (4 * j)) & 0x0f0f0f0fu;
}

// The fifth bits of weights 16 j + 4 m .. + 3 (word m of half j) from a
// block's u32 of high bits, into w.
__device__ __forceinline__ void mv_add_fifth(u32 (&w)[4], u32 qh, int j) {
#pragma unroll
    for (int m = 0; m < 4; m++) w[m] |= mv_fifth((qh >> (16 * j + 4 * m)) & 15u);
}

// Q8_0: d, 32 i8.
template <>
struct Mv<DT_Q8_0> : MvBlock32<34, Mv<DT_Q8_0>> {
    static const int offsets = MV_NO_OFFSETS;
    static __device__ __forceinline__ void decode_st(const u32* st, int sh, int lane, MvUnit& u) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int b = block(sh, lane, h);
            u32 w[4];
            mv_words(st, b + 2 + 16 * (lane & 1), w);
#pragma unroll
            for (int m = 0; m < 4; m++) u.q[h][m] = (int)w[m];
            u.d[h] = f16_to_f32(mv_half(st, b));
            u.m[h] = 0.f;
        }
    }
};

// Q4_0: d, 16 bytes of nibbles, codes q - 8.
template <>
struct Mv<DT_Q4_0> : MvBlock32<18, Mv<DT_Q4_0>> {
    static const int offsets = MV_NO_OFFSETS;
    static __device__ __forceinline__ void decode_st(const u32* st, int sh, int lane, MvUnit& u) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int b = block(sh, lane, h);
            u32 w[4];
            mv_words(st, b + 2, w);
            mv_nibbles(w, lane & 1);
#pragma unroll
            for (int m = 0; m < 4; m++) u.q[h][m] = mv_less(w[m], 0x08080808u);
            u.d[h] = f16_to_f32(mv_half(st, b));
            u.m[h] = 0.f;
        }
    }
};

// Q4_1: d, m, 16 bytes of nibbles; weight d q + m.
template <>
struct Mv<DT_Q4_1> : MvBlock32<20, Mv<DT_Q4_1>> {
    static const int offsets = MV_BLOCK_OFFSETS;
    static __device__ __forceinline__ void decode_st(const u32* st, int sh, int lane, MvUnit& u) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int b = block(sh, lane, h);
            u32 w[4];
            mv_words(st, b + 4, w);
            mv_nibbles(w, lane & 1);
#pragma unroll
            for (int m = 0; m < 4; m++) u.q[h][m] = (int)w[m];
            u.d[h] = f16_to_f32(mv_half(st, b));
            u.m[h] = (lane & 1) ? 0.f : f16_to_f32(mv_half(st, b + 2));
        }
    }
};

// Q5_0: d, u32 of fifth bits (bit i for weight i), 16 bytes of nibbles, codes q - 16.
template <>
struct Mv<DT_Q5_0> : MvBlock32<22, Mv<DT_Q5_0>> {
    static const int offsets = MV_NO_OFFSETS;
    static __device__ __forceinline__ void decode_st(const u32* st, int sh, int lane, MvUnit& u) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int b = block(sh, lane, h);
            u32 w[4];
            u32 qh = (u32)mv_half(st, b + 2) | ((u32)mv_half(st, b + 4) << 16);
            mv_words(st, b + 6, w);
            mv_nibbles(w, lane & 1);
            mv_add_fifth(w, qh, lane & 1);
#pragma unroll
            for (int m = 0; m < 4; m++) u.q[h][m] = mv_less(w[m], 0x10101010u);
            u.d[h] = f16_to_f32(mv_half(st, b));
            u.m[h] = 0.f;
        }
    }
};

// Q5_1: d, m, u32 of fifth bits, 16 bytes of nibbles; weight d q + m.
template <>
struct Mv<DT_Q5_1> : MvBlock32<24, Mv<DT_Q5_1>> {
    static const int offsets = MV_BLOCK_OFFSETS;
    static __device__ __forceinline__ void decode_st(const u32* st, int sh, int lane, MvUnit& u) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int b = block(sh, lane, h);
            u32 w[4];
            u32 qh = (u32)mv_half(st, b + 4) | ((u32)mv_half(st, b + 6) << 16);
            mv_words(st, b + 8, w);
            mv_nibbles(w, lane & 1);
            mv_add_fifth(w, qh, lane & 1);
#pragma unroll
            for (int m = 0; m < 4; m++) u.q[h][m] = (int)w[m];
            u.d[h] = f16_to_f32(mv_half(st, b));
            u.m[h] = (lane & 1) ? 0.f : f16_to_f32(mv_half(st, b + 2));
        }
    }
};

// IQ4_NL: Q4_0's layout, codes the levels of the nibbles.
template <>
struct Mv<DT_IQ4_NL> : MvBlock32<18, Mv<DT_IQ4_NL>> {
    static const int offsets = MV_NO_OFFSETS;
    static __device__ __forceinline__ void decode_st(const u32* st, int sh, int lane, MvUnit& u) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int b = block(sh, lane, h);
            u32 w[4];
            mv_words(st, b + 2, w);
            mv_nibbles(w, lane & 1);
#pragma unroll
            for (int m = 0; m < 4; m++) u.q[h][m] = mv_iq4(w[m]);
            u.d[h] = f16_to_f32(mv_half(st, b));
            u.m[h] = 0.f;
        }
    }
};

// Row i of the block's group g: groups of NW consecutive rows from j0 of
// `w`, or with `glu` `groups` groups of gate rows (`w`) and then as many of
// up rows (`up`) for the same output columns. Rows past the matrix's `n`
// read its last row again (their results are dropped).
__device__ __forceinline__ const u8* mv_row(const u8* w, const u8* up, long long row_bytes, int glu, int groups,
                                            int j0, int n, int nw, int g, int i) {
    bool is_up = glu && g >= groups;
    int j = imin(j0 + (is_up ? g - groups : g) * nw + i, n - 1);
    return (is_up ? up : w) + (long long)j * row_bytes;
}

// One unit's products: the lane's halves of the NW rows' step t (`mu`)
// against every input row, into acc.
template <class F, int R, int NW>
__device__ __forceinline__ void mv_accumulate(const MvUnit (&mu)[NW], int t, int lane, const signed char* __restrict__ xq,
                                              const float2* __restrict__ xs, int k, int rows, float (&acc)[R][NW]) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int pos = mv_pos<(int)F::kq>(t, lane, h);
        if (pos < k) {
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r < rows) {
                    int4 a = __ldg((const int4*)(xq + (long long)r * k + pos));
                    float2 sx = __ldg(xs + (long long)r * (k >> 5) + (pos >> 5));
                    // The half's sum of activation codes, for offsets per 16.
                    float sq = 0.f;
                    if (F::offsets == MV_GROUP_OFFSETS) {
                        int s = __dp4a(0x01010101, a.x, MMVQ_MAGIC);
                        s = __dp4a(0x01010101, a.y, s);
                        s = __dp4a(0x01010101, a.z, s);
                        s = __dp4a(0x01010101, a.w, s);
                        sq = (__int_as_float(s) - 12582912.f) * sx.x;
                    }
#pragma unroll
                    for (int i = 0; i < NW; i++) {
                        int dot = __dp4a(mu[i].q[h][0], a.x, MMVQ_MAGIC);
                        dot = __dp4a(mu[i].q[h][1], a.y, dot);
                        dot = __dp4a(mu[i].q[h][2], a.z, dot);
                        dot = __dp4a(mu[i].q[h][3], a.w, dot);
                        float f = __int_as_float(dot) - 12582912.f;
                        float v = fmaf(mu[i].d[h] * sx.x, f, acc[r][i]);
                        if (F::offsets == MV_BLOCK_OFFSETS) v = fmaf(mu[i].m[h], sx.y, v);
                        if (F::offsets == MV_GROUP_OFFSETS) v = fmaf(mu[i].m[h], sq, v);
                        acc[r][i] = v;
                    }
                }
            }
        }
    }
}

// The warp is done with group g: its partial sums to `red`, acc back to zero.
template <int R, int NW, int MAXG>
__device__ __forceinline__ void mv_flush(float (&acc)[R][NW], float (*red)[MAXG][R * NW], int wid, int g,
                                         int rows) {
    warp_sums_store<R, NW>(acc, red[wid][g], rows);
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int i = 0; i < NW; i++) acc[r][i] = 0.f;
}

// What a warp's unit loop needs: the block's rows (`mv_row`), the input
// rows, the units (`units` of `steps` steps each group) and where the
// partial sums of each group go.
template <int R, int NW, int MAXG>
struct MvWork {
    const u8 *w, *up;
    long long row_bytes;
    int glu, groups, j0, n;
    const signed char* __restrict__ xq;
    const float2* __restrict__ xs;
    int k, rows, units, steps, early;
    float (*red)[MAXG][R * NW];
    __device__ __forceinline__ const u8* row(int g, int i) const {
        return mv_row(w, up, row_bytes, glu, groups, j0, n, NW, g, i);
    }
};

// The unit loop with the weights in registers. PF: the next unit's weights
// are loaded before this unit's arithmetic (more registers: off where R x NW
// accumulators already take many). `early`: the first unit's weights are
// loaded before `pdl_enter`, as in gemv.cu `gemv_bf16_acc` (weights are
// written by no kernel).
template <class F, int R, int NW, bool PF, int MAXG>
__device__ __forceinline__ void mv_reg_loop(const MvWork<R, NW, MAXG>& wk) {
    __shared__ __align__(16) u32 stage[MMVQ_WARPS][NW][F::stage_words];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    int units = wk.units, steps = wk.steps;
    float acc[R][NW];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int i = 0; i < NW; i++) acc[r][i] = 0.f;
    int u = wid, g = u / steps, t = u - g * steps;
    typename F::Raw raw[NW];
    if (!wk.early) pdl_enter();
    if (u < units) {
#pragma unroll
        for (int i = 0; i < NW; i++) F::load(wk.row(g, i), wk.row_bytes, t, lane, wk.k, raw[i]);
    }
    if (wk.early) pdl_enter();
    while (u < units) {
        MvUnit mu[NW];
#pragma unroll
        for (int i = 0; i < NW; i++) F::decode(raw[i], stage[wid][i], lane, mu[i]);
        int u2 = u + MMVQ_WARPS, g2 = g, t2 = t + MMVQ_WARPS;
        while (t2 >= steps) t2 -= steps, g2++;
        if (PF && u2 < units) {
#pragma unroll
            for (int i = 0; i < NW; i++) F::load(wk.row(g2, i), wk.row_bytes, t2, lane, wk.k, raw[i]);
        }
        mv_accumulate<F, R, NW>(mu, t, lane, wk.xq, wk.xs, wk.k, wk.rows, acc);
        if (!PF && u2 < units) {
#pragma unroll
            for (int i = 0; i < NW; i++) F::load(wk.row(g2, i), wk.row_bytes, t2, lane, wk.k, raw[i]);
        }
        if (u2 >= units || g2 != g) mv_flush<R, NW, MAXG>(acc, wk.red, wid, g, wk.rows);
        u = u2, g = g2, t = t2;
    }
}

// Words of one row's step in a pipelined stage: its bytes from the 16-byte
// boundary at or below their start (2-byte aligned rows: up to 14 bytes
// before), and 16 bytes more for the word reads of `mv_words`.
template <class F>
struct MvRing {
    static const int words = (F::step_bytes + 30) / 16 * 4 + 4;
};

// Unit u's weights (its NW rows' step) copied into `slot` by cp.async, one
// commit group whether or not u is a unit: pieces past a row's end are
// zeros, read from nowhere.
template <class F, int R, int NW, int MAXG>
__device__ __forceinline__ void mv_pipe_issue(const MvWork<R, NW, MAXG>& wk, int u, u32 (*slot)[MvRing<F>::words],
                                              int lane) {
    const int most = (MvRing<F>::words - 4) / 4;
    if (u < wk.units) {
        int g = u / wk.steps, t = u - g * wk.steps;
#pragma unroll
        for (int i = 0; i < NW; i++) {
            MvSpan sp = mv_span(wk.row(g, i), wk.row_bytes, t, F::step_bytes);
            u32 dst = smem_u32(slot[i]);
            for (int p = lane; p < most; p += 32) cp_async16(dst + 16 * p, sp.base + p, p < sp.pieces ? 16 : 0);
        }
    }
    cp_async_commit();
}

// The unit loop with the weights copied S - 1 units ahead into a ring of S
// stages a warp (cp.async), so that a warp keeps about S - 1 units of bytes
// in flight without holding them in registers: at one input row a unit of
// two Q4_K rows is 1,152 bytes, and the register loop (at most two units in
// flight, 64 registers a thread for 8 blocks an SM) leaves the one-row
// GEMVs bound by memory latency, not bandwidth (an H200 ran them no faster
// than an H100). Each unit's stage is decoded as the staged formats decode
// theirs (`decode_st`), then freed for the unit S - 1 further on.
template <class F, int R, int NW, int S, int MAXG>
__device__ __forceinline__ void mv_pipe_loop(const MvWork<R, NW, MAXG>& wk) {
    __shared__ __align__(16) u32 ring[MMVQ_WARPS][S][NW][MvRing<F>::words];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    float acc[R][NW];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int i = 0; i < NW; i++) acc[r][i] = 0.f;
    if (!wk.early) pdl_enter();
#pragma unroll
    for (int s = 0; s < S - 1; s++) mv_pipe_issue<F>(wk, wid + MMVQ_WARPS * s, ring[wid][s], lane);
    if (wk.early) pdl_enter();
    for (int u = wid, c = 0; u < wk.units; u += MMVQ_WARPS, c = c + 1 == S ? 0 : c + 1) {
        // The stage this warp freed last: unit u + (S - 1) warps' turns.
        mv_pipe_issue<F>(wk, u + MMVQ_WARPS * (S - 1), ring[wid][c == 0 ? S - 1 : c - 1], lane);
        cp_async_wait<S - 1>();
        __syncwarp();
        int g = u / wk.steps, t = u - g * wk.steps;
        MvUnit mu[NW];
#pragma unroll
        for (int i = 0; i < NW; i++)
            F::decode_st(ring[wid][c][i], mv_span(wk.row(g, i), wk.row_bytes, t, F::step_bytes).sh, lane, mu[i]);
        // Every lane is done with the stage before the next turn refills it.
        __syncwarp();
        mv_accumulate<F, R, NW>(mu, t, lane, wk.xq, wk.xs, wk.k, wk.rows, acc);
        int u2 = u + MMVQ_WARPS;
        if (u2 >= wk.units || u2 / wk.steps != g) mv_flush<R, NW, MAXG>(acc, wk.red, wid, g, wk.rows);
    }
    cp_async_wait<0>();
}

// out[r][j] = x[r] . w[j], x given as `xq` (i8 codes [rows][k]) and `xs`
// ((d, d * sum q) [rows][k / 32]) of `q8_quantize`.
//
// A block reads `groups` groups of NW weight rows (MAXG at most). Its warps
// take the (group, step) units of those rows in turn, warp w units w,
// w + MMVQ_WARPS, ... of the groups' steps laid end to end, so a warp streams
// from one group into the next without waiting: the host picks `groups` so
// that the blocks are about as many as the card holds at once
// (`matmul::mmvq_groups`), and each warp keeps its loads in flight across
// the rows of its block. A warp's partial sums of a group go to shared
// memory when it moves on (each warp reaches a group's units in one run), and
// are added there in warp order: the result does not depend on timing.
//
// One launch serves up to three matrices of one input (a layer's q, k and v:
// `w0..w2`, outputs `o0..o2` with optional biases `b0..b2`, `n0..n2` rows
// each; the blocks of each part follow the part before), or with `glu` a
// layer's gate (`w0`) and up (`w1`) projections of `n0` rows: the block then
// reads its columns' gate rows and up rows and stores their SiLU product to
// `o0`, as `silu_mul` computes it, and with `hq` also that product quantized
// to 8 bits (`hq`, `hs`: the codes and scales of the next matmul's input,
// laid out as `q8_quantize` writes them; the host then gives each block
// whole blocks of 32 columns).
//
// S: 0 for the weights loaded into registers (`mv_reg_loop`), else the
// stages of the pipelined loop (`mv_pipe_loop`).
template <int DT, int R, int NW, bool PF, int MAXG, int S = 0>
__device__ __forceinline__ void mmvq_body(const u8* w0, const u8* w1, const u8* w2, float* o0, float* o1, float* o2,
                                          const float* b0, const float* b1, const float* b2, int n0, int n1, int n2,
                                          long long row_bytes, const signed char* __restrict__ xq,
                                          const float2* __restrict__ xs, int k, int rows, int groups, int glu,
                                          u32* __restrict__ hq, float2* __restrict__ hs, int early) {
    typedef Mv<DT> F;
    __shared__ float red[MMVQ_WARPS][MAXG][R * NW];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    // The block's part and its first weight row there.
    int per = NW * groups, b = blockIdx.x;
    int p = glu ? 0 : launch_part(b, n0, n1, per);
    const u8* w = w0;
    float* out = o0;
    const float* bias = b0;
    int n = n0;
    if (p == 1) w = w1, out = o1, bias = b1, n = n1;
    if (p == 2) w = w2, out = o2, bias = b2, n = n2;
    int j0 = b * per;
    int vg = glu ? 2 * groups : groups;
    int steps = (k + MMVQ_STEP - 1) / MMVQ_STEP, units = vg * steps;
    // The warp's partial sums start at zero: it may reach no unit of a group.
    for (int e = lane; e < MAXG * R * NW; e += 32) (&red[wid][0][0])[e] = 0.f;
    MvWork<R, NW, MAXG> wk{w, w1, row_bytes, glu, groups, j0, n, xq, xs, k, rows, units, steps, early, red};
    if constexpr (S > 0)
        mv_pipe_loop<F, R, NW, S, MAXG>(wk);
    else
        mv_reg_loop<F, R, NW, PF, MAXG>(wk);
    __syncthreads();
    if (!glu) {
        for (int o = threadIdx.x; o < R * per; o += blockDim.x) {
            int r = o / per, c = o - r * per, j = j0 + c;
            if (r < rows && j < n) {
                float s = 0.f;
#pragma unroll
                for (int x = 0; x < MMVQ_WARPS; x++) s += red[x][c / NW][r * NW + c % NW];
                if (bias) s += bias[j];
                out[(long long)r * n + j] = s;
            }
        }
        return;
    }
    __shared__ __align__(16) float prod[R][MAXG / 2 * NW];
    for (int o = threadIdx.x; o < R * per; o += blockDim.x) {
        int r = o / per, c = o - r * per, j = j0 + c;
        float gs = 0.f, us = 0.f;
#pragma unroll
        for (int x = 0; x < MMVQ_WARPS; x++) {
            gs += red[x][c / NW][r * NW + c % NW];
            us += red[x][groups + c / NW][r * NW + c % NW];
        }
        float v = gs / (1.0f + expf(-gs)) * us;
        prod[r][c] = v;
        if (r < rows && j < n) out[(long long)r * n + j] = v;
    }
    if (!hq) return;
    __syncthreads();
    // Eight threads a block of 32 columns, a float4 each; every thread of a
    // warp takes part (q8_store4's shuffles).
    int quads = R * per / 4;
    for (int base = 0; base < quads; base += blockDim.x) {
        int e = base + threadIdx.x, r = e / (per / 4), c = 4 * (e - r * (per / 4));
        bool live = e < quads && r < rows && j0 + c < n;
        float4 v = live ? *(const float4*)&prod[r][c] : make_float4(0.f, 0.f, 0.f, 0.f);
        q8_store4(v, live, hq, hs, live ? ((long long)r * n + j0 + c) >> 2 : 0);
    }
}

// Instantiations for 1, 2, 4 and 8 input rows; NW weight rows per group (the
// host's matmul.rs MMVQ_NW): two for 1 and 2 rows, four for 4 and 8, where
// an activation load would otherwise cost L1 more than the weights do; MAXG
// groups at most per block (MMVQ_MAX_GROUPS). MINB: blocks per SM the
// register budget must allow (left to itself this NVRTC picks smaller
// budgets and spills): 8 at one row (64 registers, a full SM of 1024
// threads), fewer where a format needs more (Q5_K holds three 16-byte pieces
// a row: without spills at 6 for one row and 3 for four, on every
// architecture scripts/check_kernels.py compiles for).
//
// `_p1`: one input row on the pipelined loop (`mv_pipe_loop`, MMVQ_STAGES
// stages; the host's `CudaTuning::mmvq_pipe`), its blocks per SM set by
// their shared memory (19-36 KB).
#define MMVQ_STAGES 4
#define MMVQ(FN, DT, R, NW, PF, MAXG, MINB, S)                                                                      \
    extern "C" __global__ void __launch_bounds__(MMVQ_WARPS * 32, MINB)                                            \
        FN(const u8* w0, const u8* w1, const u8* w2, float* o0, float* o1, float* o2, const float* b0,              \
           const float* b1, const float* b2, int n0, int n1, int n2, long long row_bytes,                          \
           const signed char* __restrict__ xq, const float2* __restrict__ xs, int k, int rows, int groups, int glu, \
           u32* hq, float2* hs, int early) {                                                                       \
        mmvq_body<DT, R, NW, PF, MAXG, S>(w0, w1, w2, o0, o1, o2, b0, b1, b2, n0, n1, n2, row_bytes, xq, xs, k,    \
                                          rows, groups, glu, hq, hs, early);                                       \
    }
#define MMVQ_ALL(NAME, DT, MINB1, MINB4)                                                                           \
    MMVQ(mmvq_##NAME##_r1, DT, 1, 2, true, 32, MINB1, 0)                                                           \
    MMVQ(mmvq_##NAME##_r2, DT, 2, 2, true, 32, 6, 0)                                                               \
    MMVQ(mmvq_##NAME##_r4, DT, 4, 4, false, 16, MINB4, 0)                                                          \
    MMVQ(mmvq_##NAME##_r8, DT, 8, 4, false, 8, 3, 0)                                                               \
    MMVQ(mmvq_##NAME##_p1, DT, 1, 2, false, 32, 8, MMVQ_STAGES)
MMVQ_ALL(q8_0, DT_Q8_0, 8, 4)
MMVQ_ALL(q4_0, DT_Q4_0, 8, 4)
MMVQ_ALL(q4_1, DT_Q4_1, 8, 4)
MMVQ_ALL(q5_0, DT_Q5_0, 8, 4)
MMVQ_ALL(q5_1, DT_Q5_1, 8, 4)
MMVQ_ALL(iq4_nl, DT_IQ4_NL, 8, 4)
MMVQ_ALL(q2_k, DT_Q2_K, 8, 4)
MMVQ_ALL(q3_k, DT_Q3_K, 8, 4)
MMVQ_ALL(q4_k, DT_Q4_K, 8, 4)
MMVQ_ALL(q5_k, DT_Q5_K, 6, 3)
MMVQ_ALL(q6_k, DT_Q6_K, 8, 4)
MMVQ_ALL(iq4_xs, DT_IQ4_XS, 8, 4)

// `blocks` blocks of 32 values of x (input rows of k a multiple of 32, back
// to back) to 8 bits: codes `q` (i8, four to a word, in x's order) and per
// block (d, d * sum q) in `s`. Eight lanes per block, a float4 each.
extern "C" __global__ void __launch_bounds__(256) q8_quantize(const float* __restrict__ x, u32* __restrict__ q,
                                                              float2* __restrict__ s, long long blocks) {
    pdl_enter();
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    bool live = (t >> 3) < blocks;
    q8_store4(live ? __ldg((const float4*)x + t) : make_float4(0.f, 0.f, 0.f, 0.f), live, q, s, t);
}
