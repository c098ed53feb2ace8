//! KV fills every sim card: after boot each card rests less than one KV chunk
//! above its floor plus the sizing margin, whatever the model and the card
//! size, because KV is sized to what the card holds rather than to what the
//! running requests could use (what they leave holds cached prefixes).

use corridor_model::layout::{LayoutSpec, Split};
use corridor_server::boot::{boot, BootOptions, Devices};
use corridor_units::{Bytes, TokenId};
use corridor_vram::sizing::DEFAULT_MARGIN;
use corridor_vram::Purpose;
use std::path::Path;

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny").join(name)
}

/// Boot `model` on sim cards of `sizes` (with `layout` over them) and check
/// every card of every arena rests within one of its chunks above floor + margin.
fn fills(model: &str, sizes: &[Bytes], layout: Option<LayoutSpec>) {
    let mut opts = BootOptions::new(fixture(model));
    opts.devices = Devices::Sim(sizes.to_vec());
    opts.layout = layout;
    opts.max_running = 8;
    opts.context_len = Some(256);
    // Under the default 1 GiB floor a 1 GiB card holds nothing.
    opts.floor_mib = Some("256".into());
    let booted = boot(&opts, |_, _| {}).unwrap();
    let gov = booted.governor.clone();
    let arenas = gov.arenas();
    let kv: Vec<_> = arenas.iter().filter(|a| a.purpose() == Purpose::Kv).collect();
    assert_eq!(kv.len(), 1, "{model}: one KV arena");
    let arena = kv[0];
    // A hybrid's state is a pool of its own, committed for the running
    // limit before KV took the rest: the rest below counts both.
    let state = arenas.iter().find(|a| a.purpose() == Purpose::State);
    assert_eq!(state.is_some(), model.starts_with("qwen3_5"), "{model}: a state pool for the hybrid only");
    if let Some(state) = state {
        assert!(state.backed().get() >= 8, "{model}: a slot for each of the 8 running requests");
        let g = state.geometry();
        let committed = Bytes((state.backed().get() / g.chunk_pages) as u64 * g.chunk_bytes.get());
        assert_eq!(
            gov.devices()[0].books().state,
            committed,
            "{model}: the pool's chunks are booked as state"
        );
    }
    assert_eq!(arena.cards().len(), sizes.len(), "{model}: the arena spans every card");
    for dev in gov.devices() {
        let part = arena.part_on(dev.id()).expect("a share on every card");
        let free = dev.card().driver_free();
        let kept = dev.settings().arming_floor() + DEFAULT_MARGIN;
        assert!(
            free >= kept,
            "{model} on {sizes:?}: {} rests under floor + margin: {free} < {kept}",
            dev.id()
        );
        let rest = free - kept;
        assert!(
            rest < part.geometry.chunk_bytes,
            "{model} on {sizes:?}: {} rests {rest} above floor + margin, more than a chunk of {} \
             ({} pages committed of an id space of {})",
            dev.id(),
            part.geometry.chunk_bytes,
            arena.backed().get(),
            arena.capacity().get(),
        );
        assert!(dev.books().kv_committed > Bytes::ZERO);
    }
    let counts = arena.check_invariants().expect("arena invariants");
    assert_eq!(counts.free, counts.committed, "{model}: nothing in use after boot");
}

#[test]
fn kv_fills_a_card_of_any_size_for_the_llama_family() {
    for gib in [1, 4, 8] {
        fills("llama-f32", &[Bytes::gib(gib)], None);
    }
    fills("qwen3", &[Bytes::gib(4)], None);
}

/// The hybrid's recurrent state is a pool of slots committed before KV is
/// sized; KV still fills what is left, so the card rests within a KV chunk
/// of floor + margin with KV and state both counted.
#[test]
fn kv_fills_a_card_beside_the_hybrids_state() {
    for gib in [1, 8] {
        fills("qwen3_5", &[Bytes::gib(gib)], None);
    }
}

/// A layout's arena spans its cards: each card of an even TP pair holds half
/// of every page, and both are filled.
#[test]
fn kv_fills_every_card_of_a_layout() {
    let tp2 = LayoutSpec { tp: 2, tp_split: Split::Even, pp: 1, pp_split: Split::Even };
    fills("llama-f32", &[Bytes::gib(4), Bytes::gib(4)], Some(tp2));
    let pp2 = LayoutSpec { tp: 1, tp_split: Split::Even, pp: 2, pp_split: Split::Even };
    fills("llama-f32", &[Bytes::gib(1), Bytes::gib(1)], Some(pp2));
}

/// The process's resident memory.
fn rss() -> Bytes {
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS");
    Bytes(line.split_whitespace().nth(1).expect("kB").parse::<u64>().expect("number") * 1024)
}

/// A filled sim card's KV is simulated memory: the CPU ranks back a block of
/// it with host memory only once it is written, so booting an 8 GiB card
/// (and serving on it) takes a small part of that from the host.
#[cfg(target_os = "linux")]
#[test]
fn a_filled_sim_card_costs_the_host_only_the_kv_written() {
    let before = rss();
    let mut opts = BootOptions::new(fixture("llama-f32"));
    opts.devices = Devices::Sim(vec![Bytes::gib(8)]);
    opts.max_running = 4;
    opts.context_len = Some(256);
    let booted = boot(&opts, |_, _| {}).unwrap();
    let kv = booted.governor.memory_report().cards[0].books.kv_committed;
    assert!(kv > Bytes::gib(6), "KV fills the card: {kv}");
    let req = corridor_engine::engine::GenerateRequest {
        prompt: (3..40).map(TokenId).collect(),
        params: corridor_engine::sampling::SamplingParams { temperature: 0.0, ..Default::default() },
        max_new_tokens: Some(8),
        eos_ids: vec![],
        constraint: None,
    };
    let mut stream = booted.engine.submit(req).unwrap();
    while let Some(e) = stream.next_blocking() {
        if matches!(e, corridor_engine::engine::Event::Done { .. }) {
            break;
        }
    }
    // Other tests of this binary boot at the same time, so the bound is
    // loose; KV backed on the host at boot would be over 6 GiB.
    let grew = rss().saturating_sub(before);
    assert!(grew < Bytes::gib(1), "the host backs {grew} for {kv} of simulated KV");
    booted.engine.shutdown();
}

/// KV pages the host card's arena holds under a 2 MiB KV budget (less than
/// the running requests could use), with the CPU's KV stored as `kv` says
/// (`None`: as the checkpoint warrants).
fn host_kv_pages(model: &str, kv: Option<corridor_backend::cpu::KvPrecision>) -> usize {
    let mut opts = BootOptions::new(fixture(model));
    opts.context_len = Some(2048);
    opts.max_running = 64;
    opts.kv_budget = Bytes::mib(2);
    opts.cpu_kv = kv;
    let booted = boot(&opts, |_, _| {}).unwrap();
    let arenas = booted.governor.arenas();
    let arena = arenas.iter().find(|a| a.purpose() == Purpose::Kv).expect("a KV arena");
    arena.backed().get()
}

/// f16 KV holds twice the tokens of f32 in the same budget, and is what a
/// quantized file gets by default; an f32 checkpoint keeps f32.
#[test]
fn the_cpu_kv_in_f16_holds_twice_the_tokens_and_is_the_default_for_quantized_files() {
    use corridor_backend::cpu::KvPrecision;
    let gguf = "kquant/llama-k-Q4_K_M.gguf";
    let (f32_pages, f16_pages) =
        (host_kv_pages(gguf, Some(KvPrecision::F32)), host_kv_pages(gguf, Some(KvPrecision::F16)));
    assert!(f32_pages > 0);
    // Twice, within the arena's rounding to whole chunks.
    let ratio = f16_pages as f64 / f32_pages as f64;
    assert!((1.9..=2.1).contains(&ratio), "f16 {f16_pages} pages against f32 {f32_pages}");
    assert_eq!(host_kv_pages(gguf, None), f16_pages, "a quantized file stores f16 by default");
    assert_eq!(
        host_kv_pages("llama-f32", None),
        host_kv_pages("llama-f32", Some(KvPrecision::F32)),
        "an f32 checkpoint keeps f32"
    );
}
