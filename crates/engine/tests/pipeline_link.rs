//! CPU ranks of a layout joined by a modelled link: every transfer pays the
//! link's time, which the group counts, and the logits are the same as
//! without it.

use corridor_backend::collective::LinkModel;
use corridor_engine::executor::{Executor, ExecutorLimits};
use corridor_engine::ranks::{LayoutOptions, MultiRank};
use corridor_engine::scheduler::{ScheduledSeq, SchedulerOutput};
use corridor_model::layout::Layout;
use corridor_model::Checkpoint;
use corridor_units::{Bytes, PageId};
use std::path::Path;
use std::time::{Duration, Instant};

fn limits() -> ExecutorLimits {
    ExecutorLimits { max_rows: 64, max_logit_rows: 4, page_size: 16, num_pages: 32 }
}

/// One prompt of 40 tokens in pages 0..3.
fn prompt_step() -> SchedulerOutput {
    let rows = 40;
    SchedulerOutput {
        tokens: (0..rows as u32).map(|t| (t * 7 + 3) % 200).collect(),
        positions: (0..rows as u32).collect(),
        seqs: vec![ScheduledSeq {
            id: 1,
            row_start: 0,
            rows,
            cached: 0,
            pages: (0..3).map(PageId).collect(),
            samples: true,
        }],
        ..SchedulerOutput::default()
    }
}

#[test]
fn a_pipeline_pays_its_link_and_computes_the_same() {
    let ckpt =
        Checkpoint::open(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/llama-f32"))
            .unwrap();
    let layout = Layout::pipeline(ckpt.config(), &[1, 1]).unwrap();
    let step = prompt_step();
    let mut free = MultiRank::spawn(&ckpt, &layout, LayoutOptions::new(limits())).unwrap();
    let mut want = Vec::new();
    free.execute(&step, &[39], &mut want).unwrap();
    assert!(free.link_stats().iter().all(|s| s.time.is_zero()), "no link, nothing paid");

    let link: LinkModel = "1GB/s,30ms".parse().unwrap();
    let options = LayoutOptions { link: Some(link), ..LayoutOptions::new(limits()) };
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
