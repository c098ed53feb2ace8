//! The gated delta-net ops of Qwen3.5's linear attention on the device
//! (kernels/delta.cu): the causal convolution with SiLU, the gated delta rule,
//! the gated RMS norm, and the sigmoid gate of the hybrid's full attention.
//!
//! Each sequence's state (the convolution's last inputs and one `[k_dim,
//! v_dim]` f32 matrix per value head) is a row of a state activation, one row
//! per slot: the model allocates them with `alloc_state`, reserved through
//! the card's chokepoint like every other buffer and booked there as state.
//! The kernels take the distance between slots as an argument (here the row
//! width), so a slot-major pool holding every layer's state of one request
//! side by side can be addressed by the same launches.
//!
//! The delta rule has two kernels, each launched once for every (sequence,
//! value head, 32 value columns). The scan runs token by token with the
//! state in registers: the recurrent update of decode, and the path of any
//! step in which no sequence brings a chunk's worth of rows. With
//! `CudaTuning::delta_chunked` a prefill step (some sequence brings at
//! least [`CHUNKED_MIN_ROWS`]) takes the chunked form instead:
//! [`DELTA_CHUNK_ROWS`] tokens at a time, the intra-chunk products (K Kᵀ,
//! Q Kᵀ, K S₀, the triangular solve for the corrections, the state update)
//! in f32 FMA over shared memory, five barriers a chunk where the scan takes
//! two a token. It is off by default: on the H200 at the Qwen3.5-27B shape
//! it ran at 0.9 times the scan's speed (0.88 against 0.77 µs a prompt
//! token), both limited by 192 blocks of 128 threads doing dependent work;
//! a form whose intra-chunk products go to the tensor cores, with the
//! chunks' independent parts spread over the whole card, is what would beat
//! the scan. Both leave the state in the same slot layout and write the
//! output to the same place, so decode continues from either.
//!
//! Each launch reads its sequences (first row, rows, cached, slot) from one
//! device table that `begin_step` uploads from the [`crate::StepPlan`]'s
//! sequences and state slots, so a decode step can be captured as a graph
//! and replayed with other sequences in other slots. A decode step's table
//! is padded to the step's rows with entries of no slot, which the kernels
//! skip, so the grid a capture records covers every replay of its shape.

use super::device::{Args, LaunchDims};
use super::kernels::grid_for;
use super::{CudaAct, CudaBackend, CudaWeight, State};
use crate::dtype::DType;
use crate::{BackendError, DeltaGeometry, DeltaRule, Result, SeqStep, VHeadOrder};
use corridor_units::StateSlot;

/// Taps of the causal convolution the kernels are instantiated for
/// (`causal_conv_silu_t{2..6}`); Qwen3.5 uses 4.
pub const CONV_TAPS: std::ops::RangeInclusive<usize> = 2..=6;

/// Largest key head dimension of the delta-rule kernel: 32 state rows per
/// thread, at most 8 warps (`gated_delta_rule_w{1,2,4,8}`).
pub const MAX_DELTA_K_DIM: usize = 256;

/// Tokens of one chunk of the chunked delta rule (kernels/delta.cu DELTA_C).
pub const DELTA_CHUNK_ROWS: usize = 16;

/// Largest key head dimension of the chunked delta rule: the state slice and
/// a chunk's q and k rows must fit in a block's 48 KB of static shared
/// memory (kernels/delta.cu DELTA_C_MAX_K). Wider heads keep the scan.
pub const MAX_CHUNKED_K_DIM: usize = 128;

/// A step takes the chunked delta rule when some sequence brings at least
/// this many rows: one whole chunk. Below it the chunked kernel would spend
/// a chunk's fixed work (its products over 16 tokens, the solve) on fewer
/// tokens while the scan's cost per token is small, and a decode step
/// (every sequence one row) must stay on the scan, the kernel its captured
/// graphs are recorded with.
pub const CHUNKED_MIN_ROWS: usize = DELTA_CHUNK_ROWS;

/// Which delta-rule kernel a prefill step takes: `Scan` by default,
/// `Chunked` (for steps with a sequence of at least [`CHUNKED_MIN_ROWS`]
/// rows) with `CudaTuning::delta_chunked`; the self-check and the benchmark
/// set either to run both on the same inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum DeltaPrefill {
    Chunked,
    Scan,
}

impl DeltaPrefill {
    /// Whether a step of these sequences, over heads of `k_dim`, runs chunked.
    fn chunks(self, seqs: &[SeqStep<'_>], k_dim: usize) -> bool {
        self == DeltaPrefill::Chunked
            && k_dim <= MAX_CHUNKED_K_DIM
            && seqs.iter().any(|s| s.rows >= CHUNKED_MIN_ROWS)
    }
}

/// Threads of a chunked delta-rule block (kernels/delta.cu DELTA_C_THREADS).
const CHUNKED_THREADS: u32 = 128;

/// The slot of a table entry that stands for no sequence (kernels/delta.cu DELTA_NO_SLOT).
const NO_SLOT: u32 = u32::MAX;

/// Rows of one thread's chunk in the convolution kernel (kernels/delta.cu CONV_CHUNK).
const CONV_CHUNK: usize = 8;
/// Warps of a convolution block at most (kernels/delta.cu CONV_MAX_WARPS).
const CONV_MAX_WARPS: usize = 8;

/// What a delta-net op runs its sequences over: checked and uploaded by `sync_delta_seqs`.
struct SeqSlots<'a, 'b> {
    op: &'static str,
    seqs: &'a [SeqStep<'b>],
    slots: &'a [StateSlot],
    /// The state buffer, `[slots, width]`.
    state: &'a CudaAct,
    width: usize,
    /// Rows of the activations the sequences' rows index.
    x_rows: usize,
}

/// The delta-net kernels' sequence table: (first row, rows, cached, slot)
/// per sequence, then, for a decode step (no sequence brings more than one
/// row), entries of no slot up to `pad_to` (its rows), so a captured launch
/// covers every sequence count it may be replayed with.
fn delta_table(seqs: &[SeqStep<'_>], slots: &[StateSlot], pad_to: usize) -> Vec<u32> {
    let decode = seqs.iter().all(|s| s.rows <= 1);
    let entries = if decode { seqs.len().max(pad_to) } else { seqs.len() };
    let mut data = Vec::with_capacity(entries * 4);
    for (s, slot) in seqs.iter().zip(slots) {
        data.extend([s.row_start as u32, s.rows as u32, s.cached as u32, slot.0]);
    }
    while data.len() < entries * 4 {
        data.extend([0, 0, 0, NO_SLOT]);
    }
    data
}

fn bad(op: &str, why: String) -> BackendError {
    BackendError::Other(format!("{op}: {why}"))
}

impl CudaBackend {
    /// One state buffer per entry of `widths` inside the slots of a governed
    /// state pool on this backend's card: slot `s` of state `j` at the pool's
    /// page `s` plus the widths before `j`. The pool must put its slots a
    /// fixed stride apart (one slot a chunk, or pages that pack chunks
    /// exactly), since the kernels reach slot `s` at `s * stride`.
    pub(super) fn states_of_pool(
        &self,
        pool: &std::sync::Arc<corridor_vram::KvArena>,
        widths: &[usize],
    ) -> Result<Vec<CudaAct>> {
        let bad = |why: String| BackendError::Other(format!("recurrent state in a pool: {why}"));
        let part = self.alloc.card().and_then(|c| pool.part_on(c)).ok_or_else(|| {
            bad(format!(
                "the pool spans {:?}; this backend's memory is not booked on any of them",
                pool.cards()
            ))
        })?;
        let g = part.geometry;
        let (cp, chunk, page) = (g.chunk_pages as u64, g.chunk_bytes.get(), g.page_bytes.get());
        if cp != 1 && chunk != cp * page {
            return Err(bad(format!(
                "chunks of {} hold {cp} slots of {} with a gap: slots are not a fixed stride apart",
                g.chunk_bytes, g.page_bytes
            )));
        }
        let stride = chunk / cp;
        let need = widths.iter().sum::<usize>() as u64 * 4;
        if stride % 4 != 0 || need > page {
            return Err(bad(format!("a slot of {} cannot hold {need} bytes of f32 state", g.page_bytes)));
        }
        let mut offset = 0u64;
        Ok(widths
            .iter()
            .map(|&cols| {
                let act = CudaAct {
                    mem: super::ActMem::Pool { ptr: part.base_address + offset, _pool: pool.clone() },
                    rows: pool.capacity().get(),
                    cols,
                    stride: (stride / 4) as usize,
                };
                offset += cols as u64 * 4;
                act
            })
            .collect())
    }

    /// Run a delta-net op with the context bound and the state locked.
    fn delta_op(&self, name: &'static str, f: impl FnOnce(&mut State) -> Result<()>) -> Result<()> {
        let mut st = self.lock();
        self.ctx.bind()?;
        match &self.profile {
            Some(p) => self.profiled(p, name, || f(&mut st)),
            None => f(&mut st),
        }
    }

    /// Check the slots against the state buffer (as the CPU does) and
    /// upload each sequence's (first row, rows, cached, slot).
    fn sync_delta_seqs(&self, st: &mut State, u: SeqSlots<'_, '_>) -> Result<usize> {
        let SeqSlots { op, seqs, slots, state, width, x_rows } = u;
        if slots.len() != seqs.len() {
            return Err(bad(op, format!("{} slots for {} sequences", slots.len(), seqs.len())));
        }
        if state.cols != width {
            return Err(bad(op, format!("a state row of {} columns, the layer needs {width}", state.cols)));
        }
        for (i, (s, slot)) in seqs.iter().zip(slots).enumerate() {
            if slot.index() >= state.rows {
                return Err(bad(op, format!("{slot} is outside the {} slots", state.rows)));
            }
            if slots[..i].contains(slot) {
                return Err(bad(op, format!("{slot} is given to two sequences of one step")));
            }
            if s.row_start + s.rows > x_rows {
                return Err(bad(
                    op,
                    format!("rows {}..{} of an activation of {x_rows}", s.row_start, s.row_start + s.rows),
                ));
            }
        }
        self.upload_delta_table(st, seqs, slots)
    }

    /// The sequence table of a step, as `begin_step` uploads it for a plan
    /// with state slots: one entry per sequence, then (for a decode step)
    /// entries of no slot up to the step's rows. Returns the entries.
    pub(super) fn upload_delta_table(
        &self,
        st: &mut State,
        seqs: &[SeqStep<'_>],
        slots: &[StateSlot],
    ) -> Result<usize> {
        if slots.len() != seqs.len() {
            return Err(bad("state slots", format!("{} slots for {} sequences", slots.len(), seqs.len())));
        }
        let data = delta_table(seqs, slots, st.step_rows.min(st.delta_seqs.cap / 4));
        let cap = st.capturing.is_some();
        self.sync_meta(&mut st.delta_seqs, &data, "delta-net sequences", cap)?;
        Ok(data.len() / 4)
    }

    pub(super) fn enqueue_sigmoid_mul(&self, x: &mut CudaAct, gate: &CudaAct, rows: usize) -> Result<()> {
        if x.cols != gate.cols || rows > x.rows.min(gate.rows) {
            return Err(bad(
                "sigmoid_mul",
                format!("{rows} rows of {} columns gated by {}x{}", x.cols, gate.rows, gate.cols),
            ));
        }
        self.delta_op("sigmoid_mul", |_| {
            let n = rows * x.cols;
            let a = Args::new().ptr(x.ptr()).ptr(gate.ptr()).i64(n as i64);
            unsafe { self.launch(self.k.sigmoid_mul, grid_for(n, 256), a) }
        })
    }

    pub(super) fn enqueue_causal_conv_silu(
        &self,
        x: &mut CudaAct,
        weight: &CudaWeight,
        state: &mut CudaAct,
        seqs: &[SeqStep<'_>],
        slots: &[StateSlot],
    ) -> Result<()> {
        let op = "causal_conv_silu";
        let (channels, taps) = (weight.rows, weight.cols);
        if x.cols != channels || !CONV_TAPS.contains(&taps) {
            return Err(bad(
                op,
                format!(
                    "{} channels, a [{channels}, {taps}] kernel (taps {}..={} on this backend)",
                    x.cols,
                    CONV_TAPS.start(),
                    CONV_TAPS.end()
                ),
            ));
        }
        if !matches!(weight.dtype, DType::BF16 | DType::F32) {
            return Err(bad(op, format!("a {} kernel; the convolution reads bf16 or f32", weight.dtype)));
        }
        self.delta_op(op, |st| {
            let width = (taps - 1) * channels;
            let entries =
                self.sync_delta_seqs(st, SeqSlots { op, seqs, slots, state, width, x_rows: x.rows })?;
            let most = seqs.iter().map(|s| s.rows).max().unwrap_or(0);
            let warps = most.div_ceil(CONV_CHUNK).clamp(1, CONV_MAX_WARPS);
            let wdt = super::kernels::dtype_code(weight.dtype);
            let a = Args::new()
                .ptr(x.ptr())
                .ptr(weight.ptr())
                .i32(wdt)
                .ptr(state.ptr())
                // Row width of a buffer of its own, or a whole slot of a pool.
                .i64(state.stride as i64)
                .ptr(st.delta_seqs.dev.ptr())
                .i32(channels as i32);
            let dims = LaunchDims {
                grid: (channels.div_ceil(32) as u32, entries as u32, 1),
                block: (32 * warps) as u32,
            };
            let kernel = self.k.causal_conv_silu[taps - CONV_TAPS.start()];
            unsafe { self.launch(kernel, dims, a) }
        })
    }

    pub(super) fn enqueue_gated_delta_rule(&self, p: DeltaRule<'_, Self>) -> Result<()> {
        let op = "gated_delta_rule";
        let g: DeltaGeometry = p.geometry;
        let (dk, dv, vh) = (g.k_dim, g.v_dim, g.v_heads);
        if g.k_heads == 0 || vh % g.k_heads != 0 {
            return Err(bad(op, format!("{vh} value heads cannot share {} key heads", g.k_heads)));
        }
        if dk == 0 || dk > MAX_DELTA_K_DIM || dv == 0 {
            return Err(bad(op, format!("heads of k_dim {dk} (1..={MAX_DELTA_K_DIM} here), v_dim {dv}")));
        }
        if p.qkv.cols != g.conv_channels()
            || p.out.cols != g.value_width()
            || p.a.cols != vh
            || p.b.cols != vh
        {
            return Err(bad(
                op,
                format!(
                    "qkv {} / out {} / a {} / b {} columns for {g:?}",
                    p.qkv.cols, p.out.cols, p.a.cols, p.b.cols
                ),
            ));
        }
        let rows = p.qkv.rows.min(p.out.rows).min(p.a.rows).min(p.b.rows);
        let decay = self.vector_ptr(p.decay, op)?;
        let dt_bias = self.vector_ptr(p.dt_bias, op)?;
        if p.decay.cols != vh || p.dt_bias.cols != vh {
            return Err(bad(
                op,
                format!("{} decay and {} dt_bias values for {vh} heads", p.decay.cols, p.dt_bias.cols),
            ));
        }
        let (state, out) = (p.state, p.out);
        self.delta_op(op, |st| {
            let width = g.recurrent_state_elems();
            let (seqs, slots) = (p.seqs, p.slots);
            let entries =
                self.sync_delta_seqs(st, SeqSlots { op, seqs, slots, state, width, x_rows: rows })?;
            let chunked = st.delta_prefill.chunks(seqs, dk);
            // The scan: warps of 32 state rows each, enough for k_dim.
            let warps = dk.div_ceil(32).next_power_of_two();
            let (kernel, threads) = if chunked {
                (self.k.gated_delta_rule_chunked, CHUNKED_THREADS)
            } else {
                (self.k.gated_delta_rule[warps.trailing_zeros() as usize], (32 * warps) as u32)
            };
            let a = Args::new()
                .ptr(p.qkv.ptr())
                .ptr(p.a.ptr())
                .ptr(p.b.ptr())
                .ptr(decay)
                .ptr(dt_bias)
                .ptr(state.ptr())
                .i64(state.stride as i64)
                .ptr(st.delta_seqs.dev.ptr())
                .ptr(out.ptr())
                .i32(p.qkv.cols as i32)
                .i32(out.cols as i32)
                .i32(vh as i32)
                .i32(g.k_heads as i32)
                .i32(dk as i32)
                .i32(dv as i32)
                .i32(i32::from(g.v_order == VHeadOrder::Tiled))
                .f32(1.0 / (dk as f32).sqrt());
            let dims =
                LaunchDims { grid: (dv.div_ceil(32) as u32, vh as u32, entries as u32), block: threads };
            unsafe { self.launch(kernel, dims, a) }
        })
    }

    pub(super) fn enqueue_gated_rms_norm(
        &self,
        x: &mut CudaAct,
        z: &CudaAct,
        weight: &CudaWeight,
        eps: f32,
        head_dim: usize,
        rows: usize,
    ) -> Result<()> {
        let op = "gated_rms_norm";
        if x.cols != z.cols
            || weight.cols != head_dim
            || head_dim == 0
            || !x.cols.is_multiple_of(head_dim)
            || rows > x.rows.min(z.rows)
        {
            return Err(bad(
                op,
                format!(
                    "{rows} rows of {} columns, gate {}, weight {} for heads of {head_dim}",
                    x.cols, z.cols, weight.cols
                ),
            ));
        }
        let w = self.vector_ptr(weight, op)?;
        self.delta_op(op, |_| {
            let heads = rows * x.cols / head_dim;
            let a =
                Args::new().ptr(x.ptr()).ptr(z.ptr()).ptr(w).i32(head_dim as i32).f32(eps).i64(heads as i64);
            unsafe { self.launch(self.k.gated_rms_norm, grid_for(heads * 32, 256), a) }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corridor_units::PageId;

    #[test]
    fn a_decode_table_is_padded_to_its_rows_with_entries_of_no_slot() {
        let pages = [PageId(0)];
        let seq = |row_start, rows, cached| SeqStep { row_start, rows, cached, pages: &pages };
        let decode = [seq(0, 1, 7), seq(1, 1, 0)];
        let t = delta_table(&decode, &[StateSlot(3), StateSlot(0)], 4);
        assert_eq!(t, vec![0, 1, 7, 3, 1, 1, 0, 0, 0, 0, 0, NO_SLOT, 0, 0, 0, NO_SLOT]);
        // A step with no sequences (a capture made at warm-up) is all padding.
        assert_eq!(delta_table(&[], &[], 2), vec![0, 0, 0, NO_SLOT, 0, 0, 0, NO_SLOT]);
        // A prefill is never padded: its grid would be mostly empty blocks.
        let prefill = [seq(0, 5, 0), seq(5, 1, 9)];
        assert_eq!(delta_table(&prefill, &[StateSlot(1), StateSlot(2)], 6).len(), 8);
        // Padding never shortens the table.
        assert_eq!(delta_table(&decode, &[StateSlot(3), StateSlot(0)], 1).len(), 8);
    }

    #[test]
    fn a_step_runs_chunked_only_with_a_whole_chunk_of_some_sequence() {
        let pages = [PageId(0)];
        let seq = |rows| SeqStep { row_start: 0, rows, cached: 0, pages: &pages };
        let auto = DeltaPrefill::Chunked;
        // Decode, and prompts shorter than a chunk, keep the scan.
        assert!(!auto.chunks(&[seq(1), seq(1), seq(0)], 128));
        assert!(!auto.chunks(&[seq(CHUNKED_MIN_ROWS - 1), seq(1)], 128));
        // One sequence with a whole chunk takes the whole step chunked.
        assert!(auto.chunks(&[seq(1), seq(CHUNKED_MIN_ROWS)], 128));
        // Heads wider than the chunked kernel's shared memory, or the scan asked for.
        assert!(!auto.chunks(&[seq(500)], MAX_CHUNKED_K_DIM + 1));
        assert!(!DeltaPrefill::Scan.chunks(&[seq(500)], 128));
    }
}
