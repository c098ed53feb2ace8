//! The `corridor` command: flags are parsed once here into frozen options,
//! then handed to the layer that acts on them.

mod generate;
mod logging;
mod memory;
mod plan;
mod pull;
mod resolve;
mod tuning;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

/// An OpenAI-compatible LLM server that fills every card to its limit and never past it.
#[derive(Parser, Debug)]
#[command(name = "corridor", version)]
struct Cli {
    /// Where downloaded models and compiled GPU kernels are cached (default: $XDG_CACHE_HOME/corridor
    /// or ~/.cache/corridor).
    #[arg(long, global = true, env = "CORRIDOR_CACHE_DIR")]
    cache_dir: Option<PathBuf>,
    /// Log filter, e.g. `info`, `debug`, `corridor_engine=debug` (RUST_LOG syntax);
    /// `info,corridor::step=trace` adds a line per engine step (its prompt and decode rows and where
    /// its time went: scheduling, the forward pass, sampling).
    #[arg(long, global = true, default_value = "info", env = "CORRIDOR_LOG")]
    log: String,
    /// Log lines as human-readable `text` or as `json` objects, one per line.
    #[arg(long, global = true, value_enum, default_value_t = logging::LogFormat::Text)]
    log_format: logging::LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve a model over the OpenAI HTTP API.
    Serve(ServeArgs),
    /// Generate text for one prompt and stream it to stdout.
    Generate(GenerateArgs),
    /// Fetch a model by name (`corridor pull org/name[:QUANT]`) or, without one, the default model
    /// (SmolLM2-135M-Instruct, GGUF Q4_1, 98 MB) into the cache, and print its path.
    Pull(PullArgs),
    /// Drive any OpenAI-compatible server with a workload and report throughput and latency.
    Bench(corridor_bench::BenchArgs),
    /// Show where every byte on every card goes: a running server's /v1/memory, or recorded boots.
    Memory(memory::MemoryArgs),
    /// Solve a parallel layout for a model on a set of cards, without loading any weights.
    Plan(plan::PlanArgs),
}

/// How the CPU's KV cache stores K and V (`--cpu-kv-dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum CpuKvDtype {
    Auto,
    F16,
    F32,
}

/// Model and engine sizing shared by `serve` and `generate`.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    #[command(flatten)]
    cuda: tuning::CudaFlags,
    /// The model: a Hugging Face directory (config.json, safetensors, tokenizer.json) or a .gguf
    /// file; or a name: `org/name` (a Hugging Face repository), `org/name:Q4_K_M` (one GGUF file of
    /// a repository, by its quantization tag), `ollama:NAME[:TAG]` or `NAME:TAG` (ollama's local
    /// store). A name is looked up in the Hugging Face cache (HF_HUB_CACHE, HF_HOME/hub,
    /// ~/.cache/huggingface/hub), then ollama's store (OLLAMA_MODELS, ~/.ollama/models), and
    /// otherwise downloaded from the hub (HF_ENDPOINT; HF_TOKEN or the `huggingface-cli login`
    /// token for gated repositories; HF_HUB_OFFLINE=1 never downloads). A path that exists always
    /// wins. Without it, the default model is used (and fetched on first use).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The branch, tag or commit of a Hugging Face repository named by --model.
    #[arg(long, default_value = "main")]
    revision: String,
    /// Requests that may run at once (continuous batching).
    #[arg(long, default_value_t = 32)]
    max_running_requests: usize,
    /// Token rows one engine step may process (the chunked-prefill budget).
    #[arg(long, default_value_t = 512)]
    max_batched_tokens: usize,
    /// Inter-token latency, in ms, that running streams should keep while prompts prefill (0 = no
    /// bound). Every stream waits for the whole step, so a step carrying a long prompt chunk is a
    /// stall for all of them: while any stream decodes, a step takes only the prompt rows that a
    /// cost model learned from measured step times predicts fit in this target (at least 16 rows,
    /// so prompts always progress); with nothing decoding, a step takes all --max-batched-tokens.
    /// The trade-off: a lower target smooths streaming (ITL p99) but spreads a long prompt over
    /// more steps, so its time to first token grows; a higher one or 0 finishes prompts sooner
    /// and lets them stall the streams. The default 38 kept an 8B model's ITL p99 at concurrency
    /// 128 within 2.9 times its median on an H200 (50: 3.8 times) at the same throughput.
    #[arg(long, default_value_t = corridor_engine::step_budget::DEFAULT_ITL_TARGET.as_millis() as u64)]
    itl_target_ms: u64,
    /// A second bound beside --itl-target-ms, relative to the card's own pace (0 = none, the
    /// default): while streams decode, a step that carries prompt rows is predicted to take at
    /// most this many times the decode-only step of the batch being served (the running requests
    /// and the waiting ones that will join them). The smaller of the two bounds decides. At 3, an
    /// 8B model at batch 128 (about 15 ms a step) keeps its gaps under about 45 ms, and a lone
    /// stream at batch 1 (about 5.6 ms) under about 17 ms where 38 ms alone allows a 7x stall; the
    /// cost is more, smaller prompt chunks: on an H100 at concurrency 128 it took ITL p99 from 3.5
    /// to 2.1 times its median and lost 4-7% of the throughput (BENCHMARKS.md).
    #[arg(long, default_value_t = 0.0, value_parser = parse_stall_ratio)]
    itl_stall_ratio: f64,
    /// Longest sequence (prompt + output) in tokens. Default: the model's trained context.
    #[arg(long)]
    context_length: Option<usize>,
    /// On `--devices cpu`: the most host memory the KV cache may take, in MiB (on cards, KV is
    /// sized from the measured free memory above the floor instead).
    #[arg(long, default_value_t = 1024)]
    kv_cache_mib: u64,
    /// Worker threads for the CPU kernels (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// On a CPU with AVX-512 VNNI, hold weights of the block formats Q4_0, Q4_1, Q5_0, Q5_1,
    /// Q8_0, Q4_K, Q5_K and Q6_K in tiles of 16 rows, so decode advances 16 rows' dot products per instruction
    /// (`on`, the default); `off` keeps them as the file stores them (memory-mapped) and dots
    /// one row at a time with AVX2. Loading repacks them into memory of the same size (a K-quant's
    /// 3% more).
    #[arg(long, value_enum, default_value_t = tuning::Switch::On, env = "CORRIDOR_CPU_ROW_TILES", value_name = "on|off")]
    cpu_row_tiles: tuning::Switch,
    /// How the CPU's KV cache stores K and V: `auto` (the default) keeps f32 for a checkpoint whose
    /// matrices are f32 and stores f16 for every other (half the bytes a token: twice the context in
    /// `--kv-cache-mib`, and half the bytes each decode step reads); `f32` or `f16` chooses.
    #[arg(long, value_enum, default_value_t = CpuKvDtype::Auto, env = "CORRIDOR_CPU_KV_DTYPE", value_name = "auto|f16|f32")]
    cpu_kv_dtype: CpuKvDtype,
    /// Cards to run on: `cpu`; `cuda:0` (an NVIDIA GPU by ordinal or `cuda:GPU-<uuid>`; needs a
    /// build with `--features cuda`, and the driver, cuBLAS and NVRTC libraries at run time); or
    /// `sim:32GiB,20GiB,20GiB` (simulated cards: CPU compute, card memory simulated, so the memory
    /// governor runs exactly as on GPUs).
    #[arg(long, default_value = "cpu")]
    devices: String,
    /// Free memory each card must keep at every instant, in MiB: one value for all cards or one
    /// per card (`1024,2048`). corridor never allocates below it and gives memory back when
    /// another process grows into it.
    #[arg(long)]
    floor_mib: Option<String>,
    /// The most corridor itself may hold on each card, in MiB (one value or one per card).
    /// Enforced, not advisory: use it to share a card or to emulate a smaller one.
    #[arg(long)]
    card_budget_mib: Option<String>,
    /// Write flight-recorder marks (JSON lines: boot phases, then every 30 s while serving) here;
    /// `corridor memory --flight-dir DIR` reads them.
    #[arg(long)]
    flight_dir: Option<PathBuf>,
    /// Tensor-parallel ranks. On `--devices cpu` they are threads sharing the host; on cards
    /// (`cuda:0,1`, `sim:...`) rank i runs on the i-th card listed, GPUs joined by NCCL, and the
    /// KV pool is the largest every card holds above its floor.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Head and FFN shares per TP rank: `a,b,c` (head counts when they sum to the model's heads),
    /// `even`, or `auto` (solved on the cards' measured free memory and budgets for the largest
    /// token capacity).
    #[arg(long, default_value = "even")]
    tp_ratio: String,
    /// Pipeline stages, placed like `--tp` ranks (one per card when `--devices` lists cards).
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// Layers per PP stage: `a,b,c`, `even`, or `auto` (solved on the cards like `--tp-ratio`).
    #[arg(long, default_value = "even")]
    pp_layers: String,
    /// Hold a tensor-parallel and a pipeline-parallel layout of the model over the cards (one
    /// rank per card; both layouts' weights resident, each KV page holding both layouts' shares)
    /// and flip between them while serving, carrying the running requests: `off` (one layout,
    /// `--tp`/`--pp`), `manual` (`POST /v1/admin/layout {"layout":"pp"}` flips), `auto` (the
    /// policy flips to pipeline parallel for prefill bursts and back to tensor parallel to
    /// decode). `--tp-ratio` and `--pp-layers` give the two splits. Sim cards only for now.
    #[arg(long, default_value = "off", value_parser = ["off", "manual", "auto"])]
    phase_flip: String,
    /// Draw decode tokens on the GPU (`on`): a row without log-probabilities or a grammar is
    /// sanitized, penalized and sampled where its logits are, and only its token id comes back
    /// instead of the whole vocabulary row. `off` copies every row to the host sampler (an A/B of
    /// the two). Single-GPU serving only; other layouts and the CPU sample on the host.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    device_sampling: String,
    /// Scheduled foreign processes on sim cards: JSON lines such as
    /// `{"at_s": 5.0, "card": 0, "pid": 4242, "bytes": 2147483648}` (`"bytes": 0` = it exited).
    #[arg(long)]
    sim_events: Option<PathBuf>,
    /// The link between sim cards of a layout: `BANDWIDTH,LATENCY`, e.g. `16GB/s,5us` (PCIe 4.0
    /// x16-like). Every activation a rank sends pays latency + bytes / bandwidth (the bytes are the
    /// f32 values CPU ranks exchange), an all-reduce or all-gather a ring's cost. Bandwidth in
    /// B/s, KB/s, MB/s, GB/s (powers of 1000), KiB/s, MiB/s, GiB/s, Mbit/s or Gbit/s; latency in
    /// ns, us, ms or s. Also applies to CPU ranks on `--devices cpu`. Default: free, as between
    /// threads.
    #[arg(long)]
    sim_link: Option<corridor_backend::collective::LinkModel>,
}

#[derive(Args, Debug)]
struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to bind. The default keeps the server private to this machine.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model name clients send and /v1/models lists (default: the checkpoint's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health. Never logged.
    #[arg(long, env = "CORRIDOR_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Let browser pages from this origin call the API (CORS), e.g. `http://localhost:3000`;
    /// repeat for more, or `*` for any. Without it no CORS headers are sent.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    cors_origins: Vec<String>,
    #[command(flatten)]
    sampling: SamplingFlags,
}

/// Defaults for requests that leave a sampling field out. Each field is taken from the request,
/// else from this flag, else from the model (`generation_config.json`, or a GGUF file's
/// `general.sampling.*`), else from the built-in default (chosen so small models answer and stop).
#[derive(Args, Debug, Clone, Default)]
struct SamplingFlags {
    /// Default sampling temperature, in [0, 2]; 0 is greedy (built-in: 0.2).
    #[arg(long, help_heading = "Sampling defaults")]
    temperature: Option<f32>,
    /// Default nucleus cut-off, in (0, 1]; 1 disables it (built-in: 0.9).
    #[arg(long, help_heading = "Sampling defaults")]
    top_p: Option<f32>,
    /// Default top-k cut-off; -1 or 0 disable it (built-in: off).
    #[arg(long, allow_hyphen_values = true, help_heading = "Sampling defaults")]
    top_k: Option<i64>,
    /// Default min-p cut-off relative to the top token, in [0, 1]; 0 disables it (built-in: 0.05).
    #[arg(long, help_heading = "Sampling defaults")]
    min_p: Option<f32>,
    /// Default repetition penalty, > 0; 1 disables it (built-in: 1.1).
    #[arg(long, help_heading = "Sampling defaults")]
    repetition_penalty: Option<f32>,
}

impl SamplingFlags {
    fn preferences(&self) -> corridor_server::defaults::SamplingPreferences {
        corridor_server::defaults::SamplingPreferences {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
        }
    }
}

#[derive(Args, Debug)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as one user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Tokens to generate at most (default: until an end token or the context end).
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches this.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Seed for a reproducible random stream.
    #[arg(long)]
    seed: Option<u64>,
    /// Keep generating past end-of-sequence tokens (for measuring speed at a fixed length).
    #[arg(long)]
    ignore_eos: bool,
    /// Run this many copies of the prompt at once (decode at a batch, without HTTP); the first
    /// copy's text is printed, the rate counts every copy's tokens. Copies after the first differ
    /// in the prompt's second token (so they share no cached prefix and each reads KV of its own)
    /// and draw from seeds after `--seed`'s.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    batch: u32,
}

#[derive(Args, Debug)]
struct PullArgs {
    /// The model to fetch or find, named as `--model` names it (`org/name`, `org/name:Q4_K_M`,
    /// `ollama:NAME:TAG`; see `serve --help`); without it, the default model. Prints the path to load.
    model: Option<PathBuf>,
    /// The branch, tag or commit of the Hugging Face repository.
    #[arg(long, default_value = "main")]
    revision: String,
    /// Download again even if the model is cached.
    #[arg(long)]
    force: bool,
}

impl ModelArgs {
    /// Resolve the model path (fetching the default model if needed) and the
    /// engine options.
    fn boot_options(&self, cache: &std::path::Path) -> Result<corridor_server::boot::BootOptions> {
        if let Some(t) = self.threads {
            rayon::ThreadPoolBuilder::new().num_threads(t.max(1)).build_global()?;
        }
        let path = match &self.model {
            Some(p) => resolve::model_arg(p, &self.revision, cache, false)?.path,
            None => pull::ensure_default_model(cache, false)?,
        };
        let mut o = corridor_server::boot::BootOptions::new(path);
        o.cuda_tuning = self.cuda.tuning();
        o.cpu_row_tiles = self.cpu_row_tiles.on();
        o.cpu_kv = match self.cpu_kv_dtype {
            CpuKvDtype::Auto => None,
            CpuKvDtype::F16 => Some(corridor_backend::cpu::KvPrecision::F16),
            CpuKvDtype::F32 => Some(corridor_backend::cpu::KvPrecision::F32),
        };
        o.max_running = self.max_running_requests;
        o.max_batched_tokens = self.max_batched_tokens;
        o.itl = corridor_engine::step_budget::ItlBound {
            target: (self.itl_target_ms > 0).then(|| std::time::Duration::from_millis(self.itl_target_ms)),
            stall_ratio: (self.itl_stall_ratio > 0.0).then_some(self.itl_stall_ratio),
        };
        o.context_len = self.context_length;
        o.kv_budget = corridor_units::Bytes::mib(self.kv_cache_mib);
        o.devices = corridor_server::boot::Devices::parse(&self.devices).map_err(anyhow::Error::msg)?;
        o.floor_mib = self.floor_mib.clone();
        o.card_budget_mib = self.card_budget_mib.clone();
        o.flight_dir = self.flight_dir.clone();
        o.sim_events = self.sim_events.clone();
        if self.sim_link.is_some() && matches!(o.devices, corridor_server::boot::Devices::Cuda(_)) {
            anyhow::bail!("--sim-link models the link between sim cards and CPU ranks; GPUs use their own");
        }
        o.sim_link = self.sim_link;
        o.kernel_cache = Some(cache.join("kernels"));
        o.device_sampling = self.device_sampling == "on";
        o.phase_flip = self.phase_flip.parse().map_err(anyhow::Error::msg)?;
        if o.phase_flip != corridor_engine::flips::FlipMode::Off {
            o.flip_splits = Some(corridor_model::layout::LayoutSpec {
                tp: 1,
                tp_split: self.tp_ratio.parse().map_err(|e| anyhow::anyhow!("--tp-ratio: {e}"))?,
                pp: 1,
                pp_split: self.pp_layers.parse().map_err(|e| anyhow::anyhow!("--pp-layers: {e}"))?,
            });
            if self.tp > 1 || self.pp > 1 {
                anyhow::bail!(
                    "--phase-flip puts one rank on every card in both layouts: leave out --tp and --pp (their splits come from --tp-ratio and --pp-layers)"
                );
            }
        } else if self.tp > 1 || self.pp > 1 {
            o.layout = Some(corridor_model::layout::LayoutSpec {
                tp: self.tp,
                tp_split: self.tp_ratio.parse().map_err(|e| anyhow::anyhow!("--tp-ratio: {e}"))?,
                pp: self.pp,
                pp_split: self.pp_layers.parse().map_err(|e| anyhow::anyhow!("--pp-layers: {e}"))?,
            });
        }
        Ok(o)
    }
}

impl ModelArgs {
    /// `--model` when it is a name rather than a path that exists.
    fn name_for_serving(&self) -> Option<String> {
        self.model.as_ref().filter(|m| !m.exists()).map(|m| m.to_string_lossy().to_string())
    }
}

/// Boot with a progress bar over the layers.
fn boot_with_progress(opts: &corridor_server::boot::BootOptions) -> Result<corridor_server::boot::Booted> {
    let bar = indicatif::ProgressBar::new(0)
        .with_style(indicatif::ProgressStyle::with_template("loading {msg} {bar:40} {pos}/{len} layers")?);
    bar.set_message(opts.model.display().to_string());
    let _shown = logging::show_progress(&bar);
    let booted = corridor_server::boot::boot(opts, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish_and_clear();
    Ok(booted?)
}

fn main() {
    tuning::nccl_environment();
    let cli = Cli::parse();
    logging::init(&cli.log, cli.log_format);
    if let Err(e) = run(cli) {
        // One line a person can act on; the chain says why.
        let chain: Vec<String> = e.chain().map(|c| c.to_string()).collect();
        eprintln!("error: {}", chain.join(": "));
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    let cache = cli.cache_dir.clone().unwrap_or_else(pull::default_cache_dir);
    match cli.command {
        Command::Pull(a) => {
            let p = match &a.model {
                Some(m) => resolve::model_arg(m, &a.revision, &cache, a.force)?.path,
                None => pull::ensure_default_model(&cache, a.force)?,
            };
            println!("{}", p.display());
            Ok(())
        }
        Command::Generate(a) => generate::run(&a, &cache),
        Command::Serve(a) => {
            let sampling = a.sampling.preferences();
            // Checked before the model loads, so a typo fails at once.
            sampling.validate().map_err(|e| anyhow::anyhow!("--{}: {e}", e.param.replace('_', "-")))?;
            // Bound before the model loads: a busy port fails now, not after the load.
            let listener = corridor_server::bind(&a.host, a.port)?;
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            // While the model loads, the address answers 503 "loading" instead of
            // leaving connections unanswered in the backlog.
            let (loaded, wait_loaded) = tokio::sync::oneshot::channel::<()>();
            let loading = rt.spawn(corridor_server::serve_while_loading(listener.try_clone()?, async {
                let _ = wait_loaded.await;
            }));
            let booted = a.model.boot_options(&cache).and_then(|opts| boot_with_progress(&opts));
            let _ = loaded.send(());
            rt.block_on(loading)??;
            let booted = booted?;
            let cfg = corridor_server::http::ServerConfig {
                host: a.host,
                port: a.port,
                // A model asked for by name is served under that name.
                served_model_name: a.served_model_name.or_else(|| a.model.name_for_serving()),
                api_key: a.api_key,
                sampling,
                cors_origins: a.cors_origins,
                ..Default::default()
            };
            rt.block_on(corridor_server::run_on(listener, booted, cfg, corridor_server::shutdown_signal()))?;
            Ok(())
        }
        Command::Memory(a) => memory::run(&a),
        Command::Plan(mut a) => {
            a.model = resolve::model_arg(&a.model, &a.revision, &cache, false)?.path;
            plan::run(&a)
        }
        Command::Bench(a) => {
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let report = rt.block_on(corridor_bench::run(a))?;
            println!("{}", corridor_bench::render_table(&report));
            Ok(())
        }
    }
}

/// `--itl-stall-ratio`: 0 (no such bound) or a finite ratio of at least 1 (no step with a prompt
/// can take less than the decodes' step without one).
fn parse_stall_ratio(s: &str) -> Result<f64, String> {
    let r: f64 = s.parse().map_err(|e| format!("not a number: {e}"))?;
    if r == 0.0 || (r.is_finite() && r >= 1.0) {
        Ok(r)
    } else {
        Err(format!("{s}: use 0 (no bound) or a ratio of at least 1"))
    }
}
