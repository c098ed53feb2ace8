//! What sampling costs per engine step on a Llama-3-sized vocabulary
//! (128,256 logits a row) at batch 1, 8, 32 and 128, with the sampler's own
//! defaults (temperature 1, no truncation) and with the server's built-in
//! defaults for requests that set nothing (temperature 0.2, top-p 0.9,
//! min-p 0.05, repetition penalty 1.1):
//!
//!     cargo run --release -p corridor-engine --example sampler_cost
//!
//! Beside each, the host's share of a step whose rows are drawn on the GPU
//! (`sampling::device`: the uniforms and edit lists, then settling the
//! summaries), with a 1,000-token prompt under the repetition penalty, in
//! the steps after a request's first.
//!
//! Wall time on whatever machine runs it: compare runs on one machine only.

use corridor_backend::sample::RowSummary;
use corridor_engine::sampling::device;
use corridor_engine::sampling::{CpuSampler, SampleRow, Sampler, SamplerState, SamplerStats, SamplingParams};
use corridor_units::{RequestId, TokenId};
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
    let eos = [TokenId(2)];
    for batch in [1usize, 8, 32, 128] {
        // Deterministic, varied logits in [0, 5).
        let mut logits: Vec<f32> =
            (0..batch * vocab).map(|i| ((i as u64 * 2_654_435_761) % 1000) as f32 / 200.0).collect();
        let mut states: Vec<SamplerState> =
            (0..batch).map(|_| SamplerState::new(params, &[1, 2, 3].map(TokenId), &[])).collect();
        let mut sampler = CpuSampler::new(Arc::new(SamplerStats::default()));
        let reps = 5;
        let started = std::time::Instant::now();
        for _ in 0..reps {
            let mut rows: Vec<SampleRow<'_>> = states
                .iter_mut()
                .enumerate()
                .map(|(i, state)| SampleRow {
                    request_id: RequestId(i as u64),
                    params,
                    state,
                    eos_token_ids: &eos,
                    mask: None,
                })
                .collect();
            sampler.sample(&mut logits, vocab, &mut rows).expect("a well-formed batch");
        }
        let host = started.elapsed().as_secs_f64() * 1e3 / reps as f64;
        // What the host still does per step when the rows are drawn on the
        // device: each row's uniform and edits (a 1,000-token prompt under
        // a repetition penalty), and settling its summary.
        let prompt: Vec<TokenId> = (0..1000).map(|i| TokenId((i * 7919) % vocab as u32)).collect();
        let mut states: Vec<SamplerState> =
            (0..batch).map(|_| SamplerState::new(params, &prompt, &[])).collect();
        let stats = SamplerStats::default();
        // Kept from step to step, as the engine keeps it.
        let mut edits = Vec::new();
        // The first step of a request also makes its penalties' edit list;
        // the steps after it, timed here, keep it up to date.
        let mut started = std::time::Instant::now();
        for rep in 0..=reps {
            if rep == 1 {
                started = std::time::Instant::now();
            }
            let mut rows: Vec<SampleRow<'_>> = states
                .iter_mut()
                .enumerate()
                .map(|(i, state)| SampleRow {
                    request_id: RequestId(i as u64),
                    params,
                    state,
                    eos_token_ids: &eos,
                    mask: None,
                })
                .collect();
            edits.clear();
            let specs: Vec<_> = rows
                .iter_mut()
                .enumerate()
                .map(|(i, r)| device::plan_row(r, vocab, i as u32, &mut edits))
                .collect();
            for (row, spec) in rows.iter_mut().zip(&specs) {
                let summary =
                    RowSummary { token: 5, argmax: 5, value_bits: 1f32.to_bits(), ..Default::default() };
                let _ = device::settle_row(&stats, row, spec, &summary, vocab, None);
                // The engine records each step's token in the row's state.
                row.state.record(TokenId(1000 + rep as u32));
            }
        }
        let device = started.elapsed().as_secs_f64() * 1e3 / reps as f64;
        println!("batch {batch:3}: {host:7.2} ms per step on the host; {device:6.3} ms of host work when drawn on the device");
    }
}
