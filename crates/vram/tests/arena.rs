//! The KV arena: page ids, the row cap, non-destructive shrink, recovery
//! after the hold time, and the page-count invariant.

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
fn shrink_never_goes_below_the_highest_live_page() {
    let c = clock();
    let (card, dev, arena) = arena_on(&c, Bytes::gib(4), 64);
    arena.commit_to(Pages(4 * CP), Urgency::Deferrable).unwrap();
    let ids = arena.alloc_many(Pages(4 * CP)).unwrap();
    let live = PageId(20); // in chunk 2
    for id in ids.iter().filter(|id| **id != live) {
        arena.release(*id).unwrap();
    }
    let out = arena.shrink_to(Pages(0));
    assert_eq!(out.chunks, 1, "only the chunk above the live page goes");
    assert_eq!(arena.backed(), Pages(3 * CP));
    assert!(live.index() < arena.backed().get(), "the live page is still backed");
    assert_eq!(dev.books().kv_committed, Bytes::mib(6));
    // Free ids above the live page stay handed-out-able only under the cap.
    let again: Vec<PageId> = std::iter::from_fn(|| arena.alloc()).collect();
    assert!(again.iter().all(|id| id.index() < 3 * CP));
    for id in again {
        arena.release(id).unwrap();
    }
    arena.release(live).unwrap();
    let out = arena.shrink_to(Pages(0));
    assert_eq!(out.chunks, 3);
    assert_eq!(arena.backed(), Pages(0));
    assert_eq!(card.driver_free(), Bytes::gib(4));
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
                    prop_assert!(id.index() < arena.backed().get());
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
                _ => {}
            }
            let counts = arena.check_invariants().map_err(TestCaseError::fail)?;
            prop_assert_eq!(counts.in_use.get(), live.len());
            prop_assert_eq!(counts.cached.get(), cached.len());
            for id in live.iter().chain(&cached) {
                prop_assert!(id.index() < arena.backed().get(), "{} lost its backing", id);
            }
        }
    }
}
