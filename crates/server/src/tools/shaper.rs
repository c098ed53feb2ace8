//! One chat answer's text, split as it arrives into reasoning, content and
//! tool calls.
//!
//! The shaper is fed the final text of a choice (after detokenization and
//! stop strings) and yields [`Delta`]s: streaming sends each one as it comes,
//! a plain response concatenates them. Text that may still turn out to be
//! part of a call marker is held back until it is decided, so a client never
//! sees half a `<tool_call>` as content. A call is released once it is
//! complete: first its id and name ([`Delta::CallStart`]), then its
//! arguments ([`Delta::CallArgs`]), which is the order the OpenAI clients
//! assemble streamed calls in. Under a named `tool_choice` the whole answer
//! is the arguments, so they stream as they are generated.

use super::parse::{self, RawCall};
use super::reasoning::{partial_tail, Piece, ReasoningSplitter};
use super::{ToolCall, ToolFormat};

/// What the answer is read as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShapeMode {
    /// Text only.
    Plain,
    /// Calls in the model's own format, anywhere the format allows.
    Auto(ToolFormat),
    /// The answer is the arguments of this function (held to its schema).
    Named { name: String, format: ToolFormat },
    /// The answer is a JSON list of `{"name", "parameters"}` (held to the
    /// tools' schemas).
    Required(ToolFormat),
}

/// One piece of a shaped answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    CallStart { index: usize, id: String, name: String },
    CallArgs { index: usize, fragment: String },
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_OPEN: &str = "[TOOL_CALLS]";
const PYTHON_TAG: &str = "<|python_tag|>";

#[derive(Debug, Clone, PartialEq, Eq)]
enum CallState {
    /// Plain text, watching for the format's opening marker.
    Text,
    /// Inside a Hermes call, waiting for its closing tag.
    InCall,
    /// Llama: the answer has not shown yet whether it is a call.
    Undecided,
    /// The rest of the answer is calls, read at the end.
    CaptureAll,
    /// Named tool choice: the call was announced; text is its arguments.
    Arguments,
}

/// The incremental shaper of one choice.
#[derive(Debug, Clone)]
pub struct ChatShaper {
    mode: ShapeMode,
    reasoning: Option<ReasoningSplitter>,
    state: CallState,
    held: String,
    calls: Vec<ToolCall>,
}

impl ChatShaper {
    /// `reasoning`: split a leading `<think>` block off (`Some`), starting
    /// inside one when the prompt opened it.
    pub fn new(mode: ShapeMode, reasoning: Option<ReasoningSplitter>) -> ChatShaper {
        let state = match &mode {
            ShapeMode::Plain | ShapeMode::Auto(ToolFormat::Hermes | ToolFormat::Mistral) => CallState::Text,
            ShapeMode::Auto(ToolFormat::Llama3) => CallState::Undecided,
            ShapeMode::Named { .. } => CallState::Text,
            ShapeMode::Required(_) => CallState::CaptureAll,
        };
        // A forced call leaves no room for a thinking block.
        let reasoning = match mode {
            ShapeMode::Plain | ShapeMode::Auto(_) => reasoning,
            _ => None,
        };
        ChatShaper { mode, reasoning, state, held: String::new(), calls: Vec::new() }
    }

    /// The calls released so far.
    pub fn calls(&self) -> &[ToolCall] {
        &self.calls
    }

    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        let pieces = match &mut self.reasoning {
            Some(r) => r.push(text),
            None => vec![Piece::Content(text.to_string())],
        };
        let mut out = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Reasoning(t) => out.push(Delta::Reasoning(t)),
                Piece::Content(t) => self.content(&t, &mut out),
            }
        }
        out
    }

    /// Releases everything held at the end of the answer.
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        if let Some(r) = &mut self.reasoning {
            for piece in r.finish() {
                match piece {
                    Piece::Reasoning(t) => out.push(Delta::Reasoning(t)),
                    Piece::Content(t) => self.content(&t, &mut out),
                }
            }
        }
        let held = std::mem::take(&mut self.held);
        let format = self.format();
        match (&self.state, &self.mode) {
            (CallState::Arguments, _) => {}
            (_, ShapeMode::Named { name, .. }) => {
                // No text at all: a call without arguments.
                let name = name.clone();
                self.release(vec![RawCall { name, arguments: held_or_empty(&held), id: None }], &mut out);
            }
            (CallState::InCall, _) => match parse::hermes_body(&held) {
                // The model ended without the closing tag.
                Some(call) => self.release(vec![call], &mut out),
                None => out.push(Delta::Content(format!("{HERMES_OPEN}{held}"))),
            },
            (CallState::CaptureAll, ShapeMode::Required(_)) => match parse::llama(&held) {
                Some(calls) => self.release(calls, &mut out),
                None => match serde_json::from_str::<serde_json::Value>(&held) {
                    Ok(serde_json::Value::Array(list)) => {
                        let calls: Vec<RawCall> =
                            list.iter().filter_map(|v| parse::llama(&v.to_string())).flatten().collect();
                        if calls.is_empty() {
                            push_content(&mut out, held);
                        } else {
                            self.release(calls, &mut out);
                        }
                    }
                    _ => push_content(&mut out, held),
                },
            },
            (CallState::CaptureAll, _) => {
                let parsed = match format {
                    Some(ToolFormat::Mistral) => parse::mistral(&held),
                    _ => parse::llama(&held),
                };
                match parsed {
                    Some(calls) => self.release(calls, &mut out),
                    None => {
                        let text = if format == Some(ToolFormat::Mistral) {
                            format!("{MISTRAL_OPEN}{held}")
                        } else {
                            held
                        };
                        push_content(&mut out, text);
                    }
                }
            }
            _ => push_content(&mut out, held),
        }
        out
    }

    fn format(&self) -> Option<ToolFormat> {
        match &self.mode {
            ShapeMode::Plain => None,
            ShapeMode::Auto(f) | ShapeMode::Required(f) | ShapeMode::Named { format: f, .. } => Some(*f),
        }
    }

    fn release(&mut self, calls: Vec<RawCall>, out: &mut Vec<Delta>) {
        let format = self.format().unwrap_or(ToolFormat::Hermes);
        for call in calls {
            let index = self.calls.len();
            let id = match call.id {
                Some(id)
                    if format == ToolFormat::Mistral
                        && id.len() == 9
                        && id.chars().all(|c| c.is_ascii_alphanumeric()) =>
                {
                    id
                }
                _ => format.new_call_id(),
            };
            out.push(Delta::CallStart { index, id: id.clone(), name: call.name.clone() });
            out.push(Delta::CallArgs { index, fragment: call.arguments.clone() });
            self.calls.push(ToolCall { id, name: call.name, arguments: call.arguments });
        }
    }

    /// Feeds content text through the call parser.
    fn content(&mut self, text: &str, out: &mut Vec<Delta>) {
        self.held.push_str(text);
        loop {
            match (&self.state, &self.mode) {
                (CallState::Text, ShapeMode::Plain) => {
                    push_content(out, std::mem::take(&mut self.held));
                    return;
                }
                (CallState::Text, ShapeMode::Named { name, .. }) => {
                    let name = name.clone();
                    let id = self.format().unwrap_or(ToolFormat::Hermes).new_call_id();
                    out.push(Delta::CallStart { index: 0, id: id.clone(), name: name.clone() });
                    self.calls.push(ToolCall { id, name, arguments: String::new() });
                    self.state = CallState::Arguments;
                }
                (CallState::Arguments, _) => {
                    let fragment = std::mem::take(&mut self.held);
                    if !fragment.is_empty() {
                        self.calls[0].arguments.push_str(&fragment);
                        out.push(Delta::CallArgs { index: 0, fragment });
                    }
                    return;
                }
                (CallState::Text, _) => {
                    let open =
                        if self.format() == Some(ToolFormat::Mistral) { MISTRAL_OPEN } else { HERMES_OPEN };
                    if let Some(at) = self.held.find(open) {
                        let before = self.held[..at].to_string();
                        self.held.drain(..at + open.len());
                        push_content(out, before);
                        self.state =
                            if open == MISTRAL_OPEN { CallState::CaptureAll } else { CallState::InCall };
                        continue;
                    }
                    let keep = partial_tail(&self.held, open);
                    let emit: String = self.held.drain(..self.held.len() - keep).collect();
                    push_content(out, emit);
                    return;
                }
                (CallState::InCall, _) => {
                    let Some(at) = self.held.find(HERMES_CLOSE) else { return };
                    let body = self.held[..at].to_string();
                    self.held.drain(..at + HERMES_CLOSE.len());
                    match parse::hermes_body(&body) {
                        Some(call) => self.release(vec![call], out),
                        None => push_content(out, format!("{HERMES_OPEN}{body}{HERMES_CLOSE}")),
                    }
                    self.state = CallState::Text;
                }
                (CallState::Undecided, _) => {
                    let trimmed = self.held.trim_start();
                    if trimmed.is_empty()
                        || (PYTHON_TAG.starts_with(trimmed) && trimmed.len() < PYTHON_TAG.len())
                    {
                        return;
                    }
                    self.state = if trimmed.starts_with('{') || trimmed.starts_with(PYTHON_TAG) {
                        CallState::CaptureAll
                    } else {
                        CallState::Text
                    };
                    if self.state == CallState::Text {
                        // Llama writes calls only as the whole answer.
                        push_content(out, std::mem::take(&mut self.held));
                        self.mode = ShapeMode::Plain;
                        return;
                    }
                }
                (CallState::CaptureAll, _) => return,
            }
        }
    }
}

fn held_or_empty(held: &str) -> String {
    if held.trim().is_empty() {
        "{}".to_string()
    } else {
        held.to_string()
    }
}

fn push_content(out: &mut Vec<Delta>, text: String) {
    if text.is_empty() {
        return;
    }
    // Adjacent content merges, so one push gives at most one content delta.
    if let Some(Delta::Content(last)) = out.last_mut() {
        last.push_str(&text);
    } else {
        out.push(Delta::Content(text));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The assembled answer: (reasoning, content, calls as (name, args)).
    fn assemble(deltas: &[Delta]) -> (String, String, Vec<(String, String)>) {
        let (mut r, mut c, mut calls) = (String::new(), String::new(), Vec::<(String, String)>::new());
        for d in deltas {
            match d {
                Delta::Reasoning(t) => r.push_str(t),
                Delta::Content(t) => c.push_str(t),
                Delta::CallStart { index, id, name } => {
                    assert_eq!(*index, calls.len(), "calls are announced in order");
                    assert!(!id.is_empty());
                    calls.push((name.clone(), String::new()));
                }
                Delta::CallArgs { index, fragment } => calls[*index].1.push_str(fragment),
            }
        }
        (r, c, calls)
    }

    fn shape(mode: ShapeMode, reasoning: bool, pieces: &[&str]) -> (String, String, Vec<(String, String)>) {
        let mut s = ChatShaper::new(mode, reasoning.then(ReasoningSplitter::new));
        let mut deltas: Vec<Delta> = pieces.iter().flat_map(|p| s.push(p)).collect();
        deltas.extend(s.finish());
        assemble(&deltas)
    }

    /// Every split of `text` in two gives the same answer as the whole.
    fn same_in_every_split(
        mode: ShapeMode,
        reasoning: bool,
        text: &str,
    ) -> (String, String, Vec<(String, String)>) {
        let whole = shape(mode.clone(), reasoning, &[text]);
        for cut in (1..text.len()).filter(|&c| text.is_char_boundary(c)) {
            assert_eq!(shape(mode.clone(), reasoning, &[&text[..cut], &text[cut..]]), whole, "cut at {cut}");
        }
        whole
    }

    #[test]
    fn hermes_calls_between_text() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        let (r, c, calls) = same_in_every_split(ShapeMode::Auto(ToolFormat::Hermes), true, text);
        assert_eq!(r, "");
        assert_eq!(c, "Let me check.\n\n");
        assert_eq!(
            calls,
            vec![
                ("get_weather".to_string(), r#"{"city":"Paris"}"#.to_string()),
                ("get_time".to_string(), "{}".to_string()),
            ]
        );
    }

    #[test]
    fn hermes_with_reasoning_and_broken_call() {
        let text = "<think>\nNeed weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let (r, c, calls) = same_in_every_split(ShapeMode::Auto(ToolFormat::Hermes), true, text);
        assert_eq!(r, "\nNeed weather.\n");
        assert_eq!(c, "");
        assert_eq!(calls.len(), 1);
        // A broken call is content, tags and all.
        let (_, c, calls) =
            shape(ShapeMode::Auto(ToolFormat::Hermes), false, &["<tool_call>{\"nam</tool_call> ok"]);
        assert_eq!((c.as_str(), calls.len()), ("<tool_call>{\"nam</tool_call> ok", 0));
        // A call cut off before its closing tag still counts if its JSON is whole.
        let (_, _, calls) = shape(
            ShapeMode::Auto(ToolFormat::Hermes),
            false,
            &["<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n"],
        );
        assert_eq!(calls.len(), 1);
        // Without tools in play nothing is parsed.
        let (_, c, calls) = shape(ShapeMode::Plain, false, &["<tool_call>{}</tool_call>"]);
        assert_eq!((c.as_str(), calls.len()), ("<tool_call>{}</tool_call>", 0));
    }

    #[test]
    fn llama_answer_is_call_or_text() {
        let text = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
        let (_, c, calls) = same_in_every_split(ShapeMode::Auto(ToolFormat::Llama3), false, text);
        assert_eq!((c.as_str(), calls.len()), ("", 1));
        let text = "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
        let (_, _, calls) = same_in_every_split(ShapeMode::Auto(ToolFormat::Llama3), false, text);
        assert_eq!(calls[0].1, r#"{"city":"Paris"}"#);
        let (_, c, calls) =
            same_in_every_split(ShapeMode::Auto(ToolFormat::Llama3), false, "It is {sunny} today.");
        assert_eq!((c.as_str(), calls.len()), ("It is {sunny} today.", 0));
        let (_, c, calls) = same_in_every_split(ShapeMode::Auto(ToolFormat::Llama3), false, "{not json}");
        assert_eq!((c.as_str(), calls.len()), ("{not json}", 0));
    }

    #[test]
    fn mistral_calls_after_marker() {
        let text = "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]";
        let (_, c, calls) = same_in_every_split(ShapeMode::Auto(ToolFormat::Mistral), false, text);
        assert_eq!((c.as_str(), calls.len()), ("", 1));
        let (_, c, _) = shape(ShapeMode::Auto(ToolFormat::Mistral), false, &["Hi [TOOL_CALLS][{\"na"]);
        assert_eq!(c, "Hi [TOOL_CALLS][{\"na");
    }

    #[test]
    fn named_streams_arguments_and_required_reads_the_list() {
        let mode = ShapeMode::Named { name: "get_weather".into(), format: ToolFormat::Hermes };
        let mut s = ChatShaper::new(mode, None);
        let first = s.push("{\"city\"");
        assert!(matches!(&first[0], Delta::CallStart { name, .. } if name == "get_weather"));
        assert_eq!(first[1], Delta::CallArgs { index: 0, fragment: "{\"city\"".into() });
        assert_eq!(
            s.push(": \"Paris\"}"),
            vec![Delta::CallArgs { index: 0, fragment: ": \"Paris\"}".into() }]
        );
        assert!(s.finish().is_empty());
        assert_eq!(s.calls()[0].arguments, "{\"city\": \"Paris\"}");
        let text = "[{\"name\": \"a\", \"parameters\": {\"x\": 1}}, {\"name\": \"b\", \"parameters\": {}}]";
        let (_, c, calls) = same_in_every_split(ShapeMode::Required(ToolFormat::Hermes), false, text);
        assert_eq!(c, "");
        assert_eq!(
            calls,
            vec![("a".to_string(), r#"{"x":1}"#.to_string()), ("b".to_string(), "{}".to_string())]
        );
    }
}
