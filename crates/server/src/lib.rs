//! The OpenAI-compatible HTTP server, with the tokenizer and chat templates.
//!
//! Invariant: only this crate knows JSON request shapes and HTTP.
