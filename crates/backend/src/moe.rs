//! The routed expert FFN of a sparse mixture-of-experts layer (Qwen3-MoE),
//! as one backend op: [`Backend::moe_ffn`](crate::Backend::moe_ffn).
//!
//! A router linear gives one logit per expert; a softmax over all experts
//! turns them into weights; each token keeps its `top_k` largest (ties to the
//! lower expert index), renormalized to sum to one when `norm_topk_prob` is
//! set; the token's output is the weighted sum of those experts' SwiGLU
//! outputs.
//!
//! [`unfused::moe_ffn`] is the op written with the plain ops, routing on the
//! host: the router logits are read back, the rows grouped by expert, and
//! each expert that any row chose runs once over exactly its rows, its
//! weighted output added into them. It is the trait's default and what the
//! CPU runs. A device backend routes on the device instead (no read-back, so
//! a decode step can be captured) and reads the chosen experts' weights
//! through an [`Backend::ExpertTable`](crate::Backend::ExpertTable) it builds
//! once per layer at load.

use crate::{ActShape, Backend, Result};

/// One expert's SwiGLU weights, sliced to the rank's expert columns.
pub struct Expert<W> {
    pub gate_proj: W, // [expert ffn, hidden]
    pub up_proj: W,   // [expert ffn, hidden]
    pub down_proj: W, // [hidden, expert ffn]
}

/// How a layer routes its rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Routing {
    pub num_experts: usize,
    /// Experts each row is sent to.
    pub top_k: usize,
    /// Renormalize each row's kept weights to sum to one.
    pub norm_topk_prob: bool,
}

/// The rows of one step grouped by expert: for expert `e`, the step rows
/// routed to it (ascending) and each row's routing weight.
#[derive(Debug, Default)]
pub struct Routes {
    rows: Vec<Vec<usize>>,
    weights: Vec<Vec<f32>>,
    /// Scratch for one row's ranking, kept to avoid a per-row allocation.
    order: Vec<usize>,
}

impl Routes {
    pub fn new(num_experts: usize) -> Routes {
        Routes {
            rows: vec![Vec::new(); num_experts],
            weights: vec![Vec::new(); num_experts],
            order: Vec::with_capacity(num_experts),
        }
    }

    /// Route `rows` rows of router logits (`[rows, num_experts]`, row-major).
    pub fn route(&mut self, routing: &Routing, logits: &[f32], rows: usize) {
        let n = routing.num_experts;
        for e in 0..n {
            self.rows[e].clear();
            self.weights[e].clear();
        }
        for r in 0..rows {
            let row = &logits[r * n..(r + 1) * n];
            // Softmax over every expert (in f32, as transformers computes it),
            // then the top k of the probabilities.
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = row.iter().map(|&l| (l - max).exp()).sum();
            self.order.clear();
            self.order.extend(0..n);
            // Highest first; ties go to the lower expert index, as torch.topk
            // returns them on the CPU.
            self.order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            let top = &self.order[..routing.top_k];
            let prob = |e: usize| (row[e] - max).exp() / sum;
            let kept: f32 = top.iter().map(|&e| prob(e)).sum();
            for &e in top {
                let p = prob(e);
                self.rows[e].push(r);
                self.weights[e].push(if routing.norm_topk_prob { p / kept } else { p });
            }
        }
    }

    /// The experts some row chose, ascending, with their rows and weights.
    pub fn chosen(&self) -> impl Iterator<Item = (usize, &[usize], &[f32])> {
        self.rows
            .iter()
            .zip(&self.weights)
            .enumerate()
            .filter(|(_, (r, _))| !r.is_empty())
            .map(|(e, (r, w))| (e, r.as_slice(), w.as_slice()))
    }
}

/// The sizes of a layer's expert FFN, for its scratch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeShape {
    /// Token rows of the largest step.
    pub max_rows: usize,
    pub hidden: usize,
    /// The rank's columns of one expert's FFN.
    pub expert_ffn: usize,
    pub routing: Routing,
}

impl MoeShape {
    /// (row, chosen expert) pairs of the largest step.
    pub fn max_pairs(&self) -> usize {
        self.max_rows * self.routing.top_k
    }

    /// 32-bit words of the routing metadata a device backend keeps per step
    /// (see [`MoeScratch::meta`]): per pair its expert, weight, sorted
    /// position and the pair at each position; per expert a count and an
    /// offset; the experts in use; and the work tiles of a grouped GEMM of
    /// `MOE_TILE_ROWS`-row tiles, three words each.
    pub fn meta_words(&self) -> usize {
        let (p, e) = (self.max_pairs(), self.routing.num_experts);
        let tiles = p.div_ceil(MOE_TILE_ROWS) + e.min(p);
        4 * p + 2 * (e + 1) + 2 + 3 * e + 3 * tiles
    }

    /// 32-bit words of the 8-bit copies a device backend's integer expert
    /// GEMVs read (see [`MoeScratch::q8`]): up to [`MOE_DECODE_ROWS`] input
    /// rows and their pairs' SiLU products, one after the other at 16-byte
    /// boundaries, each a code per value from its start and, from the next
    /// 16-byte boundary, a (scale, scaled sum) pair of f32 per 32 values.
    pub fn q8_words(&self) -> usize {
        let rows = self.max_rows.min(MOE_DECODE_ROWS);
        let bytes = |n: usize, cols: usize| {
            ((n * cols).next_multiple_of(16) + n * cols.div_ceil(32) * 8).next_multiple_of(16)
        };
        (bytes(rows, self.hidden) + bytes(rows * self.routing.top_k, self.expert_ffn)).div_ceil(4)
    }
}

/// Token rows up to which a device backend runs the routed decode kernels
/// (every chosen expert's weights read once); the scratch's 8-bit copies are
/// sized for that many.
pub const MOE_DECODE_ROWS: usize = 64;

/// Rows of one work tile of a device backend's grouped expert GEMM: the
/// metadata is sized for it here so every backend allocates the same scratch.
pub const MOE_TILE_ROWS: usize = 64;

/// Scratch of one sparse layer's FFN, allocated once at the largest step.
/// The unfused op uses `router`, `x`, `gate`, `up`, the first rows of `act`
/// and `y`, and the host fields; a device backend may use every buffer as
/// raw device memory of its size (`act`, `y` hold one row per pair).
pub struct MoeScratch<B: Backend + ?Sized> {
    pub router: B::Act, // [max_rows, num_experts]
    pub x: B::Act,      // [max_rows, hidden]       the rows routed to one expert
    pub gate: B::Act,   // [max_rows, expert ffn]
    pub up: B::Act,     // [max_rows, expert ffn]
    pub act: B::Act,    // [max_pairs, expert ffn]
    pub y: B::Act,      // [max_pairs, hidden]
    /// `[1, MoeShape::meta_words]`: the device's routing metadata.
    pub meta: B::Act,
    /// `[1, MoeShape::q8_words]`: the device's 8-bit copies of the rows and
    /// of the SiLU products, for block-format experts.
    pub q8: B::Act,
    pub host_router: Vec<f32>,
    pub routes: Routes,
    /// `max_rows` zeros: the ids that embed the zero row into every row.
    pub zero_ids: Vec<u32>,
    pub shape: MoeShape,
}

impl<B: Backend + ?Sized> MoeScratch<B> {
    pub fn new(b: &B, shape: MoeShape) -> Result<MoeScratch<B>> {
        let a = |rows: usize, cols: usize| b.alloc_act(ActShape { rows, cols });
        let (rows, pairs, ef) = (shape.max_rows, shape.max_pairs(), shape.expert_ffn);
        let n = shape.routing.num_experts;
        Ok(MoeScratch {
            router: a(rows, n)?,
            x: a(rows, shape.hidden)?,
            gate: a(rows, ef)?,
            up: a(rows, ef)?,
            act: a(pairs, ef)?,
            y: a(pairs, shape.hidden)?,
            meta: a(1, shape.meta_words())?,
            q8: a(1, shape.q8_words())?,
            host_router: Vec::with_capacity(rows * n),
            routes: Routes::new(n),
            zero_ids: vec![0; rows],
            shape,
        })
    }
}

/// The arguments of [`Backend::moe_ffn`]: `out = Σ_e w_e · down_e(silu(gate_e x) ⊙ up_e x)`
/// over each row's routed experts, for the first `rows` rows of `x`.
pub struct MoeFfn<'a, B: Backend + ?Sized> {
    /// `[rows, hidden]`: the normalized input.
    pub x: &'a B::Act,
    /// `[num_experts, hidden]`.
    pub router: &'a B::Weight,
    pub experts: &'a [Expert<B::Weight>],
    /// What [`Backend::expert_table`] built from `experts`.
    pub table: &'a B::ExpertTable,
    pub routing: Routing,
    /// `[1, hidden]` of zeros: embedding it clears `out` (the unfused op sums into it).
    pub zero_row: &'a B::Weight,
    pub rows: usize,
    pub scratch: &'a mut MoeScratch<B>,
    /// `[rows, hidden]`: overwritten.
    pub out: &'a mut B::Act,
}

/// [`Backend::moe_ffn`] with the plain ops, routing on the host.
pub mod unfused {
    use super::MoeFfn;
    use crate::{Backend, BackendError, Result};

    pub fn moe_ffn<B: Backend + ?Sized>(b: &B, p: MoeFfn<'_, B>) -> Result<()> {
        let MoeFfn { x, router, experts, routing, zero_row, rows, scratch: m, out, .. } = p;
        if experts.len() != routing.num_experts || routing.top_k == 0 || routing.top_k > routing.num_experts {
            return Err(BackendError::Other(format!(
                "moe_ffn: {} experts for {} routed, top {}",
                experts.len(),
                routing.num_experts,
                routing.top_k
            )));
        }
        b.matmul(x, router, None, rows, &mut m.router);
        b.read_rows(&m.router, rows, &mut m.host_router);
        b.check()?;
        m.routes.route(&routing, &m.host_router, rows);
        b.embedding(zero_row, &m.zero_ids[..rows], out)?;
        for (e, idx, weights) in m.routes.chosen() {
            let w = &experts[e];
            let n = idx.len();
            b.gather_rows(x, idx, &mut m.x);
            b.gate_up_silu(&m.x, &w.gate_proj, &w.up_proj, n, &mut m.gate, &mut m.up, &mut m.act);
            b.matmul(&m.act, &w.down_proj, None, n, &mut m.y);
            b.add_rows_scaled(out, rows, &m.y, idx, weights)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routing(k: usize, norm: bool) -> Routing {
        Routing { num_experts: 4, top_k: k, norm_topk_prob: norm }
    }

    #[test]
    fn rows_go_to_their_top_k_experts_with_softmax_weights() {
        let logits = [0.0, 2.0, 1.0, -1.0, 3.0, 0.0, 0.0, 3.5];
        let mut r = Routes::new(4);
        r.route(&routing(2, false), &logits, 2);
        let got: Vec<(usize, Vec<usize>)> = r.chosen().map(|(e, rows, _)| (e, rows.to_vec())).collect();
        assert_eq!(got, vec![(0, vec![1]), (1, vec![0]), (2, vec![0]), (3, vec![1])]);
        let z: f32 = [0.0f32, 2.0, 1.0, -1.0].iter().map(|l| l.exp()).sum();
        let (_, _, w1) = r.chosen().nth(1).unwrap();
        assert!((w1[0] - 2f32.exp() / z).abs() < 1e-6);
    }

    #[test]
    fn ties_go_to_the_lower_expert() {
        let logits = [1.0, 2.0, 2.0, 2.0];
        let mut r = Routes::new(4);
        r.route(&routing(2, true), &logits, 1);
        let got: Vec<usize> = r.chosen().map(|(e, _, _)| e).collect();
        assert_eq!(got, vec![1, 2]);
    }

    #[test]
    fn the_unfused_op_refuses_a_routing_its_experts_do_not_match() {
        use crate::cpu::CpuBackend;
        use crate::{Backend, DType, HostTensor, TensorBytes};
        let b = CpuBackend::new();
        let (hidden, ffn) = (8, 4);
        let t = |rows: usize, cols: usize| HostTensor {
            name: "w".into(),
            dtype: DType::F32,
            shape: vec![rows, cols],
            data: TensorBytes::from_vec(vec![0u8; 4 * rows * cols]),
        };
        let experts: Vec<_> = (0..2)
            .map(|_| Expert {
                gate_proj: b.upload_weight(&t(ffn, hidden)).unwrap(),
                up_proj: b.upload_weight(&t(ffn, hidden)).unwrap(),
                down_proj: b.upload_weight(&t(hidden, ffn)).unwrap(),
            })
            .collect();
        let (router, zero) =
            (b.upload_weight(&t(4, hidden)).unwrap(), b.upload_weight(&t(1, hidden)).unwrap());
        let x = b.alloc_act(ActShape { rows: 1, cols: hidden }).unwrap();
        let mut out = b.alloc_act(ActShape { rows: 1, cols: hidden }).unwrap();
        for routing in [routing(2, true), Routing { num_experts: 2, top_k: 3, norm_topk_prob: true }] {
            let shape = MoeShape { max_rows: 1, hidden, expert_ffn: ffn, routing };
            let mut scratch = MoeScratch::new(&b, shape).unwrap();
            let err = b
                .moe_ffn(MoeFfn {
                    x: &x,
                    router: &router,
                    experts: &experts,
                    table: &(),
                    routing,
                    zero_row: &zero,
                    rows: 1,
                    scratch: &mut scratch,
                    out: &mut out,
                })
                .expect_err("refused");
            assert!(err.to_string().contains("experts"), "{err}");
        }
    }

    #[test]
    fn norm_topk_prob_makes_each_rows_weights_sum_to_one() {
        let logits = [0.5, 2.0, 1.0, -1.0];
        let mut plain = Routes::new(4);
        plain.route(&routing(2, false), &logits, 1);
        let mut normed = Routes::new(4);
        normed.route(&routing(2, true), &logits, 1);
        let sum = |r: &Routes| r.chosen().map(|(_, _, w)| w[0]).sum::<f32>();
        assert!((sum(&normed) - 1.0).abs() < 1e-6);
        assert!(sum(&plain) < 0.95, "the plain weights leave out the other experts' mass");
    }
}
