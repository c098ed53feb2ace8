//! Sampling: a batch of logits in, one valid token per row out, each row with
//! its own parameters and its own seeded random stream.
//!
//! # The pipeline of one row
//!
//! 1. Take the row's one uniform draw from its [`SamplerState`] (exactly one
//!    per token, whatever follows, so a seeded request's tokens do not depend
//!    on its batch mates or its position in the batch).
//! 2. Sanitize the model's logits: NaN becomes -inf, +inf becomes `f32::MAX`;
//!    either one marks the row as broken ([`logits::sanitize`]).
//! 3. Adjust: repetition penalty (prompt and output tokens), frequency and
//!    presence penalties (output tokens), `logit_bias` clamped to ±100, then
//!    the masks for `min_tokens` and `ignore_eos` ([`logits::apply_adjustments`]),
//!    then the row's grammar mask, if it has one ([`constraint`]).
//!    The result is the *adjusted row*; it is left in the caller's buffer.
//! 4. Draw from the adjusted row with temperature, top-k, top-p and min-p
//!    ([`kernel`] documents the candidate set exactly).
//! 5. Check the answer and fall back if needed ([`guard`]).
//! 6. Log-probabilities, stop detection, and recording the token in the state.
//!
//! # Which distribution log-probabilities describe
//!
//! Log-probabilities are `log_softmax` of the adjusted row: after penalties,
//! `logit_bias` and masks, before temperature and truncation (vLLM's default
//! "raw" reporting, taken after the request's own adjustments). Reasons: the
//! numbers then describe the model as the request shaped it, so a client can
//! compare them across requests that differ only in temperature or top-p;
//! truncation would report log 1 = 0 for a lone greedy candidate and -inf for
//! everything it cut, which tells the client nothing; and a `logit_bias` the
//! client set shows up in what it reads back, as with OpenAI. A consequence
//! is that the chosen token's log-probability can be lower than the one of a
//! token listed above it in `top_logprobs`, because sampling chose among
//! the tempered distribution. Masked tokens have probability zero and are
//! never listed.
//!
//! # Fallbacks
//!
//! Nothing a model or a kernel produces may make a row emit an invalid token
//! or crash the batch. A row whose logits held NaN or +inf is decided by
//! argmax over the sanitized, adjusted row instead of being sampled. A draw
//! that found no candidate, returned an id outside the vocabulary, or
//! returned a masked token is replaced by that same argmax. When every
//! adjusted logit is -inf, the row's outcome is
//! [`SampleError::AllLogitsInvalid`]: that request ends with an error and the
//! rest of the batch continues. Each fallback and failure increments a
//! counter in [`SamplerStats`], and each request logs at most one warning.
//! The fallback argmax respects the masks: a request with `ignore_eos` never
//! gets an end-of-sequence token, even from a broken row.
//!
//! # Other implementations
//!
//! [`Sampler`] is the interface the engine calls. [`CpuSampler`] implements
//! it today; a GPU sampler implements the same trait and must route every
//! row through [`guard::settle_draw`] (or [`guard::fall_back`] for a row with
//! non-finite logits) and count through [`SamplerStats`], so the fallback
//! rules cannot drift between backends.
//!
//! Rows can also be drawn where their logits are, on a backend with
//! `sample_rows` ([`device`]): the host sends each row's uniform and a
//! sparse list of the adjustments of step 3, the device sanitizes, adjusts
//! and draws (step 4), and the host settles the answer with
//! [`guard::settle_summary`] (step 5) and finishes the row as above. Rows
//! that need their whole row on the host (log-probabilities, a grammar
//! mask) are sampled here instead.

pub mod constraint;
pub mod device;
pub mod guard;
pub mod kernel;
pub mod logits;

mod cpu;
mod outcome;
mod params;
#[macro_use]
mod simd;
mod state;
mod stats;

pub use constraint::{Constraint, ConstraintError, TokenConstraint, TokenMask};
pub use cpu::CpuSampler;
pub use kernel::{CpuDrawKernel, DrawKernel, DrawSpec};
pub use outcome::{BatchError, FallbackKind, SampleError, SampleOutcome, Sampled, StopReason, TokenLogprob};
pub use params::{SamplingParamError, SamplingParams, LOGIT_BIAS_LIMIT, MAX_TOP_LOGPROBS};
pub use state::SamplerState;
pub use stats::SamplerStats;

use corridor_units::{RequestId, TokenId};

/// One row of a batch: who it belongs to and how to sample it.
#[derive(Debug)]
pub struct SampleRow<'a> {
    /// The engine's id of the request, only used to name it in warnings.
    pub request_id: RequestId,
    /// The request's parameters, validated at the edge.
    pub params: &'a SamplingParams,
    /// The sequence's random stream and token counts; updated with the
    /// sampled token.
    pub state: &'a mut SamplerState,
    /// The model's end-of-sequence token ids (masked before `min_tokens` and
    /// under `ignore_eos`, reported as [`StopReason::Eos`] otherwise).
    pub eos_token_ids: &'a [TokenId],
    /// The tokens a grammar allows next ([`constraint`]); applied after the
    /// adjustments of step 3, so the fallbacks of step 5 pick among them.
    pub mask: Option<&'a TokenMask>,
}

/// Turns a batch of logits into one outcome per row.
pub trait Sampler {
    /// `logits`: [rows.len() × vocab] row-major. On return each row holds the
    /// sanitized, adjusted values its token was chosen from. The outcomes are
    /// in row order; a row's error concerns that row only. The outer error
    /// means the batch itself is malformed (a caller bug).
    fn sample(
        &mut self,
        logits: &mut [f32],
        vocab: usize,
        rows: &mut [SampleRow<'_>],
    ) -> Result<Vec<SampleOutcome>, BatchError>;
}
