//! Fallback counters shared between the sampler and whoever exports metrics.
//!
//! The engine does not depend on a metrics library; the server reads these
//! atomics and exports them as Prometheus counters, one per
//! [`FallbackKind`] label plus one for rows that failed outright.

use std::sync::atomic::{AtomicU64, Ordering};

use super::outcome::FallbackKind;

/// Monotonic counters of sampling fallbacks and failures.
#[derive(Debug, Default)]
pub struct SamplerStats {
    /// Rows whose model logits held NaN or +inf.
    non_finite_logits: AtomicU64,
    /// Rows whose draw found no candidate.
    no_candidate: AtomicU64,
    /// Rows whose draw returned an id outside the vocabulary.
    out_of_vocab: AtomicU64,
    /// Rows whose draw returned a masked token.
    masked_token: AtomicU64,
    /// Rows that failed outright (every logit invalid).
    failed_rows: AtomicU64,
    /// Rows drawn where their logits are (on the GPU).
    device_rows: AtomicU64,
    /// Rows sent to the device whose candidate set did not fit its draw, so
    /// their adjusted logits came back and the host drew them.
    device_spilled: AtomicU64,
}

impl SamplerStats {
    fn counter(&self, kind: FallbackKind) -> &AtomicU64 {
        match kind {
            FallbackKind::NonFiniteLogits => &self.non_finite_logits,
            FallbackKind::NoCandidate => &self.no_candidate,
            FallbackKind::OutOfVocab => &self.out_of_vocab,
            FallbackKind::MaskedToken => &self.masked_token,
        }
    }

    /// Counts one row that fell back for `kind`.
    pub fn record_fallback(&self, kind: FallbackKind) {
        // Relaxed: the counters are independent and only read for export.
        self.counter(kind).fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one row that produced no token.
    pub fn record_failure(&self) {
        self.failed_rows.fetch_add(1, Ordering::Relaxed);
    }

    /// Rows that fell back for `kind` so far.
    pub fn fallbacks(&self, kind: FallbackKind) -> u64 {
        self.counter(kind).load(Ordering::Relaxed)
    }

    /// Rows that fell back for any reason so far.
    pub fn total_fallbacks(&self) -> u64 {
        FallbackKind::ALL.iter().map(|&k| self.fallbacks(k)).sum()
    }

    /// Rows that produced no token so far.
    pub fn failed_rows(&self) -> u64 {
        self.failed_rows.load(Ordering::Relaxed)
    }

    /// Counts one row sent to the device sampler; `spilled` when it came
    /// back for the host to draw.
    pub fn record_device_row(&self, spilled: bool) {
        self.device_rows.fetch_add(1, Ordering::Relaxed);
        if spilled {
            self.device_spilled.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Rows sent to the device sampler so far.
    pub fn device_rows(&self) -> u64 {
        self.device_rows.load(Ordering::Relaxed)
    }

    /// Rows the device sampler handed back to the host so far.
    pub fn device_spilled(&self) -> u64 {
        self.device_spilled.load(Ordering::Relaxed)
    }
}
