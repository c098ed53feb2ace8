//! Boot: open the cards and the memory governor, load a checkpoint with its
//! tokenizer and chat template, size the KV arena from the measured free
//! column, and start the engine. The composition root shared by `corridor
//! serve`, `corridor generate` and the server's tests.
//!
//! The order is the memory model's (DESIGN.md §3): weights, then the
//! workspace, are resident and booked before KV is sized, so the solve reads
//! what is really left; each phase leaves a flight-recorder mark when a
//! flight directory is given.

use crate::template::ChatTemplate;
use crate::tokenizer::Tokenizer;
use corridor_backend::cpu::CpuBackend;
use corridor_engine::engine::spawn_with;
use corridor_engine::engine::{spawn, EngineConfig, EngineHandle};
use corridor_engine::executor::ExecutorLimits;
use corridor_engine::pages::PagePool;
use corridor_engine::ranks::{spawn_layout, LayoutOptions};
use corridor_engine::scheduler::SchedulerConfig;
use corridor_model::layout::{Layout, LayoutSpec};
use corridor_model::llama::Model;
use corridor_model::{Checkpoint, ModelConfig};
use corridor_units::{Bytes, CardId, Pages, Tokens};
use corridor_vram::recorder::{BootId, BootPhase, FlightRecorder, MarkIdentity};
use corridor_vram::sizing::{solve, SizingInput, DEFAULT_MARGIN};
use corridor_vram::{
    parse_sim_events, Allocation, Card, ChunkGeometry, CpuCard, Governor, GovernorConfig, KvArena,
    KvArenaConfig, Purpose, SimCard, SimCardSpec, SystemClock, Urgency,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Which cards to run on.
#[derive(Clone, Debug, PartialEq)]
pub enum Devices {
    /// The host: CPU compute, host memory booked on the CPU card.
    Cpu,
    /// Simulated cards of these sizes: CPU compute, simulated card memory.
    Sim(Vec<Bytes>),
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
        if t.starts_with("cuda") {
            return Err(format!(
                "--devices {text}: serving on CUDA cards is not available yet (the CUDA backend is \
                 checked on its own by scripts/gpu/check.sh); use --devices cpu or sim:SIZE,..."
            ));
        }
        Err(format!("--devices {text}: expected cpu, sim:SIZE[,SIZE...] or cuda[:ID,...]"))
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
    /// Longest sequence; `None` = the model's trained context.
    pub context_len: Option<usize>,
    /// On the CPU card: the most host memory the KV cache may take.
    pub kv_budget: Bytes,
    /// Tokens per KV page.
    pub page_size: usize,
    pub devices: Devices,
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
    /// A parallel layout (`None`: the whole model as one rank). On the CPU
    /// the ranks are threads sharing the host card.
    pub layout: Option<LayoutSpec>,
}

impl BootOptions {
    pub fn new(model: PathBuf) -> Self {
        BootOptions {
            model,
            max_running: 32,
            max_batched_tokens: 512,
            context_len: None,
            kv_budget: Bytes::mib(1024),
            page_size: 16,
            devices: Devices::Cpu,
            floor_mib: None,
            card_budget_mib: None,
            flight_dir: None,
            sim_events: None,
            sim_carve_out: Bytes::ZERO,
            kv_hold: None,
            serving_mark_interval: None,
            layout: None,
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
    Model(#[from] corridor_model::llama::ModelError),
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

fn open_cards(opts: &BootOptions, clock: &Arc<SystemClock>) -> Result<Vec<Arc<dyn Card>>, BootError> {
    Ok(match &opts.devices {
        Devices::Cpu => vec![Arc::new(CpuCard::new(CardId(0), Bytes::gib(16))) as Arc<dyn Card>],
        Devices::Sim(sizes) => {
            let events = match &opts.sim_events {
                Some(p) => {
                    let text = std::fs::read_to_string(p)
                        .map_err(|e| BootError::Config(format!("--sim-events {}: {e}", p.display())))?;
                    parse_sim_events(&text)
                        .map_err(|e| BootError::Config(format!("--sim-events {}: {e}", p.display())))?
                }
                None => Vec::new(),
            };
            sizes
                .iter()
                .enumerate()
                .map(|(i, total)| {
                    let mut spec = SimCardSpec::new(CardId(i as u32), *total);
                    spec.carve_out = opts.sim_carve_out;
                    Arc::new(SimCard::new(spec, &events, clock.clone())) as Arc<dyn Card>
                })
                .collect()
        }
    })
}

/// Bytes of the activation workspace the CPU backend allocates for steps of
/// `rows` token rows and `logit_rows` sampled rows (see `llama::Workspace`).
fn workspace_bytes(c: &ModelConfig, rows: usize, logit_rows: usize) -> Bytes {
    let q = c.num_heads * c.head_dim;
    let kv = c.num_kv_heads * c.head_dim;
    let per_row = 3 * c.hidden_size + 2 * q + 2 * kv + 3 * c.intermediate_size;
    let per_logit_row = 2 * c.hidden_size + c.vocab_size;
    Bytes(((rows * per_row + logit_rows * per_logit_row) * 4) as u64)
}

/// Load everything and start the engine. `progress(done, total)` is called as
/// layers are placed.
pub fn boot(opts: &BootOptions, mut progress: impl FnMut(usize, usize)) -> Result<Booted, BootError> {
    if opts.page_size == 0 || opts.max_running == 0 || opts.max_batched_tokens == 0 {
        return Err(BootError::Config(
            "page size, max running requests and max batched tokens must be positive".into(),
        ));
    }
    let clock = Arc::new(SystemClock::new());
    let cards = open_cards(opts, &clock)?;
    let mut gcfg =
        GovernorConfig::from_flags(cards.len(), opts.floor_mib.as_deref(), opts.card_budget_mib.as_deref())
            .map_err(|e| BootError::Config(e.to_string()))?;
    if let Some(h) = opts.kv_hold {
        gcfg.kv_hold = h;
    }
    if let Some(i) = opts.serving_mark_interval {
        gcfg.serving_mark_interval = i;
    }
    let governor =
        Arc::new(Governor::new(cards, gcfg, clock.clone()).map_err(|e| BootError::Config(e.to_string()))?);
    let recorder = match &opts.flight_dir {
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

    let ckpt = Checkpoint::open(&opts.model)?;
    let tokenizer = load_tokenizer(&ckpt)?;
    let template = ChatTemplate::for_checkpoint(
        tokenizer.chat_template(),
        tokenizer.bos_token(),
        tokenizer.eos_token(),
    )?;
    let cfg = ckpt.config().clone();
    let context_len = opts.context_len.unwrap_or(cfg.max_position_embeddings).max(1);
    // The whole model runs on card 0 (multi-card layouts place ranks).
    let dev = governor.devices()[0].clone();
    let mut resident = Vec::new();
    let weights = Bytes(ckpt.file_bytes());
    resident.push(
        dev.reserve(weights, Purpose::Weights)
            .map_err(|e| BootError::Memory(format!("weights do not fit: {e}")))?,
    );
    let layout = match &opts.layout {
        Some(spec) if spec.tp.max(1) * spec.pp.max(1) > 1 => {
            if opts.devices != Devices::Cpu {
                return Err(BootError::Config(
                    "serving a parallel layout runs on --devices cpu for now; use `corridor plan` to solve one for cards".into(),
                ));
            }
            // Block-quantized weights are split on whole 32-column blocks.
            let granule = if ckpt.gguf().is_some() { 32 } else { 1 };
            Some(Layout::from_spec(&cfg, spec, granule).map_err(|e| BootError::Config(e.to_string()))?)
        }
        _ => None,
    };
    let backend = CpuBackend::new();
    let model = match &layout {
        Some(_) => None,
        None => {
            let total = cfg.num_layers + 2;
            let mut done = 0;
            Some(Model::load(&backend, &ckpt, |n| {
                done += n;
                progress(done, total);
            })?)
        }
    };
    mark(BootPhase::WeightsLoaded);
    let ws = workspace_bytes(&cfg, opts.max_batched_tokens, opts.max_running);
    resident.push(
        dev.reserve(ws, Purpose::Workspace)
            .map_err(|e| BootError::Memory(format!("workspace does not fit: {e}")))?,
    );
    mark(BootPhase::WorkspaceReady);

    // KV: the CPU keeps it in f32; one page holds `page_size` tokens of every
    // layer, on every rank that holds a share of it.
    let kv_token_bytes: usize = match &layout {
        Some(l) => l.ranks.iter().map(|r| 2 * r.layers.len() * r.kv_heads.len() * cfg.head_dim * 4).sum(),
        None => 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4,
    };
    let page_bytes = Bytes((kv_token_bytes * opts.page_size) as u64);
    let useful = opts.max_running * context_len.div_ceil(opts.page_size);
    let mut max_pages = useful.min((dev.card().total().get() / page_bytes.get().max(1)) as usize);
    if opts.devices == Devices::Cpu {
        // The host is shared with everything else: hold KV to its budget.
        max_pages = max_pages.min((opts.kv_budget.get() / page_bytes.get().max(1)) as usize);
    }
    // Chunks of about 2 MiB (whole granules of the card), but never more than
    // a quarter of the pool, so a small pool still shrinks and grows in steps.
    let pool_bytes = Bytes(page_bytes.get() * max_pages.max(1) as u64);
    let chunk_target = Bytes::mib(2).min(Bytes(pool_bytes.get() / 4)).max(page_bytes);
    let geometry = ChunkGeometry::new(page_bytes, dev.card().granularity(), chunk_target)
        .map_err(|e| BootError::Memory(e.to_string()))?;
    // The id space is whole chunks: round up, so even a tiny pool holds one.
    let max_pages = max_pages.max(1).div_ceil(geometry.chunk_pages) * geometry.chunk_pages;
    let arena_cfg = KvArenaConfig {
        page_bytes,
        max_pages: Pages(max_pages),
        chunk_target,
        hold: governor.config().kv_hold,
    };
    let arena =
        Arc::new(KvArena::new(&dev, arena_cfg, clock.clone()).map_err(|e| BootError::Memory(e.to_string()))?);
    let sizing =
        solve(SizingInput::measure(&dev, DEFAULT_MARGIN, Bytes::ZERO, arena.geometry(), arena.capacity()));
    arena
        .commit_to(sizing.pages, Urgency::Deferrable)
        .map_err(|e| BootError::Memory(format!("KV pool: {e}")))?;
    if arena.backed().get() == 0 {
        return Err(BootError::Memory(format!(
            "no KV page of {} fits on {} above its floor: lower --max-batched-tokens, raise the card budget or lower --floor-mib",
            page_bytes,
            dev.id()
        )));
    }
    tracing::info!(
        pages = arena.backed().get(),
        tokens = arena.backed().get() * opts.page_size,
        page = %page_bytes,
        bound = ?sizing.bound,
        "KV pool sized"
    );
    governor.attach_arena(arena.clone());
    mark(BootPhase::KvSized);

    let pool = PagePool::new(arena, Tokens(opts.page_size));
    governor.register_provider(pool.prefix_evictor());
    let config = EngineConfig {
        scheduler: SchedulerConfig {
            max_running: opts.max_running,
            max_batched_tokens: opts.max_batched_tokens,
            context_len,
        },
        page_size: Tokens(opts.page_size),
    };
    let engine = match (model, &layout) {
        (Some(model), _) => spawn(backend, model, config, pool)?,
        (None, Some(layout)) => {
            let limits = ExecutorLimits {
                max_rows: opts.max_batched_tokens,
                max_logit_rows: opts.max_running,
                page_size: opts.page_size,
                num_pages: pool.capacity(),
            };
            let exec = spawn_layout(&ckpt, layout, LayoutOptions::new(limits))?;
            tracing::info!(ranks = layout.ranks.len(), "parallel layout running on CPU threads");
            spawn_with(exec, config, pool)?
        }
        (None, None) => unreachable!("a model is loaded unless a layout is"),
    };
    governor.register_provider(engine.preempt_provider(dev.id(), page_bytes));
    mark(BootPhase::BootComplete);
    if let Some(r) = recorder {
        governor.attach_recorder(r);
    }
    let monitor = governor
        .spawn_monitor()
        .map_err(|e| BootError::Memory(format!("cannot start the memory sampler: {e}")))?;
    let model_name = opts
        .model
        .file_name()
        .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
        .unwrap_or_else(|| "model".to_string());
    Ok(Booted {
        engine,
        tokenizer: Arc::new(tokenizer),
        template: Arc::new(template),
        model_name,
        checkpoint_path: opts.model.clone(),
        governor,
        keep_alive: Arc::new(KeepAlive { monitor: Some(monitor), resident }),
    })
}
