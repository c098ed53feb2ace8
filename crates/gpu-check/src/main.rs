//! `corridor-gpu-check`: the tiny checkpoints through the real forward pass
//! on the CUDA backend against the CPU (the comparison is in `lib.rs`).
//!
//! Usage: corridor-gpu-check <fixtures dir> (tests/fixtures/tiny), or
//!        corridor-gpu-check <SmolLM2-135M-Instruct.Q4_1.gguf> for the "Paris" check, or
//!        corridor-gpu-check logits <checkpoint> <id,id,...> <out.f32>: one
//!        prefill of the ids on the GPU, the logits of every position written
//!        as raw little-endian f32 `[positions, vocab]`
//!        (scripts/gpu/compare_logits.py compares them with transformers).
//!
//! Built with `--features cuda` for the GPU machine (scripts/gpu/check.sh);
//! without it the binary says so and exits with status 2.

#[cfg(feature = "cuda")]
fn main() {
    use corridor_backend::cuda::{rounds_matmul_input, CudaBackend, CudaBackendConfig};
    use corridor_backend::DType;
    use corridor_gpu_check::{all_logits, check_fixtures, device_reference, paris};
    use corridor_model::Checkpoint;
    use std::path::Path;

    let dir = std::env::args().nth(1).unwrap_or_else(|| "tests/fixtures/tiny".into());
    let gpu = CudaBackend::new(CudaBackendConfig::default()).expect("cuda backend");
    if dir == "logits" {
        let a: Vec<String> = std::env::args().skip(2).collect();
        let [model, ids, out] = &a[..] else {
            eprintln!("usage: corridor-gpu-check logits <checkpoint> <id,id,...> <out.f32>");
            std::process::exit(2);
        };
        let ids: Vec<u32> = ids.split(',').map(|t| t.trim().parse().expect("token id")).collect();
        let ckpt = Checkpoint::open(Path::new(model)).expect("checkpoint opens");
        let logits = all_logits(&gpu, &ckpt, &ids);
        let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(out, bytes).expect("write logits");
        println!("wrote {} x {} logits to {out}", ids.len(), logits.len() / ids.len().max(1));
        return;
    }
    if dir.ends_with(".gguf") {
        std::process::exit(i32::from(!paris(&gpu, Path::new(&dir))));
    }
    // The reference rounds what this backend rounds: a checkpoint's f32 and
    // f16 matrices are bf16 on the device, and its GEMMs take bf16 inputs.
    fn like_cuda(dtype: DType, n: usize, k: usize, rows: usize) -> bool {
        let held = if matches!(dtype, DType::F32 | DType::F16) { DType::BF16 } else { dtype };
        rounds_matmul_input(held, n, k, rows)
    }
    let (_, failures) = check_fixtures(&gpu, &device_reference(like_cuda), Path::new(&dir));
    println!("{failures} checkpoints failed");
    std::process::exit(i32::from(failures > 0));
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!(
        "corridor-gpu-check was built without the CUDA backend: cargo build -p corridor-gpu-check --features cuda"
    );
    std::process::exit(2);
}
