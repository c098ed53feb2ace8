//! Executors run a scheduled step on the model and return the logits of the
//! rows that sample. The engine loop sees only this trait, so one card, a
//! group of tensor-parallel ranks or a pipeline of stages all drive the same
//! loop.

use crate::scheduler::SchedulerOutput;
use corridor_backend::{Backend, SeqStep};
use corridor_model::llama::{KvCache, Model, ModelError, StepInput, Workspace};
use corridor_model::ModelConfig;

/// Runs steps for the engine.
pub trait Executor: Send + 'static {
    fn config(&self) -> &ModelConfig;
    /// Run `step` and leave the logits of `logit_rows` in `logits`
    /// (`[logit_rows.len(), vocab]`, row-major).
    fn execute(
        &mut self,
        step: &SchedulerOutput,
        logit_rows: &[usize],
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError>;
}

/// Sizes the executor must be able to run.
#[derive(Clone, Copy, Debug)]
pub struct ExecutorLimits {
    /// Token rows per step.
    pub max_rows: usize,
    /// Rows that sample per step (one per running sequence).
    pub max_logit_rows: usize,
    pub page_size: usize,
    pub num_pages: usize,
}

/// The whole model on one backend.
pub struct SingleRank<B: Backend> {
    backend: B,
    model: Model<B>,
    ws: Workspace<B>,
    kv: KvCache<B>,
}

impl<B: Backend> SingleRank<B> {
    /// Allocate the workspace and KV cache for `limits`, once.
    pub fn new(backend: B, model: Model<B>, limits: ExecutorLimits) -> Result<Self, ModelError> {
        let ws = model.workspace(&backend, limits.max_rows, limits.max_logit_rows)?;
        let kv = model.kv_cache(&backend, limits.page_size, limits.num_pages)?;
        Ok(SingleRank { backend, model, ws, kv })
    }
}

/// The per-sequence views the model wants, borrowed from a scheduler output.
pub fn seq_steps(step: &SchedulerOutput) -> Vec<SeqStep<'_>> {
    step.seqs
        .iter()
        .map(|s| SeqStep { row_start: s.row_start, rows: s.rows, cached: s.cached, pages: &s.pages })
        .collect()
}

impl<B: Backend> Executor for SingleRank<B> {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn execute(
        &mut self,
        step: &SchedulerOutput,
        logit_rows: &[usize],
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let seqs = seq_steps(step);
        let input = StepInput { tokens: &step.tokens, positions: &step.positions, seqs: &seqs, logit_rows };
        self.model.forward(&self.backend, &mut self.ws, &mut self.kv, &input, logits)
    }
}
