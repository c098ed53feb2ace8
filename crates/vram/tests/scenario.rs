//! Whole-governor scenarios on sim cards under a manual clock: sizing, an
//! intrusion and its relief, KV growing back, the card budget, the flight
//! recorder, the ledger and the memory report.

use corridor_units::{Bytes, CardId, Pages};
use corridor_vram::ledger::{CardLedger, PostKind, Provenance};
use corridor_vram::recorder::{self, BootId, BootPhase, FlightRecorder, MarkIdentity, MarkKind};
use corridor_vram::sizing::{solve, Sizing, SizingBound, SizingInput};
use corridor_vram::{
    render_table, Card, CardSettings, Clock, Governor, GovernorConfig, KvArena, KvArenaConfig, ManualClock,
    Purpose, RefusalReason, SimCard, SimCardSpec, SimEvent, Urgency,
};
use std::sync::Arc;
use std::time::Duration;

const PAGE: Bytes = Bytes(256 * 1024);
const MARGIN: Bytes = Bytes::mib(64);
const TICK: Duration = Duration::from_millis(100);
const HOLD: Duration = Duration::from_secs(2);

struct Boot {
    clock: Arc<ManualClock>,
    cards: Vec<Arc<SimCard>>,
    gov: Governor,
    arenas: Vec<Arc<KvArena>>,
    sizings: Vec<Sizing>,
    // Held for the boot's lifetime: dropping them would free the memory.
    _resident: Vec<corridor_vram::Allocation>,
    dir: tempfile::TempDir,
}

/// Boot three sim cards (32, 20, 20 GiB; card0 with a driver carve-out and a
/// context residue) the way the engine will: weights, workspace, then KV
/// sized from the measured free column, with boot marks along the way.
fn boot(events: &[SimEvent], budgets: [Option<Bytes>; 3]) -> Boot {
    let clock = Arc::new(ManualClock::new());
    let totals = [Bytes::gib(32), Bytes::gib(20), Bytes::gib(20)];
    let cards: Vec<Arc<SimCard>> = totals
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut spec = SimCardSpec::new(CardId(i as u32), *t);
            if i == 0 {
                spec.carve_out = Bytes::mib(615);
                spec.residue = Bytes::mib(518);
            }
            Arc::new(SimCard::new(spec, events, clock.clone()))
        })
        .collect();
    let mut config = GovernorConfig::uniform(3, CardSettings::default());
    for (s, b) in config.cards.iter_mut().zip(budgets) {
        s.budget = b;
    }
    config.kv_hold = HOLD;
    config.serving_mark_interval = Duration::from_secs(1);
    let dyn_cards: Vec<Arc<dyn Card>> = cards.iter().map(|c| c.clone() as Arc<dyn Card>).collect();
    let gov = Governor::new(dyn_cards, config, clock.clone()).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let ident = MarkIdentity { boot_id: BootId::new(1, 42), rank: None };
    let rec =
        Arc::new(FlightRecorder::open(dir.path(), ident, Duration::from_secs(1), clock.clone()).unwrap());
    rec.boot_mark(BootPhase::ProcessStart, gov.devices()).unwrap();
    let mut resident = Vec::new();
    for (dev, weights) in gov.devices().iter().zip([Bytes::gib(8), Bytes::gib(4), Bytes::gib(4)]) {
        resident.push(dev.reserve(weights, Purpose::Weights).unwrap());
    }
    rec.boot_mark(BootPhase::WeightsLoaded, gov.devices()).unwrap();
    for dev in gov.devices() {
        resident.push(dev.reserve(Bytes::mib(512), Purpose::Workspace).unwrap());
    }
    rec.boot_mark(BootPhase::WorkspaceReady, gov.devices()).unwrap();
    let mut arenas = Vec::new();
    let mut sizings = Vec::new();
    for dev in gov.devices() {
        let max_pages = Pages((dev.card().total().get() / PAGE.get()) as usize);
        let cfg = KvArenaConfig {
            page_bytes: PAGE,
            max_pages,
            chunk_target: Bytes::mib(32),
            hold: HOLD,
            margin: Bytes::ZERO,
        };
        let arena = Arc::new(KvArena::new(dev, cfg, clock.clone()).unwrap());
        let sizing =
            solve(SizingInput::measure(dev, MARGIN, Bytes::ZERO, arena.geometry(), arena.capacity()));
        arena.commit_to(sizing.pages, Urgency::Deferrable).unwrap();
        gov.attach_arena(arena.clone());
        arenas.push(arena);
        sizings.push(sizing);
    }
    rec.boot_mark(BootPhase::KvSized, gov.devices()).unwrap();
    rec.boot_mark(BootPhase::BootComplete, gov.devices()).unwrap();
    gov.attach_recorder(rec);
    Boot { clock, cards, gov, arenas, sizings, _resident: resident, dir }
}

fn chunk(b: &Boot) -> Bytes {
    b.arenas[0].geometry().chunk_bytes
}

/// Tick the governor every 100 ms until `until`, checking the budget.
fn run_until(b: &Boot, until: Duration) {
    while b.clock.now() < until {
        b.clock.advance(TICK);
        b.gov.tick();
        for dev in b.gov.devices() {
            if let Some(budget) = dev.settings().budget {
                assert!(dev.books().total() <= budget, "{} over its budget", dev.id());
            }
        }
    }
}

#[test]
fn after_boot_every_card_rests_within_one_chunk_above_floor_and_margin() {
    let b = boot(&[], [None; 3]);
    for (card, s) in b.cards.iter().zip(&b.sizings) {
        let rest = card.driver_free();
        let low = CardSettings::default().floor + MARGIN;
        assert!(rest >= low && rest < low + chunk(&b), "{}: rests at {rest}", card.id());
        assert_eq!(s.bound, SizingBound::FreeMemory);
    }
    // The big card is not held to the small cards' capacity.
    assert!(b.sizings[0].pages > b.sizings[1].pages);
    assert_eq!(b.gov.devices()[1].guard_stats().arms, 0, "sizing never made the guard arm");
}

#[test]
fn an_intrusion_is_relieved_within_a_second_and_kv_grows_back() {
    let events = [
        SimEvent { at_s: 5.0, card: 1, pid: 4242, bytes: Bytes::gib(3).get() },
        SimEvent { at_s: 9.0, card: 1, pid: 4242, bytes: 0 },
    ];
    let b = boot(&events, [None; 3]);
    let target = b.arenas[1].backed();
    run_until(&b, Duration::from_millis(5500));
    assert!(b.arenas[1].backed() < target, "KV gave way to the intruder");
    let s1 = b.gov.sampler().stats(CardId(1)).unwrap();
    assert!(s1.open.is_none(), "the floor is back");
    assert!(s1.intrusions >= 1);
    assert!(s1.restore_ms_max.unwrap() <= 1000, "restored in {:?} ms", s1.restore_ms_max);
    assert_eq!(s1.episodes[0].intruders[0].pid, 4242, "the intruder is named");
    assert!(b.cards[1].driver_free() >= CardSettings::default().floor);

    run_until(&b, Duration::from_secs(15));
    assert_eq!(b.arenas[1].backed(), target, "KV grew back after the intruder left");
    let rest = b.cards[1].driver_free();
    assert!(rest < CardSettings::default().floor + MARGIN + chunk(&b), "card1 rests at {rest}");
    for card in [0, 1, 2] {
        let s = b.gov.sampler().stats(CardId(card)).unwrap();
        assert_eq!(s.breaches, 0, "card{card} breached");
        assert!(s.min_free.is_some());
    }
    assert_eq!(b.gov.sampler().stats(CardId(0)).unwrap().intrusions, 0);

    // A serving mark written during the intrusion names the foreign pid.
    let marks = recorder::read_dir(b.dir.path()).unwrap();
    let named = marks
        .iter()
        .filter(|m| m.kind == MarkKind::Serving && m.card == CardId(1))
        .any(|m| m.foreign().iter().any(|p| p.pid == 4242));
    assert!(named, "no serving mark names pid 4242");

    let report = b.gov.memory_report();
    assert_eq!(report.cards[1].intrusions, s1.intrusions.max(report.cards[1].intrusions));
    assert!(report.cards[1].min_free_bytes < CardSettings::default().floor);
}

/// Relief that runs before the sampler's next period still leaves the dip on
/// record: a card found under its floor is sampled before it is relieved.
#[test]
fn relief_never_ends_a_dip_the_sampler_has_not_seen() {
    let events = [SimEvent { at_s: 1.0, card: 2, pid: 77, bytes: Bytes::mib(512).get() }];
    let b = boot(&events, [None; 3]);
    b.clock.advance(Duration::from_millis(1100));
    let before = b.cards[2].driver_free();
    assert!(before < CardSettings::default().floor, "the intruder took card2 under its floor");
    // Only the relief step runs: no sample of the dip was taken before it.
    b.gov.relieve();
    assert!(b.cards[2].driver_free() > before, "relief gave memory back");
    let s = b.gov.sampler().stats(CardId(2)).unwrap();
    assert_eq!(s.intrusions, 1, "the dip is on record: {s:?}");
    assert!(s.min_free.unwrap() < CardSettings::default().floor);
}

#[test]
fn a_card_budget_is_never_exceeded() {
    let budget = Bytes::gib(12);
    let events = [SimEvent { at_s: 1.0, card: 0, pid: 7, bytes: Bytes::gib(30).get() }];
    let b = boot(&events, [Some(budget), None, None]);
    assert_eq!(b.sizings[0].bound, SizingBound::Budget);
    assert!(b.gov.devices()[0].books().total() <= budget);
    let dev = &b.gov.devices()[0];
    // Room under the budget is made by releasing idle KV first.
    let staging = dev.reserve(Bytes::gib(1), Purpose::Staging).unwrap();
    assert!(dev.books().total() <= budget);
    assert!(dev.guard_stats().provider_calls >= 1);
    drop(staging);
    // More than the budget can ever hold beside the weights: refused.
    let err = dev.reserve(Bytes::gib(4), Purpose::Staging).unwrap_err();
    assert_eq!(err.reason, RefusalReason::Budget);
    assert!(dev.books().total() <= budget);
    // The intruder on card0 takes what is free; relief and regrowth run under the budget.
    run_until(&b, Duration::from_secs(4));
    assert!(b.gov.devices()[0].books().total() <= budget);
}

#[test]
fn the_ledger_closes_with_zero_drift_on_sim_cards() {
    let b = boot(&[], [None; 3]);
    let marks = recorder::read_dir(b.dir.path()).unwrap();
    let boot_id = recorder::latest_boot(&marks).unwrap();
    assert_eq!(recorder::group_by_boot_and_pid(&marks).len(), 1);
    for (i, (dev, s)) in b.gov.devices().iter().zip(&b.sizings).enumerate() {
        let card = dev.id();
        let mark = recorder::boot_mark_of(&marks, &boot_id, card, BootPhase::BootComplete).unwrap();
        let mut ledger = CardLedger::new(card, mark.total_bytes, mark.carve_out_bytes, Bytes::ZERO);
        let weights = [Bytes::gib(8), Bytes::gib(4), Bytes::gib(4)][i];
        let modeled = |k: &str, v: String| Provenance::Modeled { inputs: vec![(k.to_string(), v)] };
        ledger
            .post(PostKind::Weights, weights, modeled("checkpoint bytes", weights.to_string()))
            .post(PostKind::Workspace, Bytes::mib(512), modeled("max batched tokens", "8192".into()))
            .post(PostKind::Kv, s.bytes, modeled("pages", s.pages.to_string()))
            .post(PostKind::Floor, dev.settings().floor, Provenance::Declared { by: "--floor-mib".into() })
            .transient("prefill activations", None);
        let verdict = ledger.fits();
        assert!(verdict.fits, "{verdict:?}");
        assert_eq!(verdict.unbounded, vec!["prefill activations".to_string()]);

        let recon = ledger.reconcile(&mark);
        assert_eq!(recon.drift, 0, "{recon}");
        // card0's context residue has no post: it is its own row, not
        // folded into a neighbour's error.
        let expect_residuum = if i == 0 { Bytes::mib(518).get() as i64 } else { 0 };
        assert_eq!(recon.residuum, expect_residuum, "{recon}");
        for row in recon.rows.iter().filter(|r| r.name != "floor") {
            assert_eq!(row.error, 0, "{recon}");
        }
        assert!(recon.to_string().contains("residuum"));

        // With the residue posted as measured, nothing is left unclaimed.
        ledger.post(
            PostKind::Residue,
            Bytes(expect_residuum as u64),
            Provenance::Measured { mark: "boot_complete".into() },
        );
        assert_eq!(ledger.reconcile(&mark).residuum, 0);
    }
    let report = b.gov.memory_report();
    assert!(report.cards.iter().all(|c| c.drift_bytes == 0), "{report:?}");
    assert_eq!(report.cards[0].residue_bytes, Bytes::mib(518).get() as i64);
}

#[test]
fn a_plan_that_does_not_fit_says_so() {
    let mut ledger = CardLedger::new(CardId(0), Bytes::gib(20), Bytes::mib(615), Bytes::ZERO);
    ledger.post(PostKind::Weights, Bytes::gib(19), Provenance::Modeled { inputs: vec![] }).post(
        PostKind::Floor,
        Bytes::gib(1),
        Provenance::Declared { by: "default".into() },
    );
    assert!(!ledger.fits().fits);
}

#[test]
fn the_memory_report_serializes_and_renders() {
    let events = [SimEvent { at_s: 0.0, card: 2, pid: 999, bytes: Bytes::mib(100).get() }];
    let b = boot(&events, [None; 3]);
    run_until(&b, Duration::from_millis(300));
    let report = b.gov.memory_report();
    let json = serde_json::to_value(&report).unwrap();
    let card = &json["cards"][0];
    for key in [
        "card",
        "uuid",
        "total_bytes",
        "free_bytes",
        "floor_bytes",
        "min_free_bytes",
        "breaches",
        "intrusions",
        "restore_ms_max",
        "foreign_bytes",
        "residue_bytes",
        "drift_bytes",
        "books",
    ] {
        assert!(card.get(key).is_some(), "missing {key}");
    }
    assert!(card["books"].get("kv_committed").is_some() && card["books"].get("kv_reserved").is_some());
    assert!(json.get("spread_bytes").is_some());
    let back: corridor_vram::MemoryReport = serde_json::from_value(json).unwrap();
    assert_eq!(back, report);
    let table = render_table(&report);
    assert!(table.lines().count() >= 4, "{table}");
    assert!(table.contains("card2") && table.contains("foreign pid 999"), "{table}");
}

#[test]
fn torn_marks_are_tolerated_and_bad_ones_are_not() {
    let b = boot(&[], [None; 3]);
    let path = std::fs::read_dir(b.dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().contains("flight_boot"))
        .unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let whole = recorder::parse_marks(&path, &text).unwrap();
    assert_eq!(whole.marks.len(), 5 * 3);
    assert!(!whole.torn_tail);
    let torn = format!("{text}{}", &text[..40]);
    let parsed = recorder::parse_marks(&path, &torn).unwrap();
    assert!(parsed.torn_tail);
    assert_eq!(parsed.marks, whole.marks);
    let broken = format!("{}\n{text}", &text[..40]);
    assert!(recorder::parse_marks(&path, &broken).is_err());
}
