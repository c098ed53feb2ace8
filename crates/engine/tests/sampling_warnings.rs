//! One warning per request, however many of its tokens fall back.
//!
//! This test has a binary of its own: `tracing` caches per call site whether
//! anyone listens, so a test in the same process that runs with no subscriber
//! can hide the warnings from this test's thread-local subscriber.

use corridor_units::RequestId;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use corridor_engine::sampling::{
    CpuSampler, FallbackKind, SampleRow, Sampler, SamplerState, SamplerStats, SamplingParams,
};

fn flat_with(vocab: usize, at: &[(usize, f32)]) -> Vec<f32> {
    let mut row = vec![0.0f32; vocab];
    for &(i, v) in at {
        row[i] = v;
    }
    row
}

/// Counts warnings emitted on this thread.
struct WarnCounter(Arc<AtomicUsize>);

impl tracing::Subscriber for WarnCounter {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        if *event.metadata().level() == tracing::Level::WARN {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Every fallback is counted, but a request logs one warning, not one per
/// token. Two requests that both fall back log two. (Small batches run on the
/// calling thread, where the test's subscriber listens.)
#[test]
fn one_warning_per_request_every_fallback_counted() {
    let warnings = Arc::new(AtomicUsize::new(0));
    let stats = Arc::new(SamplerStats::default());
    tracing::subscriber::with_default(WarnCounter(warnings.clone()), || {
        let mut sampler = CpuSampler::new(stats.clone());
        let params = SamplingParams::default();
        let mut a = SamplerState::new(&params, &[], &[]);
        let mut b = SamplerState::new(&params, &[], &[]);
        for step in 0..6 {
            let mut logits = [flat_with(8, &[(2, f32::NAN)]), flat_with(8, &[(3, f32::INFINITY)])].concat();
            let mut rows = vec![SampleRow {
                request_id: RequestId(1),
                params: &params,
                state: &mut a,
                eos_token_ids: &[],
                mask: None,
            }];
            if step % 2 == 0 {
                rows.push(SampleRow {
                    request_id: RequestId(2),
                    params: &params,
                    state: &mut b,
                    eos_token_ids: &[],
                    mask: None,
                });
            } else {
                logits.truncate(8);
            }
            sampler.sample(&mut logits, 8, &mut rows).expect("shape");
        }
        assert!(a.has_warned() && b.has_warned());
    });
    assert_eq!(stats.fallbacks(FallbackKind::NonFiniteLogits), 9);
    assert_eq!(warnings.load(Ordering::SeqCst), 2);
}
