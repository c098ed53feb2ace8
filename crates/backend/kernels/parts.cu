// Launches over up to three matrices of one input (a layer's q, k and v):
// the blocks of each matrix follow those of the matrix before, `per` weight
// rows a block (gemv.cu `gemv_bf16_body`, mmvq.cu `mmvq_body`).

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
