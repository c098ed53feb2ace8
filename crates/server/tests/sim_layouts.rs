//! Parallel layouts on sim cards of their own: each rank on its card, KV in
//! one arena spanning the cards, the group's pages agreed by MIN.
//!
//! Two checkpoints: the tiny fixtures (greedy text through the server equals
//! one rank's), and a synthetic one shaped like Llama-3-8B in proportion (32
//! query heads over 8 KV heads, FFN 8× the hidden width) on a scaled
//! reference rig of one large and two small cards, where the `auto` split
//! must hold strictly more tokens than the even split and the cards must be
//! filled to their floors.

mod http_common;

use corridor_model::layout::{LayoutSpec, Split};
use corridor_server::boot::{boot, BootOptions, Booted, Devices};
use corridor_server::http::StateOptions;
use corridor_units::Bytes;
use http_common::{app_from, fixture};
use serde_json::json;
use std::path::Path;

fn greedy(booted: &Booted) -> String {
    let app = app_from(booted, StateOptions { served_model_name: Some("tiny".into()), ..Default::default() });
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let body =
        json!({"model": "tiny", "prompt": "The lighthouse keeper said", "max_tokens": 24, "temperature": 0});
    let r = rt.block_on(app.post("/v1/completions", &body));
    assert_eq!(r.status, axum::http::StatusCode::OK, "{}", r.text());
    r.json()["choices"][0]["text"].as_str().unwrap().to_string()
}

fn tiny_opts(devices: Devices, layout: Option<LayoutSpec>) -> BootOptions {
    let mut opts = BootOptions::new(fixture("llama-f32"));
    opts.max_running = 16;
    opts.max_batched_tokens = 64;
    opts.devices = devices;
    opts.floor_mib = Some("64".into());
    opts.layout = layout;
    opts
}

#[test]
fn layouts_on_sim_cards_answer_as_one_rank_does() {
    let one = boot(&tiny_opts(Devices::Cpu, None), |_, _| {}).expect("boots");
    let oracle = greedy(&one);
    one.engine.shutdown();
    let cards = |n: usize| Devices::Sim(vec![Bytes::mib(160); n]);
    for (n, l) in [
        (3, LayoutSpec { tp: 3, tp_split: Split::Ratio(vec![2, 1, 1]), pp: 1, pp_split: Split::Even }),
        (2, LayoutSpec { tp: 2, tp_split: Split::Auto, pp: 1, pp_split: Split::Even }),
        (2, LayoutSpec { tp: 1, tp_split: Split::Even, pp: 2, pp_split: Split::Ratio(vec![1, 1]) }),
    ] {
        let desc = format!("{l:?}");
        let booted = boot(&tiny_opts(cards(n), Some(l)), |_, _| {}).expect(&desc);
        assert_eq!(greedy(&booted), oracle, "{desc}");
        // One arena over every card, each card booking its share.
        let arenas = booted.governor.arenas();
        assert_eq!(arenas.len(), 1, "{desc}");
        assert_eq!(arenas[0].cards().len(), n, "{desc}");
        for dev in booted.governor.devices() {
            assert!(dev.books().kv_committed > Bytes::ZERO, "{desc}: {} holds KV", dev.id());
        }
        booted.engine.shutdown();
    }
}

#[test]
fn the_sim_link_is_paid_by_layouts_on_sim_cards_and_on_the_host() {
    // 20 ms a message: 24 greedy tokens through PP=2 send at least 24 times
    // from stage 0 to stage 1 (one send a step), so the answer takes at least
    // 480 ms, where the tiny model alone answers in milliseconds.
    let link: corridor_backend::collective::LinkModel = "16GB/s,20ms".parse().unwrap();
    let one = boot(&tiny_opts(Devices::Cpu, None), |_, _| {}).expect("boots");
    let oracle = greedy(&one);
    one.engine.shutdown();
    let pp2 = LayoutSpec { tp: 1, tp_split: Split::Even, pp: 2, pp_split: Split::Ratio(vec![1, 1]) };
    for devices in [Devices::Sim(vec![Bytes::mib(160); 2]), Devices::Cpu] {
        let desc = format!("{devices:?}");
        let mut opts = tiny_opts(devices, Some(pp2.clone()));
        opts.sim_link = Some(link);
        let booted = boot(&opts, |_, _| {}).expect(&desc);
        let t0 = std::time::Instant::now();
        assert_eq!(greedy(&booted), oracle, "{desc}: the link changes the time, not the text");
        let took = t0.elapsed();
        assert!(took >= link.latency * 24, "{desc}: {took:?} for at least 24 sends of 20 ms");
        booted.engine.shutdown();
    }
}

#[test]
fn a_layout_needs_one_card_per_rank() {
    let l = LayoutSpec { tp: 3, tp_split: Split::Even, pp: 1, pp_split: Split::Even };
    let err = boot(&tiny_opts(Devices::Sim(vec![Bytes::mib(160); 2]), Some(l)), |_, _| {}).err().unwrap();
    assert!(err.to_string().contains("3 ranks, one per card"), "{err}");
}

/// Write a Llama checkpoint shaped like Llama-3-8B in proportion (GQA 4:1,
/// FFN 8× hidden), with small deterministic weights and the tiny fixture's
/// tokenizer (vocabulary 384).
fn write_rig_model(dir: &Path) {
    let (hidden, heads, kv_heads, head_dim, ffn, layers, vocab) = (512, 32, 8, 16, 4096, 4, 384);
    let config = json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": vocab, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
        "bos_token_id": 0, "eos_token_id": 2, "hidden_act": "silu"
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture("llama-f32").join(f), dir.join(f)).unwrap();
    }
    let mut seed = 0x9e37_79b9_u32;
    let mut tensor = |rows: usize, cols: usize, ones: bool| -> Vec<u8> {
        let mut out = Vec::with_capacity(rows * cols * 2);
        for _ in 0..rows * cols {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let v = if ones { 1.0f32 } else { ((seed >> 9) as f32 / (1u32 << 23) as f32 - 0.5) * 0.05 };
            out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
        }
        out
    };
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut add = |name: String, rows: usize, cols: usize, ones: bool| {
        let shape = if rows == 1 { vec![cols] } else { vec![rows, cols] };
        tensors.push((name, shape, tensor(rows, cols, ones)));
    };
    add("model.embed_tokens.weight".into(), vocab, hidden, false);
    add("lm_head.weight".into(), vocab, hidden, false);
    add("model.norm.weight".into(), 1, hidden, true);
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.self_attn.q_proj.weight"), heads * head_dim, hidden, false);
        add(format!("{p}.self_attn.k_proj.weight"), kv_heads * head_dim, hidden, false);
        add(format!("{p}.self_attn.v_proj.weight"), kv_heads * head_dim, hidden, false);
        add(format!("{p}.self_attn.o_proj.weight"), hidden, heads * head_dim, false);
        add(format!("{p}.mlp.gate_proj.weight"), ffn, hidden, false);
        add(format!("{p}.mlp.up_proj.weight"), ffn, hidden, false);
        add(format!("{p}.mlp.down_proj.weight"), hidden, ffn, false);
        add(format!("{p}.input_layernorm.weight"), 1, hidden, true);
        add(format!("{p}.post_attention_layernorm.weight"), 1, hidden, true);
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, shape, data)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// Free memory each card rests at after boot, and the group's tokens.
fn rig_boot(model: &Path, tp_split: Split) -> (Vec<(Bytes, Bytes)>, usize, String) {
    let mut opts = BootOptions::new(model.to_path_buf());
    // Enough sequences of the whole context that the cards, not the id
    // space, bound the pool.
    opts.max_running = 64;
    opts.max_batched_tokens = 64;
    opts.context_len = Some(8192);
    // The reference rig (32, 20 and 20 GiB) scaled down to MiB so that the
    // CPU ranks' KV stays small.
    opts.devices = Devices::Sim(vec![Bytes::mib(448), Bytes::mib(280), Bytes::mib(280)]);
    opts.floor_mib = Some("64".into());
    opts.layout = Some(LayoutSpec { tp: 3, tp_split, pp: 1, pp_split: Split::Even });
    let booted = boot(&opts, |_, _| {}).expect("the rig boots");
    let arena = booted.governor.arenas().pop().unwrap();
    let rests = booted
        .governor
        .devices()
        .iter()
        .map(|d| {
            let chunk = arena.part_on(d.id()).unwrap().geometry.chunk_bytes;
            (d.card().driver_free(), chunk)
        })
        .collect();
    let tokens = arena.backed().get() * booted.engine.info().page_size;
    let text = greedy(&booted);
    booted.engine.shutdown();
    (rests, tokens, text)
}

#[test]
fn auto_split_on_the_reference_rig_holds_more_and_fills_every_card() {
    let dir = tempfile::tempdir().unwrap();
    write_rig_model(dir.path());
    let (auto_rests, auto_tokens, auto_text) = rig_boot(dir.path(), Split::Auto);
    let (even_rests, even_tokens, even_text) = rig_boot(dir.path(), Split::Even);
    eprintln!("auto: {auto_tokens} tokens, cards rest at {auto_rests:?}");
    eprintln!("even: {even_tokens} tokens, cards rest at {even_rests:?}");
    assert!(auto_tokens > even_tokens, "auto {auto_tokens} tokens vs even {even_tokens}");
    assert_eq!(auto_text, even_text, "the split changes capacity, not the answer");
    // Floor 64 MiB + margin 64 MiB: every card within one chunk above it.
    let line = Bytes::mib(128);
    for (i, (free, chunk)) in auto_rests.iter().enumerate() {
        assert!(*free >= line, "card{i} rests at {free}, under floor + margin");
        assert!(
            *free < line + *chunk + Bytes::mib(2),
            "card{i} rests at {free}: more than a chunk ({chunk}) above {line}"
        );
    }
}
