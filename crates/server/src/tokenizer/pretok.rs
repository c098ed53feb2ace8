//! The pre-tokenizers of GGUF BPE vocabularies, by `tokenizer.ggml.pre` name.
//!
//! llama.cpp's converter names the splitting rules a BPE vocabulary needs
//! (often by hashing the upstream tokenizer), and llama.cpp maps each name,
//! and the aliases it accepts, to a list of regexes taken from the upstream
//! `tokenizer.json` files. Every regex of a list splits the pieces left by
//! the one before; text a regex does not match stays a piece of its own.
//! The same lists are reproduced here as `tokenizers` `Split` stages, with
//! `(?i:...)` spelled out as llama.cpp does. A few names also change how the
//! pieces are merged (`ignore_merges`), whether a BOS is added by default,
//! and whether pieces are byte-level mapped (SentencePiece-style BPE such as
//! Gemma 4 keeps raw UTF-8, writes spaces as U+2581 and falls back to
//! `<0xNN>` byte tokens).
//!
//! Names llama.cpp handles with hand-written splitting code (`kimi-k2`,
//! `afmoe`), or with a tokenizer model of their own (`whitespace`), are not
//! in the table and are refused by name.

use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

/// One family of splitting rules (llama.cpp's `LLAMA_VOCAB_PRE_TYPE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PreKind {
    Default,
    Llama3,
    Jais2,
    DeepseekLlm,
    Deepseek3,
    Spark25,
    Youtu,
    DeepseekCoder,
    Falcon,
    DigitsThenGpt2,
    Gpt2,
    Qwen2,
    Qwen35,
    Bloom,
    Viking,
    Tekken,
    Chameleon,
    Gpt4o,
    GraniteEmbedMulti,
    TinyAya,
    BailingMoe,
    SeedCoder,
    Ufakzeka,
    Laguna,
    ExaoneMoe,
    Minicpm5,
    /// SentencePiece-style BPE on raw UTF-8 (Gemma 4, Sarvam).
    SpmStyle,
}

/// What a `tokenizer.ggml.pre` name asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PreSplit {
    pub kind: PreKind,
    /// A whole piece that is itself a token is taken without merging.
    pub ignore_merges: bool,
    /// llama.cpp's BOS default when the GGUF has no `add_bos_token` key.
    pub default_add_bos: bool,
}

/// Every name [`PreSplit::from_name`] knows, for error messages and tests.
pub(super) const SUPPORTED_PRE: &[&str] = &[
    "default",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
    "dbrx",
    "smaug-bpe",
    "chatglm-bpe",
    "glm4",
    "glm5",
    "jais-2",
    "deepseek-llm",
    "deepseek-v3",
    "hunyuan-dense",
    "joyai-llm",
    "hy_v4",
    "spark2_5",
    "youtu",
    "deepseek-coder",
    "falcon",
    "starcoder",
    "refact",
    "command-r",
    "smollm",
    "codeshell",
    "exaone",
    "minerva-7b",
    "mellum2",
    "gpt-2",
    "phi-2",
    "jina-es",
    "jina-de",
    "gigachat",
    "jina-v2-es",
    "jina-v2-de",
    "a.x-4.0",
    "mellum",
    "modern-bert",
    "jina-v1-en",
    "jina-v2-code",
    "roberta-bpe",
    "mpt",
    "olmo",
    "jais",
    "trillion",
    "granite-docling",
    "exaone4",
    "stablelm2",
    "qwen2",
    "deepseek-r1-qwen",
    "kormo",
    "f2llmv2",
    "hunyuan",
    "solar-open",
    "megrez",
    "qwen35",
    "poro-chat",
    "bloom",
    "gpt3-finnish",
    "viking",
    "tekken",
    "chameleon",
    "gpt-4o",
    "llama4",
    "kanana2",
    "talkie",
    "minimax-m2",
    "granite-embed-multi-97m",
    "tiny_aya",
    "cohere2moe",
    "bailingmoe",
    "bailingmoe2",
    "llada-moe",
    "seed-coder",
    "ufakzeka",
    "grok-2",
    "laguna",
    "exaone-moe",
    "minicpm5",
    "gemma4",
    "granite-embed-multi-311m",
    "sarvam-moe",
];

/// The English contractions, case-insensitive, as llama.cpp spells them.
macro_rules! contractions {
    () => {
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    };
}

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str = concat!(
    contractions!(),
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const JAIS2: &str = concat!(
    contractions!(),
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+",
    r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)",
    r"|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
);
const QWEN2: &str = concat!(
    contractions!(),
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const QWEN35: &str = concat!(
    contractions!(),
    r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
/// The letter ranges of DeepSeek LLM's tokenizer.json (cased scripts),
/// escaped because several of its characters change under Unicode
/// normalization (U+1FD3 would become U+0390 and empty a range).
const DEEPSEEK_LETTERS: &str = concat!(
    "\\s?[A-Za-z\u{b5}\u{c0}-\u{d6}\u{d8}-\u{f6}\u{f8}-\u{1ba}\u{1bc}-\u{1bf}\u{1c4}-",
    "\u{293}\u{295}-\u{2af}\u{370}-\u{373}\u{376}\u{377}\u{37b}-\u{37d}\u{37f}\u{386}",
    "\u{388}-\u{38a}\u{38c}\u{38e}-\u{3a1}\u{3a3}-\u{3f5}\u{3f7}-\u{481}\u{48a}-\u{52f}",
    "\u{531}-\u{556}\u{10a0}-\u{10c5}\u{13a0}-\u{13f5}\u{13f8}-\u{13fd}\u{1c90}-\u{1cba}",
    "\u{1cbd}-\u{1cbf}\u{1d00}-\u{1d2b}\u{1d6b}-\u{1d77}\u{1d79}-\u{1d9a}\u{1e00}-",
    "\u{1f15}\u{1f18}-\u{1f1d}\u{1f20}-\u{1f45}\u{1f48}-\u{1f4d}\u{1f50}-\u{1f57}\u{1f59}",
    "\u{1f5b}\u{1f5d}\u{1f5f}-\u{1f7d}\u{1f80}-\u{1fb4}\u{1fb6}-\u{1fbc}\u{1fbe}\u{1fc2}-",
    "\u{1fc4}\u{1fc6}-\u{1fcc}\u{1fd0}-\u{1fd3}\u{1fd6}-\u{1fdb}\u{1fe0}-\u{1fec}\u{1ff2}",
    "-\u{1ff4}\u{1ff6}-\u{1ffc}\u{2102}\u{2107}\u{210a}-\u{2113}\u{2115}\u{2119}-\u{211d}",
    "\u{2124}\u{2126}\u{2128}\u{212a}-\u{212d}\u{212f}-\u{2134}\u{2139}\u{213c}-\u{213f}",
    "\u{2145}-\u{2149}\u{214e}\u{2183}\u{2184}\u{2c00}-\u{2c7b}\u{2c7e}-\u{2ce4}\u{2ceb}-",
    "\u{2cee}\u{2cf2}\u{2cf3}\u{a640}-\u{a66d}\u{a680}-\u{a69b}\u{a722}-\u{a76f}\u{a771}-",
    "\u{a787}\u{a78b}-\u{a78e}\u{ab70}-\u{abbf}\u{fb00}-\u{fb06}\u{fb13}-\u{fb17}\u{ff21}",
    "-\u{ff3a}\u{ff41}-\u{ff5a}\u{10400}-\u{1044f}\u{104b0}-\u{104d3}\u{104d8}-\u{104fb}",
    "\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}]+",
);
const CJK_HANGUL: &str = r"[一-龥ࠀ-一가-퟿]+";
const CJK_KANA: &str = r"[一-龥぀-ゟ゠-ヿ]+";
const DEEPSEEK3_MAIN: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##;
const SPARK25_MAIN: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"##;
const YOUTU_CJK: &str = r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+";
const YOUTU_MAIN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    contractions!(),
    r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
    contractions!(),
    r"?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const BLOOM: &str = r" ?[^(\s|.,!?…。，、।۔،)]+";
const TEKKEN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+",
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*",
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const GPT4O: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+",
    contractions!(),
    r"?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*",
    contractions!(),
    r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const GRANITE_EMBED_MULTI: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+",
    contractions!(),
    r"?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*",
    contractions!(),
    r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const TINY_AYA_MAIN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    contractions!(),
    r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
    contractions!(),
    r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const BAILINGMOE: &str = r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";
const SEED_CODER: &str = concat!(
    contractions!(),
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const UFAKZEKA: &str = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const EXAONE_MOE: &str = concat!(
    contractions!(),
    r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"
);
const MINICPM5: &str = concat!(
    contractions!(),
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const LINES: &str = r"[^\n]+|[\n]+";

impl PreKind {
    /// The regexes, applied in order.
    fn patterns(self) -> Vec<&'static str> {
        use PreKind as K;
        match self {
            K::Default => vec![r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
            K::Llama3 => vec![LLAMA3],
            K::Jais2 => vec![JAIS2],
            K::DeepseekLlm => {
                vec![
                    r"[\r\n]",
                    DEEPSEEK_LETTERS,
                    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
                    r"\s+$",
                    CJK_HANGUL,
                    r"\p{N}+",
                ]
            }
            K::Deepseek3 => vec![r"\p{N}{1,3}", CJK_KANA, DEEPSEEK3_MAIN],
            K::Spark25 => vec![r"\p{N}{1,3}", CJK_KANA, SPARK25_MAIN, r"\p{N}"],
            K::Youtu => vec![YOUTU_CJK, YOUTU_MAIN],
            K::DeepseekCoder => vec![r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK_HANGUL, r"\p{N}"],
            K::Falcon => vec![r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"],
            K::DigitsThenGpt2 => vec![r"\p{N}", GPT2],
            K::Gpt2 => vec![GPT2],
            K::Qwen2 => vec![QWEN2],
            K::Qwen35 => vec![QWEN35],
            K::Bloom => vec![BLOOM],
            K::Viking => vec![BLOOM, r"\p{N}"],
            K::Tekken => vec![TEKKEN],
            K::Chameleon => vec![
                "<sentinel:[0-9]+>",
                "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                "([\\t\\n]|    |  )",
                r"\p{N}",
                r"[\p{P}!-/:-@\[-`{-~]",
                GPT2,
            ],
            K::Gpt4o => vec![GPT4O],
            K::GraniteEmbedMulti => vec![GRANITE_EMBED_MULTI],
            K::TinyAya => vec![r"\d{1,3}(?=(?:\d{3})*\b)", TINY_AYA_MAIN],
            K::BailingMoe => vec![BAILINGMOE],
            K::SeedCoder => vec![SEED_CODER],
            K::Ufakzeka => vec![UFAKZEKA],
            K::Laguna => vec![LINES, QWEN2],
            K::ExaoneMoe => vec![EXAONE_MOE],
            K::Minicpm5 => vec![r"\p{N}{1,3}", MINICPM5],
            K::SpmStyle => vec![LINES],
        }
    }
}

impl PreSplit {
    /// The rules for a `tokenizer.ggml.pre` name, or `None` for a name we
    /// do not implement.
    pub fn from_name(name: &str) -> Option<PreSplit> {
        use PreKind as K;
        let (kind, ignore_merges, default_add_bos) = match name {
            "default" => (K::Default, false, false),
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
            | "lfm2" | "jina-v5-nano" => (K::Llama3, true, true),
            "dbrx" | "smaug-bpe" | "chatglm-bpe" => (K::Llama3, false, false),
            "glm4" | "glm5" => (K::Llama3, true, false),
            "jais-2" => (K::Jais2, false, false),
            "deepseek-llm" => (K::DeepseekLlm, false, false),
            "deepseek-v3" | "hunyuan-dense" | "joyai-llm" | "hy_v4" => (K::Deepseek3, false, false),
            "spark2_5" => (K::Spark25, false, false),
            "youtu" => (K::Youtu, true, false),
            "deepseek-coder" => (K::DeepseekCoder, false, false),
            "falcon" => (K::Falcon, false, false),
            "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b"
            | "mellum2" => (K::DigitsThenGpt2, false, false),
            "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
            | "a.x-4.0" | "mellum" | "modern-bert" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe"
            | "mpt" | "olmo" | "jais" | "trillion" | "granite-docling" | "exaone4" => (K::Gpt2, false, false),
            "stablelm2" | "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "hunyuan" | "solar-open"
            | "megrez" | "grok-2" => (K::Qwen2, false, false),
            "qwen35" => (K::Qwen35, false, false),
            "poro-chat" | "bloom" | "gpt3-finnish" => (K::Bloom, false, false),
            "viking" => (K::Viking, false, false),
            "tekken" => (K::Tekken, true, true),
            "chameleon" => (K::Chameleon, false, true),
            "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => (K::Gpt4o, false, false),
            "granite-embed-multi-97m" => (K::GraniteEmbedMulti, true, false),
            "tiny_aya" | "cohere2moe" => (K::TinyAya, false, false),
            "bailingmoe" | "bailingmoe2" | "llada-moe" => (K::BailingMoe, false, false),
            "seed-coder" => (K::SeedCoder, false, false),
            "ufakzeka" => (K::Ufakzeka, false, false),
            "laguna" => (K::Laguna, false, false),
            "exaone-moe" => (K::ExaoneMoe, false, false),
            "minicpm5" => (K::Minicpm5, true, false),
            // llama.cpp always adds Gemma 4's BOS, whatever the metadata says.
            "gemma4" | "granite-embed-multi-311m" => (K::SpmStyle, false, true),
            "sarvam-moe" => (K::SpmStyle, false, false),
            _ => return None,
        };
        Some(PreSplit { kind, ignore_merges, default_add_bos })
    }

    /// Whether pieces are mapped through GPT-2's byte alphabet (otherwise
    /// they stay raw UTF-8 with spaces written as U+2581).
    pub fn byte_level(self) -> bool {
        self.kind != PreKind::SpmStyle
    }

    /// The `tokenizers` pre-tokenizer: the split stages, then (for
    /// byte-level vocabularies) the mapping of bytes to GPT-2's alphabet.
    pub fn pre_tokenizer(self) -> Result<PreTokenizerWrapper, String> {
        let mut stages = Vec::new();
        for pattern in self.kind.patterns() {
            let split =
                Split::new(SplitPattern::Regex(pattern.to_string()), SplitDelimiterBehavior::Isolated, false)
                    .map_err(|e| format!("pattern {pattern:?}: {e}"))?;
            stages.push(PreTokenizerWrapper::Split(split));
        }
        if self.byte_level() {
            // The splitting is done; ByteLevel only maps bytes to its alphabet.
            stages.push(PreTokenizerWrapper::ByteLevel(
                ByteLevel::default().add_prefix_space(false).use_regex(false),
            ));
        }
        Ok(PreTokenizerWrapper::Sequence(Sequence::new(stages)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_supported_name_is_known_and_compiles() {
        for name in SUPPORTED_PRE {
            let split = PreSplit::from_name(name).unwrap_or_else(|| panic!("{name} is listed but unknown"));
            split.pre_tokenizer().unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        for refused in ["kimi-k2", "afmoe", "whitespace", "tekken2", ""] {
            assert_eq!(PreSplit::from_name(refused), None, "{refused}");
        }
    }

    #[test]
    fn aliases_share_their_family() {
        let llama3 = PreSplit::from_name("llama-bpe").unwrap();
        assert_eq!(PreSplit::from_name("llama3"), Some(llama3));
        // Smaug's splitting is Llama 3's, without its merge shortcut or BOS.
        let smaug = PreSplit::from_name("smaug-bpe").unwrap();
        assert_eq!(smaug.kind, PreKind::Llama3);
        assert!(!smaug.ignore_merges && !smaug.default_add_bos);
        assert_eq!(PreSplit::from_name("deepseek-r1-qwen").unwrap().kind, PreKind::Qwen2);
        assert!(!PreSplit::from_name("gemma4").unwrap().byte_level());
    }
}
