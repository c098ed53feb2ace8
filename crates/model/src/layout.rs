//! Parallel layouts as data, and the solver that sizes them to the cards.
//!
//! A [`Layout`] maps ranks to slices of the model. Each [`RankSlice`] says
//! which layers, query heads, KV heads, FFN columns and vocabulary rows a rank
//! holds and where its hidden state comes from and goes to; the forward pass
//! reads only that, so nothing in it branches on the number of ranks.
//!
//! - Tensor parallelism (`--tp N --tp-ratio a,b,c|auto`): query heads split by
//!   KV group where the ratios allow; a rank whose heads do not cover whole
//!   groups holds a replica of every KV head its heads need (`kv_heads` may
//!   repeat a head). FFN columns and LM-head vocabulary rows follow the same
//!   ratios (FFN in whole 32-column blocks for block-quantized weights);
//!   embedding and norms are replicated; partial outputs are all-reduced and
//!   the logits all-gathered.
//! - Pipeline parallelism (`--pp N --pp-layers a,b,c|auto`): contiguous layer
//!   ranges; stage 0 embeds, the last stage computes logits, hidden states
//!   travel by send/recv. A stage may hold no layer (a two-layer model on three
//!   stages).
//!
//! The solver ([`solve`]) prices each rank (weights, workspace, KV per token)
//! from the model's shape, sizes every card's pool with the `vram` sizing rule
//! and picks the split whose group capacity — the minimum over ranks, since
//! page ids are shared — is largest. For TP it then moves FFN columns between
//! ranks until every card rests within one KV chunk above floor + margin.

use crate::config::ModelConfig;
use corridor_backend::DType;
use corridor_units::{Bytes, CardId, Pages, Rank, Tokens};
use corridor_vram::arena::ChunkGeometry;
use corridor_vram::sizing::{self, Sizing, SizingInput};
use std::ops::Range;
use std::str::FromStr;

/// Why a layout could not be built or solved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("{what}: '{text}' is not 'auto', 'even' or a list of positive integers like 2,1,1")]
    BadSplit { what: &'static str, text: String },
    #[error("{what}: {given} values for {ranks} ranks")]
    WrongCount { what: &'static str, given: usize, ranks: usize },
    #[error("{what}: {got} in all, the model has {want}")]
    WrongTotal { what: &'static str, got: usize, want: usize },
    #[error("{what}: {units} cannot give each of {ranks} ranks at least {min}")]
    TooFew { what: &'static str, units: usize, ranks: usize, min: usize },
    #[error("tensor and pipeline parallelism together ({tp} x {pp}) are not supported yet; pick one")]
    Combined { tp: usize, pp: usize },
    #[error("{ranks} ranks but {cards} cards: give one card per rank")]
    CardCount { ranks: usize, cards: usize },
    #[error("no split fits the cards: {reason}")]
    NoFit { reason: String },
}

/// What one rank holds. Ranges are global indices into the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankSlice {
    pub rank: Rank,
    /// Decoder layers this rank runs.
    pub layers: Range<usize>,
    /// Query heads.
    pub heads: Range<usize>,
    /// The global KV head behind each local KV head, in order. Heads that do
    /// not cover whole GQA groups make this repeat a head (a replica).
    pub kv_heads: Vec<usize>,
    /// FFN (intermediate) columns.
    pub ffn: Range<usize>,
    /// LM-head rows (vocabulary entries) whose logits this rank computes.
    pub vocab: Range<usize>,
    /// The rank the hidden state comes from; `None`: embed the tokens here.
    pub recv_from: Option<Rank>,
    /// The rank the hidden state goes to; `None`: compute logits here.
    pub send_to: Option<Rank>,
}

impl RankSlice {
    /// The whole model on one rank.
    pub fn full(cfg: &ModelConfig) -> RankSlice {
        RankSlice {
            rank: Rank(0),
            layers: 0..cfg.num_layers,
            heads: 0..cfg.num_heads,
            kv_heads: (0..cfg.num_kv_heads).collect(),
            ffn: 0..cfg.intermediate_size,
            vocab: 0..cfg.vocab_size,
            recv_from: None,
            send_to: None,
        }
    }
    pub fn embeds(&self) -> bool {
        self.recv_from.is_none()
    }
    /// The columns of every expert's FFN this rank holds: the same share of
    /// `expert_intermediate_size` as `ffn` is of `intermediate_size`, so an
    /// uneven tensor split cuts the experts by the same ratios as the dense
    /// MLP, and every rank holds a part of every expert (routing needs no
    /// exchange beyond the usual all-reduce). Empty for a dense model.
    pub fn expert_ffn(&self, cfg: &ModelConfig) -> Range<usize> {
        let Some(moe) = &cfg.moe else { return 0..0 };
        let (total, width) = (cfg.intermediate_size, moe.expert_intermediate_size);
        let at = |col: usize| if col >= total { width } else { col * width / total };
        at(self.ffn.start)..at(self.ffn.end)
    }
    pub fn emits_logits(&self) -> bool {
        self.send_to.is_none()
    }
}

/// Which kind of parallelism a layout uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutKind {
    Single,
    Tensor,
    Pipeline,
}

/// Ranks mapped to model slices; rank `i` runs on card `i` of the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub kind: LayoutKind,
    pub ranks: Vec<RankSlice>,
}

/// How a dimension is split over ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Split {
    /// As even as the model's units allow.
    Even,
    /// Shares proportional to these weights (TP: if they sum to the number of
    /// query heads they are head counts; PP: layer counts).
    Ratio(Vec<usize>),
    /// Solved for the largest group token capacity on the given cards.
    Auto,
}

impl FromStr for Split {
    type Err = LayoutError;
    fn from_str(text: &str) -> Result<Split, LayoutError> {
        let t = text.trim();
        match t {
            "auto" => return Ok(Split::Auto),
            "even" | "" => return Ok(Split::Even),
            _ => {}
        }
        let bad = || LayoutError::BadSplit { what: "split", text: text.to_string() };
        let v: Vec<usize> =
            t.split(',').map(|x| x.trim().parse::<usize>()).collect::<Result<_, _>>().map_err(|_| bad())?;
        if v.is_empty() {
            return Err(bad());
        }
        Ok(Split::Ratio(v))
    }
}

/// The layout flags, parsed once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutSpec {
    pub tp: usize,
    pub tp_split: Split,
    pub pp: usize,
    pub pp_split: Split,
}

impl Default for LayoutSpec {
    fn default() -> Self {
        LayoutSpec { tp: 1, tp_split: Split::Even, pp: 1, pp_split: Split::Even }
    }
}

impl LayoutSpec {
    pub fn ranks(&self) -> usize {
        self.tp.max(1) * self.pp.max(1)
    }
}

/// How a card holds a checkpoint's weight matrices: quantized GGUF blocks
/// stay quantized, float checkpoints are held in bf16 (what plans and boot
/// price a rank's weights with).
pub fn card_weight_dtype(ckpt: &crate::Checkpoint) -> DType {
    match ckpt.gguf() {
        Some(_) => ckpt
            .tensor("model.layers.0.mlp.down_proj.weight")
            .or_else(|_| ckpt.tensor("model.layers.0.mlp.experts.0.down_proj.weight"))
            .map(|t| t.dtype)
            .unwrap_or(DType::BF16),
        None => DType::BF16,
    }
}

/// Columns of FFN a card's split keeps together: whole 128-column tiles
/// (and so whole quantization blocks). A GPU's matrix kernels read rows in
/// aligned vectors; a rank holding 11,535 of Llama-3-8B's 14,336 columns made
/// its `down_proj` 20x slower than one holding 11,520 would be.
pub const FFN_TILE: usize = 128;

/// The FFN column granule for a weight type: whole quantization blocks in
/// whole [`FFN_TILE`]s, so a column slice of `down_proj` never cuts a block
/// and stays aligned (a model too narrow for that splits on finer granules:
/// see `fit_granule`).
pub fn ffn_granule(dtype: DType) -> usize {
    let b = dtype.block_elems().max(1);
    b / gcd(b, FFN_TILE) * FFN_TILE
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The coarsest granule, halving from `granule`, that divides `total` into at
/// least `ranks` parts.
fn fit_granule(total: usize, ranks: usize, granule: usize) -> usize {
    let mut g = granule.max(1);
    while g > 1 && (total % g != 0 || total / g < ranks) {
        g /= 2;
    }
    g
}

/// Split `total` units by `weights` (largest remainder), each rank getting at
/// least `min`.
fn apportion(
    what: &'static str,
    total: usize,
    weights: &[usize],
    min: usize,
) -> Result<Vec<usize>, LayoutError> {
    let n = weights.len();
    if n * min > total {
        return Err(LayoutError::TooFew { what, units: total, ranks: n, min });
    }
    let wsum: usize = weights.iter().sum();
    if wsum == 0 || weights.contains(&0) {
        return Err(LayoutError::BadSplit { what, text: format!("{weights:?}") });
    }
    let ideal: Vec<f64> = weights.iter().map(|&w| total as f64 * w as f64 / wsum as f64).collect();
    let mut out: Vec<usize> = ideal.iter().map(|&x| (x.floor() as usize).max(min)).collect();
    loop {
        let sum: usize = out.iter().sum();
        if sum == total {
            return Ok(out);
        }
        if sum < total {
            // Ties go to the lower rank (`max_by` keeps the last of equals).
            let i = (0..n)
                .rev()
                .max_by(|&a, &b| (ideal[a] - out[a] as f64).total_cmp(&(ideal[b] - out[b] as f64)))
                .unwrap_or(0);
            out[i] += 1;
        } else {
            let i = (0..n)
                .filter(|&i| out[i] > min)
                .max_by(|&a, &b| (out[a] as f64 - ideal[a]).total_cmp(&(out[b] as f64 - ideal[b])))
                .unwrap_or(0);
            out[i] -= 1;
        }
    }
}

/// Consecutive ranges of the given lengths.
fn ranges(counts: &[usize]) -> Vec<Range<usize>> {
    let mut at = 0;
    counts
        .iter()
        .map(|&c| {
            at += c;
            at - c..at
        })
        .collect()
}

/// The KV heads query heads `heads` need, as the attention kernel reads
/// them: local query head `i` uses local KV head `i / (heads / kv)`. Whole
/// groups keep one KV head per group; otherwise heads are blocked as coarsely
/// as their groups allow and each block gets its own replica.
pub fn kv_heads_for(cfg: &ModelConfig, heads: &Range<usize>) -> Vec<usize> {
    let g = cfg.num_heads / cfg.num_kv_heads;
    let n = heads.len();
    let shares =
        |lg: usize| (0..n / lg).all(|k| (heads.start + k * lg) / g == (heads.start + k * lg + lg - 1) / g);
    let lg = (1..=g.min(n)).rev().find(|&lg| n % lg == 0 && shares(lg)).unwrap_or(1);
    (0..n / lg).map(|k| (heads.start + k * lg) / g).collect()
}

impl Layout {
    pub fn single(cfg: &ModelConfig) -> Layout {
        Layout { kind: LayoutKind::Single, ranks: vec![RankSlice::full(cfg)] }
    }

    /// Tensor parallelism with explicit per-rank head, FFN-column and vocabulary counts.
    pub fn tensor(
        cfg: &ModelConfig,
        heads: &[usize],
        ffn: &[usize],
        vocab: &[usize],
    ) -> Result<Layout, LayoutError> {
        let n = heads.len();
        for (what, v, want) in [
            ("heads", heads, cfg.num_heads),
            ("ffn columns", ffn, cfg.intermediate_size),
            ("vocabulary rows", vocab, cfg.vocab_size),
        ] {
            if v.len() != n {
                return Err(LayoutError::WrongCount { what, given: v.len(), ranks: n });
            }
            if v.iter().sum::<usize>() != want {
                return Err(LayoutError::WrongTotal { what, got: v.iter().sum(), want });
            }
            if v.contains(&0) {
                return Err(LayoutError::TooFew { what, units: want, ranks: n, min: 1 });
            }
        }
        let (h, f, v) = (ranges(heads), ranges(ffn), ranges(vocab));
        let ranks = (0..n)
            .map(|i| RankSlice {
                rank: Rank(i as u32),
                layers: 0..cfg.num_layers,
                kv_heads: kv_heads_for(cfg, &h[i]),
                heads: h[i].clone(),
                ffn: f[i].clone(),
                vocab: v[i].clone(),
                recv_from: None,
                send_to: None,
            })
            .collect();
        Ok(Layout { kind: if n == 1 { LayoutKind::Single } else { LayoutKind::Tensor }, ranks })
    }

    /// Tensor parallelism by ratios. Ratios that sum to the number of query
    /// heads are head counts; otherwise heads are apportioned by KV group when
    /// there are at least as many KV heads as ranks, else one by one. FFN
    /// columns (in `granule`s) and vocabulary rows follow the head shares.
    pub fn tensor_ratio(cfg: &ModelConfig, ratios: &[usize], granule: usize) -> Result<Layout, LayoutError> {
        let n = ratios.len();
        let g = cfg.num_heads / cfg.num_kv_heads;
        let heads = if ratios.iter().sum::<usize>() == cfg.num_heads && !ratios.contains(&0) {
            ratios.to_vec()
        } else if n <= cfg.num_kv_heads {
            apportion("KV groups", cfg.num_kv_heads, ratios, 1)?.into_iter().map(|k| k * g).collect()
        } else {
            apportion("heads", cfg.num_heads, ratios, 1)?
        };
        let ffn = apportion_granules(cfg.intermediate_size, &heads, granule)?;
        let vocab = apportion("vocabulary rows", cfg.vocab_size, &heads, 1)?;
        Layout::tensor(cfg, &heads, &ffn, &vocab)
    }

    /// Pipeline parallelism with explicit per-stage layer counts.
    pub fn pipeline(cfg: &ModelConfig, layers: &[usize]) -> Result<Layout, LayoutError> {
        let n = layers.len();
        if layers.iter().sum::<usize>() != cfg.num_layers {
            return Err(LayoutError::WrongTotal {
                what: "layers",
                got: layers.iter().sum(),
                want: cfg.num_layers,
            });
        }
        let l = ranges(layers);
        let ranks = (0..n)
            .map(|i| RankSlice {
                rank: Rank(i as u32),
                layers: l[i].clone(),
                recv_from: (i > 0).then(|| Rank(i as u32 - 1)),
                send_to: (i + 1 < n).then(|| Rank(i as u32 + 1)),
                ..RankSlice::full(cfg)
            })
            .collect();
        Ok(Layout { kind: if n == 1 { LayoutKind::Single } else { LayoutKind::Pipeline }, ranks })
    }

    /// Build from explicit splits (`Auto` needs cards: use [`solve`]).
    pub fn from_spec(cfg: &ModelConfig, spec: &LayoutSpec, granule: usize) -> Result<Layout, LayoutError> {
        let (tp, pp) = (spec.tp.max(1), spec.pp.max(1));
        if tp > 1 && pp > 1 {
            return Err(LayoutError::Combined { tp, pp });
        }
        if tp > 1 {
            let ratios = match &spec.tp_split {
                Split::Ratio(r) if r.len() != tp => {
                    return Err(LayoutError::WrongCount { what: "--tp-ratio", given: r.len(), ranks: tp })
                }
                Split::Ratio(r) => r.clone(),
                Split::Even | Split::Auto => vec![1; tp],
            };
            return Layout::tensor_ratio(cfg, &ratios, granule);
        }
        if pp > 1 {
            let layers = match &spec.pp_split {
                Split::Ratio(r) if r.len() != pp => {
                    return Err(LayoutError::WrongCount { what: "--pp-layers", given: r.len(), ranks: pp })
                }
                Split::Ratio(r) => r.clone(),
                Split::Even | Split::Auto => apportion("layers", cfg.num_layers, &vec![1; pp], 0)?,
            };
            return Layout::pipeline(cfg, &layers);
        }
        Ok(Layout::single(cfg))
    }

    /// A short description: `tp heads 16/8/8 ffn .. ` or `pp layers 14/9/9`.
    pub fn describe(&self) -> String {
        let join = |f: &dyn Fn(&RankSlice) -> usize| {
            self.ranks.iter().map(|r| f(r).to_string()).collect::<Vec<_>>().join("/")
        };
        match self.kind {
            LayoutKind::Single => "single rank".to_string(),
            LayoutKind::Tensor => format!(
                "tp={} heads {} kv heads {} ffn {} vocab {}",
                self.ranks.len(),
                join(&|r| r.heads.len()),
                join(&|r| r.kv_heads.len()),
                join(&|r| r.ffn.len()),
                join(&|r| r.vocab.len())
            ),
            LayoutKind::Pipeline => format!("pp={} layers {}", self.ranks.len(), join(&|r| r.layers.len())),
        }
    }
}

fn apportion_granules(total: usize, weights: &[usize], granule: usize) -> Result<Vec<usize>, LayoutError> {
    let granule = fit_granule(total, weights.len(), granule);
    if total % granule != 0 {
        return apportion("ffn columns", total, weights, 1);
    }
    Ok(apportion("ffn blocks", total / granule, weights, 1)?.into_iter().map(|b| b * granule).collect())
}

/// What a rank's bytes are priced with.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Storage type of the weight matrices on the card.
    pub weight_dtype: DType,
    /// Bytes of one KV element on the card.
    pub kv_elem_bytes: u64,
    pub page_size: Tokens,
    /// Token rows of the largest step (sizes the activation workspace).
    pub max_rows: usize,
    /// Logit rows of the largest step.
    pub max_logit_rows: usize,
    /// The arena's commit unit to aim for.
    pub chunk_target: Bytes,
}

/// The commit unit a KV arena aims for (what boot uses: chunks of about
/// 2 MiB, so a card rests within a few MiB of its floor).
pub const DEFAULT_CHUNK_TARGET: Bytes = Bytes::mib(2);

pub(crate) fn elems_bytes(dtype: DType, elems: usize) -> u64 {
    // Rounding up to whole blocks only matters for shapes that are not block multiples.
    (elems.div_ceil(dtype.block_elems()) * dtype.block_bytes()) as u64
}

impl CostModel {
    /// Weight bytes of `slice` (norms and biases priced as f32).
    pub fn weights(&self, cfg: &ModelConfig, s: &RankSlice) -> Bytes {
        if let Some(h) = &cfg.hybrid {
            return crate::qwen3_5::cost::weights(self, cfg, h, s);
        }
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let w = |elems: usize| elems_bytes(self.weight_dtype, elems);
        let f32s = |elems: usize| (elems * 4) as u64;
        let (q, kv, f) = (s.heads.len() * hd, s.kv_heads.len() * hd, s.ffn.len());
        let mut attention = w(q * h) + 2 * w(kv * h) + w(h * q) + f32s(2 * h);
        if cfg.attention_bias {
            attention += f32s(q + 2 * kv);
        }
        if cfg.qk_norm {
            attention += f32s(2 * hd);
        }
        let dense = 3 * w(f * h);
        // A sparse layer holds the whole router and its share of every expert:
        // all of them, not only the few a token reads.
        let sparse = cfg
            .moe
            .as_ref()
            .map_or(0, |m| w(m.num_experts * h) + m.num_experts as u64 * 3 * w(s.expert_ffn(cfg).len() * h));
        let mut total = s
            .layers
            .clone()
            .map(|i| attention + if cfg.is_sparse_layer(i) { sparse } else { dense })
            .sum::<u64>();
        if s.embeds() {
            total += w(cfg.vocab_size * h);
        }
        if s.emits_logits() {
            total += f32s(h);
            // A tied head over the whole vocabulary is the embedding table itself.
            let shared = cfg.tie_word_embeddings && s.embeds() && s.vocab.len() == cfg.vocab_size;
            if !shared {
                total += w(s.vocab.len() * h);
            }
        }
        Bytes(total)
    }

    /// Activation workspace bytes of `slice` (f32 activations, allocated once).
    pub fn workspace(&self, cfg: &ModelConfig, s: &RankSlice) -> Bytes {
        if let Some(h) = &cfg.hybrid {
            return crate::qwen3_5::cost::workspace(self, cfg, h, s);
        }
        let (q, kv, f) = (s.heads.len() * cfg.head_dim, s.kv_heads.len() * cfg.head_dim, s.ffn.len());
        let mut per_row = 3 * cfg.hidden_size + 2 * q + 2 * kv + 3 * f;
        let mut fixed = 0;
        if let Some(m) = &cfg.moe {
            // The expert scratch (`corridor_backend::MoeScratch`): router
            // logits, the gathered rows of one expert, its gate and up, per
            // (row, chosen expert) pair a SwiGLU output and an expert output,
            // and the device's routing metadata and 8-bit copies.
            let (h, ef, k) = (cfg.hidden_size, s.expert_ffn(cfg).len(), m.experts_per_token);
            per_row += m.num_experts + h + 2 * ef + k * (ef + h);
            let shape = corridor_backend::MoeShape {
                max_rows: self.max_rows,
                hidden: h,
                expert_ffn: ef,
                routing: corridor_backend::Routing {
                    num_experts: m.num_experts,
                    top_k: k,
                    norm_topk_prob: m.norm_topk_prob,
                },
            };
            fixed += shape.meta_words() + shape.q8_words();
        }
        let per_logit_row = 2 * cfg.hidden_size + s.vocab.len() + cfg.vocab_size;
        Bytes(4 * (self.max_rows * per_row + self.max_logit_rows * per_logit_row + fixed) as u64)
    }

    /// Recurrent-state bytes of `slice`: one slot per logit row (a request
    /// that may run) of a hybrid model's linear layers; zero for the others.
    pub fn state(&self, cfg: &ModelConfig, s: &RankSlice) -> Bytes {
        cfg.hybrid.as_ref().map_or(Bytes::ZERO, |h| crate::qwen3_5::cost::state(self, cfg, h, s))
    }

    /// KV bytes one token takes on this rank (K and V, every local layer).
    pub fn kv_per_token(&self, cfg: &ModelConfig, s: &RankSlice) -> Bytes {
        if let Some(h) = &cfg.hybrid {
            return crate::qwen3_5::cost::kv_per_token(self, cfg, h, s);
        }
        Bytes(2 * s.layers.len() as u64 * s.kv_heads.len() as u64 * cfg.head_dim as u64 * self.kv_elem_bytes)
    }

    /// Bytes one page takes on this rank.
    pub fn page_bytes(&self, cfg: &ModelConfig, s: &RankSlice) -> Bytes {
        Bytes(self.kv_per_token(cfg, s).get() * self.page_size.get() as u64)
    }
}

/// One card's room, measured before anything of the model is placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CardRoom {
    pub card: CardId,
    /// Driver free memory now.
    pub free: Bytes,
    /// The floor sizing keeps (the arming floor).
    pub floor: Bytes,
    /// The error bar kept above the floor.
    pub margin: Bytes,
    /// What corridor may hold on the card in all (`--card-budget-mib`).
    pub budget: Option<Bytes>,
    /// The card's commit granularity.
    pub granularity: Bytes,
}

/// One rank of a priced plan.
#[derive(Clone, Debug, PartialEq)]
pub struct RankPlan {
    pub rank: Rank,
    pub card: CardRoom,
    pub weights: Bytes,
    pub workspace: Bytes,
    /// Recurrent-state slots (a hybrid model's; zero for the others).
    pub state: Bytes,
    pub kv_per_token: Bytes,
    /// Pages this card alone could hold (the `vram` sizing rule).
    pub own_pages: Pages,
    pub chunk: Option<ChunkGeometry>,
    /// Weights, workspace and state fit under floor, margin and budget.
    pub fits: bool,
}

/// A layout priced on cards.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub layout: Layout,
    pub ranks: Vec<RankPlan>,
    /// Pages every rank holds: the minimum of the ranks' own pages.
    pub group_pages: Pages,
    pub page_size: Tokens,
}

impl RankPlan {
    /// KV bytes committed to hold `pages` pages (whole chunks).
    pub fn committed(&self, pages: Pages) -> Bytes {
        match self.chunk {
            Some(g) if pages.get() > 0 => {
                Bytes(pages.get().div_ceil(g.chunk_pages) as u64 * g.chunk_bytes.get())
            }
            _ => Bytes::ZERO,
        }
    }
}

impl Plan {
    /// Tokens the group admits.
    pub fn tokens(&self) -> Tokens {
        self.group_pages.tokens(self.page_size)
    }
    /// KV bytes rank `i` commits.
    pub fn kv_committed(&self, i: usize) -> Bytes {
        self.ranks[i].committed(self.group_pages)
    }
    /// Free memory left on rank `i`'s card once everything is resident.
    pub fn rest(&self, i: usize) -> Bytes {
        let r = &self.ranks[i];
        r.card.free.saturating_sub(r.weights + r.workspace + r.state + self.kv_committed(i))
    }
}

/// The quiet core of the `vram` sizing rule (the solver evaluates many
/// candidates; only the chosen plan is logged through [`sizing::solve`]).
fn own_pages(input: &SizingInput) -> Pages {
    let mut room = input.free.saturating_sub(input.floor + input.margin + input.reserve);
    if let Some(b) = input.budget_room {
        room = room.min(b);
    }
    let chunks = ((room.get() / input.geometry.chunk_bytes.get()) as usize)
        .min(input.geometry.chunks_in(input.max_pages));
    Pages(chunks * input.geometry.chunk_pages)
}

fn sizing_input(card: &CardRoom, resident: Bytes, geometry: ChunkGeometry) -> SizingInput {
    SizingInput {
        card: card.card,
        free: card.free.saturating_sub(resident),
        floor: card.floor,
        margin: card.margin,
        reserve: Bytes::ZERO,
        budget_room: card.budget.map(|b| b.saturating_sub(resident)),
        geometry,
        max_pages: Pages(usize::MAX / 2),
    }
}

/// The chunk geometry of each rank's share of the group's KV arena: one id
/// space, so every rank that holds KV commits the same pages per chunk (a
/// rank without layers holds none).
pub fn group_geometry(
    cfg: &ModelConfig,
    layout: &Layout,
    cards: &[CardRoom],
    cost: &CostModel,
) -> Vec<Option<ChunkGeometry>> {
    let shapes: Vec<Option<(Bytes, Bytes)>> = layout
        .ranks
        .iter()
        .zip(cards)
        .map(|(s, c)| {
            let pb = cost.page_bytes(cfg, s);
            (pb > Bytes::ZERO).then_some((pb, c.granularity))
        })
        .collect();
    let present: Vec<(Bytes, Bytes)> = shapes.iter().flatten().copied().collect();
    let Ok(mut common) = ChunkGeometry::common(&present, cost.chunk_target) else {
        return vec![None; shapes.len()];
    };
    common.reverse();
    shapes.iter().map(|s| s.and_then(|_| common.pop())).collect()
}

fn price(
    cfg: &ModelConfig,
    layout: &Layout,
    cards: &[CardRoom],
    cost: &CostModel,
    log: bool,
) -> Result<Plan, LayoutError> {
    if cards.len() != layout.ranks.len() {
        return Err(LayoutError::CardCount { ranks: layout.ranks.len(), cards: cards.len() });
    }
    let mut ranks = Vec::with_capacity(cards.len());
    let geometry = group_geometry(cfg, layout, cards, cost);
    for ((s, card), chunk) in layout.ranks.iter().zip(cards).zip(geometry) {
        let (weights, workspace, state) = (cost.weights(cfg, s), cost.workspace(cfg, s), cost.state(cfg, s));
        let resident = weights + workspace + state;
        let fits =
            card.free >= resident + card.floor + card.margin && card.budget.is_none_or(|b| b >= resident);
        // A stage without layers holds no KV: it never bounds the group.
        let own = match chunk {
            _ if !fits => Pages(0),
            None => Pages(usize::MAX),
            Some(g) => {
                let input = sizing_input(card, resident, g);
                if log {
                    let s: Sizing = sizing::solve(input);
                    s.pages
                } else {
                    own_pages(&input)
                }
            }
        };
        ranks.push(RankPlan {
            rank: s.rank,
            card: *card,
            weights,
            workspace,
            state,
            kv_per_token: cost.kv_per_token(cfg, s),
            own_pages: own,
            chunk,
            fits,
        });
    }
    let group_pages = ranks.iter().map(|r| r.own_pages).min().unwrap_or(Pages(0));
    let group_pages = if group_pages.get() == usize::MAX { Pages(0) } else { group_pages };
    Ok(Plan { layout: layout.clone(), ranks, group_pages, page_size: cost.page_size })
}

/// Price a layout on cards (rank `i` on `cards[i]`), logging each card's
/// sizing the way boot does.
pub fn evaluate(
    cfg: &ModelConfig,
    layout: &Layout,
    cards: &[CardRoom],
    cost: &CostModel,
) -> Result<Plan, LayoutError> {
    price(cfg, layout, cards, cost, true)
}

/// Every way to write `total` as `n` ordered parts of at least `min`.
fn compositions(total: usize, n: usize, min: usize) -> Vec<Vec<usize>> {
    fn go(left: usize, n: usize, min: usize, cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if n == 1 {
            if left >= min {
                cur.push(left);
                out.push(cur.clone());
                cur.pop();
            }
            return;
        }
        for v in min..=left.saturating_sub(min * (n - 1)) {
            cur.push(v);
            go(left - v, n - 1, min, cur, out);
            cur.pop();
        }
    }
    let mut out = Vec::new();
    if n > 0 && n * min <= total {
        go(total, n, min, &mut Vec::with_capacity(n), &mut out);
    }
    out
}

/// How far a split is from even (smaller is more even), to break ties.
fn spread(v: &[usize]) -> usize {
    v.iter().max().unwrap_or(&0) - v.iter().min().unwrap_or(&0)
}

/// What a TP balance moves between ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Share {
    /// FFN columns, in whole tiles (the bulk of the weights).
    Ffn,
    /// Rows of the LM head, one at a time (fine enough to even out what
    /// whole FFN tiles leave).
    Vocab,
}

/// Move FFN columns between TP ranks so each card's spare memory above the
/// pool it must hold is as equal as whole FFN tiles allow, then move rows of
/// the LM head to even out the rest, keeping the head shares. Returns the
/// best layout found.
fn balance_ffn(
    cfg: &ModelConfig,
    base: &Layout,
    cards: &[CardRoom],
    cost: &CostModel,
    granule: usize,
) -> Result<Layout, LayoutError> {
    let ffn = balance(cfg, base, cards, cost, Share::Ffn, granule)?;
    balance(cfg, &ffn, cards, cost, Share::Vocab, 1)
}

fn balance(
    cfg: &ModelConfig,
    base: &Layout,
    cards: &[CardRoom],
    cost: &CostModel,
    share: Share,
    granule: usize,
) -> Result<Layout, LayoutError> {
    let n = base.ranks.len();
    let total = match share {
        Share::Ffn => cfg.intermediate_size,
        Share::Vocab => cfg.vocab_size,
    };
    let granule = fit_granule(total, n, granule);
    let blocks = total / granule;
    // Bytes one granule costs a rank: weights and workspace.
    let with = |i: usize, units: usize| match share {
        Share::Ffn => RankSlice { ffn: 0..units, ..base.ranks[i].clone() },
        Share::Vocab => RankSlice { vocab: 0..units, ..base.ranks[i].clone() },
    };
    let resident = |s: &RankSlice| cost.weights(cfg, s) + cost.workspace(cfg, s) + cost.state(cfg, s);
    let fixed: Vec<Bytes> = (0..n).map(|i| resident(&with(i, 0))).collect();
    let per_block: Vec<u64> = (0..n).map(|i| resident(&with(i, granule)).get() - fixed[i].get()).collect();
    let geometry = group_geometry(cfg, base, cards, cost);
    let room = |i: usize| {
        let c = &cards[i];
        let by_free = c.free.saturating_sub(c.floor + c.margin);
        c.budget.map_or(by_free, |b| by_free.min(b))
    };
    let commit = |i: usize, pages: usize| {
        geometry[i].map_or(0, |g| (pages.div_ceil(g.chunk_pages) * g.chunk_bytes.get() as usize) as u64)
    };
    // Blocks rank i can afford while holding `pages` pages.
    let afford = |i: usize, pages: usize| -> usize {
        let left = room(i).get().saturating_sub(fixed[i].get() + commit(i, pages));
        (left / per_block[i].max(1)) as usize
    };
    let feasible = |pages: usize| {
        (0..n).all(|i| afford(i, pages) >= 1) && (0..n).map(|i| afford(i, pages)).sum::<usize>() >= blocks
    };
    if !feasible(0) {
        return Ok(base.clone());
    }
    let (mut lo, mut hi) = (0usize, 1usize);
    while feasible(hi) {
        lo = hi;
        hi = hi.saturating_mul(2);
        if hi > (1 << 40) {
            break;
        }
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if feasible(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let pages = lo;
    let mut take: Vec<usize> = (0..n).map(|i| afford(i, pages).min(blocks)).collect();
    // Give back the excess where it leaves the smallest rest: one block at a
    // time from the rank whose spare memory is smallest, so no card is left
    // holding all of it.
    let rest = |i: usize, b: usize| {
        room(i).get().saturating_sub(fixed[i].get() + commit(i, pages) + b as u64 * per_block[i])
    };
    while take.iter().sum::<usize>() > blocks {
        let i = (0..n).filter(|&i| take[i] > 1).min_by_key(|&i| rest(i, take[i])).unwrap_or(0);
        take[i] -= 1;
    }
    let mut units: Vec<usize> = take.iter().map(|b| b * granule).collect();
    // Units that whole granules leave over (a total that is not a multiple)
    // go to the last rank.
    let spare = total - units.iter().sum::<usize>();
    if let Some(last) = units.last_mut() {
        *last += spare;
    }
    let heads: Vec<usize> = base.ranks.iter().map(|r| r.heads.len()).collect();
    let keep = |f: fn(&RankSlice) -> usize| base.ranks.iter().map(f).collect::<Vec<usize>>();
    match share {
        Share::Ffn => Layout::tensor(cfg, &heads, &units, &keep(|r| r.vocab.len())),
        Share::Vocab => Layout::tensor(cfg, &heads, &keep(|r| r.ffn.len()), &units),
    }
}

/// Resolve the layout flags on cards: explicit splits are built as given,
/// `auto` is solved for the largest group token capacity.
pub fn solve(
    cfg: &ModelConfig,
    spec: &LayoutSpec,
    cards: &[CardRoom],
    cost: &CostModel,
    granule: usize,
) -> Result<Plan, LayoutError> {
    let (tp, pp) = (spec.tp.max(1), spec.pp.max(1));
    if tp > 1 && pp > 1 {
        return Err(LayoutError::Combined { tp, pp });
    }
    if cards.len() != tp * pp {
        return Err(LayoutError::CardCount { ranks: tp * pp, cards: cards.len() });
    }
    let layout = if tp > 1 && spec.tp_split == Split::Auto {
        let g = cfg.num_heads / cfg.num_kv_heads;
        let candidates: Vec<Vec<usize>> = if tp <= cfg.num_kv_heads {
            compositions(cfg.num_kv_heads, tp, 1)
                .into_iter()
                .map(|c| c.into_iter().map(|k| k * g).collect())
                .collect()
        } else {
            compositions(cfg.num_heads, tp, 1)
        };
        let mut best: Option<(Pages, usize, Layout)> = None;
        for heads in candidates {
            let base = Layout::tensor_ratio(cfg, &heads, granule)?;
            let balanced = balance_ffn(cfg, &base, cards, cost, granule)?;
            let pages = price(cfg, &balanced, cards, cost, false)?.group_pages;
            let sp = spread(&heads);
            if best.as_ref().is_none_or(|(p, s, _)| pages > *p || (pages == *p && sp < *s)) {
                best = Some((pages, sp, balanced));
            }
        }
        best.map(|(_, _, l)| l)
            .ok_or_else(|| LayoutError::NoFit { reason: format!("no head split over {tp} ranks") })?
    } else if pp > 1 && spec.pp_split == Split::Auto {
        let min = usize::from(cfg.num_layers >= pp);
        let mut best: Option<(Pages, usize, Layout)> = None;
        for layers in compositions(cfg.num_layers, pp, min) {
            let l = Layout::pipeline(cfg, &layers)?;
            let pages = price(cfg, &l, cards, cost, false)?.group_pages;
            let sp = spread(&layers);
            if best.as_ref().is_none_or(|(p, s, _)| pages > *p || (pages == *p && sp < *s)) {
                best = Some((pages, sp, l));
            }
        }
        best.map(|(_, _, l)| l)
            .ok_or_else(|| LayoutError::NoFit { reason: format!("no layer split over {pp} stages") })?
    } else {
        Layout::from_spec(cfg, spec, granule)?
    };
    evaluate(cfg, &layout, cards, cost)
}

/// One card of a flipping group: what both layouts place on it.
#[derive(Clone, Debug, PartialEq)]
pub struct FlippingCard {
    pub card: CardRoom,
    /// Weights and workspace of the card's tensor rank and pipeline stage.
    pub weights: Bytes,
    pub workspace: Bytes,
    /// One KV page's bytes on this card: the tensor rank's share of the page
    /// and the pipeline stage's, both held (the layout that does not serve
    /// keeps its share so a flip can write it).
    pub page_bytes: Bytes,
    pub chunk: Option<ChunkGeometry>,
    pub own_pages: Pages,
    pub fits: bool,
}

/// Both layouts of a flipping group priced on the same cards.
#[derive(Clone, Debug, PartialEq)]
pub struct FlippingPlan {
    pub tensor: Plan,
    pub pipeline: Plan,
    pub cards: Vec<FlippingCard>,
    /// Pages every card holds with both layouts resident.
    pub group_pages: Pages,
}

/// Solve a flipping group: the tensor layout on the cards' rooms, the
/// pipeline layout on what the tensor layout leaves (its weights and
/// workspace taken out of every room), then every card priced with both
/// resident and a KV page that holds both layouts' shares.
pub fn solve_flipping(
    cfg: &ModelConfig,
    tp: &LayoutSpec,
    pp: &LayoutSpec,
    rooms: &[CardRoom],
    cost: &CostModel,
    granule: usize,
) -> Result<FlippingPlan, LayoutError> {
    let tensor = solve(cfg, tp, rooms, cost, granule)?;
    let left: Vec<CardRoom> = rooms
        .iter()
        .zip(&tensor.ranks)
        .map(|(r, p)| {
            let taken = p.weights + p.workspace;
            CardRoom {
                free: r.free.saturating_sub(taken),
                budget: r.budget.map(|b| b.saturating_sub(taken)),
                ..*r
            }
        })
        .collect();
    let pipeline = solve(cfg, pp, &left, cost, granule)?;
    let pairs: Vec<(&RankSlice, &RankSlice)> =
        tensor.layout.ranks.iter().zip(&pipeline.layout.ranks).collect();
    let shapes: Vec<(Bytes, Bytes)> = pairs
        .iter()
        .zip(rooms)
        .map(|((t, p), room)| (cost.page_bytes(cfg, t) + cost.page_bytes(cfg, p), room.granularity))
        .collect();
    let geometry = ChunkGeometry::common(&shapes, cost.chunk_target)
        .map_err(|e| LayoutError::NoFit { reason: format!("the KV chunks of both layouts: {e}") })?;
    let mut cards = Vec::with_capacity(rooms.len());
    for ((((t, p), room), shape), chunk) in pairs.iter().zip(rooms).zip(&shapes).zip(geometry) {
        let weights = cost.weights(cfg, t) + cost.weights(cfg, p);
        let workspace = cost.workspace(cfg, t) + cost.workspace(cfg, p);
        let resident = weights + workspace;
        let fits =
            room.free >= resident + room.floor + room.margin && room.budget.is_none_or(|b| b >= resident);
        let own = if fits { own_pages(&sizing_input(room, resident, chunk)) } else { Pages(0) };
        cards.push(FlippingCard {
            card: *room,
            weights,
            workspace,
            page_bytes: shape.0,
            chunk: Some(chunk),
            own_pages: own,
            fits,
        });
    }
    let group_pages = cards.iter().map(|c| c.own_pages).min().unwrap_or(Pages(0));
    Ok(FlippingPlan { tensor, pipeline, cards, group_pages })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Arch;
    use corridor_backend::RopeStyle;

    fn llama3_8b() -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            vocab_size: 128_256,
            hidden_size: 4096,
            intermediate_size: 14_336,
            num_layers: 32,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            rms_norm_eps: 1e-5,
            rope_theta: 500_000.0,
            rope_scaling: None,
            rope_style: RopeStyle::Half,
            max_position_embeddings: 8192,
            tie_word_embeddings: false,
            attention_bias: false,
            qk_norm: false,
            bos_token_id: None,
            eos_token_ids: vec![],
            moe: None,
            hybrid: None,
        }
    }

    fn tiny() -> ModelConfig {
        ModelConfig {
            vocab_size: 384,
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            ..llama3_8b()
        }
    }

    #[test]
    fn a_flipping_group_prices_both_layouts_on_every_card() {
        let cfg = llama3_8b();
        let cost = CostModel {
            weight_dtype: DType::BF16,
            kv_elem_bytes: 2,
            page_size: Tokens(16),
            max_rows: 512,
            max_logit_rows: 32,
            chunk_target: DEFAULT_CHUNK_TARGET,
        };
        let rooms = rig();
        let tp = LayoutSpec { tp: 3, tp_split: Split::Auto, pp: 1, pp_split: Split::Even };
        let pp = LayoutSpec { tp: 1, tp_split: Split::Even, pp: 3, pp_split: Split::Auto };
        let plan = solve_flipping(&cfg, &tp, &pp, &rooms, &cost, 1).unwrap();
        let alone = solve(&cfg, &tp, &rooms, &cost, 1).unwrap();
        assert!(plan.cards.iter().all(|c| c.fits));
        // Both layouts' weights are on the cards: the tensor layout's (its
        // embeddings replicated) and the pipeline's (the model once more).
        let weights: Bytes = plan.cards.iter().map(|c| c.weights).sum();
        let tensor: Bytes = plan.tensor.ranks.iter().map(|r| r.weights).sum();
        let pipeline: Bytes = plan.pipeline.ranks.iter().map(|r| r.weights).sum();
        assert_eq!(weights, tensor + pipeline);
        assert!(pipeline.get() > 15_000 << 20 && tensor > pipeline, "{tensor} {pipeline}");
        // Every page holds both shares: across the cards, twice the model's KV per token.
        let per_page: Bytes = plan.cards.iter().map(|c| c.page_bytes).sum();
        let kv = Bytes(2 * 2 * (cfg.num_layers * cfg.num_kv_heads * cfg.head_dim) as u64 * 16);
        assert_eq!(per_page, kv + kv);
        // So the group holds fewer pages than the tensor layout alone, and more than none.
        assert!(plan.group_pages.get() > 0 && plan.group_pages < alone.group_pages);
        assert_eq!(plan.group_pages, plan.cards.iter().map(|c| c.own_pages).min().unwrap());
    }

    fn rig() -> Vec<CardRoom> {
        [32u64, 20, 20]
            .iter()
            .enumerate()
            .map(|(i, &g)| CardRoom {
                card: CardId(i as u32),
                free: Bytes::gib(g),
                floor: Bytes::mib(1024),
                margin: sizing::DEFAULT_MARGIN,
                budget: None,
                granularity: Bytes::mib(2),
            })
            .collect()
    }

    fn bf16_cost() -> CostModel {
        CostModel {
            weight_dtype: DType::BF16,
            kv_elem_bytes: 2,
            page_size: Tokens(16),
            max_rows: 2048,
            max_logit_rows: 64,
            chunk_target: DEFAULT_CHUNK_TARGET,
        }
    }

    #[test]
    fn kv_heads_replicate_only_when_groups_are_cut() {
        let c = tiny(); // 4 heads, 2 KV heads: groups {0,1} {2,3}
        assert_eq!(kv_heads_for(&c, &(0..4)), vec![0, 1]);
        assert_eq!(kv_heads_for(&c, &(0..2)), vec![0]);
        assert_eq!(kv_heads_for(&c, &(0..3)), vec![0, 0, 1]);
        assert_eq!(kv_heads_for(&c, &(3..4)), vec![1]);
        assert_eq!(kv_heads_for(&c, &(1..3)), vec![0, 1]);
        let big = llama3_8b(); // groups of 4
        assert_eq!(kv_heads_for(&big, &(0..12)), vec![0, 1, 2]);
        assert_eq!(kv_heads_for(&big, &(2..7)), vec![0, 0, 1, 1, 1]);
    }

    #[test]
    fn ffn_splits_keep_whole_tiles_when_the_model_allows() {
        assert_eq!(ffn_granule(DType::BF16), 128);
        assert_eq!(ffn_granule(DType::Q8_0), 128);
        // Llama-3-8B's 14,336 columns over uneven ranks: whole 128-column tiles.
        let cfg = llama3_8b();
        for ratios in [vec![3, 1], vec![5, 2, 1], vec![1, 1, 1]] {
            let l = Layout::tensor_ratio(&cfg, &ratios, ffn_granule(DType::BF16)).unwrap();
            assert!(l.ranks.iter().all(|r| r.ffn.len() % 128 == 0 && r.ffn.start % 128 == 0), "{ratios:?}");
        }
        // A model too narrow for whole tiles on every rank splits finer.
        assert_eq!(fit_granule(128, 3, 128), 32);
        assert_eq!(fit_granule(100, 2, 128), 4);
    }

    #[test]
    fn ratios_split_by_group_where_possible() {
        let c = llama3_8b();
        let l = Layout::tensor_ratio(&c, &[1, 1, 1], 1).unwrap();
        let heads: Vec<usize> = l.ranks.iter().map(|r| r.heads.len()).collect();
        assert_eq!(heads, vec![12, 12, 8], "8 KV groups over 3 ranks: 3/3/2 groups");
        assert_eq!(l.ranks.iter().map(|r| r.ffn.len()).sum::<usize>(), c.intermediate_size);
        let q = Layout::tensor_ratio(&c, &[1, 1, 1], 32).unwrap();
        assert!(q.ranks.iter().all(|r| r.ffn.start % 32 == 0 && r.ffn.len() % 32 == 0), "{q:?}");
        // Head counts given outright are used as they are.
        let t = Layout::tensor_ratio(&tiny(), &[3, 1], 1).unwrap();
        assert_eq!((t.ranks[0].heads.clone(), t.ranks[0].kv_heads.clone()), (0..3, vec![0, 0, 1]));
        assert!(matches!("2,x".parse::<Split>(), Err(LayoutError::BadSplit { .. })));
        assert_eq!("auto".parse::<Split>().unwrap(), Split::Auto);
        assert!(matches!(Layout::pipeline(&c, &[10, 10]), Err(LayoutError::WrongTotal { .. })));
    }

    #[test]
    fn pipeline_stages_chain() {
        let l = Layout::pipeline(&tiny(), &[1, 0, 1]).unwrap();
        assert_eq!(l.ranks[1].layers, 1..1);
        assert!(l.ranks[0].embeds() && !l.ranks[0].emits_logits());
        assert_eq!((l.ranks[1].recv_from, l.ranks[1].send_to), (Some(Rank(0)), Some(Rank(2))));
        assert!(l.ranks[2].emits_logits() && !l.ranks[2].embeds());
    }

    #[test]
    fn quiet_sizing_matches_the_vram_rule() {
        let c = llama3_8b();
        let plan =
            evaluate(&c, &Layout::tensor_ratio(&c, &[1, 1, 1], 1).unwrap(), &rig(), &bf16_cost()).unwrap();
        for (r, card) in plan.ranks.iter().zip(rig()) {
            let input = sizing_input(&card, r.weights + r.workspace, r.chunk.unwrap());
            assert_eq!(own_pages(&input), sizing::solve(input).pages);
        }
    }

    /// The reference rig (32, 20, 20 GiB) and a Llama-3-8B shape in bf16:
    /// `auto` must beat the even split, and under TP every card must rest
    /// within one KV chunk above floor + margin.
    #[test]
    fn auto_beats_even_on_the_reference_rig() {
        let (c, cards, cost) = (llama3_8b(), rig(), bf16_cost());
        for (name, even, auto) in [
            (
                "tp=3",
                LayoutSpec { tp: 3, ..LayoutSpec::default() },
                LayoutSpec { tp: 3, tp_split: Split::Auto, ..LayoutSpec::default() },
            ),
            (
                "pp=3",
                LayoutSpec { pp: 3, ..LayoutSpec::default() },
                LayoutSpec { pp: 3, pp_split: Split::Auto, ..LayoutSpec::default() },
            ),
        ] {
            let g = ffn_granule(DType::BF16);
            let e = solve(&c, &even, &cards, &cost, g).unwrap();
            let a = solve(&c, &auto, &cards, &cost, g).unwrap();
            assert!(a.layout.ranks.iter().all(|r| r.ffn.len() % g == 0), "{name}: whole FFN tiles");
            println!(
                "{name}: even [{}] {} tokens; auto [{}] {} tokens (+{:.1}%)",
                e.layout.describe(),
                e.tokens().get(),
                a.layout.describe(),
                a.tokens().get(),
                100.0 * (a.tokens().get() as f64 / e.tokens().get() as f64 - 1.0)
            );
            assert!(a.tokens() > e.tokens(), "{name}: auto {} vs even {}", a.tokens(), e.tokens());
            for i in 0..3 {
                let r = &a.ranks[i];
                let above = a.rest(i) - (r.card.floor + r.card.margin);
                println!(
                    "  {name} auto card{i}: weights {} kv {} rests {} above floor + margin",
                    r.weights,
                    a.kv_committed(i),
                    above
                );
                if name == "tp=3" {
                    assert!(
                        above < r.chunk.unwrap().chunk_bytes,
                        "{name} card{i} rests {above} above floor + margin"
                    );
                }
            }
        }
    }

    #[test]
    fn budgets_bound_every_rank() {
        let (c, mut cards, cost) = (llama3_8b(), rig(), bf16_cost());
        cards[0].budget = Some(Bytes::gib(12));
        let a = solve(
            &c,
            &LayoutSpec { tp: 3, tp_split: Split::Auto, ..LayoutSpec::default() },
            &cards,
            &cost,
            1,
        )
        .unwrap();
        let r = &a.ranks[0];
        assert!(
            r.weights + r.workspace + a.kv_committed(0) <= Bytes::gib(12),
            "card0 holds more than its budget"
        );
        assert!(a.tokens().get() > 0);
    }
}
