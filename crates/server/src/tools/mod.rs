//! Tool calls and reasoning: what the request asks for (`tools`,
//! `tool_choice`), and how a model's raw output is split into content,
//! reasoning and calls.
//!
//! The output format of tool calls is the model's, not OpenAI's, so it is
//! picked from the chat template the model was trained with
//! ([`ToolFormat::detect`]):
//! - Hermes (Qwen2.5, Qwen3, Hermes, SmolLM3, and the fallback for templates
//!   that show no format): `<tool_call>{"name": .., "arguments": ..}</tool_call>`,
//!   any number of them, text around them is content;
//! - Llama 3.1 / 3.2: the whole answer is `{"name": .., "parameters": ..}`
//!   (several separated by `;`), or `<|python_tag|>` followed by such JSON or
//!   a built-in call `name.call(arg="..")`;
//! - Mistral: `[TOOL_CALLS]` followed by a JSON list of
//!   `{"name": .., "arguments": ..}`, or by `name[ARGS]{..}` entries.
//!
//! With `tool_choice` naming a function or `required`, the answer is held to
//! a grammar by constrained decoding instead, so the call cannot fail to
//! parse: the named function's arguments object alone, or a JSON list of
//! `{"name": .., "parameters": ..}` objects for `required`
//! ([`ToolChoice::grammar_schema`]). Those outputs are read back by
//! [`ShapeMode::Named`] and [`ShapeMode::Required`].
//!
//! [`shaper::ChatShaper`] does the splitting incrementally, so streamed and
//! non-streamed answers are built from the same pieces.

pub mod parse;
pub mod reasoning;
pub mod shaper;

use serde_json::{json, Map, Value as Json};

use crate::error::ApiError;

/// How a model writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3,
    Mistral,
}

impl ToolFormat {
    /// The format a chat template teaches, read from its source.
    pub fn detect(template_source: &str) -> ToolFormat {
        if template_source.contains("[TOOL_CALLS]") {
            ToolFormat::Mistral
        } else if template_source.contains("<|python_tag|>")
            || (template_source.contains("\"parameters\": ") && template_source.contains("ipython"))
        {
            ToolFormat::Llama3
        } else {
            ToolFormat::Hermes
        }
    }

    /// Whether the format's markers are special tokens, which must then be
    /// kept in the decoded text for the parser to see them.
    pub fn needs_special_tokens(self) -> bool {
        matches!(self, ToolFormat::Llama3 | ToolFormat::Mistral)
    }

    /// A fresh call id. Mistral's templates refuse any id that is not nine
    /// alphanumeric characters, so its calls get those; every other format
    /// gets OpenAI's `call_` ids.
    pub fn new_call_id(self) -> String {
        let hex = uuid::Uuid::new_v4().simple().to_string();
        match self {
            ToolFormat::Mistral => hex[..9].to_string(),
            _ => format!("call_{}", &hex[..24]),
        }
    }
}

/// One function the client offered (`tools[i].function`).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDef {
    pub name: String,
    /// The JSON schema of its arguments (`{"type": "object"}` when absent).
    pub parameters: Json,
}

/// `tool_choice`, validated.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// Calls are parsed out of the answer if the model writes any.
    Auto,
    /// The model may see the tools, but the answer is never parsed for calls.
    None,
    /// At least one call, held to the tools' schemas by the grammar.
    Required,
    /// Exactly one call of this function, its arguments held to its schema.
    Named(String),
}

/// One parsed call, ready for `tool_calls`.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as a JSON string, as OpenAI sends them.
    pub arguments: String,
}

/// Checks `tools`: each entry `{"type": "function", "function": {"name",
/// "description"?, "parameters"?, "strict"?}}`, names unique and spelled as
/// OpenAI allows, parameters a JSON-schema object.
pub fn validate_tools(tools: &[Json]) -> Result<Vec<ToolDef>, ApiError> {
    let mut defs: Vec<ToolDef> = Vec::with_capacity(tools.len());
    for (i, tool) in tools.iter().enumerate() {
        let at = |suffix: &str| format!("tools[{i}]{suffix}");
        let obj = tool.as_object().ok_or_else(|| ApiError::invalid(at(""), "each tool must be an object"))?;
        match obj.get("type") {
            Some(Json::String(t)) if t == "function" => {}
            Some(Json::String(t)) => {
                return Err(ApiError::invalid(
                    at(".type"),
                    format!("tool type '{t}' is not supported; only 'function' is"),
                ))
            }
            _ => return Err(ApiError::invalid(at(".type"), "a tool needs 'type': 'function'")),
        }
        let function = obj
            .get("function")
            .and_then(Json::as_object)
            .ok_or_else(|| ApiError::invalid(at(".function"), "a function tool needs a 'function' object"))?;
        let name = match function.get("name") {
            Some(Json::String(n)) => n.clone(),
            _ => return Err(ApiError::invalid(at(".function.name"), "a function needs a string 'name'")),
        };
        if name.is_empty()
            || name.len() > 64
            || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
        {
            return Err(ApiError::invalid(
                at(".function.name"),
                format!(
                    "function name '{name}' must be 1 to 64 characters of a-z, A-Z, 0-9, underscores, dashes and dots"
                ),
            ));
        }
        if defs.iter().any(|d| d.name == name) {
            return Err(ApiError::invalid(
                at(".function.name"),
                format!("function name '{name}' is used twice"),
            ));
        }
        if let Some(d) = function.get("description") {
            if !d.is_string() && !d.is_null() {
                return Err(ApiError::invalid(at(".function.description"), "'description' must be a string"));
            }
        }
        let parameters = match function.get("parameters") {
            None | Some(Json::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Json::Object(_)) => {
                check_schema(p).map_err(|m| ApiError::invalid(at(".function.parameters"), m))?;
                p.clone()
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    at(".function.parameters"),
                    "'parameters' must be a JSON schema object",
                ))
            }
        };
        defs.push(ToolDef { name, parameters });
    }
    Ok(defs)
}

/// JSON-schema keywords whose value must be of one JSON type; enough to
/// catch the schema mistakes clients make, while the grammar compiler
/// catches the rest.
pub fn check_schema(schema: &Json) -> Result<(), String> {
    let Json::Object(map) = schema else {
        return match schema {
            Json::Bool(_) => Ok(()),
            _ => Err("a JSON schema must be an object or a boolean".to_string()),
        };
    };
    if let Some(t) = map.get("type") {
        const TYPES: &[&str] = &["object", "array", "string", "number", "integer", "boolean", "null"];
        let ok = |v: &Json| v.as_str().is_some_and(|s| TYPES.contains(&s));
        let valid = match t {
            Json::String(_) => ok(t),
            Json::Array(list) => !list.is_empty() && list.iter().all(ok),
            _ => false,
        };
        if !valid {
            return Err(format!("invalid schema 'type': {t}"));
        }
    }
    if let Some(p) = map.get("properties") {
        let props = p.as_object().ok_or("schema 'properties' must be an object")?;
        for (name, sub) in props {
            check_schema(sub).map_err(|e| format!("property '{name}': {e}"))?;
        }
    }
    if let Some(r) = map.get("required") {
        let ok = r.as_array().is_some_and(|l| l.iter().all(Json::is_string));
        if !ok {
            return Err("schema 'required' must be a list of strings".into());
        }
    }
    if let Some(items) = map.get("items") {
        check_schema(items).map_err(|e| format!("items: {e}"))?;
    }
    if let Some(e) = map.get("enum") {
        if e.as_array().is_none_or(|l| l.is_empty()) {
            return Err("schema 'enum' must be a non-empty list".into());
        }
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        if let Some(v) = map.get(key) {
            let list = v
                .as_array()
                .filter(|l| !l.is_empty())
                .ok_or(format!("schema '{key}' must be a non-empty list"))?;
            for sub in list {
                check_schema(sub)?;
            }
        }
    }
    Ok(())
}

/// Reads `tool_choice` against the validated tools.
pub fn validate_tool_choice(choice: Option<&Json>, tools: &[ToolDef]) -> Result<ToolChoice, ApiError> {
    let param = "tool_choice";
    let choice = match choice {
        None | Some(Json::Null) => {
            return Ok(if tools.is_empty() { ToolChoice::None } else { ToolChoice::Auto })
        }
        Some(c) => c,
    };
    let parsed = match choice {
        Json::String(s) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    param,
                    format!("'tool_choice' must be 'none', 'auto', 'required' or a function, got '{other}'"),
                ))
            }
        },
        Json::Object(obj) => {
            let name = obj
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Json::as_str)
                .filter(|_| obj.get("type").and_then(Json::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::invalid(
                        param,
                        "a named 'tool_choice' is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid(
                    param,
                    format!("'tool_choice' names '{name}', which is not in 'tools'"),
                ));
            }
            ToolChoice::Named(name.to_string())
        }
        _ => return Err(ApiError::invalid(param, "'tool_choice' must be a string or an object")),
    };
    if tools.is_empty() && matches!(parsed, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(ApiError::invalid(param, "'tool_choice' needs 'tools'"));
    }
    Ok(parsed)
}

impl ToolChoice {
    /// The JSON schema the answer is held to, for the choices that force a
    /// call; `parallel`: whether `required` may make several calls.
    pub fn grammar_schema(&self, tools: &[ToolDef], parallel: bool) -> Option<Json> {
        match self {
            ToolChoice::Named(name) => tools.iter().find(|t| &t.name == name).map(|t| t.parameters.clone()),
            ToolChoice::Required => {
                let one_of: Vec<Json> = tools
                    .iter()
                    .map(|t| {
                        json!({
                            "type": "object",
                            "properties": {"name": {"const": t.name}, "parameters": t.parameters},
                            "required": ["name", "parameters"],
                            "additionalProperties": false,
                        })
                    })
                    .collect();
                let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": one_of}});
                if !parallel {
                    schema["maxItems"] = json!(1);
                }
                Some(schema)
            }
            ToolChoice::Auto | ToolChoice::None => None,
        }
    }
}

/// Prepares assistant turns that carry `tool_calls` for the template: the
/// `arguments` string is parsed into an object, since templates print it
/// with `tojson` (Llama) or as a mapping (Mistral), and a string there would
/// be printed quoted. Arguments that are not a JSON object stay a string.
pub fn prepare_history(messages: &mut [Json]) {
    for message in messages {
        let Some(calls) = message.get_mut("tool_calls").and_then(Json::as_array_mut) else { continue };
        for call in calls {
            let Some(function) = call.get_mut("function").and_then(Json::as_object_mut) else { continue };
            if let Some(Json::String(text)) = function.get("arguments") {
                if let Ok(value @ Json::Object(_)) = serde_json::from_str::<Json>(text) {
                    function.insert("arguments".into(), value);
                }
            }
        }
    }
}

/// Checks an assistant message's `tool_calls` and a tool message's
/// `tool_call_id`, naming the field at fault.
pub fn check_message_tools(i: usize, role: &str, obj: &Map<String, Json>) -> Result<(), ApiError> {
    if role == "tool" {
        match obj.get("tool_call_id") {
            None | Some(Json::Null) | Some(Json::String(_)) => {}
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].tool_call_id"),
                    "'tool_call_id' must be a string",
                ))
            }
        }
    }
    match obj.get("tool_calls") {
        None | Some(Json::Null) => Ok(()),
        Some(Json::Array(calls)) if role == "assistant" => {
            for (j, call) in calls.iter().enumerate() {
                let at = format!("messages[{i}].tool_calls[{j}]");
                let name = call.get("function").and_then(|f| f.get("name")).and_then(Json::as_str);
                if name.is_none() {
                    return Err(ApiError::invalid(
                        format!("{at}.function.name"),
                        "a tool call needs 'function.name'",
                    ));
                }
                match call.get("function").and_then(|f| f.get("arguments")) {
                    None | Some(Json::String(_)) | Some(Json::Object(_)) => {}
                    Some(_) => {
                        return Err(ApiError::invalid(
                            format!("{at}.function.arguments"),
                            "'arguments' must be a JSON string",
                        ))
                    }
                }
            }
            Ok(())
        }
        Some(Json::Array(_)) => Err(ApiError::invalid(
            format!("messages[{i}].tool_calls"),
            "only assistant messages carry 'tool_calls'",
        )),
        Some(_) => Err(ApiError::invalid(format!("messages[{i}].tool_calls"), "'tool_calls' must be a list")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(e: ApiError) -> String {
        match e {
            ApiError::InvalidRequest { param: Some(p), .. } => p,
            other => panic!("unexpected {other:?}"),
        }
    }

    fn weather() -> Json {
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    #[test]
    fn tool_definitions_are_checked_with_the_field_named() {
        assert_eq!(validate_tools(&[weather()]).expect("valid")[0].name, "get_weather");
        let bad = |t: Json| param(validate_tools(&[weather(), t]).unwrap_err());
        assert_eq!(bad(json!("x")), "tools[1]");
        assert_eq!(bad(json!({"type": "retrieval"})), "tools[1].type");
        assert_eq!(bad(json!({"type": "function"})), "tools[1].function");
        assert_eq!(
            bad(json!({"type": "function", "function": {"name": "has space"}})),
            "tools[1].function.name"
        );
        assert_eq!(bad(weather()), "tools[1].function.name", "duplicate name");
        assert_eq!(
            bad(json!({"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}})),
            "tools[1].function.parameters"
        );
        assert_eq!(
            bad(
                json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "a"}}})
            ),
            "tools[1].function.parameters"
        );
        assert_eq!(
            bad(json!({"type": "function", "function": {"name": "f", "parameters": []}})),
            "tools[1].function.parameters"
        );
    }

    #[test]
    fn tool_choice_forms() {
        let tools = validate_tools(&[weather()]).expect("valid");
        assert_eq!(validate_tool_choice(None, &tools).expect("default"), ToolChoice::Auto);
        assert_eq!(validate_tool_choice(None, &[]).expect("default"), ToolChoice::None);
        assert_eq!(validate_tool_choice(Some(&json!("required")), &tools).expect("ok"), ToolChoice::Required);
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        assert_eq!(
            validate_tool_choice(Some(&named), &tools).expect("ok"),
            ToolChoice::Named("get_weather".into())
        );
        for bad in [json!("always"), json!({"type": "function", "function": {"name": "nope"}}), json!(3)] {
            assert_eq!(param(validate_tool_choice(Some(&bad), &tools).unwrap_err()), "tool_choice");
        }
        assert!(validate_tool_choice(Some(&json!("required")), &[]).is_err());
        // The forced schemas.
        let named = ToolChoice::Named("get_weather".into()).grammar_schema(&tools, true).expect("schema");
        assert_eq!(named["required"], json!(["city"]));
        let required = ToolChoice::Required.grammar_schema(&tools, true).expect("schema");
        assert_eq!(required["items"]["anyOf"][0]["properties"]["name"]["const"], "get_weather");
        assert!(required.get("maxItems").is_none());
        assert_eq!(ToolChoice::Required.grammar_schema(&tools, false).expect("schema")["maxItems"], 1);
        assert!(ToolChoice::Auto.grammar_schema(&tools, true).is_none());
    }

    #[test]
    fn history_arguments_become_objects() {
        let mut m = vec![json!({"role": "assistant", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
            {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}}]})];
        prepare_history(&mut m);
        assert_eq!(m[0]["tool_calls"][0]["function"]["arguments"], json!({"x": 1}));
        assert_eq!(m[0]["tool_calls"][1]["function"]["arguments"], "not json");
        let obj = json!({"role": "user", "tool_calls": []});
        assert_eq!(
            param(check_message_tools(2, "user", obj.as_object().unwrap()).unwrap_err()),
            "messages[2].tool_calls"
        );
        let obj = json!({"role": "tool", "tool_call_id": 5});
        assert_eq!(
            param(check_message_tools(1, "tool", obj.as_object().unwrap()).unwrap_err()),
            "messages[1].tool_call_id"
        );
    }
}
