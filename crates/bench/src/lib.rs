//! `corridor bench`: a load generator for any OpenAI-compatible server.
//!
//! It sends streamed `/v1/completions` or `/v1/chat/completions` requests in one of four workloads
//! (fixed lengths, long-tailed chat, shared prefix, multi-turn), at a fixed concurrency or as
//! seeded Poisson arrivals, until a request count or a duration is reached. Every number it reports
//! is counted from the streamed responses: throughput, input and output tokens per second, time to
//! first token, inter-token latency and end-to-end latency (nearest-rank p50, p90, p99, max), and
//! failures by kind. A failed request is measured, never fatal; only a run that cannot start (bad
//! arguments, an unreachable server) is an error.
//!
//! Layout: [`config`] turns arguments into a frozen config, [`workload`] draws prompts, [`schedule`]
//! decides arrivals and the stop, [`client`] and [`sse`] stream one request, `runner` drives the run,
//! [`report`], [`stats`] and [`chart`] present it.

pub mod chart;
pub mod client;
pub mod config;
pub mod error;
pub mod report;
mod runner;
pub mod schedule;
pub mod sse;
pub mod stats;
pub mod workload;

pub use chart::render_svg;
pub use client::ErrorKind;
pub use config::{BenchArgs, BenchConfig, LengthControl, WorkloadKind};
pub use error::BenchError;
pub use report::{render_table, BenchReport};
pub use stats::Percentiles;

/// Run a benchmark: resolve the arguments, drive the server, write the JSON report and the chart
/// where asked, and return the report. Must be called inside a Tokio runtime.
pub async fn run(args: BenchArgs) -> Result<BenchReport, BenchError> {
    let config = BenchConfig::resolve(args)?;
    run_config(&config).await
}

/// [`run`] for an already resolved config.
pub async fn run_config(config: &BenchConfig) -> Result<BenchReport, BenchError> {
    let report = runner::execute(config).await?;
    if let Some(path) = &config.outputs.json {
        std::fs::write(path, report.to_json() + "\n").map_err(|source| BenchError::WriteOutput {
            what: "JSON report",
            path: path.clone(),
            source,
        })?;
    }
    if let Some(path) = &config.outputs.chart {
        std::fs::write(path, render_svg(&report)).map_err(|source| BenchError::WriteOutput {
            what: "chart",
            path: path.clone(),
            source,
        })?;
    }
    Ok(report)
}
