//! What each request asks for: prompts built from single-token words, lengths drawn from the seed.
//!
//! There is no tokenizer here (the bench must drive any server), so a prompt of N tokens is N words
//! each of which is a single token, leading space included, in the common BPE vocabularies (GPT-2,
//! Llama 3, Qwen, Mistral). The server's own count is what the report shows; a chat template or a
//! BOS token makes it differ from the requested length, and the report says by how much.
//!
//! Session `i` is drawn from its own stream of the seeded generator, so what a request contains
//! depends only on the seed and its index, never on which task sent it or when.

use crate::config::WorkloadSpec;
use corridor_units::Tokens;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;

/// Words that are one token each in common BPE vocabularies.
pub const WORDS: [&str; 64] = [
    " the", " of", " and", " to", " in", " is", " that", " for", " it", " as", " was", " with", " be", " by",
    " on", " not", " he", " this", " are", " or", " his", " from", " at", " which", " but", " have", " an",
    " had", " they", " you", " were", " their", " one", " all", " we", " can", " her", " has", " there",
    " been", " if", " more", " when", " will", " would", " who", " so", " no", " time", " people", " new",
    " first", " like", " over", " also", " some", " into", " out", " up", " about", " than", " them",
    " only", " other",
];

/// Stream reserved for the shared system prompt, far from any session index.
const PREFIX_STREAM: u64 = u64::MAX;

/// Log-normal parameters of the chat workload, shaped like public chat traces (ShareGPT-style):
/// most prompts are a few hundred tokens with a long tail into the thousands, outputs likewise.
/// With these values the prompt p50/p99 are about 180/2300 tokens and the output p50/p99 about
/// 150/1200 tokens, before the caps.
const CHAT_PROMPT_MEDIAN: f64 = 180.0;
const CHAT_PROMPT_SIGMA: f64 = 1.1;
const CHAT_OUTPUT_MEDIAN: f64 = 150.0;
const CHAT_OUTPUT_SIGMA: f64 = 0.9;
/// Floors of drawn lengths: a prompt needs some content, an output at least one token.
const CHAT_MIN_PROMPT: usize = 4;
const CHAT_MIN_OUTPUT: usize = 1;

/// Which OpenAI endpoint a session talks to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// One user turn: the text to send and the lengths asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct Turn {
    pub user: String,
    /// Words in `user`, each meant to be one token.
    pub input: Tokens,
    /// `max_tokens` for the reply.
    pub output: Tokens,
}

/// A unit of work: one request, or a conversation whose turns are sent one after another.
#[derive(Clone, Debug, PartialEq)]
pub struct Session {
    pub endpoint: Endpoint,
    /// A system prompt sent first, shared by every session of the shared-prefix workload.
    pub system: Option<Arc<str>>,
    pub system_tokens: Tokens,
    pub turns: Vec<Turn>,
}

/// `n` words drawn from `rng`.
pub fn words(rng: &mut impl Rng, n: Tokens) -> String {
    let mut text = String::with_capacity(n.get() * 6);
    for _ in 0..n.get() {
        text.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    text
}

/// A log-normal draw with the given median and shape, rounded and clamped to `[min, max]`.
fn log_normal(rng: &mut impl Rng, median: f64, sigma: f64, min: usize, max: usize) -> Tokens {
    // Box-Muller: two uniforms give one standard normal; `1 - u` keeps the logarithm finite.
    let u1: f64 = rng.random();
    let u2: f64 = rng.random();
    let z = (-2.0 * (1.0 - u1).ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
    let value = (median * (sigma * z).exp()).round();
    Tokens((value as usize).clamp(min, max.max(min)))
}

/// Draws sessions for a workload.
#[derive(Debug)]
pub struct Planner {
    workload: WorkloadSpec,
    seed: u64,
    shared_prefix: Option<Arc<str>>,
}

impl Planner {
    pub fn new(workload: WorkloadSpec, seed: u64) -> Planner {
        let shared_prefix = match &workload {
            WorkloadSpec::SharedPrefix { prefix, .. } => {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                rng.set_stream(PREFIX_STREAM);
                Some(Arc::from(words(&mut rng, *prefix)))
            }
            _ => None,
        };
        Planner { workload, seed, shared_prefix }
    }

    /// The endpoint every session of this workload uses.
    pub fn endpoint(&self) -> Endpoint {
        match self.workload {
            WorkloadSpec::Fixed { .. } => Endpoint::Completions,
            _ => Endpoint::Chat,
        }
    }

    /// Session number `index`; the same index and seed always give the same session.
    pub fn session(&self, index: u64) -> Session {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        rng.set_stream(index);
        let endpoint = self.endpoint();
        let single = |rng: &mut ChaCha8Rng, input: Tokens, output: Tokens| {
            vec![Turn { user: words(rng, input), input, output }]
        };
        match &self.workload {
            WorkloadSpec::Fixed { input, output } => Session {
                endpoint,
                system: None,
                system_tokens: Tokens(0),
                turns: single(&mut rng, *input, *output),
            },
            WorkloadSpec::Chat { max_input, max_output } => {
                let input = log_normal(
                    &mut rng,
                    CHAT_PROMPT_MEDIAN,
                    CHAT_PROMPT_SIGMA,
                    CHAT_MIN_PROMPT,
                    max_input.get(),
                );
                let output = log_normal(
                    &mut rng,
                    CHAT_OUTPUT_MEDIAN,
                    CHAT_OUTPUT_SIGMA,
                    CHAT_MIN_OUTPUT,
                    max_output.get(),
                );
                Session {
                    endpoint,
                    system: None,
                    system_tokens: Tokens(0),
                    turns: single(&mut rng, input, output),
                }
            }
            WorkloadSpec::SharedPrefix { prefix, input, output } => Session {
                endpoint,
                system: self.shared_prefix.clone(),
                system_tokens: *prefix,
                turns: single(&mut rng, *input, *output),
            },
            WorkloadSpec::MultiTurn { turns, input, output } => Session {
                endpoint,
                system: None,
                system_tokens: Tokens(0),
                turns: (0..*turns).map(|_| single(&mut rng, *input, *output).remove(0)).collect(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::nearest_rank;

    #[test]
    fn fixed_prompts_have_the_requested_words_and_repeat_with_the_seed() {
        let planner = Planner::new(WorkloadSpec::Fixed { input: Tokens(50), output: Tokens(7) }, 3);
        let a = planner.session(5);
        assert_eq!(a, planner.session(5));
        assert_ne!(a.turns[0].user, planner.session(6).turns[0].user);
        assert_ne!(
            a.turns[0].user,
            Planner::new(WorkloadSpec::Fixed { input: Tokens(50), output: Tokens(7) }, 4).session(5).turns[0]
                .user
        );
        assert_eq!(a.endpoint, Endpoint::Completions);
        assert_eq!(a.turns[0].user.matches(' ').count(), 50);
        assert!(a.turns[0].user.split(' ').skip(1).all(|w| WORDS.contains(&format!(" {w}").as_str())));
        assert_eq!(a.turns[0].output, Tokens(7));
    }

    #[test]
    fn chat_lengths_are_long_tailed_and_capped() {
        let planner =
            Planner::new(WorkloadSpec::Chat { max_input: Tokens(4096), max_output: Tokens(1024) }, 1);
        let mut inputs: Vec<f64> = Vec::new();
        let mut outputs: Vec<f64> = Vec::new();
        for i in 0..2000 {
            let turn = &planner.session(i).turns[0];
            assert!(turn.input.get() >= CHAT_MIN_PROMPT && turn.input.get() <= 4096);
            assert!(turn.output.get() >= CHAT_MIN_OUTPUT && turn.output.get() <= 1024);
            assert_eq!(turn.user.matches(' ').count(), turn.input.get());
            inputs.push(turn.input.get() as f64);
            outputs.push(turn.output.get() as f64);
        }
        inputs.sort_by(f64::total_cmp);
        outputs.sort_by(f64::total_cmp);
        let (p50, p99) = (nearest_rank(&inputs, 50.0).unwrap(), nearest_rank(&inputs, 99.0).unwrap());
        // A long tail: the p99 prompt is many times the median (about 13x for sigma 1.1).
        assert!((120.0..260.0).contains(&p50), "prompt p50 {p50}");
        assert!(p99 > 6.0 * p50, "prompt p99 {p99} vs p50 {p50}");
        let (p50, p99) = (nearest_rank(&outputs, 50.0).unwrap(), nearest_rank(&outputs, 99.0).unwrap());
        assert!((100.0..220.0).contains(&p50), "output p50 {p50}");
        assert!(p99 > 4.0 * p50, "output p99 {p99} vs p50 {p50}");
    }

    #[test]
    fn shared_prefix_sessions_share_the_system_prompt_only() {
        let spec = WorkloadSpec::SharedPrefix { prefix: Tokens(300), input: Tokens(20), output: Tokens(5) };
        let planner = Planner::new(spec, 9);
        let (a, b) = (planner.session(0), planner.session(1));
        assert_eq!(a.system, b.system);
        assert_eq!(a.system.as_deref().map(|s| s.matches(' ').count()), Some(300));
        assert_ne!(a.turns[0].user, b.turns[0].user);
        assert_eq!(a.endpoint, Endpoint::Chat);
    }

    #[test]
    fn multi_turn_sessions_have_distinct_turns() {
        let spec = WorkloadSpec::MultiTurn { turns: 3, input: Tokens(10), output: Tokens(4) };
        let session = Planner::new(spec, 2).session(0);
        assert_eq!(session.turns.len(), 3);
        assert_ne!(session.turns[0].user, session.turns[1].user);
    }
}
