// The 8-bit rule of cpu/quant.rs `Q8Row::quantize`, written out for the
// emulated kernel tests (mmvq.cpp, attention.cpp), and kernels/q8.cu, the
// kernels' own helpers, compiled against the shim.
#pragma once
#include "shim.h"
#include <vector>

#include "../../kernels/q8.cu"

// d = max|x| / 127 per block of 32, q = round(x / d) half away from zero,
// (d, d * sum q) per block.
inline void q8_reference(const std::vector<float>& x, std::vector<signed char>& q, std::vector<float2>& s) {
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

// Whether `codes` (as u32 words) and `scales` are exactly q8_reference(x).
inline bool q8_matches(const std::vector<float>& x, const std::vector<u32>& codes, const std::vector<float2>& scales) {
    std::vector<signed char> rq;
    std::vector<float2> rs;
    q8_reference(x, rq, rs);
    bool ok = codes.size() * 4 >= rq.size() && scales.size() >= rs.size() &&
              memcmp(codes.data(), rq.data(), rq.size()) == 0;
    for (size_t b = 0; ok && b < rs.size(); b++) ok &= memcmp(&scales[b], &rs[b], sizeof(float2)) == 0;
    return ok;
}
