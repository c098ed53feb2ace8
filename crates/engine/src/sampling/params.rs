//! Per-request sampling parameters and their validation.
//!
//! The server turns an OpenAI request into a [`SamplingParams`] and calls
//! [`SamplingParams::validate`] once, at the edge. The error names the
//! offending parameter with the same spelling OpenAI uses, so the server can
//! build its 400 error object (`param`) without a translation table. Ranges
//! follow the OpenAI reference; `repetition_penalty`, `top_k`, `min_p`,
//! `min_tokens`, `ignore_eos` and `stop_token_ids` follow vLLM's extensions.

use std::collections::BTreeMap;

use corridor_units::{TokenId, Tokens};

/// The largest `top_logprobs` OpenAI accepts.
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// `logit_bias` values are clamped to `[-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT]`,
/// as OpenAI documents: at ±100 a token is effectively banned or forced, so a
/// larger magnitude adds nothing but a risk of overflow.
pub const LOGIT_BIAS_LIMIT: f32 = 100.0;

/// The sampling parameters of one request. Plain data: the engine never
/// mutates it, and every field is checked by [`SamplingParams::validate`].
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature in `[0, 2]`; 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `k` most likely tokens; `None` disables the filter.
    /// Requests spell "disabled" as -1 or 0, which
    /// [`SamplingParams::top_k_from_request`] maps to `None`; `Some(0)` is
    /// rejected so that the two spellings cannot mean different things here.
    pub top_k: Option<u32>,
    /// Nucleus sampling: keep the smallest set of most likely tokens whose
    /// probability mass reaches `top_p`, in `(0, 1]`; 1 disables it.
    pub top_p: f32,
    /// Keep tokens whose probability is at least `min_p` times the top
    /// token's, in `[0, 1]`; 0 disables it.
    pub min_p: f32,
    /// vLLM-style multiplicative penalty for tokens seen in the prompt or the
    /// output: positive logits are divided by it, negative ones multiplied.
    /// Must be > 0; 1 disables it.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated, in
    /// `[-2, 2]`.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated, in
    /// `[-2, 2]`.
    pub frequency_penalty: f32,
    /// Added to the logit of a token id; values are clamped to ±100 when
    /// applied. Keys must be valid token ids.
    pub logit_bias: BTreeMap<TokenId, f32>,
    /// Seed of the request's private random stream; `None` draws a fresh seed.
    pub seed: Option<u64>,
    /// End-of-sequence and stop tokens are masked until this many tokens have
    /// been generated.
    pub min_tokens: Tokens,
    /// Mask the model's end-of-sequence tokens for the whole request.
    pub ignore_eos: bool,
    /// Token ids that end the sequence when sampled (reported by the sampler,
    /// acted on by the engine).
    pub stop_token_ids: Vec<TokenId>,
    /// `None`: no log-probabilities. `Some(n)`: report the chosen token's
    /// log-probability and the `n` most likely tokens' (`n` ≤ 20).
    pub logprobs: Option<u32>,
}

impl Default for SamplingParams {
    /// OpenAI's defaults: temperature 1, no truncation, no penalties.
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: BTreeMap::new(),
            seed: None,
            min_tokens: Tokens(0),
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            logprobs: None,
        }
    }
}

/// A parameter outside its valid range. `param` is the request field's name
/// as the client spelled it, for the OpenAI error object.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("invalid '{param}': {message}")]
pub struct SamplingParamError {
    /// The request field, e.g. "temperature", "top_p", "logit_bias".
    pub param: &'static str,
    /// What is wrong, including the value received and the allowed range.
    pub message: String,
}

impl SamplingParamError {
    fn new(param: &'static str, message: String) -> Self {
        SamplingParamError { param, message }
    }
}

/// Checks that `value` is finite and inside `[lo, hi]`.
fn check_closed(param: &'static str, value: f32, lo: f32, hi: f32) -> Result<(), SamplingParamError> {
    if value.is_finite() && (lo..=hi).contains(&value) {
        Ok(())
    } else {
        Err(SamplingParamError::new(param, format!("{value} is outside [{lo}, {hi}]")))
    }
}

impl SamplingParams {
    /// True when the request asks for greedy decoding.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Maps a request's integer `top_k` to the field: -1 and 0 both mean
    /// "disabled" (vLLM uses -1, others 0), a positive value keeps that many
    /// tokens, anything else is an error.
    pub fn top_k_from_request(raw: i64) -> Result<Option<u32>, SamplingParamError> {
        match raw {
            -1 | 0 => Ok(None),
            k if k >= 1 => u32::try_from(k)
                .map(Some)
                .map_err(|_| SamplingParamError::new("top_k", format!("{k} is too large"))),
            k => Err(SamplingParamError::new(
                "top_k",
                format!("{k} is invalid: use a positive value, or -1 or 0 to disable"),
            )),
        }
    }

    /// Checks every field against its range for a model whose logits have
    /// `vocab_size` entries. The first invalid field wins.
    pub fn validate(&self, vocab_size: usize) -> Result<(), SamplingParamError> {
        check_closed("temperature", self.temperature, 0.0, 2.0)?;
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingParamError::new("top_p", format!("{} is outside (0, 1]", self.top_p)));
        }
        if self.top_k == Some(0) {
            return Err(SamplingParamError::new(
                "top_k",
                "0 is not a valid count here; leave top_k unset to disable it".to_string(),
            ));
        }
        check_closed("min_p", self.min_p, 0.0, 1.0)?;
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(SamplingParamError::new(
                "repetition_penalty",
                format!("{} must be a finite number > 0 (1 disables it)", self.repetition_penalty),
            ));
        }
        check_closed("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        check_closed("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        for (&token, &bias) in &self.logit_bias {
            if token.index() >= vocab_size {
                return Err(SamplingParamError::new(
                    "logit_bias",
                    format!("token id {token} is not in the vocabulary (size {vocab_size})"),
                ));
            }
            // Out-of-range values are clamped when applied; only a value
            // that is not a number at all is refused.
            if bias.is_nan() {
                return Err(SamplingParamError::new("logit_bias", format!("bias for token {token} is NaN")));
            }
        }
        if let Some(&token) = self.stop_token_ids.iter().find(|&&t| t.index() >= vocab_size) {
            return Err(SamplingParamError::new(
                "stop_token_ids",
                format!("token id {token} is not in the vocabulary (size {vocab_size})"),
            ));
        }
        if let Some(n) = self.logprobs {
            if n > MAX_TOP_LOGPROBS {
                return Err(SamplingParamError::new(
                    "top_logprobs",
                    format!("{n} is outside [0, {MAX_TOP_LOGPROBS}]"),
                ));
            }
        }
        Ok(())
    }

    /// The bias for one token, clamped to ±[`LOGIT_BIAS_LIMIT`]; NaN (which
    /// `validate` refuses) counts as no bias so that an unvalidated request
    /// still cannot poison a row.
    pub fn clamped_bias(bias: f32) -> f32 {
        if bias.is_nan() {
            0.0
        } else {
            bias.clamp(-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
        }
    }

    /// True when any penalty needs the prompt's tokens.
    pub(crate) fn needs_prompt_tokens(&self) -> bool {
        self.repetition_penalty != 1.0
    }
}
