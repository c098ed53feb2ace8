//! The OpenAI-compatible HTTP server, with the tokenizer and chat templates.
//!
//! Invariant: only this crate knows JSON request shapes and HTTP.
//!
//! A request flows `http` (routes, auth, body limit) → `validate` (raw JSON
//! to a typed request, every limit and every 400) → `generate` (one engine
//! request per choice; detokenization and stop strings) → `respond` (a JSON
//! body or server-sent events). `error` maps every failure to HTTP in one
//! place; `access` writes one log line per request; `defaults` resolves the sampling values a request leaves out;
//! `metrics` renders `/metrics`; `serve` binds and shuts down.

pub mod boot;
pub mod template;
pub mod tokenizer;

pub mod access;
pub mod admin;
pub mod api;
pub mod defaults;
pub mod error;
pub mod generate;
pub mod grammar;
pub mod http;
pub mod metrics;
pub mod respond;
pub mod serve;
pub mod stop;
pub mod tools;
pub mod validate;

pub use error::{ApiError, ServerError};
pub use http::{router, AppState, StateOptions};
pub use serve::{bind, run, run_on, run_until, serve_while_loading, shutdown_signal, ServerConfig};
pub use validate::Limits;
