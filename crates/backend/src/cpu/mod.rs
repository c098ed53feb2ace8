//! The CPU backend: f32 compute over weights kept in their stored type.
//!
//! Weights in f32 are held as `Vec<f32>`; every other type (f16, bf16 and the
//! ggml block formats) stays packed, memory-mapped when the checkpoint was, and
//! is widened only inside the kernels: a row at a time for decode (`dot_row`),
//! a tile of rows at a time for prefill, where the tile feeds an f32 GEMM
//! (`gemm_task_cols` sizes it). Work is split over output columns, so every
//! thread streams a disjoint slice of the weights.

mod attend;
mod delta;
mod gemm;
mod pool;
pub mod quant;
pub mod tiles;

use crate::dtype::{DType, HostTensor, TensorBytes};
use crate::{
    ActShape, Backend, BackendError, DeltaRule, KvGeometry, MatmulPart, Result, RopeStyle, RopeTable, SeqStep,
};
use attend::{attend_group, AttnState, KvValue, ATTN_CHUNK};
use corridor_units::PageId;
use corridor_units::StateSlot;
use rayon::prelude::*;
use std::cell::RefCell;
use std::ops::Range;

/// Output rows (weight rows) per parallel task. Large enough that the per-task
/// overhead is amortized, small enough that 2–64 threads all get work.
const ROWS_PER_TASK: usize = 32;

/// Rows per task of a decode matmul's `n` rows: [`ROWS_PER_TASK`], or for a
/// tall matrix (an LM head of 49,152 rows is 1,536 such tasks) about eight
/// tasks a thread, up to 256 rows, so taking a task costs less than its rows.
/// Always a multiple of 32 (whole row tiles).
fn decode_task_rows(n: usize, threads: usize) -> usize {
    (n / (8 * threads.max(1))).next_multiple_of(ROWS_PER_TASK).clamp(ROWS_PER_TASK, 8 * ROWS_PER_TASK)
}

/// Up to this many rows, a matmul dots each weight row with every input row
/// (the weights are read once and widened in registers); above it, tiles of
/// weight rows are widened once into f32 and fed to a GEMM. Measured on
/// SmolLM2 Q4_1 at 8 concurrent requests with f32 activations: the GEMM path
/// gives 49.5 output tok/s where dotting 8 rows gives 32.7, so the switch
/// stays at 2 for the f32 dot.
const DOT_MAX_ROWS: usize = 2;

/// The same switch for a block format's weights against 8-bit activations
/// (`quant::dot_rows_q8`, each weight block read once for four activation
/// rows): above it the GEMM, whose cost is mostly widening the weights up to
/// a few dozen rows. Measured by `examples/cpu_matmul_cost.rs` (1536 × 576,
/// 2 threads, ms per matmul, 8-bit dot against GEMM): at 24 rows Q4_1 0.48
/// against 0.51, Q5_0 0.62 against 0.77, Q8_0 0.45 against 0.50 (and at
/// 1536 × 512 Q4_K 0.72 against 0.81, Q6_K 0.65 against 0.66); at 32 rows
/// about even, at 48 the GEMM ahead. Yet the switch stays at 8 until 8-bit
/// activations in wider steps (20 requests decoding, or a few prompt rows
/// beside a decode) are checked for quality: with 24, the default model's
/// replies to the README's request moved (its first token is a near tie that
/// the rounding decides, see `tests/e2e/test_new_user.py`), and whether they
/// got worse was not measured.
const Q8_DOT_MAX_ROWS: usize = 8;

/// What a matmul multiplies its weights with: its f32 input rows as they
/// are, rounded to bf16 (a bf16 tensor-core GEMM's operand), or quantized to
/// 8 bits per 32 ([`quant::Q8Row`]: an integer GEMV's, dotted with the
/// weight blocks as the CPU's decode does, [`DecodeActivations::Q8`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulInput {
    F32,
    Bf16,
    Q8,
}

/// How a matmul takes its input rows, given the weight's type as held (after
/// [`Bf16Rounding::weights`]), its `[n, k]` shape and the input rows: a
/// device's choice of kernel, which the device backend exposes (CUDA:
/// `cuda::rounds_matmul_input`). `Q8` only for a block format: no other
/// storage has an 8-bit dot product here.
pub type InputRounding = fn(dtype: DType, n: usize, k: usize, rows: usize) -> MatmulInput;

/// Roundings a device applies that the CPU can apply too, so the device can
/// be compared with the CPU arithmetic it should match rather than only with
/// exact f32: a model that amplifies rounding (the tiny Qwen3.5 hybrid does,
/// several times more than the dense fixtures) then still separates a wrong
/// kernel from a rounded one. Off by default; the CPU then computes as
/// always.
#[derive(Clone, Copy, Debug, Default)]
pub struct Bf16Rounding {
    /// Matrices stored in f32 or f16 are held rounded to bf16 (vectors stay
    /// as stored), as the CUDA backend holds them.
    pub weights: bool,
    /// Every K and V value is rounded to bf16 as it is written, as the CUDA
    /// KV cache stores it. (A mixture of experts picks its experts by
    /// comparing router logits; where two nearly tie, the rounding of the
    /// weights and the KV alone decides which expert a token gets, a
    /// difference no tolerance on the logits absorbs.)
    pub kv: bool,
    /// How each matmul takes its input (f32, rounded to bf16, or quantized
    /// to 8 bits), overriding [`DecodeActivations`]; when unset, decode
    /// follows it and every other matmul takes f32.
    pub inputs: Option<InputRounding>,
}

/// How decode (a matmul of at most `Q8_DOT_MAX_ROWS` rows) multiplies
/// block-format weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DecodeActivations {
    /// Quantize each activation row to 8 bits per 32 once per matmul and take
    /// integer dot products with the weight blocks ([`quant::Q8Row`]); the
    /// way llama.cpp computes, and the default.
    #[default]
    Q8,
    /// Keep the activations in f32 and dequantize the weights in registers:
    /// f32 arithmetic throughout, for comparing against f32 references.
    F32,
}

/// `v` rounded to the nearest bf16 (ties to even), back in f32.
fn round_bf16(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

/// The CPU backend. Threads come from rayon's global pool, which the binary
/// sizes once at start-up.
#[derive(Clone, Debug, Default)]
pub struct CpuBackend {
    /// Touch every page of the KV and activation buffers when they are
    /// allocated (see [`CpuBackend::resident`]).
    resident: bool,
    decode: DecodeActivations,
    rounding: Bf16Rounding,
    /// The GEMM's packed input rows, reused from matmul to matmul.
    packed: PackedRowsSlot,
    /// Keep every block-format weight in its stored rows, never in tiles of
    /// 16 rows ([`tiles`], where the CPU has AVX-512 VNNI).
    stored_rows: bool,
    /// How the KV cache stores K and V.
    kv: KvPrecision,
}

/// How the CPU's KV cache stores K and V.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvPrecision {
    /// f32: K and V exactly as computed (4 bytes a value).
    #[default]
    F32,
    /// f16 (2 bytes a value): twice the tokens in the same memory and half
    /// the bytes a decode step reads; values round to f16 and saturate at
    /// ±65504.
    F16,
}

impl KvPrecision {
    /// Bytes of one stored value.
    pub fn elem_bytes(self) -> u64 {
        match self {
            KvPrecision::F32 => 4,
            KvPrecision::F16 => 2,
        }
    }
}

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend::default()
    }
    /// A backend whose decode keeps activations as chosen.
    pub fn with_decode_activations(decode: DecodeActivations) -> Self {
        CpuBackend { decode, ..CpuBackend::default() }
    }

    /// This backend, rounding weights and matmul inputs to bf16 as `rounding` says.
    pub fn with_bf16_rounding(self, rounding: Bf16Rounding) -> Self {
        CpuBackend { rounding, ..self }
    }

    /// This backend with block-format weights in tiles of 16 rows where the
    /// CPU has AVX-512 VNNI (`true`, the default), or always in their stored
    /// rows (`false`: the AVX2 dots, for comparing the two).
    pub fn with_row_tiles(self, tiles: bool) -> Self {
        CpuBackend { stored_rows: !tiles, ..self }
    }

    /// This backend with its KV cache stored as `precision` says (f32 by
    /// default).
    pub fn with_kv_precision(self, kv: KvPrecision) -> Self {
        CpuBackend { kv, ..self }
    }

    /// A backend whose KV and activation buffers are resident from the start.
    /// A zeroed allocation is mapped lazily by the OS (and a KV store's blocks
    /// are allocated only when first written), so until then the host's books
    /// (which count it as held) and the process's resident memory disagree,
    /// and the host's free memory still offers it to others. On the host card
    /// the buffers are the card's memory, so they are made real at once; on
    /// sim cards (whose memory is simulated, and whose KV id space may be far
    /// larger than the host) they are left lazy.
    pub fn resident() -> Self {
        CpuBackend { resident: true, ..CpuBackend::default() }
    }

    /// How a matmul of `rows` rows against `w` takes its input: as
    /// [`Bf16Rounding::inputs`] says when it is set (a device's rule),
    /// otherwise quantized to 8 bits for decode over a block format under
    /// [`DecodeActivations::Q8`], and f32 for everything else.
    fn matmul_input(&self, w: &CpuWeight, rows: usize) -> MatmulInput {
        let (n, k) = w.shape();
        let decode_q8 = self.decode == DecodeActivations::Q8 && rows <= Q8_DOT_MAX_ROWS;
        let input = match self.rounding.inputs {
            Some(rule) => rule(w.dtype(), n, k, rows),
            None if decode_q8 && w.block_dtype().is_some() => MatmulInput::Q8,
            None => MatmulInput::F32,
        };
        assert!(
            input != MatmulInput::Q8 || w.block_dtype().is_some(),
            "a {} weight has no 8-bit dot product (the input rule asked for one)",
            w.dtype()
        );
        input
    }

    fn zeroed(&self, n: usize) -> Vec<f32> {
        let mut v = vec![0.0f32; n];
        if self.resident {
            touch_pages(&mut v);
        }
        v
    }

    /// A K or V value as this backend stores it: rounded to bf16 first where
    /// [`Bf16Rounding::kv`] says, then in the store's type.
    fn kv_value<T: KvValue>(&self, x: f32) -> T {
        T::of(if self.rounding.kv { round_bf16(x) } else { x })
    }

    /// [`Backend::write_kv`] into a store of `T`.
    fn write_kv_in<T: KvValue>(&self, kv: &mut Paged<T>, k: &CpuAct, v: &CpuAct, seqs: &[SeqStep<'_>]) {
        let g = kv.geometry;
        for s in seqs {
            for i in 0..s.rows {
                let pos = s.cached + i;
                let (kd, vd) = kv.token_mut(s.pages[pos / g.page_size.get()], pos % g.page_size.get());
                for (d, &x) in kd.iter_mut().zip(k.row(s.row_start + i)) {
                    *d = self.kv_value(x);
                }
                for (d, &x) in vd.iter_mut().zip(v.row(s.row_start + i)) {
                    *d = self.kv_value(x);
                }
            }
        }
    }

    /// [`Backend::attention`] over a store of `T`.
    fn attention_in<T: KvValue>(
        &self,
        q: &CpuAct,
        kv: &Paged<T>,
        heads: usize,
        seqs: &[SeqStep<'_>],
        out: &mut CpuAct,
    ) {
        let g = kv.geometry;
        let hd = g.head_dim;
        let group = heads / g.kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let cols = q.cols;
        let rows: Vec<(usize, usize)> =
            seqs.iter().enumerate().flat_map(|(si, s)| (0..s.rows).map(move |i| (si, i))).collect();
        let optr = SendPtr(out.data.as_mut_ptr());
        // Row i of sequence si's query.
        let q_row = |si: usize, i: usize| q.row(seqs[si].row_start + i);
        let write = |si: usize, i: usize, h: usize, state: &AttnState| {
            let r = seqs[si].row_start + i;
            // SAFETY: row r, head h columns are written by one task only.
            let o = unsafe { std::slice::from_raw_parts_mut(optr.get().add(r * cols + h * hd), hd) };
            state.finish(o);
        };
        let chunks = |si: usize, i: usize| (seqs[si].cached + i + 1).div_ceil(ATTN_CHUNK);
        let span = |si: usize, i: usize, c: usize| {
            (c * ATTN_CHUNK, ((c + 1) * ATTN_CHUNK).min(seqs[si].cached + i + 1))
        };
        if rows.len() > ATTN_SPLIT_MAX_ROWS {
            // A task per block of a sequence's consecutive rows and KV head: a
            // slice's K and V rows are found once for the block and stay in
            // cache while every row's query heads of the group go over them.
            // Each row folds the same slices in the same order as alone.
            let blocks: Vec<(usize, usize, usize)> = seqs
                .iter()
                .enumerate()
                .flat_map(|(si, s)| {
                    (0..s.rows)
                        .step_by(ATTN_ROW_BLOCK)
                        .map(move |i| (si, i, (i + ATTN_ROW_BLOCK).min(s.rows)))
                })
                .collect();
            pool::for_each(blocks.len() * g.kv_heads, |w| {
                let ((si, i0, i1), kvh) = (blocks[w / g.kv_heads], w % g.kv_heads);
                let mut states: Vec<AttnState> = (0..(i1 - i0) * group).map(|_| AttnState::new(hd)).collect();
                let (mut keys, mut values) = ([&[][..]; ATTN_CHUNK], [&[][..]; ATTN_CHUNK]);
                // f16 K and V: each slice widened once for every row and
                // query head of the block (one conversion a value, not one a
                // row and head); exact, so the same bits as widening in the kernel.
                let mut wide = if T::F16 { vec![0f32; 2 * ATTN_CHUNK * hd] } else { Vec::new() };
                for c in 0..chunks(si, i1 - 1) {
                    // The last row's span is the longest; the others read a prefix of it.
                    let (t0, t1) = span(si, i1 - 1, c);
                    kv.gather(seqs[si].pages, kvh * hd..(kvh + 1) * hd, t0..t1, &mut keys, &mut values);
                    let (mut wkeys, mut wvalues) = ([&[][..]; ATTN_CHUNK], [&[][..]; ATTN_CHUNK]);
                    if T::F16 {
                        let (wk, wv) = wide.split_at_mut(ATTN_CHUNK * hd);
                        for t in 0..t1 - t0 {
                            attend::widen(keys[t], &mut wk[t * hd..(t + 1) * hd]);
                            attend::widen(values[t], &mut wv[t * hd..(t + 1) * hd]);
                        }
                        let (wk, wv) = wide.split_at(ATTN_CHUNK * hd);
                        for t in 0..t1 - t0 {
                            (wkeys[t], wvalues[t]) = (&wk[t * hd..(t + 1) * hd], &wv[t * hd..(t + 1) * hd]);
                        }
                    }
                    for i in i0..i1 {
                        if c < chunks(si, i) {
                            let n = span(si, i, c).1 - t0;
                            let st = &mut states[(i - i0) * group..(i - i0 + 1) * group];
                            let (row, heads) = (q_row(si, i), (kvh * group, hd));
                            if T::F16 {
                                attend_query_heads(row, heads, scale, st, &wkeys[..n], &wvalues[..n]);
                            } else {
                                attend_query_heads(row, heads, scale, st, &keys[..n], &values[..n]);
                            }
                        }
                    }
                }
                for i in i0..i1 {
                    for j in 0..group {
                        write(si, i, kvh * group + j, &states[(i - i0) * group + j]);
                    }
                }
            });
            return;
        }
        // Few rows (decode): one task per (row, KV head, chunk of the
        // context), its query heads together, so 3 KV heads still fill every
        // thread; the chunks' states meet in chunk order, the same merges as
        // above, so the result is the same.
        let mut tasks: Vec<(usize, usize, usize)> = Vec::new();
        for (ri, &(si, i)) in rows.iter().enumerate() {
            for kvh in 0..g.kv_heads {
                tasks.extend((0..chunks(si, i)).map(|c| (ri, kvh, c)));
            }
        }
        // Each task's states as (m, l, o) in its own stretch of one buffer:
        // no allocation a task (a 2k context is 192 tasks a layer).
        let part = hd + 2;
        let mut parts = vec![0f32; tasks.len() * group * part];
        let pptr = SendPtr(parts.as_mut_ptr());
        pool::for_each(tasks.len(), |w| {
            let (ri, kvh, c) = tasks[w];
            let (si, i) = rows[ri];
            let (t0, t1) = span(si, i, c);
            let (mut keys, mut values) = ([&[][..]; ATTN_CHUNK], [&[][..]; ATTN_CHUNK]);
            kv.gather(seqs[si].pages, kvh * hd..(kvh + 1) * hd, t0..t1, &mut keys, &mut values);
            let n = t1 - t0;
            with_fresh_states(group, hd, |states| {
                attend_query_heads(q_row(si, i), (kvh * group, hd), scale, states, &keys[..n], &values[..n]);
                // SAFETY: task w alone writes its stretch of `parts`.
                let out =
                    unsafe { std::slice::from_raw_parts_mut(pptr.get().add(w * group * part), group * part) };
                for (s, o) in states.iter().zip(out.chunks_exact_mut(part)) {
                    (o[0], o[1]) = (s.m, s.l);
                    o[2..].copy_from_slice(&s.o);
                }
            });
        });
        // Each (row, query head) folds its chunks' states in chunk order, a
        // task per pair: the merges of a long context are no serial tail.
        let mut runs: Vec<Range<usize>> = Vec::new();
        for w in 0..tasks.len() {
            match runs.last_mut() {
                Some(r) if tasks[r.start].0 == tasks[w].0 && tasks[r.start].1 == tasks[w].1 => r.end = w + 1,
                _ => runs.push(w..w + 1),
            }
        }
        pool::for_each(runs.len() * group, |u| {
            let (run, j) = (runs[u / group].clone(), u % group);
            let (ri, kvh, _) = tasks[run.start];
            let (si, i) = rows[ri];
            with_fresh_states(1, hd, |state| {
                for w in run {
                    let p = &parts[(w * group + j) * part..(w * group + j + 1) * part];
                    state[0].merge(p[0], p[1], &p[2..]);
                }
                write(si, i, kvh * group + j, &state[0]);
            });
        });
    }
}

/// The query heads `h0..` of one row (`q_row`, one head of `hd` values per
/// state, all of one KV head) over a slice's K and V rows, folded into `states`.
fn attend_query_heads<U: KvValue>(
    q_row: &[f32],
    (h0, hd): (usize, usize),
    scale: f32,
    states: &mut [AttnState],
    keys: &[&[U]],
    values: &[&[U]],
) {
    let qs = &q_row[h0 * hd..(h0 + states.len()) * hd];
    with_scratch(hd, |buf| attend_group(qs, keys, values, scale, buf, states));
}

/// Reads one byte in every 4 KiB page of a mapped file, so each page is in
/// memory now; volatile so the reads are not dropped as unused.
fn read_pages(bytes: &[u8]) {
    bytes.par_chunks(4096 * 256).for_each(|chunk| {
        for i in (0..chunk.len()).step_by(4096) {
            // SAFETY: `i` is in bounds of `chunk`.
            unsafe { std::ptr::read_volatile(chunk.as_ptr().add(i)) };
        }
    });
}

/// Writes one element in every 4 KiB page, so each page is backed now. The
/// writes are volatile: zeros over zeroed memory are otherwise removed as
/// redundant, and the pages would stay unbacked.
fn touch_pages<T: Copy + Default + Send>(v: &mut [T]) {
    let per_page = (4096 / std::mem::size_of::<T>()).max(1);
    v.par_chunks_mut(per_page * 256).for_each(|chunk| {
        for i in (0..chunk.len()).step_by(per_page) {
            // SAFETY: `i` is in bounds of `chunk`.
            unsafe { std::ptr::write_volatile(chunk.as_mut_ptr().add(i), T::default()) };
        }
    });
}

/// An activation matrix: `rows × cols` f32, row-major, with a fixed capacity.
#[derive(Clone, Debug)]
pub struct CpuAct {
    data: Vec<f32>, // [rows, cols]
    rows: usize,
    cols: usize,
}

impl CpuAct {
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
    pub fn row_mut(&mut self, r: usize) -> &mut [f32] {
        &mut self.data[r * self.cols..(r + 1) * self.cols]
    }
    /// The first `rows` rows as one slice.
    pub fn live(&self, rows: usize) -> &[f32] {
        &self.data[..rows * self.cols]
    }
    pub fn live_mut(&mut self, rows: usize) -> &mut [f32] {
        &mut self.data[..rows * self.cols]
    }
}

/// A weight matrix `[rows, cols]` (a vector is one row).
pub enum CpuWeight {
    F32 {
        data: Vec<f32>,
        rows: usize,
        cols: usize,
    },
    /// f16, bf16 or a ggml block type, kept as stored.
    Packed {
        dtype: DType,
        bytes: TensorBytes,
        rows: usize,
        cols: usize,
        row_bytes: usize,
    },
    /// A block format repacked in tiles of 16 rows for the AVX-512 VNNI
    /// dots (see [`tiles`]): the same bytes, rearranged.
    Tiled(tiles::RowTiles),
}

impl CpuWeight {
    pub fn shape(&self) -> (usize, usize) {
        match self {
            CpuWeight::F32 { rows, cols, .. } | CpuWeight::Packed { rows, cols, .. } => (*rows, *cols),
            CpuWeight::Tiled(t) => t.shape(),
        }
    }
    /// The type the weight is held in.
    pub fn dtype(&self) -> DType {
        match self {
            CpuWeight::F32 { .. } => DType::F32,
            CpuWeight::Packed { dtype, .. } => *dtype,
            CpuWeight::Tiled(t) => t.dtype(),
        }
    }
    /// The weights as f32 (only for vectors and small tables: norms, biases).
    fn vector(&self) -> std::borrow::Cow<'_, [f32]> {
        match self {
            CpuWeight::F32 { data, .. } => std::borrow::Cow::Borrowed(data),
            CpuWeight::Packed { .. } | CpuWeight::Tiled(_) => {
                let (rows, cols) = self.shape();
                let mut out = vec![0f32; rows * cols];
                for (r, o) in out.chunks_mut(cols).enumerate() {
                    self.dequantize_into(r, o);
                }
                std::borrow::Cow::Owned(out)
            }
        }
    }
    fn dequantize_into(&self, r: usize, out: &mut [f32]) {
        match self {
            CpuWeight::F32 { data, cols, .. } => out.copy_from_slice(&data[r * cols..(r + 1) * cols]),
            CpuWeight::Packed { dtype, bytes, row_bytes, .. } => {
                quant::dequantize_row(*dtype, &bytes.bytes()[r * row_bytes..(r + 1) * row_bytes], out)
            }
            CpuWeight::Tiled(t) => t.dequantize_row(r, out),
        }
    }
    /// The block format of a packed block-quantized weight.
    fn block_dtype(&self) -> Option<DType> {
        match self {
            CpuWeight::Packed { dtype, .. } if dtype.is_quantized() => Some(*dtype),
            CpuWeight::Tiled(t) => Some(t.dtype()),
            _ => None,
        }
    }
    /// Rows `r0..` (as many as `out` holds, `xs.len()` values each) dotted
    /// with each Q8 activation row of `xs`, into `out` (row-major by weight row).
    fn dot_q8_many(&self, r0: usize, xs: &[quant::Q8Row], out: &mut [f32]) {
        match self {
            CpuWeight::Packed { dtype, bytes, row_bytes, .. } => {
                quant::dot_many_rows_q8(*dtype, &bytes.bytes()[r0 * row_bytes..], *row_bytes, xs, out)
            }
            CpuWeight::Tiled(t) => t.dot_many(r0, xs, out),
            CpuWeight::F32 { .. } => unreachable!("f32 weights are not dotted with Q8 rows"),
        }
    }
    fn dot(&self, r: usize, x: &[f32]) -> f32 {
        match self {
            CpuWeight::F32 { data, cols, .. } => quant::dot_f32(&data[r * cols..(r + 1) * cols], x),
            CpuWeight::Packed { dtype, bytes, row_bytes, .. } => {
                quant::dot_row(*dtype, &bytes.bytes()[r * row_bytes..(r + 1) * row_bytes], x)
            }
            // f32 activations against tiles (a reference mode, not decode's
            // path): the stored row again, dotted as a stored row is.
            CpuWeight::Tiled(t) => {
                thread_local!(static ROW: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) });
                ROW.with_borrow_mut(|row| {
                    t.stored_row(r, row);
                    quant::dot_row(t.dtype(), row, x)
                })
            }
        }
    }
}

const _: () = assert!(gemm::NR == tiles::TILE_ROWS, "a tile widens into one GEMM panel");

/// Values of K (and as many of V) one block of a [`CpuKv`] aims at: 256 KiB.
const KV_BLOCK_VALUES: usize = 64 * 1024;

/// The K and V values of one block of pages.
type KvBlock<T> = (Box<[T]>, Box<[T]>);

/// One layer's paged K and V, each `[num_pages, page_size, kv_heads, head_dim]`,
/// stored in f32 or f16 ([`KvPrecision`]).
pub enum CpuKv {
    F32(Paged<f32>),
    F16(Paged<half::f16>),
}

/// Runs `$body` with `$p` bound to the [`Paged`] store of `$kv`, whichever
/// its value type.
macro_rules! with_paged {
    ($kv:expr, $p:ident => $body:expr) => {
        match $kv {
            CpuKv::F32($p) => $body,
            CpuKv::F16($p) => $body,
        }
    };
}

impl CpuKv {
    pub fn geometry(&self) -> KvGeometry {
        with_paged!(self, p => p.geometry)
    }
    /// Blocks that hold host memory.
    pub fn blocks_allocated(&self) -> usize {
        with_paged!(self, p => p.blocks.iter().filter(|b| b.is_some()).count())
    }
    /// How K and V are stored.
    pub fn precision(&self) -> KvPrecision {
        match self {
            CpuKv::F32(_) => KvPrecision::F32,
            CpuKv::F16(_) => KvPrecision::F16,
        }
    }
}

/// Paged K and V of value type `T`, held in blocks of whole pages that are
/// allocated when a page of theirs is first written (all at once on a
/// resident backend). A store addresses the arena's whole id space, which on
/// a sim card may be far larger than the host; blocks nobody wrote cost no
/// host memory and no address space.
pub struct Paged<T> {
    geometry: KvGeometry,
    /// Pages per block.
    block_pages: usize,
    /// Each block's K and V, or `None` until one of its pages is written.
    blocks: Vec<Option<KvBlock<T>>>,
    /// What an unwritten token reads as (one token's width of zeros).
    zeros: Box<[T]>,
}

impl<T: KvValue> Paged<T> {
    fn new(geometry: KvGeometry, resident: bool) -> Paged<T> {
        let width = geometry.kv_heads * geometry.head_dim;
        let page_values = (geometry.page_size.get() * width).max(1);
        let block_pages = (KV_BLOCK_VALUES / page_values).max(1);
        let n_blocks = geometry.num_pages.get().div_ceil(block_pages);
        let mut kv = Paged {
            geometry,
            block_pages,
            blocks: (0..n_blocks).map(|_| None).collect(),
            zeros: vec![T::default(); width].into_boxed_slice(),
        };
        if resident {
            for b in 0..n_blocks {
                kv.block_mut(b);
            }
        }
        kv
    }
    /// Values in one page of K (or of V).
    fn page_values(&self) -> usize {
        let g = &self.geometry;
        g.page_size.get() * g.kv_heads * g.head_dim
    }
    /// The block holding `page` and where the page's token `slot` starts in it.
    fn locate(&self, page: PageId, slot: usize) -> (usize, usize) {
        let g = &self.geometry;
        let (block, within) = (page.index() / self.block_pages, page.index() % self.block_pages);
        (block, (within * g.page_size.get() + slot) * g.kv_heads * g.head_dim)
    }
    /// Block `b`, allocated (zeroed and touched, so it is resident) if it was not.
    fn block_mut(&mut self, b: usize) -> (&mut [T], &mut [T]) {
        let n = self.block_pages * self.page_values();
        let (k, v) = self.blocks[b].get_or_insert_with(|| {
            let mut k = vec![T::default(); n];
            let mut v = vec![T::default(); n];
            touch_pages(&mut k);
            touch_pages(&mut v);
            (k.into_boxed_slice(), v.into_boxed_slice())
        });
        (&mut k[..], &mut v[..])
    }
    /// K and V of token `slot` of `page`, all KV heads (zeros if never written).
    fn token(&self, page: PageId, slot: usize) -> (&[T], &[T]) {
        let width = self.zeros.len();
        let (b, at) = self.locate(page, slot);
        match &self.blocks[b] {
            Some((k, v)) => (&k[at..at + width], &v[at..at + width]),
            None => (&self.zeros, &self.zeros),
        }
    }
    /// K and V of token `slot` of `page`, to be written.
    fn token_mut(&mut self, page: PageId, slot: usize) -> (&mut [T], &mut [T]) {
        let width = self.zeros.len();
        let (b, at) = self.locate(page, slot);
        let (k, v) = self.block_mut(b);
        (&mut k[at..at + width], &mut v[at..at + width])
    }
    fn check_page(&self, page: PageId) -> Result<()> {
        if page.index() >= self.geometry.num_pages.get() {
            return Err(BackendError::Other(format!(
                "{page} is outside a KV store of {} pages",
                self.geometry.num_pages.get()
            )));
        }
        Ok(())
    }
    /// K and V of a whole page (`None`: never written, so zeros).
    fn page(&self, page: PageId) -> Option<(&[T], &[T])> {
        let n = self.page_values();
        let (b, at) = self.locate(page, 0);
        self.blocks[b].as_ref().map(|(k, v)| (&k[at..at + n], &v[at..at + n]))
    }
    /// The K and V rows of `heads` (a KV head's columns) for the tokens
    /// `tokens` of a sequence laid out over `pages`, into the first entries
    /// of `keys` and `values`, found a page at a time.
    fn gather<'a>(
        &'a self,
        pages: &[PageId],
        heads: Range<usize>,
        tokens: Range<usize>,
        keys: &mut [&'a [T]],
        values: &mut [&'a [T]],
    ) {
        let (ps, width) = (self.geometry.page_size.get(), self.zeros.len());
        let mut t = tokens.start;
        while t < tokens.end {
            let p = t / ps;
            let end = ((p + 1) * ps).min(tokens.end);
            let page = self.page(pages[p]);
            for t in t..end {
                let (k, v) = match page {
                    Some((k, v)) => {
                        let at = (t - p * ps) * width;
                        (&k[at..at + width], &v[at..at + width])
                    }
                    None => self.token(pages[p], t - p * ps),
                };
                let i = t - tokens.start;
                (keys[i], values[i]) = (&k[heads.clone()], &v[heads.clone()]);
            }
            t = end;
        }
    }
    /// K and V of a whole page, to be written.
    fn page_mut(&mut self, page: PageId) -> (&mut [T], &mut [T]) {
        let n = self.page_values();
        let (b, at) = self.locate(page, 0);
        let (k, v) = self.block_mut(b);
        (&mut k[at..at + n], &mut v[at..at + n])
    }
}

/// Columns `cols` of `out` (`[rows, n]`, at `out`) = `w`'s rows `cols`
/// dotted with the 8-bit input rows `xs`.
///
/// # Safety
/// `out` holds `xs.len()` rows of `n`, and nothing else writes columns
/// `cols` of it meanwhile.
unsafe fn q8_columns(
    w: &CpuWeight,
    xs: &[quant::Q8Row],
    out: SendPtr,
    n: usize,
    cols: std::ops::Range<usize>,
) {
    // Up to this many weight rows at a time: one call into the kernels each.
    const AT_ONCE: usize = ROWS_PER_TASK;
    let mut vals = [0f32; Q8_DOT_MAX_ROWS * AT_ONCE];
    for (c, xs) in xs.chunks(Q8_DOT_MAX_ROWS).enumerate() {
        let mut j0 = cols.start;
        while j0 < cols.end {
            let nj = AT_ONCE.min(cols.end - j0);
            let vals = &mut vals[..nj * xs.len()];
            w.dot_q8_many(j0, xs, vals);
            for (i, vs) in vals.chunks_exact(xs.len()).enumerate() {
                for (r, &v) in vs.iter().enumerate() {
                    // SAFETY: row c * Q8_DOT_MAX_ROWS + r of `out` exists, and column j0 + i is the caller's.
                    unsafe { *out.0.add((c * Q8_DOT_MAX_ROWS + r) * n + j0 + i) = v };
                }
            }
            j0 += nj;
        }
    }
}

/// `silu(g) * u`, as every SiLU product of this backend computes it.
#[inline]
fn silu_times(g: f32, u: f32) -> f32 {
    g / (1.0 + (-g).exp()) * u
}

/// `out[r] += bias` for the first `rows` rows.
fn add_bias(out: &mut CpuAct, bias: &[f32], rows: usize) {
    let n = out.cols;
    out.live_mut(rows).par_chunks_mut(n).for_each(|o| {
        for (o, b) in o.iter_mut().zip(bias.iter()) {
            *o += b;
        }
    });
}

/// The input rows quantized to 8 bits, once for every matmul that reads them.
fn q8_input(xs: &[f32], k: usize) -> Vec<quant::Q8Row> {
    xs.chunks_exact(k)
        .map(|r| {
            let mut q = quant::Q8Row::default();
            q.quantize(r);
            q
        })
        .collect()
}

/// `f(t)` for every task of [`decode_task_rows`] columns of `ns` matrices side
/// by side, in one parallel loop: `t` is (matrix, first column, columns).
fn for_column_tasks(ns: &[usize], f: impl Fn(usize, usize, usize) + Sync + Send) {
    let threads = rayon::current_num_threads();
    let total: usize = ns.iter().map(|&n| n.div_ceil(decode_task_rows(n, threads))).sum();
    pool::for_each(total, |mut t| {
        // Task t's matrix: the few matrices are walked, nothing is allocated.
        for (i, &n) in ns.iter().enumerate() {
            let per = decode_task_rows(n, threads);
            let tasks = n.div_ceil(per);
            if t < tasks {
                let j0 = t * per;
                return f(i, j0, per.min(n - j0));
            }
            t -= tasks;
        }
    });
}

/// A raw pointer that may cross into rayon tasks writing disjoint regions.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so a closure captures the whole `SendPtr`).
    fn get(self) -> *mut f32 {
        self.0
    }
}

thread_local! {
    /// Per-thread scratch for dequantized weight tiles and attention scores,
    /// grown once and reused, so steady-state forwards do not allocate.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

thread_local! {
    /// Per-thread softmax states of a decode attention task, reused.
    static STATES: RefCell<Vec<AttnState>> = const { RefCell::new(Vec::new()) };
}

/// `n` softmax states of `hd` values, as `AttnState::new` makes them, from
/// this thread's reused ones.
fn with_fresh_states<R>(n: usize, hd: usize, f: impl FnOnce(&mut [AttnState]) -> R) -> R {
    STATES.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < n || s.first().is_some_and(|st| st.o.len() != hd) {
            *s = (0..n).map(|_| AttnState::new(hd)).collect();
        }
        for st in s[..n].iter_mut() {
            st.reset();
        }
        f(&mut s[..n])
    })
}

fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < len {
            s.resize(len, 0.0);
        }
        f(&mut s[..len])
    })
}

/// Columns a task of the f32 GEMM path computes, for a matmul of `n`
/// columns over `k` inputs on `threads` threads: whole column panels, few
/// enough that the task's widened columns (`k` values each) stay in a core's
/// L2 cache while every input panel passes over them, and as many tasks as
/// that needs rounded up to a multiple of the threads, so they come out even.
fn gemm_task_cols(n: usize, k: usize, threads: usize) -> usize {
    const SLAB_VALUES: usize = 1 << 16;
    let fit = (SLAB_VALUES / k.max(1)).max(gemm::NR);
    let tasks = n.div_ceil(fit).next_multiple_of(threads.max(1));
    n.div_ceil(tasks).next_multiple_of(gemm::NR)
}

/// Where a backend keeps the GEMM's packed input rows between matmuls
/// (clones of a backend share it). One buffer, held by the backend rather
/// than by a thread: a step runs on whichever worker of the pool takes it,
/// so a thread's buffer would be grown, to `max_rows · k` values of the
/// widest matmul (29 MiB at 512 rows of an 8B model's down projection), on
/// every worker in turn. A matmul that finds it taken (ranks sharing one
/// backend) packs into a buffer of its own, and the larger one is kept.
#[derive(Clone, Default)]
struct PackedRowsSlot(std::sync::Arc<std::sync::Mutex<Vec<f32>>>);

impl std::fmt::Debug for PackedRowsSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let values = self.0.lock().map(|v| v.capacity()).unwrap_or(0);
        write!(f, "PackedRowsSlot({values} values)")
    }
}

impl PackedRowsSlot {
    fn take(&self) -> Vec<f32> {
        self.0.lock().map(|mut v| std::mem::take(&mut *v)).unwrap_or_default()
    }
    fn give_back(&self, v: Vec<f32>) {
        if let Ok(mut slot) = self.0.lock() {
            if v.capacity() > slot.capacity() {
                *slot = v;
            }
        }
    }
}

/// A matmul's input rows packed for the GEMM ([`gemm::pack_rows`]), in the
/// backend's buffer, given back when dropped.
#[derive(Default)]
struct PackedRows {
    values: Vec<f32>,
    home: Option<PackedRowsSlot>,
}

impl std::ops::Deref for PackedRows {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.values
    }
}

impl Drop for PackedRows {
    fn drop(&mut self) {
        if let Some(home) = self.home.take() {
            home.give_back(std::mem::take(&mut self.values));
        }
    }
}

/// `rows` input rows of `k` (`xs`) packed panel by panel, the panels in parallel.
fn pack_input_rows(slot: &PackedRowsSlot, xs: &[f32], rows: usize, k: usize) -> PackedRows {
    let mut v = slot.take();
    v.resize(gemm::packed_rows_len(rows, k), 0.0);
    let at = SendPtr(v.as_mut_ptr());
    pool::for_each(rows.div_ceil(gemm::MR), |i| {
        // SAFETY: panel i alone is written by this task, within the buffer.
        let panel = unsafe { std::slice::from_raw_parts_mut(at.get().add(i * gemm::MR * k), gemm::MR * k) };
        gemm::pack_rows(xs, rows, k, i, panel);
    });
    PackedRows { values: v, home: Some(slot.clone()) }
}

/// Steps of at most this many rows give each slice of a context a task of
/// its own (decode: a few KV heads would not fill the threads).
const ATTN_SPLIT_MAX_ROWS: usize = 4;

/// Rows of one sequence a prompt's attention task takes together (see
/// `attention`): enough that a slice's K and V rows, found once, serve
/// several rows; few enough that a long prompt still makes many tasks.
const ATTN_ROW_BLOCK: usize = 8;

impl Backend for CpuBackend {
    type Act = CpuAct;
    type Weight = CpuWeight;
    type Kv = CpuKv;
    /// The CPU runs each chosen expert with the plain ops: nothing to index.
    type ExpertTable = ();

    fn name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    /// The step runs on a worker of the global pool (one hand-over per step;
    /// on a worker already, at once). Called from outside the pool, each
    /// op's parallel loop would hand itself to the pool and put the calling
    /// thread to sleep until it finished, two context switches per op,
    /// hundreds per decode step of a small model.
    fn run_step<R: Send>(&self, step: impl FnOnce() -> R + Send) -> R {
        rayon::scope(|_| pool::run(step))
    }

    /// None: the CPU loads no kernels by shape, and what a prefill adds (the
    /// backend's packed input rows and each thread's widened weights, a few
    /// MiB) fits the KV margin. The three prefill-sized steps took 1.5-4 s of every start on
    /// two threads.
    fn warm_up_rows(&self, _max_rows: usize) -> Vec<usize> {
        Vec::new()
    }

    fn upload_weight(&self, t: &HostTensor) -> Result<CpuWeight> {
        let (rows, cols, want) = t.checked_matrix()?;
        if self.rounding.weights && rows > 1 && matches!(t.dtype, DType::F32 | DType::F16) {
            let b = t.data.bytes();
            let wide: Vec<f32> = match t.dtype {
                DType::F32 => {
                    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
                }
                _ => b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            };
            let data = wide.into_iter().map(|v| half::bf16::from_f32(v).to_f32()).collect();
            return Ok(CpuWeight::F32 { data, rows, cols });
        }
        Ok(match t.dtype {
            DType::F32 => {
                // Copy into an aligned Vec: checkpoint offsets need not be 4-byte aligned.
                let data = t
                    .data
                    .bytes()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                CpuWeight::F32 { data, rows, cols }
            }
            dtype
                if !self.stored_rows
                    && rows >= tiles::TILE_ROWS
                    && tiles::supported()
                    && tiles::RowTiles::takes(dtype) =>
            {
                CpuWeight::Tiled(
                    tiles::RowTiles::pack(dtype, t.data.bytes(), rows, cols).expect("a tile format"),
                )
            }
            dtype => {
                if self.resident {
                    // Kept in the checkpoint's mapping: read it in now, so
                    // the weights the books count are resident before the
                    // first request rather than page by page during it.
                    read_pages(t.data.bytes());
                }
                CpuWeight::Packed { dtype, bytes: t.data.clone(), rows, cols, row_bytes: want / rows.max(1) }
            }
        })
    }

    fn weight_shape(&self, w: &CpuWeight) -> (usize, usize) {
        w.shape()
    }

    fn expert_table(&self, _experts: &[crate::Expert<CpuWeight>]) -> Result<()> {
        Ok(())
    }

    fn alloc_act(&self, shape: ActShape) -> Result<CpuAct> {
        Ok(CpuAct { data: self.zeroed(shape.rows * shape.cols), rows: shape.rows, cols: shape.cols })
    }

    fn alloc_kv(&self, geometry: KvGeometry) -> Result<CpuKv> {
        Ok(match self.kv {
            KvPrecision::F32 => CpuKv::F32(Paged::new(geometry, self.resident)),
            KvPrecision::F16 => CpuKv::F16(Paged::new(geometry, self.resident)),
        })
    }

    fn embedding(&self, table: &CpuWeight, ids: &[u32], out: &mut CpuAct) -> Result<()> {
        let (vocab, cols) = table.shape();
        assert_eq!(cols, out.cols, "embedding width");
        for (r, &id) in ids.iter().enumerate() {
            if id as usize >= vocab {
                return Err(BackendError::Other(format!(
                    "token id {id} is outside the vocabulary of {vocab}"
                )));
            }
            table.dequantize_into(id as usize, out.row_mut(r));
        }
        Ok(())
    }

    fn rms_norm(&self, x: &CpuAct, weight: &CpuWeight, eps: f32, rows: usize, out: &mut CpuAct) {
        let w = weight.vector();
        let cols = x.cols;
        out.live_mut(rows).par_chunks_mut(cols).zip(x.live(rows).par_chunks(cols)).for_each(|(o, xr)| {
            let ms = xr.iter().map(|v| v * v).sum::<f32>() / cols as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for ((o, v), w) in o.iter_mut().zip(xr).zip(w.iter()) {
                *o = v * inv * w;
            }
        });
    }

    fn head_rms_norm(&self, x: &mut CpuAct, weight: &CpuWeight, eps: f32, head_dim: usize, rows: usize) {
        let w = weight.vector();
        x.live_mut(rows).par_chunks_mut(head_dim).for_each(|h| {
            let ms = h.iter().map(|v| v * v).sum::<f32>() / head_dim as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for (v, w) in h.iter_mut().zip(w.iter()) {
                *v = *v * inv * w;
            }
        });
    }

    fn matmul(&self, x: &CpuAct, w: &CpuWeight, bias: Option<&CpuWeight>, rows: usize, out: &mut CpuAct) {
        let (n, k) = w.shape();
        assert_eq!(x.cols, k, "matmul: x has {} columns, weight expects {}", x.cols, k);
        assert_eq!(out.cols, n, "matmul: out has {} columns, weight gives {}", out.cols, n);
        let input = self.matmul_input(w, rows);
        let rounded: Vec<f32>;
        let xs = match input {
            MatmulInput::Bf16 => {
                rounded = x.live(rows).iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
                &rounded[..]
            }
            MatmulInput::F32 | MatmulInput::Q8 => x.live(rows),
        };
        let optr = SendPtr(out.data.as_mut_ptr());
        // Decode over a block format: each activation row is quantized once
        // here, then read by every task.
        let q8_rows: Vec<quant::Q8Row> = match input {
            MatmulInput::Q8 => q8_input(xs, k),
            _ => Vec::new(),
        };
        let gemm = q8_rows.is_empty() && rows > DOT_MAX_ROWS;
        let per = match gemm {
            true => gemm_task_cols(n, k, rayon::current_num_threads()),
            false => decode_task_rows(n, rayon::current_num_threads()),
        };
        // The GEMM's input rows, packed once for every task.
        let packed = match gemm {
            true => pack_input_rows(&self.packed, xs, rows, k),
            false => PackedRows::default(),
        };
        pool::for_each(n.div_ceil(per), |t| {
            let j0 = t * per;
            let nb = per.min(n - j0);
            if !q8_rows.is_empty() {
                // SAFETY: task t alone writes columns j0..j0+nb of `out`.
                unsafe { q8_columns(w, &q8_rows, optr, n, j0..j0 + nb) };
                return;
            }
            if rows <= DOT_MAX_ROWS {
                // Decode: each weight row, once in cache, is dotted with every live row.
                for j in j0..j0 + nb {
                    for r in 0..rows {
                        let v = w.dot(j, &xs[r * k..(r + 1) * k]);
                        // SAFETY: task t alone writes columns j0..j0+nb.
                        unsafe { *optr.get().add(r * n + j) = v };
                    }
                }
                return;
            }
            // SAFETY: out is [rows, n] and task t alone writes columns j0..j0+nb.
            with_scratch(gemm::packed_cols_len(nb, k) + gemm::NR * k, |buf| unsafe {
                let (cols, rows_scratch) = buf.split_at_mut(buf.len() - gemm::NR * k);
                match w {
                    // A tile is a panel already (NR = TILE_ROWS; tasks start at
                    // multiples of NR).
                    CpuWeight::Tiled(t) => t.widen_panels(j0, nb, cols),
                    _ => gemm::pack_cols(nb, k, rows_scratch, |c, out| w.dequantize_into(j0 + c, out), cols),
                }
                gemm::gemm(&packed, rows, cols, nb, k, optr.get().add(j0), n)
            });
        });
        if let Some(b) = bias {
            add_bias(out, &b.vector(), rows);
        }
    }

    fn rope(&self, x: &mut CpuAct, table: &RopeTable, head_dim: usize, positions: &[u32]) {
        let cols = x.cols;
        let half = table.rot_dim / 2;
        x.live_mut(positions.len()).par_chunks_mut(cols).zip(positions.par_iter()).for_each(|(row, &pos)| {
            let mut cs = [(0f32, 0f32); 256];
            for (i, f) in table.inv_freq.iter().enumerate().take(half) {
                let a = pos as f32 * f;
                cs[i] = (a.cos(), a.sin());
            }
            for head in row.chunks_mut(head_dim) {
                for (i, &(c, s)) in cs.iter().enumerate().take(half) {
                    let (a, b) = match table.style {
                        RopeStyle::Half => (i, i + half),
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * c - x1 * s;
                    head[b] = x0 * s + x1 * c;
                }
            }
        });
    }

    /// Decode over block formats: the input quantized once and every part's
    /// columns in one parallel loop (one fork and join where there were
    /// three, the same products); anything else one matmul per part.
    fn matmul_many(
        &self,
        x: &CpuAct,
        parts: &mut [MatmulPart<'_, Self>],
        rows: usize,
        _: Option<&mut CpuAct>,
    ) {
        let k = x.cols;
        let fused = parts.len() > 1
            && parts.iter().all(|p| {
                let (n, kw) = p.w.shape();
                kw == k && p.out.cols == n && self.matmul_input(p.w, rows) == MatmulInput::Q8
            });
        if !fused {
            return crate::unfused::matmul_many(self, x, parts, rows);
        }
        let q8_rows = q8_input(x.live(rows), k);
        let outs: Vec<(&CpuWeight, SendPtr, usize)> =
            parts.iter_mut().map(|p| (p.w, SendPtr(p.out.data.as_mut_ptr()), p.out.cols)).collect();
        let ns: Vec<usize> = outs.iter().map(|o| o.2).collect();
        for_column_tasks(&ns, |i, j0, nb| {
            let (w, optr, n) = outs[i];
            // SAFETY: each task alone writes its columns of its part's output.
            unsafe { q8_columns(w, &q8_rows, optr, n, j0..j0 + nb) };
        });
        for p in parts.iter_mut() {
            if let Some(b) = p.bias {
                add_bias(p.out, &b.vector(), rows);
            }
        }
    }

    /// Decode over block formats: gate and up from one 8-bit copy of the
    /// input, each task's columns of both and their SiLU product in one
    /// parallel loop; anything else as the plain ops.
    fn gate_up_silu(
        &self,
        x: &CpuAct,
        gate: &CpuWeight,
        up: &CpuWeight,
        rows: usize,
        gate_out: &mut CpuAct,
        up_out: &mut CpuAct,
        out: &mut CpuAct,
    ) {
        let k = x.cols;
        let n = gate.shape().0;
        let fused = gate.shape() == (n, k)
            && up.shape() == (n, k)
            && [gate_out.cols, up_out.cols, out.cols] == [n; 3]
            && self.matmul_input(gate, rows) == MatmulInput::Q8
            && self.matmul_input(up, rows) == MatmulInput::Q8;
        if !fused {
            return crate::unfused::gate_up_silu(self, x, gate, up, rows, gate_out, up_out, out);
        }
        let q8_rows = q8_input(x.live(rows), k);
        let (g, u, o) = (
            SendPtr(gate_out.data.as_mut_ptr()),
            SendPtr(up_out.data.as_mut_ptr()),
            SendPtr(out.data.as_mut_ptr()),
        );
        for_column_tasks(&[n], |_, j0, nb| {
            let (g, u, o) = (g, u, o);
            // SAFETY: each task alone writes its columns of the three outputs,
            // which hold `rows` rows of `n`.
            unsafe {
                q8_columns(gate, &q8_rows, g, n, j0..j0 + nb);
                q8_columns(up, &q8_rows, u, n, j0..j0 + nb);
                for r in 0..rows {
                    for j in j0..j0 + nb {
                        let (gv, uv) = (*g.0.add(r * n + j), *u.0.add(r * n + j));
                        *o.0.add(r * n + j) = silu_times(gv, uv);
                    }
                }
            }
        });
    }

    fn silu_mul(&self, gate: &CpuAct, up: &CpuAct, rows: usize, out: &mut CpuAct) {
        let cols = gate.cols;
        out.live_mut(rows)
            .par_chunks_mut(cols)
            .zip(gate.live(rows).par_chunks(cols))
            .zip(up.live(rows).par_chunks(cols))
            .for_each(|((o, g), u)| {
                for ((o, g), u) in o.iter_mut().zip(g).zip(u) {
                    *o = silu_times(*g, *u);
                }
            });
    }

    fn add_assign(&self, x: &mut CpuAct, y: &CpuAct, rows: usize) {
        for (a, b) in x.live_mut(rows).iter_mut().zip(y.live(rows)) {
            *a += b;
        }
    }

    fn gather_rows(&self, x: &CpuAct, rows: &[usize], out: &mut CpuAct) {
        for (i, &r) in rows.iter().enumerate() {
            out.row_mut(i).copy_from_slice(x.row(r));
        }
    }

    fn add_rows_scaled(
        &self,
        out: &mut CpuAct,
        out_rows: usize,
        y: &CpuAct,
        rows: &[usize],
        scales: &[f32],
    ) -> Result<()> {
        if rows.len() != scales.len() || rows.iter().any(|&r| r >= out_rows.min(out.rows)) {
            return Err(BackendError::Other(format!(
                "add_rows_scaled: {} rows and {} scales into {out_rows} rows",
                rows.len(),
                scales.len()
            )));
        }
        for (i, (&r, &s)) in rows.iter().zip(scales).enumerate() {
            for (a, b) in out.row_mut(r).iter_mut().zip(y.row(i)) {
                *a += s * b;
            }
        }
        Ok(())
    }

    fn sigmoid_mul(&self, x: &mut CpuAct, gate: &CpuAct, rows: usize) -> Result<()> {
        delta::sigmoid_mul(x, gate, rows)
    }

    fn causal_conv_silu(
        &self,
        x: &mut CpuAct,
        weight: &CpuWeight,
        state: &mut CpuAct,
        seqs: &[SeqStep<'_>],
        slots: &[StateSlot],
    ) -> Result<()> {
        delta::causal_conv_silu(x, weight, state, seqs, slots)
    }

    fn gated_delta_rule(&self, p: DeltaRule<'_, Self>) -> Result<()> {
        delta::gated_delta_rule(delta::Delta {
            qkv: p.qkv,
            a: p.a,
            b: p.b,
            decay: p.decay,
            dt_bias: p.dt_bias,
            g: p.geometry,
            state: p.state,
            seqs: p.seqs,
            slots: p.slots,
            out: p.out,
        })
    }

    fn gated_rms_norm(
        &self,
        x: &mut CpuAct,
        z: &CpuAct,
        weight: &CpuWeight,
        eps: f32,
        head_dim: usize,
        rows: usize,
    ) -> Result<()> {
        delta::gated_rms_norm(x, z, weight, eps, head_dim, rows)
    }

    fn write_kv(&self, kv: &mut CpuKv, k: &CpuAct, v: &CpuAct, seqs: &[SeqStep<'_>]) {
        with_paged!(kv, kv => self.write_kv_in(kv, k, v, seqs))
    }

    fn attention(&self, q: &CpuAct, kv: &CpuKv, heads: usize, seqs: &[SeqStep<'_>], out: &mut CpuAct) {
        with_paged!(kv, kv => self.attention_in(q, kv, heads, seqs, out))
    }

    fn read_rows(&self, x: &CpuAct, rows: usize, out: &mut Vec<f32>) {
        out.clear();
        out.extend_from_slice(x.live(rows));
    }

    fn copy_page(&self, kv: &mut CpuKv, from: PageId, to: PageId) {
        with_paged!(kv, kv => {
            let mut data = Vec::new();
            match kv.page(from) {
                Some((k, v)) => {
                    data.extend_from_slice(k);
                    data.extend_from_slice(v);
                }
                None => data.resize(2 * kv.page_values(), Default::default()),
            }
            let n = kv.page_values();
            let (k, v) = kv.page_mut(to);
            k.copy_from_slice(&data[..n]);
            v.copy_from_slice(&data[n..]);
        })
    }

    fn read_kv_page(&self, kv: &CpuKv, page: PageId, out: &mut Vec<f32>) -> Result<()> {
        with_paged!(kv, kv => {
            kv.check_page(page)?;
            out.clear();
            match kv.page(page) {
                Some((k, v)) => out.extend(k.iter().chain(v).map(|x| x.get())),
                None => out.resize(2 * kv.page_values(), 0.0),
            }
            Ok(())
        })
    }

    fn write_kv_page(&self, kv: &mut CpuKv, page: PageId, data: &[f32]) -> Result<()> {
        with_paged!(kv, kv => {
            kv.check_page(page)?;
            let n = kv.page_values();
            if data.len() != 2 * n {
                return Err(BackendError::Other(format!(
                    "a KV page holds {} values, {} were given",
                    2 * n,
                    data.len()
                )));
            }
            let (k, v) = kv.page_mut(page);
            for (d, &x) in k.iter_mut().chain(v.iter_mut()).zip(data) {
                *d = self.kv_value(x);
            }
            Ok(())
        })
    }
}

#[cfg(all(test, target_os = "linux"))]
mod residency_tests {
    use super::*;
    use corridor_units::{Pages, Tokens};

    fn rss() -> usize {
        let status = std::fs::read_to_string("/proc/self/status").expect("status");
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS");
        line.split_whitespace().nth(1).expect("kB").parse::<usize>().expect("number") * 1024
    }

    #[test]
    fn resident_buffers_are_backed_at_allocation() {
        const MIB: usize = 1 << 20;
        // 64 MiB of K and 64 of V.
        let geometry =
            KvGeometry { num_pages: Pages(1024), page_size: Tokens(16), kv_heads: 1, head_dim: 1024 };
        let before = rss();
        let lazy = CpuBackend::new().alloc_kv(geometry).expect("kv");
        let after_lazy = rss();
        let real = CpuBackend::resident().alloc_kv(geometry).expect("kv");
        let after_real = rss();
        // Other tests of this binary allocate too, so the bounds are loose;
        // the difference (0 against 128 MiB) is not.
        assert!(after_lazy.saturating_sub(before) < 32 * MIB, "a lazy buffer was backed");
        assert!(after_real.saturating_sub(after_lazy) > 100 * MIB, "the resident buffer was not backed");
        assert_eq!(lazy.blocks_allocated(), 0);
        drop((lazy, real));
    }

    #[test]
    fn a_lazy_store_allocates_only_the_blocks_written() {
        // 4 GiB of K and as much of V if it were allocated whole.
        let geometry =
            KvGeometry { num_pages: Pages(1 << 18), page_size: Tokens(16), kv_heads: 2, head_dim: 128 };
        let backend = CpuBackend::new();
        let mut kv = backend.alloc_kv(geometry).expect("kv");
        assert_eq!(kv.blocks_allocated(), 0);
        let n = 16 * 2 * 128;
        let data: Vec<f32> = (0..2 * n).map(|i| i as f32).collect();
        let far = PageId((1 << 18) - 1);
        backend.write_kv_page(&mut kv, far, &data).expect("write");
        assert_eq!(kv.blocks_allocated(), 1);
        let mut out = Vec::new();
        backend.read_kv_page(&kv, far, &mut out).expect("read");
        assert_eq!(out, data);
        // A page never written reads as zeros and allocates nothing.
        backend.read_kv_page(&kv, PageId(0), &mut out).expect("read");
        assert!(out.iter().all(|&x| x == 0.0) && out.len() == 2 * n);
        assert_eq!(kv.blocks_allocated(), 1);
        backend.copy_page(&mut kv, far, PageId(3));
        backend.read_kv_page(&kv, PageId(3), &mut out).expect("read");
        assert_eq!(out, data);
        assert_eq!(kv.blocks_allocated(), 2);
        assert!(backend.read_kv_page(&kv, PageId(1 << 18), &mut out).is_err());
    }

    /// An f16 store: half the bytes a block; a page written reads back as
    /// its values rounded to f16 (saturated at ±65504), and moves as stored.
    #[test]
    fn an_f16_store_reads_back_its_values_rounded_to_f16() {
        let geometry = KvGeometry { num_pages: Pages(64), page_size: Tokens(16), kv_heads: 2, head_dim: 8 };
        let backend = CpuBackend::new().with_kv_precision(KvPrecision::F16);
        let mut kv = backend.alloc_kv(geometry).expect("kv");
        assert_eq!(kv.precision(), KvPrecision::F16);
        let n = 16 * 2 * 8;
        let mut data: Vec<f32> = (0..2 * n).map(|i| (i as f32 - 200.0) * 0.0123).collect();
        (data[5], data[6]) = (1e6, -1e6);
        backend.write_kv_page(&mut kv, PageId(9), &data).expect("write");
        let mut out = Vec::new();
        backend.read_kv_page(&kv, PageId(9), &mut out).expect("read");
        let want: Vec<f32> =
            data.iter().map(|&x| half::f16::from_f32(x.clamp(-65504.0, 65504.0)).to_f32()).collect();
        assert_eq!(out, want);
        assert_ne!(out, data, "f16 rounds");
        assert_eq!((out[5], out[6]), (65504.0, -65504.0));
        backend.copy_page(&mut kv, PageId(9), PageId(40));
        backend.read_kv_page(&kv, PageId(40), &mut out).expect("read");
        assert_eq!(out, want);
        let CpuKv::F16(paged) = &kv else { panic!("an f16 store") };
        assert_eq!(std::mem::size_of_val(&paged.blocks[0].as_ref().expect("written").0[0]), 2);
    }
}

#[cfg(test)]
mod storage_tests {
    use super::*;
    use corridor_units::{Pages, Tokens};

    /// `values` as a `[rows, len / rows]` tensor stored as f32 or, for any
    /// other `dtype`, as f16.
    pub(super) fn tensor(dtype: DType, rows: usize, values: &[f32]) -> HostTensor {
        let data: Vec<u8> = match dtype {
            DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            _ => values.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect(),
        };
        HostTensor {
            name: "w".into(),
            dtype,
            shape: vec![rows, values.len() / rows],
            data: TensorBytes::from_vec(data),
        }
    }

    /// Row 0 of `t` as `b` stores it, read back through an embedding.
    fn stored_row(b: &CpuBackend, t: &HostTensor) -> Vec<f32> {
        let w = b.upload_weight(t).unwrap();
        let mut out = b.alloc_act(ActShape { rows: 1, cols: t.shape[1] }).unwrap();
        b.embedding(&w, &[0], &mut out).unwrap();
        out.row(0).to_vec()
    }

    #[test]
    fn bf16_storage_rounds_matrices_and_kv_as_a_bf16_device_keeps_them() {
        // 1 + 3·2⁻⁹ is an f16 but not a bf16 (whose nearest is 1 + 2⁻⁷);
        // 1 + 2⁻²⁰ is an f32 whose nearest bf16 is 1.
        let (f16_only, f32_only) = (1.0 + 3.0 / 512.0, 1.0 + 1.0 / 1048576.0);
        let plain = CpuBackend::new();
        let bf16 =
            CpuBackend::new().with_bf16_rounding(Bf16Rounding { weights: true, kv: true, inputs: None });
        let h = tensor(DType::F16, 2, &[f16_only, -f16_only, 0.5, 2.0]);
        let f = tensor(DType::F32, 2, &[f32_only, 3.0, 0.5, 2.0]);
        assert_eq!(stored_row(&plain, &h), vec![f16_only, -f16_only]);
        assert_eq!(stored_row(&bf16, &h), vec![1.0 + 1.0 / 128.0, -(1.0 + 1.0 / 128.0)]);
        assert_eq!(stored_row(&plain, &f), vec![f32_only, 3.0]);
        assert_eq!(stored_row(&bf16, &f), vec![1.0, 3.0]);
        // A vector (norm weights, biases) stays f32, as the device keeps it.
        assert_eq!(stored_row(&bf16, &tensor(DType::F32, 1, &[f32_only, 3.0])), vec![f32_only, 3.0]);

        // K and V are rounded as they are written, and on a page copied in.
        let g = KvGeometry { page_size: Tokens(2), num_pages: Pages(1), kv_heads: 1, head_dim: 2 };
        let pages = [PageId(0)];
        let seqs = [SeqStep { row_start: 0, rows: 1, cached: 0, pages: &pages }];
        for (b, want) in [(&plain, f32_only), (&bf16, 1.0)] {
            let mut kv = b.alloc_kv(g).unwrap();
            let mut k = b.alloc_act(ActShape { rows: 1, cols: 2 }).unwrap();
            k.row_mut(0).copy_from_slice(&[f32_only, 0.25]);
            let mut v = b.alloc_act(ActShape { rows: 1, cols: 2 }).unwrap();
            v.row_mut(0).copy_from_slice(&[-f32_only, 0.5]);
            b.write_kv(&mut kv, &k, &v, &seqs);
            let mut page = Vec::new();
            b.read_kv_page(&kv, PageId(0), &mut page).unwrap();
            assert_eq!(page, vec![want, 0.25, 0.0, 0.0, -want, 0.5, 0.0, 0.0]);
            let copied: Vec<f32> = (0..8).map(|i| if i % 4 == 0 { f32_only } else { 0.0 }).collect();
            b.write_kv_page(&mut kv, PageId(0), &copied).unwrap();
            b.read_kv_page(&kv, PageId(0), &mut page).unwrap();
            assert_eq!(page[0], want);
            assert_eq!(page[4], want);
        }
    }
}

#[cfg(test)]
mod step_tests {
    use super::*;

    /// The CPU runs no prefill-sized warm-up steps before KV is sized (it
    /// loads nothing by shape); the backend default runs three.
    #[test]
    fn the_cpu_warms_up_no_prefill_shapes() {
        assert_eq!(CpuBackend::new().warm_up_rows(512), Vec::<usize>::new());
    }

    /// The GEMM packs its input rows into one buffer the backend keeps, so
    /// matmuls run from different threads reuse it instead of each growing
    /// a buffer of its own.
    #[test]
    fn the_gemms_packed_rows_are_one_buffer_of_the_backend() {
        let (n, k, rows) = (64, 96, 40);
        let b = CpuBackend::new();
        let values: Vec<f32> = (0..n * k).map(|i| (i % 13) as f32 * 0.1).collect();
        let w = b.upload_weight(&super::storage_tests::tensor(DType::F32, n, &values)).unwrap();
        let mut x = b.alloc_act(ActShape { rows, cols: k }).unwrap();
        x.live_mut(rows).iter_mut().enumerate().for_each(|(i, v)| *v = (i % 7) as f32);
        let run = || {
            let mut out = b.alloc_act(ActShape { rows, cols: n }).unwrap();
            b.run_step(|| b.matmul(&x, &w, None, rows, &mut out));
            (b.packed.0.lock().unwrap().as_ptr() as usize, out.live(rows).to_vec())
        };
        let (first, want) = run();
        assert!(b.packed.0.lock().unwrap().capacity() >= gemm::packed_rows_len(rows, k));
        let (second, got) = std::thread::scope(|s| s.spawn(run).join().unwrap());
        assert_eq!(first, second, "another thread's matmul reused the backend's buffer");
        assert_eq!(want, got);
    }

    /// A step handed to `run_step` from outside the pool runs on one of its
    /// workers, so the ops' parallel loops inside it start there.
    #[test]
    fn a_step_runs_on_a_worker_of_the_pool() {
        assert_eq!(rayon::current_thread_index(), None, "the test thread is not a worker");
        let at = CpuBackend::new().run_step(rayon::current_thread_index);
        assert!(at.is_some(), "the step ran outside the pool");
    }
}

#[cfg(test)]
mod gemm_tests {
    use super::*;

    /// A prefill matmul's GEMM tasks: whole column panels, a slab that stays
    /// in L2 (256 KiB of widened weights, or one panel where a row is longer),
    /// every thread busy where the columns allow, and tasks of one width.
    #[test]
    fn gemm_tasks_fit_the_cache_and_fill_the_threads() {
        for (n, k, threads) in
            [(576, 576, 2), (192, 576, 2), (1536, 576, 2), (576, 1536, 2), (14336, 4096, 16), (100, 64, 64)]
        {
            let per = gemm_task_cols(n, k, threads);
            assert!(per.is_multiple_of(gemm::NR) && per > 0, "{n}x{k} on {threads}: {per}");
            assert!(per * k <= (1 << 16) + gemm::NR * k, "{n}x{k}: a slab of {per} columns");
            let tasks = n.div_ceil(per);
            assert!(tasks >= threads.min(n.div_ceil(gemm::NR)), "{n}x{k} on {threads}: {tasks} tasks");
        }
        // The default model's 576-wide matrices: 6 tasks of 96 columns on 2 threads.
        assert_eq!(gemm_task_cols(576, 576, 2), 96);
    }

    /// The GEMM path computes every column of a packed weight wider than
    /// one task, to f32 rounding.
    #[test]
    fn gemm_tasks_cover_every_column() {
        let b = CpuBackend::with_decode_activations(DecodeActivations::F32);
        let (n, k, rows) = (200, 64, 5);
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0).collect();
        // f16 storage (exact for these values): widened a tile at a time.
        let data = w.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
        let t = HostTensor {
            name: "w".into(),
            dtype: DType::F16,
            shape: vec![n, k],
            data: TensorBytes::from_vec(data),
        };
        let stored = b.upload_weight(&t).unwrap();
        let x: Vec<f32> = (0..rows * k).map(|i| ((i * 13 % 29) as f32 - 14.0) / 16.0).collect();
        let x = CpuAct { data: x, rows, cols: k };
        let mut out = b.alloc_act(ActShape { rows, cols: n }).unwrap();
        b.run_step(|| b.matmul(&x, &stored, None, rows, &mut out));
        for r in 0..rows {
            for j in 0..n {
                let want: f32 = (0..k).map(|i| x.row(r)[i] * w[j * k + i]).sum();
                let got = out.row(r)[j];
                assert!(
                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "row {r} column {j}: {got} vs {want}"
                );
            }
        }
    }
}

#[cfg(test)]
mod attention_tests {
    use super::*;
    use corridor_units::{Pages, Tokens};

    fn act(rows: usize, cols: usize, seed: u32) -> CpuAct {
        let data = (0..rows * cols)
            .map(|i| {
                let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed.wrapping_mul(97)) >> 8;
                (x % 2000) as f32 / 1000.0 - 1.0
            })
            .collect();
        CpuAct { data, rows, cols }
    }

    /// Decode rows (each context's slices a task of their own) and the same
    /// rows in one step of many (a task per block of rows and KV head) give
    /// the same bits, and both match a plain softmax over the whole context,
    /// with K and V stored in f32 and in f16 (where the step of many widens
    /// each slice once for its rows and the decode kernel widens as it reads).
    #[test]
    fn a_split_context_gives_the_same_bits_as_a_whole_one() {
        for precision in [KvPrecision::F32, KvPrecision::F16] {
            split_context_case(precision);
        }
    }

    fn split_context_case(precision: KvPrecision) {
        let b = CpuBackend::new().with_kv_precision(precision);
        let (kv_heads, heads, hd, page) = (3, 9, 16, 4);
        let geometry = KvGeometry { page_size: Tokens(page), num_pages: Pages(64), kv_heads, head_dim: hd };
        let mut kv = b.alloc_kv(geometry).unwrap();
        let pages: Vec<PageId> = (0..32).map(|p| PageId((p * 7 + 3) % 64)).collect();
        let ctx = 77;
        let (k, v) = (act(ctx, kv_heads * hd, 1), act(ctx, kv_heads * hd, 2));
        b.write_kv(&mut kv, &k, &v, &[SeqStep { row_start: 0, rows: ctx, cached: 0, pages: &pages }]);
        // What the store holds, for the plain softmax below.
        let stored = |a: &CpuAct| match precision {
            KvPrecision::F32 => a.data.clone(),
            KvPrecision::F16 => a.data.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect(),
        };
        let (k, v) = (
            CpuAct { data: stored(&k), rows: ctx, cols: kv_heads * hd },
            CpuAct { data: stored(&v), rows: ctx, cols: kv_heads * hd },
        );
        // Rows in blocks of ATTN_ROW_BLOCK, some of whose contexts end in the
        // slice before the others'.
        let rows = 20;
        assert!(rows > 2 * ATTN_ROW_BLOCK && (ctx - rows) % ATTN_CHUNK != 0);
        let q = act(rows, heads * hd, 3);
        let cached = ctx - rows;
        let mut whole = act(rows, heads * hd, 0);
        b.run_step(|| {
            b.attention(&q, &kv, heads, &[SeqStep { row_start: 0, rows, cached, pages: &pages }], &mut whole)
        });
        for i in 0..rows {
            let qi = CpuAct { data: q.row(i).to_vec(), rows: 1, cols: heads * hd };
            let mut one = act(1, heads * hd, 0);
            let step = [SeqStep { row_start: 0, rows: 1, cached: cached + i, pages: &pages }];
            b.run_step(|| b.attention(&qi, &kv, heads, &step, &mut one));
            assert_eq!(one.row(0), whole.row(i), "{precision:?} KV, row {i}");
            // A plain softmax over positions 0..=cached+i.
            for h in 0..heads {
                let kvh = h / (heads / kv_heads);
                let qh = &q.row(i)[h * hd..(h + 1) * hd];
                let n = cached + i + 1;
                let s: Vec<f64> = (0..n)
                    .map(|t| {
                        let kt = &k.row(t)[kvh * hd..(kvh + 1) * hd];
                        qh.iter().zip(kt).map(|(a, b)| (*a as f64) * (*b as f64)).sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for e in 0..hd {
                    let want: f64 =
                        (0..n).map(|t| (s[t] - m).exp() / sum * v.row(t)[kvh * hd + e] as f64).sum();
                    let got = whole.row(i)[h * hd + e] as f64;
                    assert!(
                        (got - want).abs() < 1e-5,
                        "{precision:?} KV, row {i} head {h} dim {e}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tile_tests {
    use super::*;

    /// A Q4_1 weight of `rows` rows of 64 with random codes and scales.
    fn q4_1(rows: usize) -> HostTensor {
        let mut data = Vec::with_capacity(rows * 2 * 20);
        for b in 0..rows * 2 {
            let d = half::f16::from_f32(0.01 + (b % 7) as f32 * 0.003);
            let m = half::f16::from_f32(-0.05 + (b % 5) as f32 * 0.02);
            data.extend(d.to_le_bytes());
            data.extend(m.to_le_bytes());
            data.extend(
                (0..16u32)
                    .map(|j| ((b as u32).wrapping_mul(2_654_435_761).wrapping_add(j * 40_503) >> 13) as u8),
            );
        }
        HostTensor {
            name: "w".into(),
            dtype: DType::Q4_1,
            shape: vec![rows, 64],
            data: TensorBytes::from_vec(data),
        }
    }

    fn rows_of(n: usize, k: usize) -> CpuAct {
        let data = (0..n * k).map(|i| ((i * 7919) % 211) as f32 / 105.0 - 1.0).collect();
        CpuAct { data, rows: n, cols: k }
    }

    /// Where the CPU has AVX-512 VNNI, a block-format weight is held in row
    /// tiles, and its decode, prefill and embedding rows match the stored
    /// rows': prefill and lookups bit for bit (a tile widens to the stored
    /// row's values), decode within the 8-bit dots' reordering.
    #[test]
    fn row_tiles_compute_what_the_stored_rows_do() {
        let t = q4_1(40);
        let (tiled, stored) = (CpuBackend::new(), CpuBackend::new().with_row_tiles(false));
        let (wt, ws) = (tiled.upload_weight(&t).unwrap(), stored.upload_weight(&t).unwrap());
        assert!(matches!(ws, CpuWeight::Packed { .. }));
        assert_eq!(matches!(wt, CpuWeight::Tiled(_)), tiles::supported());
        let run = |b: &CpuBackend, w: &CpuWeight, rows: usize| {
            let x = rows_of(rows, 64);
            let mut out = b.alloc_act(ActShape { rows, cols: 40 }).unwrap();
            b.matmul(&x, w, None, rows, &mut out);
            out.live(rows).to_vec()
        };
        for rows in [1, 3, 8] {
            let (a, b) = (run(&tiled, &wt, rows), run(&stored, &ws, rows));
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{rows} rows: {x} against {y}");
            }
        }
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        assert_eq!(bits(run(&tiled, &wt, 12)), bits(run(&stored, &ws, 12)), "the GEMM's panels");
        let mut e = [
            tiled.alloc_act(ActShape { rows: 2, cols: 64 }).unwrap(),
            tiled.alloc_act(ActShape { rows: 2, cols: 64 }).unwrap(),
        ];
        tiled.embedding(&wt, &[39, 17], &mut e[0]).unwrap();
        stored.embedding(&ws, &[39, 17], &mut e[1]).unwrap();
        assert_eq!(bits(e[0].live(2).to_vec()), bits(e[1].live(2).to_vec()), "rows looked up");
    }
}
