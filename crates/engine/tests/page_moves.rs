//! Moving live KV pages: after an executor copies a sequence's pages to new
//! ids and the page table names the new ids, the next steps compute exactly
//! what they would have computed without the move — on one rank and on a
//! tensor-parallel layout of CPU ranks (every rank moves its own share).

use corridor_backend::cpu::CpuBackend;
use corridor_engine::executor::{Executor, ExecutorLimits, SingleRank};
use corridor_engine::ranks::{spawn_layout, LayoutOptions};
use corridor_engine::scheduler::{ScheduledSeq, SchedulerOutput};
use corridor_model::layout::{Layout, LayoutSpec, Split};
use corridor_model::Checkpoint;
use corridor_model::Model;
use corridor_units::{PageId, Pages, RequestId, TokenId, Tokens};
use std::path::Path;

const LIMITS: ExecutorLimits =
    ExecutorLimits { max_rows: Tokens(128), max_logit_rows: 4, page_size: Tokens(4), num_pages: Pages(32) };

fn checkpoint() -> Checkpoint {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/llama-f32");
    Checkpoint::open(&dir).unwrap()
}

fn one_rank() -> Box<dyn Executor> {
    let ckpt = checkpoint();
    let backend = CpuBackend::new();
    let model = Model::load(&backend, &ckpt, |_| {}).unwrap();
    Box::new(SingleRank::new(backend, model, LIMITS).unwrap())
}

fn tp2() -> Box<dyn Executor> {
    let ckpt = checkpoint();
    let spec = LayoutSpec { tp: 2, tp_split: Split::Ratio(vec![1, 1]), pp: 1, pp_split: Split::Even };
    let layout = Layout::from_spec(ckpt.config(), &spec, 1).unwrap();
    spawn_layout(&ckpt, &layout, LayoutOptions::new(LIMITS)).unwrap()
}

fn step(tokens: Vec<u32>, cached: usize, pages: &[PageId]) -> SchedulerOutput {
    let rows = tokens.len();
    SchedulerOutput {
        positions: (cached as u32..(cached + rows) as u32).collect(),
        tokens: TokenId::vec(&tokens),
        seqs: vec![ScheduledSeq {
            id: RequestId(1),
            row_start: 0,
            rows,
            cached,
            pages: pages.to_vec(),
            samples: true,
            state_slot: None,
        }],
        ..SchedulerOutput::default()
    }
}

/// A 14-token prompt on `pages`, then decode steps; between prefill and the
/// first decode the pages may move (`moves`), and the decode steps use the
/// page table after the move.
fn generate(exec: &mut dyn Executor, pages: &[PageId], moves: &[(PageId, PageId)]) -> Vec<Vec<f32>> {
    let mut logits = Vec::new();
    let prompt: Vec<u32> = (0..14).map(|t| (t * 37 % 300) as u32 + 3).collect();
    exec.execute(&step(prompt, 0, pages), &[13], &mut logits).unwrap();
    let mut out = vec![logits.clone()];
    if !moves.is_empty() {
        exec.move_pages(moves).unwrap();
    }
    let moved: Vec<PageId> =
        pages.iter().map(|p| moves.iter().find(|(f, _)| f == p).map_or(*p, |(_, t)| *t)).collect();
    for i in 0..5 {
        exec.execute(&step(vec![7 + i], 14 + i as usize, &moved), &[0], &mut logits).unwrap();
        out.push(logits.clone());
    }
    out
}

fn check(make: fn() -> Box<dyn Executor>) {
    let pages = [PageId(20), PageId(21), PageId(22), PageId(23), PageId(24)];
    let plain = generate(&mut *make(), &pages, &[]);
    // The last three pages move low (the first two stay), the way relief
    // empties a sparse chunk.
    let moves = [(PageId(22), PageId(1)), (PageId(23), PageId(2)), (PageId(24), PageId(5))];
    let moved = generate(&mut *make(), &pages, &moves);
    assert_eq!(plain, moved, "the moved pages hold the same KV");
    // And a move whose data was not copied would differ: the check can fail.
    let mut exec = make();
    let mut logits = Vec::new();
    let prompt: Vec<u32> = (0..14).map(|t| (t * 37 % 300) as u32 + 3).collect();
    exec.execute(&step(prompt, 0, &pages), &[13], &mut logits).unwrap();
    let uncopied = [PageId(20), PageId(21), PageId(1), PageId(2), PageId(5)];
    exec.execute(&step(vec![7], 14, &uncopied), &[0], &mut logits).unwrap();
    assert_ne!(logits, plain[1], "pages that were never copied give other logits");
}

#[test]
fn moved_pages_decode_exactly_as_before_on_one_rank() {
    check(one_rank);
}

#[test]
fn moved_pages_decode_exactly_as_before_on_tensor_ranks() {
    check(tp2);
}
