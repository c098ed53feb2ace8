//! The fallback rules, in one place, for every sampler implementation.
//!
//! A draw's answer is untrusted (flashinfer #384 returned invalid ids when a
//! kernel failed; SGLang #678 added a success check with an argmax fallback).
//! [`settle_draw`] accepts a drawn id only if it lies inside the vocabulary
//! and its adjusted logit is not -inf; otherwise the row falls back to the
//! argmax of the sanitized, adjusted logits. Only when even argmax has nothing
//! to choose (every entry -inf) does the row fail, and then only that row.

use corridor_units::TokenId;

use super::logits::argmax;
use super::outcome::{FallbackKind, SampleError};

/// The token a row settles on and the fallback taken to get it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settled {
    /// A token `< vocab` whose adjusted logit is finite.
    pub token: TokenId,
    /// Why the drawn answer was not used, if it was not.
    pub fallback: Option<FallbackKind>,
}

/// Checks a draw against the row it was drawn from.
///
/// `row`: [vocab] sanitized, adjusted logits. `drawn`: the kernel's answer,
/// `None` when it found no candidate. `nan`: how many of the model's logits
/// were NaN, for the error message.
pub fn settle_draw(row: &[f32], drawn: Option<TokenId>, nan: usize) -> Result<Settled, SampleError> {
    let verdict = match drawn {
        None => Some(FallbackKind::NoCandidate),
        Some(token) => match row.get(token as usize) {
            None => Some(FallbackKind::OutOfVocab),
            Some(&v) if v.is_nan() || v == f32::NEG_INFINITY => Some(FallbackKind::MaskedToken),
            Some(_) => None,
        },
    };
    match (verdict, drawn) {
        (None, Some(token)) => Ok(Settled { token, fallback: None }),
        (fallback, _) => fall_back(row, fallback, nan),
    }
}

/// Argmax over the sanitized, adjusted row, or the row's error when every
/// entry is -inf.
pub fn fall_back(row: &[f32], fallback: Option<FallbackKind>, nan: usize) -> Result<Settled, SampleError> {
    argmax(row)
        .map(|token| Settled { token, fallback })
        .ok_or(SampleError::AllLogitsInvalid { vocab: row.len(), nan })
}
