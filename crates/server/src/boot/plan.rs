//! The boot plan: the command line's [`BootOptions`] parsed once into typed,
//! immutable values (the cards, each card's floor and budget as [`Bytes`],
//! the rank group, the limits), and every check that needs no card or
//! checkpoint done here, before anything is opened. The boot sequence reads
//! only the plan.

use super::{BootError, BootOptions, Devices};
use corridor_engine::flips::FlipMode;
use corridor_model::layout::{LayoutSpec, Split};
use corridor_units::{Bytes, Tokens};
use corridor_vram::config::parse_mib_list;
use corridor_vram::{parse_sim_events, CardSettings, ConfigError, CudaSelection, GovernorConfig, SimEvent};
use std::path::PathBuf;
use std::time::Duration;

/// What the host card is taken to hold (the CPU backend's memory).
pub const HOST_CARD_BYTES: Bytes = Bytes::gib(16);

/// The cards to open.
#[derive(Clone, Debug, PartialEq)]
pub enum CardsPlan {
    /// The host: CPU compute; KV held to `kv_budget` of host memory.
    Host { total: Bytes, kv_budget: Bytes },
    /// Simulated cards: CPU compute, simulated memory, foreign processes on a schedule.
    Sim { sizes: Vec<Bytes>, carve_out: Bytes, events: Vec<SimEvent> },
    /// NVIDIA GPUs: CUDA compute.
    Cuda(CudaSelection),
}

impl CardsPlan {
    /// How many cards, where known before they are opened (`cuda` names
    /// every visible device).
    pub fn count(&self) -> Option<usize> {
        match self {
            CardsPlan::Host { .. } => Some(1),
            CardsPlan::Sim { sizes, .. } => Some(sizes.len()),
            CardsPlan::Cuda(CudaSelection::All) => None,
            CardsPlan::Cuda(CudaSelection::Devices(d)) => Some(d.len()),
        }
    }
}

/// Each card's floor and budget: one value for every card or one per card.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CardLimits {
    /// `None`: the governor's default floor.
    pub floors: Option<Vec<Bytes>>,
    /// `None`: no budget.
    pub budgets: Option<Vec<Bytes>>,
    pub sample_interval: Option<Duration>,
    pub kv_hold: Option<Duration>,
    pub serving_mark_interval: Option<Duration>,
}

impl CardLimits {
    /// The governor's settings for `cards` cards.
    pub fn governor(&self, cards: usize) -> Result<GovernorConfig, BootError> {
        let spread = |flag: &'static str, values: &[Bytes]| match values.len() {
            1 => Ok(vec![values[0]; cards]),
            n if n == cards => Ok(values.to_vec()),
            n => Err(ConfigError::WrongCount { flag, given: n, cards }),
        };
        let mut config = GovernorConfig::uniform(cards, CardSettings::default());
        let config_error = |e: ConfigError| BootError::Config(e.to_string());
        if let Some(floors) = &self.floors {
            for (s, f) in config.cards.iter_mut().zip(spread("--floor-mib", floors).map_err(config_error)?) {
                s.floor = f;
            }
        }
        if let Some(budgets) = &self.budgets {
            for (s, b) in
                config.cards.iter_mut().zip(spread("--card-budget-mib", budgets).map_err(config_error)?)
            {
                s.budget = Some(b);
            }
        }
        if let Some(i) = self.sample_interval {
            config.sample_interval = i;
        }
        if let Some(h) = self.kv_hold {
            config.kv_hold = h;
        }
        if let Some(i) = self.serving_mark_interval {
            config.serving_mark_interval = i;
        }
        config.validate(cards).map_err(config_error)?;
        Ok(config)
    }
}

/// How the model is spread over the cards.
#[derive(Clone, Debug, PartialEq)]
pub enum GroupPlan {
    /// The whole model as one rank on card 0: the trivial layout.
    One,
    /// A parallel layout of several ranks: rank `i` on card `i`, or threads
    /// sharing the host card.
    Layout(LayoutSpec),
    /// A tensor and a pipeline layout over the same cards (one rank per
    /// card holding both), flipping between them.
    Flipping { tensor: LayoutSpec, pipeline: LayoutSpec, mode: FlipMode, min_dwell: Duration },
}

/// The engine's limits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    /// Sequences that may run at once.
    pub max_running: usize,
    /// Token rows per step.
    pub max_batched_tokens: usize,
    pub page_size: Tokens,
    /// Longest sequence; `None`: the model's trained context.
    pub context_len: Option<Tokens>,
    /// What running decodes' inter-token latency keeps.
    pub itl: corridor_engine::step_budget::ItlBound,
}

/// The CUDA backend's settings.
#[derive(Clone, Debug)]
pub struct CudaPlan {
    pub tuning: corridor_backend::CudaTuning,
    pub kernel_cache: Option<PathBuf>,
}

/// Everything boot does, decided before anything is opened.
#[derive(Clone, Debug)]
pub struct BootPlan {
    /// A Hugging Face directory or a `.gguf` file.
    pub model: PathBuf,
    pub cards: CardsPlan,
    pub card_limits: CardLimits,
    pub group: GroupPlan,
    pub limits: Limits,
    pub cuda: CudaPlan,
    /// What a transfer between CPU ranks costs (`None`: nothing).
    pub sim_link: Option<corridor_backend::collective::LinkModel>,
    /// CPU ranks hold 32-weight block formats in tiles of 16 rows (`--cpu-row-tiles`).
    pub cpu_row_tiles: bool,
    /// How CPU ranks store K and V (`None`: as the checkpoint's matrices warrant).
    pub cpu_kv: Option<corridor_backend::cpu::KvPrecision>,
    pub flight_dir: Option<PathBuf>,
    /// Draw rows on the GPU where the layout allows (`--device-sampling`).
    pub device_sampling: bool,
}

impl BootPlan {
    /// Parse and check the options.
    pub fn new(opts: &BootOptions) -> Result<BootPlan, BootError> {
        if opts.page_size == 0 || opts.max_running == 0 || opts.max_batched_tokens == 0 {
            return Err(BootError::Config(
                "page size, max running requests and max batched tokens must be positive".into(),
            ));
        }
        let cards = match &opts.devices {
            Devices::Cpu => CardsPlan::Host { total: HOST_CARD_BYTES, kv_budget: opts.kv_budget },
            Devices::Sim(sizes) => {
                let events = match &opts.sim_events {
                    Some(p) => {
                        let bad = |e: String| BootError::Config(format!("--sim-events {}: {e}", p.display()));
                        let text = std::fs::read_to_string(p).map_err(|e| bad(e.to_string()))?;
                        parse_sim_events(&text).map_err(|e| bad(e.to_string()))?
                    }
                    None => Vec::new(),
                };
                CardsPlan::Sim { sizes: sizes.clone(), carve_out: opts.sim_carve_out, events }
            }
            Devices::Cuda(selection) => CardsPlan::Cuda(selection.clone()),
        };
        let mib_list = |flag: &'static str, text: &Option<String>| -> Result<Option<Vec<Bytes>>, BootError> {
            text.as_deref()
                .map(|t| {
                    parse_mib_list(flag, t)
                        .map(|v| v.into_iter().map(Bytes::mib).collect())
                        .map_err(|e| BootError::Config(e.to_string()))
                })
                .transpose()
        };
        let card_limits = CardLimits {
            floors: mib_list("--floor-mib", &opts.floor_mib)?,
            budgets: mib_list("--card-budget-mib", &opts.card_budget_mib)?,
            sample_interval: opts.sample_interval,
            kv_hold: opts.kv_hold,
            serving_mark_interval: opts.serving_mark_interval,
        };
        if let Some(n) = cards.count() {
            // Known now: a count that does not match fails before anything opens.
            card_limits.governor(n)?;
        }
        let group = group_plan(opts, &cards)?;
        Ok(BootPlan {
            model: opts.model.clone(),
            cards,
            card_limits,
            group,
            limits: Limits {
                max_running: opts.max_running,
                max_batched_tokens: opts.max_batched_tokens,
                page_size: Tokens(opts.page_size),
                context_len: opts.context_len.map(Tokens),
                itl: opts.itl,
            },
            cuda: CudaPlan { tuning: opts.cuda_tuning, kernel_cache: opts.kernel_cache.clone() },
            sim_link: opts.sim_link,
            cpu_row_tiles: opts.cpu_row_tiles,
            cpu_kv: opts.cpu_kv,
            device_sampling: opts.device_sampling,
            flight_dir: opts.flight_dir.clone(),
        })
    }
}

/// The rank group of the options, checked against the cards where it can be.
fn group_plan(opts: &BootOptions, cards: &CardsPlan) -> Result<GroupPlan, BootError> {
    if opts.phase_flip != FlipMode::Off {
        let CardsPlan::Sim { sizes, .. } = cards else {
            return Err(BootError::Config(
                "--phase-flip runs on sim cards (--devices sim:32GiB,20GiB,20GiB): CUDA ranks cannot yet copy KV pages \
                 between layouts"
                    .into(),
            ));
        };
        let n = sizes.len();
        if n < 2 {
            return Err(BootError::Config(format!(
                "--phase-flip needs two cards or more; --devices names {n}"
            )));
        }
        let splits = opts.flip_splits.clone().unwrap_or_default();
        return Ok(GroupPlan::Flipping {
            tensor: LayoutSpec { tp: n, tp_split: splits.tp_split, pp: 1, pp_split: Split::Even },
            pipeline: LayoutSpec { tp: 1, tp_split: Split::Even, pp: n, pp_split: splits.pp_split },
            mode: opts.phase_flip,
            min_dwell: opts.flip_dwell,
        });
    }
    let Some(spec) = opts.layout.clone().filter(|l| l.ranks() > 1) else {
        if let Some(n) = cards.count().filter(|&n| n > 1 && matches!(cards, CardsPlan::Cuda(_))) {
            return Err(several_cards_one_rank(n));
        }
        return Ok(GroupPlan::One);
    };
    if !matches!(cards, CardsPlan::Host { .. }) {
        if let Some(n) = cards.count() {
            check_one_rank_per_card(&spec, n)?;
        }
    }
    Ok(GroupPlan::Layout(spec))
}

/// Several CUDA cards and no layout over them.
pub(super) fn several_cards_one_rank(n: usize) -> BootError {
    BootError::Config(format!(
        "--devices names {n} CUDA cards: spread one model over them with --tp N or --pp N (N = {n}), or pick one card (e.g. cuda:0)"
    ))
}

/// A layout over cards of its own runs one rank per card.
pub(super) fn check_one_rank_per_card(spec: &LayoutSpec, cards: usize) -> Result<(), BootError> {
    if cards != spec.ranks() {
        return Err(BootError::Config(format!(
            "--tp {} --pp {} runs {} ranks, one per card, but --devices names {} card(s)",
            spec.tp.max(1),
            spec.pp.max(1),
            spec.ranks(),
            cards
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(devices: &str) -> BootOptions {
        let mut o = BootOptions::new(PathBuf::from("model"));
        o.devices = Devices::parse(devices).unwrap();
        o
    }

    fn config_error(r: Result<BootPlan, BootError>) -> String {
        match r {
            Err(BootError::Config(m)) => m,
            Err(e) => panic!("expected a configuration error, got {e}"),
            Ok(p) => panic!("expected a configuration error, got {p:?}"),
        }
    }

    #[test]
    fn floors_and_budgets_become_bytes_per_card() {
        let mut o = options("sim:4GiB,8GiB");
        o.floor_mib = Some("512,2048".into());
        o.card_budget_mib = Some("3000".into());
        let plan = BootPlan::new(&o).unwrap();
        let g = plan.card_limits.governor(2).unwrap();
        assert_eq!(g.cards[0].floor, Bytes::mib(512));
        assert_eq!(g.cards[1].floor, Bytes::mib(2048));
        assert_eq!(g.cards.iter().map(|c| c.budget).collect::<Vec<_>>(), vec![Some(Bytes::mib(3000)); 2]);
        assert_eq!(plan.group, GroupPlan::One);
        assert_eq!(plan.limits.page_size, Tokens(16));
    }

    #[test]
    fn a_floor_list_of_the_wrong_length_fails_before_anything_opens() {
        let mut o = options("sim:4GiB,8GiB");
        o.floor_mib = Some("512,512,512".into());
        assert!(config_error(BootPlan::new(&o)).contains("--floor-mib"));
        o.floor_mib = Some("lots".into());
        assert!(config_error(BootPlan::new(&o)).contains("--floor-mib"));
    }

    #[test]
    fn a_layout_runs_one_rank_per_card_except_on_the_host() {
        let tp2 = LayoutSpec { tp: 2, tp_split: Split::Even, pp: 1, pp_split: Split::Even };
        let mut o = options("sim:4GiB,4GiB,4GiB");
        o.layout = Some(tp2.clone());
        assert!(config_error(BootPlan::new(&o)).contains("one per card"));
        let mut o = options("cpu");
        o.layout = Some(tp2.clone());
        assert_eq!(BootPlan::new(&o).unwrap().group, GroupPlan::Layout(tp2));
        // A layout of one rank is the trivial one.
        let mut o = options("sim:4GiB");
        o.layout = Some(LayoutSpec::default());
        assert_eq!(BootPlan::new(&o).unwrap().group, GroupPlan::One);
    }

    #[test]
    fn flipping_needs_two_sim_cards_and_holds_both_layouts() {
        let mut o = options("sim:4GiB");
        o.phase_flip = FlipMode::Auto;
        assert!(config_error(BootPlan::new(&o)).contains("two cards"));
        let mut o = options("cuda:0,1");
        o.phase_flip = FlipMode::Auto;
        assert!(config_error(BootPlan::new(&o)).contains("sim cards"));
        let mut o = options("sim:4GiB,4GiB,4GiB");
        o.phase_flip = FlipMode::Auto;
        let GroupPlan::Flipping { tensor, pipeline, mode, .. } = BootPlan::new(&o).unwrap().group else {
            panic!("a flipping group");
        };
        assert_eq!((tensor.tp, tensor.pp, pipeline.tp, pipeline.pp, mode), (3, 1, 1, 3, FlipMode::Auto));
    }

    #[test]
    fn several_cuda_cards_need_a_layout_and_limits_must_be_positive() {
        assert!(config_error(BootPlan::new(&options("cuda:0,1"))).contains("--tp N or --pp N"));
        let mut o = options("cpu");
        o.page_size = 0;
        assert!(config_error(BootPlan::new(&o)).contains("must be positive"));
        let mut o = options("sim:4GiB");
        o.sim_events = Some(PathBuf::from("/nonexistent/events.jsonl"));
        assert!(config_error(BootPlan::new(&o)).contains("--sim-events"));
    }
}
