//! Bad checkpoints on the command line: one line naming the problem and a
//! non-zero exit, never a panic.

use std::path::{Path, PathBuf};
use std::process::Command;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny")
}

/// Run `corridor generate` on `model` and return (exit code, stderr).
fn generate(model: &Path) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_corridor"))
        .args(["--log", "error", "generate", "--prompt", "hello", "--max-tokens", "2", "--model"])
        .arg(model)
        .output()
        .expect("the binary runs");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).to_string())
}

fn assert_one_line_error(model: &Path, needle: &str) {
    let (code, err) = generate(model);
    assert_eq!(code, 1, "{}: exit {code}, stderr: {err}", model.display());
    assert!(!err.contains("panicked"), "{}: panicked: {err}", model.display());
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{}: one line expected, got: {err}", model.display());
    assert!(lines[0].starts_with("error: "), "{}", lines[0]);
    assert!(lines[0].contains(needle), "{}: expected '{needle}' in: {}", model.display(), lines[0]);
}

#[test]
fn truncated_and_corrupt_checkpoints_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = std::fs::read(fixtures().join("llama-q.gguf")).unwrap();

    let truncated = dir.path().join("truncated.gguf");
    std::fs::write(&truncated, &gguf[..gguf.len() / 2]).unwrap();
    assert_one_line_error(&truncated, "truncated.gguf");

    let corrupt = dir.path().join("corrupt.gguf");
    let mut bad = gguf.clone();
    bad[..4].copy_from_slice(b"GGUX");
    std::fs::write(&corrupt, &bad).unwrap();
    assert_one_line_error(&corrupt, "GGUF");

    // A Hugging Face directory with a truncated safetensors file.
    let hf = dir.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(fixtures().join("llama-f32").join(f), hf.join(f)).unwrap();
    }
    let st = std::fs::read(fixtures().join("llama-f32/model.safetensors")).unwrap();
    std::fs::write(hf.join("model.safetensors"), &st[..st.len() - 100]).unwrap();
    assert_one_line_error(&hf, "model.safetensors");
}

#[test]
fn unknown_architecture_and_missing_tokenizer_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let src = fixtures().join("llama-f32");
    let copy = |to: &Path| {
        std::fs::create_dir(to).unwrap();
        for e in std::fs::read_dir(&src).unwrap() {
            let p = e.unwrap().path();
            std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
        }
    };
    let arch = dir.path().join("arch");
    copy(&arch);
    let cfg = std::fs::read_to_string(arch.join("config.json")).unwrap();
    std::fs::write(
        arch.join("config.json"),
        cfg.replace("LlamaForCausalLM", "FalconForCausalLM").replace("\"llama\"", "\"falcon\""),
    )
    .unwrap();
    assert_one_line_error(&arch, "Falcon");

    let notok = dir.path().join("notok");
    copy(&notok);
    std::fs::remove_file(notok.join("tokenizer.json")).unwrap();
    assert_one_line_error(&notok, "tokenizer.json");
}

#[test]
fn unsupported_tensor_type_is_named() {
    // Rewrite one tensor's ggml type id in the tiny GGUF to IQ2_XXS (16), a type corridor does not read.
    let gguf = std::fs::read(fixtures().join("llama-q.gguf")).unwrap();
    let name = b"blk.0.attn_q.weight";
    let at = gguf.windows(name.len()).position(|w| w == name).expect("tensor name in the file") + name.len();
    // After the name: u32 n_dims, n_dims x u64 dims, then the u32 type.
    let n_dims = u32::from_le_bytes(gguf[at..at + 4].try_into().unwrap()) as usize;
    let ty = at + 4 + 8 * n_dims;
    let mut bad = gguf.clone();
    bad[ty..ty + 4].copy_from_slice(&16u32.to_le_bytes());
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("iq2.gguf");
    std::fs::write(&p, &bad).unwrap();
    assert_one_line_error(&p, "IQ2_XXS");
}

/// `--devices` names what is wrong with it, and a build without the `cuda`
/// feature says how to get one, in one line each.
#[test]
fn bad_or_unavailable_devices_are_one_line_errors() {
    let model = fixtures().join("llama-f32");
    let run = |devices: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_corridor"))
            .args([
                "--log",
                "error",
                "generate",
                "--prompt",
                "hi",
                "--max-tokens",
                "1",
                "--devices",
                devices,
                "--model",
            ])
            .arg(&model)
            .output()
            .expect("the binary runs");
        (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).to_string())
    };
    for (devices, needle) in [
        ("cuda:zero", "neither an ordinal nor a GPU-<uuid>"),
        ("cuda:0,0", "listed twice"),
        ("tpu", "expected cpu, sim:SIZE"),
    ] {
        let (code, err) = run(devices);
        assert_eq!(code, 1, "--devices {devices}: exit {code}, stderr: {err}");
        assert!(err.contains(needle) && !err.contains("panicked"), "--devices {devices}: {err}");
        assert_eq!(err.lines().filter(|l| !l.trim().is_empty()).count(), 1, "{err}");
    }
    #[cfg(not(feature = "cuda"))]
    {
        let (code, err) = run("cuda:0");
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("built without CUDA support") && err.contains("--features cuda"), "{err}");
    }
}

#[test]
fn a_bad_sim_link_is_a_one_line_error_naming_the_flag() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_corridor"))
            .args(["--log", "error", "serve", "--model"])
            .arg(fixtures().join("llama-f32"))
            .args(args)
            .output()
            .expect("the binary runs");
        (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let (code, err) = run(&["--sim-link", "16GB,5us"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--sim-link") && err.contains("link bandwidth '16GB'"), "{err}");
    let (code, err) = run(&["--sim-link", "16GB/s,5us", "--devices", "cuda:0"]);
    assert_eq!(code, 1, "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.lines().any(|l| l.starts_with("error: ") && l.contains("--sim-link")), "{err}");
}

#[test]
fn a_stall_ratio_no_step_could_keep_is_refused_by_name() {
    for bad in ["0.5", "-1", "nan", "inf", "fast"] {
        let out = Command::new(env!("CARGO_BIN_EXE_corridor"))
            .args(["--log", "error", "serve", &format!("--itl-stall-ratio={bad}"), "--model"])
            .arg(fixtures().join("llama-f32"))
            .output()
            .expect("the binary runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains("--itl-stall-ratio"), "{bad}: {err}");
    }
}
