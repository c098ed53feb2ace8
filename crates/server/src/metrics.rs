//! `GET /metrics`: Prometheus text, written by hand.
//!
//! Two sources: the engine's published snapshot (queue lengths, KV pages,
//! prefix-cache lookups, token totals, preemptions, aborts) and what the
//! server measures itself per request (time to first token, inter-token
//! latency, how requests ended). Latencies are measured here, at the point
//! where a token leaves for the client, because that is the latency a user
//! sees; the engine does not keep clocks per request.
//!
//! Names follow Prometheus conventions: a `corridor_` prefix, `_total` on
//! counters, base units (seconds) on histograms, and a HELP and TYPE line
//! before every family.

use corridor_engine::engine::ModelInfo;
use corridor_engine::sampling::{FallbackKind, SamplerStats};
use corridor_engine::stats::EngineStats;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Bucket upper bounds for time to first token, in seconds.
const TTFT_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// Bucket upper bounds for the gap between two tokens, in seconds.
const ITL_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];

/// A cumulative histogram with fixed buckets; lock-free so that recording
/// from many request tasks never contends.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Non-cumulative counts per bucket; the last one is `+Inf`.
    counts: Vec<AtomicU64>,
    /// Sum of observations in nanoseconds (integers add without a lock).
    sum_nanos: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = self.bounds.iter().position(|&b| secs <= b).unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        header(out, name, help, "histogram");
        let mut cumulative = 0;
        for (i, c) in self.counts.iter().enumerate() {
            cumulative += c.load(Ordering::Relaxed);
            let le = self.bounds.get(i).map_or_else(|| "+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {cumulative}");
    }
}

/// How a request (one HTTP request, all its choices) ended, as counted by
/// the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Every choice finished (`stop` or `length`).
    Completed,
    /// Refused at the edge (4xx).
    Rejected,
    /// The engine failed or shut down (5xx or an in-stream error).
    Failed,
}

/// What the server measures itself.
#[derive(Debug)]
pub struct Metrics {
    pub ttft: Histogram,
    pub itl: Histogram,
    completed: AtomicU64,
    rejected: AtomicU64,
    failed: AtomicU64,
    /// Choices that ended because a stop string matched.
    stop_string_hits: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            completed: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            stop_string_hits: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    pub fn count(&self, outcome: Outcome) {
        let c = match outcome {
            Outcome::Completed => &self.completed,
            Outcome::Rejected => &self.rejected,
            Outcome::Failed => &self.failed,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub fn note_stop_string(&self) {
        self.stop_string_hits.fetch_add(1, Ordering::Relaxed);
    }
}

fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn single(out: &mut String, name: &str, help: &str, kind: &str, value: impl std::fmt::Display) {
    header(out, name, help, kind);
    let _ = writeln!(out, "{name} {value}");
}

/// The inputs of one `/metrics` scrape.
pub struct Scrape<'a> {
    pub server: &'a Metrics,
    pub engine: &'a EngineStats,
    pub sampler: &'a SamplerStats,
    pub info: &'a ModelInfo,
    pub memory: &'a corridor_vram::MemoryReport,
}

/// Per-card memory: the corridor law's record and the books by purpose.
/// Phase flips: committed by direction, abandoned by reason, the bytes they
/// moved, their durations, and which layout serves.
fn render_flips(out: &mut String, f: &corridor_engine::flips::FlipStats) {
    let Some(serving) = f.serving else { return };
    header(out, "corridor_layout_serving", "1 for the layout a flipping group serves in.", "gauge");
    for p in [corridor_engine::phase::Phase::Tensor, corridor_engine::phase::Phase::Pipeline] {
        let _ = writeln!(out, "corridor_layout_serving{{layout=\"{p}\"}} {}", (p == serving) as u8);
    }
    header(out, "corridor_phase_flips_total", "Committed phase flips, by the layout flipped to.", "counter");
    let _ = writeln!(out, "corridor_phase_flips_total{{to=\"tp\"}} {}", f.to_tensor);
    let _ = writeln!(out, "corridor_phase_flips_total{{to=\"pp\"}} {}", f.to_pipeline);
    header(
        out,
        "corridor_phase_flip_abandons_total",
        "Phase flips abandoned on every rank, by reason.",
        "counter",
    );
    for reason in corridor_engine::phase::AbandonReason::LABELS {
        let n = f.abandoned.iter().find(|(l, _)| *l == reason).map_or(0, |(_, n)| *n);
        let _ = writeln!(out, "corridor_phase_flip_abandons_total{{reason=\"{reason}\"}} {n}");
    }
    single(
        out,
        "corridor_phase_flip_bytes_total",
        "KV bytes phase flips moved between ranks.",
        "counter",
        f.bytes_moved.get(),
    );
    single(
        out,
        "corridor_phase_flips_disabled",
        "1 once phase flips turned themselves off after repeated abandons.",
        "gauge",
        f.disabled as u64,
    );
    let name = "corridor_phase_flip_duration_seconds";
    header(out, name, "Committed phase flips' durations.", "histogram");
    for (le, c) in corridor_engine::flips::FLIP_BUCKETS.iter().zip(f.duration_buckets) {
        let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {c}");
    }
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", f.committed());
    let _ = writeln!(out, "{name}_sum {}", f.duration_sum.as_secs_f64());
    let _ = writeln!(out, "{name}_count {}", f.committed());
}

fn render_memory(out: &mut String, m: &corridor_vram::MemoryReport) {
    type Field = fn(&corridor_vram::CardReport) -> u64;
    let gauges: [(&str, &str, &str, Field); 8] = [
        ("corridor_card_total_bytes", "Card memory in all.", "gauge", |c| c.total_bytes.get()),
        ("corridor_card_free_bytes", "Driver free memory now.", "gauge", |c| c.free_bytes.get()),
        ("corridor_card_floor_bytes", "The free-memory floor the card must keep.", "gauge", |c| {
            c.floor_bytes.get()
        }),
        ("corridor_card_min_free_bytes", "Lowest free memory any 100 ms sample saw.", "gauge", |c| {
            c.min_free_bytes.get()
        }),
        (
            "corridor_card_breaches_total",
            "Samples under the floor caused by corridor itself.",
            "counter",
            |c| c.breaches,
        ),
        (
            "corridor_card_intrusions_total",
            "Samples under the floor caused by other processes.",
            "counter",
            |c| c.intrusions,
        ),
        (
            "corridor_card_restore_ms_max",
            "Longest time to restore the floor after an intrusion.",
            "gauge",
            |c| c.restore_ms_max.unwrap_or(0),
        ),
        ("corridor_card_foreign_bytes", "Bytes other processes hold on the card.", "gauge", |c| {
            c.foreign_bytes.get()
        }),
    ];
    for (name, help, kind, f) in gauges {
        header(out, name, help, kind);
        for c in &m.cards {
            let _ = writeln!(out, "{name}{{card=\"{}\"}} {}", c.card.0, f(c));
        }
    }
    header(out, "corridor_card_books_bytes", "What corridor holds on the card, by purpose.", "gauge");
    for c in &m.cards {
        let b = &c.books;
        for (purpose, v) in [
            ("weights", b.weights),
            ("workspace", b.workspace),
            ("graphs", b.graphs),
            ("state", b.state),
            ("kv_committed", b.kv_committed),
            ("staging", b.staging),
            ("other", b.other),
        ] {
            let _ = writeln!(
                out,
                "corridor_card_books_bytes{{card=\"{}\",purpose=\"{purpose}\"}} {}",
                c.card.0,
                v.get()
            );
        }
    }
    single(
        out,
        "corridor_card_spread_bytes",
        "Max minus min free memory across cards.",
        "gauge",
        m.spread_bytes.get(),
    );
}

/// Renders every metric family as Prometheus text (format 0.0.4).
pub fn render(s: &Scrape<'_>) -> String {
    let mut out = String::with_capacity(4096);
    render_memory(&mut out, s.memory);
    let e = s.engine;
    single(&mut out, "corridor_requests_running", "Sequences in the running batch.", "gauge", e.running);
    single(&mut out, "corridor_requests_waiting", "Sequences queued for admission.", "gauge", e.waiting);

    header(&mut out, "corridor_kv_pages", "KV cache pages by state.", "gauge");
    let p = e.pages;
    for (state, n) in [("free", p.free), ("cached", p.cached), ("in_use", p.in_use), ("withheld", p.withheld)]
    {
        let _ = writeln!(out, "corridor_kv_pages{{state=\"{state}\"}} {n}");
    }
    single(&mut out, "corridor_kv_pages_capacity", "KV cache pages in the pool.", "gauge", p.capacity);
    single(&mut out, "corridor_kv_page_size_tokens", "Tokens per KV cache page.", "gauge", s.info.page_size);

    single(
        &mut out,
        "corridor_prefix_cache_lookup_tokens_total",
        "Prompt tokens looked up in the prefix cache.",
        "counter",
        e.prefix_lookup_tokens,
    );
    single(
        &mut out,
        "corridor_prefix_cache_hit_tokens_total",
        "Prompt tokens served from the prefix cache.",
        "counter",
        e.prefix_hit_tokens,
    );
    let hit_rate = if e.prefix_lookup_tokens == 0 {
        0.0
    } else {
        e.prefix_hit_tokens as f64 / e.prefix_lookup_tokens as f64
    };
    single(
        &mut out,
        "corridor_prefix_cache_hit_rate",
        "Share of looked-up prompt tokens found in the prefix cache, since start.",
        "gauge",
        hit_rate,
    );
    single(&mut out, "corridor_prompt_tokens_total", "Prompt tokens received.", "counter", e.prompt_tokens);
    single(&mut out, "corridor_generation_tokens_total", "Tokens generated.", "counter", e.generated_tokens);
    single(&mut out, "corridor_engine_steps_total", "Engine steps run.", "counter", e.steps);
    header(
        &mut out,
        "corridor_engine_step_seconds_total",
        "Seconds engine steps spent per phase: schedule (forming the step), forward (the model, up to logits on the host), sample (sampling and handing tokens on).",
        "counter",
    );
    for (phase, v) in
        [("schedule", e.schedule_seconds), ("forward", e.forward_seconds), ("sample", e.sample_seconds)]
    {
        let _ = writeln!(out, "corridor_engine_step_seconds_total{{phase=\"{phase}\"}} {v}");
    }
    single(
        &mut out,
        "corridor_preemptions_total",
        "Sequences preempted to free KV pages.",
        "counter",
        e.preemptions,
    );
    single(
        &mut out,
        "corridor_memory_preemptions_total",
        "Sequences preempted because running requests held more KV than the card kept above its floor.",
        "counter",
        e.memory_preemptions,
    );
    single(
        &mut out,
        "corridor_kv_pages_moved_total",
        "Live KV pages moved out of sparse chunks so the chunks could be released.",
        "counter",
        e.kv_pages_moved,
    );
    render_flips(&mut out, &e.flips);
    single(
        &mut out,
        "corridor_requests_aborted_total",
        "Sequences aborted (client gone or server shutting down).",
        "counter",
        e.aborted,
    );
    single(
        &mut out,
        "corridor_sequences_finished_total",
        "Sequences the engine finished.",
        "counter",
        e.finished,
    );

    header(&mut out, "corridor_http_requests_total", "Generation requests by outcome.", "counter");
    for (outcome, c) in
        [("completed", &s.server.completed), ("rejected", &s.server.rejected), ("failed", &s.server.failed)]
    {
        let _ = writeln!(
            out,
            "corridor_http_requests_total{{outcome=\"{outcome}\"}} {}",
            c.load(Ordering::Relaxed)
        );
    }
    single(
        &mut out,
        "corridor_stop_string_matches_total",
        "Choices ended by a stop string.",
        "counter",
        s.server.stop_string_hits.load(Ordering::Relaxed),
    );

    s.server.ttft.render(
        &mut out,
        "corridor_time_to_first_token_seconds",
        "Time from submission to the first token.",
    );
    s.server.itl.render(
        &mut out,
        "corridor_inter_token_latency_seconds",
        "Time between consecutive tokens of a sequence.",
    );

    header(
        &mut out,
        "corridor_sampler_fallbacks_total",
        "Sampled rows that fell back to argmax, by reason.",
        "counter",
    );
    for kind in FallbackKind::ALL {
        let _ = writeln!(
            out,
            "corridor_sampler_fallbacks_total{{kind=\"{}\"}} {}",
            kind.label(),
            s.sampler.fallbacks(kind)
        );
    }
    single(
        &mut out,
        "corridor_sampler_failed_rows_total",
        "Sampled rows that produced no valid token.",
        "counter",
        s.sampler.failed_rows(),
    );
    single(
        &mut out,
        "corridor_sampler_device_rows_total",
        "Rows drawn on the GPU (--device-sampling); the rest were sampled on the host.",
        "counter",
        s.sampler.device_rows(),
    );
    single(
        &mut out,
        "corridor_sampler_device_spilled_rows_total",
        "Rows sent to the GPU sampler whose candidate set did not fit it, drawn on the host instead.",
        "counter",
        s.sampler.device_spilled(),
    );
    single(
        &mut out,
        "corridor_context_length_tokens",
        "Longest sequence a request may use.",
        "gauge",
        s.info.context_len,
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_and_ends_with_inf() {
        let h = Histogram::new(&[0.1, 1.0]);
        h.observe(Duration::from_millis(50));
        h.observe(Duration::from_millis(500));
        h.observe(Duration::from_secs(5));
        let mut out = String::new();
        h.render(&mut out, "x", "help");
        assert!(out.contains("x_bucket{le=\"0.1\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"1\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 3\n"), "{out}");
        assert!(out.contains("x_count 3\n"), "{out}");
        assert!(out.contains("# TYPE x histogram\n"));
        assert_eq!(h.count(), 3);
    }
}
