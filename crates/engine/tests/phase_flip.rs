//! A group of CPU ranks holding a tensor and a pipeline layout of one model
//! flips between them mid-generation: the KV of the live pages is re-sharded
//! and the next steps, in the other layout, compute what the first layout
//! would have computed (to f32 rounding: the two layouts sum in different
//! orders) — through two flips, on even and uneven splits, with a replicated
//! KV head and a stage that holds no layer. An abandoned flip (a forced
//! ballot disagreement) leaves the serving layout exactly as it was.

use corridor_backend::collective::{GroupShape, ThreadGroup};
use corridor_backend::cpu::CpuBackend;
use corridor_engine::executor::SingleRank;
use corridor_engine::executor::{Executor, ExecutorLimits};
use corridor_engine::phase::{AbandonReason, FlipVerdict, Phase};
use corridor_engine::ranks::{FlipParts, KvShare, LayoutOptions, MultiRank, RankParts};
use corridor_engine::scheduler::{ScheduledSeq, SchedulerOutput};
use corridor_model::layout::{Layout, LayoutSpec, Split};
use corridor_model::Checkpoint;
use corridor_model::Model;
use corridor_units::{Bytes, CardId, Pages, RequestId, TokenId, Tokens};
use corridor_units::{PageId, Rank};
use corridor_vram::{CardSettings, ChunkGeometry, Device, SimCard, SimCardSpec, SystemClock};
use std::path::Path;
use std::sync::Arc;

const LIMITS: ExecutorLimits =
    ExecutorLimits { max_rows: Tokens(128), max_logit_rows: 4, page_size: Tokens(4), num_pages: Pages(32) };

fn checkpoint() -> Checkpoint {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/llama-f32");
    Checkpoint::open(&dir).unwrap()
}

fn layouts(ckpt: &Checkpoint, tp: Vec<usize>, pp: Vec<usize>) -> [Layout; 2] {
    let n = tp.len();
    let t = LayoutSpec { tp: n, tp_split: Split::Ratio(tp), pp: 1, pp_split: Split::Even };
    let p = LayoutSpec { tp: 1, tp_split: Split::Even, pp: n, pp_split: Split::Ratio(pp) };
    [Layout::from_spec(ckpt.config(), &t, 1).unwrap(), Layout::from_spec(ckpt.config(), &p, 1).unwrap()]
}

fn group(tp: Vec<usize>, pp: Vec<usize>, serving: Phase) -> MultiRank {
    let ckpt = checkpoint();
    let l = layouts(&ckpt, tp, pp);
    MultiRank::spawn_flipping(&ckpt, l, serving, LayoutOptions::new(LIMITS)).unwrap()
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

const PAGES: [PageId; 5] = [PageId(20), PageId(3), PageId(22), PageId(9), PageId(24)];

/// A 13-token prompt, then 6 decode steps; `between(i)` runs before decode
/// step `i` (where a test flips).
fn generate(exec: &mut dyn Executor, mut between: impl FnMut(&mut dyn Executor, usize)) -> Vec<Vec<f32>> {
    let mut logits = Vec::new();
    let prompt: Vec<u32> = (0..13).map(|t| (t * 37 % 300) as u32 + 3).collect();
    exec.execute(&step(prompt, 0, &PAGES), &[12], &mut logits).unwrap();
    let mut out = vec![logits.clone()];
    for i in 0..6 {
        between(exec, i);
        exec.execute(&step(vec![7 + i as u32], 13 + i, &PAGES), &[0], &mut logits).unwrap();
        out.push(logits.clone());
    }
    out
}

fn flip(exec: &mut dyn Executor, to: Phase) -> FlipVerdict {
    let out = exec.flip(to, PAGES.to_vec(), None).unwrap();
    assert_eq!(
        exec.phase(),
        if matches!(out.verdict, FlipVerdict::Committed(_)) { Some(to) } else { Some(to.other()) }
    );
    out.verdict
}

fn close(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter().zip(b).flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs())).fold(0.0, f32::max)
}

fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0
}

fn carries_through_two_flips(tp: Vec<usize>, pp: Vec<usize>) {
    let plain = generate(&mut group(tp.clone(), pp.clone(), Phase::Tensor), |_, _| {});
    let mut flips = Vec::new();
    let flipped = generate(&mut group(tp.clone(), pp.clone(), Phase::Tensor), |e, i| match i {
        2 => flips.push(flip(e, Phase::Pipeline)),
        4 => flips.push(flip(e, Phase::Tensor)),
        _ => {}
    });
    for v in &flips {
        let FlipVerdict::Committed(r) = v else { panic!("flip abandoned: {v:?}") };
        assert!(r.sent.get() + r.local.get() > 0, "a flip moved nothing: {r:?}");
    }
    let diff = close(&plain, &flipped);
    assert!(diff < 1e-4, "logits after flips differ by {diff}");
    let tokens = |l: &[Vec<f32>]| l.iter().map(|r| argmax(r)).collect::<Vec<_>>();
    assert_eq!(tokens(&plain), tokens(&flipped));
    // The pipeline steps really ran on re-sharded KV: flipping with nothing
    // live carried leaves the pipeline's caches empty, and the logits differ.
    let empty = generate(&mut group(tp, pp, Phase::Tensor), |e, i| {
        if i == 2 {
            assert!(matches!(
                e.flip(Phase::Pipeline, Vec::new(), None).unwrap().verdict,
                FlipVerdict::Committed(_)
            ));
        }
    });
    assert!(close(&plain, &empty) > 1e-2, "a flip that carried no KV decoded the same");
}

#[test]
fn two_even_ranks_carry_a_sequence_through_two_flips() {
    carries_through_two_flips(vec![1, 1], vec![1, 1]);
}

#[test]
fn three_uneven_ranks_with_a_replica_and_an_empty_stage_carry_it_too() {
    // Four query heads as 2,1,1 over two KV heads: ranks 1 and 2 both hold
    // KV head 1; the pipeline puts both layers on the first two stages.
    carries_through_two_flips(vec![2, 1, 1], vec![1, 1, 0]);
}

#[test]
fn a_pipeline_group_flips_to_tensor_and_back() {
    let plain = generate(&mut group(vec![1, 1], vec![1, 1], Phase::Pipeline), |_, _| {});
    let flipped = generate(&mut group(vec![1, 1], vec![1, 1], Phase::Pipeline), |e, i| {
        if i == 1 {
            assert!(matches!(flip(e, Phase::Tensor), FlipVerdict::Committed(_)));
        }
        if i == 3 {
            assert!(matches!(flip(e, Phase::Pipeline), FlipVerdict::Committed(_)));
        }
    });
    assert!(close(&plain, &flipped) < 1e-4);
}

#[test]
fn a_ballot_mismatch_abandons_on_every_rank_and_serving_goes_on() {
    let plain = generate(&mut group(vec![2, 1, 1], vec![1, 1, 0], Phase::Tensor), |_, _| {});
    let mut epochs = Vec::new();
    let abandoned = generate(&mut group(vec![2, 1, 1], vec![1, 1, 0], Phase::Tensor), |e, i| {
        if i == 2 {
            let out = e.flip(Phase::Pipeline, PAGES.to_vec(), Some(Rank(1))).unwrap();
            assert_eq!(out.verdict, FlipVerdict::Abandoned(AbandonReason::Ballot));
            assert_eq!(e.phase(), Some(Phase::Tensor), "an abandoned flip keeps the serving layout");
            epochs.push(out.epoch);
            // The group still agrees on everything: the next flip commits.
            let out = e.flip(Phase::Pipeline, PAGES.to_vec(), None).unwrap();
            assert!(matches!(out.verdict, FlipVerdict::Committed(_)), "{out:?}");
            epochs.push(out.epoch);
        }
    });
    assert_eq!(epochs, vec![1, 2]);
    assert!(close(&plain, &abandoned) < 1e-4);
}

#[test]
fn flipping_to_the_serving_layout_is_refused() {
    let mut g = group(vec![1, 1], vec![1, 1], Phase::Tensor);
    assert!(g.flip(Phase::Tensor, PAGES.to_vec(), None).is_err());
    assert_eq!(g.phase(), Some(Phase::Tensor));
    assert_eq!(g.layouts().len(), 2);
}

/// Two even ranks whose rank 1 keeps its KV on `card` (rank 0 has none).
fn group_on(card: Arc<SimCard>) -> MultiRank {
    let ckpt = checkpoint();
    let layouts = layouts(&ckpt, vec![1, 1], vec![1, 1]);
    let options = LayoutOptions::new(LIMITS);
    let timeout = options.collective_timeout;
    let (tp_group, tp) = ThreadGroup::new(2, GroupShape::Tensor, timeout);
    let (pp_group, pp) = ThreadGroup::new(2, GroupShape::Pipeline, timeout);
    let (control, ctl) = ThreadGroup::new(2, GroupShape::Tensor, timeout);
    let device = Device::standalone(card, CardSettings::default());
    let geometry = ChunkGeometry::new(Bytes(8192), Bytes::mib(2), Bytes::mib(2)).unwrap();
    let ranks = tp
        .into_iter()
        .zip(pp)
        .zip(ctl)
        .enumerate()
        .map(|(i, ((t, p), c))| {
            let load = |l: &Layout, comm| {
                let backend = CpuBackend::new();
                let model = Model::load_slice(&backend, &ckpt, &l.ranks[i], |_| {}).unwrap();
                SingleRank::new(backend, model, LIMITS).unwrap().with_collective(comm)
            };
            let exec = load(&layouts[0], Box::new(t) as Box<_>);
            let other = load(&layouts[1], Box::new(p) as Box<_>);
            let kv = (i == 1).then(|| KvShare { device: device.clone(), geometry, margin: Bytes::ZERO });
            RankParts { exec, kv, flip: Some(FlipParts { other, control: c }) }
        })
        .collect();
    MultiRank::start_flipping(
        ckpt.config().clone(),
        layouts,
        [tp_group, pp_group],
        control,
        ranks,
        Phase::Tensor,
        options,
    )
    .unwrap()
}

#[test]
fn a_flip_whose_staging_a_card_cannot_fund_is_abandoned_before_any_byte_moves() {
    let card =
        Arc::new(SimCard::new(SimCardSpec::new(CardId(1), Bytes::gib(4)), &[], Arc::new(SystemClock::new())));
    let plain = generate(&mut group_on(card.clone()), |_, _| {});
    // A foreign process holds the card under its 1 GiB floor: rank 1 cannot
    // reserve its staging without landing under it.
    card.set_foreign(4242, Bytes::gib(3) + Bytes::mib(512));
    let mut verdicts = Vec::new();
    let mut g = group_on(card.clone());
    let under = generate(&mut g, |e, i| {
        if i == 2 {
            verdicts.push(e.flip(Phase::Pipeline, PAGES.to_vec(), None).unwrap());
            assert_eq!(e.phase(), Some(Phase::Tensor));
        }
    });
    assert_eq!(verdicts[0].verdict, FlipVerdict::Abandoned(AbandonReason::NotUnanimous("ready")));
    assert!(verdicts[0].staging > Bytes::ZERO);
    assert_eq!(card.our_bytes(), Bytes::ZERO, "nothing was reserved under the floor");
    assert_eq!(plain, under, "serving went on in the layout it had, exactly");
    // The foreign process leaves: the same flip is funded and commits.
    card.set_foreign(4242, Bytes::ZERO);
    let out = g.flip(Phase::Pipeline, PAGES.to_vec(), None).unwrap();
    assert!(matches!(out.verdict, FlipVerdict::Committed(_)), "{out:?}");
}
