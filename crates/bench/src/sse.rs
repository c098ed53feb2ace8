//! Server-sent events decoding, robust to arbitrary chunk boundaries.
//!
//! An OpenAI stream is a sequence of `data: {...}` events ending with `data: [DONE]`. TCP delivers
//! those bytes in reads that need not line up with events: a read may hold half a line, several
//! events, or stop inside a multi-byte UTF-8 character. The decoder therefore buffers raw bytes until
//! a whole line is present and only then decodes it, so any split of the same bytes yields the same
//! events. Lines end in LF or CRLF; comment lines (`:` first) and fields other than `data` are
//! skipped, as the SSE specification says.

/// Incremental decoder: feed it reads with [`SseDecoder::push`], get back complete event payloads.
#[derive(Debug, Default)]
pub struct SseDecoder {
    /// Bytes of a line whose terminating LF has not arrived yet.
    pending: Vec<u8>,
    /// The `data` of the event being assembled; an event may carry several `data` lines.
    data: Option<String>,
}

impl SseDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feed one read; returns the payloads of every event completed by it, in order.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(chunk);
        let mut events = Vec::new();
        let mut consumed = 0;
        while let Some(at) = self.pending[consumed..].iter().position(|&b| b == b'\n') {
            let end = consumed + at;
            let line =
                self.pending[consumed..end].strip_suffix(b"\r").unwrap_or(&self.pending[consumed..end]);
            let line = line.to_vec();
            consumed = end + 1;
            self.line(&line, &mut events);
        }
        self.pending.drain(..consumed);
        events
    }

    /// The stream has ended: an event whose closing blank line never came is still delivered,
    /// because some servers close the connection right after the last `data:` line.
    pub fn finish(&mut self) -> Vec<String> {
        let mut events = Vec::new();
        let rest = std::mem::take(&mut self.pending);
        let rest = rest.strip_suffix(b"\r").unwrap_or(&rest);
        if !rest.is_empty() {
            self.line(rest, &mut events);
        }
        if let Some(data) = self.data.take() {
            events.push(data);
        }
        events
    }

    fn line(&mut self, line: &[u8], events: &mut Vec<String>) {
        if line.is_empty() {
            // A blank line dispatches the event assembled so far.
            if let Some(data) = self.data.take() {
                events.push(data);
            }
            return;
        }
        if line[0] == b':' {
            return;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &[][..]),
        };
        if field != b"data" {
            return;
        }
        let value = String::from_utf8_lossy(value);
        match &mut self.data {
            Some(data) => {
                data.push('\n');
                data.push_str(&value);
            }
            None => self.data = Some(value.into_owned()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const STREAM: &str = ": keep-alive\r\n\
        data: {\"choices\":[{\"text\":\" h\u{e9}llo\"}]}\r\n\r\n\
        event: message\n\
        data: {\"a\":1}\n\
        data: {\"b\":2}\n\n\
        id: 7\n\n\
        data:{\"no_space\":true}\n\n\
        data: [DONE]\n\n";

    fn expected() -> Vec<String> {
        vec![
            "{\"choices\":[{\"text\":\" h\u{e9}llo\"}]}".to_string(),
            "{\"a\":1}\n{\"b\":2}".to_string(),
            "{\"no_space\":true}".to_string(),
            "[DONE]".to_string(),
        ]
    }

    fn decode_in_pieces(bytes: &[u8], cuts: &[usize]) -> Vec<String> {
        let mut decoder = SseDecoder::new();
        let mut events = Vec::new();
        let mut start = 0;
        for &cut in cuts {
            let cut = cut.clamp(start, bytes.len());
            events.extend(decoder.push(&bytes[start..cut]));
            start = cut;
        }
        events.extend(decoder.push(&bytes[start..]));
        events.extend(decoder.finish());
        events
    }

    #[test]
    fn decodes_whole_stream() {
        assert_eq!(decode_in_pieces(STREAM.as_bytes(), &[]), expected());
    }

    #[test]
    fn decodes_byte_by_byte_including_inside_utf8() {
        let bytes = STREAM.as_bytes();
        let cuts: Vec<usize> = (1..bytes.len()).collect();
        assert_eq!(decode_in_pieces(bytes, &cuts), expected());
    }

    #[test]
    fn delivers_unterminated_last_event_at_end() {
        let mut decoder = SseDecoder::new();
        assert!(decoder.push(b"data: [DONE]").is_empty());
        assert_eq!(decoder.finish(), vec!["[DONE]".to_string()]);
    }

    proptest! {
        #[test]
        fn any_split_gives_the_same_events(mut cuts in proptest::collection::vec(0usize..200, 0..12)) {
            cuts.sort_unstable();
            prop_assert_eq!(decode_in_pieces(STREAM.as_bytes(), &cuts), expected());
        }
    }
}
