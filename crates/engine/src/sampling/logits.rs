//! Row-level logit processing shared by every sampler implementation:
//! sanitizing the model's output, penalties, bias, masks, argmax and
//! log-probabilities.
//!
//! Conventions: a row is `[vocab]` f32 logits. After [`sanitize`] a row holds
//! only finite values and -inf; -inf is a legitimate value meaning "this token
//! is impossible" (a mask, a padded vocabulary slot), whereas NaN and +inf
//! are signs of a broken forward pass. Every function here tolerates token
//! ids outside the row by ignoring them, so an unvalidated request cannot
//! make it index out of bounds.

use std::cmp::Ordering;

use corridor_units::TokenId;

use super::outcome::TokenLogprob;
use super::params::SamplingParams;
use super::state::SamplerState;

/// What [`sanitize`] found in the model's row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RawScan {
    /// Entries that were NaN (now -inf).
    pub nan: usize,
    /// Entries that were +inf (now `f32::MAX`).
    pub pos_inf: usize,
}

impl RawScan {
    /// True when the row held a value no healthy forward pass produces.
    pub fn is_broken(&self) -> bool {
        self.nan > 0 || self.pos_inf > 0
    }
}

super::simd::multiversion! {
    /// Replaces NaN with -inf and +inf with `f32::MAX`, and reports how many of
    /// each it found. +inf becomes the largest finite value rather than -inf so
    /// that argmax still picks the token the model shouted for, while softmax
    /// stays defined.
    pub fn sanitize(row: &mut [f32]) -> RawScan {
        // Branch-free, so it vectorizes: it runs over every logit of every row.
        let (mut nan, mut pos_inf) = (0usize, 0usize);
        for v in row.iter_mut() {
            let is_nan = v.is_nan();
            let is_inf = *v == f32::INFINITY;
            nan += is_nan as usize;
            pos_inf += is_inf as usize;
            *v = if is_nan {
                f32::NEG_INFINITY
            } else if is_inf {
                f32::MAX
            } else {
                *v
            };
        }
        RawScan { nan, pos_inf }
    }
}

/// Keeps a processed value inside the sanitized domain: an overflow to +inf
/// (a huge logit divided by a small repetition penalty) becomes `f32::MAX`.
fn settle(v: f32) -> f32 {
    if v.is_nan() {
        f32::NEG_INFINITY
    } else {
        v.min(f32::MAX)
    }
}

/// Applies, in this order: the repetition penalty over prompt and output
/// tokens, the frequency and presence penalties over output tokens, the
/// clamped `logit_bias`, and the masks (end-of-sequence and stop tokens while
/// fewer than `min_tokens` were generated; end-of-sequence always under
/// `ignore_eos`). Bias comes after the penalties so that ±100 keeps its
/// "ban or force" meaning instead of being rescaled by the repetition
/// penalty; masks come last because they are absolute.
///
/// `row`: [vocab], sanitized. `eos`: the model's end-of-sequence ids.
pub fn apply_adjustments(row: &mut [f32], params: &SamplingParams, state: &SamplerState, eos: &[TokenId]) {
    let rep = params.repetition_penalty;
    if rep != 1.0 {
        debug_assert!(state.prompt_tracked(), "state made without the repetition penalty's prompt tokens");
        let penalize = |row: &mut [f32], token: TokenId| {
            if let Some(v) = row.get_mut(token.index()) {
                *v = settle(if *v > 0.0 { *v / rep } else { *v * rep });
            }
        };
        for &token in state.prompt_tokens() {
            penalize(row, token);
        }
        for &token in state.output_counts().keys() {
            // A token in both prompt and output is penalized once.
            if !state.prompt_tokens().contains(&token) {
                penalize(row, token);
            }
        }
    }
    let (freq, pres) = (params.frequency_penalty, params.presence_penalty);
    if freq != 0.0 || pres != 0.0 {
        for (&token, &count) in state.output_counts() {
            if let Some(v) = row.get_mut(token.index()) {
                let presence = if count > 0 { pres } else { 0.0 };
                *v = settle(*v - (count as f32 * freq + presence));
            }
        }
    }
    for (&token, &bias) in &params.logit_bias {
        if let Some(v) = row.get_mut(token.index()) {
            *v = settle(*v + SamplingParams::clamped_bias(bias));
        }
    }
    let mask = |row: &mut [f32], ids: &[TokenId]| {
        for &token in ids {
            if let Some(v) = row.get_mut(token.index()) {
                *v = f32::NEG_INFINITY;
            }
        }
    };
    let before_min = state.generated() < params.min_tokens;
    if before_min || params.ignore_eos {
        mask(row, eos);
    }
    if before_min {
        mask(row, &params.stop_token_ids);
    }
}

/// The order every sampler uses to rank tokens: higher logit first, lower id
/// first among equal logits. Truncation sets are prefixes of this order.
pub fn rank_order(row: &[f32], a: u32, b: u32) -> Ordering {
    row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b))
}

super::simd::multiversion! {
    /// The first token with the largest logit, or `None` when every entry is -inf
    /// (or NaN, which `total_cmp` would otherwise rank above everything).
    pub fn argmax(row: &[f32]) -> Option<TokenId> {
        // Two passes that vectorize: the largest value (NaN never wins a `>`),
        // then the first index holding it.
        let mut lanes = [f32::NEG_INFINITY; 8];
        let mut chunks = row.chunks_exact(8);
        for c in &mut chunks {
            for j in 0..8 {
                lanes[j] = if c[j] > lanes[j] { c[j] } else { lanes[j] };
            }
        }
        let mut best = lanes.iter().copied().fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a });
        for &v in chunks.remainder() {
            if v > best {
                best = v;
            }
        }
        if best == f32::NEG_INFINITY {
            return None;
        }
        row.iter().position(|&v| v == best).map(|i| TokenId(i as u32))
    }
}

/// Rows at least this long are sanitized and searched in parallel slices
/// (a step that samples one row would otherwise leave every core but one idle
/// while the card waits for its token).
pub const WIDE_ROW_MIN: usize = 1 << 16;
const WIDE_SLICE: usize = 1 << 14;

/// [`sanitize`] over parallel slices of a long row: the same row, the same counts.
pub fn sanitize_wide(row: &mut [f32]) -> RawScan {
    use rayon::prelude::*;
    if row.len() < WIDE_ROW_MIN {
        return sanitize(row);
    }
    row.par_chunks_mut(WIDE_SLICE)
        .map(sanitize)
        .reduce(RawScan::default, |a, b| RawScan { nan: a.nan + b.nan, pos_inf: a.pos_inf + b.pos_inf })
}

/// [`argmax`] over parallel slices of a long row: the same token (the first
/// of the largest value).
pub fn argmax_wide(row: &[f32]) -> Option<TokenId> {
    use rayon::prelude::*;
    if row.len() < WIDE_ROW_MIN {
        return argmax(row);
    }
    row.par_chunks(WIDE_SLICE)
        .enumerate()
        .filter_map(|(i, c)| argmax(c).map(|j| (i * WIDE_SLICE + j.index(), c[j.index()])))
        .reduce_with(|a, b| if b.1 > a.1 || (b.1 == a.1 && b.0 < a.0) { b } else { a })
        .map(|(i, _)| TokenId(i as u32))
}

/// Natural-log normalizer of a sanitized row: `ln Σ exp(l_i)`, computed in
/// f64 around the maximum so that neither huge nor tiny logits overflow.
/// `None` when every entry is -inf.
pub fn log_sum_exp(row: &[f32]) -> Option<f64> {
    let max = row.iter().copied().filter(|v| !v.is_nan()).fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return None;
    }
    let m = max as f64;
    let sum: f64 = row.iter().filter(|v| !v.is_nan()).map(|&v| (v as f64 - m).exp()).sum();
    Some(m + sum.ln())
}

/// The `n` most likely tokens with their log-probabilities (`lse` from
/// [`log_sum_exp`]), most likely first. Tokens of probability zero (-inf) are
/// never listed, so fewer than `n` may come back.
pub fn top_logprobs(row: &[f32], n: usize, lse: f64) -> Vec<TokenLogprob> {
    if n == 0 {
        return Vec::new();
    }
    let mut ids: Vec<u32> = (0..row.len() as u32).filter(|&i| row[i as usize] > f32::NEG_INFINITY).collect();
    if ids.len() > n {
        ids.select_nth_unstable_by(n - 1, |&a, &b| rank_order(row, a, b));
        ids.truncate(n);
    }
    ids.sort_unstable_by(|&a, &b| rank_order(row, a, b));
    ids.into_iter()
        .map(|i| TokenLogprob { token: TokenId(i), logprob: (row[i as usize] as f64 - lse) as f32 })
        .filter(|t| t.logprob.is_finite())
        .collect()
}

#[cfg(test)]
mod argmax_tests {
    use super::*;

    #[test]
    fn argmax_takes_the_first_largest_finite_value() {
        // Ties go to the first index, in and after the vectorized body.
        let mut row = vec![0.5f32; 37];
        row[9] = 2.0;
        row[30] = 2.0;
        assert_eq!(argmax(&row), Some(TokenId(9)));
        row[35] = 3.0; // in the remainder past the last whole chunk
        assert_eq!(argmax(&row), Some(TokenId(35)));
        row[3] = f32::NAN; // NaN never wins
        assert_eq!(argmax(&row), Some(TokenId(35)));
        assert_eq!(argmax(&[f32::NEG_INFINITY; 19]), None);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY, -1e30]), Some(TokenId(2)));
        assert_eq!(argmax(&[]), None);
    }

    #[test]
    fn wide_row_passes_match_the_plain_ones() {
        let n = WIDE_ROW_MIN * 2 + 12_345;
        let mut row: Vec<f32> = (0..n).map(|i| ((i as u64 * 2_654_435_761) % 1000) as f32 / 100.0).collect();
        // Specials in several slices, and the maximum tied across slices:
        // the first one must win.
        row[5] = f32::NAN;
        row[WIDE_SLICE * 3 + 7] = f32::INFINITY;
        row[WIDE_SLICE * 5 + 1] = f32::NAN;
        row[WIDE_SLICE * 2 + 9] = 50.0;
        row[WIDE_SLICE + 4] = 50.0;
        row[n - 1] = 50.0;
        let (mut a, mut b) = (row.clone(), row.clone());
        assert_eq!(sanitize_wide(&mut a), sanitize(&mut b));
        assert_eq!(
            a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(argmax_wide(&a), argmax(&a));
        // Without the +inf (now f32::MAX) the tie at 50 decides.
        a[WIDE_SLICE * 3 + 7] = 0.0;
        assert_eq!(argmax_wide(&a), Some(TokenId((WIDE_SLICE + 4) as u32)));
        assert_eq!(argmax_wide(&a), argmax(&a));
        a.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
        assert_eq!(argmax_wide(&a), None);
    }

    #[test]
    fn sanitize_counts_and_replaces() {
        let mut row =
            vec![1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -2.0, 0.0, 3.0, f32::INFINITY];
        let scan = sanitize(&mut row);
        assert_eq!((scan.nan, scan.pos_inf), (2, 2));
        assert_eq!(
            row,
            [
                1.0,
                f32::NEG_INFINITY,
                f32::MAX,
                f32::NEG_INFINITY,
                f32::NEG_INFINITY,
                -2.0,
                0.0,
                3.0,
                f32::MAX
            ]
        );
    }
}
