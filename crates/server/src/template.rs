//! Chat templates, rendered the way transformers renders them.
//!
//! A checkpoint's chat template is Jinja source written for Python's jinja2
//! inside transformers' `apply_chat_template`. We render it with minijinja
//! configured to match that environment:
//! - `trim_blocks` and `lstrip_blocks` on, a single trailing newline of the
//!   source dropped (jinja2's default);
//! - Python string and dict methods (`.strip()`, `.split()`, `.items()`, ...)
//!   through minijinja-contrib's pycompat callback;
//! - transformers' globals: `raise_exception(message)` and
//!   `strftime_now(format)`, and its `tojson` filter, which is Python's
//!   `json.dumps` (no HTML escaping, key order kept, `indent` honoured);
//! - values printed with `{{ }}` as Python prints them (`True`, `None`,
//!   `['a', 1]`); a value joined with `~` or `|string` still uses minijinja's
//!   spelling (`true`), a known gap no template we test depends on;
//! - transformers' `{% generation %}` block tag, which only marks text for
//!   training masks, rendered as a plain block;
//! - the variables transformers passes: `messages` (keys whose value is null
//!   dropped, reasoning fields aliased), `tools` (none unless given),
//!   `documents` (none), `add_generation_prompt`, `bos_token`, `eos_token`,
//!   and any extra `chat_template_kwargs` (e.g. `enable_thinking`).
//!
//! `strftime_now` uses UTC (transformers uses the server's local time) and
//! can be given a fixed clock, so that rendered dates are reproducible.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Serde, Value, ValueKind};
use minijinja::{escape_formatter, Environment, Error, ErrorKind, Output, State};
use serde_json::{Map, Value as Json};

/// Name under which the single template is stored in its environment.
const TEMPLATE_NAME: &str = "chat_template";

/// Variables the renderer sets itself; a kwarg may not replace them.
const RESERVED_VARIABLES: &[&str] = &["messages", "tools", "documents", "add_generation_prompt"];

/// Names under which a message's reasoning may arrive; transformers copies
/// the first one present to both `thinking` and `reasoning_content`.
const REASONING_FIELDS: &[&str] = &["reasoning_content", "thinking", "reasoning"];

/// The template used when a checkpoint has none: ChatML, which also accepts
/// content given as a list of parts (their text parts are joined).
pub const CHATML_TEMPLATE: &str = "{%- for message in messages %}\
{{- '<|im_start|>' + message['role'] + '\\n' }}\
{%- if message['content'] is string %}{{- message['content'] }}\
{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}\
{%- endif %}\
{{- '<|im_end|>\\n' }}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// Everything that can go wrong compiling or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The template source does not compile.
    #[error("chat template does not compile (line {}): {message}", fmt_line(*line))]
    Syntax { line: Option<usize>, message: String },
    /// The template itself refused the conversation through
    /// `raise_exception` (for example "roles must alternate"); this is the
    /// caller's input being rejected, not a server fault.
    #[error("chat template rejected the conversation (line {}): {message}", fmt_line(*line))]
    Raised { line: Option<usize>, message: String },
    /// Rendering failed for another reason.
    #[error("chat template failed to render (line {}): {message}", fmt_line(*line))]
    Render { line: Option<usize>, message: String },
    /// `messages` is not a list of objects.
    #[error("messages must be a list of objects: {reason}")]
    InvalidMessages { reason: String },
    /// A chat_template_kwargs entry tried to replace a variable the renderer sets.
    #[error("chat_template_kwargs may not set `{name}`")]
    ReservedKwarg { name: String },
}

fn fmt_line(line: Option<usize>) -> String {
    line.map_or_else(|| "?".to_string(), |l| l.to_string())
}

/// The error `raise_exception` raises, recognized again on the way out.
#[derive(Debug)]
struct RaisedByTemplate(String);

impl std::fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

/// Per-render inputs beyond the messages.
#[derive(Clone, Debug, Default)]
pub struct RenderOptions {
    /// End the prompt with the header of an assistant turn.
    pub add_generation_prompt: bool,
    /// Tool definitions (OpenAI `tools`, a JSON list); `None` renders as `none`.
    pub tools: Option<Json>,
    /// Extra variables (`chat_template_kwargs`), e.g. `enable_thinking`. They
    /// may override `bos_token`/`eos_token`, as in transformers.
    pub kwargs: Map<String, Json>,
    /// The instant `strftime_now` formats; `None` reads the system clock.
    pub now: Option<SystemTime>,
}

/// A compiled chat template with the special tokens it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_bytes", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `source`; `bos`/`eos` are the texts the template sees as
    /// `bos_token`/`eos_token` (left undefined when `None`).
    pub fn new(source: &str, bos: Option<&str>, eos: Option<&str>) -> Result<ChatTemplate, TemplateError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TemplateError::Syntax { line: None, message: e.to_string() })?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        // A default clock for templates that call strftime_now where the
        // per-render one is shadowed (inside macros, which see globals only).
        env.add_function("strftime_now", |format: &str| strftime(format, unix_seconds(SystemTime::now())));
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(source))
            .map_err(|e| TemplateError::Syntax { line: e.line(), message: e.to_string() })?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos_token: bos.map(str::to_string),
            eos_token: eos.map(str::to_string),
        })
    }

    /// The checkpoint's template, or ChatML when it has none (logged, since
    /// a model not trained on ChatML will answer poorly).
    pub fn for_checkpoint(
        source: Option<&str>,
        bos: Option<&str>,
        eos: Option<&str>,
    ) -> Result<ChatTemplate, TemplateError> {
        match source {
            Some(source) => ChatTemplate::new(source, bos, eos),
            None => {
                tracing::warn!("checkpoint has no chat template; falling back to ChatML");
                ChatTemplate::new(CHATML_TEMPLATE, bos, eos)
            }
        }
    }

    /// The template source as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation. `messages` is a JSON list of message objects
    /// (`role`, `content` as a string or a list of parts, and any other keys
    /// such as `tool_calls` or `reasoning_content`).
    pub fn render(&self, messages: &Json, opts: &RenderOptions) -> Result<String, TemplateError> {
        let messages = normalize_messages(messages)?;
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token".into(), Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token".into(), Value::from(eos.as_str()));
        }
        for (name, value) in &opts.kwargs {
            if RESERVED_VARIABLES.contains(&name.as_str()) {
                return Err(TemplateError::ReservedKwarg { name: name.clone() });
            }
            ctx.insert(name.clone(), Value::from(Serde(value)));
        }
        ctx.insert("messages".into(), Value::from(Serde(&messages)));
        ctx.insert("tools".into(), opts.tools.as_ref().map_or(Value::from(()), |t| Value::from(Serde(t))));
        ctx.insert("documents".into(), Value::from(()));
        ctx.insert("add_generation_prompt".into(), Value::from(opts.add_generation_prompt));
        if let Some(now) = opts.now {
            let seconds = unix_seconds(now);
            ctx.insert(
                "strftime_now".into(),
                Value::from_function(move |format: &str| strftime(format, seconds)),
            );
        }

        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TemplateError::Render { line: e.line(), message: e.to_string() })?;
        template.render(Value::from(ctx)).map_err(classify_render_error)
    }
}

/// Prints `{{ value }}` as jinja2 does, which is Python's `str(value)`:
/// `True`/`False`, `None`, floats as `repr`, and containers with Python's
/// quoting. Strings and undefined values keep minijinja's own handling.
fn python_formatter(out: &mut Output, state: &mut State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Number | ValueKind::Seq | ValueKind::Map => {
            let mut text = String::new();
            python_repr(&mut text, value);
            out.write_str(&text)
                .map_err(|_| Error::new(ErrorKind::WriteFailure, "cannot write template output"))
        }
        _ => escape_formatter(out, state, value),
    }
}

/// Python's `repr` of a template value (which is also `str` for everything
/// but a top-level string).
fn python_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::None | ValueKind::Undefined => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number if !value.is_integer() => match f64::try_from(value.clone()) {
            Ok(f) => out.push_str(&python_float_repr(f)),
            Err(_) => out.push_str(&value.to_string()),
        },
        ValueKind::String => python_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            out.push('[');
            if let Ok(items) = value.try_iter() {
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    python_repr(out, &item);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = value.try_iter() {
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    python_repr(out, &key);
                    out.push_str(": ");
                    python_repr(out, &value.get_item(&key).unwrap_or_default());
                }
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
}

/// Python's `repr(str)`: single quotes unless the text has a single quote
/// and no double quote; backslash, the quote and control characters escaped.
fn python_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Tells a template's own `raise_exception` apart from other failures.
fn classify_render_error(err: Error) -> TemplateError {
    let line = err.line();
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<RaisedByTemplate>() {
            return TemplateError::Raised { line, message: raised.0.clone() };
        }
        source = e.source();
    }
    TemplateError::Render { line, message: err.to_string() }
}

/// transformers' `raise_exception(message)`.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(RaisedByTemplate(message)))
}

/// Applies transformers' message normalization: keys whose value is null are
/// dropped (templates test for presence, not for null), and a reasoning
/// field is exposed under both `thinking` and `reasoning_content`.
fn normalize_messages(messages: &Json) -> Result<Vec<Json>, TemplateError> {
    let list = messages.as_array().ok_or_else(|| TemplateError::InvalidMessages {
        reason: format!("expected a list, found {}", json_kind(messages)),
    })?;
    list.iter()
        .enumerate()
        .map(|(index, message)| {
            let obj = message.as_object().ok_or_else(|| TemplateError::InvalidMessages {
                reason: format!("message {index} is {}", json_kind(message)),
            })?;
            let mut out: Map<String, Json> =
                obj.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), v.clone())).collect();
            let reasoning = REASONING_FIELDS.iter().find_map(|field| out.get(*field).cloned());
            if let Some(reasoning) = reasoning {
                // Python's {"thinking": r, **message, "reasoning_content": r}:
                // `thinking` comes first unless the message already has it.
                let mut aliased = Map::new();
                aliased.insert("thinking".to_string(), reasoning.clone());
                for (k, v) in out {
                    aliased.insert(k, v);
                }
                aliased.insert("reasoning_content".to_string(), reasoning);
                out = aliased;
            }
            Ok(Json::Object(out))
        })
        .collect()
}

fn json_kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "a list",
        Json::Object(_) => "an object",
    }
}

/// Replaces transformers' `{% generation %}`/`{% endgeneration %}` with
/// `{% if true %}`/`{% endif %}`, keeping any whitespace-control markers so
/// the surrounding whitespace is trimmed exactly as before.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let Some(len) = rest[start..].find("%}") else {
            break;
        };
        let tag = &rest[start..start + len + 2];
        let inner = &tag[2..tag.len() - 2];
        let open_marker = inner.strip_prefix(['-', '+']).map_or("", |_| &inner[..1]);
        let body = &inner[open_marker.len()..];
        let close_marker = if body.ends_with(['-', '+']) { &body[body.len() - 1..] } else { "" };
        let keyword = body[..body.len() - close_marker.len()].trim();
        out.push_str(&rest[..start]);
        match keyword {
            "generation" => out.push_str(&format!("{{%{open_marker} if true {close_marker}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{open_marker} endif {close_marker}%}}")),
            _ => out.push_str(tag),
        }
        rest = &rest[start + len + 2..];
    }
    out.push_str(rest);
    out
}

/// transformers' `tojson`: Python's `json.dumps(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)`, with those arguments
/// accepted as keywords and `indent` also positionally.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                let n = i64::try_from(v.clone()).map_err(|_| {
                    Error::new(ErrorKind::InvalidOperation, "tojson: indent must be an integer or a string")
                })?;
                Some(" ".repeat(n.max(0) as usize))
            }
        },
    };
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let separators = kwargs.get::<Option<Vec<String>>>("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators {
        Some(pair) if pair.len() == 2 => (pair[0].clone(), pair[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair of strings",
            ))
        }
        // Python drops the space after commas when indenting.
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let json = serde_json::to_value(value).map_err(|e| {
        Error::new(ErrorKind::InvalidOperation, "tojson: value cannot be serialized").with_source(e)
    })?;
    let style = PyJsonStyle { indent, item_sep, key_sep, ensure_ascii, sort_keys };
    let mut out = String::new();
    write_py_json(&mut out, &json, &style, 0);
    Ok(Value::from_safe_string(out))
}

/// How Python's `json.dumps` was asked to lay out its output.
struct PyJsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

/// Public so the renderer's JSON can be checked against Python's directly.
pub fn python_json_dumps(value: &Json, indent: Option<usize>) -> String {
    let style = PyJsonStyle {
        indent: indent.map(|n| " ".repeat(n)),
        item_sep: if indent.is_some() { "," } else { ", " }.to_string(),
        key_sep: ": ".to_string(),
        ensure_ascii: false,
        sort_keys: false,
    };
    let mut out = String::new();
    write_py_json(&mut out, value, &style, 0);
    out
}

fn write_py_json(out: &mut String, value: &Json, style: &PyJsonStyle, depth: usize) {
    match value {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => out.push_str(&i.to_string()),
            (_, Some(u), _) => out.push_str(&u.to_string()),
            (_, _, Some(f)) => out.push_str(&python_float_repr(f)),
            _ => out.push_str(&n.to_string()),
        },
        Json::String(s) => write_py_string(out, s, style.ensure_ascii),
        Json::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline_indent(out, style, depth + 1);
                write_py_json(out, item, style, depth + 1);
            }
            newline_indent(out, style, depth);
            out.push(']');
        }
        Json::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &Json)> = map.iter().collect();
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline_indent(out, style, depth + 1);
                write_py_string(out, key, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_py_json(out, item, style, depth + 1);
            }
            newline_indent(out, style, depth);
            out.push('}');
        }
    }
}

fn newline_indent(out: &mut String, style: &PyJsonStyle, depth: usize) {
    if let Some(unit) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(unit);
        }
    }
}

/// A JSON string literal escaped as Python's encoder escapes it.
fn write_py_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest round-tripping digits, in plain
/// notation for decimal exponents from -4 to 15 and scientific otherwise
/// (`1e+16`, `1.5e-07`), always with a `.0` when integral.
fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_string();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    let sci = format!("{f:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if f == 0.0 || (-4..16).contains(&exponent) {
        let plain = format!("{f}");
        if plain.contains('.') {
            plain
        } else {
            format!("{plain}.0")
        }
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.abs())
    }
}

/// Whole seconds since the Unix epoch (negative before it).
fn unix_seconds(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(i64::MAX),
    }
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];

/// A UTC calendar date and time broken into fields.
struct CivilTime {
    year: i64,
    month: u32,
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// 0 = Sunday.
    weekday: u32,
    /// 1-based day of the year.
    yearday: u32,
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

impl CivilTime {
    /// Converts Unix seconds to a proleptic Gregorian UTC date by counting
    /// 400-year eras (146 097 days each) from 0000-03-01, so that the leap
    /// day falls at the end of a counted year.
    fn from_unix(seconds: i64) -> CivilTime {
        let days = seconds.div_euclid(86_400);
        let secs_of_day = seconds.rem_euclid(86_400) as u32;
        let z = days + 719_468; // days from 0000-03-01 to 1970-01-01
        let era = z.div_euclid(146_097);
        let day_of_era = z.rem_euclid(146_097);
        let year_of_era =
            (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
        let day_of_year_from_march = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
        let month_from_march = (5 * day_of_year_from_march + 2) / 153;
        let day = (day_of_year_from_march - (153 * month_from_march + 2) / 5 + 1) as u32;
        let month = if month_from_march < 10 { month_from_march + 3 } else { month_from_march - 9 } as u32;
        let year = year_of_era + era * 400 + i64::from(month <= 2);
        let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
        let leap_extra = u32::from(month > 2 && is_leap(year));
        CivilTime {
            year,
            month,
            day,
            hour: secs_of_day / 3_600,
            minute: secs_of_day / 60 % 60,
            second: secs_of_day % 60,
            // 1970-01-01 was a Thursday.
            weekday: (days + 4).rem_euclid(7) as u32,
            yearday: cumulative[month as usize - 1] + day + leap_extra,
        }
    }
}

/// The subset of C `strftime` that chat templates use, in UTC. Unknown
/// directives are copied through, as glibc does.
fn strftime(format: &str, unix: i64) -> String {
    let t = CivilTime::from_unix(unix);
    let month = MONTHS[t.month as usize - 1];
    let weekday = WEEKDAYS[t.weekday as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&t.year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", t.year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{:02}", t.month)),
            Some('d') => out.push_str(&format!("{:02}", t.day)),
            Some('e') => out.push_str(&format!("{:2}", t.day)),
            Some('H') => out.push_str(&format!("{:02}", t.hour)),
            Some('I') => out.push_str(&format!("{:02}", (t.hour + 11) % 12 + 1)),
            Some('p') => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{:02}", t.minute)),
            Some('S') => out.push_str(&format!("{:02}", t.second)),
            Some('j') => out.push_str(&format!("{:03}", t.yearday)),
            Some('B') => out.push_str(month),
            Some('b') | Some('h') => out.push_str(&month[..3]),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('F') => out.push_str(&format!("{}-{:02}-{:02}", t.year, t.month, t.day)),
            Some('T') => out.push_str(&format!("{:02}:{:02}:{:02}", t.hour, t.minute, t.second)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates_match_known_instants() {
        // 2024-07-26 12:34:56 UTC, a Friday, day 208 of a leap year.
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S %a %j", 1_721_997_296), "2024-07-26 12:34:56 Fri 208");
        assert_eq!(strftime("%d %b %Y", 0), "01 Jan 1970");
        assert_eq!(strftime("%d %B %Y %A", 951_782_400), "29 February 2000 Tuesday");
        assert_eq!(strftime("%d %b %Y", -86_400), "31 Dec 1969");
        assert_eq!(strftime("100%% %Q", 0), "100% %Q");
    }

    #[test]
    fn floats_print_like_python_repr() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (123456789012345.0, "123456789012345.0"),
            (0.0, "0.0"),
        ] {
            assert_eq!(python_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn generation_tags_become_plain_blocks() {
        assert_eq!(
            rewrite_generation_tags("a{%- generation %}b{% endgeneration -%}c{% if x %}"),
            "a{%- if true %}b{% endif -%}c{% if x %}"
        );
    }
}
