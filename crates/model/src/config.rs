//! The architecture-level description of a model, resolved from whichever
//! spelling the checkpoint used (Hugging Face `config.json` in its old and new
//! spellings, or GGUF metadata).

use std::path::Path;

use corridor_backend::{DType, DeltaGeometry, RopeStyle, VHeadOrder};
use serde_json::Value;

use crate::error::LoadError;
use crate::gguf::{GgufFile, GgufValue};

/// The architectures corridor can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    /// Qwen3 attention with sparse mixture-of-experts FFNs (`moe` is set).
    Qwen3Moe,
    /// Qwen3.5: gated delta-net layers beside gated full-attention layers
    /// (`hybrid` is set).
    Qwen35,
}

/// What a layer of a hybrid model mixes tokens with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Softmax attention over the paged KV cache.
    Full,
    /// A gated delta-net: linear attention over a fixed-size state.
    Linear,
}

/// The parts of a hybrid (Qwen3.5) model that the other architectures lack.
#[derive(Clone, Debug, PartialEq)]
pub struct HybridConfig {
    /// One per layer, from `layer_types` (or `full_attention_interval`).
    pub layer_types: Vec<LayerKind>,
    /// The heads and convolution of the linear-attention layers.
    pub delta: DeltaGeometry,
    /// Dimensions of each full-attention head that RoPE rotates (the first
    /// ones; `partial_rotary_factor * head_dim`).
    pub rotary_dim: usize,
}

impl HybridConfig {
    /// Layers of each kind.
    pub fn count(&self, kind: LayerKind) -> usize {
        self.layer_types.iter().filter(|&&k| k == kind).count()
    }
}

/// The sparse FFN of a mixture-of-experts model: a router picks
/// `experts_per_token` of `num_experts` SwiGLU experts for every token, and
/// their outputs are summed with the router's softmax weights.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// Top-k: experts each token is sent to.
    pub experts_per_token: usize,
    /// Intermediate width of one expert.
    pub expert_intermediate_size: usize,
    /// Renormalize the top-k softmax weights to sum to one.
    pub norm_topk_prob: bool,
    /// Whether each layer (by index) is sparse; the others run the dense
    /// MLP of `intermediate_size`.
    pub sparse_layers: Vec<bool>,
}

impl MoeConfig {
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.sparse_layers.get(layer).copied().unwrap_or(false)
    }
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
    /// The sparse FFN of a mixture-of-experts model; `None` for dense ones.
    pub moe: Option<MoeConfig>,
    /// The linear-attention layers of a hybrid model; `None` for the others.
    pub hybrid: Option<HybridConfig>,
}

impl ModelConfig {
    /// Whether layer `layer` runs the sparse (routed) FFN.
    pub fn is_sparse_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.is_sparse(layer))
    }

    /// Layers that hold KV: every layer, or a hybrid's full-attention ones.
    pub fn kv_layers(&self) -> usize {
        self.hybrid.as_ref().map_or(self.num_layers, |h| h.count(LayerKind::Full))
    }
}

impl ModelConfig {
    /// Reads `config.json` (and `generation_config.json` when present) from
    /// a Hugging Face model directory.
    pub fn from_hf_dir(dir: &Path) -> Result<ModelConfig, LoadError> {
        let config_path = dir.join("config.json");
        let config = std::fs::read_to_string(&config_path).map_err(|e| LoadError::io(&config_path, e))?;
        let generation_path = dir.join("generation_config.json");
        let generation = match std::fs::read_to_string(&generation_path) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(LoadError::io(&generation_path, e)),
        };
        ModelConfig::from_hf_json(&config, generation.as_deref(), &config_path)
    }

    /// Parses the text of a Hugging Face `config.json`, and optionally of
    /// `generation_config.json` (whose `eos_token_id` adds end-of-sequence
    /// ids). `file` names the config in errors.
    pub fn from_hf_json(
        config: &str,
        generation: Option<&str>,
        file: &Path,
    ) -> Result<ModelConfig, LoadError> {
        let json = text_model_config(parse_object(config, file)?, file)?;
        let j = Json { obj: &json, file };
        let arch = hf_arch(&j)?;
        let hidden_size = j.req_usize("hidden_size")?;
        let num_heads = j.req_usize("num_attention_heads")?;
        if num_heads == 0 {
            return Err(LoadError::config(file, "num_attention_heads is 0"));
        }
        let head_dim = match j.opt_usize("head_dim")? {
            Some(d) => d,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(LoadError::config(
                    file,
                    format!("hidden_size {hidden_size} is not a multiple of num_attention_heads {num_heads} and head_dim is absent"),
                ))
            }
        };
        // `rope_parameters` is the newer spelling: one object holding the
        // theta and the scaling scheme; older files use `rope_theta` and a
        // separate `rope_scaling` object.
        let rope_parameters = j.opt_object("rope_parameters")?;
        let params = rope_parameters.map(|obj| Json { obj, file });
        let rope_theta = match (j.opt_f64("rope_theta")?, params.as_ref()) {
            (Some(theta), _) => theta,
            (None, Some(p)) => p.opt_f64("rope_theta")?.unwrap_or(DEFAULT_ROPE_THETA),
            (None, None) => DEFAULT_ROPE_THETA,
        };
        let rope_scaling = match (j.opt_object("rope_scaling")?, params) {
            (Some(obj), _) => hf_rope_scaling(&Json { obj, file })?,
            (None, Some(p)) => hf_rope_scaling(&p)?,
            (None, None) => None,
        };
        let mut eos_token_ids = Vec::new();
        if let Some(text) = generation {
            let generation = parse_object(text, file)?;
            eos_token_ids.extend(Json { obj: &generation, file }.token_ids("eos_token_id")?);
        }
        for id in j.token_ids("eos_token_id")? {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        let num_layers = j.req_usize("num_hidden_layers")?;
        let moe = if arch == Arch::Qwen3Moe { Some(hf_moe(&j, num_layers)?) } else { None };
        let hybrid = if arch == Arch::Qwen35 {
            let factor = match (j.opt_f64("partial_rotary_factor")?, rope_parameters) {
                (Some(f), _) => Some(f),
                (None, Some(obj)) => Json { obj, file }.opt_f64("partial_rotary_factor")?,
                (None, None) => None,
            };
            Some(hf_hybrid(&j, num_layers, head_dim, factor)?)
        } else {
            None
        };
        let config = ModelConfig {
            arch,
            vocab_size: j.req_usize("vocab_size")?,
            hidden_size,
            intermediate_size: j.req_usize("intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads: j.opt_usize("num_key_value_heads")?.unwrap_or(num_heads),
            head_dim,
            rms_norm_eps: j.opt_f64("rms_norm_eps")?.unwrap_or(DEFAULT_RMS_NORM_EPS) as f32,
            rope_theta: rope_theta as f32,
            rope_scaling,
            rope_style: RopeStyle::Half,
            max_position_embeddings: j.req_usize("max_position_embeddings")?,
            // Every one of transformers' config classes for these
            // architectures defaults to untied; the small Qwen2 models that
            // tie say so explicitly.
            tie_word_embeddings: j.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            // Qwen2 always has a bias on Q, K and V, and its config does not
            // say so; the others carry `attention_bias` (default false).
            attention_bias: arch == Arch::Qwen2 || j.opt_bool("attention_bias")?.unwrap_or(false),
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen35),
            bos_token_id: j.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids,
            moe,
            hybrid,
        };
        config.validate(file)?;
        Ok(config)
    }

    /// Builds the configuration from a GGUF file's metadata (and, where the
    /// metadata is silent, from which tensors the file holds).
    pub fn from_gguf(gguf: &GgufFile) -> Result<ModelConfig, LoadError> {
        let file = gguf.path();
        let arch_name = gguf
            .get("general.architecture")
            .and_then(GgufValue::as_str)
            .ok_or_else(|| LoadError::config(file, "general.architecture is missing"))?;
        // Mistral GGUFs are written as `llama`; they run the same code.
        let arch = match arch_name {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "qwen3moe" => Arch::Qwen3Moe,
            "qwen35" => Arch::Qwen35,
            other => {
                return Err(LoadError::UnknownArchitecture {
                    file: file.to_path_buf(),
                    arch: other.to_string(),
                })
            }
        };
        let m = Meta { gguf, prefix: arch_name };
        let hidden_size = m.req_usize("embedding_length")?;
        let num_heads = m.req_usize("attention.head_count")?;
        if num_heads == 0 {
            return Err(LoadError::config(file, format!("{arch_name}.attention.head_count is 0")));
        }
        let head_dim = match m.opt_usize("attention.key_length")? {
            Some(d) => d,
            None => hidden_size / num_heads,
        };
        let rope_theta = m.opt_f64("rope.freq_base")?.unwrap_or(DEFAULT_ROPE_THETA);
        // The embedding's row count is the logits width the model computes;
        // the token list is the fallback for a file without that tensor.
        let vocab_size = match gguf.tensor_info("token_embd.weight") {
            Some(info) => info.shape().first().copied().unwrap_or(0),
            None => match gguf.get("tokenizer.ggml.tokens").and_then(GgufValue::as_array) {
                Some(tokens) => tokens.len(),
                None => m.req_usize("vocab_size")?,
            },
        };
        let mut eos_token_ids = Vec::new();
        // llama.cpp ends generation on any of these; Llama 3 chat models end
        // turns with the end-of-turn token rather than end-of-sequence.
        for key in
            ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"]
        {
            if let Some(id) = gguf_token_id(gguf, key)? {
                if !eos_token_ids.contains(&id) {
                    eos_token_ids.push(id);
                }
            }
        }
        let rope_scaling = gguf_rope_scaling(&m, GgufRope { theta: rope_theta, head_dim })?;
        let num_layers = m.req_usize("block_count")?;
        let moe = if arch == Arch::Qwen3Moe { Some(gguf_moe(&m, num_layers)?) } else { None };
        let hybrid = if arch == Arch::Qwen35 { Some(gguf_hybrid(&m, num_layers, head_dim)?) } else { None };
        let config = ModelConfig {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size: m.req_usize("feed_forward_length")?,
            num_layers,
            num_heads,
            num_kv_heads: m.opt_usize("attention.head_count_kv")?.unwrap_or(num_heads),
            head_dim,
            rms_norm_eps: m.req_f64("attention.layer_norm_rms_epsilon")? as f32,
            rope_theta: rope_theta as f32,
            rope_scaling,
            // llama.cpp's converter permutes Llama's Q and K rows for the
            // interleaved rotation; Qwen files keep the Hugging Face layout.
            rope_style: if arch == Arch::Llama { RopeStyle::Interleaved } else { RopeStyle::Half },
            max_position_embeddings: m.req_usize("context_length")?,
            tie_word_embeddings: !gguf.has_tensor("output.weight"),
            attention_bias: arch == Arch::Qwen2 || gguf.has_tensor("blk.0.attn_q.bias"),
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen35)
                || gguf.has_tensor("blk.0.attn_q_norm.weight"),
            bos_token_id: gguf_token_id(gguf, "tokenizer.ggml.bos_token_id")?,
            eos_token_ids,
            moe,
            hybrid,
        };
        config.validate(file)?;
        Ok(config)
    }

    /// Refuses shapes no forward pass can run (zero sizes, heads that do not
    /// group evenly), so that the architectures may assume they are sane.
    pub fn validate(&self, file: &Path) -> Result<(), LoadError> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(LoadError::config(file, format!("{name} is 0")));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(LoadError::config(
                file,
                format!(
                    "{} attention heads cannot be shared evenly by {} key/value heads",
                    self.num_heads, self.num_kv_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(LoadError::config(
                file,
                format!("head_dim {} is odd; RoPE needs pairs", self.head_dim),
            ));
        }
        if let Some(m) = &self.moe {
            if m.sparse_layers.iter().any(|&s| s) {
                if m.num_experts == 0 || m.expert_intermediate_size == 0 {
                    return Err(LoadError::config(file, "a sparse layer needs experts of non-zero width"));
                }
                if m.experts_per_token == 0 || m.experts_per_token > m.num_experts {
                    return Err(LoadError::config(
                        file,
                        format!(
                            "num_experts_per_tok {} must be between 1 and num_experts {}",
                            m.experts_per_token, m.num_experts
                        ),
                    ));
                }
            }
        }
        if let Some(h) = &self.hybrid {
            let d = &h.delta;
            if h.layer_types.len() != self.num_layers {
                return Err(LoadError::config(
                    file,
                    format!("{} layer types for {} layers", h.layer_types.len(), self.num_layers),
                ));
            }
            if [d.k_heads, d.v_heads, d.k_dim, d.v_dim, d.conv_kernel].contains(&0) {
                return Err(LoadError::config(file, format!("a linear-attention size is 0: {d:?}")));
            }
            if !d.v_heads.is_multiple_of(d.k_heads) {
                return Err(LoadError::config(
                    file,
                    format!(
                        "linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
                        d.v_heads, d.k_heads
                    ),
                ));
            }
            if h.rotary_dim == 0 || !h.rotary_dim.is_multiple_of(2) || h.rotary_dim > self.head_dim {
                return Err(LoadError::config(
                    file,
                    format!("{} rotated dimensions of a head of {}", h.rotary_dim, self.head_dim),
                ));
            }
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(LoadError::config(
                file,
                format!("rms_norm_eps {} is not a positive number", self.rms_norm_eps),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(LoadError::config(
                file,
                format!("rope_theta {} is not a positive number", self.rope_theta),
            ));
        }
        Ok(())
    }
}

/// transformers' default RoPE base for every architecture here.
const DEFAULT_ROPE_THETA: f64 = 10_000.0;
/// transformers' default `rms_norm_eps` for Llama, Mistral and Qwen.
const DEFAULT_RMS_NORM_EPS: f64 = 1e-6;

fn parse_object(text: &str, file: &Path) -> Result<serde_json::Map<String, Value>, LoadError> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(obj)) => Ok(obj),
        Ok(_) => Err(LoadError::config(file, "expected a JSON object")),
        Err(e) => Err(LoadError::config(file, format!("invalid JSON: {e}"))),
    }
}

/// Multimodal wrappers whose language model corridor runs: the released
/// Qwen3.5 checkpoints are `Qwen3_5ForConditionalGeneration`, a vision tower
/// beside a `qwen3_5_text` model whose config is `text_config` and whose
/// tensors are `model.language_model.*`.
const TEXT_WRAPPERS: [&str; 1] = ["Qwen3_5ForConditionalGeneration"];

/// The config of the text model: a wrapper's `text_config`, with any key of
/// the wrapper it lacks (such as `tie_word_embeddings`), or the config as it is.
fn text_model_config(
    mut json: serde_json::Map<String, Value>,
    file: &Path,
) -> Result<serde_json::Map<String, Value>, LoadError> {
    let first =
        json.get("architectures").and_then(Value::as_array).and_then(|a| a.first()).and_then(Value::as_str);
    let wrapped = first.is_some_and(|a| TEXT_WRAPPERS.contains(&a))
        || (first.is_none() && json.get("model_type").and_then(Value::as_str) == Some("qwen3_5"));
    if !wrapped {
        return Ok(json);
    }
    let Some(Value::Object(mut text)) = json.remove("text_config") else {
        return Err(LoadError::config(file, "a multimodal config without a `text_config` object"));
    };
    for (key, value) in json {
        if !matches!(key.as_str(), "architectures" | "model_type" | "vision_config") {
            text.entry(key).or_insert(value);
        }
    }
    text.entry("model_type".to_string()).or_insert(Value::String("qwen3_5_text".into()));
    Ok(text)
}

/// The architecture, from `architectures[0]` or else `model_type`.
fn hf_arch(j: &Json<'_>) -> Result<Arch, LoadError> {
    let unknown =
        |arch: &str| LoadError::UnknownArchitecture { file: j.file.to_path_buf(), arch: arch.to_string() };
    if let Some(list) = j.obj.get("architectures").and_then(Value::as_array) {
        if let Some(first) = list.first() {
            let name = first
                .as_str()
                .ok_or_else(|| LoadError::config(j.file, "architectures[0] is not a string"))?;
            return match name {
                "LlamaForCausalLM" => Ok(Arch::Llama),
                "MistralForCausalLM" => Ok(Arch::Mistral),
                "Qwen2ForCausalLM" => Ok(Arch::Qwen2),
                "Qwen3ForCausalLM" => Ok(Arch::Qwen3),
                "Qwen3MoeForCausalLM" => Ok(Arch::Qwen3Moe),
                "Qwen3_5ForCausalLM" => Ok(Arch::Qwen35),
                other => Err(unknown(other)),
            };
        }
    }
    match j.obj.get("model_type").and_then(Value::as_str) {
        Some("llama") => Ok(Arch::Llama),
        Some("mistral") => Ok(Arch::Mistral),
        Some("qwen2") => Ok(Arch::Qwen2),
        Some("qwen3") => Ok(Arch::Qwen3),
        Some("qwen3_moe") => Ok(Arch::Qwen3Moe),
        Some("qwen3_5_text") => Ok(Arch::Qwen35),
        Some(other) => Err(unknown(other)),
        None => Err(LoadError::config(j.file, "neither `architectures` nor `model_type` is given")),
    }
}

/// The sparse FFN of a `qwen3_moe` config, with transformers' defaults for
/// absent keys. A layer is sparse unless `mlp_only_layers` lists it, and then
/// only every `decoder_sparse_step`-th one (layers `step-1, 2*step-1, ...`).
fn hf_moe(j: &Json<'_>, num_layers: usize) -> Result<MoeConfig, LoadError> {
    // Hub configs say `num_experts`; transformers 5 writes `num_local_experts`.
    let num_experts = match j.opt_usize("num_experts")? {
        Some(n) => n,
        None => j.opt_usize("num_local_experts")?.unwrap_or(128),
    };
    let experts_per_token = j.opt_usize("num_experts_per_tok")?.unwrap_or(8);
    let expert_intermediate_size = j.opt_usize("moe_intermediate_size")?.unwrap_or(768);
    let norm_topk_prob = j.opt_bool("norm_topk_prob")?.unwrap_or(false);
    let step = j.opt_usize("decoder_sparse_step")?.unwrap_or(1);
    let mlp_only = match j.get("mlp_only_layers") {
        None => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_u64()
                    .map(|n| n as usize)
                    .ok_or_else(|| j.bad("mlp_only_layers", "a list of layer indices", v))
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(v) => return Err(j.bad("mlp_only_layers", "a list of layer indices", v)),
    };
    if step == 0 {
        return Err(LoadError::config(j.file, "decoder_sparse_step is 0"));
    }
    let sparse_layers =
        (0..num_layers).map(|i| !mlp_only.contains(&i) && num_experts > 0 && (i + 1) % step == 0).collect();
    Ok(MoeConfig { num_experts, experts_per_token, expert_intermediate_size, norm_topk_prob, sparse_layers })
}

/// The linear-attention side of a `qwen3_5_text` config, with transformers'
/// defaults for absent keys: `layer_types`, or else every
/// `full_attention_interval`-th layer (default 4) full and the rest linear;
/// a quarter of each attention head rotated unless `partial_rotary_factor`
/// says otherwise.
fn hf_hybrid(
    j: &Json<'_>,
    num_layers: usize,
    head_dim: usize,
    partial_rotary_factor: Option<f64>,
) -> Result<HybridConfig, LoadError> {
    let layer_types = match j.get("layer_types") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match v.as_str() {
                Some("full_attention") => Ok(LayerKind::Full),
                Some("linear_attention") => Ok(LayerKind::Linear),
                _ => Err(j.bad("layer_types", "\"full_attention\" or \"linear_attention\" per layer", v)),
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(v) => return Err(j.bad("layer_types", "a list of layer types", v)),
        None => {
            let every = j.opt_usize("full_attention_interval")?.unwrap_or(4);
            if every == 0 {
                return Err(LoadError::config(j.file, "full_attention_interval is 0"));
            }
            (0..num_layers)
                .map(|i| if (i + 1) % every == 0 { LayerKind::Full } else { LayerKind::Linear })
                .collect()
        }
    };
    let factor = partial_rotary_factor.unwrap_or(0.25);
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(LoadError::config(j.file, format!("partial_rotary_factor {factor} is not in (0, 1]")));
    }
    Ok(HybridConfig {
        layer_types,
        delta: DeltaGeometry {
            k_heads: j.opt_usize("linear_num_key_heads")?.unwrap_or(16),
            v_heads: j.opt_usize("linear_num_value_heads")?.unwrap_or(32),
            k_dim: j.opt_usize("linear_key_head_dim")?.unwrap_or(128),
            v_dim: j.opt_usize("linear_value_head_dim")?.unwrap_or(128),
            conv_kernel: j.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
            v_order: VHeadOrder::Grouped,
        },
        // transformers truncates: int(head_dim * factor).
        rotary_dim: (head_dim as f64 * factor) as usize,
    })
}

/// The scaling scheme of a `rope_scaling` or `rope_parameters` object.
fn hf_rope_scaling(p: &Json<'_>) -> Result<Option<RopeScaling>, LoadError> {
    // Files say `rope_type`, older ones `type`; some carry both.
    let kind = match p.obj.get("rope_type").or_else(|| p.obj.get("type")) {
        None | Some(Value::Null) => "default",
        Some(Value::String(s)) => s.as_str(),
        Some(other) => return Err(LoadError::config(p.file, format!("rope type {other} is not a string"))),
    };
    match kind {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear { factor: p.req_f64("factor")? as f32 })),
        "llama3" => Ok(Some(RopeScaling::Llama3 {
            factor: p.req_f64("factor")? as f32,
            low_freq_factor: p.req_f64("low_freq_factor")? as f32,
            high_freq_factor: p.req_f64("high_freq_factor")? as f32,
            original_max_position_embeddings: p.req_usize("original_max_position_embeddings")?,
        })),
        other => {
            Err(LoadError::UnsupportedRopeScaling { file: p.file.to_path_buf(), kind: other.to_string() })
        }
    }
}

/// Typed reads from one JSON object, with errors naming the file and key.
struct Json<'a> {
    obj: &'a serde_json::Map<String, Value>,
    file: &'a Path,
}

impl<'a> Json<'a> {
    /// The value of `key`, treating an explicit `null` as absent.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn bad(&self, key: &str, want: &str, got: &Value) -> LoadError {
        LoadError::config(self.file, format!("`{key}` should be {want}, found {got}"))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, LoadError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| self.bad(key, "a non-negative integer", v)),
        }
    }

    fn req_usize(&self, key: &str) -> Result<usize, LoadError> {
        self.opt_usize(key)?.ok_or_else(|| LoadError::config(self.file, format!("`{key}` is missing")))
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>, LoadError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| self.bad(key, "a number", v)),
        }
    }

    fn req_f64(&self, key: &str) -> Result<f64, LoadError> {
        self.opt_f64(key)?.ok_or_else(|| LoadError::config(self.file, format!("`{key}` is missing")))
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>, LoadError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.bad(key, "true or false", v)),
        }
    }

    fn opt_object(&self, key: &str) -> Result<Option<&'a serde_json::Map<String, Value>>, LoadError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_object().map(Some).ok_or_else(|| self.bad(key, "an object", v)),
        }
    }

    /// A token id field that may be absent, null, one integer or a list.
    fn token_ids(&self, key: &str) -> Result<Vec<u32>, LoadError> {
        let one = |v: &Value| {
            v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| self.bad(key, "a token id", v))
        };
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items.iter().map(one).collect(),
            Some(v) => Ok(vec![one(v)?]),
        }
    }
}

/// Typed reads of `{arch}.*` GGUF metadata, with errors naming the key.
struct Meta<'a> {
    gguf: &'a GgufFile,
    prefix: &'a str,
}

impl Meta<'_> {
    fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.prefix)
    }

    fn opt_usize(&self, suffix: &str) -> Result<Option<usize>, LoadError> {
        let key = self.key(suffix);
        match self.gguf.get(&key) {
            None => Ok(None),
            Some(v) => v.as_u64().and_then(|n| usize::try_from(n).ok()).map(Some).ok_or_else(|| {
                LoadError::config(
                    self.gguf.path(),
                    format!("{key} should be a non-negative integer, found {v:?}"),
                )
            }),
        }
    }

    fn req_usize(&self, suffix: &str) -> Result<usize, LoadError> {
        let key = self.key(suffix);
        self.opt_usize(suffix)?
            .ok_or_else(|| LoadError::config(self.gguf.path(), format!("{key} is missing")))
    }

    fn opt_f64(&self, suffix: &str) -> Result<Option<f64>, LoadError> {
        let key = self.key(suffix);
        match self.gguf.get(&key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                LoadError::config(self.gguf.path(), format!("{key} should be a number, found {v:?}"))
            }),
        }
    }

    fn req_f64(&self, suffix: &str) -> Result<f64, LoadError> {
        let key = self.key(suffix);
        self.opt_f64(suffix)?.ok_or_else(|| LoadError::config(self.gguf.path(), format!("{key} is missing")))
    }

    fn opt_str(&self, suffix: &str) -> Option<&str> {
        self.gguf.get(&self.key(suffix)).and_then(GgufValue::as_str)
    }
}

/// The sparse FFN of a `qwen3moe` GGUF. A layer is sparse where the file
/// holds its router (`ffn_gate_inp`), which is how llama.cpp's converter
/// writes the layers a config marks sparse. llama.cpp always renormalizes
/// this architecture's top-k weights, and the converter writes no key for it,
/// so the file is read that way.
fn gguf_moe(m: &Meta<'_>, num_layers: usize) -> Result<MoeConfig, LoadError> {
    Ok(MoeConfig {
        num_experts: m.req_usize("expert_count")?,
        experts_per_token: m.req_usize("expert_used_count")?,
        expert_intermediate_size: m.req_usize("expert_feed_forward_length")?,
        norm_topk_prob: true,
        sparse_layers: (0..num_layers)
            .map(|i| m.gguf.has_tensor(&format!("blk.{i}.ffn_gate_inp.weight")))
            .collect(),
    })
}

/// The linear-attention side of a `qwen35` GGUF, in llama.cpp's keys: the
/// key heads are `ssm.group_count` of `ssm.state_size`, the value heads
/// `ssm.time_step_rank` sharing `ssm.inner_size`; every
/// `full_attention_interval`-th layer is full attention; RoPE turns
/// `rope.dimension_count` dimensions of a head. llama.cpp's converter stores
/// the value heads tiled (see [`VHeadOrder`]).
fn gguf_hybrid(m: &Meta<'_>, num_layers: usize, head_dim: usize) -> Result<HybridConfig, LoadError> {
    let v_heads = m.req_usize("ssm.time_step_rank")?;
    let inner = m.req_usize("ssm.inner_size")?;
    if v_heads == 0 || !inner.is_multiple_of(v_heads) {
        return Err(LoadError::config(
            m.gguf.path(),
            format!("ssm.inner_size {inner} is not whole heads of ssm.time_step_rank {v_heads}"),
        ));
    }
    let every = m.opt_usize("full_attention_interval")?.unwrap_or(4);
    if every == 0 {
        return Err(LoadError::config(m.gguf.path(), "full_attention_interval is 0"));
    }
    Ok(HybridConfig {
        layer_types: (0..num_layers)
            .map(|i| if (i + 1) % every == 0 { LayerKind::Full } else { LayerKind::Linear })
            .collect(),
        delta: DeltaGeometry {
            k_heads: m.req_usize("ssm.group_count")?,
            v_heads,
            k_dim: m.req_usize("ssm.state_size")?,
            v_dim: inner / v_heads,
            conv_kernel: m.req_usize("ssm.conv_kernel")?,
            v_order: VHeadOrder::Tiled,
        },
        rotary_dim: m.opt_usize("rope.dimension_count")?.unwrap_or(head_dim / 4),
    })
}

fn gguf_token_id(gguf: &GgufFile, key: &str) -> Result<Option<u32>, LoadError> {
    match gguf.get(key) {
        None => Ok(None),
        Some(v) => v.as_u64().and_then(|n| u32::try_from(n).ok()).map(Some).ok_or_else(|| {
            LoadError::config(gguf.path(), format!("{key} should be a token id, found {v:?}"))
        }),
    }
}

/// What RoPE scaling inference needs to know besides the metadata.
#[derive(Clone, Copy)]
struct GgufRope {
    theta: f64,
    head_dim: usize,
}

/// RoPE scaling from GGUF metadata, or from a `rope_freqs.weight` tensor.
///
/// llama.cpp's converter does not write Llama 3's scaling parameters; it
/// bakes them into per-frequency divisors stored as `rope_freqs.weight`. The
/// parameters are recovered by recomputing those divisors from the settings
/// every Llama 3.x release uses and checking that they match.
fn gguf_rope_scaling(m: &Meta<'_>, rope: GgufRope) -> Result<Option<RopeScaling>, LoadError> {
    let file = m.gguf.path();
    let kind = m.opt_str("rope.scaling.type");
    match kind {
        None | Some("none") => {}
        Some("linear") => {
            let factor = m.req_f64("rope.scaling.factor")?;
            return Ok(Some(RopeScaling::Linear { factor: factor as f32 }));
        }
        Some(other) => {
            return Err(LoadError::UnsupportedRopeScaling {
                file: file.to_path_buf(),
                kind: other.to_string(),
            })
        }
    }
    // The older spelling of linear scaling.
    if let Some(factor) = m.opt_f64("rope.scale_linear")? {
        if factor != 1.0 {
            return Ok(Some(RopeScaling::Linear { factor: factor as f32 }));
        }
    }
    if !m.gguf.has_tensor("rope_freqs.weight") {
        return Ok(None);
    }
    let tensor = m.gguf.tensor("rope_freqs.weight")?;
    let unsupported = |why: &str| LoadError::UnsupportedRopeScaling {
        file: file.to_path_buf(),
        kind: format!("rope_freqs.weight ({why})"),
    };
    if tensor.dtype != DType::F32 {
        return Err(unsupported("not stored as F32"));
    }
    let divisors: Vec<f64> = tensor
        .data
        .bytes()
        .chunks_exact(4)
        .map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
        .collect();
    if divisors.len() != rope.head_dim / 2 {
        return Err(unsupported("length is not head_dim / 2"));
    }
    let factor = divisors.iter().copied().fold(1.0, f64::max);
    if factor <= 1.0 + 1e-6 {
        return Ok(None);
    }
    let candidate =
        Llama3Params { factor, low_freq_factor: 1.0, high_freq_factor: 4.0, original_context: 8192.0 };
    let matches = divisors
        .iter()
        .enumerate()
        .all(|(i, &d)| (candidate.divisor(rope, i) - d).abs() <= 1e-3 * d.abs().max(1.0));
    if !matches {
        return Err(unsupported("per-frequency divisors that match no llama3 setting"));
    }
    Ok(Some(RopeScaling::Llama3 {
        factor: factor as f32,
        low_freq_factor: candidate.low_freq_factor as f32,
        high_freq_factor: candidate.high_freq_factor as f32,
        original_max_position_embeddings: candidate.original_context as usize,
    }))
}

/// Llama 3 RoPE scaling settings, in f64 for comparing against a file.
struct Llama3Params {
    factor: f64,
    low_freq_factor: f64,
    high_freq_factor: f64,
    original_context: f64,
}

impl Llama3Params {
    /// The divisor applied to frequency `i` (of `head_dim / 2`): 1 for short
    /// wavelengths, `factor` for long ones, a smooth blend in between.
    fn divisor(&self, rope: GgufRope, i: usize) -> f64 {
        let freq = rope.theta.powf(-((2 * i) as f64) / rope.head_dim as f64);
        let wavelen = 2.0 * std::f64::consts::PI / freq;
        let low_freq_wavelen = self.original_context / self.low_freq_factor;
        let high_freq_wavelen = self.original_context / self.high_freq_factor;
        if wavelen < high_freq_wavelen {
            1.0
        } else if wavelen > low_freq_wavelen {
            self.factor
        } else {
            let smooth = (self.original_context / wavelen - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            1.0 / ((1.0 - smooth) / self.factor + smooth)
        }
    }
}
