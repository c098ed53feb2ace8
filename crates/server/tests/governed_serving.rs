//! Serving under the memory governor on a simulated card: a foreign process
//! grows into the floor while requests run. The floor must be restored by
//! corridor itself (idle KV released, cached prefixes evicted, requests
//! preempted) within a second, with zero breaches; every request ends
//! cleanly; the serving marks name the intruder; and KV grows back once the
//! intruder exits. On the hybrid, the recurrent-state slots no request holds
//! are given back too (the state pool's idle chunks, right after idle KV)
//! and grow back with the KV.

use corridor_engine::engine::{Event, FinishReason, GenerateRequest};
use corridor_engine::sampling::SamplingParams;
use corridor_model::layout::{LayoutSpec, Split};
use corridor_server::boot::{boot, BootOptions, Devices};
use corridor_units::{Bytes, TokenId};
use corridor_vram::recorder::{read_dir, MarkKind};
use std::path::Path;
use std::time::{Duration, Instant};

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny").join(name)
}

#[test]
fn an_intruder_is_answered_without_a_breach_and_kv_grows_back() {
    intrusion("llama-f32", &[1300], None);
}

/// The hybrid, whose running requests also hold recurrent-state slots (a
/// pool committed at boot, counted in the rest above the floor): KV and the
/// chunks of idle slots are released and regrown, every request still
/// completes. (A fixed block of slots would keep its bytes booked through
/// the intrusion.)
#[test]
fn an_intruder_is_answered_without_a_breach_on_the_hybrid() {
    intrusion("qwen3_5", &[1300], None);
}

/// The same on a TP=2 layout over two sim cards, the intruder on the second:
/// the KV arena spans both cards, so relief on card1 releases the chunk on
/// both, the group shrinks together and grows back together.
#[test]
fn an_intruder_on_one_card_of_a_layout_shrinks_the_group_without_a_breach() {
    // Card1 holds a quarter of the KV (one of four heads), so it is smaller,
    // to rest about as far above its floor as the single card does.
    intrusion(
        "llama-f32",
        &[1300, 1260],
        Some(LayoutSpec { tp: 2, tp_split: Split::Ratio(vec![3, 1]), pp: 1, pp_split: Split::Even }),
    );
}

fn intrusion(model: &str, sizes_mib: &[u64], layout: Option<LayoutSpec>) {
    let cards = sizes_mib.len();
    let target = cards - 1;
    let dir = tempfile::tempdir().unwrap();
    let flight = dir.path().join("flight");
    let events = dir.path().join("events.jsonl");
    // The (last) card: 1300 MiB. After boot KV fills it to within a chunk of
    // the 1024 MiB floor plus the 64 MiB margin (~200 MiB of KV); at 1.5 s
    // pid 4242 takes 230 MiB, which puts the card ~170 MiB under the floor
    // until corridor gives KV back.
    let mib = 1024 * 1024u64;
    std::fs::write(
        &events,
        format!(
            "{{\"at_s\": 1.5, \"card\": {target}, \"pid\": 4242, \"bytes\": {}}}\n{{\"at_s\": 3.0, \"card\": {target}, \"pid\": 4242, \"bytes\": 0}}\n",
            230 * mib
        ),
    )
    .unwrap();
    let mut opts = BootOptions::new(fixture(model));
    opts.devices = Devices::Sim(sizes_mib.iter().map(|&m| Bytes::mib(m)).collect());
    opts.layout = layout;
    opts.max_running = 64;
    opts.context_len = Some(2048);
    opts.max_batched_tokens = 256;
    opts.flight_dir = Some(flight.clone());
    opts.sim_events = Some(events);
    opts.kv_hold = Some(Duration::from_millis(300));
    opts.serving_mark_interval = Some(Duration::from_millis(250));
    let booted = boot(&opts, |_, _| {}).unwrap();
    let gov = booted.governor.clone();
    let kv = |card: usize| gov.memory_report().cards[card].books.kv_committed;
    let kv_at_boot: Vec<Bytes> = (0..cards).map(kv).collect();
    assert!(kv_at_boot[target] >= Bytes::mib(32), "KV sized to {kv_at_boot:?}");
    let state = |card: usize| gov.memory_report().cards[card].books.state;
    let state_at_boot: Vec<Bytes> = (0..cards).map(state).collect();
    let hybrid = model.starts_with("qwen3_5");
    assert_eq!(state_at_boot[target] > Bytes::ZERO, hybrid, "state booked: {state_at_boot:?}");

    // Clients: keep requests flowing for 4.5 s.
    let start = Instant::now();
    let clients: Vec<_> = (0..6)
        .map(|c| {
            let engine = booted.engine.clone();
            std::thread::spawn(move || {
                let mut outcomes = Vec::new();
                let mut i = 0u32;
                while start.elapsed() < Duration::from_millis(4500) {
                    let prompt: Vec<u32> = (0..40).map(|t| 3 + (t * 7 + c * 13 + i) % 300).collect();
                    let req = GenerateRequest {
                        prompt: TokenId::vec(&prompt),
                        params: SamplingParams { temperature: 0.0, ignore_eos: true, ..Default::default() },
                        max_new_tokens: Some(24),
                        eos_ids: vec![TokenId(2)],
                        constraint: None,
                    };
                    let mut s = engine.submit(req).unwrap();
                    loop {
                        match s.next_blocking() {
                            Some(Event::Token { .. }) => {}
                            Some(Event::Done { reason, .. }) => {
                                outcomes.push(reason);
                                break;
                            }
                            None => panic!("stream ended without Done"),
                        }
                    }
                    i += 1;
                }
                outcomes
            })
        })
        .collect();
    let mut kv_during = vec![Bytes(u64::MAX); cards];
    let mut state_during = vec![Bytes(u64::MAX); cards];
    while start.elapsed() < Duration::from_millis(2900) {
        for c in 0..cards {
            kv_during[c] = kv_during[c].min(kv(c));
            state_during[c] = state_during[c].min(state(c));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let outcomes: Vec<FinishReason> = clients.into_iter().flat_map(|c| c.join().unwrap()).collect();
    // Give KV time to grow back after the intruder left at 3.0 s.
    let deadline = Instant::now() + Duration::from_secs(5);
    while (0..cards).any(|c| kv(c) < kv_at_boot[c] || state(c) < state_at_boot[c])
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    let report = gov.memory_report();
    let r = report.cards[target].clone();

    assert!(!outcomes.is_empty());
    assert!(outcomes.iter().all(|o| *o == FinishReason::Length), "every request completes: {outcomes:?}");
    assert_eq!(r.breaches, 0, "corridor's own allocations never took the card under its floor: {r:?}");
    assert!(r.intrusions >= 1, "the intruder was seen under the floor: {r:?}");
    assert!(r.restore_ms_max.is_some_and(|ms| ms <= 1000), "floor restored within a second: {r:?}");
    for c in 0..cards {
        let card = &report.cards[c];
        assert_eq!(card.breaches, 0, "card{c}: {card:?}");
        assert!(
            kv_during[c] < kv_at_boot[c],
            "card{c}: KV gave memory back during the intrusion ({} vs {})",
            kv_during[c],
            kv_at_boot[c]
        );
        assert!(
            card.books.kv_committed >= kv_at_boot[c],
            "card{c}: KV grew back after the intruder left: {card:?}"
        );
        if hybrid {
            assert!(
                state_during[c] < state_at_boot[c],
                "card{c}: idle state slots gave memory back during the intrusion ({} vs {})",
                state_during[c],
                state_at_boot[c]
            );
            assert!(
                card.books.state >= state_at_boot[c],
                "card{c}: the state pool grew back after the intruder left: {card:?}"
            );
        }
    }
    let pool = booted.engine.stats().pages;
    assert_eq!(pool.free + pool.cached + pool.in_use + pool.withheld, pool.capacity);

    // A serving mark during the intrusion names the intruder.
    let marks = read_dir(&flight).unwrap();
    assert!(marks.iter().any(|m| m.kind == MarkKind::Serving && m.processes.iter().any(|p| p.pid == 4242)));
    booted.engine.shutdown();
}
