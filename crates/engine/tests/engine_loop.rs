//! The engine loop end to end on a tiny checkpoint: greedy output equals the
//! transformers reference, concurrent requests do not disturb each other,
//! the prefix cache serves a shared prompt, and a dropped stream frees its
//! pages.

use corridor_backend::cpu::CpuBackend;
use corridor_engine::engine::{
    spawn, EngineConfig, EngineHandle, Event, FinishReason, GenerateRequest, Usage,
};
use corridor_engine::pages::PagePool;
use corridor_engine::sampling::SamplingParams;
use corridor_engine::scheduler::SchedulerConfig;
use corridor_model::Checkpoint;
use corridor_model::Model;
use corridor_units::{Pages, TokenId, Tokens};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny").join(name)
}

fn engine(pages: usize, budget: usize) -> EngineHandle {
    engine_with(pages, budget, None)
}

fn engine_with(pages: usize, budget: usize, itl_target: Option<Duration>) -> EngineHandle {
    engine_of(pages, budget, itl_target, 256)
}

fn engine_of(pages: usize, budget: usize, itl_target: Option<Duration>, context_len: usize) -> EngineHandle {
    let ckpt = Checkpoint::open(&fixture("llama-f32")).unwrap();
    let backend = CpuBackend::new();
    let model = Model::load(&backend, &ckpt, |_| {}).unwrap();
    spawn(
        backend,
        model,
        EngineConfig {
            scheduler: SchedulerConfig {
                max_running: 8,
                max_batched_tokens: budget,
                context_len,
                itl: corridor_engine::step_budget::ItlBound::absolute(itl_target),
            },
            page_size: Tokens(16),
        },
        PagePool::standalone(Pages(pages), Tokens(16)),
    )
    .unwrap()
}

fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("llama-f32").join("reference.json")).unwrap())
        .unwrap()
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

fn collect(e: &EngineHandle, req: GenerateRequest) -> (Vec<u32>, FinishReason, Usage) {
    let mut s = e.submit(req).unwrap();
    let mut toks = Vec::new();
    loop {
        match s.next_blocking().expect("engine alive") {
            Event::Token { token, .. } => toks.push(token.get()),
            Event::Done { reason, usage } => return (toks, reason, usage),
        }
    }
}

fn wait_idle(e: &EngineHandle) {
    let start = Instant::now();
    loop {
        let s = e.stats();
        if s.running == 0 && s.waiting == 0 && s.pages.in_use == 0 {
            let c = s.pages;
            assert_eq!(c.free + c.cached + c.in_use + c.withheld, c.capacity);
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "engine did not go idle: {s:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn greedy_generation_matches_transformers() {
    let r = reference();
    let e = engine(64, 64);
    let want = ids(&r["greedy"]["ids"]);
    let (got, reason, usage) = collect(&e, greedy(ids(&r["prompt_ids"]), want.len()));
    assert_eq!(got, want);
    assert_eq!(reason, FinishReason::Length);
    assert_eq!(usage.completion_tokens, want.len());
    wait_idle(&e);
    e.shutdown();
}

#[test]
fn concurrent_requests_each_get_their_solo_answer() {
    let r = reference();
    // A small budget forces chunked prefill interleaved with decodes.
    let e = engine(64, 7);
    let want = ids(&r["greedy"]["ids"]);
    let prompt = ids(&r["prompt_ids"]);
    let threads: Vec<_> = (0..6)
        .map(|i| {
            let e = e.clone();
            let p = prompt.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(3 * i));
                collect(&e, greedy(p, 16)).0
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), want);
    }
    wait_idle(&e);
    e.shutdown();
}

#[test]
fn shared_prefix_is_served_from_the_cache() {
    let e = engine(64, 256);
    let long: Vec<u32> = (0..70).map(|i| 3 + (i * 7 % 300) as u32).collect();
    let (_, _, first) = collect(&e, greedy(long.clone(), 2));
    assert_eq!(first.cached_tokens, 0);
    let mut second = long[..64].to_vec();
    second.extend([5, 6, 7]);
    let (_, _, u) = collect(&e, greedy(second, 2));
    assert_eq!(u.cached_tokens, 64, "four full pages of the shared prefix");
    assert!(e.stats().prefix_hit_tokens >= 64);
    wait_idle(&e);
    e.shutdown();
}

#[test]
fn dropping_a_stream_aborts_and_frees_its_pages() {
    // A request that could run for tens of thousands of tokens, so it is
    // still running when the abort arrives however the threads are scheduled.
    let e = engine_of(4096, 64, None, 65536);
    let mut s = e.submit(greedy((3..40).collect(), 60000)).unwrap();
    // Wait for the first token so the request holds pages, then walk away.
    loop {
        if let Event::Token { .. } = s.next_blocking().unwrap() {
            break;
        }
    }
    drop(s);
    wait_idle(&e);
    assert!(e.stats().aborted >= 1);
    e.shutdown();
}

#[test]
fn preemption_under_a_small_pool_still_completes_everything() {
    let r = reference();
    // 6 pages of 16 tokens cannot hold four 12+40-token sequences at once.
    let e = engine(6, 64);
    let prompt = ids(&r["prompt_ids"]);
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let e = e.clone();
            let p = prompt.clone();
            std::thread::spawn(move || collect(&e, greedy(p, 40)))
        })
        .collect();
    let outs: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    for (toks, reason, _) in &outs {
        assert_eq!(*reason, FinishReason::Length);
        assert_eq!(toks, &outs[0].0, "recompute after preemption must not change greedy output");
    }
    assert!(e.stats().preemptions > 0, "the pool was meant to run out");
    wait_idle(&e);
    e.shutdown();
}

#[test]
fn a_bounded_itl_learns_every_step_and_keeps_the_answers() {
    let r = reference();
    // A target far below any CPU step: every mixed step gets only the floor
    // of prompt rows. Answers do not change, and every step is measured.
    let e = engine_with(64, 64, Some(Duration::from_micros(100)));
    let want = ids(&r["greedy"]["ids"])[..12].to_vec();
    let prompt = ids(&r["prompt_ids"]);
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let e = e.clone();
            let p = prompt.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(3 * i));
                collect(&e, greedy(p, 12)).0
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), want);
    }
    wait_idle(&e);
    let s = e.stats();
    assert!(s.steps > 0);
    assert_eq!(s.step_cost_measured, s.steps, "every step that ran is a measurement");
    assert_ne!(
        s.step_cost,
        corridor_engine::step_budget::StepCost::CONSERVATIVE,
        "the model moved off its prior"
    );
    e.shutdown();
}
