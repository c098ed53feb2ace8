//! The real SmolLM2-135M-Instruct (GGUF, Q8_0 embedding and Q4_1 matrices)
//! answers "What is the capital of France?" with "The capital of France is
//! Paris." under greedy decoding. Token ids are the model's own (the GGUF
//! carries its tokenizer): this checks the GGUF reader, the quantized kernels,
//! the interleaved RoPE and tied embeddings on a trained model at once.
//!
//! The model comes from `corridor pull` (its cache, or `CORRIDOR_CACHE_DIR`).
//! Without it the test prints a notice and passes, unless
//! `CORRIDOR_REQUIRE_ASSETS` is set (CI sets it, so there it fails loudly).

use corridor_backend::cpu::CpuBackend;
use corridor_model::greedy::greedy;
use corridor_model::Checkpoint;
use corridor_model::Model;
use corridor_units::PageId;
use std::path::PathBuf;

const FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn cached_model() -> Option<PathBuf> {
    let dir = std::env::var_os("CORRIDOR_CACHE_DIR").map(PathBuf::from).or_else(|| {
        std::env::var_os("XDG_CACHE_HOME")
            .map(|x| PathBuf::from(x).join("corridor"))
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/corridor")))
    })?;
    let p = dir.join("models").join(FILE);
    p.exists().then_some(p)
}

#[test]
fn smollm2_says_paris() {
    let Some(path) = cached_model() else {
        assert!(
            std::env::var_os("CORRIDOR_REQUIRE_ASSETS").is_none(),
            "{FILE} is not cached: run `corridor pull`"
        );
        eprintln!("skipped: {FILE} is not cached (run `corridor pull`)");
        return;
    };
    let ckpt = Checkpoint::open(&path).unwrap();
    let backend = CpuBackend::new();
    let model = Model::load(&backend, &ckpt, |_| {}).unwrap();
    let prompt: Vec<u32> = vec![1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198];
    let want: Vec<u32> = vec![504, 3575, 282, 4649, 314, 7042, 30, 2];
    // Two pages, the second first: the paging must not assume contiguity.
    let got = greedy(&model, &backend, &prompt, want.len(), &[PageId(1), PageId(0)], |_| {}).unwrap();
    assert_eq!(got, want);
}
