//! Properties of the CPU sampler: every row yields a valid token (or fails
//! only when nothing is valid), inside the documented candidate set; greedy is
//! argmax; a small temperature is greedy; frequencies match the truncated,
//! renormalized softmax; seeds do not depend on the batch.

use std::sync::Arc;

use corridor_engine::sampling::{
    logits::argmax, CpuSampler, FallbackKind, SampleRow, Sampler, SamplerState, SamplerStats, SamplingParams,
};
use corridor_units::{RequestId, TokenId, Tokens};
use proptest::prelude::*;

/// One row of a generated batch.
#[derive(Clone, Debug)]
struct RowCase {
    raw: Vec<f32>,
    params: SamplingParams,
    prompt: Vec<TokenId>,
    history: Vec<TokenId>,
    eos: Vec<TokenId>,
}

/// The candidate set the kernel documents, computed independently and
/// deliberately plainly: sort everything, walk the prefix. The top-p limit
/// and the min-p floor get a relative slack of 1e-9 so that a difference in
/// float summation order at a boundary cannot fail the test; the set can only
/// grow by that slack, never shrink.
fn reference_candidates(row: &[f32], params: &SamplingParams) -> Vec<TokenId> {
    if params.temperature == 0.0 {
        return argmax(row).into_iter().collect();
    }
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let t = params.temperature as f64;
    let weight = |i: usize| ((row[i] as f64 - max) * (1.0 / t)).exp();
    let mut order: Vec<usize> = (0..row.len()).filter(|&i| weight(i) > 0.0).collect();
    order.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
    if let Some(k) = params.top_k {
        order.truncate(k as usize);
    }
    if params.top_p < 1.0 {
        let total: f64 = order.iter().map(|&i| weight(i)).sum();
        let limit = params.top_p as f64 * total * (1.0 + 1e-9);
        let mut before = 0.0;
        let mut keep = 0;
        for &i in &order {
            if before >= limit {
                break;
            }
            before += weight(i);
            keep += 1;
        }
        order.truncate(keep);
    }
    order.retain(|&i| weight(i) >= params.min_p as f64 * (1.0 - 1e-9));
    order.into_iter().map(|i| TokenId(i as u32)).collect()
}

fn logit_value(dirty: bool) -> BoxedStrategy<f32> {
    let clean = prop_oneof![
        12 => -30.0f32..30.0,
        2 => Just(f32::NEG_INFINITY),
        1 => prop::sample::select(vec![f32::MAX, -f32::MAX, 1e30, -1e30, 0.0]),
    ];
    if dirty {
        prop_oneof![6 => clean, 1 => Just(f32::NAN), 1 => Just(f32::INFINITY)].boxed()
    } else {
        clean.boxed()
    }
}

fn params_strategy(vocab: u32) -> impl Strategy<Value = SamplingParams> {
    let draw = (
        prop_oneof![2 => Just(0.0f32), 1 => Just(1e-3f32), 6 => 0.05f32..=2.0],
        prop::option::of(1u32..vocab + 3),
        prop_oneof![Just(1.0f32), 0.01f32..=1.0],
        prop_oneof![Just(0.0f32), 0.0f32..=1.0],
    );
    let adjust = (
        prop_oneof![Just(1.0f32), 0.3f32..3.0],
        -2.0f32..=2.0,
        -2.0f32..=2.0,
        prop::collection::btree_map((0..vocab).prop_map(TokenId), -150.0f32..150.0, 0..3),
    );
    let request = (
        any::<u64>(),
        0usize..4,
        any::<bool>(),
        prop::collection::vec((0..vocab).prop_map(TokenId), 0..2),
        prop::option::of(0u32..=20),
    );
    (draw, adjust, request).prop_map(
        |(
            (temperature, top_k, top_p, min_p),
            (repetition_penalty, presence_penalty, frequency_penalty, logit_bias),
            (seed, min_tokens, ignore_eos, stop_token_ids, logprobs),
        )| SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            logit_bias,
            seed: Some(seed),
            min_tokens: Tokens(min_tokens),
            ignore_eos,
            stop_token_ids,
            logprobs,
        },
    )
}

fn row_strategy(vocab: u32) -> impl Strategy<Value = RowCase> {
    prop::bool::weighted(0.25)
        .prop_flat_map(move |dirty| {
            (
                prop::collection::vec(logit_value(dirty), vocab as usize),
                params_strategy(vocab),
                prop::collection::vec((0..vocab).prop_map(TokenId), 0..8),
                prop::collection::vec((0..vocab).prop_map(TokenId), 0..5),
                prop::collection::vec((0..vocab).prop_map(TokenId), 0..2),
            )
        })
        .prop_map(|(raw, params, prompt, history, eos)| RowCase { raw, params, prompt, history, eos })
}

fn batch_strategy() -> impl Strategy<Value = (u32, Vec<RowCase>)> {
    (1u32..48).prop_flat_map(|vocab| (Just(vocab), prop::collection::vec(row_strategy(vocab), 1..5)))
}

/// Runs one batch; returns the outcomes and the adjusted rows.
fn run_batch(
    vocab: usize,
    cases: &[RowCase],
) -> (Vec<corridor_engine::sampling::SampleOutcome>, Vec<f32>, Arc<SamplerStats>) {
    let stats = Arc::new(SamplerStats::default());
    let mut sampler = CpuSampler::new(stats.clone());
    let mut states: Vec<SamplerState> = cases
        .iter()
        .map(|c| {
            let mut s = SamplerState::new(&c.params, &c.prompt, &[]);
            c.history.iter().for_each(|&t| s.record(t));
            s
        })
        .collect();
    let mut logits: Vec<f32> = cases.iter().flat_map(|c| c.raw.iter().copied()).collect();
    let mut rows: Vec<SampleRow<'_>> = cases
        .iter()
        .zip(states.iter_mut())
        .enumerate()
        .map(|(i, (c, state))| SampleRow {
            request_id: RequestId(i as u64),
            params: &c.params,
            state,
            eos_token_ids: &c.eos,
            mask: None,
        })
        .collect();
    let outcomes = sampler.sample(&mut logits, vocab, &mut rows).expect("well-shaped batch");
    (outcomes, logits, stats)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Whatever the logits and parameters: a valid token inside the candidate
    /// set, the argmax fallback for broken rows, an error only when no entry
    /// of the adjusted row is finite.
    #[test]
    fn every_row_yields_a_valid_token((vocab, cases) in batch_strategy()) {
        let (outcomes, adjusted, stats) = run_batch(vocab as usize, &cases);
        prop_assert_eq!(outcomes.len(), cases.len());
        let mut expected_fallbacks = 0;
        for ((case, outcome), row) in cases.iter().zip(&outcomes).zip(adjusted.chunks(vocab as usize)) {
            let broken = case.raw.iter().any(|v| v.is_nan() || *v == f32::INFINITY);
            let any_valid = row.iter().any(|v| v.is_finite());
            prop_assert!(row.iter().all(|v| !v.is_nan() && *v != f32::INFINITY), "adjusted row not sanitized");
            match outcome {
                Err(_) => prop_assert!(!any_valid, "a row with a valid token failed"),
                Ok(s) => {
                    prop_assert!(any_valid);
                    prop_assert!(s.token.index() < vocab as usize);
                    prop_assert!(row[s.token.index()].is_finite(), "masked token {} emitted", s.token);
                    if broken {
                        expected_fallbacks += 1;
                        prop_assert_eq!(s.fallback, Some(FallbackKind::NonFiniteLogits));
                        prop_assert_eq!(Some(s.token), argmax(row));
                    } else {
                        prop_assert_eq!(s.fallback, None);
                        let cands = reference_candidates(row, &case.params);
                        prop_assert!(cands.contains(&s.token), "token {} outside candidates {:?}", s.token, cands);
                    }
                    if case.params.temperature == 0.0 {
                        prop_assert_eq!(Some(s.token), argmax(row));
                    }
                    if let Some(lp) = s.logprob {
                        prop_assert!(lp.is_finite() && lp <= 1e-6);
                    }
                    prop_assert!(s.top_logprobs.iter().all(|t| t.logprob.is_finite()));
                }
            }
        }
        prop_assert_eq!(stats.fallbacks(FallbackKind::NonFiniteLogits), expected_fallbacks);
    }

    /// Greedy is the argmax of the adjusted row (ties: lowest id), and a
    /// temperature of 1e-3 behaves the same when the top logit leads by at
    /// least 0.05: every other token weighs under exp(-50).
    #[test]
    fn small_temperature_is_greedy(
        raw in prop::collection::vec(-10.0f32..10.0, 2..64),
        top in any::<prop::sample::Index>(),
        seed in any::<u64>(),
    ) {
        let mut raw = raw;
        let top = top.index(raw.len());
        raw[top] = raw.iter().copied().fold(f32::MIN, f32::max) + 0.05;
        for temperature in [0.0f32, 1e-3] {
            let case = RowCase {
                raw: raw.clone(),
                params: SamplingParams { temperature, seed: Some(seed), ..SamplingParams::default() },
                prompt: vec![],
                history: vec![],
                eos: vec![],
            };
            let (outcomes, _, _) = run_batch(raw.len(), &[case]);
            prop_assert_eq!(outcomes[0].as_ref().map(|s| s.token).ok(), Some(TokenId(top as u32)));
        }
    }
}

/// Chi-square critical values at p = 0.001 for 1..=12 degrees of freedom.
const CHI2_CRIT_P001: [f64; 12] =
    [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26, 32.91];

/// Draws `n` tokens from one seeded row with fixed logits and returns the
/// count per token.
fn histogram(raw: &[f32], params: &SamplingParams, n: usize) -> Vec<u64> {
    let mut sampler = CpuSampler::new(Arc::new(SamplerStats::default()));
    let mut state = SamplerState::new(params, &[], &[]);
    let mut counts = vec![0u64; raw.len()];
    let mut logits = raw.to_vec();
    for _ in 0..n {
        logits.copy_from_slice(raw);
        let mut rows = [SampleRow {
            request_id: RequestId(0),
            params,
            state: &mut state,
            eos_token_ids: &[],
            mask: None,
        }];
        let out = sampler.sample(&mut logits, raw.len(), &mut rows).expect("shape");
        counts[out[0].as_ref().expect("valid row").token.index()] += 1;
    }
    counts
}

/// The truncated, renormalized softmax the frequencies must follow.
fn expected_probs(raw: &[f32], params: &SamplingParams) -> Vec<f64> {
    let cands = reference_candidates(raw, params);
    let max = raw.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let w = |i: usize| ((raw[i] as f64 - max) / params.temperature as f64).exp();
    let total: f64 = cands.iter().map(|&i| w(i.index())).sum();
    (0..raw.len()).map(|i| if cands.contains(&TokenId(i as u32)) { w(i) / total } else { 0.0 }).collect()
}

/// Over 20 000 draws per configuration, the chi-square statistic of the
/// observed counts against the truncated, renormalized softmax stays under
/// the p = 0.001 critical value for its degrees of freedom, and tokens
/// outside the candidate set never appear. The seeds are fixed, so the test
/// is deterministic; the bound says a correct sampler would exceed it for
/// only one seed in a thousand.
#[test]
fn frequencies_match_truncated_softmax() {
    let raw = [2.0f32, 1.5, 1.2, 1.0, 0.5, 0.0, -0.3, -1.0, -1.5, -2.0];
    let base = SamplingParams { seed: Some(7), ..SamplingParams::default() };
    let configs = [
        SamplingParams { temperature: 1.0, ..base.clone() },
        SamplingParams { temperature: 0.7, top_k: Some(5), ..base.clone() },
        SamplingParams { temperature: 1.3, top_p: 0.8, seed: Some(8), ..base.clone() },
        SamplingParams { temperature: 1.0, min_p: 0.1, seed: Some(9), ..base.clone() },
        SamplingParams {
            temperature: 0.8,
            top_k: Some(6),
            top_p: 0.9,
            min_p: 0.05,
            seed: Some(10),
            ..base.clone()
        },
        SamplingParams { temperature: 2.0, top_p: 0.5, seed: Some(11), ..base.clone() },
    ];
    let n = 20_000;
    for params in &configs {
        let expected = expected_probs(&raw, params);
        let counts = histogram(&raw, params, n);
        let mut chi2 = 0.0;
        let mut cells = 0;
        for (i, (&p, &c)) in expected.iter().zip(&counts).enumerate() {
            if p == 0.0 {
                assert_eq!(c, 0, "token {i} outside the candidate set drawn {c} times with {params:?}");
                continue;
            }
            assert!(p * n as f64 >= 5.0, "test design: expected count too small for chi-square");
            let e = p * n as f64;
            chi2 += (c as f64 - e).powi(2) / e;
            cells += 1;
        }
        assert!(cells >= 2, "test design: each configuration should leave a choice");
        let crit = CHI2_CRIT_P001[cells - 2];
        assert!(chi2 < crit, "chi2 {chi2:.2} >= {crit} (df {}) for {params:?}: {counts:?}", cells - 1);
    }
}

/// A flat row of 1024 tokens with top_p 0.5 keeps exactly tokens 0..512 (ties
/// rank by id). The kernel first ranks a window of 256 tokens and must grow
/// it: a draw from 256..512 proves it did, one from 512.. would be a leak.
#[test]
fn nucleus_wider_than_the_first_window() {
    let raw = vec![0.25f32; 1024];
    let params = SamplingParams { top_p: 0.5, seed: Some(3), ..SamplingParams::default() };
    let counts = histogram(&raw, &params, 2000);
    assert!(counts[512..].iter().all(|&c| c == 0), "token outside the nucleus drawn");
    assert!(counts[256..512].iter().sum::<u64>() > 0, "nucleus was cut at the first window");
}

/// Logits for step `step` of a fake model: a fixed pseudo-random pattern.
fn fake_logits(vocab: usize, step: usize, salt: u64) -> Vec<f32> {
    let mut x = (step as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt;
    (0..vocab)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 1000) as f32 / 200.0 - 2.5
        })
        .collect()
}

/// Generates `steps` tokens for `focus` placed at `position` among `mates`,
/// and returns the focus request's tokens.
fn generate_in_batch(
    vocab: usize,
    steps: usize,
    focus: &SamplingParams,
    mates: &[SamplingParams],
    position: usize,
) -> Vec<TokenId> {
    let mut all: Vec<SamplingParams> = mates.to_vec();
    all.insert(position, focus.clone());
    let mut states: Vec<SamplerState> =
        all.iter().map(|p| SamplerState::new(p, &[1, 2, 3].map(TokenId), &[])).collect();
    let mut sampler = CpuSampler::new(Arc::new(SamplerStats::default()));
    let mut tokens = Vec::new();
    for step in 0..steps {
        // The focus row always sees the same logits; its mates see other
        // values, including a broken row and an all -inf row.
        let mut logits = Vec::with_capacity(all.len() * vocab);
        for i in 0..all.len() {
            let mut row = fake_logits(vocab, step, if i == position { 0 } else { 1000 + i as u64 });
            if i != position && i % 3 == 1 {
                row[step % vocab] = f32::NAN;
            }
            if i != position && i % 3 == 2 {
                row.fill(f32::NEG_INFINITY);
            }
            logits.extend(row);
        }
        let mut rows: Vec<SampleRow<'_>> = all
            .iter()
            .zip(states.iter_mut())
            .enumerate()
            .map(|(i, (params, state))| SampleRow {
                request_id: RequestId(i as u64),
                params,
                state,
                eos_token_ids: &[],
                mask: None,
            })
            .collect();
        let outcomes = sampler.sample(&mut logits, vocab, &mut rows).expect("shape");
        tokens.push(outcomes[position].as_ref().expect("focus row is valid").token);
    }
    tokens
}

/// The same seed gives the same tokens alone, among other requests, at any
/// position in the batch, and on the parallel path (a big batch) as on the
/// sequential one; a different seed gives different tokens.
#[test]
fn seeded_stream_ignores_batch_composition() {
    let focus = SamplingParams {
        temperature: 0.9,
        top_k: Some(40),
        frequency_penalty: 0.3,
        seed: Some(1234),
        ..SamplingParams::default()
    };
    let mates: Vec<SamplingParams> = (0..4)
        .map(|i| SamplingParams {
            temperature: [0.0, 1.0, 1.7, 0.5][i],
            top_p: 0.9,
            seed: Some(99 + i as u64),
            ..SamplingParams::default()
        })
        .collect();
    let alone = generate_in_batch(100, 30, &focus, &[], 0);
    for position in [0, 2, 4] {
        assert_eq!(generate_in_batch(100, 30, &focus, &mates, position), alone, "position {position}");
    }
    let other_seed = SamplingParams { seed: Some(1235), ..focus.clone() };
    assert_ne!(generate_in_batch(100, 30, &other_seed, &[], 0), alone);

    // 40 000 × 3 rows crosses the parallel threshold.
    let alone_big = generate_in_batch(40_000, 5, &focus, &[], 0);
    assert_eq!(generate_in_batch(40_000, 5, &focus, &mates[..2], 1), alone_big);
}

/// An unseeded request reports the seed it drew, and that seed replays it.
#[test]
fn unseeded_request_can_be_replayed_from_its_seed() {
    let params = SamplingParams { temperature: 1.0, ..SamplingParams::default() };
    let first = SamplerState::new(&params, &[], &[]);
    let replay = SamplingParams { seed: Some(first.seed()), ..params.clone() };
    let a = generate_with_state(first, &params);
    let b = generate_with_state(SamplerState::new(&replay, &[], &[]), &replay);
    assert_eq!(a, b);
}

fn generate_with_state(mut state: SamplerState, params: &SamplingParams) -> Vec<TokenId> {
    let mut sampler = CpuSampler::new(Arc::new(SamplerStats::default()));
    (0..20)
        .map(|step| {
            let mut logits = fake_logits(50, step, 0);
            let mut rows = [SampleRow {
                request_id: RequestId(0),
                params,
                state: &mut state,
                eos_token_ids: &[],
                mask: None,
            }];
            sampler.sample(&mut logits, 50, &mut rows).expect("shape")[0].as_ref().expect("valid").token
        })
        .collect()
}
