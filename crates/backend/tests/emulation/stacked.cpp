// The launches around one GEMM of stacked weights (kernels/stacked.cu), run
// under the host emulation of shim.h against the ops written out plainly:
// split_cols copies each part's columns of the stacked product into its own
// activation and adds its bias (three parts, two parts, with and without
// biases), silu_mul_stacked forms the SiLU product of the gate and up halves
// of each row with silu_mul's arithmetic, with and without the bf16 copy.
// Grids smaller than the work, so the grid-stride loops go round; guard
// values past every output must stay as they were. Built and run by
// crates/backend/tests/kernels_emulated.rs; exits 1 when a comparison fails.
#include "shim.h"
#include "checks.h"
#include <cstdio>
#include <random>
#include <string>

inline bf16_t f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

#include "../../kernels/stacked.cu"

namespace {

using emu_checks::check;
using emu_checks::failures;
using emu_checks::GUARD;
using emu_checks::random;

void split_case(std::mt19937& rng, int rows, std::vector<int> widths, std::vector<bool> biased) {
    int ld = 0;
    for (int w : widths) ld += w;
    std::vector<float> src = random(rng, (size_t)rows * ld, 4.0f);
    std::vector<std::vector<float>> dst(3), bias(3);
    for (size_t j = 0; j < widths.size(); j++) {
        dst[j].assign((size_t)rows * widths[j] + 8, GUARD);
        if (biased[j]) bias[j] = random(rng, widths[j], 1.0f);
    }
    auto d = [&](int j) { return j < (int)widths.size() ? dst[j].data() : nullptr; };
    auto b = [&](int j) { return j < (int)widths.size() && biased[j] ? bias[j].data() : nullptr; };
    auto c = [&](int j) { return j < (int)widths.size() ? widths[j] : 0; };
    launch({2, 1, 1}, 64, [&] {
        split_cols(src.data(), ld, rows, d(0), c(0), b(0), d(1), c(1), b(1), d(2), c(2), b(2));
    });
    bool ok = true;
    int off = 0;
    for (size_t j = 0; j < widths.size(); j++) {
        for (int r = 0; r < rows; r++)
            for (int col = 0; col < widths[j]; col++) {
                float want = src[(size_t)r * ld + off + col];
                if (biased[j]) want += bias[j][col];
                ok &= dst[j][(size_t)r * widths[j] + col] == want;
            }
        for (int g = 0; g < 8; g++) ok &= dst[j][(size_t)rows * widths[j] + g] == GUARD;
        off += widths[j];
    }
    std::string name = "split_cols " + std::to_string(rows) + " rows, widths";
    for (size_t j = 0; j < widths.size(); j++)
        name += " " + std::to_string(widths[j]) + (biased[j] ? "+bias" : "");
    check(name, ok);
}

void silu_case(std::mt19937& rng, int rows, int cols, bool with_bf) {
    const int ld = 2 * cols;
    std::vector<float> g = random(rng, (size_t)rows * ld, 6.0f);
    std::vector<float> out((size_t)rows * cols + 8, GUARD);
    std::vector<bf16_t> bf((size_t)rows * cols + 8, (bf16_t)0xbeef);
    launch({3, 1, 1}, 32, [&] {
        silu_mul_stacked(g.data(), ld, cols, rows, out.data(), with_bf ? bf.data() : nullptr);
    });
    bool ok = true;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            float v = g[(size_t)r * ld + c], u = g[(size_t)r * ld + cols + c];
            float want = v / (1.0f + expf(-v)) * u;
            size_t at = (size_t)r * cols + c;
            ok &= out[at] == want;
            ok &= bf[at] == (with_bf ? f32_to_bf16(want) : (bf16_t)0xbeef);
        }
    for (int i = 0; i < 8; i++) {
        ok &= out[(size_t)rows * cols + i] == GUARD;
        ok &= bf[(size_t)rows * cols + i] == (bf16_t)0xbeef;
    }
    check("silu_mul_stacked " + std::to_string(rows) + "x" + std::to_string(cols) + (with_bf ? " with" : " without") +
              " the bf16 copy",
          ok);
}

} // namespace

int main() {
    std::mt19937 rng(7);
    split_case(rng, 5, {24, 8, 8}, {false, false, false});
    split_case(rng, 7, {32, 12, 12}, {true, true, true});
    split_case(rng, 3, {16, 20}, {false, true});
    split_case(rng, 1, {4, 4, 4}, {true, false, true});
    silu_case(rng, 5, 20, true);
    silu_case(rng, 2, 36, false);
    silu_case(rng, 1, 4, true);
    std::printf("%d failed\n", failures);
    return failures ? 1 : 0;
}
