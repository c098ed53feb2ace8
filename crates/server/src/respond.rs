//! Turning a [`Generation`]'s outputs into OpenAI responses: one JSON body,
//! or a stream of server-sent events.
//!
//! Choice `i` of a request belongs to prompt `i / n` (prompts in order, `n`
//! choices each), which is also OpenAI's `index` numbering for a completion
//! with a list of prompts. `usage` counts each prompt once, with the cached
//! tokens its first choice found; completion tokens are summed over every
//! choice.
//!
//! A stream sends, per choice, a first chunk (the assistant role for chat,
//! the echoed prompt for a completion with `echo`), then text chunks, then a
//! chunk with `finish_reason`; then, with `stream_options.include_usage`, one
//! chunk with empty `choices` and the usage; then `data: [DONE]`. If a choice
//! fails after the headers are out, the stream carries one
//! `data: {"error": ...}` event and ends without `[DONE]`.

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use corridor_engine::engine::Usage;
use futures_util::Stream;
use serde::Serialize;
use serde_json::{Map, Value as Json_};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use crate::api::{
    ChatChoice, ChatChunk, ChatChunkChoice, ChatCompletion, ChatDelta, ChatLogprobs, ChatMessageOut,
    ChatTokenLogprob, Completion, CompletionChoice, LegacyLogprobs, TopLogprob, UsageOut,
};
use crate::error::ApiError;
use crate::generate::{Finish, Generation, Output, TokenInfo, TopToken};
use crate::metrics::{Metrics, Outcome};

/// Identifies the backend configuration in responses, for `seed` users.
pub const SYSTEM_FINGERPRINT: &str = concat!("fp_corridor_", env!("CARGO_PKG_VERSION"));

/// Which endpoint's shapes to produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Chat,
    Completion,
}

/// Everything the response needs besides the generation itself.
pub struct ResponsePlan {
    pub shape: Shape,
    /// `chatcmpl-...` or `cmpl-...`.
    pub id: String,
    pub created: u64,
    pub model: String,
    /// Choices per prompt.
    pub n: usize,
    /// Per prompt, text to put before each of its choices (`echo`).
    pub echo: Vec<Option<String>>,
    pub logprobs: bool,
    pub include_usage: bool,
    pub metrics: Arc<Metrics>,
    /// Where the request's log line reads its token counts.
    pub tally: Arc<crate::access::TokenTally>,
}

#[derive(Default)]
struct Collected {
    text: String,
    tokens: Vec<TokenInfo>,
    finish: Option<Finish>,
    usage: Usage,
}

/// Runs the generation to the end and answers with one JSON body.
pub async fn complete(mut generation: Generation, plan: ResponsePlan) -> Response {
    let mut choices: Vec<Collected> = (0..generation.len()).map(|_| Collected::default()).collect();
    while let Some(outputs) = generation.next().await {
        for output in outputs {
            match output {
                Output::Text { choice, text, tokens } => {
                    choices[choice].text.push_str(&text);
                    choices[choice].tokens.extend(tokens);
                }
                Output::Finished { choice, reason, usage } => {
                    choices[choice].finish = Some(reason);
                    choices[choice].usage = usage;
                }
                Output::Failed { error, .. } => {
                    plan.metrics.count(Outcome::Failed);
                    return error.into_response();
                }
            }
        }
    }
    let usage = total_usage(choices.iter().map(|c| c.usage), plan.n);
    plan.tally.set(usage.prompt_tokens, usage.completion_tokens);
    plan.metrics.count(Outcome::Completed);
    tracing::debug!(
        id = %plan.id,
        prompt_tokens = usage.prompt_tokens,
        cached_tokens = usage.prompt_tokens_details.cached_tokens,
        completion_tokens = usage.completion_tokens,
        "request finished"
    );
    match plan.shape {
        Shape::Chat => {
            let choices = choices
                .into_iter()
                .enumerate()
                .map(|(index, c)| ChatChoice {
                    index,
                    logprobs: plan.logprobs.then(|| chat_logprobs(&c.tokens)),
                    message: ChatMessageOut { role: "assistant", content: c.text },
                    finish_reason: c.finish.unwrap_or(Finish::Length).as_str(),
                })
                .collect();
            Json(ChatCompletion {
                id: plan.id,
                object: "chat.completion",
                created: plan.created,
                model: plan.model,
                system_fingerprint: SYSTEM_FINGERPRINT,
                choices,
                usage,
            })
            .into_response()
        }
        Shape::Completion => {
            let choices = choices
                .into_iter()
                .enumerate()
                .map(|(index, c)| {
                    let prefix = plan.echo.get(index / plan.n.max(1)).cloned().flatten().unwrap_or_default();
                    CompletionChoice {
                        index,
                        logprobs: plan.logprobs.then(|| legacy_logprobs(&c.tokens, prefix.len())),
                        text: prefix + &c.text,
                        finish_reason: Some(c.finish.unwrap_or(Finish::Length).as_str()),
                    }
                })
                .collect();
            Json(Completion {
                id: plan.id,
                object: "text_completion",
                created: plan.created,
                model: plan.model,
                system_fingerprint: SYSTEM_FINGERPRINT,
                choices,
                usage: Some(usage),
            })
            .into_response()
        }
    }
}

/// Answers with a stream of server-sent events.
pub fn stream(generation: Generation, plan: ResponsePlan) -> Response {
    let mut state = StreamState {
        queue: VecDeque::new(),
        usages: vec![Usage::default(); generation.len()],
        text_offsets: vec![0; generation.len()],
        generation,
        plan,
        ended: false,
    };
    state.opening_chunks();
    Sse::new(events(state)).keep_alive(KeepAlive::default()).into_response()
}

struct StreamState {
    generation: Generation,
    plan: ResponsePlan,
    /// Events ready to send.
    queue: VecDeque<SseEvent>,
    usages: Vec<Usage>,
    /// Bytes of text sent so far per choice, for the legacy `text_offset`.
    text_offsets: Vec<usize>,
    /// Nothing more will be queued.
    ended: bool,
}

fn events(state: StreamState) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(event) = st.queue.pop_front() {
                return Some((Ok(event), st));
            }
            if st.ended {
                return None;
            }
            match st.generation.next().await {
                Some(outputs) => {
                    for output in outputs {
                        st.on_output(output);
                        if st.ended {
                            break;
                        }
                    }
                }
                None => st.closing_chunks(),
            }
        }
    })
}

fn json_event(value: &impl Serialize) -> SseEvent {
    // Serializing our own response types cannot fail; an empty object would
    // still be a well-formed event if it somehow did.
    SseEvent::default().data(serde_json::to_string(value).unwrap_or_else(|_| "{}".to_string()))
}

impl StreamState {
    fn chat_chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<UsageOut>) -> SseEvent {
        json_event(&ChatChunk {
            id: self.plan.id.clone(),
            object: "chat.completion.chunk",
            created: self.plan.created,
            model: self.plan.model.clone(),
            system_fingerprint: SYSTEM_FINGERPRINT,
            choices,
            usage,
        })
    }

    fn completion_chunk(&self, choices: Vec<CompletionChoice>, usage: Option<UsageOut>) -> SseEvent {
        json_event(&Completion {
            id: self.plan.id.clone(),
            object: "text_completion",
            created: self.plan.created,
            model: self.plan.model.clone(),
            system_fingerprint: SYSTEM_FINGERPRINT,
            choices,
            usage,
        })
    }

    fn opening_chunks(&mut self) {
        for index in 0..self.generation.len() {
            let event = match self.plan.shape {
                Shape::Chat => self.chat_chunk(
                    vec![ChatChunkChoice {
                        index,
                        delta: ChatDelta { role: Some("assistant"), content: Some(String::new()) },
                        logprobs: None,
                        finish_reason: None,
                    }],
                    None,
                ),
                Shape::Completion => {
                    let prompt = self.plan.n.max(1);
                    let Some(Some(echo)) = self.plan.echo.get(index / prompt).cloned() else { continue };
                    self.text_offsets[index] = echo.len();
                    self.completion_chunk(
                        vec![CompletionChoice { index, text: echo, logprobs: None, finish_reason: None }],
                        None,
                    )
                }
            };
            self.queue.push_back(event);
        }
    }

    fn on_output(&mut self, output: Output) {
        let event = match output {
            Output::Text { choice, text, tokens } => match self.plan.shape {
                Shape::Chat => self.chat_chunk(
                    vec![ChatChunkChoice {
                        index: choice,
                        logprobs: self.plan.logprobs.then(|| chat_logprobs(&tokens)),
                        delta: ChatDelta { role: None, content: Some(text) },
                        finish_reason: None,
                    }],
                    None,
                ),
                Shape::Completion => {
                    let offset = self.text_offsets[choice];
                    self.text_offsets[choice] += text.len();
                    self.completion_chunk(
                        vec![CompletionChoice {
                            index: choice,
                            logprobs: self.plan.logprobs.then(|| legacy_logprobs(&tokens, offset)),
                            text,
                            finish_reason: None,
                        }],
                        None,
                    )
                }
            },
            Output::Finished { choice, reason, usage } => {
                self.usages[choice] = usage;
                match self.plan.shape {
                    Shape::Chat => self.chat_chunk(
                        vec![ChatChunkChoice {
                            index: choice,
                            delta: ChatDelta::default(),
                            logprobs: None,
                            finish_reason: Some(reason.as_str()),
                        }],
                        None,
                    ),
                    Shape::Completion => self.completion_chunk(
                        vec![CompletionChoice {
                            index: choice,
                            text: String::new(),
                            logprobs: None,
                            finish_reason: Some(reason.as_str()),
                        }],
                        None,
                    ),
                }
            }
            Output::Failed { error, .. } => {
                self.plan.metrics.count(Outcome::Failed);
                self.ended = true;
                json_event(&error.body())
            }
        };
        self.queue.push_back(event);
    }

    fn closing_chunks(&mut self) {
        let usage = total_usage(self.usages.iter().copied(), self.plan.n);
        self.plan.tally.set(usage.prompt_tokens, usage.completion_tokens);
        if self.plan.include_usage {
            let event = match self.plan.shape {
                Shape::Chat => self.chat_chunk(Vec::new(), Some(usage)),
                Shape::Completion => self.completion_chunk(Vec::new(), Some(usage)),
            };
            self.queue.push_back(event);
        }
        self.queue.push_back(SseEvent::default().data("[DONE]"));
        self.plan.metrics.count(Outcome::Completed);
        self.ended = true;
    }
}

/// Sums usage over choices, counting each prompt (every `n` choices) once.
fn total_usage(usages: impl Iterator<Item = Usage>, n: usize) -> UsageOut {
    let (mut prompt, mut cached, mut completion) = (0, 0, 0);
    for (i, u) in usages.enumerate() {
        if i % n.max(1) == 0 {
            prompt += u.prompt_tokens;
            cached += u.cached_tokens;
        }
        completion += u.completion_tokens;
    }
    UsageOut::new(prompt, cached, completion)
}

fn chat_logprobs(tokens: &[TokenInfo]) -> ChatLogprobs {
    ChatLogprobs {
        content: tokens
            .iter()
            .map(|t| ChatTokenLogprob {
                token: t.text.clone(),
                logprob: t.logprob,
                bytes: t.bytes.clone(),
                top_logprobs: t
                    .top
                    .iter()
                    .map(|a| TopLogprob { token: a.text.clone(), logprob: a.logprob, bytes: a.bytes.clone() })
                    .collect(),
            })
            .collect(),
        refusal: None,
    }
}

/// The legacy shape; `start` is the byte offset of the first token in the
/// choice's text.
fn legacy_logprobs(tokens: &[TokenInfo], start: usize) -> LegacyLogprobs {
    let mut out = LegacyLogprobs::default();
    let mut offset = start;
    for t in tokens {
        out.tokens.push(t.text.clone());
        out.token_logprobs.push(Some(t.logprob));
        let mut top = Map::new();
        for TopToken { text, logprob: lp, .. } in &t.top {
            // Two ids with the same text collapse to the likelier one, which
            // comes first.
            top.entry(text.clone()).or_insert_with(|| Json_::from(*lp));
        }
        out.top_logprobs.push(Some(top));
        out.text_offset.push(offset);
        offset += t.text.len();
    }
    out
}

/// Answers a request that failed before generation started.
pub fn reject(error: ApiError, metrics: &Metrics) -> Response {
    if error.status().is_client_error() {
        tracing::debug!(status = error.status().as_u16(), "request refused: {error}");
    }
    metrics.count(if error.status().is_client_error() { Outcome::Rejected } else { Outcome::Failed });
    error.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_counts_each_prompt_once() {
        let u = |p, c, g| Usage { prompt_tokens: p, cached_tokens: c, completion_tokens: g };
        // Two prompts, two choices each.
        let total = total_usage([u(10, 0, 3), u(10, 10, 4), u(7, 5, 1), u(7, 7, 2)].into_iter(), 2);
        assert_eq!(total, UsageOut::new(17, 5, 10));
    }

    #[test]
    fn legacy_offsets_accumulate() {
        let t = |s: &str| TokenInfo {
            text: s.into(),
            bytes: s.as_bytes().to_vec(),
            logprob: -1.0,
            top: vec![TopToken { text: s.into(), bytes: s.as_bytes().to_vec(), logprob: -1.0 }],
        };
        let lp = legacy_logprobs(&[t("ab"), t("c")], 5);
        assert_eq!(lp.text_offset, vec![5, 7]);
        assert_eq!(lp.tokens, vec!["ab".to_string(), "c".to_string()]);
    }
}
