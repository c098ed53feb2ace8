//! When requests start and when the run stops: seeded Poisson arrivals, the ticket dispenser that
//! enforces the count or duration bound, and the even spread of injected errors.
//!
//! Every request, whichever task sends it, first claims a ticket. The dispenser is the one place
//! that says "no more": after the last ticket of a count bound or once the deadline of a duration
//! bound has passed, every claim fails and every sender winds down, so the run stops by itself.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Stream of the seeded generator reserved for arrival gaps, so that arrivals and prompts drawn from
/// the same seed are independent of each other.
const ARRIVAL_STREAM: u64 = 0xA5A5_0001;

/// Start offsets (from the beginning of the run) of a Poisson process with `rate` arrivals per second:
/// gaps are exponential with mean `1 / rate`, drawn from `seed`, so the same seed gives the same
/// schedule on every run. `rate` must be positive and finite (the config checks it).
pub fn poisson_arrivals(rate: f64, seed: u64) -> impl Iterator<Item = Duration> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(ARRIVAL_STREAM);
    let mut at = 0.0f64;
    std::iter::from_fn(move || {
        // `random` is in [0, 1), so `1 - u` is in (0, 1] and its logarithm is finite.
        let u: f64 = rng.random();
        at += -(1.0 - u).ln() / rate;
        Some(Duration::from_secs_f64(at))
    })
}

/// Whether request number `index` (0-based, in the order tickets are issued) carries an injected
/// error when a share `fraction` of requests should. The injected requests are spread evenly and
/// their number after `n` requests is exactly `floor(n * fraction)`, so a short run still injects
/// the share asked for instead of relying on luck.
pub fn is_injected(index: u64, fraction: f64) -> bool {
    if fraction <= 0.0 {
        return false;
    }
    let before = (index as f64 * fraction).floor();
    let after = ((index + 1) as f64 * fraction).floor();
    after > before
}

/// The right to send one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    /// 0-based issue order.
    pub index: u64,
    /// The request must carry the invalid parameter a correct server rejects.
    pub injected: bool,
}

/// Hands out tickets until the bound is reached.
#[derive(Debug)]
pub struct Tickets {
    issued: AtomicU64,
    limit: Option<u64>,
    deadline: Option<Instant>,
    inject_fraction: f64,
}

impl Tickets {
    /// `limit` bounds the count, `deadline` the time; either may be absent but the config always
    /// sets one of them.
    pub fn new(limit: Option<u64>, deadline: Option<Instant>, inject_fraction: f64) -> Tickets {
        Tickets { issued: AtomicU64::new(0), limit, deadline, inject_fraction }
    }

    /// A ticket, or `None` once the run is over.
    pub fn claim(&self) -> Option<Ticket> {
        if self.deadline.is_some_and(|deadline| Instant::now() >= deadline) {
            return None;
        }
        let limit = self.limit;
        let index = self
            .issued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                limit.is_none_or(|l| n < l).then_some(n + 1)
            })
            .ok()?;
        Some(Ticket { index, injected: is_injected(index, self.inject_fraction) })
    }

    /// Whether every further claim would fail; lets an arrival loop stop without waiting for the
    /// next arrival time, which at a low rate could pad the measured duration by many seconds.
    pub fn exhausted(&self) -> bool {
        self.deadline.is_some_and(|deadline| Instant::now() >= deadline)
            || self.limit.is_some_and(|limit| self.issued() >= limit)
    }

    /// How many tickets were handed out, which is the number of requests sent.
    pub fn issued(&self) -> u64 {
        self.issued.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_is_repeatable_and_has_the_asked_rate() {
        let a: Vec<Duration> = poisson_arrivals(4.0, 7).take(20_000).collect();
        let b: Vec<Duration> = poisson_arrivals(4.0, 7).take(20_000).collect();
        let c: Vec<Duration> = poisson_arrivals(4.0, 8).take(20_000).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
        // 20 000 exponential gaps of mean 0.25 s: the sample mean has a relative standard error of
        // 1/sqrt(20000) = 0.7 %, so 5 % is over seven standard errors (and the seed is fixed anyway).
        let mean_gap = a.last().unwrap().as_secs_f64() / a.len() as f64;
        assert!((mean_gap - 0.25).abs() < 0.25 * 0.05, "mean gap {mean_gap}");
        // Exponential gaps have a coefficient of variation of 1; evenly spaced arrivals would have 0.
        let gaps: Vec<f64> = std::iter::once(a[0].as_secs_f64())
            .chain(a.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()))
            .collect();
        let var = gaps.iter().map(|g| (g - mean_gap).powi(2)).sum::<f64>() / gaps.len() as f64;
        let cv = var.sqrt() / mean_gap;
        assert!((cv - 1.0).abs() < 0.05, "coefficient of variation {cv}");
    }

    #[test]
    fn injection_is_exact_and_spread() {
        let picks: Vec<u64> = (0..20).filter(|&i| is_injected(i, 0.25)).collect();
        assert_eq!(picks, vec![3, 7, 11, 15, 19]);
        assert_eq!((0..1000).filter(|&i| is_injected(i, 0.1)).count(), 100);
        assert_eq!((0..1000).filter(|&i| is_injected(i, 0.0)).count(), 0);
        assert_eq!((0..10).filter(|&i| is_injected(i, 1.0)).count(), 10);
    }

    #[test]
    fn count_bound_issues_exactly_the_limit() {
        let tickets = Tickets::new(Some(3), None, 0.0);
        assert!(!tickets.exhausted());
        let got: Vec<u64> = std::iter::from_fn(|| tickets.claim()).map(|t| t.index).collect();
        assert_eq!(got, vec![0, 1, 2]);
        assert!(tickets.exhausted());
        assert_eq!(tickets.claim(), None);
        assert_eq!(tickets.issued(), 3);
    }

    #[test]
    fn passed_deadline_issues_nothing() {
        let tickets = Tickets::new(None, Some(Instant::now()), 0.0);
        assert!(tickets.exhausted());
        assert_eq!(tickets.claim(), None);
        assert_eq!(tickets.issued(), 0);
    }
}
