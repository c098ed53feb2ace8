//! What sampling one row produces: a token with its log-probabilities and the
//! fallback that was taken, if any, or an error for that row alone.

use corridor_units::TokenId;

/// Why a row did not take the normal sampling path. Each kind is counted in
/// [`super::SamplerStats`] and exported as a Prometheus label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FallbackKind {
    /// The model's logits held NaN or +inf: the forward pass misbehaved, so
    /// the row is not sampled but decided by argmax over sanitized logits.
    NonFiniteLogits,
    /// The draw found no candidate (truncation emptied the set, or the
    /// probabilities degenerated).
    NoCandidate,
    /// The draw returned an id outside the vocabulary.
    OutOfVocab,
    /// The draw returned a token whose adjusted logit is -inf (masked,
    /// banned, or impossible), which sampling must never yield.
    MaskedToken,
}

impl FallbackKind {
    /// Every kind, for exporting one counter per kind.
    pub const ALL: [FallbackKind; 4] = [
        FallbackKind::NonFiniteLogits,
        FallbackKind::NoCandidate,
        FallbackKind::OutOfVocab,
        FallbackKind::MaskedToken,
    ];

    /// A stable snake_case name, used as the metric label.
    pub fn label(self) -> &'static str {
        match self {
            FallbackKind::NonFiniteLogits => "non_finite_logits",
            FallbackKind::NoCandidate => "no_candidate",
            FallbackKind::OutOfVocab => "out_of_vocab",
            FallbackKind::MaskedToken => "masked_token",
        }
    }
}

impl std::fmt::Display for FallbackKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// Why a sampled token ends the sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// One of the model's end-of-sequence tokens (never reported under
    /// `ignore_eos`, which masks them).
    Eos,
    /// One of the request's `stop_token_ids`.
    StopToken,
}

/// A token and its log-probability.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token.
    pub token: TokenId,
    /// Natural-log probability under the adjusted distribution (see the
    /// module documentation for which distribution that is); always finite.
    pub logprob: f32,
}

/// A successfully sampled row.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The chosen token; always `< vocab` and never a masked token.
    pub token: TokenId,
    /// The chosen token's log-probability, when the request asked for
    /// logprobs.
    pub logprob: Option<f32>,
    /// The most likely tokens, most likely first (ties: lower id first), as
    /// many as the request asked for but never a token of probability zero.
    pub top_logprobs: Vec<TokenLogprob>,
    /// Set when the token ends the sequence; the engine acts on it.
    pub stop: Option<StopReason>,
    /// Set when the row did not take the normal sampling path.
    pub fallback: Option<FallbackKind>,
}

/// A row that could not produce any valid token. Only that row's request
/// fails; the rest of the batch is unaffected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SampleError {
    /// Every adjusted logit was -inf or NaN, so not even argmax can choose.
    #[error(
        "no valid token: all {vocab} logits are -inf or NaN after masking ({nan} NaN in the model output)"
    )]
    AllLogitsInvalid {
        /// Width of the row.
        vocab: usize,
        /// How many of the model's logits were NaN.
        nan: usize,
    },
}

/// The result for one row of a batch.
pub type SampleOutcome = Result<Sampled, SampleError>;

/// The batch itself is malformed: a bug in the caller, not bad model output.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    /// `logits.len()` is not `rows × vocab`, or `vocab` is zero.
    #[error("logits hold {logits_len} values, expected {rows} rows × {vocab} vocab")]
    ShapeMismatch {
        /// Length of the logits buffer.
        logits_len: usize,
        /// Number of rows given.
        rows: usize,
        /// Vocabulary width given.
        vocab: usize,
    },
}
