// A residual add and the RMSNorm after it, folded into the one-row GEMVs
// around them, so no one-block kernel runs between two wide ones:
//
// - the GEMV that produces the add's input (o_proj, down_proj) adds each of
//   its rows to the residual x, stores x * w (w the norm's weight) into
//   `hw`, and its block's sum of x^2 over its rows into slots[blockIdx.x];
// - the GEMVs that read the norm (q/k/v, gate/up) take `hw` as their input,
//   sum the slots in one fixed order and scale their products by 1 / rms:
//   W (x * w / rms) = (W (x * w)) / rms. They also store the norm itself
//   (hw / rms) into the activation it stands for, each block a share of it.
//
// Every block sums the slots in the same order, so every block has the same
// 1 / rms, run after run. `fold_settle` is the same last step as a kernel of
// its own, for a reader that is not one of those GEMVs.

// The producer's epilogue, in the block's first warp: lane t < live holds
// row j0 + t's sum s. x[j] += s; hw[j] = x[j] * w[j]; slots[blockIdx.x] is
// the sum of the new x[j]^2 over the block's rows.
__device__ __forceinline__ void fold_residual(float s, int live, int j0, float* __restrict__ x,
                                              const float* __restrict__ w, float* __restrict__ hw,
                                              float* __restrict__ slots) {
    int t = threadIdx.x;
    float q = 0.f;
    if (t < live) {
        float h = x[j0 + t] + s;
        x[j0 + t] = h;
        hw[j0 + t] = h * w[j0 + t];
        q = h * h;
    }
    q = warp_sum(q);
    if (t == 0) slots[blockIdx.x] = q;
}

// 1 / rms of the row whose squares the producer left in `slots`: every
// thread of the block gets it (two barriers).
__device__ __forceinline__ float fold_inv_rms(const float* __restrict__ slots, int n_slots, int cols, float eps) {
    __shared__ float partial[32];
    float q = 0.f;
    for (int i = threadIdx.x; i < n_slots; i += blockDim.x) q += slots[i];
    return 1.0f / sqrtf(block_sum(q, partial) / (float)cols + eps);
}

// This block's share of the norm: h = hw * inv over the grid.
__device__ __forceinline__ void fold_store_norm(const float* __restrict__ hw, float inv, float* __restrict__ h,
                                                int cols) {
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < cols; j += gridDim.x * blockDim.x) h[j] = hw[j] * inv;
}

// The folded norm's last step alone (any grid): h = hw / rms.
extern "C" __global__ void fold_settle(const float* hw, const float* slots, int n_slots, float* h, int cols,
                                       float eps) {
    pdl_enter();
    float inv = fold_inv_rms(slots, n_slots, cols, eps);
    fold_store_norm(hw, inv, h, cols);
}
