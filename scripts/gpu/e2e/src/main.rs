//! Every tiny checkpoint through `Model::forward` on the CUDA backend and on
//! the CPU backend: prompt logits within bf16 tolerance (2e-2 of the largest
//! logit: weights and KV are bf16 on the device), and the greedy
//! continuation equal token for token, with decode steps at batch 1.
//!
//! Greedy paths are compared up to the first genuine near tie: a step whose
//! CPU top-1/top-2 logit gap is under the bf16 error bound, where either
//! choice is correct.
//!
//! Usage: gpu-e2e <fixtures dir> (tests/fixtures/tiny), or
//!        gpu-e2e <SmolLM2-135M-Instruct.Q4_1.gguf> for the "Paris" check, or
//!        gpu-e2e logits <checkpoint> <id,id,...> <out.f32>: one prefill of
//!        the ids on the GPU, the logits of every position written as raw
//!        little-endian f32 `[positions, vocab]` (scripts/gpu/compare_logits.py
//!        compares them with transformers).

use corridor_backend::cpu::CpuBackend;
use corridor_backend::cuda::{CudaBackend, CudaBackendConfig};
use corridor_backend::{Backend, SeqStep};
use corridor_model::greedy::greedy;
use corridor_model::llama::{Model, StepInput};
use corridor_model::Checkpoint;
use corridor_units::PageId;
use std::path::Path;

const TOL: f32 = 2e-2;

/// Greedy continuation: (first-step logits, tokens, top-1/top-2 gap per step),
/// over a scrambled page table.
fn generate<B: Backend>(
    b: &B,
    ckpt: &Checkpoint,
    prompt: &[u32],
    steps: usize,
) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
    let model = Model::load(b, ckpt, |_| {}).expect("load");
    let pages = [PageId(5), PageId(1), PageId(9), PageId(3)];
    let mut first = Vec::new();
    let mut gaps = Vec::new();
    let toks = greedy(&model, b, prompt, steps, &pages, |logits| {
        if first.is_empty() {
            first = logits.to_vec();
        }
        let best = (0..logits.len()).max_by(|&a, &c| logits[a].total_cmp(&logits[c])).unwrap();
        let second =
            (0..logits.len()).filter(|&i| i != best).map(|i| logits[i]).fold(f32::NEG_INFINITY, f32::max);
        gaps.push(logits[best] - second);
    })
    .expect("greedy decode");
    (first, toks, gaps)
}

/// SmolLM2-135M-Instruct answers the ChatML "capital of France" prompt with
/// "The capital of France is Paris." (its own token ids) on the GPU.
fn paris(gpu: &CudaBackend, path: &Path) -> bool {
    let ckpt = Checkpoint::open(path).expect("SmolLM2 opens");
    let prompt: Vec<u32> = vec![1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198];
    let want: Vec<u32> = vec![504, 3575, 282, 4649, 314, 7042, 30, 2];
    let (_, got, _) = generate(gpu, &ckpt, &prompt, want.len());
    let ok = got == want;
    println!("{} SmolLM2 Paris on the GPU: got {got:?}, want {want:?}", if ok { "PASS" } else { "FAIL" });
    ok
}

/// The logits of every position of one prefill of `ids`.
fn all_logits<B: Backend>(b: &B, ckpt: &Checkpoint, ids: &[u32]) -> Vec<f32> {
    let model = Model::load(b, ckpt, |_| {}).expect("load");
    let n = ids.len();
    let mut ws = model.workspace(b, n, n).expect("workspace");
    let pages: Vec<PageId> = (0..n.div_ceil(16) as u32).rev().map(PageId).collect();
    let mut kv = model.kv_cache(b, 16, pages.len()).expect("kv");
    let positions: Vec<u32> = (0..n as u32).collect();
    let seqs = [SeqStep { row_start: 0, rows: n, cached: 0, pages: &pages }];
    let rows: Vec<usize> = (0..n).collect();
    let step = StepInput { tokens: ids, positions: &positions, seqs: &seqs, logit_rows: &rows, state_slots: &[] };
    let mut logits = Vec::new();
    model.forward(b, &mut ws, &mut kv, &step, &mut logits).expect("forward");
    logits
}

fn main() {
    let dir = std::env::args().nth(1).unwrap_or_else(|| "tests/fixtures/tiny".into());
    let gpu = CudaBackend::new(CudaBackendConfig::default()).expect("cuda backend");
    if dir == "logits" {
        let a: Vec<String> = std::env::args().skip(2).collect();
        let [model, ids, out] = &a[..] else {
            eprintln!("usage: gpu-e2e logits <checkpoint> <id,id,...> <out.f32>");
            std::process::exit(2);
        };
        let ids: Vec<u32> = ids.split(',').map(|t| t.trim().parse().expect("token id")).collect();
        let ckpt = Checkpoint::open(Path::new(model)).expect("checkpoint opens");
        let logits = all_logits(&gpu, &ckpt, &ids);
        let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(out, bytes).expect("write logits");
        println!("wrote {} x {} logits to {out}", ids.len(), logits.len() / ids.len().max(1));
        return;
    }
    if dir.ends_with(".gguf") {
        std::process::exit(i32::from(!paris(&gpu, Path::new(&dir))));
    }
    let cpu = CpuBackend::new();
    let mut entries: Vec<_> =
        std::fs::read_dir(&dir).expect("fixtures dir").flatten().map(|e| e.path()).collect();
    entries.sort();
    let mut failures = 0;
    for p in entries {
        let is_ckpt = p.is_dir() || p.extension().is_some_and(|e| e == "gguf");
        if !is_ckpt {
            continue;
        }
        let ckpt = match Checkpoint::open(Path::new(&p)) {
            Ok(c) => c,
            Err(e) => {
                println!("skip {}: {e}", p.display());
                continue;
            }
        };
        let prompt: Vec<u32> = (0..21).map(|i| (i * 37 + 11) % 300).collect();
        let (lg, tg, _) = generate(&gpu, &ckpt, &prompt, 12);
        let (lc, tc, gaps) = generate(&cpu, &ckpt, &prompt, 12);
        let scale = lc.iter().fold(0f32, |a, v| a.max(v.abs()));
        let err = lg.iter().zip(&lc).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        // Compare up to the first near tie: a gap under twice the bf16 bound.
        let tie = gaps.iter().position(|g| *g < 2.0 * TOL * scale).unwrap_or(gaps.len());
        let ok = err <= TOL * scale && tg[..tie] == tc[..tie];
        if tie < gaps.len() {
            println!(
                "  near tie at step {tie} (gap {:.2e} < {:.2e}): compared the first {tie} tokens",
                gaps[tie],
                2.0 * TOL * scale
            );
        }
        failures += usize::from(!ok);
        println!(
            "{} {}: logits max error {err:.2e} of {scale:.2e}; greedy gpu {tg:?} cpu {tc:?}",
            if ok { "PASS" } else { "FAIL" },
            p.file_name().unwrap().to_string_lossy()
        );
    }
    println!("{failures} checkpoints failed");
    std::process::exit(i32::from(failures > 0));
}
