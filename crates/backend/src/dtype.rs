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

use std::fmt;

/// The element type of a stored tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
}

/// Elements per quantization block for the block-quantized types.
pub const QK: usize = 32;

impl DType {
    /// Elements per block (1 for the plain float types).
    pub const fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => QK,
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
        }
    }
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
