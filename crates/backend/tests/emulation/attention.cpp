// The tiled prefill kernels of kernels/attention.cu (attn_prefill_hd64,
// hd128 and hd256), run under the host emulation of shim.h, against causal
// attention over the same paged bf16 cache in double precision. The warp-wide
// tensor-core instructions (mma.sync m16n8k16, ldmatrix with and without
// .trans), the shuffles and cp.async are emulated from their PTX
// definitions (emulation/mma.h), so a wrong fragment index, tile stride,
// output offset, block decomposition or missing cp.async wait fails here.
// Built and run by crates/backend/tests/kernels_emulated.rs; exits 1
// when a comparison fails.
#include "mma.h"
#include "q8.h"
#include <algorithm>
#include <random>

#define NEG_INF (-INFINITY)
using std::max;
#define KV_UNIT_SHIFT 7 // as kernels/common.cu
inline long long kv_page_elems(u32 unit) { return (long long)unit << KV_UNIT_SHIFT; }
// The block-wide sum of the split-K combine.
#include "block_sum.h"

// As kernels/common.cu has them: round to nearest even, and the L2 prefetch
// (nothing to prefetch into here).
inline bf16_t f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}
inline void l2_prefetch(const u8*, long long) {}

#include "../../kernels/attention.cu"

namespace {

std::mt19937 rng(11);
float rnd(float s) { return std::uniform_real_distribution<float>(-s, s)(rng); }

struct Seq {
    int cached, rows;
};
struct Case {
    const char* name;
    int head_dim, heads, kv_heads, page_size;
    std::vector<Seq> seqs;
    // 0: the tiled prefill kernel. Otherwise the split-K kernels (attn_partial
    // over this many splits, then attn_combine), as decode rows take them.
    int nsplit = 0;
    // Split-K through the 32-token-tile kernels (attn_tile_*) instead of attn_partial.
    bool tile = false;
    // The splits merged by the last block of each row and block of heads
    // (counters in the launch, launched twice as a replayed graph would be),
    // not by attn_combine.
    bool merge = false;
    // Split-K through the token-per-lane kernels (attn_lanes_*).
    bool lanes = false;
};

using Partial = void (*)(const float*, const bf16_t*, const bf16_t*, const u32*, const u32*, const u32*,
                         const u32*, float*, float*, float*, int, int, int, int, float, int, int, u32*, u32*,
                         float2*);
// The instantiation attention.rs picks: heads per block the largest of 8, 4,
// 2, 1 dividing the group; the vector-load kernels for head_dim 64, 128, 256.
Partial partial_of(int head_dim, int g, bool tile, bool lanes) {
    Partial exact[3][4] = {{attn_partial_g1_d2, attn_partial_g2_d2, attn_partial_g4_d2, attn_partial_g8_d2},
                           {attn_partial_g1_d4, attn_partial_g2_d4, attn_partial_g4_d4, attn_partial_g8_d4},
                           {attn_partial_g1_d8, attn_partial_g2_d8, attn_partial_g4_d8, attn_partial_g8_d8}};
    Partial tiles[3][4] = {{attn_tile_g1_d2, attn_tile_g2_d2, attn_tile_g4_d2, attn_tile_g8_d2},
                           {attn_tile_g1_d4, attn_tile_g2_d4, attn_tile_g4_d4, attn_tile_g8_d4},
                           {attn_tile_g1_d8, attn_tile_g2_d8, attn_tile_g4_d8, attn_tile_g8_d8}};
    Partial lane[3][4] = {{attn_lanes_g1_d2, attn_lanes_g2_d2, attn_lanes_g4_d2, attn_lanes_g8_d2},
                          {attn_lanes_g1_d4, attn_lanes_g2_d4, attn_lanes_g4_d4, attn_lanes_g8_d4},
                          {attn_lanes_g1_d8, attn_lanes_g2_d8, attn_lanes_g4_d8, attn_lanes_g8_d8}};
    int di = head_dim == 64 ? 0 : head_dim == 128 ? 1 : 2, gi = g == 8 ? 3 : g == 4 ? 2 : g == 2 ? 1 : 0;
    if (tile) return tiles[di][gi];
    if (lanes) return lane[di][gi];
    Partial any[4] = {attn_partial_g1, attn_partial_g2, attn_partial_g4, attn_partial_g8};
    switch (head_dim) {
    case 64: return exact[0][gi];
    case 128: return exact[1][gi];
    case 256: return exact[2][gi];
    default: return any[gi];
    }
}

using Prefill = void (*)(const float*, const bf16_t*, const bf16_t*, const u32*, const u32*, const u32*,
                         const u32*, const u32*, float*, int, int, int, float, int);

// Blocks per tile and head, as the host launches them (attention.rs TILE_PARTS_HD256).
int parts_of(int head_dim) { return head_dim == 256 ? 2 : 1; }

// Blocks of a split-K launch whose split holds tokens of its row: only they
// wait on the previous kernel, the others leave before (split_live).
long live_blocks(const std::vector<u32>& row_pos, const std::vector<u32>& row_seq, int nsplit, int min_chunk,
                 int head_blocks) {
    long live = 0;
    for (size_t r = 0; r < row_pos.size(); r++) {
        if (row_seq[r] == 0xffffffffu) continue;
        int ctx = (int)row_pos[r] + 1;
        for (int s = 0; s < nsplit; s++) live += s * split_len(ctx, nsplit, min_chunk) < ctx;
    }
    return live * head_blocks;
}

bool waits_match(const char* name, long live) {
    if (pdl_waits == live) return true;
    printf("FAIL %s: %ld blocks waited on the previous kernel, %ld splits hold tokens\n", name, pdl_waits.load(), live);
    return false;
}
Prefill kernel_of(int head_dim) {
    switch (head_dim) {
    case 64: return attn_prefill_hd64;
    case 128: return attn_prefill_hd128;
    default: return attn_prefill_hd256;
    }
}

bool run(const Case& c) {
    const int hd = c.head_dim, kvw = c.kv_heads * hd, ps = c.page_size;
    // Pages of the cache in a scrambled order, each starting on a KV unit.
    const int unit_elems = 1 << KV_UNIT_SHIFT, page_elems = ps * kvw;
    const int page_units = (page_elems + unit_elems - 1) / unit_elems;
    std::vector<u32> page_table, seq_pt_off, row_pos, row_seq, tiles;
    int npages = 0;
    for (auto& s : c.seqs) npages += (s.cached + s.rows + ps - 1) / ps;
    std::vector<int> order(npages);
    for (int i = 0; i < npages; i++) order[i] = (i * 7 + 3) % npages;
    std::vector<bf16_t> kc((size_t)npages * page_units * unit_elems), vc(kc.size());
    for (auto& x : kc) x = to_bf16(rnd(1.f));
    for (auto& x : vc) x = to_bf16(rnd(1.f));
    int next = 0, rows = 0;
    for (size_t si = 0; si < c.seqs.size(); si++) {
        auto& s = c.seqs[si];
        seq_pt_off.push_back(page_table.size());
        for (int p = 0; p < (s.cached + s.rows + ps - 1) / ps; p++) page_table.push_back(order[next++] * page_units);
        for (int t0 = 0; t0 < s.rows; t0 += 64) tiles.push_back(rows + t0), tiles.push_back(std::min(64, s.rows - t0));
        for (int i = 0; i < s.rows; i++) row_pos.push_back(s.cached + i), row_seq.push_back(si);
        rows += s.rows;
    }
    std::vector<float> q((size_t)rows * c.heads * hd), out(q.size(), NAN);
    std::vector<u32> oq;
    std::vector<float2> oqs;
    for (auto& x : q) x = rnd(2.f);
    const int ntiles = tiles.size() / 2;
    const float scale = 1.f / std::sqrt((float)hd);
    if (c.nsplit == 0) {
        Prefill k = kernel_of(hd);
        launch({(unsigned)(ntiles * parts_of(hd)), (unsigned)c.heads, 1}, 128, [&] {
            k(q.data(), kc.data(), vc.data(), row_pos.data(), row_seq.data(), seq_pt_off.data(), page_table.data(),
              tiles.data(), out.data(), c.heads, c.kv_heads, ps, scale * 1.4426950408889634f, ntiles);
        });
    } else {
        int group = c.heads / c.kv_heads, g = group % 8 == 0 ? 8 : group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
        // attention.rs ATT_TILE_SPLIT, ATT_LANES_SPLIT, ATT_MIN_SPLIT
        const int min_chunk = c.tile ? 32 : c.lanes ? 128 : 16;
        std::vector<float> part_o((size_t)rows * c.heads * c.nsplit * hd, NAN), part_ml(part_o.size() / hd * 2, NAN);
        Partial k = partial_of(hd, g, c.tile, c.lanes);
        // With head_dim a multiple of 32, the output quantized too (the
        // output projection's 8-bit input), by whichever pass merges.
        bool q8 = c.nsplit > 1 && hd % 32 == 0;
        oq.assign(out.size() / 4, 0xdeadbeef);
        oqs.assign(out.size() / 32, {NAN, NAN});
        std::vector<u32> counts(c.merge ? (size_t)rows * c.heads / g : 0, 0);
        u32 *cp = c.merge ? counts.data() : nullptr, *oqp = c.merge && q8 ? oq.data() : nullptr;
        float2* oqsp = c.merge && q8 ? oqs.data() : nullptr;
        // Merged in the launch: twice, as a graph replays it, the second from
        // the counters the first left (each must be back at zero).
        long live = live_blocks(row_pos, row_seq, c.nsplit, min_chunk, c.heads / g);
        for (int rep = 0; rep < (c.merge ? 2 : 1); rep++) {
            if (rep) std::fill(out.begin(), out.end(), NAN);
            pdl_waits = 0;
            launch({(unsigned)(c.heads / g), (unsigned)rows, (unsigned)c.nsplit}, 128, [&] {
                k(q.data(), kc.data(), vc.data(), row_pos.data(), row_seq.data(), seq_pt_off.data(),
                  page_table.data(), out.data(), part_o.data(), part_ml.data(), c.heads, c.kv_heads, hd, ps, scale,
                  min_chunk, c.nsplit, cp, oqp, oqsp);
            });
            if (!waits_match(c.name, live)) return false;
            for (u32 x : counts)
                if (x != 0) {
                    printf("FAIL %s: a split counter left at %u\n", c.name, x);
                    return false;
                }
        }
        if (c.nsplit > 1 && !c.merge) {
            launch({(unsigned)c.heads, (unsigned)rows, 1}, 128, [&] {
                attn_combine(part_o.data(), part_ml.data(), row_pos.data(), row_seq.data(), out.data(),
                             q8 ? oq.data() : nullptr, q8 ? oqs.data() : nullptr, c.heads, hd, c.nsplit, min_chunk);
            });
        }
        if (!q8) oq.clear();
    }
    // The reference: each row over keys 0..=its position, from the same cache.
    auto at = [&](const std::vector<bf16_t>& cache, int si, int t, int kvh, int d) {
        u32 unit = page_table[seq_pt_off[si] + t / ps];
        return bf16_to_f32(cache[kv_page_elems(unit) + (size_t)(t % ps) * kvw + kvh * hd + d]);
    };
    double err = 0, ref_max = 0;
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < c.heads; h++) {
            int si = row_seq[r], ctx = row_pos[r] + 1, kvh = h / (c.heads / c.kv_heads);
            const float* qr = &q[((size_t)r * c.heads + h) * hd];
            std::vector<double> sc(ctx);
            double mx = -INFINITY, sum = 0;
            for (int t = 0; t < ctx; t++) {
                double d = 0;
                for (int e = 0; e < hd; e++) d += (double)qr[e] * at(kc, si, t, kvh, e);
                sc[t] = d * scale;
                mx = std::max(mx, sc[t]);
            }
            for (int t = 0; t < ctx; t++) sum += sc[t] = std::exp(sc[t] - mx);
            for (int e = 0; e < hd; e++) {
                double o = 0;
                for (int t = 0; t < ctx; t++) o += sc[t] * at(vc, si, t, kvh, e);
                o /= sum;
                double got = out[((size_t)r * c.heads + h) * hd + e];
                ref_max = std::max(ref_max, std::fabs(o));
                err = std::isnan(got) ? INFINITY : std::max(err, std::fabs(got - o));
            }
        }
    // Tiled: Q and P are rounded to bf16 before their products, as on the GPU
    // (check.rs BF16). Split-K computes in f32 from the bf16 cache.
    bool ok = err <= (c.nsplit ? 1e-4 : 2e-2) * ref_max;
    // The combine's 8-bit copy: exactly the quantization of what it wrote.
    bool codes = oq.empty() || q8_matches(out, oq, oqs);
    printf("%s %s: max error %.2e of max |ref| %.2e%s\n", ok && codes ? "PASS" : "FAIL", c.name, err, ref_max,
           oq.empty() ? "" : codes ? "; output quantized bit for bit" : "; output's 8-bit copy DIFFERS");
    return ok && codes;
}

using TileRopeKernel = void (*)(const float*, bf16_t*, bf16_t*, const u32*, const u32*, const u32*, const u32*,
                                float*, float*, float*, int, int, int, int, float, int, int, u32*, u32*, float2*,
                                const float*, const float*, const float*, const u32*, int, int, int, const float*,
                                const float*, float, const u8*, long long);
TileRopeKernel tile_rope_of(int head_dim, int g) {
    TileRopeKernel k[3][4] = {
        {attn_tile_rope_g1_d2, attn_tile_rope_g2_d2, attn_tile_rope_g4_d2, attn_tile_rope_g8_d2},
        {attn_tile_rope_g1_d4, attn_tile_rope_g2_d4, attn_tile_rope_g4_d4, attn_tile_rope_g8_d4},
        {attn_tile_rope_g1_d8, attn_tile_rope_g2_d8, attn_tile_rope_g4_d8, attn_tile_rope_g8_d8}};
    return k[head_dim == 64 ? 0 : head_dim == 128 ? 1 : 2][g == 8 ? 3 : g == 4 ? 2 : g == 2 ? 1 : 0];
}

// A decode step through attn_tile_rope_*: rows of one token each, q and the
// new k and v as the projections wrote them.
struct RopeCase {
    const char* name;
    int head_dim, heads, kv_heads, page_size;
    std::vector<int> cached; // each row's context before its new token
    int nsplit;
    int rot_dim;             // rotary dimensions (head_dim: all)
    bool interleaved, norm, merge;
};

// rope_write_kv's arithmetic on the host (elementwise.cu): the head norm
// (sum of squares in index order; the kernel sums in another, so within a
// rounding), then each rotary pair.
void rope_head(float* x, int hd, int half, bool interleaved, const float* w, float eps, const float* inv_freq,
               float pos) {
    float inv = 1.f;
    if (w) {
        float ssq = 0.f;
        for (int e = 0; e < hd; e++) ssq += x[e] * x[e];
        inv = 1.0f / std::sqrt(ssq / (float)hd + eps);
    }
    std::vector<float> y(x, x + hd);
    for (int i = 0; i < half; i++) {
        float sn, cs;
        sincosf(pos * inv_freq[i], &sn, &cs);
        int a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
        float x0 = x[a], x1 = x[b];
        if (w) x0 = x0 * inv * w[a], x1 = x1 * inv * w[b];
        y[a] = x0 * cs - x1 * sn;
        y[b] = x0 * sn + x1 * cs;
    }
    for (int e = 2 * half; e < hd; e++) y[e] = w ? x[e] * inv * w[e] : x[e];
    std::copy(y.begin(), y.end(), x);
}

bool run_rope(const RopeCase& c) {
    const int hd = c.head_dim, kvw = c.kv_heads * hd, ps = c.page_size, rows = c.cached.size();
    const int half = c.rot_dim / 2;
    const int unit_elems = 1 << KV_UNIT_SHIFT, page_units = (ps * kvw + unit_elems - 1) / unit_elems;
    std::vector<u32> page_table, seq_pt_off, row_pos, row_seq;
    int npages = 0;
    for (int cached : c.cached) npages += cached / ps + 1;
    std::vector<bf16_t> kc((size_t)npages * page_units * unit_elems), vc(kc.size());
    for (auto& x : kc) x = to_bf16(rnd(1.f));
    for (auto& x : vc) x = to_bf16(rnd(1.f));
    // Pages in a scrambled order, no two rows sharing one.
    std::vector<int> order(npages);
    for (int i = 0; i < npages; i++) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    for (int r = 0, next = 0; r < rows; r++) {
        seq_pt_off.push_back(page_table.size());
        for (int p = 0; p <= c.cached[r] / ps; p++) page_table.push_back(order[next++] * page_units);
        row_pos.push_back(c.cached[r]);
        row_seq.push_back(r);
    }
    std::vector<float> q((size_t)rows * c.heads * hd), k((size_t)rows * kvw), v(k.size());
    for (auto& x : q) x = rnd(2.f);
    for (auto& x : k) x = rnd(2.f);
    for (auto& x : v) x = rnd(1.f);
    std::vector<float> inv_freq(half), qn(hd), kn(hd);
    for (int i = 0; i < half; i++) inv_freq[i] = std::pow(10000.f, -2.f * i / c.rot_dim);
    for (int e = 0; e < hd; e++) qn[e] = 0.5f + rnd(0.4f) + 0.5f, kn[e] = 1.f + rnd(0.4f);
    // Positions past the slots, as a model with a position offset would give them.
    std::vector<u32> positions(rows);
    for (int r = 0; r < rows; r++) positions[r] = row_pos[r] + 3;
    const float eps = 1e-6f, scale = 1.f / std::sqrt((float)hd);
    // The expected: rope_write_kv's q and cache, then attention from them in double.
    std::vector<float> qe = q, ke = k;
    std::vector<bf16_t> kce = kc, vce = vc;
    for (int r = 0; r < rows; r++) {
        for (int h = 0; h < c.heads; h++)
            rope_head(&qe[((size_t)r * c.heads + h) * hd], hd, half, c.interleaved, c.norm ? qn.data() : nullptr, eps,
                      inv_freq.data(), (float)positions[r]);
        u32 unit = page_table[seq_pt_off[r] + row_pos[r] / ps];
        for (int kvh = 0; kvh < c.kv_heads; kvh++) {
            float* kh = &ke[(size_t)r * kvw + kvh * hd];
            rope_head(kh, hd, half, c.interleaved, c.norm ? kn.data() : nullptr, eps, inv_freq.data(),
                      (float)positions[r]);
            for (int e = 0; e < hd; e++) {
                size_t at = kv_page_elems(unit) + (size_t)(row_pos[r] % ps) * kvw + kvh * hd + e;
                kce[at] = f32_to_bf16(kh[e]);
                vce[at] = f32_to_bf16(v[(size_t)r * kvw + kvh * hd + e]);
            }
        }
    }
    int group = c.heads / c.kv_heads, g = group % 8 == 0 ? 8 : group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
    std::vector<float> out(q.size(), NAN), part_o((size_t)rows * c.heads * c.nsplit * hd, NAN),
        part_ml(part_o.size() / hd * 2, NAN);
    std::vector<u32> counts((size_t)rows * c.heads / g, 0), oq(out.size() / 4, 0xdeadbeef);
    std::vector<float2> oqs(out.size() / 32, {NAN, NAN});
    bool q8 = c.merge && c.nsplit > 1 && hd % 32 == 0;
    TileRopeKernel kern = tile_rope_of(hd, g);
    long live = live_blocks(row_pos, row_seq, c.nsplit, 32, c.heads / g);
    pdl_waits = 0;
    launch({(unsigned)(c.heads / g), (unsigned)rows, (unsigned)c.nsplit}, 128, [&] {
        kern(q.data(), kc.data(), vc.data(), row_pos.data(), row_seq.data(), seq_pt_off.data(), page_table.data(),
             out.data(), part_o.data(), part_ml.data(), c.heads, c.kv_heads, hd, ps, scale, 32, c.nsplit,
             c.merge ? counts.data() : nullptr, q8 ? oq.data() : nullptr, q8 ? oqs.data() : nullptr, k.data(),
             v.data(), inv_freq.data(), positions.data(), rows, half, c.interleaved, c.norm ? qn.data() : nullptr,
             c.norm ? kn.data() : nullptr, eps, nullptr, 0);
    });
    if (!waits_match(c.name, live)) return false;
    if (c.nsplit > 1 && !c.merge)
        launch({(unsigned)c.heads, (unsigned)rows, 1}, 128, [&] {
            attn_combine(part_o.data(), part_ml.data(), row_pos.data(), row_seq.data(), out.data(), nullptr, nullptr,
                         c.heads, hd, c.nsplit, 32);
        });
    // The cache: every byte as rope_write_kv leaves it (the new tokens' K
    // within a bf16 step where the head norm's sum runs in another order).
    int cache_off = 0;
    for (size_t i = 0; i < kc.size(); i++) {
        int d = std::abs((int)kc[i] - (int)kce[i]);
        if (vc[i] != vce[i] || d > (c.norm ? 1 : 0)) cache_off++;
    }
    double err = 0, ref_max = 0;
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < c.heads; h++) {
            int ctx = row_pos[r] + 1, kvh = h / group;
            const float* qr = &qe[((size_t)r * c.heads + h) * hd];
            auto at = [&](const std::vector<bf16_t>& cache, int t, int e) {
                u32 unit = page_table[seq_pt_off[r] + t / ps];
                return bf16_to_f32(cache[kv_page_elems(unit) + (size_t)(t % ps) * kvw + kvh * hd + e]);
            };
            std::vector<double> sc(ctx);
            double mx = -INFINITY, sum = 0;
            for (int t = 0; t < ctx; t++) {
                double d = 0;
                for (int e = 0; e < hd; e++) d += (double)qr[e] * at(kce, t, e);
                mx = std::max(mx, sc[t] = d * scale);
            }
            for (int t = 0; t < ctx; t++) sum += sc[t] = std::exp(sc[t] - mx);
            for (int e = 0; e < hd; e++) {
                double o = 0;
                for (int t = 0; t < ctx; t++) o += sc[t] * at(vce, t, e);
                o /= sum;
                double got = out[((size_t)r * c.heads + h) * hd + e];
                ref_max = std::max(ref_max, std::fabs(o));
                err = std::isnan(got) ? INFINITY : std::max(err, std::fabs(got - o));
            }
        }
    bool ok = err <= 1e-4 * ref_max && cache_off == 0;
    if (!q8) oq.clear();
    bool codes = oq.empty() || q8_matches(out, oq, oqs);
    printf("%s %s: max error %.2e of max |ref| %.2e, %d cache elements off%s\n", ok && codes ? "PASS" : "FAIL",
           c.name, err, ref_max, cache_off,
           oq.empty() ? "" : codes ? "; output quantized bit for bit" : "; output's 8-bit copy DIFFERS");
    return ok && codes;
}

} // namespace

int main() {
    std::vector<Case> cases = {
        {"hd 64, two sequences, a prefix-cached one", 64, 2, 1, 16, {{33, 64}, {0, 20}}},
        {"hd 128, GQA 2, a partial tile", 128, 4, 2, 16, {{0, 70}}},
        {"hd 256, GQA 2, prefix-cached tiles and a partial one", 256, 4, 2, 16, {{40, 70}, {0, 17}}},
        {"hd 256, no GQA, page 32, a tile tail of 2 rows", 256, 2, 2, 32, {{0, 130}}},
        // Decode rows through split-K: more splits than the contexts fill (a
        // captured step splits for its longest context), a context inside
        // one split, and a head size without vector loads (the combine's
        // element-wise form).
        {"split-K decode, hd 128, GQA 8, contexts 600 and 17", 128, 16, 2, 16, {{599, 1}, {16, 1}}, 64},
        {"split-K decode, hd 64, GQA 4, one split", 64, 4, 1, 16, {{40, 1}}, 1},
        {"split-K decode, hd 18, GQA 2", 18, 4, 2, 16, {{70, 1}, {300, 1}}, 32},
        // The tile kernels: a split of several tiles and a partial last one,
        // one split (normalized in the kernel), few heads per block (threads
        // without an output), and hd 256 with 8 heads per block.
        {"tiles, hd 128, GQA 8, contexts 600 and 17", 128, 16, 2, 16, {{599, 1}, {16, 1}}, 8, true},
        {"tiles, hd 64, no GQA, one split", 64, 2, 2, 16, {{70, 1}}, 1, true},
        {"tiles, hd 128, GQA 4, three rows, page 32", 128, 8, 2, 32, {{40, 1}, {200, 2}}, 5, true},
        {"tiles, hd 256, GQA 8", 256, 8, 1, 16, {{100, 1}}, 3, true},
        // The splits merged in the launch by the last to finish: every kind
        // of decode kernel, a row whose context fills fewer splits than
        // launched, several rows, heads per block from 1 to 8, and a head
        // size without vector loads (no 8-bit copy).
        {"merged in the launch: tiles, hd 128, GQA 8, contexts 600 and 17", 128, 16, 2, 16, {{599, 1}, {16, 1}}, 8,
         true, true},
        {"merged in the launch: tiles, hd 64, GQA 4, three rows, page 32", 64, 8, 2, 32, {{40, 1}, {200, 2}}, 5, true,
         true},
        {"merged in the launch: tiles, hd 256, no GQA", 256, 2, 2, 16, {{100, 1}}, 3, true, true},
        {"merged in the launch: warp per token, hd 128, GQA 2", 128, 4, 2, 16, {{300, 1}, {33, 1}}, 12, false, true},
        {"merged in the launch: warp per token, hd 18, GQA 2", 18, 4, 2, 16, {{70, 1}, {300, 1}}, 32, false, true},
        {"merged in the launch: token per lane, hd 128, GQA 4", 128, 8, 2, 16, {{700, 1}, {90, 1}}, 6, false, true,
         true},
    };
    // RoPE and the KV store in the decode tile kernel: splits with and
    // without the merge, one split, partial rotary, interleaved pairs,
    // Qwen3's head norms, two blocks per KV head (GQA 16).
    std::vector<RopeCase> rope_cases = {
        {"RoPE in the tile kernel: hd 128, GQA 4, contexts 600, 17 and 40", 128, 16, 4, 16, {599, 16, 40}, 8, 128,
         false, false, true},
        {"RoPE in the tile kernel: hd 128, GQA 4, combine pass", 128, 8, 2, 16, {300, 70}, 6, 128, false, false,
         false},
        {"RoPE in the tile kernel: hd 64, no GQA, one split, interleaved", 64, 2, 2, 32, {70}, 1, 64, true, false,
         true},
        {"RoPE in the tile kernel: hd 128, GQA 8, head norms", 128, 16, 2, 16, {200, 31}, 5, 128, false, true, true},
        {"RoPE in the tile kernel: hd 256, GQA 16, a quarter rotary", 256, 16, 1, 16, {130}, 3, 64, false, false,
         true},
    };
    int failed = 0;
    for (auto& c : cases) failed += !run(c);
    for (auto& c : rope_cases) failed += !run_rope(c);
    return failed ? 1 : 0;
}
