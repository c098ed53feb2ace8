// Decoding the ggml block formats 32 weights at a time: `deq32<DT>(row, e0, v)`
// writes weights e0 .. e0 + 31 of a stored row (e0 a multiple of 32) to v.
//
// One group of 32 is one sub-block of a K-quant super-block (or one block of
// the 32-weight formats), so its scales are decoded once and every quant is
// unpacked four to a 32-bit word: the per-element decoder of common.cu
// (`load_elem`) spends a byte load and a scale decode per weight, which made
// the K-quant GEMVs compute-bound far below the bandwidth floor. Q4_K, Q5_K,
// Q6_K, Q8_0, Q4_0 and Q4_1 (the types of llama.cpp's default Q4_K_M, Q5_K_M
// and Q6_K mixes and of the pure files) have word-wise decoders here; the
// other formats take the per-element one, 32 unrolled (same values either
// way: the layouts are those of cpu/quant.rs `unpack_block`).
//
// Alignment: rows start 256-byte aligned (the weight arena) and a row of k
// weights holds k / 256 super-blocks (or k / 32 blocks), so a Q4_K or Q5_K
// super-block (144, 176 bytes) is 16-byte aligned and read with vector loads;
// Q6_K (210 bytes) and the 32-weight formats (34, 18, 20 bytes) are only
// 2-byte aligned and read as 16-bit words.
//
// Used by the decode GEMVs for these formats (gemv.cu `gemv_bq_body`), the
// tensor-core matmul of quantized weights (mmq.cu) and the widening copy for
// prefill (`dequant_rows32`).

__device__ __forceinline__ u32 ld_u16_pair(const u8* p) {
    const unsigned short* h = (const unsigned short*)p;
    return (u32)__ldg(h) | ((u32)__ldg(h + 1) << 16);
}

// Byte i (0..11) of a K-quant's 12 scale bytes held as three words.
__device__ __forceinline__ int kq_byte(u32 s0, u32 s1, u32 s2, int i) {
    u32 w = i < 4 ? s0 : (i < 8 ? s1 : s2);
    return (int)((w >> (8 * (i & 3))) & 0xffu);
}

// The 6-bit scale and min of sub-block s of a Q4_K / Q5_K super-block.
__device__ __forceinline__ void kq_scale_min(u32 s0, u32 s1, u32 s2, int s, int& sc, int& m) {
    if (s < 4) {
        sc = kq_byte(s0, s1, s2, s) & 63;
        m = kq_byte(s0, s1, s2, s + 4) & 63;
    } else {
        sc = (kq_byte(s0, s1, s2, s + 4) & 15) | ((kq_byte(s0, s1, s2, s - 4) >> 6) << 4);
        m = (kq_byte(s0, s1, s2, s + 4) >> 4) | ((kq_byte(s0, s1, s2, s) >> 6) << 4);
    }
}

// Byte j of w as a float, exactly: the byte placed in the mantissa of 2^23
// (one byte permute) and 2^23 subtracted (one add). The integer-to-float
// conversion it replaces runs at a quarter of the FMA rate, and was the
// decode's limit.
__device__ __forceinline__ float byte_as_float(u32 w, int j) {
    return __int_as_float((int)__byte_perm(w, 0x4B000000u, 0x7540u + j)) - 8388608.f;
}

// v[4i + j] = a * byte j of w[i] - b, for the eight words of 32 small unsigned quants.
__device__ __forceinline__ void unpack_affine(const u32 (&w)[8], float a, float b, float (&v)[32]) {
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) v[4 * i + j] = a * byte_as_float(w[i], j) - b;
}

template <int DT>
__device__ __forceinline__ void deq32(const u8* row, int e0, float (&v)[32]) {
#pragma unroll
    for (int l = 0; l < 32; l++) v[l] = load_elem(row, DT, e0 + l);
}

template <>
__device__ __forceinline__ void deq32<DT_Q4_K>(const u8* row, int e0, float (&v)[32]) {
    const u8* b = row + (long long)(e0 >> 8) * 144;
    int s = (e0 >> 5) & 7;
    uint4 h = __ldg((const uint4*)b);
    int sc, m;
    kq_scale_min(h.y, h.z, h.w, s, sc, m);
    const uint4* q = (const uint4*)(b + 16 + 32 * (s >> 1));
    uint4 q0 = __ldg(q), q1 = __ldg(q + 1);
    int sh = 4 * (s & 1);
    u32 w[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
    for (int i = 0; i < 8; i++) w[i] = (w[i] >> sh) & 0x0f0f0f0fu;
    unpack_affine(w, f16_to_f32((unsigned short)(h.x & 0xffffu)) * (float)sc,
                  f16_to_f32((unsigned short)(h.x >> 16)) * (float)m, v);
}

template <>
__device__ __forceinline__ void deq32<DT_Q5_K>(const u8* row, int e0, float (&v)[32]) {
    const u8* b = row + (long long)(e0 >> 8) * 176;
    int s = (e0 >> 5) & 7;
    uint4 h = __ldg((const uint4*)b);
    int sc, m;
    kq_scale_min(h.y, h.z, h.w, s, sc, m);
    const uint4* qh = (const uint4*)(b + 16);
    const uint4* q = (const uint4*)(b + 48 + 32 * (s >> 1));
    uint4 h0 = __ldg(qh), h1 = __ldg(qh + 1), q0 = __ldg(q), q1 = __ldg(q + 1);
    int sh = 4 * (s & 1);
    u32 w[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
    u32 hb[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
    for (int i = 0; i < 8; i++) w[i] = ((w[i] >> sh) & 0x0f0f0f0fu) | (((hb[i] >> s) & 0x01010101u) << 4);
    unpack_affine(w, f16_to_f32((unsigned short)(h.x & 0xffffu)) * (float)sc,
                  f16_to_f32((unsigned short)(h.x >> 16)) * (float)m, v);
}

template <>
__device__ __forceinline__ void deq32<DT_Q6_K>(const u8* row, int e0, float (&v)[32]) {
    const u8* b = row + (long long)(e0 >> 8) * 210;
    int s = (e0 >> 5) & 7, h = s >> 2, k4 = s & 3;
    const u8* ql = b + 64 * h + 32 * (k4 & 1);
    const u8* qh = b + 128 + 32 * h;
    u32 scw = (u32)__ldg((const unsigned short*)(b + 192 + 2 * s));
    float d = f16_to_f32(__ldg((const unsigned short*)(b + 208)));
    float d0 = d * (float)(signed char)(scw & 0xffu), d1 = d * (float)(signed char)(scw >> 8);
    int lsh = k4 >= 2 ? 4 : 0, hsh = 2 * k4;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 x = ((ld_u16_pair(ql + 4 * i) >> lsh) & 0x0f0f0f0fu) | (((ld_u16_pair(qh + 4 * i) >> hsh) & 0x03030303u) << 4);
        float dd = i < 4 ? d0 : d1; // weights 0..15 take scale 2s, 16..31 scale 2s + 1
#pragma unroll
        for (int j = 0; j < 4; j++) v[4 * i + j] = dd * (float)((int)((x >> (8 * j)) & 0xffu) - 32);
    }
}

template <>
__device__ __forceinline__ void deq32<DT_Q8_0>(const u8* row, int e0, float (&v)[32]) {
    const u8* b = row + (long long)(e0 >> 5) * 34;
    float d = f16_to_f32(__ldg((const unsigned short*)b));
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u32 x = ld_u16_pair(b + 2 + 4 * i);
#pragma unroll
        for (int j = 0; j < 4; j++) v[4 * i + j] = d * (float)(signed char)((x >> (8 * j)) & 0xffu);
    }
}

// Q4_0 and Q4_1: byte i holds quant i (low nibble) and quant i + 16 (high).
template <>
__device__ __forceinline__ void deq32<DT_Q4_0>(const u8* row, int e0, float (&v)[32]) {
    const u8* b = row + (long long)(e0 >> 5) * 18;
    float d = f16_to_f32(__ldg((const unsigned short*)b));
    u32 w[8];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 x = ld_u16_pair(b + 2 + 4 * i);
        w[i] = x & 0x0f0f0f0fu;
        w[4 + i] = (x >> 4) & 0x0f0f0f0fu;
    }
    unpack_affine(w, d, 8.f * d, v);
}

template <>
__device__ __forceinline__ void deq32<DT_Q4_1>(const u8* row, int e0, float (&v)[32]) {
    const u8* b = row + (long long)(e0 >> 5) * 20;
    float d = f16_to_f32(__ldg((const unsigned short*)b)), m = f16_to_f32(__ldg((const unsigned short*)(b + 2)));
    u32 w[8];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 x = ld_u16_pair(b + 4 + 4 * i);
        w[i] = x & 0x0f0f0f0fu;
        w[4 + i] = (x >> 4) & 0x0f0f0f0fu;
    }
    unpack_affine(w, d, -m, v);
}


// 32 decoded weights as four 16-byte bf16 chunks at `dst` (16-byte aligned).
__device__ __forceinline__ void store_bf16x32(bf16_t* dst, const float (&v)[32]) {
    uint4* d = (uint4*)dst;
#pragma unroll
    for (int q = 0; q < 4; q++)
        d[q] = make_uint4(pack_bf16x2(v[8 * q], v[8 * q + 1]), pack_bf16x2(v[8 * q + 2], v[8 * q + 3]),
                          pack_bf16x2(v[8 * q + 4], v[8 * q + 5]), pack_bf16x2(v[8 * q + 6], v[8 * q + 7]));
}

// Weights e0 .. e0 + 7 of a stored row (e0 a multiple of 8: a quarter of a
// 32-weight group), for the tensor-core matmul, whose threads each hold 8
// consecutive weights of a row (mmq.cu), in f32; the matmul takes them as
// bf16 pairs from `deq8_bf16` below, which decodes Q4_0 and the K-quants
// itself and the others from these. Same values as `deq32`. The row is
// read with generic loads: mmq passes blocks it staged in shared memory.
template <int DT>
__device__ __forceinline__ void deq8(const u8* row, int e0, float (&v)[8]) {
#pragma unroll
    for (int l = 0; l < 8; l++) v[l] = load_elem(row, DT, e0 + l);
}

__device__ __forceinline__ u32 ld_u32(const u8* p) { return *(const u32*)p; }
__device__ __forceinline__ unsigned short ld_u16(const u8* p) { return *(const unsigned short*)p; }

// Two words of 8 bytes, 2-byte aligned.
__device__ __forceinline__ void ld8_u16(const u8* p, u32& lo, u32& hi) {
    lo = (u32)ld_u16(p) | ((u32)ld_u16(p + 2) << 16);
    hi = (u32)ld_u16(p + 4) | ((u32)ld_u16(p + 6) << 16);
}

// v[j] = a * (byte j of (lo, hi) - z) - b, with z folded into the constant.
__device__ __forceinline__ void unpack8_affine(u32 lo, u32 hi, float a, float b, float (&v)[8], float z = 0.f) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        v[j] = a * (__int_as_float((int)__byte_perm(lo, 0x4B000000u, 0x7540u + j)) - (8388608.f + z)) - b;
        v[4 + j] = a * (__int_as_float((int)__byte_perm(hi, 0x4B000000u, 0x7540u + j)) - (8388608.f + z)) - b;
    }
}

template <>
__device__ __forceinline__ void deq8<DT_Q8_0>(const u8* row, int e0, float (&v)[8]) {
    const u8* b = row + (long long)(e0 >> 5) * 34;
    float d = f16_to_f32(ld_u16(b));
    u32 lo, hi;
    ld8_u16(b + 2 + (e0 & 31), lo, hi);
    // Signed bytes as unsigned ones 128 higher.
    unpack8_affine(lo ^ 0x80808080u, hi ^ 0x80808080u, d, 0.f, v, 128.f);
}

// Q4_1: quants i < 16 are the low nibbles of bytes i, i + 16 the high ones.
template <>
__device__ __forceinline__ void deq8<DT_Q4_1>(const u8* row, int e0, float (&v)[8]) {
    const u8* b = row + (long long)(e0 >> 5) * 20;
    int i = e0 & 31, sh = i >= 16 ? 4 : 0;
    float d = f16_to_f32(ld_u16(b)), m = f16_to_f32(ld_u16(b + 2));
    u32 lo, hi;
    ld8_u16(b + 4 + (i & 15), lo, hi);
    unpack8_affine((lo >> sh) & 0x0f0f0f0fu, (hi >> sh) & 0x0f0f0f0fu, d, -m, v);
}

// The same 8 weights as bf16 pairs for the mma, (e0, e0 + 1) in p[0] to
// (e0 + 6, e0 + 7) in p[3]: by default `deq8` rounded pair by pair.
template <int DT>
__device__ __forceinline__ void deq8_bf16(const u8* row, int e0, u32 (&p)[4]) {
    float v[8];
    deq8<DT>(row, e0, v);
#pragma unroll
    for (int j = 0; j < 4; j++) p[j] = pack_bf16x2(v[2 * j], v[2 * j + 1]);
}

// a * (c - z) - b for the 8 codes c (bytes of lo, then hi, each below 128)
// as bf16 pairs, computed in bf16 pairs: 0x4300 | c is exactly the bf16 of
// 128 + c, less 128 + z exactly, then one fused multiply-add with a and -b
// rounded to bf16. Three operations a pair where `unpack8_affine` and the
// packing take seven; the cost is a and b rounded to bf16 first (each up to
// 2^-9 of itself), besides the rounding of the result that both share.
__device__ __forceinline__ void unpack8_bf16(u32 lo, u32 hi, float a, float b, float z, u32 (&p)[4]) {
    const u32 one = 0x3f803f80u;
    u32 A = pack_bf16x2(a, a), B = pack_bf16x2(-b, -b), Z = pack_bf16x2(-(128.f + z), -(128.f + z));
    p[0] = bf16x2_fma(bf16x2_fma(__byte_perm(lo, 0x43434343u, 0x4140), one, Z), A, B);
    p[1] = bf16x2_fma(bf16x2_fma(__byte_perm(lo, 0x43434343u, 0x4342), one, Z), A, B);
    p[2] = bf16x2_fma(bf16x2_fma(__byte_perm(hi, 0x43434343u, 0x4140), one, Z), A, B);
    p[3] = bf16x2_fma(bf16x2_fma(__byte_perm(hi, 0x43434343u, 0x4342), one, Z), A, B);
}

// The K-quants with codes below 64 and Q4_0 decode in bf16 pairs.
template <>
__device__ __forceinline__ void deq8_bf16<DT_Q4_K>(const u8* row, int e0, u32 (&p)[4]) {
    const u8* b = row + (long long)(e0 >> 8) * 144;
    int s = (e0 >> 5) & 7, l0 = e0 & 31;
    u32 dm = ld_u32(b);
    int sc, m;
    kq_scale_min(ld_u32(b + 4), ld_u32(b + 8), ld_u32(b + 12), s, sc, m);
    uint2 q = *(const uint2*)(b + 16 + 32 * (s >> 1) + l0);
    int sh = 4 * (s & 1);
    unpack8_bf16((q.x >> sh) & 0x0f0f0f0fu, (q.y >> sh) & 0x0f0f0f0fu,
                 f16_to_f32((unsigned short)(dm & 0xffffu)) * (float)sc,
                 f16_to_f32((unsigned short)(dm >> 16)) * (float)m, 0.f, p);
}

template <>
__device__ __forceinline__ void deq8_bf16<DT_Q5_K>(const u8* row, int e0, u32 (&p)[4]) {
    const u8* b = row + (long long)(e0 >> 8) * 176;
    int s = (e0 >> 5) & 7, l0 = e0 & 31;
    u32 dm = ld_u32(b);
    int sc, m;
    kq_scale_min(ld_u32(b + 4), ld_u32(b + 8), ld_u32(b + 12), s, sc, m);
    uint2 h = *(const uint2*)(b + 16 + l0);
    uint2 q = *(const uint2*)(b + 48 + 32 * (s >> 1) + l0);
    int sh = 4 * (s & 1);
    u32 lo = ((q.x >> sh) & 0x0f0f0f0fu) | (((h.x >> s) & 0x01010101u) << 4);
    u32 hi = ((q.y >> sh) & 0x0f0f0f0fu) | (((h.y >> s) & 0x01010101u) << 4);
    unpack8_bf16(lo, hi, f16_to_f32((unsigned short)(dm & 0xffffu)) * (float)sc,
                 f16_to_f32((unsigned short)(dm >> 16)) * (float)m, 0.f, p);
}

template <>
__device__ __forceinline__ void deq8_bf16<DT_Q6_K>(const u8* row, int e0, u32 (&p)[4]) {
    const u8* b = row + (long long)(e0 >> 8) * 210;
    int s = (e0 >> 5) & 7, l0 = e0 & 31, h = s >> 2, k4 = s & 3;
    u32 l_lo, l_hi, h_lo, h_hi;
    ld8_u16(b + 64 * h + 32 * (k4 & 1) + l0, l_lo, l_hi);
    ld8_u16(b + 128 + 32 * h + l0, h_lo, h_hi);
    int lsh = k4 >= 2 ? 4 : 0, hsh = 2 * k4;
    u32 lo = ((l_lo >> lsh) & 0x0f0f0f0fu) | (((h_lo >> hsh) & 0x03030303u) << 4);
    u32 hi = ((l_hi >> lsh) & 0x0f0f0f0fu) | (((h_hi >> hsh) & 0x03030303u) << 4);
    float d = f16_to_f32(ld_u16(b + 208)) * (float)(signed char)b[192 + 2 * s + (l0 >> 4)];
    unpack8_bf16(lo, hi, d, 0.f, 32.f, p);
}

template <>
__device__ __forceinline__ void deq8_bf16<DT_Q4_0>(const u8* row, int e0, u32 (&p)[4]) {
    const u8* b = row + (long long)(e0 >> 5) * 18;
    int i = e0 & 31, sh = i >= 16 ? 4 : 0;
    float d = f16_to_f32(ld_u16(b));
    u32 lo, hi;
    ld8_u16(b + 2 + (i & 15), lo, hi);
    unpack8_bf16((lo >> sh) & 0x0f0f0f0fu, (hi >> sh) & 0x0f0f0f0fu, d, 0.f, 8.f, p);
}

// Widen stored rows row0 .. row0 + gridDim.x - 1 of a block format to a bf16
// tile [rows, k] for cuBLASLt (prefill): a thread per 32-weight group. k is
// a multiple of 32; the tile 16-byte aligned.
template <int DT>
__device__ __forceinline__ void dequant_rows32_body(const u8* w, long long row_bytes, bf16_t* out, int row0, int k) {
    pdl_enter();
    const u8* row = w + (long long)(row0 + blockIdx.x) * row_bytes;
    bf16_t* o = out + (long long)blockIdx.x * k;
    for (int g = threadIdx.x; g < (k >> 5); g += blockDim.x) {
        float v[32];
        deq32<DT>(row, 32 * g, v);
        store_bf16x32(o + 32 * g, v);
    }
}

extern "C" __global__ void dequant_rows32(const u8* w, int dtype, long long row_bytes, bf16_t* out, int row0, int k) {
    switch (dtype) {
    case DT_Q8_0: dequant_rows32_body<DT_Q8_0>(w, row_bytes, out, row0, k); break;
    case DT_Q4_0: dequant_rows32_body<DT_Q4_0>(w, row_bytes, out, row0, k); break;
    case DT_Q4_1: dequant_rows32_body<DT_Q4_1>(w, row_bytes, out, row0, k); break;
    case DT_Q4_K: dequant_rows32_body<DT_Q4_K>(w, row_bytes, out, row0, k); break;
    case DT_Q5_K: dequant_rows32_body<DT_Q5_K>(w, row_bytes, out, row0, k); break;
    case DT_Q6_K: dequant_rows32_body<DT_Q6_K>(w, row_bytes, out, row0, k); break;
    case DT_Q5_0: dequant_rows32_body<DT_Q5_0>(w, row_bytes, out, row0, k); break;
    case DT_Q5_1: dequant_rows32_body<DT_Q5_1>(w, row_bytes, out, row0, k); break;
    case DT_IQ4_NL: dequant_rows32_body<DT_IQ4_NL>(w, row_bytes, out, row0, k); break;
    case DT_Q2_K: dequant_rows32_body<DT_Q2_K>(w, row_bytes, out, row0, k); break;
    case DT_Q3_K: dequant_rows32_body<DT_Q3_K>(w, row_bytes, out, row0, k); break;
    default: dequant_rows32_body<DT_IQ4_XS>(w, row_bytes, out, row0, k); break;
    }
}
