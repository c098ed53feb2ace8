//! When a group that holds both a tensor-parallel and a pipeline layout
//! should flip between them (`--phase-flip auto`).
//!
//! The trade-off: on cards joined by a slow link, a pipeline prefills faster
//! (activations cross the link once per stage) and tensor parallelism decodes
//! faster (every card works on every token). A flip stalls the group for `C`
//! seconds, so it pays only when enough prompt tokens are waiting. Prefilling
//! `n` tokens costs `n / X` seconds in TP and `n / P + C` in PP (X and P the
//! layouts' prefill rates), so PP wins once `n` exceeds
//!
//! ```text
//! N = C / (1/X - 1/P) = C·X·P / (P - X)
//! ```
//!
//! The group rests in TP, flips to PP when the pending prefill exceeds N,
//! and flips back once it has drained; each layout is held for a minimum
//! dwell, so a burst at the boundary cannot make the group flap. Where the
//! pipeline is not faster (`P <= X`), or a rate has not been measured yet,
//! there is no N and the group stays in TP.
//!
//! [`decide`] is a pure function of its input: no clock, no randomness, no
//! state. Every rank that is handed the same [`PolicyInput`] (built from
//! replicated or reduced values) reaches the same [`Decision`], so the
//! decision can be proposed by every rank and agreed on without a leader.
//!
//! The meters ([`RateMeter`], [`FlipCostMeter`]) learn the inputs: a layout's
//! prefill rate from the steps it runs, and the cost of the flips made.

use corridor_units::Tokens;
use std::fmt;
use std::time::Duration;

pub use crate::phase::Phase;

/// What [`decide`] looks at. Every field must be the same on every rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PolicyInput {
    /// The layout the group runs in now.
    pub phase: Phase,
    /// Prompt tokens admitted or waiting whose KV is not computed yet.
    pub pending_prefill: Tokens,
    /// Measured prefill rate in TP, tokens per second (`None`: not yet).
    pub tp_rate: Option<f64>,
    /// Measured prefill rate in PP, tokens per second (`None`: not yet).
    pub pp_rate: Option<f64>,
    /// The measured cost of a flip to PP, counting the flip back that it
    /// commits the group to (the round trip, see
    /// [`FlipCostMeter::round_trip`]). `None` before any flip.
    pub flip_cost: Option<Duration>,
    /// The cost assumed while `flip_cost` is `None`.
    pub estimated_cost: Duration,
    /// Time since the last flip (or since boot).
    pub since_last_flip: Duration,
    /// The least time the group holds a layout before it flips again.
    pub min_dwell: Duration,
    /// The flip has turned itself off (after repeated abandons): never flip.
    pub disabled: bool,
}

/// The break-even pending prefill N and what it was computed from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Threshold {
    /// N rounded down: a pending prefill above this many tokens flips to PP
    /// (for a whole number of tokens, `pending > floor(N)` iff `pending > N`).
    pub tokens: Tokens,
    /// C, the flip cost used.
    pub cost: Duration,
    /// Whether `cost` was measured (else it is the caller's estimate).
    pub cost_measured: bool,
    /// X, tokens per second.
    pub tp_rate: f64,
    /// P, tokens per second.
    pub pp_rate: f64,
}

impl fmt::Display for Threshold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "N = {} (C {:.3} s {}, X {:.1} tok/s, P {:.1} tok/s)",
            self.tokens,
            self.cost.as_secs_f64(),
            if self.cost_measured { "measured" } else { "estimated" },
            self.tp_rate,
            self.pp_rate
        )
    }
}

/// Why [`decide`] decided what it did, for the log line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Reason {
    /// The flip has turned itself off.
    Disabled,
    /// The layout has not been held for the minimum dwell yet.
    Dwell { since: Duration, min: Duration },
    /// A prefill rate is not measured yet, so there is no N.
    RateUnknown { tp_rate: Option<f64>, pp_rate: Option<f64> },
    /// The pipeline does not prefill faster than TP: no pending prefill
    /// makes a flip pay.
    PipelineNotFaster { tp_rate: f64, pp_rate: f64 },
    /// In TP, the pending prefill is at or below N.
    BelowThreshold { pending: Tokens, threshold: Threshold },
    /// In TP, the pending prefill exceeds N: flip to PP.
    AboveThreshold { pending: Tokens, threshold: Threshold },
    /// In PP, prompt tokens are still pending.
    Prefilling { pending: Tokens },
    /// In PP, the pending prefill has drained: back to TP.
    Drained,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rate = |r: Option<f64>| r.map_or("unknown".to_string(), |r| format!("{r:.1} tok/s"));
        match self {
            Reason::Disabled => write!(f, "the flip is disabled"),
            Reason::Dwell { since, min } => {
                write!(f, "held {:.3} s of the {:.3} s minimum dwell", since.as_secs_f64(), min.as_secs_f64())
            }
            Reason::RateUnknown { tp_rate, pp_rate } => {
                write!(f, "prefill rate not measured yet (TP {}, PP {})", rate(*tp_rate), rate(*pp_rate))
            }
            Reason::PipelineNotFaster { tp_rate, pp_rate } => {
                write!(f, "PP prefills no faster than TP ({pp_rate:.1} <= {tp_rate:.1} tok/s)")
            }
            Reason::BelowThreshold { pending, threshold } => {
                write!(f, "pending prefill {pending} is not above {threshold}")
            }
            Reason::AboveThreshold { pending, threshold } => {
                write!(f, "pending prefill {pending} exceeds {threshold}")
            }
            Reason::Prefilling { pending } => write!(f, "{pending} of prefill still pending"),
            Reason::Drained => write!(f, "pending prefill has drained"),
        }
    }
}

/// What the group should do now.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decision {
    Stay(Reason),
    Flip { to: Phase, reason: Reason },
}

impl Decision {
    pub fn reason(&self) -> &Reason {
        match self {
            Decision::Stay(r) | Decision::Flip { reason: r, .. } => r,
        }
    }
    /// The layout to flip to, if any.
    pub fn flip_to(&self) -> Option<Phase> {
        match self {
            Decision::Stay(_) => None,
            Decision::Flip { to, .. } => Some(*to),
        }
    }
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Decision::Stay(r) => write!(f, "stay: {r}"),
            Decision::Flip { to, reason } => write!(f, "flip to {to}: {reason}"),
        }
    }
}

/// N for cost `cost` and rates `x` (TP) and `p` (PP), or `None` where the
/// pipeline is not faster or a rate is not a positive number.
///
/// Computed as `C·X·P / (P - X)`, which is the same N as `C / (1/X - 1/P)`
/// with one rounding fewer; an N beyond the token range saturates.
pub fn threshold(cost: Duration, x: f64, p: f64) -> Option<Tokens> {
    if !(x.is_finite() && p.is_finite() && x > 0.0 && p > x) {
        return None;
    }
    let n = cost.as_secs_f64() * x * p / (p - x);
    // `as` saturates: a huge N (P barely above X) means "never".
    Some(Tokens(n.floor() as usize))
}

/// The policy: what a group in `input.phase` should do now. Pure: the same
/// input gives the same decision on every rank.
pub fn decide(input: &PolicyInput) -> Decision {
    if input.disabled {
        return Decision::Stay(Reason::Disabled);
    }
    if input.since_last_flip < input.min_dwell {
        return Decision::Stay(Reason::Dwell { since: input.since_last_flip, min: input.min_dwell });
    }
    let pending = input.pending_prefill;
    match input.phase {
        Phase::Pipeline if pending.get() == 0 => {
            Decision::Flip { to: Phase::Tensor, reason: Reason::Drained }
        }
        Phase::Pipeline => Decision::Stay(Reason::Prefilling { pending }),
        Phase::Tensor => {
            let (Some(x), Some(p)) = (input.tp_rate, input.pp_rate) else {
                return Decision::Stay(Reason::RateUnknown {
                    tp_rate: input.tp_rate,
                    pp_rate: input.pp_rate,
                });
            };
            let cost = input.flip_cost.unwrap_or(input.estimated_cost);
            let Some(tokens) = threshold(cost, x, p) else {
                return Decision::Stay(Reason::PipelineNotFaster { tp_rate: x, pp_rate: p });
            };
            let threshold =
                Threshold { tokens, cost, cost_measured: input.flip_cost.is_some(), tp_rate: x, pp_rate: p };
            if pending > tokens {
                Decision::Flip { to: Phase::Pipeline, reason: Reason::AboveThreshold { pending, threshold } }
            } else {
                Decision::Stay(Reason::BelowThreshold { pending, threshold })
            }
        }
    }
}

/// Learns one layout's prefill rate (tokens per second) from the steps it
/// runs.
///
/// Only steps that are mostly prefill count: a step's time is shared by its
/// decode rows, and a step of a handful of rows measures launch overhead, not
/// the prefill rate. The meter keeps exponentially weighted sums of prefill
/// tokens and of seconds and reports their ratio, so a long step weighs as
/// much as the time it took (a mean of per-step rates would let short steps
/// dominate).
#[derive(Clone, Debug)]
pub struct RateMeter {
    /// Weight of the newest step, in (0, 1].
    weight: f64,
    tokens: f64,
    seconds: f64,
    samples: u64,
}

impl Default for RateMeter {
    fn default() -> Self {
        RateMeter::new()
    }
}

impl RateMeter {
    /// The weight of each new step by default.
    pub const DEFAULT_WEIGHT: f64 = 0.2;
    /// A step counts when at least this share of its rows is prefill.
    pub const MOSTLY_PREFILL: f64 = 0.75;
    /// ... and it carries at least this many prefill rows.
    pub const MIN_PREFILL_ROWS: usize = 32;
    /// Steps counted before [`rate`](RateMeter::rate) answers.
    pub const MIN_SAMPLES: u64 = 3;

    pub fn new() -> RateMeter {
        RateMeter::with_weight(Self::DEFAULT_WEIGHT)
    }

    /// A meter whose newest step weighs `weight` (clamped into (0, 1]).
    pub fn with_weight(weight: f64) -> RateMeter {
        let weight = if weight.is_finite() { weight.clamp(f64::MIN_POSITIVE, 1.0) } else { 1.0 };
        RateMeter { weight, tokens: 0.0, seconds: 0.0, samples: 0 }
    }

    /// Learn from one step of `prefill_rows` prompt rows and `decode_rows`
    /// decode rows that took `elapsed`. Returns whether it counted.
    pub fn observe(&mut self, prefill_rows: Tokens, decode_rows: Tokens, elapsed: Duration) -> bool {
        let (pre, dec) = (prefill_rows.get(), decode_rows.get());
        let mostly = pre as f64 >= Self::MOSTLY_PREFILL * (pre + dec) as f64;
        if pre < Self::MIN_PREFILL_ROWS || !mostly || elapsed.is_zero() {
            return false;
        }
        let w = if self.samples == 0 { 1.0 } else { self.weight };
        self.tokens = (1.0 - w) * self.tokens + w * pre as f64;
        self.seconds = (1.0 - w) * self.seconds + w * elapsed.as_secs_f64();
        self.samples += 1;
        true
    }

    /// Tokens per second, once enough steps have counted.
    pub fn rate(&self) -> Option<f64> {
        (self.samples >= Self::MIN_SAMPLES && self.seconds > 0.0).then(|| self.tokens / self.seconds)
    }

    /// Steps counted so far.
    pub fn samples(&self) -> u64 {
        self.samples
    }
}

/// The mean measured cost of the flips made, per direction.
#[derive(Clone, Debug, Default)]
pub struct FlipCostMeter {
    /// (flips, total seconds) into TP and into PP.
    to_tensor: (u64, f64),
    to_pipeline: (u64, f64),
}

impl FlipCostMeter {
    pub fn new() -> FlipCostMeter {
        FlipCostMeter::default()
    }

    fn slot(&mut self, to: Phase) -> &mut (u64, f64) {
        match to {
            Phase::Tensor => &mut self.to_tensor,
            Phase::Pipeline => &mut self.to_pipeline,
        }
    }

    /// A completed flip into `to` that took `took` (abandoned flips cost
    /// time too, but say nothing about what a flip that commits costs).
    pub fn record(&mut self, to: Phase, took: Duration) {
        let s = self.slot(to);
        s.0 += 1;
        s.1 += took.as_secs_f64();
    }

    /// Completed flips into `to`.
    pub fn count(&self, to: Phase) -> u64 {
        match to {
            Phase::Tensor => self.to_tensor.0,
            Phase::Pipeline => self.to_pipeline.0,
        }
    }

    /// The mean cost of a flip into `to`, if one was made.
    pub fn mean(&self, to: Phase) -> Option<Duration> {
        let (n, secs) = match to {
            Phase::Tensor => self.to_tensor,
            Phase::Pipeline => self.to_pipeline,
        };
        (n > 0).then(|| Duration::from_secs_f64(secs / n as f64))
    }

    /// What a flip to PP costs with the flip back it commits the group to:
    /// the sum of both directions' means. A direction not measured yet is
    /// taken to cost what the other does (both move the same KV and weights).
    /// `None` before any flip.
    pub fn round_trip(&self) -> Option<Duration> {
        match (self.mean(Phase::Pipeline), self.mean(Phase::Tensor)) {
            (Some(a), Some(b)) => Some(a + b),
            (Some(one), None) | (None, Some(one)) => Some(one * 2),
            (None, None) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    /// A group that has rested in TP past its dwell, with PP twice as fast
    /// and a 1 s flip measured: N = 1 · 1000 · 2000 / 1000 = 2000 tokens.
    fn base() -> PolicyInput {
        PolicyInput {
            phase: Phase::Tensor,
            pending_prefill: Tokens(0),
            tp_rate: Some(1000.0),
            pp_rate: Some(2000.0),
            flip_cost: Some(S(1)),
            estimated_cost: S(4),
            since_last_flip: S(10),
            min_dwell: S(3),
            disabled: false,
        }
    }

    /// What each row expects: stay (with the reason's kind) or flip to.
    #[derive(Debug, PartialEq)]
    enum Want {
        Stay(&'static str),
        Flip(Phase, &'static str),
    }

    fn kind(r: &Reason) -> &'static str {
        match r {
            Reason::Disabled => "disabled",
            Reason::Dwell { .. } => "dwell",
            Reason::RateUnknown { .. } => "rate-unknown",
            Reason::PipelineNotFaster { .. } => "pp-not-faster",
            Reason::BelowThreshold { .. } => "below",
            Reason::AboveThreshold { .. } => "above",
            Reason::Prefilling { .. } => "prefilling",
            Reason::Drained => "drained",
        }
    }

    fn got(d: &Decision) -> Want {
        match d {
            Decision::Stay(r) => Want::Stay(kind(r)),
            Decision::Flip { to, reason } => Want::Flip(*to, kind(reason)),
        }
    }

    #[test]
    fn decision_table() {
        use Phase::{Pipeline as PP, Tensor as TP};
        let rows: Vec<(&str, PolicyInput, Want)> = vec![
            ("TP, nothing pending", base(), Want::Stay("below")),
            ("TP, N exactly", PolicyInput { pending_prefill: Tokens(2000), ..base() }, Want::Stay("below")),
            (
                "TP, one token past N",
                PolicyInput { pending_prefill: Tokens(2001), ..base() },
                Want::Flip(PP, "above"),
            ),
            (
                "TP, far past N",
                PolicyInput { pending_prefill: Tokens(50_000), ..base() },
                Want::Flip(PP, "above"),
            ),
            (
                "TP, P equal to X",
                PolicyInput { pending_prefill: Tokens(1 << 30), pp_rate: Some(1000.0), ..base() },
                Want::Stay("pp-not-faster"),
            ),
            (
                "TP, P below X",
                PolicyInput { pending_prefill: Tokens(1 << 30), pp_rate: Some(900.0), ..base() },
                Want::Stay("pp-not-faster"),
            ),
            (
                "TP, PP rate unknown",
                PolicyInput { pending_prefill: Tokens(1 << 30), pp_rate: None, ..base() },
                Want::Stay("rate-unknown"),
            ),
            (
                "TP, TP rate unknown",
                PolicyInput { pending_prefill: Tokens(1 << 30), tp_rate: None, ..base() },
                Want::Stay("rate-unknown"),
            ),
            (
                "TP, inside the dwell",
                PolicyInput { pending_prefill: Tokens(50_000), since_last_flip: S(2), ..base() },
                Want::Stay("dwell"),
            ),
            (
                "TP, dwell just served",
                PolicyInput { pending_prefill: Tokens(50_000), since_last_flip: S(3), ..base() },
                Want::Flip(PP, "above"),
            ),
            (
                "TP, disabled",
                PolicyInput { pending_prefill: Tokens(50_000), disabled: true, ..base() },
                Want::Stay("disabled"),
            ),
            // No flip measured: the 4 s estimate makes N = 8000.
            (
                "TP, estimated cost, below its N",
                PolicyInput { pending_prefill: Tokens(8000), flip_cost: None, ..base() },
                Want::Stay("below"),
            ),
            (
                "TP, estimated cost, above its N",
                PolicyInput { pending_prefill: Tokens(8001), flip_cost: None, ..base() },
                Want::Flip(PP, "above"),
            ),
            ("PP, drained", PolicyInput { phase: PP, ..base() }, Want::Flip(TP, "drained")),
            (
                "PP, still prefilling",
                PolicyInput { phase: PP, pending_prefill: Tokens(1), ..base() },
                Want::Stay("prefilling"),
            ),
            (
                "PP, drained inside the dwell",
                PolicyInput { phase: PP, since_last_flip: S(1), ..base() },
                Want::Stay("dwell"),
            ),
            (
                "PP, drained but disabled",
                PolicyInput { phase: PP, disabled: true, ..base() },
                Want::Stay("disabled"),
            ),
            (
                "PP, drained with rates unknown",
                PolicyInput { phase: PP, tp_rate: None, pp_rate: None, ..base() },
                Want::Flip(TP, "drained"),
            ),
        ];
        for (name, input, want) in rows {
            let d = decide(&input);
            assert_eq!(got(&d), want, "{name}: {d}");
            assert_eq!(decide(&input), d, "{name}: the same input decides the same");
        }
    }

    #[test]
    fn n_is_cost_over_the_time_saved_per_token() {
        // The worked example of the design notes: C 5.918 s, X 1354.4,
        // P 4036 tok/s give N = 12063.66 (12064 rounded to nearest).
        let n = threshold(Duration::from_secs_f64(5.918), 1354.4, 4036.0).unwrap();
        let direct: f64 = 5.918 / (1.0 / 1354.4 - 1.0 / 4036.0);
        assert_eq!(n, Tokens(direct.floor() as usize));
        assert_eq!(n, Tokens(12063));
        // Halving the time saved per token doubles N.
        assert_eq!(threshold(S(1), 1000.0, 2000.0), Some(Tokens(2000)));
        assert_eq!(threshold(S(2), 1000.0, 2000.0), Some(Tokens(4000)));
        // A zero-cost flip pays for any prefill at all.
        assert_eq!(threshold(Duration::ZERO, 1000.0, 2000.0), Some(Tokens(0)));
        let d =
            decide(&PolicyInput { flip_cost: Some(Duration::ZERO), pending_prefill: Tokens(1), ..base() });
        assert_eq!(d.flip_to(), Some(Phase::Pipeline), "{d}");
        // No N where it cannot pay or a rate is nonsense.
        assert_eq!(threshold(S(1), 1000.0, 1000.0), None);
        assert_eq!(threshold(S(1), 0.0, 1000.0), None);
        assert_eq!(threshold(S(1), 1000.0, f64::NAN), None);
        // P barely above X: N saturates rather than wrapping.
        assert_eq!(threshold(S(1_000_000), 1.0e9, 1.0e9 + 1.0), Some(Tokens(usize::MAX)));
    }

    #[test]
    fn reasons_print_what_decided_them() {
        let d = decide(&PolicyInput { pending_prefill: Tokens(2001), ..base() });
        let line = d.to_string();
        assert!(line.starts_with("flip to pp"), "{line}");
        assert!(line.contains("2001 tokens") && line.contains("N = 2000 tokens"), "{line}");
        assert!(line.contains("measured"), "{line}");
        let est = decide(&PolicyInput { flip_cost: None, ..base() }).to_string();
        assert!(est.contains("N = 8000 tokens") && est.contains("estimated"), "{est}");
        let slow = decide(&PolicyInput { pp_rate: Some(500.0), ..base() }).to_string();
        assert!(slow.contains("500.0 <= 1000.0"), "{slow}");
    }

    #[test]
    fn phase_parses_and_prints() {
        for p in [Phase::Tensor, Phase::Pipeline] {
            assert_eq!(p.to_string().parse::<Phase>(), Ok(p));
            assert_eq!(p.other().other(), p);
        }
        assert_eq!(" PP ".parse::<Phase>(), Ok(Phase::Pipeline));
        let e = "dp".parse::<Phase>().unwrap_err();
        assert!(e.to_string().contains("'dp'"), "{e}");
    }

    #[test]
    fn rate_meter_counts_only_mostly_prefill_steps() {
        let ms = Duration::from_millis;
        let mut m = RateMeter::with_weight(0.5);
        // Decode-heavy and tiny steps say nothing about the prefill rate.
        assert!(!m.observe(Tokens(100), Tokens(100), ms(10)));
        assert!(!m.observe(Tokens(8), Tokens(0), ms(1)));
        assert!(!m.observe(Tokens(512), Tokens(0), Duration::ZERO));
        assert_eq!(m.samples(), 0);
        // 512 rows in 0.5 s: 1024 tok/s, but only after MIN_SAMPLES steps.
        assert!(m.observe(Tokens(512), Tokens(0), ms(500)));
        assert!(m.observe(Tokens(500), Tokens(12), ms(500 * 500 / 512)));
        assert_eq!(m.rate(), None);
        assert!(m.observe(Tokens(256), Tokens(0), ms(250)));
        let r = m.rate().unwrap();
        assert!((r - 1024.0).abs() < 2.0, "{r}");
        // The rate follows a slowdown: every step at 512 tok/s now.
        for _ in 0..30 {
            m.observe(Tokens(512), Tokens(0), ms(1000));
        }
        let r = m.rate().unwrap();
        assert!((r - 512.0).abs() < 1.0, "{r}");
    }

    #[test]
    fn rate_meter_weighs_steps_by_their_time() {
        // One long step at 1000 tok/s and one short at 4000 tok/s, equally
        // weighted sums: (1000 + 400) tokens over (1 + 0.1) s, not the mean
        // of the two rates.
        let mut m = RateMeter::with_weight(0.5);
        m.observe(Tokens(1000), Tokens(0), Duration::from_secs(1));
        m.observe(Tokens(400), Tokens(0), Duration::from_millis(100));
        m.observe(Tokens(1000), Tokens(0), Duration::from_secs(1));
        // Sums: tokens 0.5·(0.5·1000 + 0.5·400) + 0.5·1000 = 850,
        // seconds 0.5·(0.5·1 + 0.5·0.1) + 0.5·1 = 0.775.
        let r = m.rate().unwrap();
        assert!((r - 850.0 / 0.775).abs() < 1e-6, "{r}");
    }

    #[test]
    fn flip_cost_meter_means_per_direction_and_round_trip() {
        let mut m = FlipCostMeter::new();
        assert_eq!(m.round_trip(), None);
        m.record(Phase::Pipeline, Duration::from_millis(1000));
        assert_eq!(m.round_trip(), Some(Duration::from_millis(2000)), "one direction stands for both");
        m.record(Phase::Pipeline, Duration::from_millis(2000));
        m.record(Phase::Tensor, Duration::from_millis(500));
        assert_eq!(m.count(Phase::Pipeline), 2);
        assert_eq!(m.mean(Phase::Pipeline), Some(Duration::from_millis(1500)));
        assert_eq!(m.mean(Phase::Tensor), Some(Duration::from_millis(500)));
        assert_eq!(m.round_trip(), Some(Duration::from_millis(2000)));
        // Fed to the policy, the measured cost replaces the estimate.
        let d = decide(&PolicyInput { flip_cost: m.round_trip(), pending_prefill: Tokens(3999), ..base() });
        assert!(
            matches!(d.reason(), Reason::BelowThreshold { threshold, .. } if threshold.tokens == Tokens(4000)),
            "{d}"
        );
    }
}
