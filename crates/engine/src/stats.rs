//! Counters and gauges the engine publishes after every step, read by the
//! server's `/metrics` without locking the engine loop for long.

use crate::flips::FlipStats;
use crate::pages::PoolCounts;
use crate::step_budget::StepCost;
use std::sync::Mutex;

/// A snapshot of the engine's state and running totals.
#[derive(Clone, Debug, Default)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub pages: PoolCounts,
    /// Prompt tokens looked up in the prefix cache, and those found there.
    pub prefix_lookup_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub preemptions: u64,
    /// KV pages moved between chunks to give memory back, and the
    /// preemptions made because running requests held more than the card
    /// kept (a subset of `preemptions`).
    pub kv_pages_moved: u64,
    pub memory_preemptions: u64,
    pub aborted: u64,
    pub finished: u64,
    /// Engine steps run, and the seconds they spent in each phase: forming
    /// the step, the forward pass (device work included, up to the logits on
    /// the host), and sampling plus handing tokens to their requests.
    pub steps: u64,
    pub schedule_seconds: f64,
    pub forward_seconds: f64,
    pub sample_seconds: f64,
    /// The inter-token-latency target that bounds prompt rows beside
    /// decodes (`None`: no bound), the step-time model it works from, and the
    /// steps that model has measured (0: still the prior).
    pub itl_target: Option<std::time::Duration>,
    /// The stall ratio beside it: a step with prompt rows at most this many
    /// times the decodes' own step (`None`: none).
    pub itl_stall_ratio: Option<f64>,
    pub step_cost: StepCost,
    pub step_cost_measured: u64,
    /// Phase flips of a group that holds two layouts.
    pub flips: FlipStats,
}

/// The shared cell behind `EngineHandle::stats`.
#[derive(Default)]
pub struct StatsCell(Mutex<EngineStats>);

impl StatsCell {
    pub fn snapshot(&self) -> EngineStats {
        self.0.lock().map(|s| s.clone()).unwrap_or_default()
    }
    pub(crate) fn publish(&self, f: impl FnOnce(&mut EngineStats)) {
        if let Ok(mut s) = self.0.lock() {
            f(&mut s);
        }
    }
    pub(crate) fn add_prompt_tokens(&self, n: usize) {
        self.publish(|s| s.prompt_tokens += n as u64);
    }
    pub(crate) fn add_generated(&self, n: usize) {
        self.publish(|s| s.generated_tokens += n as u64);
    }
    pub(crate) fn note_abort(&self) {
        self.publish(|s| s.aborted += 1);
    }
    pub(crate) fn add_step(&self, schedule: f64, forward: f64, sample: f64) {
        self.publish(|s| {
            s.steps += 1;
            s.schedule_seconds += schedule;
            s.forward_seconds += forward;
            s.sample_seconds += sample;
        });
    }
    pub(crate) fn note_give_back(&self, moved: usize, preempted: usize) {
        self.publish(|s| {
            s.kv_pages_moved += moved as u64;
            s.memory_preemptions += preempted as u64;
        });
    }
    pub(crate) fn note_finished(&self) {
        self.publish(|s| s.finished += 1);
    }
}
