//! The CPU backend's opt-in bf16 rounding (`cpu::Bf16Rounding`), with which
//! a device that holds matrices in bf16, feeds its GEMMs bf16 inputs and its
//! integer GEMVs 8-bit ones is compared with the CPU arithmetic it should
//! match: rounded matrices and inputs give exactly what pre-rounded operands
//! give, 8-bit inputs exactly the CPU's own 8-bit decode, vectors and the
//! matmuls the rule leaves alone stay exact, and a backend without the
//! option computes as before.

use corridor_backend::cpu::{Bf16Rounding, CpuBackend, DecodeActivations, InputRounding, MatmulInput};
use corridor_backend::{ActShape, Backend, DType, HostTensor, TensorBytes};
use half::{bf16, f16};

fn tensor(dtype: DType, rows: usize, cols: usize, values: &[f32]) -> HostTensor {
    let data = match dtype {
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => values.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect(),
        d => panic!("no {d} tensors here"),
    };
    HostTensor { name: "w".into(), dtype, shape: vec![rows, cols], data: TensorBytes::from_vec(data) }
}

/// An activation holding `values`, made on an exact backend (through an
/// embedding table, which a rounding backend would round).
fn act(rows: usize, cols: usize, values: &[f32]) -> <CpuBackend as Backend>::Act {
    let b = CpuBackend::new();
    let table = b.upload_weight(&tensor(DType::F32, rows, cols, values)).unwrap();
    let mut a = b.alloc_act(ActShape { rows, cols }).unwrap();
    b.embedding(&table, &(0..rows as u32).collect::<Vec<_>>(), &mut a).unwrap();
    a
}

fn matmul(b: &CpuBackend, x: &[f32], rows: usize, w: &HostTensor) -> Vec<f32> {
    let (n, k) = (w.shape[0], w.shape[1]);
    let wt = b.upload_weight(w).unwrap();
    let mut out = b.alloc_act(ActShape { rows, cols: n }).unwrap();
    b.matmul(&act(rows, k, x), &wt, None, rows, &mut out);
    let mut v = Vec::new();
    b.read_rows(&out, rows, &mut v);
    v
}

/// Values no bf16 holds exactly (and most f16s do not either).
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n).map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 10007) as f32 / 3001.7 - 1.6).collect()
}

fn rounded(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

#[test]
fn matrices_are_held_in_bf16_and_vectors_as_stored() {
    let (n, k, rows) = (40, 64, 3);
    let (w, x) = (values(n * k, 1), values(rows * k, 2));
    let exact = CpuBackend::new();
    let held = CpuBackend::new().with_bf16_rounding(Bf16Rounding { weights: true, kv: false, inputs: None });
    let want = matmul(&exact, &x, rows, &tensor(DType::F32, n, k, &rounded(&w)));
    assert_eq!(matmul(&held, &x, rows, &tensor(DType::F32, n, k, &w)), want);
    assert_ne!(matmul(&exact, &x, rows, &tensor(DType::F32, n, k, &w)), want, "the option changed nothing");
    // An f16 matrix is widened, then rounded to bf16 as the device holds it.
    let w16: Vec<f32> = w.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
    let want16 = matmul(&exact, &x, rows, &tensor(DType::F32, n, k, &rounded(&w16)));
    assert_eq!(matmul(&held, &x, rows, &tensor(DType::F16, n, k, &w)), want16);
    // A vector (one row: a norm weight, a bias) keeps its f32 values.
    let v = values(k, 3);
    let table = held.upload_weight(&tensor(DType::F32, 1, k, &v)).unwrap();
    let mut out = held.alloc_act(ActShape { rows: 1, cols: k }).unwrap();
    held.embedding(&table, &[0], &mut out).unwrap();
    let mut got = Vec::new();
    held.read_rows(&out, 1, &mut got);
    assert_eq!(got, v);
}

#[test]
fn inputs_are_rounded_where_the_rule_says() {
    let (n, k) = (24, 48);
    let w = tensor(DType::F32, n, k, &values(n * k, 4));
    let exact = CpuBackend::new();
    // Round the input of matmuls of more than 2 rows against f32 matrices.
    let b = CpuBackend::new().with_bf16_rounding(Bf16Rounding {
        weights: false,
        kv: false,
        inputs: Some(|dtype, wn, wk, rows| {
            if dtype == DType::F32 && (wn, wk) == (24, 48) && rows > 2 {
                MatmulInput::Bf16
            } else {
                MatmulInput::F32
            }
        }),
    });
    for rows in [1, 2, 3, 9, 40] {
        let x = values(rows * k, rows as u32);
        let got = matmul(&b, &x, rows, &w);
        let want =
            if rows > 2 { matmul(&exact, &rounded(&x), rows, &w) } else { matmul(&exact, &x, rows, &w) };
        assert_eq!(got, want, "{rows} rows");
        if rows > 2 {
            assert_ne!(got, matmul(&exact, &x, rows, &w), "{rows} rows: the input was not rounded");
        }
    }
}

/// 8 bits for a block format, f32 for the rest.
fn q8(dtype: DType) -> MatmulInput {
    if dtype.is_quantized() {
        MatmulInput::Q8
    } else {
        MatmulInput::F32
    }
}

/// Random Q4_K rows: random quant and 6-bit scale bytes, small f16 scales.
fn q4_k(rows: usize, cols: usize) -> HostTensor {
    let mut data = Vec::new();
    let mut seed = 0x2545f4914f6cdd1du64;
    for _ in 0..rows * cols / 256 {
        let mut blk: Vec<u8> = (0..144)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed >> 56) as u8
            })
            .collect();
        blk[0..2].copy_from_slice(&f16::from_f32(0.003).to_le_bytes());
        blk[2..4].copy_from_slice(&f16::from_f32(0.001).to_le_bytes());
        data.extend(blk);
    }
    HostTensor {
        name: "w".into(),
        dtype: DType::Q4_K,
        shape: vec![rows, cols],
        data: TensorBytes::from_vec(data),
    }
}

/// The reference of a device whose decode GEMVs quantize their input to 8
/// bits (CUDA's integer GEMVs): it keeps f32 activations everywhere else, and
/// where the rule says `Q8` computes exactly what the CPU's own 8-bit decode
/// does (`quant::Q8Row` and the integer dot), at any number of rows.
#[test]
fn q8_inputs_take_the_cpus_8_bit_dot_where_the_rule_says() {
    let (n, k) = (40, 512);
    let w = q4_k(n, k);
    let f32_acts = CpuBackend::with_decode_activations(DecodeActivations::F32);
    let q8_acts = CpuBackend::new();
    let reference = |rule: InputRounding| {
        CpuBackend::with_decode_activations(DecodeActivations::F32).with_bf16_rounding(Bf16Rounding {
            weights: true,
            kv: false,
            inputs: Some(rule),
        })
    };
    let decode = reference(|dtype, _, _, rows| if rows <= 8 { q8(dtype) } else { MatmulInput::F32 });
    let every = reference(|dtype, _, _, _| q8(dtype));
    for rows in [1, 3, 8, 9] {
        let x = values(rows * k, 7 + rows as u32);
        let got = matmul(&decode, &x, rows, &w);
        if rows <= 8 {
            assert_eq!(got, matmul(&q8_acts, &x, rows, &w), "{rows} rows: not the CPU's 8-bit decode");
            assert_ne!(got, matmul(&f32_acts, &x, rows, &w), "{rows} rows: the input stayed f32");
        } else {
            assert_eq!(got, matmul(&f32_acts, &x, rows, &w), "{rows} rows: the rule said f32");
        }
    }
    // Past 8 rows the 8-bit dot runs 8 rows at a time, each row as alone.
    let rows = 11;
    let x = values(rows * k, 99);
    let got = matmul(&every, &x, rows, &w);
    let (head, tail) = x.split_at(8 * k);
    let mut want = matmul(&q8_acts, head, 8, &w);
    want.extend(matmul(&q8_acts, tail, 3, &w));
    assert_eq!(got, want);
}
