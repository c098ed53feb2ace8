// The block-wide sum as kernels/elementwise.cu has it (the real build
// compiles that file ahead of attention.cu and fold.cu), for the programs
// that include those without it.
#pragma once
#include "shim.h"

inline float block_sum(float v, float* partial) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        float w = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0.f;
        w = warp_sum(w);
        if (threadIdx.x == 0) partial[0] = w;
    }
    __syncthreads();
    return partial[0];
}
