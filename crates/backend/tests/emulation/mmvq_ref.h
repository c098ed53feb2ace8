// What the programs testing the integer GEMVs share (mmvq.cpp, moe_q8.cpp):
// kernels/mmvq.cu compiled under the emulation, with `__dp4a` and
// `__funnelshift_r` emulated from their PTX definitions; input rows with
// edge blocks; matrices of random blocks of a format with their rows
// dequantized in double from the format's definition; and the 8-bit input
// rows as the kernels read them, with the reference dot in double.
#pragma once
#include "formats.h"
#include "mma.h"
#include "q8.h"
#include <cstdio>

// dp4a.s32.s32: c plus the four products of the signed bytes of a and b.
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
// shf.r.clamp... with a shift below 32: the low word of {hi, lo} >> n.
inline u32 __funnelshift_r(u32 lo, u32 hi, int n) {
    return (u32)((((unsigned long long)hi << 32) | lo) >> (n & 31));
}

#include "../../kernels/parts.cu"
#include "../../kernels/mmvq.cu"

// Input rows with edge blocks: all zeros, a tie at every half (x / d = n + 1/2
// rounds away from zero, not to even), one large value among small ones.
std::vector<float> input_rows(int rows, int k) {
    std::vector<float> x((size_t)rows * k);
    for (auto& v : x) v = rnd(2.f);
    if (k >= 128) {
        for (int i = 0; i < 32; i++) x[i] = 0.f;
        for (int i = 0; i < 32; i++) x[32 + i] = i == 0 ? 127.f : (float)(i % 9) - 4.5f;
        for (int i = 0; i < 32; i++) x[64 + i] = i == 7 ? -1000.f : rnd(0.01f);
    }
    return x;
}

// A matrix of random blocks of `f`, n x k, 16-byte aligned as the arena
// places it, and its rows dequantized in double from the definition.
struct Matrix {
    std::vector<uint4> mem;
    long long row_bytes;
    std::vector<double> deq;
    Matrix(const Format& f, int n, int k) {
        int per_row = k / f.elems;
        std::vector<u8> w = random_blocks(f, n * per_row);
        row_bytes = (long long)per_row * f.bytes;
        mem.resize((w.size() + 15) / 16 + 1);
        memcpy(mem.data(), w.data(), w.size());
        deq.resize((size_t)n * k);
        for (int j = 0; j < n; j++)
            for (int b = 0; b < per_row; b++)
                f.decode(ptr() + j * row_bytes + (size_t)b * f.bytes, &deq[(size_t)j * k + (size_t)b * f.elems]);
    }
    const u8* ptr() const { return (const u8*)mem.data(); }
};

// The quantized input rows, as the kernels read them.
struct Input {
    std::vector<signed char> q;
    std::vector<float2> s;
    std::vector<int4> qa;
    Input(int rows, int k) : Input(input_rows(rows, k)) {}
    // Rows of `x` (whole blocks of 32, 16 codes at least) quantized by the reference rule.
    explicit Input(const std::vector<float>& x) {
        q8_reference(x, q, s);
        qa.resize(q.size() / 16);
        memcpy(qa.data(), q.data(), q.size());
    }
    // x[r] . row j of m, in double, and the sum of the terms' magnitudes.
    std::pair<double, double> dot(const Matrix& m, int k, int r, int j) const {
        double ref = 0, mag = 0;
        for (int e = 0; e < k; e++) {
            double xv = (double)s[((size_t)r * k + e) / 32].x * q[(size_t)r * k + e];
            ref += m.deq[(size_t)j * k + e] * xv;
            mag += std::fabs(m.deq[(size_t)j * k + e] * xv);
        }
        return {ref, mag};
    }
};
