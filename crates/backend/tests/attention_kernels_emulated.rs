//! The tiled prefill attention kernels (kernels/attention.cu, head dims 64,
//! 128 and 256) run on the host, without a GPU: tests/emulation/attention.cpp
//! compiles them against the thread-per-CUDA-thread emulation of
//! tests/emulation/shim.h, with the tensor-core instructions (mma.sync,
//! ldmatrix) emulated from their PTX definitions, and compares each with
//! causal attention over the same paged cache in double precision, so a wrong
//! fragment index, tile stride or output half fails here, in CI. The same
//! kernels on a real GPU are compared with the CPU backend by the GPU
//! self-check (`cuda/check.rs`).
//!
//! Needs a C++20 compiler: `$CXX`, or `c++` on the PATH.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn tiled_attention_kernels_match_the_reference_under_emulation() {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/emulation");
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("attention_kernels_emulated");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let built = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-pthread", "-Wall", "-Wno-unknown-pragmas", "-o"])
        .arg(&out)
        .arg(here.join("attention.cpp"))
        .output()
        .unwrap_or_else(|e| panic!("{cxx} could not be run ({e}): a C++20 compiler is needed (set CXX)"));
    assert!(built.status.success(), "{cxx} failed:\n{}", String::from_utf8_lossy(&built.stderr));
    let run = Command::new(&out).output().expect("the emulated kernels run");
    let report = String::from_utf8_lossy(&run.stdout);
    println!("{report}");
    assert!(run.status.success(), "a kernel differs from its reference:\n{report}");
    assert_eq!(report.matches("PASS").count(), 4, "fewer comparisons than written:\n{report}");
}
