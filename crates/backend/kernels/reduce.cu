// Block-wide reductions (the norms, attention's combine, the folded norm).

// The sum of `v` over the block (every thread gets it); `partial` holds 32
// floats. A fixed order: the same bits every run.
__device__ __forceinline__ float block_sum(float v, float* partial) {
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
