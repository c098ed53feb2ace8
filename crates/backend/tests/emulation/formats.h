// The ggml block formats for the emulated kernel tests (mmvq.cpp, mmq.cpp):
// their storage codes, the f16 conversions, a reference decoder of each
// format in double from its definition (the layouts of cpu/quant.rs
// `unpack_block`), and random blocks with edge values among them.
#pragma once
#include "shim.h"
#include <atomic>
#include <random>


// IEEE half to float (cvt.f32.f16), exactly.
inline float half_to_float(unsigned short h) {
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp((float)(m | 1024), e - 25);
    return s ? -v : v;
}
inline float f16_to_f32(unsigned short h) { return half_to_float(h); }

namespace {

// The random source of the test program (one per program: this header is
// included once).
std::mt19937 rng(23);
float rnd(float s) { return std::uniform_real_distribution<float>(-s, s)(rng); }
u8 rbyte() { return (u8)(rng() & 0xff); }

unsigned short to_half(float f) {
    // Round to nearest even through double; the values used here are normal or zero.
    if (f == 0.f) return std::signbit(f) ? 0x8000 : 0;
    int s = f < 0, e;
    double m = std::frexp(std::fabs((double)f), &e); // |f| = m 2^e, m in [0.5, 1)
    int he = e + 14;
    if (he <= 0) return (unsigned short)(s << 15); // not used here
    double frac = m * 2048.0;                        // 11 significant bits
    long long q = std::llrint(frac);
    if (q == 2048) q = 1024, he++;
    return (unsigned short)((s << 15) | (he << 10) | (q & 1023));
}

// A format: bytes and weights per block, where its f16 fields are, and the
// reference decode of a block into `out` (its weights in double).
struct Format {
    const char* name;
    int dt, bytes, elems;
    std::vector<int> f16s;
    void (*decode)(const u8* b, double* out);
};

// The weights of the formats whose tensor-core decode works in bf16 pairs
// (blocks.cu `unpack8_bf16`), a * t - b: exact by default; with
// `kernel_bf16` set, as that decode rounds them: a and b to bf16 first, then
// the result once (`bf16_of_double`, shim.h).
bool kernel_bf16 = false;
double bf16_round(double v) { return bf16_to_f32(bf16_of_double(v)); }
double affine(double a, double t, double b) {
    return kernel_bf16 ? bf16_round(bf16_round(a) * t - bf16_round(b)) : a * t - b;
}

double hd(const u8* p) { return half_to_float((unsigned short)(p[0] | (p[1] << 8))); }
const int kLevels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

void dec_q8_0(const u8* b, double* o) {
    for (int i = 0; i < 32; i++) o[i] = hd(b) * (signed char)b[2 + i];
}
void dec_q4_0(const u8* b, double* o) {
    for (int j = 0; j < 16; j++)
        o[j] = affine(hd(b), (b[2 + j] & 15) - 8, 0), o[j + 16] = affine(hd(b), (b[2 + j] >> 4) - 8, 0);
}
void dec_q4_1(const u8* b, double* o) {
    for (int j = 0; j < 16; j++) o[j] = hd(b) * (b[4 + j] & 15) + hd(b + 2), o[j + 16] = hd(b) * (b[4 + j] >> 4) + hd(b + 2);
}
u32 le32(const u8* p) { return p[0] | (p[1] << 8) | (p[2] << 16) | ((u32)p[3] << 24); }
void dec_q5_0(const u8* b, double* o) {
    u32 qh = le32(b + 2);
    for (int j = 0; j < 16; j++) {
        o[j] = hd(b) * ((int)((b[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16);
        o[j + 16] = hd(b) * ((int)((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
}
void dec_q5_1(const u8* b, double* o) {
    u32 qh = le32(b + 4);
    for (int j = 0; j < 16; j++) {
        o[j] = hd(b) * ((b[8 + j] & 15) | (((qh >> j) & 1) << 4)) + hd(b + 2);
        o[j + 16] = hd(b) * ((b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + hd(b + 2);
    }
}
void dec_iq4_nl(const u8* b, double* o) {
    for (int j = 0; j < 16; j++) o[j] = hd(b) * kLevels[b[2 + j] & 15], o[j + 16] = hd(b) * kLevels[b[2 + j] >> 4];
}
// Q4_K / Q5_K scale and min of sub-block j from the 12 bytes at s.
void k4_scale_min(int j, const u8* s, int& sc, int& m) {
    if (j < 4) sc = s[j] & 63, m = s[j + 4] & 63;
    else sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
}
void dec_k45(const u8* b, double* o, bool five) {
    const u8* qs = b + (five ? 48 : 16);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++)
            for (int hi = 0; hi < 2; hi++) {
                int s = 2 * c + hi, sc, m;
                k4_scale_min(s, b + 4, sc, m);
                int q = hi ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 15;
                if (five) q |= ((b[16 + l] >> s) & 1) << 4;
                o[32 * s + l] = affine(hd(b) * sc, q, hd(b + 2) * m);
            }
}
void dec_q4_k(const u8* b, double* o) { dec_k45(b, o, false); }
void dec_q5_k(const u8* b, double* o) { dec_k45(b, o, true); }
void dec_q6_k(const u8* b, double* o) {
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < 32; l++) {
                int byte = b[64 * h + l + 32 * (k % 2)];
                int low = k < 2 ? byte & 15 : byte >> 4, high = (b[128 + 32 * h + l] >> (2 * k)) & 3;
                int e = 128 * h + 32 * k + l;
                o[e] = affine(hd(b + 208) * (signed char)b[192 + e / 16], (low | (high << 4)) - 32, 0);
            }
}
void dec_q2_k(const u8* b, double* o) {
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                int e = 128 * h + 32 * j + l, sc = b[e / 16];
                int q = (b[16 + 32 * h + l] >> (2 * j)) & 3;
                o[e] = hd(b + 80) * (sc & 15) * q - hd(b + 82) * (sc >> 4);
            }
}
void dec_q3_k(const u8* b, double* o) {
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                int e = 128 * h + 32 * j + l, g = e / 16;
                int q = ((b[32 + 32 * h + l] >> (2 * j)) & 3) - ((b[l] >> (4 * h + j)) & 1 ? 0 : 4);
                int lo = g < 8 ? b[96 + g] & 15 : b[96 + g - 8] >> 4, hi = (b[104 + g % 4] >> (2 * (g / 4))) & 3;
                o[e] = hd(b + 108) * ((lo | (hi << 4)) - 32) * q;
            }
}
void dec_iq4_xs(const u8* b, double* o) {
    int sh = b[2] | (b[3] << 8);
    for (int s = 0; s < 8; s++) {
        int ls = ((b[4 + s / 2] >> (4 * (s % 2))) & 15) | (((sh >> (2 * s)) & 3) << 4);
        for (int j = 0; j < 16; j++) {
            int v = b[8 + 16 * s + j];
            o[32 * s + j] = hd(b) * (ls - 32) * kLevels[v & 15];
            o[32 * s + 16 + j] = hd(b) * (ls - 32) * kLevels[v >> 4];
        }
    }
}

// Every format, in the order of their storage codes (DT_Q8_0 first).
std::vector<Format> formats() {
    return {
        {"Q8_0", DT_Q8_0, 34, 32, {0}, dec_q8_0},
        {"Q4_0", DT_Q4_0, 18, 32, {0}, dec_q4_0},
        {"Q4_1", DT_Q4_1, 20, 32, {0, 2}, dec_q4_1},
        {"Q5_0", DT_Q5_0, 22, 32, {0}, dec_q5_0},
        {"Q5_1", DT_Q5_1, 24, 32, {0, 2}, dec_q5_1},
        {"IQ4_NL", DT_IQ4_NL, 18, 32, {0}, dec_iq4_nl},
        {"Q2_K", DT_Q2_K, 84, 256, {80, 82}, dec_q2_k},
        {"Q3_K", DT_Q3_K, 110, 256, {108}, dec_q3_k},
        {"Q4_K", DT_Q4_K, 144, 256, {0, 2}, dec_q4_k},
        {"Q5_K", DT_Q5_K, 176, 256, {0, 2}, dec_q5_k},
        {"Q6_K", DT_Q6_K, 210, 256, {208}, dec_q6_k},
        {"IQ4_XS", DT_IQ4_XS, 136, 256, {0}, dec_iq4_xs},
    };
}

// Random blocks; one in eight with every code byte 0xff (the largest codes),
// one in eight with 0x80 (Q8_0's -128), f16 fields zero, negative or large
// now and then.
std::vector<u8> random_blocks(const Format& f, int blocks) {
    std::vector<u8> w((size_t)blocks * f.bytes);
    for (int b = 0; b < blocks; b++) {
        u8* p = &w[(size_t)b * f.bytes];
        int kind = rng() % 8;
        for (int i = 0; i < f.bytes; i++) p[i] = kind == 0 ? 0xff : kind == 1 ? 0x80 : rbyte();
        for (int at : f.f16s) {
            int pick = rng() % 8;
            float v = pick == 0 ? 0.f : pick == 1 ? -rnd(1.f) * 0.05f : pick == 2 ? 3.5f : rnd(1.f) * 0.02f;
            unsigned short h = to_half(v);
            p[at] = h & 0xff, p[at + 1] = h >> 8;
        }
    }
    return w;
}

} // namespace

// common.cu `load_elem` for the block formats: element j of a stored row,
// from the reference decoder; `load_elem_calls` counts them (a kernel that
// should decode a format word-wise calls it never).
std::atomic<long> load_elem_calls{0};
inline float load_elem(const u8* row, int dtype, int j) {
    load_elem_calls++;
    static const std::vector<Format> all = formats();
    if (dtype < DT_Q8_0 || dtype > DT_IQ4_XS) abort();
    const Format& f = all[dtype - DT_Q8_0];
    double v[256];
    f.decode(row + (long long)(j / f.elems) * f.bytes, v);
    return (float)v[j % f.elems];
}
