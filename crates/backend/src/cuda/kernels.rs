//! The kernel table: the CUDA sources compiled into one module (through
//! the NVRTC/CUBIN cache of `nvrtc.rs`), every kernel the backend launches
//! looked up once by name, and the small launch-shape helpers shared by the
//! ops. What a kernel does is in `crates/backend/kernels/*.cu`; which kernel
//! an op picks is in the module of its concern (`matmul.rs`, `attention.rs`).

use super::device::{cuda_err, Kernel, LaunchDims};
use super::matmul::{mmq_smem_bytes, MMQ_THREADS, MMQ_TILES, MMVQ_WARPS};
use super::nvrtc;
use crate::dtype::DType;
use crate::{BackendError, Result};
use cudarc::driver::{result as cu, sys};
use std::path::Path;

pub(super) struct Kernels {
    pub(super) embedding: Kernel,
    pub(super) rms_norm: Kernel,
    pub(super) add_rms_norm: Kernel,
    pub(super) head_rms_norm: Kernel,
    pub(super) rope: Kernel,
    pub(super) silu_mul: Kernel,
    pub(super) silu_mul_stacked: Kernel,
    pub(super) split_cols: Kernel,
    pub(super) add_assign: Kernel,
    pub(super) add_bias: Kernel,
    pub(super) gather_rows: Kernel,
    pub(super) f32_to_bf16_rows: Kernel,
    pub(super) dequant_rows: Kernel,
    /// The 32-weight-group widening copy of the block formats (blocks.cu).
    pub(super) dequant_rows32: Kernel,
    pub(super) write_kv: Kernel,
    pub(super) rope_write_kv: Kernel,
    /// Indexed by log2 of the row-count instantiation (1, 2, 4, 8 rows).
    pub(super) gemv_bf16: [Kernel; 4],
    pub(super) gemv_bf16_r1_nw2: Kernel,
    /// gate/up/SiLU for 1 and 2 rows.
    pub(super) gemv_bf16_glu: [Kernel; 2],
    /// A folded residual add + norm (fold.cu): its producer and its
    /// consumers, blocks of four weight rows then of two; gate/up/SiLU as a
    /// consumer; its last step alone.
    pub(super) gemv_bf16_residual: [Kernel; 2],
    pub(super) gemv_bf16_fold: [Kernel; 2],
    pub(super) gemv_bf16_glu_fold: Kernel,
    pub(super) fold_settle: Kernel,
    pub(super) gemv_q8_0: [Kernel; 4],
    pub(super) gemv_q4_0: [Kernel; 4],
    pub(super) gemv_q4_1: [Kernel; 4],
    /// The `gemv_bq_body` kernels, one set per entry of `BLOCK_GEMVS`.
    pub(super) gemv_blocks: [[Kernel; 4]; 9],
    pub(super) gemv_bf16_tc: Kernel,
    /// Input rows to 8 bits per 32 for the integer GEMVs (mmvq.cu).
    pub(super) q8_quantize: Kernel,
    /// The integer GEMVs of block formats (mmvq.cu), one set per entry of
    /// `MMVQ_FORMATS`, indexed by log2 of the row-count instantiation (1, 2, 4, 8),
    /// then the pipelined one-row kernel ([`MMVQ_PIPE`]).
    pub(super) mmvq: [[MvKernel; 5]; 12],
    pub(super) gemv_any: Kernel,
    /// The tensor-core matmuls of block formats (mmq.cu), one set per entry of
    /// `MMQ_FORMATS`, indexed by the input-row instantiation (groups of 8, 16,
    /// 32, 64 rows); `None` where the card cannot give a block its shared memory.
    pub(super) mmq: [[Option<MmqKernel>; 4]; 12],
    /// Adds the K slices' partial sums of an mmq launch.
    pub(super) mmq_reduce: Kernel,
    /// Indexed by log2 of the query heads one block serves (1, 2, 4, 8).
    pub(super) attn_partial: [Kernel; 4],
    /// The same for head_dim 64, 128 and 256 exactly (vector loads, tokens in flight).
    pub(super) attn_partial_exact: [[Kernel; 4]; 3],
    /// The token-per-lane kernels, same indexing as `attn_partial_exact`.
    pub(super) attn_lanes: [[Kernel; 4]; 3],
    /// The 32-token-tile kernels for few rows, same indexing.
    pub(super) attn_tile: [[Kernel; 4]; 3],
    /// The same with RoPE and the new token's KV store in them, for steps of decode rows.
    pub(super) attn_tile_rope: [[Kernel; 4]; 3],
    pub(super) attn_combine: Kernel,
    pub(super) attn_prefill_hd64: Kernel,
    pub(super) attn_prefill_hd128: Kernel,
    /// Two blocks per tile, each half of the output (`attention::TILE_PARTS_HD256`).
    pub(super) attn_prefill_hd256: Kernel,
    pub(super) sigmoid_mul: Kernel,
    pub(super) gated_rms_norm: Kernel,
    /// Indexed by taps - 2 (2..=6 taps: `delta::CONV_TAPS`).
    pub(super) causal_conv_silu: [Kernel; 5],
    /// Indexed by log2 of the warps (1, 2, 4, 8: key heads of up to 32, 64, 128, 256).
    pub(super) gated_delta_rule: [Kernel; 4],
    /// The chunked form of the delta rule for prefill (`delta::DELTA_CHUNK_ROWS` tokens a chunk).
    pub(super) gated_delta_rule_chunked: Kernel,
    /// The routed expert FFN (kernels/moe.cu, launched from `moe.rs`).
    pub(super) moe_route: Kernel,
    pub(super) moe_sort: Kernel,
    pub(super) moe_route_sort: Kernel,
    pub(super) moe_gemv_gate_up: Kernel,
    pub(super) moe_gemv_down: Kernel,
    pub(super) moe_gemv_down_combine: Kernel,
    /// The bf16 routed GEMVs: gate/up and down per expert taking one pair at
    /// a time and four (`_p1`, `_p4`), and down with the weighted sum.
    pub(super) moe_gemv_gate_up_bf16: [Kernel; 2],
    pub(super) moe_gemv_down_bf16: [Kernel; 2],
    pub(super) moe_gemv_down_combine_bf16: Kernel,
    pub(super) moe_gemm_gate_up: Kernel,
    pub(super) moe_gemm_down: Kernel,
    pub(super) moe_combine: Kernel,
    /// The routed integer GEMVs of block-format experts (kernels/moe_q8.cu),
    /// gate/up/SiLU and down, one pair per entry of `MMVQ_FORMATS`.
    pub(super) moe_q8: [[MvKernel; 2]; 12],
    /// One block per row: sanitize, edit and draw (kernels/sample.cu).
    pub(super) sample_rows: Kernel,
    /// Many blocks a row: sanitize, edit and each slice's largest value.
    pub(super) sample_scan: Kernel,
    /// `sample_rows` from `sample_scan`'s slices.
    pub(super) sample_rows_sliced: Kernel,
}

/// One instantiation of the mmq kernels: the kernel, the dynamic shared
/// memory a block takes (`matmul::mmq_smem_bytes`) and how many such blocks
/// fit on one SM at once.
#[derive(Clone, Copy, Debug)]
pub(super) struct MmqKernel {
    pub(super) k: Kernel,
    pub(super) shared: u32,
    pub(super) per_sm: usize,
}

impl MmqKernel {
    /// `None` when the card cannot give a block that much shared memory (the
    /// 64-row groups of the wider formats need about 110 KiB; cards of
    /// compute capability 8.6 and 8.9 give 99): the launch then takes groups
    /// of fewer rows.
    fn new(k: Kernel, dtype: DType, tiles: usize) -> Option<MmqKernel> {
        let shared = mmq_smem_bytes(dtype, tiles) as u32;
        match k.allow_shared(shared, MMQ_THREADS) {
            Ok(per_sm) if per_sm > 0 => Some(MmqKernel { k, shared, per_sm: per_sm as usize }),
            _ => None,
        }
    }
}

/// Where `Kernels::mmvq` keeps a format's pipelined one-row integer GEMV
/// (kernels/mmvq.cu `mv_pipe_loop`).
pub(super) const MMVQ_PIPE: usize = 4;

/// An integer GEMV (kernels/mmvq.cu) and how many of its blocks fit on one
/// SM at once: a launch is sized to about that many per SM
/// (`matmul::mmvq_groups`).
#[derive(Clone, Copy, Debug)]
pub(super) struct MvKernel {
    pub(super) k: Kernel,
    pub(super) per_sm: usize,
}

impl MvKernel {
    fn new(k: Kernel) -> Result<MvKernel> {
        let per_sm = k.allow_shared(0, 32 * MMVQ_WARPS)? as usize;
        Ok(MvKernel { k, per_sm: per_sm.max(1) })
    }
}

/// Compile the kernel sources for `arch` (or read them from the cache in
/// `cache_dir`), load the module and look up every kernel of the table.
pub(super) fn load(arch: &str, cache_dir: Option<&Path>) -> Result<(sys::CUmodule, Kernels)> {
    let source: String = nvrtc::SOURCES.concat();
    let compiled = nvrtc::compile_cubin(&source, arch, cache_dir)?;
    // SAFETY: a CUBIN image NVRTC produced for this device's architecture.
    let module = unsafe { cu::module::load_data(compiled.cubin.as_ptr() as *const _) }
        .map_err(|e| cuda_err("cuModuleLoadData", e))?;
    let f = |name: &str| -> Result<Kernel> {
        let c = std::ffi::CString::new(name).expect("kernel names have no NUL");
        // SAFETY: the module is loaded; the name is one of ours.
        unsafe { cu::module::get_function(module, c) }
            .map(Kernel)
            .map_err(|e| cuda_err("cuModuleGetFunction", e))
    };
    // `{prefix}_g{G}_d{D}` for G = 1, 2, 4, 8 and D = 2, 4, 8 (head_dim 64, 128, 256).
    let by_width = |prefix: &str| -> Result<[[Kernel; 4]; 3]> {
        let g = |d: usize| -> Result<[Kernel; 4]> {
            Ok([
                f(&format!("{prefix}_g1_d{d}"))?,
                f(&format!("{prefix}_g2_d{d}"))?,
                f(&format!("{prefix}_g4_d{d}"))?,
                f(&format!("{prefix}_g8_d{d}"))?,
            ])
        };
        Ok([g(2)?, g(4)?, g(8)?])
    };
    let k = Kernels {
        embedding: f("embedding")?,
        rms_norm: f("rms_norm")?,
        add_rms_norm: f("add_rms_norm")?,
        head_rms_norm: f("head_rms_norm")?,
        rope: f("rope")?,
        silu_mul: f("silu_mul")?,
        silu_mul_stacked: f("silu_mul_stacked")?,
        split_cols: f("split_cols")?,
        add_assign: f("add_assign")?,
        add_bias: f("add_bias")?,
        gather_rows: f("gather_rows")?,
        f32_to_bf16_rows: f("f32_to_bf16_rows")?,
        dequant_rows: f("dequant_rows")?,
        dequant_rows32: f("dequant_rows32")?,
        write_kv: f("write_kv")?,
        rope_write_kv: f("rope_write_kv")?,
        gemv_bf16: [f("gemv_bf16_r1")?, f("gemv_bf16_r2")?, f("gemv_bf16_r4")?, f("gemv_bf16_r8")?],
        gemv_bf16_r1_nw2: f("gemv_bf16_r1_nw2")?,
        gemv_bf16_glu: [f("gemv_bf16_glu_r1")?, f("gemv_bf16_glu_r2")?],
        gemv_bf16_residual: [f("gemv_bf16_r1_residual")?, f("gemv_bf16_r1_nw2_residual")?],
        gemv_bf16_fold: [f("gemv_bf16_r1_fold")?, f("gemv_bf16_r1_nw2_fold")?],
        gemv_bf16_glu_fold: f("gemv_bf16_glu_r1_fold")?,
        fold_settle: f("fold_settle")?,
        gemv_q8_0: [f("gemv_q8_0_r1")?, f("gemv_q8_0_r2")?, f("gemv_q8_0_r4")?, f("gemv_q8_0_r8")?],
        gemv_q4_0: [f("gemv_q4_0_r1")?, f("gemv_q4_0_r2")?, f("gemv_q4_0_r4")?, f("gemv_q4_0_r8")?],
        gemv_q4_1: [f("gemv_q4_1_r1")?, f("gemv_q4_1_r2")?, f("gemv_q4_1_r4")?, f("gemv_q4_1_r8")?],
        gemv_blocks: {
            let set = |stem: &str| -> Result<[Kernel; 4]> {
                Ok([
                    f(&format!("gemv_{stem}_r1"))?,
                    f(&format!("gemv_{stem}_r2"))?,
                    f(&format!("gemv_{stem}_r4"))?,
                    f(&format!("gemv_{stem}_r8"))?,
                ])
            };
            let mut sets = Vec::with_capacity(BLOCK_GEMVS.len());
            for &d in BLOCK_GEMVS {
                sets.push(set(&kernel_stem(d))?);
            }
            sets.try_into().map_err(|_| BackendError::Other("block GEMV kernel table".into()))?
        },
        gemv_bf16_tc: f("gemv_bf16_tc")?,
        q8_quantize: f("q8_quantize")?,
        mmvq: {
            let mut sets = Vec::with_capacity(MMVQ_FORMATS.len());
            for d in MMVQ_FORMATS {
                let stem = kernel_stem(d);
                let mv = |name: &str| MvKernel::new(f(&format!("mmvq_{stem}_{name}"))?);
                sets.push([mv("r1")?, mv("r2")?, mv("r4")?, mv("r8")?, mv("p1")?]);
            }
            sets.try_into().map_err(|_| BackendError::Other("mmvq kernel table".into()))?
        },
        gemv_any: f("gemv_any")?,
        mmq: {
            let mut sets = Vec::with_capacity(MMQ_FORMATS.len());
            for d in MMQ_FORMATS {
                let stem = kernel_stem(d);
                let mut set = [None; 4];
                for (slot, nt) in set.iter_mut().zip(MMQ_TILES) {
                    *slot = MmqKernel::new(f(&format!("mmq_{stem}_n{nt}"))?, d, nt);
                }
                sets.push(set);
            }
            sets.try_into().map_err(|_| BackendError::Other("mmq kernel table".into()))?
        },
        mmq_reduce: f("mmq_reduce")?,
        attn_partial: [
            f("attn_partial_g1")?,
            f("attn_partial_g2")?,
            f("attn_partial_g4")?,
            f("attn_partial_g8")?,
        ],
        attn_partial_exact: by_width("attn_partial")?,
        attn_lanes: by_width("attn_lanes")?,
        attn_tile: by_width("attn_tile")?,
        attn_tile_rope: by_width("attn_tile_rope")?,
        attn_combine: f("attn_combine")?,
        attn_prefill_hd64: f("attn_prefill_hd64")?,
        attn_prefill_hd128: f("attn_prefill_hd128")?,
        attn_prefill_hd256: f("attn_prefill_hd256")?,
        sigmoid_mul: f("sigmoid_mul")?,
        gated_rms_norm: f("gated_rms_norm")?,
        causal_conv_silu: [
            f("causal_conv_silu_t2")?,
            f("causal_conv_silu_t3")?,
            f("causal_conv_silu_t4")?,
            f("causal_conv_silu_t5")?,
            f("causal_conv_silu_t6")?,
        ],
        gated_delta_rule: [
            f("gated_delta_rule_w1")?,
            f("gated_delta_rule_w2")?,
            f("gated_delta_rule_w4")?,
            f("gated_delta_rule_w8")?,
        ],
        gated_delta_rule_chunked: f("gated_delta_rule_chunked")?,
        moe_route: f("moe_route")?,
        moe_sort: f("moe_sort")?,
        moe_route_sort: f("moe_route_sort")?,
        moe_gemv_gate_up: f("moe_gemv_gate_up")?,
        moe_gemv_down: f("moe_gemv_down")?,
        moe_gemv_down_combine: f("moe_gemv_down_combine")?,
        moe_gemv_gate_up_bf16: [f("moe_gemv_gate_up_bf16_p1")?, f("moe_gemv_gate_up_bf16_p4")?],
        moe_gemv_down_bf16: [f("moe_gemv_down_bf16_p1")?, f("moe_gemv_down_bf16_p4")?],
        moe_gemv_down_combine_bf16: f("moe_gemv_down_combine_bf16")?,
        moe_gemm_gate_up: f("moe_gemm_gate_up")?,
        moe_gemm_down: f("moe_gemm_down")?,
        moe_combine: f("moe_combine")?,
        moe_q8: {
            let mut sets = Vec::with_capacity(MMVQ_FORMATS.len());
            for d in MMVQ_FORMATS {
                let stem = kernel_stem(d);
                let mv = |part: &str| MvKernel::new(f(&format!("moe_q8_{part}_{stem}"))?);
                sets.push([mv("gate_up")?, mv("down")?]);
            }
            sets.try_into().map_err(|_| BackendError::Other("moe_q8 kernel table".into()))?
        },
        sample_rows: f("sample_rows")?,
        sample_scan: f("sample_scan")?,
        sample_rows_sliced: f("sample_rows_sliced")?,
    };
    Ok((module, k))
}

/// A storage type as the kernels number it (kernels/dtypes.cu).
pub(super) fn dtype_code(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::Q8_0 => 2,
        DType::Q4_0 => 3,
        DType::Q4_1 => 4,
        DType::Q5_0 => 5,
        DType::Q5_1 => 6,
        DType::IQ4_NL => 7,
        DType::Q2_K => 8,
        DType::Q3_K => 9,
        DType::Q4_K => 10,
        DType::Q5_K => 11,
        DType::Q6_K => 12,
        DType::IQ4_XS => 13,
        DType::F16 => -1, // converted at upload, never on the device
    }
}

/// The block formats with a `gemv_bq_body` kernel set (kernels/gemv.cu), in
/// the order of `Kernels::gemv_blocks`: all but Q8_0, Q4_0 and Q4_1, the first
/// three of `DType::BLOCK_FORMATS`, which have per-row GEMVs of their own.
pub(super) const BLOCK_GEMVS: &[DType] = DType::BLOCK_FORMATS.split_at(3).1;

pub(super) fn block_gemv_index(d: DType) -> Option<usize> {
    BLOCK_GEMVS.iter().position(|t| *t == d)
}

/// Every block format with `mmq_*` kernels (kernels/mmq.cu), in the order of `Kernels::mmq`.
pub(super) const MMQ_FORMATS: [DType; 12] = DType::BLOCK_FORMATS;

pub(super) fn mmq_index(d: DType) -> Option<usize> {
    MMQ_FORMATS.iter().position(|t| *t == d)
}

/// The block formats with `mmvq_*` integer GEMVs (kernels/mmvq.cu), in the
/// order of `Kernels::mmvq`: every one.
pub(super) const MMVQ_FORMATS: [DType; 12] = DType::BLOCK_FORMATS;

pub(super) fn mmvq_index(d: DType) -> Option<usize> {
    MMVQ_FORMATS.iter().position(|t| *t == d)
}

/// A block format's name in kernel names (`gemv_q4_k_r1`, `mmq_q4_k_n8`): its lower-case type name.
fn kernel_stem(d: DType) -> String {
    d.to_string().to_lowercase()
}

/// One block per row with a thread per float4 of the row (kernels/elementwise.cu
/// `norm_row`), so a one-row norm has all of its loads in flight at once.
/// The widest row the norms hold in registers (kernels/elementwise.cu
/// `norm_row`: NORM_V4 float4s a thread, 1024 threads): only such rows can
/// also be stored quantized to 8 bits there.
pub(super) const NORM_REGISTER_COLS: usize = 4 * 4 * 1024;

pub(super) fn norm_dims(rows: usize, cols: usize) -> LaunchDims {
    let threads = cols.div_ceil(4).next_multiple_of(32).clamp(32, 1024);
    LaunchDims { grid: (rows as u32, 1, 1), block: threads as u32 }
}

pub(super) fn dims1(n: usize, block: u32) -> LaunchDims {
    LaunchDims { grid: ((n as u32).clamp(1, 65535 * 16), 1, 1), block }
}

pub(super) fn grid_for(n: usize, block: u32) -> LaunchDims {
    let blocks = n.div_ceil(block as usize).clamp(1, 65535 * 8);
    dims1(blocks, block)
}
