//! GPU self-check: preflight, every kernel against the CPU backend, graph
//! capture and replay, and micro-benchmarks. Run on a GPU machine by
//! `scripts/gpu/check.sh`; exits non-zero when any comparison fails.
//! `--bench` runs the micro-benchmarks after the checks, `--bench-only`
//! without them, `--bench-gemm` only cuBLASLt (the host's planning of new
//! row counts, which `--bench-gemm-plans` runs alone, then the split-K
//! schemes at decode batches),
//! `--bench-quant` only the block-format matmuls (every path at 1 to 256 rows;
//! `--bench-quant-short` fewer formats and shapes), `--bench-q8-layer` a decode
//! layer's integer GEMVs as separate and as fused launches, `--bench-attention`
//! one decode row's attention (splits merged in the launch and by a combine pass)
//! and a batch's (8, 32 and 128 sequences of 640 tokens, eager and captured),
//! `--bench-moe` a Qwen3-30B-A3B expert layer with bf16 experts and with a
//! Q4_K_M file's (on the routed integer GEMVs and on the any-type ones),
//! `--bench-sample` the device sampler at 1 to 128 rows (rows scanned in
//! slices first and not), `--sample-checks` the sampler's checks and then
//! that benchmark.
//!
//! `CORRIDOR_CACHE_DIR` (optional) is where compiled kernels are cached.

use corridor_backend::cuda::{check, preflight, CudaBackend, CudaBackendConfig};
use corridor_backend::CudaTuning;
use std::path::PathBuf;
use std::time::Instant;

fn main() {
    if let Err(e) = run() {
        eprintln!("cuda_check: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let pf = preflight()?;
    print!("preflight:\n{pf}");
    for d in pf.duplicates() {
        println!("WARNING: {} is mapped from {} files", d.name, d.paths.len());
    }
    let cache = std::env::var_os("CORRIDOR_CACHE_DIR").map(|d| PathBuf::from(d).join("kernels"));
    let t = Instant::now();
    // Every switch on, the L2 prefetch and the attention fusions too, so the checks run every
    // path serving may take (the attention checks also run with the splits merged by a combine
    // pass, and RoPE before attention).
    let tuning = CudaTuning { l2_prefetch: true, attn_merge: true, attn_rope: true, ..Default::default() };
    let config = CudaBackendConfig {
        kernel_cache_dir: cache.clone(),
        max_pages_per_seq: 512,
        tuning,
        ..Default::default()
    };
    let be = CudaBackend::new(config.clone())?;
    println!(
        "backend {} ready in {:.0} ms",
        corridor_backend::Backend::name(&be),
        t.elapsed().as_secs_f64() * 1e3
    );
    if cache.is_some() {
        let t = Instant::now();
        drop(CudaBackend::new(config)?);
        println!("second start (kernel cache hit): {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
    }
    let flag = |f: &str| std::env::args().any(|a| a == f);
    if flag("--bench-gemm") || flag("--bench-gemm-plans") {
        for l in check::bench_gemm_plans(&be)? {
            println!("{l}");
        }
        if flag("--bench-gemm-plans") {
            return Ok(());
        }
        for l in check::bench_gemm_schemes(&be, &mut 0)? {
            println!("{l}");
        }
        return Ok(());
    }
    if flag("--bench-attention") {
        for l in check::bench_decode_attention(&be)? {
            println!("{l}");
        }
        return Ok(());
    }
    if flag("--sample-checks") {
        let rep = check::sample_only(&be)?;
        for l in &rep.lines {
            println!("{l}");
        }
        println!("{} comparisons, {} failed", rep.lines.len(), rep.failures);
        for l in check::bench_sample(&be)? {
            println!("{l}");
        }
        if rep.failures > 0 {
            return Err(format!("{} comparisons failed", rep.failures).into());
        }
        return Ok(());
    }
    if flag("--bench-sample") {
        for l in check::bench_sample(&be)? {
            println!("{l}");
        }
        return Ok(());
    }
    if flag("--bench-moe") {
        for l in check::bench_moe(&be)? {
            println!("{l}");
        }
        return Ok(());
    }
    if flag("--bench-q8-layer") {
        for l in check::bench_q8_layer(&be, &mut 0)? {
            println!("{l}");
        }
        return Ok(());
    }
    if flag("--bench-quant") || flag("--bench-quant-short") {
        for l in check::bench_quant(&be, &mut 0, flag("--bench-quant-short"))? {
            println!("{l}");
        }
        return Ok(());
    }
    if flag("--bench-only") {
        for l in check::bench(&be)? {
            println!("{l}");
        }
        return Ok(());
    }
    let mut rep = check::run_all(&be)?;
    check::graph_check(&be, &mut rep)?;
    check::delta_graph_check(&be, &mut rep)?;
    check::moe_checks(&be, &mut rep)?;
    for l in &rep.lines {
        println!("{l}");
    }
    println!("{} comparisons, {} failed", rep.lines.len(), rep.failures);
    if flag("--bench") {
        for l in check::bench(&be)? {
            println!("{l}");
        }
    }
    if rep.failures > 0 {
        return Err(format!("{} comparisons failed", rep.failures).into());
    }
    Ok(())
}
