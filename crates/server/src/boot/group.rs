//! The rank group's boot: one linear sequence for every card kind and every
//! shape of group, from the cards to a serving engine.
//!
//! 1. The ranks' cards: card 0 for the whole model (the trivial layout), rank
//!    `i` on card `i` for a layout or a flipping group, every rank on the
//!    host card for CPU threads.
//! 2. A backend per rank (and per layout a rank holds), chosen by the card's
//!    kind ([`RankKind`]: CPU compute on the host and sim cards, CUDA on
//!    GPUs), and the collectives that join them; on GPUs the contexts and
//!    NCCL's buffers now exist, so the rooms measured next exclude them.
//! 3. The layout solved on the cards' measured rooms (`auto` splits maximize
//!    the group's token capacity; one rank is the whole model).
//! 4. Weights, then workspace, resident on every card: booked by size for
//!    CPU ranks (their memory is the host's or simulated), the backend's own
//!    allocations through the chokepoint on GPUs. A hybrid's recurrent state
//!    is a governed pool of slots ([`state_pool`]: an arena of one slot a
//!    page over the ranks' cards, booked as state), committed for the
//!    running limit before KV is sized, so a request needs pages and a slot
//!    and the governor releases idle slots and grows them back like KV; CPU
//!    ranks keep the state in host memory, GPUs inside the pool's pages.
//! 5. The KV arena's address space over the cards (each holds its ranks'
//!    share of every page), each rank's KV storage in it, and the executor:
//!    the rank itself when there is one, rank threads in lockstep otherwise.
//! 6. Warm-up: every step shape runs once (captured as graphs on GPUs).
//! 7. KV sized and committed: each card's free column above floor and
//!    margin, the MIN over the cards, agreed by the ranks through their
//!    collective; a chunk is committed on every card or on none.
//! 8. The engine over the page pool, whose prefix evictor is registered.

use super::plan::{check_one_rank_per_card, several_cards_one_rank, CardsPlan, GroupPlan};
use super::{new_arena, workspace_bytes, BootError, BootPlan};
use corridor_backend::collective::{Collective, GroupShape, LinkModel, ThreadGroup};
use corridor_backend::{Backend, KvPlacement, StatePlacement};
use corridor_engine::engine::{spawn_with_state, EngineConfig, EngineHandle};
use corridor_engine::executor::{Executor, ExecutorLimits, SingleRank};
use corridor_engine::pages::PagePool;
use corridor_engine::ranks::{Calibration, FlipParts, KvShare, LayoutOptions, MultiRank, RankParts};
use corridor_model::layout::{self, CardRoom, CostModel, Layout, LayoutSpec, RankSlice, Split};
use corridor_model::{Checkpoint, Model};
use corridor_units::{Bytes, CardId, Pages, Tokens};
use corridor_vram::recorder::BootPhase;
use corridor_vram::sizing::{solve, SizingInput, DEFAULT_MARGIN};
use corridor_vram::{Allocation, Device, Governor, KvArena, Purpose, SystemClock, Urgency};
use std::sync::Arc;

/// What the group's boot reads: the plan and what was opened before it.
pub(super) struct BootEnv<'a> {
    pub plan: &'a BootPlan,
    pub ckpt: &'a Checkpoint,
    pub governor: &'a Arc<Governor>,
    pub clock: &'a Arc<SystemClock>,
    pub mark: &'a dyn Fn(BootPhase),
    pub context_len: usize,
    /// The device ordinal of each CUDA card.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub ordinals: &'a [u32],
}

/// A serving engine and what is held beside it.
pub(super) struct Started {
    pub engine: EngineHandle,
    /// What is booked by size (CPU ranks) for the life of the engine.
    pub resident: Vec<Allocation>,
    /// A flipping group's boot-time timings of both layouts and the flips.
    pub calibration: Option<Calibration>,
}

/// A group's host side and one collective per rank.
type Collectives<B> = (ThreadGroup, Vec<Box<dyn Collective<B>>>);

/// What runs a rank on a card of one kind. Everything else in the group's
/// boot is the same for every kind.
pub(super) trait RankKind {
    type B: Backend + Send + 'static;
    /// Bytes of one KV element on this backend (the cost model's KV price).
    fn kv_elem_bytes(&self) -> u64;
    /// Whether a rank's weights and workspace are booked on its card by size
    /// (CPU ranks, whose memory is the host's or simulated) rather than by
    /// the backend's own allocations through the card's chokepoint.
    fn books_by_size(&self) -> bool;
    /// The backend of rank `rank` on `dev`.
    fn backend(&self, env: &BootEnv<'_>, dev: &Device, rank: usize) -> Result<Self::B, BootError>;
    /// The collectives of a group of `ranks` ranks, one per rank, and the
    /// group's host side.
    fn collectives(
        &self,
        env: &BootEnv<'_>,
        ranks: usize,
        shape: GroupShape,
    ) -> Result<Collectives<Self::B>, BootError>;
    /// Rows per micro-batch of a pipeline step (0: whole steps).
    fn microbatch_rows(&self) -> usize;
}

/// CPU ranks: on the host card (whose buffers are made resident, so the
/// books match the process) or on sim cards (simulated memory, KV blocks
/// backed on the host only once written), joined by in-process threads.
pub(super) struct CpuRanks {
    pub resident: bool,
    pub link: Option<LinkModel>,
    /// Block-format weights in tiles of 16 rows (`--cpu-row-tiles`).
    pub row_tiles: bool,
    /// How K and V are stored.
    pub kv: corridor_backend::cpu::KvPrecision,
}

impl RankKind for CpuRanks {
    type B = corridor_backend::cpu::CpuBackend;
    fn kv_elem_bytes(&self) -> u64 {
        self.kv.elem_bytes()
    }
    fn books_by_size(&self) -> bool {
        true
    }
    fn backend(&self, _env: &BootEnv<'_>, _dev: &Device, _rank: usize) -> Result<Self::B, BootError> {
        let b = if self.resident { Self::B::resident() } else { Self::B::new() };
        Ok(b.with_row_tiles(self.row_tiles).with_kv_precision(self.kv))
    }
    fn collectives(
        &self,
        _env: &BootEnv<'_>,
        ranks: usize,
        shape: GroupShape,
    ) -> Result<Collectives<Self::B>, BootError> {
        let timeout = corridor_engine::ranks::COLLECTIVE_TIMEOUT;
        let (group, comms) = ThreadGroup::with_link(ranks, shape, timeout, self.link);
        Ok((group, comms.into_iter().map(|c| Box::new(c) as Box<dyn Collective<Self::B>>).collect()))
    }
    fn microbatch_rows(&self) -> usize {
        corridor_engine::ranks::DEFAULT_MICROBATCH_ROWS
    }
}

/// GPU ranks: a CUDA backend per card, every device byte through that
/// card's chokepoint, joined by NCCL.
#[cfg(feature = "cuda")]
pub(super) struct CudaRanks;

#[cfg(feature = "cuda")]
impl RankKind for CudaRanks {
    type B = corridor_backend::cuda::CudaBackend;
    fn kv_elem_bytes(&self) -> u64 {
        2
    }
    fn books_by_size(&self) -> bool {
        false
    }
    fn backend(&self, env: &BootEnv<'_>, dev: &Device, rank: usize) -> Result<Self::B, BootError> {
        use corridor_backend::cuda::{CudaBackend, CudaBackendConfig};
        let (plan, limits) = (env.plan, env.plan.limits);
        let bcfg = CudaBackendConfig {
            ordinal: env.ordinals[rank] as usize,
            max_rows: limits.max_batched_tokens,
            max_seqs: limits.max_running.max(1),
            max_pages_per_seq: env.context_len.div_ceil(limits.page_size.get()),
            attn_partials: CudaBackendConfig::default().attn_partials,
            kernel_cache_dir: plan.cuda.kernel_cache.clone(),
            tuning: plan.cuda.tuning,
        };
        let tuning = bcfg.tuning;
        let backend =
            CudaBackend::on_device(bcfg, dev.clone()).map_err(|e| BootError::Config(e.to_string()))?;
        tracing::info!(
            card = %dev.id(),
            backend = %backend.name(),
            pdl = tuning.pdl,
            fused = tuning.fuse,
            "CUDA backend ready"
        );
        Ok(backend)
    }
    fn collectives(
        &self,
        env: &BootEnv<'_>,
        ranks: usize,
        shape: GroupShape,
    ) -> Result<Collectives<Self::B>, BootError> {
        use corridor_backend::cuda::nccl::nccl_group;
        let ordinals: Vec<usize> = env.ordinals[..ranks].iter().map(|&o| o as usize).collect();
        let timeout = corridor_engine::ranks::COLLECTIVE_TIMEOUT;
        let (group, comms) = nccl_group(&ordinals, shape, timeout, env.plan.cuda.tuning.nccl_graphs)
            .map_err(|e| BootError::Config(format!("NCCL: {e}")))?;
        Ok((group, comms.into_iter().map(|c| Box::new(c) as Box<dyn Collective<Self::B>>).collect()))
    }
    fn microbatch_rows(&self) -> usize {
        // Micro-batched pipeline steps have run on CPU ranks only; GPU stages
        // keep whole steps until they have been measured on two cards.
        0
    }
}

/// What one rank holds, decided by the solve.
struct Placed {
    card: Device,
    /// The slice it serves in, then (in a flipping group) its slice of the other layout.
    slices: Vec<RankSlice>,
    /// Booked by size on CPU ranks.
    weights: Bytes,
    workspace: Bytes,
    state: Bytes,
    /// Its share of one KV page (zero: it holds no layer).
    page_bytes: Bytes,
}

/// The solved group.
struct Placement {
    /// The layouts the ranks hold: none for the whole model as one rank, one
    /// for a layout, a flipping group's tensor then pipeline layout.
    layouts: Vec<Layout>,
    ranks: Vec<Placed>,
}

/// Boot the group of `env.plan` on cards of `kind` and start the engine.
pub(super) fn start<K: RankKind>(
    env: &BootEnv<'_>,
    kind: &K,
    config: EngineConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Started, BootError> {
    let (plan, ckpt) = (env.plan, env.ckpt);
    let cfg = ckpt.config();
    let limits = plan.limits;

    // 1-2. The ranks' cards, their backends and collectives.
    let (cards, own_cards) = rank_cards(env)?;
    let per_rank = if matches!(plan.group, GroupPlan::Flipping { .. }) { 2 } else { 1 };
    let mut backends = Vec::with_capacity(cards.len());
    for (i, dev) in cards.iter().enumerate() {
        backends.push((0..per_rank).map(|_| kind.backend(env, dev, i)).collect::<Result<Vec<_>, _>>()?);
    }
    (env.mark)(BootPhase::ContextReady);
    let mut groups = match &plan.group {
        GroupPlan::One => Vec::new(),
        GroupPlan::Layout(spec) => vec![kind.collectives(env, cards.len(), group_shape(spec))?],
        GroupPlan::Flipping { .. } => [GroupShape::Tensor, GroupShape::Pipeline]
            .into_iter()
            .map(|shape| kind.collectives(env, cards.len(), shape))
            .collect::<Result<_, _>>()?,
    };
    // The flip protocol's own group, on the host. All three share the cards'
    // links: the flip's KV exchange pays the link model like a step's
    // collectives do.
    let control = matches!(plan.group, GroupPlan::Flipping { .. }).then(|| {
        let timeout = corridor_engine::ranks::COLLECTIVE_TIMEOUT;
        ThreadGroup::with_link(cards.len(), GroupShape::Tensor, timeout, plan.sim_link)
    });

    // 3. The layout on the cards' rooms.
    let cost = cost_model(env, kind.kv_elem_bytes());
    let placement = place(env, &cards, own_cards, &cost)?;

    // 4. Weights, then workspace.
    let mut resident = Vec::new();
    let ticks: usize = placement.ranks.iter().flat_map(|r| &r.slices).map(|s| s.layers.len() + 2).sum();
    let mut done = 0;
    let mut loaded = Vec::with_capacity(placement.ranks.len());
    for (r, backends) in placement.ranks.iter().zip(backends) {
        if kind.books_by_size() {
            resident.push(book(&r.card, r.weights, Purpose::Weights, "weights")?);
        }
        let mut models = Vec::with_capacity(r.slices.len());
        for (slice, backend) in r.slices.iter().zip(backends) {
            let model = Model::load_slice(&backend, ckpt, slice, |n| {
                done += n;
                progress(done.min(ticks), ticks);
            })?;
            models.push((backend, model));
        }
        loaded.push(models);
    }
    (env.mark)(BootPhase::WeightsLoaded);
    // A hybrid's state is a governed pool of slots: the CPU ranks keep each
    // slot's state in host memory (the pool books it); a GPU backend reads
    // it inside the pool's pages on the card.
    let state = state_pool(env, &placement, !kind.books_by_size())?;
    let state_at = match &state {
        Some(pool) => StatePlacement::Arena(pool.clone()),
        None => StatePlacement::Own { slots: limits.max_running },
    };
    let mut with_ws = Vec::with_capacity(loaded.len());
    for (r, models) in placement.ranks.iter().zip(loaded) {
        if kind.books_by_size() {
            resident.push(book(&r.card, r.workspace, Purpose::Workspace, "workspace")?);
        }
        let mut rank = Vec::with_capacity(models.len());
        for (backend, model) in models {
            let ws = model.workspace_at(
                &backend,
                Tokens(limits.max_batched_tokens),
                limits.max_running,
                &state_at,
            )?;
            rank.push((backend, model, ws));
        }
        with_ws.push(rank);
    }
    (env.mark)(BootPhase::WorkspaceReady);

    // 5. The arena's address space, each rank's KV in it, the executor.
    let arena = group_arena(env, &placement)?;
    let page_size = limits.page_size.get();
    let options = LayoutOptions {
        link: plan.sim_link,
        microbatch_rows: kind.microbatch_rows(),
        ..LayoutOptions::new(ExecutorLimits {
            max_rows: Tokens(limits.max_batched_tokens),
            max_logit_rows: limits.max_running,
            page_size: limits.page_size,
            num_pages: arena.capacity(),
        })
    };
    let mut execs = Vec::with_capacity(with_ws.len());
    for (r, rank) in placement.ranks.iter().zip(with_ws) {
        let mut pair = Vec::with_capacity(rank.len());
        for (backend, model, ws) in rank {
            // A rank without layers holds no KV (and has no share of the arena).
            let placement = if model.slice().layers.is_empty() {
                KvPlacement::Own { num_pages: Pages(0) }
            } else {
                KvPlacement::Arena(arena.clone())
            };
            let kv = model.kv_cache_at(&backend, limits.page_size, &placement)?;
            pair.push(
                SingleRank::from_parts(backend, model, ws, kv).with_device_sampling(plan.device_sampling),
            );
        }
        let share = own_cards.then(|| kv_share(&arena, &r.card)).flatten();
        execs.push((pair, share));
    }
    let mut exec = match &plan.group {
        GroupPlan::One => {
            let (mut pair, _) = execs.pop().expect("one rank");
            Group::One(pair.pop().expect("one slice"))
        }
        GroupPlan::Layout(_) => {
            let (group, comms) = groups.pop().expect("the layout's collectives");
            let ranks = execs
                .into_iter()
                .zip(comms)
                .map(|((mut pair, kv), comm)| RankParts {
                    exec: pair.pop().expect("one slice").with_collective(comm),
                    kv,
                    flip: None,
                })
                .collect();
            let multi = MultiRank::start(cfg.clone(), &placement.layouts[0], group, ranks, options)?;
            tracing::info!(ranks = cards.len(), layout = %placement.layouts[0].describe(), "parallel layout running");
            Group::Many(multi)
        }
        GroupPlan::Flipping { .. } => {
            let (control, controls) = control.expect("a flipping group's control group");
            let (pp_group, pp_comms) = groups.pop().expect("the pipeline's collectives");
            let (tp_group, tp_comms) = groups.pop().expect("the tensor layout's collectives");
            let ranks = execs
                .into_iter()
                .zip(tp_comms.into_iter().zip(pp_comms))
                .zip(controls)
                .map(|(((pair, kv), (tp, pp)), control)| {
                    let mut pair = pair.into_iter();
                    let exec = pair.next().expect("a tensor slice").with_collective(tp);
                    let other = pair.next().expect("a pipeline slice").with_collective(pp);
                    RankParts { exec, kv, flip: Some(FlipParts { other, control }) }
                })
                .collect();
            let multi = MultiRank::start_flipping(
                cfg.clone(),
                [placement.layouts[0].clone(), placement.layouts[1].clone()],
                [tp_group, pp_group],
                control,
                ranks,
                corridor_engine::phase::Phase::Tensor,
                options,
            )?;
            tracing::info!(ranks = cards.len(), "flipping group running, serving in tensor parallel");
            Group::Many(multi)
        }
    };

    // 6. Warm-up.
    let captured = exec.warm_up()?;
    tracing::info!(graphs = ?captured, "warmed up");
    (env.mark)(BootPhase::GraphsCaptured);

    // 7. KV sized and committed; the state pool is the governor's from now
    // on too (its idle chunks are relief after idle KV's, then regrown).
    commit_kv(env, &mut exec, &arena)?;
    if let Some(state) = &state {
        env.governor.attach_arena(state.clone());
    }
    let mut calibration = None;
    if let (GroupPlan::Flipping { .. }, Group::Many(multi)) = (&plan.group, &mut exec) {
        let rows = limits.max_batched_tokens.min(env.context_len).min(arena.capacity().get() * page_size);
        let cal =
            multi.calibrate(rows, 3).map_err(|e| BootError::Config(format!("calibrating the flip: {e}")))?;
        log_calibration(&cal);
        calibration = Some(cal);
    }

    // 8. The engine.
    let pool = PagePool::new(arena, limits.page_size);
    env.governor.register_provider(pool.prefix_evictor());
    let exec: Box<dyn Executor> = match exec {
        Group::One(e) => Box::new(e),
        Group::Many(m) => Box::new(m),
    };
    let engine = spawn_with_state(exec, config, pool, state)?;
    Ok(Started { engine, resident, calibration })
}

/// The executor: the rank itself, or rank threads in lockstep. One exists
/// per boot, so the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Group<B: Backend> {
    One(SingleRank<B>),
    Many(MultiRank),
}

impl<B: Backend> Group<B> {
    fn warm_up(&mut self) -> Result<Vec<usize>, BootError> {
        let captured = match self {
            Group::One(e) => e.warm_up(),
            Group::Many(m) => m.warm_up(),
        };
        captured.map_err(|e| BootError::Config(format!("warm-up: {e}")))
    }
}

/// The card of each rank, and whether each rank has one of its own.
fn rank_cards(env: &BootEnv<'_>) -> Result<(Vec<Device>, bool), BootError> {
    let devices = env.governor.devices();
    let host = matches!(env.plan.cards, CardsPlan::Host { .. });
    Ok(match &env.plan.group {
        GroupPlan::One => {
            if matches!(env.plan.cards, CardsPlan::Cuda(_)) && devices.len() > 1 {
                return Err(several_cards_one_rank(devices.len()));
            }
            // The whole model runs on card 0 (a layout spreads it).
            (vec![devices[0].clone()], !host)
        }
        // CPU threads sharing the host card.
        GroupPlan::Layout(spec) if host => (vec![devices[0].clone(); spec.ranks()], false),
        GroupPlan::Layout(spec) => {
            check_one_rank_per_card(spec, devices.len())?;
            (devices.to_vec(), true)
        }
        GroupPlan::Flipping { tensor, .. } => {
            check_one_rank_per_card(tensor, devices.len())?;
            (devices.to_vec(), true)
        }
    })
}

/// Solve what each rank holds.
fn place(
    env: &BootEnv<'_>,
    cards: &[Device],
    own_cards: bool,
    cost: &CostModel,
) -> Result<Placement, BootError> {
    let (ckpt, limits) = (env.ckpt, env.plan.limits);
    let cfg = ckpt.config();
    let granule = layout::ffn_granule(cost.weight_dtype);
    let sliced = |layout: Layout| {
        let ranks = layout
            .ranks
            .iter()
            .zip(cards)
            .map(|(s, dev)| Placed {
                card: dev.clone(),
                slices: vec![s.clone()],
                weights: cost.weights(cfg, s),
                workspace: cost.workspace(cfg, s),
                state: cost.state(cfg, s),
                page_bytes: cost.page_bytes(cfg, s),
            })
            .collect();
        Placement { layouts: vec![layout], ranks }
    };
    Ok(match &env.plan.group {
        GroupPlan::One => {
            // The trivial layout: the whole model, booked as the file maps it.
            let whole = RankSlice::full(cfg);
            let state = cfg
                .hybrid
                .as_ref()
                .map_or(Bytes::ZERO, |h| corridor_model::qwen3_5::state_bytes(h, limits.max_running));
            Placement {
                layouts: Vec::new(),
                ranks: vec![Placed {
                    card: cards[0].clone(),
                    weights: Bytes(ckpt.file_bytes()),
                    workspace: workspace_bytes(cfg, limits.max_batched_tokens, limits.max_running),
                    state,
                    page_bytes: cost.page_bytes(cfg, &whole),
                    slices: vec![whole],
                }],
            }
        }
        GroupPlan::Layout(spec) if !own_cards => {
            // Threads sharing the host card: the split as given (block-quantized
            // weights are split on whole 32-column blocks).
            let granule = if ckpt.gguf().is_some() { 32 } else { 1 };
            sliced(Layout::from_spec(cfg, spec, granule).map_err(|e| BootError::Config(e.to_string()))?)
        }
        GroupPlan::Layout(spec) => sliced(solve_on_cards(env, spec, cards, cost)?.layout),
        GroupPlan::Flipping { tensor, pipeline, .. } => {
            let rooms: Vec<CardRoom> = cards.iter().map(card_room).collect();
            let plan = layout::solve_flipping(cfg, tensor, pipeline, &rooms, cost, granule)
                .map_err(|e| BootError::Config(e.to_string()))?;
            if let Some(c) = plan.cards.iter().find(|c| !c.fits) {
                return Err(BootError::Memory(format!(
                    "{}: both layouts' weights ({}) and workspace ({}) do not fit above its floor and margin (room {}); \
                     a flipping group holds the model twice: add cards or use a smaller model",
                    c.card.card, c.weights, c.workspace, c.card.free
                )));
            }
            let layouts = vec![plan.tensor.layout.clone(), plan.pipeline.layout.clone()];
            tracing::info!(
                tensor = %layouts[0].describe(),
                pipeline = %layouts[1].describe(),
                planned_pages = plan.group_pages.get(),
                "flipping group solved on the cards: both layouts resident"
            );
            let ranks = plan
                .cards
                .iter()
                .zip(cards)
                .enumerate()
                .map(|(i, (c, dev))| {
                    tracing::info!(card = %c.card.card, weights = %c.weights, workspace = %c.workspace,
                        page = %c.page_bytes, pages = c.own_pages.get(), "both layouts on this card");
                    Placed {
                        card: dev.clone(),
                        slices: vec![layouts[0].ranks[i].clone(), layouts[1].ranks[i].clone()],
                        weights: c.weights,
                        workspace: c.workspace,
                        state: Bytes::ZERO,
                        page_bytes: c.page_bytes,
                    }
                })
                .collect();
            Placement { layouts, ranks }
        }
    })
}

/// Book `bytes` for `what` on `dev`.
fn book(dev: &Device, bytes: Bytes, purpose: Purpose, what: &str) -> Result<Allocation, BootError> {
    dev.reserve(bytes, purpose)
        .map_err(|e| BootError::Memory(format!("{}: {what} do not fit: {e}", dev.id())))
}

/// A card's room now, as the layout solver takes it.
fn card_room(dev: &Device) -> CardRoom {
    let s = dev.settings();
    CardRoom {
        card: dev.id(),
        free: dev.card().driver_free(),
        floor: s.arming_floor(),
        margin: DEFAULT_MARGIN,
        budget: s.budget.map(|b| b.saturating_sub(dev.books().total())),
        granularity: dev.card().granularity(),
    }
}

/// How the ranks of `spec` share reductions (see `GroupShape`).
fn group_shape(spec: &LayoutSpec) -> GroupShape {
    if spec.pp.max(1) > 1 {
        GroupShape::Pipeline
    } else {
        GroupShape::Tensor
    }
}

/// Solve the layout on the cards' measured rooms and log it, with what an
/// even split would hold.
fn solve_on_cards(
    env: &BootEnv<'_>,
    spec: &LayoutSpec,
    devices: &[Device],
    cost: &CostModel,
) -> Result<layout::Plan, BootError> {
    let cfg = env.ckpt.config();
    let rooms: Vec<CardRoom> = devices.iter().map(card_room).collect();
    let granule = layout::ffn_granule(cost.weight_dtype);
    let plan =
        layout::solve(cfg, spec, &rooms, cost, granule).map_err(|e| BootError::Config(e.to_string()))?;
    let even_spec = LayoutSpec { tp_split: Split::Even, pp_split: Split::Even, ..spec.clone() };
    let even = layout::solve(cfg, &even_spec, &rooms, cost, granule).ok();
    tracing::info!(
        layout = %plan.layout.describe(),
        planned_tokens = plan.tokens().get(),
        even_split_tokens = even.map(|p| p.tokens().get()),
        "layout solved on the cards"
    );
    if let Some(r) = plan.ranks.iter().find(|r| !r.fits) {
        return Err(BootError::Memory(format!(
            "{}: {} of weights and {} of workspace do not fit above its floor and margin (room {}); \
             add cards, lower --max-batched-tokens or pick another split",
            r.card.card, r.weights, r.workspace, r.card.free
        )));
    }
    Ok(plan)
}

fn cost_model(env: &BootEnv<'_>, kv_elem_bytes: u64) -> CostModel {
    let limits = env.plan.limits;
    CostModel {
        weight_dtype: layout::card_weight_dtype(env.ckpt),
        kv_elem_bytes,
        page_size: limits.page_size,
        max_rows: limits.max_batched_tokens,
        max_logit_rows: limits.max_running,
        chunk_target: layout::DEFAULT_CHUNK_TARGET,
    }
}

/// The group's KV arena: one part per card that holds a layer, with the
/// shares of every rank on that card.
fn group_arena(env: &BootEnv<'_>, placement: &Placement) -> Result<Arc<KvArena>, BootError> {
    let mut parts: Vec<(Device, Bytes)> = Vec::new();
    for r in placement.ranks.iter().filter(|r| r.page_bytes > Bytes::ZERO) {
        match parts.iter_mut().find(|(d, _)| d.id() == r.card.id()) {
            Some((_, bytes)) => *bytes += r.page_bytes,
            None => parts.push((r.card.clone(), r.page_bytes)),
        }
    }
    if parts.is_empty() {
        return Err(BootError::Config("no rank of the layout holds a layer".into()));
    }
    let host_cap = match env.plan.cards {
        // The host is shared with everything else: hold KV to its budget and
        // to what is really free above the floor (the host card's KV is made
        // resident at allocation).
        CardsPlan::Host { kv_budget, .. } => {
            let dev = &parts[0].0;
            let room =
                dev.card().driver_free().saturating_sub(dev.settings().floor).saturating_sub(DEFAULT_MARGIN);
            Some(kv_budget.min(room))
        }
        _ => None,
    };
    new_arena(env, &parts, host_cap)
}

/// The group's pool of recurrent-state slots, committed for the running
/// limit: one arena over the cards of the ranks that hold linear layers,
/// one "page" a slot (each card holding its ranks' state of one request),
/// booked as state. `None` for a model without state.
///
/// On CPU ranks a chunk holds as many slots as fit in one granule of the
/// card, but at most a quarter of the running limit, so the chunks of idle
/// slots can be released while some requests run (a slot bigger than a
/// granule is a chunk of its own); the backend keeps a slot's state in
/// memory of its own (as it keeps KV) and the arena books what it holds.
/// With `on_device` (GPU ranks, which read the state inside the pool's
/// pages) a chunk is one slot, so slots sit a fixed stride apart — whole
/// chunks, or whole pages where they pack granules exactly — and a
/// kernel's slot stride reaches every one. The id space is the running
/// limit rounded up to whole chunks, all committed at boot, before KV is
/// sized from what is left.
fn state_pool(
    env: &BootEnv<'_>,
    placement: &Placement,
    on_device: bool,
) -> Result<Option<Arc<KvArena>>, BootError> {
    let running = env.plan.limits.max_running.max(1);
    let mut parts: Vec<(Device, Bytes)> = Vec::new();
    for r in placement.ranks.iter().filter(|r| r.state > Bytes::ZERO) {
        // `state` is the rank's slots for the running limit.
        let slot = Bytes(r.state.get().div_ceil(running as u64));
        match parts.iter_mut().find(|(d, _)| d.id() == r.card.id()) {
            Some((_, bytes)) => *bytes += slot,
            None => parts.push((r.card.clone(), slot)),
        }
    }
    let Some(widest) = parts.iter().map(|(_, b)| *b).max() else { return Ok(None) };
    let granule = parts.iter().map(|(d, _)| d.card().granularity()).max().unwrap_or(widest);
    let per_chunk =
        if on_device { 1 } else { (granule.get() / widest.get()).clamp(1, (running / 4).max(1) as u64) };
    let chunk_target = Bytes(widest.get() * per_chunk);
    let (config, geometry) = super::whole_chunks(env, &parts, running, chunk_target)?;
    let ids = config.max_pages.get();
    let pool = KvArena::spanning_as(&parts, config, Purpose::State, env.clock.clone())
        .map_err(|e| BootError::Memory(e.to_string()))?;
    pool.commit_to(Pages(ids), Urgency::Deferrable).map_err(|e| {
        BootError::Memory(format!(
            "the recurrent state of {running} running requests ({widest} a slot) does not fit: {e}; \
             lower --max-running-requests"
        ))
    })?;
    tracing::info!(
        slots = ids,
        per_chunk = geometry.chunk_pages,
        slot = %widest,
        committed = %Bytes(pool.backed().get() as u64 / geometry.chunk_pages as u64 * geometry.chunk_bytes.get()),
        "recurrent-state pool committed"
    );
    Ok(Some(Arc::new(pool)))
}

fn kv_share(arena: &KvArena, dev: &Device) -> Option<KvShare> {
    arena.part_on(dev.id()).map(|p| KvShare {
        device: dev.clone(),
        geometry: p.geometry,
        margin: DEFAULT_MARGIN,
    })
}

/// Measure every card of the arena now that everything else is resident,
/// take the pages that fit above each one's floor and margin (the MIN over
/// the cards, agreed by the ranks), commit them, and hand the arena to the
/// governor.
fn commit_kv<B: Backend>(
    env: &BootEnv<'_>,
    exec: &mut Group<B>,
    arena: &Arc<KvArena>,
) -> Result<(), BootError> {
    let cards: Vec<CardId> = arena.cards();
    let mut want = arena.capacity();
    for card in &cards {
        let (Some(dev), Some(part)) = (env.governor.device(*card), arena.part_on(*card)) else { continue };
        let sizing =
            solve(SizingInput::measure(dev, DEFAULT_MARGIN, Bytes::ZERO, part.geometry, arena.capacity()));
        tracing::info!(card = %card, pages = sizing.pages.get(), bound = ?sizing.bound, page = %part.geometry.page_bytes, "KV room");
        want = want.min(sizing.pages);
    }
    let agreed = match exec {
        Group::One(_) => want,
        Group::Many(m) => m.agree_capacity(want)?,
    };
    arena
        .commit_to(agreed, Urgency::Deferrable)
        .map_err(|e| BootError::Memory(format!("KV pool over {cards:?}: {e}")))?;
    if arena.backed() == Pages(0) {
        return Err(BootError::Memory(format!(
            "no KV page fits on {} above its floor: lower --max-batched-tokens, raise the card budget or lower --floor-mib",
            cards.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(", ")
        )));
    }
    for card in &cards {
        if let Some(dev) = env.governor.device(*card) {
            tracing::info!(card = %card, free = %dev.card().driver_free(), "KV committed");
        }
    }
    tracing::info!(
        pages = arena.backed().get(),
        tokens = arena.backed().get() * env.plan.limits.page_size.get(),
        agreed = agreed.get(),
        "KV pool sized"
    );
    env.governor.attach_arena(arena.clone());
    (env.mark)(BootPhase::KvSized);
    Ok(())
}

/// One line a person can act on: what each layout prefills and what a flip costs.
fn log_calibration(cal: &Calibration) {
    use corridor_engine::phase::Phase;
    let rate = |p: Phase| {
        let t: std::time::Duration = cal.steps[p.index()].iter().sum();
        let n = cal.steps[p.index()].len().max(1);
        cal.rows as f64 * n as f64 / t.as_secs_f64().max(1e-9)
    };
    let (x, p) = (rate(Phase::Tensor), rate(Phase::Pipeline));
    let flips: Vec<String> =
        cal.flips.iter().map(|(to, t)| format!("to {to} {:.1} ms", t.as_secs_f64() * 1e3)).collect();
    tracing::info!(
        tp_prefill_tok_s = x.round(),
        pp_prefill_tok_s = p.round(),
        flips = %flips.join(", "),
        rows = cal.rows,
        "flip calibration: {}",
        if p > x { "the pipeline prefills faster: auto flips to it for prefill bursts" } else { "the pipeline is not faster here: auto stays in tensor parallel" }
    );
}
