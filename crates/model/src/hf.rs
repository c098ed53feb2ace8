//! Hugging Face model directories: `config.json` plus weights in one
//! `model.safetensors` file or in shards listed by
//! `model.safetensors.index.json`.
//!
//! A safetensors file is an 8-byte little-endian header length, a JSON header
//! mapping each tensor name to `{dtype, shape, data_offsets: [begin, end]}`
//! (offsets relative to the end of the header), then the data. The header is
//! parsed here rather than through the `safetensors` crate so that every
//! inconsistency becomes an error naming the file and the tensor. Each file is
//! memory-mapped once and tensors are windows into the mapping.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use corridor_backend::{DType, HostTensor, TensorBytes};
use serde_json::Value;

use crate::config::ModelConfig;
use crate::error::LoadError;

/// The single-file weights name transformers writes.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The shard index name transformers writes.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The same cap on header size that the reference implementation applies; a
/// larger header is a corrupt length, not a real file.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor's entry in a safetensors header.
#[derive(Clone, Debug)]
struct Entry {
    /// The dtype as the header spells it (`"BF16"`).
    dtype: String,
    shape: Vec<usize>,
    /// Absolute byte range in the file.
    range: Range<usize>,
}

/// One memory-mapped safetensors file with its header parsed and checked.
pub struct SafetensorsFile {
    path: PathBuf,
    map: Arc<memmap2::Mmap>,
    /// Tensor names in header order.
    names: Vec<String>,
    entries: HashMap<String, Entry>,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("tensors", &self.names.len())
            .finish()
    }
}

/// Bytes per element of each safetensors dtype, for checking lengths of
/// tensors corridor will not read as well as those it will.
fn st_elem_bytes(dtype: &str) -> Option<usize> {
    match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" => Some(1),
        "U16" | "I16" | "F16" | "BF16" => Some(2),
        "U32" | "I32" | "F32" => Some(4),
        "U64" | "I64" | "F64" => Some(8),
        _ => None,
    }
}

fn st_dtype(dtype: &str) -> Option<DType> {
    match dtype {
        "F32" => Some(DType::F32),
        "F16" => Some(DType::F16),
        "BF16" => Some(DType::BF16),
        _ => None,
    }
}

impl SafetensorsFile {
    /// Maps the file and checks its header: the length is sane, every
    /// tensor's bytes lie inside the file and match its shape and dtype.
    pub fn open(path: &Path) -> Result<SafetensorsFile, LoadError> {
        let file = std::fs::File::open(path).map_err(|e| LoadError::io(path, e))?;
        // SAFETY: read-only mapping; a file changed underneath a running
        // server is outside what any memory-mapping loader can defend against.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| LoadError::io(path, e))?;
        let map = Arc::new(map);
        let (names, entries) = parse_header(path, &map[..])?;
        Ok(SafetensorsFile { path: path.to_path_buf(), map, names, entries })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Size of the file in bytes.
    pub fn file_bytes(&self) -> u64 {
        self.map.len() as u64
    }

    /// Tensor names in header order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The shape of a tensor, outermost first.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }

    /// A tensor as a window into the mapping; F32, F16 and BF16 only.
    pub fn tensor(&self, name: &str) -> Result<HostTensor, LoadError> {
        let entry = self
            .entries
            .get(name)
            .ok_or_else(|| LoadError::MissingTensor { file: self.path.clone(), tensor: name.to_string() })?;
        let dtype = st_dtype(&entry.dtype).ok_or_else(|| LoadError::UnsupportedDType {
            file: self.path.clone(),
            tensor: name.to_string(),
            dtype: entry.dtype.clone(),
        })?;
        let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = self.map.clone();
        let data = TensorBytes::new(owner, entry.range.clone()).ok_or_else(|| {
            LoadError::corrupt(&self.path, format!("tensor `{name}` lies outside the file"))
        })?;
        Ok(HostTensor { name: name.to_string(), dtype, shape: entry.shape.clone(), data })
    }
}

/// Tensor names in header order, and their checked entries.
type Header = (Vec<String>, HashMap<String, Entry>);

fn parse_header(path: &Path, buf: &[u8]) -> Result<Header, LoadError> {
    let file_len = buf.len() as u64;
    let Some(len_bytes) = buf.get(..8) else {
        return Err(LoadError::Truncated {
            file: path.into(),
            what: "the header length".into(),
            need: 8,
            have: file_len,
        });
    };
    let mut word = [0u8; 8];
    word.copy_from_slice(len_bytes);
    let header_len = u64::from_le_bytes(word);
    if header_len > MAX_HEADER_BYTES {
        return Err(LoadError::corrupt(
            path,
            format!("header length {header_len} is absurd (at most {MAX_HEADER_BYTES})"),
        ));
    }
    let data_start = 8 + header_len;
    if data_start > file_len {
        return Err(LoadError::Truncated {
            file: path.into(),
            what: format!("the {header_len}-byte JSON header"),
            need: data_start,
            have: file_len,
        });
    }
    let header: serde_json::Map<String, Value> = serde_json::from_slice(&buf[8..data_start as usize])
        .map_err(|e| LoadError::corrupt(path, format!("header is not a JSON object: {e}")))?;

    let mut names = Vec::with_capacity(header.len());
    let mut entries = HashMap::with_capacity(header.len());
    for (name, value) in &header {
        if name == "__metadata__" {
            continue;
        }
        let entry = parse_entry(path, name, value, EntryBounds { data_start, file_len })?;
        names.push(name.clone());
        entries.insert(name.clone(), entry);
    }
    Ok((names, entries))
}

/// Where the data section lies, for checking one entry against it.
#[derive(Clone, Copy)]
struct EntryBounds {
    data_start: u64,
    file_len: u64,
}

fn parse_entry(path: &Path, name: &str, value: &Value, bounds: EntryBounds) -> Result<Entry, LoadError> {
    let bad = |what: &str| LoadError::corrupt(path, format!("tensor `{name}`: {what}"));
    let dtype = value.get("dtype").and_then(Value::as_str).ok_or_else(|| bad("no dtype string"))?;
    let shape: Vec<usize> = value
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("no shape list"))?
        .iter()
        .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
        .collect::<Option<_>>()
        .ok_or_else(|| bad("shape is not a list of non-negative integers"))?;
    let offsets: Vec<u64> = value
        .get("data_offsets")
        .and_then(Value::as_array)
        .filter(|o| o.len() == 2)
        .and_then(|o| o.iter().map(Value::as_u64).collect())
        .ok_or_else(|| bad("data_offsets is not a pair of non-negative integers"))?;
    let (begin, end) = (offsets[0], offsets[1]);
    if begin > end {
        return Err(bad(&format!("data_offsets [{begin}, {end}] run backwards")));
    }
    let elems =
        shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(|| bad("absurd shape"))?;
    if let Some(size) = st_elem_bytes(dtype) {
        let want = elems.checked_mul(size).ok_or_else(|| bad("absurd shape"))? as u64;
        if end - begin != want {
            return Err(bad(&format!(
                "{} bytes stored, but shape {shape:?} of {dtype} needs {want}",
                end - begin
            )));
        }
    }
    let abs_end = bounds.data_start.saturating_add(end);
    if abs_end > bounds.file_len {
        return Err(LoadError::Truncated {
            file: path.into(),
            what: format!("tensor `{name}`"),
            need: abs_end,
            have: bounds.file_len,
        });
    }
    let abs_begin = (bounds.data_start + begin) as usize;
    Ok(Entry { dtype: dtype.to_string(), shape, range: abs_begin..abs_end as usize })
}

/// A Hugging Face model directory: its config and every weight, each shard
/// mapped once.
#[derive(Debug)]
pub struct HfDir {
    dir: PathBuf,
    config: ModelConfig,
    torch_dtype: Option<DType>,
    files: Vec<SafetensorsFile>,
    /// Tensor name → index into `files`.
    tensor_file: HashMap<String, usize>,
}

impl HfDir {
    /// Reads the config and maps the weights of the directory.
    pub fn open(dir: &Path) -> Result<HfDir, LoadError> {
        let config_path = dir.join("config.json");
        let config_text =
            std::fs::read_to_string(&config_path).map_err(|e| LoadError::io(&config_path, e))?;
        let mut config = ModelConfig::from_hf_dir(dir)?;
        let torch_dtype = torch_dtype(&config_text);

        let (files, tensor_file) = if dir.join(SINGLE_FILE).is_file() {
            let file = SafetensorsFile::open(&dir.join(SINGLE_FILE))?;
            let map = file.names().iter().map(|n| (n.clone(), 0)).collect();
            (vec![file], map)
        } else if dir.join(INDEX_FILE).is_file() {
            open_shards(dir)?
        } else {
            return Err(LoadError::NotFound {
                path: dir.to_path_buf(),
                what: format!("neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors weights are read)"),
            });
        };

        // transformers ties the output projection to the embedding when the
        // checkpoint ships no lm_head; say so here rather than fail later.
        if !config.tie_word_embeddings && !tensor_file.contains_key("lm_head.weight") {
            tracing::info!(
                dir = %dir.display(),
                "no lm_head.weight in the checkpoint; tying the output projection to the embedding"
            );
            config.tie_word_embeddings = true;
        }
        Ok(HfDir { dir: dir.to_path_buf(), config, torch_dtype, files, tensor_file })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The dtype `config.json` says the weights were saved in (`torch_dtype`
    /// or `dtype`), when it names a float type corridor reads.
    pub fn torch_dtype(&self) -> Option<DType> {
        self.torch_dtype
    }

    /// The weight files, each mapped once.
    pub fn files(&self) -> &[SafetensorsFile] {
        &self.files
    }

    /// Total bytes of the weight files.
    pub fn file_bytes(&self) -> u64 {
        self.files.iter().map(SafetensorsFile::file_bytes).sum()
    }

    /// Every tensor name, sorted.
    pub fn tensor_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.tensor_file.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensor_file.contains_key(name)
    }

    pub fn tensor(&self, name: &str) -> Result<HostTensor, LoadError> {
        match self.tensor_file.get(name) {
            Some(&i) => self.files[i].tensor(name),
            None => Err(LoadError::MissingTensor { file: self.dir.clone(), tensor: name.to_string() }),
        }
    }
}

/// The dtype named by `torch_dtype` (older) or `dtype` (newer), if readable.
fn torch_dtype(config_text: &str) -> Option<DType> {
    let json: Value = serde_json::from_str(config_text).ok()?;
    let name = json.get("torch_dtype").or_else(|| json.get("dtype")).and_then(Value::as_str)?;
    match name {
        "float32" => Some(DType::F32),
        "float16" => Some(DType::F16),
        "bfloat16" => Some(DType::BF16),
        _ => None,
    }
}

/// Shard files and the tensor → file map from `model.safetensors.index.json`.
fn open_shards(dir: &Path) -> Result<(Vec<SafetensorsFile>, HashMap<String, usize>), LoadError> {
    let index_path = dir.join(INDEX_FILE);
    let text = std::fs::read_to_string(&index_path).map_err(|e| LoadError::io(&index_path, e))?;
    let index: Value = serde_json::from_str(&text)
        .map_err(|e| LoadError::corrupt(&index_path, format!("invalid JSON: {e}")))?;
    let weight_map = index
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| LoadError::corrupt(&index_path, "no `weight_map` object"))?;

    let mut files: Vec<SafetensorsFile> = Vec::new();
    let mut file_of_shard: HashMap<&str, usize> = HashMap::new();
    let mut tensor_file = HashMap::with_capacity(weight_map.len());
    for (tensor, shard) in weight_map {
        let shard = shard.as_str().ok_or_else(|| {
            LoadError::corrupt(&index_path, format!("weight_map entry of `{tensor}` is not a file name"))
        })?;
        // A shard is a file beside the index; a name that climbs out of the
        // directory is refused rather than followed.
        if shard.is_empty() || shard.contains('/') || shard.contains('\\') || shard == ".." {
            return Err(LoadError::corrupt(
                &index_path,
                format!("weight_map names `{shard}` for `{tensor}`, which is not a plain file name"),
            ));
        }
        let i = match file_of_shard.get(shard) {
            Some(&i) => i,
            None => {
                files.push(SafetensorsFile::open(&dir.join(shard))?);
                file_of_shard.insert(shard, files.len() - 1);
                files.len() - 1
            }
        };
        if !files[i].has_tensor(tensor) {
            return Err(LoadError::MissingTensor {
                file: files[i].path().to_path_buf(),
                tensor: tensor.clone(),
            });
        }
        tensor_file.insert(tensor.clone(), i);
    }
    Ok((files, tensor_file))
}
