//! Constrained decoding: a per-request grammar that says which tokens may
//! come next.
//!
//! The engine knows no grammar language; a request carries a
//! [`TokenConstraint`] (the server builds them, from JSON schemas) and the
//! engine asks it for a [`TokenMask`] before each of the request's tokens and
//! tells it the token that was chosen. The mask is applied in the sampler
//! after the request's own adjustments (penalties, `logit_bias`,
//! `min_tokens`), by setting every disallowed logit to -inf. Every fallback
//! rule of the sampler then holds for the allowed tokens only: a row whose
//! draw fails, or whose logits were NaN, gets the argmax of the *allowed*
//! tokens, and a row with no allowed finite logit fails that request alone.
//!
//! A mask that cannot be computed (the grammar is in an error state) ends
//! the request with an error rather than letting it continue unconstrained.

use corridor_units::TokenId;

/// Which token ids may come next: one bit per id, 32 ids a word.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
}

impl TokenMask {
    /// Nothing allowed, for a vocabulary of `vocab` ids.
    pub fn none(vocab: usize) -> TokenMask {
        TokenMask { words: vec![0; vocab.div_ceil(32)] }
    }

    /// From packed words (bit `i % 32` of word `i / 32` allows id `i`), the
    /// layout grammar engines use.
    pub fn from_words(words: Vec<u32>) -> TokenMask {
        TokenMask { words }
    }

    pub fn allow(&mut self, id: TokenId) {
        let (w, b) = (id.index() / 32, id.get() % 32);
        if let Some(word) = self.words.get_mut(w) {
            *word |= 1 << b;
        }
    }

    pub fn allows(&self, id: TokenId) -> bool {
        self.words.get(id.index() / 32).is_some_and(|w| w >> (id.get() % 32) & 1 == 1)
    }

    /// How many ids are allowed.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Sets every disallowed logit of `row` to -inf. Ids past the mask's
    /// width are disallowed.
    pub fn apply(&self, row: &mut [f32]) {
        for (w, chunk) in row.chunks_mut(32).enumerate() {
            let word = self.words.get(w).copied().unwrap_or(0);
            // Most words of a grammar's mask are all-allowed or all-masked
            // (whole stretches of the vocabulary); those need no bit tests.
            if word == u32::MAX {
                continue;
            }
            if word == 0 {
                chunk.fill(f32::NEG_INFINITY);
                continue;
            }
            for (b, v) in chunk.iter_mut().enumerate() {
                if word >> b & 1 == 0 {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// A constraint failed; the request ends with this message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("constrained decoding failed: {0}")]
pub struct ConstraintError(pub String);

/// A grammar's state for one sequence.
pub trait TokenConstraint: Send {
    /// The tokens allowed next, over a vocabulary of `vocab` ids. End of
    /// sequence is allowed exactly when the grammar is complete.
    fn mask(&mut self, vocab: usize) -> Result<TokenMask, ConstraintError>;
    /// Advances by the chosen token (never called with an end-of-sequence
    /// token: the request ends there).
    fn accept(&mut self, token: TokenId) -> Result<(), ConstraintError>;
    /// A fresh copy in the same state, for another choice of the request.
    fn fork(&self) -> Box<dyn TokenConstraint>;
}

/// The constraint a request carries; cloning forks it.
pub struct Constraint(pub Box<dyn TokenConstraint>);

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Constraint(self.0.fork())
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_bits_and_apply() {
        let mut m = TokenMask::none(70);
        m.allow(TokenId(0));
        m.allow(TokenId(33));
        m.allow(TokenId(69));
        m.allow(TokenId(500)); // past the width: ignored
        assert!(m.allows(TokenId(33)) && !m.allows(TokenId(34)) && !m.allows(TokenId(500)));
        assert_eq!(m.count(), 3);
        let mut row = vec![1.0f32; 72];
        m.apply(&mut row);
        let kept: Vec<usize> =
            row.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(i, _)| i).collect();
        assert_eq!(kept, vec![0, 33, 69]);
    }
}
