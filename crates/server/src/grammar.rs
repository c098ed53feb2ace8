//! Structured output by constrained decoding, with llguidance.
//!
//! A JSON schema (`response_format`, or the arguments of a function forced
//! by `tool_choice`) is compiled at the edge, so a schema the compiler
//! refuses is a 400 before anything is queued. Each choice gets its own
//! grammar state, a [`corridor_engine::sampling::TokenConstraint`] that the
//! engine asks for the allowed tokens before every step; the sampler masks
//! the rest.
//!
//! The compiler needs every token's bytes: they come from the served
//! tokenizer ([`Tokenizer::token_bytes`]); special tokens are given
//! llguidance's special-token marker so that no grammar ever produces them as
//! text, and ids past the tokenizer (padding rows of the embedding table) have
//! no bytes and are never allowed. End of sequence is allowed exactly when
//! the grammar is complete, and then every end id of the model is, not just
//! the one the compiler knows.
//!
//! JSON is generated compactly but readably (`{"a": 1, "b": [2, 3]}`), with
//! no optional whitespace: with it, a weak model can spend its whole budget
//! on newlines and never close the object.

use std::sync::Arc;

use corridor_engine::sampling::{Constraint, ConstraintError, TokenConstraint, TokenMask};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value as Json};

use crate::tokenizer::Tokenizer;

/// A grammar that could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The tokenizer cannot be described to the grammar compiler.
    #[error("structured output is not available for this tokenizer: {0}")]
    Tokenizer(String),
    /// The schema does not compile.
    #[error("the schema cannot be used for constrained decoding: {0}")]
    Schema(String),
}

/// The served vocabulary as llguidance sees it.
struct VocabEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for VocabEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.tokenizer.encode(&String::from_utf8_lossy(s), false).unwrap_or_default()
    }
}

/// Compiles schemas for one served model; built once, shared by requests.
pub struct GrammarCompiler {
    factory: ParserFactory,
    eos_ids: Arc<[u32]>,
    /// The end id the compiler's masks use.
    trie_eos: u32,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").field("eos_ids", &self.eos_ids).finish()
    }
}

impl GrammarCompiler {
    /// `vocab`: the width of the model's logits (at least the tokenizer's).
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        vocab: usize,
        eos_ids: &[u32],
    ) -> Result<GrammarCompiler, GrammarError> {
        let trie_eos =
            *eos_ids.first().ok_or_else(|| GrammarError::Tokenizer("the model has no end token".into()))?;
        let width = vocab.max(tokenizer.vocab_size());
        let words: Vec<Vec<u8>> = (0..width as u32)
            .map(|id| {
                if id as usize >= tokenizer.vocab_size() {
                    return Vec::new();
                }
                let bytes = tokenizer.token_bytes(id);
                if tokenizer.is_special(id) || eos_ids.contains(&id) {
                    let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    marked.extend(bytes);
                    marked
                } else {
                    bytes
                }
            })
            .collect();
        let info = TokRxInfo::new(width as u32, trie_eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(VocabEnv { trie, tokenizer });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        factory.quiet();
        Ok(GrammarCompiler { factory, eos_ids: eos_ids.into(), trie_eos })
    }

    /// A fresh grammar state for output matching `schema`.
    pub fn json_schema(&self, schema: &Json) -> Result<Constraint, GrammarError> {
        let mut schema = match schema {
            Json::Object(_) => schema.clone(),
            // `true` accepts any JSON value; `false` none, which the
            // compiler reports.
            Json::Bool(true) => json!({}),
            other => return Err(GrammarError::Schema(format!("a schema must be an object, got {other}"))),
        };
        if let Some(obj) = schema.as_object_mut() {
            obj.entry("x-guidance").or_insert(json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            }));
        }
        let grammar = TopLevelGrammar::from_json_schema(schema);
        let parser = self.factory.create_parser(grammar).map_err(|e| GrammarError::Schema(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Schema(e));
        }
        Ok(Constraint(Box::new(JsonGrammar {
            matcher,
            eos_ids: self.eos_ids.clone(),
            trie_eos: self.trie_eos,
        })))
    }
}

/// One choice's grammar state.
struct JsonGrammar {
    matcher: Matcher,
    eos_ids: Arc<[u32]>,
    trie_eos: u32,
}

impl TokenConstraint for JsonGrammar {
    fn mask(&mut self, vocab: usize) -> Result<TokenMask, ConstraintError> {
        let vob = self.matcher.compute_mask_or_eos().map_err(|e| ConstraintError(e.to_string()))?;
        let mut words = vob.as_slice().to_vec();
        words.resize(vocab.div_ceil(32), 0);
        let mut mask = TokenMask::from_words(words);
        if vob.is_allowed(self.trie_eos) {
            self.eos_ids.iter().for_each(|&e| mask.allow(corridor_units::TokenId(e)));
        }
        Ok(mask)
    }

    fn accept(&mut self, token: corridor_units::TokenId) -> Result<(), ConstraintError> {
        self.matcher.consume_token(token.get()).map_err(|e| ConstraintError(e.to_string()))
    }

    fn fork(&self) -> Box<dyn TokenConstraint> {
        Box::new(JsonGrammar {
            matcher: self.matcher.deep_clone(),
            eos_ids: self.eos_ids.clone(),
            trie_eos: self.trie_eos,
        })
    }
}

/// The compiler for the served model, built on the first request that
/// needs one (building it walks the whole vocabulary), then shared.
pub struct LazyGrammar {
    cell: std::sync::OnceLock<Result<GrammarCompiler, GrammarError>>,
    tokenizer: Arc<Tokenizer>,
    vocab: usize,
    eos_ids: Vec<u32>,
}

impl LazyGrammar {
    pub fn new(tokenizer: Arc<Tokenizer>, vocab: usize, eos_ids: Vec<u32>) -> LazyGrammar {
        LazyGrammar { cell: std::sync::OnceLock::new(), tokenizer, vocab, eos_ids }
    }

    pub fn get(&self) -> Result<&GrammarCompiler, GrammarError> {
        self.cell
            .get_or_init(|| GrammarCompiler::new(self.tokenizer.clone(), self.vocab, &self.eos_ids))
            .as_ref()
            .map_err(Clone::clone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn tiny_tokenizer() -> Arc<Tokenizer> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/llama-f32");
        Arc::new(Tokenizer::from_hf_dir(&dir).expect("tiny tokenizer"))
    }

    /// Walks the grammar choosing uniformly among the allowed tokens (a
    /// model with no preference at all) until it ends; the text must be
    /// valid JSON matching the schema every time.
    #[test]
    fn random_walks_under_the_mask_produce_valid_documents() {
        let tok = tiny_tokenizer();
        let eos = vec![2u32];
        let vocab = tok.vocab_size() + 3; // padding rows past the tokenizer
        let compiler = GrammarCompiler::new(tok.clone(), vocab, &eos).expect("compiler");
        let schema = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "ok": {"type": "boolean"},
                "color": {"enum": ["red", "green"]},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}
            },
            "required": ["name", "age", "ok", "color", "tags"],
            "additionalProperties": false
        });
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for walk in 0..20 {
            let mut c = compiler.json_schema(&schema).expect("compiles");
            let mut out = Vec::new();
            let mut ended = false;
            for _ in 0..400 {
                let mask = c.0.mask(vocab).expect("mask");
                let allowed: Vec<u32> =
                    (0..vocab as u32).filter(|&t| mask.allows(corridor_units::TokenId(t))).collect();
                assert!(!allowed.is_empty(), "walk {walk}: nothing allowed after {out:?}");
                assert!(
                    allowed.iter().all(|&t| (t as usize) < tok.vocab_size()),
                    "padding ids are never allowed"
                );
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let token = allowed[(state >> 33) as usize % allowed.len()];
                if token == 2 {
                    ended = true;
                    break;
                }
                c.0.accept(corridor_units::TokenId(token)).expect("allowed tokens are accepted");
                out.push(token);
            }
            assert!(ended, "walk {walk} did not end");
            let text = tok.decode(&out, false).expect("decodes");
            let v: Json =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("walk {walk}: {text:?}: {e}"));
            assert!(v["name"].as_str().is_some_and(|s| s.chars().count() <= 6), "{text}");
            assert!(v["age"].as_i64().is_some_and(|a| (0..=120).contains(&a)), "{text}");
            assert!(v["ok"].is_boolean(), "{text}");
            assert!(v["color"] == "red" || v["color"] == "green", "{text}");
            assert!(v["tags"].as_array().is_some_and(|t| t.len() <= 2), "{text}");
            assert_eq!(v.as_object().map(|o| o.len()), Some(5), "{text}");
        }
    }

    #[test]
    fn end_is_allowed_only_when_complete_and_forks_are_independent() {
        let tok = tiny_tokenizer();
        let compiler = GrammarCompiler::new(tok.clone(), tok.vocab_size(), &[2]).expect("compiler");
        let mut c = compiler.json_schema(&json!({"type": "boolean"})).expect("compiles");
        let vocab = tok.vocab_size();
        assert!(
            !c.0.mask(vocab).expect("mask").allows(corridor_units::TokenId(2)),
            "an empty document is not complete"
        );
        let fork = c.clone();
        for t in tok.encode("true", false).expect("encodes") {
            c.0.accept(corridor_units::TokenId(t)).expect("accepted");
        }
        assert!(c.0.mask(vocab).expect("mask").allows(corridor_units::TokenId(2)));
        let mut fork = fork;
        assert!(
            !fork.0.mask(vocab).expect("mask").allows(corridor_units::TokenId(2)),
            "the fork kept its own state"
        );
    }

    #[test]
    fn bad_schemas_are_refused() {
        let tok = tiny_tokenizer();
        let compiler = GrammarCompiler::new(tok.clone(), tok.vocab_size(), &[2]).expect("compiler");
        assert!(matches!(
            compiler.json_schema(
                &json!({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]})
            ),
            Err(GrammarError::Schema(_))
        ));
        assert!(matches!(compiler.json_schema(&json!("string")), Err(GrammarError::Schema(_))));
    }
}
