// The routed expert FFN's kernels of kernels/moe.cu, run under the host
// emulation of shim.h (mma.sync from mma.h), against the op written out from
// its definition in double precision: routing and grouping (moe_route_sort,
// one row and several), the bf16 gate/up/SiLU GEMVs (moe_gemv_gate_up_bf16_p1,
// _p4) and the bf16 down GEMVs, fused with the weighted sum
// (moe_gemv_down_combine_bf16) and per expert (moe_gemv_down_bf16_p1, _p4,
// then moe_combine); and the grouped GEMM of prefill (moe_gemm_gate_up,
// moe_gemm_down) over bf16 experts and block-format ones, those of llama.cpp's
// default mixes decoded by groups of 8 (blocks.cu `deq8_bf16`, never through
// `load_elem`). The cases cover K ranges of several passes and partial ones,
// output counts that are not a multiple of a block's, experts with more pairs
// than a group of four or a GEMM tile, and fewer, as many and more slots than
// a down block has warps. The warp shuffles are emulated from their PTX
// definitions and the streaming loads as plain loads; what the emulation
// cannot show (a missing barrier's race, register spills, the speed) the GPU
// check in cuda/check.rs and scripts/check_kernels.py cover. Built and run by
// crates/backend/tests/kernels_emulated.rs; exits 1 when a comparison fails.
#include "formats.h"
#include "mma.h"
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>

// What moe.cu takes from kernels/common.cu and kernels/gemv.cu (compiled
// ahead of it in one program) and from the CUDA built-ins.
#define NEG_INF (-INFINITY)
inline int __float_as_int(float f) { return (int)__float_as_uint(f); }
inline bf16_t f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }

#include "../../kernels/blocks.cu"
#include "../../kernels/parts.cu"
#include "../../kernels/moe.cu"

namespace {

double silu(double v) { return v / (1 + std::exp(-v)); }

struct Case {
    const char* name;
    int hidden, ffn, experts, k, norm, rows;
    // Added to experts 0 and 1 in every row's logits, so that rows share them.
    float shared;
    bool gate_up, down;
};

// Max |got - want| over max |want|, against `tol`; NaN (never written) fails.
bool compare(const std::string& what, const std::vector<float>& got, const std::vector<double>& want,
             double tol) {
    double err = 0, scale = 1e-30;
    for (size_t i = 0; i < want.size(); i++) {
        scale = std::max(scale, std::fabs(want[i]));
        err = std::isnan(got[i]) ? INFINITY : std::max(err, std::fabs(got[i] - want[i]));
    }
    bool ok = err <= tol * scale;
    printf("%s %s: rel %.2e (tol %.0e)\n", ok ? "PASS" : "FAIL", what.c_str(), err / scale, tol);
    return ok;
}

bool check(const std::string& what, bool ok) {
    printf("%s %s\n", ok ? "PASS" : "FAIL", what.c_str());
    return ok;
}

std::vector<bf16_t> bf16_matrix(int rows, int cols) {
    std::vector<bf16_t> m((size_t)rows * cols);
    float s = 0.5f / std::sqrt((float)cols);
    for (auto& v : m) v = f32_to_bf16(rnd(s));
    return m;
}

// f32 results agree with the double reference to rounding (K up to ~1200
// terms); a lost or misplaced chunk is off by percents.
const double TOL = 1e-5;

bool run(const Case& c) {
    const int H = c.hidden, F = c.ffn, E = c.experts, k = c.k, rows = c.rows, P = rows * k;
    const std::string name = std::string(c.name) + ": ";
    int failed = 0;
    std::vector<std::vector<bf16_t>> gate, up, down;
    std::vector<u64> table;
    for (int e = 0; e < E; e++) {
        gate.push_back(bf16_matrix(F, H));
        up.push_back(bf16_matrix(F, H));
        down.push_back(bf16_matrix(H, F));
        table.push_back((u64)(uintptr_t)gate[e].data());
        table.push_back((u64)(uintptr_t)up[e].data());
        table.push_back((u64)(uintptr_t)down[e].data());
    }
    auto wt = [](const std::vector<bf16_t>& m, int cols, int r, int c) {
        return (double)bf16_to_f32(m[(size_t)r * cols + c]);
    };
    std::vector<float> x((size_t)rows * H), logits((size_t)rows * E);
    for (auto& v : x) v = rnd(1.f);
    for (int r = 0; r < rows; r++)
        for (int e = 0; e < E; e++) logits[(size_t)r * E + e] = rnd(2.f) + (e < 2 ? c.shared : 0.f);

    // Routing from its definition: softmax over every expert, the top k
    // (ties to the lower index), renormalized when asked.
    std::vector<int> ref_ids(P);
    std::vector<double> ref_wts(P);
    for (int r = 0; r < rows; r++) {
        const float* l = &logits[(size_t)r * E];
        double m = *std::max_element(l, l + E), sum = 0;
        for (int e = 0; e < E; e++) sum += std::exp(l[e] - m);
        std::vector<int> order(E);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b]; });
        double kept = 0;
        for (int s = 0; s < k; s++) kept += std::exp(l[order[s]] - m) / sum;
        for (int s = 0; s < k; s++) {
            ref_ids[r * k + s] = order[s];
            ref_wts[r * k + s] = std::exp(l[order[s]] - m) / sum / (c.norm ? kept : 1.0);
        }
    }

    std::vector<int> ids(P, -1), pos_of_pair(P, -1), pair_of_pos(P, -1), active(3 * E, -1);
    std::vector<int> tiles(3 * (P + E), -1);
    std::vector<float> wts(P, NAN);
    int n_active = -1, n_tiles = -1;
    launch({1, 1, 1}, 1024, [&] {
        moe_route_sort(logits.data(), rows, E, k, c.norm, ids.data(), wts.data(), pos_of_pair.data(),
                       pair_of_pos.data(), &n_active, active.data(), &n_tiles, tiles.data());
    });
    failed += !check(name + "moe_route_sort ids", ids == ref_ids);
    failed += !compare(name + "moe_route_sort weights", wts, ref_wts, TOL);
    // The grouping: a permutation of the pairs, and the experts in use, each
    // once, over consecutive ranges of the positions of exactly its pairs.
    bool grouped = n_active > 0 && n_active <= E;
    for (int p = 0; p < P && grouped; p++)
        grouped = pos_of_pair[p] >= 0 && pos_of_pair[p] < P && pair_of_pos[pos_of_pair[p]] == p;
    std::vector<bool> seen(E, false);
    for (int a = 0, next = 0; a < n_active && grouped; a++) {
        int e = active[3 * a], first = active[3 * a + 1], end = active[3 * a + 2];
        grouped = e >= 0 && e < E && !seen[e] && first == next && end > first;
        for (int pos = first; pos < end && grouped; pos++) grouped = ids[pair_of_pos[pos]] == e;
        seen[e] = true;
        next = end;
        if (a == n_active - 1) grouped = grouped && end == P;
    }
    failed += !check(name + "moe_route_sort grouping", grouped);
    if (!grouped) return false;
    const unsigned slots = std::min(E, P);

    // act[pos] by position; its reference from the definition.
    std::vector<float> act((size_t)P * F);
    if (c.gate_up) {
        std::vector<double> want((size_t)P * F);
        for (int p = 0; p < P; p++) {
            int e = ref_ids[p];
            const float* xr = &x[(size_t)(p / k) * H];
            for (int j = 0; j < F; j++) {
                double g = 0, u = 0;
                for (int h = 0; h < H; h++) {
                    g += wt(gate[e], H, j, h) * xr[h];
                    u += wt(up[e], H, j, h) * xr[h];
                }
                want[(size_t)pos_of_pair[p] * F + j] = silu(g) * u;
            }
        }
        using GateUp = void (*)(const u64*, long long, const float*, int, int, int, const int*, const int*,
                                const int*, float*);
        const GateUp kernels[2] = {moe_gemv_gate_up_bf16_p4, moe_gemv_gate_up_bf16_p1};
        const char* names[2] = {"moe_gemv_gate_up_bf16_p4", "moe_gemv_gate_up_bf16_p1"};
        for (int v = 0; v < 2; v++) {
            std::fill(act.begin(), act.end(), NAN);
            launch({(unsigned)((F + MOE_GU_COLS - 1) / MOE_GU_COLS), slots, 1}, MOE_GU_WARPS * 32, [&] {
                kernels[v](table.data(), 2LL * H, x.data(), H, F, k, pair_of_pos.data(), &n_active, active.data(),
                           act.data());
            });
            failed += !compare(name + names[v], act, want, TOL);
        }
    } else {
        for (auto& v : act) v = rnd(1.f);
    }
    if (!c.down) return failed == 0;

    // out[r][i] = sum over slots of w * (down_e[i] · act[pos]), from whatever act holds.
    std::vector<double> want((size_t)rows * H, 0.0);
    for (int r = 0; r < rows; r++)
        for (int s = 0; s < k; s++) {
            int p = r * k + s, e = ref_ids[p];
            const float* a = &act[(size_t)pos_of_pair[p] * F];
            for (int i = 0; i < H; i++) {
                double d = 0;
                for (int j = 0; j < F; j++) d += wt(down[e], F, i, j) * a[j];
                want[(size_t)r * H + i] += ref_wts[p] * d;
            }
        }
    std::vector<float> out((size_t)rows * H, NAN);
    // The fused form is for few rows (a block per MOE_DN_ROWS outputs of a row).
    if (rows <= 3) {
        launch({(unsigned)((H + MOE_DN_ROWS - 1) / MOE_DN_ROWS), (unsigned)rows, 1}, MOE_DN_WARPS * 32, [&] {
            moe_gemv_down_combine_bf16(table.data(), 2LL * F, act.data(), F, H, k, ids.data(), wts.data(),
                                       pos_of_pair.data(), out.data());
        });
        failed += !compare(name + "moe_gemv_down_combine_bf16", out, want, TOL);
    }
    using Down = void (*)(const u64*, long long, const float*, int, int, const int*, const int*, float*);
    const Down kernels[2] = {moe_gemv_down_bf16_p4, moe_gemv_down_bf16_p1};
    const char* names[2] = {"moe_gemv_down_bf16_p4 + moe_combine", "moe_gemv_down_bf16_p1 + moe_combine"};
    const int per_block = MOE_DN_WARPS * MOE_DN_ROWS;
    for (int v = 0; v < 2; v++) {
        std::vector<float> ys((size_t)P * H, NAN);
        std::fill(out.begin(), out.end(), NAN);
        launch({(unsigned)((H + per_block - 1) / per_block), slots, 1}, MOE_DN_WARPS * 32, [&] {
            kernels[v](table.data(), 2LL * F, act.data(), F, H, &n_active, active.data(), ys.data());
        });
        launch({(unsigned)rows, 1, 1}, 256,
               [&] { moe_combine(ys.data(), wts.data(), pos_of_pair.data(), k, H, out.data()); });
        failed += !compare(name + names[v], out, want, TOL);
    }
    return failed == 0;
}

// The grouped GEMM of prefill (moe_gemm_gate_up, moe_gemm_down) over experts
// of block format `f` (bf16 for `f` null): `rows` rows, each routed to
// expert 0 and one of 1 and 3 (expert 2 idle), so expert 0's pairs span a
// whole tile of MOE_BM and a partial one; two grid slots past the tiles in
// use. gate/up against the weights dequantized in double and the input
// rounded to bf16 as the kernel rounds it; down against the act the kernel
// wrote (bf16). The kernel rounds the weights to bf16 too (the word-wise
// decoders round a group's scale and offset first), and sums K terms in f32:
// a relative error of a few 2^-9 of the largest output; 2e-2 of it, while a
// misread group or a lost tile is off by the whole.
bool check_gemm(const Format* f, int rows, int hidden, int ffn) {
    const int E = 4, k = 2, P = rows * k;
    std::vector<std::vector<u8>> mats;
    std::vector<std::vector<double>> deq;
    auto matrix = [&](int n, int kk) {
        std::vector<u8> m;
        std::vector<double> d((size_t)n * kk);
        if (f) {
            m = random_blocks(*f, n * kk / f->elems);
            m.resize(m.size() + 16);
            for (int b = 0; b < n * kk / f->elems; b++) f->decode(&m[(size_t)b * f->bytes], &d[(size_t)b * f->elems]);
        } else {
            std::vector<bf16_t> w = bf16_matrix(n, kk);
            m.resize(w.size() * 2);
            memcpy(m.data(), w.data(), m.size());
            for (size_t i = 0; i < w.size(); i++) d[i] = bf16_to_f32(w[i]);
        }
        mats.push_back(std::move(m));
        deq.push_back(std::move(d));
    };
    for (int e = 0; e < E; e++) matrix(ffn, hidden), matrix(ffn, hidden), matrix(hidden, ffn);
    std::vector<u64> table;
    for (auto& m : mats) table.push_back((u64)(uintptr_t)m.data());
    long long rb_gu = f ? (long long)hidden / f->elems * f->bytes : 2LL * hidden;
    long long rb_dn = f ? (long long)ffn / f->elems * f->bytes : 2LL * ffn;
    int dt = f ? f->dt : DT_BF16;
    // The routing as moe_route_sort leaves it: pairs by expert, tiles of at most MOE_BM.
    std::vector<int> ids(P);
    for (int r = 0; r < rows; r++) ids[r * k] = 0, ids[r * k + 1] = rng() % 2 ? 1 : 3;
    std::vector<int> pair_of_pos(P), tiles;
    std::iota(pair_of_pos.begin(), pair_of_pos.end(), 0);
    std::stable_sort(pair_of_pos.begin(), pair_of_pos.end(), [&](int a, int b) { return ids[a] < ids[b]; });
    for (int p = 0; p < P;) {
        int e = ids[pair_of_pos[p]], end = p;
        while (end < P && ids[pair_of_pos[end]] == e && end - p < MOE_BM) end++;
        tiles.insert(tiles.end(), {e, p, end});
        p = end;
    }
    int n_tiles = (int)tiles.size() / 3;
    unsigned slots = (unsigned)n_tiles + 2;
    tiles.resize(3 * slots, -1);
    std::vector<float> x((size_t)rows * hidden);
    for (auto& v : x) v = rnd(1.f);
    std::vector<bf16_t> act((size_t)P * ffn + ffn, 0x7fc0);
    load_elem_calls = 0;
    launch({(unsigned)((ffn + MOE_BN - 1) / MOE_BN), slots, 1}, 128, [&] {
        moe_gemm_gate_up(table.data(), dt, rb_gu, x.data(), hidden, ffn, k, pair_of_pos.data(), &n_tiles,
                         tiles.data(), act.data());
    });
    std::vector<float> got((size_t)P * ffn);
    std::vector<double> want((size_t)P * ffn);
    for (int p = 0; p < P; p++) {
        int e = ids[pair_of_pos[p]];
        const float* xr = &x[(size_t)(pair_of_pos[p] / k) * hidden];
        for (int j = 0; j < ffn; j++) {
            double g = 0, u = 0;
            for (int h = 0; h < hidden; h++) {
                double xv = bf16_to_f32(f32_to_bf16(xr[h]));
                g += deq[3 * e][(size_t)j * hidden + h] * xv;
                u += deq[3 * e + 1][(size_t)j * hidden + h] * xv;
            }
            want[(size_t)p * ffn + j] = silu(g) * u;
            got[(size_t)p * ffn + j] = bf16_to_f32(act[(size_t)p * ffn + j]);
        }
    }
    std::string name = std::string(f ? f->name : "bf16") + " grouped GEMM, " + std::to_string(rows) + " rows";
    int failed = !compare(name + ": moe_gemm_gate_up", got, want, 2e-2);
    failed += !check(name + ": nothing past the pairs", act[(size_t)P * ffn] == 0x7fc0);
    std::vector<float> ys((size_t)P * hidden, NAN);
    launch({(unsigned)((hidden + MOE_BN - 1) / MOE_BN), slots, 1}, 128, [&] {
        moe_gemm_down(table.data(), dt, rb_dn, act.data(), ffn, hidden, &n_tiles, tiles.data(), ys.data());
    });
    std::vector<double> want_y((size_t)P * hidden);
    for (int p = 0; p < P; p++) {
        int e = ids[pair_of_pos[p]];
        for (int i = 0; i < hidden; i++) {
            double d = 0;
            for (int j = 0; j < ffn; j++) d += deq[3 * e + 2][(size_t)i * ffn + j] * got[(size_t)p * ffn + j];
            want_y[(size_t)p * hidden + i] = d;
        }
    }
    failed += !compare(name + ": moe_gemm_down", ys, want_y, 2e-2);
    // Q4_K_M's formats and Q8_0 through the word-wise decoders, never an element at a time.
    bool word_wise = f && std::string("Q4_K Q6_K Q8_0").find(f->name) != std::string::npos;
    if (word_wise) failed += !check(name + ": decoded by groups of 8 (no load_elem)", load_elem_calls == 0);
    return failed == 0;
}

} // namespace

int main() {
    // name, hidden, ffn, experts, top k, normed, rows, shared, gate/up, down
    std::vector<Case> cases = {
        // One decode row, Qwen3-30B-A3B's top 8 of many experts (one pair each).
        {"1 row, top 8 of 16", 128, 32, 16, 8, 1, 1, 0.f, true, true},
        // More experts than a lane holds in registers (the routing's loop), not renormalized.
        {"1 row, top 4 of 300, not renormalized", 64, 20, 300, 4, 0, 1, 0.f, true, false},
        // gate/up K of two passes, the second partial (145 chunks over 128
        // threads); 42 outputs, not a multiple of a block's 4.
        {"2 rows, hidden 1160, ffn 42", 1160, 42, 16, 4, 0, 2, 0.f, true, false},
        // Every row takes experts 0 and 1: six pairs each, a group of four
        // and a tail of two in the _p4 kernels.
        {"6 rows sharing two experts", 64, 16, 8, 4, 1, 6, 8.f, true, true},
        // Down rows of 101 chunks (two passes of a lane's 96), 66 outputs (a
        // partial warp and block), 3 slots: each split over two warps, two
        // warps idle.
        {"3 rows, ffn 808, top 3", 66, 808, 8, 3, 1, 3, 0.f, false, true},
        // 10 slots: two rounds of a down block's 8 warps, the second of 2.
        {"2 rows, top 10", 40, 808, 12, 10, 1, 2, 0.f, false, true},
    };
    int failed = 0;
    for (auto& c : cases) failed += !run(c);
    // The grouped GEMM: bf16 experts, formats decoded by groups of 8
    // (Q4_K_M's Q4_K and Q6_K, Q8_0) and one element by element (Q5_0).
    failed += !check_gemm(nullptr, 66, 256, 96);
    for (const Format& f : formats())
        if (std::string("Q4_K Q6_K Q8_0 Q5_0").find(f.name) != std::string::npos)
            failed += !check_gemm(&f, 66, 256, 256);
    return failed ? 1 : 0;
}
