//! Checkpoint loading (Hugging Face safetensors directories and GGUF files)
//! and the model architectures, written once against the backend trait.
//!
//! Invariant: this crate knows nothing about scheduling, requests or HTTP.

pub mod config;
