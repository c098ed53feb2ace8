//! The multi-rank executor: one thread per rank, each owning its backend,
//! its slice of the model, its KV cache and its workspace.
//!
//! The engine thread broadcasts each step (tokens, positions, page tables —
//! page ids are shared by every rank) and takes the logits from the rank that
//! computes them. Ranks stay in lockstep: every rank runs every step, and a
//! rank that fails aborts the group so its peers stop waiting; the step fails,
//! the group is reset, and serving goes on. At a cadence derived from the step
//! counter (replicated: every rank sees every step) the ranks compare their
//! collective census; a divergence fails the step and names the rank behind.
//!
//! Capacity shared by the group (how many pages it admits) is agreed by a MIN
//! reduction over what each rank can hold ([`MultiRank::agree_capacity`]):
//! a rank whose KV lives on a card of its own measures that card's free
//! column and offers the pages that fit above its floor and margin.
//!
//! The ranks are generic over the backend: CPU ranks (on the host or on sim
//! cards) join through the in-process group, GPU ranks through NCCL.

use crate::executor::{Executor, ExecutorLimits, FlipOutcome, SingleRank};
use crate::phase::{self, AbandonReason, FlipOrder, FlipVerdict, Phase, RankFlip, RankState};
use crate::scheduler::SchedulerOutput;
use corridor_backend::collective::{
    CollectiveError, GroupShape, LinkModel, LinkStats, ThreadGroup, ThreadRank,
};
use corridor_backend::cpu::CpuBackend;
use corridor_backend::Backend;
use corridor_model::layout::{Layout, LayoutKind};
use corridor_model::{Checkpoint, ModelConfig};
use corridor_model::{Model, ModelError};
use corridor_units::{Bytes, PageId, Pages, Rank, RequestId, TokenId};
use corridor_vram::sizing::{solve, SizingInput};
use corridor_vram::{ChunkGeometry, Device, Purpose, ReserveRequest, Urgency};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How long a rank waits for its peers inside one collective by default.
pub const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(300);

/// A pipeline cuts a step with more prompt rows than this into parts of
/// about this many rows ([`crate::microbatch`]): a 512-row chunk makes six,
/// two per stage of a 3-stage pipeline.
pub const DEFAULT_MICROBATCH_ROWS: usize = 96;

/// How a layout's ranks run.
#[derive(Clone, Copy, Debug)]
pub struct LayoutOptions {
    pub limits: ExecutorLimits,
    /// Compare the collective census every this many steps (0: never).
    pub census_every: u64,
    /// How long a rank waits for its peers inside one collective before the
    /// step fails (a safety net; a failing rank aborts its peers at once).
    pub collective_timeout: Duration,
    /// What a transfer between the in-process ranks costs (`None`: nothing,
    /// as between threads); see [`LinkModel`].
    pub link: Option<LinkModel>,
    /// In a pipeline, the rows per micro-batch of a step with more prompt
    /// rows than this (0: every step runs whole). Ignored by TP.
    pub microbatch_rows: usize,
}

impl LayoutOptions {
    pub fn new(limits: ExecutorLimits) -> LayoutOptions {
        LayoutOptions {
            limits,
            census_every: 64,
            collective_timeout: COLLECTIVE_TIMEOUT,
            link: None,
            microbatch_rows: DEFAULT_MICROBATCH_ROWS,
        }
    }
}

enum Job {
    Step {
        out: Arc<SchedulerOutput>,
        logit_rows: Arc<Vec<usize>>,
        census: bool,
    },
    /// Propose holding this many pages; every rank answers the group's MIN.
    Capacity(u64),
    /// Run every step shape once (see [`SingleRank::warm_up`]).
    WarmUp,
    /// Copy these pages' KV (every rank its own share of each page).
    MovePages(Arc<Vec<(PageId, PageId)>>),
    /// Re-shard the live pages into the other layout and switch to it if
    /// every rank agrees (see `phase`); `staging` is what each rank reserves.
    Flip {
        order: Arc<FlipOrder>,
        staging: Arc<Vec<Bytes>>,
    },
}

enum Reply {
    Logits(Option<Vec<f32>>),
    Capacity(u64),
    WarmedUp(Vec<usize>),
    Moved,
    Flipped(FlipVerdict),
}

/// Where a rank's KV lives when it has a card of its own: its share of the
/// group's arena, which it measures to offer a capacity.
#[derive(Clone, Debug)]
pub struct KvShare {
    pub device: Device,
    pub geometry: ChunkGeometry,
    /// The error bar sizing keeps above the floor.
    pub margin: Bytes,
}

/// One rank ready to run: its executor (slice, workspace, KV, collective)
/// and, when it has a card of its own, its KV share.
pub struct RankParts<B: Backend> {
    pub exec: SingleRank<B>,
    pub kv: Option<KvShare>,
    /// In a group that flips: the rank's executor for the other layout and
    /// its handle on the control collective.
    pub flip: Option<FlipParts<B>>,
}

/// What a rank of a flipping group holds beside the layout that serves.
pub struct FlipParts<B: Backend> {
    pub other: SingleRank<B>,
    pub control: ThreadRank,
}

/// The two layouts of a flipping group and where it stands.
struct Flipping {
    layouts: Arc<[Layout; 2]>,
    /// The collectives of the two layouts (by [`Phase::index`]) and the
    /// control group the flip protocol runs on.
    groups: [ThreadGroup; 2],
    control: ThreadGroup,
    serving: Phase,
    /// Flips attempted (committed or not): every rank counts the same.
    epoch: u64,
    page_size: usize,
}

/// The staging a rank may spend per flip: waves are cut so each fits.
pub const FLIP_STAGING_CAP: Bytes = Bytes(64 << 20);

/// A layout's ranks as threads of this process.
pub struct MultiRank {
    config: ModelConfig,
    group: ThreadGroup,
    jobs: Vec<mpsc::Sender<Job>>,
    replies: mpsc::Receiver<(usize, Result<Reply, ModelError>)>,
    /// The rank whose logits the engine samples from.
    logits_rank: usize,
    steps: u64,
    census_every: u64,
    threads: Vec<JoinHandle<()>>,
    flipping: Option<Flipping>,
}

/// Load every rank's slice of `ckpt` and start the rank threads. Each rank
/// allocates its workspace and a KV cache of `limits.num_pages` pages (the
/// group's pool, already the MIN over ranks).
pub fn spawn_layout(
    ckpt: &Checkpoint,
    layout: &Layout,
    options: LayoutOptions,
) -> Result<Box<dyn Executor>, ModelError> {
    Ok(Box::new(MultiRank::spawn(ckpt, layout, options)?))
}

impl MultiRank {
    /// CPU ranks: load every rank's slice of `ckpt` and start the rank
    /// threads, joined by the in-process group.
    pub fn spawn(
        ckpt: &Checkpoint,
        layout: &Layout,
        options: LayoutOptions,
    ) -> Result<MultiRank, ModelError> {
        let (group, comms) = ThreadGroup::with_link(
            layout.ranks.len(),
            group_shape(layout),
            options.collective_timeout,
            options.link,
        );
        let l = options.limits;
        let mut ranks = Vec::with_capacity(layout.ranks.len());
        for (slice, comm) in layout.ranks.iter().zip(comms) {
            let backend = CpuBackend::new();
            let model = Model::load_slice(&backend, ckpt, slice, |_| {})?;
            let exec = SingleRank::new(backend, model, l)?.with_collective(Box::new(comm));
            ranks.push(RankParts { exec, kv: None, flip: None });
        }
        Self::start(ckpt.config().clone(), layout, group, ranks, options)
    }

    /// CPU ranks holding both layouts of a flipping group (rank `i` of each
    /// on the same thread), serving `serving` first.
    pub fn spawn_flipping(
        ckpt: &Checkpoint,
        layouts: [Layout; 2],
        serving: Phase,
        options: LayoutOptions,
    ) -> Result<MultiRank, ModelError> {
        let world = layouts[0].ranks.len();
        let groups = layouts.clone().map(|l| {
            ThreadGroup::with_link(world, group_shape(&l), options.collective_timeout, options.link)
        });
        let [(tp_group, tp_comms), (pp_group, pp_comms)] = groups;
        let (control, controls) =
            ThreadGroup::with_link(world, GroupShape::Tensor, options.collective_timeout, options.link);
        let l = options.limits;
        let mut comms = [tp_comms, pp_comms].map(|c| c.into_iter());
        let mut ranks = Vec::with_capacity(world);
        for (i, ctl) in controls.into_iter().enumerate() {
            let mut load = |phase: Phase| -> Result<SingleRank<CpuBackend>, ModelError> {
                let backend = CpuBackend::new();
                let model = Model::load_slice(&backend, ckpt, &layouts[phase.index()].ranks[i], |_| {})?;
                let comm = comms[phase.index()].next().expect("one collective per rank");
                Ok(SingleRank::new(backend, model, l)?.with_collective(Box::new(comm)))
            };
            let exec = load(serving)?;
            let other = load(serving.other())?;
            ranks.push(RankParts { exec, kv: None, flip: Some(FlipParts { other, control: ctl }) });
        }
        Self::start_flipping(
            ckpt.config().clone(),
            layouts,
            [tp_group, pp_group],
            control,
            ranks,
            serving,
            options,
        )
    }

    /// Start the rank threads of a flipping group over ranks made by the
    /// caller: `ranks[i].exec` is rank `i` of `layouts[serving]`, its
    /// `flip.other` rank `i` of the other layout; `groups` are the layouts'
    /// collectives by [`Phase::index`].
    pub fn start_flipping<B: Backend + Send + 'static>(
        config: ModelConfig,
        layouts: [Layout; 2],
        groups: [ThreadGroup; 2],
        control: ThreadGroup,
        ranks: Vec<RankParts<B>>,
        serving: Phase,
        options: LayoutOptions,
    ) -> Result<MultiRank, ModelError> {
        if Phase::of(layouts[0].kind) != Some(Phase::Tensor)
            || Phase::of(layouts[1].kind) != Some(Phase::Pipeline)
        {
            return Err(ModelError::Step(
                "a flipping group holds a tensor layout and a pipeline layout".into(),
            ));
        }
        if layouts[0].ranks.len() != layouts[1].ranks.len() || ranks.iter().any(|r| r.flip.is_none()) {
            return Err(ModelError::Step("both layouts of a flipping group run on the same ranks".into()));
        }
        if config.hybrid.is_some() {
            // A flip carries KV pages; the linear-attention layers' recurrent
            // state is sharded differently in the two layouts and is not
            // re-sharded yet.
            return Err(ModelError::Step(
                "phase flips do not carry recurrent state yet: serve a hybrid model in one layout".into(),
            ));
        }
        phase::transfers(&config, &layouts[0], &layouts[1]).map_err(ModelError::Step)?;
        layouts.iter().try_for_each(|l| logits_rank(l).map(|_| ()))?;
        let layouts = Arc::new(layouts);
        let serving_group = groups[serving.index()].clone();
        let mut multi = Self::start_with(
            config,
            &layouts[serving.index()],
            serving_group,
            ranks,
            options,
            Some(layouts.clone()),
        )?;
        multi.flipping = Some(Flipping {
            layouts,
            groups,
            control,
            serving,
            epoch: 0,
            page_size: options.limits.page_size.get(),
        });
        Ok(multi)
    }

    /// Start one thread per rank over ranks made by the caller (rank `i` of
    /// `layout` is `ranks[i]`, whose collective belongs to `group`).
    pub fn start<B: Backend + Send + 'static>(
        config: ModelConfig,
        layout: &Layout,
        group: ThreadGroup,
        ranks: Vec<RankParts<B>>,
        options: LayoutOptions,
    ) -> Result<MultiRank, ModelError> {
        Self::start_with(config, layout, group, ranks, options, None)
    }

    fn start_with<B: Backend + Send + 'static>(
        config: ModelConfig,
        layout: &Layout,
        group: ThreadGroup,
        ranks: Vec<RankParts<B>>,
        options: LayoutOptions,
        layouts: Option<Arc<[Layout; 2]>>,
    ) -> Result<MultiRank, ModelError> {
        let logits_rank = logits_rank(layout)?;
        let (reply_tx, replies) = mpsc::channel();
        let (mut jobs, mut threads) = (Vec::with_capacity(ranks.len()), Vec::with_capacity(ranks.len()));
        for (slice, parts) in layout.ranks.iter().zip(ranks) {
            tracing::info!(rank = %slice.rank, layers = ?slice.layers, heads = ?slice.heads, kv_heads = ?slice.kv_heads,
                ffn = ?slice.ffn, vocab = ?slice.vocab, "rank loaded");
            let (tx, rx) = mpsc::channel();
            jobs.push(tx);
            let flip = match (parts.flip, &layouts) {
                (Some(f), Some(layouts)) => Some(RankFlipState {
                    other: f.other,
                    control: f.control,
                    layouts: layouts.clone(),
                    config: config.clone(),
                    page_size: options.limits.page_size.get(),
                    serving: Phase::of(layout.kind).expect("a flipping layout is tensor or pipeline"),
                    epoch: 0,
                }),
                _ => None,
            };
            let rank = RankWorker {
                index: slice.rank.0 as usize,
                exec: parts.exec,
                kv: parts.kv,
                max_pages: options.limits.num_pages.get() as u64,
                flip,
                microbatch_rows: options.microbatch_rows,
                pipeline: layout.kind == LayoutKind::Pipeline,
            };
            let reply = reply_tx.clone();
            let t = std::thread::Builder::new()
                .name(format!("corridor-rank{}", slice.rank.0))
                .spawn(move || rank.run(rx, reply))
                .map_err(|e| ModelError::Step(format!("cannot start a rank thread: {e}")))?;
            threads.push(t);
        }
        Ok(MultiRank {
            config,
            group,
            jobs,
            replies,
            logits_rank,
            steps: 0,
            census_every: options.census_every,
            threads,
            flipping: None,
        })
    }

    /// Each rank's modelled link time and bytes so far (see
    /// [`LayoutOptions::link`]; zero without a link model).
    pub fn link_stats(&self) -> Vec<LinkStats> {
        self.group.link_stats()
    }

    /// Every rank runs each step shape once, in lockstep (see
    /// [`SingleRank::warm_up`]); returns the decode batch sizes captured.
    pub fn warm_up(&mut self) -> Result<Vec<usize>, ModelError> {
        let replies = self.broadcast(|| Job::WarmUp)?;
        Ok(replies
            .into_iter()
            .find_map(|r| if let Reply::WarmedUp(s) = r { Some(s) } else { None })
            .unwrap_or_default())
    }

    /// Send `job` to every rank and wait for every answer. A failure resets
    /// the group (every rank has answered, so none is inside a collective) and
    /// returns the first error that is not an echo of another rank's abort.
    fn broadcast(&mut self, job: impl Fn() -> Job) -> Result<Vec<Reply>, ModelError> {
        for tx in &self.jobs {
            tx.send(job()).map_err(|_| ModelError::Step("a rank thread has stopped".into()))?;
        }
        let mut out: Vec<Option<Reply>> = (0..self.jobs.len()).map(|_| None).collect();
        let mut errors = Vec::new();
        for _ in 0..self.jobs.len() {
            let (i, r) =
                self.replies.recv().map_err(|_| ModelError::Step("a rank thread has stopped".into()))?;
            match r {
                Ok(reply) => out[i] = Some(reply),
                Err(e) => errors.push(e),
            }
        }
        if errors.is_empty() {
            return Ok(out.into_iter().map(|r| r.expect("every rank answered")).collect());
        }
        self.group.reset();
        if let Some(f) = &self.flipping {
            f.groups.iter().chain(std::iter::once(&f.control)).for_each(ThreadGroup::reset);
        }
        let is_echo = |e: &ModelError| matches!(e, ModelError::Collective(CollectiveError::Aborted { .. }));
        let first = errors.iter().position(|e| !is_echo(e)).unwrap_or(0);
        Err(errors.swap_remove(first))
    }

    /// Agree on how many pages the group holds: each rank offers the smaller
    /// of `want`, what its KV cache can address and (with a card of its own)
    /// what its card's measured free column holds above floor and margin; the
    /// group takes the MIN, so a rank that must refuse holds the others back
    /// instead of desyncing.
    pub fn agree_capacity(&mut self, want: Pages) -> Result<Pages, ModelError> {
        let replies = self.broadcast(|| Job::Capacity(want.get() as u64))?;
        let agreed: Vec<u64> =
            replies.iter().filter_map(|r| if let Reply::Capacity(c) = r { Some(*c) } else { None }).collect();
        debug_assert!(
            agreed.windows(2).all(|w| w[0] == w[1]),
            "ranks disagree after a MIN reduction: {agreed:?}"
        );
        Ok(Pages(agreed.first().copied().unwrap_or(0) as usize))
    }

    /// Layers per wave so that no rank stages more than [`FLIP_STAGING_CAP`]
    /// (at least one layer), and what each rank stages then.
    fn plan_waves(&self, f: &Flipping, to: Phase, pages: usize) -> Result<(usize, Vec<Bytes>), ModelError> {
        let (from_l, to_l) = (&f.layouts[to.other().index()], &f.layouts[to.index()]);
        let plan = phase::transfers(&self.config, from_l, to_l).map_err(ModelError::Step)?;
        let ranks: Vec<Rank> = to_l.ranks.iter().map(|s| s.rank).collect();
        let staging = |w: usize| -> Vec<Bytes> {
            ranks
                .iter()
                .map(|&r| phase::flip_staging(&self.config, to_l, &plan, r, pages, f.page_size, w))
                .collect()
        };
        let layers = self.config.num_layers.max(1);
        let mut wave = layers;
        while wave > 1 && staging(wave).iter().any(|&b| b > FLIP_STAGING_CAP) {
            wave = wave.div_ceil(2);
        }
        Ok((wave, staging(wave)))
    }
}

impl Executor for MultiRank {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn execute(
        &mut self,
        step: &SchedulerOutput,
        logit_rows: &[usize],
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        self.steps += 1;
        let census = self.census_every > 0 && self.steps % self.census_every == 0;
        let (out, rows) = (Arc::new(step.clone()), Arc::new(logit_rows.to_vec()));
        let mut replies =
            self.broadcast(|| Job::Step { out: out.clone(), logit_rows: rows.clone(), census })?;
        match replies.swap_remove(self.logits_rank) {
            Reply::Logits(Some(l)) => {
                *logits = l;
                Ok(())
            }
            _ => Err(ModelError::Step(format!("rank{} returned no logits", self.logits_rank))),
        }
    }

    fn move_pages(&mut self, moves: &[(PageId, PageId)]) -> Result<(), ModelError> {
        let moves = Arc::new(moves.to_vec());
        self.broadcast(|| Job::MovePages(moves.clone())).map(|_| ())
    }

    fn phase(&self) -> Option<Phase> {
        self.flipping.as_ref().map(|f| f.serving)
    }

    fn layouts(&self) -> Vec<Layout> {
        self.flipping.as_ref().map(|f| f.layouts.to_vec()).unwrap_or_default()
    }

    fn flip(
        &mut self,
        to: Phase,
        live: Vec<PageId>,
        skew_digest: Option<Rank>,
    ) -> Result<FlipOutcome, ModelError> {
        let Some(f) = self.flipping.take() else {
            return Err(ModelError::Step("this group holds one layout; it cannot flip".into()));
        };
        let result = self.flip_with(&f, to, live, skew_digest);
        self.flipping = Some(f);
        let mut out = result?;
        let f = self.flipping.as_mut().expect("restored above");
        f.epoch += 1;
        if matches!(out.verdict, FlipVerdict::Committed(_)) {
            f.serving = to;
            self.group = f.groups[to.index()].clone();
            // Both layouts were checked when the group started.
            self.logits_rank = logits_rank(&f.layouts[to.index()])?;
        }
        out.epoch = f.epoch;
        Ok(out)
    }
}

/// What a flipping group measured of itself before serving: each layout's
/// prefill steps and the flips between them.
#[derive(Clone, Debug, Default)]
pub struct Calibration {
    /// Prompt rows of each timed step.
    pub rows: usize,
    /// Each timed step's duration, by [`Phase::index`].
    pub steps: [Vec<Duration>; 2],
    /// Flips made while calibrating: (to, duration).
    pub flips: Vec<(Phase, Duration)>,
}

impl MultiRank {
    /// Time `times` prefill steps of `rows` prompt rows in each layout and
    /// the two flips between them, before any request is served: the rates
    /// and costs `--phase-flip auto` starts from. The steps write one
    /// throw-away sequence into the lowest pages (free before serving), so
    /// they run what a real prefill runs, micro-batches and link included;
    /// the group ends in the layout it started in.
    pub fn calibrate(&mut self, rows: usize, times: usize) -> Result<Calibration, ModelError> {
        let Some(start) = self.phase() else {
            return Err(ModelError::Step("only a flipping group calibrates its flips".into()));
        };
        let page_size = self.flipping.as_ref().map_or(16, |f| f.page_size);
        let pages: Vec<PageId> = (0..rows.div_ceil(page_size) as u32).map(PageId).collect();
        let vocab = self.config.vocab_size as u32;
        let step = SchedulerOutput {
            tokens: (0..rows as u32).map(|t| TokenId((t * 7 + 3) % vocab)).collect(),
            positions: (0..rows as u32).collect(),
            seqs: vec![crate::scheduler::ScheduledSeq {
                id: RequestId(u64::MAX),
                row_start: 0,
                rows,
                cached: 0,
                pages: pages.clone(),
                samples: true,
                state_slot: None,
            }],
            ..SchedulerOutput::default()
        };
        let mut cal = Calibration { rows, ..Calibration::default() };
        let mut logits = Vec::new();
        let timed_flip = |me: &mut MultiRank, to: Phase| -> Result<(Phase, Duration), ModelError> {
            let t = std::time::Instant::now();
            let out = Executor::flip(me, to, pages.clone(), None)?;
            match out.verdict {
                FlipVerdict::Committed(_) => Ok((to, t.elapsed())),
                v => Err(ModelError::Step(format!("a calibration flip was abandoned: {v:?}"))),
            }
        };
        for phase in [start, start.other()] {
            if self.phase() != Some(phase) {
                cal.flips.push(timed_flip(self, phase)?);
            }
            // One untimed step first: the first run of a shape pays for
            // first use.
            self.execute(&step, &[rows - 1], &mut logits)?;
            for _ in 0..times {
                let t = std::time::Instant::now();
                self.execute(&step, &[rows - 1], &mut logits)?;
                cal.steps[phase.index()].push(t.elapsed());
            }
        }
        cal.flips.push(timed_flip(self, start)?);
        Ok(cal)
    }

    fn flip_with(
        &mut self,
        f: &Flipping,
        to: Phase,
        live: Vec<PageId>,
        skew_digest: Option<Rank>,
    ) -> Result<FlipOutcome, ModelError> {
        if to == f.serving {
            return Err(ModelError::Step(format!("the group already serves in {to}")));
        }
        let pages = live.len();
        let (wave_layers, staging) = self.plan_waves(f, to, pages)?;
        let order = Arc::new(FlipOrder { to, epoch: f.epoch, live, wave_layers, skew_digest });
        let staging = Arc::new(staging);
        let (replies, failed) =
            match self.broadcast(|| Job::Flip { order: order.clone(), staging: staging.clone() }) {
                Ok(r) => (r, None),
                Err(e) => (Vec::new(), Some(e)),
            };
        let mut total = RankFlip::default();
        let mut verdicts =
            replies.into_iter().filter_map(|r| if let Reply::Flipped(v) = r { Some(v) } else { None });
        let verdict = match failed {
            Some(e) => FlipVerdict::Abandoned(AbandonReason::Failed(e.to_string())),
            None => {
                let mut first = None;
                for v in verdicts.by_ref() {
                    if let FlipVerdict::Committed(r) = &v {
                        total.sent += r.sent;
                        total.local += r.local;
                        total.waves = r.waves;
                    }
                    match &first {
                        None => first = Some(v),
                        Some(f) => debug_assert_eq!(
                            std::mem::discriminant(f),
                            std::mem::discriminant(&v),
                            "ranks reached different verdicts"
                        ),
                    }
                }
                match first {
                    Some(FlipVerdict::Committed(_)) => FlipVerdict::Committed(total),
                    Some(v) => v,
                    None => FlipVerdict::Abandoned(AbandonReason::Failed("no rank answered".into())),
                }
            }
        };
        Ok(FlipOutcome {
            verdict,
            pages,
            wave_layers,
            staging: staging.iter().copied().max().unwrap_or(Bytes::ZERO),
            epoch: f.epoch,
        })
    }
}

impl Drop for MultiRank {
    fn drop(&mut self) {
        // Closing the job channels ends every rank loop.
        self.jobs.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

struct RankWorker<B: Backend> {
    index: usize,
    /// The executor of the layout that serves.
    exec: SingleRank<B>,
    kv: Option<KvShare>,
    /// Pages this rank's KV cache can address.
    max_pages: u64,
    flip: Option<RankFlipState<B>>,
    /// See [`LayoutOptions::microbatch_rows`]; used while the serving layout
    /// is a pipeline.
    microbatch_rows: usize,
    /// Whether the layout this rank started serving is a pipeline (a
    /// flipping group's serving layout is `flip.serving`).
    pipeline: bool,
}

/// A rank's side of a flipping group.
struct RankFlipState<B: Backend> {
    /// The executor of the layout that does not serve.
    other: SingleRank<B>,
    control: ThreadRank,
    layouts: Arc<[Layout; 2]>,
    config: ModelConfig,
    page_size: usize,
    serving: Phase,
    epoch: u64,
}

impl<B: Backend> RankWorker<B> {
    fn run(mut self, jobs: mpsc::Receiver<Job>, reply: mpsc::Sender<(usize, Result<Reply, ModelError>)>) {
        let mut logits = Vec::new();
        for job in jobs {
            let r = match job {
                Job::Step { out, logit_rows, census } => self.step(&out, &logit_rows, census, &mut logits),
                Job::Capacity(want) => {
                    let offer = want.min(self.max_pages).min(self.own_pages());
                    self.exec.collective().min_u64(offer).map(Reply::Capacity).map_err(ModelError::from)
                }
                Job::WarmUp => self.warm_up().map(Reply::WarmedUp),
                Job::Flip { order, staging } => self.flip(&order, staging[self.index]).map(Reply::Flipped),
                Job::MovePages(moves) => self.exec.move_pages(&moves).map(|()| Reply::Moved),
            };
            if let Err(e) = &r {
                // Peers waiting on this rank stop now instead of at a timeout.
                self.exec.collective().abort(&e.to_string());
            }
            if reply.send((self.index, r)).is_err() {
                return;
            }
        }
    }

    /// Warm up the serving layout and, in a flipping group, the other one.
    fn warm_up(&mut self) -> Result<Vec<usize>, ModelError> {
        if let Some(f) = &mut self.flip {
            f.other.warm_up()?;
        }
        self.exec.warm_up()
    }

    /// This rank's side of a flip: reserve the staging (without spending
    /// relief: the engine is waiting on this flip), run the protocol, and
    /// switch executors if every rank committed.
    fn flip(&mut self, order: &FlipOrder, staging: Bytes) -> Result<FlipVerdict, ModelError> {
        let Some(f) = &mut self.flip else {
            return Err(ModelError::Step(format!("rank{} holds one layout", self.index)));
        };
        let reservation = match &self.kv {
            Some(share) if staging > Bytes::ZERO => share
                .device
                .reserve_with(ReserveRequest {
                    want: staging,
                    purpose: Purpose::Staging,
                    urgency: Urgency::Opportunistic,
                })
                .map_err(|e| tracing::warn!(rank = self.index, %staging, "flip staging refused: {e}"))
                .ok(),
            _ => None,
        };
        let funded = staging == Bytes::ZERO || self.kv.is_none() || reservation.is_some();
        let state = RankState {
            rank: Rank(self.index as u32),
            cfg: &f.config,
            layouts: &f.layouts,
            page_size: f.page_size,
            epoch: f.epoch,
            armed: order.to != f.serving,
            ready: funded,
        };
        let verdict = phase::run_flip(&state, order, &f.control, &mut self.exec, &mut f.other);
        f.epoch += 1;
        drop(reservation);
        let verdict = verdict?;
        if matches!(verdict, FlipVerdict::Committed(_)) {
            std::mem::swap(&mut self.exec, &mut f.other);
            f.serving = order.to;
        }
        Ok(verdict)
    }

    /// Pages this rank's card holds above its floor and margin, measured now
    /// (unbounded when the rank has no card of its own).
    fn own_pages(&self) -> u64 {
        let Some(share) = &self.kv else { return u64::MAX };
        let input = SizingInput::measure(
            &share.device,
            share.margin,
            Bytes::ZERO,
            share.geometry,
            Pages(self.max_pages as usize),
        );
        solve(input).pages.get() as u64
    }

    fn step(
        &mut self,
        out: &SchedulerOutput,
        logit_rows: &[usize],
        census: bool,
        logits: &mut Vec<f32>,
    ) -> Result<Reply, ModelError> {
        // Every rank cuts the step alike: the parts follow from the step.
        let pipeline = self.flip.as_ref().map_or(self.pipeline, |f| f.serving == Phase::Pipeline);
        let parts = crate::microbatch::microbatch_parts(out, if pipeline { self.microbatch_rows } else { 0 });
        self.exec.execute_microbatched(out, logit_rows, logits, parts)?;
        if census {
            self.exec.collective().compare_census()?;
        }
        let sampled = self.exec.model().slice().emits_logits() && self.exec.collective().gathers_here();
        Ok(Reply::Logits(sampled.then(|| std::mem::take(logits))))
    }
}

/// The rank whose logits the engine samples: a pipeline's last stage, a
/// tensor layout's first rank (where the gather lands).
fn logits_rank(layout: &Layout) -> Result<usize, ModelError> {
    layout
        .ranks
        .iter()
        .position(|r| r.emits_logits())
        .ok_or_else(|| ModelError::Step("no rank of the layout computes logits".into()))
}

fn group_shape(layout: &Layout) -> GroupShape {
    if layout.kind == LayoutKind::Pipeline {
        GroupShape::Pipeline
    } else {
        GroupShape::Tensor
    }
}
