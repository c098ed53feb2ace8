//! Tokenizers checked against real vocabularies and their expected ids,
//! fetched by `scripts/fetch_test_assets.sh` into `$CORRIDOR_TEST_ASSETS`
//! (default `target/test-assets`).
//!
//! Without the assets each test prints a notice and passes, unless
//! `CORRIDOR_REQUIRE_ASSETS` is set (as CI does), in which case it fails.

use std::path::{Path, PathBuf};

use corridor_server::template::{ChatTemplate, RenderOptions, CHATML_TEMPLATE};
use corridor_server::tokenizer::{DecodeStream, Tokenizer};

/// The assets directory, or `None` (after a notice) when it may be skipped.
fn assets(sub: &str) -> Option<PathBuf> {
    let root = std::env::var_os("CORRIDOR_TEST_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/test-assets"));
    let dir = root.join(sub);
    if dir.exists() {
        return Some(dir);
    }
    if std::env::var_os("CORRIDOR_REQUIRE_ASSETS").is_some() {
        panic!(
            "{} is missing and CORRIDOR_REQUIRE_ASSETS is set; run scripts/fetch_test_assets.sh",
            dir.display()
        );
    }
    eprintln!("notice: skipping, {} is missing (run scripts/fetch_test_assets.sh)", dir.display());
    None
}

/// llama.cpp's test file format: inputs separated by
/// "\n__ggml_vocab_test__\n" (the file ends with one), and one line of
/// space-separated expected ids per input, in the same order.
fn read_vocab_tests(gguf: &Path) -> Vec<(String, Vec<u32>)> {
    read_test_pair(&gguf.with_extension("gguf.inp"), &gguf.with_extension("gguf.out"))
}

fn read_test_pair(inp: &Path, out: &Path) -> Vec<(String, Vec<u32>)> {
    let gguf = inp;
    let inp = std::fs::read_to_string(inp).unwrap();
    let out = std::fs::read_to_string(out).unwrap();
    let mut inputs: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    // The separator after the last input leaves an empty tail, which
    // llama.cpp's reader never turns into a test.
    if inputs.last() == Some(&"") {
        inputs.pop();
    }
    let expected: Vec<Vec<u32>> =
        out.lines().map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect()).collect();
    assert_eq!(inputs.len(), expected.len(), "{}", gguf.display());
    inputs.into_iter().map(str::to_string).zip(expected).collect()
}

/// Encodes every test string; returns how many matched, printing misses.
fn run_vocab_tests(tok: &Tokenizer, tests: &[(String, Vec<u32>)], label: &str) -> usize {
    let mut pass = 0;
    for (text, want) in tests {
        let got = tok.encode(text, false).unwrap();
        if &got == want {
            pass += 1;
        } else {
            eprintln!("{label}: {text:?}\n  want {want:?}\n  got  {got:?}");
        }
    }
    println!("{label}: {pass}/{} test strings encode exactly", tests.len());
    pass
}

/// Decoding the expected ids gives back the test string (SentencePiece
/// takes away the one space its encoding put in front). WordPiece (BERT)
/// lowercases, strips accents and drops spacing, so there the decoded text
/// is checked by encoding it again to the same ids.
fn check_decode(tok: &Tokenizer, tests: &[(String, Vec<u32>)], label: &str) {
    for (text, ids) in tests {
        let got = tok.decode(ids, false).unwrap();
        if label == "bert-bge" {
            assert_eq!(tok.encode(&got, false).unwrap(), *ids, "{label}: re-encoding {got:?}");
        } else {
            assert_eq!(got, *text, "{label}: decode of {ids:?}");
        }
    }
}

/// Streams the expected ids one at a time and checks the pieces add up to
/// the full decode, on real multi-byte text.
fn check_stream(tok: &Tokenizer, tests: &[(String, Vec<u32>)]) {
    for (_, ids) in tests {
        let mut stream = DecodeStream::new(false);
        let mut text = String::new();
        for &id in ids {
            if let Some(piece) = stream.push(tok, id).unwrap() {
                text.push_str(&piece);
            }
        }
        text.push_str(&stream.finish(tok).unwrap());
        assert_eq!(text, tok.decode(ids, false).unwrap());
    }
}

/// Each token's raw bytes (`bytes` in chat logprobs) concatenate to the
/// UTF-8 of the decoded text, also where a character spans several tokens
/// and a token alone decodes to U+FFFD.
fn check_token_bytes(tok: &Tokenizer, tests: &[(String, Vec<u32>)]) {
    let mut split_chars = 0;
    for (_, ids) in tests {
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| tok.token_bytes(id)).collect();
        let text = tok.decode(ids, false).unwrap().into_bytes();
        // A SentencePiece token keeps its space; the decoded text starts
        // without the one encoding put in front.
        let spm_prefixed = bytes.first() == Some(&b' ') && bytes[1..] == text[..];
        assert!(bytes == text || spm_prefixed, "ids {ids:?}");
        split_chars +=
            ids.iter().filter(|&&id| tok.decode(&[id], false).unwrap().contains('\u{fffd}')).count();
    }
    assert!(split_chars > 0, "the test strings should split some character across tokens");
}

/// Every `ggml-vocab-*.gguf` of llama.cpp 0.3.36 that has `.inp`/`.out` test
/// strings. The test below fails if the directory holds one that is not
/// listed here (or lacks one that is), so no vocabulary is skipped silently.
const VOCABS_WITH_TESTS: &[&str] = &[
    "bert-bge",
    "command-r",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gemma-4",
    "gpt-2",
    "llama-bpe",
    "llama-spm",
    "mpt",
    "phi-3",
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
];

/// The vocabularies llama.cpp ships without test strings; each must load.
const VOCABS_WITHOUT_TESTS: &[&str] = &["aquila", "baichuan", "gpt-neox", "nomic-bert-moe"];

/// Names `ggml-vocab-NAME.gguf` in `dir`, split by whether test strings exist.
fn vocab_names(dir: &Path) -> (Vec<String>, Vec<String>) {
    let mut with = Vec::new();
    let mut without = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let file = entry.unwrap().file_name().into_string().unwrap();
        if let Some(name) = file.strip_prefix("ggml-vocab-").and_then(|f| f.strip_suffix(".gguf")) {
            if dir.join(format!("{file}.inp")).exists() {
                with.push(name.to_string());
            } else {
                without.push(name.to_string());
            }
        }
    }
    with.sort();
    without.sort();
    (with, without)
}

/// Checks one vocabulary; returns a description of what went wrong, if anything.
fn vocab_case(dir: &Path, name: &str) -> Option<String> {
    let gguf = dir.join(format!("ggml-vocab-{name}.gguf"));
    let tok = match Tokenizer::from_gguf_path(&gguf) {
        Ok(tok) => tok,
        Err(e) => return Some(format!("{name}: does not load: {e}")),
    };
    let tests = read_vocab_tests(&gguf);
    let pass = run_vocab_tests(&tok, &tests, name);
    if pass != tests.len() {
        return Some(format!("{name}: {pass}/{} test strings encode exactly", tests.len()));
    }
    check_decode(&tok, &tests, name);
    check_stream(&tok, &tests);
    // WordPiece pieces are not spans of the text (`##` continuations), so
    // raw token bytes are only checked for the other vocabularies.
    if name != "bert-bge" {
        check_token_bytes(&tok, &tests);
    }
    None
}

/// Every vocabulary with test strings: each string encodes to exactly the
/// ids llama.cpp expects, and the ids decode back to the text.
#[test]
fn every_llama_cpp_vocab_matches_its_test_strings() {
    let Some(dir) = assets("llama-cpp-python/vocab") else {
        return;
    };
    let (with, _) = vocab_names(&dir);
    assert_eq!(with, VOCABS_WITH_TESTS, "the vocab files with test strings changed; update the list");
    let failures: Vec<String> = with.iter().filter_map(|name| vocab_case(&dir, name)).collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The vocabularies without test strings load, and encode and decode a
/// sample text back to itself. (Their ids have no reference here; the
/// Unigram one, nomic-bert-moe, is the only vocabulary of its kind.)
#[test]
fn every_llama_cpp_vocab_without_tests_loads() {
    let Some(dir) = assets("llama-cpp-python/vocab") else {
        return;
    };
    let (_, without) = vocab_names(&dir);
    assert_eq!(without, VOCABS_WITHOUT_TESTS, "the vocab files without test strings changed");
    for name in &without {
        let tok = Tokenizer::from_gguf_path(&dir.join(format!("ggml-vocab-{name}.gguf")))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let text = "Hello world, 3.14 times";
        let ids = tok.encode(text, false).unwrap();
        assert!(!ids.is_empty(), "{name}");
        assert_eq!(tok.decode(&ids, false).unwrap(), text, "{name}");
    }
}

/// The Unigram vocabulary has no test strings of its own; the standard ones
/// were encoded by SentencePiece itself, from a model rebuilt out of the
/// same GGUF metadata, by `scripts/make_vocab_fixtures.py` (the ids are
/// committed in tests/fixtures/vocab).
#[test]
fn gguf_unigram_matches_sentencepiece() {
    let Some(dir) = assets("llama-cpp-python/vocab") else {
        return;
    };
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vocab/nomic-bert-moe.out");
    let tests = read_test_pair(&dir.join("ggml-vocab-llama-spm.gguf.inp"), &fixture);
    let tok = Tokenizer::from_gguf_path(&dir.join("ggml-vocab-nomic-bert-moe.gguf")).unwrap();
    let pass = run_vocab_tests(&tok, &tests, "nomic-bert-moe");
    assert_eq!(pass, tests.len(), "nomic-bert-moe: not every test string matched");
    check_stream(&tok, &tests);
}

/// The Qwen3 tokenizer.json shares Qwen2's vocabulary, so llama.cpp's Qwen2
/// expectations check the Hugging Face directory path too.
#[test]
fn hf_dir_qwen3_matches_qwen2_expectations() {
    let (Some(qwen), Some(vocab)) = (assets("qwen3-tokenizer"), assets("llama-cpp-python/vocab")) else {
        return;
    };
    let tok = Tokenizer::from_hf_dir(&qwen).unwrap();
    let tests = read_vocab_tests(&vocab.join("ggml-vocab-qwen2.gguf"));
    let pass = run_vocab_tests(&tok, &tests, "qwen3 tokenizer.json");
    assert_eq!(pass, tests.len());
    check_token_bytes(&tok, &tests);
    assert_eq!(tok.token_id("<|im_end|>"), Some(151_645));
    assert!(tok.eos_ids().contains(&151_645));
    assert_eq!(tok.bos_id(), None);
    assert!(tok.chat_template().is_some_and(|t| t.contains("enable_thinking")));
}

const SMOL_PROMPT_IDS: [u32; 16] =
    [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198];

#[test]
fn smollm2_gguf_prompt_and_answer() {
    let Some(dir) = assets("smollm2") else {
        return;
    };
    let tok = Tokenizer::from_gguf_path(&dir.join("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), &[2]);
    let messages = serde_json::json!([{"role": "user", "content": "What is the capital of France?"}]);
    let opts = RenderOptions { add_generation_prompt: true, ..RenderOptions::default() };

    // Plain ChatML (no system turn) gives exactly the reference prompt ids.
    let chatml = ChatTemplate::new(CHATML_TEMPLATE, tok.bos_token(), tok.eos_token()).unwrap();
    let prompt = chatml.render(&messages, &opts).unwrap();
    assert_eq!(tok.encode(&prompt, false).unwrap(), SMOL_PROMPT_IDS);
    // add_bos_token is false in this GGUF, so add_special changes nothing.
    assert_eq!(tok.encode(&prompt, true).unwrap(), SMOL_PROMPT_IDS);

    // The checkpoint's own template adds its default system turn first; the
    // conversation after it encodes to the same ids.
    let own = ChatTemplate::new(tok.chat_template().unwrap(), tok.bos_token(), tok.eos_token()).unwrap();
    let prompt = own.render(&messages, &opts).unwrap();
    assert!(prompt.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
    let ids = tok.encode(&prompt, false).unwrap();
    assert!(ids.ends_with(&SMOL_PROMPT_IDS), "{ids:?}");

    let answer = [504, 3575, 282, 4649, 314, 7042, 30, 2];
    assert_eq!(tok.decode(&answer, true).unwrap(), "The capital of France is Paris.");
    assert_eq!(tok.decode(&answer, false).unwrap(), "The capital of France is Paris.<|im_end|>");
    let mut stream = tok.decode_stream(true);
    let mut text = String::new();
    for id in answer {
        text.push_str(&stream.push(&tok, id).unwrap().unwrap_or_default());
    }
    assert_eq!(text, "The capital of France is Paris.");
}
