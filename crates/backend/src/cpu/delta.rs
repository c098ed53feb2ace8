//! The CPU kernels of a gated delta-net layer (Qwen3.5's linear attention):
//! its short causal convolution, the gated delta rule and the gated norm,
//! plus the sigmoid gate of its full-attention layers.
//!
//! Each sequence's state lives in one row of a state buffer (its slot). Decode
//! runs the recurrence token by token; a prompt runs it a chunk of tokens at
//! a time in its equal chunked form ([`chunk`]), which reads the state once
//! per chunk rather than twice per token and does its work in GEMMs.

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

/// Tokens per chunk of the chunked delta rule. A chunk costs about
/// `6·k_dim·v_dim + CHUNK·(4·k_dim + 3·v_dim)` flops per token, nearly all in
/// GEMMs, against the recurrence's `4·k_dim·v_dim` in rank-1 updates that
/// stream the whole state twice per token: a longer chunk fills the GEMMs
/// better but grows its triangle. Measured on a 2-core EPYC, one head of
/// Qwen3.5-27B's shape (`k_dim = v_dim = 128`) over 2048 tokens, best of 20:
/// 3.8 ms at 16, 3.05 ms at 32, 3.7 ms at 64 (the recurrence: 9.4 ms).
const CHUNK: usize = 32;

/// Rows of one sequence from which a step takes the chunked form; decode (one
/// row) keeps the recurrence. Measured on the same head, one chunk of n rows
/// against n recurrence steps: 0.5× at 1 row, even at 2, 1.45× at 3, 1.8× at
/// 4, 2.7× at 8, 3.2× at 16. Heads as small as the test fixtures'
/// (`k_dim = v_dim = 16`, a state that stays in L1) break even only at about
/// 16 rows, but there the whole step takes microseconds either way.
const CHUNK_MIN_ROWS: usize = 4;

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

/// What one value head reads of a row: its query and key (shared with the
/// other value heads of its key head), its value and its two gates.
struct HeadInput<'a> {
    qkv: &'a CpuAct,
    a: &'a CpuAct,
    b: &'a CpuAct,
    /// The value head.
    h: usize,
    /// First columns of its query, key and value in a qkv row.
    q0: usize,
    k0: usize,
    v0: usize,
    dk: usize,
    dv: usize,
    decay: f32,
    dt_bias: f32,
    /// `1/√k_dim`, folded into the query.
    scale: f32,
}

impl HeadInput<'_> {
    /// Writes row `r`'s L2-normalized query (times the scale) and key into
    /// `q` and `k`; returns its value, its write strength `β = σ(b)` and the
    /// log of its state's decay, `-decay·softplus(a + dt_bias)`.
    fn read(&self, r: usize, q: &mut [f32], k: &mut [f32]) -> (&[f32], f32, f32) {
        let row = self.qkv.row(r);
        q.copy_from_slice(&row[self.q0..self.q0 + self.dk]);
        k.copy_from_slice(&row[self.k0..self.k0 + self.dk]);
        let qn = 1.0 / (q.iter().map(|x| x * x).sum::<f32>() + L2_EPS).sqrt();
        let kn = 1.0 / (k.iter().map(|x| x * x).sum::<f32>() + L2_EPS).sqrt();
        q.iter_mut().for_each(|x| *x *= qn * self.scale);
        k.iter_mut().for_each(|x| *x *= kn);
        let beta = sigmoid(self.b.row(r)[self.h]);
        let log_keep = -self.decay * softplus(self.a.row(r)[self.h] + self.dt_bias);
        (&row[self.v0..self.v0 + self.dv], beta, log_keep)
    }
}

/// Where one (sequence, value head) task writes its outputs: the head's
/// columns of the sequence's first row, rows `stride` apart.
#[derive(Clone, Copy)]
struct HeadOut {
    ptr: *mut f32,
    stride: usize,
}

impl HeadOut {
    /// The head's outputs in the sequence's row `t`.
    ///
    /// # Safety
    /// `t` is one of the sequence's rows, the task alone writes these columns
    /// of these rows, and no other reference to the slice is live while the
    /// returned one is.
    unsafe fn row<'o>(self, t: usize, dv: usize) -> &'o mut [f32] {
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(t * self.stride), dv) }
    }

    /// The outputs from the sequence's row `t` on.
    fn at_row(self, t: usize) -> HeadOut {
        HeadOut { ptr: self.ptr.wrapping_add(t * self.stride), ..self }
    }
}

pub(super) fn gated_delta_rule(p: Delta<'_>) -> Result<()> {
    delta_rule(p, CHUNK_MIN_ROWS)
}

/// [`gated_delta_rule`] with the rows from which a sequence takes the chunked
/// form as an argument, so that tests can run either form on any input.
fn delta_rule(p: Delta<'_>, chunk_min_rows: usize) -> Result<()> {
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
        let input = HeadInput {
            qkv,
            a,
            b,
            h,
            q0: kh * dk,
            k0: key + kh * dk,
            v0: 2 * key + h * dv,
            dk,
            dv,
            decay: decay[h],
            dt_bias: dt_bias[h],
            scale,
        };
        let out = HeadOut { ptr: optr.0.wrapping_add(s.row_start * out_cols + h * dv), stride: out_cols };
        if s.rows >= chunk_min_rows {
            let mut scratch = ChunkScratch::new(dk, dv, CHUNK.min(s.rows));
            for c0 in (0..s.rows).step_by(CHUNK) {
                let n = CHUNK.min(s.rows - c0);
                chunk(&input, s.row_start + c0, n, st, out.at_row(c0), &mut scratch);
            }
        } else {
            recurrence(&input, s.row_start, s.rows, st, out);
        }
    });
    Ok(())
}

/// The delta rule token by token over rows `r0..r0 + n`: per token `t`, with
/// `S` the `[k_dim, v_dim]` state,
/// `S ← keep_t·S;  d_t = β_t (v_t − Sᵀk_t);  S ← S + k_t d_tᵀ;  o_t = Sᵀq_t`.
fn recurrence(input: &HeadInput<'_>, r0: usize, n: usize, st: &mut [f32], out: HeadOut) {
    let (dk, dv) = (input.dk, input.dv);
    let (mut q, mut k, mut mem) = (vec![0f32; dk], vec![0f32; dk], vec![0f32; dv]);
    for t in 0..n {
        let (v, beta, log_keep) = input.read(r0 + t, &mut q, &mut k);
        let keep = log_keep.exp();
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
        // SAFETY: row t is one of this task's rows (see HeadOut::row).
        let o = unsafe { out.row(t, dv) };
        o.fill(0.0);
        for (i, srow) in st.chunks_mut(dv).enumerate() {
            for ((sv, d), oj) in srow.iter_mut().zip(&mem).zip(o.iter_mut()) {
                *sv += k[i] * d;
                *oj += *sv * q[i];
            }
        }
    }
}

/// One task's buffers for [`chunk`], allocated once per sequence and head.
struct ChunkScratch {
    /// `[2n, k_dim]`: the chunk's queries, then its keys.
    qk: Vec<f32>,
    /// `[2n, v_dim]`: `Q·S0`, then `K·S0`.
    qks: Vec<f32>,
    /// `[2n, n]`: `Q·Kᵀ`, then `K·Kᵀ`.
    gram: Vec<f32>,
    /// `[n, v_dim]`: the corrections `d_t`, one row per token.
    d: Vec<f32>,
    /// `[n, n]`: the decays `exp(G_t − G_s)` (zero above the diagonal), then
    /// the causal, decayed `Q·Kᵀ` that reads the corrections.
    p: Vec<f32>,
    /// `[n, k_dim]`: the keys decayed to the chunk's end.
    k_end: Vec<f32>,
    /// `[n]`: write strengths, decays and the decays since the chunk's
    /// start, `γ_t = exp(G_t)`.
    beta: Vec<f32>,
    keep: Vec<f32>,
    gamma: Vec<f32>,
}

impl ChunkScratch {
    /// Room for chunks of up to `c` rows.
    fn new(dk: usize, dv: usize, c: usize) -> ChunkScratch {
        ChunkScratch {
            qk: vec![0.0; 2 * c * dk],
            qks: vec![0.0; 2 * c * dv],
            gram: vec![0.0; 2 * c * c],
            d: vec![0.0; c * dv],
            p: vec![0.0; c * c],
            k_end: vec![0.0; c * dk],
            beta: vec![0.0; c],
            keep: vec![0.0; c],
            gamma: vec![0.0; c],
        }
    }
}

/// `C = A·B` (`beta_c = 0`) or `C += A·B` (`beta_c = 1`) over row-major
/// slices given with their (row, column) strides.
///
/// # Safety
/// Each pointer spans its matrix at its strides; `c` aliases neither input.
unsafe fn gemm(
    (m, k, n): (usize, usize, usize),
    a: (*const f32, usize, usize),
    b: (*const f32, usize, usize),
    beta_c: f32,
    c: (*mut f32, usize),
) {
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.0,
            a.1 as isize,
            a.2 as isize,
            b.0,
            b.1 as isize,
            b.2 as isize,
            beta_c,
            c.0,
            c.1 as isize,
            1,
        )
    }
}

/// The delta rule over one chunk of `n ≤ CHUNK` rows `r0..r0 + n` at once,
/// equal to [`recurrence`] over them. With `G_t` the sum of the log-decays of
/// the chunk's tokens up to `t`, `γ_t = exp(G_t)` and `S0` the state at the
/// chunk's start, unrolling the recurrence gives
/// `S_t = γ_t S0 + Σ_{s≤t} exp(G_t − G_s) k_s d_sᵀ`, so the corrections solve
/// the unit lower-triangular system
/// `d_t + Σ_{s<t} β_t exp(G_t − G_s)(k_t·k_s) d_s = β_t (v_t − γ_t S0ᵀk_t)`
/// (forward substitution, one `v_dim` row per token), and then
/// `o_t = γ_t S0ᵀq_t + Σ_{s≤t} exp(G_t − G_s)(q_t·k_s) d_s` and
/// `S_n = γ_n S0 + Σ_s exp(G_n − G_s) k_s d_sᵀ`. The state is read twice and
/// written once per chunk instead of twice per token, and everything but the
/// triangle runs as GEMMs. Every decay factor is at most 1, so nothing
/// overflows however strong the decay.
fn chunk(input: &HeadInput<'_>, r0: usize, n: usize, st: &mut [f32], out: HeadOut, w: &mut ChunkScratch) {
    let (dk, dv) = (input.dk, input.dv);
    let (qs, ks) = w.qk[..2 * n * dk].split_at_mut(n * dk);
    let mut g_sum = 0.0;
    for t in 0..n {
        let (v, beta, log_keep) =
            input.read(r0 + t, &mut qs[t * dk..(t + 1) * dk], &mut ks[t * dk..(t + 1) * dk]);
        g_sum += log_keep;
        w.keep[t] = log_keep.exp();
        w.gamma[t] = g_sum.exp();
        w.beta[t] = beta;
        // The right-hand side's value part; S0ᵀk_t joins it below.
        for (d, vj) in w.d[t * dv..(t + 1) * dv].iter_mut().zip(v) {
            *d = beta * vj;
        }
    }
    // decays[t][s] = exp(G_t − G_s) = keep_t·decays[t−1][s] for s < t: one
    // product per entry, no exponential (they would cost more than the
    // triangle's arithmetic), each entry's relative error about one rounding
    // per token between s and t, and no precision lost to a large |G|.
    for t in 0..n {
        let (above, rest) = w.p[..n * n].split_at_mut(t * n);
        let row = &mut rest[..n];
        if t > 0 {
            let keep = w.keep[t];
            for (d, x) in row[..t].iter_mut().zip(&above[(t - 1) * n..]) {
                *d = keep * x;
            }
        }
        row[t] = 1.0;
        row[t + 1..].fill(0.0);
    }
    let (qk, gamma, beta) = (&w.qk[..2 * n * dk], &w.gamma[..n], &w.beta[..n]);
    // SAFETY (all GEMMs): every matrix lies in its buffer at the strides
    // given, and the outputs are distinct buffers (or this task's rows of
    // the output and its own state).
    unsafe {
        // [Q; K]·S0: [2n, dk]·[dk, dv].
        gemm((2 * n, dk, dv), (qk.as_ptr(), dk, 1), (st.as_ptr(), dv, 1), 0.0, (w.qks.as_mut_ptr(), dv));
        // [Q; K]·Kᵀ: [2n, dk]·[dk, n], Kᵀ read through K's strides.
        gemm(
            (2 * n, dk, n),
            (qk.as_ptr(), dk, 1),
            (qk[n * dk..].as_ptr(), 1, dk),
            0.0,
            (w.gram.as_mut_ptr(), n),
        );
    }
    let (qs0, ks0) = w.qks[..2 * n * dv].split_at(n * dv);
    let (qq, kk) = w.gram[..2 * n * n].split_at(n * n);
    let decays = &mut w.p[..n * n];
    for t in 0..n {
        let (done, rest) = w.d.split_at_mut(t * dv);
        let dt = &mut rest[..dv];
        let bg = beta[t] * gamma[t];
        for (d, m) in dt.iter_mut().zip(&ks0[t * dv..(t + 1) * dv]) {
            *d -= bg * m;
        }
        for (s, ds) in done.chunks_exact(dv).enumerate() {
            let a = beta[t] * decays[t * n + s] * kk[t * n + s];
            for (d, x) in dt.iter_mut().zip(ds) {
                *d -= a * x;
            }
        }
    }
    let last = &decays[(n - 1) * n..];
    for ((ke, k), f) in w.k_end[..n * dk].chunks_exact_mut(dk).zip(qk[n * dk..].chunks_exact(dk)).zip(last) {
        for (e, x) in ke.iter_mut().zip(k) {
            *e = f * x;
        }
    }
    for t in 0..n {
        // SAFETY: row t is one of this task's rows (see HeadOut::row).
        let o = unsafe { out.row(t, dv) };
        for (o, x) in o.iter_mut().zip(&qs0[t * dv..(t + 1) * dv]) {
            *o = gamma[t] * x;
        }
        for (p, x) in decays[t * n..=t * n + t].iter_mut().zip(&qq[t * n..]) {
            *p *= x;
        }
    }
    let gamma_end = gamma[n - 1];
    st.iter_mut().for_each(|x| *x *= gamma_end);
    unsafe {
        // O += P·D: [n, n]·[n, dv], into rows `stride` apart.
        gemm((n, n, dv), (w.p.as_ptr(), n, 1), (w.d.as_ptr(), dv, 1), 1.0, (out.ptr, out.stride));
        // S += K_endᵀ·D: [dk, n]·[n, dv], K_endᵀ read through its strides.
        gemm((dk, n, dv), (w.k_end.as_ptr(), 1, dk), (w.d.as_ptr(), dv, 1), 1.0, (st.as_mut_ptr(), dv));
    }
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
        // The same state is left in the slot, to rounding: the 7- and 4-row
        // steps take the chunked form, the 3-row one the recurrence.
        for (a, b) in one.rec.row(1).iter().zip(two.rec.row(1)) {
            assert!((a - b).abs() < 1e-5, "state {a} vs {b}");
        }
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

    /// A geometry of several value heads sharing key heads, with
    /// `k_dim ≠ v_dim` so that a transposed state shows.
    const GQA: DeltaGeometry = DeltaGeometry {
        k_heads: 2,
        v_heads: 6,
        k_dim: 8,
        v_dim: 5,
        conv_kernel: 4,
        v_order: VHeadOrder::Grouped,
    };

    /// Per-head decay rates of [`GQA`], from near 0 to Qwen3.5's large ones,
    /// so some chunks decay by many orders of magnitude.
    const DECAYS: [f32; 6] = [0.05, 0.5, 1.0, 2.0, 4.0, 8.0];

    /// One delta-rule step of [`GQA`] over fixed random inputs, one row per
    /// token of `seqs`, from and into `state`; `chunk_min_rows` picks the form.
    struct DeltaCase {
        b: CpuBackend,
        qkv: super::CpuAct,
        a: super::CpuAct,
        bb: super::CpuAct,
        decay: super::CpuWeight,
        dt: super::CpuWeight,
    }

    impl DeltaCase {
        fn new(rows: usize, seed: u32) -> DeltaCase {
            let b = CpuBackend::new();
            let (c, h) = (GQA.conv_channels(), GQA.v_heads);
            DeltaCase {
                qkv: act(&b, rows, c, &values(rows * c, seed)),
                a: act(&b, rows, h, &values(rows * h, seed + 1)),
                bb: act(&b, rows, h, &values(rows * h, seed + 2)),
                decay: weight(&b, 1, h, &DECAYS),
                dt: weight(&b, 1, h, &values(h, seed + 3)),
                b,
            }
        }

        fn run(
            &self,
            state: &mut super::CpuAct,
            seqs: &[SeqStep<'_>],
            slots: &[StateSlot],
            chunk_min_rows: usize,
        ) -> Vec<f32> {
            let rows: usize = seqs.iter().map(|s| s.row_start + s.rows).max().unwrap();
            let mut out = self.b.alloc_act(ActShape { rows, cols: GQA.value_width() }).unwrap();
            super::delta_rule(
                super::Delta {
                    qkv: &self.qkv,
                    a: &self.a,
                    b: &self.bb,
                    decay: &self.decay,
                    dt_bias: &self.dt,
                    g: GQA,
                    state,
                    seqs,
                    slots,
                    out: &mut out,
                },
                chunk_min_rows,
            )
            .unwrap();
            out.live(rows).to_vec()
        }
    }

    /// The largest difference of `got` from `want`, over `want`'s largest value.
    fn relative_error(got: &[f32], want: &[f32]) -> f32 {
        assert_eq!(got.len(), want.len());
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(scale > 1e-2, "the reference is not all near zero");
        got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
    }

    /// 1e-5 of the output's scale: the two forms sum the same terms in
    /// another order (f32, about 1e-7 per operation, over a few hundred terms).
    const CHUNK_TOL: f32 = 1e-5;

    /// Prompts of every length around the chunk size, one with nothing cached
    /// and one resuming from a cached state (a random matrix in its slot), in
    /// one step: the chunked form gives the recurrence's outputs and state.
    #[test]
    fn the_chunked_rule_equals_the_recurrence() {
        use super::CHUNK;
        for n in [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5] {
            let case = DeltaCase::new(2 * n, n as u32);
            let pages = [PageId(0)];
            let seqs = [
                SeqStep { row_start: 0, rows: n, cached: 0, pages: &pages },
                SeqStep { row_start: n, rows: n, cached: 7, pages: &pages },
            ];
            let slots = [StateSlot(2), StateSlot(0)];
            let mut held = case.b.alloc_act(ActShape { rows: 3, cols: GQA.recurrent_state_elems() }).unwrap();
            let len = held.data.len();
            held.data.copy_from_slice(&values(len, 99));
            let mut rec = held.clone();
            let mut chunked = held.clone();
            let want = case.run(&mut rec, &seqs, &slots, usize::MAX);
            let got = case.run(&mut chunked, &seqs, &slots, 1);
            let err = relative_error(&got, &want);
            assert!(err < CHUNK_TOL, "{n} rows: outputs differ by {err} of their scale");
            for slot in [0, 2] {
                let err = relative_error(chunked.row(slot), rec.row(slot));
                assert!(err < CHUNK_TOL, "{n} rows: the state in slot {slot} differs by {err}");
            }
            assert_eq!(chunked.row(1), held.row(1), "{n} rows: a slot no sequence names is left alone");
        }
    }

    /// A prompt fed in two steps through the chunked form (the first ending
    /// mid-chunk) gives what the recurrence gives in one.
    #[test]
    fn the_chunked_rule_carries_the_state_across_steps() {
        let n = 3 * super::CHUNK + 5;
        let split = super::CHUNK + 9;
        let case = DeltaCase::new(n, 5);
        let pages = [PageId(0)];
        let zeros = || case.b.alloc_act(ActShape { rows: 1, cols: GQA.recurrent_state_elems() }).unwrap();
        let mut whole_state = zeros();
        let whole = case.run(
            &mut whole_state,
            &[SeqStep { row_start: 0, rows: n, cached: 0, pages: &pages }],
            &[StateSlot(0)],
            usize::MAX,
        );
        let mut state = zeros();
        let mut got = case.run(
            &mut state,
            &[SeqStep { row_start: 0, rows: split, cached: 0, pages: &pages }],
            &[StateSlot(0)],
            1,
        );
        got.truncate(split * GQA.value_width());
        let rest = case.run(
            &mut state,
            &[SeqStep { row_start: split, rows: n - split, cached: split, pages: &pages }],
            &[StateSlot(0)],
            1,
        );
        got.extend_from_slice(&rest[split * GQA.value_width()..]);
        let err = relative_error(&got, &whole);
        assert!(err < CHUNK_TOL, "outputs differ by {err} of their scale");
        let err = relative_error(state.row(0), whole_state.row(0));
        assert!(err < CHUNK_TOL, "the final state differs by {err}");
    }

    /// A step takes the chunked form from `CHUNK_MIN_ROWS` rows of a sequence
    /// and the recurrence below (the two differ in their last bits).
    #[test]
    fn a_prompt_of_a_few_rows_takes_the_chunked_form() {
        let min = super::CHUNK_MIN_ROWS;
        let case = DeltaCase::new(2 * min, 11);
        let pages = [PageId(0)];
        let seqs = [
            SeqStep { row_start: 0, rows: min - 1, cached: 0, pages: &pages },
            SeqStep { row_start: min - 1, rows: min, cached: 0, pages: &pages },
        ];
        let slots = [StateSlot(0), StateSlot(1)];
        let zeros = || case.b.alloc_act(ActShape { rows: 2, cols: GQA.recurrent_state_elems() }).unwrap();
        let forms = [usize::MAX, 1, min].map(|m| case.run(&mut zeros(), &seqs, &slots, m));
        let (rec, chunked, chosen) = (&forms[0], &forms[1], &forms[2]);
        let cut = (min - 1) * GQA.value_width();
        assert_eq!(chosen[..cut], rec[..cut], "below the switch, the recurrence");
        assert_ne!(chunked[cut..], rec[cut..], "the forms differ in their last bits");
        assert_eq!(chosen[cut..], chunked[cut..], "from the switch, the chunked form");
    }
}
