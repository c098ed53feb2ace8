//! Boot of a parallel layout over cards of its own: rank `i` on card `i`.
//!
//! The order is the single card's, per card: each card's room is measured
//! (on GPUs after the contexts and NCCL's buffers exist, so the solve sees
//! them), the layout is solved on those rooms (`auto` splits maximize the
//! group's token capacity), every rank's weights and workspace become
//! resident on its card, the decode steps are warmed up (captured on GPUs),
//! and only then is KV sized: every rank measures its own card and offers
//! the pages that fit above its floor and margin, and the group takes the
//! MIN through its collective. The KV arena spans the cards (each holds its
//! ranks' share of every page), so growing and shrinking stay agreed: a
//! chunk is committed on every card or on none.
//!
//! Sim cards run CPU ranks (threads joined in-process) and book what each
//! rank holds by size; CUDA cards run GPU ranks joined by NCCL, whose every
//! device byte is an allocation through its card's chokepoint.

use super::{new_arena, BootEnv, BootError, Devices, Started};
use corridor_backend::collective::GroupShape;
use corridor_backend::DType;
use corridor_engine::engine::{spawn_with, EngineConfig};
use corridor_engine::executor::ExecutorLimits;
use corridor_engine::pages::PagePool;
use corridor_engine::ranks::{KvShare, LayoutOptions, MultiRank, RankParts};
use corridor_model::layout::{self, CardRoom, CostModel, LayoutSpec, Plan, Split};
use corridor_units::{Bytes, Pages, Tokens};
use corridor_vram::recorder::BootPhase;
use corridor_vram::sizing::DEFAULT_MARGIN;
use corridor_vram::{Device, KvArena, Urgency};
use std::sync::Arc;

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

/// The cards of the layout, one per rank.
fn layout_devices(env: &BootEnv<'_>, spec: &LayoutSpec) -> Result<Vec<Device>, BootError> {
    let devices = env.governor.devices().to_vec();
    if devices.len() != spec.ranks() {
        return Err(BootError::Config(format!(
            "--tp {} --pp {} runs {} ranks, one per card, but --devices names {} card(s)",
            spec.tp.max(1),
            spec.pp.max(1),
            spec.ranks(),
            devices.len()
        )));
    }
    Ok(devices)
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
) -> Result<Plan, BootError> {
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

/// The group's KV arena: one part per card whose rank holds layers.
fn layout_arena(
    env: &BootEnv<'_>,
    plan: &Plan,
    devices: &[Device],
    cost: &CostModel,
) -> Result<(Arc<KvArena>, Vec<(Device, Bytes)>), BootError> {
    let cfg = env.ckpt.config();
    let parts: Vec<(Device, Bytes)> = plan
        .layout
        .ranks
        .iter()
        .zip(devices)
        .map(|(s, d)| (d.clone(), cost.page_bytes(cfg, s)))
        .filter(|(_, pb)| *pb > Bytes::ZERO)
        .collect();
    if parts.is_empty() {
        return Err(BootError::Config("no rank of the layout holds a layer".into()));
    }
    let arena = new_arena(env, &parts, None)?;
    Ok((arena, parts))
}

/// Agree on the group's pages, commit them on every card, and start the
/// engine over the ranks.
fn finish(
    env: &BootEnv<'_>,
    config: EngineConfig,
    multi: MultiRank,
    arena: Arc<KvArena>,
    parts: Vec<(Device, Bytes)>,
    resident: Vec<corridor_vram::Allocation>,
) -> Result<Started, BootError> {
    finish_with(env, config, multi, arena, parts, resident, |_| Ok(()))
}

/// [`finish`], running `before_serving` on the ranks once KV is committed
/// and before the engine takes them.
fn finish_with(
    env: &BootEnv<'_>,
    config: EngineConfig,
    mut multi: MultiRank,
    arena: Arc<KvArena>,
    parts: Vec<(Device, Bytes)>,
    resident: Vec<corridor_vram::Allocation>,
    before_serving: impl FnOnce(&mut MultiRank) -> Result<(), BootError>,
) -> Result<Started, BootError> {
    let captured = multi.warm_up()?;
    tracing::info!(graphs = ?captured, "layout warmed up");
    (env.mark)(BootPhase::GraphsCaptured);
    let agreed = multi.agree_capacity(arena.capacity())?;
    arena
        .commit_to(agreed, Urgency::Deferrable)
        .map_err(|e| BootError::Memory(format!("KV pool over {:?}: {e}", arena.cards())))?;
    if arena.backed().get() == 0 {
        return Err(BootError::Memory(format!(
            "no KV page fits on every card of {:?} above its floor: lower --max-batched-tokens, raise a card budget or lower --floor-mib",
            arena.cards()
        )));
    }
    for (dev, page) in &parts {
        tracing::info!(card = %dev.id(), page = %page, free = %dev.card().driver_free(), "KV share committed");
    }
    tracing::info!(
        pages = arena.backed().get(),
        tokens = arena.backed().get() * env.opts.page_size,
        agreed = agreed.get(),
        "KV pool sized for the group (MIN over its ranks)"
    );
    env.governor.attach_arena(arena.clone());
    (env.mark)(BootPhase::KvSized);
    before_serving(&mut multi)?;
    let pool = PagePool::new(arena, Tokens(env.opts.page_size));
    env.governor.register_provider(pool.prefix_evictor());
    let engine = spawn_with(Box::new(multi), config, pool)?;
    Ok((engine, resident))
}

fn limits(env: &BootEnv<'_>, num_pages: Pages) -> ExecutorLimits {
    ExecutorLimits {
        max_rows: env.opts.max_batched_tokens,
        max_logit_rows: env.opts.max_running,
        page_size: env.opts.page_size,
        num_pages: num_pages.get(),
    }
}

fn cost_model(env: &BootEnv<'_>, weight_dtype: DType, kv_elem_bytes: u64) -> CostModel {
    CostModel {
        weight_dtype,
        kv_elem_bytes,
        page_size: Tokens(env.opts.page_size),
        max_rows: env.opts.max_batched_tokens,
        max_logit_rows: env.opts.max_running,
        chunk_target: layout::DEFAULT_CHUNK_TARGET,
    }
}

fn kv_share(arena: &KvArena, dev: &Device) -> Option<KvShare> {
    arena.part_on(dev.id()).map(|p| KvShare {
        device: dev.clone(),
        geometry: p.geometry,
        margin: DEFAULT_MARGIN,
    })
}

/// CPU ranks on sim cards: each card books what its rank would hold on a
/// GPU (weights as the card keeps them, the f32 workspace of its slice) and
/// its share of the KV arena at the CPU's f32 KV element.
pub(super) fn boot_sim_layout(
    env: &BootEnv<'_>,
    config: EngineConfig,
    spec: &LayoutSpec,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Started, BootError> {
    use corridor_backend::collective::ThreadGroup;
    use corridor_backend::cpu::CpuBackend;
    use corridor_engine::executor::SingleRank;
    use corridor_model::Model;
    use corridor_vram::Purpose;
    debug_assert!(matches!(env.opts.devices, Devices::Sim(_)));
    let devices = layout_devices(env, spec)?;
    let cost = cost_model(env, layout::card_weight_dtype(env.ckpt), 4);
    let plan = solve_on_cards(env, spec, &devices, &cost)?;
    let cfg = env.ckpt.config();
    let mut resident = Vec::new();
    let mut models = Vec::new();
    let total = plan.layout.ranks.len();
    for (i, (slice, dev)) in plan.layout.ranks.iter().zip(&devices).enumerate() {
        resident.push(dev.reserve(cost.weights(cfg, slice), Purpose::Weights).map_err(|e| {
            BootError::Memory(format!("{}: the weights of {} do not fit: {e}", dev.id(), slice.rank))
        })?);
        let backend = CpuBackend::new();
        let model = Model::load_slice(&backend, env.ckpt, slice, |_| {})?;
        models.push((backend, model));
        progress(i + 1, total);
    }
    (env.mark)(BootPhase::WeightsLoaded);
    for (slice, dev) in plan.layout.ranks.iter().zip(&devices) {
        resident.push(
            dev.reserve(cost.workspace(cfg, slice) + cost.state(cfg, slice), Purpose::Workspace)
                .map_err(|e| BootError::Memory(format!("{}: workspace does not fit: {e}", dev.id())))?,
        );
    }
    (env.mark)(BootPhase::WorkspaceReady);
    let (arena, parts) = layout_arena(env, &plan, &devices, &cost)?;
    let options =
        LayoutOptions { link: env.opts.sim_link, ..LayoutOptions::new(limits(env, arena.capacity())) };
    let (group, comms) =
        ThreadGroup::with_link(total, group_shape(spec), options.collective_timeout, options.link);
    let mut ranks = Vec::with_capacity(total);
    for (((backend, model), comm), dev) in models.into_iter().zip(comms).zip(&devices) {
        let exec = SingleRank::new(backend, model, options.limits)?.with_collective(Box::new(comm));
        ranks.push(RankParts { exec, kv: kv_share(&arena, dev), flip: None });
    }
    let multi = MultiRank::start(cfg.clone(), &plan.layout, group, ranks, options)?;
    tracing::info!(ranks = total, layout = %plan.layout.describe(), "parallel layout running on sim cards");
    finish(env, config, multi, arena, parts, resident)
}

/// A flipping group on sim cards (`--phase-flip`): every card runs one CPU
/// rank that holds its tensor slice and its pipeline stage, both booked on
/// the card, and a KV page whose share on each card covers both layouts.
/// The group serves in tensor parallel first.
pub(super) fn boot_sim_flipping(
    env: &BootEnv<'_>,
    config: EngineConfig,
    specs: [&LayoutSpec; 2],
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(Started, Option<corridor_engine::ranks::Calibration>), BootError> {
    use corridor_backend::collective::ThreadGroup;
    use corridor_backend::cpu::CpuBackend;
    use corridor_engine::executor::SingleRank;
    use corridor_engine::phase::Phase;
    use corridor_engine::ranks::FlipParts;
    use corridor_model::Model;
    use corridor_vram::Purpose;
    debug_assert!(matches!(env.opts.devices, Devices::Sim(_)));
    let devices = layout_devices(env, specs[0])?;
    let cost = cost_model(env, layout::card_weight_dtype(env.ckpt), 4);
    let cfg = env.ckpt.config();
    let rooms: Vec<CardRoom> = devices.iter().map(card_room).collect();
    let granule = layout::ffn_granule(cost.weight_dtype);
    let plan = layout::solve_flipping(cfg, specs[0], specs[1], &rooms, &cost, granule)
        .map_err(|e| BootError::Config(e.to_string()))?;
    if let Some(c) = plan.cards.iter().find(|c| !c.fits) {
        return Err(BootError::Memory(format!(
            "{}: both layouts' weights ({}) and workspace ({}) do not fit above its floor and margin (room {}); \
             a flipping group holds the model twice: add cards or use a smaller model",
            c.card.card, c.weights, c.workspace, c.card.free
        )));
    }
    let layouts = [plan.tensor.layout.clone(), plan.pipeline.layout.clone()];
    tracing::info!(
        tensor = %layouts[0].describe(),
        pipeline = %layouts[1].describe(),
        planned_pages = plan.group_pages.get(),
        "flipping group solved on the cards: both layouts resident"
    );
    for c in &plan.cards {
        tracing::info!(card = %c.card.card, weights = %c.weights, workspace = %c.workspace, page = %c.page_bytes,
            pages = c.own_pages.get(), "both layouts on this card");
    }
    let total = devices.len();
    let mut resident = Vec::new();
    let mut loaded = Vec::with_capacity(total);
    for (i, (c, dev)) in plan.cards.iter().zip(&devices).enumerate() {
        resident.push(dev.reserve(c.weights, Purpose::Weights).map_err(|e| {
            BootError::Memory(format!("{}: the weights of both layouts do not fit: {e}", dev.id()))
        })?);
        let mut pair = Vec::with_capacity(2);
        for l in &layouts {
            let backend = CpuBackend::new();
            let model = Model::load_slice(&backend, env.ckpt, &l.ranks[i], |_| {})?;
            pair.push((backend, model));
        }
        loaded.push(pair);
        progress(i + 1, total);
    }
    (env.mark)(BootPhase::WeightsLoaded);
    for (c, dev) in plan.cards.iter().zip(&devices) {
        resident.push(
            dev.reserve(c.workspace, Purpose::Workspace)
                .map_err(|e| BootError::Memory(format!("{}: workspace does not fit: {e}", dev.id())))?,
        );
    }
    (env.mark)(BootPhase::WorkspaceReady);
    let parts: Vec<(Device, Bytes)> = plan
        .cards
        .iter()
        .zip(&devices)
        .map(|(c, d)| (d.clone(), c.page_bytes))
        .filter(|(_, pb)| *pb > Bytes::ZERO)
        .collect();
    let arena = new_arena(env, &parts, None)?;
    let options =
        LayoutOptions { link: env.opts.sim_link, ..LayoutOptions::new(limits(env, arena.capacity())) };
    // The three groups share the cards' links: the flip's KV exchange pays
    // the link model like a step's collectives do.
    let group = |shape| ThreadGroup::with_link(total, shape, options.collective_timeout, options.link);
    let (tp_group, tp_comms) = group(GroupShape::Tensor);
    let (pp_group, pp_comms) = group(GroupShape::Pipeline);
    let (control, controls) = group(GroupShape::Tensor);
    let mut ranks = Vec::with_capacity(total);
    for ((((pair, tp), pp), ctl), dev) in
        loaded.into_iter().zip(tp_comms).zip(pp_comms).zip(controls).zip(&devices)
    {
        let mut pair = pair.into_iter();
        let (tb, tm) = pair.next().expect("a tensor slice");
        let (pb, pm) = pair.next().expect("a pipeline slice");
        let exec = SingleRank::new(tb, tm, options.limits)?.with_collective(Box::new(tp));
        let other = SingleRank::new(pb, pm, options.limits)?.with_collective(Box::new(pp));
        ranks.push(RankParts {
            exec,
            kv: kv_share(&arena, dev),
            flip: Some(FlipParts { other, control: ctl }),
        });
    }
    let multi = MultiRank::start_flipping(
        cfg.clone(),
        layouts,
        [tp_group, pp_group],
        control,
        ranks,
        Phase::Tensor,
        options,
    )?;
    tracing::info!(ranks = total, "flipping group running on sim cards, serving in tensor parallel");
    let rows =
        env.opts.max_batched_tokens.min(env.context_len).min(arena.capacity().get() * env.opts.page_size);
    let mut calibration = None;
    let started = finish_with(env, config, multi, arena, parts, resident, |multi| {
        let cal =
            multi.calibrate(rows, 3).map_err(|e| BootError::Config(format!("calibrating the flip: {e}")))?;
        log_calibration(&cal);
        calibration = Some(cal);
        Ok(())
    })?;
    Ok((started, calibration))
}

/// One line a person can act on: what each layout prefills and what a flip costs.
fn log_calibration(cal: &corridor_engine::ranks::Calibration) {
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

/// GPU ranks joined by NCCL: one CUDA backend per card, every device byte
/// through that card's chokepoint, KV in the card's share of the arena.
#[cfg(feature = "cuda")]
pub(super) fn boot_cuda_layout(
    env: &BootEnv<'_>,
    config: EngineConfig,
    spec: &LayoutSpec,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Started, BootError> {
    use corridor_backend::cuda::nccl::nccl_group;
    use corridor_engine::executor::SingleRank;
    use corridor_engine::ranks::COLLECTIVE_TIMEOUT;
    use corridor_model::Model;
    let devices = layout_devices(env, spec)?;
    let mut backends = Vec::with_capacity(devices.len());
    for (dev, &ordinal) in devices.iter().zip(env.ordinals) {
        backends.push(super::cuda_backend(env, dev, ordinal)?);
    }
    (env.mark)(BootPhase::ContextReady);
    let ordinals: Vec<usize> = env.ordinals.iter().map(|&o| o as usize).collect();
    let (group, comms) =
        nccl_group(&ordinals, group_shape(spec), COLLECTIVE_TIMEOUT, env.opts.cuda_tuning.nccl_graphs)
            .map_err(|e| BootError::Config(format!("NCCL: {e}")))?;
    let cost = cost_model(env, layout::card_weight_dtype(env.ckpt), 2);
    let plan = solve_on_cards(env, spec, &devices, &cost)?;
    let cfg = env.ckpt.config();
    let total_layers: usize = cfg.num_layers + 2 * plan.layout.ranks.len();
    let mut done = 0;
    let mut loaded = Vec::with_capacity(devices.len());
    for (slice, backend) in plan.layout.ranks.iter().zip(backends) {
        let model = Model::load_slice(&backend, env.ckpt, slice, |n| {
            done += n;
            progress(done.min(total_layers), total_layers);
        })?;
        loaded.push((backend, model));
    }
    (env.mark)(BootPhase::WeightsLoaded);
    let mut with_ws = Vec::with_capacity(loaded.len());
    for (backend, model) in loaded {
        let ws = model.workspace(&backend, env.opts.max_batched_tokens, env.opts.max_running)?;
        with_ws.push((backend, model, ws));
    }
    (env.mark)(BootPhase::WorkspaceReady);
    let (arena, parts) = layout_arena(env, &plan, &devices, &cost)?;
    // Micro-batched pipeline steps have run on CPU ranks only; GPU stages
    // keep whole steps until they have been measured on two cards.
    let options = LayoutOptions { microbatch_rows: 0, ..LayoutOptions::new(limits(env, arena.capacity())) };
    let mut ranks = Vec::with_capacity(with_ws.len());
    for (((backend, model, ws), comm), dev) in with_ws.into_iter().zip(comms).zip(&devices) {
        let kv = if model.slice().layers.is_empty() {
            model.kv_cache(&backend, env.opts.page_size, 0)?
        } else {
            model.kv_cache_in(&backend, env.opts.page_size, &arena)?
        };
        let exec = SingleRank::from_parts(backend, model, ws, kv).with_collective(Box::new(comm));
        ranks.push(RankParts { exec, kv: kv_share(&arena, dev), flip: None });
    }
    let multi = MultiRank::start(cfg.clone(), &plan.layout, group, ranks, options)?;
    tracing::info!(ranks = devices.len(), layout = %plan.layout.describe(), "parallel layout running on GPUs over NCCL");
    finish(env, config, multi, arena, parts, Vec::new())
}
