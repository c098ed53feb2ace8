//! The edge: a raw request body in, a typed request the engine can run out,
//! or a 400 that names the parameter at fault.
//!
//! Every limit the server enforces on a request lives in [`Limits`], and
//! every check happens here, once, before anything is queued: after this
//! point a request cannot fail for anything the client sent. The rules:
//! - `model` must be the served name (or absent, meaning it).
//! - `max_tokens` / `max_completion_tokens` must be positive when given;
//!   absent means "until an end token or the end of the context", never a
//!   small default (also for `/v1/completions`, where OpenAI's legacy default
//!   is 16). When both are given, `max_completion_tokens` wins.
//! - The prompt plus the requested output must fit the context and the KV
//!   pool; otherwise 400 with code `context_length_exceeded`. Without a
//!   limit the prompt must leave room for at least one token.
//! - `stop`: a string or at most [`Limits::max_stop_sequences`] strings;
//!   empty strings are ignored.
//! - Chat messages are objects with a string `role`; `content` is a string,
//!   a list of text parts (joined with newlines before the template sees
//!   them), or null for an assistant turn. Image, audio, video and file
//!   parts are refused: the models served are text-only.
//! - A message's role is one of system, developer (rendered as system),
//!   user, assistant and tool; an assistant's `tool_calls` and a tool
//!   message's `tool_call_id` are checked for shape.
//! - `tools`, `tool_choice` and `response_format` are checked by
//!   [`crate::tools`], naming the nested field (`tools[0].function.name`,
//!   `response_format.json_schema.schema`); a schema that is to constrain
//!   the output is compiled here, so one the grammar compiler refuses is a
//!   400 too.
//! - Sampling ranges are the sampler's own ([`SamplingParams::validate`]);
//!   the fields a request leaves out take the server's [`SamplingDefaults`].

use corridor_engine::sampling::{SamplingParams, MAX_TOP_LOGPROBS};
use corridor_units::{TokenId, Tokens};
use serde_json::{Map, Value as Json};
use std::collections::BTreeMap;

use corridor_engine::sampling::Constraint;

use crate::api::{self, ChatRequest, CompletionRequest, PromptField, SamplingFields, StopField};
use crate::defaults::SamplingDefaults;
use crate::error::ApiError;
use crate::grammar::LazyGrammar;
use crate::template::{ChatTemplate, RenderOptions, TemplateError};
use crate::tokenizer::Tokenizer;
use crate::tools::reasoning::{self, ReasoningSplitter};
use crate::tools::shaper::ShapeMode;
use crate::tools::{self as tool_rules, ToolChoice, ToolFormat};

/// Limits on what one request may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most stop strings per request (OpenAI allows 4).
    pub max_stop_sequences: usize,
    /// Most choices per prompt (`n`).
    pub max_n: usize,
    /// Most prompts in one completion request (a list prompt).
    pub max_prompts: usize,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_stop_sequences: 4, max_n: 16, max_prompts: 32, max_body_bytes: 8 * 1024 * 1024 }
    }
}

/// What the edge needs to know about the served model.
#[derive(Debug, Clone)]
pub struct ModelFacts {
    /// The name clients must send as `model`.
    pub served_name: String,
    /// Longest sequence (prompt + output).
    pub context_len: Tokens,
    /// Tokens the whole KV pool holds: a sequence longer than this can never
    /// run, even alone.
    pub pool_tokens: Tokens,
    /// Width of the model's logits (valid token ids are below it).
    pub vocab_size: usize,
}

/// Everything validation reads.
#[derive(Clone, Copy)]
pub struct Edge<'a> {
    pub limits: &'a Limits,
    pub facts: &'a ModelFacts,
    pub tokenizer: &'a Tokenizer,
    pub template: &'a ChatTemplate,
    /// What the sampling fields a request leaves out mean.
    pub defaults: &'a SamplingDefaults,
    /// The schema compiler, built on first use.
    pub grammar: &'a LazyGrammar,
}

/// One prompt, tokenized, with its text for `echo`.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidPrompt {
    pub ids: Vec<u32>,
    pub text: String,
}

/// What chat and completions have in common once validated.
#[derive(Debug, Clone)]
pub struct ValidGeneration {
    /// One entry per prompt (chat always has one).
    pub prompts: Vec<ValidPrompt>,
    /// Validated; `seed` is the seed of choice 0 (choice `i` uses `seed + i`).
    pub params: SamplingParams,
    /// `None`: until an end token or the end of the context.
    pub max_tokens: Option<usize>,
    /// Choices per prompt.
    pub n: usize,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub skip_special_tokens: bool,
    /// The grammar every choice's output is held to (each choice gets its
    /// own state).
    pub constraint: Option<Constraint>,
}

/// A chat request ready to run.
#[derive(Debug, Clone)]
pub struct ValidChat {
    pub gen: ValidGeneration,
    /// How the answer is read: text, or tool calls in which format.
    pub shape: ShapeMode,
    /// Split a leading `<think>` block into `reasoning_content`.
    pub reasoning: ReasoningStart,
}

/// Where an answer's reasoning block starts, if the model writes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningStart {
    /// The template shows no `<think>` block: nothing is split.
    Off,
    /// The answer may open with `<think>`.
    MayOpen,
    /// The prompt opened the block: the answer starts inside it.
    Inside,
}

/// A completion request ready to run.
#[derive(Debug, Clone)]
pub struct ValidCompletion {
    pub gen: ValidGeneration,
    /// Prepend the prompt's text to each choice.
    pub echo: bool,
}

/// Parses a body into JSON; malformed JSON is a 400.
pub fn parse_body(bytes: &[u8]) -> Result<Json, ApiError> {
    let value: Json = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid_body(format!("the body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::invalid_body("the body must be a JSON object"));
    }
    Ok(value)
}

/// `POST /v1/chat/completions`.
pub fn chat(body: &Json, edge: Edge<'_>) -> Result<ValidChat, ApiError> {
    let req: ChatRequest = api::parse(body)?;
    let fields: SamplingFields = api::parse(body)?;
    check_model(req.model.as_deref(), edge.facts)?;

    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (false, Some(_)) => {
            return Err(ApiError::invalid("top_logprobs", "'top_logprobs' requires 'logprobs' to be true"));
        }
        (false, None) => None,
        (true, top) => Some(top_logprobs(top)?),
    };
    let tools = tool_rules::validate_tools(req.tools.as_deref().unwrap_or(&[]))?;
    let tool_choice = tool_rules::validate_tool_choice(req.tool_choice.as_ref(), &tools)?;
    let response_schema = response_format_schema(req.response_format.as_ref())?;
    if response_schema.is_some() && matches!(tool_choice, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(ApiError::invalid(
            "response_format",
            "'response_format' cannot be combined with a 'tool_choice' that forces a call",
        ));
    }
    // `max_completion_tokens` is the current name and wins over the old one.
    let max_tokens = match req.max_completion_tokens {
        Some(v) => Some(positive("max_completion_tokens", v)?),
        None => fields.max_tokens.map(|v| positive("max_tokens", v)).transpose()?,
    };

    let mut messages = normalize_messages(req.messages.as_deref())?;
    tool_rules::prepare_history(&mut messages);
    let opts = RenderOptions {
        add_generation_prompt: req.add_generation_prompt.unwrap_or(true),
        tools: req.tools.filter(|t| !t.is_empty()).map(Json::Array),
        kwargs: req.chat_template_kwargs.unwrap_or_default(),
        now: None,
    };
    let text = edge.template.render(&Json::Array(messages), &opts).map_err(template_error)?;
    // A rendered template carries its own special tokens (BOS included).
    let ids = edge
        .tokenizer
        .encode(&text, false)
        .map_err(|e| ApiError::invalid("messages", format!("the conversation cannot be tokenized: {e}")))?;
    let source = edge.template.source();
    let reasoning = if !source.contains(reasoning::OPEN) {
        ReasoningStart::Off
    } else if ReasoningSplitter::prompt_opens_block(&text) {
        ReasoningStart::Inside
    } else {
        ReasoningStart::MayOpen
    };
    let format = ToolFormat::detect(source);
    let shape = match &tool_choice {
        ToolChoice::None => ShapeMode::Plain,
        ToolChoice::Auto => ShapeMode::Auto(format),
        ToolChoice::Required => ShapeMode::Required(format),
        ToolChoice::Named(name) => ShapeMode::Named { name: name.clone(), format },
    };
    // The markers of Llama's and Mistral's calls are special tokens, which
    // must reach the parser; a client's explicit choice still wins.
    let keep_special = matches!(shape, ShapeMode::Auto(f) if f.needs_special_tokens());
    let (schema, schema_param) =
        match tool_choice.grammar_schema(&tools, req.parallel_tool_calls.unwrap_or(true)) {
            Some(schema) => (Some(schema), "tools"),
            None => (response_schema, "response_format.json_schema.schema"),
        };
    let constraint = match schema {
        None => None,
        Some(schema) => {
            let compiler =
                edge.grammar.get().map_err(|e| ApiError::invalid("response_format", e.to_string()))?;
            Some(compiler.json_schema(&schema).map_err(|e| ApiError::invalid(schema_param, e.to_string()))?)
        }
    };
    let prompt = ValidPrompt { ids, text };
    let mut gen = generation(
        GenerationInput { fields, prompts: vec![prompt], max_tokens, logprobs, prompt_param: "messages" },
        edge,
    )?;
    if keep_special && body.get("skip_special_tokens").is_none_or(Json::is_null) {
        gen.skip_special_tokens = false;
    }
    gen.constraint = constraint;
    Ok(ValidChat { gen, shape, reasoning })
}

/// `POST /v1/completions`.
pub fn completion(body: &Json, edge: Edge<'_>) -> Result<ValidCompletion, ApiError> {
    let req: CompletionRequest = api::parse(body)?;
    let fields: SamplingFields = api::parse(body)?;
    check_model(req.model.as_deref(), edge.facts)?;

    let logprobs = match req.logprobs {
        None => None,
        Some(k) if (0..=i64::from(MAX_TOP_LOGPROBS)).contains(&k) => Some(k as u32),
        Some(k) => {
            return Err(ApiError::invalid(
                "logprobs",
                format!("'logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {k}"),
            ));
        }
    };
    let echo = req.echo.unwrap_or(false);
    if echo && logprobs.is_some() {
        // OpenAI would report the prompt's log-probabilities, which the
        // engine does not compute; refusing beats inventing them.
        return Err(ApiError::invalid("logprobs", "'logprobs' together with 'echo' is not supported"));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "'suffix' is not supported"));
    }
    let n = fields.n.unwrap_or(1);
    if let Some(best_of) = req.best_of {
        if best_of != n {
            return Err(ApiError::invalid("best_of", "'best_of' is only supported when equal to 'n'"));
        }
    }
    let max_tokens = fields.max_tokens.map(|v| positive("max_tokens", v)).transpose()?;
    let prompts = completion_prompts(req.prompt, edge)?;
    let gen =
        generation(GenerationInput { fields, prompts, max_tokens, logprobs, prompt_param: "prompt" }, edge)?;
    Ok(ValidCompletion { gen, echo })
}

/// The inputs of [`generation`], gathered so the call stays readable.
struct GenerationInput {
    fields: SamplingFields,
    prompts: Vec<ValidPrompt>,
    max_tokens: Option<usize>,
    logprobs: Option<u32>,
    /// `messages` or `prompt`: the parameter a context overflow names.
    prompt_param: &'static str,
}

/// The shared part: sampling, `n`, `stop`, streaming, and the context check.
fn generation(input: GenerationInput, edge: Edge<'_>) -> Result<ValidGeneration, ApiError> {
    let GenerationInput { fields, prompts, max_tokens, logprobs, prompt_param } = input;
    let n = match fields.n {
        None => 1,
        Some(n) if n >= 1 && n as u64 <= edge.limits.max_n as u64 => n as usize,
        Some(n) => {
            return Err(ApiError::invalid("n", format!("'n' must be in [1, {}], got {n}", edge.limits.max_n)))
        }
    };
    let stop = stop_strings(fields.stop.clone(), edge.limits)?;
    let stream = fields.stream.unwrap_or(false);
    if fields.stream_options.is_some() && !stream {
        return Err(ApiError::invalid(
            "stream_options",
            "'stream_options' is only allowed when 'stream' is true",
        ));
    }
    let include_usage = fields.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false);
    let params = sampling_params(&fields, logprobs, edge.facts.vocab_size, edge.defaults)?;
    for prompt in &prompts {
        check_fits(prompt.ids.len(), max_tokens, prompt_param, edge.facts)?;
    }
    Ok(ValidGeneration {
        prompts,
        params,
        max_tokens,
        n,
        stop,
        stream,
        include_usage,
        skip_special_tokens: fields.skip_special_tokens.unwrap_or(true),
        constraint: None,
    })
}

fn check_model(model: Option<&str>, facts: &ModelFacts) -> Result<(), ApiError> {
    match model {
        None => Ok(()),
        Some(m) if m == facts.served_name => Ok(()),
        Some(m) => Err(ApiError::ModelNotFound { model: m.to_string(), served: facts.served_name.clone() }),
    }
}

fn positive(param: &'static str, value: i64) -> Result<usize, ApiError> {
    if value >= 1 {
        usize::try_from(value)
            .map_err(|_| ApiError::invalid(param, format!("'{param}' is too large: {value}")))
    } else {
        Err(ApiError::invalid(param, format!("'{param}' must be at least 1, got {value}")))
    }
}

fn top_logprobs(top: Option<i64>) -> Result<u32, ApiError> {
    match top {
        None => Ok(0),
        Some(k) if (0..=i64::from(MAX_TOP_LOGPROBS)).contains(&k) => Ok(k as u32),
        Some(k) => Err(ApiError::invalid(
            "top_logprobs",
            format!("'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {k}"),
        )),
    }
}

/// The schema `response_format` holds the answer to: none for `text`, any
/// JSON object for `json_object`, the given one for `json_schema`.
fn response_format_schema(format: Option<&Json>) -> Result<Option<Json>, ApiError> {
    let param = "response_format";
    let Some(format) = format.filter(|f| !f.is_null()) else { return Ok(None) };
    let obj =
        format.as_object().ok_or_else(|| ApiError::invalid(param, "'response_format' must be an object"))?;
    match obj.get("type").and_then(Json::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(serde_json::json!({"type": "object"}))),
        Some("json_schema") => {
            let at = "response_format.json_schema";
            let js = obj.get("json_schema").and_then(Json::as_object).ok_or_else(|| {
                ApiError::invalid(at, "'json_schema' must be an object with 'name' and 'schema'")
            })?;
            match js.get("name") {
                Some(Json::String(n))
                    if !n.is_empty()
                        && n.len() <= 64
                        && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') => {}
                _ => {
                    return Err(ApiError::invalid(
                        format!("{at}.name"),
                        "'name' must be 1 to 64 characters of a-z, A-Z, 0-9, underscores and dashes",
                    ))
                }
            }
            if let Some(strict) = js.get("strict") {
                if !strict.is_boolean() && !strict.is_null() {
                    return Err(ApiError::invalid(format!("{at}.strict"), "'strict' must be a boolean"));
                }
            }
            let schema = match js.get("schema") {
                None | Some(Json::Null) => serde_json::json!({}),
                Some(schema) => schema.clone(),
            };
            tool_rules::check_schema(&schema).map_err(|m| ApiError::invalid(format!("{at}.schema"), m))?;
            Ok(Some(schema))
        }
        Some(other) => Err(ApiError::invalid(
            format!("{param}.type"),
            format!(
                "response_format type '{other}' is not supported; use 'text', 'json_object' or 'json_schema'"
            ),
        )),
        None => Err(ApiError::invalid(format!("{param}.type"), "'response_format' needs a 'type'")),
    }
}

fn stop_strings(stop: Option<StopField>, limits: &Limits) -> Result<Vec<String>, ApiError> {
    let list = match stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s],
        Some(StopField::Many(v)) => v,
    };
    if list.len() > limits.max_stop_sequences {
        return Err(ApiError::invalid(
            "stop",
            format!("at most {} stop sequences are allowed, got {}", limits.max_stop_sequences, list.len()),
        ));
    }
    Ok(list.into_iter().filter(|s| !s.is_empty()).collect())
}

fn sampling_params(
    f: &SamplingFields,
    logprobs: Option<u32>,
    vocab_size: usize,
    server: &SamplingDefaults,
) -> Result<SamplingParams, ApiError> {
    let defaults = SamplingParams::default();
    let top_k = match f.top_k {
        None => server.top_k,
        Some(k) => {
            SamplingParams::top_k_from_request(k).map_err(|e| ApiError::invalid(e.param, e.message))?
        }
    };
    let mut logit_bias = BTreeMap::new();
    for (key, &bias) in f.logit_bias.iter().flatten() {
        let token: u32 = key.trim().parse().map_err(|_| {
            ApiError::invalid("logit_bias", format!("logit_bias key '{key}' is not a token id"))
        })?;
        logit_bias.insert(TokenId(token), bias);
    }
    let min_tokens = match f.min_tokens {
        None => 0,
        Some(m) if m >= 0 => m as usize,
        Some(m) => {
            return Err(ApiError::invalid("min_tokens", format!("'min_tokens' must be at least 0, got {m}")))
        }
    };
    let params = SamplingParams {
        temperature: f.temperature.unwrap_or(server.temperature),
        top_k,
        top_p: f.top_p.unwrap_or(server.top_p),
        min_p: f.min_p.unwrap_or(server.min_p),
        repetition_penalty: f.repetition_penalty.unwrap_or(server.repetition_penalty),
        presence_penalty: f.presence_penalty.unwrap_or(defaults.presence_penalty),
        frequency_penalty: f.frequency_penalty.unwrap_or(defaults.frequency_penalty),
        logit_bias,
        // OpenAI's seed is a signed integer; its bits are the stream's seed.
        seed: f.seed.map(|s| s as u64),
        min_tokens: Tokens(min_tokens),
        ignore_eos: f.ignore_eos.unwrap_or(false),
        stop_token_ids: f.stop_token_ids.as_deref().map(TokenId::vec).unwrap_or_default(),
        logprobs,
    };
    params.validate(vocab_size).map_err(|e| ApiError::invalid(e.param, e.message))?;
    Ok(params)
}

fn check_fits(
    prompt_len: usize,
    max_tokens: Option<usize>,
    param: &'static str,
    facts: &ModelFacts,
) -> Result<(), ApiError> {
    if prompt_len == 0 {
        return Err(ApiError::invalid(param, format!("'{param}' is empty after tokenization")));
    }
    let context = facts.context_len.get();
    let wanted = prompt_len.saturating_add(max_tokens.unwrap_or(1));
    if wanted > context {
        let message = match max_tokens {
            Some(m) => format!(
                "This model's maximum context length is {context} tokens. However, you requested {wanted} tokens \
                 ({prompt_len} in the {param}, {m} in the completion). Please reduce the length of the {param} or the \
                 completion."
            ),
            None => format!(
                "This model's maximum context length is {context} tokens, and the {param} use {prompt_len}, \
                 leaving no room for a completion. Please reduce the length of the {param}."
            ),
        };
        return Err(ApiError::ContextLengthExceeded { message, param });
    }
    let pool = facts.pool_tokens.get();
    if wanted > pool {
        return Err(ApiError::ContextLengthExceeded {
            message: format!(
                "The request needs {wanted} tokens of KV cache ({prompt_len} in the {param}), but the whole KV pool \
                 of this server holds {pool}. Please reduce the length of the {param} or the completion."
            ),
            param,
        });
    }
    Ok(())
}

/// The roles a chat message may have.
const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// Content part types of other modalities, refused by a text-only model.
const NON_TEXT_PARTS: &[&str] = &[
    "image_url",
    "input_image",
    "image",
    "input_audio",
    "audio",
    "video_url",
    "video",
    "file",
    "input_file",
];

/// Checks the messages' shape and joins text parts, so templates written for
/// string content work with part lists too.
fn normalize_messages(messages: Option<&[Json]>) -> Result<Vec<Json>, ApiError> {
    let messages = messages.ok_or_else(|| ApiError::invalid("messages", "'messages' is required"))?;
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "'messages' must contain at least one message"));
    }
    messages.iter().enumerate().map(|(i, m)| normalize_message(i, m)).collect()
}

fn normalize_message(i: usize, message: &Json) -> Result<Json, ApiError> {
    let param = |suffix: &str| format!("messages[{i}]{suffix}");
    let obj =
        message.as_object().ok_or_else(|| ApiError::invalid(param(""), "each message must be an object"))?;
    let role = match obj.get("role") {
        Some(Json::String(r)) => r.as_str(),
        Some(_) => return Err(ApiError::invalid(param(".role"), "'role' must be a string")),
        None => return Err(ApiError::invalid(param(".role"), "'role' is required")),
    };
    if !ROLES.contains(&role) {
        return Err(ApiError::invalid(
            param(".role"),
            format!("unknown role '{role}'; a message's role is one of {}", ROLES.join(", ")),
        ));
    }
    tool_rules::check_message_tools(i, role, obj)?;
    let mut out: Map<String, Json> = obj.clone();
    if role == "developer" {
        // OpenAI's newer name for the system turn; templates know `system`.
        out.insert("role".into(), Json::String("system".into()));
    }
    let has_calls = obj.get("tool_calls").and_then(Json::as_array).is_some_and(|c| !c.is_empty());
    match obj.get("content") {
        Some(Json::String(_)) => {}
        None | Some(Json::Null) if role == "assistant" => {
            // Templates test `content` as a string; a call-only turn has none.
            if has_calls {
                out.insert("content".into(), Json::String(String::new()));
            }
        }
        None | Some(Json::Null) => {
            return Err(ApiError::invalid(param(".content"), format!("a '{role}' message needs 'content'")));
        }
        Some(Json::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                let at = param(&format!(".content[{j}]"));
                let kind = part.get("type").and_then(Json::as_str).unwrap_or("");
                match kind {
                    "text" | "input_text" => match part.get("text") {
                        Some(Json::String(t)) => texts.push(t.clone()),
                        _ => {
                            return Err(ApiError::invalid(
                                format!("{at}.text"),
                                "a text part needs a string 'text'",
                            ))
                        }
                    },
                    k if NON_TEXT_PARTS.contains(&k) => {
                        return Err(ApiError::invalid(
                            at,
                            format!(
                                "this model accepts text only; content parts of type '{k}' are not supported"
                            ),
                        ));
                    }
                    k => return Err(ApiError::invalid(at, format!("unknown content part type '{k}'"))),
                }
            }
            out.insert("content".into(), Json::String(texts.join("\n")));
        }
        Some(_) => {
            return Err(ApiError::invalid(
                param(".content"),
                "'content' must be a string or a list of content parts",
            ));
        }
    }
    Ok(Json::Object(out))
}

fn template_error(e: TemplateError) -> ApiError {
    match e {
        TemplateError::ReservedKwarg { .. } => ApiError::invalid("chat_template_kwargs", e.to_string()),
        // The template compiled at boot, so a failure here is the
        // conversation's: roles out of order, a field the template needs.
        other => ApiError::invalid("messages", other.to_string()),
    }
}

fn completion_prompts(prompt: Option<PromptField>, edge: Edge<'_>) -> Result<Vec<ValidPrompt>, ApiError> {
    let prompt = prompt.ok_or_else(|| ApiError::invalid("prompt", "'prompt' is required"))?;
    let too_many = |n: usize| n > edge.limits.max_prompts;
    let prompts = match prompt {
        PromptField::Text(t) => vec![encode_prompt(t, edge)?],
        PromptField::Texts(list) => {
            if too_many(list.len()) {
                return Err(too_many_prompts(list.len(), edge.limits));
            }
            list.into_iter().map(|t| encode_prompt(t, edge)).collect::<Result<_, _>>()?
        }
        PromptField::Ids(ids) => vec![id_prompt(ids, edge)?],
        PromptField::IdLists(lists) => {
            if too_many(lists.len()) {
                return Err(too_many_prompts(lists.len(), edge.limits));
            }
            lists.into_iter().map(|ids| id_prompt(ids, edge)).collect::<Result<_, _>>()?
        }
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("prompt", "'prompt' must not be an empty list"));
    }
    Ok(prompts)
}

fn too_many_prompts(n: usize, limits: &Limits) -> ApiError {
    ApiError::invalid(
        "prompt",
        format!("at most {} prompts per request are allowed, got {n}", limits.max_prompts),
    )
}

fn encode_prompt(text: String, edge: Edge<'_>) -> Result<ValidPrompt, ApiError> {
    // A plain prompt gets the BOS the tokenizer is configured to add.
    let ids = edge
        .tokenizer
        .encode(&text, true)
        .map_err(|e| ApiError::invalid("prompt", format!("the prompt cannot be tokenized: {e}")))?;
    Ok(ValidPrompt { ids, text })
}

fn id_prompt(ids: Vec<u32>, edge: Edge<'_>) -> Result<ValidPrompt, ApiError> {
    let vocab = edge.facts.vocab_size.min(edge.tokenizer.vocab_size().max(1));
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(ApiError::invalid(
            "prompt",
            format!("token id {bad} is outside the vocabulary (size {vocab})"),
        ));
    }
    let text = edge
        .tokenizer
        .decode(&ids, false)
        .map_err(|e| ApiError::invalid("prompt", format!("the token ids cannot be decoded: {e}")))?;
    Ok(ValidPrompt { ids, text })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn text_parts_are_joined_and_images_refused() {
        let m = normalize_messages(Some(&[json!({"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})]))
        .expect("text parts");
        assert_eq!(m[0]["content"], "a\nb");
        let err = normalize_messages(Some(&[
            json!({"role": "system", "content": "s"}),
            json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
        ]))
        .unwrap_err();
        assert!(
            matches!(err, ApiError::InvalidRequest { param: Some(p), .. } if p == "messages[1].content[0]")
        );
    }

    #[test]
    fn message_shape_errors_name_the_field() {
        let err = normalize_messages(Some(&[json!({"content": "x"})])).unwrap_err();
        assert!(matches!(err, ApiError::InvalidRequest { param: Some(p), .. } if p == "messages[0].role"));
        let err = normalize_messages(Some(&[json!({"role": "user", "content": 3})])).unwrap_err();
        assert!(matches!(err, ApiError::InvalidRequest { param: Some(p), .. } if p == "messages[0].content"));
        assert!(normalize_messages(Some(&[json!({"role": "assistant", "content": null})])).is_ok());
        assert!(normalize_messages(Some(&[])).is_err());
        assert!(normalize_messages(None).is_err());
    }

    #[test]
    fn unknown_roles_are_refused_and_developer_is_system() {
        let err = normalize_messages(Some(&[
            json!({"role": "user", "content": "a"}),
            json!({"role": "wizard", "content": "b"}),
        ]))
        .unwrap_err();
        assert!(matches!(err, ApiError::InvalidRequest { param: Some(p), .. } if p == "messages[1].role"));
        for role in ["system", "user", "assistant", "tool"] {
            assert!(normalize_messages(Some(&[json!({"role": role, "content": "x"})])).is_ok(), "{role}");
        }
        let m = normalize_messages(Some(&[json!({"role": "developer", "content": "x"})])).expect("developer");
        assert_eq!(m[0]["role"], "system");
        let m = normalize_messages(Some(&[json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})]))
        .expect("call-only turn");
        assert_eq!(m[0]["content"], "");
    }

    #[test]
    fn response_format_errors_name_the_nested_field() {
        let p = |v: Json| match response_format_schema(Some(&v)).unwrap_err() {
            ApiError::InvalidRequest { param: Some(p), .. } => p,
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!(response_format_schema(Some(&json!({"type": "text"}))).expect("text"), None);
        assert_eq!(
            response_format_schema(Some(&json!({"type": "json_object"}))).expect("obj"),
            Some(json!({"type": "object"}))
        );
        assert_eq!(p(json!({"type": "yaml"})), "response_format.type");
        assert_eq!(p(json!({"type": "json_schema"})), "response_format.json_schema");
        assert_eq!(
            p(json!({"type": "json_schema", "json_schema": {"schema": {}}})),
            "response_format.json_schema.name"
        );
        assert_eq!(
            p(json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}})),
            "response_format.json_schema.schema"
        );
        assert_eq!(
            p(json!({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}})),
            "response_format.json_schema.strict"
        );
    }

    fn facts() -> ModelFacts {
        ModelFacts {
            served_name: "m".into(),
            context_len: Tokens(100),
            pool_tokens: Tokens(80),
            vocab_size: 50,
        }
    }

    #[test]
    fn context_check_counts_prompt_and_output() {
        let f = facts();
        assert!(check_fits(10, Some(60), "prompt", &f).is_ok());
        let err = check_fits(50, Some(51), "messages", &f).unwrap_err();
        assert!(matches!(err, ApiError::ContextLengthExceeded { param: "messages", .. }));
        // Without a limit the prompt must leave room for one token.
        assert!(
            check_fits(99, None, "prompt", &ModelFacts { pool_tokens: Tokens(1000), ..f.clone() }).is_ok()
        );
        assert!(check_fits(100, None, "prompt", &f).is_err());
        // Fits the context but not the pool.
        assert!(matches!(
            check_fits(10, Some(80), "prompt", &f),
            Err(ApiError::ContextLengthExceeded { .. })
        ));
        assert!(check_fits(0, Some(1), "prompt", &f).is_err());
    }

    #[test]
    fn sampling_errors_keep_the_sampler_param() {
        let f = SamplingFields { temperature: Some(3.0), ..Default::default() };
        let err = sampling_params(&f, None, 50, &SamplingDefaults::default()).unwrap_err();
        assert!(matches!(err, ApiError::InvalidRequest { param: Some(p), .. } if p == "temperature"));
        let f = SamplingFields { logit_bias: Some([("abc".to_string(), 1.0)].into()), ..Default::default() };
        assert!(matches!(sampling_params(&f, None, 50, &SamplingDefaults::default()),
            Err(ApiError::InvalidRequest { param: Some(p), .. }) if p == "logit_bias"));
        let f = SamplingFields { seed: Some(-1), ..Default::default() };
        assert_eq!(
            sampling_params(&f, None, 50, &SamplingDefaults::default()).expect("valid").seed,
            Some(u64::MAX)
        );
    }

    #[test]
    fn request_values_override_the_server_defaults() {
        let server = SamplingDefaults {
            temperature: 0.25,
            top_p: 0.8,
            top_k: Some(12),
            min_p: 0.2,
            repetition_penalty: 1.3,
        };
        // Left out: the server's defaults.
        let p = sampling_params(&SamplingFields::default(), None, 50, &server).expect("valid");
        assert_eq!(
            (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty),
            (0.25, 0.8, Some(12), 0.2, 1.3)
        );
        // Given: the request's own, including "off" for top_k.
        let f = SamplingFields {
            temperature: Some(1.0),
            top_p: Some(1.0),
            top_k: Some(-1),
            min_p: Some(0.0),
            repetition_penalty: Some(1.0),
            ..Default::default()
        };
        let p = sampling_params(&f, None, 50, &server).expect("valid");
        assert_eq!(
            (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty),
            (1.0, 1.0, None, 0.0, 1.0)
        );
    }

    #[test]
    fn stop_limits() {
        let l = Limits::default();
        let five = StopField::Many((0..5).map(|i| i.to_string()).collect());
        assert!(stop_strings(Some(five), &l).is_err());
        let got = stop_strings(Some(StopField::Many(vec!["".into(), "x".into()])), &l).expect("valid");
        assert_eq!(got, vec!["x".to_string()]);
    }

    #[test]
    fn positive_rejects_zero_and_negative() {
        assert!(positive("max_tokens", 0).is_err());
        assert!(positive("max_tokens", -3).is_err());
        assert_eq!(positive("max_tokens", 7).expect("positive"), 7);
    }
}
