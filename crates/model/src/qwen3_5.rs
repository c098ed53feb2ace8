//! Qwen3.5 (`qwen3_5_text`: `Qwen3_5ForCausalLM`, the language model of the
//! released `Qwen3_5ForConditionalGeneration` checkpoints, and llama.cpp's
//! `qwen35` GGUF): a hybrid decoder whose layers mix tokens in one of two
//! ways, as the config's `layer_types` say.
//!
//! - Full attention (every fourth layer in the released models): grouped-query
//!   attention over the paged KV cache, as in Qwen3, with three differences:
//!   `q_proj` yields a query and an output gate per head (`[q_h, gate_h]`,
//!   split into two matrices at load), the attention output is multiplied by
//!   `sigmoid(gate)` before `o_proj`, and RoPE turns only the first
//!   `rotary_dim` dimensions of each head (`partial_rotary_factor`).
//! - Gated delta-net (linear attention): q, k and v from one projection pass
//!   through a short depthwise causal convolution and SiLU; q and k are
//!   L2-normalized; per value head a `[k_dim, v_dim]` state decays by
//!   `exp(g)` and is corrected towards v with strength `beta` at every token
//!   (the gated delta rule); its read-out is RMS-normalized, gated by
//!   `silu(z)` and projected out.
//!
//! Every RMSNorm of the residual stream and the q/k norms scale by
//! `1 + weight` (the weights are stored centred on zero); the weights are
//! widened to f32 and shifted once at load (a GGUF file stores them shifted
//! already), so the common norm kernels apply. The delta-net's own norm
//! scales by its weight as stored.
//!
//! A linear-attention layer keeps no KV: each running sequence holds a
//! fixed-size state (the convolution's last inputs and the delta rule's
//! matrices) in a slot of the workspace: the id space of the governed state
//! pool the scheduler hands slots out of ([`Model::workspace_with_state`];
//! the memory booked for them is the pool's, released and regrown by the
//! governor while the ids stay valid), or one slot per sequence that may run
//! at once; a step names each sequence's slot (`StepInput::state_slots`),
//! and a sequence with nothing cached starts from a zero state. A decode
//! step is captured as a device graph and replayed like a Llama-family one
//! (the backend uploads the slots with the step's metadata). So the state
//! cannot be rebuilt from KV pages: a sequence that is preempted recomputes
//! from its prompt, and prefix caching (which would skip rows whose state is
//! nowhere) must be off.
//!
//! A model holds one rank's [`RankSlice`]: the whole model, a pipeline stage
//! (a range of layers; the first stage embeds, the last computes logits) or
//! a tensor share. A tensor share holds its query and KV heads of the
//! full-attention layers (as in `llama.rs`), the key heads of the delta-net
//! layers in the same proportion with the value heads that read them (so
//! its state is only theirs), its FFN columns and vocabulary rows; `o_proj`,
//! `out_proj` and `down_proj` give partial sums that one all-reduce
//! completes. Each rank holds the KV and state of its own layers and heads.

use crate::checkpoint::Checkpoint;
use crate::config::{HybridConfig, LayerKind, ModelConfig};
use crate::error::LoadError;
use crate::layout::{CostModel, RankSlice};
use crate::llama::{check_shape, select, KvCache, ModelError, StepInput, Workspace};
use corridor_backend::collective::{gather_logits, Collective, Solo};
use corridor_backend::{
    ActShape, Backend, DType, DeltaGeometry, DeltaRule, HostTensor, KvGeometry, MatmulPart, QkNorm,
    RopeAttention, RopeStyle, RopeTable, StepPlan, TensorBytes, VHeadOrder,
};
use corridor_units::{Bytes, Pages, TokenId, Tokens};
use std::ops::Range;

/// One decoder layer's weights (shapes of the whole model; a tensor share
/// holds its rows or columns of each).
struct Layer<W> {
    input_layernorm: W, // [hidden], 1 + stored
    mixer: Mixer<W>,
    post_attention_layernorm: W, // [hidden], 1 + stored
    gate_proj: W,                // [ffn, hidden]
    up_proj: W,                  // [ffn, hidden]
    down_proj: W,                // [hidden, ffn]
}

/// How a layer mixes tokens.
enum Mixer<W> {
    Attention {
        q_proj: W, // [heads * head_dim, hidden]: the query rows of q_proj
        gate: W,   // [heads * head_dim, hidden]: the gate rows of q_proj
        k_proj: W, // [kv * head_dim, hidden]
        v_proj: W, // [kv * head_dim, hidden]
        q_norm: W, // [head_dim], 1 + stored
        k_norm: W, // [head_dim], 1 + stored
        o_proj: W, // [hidden, heads * head_dim]
        kv: usize, // which layer of the KV cache
    },
    Delta {
        in_proj_qkv: W, // [conv_channels, hidden]
        in_proj_z: W,   // [value_width, hidden]
        in_proj_b: W,   // [v_heads, hidden]
        in_proj_a: W,   // [v_heads, hidden]
        conv: W,        // [conv_channels, conv_kernel]
        decay: W,       // [v_heads]: exp(A_log)
        dt_bias: W,     // [v_heads]
        norm: W,        // [v_dim]
        out_proj: W,    // [hidden, value_width]
        state: usize,   // which linear layer's state
    },
}

/// The output projection.
enum Head<W> {
    Tied,
    Own(W),
}

/// A loaded Qwen3.5 model on one backend.
pub struct Model<B: Backend> {
    config: ModelConfig,
    hybrid: HybridConfig,
    slice: RankSlice,
    rope: RopeTable,
    /// This rank's share of the delta-net heads.
    share: Share,
    embed_tokens: Option<B::Weight>, // the first stage
    layers: Vec<Layer<B::Weight>>,   // the slice's layers
    norm: Option<B::Weight>,         // the last stage
    head: Option<Head<B::Weight>>,   // the last stage
}

/// The hybrid's scratch beyond the common [`Workspace`], and the recurrent
/// state of every slot.
pub struct Scratch<B: Backend> {
    gate: B::Act, // [max_rows, heads * head_dim]
    qkv: B::Act,  // [max_rows, conv_channels]
    z: B::Act,    // [max_rows, value_width]
    a: B::Act,    // [max_rows, v_heads]
    b: B::Act,    // [max_rows, v_heads]
    core: B::Act, // [max_rows, value_width]
    /// Per linear layer: `[slots, conv_state_elems]`.
    conv: Vec<B::Act>,
    /// Per linear layer: `[slots, recurrent_state_elems]`.
    recurrent: Vec<B::Act>,
    slots: usize,
}

impl<B: Backend> Scratch<B> {
    /// State slots this workspace holds.
    pub fn slots(&self) -> usize {
        self.slots
    }
}

/// The delta-net heads one rank holds: the key heads in the same share of
/// `k_heads` as its query heads are of `num_heads`, and every value head that
/// reads them, in the file's order (so a tiled file's local heads are tiled
/// too).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Share {
    pub k_heads: Range<usize>,
    pub v_heads: Vec<usize>,
    /// The local geometry: these heads only.
    pub delta: DeltaGeometry,
}

impl Share {
    pub(crate) fn of(cfg: &ModelConfig, h: &HybridConfig, s: &RankSlice) -> Share {
        let d = h.delta;
        let (nk, per) = (d.k_heads, d.v_heads / d.k_heads.max(1));
        let at = |head: usize| if head >= cfg.num_heads { nk } else { head * nk / cfg.num_heads };
        let k_heads = at(s.heads.start)..at(s.heads.end);
        let v_heads = match d.v_order {
            VHeadOrder::Grouped => k_heads.clone().flat_map(|k| k * per..(k + 1) * per).collect(),
            VHeadOrder::Tiled => (0..per).flat_map(|t| k_heads.clone().map(move |k| t * nk + k)).collect(),
        };
        let delta = DeltaGeometry { k_heads: k_heads.len(), v_heads: k_heads.len() * per, ..d };
        Share { k_heads, v_heads, delta }
    }

    /// Rows of the q, k and v channels (of `in_proj_qkv` and the conv).
    fn channels(&self, whole: &DeltaGeometry) -> Vec<Range<usize>> {
        let (dk, dv, key) = (whole.k_dim, whole.v_dim, whole.key_width());
        let (q, k) = (
            self.k_heads.start * dk..self.k_heads.end * dk,
            key + self.k_heads.start * dk..key + self.k_heads.end * dk,
        );
        let v = self.v_heads.iter().map(|&v| 2 * key + v * dv..2 * key + (v + 1) * dv);
        crate::llama::coalesce(std::iter::once(q).chain(std::iter::once(k)).chain(v))
    }

    /// Blocks of `width` per value head (rows of z, columns of out_proj).
    fn per_v_head(&self, width: usize) -> Vec<Range<usize>> {
        crate::llama::coalesce(self.v_heads.iter().map(|&v| v * width..(v + 1) * width))
    }
}

/// The hybrid part of a config, or an error naming what is missing.
fn hybrid_of(cfg: &ModelConfig) -> Result<&HybridConfig, ModelError> {
    cfg.hybrid.as_ref().ok_or_else(|| ModelError::Step("a qwen3_5 model without its hybrid config".into()))
}

impl<B: Backend> Model<B> {
    /// Load every weight of `ckpt` onto `backend`, checking shapes; `progress`
    /// ticks once for the embedding, once per layer and once for the head.
    pub fn load(backend: &B, ckpt: &Checkpoint, progress: impl FnMut(usize)) -> Result<Self, ModelError> {
        Self::load_slice(backend, ckpt, &RankSlice::full(ckpt.config()), progress)
    }

    /// Load one rank's slice: the whole model, or one pipeline stage (a
    /// range of layers with every head); a tensor slice is refused.
    pub fn load_slice(
        backend: &B,
        ckpt: &Checkpoint,
        slice: &RankSlice,
        mut progress: impl FnMut(usize),
    ) -> Result<Self, ModelError> {
        let cfg = ckpt.config().clone();
        let hybrid = hybrid_of(&cfg)?.clone();
        crate::llama::check_slice(&cfg, slice)?;
        let share = Share::of(&cfg, &hybrid, slice);
        if share.delta.k_heads == 0 && hybrid.layer_types[slice.layers.clone()].contains(&LayerKind::Linear) {
            return Err(ModelError::Step(format!(
                "{}: query heads {:?} leave this rank none of the {} delta-net key heads; give it a larger share",
                slice.rank, slice.heads, hybrid.delta.k_heads
            )));
        }
        let bytes = std::cell::Cell::new(0u64);
        place(
            ckpt,
            slice,
            &|t| {
                let (rows, cols) = t.rows_cols();
                bytes.set(bytes.get() + backend.stored_bytes(t.dtype, rows, cols));
                Ok(())
            },
            &mut |_| {},
        )?;
        backend.reserve_weights(bytes.get())?;
        let parts = place(ckpt, slice, &|t| Ok(backend.upload_weight(&t)?), &mut progress)?;
        Ok(Model {
            rope: rope_table(&cfg, &hybrid),
            share,
            slice: slice.clone(),
            config: cfg,
            hybrid,
            embed_tokens: parts.embed_tokens,
            layers: parts.layers,
            norm: parts.norm,
            head: parts.head,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn slice(&self) -> &RankSlice {
        &self.slice
    }

    /// Scratch for steps of up to `max_rows` tokens and `max_logit_rows`
    /// logit rows, with one state slot per logit row: every running sequence
    /// samples each step, so the running limit bounds both.
    pub fn workspace(
        &self,
        backend: &B,
        max_rows: Tokens,
        max_logit_rows: usize,
    ) -> Result<Workspace<B>, ModelError> {
        let own = corridor_backend::StatePlacement::Own { slots: max_logit_rows };
        self.workspace_at(backend, max_rows, max_logit_rows, &own)
    }

    /// [`Model::workspace`] with the state slots where `placement` says (at
    /// least one per logit row): a fixed block, or the governed pool the
    /// scheduler hands slots out of, whatever of it the governor holds
    /// committed. A slot holds every linear layer's convolution state, then
    /// its recurrent state, layer after layer.
    pub fn workspace_at(
        &self,
        backend: &B,
        max_rows: Tokens,
        max_logit_rows: usize,
        placement: &corridor_backend::StatePlacement,
    ) -> Result<Workspace<B>, ModelError> {
        let slots = placement.slots();
        if slots < max_logit_rows {
            return Err(ModelError::Step(format!(
                "{slots} state slots for {max_logit_rows} running sequences: each needs one"
            )));
        }
        let max_rows = max_rows.get();
        let (c, s) = (&self.config, &self.slice);
        let d = self.share.delta;
        let a = |rows: usize, cols: usize| backend.alloc_act(ActShape { rows, cols });
        let (q_out, kv_out, ffn) = (s.heads.len() * c.head_dim, s.kv_heads.len() * c.head_dim, s.ffn.len());
        let linear = self.local(LayerKind::Linear);
        let widths: Vec<usize> =
            (0..linear).flat_map(|_| [d.conv_state_elems(), d.recurrent_state_elems()]).collect();
        let mut states = backend.alloc_state_at(placement, &widths)?.into_iter();
        let (mut conv, mut recurrent) = (Vec::with_capacity(linear), Vec::with_capacity(linear));
        for _ in 0..linear {
            let (Some(c), Some(r)) = (states.next(), states.next()) else {
                return Err(ModelError::Step(format!("the backend placed fewer than {} states", 2 * linear)));
            };
            conv.push(c);
            recurrent.push(r);
        }
        let scratch = Scratch {
            gate: a(max_rows, q_out)?,
            qkv: a(max_rows, d.conv_channels())?,
            z: a(max_rows, d.value_width())?,
            a: a(max_rows, d.v_heads)?,
            b: a(max_rows, d.v_heads)?,
            core: a(max_rows, d.value_width())?,
            conv,
            recurrent,
            slots,
        };
        Ok(Workspace {
            max_rows,
            max_logit_rows,
            x: a(max_rows, c.hidden_size)?,
            h: a(max_rows, c.hidden_size)?,
            q: a(max_rows, q_out)?,
            k: a(max_rows, kv_out)?,
            v: a(max_rows, kv_out)?,
            attn: a(max_rows, q_out)?,
            proj: a(max_rows, c.hidden_size)?,
            gate: a(max_rows, ffn)?,
            up: a(max_rows, ffn)?,
            act: a(max_rows, ffn)?,
            last: a(max_logit_rows, c.hidden_size)?,
            last_n: a(max_logit_rows, c.hidden_size)?,
            logits: a(max_logit_rows, s.vocab.len())?,
            host_logits: Vec::with_capacity(max_logit_rows * s.vocab.len()),
            moe: None,
            hybrid: Some(scratch),
        })
    }

    /// This rank's layers of one kind.
    fn local(&self, kind: LayerKind) -> usize {
        self.hybrid.layer_types[self.slice.layers.clone()].iter().filter(|&&k| k == kind).count()
    }

    /// This rank's layers that hold KV (the full-attention ones).
    fn kv_layers(&self) -> usize {
        self.local(LayerKind::Full)
    }

    pub fn kv_geometry(&self, page_size: Tokens, num_pages: Pages) -> KvGeometry {
        KvGeometry {
            page_size,
            num_pages,
            kv_heads: self.slice.kv_heads.len(),
            head_dim: self.config.head_dim,
        }
    }

    /// A paged KV cache for the full-attention layers.
    pub fn kv_cache(
        &self,
        backend: &B,
        page_size: Tokens,
        num_pages: Pages,
    ) -> Result<KvCache<B>, ModelError> {
        let geometry = self.kv_geometry(page_size, num_pages);
        let layers = (0..self.kv_layers()).map(|_| backend.alloc_kv(geometry)).collect::<Result<_, _>>()?;
        Ok(KvCache { geometry, layers })
    }

    /// The KV cache of the full-attention layers where `placement` says: its
    /// own buffers, or the pages of the card's KV arena (as
    /// `llama::Model::kv_cache_at`).
    pub fn kv_cache_at(
        &self,
        backend: &B,
        page_size: Tokens,
        placement: &corridor_backend::KvPlacement,
    ) -> Result<KvCache<B>, ModelError> {
        let geometry = self.kv_geometry(page_size, placement.num_pages());
        let layers = backend.alloc_kv_at(placement, geometry, self.kv_layers())?;
        Ok(KvCache { geometry, layers })
    }

    /// Bytes of KV one token occupies (the full-attention layers only).
    pub fn kv_bytes_per_token(&self, elem_bytes: usize) -> usize {
        2 * self.kv_layers() * self.slice.kv_heads.len() * self.config.head_dim * elem_bytes
    }

    /// Bytes of recurrent state one sequence holds (f32).
    pub fn state_bytes_per_seq(&self) -> Bytes {
        state_bytes_in(&self.hybrid, &self.share.delta, self.slice.layers.clone())
    }

    /// Whether this rank's forward reads only what `begin_step` uploads, so
    /// a captured replay of it is the step itself: the whole model on the
    /// rank and a collective that may be captured. Every op, the
    /// delta-net's included, reads its step metadata (rows, page tables,
    /// state slots) from what `begin_step` uploaded.
    pub fn replayable(&self, c: &dyn Collective<B>) -> bool {
        c.capturable() && self.head.is_some() && self.embed_tokens.is_some()
    }

    /// Run this rank's part of one step: the whole model, or one pipeline
    /// stage (the first embeds, each hands its output to the next, the last
    /// leaves `[logit_rows, vocab]` in `logits`; the others leave it empty).
    pub fn forward_ranked(
        &self,
        b: &B,
        c: &dyn Collective<B>,
        ws: &mut Workspace<B>,
        kv: &mut KvCache<B>,
        step: &StepInput<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let rows = step.tokens.len();
        if step.positions.len() != rows || rows > ws.max_rows || step.logit_rows.len() > ws.max_logit_rows {
            return Err(ModelError::Step(format!(
                "a step of {rows} rows ({} positions, {} logit rows) for a workspace of {} rows and {} logit rows",
                step.positions.len(),
                step.logit_rows.len(),
                ws.max_rows,
                ws.max_logit_rows
            )));
        }
        if step.state_slots.len() != step.seqs.len() {
            return Err(ModelError::Step(format!(
                "{} state slots for {} sequences: every sequence of a hybrid model needs one",
                step.state_slots.len(),
                step.seqs.len()
            )));
        }
        if kv.layers.len() != self.kv_layers() {
            return Err(ModelError::Step(format!(
                "a KV cache of {} layers for {} full-attention layers",
                kv.layers.len(),
                self.kv_layers()
            )));
        }
        // The ops check the slots too, but a replayed step runs none of them.
        let held = ws.hybrid.as_ref().map_or(0, |sc| sc.slots);
        for (i, s) in step.state_slots.iter().enumerate() {
            if s.index() >= held {
                return Err(ModelError::Step(format!("{s} is outside the workspace's {held} state slots")));
            }
            if step.state_slots[..i].contains(s) {
                return Err(ModelError::Step(format!("{s} is given to two sequences of one step")));
            }
        }
        step.check_capture(self.replayable(c))?;
        b.begin_step(&StepPlan {
            tokens: step.tokens,
            positions: step.positions,
            seqs: step.seqs,
            logit_rows: step.logit_rows,
            state_slots: step.state_slots,
        })?;
        corridor_backend::run_captured(b, step.capture, || self.run_ops(b, c, ws, kv, step))?;
        logits.clear();
        if self.head.is_none() {
            let to = self
                .slice
                .send_to
                .ok_or_else(|| ModelError::Step("a rank without a head must send its output".into()))?;
            c.send(b, to, &ws.x, rows)?;
            b.check()?;
            return Ok(());
        }
        let n = step.logit_rows.len();
        if n == 0 {
            b.check()?;
            return Ok(());
        }
        // Each rank's vocabulary rows; only the rank that samples holds the
        // whole rows after the gather (the collective knows when no gather
        // is needed).
        let device_logits = &ws.logits;
        gather_logits(
            c,
            n,
            self.slice.vocab.clone(),
            self.config.vocab_size,
            &mut ws.host_logits,
            logits,
            |host| {
                b.read_rows(device_logits, n, host);
                b.check().map_err(ModelError::from)
            },
        )
    }

    /// Run one step with the whole model on this rank.
    pub fn forward(
        &self,
        b: &B,
        ws: &mut Workspace<B>,
        kv: &mut KvCache<B>,
        step: &StepInput<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        self.forward_ranked(b, &Solo::new(), ws, kv, step, logits)
    }

    fn run_ops(
        &self,
        b: &B,
        c: &dyn Collective<B>,
        ws: &mut Workspace<B>,
        kv: &mut KvCache<B>,
        step: &StepInput<'_>,
    ) -> Result<(), ModelError> {
        let cfg = &self.config;
        let d = self.share.delta;
        let heads = self.slice.heads.len();
        let rows = step.tokens.len();
        let eps = cfg.rms_norm_eps;
        let Some(sc) = ws.hybrid.as_mut() else {
            return Err(ModelError::Step("a hybrid model needs a workspace made by it".into()));
        };
        // A later stage receives even when it holds the table (for a tied head).
        match (self.slice.recv_from, &self.embed_tokens) {
            (Some(from), _) => c.recv(b, from, &mut ws.x, rows)?,
            (None, Some(table)) => b.embedding(table, TokenId::as_u32_slice(step.tokens), &mut ws.x)?,
            (None, None) => {
                return Err(ModelError::Step("a rank that does not embed must receive its input".into()))
            }
        }
        for (i, layer) in self.layers.iter().enumerate() {
            if i == 0 {
                b.rms_norm(&ws.x, &layer.input_layernorm, eps, rows, &mut ws.h);
            } else {
                b.add_rms_norm(&mut ws.x, &ws.proj, &layer.input_layernorm, eps, rows, &mut ws.h);
            }
            match &layer.mixer {
                Mixer::Attention { q_proj, gate, k_proj, v_proj, q_norm, k_norm, o_proj, kv: kv_index } => {
                    b.matmul_many(
                        &ws.h,
                        &mut [
                            MatmulPart { w: q_proj, bias: None, out: &mut ws.q },
                            MatmulPart { w: gate, bias: None, out: &mut sc.gate },
                            MatmulPart { w: k_proj, bias: None, out: &mut ws.k },
                            MatmulPart { w: v_proj, bias: None, out: &mut ws.v },
                        ],
                        rows,
                        None,
                    );
                    let kv_layer = &mut kv.layers[*kv_index];
                    let a = RopeAttention {
                        q: &mut ws.q,
                        k: &mut ws.k,
                        v: &ws.v,
                        norm: Some(QkNorm { q: q_norm, k: k_norm, eps, rows }),
                        table: &self.rope,
                        head_dim: cfg.head_dim,
                        positions: step.positions,
                        kv: kv_layer,
                        seqs: step.seqs,
                    };
                    b.rope_attention(a, heads, &mut ws.attn);
                    b.sigmoid_mul(&mut ws.attn, &sc.gate, rows)?;
                    b.matmul(&ws.attn, o_proj, None, rows, &mut ws.proj);
                    c.all_reduce_sum(b, &mut ws.proj, rows)?;
                }
                Mixer::Delta {
                    in_proj_qkv,
                    in_proj_z,
                    in_proj_b,
                    in_proj_a,
                    conv,
                    decay,
                    dt_bias,
                    norm,
                    out_proj,
                    state,
                } => {
                    b.matmul_many(
                        &ws.h,
                        &mut [
                            MatmulPart { w: in_proj_qkv, bias: None, out: &mut sc.qkv },
                            MatmulPart { w: in_proj_z, bias: None, out: &mut sc.z },
                            MatmulPart { w: in_proj_b, bias: None, out: &mut sc.b },
                            MatmulPart { w: in_proj_a, bias: None, out: &mut sc.a },
                        ],
                        rows,
                        None,
                    );
                    b.causal_conv_silu(&mut sc.qkv, conv, &mut sc.conv[*state], step.seqs, step.state_slots)?;
                    b.gated_delta_rule(DeltaRule {
                        qkv: &sc.qkv,
                        a: &sc.a,
                        b: &sc.b,
                        decay,
                        dt_bias,
                        geometry: d,
                        state: &mut sc.recurrent[*state],
                        seqs: step.seqs,
                        slots: step.state_slots,
                        out: &mut sc.core,
                    })?;
                    b.gated_rms_norm(&mut sc.core, &sc.z, norm, eps, d.v_dim, rows)?;
                    b.matmul(&sc.core, out_proj, None, rows, &mut ws.proj);
                    c.all_reduce_sum(b, &mut ws.proj, rows)?;
                }
            }
            b.add_rms_norm(&mut ws.x, &ws.proj, &layer.post_attention_layernorm, eps, rows, &mut ws.h);
            b.gate_up_silu(
                &ws.h,
                &layer.gate_proj,
                &layer.up_proj,
                rows,
                &mut ws.gate,
                &mut ws.up,
                &mut ws.act,
            );
            b.matmul(&ws.act, &layer.down_proj, None, rows, &mut ws.proj);
            c.all_reduce_sum(b, &mut ws.proj, rows)?;
        }
        if !self.layers.is_empty() {
            b.add_assign(&mut ws.x, &ws.proj, rows);
        }
        let n = step.logit_rows.len();
        if n == 0 {
            return Ok(());
        }
        b.gather_rows(&ws.x, step.logit_rows, &mut ws.last);
        let (Some(norm), Some(head)) = (&self.norm, &self.head) else {
            return Ok(());
        };
        b.rms_norm(&ws.last, norm, eps, n, &mut ws.last_n);
        let head = match head {
            Head::Own(w) => w,
            Head::Tied => self
                .embed_tokens
                .as_ref()
                .ok_or_else(|| ModelError::Step("a tied head needs the embedding".into()))?,
        };
        b.matmul(&ws.last_n, head, None, n, &mut ws.logits);
        Ok(())
    }
}

/// RoPE over the first `rotary_dim` dimensions of each head, with
/// frequencies spaced over those dimensions alone (as transformers computes
/// them for a partial rotary factor).
fn rope_table(cfg: &ModelConfig, h: &HybridConfig) -> RopeTable {
    let dim = h.rotary_dim;
    let inv_freq = (0..dim / 2)
        .map(|i| (1.0 / (cfg.rope_theta as f64).powf((2 * i) as f64 / dim as f64)) as f32)
        .collect();
    RopeTable { style: RopeStyle::Half, rot_dim: dim, inv_freq }
}

/// A model's weights, placed by `place`'s upload function.
struct Parts<W> {
    embed_tokens: Option<W>,
    layers: Vec<Layer<W>>,
    norm: Option<W>,
    head: Option<Head<W>>,
}

/// A float vector as f32 values, whatever it is stored as.
fn f32_values(t: &HostTensor) -> Result<Vec<f32>, ModelError> {
    if t.dtype.is_quantized() {
        return Err(ModelError::Load(LoadError::UnsupportedDType {
            file: std::path::PathBuf::new(),
            tensor: t.name.clone(),
            dtype: format!("{} (a norm vector must be a float type)", t.dtype),
        }));
    }
    let mut out = vec![0f32; t.elems()];
    corridor_backend::cpu::quant::dequantize_row(t.dtype, t.data.bytes(), &mut out);
    Ok(out)
}

/// An f32 tensor of `values` shaped `shape`.
fn f32_tensor(name: &str, shape: Vec<usize>, values: &[f32]) -> HostTensor {
    HostTensor {
        name: name.into(),
        dtype: DType::F32,
        shape,
        data: TensorBytes::from_vec(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
    }
}

/// Where a checkpoint keeps the model's tensors, and in which conventions.
enum Source<'a> {
    /// Hugging Face names under `root` (`model`, or `model.language_model`
    /// in a multimodal checkpoint), norms stored centred on zero, `A_log`.
    Hf { root: &'static str },
    /// llama.cpp's `qwen35` names: norms stored as `1 + weight` already, the
    /// decay as `ssm_a = -exp(A_log)`, the convolution squeezed to
    /// `[channels, taps]`, value heads tiled (the config says so).
    Gguf(&'a crate::gguf::GgufFile),
}

impl Source<'_> {
    fn of(ckpt: &Checkpoint) -> Source<'_> {
        match ckpt.gguf() {
            Some(g) => Source::Gguf(g),
            // The language model of a multimodal checkpoint is `model.language_model.*`.
            None if ckpt.has_tensor("model.language_model.embed_tokens.weight") => {
                Source::Hf { root: "model.language_model" }
            }
            None => Source::Hf { root: "model" },
        }
    }

    /// The Hugging Face name of a tensor: of layer `layer`, or of the model.
    fn hf_name(&self, layer: Option<usize>, part: &str) -> String {
        let root = match self {
            Source::Hf { root } => root,
            Source::Gguf(_) => "model",
        };
        match layer {
            Some(i) => format!("{root}.layers.{i}.{part}"),
            None if part == "lm_head.weight" => part.to_string(),
            None => format!("{root}.{part}"),
        }
    }

    /// The tensor, named by its Hugging Face name whatever the file calls it.
    fn read(&self, ckpt: &Checkpoint, layer: Option<usize>, part: &str) -> Result<HostTensor, ModelError> {
        let label = self.hf_name(layer, part);
        match self {
            Source::Hf { .. } => Ok(ckpt.tensor(&label)?),
            Source::Gguf(g) => {
                let name = gguf_name(layer, part).ok_or_else(|| {
                    ModelError::Load(LoadError::MissingTensor {
                        file: g.path().to_path_buf(),
                        tensor: format!("{label} (no qwen35 GGUF name)"),
                    })
                })?;
                Ok(g.tensor_as(&name, &label)?)
            }
        }
    }

    fn has(&self, ckpt: &Checkpoint, layer: Option<usize>, part: &str) -> bool {
        match self {
            Source::Hf { .. } => ckpt.has_tensor(&self.hf_name(layer, part)),
            Source::Gguf(g) => gguf_name(layer, part).is_some_and(|n| g.has_tensor(&n)),
        }
    }
}

/// llama.cpp's `qwen35` name of a tensor given by its Hugging Face part name.
fn gguf_name(layer: Option<usize>, part: &str) -> Option<String> {
    let Some(i) = layer else {
        return match part {
            "embed_tokens.weight" => Some("token_embd.weight".into()),
            "norm.weight" => Some("output_norm.weight".into()),
            "lm_head.weight" => Some("output.weight".into()),
            _ => None,
        };
    };
    let name = match part {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "post_attention_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        "linear_attn.in_proj_qkv.weight" => "attn_qkv.weight",
        "linear_attn.in_proj_z.weight" => "attn_gate.weight",
        "linear_attn.in_proj_b.weight" => "ssm_beta.weight",
        "linear_attn.in_proj_a.weight" => "ssm_alpha.weight",
        "linear_attn.conv1d.weight" => "ssm_conv1d.weight",
        "linear_attn.A_log" => "ssm_a",
        "linear_attn.dt_bias" => "ssm_dt.bias",
        "linear_attn.norm.weight" => "ssm_norm.weight",
        "linear_attn.out_proj.weight" => "ssm_out.weight",
        _ => return None,
    };
    Some(format!("blk.{i}.{name}"))
}

/// Columns `blocks` (concatenated) of a matrix: bytes copied where the
/// blocks are whole storage blocks, else widened to f32 (exactly the values
/// the kernels would dequantize). The whole matrix comes back as it is.
fn select_cols(t: HostTensor, blocks: &[Range<usize>]) -> Result<HostTensor, ModelError> {
    let (rows, ncols) = t.rows_cols();
    if blocks.len() == 1 && blocks[0] == (0..ncols) {
        return Ok(t);
    }
    if blocks.len() == 1 {
        return select(t, std::slice::from_ref(&(0..rows)), Some(blocks[0].clone()));
    }
    let bad = |reason: String| {
        ModelError::Backend(corridor_backend::BackendError::BadTensor { name: t.name.clone(), reason })
    };
    if blocks.iter().any(|b| b.end > ncols || b.start > b.end) {
        return Err(bad(format!("columns {blocks:?} outside {:?}", t.shape)));
    }
    let (be, bb) = (t.dtype.block_elems(), t.dtype.block_bytes());
    let row_bytes = t
        .dtype
        .bytes_for(ncols)
        .ok_or_else(|| bad(format!("{ncols} columns are not whole {} blocks", t.dtype)))?;
    let width: usize = blocks.iter().map(|b| b.len()).sum();
    let data = t.data.bytes();
    let aligned = blocks.iter().all(|b| b.start.is_multiple_of(be) && b.end.is_multiple_of(be));
    let mut bytes = Vec::new();
    let dtype = if aligned {
        for r in 0..rows {
            let row = &data[r * row_bytes..(r + 1) * row_bytes];
            for b in blocks {
                bytes.extend_from_slice(&row[b.start / be * bb..b.end / be * bb]);
            }
        }
        t.dtype
    } else {
        let mut row = vec![0f32; ncols];
        for r in 0..rows {
            corridor_backend::cpu::quant::dequantize_row(
                t.dtype,
                &data[r * row_bytes..(r + 1) * row_bytes],
                &mut row,
            );
            for b in blocks {
                bytes.extend(row[b.clone()].iter().flat_map(|v| v.to_le_bytes()));
            }
        }
        DType::F32
    };
    Ok(HostTensor {
        name: t.name.clone(),
        dtype,
        shape: vec![rows, width],
        data: TensorBytes::from_vec(bytes),
    })
}

/// Read every tensor of `slice`, checking shapes, cut it to the slice and
/// hand it (reshaped or converted where the kernels want it so) to `up`.
fn place<W>(
    ckpt: &Checkpoint,
    slice: &RankSlice,
    up: &dyn Fn(HostTensor) -> Result<W, ModelError>,
    progress: &mut dyn FnMut(usize),
) -> Result<Parts<W>, ModelError> {
    let cfg = ckpt.config();
    let h = hybrid_of(cfg)?;
    let d = h.delta;
    let share = Share::of(cfg, h, slice);
    let (hidden, hd, ffn) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let (q_out, kv_out) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
    let src = Source::of(ckpt);
    let gguf = matches!(src, Source::Gguf(_));
    let read = |layer: Option<usize>, part: &str, shape: &[usize]| -> Result<HostTensor, ModelError> {
        let t = src.read(ckpt, layer, part)?;
        check_shape(ckpt, &t, shape)?;
        Ok(t)
    };
    let load = |layer: Option<usize>, part: &str, shape: &[usize]| up(read(layer, part, shape)?);
    let rows = |layer: Option<usize>, part: &str, shape: &[usize], blocks: &[Range<usize>]| {
        up(select(read(layer, part, shape)?, blocks, None)?)
    };
    let cols = |layer: Option<usize>, part: &str, shape: &[usize], blocks: &[Range<usize>]| {
        up(select_cols(read(layer, part, shape)?, blocks)?)
    };
    // A vector's chosen elements, computed from the stored ones, as f32.
    let mapped = |layer: Option<usize>, part: &str, n: usize, pick: &[usize], f: &dyn Fn(f32) -> f32| {
        let t = read(layer, part, &[n])?;
        let all = f32_values(&t)?;
        let values: Vec<f32> = pick.iter().map(|&i| f(all[i])).collect();
        up(f32_tensor(&t.name, vec![values.len()], &values))
    };
    let every = |n: usize| (0..n).collect::<Vec<_>>();
    // A zero-centred norm: the kernels scale by the weight, so hand them
    // 1 + w (a GGUF file stores it so already).
    let norm = |layer: Option<usize>, part: &str, n: usize| -> Result<W, ModelError> {
        if gguf {
            load(layer, part, &[n])
        } else {
            mapped(layer, part, n, &every(n), &|w| 1.0 + w)
        }
    };
    // A present lm_head always wins, as in transformers' loading; a tied head
    // over the whole vocabulary is the embedding table itself.
    let tied = !src.has(ckpt, None, "lm_head.weight");
    let whole_vocab = slice.vocab == (0..cfg.vocab_size);
    let embed_tokens = if slice.embeds() || (tied && whole_vocab && slice.emits_logits()) {
        Some(load(None, "embed_tokens.weight", &[cfg.vocab_size, hidden])?)
    } else {
        None
    };
    progress(1);
    let q_heads: Vec<Range<usize>> = slice.heads.clone().map(|j| 2 * j * hd..(2 * j + 1) * hd).collect();
    let g_heads: Vec<Range<usize>> =
        slice.heads.clone().map(|j| (2 * j + 1) * hd..(2 * j + 2) * hd).collect();
    let kv_rows = crate::llama::coalesce(slice.kv_heads.iter().map(|&k| k * hd..(k + 1) * hd));
    let o_range = slice.heads.start * hd..slice.heads.end * hd;
    let o_cols = std::slice::from_ref(&o_range);
    let (channels, z_rows, heads_v) = (share.channels(&d), share.per_v_head(d.v_dim), share.per_v_head(1));
    let ffn_rows = [slice.ffn.clone()];
    let (mut kv, mut state) = (0, 0);
    let mut layers = Vec::with_capacity(slice.layers.len());
    for i in slice.layers.clone() {
        let l = Some(i);
        let mixer = match h.layer_types[i] {
            LayerKind::Full => {
                // q_proj interleaves per head: head j's query rows, then its gate rows.
                let q = read(l, "self_attn.q_proj.weight", &[2 * q_out, hidden])?;
                let m = Mixer::Attention {
                    q_proj: up(select(q.clone(), &q_heads, None)?)?,
                    gate: up(select(q, &g_heads, None)?)?,
                    k_proj: rows(l, "self_attn.k_proj.weight", &[kv_out, hidden], &kv_rows)?,
                    v_proj: rows(l, "self_attn.v_proj.weight", &[kv_out, hidden], &kv_rows)?,
                    q_norm: norm(l, "self_attn.q_norm.weight", hd)?,
                    k_norm: norm(l, "self_attn.k_norm.weight", hd)?,
                    o_proj: cols(l, "self_attn.o_proj.weight", &[hidden, q_out], o_cols)?,
                    kv,
                };
                kv += 1;
                m
            }
            LayerKind::Linear => {
                let all = d.conv_channels();
                let conv = src.read(ckpt, l, "linear_attn.conv1d.weight")?;
                // [channels, 1, taps] as trained, [channels, taps] once squeezed.
                let want: &[usize] =
                    if conv.shape.len() == 3 { &[all, 1, d.conv_kernel] } else { &[all, d.conv_kernel] };
                check_shape(ckpt, &conv, want)?;
                let conv = HostTensor { shape: vec![all, d.conv_kernel], ..conv };
                let v = &share.v_heads;
                // The kernels take the decay rate exp(A_log); a GGUF file
                // stores its negation.
                let decay = if gguf {
                    mapped(l, "linear_attn.A_log", d.v_heads, v, &|a| -a)?
                } else {
                    mapped(l, "linear_attn.A_log", d.v_heads, v, &f32::exp)?
                };
                let m = Mixer::Delta {
                    in_proj_qkv: rows(l, "linear_attn.in_proj_qkv.weight", &[all, hidden], &channels)?,
                    in_proj_z: rows(l, "linear_attn.in_proj_z.weight", &[d.value_width(), hidden], &z_rows)?,
                    in_proj_b: rows(l, "linear_attn.in_proj_b.weight", &[d.v_heads, hidden], &heads_v)?,
                    in_proj_a: rows(l, "linear_attn.in_proj_a.weight", &[d.v_heads, hidden], &heads_v)?,
                    conv: up(select(conv, &channels, None)?)?,
                    decay,
                    dt_bias: mapped(l, "linear_attn.dt_bias", d.v_heads, v, &|x| x)?,
                    norm: load(l, "linear_attn.norm.weight", &[d.v_dim])?,
                    out_proj: cols(l, "linear_attn.out_proj.weight", &[hidden, d.value_width()], &z_rows)?,
                    state,
                };
                state += 1;
                m
            }
        };
        layers.push(Layer {
            input_layernorm: norm(l, "input_layernorm.weight", hidden)?,
            mixer,
            post_attention_layernorm: norm(l, "post_attention_layernorm.weight", hidden)?,
            gate_proj: rows(l, "mlp.gate_proj.weight", &[ffn, hidden], &ffn_rows)?,
            up_proj: rows(l, "mlp.up_proj.weight", &[ffn, hidden], &ffn_rows)?,
            down_proj: cols(l, "mlp.down_proj.weight", &[hidden, ffn], &ffn_rows)?,
        });
        progress(1);
    }
    let (norm_w, head) = if slice.emits_logits() {
        let vocab_rows = [slice.vocab.clone()];
        let head = match (tied, whole_vocab) {
            (true, true) => Head::Tied,
            (true, false) => {
                Head::Own(rows(None, "embed_tokens.weight", &[cfg.vocab_size, hidden], &vocab_rows)?)
            }
            (false, _) => Head::Own(rows(None, "lm_head.weight", &[cfg.vocab_size, hidden], &vocab_rows)?),
        };
        (Some(norm(None, "norm.weight", hidden)?), Some(head))
    } else {
        (None, None)
    };
    progress(1);
    Ok(Parts { embed_tokens, layers, norm: norm_w, head })
}

/// Bytes of recurrent state one sequence holds across every linear layer
/// (f32: the convolution's window and the delta rule's matrices).
pub fn state_bytes_per_seq(h: &HybridConfig) -> Bytes {
    state_bytes_in(h, &h.delta, 0..h.layer_types.len())
}

/// As [`state_bytes_per_seq`], for heads `d` of the linear layers among `layers`.
fn state_bytes_in(h: &HybridConfig, d: &DeltaGeometry, layers: Range<usize>) -> Bytes {
    let per_layer = d.conv_state_elems() + d.recurrent_state_elems();
    Bytes((4 * per_layer * count_in(h, layers, LayerKind::Linear)) as u64)
}

/// Layers of `kind` among `layers`.
fn count_in(h: &HybridConfig, layers: Range<usize>, kind: LayerKind) -> usize {
    h.layer_types[layers].iter().filter(|&&k| k == kind).count()
}

/// The hybrid's prices for the layout cost model: weight, workspace, state
/// and KV bytes of a slice (the whole model, a pipeline stage or a tensor
/// share).
pub mod cost {
    use super::*;

    /// Weight bytes of `s` (norms, gates' vectors and the convolution priced
    /// as f32).
    pub fn weights(m: &CostModel, cfg: &ModelConfig, h: &HybridConfig, s: &RankSlice) -> Bytes {
        let w = |elems: usize| crate::layout::elems_bytes(m.weight_dtype, elems);
        let f32s = |elems: usize| (elems * 4) as u64;
        let (hid, hd, d) = (cfg.hidden_size, cfg.head_dim, Share::of(cfg, h, s).delta);
        let (q, kv) = (s.heads.len() * hd, s.kv_heads.len() * hd);
        let full = w(2 * q * hid) + 2 * w(kv * hid) + w(hid * q) + f32s(2 * hd);
        let linear = w(d.conv_channels() * hid)
            + w(d.value_width() * hid)
            + 2 * w(d.v_heads * hid)
            + f32s(d.conv_channels() * d.conv_kernel + 2 * d.v_heads + d.v_dim)
            + w(hid * d.value_width());
        let per_layer = |kind: &LayerKind| {
            f32s(2 * hid)
                + 3 * w(s.ffn.len() * hid)
                + match kind {
                    LayerKind::Full => full,
                    LayerKind::Linear => linear,
                }
        };
        let mut total: u64 = h.layer_types[s.layers.clone()].iter().map(per_layer).sum();
        let shared = cfg.tie_word_embeddings && s.vocab.len() == cfg.vocab_size;
        if s.embeds() || (shared && s.emits_logits()) {
            total += w(cfg.vocab_size * hid);
        }
        if s.emits_logits() {
            total += f32s(hid) + if shared { 0 } else { w(s.vocab.len() * hid) };
        }
        Bytes(total)
    }

    /// State bytes of `s`: one slot per logit row, its heads of its linear layers.
    pub fn state(m: &CostModel, cfg: &ModelConfig, h: &HybridConfig, s: &RankSlice) -> Bytes {
        let d = Share::of(cfg, h, s).delta;
        Bytes(state_bytes_in(h, &d, s.layers.clone()).get() * m.max_logit_rows as u64)
    }

    /// Workspace bytes of `s` (see [`super::workspace_bytes`]).
    pub fn workspace(m: &CostModel, cfg: &ModelConfig, h: &HybridConfig, s: &RankSlice) -> Bytes {
        let d = Share::of(cfg, h, s).delta;
        let (q, kv) = (s.heads.len() * cfg.head_dim, s.kv_heads.len() * cfg.head_dim);
        let per_row = 3 * cfg.hidden_size
            + 3 * q
            + 2 * kv
            + 3 * s.ffn.len()
            + d.conv_channels()
            + 2 * d.value_width()
            + 2 * d.v_heads;
        let per_logit_row = 2 * cfg.hidden_size + s.vocab.len() + cfg.vocab_size;
        Bytes(4 * (m.max_rows * per_row + m.max_logit_rows * per_logit_row) as u64)
    }

    /// KV bytes one token takes on `s`: K and V of its full-attention layers.
    pub fn kv_per_token(m: &CostModel, cfg: &ModelConfig, h: &HybridConfig, s: &RankSlice) -> Bytes {
        let full = count_in(h, s.layers.clone(), LayerKind::Full) as u64;
        Bytes(full * 2 * (s.kv_heads.len() * cfg.head_dim) as u64 * m.kv_elem_bytes)
    }
}

/// Activation workspace bytes for steps of `max_rows` rows and
/// `max_logit_rows` logit rows (the state slots are [`state_bytes`]).
pub fn workspace_bytes(cfg: &ModelConfig, h: &HybridConfig, max_rows: usize, max_logit_rows: usize) -> Bytes {
    let (q, kv, d) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, h.delta);
    let per_row = 3 * cfg.hidden_size
        + 3 * q
        + 2 * kv
        + 3 * cfg.intermediate_size
        + d.conv_channels()
        + 2 * d.value_width()
        + 2 * d.v_heads;
    let per_logit_row = 2 * cfg.hidden_size + cfg.vocab_size;
    Bytes(4 * (max_rows * per_row + max_logit_rows * per_logit_row) as u64)
}

/// Bytes of `slots` state slots, allocated once with the workspace.
pub fn state_bytes(h: &HybridConfig, slots: usize) -> Bytes {
    Bytes(state_bytes_per_seq(h).get() * slots as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use corridor_units::Tokens;

    fn fixture() -> Checkpoint {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/qwen3_5");
        Checkpoint::open(&dir).unwrap()
    }

    /// A step's slots are checked before anything runs: a replayed step
    /// runs none of the ops that would otherwise refuse them.
    #[test]
    fn slots_outside_the_workspace_or_shared_are_refused_before_any_op() {
        use corridor_backend::cpu::CpuBackend;
        use corridor_backend::SeqStep;
        use corridor_units::{PageId, StateSlot};
        let b = CpuBackend::new();
        let model = Model::load(&b, &fixture(), |_| {}).unwrap();
        let mut ws = model.workspace(&b, Tokens(4), 2).unwrap();
        let mut kv = model.kv_cache(&b, Tokens(16), Pages(2)).unwrap();
        let pages = [PageId(0)];
        let pages2 = [PageId(1)];
        let seqs = [
            SeqStep { row_start: 0, rows: 1, cached: 0, pages: &pages },
            SeqStep { row_start: 1, rows: 1, cached: 0, pages: &pages2 },
        ];
        let run = |slots: &[StateSlot], ws: &mut Workspace<CpuBackend>, kv: &mut KvCache<CpuBackend>| {
            let step = StepInput {
                tokens: &[TokenId(1), TokenId(2)],
                positions: &[0, 0],
                seqs: &seqs,
                logit_rows: &[0, 1],
                state_slots: slots,
                capture: None,
            };
            model.forward(&b, ws, kv, &step, &mut Vec::new()).map_err(|e| e.to_string())
        };
        let shared = run(&[StateSlot(1), StateSlot(1)], &mut ws, &mut kv).unwrap_err();
        assert!(shared.contains("two sequences") && !shared.contains("causal_conv_silu"), "{shared}");
        let outside = run(&[StateSlot(0), StateSlot(2)], &mut ws, &mut kv).unwrap_err();
        assert!(outside.contains("outside the workspace's 2 state slots"), "{outside}");
        run(&[StateSlot(1), StateSlot(0)], &mut ws, &mut kv).unwrap();

        // Slots of a state pool: any id of its space is a slot the step may
        // name, beyond the running limit; fewer slots than logit rows is refused.
        use corridor_backend::StatePlacement;
        let few =
            model.workspace_at(&b, Tokens(4), 2, &StatePlacement::Own { slots: 1 }).err().expect("refused");
        assert!(few.to_string().contains("1 state slots for 2 running sequences"), "{few}");
        let mut pooled = model.workspace_at(&b, Tokens(4), 2, &StatePlacement::Own { slots: 6 }).unwrap();
        assert_eq!(pooled.state_slots(), 6);
        run(&[StateSlot(5), StateSlot(3)], &mut pooled, &mut kv).unwrap();
    }

    fn cost() -> CostModel {
        CostModel {
            weight_dtype: DType::F32,
            kv_elem_bytes: 4,
            page_size: Tokens(16),
            max_rows: 8,
            max_logit_rows: 4,
            chunk_target: crate::layout::DEFAULT_CHUNK_TARGET,
        }
    }

    /// The cost model prices every tensor of the (f32) checkpoint: what it
    /// says is the file less its header.
    #[test]
    fn weight_price_is_the_checkpoint_less_its_header() {
        let ckpt = fixture();
        let cfg = ckpt.config();
        let priced = cost().weights(cfg, &RankSlice::full(cfg)).get();
        let file = ckpt.file_bytes();
        assert!(priced <= file && file - priced < 16 * 1024, "priced {priced} of a {file}-byte file");
    }

    /// Pipeline stages price what they hold: their weights, KV and state
    /// add up to the whole model's.
    #[test]
    fn pipeline_stages_add_up_to_the_whole() {
        let ckpt = fixture();
        let cfg = ckpt.config();
        let whole = RankSlice::full(cfg);
        let m = cost();
        for split in [[3, 1], [1, 3], [4, 0]] {
            let l = crate::layout::Layout::pipeline(cfg, &split).unwrap();
            let sum = |f: &dyn Fn(&RankSlice) -> Bytes| l.ranks.iter().map(|s| f(s).get()).sum::<u64>();
            assert_eq!(sum(&|s| m.weights(cfg, s)), m.weights(cfg, &whole).get(), "{split:?}");
            assert_eq!(sum(&|s| m.kv_per_token(cfg, s)), m.kv_per_token(cfg, &whole).get(), "{split:?}");
            assert_eq!(sum(&|s| m.state(cfg, s)), m.state(cfg, &whole).get(), "{split:?}");
        }
        let l = crate::layout::Layout::pipeline(cfg, &[3, 1]).unwrap();
        assert_eq!(m.kv_per_token(cfg, &l.ranks[0]).get(), 0, "three linear layers hold no KV");
        assert_eq!(m.state(cfg, &l.ranks[1]).get(), 0, "the full-attention layer holds no state");
    }

    /// KV is held by the full-attention layers only; the state by the linear
    /// ones, per sequence, whatever its length.
    #[test]
    fn kv_and_state_are_priced_by_their_layers() {
        let ckpt = fixture();
        let cfg = ckpt.config();
        let h = cfg.hybrid.as_ref().unwrap();
        assert_eq!((h.count(LayerKind::Full), h.count(LayerKind::Linear)), (1, 3));
        let kv = cost().kv_per_token(cfg, &RankSlice::full(cfg)).get();
        assert_eq!(kv, (2 * cfg.num_kv_heads * cfg.head_dim * 4) as u64);
        let d = h.delta;
        let per_layer = 4 * (3 * d.conv_channels() + d.v_heads * d.k_dim * d.v_dim) as u64;
        assert_eq!(state_bytes_per_seq(h).get(), 3 * per_layer);
        let backend = corridor_backend::cpu::CpuBackend::new();
        let model = Model::load(&backend, &ckpt, |_| {}).unwrap();
        assert_eq!(model.kv_bytes_per_token(4) as u64, kv);
        assert_eq!(cost().state(cfg, &RankSlice::full(cfg)).get(), 4 * 3 * per_layer, "a slot per logit row");
    }
}
