//! The floor guard and the chokepoint: each rule of DESIGN.md §3.2 with a
//! test that fails without its mechanism.

mod common;

use common::{clock, names, sim, TestProvider};
use corridor_units::{Bytes, CardId};
use corridor_vram::{
    Card, CardSettings, Device, Governor, GovernorConfig, Purpose, RefusalReason, ReserveRequest, Tier,
    Urgency,
};
use std::sync::{Arc, Mutex};

fn settings() -> CardSettings {
    CardSettings::default()
}

#[test]
fn grants_without_arming_when_the_floor_holds() {
    let c = clock();
    let dev = Device::standalone(sim(&c, 0, Bytes::gib(8)), settings());
    let a = dev.reserve(Bytes::gib(6), Purpose::Weights).unwrap();
    assert_eq!(a.bytes(), Bytes::gib(6));
    assert_eq!(dev.books().weights, Bytes::gib(6));
    assert_eq!(dev.guard_stats().arms, 0);
}

#[test]
fn allocations_book_and_unbook_on_drop() {
    let c = clock();
    let card = sim(&c, 0, Bytes::gib(8));
    let dev = Device::standalone(card.clone(), settings());
    let a = dev.reserve(Bytes::gib(1), Purpose::Workspace).unwrap();
    assert_eq!(card.driver_free(), Bytes::gib(7));
    assert_eq!(dev.books().workspace, Bytes::gib(1));
    drop(a);
    assert_eq!(card.driver_free(), Bytes::gib(8));
    assert_eq!(dev.books().total(), Bytes::ZERO);
}

#[test]
fn refuses_when_exhausted_and_books_nothing() {
    let c = clock();
    let card = sim(&c, 0, Bytes::gib(8));
    let dev = Device::standalone(card.clone(), settings());
    let err = dev.reserve(Bytes::mib(7 * 1024 + 1), Purpose::Weights).unwrap_err();
    assert_eq!(err.reason, RefusalReason::Floor);
    assert_eq!(err.card, CardId(0));
    assert!(err.to_string().contains("refused"), "{err}");
    assert_eq!(dev.books().total(), Bytes::ZERO);
    assert_eq!(card.driver_free(), Bytes::gib(8));
    // Exactly at the floor is allowed.
    assert!(dev.reserve(Bytes::gib(7), Purpose::Weights).is_ok());
}

#[test]
fn a_lying_provider_is_not_credited() {
    let c = clock();
    let card = sim(&c, 0, Bytes::gib(8));
    let dev = Device::standalone(card.clone(), settings());
    let log = Arc::new(Mutex::new(Vec::new()));
    let honest = TestProvider::honest("cache", Tier::Local, 10, &dev, 4, Bytes::gib(1), &log);
    dev.register_provider(TestProvider::liar("liar", Tier::Local, 0, CardId(0), Bytes::gib(10), &log));
    dev.register_provider(honest.clone());
    // free 4 GiB; want 4 GiB would leave 0 < floor.
    let a = dev.reserve(Bytes::gib(4), Purpose::Kv).unwrap();
    assert_eq!(names(&log), vec!["liar", "cache"], "the liar's claim must not end the search");
    assert!(card.driver_free() >= Bytes::gib(1), "the floor held: {}", card.driver_free());
    let stats = dev.guard_stats();
    assert_eq!(stats.overclaimed, Bytes::gib(10));
    drop(a);

    // With only the liar left to spend, the guard refuses.
    let dev2 = Device::standalone(sim(&c, 1, Bytes::gib(8)), settings());
    dev2.register_provider(TestProvider::liar("liar", Tier::Local, 0, CardId(1), Bytes::gib(10), &log));
    let err = dev2.reserve(Bytes::gib(7) + Bytes(1), Purpose::Kv).unwrap_err();
    assert_eq!(err.reason, RefusalReason::Floor);
}

#[test]
fn tier_outranks_cost() {
    let c = clock();
    let dev = Device::standalone(sim(&c, 0, Bytes::gib(8)), settings());
    let log = Arc::new(Mutex::new(Vec::new()));
    // Registered cheapest first, so registration order cannot explain the result.
    dev.register_provider(TestProvider::honest("park", Tier::Park, 0, &dev, 2, Bytes::gib(1), &log));
    dev.register_provider(TestProvider::honest("local", Tier::Local, 100, &dev, 2, Bytes::gib(1), &log));
    let _a = dev.reserve(Bytes::gib(4) + Bytes::mib(512), Purpose::Kv).unwrap();
    assert_eq!(names(&log), vec!["local"], "Local is spent first and sufficed");
}

#[test]
fn arming_aims_for_floor_plus_delta_plus_want() {
    let c = clock();
    let dev = Device::standalone(sim(&c, 0, Bytes::gib(8)), settings());
    let log = Arc::new(Mutex::new(Vec::new()));
    let p = TestProvider::honest("cache", Tier::Local, 0, &dev, 5, Bytes::gib(1), &log);
    dev.register_provider(p);
    // free 3 GiB, want 2.5 GiB: target 1 GiB + 256 MiB + 2.5 GiB, need 768 MiB.
    let _a = dev.reserve(Bytes::mib(2560), Purpose::Kv).unwrap();
    assert_eq!(log.lock().unwrap()[0].1, Bytes::mib(768));
}

#[test]
fn the_law_floor_decides_refusals_not_the_arming_floor() {
    let c = clock();
    let s = CardSettings { arm_margin: Bytes::mib(512), ..settings() };
    let dev = Device::standalone(sim(&c, 0, Bytes::gib(8)), s);
    // Leaves 1.25 GiB: under the arming floor (1.5 GiB), above the law (1 GiB).
    let a = dev.reserve(Bytes::mib(8192 - 1280), Purpose::Weights).unwrap();
    assert_eq!(dev.guard_stats().arms, 1, "it armed");
    drop(a);
    let err = dev.reserve(Bytes::mib(8192 - 1000), Purpose::Weights).unwrap_err();
    assert_eq!(err.reason, RefusalReason::Floor);
}

#[test]
fn the_card_budget_is_enforced() {
    let c = clock();
    let s = CardSettings { budget: Some(Bytes::gib(2)), ..settings() };
    let dev = Device::standalone(sim(&c, 0, Bytes::gib(16)), s);
    let a = dev.reserve(Bytes::mib(1536), Purpose::Weights).unwrap();
    let err = dev.reserve(Bytes::gib(1), Purpose::Kv).unwrap_err();
    assert_eq!(err.reason, RefusalReason::Budget);
    assert!(dev.books().total() <= Bytes::gib(2));
    drop(a);
    assert!(dev.reserve(Bytes::gib(1), Purpose::Kv).is_ok());
}

#[test]
fn card_failures_become_refusals() {
    let c = clock();
    let card = sim(&c, 0, Bytes::gib(8));
    let dev = Device::standalone(card.clone(), settings());
    card.inject_failures(1);
    let err = dev.reserve(Bytes::mib(2), Purpose::Other).unwrap_err();
    assert!(matches!(err.reason, RefusalReason::Card(_)), "{err}");
    assert_eq!(dev.books().total(), Bytes::ZERO);
    assert!(dev.reserve(Bytes::mib(2), Purpose::Other).is_ok());
}

#[test]
fn opportunistic_requests_never_spend_providers() {
    let c = clock();
    let dev = Device::standalone(sim(&c, 0, Bytes::gib(8)), settings());
    let log = Arc::new(Mutex::new(Vec::new()));
    dev.register_provider(TestProvider::honest("cache", Tier::Local, 0, &dev, 4, Bytes::gib(1), &log));
    let req = ReserveRequest { want: Bytes::gib(4), purpose: Purpose::Kv, urgency: Urgency::Opportunistic };
    assert_eq!(dev.reserve_with(req).unwrap_err().reason, RefusalReason::NoSpareHeadroom);
    assert!(log.lock().unwrap().is_empty());
    let req = ReserveRequest { want: Bytes::gib(2), ..req };
    assert!(dev.reserve_with(req).is_ok());
}

/// Two sim cards of 8 GiB in one governor; the second is returned for the
/// test to fill.
#[test]
fn an_allocation_that_lands_under_the_floor_is_undone_and_asked_for_again() {
    // 8 GiB card, 1 GiB floor: 2 GiB of ours, then 4 GiB more asked for
    // while another process takes 2 GiB between the guard's probe and the
    // driver's allocation. The 4 GiB fit what the driver then had free, so
    // the allocation succeeds and leaves 0 free: it must not stay.
    let c = clock();
    let card = sim(&c, 0, Bytes::gib(8));
    let dev = Device::standalone(card.clone(), settings());
    let _held = dev.reserve(Bytes::gib(2), Purpose::Weights).unwrap();
    card.intrude_during_next_take(77, Bytes::gib(2));
    let err = dev.reserve(Bytes::gib(4), Purpose::Workspace).unwrap_err();
    assert_eq!(err.reason, RefusalReason::Floor, "{err}");
    assert_eq!(dev.guard_stats().landings_undone, 1);
    assert_eq!(dev.books().total(), Bytes::gib(2), "nothing of the undone allocation stays booked");
    assert_eq!(card.our_bytes(), Bytes::gib(2), "nor held");
    assert_eq!(card.driver_free(), Bytes::gib(4));

    // A KV commit in the same race: undone; asked again, the guard sees the
    // card as it is and grants what still fits above the floor.
    let va = dev.reserve_va(Bytes::gib(4)).unwrap();
    card.intrude_during_next_take(78, Bytes::mib(2560));
    let err = dev.commit(&va, Bytes::ZERO, Bytes::gib(1), Urgency::Deferrable).unwrap_err();
    assert_eq!(err.reason, RefusalReason::Floor, "{err}");
    assert_eq!(dev.guard_stats().landings_undone, 2);
    assert_eq!(dev.books().kv_committed, Bytes::ZERO);
    assert!(card.driver_free() >= settings().floor);
    let fits = dev.commit(&va, Bytes::ZERO, Bytes::mib(256), Urgency::Deferrable).unwrap();
    assert_eq!(fits.bytes(), Bytes::mib(256));
    assert!(card.driver_free() >= settings().floor);
}

fn two_cards() -> (Arc<corridor_vram::SimCard>, Governor) {
    let c = clock();
    let card1 = sim(&c, 1, Bytes::gib(8));
    let cards: Vec<Arc<dyn Card>> = vec![sim(&c, 0, Bytes::gib(8)), card1.clone()];
    let gov = Governor::new(cards, GovernorConfig::uniform(2, settings()), c).unwrap();
    (card1, gov)
}

#[test]
fn the_host_tier_opens_only_when_level_or_deadlocked() {
    let (card1, gov) = two_cards();
    let dev = gov.device(CardId(0)).unwrap().clone();
    let log = Arc::new(Mutex::new(Vec::new()));
    gov.register_provider(TestProvider::honest("host", Tier::Host, 0, &dev, 6, Bytes::gib(1), &log));
    let want = Bytes::gib(4);

    // card1 has 8 GiB free: the fleet is not level, a deferrable request is refused.
    assert_eq!(dev.reserve(want, Purpose::Kv).unwrap_err().reason, RefusalReason::Floor);
    assert!(log.lock().unwrap().is_empty(), "host tier stayed closed");

    // Refusing would deadlock: the tier opens.
    let a =
        dev.reserve_with(ReserveRequest { want, purpose: Purpose::Kv, urgency: Urgency::Blocking }).unwrap();
    assert_eq!(names(&log), vec!["host"]);
    assert_eq!(dev.guard_stats().host_openings_deadlock, 1);
    drop(a);

    // card1 filled to floor + delta by another process: the fleet is level.
    card1.set_foreign(777, Bytes::gib(8) - Bytes::mib(1024 + 256));
    let free0 = dev.card().driver_free();
    let _b = dev.reserve(free0 - Bytes::mib(512), Purpose::Kv).unwrap();
    assert_eq!(dev.guard_stats().host_openings_level, 1);
}
