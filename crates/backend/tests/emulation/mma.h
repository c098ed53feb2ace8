// The tensor-core path's instructions under the emulation of shim.h, from
// their PTX definitions: shared-memory addresses (cvta.to.shared), cp.async
// with its commit groups, the bf16 conversion, mma.sync m16n8k16 and
// ldmatrix (x4, with and without .trans). Used by attention.cpp and mmq.cpp.
//
// cp.async lands late: a thread's copies are written to shared memory only
// when its cp.async.wait_group lets their group complete (the source is read
// at the issue), so a missing or too lenient wait leaves the staged data
// unwritten here. Both ends must be 16-byte aligned where bytes are copied,
// and the source inside the buffers the test names (emu::global_buffers).
#pragma once
#include "shim.h"
#include <cstdio>
#include <cstdlib>

namespace emu {
// Shared memory addresses are 32-bit offsets from an anchor in the same
// image as the kernels' shared arrays (integer arithmetic: the arrays are
// other objects).
unsigned char anchor;
inline unsigned char* smem(u32 addr) { return (unsigned char*)((intptr_t)&anchor + (int32_t)addr); }

// A copy issued and not yet landed: its destination and the 16 bytes it writes.
struct Copy {
    u32 dst;
    unsigned char bytes[16];
};
// This thread's copies by commit group, oldest first; the last group is the
// one still open (cp.async.commit_group closes it). Every CUDA thread is a
// std::thread of its own, so nothing carries over from block to block.
thread_local std::vector<std::vector<Copy>> copies(1);
// Where cp.async may read from while a test names its kernel's global
// buffers (none named: anywhere); a read past a buffer's end fails.
std::vector<std::pair<const void*, size_t>> global_buffers;

[[noreturn]] inline void fault(const char* what) {
    printf("FAIL %s (thread %u of block %u, %u)\n", what, threadIdx.x, blockIdx.x, blockIdx.y);
    fflush(stdout);
    abort();
}
} // namespace emu

inline u32 smem_u32(const void* p) { return (u32)((intptr_t)p - (intptr_t)&emu::anchor); }
// cp.async.cg.shared.global [dst], [src], 16, bytes: bytes from src, then zeros.
inline void cp_async16(u32 dst, const void* src, int bytes) {
    if (bytes < 0 || bytes > 16) emu::fault("cp.async: src-size outside 0..16");
    if (((uintptr_t)emu::smem(dst) & 15) || (bytes > 0 && ((uintptr_t)src & 15)))
        emu::fault("cp.async: an address not 16-byte aligned");
    bool inside = bytes == 0 || emu::global_buffers.empty();
    for (auto& [p, len] : emu::global_buffers)
        inside |= (uintptr_t)src >= (uintptr_t)p && (uintptr_t)src + bytes <= (uintptr_t)p + len;
    if (!inside) emu::fault("cp.async: a read outside the kernel's buffers");
    emu::Copy c{dst, {}};
    memcpy(c.bytes, src, bytes);
    emu::copies.back().push_back(c);
}
inline void cp_async_commit() { emu::copies.emplace_back(); }
// cp.async.wait_group N: every committed group but the newest N lands.
template <int N>
void cp_async_wait() {
    auto& q = emu::copies;
    int land = (int)q.size() - 1 - N;
    for (int g = 0; g < land; g++)
        for (auto& c : q[g]) memcpy(emu::smem(c.dst), c.bytes, 16);
    if (land > 0) q.erase(q.begin(), q.begin() + land);
}

// cvt.rn.bf16x2.f32: round to nearest even (the values here are finite).
inline bf16_t to_bf16(float f) {
    u32 u = __float_as_uint(f);
    u += 0x7fff + ((u >> 16) & 1);
    return (bf16_t)(u >> 16);
}
inline u32 pack_bf16x2(float lo, float hi) { return (u32)to_bf16(lo) | ((u32)to_bf16(hi) << 16); }

inline float bf16_lo(u32 w) { return bf16_to_f32((bf16_t)(w & 0xffff)); }
inline float bf16_hi(u32 w) { return bf16_to_f32((bf16_t)(w >> 16)); }
inline float bf16_half(u32 w, int hi) { return hi ? bf16_hi(w) : bf16_lo(w); }

// fma.rn.bf16x2: each half's a * b + c is exact in double (8-bit
// significands), then rounded once.
inline u32 bf16x2_fma(u32 a, u32 b, u32 c) {
    u32 r = 0;
    for (int h = 0; h < 2; h++) {
        double v = (double)bf16_half(a, h) * bf16_half(b, h) + bf16_half(c, h);
        r |= (u32)bf16_of_double(v) << (16 * h);
    }
    return r;
}

// mma.m16n8k16.row.col: lane = 4 * group + t. A: a0 (row group, cols 2t..2t+1),
// a1 (row group + 8), a2 (cols + 8), a3 (both); B: b0 (rows 2t..2t+1 of column
// group), b1 (rows + 8); C: c0, c1 (row group, cols 2t, 2t+1), c2, c3 (row + 8).
inline void mma_bf16_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    struct Frag {
        u32 a[4], b[2];
    } mine = {{a[0], a[1], a[2], a[3]}, {b0, b1}};
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    emu::exchange(mine, [&](auto at) {
        for (int i = 0; i < 4; i++) {
            int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
            float acc = c[i];
            for (int k = 0; k < 16; k++) {
                Frag fa = at((row % 8) * 4 + (k % 8) / 2), fb = at(col * 4 + (k % 8) / 2);
                float x = bf16_half(fa.a[row / 8 + 2 * (k / 8)], k & 1);
                float y = bf16_half(fb.b[k / 8], k & 1);
                acc += x * y;
            }
            c[i] = acc;
        }
    });
}
// The same instruction with the registers as separate operands, in PTX order
// (kernels/gemv.cu `mma_bf16_m16n8k16`).
inline void mma_bf16_m16n8k16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    const u32 a[4] = {a0, a1, a2, a3};
    mma_bf16_16816(c, a, b0, b1);
}

// ldmatrix.x4: lane l gives the address of row l % 8 of matrix l / 8; register
// i receives matrix i's row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1, or with
// .trans its elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4).
template <bool TRANS>
void ldsm(u32 addr, u32 (&r)[4]) {
    int lane = threadIdx.x & 31;
    emu::exchange(addr, [&](auto at) {
        for (int i = 0; i < 4; i++) {
            if (!TRANS) {
                memcpy(&r[i], emu::smem(at(i * 8 + lane / 4)) + (lane % 4) * 4, 4);
            } else {
                bf16_t lo, hi;
                memcpy(&lo, emu::smem(at(i * 8 + 2 * (lane % 4))) + (lane / 4) * 2, 2);
                memcpy(&hi, emu::smem(at(i * 8 + 2 * (lane % 4) + 1)) + (lane / 4) * 2, 2);
                r[i] = (u32)lo | ((u32)hi << 16);
            }
        }
    });
}
inline void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    u32 r[4];
    ldsm<false>(addr, r);
    r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}
inline void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    u32 r[4];
    ldsm<true>(addr, r);
    r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}
