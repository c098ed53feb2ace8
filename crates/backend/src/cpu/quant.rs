//! Dot products and row dequantization straight from ggml block formats.
//!
//! Decode reads every weight once per step, so these loops are the CPU
//! backend's hot path: they consume the quantized bytes directly instead of
//! widening the matrix to f32 (a Q4_1 model must not need four times its size
//! in RAM). Each block's scale is applied once per block, and the inner loops
//! are written over fixed 16-element halves so the compiler vectorizes them.

use crate::dtype::{DType, QK};
use half::{bf16, f16};

#[inline(always)]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Dot product of one stored row (`dtype`, `x.len()` elements) with `x`.
///
/// The loops below are written for the compiler to vectorize; on x86-64 the
/// same code is compiled a second time with AVX2 and FMA enabled and chosen
/// at run time, so a portable binary still uses the wide registers.
pub fn dot_row(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { dot_row_avx2(dtype, row, x) };
    }
    dot_row_generic(dtype, row, x)
}

/// Whether this CPU has AVX2 and FMA (cached by the standard library).
#[cfg(target_arch = "x86_64")]
#[inline]
fn has_avx2() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_row_avx2(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    dot_row_generic(dtype, row, x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_f32_generic(a, b)
}

#[inline(always)]
fn dot_row_generic(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    match dtype {
        DType::F32 => {
            let w: &[f32] = bytemuck::cast_slice(row);
            dot_f32_generic(w, x)
        }
        DType::F16 => {
            let mut acc = [0f32; 8];
            for (c, xs) in row.chunks_exact(16).zip(x.chunks_exact(8)) {
                for i in 0..8 {
                    acc[i] += f16_at(c, 2 * i) * xs[i];
                }
            }
            acc.iter().sum::<f32>() + tail_dot(dtype, row, x, 8)
        }
        DType::BF16 => {
            let mut acc = [0f32; 8];
            for (c, xs) in row.chunks_exact(16).zip(x.chunks_exact(8)) {
                for i in 0..8 {
                    acc[i] += bf16::from_le_bytes([c[2 * i], c[2 * i + 1]]).to_f32() * xs[i];
                }
            }
            acc.iter().sum::<f32>() + tail_dot(dtype, row, x, 8)
        }
        // The block formats accumulate lane-wise across blocks (the block's
        // scale broadcast into 16 lanes) and reduce once per row: a
        // horizontal sum per 32-weight block would cost as much as the block.
        DType::Q8_0 => {
            let mut tot = [0f32; 16];
            for (b, xs) in row.chunks_exact(34).zip(x.chunks_exact(QK)) {
                let d = f16_at(b, 0);
                let q: &[u8; 32] = b[2..34].try_into().expect("34-byte block");
                let (x0, x1) = xs.split_at(16);
                for i in 0..16 {
                    tot[i] += d * ((q[i] as i8) as f32 * x0[i] + (q[i + 16] as i8) as f32 * x1[i]);
                }
            }
            tot.iter().sum()
        }
        DType::Q4_0 => {
            let mut tot = [0f32; 16];
            for (b, xs) in row.chunks_exact(18).zip(x.chunks_exact(QK)) {
                let d = f16_at(b, 0);
                let q: &[u8; 16] = b[2..18].try_into().expect("18-byte block");
                let (x0, x1) = xs.split_at(16);
                for i in 0..16 {
                    let lo = (q[i] & 0x0f) as f32 - 8.0;
                    let hi = (q[i] >> 4) as f32 - 8.0;
                    tot[i] += d * (lo * x0[i] + hi * x1[i]);
                }
            }
            tot.iter().sum()
        }
        DType::Q4_1 => {
            let mut tot = [0f32; 16];
            for (b, xs) in row.chunks_exact(20).zip(x.chunks_exact(QK)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                let q: &[u8; 16] = b[4..20].try_into().expect("20-byte block");
                let (x0, x1) = xs.split_at(16);
                for i in 0..16 {
                    let lo = (q[i] & 0x0f) as f32;
                    let hi = (q[i] >> 4) as f32;
                    tot[i] += d * (lo * x0[i] + hi * x1[i]) + m * (x0[i] + x1[i]);
                }
            }
            tot.iter().sum()
        }
    }
}

/// The leftover elements of an f16/bf16 row whose length is not a multiple of 8.
fn tail_dot(dtype: DType, row: &[u8], x: &[f32], lanes: usize) -> f32 {
    let done = x.len() / lanes * lanes;
    let mut out = vec![0f32; x.len() - done];
    dequantize_row(dtype, &row[done * 2..], &mut out);
    out.iter().zip(&x[done..]).map(|(a, b)| a * b).sum()
}

/// f32 dot product with sixteen independent accumulators (vectorizes well).
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { dot_f32_avx2(a, b) };
    }
    dot_f32_generic(a, b)
}

#[inline(always)]
fn dot_f32_generic(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 16];
    let chunks = a.len() / 16;
    for c in 0..chunks {
        let (xa, xb) = (&a[c * 16..c * 16 + 16], &b[c * 16..c * 16 + 16]);
        for i in 0..16 {
            acc[i] += xa[i] * xb[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 16..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// Widen one stored row of `out.len()` elements to f32.
pub fn dequantize_row(dtype: DType, row: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => out.copy_from_slice(bytemuck::cast_slice(&row[..out.len() * 4])),
        DType::F16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f16_at(row, 2 * i);
            }
        }
        DType::BF16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = bf16::from_le_bytes([row[2 * i], row[2 * i + 1]]).to_f32();
            }
        }
        DType::Q8_0 => {
            for (b, o) in row.chunks_exact(34).zip(out.chunks_exact_mut(QK)) {
                let d = f16_at(b, 0);
                for i in 0..QK {
                    o[i] = d * (b[2 + i] as i8) as f32;
                }
            }
        }
        DType::Q4_0 => {
            for (b, o) in row.chunks_exact(18).zip(out.chunks_exact_mut(QK)) {
                let d = f16_at(b, 0);
                for i in 0..16 {
                    o[i] = d * ((b[2 + i] & 0x0f) as i32 - 8) as f32;
                    o[i + 16] = d * ((b[2 + i] >> 4) as i32 - 8) as f32;
                }
            }
        }
        DType::Q4_1 => {
            for (b, o) in row.chunks_exact(20).zip(out.chunks_exact_mut(QK)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                for i in 0..16 {
                    o[i] = d * (b[4 + i] & 0x0f) as f32 + m;
                    o[i + 16] = d * (b[4 + i] >> 4) as f32 + m;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Quantize by the reference formulas, to check the dot product and the
    /// dequantizer agree with each other on every type.
    fn q4_1_block(w: &[f32]) -> Vec<u8> {
        let min = w.iter().cloned().fold(f32::INFINITY, f32::min);
        let max = w.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let d = (max - min) / 15.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut b = Vec::new();
        b.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        b.extend_from_slice(&f16::from_f32(min).to_le_bytes());
        for i in 0..16 {
            let lo = (((w[i] - min) * inv).round() as u8).min(15);
            let hi = (((w[i + 16] - min) * inv).round() as u8).min(15);
            b.push(lo | (hi << 4));
        }
        b
    }

    #[test]
    fn dot_matches_dequantized_dot_for_every_type() {
        let n = 64;
        let w: Vec<f32> = (0..n).map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0).collect();
        let x: Vec<f32> = (0..n).map(|i| ((i * 13 % 17) as f32 - 8.0) / 5.0).collect();
        let mut rows: Vec<(DType, Vec<u8>)> = vec![
            (DType::F32, bytemuck::cast_slice(&w).to_vec()),
            (DType::F16, w.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect()),
            (DType::BF16, w.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect()),
        ];
        let q41: Vec<u8> = w.chunks(32).flat_map(q4_1_block).collect();
        rows.push((DType::Q4_1, q41));
        let mut q80 = Vec::new();
        let mut q40 = Vec::new();
        for blk in w.chunks(32) {
            let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            q80.extend_from_slice(&f16::from_f32(d).to_le_bytes());
            q80.extend(blk.iter().map(|v| ((v / d).round() as i8) as u8));
            let d4 = amax / 8.0;
            q40.extend_from_slice(&f16::from_f32(d4).to_le_bytes());
            for i in 0..16 {
                let lo = ((blk[i] / d4).round() as i32 + 8).clamp(0, 15) as u8;
                let hi = ((blk[i + 16] / d4).round() as i32 + 8).clamp(0, 15) as u8;
                q40.push(lo | (hi << 4));
            }
        }
        rows.push((DType::Q8_0, q80));
        rows.push((DType::Q4_0, q40));
        let exact: f32 = w.iter().zip(&x).map(|(a, b)| a * b).sum();
        for (dtype, row) in rows {
            assert_eq!(row.len(), dtype.bytes_for(n).unwrap());
            let mut deq = vec![0f32; n];
            dequantize_row(dtype, &row, &mut deq);
            let via_deq: f32 = deq.iter().zip(&x).map(|(a, b)| a * b).sum();
            let direct = dot_row(dtype, &row, &x);
            assert!((direct - via_deq).abs() < 1e-3, "{dtype}: {direct} vs {via_deq}");
            // Quantization error stays small relative to the exact product.
            let tol = match dtype {
                DType::F32 => 1e-4,
                DType::F16 | DType::BF16 => 0.1,
                _ => 1.5,
            };
            assert!((direct - exact).abs() < tol, "{dtype}: {direct} vs exact {exact}");
            for (a, b) in deq.iter().zip(&w) {
                assert!((a - b).abs() < 0.25, "{dtype}: dequantized {a} vs {b}");
            }
        }
    }
}
