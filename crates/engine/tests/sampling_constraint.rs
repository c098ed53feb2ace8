//! The grammar mask in the sampler: a masked row only ever yields allowed
//! tokens, its fallbacks pick the argmax of the allowed tokens, and a mask
//! that allows nothing with a finite logit fails that row alone.

use corridor_units::{RequestId, TokenId};
use std::sync::Arc;

use corridor_engine::sampling::{
    CpuSampler, FallbackKind, SampleError, SampleOutcome, SampleRow, Sampler, SamplerState, SamplerStats,
    SamplingParams, TokenMask,
};

fn run(rows: &[Vec<f32>], masks: &[Option<TokenMask>], params: &SamplingParams) -> Vec<SampleOutcome> {
    let vocab = rows[0].len();
    let mut logits: Vec<f32> = rows.concat();
    let per_row: Vec<SamplingParams> =
        (0..rows.len()).map(|i| SamplingParams { seed: Some(i as u64 + 7), ..params.clone() }).collect();
    let mut states: Vec<SamplerState> = per_row.iter().map(|p| SamplerState::new(p, &[], &[])).collect();
    let mut batch: Vec<SampleRow<'_>> = per_row
        .iter()
        .zip(states.iter_mut())
        .zip(masks)
        .map(|((params, state), mask)| SampleRow {
            request_id: RequestId(1),
            params,
            state,
            eos_token_ids: &[],
            mask: mask.as_ref(),
        })
        .collect();
    let mut sampler = CpuSampler::new(Arc::new(SamplerStats::default()));
    sampler.sample(&mut logits, vocab, &mut batch).expect("well-shaped batch")
}

fn mask_of(vocab: usize, ids: &[u32]) -> TokenMask {
    let mut m = TokenMask::none(vocab);
    ids.iter().for_each(|&i| m.allow(TokenId(i)));
    m
}

#[test]
fn sampled_tokens_are_always_allowed() {
    let vocab = 100;
    let allowed = [3u32, 41, 77];
    let params = SamplingParams { temperature: 1.0, ..SamplingParams::default() };
    // The allowed tokens are the least likely ones: unmasked sampling would
    // almost never pick them.
    let mut row = vec![5.0f32; vocab];
    for &a in &allowed {
        row[a as usize] = -5.0;
    }
    let rows = vec![row; 32];
    let masks: Vec<Option<TokenMask>> = (0..32).map(|_| Some(mask_of(vocab, &allowed))).collect();
    for outcome in run(&rows, &masks, &params) {
        let s = outcome.expect("sampled");
        assert!(allowed.contains(&s.token.get()), "token {} is masked", s.token);
        assert!(s.fallback.is_none());
    }
    // Rows without a mask in the same batch are untouched.
    let out = run(&rows[..2], &[None, Some(mask_of(vocab, &allowed))], &params);
    assert!(!allowed.contains(&out[0].as_ref().expect("sampled").token.get()));
}

#[test]
fn broken_row_falls_back_to_argmax_of_allowed_tokens() {
    let vocab = 64;
    let mut row = vec![0.0f32; vocab];
    row[10] = 9.0; // the global argmax, masked out
    row[20] = 2.0; // the best allowed token
    row[30] = 1.0;
    row[5] = f32::NAN; // breaks the row
    let out = run(&[row], &[Some(mask_of(vocab, &[20, 30]))], &SamplingParams::default());
    let s = out[0].as_ref().expect("fell back");
    assert_eq!(s.token, TokenId(20));
    assert_eq!(s.fallback, Some(FallbackKind::NonFiniteLogits));
}

#[test]
fn mask_with_nothing_finite_fails_the_row_only() {
    let vocab = 40;
    let mut row = vec![1.0f32; vocab];
    row[4] = f32::NEG_INFINITY;
    let out = run(
        &[row.clone(), row],
        &[Some(mask_of(vocab, &[4])), Some(mask_of(vocab, &[4, 6]))],
        &SamplingParams::default(),
    );
    assert!(matches!(out[0], Err(SampleError::AllLogitsInvalid { .. })));
    assert_eq!(out[1].as_ref().expect("other row").token, TokenId(6));
}
