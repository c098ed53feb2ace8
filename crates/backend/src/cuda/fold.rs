//! A residual add and the RMSNorm after it, folded into the one-row bf16
//! GEMVs around them (kernels/fold.cu; `CudaTuning::fold_norm`).
//!
//! [`Backend::matmul_add_rms_norm`] at one row launches the producer: the
//! projection's GEMV adds its rows to the residual, stores `x * w` into
//! `State::fold_buf` and each block's sum of squares after it, and leaves a
//! [`FoldNorm`] pending in the state. The q/k/v or gate/up GEMV that reads the
//! norm's activation next (or a plain one-row matmul of it, a MoE layer's
//! router) takes it ([`CudaBackend::op_fold`]): it reads
//! `x * w`, scales its products by 1 / rms and stores the norm itself. Any
//! other op settles it first (`lock_for_matmul` launches `fold_settle`), so
//! whatever comes next reads the norm as the separate kernel would have left
//! it. A decode step thus runs no one-block kernel between o_proj and
//! gate/up, nor between down_proj and the next layer's q/k/v.
//!
//! [`Backend::matmul_add_rms_norm`]: crate::Backend::matmul_add_rms_norm

use super::device::{Args, LaunchDims};
use super::matmul::{CudaWeight, GEMV_NW, GEMV_WARPS, GLU_NW};
use super::{CudaAct, CudaBackend, State};
use crate::dtype::DType;
use crate::{ResidualNorm, Result};
use std::sync::atomic::Ordering;

/// A folded norm whose producer ran: where its pieces are on the device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct FoldNorm {
    /// The norm's activation, written by the consumer (or `fold_settle`).
    pub(super) out: u64,
    pub(super) cols: usize,
    /// The residual times the norm's weight, one row.
    pub(super) hw: u64,
    /// The producer's sums of squares, one per block.
    pub(super) slots: u64,
    pub(super) n_slots: usize,
    pub(super) eps: f32,
}

impl FoldNorm {
    /// A consumer kernel's arguments after its input and width.
    pub(super) fn consumer_args(&self, a: Args) -> Args {
        a.ptr(self.slots).i32(self.n_slots as i32).f32(self.eps).ptr(self.out)
    }
}

/// Bytes of `State::fold_buf` for rows of `cols` columns: `x * w`, then one
/// slot per producer block (blocks of two rows at the most).
pub(super) fn fold_bytes(cols: usize) -> usize {
    slots_at(cols) + cols.div_ceil(2) * 4
}

/// Where the slots start in `State::fold_buf`.
fn slots_at(cols: usize) -> usize {
    (cols * 4).div_ceil(256) * 256
}

impl CudaBackend {
    /// Whether `rows` rows of `input` against `w`, added to `n.x` and
    /// normed, fold into the GEMVs: one row of bf16 weights on the per-row
    /// kernel, whole activations, and no block-format weight (whose integer
    /// GEMVs take the norm's 8-bit copy, which only the norm kernel writes).
    pub(super) fn folds_norm(
        &self,
        input: &CudaAct,
        w: &CudaWeight,
        rows: usize,
        n: &ResidualNorm<'_, Self>,
    ) -> bool {
        let whole = |a: &CudaAct| a.cols == w.rows && a.stride == a.cols;
        self.fold_norm.load(Ordering::Relaxed)
            && rows == 1
            && !self.q8_weights.load(Ordering::Relaxed)
            && self.fusable_gemv(input, w, rows)
            && whole(n.x)
            && whole(n.out)
            && n.weight.dtype == DType::F32
            && n.weight.rows * n.weight.cols == w.rows
            && self.lock_raw().fold_buf.as_ref().is_some_and(|b| b.bytes().0 as usize >= fold_bytes(w.rows))
    }

    /// The producer: `proj = input · wᵀ` added to `n.x`, the norm left
    /// pending (`proj` is not written). Only where [`Self::folds_norm`].
    pub(super) fn fold_producer(&self, input: &CudaAct, w: &CudaWeight, n: ResidualNorm<'_, Self>) {
        self.matmul_op("matmul + add + rms_norm (folded)", |st| {
            self.forget_written(st, [&*n.x, &*n.out]);
            let norm_w = self.vector_ptr(n.weight, "add_rms_norm")?;
            let buf = st.fold_buf.as_ref().map(|b| b.ptr()).unwrap_or(0);
            let (kernel, nw) = if self.gemv_narrow_r1(&[w.rows]) {
                (self.k.gemv_bf16_residual[1], 2)
            } else {
                (self.k.gemv_bf16_residual[0], GEMV_NW)
            };
            let blocks = w.rows.div_ceil(nw);
            let f = FoldNorm {
                out: n.out.ptr(),
                cols: w.rows,
                hw: buf,
                slots: buf + slots_at(w.rows) as u64,
                n_slots: blocks,
                eps: n.eps,
            };
            let dims = LaunchDims { grid: (blocks as u32, 1, 1), block: 32 * GEMV_WARPS };
            let a = Args::new().ptr(w.ptr()).ptr(input.ptr()).i32(w.cols as i32).i32(w.rows as i32);
            let a = a.ptr(n.x.ptr()).ptr(norm_w).ptr(f.hw).ptr(f.slots).i32(self.early_weights());
            unsafe { self.launch(kernel, dims, a)? };
            st.fold = Some(f);
            Ok(())
        })
    }

    /// The folded norm's last step as a kernel of its own.
    pub(super) fn fold_settle(&self, f: &FoldNorm) -> Result<()> {
        let a = Args::new().ptr(f.hw).ptr(f.slots).i32(f.n_slots as i32).ptr(f.out).i32(f.cols as i32);
        let a = a.f32(f.eps);
        unsafe { self.launch(self.k.fold_settle, LaunchDims { grid: (1, 1, 1), block: 1024 }, a) }
    }

    /// Whether a folded norm of activation `x` is pending.
    pub(super) fn fold_pending_for(&self, x: &CudaAct) -> bool {
        self.lock_raw().fold.is_some_and(|p| p.out == x.ptr() && p.cols == x.cols)
    }

    /// [`CudaBackend::op`] for a GEMV that can finish a pending folded norm:
    /// `f` gets it when `x` (at one row) is its activation; any other
    /// pending norm is settled first.
    pub(super) fn op_fold(
        &self,
        name: &str,
        x: &CudaAct,
        rows: usize,
        f: impl FnOnce(&mut State, Option<FoldNorm>) -> Result<()>,
    ) {
        let mut st = self.lock_raw();
        let ours = st.fold.is_some_and(|p| rows == 1 && p.out == x.ptr() && p.cols == x.cols);
        let fold = if ours { st.fold.take() } else { None };
        drop(st);
        // As `lock`: settles anything else, forgets the bf16 and 8-bit copies.
        self.op_locked(self.lock(), name, |st| f(st, fold))
    }

    /// The gate/up/SiLU GEMV of one or two rows (`gemv_bf16_glu_r*`), at
    /// one row maybe a folded norm's consumer.
    pub(super) fn gemv_glu(
        &self,
        x: &CudaAct,
        (gate, up): (&CudaWeight, &CudaWeight),
        rows: usize,
        out: &CudaAct,
        fold: Option<FoldNorm>,
    ) -> Result<()> {
        let n = gate.rows;
        let dims = LaunchDims { grid: (n.div_ceil(GLU_NW) as u32, 1, 1), block: 32 * GEMV_WARPS };
        let a = Args::new().ptr(gate.ptr()).ptr(up.ptr());
        let (kernel, a) = match fold {
            None => {
                let a = a.ptr(x.ptr()).ptr(out.ptr()).i32(n as i32).i32(x.cols as i32).i32(rows as i32);
                (self.k.gemv_bf16_glu[rows - 1], a)
            }
            Some(f) => {
                let a = a.ptr(f.hw).ptr(out.ptr()).i32(n as i32).i32(x.cols as i32);
                (self.k.gemv_bf16_glu_fold, f.consumer_args(a))
            }
        };
        unsafe { self.launch(kernel, dims, a.i32(self.early_weights())) }
    }

    /// Whether residual norms fold, in place of `CudaTuning::fold_norm`
    /// (the self-check's comparisons); `None` goes back to the tuning's.
    pub(super) fn set_fold_norm(&self, on: Option<bool>) {
        let on = on.unwrap_or(self.config.tuning.fold_norm);
        self.fold_norm.store(on, Ordering::Relaxed);
    }

    /// Whether a folded norm is pending, and how many were settled by
    /// `fold_settle` so far (the self-check).
    pub(super) fn fold_counts(&self) -> (bool, u64) {
        let st = self.lock_raw();
        (st.fold.is_some(), st.fold_settles)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slots start on their own 256 bytes after a row of `x * w`, and
    /// hold one per block of two rows (the narrower producer).
    #[test]
    fn the_fold_buffer_holds_a_row_and_a_slot_per_two_rows() {
        assert_eq!(slots_at(4096), 16384);
        assert_eq!(slots_at(4097), 16640);
        assert_eq!(fold_bytes(4096), 16384 + 2048 * 4);
        assert_eq!(fold_bytes(3), 256 + 8);
    }
}
