//! Storage types of weights and the block layouts of the quantized ones.
//!
//! Quantized types follow the GGUF (ggml) block formats bit for bit, so a GGUF
//! file's tensor bytes are used as they are, memory-mapped, never widened:
//! - `Q8_0`: 32 weights per 34-byte block: f16 scale `d`, 32 × i8; `w = d·q`.
//! - `Q4_0`: 32 weights per 18-byte block: f16 scale `d`, 16 bytes of nibbles;
//!   weight `j < 16` is the low nibble of byte `j`, weight `j + 16` the high
//!   nibble; `w = d·(q − 8)`.
//! - `Q4_1`: 32 weights per 20-byte block: f16 `d`, f16 `m`, 16 bytes of
//!   nibbles laid out as in `Q4_0`; `w = d·q + m`.
//! - `Q5_0` / `Q5_1`: as `Q4_0` / `Q4_1` with a fifth bit per weight in a
//!   32-bit mask after the scale(s) (bit `j` for weight `j`); 22 / 24 bytes;
//!   `w = d·(q − 16)` / `w = d·q + m`.
//! - `IQ4_NL`: 32 weights per 18-byte block laid out as `Q4_0`, but each
//!   nibble indexes a fixed non-uniform table of 16 levels: `w = d·T[q]`.
//! - The K-quants and `IQ4_XS` use 256-weight super-blocks ([`QK_K`]) made of
//!   sub-blocks of 16 or 32 weights, each sub-block with a small integer scale
//!   (and for `Q2_K`, `Q4_K`, `Q5_K` a small integer min) that is itself scaled
//!   by the super-block's f16 `d` (and `dmin`): `Q2_K` 84 bytes, `Q3_K` 110,
//!   `Q4_K` 144, `Q5_K` 176, `Q6_K` 210, `IQ4_XS` 136. The exact bit layouts
//!   are documented beside their decoders in `cpu/quant.rs`.

use std::fmt;

/// The element type of a stored tensor (named as ggml names them).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    IQ4_NL,
    IQ4_XS,
}

/// Elements per quantization block for the 32-element block types.
pub const QK: usize = 32;
/// Elements per super-block of the K-quants and `IQ4_XS`.
pub const QK_K: usize = 256;

impl DType {
    /// Elements per block (1 for the plain float types).
    pub const fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::IQ4_NL => QK,
            DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K | DType::IQ4_XS => QK_K,
        }
    }
    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::IQ4_NL => 18,
            DType::Q2_K => 84,
            DType::Q3_K => 110,
            DType::Q4_K => 144,
            DType::Q5_K => 176,
            DType::Q6_K => 210,
            DType::IQ4_XS => 136,
        }
    }
    /// Every storage type, for tests and tables.
    pub const ALL: [DType; 15] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::IQ4_NL,
        DType::IQ4_XS,
    ];
    /// Every block format (the storage types of `ALL` but the three floats).
    pub const BLOCK_FORMATS: [DType; 12] = [
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::IQ4_NL,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::IQ4_XS,
    ];
    pub const fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }
    /// Bytes needed to store `elems` elements, or `None` when `elems` is not a
    /// whole number of blocks.
    pub fn bytes_for(self, elems: usize) -> Option<usize> {
        if elems % self.block_elems() != 0 {
            return None;
        }
        (elems / self.block_elems()).checked_mul(self.block_bytes())
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q5_0 => "Q5_0",
            DType::Q5_1 => "Q5_1",
            DType::Q2_K => "Q2_K",
            DType::Q3_K => "Q3_K",
            DType::Q4_K => "Q4_K",
            DType::Q5_K => "Q5_K",
            DType::Q6_K => "Q6_K",
            DType::IQ4_NL => "IQ4_NL",
            DType::IQ4_XS => "IQ4_XS",
        };
        f.write_str(s)
    }
}

/// A tensor as read from a checkpoint, before it is placed on a backend.
///
/// `shape` is row-major with the outermost dimension first, the way PyTorch
/// and safetensors write it: a linear layer's weight is `[out_features,
/// in_features]` and each row is contiguous. (GGUF lists dimensions innermost
/// first; its reader reverses them before building this.)
#[derive(Clone)]
pub struct HostTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: TensorBytes,
}

/// Bytes of a tensor inside a shared owner (usually a memory map), so a
/// backend that computes from host memory can keep the mapping instead of
/// copying it.
#[derive(Clone)]
pub struct TensorBytes {
    owner: std::sync::Arc<dyn AsRef<[u8]> + Send + Sync>,
    range: std::ops::Range<usize>,
}

impl TensorBytes {
    /// `range` must lie inside `owner`; this is checked.
    pub fn new(
        owner: std::sync::Arc<dyn AsRef<[u8]> + Send + Sync>,
        range: std::ops::Range<usize>,
    ) -> Option<Self> {
        let len = (*owner).as_ref().len();
        (range.start <= range.end && range.end <= len).then_some(TensorBytes { owner, range })
    }
    /// Own a buffer outright (tests, converted tensors).
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        TensorBytes { owner: std::sync::Arc::new(bytes), range: 0..len }
    }
    pub fn bytes(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.range.clone()]
    }
    pub fn len(&self) -> usize {
        self.range.len()
    }
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }
}

impl fmt::Debug for TensorBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TensorBytes({} bytes)", self.len())
    }
}

impl fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostTensor({} {} {:?})", self.name, self.dtype, self.shape)
    }
}

impl HostTensor {
    pub fn elems(&self) -> usize {
        self.shape.iter().product()
    }
    /// Rows, columns and data bytes as a matrix, checked: every row is whole
    /// blocks of the storage type and the data is exactly that long. Every
    /// backend validates an upload with this before placing it.
    pub fn checked_matrix(&self) -> Result<(usize, usize, usize), crate::BackendError> {
        let (rows, cols) = self.rows_cols();
        let bad = |reason: String| crate::BackendError::BadTensor { name: self.name.clone(), reason };
        let want = rows
            .checked_mul(cols)
            .and_then(|n| self.dtype.bytes_for(n))
            .filter(|_| cols % self.dtype.block_elems() == 0)
            .ok_or_else(|| bad(format!("{} columns are not whole {} blocks", cols, self.dtype)))?;
        if self.data.len() != want {
            return Err(bad(format!(
                "{} bytes of data, {} {:?} needs {}",
                self.data.len(),
                self.dtype,
                self.shape,
                want
            )));
        }
        Ok((rows, cols, want))
    }

    /// Rows and columns when viewed as a matrix: the last dimension is the
    /// columns, everything before it is rows (a vector is one row).
    pub fn rows_cols(&self) -> (usize, usize) {
        let cols = *self.shape.last().unwrap_or(&1);
        let rows = if cols == 0 { 0 } else { self.elems() / cols };
        (rows, cols)
    }
}
