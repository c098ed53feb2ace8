//! The scheduler: which tokens of which sequences run in the next step.
//!
//! There is no prefill phase and no decode phase: every sequence simply has
//! tokens whose KV is computed and tokens still to compute, and each step
//! hands out a budget of token rows (`max_batched_tokens`). Running sequences
//! are served first, in admission order (a decode takes one row; a prompt takes
//! as many rows as the budget leaves — chunked prefill); waiting sequences are
//! then admitted first-come first-served while rows, running slots and pages
//! last. A waiting request that does not fit blocks the ones behind it, so a
//! long prompt is never starved by a stream of short ones.
//!
//! While decodes run, the rows prompts may take are bounded further by the
//! step-budget rule ([`crate::step_budget`]): enough to keep the predicted
//! step within the inter-token-latency target, never fewer than a floor. A
//! decode always gets its row; a step with no decode gives prompts the whole
//! budget.
//!
//! Pages are allocated before a step runs, never during it. When a running
//! sequence needs a page and none is free, the most recently admitted other
//! sequence is preempted: its pages are released (full ones stay in the prefix
//! cache) and it goes back to the head of the queue to be recomputed. Admission
//! never overcommits the pool: a sequence is admitted only with the pages for
//! the rows it is given. When the card needs memory back, [`Scheduler::give_back`]
//! moves live pages out of sparse chunks before it ever preempts. A
//! sequence's pages are an owning allocation ([`SeqPages`]): they go back to
//! the pool when the sequence is dropped or its pages are cleared, so no path
//! that ends, preempts or refuses a sequence can forget them.
//!
//! A model with recurrent state (a hybrid's linear-attention layers) also
//! needs a state slot per running sequence: a sequence is admitted only with
//! pages and a slot, and gives the slot back when it ends or is preempted.
//! The slots come from a governed pool ([`Scheduler::with_state_pool`]: an
//! arena of one slot a page, whose chunks of free slots the governor releases
//! under pressure and grows back, and which admission grows without spending
//! relief — no free slot, and the sequence waits, as it does for pages), or
//! from a fixed block ([`Scheduler::with_state_slots`], a backend that keeps
//! its state in one allocation). Its state lives nowhere but in the slot, so
//! prefix caching is off for such a model (cached pages would skip the rows
//! that build the state) and a preempted sequence recomputes from its prompt.
//!
//! The scheduler knows tokens, pages and slots only: not the model, the
//! backend, the sampler or the client.

use crate::pages::{page_hashes, PagePool, SeqPages};
use crate::step_budget::{ItlBound, StepBudget, StepShape};
use corridor_units::{Bytes, CardId, PageId, Pages, RequestId, StateSlot, TokenId, Tokens};
use corridor_vram::{KvArena, Urgency};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

/// Limits of the scheduler, fixed at start-up.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Sequences that may run at once.
    pub max_running: usize,
    /// Token rows per step (the chunked-prefill budget).
    pub max_batched_tokens: usize,
    /// Longest sequence (prompt + output) the model may hold.
    pub context_len: usize,
    /// What running decodes' inter-token latency should keep: it bounds the
    /// prefill rows of a step that carries decodes (see [`crate::step_budget`]).
    /// [`ItlBound::NONE`]: no bound, prompts take whatever rows the decodes leave.
    pub itl: ItlBound,
}

#[derive(Debug)]
struct Seq {
    id: RequestId,
    /// Prompt followed by generated tokens.
    tokens: Vec<TokenId>,
    prompt_len: usize,
    /// Tokens whose KV is in the cache.
    computed: usize,
    /// Its pages: dropping the sequence (or clearing them) gives them back.
    pages: SeqPages,
    /// Full pages already offered to the prefix cache.
    registered: usize,
    /// Prompt tokens served from the prefix cache at first admission.
    cached_tokens: Option<usize>,
    /// The recurrent-state slot, held while running (models with state).
    slot: Option<StateSlot>,
}

impl Seq {
    fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }
}

/// One sequence's share of a step.
#[derive(Clone, Debug)]
pub struct ScheduledSeq {
    pub id: RequestId,
    /// First row of this sequence in the step.
    pub row_start: usize,
    /// Rows (new tokens) in this step.
    pub rows: usize,
    /// Tokens already cached before the step.
    pub cached: usize,
    /// The page table after allocation for this step.
    pub pages: Vec<PageId>,
    /// The step reaches the end of the known tokens, so its last row's logits
    /// give the next token.
    pub samples: bool,
    /// The sequence's recurrent-state slot (a model with state; else `None`).
    pub state_slot: Option<StateSlot>,
}

/// What the next step runs.
#[derive(Clone, Debug, Default)]
pub struct SchedulerOutput {
    /// `[rows]` token ids, sequences concatenated.
    pub tokens: Vec<TokenId>,
    /// `[rows]` positions.
    pub positions: Vec<u32>,
    pub seqs: Vec<ScheduledSeq>,
    /// Sequences preempted while forming this step (back in the queue).
    pub preempted: Vec<RequestId>,
    /// Sequences that can never fit: even alone they need more pages than the
    /// pool holds. The engine ends them with `length`.
    pub out_of_capacity: Vec<RequestId>,
    /// Rows given to running sequences decoding one token; the other rows are
    /// prompt rows. What the step-time model learns from.
    pub decode_rows: usize,
}

impl SchedulerOutput {
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// The step as the cost model sees it.
    pub fn shape(&self) -> StepShape {
        StepShape {
            prefill_rows: self.tokens.len().saturating_sub(self.decode_rows),
            decode_rows: self.decode_rows,
        }
    }
}

/// What [`Scheduler::give_back`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GiveBack {
    /// Chunks released, and their bytes on the card that asked.
    pub chunks: usize,
    pub bytes: Bytes,
    /// Live pages moved to free pages of other chunks.
    pub moved: usize,
    /// Cached pages evicted.
    pub evicted: usize,
    /// Running sequences preempted (back in the queue).
    pub preempted: Vec<RequestId>,
}

/// The scheduler and the page pool it allocates from.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    pool: PagePool,
    waiting: VecDeque<Seq>,
    /// In admission order: the last one is the first to be preempted.
    running: Vec<Seq>,
    pub preemptions: u64,
    budget: StepBudget,
    /// Where a model with recurrent state takes its slots; `None`: no state.
    slots: Option<Slots>,
}

/// The state slots of a model with recurrent state.
#[derive(Debug)]
enum Slots {
    /// A fixed block: the free ones, the lowest last (popped first).
    Fixed(Vec<StateSlot>),
    /// A governed arena, one slot a page: slot `s` is page `s`.
    Pool(Arc<KvArena>),
}

impl Slots {
    /// A free slot, the lowest first; a pool grows by a chunk if none is
    /// free and the card has headroom above its floor and margin (admission
    /// never spends relief: a sequence without a slot waits).
    fn take(&mut self) -> Option<StateSlot> {
        match self {
            Slots::Fixed(free) => free.pop(),
            Slots::Pool(arena) => {
                let slot = arena.alloc().or_else(|| {
                    let _ = arena.ensure_free(Pages(1), Urgency::Opportunistic);
                    arena.alloc()
                })?;
                Some(StateSlot(slot.0))
            }
        }
    }

    fn give(&mut self, slot: StateSlot) {
        match self {
            Slots::Fixed(free) => free.push(slot),
            Slots::Pool(arena) => {
                if let Err(e) = arena.release(PageId(slot.0)) {
                    // A bookkeeping bug: the slot stays out of use rather
                    // than being handed to two sequences.
                    tracing::error!("giving back {slot}: {e}");
                    debug_assert!(false, "giving back {slot}: {e}");
                }
            }
        }
    }

    /// Slots that can be handed out now without growing.
    fn free(&self) -> usize {
        match self {
            Slots::Fixed(free) => free.len(),
            Slots::Pool(arena) => arena.counts().free.get(),
        }
    }
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, pool: PagePool) -> Self {
        let budget = StepBudget::new(config.itl);
        Scheduler::with_step_budget(config, pool, budget)
    }

    /// A scheduler whose prefill rows follow `budget` (its target replaces
    /// `config.itl_target`): for a caller that knows its card's step costs.
    pub fn with_step_budget(config: SchedulerConfig, pool: PagePool, budget: StepBudget) -> Self {
        Scheduler {
            config,
            pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
            preemptions: 0,
            budget,
            slots: None,
        }
    }

    /// Give every running sequence one of `n` recurrent-state slots (a model
    /// whose layers carry state), and turn prefix caching off: the state of
    /// a cached prefix is nowhere to be found.
    pub fn with_state_slots(mut self, n: usize) -> Self {
        // Lowest first: popped from the end.
        self.slots = Some(Slots::Fixed((0..n as u32).rev().map(StateSlot).collect()));
        self
    }

    /// Give every running sequence a recurrent-state slot from `pool` (an
    /// arena of one slot a page, booked as state), and turn prefix caching
    /// off. The pool's chunks of free slots are the governor's to release;
    /// admission grows them back when it needs a slot and the card has room.
    pub fn with_state_pool(mut self, pool: Arc<KvArena>) -> Self {
        self.slots = Some(Slots::Pool(pool));
        self
    }

    /// State slots free now (`None` for a model without state).
    pub fn free_state_slots(&self) -> Option<usize> {
        self.slots.as_ref().map(Slots::free)
    }

    /// Give a sequence's state slot back (its pages go back when it, or
    /// they, are dropped).
    fn return_slot(&mut self, s: &mut Seq) {
        if let (Some(slots), Some(slot)) = (self.slots.as_mut(), s.slot.take()) {
            slots.give(slot);
        }
    }

    /// The step-budget rule and the step-time model it has learned.
    pub fn step_budget(&self) -> &StepBudget {
        &self.budget
    }

    /// Record how long a step took, from forming it to handing out its
    /// tokens (what each of its decodes waited), so the step-time model
    /// follows the card.
    pub fn observe_step(&mut self, out: &SchedulerOutput, took: Duration) {
        self.budget.observe(out.shape(), took);
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }
    pub fn pool(&self) -> &PagePool {
        &self.pool
    }
    pub fn pool_mut(&mut self) -> &mut PagePool {
        &mut self.pool
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    /// Prompt tokens not yet prefilled: every waiting sequence's tokens and
    /// the rest of each running prompt (a running sequence that decodes
    /// brings one row, which is not prefill).
    pub fn pending_prefill(&self) -> Tokens {
        let waiting: usize = self.waiting.iter().map(|s| s.tokens.len()).sum();
        let running: usize = self.running.iter().map(Seq::pending).filter(|&p| p > 1).sum();
        Tokens(waiting + running)
    }
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Queue a new sequence.
    pub fn add(&mut self, id: RequestId, prompt: Vec<TokenId>) {
        let prompt_len = prompt.len();
        self.waiting.push_back(Seq {
            id,
            tokens: prompt,
            prompt_len,
            computed: 0,
            pages: self.pool.no_pages(),
            registered: 0,
            cached_tokens: None,
            slot: None,
        });
    }

    /// Remove a sequence wherever it is and release its pages. Returns whether
    /// it was known.
    pub fn remove(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let mut s = self.running.remove(i);
            self.return_slot(&mut s);
            return true;
        }
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            let mut s = self.waiting.remove(i).expect("index from position");
            self.return_slot(&mut s);
            return true;
        }
        false
    }

    /// Tokens of the prompt that came from the prefix cache (known once the
    /// sequence was first admitted).
    pub fn cached_tokens(&self, id: RequestId) -> Option<usize> {
        self.running.iter().chain(self.waiting.iter()).find(|s| s.id == id).and_then(|s| s.cached_tokens)
    }

    /// Append a sampled token to a running sequence.
    pub fn append_token(&mut self, id: RequestId, token: TokenId) {
        if let Some(s) = self.running.iter_mut().find(|s| s.id == id) {
            s.tokens.push(token);
        }
    }

    /// Length of a sequence (prompt + generated).
    pub fn seq_len(&self, id: RequestId) -> Option<usize> {
        self.running.iter().chain(self.waiting.iter()).find(|s| s.id == id).map(|s| s.tokens.len())
    }

    fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.pool.page_size())
    }

    /// Form the next step.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        let mut budget = self.config.max_batched_tokens;
        let mut grants: Vec<(RequestId, usize)> = Vec::new();
        // Rows prompts may take in this step: bounded while decodes run, so
        // their inter-token latency holds.
        let decodes = self.running.iter().filter(|s| s.pending() == 1).count();
        // The batch the engine is heading to: what runs and what waits to be admitted.
        let heading = (self.running.len() + self.waiting.len()).min(self.config.max_running);
        let mut prefill =
            self.budget.align_prefill(decodes, self.budget.prefill_rows(decodes, heading, budget));

        // 1. Running sequences, oldest first; make room by preempting the newest.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let pending = self.running[i].pending();
            let decode = pending == 1;
            let rows = if decode { pending.min(budget) } else { pending.min(budget).min(prefill) };
            if rows == 0 {
                i += 1;
                continue;
            }
            let need =
                self.pages_for(self.running[i].computed + rows).saturating_sub(self.running[i].pages.len());
            if let Some(pages) = self.pool.allocate(need) {
                self.running[i].pages.append(pages);
                grants.push((self.running[i].id, rows));
                budget -= rows;
                if decode {
                    out.decode_rows += rows;
                } else {
                    prefill -= rows;
                }
                i += 1;
                continue;
            }
            if self.running.len() > i + 1 {
                // Make room by preempting the newest, then retry this one.
                let victim = self.running.pop().expect("len > i + 1");
                out.preempted.push(victim.id);
                self.preempt(victim);
                continue;
            }
            let mut victim = self.running.remove(i);
            if self.running.is_empty() && victim.pages.len() + need > self.pool.target() {
                // Alone, and more than the pool ever holds: it can never fit.
                self.return_slot(&mut victim);
                out.out_of_capacity.push(victim.id);
            } else {
                // Older sequences keep their pages; this one waits for memory.
                out.preempted.push(victim.id);
                self.preempt(victim);
            }
        }

        // 2. Admit waiting sequences first-come first-served.
        while budget > 0 && prefill > 0 && self.running.len() < self.config.max_running {
            let Some(mut s) = self.waiting.pop_front() else { break };
            if let Some(slots) = self.slots.as_mut() {
                // A model with state: a slot first, and no prefix cache.
                let Some(slot) = slots.take() else {
                    self.waiting.push_front(s);
                    break;
                };
                s.slot = Some(slot);
                s.cached_tokens.get_or_insert(0);
            } else if s.pages.is_empty() {
                // Reuse cached full pages of the prefix, but always leave the last
                // token to compute: its logits give the first new token.
                let max_pages = (s.tokens.len() - 1) / self.pool.page_size();
                s.pages = self.pool.acquire_prefix(&s.tokens, max_pages);
                s.computed = s.pages.len() * self.pool.page_size();
                s.registered = s.pages.len();
                s.cached_tokens.get_or_insert(s.computed);
            }
            let rows = s.pending().min(budget).min(prefill);
            let need = self.pages_for(s.computed + rows).saturating_sub(s.pages.len());
            let Some(pages) = self.pool.allocate(need) else {
                if self.running.is_empty() && s.pages.len() + need > self.pool.target() {
                    self.return_slot(&mut s);
                    out.out_of_capacity.push(s.id);
                    continue;
                }
                // Not now: give the prefix pages (they stay cached) and any
                // state slot back, and wait.
                self.return_slot(&mut s);
                s.pages.clear();
                s.computed = 0;
                s.registered = 0;
                self.waiting.push_front(s);
                break;
            };
            s.pages.append(pages);
            grants.push((s.id, rows));
            budget -= rows;
            prefill -= rows;
            self.running.push(s);
        }

        // 3. Lay out the rows.
        for (id, rows) in grants {
            let Some(s) = self.running.iter().find(|s| s.id == id) else { continue };
            let row_start = out.tokens.len();
            out.tokens.extend_from_slice(&s.tokens[s.computed..s.computed + rows]);
            out.positions.extend((s.computed..s.computed + rows).map(|p| p as u32));
            out.seqs.push(ScheduledSeq {
                id,
                row_start,
                rows,
                cached: s.computed,
                pages: s.pages.to_vec(),
                samples: s.computed + rows == s.tokens.len(),
                state_slot: s.slot,
            });
        }
        out
    }

    /// Give `card` (one of the cards the pool's arena spans) at least `need`
    /// bytes back, between steps. In order, each step repeated while it
    /// helps: release the chunks that hold nothing; move live pages out of
    /// the sparsest chunks into free pages of other chunks in use (`copy`
    /// copies their data; page tables are rewritten); evict cached pages
    /// (whole chunks of them first), which frees chunks or makes room for
    /// moves; and only when the pages that running sequences hold exceed
    /// what the card keeps after giving `need` back, preempt the newest (each
    /// preemption logged with that arithmetic).
    ///
    /// `need` is what the guard aims for; `must` (at most `need`) is what the
    /// card cannot do without — the guard's overshoot above the floor is
    /// worth releasing idle and cached KV for, never a running request.
    pub fn give_back(
        &mut self,
        card: CardId,
        need: Bytes,
        must: Bytes,
        copy: &mut dyn FnMut(&[(PageId, PageId)]) -> Result<(), String>,
    ) -> GiveBack {
        let arena = self.pool.arena().clone();
        let mut out = GiveBack::default();
        let Some(part) = arena.part_on(card) else { return out };
        let g = part.geometry;
        let chunks_for = |b: Bytes| b.get().div_ceil(g.chunk_bytes.get().max(1)) as usize;
        let want = chunks_for(need).max(1);
        let must = chunks_for(must.min(need));
        loop {
            let left = want.saturating_sub(out.chunks);
            let r = arena.release_idle_on(card, Bytes(left as u64 * g.chunk_bytes.get()));
            out.chunks += r.chunks;
            out.bytes += Bytes(r.chunks as u64 * g.chunk_bytes.get());
            let left = want.saturating_sub(out.chunks);
            if left == 0 {
                break;
            }
            match self.pool.vacate(left, copy) {
                Ok(moves) if !moves.is_empty() => {
                    out.moved += moves.len();
                    self.remap(&moves);
                    continue;
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::error!(%card, "moving KV pages failed, nothing moved: {e}");
                    break;
                }
            }
            let evicted = self.pool.evict_for(left);
            if evicted > 0 {
                out.evicted += evicted;
                continue;
            }
            // Nothing left to move into: the pages in use exceed what the
            // card keeps. Only what the card cannot do without is worth
            // live work.
            let short = must.saturating_sub(out.chunks);
            if short == 0 {
                break;
            }
            let c = arena.counts();
            let keep = c.committed.get().saturating_sub(short * g.chunk_pages);
            let Some(victim) = self.running.pop() else { break };
            tracing::warn!(
                %card,
                "running requests hold {} KV pages ({}) but after giving back {} the card keeps {} pages ({}) \
                 above its floor: preempting {} ({} pages; it is recomputed when memory returns)",
                c.in_use.get(),
                Bytes(c.in_use.get() as u64 * g.page_bytes.get()),
                Bytes(short as u64 * g.chunk_bytes.get()),
                keep,
                Bytes(keep as u64 * g.page_bytes.get()),
                victim.id,
                victim.pages.len()
            );
            out.preempted.push(victim.id);
            self.preempt(victim);
        }
        out
    }

    /// Rewrite every sequence's page table after pages moved.
    fn remap(&mut self, moves: &[(PageId, PageId)]) {
        let map: HashMap<PageId, PageId> = moves.iter().copied().collect();
        for s in self.running.iter_mut().chain(self.waiting.iter_mut()) {
            s.pages.remap(&map);
        }
    }

    fn preempt(&mut self, mut s: Seq) {
        self.preemptions += 1;
        // A model with state recomputes from the prompt: the slot is reused
        // by whoever runs next, and a fresh one starts from zeros.
        self.return_slot(&mut s);
        s.pages.clear();
        s.computed = 0;
        s.registered = 0;
        self.waiting.push_front(s);
    }

    /// Record that a step ran: the scheduled rows are now cached, and full
    /// pages are offered to the prefix cache.
    pub fn complete_step(&mut self, out: &SchedulerOutput) {
        let ps = self.pool.page_size();
        for item in &out.seqs {
            let Some(s) = self.running.iter_mut().find(|s| s.id == item.id) else { continue };
            s.computed = item.cached + item.rows;
            let full = s.computed / ps;
            if full > s.registered && self.slots.is_none() {
                let hashes = page_hashes(&s.tokens[..full * ps], ps);
                for p in s.registered..full {
                    self.pool.register(s.pages[p], hashes[p], &s.tokens[p * ps..(p + 1) * ps]);
                }
                s.registered = full;
            }
        }
    }

    /// Prompt length of a known sequence.
    pub fn prompt_len(&self, id: RequestId) -> Option<usize> {
        self.running.iter().chain(self.waiting.iter()).find(|s| s.id == id).map(|s| s.prompt_len)
    }
}
