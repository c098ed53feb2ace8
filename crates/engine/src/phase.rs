//! One group of ranks, two layouts of one model: a phase flip re-shards the
//! KV of every live page from the layout that serves now to the other one.
//!
//! A group that flips holds both layouts resident (every rank has a tensor
//! slice and a pipeline slice of the model, and a KV cache for each). The
//! live pages' KV is copied from the serving layout's caches into the other
//! layout's in layer waves, so the staging a rank needs is bounded by one
//! wave. Nothing the serving layout reads is written until the very end:
//! the last write is the switch of the serving layout on every rank, and
//! every step before it can be abandoned with the old layout intact.
//!
//! The protocol, run by every rank in lockstep over the group's control
//! collective (see [`run_flip`]):
//! 1. **Readiness**: a MIN and a MAX (a MIN of the complement) over armed,
//!    ready (this rank has reserved its staging through its card's
//!    chokepoint), epoch, direction and a fingerprint of both layouts. Any
//!    field that is not unanimous abandons, on every rank, naming the field.
//! 2. **Ballot** on a digest of the live set (the page ids and the epoch), so
//!    ranks that disagree on what they carry never start copying.
//! 3. **Waves**: per wave of layers, each rank reads the pages it owns in the
//!    serving layout, sends every other rank the heads it will own (each
//!    message ends in a checksum of its values), assembles the pages of its
//!    own layers, writes them into the other layout's cache and reads them
//!    back to compare. A failed check does not break lockstep: the rank
//!    finishes the exchange and votes no.
//! 4. **Commit**: a MIN over every rank's verdict; only when it is unanimous
//!    does each rank switch layouts.
//!
//! What moves is planned from the two layouts alone ([`transfers`],
//! [`wave_staging`]), so every rank and the engine compute the same plan and
//! the staging is priced before any byte moves.

use crate::executor::SingleRank;
use corridor_backend::collective::{Group, ThreadRank};
use corridor_backend::Backend;
use corridor_model::layout::{Layout, LayoutKind};
use corridor_model::ModelConfig;
use corridor_model::ModelError;
use corridor_units::{Bytes, PageId, Rank};
use std::fmt;
use std::ops::Range;
use std::str::FromStr;

/// Which of a flipping group's two layouts serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Tensor parallel: every card works on every token (decode).
    Tensor,
    /// Pipeline parallel: activations cross a link once per stage (prefill).
    Pipeline,
}

impl Phase {
    /// The index of this phase's layout in a flipping group.
    pub fn index(self) -> usize {
        match self {
            Phase::Tensor => 0,
            Phase::Pipeline => 1,
        }
    }
    pub fn other(self) -> Phase {
        match self {
            Phase::Tensor => Phase::Pipeline,
            Phase::Pipeline => Phase::Tensor,
        }
    }
    pub fn of(kind: LayoutKind) -> Option<Phase> {
        match kind {
            LayoutKind::Tensor => Some(Phase::Tensor),
            LayoutKind::Pipeline => Some(Phase::Pipeline),
            LayoutKind::Single => None,
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Tensor => "tp",
            Phase::Pipeline => "pp",
        })
    }
}

impl FromStr for Phase {
    type Err = String;
    fn from_str(s: &str) -> Result<Phase, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "tp" | "tensor" => Ok(Phase::Tensor),
            "pp" | "pipeline" => Ok(Phase::Pipeline),
            _ => Err(format!("'{s}' is not a layout: use tp or pp")),
        }
    }
}

/// What the engine asks of every rank.
#[derive(Clone, Debug)]
pub struct FlipOrder {
    pub to: Phase,
    /// The group's flip counter; ranks that disagree on it abandon.
    pub epoch: u64,
    /// Every page whose KV must survive the flip (running requests' and
    /// cached prefixes'), in the order the engine lists them.
    pub live: Vec<PageId>,
    /// Layers per wave (at least one).
    pub wave_layers: usize,
    /// Fault injection: this rank perturbs its ballot digest, so the ballot
    /// fails (how the abandon path is exercised).
    pub skew_digest: Option<Rank>,
}

/// Why a flip was abandoned. Every rank reaches the same reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AbandonReason {
    /// A field of the readiness MIN was not unanimous (or not set on every
    /// rank, for `armed` and `ready`).
    NotUnanimous(&'static str),
    /// The ranks' digests of the live set differ.
    Ballot,
    /// A rank's check of what it received or wrote failed.
    Check,
    /// A rank failed or timed out inside the protocol.
    Failed(String),
}

impl fmt::Display for AbandonReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AbandonReason::NotUnanimous("ready") => {
                f.write_str("a rank could not fund its staging above its floor")
            }
            AbandonReason::NotUnanimous(field) => write!(f, "the ranks disagree on {field}"),
            AbandonReason::Ballot => f.write_str("the ranks' digests of the live set differ"),
            AbandonReason::Check => f.write_str("a rank's check of the copied KV failed"),
            AbandonReason::Failed(e) => write!(f, "a rank failed: {e}"),
        }
    }
}

impl AbandonReason {
    /// Every [`label`](AbandonReason::label), for exporters that list each.
    pub const LABELS: [&'static str; 5] = ["unfunded", "disagreement", "ballot", "check", "failure"];

    /// A short label for metrics (one of [`AbandonReason::LABELS`]).
    pub fn label(&self) -> &'static str {
        match self {
            AbandonReason::NotUnanimous("ready") => "unfunded",
            AbandonReason::NotUnanimous(_) => "disagreement",
            AbandonReason::Ballot => "ballot",
            AbandonReason::Check => "check",
            AbandonReason::Failed(_) => "failure",
        }
    }
}

/// What one rank did in a flip that committed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankFlip {
    /// KV bytes this rank sent to other ranks.
    pub sent: Bytes,
    /// KV bytes this rank copied within itself.
    pub local: Bytes,
    pub waves: usize,
}

/// How a flip ended on one rank (every rank ends the same way).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FlipVerdict {
    Committed(RankFlip),
    Abandoned(AbandonReason),
}

/// One head of one layer moving from the rank that serves it in the source
/// layout to a rank that holds it in the target layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transfer {
    pub layer: usize,
    pub head: usize,
    pub src: Rank,
    /// The layer and KV-head index in the source rank's cache.
    pub src_layer: usize,
    pub src_head: usize,
    pub dst: Rank,
    pub dst_layer: usize,
    /// Every local KV-head index of the target rank that holds this head
    /// (more than one only for a replica).
    pub dst_heads: Vec<usize>,
}

/// Where `(layer, head)` lives in `layout`: each rank holding it, with the
/// local layer and the local head indices.
fn holders(layout: &Layout, layer: usize, head: usize) -> Vec<(Rank, usize, Vec<usize>)> {
    layout
        .ranks
        .iter()
        .filter(|s| s.layers.contains(&layer))
        .filter_map(|s| {
            let local: Vec<usize> =
                s.kv_heads.iter().enumerate().filter(|(_, &h)| h == head).map(|(i, _)| i).collect();
            (!local.is_empty()).then(|| (s.rank, layer - s.layers.start, local))
        })
        .collect()
}

/// Every head of every layer, from its source (the lowest rank holding it in
/// `from`) to each rank holding it in `to`. An error names a head that one
/// layout holds and the other does not (the layouts are of different models).
pub fn transfers(cfg: &ModelConfig, from: &Layout, to: &Layout) -> Result<Vec<Transfer>, String> {
    let mut out = Vec::new();
    for layer in 0..cfg.num_layers {
        for head in 0..cfg.num_kv_heads {
            let src = holders(from, layer, head);
            let Some((src_rank, src_layer, src_heads)) = src.first() else {
                return Err(format!("layer {layer} KV head {head}: no rank of the serving layout holds it"));
            };
            let dst = holders(to, layer, head);
            if dst.is_empty() {
                return Err(format!("layer {layer} KV head {head}: no rank of the target layout holds it"));
            }
            for (dst_rank, dst_layer, dst_heads) in dst {
                out.push(Transfer {
                    layer,
                    head,
                    src: *src_rank,
                    src_layer: *src_layer,
                    src_head: src_heads[0],
                    dst: dst_rank,
                    dst_layer,
                    dst_heads,
                });
            }
        }
    }
    Ok(out)
}

/// The waves of a flip: consecutive layer ranges of `wave_layers` layers.
pub fn waves(num_layers: usize, wave_layers: usize) -> Vec<Range<usize>> {
    let w = wave_layers.max(1);
    (0..num_layers.div_ceil(w)).map(|i| i * w..((i + 1) * w).min(num_layers)).collect()
}

/// Values (f32) one KV head of one page holds: K and V of every slot.
fn head_values(cfg: &ModelConfig, page_size: usize) -> usize {
    2 * page_size * cfg.head_dim
}

/// Staging `rank` needs for one wave over `pages` live pages: the messages it
/// sends, those it receives and the target pages it assembles, at f32.
pub fn wave_staging(
    cfg: &ModelConfig,
    to: &Layout,
    plan: &[Transfer],
    wave: &Range<usize>,
    rank: Rank,
    pages: usize,
    page_size: usize,
) -> Bytes {
    let head = head_values(cfg, page_size) as u64;
    let in_wave = |t: &&Transfer| wave.contains(&t.layer);
    let sent = plan.iter().filter(in_wave).filter(|t| t.src == rank && t.dst != rank).count() as u64;
    let received = plan.iter().filter(in_wave).filter(|t| t.dst == rank && t.src != rank).count() as u64;
    let assembled = to
        .ranks
        .iter()
        .find(|s| s.rank == rank)
        .map(|s| {
            let layers = (s.layers.start.max(wave.start)..s.layers.end.min(wave.end)).len();
            (layers * s.kv_heads.len()) as u64
        })
        .unwrap_or(0);
    Bytes((sent + received + assembled) * head * pages as u64 * 4)
}

/// The most staging `rank` needs in any wave.
pub fn flip_staging(
    cfg: &ModelConfig,
    to: &Layout,
    plan: &[Transfer],
    rank: Rank,
    pages: usize,
    page_size: usize,
    wave_layers: usize,
) -> Bytes {
    waves(cfg.num_layers, wave_layers)
        .iter()
        .map(|w| wave_staging(cfg, to, plan, w, rank, pages, page_size))
        .max()
        .unwrap_or(Bytes::ZERO)
}

/// FNV-1a over 64-bit words: a digest every rank computes the same way.
pub fn fnv(words: impl IntoIterator<Item = u64>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in words {
        for b in w.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

fn checksum(values: &[f32]) -> u64 {
    fnv(values.iter().map(|v| v.to_bits() as u64))
}

/// A fingerprint of the configuration a flip assumes: both layouts, the
/// model's shape and the page size.
pub fn fingerprint(cfg: &ModelConfig, layouts: &[Layout], page_size: usize) -> u64 {
    let mut words = vec![
        cfg.num_layers as u64,
        cfg.num_kv_heads as u64,
        cfg.head_dim as u64,
        cfg.hidden_size as u64,
        page_size as u64,
    ];
    for l in layouts {
        words.push(l.kind as u64);
        for s in &l.ranks {
            words.extend([s.rank.0 as u64, s.layers.start as u64, s.layers.end as u64]);
            words.extend(s.kv_heads.iter().map(|&h| h as u64));
            words.extend([s.heads.start as u64, s.heads.end as u64, s.ffn.start as u64, s.ffn.end as u64]);
        }
    }
    fnv(words)
}

/// Whether every rank holds the same `value`: a MIN and a MIN of the
/// complement (a MAX) agree.
fn unanimous(ctl: &ThreadRank, value: u64) -> Result<(u64, bool), ModelError> {
    let lo = ctl.min_u64(value)?;
    let hi = !ctl.min_u64(!value)?;
    Ok((lo, lo == hi))
}

/// What a rank brings to a flip besides the order.
pub struct RankState<'a> {
    pub rank: Rank,
    pub cfg: &'a ModelConfig,
    pub layouts: &'a [Layout; 2],
    pub page_size: usize,
    /// This rank's flip counter.
    pub epoch: u64,
    /// Whether this rank has both layouts and may flip.
    pub armed: bool,
    /// Whether this rank has reserved its staging.
    pub ready: bool,
}

/// Run the flip protocol on one rank (see the module doc). `serving` is the
/// executor of the layout that serves now, `target` the other one. Returns
/// the verdict every rank reaches; the caller switches layouts only on
/// [`FlipVerdict::Committed`]. An error is a collective failure: the caller
/// treats it as an abandon (the serving layout is untouched).
pub fn run_flip<B: Backend>(
    st: &RankState<'_>,
    order: &FlipOrder,
    ctl: &ThreadRank,
    serving: &mut SingleRank<B>,
    target: &mut SingleRank<B>,
) -> Result<FlipVerdict, ModelError> {
    let from_phase = order.to.other();
    let fields: [(&'static str, u64, bool); 5] = [
        ("armed", st.armed as u64, true),
        ("ready", st.ready as u64, true),
        ("epoch", st.epoch, false),
        ("direction", order.to.index() as u64, false),
        ("configuration", fingerprint(st.cfg, st.layouts, st.page_size), false),
    ];
    let mut refused = None;
    for (name, value, must_be_set) in fields {
        let (lo, same) = unanimous(ctl, value)?;
        if refused.is_none() && (!same || (must_be_set && lo != 1)) {
            refused = Some(name);
        }
    }
    if let Some(name) = refused {
        return Ok(FlipVerdict::Abandoned(AbandonReason::NotUnanimous(name)));
    }
    let mut digest = fnv(std::iter::once(order.epoch).chain(order.live.iter().map(|p| p.0 as u64)));
    if order.skew_digest == Some(st.rank) {
        digest ^= 1;
    }
    if !unanimous(ctl, digest)?.1 {
        return Ok(FlipVerdict::Abandoned(AbandonReason::Ballot));
    }

    let (from, to) = (&st.layouts[from_phase.index()], &st.layouts[order.to.index()]);
    let plan = transfers(st.cfg, from, to).map_err(ModelError::Step)?;
    let mut done = RankFlip::default();
    let mut ok = true;
    for wave in waves(st.cfg.num_layers, order.wave_layers) {
        ok &= run_wave(st, order, ctl, &plan, &wave, to, serving, target, &mut done)?;
        done.waves += 1;
    }
    let all_ok = ctl.min_u64(ok as u64)? == 1;
    Ok(if all_ok { FlipVerdict::Committed(done) } else { FlipVerdict::Abandoned(AbandonReason::Check) })
}

/// One wave on one rank; returns whether this rank's checks passed.
#[allow(clippy::too_many_arguments)]
fn run_wave<B: Backend>(
    st: &RankState<'_>,
    order: &FlipOrder,
    ctl: &ThreadRank,
    plan: &[Transfer],
    wave: &Range<usize>,
    to: &Layout,
    serving: &mut SingleRank<B>,
    target: &mut SingleRank<B>,
    done: &mut RankFlip,
) -> Result<bool, ModelError> {
    let me = st.rank;
    let world = to.ranks.len();
    let ps = st.page_size;
    let hd = st.cfg.head_dim;
    let block = ps * hd;
    let items: Vec<&Transfer> = plan.iter().filter(|t| wave.contains(&t.layer)).collect();
    let my_slice = to.ranks.iter().find(|s| s.rank == me).expect("every rank is in the target layout");
    let my_layers = my_slice.layers.start.max(wave.start)..my_slice.layers.end.min(wave.end);
    let t_heads = my_slice.kv_heads.len();
    let page_values = 2 * ps * t_heads * hd;
    // Target pages of this rank: [live page][local layer of the wave].
    let mut assembled = vec![0f32; order.live.len() * my_layers.len() * page_values];
    let slot_of = |page_idx: usize, dst_layer: usize| {
        (page_idx * my_layers.len() + (dst_layer + my_slice.layers.start - my_layers.start)) * page_values
    };
    // Place one head's K and V blocks (`[ps, hd]` each) into an assembled page.
    let place = |assembled: &mut [f32], at: usize, head: usize, k: &[f32], v: &[f32]| {
        for s in 0..ps {
            let kd = at + (s * t_heads + head) * hd;
            assembled[kd..kd + hd].copy_from_slice(&k[s * hd..(s + 1) * hd]);
            let vd = at + ps * t_heads * hd + (s * t_heads + head) * hd;
            assembled[vd..vd + hd].copy_from_slice(&v[s * hd..(s + 1) * hd]);
        }
    };

    // Read what this rank serves and cut it into messages (and local copies).
    let mut outbox: Vec<Vec<f32>> = vec![Vec::new(); world];
    let mut page = Vec::new();
    let (k, v) = (&mut vec![0f32; block], &mut vec![0f32; block]);
    {
        let (backend, kv) = serving.kv_parts();
        for (pi, &pid) in order.live.iter().enumerate() {
            let mut read_layer = None;
            for t in items.iter().filter(|t| t.src == me) {
                if read_layer != Some(t.src_layer) {
                    kv.read_page(backend, t.src_layer, pid, &mut page)?;
                    read_layer = Some(t.src_layer);
                }
                let s_heads = page.len() / (2 * block);
                for s in 0..ps {
                    let src = (s * s_heads + t.src_head) * hd;
                    k[s * hd..(s + 1) * hd].copy_from_slice(&page[src..src + hd]);
                    let vs = ps * s_heads * hd + src;
                    v[s * hd..(s + 1) * hd].copy_from_slice(&page[vs..vs + hd]);
                }
                if t.dst == me {
                    for &h in &t.dst_heads {
                        place(&mut assembled, slot_of(pi, t.dst_layer), h, k, v);
                    }
                    done.local += Bytes(2 * block as u64 * 4);
                } else {
                    let msg = &mut outbox[t.dst.0 as usize];
                    msg.extend_from_slice(k);
                    msg.extend_from_slice(v);
                }
            }
        }
    }
    for (dst, msg) in outbox.iter_mut().enumerate() {
        if dst == me.0 as usize || !items.iter().any(|t| t.src == me && t.dst.0 as usize == dst) {
            continue;
        }
        let sum = checksum(msg);
        msg.push(f32::from_bits((sum >> 32) as u32));
        msg.push(f32::from_bits(sum as u32));
        ctl.send_host(Rank(dst as u32), msg)?;
        done.sent += Bytes(4 * (msg.len() as u64 - 2));
    }
    drop(outbox);

    // Receive what this rank will hold, check each message, and assemble.
    let mut ok = true;
    for src in 0..world as u32 {
        let mine: Vec<&&Transfer> =
            items.iter().filter(|t| t.dst == me && t.src.0 == src && t.src != me).collect();
        if mine.is_empty() {
            continue;
        }
        let mut msg = vec![0f32; mine.len() * order.live.len() * 2 * block + 2];
        ctl.recv_host(Rank(src), &mut msg)?;
        let n = msg.len() - 2;
        let sum = ((msg[n].to_bits() as u64) << 32) | msg[n + 1].to_bits() as u64;
        if checksum(&msg[..n]) != sum {
            tracing::warn!(rank = %me, from = src, "flip: a KV message arrived with a wrong checksum");
            ok = false;
            continue;
        }
        let mut at = 0;
        for pi in 0..order.live.len() {
            for t in &mine {
                let (kb, vb) = (&msg[at..at + block], &msg[at + block..at + 2 * block]);
                for &h in &t.dst_heads {
                    place(&mut assembled, slot_of(pi, t.dst_layer), h, kb, vb);
                }
                at += 2 * block;
            }
        }
    }

    // Write the target layout's pages and read each back.
    let (backend, kv) = target.kv_parts();
    for (pi, &pid) in order.live.iter().enumerate() {
        for layer in my_layers.clone() {
            let local = layer - my_slice.layers.start;
            let at = slot_of(pi, local);
            let want = &assembled[at..at + page_values];
            kv.write_page(backend, local, pid, want)?;
            kv.read_page(backend, local, pid, &mut page)?;
            if checksum(&page) != checksum(want) {
                tracing::warn!(rank = %me, page = %pid, layer, "flip: a KV page read back differs from what was written");
                ok = false;
            }
        }
    }
    Ok(ok)
}

#[cfg(test)]
mod tests {
    use super::*;
    use corridor_model::layout::RankSlice;

    fn cfg(layers: usize, kv_heads: usize) -> ModelConfig {
        ModelConfig {
            arch: corridor_model::config::Arch::Llama,
            vocab_size: 384,
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: layers,
            num_heads: kv_heads * 2,
            num_kv_heads: kv_heads,
            head_dim: 16,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: None,
            rope_style: corridor_backend::RopeStyle::Half,
            max_position_embeddings: 2048,
            tie_word_embeddings: false,
            attention_bias: false,
            qk_norm: false,
            bos_token_id: None,
            eos_token_ids: vec![],
            moe: None,
            hybrid: None,
        }
    }

    fn tp(cfg: &ModelConfig, heads: &[Vec<usize>]) -> Layout {
        let ranks = heads
            .iter()
            .enumerate()
            .map(|(i, h)| RankSlice { rank: Rank(i as u32), kv_heads: h.clone(), ..RankSlice::full(cfg) })
            .collect();
        Layout { kind: LayoutKind::Tensor, ranks }
    }

    fn pp(cfg: &ModelConfig, layers: &[Range<usize>]) -> Layout {
        let ranks = layers
            .iter()
            .enumerate()
            .map(|(i, l)| RankSlice { rank: Rank(i as u32), layers: l.clone(), ..RankSlice::full(cfg) })
            .collect();
        Layout { kind: LayoutKind::Pipeline, ranks }
    }

    #[test]
    fn every_head_of_every_layer_reaches_each_of_its_holders() {
        let c = cfg(4, 4);
        let from = tp(&c, &[vec![0, 1], vec![2], vec![2, 3]]);
        let to = pp(&c, &[0..2, 2..3, 3..4]);
        let plan = transfers(&c, &from, &to).unwrap();
        assert_eq!(plan.len(), 4 * 4, "one transfer per (layer, head): each stage holds a layer once");
        // Head 2 is replicated in TP: it is read from the lowest rank.
        assert!(plan.iter().filter(|t| t.head == 2).all(|t| t.src == Rank(1) && t.src_head == 0));
        let t = plan.iter().find(|t| t.layer == 3 && t.head == 3).unwrap();
        assert_eq!((t.src, t.src_layer, t.src_head, t.dst, t.dst_layer), (Rank(2), 3, 1, Rank(2), 0));
        // And back: TP's replica of head 2 is written on both of its holders.
        let back = transfers(&c, &to, &from).unwrap();
        let twos: Vec<_> = back.iter().filter(|t| t.layer == 0 && t.head == 2).map(|t| t.dst).collect();
        assert_eq!(twos, vec![Rank(1), Rank(2)]);
    }

    #[test]
    fn waves_cover_every_layer_once() {
        assert_eq!(waves(5, 2), vec![0..2, 2..4, 4..5]);
        assert_eq!(waves(3, 0), vec![0..1, 1..2, 2..3]);
        assert_eq!(waves(3, 8), vec![0..3]);
    }

    #[test]
    fn staging_shrinks_with_the_wave() {
        let c = cfg(8, 4);
        let from = tp(&c, &[vec![0, 1], vec![2, 3]]);
        let to = pp(&c, &[0..4, 4..8]);
        let plan = transfers(&c, &from, &to).unwrap();
        let whole = flip_staging(&c, &to, &plan, Rank(0), 10, 16, 8);
        let halves = flip_staging(&c, &to, &plan, Rank(0), 10, 16, 4);
        let single = flip_staging(&c, &to, &plan, Rank(0), 10, 16, 1);
        assert!(whole > halves && halves > single, "{whole} {halves} {single}");
        // Rank 0 in the wave of layers 0..4: sends heads 0,1 of nothing to
        // rank 1 (rank 1 holds 4..8), receives heads 2,3 of four layers,
        // assembles four layers of four heads: (8 + 16) head-pages.
        let head_page = 2 * 16 * c.head_dim as u64 * 4 * 10;
        assert_eq!(wave_staging(&c, &to, &plan, &(0..4), Rank(0), 10, 16), Bytes(24 * head_page));
    }

    #[test]
    fn the_fingerprint_sees_a_changed_split() {
        let c = cfg(4, 4);
        let a = [tp(&c, &[vec![0, 1], vec![2, 3]]), pp(&c, &[0..2, 2..4])];
        let b = [tp(&c, &[vec![0, 1], vec![2, 3]]), pp(&c, &[0..3, 3..4])];
        assert_eq!(fingerprint(&c, &a, 16), fingerprint(&c, &a, 16));
        assert_ne!(fingerprint(&c, &a, 16), fingerprint(&c, &b, 16));
        assert_ne!(fingerprint(&c, &a, 16), fingerprint(&c, &a, 32));
    }

    #[test]
    fn every_abandon_label_is_listed() {
        for why in [
            AbandonReason::NotUnanimous("ready"),
            AbandonReason::NotUnanimous("epoch"),
            AbandonReason::Ballot,
            AbandonReason::Check,
            AbandonReason::Failed("x".into()),
        ] {
            assert!(AbandonReason::LABELS.contains(&why.label()), "{why:?}");
        }
    }

    #[test]
    fn phases_parse_and_print() {
        assert_eq!("TP".parse::<Phase>().unwrap(), Phase::Tensor);
        assert_eq!("pipeline".parse::<Phase>().unwrap(), Phase::Pipeline);
        assert!("dp".parse::<Phase>().is_err());
        assert_eq!(Phase::Pipeline.to_string(), "pp");
        assert_eq!(Phase::Tensor.other(), Phase::Pipeline);
    }
}
