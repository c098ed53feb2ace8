//! OpenAI generation semantics in process: streaming equals non-streaming,
//! stop strings (also across token boundaries), seeds, `n`, logprobs in both
//! shapes, `echo`, prompt forms, token limits, template kwargs, and the
//! prefix cache as seen in `usage`.

mod http_common;

use axum::http::StatusCode;
use corridor_server::template::ChatTemplate;
use corridor_server::StateOptions;
use http_common::{app, app_from, booted, chat, Reply, MODEL};
use serde_json::{json, Value};
use std::sync::Arc;

fn ok(reply: &Reply) -> Value {
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    reply.json()
}

/// Concatenated streamed text per choice index, and finish reasons.
fn stream_text(events: &[Value], field: &str) -> (Vec<String>, Vec<Option<String>>) {
    let mut texts: Vec<String> = Vec::new();
    let mut finishes: Vec<Option<String>> = Vec::new();
    for e in events {
        for c in e["choices"].as_array().expect("choices") {
            let i = c["index"].as_u64().expect("index") as usize;
            if texts.len() <= i {
                texts.resize(i + 1, String::new());
                finishes.resize(i + 1, None);
            }
            let piece = if field == "delta" { &c["delta"]["content"] } else { &c["text"] };
            texts[i].push_str(piece.as_str().unwrap_or(""));
            if let Some(f) = c["finish_reason"].as_str() {
                assert!(finishes[i].is_none(), "two finish reasons for choice {i}");
                finishes[i] = Some(f.to_string());
            }
        }
    }
    (texts, finishes)
}

#[tokio::test]
async fn greedy_chat_stream_equals_non_stream() {
    let app = app();
    let body = chat("Tell me a story", 24);
    let whole = ok(&app.post("/v1/chat/completions", &body).await);
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["model"], MODEL);
    assert!(whole["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert!(whole["system_fingerprint"].is_string());
    let choice = &whole["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(whole["usage"]["completion_tokens"], 24);
    let prompt_tokens = whole["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 0);
    assert_eq!(whole["usage"]["total_tokens"].as_u64().unwrap(), prompt_tokens + 24);
    let content = choice["message"]["content"].as_str().unwrap().to_string();
    assert!(!content.is_empty());

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let reply = app.post("/v1/chat/completions", &streamed).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(reply.headers["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let data = reply.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "stream must end with [DONE]");
    let events = reply.sse_json();
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant", "first delta carries the role");
    for e in &events {
        assert_eq!(e["object"], "chat.completion.chunk");
    }
    let (texts, finishes) = stream_text(&events, "delta");
    assert_eq!(texts, vec![content]);
    assert_eq!(finishes, vec![Some("length".to_string())]);
    // The usage chunk comes last, with no choices; every other chunk has null usage.
    let last = events.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 24);
    assert_eq!(last["usage"]["prompt_tokens"], prompt_tokens);
    assert!(events[..events.len() - 1].iter().all(|e| e["usage"].is_null()));

    // Without include_usage there is no usage chunk.
    let mut plain = body.clone();
    plain["stream"] = json!(true);
    let events = app.post("/v1/chat/completions", &plain).await.sse_json();
    assert!(events.iter().all(|e| e["usage"].is_null() && !e["choices"].as_array().unwrap().is_empty()));
    app.assert_pool_idle().await;
}

#[tokio::test]
async fn greedy_completion_stream_equals_non_stream() {
    let app = app();
    let body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "ignore_eos": true});
    let whole = ok(&app.post("/v1/completions", &body).await);
    assert_eq!(whole["object"], "text_completion");
    assert!(whole["id"].as_str().unwrap().starts_with("cmpl-"));
    let text = whole["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(whole["choices"][0]["finish_reason"], "length");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let reply = app.post("/v1/completions", &streamed).await;
    assert_eq!(reply.sse_data().last().map(String::as_str), Some("[DONE]"));
    let (texts, finishes) = stream_text(&reply.sse_json(), "text");
    assert_eq!(texts, vec![text]);
    assert_eq!(finishes, vec![Some("length".to_string())]);
    app.assert_pool_idle().await;
}

/// Picks a stop string that spans the boundary between two tokens: the
/// last character of one token's text and the first of the next.
fn boundary_stop(tokens: &[Value]) -> Option<String> {
    let texts: Vec<&str> = tokens.iter().map(|t| t["token"].as_str().unwrap()).collect();
    (4..texts.len().saturating_sub(1)).find_map(|k| {
        let (a, b) = (texts[k], texts[k + 1]);
        // Special tokens are left out of the content, and a lone byte of a
        // multi-byte character shows as U+FFFD: neither makes a usable stop.
        let plain = |t: &str| !t.contains("<|") && !t.contains('\u{FFFD}');
        if !plain(a) || !plain(b) {
            return None;
        }
        Some(format!("{}{}", a.chars().last()?, b.chars().next()?))
    })
}

#[tokio::test]
async fn stop_strings_are_excluded_also_across_tokens_and_while_streaming() {
    let app = app();
    let mut body = chat("The weather today", 40);
    body["logprobs"] = json!(true);
    let whole = ok(&app.post("/v1/chat/completions", &body).await);
    let content = whole["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let tokens = whole["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
    assert_eq!(tokens.len(), 40);
    let stop = boundary_stop(&tokens).expect("some adjacent tokens have printable text");
    let at = content.find(&stop).expect("the stop string occurs in the output");
    let expected = &content[..at];

    app.assert_pool_idle().await;
    let before = app.get("/v1/engine/stats").await.json();
    // A generous limit: the stop string, not the limit, must end the request.
    let mut stopped = chat("The weather today", 200);
    stopped["stop"] = json!(["never-generated-zzz", stop]);
    let reply = ok(&app.post("/v1/chat/completions", &stopped).await);
    assert_eq!(reply["choices"][0]["message"]["content"], expected);
    assert_eq!(reply["choices"][0]["finish_reason"], "stop");
    let used = reply["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..40).contains(&used), "completion tokens {used} count up to the stop");
    // The engine ended the request early, as finished rather than aborted.
    app.assert_pool_idle().await;
    let after = app.get("/v1/engine/stats").await.json();
    let delta = |k: &str| after[k].as_u64().unwrap() - before[k].as_u64().unwrap();
    assert_eq!(delta("aborted"), 0, "{after}");
    assert_eq!(delta("finished"), 1, "{after}");
    assert!(delta("generated_tokens") < 200, "the engine kept generating after the stop: {after}");

    stopped["stream"] = json!(true);
    stopped["stream_options"] = json!({"include_usage": true});
    let streamed = app.post("/v1/chat/completions", &stopped).await;
    let events = streamed.sse_json();
    let (texts, finishes) = stream_text(&events, "delta");
    assert_eq!(texts, vec![expected.to_string()]);
    assert_eq!(finishes, vec![Some("stop".to_string())]);
    assert_eq!(events.last().unwrap()["usage"]["completion_tokens"], used);
    // No chunk ever carried text from the stop string onwards.
    for e in &events {
        if let Some(piece) = e["choices"][0]["delta"]["content"].as_str() {
            assert!(!piece.contains(stop.as_str()));
        }
    }

    // The same on /v1/completions, with a single string.
    let prompt = json!({"model": MODEL, "prompt": "The weather", "max_tokens": 30, "temperature": 0, "ignore_eos": true});
    let full =
        ok(&app.post("/v1/completions", &prompt).await)["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = full.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let mut with_stop = prompt.clone();
    with_stop["stop"] = json!(stop);
    let got = ok(&app.post("/v1/completions", &with_stop).await);
    assert_eq!(got["choices"][0]["text"], &full[..full.find(&stop).unwrap()]);
    assert_eq!(got["choices"][0]["finish_reason"], "stop");
    app.assert_pool_idle().await;
}

#[tokio::test]
async fn seeded_sampling_repeats_and_n_choices_differ() {
    let app = app();
    let body = json!({
        "model": MODEL, "messages": [{"role": "user", "content": "Pick words"}],
        "temperature": 1.0, "seed": 1234, "max_tokens": 16, "n": 3, "ignore_eos": true,
    });
    let a = ok(&app.post("/v1/chat/completions", &body).await);
    let b = ok(&app.post("/v1/chat/completions", &body).await);
    let texts = |v: &Value| -> Vec<String> {
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["message"]["content"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(texts(&a), texts(&b), "the same seed gives the same choices");
    let indices: Vec<u64> =
        a["choices"].as_array().unwrap().iter().map(|c| c["index"].as_u64().unwrap()).collect();
    assert_eq!(indices, vec![0, 1, 2]);
    let t = texts(&a);
    assert!(t[0] != t[1] || t[1] != t[2], "choices of one seeded request should not all be equal: {t:?}");
    assert_eq!(a["usage"]["completion_tokens"], 48, "usage counts every choice");

    // Streaming with the same seed gives the same choices.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = app.post("/v1/chat/completions", &streamed).await.sse_json();
    let (stream_texts, finishes) = stream_text(&events, "delta");
    assert_eq!(stream_texts, t);
    assert_eq!(finishes, vec![Some("length".to_string()); 3]);
    let roles = events.iter().filter(|e| e["choices"][0]["delta"]["role"] == "assistant").count();
    assert_eq!(roles, 3, "each choice's first delta carries the role");
    app.assert_pool_idle().await;
}

#[tokio::test]
async fn chat_logprobs_shape() {
    let app = app();
    let mut body = chat("Numbers", 6);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(3);
    let whole = ok(&app.post("/v1/chat/completions", &body).await);
    let content = whole["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 6);
    for t in content {
        assert!(t["token"].is_string());
        assert!(t["logprob"].as_f64().unwrap() <= 0.0);
        assert!(t["bytes"].is_array());
        let top = t["top_logprobs"].as_array().unwrap();
        assert!(!top.is_empty() && top.len() <= 3, "{t}");
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], t["token"]);
    }

    body["stream"] = json!(true);
    let events = app.post("/v1/chat/completions", &body).await.sse_json();
    let streamed: usize =
        events.iter().filter_map(|e| e["choices"][0]["logprobs"]["content"].as_array()).map(Vec::len).sum();
    assert_eq!(streamed, 6);
    // Without logprobs, the field is null.
    let plain = ok(&app.post("/v1/chat/completions", &chat("Numbers", 2)).await);
    assert!(plain["choices"][0]["logprobs"].is_null());
    app.assert_pool_idle().await;
}

#[tokio::test]
async fn completion_forms_echo_and_legacy_logprobs() {
    let app = app();
    // Legacy logprobs: parallel lists, one entry per token.
    let body = json!({"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0, "logprobs": 2, "ignore_eos": true});
    let r = ok(&app.post("/v1/completions", &body).await);
    let lp = &r["choices"][0]["logprobs"];
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(lp[key].as_array().unwrap().len(), 5, "{key}: {lp}");
    }
    assert!(lp["top_logprobs"][0].as_object().unwrap().len() <= 2);
    assert_eq!(lp["text_offset"][0], 0);

    // Echo puts the prompt before the completion.
    let echo = json!({"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "temperature": 0, "echo": true, "ignore_eos": true});
    let r = ok(&app.post("/v1/completions", &echo).await);
    let text = r["choices"][0]["text"].as_str().unwrap();
    assert!(text.starts_with("Hello there") && text.len() > "Hello there".len(), "{text}");
    let mut streamed = echo.clone();
    streamed["stream"] = json!(true);
    let (texts, _) = stream_text(&app.post("/v1/completions", &streamed).await.sse_json(), "text");
    assert_eq!(texts, vec![text.to_string()]);

    // A list of prompts: one choice each, in order; n multiplies.
    let list = json!({"model": MODEL, "prompt": ["Hello", "Goodbye"], "max_tokens": 3, "temperature": 0, "n": 2, "ignore_eos": true});
    let r = ok(&app.post("/v1/completions", &list).await);
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    assert_eq!(choices[0]["text"], choices[1]["text"], "greedy choices of one prompt agree");
    assert_eq!(r["usage"]["completion_tokens"], 12);

    // Token ids, and a list of token id lists; ids give the same answer as text.
    let ids = json!({"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0, "ignore_eos": true});
    let single = ok(&app.post("/v1/completions", &ids).await);
    assert_eq!(single["usage"]["prompt_tokens"], 4);
    let lists = json!({"model": MODEL, "prompt": [[5, 6, 7, 8], [9, 10]], "max_tokens": 3, "temperature": 0, "ignore_eos": true});
    let r = ok(&app.post("/v1/completions", &lists).await);
    assert_eq!(r["choices"][0]["text"], single["choices"][0]["text"]);
    assert_eq!(r["usage"]["prompt_tokens"], 6);
    app.assert_pool_idle().await;
}

#[tokio::test]
async fn absent_max_tokens_means_until_the_context_ends() {
    let app = app();
    // With EOS ignored, only the context (256) can end the answer: no
    // silent small default.
    let body = json!({"model": MODEL, "prompt": [5, 6, 7, 8], "temperature": 0, "ignore_eos": true});
    let r = ok(&app.post("/v1/completions", &body).await);
    assert_eq!(r["usage"]["completion_tokens"], 256 - 4);
    assert_eq!(r["choices"][0]["finish_reason"], "length");

    // max_completion_tokens wins over max_tokens.
    let mut c = chat("hi", 9);
    c["max_completion_tokens"] = json!(4);
    let r = ok(&app.post("/v1/chat/completions", &c).await);
    assert_eq!(r["usage"]["completion_tokens"], 4);
    app.assert_pool_idle().await;
}

#[tokio::test]
async fn chat_template_kwargs_reach_the_template() {
    let mut booted = booted();
    let source = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
                  <|im_start|>assistant\n{% if enable_thinking %}<think>\nlet me think about this carefully\n</think>\n{% endif %}";
    booted.template = Arc::new(ChatTemplate::new(source, None, Some("<|im_end|>")).unwrap());
    let app = app_from(&booted, StateOptions { served_model_name: Some(MODEL.into()), ..Default::default() });
    let mut body = chat("hi", 1);
    let plain =
        ok(&app.post("/v1/chat/completions", &body).await)["usage"]["prompt_tokens"].as_u64().unwrap();
    body["chat_template_kwargs"] = json!({"enable_thinking": true});
    let thinking =
        ok(&app.post("/v1/chat/completions", &body).await)["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(thinking > plain + 5, "enable_thinking should lengthen the prompt: {plain} vs {thinking}");
    app.assert_pool_idle().await;
}

#[tokio::test]
async fn shared_prefix_computes_only_the_suffix() {
    let app = app();
    let shared = "the quick brown fox jumps over the lazy dog ".repeat(8);
    let first =
        json!({"model": MODEL, "prompt": shared, "max_tokens": 2, "temperature": 0, "ignore_eos": true});
    let a = ok(&app.post("/v1/completions", &first).await);
    let prompt_tokens = a["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens >= 48, "the shared prompt spans several pages: {prompt_tokens}");
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    let second = json!({"model": MODEL, "prompt": format!("{shared} and then some"), "max_tokens": 2, "temperature": 0});
    let b = ok(&app.post("/v1/completions", &second).await);
    let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    // Whole pages of the shared prefix come from the cache (16-token pages).
    assert!(cached >= (prompt_tokens - 1) / 16 * 16 - 16 && cached > 0, "cached {cached} of {prompt_tokens}");
    let metrics = app.get("/metrics").await.text();
    let hits: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("corridor_prefix_cache_hit_tokens_total "))
        .and_then(|v| v.parse().ok())
        .expect("hit counter");
    assert!(hits >= cached, "metrics count the hit: {hits} < {cached}");
    app.assert_pool_idle().await;
}
