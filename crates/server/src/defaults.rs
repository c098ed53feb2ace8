//! Sampling defaults: what a request gets for the sampling fields it leaves
//! out.
//!
//! Each of `temperature`, `top_p`, `top_k`, `min_p` and
//! `repetition_penalty` is taken from the first of these that sets it:
//! 1. the request itself (always wins);
//! 2. the server's flags (`--temperature`, `--top-p`, ...), because a value
//!    the operator typed is a deliberate choice about this deployment;
//! 3. the model's own recommendation: `generation_config.json` beside a
//!    Hugging Face checkpoint (the keys vLLM reads), or the
//!    `general.sampling.*` metadata of a GGUF file (llama.cpp's keys);
//! 4. [`BUILT_IN`], chosen so that small models answer and stop.
//!
//! `max_tokens` is deliberately not among them: an absent limit means "until
//! an end token or the end of the context" (see `validate`).

use corridor_engine::sampling::SamplingParams;
use corridor_model::gguf::{GgufFile, GgufValue};
use serde_json::Value as Json;
use std::fmt;
use std::path::Path;

/// Where a default came from, for the start-up log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Flag,
    Model,
    BuiltIn,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Source::Flag => "flag",
            Source::Model => "model",
            Source::BuiltIn => "built-in",
        })
    }
}

/// Sampling values one source prefers; `None` leaves the field to the next
/// source. `top_k` is spelled as requests spell it (-1 or 0 disable it).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SamplingPreferences {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

/// The built-in defaults, used when neither a flag nor the model sets a
/// field. Chosen by experiment on the default model (SmolLM2-135M-Instruct
/// Q4_1) with the README's request ("What is the capital of France?", no
/// temperature, no max_tokens), 20 seeds per setting, counting replies that
/// end by themselves within 64 tokens and name Paris:
/// - OpenAI's temperature 1 with no cut-off wanders off within a few tokens
///   and rarely samples the end token again (thousands of tokens of noise);
/// - the model's first token is close to a tie between "The" (then "The
///   capital of France is Paris.") and "L'" (a French-flavoured ramble), so
///   no temperature low enough to keep sampling makes the ramble go away:
///   0.2 with `top_p` 0.9 still had 6 of 20 replies miss Paris or run on,
///   caught in loops such as "la femme, la femme, ...";
/// - a repetition penalty of 1.1 breaks those loops and steers the ramble
///   back to the answer: with it, 0.2 / 0.9 gave 20 of 20 (the longest
///   reply 38 tokens), while 0.3 with top-k 40 and min-p 0.1 gave 17 and
///   0.3 with a penalty of 1.15 gave 18;
/// - the first token's tie is close (about 15% against 14%), and which of
///   the two leads flips with the rounding of the step that computes it:
///   measured again with the end-of-turn token exempt from the penalty
///   (`SamplerState::new`), a request alone (8-bit activations) gets 19 of
///   20 replies ending within 64 tokens and 13 naming Paris, 20 at once get
///   20 and 20; without the exemption, 17 of 20 alone ended that soon;
/// - `min_p` 0.05 (relative to the top token, so confident steps are
///   untouched) cuts the long tail a small model's flat distribution keeps
///   when a request raises the temperature; top-k is left off, as the two
///   cut-offs above already bound the candidates.
pub const BUILT_IN: SamplingDefaults =
    SamplingDefaults { temperature: 0.2, top_p: 0.9, top_k: None, min_p: 0.05, repetition_penalty: 1.1 };

/// The value of each field a request that leaves it out gets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: f32,
    pub top_p: f32,
    /// `None`: no top-k filter.
    pub top_k: Option<u32>,
    pub min_p: f32,
    pub repetition_penalty: f32,
}

impl Default for SamplingDefaults {
    fn default() -> Self {
        BUILT_IN
    }
}

/// A sampling value that cannot be a default.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("the default {param} is invalid: {message}")]
pub struct DefaultsError {
    pub param: &'static str,
    pub message: String,
}

/// The resolved defaults and where each came from, in field order:
/// temperature, top_p, top_k, min_p, repetition_penalty.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ResolvedDefaults {
    pub values: SamplingDefaults,
    pub sources: [Source; 5],
}

impl fmt::Display for ResolvedDefaults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = &self.values;
        let top_k = v.top_k.map_or("off".to_string(), |k| k.to_string());
        let s = &self.sources;
        write!(
            f,
            "temperature {} ({}), top_p {} ({}), top_k {} ({}), min_p {} ({}), repetition_penalty {} ({})",
            v.temperature, s[0], v.top_p, s[1], top_k, s[2], v.min_p, s[3], v.repetition_penalty, s[4]
        )
    }
}

impl SamplingPreferences {
    /// The sampling keys of a `generation_config.json` body. Keys that are
    /// absent, not numbers, or out of range are left to the next source (a
    /// checkpoint's odd file must not stop the server); the others, such as
    /// `do_sample` or `max_new_tokens`, are not defaults here.
    pub fn from_generation_config(config: &Json) -> SamplingPreferences {
        let num = |key: &str| config.get(key).and_then(Json::as_f64);
        let prefs = SamplingPreferences {
            temperature: num("temperature").map(|v| v as f32),
            top_p: num("top_p").map(|v| v as f32),
            top_k: config.get("top_k").and_then(Json::as_i64),
            min_p: num("min_p").map(|v| v as f32),
            repetition_penalty: num("repetition_penalty").map(|v| v as f32),
        };
        prefs.keep_valid()
    }

    /// `generation_config.json` in a checkpoint directory; none when the
    /// file is missing or is not JSON.
    pub fn from_hf_dir(dir: &Path) -> SamplingPreferences {
        let path = dir.join("generation_config.json");
        let Ok(text) = std::fs::read_to_string(&path) else {
            return SamplingPreferences::default();
        };
        match serde_json::from_str::<Json>(&text) {
            Ok(json) => SamplingPreferences::from_generation_config(&json),
            Err(e) => {
                tracing::warn!("{}: not JSON ({e}); its sampling values are ignored", path.display());
                SamplingPreferences::default()
            }
        }
    }

    /// The `general.sampling.*` keys llama.cpp's converters write into a
    /// GGUF file (`temp`, `top_p`, `top_k`, `min_p`, `penalty_repeat`).
    pub fn from_gguf(gguf: &GgufFile) -> SamplingPreferences {
        let num = |key: &str| gguf.get(&format!("general.sampling.{key}")).and_then(GgufValue::as_f64);
        let top_k = gguf.get("general.sampling.top_k").and_then(|v| match v.as_f64() {
            Some(k) if k.fract() == 0.0 => Some(k as i64),
            _ => None,
        });
        let prefs = SamplingPreferences {
            temperature: num("temp").map(|v| v as f32),
            top_p: num("top_p").map(|v| v as f32),
            top_k,
            min_p: num("min_p").map(|v| v as f32),
            repetition_penalty: num("penalty_repeat").map(|v| v as f32),
        };
        prefs.keep_valid()
    }

    /// Checks every value that is set, naming the first bad one by its flag.
    pub fn validate(&self) -> Result<(), DefaultsError> {
        let err = |param: &'static str, message: String| Err(DefaultsError { param, message });
        if let Some(t) = self.temperature {
            if !(t.is_finite() && (0.0..=2.0).contains(&t)) {
                return err("temperature", format!("{t} is outside [0, 2]"));
            }
        }
        if let Some(p) = self.top_p {
            if !(p.is_finite() && p > 0.0 && p <= 1.0) {
                return err("top_p", format!("{p} is outside (0, 1]"));
            }
        }
        if let Some(k) = self.top_k {
            SamplingParams::top_k_from_request(k)
                .map_err(|e| DefaultsError { param: "top_k", message: e.message })?;
        }
        if let Some(m) = self.min_p {
            if !(m.is_finite() && (0.0..=1.0).contains(&m)) {
                return err("min_p", format!("{m} is outside [0, 1]"));
            }
        }
        if let Some(r) = self.repetition_penalty {
            if !(r.is_finite() && r > 0.0) {
                return err("repetition_penalty", format!("{r} must be greater than 0"));
            }
        }
        Ok(())
    }

    /// Drops each value [`SamplingPreferences::validate`] would refuse.
    fn keep_valid(mut self) -> SamplingPreferences {
        loop {
            let Err(e) = self.validate() else { return self };
            tracing::warn!("the model's recommended {}: {}; ignored", e.param, e.message);
            match e.param {
                "temperature" => self.temperature = None,
                "top_p" => self.top_p = None,
                "top_k" => self.top_k = None,
                "min_p" => self.min_p = None,
                _ => self.repetition_penalty = None,
            }
        }
    }
}

/// Resolves each field: a flag, else the model's value, else [`BUILT_IN`].
/// Both inputs must have passed [`SamplingPreferences::validate`] (the
/// model's always have).
pub fn resolve(flags: &SamplingPreferences, model: &SamplingPreferences) -> ResolvedDefaults {
    fn pick<T: Copy>(flag: Option<T>, model: Option<T>, built_in: T) -> (T, Source) {
        match (flag, model) {
            (Some(v), _) => (v, Source::Flag),
            (None, Some(v)) => (v, Source::Model),
            (None, None) => (built_in, Source::BuiltIn),
        }
    }
    let b = BUILT_IN;
    let (temperature, s0) = pick(flags.temperature, model.temperature, b.temperature);
    let (top_p, s1) = pick(flags.top_p, model.top_p, b.top_p);
    // Validated already, so the conversion cannot fail; a failure would
    // fall back to "off" rather than panic.
    let to_k = |k: i64| SamplingParams::top_k_from_request(k).unwrap_or(None);
    let (top_k, s2) = pick(flags.top_k.map(to_k), model.top_k.map(to_k), b.top_k);
    let (min_p, s3) = pick(flags.min_p, model.min_p, b.min_p);
    let (repetition_penalty, s4) =
        pick(flags.repetition_penalty, model.repetition_penalty, b.repetition_penalty);
    ResolvedDefaults {
        values: SamplingDefaults { temperature, top_p, top_k, min_p, repetition_penalty },
        sources: [s0, s1, s2, s3, s4],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn generation_config_sampling_keys_are_read() {
        let p = SamplingPreferences::from_generation_config(&json!({
            "bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": true,
            "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05
        }));
        assert_eq!(
            p,
            SamplingPreferences {
                temperature: Some(0.6),
                top_p: Some(0.95),
                top_k: Some(20),
                min_p: Some(0.05),
                repetition_penalty: Some(1.05),
            }
        );
        // Only eos/bos ids: nothing preferred.
        let none = SamplingPreferences::from_generation_config(&json!({"eos_token_id": 2}));
        assert_eq!(none, SamplingPreferences::default());
    }

    /// A GGUF file of metadata only: `(key, type id, little-endian value)`.
    fn gguf_with(kvs: &[(&str, u32, Vec<u8>)]) -> tempfile::NamedTempFile {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(0u64.to_le_bytes());
        out.extend((kvs.len() as u64).to_le_bytes());
        for (key, kind, value) in kvs {
            out.extend((key.len() as u64).to_le_bytes());
            out.extend(key.as_bytes());
            out.extend(kind.to_le_bytes());
            out.extend(value);
        }
        out.resize(out.len().div_ceil(32) * 32, 0);
        let file = tempfile::NamedTempFile::new().expect("temp file");
        std::fs::write(file.path(), out).expect("write");
        file
    }

    #[test]
    fn gguf_sampling_metadata_is_read() {
        const F32: u32 = 6;
        const I32: u32 = 5;
        let file = gguf_with(&[
            ("general.architecture", 8, [5u64.to_le_bytes().to_vec(), b"llama".to_vec()].concat()),
            ("general.sampling.temp", F32, 0.7f32.to_le_bytes().to_vec()),
            ("general.sampling.top_k", I32, 20i32.to_le_bytes().to_vec()),
            ("general.sampling.penalty_repeat", F32, 1.05f32.to_le_bytes().to_vec()),
        ]);
        let gguf = GgufFile::open(file.path()).expect("a metadata-only GGUF opens");
        let p = SamplingPreferences::from_gguf(&gguf);
        assert_eq!(
            p,
            SamplingPreferences {
                temperature: Some(0.7),
                top_k: Some(20),
                repetition_penalty: Some(1.05),
                ..Default::default()
            }
        );
    }

    #[test]
    fn a_bad_model_value_is_dropped_not_fatal() {
        let p = SamplingPreferences::from_generation_config(&json!({
            "temperature": 7.0, "top_p": "high", "top_k": -5, "repetition_penalty": 1.2
        }));
        assert_eq!(p, SamplingPreferences { repetition_penalty: Some(1.2), ..Default::default() });
    }

    #[test]
    fn model_values_fill_what_flags_leave() {
        let model = SamplingPreferences { temperature: Some(0.7), top_k: Some(20), ..Default::default() };
        let r = resolve(&SamplingPreferences::default(), &model);
        assert_eq!(r.values.temperature, 0.7);
        assert_eq!(r.values.top_k, Some(20));
        assert_eq!(r.values.top_p, BUILT_IN.top_p);
        assert_eq!(r.sources[0], Source::Model);
        assert_eq!(r.sources[1], Source::BuiltIn);
    }

    #[test]
    fn flags_override_the_model_and_the_built_in_defaults() {
        let flags = SamplingPreferences {
            temperature: Some(0.0),
            top_k: Some(-1),
            min_p: Some(0.0),
            ..Default::default()
        };
        let model = SamplingPreferences { temperature: Some(0.7), ..Default::default() };
        let r = resolve(&flags, &model);
        assert_eq!(r.values.temperature, 0.0);
        // -1 spells "off", as in a request.
        assert_eq!(r.values.top_k, None);
        assert_eq!(r.values.min_p, 0.0);
        assert_eq!(r.values.repetition_penalty, BUILT_IN.repetition_penalty);
        assert_eq!(r.sources, [Source::Flag, Source::BuiltIn, Source::Flag, Source::Flag, Source::BuiltIn]);
        assert!(r.to_string().contains("temperature 0 (flag)"), "{r}");
    }

    #[test]
    fn bad_flags_are_named() {
        let bad = SamplingPreferences { top_p: Some(0.0), ..Default::default() };
        assert_eq!(bad.validate().unwrap_err().param, "top_p");
        let bad = SamplingPreferences { top_k: Some(-2), ..Default::default() };
        assert_eq!(bad.validate().unwrap_err().param, "top_k");
        let bad = SamplingPreferences { repetition_penalty: Some(0.0), ..Default::default() };
        assert_eq!(bad.validate().unwrap_err().param, "repetition_penalty");
        assert!(BUILT_IN_AS_PREFS.validate().is_ok());
    }

    const BUILT_IN_AS_PREFS: SamplingPreferences = SamplingPreferences {
        temperature: Some(BUILT_IN.temperature),
        top_p: Some(BUILT_IN.top_p),
        top_k: None,
        min_p: Some(BUILT_IN.min_p),
        repetition_penalty: Some(BUILT_IN.repetition_penalty),
    };
}
