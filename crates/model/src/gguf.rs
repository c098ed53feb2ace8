//! A reader for GGUF files (versions 2 and 3), written against the format as
//! llama.cpp writes it.
//!
//! Layout: magic `GGUF`, u32 version, u64 tensor count, u64 metadata count,
//! the metadata key/value pairs, the tensor infos, padding up to
//! `general.alignment` (default 32), then the tensor data. All integers are
//! little-endian; a string is a u64 byte length followed by UTF-8 bytes.
//!
//! The file is memory-mapped once; a tensor handed out is a window into that
//! mapping, so quantized blocks are never copied or widened. Every length and
//! count read from the file is checked against the bytes that remain before
//! anything is allocated for it, so a corrupt count is an error, not an
//! attempt to allocate exabytes.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use corridor_backend::{DType, HostTensor, TensorBytes};

use crate::error::LoadError;

/// The four bytes every GGUF file starts with.
const MAGIC: &[u8; 4] = b"GGUF";
/// Alignment of the data section and of every tensor when the file does not
/// say otherwise.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml never has more than four dimensions; more is a corrupt file.
const MAX_DIMS: u32 = 4;
/// Arrays of arrays exist (rarely); deeper nesting than this is treated as
/// corruption so that a hostile file cannot exhaust the stack.
const MAX_NESTING: usize = 4;

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// Any integer type that holds a non-negative value, widened to u64.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(u64::from(v)),
            GgufValue::U16(v) => Some(u64::from(v)),
            GgufValue::U32(v) => Some(u64::from(v)),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any number (float or integer) as f64; writers disagree on whether
    /// values such as `rope.freq_base` are stored as floats or integers.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(f64::from(v)),
            GgufValue::F64(v) => Some(v),
            GgufValue::I8(v) => Some(f64::from(v)),
            GgufValue::I16(v) => Some(f64::from(v)),
            GgufValue::I32(v) => Some(f64::from(v)),
            // Precision loss above 2^53 is irrelevant for the values read as floats.
            GgufValue::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// The boolean, if this is one.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The elements, if this is an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(items) => Some(items),
            _ => None,
        }
    }

    /// The elements as strings, if this is an array made only of strings.
    pub fn as_string_array(&self) -> Option<Vec<&str>> {
        self.as_array()?.iter().map(GgufValue::as_str).collect()
    }

    /// The name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "u8",
            GgufValue::I8(_) => "i8",
            GgufValue::U16(_) => "u16",
            GgufValue::I16(_) => "i16",
            GgufValue::U32(_) => "u32",
            GgufValue::I32(_) => "i32",
            GgufValue::U64(_) => "u64",
            GgufValue::I64(_) => "i64",
            GgufValue::F32(_) => "f32",
            GgufValue::F64(_) => "f64",
            GgufValue::Bool(_) => "bool",
            GgufValue::String(_) => "string",
            GgufValue::Array(_) => "array",
        }
    }
}

/// The name of a ggml tensor type id, for messages (`"Q4_K"` for 12).
pub fn ggml_type_name(id: u32) -> &'static str {
    match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => "unknown",
    }
}

/// The corridor storage type of a ggml type id, for the types corridor
/// computes with.
pub fn ggml_dtype(id: u32) -> Option<DType> {
    match id {
        0 => Some(DType::F32),
        1 => Some(DType::F16),
        2 => Some(DType::Q4_0),
        3 => Some(DType::Q4_1),
        6 => Some(DType::Q5_0),
        7 => Some(DType::Q5_1),
        8 => Some(DType::Q8_0),
        10 => Some(DType::Q2_K),
        11 => Some(DType::Q3_K),
        12 => Some(DType::Q4_K),
        13 => Some(DType::Q5_K),
        14 => Some(DType::Q6_K),
        20 => Some(DType::IQ4_NL),
        23 => Some(DType::IQ4_XS),
        30 => Some(DType::BF16),
        _ => None,
    }
}

/// Where one tensor lives in the file, as its tensor-info record says.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dimensions as the file lists them: innermost (contiguous) first.
    pub dims: Vec<u64>,
    /// The ggml type id (see [`ggml_type_name`]).
    pub ggml_type: u32,
    /// Byte offset of the data, relative to the start of the data section.
    pub offset: u64,
    /// Absolute byte range in the file, known only for supported types.
    range: Option<Range<usize>>,
}

impl GgufTensorInfo {
    /// Dimensions outermost first, the way PyTorch and [`HostTensor`] list
    /// them (a GGUF `[d_model, vocab]` embedding is `[vocab, d_model]` here).
    pub fn shape(&self) -> Vec<usize> {
        // Every dimension was checked to fit a usize when the file was opened.
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// The storage type, or `None` when corridor cannot compute with it.
    pub fn dtype(&self) -> Option<DType> {
        ggml_dtype(self.ggml_type)
    }

    /// The type as a user reads it: `"Q4_K (type 12)"`.
    pub fn type_label(&self) -> String {
        format!("{} (type {})", ggml_type_name(self.ggml_type), self.ggml_type)
    }

    /// Number of elements.
    pub fn elems(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Bytes of data, known for supported types.
    pub fn byte_len(&self) -> Option<u64> {
        self.range.as_ref().map(|r| r.len() as u64)
    }
}

/// An open, memory-mapped GGUF file with its metadata and tensor directory
/// parsed.
pub struct GgufFile {
    path: PathBuf,
    map: Arc<memmap2::Mmap>,
    version: u32,
    alignment: u64,
    metadata: Vec<(String, GgufValue)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    data_start: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps the file and parses its header, metadata and tensor infos.
    ///
    /// Every supported tensor's byte range is checked against the file here,
    /// so a truncated file fails at open, naming the first tensor that does
    /// not fit. Tensors of unsupported types are listed but only refused when
    /// asked for, so that metadata (the tokenizer) stays readable.
    pub fn open(path: &Path) -> Result<GgufFile, LoadError> {
        let file = std::fs::File::open(path).map_err(|e| LoadError::io(path, e))?;
        // SAFETY: the mapping is read-only. If another process truncates or
        // rewrites the file while it is mapped, reads may fault or see new
        // bytes; that is the accepted price of never copying weights, as in
        // every memory-mapping model loader.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
        Self::parse(path.to_path_buf(), Arc::new(map))
    }

    fn parse(path: PathBuf, map: Arc<memmap2::Mmap>) -> Result<GgufFile, LoadError> {
        let buf: &[u8] = &map[..];
        let mut r = Reader { buf, pos: 0, file: &path };
        let magic = r.take(4, "the GGUF magic")?;
        if magic != MAGIC {
            return Err(LoadError::corrupt(
                &path,
                format!("not a GGUF file (starts with {magic:02x?}, expected \"GGUF\")"),
            ));
        }
        let version = r.u32("the GGUF version")?;
        if version != 2 && version != 3 {
            return Err(LoadError::corrupt(
                &path,
                format!("GGUF version {version} is not supported (2 and 3 are)"),
            ));
        }
        let tensor_count = r.u64("the tensor count")?;
        let kv_count = r.u64("the metadata count")?;
        // A key/value pair takes at least 8 (key length) + 4 (type) + 1 byte,
        // a tensor info at least 8 + 4 + 4 + 8; counts that cannot fit are
        // refused before any vector is sized by them.
        r.check_count(kv_count, 13, "metadata entries")?;
        r.check_count(tensor_count, 24, "tensor infos")?;

        let mut metadata = Vec::with_capacity(kv_count as usize);
        let mut meta_index = HashMap::with_capacity(kv_count as usize);
        for i in 0..kv_count {
            let key = r.string(&format!("metadata key #{i}"))?;
            let ty = r.u32(&format!("the type of metadata `{key}`"))?;
            let value = r.value(ty, &key, 0)?;
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(LoadError::corrupt(&path, format!("metadata key `{key}` appears twice")));
            }
            metadata.push((key, value));
        }

        let alignment = match meta_index.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(&i) => {
                let value = &metadata[i].1;
                match value.as_u64() {
                    Some(a) if a.is_power_of_two() && a <= 1 << 20 => a,
                    _ => {
                        return Err(LoadError::corrupt(
                            &path,
                            format!("general.alignment is {value:?}; expected a power of two"),
                        ))
                    }
                }
            }
        };

        let mut infos = Vec::with_capacity(tensor_count as usize);
        let mut tensor_index = HashMap::with_capacity(tensor_count as usize);
        for i in 0..tensor_count {
            let name = r.string(&format!("the name of tensor #{i}"))?;
            let n_dims = r.u32(&format!("the rank of tensor `{name}`"))?;
            if n_dims > MAX_DIMS {
                return Err(LoadError::corrupt(
                    &path,
                    format!("tensor `{name}` claims {n_dims} dimensions (ggml allows at most {MAX_DIMS})"),
                ));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.u64(&format!("the dimensions of tensor `{name}`"))?);
            }
            let ggml_type = r.u32(&format!("the type of tensor `{name}`"))?;
            let offset = r.u64(&format!("the offset of tensor `{name}`"))?;
            if tensor_index.insert(name.clone(), infos.len()).is_some() {
                return Err(LoadError::corrupt(&path, format!("tensor `{name}` appears twice")));
            }
            infos.push(GgufTensorInfo { name, dims, ggml_type, offset, range: None });
        }

        let file_len = buf.len() as u64;
        let data_start = r.pos as u64;
        let data_start = data_start.div_ceil(alignment) * alignment;
        for info in &mut infos {
            info.range = tensor_range(&path, info, TensorLayout { data_start, alignment, file_len })?;
        }

        Ok(GgufFile {
            path,
            map,
            version,
            alignment,
            metadata,
            meta_index,
            tensors: infos,
            tensor_index,
            data_start,
        })
    }

    /// The path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of the data section and of each tensor.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute offset of the data section in the file.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// Size of the file in bytes.
    pub fn file_bytes(&self) -> u64 {
        self.map.len() as u64
    }

    /// Every metadata pair, in file order.
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    /// One metadata value by key.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// Every tensor info, in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// One tensor info by its GGUF name.
    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// Whether the file holds a tensor of that GGUF name.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensor_index.contains_key(name)
    }

    /// A tensor by its GGUF name, as a window into the mapping, with its
    /// shape in PyTorch order.
    pub fn tensor(&self, name: &str) -> Result<HostTensor, LoadError> {
        self.tensor_as(name, name)
    }

    /// As [`GgufFile::tensor`], but the returned tensor carries `label` as its
    /// name (the Hugging Face name a caller asked for).
    pub(crate) fn tensor_as(&self, name: &str, label: &str) -> Result<HostTensor, LoadError> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| LoadError::MissingTensor { file: self.path.clone(), tensor: name.to_string() })?;
        let (Some(dtype), Some(range)) = (info.dtype(), info.range.clone()) else {
            return Err(LoadError::UnsupportedDType {
                file: self.path.clone(),
                tensor: name.to_string(),
                dtype: info.type_label(),
            });
        };
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = self.map.clone();
        let data = TensorBytes::new(owner, range).ok_or_else(|| {
            LoadError::corrupt(&self.path, format!("tensor `{name}` lies outside the file"))
        })?;
        Ok(HostTensor { name: label.to_string(), dtype, shape: info.shape(), data })
    }
}

impl GgufFile {
    /// Expert `expert` of a stacked expert tensor (llama.cpp's
    /// `ffn_{gate,up,down}_exps`, `[experts, rows, cols]` outermost first),
    /// as one `[rows, cols]` matrix named `label`: every expert's rows are
    /// one contiguous run of whole rows, so this is a view, not a copy.
    pub(crate) fn expert_as(&self, name: &str, expert: usize, label: &str) -> Result<HostTensor, LoadError> {
        let whole = self.tensor_as(name, label)?;
        let [experts, rows, cols] = whole.shape[..] else {
            return Err(LoadError::corrupt(
                &self.path,
                format!("`{name}` should be [experts, rows, cols], found {:?}", whole.shape),
            ));
        };
        if expert >= experts {
            return Err(LoadError::MissingTensor {
                file: self.path.clone(),
                tensor: format!("{label} (`{name}` holds {experts} experts)"),
            });
        }
        let per = whole.data.len() / experts;
        let info = self.tensor_info(name).expect("tensor_as found it");
        let start = info.range.clone().expect("tensor_as read it").start + expert * per;
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = self.map.clone();
        let data = TensorBytes::new(owner, start..start + per).ok_or_else(|| {
            LoadError::corrupt(&self.path, format!("tensor `{name}` lies outside the file"))
        })?;
        Ok(HostTensor { name: label.to_string(), dtype: whole.dtype, shape: vec![rows, cols], data })
    }
}

/// Where the data section is, for placing tensors inside it.
#[derive(Clone, Copy)]
struct TensorLayout {
    data_start: u64,
    alignment: u64,
    file_len: u64,
}

/// The absolute byte range of a tensor, checked against the file; `None`
/// for types corridor does not read (their size is not computed).
fn tensor_range(
    path: &Path,
    info: &GgufTensorInfo,
    layout: TensorLayout,
) -> Result<Option<Range<usize>>, LoadError> {
    let name = &info.name;
    let mut elems: u64 = 1;
    for &d in &info.dims {
        elems = elems.checked_mul(d).filter(|&e| usize::try_from(e).is_ok()).ok_or_else(|| {
            LoadError::corrupt(path, format!("tensor `{name}` has absurd dimensions {:?}", info.dims))
        })?;
    }
    let Some(dtype) = info.dtype() else {
        return Ok(None);
    };
    // Quantized rows are whole blocks in ggml, so the innermost dimension
    // (not just the total) must divide into blocks.
    let inner = info.dims.first().copied().unwrap_or(1);
    let block_elems = dtype.block_elems() as u64;
    if inner % block_elems != 0 {
        return Err(LoadError::corrupt(
            path,
            format!(
                "tensor `{name}` of type {} has rows of {inner} elements, not a multiple of its {}-element blocks",
                info.type_label(),
                dtype.block_elems()
            ),
        ));
    }
    // Checked: dimensions from a corrupt file can make the byte count
    // overflow even when the element count fits.
    let bytes = (elems / block_elems).checked_mul(dtype.block_bytes() as u64).ok_or_else(|| {
        LoadError::corrupt(path, format!("tensor `{name}` has absurd dimensions {:?}", info.dims))
    })?;
    if !info.offset.is_multiple_of(layout.alignment) {
        return Err(LoadError::corrupt(
            path,
            format!(
                "tensor `{name}` starts at data offset {}, not a multiple of the alignment {}",
                info.offset, layout.alignment
            ),
        ));
    }
    let start = layout.data_start.checked_add(info.offset);
    let end = start.and_then(|s| s.checked_add(bytes));
    match (start, end) {
        (Some(start), Some(end)) if end <= layout.file_len => Ok(Some(start as usize..end as usize)),
        (_, end) => Err(LoadError::Truncated {
            file: path.to_path_buf(),
            what: format!("tensor `{name}` ({}, {:?})", info.type_label(), info.dims),
            need: end.unwrap_or(u64::MAX),
            have: layout.file_len,
        }),
    }
}

/// What a read is for, turned into words only when the read fails, so that
/// reading a 150 000-token vocabulary formats nothing.
#[derive(Clone, Copy)]
enum Ctx<'k> {
    Plain(&'k str),
    ValueOf(&'k str),
}

impl std::fmt::Display for Ctx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ctx::Plain(s) => f.write_str(s),
            Ctx::ValueOf(key) => write!(f, "the value of metadata `{key}`"),
        }
    }
}

impl<'k> From<&'k str> for Ctx<'k> {
    fn from(s: &'k str) -> Self {
        Ctx::Plain(s)
    }
}

impl<'k> From<&'k String> for Ctx<'k> {
    fn from(s: &'k String) -> Self {
        Ctx::Plain(s)
    }
}

/// A cursor over the header bytes whose every read is bounds-checked.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    file: &'a Path,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn truncated<'k>(&self, what: impl Into<Ctx<'k>>, n: u64) -> LoadError {
        LoadError::Truncated {
            file: self.file.to_path_buf(),
            what: what.into().to_string(),
            need: (self.pos as u64).saturating_add(n),
            have: self.buf.len() as u64,
        }
    }

    fn take<'k>(&mut self, n: usize, what: impl Into<Ctx<'k>>) -> Result<&'a [u8], LoadError> {
        if n > self.remaining() {
            return Err(self.truncated(what, n as u64));
        }
        let bytes = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn array<'k, const N: usize>(&mut self, what: impl Into<Ctx<'k>>) -> Result<[u8; N], LoadError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    fn u32<'k>(&mut self, what: impl Into<Ctx<'k>>) -> Result<u32, LoadError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64<'k>(&mut self, what: impl Into<Ctx<'k>>) -> Result<u64, LoadError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Refuses a count of items, each at least `min_bytes` long, that the
    /// rest of the file could not hold.
    fn check_count(&self, count: u64, min_bytes: u64, what: &str) -> Result<(), LoadError> {
        match count.checked_mul(min_bytes) {
            None => Err(LoadError::corrupt(self.file, format!("absurd count of {what}: {count}"))),
            Some(need) if need > self.remaining() as u64 => {
                Err(self.truncated(&format!("{count} {what} of at least {min_bytes} bytes each"), need))
            }
            Some(_) => Ok(()),
        }
    }

    fn string<'k>(&mut self, what: impl Into<Ctx<'k>>) -> Result<String, LoadError> {
        let what = what.into();
        let len = self.u64(what)?;
        if len > self.remaining() as u64 {
            return Err(self.truncated(&format!("{what} (a string of {len} bytes)"), len));
        }
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| LoadError::corrupt(self.file, format!("{what} is not valid UTF-8")))
    }

    /// Reads one value of type id `ty`; `key` names it in errors.
    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<GgufValue, LoadError> {
        let what = Ctx::ValueOf(key);
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>(what)?[0]),
            1 => GgufValue::I8(i8::from_le_bytes(self.array(what)?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => GgufValue::U32(u32::from_le_bytes(self.array(what)?)),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => {
                    return Err(LoadError::corrupt(self.file, format!("metadata `{key}` has bool byte {b}")))
                }
            },
            8 => GgufValue::String(self.string(what)?),
            9 => {
                if depth >= MAX_NESTING {
                    return Err(LoadError::corrupt(
                        self.file,
                        format!("metadata `{key}` nests arrays deeper than {MAX_NESTING}"),
                    ));
                }
                let elem_ty = self.u32(what)?;
                let len = self.u64(what)?;
                let min = match elem_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    other => {
                        return Err(LoadError::corrupt(
                            self.file,
                            format!("metadata `{key}` is an array of unknown value type {other}"),
                        ))
                    }
                };
                self.check_count(len, min, &format!("elements of metadata `{key}`"))?;
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(self.value(elem_ty, key, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(u64::from_le_bytes(self.array(what)?)),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            other => {
                return Err(LoadError::corrupt(
                    self.file,
                    format!("metadata `{key}` has unknown value type {other}"),
                ))
            }
        })
    }
}
