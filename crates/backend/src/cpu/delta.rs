//! The CPU kernels of a gated delta-net layer (Qwen3.5's linear attention):
//! its short causal convolution, the gated delta rule and the gated norm,
//! plus the sigmoid gate of its full-attention layers.
//!
//! Each sequence's state lives in one row of a state buffer (its slot). The
//! recurrence runs token by token: exact, and at these sizes the state update
//! (`k_dim × v_dim` per head per token) is small beside the projections.

use super::{CpuAct, CpuWeight, SendPtr};
use crate::{BackendError, DeltaGeometry, Result, SeqStep};
use corridor_units::StateSlot;
use rayon::prelude::*;

/// transformers' (and FLA's) epsilon of the q/k L2 norm.
const L2_EPS: f32 = 1e-6;

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// torch's softplus (beta 1, threshold 20: linear above it).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Refuse slots that are out of range or shared by two sequences of a step
/// (their states would be overwritten by each other).
fn check_slots(
    op: &str,
    seqs: &[SeqStep<'_>],
    slots: &[StateSlot],
    state: &CpuAct,
    width: usize,
) -> Result<()> {
    let bad = |why: String| Err(BackendError::Other(format!("{op}: {why}")));
    if slots.len() != seqs.len() {
        return bad(format!("{} slots for {} sequences", slots.len(), seqs.len()));
    }
    if state.cols != width {
        return bad(format!("a state row of {} columns, the layer needs {width}", state.cols));
    }
    for (i, s) in slots.iter().enumerate() {
        if s.index() >= state.rows {
            return bad(format!("{s} is outside the {} slots", state.rows));
        }
        if slots[..i].contains(s) {
            return bad(format!("{s} is given to two sequences of one step"));
        }
    }
    Ok(())
}

pub(super) fn sigmoid_mul(x: &mut CpuAct, gate: &CpuAct, rows: usize) -> Result<()> {
    if x.cols != gate.cols {
        return Err(BackendError::Other(format!("sigmoid_mul: {} columns gated by {}", x.cols, gate.cols)));
    }
    for (v, g) in x.live_mut(rows).iter_mut().zip(gate.live(rows)) {
        *v *= sigmoid(*g);
    }
    Ok(())
}

pub(super) fn causal_conv_silu(
    x: &mut CpuAct,
    weight: &CpuWeight,
    state: &mut CpuAct,
    seqs: &[SeqStep<'_>],
    slots: &[StateSlot],
) -> Result<()> {
    let (channels, taps) = weight.shape();
    if x.cols != channels || taps == 0 {
        return Err(BackendError::Other(format!(
            "causal_conv_silu: {} channels, a [{channels}, {taps}] kernel",
            x.cols
        )));
    }
    let keep = taps - 1;
    check_slots("causal_conv_silu", seqs, slots, state, keep * channels)?;
    let w = weight.vector();
    let xptr = SendPtr(x.data.as_mut_ptr());
    let sptr = SendPtr(state.data.as_mut_ptr());
    seqs.par_iter().zip(slots.par_iter()).for_each(|(s, slot)| {
        let (xptr, sptr) = (xptr, sptr);
        // SAFETY: each sequence owns its rows of x and (slots are distinct,
        // checked above) its row of the state.
        let rows =
            unsafe { std::slice::from_raw_parts_mut(xptr.0.add(s.row_start * channels), s.rows * channels) };
        let st = unsafe {
            std::slice::from_raw_parts_mut(sptr.0.add(slot.index() * keep * channels), keep * channels)
        };
        // The inputs this sequence's outputs read: the kept window, then its rows.
        let mut input = vec![0f32; (keep + s.rows) * channels];
        if s.cached > 0 {
            input[..keep * channels].copy_from_slice(st);
        }
        input[keep * channels..].copy_from_slice(rows);
        for (t, out) in rows.chunks_mut(channels).enumerate() {
            for (c, o) in out.iter_mut().enumerate() {
                let taps_c = &w[c * taps..(c + 1) * taps];
                let acc: f32 =
                    taps_c.iter().enumerate().map(|(j, wj)| wj * input[(t + j) * channels + c]).sum();
                *o = silu(acc);
            }
        }
        st.copy_from_slice(&input[s.rows * channels..]);
    });
    Ok(())
}

/// The arguments of [`gated_delta_rule`], with the CPU's types.
pub(super) struct Delta<'a> {
    pub qkv: &'a CpuAct,
    pub a: &'a CpuAct,
    pub b: &'a CpuAct,
    pub decay: &'a CpuWeight,
    pub dt_bias: &'a CpuWeight,
    pub g: DeltaGeometry,
    pub state: &'a mut CpuAct,
    pub seqs: &'a [SeqStep<'a>],
    pub slots: &'a [StateSlot],
    pub out: &'a mut CpuAct,
}

pub(super) fn gated_delta_rule(p: Delta<'_>) -> Result<()> {
    let g = p.g;
    let (dk, dv, vh) = (g.k_dim, g.v_dim, g.v_heads);
    if g.k_heads == 0 || vh % g.k_heads != 0 {
        return Err(BackendError::Other(format!(
            "gated_delta_rule: {vh} value heads cannot share {} key heads",
            g.k_heads
        )));
    }
    let (key, width) = (g.key_width(), g.conv_channels());
    if p.qkv.cols != width || p.out.cols != g.value_width() || p.a.cols != vh || p.b.cols != vh {
        return Err(BackendError::Other(format!(
            "gated_delta_rule: qkv {} / out {} / a {} / b {} columns for {g:?}",
            p.qkv.cols, p.out.cols, p.a.cols, p.b.cols
        )));
    }
    check_slots("gated_delta_rule", p.seqs, p.slots, p.state, g.recurrent_state_elems())?;
    let (decay, dt_bias) = (p.decay.vector(), p.dt_bias.vector());
    if decay.len() != vh || dt_bias.len() != vh {
        return Err(BackendError::Other(format!(
            "gated_delta_rule: {} decay and {} dt_bias values for {vh} heads",
            decay.len(),
            dt_bias.len()
        )));
    }
    let scale = 1.0 / (dk as f32).sqrt();
    let (qkv, a, b) = (p.qkv, p.a, p.b);
    let out_cols = p.out.cols;
    let optr = SendPtr(p.out.data.as_mut_ptr());
    let sptr = SendPtr(p.state.data.as_mut_ptr());
    let work: Vec<(usize, usize)> = (0..p.seqs.len()).flat_map(|si| (0..vh).map(move |h| (si, h))).collect();
    let (seqs, slots) = (p.seqs, p.slots);
    work.par_iter().for_each(|&(si, h)| {
        let (optr, sptr) = (optr, sptr);
        let s = &seqs[si];
        let kh = g.key_head_of(h);
        // SAFETY: one task per (sequence, value head): it alone touches this
        // head's matrix in the sequence's slot and this head's output columns.
        let st = unsafe {
            std::slice::from_raw_parts_mut(
                sptr.0.add(slots[si].index() * vh * dk * dv + h * dk * dv),
                dk * dv,
            )
        };
        if s.cached == 0 {
            st.fill(0.0);
        }
        let (mut q, mut k, mut mem) = (vec![0f32; dk], vec![0f32; dk], vec![0f32; dv]);
        for r in s.row_start..s.row_start + s.rows {
            let row = qkv.row(r);
            q.copy_from_slice(&row[kh * dk..(kh + 1) * dk]);
            k.copy_from_slice(&row[key + kh * dk..key + (kh + 1) * dk]);
            let v = &row[2 * key + h * dv..2 * key + (h + 1) * dv];
            let qn = 1.0 / (q.iter().map(|x| x * x).sum::<f32>() + L2_EPS).sqrt();
            let kn = 1.0 / (k.iter().map(|x| x * x).sum::<f32>() + L2_EPS).sqrt();
            q.iter_mut().for_each(|x| *x *= qn * scale);
            k.iter_mut().for_each(|x| *x *= kn);
            let beta = sigmoid(b.row(r)[h]);
            let keep = (-decay[h] * softplus(a.row(r)[h] + dt_bias[h])).exp();
            // S is [dk, dv] row-major: decay it, read what it holds for k.
            mem.fill(0.0);
            for (i, srow) in st.chunks_mut(dv).enumerate() {
                for (m, sv) in mem.iter_mut().zip(srow.iter_mut()) {
                    *sv *= keep;
                    *m += *sv * k[i];
                }
            }
            // Write the correction towards v, then read with q.
            for (m, vj) in mem.iter_mut().zip(v) {
                *m = (vj - *m) * beta;
            }
            let o = unsafe { std::slice::from_raw_parts_mut(optr.0.add(r * out_cols + h * dv), dv) };
            o.fill(0.0);
            for (i, srow) in st.chunks_mut(dv).enumerate() {
                for ((sv, d), oj) in srow.iter_mut().zip(&mem).zip(o.iter_mut()) {
                    *sv += k[i] * d;
                    *oj += *sv * q[i];
                }
            }
        }
    });
    Ok(())
}

pub(super) fn gated_rms_norm(
    x: &mut CpuAct,
    z: &CpuAct,
    weight: &CpuWeight,
    eps: f32,
    head_dim: usize,
    rows: usize,
) -> Result<()> {
    let w = weight.vector();
    if x.cols != z.cols || w.len() != head_dim || head_dim == 0 || !x.cols.is_multiple_of(head_dim) {
        return Err(BackendError::Other(format!(
            "gated_rms_norm: {} columns, gate {}, weight {} for heads of {head_dim}",
            x.cols,
            z.cols,
            w.len()
        )));
    }
    x.live_mut(rows).par_chunks_mut(head_dim).zip(z.live(rows).par_chunks(head_dim)).for_each(|(h, zh)| {
        let ms = h.iter().map(|v| v * v).sum::<f32>() / head_dim as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((v, w), z) in h.iter_mut().zip(w.iter()).zip(zh) {
            *v = *v * inv * w * silu(*z);
        }
    });
    Ok(())
}
