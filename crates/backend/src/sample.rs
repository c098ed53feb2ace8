//! What [`crate::Backend::sample_rows`] takes and returns: the per-row draw
//! of a decode step done where the logits are, so only a few numbers per row
//! cross to the host instead of a whole vocabulary row.
//!
//! The backend knows nothing of requests: the host turns each row's
//! parameters and history into a [`SampleRowSpec`] (temperature, truncation,
//! the row's one uniform draw) and a sparse list of [`LogitEdit`]s (one per
//! token the penalties, `logit_bias` or the masks touch), and checks the
//! [`RowSummary`] that comes back with the same fallback rules as a row
//! sampled on the host. The candidate rules are those of the engine's
//! reference draw (`corridor_engine::sampling::kernel`); the semantics are
//! restated at each field so a backend can implement them from here.

/// `token` of a [`RowSummary`] when the draw chose nothing, and `argmax`
/// when every adjusted logit is -inf.
pub const NO_TOKEN: u32 = u32::MAX;

/// The most edits one row may bring: a backend's
/// [`crate::Backend::reserve_sample_rows`] makes room for this many per row,
/// and the host sends a row with more (a long prompt under a repetition
/// penalty is one edit per distinct token) to its own sampler instead.
pub const MAX_EDITS_PER_ROW: usize = 8192;

/// One token's adjustments, applied after sanitizing (NaN → -inf,
/// +inf → `f32::MAX`) in this order, each result kept in the sanitized
/// domain by `settle` (NaN → -inf, +inf → `f32::MAX`):
/// 1. `v = settle(v > 0 ? v / rep : v * rep)` (`rep` is 1 when the
///    repetition penalty does not apply to the token, which leaves `v` as it is),
/// 2. `v = settle(v - sub)` (frequency and presence penalties),
/// 3. `v = settle(v + bias)` when `flags` has [`EDIT_BIAS`] (`logit_bias`,
///    already clamped; a flag rather than a zero bias, since `-0 + 0` is `+0`
///    and the rank order tells the two zeros apart),
/// 4. `v = -inf` when `flags` has [`EDIT_MASK`].
///
/// A row's edits name each token at most once; tokens outside the
/// vocabulary are never listed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct LogitEdit {
    pub token: u32,
    pub rep: f32,
    pub sub: f32,
    pub bias: f32,
    pub flags: u32,
}

/// [`LogitEdit::flags`]: the token is masked (set to -inf last).
pub const EDIT_MASK: u32 = 1;
/// [`LogitEdit::flags`]: `bias` is added.
pub const EDIT_BIAS: u32 = 2;

/// How to draw one row.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SampleRowSpec {
    /// The row of the logits buffer this row reads (and adjusts in place).
    pub row: u32,
    /// The row's edits: `edits[edits_start..edits_start + edits_len]`.
    pub edits_start: u32,
    pub edits_len: u32,
    /// Keep at most this many tokens; 0 keeps all.
    pub top_k: u32,
    /// 0 draws the argmax (the first largest adjusted logit).
    pub temperature: f32,
    /// `1 / temperature` in f32, as the host computes it, so both sides
    /// weigh a token by the same `exp((l - max) * inv_t)`.
    pub inv_t: f32,
    /// Nucleus mass in `(0, 1]`; 1 disables it.
    pub top_p: f32,
    /// Relative floor in `[0, 1]`; 0 disables it.
    pub min_p: f32,
    /// The row's one uniform draw in `[0, 1)`.
    pub uniform: f64,
}

/// What became of one row: everything the host's fallback rules need.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct RowSummary {
    /// The drawn token, or [`NO_TOKEN`] when the draw found no candidate.
    pub token: u32,
    /// The first largest adjusted logit (what a broken or failed row falls
    /// back to; it respects the masks), or [`NO_TOKEN`] when every adjusted
    /// logit is -inf.
    pub argmax: u32,
    /// Model logits that were NaN.
    pub nan: u32,
    /// Model logits that were +inf.
    pub pos_inf: u32,
    /// The adjusted logit of `token` (bits of an f32), so the host can
    /// refuse a masked token.
    pub value_bits: u32,
    /// [`ROW_DRAWN`], or [`ROW_TOO_MANY_CANDIDATES`]: the candidate set
    /// did not fit the device's draw, and the row's adjusted logits were
    /// copied out for the host to draw from.
    pub status: u32,
}

/// [`RowSummary::status`]: the row was drawn on the device.
pub const ROW_DRAWN: u32 = 0;
/// [`RowSummary::status`]: the row's candidates did not fit; its adjusted
/// logits are in the op's spill output.
pub const ROW_TOO_MANY_CANDIDATES: u32 = 1;

impl RowSummary {
    /// The adjusted logit of the drawn token.
    pub fn value(&self) -> f32 {
        f32::from_bits(self.value_bits)
    }
    /// The drawn token, if the draw found one.
    pub fn drawn(&self) -> Option<u32> {
        (self.token != NO_TOKEN).then_some(self.token)
    }
    /// The fallback argmax, if any adjusted logit is finite.
    pub fn fallback_argmax(&self) -> Option<u32> {
        (self.argmax != NO_TOKEN).then_some(self.argmax)
    }
    /// Whether the model's row held NaN or +inf.
    pub fn is_broken(&self) -> bool {
        self.nan > 0 || self.pos_inf > 0
    }
}

/// The result of [`crate::Backend::sample_rows`].
#[derive(Clone, Debug, Default)]
pub struct SampledRows {
    /// One summary per spec, in spec order.
    pub rows: Vec<RowSummary>,
    /// `[spilled rows, vocab]`: the sanitized, adjusted logits of every row
    /// whose status is [`ROW_TOO_MANY_CANDIDATES`], in spec order.
    pub spill: Vec<f32>,
}
