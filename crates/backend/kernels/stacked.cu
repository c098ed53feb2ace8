// The two launches around one GEMM of weights stacked one after another in
// memory (crates/backend/src/cuda/matmul.rs `stacked_lt`): a layer's q, k and
// v, or its gate and up, multiplied at once where cuBLASLt takes them, the
// products then split into their own activations (with their biases) or
// combined into the SiLU product. Under the host emulation in CI too
// (crates/backend/tests/emulation/stacked.cpp).

// `silu_mul` of gate and up as one matmul of their stacked weights wrote
// them: row r's gate at g[r * ld, + cols) and its up right after, at
// g[r * ld + cols, + cols). Four columns a thread (cols a multiple of 4, g
// 16-byte aligned); the same arithmetic as `silu_mul`, element by element.
extern "C" __global__ void silu_mul_stacked(const float* g, int ld, int cols, int rows, float* out, bf16_t* out_bf) {
    pdl_enter();
    const int quads = cols >> 2;
    const long long n = (long long)rows * quads;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / quads;
        const int c = (int)(i - r * quads) * 4;
        const float4 gv = *(const float4*)(g + r * ld + c);
        const float4 uv = *(const float4*)(g + r * ld + cols + c);
        float4 o;
        o.x = gv.x / (1.0f + expf(-gv.x)) * uv.x;
        o.y = gv.y / (1.0f + expf(-gv.y)) * uv.y;
        o.z = gv.z / (1.0f + expf(-gv.z)) * uv.z;
        o.w = gv.w / (1.0f + expf(-gv.w)) * uv.w;
        const long long at = r * cols + c;
        *(float4*)(out + at) = o;
        if (out_bf) {
            out_bf[at] = f32_to_bf16(o.x);
            out_bf[at + 1] = f32_to_bf16(o.y);
            out_bf[at + 2] = f32_to_bf16(o.z);
            out_bf[at + 3] = f32_to_bf16(o.w);
        }
    }
}

// One matmul of stacked weights wrote `rows` rows of `ld` columns to `src`:
// part j's `cj` columns, one part after another. Each part's columns go to
// its own activation (`cj` wide), with its bias added when `bj` is given.
// Four columns a thread (every width a multiple of 4); a part of no columns
// takes none.
extern "C" __global__ void split_cols(const float* src, int ld, int rows, float* d0, int c0, const float* b0, float* d1,
                                      int c1, const float* b1, float* d2, int c2, const float* b2) {
    pdl_enter();
    const int quads = ld >> 2;
    const long long n = (long long)rows * quads;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / quads;
        int c = (int)(i - r * quads) * 4;
        float4 v = *(const float4*)(src + r * ld + c);
        float* d;
        const float* b;
        int w;
        if (c < c0) {
            d = d0, b = b0, w = c0;
        } else if (c < c0 + c1) {
            c -= c0;
            d = d1, b = b1, w = c1;
        } else {
            c -= c0 + c1;
            d = d2, b = b2, w = c2;
        }
        if (b) {
            v.x += b[c];
            v.y += b[c + 1];
            v.z += b[c + 2];
            v.w += b[c + 3];
        }
        *(float4*)(d + r * w + c) = v;
    }
}
