//! The CUDA backend's tuning and profiling switches, parsed here and nowhere
//! else: each is a flag of `serve` and `generate` with an environment
//! spelling (`CORRIDOR_PDL=0`, ...) that A/B scripts set, and the result is
//! one `CudaTuning` value handed down in `BootOptions`. No crate below this
//! one reads the environment (crates/cli/tests/environment.rs checks it).

use clap::{Args, ValueEnum};
use corridor_backend::CudaTuning;

/// Where `--help` lists the switches.
const H: &str = "CUDA tuning (for measurements; the defaults are the fast path)";

/// A switch as flags and environment spell it: `on`/`off`, `1`/`0`, `true`/`false`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Switch {
    #[value(alias = "1", alias = "true")]
    On,
    #[value(alias = "0", alias = "false")]
    Off,
}

impl Switch {
    pub(crate) fn on(self) -> bool {
        self == Switch::On
    }
}

/// How the CUDA backend launches steps; every switch exists to measure a step with and without it.
#[derive(Args, Debug, Clone)]
pub struct CudaFlags {
    /// Programmatic dependent launch on sm_90 and later: each kernel may start while the one ahead
    /// of it finishes and waits for it on the device.
    #[arg(long, help_heading = H, value_enum, default_value_t = Switch::On, env = "CORRIDOR_PDL", value_name = "on|off")]
    cuda_pdl: Switch,
    /// With --cuda-pdl, a bf16 GEMV started ahead of its time loads its first weights before it
    /// waits for the kernel ahead, overlapping that kernel's tail (the results are the same).
    #[arg(long, help_heading = H, value_enum, default_value_t = Switch::On, env = "CORRIDOR_EARLY_WEIGHTS", value_name = "on|off")]
    cuda_early_weights: Switch,
    /// One launch for a layer's q/k/v GEMVs, for gate/up and SiLU, and for RoPE and the KV store,
    /// where the shapes allow.
    #[arg(long, help_heading = H, value_enum, default_value_t = Switch::On, env = "CORRIDOR_FUSE", value_name = "on|off")]
    cuda_fuse: Switch,
    /// Decode attention with a token per lane for steps of 8 rows and more (off: the warp-per-token
    /// kernel).
    #[arg(long, help_heading = H, value_enum, default_value_t = Switch::On, env = "CORRIDOR_ATTN_LANES", value_name = "on|off")]
    cuda_attn_lanes: Switch,
    /// Log each op's device time every N steps; steps then run without graphs and every op is
    /// waited for, so the server is slower while it profiles.
    #[arg(long, help_heading = H, env = "CORRIDOR_CUDA_PROFILE", value_name = "N")]
    cuda_profile: Option<u64>,
    /// Let decode steps with NCCL calls (`--tp`/`--pp` over GPUs) be captured as CUDA graphs (off:
    /// those steps run op by op, to rule graphs out).
    #[arg(long, help_heading = H, value_enum, default_value_t = Switch::On, env = "CORRIDOR_NCCL_GRAPHS", value_name = "on|off")]
    nccl_graphs: Switch,
    /// Prefill the gated delta rule of a hybrid model (Qwen3.5) in its chunked form on the GPU
    /// instead of token by token (off: the scan, which measured faster on the H200).
    #[arg(long, help_heading = H, value_enum, default_value_t = Switch::Off, env = "CORRIDOR_DELTA_CHUNKED", value_name = "on|off")]
    cuda_delta_chunked: Switch,
    /// Block-format matmuls of up to 8 rows quantize their input to 8 bits and take the integer
    /// GEMVs (off: the f32 GEMVs and the tensor-core kernel, with f32 or bf16 inputs).
    #[arg(long, help_heading = H, value_enum, default_value_t = Switch::On, env = "CORRIDOR_Q8_GEMV", value_name = "on|off")]
    cuda_q8_gemv: Switch,
    /// On sm_90 and later, read the attention output projection's weights into the L2 cache while
    /// RoPE, the KV store and attention run (kernels that move few bytes), so that GEMV does not
    /// start from memory (the results are the same; off: batch-1 decode of a Q4_K_M file measured
    /// 3.67 against 3.07 ms a step with it on an H100, BENCHMARKS.md).
    #[arg(long, help_heading = H, value_enum, default_value_t = Switch::Off, env = "CORRIDOR_L2_PREFETCH", value_name = "on|off")]
    cuda_l2_prefetch: Switch,
    /// Split-K decode attention merges its splits in its own launch (the last block of a row's
    /// splits to finish combines them) instead of launching a combine kernel after it (off: slower
    /// on an H100, BENCHMARKS.md).
    #[arg(long, help_heading = H, value_enum, default_value_t = Switch::Off, env = "CORRIDOR_ATTN_MERGE", value_name = "on|off")]
    cuda_attn_merge: Switch,
    /// A step of decode rows rotates q and stores the new tokens' K and V inside its attention
    /// launch (off: a RoPE and KV-store launch, then attention; off: served on an H100 it was
    /// within 2% either way, BENCHMARKS.md).
    #[arg(long, help_heading = H, value_enum, default_value_t = Switch::Off, env = "CORRIDOR_ATTN_ROPE", value_name = "on|off")]
    cuda_attn_rope: Switch,
    /// Decode steps of a mixture of experts stored in block formats (a GGUF file's Q4_K / Q6_K
    /// experts) read each chosen expert's weights once with the integer GEMVs of the dense layers,
    /// on rows and SiLU products quantized to 8 bits (off: the routed GEMVs of any storage type,
    /// which decode each weight on its own, about 6 times slower at one row).
    #[arg(long, help_heading = H, value_enum, default_value_t = Switch::On, env = "CORRIDOR_MOE_Q8", value_name = "on|off")]
    cuda_moe_q8: Switch,
    /// One-row bf16 GEMVs take blocks of two weight rows where the last wave of the card's blocks
    /// is fuller than with blocks of four (a Llama-3-8B q/k/v; off: only where blocks of four would
    /// fill under half a wave; off: no faster served, 5.56 against 5.55 ms a step on an H100).
    #[arg(long, help_heading = H, value_enum, default_value_t = Switch::Off, env = "CORRIDOR_GEMV_FILL", value_name = "on|off")]
    cuda_gemv_fill: Switch,
    /// One-row integer GEMVs of block formats (batch-1 decode of a GGUF file) copy their weights
    /// into shared memory three steps ahead of the arithmetic, about three times the bytes in flight
    /// of the default kernels, which hold two steps in registers (the results are the same bits);
    /// off: slower on an H100 (a Q4_K decode layer's GEMVs 58.4 against 45.8 µs).
    #[arg(long, help_heading = H, value_enum, default_value_t = Switch::Off, env = "CORRIDOR_MMVQ_PIPE", value_name = "on|off")]
    cuda_mmvq_pipe: Switch,
    /// The device sampler first sanitizes, edits and finds the largest logit of every slice of 4,096
    /// tokens of every row with many blocks a row, then one block a row draws from there (the same
    /// tokens); off: one block reads the whole row for each of those passes (a greedy row of a
    /// 128,256-token vocabulary took 64 µs that way on an H100).
    #[arg(long, help_heading = H, value_enum, default_value_t = Switch::Off, env = "CORRIDOR_SAMPLE_SLICES", value_name = "on|off")]
    cuda_sample_slices: Switch,
    /// At one row of bf16 weights, each residual add and the RMSNorm after it run inside the GEMVs
    /// around them: o_proj and down_proj add their rows to the residual and leave partial sums of
    /// squares, the q/k/v and gate/up GEMVs scale their products by the norm's 1/rms (no one-block
    /// norm kernel between them, twice a layer); off: the separate add + norm kernel.
    #[arg(long, help_heading = H, value_enum, default_value_t = Switch::Off, env = "CORRIDOR_FOLD_NORM", value_name = "on|off")]
    cuda_fold_norm: Switch,
}

impl CudaFlags {
    pub fn tuning(&self) -> CudaTuning {
        CudaTuning {
            pdl: self.cuda_pdl.on(),
            early_weights: self.cuda_early_weights.on(),
            fuse: self.cuda_fuse.on(),
            lane_attention: self.cuda_attn_lanes.on(),
            profile_every: self.cuda_profile,
            nccl_graphs: self.nccl_graphs.on(),
            delta_chunked: self.cuda_delta_chunked.on(),
            q8_gemv: self.cuda_q8_gemv.on(),
            l2_prefetch: self.cuda_l2_prefetch.on(),
            attn_merge: self.cuda_attn_merge.on(),
            attn_rope: self.cuda_attn_rope.on(),
            moe_q8: self.cuda_moe_q8.on(),
            gemv_fill: self.cuda_gemv_fill.on(),
            mmvq_pipe: self.cuda_mmvq_pipe.on(),
            sample_slices: self.cuda_sample_slices.on(),
            fold_norm: self.cuda_fold_norm.on(),
        }
    }
}

/// NCCL reads its own switches from the environment. NVLink SHARP (multicast)
/// stays off unless `NCCL_NVLS_ENABLE` is set: it allocates multicast objects
/// outside any card's books. Called first thing in `main`, before any thread
/// exists, as changing the environment is only sound then.
pub fn nccl_environment() {
    for (name, value) in nccl_defaults(|name| std::env::var_os(name).is_some()) {
        std::env::set_var(name, value);
    }
}

/// The NCCL variables to set, given which are set already (`is_set`).
fn nccl_defaults(is_set: impl Fn(&str) -> bool) -> Vec<(&'static str, &'static str)> {
    [("NCCL_NVLS_ENABLE", "0")].into_iter().filter(|(name, _)| !is_set(name)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        cuda: CudaFlags,
    }

    fn parse(args: &[&str]) -> CudaTuning {
        Cmd::try_parse_from(std::iter::once("corridor").chain(args.iter().copied())).unwrap().cuda.tuning()
    }

    #[test]
    fn defaults_are_the_backends_defaults() {
        // Holds while none of the switches' variables is set, as in CI.
        assert_eq!(parse(&[]), CudaTuning::default());
    }

    #[test]
    fn each_flag_reaches_its_field() {
        let d = CudaTuning::default();
        assert_eq!(parse(&["--cuda-pdl", "off"]), CudaTuning { pdl: false, ..d });
        assert_eq!(parse(&["--cuda-early-weights", "off"]), CudaTuning { early_weights: false, ..d });
        assert_eq!(parse(&["--cuda-fuse", "0"]), CudaTuning { fuse: false, ..d });
        assert_eq!(parse(&["--cuda-attn-lanes", "false"]), CudaTuning { lane_attention: false, ..d });
        assert_eq!(parse(&["--cuda-profile", "100"]), CudaTuning { profile_every: Some(100), ..d });
        assert_eq!(parse(&["--nccl-graphs", "off"]), CudaTuning { nccl_graphs: false, ..d });
        assert_eq!(parse(&["--cuda-delta-chunked", "on"]), CudaTuning { delta_chunked: true, ..d });
        assert_eq!(parse(&["--cuda-q8-gemv", "off"]), CudaTuning { q8_gemv: false, ..d });
        assert_eq!(parse(&["--cuda-l2-prefetch", "on"]), CudaTuning { l2_prefetch: true, ..d });
        assert_eq!(parse(&["--cuda-attn-merge", "on"]), CudaTuning { attn_merge: true, ..d });
        assert_eq!(parse(&["--cuda-attn-rope", "1"]), CudaTuning { attn_rope: true, ..d });
        assert_eq!(parse(&["--cuda-moe-q8", "off"]), CudaTuning { moe_q8: false, ..d });
        assert_eq!(parse(&["--cuda-gemv-fill", "on"]), CudaTuning { gemv_fill: true, ..d });
        assert_eq!(parse(&["--cuda-mmvq-pipe", "on"]), CudaTuning { mmvq_pipe: true, ..d });
        assert_eq!(parse(&["--cuda-fuse", "1"]), d);
    }

    #[test]
    fn nvlink_sharp_is_off_unless_the_environment_says_otherwise() {
        assert_eq!(nccl_defaults(|_| false), vec![("NCCL_NVLS_ENABLE", "0")]);
        assert!(nccl_defaults(|name| name == "NCCL_NVLS_ENABLE").is_empty());
    }

    #[test]
    fn a_misspelt_switch_is_an_error() {
        let e = Cmd::try_parse_from(["corridor", "--cuda-pdl", "maybe"]).err().expect("rejected");
        assert!(e.to_string().contains("--cuda-pdl"), "{e}");
    }
}
