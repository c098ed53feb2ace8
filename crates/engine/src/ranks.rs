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

use crate::executor::{Executor, ExecutorLimits, SingleRank};
use crate::scheduler::SchedulerOutput;
use corridor_backend::collective::{CollectiveError, GroupShape, ThreadGroup};
use corridor_backend::cpu::CpuBackend;
use corridor_backend::Backend;
use corridor_model::layout::{Layout, LayoutKind};
use corridor_model::{Checkpoint, ModelConfig};
use corridor_model::{Model, ModelError};
use corridor_units::{Bytes, PageId, Pages};
use corridor_vram::sizing::{solve, SizingInput};
use corridor_vram::{ChunkGeometry, Device};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How long a rank waits for its peers inside one collective by default.
pub const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(300);

/// How a layout's ranks run.
#[derive(Clone, Copy, Debug)]
pub struct LayoutOptions {
    pub limits: ExecutorLimits,
    /// Compare the collective census every this many steps (0: never).
    pub census_every: u64,
    /// How long a rank waits for its peers inside one collective before the
    /// step fails (a safety net; a failing rank aborts its peers at once).
    pub collective_timeout: Duration,
}

impl LayoutOptions {
    pub fn new(limits: ExecutorLimits) -> LayoutOptions {
        LayoutOptions { limits, census_every: 64, collective_timeout: COLLECTIVE_TIMEOUT }
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
}

enum Reply {
    Logits(Option<Vec<f32>>),
    Capacity(u64),
    WarmedUp(Vec<usize>),
    Moved,
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
}

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
        let (group, comms) =
            ThreadGroup::new(layout.ranks.len(), group_shape(layout), options.collective_timeout);
        let l = options.limits;
        let mut ranks = Vec::with_capacity(layout.ranks.len());
        for (slice, comm) in layout.ranks.iter().zip(comms) {
            let backend = CpuBackend::new();
            let model = Model::load_slice(&backend, ckpt, slice, |_| {})?;
            let exec = SingleRank::new(backend, model, l)?.with_collective(Box::new(comm));
            ranks.push(RankParts { exec, kv: None });
        }
        Self::start(ckpt.config().clone(), layout, group, ranks, options)
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
        let logits_rank = layout
            .ranks
            .iter()
            .position(|r| r.emits_logits())
            .ok_or_else(|| ModelError::Step("no rank of the layout computes logits".into()))?;
        let (reply_tx, replies) = mpsc::channel();
        let (mut jobs, mut threads) = (Vec::with_capacity(ranks.len()), Vec::with_capacity(ranks.len()));
        for (slice, parts) in layout.ranks.iter().zip(ranks) {
            tracing::info!(rank = %slice.rank, layers = ?slice.layers, heads = ?slice.heads, kv_heads = ?slice.kv_heads,
                ffn = ?slice.ffn, vocab = ?slice.vocab, "rank loaded");
            let (tx, rx) = mpsc::channel();
            jobs.push(tx);
            let rank = RankWorker {
                index: slice.rank.0 as usize,
                exec: parts.exec,
                kv: parts.kv,
                max_pages: options.limits.num_pages as u64,
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
        })
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
    exec: SingleRank<B>,
    kv: Option<KvShare>,
    /// Pages this rank's KV cache can address.
    max_pages: u64,
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
                Job::WarmUp => self.exec.warm_up().map(Reply::WarmedUp),
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
        self.exec.execute(out, logit_rows, logits)?;
        if census {
            self.exec.collective().compare_census()?;
        }
        let sampled = self.exec.model().slice().emits_logits() && self.exec.collective().gathers_here();
        Ok(Reply::Logits(sampled.then(|| std::mem::take(logits))))
    }
}

fn group_shape(layout: &Layout) -> GroupShape {
    if layout.kind == LayoutKind::Pipeline {
        GroupShape::Pipeline
    } else {
        GroupShape::Tensor
    }
}
