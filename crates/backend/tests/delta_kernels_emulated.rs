//! The gated delta-net kernels (kernels/delta.cu) run on the host, without
//! a GPU: tests/emulation/delta.cpp compiles them against a thread-per-CUDA-
//! thread emulation (tests/emulation/shim.h) and compares every kernel with
//! references written out from the CPU backend's arithmetic (the delta rule
//! by both its kernels, the scan and the chunked form), so a wrong index, a
//! lost halo or a barrier in the wrong place fails here, in CI.
//! The same kernels on a real GPU are compared with the CPU backend by the
//! GPU self-check (`cuda/check.rs`).
//!
//! Needs a C++20 compiler: `$CXX`, or `c++` on the PATH.

use std::path::PathBuf;
use std::process::Command;

#[test]
fn delta_kernels_match_the_cpu_arithmetic_under_emulation() {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/emulation");
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("delta_kernels_emulated");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let built = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-pthread", "-Wall", "-Wno-unknown-pragmas", "-o"])
        .arg(&out)
        .arg(here.join("delta.cpp"))
        .output()
        .unwrap_or_else(|e| panic!("{cxx} could not be run ({e}): a C++20 compiler is needed (set CXX)"));
    assert!(built.status.success(), "{cxx} failed:\n{}", String::from_utf8_lossy(&built.stderr));
    let run = Command::new(&out).output().expect("the emulated kernels run");
    let report = String::from_utf8_lossy(&run.stdout);
    println!("{report}");
    assert!(run.status.success(), "a kernel differs from its reference:\n{report}");
    assert!(report.matches("PASS").count() >= 189, "fewer comparisons than written:\n{report}");
}
