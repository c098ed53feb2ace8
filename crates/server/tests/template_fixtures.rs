//! Real chat templates rendered exactly as transformers renders them.
//!
//! `tests/fixtures/templates/cases.json` and the `.jinja` files beside it are
//! written by `scripts/make_template_fixtures.py`, which renders each
//! conversation with transformers' own renderer (its clock frozen at
//! `now_unix`); this test renders the same inputs and compares byte for byte.

use std::path::PathBuf;
use std::time::{Duration, UNIX_EPOCH};

use corridor_server::template::{ChatTemplate, RenderOptions, TemplateError};
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/templates")
}

#[test]
fn renders_match_transformers() {
    let dir = fixtures();
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 40, "fixture set shrank to {}", cases.len());

    let mut failures = Vec::new();
    for case in cases {
        let name = case["template"].as_str().unwrap();
        let label = format!("{name} / {}", case["conversation"].as_str().unwrap());
        let source = std::fs::read_to_string(dir.join(name)).unwrap();
        let template = ChatTemplate::new(&source, case["bos_token"].as_str(), case["eos_token"].as_str())
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        let opts = RenderOptions {
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            tools: Some(case["tools"].clone()).filter(|t| !t.is_null()),
            kwargs: case["kwargs"].as_object().cloned().unwrap_or_default(),
            now: Some(UNIX_EPOCH + Duration::from_secs(case["now_unix"].as_u64().unwrap())),
        };
        let result = template.render(&case["messages"], &opts);
        match (case.get("expected"), case.get("expected_error"), result) {
            (Some(want), _, Ok(got)) if want.as_str() == Some(got.as_str()) => {}
            (Some(want), _, got) => {
                failures.push(format!("{label}\n--- want\n{}\n--- got\n{got:?}", want.as_str().unwrap()))
            }
            (None, Some(want), Err(TemplateError::Raised { message, .. }))
                if want.as_str() == Some(message.as_str()) => {}
            (None, want, got) => failures.push(format!("{label}: want error {want:?}, got {got:?}")),
        }
    }
    println!("{}/{} template cases match transformers", cases.len() - failures.len(), cases.len());
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n\n"));
}
