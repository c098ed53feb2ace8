//! Splitting `<think>...</think>` off the start of an answer.
//!
//! Reasoning models (Qwen3, SmolLM3, DeepSeek-R1 distills) open their answer
//! with a `<think>` block; OpenAI-compatible servers return it as
//! `reasoning_content` and the rest as `content`. Only a block at the very
//! start counts (leading whitespace aside), so an answer that merely talks
//! about the tags keeps them. Some templates open the block in the prompt
//! itself; then the answer starts inside it ([`ReasoningSplitter::inside`]).
//! The whitespace between `</think>` and the answer is dropped.
//!
//! Text is fed in pieces; a tail that could be the start of a tag is held
//! back until it is decided, so no tag ever leaks into a stream.

pub const OPEN: &str = "<think>";
pub const CLOSE: &str = "</think>";

/// One piece of split text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing decided yet: the answer may still open with `<think>`.
    Start,
    Reasoning,
    /// After `</think>`: whitespace is dropped until the answer begins.
    AfterClose,
    Content,
}

/// The incremental splitter of one answer.
#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    state: State,
    held: String,
}

/// Length of the longest tail of `text` that is a proper prefix of `marker`.
pub fn partial_tail(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

impl ReasoningSplitter {
    /// For an answer that may open with `<think>`.
    pub fn new() -> ReasoningSplitter {
        ReasoningSplitter { state: State::Start, held: String::new() }
    }

    /// For an answer whose prompt already opened the block.
    pub fn inside() -> ReasoningSplitter {
        ReasoningSplitter { state: State::Reasoning, held: String::new() }
    }

    /// Whether a rendered prompt leaves a `<think>` block open.
    pub fn prompt_opens_block(prompt: &str) -> bool {
        match (prompt.rfind(OPEN), prompt.rfind(CLOSE)) {
            (Some(open), Some(close)) => open > close && prompt[open..].trim() == OPEN,
            (Some(open), None) => prompt[open..].trim() == OPEN,
            _ => false,
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Start => {
                    let trimmed = self.held.trim_start();
                    if trimmed.is_empty() || (OPEN.starts_with(trimmed) && trimmed.len() < OPEN.len()) {
                        return out;
                    }
                    if let Some(rest) = trimmed.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.state = State::Reasoning;
                    } else {
                        self.state = State::Content;
                    }
                }
                State::Reasoning => {
                    if let Some(at) = self.held.find(CLOSE) {
                        let reasoning = self.held[..at].to_string();
                        self.held.drain(..at + CLOSE.len());
                        if !reasoning.is_empty() {
                            out.push(Piece::Reasoning(reasoning));
                        }
                        self.state = State::AfterClose;
                        continue;
                    }
                    let keep = partial_tail(&self.held, CLOSE);
                    let emit: String = self.held.drain(..self.held.len() - keep).collect();
                    if !emit.is_empty() {
                        out.push(Piece::Reasoning(emit));
                    }
                    return out;
                }
                State::AfterClose => {
                    let trimmed = self.held.trim_start().to_string();
                    self.held = trimmed;
                    if self.held.is_empty() {
                        return out;
                    }
                    self.state = State::Content;
                }
                State::Content => {
                    if !self.held.is_empty() {
                        out.push(Piece::Content(std::mem::take(&mut self.held)));
                    }
                    return out;
                }
            }
        }
    }

    /// Releases what is held at the end of the answer.
    pub fn finish(&mut self) -> Vec<Piece> {
        let held = std::mem::take(&mut self.held);
        if held.is_empty() {
            return Vec::new();
        }
        match self.state {
            State::Reasoning => vec![Piece::Reasoning(held)],
            State::AfterClose => Vec::new(),
            State::Start | State::Content => vec![Piece::Content(held)],
        }
    }
}

impl Default for ReasoningSplitter {
    fn default() -> Self {
        ReasoningSplitter::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(mut s: ReasoningSplitter, pieces: &[&str]) -> (String, String) {
        let (mut r, mut c) = (String::new(), String::new());
        let mut all: Vec<Piece> = pieces.iter().flat_map(|p| s.push(p)).collect();
        all.extend(s.finish());
        for p in all {
            match p {
                Piece::Reasoning(t) => r.push_str(&t),
                Piece::Content(t) => c.push_str(&t),
            }
        }
        (r, c)
    }

    #[test]
    fn splits_whole_and_in_every_split_of_the_tags() {
        let text = "<think>\nThe user greets.\n</think>\n\nHello!";
        assert_eq!(run(ReasoningSplitter::new(), &[text]), ("\nThe user greets.\n".into(), "Hello!".into()));
        // Every way of cutting the text in two, tags included.
        for cut in 1..text.len() {
            let got = run(ReasoningSplitter::new(), &[&text[..cut], &text[cut..]]);
            assert_eq!(got, ("\nThe user greets.\n".into(), "Hello!".into()), "cut at {cut}");
        }
        // Character by character.
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(ReasoningSplitter::new(), &refs).1, "Hello!");
    }

    #[test]
    fn only_a_leading_block_counts() {
        assert_eq!(
            run(ReasoningSplitter::new(), &["Use <think> tags."]),
            (String::new(), "Use <think> tags.".into())
        );
        assert_eq!(
            run(ReasoningSplitter::new(), &["<thi", "s is it"]),
            (String::new(), "<this is it".into())
        );
        // Cut off while thinking: all of it is reasoning.
        assert_eq!(run(ReasoningSplitter::new(), &["<think>Hmm, let"]), ("Hmm, let".into(), String::new()));
    }

    #[test]
    fn prompt_opened_block() {
        assert!(ReasoningSplitter::prompt_opens_block("<|im_start|>assistant\n<think>\n"));
        assert!(!ReasoningSplitter::prompt_opens_block("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
        assert!(!ReasoningSplitter::prompt_opens_block("<|im_start|>assistant\n"));
        assert_eq!(run(ReasoningSplitter::inside(), &["why\n</think>\n\nok"]), ("why\n".into(), "ok".into()));
    }
}
