//! Running one HTTP request's choices on the engine and turning their token
//! events into text.
//!
//! Each choice is one engine request. Its tokens go through the incremental
//! detokenizer (never half a character) and then the stop-string matcher
//! (never part of a stop string), and come out as [`Output`]s. Streaming and
//! non-streaming responses are built from the same outputs, so their text is
//! the same by construction.
//!
//! When a stop string matches, the choice asks the engine to finish the
//! request (`finish_early`), ignores any token that was already on its way,
//! and reports `stop` once the engine confirms with `Done`, whose usage
//! carries the cached prompt tokens. Its `completion_tokens` counts the
//! tokens generated up to and including the one that completed the stop
//! string: those are the tokens the client paid for, even though the stop
//! string's own text is not returned.
//!
//! The tokenizer works in `u32` ids: an [`Event::Token`]'s `TokenId` becomes
//! one here, in `on_event`, once per token.
//!
//! Dropping a [`Generation`] drops its engine streams, which aborts every
//! unfinished choice and frees its KV pages: a client that disconnects
//! (its response body or handler future is dropped) costs nothing after
//! that.

use corridor_engine::engine::{EngineHandle, Event, FinishReason, GenerateRequest, RequestStream, Usage};
use corridor_engine::sampling::TokenLogprob;
use std::sync::Arc;
use std::time::Instant;

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::stop::StopMatcher;
use crate::tokenizer::{DecodeStream, Tokenizer};

/// Why a choice ended, as OpenAI spells it. Aborts and failures are never
/// reported as a finish reason; they are errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// A token as the client sees it in `logprobs`.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenInfo {
    /// The token's text on its own (a partial character shows as U+FFFD).
    pub text: String,
    /// The token's raw bytes (a partial character's own bytes).
    pub bytes: Vec<u8>,
    pub logprob: f32,
    /// The most likely alternatives, most likely first.
    pub top: Vec<TopToken>,
}

/// One alternative in `top_logprobs`.
#[derive(Debug, Clone, PartialEq)]
pub struct TopToken {
    pub text: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

/// What a [`Generation`] yields.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Final text of a choice, with the tokens it came from (only when
    /// log-probabilities were asked for; tokens whose text is still held back
    /// travel with the text that releases them).
    Text { choice: usize, text: String, tokens: Vec<TokenInfo> },
    /// The choice is complete.
    Finished { choice: usize, reason: Finish, usage: Usage },
    /// The choice failed (the engine stopped, shut down, or faulted).
    Failed { choice: usize, error: ApiError },
}

/// One choice to run.
pub struct ChoiceSpec {
    pub request: GenerateRequest,
}

/// How the choices of one request are decoded.
#[derive(Clone)]
pub struct DecodeSettings {
    pub tokenizer: Arc<Tokenizer>,
    pub stop: Vec<String>,
    pub skip_special_tokens: bool,
    pub logprobs: bool,
}

struct ChoiceState {
    decode: DecodeStream,
    stop: StopMatcher,
    /// Tokens not yet attached to released text (logprobs only).
    pending: Vec<TokenInfo>,
    generated: usize,
    /// A stop string matched and the engine was asked to finish.
    stopped_by_string: bool,
    submitted: Instant,
    last_token: Option<Instant>,
}

/// The running choices of one request.
pub struct Generation {
    streams: Vec<Option<RequestStream>>,
    choices: Vec<ChoiceState>,
    settings: DecodeSettings,
    metrics: Arc<Metrics>,
}

impl Generation {
    /// Submits every choice to the engine.
    pub fn start(
        engine: &EngineHandle,
        specs: Vec<ChoiceSpec>,
        settings: DecodeSettings,
        metrics: Arc<Metrics>,
    ) -> Result<Generation, ApiError> {
        let mut streams = Vec::with_capacity(specs.len());
        let mut choices = Vec::with_capacity(specs.len());
        for spec in specs {
            let stream =
                engine.submit(spec.request).map_err(|e| ApiError::Unavailable { message: e.to_string() })?;
            streams.push(Some(stream));
            choices.push(ChoiceState {
                decode: settings.tokenizer.decode_stream(settings.skip_special_tokens),
                stop: StopMatcher::new(&settings.stop),
                pending: Vec::new(),
                generated: 0,
                stopped_by_string: false,
                submitted: Instant::now(),
                last_token: None,
            });
        }
        Ok(Generation { streams, choices, settings, metrics })
    }

    /// How many choices this request has.
    pub fn len(&self) -> usize {
        self.choices.len()
    }

    /// True when the request has no choices.
    pub fn is_empty(&self) -> bool {
        self.choices.is_empty()
    }

    /// The next outputs of any choice, or `None` once every choice has ended.
    /// Cancel-safe: dropping the future loses no event.
    pub async fn next(&mut self) -> Option<Vec<Output>> {
        loop {
            let waiting: Vec<_> = self
                .streams
                .iter_mut()
                .enumerate()
                .filter_map(|(i, s)| s.as_mut().map(|s| Box::pin(async move { (i, s.next().await) })))
                .collect();
            if waiting.is_empty() {
                return None;
            }
            // Receiving from an engine stream is cancel-safe, so the futures
            // that lose the race lose nothing.
            let ((i, event), _, rest) = futures_util::future::select_all(waiting).await;
            drop(rest);
            let out = self.on_event(i, event);
            if !out.is_empty() {
                return Some(out);
            }
        }
    }

    fn on_event(&mut self, i: usize, event: Option<Event>) -> Vec<Output> {
        match event {
            Some(Event::Token { token, logprob, top_logprobs }) => {
                self.on_token(i, token.get(), logprob, &top_logprobs)
            }
            Some(Event::Done { reason, usage }) => {
                // The stream is complete; dropping it sends no abort.
                self.streams[i] = None;
                self.on_done(i, reason, usage)
            }
            None => {
                self.streams[i] = None;
                vec![Output::Failed {
                    choice: i,
                    error: ApiError::Unavailable { message: "the engine has stopped".into() },
                }]
            }
        }
    }

    fn on_token(&mut self, i: usize, token: u32, logprob: Option<f32>, top: &[TokenLogprob]) -> Vec<Output> {
        let tokenizer = &self.settings.tokenizer;
        let c = &mut self.choices[i];
        if c.stopped_by_string {
            // Generated before the engine handled the finish; not ours to send.
            return Vec::new();
        }
        let now = Instant::now();
        match c.last_token {
            None => self.metrics.ttft.observe(now - c.submitted),
            Some(last) => self.metrics.itl.observe(now - last),
        }
        c.last_token = Some(now);
        c.generated += 1;
        if self.settings.logprobs {
            let text_of = |id: u32| tokenizer.decode(&[id], false).unwrap_or_default();
            c.pending.push(TokenInfo {
                text: text_of(token),
                bytes: tokenizer.token_bytes(token),
                logprob: logprob.unwrap_or(f32::NEG_INFINITY),
                top: top
                    .iter()
                    .map(|t| TopToken {
                        text: text_of(t.token.get()),
                        bytes: tokenizer.token_bytes(t.token.get()),
                        logprob: t.logprob,
                    })
                    .collect(),
            });
        }
        let piece = match c.decode.push(tokenizer, token) {
            Ok(piece) => piece,
            Err(e) => {
                // The sampler guarantees ids inside the vocabulary; a failure
                // here is the server's fault, not the client's.
                return vec![Output::Failed {
                    choice: i,
                    error: ApiError::Internal { message: e.to_string() },
                }];
            }
        };
        let Some(piece) = piece else { return Vec::new() };
        let step = c.stop.push(&piece);
        if step.stopped {
            c.stopped_by_string = true;
            if let Some(stream) = &self.streams[i] {
                stream.finish_early();
            }
            self.metrics.note_stop_string();
        }
        if step.emit.is_empty() && (c.pending.is_empty() || !step.stopped) {
            return Vec::new();
        }
        vec![Output::Text { choice: i, text: step.emit, tokens: std::mem::take(&mut c.pending) }]
    }

    fn on_done(&mut self, i: usize, reason: FinishReason, usage: Usage) -> Vec<Output> {
        let c = &mut self.choices[i];
        if c.stopped_by_string {
            let usage = Usage { completion_tokens: c.generated, ..usage };
            return vec![Output::Finished { choice: i, reason: Finish::Stop, usage }];
        }
        let mut finish = match reason {
            FinishReason::Stop => Finish::Stop,
            FinishReason::Length => Finish::Length,
            FinishReason::Aborted => {
                let message = "the request was aborted: the server is shutting down".to_string();
                return vec![Output::Failed { choice: i, error: ApiError::Unavailable { message } }];
            }
            FinishReason::Error(message) => {
                return vec![Output::Failed { choice: i, error: ApiError::Internal { message } }];
            }
        };
        // Release what the detokenizer and the stop matcher still hold; the
        // tail may itself complete a stop string.
        let tail = match c.decode.finish(&self.settings.tokenizer) {
            Ok(t) => t,
            Err(e) => {
                return vec![Output::Failed {
                    choice: i,
                    error: ApiError::Internal { message: e.to_string() },
                }]
            }
        };
        let step = c.stop.push(&tail);
        let mut text = step.emit;
        if step.stopped {
            finish = Finish::Stop;
            self.metrics.note_stop_string();
        } else {
            text.push_str(&c.stop.finish());
        }
        let mut out = Vec::with_capacity(2);
        if !text.is_empty() || !c.pending.is_empty() {
            out.push(Output::Text { choice: i, text, tokens: std::mem::take(&mut c.pending) });
        }
        out.push(Output::Finished { choice: i, reason: finish, usage });
        out
    }
}
