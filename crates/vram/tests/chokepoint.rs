//! The chokepoint holds: no crate but `vram` names a driver allocator.
//!
//! Every device byte must be booked under a purpose by the per-card
//! chokepoint, so a call to a raw allocator anywhere else would be memory
//! the books cannot see. This test reads every `crates/*/src` file outside
//! `crates/vram` and fails on any of the names below.

use std::path::{Path, PathBuf};

/// Driver and library calls that take device memory, and the sealed raw
/// primitives of this crate's cards.
const FORBIDDEN: &[&str] = &[
    "cuMemAlloc",
    "cuMemAllocAsync",
    "cuMemAllocManaged",
    "cuMemCreate",
    "cuMemMap",
    "cuMemAddressReserve",
    "cuMemHostAlloc",
    "cudaMalloc",
    "malloc_sync",
    "malloc_async",
    "alloc_zeros",
    "alloc_async",
    "clone_htod",
    "raw_alloc",
    "raw_free",
    "reserve_va",
];

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

/// Every (file, line number, name) where a forbidden name appears in the
/// `src` folders of the crates under `crates_dir`, except `skip`.
fn offenders(crates_dir: &Path, skip: &str) -> Vec<(PathBuf, usize, &'static str)> {
    let mut found = Vec::new();
    let Ok(crates) = std::fs::read_dir(crates_dir) else { return found };
    for krate in crates.flatten() {
        if krate.file_name() == skip {
            continue;
        }
        let mut files = Vec::new();
        rust_files(&krate.path().join("src"), &mut files);
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            for (i, line) in text.lines().enumerate() {
                for name in FORBIDDEN {
                    if line.contains(name) {
                        found.push((file.clone(), i + 1, *name));
                    }
                }
            }
        }
    }
    found
}

#[test]
fn no_crate_outside_vram_calls_a_driver_allocator() {
    let crates_dir = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("crates/ above crates/vram");
    let mut scanned = 0;
    for krate in std::fs::read_dir(crates_dir).expect("crates/ is readable").flatten() {
        scanned += usize::from(krate.path().join("src").is_dir());
    }
    assert!(scanned >= 2, "the scan must see the workspace's crates (saw {scanned})");
    let found = offenders(crates_dir, "vram");
    assert!(
        found.is_empty(),
        "device memory must be taken through corridor_vram::Device; found: {}",
        found.iter().map(|(f, l, n)| format!("{}:{l} {n}", f.display())).collect::<Vec<_>>().join(", ")
    );
}

#[test]
fn the_scan_finds_a_planted_call() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("engine").join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("lib.rs"), "fn f() { let p = stream.alloc_zeros::<f32>(4); }\n").unwrap();
    std::fs::create_dir_all(dir.path().join("vram").join("src")).unwrap();
    std::fs::write(dir.path().join("vram").join("src").join("lib.rs"), "fn raw_alloc() {}\n").unwrap();
    let found = offenders(dir.path(), "vram");
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].2, "alloc_zeros");
}
