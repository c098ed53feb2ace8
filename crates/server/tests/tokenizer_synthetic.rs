//! Tokenizer behaviour on small made-up vocabularies: GGUF metadata built in
//! memory and a Hugging Face directory written to a temporary folder. These
//! run everywhere; the real vocabularies are in `tokenizer_assets.rs`.

use std::collections::HashMap;

use corridor_model::gguf::GgufValue;
use corridor_server::tokenizer::{DecodeStream, Tokenizer, TokenizerError};
use proptest::prelude::*;

/// GPT-2's byte-to-character table: printable Latin-1 bytes stand for
/// themselves, the other bytes are moved to U+0100 and up in byte order.
fn byte_chars() -> Vec<char> {
    let printable =
        |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let mut shifted = 0u32;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                shifted += 1;
                char::from_u32(255 + shifted).unwrap()
            }
        })
        .collect()
}

/// The byte-level spelling of a text (what vocabulary strings look like).
fn bl(text: &str) -> String {
    let table = byte_chars();
    text.bytes().map(|b| table[b as usize]).collect()
}

const MERGES: &[(&str, &str)] =
    &[("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), (" ", "w"), ("1", "2"), ("12", "3")];

struct Vocab {
    meta: HashMap<String, GgufValue>,
    ids: HashMap<String, u32>,
}

/// A byte-level BPE vocabulary: 256 byte tokens, the merge results above,
/// two control tokens and one user-defined token.
fn vocab(pre: &str) -> Vocab {
    let mut tokens: Vec<String> = byte_chars().iter().map(|c| c.to_string()).collect();
    let mut types = vec![1u32; 256];
    for (a, b) in MERGES {
        tokens.push(bl(&format!("{a}{b}")));
        types.push(1);
    }
    // A whole word in the vocabulary that no merge sequence produces.
    tokens.push(bl("xyz"));
    types.push(1);
    for (text, ty) in [("<|im_start|>", 3), ("<|im_end|>", 3), ("[USER]", 4)] {
        tokens.push(text.to_string());
        types.push(ty);
    }
    let ids: HashMap<String, u32> = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let merges: Vec<GgufValue> =
        MERGES.iter().map(|(a, b)| GgufValue::String(format!("{} {}", bl(a), bl(b)))).collect();
    let mut meta = HashMap::new();
    meta.insert("tokenizer.ggml.model".into(), GgufValue::String("gpt2".into()));
    meta.insert("tokenizer.ggml.pre".into(), GgufValue::String(pre.into()));
    meta.insert(
        "tokenizer.ggml.tokens".into(),
        GgufValue::Array(tokens.iter().cloned().map(GgufValue::String).collect()),
    );
    meta.insert("tokenizer.ggml.merges".into(), GgufValue::Array(merges));
    meta.insert(
        "tokenizer.ggml.token_type".into(),
        GgufValue::Array(types.into_iter().map(|t| GgufValue::I32(t as i32)).collect()),
    );
    meta.insert("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(ids["<|im_start|>"]));
    meta.insert("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(ids["<|im_end|>"]));
    meta.insert("tokenizer.chat_template".into(), GgufValue::String("{{ messages }}".into()));
    Vocab { meta, ids }
}

fn build(v: &Vocab) -> Result<Tokenizer, TokenizerError> {
    Tokenizer::from_gguf_metadata(|k| v.meta.get(k), "test.gguf")
}

fn id(v: &Vocab, text: &str) -> u32 {
    v.ids[&bl(text)]
}

#[test]
fn bpe_merges_and_byte_level_round_trip() {
    let v = vocab("gpt-2");
    let tok = build(&v).unwrap();
    let ids = tok.encode("hello world", false).unwrap();
    assert_eq!(ids, vec![id(&v, "hello"), id(&v, " w"), id(&v, "o"), id(&v, "r"), id(&v, "l"), id(&v, "d")]);
    assert_eq!(tok.decode(&ids, false).unwrap(), "hello world");
    assert_eq!(tok.vocab_size(), 256 + MERGES.len() + 4);
    assert_eq!(tok.chat_template(), Some("{{ messages }}"));
    assert_eq!(tok.token_id("<|im_end|>"), Some(v.ids["<|im_end|>"]));
}

#[test]
fn special_tokens_in_text_are_recognized_and_skippable() {
    let v = vocab("gpt-2");
    let tok = build(&v).unwrap();
    let start = v.ids["<|im_start|>"];
    let user = v.ids["[USER]"];
    let ids = tok.encode("<|im_start|>hello[USER]", false).unwrap();
    assert_eq!(ids, vec![start, id(&v, "hello"), user]);
    assert_eq!(tok.decode(&ids, false).unwrap(), "<|im_start|>hello[USER]");
    // Control tokens are skipped; user-defined tokens are text and stay.
    assert_eq!(tok.decode(&ids, true).unwrap(), "hello[USER]");
    assert_eq!(tok.bos_id(), Some(start));
    assert_eq!(tok.eos_ids(), &[v.ids["<|im_end|>"]]);
    assert_eq!(tok.bos_token(), Some("<|im_start|>"));
}

#[test]
fn add_bos_follows_gguf_flag_and_pre_default() {
    let mut v = vocab("gpt-2");
    let bos = v.ids["<|im_start|>"];
    // gpt-2 vocabularies do not add BOS unless told to.
    let tok = build(&v).unwrap();
    assert_eq!(tok.encode("he", true).unwrap(), vec![id(&v, "he")]);
    v.meta.insert("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(true));
    let tok = build(&v).unwrap();
    assert_eq!(tok.encode("he", true).unwrap(), vec![bos, id(&v, "he")]);
    assert_eq!(tok.encode("he", false).unwrap(), vec![id(&v, "he")]);
    // llama-bpe (Llama 3) adds BOS by default, as llama.cpp does.
    let tok = build(&vocab("llama-bpe")).unwrap();
    assert_eq!(tok.encode("he", true).unwrap()[0], bos);
}

#[test]
fn digit_splitting_follows_the_pre_tokenizer_name() {
    let expect = |pre: &str, pieces: &[&str]| {
        let v = vocab(pre);
        let tok = build(&v).unwrap();
        let want: Vec<u32> = pieces.iter().map(|p| id(&v, p)).collect();
        assert_eq!(tok.encode("12345", false).unwrap(), want, "pre = {pre}");
    };
    // Llama 3 groups digits in threes; Qwen2 and SmolLM split every digit;
    // GPT-2 keeps the run whole and lets BPE merge it.
    expect("llama-bpe", &["123", "4", "5"]);
    expect("qwen2", &["1", "2", "3", "4", "5"]);
    expect("smollm", &["1", "2", "3", "4", "5"]);
    expect("gpt-2", &["123", "4", "5"]);
    // Aliases take their family's splitting: smaug-bpe is Llama 3's,
    // deepseek-coder and command-r split every digit.
    expect("smaug-bpe", &["123", "4", "5"]);
    expect("deepseek-coder", &["1", "2", "3", "4", "5"]);
    expect("command-r", &["1", "2", "3", "4", "5"]);
}

#[test]
fn llama3_takes_whole_vocabulary_words_without_merging() {
    let v = vocab("llama-bpe");
    assert_eq!(build(&v).unwrap().encode("xyz", false).unwrap(), vec![id(&v, "xyz")]);
    let v = vocab("gpt-2");
    assert_eq!(build(&v).unwrap().encode("xyz", false).unwrap(), vec![id(&v, "x"), id(&v, "y"), id(&v, "z")]);
    // smaug-bpe shares Llama 3's regex but not its shortcut (nor its BOS).
    let v = vocab("smaug-bpe");
    let tok = build(&v).unwrap();
    assert_eq!(tok.encode("xyz", false).unwrap(), vec![id(&v, "x"), id(&v, "y"), id(&v, "z")]);
    assert_eq!(tok.encode("he", true).unwrap(), vec![id(&v, "he")]);
}

/// A SentencePiece (`llama`) vocabulary: pieces with scores, byte-fallback
/// pieces for the bytes of 'é', and the usual three specials first.
fn spm_meta() -> HashMap<String, GgufValue> {
    let pieces: &[(&str, f32, i32)] = &[
        ("<unk>", 0.0, 2),
        ("<s>", 0.0, 3),
        ("</s>", 0.0, 3),
        ("<0xC3>", 0.0, 6),
        ("<0xA9>", 0.0, 6),
        ("\u{2581}", -1.0, 1),
        ("h", -2.0, 1),
        ("i", -2.0, 1),
        ("hi", -3.0, 1),
        ("\u{2581}hi", -4.0, 1),
        ("[TOOL]", 0.0, 4),
    ];
    let mut meta = HashMap::new();
    meta.insert("tokenizer.ggml.model".into(), GgufValue::String("llama".into()));
    meta.insert(
        "tokenizer.ggml.tokens".into(),
        GgufValue::Array(pieces.iter().map(|p| GgufValue::String(p.0.into())).collect()),
    );
    meta.insert(
        "tokenizer.ggml.scores".into(),
        GgufValue::Array(pieces.iter().map(|p| GgufValue::F32(p.1)).collect()),
    );
    meta.insert(
        "tokenizer.ggml.token_type".into(),
        GgufValue::Array(pieces.iter().map(|p| GgufValue::I32(p.2)).collect()),
    );
    meta
}

#[test]
fn sentencepiece_gguf_encodes_with_space_prefix_bos_and_byte_fallback() {
    let meta = spm_meta();
    let tok = Tokenizer::from_gguf_metadata(|k| meta.get(k), "spm.gguf").unwrap();
    // BOS and EOS default to 1 and 2, and BOS is added unless told not to.
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), &[2]);
    assert_eq!(tok.encode("hi", true).unwrap(), vec![1, 9]);
    assert_eq!(tok.encode("hi", false).unwrap(), vec![9]);
    // " hi" is "▁▁hi": the prefix space stays alone, then ▁hi.
    assert_eq!(tok.encode(" hi", false).unwrap(), vec![5, 9]);
    // 'é' has no piece: its UTF-8 bytes come out as <0xNN> pieces, and
    // decoding joins them back into the character.
    let ids = tok.encode("hié", false).unwrap();
    assert_eq!(ids, vec![9, 3, 4]);
    assert_eq!(tok.decode(&ids, false).unwrap(), "hié");
    assert_eq!(tok.token_bytes(3), vec![0xC3]);
    assert_eq!(tok.token_bytes(9), b" hi".to_vec());
    // Specials split the text; the text after one gets its own prefix space.
    let ids = tok.encode("hi</s>[TOOL]hi", false).unwrap();
    assert_eq!(ids, vec![9, 2, 10, 9]);
    assert_eq!(tok.decode(&ids, true).unwrap(), "hi[TOOL] hi");
    assert_eq!(tok.decode(&ids, false).unwrap(), "hi</s>[TOOL] hi");
    // Streaming gives the same text as one decode, 'é' held until whole.
    let ids = tok.encode("hi hié", false).unwrap();
    let mut stream = tok.decode_stream(false);
    let mut text = String::new();
    for &id in &ids {
        if let Some(piece) = stream.push(&tok, id).unwrap() {
            assert!(!piece.contains('\u{fffd}'), "{piece:?}");
            text.push_str(&piece);
        }
    }
    text.push_str(&stream.finish(&tok).unwrap());
    assert_eq!(text, "hi hié");

    // Phi-3 files (by name, as llama.cpp tells them) drop the whitespace
    // after special pieces other than <s>/<unk>; others keep it.
    // ('\n' has neither a piece nor a byte piece here, so it is <unk>.)
    assert_eq!(tok.encode("</s>\n hi", false).unwrap(), vec![2, 5, 0, 9]);
    let mut meta = spm_meta();
    meta.insert("general.name".into(), GgufValue::String("Phi-3 Mini 4K Instruct".into()));
    let phi = Tokenizer::from_gguf_metadata(|k| meta.get(k), "phi3.gguf").unwrap();
    assert_eq!(phi.encode("</s>\n hi", false).unwrap(), vec![2, 9]);
    assert_eq!(phi.encode("<s> hi", false).unwrap(), vec![1, 5, 9]);

    let mut meta = spm_meta();
    meta.insert("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(false));
    meta.insert("tokenizer.ggml.add_space_prefix".into(), GgufValue::Bool(false));
    let tok = Tokenizer::from_gguf_metadata(|k| meta.get(k), "spm.gguf").unwrap();
    assert_eq!(tok.encode("hi", true).unwrap(), vec![8]);
}

#[test]
fn default_pre_cuts_digit_runs_in_threes_before_bpe() {
    // llama.cpp's `default` splits "1234123" into 123|412|3 before BPE;
    // GPT-2 hands the whole run to BPE, which merges both "123"s.
    let v = vocab("default");
    let ids = build(&v).unwrap().encode("1234123", false).unwrap();
    assert_eq!(ids, vec![id(&v, "123"), id(&v, "4"), id(&v, "12"), id(&v, "3")]);
    let v = vocab("gpt-2");
    let ids = build(&v).unwrap().encode("1234123", false).unwrap();
    assert_eq!(ids, vec![id(&v, "123"), id(&v, "4"), id(&v, "123")]);
}

#[test]
fn unsupported_model_and_pre_are_refused_by_name() {
    let mut v = vocab("gpt-2");
    v.meta.insert("tokenizer.ggml.model".into(), GgufValue::String("rwkv".into()));
    let err = build(&v).unwrap_err();
    assert!(matches!(&err, TokenizerError::UnsupportedModel { model, .. } if model == "rwkv"));
    let msg = err.to_string();
    assert!(msg.contains("`rwkv`") && msg.contains("gpt2, gemma4, llama, bert, t5"), "{msg}");

    // kimi-k2 needs llama.cpp's hand-written splitting, which we lack.
    let err = build(&vocab("kimi-k2")).unwrap_err();
    assert!(matches!(&err, TokenizerError::UnsupportedPre { pre, .. } if pre == "kimi-k2"));
    let msg = err.to_string();
    assert!(msg.contains("kimi-k2") && msg.contains("smaug-bpe"), "{msg}");
}

#[test]
fn missing_and_malformed_keys_are_named() {
    let mut v = vocab("gpt-2");
    v.meta.remove("tokenizer.ggml.tokens");
    let err = build(&v).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::MissingKey { key, .. } if key == "tokenizer.ggml.tokens"),
        "{err}"
    );

    let mut v = vocab("gpt-2");
    v.meta
        .insert("tokenizer.ggml.merges".into(), GgufValue::Array(vec![GgufValue::String("nospace".into())]));
    let err = build(&v).unwrap_err();
    assert!(matches!(&err, TokenizerError::BadKey { key, .. } if key == "tokenizer.ggml.merges"), "{err}");

    let mut v = vocab("gpt-2");
    v.meta.insert("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(1_000_000));
    let err = build(&v).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::BadKey { key, .. } if key == "tokenizer.ggml.eos_token_id"),
        "{err}"
    );
}

#[test]
fn decode_refuses_ids_outside_the_vocabulary() {
    let tok = build(&vocab("gpt-2")).unwrap();
    let err = tok.decode(&[1, 99_999], false).unwrap_err();
    assert!(matches!(err, TokenizerError::IdOutOfRange { id: 99_999, .. }));
}

#[test]
fn decode_stream_holds_back_half_characters() {
    let v = vocab("gpt-2");
    let tok = build(&v).unwrap();
    // "é" is two bytes, C3 A9, each its own token here.
    let table = byte_chars();
    let c3 = v.ids[&table[0xc3].to_string()];
    let a9 = v.ids[&table[0xa9].to_string()];
    let mut stream = DecodeStream::new(false);
    assert_eq!(stream.push(&tok, id(&v, "he")).unwrap().as_deref(), Some("he"));
    assert_eq!(stream.push(&tok, c3).unwrap(), None);
    assert_eq!(stream.push(&tok, a9).unwrap().as_deref(), Some("é"));
    assert_eq!(stream.finish(&tok).unwrap(), "");

    // A character that never completes comes out at the end, as decode shows it.
    let mut stream = tok.decode_stream(false);
    assert_eq!(stream.push(&tok, c3).unwrap(), None);
    assert_eq!(stream.finish(&tok).unwrap(), "\u{FFFD}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever ids arrive, the streamed pieces add up to the full decode.
    #[test]
    fn decode_stream_concatenates_to_decode(
        picks in proptest::collection::vec(0usize..(256 + MERGES.len() + 4), 0..40),
        skip_special in any::<bool>(),
    ) {
        let v = vocab("gpt-2");
        let tok = build(&v).unwrap();
        let ids: Vec<u32> = picks.iter().map(|&p| p as u32).collect();
        let mut stream = DecodeStream::new(skip_special);
        let mut streamed = String::new();
        for &i in &ids {
            if let Some(piece) = stream.push(&tok, i).unwrap() {
                let held_back = !piece.ends_with(char::REPLACEMENT_CHARACTER);
                prop_assert!(held_back);
                streamed.push_str(&piece);
            }
        }
        streamed.push_str(&stream.finish(&tok).unwrap());
        prop_assert_eq!(streamed, tok.decode(&ids, skip_special).unwrap());
    }
}

mod hf_dir {
    use super::*;
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{AddedToken, DecoderWrapper, PreTokenizerWrapper};

    /// Writes a small byte-level tokenizer.json (ids as in `vocab`) and the
    /// given config files into a temporary directory.
    fn write_dir(files: &[(&str, &str)]) -> tempfile::TempDir {
        let v = vocab("gpt-2");
        let mut vocab_map = tokenizers::models::bpe::Vocab::default();
        for (text, &i) in &v.ids {
            vocab_map.insert(text.clone(), i);
        }
        let merges = MERGES.iter().map(|(a, b)| (bl(a), bl(b))).collect();
        let bpe = BPE::builder().vocab_and_merges(vocab_map, merges).build().unwrap();
        let mut tok = tokenizers::Tokenizer::new(bpe);
        tok.with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(
            ByteLevel::default().add_prefix_space(false),
        )));
        tok.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())));
        tok.add_special_tokens([
            AddedToken::from("<|im_start|>", true),
            AddedToken::from("<|im_end|>", true),
        ])
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        tok.save(dir.path().join("tokenizer.json"), false).unwrap();
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        dir
    }

    #[test]
    fn config_files_supply_specials_template_and_eos() {
        let v = vocab("gpt-2");
        let dir = write_dir(&[
            (
                "tokenizer_config.json",
                r#"{"bos_token": {"content": "<|im_start|>", "special": true}, "eos_token": "<|im_end|>",
                    "add_bos_token": true,
                    "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#,
            ),
            ("generation_config.json", r#"{"eos_token_id": [5, 7]}"#),
        ]);
        let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
        let start = v.ids["<|im_start|>"];
        let end = v.ids["<|im_end|>"];
        assert_eq!(tok.chat_template(), Some("D"));
        assert_eq!(tok.bos_id(), Some(start));
        assert_eq!(tok.eos_ids(), &[5, 7, end]);
        assert_eq!(tok.eos_token(), Some("<|im_end|>"));
        assert_eq!(tok.encode("he", true).unwrap(), vec![start, id(&v, "he")]);
        assert_eq!(tok.encode("<|im_end|>he", false).unwrap(), vec![end, id(&v, "he")]);
    }

    #[test]
    fn template_file_beside_the_config_is_used() {
        let dir = write_dir(&[
            ("tokenizer_config.json", r#"{"eos_token": null, "bos_token": null}"#),
            ("chat_template.jinja", "{{ bos_token }}"),
            ("generation_config.json", r#"{"eos_token_id": 9}"#),
        ]);
        let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
        assert_eq!(tok.chat_template(), Some("{{ bos_token }}"));
        assert_eq!(tok.eos_ids(), &[9]);
        assert_eq!(tok.bos_id(), None);
    }

    #[test]
    fn missing_tokenizer_json_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err();
        assert!(matches!(&err, TokenizerError::Missing { path, .. } if path.ends_with("tokenizer.json")));
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
    }

    #[test]
    fn malformed_config_values_are_named() {
        let dir = write_dir(&[("tokenizer_config.json", r#"{"chat_template": 3}"#)]);
        let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err();
        assert!(matches!(&err, TokenizerError::BadKey { key, .. } if key == "chat_template"), "{err}");
        let dir = write_dir(&[("generation_config.json", r#"{"eos_token_id": "x"}"#)]);
        let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err();
        assert!(matches!(&err, TokenizerError::BadKey { key, .. } if key == "eos_token_id"), "{err}");
    }
}
