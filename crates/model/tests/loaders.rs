//! Checkpoint loading against small files written by the tests themselves:
//! GGUF blobs from a minimal writer below, safetensors files from the
//! `safetensors` crate (an independent writer) or by hand when the point is
//! a corrupt header, and `config.json` text inline.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use corridor_backend::{DType, RopeStyle};
use corridor_model::checkpoint::{hf_to_gguf_name, Checkpoint, CheckpointFormat};
use corridor_model::config::{Arch, ModelConfig, RopeScaling};
use corridor_model::error::LoadError;
use corridor_model::gguf::{GgufFile, GgufValue};
use corridor_model::hf::{HfDir, SafetensorsFile};

// ---------------------------------------------------------------------------
// A minimal GGUF writer.

/// One tensor to write: name, dims innermost first, ggml type id, bytes.
struct GgufTensor {
    name: String,
    dims: Vec<u64>,
    ggml_type: u32,
    bytes: Vec<u8>,
}

struct GgufWriter {
    version: u32,
    alignment: usize,
    kvs: Vec<(String, GgufValue)>,
    tensors: Vec<GgufTensor>,
}

fn type_id(v: &GgufValue) -> u32 {
    match v {
        GgufValue::U8(_) => 0,
        GgufValue::I8(_) => 1,
        GgufValue::U16(_) => 2,
        GgufValue::I16(_) => 3,
        GgufValue::U32(_) => 4,
        GgufValue::I32(_) => 5,
        GgufValue::F32(_) => 6,
        GgufValue::Bool(_) => 7,
        GgufValue::String(_) => 8,
        GgufValue::Array(_) => 9,
        GgufValue::U64(_) => 10,
        GgufValue::I64(_) => 11,
        GgufValue::F64(_) => 12,
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => out.push(*x),
        GgufValue::I8(x) => out.extend(x.to_le_bytes()),
        GgufValue::U16(x) => out.extend(x.to_le_bytes()),
        GgufValue::I16(x) => out.extend(x.to_le_bytes()),
        GgufValue::U32(x) => out.extend(x.to_le_bytes()),
        GgufValue::I32(x) => out.extend(x.to_le_bytes()),
        GgufValue::U64(x) => out.extend(x.to_le_bytes()),
        GgufValue::I64(x) => out.extend(x.to_le_bytes()),
        GgufValue::F32(x) => out.extend(x.to_le_bytes()),
        GgufValue::F64(x) => out.extend(x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(u8::from(*x)),
        GgufValue::String(s) => put_str(out, s),
        GgufValue::Array(items) => {
            out.extend(items.first().map_or(0, type_id).to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
    }
}

impl GgufWriter {
    fn new() -> Self {
        GgufWriter { version: 3, alignment: 32, kvs: Vec::new(), tensors: Vec::new() }
    }

    fn kv(mut self, key: &str, value: GgufValue) -> Self {
        self.kvs.push((key.to_string(), value));
        self
    }

    fn tensor(mut self, name: &str, dims: &[u64], ggml_type: u32, bytes: Vec<u8>) -> Self {
        self.tensors.push(GgufTensor { name: name.to_string(), dims: dims.to_vec(), ggml_type, bytes });
        self
    }

    fn bytes(&self) -> Vec<u8> {
        let align = |n: usize| n.div_ceil(self.alignment) * self.alignment;
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kvs.len() as u64).to_le_bytes());
        for (key, value) in &self.kvs {
            put_str(&mut out, key);
            out.extend(type_id(value).to_le_bytes());
            put_value(&mut out, value);
        }
        let mut offset = 0usize;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.ggml_type.to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset = align(offset + t.bytes.len());
        }
        out.resize(align(out.len()), 0);
        for t in &self.tensors {
            out.extend(&t.bytes);
            out.resize(align(out.len()), 0);
        }
        out
    }
}

fn s(text: &str) -> GgufValue {
    GgufValue::String(text.to_string())
}

/// Distinct bytes so that a tensor read from the wrong place is noticed.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("write test file");
    path
}

fn gguf_err(bytes: &[u8]) -> LoadError {
    let dir = tempfile::tempdir().unwrap();
    match GgufFile::open(&write(dir.path(), "x.gguf", bytes)) {
        Ok(_) => panic!("a bad file was accepted"),
        Err(e) => e,
    }
}

// ---------------------------------------------------------------------------
// GGUF reader.

#[test]
fn gguf_metadata_of_every_value_type_round_trips_in_file_order() {
    let kvs = vec![
        ("a.u8", GgufValue::U8(200)),
        ("a.i8", GgufValue::I8(-5)),
        ("a.u16", GgufValue::U16(65000)),
        ("a.i16", GgufValue::I16(-30000)),
        ("a.u32", GgufValue::U32(4_000_000_000)),
        ("a.i32", GgufValue::I32(-2_000_000_000)),
        ("a.f32", GgufValue::F32(1.5e-5)),
        ("a.bool", GgufValue::Bool(true)),
        ("a.string", s("héllo")),
        ("a.u64", GgufValue::U64(1 << 40)),
        ("a.i64", GgufValue::I64(-(1 << 40))),
        ("a.f64", GgufValue::F64(500000.0)),
        ("a.strings", GgufValue::Array(vec![s("<s>"), s("</s>"), s("")])),
        ("a.ints", GgufValue::Array(vec![GgufValue::I32(3), GgufValue::I32(-1)])),
        ("a.nested", GgufValue::Array(vec![GgufValue::Array(vec![GgufValue::U8(1)])])),
        ("a.empty", GgufValue::Array(vec![])),
    ];
    let mut w = GgufWriter::new();
    for (k, v) in &kvs {
        w = w.kv(k, v.clone());
    }
    let dir = tempfile::tempdir().unwrap();
    let f = GgufFile::open(&write(dir.path(), "m.gguf", &w.bytes())).unwrap();
    let read: Vec<(&str, &GgufValue)> = f.metadata().iter().map(|(k, v)| (k.as_str(), v)).collect();
    let want: Vec<(&str, &GgufValue)> = kvs.iter().map(|(k, v)| (*k, v)).collect();
    assert_eq!(read, want);
    assert_eq!(f.version(), 3);
    assert!(f.tensors().is_empty());

    assert_eq!(f.get("a.string").and_then(GgufValue::as_str), Some("héllo"));
    assert_eq!(f.get("a.u8").and_then(GgufValue::as_u64), Some(200));
    assert_eq!(f.get("a.u32").and_then(GgufValue::as_u64), Some(4_000_000_000));
    assert_eq!(f.get("a.i8").and_then(GgufValue::as_u64), None, "a negative value is no u64");
    assert_eq!(f.get("a.f64").and_then(GgufValue::as_f64), Some(500000.0));
    assert_eq!(f.get("a.u16").and_then(GgufValue::as_f64), Some(65000.0));
    assert_eq!(f.get("a.strings").and_then(GgufValue::as_string_array), Some(vec!["<s>", "</s>", ""]));
    assert_eq!(f.get("a.ints").and_then(GgufValue::as_string_array), None);
    assert_eq!(f.get("a.ints").and_then(GgufValue::as_array).map(<[_]>::len), Some(2));
    assert_eq!(f.get("a.bool").and_then(GgufValue::as_bool), Some(true));
    assert!(f.get("a.missing").is_none());
}

/// Every supported type: (ggml id, dtype, bytes for 512 elements: two rows of
/// 256, one K-quant super-block each).
const SUPPORTED: [(u32, DType, usize); 15] = [
    (0, DType::F32, 2048),
    (1, DType::F16, 1024),
    (30, DType::BF16, 1024),
    (8, DType::Q8_0, 544),
    (2, DType::Q4_0, 288),
    (3, DType::Q4_1, 320),
    (6, DType::Q5_0, 352),
    (7, DType::Q5_1, 384),
    (20, DType::IQ4_NL, 288),
    (10, DType::Q2_K, 168),
    (11, DType::Q3_K, 220),
    (12, DType::Q4_K, 288),
    (13, DType::Q5_K, 352),
    (14, DType::Q6_K, 420),
    (23, DType::IQ4_XS, 272),
];

#[test]
fn gguf_tensors_of_every_supported_type_round_trip_with_pytorch_shapes() {
    for version in [2, 3] {
        let mut w = GgufWriter::new().kv("general.alignment", GgufValue::U32(64));
        w.version = version;
        w.alignment = 64;
        for (i, (id, dtype, len)) in SUPPORTED.iter().enumerate() {
            // 512 elements stored as 2 rows of 256: GGUF dims [256, 2].
            w = w.tensor(&format!("t.{dtype}"), &[256, 2], *id, pattern(*len, i as u8));
        }
        w = w.tensor("t.vector", &[32], 0, pattern(128, 99));
        let dir = tempfile::tempdir().unwrap();
        let f = GgufFile::open(&write(dir.path(), "t.gguf", &w.bytes())).unwrap();
        assert_eq!(f.version(), version);
        assert_eq!(f.alignment(), 64);
        assert_eq!(f.data_start() % 64, 0);
        for (i, (_, dtype, len)) in SUPPORTED.iter().enumerate() {
            let t = f.tensor(&format!("t.{dtype}")).unwrap();
            assert_eq!(t.dtype, *dtype);
            assert_eq!(t.shape, vec![2, 256], "dims are reversed into PyTorch order");
            assert_eq!(t.data.bytes(), pattern(*len, i as u8).as_slice(), "{dtype} bytes");
            assert_eq!(t.name, format!("t.{dtype}"));
        }
        let v = f.tensor("t.vector").unwrap();
        assert_eq!(v.shape, vec![32]);
        assert_eq!(v.data.bytes(), pattern(128, 99).as_slice());
        let info = f.tensor_info("t.Q8_0").unwrap();
        assert_eq!(info.dims, vec![256, 2]);
        assert_eq!(info.byte_len(), Some(544));
    }
}

/// A K-quant row must be whole 256-weight super-blocks; a 128-wide Q4_K
/// tensor is a corrupt file, named as such.
#[test]
fn gguf_k_quant_rows_must_be_whole_super_blocks() {
    let bytes = GgufWriter::new().tensor("narrow", &[128, 2], 12, vec![0; 144]).bytes();
    let dir = tempfile::tempdir().unwrap();
    let err = GgufFile::open(&write(dir.path(), "n.gguf", &bytes)).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("narrow") && msg.contains("256-element blocks"), "{msg}");
}

#[test]
fn gguf_unknown_tensor_type_is_listed_but_refused_by_name() {
    let bytes = GgufWriter::new()
        .kv("general.architecture", s("llama"))
        .tensor("blk.0.attn_q.weight", &[256, 1], 16, vec![0; 66])
        .tensor("ok", &[2], 0, vec![0; 8])
        .bytes();
    let dir = tempfile::tempdir().unwrap();
    let f = GgufFile::open(&write(dir.path(), "k.gguf", &bytes)).expect("metadata stays readable");
    assert_eq!(f.tensors().len(), 2);
    assert_eq!(f.tensor_info("blk.0.attn_q.weight").unwrap().type_label(), "IQ2_XXS (type 16)");
    let err = f.tensor("blk.0.attn_q.weight").unwrap_err();
    assert!(matches!(err, LoadError::UnsupportedDType { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("IQ2_XXS (type 16)") && msg.contains("blk.0.attn_q.weight"), "{msg}");
    assert!(f.tensor("ok").is_ok());
    assert!(matches!(f.tensor("absent"), Err(LoadError::MissingTensor { .. })));
}

fn small_gguf() -> Vec<u8> {
    GgufWriter::new()
        .kv("general.architecture", s("llama"))
        .kv("tokenizer.ggml.tokens", GgufValue::Array(vec![s("a"), s("b")]))
        .kv("x.f", GgufValue::F32(2.0))
        .tensor("w", &[32, 2], 8, pattern(68, 1))
        .tensor("n", &[3], 0, pattern(12, 2))
        .bytes()
}

#[test]
fn gguf_every_truncation_is_an_error_not_a_panic() {
    let bytes = small_gguf();
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "cut.gguf", &bytes);
    let full = GgufFile::open(&path).unwrap();
    let data_end =
        full.tensors().iter().map(|t| full.data_start() + t.offset + t.byte_len().unwrap()).max().unwrap()
            as usize;
    drop(full);
    // Any cut before the end of the last tensor's data must fail; cuts into
    // the trailing padding only may succeed.
    for len in 0..bytes.len() {
        std::fs::write(&path, &bytes[..len]).unwrap();
        let res = GgufFile::open(&path);
        if len < data_end {
            assert!(res.is_err(), "a {len}-byte prefix was accepted though data runs to {data_end}");
        }
    }
}

#[test]
fn gguf_truncated_tensor_data_names_the_tensor() {
    let bytes = small_gguf();
    let n_start = {
        let dir = tempfile::tempdir().unwrap();
        let g = GgufFile::open(&write(dir.path(), "a.gguf", &bytes)).unwrap();
        g.data_start() + g.tensor_info("n").unwrap().offset
    };
    let err = gguf_err(&bytes[..n_start as usize + 5]);
    assert!(matches!(&err, LoadError::Truncated { what, .. } if what.contains("`n`")), "{err}");
    assert!(err.to_string().contains("x.gguf"), "{err}");
}

/// The header of a GGUF file whose counts are given raw.
fn raw_header(tensors: u64, kvs: u64) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend(tensors.to_le_bytes());
    out.extend(kvs.to_le_bytes());
    out
}

#[test]
fn gguf_absurd_counts_and_lengths_are_refused_before_allocating() {
    let mut huge_tensors = raw_header(1 << 60, 0);
    huge_tensors.extend([0; 64]);
    assert!(matches!(gguf_err(&huge_tensors), LoadError::Truncated { .. } | LoadError::Corrupt { .. }));

    let mut huge_kvs = raw_header(0, u64::MAX);
    huge_kvs.extend([0; 64]);
    assert!(matches!(gguf_err(&huge_kvs), LoadError::Corrupt { .. }));

    // A key whose length claims 2^63 bytes.
    let mut long_key = raw_header(0, 1);
    long_key.extend((1u64 << 63).to_le_bytes());
    long_key.extend([0; 32]);
    assert!(matches!(gguf_err(&long_key), LoadError::Truncated { .. }));

    // An array of 2^61 u32s.
    let mut long_array = raw_header(0, 1);
    put_str(&mut long_array, "k");
    long_array.extend(9u32.to_le_bytes());
    long_array.extend(4u32.to_le_bytes());
    long_array.extend((1u64 << 61).to_le_bytes());
    long_array.extend([0; 32]);
    let err = gguf_err(&long_array);
    assert!(matches!(err, LoadError::Truncated { .. } | LoadError::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("`k`"), "{err}");

    // Dimensions whose product overflows.
    let bytes = GgufWriter::new().tensor("big", &[1 << 40, 1 << 40], 0, vec![]).bytes();
    assert!(matches!(gguf_err(&bytes), LoadError::Corrupt { .. }));
    // More than four dimensions.
    let bytes = GgufWriter::new().tensor("deep", &[1, 1, 1, 1, 1], 0, vec![0; 4]).bytes();
    assert!(matches!(gguf_err(&bytes), LoadError::Corrupt { .. }));
}

#[test]
fn gguf_bad_magic_version_and_value_type_are_refused() {
    let mut bytes = small_gguf();
    bytes[0] = b'X';
    assert!(matches!(gguf_err(&bytes), LoadError::Corrupt { .. }));

    let mut bytes = small_gguf();
    bytes[4..8].copy_from_slice(&4u32.to_le_bytes());
    assert!(gguf_err(&bytes).to_string().contains("version 4"));

    let mut bad_type = raw_header(0, 1);
    put_str(&mut bad_type, "k");
    bad_type.extend(13u32.to_le_bytes());
    bad_type.extend([0; 16]);
    assert!(gguf_err(&bad_type).to_string().contains("unknown value type 13"));

    let bytes = GgufWriter::new().kv("general.alignment", GgufValue::U32(24)).bytes();
    assert!(gguf_err(&bytes).to_string().contains("alignment"));
}

#[test]
fn gguf_misaligned_or_partial_block_tensors_are_refused() {
    // A Q8_0 row of 16 elements is not a whole block.
    let bytes = GgufWriter::new().tensor("q", &[16, 4], 8, vec![0; 68]).bytes();
    let err = gguf_err(&bytes);
    assert!(err.to_string().contains("`q`"), "{err}");

    // Offset 4 is not a multiple of the 32-byte alignment. The offset field
    // sits after the 24-byte header, the name (8 + 1), the rank (4), one
    // dimension (8) and the type (4).
    let mut bytes = GgufWriter::new().tensor("t", &[1], 0, vec![0; 4]).bytes();
    let at = 24 + 9 + 4 + 8 + 4;
    assert_eq!(bytes[at..at + 8], 0u64.to_le_bytes());
    bytes[at..at + 8].copy_from_slice(&4u64.to_le_bytes());
    let err = gguf_err(&bytes);
    assert!(matches!(err, LoadError::Corrupt { .. }) && err.to_string().contains("alignment"), "{err}");
}

// ---------------------------------------------------------------------------
// ModelConfig from GGUF metadata.

fn llama_gguf(arch: &str) -> GgufWriter {
    let a = |k: &str| format!("{arch}.{k}");
    GgufWriter::new()
        .kv("general.architecture", s(arch))
        .kv(&a("embedding_length"), GgufValue::U32(64))
        .kv(&a("block_count"), GgufValue::U32(2))
        .kv(&a("feed_forward_length"), GgufValue::U32(128))
        .kv(&a("attention.head_count"), GgufValue::U32(4))
        .kv(&a("attention.head_count_kv"), GgufValue::U32(2))
        .kv(&a("attention.layer_norm_rms_epsilon"), GgufValue::F32(1e-5))
        .kv(&a("context_length"), GgufValue::U32(2048))
        .kv("tokenizer.ggml.tokens", GgufValue::Array((0..100).map(|i| s(&i.to_string())).collect()))
        .kv("tokenizer.ggml.bos_token_id", GgufValue::U32(1))
        .kv("tokenizer.ggml.eos_token_id", GgufValue::U32(2))
        .kv("tokenizer.ggml.eot_token_id", GgufValue::U32(7))
        .tensor("token_embd.weight", &[64, 96], 8, vec![0; 96 * 2 * 34])
        .tensor("blk.0.attn_q.weight", &[64, 64], 1, pattern(64 * 64 * 2, 5))
        .tensor("output_norm.weight", &[64], 0, vec![0; 256])
}

fn open_gguf(w: &GgufWriter) -> (tempfile::TempDir, Result<Checkpoint, LoadError>) {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "model.gguf", &w.bytes());
    let ckpt = Checkpoint::open(&path);
    (dir, ckpt)
}

#[test]
fn gguf_llama_config_and_hugging_face_names() {
    let (_dir, ckpt) = open_gguf(&llama_gguf("llama"));
    let ckpt = ckpt.unwrap();
    let c = ckpt.config();
    assert_eq!(c.arch, Arch::Llama);
    assert_eq!(c.vocab_size, 96, "the embedding rows decide the vocabulary");
    assert_eq!((c.hidden_size, c.intermediate_size, c.num_layers), (64, 128, 2));
    assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (4, 2, 16));
    assert_eq!(c.rope_theta, 10000.0);
    assert_eq!(c.rope_scaling, None);
    assert_eq!(c.rope_style, RopeStyle::Interleaved);
    assert_eq!(c.max_position_embeddings, 2048);
    assert!(c.tie_word_embeddings, "no output.weight means tied");
    assert!(!c.attention_bias && !c.qk_norm);
    assert_eq!(c.bos_token_id, Some(1));
    assert_eq!(c.eos_token_ids, vec![2, 7]);
    assert_eq!(ckpt.format(), CheckpointFormat::Gguf);
    assert!(ckpt.gguf().is_some() && ckpt.dir().is_none());

    let q = ckpt.tensor("model.layers.0.self_attn.q_proj.weight").unwrap();
    assert_eq!(q.name, "model.layers.0.self_attn.q_proj.weight", "the tensor keeps the asked-for name");
    assert_eq!((q.dtype, q.shape.clone()), (DType::F16, vec![64, 64]));
    assert_eq!(q.data.bytes(), pattern(64 * 64 * 2, 5).as_slice());
    assert_eq!(ckpt.tensor("model.embed_tokens.weight").unwrap().shape, vec![96, 64]);
    assert!(ckpt.has_tensor("model.norm.weight"));
    assert!(!ckpt.has_tensor("lm_head.weight"));
    let err = ckpt.tensor("model.layers.1.mlp.up_proj.weight").unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, LoadError::MissingTensor { .. }), "{msg}");
    assert!(msg.contains("model.gguf") && msg.contains("model.layers.1.mlp.up_proj.weight"), "{msg}");
}

#[test]
fn gguf_qwen_configs_use_half_rope_and_their_extras() {
    let w = llama_gguf("qwen2").kv("qwen2.rope.freq_base", GgufValue::F32(1_000_000.0)).tensor(
        "output.weight",
        &[64, 96],
        8,
        vec![0; 96 * 2 * 34],
    );
    let (_dir, ckpt) = open_gguf(&w);
    let c = ckpt.unwrap().config().clone();
    assert_eq!((c.arch, c.rope_style), (Arch::Qwen2, RopeStyle::Half));
    assert!(c.attention_bias && !c.qk_norm && !c.tie_word_embeddings);
    assert_eq!(c.rope_theta, 1_000_000.0);

    let w = llama_gguf("qwen3").kv("qwen3.attention.key_length", GgufValue::U32(32));
    let (_dir, ckpt) = open_gguf(&w);
    let c = ckpt.unwrap().config().clone();
    assert_eq!((c.arch, c.rope_style, c.head_dim), (Arch::Qwen3, RopeStyle::Half, 32));
    assert!(c.qk_norm && !c.attention_bias);
}

#[test]
fn gguf_unknown_architecture_and_scaling_are_named() {
    let (_dir, ckpt) = open_gguf(&llama_gguf("gemma2"));
    let err = ckpt.unwrap_err();
    assert!(matches!(&err, LoadError::UnknownArchitecture { arch, .. } if arch == "gemma2"), "{err}");

    let (_dir, ckpt) = open_gguf(&llama_gguf("llama").kv("llama.rope.scaling.type", s("yarn")));
    let err = ckpt.unwrap_err();
    assert!(matches!(&err, LoadError::UnsupportedRopeScaling { kind, .. } if kind == "yarn"), "{err}");

    let w = llama_gguf("llama")
        .kv("llama.rope.scaling.type", s("linear"))
        .kv("llama.rope.scaling.factor", GgufValue::F32(4.0));
    let (_dir, ckpt) = open_gguf(&w);
    assert_eq!(ckpt.unwrap().config().rope_scaling, Some(RopeScaling::Linear { factor: 4.0 }));
}

/// The per-frequency divisors llama.cpp's converter writes for Llama 3.
fn llama3_divisors(theta: f64, head_dim: usize, factor: f64) -> Vec<u8> {
    let (low, high, orig) = (1.0, 4.0, 8192.0);
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < orig / high {
                1.0
            } else if wavelen > orig / low {
                factor
            } else {
                let smooth = (orig / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .flat_map(|d| (d as f32).to_le_bytes())
        .collect()
}

#[test]
fn gguf_llama3_scaling_is_recovered_from_rope_freqs() {
    let w = llama_gguf("llama").kv("llama.rope.freq_base", GgufValue::F32(500000.0)).tensor(
        "rope_freqs.weight",
        &[8],
        0,
        llama3_divisors(500000.0, 16, 32.0),
    );
    let (_dir, ckpt) = open_gguf(&w);
    let want = RopeScaling::Llama3 {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    assert_eq!(ckpt.unwrap().config().rope_scaling, Some(want));

    // Divisors from no known setting are refused rather than ignored.
    let mut odd = llama3_divisors(500000.0, 16, 32.0);
    odd[..4].copy_from_slice(&3.0f32.to_le_bytes());
    let w = llama_gguf("llama").kv("llama.rope.freq_base", GgufValue::F32(500000.0)).tensor(
        "rope_freqs.weight",
        &[8],
        0,
        odd,
    );
    let (_dir, ckpt) = open_gguf(&w);
    assert!(matches!(ckpt.unwrap_err(), LoadError::UnsupportedRopeScaling { .. }));
}

#[test]
fn gguf_missing_required_metadata_is_a_config_error() {
    let mut w = llama_gguf("llama");
    w.kvs.retain(|(k, _)| k != "llama.block_count");
    let (_dir, ckpt) = open_gguf(&w);
    let err = ckpt.unwrap_err();
    assert!(
        matches!(err, LoadError::Config { .. }) && err.to_string().contains("llama.block_count"),
        "{err}"
    );
}

#[test]
fn hugging_face_names_map_to_gguf_names() {
    let cases = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
        ("model.layers.12.self_attn.q_proj.weight", "blk.12.attn_q.weight"),
        ("model.layers.0.self_attn.k_proj.bias", "blk.0.attn_k.bias"),
        ("model.layers.0.self_attn.v_proj.weight", "blk.0.attn_v.weight"),
        ("model.layers.0.self_attn.o_proj.weight", "blk.0.attn_output.weight"),
        ("model.layers.3.self_attn.q_norm.weight", "blk.3.attn_q_norm.weight"),
        ("model.layers.3.self_attn.k_norm.weight", "blk.3.attn_k_norm.weight"),
        ("model.layers.1.mlp.gate_proj.weight", "blk.1.ffn_gate.weight"),
        ("model.layers.1.mlp.up_proj.weight", "blk.1.ffn_up.weight"),
        ("model.layers.1.mlp.down_proj.weight", "blk.1.ffn_down.weight"),
        ("model.layers.1.input_layernorm.weight", "blk.1.attn_norm.weight"),
        ("model.layers.1.post_attention_layernorm.weight", "blk.1.ffn_norm.weight"),
    ];
    for (hf, gguf) in cases {
        assert_eq!(hf_to_gguf_name(hf).as_deref(), Some(gguf), "{hf}");
    }
    for bad in [
        "model.layers.x.mlp.up_proj.weight",
        "model.layers.01.mlp.up_proj.weight",
        "model.layers.1.mlp.weight",
    ] {
        assert_eq!(hf_to_gguf_name(bad), None, "{bad}");
    }
}

// ---------------------------------------------------------------------------
// Safetensors.

fn st_bytes(tensors: &[(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, shape, bytes)| {
            (n.to_string(), safetensors::tensor::TensorView::new(*d, shape.clone(), bytes).unwrap())
        })
        .collect();
    safetensors::tensor::serialize(views, None).unwrap()
}

/// A hand-built safetensors file from a header JSON string and data bytes.
fn st_raw(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

fn st_err(bytes: &[u8]) -> LoadError {
    let dir = tempfile::tempdir().unwrap();
    SafetensorsFile::open(&write(dir.path(), "bad.safetensors", bytes)).unwrap_err()
}

#[test]
fn safetensors_float_tensors_round_trip_and_others_are_refused_by_name() {
    use safetensors::Dtype as D;
    let bytes = st_bytes(&[
        ("a", D::F32, vec![2, 3], pattern(24, 1)),
        ("b", D::F16, vec![3], pattern(6, 2)),
        ("c", D::BF16, vec![1, 4], pattern(8, 3)),
        ("d", D::I64, vec![2], pattern(16, 4)),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let f = SafetensorsFile::open(&write(dir.path(), "m.safetensors", &bytes)).unwrap();
    for (name, dtype, shape, seed, len) in [
        ("a", DType::F32, vec![2, 3], 1, 24),
        ("b", DType::F16, vec![3], 2, 6),
        ("c", DType::BF16, vec![1, 4], 3, 8),
    ] {
        let t = f.tensor(name).unwrap();
        assert_eq!((t.dtype, t.shape.clone()), (dtype, shape));
        assert_eq!(t.data.bytes(), pattern(len, seed).as_slice());
    }
    let err = f.tensor("d").unwrap_err();
    assert!(
        matches!(&err, LoadError::UnsupportedDType { tensor, dtype, .. } if tensor == "d" && dtype == "I64")
    );
    assert!(matches!(f.tensor("zz"), Err(LoadError::MissingTensor { .. })));
}

#[test]
fn safetensors_every_truncation_is_an_error_not_a_panic() {
    let bytes = st_bytes(&[("a", safetensors::Dtype::F32, vec![4], pattern(16, 1))]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.safetensors");
    for len in 0..bytes.len() {
        std::fs::write(&path, &bytes[..len]).unwrap();
        assert!(SafetensorsFile::open(&path).is_err(), "a {len}-byte prefix was accepted");
    }
    let err = st_err(&bytes[..bytes.len() - 1]);
    assert!(matches!(&err, LoadError::Truncated { what, .. } if what.contains("`a`")), "{err}");
    assert!(err.to_string().contains("bad.safetensors"));
}

#[test]
fn safetensors_corrupt_headers_are_refused_naming_the_tensor() {
    // Absurd header length.
    let mut absurd = u64::MAX.to_le_bytes().to_vec();
    absurd.extend([0; 16]);
    assert!(matches!(st_err(&absurd), LoadError::Corrupt { .. }));
    // Not JSON.
    assert!(matches!(st_err(&st_raw("{nope", &[])), LoadError::Corrupt { .. }));
    // Byte length does not match the shape.
    let err = st_err(&st_raw(r#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}}"#, &[0; 12]));
    assert!(matches!(&err, LoadError::Corrupt { detail, .. } if detail.contains("`w`")), "{err}");
    // Offsets running backwards.
    let err = st_err(&st_raw(r#"{"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}}"#, &[0; 8]));
    assert!(matches!(err, LoadError::Corrupt { .. }));
    // Offsets beyond the file.
    let err = st_err(&st_raw(r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[100,116]}}"#, &[0; 16]));
    assert!(matches!(err, LoadError::Truncated { .. }));
    // The metadata entry is not a tensor.
    let ok = st_raw(
        r#"{"__metadata__":{"format":"pt"},"w":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}"#,
        &[0; 4],
    );
    let dir = tempfile::tempdir().unwrap();
    let f = SafetensorsFile::open(&write(dir.path(), "ok.safetensors", &ok)).unwrap();
    assert_eq!(f.names(), ["w".to_string()]);
}

// ---------------------------------------------------------------------------
// Hugging Face directories and config.json.

const LLAMA_CONFIG: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "vocab_size": 8,
  "hidden_size": 4,
  "intermediate_size": 6,
  "num_hidden_layers": 1,
  "num_attention_heads": 2,
  "num_key_value_heads": 1,
  "rms_norm_eps": 1e-5,
  "rope_theta": 500000.0,
  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
  "max_position_embeddings": 131072,
  "bos_token_id": 1,
  "eos_token_id": [2, 3],
  "torch_dtype": "bfloat16"
}"#;

fn cfg(json: &str) -> Result<ModelConfig, LoadError> {
    ModelConfig::from_hf_json(json, None, Path::new("config.json"))
}

/// `base` with some top-level keys replaced (or removed, with `null` values
/// given as `None`).
fn edit(base: &str, changes: &[(&str, Option<serde_json::Value>)]) -> String {
    let mut v: serde_json::Map<String, serde_json::Value> = serde_json::from_str(base).unwrap();
    for (k, val) in changes {
        match val {
            Some(val) => v.insert(k.to_string(), val.clone()),
            None => v.remove(*k),
        };
    }
    serde_json::Value::Object(v).to_string()
}

#[test]
fn config_old_spelling_with_llama3_scaling() {
    let c = cfg(LLAMA_CONFIG).unwrap();
    assert_eq!(c.arch, Arch::Llama);
    assert_eq!((c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers), (8, 4, 6, 1));
    assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (2, 1, 2));
    assert_eq!(c.rope_theta, 500000.0);
    assert_eq!(
        c.rope_scaling,
        Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192
        })
    );
    assert_eq!(c.rope_style, RopeStyle::Half);
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert!(!c.tie_word_embeddings && !c.attention_bias && !c.qk_norm);
    assert_eq!((c.bos_token_id, c.eos_token_ids.clone()), (Some(1), vec![2, 3]));
}

#[test]
fn config_new_rope_parameters_spelling_matches_the_old() {
    let new = edit(
        LLAMA_CONFIG,
        &[
            ("rope_theta", None),
            ("rope_scaling", None),
            ("torch_dtype", None),
            ("dtype", Some("bfloat16".into())),
            (
                "rope_parameters",
                Some(serde_json::json!({"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
            ),
        ],
    );
    assert_eq!(cfg(&new).unwrap(), cfg(LLAMA_CONFIG).unwrap());

    let plain = edit(
        LLAMA_CONFIG,
        &[
            ("rope_theta", None),
            ("rope_scaling", None),
            ("rope_parameters", Some(serde_json::json!({"rope_theta": 1000.0, "rope_type": "default"}))),
        ],
    );
    let c = cfg(&plain).unwrap();
    assert_eq!((c.rope_theta, c.rope_scaling), (1000.0, None));
}

#[test]
fn config_rope_scaling_variants() {
    let linear =
        edit(LLAMA_CONFIG, &[("rope_scaling", Some(serde_json::json!({"type": "linear", "factor": 2.0})))]);
    assert_eq!(cfg(&linear).unwrap().rope_scaling, Some(RopeScaling::Linear { factor: 2.0 }));
    let null = edit(LLAMA_CONFIG, &[("rope_scaling", Some(serde_json::Value::Null)), ("rope_theta", None)]);
    let c = cfg(&null).unwrap();
    assert_eq!((c.rope_scaling, c.rope_theta), (None, 10000.0));
    for kind in ["yarn", "dynamic", "longrope"] {
        let j = edit(
            LLAMA_CONFIG,
            &[("rope_scaling", Some(serde_json::json!({"rope_type": kind, "factor": 4.0})))],
        );
        let err = cfg(&j).unwrap_err();
        assert!(matches!(&err, LoadError::UnsupportedRopeScaling { kind: k, .. } if k == kind), "{err}");
        assert!(err.to_string().contains(kind));
    }
}

#[test]
fn config_architectures_and_their_defaults() {
    let qwen2 = edit(
        LLAMA_CONFIG,
        &[
            ("architectures", Some(serde_json::json!(["Qwen2ForCausalLM"]))),
            ("tie_word_embeddings", Some(true.into())),
            ("rope_scaling", None),
            ("num_key_value_heads", None),
        ],
    );
    let c = cfg(&qwen2).unwrap();
    assert_eq!(c.arch, Arch::Qwen2);
    assert!(c.attention_bias && c.tie_word_embeddings && !c.qk_norm);
    assert_eq!(c.num_kv_heads, 2, "absent kv heads = attention heads");

    let qwen3 = edit(
        LLAMA_CONFIG,
        &[
            ("architectures", Some(serde_json::json!(["Qwen3ForCausalLM"]))),
            ("head_dim", Some(8.into())),
            ("attention_bias", Some(false.into())),
        ],
    );
    let c = cfg(&qwen3).unwrap();
    assert_eq!((c.arch, c.head_dim), (Arch::Qwen3, 8));
    assert!(c.qk_norm && !c.attention_bias);

    let mistral = edit(LLAMA_CONFIG, &[("architectures", None), ("model_type", Some("mistral".into()))]);
    assert_eq!(cfg(&mistral).unwrap().arch, Arch::Mistral);

    let unknown = edit(LLAMA_CONFIG, &[("architectures", Some(serde_json::json!(["GPTNeoXForCausalLM"])))]);
    let err = cfg(&unknown).unwrap_err();
    assert!(err.to_string().contains("GPTNeoXForCausalLM"), "{err}");
    assert!(matches!(err, LoadError::UnknownArchitecture { .. }));

    let missing = edit(LLAMA_CONFIG, &[("hidden_size", None)]);
    assert!(cfg(&missing).unwrap_err().to_string().contains("hidden_size"));
    let uneven = edit(LLAMA_CONFIG, &[("num_key_value_heads", Some(3.into()))]);
    assert!(matches!(cfg(&uneven), Err(LoadError::Config { .. })));
}

#[test]
fn config_eos_ids_merge_generation_config_int_or_list() {
    let one =
        ModelConfig::from_hf_json(LLAMA_CONFIG, Some(r#"{"eos_token_id": 9}"#), Path::new("c")).unwrap();
    assert_eq!(one.eos_token_ids, vec![9, 2, 3]);
    let list =
        ModelConfig::from_hf_json(LLAMA_CONFIG, Some(r#"{"eos_token_id": [3, 9]}"#), Path::new("c")).unwrap();
    assert_eq!(list.eos_token_ids, vec![3, 9, 2]);
    let single = edit(
        LLAMA_CONFIG,
        &[("eos_token_id", Some(5.into())), ("bos_token_id", Some(serde_json::Value::Null))],
    );
    let c = cfg(&single).unwrap();
    assert_eq!((c.eos_token_ids, c.bos_token_id), (vec![5], None));
}

/// Writes a tiny Llama directory: config plus the given weight files.
fn hf_dir(files: &[(&str, Vec<u8>)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "config.json", LLAMA_CONFIG.as_bytes());
    for (name, bytes) in files {
        write(dir.path(), name, bytes);
    }
    dir
}

#[test]
fn hf_single_file_directory_opens_as_a_checkpoint() {
    use safetensors::Dtype as D;
    let weights = st_bytes(&[
        ("model.embed_tokens.weight", D::BF16, vec![8, 4], pattern(64, 1)),
        ("lm_head.weight", D::BF16, vec![8, 4], pattern(64, 2)),
    ]);
    let dir = hf_dir(&[("model.safetensors", weights.clone())]);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ckpt.format(), CheckpointFormat::HuggingFace);
    assert_eq!(ckpt.dir(), Some(dir.path()));
    assert!(ckpt.gguf().is_none());
    assert_eq!(ckpt.torch_dtype(), Some(DType::BF16));
    assert_eq!(ckpt.file_bytes(), weights.len() as u64);
    assert!(!ckpt.config().tie_word_embeddings);
    let t = ckpt.tensor("lm_head.weight").unwrap();
    assert_eq!(t.data.bytes(), pattern(64, 2).as_slice());
    let err = ckpt.tensor("model.norm.weight").unwrap_err();
    assert!(
        matches!(&err, LoadError::MissingTensor { tensor, .. } if tensor == "model.norm.weight"),
        "{err}"
    );
}

#[test]
fn hf_without_lm_head_is_tied() {
    let weights =
        st_bytes(&[("model.embed_tokens.weight", safetensors::Dtype::F32, vec![8, 4], pattern(128, 1))]);
    let dir = hf_dir(&[("model.safetensors", weights)]);
    assert!(HfDir::open(dir.path()).unwrap().config().tie_word_embeddings);
}

fn shards() -> (Vec<u8>, Vec<u8>) {
    use safetensors::Dtype as D;
    (
        st_bytes(&[
            ("model.embed_tokens.weight", D::F16, vec![8, 4], pattern(64, 1)),
            ("model.norm.weight", D::F16, vec![4], pattern(8, 2)),
        ]),
        st_bytes(&[("lm_head.weight", D::F16, vec![8, 4], pattern(64, 3))]),
    )
}

fn index(map: &[(&str, &str)]) -> Vec<u8> {
    let m: HashMap<&str, &str> = map.iter().copied().collect();
    serde_json::json!({"metadata": {"total_size": 136}, "weight_map": m}).to_string().into_bytes()
}

#[test]
fn hf_sharded_index_resolves_each_tensor_to_its_shard() {
    let (a, b) = shards();
    let total = (a.len() + b.len()) as u64;
    let dir = hf_dir(&[
        ("model-00001-of-00002.safetensors", a),
        ("model-00002-of-00002.safetensors", b),
        (
            "model.safetensors.index.json",
            index(&[
                ("model.embed_tokens.weight", "model-00001-of-00002.safetensors"),
                ("model.norm.weight", "model-00001-of-00002.safetensors"),
                ("lm_head.weight", "model-00002-of-00002.safetensors"),
            ]),
        ),
    ]);
    let hf = HfDir::open(dir.path()).unwrap();
    assert_eq!(hf.files().len(), 2, "each shard is mapped once");
    assert_eq!(hf.file_bytes(), total);
    assert_eq!(hf.tensor_names(), vec!["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]);
    assert_eq!(hf.tensor("lm_head.weight").unwrap().data.bytes(), pattern(64, 3).as_slice());
    assert_eq!(hf.tensor("model.norm.weight").unwrap().data.bytes(), pattern(8, 2).as_slice());
}

#[test]
fn hf_sharded_index_errors() {
    let (a, b) = shards();
    // The index places a tensor in a shard that lacks it.
    let dir = hf_dir(&[
        ("s1.safetensors", a.clone()),
        ("s2.safetensors", b.clone()),
        ("model.safetensors.index.json", index(&[("model.norm.weight", "s2.safetensors")])),
    ]);
    let err = HfDir::open(dir.path()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, LoadError::MissingTensor { .. }) && msg.contains("s2.safetensors"), "{msg}");
    // A shard that does not exist.
    let dir =
        hf_dir(&[("model.safetensors.index.json", index(&[("model.norm.weight", "gone.safetensors")]))]);
    let err = HfDir::open(dir.path()).unwrap_err();
    assert!(
        matches!(err, LoadError::NotFound { .. }) && err.to_string().contains("gone.safetensors"),
        "{err}"
    );
    // A shard name that leaves the directory.
    let dir =
        hf_dir(&[("model.safetensors.index.json", index(&[("model.norm.weight", "../s1.safetensors")]))]);
    assert!(matches!(HfDir::open(dir.path()), Err(LoadError::Corrupt { .. })));
}

#[test]
fn missing_files_and_non_checkpoints_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err();
    assert!(matches!(err, LoadError::NotFound { .. }) && err.to_string().contains("config.json"), "{err}");

    let dir = hf_dir(&[]);
    let err = Checkpoint::open(dir.path()).unwrap_err();
    assert!(
        matches!(err, LoadError::NotFound { .. }) && err.to_string().contains("model.safetensors"),
        "{err}"
    );

    let other = write(dir.path(), "weights.bin", b"hello");
    assert!(matches!(Checkpoint::open(&other), Err(LoadError::NotACheckpoint { .. })));
    assert!(matches!(Checkpoint::open(&dir.path().join("absent.gguf")), Err(LoadError::NotFound { .. })));
}

// ---------------------------------------------------------------------------
// Random corruption never panics.

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, failure_persistence: None, ..Default::default() })]

    #[test]
    fn gguf_random_byte_damage_never_panics(flips in proptest::collection::vec((0usize..4096, proptest::prelude::any::<u8>()), 1..8)) {
        let mut bytes = small_gguf();
        for (at, value) in flips {
            let i = at % bytes.len();
            bytes[i] = value;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "fuzz.gguf", &bytes);
        if let Ok(f) = GgufFile::open(&path) {
            for t in f.tensors() {
                let _ = f.tensor(&t.name);
            }
            let _ = ModelConfig::from_gguf(&f);
        }
    }

    #[test]
    fn safetensors_random_byte_damage_never_panics(flips in proptest::collection::vec((0usize..4096, proptest::prelude::any::<u8>()), 1..8)) {
        let mut bytes = st_bytes(&[("a", safetensors::Dtype::F32, vec![2, 2], pattern(16, 1)), ("b", safetensors::Dtype::BF16, vec![3], pattern(6, 2))]);
        for (at, value) in flips {
            let i = at % bytes.len();
            bytes[i] = value;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "fuzz.safetensors", &bytes);
        if let Ok(f) = SafetensorsFile::open(&path) {
            for n in f.names().to_vec() {
                let _ = f.tensor(&n);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// The tiny checkpoints of tests/fixtures/tiny (written by
// scripts/make_fixtures.py).

fn fixture(name: &str) -> Checkpoint {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny").join(name);
    Checkpoint::open(&path).unwrap_or_else(|e| panic!("fixture {name}: {e}"))
}

/// The shapes every tiny fixture shares.
fn assert_tiny_shape(c: &ModelConfig, layers: usize, head_dim: usize) {
    assert_eq!((c.vocab_size, c.hidden_size, c.intermediate_size), (384, 64, 128));
    assert_eq!((c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim), (layers, 4, 2, head_dim));
    assert_eq!(c.max_position_embeddings, 256);
    assert_eq!(c.bos_token_id, Some(0));
}

/// Every Hugging Face name the architectures ask for, for `c`.
fn hf_names(c: &ModelConfig) -> Vec<String> {
    let mut names =
        vec!["model.embed_tokens.weight".to_string(), "model.norm.weight".into(), "lm_head.weight".into()];
    for i in 0..c.num_layers {
        for m in ["q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"] {
            names.push(format!("model.layers.{i}.self_attn.{m}.weight"));
            names.push(format!("model.layers.{i}.self_attn.{m}.bias"));
        }
        for m in ["gate_proj", "up_proj", "down_proj"] {
            names.push(format!("model.layers.{i}.mlp.{m}.weight"));
        }
        names.push(format!("model.layers.{i}.input_layernorm.weight"));
        names.push(format!("model.layers.{i}.post_attention_layernorm.weight"));
    }
    names
}

#[test]
fn fixture_hugging_face_directories_open_with_their_configs() {
    let llama3 = |theta: f32| {
        (
            theta,
            Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 64,
            }),
        )
    };

    let ckpt = fixture("llama-f32");
    let c = ckpt.config();
    assert_tiny_shape(c, 2, 16);
    assert_eq!((c.arch, c.rope_style, c.rms_norm_eps), (Arch::Llama, RopeStyle::Half, 1e-5));
    assert_eq!((c.rope_theta, c.rope_scaling.clone()), llama3(10000.0));
    assert!(!c.tie_word_embeddings && !c.attention_bias && !c.qk_norm);
    assert_eq!(c.eos_token_ids, vec![2]);
    assert_eq!(ckpt.torch_dtype(), Some(DType::F32));
    assert_eq!(ckpt.tensor("model.layers.1.mlp.down_proj.weight").unwrap().shape, vec![64, 128]);

    let ckpt = fixture("llama-bf16-sharded");
    let c = ckpt.config();
    assert_tiny_shape(c, 3, 16);
    assert_eq!((c.rope_theta, c.rope_scaling.clone()), llama3(500000.0));
    assert_eq!(ckpt.hf().unwrap().files().len(), 4);
    let t = ckpt.tensor("model.layers.2.self_attn.q_proj.weight").unwrap();
    assert_eq!((t.dtype, t.shape), (DType::BF16, vec![64, 64]));

    let ckpt = fixture("qwen2-tied");
    let c = ckpt.config();
    assert_tiny_shape(c, 2, 16);
    assert_eq!((c.arch, c.rope_theta, c.rms_norm_eps), (Arch::Qwen2, 1e6, 1e-6));
    assert!(c.tie_word_embeddings && c.attention_bias && !c.qk_norm);
    assert_eq!(c.eos_token_ids, vec![2, 0]);
    assert_eq!(ckpt.tensor("model.layers.0.self_attn.k_proj.bias").unwrap().shape, vec![32]);

    let ckpt = fixture("qwen3");
    let c = ckpt.config();
    assert_tiny_shape(c, 2, 32);
    assert_eq!(c.arch, Arch::Qwen3);
    assert!(c.qk_norm && !c.attention_bias && c.tie_word_embeddings);
    assert_eq!(ckpt.tensor("model.layers.0.self_attn.q_proj.weight").unwrap().shape, vec![128, 64]);

    let ckpt = fixture("mistral");
    let c = ckpt.config();
    assert_tiny_shape(c, 2, 16);
    assert_eq!((c.arch, c.rope_theta, c.rope_scaling.clone()), (Arch::Mistral, 1e6, None));
    assert!(!c.tie_word_embeddings && ckpt.has_tensor("lm_head.weight"));
}

#[test]
fn fixture_gguf_files_open_with_their_configs() {
    let ckpt = fixture("llama-q.gguf");
    let c = ckpt.config();
    assert_tiny_shape(c, 2, 16);
    assert_eq!(
        (c.arch, c.rope_style, c.rope_theta, c.rope_scaling.clone()),
        (Arch::Llama, RopeStyle::Interleaved, 10000.0, None)
    );
    assert!(!c.tie_word_embeddings && !c.attention_bias);
    assert_eq!(c.eos_token_ids, vec![2]);
    let dtype = |name: &str| ckpt.tensor(name).unwrap().dtype;
    assert_eq!(dtype("model.embed_tokens.weight"), DType::Q8_0);
    assert_eq!(dtype("model.layers.0.self_attn.q_proj.weight"), DType::Q4_0);
    assert_eq!(dtype("model.layers.0.mlp.up_proj.weight"), DType::Q4_1);
    assert_eq!(dtype("model.norm.weight"), DType::F32);
    assert_eq!(ckpt.tensor("lm_head.weight").unwrap().shape, vec![384, 64]);

    let ckpt = fixture("qwen2-f16.gguf");
    let c = ckpt.config();
    assert_tiny_shape(c, 2, 16);
    assert_eq!((c.arch, c.rope_style, c.rope_theta), (Arch::Qwen2, RopeStyle::Half, 1e6));
    assert!(c.tie_word_embeddings && c.attention_bias);
    assert_eq!(ckpt.tensor("model.layers.1.self_attn.v_proj.bias").unwrap().shape, vec![32]);

    let ckpt = fixture("llama-bf16.gguf");
    let c = ckpt.config();
    assert_tiny_shape(c, 2, 16);
    assert_eq!((c.rope_style, c.rope_theta), (RopeStyle::Interleaved, 100000.0));
    assert!(c.tie_word_embeddings && !ckpt.has_tensor("lm_head.weight"));
    assert_eq!(ckpt.tensor("model.layers.0.mlp.gate_proj.weight").unwrap().dtype, DType::BF16);
}

#[test]
fn fixture_gguf_tensors_all_have_hugging_face_names() {
    for name in ["llama-q.gguf", "qwen2-f16.gguf", "llama-bf16.gguf"] {
        let ckpt = fixture(name);
        let mapped: std::collections::HashSet<String> =
            hf_names(ckpt.config()).iter().filter_map(|n| hf_to_gguf_name(n)).collect();
        for t in ckpt.gguf().unwrap().tensors() {
            assert!(mapped.contains(&t.name), "{name}: `{}` has no Hugging Face name", t.name);
        }
    }
}

/// A `qwen3_moe` config: which layers are sparse follows `mlp_only_layers`
/// and `decoder_sparse_step` as transformers reads them; absent keys take
/// transformers' defaults; a top-k wider than the experts is refused.
#[test]
fn hf_qwen3_moe_config_marks_the_sparse_layers() {
    let moe = |extra: &[(&str, Option<serde_json::Value>)]| {
        let mut changes = vec![
            ("architectures", Some(serde_json::json!(["Qwen3MoeForCausalLM"]))),
            ("num_hidden_layers", Some(6.into())),
            ("num_experts", Some(8.into())),
            ("num_experts_per_tok", Some(2.into())),
            ("moe_intermediate_size", Some(16.into())),
        ];
        changes.extend_from_slice(extra);
        cfg(&edit(LLAMA_CONFIG, &changes))
    };
    let c =
        moe(&[("mlp_only_layers", Some(serde_json::json!([0, 4]))), ("norm_topk_prob", Some(true.into()))])
            .unwrap();
    assert_eq!(c.arch, Arch::Qwen3Moe);
    assert!(c.qk_norm);
    let m = c.moe.clone().expect("a MoE config");
    assert_eq!((m.num_experts, m.experts_per_token, m.expert_intermediate_size), (8, 2, 16));
    assert!(m.norm_topk_prob);
    assert_eq!(m.sparse_layers, vec![false, true, true, true, false, true]);

    let c = moe(&[("num_experts", None), ("num_local_experts", Some(6.into()))]).unwrap();
    assert_eq!(c.moe.unwrap().num_experts, 6, "transformers 5's spelling");

    let c = moe(&[("decoder_sparse_step", Some(2.into()))]).unwrap();
    let m = c.moe.expect("a MoE config");
    assert_eq!(m.sparse_layers, vec![false, true, false, true, false, true]);
    assert!(!m.norm_topk_prob, "transformers' default");

    let err = moe(&[("num_experts_per_tok", Some(9.into()))]).unwrap_err();
    assert!(err.to_string().contains("num_experts_per_tok"), "{err}");
    let err = moe(&[("mlp_only_layers", Some("all".into()))]).unwrap_err();
    assert!(err.to_string().contains("mlp_only_layers"), "{err}");

    let by_type = edit(LLAMA_CONFIG, &[("architectures", None), ("model_type", Some("qwen3_moe".into()))]);
    assert_eq!(cfg(&by_type).unwrap().arch, Arch::Qwen3Moe);
    // A dense architecture has no MoE config, whatever keys it carries.
    assert!(cfg(&edit(LLAMA_CONFIG, &[("num_experts", Some(8.into()))])).unwrap().moe.is_none());
}

/// Expert names map to one expert of llama.cpp's stacked tensors, the router
/// to `ffn_gate_inp`; malformed names map to nothing.
#[test]
fn expert_names_map_to_stacked_gguf_tensors() {
    use corridor_model::checkpoint::hf_to_gguf_expert;
    assert_eq!(
        hf_to_gguf_expert("model.layers.3.mlp.experts.5.up_proj.weight"),
        Some(("blk.3.ffn_up_exps.weight".to_string(), 5))
    );
    assert_eq!(
        hf_to_gguf_expert("model.layers.0.mlp.experts.12.down_proj.weight"),
        Some(("blk.0.ffn_down_exps.weight".to_string(), 12))
    );
    for bad in [
        "model.layers.0.mlp.experts.01.up_proj.weight",
        "model.layers.0.mlp.experts.x.up_proj.weight",
        "model.layers.0.mlp.experts.1.up_proj.bias",
        "model.layers.0.mlp.up_proj.weight",
    ] {
        assert_eq!(hf_to_gguf_expert(bad), None, "{bad}");
    }
    assert_eq!(
        hf_to_gguf_name("model.layers.2.mlp.gate.weight").as_deref(),
        Some("blk.2.ffn_gate_inp.weight")
    );
}

/// The tiny qwen3moe GGUF: MoE shape from the `qwen3moe.expert_*` keys,
/// every layer sparse (each holds a router), top-k renormalized as
/// llama.cpp runs the architecture; an expert past the stack is missing.
#[test]
fn gguf_qwen3moe_config_and_expert_views() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/qwen3-moe-f16.gguf");
    let ckpt = Checkpoint::open(&path).unwrap();
    let c = ckpt.config();
    assert_eq!((c.arch, c.head_dim, c.num_layers), (Arch::Qwen3Moe, 32, 2));
    assert!(c.qk_norm);
    let m = c.moe.clone().unwrap();
    assert_eq!((m.num_experts, m.experts_per_token, m.expert_intermediate_size), (4, 2, 32));
    assert!(m.norm_topk_prob);
    assert_eq!(m.sparse_layers, vec![true, true]);
    let e1 = ckpt.tensor("model.layers.1.mlp.experts.1.gate_proj.weight").unwrap();
    assert_eq!((e1.dtype, e1.shape.clone()), (DType::F16, vec![32, 64]));
    let stacked = ckpt.gguf().unwrap().tensor("blk.1.ffn_gate_exps.weight").unwrap();
    let per = stacked.data.len() / 4;
    assert_eq!(e1.data.bytes(), &stacked.data.bytes()[per..2 * per], "expert 1 is the second block of rows");
    assert!(ckpt.has_tensor("model.layers.1.mlp.experts.3.down_proj.weight"));
    assert!(!ckpt.has_tensor("model.layers.1.mlp.experts.4.down_proj.weight"));
    let err = ckpt.tensor("model.layers.1.mlp.experts.4.down_proj.weight").unwrap_err();
    assert!(err.to_string().contains("4 experts"), "{err}");
}

/// A `qwen3_5_text` config: layer types listed or from the interval, the
/// linear-attention heads with transformers' defaults, the rotated share of a
/// head; shapes no forward pass can run are refused naming the key.
#[test]
fn hf_qwen3_5_config_reads_the_hybrid_layout() {
    let hybrid = |extra: &[(&str, Option<serde_json::Value>)]| {
        let mut changes = vec![
            ("architectures", Some(serde_json::json!(["Qwen3_5ForCausalLM"]))),
            ("num_hidden_layers", Some(8.into())),
            ("head_dim", Some(32.into())),
            ("linear_num_key_heads", Some(2.into())),
            ("linear_num_value_heads", Some(4.into())),
            ("linear_key_head_dim", Some(16.into())),
            ("linear_value_head_dim", Some(8.into())),
        ];
        changes.extend_from_slice(extra);
        cfg(&edit(LLAMA_CONFIG, &changes))
    };
    use corridor_model::LayerKind::{Full, Linear};
    let c = hybrid(&[]).unwrap();
    assert_eq!(c.arch, Arch::Qwen35);
    assert!(c.qk_norm && c.moe.is_none());
    let h = c.hybrid.clone().expect("a hybrid config");
    assert_eq!(h.layer_types, [Linear, Linear, Linear, Full, Linear, Linear, Linear, Full]);
    assert_eq!(c.kv_layers(), 2);
    assert_eq!(
        (h.delta.k_heads, h.delta.v_heads, h.delta.k_dim, h.delta.v_dim, h.delta.conv_kernel),
        (2, 4, 16, 8, 4)
    );
    assert_eq!(h.rotary_dim, 8, "a quarter of the head by default");

    let c =
        hybrid(&[("full_attention_interval", Some(2.into())), ("partial_rotary_factor", Some(0.5.into()))])
            .unwrap();
    let h = c.hybrid.unwrap();
    assert_eq!(h.count(Full), 4);
    assert_eq!(h.rotary_dim, 16);
    let c = hybrid(&[
        ("rope_theta", None),
        ("rope_scaling", None),
        (
        "rope_parameters",
        Some(serde_json::json!({"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 1.0, "mrope_section": [11, 11, 10]})),
    ),
    ])
    .unwrap();
    assert_eq!((c.hybrid.unwrap().rotary_dim, c.rope_theta), (32, 1e7));
    let listed = serde_json::json!([
        "full_attention",
        "linear_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
        "linear_attention",
        "linear_attention",
        "linear_attention"
    ]);
    let h = hybrid(&[("layer_types", Some(listed))]).unwrap().hybrid.unwrap();
    assert_eq!(h.layer_types[..2], [Full, Linear]);

    let err = hybrid(&[("layer_types", Some(serde_json::json!(["full_attention", "mamba"])))]).unwrap_err();
    assert!(err.to_string().contains("layer_types"), "{err}");
    let err = hybrid(&[("layer_types", Some(serde_json::json!(["full_attention"])))]).unwrap_err();
    assert!(err.to_string().contains("1 layer types for 8 layers"), "{err}");
    let err = hybrid(&[("linear_num_value_heads", Some(3.into()))]).unwrap_err();
    assert!(err.to_string().contains("linear_num_value_heads"), "{err}");
    let err = hybrid(&[("partial_rotary_factor", Some(0.0.into()))]).unwrap_err();
    assert!(err.to_string().contains("partial_rotary_factor"), "{err}");

    // The released checkpoints: a multimodal wrapper around the text config.
    let text: serde_json::Value = serde_json::from_str(&edit(
        LLAMA_CONFIG,
        &[
            ("architectures", None),
            ("model_type", Some("qwen3_5_text".into())),
            ("num_hidden_layers", Some(4.into())),
            ("head_dim", Some(32.into())),
        ],
    ))
    .unwrap();
    let wrapped = serde_json::json!({"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text, "vision_config": {}});
    let c = cfg(&wrapped.to_string()).unwrap();
    assert_eq!((c.arch, c.num_layers, c.kv_layers()), (Arch::Qwen35, 4, 1));
    let err = cfg(r#"{"architectures": ["Qwen3_5ForConditionalGeneration"]}"#).unwrap_err();
    assert!(err.to_string().contains("text_config"), "{err}");
}

/// llama.cpp's `qwen35` metadata: the delta-net's heads from the `ssm.*`
/// keys, value heads tiled, layer types from the interval, the rotated share
/// from `rope.dimension_count`; the same shapes as the Hugging Face config.
#[test]
fn gguf_qwen35_config_matches_its_hugging_face_twin() {
    use corridor_backend::VHeadOrder;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny");
    let g = Checkpoint::open(&dir.join("qwen3_5-f16.gguf")).unwrap().config().clone();
    let hf = Checkpoint::open(&dir.join("qwen3_5")).unwrap().config().clone();
    assert_eq!(g.arch, Arch::Qwen35);
    let (gh, hh) = (g.hybrid.clone().unwrap(), hf.hybrid.clone().unwrap());
    assert_eq!(gh.delta.v_order, VHeadOrder::Tiled);
    assert_eq!(hh.delta.v_order, VHeadOrder::Grouped);
    assert_eq!(gh.delta, corridor_backend::DeltaGeometry { v_order: VHeadOrder::Tiled, ..hh.delta });
    assert_eq!((gh.layer_types, gh.rotary_dim), (hh.layer_types, hh.rotary_dim));
    assert_eq!(
        (g.head_dim, g.num_heads, g.num_kv_heads, g.qk_norm, g.tie_word_embeddings, g.rope_style),
        (hf.head_dim, hf.num_heads, hf.num_kv_heads, hf.qk_norm, hf.tie_word_embeddings, hf.rope_style)
    );
}
