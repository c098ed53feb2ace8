//! The architecture-level description of a model, resolved from whichever
//! spelling the checkpoint used (Hugging Face `config.json` in its old and new
//! spellings, or GGUF metadata).

use corridor_backend::RopeStyle;

/// The architectures corridor can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

/// RoPE frequency scaling.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.1 `rope_type: "llama3"`: low frequencies divided by `factor`,
    /// high frequencies kept, a smooth ramp in between.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
    /// `rope_type: "linear"`: every frequency divided by `factor`.
    Linear { factor: f32 },
}

/// Everything the forward pass needs to know about a model's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    /// Explicit in Qwen3; otherwise `hidden_size / num_heads`.
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    /// How Q and K dimensions pair up under RoPE: `Half` for Hugging Face
    /// checkpoints, `Interleaved` for GGUF Llama files (whose Q/K are permuted).
    pub rope_style: RopeStyle,
    /// The context length the model was trained for.
    pub max_position_embeddings: usize,
    /// The output projection reuses the embedding table.
    pub tie_word_embeddings: bool,
    /// Q, K and V projections carry a bias (Qwen2).
    pub attention_bias: bool,
    /// Per-head RMSNorm on Q and K before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Token ids from the model config (tokenizer files may add more).
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}
