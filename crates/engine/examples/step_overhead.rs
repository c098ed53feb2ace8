//! The engine's own share of a decode step (scheduling, sampling, handing
//! tokens out), on a model whose forward pass costs next to nothing: the
//! tiny checkpoint of the tests on the CPU backend, `B` requests of 512-token
//! prompts (shared 64-token system prompt, their own rest) generating 256
//! tokens each, all submitted at once.
//!
//!     cargo run --release -p corridor-engine --example step_overhead [B...]
//!
//! Prints, per batch, the mean milliseconds per step of each phase from the
//! engine's own stats (schedule, forward, sample) over the steps where every
//! request decodes. On a GPU the forward runs on the card, so the schedule
//! and sample phases here are what a step adds to the card's time. Wall
//! time on whatever machine runs it: compare runs on one machine only.

use corridor_backend::cpu::CpuBackend;
use corridor_engine::engine::{spawn, EngineConfig, Event, GenerateRequest};
use corridor_engine::pages::PagePool;
use corridor_engine::sampling::SamplingParams;
use corridor_engine::scheduler::SchedulerConfig;
use corridor_engine::step_budget::ItlBound;
use corridor_model::{Checkpoint, Model};
use corridor_units::{Pages, TokenId, Tokens};
use std::path::Path;

const PROMPT: usize = 512;
const OUTPUT: usize = 256;

fn main() {
    let batches: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let batches = if batches.is_empty() { vec![1, 32, 128] } else { batches };
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/llama-f32");
    for b in batches {
        let ckpt = Checkpoint::open(&dir).expect("the tiny checkpoint");
        let backend = CpuBackend::new();
        let model = Model::load(&backend, &ckpt, |_| {}).expect("it loads");
        let vocab = ckpt.config().vocab_size as u32;
        let page = 16;
        let pages = b * (PROMPT + OUTPUT).div_ceil(page) + 64;
        let engine = spawn(
            backend,
            model,
            EngineConfig {
                scheduler: SchedulerConfig {
                    max_running: b,
                    max_batched_tokens: 2048,
                    context_len: PROMPT + OUTPUT + 16,
                    itl: ItlBound::NONE,
                },
                page_size: Tokens(page),
            },
            PagePool::standalone(Pages(pages), Tokens(page)),
        )
        .expect("the engine starts");
        let streams: Vec<_> = (0..b as u32)
            .map(|r| {
                let prompt: Vec<u32> = (0..PROMPT as u32)
                    .map(|t| 3 + if t < 64 { t * 7 } else { t * 31 + r * 101 } % (vocab - 3))
                    .collect();
                engine
                    .submit(GenerateRequest {
                        prompt: TokenId::vec(&prompt),
                        params: SamplingParams { temperature: 0.0, ignore_eos: true, ..Default::default() },
                        max_new_tokens: Some(OUTPUT),
                        eos_ids: vec![TokenId(2)],
                        constraint: None,
                    })
                    .expect("admitted")
            })
            .collect();
        // Once every request has its first token, all of them decode.
        let mut streams: Vec<_> = streams.into_iter().collect();
        for s in &mut streams {
            while !matches!(s.next_blocking(), Some(Event::Token { .. })) {}
        }
        let before = engine.stats();
        // The middle of the run: every request decodes.
        for s in &mut streams {
            for _ in 0..OUTPUT / 2 {
                s.next_blocking();
            }
        }
        let after = engine.stats();
        let steps = (after.steps - before.steps).max(1) as f64;
        let ms = |a: f64, b: f64| (b - a) * 1e3 / steps;
        println!(
            "batch {b:>3}: {:>5} steps; ms per step: schedule {:.3}, forward {:.3}, sample {:.3}",
            after.steps - before.steps,
            ms(before.schedule_seconds, after.schedule_seconds),
            ms(before.forward_seconds, after.forward_seconds),
            ms(before.sample_seconds, after.sample_seconds),
        );
        drop(streams);
        engine.shutdown();
    }
}
