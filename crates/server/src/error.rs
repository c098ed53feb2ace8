//! Every way a request can fail, and the one place that maps them to HTTP.
//!
//! Clients read failures as the OpenAI error object
//! `{"error": {"message", "type", "param", "code"}}` (a flat object breaks
//! openai-node, which reads only `error.message`). The status codes follow
//! OpenAI: 400 for anything the client sent wrong, 401 for a missing or wrong
//! key, 404 for an unknown model or route, 413 for an oversized body, 503
//! when the engine is gone or shutting down, and 500 only for faults of the
//! server itself. A client mistake is never a 500.
//!
//! A completion or chat request that names a model this server does not
//! serve gets 404 `model_not_found` with `param: "model"`, exactly like
//! `GET /v1/models/{id}` for the same name, as OpenAI does.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// A failed request, with what the client needs to fix it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or a field is out of range. `param` names
    /// the field as the client spelled it (`messages[0].content`, `stop`).
    #[error("{message}")]
    InvalidRequest { message: String, param: Option<String>, code: Option<&'static str> },
    /// The prompt with its requested output cannot fit the context (or the
    /// whole KV pool).
    #[error("{message}")]
    ContextLengthExceeded { message: String, param: &'static str },
    /// The request names a model this server does not serve.
    #[error("The model `{model}` does not exist; this server serves `{served}`.")]
    ModelNotFound { model: String, served: String },
    /// No or the wrong API key.
    #[error("Invalid or missing API key: send `Authorization: Bearer <key>`.")]
    Unauthorized,
    /// No route at this path.
    #[error("No route for {method} {path}.")]
    RouteNotFound { method: String, path: String },
    /// The body is larger than the server accepts.
    #[error("The request body exceeds the limit of {limit_bytes} bytes.")]
    BodyTooLarge { limit_bytes: usize },
    /// The engine has stopped or is shutting down; the request was not
    /// (fully) served.
    #[error("{message}")]
    Unavailable { message: String },
    /// The request is well formed but the server's state refuses it now
    /// (a flip to the layout that already serves).
    #[error("{message}")]
    Conflict { message: String, param: Option<String> },
    /// A fault of the server itself (never caused by the request's content).
    #[error("{message}")]
    Internal { message: String },
}

/// The inner object of the OpenAI error body.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorObject {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

/// `{"error": {...}}`, the body of every error response and of an in-stream
/// error event.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorBody {
    pub error: ErrorObject,
}

impl ApiError {
    /// A 400 for `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError::InvalidRequest { message: message.into(), param: Some(param.into()), code: None }
    }

    /// A 400 that concerns the request as a whole (no single parameter).
    pub fn invalid_body(message: impl Into<String>) -> ApiError {
        ApiError::InvalidRequest { message: message.into(), param: None, code: None }
    }

    /// The HTTP status this error is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest { .. } | ApiError::ContextLengthExceeded { .. } => {
                StatusCode::BAD_REQUEST
            }
            ApiError::ModelNotFound { .. } | ApiError::RouteNotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Conflict { .. } => StatusCode::CONFLICT,
            ApiError::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI error object for this error.
    pub fn body(&self) -> ErrorBody {
        let (kind, param, code) = match self {
            ApiError::InvalidRequest { param, code, .. } => ("invalid_request_error", param.clone(), *code),
            ApiError::ContextLengthExceeded { param, .. } => {
                ("invalid_request_error", Some((*param).to_string()), Some("context_length_exceeded"))
            }
            ApiError::ModelNotFound { .. } => {
                ("invalid_request_error", Some("model".to_string()), Some("model_not_found"))
            }
            ApiError::Unauthorized => ("authentication_error", None, Some("invalid_api_key")),
            ApiError::RouteNotFound { .. } => ("invalid_request_error", None, Some("not_found")),
            ApiError::BodyTooLarge { .. } => ("invalid_request_error", None, Some("request_too_large")),
            ApiError::Unavailable { .. } => ("server_error", None, Some("service_unavailable")),
            ApiError::Conflict { param, .. } => ("invalid_request_error", param.clone(), Some("conflict")),
            ApiError::Internal { .. } => ("server_error", None, None),
        };
        ErrorBody { error: ErrorObject { message: self.to_string(), kind, param, code } }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status().is_server_error() {
            tracing::warn!(status = self.status().as_u16(), "request failed: {self}");
        }
        let mut response = (self.status(), axum::Json(self.body())).into_response();
        if matches!(self, ApiError::Unauthorized) {
            response
                .headers_mut()
                .insert(axum::http::header::WWW_AUTHENTICATE, axum::http::HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// Why the server could not start or stopped with a failure.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The address could not be bound (in use, or not allowed).
    #[error("cannot listen on {addr}: {error}{hint}")]
    Bind {
        addr: String,
        /// Part of the message rather than a source, so the hint comes last.
        error: std::io::Error,
        /// What to do about it, when the cause is a common one.
        hint: &'static str,
    },
    /// The accept loop failed.
    #[error("the HTTP server failed: {source}")]
    Serve {
        #[source]
        source: std::io::Error,
    },
    /// The configuration is unusable (e.g. an empty served model name).
    #[error("invalid server configuration: {message}")]
    Config { message: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_client_mistake_is_a_4xx() {
        let mistakes = [
            ApiError::invalid("temperature", "bad"),
            ApiError::invalid_body("bad json"),
            ApiError::ContextLengthExceeded { message: "too long".into(), param: "messages" },
            ApiError::ModelNotFound { model: "x".into(), served: "y".into() },
            ApiError::Unauthorized,
            ApiError::BodyTooLarge { limit_bytes: 1 },
        ];
        for e in mistakes {
            assert!(e.status().is_client_error(), "{e:?} -> {}", e.status());
        }
    }

    #[test]
    fn body_names_param_and_code() {
        let b = ApiError::ContextLengthExceeded { message: "m".into(), param: "prompt" }.body();
        assert_eq!(b.error.param.as_deref(), Some("prompt"));
        assert_eq!(b.error.code, Some("context_length_exceeded"));
        assert_eq!(b.error.kind, "invalid_request_error");
        let json = serde_json::to_value(ApiError::Unauthorized.body()).expect("serializes");
        assert_eq!(json["error"]["type"], "authentication_error");
        assert!(json["error"]["param"].is_null());
    }
}
