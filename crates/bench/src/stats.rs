//! Latency summaries: nearest-rank percentiles.
//!
//! The nearest-rank percentile `p` of `n` sorted samples is the sample at 1-based rank
//! `ceil(p / 100 * n)`. It is always one of the measured values (never an interpolation between
//! two), so a reported p99 is a latency some request really saw, and `p50 <= p90 <= p99 <= max`
//! holds by construction.

use serde::Serialize;

/// The nearest-rank `p`-th percentile (0 < p <= 100) of samples sorted ascending; `None` when empty.
pub fn nearest_rank(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let n = sorted.len();
    let rank = ((p / 100.0) * n as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, n) - 1])
}

/// Summary of one latency series, in milliseconds. Percentiles are `null` when there were no samples
/// (for example inter-token latency when every request produced a single token).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub count: usize,
    pub mean: Option<f64>,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
}

impl Percentiles {
    /// Summarise samples given in any order; non-finite samples are dropped rather than allowed to
    /// poison the ordering.
    pub fn from_samples(samples: impl IntoIterator<Item = f64>) -> Percentiles {
        let mut sorted: Vec<f64> = samples.into_iter().filter(|v| v.is_finite()).collect();
        sorted.sort_by(f64::total_cmp);
        let count = sorted.len();
        let mean = (count > 0).then(|| sorted.iter().sum::<f64>() / count as f64);
        Percentiles {
            count,
            mean,
            p50: nearest_rank(&sorted, 50.0),
            p90: nearest_rank(&sorted, 90.0),
            p99: nearest_rank(&sorted, 99.0),
            max: sorted.last().copied(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn nearest_rank_picks_measured_values() {
        let sorted: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(nearest_rank(&sorted, 50.0), Some(5.0));
        assert_eq!(nearest_rank(&sorted, 90.0), Some(9.0));
        assert_eq!(nearest_rank(&sorted, 99.0), Some(10.0));
        assert_eq!(nearest_rank(&sorted, 100.0), Some(10.0));
        assert_eq!(nearest_rank(&sorted, 1.0), Some(1.0));
        assert_eq!(nearest_rank(&[], 50.0), None);
    }

    #[test]
    fn summary_of_unsorted_samples() {
        let p = Percentiles::from_samples([30.0, 10.0, 20.0, f64::NAN]);
        assert_eq!(p.count, 3);
        assert_eq!(p.mean, Some(20.0));
        assert_eq!(p.p50, Some(20.0));
        assert_eq!(p.p90, Some(30.0));
        assert_eq!(p.max, Some(30.0));
        assert_eq!(Percentiles::from_samples([]).p50, None);
    }

    proptest! {
        #[test]
        fn percentiles_are_ordered(samples in proptest::collection::vec(0.0f64..1e6, 1..300)) {
            let p = Percentiles::from_samples(samples);
            let (p50, p90, p99, max) = (p.p50.unwrap(), p.p90.unwrap(), p.p99.unwrap(), p.max.unwrap());
            prop_assert!(p50 <= p90 && p90 <= p99 && p99 <= max);
        }
    }
}
