//! The forward pass against Hugging Face transformers, on the tiny
//! checkpoints `scripts/make_fixtures.py` writes (float32 reference outputs).
//!
//! Tolerance: 1e-4 in log-probability. The reference runs the same weights
//! in float32 (quantized GGUF weights dequantized first), and so does the
//! backend here (`DecodeActivations::F32`: its default decode rounds
//! activations to 8 bits, which `kquants.rs` bounds instead); running it in
//! float64 instead moves the log-probs by at most 1e-5, so summation order
//! (blocked dot products, a different GEMM) stays well inside the bound, while
//! a real mistake (a wrong RoPE pairing, a missing bias, an off-by-one
//! position, a norm on the wrong axis) moves them by 1e-1 or more. Greedy continuations are compared token by token until the
//! first step whose reference top-1/top-2 gap is under 1e-3, a genuine near
//! tie where either choice is correct.

use corridor_backend::cpu::{CpuBackend, DecodeActivations};
use corridor_backend::SeqStep;
use corridor_model::greedy::greedy;
use corridor_model::Checkpoint;
use corridor_model::{Model, StepInput};
use corridor_units::{PageId, Pages, StateSlot, TokenId, Tokens};
use serde_json::Value;
use std::path::{Path, PathBuf};

const TOL: f32 = 1e-4;
const PAGE: usize = 16;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny")
}

fn log_softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = row.iter().map(|v| ((v - max) as f64).exp()).sum::<f64>().ln() as f32 + max;
    row.iter().map(|v| v - lse).collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

struct Runner {
    backend: CpuBackend,
    model: Model<CpuBackend>,
}

impl Runner {
    fn open(path: &Path) -> Runner {
        let ckpt = Checkpoint::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let backend = CpuBackend::with_decode_activations(DecodeActivations::F32);
        let model =
            Model::load(&backend, &ckpt, |_| {}).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Runner { backend, model }
    }

    fn vocab(&self) -> usize {
        self.model.config().vocab_size
    }

    /// Log-probabilities at every position of `prompt`, computed in chunks
    /// of `chunk` tokens over a deliberately scrambled page table.
    fn prompt_logprobs(&self, prompt: &[u32], chunk: usize) -> Vec<Vec<f32>> {
        let n = prompt.len();
        let mut ws = self.model.workspace(&self.backend, Tokens(n), n).unwrap();
        let pages_needed = n.div_ceil(PAGE) + 2;
        let mut kv = self.model.kv_cache(&self.backend, Tokens(PAGE), Pages(pages_needed * 2)).unwrap();
        // Odd page ids, highest first: a bug that assumes contiguous pages shows.
        let pages: Vec<PageId> =
            (0..pages_needed).map(|i| PageId((2 * (pages_needed - i) - 1) as u32)).collect();
        // The last state slot: a bug that assumes slot 0 shows.
        let slot = [StateSlot(n as u32 - 1)];
        let mut out = Vec::new();
        let mut logits = Vec::new();
        let mut done = 0;
        while done < n {
            let rows = chunk.min(n - done);
            let seqs = [SeqStep { row_start: 0, rows, cached: done, pages: &pages }];
            let positions: Vec<u32> = (done..done + rows).map(|p| p as u32).collect();
            let logit_rows: Vec<usize> = (0..rows).collect();
            let step = StepInput {
                tokens: TokenId::from_u32_slice(&prompt[done..done + rows]),
                positions: &positions,
                seqs: &seqs,
                logit_rows: &logit_rows,
                state_slots: &slot,
                capture: None,
            };
            self.model.forward(&self.backend, &mut ws, &mut kv, &step, &mut logits).unwrap();
            for r in 0..rows {
                out.push(log_softmax(&logits[r * self.vocab()..(r + 1) * self.vocab()]));
            }
            done += rows;
        }
        out
    }

    /// Greedy continuation of `prompt` for `steps` tokens through the KV cache.
    fn greedy(&self, prompt: &[u32], steps: usize) -> Vec<u32> {
        let pages: Vec<PageId> = (0..(prompt.len() + steps).div_ceil(PAGE) as u32).map(PageId).collect();
        greedy(&self.model, &self.backend, prompt, steps, &pages, |_| {}).unwrap()
    }
}

fn check(path: &Path, reference: &Path) {
    let r: Value = serde_json::from_str(&std::fs::read_to_string(reference).unwrap()).unwrap();
    let run = Runner::open(path);
    let prompt = ids(&r["prompt_ids"]);
    let name = path.file_name().unwrap().to_string_lossy().to_string();

    // Per-position top-k, prompt fed in uneven chunks.
    for chunk in [prompt.len(), 5] {
        let lps = run.prompt_logprobs(&prompt, chunk);
        for (pos, top) in r["topk"].as_array().unwrap().iter().enumerate() {
            for e in top.as_array().unwrap() {
                let id = e["id"].as_u64().unwrap() as usize;
                let want = e["logprob"].as_f64().unwrap() as f32;
                let got = lps[pos][id];
                assert!((got - want).abs() < TOL, "{name} chunk {chunk} pos {pos} id {id}: {got} vs {want}");
            }
        }
        let last: Vec<f32> =
            r["last_logprobs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        let worst = last.iter().zip(lps.last().unwrap()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < TOL, "{name}: last-position log-probs differ by {worst}");
    }

    // Greedy continuation up to the first genuine near tie.
    let want = ids(&r["greedy"]["ids"]);
    let margins: Vec<f64> =
        r["greedy"]["margins"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    let got = run.greedy(&prompt, want.len());
    for i in 0..want.len() {
        if margins[i] < 1e-3 {
            break;
        }
        assert_eq!(got[i], want[i], "{name}: greedy token {i} differs (got {got:?}, want {want:?})");
    }
}

fn fixture_pairs() -> Vec<(PathBuf, PathBuf)> {
    let dir = fixtures();
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/make_fixtures.py)", dir.display()))
    {
        let p = e.unwrap().path();
        if p.is_dir() && p.join("reference.json").exists() {
            out.push((p.clone(), p.join("reference.json")));
        } else if p.extension().is_some_and(|x| x == "gguf") {
            let r = p.with_extension("reference.json");
            assert!(r.exists(), "{} has no reference", p.display());
            out.push((p, r));
        }
    }
    out.sort();
    out
}

#[test]
fn every_tiny_checkpoint_matches_transformers() {
    let pairs = fixture_pairs();
    assert!(pairs.len() >= 8, "expected at least 8 fixtures, found {}", pairs.len());
    for (model, reference) in pairs {
        check(&model, &reference);
    }
}

/// The released Qwen3.5 checkpoints wrap the language model in a multimodal
/// one: `Qwen3_5ForConditionalGeneration` with the text model's config under
/// `text_config` and its tensors under `model.language_model.`. The tiny
/// hybrid rewritten that way (no vision tower) is the same model.
#[test]
fn the_hybrid_wrapped_as_a_multimodal_checkpoint_is_the_same_model() {
    let src = fixtures().join("qwen3_5");
    let dir = tempfile::tempdir().unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let text: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let wrapped = serde_json::json!({
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": false,
        "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 16},
    });
    std::fs::write(dir.path().join("config.json"), wrapped.to_string()).unwrap();
    // safetensors: an 8-byte header length, a JSON header naming each
    // tensor's bytes, then the bytes; only the names change.
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let renamed: serde_json::Map<String, Value> = header
        .into_iter()
        .map(|(k, v)| match k.strip_prefix("model.") {
            Some(rest) => (format!("model.language_model.{rest}"), v),
            None => (k, v),
        })
        .collect();
    let mut head = serde_json::to_vec(&Value::Object(renamed)).unwrap();
    head.resize(head.len().div_ceil(8) * 8, b' ');
    let mut out = (head.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&head);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(dir.path().join("model.safetensors"), out).unwrap();
    let run = Runner::open(dir.path());
    assert_eq!(run.model.config(), Runner::open(&src).model.config());
    check(dir.path(), &src.join("reference.json"));
}

#[test]
fn two_prompts_in_one_batch_match_their_solo_runs() {
    batch_matches_solo_runs("llama-f32");
}

/// The experts of a sparse layer run over rows of both sequences at once
/// (grouped by expert); each sequence must still get its own answer.
#[test]
fn two_prompts_in_one_batch_match_their_solo_runs_through_the_experts() {
    batch_matches_solo_runs("qwen3-moe");
}

/// Two sequences of the hybrid in one step, each through its own state slot
/// of every linear-attention layer.
#[test]
fn two_prompts_in_one_batch_match_their_solo_runs_through_the_recurrent_state() {
    batch_matches_solo_runs("qwen3_5");
}

fn batch_matches_solo_runs(fixture: &str) {
    let dir = fixtures().join(fixture);
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let run = Runner::open(&dir);
    let batch = r["batch"].as_array().unwrap_or_else(|| panic!("{fixture} reference has a batch"));
    let prompts: Vec<Vec<u32>> = batch.iter().map(|b| ids(&b["prompt_ids"])).collect();
    let total: usize = prompts.iter().map(|p| p.len()).sum();
    let mut ws = run.model.workspace(&run.backend, Tokens(total), prompts.len()).unwrap();
    let mut kv = run.model.kv_cache(&run.backend, Tokens(PAGE), Pages(8)).unwrap();
    let tables: Vec<Vec<PageId>> = vec![vec![PageId(3), PageId(5)], vec![PageId(0), PageId(6)]];
    let mut tokens = Vec::new();
    let mut positions = Vec::new();
    let mut seqs = Vec::new();
    let mut logit_rows = Vec::new();
    for (p, t) in prompts.iter().zip(&tables) {
        seqs.push(SeqStep { row_start: tokens.len(), rows: p.len(), cached: 0, pages: t });
        positions.extend((0..p.len()).map(|x| x as u32));
        tokens.extend_from_slice(p);
        logit_rows.push(tokens.len() - 1);
    }
    let mut logits = Vec::new();
    let slots: Vec<StateSlot> = (0..seqs.len() as u32).map(StateSlot).collect();
    let step = StepInput {
        tokens: TokenId::from_u32_slice(&tokens),
        positions: &positions,
        seqs: &seqs,
        logit_rows: &logit_rows,
        state_slots: &slots,
        capture: None,
    };
    run.model.forward(&run.backend, &mut ws, &mut kv, &step, &mut logits).unwrap();
    let v = run.vocab();
    for (i, b) in batch.iter().enumerate() {
        let want: Vec<f32> =
            b["last_logprobs"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
        let got = log_softmax(&logits[i * v..(i + 1) * v]);
        let worst = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < TOL, "{fixture} batch row {i}: differs by {worst}");
    }
}
