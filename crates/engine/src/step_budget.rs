//! How many prompt (prefill) rows a step may carry while decodes run: the bound on the stall.
//!
//! Every running request waits for the whole step before its next token, so a running stream's
//! inter-token latency (ITL) is the time of the step it rode in. A step that carries a long prompt
//! chunk beside the decodes is a stall for every one of them. The trade-off is between two people:
//! fewer prefill rows per mixed step bound the ITL of those already streaming, but spread a new
//! prompt over more steps, so its time to first token (TTFT) grows; more rows fill the GEMMs and
//! finish prompts sooner, but stretch every running stream's token gap.
//!
//! The rule: predict a step's time with a linear model (a fixed cost per step, plus a cost per
//! prefill token, plus a cost per decode row) and give prefill the most rows that keep the
//! predicted step within the ITL target beside the decodes that are running. Never fewer than a
//! floor, so a prompt always progresses however many decodes run (the target is then missed, by
//! the floor's cost, rather than a prompt starved); and a step with no decode running takes the
//! whole `max_batched_tokens`, since no stream waits on it and a prompt then prefills at the GEMM's
//! full rate.
//!
//! The model is fitted to the measured step times by least squares, with old steps forgotten
//! geometrically so it follows a card whose speed changes (clocks, a neighbour, longer contexts).
//! Until steps are measured, a conservative prior stands in: it assumes slow steps, so the first
//! mixed steps carry small chunks, and the fit loosens them as soon as it knows better. The prior
//! stays in the fit as three imagined steps of small weight, which keeps the fit defined when the
//! measured steps do not vary enough to tell the three costs apart (all decode, say).
//!
//! Pure arithmetic: no clock, no engine; the engine hands in the measurements.

use std::time::Duration;

/// Prefill rows a mixed step always gets, so prompts progress under any number of decodes.
pub const MIN_PREFILL_ROWS: usize = 16;

/// The default inter-token-latency target (the server's `--itl-target-ms`).
pub const DEFAULT_ITL_TARGET: Duration = Duration::from_millis(50);

/// Weight kept by a measurement per newer one: about the last 50 steps make the fit.
const FORGET: f64 = 0.98;

/// Weight of each of the prior's three imagined steps, against up to 1 / (1 - FORGET) = 50 of
/// measured ones: it decides only what the measured steps leave open (a cost they never vary),
/// and pulls what they do measure by a few percent at most, even when the prior is 4× off.
const PRIOR_WEIGHT: f64 = 0.01;

/// The shapes of the prior's imagined steps: one empty, one prefill chunk, one decode batch, so
/// each cost of the prior is pinned by one of them.
const PRIOR_PREFILL_ROWS: f64 = 256.0;
const PRIOR_DECODE_ROWS: f64 = 32.0;

/// What a step carries, as the cost model sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepShape {
    /// Rows of prompts being prefilled (several sequences together).
    pub prefill_rows: usize,
    /// Running sequences decoding one token each.
    pub decode_rows: usize,
}

/// A step's time as a linear function of its shape.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepCost {
    /// Paid by every step whatever it carries (weights read once, launches, host work).
    pub fixed: Duration,
    pub per_prefill_row: Duration,
    pub per_decode_row: Duration,
}

impl StepCost {
    /// A deliberately slow guess for before any step is measured: 10 ms a step, 0.2 ms a prefill
    /// row and 0.2 ms a decode row (a GPU running an 8B model is well under half of each), so the
    /// first mixed steps err on the side of the running streams.
    pub const CONSERVATIVE: StepCost = StepCost {
        fixed: Duration::from_millis(10),
        per_prefill_row: Duration::from_micros(200),
        per_decode_row: Duration::from_micros(200),
    };

    /// The predicted time of a step of this shape.
    pub fn predict(&self, shape: StepShape) -> Duration {
        self.fixed
            + self.per_prefill_row * shape.prefill_rows as u32
            + self.per_decode_row * shape.decode_rows as u32
    }

    fn as_secs(&self) -> [f64; 3] {
        [self.fixed.as_secs_f64(), self.per_prefill_row.as_secs_f64(), self.per_decode_row.as_secs_f64()]
    }

    /// From seconds; a cost the fit drove negative (noise, or a card that is not linear) is read
    /// as zero, never as time gained.
    fn from_secs(secs: [f64; 3]) -> StepCost {
        let d = |s: f64| Duration::from_secs_f64(if s.is_finite() { s.max(0.0) } else { 0.0 });
        StepCost { fixed: d(secs[0]), per_prefill_row: d(secs[1]), per_decode_row: d(secs[2]) }
    }
}

/// The step-budget rule and the cost model it learns.
#[derive(Clone, Debug)]
pub struct StepBudget {
    /// `None`: no bound; every step may take the whole `max_batched_tokens`.
    target: Option<Duration>,
    floor: usize,
    prior: StepCost,
    /// Forgetting sums of the least-squares normal equations over measured steps, with
    /// x = [1, prefill rows, decode rows] and y = seconds: `xx` = Σ w·x·xᵀ, `xy` = Σ w·x·y.
    xx: [[f64; 3]; 3],
    xy: [f64; 3],
    measured: u64,
    /// The fit of the sums above (the prior until a step is measured).
    cost: StepCost,
}

impl StepBudget {
    /// The rule with the conservative prior and the default floor.
    pub fn new(target: Option<Duration>) -> StepBudget {
        StepBudget::with_prior(target, MIN_PREFILL_ROWS, StepCost::CONSERVATIVE)
    }

    /// The rule with a chosen floor and prior (tests, and a caller that knows its card). A zero
    /// target means no bound, like `None`.
    pub fn with_prior(target: Option<Duration>, floor: usize, prior: StepCost) -> StepBudget {
        StepBudget {
            target: target.filter(|t| !t.is_zero()),
            floor,
            prior,
            xx: [[0.0; 3]; 3],
            xy: [0.0; 3],
            measured: 0,
            cost: prior,
        }
    }

    pub fn target(&self) -> Option<Duration> {
        self.target
    }

    /// The current model of a step's time.
    pub fn cost(&self) -> StepCost {
        self.cost
    }

    /// Steps measured so far.
    pub fn measured(&self) -> u64 {
        self.measured
    }

    /// The most prefill rows the next step may carry beside `decode_rows` running decodes, out of
    /// a step of `max_batched_tokens` rows.
    pub fn prefill_rows(&self, decode_rows: usize, max_batched_tokens: usize) -> usize {
        let Some(target) = self.target else { return max_batched_tokens };
        if decode_rows == 0 {
            return max_batched_tokens;
        }
        let room = max_batched_tokens.saturating_sub(decode_rows);
        let decodes = self.cost.predict(StepShape { prefill_rows: 0, decode_rows });
        let left = target.saturating_sub(decodes).as_nanos();
        // Rounded down: a row that would cross the target is not taken. A
        // prompt row the fit finds free (no division) fits without limit.
        let fits = match left.checked_div(self.cost.per_prefill_row.as_nanos()) {
            Some(rows) => usize::try_from(rows).unwrap_or(usize::MAX).min(room),
            None => room,
        };
        fits.max(self.floor).min(room)
    }

    /// Learn from a step that carried `shape` and took `took`, from forming it to its tokens
    /// handed out (what a decoding stream waited).
    pub fn observe(&mut self, shape: StepShape, took: Duration) {
        if shape.prefill_rows + shape.decode_rows == 0 {
            return;
        }
        let x = [1.0, shape.prefill_rows as f64, shape.decode_rows as f64];
        let y = took.as_secs_f64();
        for i in 0..3 {
            for j in 0..3 {
                self.xx[i][j] = FORGET * self.xx[i][j] + x[i] * x[j];
            }
            self.xy[i] = FORGET * self.xy[i] + x[i] * y;
        }
        self.measured += 1;
        self.cost = self.fit();
    }

    /// Solve the normal equations with the prior's imagined steps added.
    fn fit(&self) -> StepCost {
        let mut a = self.xx;
        let mut b = self.xy;
        let p = self.prior.as_secs();
        let imagined = [
            ([1.0, 0.0, 0.0], p[0]),
            ([1.0, PRIOR_PREFILL_ROWS, 0.0], p[0] + PRIOR_PREFILL_ROWS * p[1]),
            ([1.0, 0.0, PRIOR_DECODE_ROWS], p[0] + PRIOR_DECODE_ROWS * p[2]),
        ];
        for (x, y) in imagined {
            for i in 0..3 {
                for j in 0..3 {
                    a[i][j] += PRIOR_WEIGHT * x[i] * x[j];
                }
                b[i] += PRIOR_WEIGHT * x[i] * y;
            }
        }
        match solve3(a, b) {
            Some(secs) => StepCost::from_secs(secs),
            None => self.cost,
        }
    }
}

/// Solve `a · x = b` for a 3×3 system by Gaussian elimination with partial pivoting; `None` when
/// it is singular (it is not, with the prior's steps in it, but the arithmetic says so itself).
fn solve3(mut a: [[f64; 3]; 3], mut b: [f64; 3]) -> Option<[f64; 3]> {
    for col in 0..3 {
        let pivot = (col..3).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        let pivot_row = a[col];
        for row in col + 1..3 {
            let f = a[row][col] / pivot_row[col];
            for (k, v) in a[row].iter_mut().enumerate().skip(col) {
                *v -= f * pivot_row[k];
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; 3];
    for row in (0..3).rev() {
        let rest: f64 = (row + 1..3).map(|k| a[row][k] * x[k]).sum();
        x[row] = (b[row] - rest) / a[row][row];
    }
    Some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// 5 ms a step, 0.1 ms a prefill row, 0.5 ms a decode row.
    const KNOWN: StepCost = StepCost {
        fixed: Duration::from_millis(5),
        per_prefill_row: Duration::from_micros(100),
        per_decode_row: Duration::from_micros(500),
    };

    fn known(target_ms: u64) -> StepBudget {
        StepBudget::with_prior(Some(ms(target_ms)), 16, KNOWN)
    }

    #[test]
    fn no_running_decodes_take_the_whole_budget() {
        assert_eq!(known(50).prefill_rows(0, 512), 512);
        // However tight the target: nobody waits on a prefill-only step.
        assert_eq!(known(1).prefill_rows(0, 512), 512);
    }

    #[test]
    fn decodes_leave_prefill_what_the_target_allows() {
        let b = known(50);
        // 50 ms - 5 ms fixed - 10 × 0.5 ms decodes = 40 ms = 400 rows of 0.1 ms.
        assert_eq!(b.prefill_rows(10, 512), 400);
        // 50 - 5 - 40 × 0.5 = 25 ms: 250 rows. More decodes, fewer prefill rows.
        assert_eq!(b.prefill_rows(40, 512), 250);
        assert!(b.prefill_rows(60, 512) < b.prefill_rows(40, 512));
        // The step the rule allows is predicted within the target; one row more is not.
        let shape = |p| StepShape { prefill_rows: p, decode_rows: 40 };
        assert!(KNOWN.predict(shape(250)) <= ms(50));
        assert!(KNOWN.predict(shape(251)) > ms(50));
    }

    #[test]
    fn few_decodes_are_capped_by_the_step_rows() {
        // 50 - 5 - 0.5 = 44.5 ms would fit 445 rows, but the step holds 128 rows, 2 of them decodes.
        assert_eq!(known(50).prefill_rows(1, 128), 127);
        assert_eq!(known(50).prefill_rows(2, 128), 126);
    }

    #[test]
    fn the_floor_holds_when_decodes_fill_the_target() {
        // 80 decodes alone predict 45 ms: nothing fits within 40 ms, the floor still goes in.
        assert_eq!(known(40).prefill_rows(80, 512), 16);
        assert_eq!(known(40).prefill_rows(200, 512), 16);
        // But never more rows than the step has beside its decodes.
        assert_eq!(known(40).prefill_rows(500, 512), 12);
        assert_eq!(known(40).prefill_rows(600, 512), 0);
    }

    #[test]
    fn free_prompt_rows_fill_the_step() {
        // A fit that finds prompt rows cost nothing (say, measured steps all hid them in the fixed
        // cost) limits them only by the step's rows.
        let free = StepCost { per_prefill_row: Duration::ZERO, ..KNOWN };
        assert_eq!(StepBudget::with_prior(Some(ms(50)), 16, free).prefill_rows(10, 512), 502);
    }

    #[test]
    fn no_target_is_todays_behaviour() {
        for target in [None, Some(Duration::ZERO)] {
            let b = StepBudget::with_prior(target, 16, KNOWN);
            assert_eq!(b.target(), None);
            assert_eq!(b.prefill_rows(0, 512), 512);
            assert_eq!(b.prefill_rows(100, 512), 512);
        }
    }

    #[test]
    fn the_prior_is_conservative_until_steps_are_measured() {
        let b = StepBudget::new(Some(DEFAULT_ITL_TARGET));
        assert_eq!(b.cost(), StepCost::CONSERVATIVE);
        assert_eq!(b.measured(), 0);
        // 50 - 10 - 32 × 0.2 = 33.6 ms: 168 rows of 0.2 ms.
        assert_eq!(b.prefill_rows(32, 512), 168);
    }

    /// Steps of varied shapes timed exactly by `truth`.
    fn feed(b: &mut StepBudget, truth: StepCost, steps: usize) {
        for i in 0..steps {
            let shape = StepShape { prefill_rows: (i * 37) % 300, decode_rows: 1 + (i * 11) % 64 };
            b.observe(shape, truth.predict(shape));
        }
    }

    fn close(a: Duration, b: Duration, rel: f64) -> bool {
        (a.as_secs_f64() - b.as_secs_f64()).abs() <= rel * b.as_secs_f64()
    }

    #[test]
    fn the_model_learns_the_measured_step_times() {
        // A card four times faster than the prior fears.
        let truth = StepCost {
            fixed: Duration::from_micros(2500),
            per_prefill_row: Duration::from_micros(50),
            per_decode_row: Duration::from_micros(50),
        };
        let mut b = StepBudget::new(Some(ms(50)));
        let before = b.prefill_rows(32, 2048);
        feed(&mut b, truth, 200);
        assert_eq!(b.measured(), 200);
        let cost = b.cost();
        // The prior's imagined steps, 4× off, pull the fit by a few percent at most.
        assert!(close(cost.fixed, truth.fixed, 0.05), "{cost:?}");
        assert!(close(cost.per_prefill_row, truth.per_prefill_row, 0.05), "{cost:?}");
        assert!(close(cost.per_decode_row, truth.per_decode_row, 0.05), "{cost:?}");
        // 50 - 2.5 - 1.6 = 45.9 ms: about 918 rows, where the prior allowed 168.
        let after = b.prefill_rows(32, 2048);
        assert_eq!(before, 168);
        assert!((890..=940).contains(&after), "{after}");
    }

    #[test]
    fn the_model_follows_a_card_that_slows_down() {
        let mut b = StepBudget::with_prior(Some(ms(50)), 16, KNOWN);
        feed(&mut b, KNOWN, 200);
        let fast = b.prefill_rows(10, 512);
        let slow = StepCost { per_prefill_row: KNOWN.per_prefill_row * 2, ..KNOWN };
        feed(&mut b, slow, 300);
        let slowed = b.prefill_rows(10, 512);
        // 40 ms of room: 400 rows at 0.1 ms, 200 at 0.2 ms; old steps are forgotten.
        assert!((395..=400).contains(&fast), "{fast}");
        assert!((195..=205).contains(&slowed), "{slowed}");
    }

    #[test]
    fn decode_only_steps_leave_the_prefill_cost_to_the_prior() {
        // Steps that never carry a prompt say nothing about a prefill row's cost; the fit stays
        // defined and keeps the prior's.
        let mut b = StepBudget::with_prior(Some(ms(50)), 16, KNOWN);
        for d in 1..100 {
            let shape = StepShape { prefill_rows: 0, decode_rows: d % 40 + 1 };
            b.observe(shape, KNOWN.predict(shape));
        }
        assert!(close(b.cost().per_prefill_row, KNOWN.per_prefill_row, 0.01), "{:?}", b.cost());
    }

    #[test]
    fn empty_steps_are_not_measurements() {
        let mut b = known(50);
        b.observe(StepShape::default(), ms(500));
        assert_eq!((b.measured(), b.cost()), (0, KNOWN));
    }

    #[test]
    fn solves_a_known_system() {
        let x = solve3([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 4.0, 1.0]], [4.0, 9.0, 12.0]).unwrap();
        for (got, want) in x.iter().zip([1.0, 2.0, 3.0]) {
            assert!((got - want).abs() < 1e-12, "{x:?}");
        }
        assert!(solve3([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 0.0, 1.0]], [1.0, 2.0, 3.0]).is_none());
    }
}
