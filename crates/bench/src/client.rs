//! One streamed request: send it, read the server-sent events, and time every content chunk.
//!
//! The client is hyper's pooled HTTP/1 client (loopback and LAN targets; no TLS). Timings are taken
//! when a read arrives, so several events that arrive in one read share a timestamp: that is what a
//! client really observes. A request is complete when `data: [DONE]` arrives, or when the stream
//! ends cleanly after a chunk that carried a `finish_reason`; anything else is a failure of a named
//! kind, and no failure ends the run.
//!
//! A server may close a kept-alive connection just as the client sends the next request on it (an
//! idle timeout that fires as the request arrives): the request then fails without a byte of
//! response, through no fault of the request. Such a request is sent once more on a new connection
//! and marked as retried, so the report counts it apart instead of as a failure of the server's
//! serving. Only a connection that has already carried a response counts as kept alive: a fresh
//! connection closed without an answer is a real failure (`transport`).

use crate::sse::SseDecoder;
use crate::workload::Endpoint;
use bytes::Bytes;
use corridor_units::Tokens;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::client::legacy::connect::{HttpConnector, HttpInfo};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The most of an error body kept for the report.
const ERROR_BODY_LIMIT: usize = 16 * 1024;
/// The most of an error message shown to people.
const MESSAGE_CHARS: usize = 200;

/// Why one request failed. Its [`fmt::Display`] form is the key under `errors` in the report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ErrorKind {
    /// The server answered with this non-success status.
    Http(u16),
    /// The request did not finish within the request timeout.
    Timeout,
    /// No connection could be made.
    Connect,
    /// The HTTP exchange failed before a response arrived, for another reason.
    Transport,
    /// The request went out on a pooled keep-alive connection that the server closed without a byte
    /// of response (counted only when such a request is not retried on a new connection).
    ClosedKeepAlive,
    /// The connection broke while the response was streaming.
    StreamBroken,
    /// The stream carried an `{"error": ...}` event.
    StreamError,
    /// An event was not JSON.
    MalformedChunk,
    /// The stream ended without `[DONE]` and without a finish reason.
    Truncated,
    /// The request's task ended without reporting (it should not happen; counted so totals add up).
    Lost,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ErrorKind::Http(status) => write!(f, "http_{status}"),
            ErrorKind::Timeout => f.write_str("timeout"),
            ErrorKind::Connect => f.write_str("connect"),
            ErrorKind::Transport => f.write_str("transport"),
            ErrorKind::ClosedKeepAlive => f.write_str("closed_keepalive"),
            ErrorKind::StreamBroken => f.write_str("stream_broken"),
            ErrorKind::StreamError => f.write_str("stream_error"),
            ErrorKind::MalformedChunk => f.write_str("malformed_chunk"),
            ErrorKind::Truncated => f.write_str("truncated"),
            ErrorKind::Lost => f.write_str("lost"),
        }
    }
}

/// A failed request.
#[derive(Clone, Debug, PartialEq)]
pub struct Failure {
    pub kind: ErrorKind,
    /// What the server or the transport said, shortened.
    pub message: String,
}

impl Failure {
    fn new(kind: ErrorKind, message: impl fmt::Display) -> Failure {
        Failure { kind, message: shorten(&message.to_string()) }
    }
}

fn shorten(text: &str) -> String {
    let text = text.trim();
    match text.char_indices().nth(MESSAGE_CHARS) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text.to_string(),
    }
}

/// Token counts the server reported in `usage`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    pub prompt: Tokens,
    pub completion: Tokens,
}

/// A request that streamed to the end.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Completion {
    /// From sending the request to the first chunk with content; `None` if no content came.
    pub ttft: Option<Duration>,
    /// Gaps between consecutive content chunks.
    pub itl: Vec<Duration>,
    /// From sending the request to the end of the stream.
    pub e2e: Duration,
    /// Chunks that carried generated text; one per token on servers that stream token by token.
    pub content_chunks: usize,
    pub usage: Option<Usage>,
    pub finish_reason: Option<String>,
    /// The generated text (completion text or assistant content), for multi-turn history.
    pub text: String,
}

/// Folds the events of one stream into a [`Completion`]. Times are offsets from sending the request,
/// so the folding can be tested without a clock.
#[derive(Debug)]
pub struct StreamState {
    endpoint: Endpoint,
    completion: Completion,
    last_chunk: Option<Duration>,
    done: bool,
}

impl StreamState {
    pub fn new(endpoint: Endpoint) -> StreamState {
        StreamState { endpoint, completion: Completion::default(), last_chunk: None, done: false }
    }

    /// Whether `[DONE]` has arrived.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Take one event payload that arrived `at` after the request was sent.
    pub fn on_event(&mut self, data: &str, at: Duration) -> Result<(), Failure> {
        if data.trim() == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let chunk: Value = serde_json::from_str(data).map_err(|e| {
            Failure::new(ErrorKind::MalformedChunk, format!("{e} in event '{}'", shorten(data)))
        })?;
        if let Some(error) = chunk.get("error").filter(|e| !e.is_null()) {
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| error.to_string(), str::to_string);
            return Err(Failure::new(ErrorKind::StreamError, message));
        }
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            let count = |key: &str| usage.get(key).and_then(Value::as_u64).map(|n| Tokens(n as usize));
            if let (Some(prompt), Some(completion)) = (count("prompt_tokens"), count("completion_tokens")) {
                self.completion.usage = Some(Usage { prompt, completion });
            }
        }
        let Some(choice) = chunk.get("choices").and_then(Value::as_array).and_then(|c| c.first()) else {
            return Ok(());
        };
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            self.completion.finish_reason = Some(reason.to_string());
        }
        let (text, reasoning) = match self.endpoint {
            Endpoint::Completions => (choice.get("text").and_then(Value::as_str).unwrap_or(""), ""),
            Endpoint::Chat => {
                let delta = choice.get("delta");
                let field = |key: &str| delta.and_then(|d| d.get(key)).and_then(Value::as_str).unwrap_or("");
                (field("content"), field("reasoning_content"))
            }
        };
        // A chunk counts when it carries generated text, reasoning included; role-only and empty
        // chunks are protocol, not tokens.
        if text.is_empty() && reasoning.is_empty() {
            return Ok(());
        }
        self.completion.text.push_str(text);
        self.completion.content_chunks += 1;
        match self.last_chunk {
            None => self.completion.ttft = Some(at),
            Some(last) => self.completion.itl.push(at.saturating_sub(last)),
        }
        self.last_chunk = Some(at);
        Ok(())
    }

    /// The stream ended `at` after sending: a completion, or `Truncated` if it never finished.
    pub fn finish(mut self, at: Duration) -> Result<Completion, Failure> {
        if !self.done && self.completion.finish_reason.is_none() {
            return Err(Failure::new(
                ErrorKind::Truncated,
                "the stream ended without [DONE] or a finish reason",
            ));
        }
        self.completion.e2e = at;
        Ok(self.completion)
    }
}

/// Whether a request that met a closed keep-alive connection is sent again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClosedKeepAlive {
    /// Once more, on a new connection; the request is marked as retried.
    Retry,
    /// Not at all: the request fails as `closed_keepalive`.
    Fail,
}

/// What became of one request.
#[derive(Clone, Debug, PartialEq)]
pub struct Streamed {
    pub outcome: Result<Completion, Failure>,
    /// The first attempt met a closed keep-alive connection and the request was sent again on a new
    /// connection; `outcome` is that second attempt's.
    pub retried: bool,
}

/// A pooled HTTP client for one target.
#[derive(Clone, Debug)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
    /// Keeps no idle connection, so every request through it opens a new one: the retry after a
    /// closed keep-alive connection must not meet another pooled connection the server may close.
    fresh: Client<HttpConnector, Full<Bytes>>,
    /// Local addresses of the pooled connections that have carried a response: a request that
    /// fails on one of them was sent on a kept-alive connection.
    served: Arc<Mutex<HashSet<SocketAddr>>>,
    closed_keepalive: ClosedKeepAlive,
    api_key: Option<String>,
}

/// One request to send.
#[derive(Clone, Debug)]
pub struct Exchange {
    pub uri: Uri,
    pub endpoint: Endpoint,
    /// The JSON body.
    pub body: Bytes,
    pub timeout: Duration,
}

/// Which of the client's two pools an attempt uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pool {
    Pooled,
    Fresh,
}

impl HttpClient {
    pub fn new(api_key: Option<String>, closed_keepalive: ClosedKeepAlive) -> HttpClient {
        let mut connector = HttpConnector::new();
        // Token-by-token streams are many small writes; Nagle's algorithm would delay them.
        connector.set_nodelay(true);
        let inner = Client::builder(TokioExecutor::new()).build(connector.clone());
        let fresh = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(0).build(connector);
        HttpClient { inner, fresh, served: Arc::default(), closed_keepalive, api_key }
    }

    /// Send the request and stream the response to its end, within the timeout (both attempts
    /// together when the first met a closed keep-alive connection). A retried request's latencies
    /// are timed from its second sending: the first attempt measured the connection, not the server.
    pub async fn stream(&self, exchange: &Exchange) -> Streamed {
        let retried = AtomicBool::new(false);
        let attempts = async {
            let first = self.attempt(exchange, Pool::Pooled).await;
            match first {
                Err(Failure { kind: ErrorKind::ClosedKeepAlive, .. })
                    if self.closed_keepalive == ClosedKeepAlive::Retry =>
                {
                    retried.store(true, Ordering::Relaxed);
                    self.attempt(exchange, Pool::Fresh).await
                }
                other => other,
            }
        };
        let outcome = match tokio::time::timeout(exchange.timeout, attempts).await {
            Ok(result) => result,
            Err(_) => Err(Failure::new(
                ErrorKind::Timeout,
                format!("no complete response within {:.1} s", exchange.timeout.as_secs_f64()),
            )),
        };
        Streamed { outcome, retried: retried.load(Ordering::Relaxed) }
    }

    /// Whether `error` says the request went out on a connection that had carried a response
    /// before and was closed before any byte of the next response came.
    fn closed_while_kept_alive(&self, error: &hyper_util::client::legacy::Error) -> bool {
        let Some(info) = error.connect_info() else { return false };
        let mut extensions = hyper::http::Extensions::new();
        info.get_extras(&mut extensions);
        let Some(local) = extensions.get::<HttpInfo>().map(HttpInfo::local_addr) else { return false };
        let kept_alive = self.served.lock().unwrap_or_else(PoisonError::into_inner).contains(&local);
        kept_alive && closed_before_response(error)
    }

    async fn attempt(&self, exchange: &Exchange, pool: Pool) -> Result<Completion, Failure> {
        let sent = Instant::now();
        let mut builder = Request::builder()
            .method(Method::POST)
            .uri(exchange.uri.clone())
            .header(CONTENT_TYPE, "application/json")
            .header(ACCEPT, "text/event-stream");
        if let Some(key) = &self.api_key {
            builder = builder.header(AUTHORIZATION, format!("Bearer {key}"));
        }
        let request = builder
            .body(Full::new(exchange.body.clone()))
            .map_err(|e| Failure::new(ErrorKind::Transport, e))?;
        let client = match pool {
            Pool::Pooled => &self.inner,
            Pool::Fresh => &self.fresh,
        };
        let response = client.request(request).await.map_err(|e| {
            let kind = if e.is_connect() {
                ErrorKind::Connect
            } else if pool == Pool::Pooled && self.closed_while_kept_alive(&e) {
                ErrorKind::ClosedKeepAlive
            } else {
                ErrorKind::Transport
            };
            // The outer error says little ("client error (Connect)"); its source says why.
            let message = match std::error::Error::source(&e) {
                Some(source) => format!("{e}: {source}"),
                None => e.to_string(),
            };
            Failure::new(kind, message)
        })?;
        if pool == Pool::Pooled {
            if let Some(info) = response.extensions().get::<HttpInfo>() {
                self.served.lock().unwrap_or_else(PoisonError::into_inner).insert(info.local_addr());
            }
        }
        let status = response.status();
        if !status.is_success() {
            return Err(http_failure(status, response.into_body()).await);
        }
        let mut body = response.into_body();
        let mut decoder = SseDecoder::new();
        let mut state = StreamState::new(exchange.endpoint);
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| Failure::new(ErrorKind::StreamBroken, e))?;
            let at = sent.elapsed();
            if let Ok(data) = frame.into_data() {
                for event in decoder.push(&data) {
                    state.on_event(&event, at)?;
                }
            }
            if state.is_done() {
                // Nothing after [DONE] matters; not waiting for the close keeps e2e honest.
                return state.finish(sent.elapsed());
            }
        }
        let at = sent.elapsed();
        for event in decoder.finish() {
            state.on_event(&event, at)?;
        }
        state.finish(at)
    }
}

/// Whether the connection closed before a response began ("connection closed before message
/// completed"), anywhere in the error's chain of sources.
fn closed_before_response(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(error);
    while let Some(e) = source {
        if e.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_incomplete_message) {
            return true;
        }
        source = e.source();
    }
    false
}

/// Read an error response (bounded) and pull out the OpenAI error message when there is one.
async fn http_failure(status: StatusCode, body: hyper::body::Incoming) -> Failure {
    let kind = ErrorKind::Http(status.as_u16());
    let bytes = match Limited::new(body, ERROR_BODY_LIMIT).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => return Failure::new(kind, status),
    };
    let parsed: Option<Value> = serde_json::from_slice(&bytes).ok();
    let message = parsed
        .as_ref()
        .and_then(|v| v.get("error"))
        .and_then(|e| e.get("message").and_then(Value::as_str).or_else(|| e.as_str()))
        .map(str::to_string)
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    Failure::new(kind, if message.trim().is_empty() { status.to_string() } else { message })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn folds_a_chat_stream() {
        let mut state = StreamState::new(Endpoint::Chat);
        let events = [
            (r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#, 5),
            (r#"{"choices":[{"delta":{"content":"Hel"}}]}"#, 10),
            (r#"{"choices":[{"delta":{"content":"lo"}}]}"#, 13),
            (r#"{"choices":[{"delta":{"content":"!"},"finish_reason":"length"}]}"#, 20),
            (r#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}"#, 21),
            ("[DONE]", 22),
        ];
        for (data, at) in events {
            state.on_event(data, ms(at)).unwrap();
        }
        assert!(state.is_done());
        let done = state.finish(ms(23)).unwrap();
        assert_eq!(done.ttft, Some(ms(10)));
        assert_eq!(done.itl, vec![ms(3), ms(7)]);
        assert_eq!(done.e2e, ms(23));
        assert_eq!(done.content_chunks, 3);
        assert_eq!(done.text, "Hello!");
        assert_eq!(done.usage, Some(Usage { prompt: Tokens(7), completion: Tokens(3) }));
        assert_eq!(done.finish_reason.as_deref(), Some("length"));
    }

    #[test]
    fn completions_text_and_missing_usage() {
        let mut state = StreamState::new(Endpoint::Completions);
        state.on_event(r#"{"choices":[{"text":" a","finish_reason":null}]}"#, ms(4)).unwrap();
        state.on_event(r#"{"choices":[{"text":" b","finish_reason":"stop"}]}"#, ms(6)).unwrap();
        // No [DONE], but a finish reason: the stream is complete.
        let done = state.finish(ms(7)).unwrap();
        assert_eq!(done.content_chunks, 2);
        assert_eq!(done.usage, None);
        assert_eq!(done.text, " a b");
    }

    #[test]
    fn failures_have_kinds() {
        let mut state = StreamState::new(Endpoint::Completions);
        assert_eq!(state.on_event("{not json", ms(1)).unwrap_err().kind, ErrorKind::MalformedChunk);
        let err = state.on_event(r#"{"error":{"message":"out of memory"}}"#, ms(1)).unwrap_err();
        assert_eq!((err.kind, err.message.as_str()), (ErrorKind::StreamError, "out of memory"));
        state.on_event(r#"{"choices":[{"text":" a"}]}"#, ms(2)).unwrap();
        assert_eq!(state.finish(ms(3)).unwrap_err().kind, ErrorKind::Truncated);
        assert_eq!(ErrorKind::Http(400).to_string(), "http_400");
    }
}
