//! The draw: the one step that turns an adjusted row into a token, and the
//! part a GPU kernel replaces.
//!
//! The candidate set, for temperature `T > 0`: weigh each token by
//! `w_i = exp((l_i - max) / T)` (so the top token weighs exactly 1), order
//! tokens by [`rank_order`], then keep
//! 1. the first `top_k` tokens (all when `top_k` is unset),
//! 2. of those, the shortest prefix whose weight reaches `top_p` of their
//!    total (a token stays when the weight strictly before it is below
//!    `top_p × total`, so the top token always stays),
//! 3. of those, the tokens with `w_i ≥ min_p` (relative to the top token).
//!
//! A token whose weight underflowed to zero is never a candidate. The token is then
//! drawn with probability proportional to its weight among the candidates,
//! by inverse CDF on the row's single uniform draw. With `T = 0` the draw is
//! the argmax. Weights and sums are f64, so no logit in f32 range can
//! overflow them.

use corridor_units::TokenId;

use super::logits::{argmax, rank_order};

/// The truncation and temperature of one row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DrawSpec {
    /// Softmax temperature; 0 means argmax.
    pub temperature: f32,
    /// Keep at most this many tokens; `None` keeps all.
    pub top_k: Option<u32>,
    /// Nucleus mass in `(0, 1]`.
    pub top_p: f32,
    /// Relative probability floor in `[0, 1]`.
    pub min_p: f32,
}

/// Chooses one token from a sanitized, adjusted row.
///
/// An implementation may be wrong (a GPU kernel that fails returns garbage):
/// the caller checks its answer with [`super::guard::settle_draw`], so a
/// kernel reports failure as `None` and never needs to be trusted.
pub trait DrawKernel: Sync {
    /// `row`: [vocab] finite values or -inf, at least one finite.
    /// `uniform`: the row's draw in `[0, 1)`.
    fn draw(&self, row: &[f32], spec: &DrawSpec, uniform: f64) -> Option<TokenId>;
}

/// The reference CPU draw described in the module documentation.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuDrawKernel;

/// When nucleus sampling needs the ranked prefix, it first ranks only this
/// many tokens and grows the window by 8× until the prefix fits in it: most
/// of a real vocabulary lies far outside any nucleus, and ranking all 150k
/// entries of a row costs far more than the draw itself.
const FIRST_TOP_P_WINDOW: usize = 256;

impl DrawKernel for CpuDrawKernel {
    fn draw(&self, row: &[f32], spec: &DrawSpec, uniform: f64) -> Option<TokenId> {
        if spec.temperature == 0.0 {
            return argmax(row);
        }
        let top = argmax(row)?;
        let max = row[top as usize] as f64;
        let inv_t = 1.0 / spec.temperature as f64;
        let weight = |i: u32| ((row[i as usize] as f64 - max) * inv_t).exp();
        let min_p = spec.min_p as f64;

        // Tokens of zero weight are never candidates.
        let mut cands: Vec<(u32, f64)> =
            (0..row.len() as u32).map(|i| (i, weight(i))).filter(|&(_, w)| w > 0.0).collect();
        let by_rank = |a: &(u32, f64), b: &(u32, f64)| rank_order(row, a.0, b.0);

        if let Some(k) = spec.top_k.map(|k| k as usize) {
            if k == 0 {
                return None;
            }
            if k < cands.len() {
                cands.select_nth_unstable_by(k - 1, by_rank);
                cands.truncate(k);
            }
        }
        if spec.top_p < 1.0 {
            let total: f64 = cands.iter().map(|c| c.1).sum();
            let limit = spec.top_p as f64 * total;
            let mut window = FIRST_TOP_P_WINDOW.min(cands.len());
            loop {
                if window < cands.len() {
                    cands.select_nth_unstable_by(window - 1, by_rank);
                }
                cands[..window].sort_unstable_by(by_rank);
                let mut before = 0.0;
                let mut keep = None;
                for (n, c) in cands[..window].iter().enumerate() {
                    if before >= limit {
                        keep = Some(n);
                        break;
                    }
                    before += c.1;
                }
                match keep {
                    Some(n) => {
                        cands.truncate(n);
                        break;
                    }
                    None if window == cands.len() => break,
                    None => window = (window * 8).min(cands.len()),
                }
            }
        }
        if min_p > 0.0 {
            cands.retain(|c| c.1 >= min_p);
        }

        let total: f64 = cands.iter().map(|c| c.1).sum();
        if cands.is_empty() || !(total.is_finite() && total > 0.0) {
            return None;
        }
        let target = uniform * total;
        let mut cum = 0.0;
        for &(token, w) in &cands {
            cum += w;
            if cum > target {
                return Some(token);
            }
        }
        // Rounding left `target` at or past the last partial sum: the draw
        // belongs to the last candidate.
        cands.last().map(|c| c.0)
    }
}
