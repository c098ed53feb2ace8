// The residual add + RMSNorm folded into the GEMVs around it
// (kernels/fold.cu), run under the host emulation of shim.h against the op
// written out in double: the producer's epilogue over blocks of four and of
// two rows (a last block with fewer rows than the others) adds each row to
// the residual, stores x * w and one sum of squares per block; a consumer's
// grid (fewer blocks than the row has threads, so the grid-stride store goes
// round) finds 1 / rms from those sums and stores the norm; `fold_settle`
// alone gives the same bits. Every block of the grid must find the same
// 1 / rms; values past every output must stay as they were. Built and run by
// crates/backend/tests/kernels_emulated.rs; exits 1 when a comparison fails.
#include "shim.h"
#include "block_sum.h"
#include "checks.h"
#include <cstdio>
#include <random>
#include <string>


#include "../../kernels/fold.cu"

namespace {

using emu_checks::check;
using emu_checks::failures;
using emu_checks::GUARD;
using emu_checks::random;

bool guarded(const std::vector<float>& v, size_t from) {
    for (size_t i = from; i < v.size(); i++)
        if (v[i] != GUARD) return false;
    return true;
}

void fold_case(std::mt19937& rng, int cols, int nw, unsigned consumers) {
    const float eps = 1e-5f;
    std::string name = std::to_string(cols) + " columns, blocks of " + std::to_string(nw) + " rows";
    std::vector<float> x = random(rng, cols, 2.0f), proj = random(rng, cols, 1.0f), w = random(rng, cols, 1.0f);
    std::vector<float> x0 = x;
    int blocks = (cols + nw - 1) / nw;
    std::vector<float> hw(cols + 8, GUARD), slots(blocks + 8, GUARD);
    // The producer's epilogue: its first warp, lane t holding row j0 + t's sum.
    launch({(unsigned)blocks, 1, 1}, 32, [&] {
        int j0 = blockIdx.x * nw, live = imin(nw, cols - j0);
        float s = (int)threadIdx.x < live ? proj[j0 + threadIdx.x] : 0.f;
        fold_residual(s, live, j0, x.data(), w.data(), hw.data(), slots.data());
    });
    bool ok = true;
    double ss = 0.0;
    for (int j = 0; j < cols; j++) {
        float h = x0[j] + proj[j];
        ok = ok && x[j] == h && hw[j] == h * w[j];
        ss += (double)h * h;
    }
    check(name + ": the residual and x * w", ok);
    check(name + ": nothing past x * w or the slots", guarded(hw, cols) && guarded(slots, blocks));
    // A consumer's grid: every block's 1 / rms, and the norm stored by all of them.
    std::vector<float> invs(consumers, 0.f), h(cols + 8, GUARD);
    launch({consumers, 1, 1}, 128, [&] {
        float inv = fold_inv_rms(slots.data(), blocks, cols, eps);
        if (threadIdx.x == 0) invs[blockIdx.x] = inv;
        fold_store_norm(hw.data(), inv, h.data(), cols);
    });
    bool same = true;
    for (float v : invs) same = same && std::memcmp(&v, &invs[0], 4) == 0;
    check(name + ": every block's 1 / rms is the same bits", same);
    double inv = 1.0 / std::sqrt(ss / cols + eps), scale = 0.0, err = 0.0;
    for (int j = 0; j < cols; j++) {
        double want = ((double)x0[j] + proj[j]) * inv * w[j];
        scale = std::max(scale, std::fabs(want));
        err = std::max(err, std::fabs(h[j] - want));
    }
    std::printf("     %s: norm error %.2e of %.3f\n", name.c_str(), err, scale);
    check(name + ": the norm against the reference", err <= 1e-5 * scale);
    check(name + ": nothing past the norm", guarded(h, cols));
    // The last step as a kernel of its own: the same bits.
    std::vector<float> h2(cols + 8, GUARD);
    launch({1, 1, 1}, 256, [&] { fold_settle(hw.data(), slots.data(), blocks, h2.data(), cols, eps); });
    check(name + ": fold_settle stores the same bits", std::memcmp(h.data(), h2.data(), 4 * h.size()) == 0);
}

} // namespace

int main() {
    std::mt19937 rng(7);
    fold_case(rng, 1032, 4, 3);
    fold_case(rng, 1030, 4, 2); // a last block of two rows
    fold_case(rng, 264, 2, 1);
    fold_case(rng, 263, 2, 5); // a last block of one row
    std::printf("%d failed\n", failures);
    return failures ? 1 : 0;
}
