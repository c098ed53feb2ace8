//! CUDA kernels run on the host, without a GPU: each `tests/emulation/*.cpp`
//! compiles kernel sources against the thread-per-CUDA-thread emulation of
//! `tests/emulation/shim.h` and compares them with references in double
//! precision, so a wrong index, fragment, tile stride, lost halo or barrier
//! in the wrong place fails here, in CI. The same kernels on a real GPU are
//! compared with the CPU backend by the GPU self-check (`cuda/check.rs`).
//!
//! - `delta.cpp`: the gated delta-net kernels (kernels/delta.cu) against the
//!   CPU backend's arithmetic, the delta rule by both its kernels, the scan
//!   and the chunked form.
//! - `attention.cpp`: the tiled prefill attention kernels (kernels/attention.cu,
//!   head dims 64, 128 and 256), with the tensor-core instructions (mma.sync,
//!   ldmatrix) emulated from their PTX definitions, and the split-K decode
//!   kernels (per warp and in 32-token tiles, then the combine, whose 8-bit
//!   copy of the output is checked bit for bit), against causal attention
//!   over the same paged cache.
//! - `moe.cpp`: the routed expert FFN's kernels (kernels/moe.cu): routing
//!   and grouping, the bf16 gate/up and down GEMVs, fused with the weighted
//!   sum and per expert, and the grouped GEMM of prefill over bf16 and
//!   block-format experts (the formats of llama.cpp's default mixes decoded
//!   by groups of 8), against the op from its definition.
//! - `mmvq.cpp`: the integer decode GEMVs (kernels/mmvq.cu): the 8-bit
//!   quantization of the input rows bit for bit against the CPU's rule, and
//!   every format's GEMV at every row-count instantiation against the weights
//!   dequantized in double from the format's definition, with one and several
//!   groups of weight rows a block, three matrices in one launch, and gate/up
//!   with their SiLU product, that product's 8-bit copy bit for bit.
//! - `moe_q8.cpp`: the routed integer GEMVs of block-format experts
//!   (kernels/moe_q8.cu) as the MoE decode launches them, gate/up/SiLU, the
//!   products' 8-bit copy and down, every format and Q4_K_M's mix, against
//!   the experts dequantized in double.
//! - `stacked.cpp`: the launches around one GEMM of stacked weights
//!   (kernels/stacked.cu): the split of q/k/v's product with biases, the
//!   SiLU product of gate and up's, against the ops written out plainly.
//! - `fold.cpp`: the residual add + RMSNorm folded into the GEMVs around
//!   it (kernels/fold.cu): the producer's epilogue over blocks of four and
//!   of two rows, a consumer grid's 1 / rms (the same bits in every block)
//!   and its store of the norm, and `fold_settle`, against the op in double.
//! - `mmq.cpp`: the tensor-core matmul of block-format weights
//!   (kernels/mmq.cu, with the decoders of kernels/blocks.cu) for the formats
//!   with word-wise decoders, at every group size, with K slices and their
//!   reduction, against the weights dequantized in double; copies land at
//!   their cp.async wait, reads past the weights or the input fail.
//!
//! Shared by the programs: `shim.h` (threads, barriers, vector types, warp
//! shuffles), `mma.h` (shared-memory addresses, cp.async, mma.sync,
//! ldmatrix), `formats.h` (the block formats' reference decoders and
//! random blocks), `q8.h` (the 8-bit rule of the GEMVs' inputs),
//! `mmvq_ref.h` (the integer GEMVs compiled, random matrices and inputs with
//! their reference dots), `block_sum.h` (kernels/reduce.cu's block-wide sum) and
//! `checks.h` (pass/fail lines, random vectors, the guard value).
//!
//! Needs a C++20 compiler: `$CXX`, or `c++` on the PATH.

use std::path::PathBuf;
use std::process::Command;

/// Build and run `tests/emulation/{name}.cpp`; its report, after asserting it passed.
fn run_emulated(name: &str) -> String {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/emulation");
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}_kernels_emulated"));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let built = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-pthread", "-Wall", "-Wno-unknown-pragmas", "-o"])
        .arg(&out)
        .arg(here.join(format!("{name}.cpp")))
        .output()
        .unwrap_or_else(|e| panic!("{cxx} could not be run ({e}): a C++20 compiler is needed (set CXX)"));
    assert!(built.status.success(), "{cxx} failed:\n{}", String::from_utf8_lossy(&built.stderr));
    let run = Command::new(&out).output().expect("the emulated kernels run");
    let report = String::from_utf8_lossy(&run.stdout).into_owned();
    println!("{report}");
    assert!(run.status.success(), "a kernel differs from its reference:\n{report}");
    report
}

#[test]
fn delta_kernels_match_the_cpu_arithmetic_under_emulation() {
    let report = run_emulated("delta");
    assert!(report.matches("PASS").count() >= 189, "fewer comparisons than written:\n{report}");
}

#[test]
fn attention_kernels_match_the_reference_under_emulation() {
    let report = run_emulated("attention");
    assert_eq!(report.matches("PASS").count(), 22, "fewer comparisons than written:\n{report}");
    assert_eq!(
        report.matches("output quantized bit for bit").count(),
        12,
        "the 8-bit copy of the combine pass and of the merge in the launch:\n{report}"
    );
}

#[test]
fn moe_kernels_match_the_reference_under_emulation() {
    let report = run_emulated("moe");
    assert_eq!(report.matches("PASS").count(), 55, "fewer comparisons than written:\n{report}");
    assert_eq!(
        report.matches("decoded by groups of 8 (no load_elem)").count(),
        3,
        "the grouped GEMM's word-wise decoders:\n{report}"
    );
}

#[test]
fn integer_decode_gemvs_match_the_block_definitions_under_emulation() {
    let report = run_emulated("mmvq");
    assert_eq!(report.matches("PASS").count(), 248, "fewer comparisons than written:\n{report}");
    assert_eq!(report.matches(" p1").count(), 84, "the pipelined one-row kernels:\n{report}");
    assert_eq!(
        report.matches("product quantized bit for bit").count(),
        36,
        "the SiLU product's 8-bit copy:\n{report}"
    );
}

#[test]
fn routed_integer_expert_gemvs_match_the_block_definitions_under_emulation() {
    let report = run_emulated("moe_q8");
    assert_eq!(report.matches("PASS").count(), 15, "fewer comparisons than written:\n{report}");
}

#[test]
fn mmq_kernels_match_the_reference_under_emulation() {
    let report = run_emulated("mmq");
    assert_eq!(report.matches("PASS").count(), 39, "fewer comparisons than written:\n{report}");
}

#[test]
fn stacked_matmul_kernels_match_the_plain_ops_under_emulation() {
    let report = run_emulated("stacked");
    assert!(report.contains("0 failed"), "{report}");
}

#[test]
fn folded_norm_kernels_match_the_plain_op_under_emulation() {
    let report = run_emulated("fold");
    assert!(report.contains("0 failed"), "{report}");
    assert_eq!(report.matches("ok  ").count(), 24, "fewer comparisons than written:\n{report}");
}
