// What the plain-op emulation programs share (stacked.cpp, fold.cpp): a
// named pass/fail line per comparison and its count, random f32 vectors, and
// the guard value past every output that must stay as it was.
#pragma once
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace emu_checks {

const float GUARD = 12345.5f;
inline int failures = 0;

inline void check(const std::string& what, bool ok) {
    std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
    if (!ok) failures++;
}

inline std::vector<float> random(std::mt19937& rng, size_t n, float scale) {
    std::uniform_real_distribution<float> d(-scale, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
}

} // namespace emu_checks
