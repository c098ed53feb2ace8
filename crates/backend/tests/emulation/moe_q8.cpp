// The routed integer GEMVs of block-format experts (kernels/moe_q8.cu), run
// under the host emulation of shim.h, the way moe.rs launches them: the
// input rows in 8 bits, each expert in use's gate/up/SiLU products into one
// row per pair in sorted position (moe_q8_gate_up_<fmt>), those rows
// quantized by q8_quantize (checked bit for bit against the reference rule),
// and each pair's down rows (moe_q8_down_<fmt>). Each output is compared
// with the pair's row dotted in double with the expert's weights dequantized
// from the format's definition (mmvq_ref.h). The routing is written here as
// moe_route_sort leaves it (pairs sorted by expert, `active` listing each
// expert in use with its first and end position): experts with one pair and
// with several, experts no row chose, grid slots past the experts in use
// (their blocks must leave without writing), every format for gate/up and
// down alike and Q4_K_M's mix (Q4_K gate/up, Q6_K down). Built and run by
// crates/backend/tests/kernels_emulated.rs; exits 1 when a comparison fails.
#include "mmvq_ref.h"
#include <algorithm>

typedef unsigned long long u64;
#include "../../kernels/moe_q8.cu"

namespace {

using GateUp = void (*)(const u64*, long long, const signed char*, const float2*, int, int, int, const int*,
                        const int*, const int*, float*, int);
using Down = void (*)(const u64*, long long, const signed char*, const float2*, int, int, const int*, const int*,
                      float*, int);
#define PAIR(stem) {moe_q8_gate_up_##stem, moe_q8_down_##stem}
struct Kernels {
    GateUp gate_up;
    Down down;
};
// As formats() lists them.
const Kernels kKernels[12] = {PAIR(q8_0), PAIR(q4_0), PAIR(q4_1), PAIR(q5_0), PAIR(q5_1), PAIR(iq4_nl),
                              PAIR(q2_k), PAIR(q3_k), PAIR(q4_k), PAIR(q5_k), PAIR(q6_k), PAIR(iq4_xs)};
Kernels kernels_of(const Format& f) { return kKernels[f.dt - DT_Q8_0]; }

struct Expert {
    Matrix gate, up, down;
    Expert(const Format& gu, const Format& dn, int hidden, int ffn)
        : gate(gu, ffn, hidden), up(gu, ffn, hidden), down(dn, hidden, ffn) {}
};

// `rows` rows, each routed to `k` distinct experts of `n_experts`, drawn so
// that expert 0 serves every row (several pairs) and the last expert none.
bool check_case(const Format& gu, const Format& dn, int n_experts, int k, int rows, int hidden, int ffn,
                int groups) {
    std::vector<Expert> experts;
    for (int e = 0; e < n_experts; e++) experts.emplace_back(gu, dn, hidden, ffn);
    std::vector<u64> table;
    for (auto& x : experts)
        for (const Matrix* m : {&x.gate, &x.up, &x.down}) table.push_back((u64)m->ptr());
    // The routing: ids[r k + s].
    int pairs = rows * k;
    std::vector<int> ids(pairs);
    for (int r = 0; r < rows; r++) {
        std::vector<int> pick(n_experts - 2);
        std::iota(pick.begin(), pick.end(), 1);
        std::shuffle(pick.begin(), pick.end(), rng);
        ids[r * k] = 0;
        for (int s = 1; s < k; s++) ids[r * k + s] = pick[s - 1];
    }
    std::vector<int> pair_of_pos(pairs);
    std::iota(pair_of_pos.begin(), pair_of_pos.end(), 0);
    std::stable_sort(pair_of_pos.begin(), pair_of_pos.end(), [&](int a, int b) { return ids[a] < ids[b]; });
    std::vector<int> active;
    for (int p = 0; p < pairs; p++) {
        int e = ids[pair_of_pos[p]];
        if (active.empty() || active[active.size() - 3] != e) active.insert(active.end(), {e, p, p});
        active.back() = p + 1;
    }
    int n_active = (int)active.size() / 3;
    // Grid slots as moe.rs launches them: min(experts, pairs), at least as many as in use.
    int slots = std::min(n_experts, pairs);
    active.resize(3 * slots, -1);

    Input x(rows, hidden);
    std::vector<float> act((size_t)pairs * ffn + ffn, NAN);
    int per = 2 * groups;
    Kernels kern = kernels_of(gu);
    launch({(unsigned)((ffn + per - 1) / per), (unsigned)slots, 1}, MMVQ_WARPS * 32, [&] {
        kern.gate_up(table.data(), experts[0].gate.row_bytes, (const signed char*)x.qa.data(), x.s.data(), hidden,
                     ffn, k, pair_of_pos.data(), &n_active, active.data(), act.data(), groups);
    });
    double worst_gu = 0;
    bool untouched = std::isnan(act[(size_t)pairs * ffn]);
    for (int p = 0; p < pairs; p++) {
        const Expert& ex = experts[ids[pair_of_pos[p]]];
        int r = pair_of_pos[p] / k;
        for (int j = 0; j < ffn; j++) {
            auto [gv, gm] = x.dot(ex.gate, hidden, r, j);
            auto [uv, um] = x.dot(ex.up, hidden, r, j);
            double sg = gv / (1 + std::exp(-gv)), ref = sg * uv;
            double bound = 1e-5 * (1.1 * gm * std::fabs(uv) + std::fabs(sg) * um) + 1e-6 * std::fabs(ref) + 1e-30;
            double got = act[(size_t)p * ffn + j];
            worst_gu = std::max(worst_gu, std::isnan(got) ? INFINITY : std::fabs(got - ref) / bound);
        }
    }
    // The products in 8 bits, as moe.rs quantizes them for down.
    act.resize((size_t)pairs * ffn);
    long long blocks = (long long)pairs * ffn / 32;
    std::vector<u32> aq((size_t)pairs * ffn / 4, 0xdeadbeef);
    std::vector<float2> as(blocks, {NAN, NAN});
    launch({(unsigned)((blocks * 8 + 255) / 256), 1, 1}, 256, [&] { q8_quantize(act.data(), aq.data(), as.data(), blocks); });
    bool codes = q8_matches(act, aq, as);
    Input a(act);
    std::vector<float> ys((size_t)pairs * hidden + hidden, NAN);
    Kernels dkern = kernels_of(dn);
    launch({(unsigned)((hidden + per - 1) / per), (unsigned)slots, 1}, MMVQ_WARPS * 32, [&] {
        dkern.down(table.data(), experts[0].down.row_bytes, (const signed char*)aq.data(), as.data(), ffn, hidden,
                   &n_active, active.data(), ys.data(), groups);
    });
    untouched = untouched && std::isnan(ys[(size_t)pairs * hidden]);
    double worst_dn = 0;
    for (int p = 0; p < pairs; p++) {
        const Expert& ex = experts[ids[pair_of_pos[p]]];
        for (int i = 0; i < hidden; i++) {
            auto [ref, mag] = a.dot(ex.down, ffn, p, i);
            double got = ys[(size_t)p * hidden + i];
            worst_dn = std::max(worst_dn, std::isnan(got) ? INFINITY : std::fabs(got - ref) / std::max(mag, 1e-30));
        }
    }
    bool ok = worst_gu <= 1.0 && worst_dn <= 1e-5 && codes && untouched;
    printf("%s moe_q8 %s/%s: %d experts top %d, %d rows, %d in use of %d slots, hidden %d, ffn %d, %d groups: "
           "gate/up %.2f of its bound, down %.2e of the sum of |terms|%s%s\n",
           ok ? "PASS" : "FAIL", gu.name, dn.name, n_experts, k, rows, n_active, slots, hidden, ffn, groups, worst_gu,
           worst_dn, codes ? "" : "; products' 8-bit copy DIFFERS", untouched ? "" : "; wrote past the pairs");
    return ok;
}

} // namespace

int main() {
    int failed = 0;
    std::vector<Format> fs = formats();
    auto by_name = [&](const char* n) {
        for (const Format& f : fs)
            if (std::string(f.name) == n) return f;
        abort();
    };
    // hidden: a partial step (2 super-blocks); ffn: 1 super-block; expert 0
    // with three pairs; a grid slot past the experts in use.
    for (const Format& f : fs) failed += !check_case(f, f, 6, 2, 3, 512, 256, 8);
    // Q4_K_M's experts: Q4_K gate/up, Q6_K down; one group a block and one
    // row, widths of several steps and a warp's second step, a block's most groups.
    const Format q4k = by_name("Q4_K"), q6k = by_name("Q6_K");
    failed += !check_case(q4k, q6k, 6, 2, 1, 512, 256, 1);
    failed += !check_case(q4k, q6k, 5, 3, 2, 4352, 256, 16);
    failed += !check_case(q4k, q6k, 8, 2, 1, 1280, 512, 16);
    return failed ? 1 : 0;
}
