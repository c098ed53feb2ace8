//! The CUDA backend: the same operations as the CPU backend, on one GPU.
//!
//! - Activations are f32 device matrices (`CudaAct`), as the trait promises.
//! - Weights: matrices in bf16 (f16/f32 checkpoints converted at upload), the
//!   ggml block formats uploaded as they are; vectors (norms, biases) in f32.
//! - Matmuls: GEMV kernels for decode rows, cuBLASLt for prefill (`matmul.rs`).
//! - KV: bf16 pages, per layer, in buffers of their own or the card's KV
//!   arena; tiled attention for prefill, split-K for everything else
//!   (`attention.rs`).
//! - Step metadata (token ids, positions, page tables, row maps) lives in
//!   device buffers sized at construction; each op compares its host
//!   arguments with what was last uploaded and copies only what changed, so
//!   `begin_step` makes every per-layer op upload nothing, and a captured
//!   step can be replayed after `begin_step` refreshed the buffers.
//!
//! Ops that return `()` record the first device error; `check` returns it.
//!
//! Where each concern lives:
//! - `kernels.rs`: the kernel table, compiled and loaded (NVRTC and the CUBIN cache: `nvrtc.rs`);
//! - `matmul.rs`: weights and the GEMV / cuBLASLt paths (`gemm.rs` wraps cuBLASLt);
//! - `moe.rs`: the routed expert FFN (device-side routing, routed GEMVs, the grouped GEMM);
//! - `attention.rs`: KV stores, the step's row and page maps, the KV writes and attention;
//! - `delta.rs`: the gated delta-net ops of the Qwen3.5 hybrid (convolution, delta rule, norms);
//! - `graphs.rs`: graph capture and replay;
//! - `profile.rs`: the per-op device-time profile;
//! - `sample.rs`: rows sampled on the device (`sample_rows`);
//! - `backend.rs`: the `Backend` impl that ties them;
//! - this file: the configuration, the device state every op shares, and construction;
//! - beside them: `device.rs` (context, stream, buffers, launches), `vram_alloc.rs` (every
//!   device byte through the card's chokepoint), `preflight.rs` (the libraries, found and
//!   checked), `nccl.rs` (the collective for GPU ranks), `check.rs` (the self-check against
//!   the CPU backend and the micro-benchmarks).

mod attention;
mod backend;
pub mod check;
mod delta;
pub mod device;
mod fold;
pub mod gemm;
mod graphs;
mod kernels;
mod matmul;
mod moe;
pub mod nccl;
pub mod nvrtc;
pub mod preflight;
mod profile;
mod sample;
pub mod vram_alloc;

use crate::kv_units::KvAddressing;
use crate::{BackendError, CudaTuning, GraphKey, Result, RopeTable};
use attention::{PrefillPath, SeqMaps};
use corridor_units::Bytes;
use cudarc::driver::{result as cu, sys};
use delta::DeltaPrefill;
use device::{cuda_err, Args, Ctx, DeviceAlloc, DeviceBuffer, Kernel, LaunchDims, Purpose, Stream};
use gemm::Gemm;
use graphs::{drop_graphs, Captured};
use kernels::Kernels;
use matmul::Arena;
use profile::OpProfile;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

pub use attention::{CudaKv, MAX_HEAD_DIM, TILED_MIN_ROWS};
pub use matmul::{rounds_matmul_input, CudaWeight, GEMV_MAX_ROWS};
pub use moe::{CudaExperts, MoePath, MOE_GEMV_MAX_ROWS};
pub use preflight::{preflight, Preflight};
pub use vram_alloc::VramAlloc;

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
    /// How steps are launched and whether ops are profiled (parsed at the edge: `crate::tuning`).
    pub tuning: CudaTuning,
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
            tuning: CudaTuning::default(),
        }
    }
}

/// An activation matrix `[rows, cols]` f32 on the device.
pub struct CudaAct {
    mem: ActMem,
    rows: usize,
    cols: usize,
    /// f32 elements from one row to the next: `cols` in a buffer of its
    /// own; a whole slot for a state inside a state pool's slots (only the
    /// delta-net ops, which take the stride, read such a state).
    stride: usize,
}

/// The first `rows` rows of the activation at `ptr` (`cols` wide), as
/// `State::xbf` may hold them rounded to bf16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct XbfView {
    pub(super) ptr: u64,
    pub(super) rows: usize,
    pub(super) cols: usize,
}

/// What `State::xq[buf]` holds: the first `rows` rows of the activation at
/// `ptr` (`cols` wide) quantized to 8 bits. The layout of the codes and
/// scales depends on `rows`, so a GEMV takes it only for exactly those rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Q8View {
    pub(super) buf: usize,
    pub(super) ptr: u64,
    pub(super) rows: usize,
    pub(super) cols: usize,
}

/// Where an activation's elements are.
enum ActMem {
    Own(DeviceBuffer),
    /// One state of every slot of a governed state pool: row `s` at
    /// `ptr + s * stride` inside the pool's reservation, which the pool
    /// keeps reserved (its chunks committed while a slot in them is held).
    Pool {
        ptr: u64,
        _pool: Arc<corridor_vram::KvArena>,
    },
}

impl CudaAct {
    fn own(buf: DeviceBuffer, rows: usize, cols: usize) -> CudaAct {
        CudaAct { mem: ActMem::Own(buf), rows, cols, stride: cols }
    }
    pub fn ptr(&self) -> u64 {
        match &self.mem {
            ActMem::Own(buf) => buf.ptr(),
            ActMem::Pool { ptr, .. } => *ptr,
        }
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
}

/// One u32 metadata array: its device buffer and the host copy last uploaded.
struct Meta {
    dev: DeviceBuffer,
    cap: usize,
    host: Vec<u32>,
    valid: bool,
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
    /// Per sequence of a delta-net op: first row, rows, cached, state slot.
    delta_seqs: Meta,
    prefill: PrefillPath,
    /// Split-K steps of fewer than `ATT_LANES_MIN_ROWS` rows take the
    /// 32-token-tile kernel (`attn_tile_*`); off only for the self-check's
    /// comparisons and benchmark of the per-warp kernel it replaces.
    decode_tiles: bool,
    delta_prefill: DeltaPrefill,
    maps: SeqMaps,
    maps_scratch: SeqMaps,
    inv_freq: DeviceBuffer,
    inv_freq_host: Vec<f32>,
    /// f32 → bf16 copy of a matmul's input rows.
    xbf: Option<DeviceBuffer>,
    /// The activation whose first rows `xbf` holds rounded to bf16, written
    /// by the op that produced them (a norm, the SiLU product) or by the
    /// first matmul that needed them: the matmuls of that input after it
    /// launch no conversion. Any op but a matmul forgets it (see `lock`).
    xbf_holds: Option<XbfView>,
    /// 8-bit copies of a decode matmul's input rows (at most
    /// `GEMV_MAX_ROWS`), laid out as `matmul::q8_layout` says: two, so that
    /// the gate/up GEMV can store its SiLU product quantized while it reads
    /// its own input from the other (`cuda_check --bench-q8-layer` times
    /// that form; serving does not take it).
    xq: [Option<DeviceBuffer>; 2],
    /// The activation whose first rows one of `xq` holds quantized, written
    /// by the op that produced them (a norm, attention's combine pass) or by the
    /// first integer GEMV of that input: the GEMVs of that input after it
    /// quantize nothing. Forgotten as `xbf_holds` is.
    xq_holds: Option<Q8View>,
    /// A residual add + RMSNorm folded into the one-row GEMVs around it
    /// (`fold.rs`): its producer ran, its activation is not yet written. A
    /// consumer GEMV of that activation takes it; any other op settles it
    /// first (`lock_for_matmul`).
    fold: Option<fold::FoldNorm>,
    /// Folded norms settled by a kernel of their own, counted for the self-check.
    fold_settles: u64,
    /// The folded norm's `x * w` (a row of the widest activation) and its
    /// producer's per-block sums of squares.
    fold_buf: Option<DeviceBuffer>,
    /// bf16 tile of a quantized weight, widened for a prefill GEMM.
    tile: Option<DeviceBuffer>,
    part_o: DeviceBuffer,
    part_ml: DeviceBuffer,
    /// A counter per (row, block of heads) of split-K attention, for the
    /// splits merged in their own launch: zero between launches (the block
    /// that merges rearms it).
    attn_counts: DeviceBuffer,
    /// Split-K attention merges its splits in its own launch
    /// (`CudaTuning::attn_merge`; the self-check also runs the combine pass).
    attn_merge: bool,
    /// Launches of `rope_attention` in one pass, counted for the self-check.
    one_pass_attention: u64,
    /// The context split-K attention splits for, in place of `split_ctx`'s
    /// (`cuda_check --bench-attention` times splits for the real context
    /// against a captured step's); None when serving.
    split_ctx_override: Option<usize>,
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
    /// The device side of `sample_rows` (`sample.rs`).
    sampling: sample::SampleBuffers,
    /// Bytes `Backend::prefetch` asked the next op to read into L2 (its
    /// launch carries them if it can); every op clears it.
    prefetch: Option<L2Span>,
}

/// Device bytes to read into the L2 cache: `bytes` from `ptr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct L2Span {
    ptr: u64,
    bytes: u64,
}

/// How much of a weight of `bytes` bytes a prefetch asks an L2 cache of
/// `l2` bytes to hold: at most half of it, so the lines the ops in between
/// read (attention's KV rows) keep their room and the first lines fetched
/// are not evicted by the last, and a multiple of 16 bytes, the bulk
/// prefetch's unit (0: nothing to ask).
fn l2_prefetch_bytes(bytes: u64, l2: u64) -> u64 {
    bytes.min(l2 / 2) & !15
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
    /// Kernels are launched with programmatic dependent launch (`CudaTuning::pdl` on sm_90+).
    pdl: bool,
    /// One-row bf16 GEMVs of small matrices take two-row blocks (`gemv_bf16_parts`);
    /// off only for the self-check's benchmark of both.
    gemv_narrow: std::sync::atomic::AtomicBool,
    /// Weight-row groups per block of the integer GEMVs, 0 for the launch's
    /// own choice (`matmul::mmvq_groups`); set only by the self-check's benchmark.
    mmvq_groups: std::sync::atomic::AtomicUsize,
    /// One-row integer GEMVs take the pipelined kernels (`CudaTuning::mmvq_pipe`;
    /// the self-check also sets it, to compare and time both).
    mmvq_pipe: std::sync::atomic::AtomicBool,
    /// The device sampler scans every row in slices first
    /// (`CudaTuning::sample_slices`; the self-check also sets it).
    sample_slices: std::sync::atomic::AtomicBool,
    /// One-row residual adds and norms fold into the GEMVs around them
    /// (`CudaTuning::fold_norm`; the self-check also sets it).
    fold_norm: std::sync::atomic::AtomicBool,
    /// Whether a block-format weight with an integer GEMV was uploaded: only
    /// then do the norms also store their rows quantized to 8 bits.
    q8_weights: std::sync::atomic::AtomicBool,
    /// The card's L2 cache in bytes where `CudaTuning::l2_prefetch` holds
    /// and the card has the bulk prefetch (sm_90 and later), else 0: then
    /// `Backend::prefetch` does nothing.
    l2_prefetch: u64,
    state: Mutex<State>,
    /// Per-op timing when `CudaTuning::profile_every` is set (a report every N steps).
    profile: Option<Mutex<OpProfile>>,
}

// SAFETY: the module handle is immutable once loaded; everything mutable is behind `state`.
unsafe impl Send for CudaBackend {}

unsafe impl Sync for CudaBackend {}

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
        let l2 = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?.max(0) as u64;
        let arch = format!("sm_{major}{minor}");
        let dev_name = cu::device::get_name(dev).unwrap_or_else(|_| "unknown".into());
        let stream = Stream(
            cu::stream::create(cu::stream::StreamKind::NonBlocking)
                .map_err(|e| cuda_err("cuStreamCreate", e))?,
        );
        let (module, k) = kernels::load(&arch, config.kernel_cache_dir.as_deref())?;
        let meta = |n: usize| -> Result<Meta> {
            let dev = DeviceBuffer::new(&alloc, ctx, Bytes((n.max(1) * 4) as u64), Purpose::Workspace)?;
            Ok(Meta { dev, cap: n.max(1), host: Vec::new(), valid: false })
        };
        let rows = config.max_rows.max(1);
        let parts = config.attn_partials.max(1);
        // Rows x heads never exceeds the partial slots where a row has more than one split.
        let attn_counts = DeviceBuffer::new(&alloc, ctx, Bytes((parts * 4) as u64), Purpose::Workspace)?;
        // SAFETY: a fresh buffer of `parts` counters, zeroed on the stream every kernel runs on.
        unsafe { cu::memset_d8_async(attn_counts.ptr(), 0, parts * 4, stream.0) }
            .map_err(|e| cuda_err("cuMemsetD8Async", e))?;
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
            delta_seqs: meta(4 * config.max_seqs)?,
            prefill: PrefillPath::Tiled,
            decode_tiles: true,
            delta_prefill: if config.tuning.delta_chunked {
                DeltaPrefill::Chunked
            } else {
                DeltaPrefill::Scan
            },
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
            xbf_holds: None,
            xq: [None, None],
            xq_holds: None,
            fold: None,
            fold_settles: 0,
            fold_buf: None,
            tile: None,
            part_o: DeviceBuffer::new(
                &alloc,
                ctx,
                Bytes((parts * MAX_HEAD_DIM * 4) as u64),
                Purpose::Workspace,
            )?,
            part_ml: DeviceBuffer::new(&alloc, ctx, Bytes((parts * 2 * 4) as u64), Purpose::Workspace)?,
            attn_counts,
            attn_merge: config.tuning.attn_merge,
            one_pass_attention: 0,
            split_ctx_override: None,
            arena: None,
            capturing: None,
            graphs: HashMap::new(),
            kv_addr: KvAddressing::IDENTITY,
            step_rows: 0,
            pinned: None,
            sampling: Default::default(),
            prefetch: None,
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
            gemv_narrow: std::sync::atomic::AtomicBool::new(true),
            mmvq_groups: std::sync::atomic::AtomicUsize::new(0),
            mmvq_pipe: std::sync::atomic::AtomicBool::new(config.tuning.mmvq_pipe),
            sample_slices: std::sync::atomic::AtomicBool::new(config.tuning.sample_slices),
            fold_norm: std::sync::atomic::AtomicBool::new(config.tuning.fold_norm),
            q8_weights: std::sync::atomic::AtomicBool::new(false),
            l2_prefetch: if config.tuning.l2_prefetch && major >= 9 { l2 } else { 0 },
            profile: config.tuning.profile_every.map(|every| Mutex::new(OpProfile::new(every))),
            config,
            state: Mutex::new(state),
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

    /// The state, locked for an op that may write any activation: what
    /// `xbf` holds is forgotten, so only the matmuls (which write nothing
    /// their inputs are; `lock_for_matmul`) ever reuse it.
    fn lock(&self) -> MutexGuard<'_, State> {
        let mut st = self.lock_for_matmul();
        st.xbf_holds = None;
        st.xq_holds = None;
        st
    }

    /// The state, locked for a matmul, which keeps `xbf_holds` (it checks
    /// that its outputs are not the activation held). A folded norm still
    /// pending is settled first: this op may read its activation.
    fn lock_for_matmul(&self) -> MutexGuard<'_, State> {
        let mut st = self.lock_raw();
        if let Some(f) = st.fold.take() {
            let r = self.ctx.bind().and_then(|_| self.fold_settle(&f));
            st.fold_settles += 1;
            self.record(&mut st, r);
        }
        st
    }

    /// The state as it is, a folded norm left pending.
    fn lock_raw(&self) -> MutexGuard<'_, State> {
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
    /// error; when profiling (`CudaTuning::profile_every`) also wait for it and count its time.
    /// The name is only formatted when profiling.
    fn op(&self, name: impl std::fmt::Display, f: impl FnOnce(&mut State) -> Result<()>) {
        self.op_locked(self.lock(), name, f)
    }

    /// [`CudaBackend::op`] for a matmul: what `xbf` holds stays known.
    fn matmul_op(&self, name: impl std::fmt::Display, f: impl FnOnce(&mut State) -> Result<()>) {
        self.op_locked(self.lock_for_matmul(), name, f)
    }

    fn op_locked(
        &self,
        st: MutexGuard<'_, State>,
        name: impl std::fmt::Display,
        f: impl FnOnce(&mut State) -> Result<()>,
    ) {
        let mut st = st;
        let Some(profile) = &self.profile else {
            let r = self.ctx.bind().and_then(|_| f(&mut st));
            st.prefetch = None;
            self.record(&mut st, r);
            return;
        };
        let r = self.ctx.bind().and_then(|_| self.profiled(profile, &name.to_string(), || f(&mut st)));
        st.prefetch = None;
        self.record(&mut st, r);
    }

    /// `Backend::prefetch`: the next op's launch may read `w` into L2.
    fn note_prefetch(&self, w: &CudaWeight) {
        let bytes = l2_prefetch_bytes((w.rows * w.row_bytes) as u64, self.l2_prefetch);
        if bytes > 0 {
            self.lock_for_matmul().prefetch = Some(L2Span { ptr: w.ptr(), bytes });
        }
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
        self.launch_shared(k, dims, 0, args)
    }

    /// [`CudaBackend::launch`] with `shared` bytes of dynamic shared memory.
    unsafe fn launch_shared(&self, k: Kernel, dims: LaunchDims, shared: u32, args: Args) -> Result<()> {
        let mut args = args;
        k.launch_shared(self.stream, dims, shared, &mut args, self.pdl)
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
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        let _ = self.synchronize();
        let mut st = self.lock_raw();
        drop_graphs(&mut st);
        drop(st);
        // SAFETY: no kernel of the module can still run after the synchronize above.
        unsafe {
            let _ = cu::module::unload(self.module);
            let _ = cu::stream::destroy(self.stream.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::l2_prefetch_bytes;

    #[test]
    fn a_prefetch_asks_for_at_most_half_the_l2_in_whole_16_byte_units() {
        const MIB: u64 = 1 << 20;
        // Llama-3-8B's o_proj: Q4_K (9 MiB) whole on a 50 MiB L2; bf16 (32 MiB) cut to half of it.
        assert_eq!(l2_prefetch_bytes(4096 * 2304, 50 * MIB), 4096 * 2304);
        assert_eq!(l2_prefetch_bytes(4096 * 8192, 50 * MIB), 25 * MIB);
        // The bulk prefetch's unit: a ragged length is rounded down, never up past the weight.
        assert_eq!(l2_prefetch_bytes(1000, 50 * MIB), 992);
        assert_eq!(l2_prefetch_bytes(15, 50 * MIB), 0);
        // A card that reports no L2 (or prefetching off) asks for nothing.
        assert_eq!(l2_prefetch_bytes(4096 * 2304, 0), 0);
    }
}
