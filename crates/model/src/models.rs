//! One model type over every architecture: [`Model`] holds a loaded model of
//! whichever architecture the checkpoint's config names, and forwards each
//! call to it. The workspace, the KV cache and the step are shared types
//! (`llama::Workspace` carries the hybrid's extra scratch), so callers see one
//! set of types whatever runs.

use crate::checkpoint::Checkpoint;
use crate::config::{Arch, ModelConfig};
use crate::layout::RankSlice;
use crate::llama::{self, KvCache, ModelError, StepInput, Workspace};
use crate::qwen3_5;
use corridor_backend::collective::Collective;
use corridor_backend::sample::{LogitEdit, SampleRowSpec, SampledRows};
use corridor_backend::{Backend, KvGeometry, KvPlacement};
use corridor_units::{Bytes, Pages, Tokens};

/// A loaded model (one rank's slice of it) of any supported architecture.
pub enum Model<B: Backend> {
    /// Llama, Mistral, Qwen2, Qwen3 and Qwen3-MoE.
    Llama(llama::Model<B>),
    /// Qwen3.5: gated delta-net and full-attention layers.
    Qwen35(qwen3_5::Model<B>),
}

/// Which implementation runs an architecture: one entry per architecture.
fn family(arch: Arch) -> Family {
    match arch {
        Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => Family::Llama,
        Arch::Qwen35 => Family::Qwen35,
    }
}

#[derive(Clone, Copy)]
enum Family {
    Llama,
    Qwen35,
}

/// Forward one call to whichever architecture is loaded.
macro_rules! each {
    ($self:expr, $m:ident => $e:expr) => {
        match $self {
            Model::Llama($m) => $e,
            Model::Qwen35($m) => $e,
        }
    };
}

impl<B: Backend> Model<B> {
    /// Load the whole of `ckpt` onto `backend` (see `llama::Model::load`).
    pub fn load(backend: &B, ckpt: &Checkpoint, progress: impl FnMut(usize)) -> Result<Self, ModelError> {
        Ok(match family(ckpt.config().arch) {
            Family::Llama => Model::Llama(llama::Model::load(backend, ckpt, progress)?),
            Family::Qwen35 => Model::Qwen35(qwen3_5::Model::load(backend, ckpt, progress)?),
        })
    }

    /// Load one rank's slice of `ckpt` (see `llama::Model::load_slice`).
    pub fn load_slice(
        backend: &B,
        ckpt: &Checkpoint,
        slice: &RankSlice,
        progress: impl FnMut(usize),
    ) -> Result<Self, ModelError> {
        Ok(match family(ckpt.config().arch) {
            Family::Llama => Model::Llama(llama::Model::load_slice(backend, ckpt, slice, progress)?),
            Family::Qwen35 => Model::Qwen35(qwen3_5::Model::load_slice(backend, ckpt, slice, progress)?),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        each!(self, m => m.config())
    }

    /// The part of the model this rank holds.
    pub fn slice(&self) -> &RankSlice {
        each!(self, m => m.slice())
    }

    /// Whether the model carries per-sequence recurrent state: then every
    /// sequence of a step needs a state slot, a preempted sequence must
    /// recompute from its prompt, and prefix caching cannot apply.
    pub fn has_state(&self) -> bool {
        matches!(self, Model::Qwen35(_))
    }

    /// Bytes of recurrent state one sequence holds (zero without state).
    pub fn state_bytes_per_seq(&self) -> Bytes {
        match self {
            Model::Llama(_) => Bytes(0),
            Model::Qwen35(m) => m.state_bytes_per_seq(),
        }
    }

    /// Scratch for steps of up to `max_rows` token rows and `max_logit_rows`
    /// logit rows (and, for a model with state, that many state slots).
    pub fn workspace(
        &self,
        backend: &B,
        max_rows: Tokens,
        max_logit_rows: usize,
    ) -> Result<Workspace<B>, ModelError> {
        each!(self, m => m.workspace(backend, max_rows, max_logit_rows))
    }

    /// [`Model::workspace`] with its recurrent-state slots where `state`
    /// says (a model with state; the others ignore it): a fixed block, or
    /// the slots of a governed state pool, whose id space may exceed the
    /// running limit by the rounding to whole chunks.
    pub fn workspace_at(
        &self,
        backend: &B,
        max_rows: Tokens,
        max_logit_rows: usize,
        state: &corridor_backend::StatePlacement,
    ) -> Result<Workspace<B>, ModelError> {
        match self {
            Model::Qwen35(m) => m.workspace_at(backend, max_rows, max_logit_rows, state),
            _ => self.workspace(backend, max_rows, max_logit_rows),
        }
    }

    pub fn kv_cache(
        &self,
        backend: &B,
        page_size: Tokens,
        num_pages: Pages,
    ) -> Result<KvCache<B>, ModelError> {
        each!(self, m => m.kv_cache(backend, page_size, num_pages))
    }

    /// The KV cache of this rank where `placement` says.
    pub fn kv_cache_at(
        &self,
        backend: &B,
        page_size: Tokens,
        placement: &KvPlacement,
    ) -> Result<KvCache<B>, ModelError> {
        each!(self, m => m.kv_cache_at(backend, page_size, placement))
    }

    pub fn kv_geometry(&self, page_size: Tokens, num_pages: Pages) -> KvGeometry {
        each!(self, m => m.kv_geometry(page_size, num_pages))
    }

    /// Bytes of KV one token occupies across this rank's layers.
    pub fn kv_bytes_per_token(&self, elem_bytes: usize) -> usize {
        each!(self, m => m.kv_bytes_per_token(elem_bytes))
    }

    pub fn forward(
        &self,
        b: &B,
        ws: &mut Workspace<B>,
        kv: &mut KvCache<B>,
        step: &StepInput<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        each!(self, m => m.forward(b, ws, kv, step, logits))
    }

    pub fn forward_ranked(
        &self,
        b: &B,
        c: &dyn Collective<B>,
        ws: &mut Workspace<B>,
        kv: &mut KvCache<B>,
        step: &StepInput<'_>,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        each!(self, m => m.forward_ranked(b, c, ws, kv, step, logits))
    }

    /// Whether this rank's forward with the collective `c` reads only what
    /// the backend's `begin_step` uploads, so a decode step of it may be
    /// captured and replayed: the question an executor asks before it names
    /// a capture key in [`StepInput::capture`] (the model never decides it).
    pub fn replayable(&self, c: &dyn Collective<B>) -> bool {
        each!(self, m => m.replayable(c))
    }

    /// Whether [`Model::forward_ranked_rows`] and [`Model::sample_on_device`]
    /// serve this model on `b` with the collective `c`: a Llama-family model
    /// whose rank holds every vocabulary column, alone, on a backend with
    /// `sample_rows`.
    pub fn samples_on_device(&self, b: &B, c: &dyn Collective<B>) -> bool {
        let whole = |s: &RankSlice| s.emits_logits() && s.vocab == (0..self.config().vocab_size);
        matches!(self, Model::Llama(m) if whole(m.slice())) && c.world() == 1 && b.samples_on_device()
    }

    /// [`Model::forward_ranked`], copying only the first `host_rows` logit
    /// rows to the host (see [`llama::Model::forward_ranked_rows`]); a model
    /// that cannot sample on the device copies them all.
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
        match self {
            Model::Llama(m) => m.forward_ranked_rows(b, c, ws, kv, step, logits, host_rows),
            Model::Qwen35(m) => m.forward_ranked(b, c, ws, kv, step, logits),
        }
    }

    /// Draw logit rows of the last forward pass on the device
    /// ([`llama::Model::sample_on_device`]).
    pub fn sample_on_device(
        &self,
        b: &B,
        ws: &mut Workspace<B>,
        specs: &[SampleRowSpec],
        edits: &[LogitEdit],
        out: &mut SampledRows,
    ) -> Result<(), ModelError> {
        match self {
            Model::Llama(m) => m.sample_on_device(b, ws, specs, edits, out),
            Model::Qwen35(_) => Err(ModelError::Step("this model samples on the host".into())),
        }
    }
}
