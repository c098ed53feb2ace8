//! Models by name, end to end through the `corridor` binary: a local server
//! laid out as the Hugging Face hub's file API (downloads, a resume after a cut
//! connection, a corrupt download refused, a gated repository, revisions), a
//! Hugging Face cache laid out as `huggingface_hub` writes it, and ollama's
//! store. Nothing here reaches beyond 127.0.0.1.

use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny")
}

fn sha256(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// A repository at one revision: its commit and files.
#[derive(Clone)]
struct Snapshot {
    commit: String,
    files: Vec<(String, Vec<u8>)>,
}

fn is_lfs(name: &str) -> bool {
    name.ends_with(".safetensors") || name.ends_with(".gguf")
}

#[derive(Default)]
struct HubState {
    /// (repo, revision) -> snapshot.
    repos: HashMap<(String, String), Snapshot>,
    /// repo -> the only token that may read its files.
    gated: HashMap<String, String>,
    /// sha256 -> how many more GETs of that blob are cut after this many bytes.
    cut: HashMap<String, (usize, usize)>,
    /// sha256 of blobs served with one byte flipped.
    corrupt: Vec<String>,
    /// Where LFS files redirect to (another server, as the hub's CDN is); `None`: this one.
    lfs_base: Option<String>,
    /// How many more blob GETs are answered 503.
    busy: usize,
    /// A pause after every 8 KiB of a blob (a slow link).
    slow: Option<std::time::Duration>,
    /// "METHOD path | range | authorization" of every request.
    log: Vec<String>,
}

/// A hub on 127.0.0.1: the file API of huggingface.co, and a blob store its
/// LFS files redirect to.
struct FakeHub {
    url: String,
    state: Arc<Mutex<HubState>>,
}

impl FakeHub {
    fn start(state: HubState) -> FakeHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(Mutex::new(state));
        let s = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { return };
                let s = s.clone();
                std::thread::spawn(move || serve(conn, &s));
            }
        });
        FakeHub { url, state }
    }

    fn log(&self) -> Vec<String> {
        self.state.lock().unwrap().log.clone()
    }
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            out.push(u8::from_str_radix(&s[i + 1..i + 3], 16).unwrap());
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap()
}

fn respond(conn: &mut TcpStream, status: &str, headers: &[(&str, String)], body: &[u8], head: bool) {
    let mut r = format!("HTTP/1.1 {status}\r\nconnection: close\r\n");
    for (k, v) in headers {
        r.push_str(&format!("{k}: {v}\r\n"));
    }
    if !headers.iter().any(|(k, _)| *k == "content-length") {
        r.push_str(&format!("content-length: {}\r\n", body.len()));
    }
    r.push_str("\r\n");
    let _ = conn.write_all(r.as_bytes());
    if !head {
        let _ = conn.write_all(body);
    }
}

fn serve(mut conn: TcpStream, state: &Mutex<HubState>) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let path = parts.next().unwrap_or("").to_string();
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).is_err() || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let auth = headers.get("authorization").cloned().unwrap_or_default();
    let range = headers.get("range").cloned().unwrap_or_default();
    let mut st = state.lock().unwrap();
    st.log.push(format!("{method} {path} | {range} | {auth}"));
    let head = method == "HEAD";
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let not_found = |conn: &mut TcpStream, code: &str| {
        respond(
            conn,
            "404 Not Found",
            &[("x-error-code", code.to_string())],
            b"{\"error\":\"not found\"}",
            head,
        )
    };
    match segs.as_slice() {
        ["api", "models", "old-org", name, "revision", rev] => {
            let to = format!("/api/models/tiny/{name}/revision/{rev}");
            respond(&mut conn, "307 Temporary Redirect", &[("location", to)], b"", head)
        }
        ["old-org", name, "resolve", rest @ ..] => {
            let to = format!("/tiny/{name}/resolve/{}", rest.join("/"));
            respond(&mut conn, "307 Temporary Redirect", &[("location", to)], b"", head)
        }
        ["api", "models", org, name, "revision", rev] => {
            let repo = format!("{org}/{name}");
            let rev = decode(rev);
            match st.repos.get(&(repo.clone(), rev)) {
                Some(snap) => {
                    let siblings: Vec<_> =
                        snap.files.iter().map(|(n, _)| serde_json::json!({ "rfilename": n })).collect();
                    let body = serde_json::json!({ "id": repo, "sha": snap.commit, "siblings": siblings });
                    respond(
                        &mut conn,
                        "200 OK",
                        &[("content-type", "application/json".into())],
                        body.to_string().as_bytes(),
                        head,
                    )
                }
                None if st.repos.keys().any(|(r, _)| *r == repo) => not_found(&mut conn, "RevisionNotFound"),
                None => not_found(&mut conn, "RepoNotFound"),
            }
        }
        [org, name, "resolve", commit, file @ ..] => {
            let repo = format!("{org}/{name}");
            let file = decode(&file.join("/"));
            if let Some(token) = st.gated.get(&repo) {
                let msg = format!(
                    "Access to model {repo} is restricted. You must have access to it and be authenticated."
                );
                if auth.is_empty() {
                    return respond(
                        &mut conn,
                        "401 Unauthorized",
                        &[("x-error-code", "GatedRepo".into()), ("x-error-message", msg)],
                        b"",
                        head,
                    );
                }
                if auth != format!("Bearer {token}") {
                    return respond(
                        &mut conn,
                        "403 Forbidden",
                        &[("x-error-code", "GatedRepo".into()), ("x-error-message", msg)],
                        b"",
                        head,
                    );
                }
            }
            let snap =
                st.repos.iter().find(|((r, _), s)| *r == repo && s.commit == *commit).map(|(_, s)| s.clone());
            let Some(snap) = snap else { return not_found(&mut conn, "RevisionNotFound") };
            let Some((_, bytes)) = snap.files.iter().find(|(n, _)| *n == file) else {
                return not_found(&mut conn, "EntryNotFound");
            };
            let common = vec![("x-repo-commit", snap.commit.clone())];
            if is_lfs(&file) {
                let sha = sha256(bytes);
                let mut h = common;
                h.extend([
                    ("x-linked-etag", format!("\"{sha}\"")),
                    ("x-linked-size", bytes.len().to_string()),
                    ("location", format!("{}/lfs/{sha}", st.lfs_base.clone().unwrap_or_default())),
                ]);
                respond(&mut conn, "302 Found", &h, b"", head)
            } else {
                // A git file's etag is its git object id (here: any 40 hex digits).
                let mut h = common;
                h.push(("etag", format!("\"{}\"", &sha256(bytes)[..40])));
                respond(&mut conn, "200 OK", &h, bytes, head)
            }
        }
        ["lfs", sha] => {
            let blob = st
                .repos
                .values()
                .flat_map(|s| s.files.iter())
                .find(|(_, b)| sha256(b) == *sha)
                .map(|(_, b)| b.clone());
            let Some(mut blob) = blob else { return not_found(&mut conn, "EntryNotFound") };
            if st.busy > 0 {
                st.busy -= 1;
                return respond(&mut conn, "503 Service Unavailable", &[], b"busy", head);
            }
            if st.corrupt.iter().any(|c| c == sha) {
                let mid = blob.len() / 2;
                blob[mid] ^= 0x55;
            }
            let start: usize = range
                .strip_prefix("bytes=")
                .and_then(|r| r.strip_suffix('-'))
                .and_then(|r| r.parse().ok())
                .unwrap_or(0);
            if start > blob.len() {
                return respond(&mut conn, "416 Range Not Satisfiable", &[], b"", head);
            }
            let body = &blob[start..];
            let (status, mut h) = if start > 0 {
                (
                    "206 Partial Content",
                    vec![("content-range", format!("bytes {start}-{}/{}", blob.len() - 1, blob.len()))],
                )
            } else {
                ("200 OK", vec![])
            };
            h.push(("content-length", body.len().to_string()));
            let cut = match st.cut.get_mut(*sha) {
                Some((times, at)) if *times > 0 => {
                    *times -= 1;
                    Some(*at)
                }
                _ => None,
            };
            let slow = st.slow;
            drop(st);
            match cut {
                Some(at) => {
                    // Headers announce the whole body; the connection dies after `at` bytes.
                    respond(&mut conn, status, &h, &body[..at.min(body.len())], false);
                    let _ = conn.flush();
                    let _ = conn.shutdown(Shutdown::Both);
                }
                None => match slow {
                    Some(pause) => {
                        respond(&mut conn, status, &h, b"", true);
                        for chunk in body.chunks(8 << 10) {
                            if conn.write_all(chunk).is_err() {
                                return;
                            }
                            std::thread::sleep(pause);
                        }
                    }
                    None => respond(&mut conn, status, &h, body, head),
                },
            }
        }
        _ => not_found(&mut conn, "RepoNotFound"),
    }
}

fn snapshot(commit_seed: &str, files: &[(&str, Vec<u8>)]) -> Snapshot {
    Snapshot {
        commit: sha256(commit_seed.as_bytes())[..40].to_string(),
        files: files.iter().map(|(n, b)| (n.to_string(), b.clone())).collect(),
    }
}

/// The tiny llama checkpoint as a Hugging Face repository's files.
fn hf_files() -> Vec<(&'static str, Vec<u8>)> {
    ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"]
        .iter()
        .map(|f| (*f, std::fs::read(fixtures().join("llama-f32").join(f)).unwrap()))
        .chain([("README.md", b"# tiny\n".to_vec())])
        .collect()
}

fn gguf_bytes() -> Vec<u8> {
    std::fs::read(fixtures().join("llama-q.gguf")).unwrap()
}

/// A sandbox: its own HF cache, ollama store and corridor cache, no token.
struct Env {
    dir: tempfile::TempDir,
    endpoint: String,
    token: Option<String>,
    extra: Vec<(String, String)>,
}

impl Env {
    fn new(endpoint: &str) -> Env {
        Env { dir: tempfile::tempdir().unwrap(), endpoint: endpoint.to_string(), token: None, extra: vec![] }
    }
    fn hub_cache(&self) -> PathBuf {
        self.dir.path().join("hf/hub")
    }
    fn ollama(&self) -> PathBuf {
        self.dir.path().join("ollama")
    }
    fn run(&self, args: &[&str]) -> Output {
        let mut c = Command::new(env!("CARGO_BIN_EXE_corridor"));
        c.arg("--log")
            .arg("error")
            .arg("--cache-dir")
            .arg(self.dir.path().join("corridor"))
            .args(args)
            .current_dir(self.dir.path())
            .env("HF_ENDPOINT", &self.endpoint)
            .env("HF_HUB_CACHE", self.hub_cache())
            .env("OLLAMA_MODELS", self.ollama())
            .env_remove("HF_TOKEN")
            .env_remove("HF_HOME")
            .env_remove("HF_HUB_OFFLINE");
        if let Some(t) = &self.token {
            c.env("HF_TOKEN", t);
        }
        for (k, v) in &self.extra {
            c.env(k, v);
        }
        c.output().expect("the binary runs")
    }
    /// `corridor pull`, which must succeed; returns the printed path.
    fn pull(&self, args: &[&str]) -> PathBuf {
        let out = self.run(&[&["pull"], args].concat());
        assert!(out.status.success(), "pull {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    }
    /// `corridor pull`, which must fail with one error line; returns it.
    fn pull_err(&self, args: &[&str]) -> String {
        let out = self.run(&[&["pull"], args].concat());
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(1), "pull {args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        err.lines()
            .find(|l| l.starts_with("error: "))
            .unwrap_or_else(|| panic!("no error line: {err}"))
            .to_string()
    }
    /// Load the model and generate two tokens; must succeed.
    fn generate(&self, model: &str) {
        let out = self.run(&[
            "generate",
            "--model",
            model,
            "--prompt",
            "hello",
            "--max-tokens",
            "2",
            "--kv-cache-mib",
            "16",
            "--context-length",
            "64",
        ]);
        assert!(out.status.success(), "generate --model {model}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

/// An address where nothing listens.
fn dead_endpoint() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    drop(l);
    url
}

fn read_ref(env: &Env, repo_dir: &str, rev: &str) -> String {
    std::fs::read_to_string(env.hub_cache().join(repo_dir).join("refs").join(rev)).unwrap()
}

#[test]
fn a_hub_repository_downloads_into_the_cache_and_then_loads_offline() {
    let snap = snapshot("tiny-main", &hf_files());
    let mut st = HubState::default();
    st.repos.insert(("tiny/llama-f32".into(), "main".into()), snap.clone());
    // The first blob request meets a busy server; the next try gets it.
    st.busy = 1;
    let hub = FakeHub::start(st);
    let mut env = Env::new(&hub.url);

    let path = env.pull(&["tiny/llama-f32"]);
    let repo = env.hub_cache().join("models--tiny--llama-f32");
    assert_eq!(path, repo.join("snapshots").join(&snap.commit));
    assert_eq!(read_ref(&env, "models--tiny--llama-f32", "main"), snap.commit);
    for (name, bytes) in &snap.files {
        let p = path.join(name);
        if name == "README.md" {
            assert!(!p.exists(), "only what the loader reads is fetched");
            continue;
        }
        assert_eq!(&std::fs::read(&p).unwrap(), bytes, "{name}");
        let link = std::fs::read_link(&p).unwrap();
        assert!(link.starts_with("../../blobs"), "{name} -> {}", link.display());
    }
    // LFS blobs are named by their sha256.
    let st_bytes = &snap.files.iter().find(|(n, _)| n == "model.safetensors").unwrap().1;
    assert!(repo.join("blobs").join(sha256(st_bytes)).is_file());
    assert!(hub.log().iter().all(|l| l.ends_with("| ")), "no token was sent: {:?}", hub.log());
    assert_eq!(hub.state.lock().unwrap().busy, 0);

    // A repository that moved is followed to its new name.
    let moved = env.pull(&["old-org/llama-f32"]);
    assert_eq!(
        std::fs::read(moved.join("config.json")).unwrap(),
        std::fs::read(path.join("config.json")).unwrap()
    );

    // With the hub gone, the name resolves from the cache and the model loads.
    env.endpoint = dead_endpoint();
    env.generate("tiny/llama-f32");
    assert_eq!(env.pull(&["tiny/llama-f32"]), path);
}

#[test]
fn a_sharded_checkpoint_fetches_the_shards_its_index_names() {
    let dir = fixtures().join("llama-bf16-sharded");
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n != "reference.json")
        .map(|n| (n.clone(), std::fs::read(dir.join(&n)).unwrap()))
        .collect();
    // Weights in another layout beside the index are not fetched.
    files.push(("consolidated.safetensors".into(), b"not read".to_vec()));
    let named: Vec<(&str, Vec<u8>)> = files.iter().map(|(n, b)| (n.as_str(), b.clone())).collect();
    let mut st = HubState::default();
    st.repos.insert(("tiny/sharded".into(), "main".into()), snapshot("sharded", &named));
    let hub = FakeHub::start(st);
    let mut env = Env::new(&hub.url);

    let path = env.pull(&["tiny/sharded"]);
    for i in 1..=4 {
        assert!(path.join(format!("model-0000{i}-of-00004.safetensors")).is_file());
    }
    assert!(!path.join("consolidated.safetensors").exists());
    env.endpoint = dead_endpoint();
    env.generate("tiny/sharded");
}

#[test]
fn force_fetches_a_cached_file_again() {
    let gguf = gguf_bytes();
    let mut st = HubState::default();
    st.repos.insert(("tiny/f-GGUF".into(), "main".into()), snapshot("f", &[("f-Q4_0.gguf", gguf.clone())]));
    let hub = FakeHub::start(st);
    let env = Env::new(&hub.url);
    let path = env.pull(&["tiny/f-GGUF"]);
    // Damage the cached blob behind the link.
    let blob = std::fs::canonicalize(&path).unwrap();
    std::fs::write(&blob, vec![0u8; gguf.len()]).unwrap();
    assert_eq!(env.pull(&["tiny/f-GGUF"]), path, "without --force the cache is trusted");
    assert_eq!(env.pull(&["tiny/f-GGUF", "--force"]), path);
    assert_eq!(std::fs::read(&path).unwrap(), gguf);
    assert_eq!(hub.log().iter().filter(|l| l.starts_with("GET /lfs/")).count(), 2);
}

#[test]
fn a_cut_connection_is_resumed_with_a_range_request() {
    let gguf = gguf_bytes();
    let cut_at = gguf.len() / 3;
    let mut st = HubState::default();
    let files = vec![
        ("README.md", b"quants\n".to_vec()),
        ("llama-Q4_0.gguf", gguf.clone()),
        ("llama-F16.gguf", std::fs::read(fixtures().join("llama-bf16.gguf")).unwrap()),
    ];
    st.repos.insert(("tiny/llama-GGUF".into(), "main".into()), snapshot("gguf-main", &files));
    st.cut.insert(sha256(&gguf), (1, cut_at));
    let hub = FakeHub::start(st);
    let mut env = Env::new(&hub.url);

    let path = env.pull(&["tiny/llama-GGUF:q4_0"]);
    assert_eq!(path.file_name().unwrap(), "llama-Q4_0.gguf");
    assert_eq!(std::fs::read(&path).unwrap(), gguf);
    let gets: Vec<String> = hub.log().into_iter().filter(|l| l.starts_with("GET /lfs/")).collect();
    assert_eq!(gets.len(), 2, "{gets:?}");
    assert!(gets[0].contains("|  |"), "the first try asks for the whole file: {}", gets[0]);
    assert!(gets[1].contains(&format!("| bytes={cut_at}- |")), "the second resumes at the cut: {}", gets[1]);
    let blobs = env.hub_cache().join("models--tiny--llama-GGUF/blobs");
    let names: Vec<_> = std::fs::read_dir(&blobs).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from(sha256(&gguf))], "only the verified blob is left");

    env.endpoint = dead_endpoint();
    env.generate("tiny/llama-GGUF:Q4_0");
}

#[test]
fn a_download_cut_on_every_try_is_resumed_by_the_next_run() {
    let gguf = gguf_bytes();
    let mut st = HubState::default();
    st.repos.insert(
        ("tiny/flaky-GGUF".into(), "main".into()),
        snapshot("flaky", &[("f-Q4_0.gguf", gguf.clone())]),
    );
    // Five tries of 1000 bytes each, then the connection holds.
    st.cut.insert(sha256(&gguf), (5, 1000));
    let hub = FakeHub::start(st);
    let env = Env::new(&hub.url);

    let err = env.pull_err(&["tiny/flaky-GGUF:Q4_0"]);
    assert!(err.contains("stopped at 5000 of") && err.contains("run the command again"), "{err}");
    let partial =
        env.hub_cache().join("models--tiny--flaky-GGUF/blobs").join(format!("{}.incomplete", sha256(&gguf)));
    assert_eq!(std::fs::read(&partial).unwrap(), &gguf[..5000]);

    let path = env.pull(&["tiny/flaky-GGUF:Q4_0"]);
    assert_eq!(std::fs::read(&path).unwrap(), gguf);
    assert!(!partial.exists());
    let last = hub.log().into_iter().rfind(|l| l.starts_with("GET /lfs/")).unwrap();
    assert!(last.contains("| bytes=5000- |"), "{last}");
}

#[test]
fn two_runs_fetching_one_file_at_once_download_it_once() {
    let gguf = gguf_bytes();
    let mut st = HubState::default();
    st.repos
        .insert(("tiny/busy-GGUF".into(), "main".into()), snapshot("busy", &[("b-Q4_0.gguf", gguf.clone())]));
    // 14 chunks of 8 KiB at 100 ms: the first run is still downloading when the second starts.
    st.slow = Some(std::time::Duration::from_millis(100));
    let hub = FakeHub::start(st);
    let env = Arc::new(Env::new(&hub.url));
    let runs: Vec<_> = (0..2)
        .map(|i| {
            let env = env.clone();
            std::thread::sleep(std::time::Duration::from_millis(200 * i));
            std::thread::spawn(move || env.pull(&["tiny/busy-GGUF:Q4_0"]))
        })
        .collect();
    for r in runs {
        assert_eq!(std::fs::read(r.join().unwrap()).unwrap(), gguf);
    }
    let gets = hub.log().into_iter().filter(|l| l.starts_with("GET /lfs/")).count();
    assert_eq!(gets, 1, "the second run waits for the first one's file: {:?}", hub.log());
}

#[test]
fn a_download_whose_sha256_differs_is_refused_and_removed() {
    let gguf = gguf_bytes();
    let mut st = HubState::default();
    st.repos
        .insert(("tiny/bad-GGUF".into(), "main".into()), snapshot("bad", &[("m-Q4_0.gguf", gguf.clone())]));
    st.corrupt.push(sha256(&gguf));
    let hub = FakeHub::start(st);
    let env = Env::new(&hub.url);

    let err = env.pull_err(&["tiny/bad-GGUF:Q4_0"]);
    assert!(err.contains("sha256") && err.contains("m-Q4_0.gguf") && err.contains(&sha256(&gguf)), "{err}");
    let blobs = env.hub_cache().join("models--tiny--bad-GGUF/blobs");
    let left: Vec<_> =
        std::fs::read_dir(&blobs).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    assert!(left.is_empty(), "nothing is kept of a corrupt download: {left:?}");
    assert!(!env.hub_cache().join("models--tiny--bad-GGUF/refs/main").exists());
}

#[test]
fn a_gated_repository_names_the_token_it_needs() {
    let mut st = HubState::default();
    st.repos.insert(
        ("meta/gated-GGUF".into(), "main".into()),
        snapshot("gated", &[("g-Q4_0.gguf", gguf_bytes())]),
    );
    st.gated.insert("meta/gated-GGUF".into(), "hf_granted".into());
    // The bytes come from another server, which must never see the token.
    let cdn = FakeHub::start(HubState { repos: st.repos.clone(), ..Default::default() });
    st.lfs_base = Some(cdn.url.clone());
    let hub = FakeHub::start(st);
    let mut env = Env::new(&hub.url);

    let err = env.pull_err(&["meta/gated-GGUF"]);
    assert!(
        err.contains("meta/gated-GGUF") && err.contains("gated") && err.contains("set HF_TOKEN"),
        "{err}"
    );

    env.token = Some("hf_wrong".into());
    let err = env.pull_err(&["meta/gated-GGUF"]);
    assert!(err.contains("meta/gated-GGUF") && err.contains("HF_TOKEN is not accepted"), "{err}");

    // The token file `huggingface-cli login` writes is read when HF_TOKEN is not set.
    env.token = None;
    let home = env.dir.path().join("hf-home");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::write(home.join("token"), "hf_granted\n").unwrap();
    env.extra = vec![("HF_HOME".into(), home.display().to_string())];
    let path = env.pull(&["meta/gated-GGUF", "--force"]);
    assert_eq!(std::fs::read(path).unwrap(), gguf_bytes());

    env.extra.clear();
    env.token = Some("hf_granted".into());
    let path = env.pull(&["meta/gated-GGUF", "--force"]);
    assert_eq!(std::fs::read(path).unwrap(), gguf_bytes());
    assert!(hub.log().iter().any(|l| l.starts_with("HEAD /meta/") && l.ends_with("| Bearer hf_granted")));
    let cdn_log = cdn.log();
    assert_eq!(cdn_log.iter().filter(|l| l.starts_with("GET /lfs/")).count(), 2, "{cdn_log:?}");
    assert!(cdn_log.iter().all(|l| l.ends_with("| ")), "the token stays with the hub: {cdn_log:?}");
}

#[test]
fn a_revision_other_than_main_is_fetched_and_recorded() {
    let old = gguf_bytes();
    let new = std::fs::read(fixtures().join("qwen2-f16.gguf")).unwrap();
    let mut st = HubState::default();
    let main = snapshot("main", &[("m-Q4_0.gguf", old.clone())]);
    let v2 = snapshot("v2", &[("m-Q4_0.gguf", new.clone())]);
    let pr = snapshot("pr1", &[("m-Q4_0.gguf", new.clone())]);
    st.repos.insert(("o/m-GGUF".into(), "main".into()), main.clone());
    st.repos.insert(("o/m-GGUF".into(), "v2".into()), v2.clone());
    st.repos.insert(("o/m-GGUF".into(), "refs/pr/1".into()), pr.clone());
    let hub = FakeHub::start(st);
    let env = Env::new(&hub.url);

    let p2 = env.pull(&["o/m-GGUF:Q4_0", "--revision", "v2"]);
    assert!(
        p2.starts_with(env.hub_cache().join("models--o--m-GGUF/snapshots").join(&v2.commit)),
        "{}",
        p2.display()
    );
    assert_eq!(std::fs::read(&p2).unwrap(), new);
    assert_eq!(read_ref(&env, "models--o--m-GGUF", "v2"), v2.commit);
    let p1 = env.pull(&["o/m-GGUF:Q4_0"]);
    assert_eq!(std::fs::read(&p1).unwrap(), old);
    let pp = env.pull(&["o/m-GGUF:Q4_0", "--revision", "refs/pr/1"]);
    assert_eq!(read_ref(&env, "models--o--m-GGUF", "refs/pr/1"), pr.commit);
    assert!(pp.starts_with(env.hub_cache().join("models--o--m-GGUF/snapshots").join(&pr.commit)));
    assert!(
        hub.log().iter().any(|l| l.starts_with("GET /api/models/o/m-GGUF/revision/refs%2Fpr%2F1 ")),
        "{:?}",
        hub.log()
    );
    // A blob shared by two revisions is downloaded once.
    assert_eq!(hub.log().iter().filter(|l| l.starts_with("GET /lfs/")).count(), 2, "{:?}", hub.log());
    // A commit is a revision too, and needs no network once cached.
    let mut offline = Env::new(&dead_endpoint());
    offline.dir = env.dir;
    assert_eq!(offline.pull(&["o/m-GGUF:Q4_0", "--revision", &v2.commit]), p2);

    let err = offline.pull_err(&["o/m-GGUF:Q4_0", "--revision", "v3"]);
    assert!(err.contains("cannot reach the Hugging Face hub"), "{err}");
    let online = Env { endpoint: hub.url.clone(), ..offline };
    let err = online.pull_err(&["o/m-GGUF:Q4_0", "--revision", "v3"]);
    assert!(err.contains("o/m-GGUF") && err.contains("no revision 'v3'"), "{err}");
    let err = online.pull_err(&["nobody/nothing"]);
    assert!(err.contains("no repository nobody/nothing"), "{err}");
    let err = online.pull_err(&["o/m-GGUF:Q5_K_M"]);
    assert!(err.contains("no GGUF file tagged Q5_K_M") && err.contains("m-Q4_0.gguf"), "{err}");
}

/// Write `files` into `root` the way huggingface_hub does: blobs by etag,
/// relative links in the snapshot, the ref naming the commit.
fn write_hf_cache(root: &Path, repo: &str, commit: &str, files: &[(&str, Vec<u8>)]) -> PathBuf {
    let dir = root.join(format!("models--{}", repo.replace('/', "--")));
    std::fs::create_dir_all(dir.join("blobs")).unwrap();
    std::fs::create_dir_all(dir.join("refs")).unwrap();
    let snap = dir.join("snapshots").join(commit);
    std::fs::create_dir_all(&snap).unwrap();
    for (name, bytes) in files {
        let etag = if is_lfs(name) { sha256(bytes) } else { sha256(bytes)[..40].to_string() };
        std::fs::write(dir.join("blobs").join(&etag), bytes).unwrap();
        std::os::unix::fs::symlink(Path::new("../../blobs").join(&etag), snap.join(name)).unwrap();
    }
    std::fs::write(dir.join("refs/main"), commit).unwrap();
    snap
}

#[test]
fn models_in_the_hugging_face_cache_load_without_a_network() {
    let env = Env::new(&dead_endpoint());
    let commit = "1111111111111111111111111111111111111111";
    let snap = write_hf_cache(&env.hub_cache(), "tiny/cached", commit, &hf_files());
    env.generate("tiny/cached");
    assert_eq!(env.pull(&["tiny/cached"]), snap);

    // A GGUF repository: the tag picks the file.
    let gsnap = write_hf_cache(
        &env.hub_cache(),
        "tiny/cached-GGUF",
        commit,
        &[
            ("c-Q4_0.gguf", gguf_bytes()),
            ("c-BF16.gguf", std::fs::read(fixtures().join("llama-bf16.gguf")).unwrap()),
        ],
    );
    assert_eq!(env.pull(&["tiny/cached-GGUF:bf16"]), gsnap.join("c-BF16.gguf"));
    env.generate("tiny/cached-GGUF:Q4_0");

    // HF_HOME/hub is the cache when HF_HUB_CACHE is not set.
    let home = tempfile::tempdir().unwrap();
    write_hf_cache(&home.path().join("hub"), "tiny/elsewhere", commit, &hf_files());
    let mut c = Command::new(env!("CARGO_BIN_EXE_corridor"));
    let out = c
        .args(["--log", "error", "pull", "tiny/elsewhere"])
        .env("HF_HOME", home.path())
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_TOKEN")
        .env("OLLAMA_MODELS", home.path().join("ollama"))
        .env("HF_ENDPOINT", dead_endpoint())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout)
        .trim()
        .starts_with(home.path().join("hub").to_str().unwrap()));

    // A snapshot that lacks the weights is not a model; offline, that is said plainly.
    let partial = hf_files().into_iter().filter(|(n, _)| *n == "config.json").collect::<Vec<_>>();
    write_hf_cache(&env.hub_cache(), "tiny/partial", commit, &partial);
    let offline = Env { extra: vec![("HF_HUB_OFFLINE".into(), "1".into())], ..Env::new(&dead_endpoint()) };
    let offline = Env { dir: env.dir, ..offline };
    let err = offline.pull_err(&["tiny/partial"]);
    assert!(err.contains("tiny/partial") && err.contains("HF_HUB_OFFLINE"), "{err}");

    // A local path that exists wins over the same words as a name.
    let local = offline.dir.path().join("tiny/cached");
    std::fs::create_dir_all(&local).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"] {
        std::fs::copy(fixtures().join("llama-f32").join(f), local.join(f)).unwrap();
    }
    assert_eq!(offline.pull(&["tiny/cached"]), PathBuf::from("tiny/cached"));
}

/// Lay out an ollama store with one model (`library/<model>:<tag>`).
fn write_ollama(root: &Path, namespace: &str, model: &str, tag: &str, blob: &[u8]) -> PathBuf {
    let digest = sha256(blob);
    std::fs::create_dir_all(root.join("blobs")).unwrap();
    let blob_path = root.join("blobs").join(format!("sha256-{digest}"));
    std::fs::write(&blob_path, blob).unwrap();
    let template = b"{{ .Prompt }}";
    std::fs::write(root.join("blobs").join(format!("sha256-{}", sha256(template))), template).unwrap();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": { "mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:00", "size": 2 },
        "layers": [
            { "mediaType": "application/vnd.ollama.image.model", "digest": format!("sha256:{digest}"), "size": blob.len() },
            { "mediaType": "application/vnd.ollama.image.template", "digest": format!("sha256:{}", sha256(template)), "size": template.len() }
        ]
    });
    let dir = root.join("manifests/registry.ollama.ai").join(namespace).join(model);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(tag), manifest.to_string()).unwrap();
    blob_path
}

#[test]
fn models_in_ollamas_store_load_by_their_ollama_name() {
    let env = Env::new(&dead_endpoint());
    let blob = write_ollama(&env.ollama(), "library", "tiny", "q4", &gguf_bytes());
    env.generate("ollama:tiny:q4");
    env.generate("tiny:q4");
    let p = env.pull(&["tiny:q4"]);
    assert_eq!(p.extension().unwrap(), "gguf");
    assert_eq!(std::fs::canonicalize(&p).unwrap(), std::fs::canonicalize(&blob).unwrap());

    // `latest` is the default tag; a user namespace reads like a hub name.
    write_ollama(&env.ollama(), "library", "tiny", "latest", &gguf_bytes());
    env.pull(&["ollama:tiny"]);
    write_ollama(&env.ollama(), "someone", "small", "latest", &gguf_bytes());
    env.generate("someone/small");
    // ollama keeps what it pulled from the hub under the hf.co host.
    let hf_dir = env.ollama().join("manifests/hf.co/org/m-GGUF");
    std::fs::create_dir_all(&hf_dir).unwrap();
    std::fs::copy(
        env.ollama().join("manifests/registry.ollama.ai/someone/small/latest"),
        hf_dir.join("Q4_0"),
    )
    .unwrap();
    env.pull(&["hf.co/org/m-GGUF:Q4_0"]);

    let err = env.pull_err(&["tiny:7b"]);
    assert!(err.contains("tiny:7b") && err.contains("ollama pull tiny:7b"), "{err}");
    std::fs::remove_file(&blob).unwrap();
    let err = env.pull_err(&["tiny:q4"]);
    assert!(err.contains("blob is missing"), "{err}");
    write_ollama(&env.ollama(), "library", "notgguf", "1b", b"safetensors, not GGUF");
    let err = env.pull_err(&["ollama:notgguf:1b"]);
    assert!(err.contains("not a GGUF file"), "{err}");
}

#[test]
fn no_network_and_bad_names_are_one_line_errors() {
    let env = Env::new(&dead_endpoint());
    let err = env.pull_err(&["org/absent"]);
    assert!(err.contains("cannot reach the Hugging Face hub") && err.contains(&env.endpoint), "{err}");
    let err = env.pull_err(&["./no/such/dir"]);
    assert!(err.contains("no such file or directory"), "{err}");
    let err = env.pull_err(&["org/na me"]);
    assert!(err.contains("not a Hugging Face repository id"), "{err}");
    // `generate` and `plan` resolve names the same way.
    let out = env.run(&["plan", "--model", "org/absent", "--devices", "sim:1GiB"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach the Hugging Face hub"));
    let out = env.run(&["generate", "--model", "org/absent", "--prompt", "x"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach the Hugging Face hub"));
}

/// Kills the server when the test ends, however it ends.
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_model_served_by_name_is_listed_under_that_name() {
    let env = Env::new(&dead_endpoint());
    write_ollama(&env.ollama(), "library", "tiny", "q4", &gguf_bytes());
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_corridor"))
        .args(["--log", "info", "--cache-dir"])
        .arg(env.dir.path().join("corridor"))
        .args(["serve", "--model", "tiny:q4", "--port", &port.to_string(), "--kv-cache-mib", "16"])
        .args(["--context-length", "64"])
        .env("OLLAMA_MODELS", env.ollama())
        .env("HF_HUB_CACHE", env.hub_cache())
        .env("HF_ENDPOINT", &env.endpoint)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let _server = Server(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("serving at") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(std::time::Duration::from_secs(60)).expect("the server comes up within a minute");
    let mut conn = TcpStream::connect(("127.0.0.1", port)).unwrap();
    conn.write_all(b"GET /v1/models HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n").unwrap();
    let mut body = String::new();
    std::io::Read::read_to_string(&mut conn, &mut body).unwrap();
    assert!(body.contains("\"id\":\"tiny:q4\""), "{body}");
}
