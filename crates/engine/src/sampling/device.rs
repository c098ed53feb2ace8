//! Rows sampled where their logits are: what the host sends a backend's
//! [`corridor_backend::Backend::sample_rows`] and how it settles what comes
//! back, by the same rules and counters as a row sampled on the host.
//!
//! The host keeps everything a request carries: its random stream (the
//! row's one uniform is drawn here, exactly as [`super::CpuSampler`] draws
//! it), its history (turned into the sparse [`LogitEdit`] list that
//! [`adjustment_edits`] makes, the same arithmetic as
//! [`super::logits::apply_adjustments`]) and the fallback rules
//! ([`super::guard::settle_summary`]). The device only sanitizes, edits and
//! draws. A row that wants log-probabilities or has a grammar mask needs its
//! whole row on the host, so the engine never sends one here.
//!
//! [`host_op`] is the op itself on the host: what a device must compute,
//! written with the host sampler's own pieces, for tests and for checking a
//! device against.

use corridor_backend::sample::{
    LogitEdit, RowSummary, SampleRowSpec, EDIT_BIAS, EDIT_MASK, NO_TOKEN, ROW_DRAWN, ROW_TOO_MANY_CANDIDATES,
};
use corridor_units::TokenId;

use super::cpu::conclude;
use super::guard::{settle_draw, settle_summary};
use super::kernel::{CpuDrawKernel, DrawKernel, DrawSpec};
use super::logits::{argmax, sanitize, RawScan};
use super::outcome::SampleOutcome;
use super::params::SamplingParams;
use super::state::SamplerState;
use super::stats::SamplerStats;
use super::SampleRow;

/// Appends to `out` the edits [`super::logits::apply_adjustments`] would make
/// to a row of `vocab` logits for `params` and `state`: one entry per token
/// it touches, in no particular order (each token's edit is independent of
/// the others'). Runs every step for every device row, so the penalties'
/// edits, the many (a prompt token each), are the state's own list, kept up
/// to date as tokens are recorded, and copied whole; only the few others
/// (`logit_bias`, masks) are merged into them here.
pub fn adjustment_edits(
    params: &SamplingParams,
    state: &mut SamplerState,
    eos: &[TokenId],
    vocab: usize,
    out: &mut Vec<LogitEdit>,
) {
    let start = out.len();
    let before_min = state.generated() < params.min_tokens;
    let penalties = state.penalty_edits(params, vocab);
    if let Some(p) = penalties {
        out.extend_from_slice(&p.edits);
    }
    let held = penalties.map(|p| &p.at);
    // The edits of `logit_bias` and the masks, merged with the penalties'
    // edit of the same token, else with one made here before (from `extra` on).
    let extra = out.len();
    let edit = |out: &mut Vec<LogitEdit>, token: TokenId, f: &dyn Fn(&mut LogitEdit)| {
        if token.index() >= vocab {
            return;
        }
        let i = match held.and_then(|at| at.get(&token)) {
            Some(&i) => start + i,
            None => match out[extra..].iter().position(|e| e.token == token.get()) {
                Some(j) => extra + j,
                None => {
                    out.push(LogitEdit { token: token.get(), rep: 1.0, sub: 0.0, bias: 0.0, flags: 0 });
                    out.len() - 1
                }
            },
        };
        f(&mut out[i]);
    };
    for (&token, &bias) in &params.logit_bias {
        edit(out, token, &|e| {
            e.bias = SamplingParams::clamped_bias(bias);
            e.flags |= EDIT_BIAS;
        });
    }
    if before_min || params.ignore_eos {
        for &token in eos {
            edit(out, token, &|e| e.flags |= EDIT_MASK);
        }
    }
    if before_min {
        for &token in &params.stop_token_ids {
            edit(out, token, &|e| e.flags |= EDIT_MASK);
        }
    }
}

/// At least as many edits as [`adjustment_edits`] makes for this row, without
/// making them: a row above [`corridor_backend::sample::MAX_EDITS_PER_ROW`]
/// is sampled on the host.
pub fn edits_bound(params: &SamplingParams, state: &SamplerState, eos: &[TokenId]) -> usize {
    let penalized = if params.repetition_penalty != 1.0 { state.prompt_tokens().len() } else { 0 };
    penalized
        + state.output_counts().len()
        + params.logit_bias.len()
        + eos.len()
        + params.stop_token_ids.len()
}

/// Keeps a processed value inside the sanitized domain, as the host's
/// adjustments do.
fn settle(v: f32) -> f32 {
    if v.is_nan() {
        f32::NEG_INFINITY
    } else {
        v.min(f32::MAX)
    }
}

/// Applies `edits` to a sanitized row by the arithmetic documented at
/// [`LogitEdit`]. Tokens outside the row are ignored.
pub fn apply_edits(row: &mut [f32], edits: &[LogitEdit]) {
    for e in edits {
        let Some(v) = row.get_mut(e.token as usize) else { continue };
        // Untouched steps leave `v` as it is: `v / 1`, `v * 1` and `v - 0`
        // are exact, and the bias is added only when flagged.
        *v = settle(if *v > 0.0 { *v / e.rep } else { *v * e.rep });
        *v = settle(*v - e.sub);
        if e.flags & EDIT_BIAS != 0 {
            *v = settle(*v + e.bias);
        }
        if e.flags & EDIT_MASK != 0 {
            *v = f32::NEG_INFINITY;
        }
    }
}

/// Draws the row's uniform (its one draw for this token) and appends its
/// edits to `edits`: the spec of `row` for the device, which reads logits
/// row `logit_row`.
pub fn plan_row(
    row: &mut SampleRow<'_>,
    vocab: usize,
    logit_row: u32,
    edits: &mut Vec<LogitEdit>,
) -> SampleRowSpec {
    let uniform = row.state.next_uniform();
    let start = edits.len();
    adjustment_edits(row.params, row.state, row.eos_token_ids, vocab, edits);
    let p = row.params;
    SampleRowSpec {
        row: logit_row,
        edits_start: start as u32,
        edits_len: (edits.len() - start) as u32,
        top_k: p.top_k.unwrap_or(0),
        temperature: p.temperature,
        inv_t: if p.temperature > 0.0 { 1.0 / p.temperature } else { 0.0 },
        top_p: p.top_p,
        min_p: p.min_p,
        uniform,
    }
}

/// The draw a spec asks for, as the host's kernel takes it.
pub fn draw_spec(spec: &SampleRowSpec) -> DrawSpec {
    DrawSpec {
        temperature: spec.temperature,
        top_k: (spec.top_k > 0).then_some(spec.top_k),
        top_p: spec.top_p,
        min_p: spec.min_p,
    }
}

/// Settles one row the device handled and finishes it as the host sampler
/// finishes a row: the token by [`settle_summary`], or, for a row whose
/// candidates did not fit the device (`spilled` holds its sanitized,
/// adjusted logits), drawn here from `spilled` with the spec's uniform and
/// settled by [`settle_draw`]. Counted in `stats` either way.
pub fn settle_row(
    stats: &SamplerStats,
    row: &mut SampleRow<'_>,
    spec: &SampleRowSpec,
    summary: &RowSummary,
    vocab: usize,
    spilled: Option<&[f32]>,
) -> SampleOutcome {
    let scan = RawScan { nan: summary.nan as usize, pos_inf: summary.pos_inf as usize };
    stats.record_device_row(spilled.is_some());
    let settled = match spilled {
        Some(logits)
            if summary.status == ROW_TOO_MANY_CANDIDATES && !summary.is_broken() && logits.len() == vocab =>
        {
            // The device found the row sane (it spills only rows it would
            // draw), so only the draw is left to do.
            settle_draw(logits, CpuDrawKernel.draw(logits, &draw_spec(spec), spec.uniform), scan.nan)
        }
        _ => settle_summary(summary, vocab),
    };
    conclude(stats, row, scan, vocab, settled, None)
}

/// The op on the host: sanitize `row` (the model's logits), apply the
/// spec's `edits`, and draw as the device would, leaving the adjusted row
/// in `row`. A row whose draw is skipped (broken, or nothing finite) has no
/// token; the caller's guard decides it from the argmax.
pub fn host_op(row: &mut [f32], spec: &SampleRowSpec, edits: &[LogitEdit]) -> RowSummary {
    let scan = sanitize(row);
    let lo = spec.edits_start as usize;
    apply_edits(row, &edits[lo..lo + spec.edits_len as usize]);
    let best = argmax(row);
    let drawn = match best {
        Some(_) if !scan.is_broken() => CpuDrawKernel.draw(row, &draw_spec(spec), spec.uniform),
        _ => None,
    };
    RowSummary {
        token: drawn.map_or(NO_TOKEN, TokenId::get),
        argmax: best.map_or(NO_TOKEN, TokenId::get),
        nan: scan.nan as u32,
        pos_inf: scan.pos_inf as u32,
        value_bits: drawn.map_or(f32::NEG_INFINITY, |t| row[t.index()]).to_bits(),
        status: ROW_DRAWN,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::logits::apply_adjustments;
    use crate::sampling::outcome::FallbackKind;
    use crate::sampling::{CpuSampler, Sampler};
    use corridor_units::RequestId;
    use corridor_units::Tokens;
    use std::sync::Arc;

    /// xorshift64*: deterministic inputs without a dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545f4914f6cdd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        /// Uniform in [-1, 1).
        fn f(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
    }

    /// Logits with every value the edits must treat right: masked slots,
    /// both zeros, huge values a penalty can push past f32::MAX, NaN, +inf.
    fn row(rng: &mut Rng, vocab: usize, specials: bool) -> Vec<f32> {
        (0..vocab)
            .map(|_| match rng.below(if specials { 40 } else { 1000 }) {
                0 => f32::NEG_INFINITY,
                1 => 0.0,
                2 => -0.0,
                3 => f32::MAX / 1.5,
                4 => -f32::MAX / 1.5,
                5 if specials => f32::NAN,
                6 if specials => f32::INFINITY,
                _ => rng.f() * 12.0,
            })
            .collect()
    }

    fn params(rng: &mut Rng, vocab: usize) -> SamplingParams {
        let mut p = SamplingParams::default();
        if rng.below(3) > 0 {
            p.repetition_penalty = [1.1, 0.7, 1.9, 1.0][rng.below(4) as usize];
        }
        if rng.below(2) == 0 {
            p.frequency_penalty = rng.f() * 2.0;
        }
        if rng.below(2) == 0 {
            p.presence_penalty = rng.f() * 2.0;
        }
        for _ in 0..rng.below(6) {
            let bias = [0.0, -0.0, 250.0, -100.0, rng.f() * 30.0][rng.below(5) as usize];
            p.logit_bias.insert(TokenId(rng.below(vocab as u64) as u32), bias);
        }
        p.min_tokens = Tokens(rng.below(4) as usize);
        p.ignore_eos = rng.below(3) == 0;
        p.stop_token_ids = (0..rng.below(3)).map(|_| TokenId(rng.below(vocab as u64) as u32)).collect();
        p
    }

    fn state(rng: &mut Rng, p: &SamplingParams, vocab: usize) -> SamplerState {
        // Ids past the vocabulary too: both sides must ignore them.
        let prompt: Vec<TokenId> =
            (0..rng.below(40)).map(|_| TokenId(rng.below(vocab as u64 + 5) as u32)).collect();
        let mut s = SamplerState::new(&SamplingParams { seed: Some(rng.next()), ..p.clone() }, &prompt, &[]);
        // The penalties' edits are first made after `early` tokens (then kept
        // up to date by `record`), or from the whole history when past the end.
        let n = rng.below(12);
        let early = rng.below(n + 2);
        for i in 0..n {
            if i == early {
                adjustment_edits(p, &mut s, &[], vocab, &mut Vec::new());
            }
            s.record(TokenId(rng.below(vocab as u64 + 3) as u32));
        }
        s
    }

    #[test]
    fn edits_are_the_adjustments_bit_for_bit() {
        let mut rng = Rng(0x51ed);
        let mut edited = 0;
        for case in 0..400 {
            let vocab = 64 + case % 7;
            let p = params(&mut rng, vocab);
            let mut s = state(&mut rng, &p, vocab);
            let eos = [TokenId(rng.below(vocab as u64) as u32), TokenId(vocab as u32 + 1)];
            let mut want = row(&mut rng, vocab, true);
            sanitize(&mut want);
            let mut got = want.clone();
            apply_adjustments(&mut want, &p, &s, &eos);
            let mut edits = Vec::new();
            adjustment_edits(&p, &mut s, &eos, vocab, &mut edits);
            let mut tokens: Vec<TokenId> = edits.iter().map(|e| TokenId(e.token)).collect();
            tokens.sort_unstable();
            assert!(tokens.windows(2).all(|w| w[0] < w[1]), "one edit per token");
            assert!(edits.iter().all(|e| (e.token as usize) < vocab));
            assert!(edits.len() <= edits_bound(&p, &s, &eos), "the bound is below the edits made");
            apply_edits(&mut got, &edits);
            let bits = |r: &[f32]| r.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "case {case}: {p:?}");
            edited += edits.len();
        }
        assert!(edited > 2000, "the cases touched few tokens: {edited}");
    }

    /// The decomposition the device path uses (plan, the op, settle) gives
    /// the host sampler's outcome and counters, row for row.
    #[test]
    fn host_op_settles_like_the_host_sampler() {
        let mut rng = Rng(0xd1ce);
        let vocab = 3000;
        let server_default = SamplingParams {
            temperature: 0.2,
            top_p: 0.9,
            min_p: 0.05,
            repetition_penalty: 1.1,
            ..SamplingParams::default()
        };
        let mut shapes = vec![
            server_default,
            SamplingParams::default(),
            SamplingParams { temperature: 0.0, ..SamplingParams::default() },
            SamplingParams { top_k: Some(40), ..SamplingParams::default() },
            SamplingParams { top_p: 0.95, ..SamplingParams::default() },
            SamplingParams { min_p: 0.1, ..SamplingParams::default() },
            SamplingParams {
                top_k: Some(5),
                top_p: 0.8,
                min_p: 0.02,
                temperature: 1.3,
                ..Default::default()
            },
        ];
        for _ in 0..5 {
            let mut p = params(&mut rng, vocab);
            p.temperature = rng.f().abs() * 2.0;
            shapes.push(p);
        }
        let (host_stats, dev_stats) = (Arc::new(SamplerStats::default()), Arc::new(SamplerStats::default()));
        let mut host = CpuSampler::new(host_stats.clone());
        let mut compared = 0;
        for (n, p) in shapes.iter().enumerate() {
            for case in 0..30 {
                let mut logits = row(&mut rng, vocab, case % 5 == 4);
                if case % 10 == 9 {
                    logits.fill(f32::NEG_INFINITY);
                }
                let eos = [TokenId(7)];
                let mut a = state(&mut rng, p, vocab);
                let mut b = a.clone();
                let mut hl = logits.clone();
                let mut rows = [SampleRow {
                    request_id: RequestId(1),
                    params: p,
                    state: &mut a,
                    eos_token_ids: &eos,
                    mask: None,
                }];
                let want = host.sample(&mut hl, vocab, &mut rows).unwrap().remove(0);
                let mut row = SampleRow {
                    request_id: RequestId(1),
                    params: p,
                    state: &mut b,
                    eos_token_ids: &eos,
                    mask: None,
                };
                let mut edits = Vec::new();
                let spec = plan_row(&mut row, vocab, 0, &mut edits);
                let mut dl = logits.clone();
                let summary = host_op(&mut dl, &spec, &edits);
                let got = settle_row(&dev_stats, &mut row, &spec, &summary, vocab, None);
                assert_eq!(got, want, "shape {n} case {case}");
                // The spilled path draws the same from the adjusted row.
                let mut c = a.clone();
                let mut row = SampleRow {
                    request_id: RequestId(1),
                    params: p,
                    state: &mut c,
                    eos_token_ids: &eos,
                    mask: None,
                };
                if summary.argmax != NO_TOKEN && !summary.is_broken() {
                    let spilled = RowSummary { status: ROW_TOO_MANY_CANDIDATES, token: NO_TOKEN, ..summary };
                    let again =
                        settle_row(&SamplerStats::default(), &mut row, &spec, &spilled, vocab, Some(&dl));
                    assert_eq!(again.map(|s| s.token), got.as_ref().map(|s| s.token).map_err(|e| e.clone()));
                }
                compared += 1;
            }
        }
        assert_eq!(compared, shapes.len() * 30);
        for kind in FallbackKind::ALL {
            assert_eq!(dev_stats.fallbacks(kind), host_stats.fallbacks(kind), "{kind}");
        }
        assert!(host_stats.fallbacks(FallbackKind::NonFiniteLogits) > 0);
        assert_eq!(dev_stats.failed_rows(), host_stats.failed_rows());
        assert!(host_stats.failed_rows() > 0);
        assert_eq!(dev_stats.device_rows(), compared as u64);
    }

    fn summary(token: u32, argmax: u32, value: f32) -> RowSummary {
        RowSummary { token, argmax, nan: 0, pos_inf: 0, value_bits: value.to_bits(), status: ROW_DRAWN }
    }

    #[test]
    fn a_device_answer_is_checked_like_a_host_draw() {
        let ok = settle_summary(&summary(3, 1, 0.5), 10).unwrap();
        assert_eq!((ok.token, ok.fallback), (TokenId(3), None));
        let fell = |s: RowSummary| settle_summary(&s, 10).map(|s| (s.token.get(), s.fallback));
        assert_eq!(fell(summary(NO_TOKEN, 1, 0.0)), Ok((1, Some(FallbackKind::NoCandidate))));
        assert_eq!(fell(summary(10, 1, 0.5)), Ok((1, Some(FallbackKind::OutOfVocab))));
        assert_eq!(fell(summary(4, 1, f32::NEG_INFINITY)), Ok((1, Some(FallbackKind::MaskedToken))));
        assert_eq!(fell(summary(4, 1, f32::NAN)), Ok((1, Some(FallbackKind::MaskedToken))));
        let broken = RowSummary { nan: 2, ..summary(3, 1, 0.5) };
        assert_eq!(fell(broken), Ok((1, Some(FallbackKind::NonFiniteLogits))));
        let inf = RowSummary { pos_inf: 1, ..summary(3, 1, 0.5) };
        assert_eq!(fell(inf), Ok((1, Some(FallbackKind::NonFiniteLogits))));
        // Nothing finite, or an argmax the vocabulary does not hold: the row fails.
        let none = RowSummary { nan: 2, ..summary(NO_TOKEN, NO_TOKEN, 0.0) };
        assert_eq!(fell(none), Err(crate::sampling::SampleError::AllLogitsInvalid { vocab: 10, nan: 2 }));
        assert!(fell(summary(3, 10, 0.5)).is_err());
    }
}
