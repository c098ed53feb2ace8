//! Every tiny checkpoint through `Model::forward` on the CUDA backend and on
//! the CPU backend: prompt logits within bf16 tolerance (2e-2 of the largest
//! logit: weights and KV are bf16 on the device), and the greedy
//! continuation equal token for token, with decode steps at batch 1.
//!
//! Usage: gpu-e2e <fixtures dir> (tests/fixtures/tiny).

use corridor_backend::cpu::CpuBackend;
use corridor_backend::cuda::{CudaBackend, CudaBackendConfig};
use corridor_backend::{Backend, SeqStep};
use corridor_model::llama::{Model, StepInput};
use corridor_model::Checkpoint;
use corridor_units::PageId;
use std::path::Path;

const TOL: f32 = 2e-2;
const PAGE: usize = 16;

fn generate<B: Backend>(b: &B, ckpt: &Checkpoint, prompt: &[u32], steps: usize) -> (Vec<f32>, Vec<u32>) {
    let model = Model::load(b, ckpt, |_| {}).expect("load");
    let mut ws = model.workspace(b, prompt.len(), 1).expect("workspace");
    let mut kv = model.kv_cache(b, PAGE, 16).expect("kv");
    let pages = [PageId(5), PageId(1), PageId(9), PageId(3)];
    let vocab = model.config().vocab_size;
    let mut toks = prompt.to_vec();
    let mut cached = 0;
    let mut first = Vec::new();
    let mut logits = Vec::new();
    while toks.len() < prompt.len() + steps {
        let rows = toks.len() - cached;
        let seqs = [SeqStep { row_start: 0, rows, cached, pages: &pages }];
        let positions: Vec<u32> = (cached..toks.len()).map(|p| p as u32).collect();
        let step = StepInput {
            tokens: &toks[cached..],
            positions: &positions,
            seqs: &seqs,
            logit_rows: &[rows - 1],
        };
        model.forward(b, &mut ws, &mut kv, &step, &mut logits).expect("forward");
        b.check().expect("device error");
        if first.is_empty() {
            first = logits.clone();
        }
        cached = toks.len();
        toks.push((0..vocab).max_by(|&a, &c| logits[a].total_cmp(&logits[c])).unwrap() as u32);
    }
    (first, toks[prompt.len()..].to_vec())
}

fn main() {
    let dir = std::env::args().nth(1).unwrap_or_else(|| "tests/fixtures/tiny".into());
    let gpu = CudaBackend::new(CudaBackendConfig::default()).expect("cuda backend");
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
        let (lg, tg) = generate(&gpu, &ckpt, &prompt, 12);
        let (lc, tc) = generate(&cpu, &ckpt, &prompt, 12);
        let scale = lc.iter().fold(0f32, |a, v| a.max(v.abs()));
        let err = lg.iter().zip(&lc).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        let ok = err <= TOL * scale && tg == tc;
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
