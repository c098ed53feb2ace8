//! The sparse mixture-of-experts FFN (Qwen3-MoE): a router linear gives one
//! logit per expert, a softmax over all experts turns them into weights, each
//! token keeps its `experts_per_token` largest (renormalized to sum to one
//! when the config says `norm_topk_prob`), and the token's FFN output is the
//! weighted sum of those experts' SwiGLU outputs.
//!
//! Routing runs on the host: the router logits of the step's rows are read
//! back, and the rows are grouped by expert, so each expert that any token
//! chose runs once over exactly its rows and the weights of experts no token
//! chose are never read. Under tensor parallelism every rank holds the whole
//! router and a share of every expert's columns: the all-reduce before the
//! layer hands every rank the same hidden state, so all ranks route alike,
//! and their outputs are partial sums, like the dense MLP's.

use crate::config::MoeConfig;

/// One expert's SwiGLU weights, sliced to the rank's expert columns.
pub(crate) struct Expert<W> {
    pub gate_proj: W, // [expert ffn, hidden]
    pub up_proj: W,   // [expert ffn, hidden]
    pub down_proj: W, // [hidden, expert ffn]
}

/// The rows of one step grouped by expert: for expert `e`, the step rows
/// routed to it (ascending) and each row's routing weight.
#[derive(Debug, Default)]
pub(crate) struct Routes {
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
    pub fn route(&mut self, moe: &MoeConfig, logits: &[f32], rows: usize) {
        let n = moe.num_experts;
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
            let top = &self.order[..moe.experts_per_token];
            let prob = |e: usize| (row[e] - max).exp() / sum;
            let kept: f32 = top.iter().map(|&e| prob(e)).sum();
            for &e in top {
                let p = prob(e);
                self.rows[e].push(r);
                self.weights[e].push(if moe.norm_topk_prob { p / kept } else { p });
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

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(k: usize, norm: bool) -> MoeConfig {
        MoeConfig {
            num_experts: 4,
            experts_per_token: k,
            expert_intermediate_size: 8,
            norm_topk_prob: norm,
            sparse_layers: vec![true],
        }
    }

    #[test]
    fn rows_go_to_their_top_k_experts_with_softmax_weights() {
        let logits = [0.0, 2.0, 1.0, -1.0, 3.0, 0.0, 0.0, 3.5];
        let mut r = Routes::new(4);
        r.route(&moe(2, false), &logits, 2);
        let got: Vec<(usize, Vec<usize>)> = r.chosen().map(|(e, rows, _)| (e, rows.to_vec())).collect();
        assert_eq!(got, vec![(0, vec![1]), (1, vec![0]), (2, vec![0]), (3, vec![1])]);
        let z: f32 = [0.0f32, 2.0, 1.0, -1.0].iter().map(|l| l.exp()).sum();
        let (_, _, w1) = r.chosen().nth(1).unwrap();
        assert!((w1[0] - 2f32.exp() / z).abs() < 1e-6);
    }

    #[test]
    fn norm_topk_prob_makes_each_rows_weights_sum_to_one() {
        let logits = [0.5, 2.0, 1.0, -1.0];
        let mut plain = Routes::new(4);
        plain.route(&moe(2, false), &logits, 1);
        let mut normed = Routes::new(4);
        normed.route(&moe(2, true), &logits, 1);
        let sum = |r: &Routes| r.chosen().map(|(_, _, w)| w[0]).sum::<f32>();
        assert!((sum(&normed) - 1.0).abs() < 1e-6);
        assert!(sum(&plain) < 0.95, "the plain weights leave out the other experts' mass");
    }
}
