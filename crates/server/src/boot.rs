//! Boot: load a checkpoint, its tokenizer and chat template, size the KV
//! pool, and start the engine. The composition root shared by `corridor
//! serve`, `corridor generate` and the server's tests.

use crate::template::ChatTemplate;
use crate::tokenizer::Tokenizer;
use corridor_backend::cpu::CpuBackend;
use corridor_engine::engine::{spawn, EngineConfig, EngineHandle};
use corridor_engine::scheduler::SchedulerConfig;
use corridor_model::llama::Model;
use corridor_model::Checkpoint;
use corridor_units::{Bytes, Pages, Tokens};
use std::path::{Path, PathBuf};
use std::sync::Arc;

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
    /// Memory for the KV cache on the CPU.
    pub kv_budget: Bytes,
    /// Tokens per KV page.
    pub page_size: usize,
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
}

/// Load the tokenizer that belongs to a checkpoint.
pub fn load_tokenizer(ckpt: &Checkpoint) -> Result<Tokenizer, BootError> {
    Ok(match ckpt.gguf() {
        Some(g) => Tokenizer::from_gguf(g)?,
        None => Tokenizer::from_hf_dir(ckpt.dir().unwrap_or_else(|| Path::new(".")))?,
    })
}

/// Load everything and start the engine. `progress(done, total)` is called as
/// layers are placed.
pub fn boot(opts: &BootOptions, mut progress: impl FnMut(usize, usize)) -> Result<Booted, BootError> {
    let ckpt = Checkpoint::open(&opts.model)?;
    let tokenizer = load_tokenizer(&ckpt)?;
    let template = ChatTemplate::for_checkpoint(tokenizer.chat_template(), tokenizer.bos_token(), tokenizer.eos_token())?;
    let cfg = ckpt.config().clone();
    let backend = CpuBackend::new();
    let total = cfg.num_layers + 2;
    let mut done = 0;
    let model = Model::load(&backend, &ckpt, |n| {
        done += n;
        progress(done, total);
    })?;
    let context_len = opts.context_len.unwrap_or(cfg.max_position_embeddings).max(1);
    if opts.page_size == 0 || opts.max_running == 0 || opts.max_batched_tokens == 0 {
        return Err(BootError::Config("page size, max running requests and max batched tokens must be positive".into()));
    }
    // The CPU keeps KV in f32: bytes per page across all layers.
    let page_bytes = model.kv_bytes_per_token(4) * opts.page_size;
    let budget_pages = (opts.kv_budget.get() / page_bytes as u64) as usize;
    // No point holding more than every running sequence at full context.
    let useful = opts.max_running * context_len.div_ceil(opts.page_size);
    let num_pages = budget_pages.min(useful);
    if num_pages == 0 {
        return Err(BootError::Config(format!(
            "a KV budget of {} holds no page of {} tokens ({} each): raise --kv-cache-mib",
            opts.kv_budget,
            opts.page_size,
            Bytes(page_bytes as u64)
        )));
    }
    tracing::info!(
        pages = num_pages,
        tokens = num_pages * opts.page_size,
        page_bytes,
        bound = if budget_pages <= useful { "kv budget" } else { "max running × context" },
        "KV pool sized"
    );
    let engine = spawn(
        backend,
        model,
        EngineConfig {
            scheduler: SchedulerConfig { max_running: opts.max_running, max_batched_tokens: opts.max_batched_tokens, context_len },
            page_size: Tokens(opts.page_size),
            num_pages: Pages(num_pages),
        },
    )?;
    let model_name = opts
        .model
        .file_name()
        .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
        .unwrap_or_else(|| "model".to_string());
    Ok(Booted { engine, tokenizer: Arc::new(tokenizer), template: Arc::new(template), model_name, checkpoint_path: opts.model.clone() })
}
