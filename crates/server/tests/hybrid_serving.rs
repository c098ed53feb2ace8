//! The tiny qwen3_5 hybrid served through the normal server: the greedy
//! completion of the reference prompt is the text of transformers' greedy
//! tokens on the CPU and on a sim card, with concurrent requests each
//! getting that text, also as uneven tensor shares and pipeline stages (CPU
//! threads and sim cards); a share that would hold no delta-net head is
//! refused at boot with a reason.

mod http_common;

use corridor_model::layout::{LayoutSpec, Split};
use corridor_server::boot::{boot, BootOptions, Devices};
use corridor_server::http::StateOptions;
use corridor_server::tokenizer::Tokenizer;
use corridor_units::Bytes;
use http_common::{app_from, fixture};
use serde_json::{json, Value};

/// The reference prompt and the text of transformers' greedy tokens up to
/// the first near tie or end of sequence, with the token count.
fn reference() -> (String, usize, String, usize) {
    let dir = fixture("qwen3_5");
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

/// Serve `copies` concurrent greedy completions of `prompt`; their texts and
/// prompt token counts.
fn complete(mut opts: BootOptions, prompt: &str, max_tokens: usize, copies: usize) -> Vec<(String, u64)> {
    opts.max_running = 4;
    // Few rows per step: the prompts are prefilled in chunks beside decodes.
    opts.max_batched_tokens = 8;
    let booted = boot(&opts, |_, _| {}).expect("boots");
    let app =
        app_from(&booted, StateOptions { served_model_name: Some("tiny".into()), ..Default::default() });
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "repetition_penalty": 1.0});
    let outs = rt.block_on(async {
        let calls = (0..copies).map(|_| app.post("/v1/completions", &body));
        futures_util::future::join_all(calls).await
    });
    booted.engine.shutdown();
    outs.into_iter()
        .map(|r| {
            assert_eq!(r.status, axum::http::StatusCode::OK, "{}", r.text());
            let j = r.json();
            (
                j["choices"][0]["text"].as_str().unwrap().to_string(),
                j["usage"]["prompt_tokens"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn the_tiny_hybrid_serves_transformers_greedy_text() {
    let (prompt, prompt_len, want, n) = reference();
    for (text, prompt_tokens) in complete(BootOptions::new(fixture("qwen3_5")), &prompt, n, 3) {
        assert_eq!(prompt_tokens, prompt_len as u64, "the server encodes the prompt as the reference did");
        assert_eq!(text, want);
    }
}

#[test]
fn the_tiny_hybrid_on_a_sim_card_serves_transformers_greedy_text() {
    let (prompt, _, want, n) = reference();
    let mut opts = BootOptions::new(fixture("qwen3_5"));
    opts.devices = Devices::Sim(vec![Bytes::mib(160)]);
    opts.floor_mib = Some("64".into());
    for (text, _) in complete(opts, &prompt, n, 2) {
        assert_eq!(text, want);
    }
}

/// llama.cpp's qwen35 GGUF (tokenizer from its metadata, value heads tiled)
/// serves its own reference's greedy text.
#[test]
fn the_tiny_hybrid_gguf_serves_transformers_greedy_text() {
    let path = fixture("qwen3_5-f16.gguf");
    let tok = Tokenizer::from_gguf_path(&path).unwrap();
    let (prompt, prompt_len, want, n) = reference_of(&fixture("qwen3_5-f16.reference.json"), &tok);
    for (text, prompt_tokens) in complete(BootOptions::new(path), &prompt, n, 2) {
        assert_eq!(prompt_tokens, prompt_len as u64);
        assert_eq!(text, want);
    }
}

/// Uneven tensor shares and pipeline stages of the hybrid (CPU threads, and
/// sim cards of their own) serve the same text; each rank holds the KV and
/// state of its own layers and heads.
#[test]
fn the_tiny_hybrid_as_a_layout_serves_transformers_greedy_text() {
    let (prompt, _, want, n) = reference();
    let tp = |r: Vec<usize>| LayoutSpec { tp: 2, tp_split: Split::Ratio(r), pp: 1, pp_split: Split::Even };
    let pp = |r: Vec<usize>| LayoutSpec { tp: 1, tp_split: Split::Even, pp: 2, pp_split: Split::Ratio(r) };
    for l in [tp(vec![3, 1]), pp(vec![3, 1]), pp(vec![1, 3])] {
        let mut opts = BootOptions::new(fixture("qwen3_5"));
        opts.layout = Some(l.clone());
        for (text, _) in complete(opts, &prompt, n, 2) {
            assert_eq!(text, want, "{l:?}");
        }
    }
    for l in [tp(vec![3, 1]), pp(vec![2, 2])] {
        let mut opts = BootOptions::new(fixture("qwen3_5"));
        opts.devices = Devices::Sim(vec![Bytes::mib(160); 2]);
        opts.floor_mib = Some("64".into());
        opts.layout = Some(l.clone());
        for (text, _) in complete(opts, &prompt, n, 2) {
            assert_eq!(text, want, "{l:?} on sim cards");
        }
    }
}

#[test]
fn a_share_without_a_delta_net_head_is_refused_with_a_reason() {
    let mut opts = BootOptions::new(fixture("qwen3_5"));
    opts.layout =
        Some(LayoutSpec { tp: 3, tp_split: Split::Ratio(vec![2, 1, 1]), pp: 1, pp_split: Split::Even });
    let err = boot(&opts, |_, _| {}).err().expect("a share without a key head boots");
    assert!(err.to_string().contains("delta-net key heads"), "{err}");
}

/// The recurrent state of every slot is booked, as state, before KV is
/// sized, so the card's books (and /v1/memory) count KV and state both: the
/// slots are a governed pool of one slot a page, committed in whole chunks
/// for the running limit.
#[test]
fn the_state_slots_are_booked_on_the_card() {
    let mut opts = BootOptions::new(fixture("qwen3_5"));
    opts.devices = Devices::Sim(vec![Bytes::mib(160)]);
    opts.floor_mib = Some("64".into());
    opts.max_running = 6;
    opts.max_batched_tokens = 8;
    let booted = boot(&opts, |_, _| {}).expect("boots");
    let cfg = corridor_model::ModelConfig::from_hf_dir(&fixture("qwen3_5")).unwrap();
    let h = cfg.hybrid.clone().unwrap();
    let d = h.delta;
    // Per linear layer and sequence: the conv window over q, k and v, and a
    // [k_dim, v_dim] matrix per value head, in f32.
    let channels = 2 * d.k_heads * d.k_dim + d.v_heads * d.v_dim;
    let per_seq = 4 * ((d.conv_kernel - 1) * channels + d.v_heads * d.k_dim * d.v_dim) * 3;
    assert_eq!(h.count(corridor_model::LayerKind::Linear), 3);
    let app = app_from(&booted, StateOptions::default());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let v = rt.block_on(app.get("/v1/memory")).json();
    let books = &v["cards"][0]["books"];
    let arenas = booted.governor.arenas();
    let pool = arenas.iter().find(|a| a.purpose() == corridor_vram::Purpose::State).expect("a state pool");
    let g = pool.geometry();
    assert_eq!(g.page_bytes.get(), per_seq as u64, "a slot holds every linear layer's state");
    assert!(pool.backed().get() >= 6, "a slot for every running request");
    let chunks = (pool.backed().get() / g.chunk_pages) as u64;
    assert_eq!(books["state"].as_u64().unwrap(), chunks * g.chunk_bytes.get(), "{books}");
    assert!(books["state"].as_u64().unwrap() >= (6 * per_seq) as u64, "6 slots of {per_seq}: {books}");
    assert!(books["kv_committed"].as_u64().unwrap() > 0, "{books}");
    booted.engine.shutdown();
}
