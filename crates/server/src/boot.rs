//! Boot: the composition root shared by `corridor serve`, `corridor
//! generate` and the server's tests. The options are parsed once into a
//! [`BootPlan`] (`plan.rs`); [`boot_plan`] then reads straight down: open and
//! measure the cards under their governor, open the checkpoint with its
//! tokenizer and chat template, boot the rank group on the backend of the
//! cards' kind (`group.rs`: layout solved, ranks loaded, warmed up, KV sized
//! and committed), register the relief providers, serve.
//!
//! The order is the memory model's (DESIGN.md §3): weights, then the
//! workspace, are resident and booked before KV is sized, so the solve reads
//! what is really left, and KV takes what the cards hold above floor and
//! margin; each phase leaves a flight-recorder mark when a flight directory
//! is given.

use crate::template::ChatTemplate;
use crate::tokenizer::Tokenizer;
use corridor_backend::cpu::KvPrecision;
use corridor_engine::engine::{EngineConfig, EngineHandle};
use corridor_engine::flips::FlipMode;
use corridor_engine::scheduler::SchedulerConfig;
use corridor_model::layout::LayoutSpec;
use corridor_model::{Checkpoint, ModelConfig};
use corridor_units::{Bytes, CardId, Pages};
use corridor_vram::recorder::{BootId, BootPhase, FlightRecorder, MarkIdentity};
use corridor_vram::sizing::DEFAULT_MARGIN;
use corridor_vram::{
    Allocation, Card, ChunkGeometry, CpuCard, CudaSelection, Device, Governor, KvArena, KvArenaConfig,
    SimCard, SimCardSpec, SystemClock,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod group;
pub mod plan;

use group::{BootEnv, CpuRanks, Started};
pub use plan::{BootPlan, CardsPlan, GroupPlan};

/// How long the governor waits for the engine to give memory back: a step
/// in flight finishes first (a long prefill chunk on a CPU can take this long).
const KV_RELIEF_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Which cards to run on.
#[derive(Clone, Debug, PartialEq)]
pub enum Devices {
    /// The host: CPU compute, host memory booked on the CPU card.
    Cpu,
    /// Simulated cards of these sizes: CPU compute, simulated card memory.
    Sim(Vec<Bytes>),
    /// NVIDIA GPUs: CUDA compute, card memory measured by the driver and NVML.
    Cuda(CudaSelection),
}

impl Devices {
    /// Parse `cpu` or `sim:32GiB,20GiB,20GiB`.
    pub fn parse(text: &str) -> Result<Devices, String> {
        let t = text.trim();
        if t == "cpu" {
            return Ok(Devices::Cpu);
        }
        if let Some(list) = t.strip_prefix("sim:") {
            let sizes: Result<Vec<Bytes>, String> = list.split(',').map(Bytes::parse_size).collect();
            let sizes = sizes?;
            if sizes.is_empty() || sizes.iter().any(|b| *b == Bytes::ZERO) {
                return Err(format!("--devices {text}: every sim card needs a size, e.g. sim:32GiB,20GiB"));
            }
            return Ok(Devices::Sim(sizes));
        }
        if t.len() >= 4 && t[..4].eq_ignore_ascii_case("cuda") {
            return CudaSelection::parse(t).map(Devices::Cuda).map_err(|e| format!("--devices: {e}"));
        }
        Err(format!("--devices {text}: expected cpu, sim:SIZE[,SIZE...] or cuda[:ORDINAL|GPU-UUID,...]"))
    }
}

/// What `boot` needs; the cli fills it from flags.
#[derive(Clone, Debug)]
pub struct BootOptions {
    /// A Hugging Face directory or a `.gguf` file.
    pub model: PathBuf,
    /// Sequences that may run at once.
    pub max_running: usize,
    /// Token rows per step (chunked-prefill budget).
    pub max_batched_tokens: usize,
    /// What running decodes' inter-token latency should keep (an absolute
    /// target and a stall ratio): it bounds the prompt rows a step carries
    /// beside them, at the cost of a longer time to first token for long
    /// prompts ([`ItlBound::NONE`]: no bound).
    pub itl: corridor_engine::step_budget::ItlBound,
    /// Longest sequence; `None` = the model's trained context.
    pub context_len: Option<usize>,
    /// On the CPU card: the most host memory the KV cache may take.
    pub kv_budget: Bytes,
    /// Tokens per KV page.
    pub page_size: usize,
    pub devices: Devices,
    /// The CUDA backend's launch and profiling switches (parsed by the command line).
    pub cuda_tuning: corridor_backend::CudaTuning,
    /// CPU ranks hold 32-weight block formats in tiles of 16 rows where the
    /// CPU has AVX-512 VNNI (`--cpu-row-tiles`).
    pub cpu_row_tiles: bool,
    /// How CPU ranks store K and V (`--cpu-kv-dtype`); `None`: f32 for a
    /// checkpoint whose matrices are f32, f16 for every other.
    pub cpu_kv: Option<corridor_backend::cpu::KvPrecision>,
    /// `--floor-mib` as given (`N` or `N,N,...`); `None` = 1024 per card.
    pub floor_mib: Option<String>,
    /// `--card-budget-mib` as given; `None` = no budget.
    pub card_budget_mib: Option<String>,
    /// Where boot and serving marks are written (`None`: no recorder).
    pub flight_dir: Option<PathBuf>,
    /// Scheduled foreign processes on sim cards (JSON lines).
    pub sim_events: Option<PathBuf>,
    /// Driver carve-out on sim cards (to rehearse a real card).
    pub sim_carve_out: Bytes,
    /// How long KV waits after giving memory back before growing again
    /// (`None`: the governor's default).
    pub kv_hold: Option<std::time::Duration>,
    /// Pace of serving marks (`None`: the governor's default, 30 s).
    pub serving_mark_interval: Option<std::time::Duration>,
    /// How often the sampler reads every card (`None`: 100 ms).
    pub sample_interval: Option<std::time::Duration>,
    /// A parallel layout (`None`: the whole model as one rank). On the CPU
    /// the ranks are threads sharing the host card.
    pub layout: Option<LayoutSpec>,
    /// Where compiled GPU kernels are cached (`None`: compiled at every start).
    pub kernel_cache: Option<PathBuf>,
    /// Hold a tensor and a pipeline layout over the cards and flip between
    /// them (`Off`: one layout, `layout`).
    pub phase_flip: FlipMode,
    /// The two layouts of a flipping group (`tp_split` and `pp_split` of
    /// this spec; one rank per card).
    pub flip_splits: Option<LayoutSpec>,
    /// The least time `--phase-flip auto` stays in a layout.
    pub flip_dwell: std::time::Duration,
    /// Draw rows on the GPU where the layout allows (`--device-sampling`).
    pub device_sampling: bool,
    /// What a transfer between CPU ranks of a layout (on sim cards or the
    /// host) costs; `None`: nothing, as between threads.
    pub sim_link: Option<corridor_backend::collective::LinkModel>,
}

impl BootOptions {
    pub fn new(model: PathBuf) -> Self {
        BootOptions {
            model,
            max_running: 32,
            max_batched_tokens: 512,
            itl: corridor_engine::step_budget::ItlBound::DEFAULT,
            context_len: None,
            kv_budget: Bytes::mib(1024),
            page_size: 16,
            devices: Devices::Cpu,
            cuda_tuning: corridor_backend::CudaTuning::default(),
            cpu_row_tiles: true,
            cpu_kv: None,
            floor_mib: None,
            card_budget_mib: None,
            flight_dir: None,
            sim_events: None,
            sim_carve_out: Bytes::ZERO,
            kv_hold: None,
            serving_mark_interval: None,
            sample_interval: None,
            layout: None,
            kernel_cache: None,
            phase_flip: FlipMode::Off,
            flip_splits: None,
            flip_dwell: corridor_engine::flips::DEFAULT_MIN_DWELL,
            device_sampling: true,
            sim_link: None,
        }
    }
}

/// A running engine with what the server needs beside it.
pub struct Booted {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Arc<ChatTemplate>,
    /// The name `/v1/models` lists by default (the checkpoint's file or directory name).
    pub model_name: String,
    pub checkpoint_path: PathBuf,
    /// The sampling values the checkpoint recommends (`generation_config.json`
    /// or a GGUF file's `general.sampling.*`); the server's flags win over them.
    pub sampling: crate::defaults::SamplingPreferences,
    /// The memory governor: cards, books, arenas, sampler.
    pub governor: Arc<Governor>,
    /// What must live as long as anything serves from this boot: the weights
    /// and workspace bookings and the sampler/relief threads. Shared, so the
    /// server state keeps it alive after `Booted` itself is gone.
    pub keep_alive: Arc<KeepAlive>,
}

/// Bookings and threads held for the life of the engine.
pub struct KeepAlive {
    /// Dropping it stops the sampler and relief threads.
    pub monitor: Option<corridor_vram::governor::Monitor>,
    /// Weights and workspace bookings.
    pub resident: Vec<Allocation>,
}

/// Errors at boot, each one line a person can act on.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error(transparent)]
    Load(#[from] corridor_model::error::LoadError),
    #[error(transparent)]
    Model(#[from] corridor_model::ModelError),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error(transparent)]
    Template(#[from] crate::template::TemplateError),
    #[error(transparent)]
    Engine(#[from] corridor_engine::engine::EngineError),
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Memory(String),
}

/// Load the tokenizer that belongs to a checkpoint.
pub fn load_tokenizer(ckpt: &Checkpoint) -> Result<Tokenizer, BootError> {
    Ok(match ckpt.gguf() {
        Some(g) => Tokenizer::from_gguf(g)?,
        None => Tokenizer::from_hf_dir(ckpt.dir().unwrap_or_else(|| Path::new(".")))?,
    })
}

/// The cards of the plan, with each CUDA card's device ordinal (none for
/// the host and sim cards).
type Cards = (Vec<Arc<dyn Card>>, Vec<u32>);

fn open_cards(cards: &CardsPlan, clock: &Arc<SystemClock>) -> Result<Cards, BootError> {
    Ok(match cards {
        CardsPlan::Host { total, .. } => {
            (vec![Arc::new(CpuCard::new(CardId(0), *total)) as Arc<dyn Card>], Vec::new())
        }
        CardsPlan::Sim { sizes, carve_out, events } => {
            let cards = sizes
                .iter()
                .enumerate()
                .map(|(i, total)| {
                    let mut spec = SimCardSpec::new(CardId(i as u32), *total);
                    spec.carve_out = *carve_out;
                    Arc::new(SimCard::new(spec, events, clock.clone())) as Arc<dyn Card>
                })
                .collect();
            (cards, Vec::new())
        }
        CardsPlan::Cuda(selection) => open_cuda_cards(selection)?,
    })
}

#[cfg(feature = "cuda")]
fn open_cuda_cards(selection: &CudaSelection) -> Result<Cards, BootError> {
    let cards = corridor_vram::CudaCard::open_all(selection).map_err(|e| BootError::Config(e.to_string()))?;
    let ordinals = cards.iter().map(|c| c.ordinal()).collect();
    Ok((cards.into_iter().map(|c| Arc::new(c) as Arc<dyn Card>).collect(), ordinals))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda_cards(_selection: &CudaSelection) -> Result<Cards, BootError> {
    Err(BootError::Config(
        "--devices cuda: this corridor was built without CUDA support; build it with \
         `cargo build --release --features cuda`"
            .into(),
    ))
}

/// Bytes of the activation workspace the CPU backend allocates for steps of
/// `rows` token rows and `logit_rows` sampled rows (see `llama::Workspace`).
fn workspace_bytes(c: &ModelConfig, rows: usize, logit_rows: usize) -> Bytes {
    if let Some(h) = &c.hybrid {
        return corridor_model::qwen3_5::workspace_bytes(c, h, rows, logit_rows);
    }
    let q = c.num_heads * c.head_dim;
    let kv = c.num_kv_heads * c.head_dim;
    let per_row = 3 * c.hidden_size + 2 * q + 2 * kv + 3 * c.intermediate_size;
    let per_logit_row = 2 * c.hidden_size + c.vocab_size;
    Bytes(((rows * per_row + logit_rows * per_logit_row) * 4) as u64)
}

/// Load everything and start the engine. `progress(done, total)` is called as
/// layers are placed.
pub fn boot(opts: &BootOptions, mut progress: impl FnMut(usize, usize)) -> Result<Booted, BootError> {
    let plan = BootPlan::new(opts)?;
    boot_plan(&plan, &mut progress)
}

/// Boot a plan: open and measure the cards, open the checkpoint, boot the
/// rank group on the cards (`group::start`: layout solved, ranks loaded,
/// warmed up, KV sized and committed), register the relief providers and
/// serve.
pub fn boot_plan(plan: &BootPlan, progress: &mut dyn FnMut(usize, usize)) -> Result<Booted, BootError> {
    // The cards and their governor.
    let clock = Arc::new(SystemClock::new());
    let (cards, ordinals) = open_cards(&plan.cards, &clock)?;
    let gcfg = plan.card_limits.governor(cards.len())?;
    let governor =
        Arc::new(Governor::new(cards, gcfg, clock.clone()).map_err(|e| BootError::Config(e.to_string()))?);
    let recorder = match &plan.flight_dir {
        Some(dir) => {
            let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            let ident = MarkIdentity {
                boot_id: BootId::new(std::process::id(), wall.as_millis() as u64),
                rank: None,
            };
            let rec =
                FlightRecorder::open(dir, ident, governor.config().serving_mark_interval, clock.clone())
                    .map_err(|e| BootError::Config(format!("--flight-dir {}: {e}", dir.display())))?;
            Some(Arc::new(rec))
        }
        None => None,
    };
    let mark = |phase: BootPhase| {
        if let Some(r) = &recorder {
            if let Err(e) = r.boot_mark(phase, governor.devices()) {
                tracing::warn!("flight recorder: {e}");
            }
        }
    };
    mark(BootPhase::ProcessStart);

    // The checkpoint and what serves beside it.
    let ckpt = Checkpoint::open(&plan.model)?;
    let tokenizer = load_tokenizer(&ckpt)?;
    let template = ChatTemplate::for_checkpoint(
        tokenizer.chat_template(),
        tokenizer.bos_token(),
        tokenizer.eos_token(),
    )?;
    let sampling = match (ckpt.gguf(), ckpt.dir()) {
        (Some(g), _) => crate::defaults::SamplingPreferences::from_gguf(g),
        (None, Some(dir)) => crate::defaults::SamplingPreferences::from_hf_dir(dir),
        (None, None) => Default::default(),
    };
    let limits = plan.limits;
    let context_len = limits.context_len.map_or(ckpt.config().max_position_embeddings, |t| t.get()).max(1);
    let config = EngineConfig {
        scheduler: SchedulerConfig {
            max_running: limits.max_running,
            max_batched_tokens: limits.max_batched_tokens,
            context_len,
            itl: limits.itl,
        },
        page_size: limits.page_size,
    };
    if limits.itl.is_none() {
        tracing::info!("no inter-token-latency bound: prompts take every row decodes leave");
    } else {
        tracing::info!(
            itl_target_ms = limits.itl.target.map(|t| t.as_millis() as u64),
            itl_stall_ratio = limits.itl.stall_ratio,
            max_batched_tokens = limits.max_batched_tokens,
            "while requests decode, a step takes only the prompt rows predicted to keep their inter-token latency \
             within the target and within the ratio times their step without a prompt"
        );
    }

    // The rank group, on the backend of the cards' kind.
    let env = BootEnv {
        plan,
        ckpt: &ckpt,
        governor: &governor,
        clock: &clock,
        mark: &mark,
        context_len,
        ordinals: &ordinals,
    };
    // CPU ranks on the host card hold resident buffers; on sim cards, lazy ones.
    let kv = plan.cpu_kv.unwrap_or(if ckpt.matrices_f32() { KvPrecision::F32 } else { KvPrecision::F16 });
    if !matches!(plan.cards, CardsPlan::Cuda(_)) {
        tracing::info!(
            kv = ?kv,
            "CPU ranks store K and V in {}",
            match kv {
                KvPrecision::F32 => "f32",
                KvPrecision::F16 => "f16 (half the bytes a token of f32; --cpu-kv-dtype f32 keeps them exact)",
            }
        );
    }
    let cpu_ranks = |resident| CpuRanks { resident, link: plan.sim_link, row_tiles: plan.cpu_row_tiles, kv };
    let started = match &plan.cards {
        CardsPlan::Host { .. } => group::start(&env, &cpu_ranks(true), config, progress)?,
        CardsPlan::Sim { .. } => group::start(&env, &cpu_ranks(false), config, progress)?,
        CardsPlan::Cuda(_) => start_cuda(&env, config, progress)?,
    };
    if let GroupPlan::Flipping { mode, min_dwell, .. } = &plan.group {
        let governor = governor.clone();
        let observer: corridor_engine::flips::FlipObserver =
            Arc::new(move |r| governor.record_flip(&flip_event(r)));
        started.engine.set_flips(corridor_engine::flips::FlipSettings {
            mode: *mode,
            min_dwell: *min_dwell,
            observer: Some(observer),
            calibration: started.calibration.clone(),
        });
        tracing::info!(mode = %mode, "phase flips between tensor and pipeline parallel are on");
    }

    // Relief: the engine answers for every card its KV spans: it moves live
    // pages between steps and preempts only when running requests hold more
    // than the card keeps.
    governor.register_provider(started.engine.kv_relief(KV_RELIEF_TIMEOUT));
    mark(BootPhase::BootComplete);
    if let Some(r) = recorder {
        governor.attach_recorder(r);
    }
    let monitor = governor
        .spawn_monitor()
        .map_err(|e| BootError::Memory(format!("cannot start the memory sampler: {e}")))?;
    let model_name = plan
        .model
        .file_name()
        .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
        .unwrap_or_else(|| "model".to_string());
    Ok(Booted {
        engine: started.engine,
        tokenizer: Arc::new(tokenizer),
        template: Arc::new(template),
        model_name,
        checkpoint_path: plan.model.clone(),
        sampling,
        governor,
        keep_alive: Arc::new(KeepAlive { monitor: Some(monitor), resident: started.resident }),
    })
}

#[cfg(feature = "cuda")]
fn start_cuda(
    env: &BootEnv<'_>,
    config: EngineConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Started, BootError> {
    group::start(env, &group::CudaRanks, config, progress)
}

#[cfg(not(feature = "cuda"))]
fn start_cuda(
    _env: &BootEnv<'_>,
    _config: EngineConfig,
    _progress: &mut dyn FnMut(usize, usize),
) -> Result<Started, BootError> {
    Err(BootError::Config("this corridor was built without CUDA support".into()))
}

/// A flip as the flight recorder keeps it.
fn flip_event(r: &corridor_engine::flips::FlipRecord) -> corridor_vram::recorder::FlipEvent {
    use corridor_engine::phase::FlipVerdict;
    let (sent, local, reason) = match &r.verdict {
        FlipVerdict::Committed(d) => (d.sent, d.local, None),
        FlipVerdict::Abandoned(why) => (Bytes::ZERO, Bytes::ZERO, Some(why.to_string())),
    };
    corridor_vram::recorder::FlipEvent {
        from: r.from.to_string(),
        to: r.to.to_string(),
        committed: r.committed(),
        reason,
        bytes_moved: sent,
        bytes_local: local,
        pages: r.pages as u64,
        requests: r.requests as u64,
        duration_us: r.duration.as_micros() as u64,
        staging: r.staging,
        epoch: r.epoch,
    }
}

/// The KV arena over `parts` (each card with the bytes of one page on it;
/// one card unless a layout spans several): an address reservation for as
/// many pages as the smallest share could ever hold (on the host card, at
/// most what the scheduler could ever use), nothing committed yet.
/// The config of an arena over `parts` (each card's page bytes) in chunks of
/// about `chunk_target`, its id space `pages` rounded up to whole chunks (so
/// even a tiny pool holds one), and the chunks' geometry.
fn whole_chunks(
    env: &BootEnv<'_>,
    parts: &[(Device, Bytes)],
    pages: usize,
    chunk_target: Bytes,
) -> Result<(KvArenaConfig, ChunkGeometry), BootError> {
    let shapes: Vec<(Bytes, Bytes)> = parts.iter().map(|(d, pb)| (*pb, d.card().granularity())).collect();
    let geometry =
        ChunkGeometry::common(&shapes, chunk_target).map_err(|e| BootError::Memory(e.to_string()))?[0];
    let ids = pages.max(1).div_ceil(geometry.chunk_pages) * geometry.chunk_pages;
    let config = KvArenaConfig {
        page_bytes: parts[0].1,
        max_pages: Pages(ids),
        chunk_target,
        hold: env.governor.config().kv_hold,
        margin: DEFAULT_MARGIN,
    };
    Ok((config, geometry))
}

fn new_arena(
    env: &BootEnv<'_>,
    parts: &[(Device, Bytes)],
    host_cap: Option<Bytes>,
) -> Result<Arc<KvArena>, BootError> {
    let limits = env.plan.limits;
    let mut max_pages = parts
        .iter()
        .map(|(dev, pb)| (dev.card().total().get() / pb.get().max(1)) as usize)
        .min()
        .unwrap_or(0);
    if matches!(env.plan.cards, CardsPlan::Host { .. }) {
        // The host card's KV is made resident when it is allocated and the
        // host is shared with everything else, so its id space is held to
        // what the scheduler could use at once. On sim and GPU cards the id
        // space is address space only: KV fills the card, and what running
        // requests do not use holds cached prefixes (the CPU ranks of sim
        // cards back a block of KV with host memory only once it is written).
        let useful = limits.max_running * env.context_len.div_ceil(limits.page_size.get());
        max_pages = max_pages.min(useful);
    }
    let widest = parts.iter().map(|(_, pb)| *pb).max().unwrap_or(Bytes::ZERO);
    if let Some(cap) = host_cap {
        // The host is shared with everything else: hold KV to its budget.
        max_pages = max_pages.min((cap.get() / widest.get().max(1)) as usize);
    }
    // Chunks of about 2 MiB (whole granules of the card), but never more than
    // a quarter of the pool, so a small pool still shrinks and grows in steps.
    let pool_bytes = Bytes(widest.get() * max_pages.max(1) as u64);
    let chunk_target = Bytes::mib(2).min(Bytes(pool_bytes.get() / 4)).max(widest);
    let (arena_cfg, _) = whole_chunks(env, parts, max_pages, chunk_target)?;
    let arena = KvArena::spanning(parts, arena_cfg, env.clock.clone())
        .map_err(|e| BootError::Memory(e.to_string()))?;
    Ok(Arc::new(arena))
}
