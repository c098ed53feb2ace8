//! Checkpoint loading (Hugging Face safetensors directories and GGUF files)
//! and the model architectures, written once against the backend trait.
//!
//! Invariant: this crate knows nothing about scheduling, requests or HTTP.

pub mod checkpoint;
pub mod config;
pub mod error;
pub mod gguf;
pub mod greedy;
pub mod hf;
pub mod layout;
pub mod llama;
mod models;
pub mod qwen3_5;
pub mod rope;

pub use checkpoint::Checkpoint;
pub use config::{Arch, HybridConfig, LayerKind, ModelConfig, MoeConfig, RopeScaling};
pub use llama::{KvCache, ModelError, StepInput, Workspace};
pub use models::Model;
