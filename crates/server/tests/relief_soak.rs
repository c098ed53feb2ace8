//! Hours of foreign growth, compressed: 200 cycles of a foreign process
//! growing into a sim card's KV (random sizes up to the free KV, random hold
//! and gap times) under concurrent chat load with shared prompt prefixes.
//!
//! What must hold: corridor's own allocations never take the card under its
//! floor (zero breaches); nothing running is preempted, since the free KV
//! covers every intrusion (relief releases idle chunks wherever they sit and
//! moves live pages out of sparse ones instead); every request completes;
//! the page pool's invariant holds at every step (the engine checks it after
//! every step in debug builds and would fail the requests); and once the
//! intruder has gone the card rests within one chunk of floor + margin.

use corridor_engine::engine::{Event, FinishReason, GenerateRequest};
use corridor_engine::sampling::SamplingParams;
use corridor_server::boot::{boot, BootOptions, Devices};
use corridor_units::{Bytes, TokenId};
use corridor_vram::sizing::DEFAULT_MARGIN;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny").join(name)
}

/// A small deterministic generator (xorshift64*), so a failing run can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

const CYCLES: usize = 200;
const MIB: u64 = 1024 * 1024;

#[test]
fn two_hundred_intrusions_never_preempt_while_free_kv_covers_them() {
    let dir = tempfile::tempdir().unwrap();
    // The tiny model's KV is 8 KiB a page (2 layers, 2 KV heads of 16, f32).
    // 1190 MiB: about 100 MiB of KV at boot above the 1024 MiB floor and the
    // 64 MiB margin, so an intruder of more than the margin reaches into
    // the floor and one of less does not.
    let card_mib = 1190;
    let mut opts = BootOptions::new(fixture("llama-f32"));
    opts.devices = Devices::Sim(vec![Bytes::mib(card_mib)]);
    opts.max_running = 16;
    opts.context_len = Some(16384);
    opts.max_batched_tokens = 256;
    opts.kv_hold = Some(Duration::from_millis(150));
    opts.sample_interval = Some(Duration::from_millis(20));

    // Running requests hold at most 16 x 10 pages (prompts up to 120 tokens
    // plus 32 generated); an intrusion of the KV at boot less this and two
    // chunks of rounding is covered by free (or cached) KV whatever state
    // the previous cycle left, because what KV gave back is free on the card.
    let kv_at_boot_bound = (card_mib - 1024 - DEFAULT_MARGIN.get() / MIB) * MIB;
    let mut rng = Rng(0x5eed_1e55);
    let mut events = String::new();
    let mut t = 0.5f64;
    let mut sizes = Vec::with_capacity(CYCLES);
    for i in 0..CYCLES {
        let size = rng.range(MIB, kv_at_boot_bound - 12 * MIB);
        let hold = rng.range(10, 120) as f64 / 1000.0;
        let gap = rng.range(10, 120) as f64 / 1000.0;
        let pid = 5000 + i as u64;
        events.push_str(&format!("{{\"at_s\": {t:.3}, \"card\": 0, \"pid\": {pid}, \"bytes\": {size}}}\n"));
        events
            .push_str(&format!("{{\"at_s\": {:.3}, \"card\": 0, \"pid\": {pid}, \"bytes\": 0}}\n", t + hold));
        sizes.push(size);
        t += hold + gap;
    }
    let schedule_end = t;
    let events_path = dir.path().join("events.jsonl");
    std::fs::write(&events_path, events).unwrap();
    opts.sim_events = Some(events_path);

    let booted = boot(&opts, |_, _| {}).unwrap();
    let gov = booted.governor.clone();
    let arena = gov.arenas()[0].clone();
    let chunk = arena.geometry().chunk_bytes;
    let kv_at_boot = gov.memory_report().cards[0].books.kv_committed;
    assert!(
        kv_at_boot > Bytes::mib(80) && kv_at_boot.get() <= kv_at_boot_bound,
        "KV sized to {kv_at_boot}: the intrusions are meant to reach into the floor"
    );
    let over_margin = sizes.iter().filter(|&&s| s > DEFAULT_MARGIN.get() + 2 * MIB).count();
    assert!(over_margin >= CYCLES / 4, "only {over_margin} intrusions reach into the floor");

    // Clients: chats that share one of three system prompts (three full
    // pages each), with their own question after it.
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..8u32)
        .map(|c| {
            let engine = booted.engine.clone();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut rng = Rng(0x1234_5678 + c as u64);
                let mut outcomes = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let system = rng.range(0, 2) as u32;
                    let mut prompt: Vec<u32> = (0..48).map(|t| 3 + (t * 11 + system * 97) % 380).collect();
                    let tail = rng.range(16, 72) as u32;
                    let salt = rng.next() as u32;
                    prompt.extend((0..tail).map(|t| 3 + (t.wrapping_mul(31) ^ salt) % 380));
                    let req = GenerateRequest {
                        prompt: TokenId::vec(&prompt),
                        params: SamplingParams { temperature: 0.0, ignore_eos: true, ..Default::default() },
                        max_new_tokens: Some(rng.range(8, 32) as usize),
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
                }
                outcomes
            })
        })
        .collect();

    // Let the whole schedule play (the card's clock started at boot).
    let start = Instant::now();
    let mut lowest_kv = kv_at_boot;
    while start.elapsed() < Duration::from_secs_f64(schedule_end + 0.5) {
        lowest_kv = lowest_kv.min(gov.memory_report().cards[0].books.kv_committed);
        std::thread::sleep(Duration::from_millis(25));
    }
    stop.store(true, Ordering::Relaxed);
    let outcomes: Vec<FinishReason> = clients.into_iter().flat_map(|c| c.join().unwrap()).collect();

    // The intruders are gone: KV grows back after the hold time and the card
    // rests where boot sizing left it.
    let floor = gov.devices()[0].settings().floor;
    let rests = |free: Bytes| free >= floor + DEFAULT_MARGIN && free < floor + DEFAULT_MARGIN + chunk;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !rests(gov.memory_report().cards[0].free_bytes) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(25));
    }
    let report = gov.memory_report();
    let card = &report.cards[0];
    let stats = booted.engine.stats();
    eprintln!(
        "{} requests; {} intrusions into the floor, longest restore {:?} ms; KV {} at boot, {} lowest; \
         {} pages moved; {} preemptions; {} chunks released, {} committed; {} landings under the floor undone",
        outcomes.len(),
        card.intrusions,
        card.restore_ms_max,
        kv_at_boot,
        lowest_kv,
        stats.kv_pages_moved,
        stats.preemptions,
        arena.stats().chunks_released,
        arena.stats().chunks_committed,
        gov.devices()[0].guard_stats().landings_undone,
    );

    assert!(outcomes.len() >= 100, "the load kept going: {} requests", outcomes.len());
    assert!(outcomes.iter().all(|o| *o == FinishReason::Length), "every request completes: {outcomes:?}");
    assert_eq!(card.breaches, 0, "corridor's own allocations never took the card under its floor: {card:?}");
    assert!(card.intrusions >= 1, "intruders reached into the floor: {card:?}");
    assert!(card.restore_ms_max.is_some_and(|ms| ms <= 1000), "floor restored within a second: {card:?}");
    assert_eq!(stats.preemptions, 0, "no request was preempted while free KV covered every intrusion");
    assert!(lowest_kv < kv_at_boot, "KV gave memory back to the intruders");
    assert!(
        rests(card.free_bytes),
        "the card rests within one chunk ({chunk}) of floor + margin afterwards: free {}",
        card.free_bytes
    );
    arena.check_invariants().unwrap();
    let pool = stats.pages;
    assert_eq!(pool.free + pool.cached + pool.in_use + pool.withheld, pool.capacity);
    booted.engine.shutdown();
}
