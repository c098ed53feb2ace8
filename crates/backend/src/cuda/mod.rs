//! The CUDA backend: the same operations as the CPU backend, on one GPU.
//!
//! - Activations are f32 device matrices (`CudaAct`), as the trait promises.
//! - Weights: matrices in bf16 (f16/f32 checkpoints converted at upload), the
//!   ggml block formats uploaded as they are; vectors (norms, biases) in f32.
//! - Matmuls: decode rows (up to `GEMV_MAX_ROWS`) go through GEMV kernels
//!   that read every weight byte once per step: a per-row kernel (16-byte
//!   loads, split-K across the warps of a block, one instantiation per
//!   power-of-two row count, for bf16 and each ggml block format) and a
//!   tensor-core kernel for 3..8 rows that splits the f32 activations into
//!   two bf16 parts and so stays exact. cuBLASLt (bf16 × bf16 → f32) takes
//!   prefill rows, and 3..8 rows on large bf16 matrices where it measured
//!   faster (`takes_gemv`); quantized weights are widened to bf16 a tile of
//!   rows at a time for it.
//! - KV: bf16, per layer `[pages, page_size, kv_heads, head_dim]` for K and V.
//!   Attention is causal per row and grouped-query. Sequences that bring at
//!   least `TILED_MIN_ROWS` rows to a step (prefill, also after a cached
//!   prefix) go through a tiled tensor-core kernel (64 query rows per block,
//!   K/V streamed through shared memory, online softmax); every other row
//!   (decode, short chunks, and everything inside a graph capture) through a
//!   split-K kernel over the context (flash-decoding) with a combine pass.
//! - Step metadata (token ids, positions, page tables, row maps) lives in
//!   device buffers sized at construction; each op compares its host
//!   arguments with what was last uploaded and copies only what changed, so
//!   `begin_step` makes every per-layer op upload nothing, and a captured
//!   step can be replayed after `begin_step` refreshed the buffers.
//!
//! Ops that return `()` record the first device error; `check` returns it.

pub mod check;
pub mod device;
pub mod gemm;
pub mod nccl;
pub mod nvrtc;
pub mod preflight;
pub mod vram_alloc;

use crate::dtype::{DType, HostTensor};
use crate::kv_units::KvAddressing;
use crate::{
    ActShape, Backend, BackendError, GraphKey, KvGeometry, MatmulPart, Result, RopeStyle, RopeTable, SeqStep,
    StepPlan,
};
use corridor_units::{Bytes, PageId};
use corridor_vram::KvArena;
use cudarc::driver::{result as cu, sys};
use device::{cuda_err, Args, Ctx, DeviceAlloc, DeviceBuffer, Kernel, LaunchDims, Purpose, Stream};
use gemm::{Gemm, GemmShape};
use half::{bf16, f16};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

pub use preflight::{preflight, Preflight};
pub use vram_alloc::VramAlloc;

/// Rows up to which matmuls use the GEMV kernels (kernels/gemv.cu GEMV_MAX_ROWS).
pub const GEMV_MAX_ROWS: usize = 8;
/// Warps per GEMV block (kernels/gemv.cu GEMV_WARPS).
const GEMV_WARPS: u32 = 4;
/// Weight rows per block of the bf16 GEMV (GEMV_NW) and of the block-format GEMV (GEMVQ_NW).
const GEMV_NW: usize = 4;
const GEMVQ_NW: usize = 2;
/// Output columns per block of the gate/up/SiLU GEMV (GLU_NW).
const GLU_NW: usize = 4;
/// Warps per block of the tensor-core GEMV (GEMVT_WARPS).
const GEMV_TC_WARPS: u32 = 8;
/// Weight rows below which the tensor-core GEMV leaves 3 and 4 input rows to the per-row kernel.
const GEMV_TC_MIN_N: usize = 2048;
/// A sequence with at least this many rows in a step is attended by the tiled
/// prefill kernel; below it the tile's tensor-core work is mostly padding.
pub const TILED_MIN_ROWS: usize = 16;
/// Query rows per block of the tiled prefill kernel (kernels/attention.cu FA_BM).
const TILE_ROWS: usize = 64;
/// Threads per block of the tiled prefill kernel (FA_WARPS warps).
const TILE_THREADS: u32 = 128;
/// Fewest tokens in one split of the split-K attention; each row's split
/// length is its context over the splits, at least this (kernels/attention.cu
/// `split_len`). 16 tokens is one batch of loads for each of a block's warps.
const ATT_MIN_SPLIT: usize = 16;
/// Steps with at least this many rows take the token-per-lane decode
/// attention (`attn_lanes_*`), whose splits hold at least a 32-token tile for
/// each of a block's four warps.
const ATT_LANES_MIN_ROWS: usize = 8;
const ATT_LANES_SPLIT: usize = 128;
/// Largest head dimension the attention kernel holds in registers.
pub const MAX_HEAD_DIM: usize = 256;
/// Bytes of the bf16 tile a quantized weight is widened into for prefill.
const DEQUANT_TILE: usize = 32 << 20;
/// Alignment of weights inside the weight arena (cuBLASLt wants 16, the
/// vector loads 16; 256 keeps every tensor on its own cache lines).
const ARENA_ALIGN: u64 = 256;

/// Sizes the backend allocates its step metadata for, once, at construction.
#[derive(Clone, Debug)]
pub struct CudaBackendConfig {
    /// CUDA device ordinal.
    pub ordinal: usize,
    /// Token rows of the largest step (grown by `alloc_act` when a workspace asks for more).
    pub max_rows: usize,
    /// Sequences in one step.
    pub max_seqs: usize,
    /// Page-table entries of one sequence.
    pub max_pages_per_seq: usize,
    /// (row, head, split) slots of the split-K attention scratch.
    pub attn_partials: usize,
    /// Where compiled kernels are cached (`$CORRIDOR_CACHE_DIR/kernels`); `None` compiles every time.
    pub kernel_cache_dir: Option<PathBuf>,
    /// How decode steps are launched.
    pub tuning: Tuning,
}

/// How decode steps are launched. Everything is on by default; each switch
/// exists so one binary can measure a step with and without it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// Programmatic dependent launch (sm_90 and later; ignored below): each
    /// kernel may start while the one ahead of it finishes, and waits for it
    /// on the device (`CORRIDOR_PDL=0` turns it off).
    pub pdl: bool,
    /// One launch for a layer's q/k/v GEMVs, for gate/up and SiLU, and for
    /// RoPE and the KV store, where the shapes allow (`CORRIDOR_FUSE=0`).
    pub fuse: bool,
    /// Decode attention with a token per lane for steps of `ATT_LANES_MIN_ROWS`
    /// rows and more (`CORRIDOR_ATTN_LANES=0` keeps the warp-per-token kernel).
    pub lane_attention: bool,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning { pdl: true, fuse: true, lane_attention: true }
    }
}

impl Tuning {
    /// The defaults with the environment's overrides.
    pub fn from_env() -> Tuning {
        let d = Tuning::default();
        let flag = |name: &str, default: bool| std::env::var(name).map(|v| v != "0").unwrap_or(default);
        Tuning {
            pdl: flag("CORRIDOR_PDL", d.pdl),
            fuse: flag("CORRIDOR_FUSE", d.fuse),
            lane_attention: flag("CORRIDOR_ATTN_LANES", d.lane_attention),
        }
    }
}

impl Default for CudaBackendConfig {
    fn default() -> Self {
        CudaBackendConfig {
            ordinal: 0,
            max_rows: 512,
            max_seqs: 256,
            max_pages_per_seq: 4096,
            attn_partials: 1 << 16,
            kernel_cache_dir: None,
            tuning: Tuning::from_env(),
        }
    }
}

struct Kernels {
    embedding: Kernel,
    rms_norm: Kernel,
    add_rms_norm: Kernel,
    head_rms_norm: Kernel,
    rope: Kernel,
    silu_mul: Kernel,
    add_assign: Kernel,
    add_bias: Kernel,
    gather_rows: Kernel,
    f32_to_bf16_rows: Kernel,
    dequant_rows: Kernel,
    write_kv: Kernel,
    rope_write_kv: Kernel,
    /// Indexed by log2 of the row-count instantiation (1, 2, 4, 8 rows).
    gemv_bf16: [Kernel; 4],
    /// gate/up/SiLU for 1 and 2 rows.
    gemv_bf16_glu: [Kernel; 2],
    gemv_q8_0: [Kernel; 4],
    gemv_q4_0: [Kernel; 4],
    gemv_q4_1: [Kernel; 4],
    /// The `gemv_bq_body` kernels, one set per entry of `BLOCK_GEMVS`.
    gemv_blocks: [[Kernel; 4]; 9],
    gemv_bf16_tc: Kernel,
    gemv_any: Kernel,
    /// Indexed by log2 of the query heads one block serves (1, 2, 4, 8).
    attn_partial: [Kernel; 4],
    /// The same for head_dim 64, 128 and 256 exactly (vector loads, tokens in flight).
    attn_partial_exact: [[Kernel; 4]; 3],
    /// The token-per-lane kernels, same indexing as `attn_partial_exact`.
    attn_lanes: [[Kernel; 4]; 3],
    attn_combine: Kernel,
    attn_prefill_hd64: Kernel,
    attn_prefill_hd128: Kernel,
}

/// Which kernel attends the rows of sequences that are prefilled in a step.
/// `Tiled` is what the backend uses; `SplitK` exists so the self-check and the
/// benchmark can run the general kernel on the same inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PrefillPath {
    Tiled,
    SplitK,
}

/// Where a weight's bytes live: its own allocation or a slice of the arena.
enum WeightMem {
    Own(DeviceBuffer),
    Arena { _arena: Arc<DeviceBuffer>, ptr: u64 },
}

/// A weight on the device: `[rows, cols]` in `dtype` (BF16, F32 for vectors, or a ggml block type).
pub struct CudaWeight {
    mem: WeightMem,
    dtype: DType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
}

impl CudaWeight {
    fn ptr(&self) -> u64 {
        match &self.mem {
            WeightMem::Own(b) => b.ptr(),
            WeightMem::Arena { ptr, .. } => *ptr,
        }
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
}

/// An activation matrix `[rows, cols]` f32 on the device.
pub struct CudaAct {
    buf: DeviceBuffer,
    rows: usize,
    cols: usize,
}

impl CudaAct {
    pub fn ptr(&self) -> u64 {
        self.buf.ptr()
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
}

/// Reads to the host of at least this many values go through page-locked staging.
const PINNED_READ_MIN: usize = 1 << 16;

/// What holds a KV store's bytes alive.
enum KvMem {
    /// Two buffers of its own (K and V), page after page.
    Own { _k: DeviceBuffer, _v: DeviceBuffer },
    /// Pages of the card's KV arena, every layer's K and V in each page.
    Arena(#[allow(dead_code)] Arc<KvArena>),
}

/// One layer's paged K and V in bf16: each page holds `[page_size, kv_heads,
/// head_dim]` of K at `k + offset(page)` and of V at `v + offset(page)`.
pub struct CudaKv {
    geometry: KvGeometry,
    _mem: KvMem,
    k: u64,
    v: u64,
    addr: KvAddressing,
}

impl CudaKv {
    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }
    /// Bytes of K (or V) one page holds for this layer.
    fn page_bytes(&self) -> usize {
        let g = self.geometry;
        g.page_size * g.kv_heads * g.head_dim * 2
    }
}

/// A bump allocator over one device allocation for all weights.
struct Arena {
    buf: Arc<DeviceBuffer>,
    used: u64,
}

/// One u32 metadata array: its device buffer and the host copy last uploaded.
struct Meta {
    dev: DeviceBuffer,
    cap: usize,
    host: Vec<u32>,
    valid: bool,
}

/// The step's per-row and per-sequence maps, built on the host.
#[derive(Default, PartialEq)]
struct SeqMaps {
    row_pos: Vec<u32>,
    row_seq: Vec<u32>,
    seq_pt_off: Vec<u32>,
    page_table: Vec<u32>,
    /// Rows the maps cover (one past the last row of any sequence).
    rows: usize,
    /// Longest context of any row.
    max_ctx: usize,
    /// (first row, rows) of every tile of the tiled prefill kernel.
    tiles: Vec<u32>,
    /// `row_seq` with the tiled rows masked out: what the split-K kernel attends beside the tiles.
    rest_seq: Vec<u32>,
    /// Longest context of any row in `rest_seq`; 0 when there is none.
    rest_max_ctx: usize,
}

/// The operands of one attention call, shared by its kernels.
struct AttnLaunch<'a> {
    q: &'a CudaAct,
    kv: &'a CudaKv,
    heads: usize,
    /// Device pointer of the output activation.
    out: u64,
}

struct Captured {
    exec: sys::CUgraphExec,
    graph: sys::CUgraph,
}

struct State {
    gemm: Gemm,
    error: Option<BackendError>,
    tokens: Meta,
    positions: Meta,
    gather: Meta,
    row_pos: Meta,
    row_seq: Meta,
    seq_pt_off: Meta,
    page_table: Meta,
    tiles: Meta,
    rest_seq: Meta,
    prefill: PrefillPath,
    maps: SeqMaps,
    maps_scratch: SeqMaps,
    inv_freq: DeviceBuffer,
    inv_freq_host: Vec<f32>,
    /// f32 → bf16 copy of a matmul's input rows.
    xbf: Option<DeviceBuffer>,
    /// bf16 tile of a quantized weight, widened for a prefill GEMM.
    tile: Option<DeviceBuffer>,
    part_o: DeviceBuffer,
    part_ml: DeviceBuffer,
    arena: Option<Arena>,
    capturing: Option<GraphKey>,
    graphs: HashMap<GraphKey, Captured>,
    /// How page ids translate into the page table's entries: the addressing
    /// of the KV store the last op used (every layer of a model shares one).
    kv_addr: KvAddressing,
    /// Page-locked staging for large reads to the host (logits of a big batch).
    pinned: Option<corridor_vram::cuda::PinnedHost>,
    /// Token rows of the step `begin_step` announced: kernels over rows
    /// cover at least these, so a captured step covers every row it may be
    /// replayed with (rows of no sequence are skipped on the device).
    step_rows: usize,
}

// SAFETY: the raw graph handles inside are only used under the backend's mutex.
unsafe impl Send for State {}

/// The CUDA backend for one device.
pub struct CudaBackend {
    name: String,
    ctx: Ctx,
    stream: Stream,
    module: sys::CUmodule,
    k: Kernels,
    alloc: Arc<dyn DeviceAlloc>,
    sm_count: usize,
    arch: String,
    config: CudaBackendConfig,
    /// Kernels are launched with programmatic dependent launch (`Tuning::pdl` on sm_90+).
    pdl: bool,
    state: Mutex<State>,
    /// Per-op timing when `CORRIDOR_CUDA_PROFILE=N` is set (a report every N steps).
    profile: Option<Mutex<OpProfile>>,
}

/// Where a step's device time goes, op by op: with profiling on, steps run
/// without graphs, every op is waited for, and its time is the device's
/// between two events recorded around it (the host's launch and wait are not
/// in it; the kernel's start on an idle device is).
struct OpProfile {
    every: u64,
    steps: u64,
    rows: usize,
    totals: HashMap<String, (std::time::Duration, u64)>,
    /// Recorded around each op on the stream: its device time, without the
    /// host's launch and wait.
    events: Option<(sys::CUevent, sys::CUevent)>,
}

impl OpProfile {
    fn add(&mut self, name: &str, d: std::time::Duration) {
        let e = self.totals.entry(name.to_string()).or_default();
        e.0 += d;
        e.1 += 1;
    }

    /// Count a step; every `every` steps log the table and start again.
    fn step(&mut self, rows: usize) {
        self.steps += 1;
        self.rows = rows;
        if self.steps < self.every {
            return;
        }
        let mut by_time: Vec<_> = self.totals.iter().collect();
        by_time.sort_by_key(|r| std::cmp::Reverse(r.1 .0));
        let total: f64 = by_time.iter().map(|r| r.1 .0.as_secs_f64()).sum();
        let mut table = String::new();
        for (name, (d, n)) in by_time {
            let ms = d.as_secs_f64() * 1e3 / self.steps as f64;
            table.push_str(&format!(
                "\n  {ms:8.3} ms/step {:5.1}%  {:6} calls/step  {:8.1} us/call  {name}",
                100.0 * d.as_secs_f64() / total.max(1e-12),
                n / self.steps,
                d.as_secs_f64() * 1e6 / *n as f64
            ));
        }
        tracing::info!(
            "CUDA op profile over {} steps (last step {} rows), {:.3} ms/step in ops:{table}",
            self.steps,
            self.rows,
            total * 1e3 / self.steps as f64
        );
        self.steps = 0;
        self.totals.clear();
    }
}

// SAFETY: the module handle is immutable once loaded; everything mutable is behind `state`.
unsafe impl Send for CudaBackend {}
unsafe impl Sync for CudaBackend {}

fn dtype_code(d: DType) -> i32 {
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
/// the order of `Kernels::gemv_blocks`, with their kernel name stems.
const BLOCK_GEMVS: [(DType, &str); 9] = [
    (DType::Q5_0, "q5_0"),
    (DType::Q5_1, "q5_1"),
    (DType::IQ4_NL, "iq4_nl"),
    (DType::Q2_K, "q2_k"),
    (DType::Q3_K, "q3_k"),
    (DType::Q4_K, "q4_k"),
    (DType::Q5_K, "q5_k"),
    (DType::Q6_K, "q6_k"),
    (DType::IQ4_XS, "iq4_xs"),
];

fn block_gemv_index(d: DType) -> Option<usize> {
    BLOCK_GEMVS.iter().position(|(t, _)| *t == d)
}

/// Head sizes the attention kernels hold in registers.
fn check_kv_geometry(g: &KvGeometry) -> Result<()> {
    if g.head_dim > MAX_HEAD_DIM || g.head_dim == 0 || g.kv_heads == 0 || g.page_size == 0 {
        return Err(BackendError::Other(format!(
            "head_dim {} (at most {MAX_HEAD_DIM}), kv_heads {}, page size {}",
            g.head_dim, g.kv_heads, g.page_size
        )));
    }
    Ok(())
}

/// One block per row with a thread per float4 of the row (kernels/elementwise.cu
/// `norm_row`), so a one-row norm has all of its loads in flight at once.
fn norm_dims(rows: usize, cols: usize) -> LaunchDims {
    let threads = cols.div_ceil(4).next_multiple_of(32).clamp(32, 1024);
    LaunchDims { grid: (rows as u32, 1, 1), block: threads as u32 }
}

fn dims1(n: usize, block: u32) -> LaunchDims {
    LaunchDims { grid: ((n as u32).clamp(1, 65535 * 16), 1, 1), block }
}

fn grid_for(n: usize, block: u32) -> LaunchDims {
    let blocks = n.div_ceil(block as usize).clamp(1, 65535 * 8);
    dims1(blocks, block)
}

impl CudaBackend {
    /// Open device `config.ordinal` as a card of its own: a standalone
    /// chokepoint (corridor_vram, default limits) books every allocation.
    pub fn new(config: CudaBackendConfig) -> Result<CudaBackend> {
        let alloc = VramAlloc::open_standalone(config.ordinal)?;
        Self::with_alloc(config, Arc::new(alloc))
    }

    /// Open device `config.ordinal` with every allocation reserved through
    /// `device`, the chokepoint of that same card (checked by UUID).
    pub fn on_device(config: CudaBackendConfig, device: corridor_vram::Device) -> Result<CudaBackend> {
        let alloc = VramAlloc::new(device);
        alloc.check_card(config.ordinal)?;
        Self::with_alloc(config, Arc::new(alloc))
    }

    /// Open a device with every allocation routed through `alloc`.
    pub fn with_alloc(config: CudaBackendConfig, alloc: Arc<dyn DeviceAlloc>) -> Result<CudaBackend> {
        preflight::preflight()?;
        cu::init().map_err(|e| cuda_err("cuInit", e))?;
        let dev = cu::device::get(config.ordinal as i32).map_err(|e| cuda_err("cuDeviceGet", e))?;
        // SAFETY: a valid device from cuDeviceGet; the primary context is retained for the process.
        let ctx =
            Ctx(unsafe { cu::primary_ctx::retain(dev) }
                .map_err(|e| cuda_err("cuDevicePrimaryCtxRetain", e))?);
        ctx.bind()?;
        let attr =
            |a| unsafe { cu::device::get_attribute(dev, a) }.map_err(|e| cuda_err("cuDeviceGetAttribute", e));
        let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let sm_count = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize;
        let arch = format!("sm_{major}{minor}");
        let dev_name = cu::device::get_name(dev).unwrap_or_else(|_| "unknown".into());
        let stream = Stream(
            cu::stream::create(cu::stream::StreamKind::NonBlocking)
                .map_err(|e| cuda_err("cuStreamCreate", e))?,
        );
        let source: String = nvrtc::SOURCES.concat();
        let compiled = nvrtc::compile_cubin(&source, &arch, config.kernel_cache_dir.as_deref())?;
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
            add_assign: f("add_assign")?,
            add_bias: f("add_bias")?,
            gather_rows: f("gather_rows")?,
            f32_to_bf16_rows: f("f32_to_bf16_rows")?,
            dequant_rows: f("dequant_rows")?,
            write_kv: f("write_kv")?,
            rope_write_kv: f("rope_write_kv")?,
            gemv_bf16: [f("gemv_bf16_r1")?, f("gemv_bf16_r2")?, f("gemv_bf16_r4")?, f("gemv_bf16_r8")?],
            gemv_bf16_glu: [f("gemv_bf16_glu_r1")?, f("gemv_bf16_glu_r2")?],
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
                for (_, stem) in BLOCK_GEMVS {
                    sets.push(set(stem)?);
                }
                sets.try_into().map_err(|_| BackendError::Other("block GEMV kernel table".into()))?
            },
            gemv_bf16_tc: f("gemv_bf16_tc")?,
            gemv_any: f("gemv_any")?,
            attn_partial: [
                f("attn_partial_g1")?,
                f("attn_partial_g2")?,
                f("attn_partial_g4")?,
                f("attn_partial_g8")?,
            ],
            attn_partial_exact: by_width("attn_partial")?,
            attn_lanes: by_width("attn_lanes")?,
            attn_combine: f("attn_combine")?,
            attn_prefill_hd64: f("attn_prefill_hd64")?,
            attn_prefill_hd128: f("attn_prefill_hd128")?,
        };
        let meta = |n: usize| -> Result<Meta> {
            let dev = DeviceBuffer::new(&alloc, ctx, Bytes((n.max(1) * 4) as u64), Purpose::Workspace)?;
            Ok(Meta { dev, cap: n.max(1), host: Vec::new(), valid: false })
        };
        let rows = config.max_rows.max(1);
        let parts = config.attn_partials.max(1);
        let state = State {
            gemm: Gemm::new(&alloc, ctx)?,
            error: None,
            tokens: meta(rows)?,
            positions: meta(rows)?,
            gather: meta(rows)?,
            row_pos: meta(rows)?,
            row_seq: meta(rows)?,
            seq_pt_off: meta(config.max_seqs)?,
            page_table: meta(config.max_seqs * config.max_pages_per_seq)?,
            // A tile holds at least TILED_MIN_ROWS rows, so two entries per tile fit in one per row.
            tiles: meta(rows)?,
            rest_seq: meta(rows)?,
            prefill: PrefillPath::Tiled,
            maps: SeqMaps::default(),
            maps_scratch: SeqMaps::default(),
            inv_freq: DeviceBuffer::new(
                &alloc,
                ctx,
                Bytes((MAX_HEAD_DIM / 2 * 4) as u64),
                Purpose::Workspace,
            )?,
            inv_freq_host: Vec::new(),
            xbf: None,
            tile: None,
            part_o: DeviceBuffer::new(
                &alloc,
                ctx,
                Bytes((parts * MAX_HEAD_DIM * 4) as u64),
                Purpose::Workspace,
            )?,
            part_ml: DeviceBuffer::new(&alloc, ctx, Bytes((parts * 2 * 4) as u64), Purpose::Workspace)?,
            arena: None,
            capturing: None,
            graphs: HashMap::new(),
            kv_addr: KvAddressing::IDENTITY,
            step_rows: 0,
            pinned: None,
        };
        let name = format!("cuda:{} ({dev_name}, {arch}, {sm_count} SMs)", config.ordinal);
        Ok(CudaBackend {
            name,
            ctx,
            stream,
            module,
            k,
            alloc,
            sm_count,
            arch,
            pdl: config.tuning.pdl && major >= 9,
            config,
            state: Mutex::new(state),
            profile: std::env::var("CORRIDOR_CUDA_PROFILE").ok().and_then(|v| v.parse().ok()).map(
                |every: u64| {
                    Mutex::new(OpProfile {
                        every: every.max(1),
                        steps: 0,
                        rows: 0,
                        totals: HashMap::new(),
                        events: None,
                    })
                },
            ),
        })
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Wait for every enqueued operation.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: our stream.
        unsafe { cu::stream::synchronize(self.stream.0) }.map_err(|e| cuda_err("cuStreamSynchronize", e))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock means a panic mid-op; the state is still consistent
        // enough to report errors, so keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn record(&self, st: &mut State, r: Result<()>) {
        if let Err(e) = r {
            st.error.get_or_insert(e);
        }
    }

    /// Run `f` with the context bound and the state locked, recording its
    /// error; under `CORRIDOR_CUDA_PROFILE` also wait for it and count its time.
    /// The name is only formatted when profiling.
    fn op(&self, name: impl std::fmt::Display, f: impl FnOnce(&mut State) -> Result<()>) {
        let mut st = self.lock();
        let Some(profile) = &self.profile else {
            let r = self.ctx.bind().and_then(|_| f(&mut st));
            self.record(&mut st, r);
            return;
        };
        let r = self.ctx.bind().and_then(|_| self.profiled(profile, &name.to_string(), || f(&mut st)));
        self.record(&mut st, r);
    }

    /// Run `f` between two events on the stream, wait, and count the
    /// device time between them under `name`.
    fn profiled(&self, profile: &Mutex<OpProfile>, name: &str, f: impl FnOnce() -> Result<()>) -> Result<()> {
        let mut p = profile.lock().unwrap_or_else(|e| e.into_inner());
        if p.events.is_none() {
            let ev = || {
                cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                    .map_err(|e| cuda_err("cuEventCreate", e))
            };
            p.events = Some((ev()?, ev()?));
        }
        let (a, b) = p.events.expect("created above");
        // SAFETY: events of this context, recorded on our stream.
        unsafe { cu::event::record(a, self.stream.0) }.map_err(|e| cuda_err("cuEventRecord", e))?;
        f()?;
        unsafe { cu::event::record(b, self.stream.0) }.map_err(|e| cuda_err("cuEventRecord", e))?;
        self.synchronize()?;
        let ms = unsafe { cu::event::elapsed(a, b) }.map_err(|e| cuda_err("cuEventElapsedTime", e))?;
        p.add(name, std::time::Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3));
        Ok(())
    }

    /// Enqueue a library call (a collective) on this backend's stream with
    /// the context bound; an error is recorded like a kernel's and surfaces
    /// at `check`.
    pub(crate) fn enqueue_library(
        &self,
        name: impl std::fmt::Display,
        f: impl FnOnce(sys::CUstream) -> Result<()>,
    ) {
        self.op(name, |_| f(self.stream.0))
    }

    unsafe fn launch(&self, k: Kernel, dims: LaunchDims, args: Args) -> Result<()> {
        let mut args = args;
        k.launch(self.stream, dims, &mut args, self.pdl)
    }

    fn upload<T: Copy>(&self, dst: u64, src: &[T]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` has room for `src` (checked by the callers against capacities);
        // from pageable memory the call returns once the source was staged.
        unsafe { cu::memcpy_htod_async(dst, src, self.stream.0) }
            .map_err(|e| cuda_err("cuMemcpyHtoDAsync", e))
    }

    /// Make `meta` hold `data`, uploading only when it differs from the last upload.
    fn sync_meta(&self, meta: &mut Meta, data: &[u32], what: &'static str, capturing: bool) -> Result<()> {
        if meta.valid && meta.host == data {
            return Ok(());
        }
        if data.len() > meta.cap {
            return Err(BackendError::Other(format!(
                "{what}: {} entries, the backend was sized for {}",
                data.len(),
                meta.cap
            )));
        }
        if capturing {
            return Err(BackendError::Other(format!(
                "{what} changed during graph capture: call begin_step first"
            )));
        }
        self.upload(meta.dev.ptr(), data)?;
        meta.host.clear();
        meta.host.extend_from_slice(data);
        meta.valid = true;
        Ok(())
    }

    fn sync_seqs(&self, st: &mut State, seqs: &[SeqStep<'_>]) -> Result<()> {
        let mut m = std::mem::take(&mut st.maps_scratch);
        m.rows = seqs.iter().map(|s| s.row_start + s.rows).max().unwrap_or(0).max(st.step_rows);
        m.row_pos.clear();
        m.row_pos.resize(m.rows, 0);
        m.row_seq.clear();
        m.row_seq.resize(m.rows, u32::MAX);
        m.seq_pt_off.clear();
        m.page_table.clear();
        m.max_ctx = 0;
        m.tiles.clear();
        m.rest_seq.clear();
        m.rest_seq.resize(m.rows, u32::MAX);
        m.rest_max_ctx = 0;
        for (si, s) in seqs.iter().enumerate() {
            m.seq_pt_off.push(m.page_table.len() as u32);
            if s.pages.len() > self.config.max_pages_per_seq {
                st.maps_scratch = m;
                return Err(BackendError::Other(format!(
                    "a sequence has {} pages, the backend was sized for {}",
                    s.pages.len(),
                    self.config.max_pages_per_seq
                )));
            }
            m.page_table.extend(s.pages.iter().map(|&p| st.kv_addr.unit(p) as u32));
            for i in 0..s.rows {
                m.row_pos[s.row_start + i] = (s.cached + i) as u32;
                m.row_seq[s.row_start + i] = si as u32;
            }
            m.max_ctx = m.max_ctx.max(s.context_len());
            if s.rows >= TILED_MIN_ROWS {
                for t0 in (0..s.rows).step_by(TILE_ROWS) {
                    m.tiles.push((s.row_start + t0) as u32);
                    m.tiles.push(TILE_ROWS.min(s.rows - t0) as u32);
                }
            } else if s.rows > 0 {
                m.rest_seq[s.row_start..s.row_start + s.rows].fill(si as u32);
                m.rest_max_ctx = m.rest_max_ctx.max(s.context_len());
            }
        }
        if m == st.maps && st.row_pos.valid {
            st.maps_scratch = m;
            return Ok(());
        }
        let cap = st.capturing.is_some();
        let r = (|| {
            self.sync_meta(&mut st.row_pos, &m.row_pos, "rows", cap)?;
            self.sync_meta(&mut st.row_seq, &m.row_seq, "rows", cap)?;
            self.sync_meta(&mut st.seq_pt_off, &m.seq_pt_off, "sequences", cap)?;
            self.sync_meta(&mut st.page_table, &m.page_table, "page-table entries", cap)?;
            self.sync_meta(&mut st.tiles, &m.tiles, "prefill tiles", cap)?;
            self.sync_meta(&mut st.rest_seq, &m.rest_seq, "rows", cap)
        })();
        st.maps_scratch = std::mem::replace(&mut st.maps, m);
        r
    }

    fn sync_rope(&self, st: &mut State, table: &RopeTable) -> Result<()> {
        if st.inv_freq_host == table.inv_freq {
            return Ok(());
        }
        if table.inv_freq.len() > MAX_HEAD_DIM / 2 {
            return Err(BackendError::Other(format!(
                "{} rotary frequencies, at most {}",
                table.inv_freq.len(),
                MAX_HEAD_DIM / 2
            )));
        }
        if st.capturing.is_some() {
            return Err(BackendError::Other("rotary table changed during graph capture".into()));
        }
        self.upload(st.inv_freq.ptr(), &table.inv_freq)?;
        st.inv_freq_host = table.inv_freq.clone();
        Ok(())
    }

    /// A new KV store: page tables translate through its addressing from now
    /// on, and captured steps (which point at the old store) are dropped.
    fn adopt_kv_addressing(&self, addr: KvAddressing) -> Result<()> {
        self.synchronize()?;
        let mut st = self.lock();
        drop_graphs(&mut st);
        st.kv_addr = addr;
        Ok(())
    }

    fn alloc_buf(&self, bytes: usize, purpose: Purpose) -> Result<DeviceBuffer> {
        DeviceBuffer::new(&self.alloc, self.ctx, Bytes(bytes as u64), purpose)
    }

    /// Grow a scratch buffer to `bytes` (only at allocation time, never in a forward pass).
    fn ensure_scratch(&self, slot: &mut Option<DeviceBuffer>, bytes: usize) -> Result<()> {
        if slot.as_ref().is_none_or(|b| (b.bytes().0 as usize) < bytes) {
            *slot = None;
            *slot = Some(self.alloc_buf(bytes, Purpose::Workspace)?);
        }
        Ok(())
    }

    fn place_weight(&self, bytes: &[u8]) -> Result<WeightMem> {
        let mut st = self.lock();
        let len = bytes.len() as u64;
        let mem = match &mut st.arena {
            Some(a) if a.used.div_ceil(ARENA_ALIGN) * ARENA_ALIGN + len <= a.buf.bytes().0 => {
                let off = a.used.div_ceil(ARENA_ALIGN) * ARENA_ALIGN;
                a.used = off + len;
                WeightMem::Arena { _arena: a.buf.clone(), ptr: a.buf.ptr() + off }
            }
            _ => WeightMem::Own(self.alloc_buf(bytes.len(), Purpose::Weights)?),
        };
        let ptr = match &mem {
            WeightMem::Own(b) => b.ptr(),
            WeightMem::Arena { ptr, .. } => *ptr,
        };
        self.upload(ptr, bytes)?;
        self.synchronize()?;
        Ok(mem)
    }

    /// `out = x · wᵀ` without bias, for `rows` rows.
    fn matmul_inner(
        &self,
        st: &mut State,
        x: &CudaAct,
        w: &CudaWeight,
        rows: usize,
        out: &CudaAct,
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        if self.takes_gemv(w, rows) {
            return self.gemv(x, w, rows, out);
        }
        self.matmul_lt(st, x, w, rows, out)
    }

    /// Whether `rows` rows against `w` go through a GEMV kernel (f32
    /// activations, exact) rather than cuBLASLt (activations rounded to bf16).
    ///
    /// Picked per shape from measurements on the H200 (graph replays, weights
    /// larger than L2; scripts/gpu/PERF.md has the table): the per-row GEMV
    /// wins at 1 and 2 rows on every Llama-3-8B shape (83-104% of the copy
    /// bandwidth on the large ones). From 3 rows on, cuBLASLt's tensor cores
    /// lead on large matrices (MLP, lm_head: 80-97% against 60-86% for the
    /// tensor-core GEMV), while on the attention projections the tensor-core
    /// GEMV is as fast and stays exact. Block-format weights always take a
    /// GEMV: cuBLASLt would first widen them to bf16.
    fn takes_gemv(&self, w: &CudaWeight, rows: usize) -> bool {
        const LARGE_WEIGHT: usize = 64 << 20;
        let large_bf16 = w.dtype == DType::BF16 && w.rows * w.cols * 2 >= LARGE_WEIGHT;
        match rows {
            0..=2 => true,
            3..=GEMV_MAX_ROWS => !large_bf16,
            _ => false,
        }
    }

    /// Whether the tensor-core GEMV takes `rows` rows against `w` (bf16, k a
    /// multiple of 32). At 1 and 2 rows the per-row kernel is faster; at 3 and
    /// 4 rows it still is on narrow matrices (1024 rows: the tensor-core
    /// kernel's 16-row blocks are too few to fill the card).
    fn takes_gemv_tc(&self, w: &CudaWeight, rows: usize) -> bool {
        let shape_ok = w.dtype == DType::BF16 && w.cols.is_multiple_of(32);
        shape_ok && (3..=GEMV_MAX_ROWS).contains(&rows) && (rows > 4 || w.rows >= GEMV_TC_MIN_N)
    }

    /// The tensor-core GEMV (kernels/gemv.cu `gemv_bf16_tc`): 16 weight rows per block.
    fn gemv_tc(&self, x: &CudaAct, w: &CudaWeight, rows: usize, out: &CudaAct) -> Result<()> {
        let (n, k) = (w.rows, w.cols);
        let dims = LaunchDims { grid: (n.div_ceil(16) as u32, 1, 1), block: 32 * GEMV_TC_WARPS };
        let a =
            Args::new().ptr(w.ptr()).ptr(x.ptr()).ptr(out.ptr()).i32(n as i32).i32(k as i32).i32(rows as i32);
        unsafe { self.launch(self.k.gemv_bf16_tc, dims, a) }
    }

    /// Decode rows (at most `GEMV_MAX_ROWS`): the GEMV kernels read each weight byte once.
    fn gemv(&self, x: &CudaAct, w: &CudaWeight, rows: usize, out: &CudaAct) -> Result<()> {
        if self.takes_gemv_tc(w, rows) {
            return self.gemv_tc(x, w, rows, out);
        }
        self.gemv_simt(x, w, rows, out)
    }

    /// The per-row GEMV kernels: f32 FMAs, for every storage type.
    fn gemv_simt(&self, x: &CudaAct, w: &CudaWeight, rows: usize, out: &CudaAct) -> Result<()> {
        let (n, k) = (w.rows, w.cols);
        // The instantiation for the smallest power of two >= rows (1, 2, 4, 8).
        // bf16 with 16-byte loads: rows of whole 8-element chunks (the arena keeps 256-byte alignment).
        if w.dtype == DType::BF16 && k % 8 == 0 {
            return self.gemv_bf16_parts(x, &[(w, 0, out.ptr())], rows);
        }
        let inst = rows.next_power_of_two().trailing_zeros() as usize;
        let block_format = match w.dtype {
            DType::Q8_0 => Some(self.k.gemv_q8_0[inst]),
            DType::Q4_0 => Some(self.k.gemv_q4_0[inst]),
            DType::Q4_1 => Some(self.k.gemv_q4_1[inst]),
            d => match block_gemv_index(d) {
                // One warp per weight row (gemv_bq_body).
                Some(i) => {
                    let kernel = self.k.gemv_blocks[i][inst];
                    let dims = LaunchDims {
                        grid: (n.div_ceil(GEMV_WARPS as usize) as u32, 1, 1),
                        block: 32 * GEMV_WARPS,
                    };
                    let a = Args::new().ptr(w.ptr()).i64(w.row_bytes as i64).ptr(x.ptr()).ptr(out.ptr());
                    let a = a.i32(n as i32).i32(k as i32).i32(rows as i32);
                    return unsafe { self.launch(kernel, dims, a) };
                }
                None => None,
            },
        };
        match block_format {
            Some(kernel) => {
                let dims = LaunchDims { grid: (n.div_ceil(GEMVQ_NW) as u32, 1, 1), block: 32 * GEMV_WARPS };
                let a = Args::new().ptr(w.ptr()).i64(w.row_bytes as i64).ptr(x.ptr()).ptr(out.ptr());
                let a = a.i32(n as i32).i32(k as i32).i32(rows as i32);
                unsafe { self.launch(kernel, dims, a) }
            }
            None => self.gemv_general(x, w, rows, out),
        }
    }

    /// Up to three bf16 matrices of one input in one launch of the per-row
    /// kernel (`gemv_bf16_r*`): each part is (weight, bias pointer or 0,
    /// output pointer). The weights share `x`'s width, a multiple of 8.
    fn gemv_bf16_parts(&self, x: &CudaAct, parts: &[(&CudaWeight, u64, u64)], rows: usize) -> Result<()> {
        debug_assert!((1..=3).contains(&parts.len()) && (1..=GEMV_MAX_ROWS).contains(&rows));
        let inst = rows.next_power_of_two().trailing_zeros() as usize;
        let (mut w, mut o, mut b, mut n) = ([0u64; 3], [0u64; 3], [0u64; 3], [0usize; 3]);
        for (i, (wt, bias, out)) in parts.iter().enumerate() {
            (w[i], b[i], o[i], n[i]) = (wt.ptr(), *bias, *out, wt.rows);
        }
        let blocks: usize = n.iter().map(|n| n.div_ceil(GEMV_NW)).sum();
        let dims = LaunchDims { grid: (blocks as u32, 1, 1), block: 32 * GEMV_WARPS };
        let mut a = Args::new();
        for p in w.iter().chain(&o).chain(&b) {
            a = a.ptr(*p);
        }
        for n in n {
            a = a.i32(n as i32);
        }
        let a = a.ptr(x.ptr()).i32(x.cols as i32).i32(rows as i32);
        unsafe { self.launch(self.k.gemv_bf16[inst], dims, a) }
    }

    /// Whether `rows` rows against bf16 `w` take the per-row kernel, the one
    /// the fused launches extend (1 and 2 rows, 16-byte rows).
    fn fusable_gemv(&self, x: &CudaAct, w: &CudaWeight, rows: usize) -> bool {
        self.config.tuning.fuse
            && (1..=2).contains(&rows)
            && w.dtype == DType::BF16
            && w.cols == x.cols
            && w.cols.is_multiple_of(8)
            && self.takes_gemv(w, rows)
            && !self.takes_gemv_tc(w, rows)
    }

    /// The per-element GEMV for any storage type and width (f32 weights, bf16
    /// rows that are not whole 16-byte chunks).
    fn gemv_general(&self, x: &CudaAct, w: &CudaWeight, rows: usize, out: &CudaAct) -> Result<()> {
        let (n, k) = (w.rows, w.cols);
        let warps_per_block = 4usize;
        let dims = LaunchDims {
            grid: (n.div_ceil(warps_per_block) as u32, 1, 1),
            block: 32 * warps_per_block as u32,
        };
        let a = Args::new()
            .ptr(w.ptr())
            .i32(dtype_code(w.dtype))
            .i64(w.row_bytes as i64)
            .ptr(x.ptr())
            .ptr(out.ptr())
            .i32(n as i32)
            .i32(k as i32)
            .i32(rows as i32);
        unsafe { self.launch(self.k.gemv_any, dims, a) }
    }

    /// Prefill rows: a bf16 copy of the input rows, then cuBLASLt (quantized
    /// weights widened to bf16 a tile of rows at a time).
    fn matmul_lt(
        &self,
        st: &mut State,
        x: &CudaAct,
        w: &CudaWeight,
        rows: usize,
        out: &CudaAct,
    ) -> Result<()> {
        let (n, k) = (w.rows, w.cols);
        let xbf = st.xbf.as_ref().filter(|b| b.bytes().0 as usize >= rows * k * 2).ok_or_else(|| {
            BackendError::Other(format!(
                "matmul of {rows}x{k}: scratch not sized (allocate activations first)"
            ))
        })?;
        let xbf_ptr = xbf.ptr();
        let total = rows * k;
        let a = Args::new().ptr(x.ptr()).ptr(xbf_ptr).i64(total as i64);
        unsafe { self.launch(self.k.f32_to_bf16_rows, grid_for(total, 256), a)? };
        if w.dtype == DType::BF16 {
            let s = GemmShape { m: rows, n, k, ldc: n };
            return st.gemm.matmul(self.stream, s, xbf_ptr, w.ptr(), out.ptr());
        }
        let tile = st
            .tile
            .as_ref()
            .ok_or_else(|| BackendError::Other("dequantization tile not allocated".into()))?;
        let (tile_ptr, tile_rows) = (tile.ptr(), (tile.bytes().0 as usize / (k * 2)).max(1));
        let mut j0 = 0;
        while j0 < n {
            let nb = tile_rows.min(n - j0);
            let a = Args::new()
                .ptr(w.ptr())
                .i32(dtype_code(w.dtype))
                .i64(w.row_bytes as i64)
                .ptr(tile_ptr)
                .i32(j0 as i32)
                .i32(k as i32);
            unsafe {
                self.launch(self.k.dequant_rows, LaunchDims { grid: (nb as u32, 1, 1), block: 256 }, a)?
            };
            let s = GemmShape { m: rows, n: nb, k, ldc: n };
            st.gemm.matmul(self.stream, s, xbf_ptr, tile_ptr, out.ptr() + (j0 * 4) as u64)?;
            j0 += nb;
        }
        Ok(())
    }

    /// Split-K attention (flash-decoding) for the rows whose sequence index in
    /// `row_seq` is not u32::MAX, over contexts of at most `max_ctx` tokens.
    fn attn_split(&self, st: &State, a: &AttnLaunch<'_>, row_seq: u64, max_ctx: usize) -> Result<()> {
        let g = a.kv.geometry;
        let rows = st.maps.rows;
        // Query heads per block: the largest of 8, 4, 2, 1 that divides the
        // GQA group, so a block reads each K/V row once for all of them.
        let group = a.heads / g.kv_heads;
        let per_block = [8usize, 4, 2, 1].into_iter().find(|p| group.is_multiple_of(*p)).unwrap_or(1);
        let g_idx = per_block.trailing_zeros() as usize;
        let exact = match g.head_dim {
            64 => Some(0),
            128 => Some(1),
            256 => Some(2),
            _ => None,
        };
        let lanes = self.config.tuning.lane_attention && rows >= ATT_LANES_MIN_ROWS && exact.is_some();
        let min_split = if lanes { ATT_LANES_SPLIT } else { ATT_MIN_SPLIT };
        let nsplit = self.splits(rows, a.heads, per_block, max_ctx, min_split);
        let scale = 1.0 / (g.head_dim as f32).sqrt();
        let args = Args::new()
            .ptr(a.q.ptr())
            .ptr(a.kv.k)
            .ptr(a.kv.v)
            .ptr(st.row_pos.dev.ptr())
            .ptr(row_seq)
            .ptr(st.seq_pt_off.dev.ptr())
            .ptr(st.page_table.dev.ptr())
            .ptr(a.out)
            .ptr(st.part_o.ptr())
            .ptr(st.part_ml.ptr())
            .i32(a.heads as i32)
            .i32(g.kv_heads as i32)
            .i32(g.head_dim as i32)
            .i32(g.page_size as i32)
            .f32(scale)
            .i32(min_split as i32)
            .i32(nsplit as i32);
        let dims =
            LaunchDims { grid: (nsplit as u32, (a.heads / per_block) as u32, rows as u32), block: 128 };
        let kernel = match exact {
            Some(d) if lanes => self.k.attn_lanes[d][g_idx],
            Some(d) => self.k.attn_partial_exact[d][g_idx],
            None => self.k.attn_partial[g_idx],
        };
        unsafe { self.launch(kernel, dims, args)? };
        if nsplit > 1 {
            let args = Args::new()
                .ptr(st.part_o.ptr())
                .ptr(st.part_ml.ptr())
                .ptr(st.row_pos.dev.ptr())
                .ptr(row_seq)
                .ptr(a.out)
                .i32(a.heads as i32)
                .i32(g.head_dim as i32)
                .i32(nsplit as i32)
                .i32(min_split as i32);
            let dims = LaunchDims { grid: (a.heads as u32, rows as u32, 1), block: 128 };
            unsafe { self.launch(self.k.attn_combine, dims, args)? };
        }
        Ok(())
    }

    /// The tiled prefill kernel over every tile of `st.maps.tiles`.
    fn attn_tiled(&self, st: &State, a: &AttnLaunch<'_>, kernel: Kernel) -> Result<()> {
        let g = a.kv.geometry;
        let ntiles = st.maps.tiles.len() / 2;
        let scale_log2 = std::f32::consts::LOG2_E / (g.head_dim as f32).sqrt();
        let args = Args::new()
            .ptr(a.q.ptr())
            .ptr(a.kv.k)
            .ptr(a.kv.v)
            .ptr(st.row_pos.dev.ptr())
            .ptr(st.row_seq.dev.ptr())
            .ptr(st.seq_pt_off.dev.ptr())
            .ptr(st.page_table.dev.ptr())
            .ptr(st.tiles.dev.ptr())
            .ptr(a.out)
            .i32(a.heads as i32)
            .i32(g.kv_heads as i32)
            .i32(g.page_size as i32)
            .f32(scale_log2)
            .i32(ntiles as i32);
        let dims = LaunchDims { grid: (ntiles as u32, a.heads as u32, 1), block: TILE_THREADS };
        unsafe { self.launch(kernel, dims, args) }
    }

    /// How many context splits attention uses for `rows × heads` queries over at most `max_ctx` tokens.
    fn splits(&self, rows: usize, heads: usize, per_block: usize, max_ctx: usize, min_split: usize) -> usize {
        let base = (rows * heads).max(1);
        let want_blocks = self.sm_count * 8;
        let by_occupancy = want_blocks.div_ceil((base / per_block).max(1));
        let by_length = max_ctx.div_ceil(min_split).max(1);
        let by_scratch = (self.config.attn_partials / base).max(1);
        // 256: kernels/attention.cu ATT_MAX_SPLITS.
        by_occupancy.min(by_length).min(by_scratch).clamp(1, 256)
    }

    fn vector_ptr(&self, w: &CudaWeight, what: &str) -> Result<u64> {
        if w.dtype != DType::F32 || w.rows != 1 {
            return Err(BackendError::Other(format!(
                "{what}: expected an f32 vector weight, got {} {}x{}",
                w.dtype, w.rows, w.cols
            )));
        }
        Ok(w.ptr())
    }
}

/// Destroy every captured step (the caller has synchronized the stream or
/// is about to change what the captures point at, between steps).
fn drop_graphs(st: &mut State) {
    for (_, g) in st.graphs.drain() {
        // SAFETY: created by capture, destroyed once; no replay is in flight
        // that the driver does not finish first (destroying a launched graph
        // exec is deferred by the driver until its work is done).
        unsafe {
            let _ = cu::graph::exec_destroy(g.exec);
            let _ = cu::graph::destroy(g.graph);
        }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        let _ = self.synchronize();
        let mut st = self.lock();
        drop_graphs(&mut st);
        drop(st);
        // SAFETY: no kernel of the module can still run after the synchronize above.
        unsafe {
            let _ = cu::module::unload(self.module);
            let _ = cu::stream::destroy(self.stream.0);
        }
    }
}

impl Backend for CudaBackend {
    type Act = CudaAct;
    type Weight = CudaWeight;
    type Kv = CudaKv;

    fn name(&self) -> String {
        self.name.clone()
    }

    fn stored_bytes(&self, dtype: DType, rows: usize, cols: usize) -> u64 {
        // As `upload_weight` stores it, on its own 256-byte boundary in the arena.
        let bytes = match dtype {
            _ if rows == 1 => cols as u64 * 4,
            DType::F32 | DType::F16 | DType::BF16 => (rows * cols * 2) as u64,
            q => q.bytes_for(cols).unwrap_or(0) as u64 * rows as u64,
        };
        bytes.div_ceil(ARENA_ALIGN) * ARENA_ALIGN
    }

    fn captures_graphs(&self) -> bool {
        // Profiling times ops one by one, so it runs without graphs.
        self.profile.is_none()
    }

    fn upload_weight(&self, t: &HostTensor) -> Result<CudaWeight> {
        self.ctx.bind()?;
        let (rows, cols, want) = t.checked_matrix()?;
        let src = t.data.bytes();
        let widen =
            |f: &dyn Fn(&[u8]) -> f32, width: usize| -> Vec<f32> { src.chunks_exact(width).map(f).collect() };
        let as_f32 = || -> Vec<f32> {
            match t.dtype {
                DType::F32 => widen(&|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]), 4),
                DType::F16 => widen(&|c| f16::from_le_bytes([c[0], c[1]]).to_f32(), 2),
                DType::BF16 => widen(&|c| bf16::from_le_bytes([c[0], c[1]]).to_f32(), 2),
                _ => {
                    let mut out = vec![0f32; rows * cols];
                    let rb = want / rows.max(1);
                    for (r, o) in out.chunks_mut(cols.max(1)).enumerate() {
                        crate::cpu::quant::dequantize_row(t.dtype, &src[r * rb..(r + 1) * rb], o);
                    }
                    out
                }
            }
        };
        // Vectors (norm weights, biases) are f32; matrices bf16 or their block type.
        let (dtype, bytes): (DType, Vec<u8>) = if rows == 1 {
            (DType::F32, bytemuck::cast_slice(&as_f32()).to_vec())
        } else {
            match t.dtype {
                DType::BF16 => (DType::BF16, src.to_vec()),
                DType::F32 | DType::F16 => {
                    (DType::BF16, as_f32().iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect())
                }
                q => (q, src.to_vec()),
            }
        };
        if dtype.is_quantized() {
            let tile = (DEQUANT_TILE / (cols * 2)).max(1).min(rows) * cols * 2;
            let mut st = self.lock();
            let mut slot = st.tile.take();
            let r = self.ensure_scratch(&mut slot, tile);
            st.tile = slot;
            r?;
        }
        let row_bytes = dtype.bytes_for(cols).unwrap_or(0);
        let mem = self.place_weight(&bytes)?;
        Ok(CudaWeight { mem, dtype, rows, cols, row_bytes })
    }

    fn weight_shape(&self, w: &CudaWeight) -> (usize, usize) {
        (w.rows, w.cols)
    }

    fn alloc_act(&self, shape: ActShape) -> Result<CudaAct> {
        self.ctx.bind()?;
        let bytes = (shape.rows * shape.cols).max(1) * 4;
        let buf = self.alloc_buf(bytes, Purpose::Workspace)?;
        // SAFETY: a fresh buffer of `bytes` bytes.
        unsafe { cu::memset_d8_async(buf.ptr(), 0, bytes, self.stream.0) }
            .map_err(|e| cuda_err("cuMemsetD8Async", e))?;
        self.synchronize()?;
        // The bf16 copy of matmul inputs must hold the widest activation at the most rows.
        let mut guard = self.lock();
        let st = &mut *guard;
        // A new workspace means new step buffers: captures of the old ones are stale.
        drop_graphs(st);
        let mut slot = st.xbf.take();
        let r = self.ensure_scratch(&mut slot, shape.rows * shape.cols * 2);
        st.xbf = slot;
        r?;
        // Row-indexed metadata grows with the largest workspace too.
        for m in [
            &mut st.tokens,
            &mut st.positions,
            &mut st.gather,
            &mut st.row_pos,
            &mut st.row_seq,
            &mut st.tiles,
            &mut st.rest_seq,
        ] {
            if m.cap < shape.rows {
                m.dev = self.alloc_buf(shape.rows * 4, Purpose::Workspace)?;
                m.cap = shape.rows;
                m.valid = false;
            }
        }
        drop(guard);
        self.synchronize()?;
        Ok(CudaAct { buf, rows: shape.rows, cols: shape.cols })
    }

    fn alloc_kv(&self, g: KvGeometry) -> Result<CudaKv> {
        self.ctx.bind()?;
        check_kv_geometry(&g)?;
        // Pages start on whole KV units; a page whose bytes are not a multiple
        // of the unit is padded.
        let addr = KvAddressing::contiguous((g.page_size * g.kv_heads * g.head_dim * 2) as u64, g.num_pages);
        addr.check(g.num_pages).map_err(BackendError::Other)?;
        let bytes = addr.span(g.num_pages).max(2) as usize;
        let k = self.alloc_buf(bytes, Purpose::Kv)?;
        let v = self.alloc_buf(bytes, Purpose::Kv)?;
        for b in [&k, &v] {
            // SAFETY: fresh buffers of `bytes` bytes.
            unsafe { cu::memset_d8_async(b.ptr(), 0, bytes, self.stream.0) }
                .map_err(|e| cuda_err("cuMemsetD8Async", e))?;
        }
        self.adopt_kv_addressing(addr)?;
        let (kp, vp) = (k.ptr(), v.ptr());
        Ok(CudaKv { geometry: g, _mem: KvMem::Own { _k: k, _v: v }, k: kp, v: vp, addr })
    }

    fn kv_in_arena(&self, arena: &Arc<KvArena>, g: KvGeometry, layers: usize) -> Result<Option<Vec<CudaKv>>> {
        check_kv_geometry(&g)?;
        // This card's share of the arena (the whole of it unless it spans cards).
        let part = self.alloc.card().and_then(|c| arena.part_on(c)).ok_or_else(|| {
            BackendError::Other(format!(
                "the KV arena spans {:?}; this backend's memory is not booked on any of them",
                arena.cards()
            ))
        })?;
        let geo = part.geometry;
        let layer_bytes = (g.page_size * g.kv_heads * g.head_dim * 2) as u64;
        if layers == 0 || geo.page_bytes.get() != 2 * layers as u64 * layer_bytes {
            return Err(BackendError::Other(format!(
                "a KV arena page of {} does not hold K and V of {layers} layers of {layer_bytes} bytes",
                geo.page_bytes
            )));
        }
        let addr = KvAddressing::of_arena(&geo).map_err(BackendError::Other)?;
        addr.check(arena.capacity().get()).map_err(BackendError::Other)?;
        let base = part.base_address;
        self.adopt_kv_addressing(addr)?;
        // Page-major: page p holds, for layer l, K at 2l and V at 2l+1 (in layer-sized slots).
        Ok(Some(
            (0..layers as u64)
                .map(|l| CudaKv {
                    geometry: KvGeometry { num_pages: arena.capacity().get(), ..g },
                    _mem: KvMem::Arena(arena.clone()),
                    k: base + 2 * l * layer_bytes,
                    v: base + (2 * l + 1) * layer_bytes,
                    addr,
                })
                .collect(),
        ))
    }

    fn embedding(&self, table: &CudaWeight, ids: &[u32], out: &mut CudaAct) -> Result<()> {
        let (vocab, cols) = (table.rows, table.cols);
        if cols != out.cols {
            return Err(BackendError::Other(format!(
                "embedding width {cols}, activation width {}",
                out.cols
            )));
        }
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(BackendError::Other(format!("token id {id} is outside the vocabulary of {vocab}")));
        }
        let mut st = self.lock();
        self.ctx.bind()?;
        let r = (|| {
            let cap = st.capturing.is_some();
            self.sync_meta(&mut st.tokens, ids, "token rows", cap)?;
            let a = Args::new()
                .ptr(table.ptr())
                .i32(dtype_code(table.dtype))
                .i64(table.row_bytes as i64)
                .ptr(st.tokens.dev.ptr())
                .ptr(out.ptr())
                .i32(cols as i32);
            unsafe {
                self.launch(self.k.embedding, LaunchDims { grid: (ids.len() as u32, 1, 1), block: 256 }, a)
            }
        })();
        if let Err(e) = &r {
            st.error.get_or_insert(BackendError::Other(e.to_string()));
        }
        r
    }

    fn rms_norm(&self, x: &CudaAct, weight: &CudaWeight, eps: f32, rows: usize, out: &mut CudaAct) {
        self.op("rms_norm", |_| {
            let w = self.vector_ptr(weight, "rms_norm")?;
            let a = Args::new().ptr(x.ptr()).ptr(w).ptr(out.ptr()).i32(x.cols as i32).f32(eps);
            unsafe { self.launch(self.k.rms_norm, norm_dims(rows, x.cols), a) }
        })
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaAct,
        y: &CudaAct,
        weight: &CudaWeight,
        eps: f32,
        rows: usize,
        out: &mut CudaAct,
    ) {
        self.op("add_rms_norm", |_| {
            let w = self.vector_ptr(weight, "add_rms_norm")?;
            let a = Args::new().ptr(x.ptr()).ptr(y.ptr()).ptr(w).ptr(out.ptr()).i32(x.cols as i32).f32(eps);
            unsafe { self.launch(self.k.add_rms_norm, norm_dims(rows, x.cols), a) }
        })
    }

    fn head_rms_norm(&self, x: &mut CudaAct, weight: &CudaWeight, eps: f32, head_dim: usize, rows: usize) {
        self.op("head_rms_norm", |_| {
            let w = self.vector_ptr(weight, "head_rms_norm")?;
            let heads = rows * x.cols / head_dim;
            let a = Args::new().ptr(x.ptr()).ptr(w).i32(head_dim as i32).f32(eps).i32(heads as i32);
            unsafe { self.launch(self.k.head_rms_norm, grid_for(heads * 32, 256), a) }
        })
    }

    fn matmul(&self, x: &CudaAct, w: &CudaWeight, bias: Option<&CudaWeight>, rows: usize, out: &mut CudaAct) {
        self.op(format_args!("matmul {}x{} {}", w.rows, w.cols, w.dtype), |st| {
            if x.cols != w.cols || out.cols != w.rows {
                return Err(BackendError::Other(format!(
                    "matmul: x has {} columns, weight is {}x{}, out has {} columns",
                    x.cols, w.rows, w.cols, out.cols
                )));
            }
            self.matmul_inner(st, x, w, rows, out)?;
            if let Some(b) = bias {
                let bp = self.vector_ptr(b, "bias")?;
                let n = rows * out.cols;
                let a = Args::new().ptr(out.ptr()).ptr(bp).i32(out.cols as i32).i64(n as i64);
                unsafe { self.launch(self.k.add_bias, grid_for(n, 256), a)? };
            }
            Ok(())
        })
    }

    fn matmul_many(&self, x: &CudaAct, parts: &mut [MatmulPart<'_, Self>], rows: usize) {
        let fused = parts.len() <= 3
            && parts.iter().all(|p| p.out.cols == p.w.rows && self.fusable_gemv(x, p.w, rows))
            && parts
                .iter()
                .all(|p| p.bias.is_none_or(|b| b.dtype == DType::F32 && b.rows * b.cols == p.w.rows));
        if !fused {
            return crate::unfused::matmul_many(self, x, parts, rows);
        }
        self.op("matmul_many (q/k/v)", |_| {
            let mut v = Vec::with_capacity(3);
            for p in parts.iter() {
                let bias = match p.bias {
                    Some(b) => self.vector_ptr(b, "bias")?,
                    None => 0,
                };
                v.push((p.w, bias, p.out.ptr()));
            }
            self.gemv_bf16_parts(x, &v, rows)
        })
    }

    fn gate_up_silu(
        &self,
        x: &CudaAct,
        gate: &CudaWeight,
        up: &CudaWeight,
        rows: usize,
        gate_out: &mut CudaAct,
        up_out: &mut CudaAct,
        out: &mut CudaAct,
    ) {
        let fused = self.fusable_gemv(x, gate, rows)
            && self.fusable_gemv(x, up, rows)
            && gate.rows == up.rows
            && out.cols == gate.rows;
        if !fused {
            return crate::unfused::gate_up_silu(self, x, gate, up, rows, gate_out, up_out, out);
        }
        self.op("gate_up_silu", |_| {
            let n = gate.rows;
            let dims = LaunchDims { grid: (n.div_ceil(GLU_NW) as u32, 1, 1), block: 32 * GEMV_WARPS };
            let a = Args::new()
                .ptr(gate.ptr())
                .ptr(up.ptr())
                .ptr(x.ptr())
                .ptr(out.ptr())
                .i32(n as i32)
                .i32(x.cols as i32)
                .i32(rows as i32);
            unsafe { self.launch(self.k.gemv_bf16_glu[rows - 1], dims, a) }
        })
    }

    fn rope_write_kv(
        &self,
        q: &mut CudaAct,
        k: &mut CudaAct,
        v: &CudaAct,
        table: &RopeTable,
        head_dim: usize,
        positions: &[u32],
        kv: &mut CudaKv,
        seqs: &[SeqStep<'_>],
    ) {
        if !self.config.tuning.fuse {
            return crate::unfused::rope_write_kv(self, q, k, v, table, head_dim, positions, kv, seqs);
        }
        self.op("rope_write_kv", |st| {
            self.sync_rope(st, table)?;
            let cap = st.capturing.is_some();
            self.sync_meta(&mut st.positions, positions, "positions", cap)?;
            st.kv_addr = kv.addr;
            self.sync_seqs(st, seqs)?;
            let g = kv.geometry;
            let width = g.kv_heads * g.head_dim;
            if k.cols != width || v.cols != width {
                return Err(BackendError::Other(format!(
                    "rope_write_kv: k has {} and v {} columns, the cache {width}",
                    k.cols, v.cols
                )));
            }
            if head_dim == 0 || !q.cols.is_multiple_of(head_dim) || head_dim != g.head_dim {
                return Err(BackendError::Other(format!(
                    "rope_write_kv: q has {} columns, heads of {head_dim}, the cache's {}",
                    q.cols, g.head_dim
                )));
            }
            let heads = q.cols / head_dim;
            let half = table.rot_dim / 2;
            let interleaved = i32::from(table.style == RopeStyle::Interleaved);
            let a = Args::new()
                .ptr(q.ptr())
                .ptr(k.ptr())
                .ptr(v.ptr())
                .ptr(kv.k)
                .ptr(kv.v)
                .ptr(st.inv_freq.ptr())
                .ptr(st.positions.dev.ptr())
                .i32(positions.len() as i32)
                .i32(st.maps.rows as i32)
                .ptr(st.row_pos.dev.ptr())
                .ptr(st.row_seq.dev.ptr())
                .ptr(st.seq_pt_off.dev.ptr())
                .ptr(st.page_table.dev.ptr())
                .i32(g.page_size as i32)
                .i32(heads as i32)
                .i32(g.kv_heads as i32)
                .i32(head_dim as i32)
                .i32(half as i32)
                .i32(interleaved);
            // A block per (row, head): q heads, then the KV heads' k, then their v.
            let rows = st.maps.rows.max(positions.len());
            let dims = LaunchDims {
                grid: (rows as u32, (heads + 2 * g.kv_heads) as u32, 1),
                block: half.next_power_of_two().clamp(32, 256) as u32,
            };
            unsafe { self.launch(self.k.rope_write_kv, dims, a) }
        })
    }

    fn rope(&self, x: &mut CudaAct, table: &RopeTable, head_dim: usize, positions: &[u32]) {
        self.op("rope", |st| {
            self.sync_rope(st, table)?;
            let cap = st.capturing.is_some();
            self.sync_meta(&mut st.positions, positions, "positions", cap)?;
            let interleaved = i32::from(table.style == RopeStyle::Interleaved);
            let a = Args::new()
                .ptr(x.ptr())
                .ptr(st.inv_freq.ptr())
                .ptr(st.positions.dev.ptr())
                .i32(x.cols as i32)
                .i32(head_dim as i32)
                .i32((table.rot_dim / 2) as i32)
                .i32(interleaved);
            unsafe {
                self.launch(self.k.rope, LaunchDims { grid: (positions.len() as u32, 1, 1), block: 128 }, a)
            }
        })
    }

    fn silu_mul(&self, gate: &CudaAct, up: &CudaAct, rows: usize, out: &mut CudaAct) {
        self.op("silu_mul", |_| {
            let n = rows * gate.cols;
            let a = Args::new().ptr(gate.ptr()).ptr(up.ptr()).ptr(out.ptr()).i64(n as i64);
            unsafe { self.launch(self.k.silu_mul, grid_for(n, 256), a) }
        })
    }

    fn add_assign(&self, x: &mut CudaAct, y: &CudaAct, rows: usize) {
        self.op("add_assign", |_| {
            let n = rows * x.cols;
            let a = Args::new().ptr(x.ptr()).ptr(y.ptr()).i64(n as i64);
            unsafe { self.launch(self.k.add_assign, grid_for(n, 256), a) }
        })
    }

    fn gather_rows(&self, x: &CudaAct, rows: &[usize], out: &mut CudaAct) {
        self.op("gather_rows", |st| {
            let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
            let cap = st.capturing.is_some();
            self.sync_meta(&mut st.gather, &idx, "logit rows", cap)?;
            let a = Args::new().ptr(x.ptr()).ptr(st.gather.dev.ptr()).ptr(out.ptr()).i32(x.cols as i32);
            unsafe {
                self.launch(self.k.gather_rows, LaunchDims { grid: (rows.len() as u32, 1, 1), block: 256 }, a)
            }
        })
    }

    fn write_kv(&self, kv: &mut CudaKv, k: &CudaAct, v: &CudaAct, seqs: &[SeqStep<'_>]) {
        self.op("write_kv", |st| {
            st.kv_addr = kv.addr;
            self.sync_seqs(st, seqs)?;
            let g = kv.geometry;
            let a = Args::new()
                .ptr(k.ptr())
                .ptr(v.ptr())
                .ptr(kv.k)
                .ptr(kv.v)
                .ptr(st.row_pos.dev.ptr())
                .ptr(st.row_seq.dev.ptr())
                .ptr(st.seq_pt_off.dev.ptr())
                .ptr(st.page_table.dev.ptr())
                .i32(g.page_size as i32)
                .i32((g.kv_heads * g.head_dim) as i32);
            unsafe {
                self.launch(self.k.write_kv, LaunchDims { grid: (st.maps.rows as u32, 1, 1), block: 256 }, a)
            }
        })
    }

    fn attention(&self, q: &CudaAct, kv: &CudaKv, heads: usize, seqs: &[SeqStep<'_>], out: &mut CudaAct) {
        self.op("attention", |st| {
            st.kv_addr = kv.addr;
            self.sync_seqs(st, seqs)?;
            let g = kv.geometry;
            if !heads.is_multiple_of(g.kv_heads) {
                return Err(BackendError::Other(format!("{heads} heads over {} KV heads", g.kv_heads)));
            }
            let a = AttnLaunch { q, kv, heads, out: out.ptr() };
            let tiled = match g.head_dim {
                64 => Some(self.k.attn_prefill_hd64),
                128 => Some(self.k.attn_prefill_hd128),
                _ => None,
            };
            // A captured step must stay valid for any rows and contexts, which
            // only the split-K kernel's fixed grid allows; it also splits for
            // the longest context the backend was sized for.
            if st.capturing.is_some() {
                let max_ctx = self.config.max_pages_per_seq * g.page_size;
                return self.attn_split(st, &a, st.row_seq.dev.ptr(), max_ctx);
            }
            match tiled {
                Some(kernel) if st.prefill == PrefillPath::Tiled && !st.maps.tiles.is_empty() => {
                    self.attn_tiled(st, &a, kernel)?;
                    if st.maps.rest_max_ctx > 0 {
                        self.attn_split(st, &a, st.rest_seq.dev.ptr(), st.maps.rest_max_ctx)?;
                    }
                    Ok(())
                }
                _ => self.attn_split(st, &a, st.row_seq.dev.ptr(), st.maps.max_ctx),
            }
        })
    }

    fn read_rows(&self, x: &CudaAct, rows: usize, out: &mut Vec<f32>) {
        self.op("read_rows (logits to host)", |st| {
            // Only a longer `out` is filled first: the copy overwrites it all,
            // and zeroing tens of megabytes every step would cost milliseconds.
            let n = rows * x.cols;
            if out.len() > n {
                out.truncate(n);
            } else {
                out.resize(n, 0.0);
            }
            if n < PINNED_READ_MIN {
                // SAFETY: `out` holds exactly the first `rows` rows of `x`.
                unsafe { cu::memcpy_dtoh_async(out.as_mut_slice(), x.ptr(), self.stream.0) }
                    .map_err(|e| cuda_err("cuMemcpyDtoHAsync", e))?;
                return self.synchronize();
            }
            // Large reads go through page-locked memory at the link's speed
            // (a pageable copy is staged by the driver at a fraction of it),
            // then into `out` on every core. The staging grows once, at the
            // largest read (the warm-up makes it).
            if st.pinned.as_ref().is_none_or(|p| p.len() < n) {
                st.pinned = None;
                st.pinned = Some(
                    corridor_vram::cuda::PinnedHost::new(n)
                        .map_err(|e| BackendError::Other(format!("page-locked staging: {e}")))?,
                );
            }
            let pinned = st.pinned.as_mut().expect("made above");
            let stage = &mut pinned.as_mut_slice()[..n];
            // SAFETY: `stage` holds exactly the first `rows` rows of `x`.
            unsafe { cu::memcpy_dtoh_async(stage, x.ptr(), self.stream.0) }
                .map_err(|e| cuda_err("cuMemcpyDtoHAsync", e))?;
            self.synchronize()?;
            use rayon::prelude::*;
            out.par_chunks_mut(1 << 18)
                .zip(stage.par_chunks(1 << 18))
                .for_each(|(o, i)| o.copy_from_slice(i));
            Ok(())
        })
    }

    fn copy_page(&self, kv: &mut CudaKv, from: PageId, to: PageId) {
        self.op("copy_page", |_| {
            let n = kv.page_bytes();
            let (src, dst) = (kv.addr.offset(from), kv.addr.offset(to));
            for base in [kv.k, kv.v] {
                // SAFETY: both pages lie inside the store (page ids come from the pool of this geometry).
                unsafe { cu::memcpy_dtod_async(base + dst, base + src, n, self.stream.0) }
                    .map_err(|e| cuda_err("cuMemcpyDtoDAsync", e))?;
            }
            Ok(())
        })
    }

    fn reserve_weights(&self, bytes: u64) -> Result<()> {
        self.ctx.bind()?;
        let buf = self.alloc_buf(bytes as usize, Purpose::Weights)?;
        self.lock().arena = Some(Arena { buf: Arc::new(buf), used: 0 });
        Ok(())
    }

    fn begin_step(&self, plan: &StepPlan<'_>) -> Result<()> {
        let mut st = self.lock();
        self.ctx.bind()?;
        let r = (|| {
            let cap = st.capturing.is_some();
            st.step_rows = plan.tokens.len();
            if let Some(p) = &self.profile {
                p.lock().unwrap_or_else(|e| e.into_inner()).step(plan.tokens.len());
            }
            self.sync_meta(&mut st.tokens, plan.tokens, "token rows", cap)?;
            self.sync_meta(&mut st.positions, plan.positions, "positions", cap)?;
            let idx: Vec<u32> = plan.logit_rows.iter().map(|&r| r as u32).collect();
            self.sync_meta(&mut st.gather, &idx, "logit rows", cap)?;
            self.sync_seqs(&mut st, plan.seqs)
        })();
        r
    }

    fn synchronize(&self) -> Result<()> {
        CudaBackend::synchronize(self)?;
        self.check()
    }

    fn check(&self) -> Result<()> {
        match self.lock().error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn graph_replay(&self, key: GraphKey) -> Result<bool> {
        let st = self.lock();
        self.ctx.bind()?;
        match st.graphs.get(&key) {
            Some(g) => {
                // SAFETY: an instantiated graph of this context, launched on our stream.
                unsafe { cu::graph::launch(g.exec, self.stream.0) }
                    .map_err(|e| cuda_err("cuGraphLaunch", e))?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn graph_capture_begin(&self, key: GraphKey) -> Result<bool> {
        let mut st = self.lock();
        self.ctx.bind()?;
        if st.capturing.is_some() || st.graphs.contains_key(&key) || self.profile.is_some() {
            return Ok(false);
        }
        // Relaxed mode: another thread's unrelated driver calls (an allocation
        // for a new KV chunk, say) must not invalidate the capture.
        unsafe {
            cu::stream::begin_capture(self.stream.0, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        }
        .map_err(|e| cuda_err("cuStreamBeginCapture", e))?;
        st.capturing = Some(key);
        Ok(true)
    }

    fn graph_capture_end(&self, key: GraphKey) -> Result<()> {
        let mut st = self.lock();
        self.ctx.bind()?;
        st.capturing = None;
        // SAFETY: our stream, capturing since graph_capture_begin.
        let graph = unsafe { cu::stream::end_capture(self.stream.0) }
            .map_err(|e| cuda_err("cuStreamEndCapture", e))?;
        if let Some(e) = st.error.take() {
            // SAFETY: the graph was just created and is not instantiated.
            let _ = unsafe { cu::graph::destroy(graph) };
            return Err(e);
        }
        // SAFETY: a graph captured on this context.
        let exec = unsafe { cu::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) }
            .map_err(|e| cuda_err("cuGraphInstantiate", e))?;
        // The ops were only recorded; run them once so this step has its results.
        unsafe { cu::graph::launch(exec, self.stream.0) }.map_err(|e| cuda_err("cuGraphLaunch", e))?;
        st.graphs.insert(key, Captured { exec, graph });
        Ok(())
    }
}
