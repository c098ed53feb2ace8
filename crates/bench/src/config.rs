//! The arguments of `corridor bench` and their resolution, once, into a frozen [`BenchConfig`].
//!
//! [`BenchArgs`] derives `clap::Args` so the command line can flatten it as is; nothing else in the
//! crate reads it. [`BenchConfig::resolve`] checks every value and turns the flag combinations
//! (`--concurrency` or `--request-rate`, `--num-requests` or `--duration`) into enums, so the runner
//! never meets an impossible combination.

use crate::error::BenchError;
use corridor_units::Tokens;
use hyper::Uri;
use std::path::PathBuf;
use std::time::Duration;

/// Which traffic to send.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkloadKind {
    /// Prompts of `--input-tokens` and outputs of `--output-tokens`, on `/v1/completions`.
    Fixed,
    /// Chat requests whose prompt and output lengths are drawn from a seeded long-tailed distribution.
    Chat,
    /// Chat requests that all share one long system prompt of `--prefix-tokens`.
    SharedPrefix,
    /// Conversations of `--turns` user turns, each resending the whole history.
    MultiTurn,
}

/// Whether to ask the server to ignore end-of-sequence so outputs have the requested length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LengthControl {
    /// Send `ignore_eos` and `min_tokens` if a preflight request shows the server accepts them.
    Auto,
    /// Always send them; a server that rejects them fails the preflight.
    On,
    /// Send only `max_tokens`.
    Off,
}

/// Command-line arguments of `corridor bench`.
#[derive(Clone, Debug, PartialEq, clap::Args)]
pub struct BenchArgs {
    /// Server address, with or without a trailing `/v1` (plain http).
    #[arg(long)]
    pub base_url: String,
    /// Model name sent in every request.
    #[arg(long)]
    pub model: String,
    /// Traffic shape.
    #[arg(long, value_enum, default_value_t = WorkloadKind::Fixed)]
    pub workload: WorkloadKind,
    /// Prompt length in tokens (fixed), unique suffix length (shared-prefix), user turn length (multi-turn).
    #[arg(long, default_value_t = 256)]
    pub input_tokens: usize,
    /// Output length in tokens (fixed, shared-prefix, multi-turn).
    #[arg(long, default_value_t = 128)]
    pub output_tokens: usize,
    /// Length of the common system prompt (shared-prefix).
    #[arg(long, default_value_t = 2048)]
    pub prefix_tokens: usize,
    /// User turns per conversation (multi-turn).
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// Cap on drawn prompt lengths (chat).
    #[arg(long, default_value_t = 4096)]
    pub max_input_tokens: usize,
    /// Cap on drawn output lengths (chat).
    #[arg(long, default_value_t = 1024)]
    pub max_output_tokens: usize,
    /// Requests in flight at all times (the default, 1, when no rate is given).
    #[arg(long, conflicts_with = "request_rate")]
    pub concurrency: Option<usize>,
    /// Poisson arrivals at this many requests per second (multi-turn: conversations start at this rate).
    #[arg(long)]
    pub request_rate: Option<f64>,
    /// Stop after sending this many requests (the default, 100, when no duration is given).
    #[arg(long, conflicts_with = "duration")]
    pub num_requests: Option<u64>,
    /// Stop sending after this many seconds; requests in flight then finish or time out.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Seed of every random draw (prompts, lengths, arrivals).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write a latency-over-time chart to this file (SVG).
    #[arg(long)]
    pub chart: Option<PathBuf>,
    /// Share of requests sent with an invalid parameter (`temperature: 5`) that a server must reject.
    #[arg(long, default_value_t = 0.0)]
    pub inject_errors: f64,
    /// Whether to send `ignore_eos` and `min_tokens`.
    #[arg(long, value_enum, default_value_t = LengthControl::Auto)]
    pub length_control: LengthControl,
    /// Seconds one request may take, streaming included, before it counts as a timeout.
    #[arg(long, default_value_t = 300.0)]
    pub request_timeout: f64,
    /// Bearer token sent in the Authorization header.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Do not draw a progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Count a request sent on a kept-alive connection that the server closed without answering as
    /// failed (`closed_keepalive`). By default it is sent once more on a new connection and counted
    /// apart, as retried, since the close says nothing about the server's serving.
    #[arg(long)]
    pub no_keepalive_retry: bool,
}

impl BenchArgs {
    /// Arguments with every default the command line would give.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> BenchArgs {
        BenchArgs {
            base_url: base_url.into(),
            model: model.into(),
            workload: WorkloadKind::Fixed,
            input_tokens: 256,
            output_tokens: 128,
            prefix_tokens: 2048,
            turns: 4,
            max_input_tokens: 4096,
            max_output_tokens: 1024,
            concurrency: None,
            request_rate: None,
            num_requests: None,
            duration: None,
            seed: 0,
            json: None,
            chart: None,
            inject_errors: 0.0,
            length_control: LengthControl::Auto,
            request_timeout: 300.0,
            api_key: None,
            no_progress: false,
            no_keepalive_retry: false,
        }
    }
}

/// The workload with its lengths.
#[derive(Clone, Debug, PartialEq)]
pub enum WorkloadSpec {
    Fixed { input: Tokens, output: Tokens },
    Chat { max_input: Tokens, max_output: Tokens },
    SharedPrefix { prefix: Tokens, input: Tokens, output: Tokens },
    MultiTurn { turns: usize, input: Tokens, output: Tokens },
}

impl WorkloadSpec {
    /// One line for people, e.g. `fixed (input 256, output 128 tokens)`.
    pub fn describe(&self) -> String {
        match self {
            WorkloadSpec::Fixed { input, output } => {
                format!("fixed (input {}, output {} tokens)", input.get(), output.get())
            }
            WorkloadSpec::Chat { max_input, max_output } => format!(
                "chat (long-tailed lengths, input up to {}, output up to {} tokens)",
                max_input.get(),
                max_output.get()
            ),
            WorkloadSpec::SharedPrefix { prefix, input, output } => format!(
                "shared-prefix (system prompt {}, suffix {}, output {} tokens)",
                prefix.get(),
                input.get(),
                output.get()
            ),
            WorkloadSpec::MultiTurn { turns, input, output } => format!(
                "multi-turn ({turns} turns, {} tokens per user turn, output {} tokens)",
                input.get(),
                output.get()
            ),
        }
    }
}

/// How requests arrive.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arrivals {
    /// This many requests in flight at all times.
    Concurrency(usize),
    /// Poisson arrivals at this many requests per second.
    Poisson { rate: f64 },
}

impl Arrivals {
    pub fn describe(&self) -> String {
        match self {
            Arrivals::Concurrency(n) => format!("concurrency {n}"),
            Arrivals::Poisson { rate } => format!("poisson {rate} req/s"),
        }
    }
}

/// When the run stops sending.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Bound {
    Requests(u64),
    Duration(Duration),
}

impl Bound {
    pub fn describe(&self) -> String {
        match self {
            Bound::Requests(n) => format!("{n} requests"),
            Bound::Duration(d) => format!("{:.1} s", d.as_secs_f64()),
        }
    }
}

/// Whether to draw the progress bar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    Bar,
    Hidden,
}

/// The endpoints of the server under test.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    /// The base URL as given, for reports.
    pub base_url: String,
    pub completions: Uri,
    pub chat: Uri,
}

impl Target {
    /// Accepts `http://host:port`, `http://host:port/prefix` and the same with a trailing `/v1`.
    pub fn parse(base_url: &str) -> Result<Target, BenchError> {
        let invalid =
            |reason: &str| BenchError::InvalidArgument { name: "base-url", reason: reason.to_string() };
        let trimmed = base_url.trim().trim_end_matches('/');
        let root = trimmed.strip_suffix("/v1").unwrap_or(trimmed);
        let uri: Uri = root.parse().map_err(|e| invalid(&format!("'{base_url}' is not a URL ({e})")))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => return Err(invalid(&format!("scheme '{other}' is not supported; use http://"))),
            None => return Err(invalid(&format!("'{base_url}' has no scheme; use http://host:port"))),
        }
        if uri.authority().is_none() {
            return Err(invalid(&format!("'{base_url}' has no host")));
        }
        let endpoint = |path: &str| -> Result<Uri, BenchError> {
            format!("{root}/v1/{path}").parse().map_err(|e| invalid(&format!("cannot form /v1/{path}: {e}")))
        };
        Ok(Target {
            base_url: base_url.to_string(),
            completions: endpoint("completions")?,
            chat: endpoint("chat/completions")?,
        })
    }
}

/// Where the optional outputs go.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outputs {
    pub json: Option<PathBuf>,
    /// Always an `.svg` path.
    pub chart: Option<PathBuf>,
}

/// Everything a run needs, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchConfig {
    pub target: Target,
    pub model: String,
    pub workload: WorkloadSpec,
    pub arrivals: Arrivals,
    pub bound: Bound,
    pub seed: u64,
    /// Share in [0, 1] of requests carrying an invalid parameter.
    pub inject_errors: f64,
    pub length_control: LengthControl,
    pub request_timeout: Duration,
    pub api_key: Option<String>,
    pub outputs: Outputs,
    pub progress: Progress,
    /// Send a request that met a closed keep-alive connection once more on a new connection.
    pub retry_closed_keepalive: bool,
}

/// Default number of requests when neither a count nor a duration is given.
const DEFAULT_REQUESTS: u64 = 100;

fn positive_tokens(name: &'static str, value: usize) -> Result<Tokens, BenchError> {
    if value == 0 {
        return Err(BenchError::InvalidArgument { name, reason: "must be at least 1".to_string() });
    }
    Ok(Tokens(value))
}

fn positive_seconds(name: &'static str, value: f64) -> Result<Duration, BenchError> {
    Duration::try_from_secs_f64(value).ok().filter(|d| !d.is_zero()).ok_or_else(|| {
        BenchError::InvalidArgument { name, reason: format!("{value} is not a positive number of seconds") }
    })
}

impl BenchConfig {
    /// Check the arguments and freeze them.
    pub fn resolve(args: BenchArgs) -> Result<BenchConfig, BenchError> {
        let target = Target::parse(&args.base_url)?;
        if args.model.trim().is_empty() {
            return Err(BenchError::InvalidArgument {
                name: "model",
                reason: "must not be empty".to_string(),
            });
        }
        let workload = match args.workload {
            WorkloadKind::Fixed => WorkloadSpec::Fixed {
                input: positive_tokens("input-tokens", args.input_tokens)?,
                output: positive_tokens("output-tokens", args.output_tokens)?,
            },
            WorkloadKind::Chat => WorkloadSpec::Chat {
                max_input: positive_tokens("max-input-tokens", args.max_input_tokens)?,
                max_output: positive_tokens("max-output-tokens", args.max_output_tokens)?,
            },
            WorkloadKind::SharedPrefix => WorkloadSpec::SharedPrefix {
                prefix: positive_tokens("prefix-tokens", args.prefix_tokens)?,
                input: positive_tokens("input-tokens", args.input_tokens)?,
                output: positive_tokens("output-tokens", args.output_tokens)?,
            },
            WorkloadKind::MultiTurn => {
                if args.turns == 0 {
                    return Err(BenchError::InvalidArgument {
                        name: "turns",
                        reason: "must be at least 1".into(),
                    });
                }
                WorkloadSpec::MultiTurn {
                    turns: args.turns,
                    input: positive_tokens("input-tokens", args.input_tokens)?,
                    output: positive_tokens("output-tokens", args.output_tokens)?,
                }
            }
        };
        let arrivals = match (args.concurrency, args.request_rate) {
            (Some(_), Some(_)) => {
                return Err(BenchError::InvalidArgument {
                    name: "concurrency",
                    reason: "give either --concurrency or --request-rate, not both".to_string(),
                })
            }
            (Some(0), None) => {
                return Err(BenchError::InvalidArgument {
                    name: "concurrency",
                    reason: "must be at least 1".into(),
                })
            }
            (Some(n), None) => Arrivals::Concurrency(n),
            (None, Some(rate)) if rate.is_finite() && rate > 0.0 => Arrivals::Poisson { rate },
            (None, Some(rate)) => {
                return Err(BenchError::InvalidArgument {
                    name: "request-rate",
                    reason: format!("{rate} is not a positive request rate"),
                })
            }
            (None, None) => Arrivals::Concurrency(1),
        };
        let bound = match (args.num_requests, args.duration) {
            (Some(_), Some(_)) => {
                return Err(BenchError::InvalidArgument {
                    name: "num-requests",
                    reason: "give either --num-requests or --duration, not both".to_string(),
                })
            }
            (Some(0), None) => {
                return Err(BenchError::InvalidArgument {
                    name: "num-requests",
                    reason: "must be at least 1".into(),
                })
            }
            (Some(n), None) => Bound::Requests(n),
            (None, Some(seconds)) => Bound::Duration(positive_seconds("duration", seconds)?),
            (None, None) => Bound::Requests(DEFAULT_REQUESTS),
        };
        if !(0.0..=1.0).contains(&args.inject_errors) {
            return Err(BenchError::InvalidArgument {
                name: "inject-errors",
                reason: format!("{} is not a share between 0 and 1", args.inject_errors),
            });
        }
        if let Some(chart) = &args.chart {
            let is_svg = chart.extension().is_some_and(|ext| ext.eq_ignore_ascii_case("svg"));
            if !is_svg {
                return Err(BenchError::InvalidArgument {
                    name: "chart",
                    reason: format!("{} must end in .svg (the only chart format written)", chart.display()),
                });
            }
        }
        Ok(BenchConfig {
            target,
            model: args.model,
            workload,
            arrivals,
            bound,
            seed: args.seed,
            inject_errors: args.inject_errors,
            length_control: args.length_control,
            request_timeout: positive_seconds("request-timeout", args.request_timeout)?,
            api_key: args.api_key,
            outputs: Outputs { json: args.json, chart: args.chart },
            progress: if args.no_progress { Progress::Hidden } else { Progress::Bar },
            retry_closed_keepalive: !args.no_keepalive_retry,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Command {
        #[command(flatten)]
        args: BenchArgs,
    }

    fn parse(extra: &[&str]) -> Result<BenchArgs, clap::Error> {
        let base = ["bench", "--base-url", "http://127.0.0.1:8000", "--model", "m"];
        Command::try_parse_from(base.iter().chain(extra)).map(|c| c.args)
    }

    #[test]
    fn new_matches_the_command_line_defaults() {
        assert_eq!(parse(&[]).unwrap(), BenchArgs::new("http://127.0.0.1:8000", "m"));
    }

    #[test]
    fn command_line_rejects_conflicting_bounds() {
        assert!(parse(&["--concurrency", "2", "--request-rate", "3"]).is_err());
        assert!(parse(&["--num-requests", "2", "--duration", "3"]).is_err());
        let args = parse(&["--workload", "multi-turn", "--request-rate", "2.5", "--duration", "10"]).unwrap();
        let config = BenchConfig::resolve(args).unwrap();
        assert_eq!(config.arrivals, Arrivals::Poisson { rate: 2.5 });
        assert_eq!(config.bound, Bound::Duration(Duration::from_secs(10)));
        assert!(matches!(config.workload, WorkloadSpec::MultiTurn { turns: 4, .. }));
    }

    #[test]
    fn defaults_resolve_to_one_at_a_time_for_a_hundred_requests() {
        let config = BenchConfig::resolve(BenchArgs::new("http://localhost:8000/v1/", "m")).unwrap();
        assert_eq!(config.arrivals, Arrivals::Concurrency(1));
        assert_eq!(config.bound, Bound::Requests(100));
        assert_eq!(config.target.completions, "http://localhost:8000/v1/completions");
        assert_eq!(config.target.chat, "http://localhost:8000/v1/chat/completions");
    }

    #[test]
    fn bad_values_name_their_flag() {
        let name_of = |args: BenchArgs| match BenchConfig::resolve(args) {
            Err(BenchError::InvalidArgument { name, .. }) => name,
            other => panic!("expected an invalid argument, got {other:?}"),
        };
        assert_eq!(name_of(BenchArgs::new("https://x", "m")), "base-url");
        assert_eq!(name_of(BenchArgs::new("localhost:8000", "m")), "base-url");
        assert_eq!(
            name_of(BenchArgs { inject_errors: 1.5, ..BenchArgs::new("http://x", "m") }),
            "inject-errors"
        );
        assert_eq!(
            name_of(BenchArgs { request_rate: Some(0.0), ..BenchArgs::new("http://x", "m") }),
            "request-rate"
        );
        assert_eq!(
            name_of(BenchArgs { duration: Some(-1.0), ..BenchArgs::new("http://x", "m") }),
            "duration"
        );
        assert_eq!(
            name_of(BenchArgs { output_tokens: 0, ..BenchArgs::new("http://x", "m") }),
            "output-tokens"
        );
        assert_eq!(
            name_of(BenchArgs { chart: Some(PathBuf::from("a.png")), ..BenchArgs::new("http://x", "m") }),
            "chart"
        );
    }
}
