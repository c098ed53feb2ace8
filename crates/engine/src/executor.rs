//! Executors run a scheduled step on the model and return the logits of the
//! rows that sample. The engine loop sees only this trait, so one card, a
//! group of tensor-parallel ranks or a pipeline of stages all drive the same
//! loop.

use crate::microbatch::{logit_places, split_step};
use crate::phase::{FlipVerdict, Phase};
use crate::scheduler::SchedulerOutput;
use corridor_backend::collective::{Collective, Solo};
use corridor_backend::sample::{LogitEdit, SampleRowSpec, SampledRows};
use corridor_backend::{Backend, GraphKey, SeqStep};
use corridor_model::layout::Layout;
use corridor_model::ModelConfig;
use corridor_model::{KvCache, Model, ModelError, StepInput, Workspace};
use corridor_units::{Bytes, PageId, Pages, Rank, StateSlot, TokenId, Tokens};

/// Runs steps for the engine.
pub trait Executor: Send + 'static {
    fn config(&self) -> &ModelConfig;
    /// Run `step` and leave the logits of `logit_rows` in `logits`
    /// (`[logit_rows.len(), vocab]`, row-major).
    fn execute(
        &mut self,
        step: &SchedulerOutput,
        logit_rows: &[usize],
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError>;
    /// Whether [`Executor::execute_sampling`] can draw rows where their
    /// logits are (one card holding the whole vocabulary, on a backend with
    /// `sample_rows`, device sampling not turned off).
    fn samples_on_device(&self) -> bool {
        false
    }
    /// Run `step` as [`Executor::execute`] does, but copy only the first
    /// `draw.host_rows` of `logit_rows` to `logits` (their raw rows, before
    /// any edit) and draw the rows `draw.specs` name (a spec's `row` indexes
    /// `logit_rows`) on the device, one summary each in `out`.
    fn execute_sampling(
        &mut self,
        _step: &SchedulerOutput,
        _logit_rows: &[usize],
        _logits: &mut Vec<f32>,
        _draw: &DeviceDraw<'_>,
        _out: &mut SampledRows,
    ) -> Result<(), ModelError> {
        Err(ModelError::Step("this executor samples on the host only".into()))
    }
    /// Copy the KV of each `(from, to)` page, every layer this executor
    /// holds, and wait until the copies are done, so the sources can be
    /// released. Runs between steps.
    fn move_pages(&mut self, moves: &[(PageId, PageId)]) -> Result<(), ModelError>;
    /// The layout that serves, in a group that holds two and can flip.
    fn phase(&self) -> Option<Phase> {
        None
    }
    /// Both layouts of a flipping group (tensor, then pipeline); empty
    /// otherwise.
    fn layouts(&self) -> Vec<Layout> {
        Vec::new()
    }
    /// Re-shard the KV of `live` into the `to` layout and serve in it from
    /// the next step, if every rank agrees; between steps only. An abandoned
    /// flip leaves the serving layout as it was. `skew_digest` injects a
    /// ballot disagreement on that rank (to exercise the abandon path).
    fn flip(
        &mut self,
        _to: Phase,
        _live: Vec<PageId>,
        _skew_digest: Option<Rank>,
    ) -> Result<FlipOutcome, ModelError> {
        Err(ModelError::Step("this executor holds one layout; it cannot flip".into()))
    }
    /// Recurrent-state slots the model holds, one per sequence that may run
    /// at once; `None` for a model without recurrent state, or an executor
    /// that does not say (the engine then trusts its running limit).
    fn state_slots(&self) -> Option<usize> {
        None
    }
}

/// How a flip ended, for the engine's records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlipOutcome {
    pub verdict: FlipVerdict,
    /// Live pages carried.
    pub pages: usize,
    pub wave_layers: usize,
    /// The most staging any rank reserved.
    pub staging: Bytes,
    /// The group's flip counter after this attempt.
    pub epoch: u64,
}

/// The rows of a step drawn on the device ([`Executor::execute_sampling`]).
#[derive(Clone, Copy, Debug)]
pub struct DeviceDraw<'a> {
    /// Leading logit rows copied to the host for the host sampler.
    pub host_rows: usize,
    /// One per row drawn on the device.
    pub specs: &'a [SampleRowSpec],
    /// The specs' edits.
    pub edits: &'a [LogitEdit],
}

/// Sizes the executor must be able to run.
#[derive(Clone, Copy, Debug)]
pub struct ExecutorLimits {
    /// Token rows per step (the scheduler's token budget).
    pub max_rows: Tokens,
    /// Rows that sample per step: a count of rows, one per running sequence
    /// (and of state slots for a model with recurrent state), not of tokens.
    pub max_logit_rows: usize,
    /// Tokens per KV page.
    pub page_size: Tokens,
    /// KV pages the cache holds (the page pool's id space).
    pub num_pages: Pages,
}

/// The whole model on one backend, or one rank's slice of it with the
/// collective that joins it to its peers (`with_collective`).
pub struct SingleRank<B: Backend> {
    backend: B,
    model: Model<B>,
    ws: Workspace<B>,
    kv: KvCache<B>,
    comm: Box<dyn Collective<B>>,
    /// Decode steps are padded up to one of a few batch sizes (when the
    /// backend replays captured steps), at most this many rows.
    pad_limit: Option<usize>,
    padded: PaddedStep,
    /// Each step's state slots, parallel to its sequences.
    slots: Vec<StateSlot>,
    /// Rows may be drawn on the device when the model and backend allow.
    device_sampling: bool,
}

/// A decode step padded with rows that belong to no sequence.
#[derive(Default)]
struct PaddedStep {
    tokens: Vec<TokenId>,
    positions: Vec<u32>,
    logit_rows: Vec<usize>,
}

/// The batch size a decode step of `rows` rows is padded to: powers of two up
/// to 8, then multiples of 16 up to 128, then of 64, so a handful of captured
/// steps serve every batch. Padding costs little: a decode step's time is the
/// weight read, the same for 17 rows as for 32.
pub fn decode_bucket(rows: usize) -> usize {
    match rows {
        0..=8 => rows.next_power_of_two(),
        9..=128 => rows.div_ceil(16) * 16,
        _ => rows.div_ceil(64) * 64,
    }
}

/// The captured replay the executor runs a step as: a decode step (every
/// sequence one row, every row sampling: the same kernels on the same
/// buffers for every batch of its size, only the uploaded metadata differs)
/// on a rank whose forward is `replayable` ([`Model::replayable`]); `None`,
/// run op by op, for every prefill or mixed step and every rank that reads
/// the host mid-step. The executor is the one place this is decided; the
/// model only runs the key it is handed.
pub fn capture_key(input: &StepInput<'_>, replayable: bool) -> Option<GraphKey> {
    (replayable && input.is_decode())
        .then_some(GraphKey { rows: input.tokens.len(), logit_rows: input.logit_rows.len() })
}

impl<B: Backend> SingleRank<B> {
    /// Allocate the workspace and KV cache for `limits`, once.
    pub fn new(backend: B, model: Model<B>, limits: ExecutorLimits) -> Result<Self, ModelError> {
        let ws = model.workspace(&backend, limits.max_rows, limits.max_logit_rows)?;
        let kv = model.kv_cache(&backend, limits.page_size, limits.num_pages)?;
        Ok(Self::from_parts(backend, model, ws, kv))
    }

    /// Pad decode steps to [`decode_bucket`] sizes or not, whatever the
    /// backend says (the CPU never captures; this lets a test check that
    /// padding leaves every real row's logits as they were).
    pub fn with_decode_padding(mut self, on: bool) -> Self {
        self.pad_limit = on.then(|| self.ws.max_rows().min(self.ws.max_logit_rows()));
        self
    }

    /// Run over a workspace and KV cache allocated by the caller (at boot,
    /// where the workspace must be resident before KV is sized).
    pub fn from_parts(backend: B, model: Model<B>, ws: Workspace<B>, kv: KvCache<B>) -> Self {
        let pad_limit = backend.captures_graphs().then(|| ws.max_rows().min(ws.max_logit_rows()));
        SingleRank {
            backend,
            model,
            ws,
            kv,
            comm: Box::new(Solo::new()),
            pad_limit,
            padded: PaddedStep::default(),
            slots: Vec::new(),
            device_sampling: true,
        }
    }

    /// Draw rows on the device where the model and backend allow (`on`,
    /// the default), or always copy every logit row to the host.
    pub fn with_device_sampling(mut self, on: bool) -> Self {
        self.device_sampling = on;
        self
    }

    /// Run as one rank of a layout: every step's exchanges go through `comm`.
    /// Padding and warm-up are decided from what every rank shares (the
    /// workspace limits and the backend kind), so the ranks stay in lockstep.
    pub fn with_collective(mut self, comm: Box<dyn Collective<B>>) -> Self {
        self.comm = comm;
        self
    }

    pub fn collective(&self) -> &dyn Collective<B> {
        &*self.comm
    }

    pub fn model(&self) -> &Model<B> {
        &self.model
    }

    /// The backend and the KV cache, for work on the cache between steps
    /// (a layout change re-sharding it).
    pub fn kv_parts(&mut self) -> (&B, &mut KvCache<B>) {
        (&self.backend, &mut self.kv)
    }
}

impl<B: Backend> SingleRank<B> {
    /// Run every decode shape the engine will form once on rows that belong
    /// to no sequence (they touch no KV page), so a backend that captures
    /// steps holds every graph, and every library kernel a prefill loads is
    /// loaded, before KV is sized. Returns the batch sizes captured.
    pub fn warm_up(&mut self) -> Result<Vec<usize>, ModelError> {
        let mut logits = Vec::new();
        let mut run = |me: &mut Self, rows: usize| -> Result<(), ModelError> {
            let tokens = vec![TokenId(0); rows];
            let positions = vec![0u32; rows];
            let logit_rows: Vec<usize> = (0..rows.min(me.ws.max_logit_rows())).collect();
            let mut input = StepInput {
                tokens: &tokens,
                positions: &positions,
                seqs: &[],
                logit_rows: &logit_rows,
                state_slots: &[],
                capture: None,
            };
            input.capture = capture_key(&input, me.model.replayable(&*me.comm));
            me.model.forward_ranked(&me.backend, &*me.comm, &mut me.ws, &mut me.kv, &input, &mut logits)
        };
        // Prefill-sized steps first, where the backend wants them (cuBLASLt
        // picks kernels by shape).
        for rows in self.backend.warm_up_rows(self.ws.max_rows()) {
            run(self, rows)?;
        }
        if self.samples_on_device() {
            self.backend.reserve_sample_rows(self.ws.max_logit_rows())?;
        }
        let Some(limit) = self.pad_limit else {
            return Ok(Vec::new());
        };
        let mut sizes = Vec::new();
        let mut rows = 1;
        while rows <= limit {
            let b = decode_bucket(rows).min(limit);
            if sizes.last() != Some(&b) {
                run(self, b)?;
                sizes.push(b);
            }
            rows = b + 1;
        }
        Ok(sizes)
    }
}

/// The per-sequence views the model wants, borrowed from a scheduler output.
pub fn seq_steps(step: &SchedulerOutput) -> Vec<SeqStep<'_>> {
    step.seqs
        .iter()
        .map(|s| SeqStep { row_start: s.row_start, rows: s.rows, cached: s.cached, pages: &s.pages })
        .collect()
}

impl<B: Backend> SingleRank<B> {
    /// Run `step` cut into `parts` consecutive micro-batches
    /// ([`split_step`]), one after another, and leave the logits of
    /// `logit_rows` in `logits` in the order asked, as [`Executor::execute`]
    /// would. In a pipeline every rank runs the same parts, so a stage
    /// works on a part while the next stage works on the one before.
    /// A rank that computes no logits leaves `logits` empty.
    pub fn execute_microbatched(
        &mut self,
        step: &SchedulerOutput,
        logit_rows: &[usize],
        logits: &mut Vec<f32>,
        parts: usize,
    ) -> Result<(), ModelError> {
        let split = split_step(step, logit_rows, parts);
        if split.len() <= 1 {
            return self.execute(step, logit_rows, logits);
        }
        let vocab = self.model.config().vocab_size;
        let places = logit_places(step.tokens.len(), logit_rows, split.len());
        let mut outs = Vec::with_capacity(split.len());
        for (part, rows) in &split {
            let mut part_logits = Vec::new();
            self.execute(part, rows, &mut part_logits)?;
            if !part_logits.is_empty() && part_logits.len() != rows.len() * vocab {
                return Err(ModelError::Step(format!(
                    "a micro-batch of {} logit rows returned {} values",
                    rows.len(),
                    part_logits.len()
                )));
            }
            outs.push(part_logits);
        }
        logits.clear();
        if outs.iter().all(|o| o.is_empty()) {
            return Ok(());
        }
        logits.resize(logit_rows.len() * vocab, 0.0);
        for (i, &(k, j)) in places.iter().enumerate() {
            let Some(row) = outs[k].get(j * vocab..(j + 1) * vocab) else {
                return Err(ModelError::Step(format!("micro-batch {k} returned no logits for row {j}")));
            };
            logits[i * vocab..(i + 1) * vocab].copy_from_slice(row);
        }
        Ok(())
    }
}

impl<B: Backend> Executor for SingleRank<B> {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn execute(
        &mut self,
        step: &SchedulerOutput,
        logit_rows: &[usize],
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        self.run(step, logit_rows, logits, usize::MAX)
    }

    fn samples_on_device(&self) -> bool {
        self.device_sampling && self.model.samples_on_device(&self.backend, &*self.comm)
    }

    fn execute_sampling(
        &mut self,
        step: &SchedulerOutput,
        logit_rows: &[usize],
        logits: &mut Vec<f32>,
        draw: &DeviceDraw<'_>,
        out: &mut SampledRows,
    ) -> Result<(), ModelError> {
        if !self.samples_on_device() {
            return Err(ModelError::Step("device sampling is off or not available here".into()));
        }
        if let Some(s) = draw
            .specs
            .iter()
            .find(|s| (s.row as usize) < draw.host_rows || s.row as usize >= logit_rows.len())
        {
            return Err(ModelError::Step(format!(
                "a device row reads logit row {} of {} ({} go to the host)",
                s.row,
                logit_rows.len(),
                draw.host_rows
            )));
        }
        self.run(step, logit_rows, logits, draw.host_rows)?;
        self.model.sample_on_device(&self.backend, &mut self.ws, draw.specs, draw.edits, out)
    }

    fn move_pages(&mut self, moves: &[(PageId, PageId)]) -> Result<(), ModelError> {
        for &(from, to) in moves {
            self.kv.copy_page(&self.backend, from, to);
        }
        Ok(self.backend.synchronize()?)
    }

    fn state_slots(&self) -> Option<usize> {
        self.model.has_state().then(|| self.ws.state_slots())
    }
}

impl<B: Backend> SingleRank<B> {
    /// One step, the first `host_rows` logit rows copied to the host.
    fn run(
        &mut self,
        step: &SchedulerOutput,
        logit_rows: &[usize],
        logits: &mut Vec<f32>,
        host_rows: usize,
    ) -> Result<(), ModelError> {
        let seqs = seq_steps(step);
        let rows = step.tokens.len();
        self.slots.clear();
        if self.model.has_state() {
            for s in &step.seqs {
                let slot = s.state_slot.ok_or_else(|| {
                    ModelError::Step(format!("{} has no state slot; the model needs one", s.id))
                })?;
                self.slots.push(slot);
            }
        }
        let mut input = StepInput {
            tokens: &step.tokens,
            positions: &step.positions,
            seqs: &seqs,
            logit_rows,
            state_slots: &self.slots,
            capture: None,
        };
        // A rank alone runs its step where its backend's ops run best
        // (`Backend::run_step`: the CPU's pool). A rank of a group does not:
        // it blocks in collectives, and a pool worker blocked waiting for a
        // peer whose step is queued behind it on the same pool never wakes.
        let replayable = self.model.replayable(&*self.comm);
        let target = match self.pad_limit {
            Some(limit) if input.is_decode() && rows > 0 => decode_bucket(rows).min(limit).max(rows),
            _ => rows,
        };
        if target == rows {
            input.capture = capture_key(&input, replayable);
            let (backend, comm, model) = (&self.backend, &*self.comm, &self.model);
            let (ws, kv) = (&mut self.ws, &mut self.kv);
            let mut forward = || model.forward_ranked_rows(backend, comm, ws, kv, &input, logits, host_rows);
            return if comm.world() == 1 { backend.run_step(forward) } else { forward() };
        }
        let p = &mut self.padded;
        p.tokens.clear();
        p.tokens.extend_from_slice(&step.tokens);
        p.tokens.resize(target, TokenId(0));
        p.positions.clear();
        p.positions.extend_from_slice(&step.positions);
        p.positions.resize(target, 0);
        p.logit_rows.clear();
        p.logit_rows.extend_from_slice(logit_rows);
        p.logit_rows.extend(rows..target);
        let mut input = StepInput {
            tokens: &p.tokens,
            positions: &p.positions,
            seqs: &seqs,
            logit_rows: &p.logit_rows,
            state_slots: &self.slots,
            capture: None,
        };
        input.capture = capture_key(&input, replayable);
        let (backend, comm, model) = (&self.backend, &*self.comm, &self.model);
        let (ws, kv) = (&mut self.ws, &mut self.kv);
        let mut forward = || model.forward_ranked_rows(backend, comm, ws, kv, &input, logits, host_rows);
        if comm.world() == 1 { backend.run_step(forward) } else { forward() }?;
        // The padding rows' logits are dropped.
        logits.truncate(logit_rows.len() * self.model.config().vocab_size);
        Ok(())
    }
}
