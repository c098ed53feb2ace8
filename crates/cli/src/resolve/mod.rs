//! Models by name: what `--model` means when it is not a path that exists.
//!
//! The order is fixed so that the same words always mean the same model:
//! 1. a local path that exists is used as it is;
//! 2. `ollama:NAME[:TAG]` (or a bare `NAME:TAG` with no `/`) is looked up in
//!    ollama's local store;
//! 3. `org/name[:QUANT]` is looked up in the local Hugging Face cache (the
//!    layout `huggingface_hub` writes, so models other tools downloaded are
//!    found), then in ollama's store under that namespace, and only then
//!    downloaded from the hub into that same cache, so the next run is offline.
//!
//! Environment variables are read once, in [`Settings::from_env`], at the edge.

mod cache;
mod hub;
mod ollama;

use corridor_units::Bytes;
use std::path::{Path, PathBuf};

pub use hub::Hub;

/// Where names are looked up and fetched from (parsed once from the environment).
#[derive(Debug, Clone)]
pub struct Settings {
    /// The Hugging Face hub cache (`HF_HUB_CACHE`, `HF_HOME/hub`, `~/.cache/huggingface/hub`).
    pub hf_cache: PathBuf,
    /// The hub's base URL (`HF_ENDPOINT`, default https://huggingface.co), without a trailing `/`.
    pub endpoint: String,
    /// A bearer token for gated and private repositories (`HF_TOKEN`, else the token file
    /// `huggingface-cli login` writes: `HF_TOKEN_PATH` or `HF_HOME/token`).
    pub token: Option<String>,
    /// Never touch the network (`HF_HUB_OFFLINE=1`).
    pub offline: bool,
    /// ollama's model stores, searched in order (`OLLAMA_MODELS`, else `~/.ollama/models` and
    /// the system service's `/usr/share/ollama/.ollama/models`).
    pub ollama_roots: Vec<PathBuf>,
    /// Where `.gguf`-named links to ollama's blobs are made (ollama names blobs by digest only).
    pub link_dir: PathBuf,
}

impl Settings {
    pub fn from_env(corridor_cache: &Path) -> Settings {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        let home = var("HOME");
        let hf_home = var("HF_HOME").or_else(|| {
            var("XDG_CACHE_HOME")
                .or_else(|| home.as_ref().map(|h| h.join(".cache")))
                .map(|c| c.join("huggingface"))
        });
        let hf_cache = var("HF_HUB_CACHE")
            .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
            .or_else(|| hf_home.as_ref().map(|h| h.join("hub")))
            .unwrap_or_else(|| PathBuf::from(".cache/huggingface/hub"));
        let endpoint = std::env::var("HF_ENDPOINT")
            .ok()
            .filter(|e| !e.is_empty())
            .unwrap_or_else(|| "https://huggingface.co".to_string())
            .trim_end_matches('/')
            .to_string();
        // As huggingface_hub: HF_TOKEN, else the file `huggingface-cli login` writes.
        let token_file = var("HF_TOKEN_PATH").or_else(|| hf_home.as_ref().map(|h| h.join("token")));
        let token = std::env::var("HF_TOKEN")
            .ok()
            .or_else(|| token_file.and_then(|f| std::fs::read_to_string(f).ok()))
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty());
        let offline = std::env::var("HF_HUB_OFFLINE")
            .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"));
        let ollama_roots = match var("OLLAMA_MODELS") {
            Some(p) => vec![p],
            None => home
                .map(|h| h.join(".ollama/models"))
                .into_iter()
                .chain([PathBuf::from("/usr/share/ollama/.ollama/models")])
                .collect(),
        };
        Settings { hf_cache, endpoint, token, offline, ollama_roots, link_dir: corridor_cache.join("ollama") }
    }
}

/// What to resolve.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// `--model` as given.
    pub spec: &'a str,
    /// `--revision`: a branch, tag or commit of a hub repository.
    pub revision: &'a str,
    /// Download again even when the cache has the files.
    pub force: bool,
}

/// A model found (or fetched): the path the loader opens and the name it goes by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// A Hugging Face directory or a `.gguf` file.
    pub path: PathBuf,
    /// The name it was asked for (`org/name`, `llama3.2:3b`); `None` for a plain path.
    pub name: Option<String>,
}

/// Why a name did not become a model. Every message says what to do next.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("--model {spec}: no such file or directory")]
    NoSuchPath { spec: String },
    #[error("--model {spec}: {why}")]
    BadName { spec: String, why: String },
    #[error(
        "{repo} is a gated repository on {endpoint}: accept its conditions on {endpoint}/{repo} and \
         set HF_TOKEN to an access token of that account"
    )]
    GatedNoToken { repo: String, endpoint: String },
    #[error(
        "{repo} is a gated repository on {endpoint} and the token in HF_TOKEN is not accepted for it: \
         accept its conditions on {endpoint}/{repo} with the token's account, or use another token"
    )]
    GatedTokenRefused { repo: String, endpoint: String },
    #[error(
        "{repo} on {endpoint} needs authentication (a private or gated repository): set HF_TOKEN \
         to an access token that can read it"
    )]
    NeedsToken { repo: String, endpoint: String },
    #[error(
        "{repo} on {endpoint} refused the token in HF_TOKEN (HTTP {status}): check the token and its access"
    )]
    TokenRefused { repo: String, endpoint: String, status: u16 },
    #[error("no repository {repo} on {endpoint} (check the name; a private repository also needs HF_TOKEN)")]
    RepoNotFound { repo: String, endpoint: String },
    #[error("repository {repo} has no revision '{revision}' on {endpoint} (a branch, tag or commit)")]
    RevisionNotFound { repo: String, revision: String, endpoint: String },
    #[error("{repo} at revision {revision} has no file {file}")]
    FileNotFound { repo: String, revision: String, file: String },
    #[error(
        "cannot reach the Hugging Face hub at {endpoint} ({detail}): check the network, or set \
         HF_ENDPOINT to a mirror; models already in the cache load without a network"
    )]
    Network { endpoint: String, detail: String },
    #[error("{url}: HTTP {status}{message}")]
    Http { url: String, status: u16, message: String },
    #[error(
        "{repo}/{file}: the download's sha256 is {got} but the hub says {want}; the partial file \
         was removed, run the command again"
    )]
    Checksum { repo: String, file: String, want: String, got: String },
    #[error(
        "{repo}/{file}: the download stopped at {} of {} bytes ({why}); run the command again to \
         resume it", .got.get(), .want.get()
    )]
    ShortDownload { repo: String, file: String, want: Bytes, got: Bytes, why: String },
    #[error("{repo}: {why}; its files: {files}")]
    NoWeights { repo: String, why: String, files: String },
    #[error("{repo} has several GGUF files: name one by its quantization, e.g. --model {repo}:{example} (files: {files})")]
    NeedsQuant { repo: String, example: String, files: String },
    #[error("{repo} has no GGUF file tagged {quant}; its GGUF files: {files}")]
    QuantNotFound { repo: String, quant: String, files: String },
    #[error("{repo}: several GGUF files are tagged {quant}: {files}; name the file more exactly")]
    QuantAmbiguous { repo: String, quant: String, files: String },
    #[error(
        "{repo}: {quant} is split into {count} shards ({files}); corridor loads one .gguf file: merge \
         them into one (llama.cpp's `llama-gguf-split --merge`) and pass its path"
    )]
    QuantSharded { repo: String, quant: String, count: usize, files: String },
    #[error(
        "{repo} (revision {revision}) is not in the Hugging Face cache at {cache} and HF_HUB_OFFLINE \
         is set, so it cannot be downloaded"
    )]
    Offline { repo: String, revision: String, cache: String },
    #[error(
        "--model {spec}: not a file, and ollama's store has no model {name} (looked in {roots}); \
         `ollama pull {name}` fetches it, or set OLLAMA_MODELS"
    )]
    OllamaNotFound { spec: String, name: String, roots: String },
    #[error("ollama model {name}: {why} ({path})")]
    OllamaBroken { name: String, path: String, why: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl ResolveError {
    fn io(path: &Path, source: std::io::Error) -> ResolveError {
        ResolveError::Io { path: path.display().to_string(), source }
    }
}

/// What a `--model` value names, before anything is looked up.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Spec {
    /// A path that exists.
    Path(PathBuf),
    /// A hub repository, optionally with a GGUF quantization tag.
    Hub { repo: String, quant: Option<String> },
    /// An ollama model (`[namespace/]name[:tag]`).
    Ollama { name: String },
}

/// Resolve `--model` to a path the loader opens, downloading when needed.
pub fn resolve(req: Request<'_>, settings: &Settings) -> Result<Resolved, ResolveError> {
    match parse_spec(req.spec, |p| p.exists())? {
        Spec::Path(path) => Ok(Resolved { path, name: None }),
        Spec::Ollama { name } => match ollama::find(&settings.ollama_roots, &name)? {
            Some(blob) => {
                Ok(Resolved { path: ollama::gguf_link(&settings.link_dir, &name, &blob)?, name: Some(name) })
            }
            None => Err(ResolveError::OllamaNotFound {
                spec: req.spec.to_string(),
                name: name.clone(),
                roots: join_paths(&settings.ollama_roots),
            }),
        },
        Spec::Hub { repo, quant } => {
            let name = Some(req.spec.to_string());
            if !req.force {
                if let Some(path) =
                    cache::find_local(&settings.hf_cache, &repo, req.revision, quant.as_deref())?
                {
                    tracing::info!(model = %req.spec, path = %path.display(), "found in the Hugging Face cache");
                    return Ok(Resolved { path, name });
                }
                // `user/model:tag` may be an ollama model of a user namespace, and
                // `hf.co/org/name:QUANT` one that ollama pulled from the hub.
                let short = match &quant {
                    Some(q) => format!("{repo}:{q}"),
                    None => repo.clone(),
                };
                // ollama keeps no revisions: only the default one can be there.
                let ollama_names =
                    if req.revision == "main" { vec![short.as_str(), req.spec] } else { vec![] };
                for ollama_name in ollama_names {
                    if let Some(blob) = ollama::find(&settings.ollama_roots, ollama_name)? {
                        let path = ollama::gguf_link(&settings.link_dir, ollama_name, &blob)?;
                        return Ok(Resolved { path, name });
                    }
                }
            }
            if settings.offline {
                return Err(ResolveError::Offline {
                    repo,
                    revision: req.revision.to_string(),
                    cache: settings.hf_cache.display().to_string(),
                });
            }
            let hub = Hub::new(&settings.endpoint, settings.token.clone());
            let path =
                hub::fetch(&hub, &settings.hf_cache, &repo, req.revision, quant.as_deref(), req.force)?;
            Ok(Resolved { path, name })
        }
    }
}

/// Resolve a `--model` value with the settings of this process's environment.
pub fn model_arg(
    spec: &Path,
    revision: &str,
    corridor_cache: &Path,
    force: bool,
) -> Result<Resolved, ResolveError> {
    if spec.exists() {
        return Ok(Resolved { path: spec.to_path_buf(), name: None });
    }
    let text = spec.to_string_lossy();
    resolve(Request { spec: &text, revision, force }, &Settings::from_env(corridor_cache))
}

fn join_paths(paths: &[PathBuf]) -> String {
    paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
}

/// A hub repository id part: what the hub allows in `org` and `name`.
fn valid_repo_part(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 96
        && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !s.contains("--")
        && !s.contains("..")
        && !s.starts_with(['-', '.'])
        && !s.ends_with(['-', '.'])
}

fn valid_tag(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// Classify `--model` without touching the network; `exists` decides whether it is a path.
fn parse_spec(spec: &str, exists: impl Fn(&Path) -> bool) -> Result<Spec, ResolveError> {
    let bad = |why: &str| ResolveError::BadName { spec: spec.to_string(), why: why.to_string() };
    if spec.trim().is_empty() {
        return Err(bad("empty; give a path, org/name, org/name:QUANT or an ollama name"));
    }
    if exists(Path::new(spec)) {
        return Ok(Spec::Path(PathBuf::from(spec)));
    }
    if let Some(name) = spec.strip_prefix("ollama:") {
        if !ollama::valid_name(name) {
            return Err(bad("not an ollama model name (NAME, NAME:TAG or NAMESPACE/NAME:TAG)"));
        }
        return Ok(Spec::Ollama { name: name.to_string() });
    }
    // ollama's own spelling of a hub GGUF: `hf.co/org/name:QUANT`.
    let hub_spec = spec.strip_prefix("hf.co/").or_else(|| spec.strip_prefix("huggingface.co/"));
    let looks_like_path = spec.starts_with(['/', '.', '~'])
        || spec.contains('\\')
        || [".gguf", ".safetensors", ".json"].iter().any(|x| spec.to_ascii_lowercase().ends_with(x));
    if hub_spec.is_none() && looks_like_path {
        return Err(ResolveError::NoSuchPath { spec: spec.to_string() });
    }
    let text = hub_spec.unwrap_or(spec);
    match text.matches('/').count() {
        0 => {
            if ollama::valid_name(text) {
                Ok(Spec::Ollama { name: text.to_string() })
            } else {
                Err(ResolveError::NoSuchPath { spec: spec.to_string() })
            }
        }
        1 => {
            let (org, rest) = text.split_once('/').expect("one slash");
            let (name, quant) = match rest.split_once(':') {
                Some((n, q)) => (n, Some(q)),
                None => (rest, None),
            };
            if !valid_repo_part(org) || !valid_repo_part(name) {
                return Err(bad(
                    "not a path that exists, and not a Hugging Face repository id (org/name: letters, \
                     digits, '-', '_', '.')",
                ));
            }
            if let Some(q) = quant {
                if !valid_tag(q) {
                    return Err(bad("the part after ':' must be a quantization tag such as Q4_K_M"));
                }
            }
            Ok(Spec::Hub { repo: format!("{org}/{name}"), quant: quant.map(str::to_string) })
        }
        _ => Err(ResolveError::NoSuchPath { spec: spec.to_string() }),
    }
}

/// Whether `tag` appears in `file` as a whole word of a GGUF file name
/// (`Q4_K` must not pick `Q4_K_M`, `Q4_0` must not pick `IQ4_0`).
fn has_quant_tag(file: &str, tag: &str) -> bool {
    let f = file.to_ascii_lowercase();
    let t = tag.to_ascii_lowercase();
    let mut from = 0;
    while let Some(i) = f[from..].find(&t) {
        let start = from + i;
        let end = start + t.len();
        let before_ok = start == 0 || matches!(f.as_bytes()[start - 1], b'.' | b'-' | b'_' | b'/');
        let after_ok = end == f.len() || matches!(f.as_bytes()[end], b'.' | b'-' | b'/');
        if before_ok && after_ok {
            return true;
        }
        from = start + 1;
    }
    false
}

/// `model-Q4_K_M-00001-of-00003.gguf`: a shard of a split GGUF.
fn is_gguf_shard(file: &str) -> bool {
    let f = file.to_ascii_lowercase();
    let Some(stem) = f.strip_suffix(".gguf") else { return false };
    let b = stem.as_bytes();
    // "-NNNNN-of-NNNNN" is 15 bytes.
    b.len() >= 15 && {
        let t = &b[b.len() - 15..];
        t[0] == b'-'
            && t[1..6].iter().all(u8::is_ascii_digit)
            && &t[6..10] == b"-of-"
            && t[10..15].iter().all(u8::is_ascii_digit)
    }
}

/// The GGUF weight files of a listing (projector files of vision models are not models).
fn gguf_files(files: &[String]) -> Vec<&String> {
    files
        .iter()
        .filter(|f| f.to_ascii_lowercase().ends_with(".gguf"))
        .filter(|f| !f.rsplit('/').next().unwrap_or(f).to_ascii_lowercase().starts_with("mmproj"))
        .collect()
}

/// Pick the one GGUF file of a repository listing that `quant` names (or the only one).
fn choose_gguf(repo: &str, files: &[String], quant: Option<&str>) -> Result<String, ResolveError> {
    let ggufs = gguf_files(files);
    let list = |v: &[&String]| v.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ");
    let Some(quant) = quant else {
        return match ggufs.as_slice() {
            [one] if !is_gguf_shard(one) => Ok((*one).clone()),
            [] => Err(ResolveError::NoWeights {
                repo: repo.to_string(),
                why: "no config.json with safetensors weights and no .gguf file".to_string(),
                files: files.join(", "),
            }),
            many => Err(ResolveError::NeedsQuant {
                repo: repo.to_string(),
                example: example_tag(many).unwrap_or_else(|| "Q4_K_M".to_string()),
                files: list(many),
            }),
        };
    };
    let matches: Vec<&String> = ggufs.iter().copied().filter(|f| has_quant_tag(f, quant)).collect();
    match matches.as_slice() {
        [] => Err(ResolveError::QuantNotFound {
            repo: repo.to_string(),
            quant: quant.to_string(),
            files: if ggufs.is_empty() { "none".to_string() } else { list(&ggufs) },
        }),
        m if m.iter().any(|f| is_gguf_shard(f)) => Err(ResolveError::QuantSharded {
            repo: repo.to_string(),
            quant: quant.to_string(),
            count: m.len(),
            files: list(m),
        }),
        [one] => Ok((*one).clone()),
        m => Err(ResolveError::QuantAmbiguous {
            repo: repo.to_string(),
            quant: quant.to_string(),
            files: list(m),
        }),
    }
}

/// A quantization tag seen in a file name, for the hint in an error.
fn example_tag(files: &[&String]) -> Option<String> {
    files.iter().find_map(|f| {
        let stem = f.rsplit('/').next()?.strip_suffix(".gguf").or_else(|| f.strip_suffix(".GGUF"))?;
        stem.rsplit(['.', '-'])
            .find(|p| {
                let u = p.to_ascii_uppercase();
                (u.starts_with('Q') || u.starts_with("IQ") || u == "F16" || u == "BF16" || u == "F32")
                    && u.chars().any(|c| c.is_ascii_digit())
            })
            .map(str::to_string)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Spec, ResolveError> {
        parse_spec(s, |p| p == Path::new("models/here.gguf"))
    }

    #[test]
    fn specs_are_classified_without_the_network() {
        assert_eq!(parse("models/here.gguf").unwrap(), Spec::Path("models/here.gguf".into()));
        assert_eq!(
            parse("Qwen/Qwen3-0.6B").unwrap(),
            Spec::Hub { repo: "Qwen/Qwen3-0.6B".into(), quant: None }
        );
        assert_eq!(
            parse("unsloth/Qwen3-0.6B-GGUF:q4_k_m").unwrap(),
            Spec::Hub { repo: "unsloth/Qwen3-0.6B-GGUF".into(), quant: Some("q4_k_m".into()) }
        );
        assert_eq!(
            parse("hf.co/org/m-GGUF:Q8_0").unwrap(),
            Spec::Hub { repo: "org/m-GGUF".into(), quant: Some("Q8_0".into()) }
        );
        assert_eq!(parse("llama3.2:3b").unwrap(), Spec::Ollama { name: "llama3.2:3b".into() });
        assert_eq!(parse("ollama:llama3.2").unwrap(), Spec::Ollama { name: "llama3.2".into() });
        assert!(matches!(parse("models/missing.gguf"), Err(ResolveError::NoSuchPath { .. })));
        assert!(matches!(parse("./dir"), Err(ResolveError::NoSuchPath { .. })));
        assert!(matches!(parse("a/b/c"), Err(ResolveError::NoSuchPath { .. })));
        assert!(matches!(parse("org/na me"), Err(ResolveError::BadName { .. })));
        assert!(matches!(parse("org/name:Q4 K"), Err(ResolveError::BadName { .. })));
        assert!(matches!(parse("org--x/name"), Err(ResolveError::BadName { .. })));
        assert!(matches!(parse(""), Err(ResolveError::BadName { .. })));
    }

    #[test]
    fn quant_tags_match_whole_words_only() {
        assert!(has_quant_tag("Model-Q4_K_M.gguf", "q4_k_m"));
        assert!(has_quant_tag("model.Q4_K_M.gguf", "Q4_K_M"));
        assert!(!has_quant_tag("model-Q4_K_M.gguf", "Q4_K"));
        assert!(!has_quant_tag("model-IQ4_0.gguf", "Q4_0"));
        assert!(has_quant_tag("model_Q8_0.gguf", "Q8_0"));
        assert!(is_gguf_shard("Q4_K_M/model-Q4_K_M-00001-of-00002.gguf"));
        assert!(!is_gguf_shard("model-Q4_K_M.gguf"));
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_gguf_is_chosen_by_its_tag_and_every_doubt_is_an_error() {
        let files = names(&[
            "README.md",
            "m-Q4_K_M.gguf",
            "m-Q4_K_S.gguf",
            "m-Q8_0.gguf",
            "mmproj-m-Q8_0.gguf",
            "big/m-Q6_K-00001-of-00002.gguf",
            "big/m-Q6_K-00002-of-00002.gguf",
            "m-F16.gguf",
            "m-f16.gguf",
        ]);
        assert_eq!(choose_gguf("o/m", &files, Some("q4_k_m")).unwrap(), "m-Q4_K_M.gguf");
        assert_eq!(choose_gguf("o/m", &files, Some("Q8_0")).unwrap(), "m-Q8_0.gguf");
        let e = choose_gguf("o/m", &files, Some("Q6_K")).unwrap_err();
        assert!(matches!(e, ResolveError::QuantSharded { count: 2, .. }), "{e}");
        assert!(e.to_string().contains("m-Q6_K-00001-of-00002.gguf"), "{e}");
        let e = choose_gguf("o/m", &files, Some("F16")).unwrap_err();
        assert!(matches!(e, ResolveError::QuantAmbiguous { .. }), "{e}");
        assert!(e.to_string().contains("m-F16.gguf") && e.to_string().contains("m-f16.gguf"), "{e}");
        let e = choose_gguf("o/m", &files, Some("Q2_K")).unwrap_err();
        assert!(
            matches!(e, ResolveError::QuantNotFound { .. }) && e.to_string().contains("m-Q4_K_S.gguf"),
            "{e}"
        );
        let e = choose_gguf("o/m", &files, None).unwrap_err();
        assert!(matches!(e, ResolveError::NeedsQuant { .. }) && e.to_string().contains("o/m:"), "{e}");
        assert_eq!(choose_gguf("o/m", &names(&["x.gguf", "mmproj-x.gguf"]), None).unwrap(), "x.gguf");
    }
}
