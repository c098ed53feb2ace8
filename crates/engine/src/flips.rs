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
use crate::flip_policy::{decide, Decision, FlipCostMeter, PolicyInput, RateMeter};
use crate::phase::{FlipVerdict, Phase};
use crate::ranks::Calibration;
use corridor_units::{Bytes, PageId, Rank, Tokens};
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

/// How the engine decides flips (`EngineHandle::set_flips`).
#[derive(Clone, Default)]
pub struct FlipSettings {
    pub mode: FlipMode,
    /// The least time the group stays in a layout before `auto` flips it.
    pub min_dwell: Duration,
    /// Told about every flip.
    pub observer: Option<FlipObserver>,
    /// What the group measured of itself at boot (seeds the meters).
    pub calibration: Option<Calibration>,
}

/// The least time in a layout before `auto` flips again, by default.
pub const DEFAULT_MIN_DWELL: Duration = Duration::from_millis(500);
/// The flip cost `auto` assumes before any flip is measured.
pub const ESTIMATED_FLIP_COST: Duration = Duration::from_millis(50);

/// The engine thread's flip state.
pub(crate) struct FlipControl {
    pub mode: FlipMode,
    abandons_in_a_row: u32,
    pub disabled: bool,
    pub last_flip: Option<Instant>,
    pub observers: Vec<FlipObserver>,
    pub stats: FlipStats,
    min_dwell: Duration,
    /// Prefill rates by [`Phase::index`], and the flips' costs.
    rates: [RateMeter; 2],
    costs: FlipCostMeter,
    started: Instant,
}

impl Default for FlipControl {
    fn default() -> Self {
        FlipControl {
            mode: FlipMode::Off,
            abandons_in_a_row: 0,
            disabled: false,
            last_flip: None,
            observers: Vec::new(),
            stats: FlipStats::default(),
            min_dwell: DEFAULT_MIN_DWELL,
            rates: [RateMeter::new(), RateMeter::new()],
            costs: FlipCostMeter::new(),
            started: Instant::now(),
        }
    }
}

impl FlipControl {
    /// Take `settings`: the mode, the dwell, an observer, and the boot's
    /// measurements as the meters' first samples.
    pub fn configure(&mut self, settings: FlipSettings) {
        self.mode = settings.mode;
        self.min_dwell = settings.min_dwell;
        self.observers.extend(settings.observer);
        if let Some(cal) = settings.calibration {
            for phase in [Phase::Tensor, Phase::Pipeline] {
                for t in &cal.steps[phase.index()] {
                    self.rates[phase.index()].observe(Tokens(cal.rows), Tokens(0), *t);
                }
            }
            for (to, t) in cal.flips {
                self.costs.record(to, t);
            }
        }
    }

    /// Learn the serving layout's prefill rate from a step's forward pass.
    pub fn observe_step(&mut self, phase: Phase, prefill_rows: usize, decode_rows: usize, forward: Duration) {
        self.rates[phase.index()].observe(Tokens(prefill_rows), Tokens(decode_rows), forward);
    }

    /// What `auto` says now, from the same inputs every rank could see.
    pub fn decide(&self, phase: Phase, pending_prefill: Tokens) -> Decision {
        let since = self.last_flip.unwrap_or(self.started).elapsed();
        decide(&PolicyInput {
            phase,
            pending_prefill,
            tp_rate: self.rates[Phase::Tensor.index()].rate(),
            pp_rate: self.rates[Phase::Pipeline.index()].rate(),
            flip_cost: self.costs.round_trip().map(|rt| rt / 2),
            estimated_cost: ESTIMATED_FLIP_COST,
            since_last_flip: since,
            min_dwell: self.min_dwell,
            disabled: self.disabled,
        })
    }

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
                self.costs.record(to, record.duration);
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
