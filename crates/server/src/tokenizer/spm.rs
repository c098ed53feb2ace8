//! SentencePiece BPE from GGUF metadata (`tokenizer.ggml.model == "llama"`:
//! Llama 2, Mistral v0.1, TinyLlama, Phi-3).
//!
//! The vocabulary carries a score per piece and no merge list: encoding
//! starts from single characters and repeatedly joins the adjacent pair
//! whose joined text is a piece with the highest score (the leftmost pair
//! among equal scores), until no adjacent pair forms a piece. A character
//! that never became part of a piece is written as its UTF-8 bytes, each as
//! the byte-fallback piece `<0xNN>`. Spaces are written as U+2581, and one
//! space is put in front of every run of text that starts the input or
//! follows a special token (`add_space_prefix`, on unless the metadata says
//! otherwise), the way llama.cpp and SentencePiece do; decoding takes that
//! one leading space away again.
//!
//! Special pieces (control, user-defined and unknown) are recognized as
//! whole strings in the text before any of this, longest first.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// The space marker SentencePiece writes for ' '.
const SPACE_MARK: char = '\u{2581}';

/// GGUF token types (llama.cpp's `llama_token_type`).
pub(super) mod token_type {
    pub const NORMAL: u64 = 1;
    pub const UNKNOWN: u64 = 2;
    pub const CONTROL: u64 = 3;
    pub const USER_DEFINED: u64 = 4;
    pub const UNUSED: u64 = 5;
    pub const BYTE: u64 = 6;
}

/// What a piece is, for encoding and decoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Ordinary text; merges may produce it.
    Normal,
    /// Matched only as a whole string in the text; decodes to its text.
    UserDefined,
    /// Control tokens (BOS, EOS...): matched whole, left out by skip_special.
    Control,
    /// The unknown piece: matched whole, decodes like SentencePiece's " ⁇ ".
    Unknown,
    /// `<0xNN>`: one raw byte.
    Byte(u8),
    /// Never produced by encoding; decodes to its text.
    Unused,
}

/// A SentencePiece vocabulary ready to encode and decode.
#[derive(Debug)]
pub(super) struct Spm {
    pieces: Vec<String>,
    scores: Vec<f32>,
    kinds: Vec<Kind>,
    /// Pieces merging may produce, by text.
    mergeable: HashMap<String, u32>,
    /// Every piece by text (the last of duplicated strings wins, like llama.cpp).
    by_text: HashMap<String, u32>,
    byte_ids: [Option<u32>; 256],
    /// Special pieces matched in the text, longest first, and whether the
    /// whitespace after one is dropped (`rstrip`).
    specials: Vec<(String, u32, bool)>,
    /// For each first byte, the indices into `specials` that start with it
    /// (still longest first), so a scan looks only at candidates.
    specials_by_first_byte: Vec<Vec<usize>>,
    unk_id: Option<u32>,
    add_space_prefix: bool,
}

/// A vocabulary as read from GGUF metadata.
pub(super) struct SpmVocab<'a> {
    pub pieces: &'a [&'a str],
    pub scores: &'a [f32],
    /// `None` treats every piece as normal text.
    pub types: Option<&'a [u64]>,
    pub unk_id: Option<u32>,
    pub add_space_prefix: bool,
    /// Phi-3's special pieces swallow the whitespace after them (llama.cpp
    /// recognizes these files by their `general.name`), except `<unk>`,
    /// `<s>` and `<|endoftext|>`.
    pub rstrip_specials: bool,
}

/// One candidate merge of two adjacent symbols.
#[derive(Debug)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the joined text, to notice a stale entry.
    len: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// The heap pops the highest score first, and the leftmost pair on ties.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.left.cmp(&self.left))
    }
}

/// A run of the text during merging: `start..start + len` bytes, linked to
/// its neighbours (a merged-away symbol has `len == 0`).
#[derive(Clone, Copy, Debug)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    /// Builds the vocabulary; `types`, when present, has one entry per piece
    /// (the caller checks the lengths).
    pub fn new(vocab: &SpmVocab<'_>) -> Spm {
        let n = vocab.pieces.len();
        let mut kinds = Vec::with_capacity(n);
        let mut mergeable = HashMap::with_capacity(n);
        let mut by_text = HashMap::with_capacity(n);
        let mut byte_ids = [None; 256];
        let mut specials = Vec::new();
        for (id, piece) in vocab.pieces.iter().enumerate() {
            let id = id as u32;
            let ty = vocab.types.map_or(token_type::NORMAL, |t| t[id as usize]);
            let kind = match ty {
                token_type::UNKNOWN => Kind::Unknown,
                token_type::CONTROL => Kind::Control,
                token_type::USER_DEFINED => Kind::UserDefined,
                token_type::UNUSED => Kind::Unused,
                token_type::BYTE => match super::byte_fallback_token(piece) {
                    Some(b) => Kind::Byte(b),
                    None => Kind::Normal,
                },
                _ => Kind::Normal,
            };
            match kind {
                Kind::Normal => {
                    mergeable.insert(piece.to_string(), id);
                }
                Kind::Byte(b) => byte_ids[b as usize] = Some(id),
                Kind::Control | Kind::UserDefined | Kind::Unknown if !piece.is_empty() => {
                    let rstrip =
                        vocab.rstrip_specials && !matches!(*piece, "<unk>" | "<s>" | "<|endoftext|>");
                    specials.push((piece.to_string(), id, rstrip));
                }
                _ => {}
            }
            by_text.insert(piece.to_string(), id);
            kinds.push(kind);
        }
        // Without token types, byte pieces are still recognized by their form.
        if vocab.types.is_none() {
            for (id, piece) in vocab.pieces.iter().enumerate() {
                if let Some(b) = super::byte_fallback_token(piece) {
                    byte_ids[b as usize] = Some(id as u32);
                    kinds[id] = Kind::Byte(b);
                    mergeable.remove(*piece);
                }
            }
        }
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let mut specials_by_first_byte = vec![Vec::new(); 256];
        for (i, (piece, _, _)) in specials.iter().enumerate() {
            specials_by_first_byte[piece.as_bytes()[0] as usize].push(i);
        }
        let mut scores = vocab.scores.to_vec();
        scores.resize(n, 0.0);
        Spm {
            pieces: vocab.pieces.iter().map(|p| p.to_string()).collect(),
            scores,
            kinds,
            mergeable,
            by_text,
            byte_ids,
            specials,
            specials_by_first_byte,
            unk_id: vocab.unk_id,
            add_space_prefix: vocab.add_space_prefix,
        }
    }

    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.by_text.get(text).copied()
    }

    /// Whether `id` is a control token (left out when skipping specials).
    pub fn is_control(&self, id: u32) -> bool {
        self.kinds.get(id as usize) == Some(&Kind::Control)
    }

    /// Encodes text, recognizing special pieces written in it.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let (plain, special) = self.next_special(rest);
            // Every run of plain text starts the input or follows a special
            // piece, so each gets the space prefix.
            if !plain.is_empty() {
                let mut escaped = String::with_capacity(plain.len() + 3);
                if self.add_space_prefix {
                    escaped.push(SPACE_MARK);
                }
                escaped.extend(plain.chars().map(|c| if c == ' ' { SPACE_MARK } else { c }));
                self.encode_run(&escaped, &mut out);
            }
            match special {
                Some((id, len, rstrip)) => {
                    out.push(id);
                    rest = &rest[plain.len() + len..];
                    if rstrip {
                        // C's isspace: space, \t, \n, \v, \f, \r.
                        rest = rest.trim_start_matches([' ', '\t', '\n', '\x0b', '\x0c', '\r']);
                    }
                }
                None => break,
            }
        }
        out
    }

    /// Splits `text` at the first special piece: the plain text before it,
    /// and the piece's id, byte length (longest match at that position) and
    /// whether it swallows the whitespace after it.
    fn next_special<'t>(&self, text: &'t str) -> (&'t str, Option<(u32, usize, bool)>) {
        if self.specials.is_empty() {
            return (text, None);
        }
        for (at, _) in text.char_indices() {
            let tail = &text[at..];
            let candidates = &self.specials_by_first_byte[tail.as_bytes()[0] as usize];
            let found =
                candidates.iter().map(|&i| &self.specials[i]).find(|(p, _, _)| tail.starts_with(p.as_str()));
            if let Some((piece, id, rstrip)) = found {
                return (&text[..at], Some((*id, piece.len(), *rstrip)));
            }
        }
        (text, None)
    }

    /// The score-ordered merge over one run of escaped text.
    fn encode_run(&self, text: &str, out: &mut Vec<u32>) {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            symbols.push(Symbol { start, len: c.len_utf8(), prev: i.checked_sub(1), next: Some(i + 1) });
        }
        let Some(last) = symbols.last_mut() else {
            return;
        };
        last.next = None;

        let mut heap = BinaryHeap::new();
        let try_pair = |heap: &mut BinaryHeap<Bigram>, symbols: &[Symbol], left: usize, right: usize| {
            let (l, r) = (symbols[left], symbols[right]);
            let joined = &text[l.start..r.start + r.len];
            if let Some(&id) = self.mergeable.get(joined) {
                heap.push(Bigram { score: self.scores[id as usize], left, right, len: joined.len() });
            }
        };
        for i in 1..symbols.len() {
            try_pair(&mut heap, &symbols, i - 1, i);
        }
        while let Some(bigram) = heap.pop() {
            let (l, r) = (symbols[bigram.left], symbols[bigram.right]);
            // An entry is stale once either side has changed since it was queued.
            if l.len == 0 || r.len == 0 || l.len + r.len != bigram.len || l.next != Some(bigram.right) {
                continue;
            }
            symbols[bigram.left].len += r.len;
            symbols[bigram.left].next = r.next;
            symbols[bigram.right].len = 0;
            if let Some(next) = r.next {
                symbols[next].prev = Some(bigram.left);
            }
            if let Some(prev) = symbols[bigram.left].prev {
                try_pair(&mut heap, &symbols, prev, bigram.left);
            }
            if let Some(next) = symbols[bigram.left].next {
                try_pair(&mut heap, &symbols, bigram.left, next);
            }
        }

        let mut at = Some(0);
        while let Some(i) = at {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match self.mergeable.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for b in piece.bytes() {
                        out.extend(self.byte_ids[b as usize].or(self.unk_id));
                    }
                }
            }
            at = s.next;
        }
    }

    /// The bytes one piece stands for (U+2581 as a space).
    pub fn piece_bytes(&self, id: u32) -> Vec<u8> {
        let Some(piece) = self.pieces.get(id as usize) else {
            return Vec::new();
        };
        match self.kinds[id as usize] {
            Kind::Byte(b) => vec![b],
            Kind::Unknown => " \u{2047} ".as_bytes().to_vec(),
            Kind::Control => piece.as_bytes().to_vec(),
            Kind::Normal | Kind::UserDefined | Kind::Unused => piece.replace(SPACE_MARK, " ").into_bytes(),
        }
    }

    /// Decodes ids (the caller has checked they are in range); the space
    /// put in front of the text by encoding is taken away again.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut bytes = Vec::new();
        let mut first = true;
        for &id in ids {
            let control = self.is_control(id);
            if control && skip_special {
                continue;
            }
            let piece = self.piece_bytes(id);
            let strip = first && self.add_space_prefix && !control && piece.first() == Some(&b' ');
            bytes.extend_from_slice(if strip { &piece[1..] } else { &piece });
            first = false;
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pieces: bytes for 'a'..'c' are missing on purpose so fallback shows.
    fn vocab(add_space_prefix: bool) -> Spm {
        let pieces = [
            "<unk>",
            "<s>",
            "</s>",
            "<0x61>",
            "<0xC3>",
            "<0xA9>",
            "\u{2581}",
            "a",
            "b",
            "ab",
            "\u{2581}ab",
            "bb",
        ];
        let scores = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -3.0, -4.0, -2.5];
        let types = [2, 3, 3, 6, 6, 6, 1, 1, 1, 1, 1, 1];
        Spm::new(&SpmVocab {
            pieces: &pieces,
            scores: &scores,
            types: Some(&types),
            unk_id: Some(0),
            add_space_prefix,
            rstrip_specials: false,
        })
    }

    #[test]
    fn merges_by_score_and_prefixes_a_space() {
        let spm = vocab(true);
        // "▁ab": ▁+a is not a piece; a+b (-3) forms, then ▁+ab (-4).
        assert_eq!(spm.encode("ab"), [10]);
        // "abb": b+b (-2.5) outranks a+b (-3), leaving a and bb.
        assert_eq!(spm.encode("abb"), [6, 7, 11]);
        assert_eq!(spm.decode(&[10], false), "ab");
        assert_eq!(spm.decode(&[6, 7, 11], false), "abb");
        assert_eq!(spm.encode(""), Vec::<u32>::new());
    }

    #[test]
    fn equal_scores_merge_the_leftmost_pair() {
        let spm = vocab(false);
        // b+b at 0 and at 1 tie; the left one wins, leaving "bb" + "b".
        assert_eq!(spm.encode("bbb"), [11, 8]);
    }

    #[test]
    fn unknown_characters_fall_back_to_bytes() {
        let spm = vocab(false);
        // 'é' is not a piece: its two UTF-8 bytes are.
        assert_eq!(spm.encode("é"), [4, 5]);
        assert_eq!(spm.decode(&[4, 5], false), "é");
        // A byte without a piece becomes <unk>.
        assert_eq!(spm.encode("z"), [0]);
    }

    #[test]
    fn special_pieces_split_the_text_and_restart_the_space_prefix() {
        let spm = vocab(true);
        assert_eq!(spm.encode("<s>ab</s>ab"), [1, 10, 2, 10]);
        assert_eq!(spm.decode(&[1, 10, 2], true), "ab");
        assert_eq!(spm.decode(&[1, 10, 2], false), "<s> ab</s>");
    }
}
