//! The admin surface behind the API key: which layout a flipping group
//! serves, and a flip asked by hand (`--phase-flip manual` or `auto`).
//!
//! `GET /v1/admin/layout` answers the serving layout, the mode and the flip
//! counters; `POST /v1/admin/layout` with `{"layout": "tp"}` or `"pp"` flips
//! between two engine steps and answers how the flip ended (a flip that the
//! ranks abandoned is still a 200: serving went on in the old layout, and the
//! body says why).

use crate::error::ApiError;
use crate::http::AppState;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use corridor_engine::flips::{FlipError, FlipRecord, FlipStats};
use corridor_engine::phase::{FlipVerdict, Phase};
use serde_json::{json, Value};

/// The flip counters and serving layout as JSON (also in `/v1/memory` and
/// `/v1/engine/stats`).
pub fn layout_json(f: &FlipStats) -> Value {
    json!({
        "serving": f.serving.map(|p| p.to_string()),
        "phase_flip": f.mode.to_string(),
        "flips": {
            "to_tp": f.to_tensor,
            "to_pp": f.to_pipeline,
            "abandoned": f.abandoned.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "bytes_moved": f.bytes_moved.get(),
            "requests_carried": f.requests_carried,
            "seconds": f.duration_sum.as_secs_f64(),
            "disabled": f.disabled,
            "last": f.last.as_ref().map(record_json),
        },
    })
}

/// One flip as JSON.
pub fn record_json(r: &FlipRecord) -> Value {
    let (committed, reason, moved, local, waves) = match &r.verdict {
        FlipVerdict::Committed(d) => (true, None, d.sent.get(), d.local.get(), d.waves),
        FlipVerdict::Abandoned(why) => (false, Some(why.to_string()), 0, 0, 0),
    };
    json!({
        "from": r.from.to_string(),
        "to": r.to.to_string(),
        "trigger": r.trigger,
        "committed": committed,
        "reason": reason,
        "bytes_moved": moved,
        "bytes_local": local,
        "pages": r.pages,
        "requests": r.requests,
        "waves": waves,
        "wave_layers": r.wave_layers,
        "staging_bytes": r.staging.get(),
        "duration_ms": r.duration.as_secs_f64() * 1e3,
        "epoch": r.epoch,
    })
}

/// `GET /v1/admin/layout`.
pub async fn get_layout(State(state): State<AppState>) -> Response {
    Json(layout_json(&state.engine().stats().flips)).into_response()
}

/// `POST /v1/admin/layout`: `{"layout": "tp" | "pp"}`.
pub async fn post_layout(
    State(state): State<AppState>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let value: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::invalid_body(format!("the body is not JSON: {e}")))?;
    let bad =
        |message: String| ApiError::InvalidRequest { message, param: Some("layout".into()), code: None };
    let to: Phase = match value.get("layout") {
        Some(Value::String(s)) => s.parse().map_err(bad)?,
        Some(other) => return Err(bad(format!("`layout` must be \"tp\" or \"pp\", not {other}"))),
        None => return Err(bad("`layout` is required: \"tp\" or \"pp\"".into())),
    };
    let engine = state.engine().clone();
    let outcome = tokio::task::spawn_blocking(move || engine.flip(to, None))
        .await
        .map_err(|e| ApiError::Internal { message: format!("the flip task failed: {e}") })?;
    match outcome {
        Ok(record) => Ok(Json(record_json(&record)).into_response()),
        Err(e @ FlipError::NotFlipping) => Err(bad(e.to_string())),
        Err(e @ (FlipError::AlreadyServing(_) | FlipError::Disabled(_))) => {
            Err(ApiError::Conflict { message: e.to_string(), param: Some("layout".into()) })
        }
        Err(e @ FlipError::Stopped) => Err(ApiError::Unavailable { message: e.to_string() }),
        Err(e @ FlipError::Failed(_)) => Err(ApiError::Internal { message: e.to_string() }),
    }
}
