//! Downloads from the Hugging Face hub's file API into the hub cache.
//!
//! `GET /api/models/{repo}/revision/{rev}` gives the commit and the file list;
//! `HEAD /{repo}/resolve/{commit}/{file}` gives the file's etag (the sha256 of
//! an LFS file's contents) and size, and for LFS files a redirect to where the
//! bytes are. The bytes go into `blobs/<etag>.incomplete`, resumed with an
//! HTTP Range after a cut connection (in this run or a later one), and become
//! `blobs/<etag>` only once the size and, for LFS files, the sha256 agree.

use super::cache::{self, INDEX, SINGLE};
use super::{choose_gguf, ResolveError};
use corridor_units::Bytes;
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Tries at one file before giving up; each resumes where the last one stopped.
const ATTEMPTS: usize = 5;

/// Small files a Hugging Face checkpoint may carry besides its weights.
const HF_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
];

/// A client of one hub endpoint.
pub struct Hub {
    agent: ureq::Agent,
    endpoint: String,
    token: Option<String>,
}

/// A repository at one commit.
#[derive(Debug)]
pub struct RepoInfo {
    pub commit: String,
    pub files: Vec<String>,
}

/// What the hub says about one file before it is downloaded.
struct FileMeta {
    etag: String,
    size: Option<u64>,
    /// Where the bytes are (the resolve URL itself, or its redirect).
    url: String,
}

/// What a request was about, to name it in an error.
enum Subject<'a> {
    Repo { revision: &'a str },
    File { revision: &'a str, file: &'a str },
}

impl Hub {
    pub fn new(endpoint: &str, token: Option<String>) -> Hub {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            // Redirects are followed by hand: the token must not travel to another host.
            .max_redirects(0)
            .timeout_connect(Some(Duration::from_secs(15)))
            .timeout_recv_response(Some(Duration::from_secs(60)))
            .timeout_per_read(Some(Duration::from_secs(60)))
            .user_agent(concat!("corridor/", env!("CARGO_PKG_VERSION")))
            // Sizes from HEAD must be the sizes of the bytes a GET brings.
            .accept_encoding("identity")
            // The system's trust store (and SSL_CERT_FILE), so a proxy's own
            // certificate authority is honoured as curl and pip honour it.
            .tls_config(
                ureq::tls::TlsConfig::builder().root_certs(ureq::tls::RootCerts::PlatformVerifier).build(),
            )
            .build();
        Hub {
            agent: ureq::Agent::new_with_config(config),
            endpoint: endpoint.trim_end_matches('/').to_string(),
            token,
        }
    }

    fn authorized<B>(&self, req: ureq::RequestBuilder<B>, url: &str) -> ureq::RequestBuilder<B> {
        match &self.token {
            Some(t) if same_origin(url, &self.endpoint) => req.header("Authorization", format!("Bearer {t}")),
            _ => req,
        }
    }

    fn network(&self, e: ureq::Error) -> ResolveError {
        ResolveError::Network { endpoint: self.endpoint.clone(), detail: e.to_string() }
    }

    /// The commit a revision points at and the repository's files.
    pub fn repo_info(&self, repo: &str, revision: &str) -> Result<RepoInfo, ResolveError> {
        let mut url = format!("{}/api/models/{repo}/revision/{}", self.endpoint, encode(revision, false));
        let mut resp = self.authorized(self.agent.get(&url), &url).call().map_err(|e| self.network(e))?;
        // A renamed repository answers with a redirect to its new name.
        for _ in 0..5 {
            let Some(loc) = resp.headers().get("location").and_then(|v| v.to_str().ok()) else { break };
            if !resp.status().is_redirection() {
                break;
            }
            url = join_url(&url, loc);
            resp = self.authorized(self.agent.get(&url), &url).call().map_err(|e| self.network(e))?;
        }
        let status = resp.status().as_u16();
        if status != 200 {
            return Err(self.status_error(repo, Subject::Repo { revision }, &url, resp));
        }
        let text = resp.into_body().read_to_string().map_err(|e| self.network(e))?;
        let bad = |why: &str| ResolveError::Http { url: url.clone(), status, message: format!(": {why}") };
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(&format!("not JSON ({e})")))?;
        let commit = v["sha"].as_str().filter(|s| cache::is_commit(s)).ok_or_else(|| bad("no commit sha"))?;
        let files = v["siblings"]
            .as_array()
            .ok_or_else(|| bad("no file list"))?
            .iter()
            .filter_map(|s| s["rfilename"].as_str().map(str::to_string))
            .collect();
        Ok(RepoInfo { commit: commit.to_string(), files })
    }

    /// The etag, size and location of one file at a commit.
    fn file_meta(
        &self,
        repo: &str,
        commit: &str,
        revision: &str,
        file: &str,
    ) -> Result<FileMeta, ResolveError> {
        let mut url = format!("{}/{repo}/resolve/{commit}/{}", self.endpoint, encode(file, true));
        for _ in 0..5 {
            let resp = self.authorized(self.agent.head(&url), &url).call().map_err(|e| self.network(e))?;
            let status = resp.status().as_u16();
            let header = |k: &str| resp.headers().get(k).and_then(|v| v.to_str().ok()).map(str::to_string);
            if !(200..400).contains(&status) {
                return Err(self.status_error(repo, Subject::File { revision, file }, &url, resp));
            }
            let location = header("location").map(|l| join_url(&url, &l));
            let etag = header("x-linked-etag").or_else(|| header("etag")).map(|e| clean_etag(&e));
            let size =
                header("x-linked-size").or_else(|| header("content-length")).and_then(|s| s.parse().ok());
            match (etag, location) {
                // An LFS file: its metadata here, its bytes behind the redirect.
                (Some(etag), Some(loc)) if (300..400).contains(&status) => {
                    return Ok(FileMeta { etag, size, url: loc })
                }
                (Some(etag), None) if status < 300 => return Ok(FileMeta { etag, size, url }),
                // A renamed repository: the hub redirects to the new name.
                (None, Some(loc)) if (300..400).contains(&status) => url = loc,
                _ => {
                    return Err(ResolveError::Http {
                        url,
                        status,
                        message: ": the hub sent no etag for the file".to_string(),
                    })
                }
            }
        }
        Err(ResolveError::Http { url, status: 310, message: ": too many redirects".to_string() })
    }

    /// Turn a refusal into the error a person can act on.
    fn status_error(
        &self,
        repo: &str,
        subject: Subject<'_>,
        url: &str,
        mut resp: ureq::http::Response<ureq::Body>,
    ) -> ResolveError {
        let status = resp.status().as_u16();
        let code = resp.headers().get("x-error-code").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
        let message = resp
            .headers()
            .get("x-error-message")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            .or_else(|| resp.body_mut().with_config().limit(4096).read_to_string().ok())
            .map(|m| m.trim().chars().take(300).collect::<String>())
            .filter(|m| !m.is_empty())
            .map(|m| format!(": {m}"))
            .unwrap_or_default();
        let repo_s = repo.to_string();
        let endpoint = self.endpoint.clone();
        let has_token = self.token.is_some();
        let revision = match subject {
            Subject::Repo { revision } | Subject::File { revision, .. } => revision.to_string(),
        };
        match (code.as_str(), status) {
            ("GatedRepo", _) | ("", 403) if !has_token => {
                ResolveError::GatedNoToken { repo: repo_s, endpoint }
            }
            ("GatedRepo", _) | ("", 403) => ResolveError::GatedTokenRefused { repo: repo_s, endpoint },
            ("RepoNotFound", _) => ResolveError::RepoNotFound { repo: repo_s, endpoint },
            ("", 401) if !has_token => ResolveError::NeedsToken { repo: repo_s, endpoint },
            ("", 401) => ResolveError::TokenRefused { repo: repo_s, endpoint, status },
            ("RevisionNotFound", _) => ResolveError::RevisionNotFound { repo: repo_s, revision, endpoint },
            ("EntryNotFound", _) => match subject {
                Subject::File { file, .. } => {
                    ResolveError::FileNotFound { repo: repo_s, revision, file: file.to_string() }
                }
                Subject::Repo { .. } => ResolveError::RevisionNotFound { repo: repo_s, revision, endpoint },
            },
            (_, 404) => match subject {
                Subject::File { file, .. } => {
                    ResolveError::FileNotFound { repo: repo_s, revision, file: file.to_string() }
                }
                Subject::Repo { revision: "main" } => ResolveError::RepoNotFound { repo: repo_s, endpoint },
                Subject::Repo { .. } => ResolveError::RevisionNotFound { repo: repo_s, revision, endpoint },
            },
            _ => ResolveError::Http { url: url.to_string(), status, message },
        }
    }

    /// Make `blobs/<etag>` hold the file (downloading what is missing) and
    /// link it into the snapshot of `commit`.
    fn ensure_file(&self, ctx: &Ctx<'_>, file: &str) -> Result<PathBuf, ResolveError> {
        let meta = self.file_meta(ctx.repo, ctx.commit, ctx.revision, file)?;
        let blob = cache::blob_path(ctx.root, ctx.repo, &meta.etag);
        let have = std::fs::metadata(&blob).ok().map(|m| m.len());
        if ctx.force || have.is_none() || (meta.size.is_some() && have != meta.size) {
            self.download(ctx.repo, file, &meta, &blob, have.is_some())?;
        }
        cache::link(ctx.root, ctx.repo, ctx.commit, file, &meta.etag)
    }

    /// Download into `<blob>.incomplete`, resuming, then verify and move into
    /// place; `replace` when a blob already there is to be fetched again.
    fn download(
        &self,
        repo: &str,
        file: &str,
        meta: &FileMeta,
        blob: &Path,
        replace: bool,
    ) -> Result<(), ResolveError> {
        let parent = blob.parent().expect("blobs/<etag>");
        std::fs::create_dir_all(parent).map_err(|e| ResolveError::io(parent, e))?;
        let partial = PathBuf::from(format!("{}.incomplete", blob.display()));
        let mut out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&partial)
            .map_err(|e| ResolveError::io(&partial, e))?;
        // Another process fetching the same blob holds this lock until its
        // file is in place; appending beside it would interleave the bytes.
        out.lock().map_err(|e| ResolveError::io(&partial, e))?;
        if !replace && blob.is_file() {
            return Ok(());
        }
        let bar = ProgressBar::new(meta.size.unwrap_or(0)).with_style(
            ProgressStyle::with_template("{msg} {bar:30} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
                .expect("valid template"),
        );
        bar.set_message(file.rsplit('/').next().unwrap_or(file).to_string());
        let mut last_err = None;
        let mut cut: Option<String> = None;
        for attempt in 0..ATTEMPTS {
            let have = out.metadata().map_err(|e| ResolveError::io(&partial, e))?.len();
            if meta.size.is_some_and(|s| s == have && s > 0) {
                break;
            }
            if attempt > 0 {
                tracing::warn!(file, resumed_at = have, "download interrupted, resuming");
                std::thread::sleep(Duration::from_millis(250 * attempt as u64));
            }
            bar.set_position(have);
            let mut req = self.authorized(self.agent.get(&meta.url), &meta.url);
            if have > 0 {
                req = req.header("Range", format!("bytes={have}-"));
            }
            let resp = match req.call() {
                Ok(r) => r,
                Err(e) => {
                    last_err = Some(self.network(e));
                    continue;
                }
            };
            let status = resp.status().as_u16();
            match status {
                206 => {}
                200 => {
                    // The server ignored the range: start over.
                    out.set_len(0).map_err(|e| ResolveError::io(&partial, e))?;
                    out.seek(std::io::SeekFrom::End(0)).map_err(|e| ResolveError::io(&partial, e))?;
                    bar.set_position(0);
                }
                416 => {
                    // Nothing past what we hold: either complete or stale.
                    if meta.size.is_some_and(|s| s == have) {
                        break;
                    }
                    out.set_len(0).map_err(|e| ResolveError::io(&partial, e))?;
                    continue;
                }
                // A busy or failing server may answer the next try.
                429 | 500..=599 => {
                    last_err =
                        Some(ResolveError::Http { url: meta.url.clone(), status, message: String::new() });
                    continue;
                }
                _ => {
                    let e = self.status_error(repo, Subject::File { revision: "", file }, &meta.url, resp);
                    bar.finish_and_clear();
                    return Err(e);
                }
            }
            match copy(resp.into_body().into_reader(), &mut out, &bar) {
                Ok(()) if meta.size.is_none() => break,
                Ok(()) => {}
                Err(e) => {
                    let _ = out.flush();
                    cut = Some(e.to_string());
                }
            }
        }
        bar.finish_and_clear();
        out.flush().map_err(|e| ResolveError::io(&partial, e))?;
        // `out` stays open (and locked) until the blob is in place.
        let got = std::fs::metadata(&partial).map_err(|e| ResolveError::io(&partial, e))?.len();
        if let Some(want) = meta.size {
            if got != want {
                // What was received stays in `.incomplete` for the next run to resume.
                return Err(match (got, last_err) {
                    (0, Some(e)) => e,
                    _ => ResolveError::ShortDownload {
                        repo: repo.to_string(),
                        file: file.to_string(),
                        want: Bytes(want),
                        got: Bytes(got),
                        why: cut.unwrap_or_else(|| "the connection closed early".to_string()),
                    },
                });
            }
        }
        // An LFS file's etag is the sha256 of its bytes; a git file's is a
        // git object id, checked here by its size only.
        if is_sha256(&meta.etag) {
            let digest = sha256_file(&partial)?;
            if digest != meta.etag {
                let _ = std::fs::remove_file(&partial);
                return Err(ResolveError::Checksum {
                    repo: repo.to_string(),
                    file: file.to_string(),
                    want: meta.etag.clone(),
                    got: digest,
                });
            }
        }
        std::fs::rename(&partial, blob).map_err(|e| ResolveError::io(blob, e))?;
        drop(out);
        Ok(())
    }
}

/// One repository at one commit, being written into one cache.
struct Ctx<'a> {
    root: &'a Path,
    repo: &'a str,
    revision: &'a str,
    commit: &'a str,
    force: bool,
}

/// Download what `repo` at `revision` needs into the cache; returns the path to load.
pub fn fetch(
    hub: &Hub,
    root: &Path,
    repo: &str,
    revision: &str,
    quant: Option<&str>,
    force: bool,
) -> Result<PathBuf, ResolveError> {
    let info = hub.repo_info(repo, revision)?;
    let ctx = Ctx { root, repo, revision, commit: &info.commit, force };
    let has = |f: &str| info.files.iter().any(|x| x == f);
    let is_hf = quant.is_none() && has("config.json") && (has(SINGLE) || has(INDEX));
    let path = if is_hf {
        eprintln!(
            "corridor: downloading {repo} (revision {revision}, commit {}) from {}",
            &info.commit[..12],
            hub.endpoint
        );
        for f in HF_FILES.iter().filter(|f| has(f)) {
            hub.ensure_file(&ctx, f)?;
        }
        if has(SINGLE) {
            hub.ensure_file(&ctx, SINGLE)?;
        } else {
            let index = hub.ensure_file(&ctx, INDEX)?;
            for shard in cache::index_shards(&index)? {
                hub.ensure_file(&ctx, &shard)?;
            }
        }
        index_dir(root, repo, &info.commit)
    } else {
        let file = match choose_gguf(repo, &info.files, quant) {
            Err(ResolveError::NoWeights { repo, files, .. }) => {
                return Err(ResolveError::NoWeights {
                    repo,
                    why: "neither config.json with model.safetensors (or its index) nor a .gguf file"
                        .to_string(),
                    files,
                })
            }
            other => other?,
        };
        eprintln!("corridor: downloading {repo}/{file} (revision {revision}) from {}", hub.endpoint);
        hub.ensure_file(&ctx, &file)?
    };
    cache::write_ref(root, repo, revision, &info.commit)?;
    eprintln!("corridor: cached {}", path.display());
    Ok(path)
}

fn index_dir(root: &Path, repo: &str, commit: &str) -> PathBuf {
    cache::repo_dir(root, repo).join("snapshots").join(commit)
}

fn copy(mut from: impl Read, to: &mut std::fs::File, bar: &ProgressBar) -> std::io::Result<()> {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = from.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        to.write_all(&buf[..n])?;
        bar.inc(n as u64);
    }
}

/// The sha256 of a file, with a bar (a multi-GB file takes a while).
fn sha256_file(path: &Path) -> Result<String, ResolveError> {
    let mut f = std::fs::File::open(path).map_err(|e| ResolveError::io(path, e))?;
    let len = f.metadata().map_err(|e| ResolveError::io(path, e))?.len();
    let bar = ProgressBar::new(len).with_style(
        ProgressStyle::with_template("verifying {bar:30} {bytes}/{total_bytes}").expect("valid template"),
    );
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| ResolveError::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    Ok(hex::encode(h.finalize()))
}

fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// `W/"abc"` -> `abc`.
fn clean_etag(e: &str) -> String {
    e.trim().trim_start_matches("W/").trim_matches('"').to_string()
}

/// Percent-encode a revision (`refs/pr/1` is one path segment) or a file path
/// (whose `/` separate segments).
fn encode(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') || (keep_slash && b == b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Whether `url` is on the endpoint's own origin (the token goes nowhere else).
fn same_origin(url: &str, endpoint: &str) -> bool {
    url.strip_prefix(endpoint).is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// Resolve a `Location` header against the URL it answered.
fn join_url(base: &str, location: &str) -> String {
    if location.contains("://") {
        return location.to_string();
    }
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let origin_end = base[scheme_end..].find('/').map(|i| scheme_end + i).unwrap_or(base.len());
    if location.starts_with('/') {
        format!("{}{location}", &base[..origin_end])
    } else {
        let dir_end = base.rfind('/').filter(|&i| i >= origin_end).unwrap_or(origin_end);
        format!("{}/{location}", &base[..dir_end])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_encoded_and_redirects_joined() {
        assert_eq!(encode("refs/pr/1", false), "refs%2Fpr%2F1");
        assert_eq!(encode("sub dir/a+b.gguf", true), "sub%20dir/a%2Bb.gguf");
        assert_eq!(join_url("http://h:1/a/b/c", "/x/y"), "http://h:1/x/y");
        assert_eq!(join_url("http://h:1/a/b/c", "d"), "http://h:1/a/b/d");
        assert_eq!(join_url("http://h:1/a", "https://cdn/z"), "https://cdn/z");
        assert_eq!(clean_etag("W/\"abc\""), "abc");
        assert_eq!(clean_etag("\"abc\""), "abc");
        assert!(same_origin("http://h:80/a", "http://h:80"));
        assert!(!same_origin("http://h:8000/a", "http://h:80"));
        assert!(!same_origin("https://cdn.example/x", "https://hub.example"));
    }
}
