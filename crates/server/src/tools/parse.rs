//! Reading complete tool calls out of text, one function per format.
//!
//! Each function gets the text of the calls (the markers that opened them
//! already found by the shaper) and returns the calls, or `None` when the
//! text is not a well-formed call, in which case the shaper returns it as
//! content: a model that wrote something call-like but broken gets its text
//! back rather than an invented call.

use serde_json::{Deserializer, Value as Json};

/// A call as written by the model: a name and the arguments as JSON text.
#[derive(Debug, Clone, PartialEq)]
pub struct RawCall {
    pub name: String,
    pub arguments: String,
    /// The id the model wrote itself (Mistral does), if any.
    pub id: Option<String>,
}

/// Reads `{"name": .., "arguments": ..}` (or `parameters`) from a JSON value.
fn call_of(value: &Json) -> Option<RawCall> {
    let obj = value.as_object()?;
    let name = obj.get("name")?.as_str()?.to_string();
    let args = obj.get("arguments").or_else(|| obj.get("parameters"));
    let arguments = match args {
        None | Some(Json::Null) => "{}".to_string(),
        // Some models write the arguments as a JSON string already.
        Some(Json::String(s)) => s.clone(),
        Some(v) => serde_json::to_string(v).ok()?,
    };
    let id = obj.get("id").and_then(Json::as_str).map(str::to_string);
    Some(RawCall { name, arguments, id })
}

/// The JSON values in `text`, one after the other, separated by whitespace
/// and `sep` characters; `None` if anything else is there.
fn json_values(text: &str, sep: char) -> Option<Vec<Json>> {
    let mut out = Vec::new();
    let mut rest = text.trim_start_matches(|c: char| c.is_whitespace() || c == sep);
    while !rest.is_empty() {
        let mut iter = Deserializer::from_str(rest).into_iter::<Json>();
        let value = iter.next()?.ok()?;
        let used = iter.byte_offset();
        out.push(value);
        rest = rest[used..].trim_start_matches(|c: char| c.is_whitespace() || c == sep);
    }
    Some(out)
}

/// The body of one Hermes `<tool_call>...</tool_call>`.
pub fn hermes_body(body: &str) -> Option<RawCall> {
    let values = json_values(body, ',')?;
    match values.as_slice() {
        [one] => call_of(one),
        _ => None,
    }
}

/// A Llama 3.x answer that is nothing but calls: JSON objects separated by
/// `;`, optionally after `<|python_tag|>`, or a built-in tool's
/// `name.call(arg="value", ...)`.
pub fn llama(text: &str) -> Option<Vec<RawCall>> {
    let text = text.trim();
    let text = text.strip_prefix("<|python_tag|>").unwrap_or(text).trim();
    if text.starts_with('{') {
        let values = json_values(text, ';')?;
        let calls: Option<Vec<RawCall>> = values.iter().map(call_of).collect();
        return calls.filter(|c| !c.is_empty());
    }
    builtin_call(text).map(|c| vec![c])
}

/// `brave_search.call(query="weather in Paris")`: the form the Llama 3.1
/// template uses for its built-in tools. Argument values are Python string,
/// number or boolean literals.
fn builtin_call(text: &str) -> Option<RawCall> {
    let (name, rest) = text.split_once(".call(")?;
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return None;
    }
    let inner = rest.trim_end().strip_suffix(')')?;
    let mut args = serde_json::Map::new();
    let mut rest = inner.trim();
    while !rest.is_empty() {
        let (key, after) = rest.split_once('=')?;
        let key = key.trim();
        let after = after.trim_start();
        let (value, tail) = if let Some(q) = after.chars().next().filter(|c| *c == '"' || *c == '\'') {
            let body = &after[1..];
            let end = body.find(q)?;
            (Json::String(body[..end].to_string()), &body[end + 1..])
        } else {
            let end = after.find(',').unwrap_or(after.len());
            let literal = after[..end].trim();
            let value = match literal {
                "True" => Json::Bool(true),
                "False" => Json::Bool(false),
                "None" => Json::Null,
                other => serde_json::from_str::<Json>(other).ok()?,
            };
            (value, &after[end..])
        };
        args.insert(key.to_string(), value);
        rest = tail.trim_start().trim_start_matches(',').trim_start();
    }
    Some(RawCall { name: name.to_string(), arguments: Json::Object(args).to_string(), id: None })
}

/// What follows Mistral's `[TOOL_CALLS]`: a JSON list of calls (the
/// v3 tokenizer's form), or `name[ARGS]{...}` entries (v11), several of
/// them each after their own `[TOOL_CALLS]`.
pub fn mistral(text: &str) -> Option<Vec<RawCall>> {
    let text = text.trim();
    if text.starts_with('[') {
        let values = json_values(text, ',')?;
        let mut calls = Vec::new();
        for v in &values {
            match v {
                Json::Array(list) => {
                    for item in list {
                        calls.push(call_of(item)?);
                    }
                }
                other => calls.push(call_of(other)?),
            }
        }
        return Some(calls).filter(|c| !c.is_empty());
    }
    let mut calls = Vec::new();
    for entry in text.split("[TOOL_CALLS]").map(str::trim).filter(|e| !e.is_empty()) {
        let (name, args) = entry.split_once("[ARGS]")?;
        let values = json_values(args, ',')?;
        let [value] = values.as_slice() else { return None };
        if !value.is_object() {
            return None;
        }
        calls.push(RawCall { name: name.trim().to_string(), arguments: value.to_string(), id: None });
    }
    Some(calls).filter(|c| !c.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hermes_reads_arguments_and_parameters() {
        let c = hermes_body("\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n")
            .expect("call");
        assert_eq!(c.name, "get_weather");
        assert_eq!(c.arguments, r#"{"city":"Paris"}"#);
        let c = hermes_body(r#"{"name": "f", "arguments": "{\"x\": 1}"}"#).expect("string arguments");
        assert_eq!(c.arguments, r#"{"x": 1}"#);
        assert!(hermes_body("{\"name\": \"f\"").is_none(), "truncated JSON is no call");
        assert!(hermes_body("{\"arguments\": {}}").is_none(), "a call needs a name");
        assert!(hermes_body("{\"name\": \"f\"} {\"name\": \"g\"}").is_none());
    }

    #[test]
    fn llama_json_python_tag_and_builtins() {
        // Meta's published example of a JSON-based call.
        let calls = llama(r#"{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}"#)
            .expect("call");
        assert_eq!(calls[0].name, "get_current_conditions");
        assert_eq!(calls[0].arguments, r#"{"location":"San Francisco, CA","unit":"Fahrenheit"}"#);
        let calls = llama("<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"n\": 2}}")
            .expect("two calls");
        assert_eq!(calls.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        // Meta's built-in tool example.
        let calls =
            llama("<|python_tag|>brave_search.call(query=\"current weather in Menlo Park, California\")")
                .expect("builtin");
        assert_eq!(calls[0].name, "brave_search");
        assert_eq!(calls[0].arguments, r#"{"query":"current weather in Menlo Park, California"}"#);
        assert!(llama("The weather is fine.").is_none());
        assert!(llama("{\"name\": \"a\", \"parameters\": {}} and then some").is_none());
    }

    #[test]
    fn mistral_list_and_args_forms() {
        // Mistral's published v3 example.
        let calls = mistral(r#" [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}]"#)
            .expect("list");
        assert_eq!(calls[0].name, "get_current_weather");
        assert_eq!(calls[0].arguments, r#"{"location":"Paris, France","format":"celsius"}"#);
        let calls =
            mistral(r#"get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}"#).expect("v11");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1].name, "get_time");
        let calls = mistral(r#"[{"name": "f", "arguments": {}, "id": "abcdefghi"}]"#).expect("id");
        assert_eq!(calls[0].id.as_deref(), Some("abcdefghi"));
        assert!(mistral("[{\"name\": \"f\", ").is_none());
    }
}
