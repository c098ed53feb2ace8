//! The HTTP surface in process: routes, the API key, the body limit, and
//! the error object for every kind of bad request.

mod http_common;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use corridor_server::{Limits, StateOptions};
use http_common::{app, app_with, app_with_limits, assert_error, chat, MODEL};
use serde_json::json;

#[tokio::test]
async fn health_models_and_metrics() {
    let app = app();
    let health = app.get("/health").await;
    assert_eq!(health.status, StatusCode::OK);
    assert_eq!(health.json()["status"], "ok");

    let models = app.get("/v1/models").await.json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(models["data"][0]["max_model_len"], 256);

    let one = app.get(&format!("/v1/models/{MODEL}")).await;
    assert_eq!(one.status, StatusCode::OK);
    assert_eq!(one.json()["id"], MODEL);
    assert_error(
        &app.get("/v1/models/gpt-4").await,
        StatusCode::NOT_FOUND,
        Some("model"),
        Some("model_not_found"),
    );

    // Generate something so the counters move.
    let reply = app.post("/v1/chat/completions", &chat("hi", 3)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let metrics = app.get("/metrics").await;
    assert_eq!(metrics.status, StatusCode::OK);
    assert!(metrics.headers[header::CONTENT_TYPE].to_str().unwrap().starts_with("text/plain"));
    let text = metrics.text();
    for family in [
        "corridor_requests_running",
        "corridor_requests_waiting",
        "corridor_kv_pages",
        "corridor_prefix_cache_hit_rate",
        "corridor_prompt_tokens_total",
        "corridor_generation_tokens_total",
        "corridor_time_to_first_token_seconds",
        "corridor_inter_token_latency_seconds",
        "corridor_preemptions_total",
        "corridor_requests_aborted_total",
    ] {
        assert!(text.contains(&format!("# TYPE {family} ")), "{family} missing:\n{text}");
    }
    assert!(text.contains("corridor_generation_tokens_total 3\n"), "{text}");
    assert!(text.contains("corridor_time_to_first_token_seconds_count 1\n"), "{text}");
    assert!(text.contains("corridor_inter_token_latency_seconds_count 2\n"), "{text}");
    assert!(text.contains("corridor_http_requests_total{outcome=\"completed\"} 1\n"), "{text}");
    // One prefill step and two decode steps made the three tokens, and each
    // phase of a step is timed. A step is counted once its tokens are handed
    // on, so the reply can arrive a moment before the count: wait for it.
    let mut stats = app.get("/v1/engine/stats").await.json();
    for _ in 0..200 {
        if stats["steps"] == 3 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        stats = app.get("/v1/engine/stats").await.json();
    }
    assert_eq!(stats["steps"], 3, "{stats}");
    // Every step taught the step-time model behind the default ITL bound.
    assert_eq!(stats["step_cost"]["measured"], 3, "{stats}");
    let default_ms = corridor_engine::step_budget::DEFAULT_ITL_TARGET.as_secs_f64() * 1e3;
    assert_eq!(stats["itl_target_ms"].as_f64(), Some(default_ms), "{stats}");
    assert!(stats["itl_stall_ratio"].is_null(), "no stall ratio unless asked for: {stats}");
    let text = app.get("/metrics").await.text();
    assert!(text.contains("# TYPE corridor_engine_steps_total counter"), "{text}");
    assert!(text.contains("corridor_engine_steps_total 3\n"), "{text}");
    for phase in ["schedule", "forward", "sample"] {
        let secs = stats["step_seconds"][phase].as_f64().unwrap();
        assert!(secs > 0.0 && secs < 60.0, "{phase}: {secs}");
        assert!(
            text.contains(&format!("corridor_engine_step_seconds_total{{phase=\"{phase}\"}} ")),
            "{text}"
        );
    }
    app.assert_pool_idle().await;
}

#[tokio::test]
async fn api_key_guards_everything_but_health() {
    let app = app_with(StateOptions {
        served_model_name: Some(MODEL.into()),
        api_key: Some("sesame".into()),
        ..Default::default()
    });
    assert_eq!(app.get("/health").await.status, StatusCode::OK);
    for path in ["/v1/models", "/metrics", "/v1/engine/stats"] {
        let reply = app.get(path).await;
        assert_error(&reply, StatusCode::UNAUTHORIZED, None, Some("invalid_api_key"));
        assert!(!reply.text().contains("sesame"), "the key leaked into a response");
    }
    let wrong =
        Request::get("/v1/models").header(header::AUTHORIZATION, "Bearer open").body(Body::empty()).unwrap();
    assert_eq!(app.send(wrong).await.status, StatusCode::UNAUTHORIZED);
    let right = Request::get("/v1/models")
        .header(header::AUTHORIZATION, "Bearer sesame")
        .body(Body::empty())
        .unwrap();
    assert_eq!(app.send(right).await.status, StatusCode::OK);
    let post = Request::post("/v1/chat/completions")
        .header(header::AUTHORIZATION, "Bearer sesame")
        .body(Body::from(serde_json::to_vec(&chat("hi", 2)).unwrap()))
        .unwrap();
    assert_eq!(app.send(post).await.status, StatusCode::OK);
    let unauthorized_post = app.post("/v1/chat/completions", &chat("hi", 2)).await;
    assert_eq!(unauthorized_post.status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn body_limit_and_malformed_bodies() {
    let app = app_with_limits(Limits { max_body_bytes: 1024, ..Limits::default() });
    let big = json!({"model": MODEL, "messages": [{"role": "user", "content": "x".repeat(4096)}]});
    let reply = app.post("/v1/chat/completions", &big).await;
    assert_error(&reply, StatusCode::PAYLOAD_TOO_LARGE, None, Some("request_too_large"));

    assert_error(
        &app.post_raw("/v1/chat/completions", b"{not json".to_vec()).await,
        StatusCode::BAD_REQUEST,
        None,
        None,
    );
    assert_error(
        &app.post_raw("/v1/completions", b"[1, 2]".to_vec()).await,
        StatusCode::BAD_REQUEST,
        None,
        None,
    );
    assert_error(&app.post_raw("/v1/completions", Vec::new()).await, StatusCode::BAD_REQUEST, None, None);
    assert_error(&app.get("/v1/nothing").await, StatusCode::NOT_FOUND, None, Some("not_found"));
    let wrong_method = app.get("/v1/chat/completions").await;
    assert_eq!(wrong_method.status, StatusCode::METHOD_NOT_ALLOWED);
    assert!(wrong_method.json()["error"]["message"].is_string());
    app.assert_pool_idle().await;
}

/// Every client mistake is a 400 (or 404 for the model) naming the field.
#[tokio::test]
async fn invalid_requests_name_their_parameter() {
    let app = app();
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let long = "word ".repeat(400);
    let chat_cases = vec![
        (json!({"messages": msgs, "temperature": "hot"}), "temperature", None),
        (json!({"messages": msgs, "temperature": 2.5}), "temperature", None),
        (json!({"messages": msgs, "top_p": 0}), "top_p", None),
        (json!({"messages": msgs, "max_tokens": 0}), "max_tokens", None),
        (json!({"messages": msgs, "max_tokens": -5}), "max_tokens", None),
        (json!({"messages": msgs, "max_completion_tokens": 0}), "max_completion_tokens", None),
        (json!({"messages": msgs, "n": 0}), "n", None),
        (json!({"messages": msgs, "n": 1000}), "n", None),
        (json!({"messages": msgs, "top_logprobs": 3}), "top_logprobs", None),
        (json!({"messages": msgs, "logprobs": true, "top_logprobs": 21}), "top_logprobs", None),
        (json!({"messages": msgs, "stop": ["a", "b", "c", "d", "e"]}), "stop", None),
        (json!({"messages": msgs, "stop": 7}), "stop", None),
        (json!({"messages": msgs, "logit_bias": {"99999": 1}}), "logit_bias", None),
        (json!({"messages": msgs, "stream_options": {"include_usage": true}}), "stream_options", None),
        (json!({"messages": msgs, "response_format": {"type": "yaml"}}), "response_format.type", None),
        (json!({"messages": [{"role": "robot", "content": "x"}]}), "messages[0].role", None),
        (json!({"messages": msgs, "tool_choice": "required"}), "tool_choice", None),
        (json!({"messages": msgs, "chat_template_kwargs": {"messages": []}}), "chat_template_kwargs", None),
        (json!({"messages": []}), "messages", None),
        (json!({}), "messages", None),
        (json!({"messages": [{"content": "x"}]}), "messages[0].role", None),
        (json!({"messages": [{"role": "user", "content": 5}]}), "messages[0].content", None),
        (
            json!({"messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
            "messages[0].content[1]",
            None,
        ),
        (
            json!({"messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}),
            "messages[0].content[0]",
            None,
        ),
        (
            json!({"messages": [{"role": "user", "content": long}], "max_tokens": 10}),
            "messages",
            Some("context_length_exceeded"),
        ),
        (json!({"messages": msgs, "max_tokens": 100000}), "messages", Some("context_length_exceeded")),
    ];
    for (body, param, code) in chat_cases {
        let reply = app.post("/v1/chat/completions", &body).await;
        assert_error(&reply, StatusCode::BAD_REQUEST, Some(param), code);
    }
    let completion_cases = vec![
        (json!({"prompt": "hi", "logprobs": 21}), "logprobs", None),
        (json!({"prompt": "hi", "logprobs": 1, "echo": true}), "logprobs", None),
        (json!({"prompt": "hi", "suffix": "x"}), "suffix", None),
        (json!({"prompt": "hi", "max_tokens": 0}), "max_tokens", None),
        (json!({"prompt": []}), "prompt", None),
        (json!({"prompt": ""}), "prompt", None),
        (json!({"prompt": [1, 2, 100000]}), "prompt", None),
        (json!({"prompt": {"text": "x"}}), "prompt", None),
        (json!({}), "prompt", None),
        (json!({"prompt": [1, 2, 3], "max_tokens": 300}), "prompt", Some("context_length_exceeded")),
    ];
    for (body, param, code) in completion_cases {
        let reply = app.post("/v1/completions", &body).await;
        assert_error(&reply, StatusCode::BAD_REQUEST, Some(param), code);
    }
    // An unknown model is 404 `model_not_found` on every route.
    let reply = app.post("/v1/chat/completions", &json!({"model": "gpt-4", "messages": msgs})).await;
    assert_error(&reply, StatusCode::NOT_FOUND, Some("model"), Some("model_not_found"));
    let reply = app.post("/v1/completions", &json!({"model": "gpt-4", "prompt": "x"})).await;
    assert_error(&reply, StatusCode::NOT_FOUND, Some("model"), Some("model_not_found"));
    app.assert_pool_idle().await;
}
