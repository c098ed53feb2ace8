// Sampling where the logits are: one block per row, every row of a step in
// one launch (`Backend::sample_rows`, crates/backend/src/sample.rs for the
// semantics, crates/engine/src/sampling/kernel.rs for the candidate rules).
//
// Per row: sanitize (NaN -> -inf, +inf -> FLT_MAX, counted) and apply the
// host's sparse edits in place, find the first largest value, then draw:
// - temperature 0: that argmax;
// - no top-k (or one at least the count of tokens of positive weight) and
//   top_p = 1: inverse CDF over every token of positive weight (and at least
//   min_p, when set) in vocabulary order, each thread summing a contiguous
//   chunk, a block scan placing the chunks;
// - otherwise the candidates are a prefix of the rank order (logit down,
//   id up): a threshold on the logit's ordered key, found by bisection,
//   bounds a region that holds them, at most SAMPLE_CAP tokens, which is
//   sorted in shared memory and walked as the host walks its candidates.
//   A nucleus (top-p without top-k) too large for that is drawn by
//   bisection on the key: first the nucleus's last key, then the key whose
//   tokens hold the draw; only the tokens sharing one key are sorted. A
//   top-k beyond SAMPLE_CAP is handed back (ROW_TOO_MANY).
// The passes over a row unroll by four so each thread keeps several loads in
// flight (one block reads the whole row, several times). With slices (the
// default), `sample_scan` first sanitizes, edits and finds the largest value
// of every slice of every row, many blocks a row, and `sample_rows` starts
// from the slices' results: a greedy row is then never read by one block. Weights are bit for
// bit the host's: the same polynomial with the same rounding at every step
// (no fused multiply-adds). Sums are f64 in another order than the host's,
// so a draw within rounding of a boundary may pick the neighbouring token.

#define SAMPLE_THREADS 1024
#define SAMPLE_CAP 4096
#define SAMPLE_NONE 0xffffffffu
#define FLT_MAX_F __int_as_float(0x7f7fffff)
#define ROW_TOO_MANY 1u
#define EDIT_MASK 1u
#define EDIT_BIAS 2u

// Layouts of crates/backend/src/sample.rs (#[repr(C)]).
struct SampleSpec {
    u32 row, edits_start, edits_len, top_k;
    float temperature, inv_t, top_p, min_p;
    double uniform;
};
struct SampleEdit {
    u32 token;
    float rep, sub, bias;
    u32 flags;
};
struct SampleSummary {
    u32 token, argmax, nan, pos_inf, value_bits, status;
};
// One slice's result of `sample_scan`: its first largest value (after the
// sanitizing and the edits), where it is, and the NaN and +inf it held.
struct SampleSlice {
    float max;
    u32 argmax, nan, pos_inf;
};
#define SCAN_THREADS 256

__device__ __forceinline__ float sample_settle(float v) { return isnan(v) ? NEG_INF : fminf(v, FLT_MAX_F); }

// The host's exp_nonpositive (crates/engine/src/sampling/kernel.rs), every
// operation rounded as it is there.
__device__ __forceinline__ float sample_exp_nonpositive(float x) {
    const float LN2_HI = __int_as_float(0x3f317200);
    const float LN2_LO = __int_as_float(0x35bfbe8e);
    const float LOG2E = __int_as_float(0x3fb8aa3b);
    const float SHIFTER = __int_as_float(0x4b400000);
    const float C0 = __int_as_float(0x3f000000), C1 = __int_as_float(0x3e2aaaab), C2 = __int_as_float(0x3d2aaaab);
    const float C3 = __int_as_float(0x3c088889), C4 = __int_as_float(0x3ab60b61), C5 = __int_as_float(0x39500d01);
    float keep = x < -87.0f ? 0.0f : 1.0f;
    float xc = x < -87.0f ? -87.0f : x;
    float k = __fsub_rn(__fadd_rn(__fmul_rn(xc, LOG2E), SHIFTER), SHIFTER);
    float r = __fsub_rn(__fsub_rn(xc, __fmul_rn(k, LN2_HI)), __fmul_rn(k, LN2_LO));
    float p = __fadd_rn(C4, __fmul_rn(r, C5));
    p = __fadd_rn(C3, __fmul_rn(r, p));
    p = __fadd_rn(C2, __fmul_rn(r, p));
    p = __fadd_rn(C1, __fmul_rn(r, p));
    p = __fadd_rn(C0, __fmul_rn(r, p));
    p = __fadd_rn(1.0f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f, __fmul_rn(r, p));
    int ki = (int)k;
    float scale = __int_as_float((u32)(ki + 127) << 23);
    return __fmul_rn(__fmul_rn(p, scale), keep);
}

__device__ __forceinline__ float sample_weight(float l, float mx, float inv_t) {
    float x = __fmul_rn(__fsub_rn(l, mx), inv_t);
    return sample_exp_nonpositive(x > 0.0f ? 0.0f : x);
}

// Orders floats as the host's total_cmp does for non-NaN values (-0 < +0).
__device__ __forceinline__ u32 sample_key(float v) {
    u32 u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float sample_unkey(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Block-wide reductions over SAMPLE_THREADS threads; `scratch` holds one
// value per warp. Every thread gets the result.
__device__ double sample_sum_f64(double v, double* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double t = 0.0;
    // A fixed order, so every thread computes the same bits.
    for (int w = 0; w < SAMPLE_THREADS / 32; w++) t += scratch[w];
    return t;
}

__device__ u32 sample_sum_u32(u32 v, u32* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    u32 t = 0;
    for (int w = 0; w < SAMPLE_THREADS / 32; w++) t += scratch[w];
    return t;
}

// Exclusive prefix of `v` over the threads in thread order, and the total.
__device__ double sample_scan_f64(double v, double* scratch, double* total) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    double inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        double n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += n;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    double before = 0.0, all = 0.0;
    for (int w = 0; w < SAMPLE_THREADS / 32; w++) {
        if (w < warp) before += scratch[w];
        all += scratch[w];
    }
    *total = all;
    return before + inc - v;
}

// The count and weight of the tokens at or above `key` (and passing the
// floor): one pass over the row.
__device__ void sample_region(const float* row, int vocab, float mx, float inv_t, float floor_w, u32 key,
                              u32* count, double* sum, u32* su, double* sd) {
    u32 c = 0;
    double s = 0.0;
    #pragma unroll 4
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
        float l = row[i];
        if (sample_key(l) < key) continue;
        float w = sample_weight(l, mx, inv_t);
        if (w > 0.0f && w >= floor_w) {
            c++;
            s += (double)w;
        }
    }
    *count = sample_sum_u32(c, su);
    *sum = sample_sum_f64(s, sd);
}

// Gather the tokens of positive weight at the floor whose key lies in
// [klo, khi] into `keys` as (key << 32 | ~id) and sort them in rank order
// (larger key first, then lower id). Returns how many there are; more than
// SAMPLE_CAP means they did not fit (and `keys` holds some of them).
__device__ u32 sample_gather_sorted(const float* row, int vocab, float mx, float inv_t, float floor_w, u32 klo,
                                    u32 khi, unsigned long long* keys, u32* slot) {
    const int tid = threadIdx.x;
    __syncthreads();
    if (tid == 0) *slot = 0;
    __syncthreads();
    #pragma unroll 4
    for (int i = tid; i < vocab; i += SAMPLE_THREADS) {
        float l = row[i];
        u32 k = sample_key(l);
        if (k < klo || k > khi) continue;
        float w = sample_weight(l, mx, inv_t);
        if (w > 0.0f && w >= floor_w) {
            u32 at = atomicAdd(slot, 1u);
            if (at < SAMPLE_CAP) keys[at] = ((unsigned long long)k << 32) | (unsigned long long)(0xffffffffu - (u32)i);
        }
    }
    __syncthreads();
    const u32 total = *slot;
    const u32 n = min(total, (u32)SAMPLE_CAP);
    u32 p2 = 1;
    while (p2 < n) p2 <<= 1;
    for (u32 i = n + tid; i < p2; i += SAMPLE_THREADS) keys[i] = 0ull;
    __syncthreads();
    // Bitonic sort, descending.
    for (u32 size = 2; size <= p2; size <<= 1) {
        for (u32 stride = size >> 1; stride > 0; stride >>= 1) {
            for (u32 i = tid; i < p2 / 2; i += SAMPLE_THREADS) {
                u32 a = 2 * i - (i & (stride - 1));
                u32 b = a + stride;
                bool desc = (a & size) == 0;
                unsigned long long ka = keys[a], kb = keys[b];
                if (desc ? (ka < kb) : (ka > kb)) {
                    keys[a] = kb;
                    keys[b] = ka;
                }
            }
            __syncthreads();
        }
    }
    return total;
}

__device__ __forceinline__ float sample_key_weight(unsigned long long key, float mx, float inv_t) {
    return sample_weight(sample_unkey((u32)(key >> 32)), mx, inv_t);
}
__device__ __forceinline__ u32 sample_key_id(unsigned long long key) { return 0xffffffffu - (u32)(key & 0xffffffffull); }

// The weight of the tokens at the floor whose key is above `k`.
__device__ double sample_mass_above(const float* row, int vocab, float mx, float inv_t, float floor_w, u32 k, u32* su,
                                    double* sd) {
    u32 c;
    double s;
    sample_region(row, vocab, mx, inv_t, floor_w, k + 1, &c, &s, su, sd);
    return s;
}

// The first largest of (v, i) and (ov, oi): the larger value, the lower
// index on a tie (SAMPLE_NONE, for nothing above -inf, is the highest).
__device__ __forceinline__ void sample_best(float& v, u32& i, float ov, u32 oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// Sanitize tokens from..end of `row` in place, every `stride`-th (NaN ->
// -inf, +inf -> FLT_MAX), counting what was wrong.
__device__ __forceinline__ void sample_sanitize(float* row, int from, int end, int stride, u32& nan, u32& pinf) {
    #pragma unroll 4
    for (int i = from; i < end; i += stride) {
        float v = row[i];
        if (isnan(v)) {
            nan++;
            row[i] = NEG_INF;
        } else if (isinf(v) && v > 0.0f) {
            pinf++;
            row[i] = FLT_MAX_F;
        }
    }
}

// Every lane of a warp gets the warp's first largest (v, i) and the sums
// of n and p.
__device__ __forceinline__ void sample_fold_warp(float& v, u32& i, u32& n, u32& p) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        sample_best(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
        n += __shfl_xor_sync(0xffffffffu, n, o);
        p += __shfl_xor_sync(0xffffffffu, p, o);
    }
}

// The host's edit `ed` applied to the sanitized value `v`.
__device__ __forceinline__ float sample_edit(float v, const SampleEdit& ed) {
    v = sample_settle(v > 0.0f ? __fdiv_rn(v, ed.rep) : __fmul_rn(v, ed.rep));
    v = sample_settle(__fsub_rn(v, ed.sub));
    if (ed.flags & EDIT_BIAS) v = sample_settle(__fadd_rn(v, ed.bias));
    if (ed.flags & EDIT_MASK) v = NEG_INF;
    return v;
}

// Slice blockIdx.x of the row of spec blockIdx.y (slices of `chunk` tokens):
// sanitized in place, the row's edits that fall in it applied, its first
// largest value found; `out[spec * gridDim.x + slice]` gets the result.
extern "C" __global__ void __launch_bounds__(SCAN_THREADS)
    sample_scan(float* logits, int vocab, int chunk, const SampleSpec* specs, const SampleEdit* edits,
                SampleSlice* out) {
    pdl_enter();
    __shared__ float best_v[SCAN_THREADS / 32];
    __shared__ u32 best_i[SCAN_THREADS / 32], nans[SCAN_THREADS / 32], infs[SCAN_THREADS / 32];
    const SampleSpec sp = specs[blockIdx.y];
    float* row = logits + (long long)sp.row * vocab;
    const int lo = blockIdx.x * chunk, hi = min(vocab, lo + chunk);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    u32 nan = 0, pinf = 0;
    sample_sanitize(row, lo + tid, hi, SCAN_THREADS, nan, pinf);
    __syncthreads();
    for (u32 e = tid; e < sp.edits_len; e += SCAN_THREADS) {
        SampleEdit ed = edits[sp.edits_start + e];
        if (ed.token < (u32)lo || ed.token >= (u32)hi) continue;
        row[ed.token] = sample_edit(row[ed.token], ed);
    }
    __syncthreads();
    float bv = NEG_INF;
    u32 bi = SAMPLE_NONE;
    #pragma unroll 4
    for (int i = lo + tid; i < hi; i += SCAN_THREADS) {
        float v = row[i];
        if (v > bv) {
            bv = v;
            bi = (u32)i;
        }
    }
    sample_fold_warp(bv, bi, nan, pinf);
    if (lane == 0) {
        best_v[warp] = bv;
        best_i[warp] = bi;
        nans[warp] = nan;
        infs[warp] = pinf;
    }
    __syncthreads();
    if (tid == 0) {
        SampleSlice r = {NEG_INF, SAMPLE_NONE, 0, 0};
        for (int w = 0; w < SCAN_THREADS / 32; w++) {
            sample_best(r.max, r.argmax, best_v[w], best_i[w]);
            r.nan += nans[w];
            r.pos_inf += infs[w];
        }
        out[blockIdx.y * gridDim.x + blockIdx.x] = r;
    }
}

// One row drawn by one block. SLICED: `sample_scan` ran over this launch's
// specs with `slices` slices a row, its results in `scanned`; otherwise the
// block sanitizes, edits and finds the largest value itself. (Two kernels,
// so the one-block one compiles as it did before the slices existed.)
template <bool SLICED>
__device__ __forceinline__ void sample_row(float* logits, int vocab, const SampleSpec* specs, const SampleEdit* edits,
                                           SampleSummary* out, const SampleSlice* scanned, int slices) {
    __shared__ unsigned long long keys[SAMPLE_CAP];
    __shared__ double sd[32];
    __shared__ u32 su[32];
    __shared__ float best_v[32];
    __shared__ u32 best_i[32];
    __shared__ u32 slot, chosen;
    __shared__ double wide_total;

    const SampleSpec sp = specs[blockIdx.x];
    float* row = logits + (long long)sp.row * vocab;
    const int tid = threadIdx.x;

    u32 nan = 0, pinf = 0;
    float mx = NEG_INF;
    u32 amax = SAMPLE_NONE;
    if (SLICED) {
        // The slices folded by the first warp, lane by lane then across the
        // lanes: the first largest value (ties to the lowest index, so the
        // order of the fold does not matter) and the counts.
        if (tid < 32) {
            float bv = NEG_INF;
            u32 bi = SAMPLE_NONE, n = 0, p = 0;
            const SampleSlice* sl = scanned + (long long)blockIdx.x * slices;
            for (int i = tid; i < slices; i += 32) {
                SampleSlice r = sl[i];
                sample_best(bv, bi, r.max, r.argmax);
                n += r.nan;
                p += r.pos_inf;
            }
            sample_fold_warp(bv, bi, n, p);
            if (tid == 0) {
                best_v[0] = bv;
                best_i[0] = bi;
                su[0] = n;
                su[1] = p;
            }
        }
        __syncthreads();
        mx = best_v[0];
        amax = best_i[0];
        nan = su[0];
        pinf = su[1];
    } else {
        sample_sanitize(row, tid, vocab, SAMPLE_THREADS, nan, pinf);
        nan = sample_sum_u32(nan, su);
        pinf = sample_sum_u32(pinf, su);
        // The host's edits, one token each, in the host's order of operations.
        for (u32 e = tid; e < sp.edits_len; e += SAMPLE_THREADS) {
            SampleEdit ed = edits[sp.edits_start + e];
            if (ed.token >= (u32)vocab) continue;
            row[ed.token] = sample_edit(row[ed.token], ed);
        }
        __syncthreads();

        // The first largest value.
        float bv = NEG_INF;
        u32 bi = SAMPLE_NONE;
        #pragma unroll 4
        for (int i = tid; i < vocab; i += SAMPLE_THREADS) {
            float v = row[i];
            if (v > bv) {
                bv = v;
                bi = (u32)i;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            sample_best(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
        if ((tid & 31) == 0) {
            best_v[tid >> 5] = bv;
            best_i[tid >> 5] = bi;
        }
        __syncthreads();
        for (int w = 0; w < SAMPLE_THREADS / 32; w++) sample_best(mx, amax, best_v[w], best_i[w]);
    }
    if (mx == NEG_INF) amax = SAMPLE_NONE;

    SampleSummary res;
    res.token = SAMPLE_NONE;
    res.argmax = amax;
    res.nan = nan;
    res.pos_inf = pinf;
    res.value_bits = __float_as_uint(NEG_INF);
    res.status = 0;
    // A broken or empty row is decided by the host from the argmax.
    if (amax == SAMPLE_NONE || nan > 0 || pinf > 0) {
        if (tid == 0) out[blockIdx.x] = res;
        return;
    }
    if (sp.temperature == 0.0f) {
        if (tid == 0) {
            res.token = amax;
            res.value_bits = __float_as_uint(mx);
            out[blockIdx.x] = res;
        }
        return;
    }

    const float inv_t = sp.inv_t;
    const float floor_w = sp.min_p > 0.0f ? sp.min_p : 0.0f;
    // Tokens of positive weight, their total, and those at the floor.
    u32 npos = 0, nfloor = 0;
    double total = 0.0;
    #pragma unroll 4
    for (int i = tid; i < vocab; i += SAMPLE_THREADS) {
        float w = sample_weight(row[i], mx, inv_t);
        if (w > 0.0f) {
            npos++;
            total += (double)w;
            if (w >= floor_w) nfloor++;
        }
    }
    npos = sample_sum_u32(npos, su);
    nfloor = sample_sum_u32(nfloor, su);
    total = sample_sum_f64(total, sd);
    const u32 top_k = (sp.top_k > 0 && sp.top_k < npos) ? sp.top_k : 0;

    if (top_k == 0 && sp.top_p >= 1.0f) {
        // Vocabulary order: each thread a contiguous chunk.
        const int chunk = (vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
        const int lo = tid * chunk, hi = min(lo + chunk, vocab);
        double s = 0.0;
        u32 last = SAMPLE_NONE;
        for (int i = lo; i < hi; i++) {
            float w = sample_weight(row[i], mx, inv_t);
            if (w > 0.0f && w >= floor_w) {
                s += (double)w;
                last = (u32)i;
            }
        }
        if (tid == 0) {
            chosen = SAMPLE_NONE;
            slot = 0;
        }
        double all;
        const double before = sample_scan_f64(s, sd, &all);
        const bool drawn = all > 0.0 && all <= 1.0e308;
        const double target = sp.uniform * all;
        // The chunk holding the draw is the last one that starts at or
        // before it (the host's first block whose end passes it, but
        // immune to the two sums rounding differently at a chunk border).
        if (drawn && s > 0.0 && before <= target) atomicMax(&slot, (u32)tid + 1);
        __syncthreads();
        if (drawn && (u32)tid + 1 == slot) {
            double cum = before;
            // Rounding inside the chunk: the draw belongs to its last candidate.
            u32 pick = last;
            for (int i = lo; i < hi; i++) {
                float w = sample_weight(row[i], mx, inv_t);
                if (w > 0.0f && w >= floor_w) {
                    cum += (double)w;
                    if (cum > target) {
                        pick = (u32)i;
                        break;
                    }
                }
            }
            chosen = pick;
        }
        __syncthreads();
        if (tid == 0) {
            u32 t = chosen;
            if (t != SAMPLE_NONE) {
                res.token = t;
                res.value_bits = __float_as_uint(row[t]);
            }
            out[blockIdx.x] = res;
        }
        return;
    }

    // A rank prefix holds the candidates. With top-k, the region must hold
    // the first k tokens of positive weight (min-p applies after); without,
    // only tokens at the floor can be candidates, and the region must reach
    // the nucleus limit (or be every such token).
    const float region_floor = top_k > 0 ? 0.0f : floor_w;
    const u32 full = top_k > 0 ? npos : nfloor;
    const double limit = (double)sp.top_p * total;
    u32 lo_key = 0, count = full;
    if (count > SAMPLE_CAP && top_k > 0) {
        // The highest key whose region holds the first k tokens and fits.
        u32 hi_key = sample_key(mx) + 1;
        while (hi_key - lo_key > 1) {
            u32 mid = lo_key + (hi_key - lo_key) / 2;
            u32 c;
            double s;
            sample_region(row, vocab, mx, inv_t, region_floor, mid, &c, &s, su, sd);
            if (c >= top_k) {
                lo_key = mid;
                count = c;
                if (c <= SAMPLE_CAP) break;
            } else {
                hi_key = mid;
            }
        }
    } else if (count > SAMPLE_CAP) {
        // The nucleus's last key: the lowest key `kc` whose tokens above it
        // weigh less than the limit. Every token above `kc` is a candidate,
        // and those at `kc` while the weight before them is below the limit.
        u32 lo = 0, hi = sample_key(mx);
        while (lo < hi) {
            u32 mid = lo + (hi - lo) / 2;
            if (sample_mass_above(row, vocab, mx, inv_t, floor_w, mid, su, sd) < limit) hi = mid;
            else lo = mid + 1;
        }
        const u32 kc = lo;
        u32 c;
        double s;
        sample_region(row, vocab, mx, inv_t, floor_w, kc, &c, &s, su, sd);
        lo_key = kc;
        count = c;
        if (count > SAMPLE_CAP) {
            // Too many to sort: draw by bisection on the key as well. The
            // tokens at `kc` (usually one) take part in id order.
            const double above = sample_mass_above(row, vocab, mx, inv_t, floor_w, kc, su, sd);
            const u32 g = sample_gather_sorted(row, vocab, mx, inv_t, floor_w, kc, kc, keys, &slot);
            if (g > SAMPLE_CAP) {
                res.status = ROW_TOO_MANY;
                if (tid == 0) out[blockIdx.x] = res;
                return;
            }
            if (tid == 0) {
                double cum = above;
                u32 nc = 0;
                for (; nc < g; nc++) {
                    if (cum >= limit) break;
                    cum += (double)sample_key_weight(keys[nc], mx, inv_t);
                }
                wide_total = cum;
                chosen = nc;
            }
            __syncthreads();
            const double all = wide_total;
            const u32 nc = chosen;
            double target = sp.uniform * all;
            if (target >= above && nc == 0) target = nextafter(above, 0.0);
            if (target >= above) {
                // In the group at `kc`.
                if (tid == 0) {
                    double cum = above;
                    u32 pick = nc - 1;
                    for (u32 j = 0; j < nc; j++) {
                        cum += (double)sample_key_weight(keys[j], mx, inv_t);
                        if (cum > target) {
                            pick = j;
                            break;
                        }
                    }
                    res.token = sample_key_id(keys[pick]);
                    res.value_bits = __float_as_uint(sample_unkey(kc));
                    out[blockIdx.x] = res;
                }
                return;
            }
            // Above `kc`: the lowest key whose tokens above it weigh no more
            // than the target holds the draw.
            u32 dlo = kc + 1, dhi = sample_key(mx);
            while (dlo < dhi) {
                u32 mid = dlo + (dhi - dlo) / 2;
                if (sample_mass_above(row, vocab, mx, inv_t, floor_w, mid, su, sd) <= target) dhi = mid;
                else dlo = mid + 1;
            }
            const u32 kd = dlo;
            const double base = sample_mass_above(row, vocab, mx, inv_t, floor_w, kd, su, sd);
            const u32 gd = sample_gather_sorted(row, vocab, mx, inv_t, floor_w, kd, kd, keys, &slot);
            if (gd == 0 || gd > SAMPLE_CAP) {
                res.status = ROW_TOO_MANY;
                if (tid == 0) out[blockIdx.x] = res;
                return;
            }
            if (tid == 0) {
                double cum = base;
                u32 pick = gd - 1;
                for (u32 j = 0; j < gd; j++) {
                    cum += (double)sample_key_weight(keys[j], mx, inv_t);
                    if (cum > target) {
                        pick = j;
                        break;
                    }
                }
                res.token = sample_key_id(keys[pick]);
                res.value_bits = __float_as_uint(sample_unkey(kd));
                out[blockIdx.x] = res;
            }
            return;
        }
    }
    if (count > SAMPLE_CAP) {
        res.status = ROW_TOO_MANY;
        if (tid == 0) out[blockIdx.x] = res;
        return;
    }

    // Gather the region and sort it in rank order.
    const u32 n = min(sample_gather_sorted(row, vocab, mx, inv_t, region_floor, lo_key, 0xffffffffu, keys, &slot),
                      (u32)SAMPLE_CAP);

    // The host's walk over its candidates, in rank order.
    if (tid == 0) {
        u32 m = top_k > 0 ? min(top_k, n) : n;
        double tot = total;
        if (top_k > 0) {
            tot = 0.0;
            for (u32 j = 0; j < m; j++) tot += (double)sample_weight(sample_unkey((u32)(keys[j] >> 32)), mx, inv_t);
        }
        if (sp.top_p < 1.0f) {
            double lim = (double)sp.top_p * tot;
            double before = 0.0;
            for (u32 j = 0; j < m; j++) {
                if (before >= lim) {
                    m = j;
                    break;
                }
                before += (double)sample_weight(sample_unkey((u32)(keys[j] >> 32)), mx, inv_t);
            }
        }
        // min-p last, token by token as the host filters (a filter, not a
        // cut: the weights' polynomial need not be monotone to the last ulp).
        double sum = 0.0;
        for (u32 j = 0; j < m; j++) {
            float w = sample_weight(sample_unkey((u32)(keys[j] >> 32)), mx, inv_t);
            if (w >= floor_w) sum += (double)w;
        }
        if (m > 0 && sum > 0.0 && sum <= 1.0e308) {
            double target = sp.uniform * sum, cum = 0.0;
            u32 pick = SAMPLE_NONE;
            for (u32 j = 0; j < m; j++) {
                float w = sample_weight(sample_unkey((u32)(keys[j] >> 32)), mx, inv_t);
                if (w < floor_w) continue;
                // Rounding left the target at or past the sum: the last candidate.
                pick = j;
                cum += (double)w;
                if (cum > target) break;
            }
            unsigned long long kp = keys[pick];
            res.token = 0xffffffffu - (u32)(kp & 0xffffffffull);
            res.value_bits = __float_as_uint(sample_unkey((u32)(kp >> 32)));
        }
        out[blockIdx.x] = res;
    }
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows(float* logits, int vocab, const SampleSpec* specs, const SampleEdit* edits, SampleSummary* out) {
    pdl_enter();
    sample_row<false>(logits, vocab, specs, edits, out, nullptr, 0);
}

// `sample_rows` after `sample_scan` (`slices` a row, in `scanned`).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows_sliced(float* logits, int vocab, const SampleSpec* specs, const SampleEdit* edits,
                       SampleSummary* out, const SampleSlice* scanned, int slices) {
    pdl_enter();
    sample_row<true>(logits, vocab, specs, edits, out, scanned, slices);
}
