//! Decode steps padded to a captured batch size: the padding rows belong to
//! no sequence, so they must touch no KV page and leave every real row's
//! logits exactly as an unpadded step computes them; and a warm-up over rows
//! of no sequence runs every shape without a page.

use corridor_backend::cpu::CpuBackend;
use corridor_engine::executor::{decode_bucket, Executor, SingleRank};
use corridor_engine::scheduler::{ScheduledSeq, SchedulerOutput};
use corridor_model::Checkpoint;
use corridor_model::Model;
use corridor_units::{PageId, Pages, RequestId, TokenId, Tokens};
use std::path::Path;

fn executor(padded: bool) -> SingleRank<CpuBackend> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/llama-f32");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let backend = CpuBackend::new();
    let model = Model::load(&backend, &ckpt, |_| {}).unwrap();
    let limits = corridor_engine::executor::ExecutorLimits {
        max_rows: Tokens(256),
        max_logit_rows: 16,
        page_size: Tokens(16),
        num_pages: Pages(64),
    };
    SingleRank::new(backend, model, limits).unwrap().with_decode_padding(padded)
}

fn empty_step() -> SchedulerOutput {
    SchedulerOutput::default()
}

/// `n` sequences: a prefill of `10 + i` tokens each, then `steps` decode steps.
fn run(exec: &mut SingleRank<CpuBackend>, n: usize, steps: usize) -> Vec<Vec<f32>> {
    let pages = |i: usize| -> Vec<PageId> { (0..4).map(|p| PageId((i * 4 + p) as u32)).collect() };
    let mut lens: Vec<usize> = (0..n).map(|i| 10 + i).collect();
    let mut out = Vec::new();
    let mut logits = Vec::new();
    // Prefill every sequence in one step.
    let mut step = empty_step();
    let mut logit_rows = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        let row_start = step.tokens.len();
        step.tokens.extend((0..len).map(|t| TokenId(((t * 31 + i * 7) % 200) as u32)));
        step.positions.extend(0..len as u32);
        step.seqs.push(ScheduledSeq {
            id: RequestId(i as u64),
            row_start,
            rows: len,
            cached: 0,
            pages: pages(i),
            samples: true,
            state_slot: None,
        });
        logit_rows.push(row_start + len - 1);
    }
    exec.execute(&step, &logit_rows, &mut logits).unwrap();
    out.push(logits.clone());
    for s in 0..steps {
        let mut step = empty_step();
        for (i, len) in lens.iter_mut().enumerate() {
            step.tokens.push(TokenId(((s * 13 + i * 5) % 200) as u32));
            step.positions.push(*len as u32);
            step.seqs.push(ScheduledSeq {
                id: RequestId(i as u64),
                row_start: i,
                rows: 1,
                cached: *len,
                pages: pages(i),
                samples: true,
                state_slot: None,
            });
            *len += 1;
        }
        let rows: Vec<usize> = (0..n).collect();
        exec.execute(&step, &rows, &mut logits).unwrap();
        out.push(logits.clone());
    }
    out
}

#[test]
fn padded_decode_steps_equal_unpadded_ones() {
    // 3 and 5 sequences pad to 4 and 8 rows; 9 to 16.
    for n in [3, 5, 9] {
        assert!(decode_bucket(n) > n);
        let plain = run(&mut executor(false), n, 4);
        let padded = run(&mut executor(true), n, 4);
        assert_eq!(plain.len(), padded.len());
        for (a, b) in plain.iter().zip(&padded) {
            assert_eq!(a.len(), b.len(), "padding rows' logits must be dropped");
            assert_eq!(a, b, "{n} sequences: padding changed a real row");
        }
    }
}

#[test]
fn buckets_cover_every_batch_with_few_sizes() {
    let sizes: std::collections::BTreeSet<usize> = (1..=128).map(decode_bucket).collect();
    assert_eq!(sizes.into_iter().collect::<Vec<_>>(), [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]);
    for rows in 1..=1000 {
        let b = decode_bucket(rows);
        assert!(b >= rows && b < rows + 64, "{rows} -> {b}");
    }
}

#[test]
fn warm_up_runs_every_shape_without_a_sequence() {
    // On the CPU nothing is captured, but every shape still runs.
    let mut plain = executor(false);
    assert_eq!(plain.warm_up().unwrap(), Vec::<usize>::new());
    let mut padded = executor(true);
    assert_eq!(padded.warm_up().unwrap(), [1, 2, 4, 8, 16]);
    // And a warmed-up executor still computes the same logits.
    let a = run(&mut executor(false), 3, 2);
    let b = run(&mut padded, 3, 2);
    assert_eq!(a, b);
}
