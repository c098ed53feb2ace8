//! The Llama family of decoders: Llama (with Llama 3.1 rope scaling),
//! Mistral (dense), Qwen2 and Qwen3, with grouped-query attention throughout.
//!
//! The four architectures share one layer structure and one set of checkpoint
//! names; what differs is carried by `ModelConfig` and read here in one place:
//! - Qwen2: Q, K and V projections have a bias (`attention_bias`);
//! - Qwen3: Q and K are RMS-normalized per head before RoPE (`qk_norm`), and
//!   `head_dim` is explicit (it need not be hidden / heads);
//! - Llama 3.1: `rope_scaling` of type `llama3` (see `rope.rs`);
//! - tied embeddings (small Qwen2, SmolLM2): the output projection is the
//!   embedding table (`tie_word_embeddings`);
//! - Qwen3-MoE: Qwen3 attention, and on the layers its config marks sparse a
//!   routed mixture of SwiGLU experts in place of the MLP (see `moe.rs`).
//!
//! The forward pass is written once against [`Backend`] and reads top to
//! bottom: embed → layers (norm → attention → residual → norm → MLP →
//! residual) → final norm → logits for the rows that need them.
//!
//! A model holds one rank's [`RankSlice`]: its layers, query heads, KV heads,
//! FFN columns and vocabulary rows. `q/k/v/gate/up` are sliced by rows and
//! `o_proj/down_proj` by columns, so each rank's attention and MLP outputs are
//! partial sums that one all-reduce completes; the logits of each rank's
//! vocabulary rows are all-gathered; pipeline stages receive and send the
//! hidden state. With the whole model on one rank every exchange is the
//! identity ([`Solo`]), so the same code runs one card and a layout.

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::error::LoadError;
use crate::layout::RankSlice;
use crate::rope::rope_table;
use corridor_backend::collective::{gather_logits, Collective, CollectiveError, Solo};
use corridor_backend::sample::{LogitEdit, SampleRowSpec, SampledRows};
use corridor_backend::{
    ActShape, Backend, BackendError, DType, Expert, GraphKey, HostTensor, KvGeometry, KvPlacement,
    MatmulPart, MoeFfn, MoeScratch, MoeShape, QkNorm, ResidualNorm, RopeAttention, RopeTable, Routing,
    SeqStep, StepPlan, TensorBytes,
};
use corridor_units::{Pages, StateSlot, TokenId, Tokens};
use std::ops::Range;

/// Errors from building or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error("{0}")]
    Step(String),
}

/// One decoder layer's weights, named as in the checkpoint, sliced to the
/// rank: `heads`, `kv` and `ffn` below are the rank's local counts.
struct Layer<W> {
    input_layernorm: W,          // [hidden]
    q_proj: W,                   // [heads * head_dim, hidden]
    k_proj: W,                   // [kv * head_dim, hidden]
    v_proj: W,                   // [kv * head_dim, hidden]
    qkv_bias: Option<[W; 3]>,    // Qwen2: [q_out], [kv_out], [kv_out]
    qk_norm: Option<[W; 2]>,     // Qwen3: [head_dim] each
    o_proj: W,                   // [hidden, heads * head_dim]
    post_attention_layernorm: W, // [hidden]
    ffn: Ffn<W>,
}

/// A layer's feed-forward block.
enum Ffn<W> {
    /// The gated MLP, sliced to the rank's FFN columns.
    Dense {
        gate_proj: W, // [ffn, hidden]
        up_proj: W,   // [ffn, hidden]
        down_proj: W, // [hidden, ffn]
    },
    /// A mixture of experts: the whole router and every expert, each sliced
    /// to the rank's expert columns. The all-reduce before the layer hands
    /// every rank the same input, so all ranks route alike, and their
    /// outputs are partial sums, like the dense MLP's.
    Sparse {
        router: W, // [num_experts, hidden]
        experts: Vec<Expert<W>>,
    },
}

/// The output projection of a rank that computes logits.
enum Head<W> {
    /// The embedding table itself (tied, whole vocabulary, held here anyway).
    Tied,
    /// Its own rows: `[vocab share, hidden]`.
    Own(W),
}

/// A rank's weights, placed by whatever `place` function built them: the
/// backend's upload, or a count of the bytes an upload would take.
struct Parts<W> {
    embed_tokens: Option<W>,
    layers: Vec<Layer<W>>,
    norm: Option<W>,
    head: Option<Head<W>>,
}

/// A loaded model (one rank's slice of it) on one backend.
pub struct Model<B: Backend> {
    config: ModelConfig,
    slice: RankSlice,
    rope: RopeTable,
    embed_tokens: Option<B::Weight>, // [vocab, hidden]; ranks that embed
    layers: Vec<Layer<B::Weight>>,
    norm: Option<B::Weight>,       // [hidden]; ranks that compute logits
    head: Option<Head<B::Weight>>, // ranks that compute logits
    /// `[1, hidden]` of zeros for a model with sparse layers: embedding it
    /// clears the buffer the experts' outputs are summed into.
    zero_row: Option<B::Weight>,
    /// Per local layer, the backend's table of a sparse layer's experts.
    expert_tables: Vec<Option<B::ExpertTable>>,
    /// Every sparse layer's FFN runs on the device: a decode step may be captured.
    moe_on_device: bool,
}

/// Scratch activations for one forward pass, allocated once at the largest
/// step the scheduler may form, so a forward pass allocates nothing.
pub struct Workspace<B: Backend> {
    pub(crate) max_rows: usize,
    pub(crate) max_logit_rows: usize,
    pub(crate) x: B::Act,      // [max_rows, hidden]     the residual stream
    pub(crate) h: B::Act,      // [max_rows, hidden]     normalized input of a block
    pub(crate) q: B::Act,      // [max_rows, heads * head_dim]
    pub(crate) k: B::Act,      // [max_rows, kv_heads * head_dim]
    pub(crate) v: B::Act,      // [max_rows, kv_heads * head_dim]
    pub(crate) attn: B::Act,   // [max_rows, heads * head_dim]
    pub(crate) proj: B::Act,   // [max_rows, hidden]     output of o_proj / down_proj
    pub(crate) gate: B::Act,   // [max_rows, intermediate]
    pub(crate) up: B::Act,     // [max_rows, intermediate]
    pub(crate) act: B::Act,    // [max_rows, intermediate] silu(gate) * up
    pub(crate) last: B::Act,   // [max_logit_rows, hidden]
    pub(crate) last_n: B::Act, // [max_logit_rows, hidden]
    pub(crate) logits: B::Act, // [max_logit_rows, vocab share]
    /// `[max_logit_rows, vocab share]` on the host, before the all-gather.
    pub(crate) host_logits: Vec<f32>,
    /// Scratch of the sparse layers; `None` for a dense model.
    pub(crate) moe: Option<MoeScratch<B>>,
    /// Scratch and recurrent state of a hybrid model; `None` for the others.
    pub(crate) hybrid: Option<crate::qwen3_5::Scratch<B>>,
}

impl<B: Backend> Workspace<B> {
    /// Token rows one step may have.
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }
    /// Rows whose logits one step may want.
    pub fn max_logit_rows(&self) -> usize {
        self.max_logit_rows
    }
    /// Recurrent-state slots the workspace holds (zero for a model without
    /// state): a step may name any slot below this.
    pub fn state_slots(&self) -> usize {
        self.hybrid.as_ref().map_or(0, |sc| sc.slots())
    }
}

/// The paged KV cache of every layer.
pub struct KvCache<B: Backend> {
    pub(crate) geometry: KvGeometry,
    pub(crate) layers: Vec<B::Kv>,
}

impl<B: Backend> KvCache<B> {
    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }
    pub fn copy_page(&mut self, backend: &B, from: corridor_units::PageId, to: corridor_units::PageId) {
        for l in &mut self.layers {
            backend.copy_page(l, from, to);
        }
    }
    /// Copy page `page` of local layer `layer` to the host (see
    /// `Backend::read_kv_page` for the layout).
    pub fn read_page(
        &self,
        backend: &B,
        layer: usize,
        page: corridor_units::PageId,
        out: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        Ok(backend.read_kv_page(&self.layers[layer], page, out)?)
    }
    /// Overwrite page `page` of local layer `layer` from the host.
    pub fn write_page(
        &mut self,
        backend: &B,
        layer: usize,
        page: corridor_units::PageId,
        data: &[f32],
    ) -> Result<(), ModelError> {
        Ok(backend.write_kv_page(&mut self.layers[layer], page, data)?)
    }
}

/// One batched step: the new tokens of every scheduled sequence.
pub struct StepInput<'a> {
    /// Token ids, sequences concatenated: `[rows]`.
    pub tokens: &'a [TokenId],
    /// The position of each token: `[rows]`.
    pub positions: &'a [u32],
    /// Each sequence's slice of the rows and its page table.
    pub seqs: &'a [SeqStep<'a>],
    /// Rows whose logits are wanted (usually each sequence's last row).
    pub logit_rows: &'a [usize],
    /// Each sequence's recurrent-state slot, parallel to `seqs` (a hybrid
    /// model's linear-attention layers); empty for a model without state.
    pub state_slots: &'a [StateSlot],
    /// The captured replay this step's device work is run as, chosen by the
    /// caller (the engine's executor): `None` runs the ops as they come. A
    /// key is only valid for a model that is [`Model::replayable`] and names
    /// the step's own rows and logit rows.
    pub capture: Option<GraphKey>,
}

impl StepInput<'_> {
    /// A decode step: every sequence brings one row and every row samples
    /// (rows of no sequence, padding, sample too). Such a step has the same
    /// shape for every batch of its size, so it may be captured once per
    /// shape and replayed.
    pub fn is_decode(&self) -> bool {
        self.seqs.iter().all(|q| q.rows == 1) && self.logit_rows.len() == self.tokens.len()
    }

    /// Refuse a capture key that names another shape than this step's, or
    /// that a rank which cannot replay its forward was given.
    pub(crate) fn check_capture(&self, replayable: bool) -> Result<(), ModelError> {
        let Some(k) = self.capture else { return Ok(()) };
        if !replayable {
            return Err(ModelError::Step(
                "a capture key for a rank whose forward does not read only what begin_step uploads".into(),
            ));
        }
        if k.rows != self.tokens.len() || k.logit_rows != self.logit_rows.len() {
            return Err(ModelError::Step(format!(
                "a capture key of {} rows and {} logit rows for a step of {} and {}",
                k.rows,
                k.logit_rows,
                self.tokens.len(),
                self.logit_rows.len()
            )));
        }
        Ok(())
    }
}

impl<B: Backend> Model<B> {
    /// Load every weight of `ckpt` onto `backend`, checking shapes; `progress`
    /// is told each time a layer is done (layer count + 2 ticks in all).
    pub fn load(backend: &B, ckpt: &Checkpoint, progress: impl FnMut(usize)) -> Result<Self, ModelError> {
        Self::load_slice(backend, ckpt, &RankSlice::full(ckpt.config()), progress)
    }

    /// Load one rank's slice of `ckpt`: only the tensors (and the rows or
    /// columns of them) the slice runs. `progress` ticks once per layer of the
    /// slice, once for the embedding and once for the head.
    pub fn load_slice(
        backend: &B,
        ckpt: &Checkpoint,
        slice: &RankSlice,
        mut progress: impl FnMut(usize),
    ) -> Result<Self, ModelError> {
        let cfg = ckpt.config().clone();
        if cfg.hybrid.is_some() {
            return Err(ModelError::Step(format!(
                "{:?} is a hybrid architecture: load it as corridor_model::Model",
                cfg.arch
            )));
        }
        check_slice(&cfg, slice)?;
        // A first pass over the (memory-mapped) tensors counts the bytes the
        // backend will place, so a device backend can put them in one allocation.
        let bytes = std::cell::Cell::new(0u64);
        place_parts(
            ckpt,
            slice,
            &|t| {
                let (rows, cols) = t.rows_cols();
                bytes.set(bytes.get() + backend.stored_bytes(t.dtype, rows, cols));
                Ok(())
            },
            &mut |_| {},
        )?;
        let zero_row = cfg.moe.as_ref().map(|_| HostTensor {
            name: "moe zero row".into(),
            dtype: DType::F32,
            shape: vec![1, cfg.hidden_size],
            data: TensorBytes::from_vec(vec![0u8; 4 * cfg.hidden_size]),
        });
        if zero_row.is_some() {
            bytes.set(bytes.get() + backend.stored_bytes(DType::F32, 1, cfg.hidden_size));
        }
        backend.reserve_weights(bytes.get())?;
        let parts = place_parts(ckpt, slice, &|t| Ok(backend.upload_weight(&t)?), &mut progress)?;
        let zero_row = zero_row.map(|t| backend.upload_weight(&t)).transpose()?;
        let expert_tables = parts
            .layers
            .iter()
            .map(|l| match &l.ffn {
                Ffn::Sparse { experts, .. } => backend.expert_table(experts).map(Some),
                Ffn::Dense { .. } => Ok(None),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let moe_on_device = expert_tables.iter().flatten().all(|t| backend.moe_on_device(t));
        Ok(Model {
            rope: rope_table(&cfg),
            config: cfg,
            slice: slice.clone(),
            embed_tokens: parts.embed_tokens,
            layers: parts.layers,
            norm: parts.norm,
            head: parts.head,
            zero_row,
            expert_tables,
            moe_on_device,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The part of the model this rank holds.
    pub fn slice(&self) -> &RankSlice {
        &self.slice
    }

    /// Allocate the scratch activations for steps of up to `max_rows` tokens
    /// and `max_logit_rows` logit rows.
    pub fn workspace(
        &self,
        backend: &B,
        max_rows: Tokens,
        max_logit_rows: usize,
    ) -> Result<Workspace<B>, ModelError> {
        let max_rows = max_rows.get();
        let (c, s) = (&self.config, &self.slice);
        let a = |rows: usize, cols: usize| backend.alloc_act(ActShape { rows, cols });
        let (q_out, kv_out, ffn) = (s.heads.len() * c.head_dim, s.kv_heads.len() * c.head_dim, s.ffn.len());
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
            moe: match &c.moe {
                Some(m) => Some(MoeScratch::new(
                    backend,
                    MoeShape {
                        max_rows,
                        hidden: c.hidden_size,
                        expert_ffn: s.expert_ffn(c).len(),
                        routing: routing(m),
                    },
                )?),
                None => None,
            },
            hybrid: None,
        })
    }

    /// Allocate a paged KV cache of `num_pages` pages of `page_size` tokens
    /// for this rank's layers and KV heads.
    pub fn kv_cache(
        &self,
        backend: &B,
        page_size: Tokens,
        num_pages: Pages,
    ) -> Result<KvCache<B>, ModelError> {
        self.kv_cache_at(backend, page_size, &KvPlacement::Own { num_pages })
    }

    /// The KV cache of this rank's layers and KV heads where `placement`
    /// says (in a card's KV arena, or in buffers of the backend's own), so
    /// page ids from the pool address it either way.
    pub fn kv_cache_at(
        &self,
        backend: &B,
        page_size: Tokens,
        placement: &KvPlacement,
    ) -> Result<KvCache<B>, ModelError> {
        let geometry = self.kv_geometry(page_size, placement.num_pages());
        let layers = backend.alloc_kv_at(placement, geometry, self.slice.layers.len())?;
        Ok(KvCache { geometry, layers })
    }

    pub fn kv_geometry(&self, page_size: Tokens, num_pages: Pages) -> KvGeometry {
        KvGeometry {
            page_size,
            num_pages,
            kv_heads: self.slice.kv_heads.len(),
            head_dim: self.config.head_dim,
        }
    }

    /// Bytes of KV one token occupies across this rank's layers (K and V,
    /// f32 on the CPU).
    pub fn kv_bytes_per_token(&self, elem_bytes: usize) -> usize {
        2 * self.slice.layers.len() * self.slice.kv_heads.len() * self.config.head_dim * elem_bytes
    }

    /// Whether this rank's forward reads only what `begin_step` uploads, so
    /// a captured replay of it is the step itself: the whole model on the
    /// rank (it embeds and computes logits), a collective that may be
    /// captured, and every sparse layer routed on the device (a layer
    /// routed on the host reads its router logits back mid-step, which a
    /// replay could not repeat). The executor asks this before it names a
    /// capture key ([`StepInput::capture`]).
    pub fn replayable(&self, c: &dyn Collective<B>) -> bool {
        c.capturable()
            && self.head.is_some()
            && self.embed_tokens.is_some()
            && (self.config.moe.is_none() || self.moe_on_device)
    }

    /// Run one step with the whole model on this rank; the logits of
    /// `step.logit_rows` are copied into `logits` (`[logit_rows, vocab]`,
    /// row-major).
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

    /// Run this rank's part of one step. Every rank of a layout calls this
    /// with the same step; the rank whose logits are sampled (the last stage
    /// of a pipeline, rank 0 of a tensor group: `Group::gathers_here`) leaves
    /// `[logit_rows, vocab]` in `logits`, the others leave it empty.
    pub fn forward_ranked(
        &self,
        b: &B,
        c: &dyn Collective<B>,
        ws: &mut Workspace<B>,
        kv: &mut KvCache<B>,
        step: &StepInput<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        self.forward_ranked_rows(b, c, ws, kv, step, logits, usize::MAX)
    }

    /// [`Model::forward_ranked`] that copies only the first `host_rows` of
    /// the step's logit rows to the host; all of them stay in the
    /// workspace on the device for [`Model::sample_on_device`]. Reading
    /// fewer rows changes nothing before the read, so a captured step
    /// serves either.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_ranked_rows(
        &self,
        b: &B,
        c: &dyn Collective<B>,
        ws: &mut Workspace<B>,
        kv: &mut KvCache<B>,
        step: &StepInput<'_>,
        logits: &mut Vec<f32>,
        host_rows: usize,
    ) -> Result<(), ModelError> {
        let (cfg, s) = (&self.config, &self.slice);
        let rows = step.tokens.len();
        if rows == 0 || rows > ws.max_rows || step.positions.len() != rows {
            return Err(ModelError::Step(format!("{rows} rows for a workspace of {}", ws.max_rows)));
        }
        if step.logit_rows.len() > ws.max_logit_rows {
            return Err(ModelError::Step(format!(
                "{} logit rows for a workspace of {}",
                step.logit_rows.len(),
                ws.max_logit_rows
            )));
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
            // A stage before the last hands every row on.
            let to = s
                .send_to
                .ok_or_else(|| ModelError::Step("a rank without a head must send its output".into()))?;
            c.send(b, to, &ws.x, rows)?;
            b.check()?;
            return Ok(());
        }
        let n = step.logit_rows.len().min(host_rows);
        if n == 0 {
            b.check()?;
            return Ok(());
        }
        // Only the rank whose logits are sampled holds the whole rows.
        let device_logits = &ws.logits;
        gather_logits(c, n, s.vocab.clone(), cfg.vocab_size, &mut ws.host_logits, logits, |host| {
            b.read_rows(device_logits, n, host);
            b.check().map_err(ModelError::from)
        })
    }

    /// Draw the logit rows of the last forward pass that `specs` name, on
    /// the device that holds them (`Backend::sample_rows`; it adjusts them
    /// in place). Only a rank that holds every vocabulary column may.
    pub fn sample_on_device(
        &self,
        b: &B,
        ws: &mut Workspace<B>,
        specs: &[SampleRowSpec],
        edits: &[LogitEdit],
        out: &mut SampledRows,
    ) -> Result<(), ModelError> {
        if self.head.is_none() || self.slice.vocab != (0..self.config.vocab_size) {
            return Err(ModelError::Step("this rank does not hold whole logit rows".into()));
        }
        Ok(b.sample_rows(&mut ws.logits, specs, edits, out)?)
    }

    /// The device work of a step: embed (or receive), every layer, and the
    /// logits of the wanted rows left in `ws.logits` on ranks with a head.
    fn run_ops(
        &self,
        b: &B,
        c: &dyn Collective<B>,
        ws: &mut Workspace<B>,
        kv: &mut KvCache<B>,
        step: &StepInput<'_>,
    ) -> Result<(), ModelError> {
        let (cfg, s) = (&self.config, &self.slice);
        let rows = step.tokens.len();
        let eps = cfg.rms_norm_eps;
        match (&self.embed_tokens, s.recv_from) {
            (Some(table), _) => b.embedding(table, TokenId::as_u32_slice(step.tokens), &mut ws.x)?,
            (None, Some(from)) => c.recv(b, from, &mut ws.x, rows)?,
            (None, None) => {
                return Err(ModelError::Step("a rank that does not embed must receive its input".into()))
            }
        }
        // Each block's residual add is fused with the norm that follows it,
        // and where this rank's projections are whole sums (no other rank
        // adds to them) with the projection before it too; the last layer's
        // add stands alone (the final norm reads only the gathered rows).
        let whole = s.heads == (0..cfg.num_heads) && s.ffn == (0..cfg.intermediate_size);
        // Whether `ws.h` already holds this layer's input norm.
        let mut normed = false;
        for (i, (layer, kv_layer)) in self.layers.iter().zip(kv.layers.iter_mut()).enumerate() {
            // Attention block: this rank's heads; o_proj gives a partial sum.
            if i == 0 {
                b.rms_norm(&ws.x, &layer.input_layernorm, eps, rows, &mut ws.h);
            } else if !normed {
                b.add_rms_norm(&mut ws.x, &ws.proj, &layer.input_layernorm, eps, rows, &mut ws.h);
            }
            let bias = layer.qkv_bias.as_ref();
            b.matmul_many(
                &ws.h,
                &mut [
                    MatmulPart { w: &layer.q_proj, bias: bias.map(|x| &x[0]), out: &mut ws.q },
                    MatmulPart { w: &layer.k_proj, bias: bias.map(|x| &x[1]), out: &mut ws.k },
                    MatmulPart { w: &layer.v_proj, bias: bias.map(|x| &x[2]), out: &mut ws.v },
                ],
                rows,
                // Free until the MLP: a backend may multiply by q, k and v
                // stacked into it.
                Some(&mut ws.gate),
            );
            let norm = layer.qk_norm.as_ref().map(|[q, k]| QkNorm { q, k, eps, rows });
            // RoPE and attention move few bytes: the output projection's
            // weights can be on their way meanwhile.
            b.prefetch(&layer.o_proj);
            let a = RopeAttention {
                q: &mut ws.q,
                k: &mut ws.k,
                v: &ws.v,
                norm,
                table: &self.rope,
                head_dim: cfg.head_dim,
                positions: step.positions,
                kv: kv_layer,
                seqs: step.seqs,
            };
            b.rope_attention(a, s.heads.len(), &mut ws.attn);
            let post = &layer.post_attention_layernorm;
            if whole {
                let n = ResidualNorm { x: &mut ws.x, weight: post, eps, out: &mut ws.h };
                b.matmul_add_rms_norm(&ws.attn, &layer.o_proj, rows, &mut ws.proj, n);
            } else {
                b.matmul(&ws.attn, &layer.o_proj, None, rows, &mut ws.proj);
                c.all_reduce_sum(b, &mut ws.proj, rows)?;
                // MLP block: this rank's FFN columns; down_proj gives a partial sum.
                b.add_rms_norm(&mut ws.x, &ws.proj, post, eps, rows, &mut ws.h);
            }
            normed = false;
            match &layer.ffn {
                Ffn::Dense { gate_proj, up_proj, down_proj } => {
                    b.gate_up_silu(&ws.h, gate_proj, up_proj, rows, &mut ws.gate, &mut ws.up, &mut ws.act);
                    match self.layers.get(i + 1).filter(|_| whole) {
                        Some(next) => {
                            let weight = &next.input_layernorm;
                            let n = ResidualNorm { x: &mut ws.x, weight, eps, out: &mut ws.h };
                            b.matmul_add_rms_norm(&ws.act, down_proj, rows, &mut ws.proj, n);
                            normed = true;
                        }
                        None => b.matmul(&ws.act, down_proj, None, rows, &mut ws.proj),
                    }
                }
                Ffn::Sparse { router, experts } => self.sparse_ffn(b, i, router, experts, ws, rows)?,
            }
            if !normed {
                c.all_reduce_sum(b, &mut ws.proj, rows)?;
            }
        }
        if !self.layers.is_empty() {
            b.add_assign(&mut ws.x, &ws.proj, rows);
        }
        let (Some(norm), Some(head)) = (&self.norm, &self.head) else {
            return Ok(());
        };
        let n = step.logit_rows.len();
        if n == 0 {
            return Ok(());
        }
        b.gather_rows(&ws.x, step.logit_rows, &mut ws.last);
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

impl<B: Backend> Model<B> {
    /// A sparse FFN over `ws.h` into `ws.proj` (local layer `layer`): the
    /// backend routes every row and sums its experts' weighted outputs.
    fn sparse_ffn(
        &self,
        b: &B,
        layer: usize,
        router: &B::Weight,
        experts: &[Expert<B::Weight>],
        ws: &mut Workspace<B>,
        rows: usize,
    ) -> Result<(), ModelError> {
        let (Some(moe), Some(zero), Some(m), Some(Some(table))) =
            (&self.config.moe, &self.zero_row, ws.moe.as_mut(), self.expert_tables.get(layer))
        else {
            return Err(ModelError::Step("a sparse layer in a model without expert scratch".into()));
        };
        b.moe_ffn(MoeFfn {
            x: &ws.h,
            router,
            experts,
            table,
            routing: routing(moe),
            zero_row: zero,
            rows,
            scratch: m,
            out: &mut ws.proj,
        })?;
        Ok(())
    }
}

/// The backend's view of a model's routing.
fn routing(m: &crate::config::MoeConfig) -> Routing {
    Routing { num_experts: m.num_experts, top_k: m.experts_per_token, norm_topk_prob: m.norm_topk_prob }
}

/// Read every tensor `slice` runs from `ckpt`, checking shapes, cut it to the
/// slice and hand it to `up`; `progress` ticks once for the embedding, once
/// per layer and once for the head.
fn place_parts<W>(
    ckpt: &Checkpoint,
    slice: &RankSlice,
    up: &dyn Fn(HostTensor) -> Result<W, ModelError>,
    progress: &mut dyn FnMut(usize),
) -> Result<Parts<W>, ModelError> {
    let cfg = ckpt.config();
    let (hidden, hd) = (cfg.hidden_size, cfg.head_dim);
    let (q_out, kv_out) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
    let read = |name: &str, shape: &[usize]| -> Result<HostTensor, ModelError> {
        let t = ckpt.tensor(name)?;
        check_shape(ckpt, &t, shape)?;
        Ok(t)
    };
    let load = |name: &str, shape: &[usize]| up(read(name, shape)?);
    // Row blocks of this rank's heads: query heads are one range, KV heads
    // a list (a replica repeats a head).
    let q_rows = [slice.heads.start * hd..slice.heads.end * hd];
    let kv_rows = coalesce(slice.kv_heads.iter().map(|&k| k * hd..(k + 1) * hd));
    let ffn_rows = [slice.ffn.clone()];
    let embed_tokens = if slice.embeds() {
        Some(load("model.embed_tokens.weight", &[cfg.vocab_size, hidden])?)
    } else {
        None
    };
    progress(1);
    let mut layers = Vec::with_capacity(slice.layers.len());
    for i in slice.layers.clone() {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let rows = |name: &str, shape: &[usize], blocks: &[Range<usize>]| {
            up(select(read(&p(name), shape)?, blocks, None)?)
        };
        let cols = |name: &str, shape: &[usize], cols: Range<usize>| {
            up(select(read(&p(name), shape)?, &[0..shape[0]], Some(cols))?)
        };
        let elems = |name: &str, shape: &[usize], blocks: &[Range<usize>]| {
            up(select_elems(read(&p(name), shape)?, blocks)?)
        };
        let qkv_bias = if cfg.attention_bias {
            Some([
                elems("self_attn.q_proj.bias", &[q_out], &q_rows)?,
                elems("self_attn.k_proj.bias", &[kv_out], &kv_rows)?,
                elems("self_attn.v_proj.bias", &[kv_out], &kv_rows)?,
            ])
        } else {
            None
        };
        let qk_norm = if cfg.qk_norm {
            Some([load(&p("self_attn.q_norm.weight"), &[hd])?, load(&p("self_attn.k_norm.weight"), &[hd])?])
        } else {
            None
        };
        let ffn = if cfg.is_sparse_layer(i) {
            let moe = cfg.moe.as_ref().expect("a sparse layer has a MoE config");
            let (width, share) = (moe.expert_intermediate_size, slice.expert_ffn(cfg));
            let share_rows = [share.clone()];
            let experts = (0..moe.num_experts)
                .map(|e| {
                    let x = |s: &str| format!("mlp.experts.{e}.{s}");
                    Ok(Expert {
                        gate_proj: rows(&x("gate_proj.weight"), &[width, hidden], &share_rows)?,
                        up_proj: rows(&x("up_proj.weight"), &[width, hidden], &share_rows)?,
                        down_proj: cols(&x("down_proj.weight"), &[hidden, width], share.clone())?,
                    })
                })
                .collect::<Result<Vec<_>, ModelError>>()?;
            Ffn::Sparse { router: load(&p("mlp.gate.weight"), &[moe.num_experts, hidden])?, experts }
        } else {
            Ffn::Dense {
                gate_proj: rows("mlp.gate_proj.weight", &[cfg.intermediate_size, hidden], &ffn_rows)?,
                up_proj: rows("mlp.up_proj.weight", &[cfg.intermediate_size, hidden], &ffn_rows)?,
                down_proj: cols("mlp.down_proj.weight", &[hidden, cfg.intermediate_size], slice.ffn.clone())?,
            }
        };
        layers.push(Layer {
            input_layernorm: load(&p("input_layernorm.weight"), &[hidden])?,
            q_proj: rows("self_attn.q_proj.weight", &[q_out, hidden], &q_rows)?,
            k_proj: rows("self_attn.k_proj.weight", &[kv_out, hidden], &kv_rows)?,
            v_proj: rows("self_attn.v_proj.weight", &[kv_out, hidden], &kv_rows)?,
            qkv_bias,
            qk_norm,
            o_proj: cols("self_attn.o_proj.weight", &[hidden, q_out], q_rows[0].clone())?,
            post_attention_layernorm: load(&p("post_attention_layernorm.weight"), &[hidden])?,
            ffn,
        });
        progress(1);
    }
    let (norm, head) = if slice.emits_logits() {
        let norm = load("model.norm.weight", &[hidden])?;
        // A checkpoint may say it is tied and still ship lm_head (or the
        // reverse): a present lm_head always wins, as in transformers' loading.
        let name =
            if ckpt.has_tensor("lm_head.weight") { "lm_head.weight" } else { "model.embed_tokens.weight" };
        let whole = slice.vocab == (0..cfg.vocab_size);
        let head = if name == "model.embed_tokens.weight" && whole && embed_tokens.is_some() {
            Head::Tied
        } else {
            Head::Own(up(select(read(name, &[cfg.vocab_size, hidden])?, &[slice.vocab.clone()], None)?)?)
        };
        (Some(norm), Some(head))
    } else {
        (None, None)
    };
    progress(1);
    Ok(Parts { embed_tokens, layers, norm, head })
}

/// Refuse a slice that does not fit the model (a bug in whoever built it).
pub(crate) fn check_slice(cfg: &ModelConfig, s: &RankSlice) -> Result<(), ModelError> {
    let bad = |what: String| Err(ModelError::Step(format!("{}: {what}", s.rank)));
    if s.layers.end > cfg.num_layers
        || s.heads.end > cfg.num_heads
        || s.ffn.end > cfg.intermediate_size
        || s.vocab.end > cfg.vocab_size
    {
        return bad(format!("slice {s:?} is outside the model"));
    }
    if s.heads.is_empty() || s.kv_heads.is_empty() || s.heads.len() % s.kv_heads.len() != 0 {
        return bad(format!(
            "{} query heads cannot share {} KV heads evenly",
            s.heads.len(),
            s.kv_heads.len()
        ));
    }
    if cfg.moe.is_some()
        && (0..cfg.num_layers).any(|i| cfg.is_sparse_layer(i))
        && s.expert_ffn(cfg).is_empty()
    {
        return bad(format!(
            "FFN columns {:?} leave this rank none of the experts' columns; give it a larger share",
            s.ffn
        ));
    }
    let (g, lg) = (cfg.num_heads / cfg.num_kv_heads, s.heads.len() / s.kv_heads.len());
    for (i, h) in s.heads.clone().enumerate() {
        if s.kv_heads.get(i / lg) != Some(&(h / g)) {
            return bad(format!(
                "query head {h} would read KV head {:?}, it needs {}",
                s.kv_heads.get(i / lg),
                h / g
            ));
        }
    }
    Ok(())
}

/// Bytes of one element row segment: the byte range of columns `cols` in a
/// row of `dtype` (whole blocks for the quantized types).
fn col_bytes(dtype: DType, cols: &Range<usize>) -> Range<usize> {
    let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
    cols.start / be * bb..cols.end / be * bb
}

/// Merge ranges that follow each other, so whole tensors stay whole.
pub(crate) fn coalesce(ranges: impl Iterator<Item = Range<usize>>) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for r in ranges {
        match out.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => out.push(r),
        }
    }
    out
}

/// Elements `blocks` (concatenated) of a float vector stored as `[n]` or
/// `[1, n]` (norms and biases). The whole vector comes back as it is.
pub(crate) fn select_elems(t: HostTensor, blocks: &[Range<usize>]) -> Result<HostTensor, ModelError> {
    let n = t.elems();
    if blocks.len() == 1 && blocks[0] == (0..n) {
        return Ok(t);
    }
    let bad = |reason: String| ModelError::Backend(BackendError::BadTensor { name: t.name.clone(), reason });
    if t.dtype.is_quantized() {
        return Err(bad("a quantized vector cannot be sliced".into()));
    }
    if blocks.iter().any(|b| b.end > n || b.start > b.end) {
        return Err(bad(format!("elements {blocks:?} outside {:?}", t.shape)));
    }
    let eb = t.dtype.block_bytes();
    let data = t.data.bytes();
    let bytes: Vec<u8> = blocks.iter().flat_map(|b| data[b.start * eb..b.end * eb].iter().copied()).collect();
    let m = blocks.iter().map(|b| b.len()).sum();
    let shape = if t.shape.len() == 2 { vec![1, m] } else { vec![m] };
    Ok(HostTensor { name: t.name.clone(), dtype: t.dtype, shape, data: TensorBytes::from_vec(bytes) })
}

/// Rows `blocks` (concatenated, repeats allowed) and columns `cols` of a
/// checkpoint matrix. The whole matrix comes back as it is, without a copy.
/// A quantized matrix cut inside a block is widened to f32 (exactly the
/// values the kernels would dequantize), since a partial block cannot be
/// stored.
pub(crate) fn select(
    t: HostTensor,
    blocks: &[Range<usize>],
    cols: Option<Range<usize>>,
) -> Result<HostTensor, ModelError> {
    let (rows, ncols) = t.rows_cols();
    let cols = cols.unwrap_or(0..ncols);
    if blocks.len() == 1 && blocks[0] == (0..rows) && cols == (0..ncols) {
        return Ok(t);
    }
    let bad = |reason: String| ModelError::Backend(BackendError::BadTensor { name: t.name.clone(), reason });
    if blocks.iter().any(|b| b.end > rows || b.start > b.end) || cols.end > ncols || cols.start > cols.end {
        return Err(bad(format!("slice {blocks:?} x {cols:?} outside {:?}", t.shape)));
    }
    let out_rows: usize = blocks.iter().map(|b| b.len()).sum();
    let shape = vec![out_rows, cols.len()];
    let be = t.dtype.block_elems();
    let data = t.data.bytes();
    let row_bytes = t
        .dtype
        .bytes_for(ncols)
        .ok_or_else(|| bad(format!("{ncols} columns are not whole {} blocks", t.dtype)))?;
    let aligned = cols.start % be == 0 && cols.end % be == 0;
    let mut bytes = Vec::new();
    if aligned {
        let cb = col_bytes(t.dtype, &cols);
        for r in blocks.iter().flat_map(|b| b.clone()) {
            bytes.extend_from_slice(&data[r * row_bytes..(r + 1) * row_bytes][cb.clone()]);
        }
        return Ok(HostTensor {
            name: t.name.clone(),
            dtype: t.dtype,
            shape,
            data: TensorBytes::from_vec(bytes),
        });
    }
    let mut row = vec![0f32; ncols];
    for r in blocks.iter().flat_map(|b| b.clone()) {
        corridor_backend::cpu::quant::dequantize_row(
            t.dtype,
            &data[r * row_bytes..(r + 1) * row_bytes],
            &mut row,
        );
        bytes.extend(row[cols.clone()].iter().flat_map(|v| v.to_le_bytes()));
    }
    Ok(HostTensor { name: t.name.clone(), dtype: DType::F32, shape, data: TensorBytes::from_vec(bytes) })
}

pub(crate) fn check_shape(ckpt: &Checkpoint, t: &HostTensor, want: &[usize]) -> Result<(), LoadError> {
    // A vector may be stored as [n] or [1, n]; compare element layouts.
    let same = t.shape == want
        || (want.len() == 1 && t.shape.len() == 2 && t.shape[0] == 1 && t.shape[1] == want[0]);
    if same {
        Ok(())
    } else {
        Err(LoadError::BadShape {
            file: ckpt.path().to_path_buf(),
            tensor: t.name.clone(),
            expected: want.to_vec(),
            found: t.shape.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::CostModel;
    use corridor_backend::cpu::{CpuAct, CpuBackend};
    use corridor_units::{Bytes, Tokens};
    use std::path::Path;

    /// The layout cost model's workspace price covers every buffer a
    /// mixture-of-experts workspace allocates (the expert scratch holds a row
    /// per (row, chosen expert) pair and the device's routing metadata), so a
    /// card booked by the price is never short of it.
    #[test]
    fn the_cost_model_prices_the_whole_moe_workspace() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/qwen3-moe");
        let ckpt = Checkpoint::open(&dir).unwrap();
        let b = CpuBackend::new();
        let model = Model::load(&b, &ckpt, |_| {}).unwrap();
        let (rows, logit_rows) = (24, 5);
        let ws = model.workspace(&b, Tokens(rows), logit_rows).unwrap();
        let n = |a: &CpuAct| (a.rows() * a.cols() * 4) as u64;
        let m = ws.moe.as_ref().expect("a sparse model has expert scratch");
        let acts = [
            &ws.x, &ws.h, &ws.q, &ws.k, &ws.v, &ws.attn, &ws.proj, &ws.gate, &ws.up, &ws.act, &ws.last,
            &ws.last_n, &ws.logits, &m.router, &m.x, &m.gate, &m.up, &m.act, &m.y, &m.meta,
        ];
        let bytes = acts.iter().map(|a| n(a)).sum::<u64>() + (ws.host_logits.capacity() * 4) as u64;
        let cost = CostModel {
            weight_dtype: DType::F32,
            kv_elem_bytes: 4,
            page_size: Tokens(16),
            max_rows: rows,
            max_logit_rows: logit_rows,
            chunk_target: Bytes::mib(2),
        };
        let priced = cost.workspace(model.config(), model.slice()).get();
        assert!(bytes <= priced, "{bytes} bytes allocated, {priced} priced");
    }
}
