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
// `__dp4a` and `__funnelshift_r` are emulated in mmvq_ref.h from their PTX
// definitions, `__byte_perm`, the streaming load and the warp shuffles in
// shim.h, the f16 conversion in formats.h (with the formats' decoders).
// Built and run by crates/backend/tests/kernels_emulated.rs; exits 1 when a
// comparison fails.
#include "mmvq_ref.h"

namespace {

using Gemv = void (*)(const u8*, const u8*, const u8*, float*, float*, float*, const float*, const float*,
                     const float*, int, int, int, long long, const signed char*, const float2*, int, int, int, int,
                     u32*, float2*, int);
#define KERNELS(stem) {mmvq_##stem##_r1, mmvq_##stem##_r2, mmvq_##stem##_r4, mmvq_##stem##_r8, mmvq_##stem##_p1}
// Each format's GEMVs for 1, 2, 4 and 8 input rows, then the pipelined one
// for one row (PIPE), as formats() lists them.
const int PIPE = 4;
const Gemv kGemvs[12][5] = {KERNELS(q8_0), KERNELS(q4_0), KERNELS(q4_1),   KERNELS(q5_0),
                            KERNELS(q5_1), KERNELS(iq4_nl), KERNELS(q2_k), KERNELS(q3_k),
                            KERNELS(q4_k), KERNELS(q5_k), KERNELS(q6_k),   KERNELS(iq4_xs)};
const int kMaxGroups[4] = {32, 32, 16, 8}; // matmul.rs MMVQ_MAX_GROUPS

bool check_quantize(int rows, int k) {
    std::vector<float> x = input_rows(rows, k);
    long long blocks = (long long)rows * k / 32;
    std::vector<u32> q((size_t)rows * k / 4, 0xdeadbeef);
    std::vector<float2> s(blocks, {NAN, NAN});
    unsigned grid = (unsigned)((blocks * 8 + 255) / 256);
    launch({grid, 1, 1}, 256, [&] { q8_quantize(x.data(), q.data(), s.data(), blocks); });
    bool ok = q8_matches(x, q, s);
    printf("%s q8_quantize %d x %d: codes and (d, d sum q) bit for bit\n", ok ? "PASS" : "FAIL", rows, k);
    return ok;
}

int inst_of(int rows) { return rows <= 1 ? 0 : rows <= 2 ? 1 : rows <= 4 ? 2 : 3; }
int nw_of(int rows) { return inst_of(rows) <= 1 ? 2 : 4; } // matmul.rs MMVQ_NW
// The kernel for `rows`: with `pipe` (one row) the pipelined one.
Gemv kernel_of(const Format& f, int rows, bool pipe) { return kGemvs[f.dt - DT_Q8_0][pipe ? PIPE : inst_of(rows)]; }
const char* name_of(int rows, bool pipe) {
    static const char* names[] = {"r1", "r2", "r4", "r8"};
    return pipe ? "p1" : names[inst_of(rows)];
}

// One launch over up to three matrices of one input (`ns`: their rows; 0:
// absent), `groups` groups of weight rows a block, a bias on the second.
bool check_gemv(const Format& f, std::vector<int> ns, int k, int rows, int groups, bool pipe = false) {
    ns.resize(3, 0);
    std::vector<Matrix> ms;
    for (int n : ns) ms.emplace_back(f, n, k);
    Input x(rows, k);
    std::vector<std::vector<float>> out(3), bias(3);
    for (int p = 0; p < 3; p++) {
        out[p].assign((size_t)rows * ns[p], NAN);
        if (p == 1) {
            bias[p].resize(ns[p]);
            for (auto& b : bias[p]) b = rnd(1.f);
        }
    }
    int per = nw_of(rows) * groups, blocks = 0;
    for (int n : ns) blocks += (n + per - 1) / per;
    Gemv kernel = kernel_of(f, rows, pipe);
    auto bp = [&](int p) { return bias[p].empty() ? nullptr : bias[p].data(); };
    launch({(unsigned)blocks, 1, 1}, MMVQ_WARPS * 32, [&] {
        kernel(ms[0].ptr(), ms[1].ptr(), ms[2].ptr(), out[0].data(), out[1].data(), out[2].data(), bp(0), bp(1), bp(2),
               ns[0], ns[1], ns[2], ms[0].row_bytes, (const signed char*)x.qa.data(), x.s.data(), k, rows, groups, 0,
               nullptr, nullptr, 1);
    });
    double worst = 0;
    for (int p = 0; p < 3; p++)
        for (int j = 0; j < ns[p]; j++)
            for (int r = 0; r < rows; r++) {
                auto [ref, mag] = x.dot(ms[p], k, r, j);
                if (!bias[p].empty()) ref += bias[p][j], mag += std::fabs(bias[p][j]);
                double got = out[p][(size_t)r * ns[p] + j];
                double e = std::isnan(got) ? INFINITY : std::fabs(got - ref) / std::max(mag, 1e-30);
                worst = std::max(worst, e);
            }
    // f32 products and sums of exact integer dots: a few ulps of the sum of magnitudes.
    bool ok = worst <= 1e-5;
    printf("%s mmvq %s %s: %d rows, n %d+%d+%d, k %d, %d groups a block: max error %.2e of the sum of |terms|\n",
           ok ? "PASS" : "FAIL", f.name, name_of(rows, pipe), rows, ns[0], ns[1], ns[2], k, groups, worst);
    return ok;
}

// Gate and up (n rows each) in one launch: their SiLU product, and with
// `quantized` that product quantized bit for bit as q8_quantize would.
bool check_glu(const Format& f, int n, int k, int rows, int groups, bool quantized, bool pipe = false) {
    Matrix g(f, n, k), u(f, n, k);
    Input x(rows, k);
    std::vector<float> h((size_t)rows * n, NAN);
    std::vector<u32> hq((size_t)rows * n / 4, 0xdeadbeef);
    std::vector<float2> hs((size_t)rows * n / 32, {NAN, NAN});
    int per = nw_of(rows) * groups;
    Gemv kernel = kernel_of(f, rows, pipe);
    launch({(unsigned)((n + per - 1) / per), 1, 1}, MMVQ_WARPS * 32, [&] {
        kernel(g.ptr(), u.ptr(), nullptr, h.data(), nullptr, nullptr, nullptr, nullptr, nullptr, n, 0, 0, g.row_bytes,
               (const signed char*)x.qa.data(), x.s.data(), k, rows, groups, 1, quantized ? hq.data() : nullptr,
               quantized ? hs.data() : nullptr, 1);
    });
    double worst = 0;
    for (int j = 0; j < n; j++)
        for (int r = 0; r < rows; r++) {
            auto [gv, gm] = x.dot(g, k, r, j);
            auto [uv, um] = x.dot(u, k, r, j);
            double sg = gv / (1 + std::exp(-gv)), ref = sg * uv;
            // The product's error from the dots' (silu' is at most 1.1 in magnitude).
            double bound = 1e-5 * (1.1 * gm * std::fabs(uv) + std::fabs(sg) * um) + 1e-6 * std::fabs(ref) + 1e-30;
            double got = h[(size_t)r * n + j];
            worst = std::max(worst, std::isnan(got) ? INFINITY : std::fabs(got - ref) / bound);
        }
    bool ok = worst <= 1.0;
    bool codes = !quantized || q8_matches(h, hq, hs);
    printf("%s mmvq %s %s gate/up/SiLU: %d rows, n %d, k %d, %d groups a block: max error %.2f of its bound%s\n",
           ok && codes ? "PASS" : "FAIL", f.name, name_of(rows, pipe), rows, n, k, groups, worst,
           quantized ? (codes ? "; product quantized bit for bit" : "; product's 8-bit copy DIFFERS") : "");
    return ok && codes;
}

} // namespace

int main() {
    int failed = 0;
    failed += !check_quantize(1, 512);
    failed += !check_quantize(3, 1280);
    for (const Format& f : formats()) {
        // k: a partial step (2 super-blocks), two warps' steps (5), and a
        // warp's second step (17), with the next step's weights loaded
        // ahead (1 and 2 rows) and without (5 rows); for the 32-weight
        // formats also a step whose last block is alone in its half (17
        // blocks). Groups: one a block, two or three (a warp's units across
        // groups, a partial last block, three matrices' blocks side by side),
        // and a block's most.
        failed += !check_gemv(f, {5}, 512, 1, 1);
        failed += !check_gemv(f, {5}, 512, 3, 1);
        failed += !check_gemv(f, {5}, 1280, 2, 3);
        failed += !check_gemv(f, {3}, 4352, 5, 1);
        failed += !check_gemv(f, {4}, 4352, 1, 1);
        failed += !check_gemv(f, {3}, 4352, 2, 1);
        failed += !check_gemv(f, {9, 5, 7}, 1280, 1, 3);
        failed += !check_gemv(f, {9, 5, 7}, 4352, 4, 2);
        failed += !check_gemv(f, {37}, 512, 2, kMaxGroups[1]);
        failed += !check_gemv(f, {37}, 512, 8, kMaxGroups[3]);
        if (f.elems == 32) failed += !check_gemv(f, {5}, 544, 8, 1);
        failed += !check_glu(f, 64, 1280, 1, 16, true);
        failed += !check_glu(f, 64, 512, 3, 8, true);
        failed += !check_glu(f, 13, 1280, 2, 3, false);
        // The pipelined one-row kernel: a partial step, a warp's units
        // wrapping its ring of stages more than once (17 super-blocks: 5
        // steps, 3 groups: 15 units over 4 warps), three matrices, a block's
        // most groups, and gate/up with the product quantized.
        failed += !check_gemv(f, {5}, 512, 1, 1, true);
        failed += !check_gemv(f, {4}, 4352, 1, 1, true);
        failed += !check_gemv(f, {7}, 4352, 1, 3, true);
        failed += !check_gemv(f, {9, 5, 7}, 1280, 1, 3, true);
        failed += !check_gemv(f, {37}, 512, 1, kMaxGroups[0], true);
        failed += !check_glu(f, 64, 1280, 1, 16, true, true);
        failed += !check_glu(f, 13, 4352, 1, 3, false, true);
    }
    return failed ? 1 : 0;
}
