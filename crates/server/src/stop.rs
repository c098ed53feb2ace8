//! Stop strings, matched on the generated text rather than on tokens.
//!
//! A stop string may span several tokens (`"\n\n"` can arrive as `"\n"` then
//! `"\n"`), or begin in the middle of one. The matcher therefore works on the
//! text stream: it appends each new piece, looks for the earliest occurrence
//! of any stop string in the text it has not released yet, and otherwise
//! holds back the longest tail that could still be the start of one. What it
//! releases is therefore final: no released text is ever followed by a match
//! that begins inside it, so a streaming client never receives part of a
//! stop string, and the concatenation of everything released equals the
//! non-streaming output.
//!
//! The matched stop string and everything after it are dropped, as OpenAI
//! does.

/// The outcome of feeding one piece of text.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopStep {
    /// Text that is final and can be sent to the client.
    pub emit: String,
    /// A stop string matched; nothing more will be released.
    pub stopped: bool,
}

/// Incremental stop-string matcher for one generated sequence.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not released: a tail that may begin a stop string.
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops`; empty strings are ignored (they would match
    /// everywhere).
    pub fn new(stops: &[String]) -> StopMatcher {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// True once a stop string has matched.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Feeds the next piece of generated text.
    pub fn push(&mut self, piece: &str) -> StopStep {
        if self.stopped {
            return StopStep { emit: String::new(), stopped: true };
        }
        self.held.push_str(piece);
        if self.stops.is_empty() {
            return StopStep { emit: std::mem::take(&mut self.held), stopped: false };
        }
        // The earliest match wins; among matches at the same place, any will
        // do, since everything from that place on is dropped.
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let emit = self.held[..at].to_string();
            self.held.clear();
            self.stopped = true;
            return StopStep { emit, stopped: true };
        }
        let keep = self.longest_partial_tail();
        let split = self.held.len() - keep;
        let emit = self.held[..split].to_string();
        self.held.drain(..split);
        StopStep { emit, stopped: false }
    }

    /// Releases the held tail at the end of generation (it turned out not to
    /// be the start of a stop string).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }

    /// Length in bytes of the longest tail of `held` that is a proper prefix
    /// of some stop string. Only char boundaries are considered, since stop
    /// strings are whole strings.
    fn longest_partial_tail(&self) -> usize {
        let longest_stop = self.stops.iter().map(String::len).max().unwrap_or(0);
        let held = self.held.as_str();
        let min_start = held.len().saturating_sub(longest_stop.saturating_sub(1));
        held.char_indices()
            .map(|(i, _)| i)
            .filter(|&i| i >= min_start)
            .find(|&i| {
                let tail = &held[i..];
                self.stops.iter().any(|s| s.len() > tail.len() && s.starts_with(tail))
            })
            .map_or(0, |i| held.len() - i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn stops(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    /// Feeds pieces and returns (released text, stopped).
    fn run(list: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(&stops(list));
        let mut out = String::new();
        for p in pieces {
            let step = m.push(p);
            out.push_str(&step.emit);
            if step.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn match_across_pieces_is_excluded() {
        assert_eq!(run(&["\n\n"], &["Hello", "\n", "\nWorld"]), ("Hello".to_string(), true));
        assert_eq!(run(&["STOP"], &["abS", "T", "OPxyz"]), ("ab".to_string(), true));
    }

    #[test]
    fn partial_prefix_is_held_then_released() {
        let mut m = StopMatcher::new(&stops(&["END"]));
        assert_eq!(m.push("fooE").emit, "foo");
        assert_eq!(m.push("N").emit, "");
        // "ENx" is not "END": all of it is released.
        assert_eq!(m.push("x").emit, "ENx");
        assert_eq!(m.push("E").emit, "");
        assert_eq!(m.finish(), "E");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        assert_eq!(run(&["cd", "b"], &["abcd"]), ("a".to_string(), true));
    }

    #[test]
    fn no_stops_releases_everything_at_once() {
        let mut m = StopMatcher::new(&[]);
        assert_eq!(m.push("abc"), StopStep { emit: "abc".into(), stopped: false });
    }

    #[test]
    fn multibyte_text_is_split_on_char_boundaries() {
        assert_eq!(run(&["é!"], &["caf", "é", "é!"]), ("café".to_string(), true));
        assert_eq!(run(&["日本"], &["今日", "日"]), ("今日日".to_string(), false));
    }

    proptest! {
        /// However the text is cut into pieces, the released text equals the
        /// text up to the first stop string, and a match is found exactly
        /// when the whole text contains one.
        #[test]
        fn streaming_equals_whole_text(
            text in "[ab\n]{0,40}",
            stop in "[ab\n]{1,4}",
            cuts in proptest::collection::vec(0usize..41, 0..8),
        ) {
            let mut cuts: Vec<usize> = cuts.into_iter().filter(|&c| c <= text.len()).collect();
            cuts.sort_unstable();
            let mut pieces = Vec::new();
            let mut last = 0;
            for c in cuts {
                pieces.push(&text[last..c]);
                last = c;
            }
            pieces.push(&text[last..]);
            let (got, stopped) = run(&[stop.as_str()], &pieces);
            match text.find(&stop) {
                Some(at) => { prop_assert!(stopped); prop_assert_eq!(got, &text[..at]); }
                None => { prop_assert!(!stopped); prop_assert_eq!(got, text.clone()); }
            }
        }
    }
}
