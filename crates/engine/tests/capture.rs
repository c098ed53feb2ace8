//! The executor, not the model, chooses which steps run as a captured
//! replay: decode steps only, and only on a rank whose forward reads nothing
//! but what `begin_step` uploads (the whole model on the rank, every sparse
//! layer routed on the device). The model runs the key it is handed and
//! refuses one it could not replay, so an executor that asked wrongly fails
//! its step instead of replaying a graph that skipped the host's work.

use corridor_backend::collective::Solo;
use corridor_backend::cpu::CpuBackend;
use corridor_backend::{GraphKey, SeqStep};
use corridor_engine::executor::{capture_key, Executor, ExecutorLimits, SingleRank};
use corridor_engine::scheduler::{ScheduledSeq, SchedulerOutput};
use corridor_model::layout::Layout;
use corridor_model::{Checkpoint, KvCache, Model, ModelError, StepInput, Workspace};
use corridor_units::{PageId, Pages, RequestId, StateSlot, TokenId, Tokens};
use std::path::Path;

fn ckpt(name: &str) -> Checkpoint {
    Checkpoint::open(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny").join(name))
        .unwrap()
}

fn load(name: &str) -> (CpuBackend, Model<CpuBackend>) {
    let backend = CpuBackend::new();
    let model = Model::load(&backend, &ckpt(name), |_| {}).unwrap();
    (backend, model)
}

const PAGES: [PageId; 2] = [PageId(0), PageId(1)];

/// A step over `rows_per_seq` sequences (one page table for all: the key
/// depends on the shape only) sampling `logit_rows`.
fn with_step<R>(rows_per_seq: &[usize], logit_rows: &[usize], f: impl FnOnce(&StepInput<'_>) -> R) -> R {
    let mut seqs = Vec::new();
    let mut row = 0;
    for &rows in rows_per_seq {
        seqs.push(SeqStep { row_start: row, rows, cached: 0, pages: &PAGES });
        row += rows;
    }
    let tokens = vec![TokenId(1); row];
    let positions: Vec<u32> = (0..row as u32).collect();
    f(&StepInput {
        tokens: &tokens,
        positions: &positions,
        seqs: &seqs,
        logit_rows,
        state_slots: &[],
        capture: None,
    })
}

#[test]
fn only_decode_steps_of_a_replayable_rank_are_captured() {
    // Three sequences of one row, every row sampling: a decode step.
    let decode = with_step(&[1, 1, 1], &[0, 1, 2], |s| capture_key(s, true));
    assert_eq!(decode, Some(GraphKey { rows: 3, logit_rows: 3 }));
    // A decode step padded with a row of no sequence still is one.
    let padded = with_step(&[1, 1, 1], &[0, 1, 2, 3], |s| {
        let tokens = [TokenId(1); 4];
        let positions = [0u32; 4];
        capture_key(&StepInput { tokens: &tokens, positions: &positions, ..*s }, true)
    });
    assert_eq!(padded, Some(GraphKey { rows: 4, logit_rows: 4 }));
    // A prompt, and a prompt beside a decoding sequence, are never captured.
    assert_eq!(with_step(&[5], &[4], |s| capture_key(s, true)), None, "prefill");
    assert_eq!(with_step(&[1, 4], &[0, 4], |s| capture_key(s, true)), None, "mixed");
    // Nor is a decode step of a rank that cannot replay its forward.
    assert_eq!(with_step(&[1, 1], &[0, 1], |s| capture_key(s, false)), None, "not replayable");
}

#[test]
fn a_rank_replays_only_with_the_whole_model_and_device_routing() {
    let (_, llama) = load("llama-f32");
    assert!(llama.replayable(&Solo::new()), "the whole dense model on one rank");
    // The CPU routes a sparse layer on the host, reading the router mid-step.
    let (_, moe) = load("qwen3-moe");
    assert!(!moe.replayable(&Solo::new()), "host-routed experts");
    // A pipeline stage neither embeds and computes logits both.
    let ck = ckpt("llama-f32");
    let layout = Layout::pipeline(ck.config(), &[1, ck.config().num_layers - 1]).unwrap();
    let backend = CpuBackend::new();
    for slice in &layout.ranks {
        let stage: Model<CpuBackend> = Model::load_slice(&backend, &ck, slice, |_| {}).unwrap();
        assert!(!stage.replayable(&Solo::new()), "stage {}", slice.rank);
    }
}

/// A decode step of two sequences through `model`, run as `key`.
fn decode_two(
    backend: &CpuBackend,
    model: &Model<CpuBackend>,
    ws: &mut Workspace<CpuBackend>,
    kv: &mut KvCache<CpuBackend>,
    key: Option<GraphKey>,
) -> Result<(), ModelError> {
    let mut logits = Vec::new();
    with_step(&[1, 1], &[0, 1], |s| {
        model.forward(backend, ws, kv, &StepInput { capture: key, ..*s }, &mut logits)
    })
}

#[test]
fn the_model_refuses_a_key_it_cannot_replay_or_of_another_shape() {
    let key = Some(GraphKey { rows: 2, logit_rows: 2 });
    let (backend, moe) = load("qwen3-moe");
    let mut ws = moe.workspace(&backend, Tokens(4), 4).unwrap();
    let mut kv = moe.kv_cache(&backend, Tokens(16), Pages(4)).unwrap();
    assert!(decode_two(&backend, &moe, &mut ws, &mut kv, key).is_err(), "host-routed experts");
    assert!(decode_two(&backend, &moe, &mut ws, &mut kv, None).is_ok());

    let (backend, llama) = load("llama-f32");
    let mut ws = llama.workspace(&backend, Tokens(4), 4).unwrap();
    let mut kv = llama.kv_cache(&backend, Tokens(16), Pages(4)).unwrap();
    assert!(decode_two(&backend, &llama, &mut ws, &mut kv, key).is_ok());
    let other = Some(GraphKey { rows: 4, logit_rows: 4 });
    assert!(decode_two(&backend, &llama, &mut ws, &mut kv, other).is_err(), "a key of another batch size");
}

/// A prompt of 6 tokens for each of two sequences, then `steps` decode steps.
fn serve(exec: &mut SingleRank<CpuBackend>, steps: usize) -> Vec<f32> {
    let pages = |i: usize| vec![PageId(2 * i as u32), PageId(2 * i as u32 + 1)];
    let seq = |i: usize, row_start, rows, cached| ScheduledSeq {
        id: RequestId(i as u64),
        row_start,
        rows,
        cached,
        pages: pages(i),
        samples: true,
        state_slot: Some(StateSlot(i as u32)),
    };
    let mut logits = Vec::new();
    let mut step = SchedulerOutput::default();
    for i in 0..2 {
        step.tokens.extend((0..6).map(|t| TokenId((t * 7 + i as u32) % 100)));
        step.positions.extend(0..6);
        step.seqs.push(seq(i, 6 * i, 6, 0));
    }
    exec.execute(&step, &[5, 11], &mut logits).unwrap();
    for s in 0..steps {
        let mut step = SchedulerOutput::default();
        for i in 0..2 {
            step.tokens.push(TokenId((s * 3 + i) as u32 % 100));
            step.positions.push((6 + s) as u32);
            step.seqs.push(seq(i, i, 1, 6 + s));
        }
        exec.execute(&step, &[0, 1], &mut logits).unwrap();
    }
    logits
}

#[test]
fn the_executor_never_asks_a_host_routed_model_to_capture() {
    // The model refuses a key it cannot replay, so every decode step here
    // (padded to captured sizes, as on a device that replays) passing shows
    // the executor asked for none.
    let (backend, moe) = load("qwen3-moe");
    let limits = ExecutorLimits {
        max_rows: Tokens(16),
        max_logit_rows: 4,
        page_size: Tokens(16),
        num_pages: Pages(8),
    };
    let mut exec = SingleRank::new(backend, moe, limits).unwrap().with_decode_padding(true);
    assert_eq!(serve(&mut exec, 3).len(), 2 * exec.config().vocab_size);
    // The replayable model is handed keys of its padded shape (a key of any
    // other shape fails the step).
    let (backend, llama) = load("llama-f32");
    let mut exec = SingleRank::new(backend, llama, limits).unwrap().with_decode_padding(true);
    assert_eq!(serve(&mut exec, 3).len(), 2 * exec.config().vocab_size);
}
