//! Many users at once: 32 concurrent requests, a client that drops its
//! stream, and a graceful shutdown of the real listener with a stream open.

mod http_common;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use corridor_server::{run_until, ServerConfig};
use corridor_units::TokenId;
use futures_util::future::join_all;
use http_body_util::BodyExt;
use http_common::{app, booted, chat, MODEL};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_concurrent_requests_all_complete() {
    let app = app();
    let requests = (0..32).map(|i| {
        let app = &app;
        async move {
            let stream = i % 2 == 0;
            let body = json!({
                "model": MODEL,
                "messages": [{"role": "user", "content": format!("request number {i}")}],
                "max_tokens": 6, "temperature": 0.7, "seed": i, "ignore_eos": true,
                "stream": stream,
            });
            let reply = app.post("/v1/chat/completions", &body).await;
            assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
            if stream {
                assert_eq!(reply.sse_data().last().map(String::as_str), Some("[DONE]"));
            } else {
                assert_eq!(reply.json()["usage"]["completion_tokens"], 6);
            }
        }
    });
    join_all(requests).await;
    app.assert_pool_idle().await;
    let stats = app.get("/v1/engine/stats").await.json();
    assert_eq!(stats["finished"], 32, "{stats}");
    assert_eq!(stats["aborted"], 0, "{stats}");
}

#[tokio::test]
async fn a_dropped_stream_is_aborted_and_does_not_wedge_the_server() {
    let app = app();
    let mut body = chat("keep talking", 200);
    body["stream"] = json!(true);
    let request = Request::post("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(serde_json::to_vec(&body).unwrap()))
        .unwrap();
    let response = app.router.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut stream = response.into_body();
    // Read until some generated text has arrived, then hang up.
    let mut seen = String::new();
    while !seen.contains("\"content\":\"") || seen.matches("data:").count() < 3 {
        let frame = stream.frame().await.expect("the stream is still open").expect("frame reads");
        if let Ok(data) = frame.into_data() {
            seen.push_str(&String::from_utf8_lossy(&data));
        }
    }
    drop(stream);
    app.assert_pool_idle().await;
    let stats = app.get("/v1/engine/stats").await.json();
    assert_eq!(stats["aborted"], 1, "{stats}");
    assert!(stats["generated_tokens"].as_u64().unwrap() < 200, "the dropped request stopped early: {stats}");

    // The server still serves.
    let reply = app.post("/v1/chat/completions", &chat("still there?", 3)).await;
    assert_eq!(reply.status, StatusCode::OK);
    app.assert_pool_idle().await;
}

/// Sends one raw HTTP/1.1 request and returns the connection.
async fn send_raw(port: u16, method: &str, path: &str, body: &str) -> tokio::net::TcpStream {
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.expect("server listens");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).await.expect("request writes");
    conn
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_aborts_in_flight_streams_and_returns_ok() {
    let port = {
        // Ask the OS for a free port, then release it for the server.
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let booted = booted();
    let engine = booted.engine.clone();
    let (trigger, triggered) = tokio::sync::oneshot::channel::<()>();
    let cfg = ServerConfig { port, served_model_name: Some(MODEL.into()), ..Default::default() };
    let server = tokio::spawn(run_until(booted, cfg, async move {
        let _ = triggered.await;
    }));

    // Wait for the listener (bounded), via /health.
    let mut attempts = 0;
    loop {
        if let Ok(mut conn) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            conn.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
            let mut reply = String::new();
            conn.read_to_string(&mut reply).await.unwrap();
            assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
            break;
        }
        attempts += 1;
        assert!(attempts < 500, "the server never listened");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }

    // A long stream is in flight when the signal comes.
    let mut body = chat("a long answer please", 200);
    body["stream"] = json!(true);
    let mut conn = send_raw(port, "POST", "/v1/chat/completions", &body.to_string()).await;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&seen).matches("data:").count() < 3 {
        let n = conn.read(&mut buf).await.unwrap();
        assert!(n > 0, "the stream closed early");
        seen.extend_from_slice(&buf[..n]);
    }
    trigger.send(()).unwrap();
    // The stream ends (with an error event, not a fake finish) instead of
    // holding the shutdown open.
    conn.read_to_end(&mut seen).await.unwrap();
    let text = String::from_utf8_lossy(&seen);
    assert!(text.contains("\"error\""), "{text}");
    assert!(!text.contains("\"finish_reason\":\"stop\""), "an abort must not look like a stop: {text}");
    server.await.expect("the server task joins").expect("run_until returns Ok");
    assert!(
        engine
            .submit(corridor_engine::engine::GenerateRequest {
                prompt: vec![TokenId(5)],
                params: Default::default(),
                max_new_tokens: Some(1),
                eos_ids: vec![],
                constraint: None,
            })
            .is_err(),
        "the engine has stopped"
    );
    // The listener is closed.
    assert!(tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err());
}
