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
// `__dp4a` and `__funnelshift_r` are emulated below from their PTX
// definitions, `__byte_perm`, the streaming load and the warp shuffles in
// shim.h, the f16 conversion in formats.h (with the formats' decoders).
// Built and run by crates/backend/tests/kernels_emulated.rs; exits 1 when a
// comparison fails.
#include "formats.h"
#include <cstdio>

// dp4a.s32.s32: c plus the four products of the signed bytes of a and b.
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
// shf.r.clamp... with a shift below 32: the low word of {hi, lo} >> n.
inline u32 __funnelshift_r(u32 lo, u32 hi, int n) {
    return (u32)((((unsigned long long)hi << 32) | lo) >> (n & 31));
}

#include "../../kernels/mmvq.cu"

namespace {

using Gemv = void (*)(const u8*, long long, const signed char*, const float2*, float*, int, int, int, int);
#define KERNELS(stem) {mmvq_##stem##_r1, mmvq_##stem##_r2, mmvq_##stem##_r4, mmvq_##stem##_r8}
// Each format's GEMVs for 1, 2, 4 and 8 input rows, as formats() lists them.
const Gemv kGemvs[12][4] = {KERNELS(q8_0), KERNELS(q4_0), KERNELS(q4_1),   KERNELS(q5_0),
                            KERNELS(q5_1), KERNELS(iq4_nl), KERNELS(q2_k), KERNELS(q3_k),
                            KERNELS(q4_k), KERNELS(q5_k), KERNELS(q6_k),   KERNELS(iq4_xs)};

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
    Gemv kernel = kGemvs[f.dt - DT_Q8_0][r_inst == 1 ? 0 : r_inst == 2 ? 1 : r_inst == 4 ? 2 : 3];
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
        // warp's second step (17), with the next step's weights loaded
        // ahead (1 and 2 rows) and without (5 rows); for
        // the 32-weight formats also a step whose last block is alone in its
        // half (17 blocks).
        failed += !check_gemv(f, 5, 512, 1);
        failed += !check_gemv(f, 5, 512, 3);
        failed += !check_gemv(f, 5, 1280, 2);
        failed += !check_gemv(f, 3, 4352, 5);
        failed += !check_gemv(f, 4, 4352, 1);
        failed += !check_gemv(f, 3, 4352, 2);
        if (f.elems == 32) failed += !check_gemv(f, 5, 544, 8);
    }
    return failed ? 1 : 0;
}
