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
//! `--delta-chunked` (anywhere after the fixtures dir) runs the hybrid's
//! prefill through the chunked delta-rule kernel (`CudaTuning::delta_chunked`),
//! `--fold-norm` folds batch-1 residual adds and norms into the GEMVs around
//! them (`CudaTuning::fold_norm`).
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
    let tuning = corridor_backend::CudaTuning {
        delta_chunked: std::env::args().any(|a| a == "--delta-chunked"),
        fold_norm: std::env::args().any(|a| a == "--fold-norm"),
        ..Default::default()
    };
    let gpu = CudaBackend::new(CudaBackendConfig { tuning, ..Default::default() }).expect("cuda backend");
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
    // f16 matrices are bf16 on the device, its GEMMs take bf16 inputs and its
    // integer GEMVs 8-bit ones (the default tuning's, as `gpu` runs).
    fn like_cuda(dtype: DType, n: usize, k: usize, rows: usize) -> corridor_backend::cpu::MatmulInput {
        let held = if matches!(dtype, DType::F32 | DType::F16) { DType::BF16 } else { dtype };
        rounds_matmul_input(held, n, k, rows)
    }
    let reference = device_reference(like_cuda);
    let (_, mut failures) = check_fixtures(&gpu, &reference, Path::new(&dir));
    failures += state_pool_on_card0(&reference, Path::new(&dir));
    println!("{failures} checkpoints failed");
    std::process::exit(i32::from(failures > 0));
}

/// The hybrid with its recurrent state inside a governed state pool on
/// card 0 (as `corridor serve` places it on a GPU: one slot a chunk, the
/// kernels stepping a whole slot), against the CPU.
#[cfg(feature = "cuda")]
fn state_pool_on_card0(reference: &corridor_backend::cpu::CpuBackend, dir: &std::path::Path) -> usize {
    use corridor_backend::cuda::{CudaBackend, CudaBackendConfig};
    use corridor_units::{Bytes, CardId, Pages};
    use corridor_vram::{
        CardSettings, CudaCard, Device, KvArena, KvArenaConfig, Purpose, SystemClock, Urgency,
    };
    use std::sync::Arc;
    if !dir.join("qwen3_5").join("config.json").is_file() {
        // A directory of other checkpoints (tests/fixtures/tiny/kquant) has no hybrid.
        println!("skipped: the state pool on card 0 (no qwen3_5 fixture in {})", dir.display());
        return 0;
    }
    let card = Arc::new(CudaCard::open(CardId(0), 0).expect("card 0 opens"));
    let dev = Device::standalone(card, CardSettings { floor: Bytes::ZERO, ..CardSettings::default() });
    let gpu =
        CudaBackend::on_device(CudaBackendConfig::default(), dev.clone()).expect("cuda backend on card 0");
    let cfg =
        corridor_model::ModelConfig::from_hf_dir(&dir.join("qwen3_5")).expect("the hybrid fixture's config");
    let slot = corridor_model::qwen3_5::state_bytes_per_seq(cfg.hybrid.as_ref().expect("a hybrid"));
    let config = KvArenaConfig {
        page_bytes: slot,
        max_pages: Pages(4),
        chunk_target: slot,
        hold: std::time::Duration::ZERO,
        margin: Bytes::ZERO,
    };
    let pool = KvArena::spanning_as(&[(dev, slot)], config, Purpose::State, Arc::new(SystemClock::new()))
        .expect("a state pool on card 0");
    pool.commit_to(Pages(4), Urgency::Deferrable).expect("the pool commits");
    corridor_gpu_check::check_state_pool(&gpu, reference, dir, Arc::new(pool))
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!(
        "corridor-gpu-check was built without the CUDA backend: cargo build -p corridor-gpu-check --features cuda"
    );
    std::process::exit(2);
}
