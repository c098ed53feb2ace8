//! The report of a run: totals, error counts by kind, token cross-checks, latency percentiles; as
//! JSON for machines and as a table for people.
//!
//! Counting rules, so the numbers add up:
//! - `requests_sent` is the number of tickets issued; every sent request ends either completed or
//!   failed, so `requests_sent = requests_completed + requests_failed` and the `errors` counts sum to
//!   `requests_failed`.
//! - A request whose first attempt met a kept-alive connection the server had closed, and that was
//!   sent again on a new connection, counts once, by its second attempt; `retried_closed_keepalive`
//!   says how many were.
//! - Token totals count completed requests only. `output_tokens` is the server's `usage` count when
//!   it sent one and the number of streamed content chunks otherwise; `token_check` sets the two
//!   side by side so a server whose usage disagrees with its own stream is visible.
//! - Latencies come from completed requests: TTFT and E2E one sample per request, ITL one sample per
//!   gap between consecutive content chunks. Percentiles are nearest-rank ([`crate::stats`]).

use crate::client::ErrorKind;
use crate::config::BenchConfig;
use crate::runner::{LengthFields, RequestRecord};
use crate::stats::Percentiles;
use corridor_units::Tokens;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

/// Requests sent with an invalid parameter, and how many the server rejected as it should.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct InjectedErrors {
    pub sent: u64,
    pub rejected: u64,
}

/// Usage reported by the server against what was streamed, over completed requests.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TokenCheck {
    /// Sum of `usage.completion_tokens` where present.
    pub output_tokens_reported: Tokens,
    /// Content chunks received, over the same requests as `output_tokens` counts.
    pub output_tokens_streamed: Tokens,
    /// Completed requests with a `usage` object.
    pub usage_present: u64,
    /// Completed requests without one (their counts come from the stream and the request).
    pub usage_missing: u64,
    /// Requests whose `usage.completion_tokens` differs from their content chunk count.
    pub usage_stream_mismatches: u64,
}

/// Whether the server produced the lengths asked for, over completed requests.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LengthCheck {
    pub requested_input_tokens: Tokens,
    pub requested_output_tokens: Tokens,
    /// Requests whose output count equals `max_tokens`.
    pub output_as_requested: u64,
    pub output_shorter: u64,
    pub output_longer: u64,
    /// Requests whose server-counted prompt equals the requested length (a chat template or a BOS
    /// token makes them differ; that is expected, and shown rather than hidden).
    pub input_as_requested: u64,
    pub input_differs: u64,
    /// Mean of server-counted minus requested prompt tokens, over requests with usage.
    pub input_mean_difference: Option<f64>,
}

/// One request, for machines and for the chart.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RequestSummary {
    pub index: u64,
    pub session: u64,
    pub turn: usize,
    pub start_s: f64,
    pub injected: bool,
    /// `ok`, or the error kind.
    pub status: String,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    pub requested_input_tokens: Tokens,
    pub requested_output_tokens: Tokens,
    pub prompt_tokens: Option<Tokens>,
    pub completion_tokens: Option<Tokens>,
    pub content_chunks: usize,
    /// Sent again on a new connection after a closed keep-alive connection.
    pub retried: bool,
}

/// Everything a run measured. Field order is the JSON key order.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BenchReport {
    pub model: String,
    pub base_url: String,
    pub workload: String,
    pub arrivals: String,
    pub bound: String,
    pub seed: u64,
    /// What was sent to hold output lengths: `ignore_eos + min_tokens` or `max_tokens only`.
    pub length_control: String,
    pub requests_sent: u64,
    pub requests_completed: u64,
    pub requests_failed: u64,
    /// Failed requests by kind (`http_400`, `timeout`, ...).
    pub errors: BTreeMap<String, u64>,
    /// The first message seen for each error kind.
    pub error_examples: BTreeMap<String, String>,
    /// Requests sent again on a new connection because the kept-alive connection they first went
    /// out on was closed before any byte of a response (not failures; their outcome is the second
    /// attempt's).
    pub retried_closed_keepalive: u64,
    pub injected_errors: InjectedErrors,
    pub input_tokens: Tokens,
    pub output_tokens: Tokens,
    pub token_check: TokenCheck,
    pub lengths: LengthCheck,
    /// From the first request sent to the last response finished.
    pub duration_s: f64,
    pub request_throughput: f64,
    pub input_tokens_per_s: f64,
    pub output_tokens_per_s: f64,
    pub ttft_ms: Percentiles,
    pub itl_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub requests: Vec<RequestSummary>,
}

impl BenchReport {
    /// Pretty JSON with the keys in field order.
    pub fn to_json(&self) -> String {
        // Every field is a plain value or a string-keyed map, which serde_json always serialises.
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
}

/// What the runner hands over.
pub(crate) struct RunFacts<'a> {
    pub config: &'a BenchConfig,
    pub length: LengthFields,
    /// Tickets issued.
    pub sent: u64,
    pub duration: Duration,
    pub records: Vec<RequestRecord>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn per_second(count: f64, duration: Duration) -> f64 {
    let secs = duration.as_secs_f64();
    if secs > 0.0 {
        count / secs
    } else {
        0.0
    }
}

pub(crate) fn build(facts: &RunFacts<'_>) -> BenchReport {
    let config = facts.config;
    let mut records: Vec<&RequestRecord> = facts.records.iter().collect();
    records.sort_by_key(|r| r.ticket.index);

    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    let mut error_examples: BTreeMap<String, String> = BTreeMap::new();
    let mut injected = InjectedErrors::default();
    let mut tokens = TokenCheck::default();
    let mut lengths = LengthCheck::default();
    let (mut input_tokens, mut output_tokens) = (Tokens(0), Tokens(0));
    let (mut ttft, mut itl, mut e2e) = (Vec::new(), Vec::new(), Vec::new());
    let mut input_differences = Vec::new();
    let mut completed = 0u64;
    let mut retried = 0u64;
    let mut summaries = Vec::with_capacity(records.len());

    for record in &records {
        if record.ticket.injected {
            injected.sent += 1;
        }
        let mut summary = RequestSummary {
            index: record.ticket.index,
            session: record.session,
            turn: record.turn,
            start_s: record.start.as_secs_f64(),
            injected: record.ticket.injected,
            status: "ok".to_string(),
            ttft_ms: None,
            e2e_ms: None,
            requested_input_tokens: record.requested_input,
            requested_output_tokens: record.requested_output,
            prompt_tokens: None,
            completion_tokens: None,
            content_chunks: 0,
            retried: record.retried,
        };
        if record.retried {
            retried += 1;
        }
        match &record.outcome {
            Err(failure) => {
                let key = failure.kind.to_string();
                if record.ticket.injected && matches!(failure.kind, ErrorKind::Http(400..=499)) {
                    injected.rejected += 1;
                }
                *errors.entry(key.clone()).or_default() += 1;
                error_examples.entry(key.clone()).or_insert_with(|| failure.message.clone());
                summary.status = key;
            }
            Ok(done) => {
                completed += 1;
                let streamed = Tokens(done.content_chunks);
                let output = done.usage.map_or(streamed, |u| u.completion);
                let input = done.usage.map_or(record.requested_input, |u| u.prompt);
                output_tokens = output_tokens + output;
                input_tokens = input_tokens + input;
                tokens.output_tokens_streamed = tokens.output_tokens_streamed + streamed;
                match done.usage {
                    Some(usage) => {
                        tokens.usage_present += 1;
                        tokens.output_tokens_reported = tokens.output_tokens_reported + usage.completion;
                        if usage.completion != streamed {
                            tokens.usage_stream_mismatches += 1;
                        }
                        if usage.prompt == record.requested_input {
                            lengths.input_as_requested += 1;
                        } else {
                            lengths.input_differs += 1;
                        }
                        input_differences
                            .push(usage.prompt.get() as f64 - record.requested_input.get() as f64);
                    }
                    None => tokens.usage_missing += 1,
                }
                lengths.requested_input_tokens = lengths.requested_input_tokens + record.requested_input;
                lengths.requested_output_tokens = lengths.requested_output_tokens + record.requested_output;
                match output.cmp(&record.requested_output) {
                    std::cmp::Ordering::Equal => lengths.output_as_requested += 1,
                    std::cmp::Ordering::Less => lengths.output_shorter += 1,
                    std::cmp::Ordering::Greater => lengths.output_longer += 1,
                }
                if let Some(first) = done.ttft {
                    ttft.push(ms(first));
                }
                itl.extend(done.itl.iter().copied().map(ms));
                e2e.push(ms(done.e2e));
                summary.ttft_ms = done.ttft.map(ms);
                summary.e2e_ms = Some(ms(done.e2e));
                summary.prompt_tokens = done.usage.map(|u| u.prompt);
                summary.completion_tokens = done.usage.map(|u| u.completion);
                summary.content_chunks = done.content_chunks;
            }
        }
        summaries.push(summary);
    }
    // Requests whose task vanished without a record still count as sent; they are failures of their
    // own kind so that the totals add up and the shortfall is visible.
    let recorded = records.len() as u64;
    let sent = facts.sent.max(recorded);
    if sent > recorded {
        errors.insert(ErrorKind::Lost.to_string(), sent - recorded);
    }
    lengths.input_mean_difference = (!input_differences.is_empty())
        .then(|| input_differences.iter().sum::<f64>() / input_differences.len() as f64);

    BenchReport {
        model: config.model.clone(),
        base_url: config.target.base_url.clone(),
        workload: config.workload.describe(),
        arrivals: config.arrivals.describe(),
        bound: config.bound.describe(),
        seed: config.seed,
        length_control: facts.length.describe().to_string(),
        requests_sent: sent,
        requests_completed: completed,
        requests_failed: sent - completed,
        errors,
        error_examples,
        retried_closed_keepalive: retried,
        injected_errors: injected,
        input_tokens,
        output_tokens,
        token_check: tokens,
        lengths,
        duration_s: facts.duration.as_secs_f64(),
        request_throughput: per_second(completed as f64, facts.duration),
        input_tokens_per_s: per_second(input_tokens.get() as f64, facts.duration),
        output_tokens_per_s: per_second(output_tokens.get() as f64, facts.duration),
        ttft_ms: Percentiles::from_samples(ttft),
        itl_ms: Percentiles::from_samples(itl),
        e2e_ms: Percentiles::from_samples(e2e),
        requests: summaries,
    }
}

fn cell(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"))
}

/// The report as a table for people.
pub fn render_table(report: &BenchReport) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail, so the results of `writeln!` are ignored below.
    let _ = writeln!(out, "corridor bench: {} at {}", report.model, report.base_url);
    let _ = writeln!(out, "  workload    {}", report.workload);
    let _ = writeln!(out, "  arrivals    {}, bound {}, seed {}", report.arrivals, report.bound, report.seed);
    let _ = writeln!(out, "  lengths     held with {}", report.length_control);
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "Requests     {} sent, {} completed, {} failed",
        report.requests_sent, report.requests_completed, report.requests_failed
    );
    for (kind, count) in &report.errors {
        let example = report.error_examples.get(kind).map(|m| format!("  e.g. \"{m}\"")).unwrap_or_default();
        let _ = writeln!(out, "  {kind:<11} {count}{example}");
    }
    if report.retried_closed_keepalive > 0 {
        let _ = writeln!(
            out,
            "  retried after a closed keep-alive connection: {} (not failures)",
            report.retried_closed_keepalive
        );
    }
    if report.injected_errors.sent > 0 {
        let _ = writeln!(
            out,
            "  injected    {} sent with an invalid parameter, {} rejected by the server",
            report.injected_errors.sent, report.injected_errors.rejected
        );
    }
    let check = &report.token_check;
    let _ = writeln!(
        out,
        "Tokens       {} input, {} output (usage reported {}, streamed {})",
        report.input_tokens.get(),
        report.output_tokens.get(),
        check.output_tokens_reported.get(),
        check.output_tokens_streamed.get()
    );
    if check.usage_missing > 0 {
        let _ = writeln!(
            out,
            "  {} completed requests had no usage; counted from the stream",
            check.usage_missing
        );
    }
    if check.usage_stream_mismatches > 0 {
        let _ = writeln!(
            out,
            "  {} requests reported a completion count different from the chunks streamed",
            check.usage_stream_mismatches
        );
    }
    let l = &report.lengths;
    let _ = writeln!(
        out,
        "Lengths      output as requested in {} of {} (shorter {}, longer {})",
        l.output_as_requested, report.requests_completed, l.output_shorter, l.output_longer
    );
    if let Some(diff) = l.input_mean_difference {
        let _ = writeln!(
            out,
            "             prompt as requested in {} of {}; the server counted {diff:+.1} tokens per request on average",
            l.input_as_requested,
            l.input_as_requested + l.input_differs
        );
    }
    let _ = writeln!(
        out,
        "Throughput   {:.2} req/s, {:.1} input tok/s, {:.1} output tok/s over {:.2} s",
        report.request_throughput, report.input_tokens_per_s, report.output_tokens_per_s, report.duration_s
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<14}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}",
        "latency (ms)", "p50", "p90", "p99", "max", "mean", "samples"
    );
    for (name, p) in [("TTFT", &report.ttft_ms), ("ITL", &report.itl_ms), ("E2E", &report.e2e_ms)] {
        let _ = writeln!(
            out,
            "{:<14}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}",
            name,
            cell(p.p50),
            cell(p.p90),
            cell(p.p99),
            cell(p.max),
            cell(p.mean),
            p.count
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{Completion, Failure, Usage};
    use crate::config::BenchArgs;
    use crate::schedule::Ticket;

    fn record(index: u64, outcome: Result<Completion, Failure>) -> RequestRecord {
        RequestRecord {
            ticket: Ticket { index, injected: false },
            session: index,
            turn: 0,
            start: Duration::from_millis(index * 10),
            requested_input: Tokens(10),
            requested_output: Tokens(3),
            outcome,
            retried: false,
        }
    }

    fn completed(prompt: usize, chunks: usize) -> Completion {
        Completion {
            ttft: Some(Duration::from_millis(5)),
            itl: vec![Duration::from_millis(2); chunks.saturating_sub(1)],
            e2e: Duration::from_millis(9),
            content_chunks: chunks,
            usage: Some(Usage { prompt: Tokens(prompt), completion: Tokens(chunks) }),
            finish_reason: Some("length".into()),
            text: String::new(),
        }
    }

    #[test]
    fn unrecorded_requests_are_counted_as_lost() {
        let config = BenchConfig::resolve(BenchArgs::new("http://127.0.0.1:1", "m")).unwrap();
        let failure = Failure { kind: ErrorKind::Http(503), message: "busy".into() };
        let records =
            vec![record(0, Ok(completed(11, 3))), record(1, Err(failure)), record(2, Ok(completed(10, 2)))];
        let report = build(&RunFacts {
            config: &config,
            length: LengthFields::Omit,
            sent: 5,
            duration: Duration::from_secs(2),
            records,
        });
        assert_eq!((report.requests_sent, report.requests_completed, report.requests_failed), (5, 2, 3));
        assert_eq!(report.errors.get("lost"), Some(&2));
        assert_eq!(report.errors.get("http_503"), Some(&1));
        assert_eq!(report.output_tokens, Tokens(5));
        assert_eq!(report.input_tokens, Tokens(21));
        assert_eq!((report.lengths.output_as_requested, report.lengths.output_shorter), (1, 1));
        assert_eq!((report.lengths.input_as_requested, report.lengths.input_differs), (1, 1));
        assert_eq!(report.lengths.input_mean_difference, Some(0.5));
        assert_eq!(report.itl_ms.count, 3);
        assert_eq!(report.request_throughput, 1.0);
        assert_eq!(report.requests[1].status, "http_503");
    }

    #[test]
    fn retried_requests_count_apart_from_failures() {
        let config = BenchConfig::resolve(BenchArgs::new("http://127.0.0.1:1", "m")).unwrap();
        let failure = Failure { kind: ErrorKind::Timeout, message: "slow".into() };
        let retried = |index, outcome| RequestRecord { retried: true, ..record(index, outcome) };
        let records =
            vec![retried(0, Ok(completed(10, 3))), record(1, Ok(completed(10, 3))), retried(2, Err(failure))];
        let report = build(&RunFacts {
            config: &config,
            length: LengthFields::Omit,
            sent: 3,
            duration: Duration::from_secs(1),
            records,
        });
        assert_eq!((report.requests_completed, report.requests_failed), (2, 1));
        assert_eq!(report.retried_closed_keepalive, 2);
        assert_eq!(report.errors.get("timeout"), Some(&1));
        assert_eq!(report.errors.len(), 1, "a retry is not an error kind");
        assert!(report.requests[0].retried && !report.requests[1].retried);
        assert!(render_table(&report).contains("retried after a closed keep-alive connection: 2"));
        assert!(!render_table(&build(&RunFacts {
            config: &config,
            length: LengthFields::Omit,
            sent: 1,
            duration: Duration::from_secs(1),
            records: vec![record(0, Ok(completed(10, 3)))],
        }))
        .contains("retried"));
    }
}
