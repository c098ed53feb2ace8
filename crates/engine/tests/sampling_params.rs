//! Parameter validation, penalties and bias against a plain reference,
//! masks and stop tokens, and the log-probability decision.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use corridor_engine::sampling::{
    CpuSampler, SampleOutcome, SampleRow, Sampler, SamplerState, SamplerStats, SamplingParams, StopReason,
    MAX_TOP_LOGPROBS,
};
use corridor_units::{RequestId, TokenId, Tokens};
use proptest::prelude::*;

const VOCAB: usize = 16;

fn rejects(params: SamplingParams, param: &str) {
    let err = params.validate(VOCAB).expect_err("should be rejected");
    assert_eq!(err.param, param, "{err}");
}

#[test]
fn defaults_are_openai_defaults_and_valid() {
    let p = SamplingParams::default();
    assert_eq!((p.temperature, p.top_p, p.top_k, p.min_p), (1.0, 1.0, None, 0.0));
    assert_eq!((p.repetition_penalty, p.presence_penalty, p.frequency_penalty), (1.0, 0.0, 0.0));
    assert!(p.logit_bias.is_empty() && p.seed.is_none() && p.logprobs.is_none());
    assert!(!p.is_greedy());
    p.validate(VOCAB).expect("defaults are valid");
}

#[test]
fn each_range_is_enforced_and_named() {
    let d = SamplingParams::default;
    for t in [-0.01, 2.01, f32::NAN, f32::INFINITY] {
        rejects(SamplingParams { temperature: t, ..d() }, "temperature");
    }
    for p in [0.0, -0.5, 1.01, f32::NAN] {
        rejects(SamplingParams { top_p: p, ..d() }, "top_p");
    }
    rejects(SamplingParams { top_k: Some(0), ..d() }, "top_k");
    for m in [-0.1, 1.1, f32::NAN] {
        rejects(SamplingParams { min_p: m, ..d() }, "min_p");
    }
    for r in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        rejects(SamplingParams { repetition_penalty: r, ..d() }, "repetition_penalty");
    }
    for v in [-2.01, 2.01, f32::NAN] {
        rejects(SamplingParams { presence_penalty: v, ..d() }, "presence_penalty");
        rejects(SamplingParams { frequency_penalty: v, ..d() }, "frequency_penalty");
    }
    rejects(
        SamplingParams { logit_bias: BTreeMap::from([(TokenId(VOCAB as u32), 1.0)]), ..d() },
        "logit_bias",
    );
    rejects(SamplingParams { logit_bias: BTreeMap::from([(TokenId(3), f32::NAN)]), ..d() }, "logit_bias");
    rejects(
        SamplingParams { stop_token_ids: vec![TokenId(2), TokenId(VOCAB as u32)], ..d() },
        "stop_token_ids",
    );
    rejects(SamplingParams { logprobs: Some(MAX_TOP_LOGPROBS + 1), ..d() }, "top_logprobs");
}

#[test]
fn boundary_values_are_accepted() {
    let d = SamplingParams::default;
    let ok = [
        SamplingParams { temperature: 0.0, ..d() },
        SamplingParams { temperature: 2.0, top_p: 1e-6, ..d() },
        SamplingParams { top_k: Some(1), min_p: 1.0, ..d() },
        SamplingParams { top_k: Some(u32::MAX), min_p: 0.0, ..d() },
        SamplingParams { repetition_penalty: 1e-3, presence_penalty: -2.0, frequency_penalty: 2.0, ..d() },
        // Out-of-range biases are clamped, not refused (OpenAI's behaviour).
        SamplingParams {
            logit_bias: BTreeMap::from([(TokenId(0), 1e9), (TokenId(15), f32::NEG_INFINITY)]),
            ..d()
        },
        SamplingParams { logprobs: Some(0), ..d() },
        SamplingParams { logprobs: Some(MAX_TOP_LOGPROBS), ..d() },
    ];
    for p in ok {
        p.validate(VOCAB).unwrap_or_else(|e| panic!("{p:?} rejected: {e}"));
    }
    assert_eq!(SamplingParams::clamped_bias(1e9), 100.0);
    assert_eq!(SamplingParams::clamped_bias(f32::NEG_INFINITY), -100.0);
    assert_eq!(SamplingParams::clamped_bias(-3.5), -3.5);
}

#[test]
fn top_k_from_request_spells_disabled_explicitly() {
    assert_eq!(SamplingParams::top_k_from_request(-1), Ok(None));
    assert_eq!(SamplingParams::top_k_from_request(0), Ok(None));
    assert_eq!(SamplingParams::top_k_from_request(7), Ok(Some(7)));
    assert_eq!(SamplingParams::top_k_from_request(-2).expect_err("negative").param, "top_k");
    assert_eq!(SamplingParams::top_k_from_request(i64::MAX).expect_err("too large").param, "top_k");
}

/// Samples one row and returns its outcome and the adjusted row.
fn sample_one(
    raw: &[f32],
    params: &SamplingParams,
    state: &mut SamplerState,
    eos: &[TokenId],
) -> (SampleOutcome, Vec<f32>) {
    let mut sampler = CpuSampler::new(Arc::new(SamplerStats::default()));
    let mut logits = raw.to_vec();
    let mut rows = [SampleRow { request_id: RequestId(0), params, state, eos_token_ids: eos, mask: None }];
    let out = sampler.sample(&mut logits, raw.len(), &mut rows).expect("shape").remove(0);
    (out, logits)
}

/// The adjusted logits as vLLM and OpenAI define them, written the plain way:
/// one token at a time, no sets, no sharing with the implementation.
fn reference_adjust(
    raw: &[f32],
    params: &SamplingParams,
    prompt: &[TokenId],
    history: &[TokenId],
    eos: &[TokenId],
) -> Vec<f32> {
    let mut counts: HashMap<TokenId, u32> = HashMap::new();
    for &t in history {
        *counts.entry(t).or_default() += 1;
    }
    (0..raw.len() as u32)
        .map(TokenId)
        .map(|t| {
            let mut l = raw[t.index()];
            let count = counts.get(&t).copied().unwrap_or(0);
            // The tokens that end a reply never take the penalty for being in the prompt.
            let ends = eos.contains(&t) || params.stop_token_ids.contains(&t);
            if (prompt.contains(&t) && !ends) || count > 0 {
                let r = params.repetition_penalty;
                l = if l > 0.0 { l / r } else { l * r };
            }
            l -= count as f32 * params.frequency_penalty;
            if count > 0 {
                l -= params.presence_penalty;
            }
            if let Some(&b) = params.logit_bias.get(&t) {
                l += b.clamp(-100.0, 100.0);
            }
            let before_min = history.len() < params.min_tokens.0;
            if (eos.contains(&t) && (before_min || params.ignore_eos))
                || (params.stop_token_ids.contains(&t) && before_min)
            {
                l = f32::NEG_INFINITY;
            }
            l
        })
        .collect()
}

proptest! {
    /// Penalties, bias and masks agree with the reference for random inputs.
    #[test]
    fn adjustments_match_reference(
        raw in prop::collection::vec(-20.0f32..20.0, VOCAB),
        rep in prop_oneof![Just(1.0f32), 0.2f32..3.0],
        pres in -2.0f32..=2.0,
        freq in -2.0f32..=2.0,
        bias in prop::collection::btree_map((0..VOCAB as u32).prop_map(TokenId), -300.0f32..300.0, 0..5),
        prompt in prop::collection::vec((0..VOCAB as u32).prop_map(TokenId), 0..10),
        history in prop::collection::vec((0..VOCAB as u32).prop_map(TokenId), 0..10),
        eos in prop::collection::vec((0..VOCAB as u32).prop_map(TokenId), 0..2),
        stops in prop::collection::vec((0..VOCAB as u32).prop_map(TokenId), 0..2),
        min_tokens in 0usize..12,
        ignore_eos in any::<bool>(),
    ) {
        let params = SamplingParams {
            temperature: 0.0,
            repetition_penalty: rep,
            presence_penalty: pres,
            frequency_penalty: freq,
            logit_bias: bias,
            min_tokens: Tokens(min_tokens),
            ignore_eos,
            stop_token_ids: stops,
            ..SamplingParams::default()
        };
        let mut state = SamplerState::new(&params, &prompt, &eos);
        history.iter().for_each(|&t| state.record(t));
        let (_, adjusted) = sample_one(&raw, &params, &mut state, &eos);
        let expected = reference_adjust(&raw, &params, &prompt, &history, &eos);
        for (t, (a, e)) in adjusted.iter().zip(&expected).enumerate() {
            let close = a == e || (a - e).abs() <= 1e-5 * e.abs().max(1.0);
            prop_assert!(close, "token {}: got {}, reference {}", t, a, e);
        }
    }
}

/// The sampler records what it samples, so the penalties of the next token
/// see it: a strong frequency penalty makes greedy decoding walk down the
/// ranking instead of repeating the top token.
#[test]
fn sampled_tokens_feed_the_penalties() {
    let raw = [3.0f32, 2.5, 2.0, 1.5];
    let params = SamplingParams { temperature: 0.0, frequency_penalty: 2.0, ..SamplingParams::default() };
    let mut state = SamplerState::new(&params, &[], &[]);
    let tokens: Vec<TokenId> =
        (0..4).map(|_| sample_one(&raw, &params, &mut state, &[]).0.expect("valid").token).collect();
    assert_eq!(tokens, [0, 1, 2, 3].map(TokenId));
    assert_eq!(state.generated(), Tokens(4));
    assert_eq!(state.output_count(TokenId(0)), 1);
}

/// A chat template writes the end-of-turn token into the prompt after every
/// message. The repetition penalty leaves it (and a request's stop tokens)
/// alone, so it cannot make ending the reply less likely; every other prompt
/// token takes it.
#[test]
fn tokens_that_end_a_reply_take_no_repetition_penalty_from_the_prompt() {
    let eos = [TokenId(1)];
    let raw = [2.0f32, 3.0, 1.0, 4.0];
    let params = SamplingParams {
        temperature: 0.0,
        repetition_penalty: 1.5,
        stop_token_ids: vec![TokenId(3)],
        ..SamplingParams::default()
    };
    let prompt = [0, 1, 2, 3].map(TokenId);
    let mut state = SamplerState::new(&params, &prompt, &eos);
    let (_, adjusted) = sample_one(&raw, &params, &mut state, &eos);
    assert_eq!(adjusted, vec![2.0 / 1.5, 3.0, 1.0 / 1.5, 4.0]);
}

/// End-of-sequence and stop tokens are masked until `min_tokens`, then
/// reported; `ignore_eos` masks end-of-sequence for good.
#[test]
fn min_tokens_ignore_eos_and_stop_reporting() {
    let eos = [TokenId(0)];
    let raw = [9.0f32, 8.0, 7.0, 1.0];
    let params = SamplingParams {
        temperature: 0.0,
        min_tokens: Tokens(2),
        stop_token_ids: vec![TokenId(1)],
        ..SamplingParams::default()
    };
    let mut state = SamplerState::new(&params, &[], &[]);
    let mut step = || sample_one(&raw, &params, &mut state, &eos).0.expect("valid");
    let (a, b, c) = (step(), step(), step());
    assert_eq!((a.token, a.stop), (TokenId(2), None));
    assert_eq!((b.token, b.stop), (TokenId(2), None));
    assert_eq!((c.token, c.stop), (TokenId(0), Some(StopReason::Eos)));

    let raw = [1.0f32, 8.0, 9.0, 1.0];
    let stop_params =
        SamplingParams { temperature: 0.0, stop_token_ids: vec![TokenId(2)], ..SamplingParams::default() };
    let mut state = SamplerState::new(&stop_params, &[], &[]);
    let s = sample_one(&raw, &stop_params, &mut state, &eos).0.expect("valid");
    assert_eq!((s.token, s.stop), (TokenId(2), Some(StopReason::StopToken)));

    let raw = [9.0f32, 1.0, 2.0, 3.0];
    let ignore = SamplingParams { ignore_eos: true, seed: Some(5), ..SamplingParams::default() };
    let mut state = SamplerState::new(&ignore, &[], &[]);
    for _ in 0..200 {
        let s = sample_one(&raw, &ignore, &mut state, &eos).0.expect("valid");
        assert_ne!(s.token, TokenId(0), "eos sampled under ignore_eos");
        assert_eq!(s.stop, None);
    }
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    row.iter().map(|&v| v as f64 - lse).collect()
}

/// The decision: logprobs are log_softmax of the adjusted row (bias,
/// penalties and masks applied), before temperature and truncation. So they
/// do not change with temperature, top-k or top-p, they do change with
/// logit_bias, and masked tokens are never listed.
#[test]
fn logprobs_describe_the_adjusted_untruncated_distribution() {
    let raw = [2.0f32, 1.0, 0.5, 0.0, -1.0, -3.0];
    let eos = [TokenId(1)];
    let base = SamplingParams {
        logprobs: Some(4),
        logit_bias: BTreeMap::from([(TokenId(4), 2.5)]),
        min_tokens: Tokens(1),
        seed: Some(11),
        ..SamplingParams::default()
    };
    let mut adjusted = raw;
    adjusted[4] += 2.5;
    adjusted[1] = f32::NEG_INFINITY;
    let expected = log_softmax(&adjusted);

    let variants = [
        SamplingParams { temperature: 1.0, ..base.clone() },
        SamplingParams { temperature: 0.2, top_k: Some(2), ..base.clone() },
        SamplingParams { temperature: 1.8, top_p: 0.3, min_p: 0.5, ..base.clone() },
        SamplingParams { temperature: 0.0, ..base.clone() },
    ];
    let mut first_top = None;
    for params in &variants {
        let mut state = SamplerState::new(params, &[], &[]);
        let s = sample_one(&raw, params, &mut state, &eos).0.expect("valid");
        let lp = s.logprob.expect("logprobs requested");
        assert!((lp as f64 - expected[s.token.index()]).abs() < 1e-5, "{params:?}");
        let listed: Vec<TokenId> = s.top_logprobs.iter().map(|t| t.token).collect();
        assert_eq!(listed, [0, 4, 2, 3].map(TokenId), "most likely first, bias included, masked eos absent");
        for t in &s.top_logprobs {
            assert!((t.logprob as f64 - expected[t.token.index()]).abs() < 1e-5);
        }
        match &first_top {
            None => first_top = Some(s.top_logprobs.clone()),
            Some(first) => assert_eq!(first, &s.top_logprobs, "logprobs moved with temperature/truncation"),
        }
    }

    // Without a request for logprobs nothing is computed.
    let quiet = SamplingParams { logprobs: None, ..base.clone() };
    let mut state = SamplerState::new(&quiet, &[], &[]);
    let s = sample_one(&raw, &quiet, &mut state, &eos).0.expect("valid");
    assert!(s.logprob.is_none() && s.top_logprobs.is_empty());

    // A row with fewer possible tokens than asked lists only those.
    let narrow = SamplingParams { logprobs: Some(20), ..SamplingParams::default() };
    let raw = [0.0f32, f32::NEG_INFINITY, 1.0, f32::NEG_INFINITY];
    let mut state = SamplerState::new(&narrow, &[], &[]);
    let s = sample_one(&raw, &narrow, &mut state, &[]).0.expect("valid");
    assert_eq!(s.top_logprobs.iter().map(|t| t.token).collect::<Vec<_>>(), [2, 0].map(TokenId));
}
