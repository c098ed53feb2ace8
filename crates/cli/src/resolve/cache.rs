//! The Hugging Face hub cache, laid out exactly as `huggingface_hub` writes it,
//! so models downloaded by Python tools are found here and ours are found there:
//!
//! ```text
//! <cache>/models--<org>--<name>/
//!     refs/<revision>                 the commit a branch or tag pointed at
//!     blobs/<etag>                    file contents (sha256 for LFS files)
//!     snapshots/<commit>/<file>       relative symlinks into blobs/
//! ```

use super::{choose_gguf, ResolveError};
use std::path::{Path, PathBuf};

/// The weight files corridor's loader reads from a Hugging Face directory.
pub const SINGLE: &str = "model.safetensors";
pub const INDEX: &str = "model.safetensors.index.json";

pub fn repo_dir(root: &Path, repo: &str) -> PathBuf {
    root.join(format!("models--{}", repo.replace('/', "--")))
}

pub fn is_commit(rev: &str) -> bool {
    rev.len() == 40 && rev.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The snapshot directory a revision names, if the cache has it.
pub fn snapshot(root: &Path, repo: &str, revision: &str) -> Option<PathBuf> {
    let dir = repo_dir(root, repo);
    let commit = if is_commit(revision) {
        revision.to_string()
    } else {
        std::fs::read_to_string(dir.join("refs").join(revision)).ok()?.trim().to_string()
    };
    if !is_commit(&commit) {
        return None;
    }
    let snap = dir.join("snapshots").join(commit);
    snap.is_dir().then_some(snap)
}

/// Files of a snapshot whose links resolve, as repository paths (`a/b.gguf`).
fn snapshot_files(snap: &Path) -> Vec<String> {
    fn walk(dir: &Path, prefix: &str, out: &mut Vec<String>) {
        let Ok(rd) = std::fs::read_dir(dir) else { return };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let path = e.path();
            let rel = if prefix.is_empty() { name } else { format!("{prefix}/{name}") };
            // `is_dir`/`is_file` follow the symlink: a dangling link is neither.
            if path.is_dir() {
                walk(&path, &rel, out);
            } else if path.is_file() {
                out.push(rel);
            }
        }
    }
    let mut out = Vec::new();
    walk(snap, "", &mut out);
    out.sort();
    out
}

/// A complete, loadable model for `repo` at `revision` in the cache, if there is one.
pub fn find_local(
    root: &Path,
    repo: &str,
    revision: &str,
    quant: Option<&str>,
) -> Result<Option<PathBuf>, ResolveError> {
    let Some(snap) = snapshot(root, repo, revision) else { return Ok(None) };
    let files = snapshot_files(&snap);
    if quant.is_none() && snap.join("config.json").is_file() {
        return Ok(hf_dir_complete(&snap)?.then_some(snap));
    }
    // The snapshot holds only what was downloaded; a tag it lacks may still
    // be on the hub, so "not here" is not an error yet.
    Ok(choose_gguf(repo, &files, quant).ok().map(|f| snap.join(f)))
}

/// Whether a Hugging Face directory has its config, tokenizer and every weight shard.
fn hf_dir_complete(dir: &Path) -> Result<bool, ResolveError> {
    if !dir.join("tokenizer.json").is_file() && !dir.join("tokenizer.model").is_file() {
        return Ok(false);
    }
    if dir.join(SINGLE).is_file() {
        return Ok(true);
    }
    let index = dir.join(INDEX);
    if !index.is_file() {
        return Ok(false);
    }
    let shards = index_shards(&index)?;
    Ok(!shards.is_empty() && shards.iter().all(|s| dir.join(s).is_file()))
}

/// The shard files a safetensors index names, in order, each once.
pub fn index_shards(index: &Path) -> Result<Vec<String>, ResolveError> {
    let text = std::fs::read_to_string(index).map_err(|e| ResolveError::io(index, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        ResolveError::io(index, std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))
    })?;
    let mut shards: Vec<String> = v["weight_map"]
        .as_object()
        .map(|m| m.values().filter_map(|s| s.as_str().map(str::to_string)).collect())
        .unwrap_or_default();
    shards.sort();
    shards.dedup();
    Ok(shards)
}

/// Record that `revision` points at `commit` (a commit needs no ref).
pub fn write_ref(root: &Path, repo: &str, revision: &str, commit: &str) -> Result<(), ResolveError> {
    if revision == commit {
        return Ok(());
    }
    let path = repo_dir(root, repo).join("refs").join(revision);
    let parent = path.parent().expect("refs/<rev> has a parent");
    std::fs::create_dir_all(parent).map_err(|e| ResolveError::io(parent, e))?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, commit).map_err(|e| ResolveError::io(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| ResolveError::io(&path, e))
}

pub fn blob_path(root: &Path, repo: &str, etag: &str) -> PathBuf {
    repo_dir(root, repo).join("blobs").join(etag)
}

/// Point `snapshots/<commit>/<file>` at `blobs/<etag>` with a relative link,
/// as `huggingface_hub` does (the cache stays valid when it is moved).
pub fn link(root: &Path, repo: &str, commit: &str, file: &str, etag: &str) -> Result<PathBuf, ResolveError> {
    let pointer = repo_dir(root, repo).join("snapshots").join(commit).join(file);
    let parent = pointer.parent().expect("a file in a snapshot");
    std::fs::create_dir_all(parent).map_err(|e| ResolveError::io(parent, e))?;
    let ups = file.split('/').count() + 1;
    let target: PathBuf = std::iter::repeat_n("..", ups).collect::<PathBuf>().join("blobs").join(etag);
    if std::fs::read_link(&pointer).is_ok_and(|t| t == target) {
        return Ok(pointer);
    }
    // Made beside and renamed over, so a reader never finds the pointer missing.
    let tmp = pointer.with_file_name(format!(
        ".{}.{}.tmp",
        pointer.file_name().expect("a file name").to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_file(&tmp);
    symlink(&target, &tmp).map_err(|e| ResolveError::io(&tmp, e))?;
    std::fs::rename(&tmp, &pointer).map_err(|e| ResolveError::io(&pointer, e))?;
    Ok(pointer)
}

#[cfg(unix)]
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    std::os::unix::fs::symlink(target, link)
}

#[cfg(not(unix))]
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    // Without symlinks, huggingface_hub copies the blob into the snapshot.
    let from = link.parent().expect("a file in a snapshot").join(target);
    std::fs::copy(from, link).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_are_relative_and_resolve_from_nested_files() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let blob = blob_path(root, "o/m", "abc");
        std::fs::create_dir_all(blob.parent().unwrap()).unwrap();
        std::fs::write(&blob, b"x").unwrap();
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let p = link(root, "o/m", commit, "sub/dir/f.gguf", "abc").unwrap();
        assert_eq!(std::fs::read_link(&p).unwrap(), PathBuf::from("../../../../blobs/abc"));
        assert_eq!(std::fs::read(&p).unwrap(), b"x");
        write_ref(root, "o/m", "refs/pr/1", commit).unwrap();
        assert_eq!(
            snapshot(root, "o/m", "refs/pr/1").unwrap(),
            repo_dir(root, "o/m").join("snapshots").join(commit)
        );
        assert_eq!(
            snapshot(root, "o/m", commit).unwrap(),
            repo_dir(root, "o/m").join("snapshots").join(commit)
        );
        assert!(snapshot(root, "o/m", "main").is_none());
    }
}
