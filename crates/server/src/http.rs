//! The axum router: routes, handlers, the API-key check and the body limit.
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions`,
//! `GET /v1/models`, `GET /v1/models/{id}`, `GET /health`, `GET /metrics`,
//! and `GET /v1/engine/stats` (the page pool's counts as JSON, which tests
//! use to check that `free + cached + in_use + withheld == capacity`).
//! With an API key set, every route but `/health` requires
//! `Authorization: Bearer <key>`. Bodies are read as bytes under a size
//! limit and parsed by `validate`, so a malformed body, an oversized one, or
//! a wrong field all get the OpenAI error object instead of axum's plain
//! text rejections.

use crate::access::TokenTally;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use corridor_engine::engine::{EngineHandle, GenerateRequest};
use corridor_units::{TokenId, Tokens};
use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tower_http::cors::{self, AllowOrigin, CorsLayer};

use crate::api::{ModelCard, ModelList};
use crate::boot::Booted;
use crate::defaults::{self, SamplingDefaults, SamplingPreferences};
use crate::error::ApiError;
use crate::generate::{ChoiceSpec, DecodeSettings, Generation};
use crate::grammar::LazyGrammar;
use crate::metrics::{self, Metrics, Scrape};
use crate::respond::{self, ChatReading, ResponsePlan, Shape};
use crate::template::ChatTemplate;
use crate::tokenizer::Tokenizer;
use crate::validate::{self, Edge, Limits, ModelFacts, ValidGeneration};

// The entry points live in `serve`; they are also reachable from here, where
// the rest of the HTTP surface is.
pub use crate::serve::{bind, run, run_on, run_until, ServerConfig};

/// What the handlers share. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Shared>,
}

struct Shared {
    engine: EngineHandle,
    /// The memory governor (cards, books, sampler) behind `/v1/memory`.
    governor: Arc<corridor_vram::Governor>,
    /// Keeps the boot's bookings and sampler threads alive with the server.
    _keep_alive: Arc<crate::boot::KeepAlive>,
    tokenizer: Arc<Tokenizer>,
    template: Arc<ChatTemplate>,
    facts: ModelFacts,
    limits: Limits,
    cors_origins: Vec<String>,
    /// What the sampling fields a request leaves out mean.
    defaults: SamplingDefaults,
    /// Kept out of every `Debug` and log line.
    api_key: Option<String>,
    /// End-of-sequence ids: the tokenizer's and the model config's.
    eos_ids: Vec<u32>,
    metrics: Arc<Metrics>,
    /// Compiles `response_format` and forced-call schemas.
    grammar: LazyGrammar,
    /// When the server started (`created` of the model card).
    started: u64,
    /// Set once shutdown begins: `/health` turns 503 and new generation
    /// requests are refused.
    draining: AtomicBool,
}

/// The parts of the server configuration the handlers need.
#[derive(Clone, Default)]
pub struct StateOptions {
    /// The name clients send as `model`; `None` uses the checkpoint's name.
    pub served_model_name: Option<String>,
    pub api_key: Option<String>,
    pub limits: Limits,
    /// Sampling defaults from the server's flags; they win over the model's
    /// recommendation (see `defaults`).
    pub sampling: SamplingPreferences,
    /// Origins allowed to call the API from a browser (`*`: any).
    pub cors_origins: Vec<String>,
}

impl std::fmt::Debug for StateOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateOptions")
            .field("served_model_name", &self.served_model_name)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("limits", &self.limits)
            .field("sampling", &self.sampling)
            .field("cors_origins", &self.cors_origins)
            .finish()
    }
}

impl AppState {
    pub fn new(booted: &Booted, options: StateOptions) -> AppState {
        let info = booted.engine.info();
        let mut eos_ids: Vec<u32> = booted.tokenizer.eos_ids().to_vec();
        eos_ids.extend(info.config.eos_token_ids.iter().copied());
        eos_ids.sort_unstable();
        eos_ids.dedup();
        let served_name = options.served_model_name.unwrap_or_else(|| booted.model_name.clone());
        let facts = ModelFacts {
            served_name,
            context_len: Tokens(info.context_len),
            pool_tokens: Tokens(info.num_pages * info.page_size),
            vocab_size: info.config.vocab_size,
        };
        let defaults = defaults::resolve(&options.sampling, &booted.sampling);
        tracing::info!("sampling defaults: {defaults}");
        AppState {
            inner: Arc::new(Shared {
                engine: booted.engine.clone(),
                governor: booted.governor.clone(),
                _keep_alive: booted.keep_alive.clone(),
                tokenizer: booted.tokenizer.clone(),
                template: booted.template.clone(),
                facts,
                limits: options.limits,
                defaults: defaults.values,
                cors_origins: options.cors_origins,
                api_key: options.api_key.filter(|k| !k.is_empty()),
                grammar: LazyGrammar::new(booted.tokenizer.clone(), info.config.vocab_size, eos_ids.clone()),
                eos_ids,
                metrics: Arc::new(Metrics::default()),
                started: unix_now(),
                draining: AtomicBool::new(false),
            }),
        }
    }

    /// The name clients must send as `model`.
    pub fn served_model_name(&self) -> &str {
        &self.inner.facts.served_name
    }

    /// The engine behind the server.
    pub fn engine(&self) -> &EngineHandle {
        &self.inner.engine
    }

    /// Starts draining: `/health` answers 503 and new requests are refused.
    pub fn begin_shutdown(&self) {
        self.inner.draining.store(true, Ordering::SeqCst);
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The whole HTTP surface, for `run` and for in-process tests.
pub fn router(state: AppState) -> Router {
    let limit = state.inner.limits.max_body_bytes;
    let protected = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*id}", get(get_model))
        .route("/v1/engine/stats", get(engine_stats))
        .route("/v1/memory", get(memory_report))
        .route("/v1/admin/layout", get(crate::admin::get_layout).post(crate::admin::post_layout))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), require_key));
    let app = Router::new()
        .route("/health", get(health))
        .merge(protected)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn(crate::access::log_request));
    // Outermost, so a browser's preflight is answered before the key check
    // (preflights carry no credentials) and every answer carries the headers.
    match cors_layer(&state.inner.cors_origins) {
        Some(cors) => app.layer(cors).with_state(state),
        None => app.with_state(state),
    }
}

/// The CORS policy for `--cors-origin`: `*` allows any origin, otherwise the
/// exact origins listed; any method and header, as the OpenAI clients send
/// `Authorization` and `Content-Type`. `None` when no origin is configured.
fn cors_layer(origins: &[String]) -> Option<CorsLayer> {
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| HeaderValue::from_str(o.trim_end_matches('/')).ok()))
    };
    Some(CorsLayer::new().allow_origin(allow).allow_methods(cors::Any).allow_headers(cors::Any))
}

/// Checks `Authorization: Bearer <key>` when a key is configured.
async fn require_key(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.inner.api_key {
        let presented = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if !presented.is_some_and(|p| constant_time_eq(p.as_bytes(), key.as_bytes())) {
            return ApiError::Unauthorized.into_response();
        }
    }
    next.run(request).await
}

/// Compares without an early exit, so response timing does not reveal how
/// much of a guessed key was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn health(State(state): State<AppState>) -> Response {
    if state.inner.draining.load(Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "shutting down"}))).into_response();
    }
    Json(json!({"status": "ok"})).into_response()
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::RouteNotFound { method: method.to_string(), path: uri.path().to_string() }
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    let body = ApiError::invalid_body(format!("{method} is not allowed on {}", uri.path())).body();
    (StatusCode::METHOD_NOT_ALLOWED, Json(body)).into_response()
}

fn model_card(state: &AppState) -> ModelCard {
    ModelCard {
        id: state.inner.facts.served_name.clone(),
        object: "model",
        created: state.inner.started,
        owned_by: "corridor",
        max_model_len: state.inner.facts.context_len.get(),
    }
}

async fn list_models(State(state): State<AppState>) -> Json<ModelList> {
    Json(ModelList { object: "list", data: vec![model_card(&state)] })
}

async fn get_model(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    if id == state.inner.facts.served_name {
        Ok(Json(model_card(&state)))
    } else {
        Err(ApiError::ModelNotFound { model: id, served: state.inner.facts.served_name.clone() })
    }
}

async fn engine_stats(State(state): State<AppState>) -> Response {
    let s = state.inner.engine.stats();
    let p = s.pages;
    Json(json!({
        "running": s.running,
        "waiting": s.waiting,
        "pages": {
            "capacity": p.capacity,
            "free": p.free,
            "cached": p.cached,
            "in_use": p.in_use,
            "withheld": p.withheld,
        },
        "prefix_lookup_tokens": s.prefix_lookup_tokens,
        "prefix_hit_tokens": s.prefix_hit_tokens,
        "prompt_tokens": s.prompt_tokens,
        "generated_tokens": s.generated_tokens,
        "preemptions": s.preemptions,
        "memory_preemptions": s.memory_preemptions,
        "kv_pages_moved": s.kv_pages_moved,
        "aborted": s.aborted,
        "finished": s.finished,
        "layout": crate::admin::layout_json(&s.flips),
        "steps": s.steps,
        "step_seconds": {
            "schedule": s.schedule_seconds,
            "forward": s.forward_seconds,
            "sample": s.sample_seconds,
        },
        // The bound on prompt rows beside decodes, and the step-time model
        // (learned from `measured` steps) it predicts with.
        "itl_target_ms": s.itl_target.map(|t| t.as_secs_f64() * 1000.0),
        "itl_stall_ratio": s.itl_stall_ratio,
        "step_cost": {
            "measured": s.step_cost_measured,
            "fixed_s": s.step_cost.fixed.as_secs_f64(),
            "prefill_step_s": s.step_cost.prefill_step.as_secs_f64(),
            "per_prefill_row_s": s.step_cost.per_prefill_row.as_secs_f64(),
            "per_decode_row_s": s.step_cost.per_decode_row.as_secs_f64(),
        },
    }))
    .into_response()
}

/// `GET /v1/memory`: every card's memory, books and corridor record.
async fn memory_report(State(state): State<AppState>) -> Response {
    let mut report = serde_json::to_value(state.inner.governor.memory_report()).unwrap_or_default();
    if let Some(obj) = report.as_object_mut() {
        obj.insert("layout".into(), crate::admin::layout_json(&state.inner.engine.stats().flips));
    }
    axum::Json(report).into_response()
}

async fn metrics_text(State(state): State<AppState>) -> Response {
    let engine = state.inner.engine.stats();
    let memory = state.inner.governor.memory_report();
    let text = metrics::render(&Scrape {
        server: &state.inner.metrics,
        engine: &engine,
        sampler: state.inner.engine.sampler_stats(),
        info: state.inner.engine.info(),
        memory: &memory,
    });
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

impl AppState {
    fn edge(&self) -> Edge<'_> {
        Edge {
            limits: &self.inner.limits,
            facts: &self.inner.facts,
            tokenizer: &self.inner.tokenizer,
            template: &self.inner.template,
            defaults: &self.inner.defaults,
            grammar: &self.inner.grammar,
        }
    }

    /// Reads the body, refusing new work while shutting down.
    fn accept(&self, body: Result<Bytes, BytesRejection>) -> Result<serde_json::Value, ApiError> {
        if self.inner.draining.load(Ordering::SeqCst) {
            return Err(ApiError::Unavailable { message: "the server is shutting down".into() });
        }
        let bytes = body.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::BodyTooLarge { limit_bytes: self.inner.limits.max_body_bytes }
            } else {
                ApiError::invalid_body(rejection.body_text())
            }
        })?;
        validate::parse_body(&bytes)
    }

    /// Submits every choice of a validated request and answers it.
    async fn run(
        &self,
        gen: ValidGeneration,
        shape: Shape,
        echo: bool,
        reading: Option<ChatReading>,
        tally: Tally,
    ) -> Response {
        let tally = tally.map(|t| t.0).unwrap_or_default();
        let metrics = self.inner.metrics.clone();
        let specs = choice_specs(&gen, &self.inner.eos_ids);
        let settings = DecodeSettings {
            tokenizer: self.inner.tokenizer.clone(),
            stop: gen.stop.clone(),
            skip_special_tokens: gen.skip_special_tokens,
            logprobs: gen.params.logprobs.is_some(),
        };
        let generation = match Generation::start(&self.inner.engine, specs, settings, metrics.clone()) {
            Ok(g) => g,
            Err(e) => return respond::reject(e, &metrics),
        };
        let prefix = if shape == Shape::Chat { "chatcmpl" } else { "cmpl" };
        let plan = ResponsePlan {
            shape,
            id: format!("{prefix}-{}", uuid::Uuid::new_v4().simple()),
            created: unix_now(),
            model: self.inner.facts.served_name.clone(),
            n: gen.n,
            echo: gen.prompts.iter().map(|p| echo.then(|| p.text.clone())).collect(),
            logprobs: gen.params.logprobs.is_some(),
            include_usage: gen.include_usage,
            metrics,
            tally,
            reading,
        };
        if gen.stream {
            respond::stream(generation, plan)
        } else {
            respond::complete(generation, plan).await
        }
    }
}

/// One engine request per (prompt, choice), prompt-major. With a seed,
/// choice `j` of a prompt uses `seed + j`, so choices differ from each other
/// but every one of them is repeatable. The tokenizer's `u32` ids (prompt and
/// end of sequence) become `TokenId` here, where they enter the engine.
fn choice_specs(gen: &ValidGeneration, eos_ids: &[u32]) -> Vec<ChoiceSpec> {
    let mut specs = Vec::with_capacity(gen.prompts.len() * gen.n);
    for prompt in &gen.prompts {
        for j in 0..gen.n {
            let mut params = gen.params.clone();
            params.seed = params.seed.map(|s| s.wrapping_add(j as u64));
            specs.push(ChoiceSpec {
                request: GenerateRequest {
                    prompt: TokenId::vec(&prompt.ids),
                    params,
                    max_new_tokens: gen.max_tokens,
                    eos_ids: TokenId::vec(eos_ids),
                    // Cloning forks the grammar: every choice has its own state.
                    constraint: gen.constraint.clone(),
                },
            });
        }
    }
    specs
}

/// The request's token tally, from the access-log middleware.
type Tally = Option<Extension<Arc<TokenTally>>>;

async fn chat_completions(
    State(state): State<AppState>,
    tally: Tally,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let valid = state.accept(body).and_then(|json| validate::chat(&json, state.edge()));
    match valid {
        Ok(chat) => {
            let reading = ChatReading { mode: chat.shape, reasoning: chat.reasoning };
            state.run(chat.gen, Shape::Chat, false, Some(reading), tally).await
        }
        Err(e) => respond::reject(e, &state.inner.metrics),
    }
}

async fn completions(
    State(state): State<AppState>,
    tally: Tally,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let valid = state.accept(body).and_then(|json| validate::completion(&json, state.edge()));
    match valid {
        Ok(c) => state.run(c.gen, Shape::Completion, c.echo, None, tally).await,
        Err(e) => respond::reject(e, &state.inner.metrics),
    }
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn key_comparison() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
    }
}
