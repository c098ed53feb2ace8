//! Each fallback path: broken logits, a row with nothing valid, and a draw
//! that returns no candidate, an id outside the vocabulary, or a masked
//! token. Every test here fails if its fallback is removed: the row would
//! then be sampled normally (a random token instead of the argmax), emit an
//! invalid id, or take the whole batch down.

use std::sync::Arc;

use corridor_engine::sampling::{
    BatchError, CpuSampler, DrawKernel, DrawSpec, FallbackKind, SampleError, SampleOutcome, SampleRow,
    Sampler, SamplerState, SamplerStats, SamplingParams,
};
use corridor_units::{RequestId, TokenId, Tokens};

/// Runs one batch of rows that share `params`, each with its own seed.
fn run<S: Sampler>(sampler: &mut S, rows: &[Vec<f32>], params: &SamplingParams) -> Vec<SampleOutcome> {
    let vocab = rows[0].len();
    let mut logits: Vec<f32> = rows.concat();
    let per_row: Vec<SamplingParams> =
        (0..rows.len()).map(|i| SamplingParams { seed: Some(i as u64), ..params.clone() }).collect();
    let mut states: Vec<SamplerState> = per_row.iter().map(|p| SamplerState::new(p, &[], &[])).collect();
    let mut batch: Vec<SampleRow<'_>> = per_row
        .iter()
        .zip(states.iter_mut())
        .map(|(params, state)| SampleRow {
            request_id: RequestId(1),
            params,
            state,
            eos_token_ids: &[],
            mask: None,
        })
        .collect();
    sampler.sample(&mut logits, vocab, &mut batch).expect("well-shaped batch")
}

fn flat_with(vocab: usize, at: &[(usize, f32)]) -> Vec<f32> {
    let mut row = vec![0.0f32; vocab];
    for &(i, v) in at {
        row[i] = v;
    }
    row
}

/// A NaN anywhere makes the row argmax over the sanitized logits, whatever
/// the temperature: on a flat row sampling would pick tokens at random.
#[test]
fn nan_in_logits_falls_back_to_argmax() {
    let stats = Arc::new(SamplerStats::default());
    let mut sampler = CpuSampler::new(stats.clone());
    let rows: Vec<Vec<f32>> = (0..20).map(|i| flat_with(32, &[(i, f32::NAN), (20, 0.5)])).collect();
    let out = run(&mut sampler, &rows, &SamplingParams { temperature: 2.0, ..SamplingParams::default() });
    for o in &out {
        let s = o.as_ref().expect("row still has valid tokens");
        assert_eq!((s.token, s.fallback), (TokenId(20), Some(FallbackKind::NonFiniteLogits)));
    }
    assert_eq!(stats.fallbacks(FallbackKind::NonFiniteLogits), 20);
    assert_eq!(stats.total_fallbacks(), 20);
}

/// +inf is the model shouting for a token: argmax picks it (the first one
/// on ties) instead of letting softmax turn the row into NaN.
#[test]
fn positive_infinity_falls_back_to_that_token() {
    let stats = Arc::new(SamplerStats::default());
    let mut sampler = CpuSampler::new(stats.clone());
    let rows: Vec<Vec<f32>> =
        (0..10).map(|_| flat_with(16, &[(7, f32::INFINITY), (9, f32::INFINITY), (3, 1e30)])).collect();
    let params = SamplingParams { logprobs: Some(3), ..SamplingParams::default() };
    for o in run(&mut sampler, &rows, &params) {
        let s = o.expect("valid");
        assert_eq!((s.token, s.fallback), (TokenId(7), Some(FallbackKind::NonFiniteLogits)));
        let lp = s.logprob.expect("requested");
        assert!(lp.is_finite(), "logprob of a sanitized +inf token must be finite, got {lp}");
    }
    assert_eq!(stats.fallbacks(FallbackKind::NonFiniteLogits), 10);
}

/// A row with nothing valid fails alone: its neighbours are sampled as usual,
/// and the failure is counted.
#[test]
fn a_row_with_nothing_valid_fails_alone() {
    let stats = Arc::new(SamplerStats::default());
    let mut sampler = CpuSampler::new(stats.clone());
    let good = flat_with(8, &[(5, 3.0)]);
    let rows = vec![
        good.clone(),
        vec![f32::NEG_INFINITY; 8],
        vec![f32::NAN; 8],
        [f32::NAN, f32::NEG_INFINITY].repeat(4),
        good,
    ];
    let out = run(&mut sampler, &rows, &SamplingParams { temperature: 0.0, ..SamplingParams::default() });
    assert_eq!(out[0].as_ref().map(|s| s.token), Ok(TokenId(5)));
    assert_eq!(out[1], Err(SampleError::AllLogitsInvalid { vocab: 8, nan: 0 }));
    assert_eq!(out[2], Err(SampleError::AllLogitsInvalid { vocab: 8, nan: 8 }));
    assert_eq!(out[3], Err(SampleError::AllLogitsInvalid { vocab: 8, nan: 4 }));
    assert_eq!(out[4].as_ref().map(|s| s.token), Ok(TokenId(5)));
    assert_eq!(stats.failed_rows(), 3);
    assert_eq!(stats.total_fallbacks(), 0);
}

/// Masks can empty a row too (only eos is possible but min_tokens masks it):
/// the request fails rather than emit a masked token.
#[test]
fn masks_that_leave_nothing_fail_the_row() {
    let mut sampler = CpuSampler::new(Arc::new(SamplerStats::default()));
    let params = SamplingParams { min_tokens: Tokens(3), ..SamplingParams::default() };
    let mut state = SamplerState::new(&params, &[], &[]);
    let mut logits = vec![f32::NEG_INFINITY, 4.0, f32::NEG_INFINITY];
    let mut rows = [SampleRow {
        request_id: RequestId(9),
        params: &params,
        state: &mut state,
        eos_token_ids: &[TokenId(1)],
        mask: None,
    }];
    let out = sampler.sample(&mut logits, 3, &mut rows).expect("shape");
    assert!(matches!(out[0], Err(SampleError::AllLogitsInvalid { .. })));
}

/// A draw that misbehaves in a fixed way, standing in for a failing kernel.
struct BadKernel(fn(&[f32]) -> Option<TokenId>);

impl DrawKernel for BadKernel {
    fn draw(&self, row: &[f32], _: &DrawSpec, _: f64) -> Option<TokenId> {
        (self.0)(row)
    }
}

fn check_kernel_fallback(kernel: BadKernel, kind: FallbackKind) {
    let stats = Arc::new(SamplerStats::default());
    let mut sampler = CpuSampler::with_kernel(stats.clone(), kernel);
    let rows: Vec<Vec<f32>> = (0..4).map(|_| flat_with(10, &[(0, f32::NEG_INFINITY), (6, 1.5)])).collect();
    for o in run(&mut sampler, &rows, &SamplingParams::default()) {
        let s = o.expect("argmax is possible");
        assert_eq!((s.token, s.fallback), (TokenId(6), Some(kind)));
    }
    assert_eq!(stats.fallbacks(kind), 4);
    assert_eq!(stats.total_fallbacks(), 4);
}

#[test]
fn empty_candidate_set_falls_back_to_argmax() {
    check_kernel_fallback(BadKernel(|_| None), FallbackKind::NoCandidate);
}

#[test]
fn id_outside_vocabulary_falls_back_to_argmax() {
    check_kernel_fallback(BadKernel(|row| Some(TokenId(row.len() as u32 + 7))), FallbackKind::OutOfVocab);
    check_kernel_fallback(BadKernel(|_| Some(TokenId(u32::MAX))), FallbackKind::OutOfVocab);
}

#[test]
fn masked_token_falls_back_to_argmax() {
    // Token 0 is -inf in every row the helper builds.
    check_kernel_fallback(BadKernel(|_| Some(TokenId(0))), FallbackKind::MaskedToken);
}

/// The empty-candidate path is reachable with the real draw too: a top_k of
/// zero that skipped validation leaves no candidate.
#[test]
fn unvalidated_zero_top_k_falls_back_to_argmax() {
    let stats = Arc::new(SamplerStats::default());
    let mut sampler = CpuSampler::new(stats.clone());
    let rows: Vec<Vec<f32>> = (0..5).map(|_| flat_with(12, &[(4, 0.1)])).collect();
    for o in run(&mut sampler, &rows, &SamplingParams { top_k: Some(0), ..SamplingParams::default() }) {
        let s = o.expect("valid");
        assert_eq!((s.token, s.fallback), (TokenId(4), Some(FallbackKind::NoCandidate)));
    }
    assert_eq!(stats.fallbacks(FallbackKind::NoCandidate), 5);
}

#[test]
fn malformed_batch_is_an_error_not_a_panic() {
    let mut sampler = CpuSampler::new(Arc::new(SamplerStats::default()));
    let params = SamplingParams::default();
    let mut state = SamplerState::new(&params, &[], &[]);
    let mut rows = [SampleRow {
        request_id: RequestId(0),
        params: &params,
        state: &mut state,
        eos_token_ids: &[],
        mask: None,
    }];
    let mut logits = vec![0.0f32; 7];
    assert_eq!(
        sampler.sample(&mut logits, 8, &mut rows),
        Err(BatchError::ShapeMismatch { logits_len: 7, rows: 1, vocab: 8 })
    );
    assert!(sampler.sample(&mut logits, 0, &mut rows).is_err());
}

#[test]
fn fallback_labels_are_distinct() {
    let mut labels: Vec<&str> = FallbackKind::ALL.iter().map(|k| k.label()).collect();
    labels.sort_unstable();
    labels.dedup();
    assert_eq!(labels.len(), FallbackKind::ALL.len());
}
