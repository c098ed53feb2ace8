//! The workspace's crates depend on each other one way only (DESIGN.md §2):
//! units ← vram ← backend ← model ← engine ← server ← cli, with bench beside
//! them. A dependency that points up the stack fails this test.

use std::process::Command;

/// Each crate with the layer it sits in; a crate may depend only on crates in
/// lower layers.
const LAYERS: &[(&str, u32)] = &[
    ("corridor-units", 0),
    ("corridor-vram", 1),
    ("corridor-backend", 2),
    ("corridor-model", 3),
    ("corridor-engine", 4),
    ("corridor-bench", 4),
    // The GPU check: a binary over model and backend, beside the engine.
    ("corridor-gpu-check", 4),
    ("corridor-server", 5),
    ("corridor-cli", 6),
];

fn layer(name: &str) -> Option<u32> {
    LAYERS.iter().find(|(n, _)| *n == name).map(|(_, l)| *l)
}

#[test]
fn dependencies_point_down_the_stack() {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut checked = 0;
    for pkg in meta["packages"].as_array().unwrap() {
        let name = pkg["name"].as_str().unwrap();
        let Some(mine) = layer(name) else { panic!("{name} is not placed in a layer: add it to LAYERS") };
        for dep in pkg["dependencies"].as_array().unwrap() {
            // Dev-dependencies may reach up (a test can drive a higher layer).
            if dep["kind"].as_str() == Some("dev") {
                continue;
            }
            let d = dep["name"].as_str().unwrap();
            if let Some(theirs) = layer(d) {
                assert!(
                    theirs < mine,
                    "{name} (layer {mine}) depends on {d} (layer {theirs}): dependencies must point down"
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 10, "only {checked} internal edges checked; is the workspace intact?");
}

/// `vram` knows nothing about models or HTTP; `model` nothing about
/// scheduling or HTTP; only `server` knows HTTP.
#[test]
fn lower_layers_do_not_pull_in_http() {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for pkg in meta["packages"].as_array().unwrap() {
        let name = pkg["name"].as_str().unwrap();
        if !matches!(
            name,
            "corridor-units" | "corridor-vram" | "corridor-backend" | "corridor-model" | "corridor-engine"
        ) {
            continue;
        }
        for dep in pkg["dependencies"].as_array().unwrap() {
            let d = dep["name"].as_str().unwrap();
            if dep["kind"].as_str() == Some("dev") {
                continue;
            }
            assert!(
                !matches!(d, "axum" | "hyper" | "tower-http" | "clap"),
                "{name} depends on {d}, which belongs to the edge"
            );
        }
    }
}
