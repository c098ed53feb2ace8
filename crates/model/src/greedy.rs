//! A plain greedy decode through the paged KV cache: the prompt in one step,
//! then one token per step. It is the reference path the numerics checks use
//! (CPU against transformers, GPU against CPU, the SmolLM2 "Paris" check);
//! serving goes through the engine's scheduler instead.

use crate::llama::{ModelError, StepInput};
use crate::Model;
use corridor_backend::{Backend, SeqStep};
use corridor_units::{PageId, Pages, StateSlot, TokenId, Tokens};

/// Tokens per KV page on this path.
pub const PAGE_SIZE: usize = 16;

/// Greedily continue `prompt` by `steps` tokens on `backend`, with the
/// sequence's KV in `pages` of [`PAGE_SIZE`] tokens (in order; any ids, so a
/// scrambled table checks the paging). `on_logits` sees each step's
/// logits row (`[vocab]`) before its token is chosen. Returns the new tokens
/// (prompt and result are the tokenizer's `u32` ids).
pub fn greedy<B: Backend>(
    model: &Model<B>,
    backend: &B,
    prompt: &[u32],
    steps: usize,
    pages: &[PageId],
    mut on_logits: impl FnMut(&[f32]),
) -> Result<Vec<u32>, ModelError> {
    if pages.len() * PAGE_SIZE < prompt.len() + steps || prompt.is_empty() {
        return Err(ModelError::Step(format!(
            "{} pages of {PAGE_SIZE} cannot hold {} prompt + {steps} new tokens",
            pages.len(),
            prompt.len()
        )));
    }
    let num_pages = pages.iter().map(|p| p.index() + 1).max().unwrap_or(1);
    let mut ws = model.workspace(backend, Tokens(prompt.len()), 1)?;
    let mut kv = model.kv_cache(backend, Tokens(PAGE_SIZE), Pages(num_pages))?;
    let vocab = model.config().vocab_size;
    let mut toks = TokenId::vec(prompt);
    let mut logits = Vec::new();
    let mut cached = 0;
    for _ in 0..steps {
        let rows = toks.len() - cached;
        let seqs = [SeqStep { row_start: 0, rows, cached, pages }];
        let positions: Vec<u32> = (cached..toks.len()).map(|p| p as u32).collect();
        let step = StepInput {
            tokens: &toks[cached..],
            positions: &positions,
            seqs: &seqs,
            logit_rows: &[rows - 1],
            state_slots: &[StateSlot(0)],
            capture: None,
        };
        model.forward(backend, &mut ws, &mut kv, &step, &mut logits)?;
        backend.check()?;
        on_logits(&logits[..vocab]);
        cached = toks.len();
        let next = (0..vocab).max_by(|&a, &b| logits[a].total_cmp(&logits[b])).unwrap_or(0) as u32;
        toks.push(TokenId(next));
    }
    Ok(TokenId::as_u32_slice(&toks[prompt.len()..]).to_vec())
}
