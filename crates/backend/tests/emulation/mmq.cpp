// The tensor-core matmul of block-format weights, kernels/mmq.cu (mmq_*_n1,
// _n2, _n4, _n8 and mmq_reduce), run under the host emulation of shim.h with
// the tensor-core instructions of mma.h, against out[r][j] = sum_k w[j][k]
// x[r][k] in double, where w is every weight dequantized from the format's
// definition (formats.h) and x the bf16 input. The formats are those whose
// `deq8_bf16` / `deq8` in kernels/blocks.cu is word-wise (Q8_0, Q4_0, Q4_1,
// Q4_K, Q5_K, Q6_K); the others decode through common.cu's per-element `load_elem`,
// stood in for here by the reference decoders, so they would test nothing of
// the kernel that these do not. The cases cover every group size, one group
// and two or three with a short last one, last weight tiles of 16 and 11
// rows and one of 16 rows only, K slices (even and uneven) with their
// reduction, several chunks of one slice (both stages of the double buffer,
// refilled), and a last chunk of fewer than 256 weights; the weight rows lie
// row_bytes apart from a 16-byte aligned base, so Q8_0, Q4_0, Q4_1 and Q6_K
// rows (and Q6_K's chunks) start off 16-byte boundaries. Shared memory is
// poisoned (0xff bytes: NaN as bf16 and f16) before every block, the bytes
// past the kernel's layout and guard zones around the outputs are checked
// untouched, copies land only at their cp.async.wait_group, and a copy from
// outside the weights or the input fails (mma.h), so staging too little, too
// late or past the end fails too. Built and run by
// crates/backend/tests/kernels_emulated.rs; exits 1 when a comparison fails.
#include "formats.h"
#include "mma.h"

// What blocks.cu and mmq.cu take from kernels/common.cu (compiled ahead of
// them): the per-element decoder, for the formats without a word-wise one.
// mmq.cu's dynamic shared memory (`extern __shared__ ... mmq_smem[]` inside
// the kernel) is this array; shim.h's `__shared__` (a function-local static)
// would not declare it. The largest layout is Q8_0's (a 304-byte slot per
// weight row) with 8 tiles of input rows.
#undef __shared__
#define __shared__
alignas(16) u8 mmq_smem[2 * 64 * 304 + 2 * 8 * 8 * 288 * 2];

#include "../../kernels/blocks.cu"
#include "../../kernels/mmq.cu"

namespace {

using Mmq = void (*)(const u8*, long long, const bf16_t*, float*, int, int, int, int, int);
#define MMQS(stem) {mmq_##stem##_n1, mmq_##stem##_n2, mmq_##stem##_n4, mmq_##stem##_n8}
// Each format's kernels for groups of 1, 2, 4 and 8 tiles, as formats() lists them.
const Mmq kMmq[12][4] = {MMQS(q8_0), MMQS(q4_0), MMQS(q4_1), MMQS(q5_0), MMQS(q5_1), MMQS(iq4_nl),
                         MMQS(q2_k), MMQS(q3_k), MMQS(q4_k), MMQS(q5_k), MMQS(q6_k), MMQS(iq4_xs)};

// The layout's bytes, as the host computes them (matmul.rs `mmq_smem_bytes`).
int smem_bytes(const Format& f, int nt) {
    int b256 = f.bytes * 256 / f.elems, slot = 16 * (((b256 + 15) / 16 + 1) | 1);
    return 2 * MMQ_BN * slot + 2 * 8 * nt * MMQ_XSTRIDE * 2;
}

// Floats on either side of an output buffer that nothing may write.
const int kGuard = 64;
const u32 kGuardBits = 0x7fc0dead;
std::vector<float> guarded(size_t len) {
    std::vector<float> v(len + 2 * kGuard, NAN);
    for (int i = 0; i < kGuard; i++) memcpy(&v[i], &kGuardBits, 4), memcpy(&v[len + kGuard + i], &kGuardBits, 4);
    return v;
}
bool guards_intact(const std::vector<float>& v) {
    bool ok = true;
    for (int i = 0; i < kGuard; i++)
        ok &= memcmp(&v[i], &kGuardBits, 4) == 0 && memcmp(&v[v.size() - 1 - i], &kGuardBits, 4) == 0;
    return ok;
}

// One launch of `f`'s kernel for groups of `nt` tiles over `rows` input rows
// of k, n weight rows, K in slices of `kslice` (then mmq_reduce), against the
// reference.
bool check(const Format& f, int nt, int rows, int n, int k, int kslice) {
    const int ti = nt == 1 ? 0 : nt == 2 ? 1 : nt == 4 ? 2 : 3;
    const int groups = (rows + 8 * nt - 1) / (8 * nt), tiles = (n + MMQ_BN - 1) / MMQ_BN * groups;
    const int slices = (k + kslice - 1) / kslice;
    if (slices > 1 && kslice % 256) abort(); // matmul.rs `mmq_split`: whole super-blocks per slice
    const int per_row = k / f.elems;
    const long long row_bytes = (long long)per_row * f.bytes;
    // The weight rows from a 16-byte aligned base, as the arena places a tensor.
    std::vector<u8> w = random_blocks(f, n * per_row);
    std::vector<uint4> wa(w.size() / 16 + 1);
    memcpy(wa.data(), w.data(), w.size());
    const u8* wp = (const u8*)wa.data();
    std::vector<bf16_t> xb((size_t)rows * k);
    for (auto& v : xb) v = to_bf16(rnd(2.f));

    const size_t len = (size_t)rows * n;
    std::vector<float> out = guarded(len), part = guarded(slices > 1 ? slices * len : 0);
    float* dst = slices > 1 ? &part[kGuard] : &out[kGuard];
    const int need = smem_bytes(f, nt);
    if (need > (int)sizeof(mmq_smem)) abort();
    memset(mmq_smem, 0xff, sizeof(mmq_smem));
    Mmq kern = kMmq[f.dt - DT_Q8_0][ti];
    // The kernel reads global memory only by cp.async: none past the weight rows or the input.
    emu::global_buffers = {{wp, (size_t)n * row_bytes}, {xb.data(), xb.size() * sizeof(bf16_t)}};
    launch({(unsigned)tiles, (unsigned)slices, 1}, MMQ_WARPS * 32, [&] {
        // Nothing of the block before this one is left to read.
        if (threadIdx.x == 0) memset(mmq_smem, 0xff, need);
        __syncthreads();
        kern(wp, row_bytes, xb.data(), dst, n, k, rows, kslice, groups);
    });
    emu::global_buffers.clear();
    bool ok = guards_intact(out) && guards_intact(part);
    for (size_t i = need; i < sizeof(mmq_smem); i++) ok &= mmq_smem[i] == 0xff;
    if (slices > 1)
        launch({3, 1, 1}, 128, [&] { mmq_reduce(&part[kGuard], &out[kGuard], slices, (long long)len); });
    ok &= guards_intact(out);

    // Two references: the weights exact, and each rounded to bf16 as the
    // kernel does before the mma. Against the exact one: the rounding moves
    // a weight by up to 2^-9 of |w|, the bf16 input is exact, the products
    // are exact in f32 and their f32 sums over k <= 1280 add at most
    // 1280 * 2^-24 (< 2^-13) of the sum of magnitudes, so 2^-8 of sum |w x|
    // holds it with room. Against the rounded one only the f32 sums remain
    // (and, rarely, a weight whose f32 decode rounds to the other bf16 of a
    // near tie: 2^-8 of one term), so 2^-12 of sum |w x| holds it, and
    // weights lost, doubled or taken from another row, k or chunk exceed it.
    double worst = 0, worst_b = 0;
    std::vector<double> wrow(k), wker(k);
    const bool in_bf16 = f.dt == DT_Q4_0 || f.dt == DT_Q4_K || f.dt == DT_Q5_K || f.dt == DT_Q6_K;
    for (int j = 0; j < n; j++) {
        for (int b = 0; b < per_row; b++) {
            const u8* blk = wp + j * row_bytes + (size_t)b * f.bytes;
            f.decode(blk, &wrow[(size_t)b * f.elems]);
            kernel_bf16 = in_bf16;
            f.decode(blk, &wker[(size_t)b * f.elems]);
            kernel_bf16 = false;
        }
        for (int r = 0; r < rows; r++) {
            double ref = 0, mag = 0, refb = 0;
            for (int e = 0; e < k; e++) {
                double xv = bf16_to_f32(xb[(size_t)r * k + e]), t = wrow[e] * xv;
                ref += t, mag += std::fabs(t);
                refb += (in_bf16 ? wker[e] : bf16_to_f32(to_bf16((float)wrow[e]))) * xv;
            }
            double got = out[kGuard + (size_t)r * n + j], err = std::fabs(got - ref), errb = std::fabs(got - refb);
            ok &= err <= std::ldexp(mag, -8) && errb <= std::ldexp(mag, -12); // false for NaN
            worst = std::max(worst, std::isnan(got) ? INFINITY : err / std::max(mag, 1e-30));
            worst_b = std::max(worst_b, std::isnan(got) ? INFINITY : errb / std::max(mag, 1e-30));
        }
    }
    printf("%s mmq %s n%d: %d rows (%d group%s), n %d, k %d in %d slice%s: max error %.2e (%.2e against bf16 "
           "weights) of the sum of |terms|\n",
           ok ? "PASS" : "FAIL", f.name, nt, rows, groups, groups > 1 ? "s" : "", n, k, slices, slices > 1 ? "s" : "",
           worst, worst_b);
    return ok;
}

} // namespace

int main() {
    rng.seed(31);
    int failed = 0;
    for (const Format& f : formats()) {
        if (f.dt != DT_Q8_0 && f.dt != DT_Q4_0 && f.dt != DT_Q4_1 && f.dt != DT_Q4_K && f.dt != DT_Q5_K &&
            f.dt != DT_Q6_K)
            continue;
        // One group of 3 rows, K in two slices; one of 13 rows in 16, K in
        // three slices; 27 rows in one group of 32, five chunks of one slice
        // (the double buffer refilled); three groups of 16, the last of 8
        // rows, in two uneven slices (three chunks and two); two groups of
        // 64, the last of 6 rows; three groups of 32 over 16 weight rows (one
        // warp's: the other three clamp every row). n = 80 or 75: the second
        // weight tile has 16 or 11 rows, and with 75 the weights end off a
        // 16-byte boundary (a copy past them reads outside the buffer).
        failed += !check(f, 1, 3, 80, 512, 256);
        failed += !check(f, 2, 13, 75, 768, 256);
        failed += !check(f, 4, 27, 80, 1280, 1280);
        failed += !check(f, 2, 40, 64, 1280, 768);
        failed += !check(f, 8, 70, 80, 256, 256);
        failed += !check(f, 4, 72, 16, f.elems == 32 ? 544 : 512, f.elems == 32 ? 544 : 256);
        // A last chunk of one 32-weight block (k = 544: kw = 32) after two
        // whole ones, the rows 2-byte aligned (578 bytes apart for Q8_0:
        // every even offset from a 16-byte boundary).
        if (f.elems == 32) failed += !check(f, 1, 5, 75, 544, 544);
    }
    return failed ? 1 : 0;
}
