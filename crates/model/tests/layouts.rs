//! Parallel layouts against the single-rank oracle, on the tiny checkpoints.
//!
//! Each layout runs as threads with the in-process collective: tensor
//! parallelism with uneven head, FFN and vocabulary shares (TP=2 with 3:1
//! heads, TP=3 with 2:1:1, so one rank holds a replica of a KV head), and
//! pipeline parallelism with uneven layer counts (including a stage that
//! holds no layer, since the fixtures have two layers). The prompt is fed in
//! uneven chunks over a scrambled page table, then decoded greedily.
//!
//! Tolerance: 1e-4 on logits. A layout changes only the order of summation
//! (partial sums over heads and FFN columns added by the all-reduce), which
//! moves f32 logits of these models by about 1e-6; a wrong slice (a head read
//! against the wrong KV head, an FFN block dropped, a misplaced vocabulary
//! block) moves them by 1e-2 or more. Decode keeps activations in f32
//! (`DecodeActivations::F32`): a slice cut inside a quantized block is
//! widened to f32 at load, so with 8-bit activations the oracle and the
//! slices would round differently.

use corridor_backend::collective::{Collective, GroupShape, ThreadGroup};
use corridor_backend::cpu::{CpuBackend, DecodeActivations};
use corridor_backend::SeqStep;
use corridor_model::layout::{Layout, LayoutKind};
use corridor_model::Checkpoint;
use corridor_model::{Model, StepInput};
use corridor_units::{PageId, Pages, StateSlot, TokenId, Tokens};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

const TOL: f32 = 1e-4;
const PAGE: usize = 4;
const PROMPT: [u32; 11] = [1, 17, 42, 99, 3, 250, 7, 7, 300, 12, 5];
const STEPS: usize = 6;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny")
}

/// One step every rank runs: tokens from `cached` on, logits of every row.
#[derive(Clone)]
struct Job {
    tokens: Vec<u32>,
    cached: usize,
}

/// Logits of every row of every step, and the greedy continuation, with the
/// model split by `layout` (one thread per rank).
fn run(path: &Path, layout: &Layout) -> (Vec<Vec<f32>>, Vec<u32>) {
    let ckpt = Checkpoint::open(path).unwrap();
    let vocab = ckpt.config().vocab_size;
    let world = layout.ranks.len();
    let shape = if layout.kind == LayoutKind::Pipeline { GroupShape::Pipeline } else { GroupShape::Tensor };
    let (_group, ranks) = ThreadGroup::new(world, shape, Duration::from_secs(60));
    let pages_needed = (PROMPT.len() + STEPS).div_ceil(PAGE);
    // Odd page ids, highest first: shared by all ranks, as the engine's are.
    let pages: Vec<PageId> = (0..pages_needed).map(|i| PageId((2 * (pages_needed - i) - 1) as u32)).collect();
    let mut jobs = Vec::new();
    let (reply_tx, reply_rx) = mpsc::channel::<(usize, Vec<f32>)>();
    let mut threads = Vec::new();
    for (slice, comm) in layout.ranks.iter().cloned().zip(ranks) {
        let backend = CpuBackend::with_decode_activations(DecodeActivations::F32);
        let model = Model::load_slice(&backend, &ckpt, &slice, |_| {}).unwrap();
        let (tx, rx) = mpsc::channel::<Job>();
        jobs.push(tx);
        let (reply, pages) = (reply_tx.clone(), pages.clone());
        threads.push(std::thread::spawn(move || {
            let total = PROMPT.len() + STEPS;
            let mut ws = model.workspace(&backend, Tokens(total), total).unwrap();
            let mut kv = model.kv_cache(&backend, Tokens(PAGE), Pages(2 * pages.len() + 1)).unwrap();
            let mut logits = Vec::new();
            for job in rx {
                let rows = job.tokens.len();
                let seqs = [SeqStep { row_start: 0, rows, cached: job.cached, pages: &pages }];
                let positions: Vec<u32> = (job.cached..job.cached + rows).map(|p| p as u32).collect();
                let logit_rows: Vec<usize> = (0..rows).collect();
                let step = StepInput {
                    tokens: TokenId::from_u32_slice(&job.tokens),
                    positions: &positions,
                    seqs: &seqs,
                    logit_rows: &logit_rows,
                    // One sequence, in its state slot (a model without state ignores it).
                    state_slots: &[StateSlot(0)],
                    capture: None,
                };
                model
                    .forward_ranked(
                        &backend,
                        &comm as &dyn Collective<CpuBackend>,
                        &mut ws,
                        &mut kv,
                        &step,
                        &mut logits,
                    )
                    .unwrap();
                if slice.emits_logits() {
                    reply.send((slice.rank.0 as usize, logits.clone())).unwrap();
                }
            }
        }));
    }
    drop(reply_tx);
    let emitters = layout.ranks.iter().filter(|r| r.emits_logits()).count();
    let step = |tokens: &[u32], cached: usize| -> Vec<f32> {
        for tx in &jobs {
            tx.send(Job { tokens: tokens.to_vec(), cached }).unwrap();
        }
        let mut got: Vec<(usize, Vec<f32>)> = (0..emitters).map(|_| reply_rx.recv().unwrap()).collect();
        got.sort_by_key(|g| g.0);
        // The first rank that computes logits (rank 0 of a tensor group, the
        // last stage of a pipeline) holds all of them after the gather; the
        // other tensor ranks hold none.
        let (first, rest) = got.split_first().expect("a rank emits logits");
        assert!(!first.1.is_empty(), "rank{} holds the logits", first.0);
        for (r, l) in rest {
            assert!(l.is_empty(), "rank{r} holds {} logits it does not sample", l.len());
        }
        first.1.clone()
    };
    let mut rows = Vec::new();
    let mut done = 0;
    for chunk in [5, 1, 5] {
        let l = step(&PROMPT[done..done + chunk], done);
        rows.extend(l.chunks(vocab).map(|r| r.to_vec()));
        done += chunk;
    }
    let argmax = |r: &[f32]| (0..r.len()).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap() as u32;
    let mut greedy = vec![argmax(rows.last().unwrap())];
    while greedy.len() < STEPS {
        let l = step(&[*greedy.last().unwrap()], PROMPT.len() + greedy.len() - 1);
        rows.push(l.clone());
        greedy.push(argmax(&l));
    }
    drop(jobs);
    for t in threads {
        t.join().unwrap();
    }
    (rows, greedy)
}

fn check(fixture: &str) {
    let path = fixtures().join(fixture);
    let cfg = Checkpoint::open(&path).unwrap().config().clone();
    // Whole quantization blocks for the GGUF file's FFN columns.
    let granule = if fixture.ends_with(".gguf") { 32 } else { 1 };
    let layouts = vec![
        ("tp=2 heads 3:1", Layout::tensor_ratio(&cfg, &[3, 1], granule).unwrap()),
        ("tp=3 heads 2:1:1", Layout::tensor_ratio(&cfg, &[2, 1, 1], granule).unwrap()),
        ("tp=3 heads 1:1:2", Layout::tensor_ratio(&cfg, &[1, 1, 2], granule).unwrap()),
        ("pp=2 layers 0,2", Layout::pipeline(&cfg, &[0, 2]).unwrap()),
        ("pp=2 layers 1,1", Layout::pipeline(&cfg, &[1, 1]).unwrap()),
        ("pp=3 layers 1,0,1", Layout::pipeline(&cfg, &[1, 0, 1]).unwrap()),
        ("pp=3 layers 2,0,0", Layout::pipeline(&cfg, &[2, 0, 0]).unwrap()),
    ];
    compare(fixture, layouts);
}

/// Every layout of `layouts` against the single rank, on `fixture`.
fn compare(fixture: &str, layouts: Vec<(&str, Layout)>) {
    let path = fixtures().join(fixture);
    let cfg = Checkpoint::open(&path).unwrap().config().clone();
    let (oracle_rows, oracle_greedy) = run(&path, &Layout::single(&cfg));
    for (name, layout) in layouts {
        let (rows, greedy) = run(&path, &layout);
        let mut worst = 0f32;
        for (a, b) in rows.iter().zip(&oracle_rows) {
            for (x, y) in a.iter().zip(b) {
                worst = worst.max((x - y).abs());
            }
        }
        println!("{fixture} {name} [{}]: max |logit diff| {worst:.2e}", layout.describe());
        assert_eq!(rows.len(), oracle_rows.len());
        assert!(worst < TOL, "{fixture} {name}: logits differ by {worst}");
        assert_eq!(greedy, oracle_greedy, "{fixture} {name}: greedy continuation differs");
    }
}

/// The hybrid split by layers and by heads. Pipeline stages hold the KV of
/// their full-attention layers and the state of their linear ones (stages
/// of linear layers only, of the full one only, and one holding no layer).
/// Tensor shares hold uneven query and KV heads, the delta-net key heads in
/// proportion with the value heads that read them (grouped in the
/// safetensors file, tiled in the GGUF one), FFN columns and vocabulary rows.
#[test]
fn qwen3_5_layouts_match_the_single_rank() {
    let cfg = Checkpoint::open(&fixtures().join("qwen3_5")).unwrap().config().clone();
    let layouts = || {
        vec![
            ("tp=2 heads 3:1", Layout::tensor_ratio(&cfg, &[3, 1], 1).unwrap()),
            ("tp=2 heads 1:1", Layout::tensor_ratio(&cfg, &[1, 1], 1).unwrap()),
            ("pp=2 layers 3,1", Layout::pipeline(&cfg, &[3, 1]).unwrap()),
            ("pp=2 layers 1,3", Layout::pipeline(&cfg, &[1, 3]).unwrap()),
            ("pp=3 layers 2,0,2", Layout::pipeline(&cfg, &[2, 0, 2]).unwrap()),
        ]
    };
    compare("qwen3_5", layouts());
    compare("qwen3_5-f16.gguf", layouts());
}

/// A tensor share that would hold none of the delta-net's key heads is
/// refused with a reason, not run wrongly.
#[test]
fn qwen3_5_shares_without_a_key_head_are_refused() {
    let ckpt = Checkpoint::open(&fixtures().join("qwen3_5")).unwrap();
    // Heads 2:1:1 of 4 give the middle rank a quarter of 2 key heads: none.
    let layout = Layout::tensor_ratio(ckpt.config(), &[2, 1, 1], 1).unwrap();
    let err = Model::load_slice(&CpuBackend::new(), &ckpt, &layout.ranks[1], |_| {}).err().expect("refused");
    assert!(err.to_string().contains("none of the 2 delta-net key heads"), "{err}");
    assert!(Model::load_slice(&CpuBackend::new(), &ckpt, &layout.ranks[0], |_| {}).is_ok());
}

#[test]
fn llama_f32_layouts_match_the_single_rank() {
    check("llama-f32");
}

#[test]
fn qwen2_tied_with_biases_layouts_match_the_single_rank() {
    check("qwen2-tied");
}

#[test]
fn qwen3_qk_norm_layouts_match_the_single_rank() {
    check("qwen3");
}

#[test]
fn gguf_quantized_layouts_match_the_single_rank() {
    check("llama-q.gguf");
}

/// The mixture of experts (three layers, the middle one dense): uneven
/// tensor splits cut every expert's columns by the ranks' ratios, pipeline
/// stages split the sparse and dense layers between them.
#[test]
fn qwen3_moe_layouts_match_the_single_rank() {
    let cfg = Checkpoint::open(&fixtures().join("qwen3-moe")).unwrap().config().clone();
    let layouts = vec![
        ("tp=2 heads 3:1", Layout::tensor_ratio(&cfg, &[3, 1], 1).unwrap()),
        ("tp=2 heads 1:1", Layout::tensor_ratio(&cfg, &[1, 1], 1).unwrap()),
        ("tp=3 heads 2:1:1", Layout::tensor_ratio(&cfg, &[2, 1, 1], 1).unwrap()),
        ("pp=2 layers 1,2", Layout::pipeline(&cfg, &[1, 2]).unwrap()),
        ("pp=2 layers 2,1", Layout::pipeline(&cfg, &[2, 1]).unwrap()),
        ("pp=3 layers 1,1,1", Layout::pipeline(&cfg, &[1, 1, 1]).unwrap()),
    ];
    for (name, layout) in &layouts {
        if layout.kind == LayoutKind::Tensor {
            let cols: Vec<usize> = layout.ranks.iter().map(|r| r.expert_ffn(&cfg).len()).collect();
            let ffn: Vec<usize> = layout.ranks.iter().map(|r| r.ffn.len()).collect();
            assert_eq!(cols.iter().sum::<usize>(), 32, "{name}: every expert column is held once");
            assert!(
                cols.windows(2).zip(ffn.windows(2)).all(|(c, f)| c[0] * f[1] == c[1] * f[0]),
                "{name}: {cols:?} by the ratios of {ffn:?}"
            );
        }
    }
    compare("qwen3-moe", layouts);
}

/// A slice whose query heads would read the wrong KV head is refused at load
/// rather than producing plausible but wrong logits.
#[test]
fn a_wrong_kv_mapping_is_refused() {
    let path = fixtures().join("llama-f32");
    let ckpt = Checkpoint::open(&path).unwrap();
    let mut layout = Layout::tensor_ratio(ckpt.config(), &[3, 1], 1).unwrap();
    layout.ranks[0].kv_heads = vec![0, 1, 1];
    let err = Model::load_slice(&CpuBackend::new(), &ckpt, &layout.ranks[0], |_| {}).err().expect("refused");
    assert!(err.to_string().contains("KV head"), "{err}");
}

/// The layout cost model prices a mixture of experts by every expert it
/// holds (a card stores all of them, though a token reads only a few): in
/// f32 the whole model's price is the checkpoint's tensor bytes exactly, and
/// the shares of a tensor split add up to it plus what every rank repeats.
#[test]
fn the_cost_model_counts_every_expert() {
    use corridor_backend::DType;
    use corridor_model::layout::CostModel;
    use corridor_units::{Bytes, Tokens};
    let ckpt = Checkpoint::open(&fixtures().join("qwen3-moe")).unwrap();
    let cfg = ckpt.config().clone();
    let hf = ckpt.hf().expect("a safetensors directory");
    let stored: u64 =
        hf.tensor_names().iter().map(|n| ckpt.tensor(n).unwrap().data.bytes().len() as u64).sum();
    let cost = CostModel {
        weight_dtype: DType::F32,
        kv_elem_bytes: 4,
        page_size: Tokens(16),
        max_rows: 16,
        max_logit_rows: 16,
        chunk_target: Bytes::mib(2),
    };
    let single = Layout::single(&cfg);
    assert_eq!(cost.weights(&cfg, &single.ranks[0]).get(), stored);

    let moe = cfg.moe.clone().unwrap();
    let tp = Layout::tensor_ratio(&cfg, &[1, 1], 1).unwrap();
    let shares: u64 = tp.ranks.iter().map(|r| cost.weights(&cfg, r).get()).sum();
    let (h, layers) = (cfg.hidden_size as u64, cfg.num_layers as u64);
    let sparse = (0..cfg.num_layers).filter(|&i| cfg.is_sparse_layer(i)).count() as u64;
    // Repeated on the second rank: the norms (two per layer, and q/k norms),
    // the embedding, the final norm, and each sparse layer's router.
    let repeated = 4 * (2 * h * layers + 2 * cfg.head_dim as u64 * layers)
        + 4 * (cfg.vocab_size as u64 * h + h)
        + 4 * sparse * moe.num_experts as u64 * h;
    assert_eq!(shares, stored + repeated);
}

/// The qwen3moe GGUF (stacked experts read one expert at a time): tensor
/// splits cut each expert's view, pipeline stages split the layers.
#[test]
fn qwen3_moe_gguf_layouts_match_the_single_rank() {
    let cfg = Checkpoint::open(&fixtures().join("qwen3-moe-f16.gguf")).unwrap().config().clone();
    let layouts = vec![
        ("tp=2 heads 3:1", Layout::tensor_ratio(&cfg, &[3, 1], 1).unwrap()),
        ("pp=2 layers 1,1", Layout::pipeline(&cfg, &[1, 1]).unwrap()),
    ];
    compare("qwen3-moe-f16.gguf", layouts);
}

/// A tensor share so thin that it holds none of the experts' columns is
/// refused at load with a message that says so, not run with an empty FFN.
#[test]
fn a_rank_without_expert_columns_is_refused() {
    let ckpt = Checkpoint::open(&fixtures().join("qwen3-moe")).unwrap();
    let cfg = ckpt.config();
    // FFN 124 / 1 / 3 of 128: the middle rank's one column is no column of 32.
    let layout = Layout::tensor(cfg, &[2, 1, 1], &[124, 1, 3], &[128, 128, 128]).unwrap();
    assert!(layout.ranks[1].expert_ffn(cfg).is_empty());
    let err = Model::load_slice(&CpuBackend::new(), &ckpt, &layout.ranks[1], |_| {}).err().expect("refused");
    assert!(err.to_string().contains("experts' columns"), "{err}");
    // Its neighbours hold columns and load.
    assert!(Model::load_slice(&CpuBackend::new(), &ckpt, &layout.ranks[2], |_| {}).is_ok());
}
