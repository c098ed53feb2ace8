//! Per-sequence sampler state: the request's private random stream and the
//! token counts the penalties read.
//!
//! Seeds are reproducible because every row draws only from its own stream,
//! and exactly one 64-bit draw is taken per sampled token whatever the
//! parameters or the outcome (greedy, fallback, or error). The n-th token of a
//! seeded request therefore always sees the n-th draw of its stream, no matter
//! which other requests share the batch or where the row sits in it.

use std::collections::{HashMap, HashSet};

use corridor_units::{TokenId, Tokens};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;

use super::params::SamplingParams;

/// What one sequence carries from one sampled token to the next.
#[derive(Clone, Debug)]
pub struct SamplerState {
    /// The request's private random stream.
    rng: ChaCha20Rng,
    /// The seed the stream started from: the request's, or a fresh one, so an
    /// unseeded request can still be replayed from the logs.
    seed: u64,
    /// Distinct prompt tokens, for the repetition penalty. Only kept when the
    /// request's repetition penalty is on, since a long prompt is costly.
    prompt_tokens: HashSet<TokenId>,
    /// Whether `prompt_tokens` was filled (the request had a repetition
    /// penalty when the state was made).
    prompt_tracked: bool,
    /// How many times each token was generated, for all three penalties.
    output_counts: HashMap<TokenId, u32>,
    /// Tokens generated so far, for `min_tokens`.
    generated: Tokens,
    /// Whether a fallback warning was already logged for this request; later
    /// fallbacks are only counted.
    warned: bool,
}

impl SamplerState {
    /// A fresh state for a request with `params` whose prompt is `prompt`.
    /// The stream is seeded from `params.seed`, or from a fresh random seed.
    pub fn new(params: &SamplingParams, prompt: &[TokenId]) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random::<u64>);
        let prompt_tracked = params.needs_prompt_tokens();
        let prompt_tokens = if prompt_tracked { prompt.iter().copied().collect() } else { HashSet::new() };
        SamplerState {
            rng: ChaCha20Rng::seed_from_u64(seed),
            seed,
            prompt_tokens,
            prompt_tracked,
            output_counts: HashMap::new(),
            generated: Tokens(0),
            warned: false,
        }
    }

    /// The seed the random stream started from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> Tokens {
        self.generated
    }

    /// Whether a fallback or failure of this request was already logged.
    pub fn has_warned(&self) -> bool {
        self.warned
    }

    /// How many times `token` was generated.
    pub fn output_count(&self, token: TokenId) -> u32 {
        self.output_counts.get(&token).copied().unwrap_or(0)
    }

    /// Records a token appended to the sequence. The sampler calls this for
    /// every token it returns; the engine calls it only for tokens it appends
    /// by other means (e.g. forced or replayed ones).
    pub fn record(&mut self, token: TokenId) {
        *self.output_counts.entry(token).or_insert(0) += 1;
        self.generated = self.generated + Tokens(1);
    }

    /// The row's one uniform draw in `[0, 1)` for this token: the top 53 bits
    /// of one 64-bit output, so each value is exactly representable. Written
    /// out here rather than taken from `rand`'s distributions so that a seed
    /// keeps its meaning across `rand` releases.
    pub(crate) fn next_uniform(&mut self) -> f64 {
        (self.rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Marks the request as warned; returns true the first time only.
    pub(crate) fn take_first_warning(&mut self) -> bool {
        !std::mem::replace(&mut self.warned, true)
    }

    /// Distinct prompt tokens (empty unless the repetition penalty was on).
    pub(crate) fn prompt_tokens(&self) -> &HashSet<TokenId> {
        &self.prompt_tokens
    }

    /// Whether the prompt tokens were kept.
    pub(crate) fn prompt_tracked(&self) -> bool {
        self.prompt_tracked
    }

    /// Generated tokens and their counts.
    pub(crate) fn output_counts(&self) -> &HashMap<TokenId, u32> {
        &self.output_counts
    }
}
