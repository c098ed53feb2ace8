//! The fallback rules, in one place, for every sampler implementation.
//!
//! A draw's answer is untrusted (flashinfer #384 returned invalid ids when a
//! kernel failed; SGLang #678 added a success check with an argmax fallback).
//! [`settle_draw`] accepts a drawn id only if it lies inside the vocabulary
//! and its adjusted logit is not -inf; otherwise the row falls back to the
//! argmax of the sanitized, adjusted logits. Only when even argmax has nothing
//! to choose (every entry -inf) does the row fail, and then only that row.

use corridor_units::TokenId;

use corridor_backend::sample::RowSummary;

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
    match (verdict(drawn, |token| row.get(token.index()).copied()), drawn) {
        (None, Some(token)) => Ok(Settled { token, fallback: None }),
        (fallback, _) => fall_back(row, fallback, nan),
    }
}

/// Why a drawn answer cannot be used, if it cannot: `value_of` gives the
/// adjusted logit of a token inside the vocabulary (`None` outside it).
fn verdict(drawn: Option<TokenId>, value_of: impl FnOnce(TokenId) -> Option<f32>) -> Option<FallbackKind> {
    match drawn {
        None => Some(FallbackKind::NoCandidate),
        Some(token) => match value_of(token) {
            None => Some(FallbackKind::OutOfVocab),
            Some(v) if v.is_nan() || v == f32::NEG_INFINITY => Some(FallbackKind::MaskedToken),
            Some(_) => None,
        },
    }
}

/// Settles a row drawn on the device from its summary, by the rules the
/// host sampler applies to a row it holds: every adjusted logit -inf fails
/// the row; a row whose model logits held NaN or +inf takes the argmax; a
/// draw that found nothing, left the vocabulary or chose a masked token
/// takes the argmax. The summary's argmax stands for the row's (the device
/// found it over the same adjusted row); one outside the vocabulary counts
/// as none, so a garbled answer fails the row rather than emit an
/// invalid token.
pub fn settle_summary(summary: &RowSummary, vocab: usize) -> Result<Settled, SampleError> {
    let nan = summary.nan as usize;
    let Some(argmax) = summary.fallback_argmax().map(TokenId).filter(|t| t.index() < vocab) else {
        return Err(SampleError::AllLogitsInvalid { vocab, nan });
    };
    let fallback = if summary.is_broken() {
        Some(FallbackKind::NonFiniteLogits)
    } else {
        let drawn = summary.drawn().map(TokenId);
        match verdict(drawn, |token| (token.index() < vocab).then(|| summary.value())) {
            None => {
                return Ok(Settled { token: drawn.expect("a verdict of None means a draw"), fallback: None })
            }
            kind => kind,
        }
    };
    Ok(Settled { token: argmax, fallback })
}

/// Argmax over the sanitized, adjusted row, or the row's error when every
/// entry is -inf.
pub fn fall_back(row: &[f32], fallback: Option<FallbackKind>, nan: usize) -> Result<Settled, SampleError> {
    argmax(row)
        .map(|token| Settled { token, fallback })
        .ok_or(SampleError::AllLogitsInvalid { vocab: row.len(), nan })
}
