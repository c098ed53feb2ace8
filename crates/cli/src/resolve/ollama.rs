//! Models in ollama's local store, loaded by their ollama name.
//!
//! ```text
//! <store>/manifests/<host>/<namespace>/<model>/<tag>   JSON: layers with mediaType and digest
//! <store>/blobs/sha256-<hex>                           the layer's bytes
//! ```
//!
//! The layer of mediaType `application/vnd.ollama.image.model` is a GGUF file.
//! `llama3.2:3b` means `registry.ollama.ai/library/llama3.2/3b`; a missing tag
//! is `latest`.

use super::ResolveError;
use std::path::{Path, PathBuf};

const MODEL_LAYER: &str = "application/vnd.ollama.image.model";
const DEFAULT_HOST: &str = "registry.ollama.ai";
const DEFAULT_NAMESPACE: &str = "library";

/// `[host/][namespace/]model[:tag]` split into its four parts.
#[derive(Debug, PartialEq, Eq)]
struct Name<'a> {
    host: &'a str,
    namespace: &'a str,
    model: &'a str,
    tag: &'a str,
}

fn part_ok(s: &str) -> bool {
    !s.is_empty()
        && s != "."
        && s != ".."
        && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn parse(name: &str) -> Option<Name<'_>> {
    let (path, tag) = match name.rsplit_once(':') {
        Some((p, t)) if !t.contains('/') => (p, t),
        _ => (name, "latest"),
    };
    let parts: Vec<&str> = path.split('/').collect();
    let (host, namespace, model) = match parts.as_slice() {
        [m] => (DEFAULT_HOST, DEFAULT_NAMESPACE, *m),
        [ns, m] => (DEFAULT_HOST, *ns, *m),
        [h, ns, m] => (*h, *ns, *m),
        _ => return None,
    };
    [host, namespace, model, tag].iter().all(|p| part_ok(p)).then_some(Name { host, namespace, model, tag })
}

pub fn valid_name(name: &str) -> bool {
    parse(name).is_some()
}

/// The GGUF blob of `name` in the first store that has its manifest.
pub fn find(roots: &[PathBuf], name: &str) -> Result<Option<PathBuf>, ResolveError> {
    let Some(n) = parse(name) else { return Ok(None) };
    for root in roots {
        let manifest = root.join("manifests").join(n.host).join(n.namespace).join(n.model).join(n.tag);
        if !manifest.is_file() {
            continue;
        }
        return blob_of(root, &manifest, name).map(Some);
    }
    Ok(None)
}

fn blob_of(root: &Path, manifest: &Path, name: &str) -> Result<PathBuf, ResolveError> {
    let broken = |path: &Path, why: String| ResolveError::OllamaBroken {
        name: name.to_string(),
        path: path.display().to_string(),
        why,
    };
    let text = std::fs::read_to_string(manifest).map_err(|e| ResolveError::io(manifest, e))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| broken(manifest, format!("the manifest is not JSON ({e})")))?;
    let layers =
        v["layers"].as_array().ok_or_else(|| broken(manifest, "the manifest has no layers".into()))?;
    let models: Vec<&serde_json::Value> = layers.iter().filter(|l| l["mediaType"] == MODEL_LAYER).collect();
    let layer = match models.as_slice() {
        [one] => *one,
        [] => return Err(broken(manifest, format!("no layer of mediaType {MODEL_LAYER}"))),
        _ => {
            return Err(broken(
                manifest,
                format!("{} model layers; corridor loads one GGUF file", models.len()),
            ))
        }
    };
    let digest = layer["digest"].as_str().unwrap_or("");
    let hex = digest
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| {
            broken(manifest, format!("the model layer's digest '{digest}' is not sha256:<hex>"))
        })?;
    let blob = root.join("blobs").join(format!("sha256-{hex}"));
    let meta = std::fs::metadata(&blob)
        .map_err(|_| broken(&blob, format!("the model blob is missing; `ollama pull {name}` restores it")))?;
    if let Some(size) = layer["size"].as_u64() {
        if meta.len() != size {
            return Err(broken(&blob, format!("the blob is {} bytes, the manifest says {size}", meta.len())));
        }
    }
    let mut magic = [0u8; 4];
    let read = std::fs::File::open(&blob).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic));
    if read.is_err() || &magic != b"GGUF" {
        return Err(broken(&blob, "the model layer is not a GGUF file".into()));
    }
    Ok(blob)
}

/// A `.gguf`-named link to the blob (the loader knows GGUF files by their
/// extension, and ollama names blobs by digest), made under `dir`.
pub fn gguf_link(dir: &Path, name: &str, blob: &Path) -> Result<PathBuf, ResolveError> {
    std::fs::create_dir_all(dir).map_err(|e| ResolveError::io(dir, e))?;
    let file: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '-' })
        .collect();
    let link = dir.join(format!("{file}.gguf"));
    let blob = std::fs::canonicalize(blob).map_err(|e| ResolveError::io(blob, e))?;
    if std::fs::read_link(&link).is_ok_and(|t| t == blob) {
        return Ok(link);
    }
    match std::fs::remove_file(&link) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(ResolveError::io(&link, e)),
    }
    #[cfg(unix)]
    std::os::unix::fs::symlink(&blob, &link).map_err(|e| ResolveError::io(&link, e))?;
    #[cfg(not(unix))]
    std::fs::hard_link(&blob, &link).map_err(|e| ResolveError::io(&link, e))?;
    Ok(link)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_expand_as_ollama_expands_them() {
        let n = parse("llama3.2:3b").unwrap();
        assert_eq!((n.host, n.namespace, n.model, n.tag), (DEFAULT_HOST, "library", "llama3.2", "3b"));
        assert_eq!(parse("qwen3").unwrap().tag, "latest");
        let n = parse("someone/tiny:q4").unwrap();
        assert_eq!((n.namespace, n.model, n.tag), ("someone", "tiny", "q4"));
        let n = parse("hf.co/org/m-GGUF:Q8_0").unwrap();
        assert_eq!((n.host, n.namespace, n.model, n.tag), ("hf.co", "org", "m-GGUF", "Q8_0"));
        assert!(parse("../x:1").is_none());
        assert!(parse("a/b/c/d").is_none());
        assert!(parse("x:").is_none());
    }
}
