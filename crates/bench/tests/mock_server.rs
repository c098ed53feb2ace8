//! End-to-end runs against a small in-test OpenAI-compatible server that streams a known number of
//! tokens with known delays, rejects invalid parameters with 400 and can misbehave on purpose
//! (reject extra fields, misreport usage, hang, close kept-alive connections instead of answering).
//! Each test checks that the bench's numbers add up.

use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use corridor_bench::{run, BenchArgs, BenchError, BenchReport, Percentiles, WorkloadKind};
use corridor_units::Tokens;
use serde_json::{json, Value};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

const MODEL: &str = "mock-model";
/// What the mock streams per token.
const TOKEN_TEXT: &str = " tok";

#[derive(Clone, Copy, Debug, PartialEq)]
enum UsageMode {
    Honest,
    OffByOne,
    Absent,
}

#[derive(Clone, Debug)]
struct Behaviour {
    token_delay: Duration,
    usage: UsageMode,
    /// Answer 400 to requests carrying `ignore_eos` or `min_tokens`, as a strict server would.
    reject_length_fields: bool,
    /// Hang (never send a byte of the stream) on server arrivals whose number is a positive multiple.
    hang_every: Option<u64>,
    /// Which requests the server reads and then answers by closing the connection.
    closing: Closing,
}

/// When the server closes a connection on a request instead of answering it.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Closing {
    Never,
    /// When the request arrives on a kept-alive connection that has been idle at least this long
    /// since its last response byte: a server whose idle timeout fires just as the next request
    /// comes in. Zero closes every kept-alive connection when it is reused.
    IdleFor(Duration),
    /// Every request, the first on a new connection too: a server that dies on each request.
    Always,
}

impl Default for Behaviour {
    fn default() -> Self {
        Behaviour {
            token_delay: Duration::from_millis(1),
            usage: UsageMode::Honest,
            reject_length_fields: false,
            hang_every: None,
            closing: Closing::Never,
        }
    }
}

struct Mock {
    behaviour: Behaviour,
    arrivals: AtomicU64,
    bodies: Mutex<Vec<Value>>,
    /// Requests the connection layer read and answered by closing, before any handler saw them.
    closed: Arc<AtomicU64>,
}

/// A server connection that applies [`Closing`]: a request it closes on is read (so the close is a
/// clean FIN, as from a server that timed the connection out) and dropped, and the server sees the
/// end of the stream and closes without writing a byte.
struct ClosingConn {
    tcp: TcpStream,
    closing: Closing,
    /// When the last response byte went out; `None` until the first response.
    last_write: Option<Instant>,
    ended: bool,
    closed: Arc<AtomicU64>,
}

impl ClosingConn {
    fn closes_on_request(&self) -> bool {
        match self.closing {
            Closing::Never => false,
            Closing::IdleFor(idle) => self.last_write.is_some_and(|at| at.elapsed() >= idle),
            Closing::Always => true,
        }
    }
}

impl AsyncRead for ClosingConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.ended {
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.tcp).poll_read(cx, buf))?;
        // The client sends nothing while a response streams, so new bytes are the next request.
        if buf.filled().len() > before && this.closes_on_request() {
            buf.set_filled(before);
            this.ended = true;
            this.closed.fetch_add(1, Ordering::SeqCst);
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for ClosingConn {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let written = ready!(Pin::new(&mut self.tcp).poll_write(cx, data))?;
        if written > 0 {
            self.last_write = Some(Instant::now());
        }
        Poll::Ready(Ok(written))
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

struct ClosingListener {
    tcp: TcpListener,
    closing: Closing,
    closed: Arc<AtomicU64>,
}

impl axum::serve::Listener for ClosingListener {
    type Io = ClosingConn;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (ClosingConn, SocketAddr) {
        loop {
            let Ok((tcp, addr)) = self.tcp.accept().await else { continue };
            // Without TCP_NODELAY, Nagle's algorithm and the client's delayed ACK hold small SSE
            // writes for about 40 ms, and every token of a stream arrives in one lump at the end.
            let _ = tcp.set_nodelay(true);
            let conn = ClosingConn {
                tcp,
                closing: self.closing,
                last_write: None,
                ended: false,
                closed: self.closed.clone(),
            };
            return (conn, addr);
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp.local_addr()
    }
}

fn openai_error(status: StatusCode, message: &str, param: &str) -> Response {
    let body = json!({ "error": { "message": message, "type": "invalid_request_error", "param": param } });
    (status, Json(body)).into_response()
}

fn words_in(text: &str) -> usize {
    text.split_whitespace().count()
}

async fn handle(mock: Arc<Mock>, body: Value, chat: bool) -> Response {
    let arrival = mock.arrivals.fetch_add(1, Ordering::SeqCst);
    mock.bodies.lock().unwrap().push(body.clone());
    if body["model"] != MODEL {
        return openai_error(StatusCode::NOT_FOUND, "no such model", "model");
    }
    if body.get("temperature").and_then(Value::as_f64).is_some_and(|t| !(0.0..=2.0).contains(&t)) {
        return openai_error(StatusCode::BAD_REQUEST, "temperature must be between 0 and 2", "temperature");
    }
    if mock.behaviour.reject_length_fields
        && (body.get("ignore_eos").is_some() || body.get("min_tokens").is_some())
    {
        return openai_error(StatusCode::BAD_REQUEST, "unknown parameter", "ignore_eos");
    }
    let Some(max_tokens) = body["max_tokens"].as_u64() else {
        return openai_error(StatusCode::BAD_REQUEST, "max_tokens is required here", "max_tokens");
    };
    let prompt_tokens = if chat {
        body["messages"].as_array().unwrap().iter().map(|m| words_in(m["content"].as_str().unwrap())).sum()
    } else {
        words_in(body["prompt"].as_str().unwrap())
    };
    let include_usage = body["stream_options"]["include_usage"] == true;
    let hang = mock.behaviour.hang_every.is_some_and(|k| arrival > 0 && arrival.checked_rem(k) == Some(0));
    let behaviour = mock.behaviour.clone();

    // Events in order, each marked with whether it is a token (which waits `token_delay` first).
    let mut events: Vec<(bool, String)> = Vec::new();
    if chat {
        events.push((
            false,
            json!({"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}).to_string(),
        ));
    }
    for i in 0..max_tokens {
        let finish = if i + 1 == max_tokens { json!("length") } else { Value::Null };
        let chunk = if chat {
            json!({"choices":[{"index":0,"delta":{"content":TOKEN_TEXT},"finish_reason":finish}]})
        } else {
            json!({"choices":[{"index":0,"text":TOKEN_TEXT,"finish_reason":finish}]})
        };
        events.push((true, chunk.to_string()));
    }
    if include_usage && behaviour.usage != UsageMode::Absent {
        let completion = max_tokens + u64::from(behaviour.usage == UsageMode::OffByOne);
        let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                           "total_tokens": prompt_tokens as u64 + completion});
        events.push((false, json!({"choices":[], "usage": usage}).to_string()));
    }
    events.push((false, "[DONE]".to_string()));

    // Each event goes out as two writes cut mid-line, so the client's decoder meets split events.
    let mut pieces: Vec<(Duration, String)> = Vec::new();
    for (is_token, data) in events {
        let text = format!("data: {data}\n\n");
        let (head, tail) = text.split_at(text.len() / 2);
        let delay = if is_token { behaviour.token_delay } else { Duration::ZERO };
        pieces.push((delay, head.to_string()));
        pieces.push((Duration::ZERO, tail.to_string()));
    }
    let stream = futures_util::stream::unfold((pieces.into_iter(), hang), |(mut rest, hang)| async move {
        if hang {
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
        let (delay, piece) = rest.next()?;
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        Some((Ok::<_, std::convert::Infallible>(piece), (rest, false)))
    });
    Response::builder().header("content-type", "text/event-stream").body(Body::from_stream(stream)).unwrap()
}

async fn start(behaviour: Behaviour) -> (SocketAddr, Arc<Mock>) {
    let closing = behaviour.closing;
    let mock = Arc::new(Mock {
        behaviour,
        arrivals: AtomicU64::new(0),
        bodies: Mutex::new(Vec::new()),
        closed: Arc::default(),
    });
    let app = Router::new()
        .route(
            "/v1/completions",
            post(|State(m): State<Arc<Mock>>, Json(b): Json<Value>| async move { handle(m, b, false).await }),
        )
        .route(
            "/v1/chat/completions",
            post(|State(m): State<Arc<Mock>>, Json(b): Json<Value>| async move { handle(m, b, true).await }),
        )
        .with_state(mock.clone());
    let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let listener = ClosingListener { tcp, closing, closed: mock.closed.clone() };
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, mock)
}

fn args(addr: SocketAddr) -> BenchArgs {
    BenchArgs {
        input_tokens: 16,
        output_tokens: 8,
        num_requests: Some(20),
        no_progress: true,
        request_timeout: 30.0,
        ..BenchArgs::new(format!("http://{addr}"), MODEL)
    }
}

fn assert_ordered(p: &Percentiles) {
    if p.count == 0 {
        return;
    }
    let (p50, p90, p99, max) = (p.p50.unwrap(), p.p90.unwrap(), p.p99.unwrap(), p.max.unwrap());
    assert!(p50 <= p90 && p90 <= p99 && p99 <= max, "{p:?}");
}

fn assert_adds_up(report: &BenchReport) {
    assert_eq!(report.requests_sent, report.requests_completed + report.requests_failed);
    assert_eq!(report.errors.values().sum::<u64>(), report.requests_failed);
    assert_eq!(report.requests.len() as u64, report.requests_sent);
    assert_eq!(report.ttft_ms.count as u64, report.requests_completed);
    assert_eq!(report.e2e_ms.count as u64, report.requests_completed);
    for p in [&report.ttft_ms, &report.itl_ms, &report.e2e_ms] {
        assert_ordered(p);
    }
}

/// The bodies the bench sent after its preflight request.
fn run_bodies(mock: &Mock) -> Vec<Value> {
    mock.bodies.lock().unwrap().iter().skip(1).cloned().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_workload_counts_add_up_with_injected_errors() {
    let (addr, mock) = start(Behaviour::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let json_path = dir.path().join("report.json");
    let chart_path = dir.path().join("latency.svg");
    let report = run(BenchArgs {
        concurrency: Some(4),
        inject_errors: 0.25,
        json: Some(json_path.clone()),
        chart: Some(chart_path.clone()),
        ..args(addr)
    })
    .await
    .unwrap();

    assert_adds_up(&report);
    assert_eq!((report.requests_sent, report.requests_completed, report.requests_failed), (20, 15, 5));
    assert_eq!(report.errors.get("http_400"), Some(&5));
    assert_eq!(report.errors.len(), 1);
    assert_eq!((report.injected_errors.sent, report.injected_errors.rejected), (5, 5));
    assert!(report.error_examples["http_400"].contains("temperature"));
    assert_eq!(report.length_control, "ignore_eos + min_tokens");
    // 15 completed requests of 8 tokens each, reported and streamed alike.
    assert_eq!(report.output_tokens, Tokens(120));
    assert_eq!(report.token_check.output_tokens_reported, Tokens(120));
    assert_eq!(report.token_check.output_tokens_streamed, Tokens(120));
    assert_eq!(report.token_check.usage_stream_mismatches, 0);
    assert_eq!(report.input_tokens, Tokens(15 * 16));
    assert_eq!((report.lengths.output_as_requested, report.lengths.input_as_requested), (15, 15));
    assert_eq!(report.itl_ms.count, 15 * 7);
    assert!(report.output_tokens_per_s > 0.0 && report.request_throughput > 0.0);

    let sent = run_bodies(&mock);
    assert_eq!(sent.len(), 20);
    assert!(sent.iter().all(|b| b["ignore_eos"] == true && b["min_tokens"] == 8 && b["stream"] == true));
    assert_eq!(sent.iter().filter(|b| b.get("temperature").is_some()).count(), 5);

    let written: Value = serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    for key in [
        "requests_sent",
        "requests_completed",
        "requests_failed",
        "errors",
        "input_tokens",
        "output_tokens",
        "duration_s",
        "request_throughput",
        "output_tokens_per_s",
    ] {
        assert!(written.get(key).is_some(), "missing {key}");
    }
    for series in ["ttft_ms", "itl_ms", "e2e_ms"] {
        for key in ["p50", "p90", "p99", "max"] {
            assert!(written[series][key].is_number(), "missing {series}.{key}");
        }
    }
    assert_eq!(written["errors"]["http_400"], 5);
    assert_eq!(written["requests_sent"], 20);

    let svg = std::fs::read_to_string(&chart_path).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches(r#"r="3"/>"#).count(), 15, "one end-to-end point per completed request");
    assert_eq!(svg.matches("<path").count(), 5, "one cross per failed request");
    assert!(svg.contains("request start (s)") && svg.contains("latency (ms)"));

    let table = corridor_bench::render_table(&report);
    assert!(table.contains("20 sent, 15 completed, 5 failed"));
    assert!(table.contains("http_400"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poisson_arrivals_stop_at_the_count() {
    let (addr, mock) = start(Behaviour::default()).await;
    let report = run(BenchArgs { request_rate: Some(400.0), num_requests: Some(12), seed: 5, ..args(addr) })
        .await
        .unwrap();
    assert_adds_up(&report);
    assert_eq!((report.requests_sent, report.requests_completed), (12, 12));
    assert_eq!(run_bodies(&mock).len(), 12);
    assert!(report.arrivals.starts_with("poisson"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duration_bound_stops_by_itself() {
    let (addr, mock) = start(Behaviour::default()).await;
    let report =
        run(BenchArgs { concurrency: Some(2), num_requests: None, duration: Some(0.3), ..args(addr) })
            .await
            .unwrap();
    assert_adds_up(&report);
    assert!(report.requests_sent >= 1);
    assert_eq!(report.requests_failed, 0);
    assert_eq!(run_bodies(&mock).len() as u64, report.requests_sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_turn_resends_the_whole_history() {
    let (addr, mock) = start(Behaviour::default()).await;
    let report = run(BenchArgs {
        workload: WorkloadKind::MultiTurn,
        turns: 3,
        input_tokens: 5,
        output_tokens: 4,
        num_requests: Some(6),
        concurrency: Some(1),
        ..args(addr)
    })
    .await
    .unwrap();
    assert_adds_up(&report);
    assert_eq!(report.requests_completed, 6);
    let sent = run_bodies(&mock);
    assert_eq!(sent.len(), 6);
    for (i, body) in sent.iter().enumerate() {
        let turn = i % 3;
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 2 * turn + 1, "turn {turn} carries the whole history");
        for (j, m) in messages.iter().enumerate() {
            let role = if j % 2 == 0 { "user" } else { "assistant" };
            assert_eq!(m["role"], role);
            if role == "assistant" {
                assert_eq!(m["content"], TOKEN_TEXT.repeat(4), "the reply really streamed");
            }
        }
        if turn > 0 {
            let previous = sent[i - 1]["messages"].as_array().unwrap();
            assert_eq!(&messages[..previous.len()], &previous[..], "history is resent unchanged");
        }
    }
    // The third turn asks for three user turns plus two replies of prompt.
    let third = &report.requests[2];
    assert_eq!(third.turn, 2);
    assert_eq!(third.requested_input_tokens, Tokens(3 * 5 + 2 * 4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_turn_ends_its_conversation() {
    let (addr, mock) = start(Behaviour::default()).await;
    // Tickets 1, 3 and 5 are injected: every conversation fails on its second turn.
    let report = run(BenchArgs {
        workload: WorkloadKind::MultiTurn,
        turns: 3,
        inject_errors: 0.5,
        num_requests: Some(6),
        concurrency: Some(1),
        ..args(addr)
    })
    .await
    .unwrap();
    assert_adds_up(&report);
    assert_eq!((report.requests_completed, report.errors.get("http_400")), (3, Some(&3)));
    let lengths: Vec<usize> =
        run_bodies(&mock).iter().map(|b| b["messages"].as_array().unwrap().len()).collect();
    assert_eq!(lengths, vec![1, 3, 1, 3, 1, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prefix_requests_share_the_system_prompt() {
    let (addr, mock) = start(Behaviour::default()).await;
    let report = run(BenchArgs {
        workload: WorkloadKind::SharedPrefix,
        prefix_tokens: 200,
        num_requests: Some(5),
        concurrency: Some(2),
        ..args(addr)
    })
    .await
    .unwrap();
    assert_adds_up(&report);
    let sent = run_bodies(&mock);
    let system = &sent[0]["messages"][0];
    assert_eq!(system["role"], "system");
    assert_eq!(words_in(system["content"].as_str().unwrap()), 200);
    assert!(sent.iter().all(|b| &b["messages"][0] == system));
    let users: std::collections::HashSet<String> =
        sent.iter().map(|b| b["messages"][1]["content"].to_string()).collect();
    assert_eq!(users.len(), 5);
    assert_eq!(report.input_tokens, Tokens(5 * (200 + 16)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_workload_draws_varied_lengths() {
    let (addr, mock) = start(Behaviour { token_delay: Duration::ZERO, ..Behaviour::default() }).await;
    let report = run(BenchArgs {
        workload: WorkloadKind::Chat,
        max_output_tokens: 64,
        num_requests: Some(10),
        concurrency: Some(3),
        ..args(addr)
    })
    .await
    .unwrap();
    assert_adds_up(&report);
    assert_eq!(report.requests_completed, 10);
    let outputs: std::collections::HashSet<u64> =
        run_bodies(&mock).iter().map(|b| b["max_tokens"].as_u64().unwrap()).collect();
    assert!(outputs.len() > 1 && outputs.iter().all(|&n| (1..=64).contains(&n)));
    assert_eq!(report.output_tokens, report.token_check.output_tokens_streamed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_length_control_falls_back_when_the_server_rejects_it() {
    let (addr, mock) = start(Behaviour { reject_length_fields: true, ..Behaviour::default() }).await;
    let report = run(BenchArgs { num_requests: Some(3), ..args(addr) }).await.unwrap();
    assert_eq!(report.length_control, "max_tokens only");
    assert_eq!(report.requests_failed, 0);
    // The probe with the fields, the probe without, then three plain requests.
    let bodies = mock.bodies.lock().unwrap().clone();
    assert_eq!(bodies.len(), 5);
    assert!(bodies[1..].iter().all(|b| b.get("ignore_eos").is_none() && b.get("min_tokens").is_none()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_that_disagrees_with_the_stream_is_flagged() {
    let (addr, _mock) = start(Behaviour { usage: UsageMode::OffByOne, ..Behaviour::default() }).await;
    let report = run(BenchArgs { num_requests: Some(4), ..args(addr) }).await.unwrap();
    assert_eq!(report.token_check.usage_stream_mismatches, 4);
    assert_eq!(report.output_tokens, Tokens(4 * 9));
    assert_eq!(report.token_check.output_tokens_streamed, Tokens(4 * 8));
    assert_eq!(report.lengths.output_longer, 4);

    let (addr, _mock) = start(Behaviour { usage: UsageMode::Absent, ..Behaviour::default() }).await;
    let report = run(BenchArgs { num_requests: Some(4), ..args(addr) }).await.unwrap();
    assert_eq!(report.token_check.usage_missing, 4);
    assert_eq!(report.output_tokens, Tokens(4 * 8));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_are_counted_and_not_fatal() {
    let (addr, _mock) = start(Behaviour { hang_every: Some(2), ..Behaviour::default() }).await;
    let report =
        run(BenchArgs { num_requests: Some(6), concurrency: Some(2), request_timeout: 0.3, ..args(addr) })
            .await
            .unwrap();
    assert_adds_up(&report);
    // Server arrivals 2, 4 and 6 hang (arrival 0 is the preflight).
    assert_eq!(report.errors.get("timeout"), Some(&3));
    assert_eq!(report.requests_completed, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_cannot_start_the_run_is_an_error() {
    let (addr, _mock) = start(Behaviour::default()).await;
    let wrong_model = run(BenchArgs { model: "other".into(), ..args(addr) }).await;
    assert!(
        matches!(wrong_model, Err(BenchError::Preflight { ref kind, .. }) if kind == "http_404"),
        "{wrong_model:?}"
    );

    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let unreachable = run(args(free)).await;
    assert!(matches!(unreachable, Err(BenchError::Unreachable { .. })), "{unreachable:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_keepalive_connections_are_retried_and_counted_apart() {
    let closing = Behaviour { closing: Closing::IdleFor(Duration::ZERO), ..Behaviour::default() };

    // Without the retry, every request that reuses a connection fails.
    let (addr, mock) = start(closing.clone()).await;
    let report =
        run(BenchArgs { concurrency: Some(3), no_keepalive_retry: true, ..args(addr) }).await.unwrap();
    assert_adds_up(&report);
    let closed = mock.closed.load(Ordering::SeqCst);
    assert!(closed > 0, "the server closed no connection");
    assert_eq!(report.requests_failed, closed);
    assert_eq!(report.errors.get("closed_keepalive"), Some(&closed));
    assert!(report.error_examples["closed_keepalive"].contains("closed before message completed"));
    assert_eq!(report.retried_closed_keepalive, 0);

    // With it, each is sent again on a new connection: no failures, and the retries are counted.
    let (addr, mock) = start(closing).await;
    let report = run(BenchArgs { concurrency: Some(3), ..args(addr) }).await.unwrap();
    assert_adds_up(&report);
    let closed = mock.closed.load(Ordering::SeqCst);
    assert!(closed > 0, "the server closed no connection");
    assert_eq!((report.requests_sent, report.requests_completed, report.requests_failed), (20, 20, 0));
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(report.retried_closed_keepalive, closed);
    assert_eq!(report.requests.iter().filter(|r| r.retried).count() as u64, closed);
    assert_eq!(report.output_tokens, Tokens(20 * 8));
    assert_eq!(report.itl_ms.count, 20 * 7);
    // Each request reached the handler exactly once: the closed attempts never did.
    assert_eq!(run_bodies(&mock).len(), 20);
    let table = corridor_bench::render_table(&report);
    assert!(table.contains(&format!("retried after a closed keep-alive connection: {closed}")), "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_connection_closed_without_an_answer_is_not_retried() {
    let (addr, mock) = start(Behaviour { closing: Closing::Always, ..Behaviour::default() }).await;
    let result = run(args(addr)).await;
    assert!(
        matches!(result, Err(BenchError::Preflight { ref kind, .. }) if kind == "transport"),
        "{result:?}"
    );
    // The preflight went out once: a connection that never carried a response is not kept alive.
    assert_eq!(mock.closed.load(Ordering::SeqCst), 1);
}
