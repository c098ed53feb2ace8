//! One view of a checkpoint, whatever its format: the architectures ask for
//! tensors by their Hugging Face names and get memory-mapped host tensors.
//!
//! A directory is read as a Hugging Face model directory, a `.gguf` file as
//! GGUF; for GGUF the Hugging Face names are translated to llama.cpp's
//! (`model.layers.3.self_attn.q_proj.weight` → `blk.3.attn_q.weight`) and the
//! tensor handed back still carries the name that was asked for.

use std::path::{Path, PathBuf};

use corridor_backend::{DType, HostTensor};

use crate::config::ModelConfig;
use crate::error::LoadError;
use crate::gguf::GgufFile;
use crate::hf::HfDir;

/// Which format a checkpoint came in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointFormat {
    HuggingFace,
    Gguf,
}

enum Source {
    Hf(HfDir),
    Gguf { file: GgufFile, config: ModelConfig },
}

/// An opened checkpoint: its configuration and access to its weights.
pub struct Checkpoint {
    path: PathBuf,
    source: Source,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint").field("path", &self.path).field("format", &self.format()).finish()
    }
}

impl Checkpoint {
    /// Opens a Hugging Face model directory or a `.gguf` file.
    pub fn open(path: &Path) -> Result<Checkpoint, LoadError> {
        let meta = std::fs::metadata(path).map_err(|e| LoadError::io(path, e))?;
        let is_gguf =
            path.extension().and_then(|e| e.to_str()).is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
        let source = if meta.is_dir() {
            Source::Hf(HfDir::open(path)?)
        } else if meta.is_file() && is_gguf {
            let file = GgufFile::open(path)?;
            let config = ModelConfig::from_gguf(&file)?;
            Source::Gguf { file, config }
        } else {
            return Err(LoadError::NotACheckpoint { path: path.to_path_buf() });
        };
        let checkpoint = Checkpoint { path: path.to_path_buf(), source };
        tracing::info!(
            path = %path.display(),
            format = ?checkpoint.format(),
            arch = ?checkpoint.config().arch,
            layers = checkpoint.config().num_layers,
            mib = checkpoint.file_bytes() / (1 << 20),
            "opened checkpoint"
        );
        Ok(checkpoint)
    }

    /// The path it was opened from (the directory, or the GGUF file).
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn format(&self) -> CheckpointFormat {
        match self.source {
            Source::Hf(_) => CheckpointFormat::HuggingFace,
            Source::Gguf { .. } => CheckpointFormat::Gguf,
        }
    }

    pub fn config(&self) -> &ModelConfig {
        match &self.source {
            Source::Hf(hf) => hf.config(),
            Source::Gguf { config, .. } => config,
        }
    }

    /// The GGUF file, for readers of its metadata (the tokenizer).
    pub fn gguf(&self) -> Option<&GgufFile> {
        match &self.source {
            Source::Gguf { file, .. } => Some(file),
            Source::Hf(_) => None,
        }
    }

    /// The Hugging Face directory, for readers of its other files
    /// (`tokenizer.json`, `tokenizer_config.json`).
    pub fn dir(&self) -> Option<&Path> {
        match &self.source {
            Source::Hf(hf) => Some(hf.dir()),
            Source::Gguf { .. } => None,
        }
    }

    /// The Hugging Face directory's weight files, when it is one.
    pub fn hf(&self) -> Option<&HfDir> {
        match &self.source {
            Source::Hf(hf) => Some(hf),
            Source::Gguf { .. } => None,
        }
    }

    /// The dtype the Hugging Face config says the weights were saved in.
    pub fn torch_dtype(&self) -> Option<DType> {
        self.hf().and_then(HfDir::torch_dtype)
    }

    /// Whether the model's matrices are stored in f32 (a Hugging Face
    /// directory whose config says `float32`; a GGUF file whose first
    /// layer matrix is F32).
    pub fn matrices_f32(&self) -> bool {
        match &self.source {
            Source::Hf(hf) => hf.torch_dtype() == Some(DType::F32),
            Source::Gguf { file, .. } => {
                file.tensors()
                    .iter()
                    .find(|t| t.name.starts_with("blk.") && t.shape().len() == 2)
                    .and_then(|t| t.dtype())
                    == Some(DType::F32)
            }
        }
    }

    /// Bytes of weight files on disk (all shards, or the GGUF file).
    pub fn file_bytes(&self) -> u64 {
        match &self.source {
            Source::Hf(hf) => hf.file_bytes(),
            Source::Gguf { file, .. } => file.file_bytes(),
        }
    }

    /// Whether the checkpoint holds the tensor of that Hugging Face name.
    pub fn has_tensor(&self, hf_name: &str) -> bool {
        match &self.source {
            Source::Hf(hf) => hf.has_tensor(hf_name),
            Source::Gguf { file, .. } => match hf_to_gguf_expert(hf_name) {
                Some((g, e)) => {
                    file.tensor_info(&g).is_some_and(|t| t.shape().first().is_some_and(|&n| e < n))
                }
                None => hf_to_gguf_name(hf_name).is_some_and(|g| file.has_tensor(&g)),
            },
        }
    }

    /// The tensor of that Hugging Face name, memory-mapped, named as asked.
    pub fn tensor(&self, hf_name: &str) -> Result<HostTensor, LoadError> {
        match &self.source {
            Source::Hf(hf) => hf.tensor(hf_name),
            Source::Gguf { file, .. } => {
                let missing =
                    |why: String| LoadError::MissingTensor { file: file.path().to_path_buf(), tensor: why };
                if let Some((stacked, expert)) = hf_to_gguf_expert(hf_name) {
                    if !file.has_tensor(&stacked) {
                        return Err(missing(format!("{hf_name} (GGUF name {stacked})")));
                    }
                    return file.expert_as(&stacked, expert, hf_name);
                }
                let Some(gguf_name) = hf_to_gguf_name(hf_name) else {
                    return Err(missing(format!("{hf_name} (no GGUF equivalent)")));
                };
                if !file.has_tensor(&gguf_name) {
                    return Err(missing(format!("{hf_name} (GGUF name {gguf_name})")));
                }
                file.tensor_as(&gguf_name, hf_name)
            }
        }
    }
}

/// The llama.cpp name of a Hugging Face tensor name, for the tensors of the
/// architectures corridor runs; `None` for anything else.
pub fn hf_to_gguf_name(hf_name: &str) -> Option<String> {
    match hf_name {
        "model.embed_tokens.weight" => return Some("token_embd.weight".to_string()),
        "model.norm.weight" => return Some("output_norm.weight".to_string()),
        "lm_head.weight" => return Some("output.weight".to_string()),
        _ => {}
    }
    let rest = hf_name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    // Only a plain decimal layer number; `+1` or `01` would alias another name.
    if layer.is_empty()
        || !layer.bytes().all(|b| b.is_ascii_digit())
        || (layer.len() > 1 && layer.starts_with('0'))
    {
        return None;
    }
    let (module, kind) = rest.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    let gguf_module = match module {
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        // A mixture of experts' router.
        "mlp.gate" => "ffn_gate_inp",
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        _ => return None,
    };
    Some(format!("blk.{layer}.{gguf_module}.{kind}"))
}

/// The stacked llama.cpp tensor holding one expert of a Hugging Face expert
/// name, and the expert's index in it:
/// `model.layers.3.mlp.experts.5.up_proj.weight` → (`blk.3.ffn_up_exps.weight`, 5).
pub fn hf_to_gguf_expert(hf_name: &str) -> Option<(String, usize)> {
    let rest = hf_name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once(".mlp.experts.")?;
    let (expert, proj) = rest.split_once('.')?;
    let plain = |n: &str| {
        !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) && (n.len() == 1 || !n.starts_with('0'))
    };
    if !plain(layer) || !plain(expert) {
        return None;
    }
    let stacked = match proj {
        "gate_proj.weight" => "ffn_gate_exps",
        "up_proj.weight" => "ffn_up_exps",
        "down_proj.weight" => "ffn_down_exps",
        _ => return None,
    };
    Some((format!("blk.{layer}.{stacked}.weight"), expert.parse().ok()?))
}
