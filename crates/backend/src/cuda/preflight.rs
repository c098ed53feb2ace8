//! Start-up checks of the GPU libraries, before anything can panic.
//!
//! cudarc loads each library by name on first use and panics when one is
//! missing, so the backend asks first (`is_culib_present`), turns a miss into
//! an error naming every missing library, and reports the version and the
//! file each library was loaded from (read from `/proc/self/maps`), including
//! the case of two copies of one library mapped at once.

use crate::{BackendError, Result};

/// One library as found at start-up.
#[derive(Clone, Debug)]
pub struct LibraryReport {
    /// The library's short name ("libcuda", "libnvrtc", ...).
    pub name: &'static str,
    pub version: String,
    /// Every distinct file of this library mapped into the process (more than
    /// one means two copies are loaded, which breaks cuBLASLt).
    pub paths: Vec<String>,
}

/// What the preflight found.
#[derive(Clone, Debug)]
pub struct Preflight {
    pub libraries: Vec<LibraryReport>,
}

impl Preflight {
    /// Libraries mapped from more than one file.
    pub fn duplicates(&self) -> Vec<&LibraryReport> {
        self.libraries.iter().filter(|l| l.paths.len() > 1).collect()
    }
}

impl std::fmt::Display for Preflight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for l in &self.libraries {
            let paths = if l.paths.is_empty() {
                "(path not found in /proc/self/maps)".to_string()
            } else {
                l.paths.join(", ")
            };
            writeln!(f, "{:<14} {:<12} {}", l.name, l.version, paths)?;
        }
        Ok(())
    }
}

/// Files mapped into this process whose name contains `stem`.
fn mapped_paths(maps: &str, stem: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in maps.lines() {
        if let Some(path) = line.split_whitespace().nth(5) {
            let file = path.rsplit('/').next().unwrap_or(path);
            if file.starts_with(stem) && !out.iter().any(|p| p == path) {
                out.push(path.to_string());
            }
        }
    }
    out
}

/// Check libcuda, libnvrtc, libcublasLt and libnvidia-ml, load them, and report
/// versions and paths. Fails with one error naming every missing library.
pub fn preflight() -> Result<Preflight> {
    // SAFETY: each call only tries to dlopen the library by its usual names.
    let present = unsafe {
        [
            ("libcuda", cudarc::driver::sys::is_culib_present()),
            ("libnvrtc", cudarc::nvrtc::sys::is_culib_present()),
            ("libcublasLt", cudarc::cublaslt::sys::is_culib_present()),
        ]
    };
    let nvml = nvml_wrapper::Nvml::init();
    let mut missing: Vec<String> = present.iter().filter(|(_, ok)| !ok).map(|(n, _)| n.to_string()).collect();
    if let Err(e) = &nvml {
        missing.push(format!("libnvidia-ml ({e})"));
    }
    if !missing.is_empty() {
        return Err(BackendError::MissingLibrary { missing: missing.join(", ") });
    }
    let mut driver = 0i32;
    // SAFETY: an out-parameter; the library is present.
    let _ = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) };
    let nvrtc = super::nvrtc::nvrtc_version()?;
    // SAFETY: the library is present.
    let lt = unsafe { cudarc::cublaslt::sys::cublasLtGetVersion() };
    let nvml_ver = nvml.as_ref().ok().and_then(|n| n.sys_driver_version().ok()).unwrap_or_default();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let libraries = vec![
        LibraryReport {
            name: "libcuda",
            version: format!("{}.{}", driver / 1000, (driver % 1000) / 10),
            paths: mapped_paths(&maps, "libcuda.so"),
        },
        LibraryReport {
            name: "libnvrtc",
            version: format!("{}.{}", nvrtc.0, nvrtc.1),
            paths: mapped_paths(&maps, "libnvrtc.so"),
        },
        LibraryReport {
            name: "libcublasLt",
            version: lt.to_string(),
            paths: mapped_paths(&maps, "libcublasLt.so"),
        },
        LibraryReport {
            name: "libnvidia-ml",
            version: nvml_ver,
            paths: mapped_paths(&maps, "libnvidia-ml.so"),
        },
    ];
    Ok(Preflight { libraries })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_parsing_finds_each_distinct_copy() {
        let maps = "7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libcuda.so.580.1\n\
                    7f10-7f20 r--p 00010000 08:01 1 /usr/lib/libcuda.so.580.1\n\
                    7f20-7f30 r-xp 00000000 08:01 2 /a/libcublasLt.so.13\n\
                    7f30-7f40 r-xp 00000000 08:01 3 /b/libcublasLt.so.13\n\
                    7f40-7f50 rw-p 00000000 00:00 0\n";
        assert_eq!(mapped_paths(maps, "libcuda.so"), vec!["/usr/lib/libcuda.so.580.1"]);
        assert_eq!(mapped_paths(maps, "libcublasLt.so").len(), 2);
        assert!(mapped_paths(maps, "libnvrtc.so").is_empty());
    }
}
