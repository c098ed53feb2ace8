//! Page pool and scheduler behaviour, with the pool invariant checked after
//! every operation.

use corridor_engine::pages::{page_hashes, PagePool};
use corridor_engine::scheduler::{Scheduler, SchedulerConfig, SchedulerOutput};
use corridor_engine::step_budget::{aligned_rows, ItlBound, StepBudget, StepCost, StepShape};
use corridor_units::{Pages, RequestId, TokenId, Tokens};
use std::time::Duration;

fn pool(n: usize) -> PagePool {
    PagePool::standalone(Pages(n), Tokens(4))
}

fn ok(p: &PagePool) {
    p.check_invariants().unwrap();
}

#[test]
fn pool_counts_add_up_through_allocate_release_and_cache() {
    let mut p = pool(8);
    let a = p.allocate(3).unwrap();
    ok(&p);
    assert_eq!(p.counts().in_use, 3);
    let toks: Vec<TokenId> = (0..4).map(TokenId).collect();
    p.register(a[0], page_hashes(&toks, 4)[0], &toks);
    drop(a);
    ok(&p);
    let c = p.counts();
    assert_eq!((c.free, c.cached, c.in_use), (7, 1, 0));
    assert!(p.allocate(9).is_none(), "all-or-nothing allocation");
    ok(&p);
    // Taking all 8 evicts the cached page last.
    let all = p.allocate(8).unwrap();
    assert_eq!(p.evictions(), 1);
    ok(&p);
    drop(all);
    ok(&p);
}

/// A sequence's pages are an owning allocation: letting go of it gives every
/// page back (a registered one to the prefix cache), and a prefix hit holds
/// its pages the same way.
#[test]
fn dropping_an_allocation_gives_its_pages_back() {
    let mut p = pool(8);
    let mut a = p.allocate(2).unwrap();
    a.append(p.allocate(2).unwrap());
    assert_eq!(a.len(), 4);
    let toks: Vec<TokenId> = (0..4).map(TokenId).collect();
    let first = a[0];
    p.register(first, page_hashes(&toks, 4)[0], &toks);
    assert_eq!(p.counts().in_use, 4);
    drop(a);
    ok(&p);
    let c = p.counts();
    assert_eq!((c.free, c.cached, c.in_use), (7, 1, 0), "dropped pages are free or cached");
    let mut hit = p.acquire_prefix(&[0, 1, 2, 3, 9].map(TokenId), 1);
    assert_eq!(*hit, [first]);
    assert_eq!(p.counts().in_use, 1);
    hit.clear();
    ok(&p);
    assert_eq!((p.counts().cached, p.counts().in_use), (1, 0), "cleared pages go back too");
    // A scheduler's sequences hold their pages the same way: removing one
    // (or dropping the scheduler) leaves nothing in use.
    let mut s = sched(16, 32, 2);
    s.add(RequestId(1), (0..10).map(TokenId).collect());
    s.add(RequestId(2), (20..30).map(TokenId).collect());
    step(&mut s, 7);
    assert_eq!(s.pool().counts().in_use, 6, "three pages each");
    assert!(s.remove(RequestId(1)));
    s.pool().check_invariants().unwrap();
    assert_eq!(s.pool().counts().in_use, 3, "only sequence 2's pages are held");
    let arena = s.pool().arena().clone();
    drop(s);
    assert_eq!(arena.counts().in_use.get(), 0, "dropping the scheduler released every page");
}

#[test]
fn prefix_hit_requires_equal_tokens_not_just_equal_hash() {
    let mut p = pool(4);
    let a = p.allocate(1).unwrap();
    let real: Vec<TokenId> = [1, 2, 3, 4].map(TokenId).to_vec();
    let h = page_hashes(&real, 4)[0];
    // Register the hash of `real` for a page that holds other tokens: a collision.
    p.register(a[0], h, &[TokenId(9); 4]);
    drop(a);
    assert!(p.acquire_prefix(&real, 1).is_empty(), "a colliding page must not be reused");
    ok(&p);
}

#[test]
fn prefix_hits_chain_and_stop_at_first_miss() {
    let mut p = pool(8);
    let toks: Vec<TokenId> = (10..22).map(TokenId).collect(); // 3 pages
    let pages = p.allocate(3).unwrap();
    let hs = page_hashes(&toks, 4);
    for i in 0..3 {
        p.register(pages[i], hs[i], &toks[i * 4..i * 4 + 4]);
    }
    let ids = pages.to_vec();
    drop(pages);
    let mut other = toks.clone();
    other[5] = TokenId(999); // second page differs
    let hit = p.acquire_prefix(&other, 3);
    assert_eq!(*hit, [ids[0]]);
    ok(&p);
    let full = p.acquire_prefix(&toks, 3);
    assert_eq!(*full, *ids);
    assert_eq!(p.counts().in_use, 3);
    ok(&p);
}

fn sched(pages: usize, budget: usize, running: usize) -> Scheduler {
    Scheduler::new(
        SchedulerConfig {
            max_running: running,
            max_batched_tokens: budget,
            context_len: 1024,
            itl: ItlBound::NONE,
        },
        PagePool::standalone(Pages(pages), Tokens(4)),
    )
}

/// Run a step as the engine would: complete it and append a token to every
/// sequence that samples.
fn step(s: &mut Scheduler, next: u32) -> SchedulerOutput {
    let next = TokenId(next);
    let out = s.schedule();
    s.complete_step(&out);
    for item in &out.seqs {
        if item.samples {
            s.append_token(item.id, next);
        }
    }
    s.pool().check_invariants().unwrap();
    out
}

#[test]
fn chunked_prefill_respects_the_token_budget() {
    let mut s = sched(64, 8, 4);
    s.add(RequestId(1), (0..20).map(TokenId).collect());
    let a = step(&mut s, 100);
    assert_eq!(a.tokens.len(), 8);
    assert!(!a.seqs[0].samples);
    let b = step(&mut s, 100);
    assert_eq!((b.seqs[0].cached, b.seqs[0].rows), (8, 8));
    let c = step(&mut s, 100);
    assert_eq!(c.seqs[0].rows, 4);
    assert!(c.seqs[0].samples, "the last chunk samples");
    let d = step(&mut s, 101);
    assert_eq!((d.seqs[0].rows, d.positions[0]), (1, 20), "then one decode row");
}

#[test]
fn decodes_are_batched_with_a_new_prefill() {
    let mut s = sched(64, 16, 4);
    s.add(RequestId(1), (0..5).map(TokenId).collect());
    step(&mut s, 7);
    s.add(RequestId(2), (0..30).map(TokenId).collect());
    let out = step(&mut s, 7);
    assert_eq!(out.seqs.len(), 2);
    assert_eq!(out.seqs[0].rows, 1, "running decode first");
    assert_eq!(out.seqs[1].rows, 15, "prefill takes the rest of the budget");
}

#[test]
fn second_request_reuses_the_cached_prefix() {
    let mut s = sched(64, 64, 4);
    let prompt: Vec<TokenId> = (0..18).map(TokenId).collect(); // 4 full pages + 2
    s.add(RequestId(1), prompt.clone());
    step(&mut s, 50);
    s.remove(RequestId(1));
    s.pool().check_invariants().unwrap();
    let mut p2 = prompt[..16].to_vec();
    p2.extend([77, 78, 79].map(TokenId));
    s.add(RequestId(2), p2);
    let out = step(&mut s, 50);
    assert_eq!(s.cached_tokens(RequestId(2)), Some(16));
    assert_eq!((out.seqs[0].cached, out.seqs[0].rows), (16, 3), "only the new suffix is computed");
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_token() {
    let mut s = sched(64, 64, 4);
    let prompt: Vec<TokenId> = (0..16).map(TokenId).collect();
    s.add(RequestId(1), prompt.clone());
    step(&mut s, 50);
    s.remove(RequestId(1));
    s.add(RequestId(2), prompt);
    let out = step(&mut s, 50);
    assert_eq!(s.cached_tokens(RequestId(2)), Some(12));
    assert_eq!(out.seqs[0].rows, 4);
    assert!(out.seqs[0].samples);
}

#[test]
fn pressure_preempts_the_newest_and_it_resumes_later() {
    // 6 pages of 4 tokens; two sequences of 8 prompt tokens each use 2 pages,
    // then grow until the pool runs out.
    let mut s = sched(6, 64, 4);
    s.add(RequestId(1), (0..8).map(TokenId).collect());
    s.add(RequestId(2), (100..108).map(TokenId).collect());
    step(&mut s, 1);
    let mut preempted = Vec::new();
    for _ in 0..12 {
        let out = step(&mut s, 1);
        preempted.extend(out.preempted.iter().copied());
        assert!(out.out_of_capacity.is_empty());
    }
    assert_eq!(preempted.first(), Some(&RequestId(2)), "the newest is preempted first");
    assert!(s.preemptions >= 1);
    // Sequence 1 kept running throughout and grew past what two could share.
    assert!(s.seq_len(RequestId(1)).unwrap() > 12);
    s.remove(RequestId(1));
    let out = step(&mut s, 1);
    assert!(out.seqs.iter().any(|x| x.id == RequestId(2)), "the preempted sequence resumes");
}

#[test]
fn a_sequence_larger_than_the_pool_is_reported_not_looped() {
    let mut s = sched(2, 64, 4);
    s.add(RequestId(1), (0..20).map(TokenId).collect()); // needs 5 pages
    let out = step(&mut s, 1);
    assert_eq!(out.out_of_capacity, vec![RequestId(1)]);
    assert!(!s.has_work());
}

#[test]
fn admission_is_first_come_first_served_and_never_overcommits() {
    let mut s = sched(4, 64, 8);
    s.add(RequestId(1), (0..12).map(TokenId).collect()); // 3 pages
    s.add(RequestId(2), (0..8).map(|x| x + 500).map(TokenId).collect()); // 2 pages: must wait
    s.add(RequestId(3), vec![TokenId(900)]); // 1 page: would fit, but waits behind 2
    let out = step(&mut s, 1);
    assert_eq!(out.seqs.len(), 1);
    assert_eq!(s.num_waiting(), 2);
    assert!(s.pool().counts().in_use <= 4);
}

#[test]
fn removing_a_request_frees_its_pages() {
    let mut s = sched(16, 64, 4);
    s.add(RequestId(1), (0..10).map(TokenId).collect());
    step(&mut s, 1);
    assert!(s.pool().counts().in_use > 0);
    assert!(s.remove(RequestId(1)));
    assert_eq!(s.pool().counts().in_use, 0);
    s.pool().check_invariants().unwrap();
}

/// A pool of `chunks` chunks of four pages (512 KiB pages, 2 MiB chunks) on
/// a private sim card, all committed, and a scheduler over it.
fn chunked(chunks: usize) -> Scheduler {
    use corridor_units::{Bytes, CardId};
    use corridor_vram::{
        CardSettings, Device, KvArena, KvArenaConfig, ManualClock, SimCard, SimCardSpec, Urgency,
    };
    use std::sync::Arc;
    let clock = Arc::new(ManualClock::new());
    let card = Arc::new(SimCard::new(SimCardSpec::new(CardId(0), Bytes::gib(1)), &[], clock.clone()));
    let dev = Device::standalone(card, CardSettings { floor: Bytes::ZERO, ..CardSettings::default() });
    let cfg = KvArenaConfig {
        page_bytes: Bytes(512 * 1024),
        max_pages: Pages(4 * chunks),
        chunk_target: Bytes::mib(2),
        hold: std::time::Duration::ZERO,
        margin: Bytes::ZERO,
    };
    let arena = Arc::new(KvArena::new(&dev, cfg, clock).unwrap());
    arena.commit_to(Pages(4 * chunks), Urgency::Blocking).unwrap();
    assert_eq!(arena.geometry().chunk_pages, 4);
    let config =
        SchedulerConfig { max_running: 16, max_batched_tokens: 256, context_len: 1024, itl: ItlBound::NONE };
    Scheduler::new(config, PagePool::new(arena, Tokens(4)))
}

/// Eight one-page sequences on pages 0..8, then all but those on pages 0, 4
/// and 7 finish: chunk 0 holds one live page, chunk 1 two, chunks 2 and 3
/// none. Returns the ids left running, in admission order.
fn scattered(s: &mut Scheduler) -> Vec<RequestId> {
    for id in 0..8 {
        s.add(RequestId(id), [1, 2, 3].map(TokenId).to_vec());
    }
    let out = s.schedule();
    let pages: Vec<u32> = out.seqs.iter().map(|q| q.pages[0].0).collect();
    assert_eq!(pages, (0..8).collect::<Vec<u32>>());
    s.complete_step(&out);
    for id in [1, 2, 3, 5, 6] {
        assert!(s.remove(RequestId(id)));
    }
    s.pool().check_invariants().unwrap();
    vec![RequestId(0), RequestId(4), RequestId(7)]
}

fn pages_of(s: &mut Scheduler, id: RequestId) -> Vec<u32> {
    s.append_token(id, TokenId(9));
    let out = s.schedule();
    let q = out.seqs.iter().find(|q| q.id == id).expect("scheduled");
    let pages = q.pages.iter().map(|p| p.0).collect();
    s.complete_step(&out);
    pages
}

#[test]
fn give_back_moves_live_pages_out_of_sparse_chunks_instead_of_preempting() {
    use corridor_units::{Bytes, CardId, PageId};
    let mut s = chunked(4);
    scattered(&mut s);
    let mut copies: Vec<(PageId, PageId)> = Vec::new();
    let need = Bytes::mib(6); // three chunks
    let done = s.give_back(CardId(0), need, need, &mut |moves| {
        copies.extend_from_slice(moves);
        Ok(())
    });
    assert_eq!((done.chunks, done.bytes), (3, Bytes::mib(6)), "{done:?}");
    assert_eq!(done.preempted, Vec::<RequestId>::new(), "free pages held the live one: nothing preempted");
    assert_eq!(
        copies,
        vec![(PageId(0), PageId(5))],
        "the sparsest chunk's page moved to the lowest free page"
    );
    assert_eq!(done.moved, 1);
    s.pool().check_invariants().unwrap();
    assert_eq!(s.pool().counts().committed, 4, "one chunk left");
    assert_eq!(pages_of(&mut s, RequestId(0)), vec![5], "the page table follows the move");
    assert_eq!(s.preemptions, 0);
}

#[test]
fn give_back_preempts_only_what_the_card_cannot_keep() {
    use corridor_units::{Bytes, CardId};
    let mut s = chunked(4);
    let running = scattered(&mut s);
    // The whole pool asked for, but only the overshoot beyond three chunks
    // is optional: no request is worth it.
    let done = s.give_back(CardId(0), Bytes::mib(8), Bytes::mib(6), &mut |_| Ok(()));
    assert_eq!((done.chunks, done.preempted.len()), (3, 0), "{done:?}");
    // All of it needed: the three live pages exceed what no chunk keeps, so
    // every running sequence goes, newest first.
    let done = s.give_back(CardId(0), Bytes::mib(2), Bytes::mib(2), &mut |_| Ok(()));
    assert_eq!(done.preempted, running.iter().rev().copied().collect::<Vec<RequestId>>(), "{done:?}");
    assert_eq!(done.chunks, 1);
    assert_eq!(s.pool().counts().committed, 0);
    s.pool().check_invariants().unwrap();
}

#[test]
fn a_failed_copy_moves_nothing() {
    use corridor_units::{Bytes, CardId};
    let mut s = chunked(4);
    scattered(&mut s);
    let before = s.pool().counts();
    let done = s.give_back(CardId(0), Bytes::mib(6), Bytes::mib(6), &mut |_| Err("device lost".into()));
    assert_eq!((done.chunks, done.moved, done.preempted.len()), (2, 0, 0), "{done:?}");
    assert_eq!(s.pool().counts().in_use, before.in_use);
    s.pool().check_invariants().unwrap();
    assert_eq!(pages_of(&mut s, RequestId(0)), vec![0], "the page stayed where it was");
}

/// 5 ms a step, 0.1 ms a prompt row, 0.5 ms a decode row.
const KNOWN: StepCost = StepCost {
    fixed: Duration::from_millis(5),
    prefill_step: Duration::ZERO,
    per_prefill_row: Duration::from_micros(100),
    per_decode_row: Duration::from_micros(500),
};

fn bounded(target: Option<Duration>, cost: StepCost) -> Scheduler {
    let config = SchedulerConfig {
        max_running: 16,
        max_batched_tokens: 512,
        context_len: 4096,
        itl: ItlBound::absolute(target),
    };
    Scheduler::with_step_budget(
        config,
        PagePool::standalone(Pages(2048), Tokens(4)),
        StepBudget::with_prior(ItlBound::absolute(target), 16, cost),
    )
}

/// Ten short prompts become ten running decodes, then a long prompt arrives:
/// the rows it gets in the next step.
fn long_prompt_beside_ten_decodes(s: &mut Scheduler) -> SchedulerOutput {
    for id in 0..10 {
        s.add(RequestId(id), [1, 2, 3].map(TokenId).to_vec());
    }
    let first = step(s, 9);
    assert_eq!(first.decode_rows, 0, "prompts only");
    assert!(first.seqs.iter().all(|q| q.samples));
    s.add(RequestId(100), (0..3000).map(|t| t % 50).map(TokenId).collect());
    step(s, 9)
}

#[test]
fn the_step_budget_bounds_a_prompt_beside_running_decodes() {
    let mut s = bounded(Some(Duration::from_millis(50)), KNOWN);
    let out = long_prompt_beside_ten_decodes(&mut s);
    assert_eq!(out.decode_rows, 10);
    assert!(out.seqs[..10].iter().all(|q| q.rows == 1), "every decode keeps its row");
    let long = out.seqs.iter().find(|q| q.id == RequestId(100)).unwrap();
    // 50 ms - 5 ms fixed - 10 × 0.5 ms = 40 ms of prompt rows at 0.1 ms: 400, cut to 398 so the
    // step's rows come to a round count (408, `aligned_rows`).
    assert_eq!(long.rows, 398);
    assert_eq!(out.shape(), StepShape { prefill_rows: 398, decode_rows: 10 });
    assert!(KNOWN.predict(out.shape()) <= Duration::from_millis(50));

    // Without a target the prompt takes every row the decodes leave.
    let mut open = bounded(None, KNOWN);
    let out = long_prompt_beside_ten_decodes(&mut open);
    assert_eq!(out.seqs.iter().find(|q| q.id == RequestId(100)).unwrap().rows, 502);

    // Once the decodes are gone, nobody waits on the step: the whole budget.
    for id in 0..10 {
        assert!(s.remove(RequestId(id)));
    }
    let alone = step(&mut s, 9);
    assert_eq!((alone.seqs.len(), alone.seqs[0].rows, alone.decode_rows), (1, 512, 0));
}

#[test]
fn the_stall_ratio_counts_the_waiting_prompts_in_the_batch_it_protects() {
    let ratio = ItlBound { target: Some(Duration::from_millis(50)), stall_ratio: Some(2.0) };
    let config = SchedulerConfig { max_running: 16, max_batched_tokens: 512, context_len: 4096, itl: ratio };
    let mut s = Scheduler::with_step_budget(
        config,
        PagePool::standalone(Pages(2048), Tokens(4)),
        StepBudget::with_prior(ratio, 16, KNOWN),
    );
    // One long prompt beside ten decodes: the batch heads for 11, which step in 10.5 ms alone; at
    // most 21 ms with the prompt: (21 - 5 - 5) / 0.1 = 110 rows (within a row of rounding), cut to
    // a round count of the step's rows.
    let out = long_prompt_beside_ten_decodes(&mut s);
    let rows = out.seqs.iter().find(|q| q.id == RequestId(100)).unwrap().rows;
    assert!((102..=110).contains(&rows) && aligned_rows(rows + 10) == rows + 10, "{rows}");
    // Five more prompts wait: the batch heads for 16 (13 ms alone, 26 ms with prompts), so the
    // prompts share (26 - 5 - 5) / 0.1 = 160 rows, not the 110 of the 11 running.
    for id in 200..205 {
        s.add(RequestId(id), (0..300).map(|t| t % 50).map(TokenId).collect());
    }
    let out = step(&mut s, 9);
    assert_eq!(out.decode_rows, 10);
    let rows = out.shape().prefill_rows;
    assert!((150..=160).contains(&rows) && aligned_rows(rows + 10) == rows + 10, "{:?}", out.shape());
}

#[test]
fn a_prompt_still_progresses_by_the_floor_when_decodes_fill_the_target() {
    // Ten decodes alone are predicted at 5 + 10 × 5 = 55 ms, over the target.
    let slow = StepCost { per_decode_row: Duration::from_millis(5), ..KNOWN };
    let mut s = bounded(Some(Duration::from_millis(50)), slow);
    let out = long_prompt_beside_ten_decodes(&mut s);
    assert_eq!(out.seqs.iter().find(|q| q.id == RequestId(100)).unwrap().rows, 16);
    // And it keeps progressing step after step.
    let next = step(&mut s, 9);
    let long = next.seqs.iter().find(|q| q.id == RequestId(100)).unwrap();
    assert_eq!((long.cached, long.rows), (16, 16));
}

#[test]
fn measured_steps_move_the_bound() {
    let mut s = bounded(Some(Duration::from_millis(50)), KNOWN);
    let out = long_prompt_beside_ten_decodes(&mut s);
    assert_eq!(out.seqs.iter().find(|q| q.id == RequestId(100)).unwrap().rows, 398);
    // The card turns out twice as slow per prompt row as believed; steps of
    // several shapes are measured so.
    let truth = StepCost { per_prefill_row: Duration::from_micros(200), ..KNOWN };
    for i in 0..300usize {
        let shape = StepShape { prefill_rows: (i * 37) % 400, decode_rows: 1 + i % 16 };
        let measured = SchedulerOutput {
            tokens: vec![TokenId(0); shape.prefill_rows + shape.decode_rows],
            decode_rows: shape.decode_rows,
            ..SchedulerOutput::default()
        };
        s.observe_step(&measured, truth.predict(shape));
    }
    assert_eq!(s.step_budget().measured(), 300);
    // 40 ms of room now holds about 200 rows of 0.2 ms (the prior's small
    // weight pulls the fit by a few rows at most; the step's rows come to a multiple of 8).
    let next = step(&mut s, 9);
    let long = next.seqs.iter().find(|q| q.id == RequestId(100)).unwrap();
    assert!((182..=205).contains(&long.rows), "{}", long.rows);
    assert_eq!(next.decode_rows, 10);
}

/// A model with recurrent state: every running sequence holds its own slot,
/// admission waits for a free one, and ending or preempting a sequence gives
/// its slot back.
#[test]
fn state_slots_bound_admission_and_return_on_end_and_preemption() {
    let mut s = sched(64, 64, 4).with_state_slots(2);
    for id in 1..=3 {
        s.add(RequestId(id), (0..6).map(|t| t + 10 * id as u32).map(TokenId).collect());
    }
    let out = step(&mut s, 1);
    let slots: Vec<_> = out.seqs.iter().map(|q| q.state_slot.expect("a slot")).collect();
    assert_eq!(out.seqs.len(), 2, "two slots, two running, though four may run");
    assert_ne!(slots[0], slots[1]);
    assert_eq!((s.num_running(), s.num_waiting(), s.free_state_slots()), (2, 1, Some(0)));
    // A sequence keeps its slot from step to step.
    let again = step(&mut s, 1);
    assert_eq!(again.seqs.iter().map(|q| q.state_slot.unwrap()).collect::<Vec<_>>(), slots);
    // Ending the first frees its slot for the waiting one.
    s.remove(RequestId(1));
    assert_eq!(s.free_state_slots(), Some(1));
    let out = step(&mut s, 1);
    let third = out.seqs.iter().find(|q| q.id == RequestId(3)).expect("admitted once a slot is free");
    assert_eq!(third.state_slot, Some(slots[0]));
    assert_eq!(third.cached, 0);
    s.remove(RequestId(2));
    s.remove(RequestId(3));
    assert_eq!(s.free_state_slots(), Some(2));
}

#[test]
fn state_slots_are_given_back_by_preemption() {
    // 6 pages of 4 tokens: two growing sequences run the pool out.
    let mut s = sched(6, 64, 4).with_state_slots(2);
    s.add(RequestId(1), (0..8).map(TokenId).collect());
    s.add(RequestId(2), (100..108).map(TokenId).collect());
    step(&mut s, 1);
    let mut preempted = false;
    for _ in 0..12 {
        let out = step(&mut s, 1);
        if !out.preempted.is_empty() {
            preempted = true;
            // The victim is back in the queue without its slot.
            assert_eq!(s.free_state_slots(), Some(2 - s.num_running()));
        }
        for q in &out.seqs {
            assert!(q.state_slot.is_some());
        }
    }
    assert!(preempted, "the pool was meant to run out");
}

/// The state of a cached prefix is nowhere, so a model with state never
/// reuses one: the second prompt is computed from its first token.
#[test]
fn a_model_with_state_reuses_no_prefix() {
    let mut s = sched(64, 64, 4).with_state_slots(4);
    let prompt: Vec<TokenId> = (0..18).map(TokenId).collect();
    s.add(RequestId(1), prompt.clone());
    step(&mut s, 50);
    s.remove(RequestId(1));
    s.add(RequestId(2), prompt);
    let out = step(&mut s, 50);
    assert_eq!(s.cached_tokens(RequestId(2)), Some(0));
    assert_eq!((out.seqs[0].cached, out.seqs[0].rows), (0, 18));
    assert_eq!(s.pool().counts().cached, 0, "no page was offered to the prefix cache");
}

/// Slots from a governed state pool (an arena of one slot a page, chunks of
/// four slots on a private sim card): the lowest free slot goes first, a
/// pool with no free slot grows by a chunk when the card has room, and
/// admission waits when it has none; ending a sequence gives its slot back
/// to the pool, whose chunks of free slots can then be released.
#[test]
fn state_slots_come_from_a_governed_pool_that_grows_on_admission_and_gives_chunks_back() {
    use corridor_units::{Bytes, CardId};
    use corridor_vram::{
        Card, CardSettings, Device, KvArena, KvArenaConfig, ManualClock, Purpose, SimCard, SimCardSpec,
        Urgency,
    };
    use std::sync::Arc;
    let clock = Arc::new(ManualClock::new());
    let card = Arc::new(SimCard::new(SimCardSpec::new(CardId(0), Bytes::gib(2)), &[], clock.clone()));
    let dev = Device::standalone(card.clone(), CardSettings::default());
    let cfg = KvArenaConfig {
        page_bytes: Bytes(512 * 1024),
        max_pages: Pages(8),
        chunk_target: Bytes::mib(2),
        hold: Duration::ZERO,
        margin: Bytes::ZERO,
    };
    let slots =
        Arc::new(KvArena::spanning_as(&[(dev.clone(), cfg.page_bytes)], cfg, Purpose::State, clock).unwrap());
    slots.commit_to(Pages(4), Urgency::Deferrable).unwrap();
    let mut s = sched(64, 64, 8).with_state_pool(slots.clone());
    assert_eq!(s.free_state_slots(), Some(4));
    for id in 1..=6 {
        s.add(RequestId(id), vec![TokenId(id as u32); 3]);
    }
    // Six sequences: the pool grows by its second chunk for the fifth.
    let out = step(&mut s, 1);
    let given: Vec<u32> = out.seqs.iter().map(|q| q.state_slot.unwrap().0).collect();
    assert_eq!(given, vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(dev.books().state, Bytes::mib(4));
    // Everything but the first ends: the second chunk holds no slot and goes.
    for id in 2..=6 {
        s.remove(RequestId(id));
    }
    assert_eq!(s.free_state_slots(), Some(7));
    assert_eq!(slots.release_idle(Bytes::mib(4)).chunks, 1, "the chunk of slot 0 stays");
    assert_eq!(dev.books().state, Bytes::mib(2));
    // A foreign process leaves no room to grow: with the three free slots
    // taken, the next sequence waits for one rather than pushing the card.
    let floor = CardSettings::default().floor;
    card.set_foreign(9, card.driver_free() - floor - Bytes::mib(1));
    for id in 7..=10 {
        s.add(RequestId(id), vec![TokenId(id as u32); 3]);
    }
    let out = step(&mut s, 1);
    assert_eq!(out.seqs.iter().filter(|q| q.cached == 0).count(), 3, "three admitted");
    assert_eq!((s.num_running(), s.num_waiting(), s.free_state_slots()), (4, 1, Some(0)));
    assert_eq!(dev.books().state, Bytes::mib(2), "no growth into the floor");
    // The first ends: its slot goes to the one that waited.
    s.remove(RequestId(1));
    let out = step(&mut s, 1);
    assert_eq!(
        out.seqs.iter().find(|q| q.id == RequestId(10)).and_then(|q| q.state_slot).map(|s| s.0),
        Some(0)
    );
    slots.check_invariants().unwrap();
}
