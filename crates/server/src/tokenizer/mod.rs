//! One tokenizer type for both checkpoint formats.
//!
//! A Hugging Face directory brings its own `tokenizer.json`, which the
//! `tokenizers` crate loads as is; the chat template, the special tokens and
//! the end-of-sequence ids come from `tokenizer_config.json` and
//! `generation_config.json` beside it. A GGUF file carries only the raw
//! vocabulary (tokens, merges or scores, token types) and names for the
//! tokenizer model (`tokenizer.ggml.model`) and its pre-tokenizer
//! (`tokenizer.ggml.pre`); from those we rebuild what llama.cpp runs:
//! - `gpt2`: byte-level BPE with the regex splits llama.cpp applies for the
//!   pre-tokenizer name ([`pretok`] has the table of names and aliases);
//! - `gemma4`: BPE over raw UTF-8 with spaces as U+2581 and `<0xNN>` bytes;
//! - `llama`: SentencePiece's score-ordered merge with byte fallback
//!   ([`spm`]);
//! - `bert`: WordPiece after BERT's uncased normalization;
//! - `t5`: SentencePiece Unigram with the vocabulary's compiled normalizer.
//!
//! Any other model or pre-tokenizer name is refused with an error that names
//! it and lists the supported ones, rather than tokenized wrongly.
//!
//! Encoding always recognizes special tokens written in the text (such as
//! `<|im_start|>`), because rendered chat templates rely on it. Whether a BOS
//! is prepended is a separate choice (`add_special`); a rendered chat prompt
//! usually carries its own BOS and is encoded without it, as transformers does.
//!
//! [`DecodeStream`] turns generated ids into text one id at a time without
//! ever emitting half a character.

mod pretok;
mod spm;

use std::path::{Path, PathBuf};

use corridor_model::gguf::{GgufFile, GgufValue};
use serde_json::Value as Json;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip as DecoderStrip;
use tokenizers::decoders::wordpiece::WordPiece as WordPieceDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::models::unigram::Unigram;
use tokenizers::models::wordpiece::WordPiece;
use tokenizers::normalizers::bert::BertNormalizer;
use tokenizers::normalizers::replace::{Replace, ReplacePattern};
use tokenizers::normalizers::strip::Strip;
use tokenizers::normalizers::utils::Sequence as NormalizerSequence;
use tokenizers::normalizers::Precompiled;
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper};

use pretok::{PreSplit, SUPPORTED_PRE};
use spm::{Spm, SpmVocab};

/// The space marker of SentencePiece-style vocabularies.
const SPACE_MARK: &str = "\u{2581}";

/// The character `String::from_utf8_lossy` puts where bytes do not (yet) form
/// a character; a decode that ends in it may be waiting for more bytes.
const REPLACEMENT: char = '\u{FFFD}';

/// GGUF token types (llama.cpp's `llama_token_type`) that become added tokens.
const TOKEN_TYPE_CONTROL: u64 = spm::token_type::CONTROL;
const TOKEN_TYPE_USER_DEFINED: u64 = spm::token_type::USER_DEFINED;

/// Everything that can go wrong loading or using a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file the tokenizer needs does not exist.
    #[error("{}: not found ({what})", path.display())]
    Missing { path: PathBuf, what: &'static str },
    /// A file exists but could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file was read but its contents are not what the format says.
    #[error("{}: {message}", path.display())]
    Parse { path: PathBuf, message: String },
    /// A configuration or metadata key holds a value of the wrong shape.
    #[error("{origin}: key `{key}`: {problem}")]
    BadKey { origin: String, key: String, problem: String },
    /// A GGUF key the tokenizer cannot do without is absent.
    #[error("{origin}: key `{key}` is missing")]
    MissingKey { origin: String, key: String },
    /// The GGUF names a tokenizer model we do not implement.
    #[error(
        "{origin}: tokenizer model `{model}` is not supported (supported: {})",
        SUPPORTED_MODELS.join(", ")
    )]
    UnsupportedModel { origin: String, model: String },
    /// The GGUF names a pre-tokenizer whose splitting rules we do not implement.
    #[error(
        "{origin}: pre-tokenizer `{pre}` is not supported (supported: {})",
        SUPPORTED_PRE.join(", ")
    )]
    UnsupportedPre { origin: String, pre: String },
    /// The GGUF file itself could not be opened or parsed.
    #[error(transparent)]
    Gguf(#[from] corridor_model::error::LoadError),
    /// The `tokenizers` crate refused to build the tokenizer.
    #[error("{origin}: cannot build the tokenizer: {message}")]
    Build { origin: String, message: String },
    /// Encoding a text failed inside the `tokenizers` crate.
    #[error("cannot encode text of {len} bytes: {message}")]
    Encode { len: usize, message: String },
    /// Decoding failed inside the `tokenizers` crate.
    #[error("cannot decode {count} ids: {message}")]
    Decode { count: usize, message: String },
    /// An id no token has; sampled ids are untrusted and checked here.
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    IdOutOfRange { id: u32, vocab_size: usize },
}

/// The byte a character of the byte-level alphabet stands for: printable
/// Latin-1 bytes are themselves, the other 68 bytes were moved to U+0100
/// onwards in byte order (the GPT-2 scheme every byte-level BPE shares).
fn byte_of_char(c: char) -> Option<u8> {
    let printable =
        |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let cp = c as u32;
    if cp < 0x100 {
        return printable(cp).then_some(cp as u8);
    }
    // The n-th non-printable byte (in byte order) became U+0100 + n.
    let n = cp - 0x100;
    (0u32..256).filter(|&b| !printable(b)).nth(n as usize).map(|b| b as u8)
}

/// `<0xNN>`, SentencePiece's byte-fallback tokens.
fn byte_fallback_token(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Whether `encode(.., add_special = true)` adds a BOS and/or EOS itself,
/// overriding whatever post-processor the tokenizer file carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SpecialPolicy {
    add_bos: bool,
    add_eos: bool,
}

/// A loaded tokenizer with the special-token facts the server needs.
pub struct Tokenizer {
    engine: Engine,
    /// One past the largest id any token has (model vocabulary and added
    /// tokens together); ids at or above it are refused by `decode`.
    vocab_size: usize,
    bos_id: Option<u32>,
    bos_token: Option<String>,
    eos_ids: Vec<u32>,
    eos_token: Option<String>,
    /// `None` leaves BOS/EOS to the tokenizer file's post-processor.
    policy: Option<SpecialPolicy>,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

impl Tokenizer {
    /// Loads a Hugging Face model directory: `tokenizer.json` (required),
    /// `tokenizer_config.json` and `generation_config.json` (optional), and a
    /// chat template from `tokenizer_config.json`, `chat_template.jinja` or
    /// `chat_template.json`, in that order.
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let tokenizer_json = dir.join("tokenizer.json");
        if !tokenizer_json.is_file() {
            return Err(TokenizerError::Missing {
                path: tokenizer_json,
                what: "the Hugging Face tokenizer file",
            });
        }
        let inner = tokenizers::Tokenizer::from_file(&tokenizer_json)
            .map_err(|e| TokenizerError::Parse { path: tokenizer_json.clone(), message: e.to_string() })?;

        let config_path = dir.join("tokenizer_config.json");
        let config = read_optional_json(&config_path)?.unwrap_or(Json::Null);
        let origin = config_path.display().to_string();

        let bos_token = special_token_text(&config, "bos_token", &origin)?;
        let eos_token = special_token_text(&config, "eos_token", &origin)?;
        let bos_id = bos_token.as_deref().and_then(|t| inner.token_to_id(t));

        let gen_path = dir.join("generation_config.json");
        let gen = read_optional_json(&gen_path)?.unwrap_or(Json::Null);
        let gen_origin = gen_path.display().to_string();
        // generation_config.json is what transformers stops on; the
        // tokenizer's own eos token is added in case it names another one.
        let mut eos_ids = id_list(&gen, "eos_token_id", &gen_origin)?;
        if let Some(id) = eos_token.as_deref().and_then(|t| inner.token_to_id(t)) {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        let bos_id = match bos_id {
            Some(id) => Some(id),
            None => id_list(&gen, "bos_token_id", &gen_origin)?.first().copied(),
        };

        // transformers' Llama-style tokenizers rebuild their post-processor
        // from these two flags, so an explicit flag outranks tokenizer.json.
        let add_bos = optional_bool(&config, "add_bos_token", &origin)?;
        let add_eos = optional_bool(&config, "add_eos_token", &origin)?;
        let policy = match (add_bos, add_eos) {
            (None, None) => None,
            (bos, eos) => {
                Some(SpecialPolicy { add_bos: bos.unwrap_or(false), add_eos: eos.unwrap_or(false) })
            }
        };

        let chat_template = match chat_template_from_config(&config, &origin)? {
            Some(t) => Some(t),
            None => chat_template_from_files(dir)?,
        };

        let vocab_size = max_id_plus_one(&inner);
        Ok(Tokenizer {
            engine: Engine::Hf(inner),
            vocab_size,
            bos_id,
            bos_token,
            eos_ids,
            eos_token,
            policy,
            chat_template,
        })
    }

    /// Opens a GGUF file and builds its tokenizer from the metadata.
    pub fn from_gguf_path(path: &Path) -> Result<Tokenizer, TokenizerError> {
        let file = GgufFile::open(path)?;
        Tokenizer::from_gguf(&file)
    }

    /// Builds the tokenizer stored in an open GGUF file's metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer, TokenizerError> {
        let origin = file.path().display().to_string();
        Tokenizer::from_gguf_metadata(|key| file.get(key), &origin)
    }

    /// Builds a tokenizer from GGUF metadata given as a lookup function, so
    /// that metadata can come from a file or be made up in a test. `origin`
    /// names the source in errors.
    pub fn from_gguf_metadata<'a, F>(get: F, origin: &str) -> Result<Tokenizer, TokenizerError>
    where
        F: Fn(&str) -> Option<&'a GgufValue>,
    {
        let meta = GgufMeta { get, origin };
        let model = meta.required_str("tokenizer.ggml.model")?;
        let model_kind = match model {
            "gpt2" => GgufModel::Bpe,
            // Gemma 4 is BPE over raw UTF-8; llama.cpp fixes its splitting.
            "gemma4" => GgufModel::Bpe,
            "llama" => GgufModel::Spm,
            "bert" => GgufModel::Wpm,
            "t5" => GgufModel::Ugm,
            _ => {
                return Err(TokenizerError::UnsupportedModel {
                    origin: origin.to_string(),
                    model: model.to_string(),
                })
            }
        };
        let tokens = meta.required_strings("tokenizer.ggml.tokens")?;
        let token_types = meta.optional_ints("tokenizer.ggml.token_type")?;
        if let Some(types) = &token_types {
            if types.len() != tokens.len() {
                return Err(TokenizerError::BadKey {
                    origin: origin.to_string(),
                    key: "tokenizer.ggml.token_type".to_string(),
                    problem: format!("has {} entries but there are {} tokens", types.len(), tokens.len()),
                });
            }
        }
        let vocab_len = u32::try_from(tokens.len()).map_err(|_| TokenizerError::BadKey {
            origin: origin.to_string(),
            key: "tokenizer.ggml.tokens".to_string(),
            problem: format!("{} tokens do not fit 32-bit ids", tokens.len()),
        })?;
        let check_id = |key: &str| -> Result<Option<u32>, TokenizerError> {
            match meta.optional_u64(key)? {
                None => Ok(None),
                Some(id) if id < u64::from(vocab_len) => Ok(Some(id as u32)),
                Some(id) => Err(TokenizerError::BadKey {
                    origin: origin.to_string(),
                    key: key.to_string(),
                    problem: format!("id {id} is outside the {vocab_len} tokens"),
                }),
            }
        };
        let build_err = |message: String| TokenizerError::Build { origin: origin.to_string(), message };

        // What encode(.., add_special = true) adds when the metadata is
        // silent follows llama.cpp's defaults per tokenizer type.
        let (mut engine, default_add_bos) = match model_kind {
            GgufModel::Bpe => {
                let pre = if model == "gemma4" {
                    "gemma4"
                } else {
                    match meta.optional_str("tokenizer.ggml.pre")? {
                        Some(p) => p,
                        // llama.cpp falls back to its "default" splitting when
                        // the key is absent; we do the same and say so,
                        // because the result is often wrong.
                        None => {
                            tracing::warn!(
                                origin,
                                "GGUF has no tokenizer.ggml.pre; using llama.cpp's `default` splitting"
                            );
                            "default"
                        }
                    }
                };
                let split = PreSplit::from_name(pre).ok_or_else(|| TokenizerError::UnsupportedPre {
                    origin: origin.to_string(),
                    pre: pre.to_string(),
                })?;
                let merges_raw = meta.required_strings("tokenizer.ggml.merges")?;
                let inner = build_bpe(&tokens, &merges_raw, split, origin)?;
                (Engine::Hf(inner), split.default_add_bos)
            }
            GgufModel::Spm => {
                let scores = meta.optional_floats("tokenizer.ggml.scores")?.unwrap_or_default();
                let spm = Spm::new(&SpmVocab {
                    pieces: &tokens,
                    scores: &scores,
                    types: token_types.as_deref(),
                    unk_id: check_id("tokenizer.ggml.unknown_token_id")?.or(Some(0)),
                    add_space_prefix: meta.optional_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true),
                    rstrip_specials: meta.optional_str("general.name")?.is_some_and(|name| {
                        let name = name.to_ascii_lowercase();
                        name.contains("phi-3") || name.contains("phi3")
                    }),
                });
                (Engine::Spm(spm), true)
            }
            GgufModel::Wpm => {
                let unk = check_id("tokenizer.ggml.unknown_token_id")?.unwrap_or(100);
                let unk_text = tokens.get(unk as usize).copied().unwrap_or("[UNK]");
                (Engine::Hf(build_wpm(&tokens, unk_text).map_err(build_err)?), true)
            }
            GgufModel::Ugm => {
                let scores = meta.optional_floats("tokenizer.ggml.scores")?.unwrap_or_default();
                let charsmap =
                    meta.optional_bytes("tokenizer.ggml.precompiled_charsmap")?.unwrap_or_default();
                let unk = check_id("tokenizer.ggml.unknown_token_id")?.or_else(|| {
                    let types = token_types.as_deref()?;
                    types.iter().position(|&t| t == spm::token_type::UNKNOWN).map(|i| i as u32)
                });
                let ugm = UgmVocab {
                    tokens: &tokens,
                    scores: &scores,
                    types: token_types.as_deref(),
                    unk_id: unk,
                    charsmap: &charsmap,
                    add_space_prefix: meta.optional_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true),
                    remove_extra_whitespaces: meta
                        .optional_bool("tokenizer.ggml.remove_extra_whitespaces")?
                        .unwrap_or(true),
                };
                (Engine::Hf(build_ugm(&ugm).map_err(build_err)?), false)
            }
        };

        // Control and user-defined tokens match as whole strings before any
        // splitting, like llama.cpp's special-token partition. Their text is
        // stored raw (not byte-level mapped), which is also how added tokens
        // are written in tokenizer.json; their ids come from the vocabulary.
        // (SentencePiece keeps its own list.)
        if let (Engine::Hf(inner), Some(types)) = (&mut engine, &token_types) {
            let mut special = Vec::new();
            let mut user = Vec::new();
            for (text, ty) in tokens.iter().zip(types) {
                match *ty {
                    TOKEN_TYPE_CONTROL => special.push(AddedToken::from(*text, true)),
                    TOKEN_TYPE_USER_DEFINED => user.push(AddedToken::from(*text, false)),
                    _ => {}
                }
            }
            inner.add_special_tokens(special).map_err(|e| build_err(e.to_string()))?;
            inner.add_tokens(user).map_err(|e| build_err(e.to_string()))?;
        }

        // llama.cpp's defaults for SentencePiece vocabularies, which older
        // converters left implicit.
        let spm_default = |id: u32| (model_kind == GgufModel::Spm).then_some(id);
        let bos_id = check_id("tokenizer.ggml.bos_token_id")?.or(spm_default(1));
        let eos_id = check_id("tokenizer.ggml.eos_token_id")?.or(spm_default(2));
        let eot_id = check_id("tokenizer.ggml.eot_token_id")?;
        let mut eos_ids: Vec<u32> = eos_id.into_iter().collect();
        if let Some(eot) = eot_id {
            if !eos_ids.contains(&eot) {
                eos_ids.push(eot);
            }
        }
        let mut add_bos = meta.optional_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos);
        if model == "gemma4" {
            // llama.cpp always adds Gemma 4's BOS, whatever the metadata says.
            add_bos = true;
        }
        // Unigram (T5) vocabularies end a sequence with EOS unless told not to.
        let default_add_eos = model_kind == GgufModel::Ugm;
        let policy = SpecialPolicy {
            add_bos,
            add_eos: meta.optional_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(default_add_eos),
        };
        let chat_template = meta.optional_str("tokenizer.chat_template")?.map(str::to_string);
        let text_of = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize).map(|t| t.to_string()));
        let vocab_size = engine.max_id_plus_one();
        Ok(Tokenizer {
            engine,
            vocab_size,
            bos_token: text_of(bos_id),
            eos_token: text_of(eos_id),
            bos_id,
            eos_ids,
            policy: Some(policy),
            chat_template,
        })
    }

    /// Encodes `text` to ids. Special tokens written in the text are always
    /// recognized; `add_special` adds the BOS/EOS the tokenizer is configured
    /// to add around a sequence.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let encode_err =
            |e: tokenizers::Error| TokenizerError::Encode { len: text.len(), message: e.to_string() };
        let body = |engine: &Engine| -> Result<Vec<u32>, TokenizerError> {
            match engine {
                Engine::Hf(inner) => {
                    Ok(inner.encode_fast(text, false).map_err(encode_err)?.get_ids().to_vec())
                }
                Engine::Spm(spm) => Ok(spm.encode(text)),
            }
        };
        match (&self.engine, self.policy, add_special) {
            (_, Some(policy), true) => {
                let body = body(&self.engine)?;
                let mut ids = Vec::with_capacity(body.len() + 2);
                if policy.add_bos {
                    ids.extend(self.bos_id);
                }
                ids.extend_from_slice(&body);
                if policy.add_eos {
                    ids.extend(self.eos_ids.first().copied());
                }
                Ok(ids)
            }
            (Engine::Hf(inner), _, true) => {
                Ok(inner.encode_fast(text, true).map_err(encode_err)?.get_ids().to_vec())
            }
            (engine, _, _) => body(engine),
        }
    }

    /// Decodes ids to text; `skip_special` leaves out control tokens.
    /// An id outside the vocabulary is an error, not silently dropped.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(TokenizerError::IdOutOfRange { id, vocab_size: self.vocab_size });
        }
        match &self.engine {
            Engine::Hf(inner) => inner
                .decode(ids, skip_special)
                .map_err(|e| TokenizerError::Decode { count: ids.len(), message: e.to_string() }),
            Engine::Spm(spm) => Ok(spm.decode(ids, skip_special)),
        }
    }

    /// The raw bytes token `id` stands for, what OpenAI's `bytes` field
    /// carries: a token that is part of a character (its text alone is
    /// U+FFFD) still has its own bytes, and the bytes of a run of tokens
    /// concatenate to the UTF-8 of their text. For a byte-level vocabulary the
    /// token's characters are mapped back through the byte alphabet; a
    /// byte-fallback token `<0xNN>` is that byte; anything else (special
    /// tokens, other vocabularies) is the UTF-8 of its decoded text.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let inner = match &self.engine {
            Engine::Hf(inner) => inner,
            Engine::Spm(spm) => return spm.piece_bytes(id),
        };
        if let Some(piece) = inner.id_to_token(id) {
            if let Some(b) = byte_fallback_token(&piece) {
                return vec![b];
            }
            let added = inner.get_added_vocabulary().is_special_token(&piece);
            if !added && self.byte_level() {
                if let Some(bytes) = piece.chars().map(byte_of_char).collect::<Option<Vec<u8>>>() {
                    return bytes;
                }
            }
        }
        self.decode(&[id], false).unwrap_or_default().into_bytes()
    }

    /// Whether `id` is a special token (markers such as `<|im_end|>` that are
    /// not text, as the tokenizer file flags them).
    pub fn is_special(&self, id: u32) -> bool {
        match &self.engine {
            Engine::Hf(inner) => inner
                .id_to_token(id)
                .is_some_and(|piece| inner.get_added_vocabulary().is_special_token(&piece)),
            Engine::Spm(spm) => spm.is_control(id),
        }
    }

    /// Whether the decoder maps tokens through the byte-level alphabet.
    fn byte_level(&self) -> bool {
        use tokenizers::DecoderWrapper as D;
        let Engine::Hf(inner) = &self.engine else {
            return false;
        };
        match inner.get_decoder() {
            Some(D::ByteLevel(_)) => true,
            Some(D::Sequence(seq)) => seq.get_decoders().iter().any(|d| matches!(d, D::ByteLevel(_))),
            _ => false,
        }
    }

    /// One past the largest token id (the model's embedding table may be
    /// larger; ids in between decode to nothing).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Ids that end generation.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The beginning-of-sequence id, if the tokenizer has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// The BOS token's text, as chat templates see it (`bos_token`).
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS token's text, as chat templates see it (`eos_token`).
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// The id of a token given by its text (added tokens included).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match &self.engine {
            Engine::Hf(inner) => inner.token_to_id(token),
            Engine::Spm(spm) => spm.token_id(token),
        }
    }

    /// The checkpoint's own chat template source, if it has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Starts an incremental detokenizer for one generated sequence.
    pub fn decode_stream(&self, skip_special: bool) -> DecodeStream {
        DecodeStream::new(skip_special)
    }
}

/// Incremental detokenizer for streaming.
///
/// It keeps a short window of ids and emits the text that decoding the
/// window gained since the last emission. Text is held back while the
/// decode ends in U+FFFD, because that is what a character cut between two
/// byte-level tokens looks like; it is released once the character completes
/// (or by [`DecodeStream::finish`]). Decoding a window rather than single ids
/// keeps decoders that look at neighbouring tokens (leading-space rules)
/// right, so the concatenation of everything emitted, `finish` included,
/// equals `decode` of all ids.
///
/// The stream does not borrow the tokenizer; each call takes it, so a stream
/// can live beside an `Arc<Tokenizer>` in a request's state.
#[derive(Clone, Debug, Default)]
pub struct DecodeStream {
    skip_special: bool,
    /// Ids not yet released from the window.
    ids: Vec<u32>,
    /// Start of the window that is decoded for context.
    prefix_offset: usize,
    /// End of the text already emitted (exclusive, in ids).
    read_offset: usize,
}

impl DecodeStream {
    /// A new stream; `skip_special` must match the `decode` it is compared to.
    pub fn new(skip_special: bool) -> DecodeStream {
        DecodeStream { skip_special, ..DecodeStream::default() }
    }

    /// Adds one generated id; returns the text it completed, if any.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<Option<String>, TokenizerError> {
        self.ids.push(id);
        let prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special)?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        if full.len() <= prefix.len() || full.ends_with(REPLACEMENT) {
            return Ok(None);
        }
        let delta = new_suffix(&prefix, &full).to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        self.compact();
        Ok(Some(delta))
    }

    /// Releases whatever is still held back (an unfinished character comes
    /// out as U+FFFD, exactly as `decode` shows it) and resets the stream.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String, TokenizerError> {
        let prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special)?;
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        let rest = new_suffix(&prefix, &full).to_string();
        *self = DecodeStream::new(self.skip_special);
        Ok(rest)
    }

    /// Drops ids before the context window so memory stays bounded.
    fn compact(&mut self) {
        if self.prefix_offset > 0 {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
    }
}

/// The part of `full` after `prefix`. Decoders only append, so `prefix` is
/// normally a prefix of `full`; if a decoder rewrote earlier text, the part
/// after the longest common prefix (on a character boundary) is returned.
fn new_suffix<'a>(prefix: &str, full: &'a str) -> &'a str {
    if let Some(rest) = full.strip_prefix(prefix) {
        return rest;
    }
    let common = prefix
        .char_indices()
        .zip(full.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or(prefix.len().min(full.len()));
    &full[common..]
}

/// The tokenizer models of GGUF files we build, by `tokenizer.ggml.model`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GgufModel {
    /// `gpt2` (byte-level BPE) and `gemma4` (BPE over raw UTF-8).
    Bpe,
    /// `llama`: SentencePiece with scores and byte fallback.
    Spm,
    /// `bert`: WordPiece.
    Wpm,
    /// `t5`: SentencePiece Unigram.
    Ugm,
}

/// The `tokenizer.ggml.model` names we build, for error messages.
const SUPPORTED_MODELS: &[&str] = &["gpt2", "gemma4", "llama", "bert", "t5"];

/// What does the work behind a [`Tokenizer`]. There is one per loaded
/// model and it is never moved after loading, so its size does not matter.
#[allow(clippy::large_enum_variant)]
enum Engine {
    /// The `tokenizers` crate: Hugging Face files, GGUF BPE and WordPiece.
    Hf(tokenizers::Tokenizer),
    /// Our SentencePiece merge, for GGUF `llama` vocabularies.
    Spm(Spm),
}

impl Engine {
    /// One past the largest id of any token, added tokens included.
    fn max_id_plus_one(&self) -> usize {
        match self {
            Engine::Hf(t) => max_id_plus_one(t),
            Engine::Spm(s) => s.len(),
        }
    }
}

/// A BPE tokenizer from GGUF tokens and merges, split the way `split` says.
fn build_bpe(
    tokens: &[&str],
    merges_raw: &[&str],
    split: PreSplit,
    origin: &str,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    // llama.cpp's text-to-id map keeps the last of duplicated strings.
    let mut vocab = Vocab::with_capacity(tokens.len());
    for (id, text) in (0u32..).zip(tokens.iter()) {
        vocab.insert((*text).to_string(), id);
    }

    // A merge is "left right", split at the first space after the first
    // byte (a left part is never empty). Merges whose parts or result are
    // not tokens cannot fire in llama.cpp either; tokenizers refuses them
    // outright, so they are dropped and counted.
    let mut merges = Vec::with_capacity(merges_raw.len());
    let mut dropped = 0usize;
    for (index, merge) in merges_raw.iter().enumerate() {
        let split_at =
            merge.char_indices().skip(1).find(|&(_, c)| c == ' ').map(|(i, _)| i).ok_or_else(|| {
                TokenizerError::BadKey {
                    origin: origin.to_string(),
                    key: "tokenizer.ggml.merges".to_string(),
                    problem: format!("merge #{index} {merge:?} has no space between its parts"),
                }
            })?;
        let (left, right) = (&merge[..split_at], &merge[split_at + 1..]);
        let joined = format!("{left}{right}");
        if vocab.contains_key(left) && vocab.contains_key(right) && vocab.contains_key(&joined) {
            merges.push((left.to_string(), right.to_string()));
        } else {
            dropped += 1;
        }
    }
    if dropped > 0 {
        tracing::warn!(origin, dropped, "GGUF merges naming unknown tokens were dropped");
    }

    let build_err = |message: String| TokenizerError::Build { origin: origin.to_string(), message };
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(split.ignore_merges)
        // Raw UTF-8 vocabularies spell bytes without a piece as <0xNN>.
        .byte_fallback(!split.byte_level())
        .build()
        .map_err(|e| build_err(e.to_string()))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(split.pre_tokenizer().map_err(build_err)?));
    if split.byte_level() {
        inner.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevelDecoder::default())));
    } else {
        // Spaces are written as U+2581 before splitting, and turned back on
        // the way out after byte-fallback pieces are joined into text.
        let to_mark = Replace::new(" ", SPACE_MARK).map_err(|e| build_err(e.to_string()))?;
        inner
            .with_normalizer(Some(NormalizerWrapper::Replace(to_mark)))
            .map_err(|e| build_err(e.to_string()))?;
        let to_space = Replace::new(SPACE_MARK, " ").map_err(|e| build_err(e.to_string()))?;
        inner.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(vec![
            DecoderWrapper::Replace(to_space),
            DecoderWrapper::ByteFallback(ByteFallback::new()),
            DecoderWrapper::Fuse(Fuse::new()),
        ]))));
    }
    Ok(inner)
}

/// A Unigram vocabulary as read from GGUF metadata.
struct UgmVocab<'a> {
    tokens: &'a [&'a str],
    scores: &'a [f32],
    types: Option<&'a [u64]>,
    unk_id: Option<u32>,
    /// SentencePiece's compiled normalization rules (empty for none).
    charsmap: &'a [u8],
    add_space_prefix: bool,
    remove_extra_whitespaces: bool,
}

/// A SentencePiece Unigram (T5, XLM-R) tokenizer: the text is normalized by
/// the vocabulary's compiled rules, runs of spaces are collapsed and the ends
/// trimmed (`remove_extra_whitespaces`), spaces become U+2581 with one put in
/// front of each word, and the segmentation with the highest total score
/// wins. User-defined pieces score 0, as in llama.cpp, so whole matches of
/// them are preferred.
fn build_ugm(v: &UgmVocab<'_>) -> Result<tokenizers::Tokenizer, String> {
    let vocab: Vec<(String, f64)> = v
        .tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let ty = v.types.map_or(spm::token_type::NORMAL, |types| types[i]);
            let score = if ty == spm::token_type::USER_DEFINED {
                0.0
            } else {
                v.scores.get(i).copied().unwrap_or(0.0)
            };
            ((*t).to_string(), f64::from(score))
        })
        .collect();
    let byte_fallback = v.tokens.iter().any(|t| byte_fallback_token(t).is_some());
    let unigram =
        Unigram::from(vocab, v.unk_id.map(|id| id as usize), byte_fallback).map_err(|e| e.to_string())?;
    let mut inner = tokenizers::Tokenizer::new(unigram);
    let mut normalizers = Vec::new();
    if !v.charsmap.is_empty() {
        let compiled = Precompiled::from(v.charsmap).map_err(|e| format!("precompiled_charsmap: {e}"))?;
        normalizers.push(NormalizerWrapper::Precompiled(compiled));
    }
    if v.remove_extra_whitespaces {
        let collapse =
            Replace::new(ReplacePattern::Regex(" {2,}".to_string()), " ").map_err(|e| e.to_string())?;
        normalizers.push(NormalizerWrapper::Replace(collapse));
        normalizers.push(NormalizerWrapper::StripNormalizer(Strip::new(true, true)));
    }
    inner
        .with_normalizer(Some(NormalizerWrapper::Sequence(NormalizerSequence::new(normalizers))))
        .map_err(|e| e.to_string())?;
    let scheme = if v.add_space_prefix { PrependScheme::Always } else { PrependScheme::Never };
    let mark = '\u{2581}';
    inner.with_pre_tokenizer(Some(PreTokenizerWrapper::Metaspace(Metaspace::new(mark, scheme, true))));
    // Decoding turns U+2581 back into spaces and takes away the one space
    // put in front of the text.
    let to_space = Replace::new(SPACE_MARK, " ").map_err(|e| e.to_string())?;
    let mut decoders = vec![
        DecoderWrapper::Replace(to_space),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if v.add_space_prefix {
        decoders.push(DecoderWrapper::Strip(DecoderStrip::new(' ', 1, 0)));
    }
    inner.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(decoders))));
    Ok(inner)
}

/// A WordPiece (BERT) tokenizer. llama.cpp's converter writes a word-start
/// piece `x` as `▁x` and a continuation `##x` as `x`, keeping `[...]`
/// specials as they are; the original spelling is restored for WordPiece.
/// Text is cleaned, lowercased and stripped of accents, and split at
/// whitespace, punctuation and CJK characters, as BERT's uncased
/// tokenizers do.
fn build_wpm(tokens: &[&str], unk: &str) -> Result<tokenizers::Tokenizer, String> {
    let mut vocab = Vocab::with_capacity(tokens.len());
    for (id, text) in (0u32..).zip(tokens.iter()) {
        let original = if let Some(word) = text.strip_prefix(SPACE_MARK) {
            word.to_string()
        } else if text.starts_with('[') && text.ends_with(']') {
            (*text).to_string()
        } else {
            format!("##{text}")
        };
        vocab.entry(original).or_insert(id);
    }
    let wordpiece = WordPiece::builder()
        .vocab(vocab)
        .unk_token(unk.to_string())
        .continuing_subword_prefix("##".to_string())
        .max_input_chars_per_word(100)
        .build()
        .map_err(|e| e.to_string())?;
    let mut inner = tokenizers::Tokenizer::new(wordpiece);
    inner
        .with_normalizer(Some(NormalizerWrapper::BertNormalizer(BertNormalizer::new(true, true, None, true))))
        .map_err(|e| e.to_string())?;
    inner.with_pre_tokenizer(Some(PreTokenizerWrapper::BertPreTokenizer(BertPreTokenizer)));
    inner.with_decoder(Some(DecoderWrapper::WordPiece(WordPieceDecoder::new("##".to_string(), true))));
    Ok(inner)
}

/// Typed access to GGUF metadata that names the key and the source in errors.
struct GgufMeta<'o, F> {
    get: F,
    origin: &'o str,
}

impl<'a, F> GgufMeta<'_, F>
where
    F: Fn(&str) -> Option<&'a GgufValue>,
{
    fn bad(&self, key: &str, value: &GgufValue, want: &str) -> TokenizerError {
        TokenizerError::BadKey {
            origin: self.origin.to_string(),
            key: key.to_string(),
            problem: format!("expected {want}, found {}", value.type_name()),
        }
    }

    fn missing(&self, key: &str) -> TokenizerError {
        TokenizerError::MissingKey { origin: self.origin.to_string(), key: key.to_string() }
    }

    fn optional_str(&self, key: &str) -> Result<Option<&'a str>, TokenizerError> {
        match (self.get)(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.bad(key, v, "a string")),
        }
    }

    fn required_str(&self, key: &str) -> Result<&'a str, TokenizerError> {
        self.optional_str(key)?.ok_or_else(|| self.missing(key))
    }

    fn required_strings(&self, key: &str) -> Result<Vec<&'a str>, TokenizerError> {
        let v = (self.get)(key).ok_or_else(|| self.missing(key))?;
        v.as_string_array().ok_or_else(|| self.bad(key, v, "an array of strings"))
    }

    fn optional_ints(&self, key: &str) -> Result<Option<Vec<u64>>, TokenizerError> {
        let Some(v) = (self.get)(key) else {
            return Ok(None);
        };
        let items = v.as_array().ok_or_else(|| self.bad(key, v, "an array of integers"))?;
        items
            .iter()
            .map(|item| item.as_u64().ok_or_else(|| self.bad(key, item, "non-negative integers")))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    fn optional_floats(&self, key: &str) -> Result<Option<Vec<f32>>, TokenizerError> {
        let Some(v) = (self.get)(key) else {
            return Ok(None);
        };
        let items = v.as_array().ok_or_else(|| self.bad(key, v, "an array of numbers"))?;
        items
            .iter()
            .map(|item| item.as_f64().map(|x| x as f32).ok_or_else(|| self.bad(key, item, "numbers")))
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    /// An array of bytes (GGUF writes them as u8 or i8).
    fn optional_bytes(&self, key: &str) -> Result<Option<Vec<u8>>, TokenizerError> {
        let Some(v) = (self.get)(key) else {
            return Ok(None);
        };
        let items = v.as_array().ok_or_else(|| self.bad(key, v, "an array of bytes"))?;
        items
            .iter()
            .map(|item| match item {
                GgufValue::U8(b) => Ok(*b),
                GgufValue::I8(b) => Ok(*b as u8),
                other => Err(self.bad(key, other, "bytes")),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    fn optional_u64(&self, key: &str) -> Result<Option<u64>, TokenizerError> {
        match (self.get)(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| self.bad(key, v, "a non-negative integer")),
        }
    }

    fn optional_bool(&self, key: &str) -> Result<Option<bool>, TokenizerError> {
        match (self.get)(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.bad(key, v, "a boolean")),
        }
    }
}

/// One past the largest id of any token, added tokens included.
fn max_id_plus_one(tokenizer: &tokenizers::Tokenizer) -> usize {
    tokenizer.get_vocab(true).values().max().map_or(0, |&id| id as usize + 1)
}

/// Reads a JSON file that may be absent.
fn read_optional_json(path: &Path) -> Result<Option<Json>, TokenizerError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(TokenizerError::Io { path: path.to_path_buf(), source }),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TokenizerError::Parse { path: path.to_path_buf(), message: e.to_string() })
}

/// A special token in tokenizer_config.json: a string, an AddedToken object
/// (`{"content": ...}`), or null.
fn special_token_text(config: &Json, key: &str, origin: &str) -> Result<Option<String>, TokenizerError> {
    match config.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Object(obj)) => match obj.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => Err(TokenizerError::BadKey {
                origin: origin.to_string(),
                key: key.to_string(),
                problem: "an AddedToken object without a string `content`".to_string(),
            }),
        },
        Some(other) => Err(TokenizerError::BadKey {
            origin: origin.to_string(),
            key: key.to_string(),
            problem: format!("expected a string or an AddedToken object, found {other}"),
        }),
    }
}

/// A token id field that may be one integer or a list of them.
fn id_list(config: &Json, key: &str, origin: &str) -> Result<Vec<u32>, TokenizerError> {
    let bad = |problem: String| TokenizerError::BadKey {
        origin: origin.to_string(),
        key: key.to_string(),
        problem,
    };
    let one = |v: &Json| -> Result<u32, TokenizerError> {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| bad(format!("expected a token id, found {v}")))
    };
    match config.get(key) {
        None | Some(Json::Null) => Ok(Vec::new()),
        Some(Json::Array(items)) => items.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

fn optional_bool(config: &Json, key: &str, origin: &str) -> Result<Option<bool>, TokenizerError> {
    match config.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(TokenizerError::BadKey {
            origin: origin.to_string(),
            key: key.to_string(),
            problem: format!("expected a boolean, found {other}"),
        }),
    }
}

/// `chat_template` in tokenizer_config.json: a string, or a list of
/// `{name, template}` objects of which the one named "default" is used.
fn chat_template_from_config(config: &Json, origin: &str) -> Result<Option<String>, TokenizerError> {
    let bad = |problem: &str| TokenizerError::BadKey {
        origin: origin.to_string(),
        key: "chat_template".to_string(),
        problem: problem.to_string(),
    };
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Array(items)) => {
            for item in items {
                let name = item.get("name").and_then(Json::as_str);
                let template = item.get("template").and_then(Json::as_str);
                match (name, template) {
                    (Some("default"), Some(t)) => return Ok(Some(t.to_string())),
                    (Some(_), Some(_)) => {}
                    _ => return Err(bad("list entries must be {\"name\", \"template\"} strings")),
                }
            }
            Err(bad("a list of named templates without one named \"default\""))
        }
        Some(_) => Err(bad("expected a string or a list of named templates")),
    }
}

/// Newer transformers versions save the template beside the config instead.
fn chat_template_from_files(dir: &Path) -> Result<Option<String>, TokenizerError> {
    let jinja = dir.join("chat_template.jinja");
    match std::fs::read_to_string(&jinja) {
        Ok(text) => return Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(TokenizerError::Io { path: jinja, source }),
    }
    let json_path = dir.join("chat_template.json");
    let origin = json_path.display().to_string();
    match read_optional_json(&json_path)? {
        Some(json) => chat_template_from_config(&json, &origin),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_suffix_handles_rewrites_on_char_boundaries() {
        assert_eq!(new_suffix("ab", "abc"), "c");
        assert_eq!(new_suffix("aé", "aèx"), "èx");
        assert_eq!(new_suffix("abc", "ab"), "");
    }
}
