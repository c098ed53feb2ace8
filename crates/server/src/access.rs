//! One log line per request: method, path, status, tokens and latency.
//!
//! The line is written when the response is done, not when its headers are:
//! a streamed answer's tokens are only known at its end, and its latency is
//! what the client waited for. The middleware hands the handler a
//! [`TokenTally`] through the request's extensions; `respond` fills it in;
//! the line is written when the body ends (or the client goes away).

use axum::body::Body;
use axum::extract::Request;
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use futures_util::StreamExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Tokens of one request, filled in by the handler that generated them.
#[derive(Debug, Default)]
pub struct TokenTally {
    prompt: AtomicUsize,
    completion: AtomicUsize,
}

impl TokenTally {
    /// Records the request's totals (all prompts, all choices).
    pub fn set(&self, prompt: usize, completion: usize) {
        self.prompt.store(prompt, Ordering::Relaxed);
        self.completion.store(completion, Ordering::Relaxed);
    }
}

/// What the line reports, gathered so it is written in one place.
struct Line {
    method: String,
    path: String,
    status: u16,
    tally: Arc<TokenTally>,
    start: Instant,
}

impl Drop for Line {
    fn drop(&mut self) {
        let latency_ms = self.start.elapsed().as_secs_f64() * 1000.0;
        // Health probes arrive every few seconds from load balancers and
        // would drown the lines that matter; they are logged at debug.
        if self.path == "/health" {
            tracing::debug!(target: "corridor::request", method = %self.method, path = %self.path, status = self.status, "request");
            return;
        }
        tracing::info!(
            target: "corridor::request",
            method = %self.method,
            path = %self.path,
            status = self.status,
            prompt_tokens = self.tally.prompt.load(Ordering::Relaxed),
            completion_tokens = self.tally.completion.load(Ordering::Relaxed),
            latency_ms = format_args!("{latency_ms:.1}"),
            "request"
        );
    }
}

/// The middleware: times the request and logs it once its response is done.
pub async fn log_request(mut request: Request, next: Next) -> Response {
    let start = Instant::now();
    let method = request.method().to_string();
    let path = request.uri().path().to_string();
    let tally = Arc::new(TokenTally::default());
    request.extensions_mut().insert(tally.clone());
    let response = next.run(request).await;
    let line = Line { method, path, status: response.status().as_u16(), tally, start };
    let streamed = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if !streamed {
        // The body is already complete: log now (dropping `line`), and keep
        // the body as it is (its length stays known).
        drop(line);
        return response;
    }
    // A stream: the line goes out when the body stream is dropped, at its
    // end or when the client disconnects.
    let (parts, body) = response.into_parts();
    let stream = body.into_data_stream().map(move |chunk| {
        let _held = &line;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(stream))
}
