//! What micro-batching buys a pipeline's prefill: one 2,048-token prompt
//! prefilled in 512-row chunks (the server's default step) on PP=3 CPU
//! ranks joined by a modelled link, run whole and cut into micro-batches:
//!
//!     cargo run -p corridor-engine --example pipeline_prefill -- \
//!         [MODEL] [--link 16GB/s,5us] [--microbatch-rows 96] [--reps 3]
//!
//! MODEL defaults to the SmolLM2-135M GGUF that `scripts/fetch_test_assets.sh`
//! puts under `target/test-assets`. Prints the best of `--reps` runs of each
//! and the link time the ranks paid. Wall time on whatever machine runs it:
//! the stages are threads sharing the host's cores, so compare runs on one
//! machine only.

use corridor_backend::collective::LinkModel;
use corridor_engine::executor::{Executor, ExecutorLimits};
use corridor_engine::ranks::{LayoutOptions, MultiRank, DEFAULT_MICROBATCH_ROWS};
use corridor_engine::scheduler::{ScheduledSeq, SchedulerOutput};
use corridor_model::layout::Layout;
use corridor_model::Checkpoint;
use corridor_units::{PageId, Pages, RequestId, TokenId, Tokens};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const PROMPT: usize = 2048;
const CHUNK: usize = 512;
const PAGE: usize = 16;
const STAGES: usize = 3;

struct Args {
    model: PathBuf,
    link: LinkModel,
    microbatch_rows: usize,
    reps: usize,
}

fn args() -> Result<Args, String> {
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| "target".into());
    let mut a = Args {
        model: target.join("test-assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
        link: "16GB/s,5us".parse().map_err(|e| format!("{e}"))?,
        microbatch_rows: DEFAULT_MICROBATCH_ROWS,
        reps: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--link" => a.link = value("--link")?.parse().map_err(|e| format!("--link: {e}"))?,
            "--microbatch-rows" => {
                a.microbatch_rows =
                    value("--microbatch-rows")?.parse().map_err(|e| format!("--microbatch-rows: {e}"))?
            }
            "--reps" => a.reps = value("--reps")?.parse().map_err(|e| format!("--reps: {e}"))?,
            other if other.starts_with("--") => return Err(format!("unknown option {other}")),
            path => a.model = path.into(),
        }
    }
    Ok(a)
}

/// The prompt's chunks as the scheduler forms them: one sequence, 512 rows
/// a step, the last chunk sampling its last row.
fn chunks() -> Vec<(SchedulerOutput, Vec<usize>)> {
    let pages: Vec<PageId> = (0..PROMPT.div_ceil(PAGE) as u32).map(PageId).collect();
    (0..PROMPT / CHUNK)
        .map(|c| {
            let cached = c * CHUNK;
            let last = cached + CHUNK == PROMPT;
            let step = SchedulerOutput {
                tokens: (cached..cached + CHUNK).map(|t| TokenId((t * 7919 % 30_000) as u32 + 100)).collect(),
                positions: (cached as u32..(cached + CHUNK) as u32).collect(),
                seqs: vec![ScheduledSeq {
                    id: RequestId(1),
                    row_start: 0,
                    rows: CHUNK,
                    cached,
                    pages: pages.clone(),
                    samples: last,
                    state_slot: None,
                }],
                ..SchedulerOutput::default()
            };
            (step, if last { vec![CHUNK - 1] } else { Vec::new() })
        })
        .collect()
}

/// A pipeline over `layout` whose steps with more than `microbatch_rows`
/// prompt rows run as micro-batches (0: whole), warmed up by one chunk.
fn group(ckpt: &Checkpoint, layout: &Layout, link: LinkModel, microbatch_rows: usize) -> MultiRank {
    let limits = ExecutorLimits {
        max_rows: Tokens(CHUNK),
        max_logit_rows: 1,
        page_size: Tokens(PAGE),
        num_pages: Pages(PROMPT / PAGE),
    };
    let options = LayoutOptions { link: Some(link), microbatch_rows, ..LayoutOptions::new(limits) };
    let mut group = MultiRank::spawn(ckpt, layout, options).expect("spawn the pipeline");
    let (step, rows) = &chunks()[0];
    group.execute(step, rows, &mut Vec::new()).expect("warm-up step");
    group
}

/// One whole prefill on `group`: its time and the link time its ranks paid.
fn prefill(group: &mut MultiRank, vocab: usize) -> (Duration, Duration) {
    let paid = |g: &MultiRank| g.link_stats().iter().map(|s| s.time).sum::<Duration>();
    let before = paid(group);
    let mut logits = Vec::new();
    let t0 = Instant::now();
    for (step, rows) in &chunks() {
        group.execute(step, rows, &mut logits).expect("prefill step");
    }
    let took = t0.elapsed();
    assert_eq!(logits.len(), vocab, "the last chunk samples one row");
    (took, paid(group) - before)
}

fn main() {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("pipeline_prefill: {e}");
            std::process::exit(2);
        }
    };
    let ckpt = Checkpoint::open(&a.model).unwrap_or_else(|e| {
        eprintln!("pipeline_prefill: {}: {e} (run scripts/fetch_test_assets.sh)", a.model.display());
        std::process::exit(2);
    });
    let cfg = ckpt.config();
    let per = cfg.num_layers / STAGES;
    let mut layers = vec![per; STAGES];
    layers[STAGES - 1] += cfg.num_layers - per * STAGES;
    let layout = Layout::pipeline(cfg, &layers).expect("an even pipeline");
    println!(
        "{}: {PROMPT}-token prefill in {CHUNK}-row steps, PP={STAGES} layers {layers:?}, link {}, best of {}",
        a.model.file_name().map(|f| f.to_string_lossy().to_string()).unwrap_or_default(),
        a.link,
        a.reps
    );
    // Runs alternate between the two, so a change in the machine's load
    // falls on both alike.
    let kinds = [
        ("whole steps".to_string(), 0),
        (format!("micro-batched, {} rows a part", a.microbatch_rows), a.microbatch_rows),
    ];
    let mut groups: Vec<MultiRank> =
        kinds.iter().map(|(_, rows)| group(&ckpt, &layout, a.link, *rows)).collect();
    let mut best = vec![(Duration::MAX, Duration::ZERO); kinds.len()];
    for _ in 0..a.reps.max(1) {
        for (g, b) in groups.iter_mut().zip(&mut best) {
            let run = prefill(g, cfg.vocab_size);
            if run.0 < b.0 {
                *b = run;
            }
        }
    }
    for ((name, _), (t, link)) in kinds.iter().zip(&best) {
        let vs = best[0].0.as_secs_f64() / t.as_secs_f64();
        println!(
            "{name:>32}: {:9.1} ms  {:7.1} tok/s  link paid {:6.2} ms  {vs:.2}x whole",
            t.as_secs_f64() * 1e3,
            PROMPT as f64 / t.as_secs_f64(),
            link.as_secs_f64() * 1e3,
        );
    }
}
