//! The CUDA backend's tuning and profiling switches, as one value.
//!
//! Every switch is on by default but the chunked delta rule, the L2
//! prefetch and the two attention fusions (profiling off), and exists so one
//! binary can
//! measure a step with and without it. The backend never reads the
//! environment: the `corridor` command parses these from its flags (each
//! with an environment spelling for A/B scripts, README.md "What a GPU
//! needs") and hands the value down through `BootOptions`. The type is
//! defined without the `cuda` feature so the layers above can carry it in
//! every build.

/// How the CUDA backend launches a step, and whether it profiles ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaTuning {
    /// Programmatic dependent launch (sm_90 and later; ignored below): each
    /// kernel may start while the one ahead of it finishes, and waits for it
    /// on the device (`--cuda-pdl off`, `CORRIDOR_PDL=0`).
    pub pdl: bool,
    /// A bf16 GEMV launched ahead of its time (with `pdl`) loads its first
    /// weights before it waits for the kernel ahead, so those loads overlap
    /// that kernel's tail (`--cuda-early-weights off`,
    /// `CORRIDOR_EARLY_WEIGHTS=0`; the results are the same either way).
    pub early_weights: bool,
    /// One launch for a layer's q/k/v GEMVs, for gate/up and SiLU, and for
    /// RoPE and the KV store, where the shapes allow (`--cuda-fuse off`,
    /// `CORRIDOR_FUSE=0`).
    pub fuse: bool,
    /// Decode attention with a token per lane for steps of 8 rows and more
    /// (`--cuda-attn-lanes off`, `CORRIDOR_ATTN_LANES=0`, keeps the
    /// warp-per-token kernel).
    pub lane_attention: bool,
    /// Per-op device time, a table logged every this many steps; steps then
    /// run without graphs and every op is waited for (`--cuda-profile N`,
    /// `CORRIDOR_CUDA_PROFILE=N`; `None`: off).
    pub profile_every: Option<u64>,
    /// Decode steps with NCCL calls may be captured as graphs
    /// (`--nccl-graphs off`, `CORRIDOR_NCCL_GRAPHS=0`, rules graphs out).
    pub nccl_graphs: bool,
    /// Prefill steps run the gated delta rule in its chunked form
    /// (`--cuda-delta-chunked on`, `CORRIDOR_DELTA_CHUNKED=1`) instead of the
    /// token-by-token scan. Off by default: on the H200 the chunked kernel,
    /// on CUDA cores, measured 0.9 times the scan's speed at the Qwen3.5-27B
    /// shape (`cuda_check --bench`, BENCHMARKS.md).
    pub delta_chunked: bool,
    /// Block-format matmuls of up to 8 rows quantize their input to 8 bits
    /// per 32 and take the integer GEMVs (`--cuda-q8-gemv off`,
    /// `CORRIDOR_Q8_GEMV=0`, keeps the f32 GEMVs and the tensor-core mmq).
    pub q8_gemv: bool,
    /// While RoPE and the KV store run (a launch that moves few bytes, ahead
    /// of attention, which moves few more at short contexts), the card
    /// reads the attention output projection's weights into its L2 cache, so
    /// that GEMV finds them there instead of waiting on memory after an idle
    /// stretch (`Backend::prefetch`; `--cuda-l2-prefetch on`,
    /// `CORRIDOR_L2_PREFETCH=1`; sm_90 and later; the results are the same
    /// either way). Off by default: it costs more than it saves (on an H100,
    /// batch-1 decode of a Q4_K_M file took 3.67 ms a step with it against
    /// 3.07 without, `scripts/gpu/session.sh ab`, BENCHMARKS.md; where the
    /// time goes is not profiled).
    pub l2_prefetch: bool,
    /// Split-K decode attention merges its splits in the same launch: the
    /// last block of a row's splits to finish combines them (a counter per
    /// row and block of heads), so no combine kernel is launched after it
    /// (`--cuda-attn-merge on`, `CORRIDOR_ATTN_MERGE=1`; off, a combine
    /// launch follows; the results agree to rounding). Off by default: on an
    /// H100 one decode row's attention took 5-10 µs longer at 640 tokens and
    /// 30-60 µs at 4,096 (`cuda_check --bench-attention`, BENCHMARKS.md): the
    /// merging block walks the splits a load round trip at a time.
    pub attn_merge: bool,
    /// A step of decode rows rotates q and stores the new tokens' K and V
    /// inside its attention launch (`Backend::rope_attention` in one pass;
    /// `--cuda-attn-rope on`, `CORRIDOR_ATTN_ROPE=1`; off, RoPE with the KV
    /// store is launched, then attention). Checked on an H100 (`cuda_check`);
    /// off by default: served there, a step took 3.00 against 3.04 ms
    /// (Q4_K_M, batch 1) and 5.71 against 5.62 ms (bf16), within the run's
    /// noise either way (BENCHMARKS.md): the launch it saves overlaps the
    /// one before it already (PDL), and every block then rotates its q heads.
    pub attn_rope: bool,
    /// Decode steps of block-format experts (a GGUF file's mixture of
    /// experts) take the routed integer GEMVs: each chosen expert's weights
    /// read once by the dense layers' integer GEMV, on rows and SiLU products
    /// quantized to 8 bits (`--cuda-moe-q8 off`, `CORRIDOR_MOE_Q8=0`, keeps
    /// the routed GEMVs of any storage type, which decode every weight on its
    /// own). A Qwen3-30B-A3B expert layer of Q4_K / Q6_K experts at one row:
    /// 0.037 against 0.214 ms on an H100 (`cuda_check --bench-moe`).
    pub moe_q8: bool,
    /// One-row bf16 GEMVs take blocks of two weight rows where their last
    /// wave is fuller than that of blocks of four (a Llama-3-8B q/k/v of
    /// 6,144 rows: 1,536 four-row blocks fill 73% of two waves of 8 per SM on
    /// 132 SMs, 3,072 two-row ones 97% of three; `--cuda-gemv-fill on`,
    /// `CORRIDOR_GEMV_FILL=1`; off, two-row blocks only where four-row ones
    /// fill under half a wave). Off by default: served batch-1 decode of the
    /// bf16 8B shape took 5.56 ms a step with it against 5.55 without (H100,
    /// `scripts/gpu/session.sh ab`).
    pub gemv_fill: bool,
    /// One-row integer GEMVs of block formats (batch-1 decode of a GGUF
    /// file) copy their weights into shared memory three steps ahead of the
    /// arithmetic (cp.async, kernels/mmvq.cu `mv_pipe_loop`) instead of
    /// holding at most two steps in registers (`--cuda-mmvq-pipe on`,
    /// `CORRIDOR_MMVQ_PIPE=1`): about three times the bytes in flight a
    /// warp, for GEMVs that ran no faster on an H200 than on an H100. The
    /// results are the same bits. Off: slower on an H100.
    pub mmvq_pipe: bool,
    /// The device sampler first sanitizes, edits and finds the largest
    /// logit of every slice of 4,096 tokens of every row, many blocks a row
    /// (kernels/sample.cu `sample_scan`), and one block a row draws from
    /// there (`--cuda-sample-slices`); off: one block reads the whole row
    /// for each of those passes. The same results either way.
    pub sample_slices: bool,
    /// At one row of bf16 weights, a residual add and the RMSNorm after it
    /// run inside the GEMVs around them (kernels/fold.cu): o_proj and
    /// down_proj add their rows to the residual and leave each block's sum
    /// of squares, and the q/k/v and gate/up GEMVs that read the norm scale
    /// their products by its 1 / rms (`--cuda-fold-norm`): no one-block
    /// norm kernel between two wide ones, twice a layer. The products
    /// differ from the separate norm's in the last bits (the scale is
    /// applied after the sum).
    pub fold_norm: bool,
}

impl Default for CudaTuning {
    fn default() -> Self {
        CudaTuning {
            pdl: true,
            early_weights: true,
            fuse: true,
            lane_attention: true,
            profile_every: None,
            nccl_graphs: true,
            delta_chunked: false,
            q8_gemv: true,
            l2_prefetch: false,
            attn_merge: false,
            attn_rope: false,
            moe_q8: true,
            gemv_fill: false,
            mmvq_pipe: false,
            sample_slices: false,
            fold_norm: false,
        }
    }
}
