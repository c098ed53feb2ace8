//! `corridor plan`: solve a parallel layout on cards and print it, without
//! placing any weight on any device.
//!
//! Reads only the checkpoint's shape, measures (or, for sim cards, takes) each
//! card's free memory, and prints the solved layout, each card's ledger posts
//! and the group's token capacity next to what an even split would give.

use anyhow::{bail, Context, Result};
use corridor_model::layout::{self, CardRoom, CostModel, LayoutSpec, Plan, Split};
use corridor_model::Checkpoint;
use corridor_units::{Bytes, CardId, Tokens};
use corridor_vram::ledger::{CardLedger, PostKind, Provenance};
use corridor_vram::GovernorConfig;
use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone)]
pub struct PlanArgs {
    /// A Hugging Face model directory or a .gguf file (only its shape is read), or a model name
    /// as `serve --model` takes it.
    #[arg(long)]
    pub model: PathBuf,
    /// The branch, tag or commit of a Hugging Face repository named by --model.
    #[arg(long, default_value = "main")]
    pub revision: String,
    /// The cards, one per rank: `sim:32GiB,20GiB,20GiB` (simulated cards of those sizes).
    #[arg(long)]
    pub devices: String,
    /// Tensor-parallel ranks.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Head and FFN shares per TP rank: `a,b,c`, `even` or `auto`.
    #[arg(long, default_value = "even")]
    pub tp_ratio: String,
    /// Pipeline stages.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Layers per PP stage: `a,b,c`, `even` or `auto`.
    #[arg(long, default_value = "even")]
    pub pp_layers: String,
    /// Per-card floor in MiB (`N` for all cards or `N,N,...`).
    #[arg(long)]
    pub floor_mib: Option<String>,
    /// Per-card cap on what corridor holds, in MiB (`N` or `N,N,...`).
    #[arg(long)]
    pub card_budget_mib: Option<String>,
    /// Tokens per KV page.
    #[arg(long, default_value_t = 16)]
    pub page_size: usize,
    /// Token rows one step may process (sizes the workspace).
    #[arg(long, default_value_t = 512)]
    pub max_batched_tokens: usize,
    /// Requests that may run at once (sizes the logits workspace).
    #[arg(long, default_value_t = 32)]
    pub max_running_requests: usize,
    /// Bytes per KV element on the cards (2 for bf16).
    #[arg(long, default_value_t = 2)]
    pub kv_elem_bytes: u64,
    /// Plan a flipping group (`serve --phase-flip`): a tensor layout and a pipeline layout over all
    /// the cards, both resident, each KV page holding both layouts' shares. `--tp-ratio` and
    /// `--pp-layers` give the splits; `--tp` and `--pp` are not used.
    #[arg(long)]
    pub phase_flip: bool,
}

/// Parse `sim:32GiB,20GiB,20GiB` into card sizes.
fn parse_devices(text: &str) -> Result<Vec<Bytes>> {
    let Some(sizes) = text.strip_prefix("sim:") else {
        bail!("--devices '{text}': only simulated cards (sim:SIZE,SIZE,...) can be planned in this build; GPUs need the cuda build")
    };
    sizes.split(',').map(|s| Bytes::parse_size(s).map_err(|e| anyhow::anyhow!("--devices: {e}"))).collect()
}

pub fn run(args: &PlanArgs) -> Result<()> {
    let ckpt = Checkpoint::open(&args.model).with_context(|| format!("opening {}", args.model.display()))?;
    let cfg = ckpt.config().clone();
    let sizes = parse_devices(&args.devices)?;
    let governor =
        GovernorConfig::from_flags(sizes.len(), args.floor_mib.as_deref(), args.card_budget_mib.as_deref())?;
    let cards: Vec<CardRoom> = sizes
        .iter()
        .enumerate()
        .map(|(i, &total)| {
            let s = governor.card(CardId(i as u32));
            CardRoom {
                card: CardId(i as u32),
                free: total,
                floor: s.arming_floor(),
                margin: corridor_vram::sizing::DEFAULT_MARGIN,
                budget: s.budget,
                granularity: corridor_vram::sim::SIM_GRANULARITY,
            }
        })
        .collect();
    let weight_dtype = layout::card_weight_dtype(&ckpt);
    let granule = layout::ffn_granule(weight_dtype);
    let cost = CostModel {
        weight_dtype,
        kv_elem_bytes: args.kv_elem_bytes,
        page_size: Tokens(args.page_size),
        max_rows: args.max_batched_tokens,
        max_logit_rows: args.max_running_requests,
        chunk_target: layout::DEFAULT_CHUNK_TARGET,
    };
    if args.phase_flip {
        return plan_flipping(args, &cfg, &cards, &cost, granule);
    }
    let spec = LayoutSpec {
        tp: args.tp,
        tp_split: args.tp_ratio.parse()?,
        pp: args.pp,
        pp_split: args.pp_layers.parse()?,
    };
    let plan = layout::solve(&cfg, &spec, &cards, &cost, granule)?;
    let even_spec = LayoutSpec { tp_split: Split::Even, pp_split: Split::Even, ..spec.clone() };
    let even = layout::solve(&cfg, &even_spec, &cards, &cost, granule)?;
    println!(
        "model {} ({} layers, {} heads, {} KV heads, FFN {}, weights {})",
        args.model.display(),
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.intermediate_size,
        weight_dtype
    );
    println!("layout: {}", plan.layout.describe());
    print_ledger(&plan);
    println!(
        "group token capacity: {} ({} pages of {})",
        plan.tokens().get(),
        plan.group_pages.get(),
        args.page_size
    );
    println!("even split [{}]: {} tokens", even.layout.describe(), even.tokens().get());
    Ok(())
}

fn print_ledger(plan: &Plan) {
    for (i, r) in plan.ranks.iter().enumerate() {
        let modeled =
            |what: &str| Provenance::Modeled { inputs: vec![("from".to_string(), what.to_string())] };
        let mut l = CardLedger::new(r.card.card, r.card.free, Bytes::ZERO, Bytes::ZERO);
        l.post(PostKind::Weights, r.weights, modeled("the rank's slice of the checkpoint"))
            .post(PostKind::Workspace, r.workspace, modeled("max batched tokens x slice widths"))
            .post(PostKind::State, r.state, modeled("max running requests x recurrent state per request"))
            .post(PostKind::Kv, plan.kv_committed(i), modeled("group pages in whole chunks"))
            .post(
                PostKind::Floor,
                r.card.floor + r.card.margin,
                Provenance::Declared { by: "floor + margin".to_string() },
            );
        let v = l.fits();
        println!(
            "{} ({}): {} | fits {} | own capacity {} pages | rests {} above floor + margin",
            r.rank,
            r.card.card,
            l.posts.iter().map(|p| format!("{} {}", p.kind.name(), p.bytes)).collect::<Vec<_>>().join(", "),
            v.fits,
            r.own_pages.get(),
            plan.rest(i).saturating_sub(r.card.floor + r.card.margin)
        );
    }
}

/// `--phase-flip`: both layouts on the cards and what each card holds of them.
fn plan_flipping(
    args: &PlanArgs,
    cfg: &corridor_model::ModelConfig,
    cards: &[CardRoom],
    cost: &CostModel,
    granule: usize,
) -> Result<()> {
    let n = cards.len();
    if n < 2 {
        bail!("--phase-flip needs two cards or more; --devices names {n}");
    }
    let tp = LayoutSpec { tp: n, tp_split: args.tp_ratio.parse()?, pp: 1, pp_split: Split::Even };
    let pp = LayoutSpec { tp: 1, tp_split: Split::Even, pp: n, pp_split: args.pp_layers.parse()? };
    let plan = layout::solve_flipping(cfg, &tp, &pp, cards, cost, granule)?;
    println!("flipping group: both layouts resident, one rank per card");
    println!("  tensor layout:   {}", plan.tensor.layout.describe());
    println!("  pipeline layout: {}", plan.pipeline.layout.describe());
    for (i, c) in plan.cards.iter().enumerate() {
        let (t, p) = (&plan.tensor.ranks[i], &plan.pipeline.ranks[i]);
        let kv = c.chunk.map_or(Bytes::ZERO, |g| {
            Bytes(plan.group_pages.get().div_ceil(g.chunk_pages) as u64 * g.chunk_bytes.get())
        });
        let rest = c.card.free.saturating_sub(c.weights + c.workspace + kv + c.card.floor + c.card.margin);
        println!(
            "{} ({}): weights {} (tensor {} + pipeline {}), workspace {}, KV page {} (tensor {} + pipeline {}), \
             KV {kv}, fits {}, own capacity {} pages, rests {rest} above floor + margin",
            t.rank,
            c.card.card,
            c.weights,
            t.weights,
            p.weights,
            c.workspace,
            c.page_bytes,
            cost.page_bytes(cfg, &plan.tensor.layout.ranks[i]),
            cost.page_bytes(cfg, &plan.pipeline.layout.ranks[i]),
            c.fits,
            c.own_pages.get(),
        );
    }
    println!(
        "group token capacity: {} ({} pages of {}); the tensor layout alone would hold {}",
        plan.group_pages.get() * args.page_size,
        plan.group_pages.get(),
        args.page_size,
        plan.tensor.tokens().get()
    );
    Ok(())
}
