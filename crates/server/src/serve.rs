//! The entry point `corridor serve` calls: bind, serve, shut down cleanly.
//!
//! Shutdown on SIGINT or SIGTERM: `/health` turns 503 and new generation
//! requests are refused at once; the listener stops accepting; the engine
//! aborts whatever is in flight (non-streaming requests answer 503, streams
//! end with an error event), which lets every open response finish; then
//! the engine thread is joined and `run` returns `Ok`, so the process can
//! exit 0.

use std::future::Future;
use std::net::SocketAddr;

use crate::boot::Booted;
use crate::defaults::SamplingPreferences;
use crate::error::ServerError;
use crate::http::{router, AppState, StateOptions};
use crate::validate::Limits;

/// How the server listens and whom it serves; the cli fills it from flags.
#[derive(Clone)]
pub struct ServerConfig {
    /// Address to bind; loopback by default, so nothing is exposed unless
    /// asked for.
    pub host: String,
    pub port: u16,
    /// The model id clients use; `None` uses the checkpoint's name.
    pub served_model_name: Option<String>,
    /// When set, every route but `/health` requires `Authorization: Bearer
    /// <key>`. Never logged.
    pub api_key: Option<String>,
    /// Per-request limits (stop strings, `n`, body size, ...).
    pub limits: Limits,
    /// Sampling defaults set by flags (`--temperature`, ...).
    pub sampling: SamplingPreferences,
    /// Origins browsers may call the API from (`*` for any); empty: no CORS
    /// headers, so browsers keep to same-origin.
    pub cors_origins: Vec<String>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".to_string(),
            port: 8000,
            served_model_name: None,
            api_key: None,
            limits: Limits::default(),
            sampling: SamplingPreferences::default(),
            cors_origins: Vec::new(),
        }
    }
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("served_model_name", &self.served_model_name)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("limits", &self.limits)
            .field("sampling", &self.sampling)
            .field("cors_origins", &self.cors_origins)
            .finish()
    }
}

impl ServerConfig {
    fn state_options(&self) -> StateOptions {
        StateOptions {
            served_model_name: self.served_model_name.clone(),
            api_key: self.api_key.clone(),
            limits: self.limits,
            sampling: self.sampling,
            cors_origins: self.cors_origins.clone(),
        }
    }
}

/// Serves until SIGINT or SIGTERM, then shuts down gracefully.
pub async fn run(booted: Booted, cfg: ServerConfig) -> Result<(), ServerError> {
    run_until(booted, cfg, shutdown_signal()).await
}

/// Serves until `shutdown` completes, then shuts down gracefully (what `run`
/// does on a signal; tests pass their own trigger).
pub async fn run_until(
    booted: Booted,
    cfg: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let listener = bind(&cfg.host, cfg.port)?;
    run_on(listener, booted, cfg, shutdown).await
}

/// Binds the listen address. `corridor serve` calls it before loading the
/// model, so a busy port fails at once instead of after the load.
pub fn bind(host: &str, port: u16) -> Result<std::net::TcpListener, ServerError> {
    let addr = format!("{host}:{port}");
    let listener = std::net::TcpListener::bind(&addr).map_err(|error| ServerError::Bind {
        hint: match error.kind() {
            std::io::ErrorKind::AddrInUse => {
                " (another process is listening there: stop it or choose another --port)"
            }
            std::io::ErrorKind::AddrNotAvailable => {
                " (no interface of this machine has that address: check --host)"
            }
            std::io::ErrorKind::PermissionDenied => {
                " (ports below 1024 need privileges: choose another --port)"
            }
            _ => "",
        },
        addr: addr.clone(),
        error,
    })?;
    // tokio needs the socket non-blocking.
    listener.set_nonblocking(true).map_err(|error| ServerError::Bind { addr, error, hint: "" })?;
    Ok(listener)
}

/// Answers on a listener from [`bind`] while the model loads, until `loaded`
/// completes: `/health` is 503 `{"status": "loading"}` (so a probe or a
/// client that waits for it keeps waiting, rather than hanging on a socket
/// nobody accepts), and every other route is 503 with the OpenAI error
/// object. Then it lets go of the listener for [`run_on`] (pass it a clone
/// from `try_clone`; both are the same socket).
pub async fn serve_while_loading(
    listener: std::net::TcpListener,
    loaded: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    use axum::response::IntoResponse;
    let addr = listener.local_addr().map(|a| a.to_string()).unwrap_or_default();
    let listener = tokio::net::TcpListener::from_std(listener).map_err(|error| ServerError::Bind {
        addr,
        error,
        hint: "",
    })?;
    let health = || async {
        (axum::http::StatusCode::SERVICE_UNAVAILABLE, axum::Json(serde_json::json!({"status": "loading"})))
    };
    let busy = || async {
        crate::error::ApiError::Unavailable { message: "the model is still loading; retry shortly".into() }
            .into_response()
    };
    let app = axum::Router::new().route("/health", axum::routing::get(health)).fallback(busy);
    axum::serve(listener, app)
        .with_graceful_shutdown(loaded)
        .await
        .map_err(|source| ServerError::Serve { source })
}

/// Serves on a listener from [`bind`] until `shutdown` completes.
pub async fn run_on(
    listener: std::net::TcpListener,
    booted: Booted,
    cfg: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    if cfg.served_model_name.as_deref().is_some_and(|n| n.trim().is_empty()) {
        return Err(ServerError::Config { message: "the served model name must not be empty".into() });
    }
    cfg.sampling.validate().map_err(|e| ServerError::Config { message: e.to_string() })?;
    let state = AppState::new(&booted, cfg.state_options());
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = tokio::net::TcpListener::from_std(listener).map_err(|error| ServerError::Bind {
        addr: addr.clone(),
        error,
        hint: "",
    })?;
    let local: SocketAddr =
        listener.local_addr().map_err(|error| ServerError::Bind { addr: addr.clone(), error, hint: "" })?;
    tracing::info!(
        model = state.served_model_name(),
        auth = if cfg.api_key.is_some() { "api key required" } else { "none" },
        "serving at http://{local}/v1"
    );

    let engine = booted.engine.clone();
    let draining = state.clone();
    let app = router(state);
    let stop = async move {
        shutdown.await;
        tracing::info!("shutting down: refusing new requests and aborting those in flight");
        draining.begin_shutdown();
        // Aborting in-flight requests is what lets open responses (streams
        // especially) finish, so the graceful drain below cannot hang.
        // `shutdown` joins the engine thread, hence a blocking task.
        let engine = draining.engine().clone();
        let _ = tokio::task::spawn_blocking(move || engine.shutdown()).await;
    };
    let served = axum::serve(listener, app).with_graceful_shutdown(stop).await;
    engine.shutdown();
    served.map_err(|source| ServerError::Serve { source })?;
    tracing::info!("server stopped");
    Ok(())
}

/// Completes on the first SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            // Without a signal handler, never trigger from here.
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get(port: u16, path: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.expect("connect");
        let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).await.expect("read");
        out
    }

    #[tokio::test]
    async fn a_loading_server_answers_503_and_lets_go_of_the_socket() {
        let listener = bind("127.0.0.1", 0).expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let kept = listener.try_clone().expect("clone");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let loading = tokio::spawn(serve_while_loading(listener, async {
            let _ = rx.await;
        }));
        let health = get(port, "/health").await;
        assert!(health.starts_with("HTTP/1.1 503"), "{health}");
        assert!(health.contains(r#"{"status":"loading"}"#), "{health}");
        let other = get(port, "/v1/models").await;
        assert!(other.starts_with("HTTP/1.1 503") && other.contains("still loading"), "{other}");
        tx.send(()).expect("loading server alive");
        loading.await.expect("joined").expect("served");
        // The socket is still bound (the clone holds it): nobody else can take the port.
        assert!(bind("127.0.0.1", port).is_err());
        drop(kept);
    }

    #[test]
    fn a_busy_port_names_the_fix() {
        let held = bind("127.0.0.1", 0).expect("bind");
        let port = held.local_addr().expect("addr").port();
        let err = bind("127.0.0.1", port).unwrap_err().to_string();
        assert!(
            err.contains(&format!("cannot listen on 127.0.0.1:{port}")) && err.contains("--port"),
            "{err}"
        );
    }
}
