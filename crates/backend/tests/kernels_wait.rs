//! Every CUDA kernel waits for the kernels ahead of it on the device.
//!
//! The CUDA backend launches kernels with programmatic dependent launch: a
//! kernel may start while the one before it is still running, and only its
//! own `pdl_enter()` (or `pdl_wait()`) orders it after that one. A kernel
//! without the wait would read half-written activations. This test reads the
//! kernel sources (it needs no GPU) and fails for any `__global__` kernel
//! whose body, and every `__device__` function its body reaches, never waits.

use std::collections::HashMap;

/// The text between the `{` at or after `from` and its matching `}`.
fn block(src: &str, from: usize) -> Option<&str> {
    let open = from + src[from..].find('{')?;
    let mut depth = 0usize;
    for (i, c) in src[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&src[open + 1..open + i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// The identifier that ends right before `end` (skipping spaces).
fn ident_before(src: &str, end: usize) -> &str {
    let head = src[..end].trim_end();
    let start = head.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
    &head[start..]
}

fn waits(body: &str) -> bool {
    body.contains("pdl_enter()") || body.contains("pdl_wait()")
}

#[test]
fn every_kernel_waits_for_the_one_ahead() {
    // The sources the backend compiles, as src/cuda/nvrtc.rs lists them.
    let root = env!("CARGO_MANIFEST_DIR");
    let list = std::fs::read_to_string(format!("{root}/src/cuda/nvrtc.rs")).expect("nvrtc.rs");
    let files: Vec<&str> =
        list.split("include_str!(\"../../kernels/").skip(1).filter_map(|s| s.split('"').next()).collect();
    assert!(files.len() >= 4, "kernel sources not found in nvrtc.rs: {files:?}");
    let src: String = files
        .iter()
        .map(|f| std::fs::read_to_string(format!("{root}/kernels/{f}")).expect("kernel source"))
        .collect();
    // Device functions by name -> body.
    let mut device: HashMap<&str, &str> = HashMap::new();
    for (at, _) in src.match_indices("__device__") {
        let Some(paren) = src[at..].find('(').map(|p| at + p) else { continue };
        let name = ident_before(&src, paren);
        if let Some(body) = block(&src, paren) {
            device.insert(name, body);
        }
    }
    // A device function waits when its body does or when it calls one that
    // does (a kernel's body may reach the wait a few calls down).
    let calls = |body: &str, f: &str| body.contains(&format!("{f}(")) || body.contains(&format!("{f}<"));
    let mut waiting: Vec<&str> = device.iter().filter(|(_, b)| waits(b)).map(|(f, _)| *f).collect();
    loop {
        let more: Vec<&str> = device
            .iter()
            .filter(|(f, b)| !waiting.contains(f) && waiting.iter().any(|w| calls(b, w)))
            .map(|(f, _)| *f)
            .collect();
        if more.is_empty() {
            break;
        }
        waiting.extend(more);
    }
    let mut kernels = 0;
    let mut missing = Vec::new();
    for (at, _) in src.match_indices("__global__") {
        // The kernel's parameter list opens at the first '(' after its name,
        // past an optional __launch_bounds__(...).
        let mut rest = at;
        let paren = loop {
            let p = rest + src[rest..].find('(').expect("a parameter list");
            if ident_before(&src, p) == "__launch_bounds__" {
                rest = p + src[p..].find(')').expect("closing )") + 1;
                continue;
            }
            break p;
        };
        let name = ident_before(&src, paren);
        let body = block(&src, paren).expect("a kernel body");
        kernels += 1;
        let calls_waiting = waiting.iter().any(|f| calls(body, f));
        if !(waits(body) || calls_waiting) {
            missing.push(name.to_string());
        }
    }
    assert!(kernels >= 20, "found only {kernels} kernels: the source scan is broken");
    assert!(missing.is_empty(), "kernels that never wait for the one ahead (add pdl_enter()): {missing:?}");
}
