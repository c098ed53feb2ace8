//! Per-sequence sampler state: the request's private random stream and the
//! token counts the penalties read.
//!
//! Seeds are reproducible because every row draws only from its own stream,
//! and exactly one 64-bit draw is taken per sampled token whatever the
//! parameters or the outcome (greedy, fallback, or error). The n-th token of a
//! seeded request therefore always sees the n-th draw of its stream, no matter
//! which other requests share the batch or where the row sits in it.

use std::collections::{HashMap, HashSet};

use corridor_backend::sample::LogitEdit;
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
    /// The tokens that end a reply are left out (see [`SamplerState::new`]).
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
    /// The penalties' device edits, made the first time a row is sampled on
    /// a device and kept up to date by `record` from then on.
    penalty_edits: Option<PenaltyEdits>,
}

/// The penalties' part of a row's device edits (what
/// [`super::device::adjustment_edits`] sends for the repetition, frequency
/// and presence penalties): one edit per prompt or output token they touch.
/// Kept up to date a token at a time by [`SamplerState::record`], so a step
/// copies it instead of rebuilding it from the counts (a 512-token prompt
/// is 512 edits a row, every step).
#[derive(Clone, Debug)]
pub(crate) struct PenaltyEdits {
    rep: f32,
    freq: f32,
    pres: f32,
    vocab: usize,
    /// One edit per token, below `vocab`.
    pub(crate) edits: Vec<LogitEdit>,
    /// Where each token's edit is in `edits`.
    pub(crate) at: HashMap<TokenId, usize>,
}

impl PenaltyEdits {
    /// Whether these edits are the ones `params` asks for over `vocab` logits.
    fn serves(&self, params: &SamplingParams, vocab: usize) -> bool {
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits();
        same(self.rep, params.repetition_penalty)
            && same(self.freq, params.frequency_penalty)
            && same(self.pres, params.presence_penalty)
            && self.vocab == vocab
    }

    /// The edits from the whole history, or `None` when no penalty is on.
    fn build(
        params: &SamplingParams,
        vocab: usize,
        prompt: &HashSet<TokenId>,
        outputs: &HashMap<TokenId, u32>,
    ) -> Option<Self> {
        let (rep, freq, pres) =
            (params.repetition_penalty, params.frequency_penalty, params.presence_penalty);
        if rep == 1.0 && freq == 0.0 && pres == 0.0 {
            return None;
        }
        // Room for the tokens still to come, so `note` rarely grows them.
        let len = outputs.len() + if rep != 1.0 { prompt.len() } else { 0 };
        let len = len + len / 2 + 64;
        let mut p = PenaltyEdits {
            rep,
            freq,
            pres,
            vocab,
            edits: Vec::with_capacity(len),
            at: HashMap::with_capacity(len),
        };
        for (&token, &count) in outputs {
            p.note(token, count);
        }
        if rep != 1.0 {
            for &token in prompt {
                if token.index() < vocab && !p.at.contains_key(&token) {
                    p.at.insert(token, p.edits.len());
                    p.edits.push(LogitEdit { token: token.get(), rep, sub: 0.0, bias: 0.0, flags: 0 });
                }
            }
        }
        Some(p)
    }

    /// `token` was generated `count` times so far: its edit takes the
    /// repetition penalty (a prompt token's already has it) and the
    /// frequency and presence penalties of that count.
    fn note(&mut self, token: TokenId, count: u32) {
        if token.index() >= self.vocab {
            return;
        }
        let counted = self.freq != 0.0 || self.pres != 0.0;
        let presence = if count > 0 { self.pres } else { 0.0 };
        let sub = if counted { count as f32 * self.freq + presence } else { 0.0 };
        let rep = self.rep;
        match self.at.get(&token) {
            Some(&i) => {
                self.edits[i].rep = rep;
                self.edits[i].sub = sub;
            }
            None => {
                self.at.insert(token, self.edits.len());
                self.edits.push(LogitEdit { token: token.get(), rep, sub, bias: 0.0, flags: 0 });
            }
        }
    }
}

impl SamplerState {
    /// A fresh state for a request with `params` whose prompt is `prompt`.
    /// The stream is seeded from `params.seed`, or from a fresh random seed.
    ///
    /// `ends` are the tokens that end a reply (the model's end-of-sequence
    /// ids); they and the request's `stop_token_ids` never take the
    /// repetition penalty. A chat template writes the end-of-turn token into
    /// the prompt after every message, so the penalty would otherwise make
    /// the one token that ends the reply less likely at every step: at the
    /// built-in defaults (penalty 1.1, temperature 0.2) an end-of-turn logit
    /// of 15 loses 1.4, a factor of about 1,000 in its probability, and a
    /// small model that has drifted keeps talking to the end of its context.
    pub fn new(params: &SamplingParams, prompt: &[TokenId], ends: &[TokenId]) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random::<u64>);
        let prompt_tracked = params.needs_prompt_tokens();
        let ends_reply = |t: &TokenId| ends.contains(t) || params.stop_token_ids.contains(t);
        let prompt_tokens = if prompt_tracked {
            prompt.iter().copied().filter(|t| !ends_reply(t)).collect()
        } else {
            HashSet::new()
        };
        SamplerState {
            rng: ChaCha20Rng::seed_from_u64(seed),
            seed,
            prompt_tokens,
            prompt_tracked,
            output_counts: HashMap::new(),
            generated: Tokens(0),
            warned: false,
            penalty_edits: None,
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
        let count = self.output_counts.entry(token).or_insert(0);
        *count += 1;
        if let Some(p) = &mut self.penalty_edits {
            p.note(token, *count);
        }
        self.generated = self.generated + Tokens(1);
    }

    /// The penalties' device edits for `params` over `vocab` logits, made
    /// from the history the first time (or when asked for other penalties),
    /// then kept by `record`; `None` when no penalty is on.
    pub(crate) fn penalty_edits(&mut self, params: &SamplingParams, vocab: usize) -> Option<&PenaltyEdits> {
        if !self.penalty_edits.as_ref().is_some_and(|p| p.serves(params, vocab)) {
            self.penalty_edits = PenaltyEdits::build(params, vocab, &self.prompt_tokens, &self.output_counts);
        }
        self.penalty_edits.as_ref()
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
