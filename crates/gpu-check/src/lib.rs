//! Every tiny checkpoint through `Model::forward` on a backend under test and
//! on the CPU backend: prompt logits within bf16 tolerance (2e-2 of the
//! largest logit: weights and KV are bf16 on the device), and the greedy
//! continuation equal token for token, with decode steps at batch 1. A
//! mixture-of-experts checkpoint runs a second, 90-token prompt too, so a
//! device that routes few rows one way and many another runs both.
//!
//! Greedy paths are compared up to the first genuine near tie: a step whose
//! CPU top-1/top-2 logit gap is under the bf16 error bound, where either
//! choice is correct.
//!
//! The binary (`src/main.rs`, feature `cuda`) runs this with the CUDA backend
//! on the GPU machine; without a GPU the comparison is tested CPU against CPU.

use corridor_backend::cpu::CpuBackend;
use corridor_backend::{Backend, SeqStep};
use corridor_model::greedy::greedy;
use corridor_model::Checkpoint;
use corridor_model::{Model, StepInput};
use corridor_units::PageId;
use std::path::Path;

/// Largest logit error, as a fraction of the largest logit, that bf16 weights and KV explain.
pub const TOL: f32 = 2e-2;

/// One greedy run: the first step's logits, the tokens, and the top-1/top-2 gap at each step.
pub struct Run {
    pub first_logits: Vec<f32>,
    pub tokens: Vec<u32>,
    pub gaps: Vec<f32>,
}

/// Greedy continuation over a scrambled page table.
pub fn generate<B: Backend>(b: &B, ckpt: &Checkpoint, prompt: &[u32], steps: usize) -> Run {
    try_generate(b, ckpt, prompt, steps).expect("greedy decode")
}

/// [`generate`], with the backend's refusal as an error.
pub fn try_generate<B: Backend>(
    b: &B,
    ckpt: &Checkpoint,
    prompt: &[u32],
    steps: usize,
) -> Result<Run, String> {
    let model = Model::load(b, ckpt, |_| {}).map_err(|e| e.to_string())?;
    // Pages out of order and with gaps, as many as the run needs (at least four).
    let need = (prompt.len() + steps).div_ceil(16).max(4) as u32;
    let pages: Vec<PageId> = (0..need).map(|i| PageId(2 * (need - 1 - i) + 1)).collect();
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
    .map_err(|e| e.to_string())?;
    Ok(Run { first_logits: first, tokens: toks, gaps })
}

/// How a run on the backend under test compares with the CPU's.
#[derive(Debug)]
pub struct Verdict {
    pub ok: bool,
    /// Largest logit difference of the first step.
    pub err: f32,
    /// Largest CPU logit of the first step (the tolerance is relative to it).
    pub scale: f32,
    /// The first step whose CPU gap is a near tie, and that gap; tokens are compared before it.
    pub tie: Option<(usize, f32)>,
}

/// Compare `got` (the backend under test) with `want` (the CPU).
pub fn compare(got: &Run, want: &Run) -> Verdict {
    let scale = want.first_logits.iter().fold(0f32, |a, v| a.max(v.abs()));
    let err = got.first_logits.iter().zip(&want.first_logits).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
    let same_len = got.first_logits.len() == want.first_logits.len();
    // Compare up to the first near tie: a gap under twice the bf16 bound.
    let tie_at = want.gaps.iter().position(|g| *g < 2.0 * TOL * scale);
    let upto = tie_at.unwrap_or(want.gaps.len());
    let ok = same_len && err <= TOL * scale && got.tokens.get(..upto) == want.tokens.get(..upto);
    Verdict { ok, err, scale, tie: tie_at.map(|t| (t, want.gaps[t])) }
}

/// Every checkpoint in `dir` (directories and .gguf files) on `b` and on the
/// CPU, one PASS/FAIL line each; returns (checkpoints compared, failures).
pub fn check_fixtures<B: Backend>(b: &B, dir: &Path) -> (usize, usize) {
    let cpu = CpuBackend::new();
    let mut entries: Vec<_> =
        std::fs::read_dir(dir).expect("fixtures dir").flatten().map(|e| e.path()).collect();
    entries.sort();
    let (mut checked, mut failures) = (0, 0);
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
        let got = match try_generate(b, &ckpt, &prompt, 12) {
            Ok(run) => run,
            // The hybrid's delta-net has CPU kernels only: a backend without
            // them refuses, and that is not a wrong answer.
            Err(e) if ckpt.config().hybrid.is_some() => {
                println!("skip {}: {e}", p.display());
                continue;
            }
            Err(e) => {
                println!("FAIL {}: {e}", p.display());
                failures += 1;
                continue;
            }
        };
        let want = generate(&cpu, &ckpt, &prompt, 12);
        let v = compare(&got, &want);
        if let Some((tie, gap)) = v.tie {
            println!(
                "  near tie at step {tie} (gap {gap:.2e} < {:.2e}): compared the first {tie} tokens",
                2.0 * TOL * v.scale
            );
        }
        checked += 1;
        failures += usize::from(!v.ok);
        println!(
            "{} {}: logits max error {:.2e} of {:.2e}; greedy gpu {:?} cpu {:?}",
            if v.ok { "PASS" } else { "FAIL" },
            p.file_name().unwrap().to_string_lossy(),
            v.err,
            v.scale,
            got.tokens,
            want.tokens
        );
        // A mixture of experts also prefills a prompt longer than the routed
        // GEMVs take (64 rows on CUDA), so its grouped GEMM runs too.
        if ckpt.config().moe.is_some() {
            let long: Vec<u32> = (0..90).map(|i| (i * 53 + 7) % 300).collect();
            let (got, want) = match try_generate(b, &ckpt, &long, 4) {
                Ok(run) => (run, generate(&cpu, &ckpt, &long, 4)),
                Err(e) => {
                    println!("FAIL {} (90-token prompt): {e}", p.display());
                    failures += 1;
                    continue;
                }
            };
            let lv = compare(&got, &want);
            checked += 1;
            failures += usize::from(!lv.ok);
            println!(
                "{} {} (90-token prompt): logits max error {:.2e} of {:.2e}; greedy gpu {:?} cpu {:?}",
                if lv.ok { "PASS" } else { "FAIL" },
                p.file_name().unwrap().to_string_lossy(),
                lv.err,
                lv.scale,
                got.tokens,
                want.tokens
            );
        }
    }
    (checked, failures)
}

/// SmolLM2-135M-Instruct answers the ChatML "capital of France" prompt with
/// "The capital of France is Paris." (its own token ids) on `b`.
pub fn paris<B: Backend>(b: &B, path: &Path) -> bool {
    let ckpt = Checkpoint::open(path).expect("SmolLM2 opens");
    let prompt: Vec<u32> = vec![1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198];
    let want: Vec<u32> = vec![504, 3575, 282, 4649, 314, 7042, 30, 2];
    let got = generate(b, &ckpt, &prompt, want.len()).tokens;
    let ok = got == want;
    println!(
        "{} SmolLM2 Paris on {}: got {got:?}, want {want:?}",
        if ok { "PASS" } else { "FAIL" },
        b.name()
    );
    ok
}

/// The logits of every position of one prefill of `ids`.
pub fn all_logits<B: Backend>(b: &B, ckpt: &Checkpoint, ids: &[u32]) -> Vec<f32> {
    let model = Model::load(b, ckpt, |_| {}).expect("load");
    let n = ids.len();
    let mut ws = model.workspace(b, n, n).expect("workspace");
    let pages: Vec<PageId> = (0..n.div_ceil(16) as u32).rev().map(PageId).collect();
    let mut kv = model.kv_cache(b, 16, pages.len()).expect("kv");
    let positions: Vec<u32> = (0..n as u32).collect();
    let seqs = [SeqStep { row_start: 0, rows: n, cached: 0, pages: &pages }];
    let rows: Vec<usize> = (0..n).collect();
    let step =
        StepInput { tokens: ids, positions: &positions, seqs: &seqs, logit_rows: &rows, state_slots: &[] };
    let mut logits = Vec::new();
    model.forward(b, &mut ws, &mut kv, &step, &mut logits).expect("forward");
    logits
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(logits: &[f32], tokens: &[u32], gaps: &[f32]) -> Run {
        Run { first_logits: logits.to_vec(), tokens: tokens.to_vec(), gaps: gaps.to_vec() }
    }

    #[test]
    fn the_verdict_holds_logits_to_the_bound_and_tokens_up_to_a_near_tie() {
        let want = run(&[10.0, 2.0, -3.0], &[1, 2, 3, 4], &[5.0, 5.0, 5.0, 5.0]);
        assert!(compare(&run(&[10.1, 2.0, -3.1], &[1, 2, 3, 4], &[]), &want).ok);
        // 0.3 is past 2e-2 of 10.
        assert!(!compare(&run(&[10.3, 2.0, -3.0], &[1, 2, 3, 4], &[]), &want).ok);
        assert!(!compare(&run(&[10.0, 2.0, -3.0], &[1, 2, 9, 4], &[]), &want).ok);
        assert!(!compare(&run(&[10.0, 2.0], &[1, 2, 3, 4], &[]), &want).ok, "a missing logit");
        // A near tie at step 2 (gap 0.1 < 2 × 2e-2 × 10): tokens from there on may differ.
        let tied = run(&[10.0, 2.0, -3.0], &[1, 2, 3, 4], &[5.0, 5.0, 0.1, 5.0]);
        let v = compare(&run(&[10.0, 2.0, -3.0], &[1, 2, 7, 8], &[]), &tied);
        assert!(v.ok, "{v:?}");
        assert_eq!(v.tie.map(|t| t.0), Some(2));
        assert!(!compare(&run(&[10.0, 2.0, -3.0], &[1, 5, 7, 8], &[]), &tied).ok);
    }

    #[test]
    fn the_cpu_passes_against_itself_on_every_tiny_checkpoint() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny");
        let (checked, failures) = check_fixtures(&CpuBackend::new(), &dir);
        assert!(checked >= 5, "only {checked} checkpoints found in {}", dir.display());
        assert_eq!(failures, 0);
    }
}
