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
    ChatTokenLogprob, Completion, CompletionChoice, FunctionDelta, FunctionOut, LegacyLogprobs,
    ToolCallDelta, ToolCallOut, TopLogprob, UsageOut,
};
use crate::error::ApiError;
use crate::generate::{Finish, Generation, Output, TokenInfo, TopToken};
use crate::metrics::{Metrics, Outcome};
use crate::tools::reasoning::ReasoningSplitter;
use crate::tools::shaper::{ChatShaper, Delta, ShapeMode};
use crate::validate::ReasoningStart;

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
    /// How chat answers are split into reasoning, content and tool calls
    /// (`None` for completions).
    pub reading: Option<ChatReading>,
}

/// How to read a chat answer.
#[derive(Debug, Clone)]
pub struct ChatReading {
    pub mode: ShapeMode,
    pub reasoning: ReasoningStart,
}

impl ChatReading {
    fn shaper(&self) -> ChatShaper {
        let splitter = match self.reasoning {
            ReasoningStart::Off => None,
            ReasoningStart::MayOpen => Some(ReasoningSplitter::new()),
            ReasoningStart::Inside => Some(ReasoningSplitter::inside()),
        };
        ChatShaper::new(self.mode.clone(), splitter)
    }
}

/// The finish reason a chat choice reports: a choice that called tools
/// says so.
fn chat_finish(reason: Finish, shaper: Option<&ChatShaper>) -> &'static str {
    match shaper {
        Some(s) if !s.calls().is_empty() => "tool_calls",
        _ => reason.as_str(),
    }
}

/// A chat message assembled from an answer's deltas.
fn chat_message(deltas: &[Delta], shaper: &ChatShaper) -> ChatMessageOut {
    let (mut content, mut reasoning) = (String::new(), String::new());
    for d in deltas {
        match d {
            Delta::Content(t) => content.push_str(t),
            Delta::Reasoning(t) => reasoning.push_str(t),
            Delta::CallStart { .. } | Delta::CallArgs { .. } => {}
        }
    }
    let tool_calls: Vec<ToolCallOut> = shaper
        .calls()
        .iter()
        .map(|c| ToolCallOut {
            id: c.id.clone(),
            kind: "function",
            function: FunctionOut { name: c.name.clone(), arguments: c.arguments.clone() },
        })
        .collect();
    let content = if content.is_empty() && !tool_calls.is_empty() { None } else { Some(content) };
    ChatMessageOut {
        role: "assistant",
        content,
        reasoning_content: (!reasoning.is_empty()).then_some(reasoning),
        tool_calls,
    }
}

/// The streamed form of one delta.
fn chat_delta(delta: Delta) -> ChatDelta {
    match delta {
        Delta::Content(t) => ChatDelta { content: Some(t), ..ChatDelta::default() },
        Delta::Reasoning(t) => ChatDelta { reasoning_content: Some(t), ..ChatDelta::default() },
        Delta::CallStart { index, id, name } => ChatDelta {
            tool_calls: Some(vec![ToolCallDelta {
                index,
                id: Some(id),
                kind: Some("function"),
                function: FunctionDelta { name: Some(name), arguments: Some(String::new()) },
            }]),
            ..ChatDelta::default()
        },
        Delta::CallArgs { index, fragment } => ChatDelta {
            tool_calls: Some(vec![ToolCallDelta {
                index,
                id: None,
                kind: None,
                function: FunctionDelta { name: None, arguments: Some(fragment) },
            }]),
            ..ChatDelta::default()
        },
    }
}

#[derive(Default)]
struct Collected {
    text: String,
    /// Chat only: the answer's shaper and what it released.
    shaper: Option<ChatShaper>,
    deltas: Vec<Delta>,
    tokens: Vec<TokenInfo>,
    finish: Option<Finish>,
    usage: Usage,
}

/// Runs the generation to the end and answers with one JSON body.
pub async fn complete(mut generation: Generation, plan: ResponsePlan) -> Response {
    let mut choices: Vec<Collected> = (0..generation.len())
        .map(|_| Collected { shaper: plan.reading.as_ref().map(ChatReading::shaper), ..Collected::default() })
        .collect();
    while let Some(outputs) = generation.next().await {
        for output in outputs {
            match output {
                Output::Text { choice, text, tokens } => {
                    let c = &mut choices[choice];
                    if let Some(shaper) = &mut c.shaper {
                        c.deltas.extend(shaper.push(&text));
                    }
                    c.text.push_str(&text);
                    c.tokens.extend(tokens);
                }
                Output::Finished { choice, reason, usage } => {
                    let c = &mut choices[choice];
                    if let Some(shaper) = &mut c.shaper {
                        c.deltas.extend(shaper.finish());
                    }
                    c.finish = Some(reason);
                    c.usage = usage;
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
                    message: match &c.shaper {
                        Some(shaper) => chat_message(&c.deltas, shaper),
                        None => ChatMessageOut {
                            role: "assistant",
                            content: Some(c.text.clone()),
                            reasoning_content: None,
                            tool_calls: Vec::new(),
                        },
                    },
                    finish_reason: chat_finish(c.finish.unwrap_or(Finish::Length), c.shaper.as_ref()),
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
        shapers: (0..generation.len()).map(|_| plan.reading.as_ref().map(ChatReading::shaper)).collect(),
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
    /// Chat only: each choice's shaper.
    shapers: Vec<Option<ChatShaper>>,
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
                        delta: ChatDelta {
                            role: Some("assistant"),
                            content: Some(String::new()),
                            ..ChatDelta::default()
                        },
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

    /// Queues one chunk per delta of a chat choice; log-probabilities go
    /// with the first (or alone, when the text released nothing yet).
    fn chat_deltas(&mut self, choice: usize, deltas: Vec<Delta>, mut logprobs: Option<ChatLogprobs>) {
        if deltas.is_empty() {
            if let Some(lp) = logprobs.filter(|lp| !lp.content.is_empty()) {
                let event = self.chat_chunk(
                    vec![ChatChunkChoice {
                        index: choice,
                        delta: ChatDelta::default(),
                        logprobs: Some(lp),
                        finish_reason: None,
                    }],
                    None,
                );
                self.queue.push_back(event);
            }
            return;
        }
        for delta in deltas {
            let event = self.chat_chunk(
                vec![ChatChunkChoice {
                    index: choice,
                    delta: chat_delta(delta),
                    logprobs: logprobs.take(),
                    finish_reason: None,
                }],
                None,
            );
            self.queue.push_back(event);
        }
    }

    fn on_output(&mut self, output: Output) {
        let shaped = |choice: usize, st: &Self| st.plan.shape == Shape::Chat && st.shapers[choice].is_some();
        let output = match output {
            Output::Text { choice, text, tokens } if shaped(choice, self) => {
                let deltas = self.shapers[choice].as_mut().map(|s| s.push(&text)).unwrap_or_default();
                let logprobs = self.plan.logprobs.then(|| chat_logprobs(&tokens));
                self.chat_deltas(choice, deltas, logprobs);
                return;
            }
            Output::Finished { choice, reason, usage } if shaped(choice, self) => {
                self.usages[choice] = usage;
                let deltas = self.shapers[choice].as_mut().map(ChatShaper::finish).unwrap_or_default();
                self.chat_deltas(choice, deltas, None);
                let finish_reason = Some(chat_finish(reason, self.shapers[choice].as_ref()));
                let event = self.chat_chunk(
                    vec![ChatChunkChoice {
                        index: choice,
                        delta: ChatDelta::default(),
                        logprobs: None,
                        finish_reason,
                    }],
                    None,
                );
                self.queue.push_back(event);
                return;
            }
            other => other,
        };
        let event = match output {
            Output::Text { choice, text, tokens } => match self.plan.shape {
                Shape::Chat => self.chat_chunk(
                    vec![ChatChunkChoice {
                        index: choice,
                        logprobs: self.plan.logprobs.then(|| chat_logprobs(&tokens)),
                        delta: ChatDelta { content: Some(text), ..ChatDelta::default() },
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
