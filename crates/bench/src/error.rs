//! Why a bench run could not run at all.
//!
//! Failures of single requests are not errors of the run: they are measured and reported by kind
//! (see [`crate::ErrorKind`]). A [`BenchError`] means the run could not start (bad arguments, the
//! server is unreachable or rejects even a plain request) or its results could not be written.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("invalid --{name}: {reason}")]
    InvalidArgument { name: &'static str, reason: String },

    #[error("cannot reach the server at {url}: {message}")]
    Unreachable { url: String, message: String },

    #[error("the server at {url} rejected a plain streaming request ({kind}): {message}")]
    Preflight { url: String, kind: String, message: String },

    #[error("cannot write the {what} to {path}: {source}")]
    WriteOutput {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}
