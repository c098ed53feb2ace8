//! What sampling costs per engine step on a Llama-3-sized vocabulary
//! (128,256 logits a row) at batch 1, 8, 32 and 128, with the sampler's own
//! defaults (temperature 1, no truncation) and with the server's built-in
//! defaults for requests that set nothing (temperature 0.2, top-p 0.9,
//! min-p 0.05, repetition penalty 1.1):
//!
//!     cargo run --release -p corridor-engine --example sampler_cost
//!
//! Wall time on whatever machine runs it: compare runs on one machine only.

use corridor_engine::sampling::{CpuSampler, SampleRow, Sampler, SamplerState, SamplerStats, SamplingParams};
use std::sync::Arc;

fn main() {
    let plain = SamplingParams::default();
    let served = SamplingParams {
        temperature: 0.2,
        top_p: 0.9,
        min_p: 0.05,
        repetition_penalty: 1.1,
        ..SamplingParams::default()
    };
    for (name, params) in [("temperature 1, no truncation", plain), ("server defaults", served)] {
        println!("{name}:");
        run(&params);
    }
}

fn run(params: &SamplingParams) {
    let vocab = 128_256;
    let eos = [2u32];
    for batch in [1usize, 8, 32, 128] {
        // Deterministic, varied logits in [0, 5).
        let mut logits: Vec<f32> =
            (0..batch * vocab).map(|i| ((i as u64 * 2_654_435_761) % 1000) as f32 / 200.0).collect();
        let mut states: Vec<SamplerState> =
            (0..batch).map(|_| SamplerState::new(params, &[1, 2, 3])).collect();
        let mut sampler = CpuSampler::new(Arc::new(SamplerStats::default()));
        let reps = 5;
        let started = std::time::Instant::now();
        for _ in 0..reps {
            let mut rows: Vec<SampleRow<'_>> = states
                .iter_mut()
                .enumerate()
                .map(|(i, state)| SampleRow {
                    request_id: i as u64,
                    params,
                    state,
                    eos_token_ids: &eos,
                    mask: None,
                })
                .collect();
            sampler.sample(&mut logits, vocab, &mut rows).expect("a well-formed batch");
        }
        println!("batch {batch:3}: {:7.2} ms per step", started.elapsed().as_secs_f64() * 1e3 / reps as f64);
    }
}
