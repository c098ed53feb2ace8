//! The tiny mixture-of-experts checkpoints served through the normal server:
//! the greedy completion of the reference prompt is the text of
//! transformers' greedy tokens, on one rank, on uneven tensor and pipeline
//! layouts (CPU threads), and on sim cards of their own (where the `auto`
//! split prices the experts with the layout cost model).

mod http_common;

use corridor_model::layout::{LayoutSpec, Split};
use corridor_server::boot::{boot, BootOptions, Devices};
use corridor_server::http::StateOptions;
use corridor_server::tokenizer::Tokenizer;
use corridor_units::Bytes;
use http_common::{app_from, fixture};
use serde_json::{json, Value};

/// The reference prompt, and the text of transformers' greedy tokens up to
/// the first near tie (either choice would be right there) or end of
/// sequence.
fn reference() -> (String, usize, String, usize) {
    let dir = fixture("qwen3-moe");
    reference_of(&dir.join("reference.json"), &Tokenizer::from_hf_dir(&dir).unwrap())
}

/// As [`reference`], for the reference file at `path`.
fn reference_of(path: &std::path::Path, tok: &Tokenizer) -> (String, usize, String, usize) {
    let r: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    };
    let greedy = ids(&r["greedy"]["ids"]);
    let margins: Vec<f64> =
        r["greedy"]["margins"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    let n = (0..greedy.len())
        .find(|&i| margins[i] < 1e-3 || tok.eos_ids().contains(&greedy[i]))
        .unwrap_or(greedy.len());
    assert!(n >= 4, "the reference keeps at least a few clear greedy steps ({n})");
    let text = tok.decode(&greedy[..n], true).unwrap();
    (r["prompt_text"].as_str().unwrap().to_string(), ids(&r["prompt_ids"]).len(), text, n)
}

fn complete(layout: Option<LayoutSpec>, prompt: &str, max_tokens: usize) -> (String, u64) {
    let mut opts = BootOptions::new(fixture("qwen3-moe"));
    opts.layout = layout;
    complete_with(opts, prompt, max_tokens)
}

fn complete_with(mut opts: BootOptions, prompt: &str, max_tokens: usize) -> (String, u64) {
    opts.max_running = 4;
    opts.max_batched_tokens = 64;
    let booted = boot(&opts, |_, _| {}).expect("boots");
    let app =
        app_from(&booted, StateOptions { served_model_name: Some("tiny".into()), ..Default::default() });
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    // Greedy as transformers decodes: no penalty from the server defaults.
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "repetition_penalty": 1.0});
    let r = rt.block_on(app.post("/v1/completions", &body));
    assert_eq!(r.status, axum::http::StatusCode::OK, "{}", r.text());
    let j = r.json();
    booted.engine.shutdown();
    (j["choices"][0]["text"].as_str().unwrap().to_string(), j["usage"]["prompt_tokens"].as_u64().unwrap())
}

#[test]
fn the_tiny_moe_serves_transformers_greedy_text() {
    let (prompt, prompt_len, want, n) = reference();
    let (text, prompt_tokens) = complete(None, &prompt, n);
    assert_eq!(prompt_tokens, prompt_len as u64, "the server encodes the prompt as the reference did");
    assert_eq!(text, want);
    let layouts = [
        LayoutSpec { tp: 2, tp_split: Split::Ratio(vec![3, 1]), pp: 1, pp_split: Split::Even },
        LayoutSpec { tp: 1, tp_split: Split::Even, pp: 2, pp_split: Split::Ratio(vec![2, 1]) },
    ];
    for l in layouts {
        let desc = format!("{l:?}");
        assert_eq!(complete(Some(l), &prompt, n).0, want, "{desc}");
    }
}

#[test]
fn the_tiny_moe_on_sim_cards_serves_transformers_greedy_text() {
    let (prompt, _, want, n) = reference();
    for (cards, l) in [
        (2, LayoutSpec { tp: 2, tp_split: Split::Auto, pp: 1, pp_split: Split::Even }),
        (2, LayoutSpec { tp: 2, tp_split: Split::Ratio(vec![3, 1]), pp: 1, pp_split: Split::Even }),
        (2, LayoutSpec { tp: 1, tp_split: Split::Even, pp: 2, pp_split: Split::Ratio(vec![1, 2]) }),
    ] {
        let desc = format!("{l:?}");
        let mut opts = BootOptions::new(fixture("qwen3-moe"));
        opts.devices = Devices::Sim(vec![Bytes::mib(160); cards]);
        opts.floor_mib = Some("64".into());
        opts.layout = Some(l);
        assert_eq!(complete_with(opts, &prompt, n).0, want, "{desc}");
    }
}

/// The qwen3moe GGUF (tokenizer from its metadata, experts from stacked
/// tensors) serves its own reference's greedy text.
#[test]
fn the_tiny_moe_gguf_serves_transformers_greedy_text() {
    let path = fixture("qwen3-moe-f16.gguf");
    let tok = Tokenizer::from_gguf_path(&path).unwrap();
    let (prompt, prompt_len, want, n) = reference_of(&fixture("qwen3-moe-f16.reference.json"), &tok);
    let (text, prompt_tokens) = complete_with(BootOptions::new(path), &prompt, n);
    assert_eq!(prompt_tokens, prompt_len as u64);
    assert_eq!(text, want);
}

/// The tiny qwen3moe that llama-quantize wrote as Q4_K_M (experts Q4_K, their
/// down projections Q6_K: whole 256-weight blocks a row) serves the same
/// greedy text on one rank and sharded by uneven tensor parallelism, its
/// experts' block-format columns split between the ranks.
#[test]
fn the_tiny_quantized_moe_gguf_serves_alike_on_one_rank_and_sharded() {
    let path = fixture("kquant/qwen3moe-k-Q4_K_M.gguf");
    let prompt = "The quick brown fox";
    // K and V kept in f32: a sharded step sums its partial products in
    // another order, and f16 storage can turn that last-bit difference into
    // a whole f16 step, which this random model's near-tied logits amplify.
    let opts = || {
        let mut o = BootOptions::new(path.clone());
        o.cpu_kv = Some(corridor_backend::cpu::KvPrecision::F32);
        o
    };
    let (one, _) = complete_with(opts(), prompt, 12);
    assert!(!one.is_empty());
    for l in [
        LayoutSpec { tp: 2, tp_split: Split::Even, pp: 1, pp_split: Split::Even },
        LayoutSpec { tp: 2, tp_split: Split::Ratio(vec![3, 1]), pp: 1, pp_split: Split::Even },
    ] {
        let desc = format!("{l:?}");
        let mut opts = opts();
        opts.layout = Some(l);
        assert_eq!(complete_with(opts, prompt, 12).0, one, "{desc}");
    }
}
