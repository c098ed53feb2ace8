//! How many prompt (prefill) rows a step may carry while decodes run: the bound on the stall.
//!
//! Every running request waits for the whole step before its next token, so a running stream's
//! inter-token latency (ITL) is the time of the step it rode in. A step that carries a long prompt
//! chunk beside the decodes is a stall for every one of them. The trade-off is between two people:
//! fewer prefill rows per mixed step bound the ITL of those already streaming, but spread a new
//! prompt over more steps, so its time to first token (TTFT) grows; more rows fill the GEMMs and
//! finish prompts sooner, but stretch every running stream's token gap.
//!
//! The rule: predict a step's time with a linear model (a fixed cost per step, a further fixed cost
//! for a step that carries prompt rows at all, plus a cost per prefill token, plus a cost per decode
//! row) and give prefill the most rows that keep the predicted step within the bound beside the
//! decodes that are running. The bound is the smaller of two: an absolute ITL target
//! (`--itl-target-ms`), and a stall ratio (`--itl-stall-ratio`) times the predicted decode-only step
//! of the batch the engine is heading to (the running sequences and the waiting ones it will admit),
//! so a stream's gap during a prompt stays within a multiple of its usual gap however fast or slow
//! the card is (a 50 ms bound is 3 steps of an 8B model at batch 128, but 10 at batch 1). The
//! reference is that batch's step, not the step of the decodes running now: in a burst of arrivals
//! the first streams to start would otherwise hold every later prompt to a few rows a step (their
//! gap is small while they are few), and the burst's prompts would wait seconds for their first
//! token, the batch filling slowly and the card doing less; once the batch has filled, the streams'
//! gap is that batch's step anyway. Never fewer than a
//! floor, so a prompt always progresses however many decodes run (the target is then missed, by
//! the floor's cost, rather than a prompt starved); and a step with no decode running takes the
//! whole `max_batched_tokens`, since no stream waits on it and a prompt then prefills at the GEMM's
//! full rate.
//!
//! The model is fitted to the measured step times by least squares, with old steps forgotten
//! geometrically so it follows a card whose speed changes (clocks, a neighbour, longer contexts).
//! The fixed cost of a step with prompt rows is its own term because it differs: a decode-only
//! step is a captured replay, a mixed one runs eagerly; folded into one fixed cost, it would make
//! the decode-only prediction (the stall ratio's reference) too slow. Until steps are measured, a
//! conservative prior stands in: it assumes slow steps, so the first mixed steps carry small
//! chunks, and the fit loosens them as soon as it knows better. The prior stays in the fit as four
//! imagined steps of small weight, which keeps the fit defined when the measured steps do not vary
//! enough to tell the costs apart (all decode, say).
//!
//! Pure arithmetic: no clock, no engine; the engine hands in the measurements.

use std::time::Duration;

/// Prefill rows a mixed step always gets, so prompts progress under any number of decodes.
pub const MIN_PREFILL_ROWS: usize = 16;

/// The default inter-token-latency target (the server's `--itl-target-ms`). Measured on an H200
/// serving the Llama-3-8B shape at concurrency 128 (512-token prompts, 128 generated; one warm
/// machine, one binary): 38 ms kept ITL p99 at 2.9 times its median (13.6 ms) at 4,427 output
/// tok/s, where 50 ms let it reach 3.8 times at 4,436-4,447 and 40 ms 3.1 times; below 38 the
/// p99 stays (the mixed steps' floor of rows) and prompts wait longer (BENCHMARKS.md).
pub const DEFAULT_ITL_TARGET: Duration = Duration::from_millis(38);

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

/// Terms of the model: 1, carries prompt rows (0 or 1), prefill rows, decode rows.
const TERMS: usize = 4;

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
    /// Paid besides by a step that carries prompt rows (it runs eagerly where a decode-only step
    /// replays a captured graph, and its prompts' attention and metadata cost their own start-up).
    pub prefill_step: Duration,
    pub per_prefill_row: Duration,
    pub per_decode_row: Duration,
}

impl StepCost {
    /// A deliberately slow guess for before any step is measured: 10 ms a step, 0.2 ms a prefill
    /// row and 0.2 ms a decode row (a GPU running an 8B model is well under half of each), so the
    /// first mixed steps err on the side of the running streams.
    pub const CONSERVATIVE: StepCost = StepCost {
        fixed: Duration::from_millis(10),
        prefill_step: Duration::ZERO,
        per_prefill_row: Duration::from_micros(200),
        per_decode_row: Duration::from_micros(200),
    };

    /// The predicted time of a step of this shape.
    pub fn predict(&self, shape: StepShape) -> Duration {
        let prefill_step = if shape.prefill_rows > 0 { self.prefill_step } else { Duration::ZERO };
        self.fixed
            + prefill_step
            + self.per_prefill_row * shape.prefill_rows as u32
            + self.per_decode_row * shape.decode_rows as u32
    }

    /// From seconds; a cost the fit drove negative (noise, or a card that is not linear) is read
    /// as zero, never as time gained.
    fn from_secs(secs: [f64; TERMS]) -> StepCost {
        let d = |s: f64| Duration::from_secs_f64(if s.is_finite() { s.max(0.0) } else { 0.0 });
        StepCost {
            fixed: d(secs[0]),
            prefill_step: d(secs[1]),
            per_prefill_row: d(secs[2]),
            per_decode_row: d(secs[3]),
        }
    }
}

impl StepShape {
    /// The model's terms of this shape.
    fn terms(&self) -> [f64; TERMS] {
        let carries = if self.prefill_rows > 0 { 1.0 } else { 0.0 };
        [1.0, carries, self.prefill_rows as f64, self.decode_rows as f64]
    }
}

/// What bounds a step that carries prompt rows beside decodes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ItlBound {
    /// An absolute inter-token-latency target (`None`: none).
    pub target: Option<Duration>,
    /// The step at most this many times the decodes' own step (`None`: none).
    pub stall_ratio: Option<f64>,
}

impl ItlBound {
    /// No bound: every step may take the whole `max_batched_tokens`.
    pub const NONE: ItlBound = ItlBound { target: None, stall_ratio: None };

    /// The server's default: 50 ms, no stall ratio. Measured on an 8B model at concurrency 128
    /// (512-token prompts, 128 generated; BENCHMARKS.md), a ratio of 3 took ITL p99 from 3.5 to
    /// 2.1 times its median but cost 4-7% of the throughput, since every extra step that carries
    /// prompt rows pays a mixed step's own cost again; so the ratio is the user's choice.
    pub const DEFAULT: ItlBound = ItlBound { target: Some(DEFAULT_ITL_TARGET), stall_ratio: None };

    /// An absolute target alone.
    pub fn absolute(target: Option<Duration>) -> ItlBound {
        ItlBound { target, stall_ratio: None }
    }

    /// Zero targets and ratios (and ratios that are not finite or under 1, which no step could
    /// keep) mean no bound of that kind.
    fn normalized(self) -> ItlBound {
        ItlBound {
            target: self.target.filter(|t| !t.is_zero()),
            stall_ratio: self.stall_ratio.filter(|r| r.is_finite() && *r >= 1.0),
        }
    }

    pub fn is_none(&self) -> bool {
        self.target.is_none() && self.stall_ratio.is_none()
    }
}

/// The step-budget rule and the cost model it learns.
#[derive(Clone, Debug)]
pub struct StepBudget {
    /// No bound ([`ItlBound::NONE`]): every step may take the whole `max_batched_tokens`.
    bound: ItlBound,
    floor: usize,
    prior: StepCost,
    /// Forgetting sums of the least-squares normal equations over measured steps, with
    /// x = [1, carries prompt rows, prefill rows, decode rows] and y = seconds: `xx` = Σ w·x·xᵀ,
    /// `xy` = Σ w·x·y.
    xx: [[f64; TERMS]; TERMS],
    xy: [f64; TERMS],
    measured: u64,
    /// The fit of the sums above (the prior until a step is measured).
    cost: StepCost,
}

impl StepBudget {
    /// The rule with the conservative prior and the default floor.
    pub fn new(bound: ItlBound) -> StepBudget {
        StepBudget::with_prior(bound, MIN_PREFILL_ROWS, StepCost::CONSERVATIVE)
    }

    /// The rule with a chosen floor and prior (tests, and a caller that knows its card). A zero
    /// target or ratio means no bound of that kind.
    pub fn with_prior(bound: ItlBound, floor: usize, prior: StepCost) -> StepBudget {
        StepBudget {
            bound: bound.normalized(),
            floor,
            prior,
            xx: [[0.0; TERMS]; TERMS],
            xy: [0.0; TERMS],
            measured: 0,
            cost: prior,
        }
    }

    /// The absolute ITL target (`None`: none).
    pub fn target(&self) -> Option<Duration> {
        self.bound.target
    }

    /// The bound in force.
    pub fn bound(&self) -> ItlBound {
        self.bound
    }

    /// The most a step with some prompt rows may take while decodes run, heading for a batch of
    /// `heading_rows` decodes: the smaller of the absolute target and the stall ratio times that
    /// batch's predicted decode-only step; `None` without a bound.
    pub fn step_limit(&self, heading_rows: usize) -> Option<Duration> {
        let alone = self.cost.predict(StepShape { prefill_rows: 0, decode_rows: heading_rows });
        let by_ratio = self.bound.stall_ratio.map(|r| alone.mul_f64(r));
        match (self.bound.target, by_ratio) {
            (Some(t), Some(r)) => Some(t.min(r)),
            (t, r) => t.or(r),
        }
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
    /// a step of `max_batched_tokens` rows, heading for a batch of `heading_rows` decodes (the
    /// running sequences and the waiting ones the engine will admit; at least `decode_rows`).
    pub fn prefill_rows(&self, decode_rows: usize, heading_rows: usize, max_batched_tokens: usize) -> usize {
        if decode_rows == 0 {
            return max_batched_tokens;
        }
        let Some(limit) = self.step_limit(heading_rows.max(decode_rows)) else { return max_batched_tokens };
        let room = max_batched_tokens.saturating_sub(decode_rows);
        // The step with one prompt row: the decodes, the mixed step's own cost, that row.
        let one = self.cost.predict(StepShape { prefill_rows: 1, decode_rows });
        let left = (limit + self.cost.per_prefill_row).saturating_sub(one).as_nanos();
        // Rounded down: a row that would cross the target is not taken. A
        // prompt row the fit finds free (no division) fits without limit.
        let fits = match left.checked_div(self.cost.per_prefill_row.as_nanos()) {
            Some(rows) => usize::try_from(rows).unwrap_or(usize::MAX).min(room),
            None => room,
        };
        fits.max(self.floor).min(room)
    }

    /// `prefill_rows` prompt rows beside `decode_rows` decodes, cut so the step's rows come to a
    /// round number ([`aligned_rows`]): a mixed step runs eagerly, and every row count a matmul
    /// has not seen costs the host a planning query before the first layer's GEMMs can start
    /// (cuBLASLt's heuristic, 0.3-0.6 ms a shape on an H100, four shapes and the LM head's a step;
    /// BENCHMARKS.md), while a step whose rows the budget set would otherwise bring a new count
    /// nearly every time. Only ever fewer rows (less than a 32nd of the step's), never under the
    /// floor; a step of fewer prompt rows than allowed (the prompts ran out) keeps its count.
    pub fn align_prefill(&self, decode_rows: usize, prefill_rows: usize) -> usize {
        if decode_rows == 0 || prefill_rows <= self.floor {
            return prefill_rows;
        }
        let total = aligned_rows(decode_rows + prefill_rows);
        match total.checked_sub(decode_rows) {
            Some(rows) if rows >= self.floor => rows,
            _ => prefill_rows,
        }
    }

    /// Learn from a step that carried `shape` and took `took`, from forming it to its tokens
    /// handed out (what a decoding stream waited).
    pub fn observe(&mut self, shape: StepShape, took: Duration) {
        if shape.prefill_rows + shape.decode_rows == 0 {
            return;
        }
        let x = shape.terms();
        let y = took.as_secs_f64();
        for i in 0..TERMS {
            for j in 0..TERMS {
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
        // One imagined step pins each cost of the prior: an empty one, a one-row prompt, a
        // prompt chunk, a decode batch.
        let imagined = [
            StepShape { prefill_rows: 0, decode_rows: 0 },
            StepShape { prefill_rows: 1, decode_rows: 0 },
            StepShape { prefill_rows: PRIOR_PREFILL_ROWS as usize, decode_rows: 0 },
            StepShape { prefill_rows: 0, decode_rows: PRIOR_DECODE_ROWS as usize },
        ];
        for shape in imagined {
            let (x, y) = (shape.terms(), self.prior.predict(shape).as_secs_f64());
            for i in 0..TERMS {
                for j in 0..TERMS {
                    a[i][j] += PRIOR_WEIGHT * x[i] * x[j];
                }
                b[i] += PRIOR_WEIGHT * x[i] * y;
            }
        }
        match solve(a, b) {
            Some(secs) => StepCost::from_secs(secs),
            None => self.cost,
        }
    }
}

/// `rows` rounded down to a multiple of a 64th of the next power of two (at least 8): less than a
/// 32nd under it, and at most 64 distinct counts an octave, so the row counts of mixed steps repeat.
pub fn aligned_rows(rows: usize) -> usize {
    let step = (rows.next_power_of_two() / 64).max(8);
    rows / step * step
}

/// Solve `a · x = b` by Gaussian elimination with partial pivoting; `None` when it is singular
/// (it is not, with the prior's steps in it, but the arithmetic says so itself).
fn solve<const N: usize>(mut a: [[f64; N]; N], mut b: [f64; N]) -> Option<[f64; N]> {
    for col in 0..N {
        let pivot = (col..N).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        let pivot_row = a[col];
        for row in col + 1..N {
            let f = a[row][col] / pivot_row[col];
            for (k, v) in a[row].iter_mut().enumerate().skip(col) {
                *v -= f * pivot_row[k];
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; N];
    for row in (0..N).rev() {
        let rest: f64 = (row + 1..N).map(|k| a[row][k] * x[k]).sum();
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
        prefill_step: Duration::ZERO,
        per_prefill_row: Duration::from_micros(100),
        per_decode_row: Duration::from_micros(500),
    };

    fn known(target_ms: u64) -> StepBudget {
        StepBudget::with_prior(ItlBound::absolute(Some(ms(target_ms))), 16, KNOWN)
    }

    #[test]
    fn no_running_decodes_take_the_whole_budget() {
        assert_eq!(known(50).prefill_rows(0, 0, 512), 512);
        // However tight the target: nobody waits on a prefill-only step.
        assert_eq!(known(1).prefill_rows(0, 0, 512), 512);
    }

    #[test]
    fn decodes_leave_prefill_what_the_target_allows() {
        let b = known(50);
        // 50 ms - 5 ms fixed - 10 × 0.5 ms decodes = 40 ms = 400 rows of 0.1 ms.
        assert_eq!(b.prefill_rows(10, 10, 512), 400);
        // 50 - 5 - 40 × 0.5 = 25 ms: 250 rows. More decodes, fewer prefill rows.
        assert_eq!(b.prefill_rows(40, 40, 512), 250);
        assert!(b.prefill_rows(60, 60, 512) < b.prefill_rows(40, 40, 512));
        // The step the rule allows is predicted within the target; one row more is not.
        let shape = |p| StepShape { prefill_rows: p, decode_rows: 40 };
        assert!(KNOWN.predict(shape(250)) <= ms(50));
        assert!(KNOWN.predict(shape(251)) > ms(50));
    }

    #[test]
    fn few_decodes_are_capped_by_the_step_rows() {
        // 50 - 5 - 0.5 = 44.5 ms would fit 445 rows, but the step holds 128 rows, 2 of them decodes.
        assert_eq!(known(50).prefill_rows(1, 1, 128), 127);
        assert_eq!(known(50).prefill_rows(2, 2, 128), 126);
    }

    #[test]
    fn the_floor_holds_when_decodes_fill_the_target() {
        // 80 decodes alone predict 45 ms: nothing fits within 40 ms, the floor still goes in.
        assert_eq!(known(40).prefill_rows(80, 80, 512), 16);
        assert_eq!(known(40).prefill_rows(200, 200, 512), 16);
        // But never more rows than the step has beside its decodes.
        assert_eq!(known(40).prefill_rows(500, 500, 512), 12);
        assert_eq!(known(40).prefill_rows(600, 600, 512), 0);
    }

    #[test]
    fn free_prompt_rows_fill_the_step() {
        // A fit that finds prompt rows cost nothing (say, measured steps all hid them in the fixed
        // cost) limits them only by the step's rows.
        let free = StepCost { per_prefill_row: Duration::ZERO, ..KNOWN };
        assert_eq!(
            StepBudget::with_prior(ItlBound::absolute(Some(ms(50))), 16, free).prefill_rows(10, 10, 512),
            502
        );
    }

    #[test]
    fn no_target_is_todays_behaviour() {
        for target in [None, Some(Duration::ZERO)] {
            let b = StepBudget::with_prior(ItlBound::absolute(target), 16, KNOWN);
            assert_eq!(b.target(), None);
            assert_eq!(b.prefill_rows(0, 0, 512), 512);
            assert_eq!(b.prefill_rows(100, 100, 512), 512);
        }
    }

    #[test]
    fn the_prior_is_conservative_until_steps_are_measured() {
        let b = StepBudget::new(ItlBound::absolute(Some(DEFAULT_ITL_TARGET)));
        assert_eq!(b.cost(), StepCost::CONSERVATIVE);
        assert_eq!(b.measured(), 0);
        // 38 - 10 - 32 × 0.2 = 21.6 ms: 108 rows of 0.2 ms.
        assert_eq!(b.prefill_rows(32, 32, 512), 108);
    }

    /// Steps of varied shapes timed exactly by `truth`.
    fn feed(b: &mut StepBudget, truth: StepCost, steps: usize) {
        for i in 0..steps {
            let prefill_rows = if i % 3 == 0 { 0 } else { (i * 37) % 300 };
            let shape = StepShape { prefill_rows, decode_rows: 1 + (i * 11) % 64 };
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
            prefill_step: Duration::ZERO,
            per_prefill_row: Duration::from_micros(50),
            per_decode_row: Duration::from_micros(50),
        };
        let mut b = StepBudget::new(ItlBound::absolute(Some(ms(50))));
        let before = b.prefill_rows(32, 32, 2048);
        feed(&mut b, truth, 200);
        assert_eq!(b.measured(), 200);
        let cost = b.cost();
        // The prior's imagined steps, 4× off, pull the fit by a few percent at most.
        assert!(close(cost.fixed, truth.fixed, 0.05), "{cost:?}");
        assert!(close(cost.per_prefill_row, truth.per_prefill_row, 0.05), "{cost:?}");
        assert!(close(cost.per_decode_row, truth.per_decode_row, 0.05), "{cost:?}");
        // 50 - 2.5 - 1.6 = 45.9 ms: about 918 rows, where the prior allowed 168.
        let after = b.prefill_rows(32, 32, 2048);
        assert_eq!(before, 168);
        assert!((890..=940).contains(&after), "{after}");
    }

    #[test]
    fn the_model_follows_a_card_that_slows_down() {
        let mut b = StepBudget::with_prior(ItlBound::absolute(Some(ms(50))), 16, KNOWN);
        feed(&mut b, KNOWN, 200);
        let fast = b.prefill_rows(10, 10, 512);
        let slow = StepCost { per_prefill_row: KNOWN.per_prefill_row * 2, ..KNOWN };
        feed(&mut b, slow, 300);
        let slowed = b.prefill_rows(10, 10, 512);
        // 40 ms of room: 400 rows at 0.1 ms, 200 at 0.2 ms; old steps are forgotten.
        assert!((395..=400).contains(&fast), "{fast}");
        assert!((195..=205).contains(&slowed), "{slowed}");
    }

    #[test]
    fn decode_only_steps_leave_the_prefill_cost_to_the_prior() {
        // Steps that never carry a prompt say nothing about a prefill row's cost; the fit stays
        // defined and keeps the prior's.
        let mut b = StepBudget::with_prior(ItlBound::absolute(Some(ms(50))), 16, KNOWN);
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
    fn the_stall_ratio_bounds_a_step_by_the_decodes_own() {
        let b = StepBudget::with_prior(ItlBound { target: Some(ms(50)), stall_ratio: Some(2.5) }, 16, KNOWN);
        // 10 decodes step in 5 + 5 = 10 ms alone: at most 25 ms with a prompt, 150 rows of 0.1 ms
        // (the absolute 50 ms would have allowed 400).
        assert_eq!(b.step_limit(10), Some(ms(25)));
        assert_eq!(b.prefill_rows(10, 10, 512), 150);
        // 80 decodes step in 45 ms: 2.5 times that is past 50 ms, so the absolute target decides.
        assert_eq!(b.step_limit(80), Some(ms(50)));
        assert_eq!(b.prefill_rows(80, 80, 512), 50);
        // A ratio alone.
        let r = StepBudget::with_prior(ItlBound { target: None, stall_ratio: Some(2.0) }, 16, KNOWN);
        assert_eq!(r.prefill_rows(10, 10, 512), 100);
        assert_eq!(r.prefill_rows(0, 0, 512), 512, "nobody waits on a prefill-only step");
    }

    #[test]
    fn the_ratio_follows_the_batch_the_engine_is_heading_to() {
        let b = StepBudget::with_prior(ItlBound { target: Some(ms(50)), stall_ratio: Some(2.5) }, 16, KNOWN);
        // A burst: 10 streams decode and 30 prompts wait. Their batch of 40 steps in 25 ms alone,
        // so a step may take 2.5 x 25 = 62.5 ms, past the absolute 50: (50 - 10) / 0.1 = 400 rows,
        // where holding to the 10 streams' own 10 ms step would allow 150 and starve the burst.
        assert_eq!(b.prefill_rows(10, 40, 512), 400);
        assert!(b.prefill_rows(10, 40, 512) > b.prefill_rows(10, 10, 512));
        // Heading for 16: 2.5 x 13 ms = 32.5 ms, 225 rows.
        assert_eq!(b.prefill_rows(10, 16, 512), 225);
        // Fewer than those decoding is read as those decoding.
        assert_eq!(b.prefill_rows(10, 3, 512), b.prefill_rows(10, 10, 512));
    }

    #[test]
    fn a_mixed_steps_own_cost_comes_off_the_prompt_rows() {
        let slow_mix = StepCost { prefill_step: ms(3), ..KNOWN };
        let b =
            StepBudget::with_prior(ItlBound { target: Some(ms(50)), stall_ratio: Some(2.5) }, 16, slow_mix);
        // The decodes alone: still 10 ms (a decode-only step pays no prefill_step). With a
        // prompt: 25 - 10 - 3 = 12 ms for its rows.
        assert_eq!(b.step_limit(10), Some(ms(25)));
        assert_eq!(b.prefill_rows(10, 10, 512), 120);
        let shape = |p| StepShape { prefill_rows: p, decode_rows: 10 };
        assert!(slow_mix.predict(shape(120)) <= ms(25));
        assert!(slow_mix.predict(shape(121)) > ms(25));
    }

    #[test]
    fn the_model_tells_a_mixed_steps_own_cost_from_the_fixed_one() {
        // Decode-only steps replay a graph; mixed ones pay 4 ms more. Folded into one fixed cost,
        // the decodes' own step (the stall ratio's reference) would read about 2 ms slow.
        let truth = StepCost {
            fixed: ms(3),
            prefill_step: ms(4),
            per_prefill_row: Duration::from_micros(50),
            per_decode_row: Duration::from_micros(100),
        };
        let mut b = StepBudget::new(ItlBound::DEFAULT);
        feed(&mut b, truth, 300);
        let cost = b.cost();
        assert!(close(cost.fixed, truth.fixed, 0.05), "{cost:?}");
        assert!(close(cost.prefill_step, truth.prefill_step, 0.05), "{cost:?}");
        assert!(close(cost.per_prefill_row, truth.per_prefill_row, 0.05), "{cost:?}");
        assert!(close(cost.per_decode_row, truth.per_decode_row, 0.05), "{cost:?}");
    }

    #[test]
    fn ratios_no_step_could_keep_are_no_bound() {
        for ratio in [0.0, 0.5, f64::NAN, f64::INFINITY] {
            let b = StepBudget::with_prior(ItlBound { target: None, stall_ratio: Some(ratio) }, 16, KNOWN);
            assert!(b.bound().is_none(), "{ratio}");
            assert_eq!(b.prefill_rows(10, 10, 512), 512);
        }
    }

    #[test]
    fn a_mixed_steps_rows_come_to_a_round_count() {
        let b = known(50);
        // 10 decodes + 400 prompt rows = 410: a 64th of 512 is 8, so 408 rows in all.
        assert_eq!(b.align_prefill(10, 400), 398);
        // 115 decodes + 1,250 prompt rows = 1,365: steps of 32, 1,344 in all.
        assert_eq!(b.align_prefill(115, 1250), 1229);
        // Every such step's rows land on few counts, each less than a 32nd under the budget's.
        let mut counts = std::collections::BTreeSet::new();
        for decodes in 100..128 {
            for prompt in 1200..1300 {
                let p = b.align_prefill(decodes, prompt);
                assert!(p <= prompt && (prompt - p) * 32 < decodes + prompt);
                counts.insert(decodes + p);
            }
        }
        assert!(counts.len() <= 5, "{counts:?}");
    }

    #[test]
    fn alignment_never_cuts_under_the_floor_nor_a_prefill_only_step() {
        let b = known(50);
        // 120 + 20 = 140 would round to 136: 16 prompt rows, the floor; 120 + 17 would give 16 too.
        assert_eq!(b.align_prefill(120, 20), 16);
        // 125 + 17 = 142 would round to 136, 11 prompt rows: under the floor, so unaligned.
        assert_eq!(b.align_prefill(125, 17), 17);
        assert_eq!(b.align_prefill(125, 16), 16);
        // Nobody waits on a prefill-only step: it keeps its rows (the step's limit is fixed anyway).
        assert_eq!(b.align_prefill(0, 8000), 8000);
        assert_eq!(aligned_rows(7), 0);
        assert_eq!(aligned_rows(300), 296);
        assert_eq!(aligned_rows(8192), 8192);
    }

    #[test]
    fn solves_a_known_system() {
        let x = solve([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 4.0, 1.0]], [4.0, 9.0, 12.0]).unwrap();
        for (got, want) in x.iter().zip([1.0, 2.0, 3.0]) {
            assert!((got - want).abs() < 1e-12, "{x:?}");
        }
        assert!(solve([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 0.0, 1.0]], [1.0, 2.0, 3.0]).is_none());
    }
}
