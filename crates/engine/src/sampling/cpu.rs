//! The batched CPU sampler: every row through the same pipeline, rows in
//! parallel when the batch is big enough to pay for it.

use std::sync::Arc;

use rayon::prelude::*;

use super::guard::{fall_back, settle_draw, Settled};
use super::kernel::{CpuDrawKernel, DrawKernel, DrawSpec};
use super::logits::{apply_adjustments, log_sum_exp, sanitize, sanitize_wide, top_logprobs, RawScan};
use super::outcome::{BatchError, FallbackKind, SampleError, SampleOutcome, Sampled, StopReason};
use super::stats::SamplerStats;
use super::{SampleRow, Sampler};

/// Below this many logits in a batch, rows run on the calling thread: fanning
/// a few small rows out to the thread pool costs more than it saves.
const PARALLEL_MIN_LOGITS: usize = 1 << 16;

/// Samples on the CPU with the draw `K` (the reference [`CpuDrawKernel`]
/// unless a test or a faster kernel plugs in another).
#[derive(Debug)]
pub struct CpuSampler<K: DrawKernel = CpuDrawKernel> {
    /// The per-row draw; its answers are checked, never trusted.
    kernel: K,
    /// Fallback counters, shared with the metrics exporter.
    stats: Arc<SamplerStats>,
}

impl CpuSampler<CpuDrawKernel> {
    /// A sampler with the reference draw, counting into `stats`.
    pub fn new(stats: Arc<SamplerStats>) -> Self {
        CpuSampler { kernel: CpuDrawKernel, stats }
    }
}

impl<K: DrawKernel> CpuSampler<K> {
    /// A sampler with a custom draw, counting into `stats`.
    pub fn with_kernel(stats: Arc<SamplerStats>, kernel: K) -> Self {
        CpuSampler { kernel, stats }
    }

    /// The counters this sampler increments.
    pub fn stats(&self) -> &Arc<SamplerStats> {
        &self.stats
    }
}

impl<K: DrawKernel> Sampler for CpuSampler<K> {
    fn sample(
        &mut self,
        logits: &mut [f32],
        vocab: usize,
        rows: &mut [SampleRow<'_>],
    ) -> Result<Vec<SampleOutcome>, BatchError> {
        if vocab == 0 || logits.len() != rows.len() * vocab {
            return Err(BatchError::ShapeMismatch { logits_len: logits.len(), rows: rows.len(), vocab });
        }
        let (kernel, stats) = (&self.kernel, &*self.stats);
        let outcomes = if rows.len() >= 2 && logits.len() >= PARALLEL_MIN_LOGITS {
            logits
                .par_chunks_mut(vocab)
                .zip(rows.par_iter_mut())
                .map(|(row_logits, row)| sample_row(kernel, stats, row_logits, row, false))
                .collect()
        } else {
            // One row (or a short batch): its own passes run on every core.
            let wide = rows.len() == 1;
            logits
                .chunks_mut(vocab)
                .zip(rows.iter_mut())
                .map(|(row_logits, row)| sample_row(kernel, stats, row_logits, row, wide))
                .collect()
        };
        Ok(outcomes)
    }
}

/// One row, start to finish. `logits`: [vocab], overwritten with the
/// sanitized, adjusted values the token was chosen from.
fn sample_row<K: DrawKernel>(
    kernel: &K,
    stats: &SamplerStats,
    logits: &mut [f32],
    row: &mut SampleRow<'_>,
    wide: bool,
) -> SampleOutcome {
    // The draw comes first and unconditionally, so the stream advances by
    // exactly one per token whatever happens below.
    let uniform = row.state.next_uniform();
    let scan = if wide { sanitize_wide(logits) } else { sanitize(logits) };
    apply_adjustments(logits, row.params, row.state, row.eos_token_ids);
    if let Some(mask) = row.mask {
        mask.apply(logits);
    }

    let settled = if !logits.iter().any(|&v| v > f32::NEG_INFINITY) {
        Err(SampleError::AllLogitsInvalid { vocab: logits.len(), nan: scan.nan })
    } else if scan.is_broken() {
        fall_back(logits, Some(FallbackKind::NonFiniteLogits), scan.nan)
    } else {
        let spec = DrawSpec {
            temperature: row.params.temperature,
            top_k: row.params.top_k,
            top_p: row.params.top_p,
            min_p: row.params.min_p,
        };
        settle_draw(logits, kernel.draw(logits, &spec, uniform), scan.nan)
    };

    conclude(stats, row, scan, logits.len(), settled, Some(logits))
}

/// The rest of a row once its token is settled, wherever it was drawn:
/// count and log the fallback or failure (a request logs once), the
/// log-probabilities (from `logits`, the sanitized, adjusted row, when the
/// caller holds it), the stop reason, and the token recorded in the state.
pub(super) fn conclude(
    stats: &SamplerStats,
    row: &mut SampleRow<'_>,
    scan: RawScan,
    vocab: usize,
    settled: Result<Settled, SampleError>,
    logits: Option<&[f32]>,
) -> SampleOutcome {
    let Settled { token, fallback } = match settled {
        Ok(settled) => settled,
        Err(err) => {
            stats.record_failure();
            if row.state.take_first_warning() {
                tracing::warn!(
                    request = row.request_id.get(),
                    position = row.state.generated().0,
                    nan = scan.nan,
                    pos_inf = scan.pos_inf,
                    vocab,
                    "sampling failed, the request ends with an error: {err}"
                );
            }
            return Err(err);
        }
    };
    if let Some(kind) = fallback {
        stats.record_fallback(kind);
        if row.state.take_first_warning() {
            tracing::warn!(
                request = row.request_id.get(),
                position = row.state.generated().0,
                kind = kind.label(),
                nan = scan.nan,
                pos_inf = scan.pos_inf,
                vocab,
                "sampling fell back to argmax; later fallbacks of this request are counted, not logged"
            );
        }
    }

    let (logprob, top) = match (row.params.logprobs, logits) {
        (None, _) | (_, None) => (None, Vec::new()),
        (Some(n), Some(logits)) => match log_sum_exp(logits) {
            Some(lse) => {
                (Some((logits[token.index()] as f64 - lse) as f32), top_logprobs(logits, n as usize, lse))
            }
            None => (None, Vec::new()),
        },
    };
    let stop = if row.eos_token_ids.contains(&token) && !row.params.ignore_eos {
        Some(StopReason::Eos)
    } else if row.params.stop_token_ids.contains(&token) {
        Some(StopReason::StopToken)
    } else {
        None
    };
    row.state.record(token);
    Ok(Sampled { token, logprob, top_logprobs: top, stop, fallback })
}
