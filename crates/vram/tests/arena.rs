//! The KV arena: page ids, holes released anywhere, live pages moved out of
//! sparse chunks, non-destructive shrink, recovery after the hold time and
//! within the margin, and the page-count invariant.

mod common;

use common::{clock, sim};
use corridor_units::{Bytes, PageId, Pages};
use corridor_vram::{
    ArenaError, Card, CardSettings, ChunkGeometry, Device, KvArena, KvArenaConfig, ManualClock, Purpose,
    ReliefProvider, Urgency,
};
use proptest::prelude::*;
use std::sync::Arc;
use std::time::Duration;

const PAGE: Bytes = Bytes(256 * 1024);
/// 2 MiB chunks of eight 256 KiB pages.
const CP: usize = 8;
const HOLD: Duration = Duration::from_secs(5);

fn arena_on(
    c: &Arc<ManualClock>,
    total: Bytes,
    max_pages: usize,
) -> (Arc<corridor_vram::SimCard>, Device, Arc<KvArena>) {
    let card = sim(c, 0, total);
    let dev = Device::standalone(card.clone(), CardSettings::default());
    let cfg = KvArenaConfig {
        page_bytes: PAGE,
        max_pages: Pages(max_pages),
        chunk_target: Bytes::mib(2),
        hold: HOLD,
        margin: Bytes::ZERO,
    };
    let arena = Arc::new(KvArena::new(&dev, cfg, c.clone()).unwrap());
    (card, dev, arena)
}

#[test]
fn chunk_geometry_packs_pages_into_granules() {
    let g = ChunkGeometry::new(PAGE, Bytes::mib(2), Bytes::mib(2)).unwrap();
    assert_eq!((g.chunk_pages, g.chunk_bytes), (8, Bytes::mib(2)));
    // 1.75 MiB pages: eight fill 14 MiB exactly.
    let g = ChunkGeometry::new(Bytes(1_835_008), Bytes::mib(2), Bytes::mib(2)).unwrap();
    assert_eq!((g.chunk_pages, g.chunk_bytes), (8, Bytes::mib(14)));
    assert_eq!(g.page_offset(PageId(9)), Bytes::mib(14) + Bytes(1_835_008));
    // A page size that never packs exactly: whole pages, rounded up to granules.
    let g = ChunkGeometry::new(Bytes(1000), Bytes::mib(2), Bytes::mib(2)).unwrap();
    assert_eq!((g.chunk_pages, g.chunk_bytes), (2097, Bytes::mib(2)));
    assert_eq!(g.page_offset(PageId(2097)), Bytes::mib(2));
    assert!(ChunkGeometry::new(Bytes::ZERO, Bytes::mib(2), Bytes::mib(2)).is_err());
}

#[test]
fn reservation_takes_no_memory_and_commits_are_booked() {
    let c = clock();
    let (card, dev, arena) = arena_on(&c, Bytes::gib(4), 1024);
    assert_eq!(card.driver_free(), Bytes::gib(4));
    assert_eq!(dev.books().kv_reserved, Bytes::mib(256));
    arena.commit_to(Pages(3 * CP), Urgency::Deferrable).unwrap();
    assert_eq!(dev.books().kv_committed, Bytes::mib(6));
    assert_eq!(card.driver_free(), Bytes::gib(4) - Bytes::mib(6));
    drop(arena);
    assert_eq!(dev.books().kv_committed, Bytes::ZERO);
    assert_eq!(dev.books().kv_reserved, Bytes::ZERO);
    assert_eq!(card.driver_free(), Bytes::gib(4));
}

#[test]
fn withheld_ids_are_never_handed_out() {
    let c = clock();
    let (_card, _dev, arena) = arena_on(&c, Bytes::gib(4), 64);
    arena.commit_to(Pages(2 * CP), Urgency::Deferrable).unwrap();
    let ids: Vec<PageId> = std::iter::from_fn(|| arena.alloc()).collect();
    assert_eq!(ids.len(), 2 * CP, "only backed ids");
    assert!(ids.iter().all(|id| id.index() < arena.backed().get()));
    let counts = arena.check_invariants().unwrap();
    assert_eq!(counts.withheld, Pages(64 - 2 * CP));
    assert!(matches!(arena.alloc_many(Pages(1)), Err(ArenaError::Exhausted { .. })));
}

#[test]
fn free_chunks_are_released_wherever_they_sit() {
    let c = clock();
    let (card, dev, arena) = arena_on(&c, Bytes::gib(4), 64);
    arena.commit_to(Pages(4 * CP), Urgency::Deferrable).unwrap();
    let ids = arena.alloc_many(Pages(4 * CP)).unwrap();
    let live = PageId(20); // in chunk 2
    for id in ids.iter().filter(|id| **id != live) {
        arena.release(*id).unwrap();
    }
    let out = arena.shrink_to(Pages(0));
    assert_eq!(out.chunks, 3, "every chunk without a live page goes, under the live one too");
    assert_eq!(arena.backed(), Pages(CP));
    assert!(arena.is_backed(live), "the live page is still backed");
    assert!(!arena.is_backed(PageId(0)) && !arena.is_backed(PageId(3 * CP as u32)));
    assert_eq!(dev.books().kv_committed, Bytes::mib(2));
    // Ids in the holes are never handed out: only the live page's chunk has free ids.
    let again: Vec<PageId> = std::iter::from_fn(|| arena.alloc()).collect();
    assert_eq!(again.len(), CP - 1);
    assert!(again.iter().all(|id| id.index() / CP == 2), "{again:?}");
    for id in again {
        arena.release(id).unwrap();
    }
    // Growth fills the lowest hole first.
    arena.ensure_free(Pages(CP + 1), Urgency::Deferrable).unwrap();
    assert!(arena.is_backed(PageId(0)) && !arena.is_backed(PageId(CP as u32)));
    assert_eq!(arena.alloc(), Some(PageId(0)), "the lowest free id first");
    arena.release(PageId(0)).unwrap();
    arena.release(live).unwrap();
    let out = arena.shrink_to(Pages(0));
    assert_eq!(out.chunks, 2);
    assert_eq!(arena.backed(), Pages(0));
    assert_eq!(card.driver_free(), Bytes::gib(4));
    arena.check_invariants().unwrap();
}

#[test]
fn live_pages_move_out_of_sparse_chunks_so_they_can_be_released() {
    let c = clock();
    let (card, _dev, arena) = arena_on(&c, Bytes::gib(4), 64);
    arena.commit_to(Pages(4 * CP), Urgency::Deferrable).unwrap();
    let ids = arena.alloc_many(Pages(4 * CP)).unwrap();
    // Two live pages in each of chunks 1 and 3, one of them cached with a
    // second holder elsewhere: every chunk holds something, nothing is free.
    let keep = [PageId(9), PageId(12), PageId(25), PageId(30)];
    arena.retain(PageId(12)).unwrap();
    for id in ids.iter().filter(|id| !keep.contains(id)) {
        arena.release(*id).unwrap();
    }
    arena.release_to_cache(PageId(30)).unwrap();
    assert_eq!(arena.shrink_to(Pages(0)).chunks, 2, "chunks 0 and 2 go; 1 and 3 are pinned");
    assert_eq!(arena.free_chunks(), 0);
    let free_before = card.driver_free();
    // One more chunk: the sparsest, highest first (chunk 3), moves into the
    // lowest free pages of chunk 1.
    let plan = arena.plan_vacate(1);
    assert_eq!(plan.chunks, vec![3]);
    assert_eq!(plan.moves, vec![(PageId(25), PageId(8)), (PageId(30), PageId(10))]);
    assert_eq!(arena.alloc(), Some(PageId(11)), "the destinations are taken during the copy");
    arena.release(PageId(11)).unwrap();
    arena.finish_moves(&plan.moves).unwrap();
    assert_eq!(arena.counts().cached, Pages(1));
    assert!(arena.evict(PageId(10)).is_ok() && arena.release_to_cache(PageId(8)).is_ok());
    assert_eq!(arena.stats().pages_moved, 2);
    assert_eq!(arena.free_chunks(), 1);
    assert_eq!(arena.release_idle(Bytes::mib(1)).chunks, 1);
    assert_eq!(card.driver_free(), free_before + Bytes::mib(2));
    assert!(!arena.is_backed(PageId(25)));
    // Emptying the last chunk needs a chunk of free pages elsewhere: none left.
    assert_eq!(arena.plan_vacate(1), corridor_vram::Vacate::default());
    // A finished move is checked whole first.
    assert!(arena.finish_moves(&[(PageId(13), PageId(14))]).is_err());
    arena.check_invariants().unwrap();
}

#[test]
fn cached_pages_are_live_for_shrink_and_evictable() {
    let c = clock();
    let (_card, _dev, arena) = arena_on(&c, Bytes::gib(4), 64);
    arena.commit_to(Pages(2 * CP), Urgency::Deferrable).unwrap();
    let ids = arena.alloc_many(Pages(2 * CP)).unwrap();
    let last = *ids.last().unwrap();
    arena.retain(last).unwrap();
    for id in &ids {
        arena.release_to_cache(*id).unwrap();
    }
    // `last` had two holders; one is left.
    assert_eq!(arena.counts().in_use, Pages(1));
    arena.release_to_cache(last).unwrap();
    assert_eq!(arena.counts().cached, Pages(2 * CP));
    assert_eq!(arena.shrink_to(Pages(0)).chunks, 0, "cached contents are not destroyed by a shrink");
    arena.revive(ids[0]).unwrap();
    assert!(arena.evict(ids[0]).is_err(), "an in-use page cannot be evicted");
    for id in &ids[CP..] {
        arena.evict(*id).unwrap();
    }
    assert_eq!(arena.shrink_to(Pages(0)).chunks, 1);
    assert!(arena.release(PageId(CP as u32)).is_err(), "a released chunk's ids are unbacked");
    arena.check_invariants().unwrap();
}

#[test]
fn kv_grows_back_only_after_the_hold_time() {
    let c = clock();
    let (card, _dev, arena) = arena_on(&c, Bytes::gib(4), 1024);
    arena.commit_to(Pages(10 * CP), Urgency::Deferrable).unwrap();
    let relieved = arena.relieve(arena.card(), Bytes::mib(5));
    assert_eq!(relieved, Bytes::mib(6), "whole chunks");
    assert_eq!(arena.backed(), Pages(7 * CP));
    assert_eq!(arena.counts().target, Pages(10 * CP), "relief keeps the target");
    c.advance(HOLD - Duration::from_millis(1));
    assert_eq!(arena.recover(), Pages(0), "held");
    c.advance(Duration::from_millis(1));
    assert_eq!(arena.recover(), Pages(3 * CP));
    assert_eq!(card.driver_free(), Bytes::gib(4) - Bytes::mib(20));
}

#[test]
fn growth_without_relief_stops_at_the_margin_after_an_intrusion() {
    let c = clock();
    let card = sim(&c, 0, Bytes::gib(2));
    let dev = Device::standalone(card.clone(), CardSettings::default());
    let margin = Bytes::mib(64);
    let cfg = KvArenaConfig {
        page_bytes: PAGE,
        max_pages: Pages(4096),
        chunk_target: Bytes::mib(2),
        hold: HOLD,
        margin,
    };
    let arena = Arc::new(KvArena::new(&dev, cfg, c.clone()).unwrap());
    dev.register_provider(arena.clone());
    let floor = CardSettings::default().floor;
    let rests = |what: &str| {
        let free = card.driver_free();
        assert!(free >= floor + margin && free < floor + margin + Bytes::mib(2), "{what}: free {free}");
    };
    // Boot sizing leaves floor + margin; admission growth stops there too.
    arena.commit_to(Pages((1024 - 64 - 100) / 2 * CP), Urgency::Deferrable).unwrap();
    while arena.ensure_free(Pages(arena.counts().free.get() + 1), Urgency::Opportunistic).is_ok() {}
    rests("after admission growth");
    // An intruder takes 300 MiB; relief gives it back; it leaves again.
    card.set_foreign(7, Bytes::mib(300));
    dev.make_room(Bytes::ZERO, Urgency::Blocking).unwrap();
    assert!(card.driver_free() >= floor);
    card.set_foreign(7, Bytes::ZERO);
    c.advance(HOLD);
    assert!(arena.recover() > Pages(0));
    rests("after regrowth");
    arena.check_invariants().unwrap();
}

/// An arena of recurrent-state slots books its chunks as state, not KV;
/// relief releases the chunks of slots no request holds (never a held one)
/// under the name of state, and they grow back after the hold time.
#[test]
fn a_state_arena_books_state_and_releases_idle_slots_under_relief() {
    let c = clock();
    let card = sim(&c, 0, Bytes::gib(2));
    let dev = Device::standalone(card.clone(), CardSettings::default());
    let cfg = KvArenaConfig {
        page_bytes: PAGE,
        max_pages: Pages(4 * CP),
        chunk_target: Bytes::mib(2),
        hold: HOLD,
        margin: Bytes::ZERO,
    };
    let slots =
        Arc::new(KvArena::spanning_as(&[(dev.clone(), PAGE)], cfg, Purpose::State, c.clone()).unwrap());
    assert_eq!(slots.purpose(), Purpose::State);
    assert_eq!(slots.name(), "release idle state chunks");
    dev.register_provider(slots.clone());
    slots.commit_to(Pages(4 * CP), Urgency::Deferrable).unwrap();
    assert_eq!((dev.books().state, dev.books().kv_committed), (Bytes::mib(8), Bytes::ZERO));
    // One request holds a slot in the first chunk; the other three chunks are idle.
    let held = slots.alloc().unwrap();
    assert_eq!(held, PageId(0));
    let floor = CardSettings::default().floor;
    card.set_foreign(7, Bytes::gib(2) - floor - Bytes::mib(8) + Bytes::mib(5));
    dev.make_room(Bytes::ZERO, Urgency::Blocking).unwrap();
    assert!(card.driver_free() >= floor);
    assert_eq!(dev.books().state, Bytes::mib(2), "only the chunk of the held slot stays");
    assert!(slots.is_backed(held));
    slots.release(held).unwrap();
    card.set_foreign(7, Bytes::ZERO);
    c.advance(HOLD);
    assert_eq!(slots.recover(), Pages(3 * CP));
    assert_eq!(dev.books().state, Bytes::mib(8));
    slots.check_invariants().unwrap();
}

#[test]
fn a_refused_grow_leaves_a_consistent_arena() {
    let c = clock();
    let (card, dev, arena) = arena_on(&c, Bytes::gib(4), 4096);
    let _weights = dev.reserve(Bytes::mib(3000), Purpose::Weights).unwrap();
    let err = arena.ensure_free(Pages(4096), Urgency::Deferrable).unwrap_err();
    assert!(matches!(err, ArenaError::Refused(_)), "{err}");
    assert!(card.driver_free() >= Bytes::gib(1), "the floor held");
    arena.check_invariants().unwrap();
    assert!(arena.ensure_free(Pages(8), Urgency::Deferrable).is_ok());
}

#[test]
fn idle_chunks_are_trimmed_after_the_hold_time() {
    let c = clock();
    let (_card, _dev, arena) = arena_on(&c, Bytes::gib(4), 1024);
    arena.ensure_free(Pages(3 * CP), Urgency::Deferrable).unwrap();
    let keep = arena.alloc().unwrap();
    c.advance(Duration::from_secs(1));
    assert_eq!(arena.trim_idle().chunks, 0, "not idle long enough");
    c.advance(HOLD);
    assert_eq!(arena.trim_idle().chunks, 2);
    assert_eq!(arena.backed(), Pages(CP), "the chunk with a live page stays");
    c.advance(HOLD);
    assert_eq!(arena.recover(), Pages(0), "a trim lowers the target");
    arena.release(keep).unwrap();
}

#[derive(Clone, Debug)]
enum Op {
    Alloc,
    Release(usize),
    Cache(usize),
    Evict(usize),
    Revive(usize),
    Grow(usize),
    Shrink(usize),
    Relieve(u64),
    Recover(u64),
    Vacate(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Alloc),
        3 => (0usize..64).prop_map(Op::Release),
        2 => (0usize..64).prop_map(Op::Cache),
        2 => (0usize..64).prop_map(Op::Evict),
        1 => (0usize..64).prop_map(Op::Revive),
        1 => (0usize..64).prop_map(Op::Grow),
        1 => (0usize..64).prop_map(Op::Shrink),
        1 => (1u64..8).prop_map(Op::Relieve),
        1 => (0u64..8).prop_map(Op::Recover),
        1 => (0usize..4).prop_map(Op::Vacate),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    /// Any sequence of operations keeps `free + cached + in_use + withheld ==
    /// capacity`, never hands out an unbacked or duplicate id, and never
    /// unbacks a live page.
    #[test]
    fn invariants_hold_under_any_sequence(ops in proptest::collection::vec(op(), 1..120)) {
        let c = clock();
        let (_card, _dev, arena) = arena_on(&c, Bytes::gib(2), 64);
        arena.commit_to(Pages(2 * CP), Urgency::Deferrable).unwrap();
        let mut live: Vec<PageId> = Vec::new();
        let mut cached: Vec<PageId> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc => if let Some(id) = arena.alloc() {
                    prop_assert!(arena.is_backed(id));
                    prop_assert!(!live.contains(&id) && !cached.contains(&id));
                    live.push(id);
                },
                Op::Release(i) if !live.is_empty() => { let id = live.swap_remove(i % live.len()); arena.release(id).unwrap(); }
                Op::Cache(i) if !live.is_empty() => { let id = live.swap_remove(i % live.len()); arena.release_to_cache(id).unwrap(); cached.push(id); }
                Op::Evict(i) if !cached.is_empty() => { let id = cached.swap_remove(i % cached.len()); arena.evict(id).unwrap(); }
                Op::Revive(i) if !cached.is_empty() => { let id = cached.swap_remove(i % cached.len()); arena.revive(id).unwrap(); live.push(id); }
                Op::Grow(n) => { let _ = arena.ensure_free(Pages(n), Urgency::Deferrable); }
                Op::Shrink(n) => { arena.shrink_to(Pages(n)); }
                Op::Relieve(mib) => { arena.relieve(arena.card(), Bytes::mib(mib)); }
                Op::Recover(s) => { c.advance(Duration::from_secs(s)); arena.recover(); }
                Op::Vacate(n) => {
                    let plan = arena.plan_vacate(n);
                    arena.finish_moves(&plan.moves).unwrap();
                    for (from, to) in &plan.moves {
                        for id in live.iter_mut().chain(cached.iter_mut()).filter(|id| *id == from) {
                            *id = *to;
                        }
                    }
                    prop_assert!(arena.free_chunks() >= plan.chunks.len(), "the vacated chunks hold nothing");
                }
                _ => {}
            }
            let counts = arena.check_invariants().map_err(TestCaseError::fail)?;
            prop_assert_eq!(counts.in_use.get(), live.len());
            prop_assert_eq!(counts.cached.get(), cached.len());
            for id in live.iter().chain(&cached) {
                prop_assert!(arena.is_backed(*id), "{} lost its backing", id);
            }
        }
    }
}

#[test]
fn common_geometry_shares_page_ids_across_cards() {
    // 1 MiB pages on one card, 256 KiB on another: 2 and 8 pages fill whole
    // 2 MiB granules, so 8 pages fill them on both.
    let g = ChunkGeometry::common(&[(Bytes::mib(1), Bytes::mib(2)), (PAGE, Bytes::mib(2))], Bytes::mib(2))
        .unwrap();
    assert_eq!(g[0].chunk_pages, g[1].chunk_pages);
    assert_eq!((g[0].chunk_pages, g[0].chunk_bytes, g[1].chunk_bytes), (8, Bytes::mib(8), Bytes::mib(2)));
    // 768 KiB pages need 8 pages for whole granules; 1 MiB pages need 2: 8 for both.
    let g = ChunkGeometry::common(
        &[(Bytes(768 * 1024), Bytes::mib(2)), (Bytes::mib(1), Bytes::mib(2))],
        Bytes::mib(2),
    )
    .unwrap();
    assert_eq!((g[0].chunk_pages, g[1].chunk_pages), (8, 8));
    assert_eq!((g[0].chunk_bytes, g[1].chunk_bytes), (Bytes::mib(6), Bytes::mib(8)));
    // One part is exactly the single-card geometry.
    let one = ChunkGeometry::common(&[(Bytes(1_835_008), Bytes::mib(2))], Bytes::mib(2)).unwrap();
    assert_eq!(one[0], ChunkGeometry::new(Bytes(1_835_008), Bytes::mib(2), Bytes::mib(2)).unwrap());
}

/// An arena over two sim cards: 256 KiB pages on a 4 GiB card, 512 KiB
/// pages on a 2 GiB card (twice the heads).
fn spanning_arena(c: &Arc<ManualClock>) -> (Vec<Arc<corridor_vram::SimCard>>, Vec<Device>, Arc<KvArena>) {
    let cards = vec![sim(c, 0, Bytes::gib(4)), sim(c, 1, Bytes::gib(2))];
    let devs: Vec<Device> =
        cards.iter().map(|card| Device::standalone(card.clone(), CardSettings::default())).collect();
    let cfg = KvArenaConfig {
        page_bytes: Bytes::ZERO,
        max_pages: Pages(8192),
        chunk_target: Bytes::mib(2),
        hold: HOLD,
        margin: Bytes::ZERO,
    };
    let parts = [(devs[0].clone(), PAGE), (devs[1].clone(), Bytes(512 * 1024))];
    let arena = Arc::new(KvArena::spanning(&parts, cfg, c.clone()).unwrap());
    (cards, devs, arena)
}

#[test]
fn a_spanning_arena_holds_what_every_card_can_back() {
    let c = clock();
    let (cards, devs, arena) = spanning_arena(&c);
    assert_eq!(arena.cards(), vec![corridor_units::CardId(0), corridor_units::CardId(1)]);
    let g1 = arena.part_on(corridor_units::CardId(1)).unwrap().geometry;
    assert_eq!((arena.geometry().chunk_pages, g1.chunk_pages), (8, 8), "one id space");
    assert_eq!((arena.geometry().chunk_bytes, g1.chunk_bytes), (Bytes::mib(2), Bytes::mib(4)));
    arena.commit_to(Pages(40), Urgency::Deferrable).unwrap();
    assert_eq!(devs[0].books().kv_committed, Bytes::mib(10));
    assert_eq!(devs[1].books().kv_committed, Bytes::mib(20));
    // The small card fills first: the group stops where it refuses, and the
    // big card holds no chunk the small one could not back.
    let err = arena.ensure_free(Pages(8192), Urgency::Deferrable).unwrap_err();
    assert!(matches!(err, ArenaError::Refused(_)), "{err}");
    let backed = arena.backed().get();
    let chunks = (backed / 8) as u64;
    assert_eq!(devs[0].books().kv_committed, Bytes(chunks * Bytes::mib(2).get()));
    assert_eq!(devs[1].books().kv_committed, Bytes(chunks * Bytes::mib(4).get()));
    let floor = CardSettings::default().floor;
    assert!(cards[1].driver_free() >= floor, "the small card's floor held");
    assert!(
        cards[1].driver_free() < floor + Bytes::mib(4),
        "the small card is filled to within a chunk: {}",
        cards[1].driver_free()
    );
    assert!(cards[0].driver_free() > Bytes::gib(2), "the big card holds only the group's pages");
    arena.check_invariants().unwrap();
}

#[test]
fn relief_on_any_card_releases_the_chunk_on_every_card() {
    let c = clock();
    let (cards, devs, arena) = spanning_arena(&c);
    arena.commit_to(Pages(40), Urgency::Deferrable).unwrap();
    let before = (cards[0].driver_free(), cards[1].driver_free());
    // Relief asked on the small card: its share of whole chunks comes back,
    // and the big card releases the same pages.
    let got = arena.relieve(corridor_units::CardId(1), Bytes::mib(3));
    assert_eq!(got, Bytes::mib(4), "one whole chunk, 4 MiB on card 1");
    assert_eq!(arena.backed(), Pages(32));
    assert_eq!(cards[1].driver_free(), before.1 + Bytes::mib(4));
    assert_eq!(cards[0].driver_free(), before.0 + Bytes::mib(2));
    assert_eq!(devs[0].books().kv_committed, Bytes::mib(8));
    // A card the arena does not span is not relieved.
    assert_eq!(arena.relieve(corridor_units::CardId(7), Bytes::mib(3)), Bytes::ZERO);
    c.advance(HOLD);
    assert_eq!(arena.recover(), Pages(8), "both cards grow back together");
    assert_eq!(devs[1].books().kv_committed, Bytes::mib(20));
}

#[test]
fn common_geometry_of_pages_that_never_pack_rounds_to_granules() {
    // Page sizes with no common exact packing: whole pages per chunk, each
    // part rounded up to its granules, no overflow.
    let parts = [(Bytes(1000), Bytes::mib(2)), (Bytes(1001), Bytes::mib(2)), (Bytes(1003), Bytes::mib(2))];
    let g = ChunkGeometry::common(&parts, Bytes::mib(2)).unwrap();
    assert!(g.iter().all(|x| x.chunk_pages == g[0].chunk_pages && x.chunk_pages > 0));
    assert!(g.iter().all(|x| x.chunk_bytes.get() % Bytes::mib(2).get() == 0));
    assert!(g.iter().all(|x| x.chunk_bytes.get() >= x.chunk_pages as u64 * x.page_bytes.get()));
}
