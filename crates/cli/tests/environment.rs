//! The environment is read at the edge only: no crate below `cli` reads an
//! environment variable, so every switch that changes what the engine or a
//! backend does arrives as a typed field (the CUDA switches as
//! `corridor_backend::CudaTuning`, parsed in crates/cli/src/tuning.rs).
//!
//! This test reads every `crates/*/src` file of the crates below `cli` and
//! fails on any call that reads or changes the process environment.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Calls that read or change the process environment. (`env!` reads the
/// build's environment at compile time and is not among them.)
const FORBIDDEN: &[&str] = &[
    "env::var(",
    "env::var_os(",
    "env::vars(",
    "env::vars_os(",
    "env::set_var(",
    "env::remove_var(",
    "std::env::var",
    "getenv",
    "from_default_env",
    "EnvFilter::from_env",
];

/// Crates that are edges themselves: the `corridor` command, and the GPU
/// check, a binary of its own.
const EDGES: &[&str] = &["cli", "gpu-check"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every (file, line number, call) where a forbidden call appears in the
/// `src` folders of the crates under `crates_dir` that are not edges.
fn offenders(crates_dir: &Path) -> Vec<(PathBuf, usize, &'static str)> {
    let mut found = Vec::new();
    let Ok(crates) = std::fs::read_dir(crates_dir) else { return found };
    for krate in crates.flatten() {
        if EDGES.iter().any(|e| krate.file_name() == *e) {
            continue;
        }
        let mut files = Vec::new();
        rust_files(&krate.path().join("src"), &mut files);
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            for (i, line) in text.lines().enumerate() {
                if let Some(call) = FORBIDDEN.iter().find(|c| line.contains(*c)) {
                    found.push((file.clone(), i + 1, *call));
                }
            }
        }
    }
    found
}

#[test]
fn no_crate_below_cli_reads_the_environment() {
    let crates_dir = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("crates/ above crates/cli");
    let mut scanned = 0;
    for krate in std::fs::read_dir(crates_dir).expect("crates/ is readable").flatten() {
        scanned += usize::from(krate.path().join("src").is_dir());
    }
    assert!(scanned >= 7, "the scan must see the workspace's crates (saw {scanned})");
    let found = offenders(crates_dir);
    assert!(
        found.is_empty(),
        "switches are parsed by the command (crates/cli) and handed down as typed fields; found: {}",
        found.iter().map(|(f, l, n)| format!("{}:{l} {n}", f.display())).collect::<Vec<_>>().join(", ")
    );
}

#[test]
fn the_scan_finds_a_planted_read() {
    let dir = tempfile::tempdir().unwrap();
    let plant = |krate: &str, file: &str, text: &str| {
        let src = dir.path().join(krate).join("src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join(file), text).unwrap();
    };
    plant("backend", "deep.rs", "fn f() -> bool { std::env::var(\"CORRIDOR_X\").is_ok() }\n");
    plant("engine", "lib.rs", "const V: &str = env!(\"CARGO_PKG_VERSION\");\n");
    plant("cli", "main.rs", "fn main() { let _ = std::env::var_os(\"HOME\"); }\n");
    let found = offenders(dir.path());
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].0.ends_with("backend/src/deep.rs"), "{found:?}");
    assert_eq!(found[0].1, 1);
}

/// The switches' environment spellings are the flags': a value that is no
/// switch fails at parse time, naming the flag, before anything loads.
#[test]
fn a_switch_in_the_environment_is_parsed_as_its_flag() {
    for (var, flag) in [
        ("CORRIDOR_PDL", "--cuda-pdl"),
        ("CORRIDOR_EARLY_WEIGHTS", "--cuda-early-weights"),
        ("CORRIDOR_FUSE", "--cuda-fuse"),
        ("CORRIDOR_ATTN_LANES", "--cuda-attn-lanes"),
        ("CORRIDOR_CUDA_PROFILE", "--cuda-profile"),
        ("CORRIDOR_NCCL_GRAPHS", "--nccl-graphs"),
        ("CORRIDOR_DELTA_CHUNKED", "--cuda-delta-chunked"),
        ("CORRIDOR_Q8_GEMV", "--cuda-q8-gemv"),
        ("CORRIDOR_L2_PREFETCH", "--cuda-l2-prefetch"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_corridor"))
            .args(["generate", "--prompt", "hi", "--model", "/nonexistent/model.gguf"])
            .env(var, "maybe")
            .output()
            .expect("the binary runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}=maybe: {err}");
        assert!(err.contains(flag), "{var}=maybe should name {flag}: {err}");
    }
}
