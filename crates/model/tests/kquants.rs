//! The GGUF files llama.cpp's own quantizer writes, against the f16 file they
//! were made from (`tests/fixtures/tiny/kquant/`, from
//! `scripts/make_quant_fixtures.py`).
//!
//! Each file must carry the per-tensor type mix llama-quantize chose (the
//! output Q6_K, the token embedding quantized, K-quant mixes raising attn_v
//! and ffn_down), load with every tensor kept in its block format, and give
//! log-probabilities within a per-type tolerance of the f16 file's, both
//! through prefill (f32 GEMM over dequantized tiles) and token-by-token decode
//! (integer dot products over 8-bit activations, the CPU default).
//!
//! Tolerances: the largest, over prompt positions, probability-weighted RMS
//! |Δ log-prob| against the f16 file (`weighted`), measured here and raised
//! by half. They follow the bits per weight, about doubling per bit lost
//! (measured: Q6_K 0.08, Q5_K_M 0.16, Q5_1 0.18, Q5_0 0.25, IQ4_NL 0.31,
//! IQ4_XS 0.34, Q4_K_M 0.36, Q3_K_M 0.63, Q2_K 1.28), which is what the
//! weights' own rounding predicts: this untrained model's logits have a
//! spread of about 2, and a relative weight error of 1.8% (Q6_K) to 29%
//! (Q2_K) moves them by that fraction. A misread format decorrelates the
//! weights (relative error 0.5 or more at any bit width) and fails the
//! per-tensor check below by far, and these bounds by several times.

use corridor_backend::cpu::quant::dequantize_row;
use corridor_backend::cpu::{CpuBackend, DecodeActivations};
use corridor_backend::{DType, SeqStep};
use corridor_model::Checkpoint;
use corridor_model::{Model, StepInput};
use corridor_units::{PageId, Pages, TokenId, Tokens};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const PAGE: usize = 16;
/// Decode with 8-bit activations against decode in f32, on the same file:
/// each activation element moves by at most 1/254 of its block's largest,
/// a relative error of a few tenths of a percent on every matmul, which here
/// moves the log-probs by up to 0.09 (measured, worst token above e^-8);
/// half again that.
const ACT_TOL: f32 = 0.13;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/kquant")
}

fn prompt() -> Vec<u32> {
    (0..20u32).map(|i| (i * 37 + 5) % 384).collect()
}

fn log_softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = row.iter().map(|v| ((v - max) as f64).exp()).sum::<f64>().ln() as f32 + max;
    row.iter().map(|v| v - lse).collect()
}

/// Log-probs at every prompt position, the prompt fed `chunk` tokens at a time.
fn logprobs(path: &Path, decode: DecodeActivations, chunk: usize) -> Vec<Vec<f32>> {
    let ckpt = Checkpoint::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let backend = CpuBackend::with_decode_activations(decode);
    let model = Model::load(&backend, &ckpt, |_| {}).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let vocab = model.config().vocab_size;
    let ids = prompt();
    let n = ids.len();
    let mut ws = model.workspace(&backend, Tokens(n), n).unwrap();
    let mut kv = model.kv_cache(&backend, Tokens(PAGE), Pages(n.div_ceil(PAGE) + 1)).unwrap();
    let pages: Vec<PageId> = (0..n.div_ceil(PAGE) as u32).map(PageId).collect();
    let (mut out, mut logits, mut done) = (Vec::new(), Vec::new(), 0);
    while done < n {
        let rows = chunk.min(n - done);
        let seqs = [SeqStep { row_start: 0, rows, cached: done, pages: &pages }];
        let positions: Vec<u32> = (done..done + rows).map(|p| p as u32).collect();
        let logit_rows: Vec<usize> = (0..rows).collect();
        let step = StepInput {
            tokens: TokenId::from_u32_slice(&ids[done..done + rows]),
            positions: &positions,
            seqs: &seqs,
            logit_rows: &logit_rows,
            state_slots: &[],
            capture: None,
        };
        model.forward(&backend, &mut ws, &mut kv, &step, &mut logits).unwrap();
        for r in 0..rows {
            out.push(log_softmax(&logits[r * vocab..(r + 1) * vocab]));
        }
        done += rows;
    }
    out
}

/// The largest, over positions, probability-weighted RMS |Δ log-prob|,
/// `sqrt(Σ_v p_ref(v)·Δ(v)²)`: the error on the tokens that matter there.
fn weighted(reference: &[Vec<f32>], got: &[Vec<f32>]) -> f32 {
    let mut w = 0f64;
    for (r, g) in reference.iter().zip(got) {
        let s: f64 = r.iter().zip(g).map(|(a, b)| (*a as f64).exp() * ((a - b) as f64).powi(2)).sum();
        w = w.max(s.sqrt());
    }
    w as f32
}

/// The largest |Δ log-prob| over the tokens the reference gives at least e^-8.
fn worst(reference: &[Vec<f32>], got: &[Vec<f32>]) -> f32 {
    let mut w = 0f32;
    for (r, g) in reference.iter().zip(got) {
        for (a, b) in r.iter().zip(g) {
            if *a > -8.0 {
                w = w.max((a - b).abs());
            }
        }
    }
    w
}

/// (file type, tolerance, token_embd, attn_q, attn_v, ffn_down): the types
/// llama-quantize's default mixes give a one-layer model (its only layer
/// counts as a last one, so the `_M` mixes raise attn_v and ffn_down).
const FILES: [(&str, f32, DType, DType, DType, DType); 9] = [
    ("Q6_K", 0.12, DType::Q6_K, DType::Q6_K, DType::Q6_K, DType::Q6_K),
    ("Q5_K_M", 0.24, DType::Q5_K, DType::Q5_K, DType::Q6_K, DType::Q6_K),
    ("Q5_1", 0.27, DType::Q5_1, DType::Q5_1, DType::Q5_1, DType::Q5_1),
    ("Q5_0", 0.37, DType::Q5_0, DType::Q5_0, DType::Q5_0, DType::Q5_0),
    ("IQ4_NL", 0.47, DType::IQ4_NL, DType::IQ4_NL, DType::IQ4_NL, DType::IQ4_NL),
    ("Q4_K_M", 0.53, DType::Q4_K, DType::Q4_K, DType::Q6_K, DType::Q6_K),
    ("IQ4_XS", 0.5, DType::IQ4_XS, DType::IQ4_XS, DType::IQ4_XS, DType::IQ4_XS),
    ("Q3_K_M", 0.94, DType::Q3_K, DType::Q3_K, DType::Q5_K, DType::Q4_K),
    ("Q2_K", 1.9, DType::Q2_K, DType::Q2_K, DType::Q3_K, DType::Q3_K),
];

fn file(ft: &str) -> PathBuf {
    dir().join(format!("llama-k-{ft}.gguf"))
}

#[test]
fn quantized_files_carry_llama_quantize_type_mixes() {
    for (ft, _, embd, q, v, down) in FILES {
        let ckpt = Checkpoint::open(&file(ft)).unwrap();
        let ty = |name: &str| ckpt.tensor(name).unwrap_or_else(|e| panic!("{ft} {name}: {e}")).dtype;
        assert_eq!(ty("model.embed_tokens.weight"), embd, "{ft} token_embd");
        assert_eq!(ty("lm_head.weight"), DType::Q6_K, "{ft} output");
        assert_eq!(ty("model.layers.0.self_attn.q_proj.weight"), q, "{ft} attn_q");
        assert_eq!(ty("model.layers.0.self_attn.v_proj.weight"), v, "{ft} attn_v");
        assert_eq!(ty("model.layers.0.mlp.down_proj.weight"), down, "{ft} ffn_down");
        assert_eq!(ty("model.norm.weight"), DType::F32, "{ft} output_norm");
    }
}

/// Every quantized tensor, dequantized by corridor, against the f16 tensor
/// llama-quantize read: the relative RMS error must be what the format's bits
/// allow for Gaussian weights (measured: Q6_K 0.018, Q5_K 0.036, Q5_1 0.03,
/// Q5_0 0.04, Q4_K 0.071, IQ4_NL/XS 0.06-0.07, Q3_K 0.14, Q2_K 0.29; bounds
/// a quarter above). A misread field (a swapped nibble, a scale from the
/// wrong sub-block, a lost high bit) decorrelates the weights and gives 0.5
/// or more.
#[test]
fn quantized_tensors_dequantize_close_to_the_f16_originals() {
    let f16 = Checkpoint::open(&file("f16")).unwrap();
    let bound = |d: DType| match d {
        DType::Q6_K => 0.023,
        DType::Q5_K | DType::Q5_0 | DType::Q5_1 => 0.05,
        DType::Q4_K | DType::IQ4_NL | DType::IQ4_XS => 0.09,
        DType::Q3_K => 0.18,
        DType::Q2_K => 0.37,
        other => panic!("unexpected {other}"),
    };
    let widen = |t: &corridor_backend::HostTensor| {
        let (rows, cols) = t.rows_cols();
        let rb = t.data.len() / rows;
        let mut out = vec![0f32; rows * cols];
        for (r, o) in out.chunks_mut(cols).enumerate() {
            dequantize_row(t.dtype, &t.data.bytes()[r * rb..(r + 1) * rb], o);
        }
        out
    };
    let names = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    ];
    for (ft, ..) in FILES {
        let q = Checkpoint::open(&file(ft)).unwrap();
        for name in names {
            let (a, b) = (f16.tensor(name).unwrap(), q.tensor(name).unwrap());
            assert_eq!(a.shape, b.shape, "{ft} {name}");
            let (wa, wb) = (widen(&a), widen(&b));
            let err: f64 = wa.iter().zip(&wb).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
            let norm: f64 = wa.iter().map(|x| (*x as f64).powi(2)).sum();
            let rel = (err / norm).sqrt();
            assert!(rel < bound(b.dtype), "{ft} {name} ({}): relative RMS error {rel:.4}", b.dtype);
        }
    }
}

#[test]
fn quantized_files_match_the_f16_file_within_per_type_tolerances() {
    let reference = logprobs(&file("f16"), DecodeActivations::F32, usize::MAX);
    let n = prompt().len();
    let mut seen = BTreeMap::new();
    for (ft, tol, ..) in FILES {
        // Prefill: the whole prompt at once, by the default path (the 8-bit
        // dots or the GEMM, as the rows decide) and by the widened tiles' f32 GEMM.
        let pre = logprobs(&file(ft), DecodeActivations::Q8, n);
        let gemm = weighted(&reference, &logprobs(&file(ft), DecodeActivations::F32, n));
        assert!(gemm < tol, "{ft}: the f32 GEMM prefill is {gemm} from the f16 file, over {tol}");
        // Decode: one token at a time, integer dots over 8-bit activations,
        let dec = logprobs(&file(ft), DecodeActivations::Q8, 1);
        // and in f32, which isolates the weights' own rounding.
        let dec32 = logprobs(&file(ft), DecodeActivations::F32, 1);
        let (p, d, d32) =
            (weighted(&reference, &pre), weighted(&reference, &dec), weighted(&reference, &dec32));
        // The activation rounding alone: the same file, Q8 against f32 decode.
        let act = worst(&dec32, &dec);
        println!("{ft}: weighted |Δ logprob| prefill {p:.4}, decode q8 {d:.4}, decode f32 {d32:.4} (tolerance {tol}); q8 vs f32 decode {act:.4}");
        assert!(p < tol && d < tol && d32 < tol, "{ft}: {p} / {d} / {d32} over {tol}");
        assert!(act < ACT_TOL, "{ft}: 8-bit activations moved decode by {act}");
        assert!(act > 0.0, "{ft}: the default decode did not take the 8-bit activation path");
        seen.insert(ft, d);
    }
    // The f16 file against itself through the Q8 decode path: the activation
    // rounding alone stays far below every tolerance above.
    let own = worst(&reference, &logprobs(&file("f16"), DecodeActivations::Q8, 1));
    assert!(own < 1e-4, "f16 decode moved by {own}: f16 weights are not dotted through Q8 rows");
    assert_eq!(seen.len(), FILES.len());
}

/// Per position, the probability-weighted RMS |Δ log-prob| (as [`weighted`]), sorted.
fn weighted_by_position(reference: &[Vec<f32>], got: &[Vec<f32>]) -> Vec<f32> {
    let mut w: Vec<f32> =
        reference.iter().zip(got).map(|(r, g)| weighted(&[r.clone()], &[g.clone()])).collect();
    w.sort_by(f32::total_cmp);
    w
}

/// The mixture of experts llama-quantize writes for Qwen3-30B-A3B-like files
/// (`qwen3moe-k-Q4_K_M.gguf`: experts Q4_K, their down projections Q6_K, the
/// router kept in f32), against the f16 file it was made from: the experts
/// stay in their block formats, and log-probabilities through prefill and
/// token-by-token decode stay near the dense files' Q4_K_M error.
///
/// Two bounds, since a quantized file may route a token otherwise than the
/// f16 file where its second and third experts are close: the median
/// position within Q4_K_M's tolerance above (measured 0.22-0.23), and every
/// position within 1.0 (measured 0.62-0.63 at the one position whose routing
/// moved, 0.44 at the next). A misread expert moves every token routed to
/// it past the second bound: the quantized file's expert 3 read as expert 4
/// put its worst position at 1.75.
#[test]
fn a_quantized_mixture_of_experts_matches_its_f16_file() {
    let moe = |ft: &str| dir().join(format!("qwen3moe-k-{ft}.gguf"));
    let q = Checkpoint::open(&moe("Q4_K_M")).unwrap();
    let ty = |name: &str| q.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}")).dtype;
    for e in [0, 7] {
        let p = format!("model.layers.0.mlp.experts.{e}.");
        assert_eq!(ty(&format!("{p}gate_proj.weight")), DType::Q4_K, "expert {e} gate");
        assert_eq!(ty(&format!("{p}up_proj.weight")), DType::Q4_K, "expert {e} up");
        assert_eq!(ty(&format!("{p}down_proj.weight")), DType::Q6_K, "expert {e} down");
    }
    assert_eq!(ty("model.layers.0.mlp.gate.weight"), DType::F32, "router");
    let reference = logprobs(&moe("f16"), DecodeActivations::F32, usize::MAX);
    let n = prompt().len();
    let (median_tol, worst_tol) = (0.36, 1.0);
    for (what, decode, chunk) in [
        ("prefill", DecodeActivations::Q8, n),
        ("prefill f32", DecodeActivations::F32, n),
        ("decode q8", DecodeActivations::Q8, 1),
        ("decode f32", DecodeActivations::F32, 1),
    ] {
        let w = weighted_by_position(&reference, &logprobs(&moe("Q4_K_M"), decode, chunk));
        let (median, worst) = (w[w.len() / 2], w[w.len() - 1]);
        println!("qwen3moe Q4_K_M {what}: weighted |Δ logprob| median {median:.4}, worst {worst:.4}");
        assert!(median < median_tol, "qwen3moe Q4_K_M {what}: median {median}, over {median_tol}");
        assert!(worst < worst_tol, "qwen3moe Q4_K_M {what}: worst {worst}, over {worst_tol}");
    }
}
