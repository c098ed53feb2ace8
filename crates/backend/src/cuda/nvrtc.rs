//! Kernels compiled at run time by NVRTC, to CUBIN for the exact device, and
//! cached on disk.
//!
//! CUBIN rather than PTX: a newer NVRTC than the driver emits PTX the driver
//! cannot JIT, while machine code for `sm_XY` runs on any driver that knows
//! the chip. The cache file is named by a hash of the source, the options and
//! the NVRTC version, so a change to any of them compiles afresh.

use crate::{BackendError, Result};
use cudarc::nvrtc::{result as nv, sys as nvsys};
use std::ffi::CString;
use std::path::{Path, PathBuf};

/// The kernel sources, concatenated into one program (one compile, one module).
pub const SOURCES: &[&str] = &[
    include_str!("../../kernels/dtypes.cu"),
    include_str!("../../kernels/common.cu"),
    include_str!("../../kernels/reduce.cu"),
    include_str!("../../kernels/q8.cu"),
    include_str!("../../kernels/parts.cu"),
    include_str!("../../kernels/blocks.cu"),
    include_str!("../../kernels/elementwise.cu"),
    include_str!("../../kernels/stacked.cu"),
    include_str!("../../kernels/fold.cu"),
    include_str!("../../kernels/gemv.cu"),
    include_str!("../../kernels/mmvq.cu"),
    include_str!("../../kernels/mmq.cu"),
    include_str!("../../kernels/attention.cu"),
    include_str!("../../kernels/delta.cu"),
    include_str!("../../kernels/moe.cu"),
    include_str!("../../kernels/moe_q8.cu"),
    include_str!("../../kernels/sample.cu"),
];

/// NVRTC's version as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters.
    unsafe { nvsys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| BackendError::Cuda { op: "nvrtcVersion", reason: format!("{e:?}") })?;
    Ok((major, minor))
}

/// 64-bit FNV-1a: stable across Rust versions and platforms, unlike std's hasher.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for b in p.iter().chain(&[0xffu8]) {
            h ^= *b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    h
}

/// Where a compiled program lives in the cache.
pub fn cache_path(dir: &Path, source: &str, options: &[String], version: (i32, i32)) -> PathBuf {
    let opts = options.join("\u{1}");
    let ver = format!("{}.{}", version.0, version.1);
    let h = fnv1a(&[source.as_bytes(), opts.as_bytes(), ver.as_bytes()]);
    dir.join(format!("{h:016x}.cubin"))
}

/// The result of [`compile_cubin`]: the machine code and whether it came from the cache.
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub from_cache: bool,
    pub path: Option<PathBuf>,
}

/// Compile `source` for `arch` (e.g. "sm_90"), reading and writing the cache
/// in `cache_dir` when one is given. A cache that cannot be written is not an
/// error: the kernels still work, they are just compiled again next time.
pub fn compile_cubin(source: &str, arch: &str, cache_dir: Option<&Path>) -> Result<Compiled> {
    let options =
        vec![format!("--gpu-architecture={arch}"), "--std=c++17".to_string(), "-lineinfo".to_string()];
    let version = nvrtc_version()?;
    let path = cache_dir.map(|d| cache_path(d, source, &options, version));
    if let Some(p) = &path {
        if let Ok(cubin) = std::fs::read(p) {
            if !cubin.is_empty() {
                return Ok(Compiled { cubin, from_cache: true, path });
            }
        }
    }
    let src =
        CString::new(source).map_err(|_| BackendError::Other("kernel source contains a NUL byte".into()))?;
    let name = CString::new("corridor.cu").expect("no NUL in a literal");
    let prog = nv::create_program(&src, Some(&name))
        .map_err(|e| BackendError::Cuda { op: "nvrtcCreateProgram", reason: format!("{e:?}") })?;
    // SAFETY: `prog` is live until destroy_program below; the log and CUBIN
    // buffers are sized by NVRTC's own size queries.
    let result = unsafe {
        let compiled = nv::compile_program(prog, &options);
        if let Err(e) = compiled {
            let log = nv::get_program_log(prog)
                .map(|l| l.iter().map(|&c| c as u8 as char).collect::<String>())
                .unwrap_or_default();
            Err(BackendError::Cuda { op: "nvrtcCompileProgram", reason: format!("{e:?}\n{log}") })
        } else {
            let mut size = 0usize;
            let r = nvsys::nvrtcGetCUBINSize(prog, &mut size).result();
            let mut cubin = vec![0u8; size];
            let r2 = r.and_then(|_| nvsys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut _).result());
            r2.map(|_| cubin)
                .map_err(|e| BackendError::Cuda { op: "nvrtcGetCUBIN", reason: format!("{e:?}") })
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { nv::destroy_program(prog) };
    let cubin = result?;
    if let (Some(p), Some(d)) = (&path, cache_dir) {
        // Write to a temporary name and rename, so a concurrent reader never
        // sees half a file.
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::create_dir_all(d).is_ok() && std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok(Compiled { cubin, from_cache: false, path })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_name_changes_with_source_options_and_version() {
        let d = Path::new("/c");
        let o = vec!["--gpu-architecture=sm_90".to_string()];
        let a = cache_path(d, "x", &o, (13, 0));
        assert_eq!(a, cache_path(d, "x", &o, (13, 0)));
        assert_ne!(a, cache_path(d, "y", &o, (13, 0)));
        assert_ne!(a, cache_path(d, "x", &["--gpu-architecture=sm_80".to_string()], (13, 0)));
        assert_ne!(a, cache_path(d, "x", &o, (13, 1)));
    }

    /// The parameters of each kernel, from `__global__` to its closing
    /// parenthesis (macro bodies included), for every source.
    fn kernel_params() -> Vec<(String, usize)> {
        let mut found = Vec::new();
        for src in SOURCES {
            let mut rest = *src;
            while let Some(at) = rest.find("__global__") {
                rest = &rest[at + "__global__".len()..];
                let open = rest.find('(').expect("a kernel's parameter list");
                // `__launch_bounds__(...)` comes before the name: skip to the name's list.
                let (head, mut body) = rest.split_at(open);
                let mut name = head.split_whitespace().last().unwrap_or("").to_string();
                if head.trim_end().ends_with("__launch_bounds__") {
                    let close = body.find(')').unwrap();
                    body = &body[close + 1..];
                    let open2 = body.find('(').unwrap();
                    name = body[..open2].split_whitespace().last().unwrap_or("").to_string();
                    body = &body[open2..];
                }
                let (mut depth, mut commas, mut empty) = (0, 0, true);
                for c in body.chars() {
                    match c {
                        '(' => depth += 1,
                        ')' => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        ',' if depth == 1 => commas += 1,
                        c if depth == 1 && !c.is_whitespace() && c != '\\' => empty = false,
                        _ => {}
                    }
                }
                found.push((name, if empty { 0 } else { commas + 1 }));
            }
        }
        found
    }

    #[test]
    fn every_kernel_fits_the_launch_argument_slots() {
        let kernels = kernel_params();
        assert!(kernels.len() > 40, "found only {} kernels", kernels.len());
        let rope =
            kernels.iter().find(|(n, _)| n.starts_with("attn_tile_rope_g")).expect("the RoPE tile kernel");
        assert_eq!(rope.1, 32, "{rope:?}");
        for (name, n) in &kernels {
            assert!(*n <= super::super::device::ARGS_MAX, "{name} takes {n} parameters");
        }
    }
}
