//! Parallel layouts served through the normal server: TP and PP ranks (CPU
//! threads) answer exactly what one rank answers under greedy decoding.

mod http_common;

use corridor_model::layout::{LayoutSpec, Split};
use corridor_server::boot::{boot, BootOptions};
use corridor_server::http::StateOptions;
use http_common::{app_from, fixture};
use serde_json::json;

fn greedy_text(layout: Option<LayoutSpec>, model: &str) -> String {
    let mut opts = BootOptions::new(fixture(model));
    opts.max_running = 16;
    opts.max_batched_tokens = 64;
    opts.layout = layout;
    let booted = boot(&opts, |_, _| {}).expect("boots");
    let app =
        app_from(&booted, StateOptions { served_model_name: Some("tiny".into()), ..Default::default() });
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let body =
        json!({"model": "tiny", "prompt": "The lighthouse keeper said", "max_tokens": 24, "temperature": 0});
    let r = rt.block_on(app.post("/v1/completions", &body));
    assert_eq!(r.status, axum::http::StatusCode::OK, "{}", r.text());
    let text = r.json()["choices"][0]["text"].as_str().unwrap().to_string();
    booted.engine.shutdown();
    text
}

#[test]
fn tp_and_pp_layouts_answer_as_one_rank_does() {
    for model in ["llama-f32", "qwen2-tied"] {
        let oracle = greedy_text(None, model);
        assert!(!oracle.is_empty());
        let layouts = [
            LayoutSpec { tp: 3, tp_split: Split::Ratio(vec![2, 1, 1]), pp: 1, pp_split: Split::Even },
            LayoutSpec { tp: 2, tp_split: Split::Ratio(vec![3, 1]), pp: 1, pp_split: Split::Even },
            LayoutSpec { tp: 1, tp_split: Split::Even, pp: 2, pp_split: Split::Ratio(vec![1, 1]) },
            LayoutSpec { tp: 1, tp_split: Split::Even, pp: 3, pp_split: Split::Ratio(vec![1, 0, 1]) },
        ];
        for l in layouts {
            let desc = format!("{model} {l:?}");
            assert_eq!(greedy_text(Some(l), model), oracle, "{desc}");
        }
    }
}
