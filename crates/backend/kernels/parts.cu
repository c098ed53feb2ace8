// Launches over up to three matrices of one input (a layer's q, k and v):
// the blocks of each matrix follow those of the matrix before, `per` weight
// rows a block (gemv.cu `gemv_bf16_body`, mmvq.cu `mmvq_body`); and what the
// GEMVs of both files do with a warp's partial sums.

// Which matrix block `b` serves (0, 1 or 2) for matrices of n0 and n1 rows
// (the third takes the rest); `b` becomes the block's index within it.
__device__ __forceinline__ int launch_part(int& b, int n0, int n1, int per) {
    int nb0 = (n0 + per - 1) / per, nb1 = (n1 + per - 1) / per;
    if (b >= nb0 + nb1) {
        b -= nb0 + nb1;
        return 2;
    }
    if (b >= nb0) {
        b -= nb0;
        return 1;
    }
    return 0;
}

// A warp's R x NW partial sums of its input rows below `rows`, each summed
// over the warp's lanes, to dst[r * NW + i] (lane 0 stores).
template <int R, int NW>
__device__ __forceinline__ void warp_sums_store(const float (&acc)[R][NW], float* dst, int rows) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (r < rows) {
#pragma unroll
            for (int i = 0; i < NW; i++) {
                float s = warp_sum(acc[r][i]);
                if (lane == 0) dst[r * NW + i] = s;
            }
        }
    }
}
