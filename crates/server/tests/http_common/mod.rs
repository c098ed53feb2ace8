//! Shared helpers for the in-process HTTP tests: boot the tiny fixture
//! model with small limits, drive the router with `oneshot`, read SSE
//! bodies, and check the page pool after each test.
#![allow(dead_code)]

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use axum::Router;
use corridor_server::boot::{boot, BootOptions, Booted};
use corridor_server::{router, AppState, Limits, StateOptions};
use http_body_util::BodyExt;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tower::ServiceExt;

/// The name the tiny model is served under in these tests.
pub const MODEL: &str = "tiny";

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny").join(name)
}

/// A booted tiny model behind the router.
pub struct App {
    pub router: Router,
    pub state: AppState,
}

/// Boots `llama-f32` (context 256) with 16 running sequences and a 64-row
/// step, so that prefill is chunked and requests queue.
pub fn app() -> App {
    app_with(StateOptions { served_model_name: Some(MODEL.into()), ..Default::default() })
}

pub fn app_with(options: StateOptions) -> App {
    app_from(&booted(), options)
}

/// The booted fixture, for tests that change a part before serving it.
pub fn booted() -> Booted {
    let mut opts = BootOptions::new(fixture("llama-f32"));
    opts.max_running = 16;
    opts.max_batched_tokens = 64;
    boot(&opts, |_, _| {}).expect("the tiny fixture boots")
}

pub fn app_from(booted: &Booted, options: StateOptions) -> App {
    let state = AppState::new(booted, options);
    App { router: router(state.clone()), state }
}

pub fn app_with_limits(limits: Limits) -> App {
    app_with(StateOptions { served_model_name: Some(MODEL.into()), limits, ..Default::default() })
}

/// A response with its body read to the end.
pub struct Reply {
    pub status: StatusCode,
    pub headers: axum::http::HeaderMap,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    /// The `data:` payloads of an SSE body, in order.
    pub fn sse_data(&self) -> Vec<String> {
        sse_data(&self.text())
    }
    /// The JSON events of an SSE body (everything but `[DONE]`).
    pub fn sse_json(&self) -> Vec<Value> {
        self.sse_data()
            .iter()
            .filter(|d| d.as_str() != "[DONE]")
            .map(|d| serde_json::from_str(d).expect("SSE data is JSON"))
            .collect()
    }
}

pub fn sse_data(text: &str) -> Vec<String> {
    text.lines().filter_map(|l| l.strip_prefix("data:")).map(|d| d.trim_start().to_string()).collect()
}

impl App {
    pub async fn send(&self, request: Request<Body>) -> Reply {
        let response = self.router.clone().oneshot(request).await.expect("the router is infallible");
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.into_body().collect().await.expect("body reads").to_bytes().to_vec();
        Reply { status, headers, body }
    }

    pub async fn post(&self, path: &str, body: &Value) -> Reply {
        self.post_raw(path, serde_json::to_vec(body).expect("serializes")).await
    }

    pub async fn post_raw(&self, path: &str, body: Vec<u8>) -> Reply {
        let request = Request::post(path)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body))
            .expect("request builds");
        self.send(request).await
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.send(Request::get(path).body(Body::empty()).expect("request builds")).await
    }

    /// Waits (bounded) until the engine is idle, then checks the page-pool
    /// invariant: every page is free, cached, in use or withheld, and none is
    /// in use. The wait is not a timing assertion: the engine publishes its
    /// counts after each loop turn, a moment after a response completes.
    pub async fn assert_pool_idle(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let stats = self.get("/v1/engine/stats").await.json();
            let p = &stats["pages"];
            let n = |k: &str| p[k].as_u64().unwrap_or_else(|| panic!("pages.{k} missing: {stats}"));
            assert_eq!(
                n("free") + n("cached") + n("in_use") + n("withheld"),
                n("capacity"),
                "page pool accounting is broken: {stats}"
            );
            let idle = n("in_use") == 0 && stats["running"] == 0 && stats["waiting"] == 0;
            if idle {
                return;
            }
            assert!(Instant::now() < deadline, "the engine did not become idle: {stats}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A greedy chat request for one user message. `ignore_eos` makes the
/// length exact whatever the random weights prefer.
pub fn chat(content: &str, max_tokens: u64) -> Value {
    serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": true,
    })
}

/// Asserts an OpenAI error body with this status, `param` and `code`.
pub fn assert_error(reply: &Reply, status: StatusCode, param: Option<&str>, code: Option<&str>) {
    assert_eq!(reply.status, status, "{}", reply.text());
    let body = reply.json();
    let error = &body["error"];
    assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()), "no message: {body}");
    assert!(error["type"].is_string(), "no type: {body}");
    assert_eq!(error["param"].as_str(), param, "param: {body}");
    assert_eq!(error["code"].as_str(), code, "code: {body}");
}
