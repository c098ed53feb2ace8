//! Pipelines of CPU ranks: joined by a modelled link, every transfer pays
//! the link's time, which the group counts; cut into micro-batches, a step
//! gives the same logits as run whole, for prompts fed whole and in chunks
//! beside decodes.

use corridor_backend::collective::LinkModel;
use corridor_engine::executor::{Executor, ExecutorLimits};
use corridor_engine::ranks::{LayoutOptions, MultiRank};
use corridor_engine::scheduler::{ScheduledSeq, SchedulerOutput};
use corridor_model::layout::Layout;
use corridor_model::Checkpoint;
use corridor_units::{Bytes, PageId, Pages, RequestId, TokenId, Tokens};
use std::path::Path;
use std::time::{Duration, Instant};

fn open(name: &str) -> Checkpoint {
    Checkpoint::open(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny").join(name))
        .unwrap()
}

fn ckpt() -> Checkpoint {
    open("llama-f32")
}

fn limits() -> ExecutorLimits {
    ExecutorLimits { max_rows: Tokens(64), max_logit_rows: 4, page_size: Tokens(16), num_pages: Pages(32) }
}

/// One prompt of 40 tokens in pages 0..3.
fn prompt_step() -> SchedulerOutput {
    let rows = 40;
    SchedulerOutput {
        tokens: (0..rows as u32).map(|t| TokenId((t * 7 + 3) % 200)).collect(),
        positions: (0..rows as u32).collect(),
        seqs: vec![ScheduledSeq {
            id: RequestId(1),
            row_start: 0,
            rows,
            cached: 0,
            pages: (0..3).map(PageId).collect(),
            samples: true,
            state_slot: None,
        }],
        ..SchedulerOutput::default()
    }
}

#[test]
fn a_pipeline_pays_its_link_and_computes_the_same() {
    let ckpt = ckpt();
    let layout = Layout::pipeline(ckpt.config(), &[1, 1]).unwrap();
    let step = prompt_step();
    let whole = LayoutOptions { microbatch_rows: 0, ..LayoutOptions::new(limits()) };
    let mut free = MultiRank::spawn(&ckpt, &layout, whole).unwrap();
    let mut want = Vec::new();
    free.execute(&step, &[39], &mut want).unwrap();
    assert!(free.link_stats().iter().all(|s| s.time.is_zero()), "no link, nothing paid");

    let link: LinkModel = "1GB/s,30ms".parse().unwrap();
    let options = LayoutOptions { link: Some(link), microbatch_rows: 0, ..LayoutOptions::new(limits()) };
    let mut linked = MultiRank::spawn(&ckpt, &layout, options).unwrap();
    let mut got = Vec::new();
    let t0 = Instant::now();
    linked.execute(&step, &[39], &mut got).unwrap();
    let took = t0.elapsed();
    assert_eq!(got, want, "the link changes the time, not the numbers");
    // Stage 0 hands stage 1 the step's 40 rows of hidden state (f32).
    let bytes = Bytes((40 * ckpt.config().hidden_size * 4) as u64);
    let stats = linked.link_stats();
    assert_eq!(stats[0].bytes, bytes);
    assert_eq!(stats[0].time, link.send(bytes));
    assert!(took >= link.send(bytes) && took >= Duration::from_millis(30), "{took:?}");
}

fn seq(id: u64, row_start: usize, rows: usize, cached: usize, samples: bool) -> ScheduledSeq {
    // Four pages of 16 tokens per sequence, disjoint.
    let pages = (0..4).map(|p| PageId(id as u32 * 4 + p)).collect();
    ScheduledSeq { id: RequestId(id), row_start, rows, cached, pages, samples, state_slot: None }
}

/// Steps as the scheduler would form them, with the rows whose logits are
/// asked for: seq 1's 40-token prompt whole beside the first 20 rows of seq
/// 2's 30-token prompt; then seq 1 decoding, the rest of seq 2 and seq 3's
/// 25-token prompt whole (logit rows asked out of row order); then every
/// sequence decoding.
fn steps() -> Vec<(SchedulerOutput, Vec<usize>)> {
    let tok = |id: u64, at: usize| ((id as usize * 31 + at * 7) % 250) as u32;
    let build = |seqs: Vec<ScheduledSeq>, decode_rows: usize| {
        let mut out = SchedulerOutput { decode_rows, ..SchedulerOutput::default() };
        for s in &seqs {
            for r in 0..s.rows {
                out.tokens.push(TokenId(tok(s.id.get(), s.cached + r)));
                out.positions.push((s.cached + r) as u32);
            }
        }
        out.seqs = seqs;
        out
    };
    vec![
        (build(vec![seq(1, 0, 40, 0, true), seq(2, 40, 20, 0, false)], 0), vec![39]),
        (
            build(vec![seq(1, 0, 1, 40, true), seq(2, 1, 10, 20, true), seq(3, 11, 25, 0, true)], 1),
            vec![35, 0, 10],
        ),
        (
            build(vec![seq(1, 0, 1, 41, true), seq(2, 1, 1, 30, true), seq(3, 2, 1, 25, true)], 3),
            vec![0, 1, 2],
        ),
    ]
}

/// Every step's logits from a fresh group over `layout`, and the sends
/// stage 0 made (counted through a link of 1 ms latency and no wire time:
/// the modelled time is 1 ms a message).
fn run(ckpt: &Checkpoint, layout: &Layout, microbatch_rows: usize) -> (Vec<Vec<f32>>, u64) {
    let link = LinkModel::new(1e18, Duration::from_millis(1)).unwrap();
    let options = LayoutOptions { microbatch_rows, link: Some(link), ..LayoutOptions::new(limits()) };
    let mut group = MultiRank::spawn(ckpt, layout, options).unwrap();
    let logits = steps()
        .iter()
        .map(|(step, rows)| {
            let mut l = Vec::new();
            group.execute(step, rows, &mut l).unwrap();
            assert_eq!(l.len(), rows.len() * group.config().vocab_size);
            l
        })
        .collect();
    let sends = (group.link_stats()[0].time.as_secs_f64() * 1e3).round() as u64;
    (logits, sends)
}

#[test]
fn micro_batches_give_the_logits_of_whole_steps() {
    // PP=2 over two layers, PP=3 over three (bf16 weights, f32 compute).
    for (name, layers) in [("llama-f32", &[1, 1][..]), ("llama-bf16-sharded", &[1, 1, 1])] {
        let ckpt = open(name);
        let layout = Layout::pipeline(ckpt.config(), layers).unwrap();
        let (want, whole_sends) = run(&ckpt, &layout, 0);
        assert_eq!(whole_sends, 3, "{layers:?}: one send a step run whole");
        // 7 rows a part: 60 rows make 9 parts, 36 rows 6 parts, and the
        // all-decode step (no prompt rows) runs whole. Parts cut seq 1's and
        // seq 3's prompts and seq 2's chunks at rows that are not page
        // boundaries.
        let (got, sends) = run(&ckpt, &layout, 7);
        assert_eq!(sends, 9 + 6 + 1, "{layers:?}: a send per micro-batch");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let worst = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(worst <= 1e-5, "{layers:?} step {i}: logits differ by {worst}");
        }
    }
}

/// Through the engine loop: the scheduler's own steps (chunked prompts of
/// 24 rows beside decodes), cut into parts of 5 rows, give the greedy tokens
/// of one rank.
#[test]
fn a_micro_batched_pipeline_serves_what_one_rank_serves() {
    use corridor_engine::engine::{spawn_with, EngineConfig, Event};
    use corridor_engine::executor::SingleRank;
    use corridor_engine::pages::PagePool;
    use corridor_engine::sampling::SamplingParams;
    use corridor_engine::scheduler::SchedulerConfig;
    use corridor_model::Model;
    let l = ExecutorLimits {
        max_rows: Tokens(24),
        max_logit_rows: 4,
        page_size: Tokens(16),
        num_pages: Pages(64),
    };
    let serve = |exec: Box<dyn Executor>| {
        let config = EngineConfig {
            scheduler: SchedulerConfig {
                max_running: 4,
                max_batched_tokens: 24,
                context_len: 256,
                itl: corridor_engine::step_budget::ItlBound::NONE,
            },
            page_size: Tokens(16),
        };
        let e = spawn_with(exec, config, PagePool::standalone(Pages(64), Tokens(16))).unwrap();
        let prompts: Vec<Vec<u32>> = vec![(1..40).collect(), vec![5, 9, 200, 31], (100..150).rev().collect()];
        let mut streams: Vec<_> = prompts
            .into_iter()
            .map(|prompt| {
                e.submit(corridor_engine::engine::GenerateRequest {
                    prompt: TokenId::vec(&prompt),
                    params: SamplingParams { temperature: 0.0, ignore_eos: true, ..Default::default() },
                    max_new_tokens: Some(8),
                    eos_ids: vec![],
                    constraint: None,
                })
                .unwrap()
            })
            .collect();
        let out: Vec<Vec<u32>> = streams
            .iter_mut()
            .map(|s| {
                let mut toks = Vec::new();
                while let Event::Token { token, .. } = s.next_blocking().expect("engine alive") {
                    toks.push(token.get());
                }
                toks
            })
            .collect();
        e.shutdown();
        out
    };
    let ckpt = open("llama-bf16-sharded");
    let backend = corridor_backend::cpu::CpuBackend::new();
    let single = SingleRank::new(backend.clone(), Model::load(&backend, &ckpt, |_| {}).unwrap(), l).unwrap();
    let oracle = serve(Box::new(single));
    assert!(oracle.iter().all(|t| t.len() == 8), "{oracle:?}");
    let layout = Layout::pipeline(ckpt.config(), &[1, 1, 1]).unwrap();
    let options = LayoutOptions { microbatch_rows: 5, census_every: 2, ..LayoutOptions::new(l) };
    let got = serve(Box::new(MultiRank::spawn(&ckpt, &layout, options).unwrap()));
    assert_eq!(got, oracle);
}
