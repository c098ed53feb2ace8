//! The one error type of checkpoint loading.
//!
//! Every variant names the file it is about, and the tensor where there is
//! one, so that its one-line `Display` tells a user which file to fix or
//! replace without a backtrace.

use std::path::PathBuf;

/// Why a checkpoint (or one of its tensors) could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The operating system refused to open, stat, read or map a file.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file the checkpoint needs does not exist.
    #[error("{}: not found ({what})", path.display())]
    NotFound { path: PathBuf, what: String },
    /// A path that is neither a Hugging Face directory nor a `.gguf` file.
    #[error("{}: not a checkpoint (expected a Hugging Face model directory or a .gguf file)", path.display())]
    NotACheckpoint { path: PathBuf },
    /// The model's architecture is not one corridor runs.
    #[error(
        "{}: unknown architecture `{arch}` (supported: LlamaForCausalLM, MistralForCausalLM, \
         Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen3_5ForCausalLM, \
         Qwen3_5ForConditionalGeneration; GGUF: llama, qwen2, qwen3, qwen3moe, qwen35)",
        file.display()
    )]
    UnknownArchitecture { file: PathBuf, arch: String },
    /// A RoPE scaling scheme corridor does not implement.
    #[error(
        "{}: rope scaling `{kind}` is not supported (supported: default, linear, llama3)",
        file.display()
    )]
    UnsupportedRopeScaling { file: PathBuf, kind: String },
    /// A tensor stored in an element type corridor cannot compute with.
    #[error(
        "{}: tensor `{tensor}` is stored as {dtype}, which is not supported \
         (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)",
        file.display()
    )]
    UnsupportedDType { file: PathBuf, tensor: String, dtype: String },
    /// The file ends before something it declares.
    #[error(
        "{}: truncated: {what} needs bytes up to offset {need}, but the file has {have} bytes",
        file.display()
    )]
    Truncated { file: PathBuf, what: String, need: u64, have: u64 },
    /// The file's structure contradicts itself (bad magic, absurd counts,
    /// overlapping or misaligned data, malformed JSON header, ...).
    #[error("{}: corrupt: {detail}", file.display())]
    Corrupt { file: PathBuf, detail: String },
    /// A tensor has a shape other than the one the architecture needs.
    #[error("{}: tensor `{tensor}` has shape {found:?}, expected {expected:?}", file.display())]
    BadShape { file: PathBuf, tensor: String, expected: Vec<usize>, found: Vec<usize> },
    /// A tensor the architecture needs is not in the checkpoint.
    #[error("{}: tensor `{tensor}` is missing", file.display())]
    MissingTensor { file: PathBuf, tensor: String },
    /// The model configuration is missing a field or has an invalid value.
    #[error("{}: {message}", file.display())]
    Config { file: PathBuf, message: String },
}

impl LoadError {
    /// Wraps an I/O error with the path it happened on; a missing file
    /// becomes `NotFound` so the message says so plainly.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> LoadError {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound {
            LoadError::NotFound { path, what: "no such file or directory".to_string() }
        } else {
            LoadError::Io { path, source }
        }
    }

    /// Shorthand for a `Corrupt` error.
    pub fn corrupt(file: impl Into<PathBuf>, detail: impl Into<String>) -> LoadError {
        LoadError::Corrupt { file: file.into(), detail: detail.into() }
    }

    /// Shorthand for a `Config` error.
    pub fn config(file: impl Into<PathBuf>, message: impl Into<String>) -> LoadError {
        LoadError::Config { file: file.into(), message: message.into() }
    }
}
