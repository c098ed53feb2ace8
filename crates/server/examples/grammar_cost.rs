//! What constrained decoding costs per engine step: the grammar masks of a
//! batch (computed in parallel across rows, as the engine does) and applying
//! them to the logits, at batch 1 and 32, on a real vocabulary:
//!
//!     cargo run --release -p corridor-server --example grammar_cost -- [TOKENIZER_DIR]
//!
//! TOKENIZER_DIR holds a `tokenizer.json` (default: the Qwen3 tokenizer that
//! `scripts/fetch_test_assets.sh` puts under `target/test-assets`, 151,669
//! ids). Each row walks a JSON schema choosing a pseudo-random allowed token
//! per step (a model with no preference), restarting when its document ends.
//! Wall time on whatever machine runs it: compare runs on one machine only.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use corridor_engine::sampling::Constraint;
use corridor_server::grammar::GrammarCompiler;
use corridor_server::tokenizer::Tokenizer;
use rayon::prelude::*;
use serde_json::json;

fn main() {
    let dir = std::env::args().nth(1).map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/test-assets/qwen3-tokenizer")
    });
    let tokenizer = Arc::new(Tokenizer::from_hf_dir(&dir).expect("tokenizer"));
    let vocab = tokenizer.vocab_size();
    let eos = tokenizer.eos_ids().to_vec();
    let built = Instant::now();
    let compiler = GrammarCompiler::new(tokenizer.clone(), vocab, &eos).expect("compiler");
    println!("vocabulary {vocab} ids; compiler built in {:.1} ms", built.elapsed().as_secs_f64() * 1e3);
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "maxLength": 40},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
            "active": {"type": "boolean"}
        },
        "required": ["name", "age", "email", "tags", "active"],
        "additionalProperties": false
    });
    let compiled = Instant::now();
    let fresh = compiler.json_schema(&schema).expect("schema");
    println!("schema compiled in {:.1} ms", compiled.elapsed().as_secs_f64() * 1e3);
    let steps = 64;
    for batch in [1usize, 32] {
        let mut rows: Vec<(Constraint, u64)> = (0..batch).map(|i| (fresh.clone(), i as u64 + 1)).collect();
        let mut logits = vec![0.5f32; batch * vocab];
        let (mut mask_time, mut apply_time) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..steps {
            let t0 = Instant::now();
            let masks: Vec<_> = rows.par_iter_mut().map(|(c, _)| c.0.mask(vocab).expect("mask")).collect();
            let t1 = Instant::now();
            logits.par_chunks_mut(vocab).zip(masks.par_iter()).for_each(|(row, m)| m.apply(row));
            apply_time += t1.elapsed();
            mask_time += t1 - t0;
            for ((c, state), m) in rows.iter_mut().zip(&masks) {
                let allowed: Vec<u32> =
                    (0..vocab as u32).filter(|&t| m.allows(corridor_units::TokenId(t))).collect();
                *state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let token = allowed[(*state >> 33) as usize % allowed.len()];
                if eos.contains(&token) {
                    *c = fresh.clone();
                } else {
                    c.0.accept(corridor_units::TokenId(token)).expect("allowed");
                }
            }
        }
        let per_step = |d: Duration| d.as_secs_f64() * 1e3 / steps as f64;
        println!(
            "batch {batch:>2}: masks {:.3} ms/step, applying them {:.3} ms/step",
            per_step(mask_time),
            per_step(apply_time)
        );
    }
}
