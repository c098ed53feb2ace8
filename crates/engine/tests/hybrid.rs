//! The engine serving the qwen3_5 hybrid (linear-attention layers with
//! per-request recurrent state): greedy output equals the transformers
//! reference, concurrent requests with chunked prefill each keep their own
//! state, preemption rebuilds the state from the prompt, and a shared prefix
//! is computed again rather than served from a cache that holds no state.

use corridor_backend::cpu::CpuBackend;
use corridor_engine::engine::{spawn, EngineConfig, EngineHandle, Event, FinishReason, GenerateRequest};
use corridor_engine::pages::PagePool;
use corridor_engine::sampling::SamplingParams;
use corridor_engine::scheduler::SchedulerConfig;
use corridor_model::{Checkpoint, Model};
use corridor_units::{Pages, TokenId, Tokens};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/qwen3_5")
}

fn engine(pages: usize, budget: usize, running: usize) -> EngineHandle {
    let ckpt = Checkpoint::open(&fixture()).unwrap();
    let backend = CpuBackend::new();
    let model = Model::load(&backend, &ckpt, |_| {}).unwrap();
    assert!(model.has_state());
    spawn(
        backend,
        model,
        EngineConfig {
            scheduler: SchedulerConfig {
                max_running: running,
                max_batched_tokens: budget,
                context_len: 256,
                itl: corridor_engine::step_budget::ItlBound::NONE,
            },
            page_size: Tokens(16),
        },
        PagePool::standalone(Pages(pages), Tokens(16)),
    )
    .unwrap()
}

fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture().join("reference.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn greedy(prompt: Vec<u32>, n: usize) -> GenerateRequest {
    GenerateRequest {
        prompt: TokenId::vec(&prompt),
        params: SamplingParams { temperature: 0.0, ignore_eos: true, ..Default::default() },
        max_new_tokens: Some(n),
        eos_ids: vec![TokenId(2)],
        constraint: None,
    }
}

fn collect(e: &EngineHandle, req: GenerateRequest) -> (Vec<u32>, FinishReason, usize) {
    let mut s = e.submit(req).unwrap();
    let mut toks = Vec::new();
    loop {
        match s.next_blocking().expect("engine alive") {
            Event::Token { token, .. } => toks.push(token.get()),
            Event::Done { reason, usage } => return (toks, reason, usage.cached_tokens),
        }
    }
}

fn wait_idle(e: &EngineHandle) {
    let start = Instant::now();
    loop {
        let s = e.stats();
        if s.running == 0 && s.waiting == 0 && s.pages.in_use == 0 {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "engine did not go idle: {s:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Three different prompts: the reference one, the batch record's second
/// one, and a longer one that spans pages.
fn prompts() -> Vec<Vec<u32>> {
    let r = reference();
    let long: Vec<u32> = (0..40).map(|i| 3 + (i * 7 % 300) as u32).collect();
    vec![ids(&r["prompt_ids"]), ids(&r["batch"][1]["prompt_ids"]), long]
}

#[test]
fn greedy_generation_matches_transformers() {
    let r = reference();
    let e = engine(64, 64, 4);
    let want = ids(&r["greedy"]["ids"]);
    let (got, reason, _) = collect(&e, greedy(ids(&r["prompt_ids"]), want.len()));
    assert_eq!(got, want);
    assert_eq!(reason, FinishReason::Length);
    wait_idle(&e);
    e.shutdown();
}

#[test]
fn concurrent_hybrid_requests_each_get_their_solo_answer() {
    let e = engine(64, 64, 8);
    let solo: Vec<Vec<u32>> = prompts().into_iter().map(|p| collect(&e, greedy(p, 16)).0).collect();
    wait_idle(&e);
    e.shutdown();
    // A small budget forces chunked prefill interleaved with decodes, and
    // six requests over three prompts run in different slots at once.
    let e = engine(64, 7, 8);
    let threads: Vec<_> = (0..6)
        .map(|i| {
            let e = e.clone();
            let p = prompts()[i % 3].clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(3 * i as u64));
                collect(&e, greedy(p, 16)).0
            })
        })
        .collect();
    for (i, t) in threads.into_iter().enumerate() {
        assert_eq!(t.join().unwrap(), solo[i % 3], "request {i} (prompt {})", i % 3);
    }
    wait_idle(&e);
    e.shutdown();
}

#[test]
fn preemption_rebuilds_the_state_from_the_prompt() {
    let e = engine(64, 64, 4);
    let want = collect(&e, greedy(prompts()[0].clone(), 40)).0;
    e.shutdown();
    // 6 pages of 16 tokens cannot hold four 12+40-token sequences at once.
    let e = engine(6, 64, 4);
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let e = e.clone();
            let p = prompts()[0].clone();
            std::thread::spawn(move || collect(&e, greedy(p, 40)))
        })
        .collect();
    for t in threads {
        let (toks, reason, _) = t.join().unwrap();
        assert_eq!(reason, FinishReason::Length);
        assert_eq!(toks, want, "recompute after preemption must not change greedy output");
    }
    assert!(e.stats().preemptions > 0, "the pool was meant to run out");
    wait_idle(&e);
    e.shutdown();
}

#[test]
fn a_shared_prefix_is_computed_again() {
    let e = engine(64, 256, 4);
    let long = prompts()[2].clone();
    let (first, _, cached) = collect(&e, greedy(long.clone(), 4));
    assert_eq!(cached, 0);
    let (second, _, cached) = collect(&e, greedy(long, 4));
    assert_eq!(cached, 0, "no prefix is served to a model with state");
    assert_eq!(first, second);
    assert_eq!(e.stats().prefix_hit_tokens, 0);
    wait_idle(&e);
    e.shutdown();
}
