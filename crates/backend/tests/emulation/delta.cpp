// The kernels of kernels/delta.cu, run under the host emulation of shim.h,
// against references written out from crates/backend/src/cpu/delta.rs in
// double precision: several head shapes (one per kernel instantiation, the
// Qwen3.5-27B heads among them), every tap count, runs of steps that carry
// state, chunks shorter than the convolution window, a new sequence in a
// slot that held another, a padding entry of no slot, and prompts of whole
// and partial chunks of the delta rule's staging (DELTA_CHUNK tokens), and
// the hybrid tiny fixture's geometry under the model's own call pattern.
// The chunked delta rule (gated_delta_rule_chunked, k_dim up to
// DELTA_C_MAX_K) runs every step of every case beside the scan, on its own
// copy of the states, against the same reference.
// Built and run by crates/backend/tests/kernels_emulated.rs; exits 1
// when a comparison fails.
#include "shim.h"
#include <array>
#include <cstdio>
#include <random>
#include "../../kernels/delta.cu"

namespace {

std::mt19937 rng(7);
float rnd(float s) { return std::uniform_real_distribution<float>(-s, s)(rng); }
bf16_t to_bf16(float f) {
    u32 u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return (bf16_t)(u >> 16);
}
double silu(double x) { return x / (1 + std::exp(-x)); }

struct Geometry {
    int k_heads, v_heads, k_dim, v_dim, taps, tiled;
    int channels() const { return 2 * k_heads * k_dim + v_heads * v_dim; }
};
struct Seq {
    int row0, rows, cached, slot;
};

void ref_conv(std::vector<float>& x, const std::vector<float>& w, std::vector<float>& state,
              const std::vector<Seq>& seqs, Geometry g) {
    int C = g.channels(), taps = g.taps, keep = taps - 1;
    for (auto& s : seqs) {
        std::vector<float> in((size_t)(keep + s.rows) * C, 0.f);
        float* st = &state[(size_t)s.slot * keep * C];
        if (s.cached > 0) memcpy(in.data(), st, (size_t)keep * C * 4);
        memcpy(in.data() + (size_t)keep * C, &x[(size_t)s.row0 * C], (size_t)s.rows * C * 4);
        for (int t = 0; t < s.rows; t++)
            for (int c = 0; c < C; c++) {
                double acc = 0;
                for (int j = 0; j < taps; j++) acc += (double)w[c * taps + j] * in[(size_t)(t + j) * C + c];
                x[(size_t)(s.row0 + t) * C + c] = (float)silu(acc);
            }
        memcpy(st, in.data() + (size_t)s.rows * C, (size_t)keep * C * 4);
    }
}

struct DeltaInputs {
    const std::vector<float>&qkv, &a, &b, &decay, &dt_bias;
};

void ref_delta(const DeltaInputs& in, std::vector<float>& state, const std::vector<Seq>& seqs,
               std::vector<float>& out, Geometry g) {
    int dk = g.k_dim, dv = g.v_dim, vh = g.v_heads, key = g.k_heads * dk, C = g.channels();
    double scale = 1.0 / std::sqrt((double)dk);
    for (auto& s : seqs)
        for (int h = 0; h < vh; h++) {
            int kh = g.tiled ? h % g.k_heads : h / (vh / g.k_heads);
            float* S = &state[((size_t)s.slot * vh + h) * dk * dv];
            std::vector<double> m(dk * dv);
            for (int i = 0; i < dk * dv; i++) m[i] = s.cached > 0 ? S[i] : 0.0;
            for (int r = s.row0; r < s.row0 + s.rows; r++) {
                const float* row = &in.qkv[(size_t)r * C];
                std::vector<double> q(dk), k(dk), mem(dv, 0), o(dv, 0);
                double qq = 0, kk = 0;
                for (int i = 0; i < dk; i++) {
                    q[i] = row[kh * dk + i];
                    k[i] = row[key + kh * dk + i];
                    qq += q[i] * q[i];
                    kk += k[i] * k[i];
                }
                for (int i = 0; i < dk; i++) {
                    q[i] *= scale / std::sqrt(qq + 1e-6);
                    k[i] /= std::sqrt(kk + 1e-6);
                }
                double beta = 1 / (1 + std::exp(-(double)in.b[(size_t)r * vh + h]));
                double x = in.a[(size_t)r * vh + h] + in.dt_bias[h];
                double keep = std::exp(-in.decay[h] * (x > 20 ? x : std::log1p(std::exp(x))));
                for (int i = 0; i < dk; i++)
                    for (int j = 0; j < dv; j++) {
                        m[i * dv + j] *= keep;
                        mem[j] += m[i * dv + j] * k[i];
                    }
                for (int j = 0; j < dv; j++) mem[j] = (row[2 * key + h * dv + j] - mem[j]) * beta;
                for (int i = 0; i < dk; i++)
                    for (int j = 0; j < dv; j++) {
                        m[i * dv + j] += k[i] * mem[j];
                        o[j] += m[i * dv + j] * q[i];
                    }
                for (int j = 0; j < dv; j++) out[(size_t)r * vh * dv + h * dv + j] = (float)o[j];
            }
            for (int i = 0; i < dk * dv; i++) S[i] = (float)m[i];
        }
}

int failures = 0;

// Largest difference relative to the largest reference magnitude, checked against `tol`.
void compare(const std::string& what, const std::vector<float>& got, const std::vector<float>& want, double tol) {
    double scale = 1e-9, err = 0;
    for (size_t i = 0; i < got.size(); i++) {
        scale = std::max(scale, (double)std::fabs(want[i]));
        double d = std::fabs((double)got[i] - want[i]);
        err = std::max(err, d == d ? d : 1e30);
    }
    bool ok = err / scale <= tol && got.size() == want.size();
    failures += !ok;
    printf("%s %s: rel %.2e (tol %.0e)\n", ok ? "PASS" : "FAIL", what.c_str(), err / scale, tol);
}

// (slot, rows, cached) per sequence of a step.
using Step = std::vector<std::array<int, 3>>;

// `slot_major`: the kernels' state is one pool of slots holding both layers'
// states side by side (the convolution's, then the recurrent one, then
// padding), so each kernel steps over a whole slot between slots; otherwise
// each state is its own [slots, elems] buffer. The references keep their own
// [slots, elems] buffers either way.
// Which delta-rule kernels a case runs: the chunked one beside the scan
// wherever k_dim allows, or (a shape too costly to emulate twice) the scan alone.
enum class Rule { Both, ScanOnly };

void run_case(const std::string& name, Geometry g, int slots, const std::vector<Step>& steps,
              bool slot_major = false, Rule rule = Rule::Both) {
    int C = g.channels(), keep = g.taps - 1;
    std::vector<float> w(C * g.taps);
    std::vector<bf16_t> wb(w.size());
    for (size_t i = 0; i < w.size(); i++) {
        wb[i] = to_bf16(rnd(0.6f));
        w[i] = bf16_to_f32(wb[i]);
    }
    std::vector<float> decay(g.v_heads), dt_bias(g.v_heads);
    for (auto& v : decay) v = 0.05f + 1.5f * std::fabs(rnd(1));
    for (auto& v : dt_bias) v = rnd(1);
    // The slots start out holding garbage: a sequence with nothing cached must ignore it.
    const size_t conv_w = (size_t)keep * C, rec_w = (size_t)g.v_heads * g.k_dim * g.v_dim;
    std::vector<float> conv_r(slots * conv_w), rec_r(slots * rec_w);
    for (auto& v : conv_r) v = rnd(3);
    for (auto& v : rec_r) v = rnd(3);
    // The kernels' buffers: the same garbage, laid out as the case says.
    const size_t slot_w = slot_major ? conv_w + rec_w + 37 : 0;
    std::vector<float> pool(slot_major ? slots * slot_w : 0);
    for (auto& v : pool) v = rnd(3);
    std::vector<float> conv_k = conv_r, rec_k = rec_r;
    float* conv_base = conv_k.data();
    float* rec_base = rec_k.data();
    long long conv_stride = (long long)conv_w, rec_stride = (long long)rec_w;
    if (slot_major) {
        for (int sl = 0; sl < slots; sl++) {
            std::copy_n(&conv_r[sl * conv_w], conv_w, &pool[sl * slot_w]);
            std::copy_n(&rec_r[sl * rec_w], rec_w, &pool[sl * slot_w + conv_w]);
        }
        conv_base = pool.data();
        rec_base = pool.data() + conv_w;
        conv_stride = rec_stride = (long long)slot_w;
    }
    const std::vector<float> pool_start = pool;
    // The chunked kernel's own states: the same start, the same layout.
    const bool chunked = rule == Rule::Both && g.k_dim <= DELTA_C_MAX_K;
    std::vector<float> rec_c = rec_r, pool_c = pool;
    float* rec_base_c = slot_major ? pool_c.data() + conv_w : rec_c.data();
    for (size_t si = 0; si < steps.size(); si++) {
        std::vector<Seq> seqs;
        int rows = 0, most = 0;
        for (auto& e : steps[si]) {
            seqs.push_back({rows, e[1], e[2], e[0]});
            rows += e[1];
            most = std::max(most, e[1]);
        }
        std::vector<float> x((size_t)rows * C), a((size_t)rows * g.v_heads), b((size_t)rows * g.v_heads);
        for (auto& v : x) v = rnd(1);
        for (auto& v : a) v = rnd(2);
        for (auto& v : b) v = rnd(2);
        std::vector<u32> table;
        for (auto& s : seqs) table.insert(table.end(), {(u32)s.row0, (u32)s.rows, (u32)s.cached, (u32)s.slot});
        // A padding entry, as a decode step's table ends with: its blocks do nothing.
        table.insert(table.end(), {0, 1, 0, DELTA_NO_SLOT});
        unsigned entries = (unsigned)seqs.size() + 1;

        auto xk = x, xr = x;
        int warps = std::min(8, std::max(1, (most + 7) / 8));
        auto conv = g.taps == 2 ? causal_conv_silu_t2 : g.taps == 3 ? causal_conv_silu_t3 : g.taps == 4 ? causal_conv_silu_t4
                  : g.taps == 5 ? causal_conv_silu_t5 : causal_conv_silu_t6;
        launch({(unsigned)(C + 31) / 32, entries, 1}, 32 * warps,
               [&] { conv(xk.data(), (const u8*)wb.data(), DT_BF16, conv_base, conv_stride, table.data(), C); });
        ref_conv(xr, w, conv_r, seqs, g);
        std::string at = name + ", step " + std::to_string(si);
        compare("causal_conv_silu, " + at, xk, xr, 1e-5);

        std::vector<float> ok((size_t)rows * g.v_heads * g.v_dim), orf = ok;
        int nw = 1;
        while (32 * nw < g.k_dim) nw *= 2;
        auto delta = nw == 1 ? gated_delta_rule_w1 : nw == 2 ? gated_delta_rule_w2 : nw == 4 ? gated_delta_rule_w4 : gated_delta_rule_w8;
        launch({(unsigned)(g.v_dim + 31) / 32, (unsigned)g.v_heads, entries}, 32 * nw, [&] {
            delta(xr.data(), a.data(), b.data(), decay.data(), dt_bias.data(), rec_base, rec_stride, table.data(), ok.data(), C,
                  g.v_heads * g.v_dim, g.v_heads, g.k_heads, g.k_dim, g.v_dim, g.tiled, 1.0f / std::sqrt((float)g.k_dim));
        });
        ref_delta({xr, a, b, decay, dt_bias}, rec_r, seqs, orf, g);
        compare("gated_delta_rule, " + at, ok, orf, 1e-4);
        if (chunked) {
            std::vector<float> oc(orf.size());
            launch({(unsigned)(g.v_dim + 31) / 32, (unsigned)g.v_heads, entries}, DELTA_C_THREADS, [&] {
                gated_delta_rule_chunked(xr.data(), a.data(), b.data(), decay.data(), dt_bias.data(), rec_base_c,
                                         rec_stride, table.data(), oc.data(), C, g.v_heads * g.v_dim, g.v_heads,
                                         g.k_heads, g.k_dim, g.v_dim, g.tiled, 1.0f / std::sqrt((float)g.k_dim));
            });
            compare("gated_delta_rule_chunked, " + at, oc, orf, 1e-4);
        }
    }
    if (slot_major) {
        // Each slot's states back out of the pool; the padding between
        // slots is left exactly as it was.
        std::vector<float> pad_k, pad_r;
        for (int sl = 0; sl < slots; sl++) {
            std::copy_n(&pool[sl * slot_w], conv_w, &conv_k[sl * conv_w]);
            std::copy_n(&pool[sl * slot_w + conv_w], rec_w, &rec_k[sl * rec_w]);
            for (size_t i = conv_w + rec_w; i < slot_w; i++) {
                pad_k.push_back(pool[sl * slot_w + i]);
                pad_r.push_back(pool_start[sl * slot_w + i]);
            }
        }
        compare("padding between slots, " + name, pad_k, pad_r, 0);
        if (chunked) {
            std::vector<float> pad_c;
            for (int sl = 0; sl < slots; sl++) {
                std::copy_n(&pool_c[sl * slot_w + conv_w], rec_w, &rec_c[sl * rec_w]);
                // The chunked kernel touches nothing but the recurrent state.
                for (size_t i = 0; i < slot_w; i++)
                    if (i < conv_w || i >= conv_w + rec_w) pad_c.push_back(pool_c[sl * slot_w + i] - pool_start[sl * slot_w + i]);
            }
            compare("chunked: the rest of each slot untouched, " + name, pad_c, std::vector<float>(pad_c.size(), 0.f), 0);
        }
    }
    compare("convolution states, " + name, conv_k, conv_r, 1e-6);
    compare("recurrent states, " + name, rec_k, rec_r, 1e-4);
    if (chunked) compare("recurrent states (chunked), " + name, rec_c, rec_r, 1e-4);
}

void norm_and_gate() {
    const int rows = 3, hd = 128, heads = 5, n = rows * hd * heads;
    std::vector<float> x(n), z(n), w(hd);
    for (auto& v : x) v = rnd(2);
    for (auto& v : z) v = rnd(4);
    for (auto& v : w) v = rnd(1);
    auto xk = x, xr = x;
    launch({2, 1, 1}, 64, [&] { gated_rms_norm(xk.data(), z.data(), w.data(), hd, 1e-6f, rows * heads); });
    for (int h = 0; h < rows * heads; h++) {
        double s = 0;
        for (int j = 0; j < hd; j++) s += (double)xr[h * hd + j] * xr[h * hd + j];
        double inv = 1 / std::sqrt(s / hd + 1e-6);
        for (int j = 0; j < hd; j++) xr[h * hd + j] = (float)(xr[h * hd + j] * inv * w[j] * silu(z[h * hd + j]));
    }
    compare("gated_rms_norm, 15 heads of 128 over 4 warps", xk, xr, 1e-5);
    auto gk = x, gr = x;
    launch({3, 1, 1}, 64, [&] { sigmoid_mul(gk.data(), z.data(), n); });
    for (int i = 0; i < n; i++) gr[i] = (float)(gr[i] / (1 + std::exp(-(double)z[i])));
    compare("sigmoid_mul", gk, gr, 1e-6);
}

} // namespace

int main() {
    norm_and_gate();
    run_case("tiny fixture heads, prefill, decode, chunks", {2, 4, 16, 16, 4, 0}, 2,
             {{{1, 7, 0}}, {{1, 1, 7}}, {{1, 5, 8}}, {{1, 2, 13}}, {{1, 8, 15}}, {{1, 16, 23}}});
    // The hybrid fixture's calls as the model makes them (tests/fixtures/tiny/qwen3_5: key and value
    // heads of 16, half a value tile): its 21-token check prompt whole, the same prompt in chunks of
    // [2, 1, 7, 5, 6] on its cache, and three sequences (prompts of 7, 12 and 3) in slots 2, 0 and 3
    // decoded together in steps of 4 rows, reordered each step, the last row padding.
    run_case("tiny fixture, the 21-token prompt whole, then decode", {2, 4, 16, 16, 4, 0}, 2,
             {{{1, 21, 0}}, {{1, 1, 21}}, {{1, 1, 22}}});
    run_case("tiny fixture, the prompt in chunks of 2, 1, 7, 5, 6", {2, 4, 16, 16, 4, 0}, 2,
             {{{1, 2, 0}}, {{1, 1, 2}}, {{1, 7, 3}}, {{1, 5, 10}}, {{1, 6, 15}}});
    run_case("tiny fixture, 3 sequences in slots 2, 0, 3 decoded together", {2, 4, 16, 16, 4, 0}, 4,
             {{{2, 7, 0}},
              {{0, 12, 0}},
              {{3, 3, 0}},
              {{2, 1, 7}, {0, 1, 12}, {3, 1, 3}},
              {{2, 1, 8}, {3, 1, 4}, {0, 1, 13}},
              {{3, 1, 5}, {2, 1, 9}, {0, 1, 14}},
              {{3, 1, 6}, {0, 1, 15}, {2, 1, 10}}});
    // The scan alone: the chunked kernel's run of this shape (with fewer heads) is below.
    run_case("Qwen3.5-27B heads, two prompts then decode", {16, 48, 128, 128, 4, 0}, 3,
             {{{0, 3, 0}, {2, 2, 0}}, {{2, 1, 2}, {0, 1, 3}}}, false, Rule::ScanOnly);
    run_case("key heads of 128, long chunks (several convolution passes), a used slot", {2, 6, 128, 40, 4, 0}, 4,
             {{{0, 37, 0}, {3, 20, 0}}, {{0, 1, 37}, {3, 1, 20}}, {{3, 9, 0}, {0, 1, 38}}, {{0, 70, 39}}});
    run_case("key heads of 256, tiled value heads, 3 taps", {2, 4, 256, 33, 3, 1}, 3,
             {{{2, 12, 0}, {0, 2, 0}}, {{2, 1, 12}, {0, 1, 2}}});
    run_case("key heads of 40, 6 taps, a prompt shorter than the window", {2, 2, 40, 24, 6, 0}, 2,
             {{{1, 2, 0}}, {{1, 1, 2}}, {{1, 70, 3}}, {{1, 3, 73}}});
    run_case("key heads of 64, 2 taps, a batch", {1, 3, 64, 40, 2, 0}, 6,
             {{{5, 3, 0}, {1, 1, 0}, {2, 6, 0}}, {{5, 1, 3}, {1, 1, 1}, {2, 1, 6}}});
    run_case("5 taps, one row after one row", {1, 2, 32, 32, 5, 0}, 1, {{{0, 1, 0}}, {{0, 1, 1}}, {{0, 9, 2}}});
    // Slots of a pool holding both states side by side and padding, so the
    // kernels step over a whole slot: the tiny fixture's batch and wide heads.
    run_case("slot-major pool, tiny fixture, 3 sequences in slots 2, 0, 3", {2, 4, 16, 16, 4, 0}, 4,
             {{{2, 7, 0}, {0, 12, 0}}, {{3, 3, 0}, {2, 1, 7}}, {{2, 1, 8}, {3, 1, 3}, {0, 1, 12}}}, true);
    run_case("slot-major pool, key heads of 128, tiled, 3 taps", {2, 6, 128, 40, 3, 1}, 3,
             {{{1, 20, 0}, {2, 9, 0}}, {{2, 1, 9}, {1, 1, 20}}}, true);
    // The chunked delta rule (DELTA_C = 16 tokens a chunk) at the chunk's
    // edges: prompts of 1, C-1, C, C+1 and 3C+5 rows, from a zero state and
    // continuing a cached one, several sequences in one launch.
    run_case("chunk edges: prompts of 1, 15, 16, 17, 53 rows, then each continued", {2, 4, 32, 40, 4, 0}, 5,
             {{{0, 1, 0}, {1, 15, 0}, {2, 16, 0}},
              {{3, 17, 0}, {4, 53, 0}},
              {{4, 1, 53}, {0, 53, 1}, {1, 17, 15}, {2, 16, 16}, {3, 15, 17}}});
    // The 27B head shape (k_dim = v_dim = 128: four value tiles) with fewer heads: a
    // prompt of 3C+5 split in two launches (the state carried), then decode.
    run_case("27B head shape, 6 value heads, a 53-row prompt as 37 + 16, decode", {2, 6, 128, 128, 4, 0}, 2,
             {{{1, 37, 0}}, {{1, 16, 37}}, {{1, 1, 53}}});
    printf("%d comparisons failed\n", failures);
    return failures != 0;
}
