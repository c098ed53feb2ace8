//! Layouts served through the normal engine loop: a TP=3 and a PP=3 group of
//! rank threads give the same greedy outputs as one rank for concurrent
//! requests, a rank's failure fails the step and not the engine, and the
//! group's capacity is the MIN of what its ranks offer.

use corridor_engine::engine::{spawn_with, EngineConfig, EngineHandle, Event, FinishReason, GenerateRequest};
use corridor_engine::executor::{Executor, ExecutorLimits, SingleRank};
use corridor_engine::pages::PagePool;
use corridor_engine::ranks::{spawn_layout, LayoutOptions, MultiRank};
use corridor_engine::sampling::SamplingParams;
use corridor_engine::scheduler::SchedulerConfig;
use corridor_model::layout::Layout;
use corridor_model::Checkpoint;
use corridor_model::Model;
use corridor_units::{Pages, TokenId, Tokens};
use std::path::{Path, PathBuf};

const PAGES: usize = 64;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny").join(name)
}

fn limits() -> ExecutorLimits {
    ExecutorLimits { max_rows: Tokens(24), max_logit_rows: 4, page_size: Tokens(16), num_pages: Pages(PAGES) }
}

fn engine(exec: Box<dyn Executor>) -> EngineHandle {
    let l = limits();
    spawn_with(
        exec,
        EngineConfig {
            scheduler: SchedulerConfig {
                max_running: l.max_logit_rows,
                max_batched_tokens: l.max_rows.get(),
                context_len: 256,
                itl: corridor_engine::step_budget::ItlBound::NONE,
            },
            page_size: Tokens(16),
        },
        PagePool::standalone(Pages(PAGES), Tokens(16)),
    )
    .unwrap()
}

fn greedy(prompt: Vec<u32>, n: usize) -> GenerateRequest {
    GenerateRequest {
        prompt: TokenId::vec(&prompt),
        params: SamplingParams { temperature: 0.0, ignore_eos: true, ..Default::default() },
        max_new_tokens: Some(n),
        eos_ids: vec![],
        constraint: None,
    }
}

fn collect(e: &EngineHandle, reqs: Vec<GenerateRequest>) -> Vec<(Vec<u32>, FinishReason)> {
    // Submit everything first so the requests share steps.
    let mut streams: Vec<_> = reqs.into_iter().map(|r| e.submit(r).unwrap()).collect();
    streams
        .iter_mut()
        .map(|s| {
            let mut toks = Vec::new();
            loop {
                match s.next_blocking().expect("engine alive") {
                    Event::Token { token, .. } => toks.push(token.get()),
                    Event::Done { reason, .. } => return (toks, reason),
                }
            }
        })
        .collect()
}

fn requests() -> Vec<GenerateRequest> {
    vec![greedy((1..40).collect(), 12), greedy(vec![5, 9, 200, 31], 9), greedy((100..130).rev().collect(), 7)]
}

#[test]
fn tp_and_pp_serve_what_one_rank_serves() {
    serve_like_one_rank(&["llama-f32", "qwen2-tied"], |cfg| {
        vec![Layout::tensor_ratio(cfg, &[2, 1, 1], 1).unwrap(), Layout::pipeline(cfg, &[1, 0, 1]).unwrap()]
    });
}

/// The mixture of experts (three layers, the middle one dense) under uneven
/// TP=2 and PP=2: batched sequences share the step's expert groups.
#[test]
fn tp_and_pp_serve_the_moe_as_one_rank_does() {
    serve_like_one_rank(&["qwen3-moe"], |cfg| {
        vec![Layout::tensor_ratio(cfg, &[3, 1], 1).unwrap(), Layout::pipeline(cfg, &[1, 2]).unwrap()]
    });
}

fn serve_like_one_rank(names: &[&str], layouts: impl Fn(&corridor_model::ModelConfig) -> Vec<Layout>) {
    for &name in names {
        let ckpt = Checkpoint::open(&fixture(name)).unwrap();
        let backend = corridor_backend::cpu::CpuBackend::new();
        let single =
            SingleRank::new(backend.clone(), Model::load(&backend, &ckpt, |_| {}).unwrap(), limits())
                .unwrap();
        let e = engine(Box::new(single));
        let oracle = collect(&e, requests());
        e.shutdown();
        for layout in layouts(ckpt.config()) {
            let e = engine(
                spawn_layout(
                    &ckpt,
                    &layout,
                    LayoutOptions { census_every: 2, ..LayoutOptions::new(limits()) },
                )
                .unwrap(),
            );
            let got = collect(&e, requests());
            e.shutdown();
            assert_eq!(got, oracle, "{name} {}", layout.describe());
            assert!(got.iter().all(|(t, r)| !t.is_empty() && *r == FinishReason::Length));
        }
    }
}

#[test]
fn a_rank_error_fails_the_step_not_the_engine() {
    let ckpt = Checkpoint::open(&fixture("llama-f32")).unwrap();
    let layout = Layout::pipeline(ckpt.config(), &[1, 1]).unwrap();
    let e = engine(spawn_layout(&ckpt, &layout, LayoutOptions::new(limits())).unwrap());
    // Token 100000 is outside the vocabulary: stage 0 fails to embed while
    // stage 1 waits for its input; the abort must release stage 1.
    let bad = collect(&e, vec![greedy(vec![1, 100_000, 3], 4)]);
    assert!(matches!(bad[0].1, FinishReason::Error(ref m) if m.contains("vocabulary")), "{bad:?}");
    let good = collect(&e, vec![greedy(vec![1, 2, 3], 4)]);
    assert_eq!(
        (good[0].0.len(), &good[0].1),
        (4, &FinishReason::Length),
        "the group serves again after a failed step"
    );
    e.shutdown();
}

#[test]
fn capacity_is_agreed_by_min_reduction() {
    let ckpt = Checkpoint::open(&fixture("llama-f32")).unwrap();
    let layout = Layout::tensor_ratio(ckpt.config(), &[3, 1], 1).unwrap();
    let mut group = MultiRank::spawn(&ckpt, &layout, LayoutOptions::new(limits())).unwrap();
    // Every rank holds PAGES pages: growing past that is refused by every
    // rank, so the group agrees on PAGES; shrinking is agreed as asked.
    assert_eq!(group.agree_capacity(Pages(PAGES * 2)).unwrap(), Pages(PAGES));
    assert_eq!(group.agree_capacity(Pages(10)).unwrap(), Pages(10));
}
