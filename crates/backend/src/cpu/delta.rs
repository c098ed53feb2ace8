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

#[cfg(test)]
mod tests {
    use super::super::CpuBackend;
    use crate::{ActShape, Backend, DeltaGeometry, DeltaRule, HostTensor, SeqStep, TensorBytes, VHeadOrder};
    use corridor_units::{PageId, StateSlot};

    const G: DeltaGeometry = DeltaGeometry {
        k_heads: 2,
        v_heads: 4,
        k_dim: 3,
        v_dim: 2,
        conv_kernel: 3,
        v_order: VHeadOrder::Grouped,
    };

    /// Deterministic values in [-1, 1).
    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x % 2000) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn weight(b: &CpuBackend, rows: usize, cols: usize, v: &[f32]) -> super::CpuWeight {
        let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let t = HostTensor {
            name: "w".into(),
            dtype: crate::DType::F32,
            shape: vec![rows, cols],
            data: TensorBytes::from_vec(bytes),
        };
        b.upload_weight(&t).unwrap()
    }

    fn act(b: &CpuBackend, rows: usize, cols: usize, v: &[f32]) -> super::CpuAct {
        let mut a = b.alloc_act(ActShape { rows, cols }).unwrap();
        a.live_mut(rows).copy_from_slice(&v[..rows * cols]);
        a
    }

    /// The layer's state path (conv, then the delta rule) over `rows` rows of
    /// one sequence starting at `cached`, from and into `slot`.
    struct Layer {
        b: CpuBackend,
        conv_w: super::CpuWeight,
        decay: super::CpuWeight,
        dt: super::CpuWeight,
        conv: super::CpuAct,
        rec: super::CpuAct,
    }

    impl Layer {
        fn new() -> Layer {
            let b = CpuBackend::new();
            let c = G.conv_channels();
            Layer {
                conv_w: weight(&b, c, G.conv_kernel, &values(c * G.conv_kernel, 1)),
                decay: weight(&b, 1, G.v_heads, &[0.5, 1.0, 2.0, 0.1]),
                dt: weight(&b, 1, G.v_heads, &values(G.v_heads, 2)),
                conv: b.alloc_act(ActShape { rows: 2, cols: G.conv_state_elems() }).unwrap(),
                rec: b.alloc_act(ActShape { rows: 2, cols: G.recurrent_state_elems() }).unwrap(),
                b,
            }
        }

        /// Outputs of rows `from..to` of a fixed input sequence.
        fn run(&mut self, from: usize, to: usize, slot: u32) -> Vec<f32> {
            let (c, n) = (G.conv_channels(), to - from);
            let all_x = values(16 * c, 3);
            let all_ab = values(16 * 2 * G.v_heads, 4);
            let mut x = act(&self.b, n, c, &all_x[from * c..]);
            let a = act(&self.b, n, G.v_heads, &all_ab[from * G.v_heads..]);
            let bb = act(&self.b, n, G.v_heads, &all_ab[(16 + from) * G.v_heads..]);
            let mut out = self.b.alloc_act(ActShape { rows: n, cols: G.value_width() }).unwrap();
            let pages = [PageId(0)];
            let seqs = [SeqStep { row_start: 0, rows: n, cached: from, pages: &pages }];
            let slots = [StateSlot(slot)];
            self.b.causal_conv_silu(&mut x, &self.conv_w, &mut self.conv, &seqs, &slots).unwrap();
            self.b
                .gated_delta_rule(DeltaRule {
                    qkv: &x,
                    a: &a,
                    b: &bb,
                    decay: &self.decay,
                    dt_bias: &self.dt,
                    geometry: G,
                    state: &mut self.rec,
                    seqs: &seqs,
                    slots: &slots,
                    out: &mut out,
                })
                .unwrap();
            out.live(n).to_vec()
        }
    }

    /// Rows fed in two steps through the slot's state give what one step gives.
    #[test]
    fn the_state_carries_a_sequence_across_steps() {
        let mut one = Layer::new();
        let whole = one.run(0, 7, 1);
        let mut two = Layer::new();
        let mut split = two.run(0, 3, 1);
        split.extend(two.run(3, 7, 1));
        assert_eq!(whole.len(), split.len());
        for (a, b) in whole.iter().zip(&split) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        assert!(whole.iter().any(|v| v.abs() > 1e-3), "the outputs are not all zero");
        assert_eq!(one.rec.row(1), two.rec.row(1), "the same state is left in the slot");
        assert_eq!(one.conv.row(1), two.conv.row(1));
    }

    /// A sequence with nothing cached starts from zeros, whatever its slot
    /// held before (a slot is reused by the next request without clearing).
    #[test]
    fn a_new_sequence_ignores_what_its_slot_held() {
        let mut fresh = Layer::new();
        let want = fresh.run(0, 4, 0);
        let mut reused = Layer::new();
        reused.run(0, 6, 0);
        assert_eq!(reused.run(0, 4, 0), want);
    }

    #[test]
    fn shared_or_missing_slots_are_refused() {
        let mut l = Layer::new();
        let c = G.conv_channels();
        let mut x = act(&l.b, 2, c, &values(2 * c, 5));
        let pages = [PageId(0)];
        let seqs = [
            SeqStep { row_start: 0, rows: 1, cached: 0, pages: &pages },
            SeqStep { row_start: 1, rows: 1, cached: 0, pages: &pages },
        ];
        let shared =
            l.b.causal_conv_silu(&mut x, &l.conv_w, &mut l.conv, &seqs, &[StateSlot(1), StateSlot(1)]);
        assert!(shared.unwrap_err().to_string().contains("two sequences"));
        let outside =
            l.b.causal_conv_silu(&mut x, &l.conv_w, &mut l.conv, &seqs, &[StateSlot(0), StateSlot(2)]);
        assert!(outside.unwrap_err().to_string().contains("outside"));
        let short = l.b.causal_conv_silu(&mut x, &l.conv_w, &mut l.conv, &seqs, &[StateSlot(0)]);
        assert!(short.unwrap_err().to_string().contains("1 slots for 2 sequences"));
    }
}
