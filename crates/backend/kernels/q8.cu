// The 8-bit quantization of activations that the integer GEMVs of mmvq.cu
// read (d = max|x| / 127 per block of 32, q = round(x / d) half away from
// zero, exactly the CPU's `quant::Q8Row`): `q8_quantize` there, and the ops
// that store their output quantized as they write it (the norms, the gate/up
// GEMV's SiLU product, attention's combine pass) through the helpers here,
// which give the same bits.

// The code of one activation: round half away from zero (Rust's `f32::round`)
// and saturate as Rust's `as i8` does (NaN to 0: the conversion gives 0).
__device__ __forceinline__ int q8_code(float v) {
    int q = (int)roundf(v);
    return q < -128 ? -128 : (q > 127 ? 127 : q);
}

// `v`, a float4 of x (zero where `live` is false), quantized as
// `q8_quantize` quantizes it: eight consecutive lanes hold one block of 32
// values, t (the float4's index in the flattened [rows][k]) a multiple of 8
// at the first of them. Every lane of the warp takes part in the shuffles;
// the live ones store.
__device__ __forceinline__ void q8_store4(float4 v, bool live, u32* __restrict__ q, float2* __restrict__ s,
                                          long long t) {
    // max is exact in any order, so this is the CPU's fold.
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float d = amax / 127.0f;
    float inv = d > 0.f ? 1.0f / d : 0.f;
    int q0 = q8_code(v.x * inv), q1 = q8_code(v.y * inv), q2 = q8_code(v.z * inv), q3 = q8_code(v.w * inv);
    int sum = q0 + q1 + q2 + q3;
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (live) {
        q[t] = (u32)(q0 & 0xff) | ((u32)(q1 & 0xff) << 8) | ((u32)(q2 & 0xff) << 16) | ((u32)(q3 & 0xff) << 24);
        if ((t & 7) == 0) s[t >> 3] = make_float2(d, d * (float)sum);
    }
}

// `v`, one value of x a lane (zero where `live` is false), quantized as
// `q8_quantize` quantizes it: the warp's 32 lanes hold one block of 32
// consecutive values, e (lane 0's index in the flattened [rows][k]) a
// multiple of 32. Every lane takes part; a live block's lanes store.
__device__ __forceinline__ void q8_store1(float v, bool live, u32* __restrict__ q, float2* __restrict__ s,
                                          long long e) {
    int lane = threadIdx.x & 31;
    float amax = warp_max(fabsf(v));
    float d = amax / 127.0f;
    float inv = d > 0.f ? 1.0f / d : 0.f;
    int c = q8_code(v * inv);
    int sum = c;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    u32 b = (u32)(c & 0xff);
    u32 word = b | (__shfl_down_sync(0xffffffffu, b, 1) << 8) | (__shfl_down_sync(0xffffffffu, b, 2) << 16) |
               (__shfl_down_sync(0xffffffffu, b, 3) << 24);
    if (live) {
        if ((lane & 3) == 0) q[(e >> 2) + (lane >> 2)] = word;
        if (lane == 0) s[e >> 5] = make_float2(d, d * (float)sum);
    }
}
