//! The engine loop and the handle the server talks to.
//!
//! One thread owns the model, the KV cache, the scheduler and the sampler, and
//! runs `schedule → execute → update` for as long as there is work. Requests
//! arrive as commands on a channel; each request gets its own channel of
//! events (tokens, then one `Done`). Dropping a request's [`RequestStream`]
//! aborts it: the engine frees its pages before the next step, so a client
//! that disconnects costs nothing after that.
//!
//! Requests are named by [`RequestId`] and carry [`TokenId`]s: the caller
//! converts the tokenizer's `u32` once, when it builds a [`GenerateRequest`]
//! (the server's `choice_specs`), and back when it reads an [`Event::Token`].
//! Below this they stay `TokenId` down to the kernels' edge.

use crate::executor::{DeviceDraw, Executor, ExecutorLimits, SingleRank};
use crate::flips::{FlipControl, FlipError, FlipMode, FlipRecord, FlipSettings, FlipTrigger};
use crate::pages::PagePool;
use crate::phase::Phase;
use crate::sampling::device;
use crate::sampling::{
    Constraint, CpuSampler, SampleRow, Sampler, SamplerState, SamplerStats, SamplingParams, TokenLogprob,
};
use crate::scheduler::{Scheduler, SchedulerConfig, SchedulerOutput};
use crate::stats::{EngineStats, StatsCell};
use corridor_backend::sample::{
    LogitEdit, SampleRowSpec, SampledRows, MAX_EDITS_PER_ROW, ROW_TOO_MANY_CANDIDATES,
};
use corridor_backend::Backend;
use corridor_model::Model;
use corridor_model::ModelConfig;
use corridor_units::{Bytes, CardId, Pages, Rank, RequestId, TokenId, Tokens};
use corridor_vram::{ReliefProvider, Tier};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use tokio::sync::mpsc as tmpsc;

/// How the engine is sized, fixed at start-up.
#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    pub scheduler: SchedulerConfig,
    /// Tokens per KV page.
    pub page_size: Tokens,
}

/// A request as the engine sees it: token ids and sampling settings.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<TokenId>,
    pub params: SamplingParams,
    /// `None` means until an end token or the end of the context.
    pub max_new_tokens: Option<usize>,
    /// End-of-sequence ids of the tokenizer (the sampler masks them while
    /// `min_tokens` is not reached).
    pub eos_ids: Vec<TokenId>,
    /// A grammar the output is held to (structured output, forced tool
    /// calls); `None` leaves the output free.
    pub constraint: Option<Constraint>,
}

/// Why a request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence or stop token was produced (it is not emitted).
    Stop,
    /// `max_new_tokens` or the context (or the KV pool) ran out.
    Length,
    /// The client went away or the server is shutting down.
    Aborted,
    /// This request failed (e.g. every logit was NaN); others continue.
    Error(String),
}

/// The counts `usage` reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
}

/// What a request's stream carries.
#[derive(Clone, Debug)]
pub enum Event {
    Token { token: TokenId, logprob: Option<f32>, top_logprobs: Vec<TokenLogprob> },
    Done { reason: FinishReason, usage: Usage },
}

/// Errors submitting to the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the engine has stopped")]
    Stopped,
    #[error("engine start-up failed: {0}")]
    Startup(String),
}

enum Command {
    Add {
        id: RequestId,
        // Boxed: a request is much larger than the other commands.
        req: Box<GenerateRequest>,
        tx: tmpsc::UnboundedSender<Event>,
    },
    Abort(RequestId),
    /// End a request as completed (the server matched a stop string).
    Finish(RequestId),
    /// The governor needs `need` bytes back on `card`: answer with what the
    /// card got back (see [`Scheduler::give_back`]).
    GiveBack {
        card: CardId,
        need: Bytes,
        reply: mpsc::Sender<Bytes>,
    },
    /// Flip the group to `to` between steps (see `flips`).
    Flip {
        to: Phase,
        skew_digest: Option<Rank>,
        reply: mpsc::Sender<Result<FlipRecord, FlipError>>,
    },
    /// How flips are decided from now on, and who hears of each.
    FlipSetup(Box<FlipSettings>),
    Shutdown,
}

/// A request's events. Dropping it aborts the request.
pub struct RequestStream {
    pub id: RequestId,
    rx: tmpsc::UnboundedReceiver<Event>,
    commands: mpsc::Sender<Command>,
    done: bool,
}

impl RequestStream {
    /// The next event, or `None` once the engine has dropped the request.
    pub async fn next(&mut self) -> Option<Event> {
        let ev = self.rx.recv().await;
        if matches!(ev, Some(Event::Done { .. }) | None) {
            self.done = true;
        }
        ev
    }
    /// End the request now as completed, e.g. because the caller matched a
    /// stop string in its text. Unlike dropping the stream this is not
    /// counted as an abort, and the stream stays open: tokens generated
    /// before the engine handles it still arrive, then `Done { reason: Stop }`
    /// with the request's usage (including its cached prompt tokens).
    pub fn finish_early(&self) {
        if !self.done {
            let _ = self.commands.send(Command::Finish(self.id));
        }
    }

    /// Blocking variant for non-async callers (the `generate` command, tests).
    pub fn next_blocking(&mut self) -> Option<Event> {
        let ev = self.rx.blocking_recv();
        if matches!(ev, Some(Event::Done { .. }) | None) {
            self.done = true;
        }
        ev
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.commands.send(Command::Abort(self.id));
        }
    }
}

/// What the server needs to know about the loaded model.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub config: ModelConfig,
    pub context_len: usize,
    pub num_pages: usize,
    pub page_size: usize,
}

/// A cheap, cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
    next_id: Arc<AtomicU64>,
    stats: Arc<StatsCell>,
    sampler_stats: Arc<SamplerStats>,
    info: Arc<ModelInfo>,
    thread: Arc<std::sync::Mutex<Option<std::thread::JoinHandle<()>>>>,
}

impl EngineHandle {
    /// Queue a request; its events arrive on the returned stream.
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestStream, EngineError> {
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = tmpsc::unbounded_channel();
        self.commands.send(Command::Add { id, req: Box::new(req), tx }).map_err(|_| EngineError::Stopped)?;
        Ok(RequestStream { id, rx, commands: self.commands.clone(), done: false })
    }

    pub fn stats(&self) -> EngineStats {
        self.stats.snapshot()
    }

    /// The relief provider through which the governor asks the engine for
    /// memory back on any card its KV spans: between steps the engine
    /// releases idle chunks, moves live pages out of sparse ones and, only
    /// when running requests hold more than the card keeps, preempts. The
    /// provider waits for the answer (at most `timeout`), so the guard
    /// credits what the card really got back in the same round.
    pub fn kv_relief(&self, timeout: std::time::Duration) -> Arc<dyn ReliefProvider> {
        let engine_thread = self.thread.lock().ok().and_then(|t| t.as_ref().map(|t| t.thread().id()));
        Arc::new(KvRelief { commands: std::sync::Mutex::new(self.commands.clone()), engine_thread, timeout })
    }

    /// Flip the group to `to` between steps and wait for how it ended (a
    /// committed or abandoned flip is `Ok`; `Err` means none was tried).
    /// `skew_digest` injects a ballot disagreement on that rank.
    pub fn flip(&self, to: Phase, skew_digest: Option<Rank>) -> Result<FlipRecord, FlipError> {
        let (reply, rx) = mpsc::channel();
        self.commands.send(Command::Flip { to, skew_digest, reply }).map_err(|_| FlipError::Stopped)?;
        rx.recv().map_err(|_| FlipError::Stopped)?
    }

    /// Decide flips by `settings` from now on.
    pub fn set_flips(&self, settings: FlipSettings) {
        let _ = self.commands.send(Command::FlipSetup(Box::new(settings)));
    }

    /// Sampler fallback counters (exported as Prometheus counters).
    pub fn sampler_stats(&self) -> &SamplerStats {
        &self.sampler_stats
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Abort what is in flight, stop the loop and wait for the thread.
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(t) = self.thread.lock().ok().and_then(|mut g| g.take()) {
            let _ = t.join();
        }
    }
}

struct Live {
    tx: tmpsc::UnboundedSender<Event>,
    params: SamplingParams,
    state: SamplerState,
    eos_ids: Vec<TokenId>,
    prompt_len: usize,
    generated: usize,
    max_new: Option<usize>,
    constraint: Option<Constraint>,
}

/// Start the engine thread with the whole model on one backend. The KV
/// storage covers the pool's whole id space.
pub fn spawn<B: Backend>(
    backend: B,
    model: Model<B>,
    config: EngineConfig,
    pool: PagePool,
) -> Result<EngineHandle, EngineError> {
    let sc = config.scheduler;
    let limits = ExecutorLimits {
        max_rows: Tokens(sc.max_batched_tokens),
        max_logit_rows: sc.max_running,
        page_size: config.page_size,
        num_pages: pool.capacity(),
    };
    let exec = SingleRank::new(backend, model, limits).map_err(|e| EngineError::Startup(e.to_string()))?;
    spawn_with(Box::new(exec), config, pool)
}

/// A pool of exactly `pages` pages on a private simulated card (tests,
/// `generate`): see [`PagePool::standalone`].
pub fn standalone_pool(pages: Pages, page_size: Tokens) -> PagePool {
    PagePool::standalone(pages, page_size)
}

/// Start the engine thread over any executor and page pool (a model with
/// recurrent state takes its slots from a fixed block of `max_running`).
pub fn spawn_with(
    exec: Box<dyn Executor>,
    config: EngineConfig,
    pool: PagePool,
) -> Result<EngineHandle, EngineError> {
    spawn_with_state(exec, config, pool, None)
}

/// [`spawn_with`], a model with recurrent state taking its slots from
/// `state` when given: an arena of one slot a page (booked as state, slot
/// `s` being page `s`), whose idle chunks the governor releases and grows
/// back like KV. The executor must hold a slot for every id of its space.
pub fn spawn_with_state(
    exec: Box<dyn Executor>,
    config: EngineConfig,
    pool: PagePool,
    state: Option<Arc<corridor_vram::KvArena>>,
) -> Result<EngineHandle, EngineError> {
    let sc = config.scheduler;
    let info = Arc::new(ModelInfo {
        config: exec.config().clone(),
        context_len: sc.context_len,
        num_pages: pool.capacity().get(),
        page_size: config.page_size.get(),
    });
    let mut sched = Scheduler::new(sc, pool);
    if exec.config().hybrid.is_some() {
        // One slot per request that may run: every executor's workspace is
        // sized for `max_running` logit rows, and holds that many slots.
        let slots = sc.max_running;
        if let Some(held) = exec.state_slots().filter(|&held| held < slots) {
            return Err(EngineError::Startup(format!(
                "the model holds {held} recurrent-state slots for {slots} running requests"
            )));
        }
        match state {
            Some(arena) => {
                let ids = arena.capacity().get();
                if let Some(held) = exec.state_slots().filter(|&held| held < ids) {
                    return Err(EngineError::Startup(format!(
                        "the model holds {held} recurrent-state slots for a state pool of {ids}"
                    )));
                }
                tracing::info!(
                    slots,
                    pool = ids,
                    committed = arena.backed().get(),
                    slot_bytes = %arena.geometry().page_bytes,
                    "the model carries recurrent state: each running request holds a slot of the governed state pool \
                     (idle chunks released and regrown like KV), prefix caching is off, and a preempted request is \
                     recomputed from its prompt"
                );
                sched = sched.with_state_pool(arena);
            }
            None => {
                tracing::info!(
                    slots,
                    "the model carries recurrent state: each running request holds a state slot, prefix caching is off, \
                     and a preempted request is recomputed from its prompt"
                );
                sched = sched.with_state_slots(slots);
            }
        }
    }
    let (commands, rx) = mpsc::channel();
    let stats = Arc::new(StatsCell::default());
    // Readers see the serving layout from the start.
    let serving = exec.phase();
    stats.publish(|s| s.flips.serving = serving);
    let sampler_stats = Arc::new(SamplerStats::default());
    let device_sampling = exec.samples_on_device();
    if device_sampling {
        tracing::info!("rows without log-probabilities or a grammar are sampled on the device");
    }
    let mut core = Core {
        exec,
        sched,
        live: HashMap::new(),
        rx,
        stats: stats.clone(),
        logits: Vec::new(),
        sampler: CpuSampler::new(sampler_stats.clone()),
        device_sampling,
        drawn: SampledRows::default(),
        edits: Vec::new(),
        shutting_down: false,
        flips: FlipControl::default(),
        last_step_end: None,
    };
    let thread = std::thread::Builder::new()
        .name("corridor-engine".into())
        .spawn(move || core.run())
        .map_err(|e| EngineError::Startup(e.to_string()))?;
    Ok(EngineHandle {
        commands,
        next_id: Arc::new(AtomicU64::new(1)),
        stats,
        sampler_stats,
        info,
        thread: Arc::new(std::sync::Mutex::new(Some(thread))),
    })
}

struct Core {
    exec: Box<dyn Executor>,
    sched: Scheduler,
    live: HashMap<RequestId, Live>,
    rx: mpsc::Receiver<Command>,
    stats: Arc<StatsCell>,
    /// `[logit rows, vocab]` of the last step.
    logits: Vec<f32>,
    sampler: CpuSampler,
    /// Rows may be drawn on the device ([`Executor::execute_sampling`]).
    device_sampling: bool,
    /// The device's answers of the last step, kept to reuse the buffers.
    drawn: SampledRows,
    /// The device rows' edits of a step, kept between steps so a batch's
    /// (a penalized prompt token each) is not a fresh allocation every step.
    edits: Vec<LogitEdit>,
    shutting_down: bool,
    flips: FlipControl,
    /// When the last step ended: the trace of steps tells the time between them.
    last_step_end: Option<std::time::Instant>,
}

impl Core {
    fn run(&mut self) {
        // Readers see the configuration (the ITL target) before any step.
        self.publish_stats();
        loop {
            // Block for work when idle; otherwise take whatever has arrived.
            if !self.sched.has_work() {
                if self.shutting_down {
                    break;
                }
                match self.rx.recv() {
                    Ok(cmd) => self.command(cmd),
                    Err(_) => break,
                }
            }
            while let Ok(cmd) = self.rx.try_recv() {
                self.command(cmd);
            }
            self.drop_disconnected();
            let started = std::time::Instant::now();
            let out = self.sched.schedule();
            for &id in &out.out_of_capacity {
                self.finish(id, FinishReason::Length);
            }
            if !out.is_empty() {
                self.step(&out, started);
                self.auto_flip();
            } else if self.sched.has_work() {
                // Nothing fits now (the card is under pressure): wait for
                // memory or a command instead of spinning.
                if let Ok(cmd) = self.rx.recv_timeout(std::time::Duration::from_millis(5)) {
                    self.command(cmd);
                }
            }
            self.publish_stats();
            #[cfg(debug_assertions)]
            if let Err(e) = self.sched.pool().check_invariants() {
                panic!("page pool invariant broken: {e}");
            }
        }
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Add { id, req, tx } => {
                let req = *req;
                if self.shutting_down {
                    let _ = tx.send(Event::Done { reason: FinishReason::Aborted, usage: Usage::default() });
                    return;
                }
                let state = SamplerState::new(&req.params, &req.prompt, &req.eos_ids);
                let prompt_len = req.prompt.len();
                self.live.insert(
                    id,
                    Live {
                        tx,
                        params: req.params,
                        state,
                        eos_ids: req.eos_ids,
                        prompt_len,
                        generated: 0,
                        max_new: req.max_new_tokens,
                        constraint: req.constraint,
                    },
                );
                self.stats.add_prompt_tokens(prompt_len);
                self.sched.add(id, req.prompt);
            }
            Command::Abort(id) => {
                if self.live.contains_key(&id) {
                    self.stats.note_abort();
                    self.finish(id, FinishReason::Aborted);
                }
            }
            Command::Finish(id) => {
                if self.live.contains_key(&id) {
                    self.finish(id, FinishReason::Stop);
                }
            }
            Command::GiveBack { card, need, reply } => {
                let exec = &mut self.exec;
                // The guard aims `delta` above what the card needs.
                let delta = self.sched.pool().arena().settings_on(card).map_or(Bytes::ZERO, |s| s.delta);
                let must = need.saturating_sub(delta);
                let done = self.sched.give_back(card, need, must, &mut |moves| {
                    exec.move_pages(moves).map_err(|e| e.to_string())
                });
                if done.moved > 0 || !done.preempted.is_empty() {
                    tracing::info!(
                        %card,
                        %need,
                        released = %done.bytes,
                        moved = done.moved,
                        evicted = done.evicted,
                        preempted = done.preempted.len(),
                        "gave KV memory back"
                    );
                }
                self.stats.note_give_back(done.moved, done.preempted.len());
                // The asker may have timed out and gone; the work stands.
                let _ = reply.send(done.bytes);
            }
            Command::Flip { to, skew_digest, reply } => {
                let _ = reply.send(self.flip(to, FlipTrigger::Manual, skew_digest));
            }
            Command::FlipSetup(settings) => self.flips.configure(*settings),
            Command::Shutdown => {
                self.shutting_down = true;
                let ids: Vec<RequestId> = self.live.keys().copied().collect();
                for id in ids {
                    self.finish(id, FinishReason::Aborted);
                }
            }
        }
    }

    /// Abort requests whose client has gone (their receiver was dropped).
    fn drop_disconnected(&mut self) {
        let gone: Vec<RequestId> =
            self.live.iter().filter(|(_, l)| l.tx.is_closed()).map(|(id, _)| *id).collect();
        for id in gone {
            self.stats.note_abort();
            self.finish(id, FinishReason::Aborted);
        }
    }

    fn finish(&mut self, id: RequestId, reason: FinishReason) {
        let cached = self.sched.cached_tokens(id).unwrap_or(0);
        self.sched.remove(id);
        if let Some(l) = self.live.remove(&id) {
            let usage =
                Usage { prompt_tokens: l.prompt_len, cached_tokens: cached, completion_tokens: l.generated };
            let _ = l.tx.send(Event::Done { reason, usage });
            self.stats.note_finished();
        }
    }

    fn step(&mut self, out: &SchedulerOutput, started: std::time::Instant) {
        // Rows that need their whole row on the host (log-probabilities, a
        // grammar mask) or bring more edits than a device row takes come
        // first and are copied; the rest are drawn on the device when the
        // executor can.
        let on_host = |id: &RequestId| {
            !self.device_sampling
                || self.live.get(id).is_none_or(|l| {
                    l.params.logprobs.is_some()
                        || l.constraint.is_some()
                        || device::edits_bound(&l.params, &l.state, &l.eos_ids) > MAX_EDITS_PER_ROW
                })
        };
        let (host, device): (Vec<_>, Vec<_>) =
            out.seqs.iter().filter(|s| s.samples).partition(|s| on_host(&s.id));
        let logit_rows: Vec<usize> = host.iter().chain(&device).map(|s| s.row_start + s.rows - 1).collect();
        let host_ids: Vec<RequestId> = host.iter().map(|s| s.id).collect();
        let device_ids: Vec<RequestId> = device.iter().map(|s| s.id).collect();
        let mut edits = std::mem::take(&mut self.edits);
        let specs = self.plan_device_rows(&device_ids, host_ids.len(), &mut edits);
        let scheduled = std::time::Instant::now();
        let ran = if device_ids.is_empty() {
            self.exec.execute(out, &logit_rows, &mut self.logits)
        } else {
            let draw = DeviceDraw { host_rows: host_ids.len(), specs: &specs, edits: &edits };
            self.exec.execute_sampling(out, &logit_rows, &mut self.logits, &draw, &mut self.drawn)
        };
        self.edits = edits;
        let forwarded = std::time::Instant::now();
        if let Some(phase) = self.exec.phase() {
            let shape = out.shape();
            self.flips.observe_step(phase, shape.prefill_rows, shape.decode_rows, forwarded - scheduled);
        }
        if let Err(e) = ran {
            // A failed forward fails the requests in it, not the server.
            tracing::error!("forward pass failed: {e}");
            for s in &out.seqs {
                self.finish(s.id, FinishReason::Error(format!("forward pass failed: {e}")));
            }
            return;
        }
        self.sched.complete_step(out);
        self.sample(&host_ids);
        self.settle_device_rows(&device_ids, &specs);
        let secs = |a: std::time::Instant, b: std::time::Instant| b.duration_since(a).as_secs_f64();
        let finished = std::time::Instant::now();
        // What each decode in the step waited for its token: the step-time
        // model learns it, so the next mixed steps keep the ITL target.
        self.sched.observe_step(out, finished.duration_since(started));
        let budget = self.sched.step_budget();
        let (cost, measured) = (budget.cost(), budget.measured());
        // Published before the step is counted, so a reader that sees the
        // step sees what it taught.
        self.stats.publish(|s| {
            s.step_cost = cost;
            s.step_cost_measured = measured;
        });
        self.stats.add_step(secs(started, scheduled), secs(scheduled, forwarded), secs(forwarded, finished));
        let shape = out.shape();
        let between = self.last_step_end.replace(finished).map(|end| secs(end, started));
        tracing::trace!(
            target: "corridor::step",
            between_ms = between.unwrap_or(0.0) * 1e3,
            prefill_rows = shape.prefill_rows,
            decode_rows = shape.decode_rows,
            schedule_ms = secs(started, scheduled) * 1e3,
            forward_ms = secs(scheduled, forwarded) * 1e3,
            sample_ms = secs(forwarded, finished) * 1e3,
            "step"
        );
    }

    /// Sample one token for each id (in logit-row order) and apply it.
    fn sample(&mut self, ids: &[RequestId]) {
        let vocab = self.exec.config().vocab_size;
        let (masks, failed) = self.grammar_masks(ids, vocab);
        for (id, message) in failed {
            self.finish(id, FinishReason::Error(message));
        }
        // Rows of requests that just ended (their grammar failed) leave the
        // batch: move the rows after them down, so row i is ids[i]'s again.
        let mut kept = Vec::with_capacity(ids.len());
        for (row, &id) in ids.iter().enumerate() {
            if self.live.contains_key(&id) {
                let to = kept.len();
                if to != row {
                    self.logits.copy_within(row * vocab..(row + 1) * vocab, to * vocab);
                }
                kept.push(id);
            }
        }
        let ids = &kept[..];
        let outcomes = {
            let mut rows: Vec<SampleRow<'_>> = Vec::with_capacity(ids.len());
            // Collect disjoint &mut borrows of the live map in id order.
            let mut by_id: HashMap<RequestId, &mut Live> =
                self.live.iter_mut().map(|(k, v)| (*k, v)).collect();
            for id in ids {
                let l = by_id.remove(id).expect("scheduled ids are live");
                rows.push(SampleRow {
                    request_id: *id,
                    params: &l.params,
                    state: &mut l.state,
                    eos_token_ids: &l.eos_ids,
                    mask: masks.get(id),
                });
            }
            self.sampler.sample(&mut self.logits[..ids.len() * vocab], vocab, &mut rows)
        };
        let outcomes = match outcomes {
            Ok(o) => o,
            Err(e) => {
                // A malformed batch is our bug, not the clients': fail these
                // requests with the reason and keep serving.
                tracing::error!("sampling failed for the whole batch: {e}");
                for &id in ids {
                    self.finish(id, FinishReason::Error(format!("sampling failed: {e}")));
                }
                return;
            }
        };
        self.apply_outcomes(ids, outcomes);
    }

    /// The device's specs of the rows `ids` (logit rows `first..`, in
    /// order): each row's uniform drawn from its stream, and its edits.
    fn plan_device_rows(
        &mut self,
        ids: &[RequestId],
        first: usize,
        edits: &mut Vec<LogitEdit>,
    ) -> Vec<SampleRowSpec> {
        let vocab = self.exec.config().vocab_size;
        edits.clear();
        let mut specs = Vec::with_capacity(ids.len());
        for (j, id) in ids.iter().enumerate() {
            let l = self.live.get_mut(id).expect("scheduled ids are live");
            let mut row = SampleRow {
                request_id: *id,
                params: &l.params,
                state: &mut l.state,
                eos_token_ids: &l.eos_ids,
                mask: None,
            };
            specs.push(device::plan_row(&mut row, vocab, (first + j) as u32, edits));
        }
        specs
    }

    /// Settle the rows drawn on the device (`self.drawn`, one summary per
    /// spec) by the host sampler's rules, and apply them.
    fn settle_device_rows(&mut self, ids: &[RequestId], specs: &[SampleRowSpec]) {
        if ids.is_empty() {
            return;
        }
        let vocab = self.exec.config().vocab_size;
        let drawn = std::mem::take(&mut self.drawn);
        let spilled = drawn.rows.iter().filter(|r| r.status == ROW_TOO_MANY_CANDIDATES).count();
        if drawn.rows.len() != ids.len() || drawn.spill.len() != spilled * vocab {
            tracing::error!(
                rows = ids.len(),
                summaries = drawn.rows.len(),
                "the device sampled a malformed batch"
            );
            for &id in ids {
                self.finish(id, FinishReason::Error("sampling failed: malformed device answer".into()));
            }
            self.drawn = drawn;
            return;
        }
        let stats = self.sampler.stats().clone();
        let mut spill = drawn.spill.chunks(vocab);
        let mut outcomes = Vec::with_capacity(ids.len());
        for ((id, spec), summary) in ids.iter().zip(specs).zip(&drawn.rows) {
            let l = self.live.get_mut(id).expect("scheduled ids are live");
            let mut row = SampleRow {
                request_id: *id,
                params: &l.params,
                state: &mut l.state,
                eos_token_ids: &l.eos_ids,
                mask: None,
            };
            let rows = if summary.status == ROW_TOO_MANY_CANDIDATES { spill.next() } else { None };
            outcomes.push(device::settle_row(&stats, &mut row, spec, summary, vocab, rows));
        }
        self.drawn = drawn;
        self.apply_outcomes(ids, outcomes);
    }

    /// Emit each row's token (or end its request) and append it.
    fn apply_outcomes(&mut self, ids: &[RequestId], outcomes: Vec<crate::sampling::SampleOutcome>) {
        for (&id, outcome) in ids.iter().zip(outcomes) {
            match outcome {
                Err(e) => self.finish(id, FinishReason::Error(e.to_string())),
                Ok(s) => {
                    let l = self.live.get_mut(&id).expect("scheduled ids are live");
                    if s.stop.is_some() {
                        self.finish(id, FinishReason::Stop);
                        continue;
                    }
                    if let Some(Err(e)) = l.constraint.as_mut().map(|c| c.0.accept(s.token)) {
                        self.finish(id, FinishReason::Error(e.to_string()));
                        continue;
                    }
                    l.generated += 1;
                    self.stats.add_generated(1);
                    let _ = l.tx.send(Event::Token {
                        token: s.token,
                        logprob: s.logprob,
                        top_logprobs: s.top_logprobs,
                    });
                    self.sched.append_token(id, s.token);
                    let len = self.sched.seq_len(id).unwrap_or(0);
                    let capped = l.max_new.is_some_and(|m| l.generated >= m);
                    if capped || len >= self.sched.config().context_len {
                        self.finish(id, FinishReason::Length);
                    }
                }
            }
        }
    }

    /// The grammar masks of the constrained rows among `ids`, computed in
    /// parallel (one grammar per row, on rayon's pool), with the requests
    /// whose grammar failed. Rows without a grammar cost nothing here.
    fn grammar_masks(
        &mut self,
        ids: &[RequestId],
        vocab: usize,
    ) -> (HashMap<RequestId, crate::sampling::TokenMask>, Vec<(RequestId, String)>) {
        use rayon::prelude::*;
        let mut constrained: Vec<(RequestId, &mut Constraint)> = Vec::new();
        let wanted: std::collections::HashSet<RequestId> = ids.iter().copied().collect();
        for (id, l) in self.live.iter_mut() {
            if let (true, Some(c)) = (wanted.contains(id), l.constraint.as_mut()) {
                constrained.push((*id, c));
            }
        }
        if constrained.is_empty() {
            return (HashMap::new(), Vec::new());
        }
        let results: Vec<(RequestId, Result<_, _>)> =
            constrained.into_par_iter().map(|(id, c)| (id, c.0.mask(vocab))).collect();
        let mut masks = HashMap::with_capacity(results.len());
        let mut failed = Vec::new();
        for (id, r) in results {
            match r {
                Ok(m) => {
                    masks.insert(id, m);
                }
                Err(e) => failed.push((id, e.to_string())),
            }
        }
        (masks, failed)
    }

    /// `--phase-flip auto`: ask the policy after each step and flip when it
    /// says so (between steps, like a manual flip).
    fn auto_flip(&mut self) {
        if self.flips.mode != FlipMode::Auto || self.flips.disabled {
            return;
        }
        let Some(phase) = self.exec.phase() else { return };
        let decision = self.flips.decide(phase, self.sched.pending_prefill());
        tracing::trace!(%decision, "flip policy");
        if let Some(to) = decision.flip_to() {
            tracing::info!(%to, reason = %decision.reason(), "the flip policy flips");
            if let Err(e) = self.flip(to, FlipTrigger::Auto, None) {
                tracing::warn!("the flip policy's flip was not tried: {e}");
            }
        }
    }

    /// Flip between steps, carrying every live page and running request.
    fn flip(&mut self, to: Phase, trigger: FlipTrigger, skew: Option<Rank>) -> Result<FlipRecord, FlipError> {
        let live = self.sched.pool().arena().live_pages();
        let requests = self.sched.num_running();
        self.flips.flip(&mut *self.exec, to, live, requests, trigger, skew)
    }

    fn publish_stats(&self) {
        let pool = self.sched.pool();
        let mut flips = self.flips.stats.clone();
        flips.serving = self.exec.phase();
        flips.mode = self.flips.mode;
        self.stats.publish(|s| {
            s.flips = flips;
            s.running = self.sched.num_running();
            s.waiting = self.sched.num_waiting();
            s.pages = pool.counts();
            s.prefix_lookup_tokens = pool.lookup_tokens;
            s.prefix_hit_tokens = pool.hit_tokens;
            s.preemptions = self.sched.preemptions;
            s.itl_target = self.sched.step_budget().target();
            s.itl_stall_ratio = self.sched.step_budget().bound().stall_ratio;
        });
    }
}

/// Relief provider: the engine gives memory back between steps (see
/// [`EngineHandle::kv_relief`]).
struct KvRelief {
    commands: std::sync::Mutex<mpsc::Sender<Command>>,
    /// Asking from the engine thread itself would wait on its own answer.
    engine_thread: Option<std::thread::ThreadId>,
    timeout: std::time::Duration,
}

impl ReliefProvider for KvRelief {
    fn name(&self) -> &str {
        "move KV pages between steps, or preempt"
    }
    fn tier(&self) -> Tier {
        Tier::Local
    }
    fn cost(&self) -> u32 {
        // After idle chunks (cost 0), before evicting prefixes (10): a move
        // costs a copy and keeps every prefix; it preempts only when running
        // requests truly hold more than the card keeps.
        5
    }
    fn relieve(&self, card: CardId, need: Bytes) -> Bytes {
        if Some(std::thread::current().id()) == self.engine_thread {
            return Bytes::ZERO;
        }
        let (reply, answer) = mpsc::channel();
        let sent = self
            .commands
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(Command::GiveBack { card, need, reply })
            .is_ok();
        if !sent {
            return Bytes::ZERO;
        }
        match answer.recv_timeout(self.timeout) {
            Ok(bytes) => bytes,
            Err(_) => {
                tracing::warn!(%card, %need, timeout = ?self.timeout, "the engine did not answer a request for memory in time");
                Bytes::ZERO
            }
        }
    }
}
