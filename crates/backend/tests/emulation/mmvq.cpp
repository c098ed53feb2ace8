// The integer decode GEMVs of kernels/mmvq.cu (q8_quantize and every
// mmvq_* kernel), run under the host emulation of shim.h. The activation
// rows are quantized by the kernel and compared with the 8-bit rule written
// out here (d = max|x| / 127, q = round(x / d) half away from zero, d * sum q
// per 32: cpu/quant.rs `Q8Row::quantize`) bit for bit; each GEMV is compared
// with a reference that dequantizes every weight in double from the format's
// definition (the layouts of cpu/quant.rs `unpack_block`) and dots it with
// the quantized activations in double. Weights are random blocks with edge
// values among them (zero, negative and large scales, all-ones and extreme
// codes); rows of two, three, five and seventeen super-blocks' width cover a
// partial step, steps spread over the block's warps and a warp's second
// step, and the 2-byte aligned formats' rows start at every alignment.
// `__dp4a`, `__byte_perm`, `__funnelshift_r`, the streaming load, f16
// conversion and the warp shuffles are emulated below from their PTX
// definitions. Built and run by crates/backend/tests/kernels_emulated.rs;
// exits 1 when a comparison fails.
#include "shim.h"
#include <cstdio>
#include <random>

#undef __launch_bounds__
#define __launch_bounds__(...)

// Storage codes, as kernels/common.cu.
#define DT_Q8_0 2
#define DT_Q4_0 3
#define DT_Q4_1 4
#define DT_Q5_0 5
#define DT_Q5_1 6
#define DT_IQ4_NL 7
#define DT_Q2_K 8
#define DT_Q3_K 9
#define DT_Q4_K 10
#define DT_Q5_K 11
#define DT_Q6_K 12
#define DT_IQ4_XS 13

struct alignas(16) uint4 {
    u32 x, y, z, w;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
inline uint4 make_uint4(u32 x, u32 y, u32 z, u32 w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline int imin(int a, int b) { return a < b ? a : b; }
template <class T>
T __ldg(const T* p) {
    return *p;
}
// ld.global.nc.L1::no_allocate.v4.u32: a plain 16-byte load here.
inline uint4 ld_stream(const uint4* p) { return *p; }

inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}
// dp4a.s32.s32: c plus the four products of the signed bytes of a and b.
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
// prmt.b32 (default mode): byte i of the result is byte s_i & 7 of {b, a},
// or that byte's sign replicated when s_i & 8.
inline u32 __byte_perm(u32 a, u32 b, u32 s) {
    unsigned long long v = ((unsigned long long)b << 32) | a;
    u32 r = 0;
    for (int i = 0; i < 4; i++) {
        u32 c = (s >> (4 * i)) & 15, byte = (u32)(v >> (8 * (c & 7))) & 0xff;
        if (c & 8) byte = (byte & 0x80) ? 0xff : 0;
        r |= byte << (8 * i);
    }
    return r;
}
// shf.r.clamp... with a shift below 32: the low word of {hi, lo} >> n.
inline u32 __funnelshift_r(u32 lo, u32 hi, int n) {
    return (u32)((((unsigned long long)hi << 32) | lo) >> (n & 31));
}

// IEEE half to float (cvt.f32.f16), exactly.
inline float half_to_float(unsigned short h) {
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp((float)(m | 1024), e - 25);
    return s ? -v : v;
}
inline float f16_to_f32(unsigned short h) { return half_to_float(h); }

namespace emu {
alignas(16) unsigned char board[32][32][16];
inline void warp_sync() { (*warp_barriers)[threadIdx.x >> 5]->arrive_and_wait(); }
} // namespace emu
inline void __syncwarp() { emu::warp_sync(); }
// shfl.sync.bfly: every lane publishes its value, then reads lane ^ o's.
template <class T>
T __shfl_xor_sync(u32, T v, int o) {
    static_assert(sizeof(T) <= 16);
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    memcpy(emu::board[w][lane], &v, sizeof(T));
    emu::warp_sync();
    T r;
    memcpy(&r, emu::board[w][lane ^ o], sizeof(T));
    emu::warp_sync();
    return r;
}

#include "../../kernels/mmvq.cu"

namespace {

std::mt19937 rng(23);
float rnd(float s) { return std::uniform_real_distribution<float>(-s, s)(rng); }
u8 rbyte() { return (u8)(rng() & 0xff); }

unsigned short to_half(float f) {
    // Round to nearest even through double; the values used here are normal or zero.
    if (f == 0.f) return std::signbit(f) ? 0x8000 : 0;
    int s = f < 0, e;
    double m = std::frexp(std::fabs((double)f), &e); // |f| = m 2^e, m in [0.5, 1)
    int he = e + 14;
    if (he <= 0) return (unsigned short)(s << 15); // not used here
    double frac = m * 2048.0;                        // 11 significant bits
    long long q = std::llrint(frac);
    if (q == 2048) q = 1024, he++;
    return (unsigned short)((s << 15) | (he << 10) | (q & 1023));
}

// A format: bytes and weights per block, where its f16 fields are, and the
// reference decode of a block into `out` (its weights in double).
struct Format {
    const char* name;
    int dt, bytes, elems;
    std::vector<int> f16s;
    void (*decode)(const u8* b, double* out);
    void (*r1)(const u8*, long long, const signed char*, const float2*, float*, int, int, int, int);
    void (*r2)(const u8*, long long, const signed char*, const float2*, float*, int, int, int, int);
    void (*r4)(const u8*, long long, const signed char*, const float2*, float*, int, int, int, int);
    void (*r8)(const u8*, long long, const signed char*, const float2*, float*, int, int, int, int);
};

double hd(const u8* p) { return half_to_float((unsigned short)(p[0] | (p[1] << 8))); }
const int kLevels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

void dec_q8_0(const u8* b, double* o) {
    for (int i = 0; i < 32; i++) o[i] = hd(b) * (signed char)b[2 + i];
}
void dec_q4_0(const u8* b, double* o) {
    for (int j = 0; j < 16; j++) o[j] = hd(b) * ((b[2 + j] & 15) - 8), o[j + 16] = hd(b) * ((b[2 + j] >> 4) - 8);
}
void dec_q4_1(const u8* b, double* o) {
    for (int j = 0; j < 16; j++) o[j] = hd(b) * (b[4 + j] & 15) + hd(b + 2), o[j + 16] = hd(b) * (b[4 + j] >> 4) + hd(b + 2);
}
u32 le32(const u8* p) { return p[0] | (p[1] << 8) | (p[2] << 16) | ((u32)p[3] << 24); }
void dec_q5_0(const u8* b, double* o) {
    u32 qh = le32(b + 2);
    for (int j = 0; j < 16; j++) {
        o[j] = hd(b) * ((int)((b[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16);
        o[j + 16] = hd(b) * ((int)((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
}
void dec_q5_1(const u8* b, double* o) {
    u32 qh = le32(b + 4);
    for (int j = 0; j < 16; j++) {
        o[j] = hd(b) * ((b[8 + j] & 15) | (((qh >> j) & 1) << 4)) + hd(b + 2);
        o[j + 16] = hd(b) * ((b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + hd(b + 2);
    }
}
void dec_iq4_nl(const u8* b, double* o) {
    for (int j = 0; j < 16; j++) o[j] = hd(b) * kLevels[b[2 + j] & 15], o[j + 16] = hd(b) * kLevels[b[2 + j] >> 4];
}
// Q4_K / Q5_K scale and min of sub-block j from the 12 bytes at s.
void k4_scale_min(int j, const u8* s, int& sc, int& m) {
    if (j < 4) sc = s[j] & 63, m = s[j + 4] & 63;
    else sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
}
void dec_k45(const u8* b, double* o, bool five) {
    const u8* qs = b + (five ? 48 : 16);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++)
            for (int hi = 0; hi < 2; hi++) {
                int s = 2 * c + hi, sc, m;
                k4_scale_min(s, b + 4, sc, m);
                int q = hi ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 15;
                if (five) q |= ((b[16 + l] >> s) & 1) << 4;
                o[32 * s + l] = hd(b) * sc * q - hd(b + 2) * m;
            }
}
void dec_q4_k(const u8* b, double* o) { dec_k45(b, o, false); }
void dec_q5_k(const u8* b, double* o) { dec_k45(b, o, true); }
void dec_q6_k(const u8* b, double* o) {
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < 32; l++) {
                int byte = b[64 * h + l + 32 * (k % 2)];
                int low = k < 2 ? byte & 15 : byte >> 4, high = (b[128 + 32 * h + l] >> (2 * k)) & 3;
                int e = 128 * h + 32 * k + l;
                o[e] = hd(b + 208) * (signed char)b[192 + e / 16] * ((low | (high << 4)) - 32);
            }
}
void dec_q2_k(const u8* b, double* o) {
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                int e = 128 * h + 32 * j + l, sc = b[e / 16];
                int q = (b[16 + 32 * h + l] >> (2 * j)) & 3;
                o[e] = hd(b + 80) * (sc & 15) * q - hd(b + 82) * (sc >> 4);
            }
}
void dec_q3_k(const u8* b, double* o) {
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                int e = 128 * h + 32 * j + l, g = e / 16;
                int q = ((b[32 + 32 * h + l] >> (2 * j)) & 3) - ((b[l] >> (4 * h + j)) & 1 ? 0 : 4);
                int lo = g < 8 ? b[96 + g] & 15 : b[96 + g - 8] >> 4, hi = (b[104 + g % 4] >> (2 * (g / 4))) & 3;
                o[e] = hd(b + 108) * ((lo | (hi << 4)) - 32) * q;
            }
}
void dec_iq4_xs(const u8* b, double* o) {
    int sh = b[2] | (b[3] << 8);
    for (int s = 0; s < 8; s++) {
        int ls = ((b[4 + s / 2] >> (4 * (s % 2))) & 15) | (((sh >> (2 * s)) & 3) << 4);
        for (int j = 0; j < 16; j++) {
            int v = b[8 + 16 * s + j];
            o[32 * s + j] = hd(b) * (ls - 32) * kLevels[v & 15];
            o[32 * s + 16 + j] = hd(b) * (ls - 32) * kLevels[v >> 4];
        }
    }
}

#define KERNELS(stem) mmvq_##stem##_r1, mmvq_##stem##_r2, mmvq_##stem##_r4, mmvq_##stem##_r8
std::vector<Format> formats() {
    return {
        {"Q8_0", DT_Q8_0, 34, 32, {0}, dec_q8_0, KERNELS(q8_0)},
        {"Q4_0", DT_Q4_0, 18, 32, {0}, dec_q4_0, KERNELS(q4_0)},
        {"Q4_1", DT_Q4_1, 20, 32, {0, 2}, dec_q4_1, KERNELS(q4_1)},
        {"Q5_0", DT_Q5_0, 22, 32, {0}, dec_q5_0, KERNELS(q5_0)},
        {"Q5_1", DT_Q5_1, 24, 32, {0, 2}, dec_q5_1, KERNELS(q5_1)},
        {"IQ4_NL", DT_IQ4_NL, 18, 32, {0}, dec_iq4_nl, KERNELS(iq4_nl)},
        {"Q2_K", DT_Q2_K, 84, 256, {80, 82}, dec_q2_k, KERNELS(q2_k)},
        {"Q3_K", DT_Q3_K, 110, 256, {108}, dec_q3_k, KERNELS(q3_k)},
        {"Q4_K", DT_Q4_K, 144, 256, {0, 2}, dec_q4_k, KERNELS(q4_k)},
        {"Q5_K", DT_Q5_K, 176, 256, {0, 2}, dec_q5_k, KERNELS(q5_k)},
        {"Q6_K", DT_Q6_K, 210, 256, {208}, dec_q6_k, KERNELS(q6_k)},
        {"IQ4_XS", DT_IQ4_XS, 136, 256, {0}, dec_iq4_xs, KERNELS(iq4_xs)},
    };
}

// Random blocks; one in eight with every code byte 0xff (the largest codes),
// one in eight with 0x80 (Q8_0's -128), f16 fields zero, negative or large
// now and then.
std::vector<u8> random_blocks(const Format& f, int blocks) {
    std::vector<u8> w((size_t)blocks * f.bytes);
    for (int b = 0; b < blocks; b++) {
        u8* p = &w[(size_t)b * f.bytes];
        int kind = rng() % 8;
        for (int i = 0; i < f.bytes; i++) p[i] = kind == 0 ? 0xff : kind == 1 ? 0x80 : rbyte();
        for (int at : f.f16s) {
            int pick = rng() % 8;
            float v = pick == 0 ? 0.f : pick == 1 ? -rnd(1.f) * 0.05f : pick == 2 ? 3.5f : rnd(1.f) * 0.02f;
            unsigned short h = to_half(v);
            p[at] = h & 0xff, p[at + 1] = h >> 8;
        }
    }
    return w;
}

// The 8-bit rule of cpu/quant.rs `Q8Row::quantize`, written out.
void q8_reference(const std::vector<float>& x, std::vector<signed char>& q, std::vector<float2>& s) {
    size_t blocks = x.size() / 32;
    q.resize(x.size());
    s.resize(blocks);
    for (size_t b = 0; b < blocks; b++) {
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(x[32 * b + i]));
        float d = amax / 127.0f;
        float inv = d > 0.f ? 1.0f / d : 0.f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            float r = std::round(x[32 * b + i] * inv);
            int c = std::isnan(r) ? 0 : r < -128.f ? -128 : r > 127.f ? 127 : (int)r;
            q[32 * b + i] = (signed char)c;
            sum += c;
        }
        s[b] = {d, d * (float)sum};
    }
}

// Input rows with edge blocks: all zeros, a tie at every half (x / d = n + 1/2
// rounds away from zero, not to even), one large value among small ones.
std::vector<float> input_rows(int rows, int k) {
    std::vector<float> x((size_t)rows * k);
    for (auto& v : x) v = rnd(2.f);
    if (k >= 128) {
        for (int i = 0; i < 32; i++) x[i] = 0.f;
        for (int i = 0; i < 32; i++) x[32 + i] = i == 0 ? 127.f : (float)(i % 9) - 4.5f;
        for (int i = 0; i < 32; i++) x[64 + i] = i == 7 ? -1000.f : rnd(0.01f);
    }
    return x;
}

bool check_quantize(int rows, int k) {
    std::vector<float> x = input_rows(rows, k);
    long long blocks = (long long)rows * k / 32;
    std::vector<u32> q((size_t)rows * k / 4, 0xdeadbeef);
    std::vector<float2> s(blocks, {NAN, NAN});
    unsigned grid = (unsigned)((blocks * 8 + 255) / 256);
    launch({grid, 1, 1}, 256, [&] { q8_quantize(x.data(), q.data(), s.data(), blocks); });
    std::vector<signed char> rq;
    std::vector<float2> rs;
    q8_reference(x, rq, rs);
    bool ok = memcmp(q.data(), rq.data(), rq.size()) == 0;
    for (long long b = 0; b < blocks; b++) ok &= memcmp(&s[b], &rs[b], sizeof(float2)) == 0;
    printf("%s q8_quantize %d x %d: codes and (d, d sum q) bit for bit\n", ok ? "PASS" : "FAIL", rows, k);
    return ok;
}

bool check_gemv(const Format& f, int n, int k, int rows) {
    int per_row = k / f.elems;
    std::vector<u8> w = random_blocks(f, n * per_row);
    long long row_bytes = (long long)per_row * f.bytes;
    // A 16-byte aligned copy, as the arena places a tensor.
    std::vector<uint4> wa((w.size() + 15) / 16 + 1);
    memcpy(wa.data(), w.data(), w.size());
    const u8* wp = (const u8*)wa.data();
    std::vector<float> x = input_rows(rows, k);
    std::vector<signed char> xq;
    std::vector<float2> xs;
    q8_reference(x, xq, xs);
    std::vector<int4> xqa(xq.size() / 16);
    memcpy(xqa.data(), xq.data(), xq.size());
    std::vector<float> out((size_t)rows * n, NAN);
    int r_inst = rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8;
    auto kernel = r_inst == 1 ? f.r1 : r_inst == 2 ? f.r2 : r_inst == 4 ? f.r4 : f.r8;
    int nw = r_inst <= 2 ? 2 : 4; // matmul.rs MMVQ_NW
    launch({(unsigned)((n + nw - 1) / nw), 1, 1}, MMVQ_WARPS * 32, [&] {
        kernel(wp, row_bytes, (const signed char*)xqa.data(), xs.data(), out.data(), n, k, rows, 1);
    });
    // The reference: weights in double from the definition, times d * q.
    double worst = 0;
    std::vector<double> wrow(k);
    for (int j = 0; j < n; j++) {
        for (int b = 0; b < per_row; b++) f.decode(wp + j * row_bytes + (size_t)b * f.bytes, &wrow[(size_t)b * f.elems]);
        for (int r = 0; r < rows; r++) {
            double ref = 0, mag = 0;
            for (int e = 0; e < k; e++) {
                double xv = (double)xs[((size_t)r * k + e) / 32].x * xq[(size_t)r * k + e];
                ref += wrow[e] * xv;
                mag += std::fabs(wrow[e] * xv);
            }
            // The offsets' term (m * d sum q) is one product per 32 weights.
            double got = out[(size_t)r * n + j];
            double e = std::isnan(got) ? INFINITY : std::fabs(got - ref) / std::max(mag, 1e-30);
            worst = std::max(worst, e);
        }
    }
    // f32 products and sums of exact integer dots: a few ulps of the sum of magnitudes.
    bool ok = worst <= 1e-5;
    printf("%s mmvq %s r%d: %d rows, n %d, k %d: max error %.2e of the sum of |terms|\n", ok ? "PASS" : "FAIL", f.name,
           r_inst, rows, n, k, worst);
    return ok;
}

} // namespace

int main() {
    int failed = 0;
    failed += !check_quantize(1, 512);
    failed += !check_quantize(3, 1280);
    for (const Format& f : formats()) {
        // k: a partial step (2 super-blocks), two warps' steps (5), and a
        // warp's second step (17); for the 32-weight formats also a step
        // whose last block is alone in its half (17 blocks).
        failed += !check_gemv(f, 5, 512, 1);
        failed += !check_gemv(f, 5, 512, 3);
        failed += !check_gemv(f, 5, 1280, 2);
        failed += !check_gemv(f, 3, 4352, 5);
        if (f.elems == 32) failed += !check_gemv(f, 5, 544, 8);
    }
    return failed ? 1 : 0;
}
