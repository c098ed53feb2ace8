//! Matmuls: the weights they read and the kernels that compute them.
//!
//! A weight lives in the weight arena (or an allocation of its own): bf16
//! for matrices (f16/f32 checkpoints converted at upload), the ggml block
//! formats as they are, f32 for vectors. Decode rows (up to `GEMV_MAX_ROWS`)
//! go through GEMV kernels (kernels/gemv.cu) that read every weight byte
//! once per step: a per-row kernel (16-byte loads, split-K across the warps
//! of a block, one instantiation per power-of-two row count, for bf16 and
//! each ggml block format), its fused launches (q/k/v in one, gate/up with
//! SiLU), and a tensor-core kernel for 3..8 rows that splits the f32
//! activations into two bf16 parts and so stays exact. cuBLASLt (bf16 ×
//! bf16 → f32, `gemm.rs`) takes prefill rows, and 3..8 rows on large bf16
//! matrices where it measured faster (`takes_gemv`). Block-format weights at
//! 1..=8 rows take the integer GEMVs of kernels/mmvq.cu (`takes_q8_gemv`:
//! the input rows quantized to 8 bits per 32 once, then `__dp4a` on the
//! weights' codes), then up to `MMQ_TAKES_ROWS` rows the tensor-core kernels of
//! kernels/mmq.cu, which decode the blocks in shared memory and never widen
//! the matrix; past that, quantized weights are widened to bf16 a tile of
//! rows at a time for cuBLASLt.

use super::device::{Args, DeviceBuffer, LaunchDims, Purpose};
use super::fold::FoldNorm;
use super::gemm::GemmShape;
use super::kernels::{block_gemv_index, dtype_code, grid_for, mmq_index, mmvq_index, MmqKernel, MMVQ_PIPE};
use super::{CudaAct, CudaBackend, Q8View, State, XbfView};
use crate::cpu::MatmulInput;
use crate::dtype::DType;
use crate::{BackendError, CudaTuning, MatmulPart, Result};
use std::sync::Arc;

/// Rows up to which matmuls use the GEMV kernels (kernels/gemv.cu GEMV_MAX_ROWS).
pub const GEMV_MAX_ROWS: usize = 8;

/// Warps per GEMV block (kernels/gemv.cu GEMV_WARPS).
pub(super) const GEMV_WARPS: u32 = 4;

/// Weight rows per block of the bf16 GEMV (GEMV_NW) and of the block-format GEMV (GEMVQ_NW).
pub(super) const GEMV_NW: usize = 4;
pub(super) const GEMVQ_NW: usize = 2;

/// Output columns per block of the gate/up/SiLU GEMV (GLU_NW).
pub(super) const GLU_NW: usize = 4;

/// Warps per block of the tensor-core GEMV (GEMVT_WARPS).
pub(super) const GEMV_TC_WARPS: u32 = 8;

/// Weight rows below which the tensor-core GEMV leaves 3 and 4 input rows to the per-row kernel.
pub(super) const GEMV_TC_MIN_N: usize = 2048;

/// Input rows from which block-format weights may take the tensor-core
/// kernels of kernels/mmq.cu (the 32-weight formats with a per-row GEMV of
/// their own keep it below).
pub const MMQ_MIN_ROWS: usize = 3;
/// Rows up to which `matmul` picks the mmq kernels; past them widening the
/// matrix to bf16 for cuBLASLt, whose larger tiles then outrun decoding the
/// blocks again for every group of rows (PERF.md, "Quantized matmuls").
pub const MMQ_TAKES_ROWS: usize = 128;

/// Weight rows per block of the mmq kernels (MMQ_BN) and threads per block.
pub(super) const MMQ_BN: usize = 64;
pub(super) const MMQ_THREADS: u32 = 128;
/// Tiles of 8 input rows of the mmq instantiations (`mmq_*_n1` .. `_n8`):
/// one block takes a group of up to 8, 16, 32 or 64 input rows.
pub(super) const MMQ_TILES: [usize; 4] = [1, 2, 4, 8];
/// bf16 elements of one staged input row in shared memory (MMQ_XSTRIDE).
const MMQ_XSTRIDE: usize = 288;
/// Chunks of 256 weights a K slice keeps at least, so that the copy of one
/// overlaps the decoding of the one before.
const MMQ_MIN_CHUNKS: usize = 2;

/// The dynamic shared memory of an mmq block (kernels/mmq.cu
/// `mmq_smem_bytes`): two stages of the raw blocks of 64 weight rows, each
/// row's 256 weights in a slot of an odd number of 16-byte pieces, and two
/// stages of the group's input rows.
pub(super) fn mmq_smem_bytes(dtype: DType, tiles: usize) -> usize {
    let b256 = dtype.block_bytes() * 256 / dtype.block_elems();
    let slot = 16 * ((b256.div_ceil(16) + 1) | 1);
    2 * MMQ_BN * slot + 2 * 8 * tiles * MMQ_XSTRIDE * 2
}

/// The instantiation (index into `MMQ_TILES`) and the number of row groups
/// an mmq launch of `rows` rows takes, among the instantiations `fits` says
/// the card runs: the smallest group that holds every row, else the largest
/// one that runs, as many times as the rows need.
pub(super) fn mmq_shape(rows: usize, fits: impl Fn(usize) -> bool) -> Option<(usize, usize)> {
    let want = MMQ_TILES.iter().position(|&t| 8 * t >= rows).unwrap_or(MMQ_TILES.len() - 1);
    let inst = (0..=want).rev().find(|&i| fits(i))?;
    Some((inst, rows.div_ceil(8 * MMQ_TILES[inst])))
}

/// One mmq launch: the instantiation, its row groups, the blocks over the
/// weight rows and groups (`tiles`) and the K slices.
#[derive(Clone, Copy, Debug)]
pub(super) struct MmqLaunch {
    pub(super) kern: MmqKernel,
    pub(super) groups: usize,
    pub(super) group_rows: usize,
    pub(super) tiles: usize,
    pub(super) slices: usize,
    pub(super) kslice: usize,
}

/// How an mmq launch of `tiles` blocks over K splits K: (slices, weights per
/// slice). Enough slices for about one wave of blocks (`resident` fit on the
/// card at once), each with at least `MMQ_MIN_CHUNKS` super-blocks, and no
/// more than the partial sums (`slices × out_elems` f32) that fit in
/// `part_bytes` of scratch; one slice when K is not whole super-blocks.
pub(super) fn mmq_split(
    tiles: usize,
    k: usize,
    out_elems: usize,
    resident: usize,
    part_bytes: usize,
) -> (usize, usize) {
    if !k.is_multiple_of(256) || k < 256 * MMQ_MIN_CHUNKS {
        return (1, k);
    }
    let supers = k / 256;
    let fit = part_bytes / (out_elems * 4).max(1);
    let want = ((resident + tiles / 2) / tiles.max(1)).min(supers / MMQ_MIN_CHUNKS).min(fit);
    if want < 2 {
        return (1, k);
    }
    let per = supers.div_ceil(want);
    (supers.div_ceil(per), per * 256)
}

/// Warps per block of the integer GEMVs (kernels/mmvq.cu MMVQ_WARPS).
pub(super) const MMVQ_WARPS: u32 = 4;

/// Weight rows per group of the integer GEMVs, by row-count instantiation
/// (1, 2, 4, 8 input rows; kernels/mmvq.cu MMVQ_ALL).
pub(super) const MMVQ_NW: [usize; 4] = [2, 2, 4, 4];

/// Groups of weight rows one block of the integer GEMVs reads at most, by
/// row-count instantiation (kernels/mmvq.cu MMVQ_ALL's MAXG; a gate/up
/// launch reads twice its groups).
pub(super) const MMVQ_MAX_GROUPS: [usize; 4] = [32, 32, 16, 8];

/// Groups of weight rows per block of an integer GEMV launch over
/// `weight_groups` groups in all, when `resident` blocks fit on the card at
/// once: about one block per place, each warp then streaming its loads
/// across its block's rows (kernels/mmvq.cu `mmvq_body`), at most `max`.
pub(super) fn mmvq_groups(weight_groups: usize, resident: usize, max: usize) -> usize {
    weight_groups.div_ceil(resident.max(1)).clamp(1, max.max(1))
}

/// Whether a one-row bf16 GEMV takes blocks of two weight rows (`blocks2` of
/// them) rather than of four (`blocks4`), `resident` blocks fitting the card
/// at once (8 per SM: kernels/gemv.cu MINB, both kernels): where four-row
/// blocks fill under half a wave, and with `fill` also where two-row ones
/// fill their last wave better by a tenth of a wave (the four-row blocks
/// share each activation load between more rows, so a small gain in fill
/// does not pay for it).
pub(super) fn two_row_blocks(blocks4: usize, blocks2: usize, resident: usize, fill: bool) -> bool {
    let filled = |b: usize| b as f64 / (b.div_ceil(resident.max(1)) * resident.max(1)) as f64;
    blocks4 * 2 < resident || (fill && filled(blocks2) > filled(blocks4) + 0.1)
}

/// One matrix of an integer GEMV launch: the weight, a bias pointer or 0,
/// the output pointer.
pub(super) type MvPart<'a> = (&'a CudaWeight, u64, u64);

/// Input rows up to which a block format with an integer GEMV takes it
/// instead of mmq. Measured on the H200 (`cuda_check --bench`, 2026-12-02,
/// Llama-3-8B shapes): the integer GEMV leads at 1, 2 and 4 rows for every
/// format (Q4_K at one row 32-49% of the copy bandwidth against mmq's
/// 17-21%, Q6_K 41-57% against 21-30%, at four rows Q4_K 21-30% against
/// 16-20%), and mmq leads at 8 (Q4_K 11-15% against 16-20%, Q4_0 12-17%
/// against 15-19%): past 4 rows the GEMV's dp4a and scaling per input row,
/// not the bytes, are its limit.
pub const Q8_GEMV_MAX_ROWS: usize = 4;

/// Rows up to which `dtype` takes the integer GEMV (0: it has none).
fn q8_gemv_rows(dtype: DType) -> usize {
    if mmvq_index(dtype).is_some() {
        Q8_GEMV_MAX_ROWS
    } else {
        0
    }
}

/// Where the 8-bit copy of a matmul's input rows lies in its scratch
/// (`State::xq`): the codes `[rows, k]` as i8 from the start, then from the
/// next 16-byte boundary `scales_at` the (d, d·Σq) pairs `[rows, k / 32]` as
/// f32, `bytes` in all (kernels/mmvq.cu `q8_quantize`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Q8Layout {
    pub(super) scales_at: usize,
    pub(super) bytes: usize,
}

pub(super) fn q8_layout(rows: usize, k: usize) -> Q8Layout {
    let scales_at = (rows * k).next_multiple_of(16);
    Q8Layout { scales_at, bytes: scales_at + rows * k.div_ceil(32) * 8 }
}

/// The 8-bit copy of a matmul's input, quantized in the scratch: device
/// pointers to its codes and scales, for the integer GEMVs.
#[derive(Clone, Copy)]
pub(super) struct Q8Input {
    pub(super) codes: u64,
    pub(super) scales: u64,
    pub(super) k: usize,
}

impl Q8Input {
    /// `rows` rows of `k` columns laid out by [`q8_layout`] from `at`.
    pub(super) fn at(at: u64, rows: usize, k: usize) -> Q8Input {
        Q8Input { codes: at, scales: at + q8_layout(rows, k).scales_at as u64, k }
    }
}

/// Bytes of the bf16 tile a quantized weight is widened into for prefill.
pub(super) const DEQUANT_TILE: usize = 32 << 20;
/// Alignment of weights inside the weight arena (cuBLASLt wants 16, the
/// vector loads 16; 256 keeps every tensor on its own cache lines).
pub(super) const ARENA_ALIGN: u64 = 256;

/// Where a weight's bytes live: its own allocation or a slice of the arena.
pub(super) enum WeightMem {
    Own(DeviceBuffer),
    Arena { _arena: Arc<DeviceBuffer>, ptr: u64 },
}

/// [`CudaBackend::takes_gemv`] for an `[n, k]` matrix held as `dtype`.
fn takes_gemv(dtype: DType, n: usize, k: usize, rows: usize) -> bool {
    const LARGE_WEIGHT: usize = 64 << 20;
    let large_bf16 = dtype == DType::BF16 && n * k * 2 >= LARGE_WEIGHT;
    match rows {
        0..=2 => true,
        3..=GEMV_MAX_ROWS => !large_bf16,
        _ => false,
    }
}

/// [`CudaBackend::takes_q8_gemv`] for a matrix of `k` columns held as `dtype`.
fn takes_q8_gemv(tuning: &CudaTuning, dtype: DType, k: usize, rows: usize) -> bool {
    tuning.q8_gemv && k.is_multiple_of(dtype.block_elems()) && (1..=q8_gemv_rows(dtype)).contains(&rows)
}

/// [`CudaBackend::takes_mmq`] for a matrix of `k` columns held as `dtype`.
fn takes_mmq(dtype: DType, k: usize, rows: usize) -> bool {
    // The 32-weight formats with a per-row GEMV of their own keep it at 1
    // and 2 rows, where it measured faster; every other block format takes
    // mmq from one row (scripts/gpu/PERF.md, "Quantized matmuls").
    let own_gemv = matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1);
    let first = if own_gemv { MMQ_MIN_ROWS } else { 1 };
    mmq_index(dtype).is_some() && k.is_multiple_of(32) && (first..=MMQ_TAKES_ROWS).contains(&rows)
}

/// How a matmul of `rows` rows against an `[n, k]` matrix held on the device
/// as `dtype` takes its input under `tuning`: quantized to 8 bits (the
/// integer GEMVs), rounded to bf16 (mmq, cuBLASLt) or as f32 (the other
/// GEMVs). The order of `matmul_inner`'s choice.
fn matmul_input(tuning: &CudaTuning, dtype: DType, n: usize, k: usize, rows: usize) -> MatmulInput {
    if takes_q8_gemv(tuning, dtype, k, rows) {
        MatmulInput::Q8
    } else if takes_mmq(dtype, k, rows) || !takes_gemv(dtype, n, k, rows) {
        MatmulInput::Bf16
    } else {
        MatmulInput::F32
    }
}

/// How a matmul of `rows` rows against an `[n, k]` matrix held on the
/// device as `dtype` (bf16 for a checkpoint's f32 and f16 matrices, see
/// `upload_weight`) takes its input under the default tuning: what a CPU
/// reference must do to its input to compute as this backend does
/// (`cpu::Bf16Rounding::inputs`).
pub fn rounds_matmul_input(dtype: DType, n: usize, k: usize, rows: usize) -> MatmulInput {
    matmul_input(&CudaTuning::default(), dtype, n, k, rows)
}

/// A weight on the device: `[rows, cols]` in `dtype` (BF16, F32 for vectors, or a ggml block type).
pub struct CudaWeight {
    pub(super) mem: WeightMem,
    pub(super) dtype: DType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) row_bytes: usize,
}

impl CudaWeight {
    pub(super) fn ptr(&self) -> u64 {
        match &self.mem {
            WeightMem::Own(b) => b.ptr(),
            WeightMem::Arena { ptr, .. } => *ptr,
        }
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
}

/// A bump allocator over one device allocation for all weights.
pub(super) struct Arena {
    pub(super) buf: Arc<DeviceBuffer>,
    pub(super) used: u64,
}

impl CudaBackend {
    pub(super) fn place_weight(&self, bytes: &[u8]) -> Result<WeightMem> {
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
    pub(super) fn matmul_inner(
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
        if self.takes_q8_gemv(w, rows) {
            let input = self.q8_input(st, x, rows)?;
            return self.gemv_q8(st, input, w, rows, out);
        }
        if self.takes_mmq(w, rows) {
            return self.mmq(st, x, w, rows, out);
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
    pub(super) fn takes_gemv(&self, w: &CudaWeight, rows: usize) -> bool {
        takes_gemv(w.dtype, w.rows, w.cols, rows)
    }

    /// Whether `rows` rows against `w` take the tensor-core kernels of block
    /// formats (kernels/mmq.cu): every block format with rows of whole
    /// 32-weight groups, from 3 rows (where the per-row GEMVs' f32 FMAs become
    /// their limit) to `MMQ_TAKES_ROWS`. The input is rounded to bf16 there.
    pub(super) fn takes_mmq(&self, w: &CudaWeight, rows: usize) -> bool {
        takes_mmq(w.dtype, w.cols, rows)
    }

    /// Whether `rows` rows against `w` take the integer GEMV of its block
    /// format (kernels/mmvq.cu), ahead of mmq: with `CudaTuning::q8_gemv`,
    /// up to the format's `q8_gemv_rows`. The input is quantized to 8 bits
    /// there, as the CPU's decode quantizes it.
    pub(super) fn takes_q8_gemv(&self, w: &CudaWeight, rows: usize) -> bool {
        takes_q8_gemv(&self.config.tuning, w.dtype, w.cols, rows)
    }

    /// How the result of `rows` rows against `w` is computed from the input:
    /// quantized to 8 bits (the integer GEMVs), rounded to bf16 (cuBLASLt or
    /// the mmq kernels), or in f32.
    pub fn rounds_input(&self, w: &CudaWeight, rows: usize) -> MatmulInput {
        matmul_input(&self.config.tuning, w.dtype, w.rows, w.cols, rows)
    }

    /// `rows` rows of `x` (`x.cols` a multiple of 32) quantized to 8 bits per
    /// 32 in a scratch (kernels/mmvq.cu `q8_quantize`), for one or more
    /// integer GEMVs of that input. Quantized here unless a scratch already
    /// holds them (`State::xq_holds`: the op that wrote `x` stored them, or
    /// a GEMV of the same input quantized them).
    pub(super) fn q8_input(&self, st: &mut State, x: &CudaAct, rows: usize) -> Result<Q8Input> {
        let k = x.cols;
        if !k.is_multiple_of(32) {
            return Err(BackendError::Other(format!("8-bit input of {k} columns: not whole blocks of 32")));
        }
        if let Some(v) = st.xq_holds.filter(|v| v.ptr == x.ptr() && v.cols == k && v.rows == rows) {
            return self.q8_scratch(st, v.buf, rows, k);
        }
        let input = self.q8_scratch(st, 0, rows, k)?;
        self.q8_quantize(x.ptr(), input, rows)?;
        st.xq_holds = Some(Q8View { buf: 0, ptr: x.ptr(), rows, cols: k });
        Ok(input)
    }

    /// `rows` rows of `q.k` f32 columns from device address `x` quantized to
    /// 8 bits into `q` (kernels/mmvq.cu `q8_quantize`; `q.k` a multiple of 32).
    pub(super) fn q8_quantize(&self, x: u64, q: Q8Input, rows: usize) -> Result<()> {
        let blocks = rows * q.k / 32;
        let a = Args::new().ptr(x).ptr(q.codes).ptr(q.scales).i64(blocks as i64);
        unsafe { self.launch(self.k.q8_quantize, grid_for(blocks * 8, 256), a) }
    }

    /// Where `rows` rows of `k` columns quantized to 8 bits go in scratch `buf`.
    fn q8_scratch(&self, st: &State, buf: usize, rows: usize, k: usize) -> Result<Q8Input> {
        let b = st.xq[buf].as_ref().filter(|b| b.bytes().0 as usize >= q8_layout(rows, k).bytes).ok_or_else(
            || {
                BackendError::Other(format!(
                    "8-bit input of {rows}x{k}: scratch not sized (allocate activations first)"
                ))
            },
        )?;
        Ok(Q8Input::at(b.ptr(), rows, k))
    }

    /// Where an op that writes `rows` rows of `out` (a norm, attention's
    /// combine pass) can also store them quantized to 8 bits for the integer
    /// GEMVs that read `out` next: scratch 0, recorded in `State::xq_holds`;
    /// `None` (store nothing) when no weight takes an integer GEMV, the rows
    /// are too many for one, the width is not whole blocks of 32 or wider
    /// than the op can quantize (`max_cols`: the norm's register path,
    /// kernels/elementwise.cu `norm_row`), or the scratch too small.
    pub(super) fn q8_output(
        &self,
        st: &mut State,
        out: &CudaAct,
        rows: usize,
        max_cols: usize,
    ) -> Option<Q8Input> {
        let k = out.cols;
        let fits = self.q8_weights.load(std::sync::atomic::Ordering::Relaxed)
            && self.config.tuning.fuse
            && self.config.tuning.q8_gemv
            && (1..=Q8_GEMV_MAX_ROWS).contains(&rows)
            && k.is_multiple_of(32)
            && k <= max_cols
            && out.stride == out.cols;
        if !fits {
            return None;
        }
        let input = self.q8_scratch(st, 0, rows, k).ok()?;
        st.xq_holds = Some(Q8View { buf: 0, ptr: out.ptr(), rows, cols: k });
        Some(input)
    }

    /// Weight-row groups per block of the integer GEMVs from now on, 0 for
    /// each launch's own choice (the self-check's comparisons and benchmark).
    pub(super) fn set_mmvq_groups(&self, groups: usize) {
        self.mmvq_groups.store(groups, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether one-row integer GEMVs take the pipelined kernels, in place of
    /// `CudaTuning::mmvq_pipe` (the self-check's comparisons and benchmark);
    /// `None` goes back to the tuning's choice.
    pub(super) fn set_mmvq_pipe(&self, on: Option<bool>) {
        let on = on.unwrap_or(self.config.tuning.mmvq_pipe);
        self.mmvq_pipe.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// The integer GEMV of `w`'s block format on an input quantized by
    /// `q8_input`.
    pub(super) fn gemv_q8(
        &self,
        st: &mut State,
        x: Q8Input,
        w: &CudaWeight,
        rows: usize,
        out: &CudaAct,
    ) -> Result<()> {
        self.mmvq(st, x, &[(w, 0, out.ptr())], rows, None)
    }

    /// One launch of the integer GEMV of a block format (kernels/mmvq.cu
    /// `mmvq_body`) on an input quantized by `q8_input`: up to three matrices
    /// of that input, all of one format and width (`parts`), or with `glu`
    /// one gate matrix (`parts[0]`, its output the SiLU product) and its up
    /// matrix, the product also stored quantized to 8 bits in the scratch
    /// `x` is not in when `glu.1` and the columns are whole blocks of 32
    /// (then recorded in `State::xq_holds`). The instantiation for the
    /// smallest of 1, 2, 4, 8 rows that holds `rows`.
    pub(super) fn mmvq(
        &self,
        st: &mut State,
        x: Q8Input,
        parts: &[MvPart<'_>],
        rows: usize,
        glu: Option<(&CudaWeight, bool)>,
    ) -> Result<()> {
        let first = parts.first().ok_or_else(|| BackendError::Other("mmvq: no matrix".into()))?.0;
        let (dtype, k, row_bytes) = (first.dtype, first.cols, first.row_bytes);
        let set = mmvq_index(dtype)
            .ok_or_else(|| BackendError::Other(format!("mmvq: {dtype} has no integer GEMV")))?;
        let ups = glu.map(|(up, _)| up);
        let shapes_ok = parts.len() <= 3
            && parts
                .iter()
                .map(|p| p.0)
                .chain(ups)
                .all(|w| w.dtype == dtype && w.cols == k && w.row_bytes == row_bytes)
            && (glu.is_none() || (parts.len() == 1 && ups.is_some_and(|u| u.rows == first.rows)));
        if !shapes_ok || k != x.k || !(1..=GEMV_MAX_ROWS).contains(&rows) {
            return Err(BackendError::Other(format!(
                "mmvq: {rows} rows of {} columns against {} matrices of {dtype} (first {}x{k})",
                x.k,
                parts.len(),
                first.rows
            )));
        }
        let inst = rows.next_power_of_two().trailing_zeros() as usize;
        let pipe = rows == 1 && self.mmvq_pipe.load(std::sync::atomic::Ordering::Relaxed);
        let kern = self.k.mmvq[set][if pipe { MMVQ_PIPE } else { inst }];
        let (nw, max) = (MMVQ_NW[inst], MMVQ_MAX_GROUPS[inst]);
        let chosen = self.mmvq_groups.load(std::sync::atomic::Ordering::Relaxed);
        let resident = kern.per_sm * self.sm_count;
        // The SiLU product quantized: each block then owns whole blocks of 32 columns.
        let product = match glu {
            Some((_, true)) if first.rows.is_multiple_of(32) && 2 * (32 / nw) <= max => {
                let other = usize::from(st.xq[0].as_ref().is_some_and(|b| b.ptr() == x.codes));
                let q = self.q8_scratch(st, other, rows, first.rows)?;
                st.xq_holds = Some(Q8View { buf: other, ptr: parts[0].2, rows, cols: first.rows });
                Some(q)
            }
            _ => None,
        };
        let groups = match (glu, product) {
            (_, Some(_)) => 32 / nw,
            (Some(_), None) if chosen > 0 => chosen.min(max / 2),
            (Some(_), None) => mmvq_groups(first.rows.div_ceil(nw), resident, max / 2),
            (None, _) if chosen > 0 => chosen.min(max),
            (None, _) => mmvq_groups(parts.iter().map(|p| p.0.rows.div_ceil(nw)).sum(), resident, max),
        };
        let blocks: usize = parts.iter().map(|p| p.0.rows.div_ceil(nw * groups)).sum();
        let dims = LaunchDims { grid: (blocks as u32, 1, 1), block: 32 * MMVQ_WARPS };
        let at = |i: usize| parts.get(i);
        let mut a = Args::new();
        for i in 0..3 {
            a = a.ptr(match (i, at(i), ups) {
                (1, _, Some(up)) => up.ptr(),
                (_, Some(p), _) => p.0.ptr(),
                _ => 0,
            });
        }
        for i in 0..3 {
            a = a.ptr(at(i).map_or(0, |p| p.2));
        }
        for i in 0..3 {
            a = a.ptr(at(i).map_or(0, |p| p.1));
        }
        for i in 0..3 {
            a = a.i32(at(i).map_or(0, |p| p.0.rows) as i32);
        }
        let a = a.i64(row_bytes as i64).ptr(x.codes).ptr(x.scales).i32(k as i32).i32(rows as i32);
        let a = a.i32(groups as i32).i32(i32::from(glu.is_some()));
        let a = a.ptr(product.map_or(0, |q| q.codes)).ptr(product.map_or(0, |q| q.scales));
        let a = a.i32(self.early_weights());
        unsafe { self.launch(kern.k, dims, a) }
    }

    /// The tensor-core matmul of a block-format weight (kernels/mmq.cu): the
    /// input rows rounded to bf16 in the scratch, then one launch of the
    /// instantiation whose group of 8, 16, 32 or 64 rows holds them (groups
    /// of 64 side by side past that), K split into slices when the blocks
    /// would not fill the card (the slices' partial sums go to the
    /// dequantization tile and `mmq_reduce` adds them).
    pub(super) fn mmq(
        &self,
        st: &mut State,
        x: &CudaAct,
        w: &CudaWeight,
        rows: usize,
        out: &CudaAct,
    ) -> Result<()> {
        let (n, k) = (w.rows, w.cols);
        let part = st.tile.as_ref().map(|t| (t.ptr(), t.bytes().0 as usize)).unwrap_or((0, 0));
        let MmqLaunch { kern, groups, tiles, slices, kslice, .. } = self.mmq_launch(w, rows, part.1)?;
        let xbf = self.bf16_input(st, x, rows)?;
        let dims = LaunchDims { grid: (tiles as u32, slices as u32, 1), block: MMQ_THREADS };
        let dst = if slices > 1 { part.0 } else { out.ptr() };
        let a = Args::new().ptr(w.ptr()).i64(w.row_bytes as i64).ptr(xbf).ptr(dst);
        let a = a.i32(n as i32).i32(k as i32).i32(rows as i32).i32(kslice as i32).i32(groups as i32);
        unsafe { self.launch_shared(kern.k, dims, kern.shared, a)? };
        if slices > 1 {
            let len = rows * n;
            let a = Args::new().ptr(part.0).ptr(out.ptr()).i32(slices as i32).i64(len as i64);
            unsafe { self.launch(self.k.mmq_reduce, grid_for(len, 256), a)? };
        }
        Ok(())
    }

    /// How [`CudaBackend::mmq`] launches for `rows` rows of `w`, with
    /// `part_bytes` of scratch for the slices' partial sums.
    pub(super) fn mmq_launch(&self, w: &CudaWeight, rows: usize, part_bytes: usize) -> Result<MmqLaunch> {
        let set = &self.k.mmq[mmq_index(w.dtype)
            .ok_or_else(|| BackendError::Other(format!("mmq: {} is not a block format", w.dtype)))?];
        let (inst, groups) = mmq_shape(rows, |i| set[i].is_some())
            .ok_or_else(|| BackendError::Other(format!("mmq: no {} kernel fits this card", w.dtype)))?;
        let kern = set[inst].ok_or_else(|| BackendError::Other("mmq: kernel table".into()))?;
        let tiles = w.rows.div_ceil(MMQ_BN) * groups;
        let (slices, kslice) =
            mmq_split(tiles, w.cols, rows * w.rows, kern.per_sm * self.sm_count, part_bytes);
        Ok(MmqLaunch { kern, groups, group_rows: 8 * MMQ_TILES[inst], tiles, slices, kslice })
    }

    /// `rows` rows of `x` rounded to bf16 in the scratch (`[rows, x.cols]`);
    /// its pointer. Converted here unless the scratch already holds them
    /// (`State::xbf_holds`: the op that wrote `x` stored them, or a matmul of
    /// the same input converted them).
    pub(super) fn bf16_input(&self, st: &mut State, x: &CudaAct, rows: usize) -> Result<u64> {
        let k = x.cols;
        let xbf = st.xbf.as_ref().filter(|b| b.bytes().0 as usize >= rows * k * 2).ok_or_else(|| {
            BackendError::Other(format!(
                "matmul of {rows}x{k}: scratch not sized (allocate activations first)"
            ))
        })?;
        let xbf_ptr = xbf.ptr();
        if st.xbf_holds.is_some_and(|v| v.ptr == x.ptr() && v.cols == k && v.rows >= rows) {
            return Ok(xbf_ptr);
        }
        let total = rows * k;
        let a = Args::new().ptr(x.ptr()).ptr(xbf_ptr).i64(total as i64);
        unsafe { self.launch(self.k.f32_to_bf16_rows, grid_for(total, 256), a)? };
        st.xbf_holds = Some(XbfView { ptr: x.ptr(), rows, cols: k });
        Ok(xbf_ptr)
    }

    /// Where an op that writes `rows` rows of `out` can also store them
    /// rounded to bf16 for the matmuls that read `out` next: the scratch's
    /// pointer, recorded in `State::xbf_holds`, or 0 (store nothing) when
    /// the rows are too few to take a bf16 input or the scratch too small.
    pub(super) fn bf16_output(&self, st: &mut State, out: &CudaAct, rows: usize) -> u64 {
        let bytes = rows * out.cols * 2;
        match st.xbf.as_ref() {
            Some(b) if rows >= MMQ_MIN_ROWS && b.bytes().0 as usize >= bytes && out.stride == out.cols => {
                st.xbf_holds = Some(XbfView { ptr: out.ptr(), rows, cols: out.cols });
                b.ptr()
            }
            _ => 0,
        }
    }

    /// A matmul op writes `outs`: if one of them is the activation `xbf` or
    /// one of `xq` holds, that copy is stale.
    pub(super) fn forget_written<'a>(&self, st: &mut State, outs: impl IntoIterator<Item = &'a CudaAct>) {
        let held = |ptr: u64, rows: usize, cols: usize| ptr..ptr + (rows * cols * 4) as u64;
        let xbf = st.xbf_holds.map(|v| held(v.ptr, v.rows, v.cols));
        let xq = st.xq_holds.map(|v| held(v.ptr, v.rows, v.cols));
        for o in outs {
            let len = (o.rows.max(1) * o.stride.max(o.cols) * 4) as u64;
            let hits = |h: &Option<std::ops::Range<u64>>| {
                h.as_ref().is_some_and(|h| o.ptr() < h.end && h.start < o.ptr() + len)
            };
            if hits(&xbf) {
                st.xbf_holds = None;
            }
            if hits(&xq) {
                st.xq_holds = None;
            }
        }
    }

    /// Whether the tensor-core GEMV takes `rows` rows against `w` (bf16, k a
    /// multiple of 32). At 1 and 2 rows the per-row kernel is faster; at 3 and
    /// 4 rows it still is on narrow matrices (1024 rows: the tensor-core
    /// kernel's 16-row blocks are too few to fill the card).
    pub(super) fn takes_gemv_tc(&self, w: &CudaWeight, rows: usize) -> bool {
        let shape_ok = w.dtype == DType::BF16 && w.cols.is_multiple_of(32);
        shape_ok && (3..=GEMV_MAX_ROWS).contains(&rows) && (rows > 4 || w.rows >= GEMV_TC_MIN_N)
    }

    /// The tensor-core GEMV (kernels/gemv.cu `gemv_bf16_tc`): 16 weight rows per block.
    pub(super) fn gemv_tc(&self, x: &CudaAct, w: &CudaWeight, rows: usize, out: &CudaAct) -> Result<()> {
        let (n, k) = (w.rows, w.cols);
        let dims = LaunchDims { grid: (n.div_ceil(16) as u32, 1, 1), block: 32 * GEMV_TC_WARPS };
        let a = Args::new().ptr(w.ptr()).ptr(x.ptr()).ptr(out.ptr()).i32(n as i32).i32(k as i32);
        let a = a.i32(rows as i32).i32(self.early_weights());
        unsafe { self.launch(self.k.gemv_bf16_tc, dims, a) }
    }

    /// The `early` argument of the bf16 GEMVs: 1 when a kernel launched ahead
    /// of its time (programmatic dependent launch) issues its first weight
    /// loads before it waits for the kernel ahead (`CudaTuning::early_weights`).
    pub(super) fn early_weights(&self) -> i32 {
        i32::from(self.pdl && self.config.tuning.early_weights)
    }

    /// Decode rows (at most `GEMV_MAX_ROWS`): the GEMV kernels read each weight byte once.
    pub(super) fn gemv(&self, x: &CudaAct, w: &CudaWeight, rows: usize, out: &CudaAct) -> Result<()> {
        if self.takes_gemv_tc(w, rows) {
            return self.gemv_tc(x, w, rows, out);
        }
        self.gemv_simt(x, w, rows, out)
    }

    /// The per-row GEMV kernels: f32 FMAs, for every storage type.
    pub(super) fn gemv_simt(&self, x: &CudaAct, w: &CudaWeight, rows: usize, out: &CudaAct) -> Result<()> {
        let (n, k) = (w.rows, w.cols);
        // The instantiation for the smallest power of two >= rows (1, 2, 4, 8).
        // bf16 with 16-byte loads: rows of whole 8-element chunks (the arena keeps 256-byte alignment).
        if w.dtype == DType::BF16 && k % 8 == 0 {
            return self.gemv_bf16_parts(x, &[(w, 0, out.ptr())], rows, None);
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

    /// Whether one row against matrices of `n` rows in all (one launch)
    /// takes blocks of two weight rows rather than of four.
    pub(super) fn gemv_narrow_r1(&self, n: &[usize]) -> bool {
        let blocks_of = |nw: usize| -> usize { n.iter().map(|n| n.div_ceil(nw)).sum() };
        self.gemv_narrow.load(std::sync::atomic::Ordering::Relaxed)
            && two_row_blocks(
                blocks_of(GEMV_NW),
                blocks_of(2),
                self.sm_count * 8,
                self.config.tuning.gemv_fill,
            )
    }

    /// Up to three bf16 matrices of one input in one launch of the per-row
    /// kernel (`gemv_bf16_r*`): each part is (weight, bias pointer or 0,
    /// output pointer). The weights share `x`'s width, a multiple of 8.
    /// With `fold` (one row), `x` is that folded norm's activation: the
    /// kernel reads its `x * w` and finishes the norm (`fold.rs`).
    pub(super) fn gemv_bf16_parts(
        &self,
        x: &CudaAct,
        parts: &[(&CudaWeight, u64, u64)],
        rows: usize,
        fold: Option<&FoldNorm>,
    ) -> Result<()> {
        debug_assert!((1..=3).contains(&parts.len()) && (1..=GEMV_MAX_ROWS).contains(&rows));
        debug_assert!(fold.is_none() || rows == 1);
        let inst = rows.next_power_of_two().trailing_zeros() as usize;
        let (mut w, mut o, mut b, mut n) = ([0u64; 3], [0u64; 3], [0u64; 3], [0usize; 3]);
        for (i, (wt, bias, out)) in parts.iter().enumerate() {
            (w[i], b[i], o[i], n[i]) = (wt.ptr(), *bias, *out, wt.rows);
        }
        let narrow = rows == 1 && self.gemv_narrow_r1(&n);
        let (kernel, nw) = match (narrow, fold) {
            (false, None) => (self.k.gemv_bf16[inst], GEMV_NW),
            (true, None) => (self.k.gemv_bf16_r1_nw2, 2),
            (false, Some(_)) => (self.k.gemv_bf16_fold[0], GEMV_NW),
            (true, Some(_)) => (self.k.gemv_bf16_fold[1], 2),
        };
        let blocks: usize = n.iter().map(|n| n.div_ceil(nw)).sum();
        let dims = LaunchDims { grid: (blocks as u32, 1, 1), block: 32 * GEMV_WARPS };
        let mut a = Args::new();
        for p in w.iter().chain(&o).chain(&b) {
            a = a.ptr(*p);
        }
        for n in n {
            a = a.i32(n as i32);
        }
        let a = match fold {
            None => a.ptr(x.ptr()).i32(x.cols as i32).i32(rows as i32),
            Some(f) => f.consumer_args(a.ptr(f.hw).i32(x.cols as i32)),
        };
        let a = a.i32(self.early_weights());
        unsafe { self.launch(kernel, dims, a) }
    }

    /// Whether `rows` rows against bf16 `w` take the per-row kernel, the one
    /// the fused launches extend (1 and 2 rows, 16-byte rows).
    pub(super) fn fusable_gemv(&self, x: &CudaAct, w: &CudaWeight, rows: usize) -> bool {
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
    pub(super) fn gemv_general(&self, x: &CudaAct, w: &CudaWeight, rows: usize, out: &CudaAct) -> Result<()> {
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
    pub(super) fn matmul_lt(
        &self,
        st: &mut State,
        x: &CudaAct,
        w: &CudaWeight,
        rows: usize,
        out: &CudaAct,
    ) -> Result<()> {
        let (n, k) = (w.rows, w.cols);
        let xbf_ptr = self.bf16_input(st, x, rows)?;
        if w.dtype == DType::BF16 {
            let s = GemmShape { m: rows, n, k, ldc: n };
            return st.gemm.matmul(self.stream, s, xbf_ptr, w.ptr(), out.ptr());
        }
        let tile = st
            .tile
            .as_ref()
            .ok_or_else(|| BackendError::Other("dequantization tile not allocated".into()))?;
        let (tile_ptr, tile_rows) = (tile.ptr(), (tile.bytes().0 as usize / (k * 2)).max(1));
        // Block formats with whole 32-weight groups widen a group per thread (blocks.cu).
        let (widen, block) = if w.dtype.is_quantized() && k.is_multiple_of(32) {
            (self.k.dequant_rows32, 128)
        } else {
            (self.k.dequant_rows, 256)
        };
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
            unsafe { self.launch(widen, LaunchDims { grid: (nb as u32, 1, 1), block }, a)? };
            let s = GemmShape { m: rows, n: nb, k, ldc: n };
            st.gemm.matmul(self.stream, s, xbf_ptr, tile_ptr, out.ptr() + (j0 * 4) as u64)?;
            j0 += nb;
        }
        Ok(())
    }

    pub(super) fn vector_ptr(&self, w: &CudaWeight, what: &str) -> Result<u64> {
        if w.dtype != DType::F32 || w.rows != 1 {
            return Err(BackendError::Other(format!(
                "{what}: expected an f32 vector weight, got {} {}x{}",
                w.dtype, w.rows, w.cols
            )));
        }
        Ok(w.ptr())
    }

    pub(super) fn enqueue_matmul(
        &self,
        x: &CudaAct,
        w: &CudaWeight,
        bias: Option<&CudaWeight>,
        rows: usize,
        out: &mut CudaAct,
    ) {
        // (The switch first: with folds off no norm is left pending by a
        // producer, and a matmul takes no lock to look.)
        if rows == 1
            && bias.is_none()
            && out.cols == w.rows
            && self.fold_norm.load(std::sync::atomic::Ordering::Relaxed)
            && self.fold_pending_for(x)
            && self.fusable_gemv(x, w, rows)
        {
            // The consumer of a folded norm (a MoE layer's router).
            return self.op_fold("matmul (folded norm)", x, rows, |st, fold| {
                self.forget_written(st, [&*out]);
                self.gemv_bf16_parts(x, &[(w, 0, out.ptr())], rows, fold.as_ref())
            });
        }
        self.matmul_op(format_args!("matmul {}x{} {}", w.rows, w.cols, w.dtype), |st| {
            if x.cols != w.cols || out.cols != w.rows {
                return Err(BackendError::Other(format!(
                    "matmul: x has {} columns, weight is {}x{}, out has {} columns",
                    x.cols, w.rows, w.cols, out.cols
                )));
            }
            let r = self.matmul_inner(st, x, w, rows, out);
            self.forget_written(st, [&*out]);
            r?;
            match bias {
                Some(b) => self.add_bias(out, b, rows),
                None => Ok(()),
            }
        })
    }

    /// `out[r] += bias` for the first `rows` rows.
    fn add_bias(&self, out: &CudaAct, bias: &CudaWeight, rows: usize) -> Result<()> {
        let bp = self.vector_ptr(bias, "bias")?;
        let n = rows * out.cols;
        let a = Args::new().ptr(out.ptr()).ptr(bp).i32(out.cols as i32).i64(n as i64);
        unsafe { self.launch(self.k.add_bias, grid_for(n, 256), a) }
    }

    /// Whether every weight of `ws` takes the integer GEMV on `rows` rows of
    /// `x` (with a matching shape), so their matmuls can share one 8-bit copy
    /// of the input: a layer's q/k/v, its gate and up.
    fn share_q8_input<'w>(
        &self,
        x: &CudaAct,
        ws: impl ExactSizeIterator<Item = (&'w CudaWeight, usize)>,
        rows: usize,
    ) -> bool {
        let mut ws = ws;
        ws.len() > 1
            && ws.all(|(w, out_cols)| w.cols == x.cols && out_cols == w.rows && self.takes_q8_gemv(w, rows))
    }

    /// Whether `ws` (in order) lie one after another in device memory as
    /// bf16 rows of `x`'s width, each taking cuBLASLt on `rows` rows, so one
    /// GEMM over them stacked computes every product: one launch (and one
    /// split-K reduction, where the heuristic splits) where there were one
    /// per weight. Every width a multiple of 4 (the split and SiLU kernels
    /// move four columns a thread).
    fn stacked_lt(&self, x: &CudaAct, ws: &[&CudaWeight], rows: usize) -> bool {
        self.config.tuning.fuse
            && ws.len() > 1
            && ws.iter().all(|w| {
                w.dtype == DType::BF16
                    && w.cols == x.cols
                    && w.rows.is_multiple_of(4)
                    && !self.takes_q8_gemv(w, rows)
                    && !self.takes_mmq(w, rows)
                    && !self.takes_gemv(w, rows)
            })
            && ws.windows(2).all(|p| p[0].ptr() + (p[0].rows * p[0].row_bytes) as u64 == p[1].ptr())
    }

    /// `rows` rows of `x` times the weights from `first` on, `n` stacked rows
    /// of them ([`CudaBackend::stacked_lt`]), into `out` as `[rows, n]`.
    fn stacked_gemm(
        &self,
        st: &mut State,
        x: &CudaAct,
        first: &CudaWeight,
        n: usize,
        rows: usize,
        out: u64,
    ) -> Result<()> {
        let xbf = self.bf16_input(st, x, rows)?;
        st.gemm.matmul(self.stream, GemmShape { m: rows, n, k: x.cols, ldc: n }, xbf, first.ptr(), out)
    }

    /// [`Backend::matmul_many`] of 2 or 3 parts as one GEMM of the stacked
    /// weights into `scratch`, then one launch that copies each part's
    /// columns out and adds its bias. False (nothing run) when the parts or
    /// the scratch do not allow it.
    fn matmul_many_stacked(
        &self,
        x: &CudaAct,
        parts: &mut [MatmulPart<'_, Self>],
        rows: usize,
        scratch: &mut CudaAct,
    ) -> bool {
        if !(2..=3).contains(&parts.len()) {
            return false;
        }
        let mut ws = [parts[0].w; 3];
        for (w, p) in ws.iter_mut().zip(parts.iter()) {
            *w = p.w;
        }
        let ws = &ws[..parts.len()];
        let n: usize = ws.iter().map(|w| w.rows).sum();
        let fits = scratch.stride == scratch.cols
            && scratch.rows * scratch.cols >= rows * n
            && parts.iter().all(|p| {
                p.out.cols == p.w.rows
                    && p.out.stride == p.out.cols
                    && p.bias.is_none_or(|b| b.dtype == DType::F32 && b.rows * b.cols == p.w.rows)
            });
        if !fits || !self.stacked_lt(x, ws, rows) {
            return false;
        }
        self.matmul_op("matmul_many (stacked)", |st| {
            self.forget_written(st, parts.iter().map(|p| &*p.out).chain([&*scratch]));
            self.stacked_gemm(st, x, parts[0].w, n, rows, scratch.ptr())?;
            let mut a = Args::new().ptr(scratch.ptr()).i32(n as i32).i32(rows as i32);
            for j in 0..3 {
                a = match parts.get(j) {
                    Some(p) => {
                        let bias = match p.bias {
                            Some(b) => self.vector_ptr(b, "bias")?,
                            None => 0,
                        };
                        a.ptr(p.out.ptr()).i32(p.w.rows as i32).ptr(bias)
                    }
                    None => a.ptr(0).i32(0).ptr(0),
                };
            }
            unsafe { self.launch(self.k.split_cols, grid_for(rows * n / 4, 256), a) }
        });
        true
    }

    pub(super) fn enqueue_matmul_many(
        &self,
        x: &CudaAct,
        parts: &mut [MatmulPart<'_, Self>],
        rows: usize,
        scratch: Option<&mut CudaAct>,
    ) {
        let fused = parts.len() <= 3
            && parts.iter().all(|p| p.out.cols == p.w.rows && self.fusable_gemv(x, p.w, rows))
            && parts
                .iter()
                .all(|p| p.bias.is_none_or(|b| b.dtype == DType::F32 && b.rows * b.cols == p.w.rows));
        if !fused && self.share_q8_input(x, parts.iter().map(|p| (p.w, p.out.cols)), rows) {
            // One quantization of the input for every part.
            return self.matmul_op("matmul_many (8-bit input)", |st| {
                self.forget_written(st, parts.iter().map(|p| &*p.out));
                let input = self.q8_input(st, x, rows)?;
                if self.config.tuning.fuse {
                    // One launch for each run of parts of one format (q and k
                    // Q4_K, v Q6_K in half the layers of a Q4_K_M file: two).
                    let mut v: Vec<MvPart<'_>> = Vec::with_capacity(3);
                    for p in parts.iter() {
                        let bias = match p.bias {
                            Some(b) if b.rows * b.cols == p.w.rows => self.vector_ptr(b, "bias")?,
                            Some(_) => {
                                return Err(BackendError::Other("matmul_many: bias of another width".into()))
                            }
                            None => 0,
                        };
                        if v.first().is_some_and(|f| f.0.dtype != p.w.dtype) {
                            self.mmvq(st, input, &v, rows, None)?;
                            v.clear();
                        }
                        v.push((p.w, bias, p.out.ptr()));
                    }
                    return self.mmvq(st, input, &v, rows, None);
                }
                for p in parts.iter() {
                    self.gemv_q8(st, input, p.w, rows, p.out)?;
                    if let Some(b) = p.bias {
                        self.add_bias(p.out, b, rows)?;
                    }
                }
                Ok(())
            });
        }
        if !fused {
            if scratch.is_some_and(|s| self.matmul_many_stacked(x, parts, rows, s)) {
                return;
            }
            return crate::unfused::matmul_many(self, x, parts, rows);
        }
        self.op_fold("matmul_many (q/k/v)", x, rows, |_, fold| {
            let mut v = Vec::with_capacity(3);
            for p in parts.iter() {
                let bias = match p.bias {
                    Some(b) => self.vector_ptr(b, "bias")?,
                    None => 0,
                };
                v.push((p.w, bias, p.out.ptr()));
            }
            self.gemv_bf16_parts(x, &v, rows, fold.as_ref())
        })
    }

    // The signature of `Backend::gate_up_silu`, which this implements.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn enqueue_gate_up_silu(
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
        if !fused && self.share_q8_input(x, [(gate, gate_out.cols), (up, up_out.cols)].into_iter(), rows) {
            if self.config.tuning.fuse
                && gate.dtype == up.dtype
                && gate.rows == up.rows
                && out.cols == gate.rows
            {
                // One launch: gate and up rows of the same columns and their
                // SiLU product. Not also the product quantized: that takes
                // blocks of whole 32-column groups (448 for Llama-3-8B, under
                // half the card's places), measured slower than blocks sized
                // to the card plus the quantization launch (H100, Q4_K, one
                // row: 50.3 against 45.6 µs for gate/up/SiLU and down;
                // `cuda_check --bench-q8-layer`).
                return self.matmul_op("gate_up_silu (8-bit input)", |st| {
                    self.forget_written(st, [&*gate_out, &*up_out, &*out]);
                    let input = self.q8_input(st, x, rows)?;
                    self.mmvq(st, input, &[(gate, 0, out.ptr())], rows, Some((up, false)))
                });
            }
            // One quantization of the input for both GEMVs, then the SiLU product.
            self.matmul_op("gate_up (8-bit input)", |st| {
                self.forget_written(st, [&*gate_out, &*up_out]);
                let input = self.q8_input(st, x, rows)?;
                self.gemv_q8(st, input, gate, rows, gate_out)?;
                self.gemv_q8(st, input, up, rows, up_out)
            });
            return crate::Backend::silu_mul(self, gate_out, up_out, rows, out);
        }
        // Stacked only past the GEMVs' rows, where it was measured faster (32
        // and 128 rows, BENCHMARKS.md); at 3 to 8 rows gate and up (large
        // enough for cuBLASLt there) stay two GEMMs until measured.
        if !fused
            && rows > GEMV_MAX_ROWS
            && gate.rows == up.rows
            && out.cols == gate.rows
            && out.stride == out.cols
            && gate_out.stride == gate_out.cols
            && gate_out.rows * gate_out.cols >= rows * 2 * gate.rows
            && self.stacked_lt(x, &[gate, up], rows)
        {
            // One GEMM of gate and up stacked, both halves of each row into
            // `gate_out`, then their SiLU product.
            return self.matmul_op("gate_up_silu (stacked)", |st| {
                self.forget_written(st, [&*gate_out, &*up_out, &*out]);
                let n = gate.rows;
                self.stacked_gemm(st, x, gate, 2 * n, rows, gate_out.ptr())?;
                let bf = self.bf16_output(st, out, rows);
                let a = Args::new().ptr(gate_out.ptr()).i32(2 * n as i32).i32(n as i32).i32(rows as i32);
                let a = a.ptr(out.ptr()).ptr(bf);
                unsafe { self.launch(self.k.silu_mul_stacked, grid_for(rows * n / 4, 256), a) }
            });
        }
        if !fused {
            return crate::unfused::gate_up_silu(self, x, gate, up, rows, gate_out, up_out, out);
        }
        self.op_fold("gate_up_silu", x, rows, |_, fold| self.gemv_glu(x, (gate, up), rows, out, fold))
    }
}

#[cfg(test)]
mod tests {
    use super::super::kernels::MMVQ_FORMATS;
    use super::*;

    /// Block formats with an integer GEMV take it, and an 8-bit input, up to
    /// `Q8_GEMV_MAX_ROWS` rows; past it, and for the formats without one,
    /// mmq's bf16 input; bf16 matrices keep their f32 GEMVs. Switched off,
    /// the formats fall back to mmq or their f32 GEMVs.
    #[test]
    fn decode_rows_of_block_formats_take_8_bit_inputs() {
        let on = CudaTuning::default();
        let off = CudaTuning { q8_gemv: false, ..on };
        for &d in &MMVQ_FORMATS {
            for rows in 1..=Q8_GEMV_MAX_ROWS {
                assert_eq!(rounds_matmul_input(d, 4096, 4096, rows), MatmulInput::Q8, "{d} {rows} rows");
            }
            for rows in Q8_GEMV_MAX_ROWS + 1..=GEMV_MAX_ROWS + 1 {
                assert_eq!(rounds_matmul_input(d, 4096, 4096, rows), MatmulInput::Bf16, "{d} {rows} rows");
            }
        }
        assert_eq!(rounds_matmul_input(DType::BF16, 4096, 4096, 1), MatmulInput::F32);
        assert_eq!(matmul_input(&off, DType::Q4_K, 4096, 4096, 1), MatmulInput::Bf16);
        assert_eq!(matmul_input(&off, DType::Q8_0, 4096, 4096, 2), MatmulInput::F32);
        assert_eq!(matmul_input(&off, DType::Q8_0, 4096, 4096, 3), MatmulInput::Bf16);
    }

    /// About one block per place on the card, never more groups than a
    /// block holds, at least one.
    #[test]
    fn integer_gemv_blocks_are_about_as_many_as_the_card_holds() {
        // Llama-3-8B at one row on 132 SMs x 8 blocks: gate/up's 7,168 row
        // pairs in 1,024 blocks of 7 groups; q/k/v's 3,072 in 1,024 of 3.
        assert_eq!(mmvq_groups(7168, 1056, 32), 7);
        // 132 SMs of 8 blocks: a 2048-row matrix (512 four-row blocks) is under half a wave.
        assert!(two_row_blocks(512, 1024, 1056, false));
        // A Llama-3-8B q/k/v (6,144 rows): 73% of two waves against 97% of three, with the rule only.
        assert!(!two_row_blocks(1536, 3072, 1056, false));
        assert!(two_row_blocks(1536, 3072, 1056, true));
        // 4,096 rows fill one wave either way (97%): four-row blocks stay.
        assert!(!two_row_blocks(1024, 2048, 1056, true));
        // Qwen3-30B-A3B's q/k/v (5,120 rows): 61% against 81%.
        assert!(two_row_blocks(1280, 2560, 1056, true));
        assert_eq!(mmvq_groups(3072, 1056, 32), 3);
        assert_eq!(mmvq_groups(10, 1056, 32), 1);
        assert_eq!(mmvq_groups(0, 1056, 32), 1);
        assert_eq!(mmvq_groups(1 << 20, 1056, 8), 8);
        assert_eq!(mmvq_groups(100, 0, 32), 32);
        for (wg, res) in [(7168, 1056), (2048, 1056), (777, 100)] {
            let g = mmvq_groups(wg, res, 32);
            assert!(wg.div_ceil(g) <= res && (g == 1 || wg.div_ceil(g - 1) > res), "{wg} over {res}: {g}");
        }
    }

    #[test]
    fn the_8_bit_scales_start_on_16_bytes_after_the_codes() {
        let l = q8_layout(3, 4128);
        assert_eq!(l.scales_at, (3 * 4128usize).next_multiple_of(16));
        assert_eq!(l.bytes, l.scales_at + 3 * 129 * 8);
        assert!(l.scales_at >= 3 * 4128 && l.scales_at.is_multiple_of(16));
    }

    /// The smallest group that holds the rows, groups of 64 side by side past
    /// 64 rows, and groups of the largest instantiation the card runs when
    /// the one wanted does not fit.
    #[test]
    fn mmq_groups_hold_every_row_with_the_kernels_the_card_runs() {
        let all = |_: usize| true;
        assert_eq!(mmq_shape(3, all), Some((0, 1)));
        assert_eq!(mmq_shape(8, all), Some((0, 1)));
        assert_eq!(mmq_shape(9, all), Some((1, 1)));
        assert_eq!(mmq_shape(33, all), Some((3, 1)));
        assert_eq!(mmq_shape(64, all), Some((3, 1)));
        assert_eq!(mmq_shape(65, all), Some((3, 2)));
        assert_eq!(mmq_shape(128, all), Some((3, 2)));
        assert_eq!(mmq_shape(129, all), Some((3, 3)));
        let no_64 = |i: usize| i < 3;
        assert_eq!(mmq_shape(40, no_64), Some((2, 2)));
        assert_eq!(mmq_shape(128, no_64), Some((2, 4)));
        assert_eq!(mmq_shape(16, no_64), Some((1, 1)));
        assert_eq!(mmq_shape(16, |_| false), None);
        for rows in 1..300 {
            let (i, groups) = mmq_shape(rows, no_64).unwrap();
            let per = 8 * MMQ_TILES[i];
            assert!(groups * per >= rows && (groups - 1) * per < rows, "{rows} rows: {groups} x {per}");
        }
    }

    /// K slices: whole super-blocks, at least two a slice, about one wave of
    /// blocks, no more partial sums than the scratch holds, and together
    /// exactly K.
    #[test]
    fn mmq_slices_cover_k_in_whole_super_blocks() {
        // 64 tiles, 264 resident blocks: 4 slices of 4 super-blocks.
        assert_eq!(mmq_split(64, 4096, 32 * 4096, 264, 32 << 20), (4, 1024));
        // 224 tiles, 396 resident: 2 slices.
        assert_eq!(mmq_split(224, 4096, 32 * 14336, 396, 32 << 20), (2, 2048));
        // As many tiles as fit: one slice.
        assert_eq!(mmq_split(448, 4096, 64 * 14336, 396, 32 << 20), (1, 4096));
        // The partial sums do not fit: one slice.
        assert_eq!(mmq_split(16, 4096, 128 * 1024, 1000, 128 * 1024 * 4), (1, 4096));
        // K of 32-weight blocks that are not whole super-blocks, or too short to split.
        assert_eq!(mmq_split(4, 4128, 8 * 64, 1000, 32 << 20), (1, 4128));
        assert_eq!(mmq_split(4, 256, 8 * 64, 1000, 32 << 20), (1, 256));
        for k in (512..=16384).step_by(256) {
            for tiles in [1, 16, 64, 224, 2004] {
                let (slices, kslice) = mmq_split(tiles, k, 1024, 2 * 132, 32 << 20);
                assert!(kslice.is_multiple_of(256) && kslice >= 512.min(k), "k {k}: {slices} x {kslice}");
                assert!(slices * kslice >= k && (slices - 1) * kslice < k, "k {k}: {slices} x {kslice}");
            }
        }
    }
}
