//! The `Backend` impl that ties the concerns together: each trait method is
//! either an op of its own here (embedding, norms, RoPE, element-wise ops,
//! reads to the host, step metadata, weights and workspaces) or hands over to
//! the module of its concern (`matmul.rs`, `attention.rs`, `delta.rs`, `graphs.rs`).

use super::device::{cuda_err, Args, LaunchDims, Purpose};
use super::graphs::drop_graphs;
use super::kernels::{dtype_code, grid_for, norm_dims, NORM_REGISTER_COLS};
use super::matmul::{q8_layout, Arena, CudaWeight, ARENA_ALIGN, DEQUANT_TILE, GEMV_MAX_ROWS};
use super::{CudaAct, CudaBackend, CudaExperts, CudaKv};
use crate::dtype::{DType, HostTensor};
use crate::{
    ActShape, Backend, BackendError, DeltaRule, Expert, GraphKey, KvGeometry, MatmulPart, MoeFfn, QkNorm,
    ResidualNorm, Result, RopeAttention, RopeStyle, RopeTable, SeqStep, StepPlan,
};
use corridor_units::{PageId, StateSlot, TokenId};
use corridor_vram::KvArena;
use cudarc::driver::result as cu;
use half::{bf16, f16};
use std::sync::Arc;

/// Reads to the host of at least this many values go through page-locked staging.
const PINNED_READ_MIN: usize = 1 << 16;

impl Backend for CudaBackend {
    type Act = CudaAct;
    type Weight = CudaWeight;
    type Kv = CudaKv;
    type ExpertTable = CudaExperts;

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
        if super::kernels::mmvq_index(dtype).is_some() {
            self.q8_weights.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let row_bytes = dtype.bytes_for(cols).unwrap_or(0);
        let mem = self.place_weight(&bytes)?;
        Ok(CudaWeight { mem, dtype, rows, cols, row_bytes })
    }

    fn weight_shape(&self, w: &CudaWeight) -> (usize, usize) {
        (w.rows, w.cols)
    }

    fn expert_table(&self, experts: &[Expert<CudaWeight>]) -> Result<CudaExperts> {
        self.build_expert_table(experts)
    }

    fn moe_on_device(&self, table: &CudaExperts) -> bool {
        table.on_device()
    }

    fn moe_ffn(&self, p: MoeFfn<'_, Self>) -> Result<()> {
        self.enqueue_moe_ffn(p)
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
        // And a folded norm's row (`fold.rs`).
        let mut slot = st.fold_buf.take();
        let r = self.ensure_scratch(&mut slot, super::fold::fold_bytes(shape.cols));
        st.fold_buf = slot;
        r?;
        // And the 8-bit copy of the decode rows the integer GEMVs take.
        for i in 0..st.xq.len() {
            let mut slot = st.xq[i].take();
            let r =
                self.ensure_scratch(&mut slot, q8_layout(shape.rows.min(GEMV_MAX_ROWS), shape.cols).bytes);
            st.xq[i] = slot;
            r?;
        }
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
        Ok(CudaAct::own(buf, shape.rows, shape.cols))
    }

    fn alloc_state(&self, shape: ActShape) -> Result<CudaAct> {
        // Only the delta-net ops read state buffers, so none of the matmul
        // scratch or row metadata grows with them, and no capture is stale.
        self.ctx.bind()?;
        let bytes = (shape.rows * shape.cols).max(1) * 4;
        let buf = self.alloc_buf(bytes, Purpose::State)?;
        // SAFETY: a fresh buffer of `bytes` bytes.
        unsafe { cu::memset_d8_async(buf.ptr(), 0, bytes, self.stream.0) }
            .map_err(|e| cuda_err("cuMemsetD8Async", e))?;
        self.synchronize()?;
        Ok(CudaAct::own(buf, shape.rows, shape.cols))
    }

    fn state_in_arena(&self, arena: &Arc<KvArena>, widths: &[usize]) -> Result<Option<Vec<CudaAct>>> {
        self.states_of_pool(arena, widths).map(Some)
    }

    fn alloc_kv(&self, g: KvGeometry) -> Result<CudaKv> {
        self.new_kv(g)
    }

    fn kv_in_arena(&self, arena: &Arc<KvArena>, g: KvGeometry, layers: usize) -> Result<Option<Vec<CudaKv>>> {
        self.kv_of_arena(arena, g, layers)
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
        self.op("rms_norm", |st| {
            let w = self.vector_ptr(weight, "rms_norm")?;
            let bf = self.bf16_output(st, out, rows);
            let (q, qs) =
                self.q8_output(st, out, rows, NORM_REGISTER_COLS).map_or((0, 0), |o| (o.codes, o.scales));
            let a = Args::new().ptr(x.ptr()).ptr(w).ptr(out.ptr()).ptr(bf).ptr(q).ptr(qs);
            let a = a.i32(x.cols as i32).f32(eps);
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
        self.op("add_rms_norm", |st| {
            let w = self.vector_ptr(weight, "add_rms_norm")?;
            let bf = self.bf16_output(st, out, rows);
            let (q, qs) =
                self.q8_output(st, out, rows, NORM_REGISTER_COLS).map_or((0, 0), |o| (o.codes, o.scales));
            let a = Args::new().ptr(x.ptr()).ptr(y.ptr()).ptr(w).ptr(out.ptr()).ptr(bf).ptr(q).ptr(qs);
            let a = a.i32(x.cols as i32).f32(eps);
            unsafe { self.launch(self.k.add_rms_norm, norm_dims(rows, x.cols), a) }
        })
    }

    fn matmul_add_rms_norm(
        &self,
        input: &CudaAct,
        w: &CudaWeight,
        rows: usize,
        proj: &mut CudaAct,
        n: ResidualNorm<'_, Self>,
    ) {
        if self.folds_norm(input, w, rows, &n) {
            return self.fold_producer(input, w, n);
        }
        crate::unfused::matmul_add_rms_norm(self, input, w, rows, proj, n)
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
        self.enqueue_matmul(x, w, bias, rows, out)
    }

    fn matmul_many(
        &self,
        x: &CudaAct,
        parts: &mut [MatmulPart<'_, Self>],
        rows: usize,
        scratch: Option<&mut CudaAct>,
    ) {
        self.enqueue_matmul_many(x, parts, rows, scratch)
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
        self.enqueue_gate_up_silu(x, gate, up, rows, gate_out, up_out, out)
    }

    fn rope_write_kv(
        &self,
        q: &mut CudaAct,
        k: &mut CudaAct,
        v: &CudaAct,
        norm: Option<QkNorm<'_, Self>>,
        table: &RopeTable,
        head_dim: usize,
        positions: &[u32],
        kv: &mut CudaKv,
        seqs: &[SeqStep<'_>],
    ) {
        self.enqueue_rope_write_kv(q, k, v, norm, table, head_dim, positions, kv, seqs)
    }

    fn rope_attention(&self, a: RopeAttention<'_, Self>, heads: usize, out: &mut CudaAct) {
        self.enqueue_rope_attention(a, heads, out)
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
        self.op("silu_mul", |st| {
            let n = rows * gate.cols;
            let bf = self.bf16_output(st, out, rows);
            let a = Args::new().ptr(gate.ptr()).ptr(up.ptr()).ptr(out.ptr()).ptr(bf).i64(n as i64);
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

    fn prefetch(&self, w: &CudaWeight) {
        self.note_prefetch(w)
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

    fn sigmoid_mul(&self, x: &mut CudaAct, gate: &CudaAct, rows: usize) -> Result<()> {
        self.enqueue_sigmoid_mul(x, gate, rows)
    }

    fn causal_conv_silu(
        &self,
        x: &mut CudaAct,
        weight: &CudaWeight,
        state: &mut CudaAct,
        seqs: &[SeqStep<'_>],
        slots: &[StateSlot],
    ) -> Result<()> {
        self.enqueue_causal_conv_silu(x, weight, state, seqs, slots)
    }

    fn gated_delta_rule(&self, p: DeltaRule<'_, Self>) -> Result<()> {
        self.enqueue_gated_delta_rule(p)
    }

    fn gated_rms_norm(
        &self,
        x: &mut CudaAct,
        z: &CudaAct,
        weight: &CudaWeight,
        eps: f32,
        head_dim: usize,
        rows: usize,
    ) -> Result<()> {
        self.enqueue_gated_rms_norm(x, z, weight, eps, head_dim, rows)
    }

    fn write_kv(&self, kv: &mut CudaKv, k: &CudaAct, v: &CudaAct, seqs: &[SeqStep<'_>]) {
        self.enqueue_write_kv(kv, k, v, seqs)
    }

    fn attention(&self, q: &CudaAct, kv: &CudaKv, heads: usize, seqs: &[SeqStep<'_>], out: &mut CudaAct) {
        self.enqueue_attention(q, kv, heads, seqs, out)
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    fn reserve_sample_rows(&self, rows: usize) -> Result<()> {
        self.reserve_sampling(rows)
    }

    fn sample_rows(
        &self,
        logits: &mut CudaAct,
        specs: &[crate::sample::SampleRowSpec],
        edits: &[crate::sample::LogitEdit],
        out: &mut crate::sample::SampledRows,
    ) -> Result<()> {
        self.sample_rows_on_device(logits, specs, edits, out)
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
        self.enqueue_copy_page(kv, from, to)
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
            self.sync_meta(&mut st.tokens, TokenId::as_u32_slice(plan.tokens), "token rows", cap)?;
            self.sync_meta(&mut st.positions, plan.positions, "positions", cap)?;
            let idx: Vec<u32> = plan.logit_rows.iter().map(|&r| r as u32).collect();
            self.sync_meta(&mut st.gather, &idx, "logit rows", cap)?;
            self.sync_seqs(&mut st, plan.seqs)?;
            // A plan with a slot per sequence (a hybrid model's, or one with
            // no sequences, which a capture may be made from) gets the
            // delta-net ops' sequence table too.
            if plan.state_slots.len() == plan.seqs.len() {
                self.upload_delta_table(&mut st, plan.seqs, plan.state_slots)?;
            }
            Ok(())
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
        self.replay_graph(key)
    }

    fn graph_capture_begin(&self, key: GraphKey) -> Result<bool> {
        self.begin_capture(key)
    }

    fn graph_capture_end(&self, key: GraphKey) -> Result<()> {
        self.end_capture(key)
    }
}
