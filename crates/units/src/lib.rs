//! Typed units shared by every corridor layer.
//!
//! A bare integer could mean bytes, tokens or pages; these newtypes make the
//! meaning part of the type so the compiler catches a page count passed where a
//! byte count was expected. Bytes print as MiB because that is the unit people
//! read memory in.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::{Add, AddAssign, Sub, SubAssign};

/// A count of bytes (device or host memory).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Bytes(pub u64);

impl Bytes {
    pub const ZERO: Bytes = Bytes(0);
    pub const KIB: u64 = 1024;
    pub const MIB: u64 = 1024 * 1024;
    pub const GIB: u64 = 1024 * 1024 * 1024;

    pub const fn mib(n: u64) -> Bytes {
        Bytes(n * Self::MIB)
    }
    pub const fn gib(n: u64) -> Bytes {
        Bytes(n * Self::GIB)
    }
    pub const fn get(self) -> u64 {
        self.0
    }
    /// The value in MiB as a float, for display.
    pub fn as_mib_f64(self) -> f64 {
        self.0 as f64 / Self::MIB as f64
    }
    pub fn saturating_sub(self, rhs: Bytes) -> Bytes {
        Bytes(self.0.saturating_sub(rhs.0))
    }
    pub fn checked_sub(self, rhs: Bytes) -> Option<Bytes> {
        self.0.checked_sub(rhs.0).map(Bytes)
    }
    /// Round up to a multiple of `granule` (which must be non-zero).
    pub fn round_up(self, granule: Bytes) -> Bytes {
        assert!(granule.0 > 0, "granule must be non-zero");
        Bytes(self.0.div_ceil(granule.0) * granule.0)
    }
    /// Round down to a multiple of `granule` (which must be non-zero).
    pub fn round_down(self, granule: Bytes) -> Bytes {
        assert!(granule.0 > 0, "granule must be non-zero");
        Bytes(self.0 / granule.0 * granule.0)
    }
    /// Parse sizes such as `32GiB`, `20GB`, `512MiB`, `1024` (bytes).
    pub fn parse_size(text: &str) -> Result<Bytes, String> {
        let t = text.trim();
        let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let value: f64 = num.parse().map_err(|_| format!("invalid size '{text}'"))?;
        let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1.0,
            "k" | "kib" => 1024.0,
            "kb" => 1e3,
            "m" | "mib" => 1024.0 * 1024.0,
            "mb" => 1e6,
            "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
            "gb" => 1e9,
            "t" | "tib" => 1024.0f64.powi(4),
            "tb" => 1e12,
            other => {
                return Err(format!("unknown size unit '{other}' in '{text}' (use B, MiB, GiB, MB, GB)"))
            }
        };
        if !value.is_finite() || value < 0.0 {
            return Err(format!("invalid size '{text}'"));
        }
        Ok(Bytes((value * mult).round() as u64))
    }
}

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.1} MiB", self.as_mib_f64())
    }
}

impl Add for Bytes {
    type Output = Bytes;
    fn add(self, rhs: Bytes) -> Bytes {
        Bytes(self.0 + rhs.0)
    }
}
impl AddAssign for Bytes {
    fn add_assign(&mut self, rhs: Bytes) {
        self.0 += rhs.0;
    }
}
impl Sub for Bytes {
    type Output = Bytes;
    fn sub(self, rhs: Bytes) -> Bytes {
        Bytes(self.0.checked_sub(rhs.0).expect("Bytes subtraction underflow"))
    }
}
impl SubAssign for Bytes {
    fn sub_assign(&mut self, rhs: Bytes) {
        *self = *self - rhs;
    }
}
impl std::iter::Sum for Bytes {
    fn sum<I: Iterator<Item = Bytes>>(iter: I) -> Bytes {
        Bytes(iter.map(|b| b.0).sum())
    }
}

/// A count of tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Tokens(pub usize);

impl Tokens {
    pub const fn get(self) -> usize {
        self.0
    }
    /// How many pages of `page_size` tokens hold this many tokens.
    pub fn pages(self, page_size: Tokens) -> Pages {
        Pages(self.0.div_ceil(page_size.0))
    }
}
impl fmt::Display for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} tokens", self.0)
    }
}
impl Add for Tokens {
    type Output = Tokens;
    fn add(self, rhs: Tokens) -> Tokens {
        Tokens(self.0 + rhs.0)
    }
}
impl Sub for Tokens {
    type Output = Tokens;
    fn sub(self, rhs: Tokens) -> Tokens {
        Tokens(self.0 - rhs.0)
    }
}

/// A count of KV pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Pages(pub usize);

impl Pages {
    pub const fn get(self) -> usize {
        self.0
    }
    pub fn tokens(self, page_size: Tokens) -> Tokens {
        Tokens(self.0 * page_size.0)
    }
}
impl fmt::Display for Pages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} pages", self.0)
    }
}

/// The index of one KV page inside a card's arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PageId(pub u32);

impl PageId {
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}
impl fmt::Display for PageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "page#{}", self.0)
    }
}

/// The index of one sequence's recurrent-state slot (the fixed-size state a
/// linear-attention layer carries in place of a growing KV cache).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct StateSlot(pub u32);

impl StateSlot {
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}
impl fmt::Display for StateSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "state#{}", self.0)
    }
}

/// A card (one device: a GPU, a simulated card, or the host) as corridor numbers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CardId(pub u32);

impl fmt::Display for CardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "card{}", self.0)
    }
}

/// A rank inside a parallel layout (a TP shard or a PP stage).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Rank(pub u32);

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank{}", self.0)
    }
}

/// One generation request as the engine numbers it, from submission to its
/// last event: the key of its sequence in the scheduler and of its sampler
/// state in the engine loop.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestId(pub u64);

impl RequestId {
    pub const fn get(self) -> u64 {
        self.0
    }
}
impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req#{}", self.0)
    }
}

/// A token id in a tokenizer's vocabulary. The engine and the model carry
/// these; they become bare `u32` only where they are handed to a kernel or
/// uploaded to a device ([`TokenId::as_u32_slice`]), and are made from the
/// tokenizer's `u32` once, where a request enters the engine.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TokenId(pub u32);

impl TokenId {
    pub const fn get(self) -> u32 {
        self.0
    }
    /// The id as an index into a vocabulary-wide row (logits, embeddings).
    pub const fn index(self) -> usize {
        self.0 as usize
    }
    /// The ids as the `u32` a kernel or a device upload reads, without a copy.
    pub fn as_u32_slice(ids: &[TokenId]) -> &[u32] {
        // SAFETY: TokenId is #[repr(transparent)] over u32, so a slice of
        // them has the layout (size, alignment, stride) of a slice of u32 of
        // the same length, and every u32 is a valid TokenId and vice versa.
        unsafe { std::slice::from_raw_parts(ids.as_ptr().cast::<u32>(), ids.len()) }
    }
    /// Tokenizer output as ids, without a copy (the reverse of
    /// [`TokenId::as_u32_slice`]).
    pub fn from_u32_slice(ids: &[u32]) -> &[TokenId] {
        // SAFETY: as in `as_u32_slice`: the same layout, every value valid.
        unsafe { std::slice::from_raw_parts(ids.as_ptr().cast::<TokenId>(), ids.len()) }
    }
    /// Tokenizer output as an owned vector of ids.
    pub fn vec(ids: &[u32]) -> Vec<TokenId> {
        ids.iter().copied().map(TokenId).collect()
    }
}
impl fmt::Display for TokenId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}
impl From<TokenId> for u32 {
    fn from(t: TokenId) -> u32 {
        t.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes() {
        assert_eq!(Bytes::parse_size("32GiB").unwrap(), Bytes::gib(32));
        assert_eq!(Bytes::parse_size("20GB").unwrap(), Bytes(20_000_000_000));
        assert_eq!(Bytes::parse_size("512MiB").unwrap(), Bytes::mib(512));
        assert_eq!(Bytes::parse_size("1024").unwrap(), Bytes(1024));
        assert!(Bytes::parse_size("12 parsecs").is_err());
        assert!(Bytes::parse_size("").is_err());
    }

    #[test]
    fn rounds_and_displays() {
        assert_eq!(Bytes(3).round_up(Bytes(2)), Bytes(4));
        assert_eq!(Bytes(3).round_down(Bytes(2)), Bytes(2));
        assert_eq!(Bytes::mib(3).to_string(), "3.0 MiB");
        assert_eq!(Tokens(17).pages(Tokens(16)), Pages(2));
        assert_eq!(Pages(2).tokens(Tokens(16)), Tokens(32));
    }

    #[test]
    fn ids_name_themselves() {
        assert_eq!(RequestId(7).to_string(), "req#7");
        assert_eq!(RequestId(7).get(), 7);
        assert_eq!(PageId(3).to_string(), "page#3");
        assert_eq!(TokenId(42).to_string(), "42", "a token id prints as the tokenizer's number");
    }

    #[test]
    fn token_slices_cast_both_ways_in_place() {
        let ids = [TokenId(3), TokenId(0), TokenId(u32::MAX)];
        let raw = TokenId::as_u32_slice(&ids);
        assert_eq!(raw, [3, 0, u32::MAX]);
        assert_eq!(raw.as_ptr() as usize, ids.as_ptr() as usize, "no copy");
        assert_eq!(TokenId::from_u32_slice(raw), ids);
        assert_eq!(TokenId::vec(raw), ids);
        assert!(TokenId::as_u32_slice(&[]).is_empty());
    }

    #[test]
    #[should_panic(expected = "underflow")]
    fn subtraction_underflow_is_loud() {
        let _ = Bytes(1) - Bytes(2);
    }
}
