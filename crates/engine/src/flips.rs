//! The engine's side of phase flips: asking the executor to flip between
//! steps, counting how flips end, turning flips off after repeated abandons,
//! and telling observers (the flight recorder) about each one.
//!
//! A flip runs on the engine thread between two steps, so the machinery is
//! quiesced by construction: no forward pass is in flight and every page a
//! step uses was allocated before that step ran. The workload is not
//! drained: the running requests' pages (and the cached prefixes') are the
//! live set the flip carries, and the next step runs them in the new layout.

use crate::executor::Executor;
use crate::phase::{FlipVerdict, Phase};
use corridor_units::{Bytes, PageId, Rank};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Abandons in a row after which flips turn themselves off.
pub const MAX_ABANDONS_IN_A_ROW: u32 = 3;

/// Who asked for a flip.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FlipTrigger {
    /// The admin endpoint.
    Manual,
    /// The policy (`--phase-flip auto`).
    Auto,
}

/// How flips are decided (`--phase-flip`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FlipMode {
    /// Never (a group that holds one layout).
    #[default]
    Off,
    /// Only when the admin endpoint asks.
    Manual,
    /// When the policy says so (and when the admin endpoint asks).
    Auto,
}

impl std::str::FromStr for FlipMode {
    type Err = String;
    fn from_str(s: &str) -> Result<FlipMode, String> {
        match s {
            "off" => Ok(FlipMode::Off),
            "manual" => Ok(FlipMode::Manual),
            "auto" => Ok(FlipMode::Auto),
            _ => Err(format!("'{s}' is not a flip mode: use off, manual or auto")),
        }
    }
}

impl std::fmt::Display for FlipMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FlipMode::Off => "off",
            FlipMode::Manual => "manual",
            FlipMode::Auto => "auto",
        })
    }
}

/// One flip, committed or abandoned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlipRecord {
    pub from: Phase,
    pub to: Phase,
    pub trigger: FlipTrigger,
    pub verdict: FlipVerdict,
    /// Live pages carried (or that would have been).
    pub pages: usize,
    /// Requests running at the flip, which go on in the new layout.
    pub requests: usize,
    pub duration: Duration,
    /// The most staging one rank reserved.
    pub staging: Bytes,
    pub wave_layers: usize,
    pub epoch: u64,
}

impl FlipRecord {
    pub fn committed(&self) -> bool {
        matches!(self.verdict, FlipVerdict::Committed(_))
    }
    /// KV bytes that crossed between ranks.
    pub fn bytes_moved(&self) -> Bytes {
        match &self.verdict {
            FlipVerdict::Committed(r) => r.sent,
            FlipVerdict::Abandoned(_) => Bytes::ZERO,
        }
    }
}

/// Why the engine did not try a flip at all.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FlipError {
    #[error("this server holds one layout; start it with --phase-flip manual or auto to flip")]
    NotFlipping,
    #[error("the group already serves in {0}")]
    AlreadyServing(Phase),
    #[error("flips are off after {0} abandoned flips in a row; restart to turn them on")]
    Disabled(u32),
    #[error("the engine has stopped")]
    Stopped,
    #[error("the flip failed before it started: {0}")]
    Failed(String),
}

/// Running totals of flips, for `/metrics` and `/v1/engine/stats`.
#[derive(Clone, Debug, Default)]
pub struct FlipStats {
    /// The layout that serves (`None`: the group holds one layout).
    pub serving: Option<Phase>,
    pub mode: FlipMode,
    pub to_tensor: u64,
    pub to_pipeline: u64,
    /// Abandons by reason label (see `AbandonReason::label`).
    pub abandoned: Vec<(&'static str, u64)>,
    pub bytes_moved: Bytes,
    pub requests_carried: u64,
    /// Committed flips' durations: cumulative counts at [`FLIP_BUCKETS`].
    pub duration_buckets: [u64; FLIP_BUCKETS.len()],
    pub duration_sum: Duration,
    pub disabled: bool,
    pub last: Option<FlipRecord>,
}

/// Upper bounds (seconds) of the flip-duration histogram.
pub const FLIP_BUCKETS: [f64; 8] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0];

impl FlipStats {
    fn note(&mut self, r: &FlipRecord) {
        match &r.verdict {
            FlipVerdict::Committed(done) => {
                match r.to {
                    Phase::Tensor => self.to_tensor += 1,
                    Phase::Pipeline => self.to_pipeline += 1,
                }
                self.bytes_moved += done.sent;
                self.requests_carried += r.requests as u64;
                let secs = r.duration.as_secs_f64();
                for (i, le) in FLIP_BUCKETS.iter().enumerate() {
                    if secs <= *le {
                        self.duration_buckets[i] += 1;
                    }
                }
                self.duration_sum += r.duration;
            }
            FlipVerdict::Abandoned(why) => {
                let label = why.label();
                match self.abandoned.iter_mut().find(|(l, _)| *l == label) {
                    Some((_, n)) => *n += 1,
                    None => self.abandoned.push((label, 1)),
                }
            }
        }
        self.last = Some(r.clone());
    }
    /// Committed flips.
    pub fn committed(&self) -> u64 {
        self.to_tensor + self.to_pipeline
    }
}

/// Something told about every flip (the server writes a flight-recorder
/// mark and a log line).
pub type FlipObserver = Arc<dyn Fn(&FlipRecord) + Send + Sync>;

/// The engine thread's flip state.
#[derive(Default)]
pub(crate) struct FlipControl {
    pub mode: FlipMode,
    abandons_in_a_row: u32,
    pub disabled: bool,
    pub last_flip: Option<Instant>,
    pub observers: Vec<FlipObserver>,
    pub stats: FlipStats,
}

impl FlipControl {
    /// Flip `exec` to `to`, carrying `live` and `requests`; counts, logs and
    /// tells the observers how it ended.
    pub fn flip(
        &mut self,
        exec: &mut dyn Executor,
        to: Phase,
        live: Vec<PageId>,
        requests: usize,
        trigger: FlipTrigger,
        skew_digest: Option<Rank>,
    ) -> Result<FlipRecord, FlipError> {
        let from = exec.phase().ok_or(FlipError::NotFlipping)?;
        if self.disabled {
            return Err(FlipError::Disabled(self.abandons_in_a_row));
        }
        if from == to {
            return Err(FlipError::AlreadyServing(to));
        }
        let pages = live.len();
        let started = Instant::now();
        let out = exec.flip(to, live, skew_digest).map_err(|e| FlipError::Failed(e.to_string()))?;
        let record = FlipRecord {
            from,
            to,
            trigger,
            verdict: out.verdict,
            pages,
            requests,
            duration: started.elapsed(),
            staging: out.staging,
            wave_layers: out.wave_layers,
            epoch: out.epoch,
        };
        self.last_flip = Some(Instant::now());
        match &record.verdict {
            FlipVerdict::Committed(done) => {
                self.abandons_in_a_row = 0;
                tracing::info!(
                    %from, %to, trigger = ?trigger, pages, requests,
                    moved = %done.sent, local = %done.local, waves = done.waves,
                    staging = %record.staging, ms = record.duration.as_secs_f64() * 1e3,
                    "phase flip committed"
                );
            }
            FlipVerdict::Abandoned(why) => {
                self.abandons_in_a_row += 1;
                tracing::warn!(%from, %to, trigger = ?trigger, pages, reason = %why, "phase flip abandoned; serving goes on in {from}");
                if self.abandons_in_a_row >= MAX_ABANDONS_IN_A_ROW {
                    self.disabled = true;
                    tracing::error!(
                        "phase flips turned off after {} abandoned flips in a row (the last: {why}); serving stays in {from}",
                        self.abandons_in_a_row
                    );
                }
            }
        }
        self.stats.note(&record);
        self.stats.disabled = self.disabled;
        for o in &self.observers {
            o(&record);
        }
        Ok(record)
    }
}
