//! The run: a preflight request, then sessions launched by concurrency workers or Poisson arrivals
//! until the ticket dispenser says the bound is reached, then the report.
//!
//! A session is one request, or for the multi-turn workload a conversation whose turns go out one
//! after another, each resending the whole history with the assistant's real replies. Each request
//! claims a ticket first, so the count bound is exact whichever way requests arrive, and each one is
//! recorded whatever happens to it, so `sent = completed + failed` holds by construction.

use crate::client::{ClosedKeepAlive, Completion, ErrorKind, Exchange, Failure, HttpClient, Streamed};
use crate::config::{Arrivals, BenchConfig, Bound, LengthControl, Progress};
use crate::error::BenchError;
use crate::report::{self, BenchReport};
use crate::schedule::{poisson_arrivals, Ticket, Tickets};
use crate::workload::{words, Endpoint, Planner, Session};
use bytes::Bytes;
use corridor_units::Tokens;
use hyper::Uri;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::task::JoinSet;

/// The parameter value a correct OpenAI server rejects: temperature is defined on [0, 2].
const INJECTED_TEMPERATURE: f64 = 5.0;
/// Words in the preflight prompt; the preflight asks for one token back.
const PREFLIGHT_WORDS: usize = 4;
/// Progress bar of a count-bound run.
const COUNT_TEMPLATE: &str = "{elapsed_precise} [{wide_bar}] {pos}/{len} requests finished ({msg})";
/// Progress bar of a duration-bound run; its position is milliseconds of the sending time.
const TIME_TEMPLATE: &str = "{elapsed_precise} [{wide_bar}] {percent}% of the sending time ({msg})";
/// How often the duration progress bar is refreshed.
const PROGRESS_TICK: Duration = Duration::from_millis(200);

/// Whether requests carry `ignore_eos` and `min_tokens`, as settled by the preflight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LengthFields {
    Send,
    Omit,
}

impl LengthFields {
    pub fn describe(self) -> &'static str {
        match self {
            LengthFields::Send => "ignore_eos + min_tokens",
            LengthFields::Omit => "max_tokens only",
        }
    }
}

/// What one request was and what became of it.
#[derive(Clone, Debug)]
pub struct RequestRecord {
    pub ticket: Ticket,
    pub session: u64,
    /// 0-based turn within the session.
    pub turn: usize,
    /// When it was sent, from the start of the run.
    pub start: Duration,
    /// Prompt tokens asked for: words sent, plus earlier replies as the server counted them.
    pub requested_input: Tokens,
    /// `max_tokens`.
    pub requested_output: Tokens,
    pub outcome: Result<Completion, Failure>,
    /// The first attempt met a closed keep-alive connection; `outcome` is the second one's.
    pub retried: bool,
}

/// The prompt of one request.
enum Prompt<'a> {
    Text(&'a str),
    Messages(&'a [Value]),
}

/// Everything that goes into one request body.
struct BodySpec<'a> {
    model: &'a str,
    prompt: Prompt<'a>,
    max_tokens: Tokens,
    length: LengthFields,
    injected: bool,
}

fn request_body(spec: &BodySpec<'_>) -> Bytes {
    let mut body = json!({
        "model": spec.model,
        "max_tokens": spec.max_tokens.get(),
        "stream": true,
        "stream_options": { "include_usage": true },
    });
    match spec.prompt {
        Prompt::Text(text) => body["prompt"] = json!(text),
        Prompt::Messages(messages) => body["messages"] = json!(messages),
    }
    if spec.length == LengthFields::Send {
        body["ignore_eos"] = json!(true);
        body["min_tokens"] = json!(spec.max_tokens.get());
    }
    if spec.injected {
        body["temperature"] = json!(INJECTED_TEMPERATURE);
    }
    Bytes::from(body.to_string())
}

/// What the progress bar counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ProgressUnit {
    /// One step per finished request (count bound).
    Requests,
    /// Milliseconds of the duration bound, moved by a ticker.
    Time,
}

/// State shared by every task of a run.
struct Shared {
    client: HttpClient,
    planner: Planner,
    tickets: Tickets,
    model: String,
    uri: Uri,
    timeout: Duration,
    length: LengthFields,
    start: Instant,
    records: Mutex<Vec<RequestRecord>>,
    progress: ProgressBar,
    progress_unit: ProgressUnit,
    failed: AtomicU64,
}

impl Shared {
    fn record(&self, record: RequestRecord) {
        if record.outcome.is_err() {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        let done = {
            let mut records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
            records.push(record);
            records.len()
        };
        self.progress.set_message(format!("{done} done, {} failed", self.failed.load(Ordering::Relaxed)));
        if self.progress_unit == ProgressUnit::Requests {
            self.progress.inc(1);
        }
    }

    /// Send one request and record it; returns the completion if there was one.
    async fn send(&self, request: Outgoing<'_>) -> Option<Completion> {
        let body = request_body(&BodySpec {
            model: &self.model,
            prompt: request.prompt,
            max_tokens: request.requested_output,
            length: self.length,
            injected: request.ticket.injected,
        });
        let exchange = Exchange {
            uri: self.uri.clone(),
            endpoint: self.planner.endpoint(),
            body,
            timeout: self.timeout,
        };
        let start = self.start.elapsed();
        let Streamed { outcome, retried } = self.client.stream(&exchange).await;
        let completion = outcome.as_ref().ok().cloned();
        self.record(RequestRecord {
            ticket: request.ticket,
            session: request.session,
            turn: request.turn,
            start,
            requested_input: request.requested_input,
            requested_output: request.requested_output,
            outcome,
            retried,
        });
        completion
    }
}

/// One request of a session, ready to send.
struct Outgoing<'a> {
    ticket: Ticket,
    session: u64,
    turn: usize,
    prompt: Prompt<'a>,
    requested_input: Tokens,
    requested_output: Tokens,
}

/// Run one session starting with an already claimed ticket; later turns claim their own.
async fn run_session(shared: Arc<Shared>, index: u64, first: Ticket) {
    let Session { endpoint, system, system_tokens, turns } = shared.planner.session(index);
    let mut ticket = Some(first);
    let mut messages: Vec<Value> = Vec::new();
    if let Some(system) = &system {
        messages.push(json!({ "role": "system", "content": &**system }));
    }
    // Prompt tokens asked for so far: words sent plus earlier replies as the server counted them.
    let mut history = system_tokens;
    for (turn_index, turn) in turns.iter().enumerate() {
        let Some(current) = ticket.take().or_else(|| shared.tickets.claim()) else { return };
        history = history + turn.input;
        if endpoint == Endpoint::Chat {
            messages.push(json!({ "role": "user", "content": &turn.user }));
        }
        let prompt = match endpoint {
            Endpoint::Completions => Prompt::Text(&turn.user),
            Endpoint::Chat => Prompt::Messages(&messages),
        };
        let completion = shared
            .send(Outgoing {
                ticket: current,
                session: index,
                turn: turn_index,
                prompt,
                requested_input: history,
                requested_output: turn.output,
            })
            .await;
        // A failed turn ends the conversation: its history would no longer be what a client has.
        let Some(completion) = completion else { return };
        history = history + completion.usage.map_or(Tokens(completion.content_chunks), |u| u.completion);
        messages.push(json!({ "role": "assistant", "content": completion.text }));
    }
}

/// One of `--concurrency` workers: sessions back to back until tickets run out.
async fn worker(shared: Arc<Shared>, next_session: Arc<AtomicU64>) {
    while let Some(ticket) = shared.tickets.claim() {
        let index = next_session.fetch_add(1, Ordering::Relaxed);
        run_session(shared.clone(), index, ticket).await;
    }
}

/// Send one tiny request to learn whether the server accepts `ignore_eos` and `min_tokens`, and to
/// fail early, with the server's own words, when the URL or the model name is wrong.
async fn preflight(
    client: &HttpClient,
    config: &BenchConfig,
    planner: &Planner,
) -> Result<LengthFields, BenchError> {
    let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
    let text = words(&mut rng, Tokens(PREFLIGHT_WORDS));
    let messages = [json!({ "role": "user", "content": &text })];
    let endpoint = planner.endpoint();
    let uri = match endpoint {
        Endpoint::Completions => config.target.completions.clone(),
        Endpoint::Chat => config.target.chat.clone(),
    };
    let attempt = |length: LengthFields| {
        let prompt = match endpoint {
            Endpoint::Completions => Prompt::Text(&text),
            Endpoint::Chat => Prompt::Messages(&messages),
        };
        let body = request_body(&BodySpec {
            model: &config.model,
            prompt,
            max_tokens: Tokens(1),
            length,
            injected: false,
        });
        let exchange = Exchange { uri: uri.clone(), endpoint, body, timeout: config.request_timeout };
        async move { client.stream(&exchange).await.outcome }
    };
    let fatal = |failure: Failure| match failure.kind {
        ErrorKind::Connect => BenchError::Unreachable { url: uri.to_string(), message: failure.message },
        kind => {
            BenchError::Preflight { url: uri.to_string(), kind: kind.to_string(), message: failure.message }
        }
    };
    match config.length_control {
        LengthControl::On => attempt(LengthFields::Send).await.map(|_| LengthFields::Send).map_err(fatal),
        LengthControl::Off => attempt(LengthFields::Omit).await.map(|_| LengthFields::Omit).map_err(fatal),
        LengthControl::Auto => match attempt(LengthFields::Send).await {
            Ok(_) => Ok(LengthFields::Send),
            // A 4xx may be the extra fields; a plain request tells whether it was.
            Err(Failure { kind: ErrorKind::Http(400..=499), .. }) => {
                attempt(LengthFields::Omit).await.map(|_| LengthFields::Omit).map_err(fatal)
            }
            Err(failure) => Err(fatal(failure)),
        },
    }
}

fn progress_bar(config: &BenchConfig) -> (ProgressBar, ProgressUnit) {
    let (bar, unit, template) = match config.bound {
        Bound::Requests(n) => (ProgressBar::new(n), ProgressUnit::Requests, COUNT_TEMPLATE),
        Bound::Duration(d) => (
            ProgressBar::new(d.as_millis().try_into().unwrap_or(u64::MAX)),
            ProgressUnit::Time,
            TIME_TEMPLATE,
        ),
    };
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    // stderr hides itself when it is not a terminal, so piped output stays clean.
    let target = match config.progress {
        Progress::Bar => ProgressDrawTarget::stderr(),
        Progress::Hidden => ProgressDrawTarget::hidden(),
    };
    bar.set_draw_target(target);
    (bar, unit)
}

/// Run the benchmark described by `config` and build its report (no files written here).
pub async fn execute(config: &BenchConfig) -> Result<BenchReport, BenchError> {
    let closed = if config.retry_closed_keepalive { ClosedKeepAlive::Retry } else { ClosedKeepAlive::Fail };
    let client = HttpClient::new(config.api_key.clone(), closed);
    let planner = Planner::new(config.workload.clone(), config.seed);
    let length = preflight(&client, config, &planner).await?;
    let uri = match planner.endpoint() {
        Endpoint::Completions => config.target.completions.clone(),
        Endpoint::Chat => config.target.chat.clone(),
    };
    let (progress, progress_unit) = progress_bar(config);
    let start = Instant::now();
    let (limit, deadline) = match config.bound {
        Bound::Requests(n) => (Some(n), None),
        Bound::Duration(d) => (None, Some(start + d)),
    };
    let shared = Arc::new(Shared {
        client,
        planner,
        tickets: Tickets::new(limit, deadline, config.inject_errors),
        model: config.model.clone(),
        uri,
        timeout: config.request_timeout,
        length,
        start,
        records: Mutex::new(Vec::new()),
        progress: progress.clone(),
        progress_unit,
        failed: AtomicU64::new(0),
    });
    let ticker = (progress_unit == ProgressUnit::Time).then(|| {
        let bar = progress.clone();
        tokio::spawn(async move {
            loop {
                bar.set_position(start.elapsed().as_millis().try_into().unwrap_or(u64::MAX));
                tokio::time::sleep(PROGRESS_TICK).await;
            }
        })
    });

    let mut tasks = JoinSet::new();
    match config.arrivals {
        Arrivals::Concurrency(n) => {
            let next_session = Arc::new(AtomicU64::new(0));
            for _ in 0..n {
                tasks.spawn(worker(shared.clone(), next_session.clone()));
            }
        }
        Arrivals::Poisson { rate } => {
            for (index, offset) in poisson_arrivals(rate, config.seed).enumerate() {
                let at = start + offset;
                if shared.tickets.exhausted() || deadline.is_some_and(|deadline| at >= deadline) {
                    break;
                }
                tokio::time::sleep_until(at.into()).await;
                let Some(ticket) = shared.tickets.claim() else { break };
                tasks.spawn(run_session(shared.clone(), index as u64, ticket));
                // Reap finished sessions so a long run does not hold every handle.
                while tasks.try_join_next().is_some() {}
            }
        }
    }
    // A panicked task loses its records; the report counts the shortfall as `lost`, so no join
    // result needs handling here.
    while tasks.join_next().await.is_some() {}
    let duration = start.elapsed();
    if let Some(ticker) = ticker {
        ticker.abort();
    }
    progress.finish_and_clear();

    let sent = shared.tickets.issued();
    let records = std::mem::take(&mut *shared.records.lock().unwrap_or_else(PoisonError::into_inner));
    Ok(report::build(&report::RunFacts { config, length, sent, duration, records }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(spec: &BodySpec<'_>) -> Value {
        serde_json::from_slice(&request_body(spec)).unwrap()
    }

    #[test]
    fn progress_templates_parse() {
        assert!(ProgressStyle::with_template(COUNT_TEMPLATE).is_ok());
        assert!(ProgressStyle::with_template(TIME_TEMPLATE).is_ok());
    }

    #[test]
    fn body_carries_length_fields_and_injection_only_when_asked() {
        let spec = BodySpec {
            model: "m",
            prompt: Prompt::Text(" the of"),
            max_tokens: Tokens(9),
            length: LengthFields::Send,
            injected: false,
        };
        let plain = body(&spec);
        assert_eq!(plain["prompt"], " the of");
        assert_eq!(plain["max_tokens"], 9);
        assert_eq!(plain["min_tokens"], 9);
        assert_eq!(plain["ignore_eos"], true);
        assert_eq!(plain["stream"], true);
        assert_eq!(plain["stream_options"]["include_usage"], true);
        assert!(plain.get("temperature").is_none());

        let messages = [json!({"role": "user", "content": "hi"})];
        let other = body(&BodySpec {
            prompt: Prompt::Messages(&messages),
            length: LengthFields::Omit,
            injected: true,
            ..spec
        });
        assert_eq!(other["messages"][0]["content"], "hi");
        assert!(other.get("prompt").is_none());
        assert!(other.get("ignore_eos").is_none() && other.get("min_tokens").is_none());
        assert_eq!(other["temperature"], INJECTED_TEMPERATURE);
    }
}
