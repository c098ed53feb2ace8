//! Every ggml block format against a plain dequantizer written here, weight by
//! weight, from the format's definition (ggml-common.h's structs and the
//! meaning of each field), independently of the kernels' block unpacking.
//!
//! Blocks are random bytes with their f16 scale fields set to chosen values,
//! plus the edge blocks: every quant byte 0x00 or 0xFF (the extreme codes and
//! the extreme 6-bit sub-scales), scales at ±65504 (the largest f16), the
//! smallest subnormal, zero and negative. Dequantization must match exactly
//! (the same f32 products); the f32 dot product within its summation order.

use corridor_backend::cpu::quant::{
    dequantize_row, dot_many_rows_q8, dot_row, dot_row_q8, dot_row_q8_portable, dot_rows_q8, Q8Row,
};
use corridor_backend::DType;
use half::f16;

/// xorshift64*: a fixed, dependency-free source of test bytes.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn byte(&mut self) -> u8 {
        (self.next() >> 56) as u8
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

const IQ4: [f32; 16] =
    [-127., -104., -83., -65., -49., -35., -22., -10., 1., 13., 25., 38., 53., 69., 89., 113.];

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Nibble `i` (0..32) of a 32-weight block whose 16 quant bytes start at
/// `qs`: weights 0..16 are the low nibbles, 16..32 the high ones.
fn nib32(b: &[u8], qs: usize, i: usize) -> u32 {
    let byte = b[qs + i % 16] as u32;
    if i < 16 {
        byte & 15
    } else {
        byte >> 4
    }
}

/// Bit `i` of the little-endian u32 at `at`.
fn bit32(b: &[u8], at: usize, i: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) >> i & 1
}

/// The 6-bit scale (`min = false`) or min of sub-block `j` of Q4_K/Q5_K.
fn k_scale(b: &[u8], j: usize, min: bool) -> f32 {
    let s = &b[4..16];
    let v = match (j < 4, min) {
        (true, false) => s[j] & 0x3f,
        (true, true) => s[j + 4] & 0x3f,
        (false, false) => (s[j + 4] & 0x0f) | (s[j - 4] >> 6) << 4,
        (false, true) => (s[j + 4] >> 4) | (s[j] >> 6) << 4,
    };
    v as f32
}

/// Q3_K's sixteen signed scales, unpacked the way the format packs them:
/// three little-endian words, the low nibbles in the first two and the
/// 2-bit high parts in the third.
fn q3k_scales(b: &[u8]) -> [i32; 16] {
    let w = |i: usize| u32::from_le_bytes([b[96 + 4 * i], b[97 + 4 * i], b[98 + 4 * i], b[99 + 4 * i]]);
    let (a0, a1, t) = (w(0), w(1), w(2));
    let words = [
        (a0 & 0x0f0f_0f0f) | ((t & 0x0303_0303) << 4),
        (a1 & 0x0f0f_0f0f) | (((t >> 2) & 0x0303_0303) << 4),
        ((a0 >> 4) & 0x0f0f_0f0f) | (((t >> 4) & 0x0303_0303) << 4),
        ((a1 >> 4) & 0x0f0f_0f0f) | (((t >> 6) & 0x0303_0303) << 4),
    ];
    let mut out = [0i32; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = ((words[i / 4] >> (8 * (i % 4))) & 0xff) as i32 - 32;
    }
    out
}

/// Weight `i` of one block, from the format's definition.
fn reference(dtype: DType, b: &[u8], i: usize) -> f32 {
    match dtype {
        DType::Q8_0 => h(b, 0) * (b[2 + i] as i8) as f32,
        DType::Q4_0 => h(b, 0) * (nib32(b, 2, i) as f32 - 8.0),
        DType::Q4_1 => h(b, 0) * nib32(b, 4, i) as f32 + h(b, 2),
        DType::IQ4_NL => h(b, 0) * IQ4[nib32(b, 2, i) as usize],
        DType::Q5_0 => h(b, 0) * ((nib32(b, 6, i) | bit32(b, 2, i) << 4) as f32 - 16.0),
        DType::Q5_1 => h(b, 0) * (nib32(b, 8, i) | bit32(b, 4, i) << 4) as f32 + h(b, 2),
        DType::Q2_K => {
            // 256 weights = 2 halves of 128; in a half, 4 bit-pairs of 32 bytes.
            let (half, pair, l) = (i / 128, i % 128 / 32, i % 32);
            let code = (b[16 + 32 * half + l] >> (2 * pair)) & 3;
            let sc = b[i / 16];
            h(b, 80) * (sc & 15) as f32 * code as f32 - h(b, 82) * (sc >> 4) as f32
        }
        DType::Q3_K => {
            let (half, pair, l) = (i / 128, i % 128 / 32, i % 32);
            let low = ((b[32 + 32 * half + l] >> (2 * pair)) & 3) as i32;
            let high_set = b[l] >> (4 * half + pair) & 1 == 1;
            let code = low - if high_set { 0 } else { 4 };
            h(b, 108) * q3k_scales(b)[i / 16] as f32 * code as f32
        }
        DType::Q4_K | DType::Q5_K => {
            // Sub-block j of 32; pairs of sub-blocks share 32 quant bytes.
            let (j, l) = (i / 32, i % 32);
            let qs = if dtype == DType::Q5_K { 48 } else { 16 };
            let byte = b[qs + 32 * (j / 2) + l];
            let mut code = if j % 2 == 0 { byte & 15 } else { byte >> 4 } as u32;
            if dtype == DType::Q5_K {
                code += 16 * ((b[16 + l] >> j) & 1) as u32;
            }
            h(b, 0) * k_scale(b, j, false) * code as f32 - h(b, 2) * k_scale(b, j, true)
        }
        DType::Q6_K => {
            let (half, quarter, l) = (i / 128, i % 128 / 32, i % 32);
            let byte = b[64 * half + 32 * (quarter % 2) + l];
            let low = if quarter < 2 { byte & 15 } else { byte >> 4 } as i32;
            let high = ((b[128 + 32 * half + l] >> (2 * quarter)) & 3) as i32;
            h(b, 208) * (b[192 + i / 16] as i8) as f32 * ((low | high << 4) - 32) as f32
        }
        DType::IQ4_XS => {
            let j = i / 32;
            let low = (b[4 + j / 2] >> (4 * (j % 2))) & 15;
            let high = (u16::from_le_bytes([b[2], b[3]]) >> (2 * j)) & 3;
            let scale = (low as i32 | (high as i32) << 4) - 32;
            h(b, 0) * scale as f32 * IQ4[nib32(b, 8 + 16 * j, i % 32) as usize]
        }
        DType::F32 | DType::F16 | DType::BF16 => unreachable!(),
    }
}

/// Byte offsets of each format's f16 scale fields.
fn f16_fields(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
        _ => &[0],
    }
}

const BLOCK_TYPES: [DType; 12] = DType::BLOCK_FORMATS;

/// Blocks of `dtype`: random and edge, each as its bytes.
fn blocks(dtype: DType, rng: &mut Rng) -> Vec<Vec<u8>> {
    let bb = dtype.block_bytes();
    let scales = [1.0f32, -0.75, 0.0, 65504.0, -65504.0, 5.96e-8, 6.1e-5, 0.0123];
    let mut out = Vec::new();
    for fill in [None, Some(0x00u8), Some(0xff)] {
        for (si, &s) in scales.iter().enumerate() {
            for _ in 0..if fill.is_none() { 6 } else { 1 } {
                let mut b: Vec<u8> = (0..bb).map(|_| fill.unwrap_or_else(|| rng.byte())).collect();
                for (k, &at) in f16_fields(dtype).iter().enumerate() {
                    // Second fields (min, dmin) take the next scale, so the
                    // pairs vary independently.
                    let v = if k == 0 { s } else { scales[(si + 3) % scales.len()] };
                    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
                }
                out.push(b);
            }
        }
    }
    out
}

#[test]
fn sizes_follow_the_ggml_structs() {
    let want = [
        (DType::Q5_0, 32, 22),
        (DType::Q5_1, 32, 24),
        (DType::IQ4_NL, 32, 18),
        (DType::Q2_K, 256, 84),
        (DType::Q3_K, 256, 110),
        (DType::Q4_K, 256, 144),
        (DType::Q5_K, 256, 176),
        (DType::Q6_K, 256, 210),
        (DType::IQ4_XS, 256, 136),
    ];
    for (dtype, elems, bytes) in want {
        assert_eq!((dtype.block_elems(), dtype.block_bytes()), (elems, bytes), "{dtype}");
        assert_eq!(dtype.bytes_for(2 * elems), Some(2 * bytes), "{dtype}");
        assert_eq!(dtype.bytes_for(elems + 16), None, "{dtype}");
    }
}

#[test]
fn every_block_format_dequantizes_as_its_definition() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for dtype in BLOCK_TYPES {
        let be = dtype.block_elems();
        for b in blocks(dtype, &mut rng) {
            let mut got = vec![0f32; be];
            dequantize_row(dtype, &b, &mut got);
            for (i, g) in got.iter().enumerate() {
                let want = reference(dtype, &b, i);
                assert!(
                    g.to_bits() == want.to_bits() || (g - want).abs() <= 1e-6 * want.abs(),
                    "{dtype} block {:02x?} weight {i}: {g} vs {want}",
                    &b[..8]
                );
            }
        }
    }
}

#[test]
fn every_block_format_dots_as_its_definition() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for dtype in BLOCK_TYPES {
        let be = dtype.block_elems();
        // Rows of three blocks, so the cross-block accumulation is exercised.
        let bs = blocks(dtype, &mut rng);
        for row in bs.chunks_exact(3) {
            let bytes: Vec<u8> = row.concat();
            let x: Vec<f32> = (0..3 * be).map(|_| rng.unit()).collect();
            let (mut want, mut mag) = (0f64, 0f64);
            for (i, &xi) in x.iter().enumerate() {
                let w = reference(dtype, &row[i / be], i % be) as f64;
                want += w * xi as f64;
                mag += (w * xi as f64).abs();
            }
            let got = dot_row(dtype, &bytes, &x) as f64;
            assert!((got - want).abs() <= 1e-5 * mag + 1e-30, "{dtype}: {got} vs {want} (magnitude {mag})");
        }
    }
}

/// Decode's integer path: the weights dotted with the activation row as
/// quantized to 8 bits per 32 (`Q8Row`). Against the exact f32 dot product it
/// may differ only by the activation rounding: at most `max|x_b| / 254` per
/// element of block `b`, times that block's `Σ|w|` (plus f32 summation
/// slack). Rows mix blocks of very different magnitude, so a scale applied to
/// the wrong block shows.
#[test]
fn q8_activation_dot_is_within_the_rounding_bound_for_every_block_format() {
    let mut rng = Rng(0x0bad_cafe_f00d_d00d);
    for dtype in BLOCK_TYPES {
        let be = dtype.block_elems();
        let bs = blocks(dtype, &mut rng);
        for row in bs.chunks_exact(3) {
            let bytes: Vec<u8> = row.concat();
            let n = 3 * be;
            let x: Vec<f32> = (0..n).map(|i| rng.unit() * [0.01f32, 3.0, 0.5, 40.0][i / 32 % 4]).collect();
            let mut xq = Q8Row::default();
            xq.quantize(&x);
            let w: Vec<f64> = (0..n).map(|i| reference(dtype, &row[i / be], i % be) as f64).collect();
            let exact: f64 = w.iter().zip(&x).map(|(w, x)| w * *x as f64).sum();
            let mag: f64 = w.iter().zip(&x).map(|(w, x)| (w * *x as f64).abs()).sum();
            let mut bound = 0f64;
            for b in 0..n / 32 {
                let amax = x[32 * b..32 * b + 32].iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
                let wsum: f64 = w[32 * b..32 * b + 32].iter().map(|v| v.abs()).sum();
                bound += amax / 254.0 * wsum;
            }
            let got = dot_row_q8(dtype, &bytes, &xq) as f64;
            assert!(
                (got - exact).abs() <= bound * (1.0 + 1e-4) + 1e-5 * mag + 1e-30,
                "{dtype}: {got} vs exact {exact}, bound {bound}"
            );
            // Against the quantized activations themselves the integer path is
            // exact up to f32 summation.
            let xd = xq.dequantized();
            let same: f64 = w.iter().zip(&xd).map(|(w, x)| w * *x as f64).sum();
            let smag: f64 = w.iter().zip(&xd).map(|(w, x)| (w * *x as f64).abs()).sum();
            assert!((got - same).abs() <= 1e-5 * smag + 1e-30, "{dtype}: {got} vs {same}");
            // The AVX2 build and the portable build agree bit for bit.
            let portable = dot_row_q8_portable(dtype, &bytes, &xq);
            assert_eq!(portable.to_bits(), (got as f32).to_bits(), "{dtype}: portable {portable} vs {got}");
        }
    }
}

/// Several activation rows against one weight row at once give each row
/// exactly what one row alone gives, for every block format and every count
/// of rows a decode step takes.
/// `count` activation rows of n values quantized to 8 bits, each with
/// blocks of four magnitudes (0.01 to 40) in a different order.
fn q8_rows(rng: &mut Rng, count: usize, n: usize) -> Vec<Q8Row> {
    (0..count)
        .map(|r| {
            let x: Vec<f32> =
                (0..n).map(|i| rng.unit() * [0.01f32, 3.0, 0.5, 40.0][(i / 32 + r) % 4]).collect();
            let mut q = Q8Row::default();
            q.quantize(&x);
            q
        })
        .collect()
}

#[test]
fn q8_dot_of_several_rows_is_each_rows_own_dot() {
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    for dtype in BLOCK_TYPES {
        let be = dtype.block_elems();
        let bs = blocks(dtype, &mut rng);
        let bytes: Vec<u8> = bs[..3].concat();
        let n = 3 * be;
        for rows in 1..=8 {
            let xs = q8_rows(&mut rng, rows, n);
            let mut got = vec![0f32; rows];
            dot_rows_q8(dtype, &bytes, &xs, &mut got);
            for (r, x) in xs.iter().enumerate() {
                let one = dot_row_q8(dtype, &bytes, x);
                assert_eq!(
                    got[r].to_bits(),
                    one.to_bits(),
                    "{dtype}, row {r} of {rows}: {} vs {one}",
                    got[r]
                );
            }
        }
    }
}

/// The decode matmul's kernel (`dot_many_rows_q8`: several weight rows
/// against 1 to 8 activation rows, with the format chosen once) on rows long
/// enough for every unrolled loop, with an odd count of 32-weight blocks
/// (the even/odd pairs and the tail) and several super-blocks: every value
/// is bit for bit the portable build's dot of that weight row with that
/// activation row, for every block format, edge blocks included. On x86-64
/// with AVX2 this checks the register kernels (`codes_avx2`, the F16C scale
/// loads, the vector scale unpacking of Q4_K/Q5_K/Q6_K) against the scalar
/// reference, so a wrong code, scale or order in any of them shows.
#[test]
fn q8_many_rows_are_the_portable_dot_bit_for_bit() {
    let mut rng = Rng(0x7e57_0000_c0de_0042);
    let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    for dtype in BLOCK_TYPES {
        let be = dtype.block_elems();
        let per_row = if be == 32 { 19 } else { 3 };
        let n = per_row * be;
        let row_bytes = per_row * dtype.block_bytes();
        let bs = blocks(dtype, &mut rng);
        // Five weight rows drawn from the random and edge blocks.
        let nrows = 5;
        let w: Vec<u8> = (0..nrows * per_row)
            .flat_map(|i| bs[(i * 7 + (rng.next() as usize % 3)) % bs.len()].clone())
            .collect();
        assert_eq!(w.len(), nrows * row_bytes);
        for count in 1..=8 {
            let xs = q8_rows(&mut rng, count, n);
            let mut got = vec![0f32; nrows * count];
            dot_many_rows_q8(dtype, &w, row_bytes, &xs, &mut got);
            for i in 0..nrows {
                let row = &w[i * row_bytes..(i + 1) * row_bytes];
                for (r, x) in xs.iter().enumerate() {
                    let want = dot_row_q8_portable(dtype, row, x);
                    let g = got[i * count + r];
                    assert!(
                        same(g, want),
                        "{dtype}, weight row {i}, {count} rows, row {r}: {g} vs portable {want}"
                    );
                    let one = dot_row_q8(dtype, row, x);
                    assert!(same(one, want), "{dtype}, weight row {i}: dot_row_q8 {one} vs portable {want}");
                }
            }
        }
    }
}

#[test]
fn q8_rows_round_each_element_to_half_a_step() {
    let mut rng = Rng(77);
    let x: Vec<f32> = (0..96).map(|i| if i < 32 { 0.0 } else { rng.unit() * 5.0 }).collect();
    let mut q = Q8Row::default();
    q.quantize(&x);
    let d = q.dequantized();
    for b in 0..3 {
        let amax = x[32 * b..32 * b + 32].iter().fold(0f32, |a, v| a.max(v.abs()));
        for i in 32 * b..32 * b + 32 {
            assert!((d[i] - x[i]).abs() <= amax / 254.0 * 1.0001, "element {i}: {} vs {}", d[i], x[i]);
        }
    }
    assert!(d[..32].iter().all(|v| *v == 0.0), "an all-zero block stays zero");
}
