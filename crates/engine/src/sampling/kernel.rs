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
//! by inverse CDF on the row's single uniform draw, walking the candidates
//! in rank order when `top_p < 1` or `top_k` is below the number of tokens
//! of positive weight, in vocabulary order otherwise (only `min_p`, or
//! nothing, truncates). With `T = 0` the draw is
//! the argmax. Weights are at most 1 (f32 from [`weight_of`], relative error
//! under 3e-7) and sums are f64, so no logit in f32 range can overflow them.
//!
//! Without truncation (no `top_k`, `top_p = 1`, `min_p = 0`: the default)
//! every token is a candidate in vocabulary order, so the draw needs no
//! candidate list: the row is cut into fixed blocks of [`DRAW_BLOCK`] tokens,
//! each block's weight is summed (blocks in parallel on a large row), the
//! block holding the draw is found from the block sums and only it is walked.
//! The blocks are fixed, so a row draws the same token whatever the batch or
//! the thread count.

use corridor_units::TokenId;

use super::logits::{argmax, argmax_wide, rank_order};

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

/// Tokens per block of the untruncated draw.
pub const DRAW_BLOCK: usize = 4096;

/// Rows at least this long sum their blocks in parallel.
const PARALLEL_DRAW_MIN: usize = 4 * DRAW_BLOCK;

/// `e^x` for `x <= 0`, in f32: exactly 1 at 0, exactly 0 below -87 (and at
/// -inf, so a masked token weighs nothing), relative error under 3e-7
/// elsewhere. Branch-free, so a loop over a block vectorizes.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Round to nearest by the 1.5 * 2^23 trick: a call to `round` (or the
    // NaN rules of `max`) would keep the loop from vectorizing.
    const SHIFTER: f32 = 12_582_912.0;
    const C: [f32; 6] = [1.0 / 2.0, 1.0 / 6.0, 1.0 / 24.0, 1.0 / 120.0, 1.0 / 720.0, 1.0 / 5040.0];
    let keep = if x < -87.0 { 0.0 } else { 1.0 };
    let xc = if x < -87.0 { -87.0 } else { x };
    let k = (xc * std::f32::consts::LOG2_E + SHIFTER) - SHIFTER;
    let r = (xc - k * LN2_HI) - k * LN2_LO;
    // e^r on |r| <= ln2/2: Taylor to degree 7, Horner's rule.
    let p = 1.0 + r * (1.0 + r * (C[0] + r * (C[1] + r * (C[2] + r * (C[3] + r * (C[4] + r * C[5]))))));
    // SAFETY: k is a whole number in [-126, 0] (xc is in [-87, 0]), so it fits an i32.
    let ki = unsafe { k.to_int_unchecked::<i32>() };
    let scale = f32::from_bits(((ki + 127) as u32) << 23);
    // A select, not a branch, so a loop over a block stays vectorized.
    p * scale * keep
}

/// A token's weight `exp((l - max) / T)` given `inv_t = 1 / T`: what every
/// path of the draw weighs tokens by.
#[inline(always)]
pub fn weight_of(logit: f32, max: f32, inv_t: f32) -> f32 {
    let x = (logit - max) * inv_t;
    exp_nonpositive(if x > 0.0 { 0.0 } else { x })
}

super::simd::multiversion! {
    /// The f64 sum of one block's weights, with eight partial sums so the loop
    /// vectorizes (a fixed order, so the same on every machine and thread).
    fn block_weight(block: &[f32], max: f32, inv_t: f32) -> f64 {
        let mut acc = [0f64; 8];
        let mut w = [0f32; 8];
        let mut chunks = block.chunks_exact(8);
        for c in &mut chunks {
            for j in 0..8 {
                w[j] = weight_of(c[j], max, inv_t);
            }
            for j in 0..8 {
                acc[j] += w[j] as f64;
            }
        }
        let tail: f64 = chunks.remainder().iter().map(|&l| weight_of(l, max, inv_t) as f64).sum();
        acc.iter().sum::<f64>() + tail
    }
}

/// The weight of each block of [`DRAW_BLOCK`] tokens of the row, in order
/// (blocks in parallel on a large row; each block's sum is the same either
/// way).
fn block_sums(row: &[f32], max: f32, inv_t: f32) -> Vec<f64> {
    use rayon::prelude::*;
    let block_sum = |b: usize| -> f64 {
        let lo = b * DRAW_BLOCK;
        let hi = (lo + DRAW_BLOCK).min(row.len());
        block_weight(&row[lo..hi], max, inv_t)
    };
    let blocks = row.len().div_ceil(DRAW_BLOCK);
    if row.len() >= PARALLEL_DRAW_MIN {
        (0..blocks).into_par_iter().map(block_sum).collect()
    } else {
        (0..blocks).map(block_sum).collect()
    }
}

/// The weight of the whole row: its block sums added in order. Every path
/// whose top-p limit is a share of the whole row takes this sum, so they
/// cut at the same token.
fn row_weight(row: &[f32], max: f32, inv_t: f32) -> f64 {
    block_sums(row, max, inv_t).iter().sum()
}

/// The inverse-CDF draw over every token of positive weight, in vocabulary
/// order, by blocks (see the module documentation).
fn draw_untruncated(row: &[f32], max: f32, inv_t: f32, uniform: f64) -> Option<TokenId> {
    let weight = |i: u32| weight_of(row[i as usize], max, inv_t) as f64;
    let sums = block_sums(row, max, inv_t);
    let total: f64 = sums.iter().sum();
    if !(total.is_finite() && total > 0.0) {
        return None;
    }
    let target = uniform * total;
    let mut cum = 0.0;
    for (b, &sum) in sums.iter().enumerate() {
        if sum > 0.0 && cum + sum > target {
            let lo = b * DRAW_BLOCK;
            let hi = (lo + DRAW_BLOCK).min(row.len());
            let mut last = None;
            for i in lo as u32..hi as u32 {
                let w = weight(i);
                if w > 0.0 {
                    cum += w;
                    last = Some(i);
                    if cum > target {
                        return Some(TokenId(i));
                    }
                }
            }
            // Rounding inside the block: the draw belongs to its last candidate.
            return last.map(TokenId);
        }
        cum += sum;
    }
    // Rounding left `target` at or past the total: the last candidate.
    (0..row.len() as u32).rev().find(|&i| weight(i) > 0.0).map(TokenId)
}

impl DrawKernel for CpuDrawKernel {
    fn draw(&self, row: &[f32], spec: &DrawSpec, uniform: f64) -> Option<TokenId> {
        if spec.temperature == 0.0 {
            return argmax(row);
        }
        let top = argmax_wide(row)?;
        let max = row[top.index()];
        let inv_t = 1.0 / spec.temperature;
        let weight = |i: u32| weight_of(row[i as usize], max, inv_t) as f64;
        let min_p = spec.min_p as f64;
        if spec.top_k.is_none() && spec.top_p >= 1.0 && min_p <= 0.0 {
            return draw_untruncated(row, max, inv_t, uniform);
        }
        if spec.top_k.is_none() && min_p > 0.0 {
            return draw_min_p(row, max, inv_t, spec.top_p, min_p, uniform);
        }

        // Tokens of zero weight are never candidates.
        let mut cands: Vec<(u32, f64)> =
            (0..row.len() as u32).map(|i| (i, weight(i))).filter(|&(_, w)| w > 0.0).collect();
        let by_rank = |a: &(u32, f64), b: &(u32, f64)| rank_order(row, a.0, b.0);

        let cut_by_top_k = spec.top_k.is_some_and(|k| (k as usize) < cands.len());
        if let Some(k) = spec.top_k.map(|k| k as usize) {
            if k == 0 {
                return None;
            }
            if k < cands.len() {
                cands.select_nth_unstable_by(k - 1, by_rank);
                cands.truncate(k);
                // The draw walks the candidates in rank order, not in
                // whatever order the selection left them, so any
                // implementation that finds the same set draws the same token.
                cands.sort_unstable_by(by_rank);
            }
        }
        if spec.top_p < 1.0 {
            // Unless top-k cut them, the candidates are every token of
            // positive weight, and their total is the row's.
            let total: f64 =
                if cut_by_top_k { cands.iter().map(|c| c.1).sum() } else { row_weight(row, max, inv_t) };
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
        draw_from(&cands, uniform)
    }
}

/// The candidate set when `min_p` is set and `top_k` is not, without ranking
/// the whole row: the tokens with `w_i ≥ min_p` are a prefix of the rank
/// order, and so is the top-p cut, so the candidates are the shorter of the
/// two, and only the few tokens at or above `min_p` are ranked. The top-p
/// limit is the same sum over the whole row ([`row_weight`]) as the general
/// path takes, so the draw is the same token, bit for bit.
fn draw_min_p(row: &[f32], max: f32, inv_t: f32, top_p: f32, min_p: f64, uniform: f64) -> Option<TokenId> {
    // `w ≥ min_p` needs `x = (l - max) / T ≥ ln(min_p)` (the weight is
    // `e^x` within 3e-7), so a group of eight tokens whose every `x` is below
    // that, less a margin far wider than the weight's error, is passed over
    // without weighing it: the scan is a subtraction, a product and a compare
    // per token, branch-free within the eight so it vectorizes, and only the
    // groups near the top are weighed, token by token.
    let floor = (min_p.ln() - 1e-3) as f32;
    let mut cands: Vec<(u32, f64)> = Vec::new();
    for (c, group) in row.chunks(8).enumerate() {
        let near = group.iter().fold(false, |any, &l| any | ((l - max) * inv_t >= floor));
        if !near {
            continue;
        }
        for (j, &l) in group.iter().enumerate() {
            let w = weight_of(l, max, inv_t) as f64;
            if w > 0.0 && w >= min_p {
                cands.push(((c * 8 + j) as u32, w));
            }
        }
    }
    if top_p < 1.0 {
        let limit = top_p as f64 * row_weight(row, max, inv_t);
        cands.sort_unstable_by(|a, b| rank_order(row, a.0, b.0));
        let mut before = 0.0;
        let cut = cands.iter().position(|c| {
            let reached = before >= limit;
            before += c.1;
            reached
        });
        if let Some(n) = cut {
            cands.truncate(n);
        }
    }
    draw_from(&cands, uniform)
}

/// Draw from candidates by inverse CDF on `uniform`, in their order.
fn draw_from(cands: &[(u32, f64)], uniform: f64) -> Option<TokenId> {
    let total: f64 = cands.iter().map(|c| c.1).sum();
    if cands.is_empty() || !(total.is_finite() && total > 0.0) {
        return None;
    }
    let target = uniform * total;
    let mut cum = 0.0;
    for &(token, w) in cands {
        cum += w;
        if cum > target {
            return Some(TokenId(token));
        }
    }
    // Rounding left `target` at or past the last partial sum: the draw
    // belongs to the last candidate.
    cands.last().map(|c| TokenId(c.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_exact_at_the_ends_and_close_between() {
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(-87.5), 0.0);
        let mut worst = 0f64;
        let mut x = 0f32;
        while x > -87.0 {
            let want = (x as f64).exp();
            worst = worst.max(((exp_nonpositive(x) as f64 - want) / want).abs());
            x -= 0.000_73;
        }
        assert!(worst < 3e-7, "relative error {worst:e}");
    }

    /// A block's sum is the same bits whichever build of the loop runs (the
    /// wide one on a CPU with AVX2 and FMA): eight lanes, each in order.
    #[test]
    fn block_sums_are_the_same_bits_on_every_vector_width() {
        let row: Vec<f32> = (0..DRAW_BLOCK + 5)
            .map(|i| if i % 31 == 3 { f32::NEG_INFINITY } else { ((i * 48271) % 2003) as f32 / 97.0 - 9.0 })
            .collect();
        for inv_t in [0.37f32, 1.0, 3.1] {
            let got = block_weight(&row, 11.5, inv_t);
            let mut lanes = [0f64; 8];
            let whole = row.len() / 8 * 8;
            for (i, &l) in row[..whole].iter().enumerate() {
                lanes[i % 8] += std::hint::black_box(weight_of(l, 11.5, inv_t)) as f64;
            }
            let tail: f64 = row[whole..].iter().map(|&l| weight_of(l, 11.5, inv_t) as f64).sum();
            let want = lanes.iter().sum::<f64>() + tail;
            assert_eq!(got.to_bits(), want.to_bits(), "inv_t {inv_t}");
        }
    }

    /// The blocked draw picks the token a plain walk over every weight picks.
    #[test]
    fn blocked_draw_equals_the_plain_inverse_cdf() {
        // Several blocks and a ragged last one, with masked tokens between.
        let n = 3 * DRAW_BLOCK + 1234;
        let row: Vec<f32> = (0..n)
            .map(|i| if i % 97 == 5 { f32::NEG_INFINITY } else { ((i * 7919) % 1000) as f32 / 90.0 - 4.0 })
            .collect();
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for t in [0.3f32, 1.0, 2.5] {
            let inv_t = 1.0 / t;
            let w: Vec<f64> = row.iter().map(|&l| weight_of(l, max, inv_t) as f64).collect();
            let total: f64 = w.iter().sum();
            for k in 0..500 {
                let u = (k as f64 + 0.5) / 500.0;
                let target = u * total;
                let (mut cum, mut want) = (0.0, None);
                for (i, &wi) in w.iter().enumerate() {
                    cum += wi;
                    if wi > 0.0 && cum > target {
                        want = Some(TokenId(i as u32));
                        break;
                    }
                }
                let got = draw_untruncated(&row, max, inv_t, u);
                // Summation order differs: only a draw within rounding of a boundary may differ.
                if got != want {
                    let g = got.unwrap().index();
                    let before: f64 = w[..g].iter().sum();
                    assert!(
                        (before - target).abs() < 1e-9 * total
                            || (before + w[g] - target).abs() < 1e-9 * total
                    );
                }
                assert!(got.is_some_and(|g| row[g.index()] > f32::NEG_INFINITY));
            }
        }
    }

    #[test]
    fn min_p_without_top_k_draws_what_the_general_path_draws() {
        // The general path is taken when top_k is set; top_k = vocab keeps
        // every token, so both paths must choose the same token bit for bit.
        let n = 5000;
        let row: Vec<f32> = (0..n)
            .map(|i| if i % 61 == 3 { f32::NEG_INFINITY } else { ((i * 7919) % 1000) as f32 / 120.0 - 3.0 })
            .collect();
        let mut checked = 0;
        for temperature in [0.2f32, 0.7, 1.0, 1.8] {
            for top_p in [0.3f32, 0.9, 0.999, 1.0] {
                for min_p in [0.001f32, 0.05, 0.3, 1.0] {
                    let fast = DrawSpec { temperature, top_k: None, top_p, min_p };
                    let general = DrawSpec { top_k: Some(n as u32), ..fast };
                    for k in 0..200 {
                        let u = (k as f64 + 0.37) / 200.0;
                        assert_eq!(
                            CpuDrawKernel.draw(&row, &fast, u),
                            CpuDrawKernel.draw(&row, &general, u),
                            "{fast:?} at {u}"
                        );
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 4 * 4 * 4 * 200);
    }
}
