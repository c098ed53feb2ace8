//! OpenAI request and response shapes, as serde types.
//!
//! Requests are read leniently where OpenAI is lenient and strictly where it
//! is strict: unknown fields are ignored (clients send `user`, `metadata`,
//! `store`, ...), `null` means "not given", but a field of the wrong type is
//! refused with its name (`temperature: invalid type: string "hot", expected
//! f32`). Integer fields that have a lower bound are read as `i64` so that a
//! negative value gets a message about the bound rather than about the type.
//! These types are only the raw shape; `validate` turns them into the typed
//! requests the handlers run.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};
use std::collections::BTreeMap;

use crate::error::ApiError;

/// Reads one raw request type from a parsed body; a type mismatch names the
/// field by its path (`messages[0].role`, `stream_options.include_usage`).
pub fn parse<T: DeserializeOwned>(body: &Json) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        if path.is_empty() || path == "." {
            ApiError::invalid_body(format!("invalid request body: {inner}"))
        } else {
            // The root of the path is the request field a client looks for.
            ApiError::invalid(path.clone(), format!("invalid '{path}': {inner}"))
        }
    })
}

/// `stop`: one string or a list of strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The sampling fields chat and completions share, read from the same body
/// as the endpoint's own request type. Besides OpenAI's fields, vLLM's
/// extensions that the sampler implements are accepted.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// Token id (as a string key, as OpenAI sends it) to bias.
    pub logit_bias: Option<BTreeMap<String, f32>>,
    pub seed: Option<i64>,
    pub min_tokens: Option<i64>,
    pub ignore_eos: Option<bool>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub stop: Option<StopField>,
    pub n: Option<i64>,
    pub max_tokens: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// vLLM's switch; special tokens are left out of the text by default.
    pub skip_special_tokens: Option<bool>,
}

/// `POST /v1/chat/completions`, beside [`SamplingFields`].
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    /// Kept as JSON: the chat template sees the messages as the client sent
    /// them (tool calls, reasoning fields); `validate` checks their shape.
    pub messages: Option<Vec<Json>>,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    /// `false`: at most one call per answer.
    pub parallel_tool_calls: Option<bool>,
    /// `text`, `json_object` or `json_schema`; read by `validate`, which
    /// names the nested field at fault.
    pub response_format: Option<Json>,
    pub chat_template_kwargs: Option<Map<String, Json>>,
    /// vLLM's extension: end the prompt with the assistant header (default).
    pub add_generation_prompt: Option<bool>,
}

/// `prompt` of a completion: a string, strings, token ids, or lists of ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

/// `POST /v1/completions`, beside [`SamplingFields`].
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Option<PromptField>,
    /// The legacy shape: how many top tokens to report per position.
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
}

// ---------------------------------------------------------------- responses

/// `usage`, with the prompt tokens served from the prefix cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct UsageOut {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl UsageOut {
    pub fn new(prompt_tokens: usize, cached_tokens: usize, completion_tokens: usize) -> UsageOut {
        UsageOut {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// One alternative in chat `top_logprobs`.
#[derive(Debug, Clone, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// One generated token in chat `logprobs.content`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

/// Chat `choices[].logprobs`.
#[derive(Debug, Clone, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
    pub refusal: Option<String>,
}

/// The legacy completions `logprobs` object: parallel lists per token.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LegacyLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    /// Per position, token text to log-probability, most likely first.
    pub top_logprobs: Vec<Option<Map<String, Json>>>,
    /// Byte offset of each token in the choice's text.
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatMessageOut {
    pub role: &'static str,
    /// `null` for an answer that is only tool calls.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

/// One entry of a message's `tool_calls`.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionOut,
}

#[derive(Debug, Clone, Serialize)]
pub struct FunctionOut {
    pub name: String,
    /// The arguments as a JSON string.
    pub arguments: String,
}

/// One entry of a streamed delta's `tool_calls`: the first for a call
/// carries its id, type and name; later ones append to `arguments`.
#[derive(Debug, Clone, Serialize)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ChatMessageOut,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
}

/// A non-streaming chat answer.
#[derive(Debug, Clone, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: &'static str,
    pub choices: Vec<ChatChoice>,
    pub usage: UsageOut,
}

/// The `delta` of a streamed chat chunk; absent keys are left out.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// One SSE frame of a streamed chat answer.
#[derive(Debug, Clone, Serialize)]
pub struct ChatChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: &'static str,
    pub choices: Vec<ChatChunkChoice>,
    pub usage: Option<UsageOut>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<LegacyLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// A completion answer, or one SSE frame of a streamed one (same shape).
#[derive(Debug, Clone, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: &'static str,
    pub choices: Vec<CompletionChoice>,
    pub usage: Option<UsageOut>,
}

/// One entry of `GET /v1/models`.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// The longest sequence (prompt + output) a request may use.
    pub max_model_len: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn wrong_type_names_the_field() {
        let err = parse::<SamplingFields>(&json!({"temperature": "hot"})).unwrap_err();
        match err {
            ApiError::InvalidRequest { param, message, .. } => {
                assert_eq!(param.as_deref(), Some("temperature"));
                assert!(message.contains("temperature"), "{message}");
            }
            other => panic!("unexpected {other:?}"),
        }
        let err = parse::<SamplingFields>(&json!({"stream_options": {"include_usage": 3}})).unwrap_err();
        assert!(
            matches!(err, ApiError::InvalidRequest { param: Some(p), .. } if p == "stream_options.include_usage")
        );
    }

    #[test]
    fn unknown_fields_and_nulls_are_accepted() {
        let f = parse::<SamplingFields>(&json!({"user": "u", "metadata": {}, "temperature": null}))
            .expect("lenient");
        assert!(f.temperature.is_none());
    }

    #[test]
    fn prompt_shapes() {
        let r = parse::<CompletionRequest>(&json!({"prompt": [1, 2, 3]})).expect("ids");
        assert!(matches!(r.prompt, Some(PromptField::Ids(v)) if v == vec![1, 2, 3]));
        let r = parse::<CompletionRequest>(&json!({"prompt": [[1], [2, 3]]})).expect("id lists");
        assert!(matches!(r.prompt, Some(PromptField::IdLists(v)) if v.len() == 2));
        let r = parse::<CompletionRequest>(&json!({"prompt": ["a", "b"]})).expect("texts");
        assert!(matches!(r.prompt, Some(PromptField::Texts(v)) if v.len() == 2));
        assert!(parse::<CompletionRequest>(&json!({"prompt": [-1]})).is_err());
    }

    #[test]
    fn usage_serializes_cached_tokens() {
        let v = serde_json::to_value(UsageOut::new(10, 4, 3)).expect("serializes");
        assert_eq!(v["total_tokens"], 13);
        assert_eq!(v["prompt_tokens_details"]["cached_tokens"], 4);
    }
}
