//! Dot products and row dequantization straight from ggml block formats.
//!
//! Decode reads every weight once per step, so these loops are the CPU
//! backend's hot path: they consume the quantized bytes directly instead of
//! widening the matrix to f32 (a Q4_1 model must not need four times its size
//! in RAM). Each block's scale is applied once per block, and the inner loops
//! are written over fixed 16-element halves so the compiler vectorizes them.
//!
//! Every block format (Q8_0, Q4_0/1, Q5_0/1, IQ4_NL and the 256-weight
//! K-quants and IQ4_XS) is decoded by one function, [`unpack_block`], into
//! integer codes with a scale and an offset per 16 weights ([`Block`]; the
//! scales alone by [`block_scales`]); the dequantizer and the portable dot
//! products run over that shape. Decode dots the weights with activations
//! quantized to 8 bits per 32 ([`Q8Row`], once per matmul), so the inner
//! products are integer and the activations a quarter of their f32 size in
//! cache; on x86-64 with AVX2 the codes of each 32 weights are unpacked in
//! registers instead (`codes_avx2`) and multiplied by `vpmaddubsw`, with the
//! same roundings as the portable loop, so both give the same bits. The AVX2
//! kernels are built once per format (a const generic, [`block_type`]), so
//! the unpacking inlines into each loop instead of being a call through a
//! jump on the format for every 32 weights.

use crate::dtype::{DType, QK, QK_K};
use half::{bf16, f16};

#[inline(always)]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Calls `$f(DType::X, args..)` with the block type as a constant in each
/// arm, so that after inlining every per-type `match` inside the block loop
/// folds away and the loops vectorize for that one format.
macro_rules! per_block_type {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::Q8_0 => $f(DType::Q8_0, $($arg),*),
            DType::Q4_0 => $f(DType::Q4_0, $($arg),*),
            DType::Q4_1 => $f(DType::Q4_1, $($arg),*),
            DType::Q5_0 => $f(DType::Q5_0, $($arg),*),
            DType::Q5_1 => $f(DType::Q5_1, $($arg),*),
            DType::IQ4_NL => $f(DType::IQ4_NL, $($arg),*),
            DType::Q2_K => $f(DType::Q2_K, $($arg),*),
            DType::Q3_K => $f(DType::Q3_K, $($arg),*),
            DType::Q4_K => $f(DType::Q4_K, $($arg),*),
            DType::Q5_K => $f(DType::Q5_K, $($arg),*),
            DType::Q6_K => $f(DType::Q6_K, $($arg),*),
            DType::IQ4_XS => $f(DType::IQ4_XS, $($arg),*),
            DType::F32 | DType::F16 | DType::BF16 => unreachable!("{} is not a block format", $dtype),
        }
    };
}

/// Evaluates `$body` with `$t` a constant `u8` naming the block format
/// `$dtype` (`DType::X as u8`), for the AVX2 kernels' const generic.
#[cfg(target_arch = "x86_64")]
macro_rules! with_block_const {
    ($dtype:expr, $t:ident => $body:expr) => {
        with_block_const!(@arms $dtype, $t => $body; Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 IQ4_NL Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_XS)
    };
    (@arms $dtype:expr, $t:ident => $body:expr; $($v:ident)*) => {
        match $dtype {
            $(DType::$v => {
                const $t: u8 = DType::$v as u8;
                $body
            })*
            DType::F32 | DType::F16 | DType::BF16 => unreachable!("{} is not a block format", $dtype),
        }
    };
}

/// Dot product of one stored row (`dtype`, `x.len()` elements) with `x`.
///
/// The loops below are written for the compiler to vectorize; on x86-64 the
/// same code is compiled a second time with AVX2 and FMA enabled and chosen
/// at run time, so a portable binary still uses the wide registers.
pub fn dot_row(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2, FMA and F16C (checked above).
        return unsafe { dot_row_avx2(dtype, row, x) };
    }
    dot_row_generic(dtype, row, x)
}

/// Whether this CPU has AVX2, FMA and F16C (cached by the standard library).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn has_avx2() -> bool {
    std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("f16c")
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
        // The block formats are unpacked block by block into integer codes
        // with a scale and offset per 16 weights (`Block`), and accumulate
        // lane-wise across blocks (the group's scale broadcast into 8 lanes),
        // reducing once per row: a horizontal sum per block would cost as much
        // as the block.
        q => per_block_type!(q, blocks_dot_f32(row, x)),
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
        // SAFETY: the CPU supports AVX2, FMA and F16C (checked above).
        return unsafe { dot_f32_avx2(a, b) };
    }
    dot_f32_generic(a, b)
}

#[inline(always)]
pub(crate) fn dot_f32_generic(a: &[f32], b: &[f32]) -> f32 {
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
        q => per_block_type!(q, dequantize_blocks(row, out)),
    }
}

/// Weights per group sharing one scale and offset in [`Block`]: the finest
/// sub-block of any supported format (Q2_K, Q3_K and Q6_K scale 16 weights).
pub const GROUP: usize = 16;

/// One block of a ggml block format, unpacked: weight `i` is
/// `d[i / 16] · q[i] + m[i / 16]`. Every supported format decodes into this
/// shape exactly (the codes fit an i8: at most 0..31 or −128..127), so one
/// dot-product loop serves them all, in f32 and against 8-bit activations.
pub struct Block {
    pub q: [i8; QK_K],
    pub d: [f32; QK_K / GROUP],
    pub m: [f32; QK_K / GROUP],
}

impl Block {
    const fn new() -> Self {
        Block { q: [0; QK_K], d: [0.0; QK_K / GROUP], m: [0.0; QK_K / GROUP] }
    }
}

impl Default for Block {
    fn default() -> Self {
        Block::new()
    }
}

/// The 16 levels of IQ4_NL and IQ4_XS, a fixed non-uniform grid (denser near
/// zero, where trained weights cluster), as the ggml format defines them.
pub const IQ4_LEVELS: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// The 6-bit scale and min `j` (0..8) of a Q4_K / Q5_K super-block, packed
/// in 12 bytes: for `j < 4` the low 6 bits of bytes `j` and `j + 4`; for
/// `j >= 4` a nibble of byte `j + 4` below the top two bits of bytes `j − 4`
/// (scale) and `j` (min).
#[inline(always)]
pub(super) fn k4_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// The 6-bit scale `g` (0..16) of a Q3_K super-block, packed in 12 bytes:
/// low nibble from byte `g` (g < 8) or the high nibble of byte `g − 8`, top
/// two bits from byte `8 + g % 4` at bit `2·(g / 4)`; stored offset by 32.
#[inline(always)]
fn q3k_scale(g: usize, s: &[u8]) -> i32 {
    let low = if g < 8 { s[g] & 0x0f } else { s[g - 8] >> 4 };
    let high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
    (low | (high << 4)) as i32 - 32
}

/// Decode one block of `dtype` (its `block_bytes()` bytes) into `out`.
///
/// Layouts (all little-endian; f16 scales):
/// - Q8_0 `[d][32 × i8]`; Q4_0 `[d][16 nibble bytes]`, codes `q − 8`;
///   Q4_1 `[d][m][16]`; IQ4_NL as Q4_0 with codes `IQ4_LEVELS[q]`. In the
///   nibble formats byte `j` holds weight `j` (low) and `j + 16` (high).
/// - Q5_0 `[d][u32 qh][16]`, codes `(nibble | bit j of qh << 4) − 16`; Q5_1
///   `[d][m][u32 qh][16]` without the offset.
/// - Q2_K `[16 scale bytes][64 qs][d][dmin]`: weight `128h + 32j + l` is bits
///   `2j..2j+2` of `qs[32h + l]`; its group's byte holds the scale (low
///   nibble, × d) and min (high nibble, × dmin, subtracted).
/// - Q3_K `[32 hmask][64 qs][12 scales][d]`: two low bits as Q2_K, minus 4
///   unless bit `4h + j` of `hmask[l]` is set; 6-bit signed scales × d.
/// - Q4_K `[d][dmin][12 scales][128 qs]`: 64-weight chunk `c` takes the low
///   nibbles of `qs[32c..32c+32]` then the high ones; sub-block `s` (32
///   weights) has 6-bit scale × d and min × dmin (subtracted).
/// - Q5_K `[d][dmin][12 scales][32 qh][128 qs]`: as Q4_K, plus 16 when bit
///   `s` of `qh[l]` is set (weight `32s + l`).
/// - Q6_K `[128 ql][64 qh][16 i8 scales][d]`: weight `128h + 32k + l` is a
///   nibble of `ql[64h + l + 32(k % 2)]` (low for k < 2) with bits `2k..2k+2`
///   of `qh[32h + l]` above it, minus 32; group scale `scales[g]` × d.
/// - IQ4_XS `[d][u16 scales_h][4 scales_l][128 qs]`: sub-block `s` of 32 has
///   6-bit scale (nibble of `scales_l[s/2]`, two bits of `scales_h`) − 32,
///   × d, and codes `IQ4_LEVELS[q]` laid out per sub-block as in IQ4_NL.
#[inline(always)]
pub fn unpack_block(dtype: DType, b: &[u8], out: &mut Block) {
    let (at, two) = f16_scales_at(dtype);
    let m = if two { f16_at(b, at + 2) } else { 0.0 };
    block_scales(dtype, b, f16_at(b, at), m, &mut out.d, &mut out.m);
    let q = &mut out.q;
    match dtype {
        DType::Q8_0 => {
            for i in 0..QK {
                q[i] = b[2 + i] as i8;
            }
        }
        DType::Q4_0 | DType::Q4_1 | DType::IQ4_NL => {
            let qs = if dtype == DType::Q4_1 { &b[4..20] } else { &b[2..18] };
            for j in 0..16 {
                let (lo, hi) = (qs[j] & 0x0f, qs[j] >> 4);
                (q[j], q[j + 16]) = match dtype {
                    DType::Q4_0 => (lo as i8 - 8, hi as i8 - 8),
                    DType::Q4_1 => (lo as i8, hi as i8),
                    _ => (IQ4_LEVELS[lo as usize], IQ4_LEVELS[hi as usize]),
                };
            }
        }
        DType::Q5_0 | DType::Q5_1 => {
            let (at, off) = if dtype == DType::Q5_1 { (4, 0) } else { (2, 16) };
            let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            let qs = &b[at + 4..at + 20];
            for j in 0..16 {
                let lo = (qs[j] & 0x0f) | (((qh >> j) & 1) << 4) as u8;
                let hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4) as u8;
                q[j] = lo as i8 - off;
                q[j + 16] = hi as i8 - off;
            }
        }
        DType::Q2_K => {
            let qs = &b[16..80];
            for h in 0..2 {
                for j in 0..4 {
                    for l in 0..32 {
                        q[128 * h + 32 * j + l] = ((qs[32 * h + l] >> (2 * j)) & 3) as i8;
                    }
                }
            }
        }
        DType::Q3_K => {
            let (hmask, qs) = (&b[0..32], &b[32..96]);
            for h in 0..2 {
                for j in 0..4 {
                    let bit = 1u8 << (4 * h + j);
                    for l in 0..32 {
                        let low = ((qs[32 * h + l] >> (2 * j)) & 3) as i8;
                        q[128 * h + 32 * j + l] = low - if hmask[l] & bit != 0 { 0 } else { 4 };
                    }
                }
            }
        }
        DType::Q4_K | DType::Q5_K => {
            let (qh, qs) = match dtype {
                DType::Q5_K => (Some(&b[16..48]), &b[48..176]),
                _ => (None, &b[16..144]),
            };
            for c in 0..4 {
                for l in 0..32 {
                    let v = qs[32 * c + l];
                    let (mut lo, mut hi) = (v & 0x0f, v >> 4);
                    if let Some(qh) = qh {
                        lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                    }
                    q[64 * c + l] = lo as i8;
                    q[64 * c + 32 + l] = hi as i8;
                }
            }
        }
        DType::Q6_K => {
            let (ql, qh) = (&b[0..128], &b[128..192]);
            for h in 0..2 {
                for k in 0..4 {
                    for l in 0..32 {
                        let byte = ql[64 * h + l + 32 * (k % 2)];
                        let low = if k < 2 { byte & 0x0f } else { byte >> 4 };
                        let high = (qh[32 * h + l] >> (2 * k)) & 3;
                        q[128 * h + 32 * k + l] = (low | (high << 4)) as i8 - 32;
                    }
                }
            }
        }
        DType::IQ4_XS => {
            let qs = &b[8..136];
            for s in 0..8 {
                for j in 0..16 {
                    let v = qs[16 * s + j];
                    q[32 * s + j] = IQ4_LEVELS[(v & 0x0f) as usize];
                    q[32 * s + 16 + j] = IQ4_LEVELS[(v >> 4) as usize];
                }
            }
        }
        DType::F32 | DType::F16 | DType::BF16 => unreachable!("{dtype} is not a block format"),
    }
}

/// Where a block keeps its f16 scale `d`, and whether a second f16 follows
/// it (Q4_1 and Q5_1's offset `m`, the `dmin` of Q2_K, Q4_K and Q5_K): the
/// values [`block_scales`] is given, converted however the caller converts.
#[inline(always)]
const fn f16_scales_at(dtype: DType) -> (usize, bool) {
    match dtype {
        DType::Q2_K => (80, true),
        DType::Q3_K => (108, false),
        DType::Q6_K => (208, false),
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => (0, true),
        _ => (0, false),
    }
}

/// The scale and offset of each 16-weight group of one block (`Block::d`
/// and `Block::m`; only the first two for the 32-weight formats), from the
/// block's bytes and its f16 fields already widened (`d`, and `m` or
/// `dmin` where [`f16_scales_at`] says the format has one): the layouts of
/// [`unpack_block`]. Shared by the unpacking and the AVX2 dot, so both scale
/// by the same values.
#[inline(always)]
fn block_scales(dtype: DType, b: &[u8], d: f32, m: f32, od: &mut [f32; 16], om: &mut [f32; 16]) {
    match dtype {
        DType::Q8_0 | DType::Q4_0 | DType::Q5_0 | DType::IQ4_NL => {
            od[..2].fill(d);
            om[..2].fill(0.0);
        }
        DType::Q4_1 | DType::Q5_1 => {
            od[..2].fill(d);
            om[..2].fill(m);
        }
        DType::Q2_K => {
            for ((od, om), &s) in od.iter_mut().zip(om.iter_mut()).zip(&b[0..16]) {
                *od = d * (s & 0x0f) as f32;
                *om = -m * (s >> 4) as f32;
            }
        }
        DType::Q3_K => {
            for (g, od) in od.iter_mut().enumerate() {
                *od = d * q3k_scale(g, &b[96..108]) as f32;
            }
            om.fill(0.0);
        }
        DType::Q4_K | DType::Q5_K => {
            for s in 0..8 {
                let (scale, min) = k4_scale_min(s, &b[4..16]);
                od[2 * s..2 * s + 2].fill(d * scale as f32);
                om[2 * s..2 * s + 2].fill(-m * min as f32);
            }
        }
        DType::Q6_K => {
            for (od, &s) in od.iter_mut().zip(&b[192..208]) {
                *od = d * (s as i8) as f32;
            }
            om.fill(0.0);
        }
        DType::IQ4_XS => {
            let (sh, sl) = (u16::from_le_bytes([b[2], b[3]]), &b[4..8]);
            for s in 0..8 {
                let ls = ((sl[s / 2] >> (4 * (s % 2))) & 0x0f) | ((((sh >> (2 * s)) & 3) as u8) << 4);
                od[2 * s..2 * s + 2].fill(d * (ls as i32 - 32) as f32);
            }
            om.fill(0.0);
        }
        DType::F32 | DType::F16 | DType::BF16 => unreachable!("{dtype} is not a block format"),
    }
}

/// Calls `f(block, elems, first_elem)` for every block of a row of `n`
/// elements, with the block unpacked into a per-thread buffer.
#[inline(always)]
fn for_each_block(dtype: DType, row: &[u8], n: usize, mut f: impl FnMut(&Block, usize, usize)) {
    let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
    let mut blk = Block::new();
    for (i, b) in row.chunks_exact(bb).take(n / be).enumerate() {
        unpack_block(dtype, b, &mut blk);
        f(&blk, be, i * be);
    }
}

#[inline(always)]
fn dequantize_blocks(dtype: DType, row: &[u8], out: &mut [f32]) {
    let n = out.len();
    for_each_block(dtype, row, n, |blk, elems, at| {
        for (g, o) in out[at..at + elems].chunks_exact_mut(GROUP).enumerate() {
            let (d, m) = (blk.d[g], blk.m[g]);
            for (o, &c) in o.iter_mut().zip(&blk.q[g * GROUP..(g + 1) * GROUP]) {
                *o = d * c as f32 + m;
            }
        }
    })
}

/// `Σ w·x` over a row of a block format, in f32.
#[inline(always)]
fn blocks_dot_f32(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for_each_block(dtype, row, x.len(), |blk, elems, at| {
        for g in 0..elems / GROUP {
            let (d, m) = (blk.d[g], blk.m[g]);
            let xs = &x[at + g * GROUP..at + (g + 1) * GROUP];
            let qs = &blk.q[g * GROUP..(g + 1) * GROUP];
            for l in 0..8 {
                let (x0, x1) = (xs[2 * l], xs[2 * l + 1]);
                acc[l] += d * (qs[2 * l] as f32 * x0 + qs[2 * l + 1] as f32 * x1) + m * (x0 + x1);
            }
        }
    });
    acc.iter().sum()
}

/// An activation row quantized to 8 bits in blocks of 32, the way it is
/// dotted with block-format weights: `x[i] ≈ d[i / 32] · q[i]`, with
/// `d = max|x| / 127` per block. `gsum[g]` is `d · Σ q` over the 16-element
/// group `g`, for the formats whose weights carry an offset (`m · Σ x`).
///
/// Error: each element moves by at most `d / 2 = max|x| / 254` of its block,
/// so a dot product with weights `w` moves by at most
/// `Σ_blocks max|x_b| / 254 · Σ_{i∈b} |w_i|` (checked by the tests).
#[derive(Clone, Debug, Default)]
pub struct Q8Row {
    q: Vec<i8>,
    d: Vec<f32>,
    gsum: Vec<f32>,
    /// `d · Σ q` over each 32-element block (Q4_1's offsets).
    bsum: Vec<f32>,
    /// `Σ q` over each 32-element block (the row tiles' integer offsets).
    qsum: Vec<i32>,
    /// `Σ q` over each 16-element group (Q6_K's tiles).
    qsum16: Vec<i32>,
}

/// `y.round() as i8` (the nearest whole number, halves away from zero,
/// saturated to an i8), bit for bit for every `y`, as an addition and a
/// truncating conversion that vectorize: `round` is a call into the C
/// library per value (0.6-0.9% of a small model's decode). The largest
/// f32 below one half, added with `y`'s sign, carries every value at or past
/// a half over the next whole number and none below it; the conversion then
/// truncates toward zero and saturates as `as` does.
#[inline(always)]
fn round_to_i8(y: f32) -> i8 {
    const BELOW_HALF: f32 = 0.499_999_97;
    (y + BELOW_HALF.copysign(y)) as i8
}

impl Q8Row {
    /// Quantizes `x` (a whole number of 32-element blocks) into this row,
    /// reusing its buffers.
    pub fn quantize(&mut self, x: &[f32]) {
        assert!(x.len().is_multiple_of(QK), "a Q8 activation row is whole 32-element blocks");
        self.q.resize(x.len(), 0);
        self.d.resize(x.len() / QK, 0.0);
        self.gsum.resize(x.len() / GROUP, 0.0);
        self.bsum.resize(x.len() / QK, 0.0);
        self.qsum.resize(x.len() / QK, 0);
        self.qsum16.resize(x.len() / GROUP, 0);
        #[cfg(target_arch = "x86_64")]
        if has_avx512bw() {
            // SAFETY: the CPU has AVX-512 F and BW (checked above); the
            // buffers were just sized for `x`.
            unsafe { self.quantize_avx512(x) };
            return;
        }
        self.quantize_blocks(x, 0..x.len() / QK);
    }

    /// [`Q8Row::quantize`] of blocks `blocks` of `x`, one value at a time,
    /// into buffers already sized.
    fn quantize_blocks(&mut self, x: &[f32], blocks: std::ops::Range<usize>) {
        for b in blocks {
            let (xs, qs) = (&x[b * QK..(b + 1) * QK], &mut self.q[b * QK..(b + 1) * QK]);
            let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            for (q, v) in qs.iter_mut().zip(xs) {
                *q = round_to_i8(v * inv);
            }
            self.d[b] = d;
            self.qsum[b] = qs.iter().map(|&q| q as i32).sum::<i32>();
            self.bsum[b] = d * self.qsum[b] as f32;
            for h in 0..2 {
                let s: i32 = qs[h * GROUP..(h + 1) * GROUP].iter().map(|&q| q as i32).sum();
                self.gsum[2 * b + h] = d * s as f32;
                self.qsum16[2 * b + h] = s;
            }
        }
    }
    /// [`Q8Row::quantize`] a block at a time in two 16-lane registers: the
    /// same operations on every value (the scale's division and inverse, a
    /// product, the biased half, a truncating conversion that saturates as
    /// `as i8` does for these magnitudes) and exact integer sums, so the same
    /// bits. A block holding a NaN, or whose inverse scale is not finite (a
    /// subnormal largest value), goes through the one-value loop.
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BW; the buffers are sized for `x`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn quantize_avx512(&mut self, x: &[f32]) {
        use std::arch::x86_64::*;
        let abs_mask = _mm512_set1_epi32(i32::MAX);
        let sign = _mm512_set1_epi32(i32::MIN);
        let half = _mm512_castps_si512(_mm512_set1_ps(0.499_999_97));
        let abs = |v: __m512| _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs_mask));
        for b in 0..x.len() / QK {
            // SAFETY: block b's 32 values are within `x` and within `q`.
            let (lo, hi) = unsafe {
                (_mm512_loadu_ps(x.as_ptr().add(b * QK)), _mm512_loadu_ps(x.as_ptr().add(b * QK + 16)))
            };
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(lo, lo) | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(hi, hi);
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(abs(lo), abs(hi)));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            if nan != 0 || !inv.is_finite() {
                self.quantize_blocks(x, b..b + 1);
                continue;
            }
            let codes = |v: __m512| {
                let y = _mm512_mul_ps(v, _mm512_set1_ps(inv));
                let bias = _mm512_or_si512(half, _mm512_and_si512(_mm512_castps_si512(y), sign));
                _mm512_cvttps_epi32(_mm512_add_ps(y, _mm512_castsi512_ps(bias)))
            };
            let (ql, qh) = (codes(lo), codes(hi));
            // SAFETY: 16 codes each at block b's two halves of `q`.
            unsafe {
                _mm_storeu_si128(self.q.as_mut_ptr().add(b * QK) as *mut __m128i, _mm512_cvtsepi32_epi8(ql));
                _mm_storeu_si128(
                    self.q.as_mut_ptr().add(b * QK + 16) as *mut __m128i,
                    _mm512_cvtsepi32_epi8(qh),
                );
            }
            let (sl, sh) = (_mm512_reduce_add_epi32(ql), _mm512_reduce_add_epi32(qh));
            self.d[b] = d;
            self.qsum[b] = sl + sh;
            self.bsum[b] = d * (sl + sh) as f32;
            for (h, s) in [sl, sh].into_iter().enumerate() {
                self.gsum[2 * b + h] = d * s as f32;
                self.qsum16[2 * b + h] = s;
            }
        }
    }

    pub fn len(&self) -> usize {
        self.q.len()
    }
    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }
    /// Checks that the row holds `blocks` 32-element blocks with their
    /// scales and sums, so the AVX2 loops may read them unchecked.
    #[cfg(target_arch = "x86_64")]
    fn check_blocks(&self, blocks: usize) {
        assert!(
            self.q.len() >= blocks * QK
                && self.d.len() >= blocks
                && self.bsum.len() >= blocks
                && self.gsum.len() >= 2 * blocks,
            "an 8-bit row of {} elements for {blocks} blocks",
            self.q.len()
        );
    }
    /// Checks that the row holds `len` elements with every block's scale
    /// and sums, so a kernel may read them unchecked.
    pub(super) fn check_len(&self, len: usize) {
        let blocks = len / QK;
        assert!(
            self.q.len() == len
                && self.d.len() == blocks
                && self.bsum.len() == blocks
                && self.qsum.len() == blocks
                && self.qsum16.len() == 2 * blocks,
            "an 8-bit row of {} elements where {len} are dotted",
            self.q.len()
        );
    }
    pub(super) fn q(&self) -> &[i8] {
        &self.q
    }
    pub(super) fn d(&self) -> &[f32] {
        &self.d
    }
    pub(super) fn bsum(&self) -> &[f32] {
        &self.bsum
    }
    pub(super) fn qsum(&self) -> &[i32] {
        &self.qsum
    }
    pub(super) fn qsum16(&self) -> &[i32] {
        &self.qsum16
    }
    /// The values the row stands for, `d · q` (for tests and bounds).
    pub fn dequantized(&self) -> Vec<f32> {
        self.q.iter().enumerate().map(|(i, &q)| self.d[i / QK] * q as f32).collect()
    }
}

/// Dot product of one stored row of a block format with a Q8 activation row:
/// exact integer products over each four weights, scaled once per 16- or
/// 32-weight group by the weight's and the activation's scales (see
/// [`q8_dot_lanes`] for the order of the roundings).
///
/// On x86-64 the same code is also compiled with AVX2, FMA and F16C and chosen at
/// run time. Both builds perform the same f32 operations in the same order
/// (Rust never contracts or reassociates float arithmetic), so they return
/// bit-identical results; the tests check that.
pub fn dot_row_q8(dtype: DType, row: &[u8], x: &Q8Row) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2, FMA and F16C (checked above).
        return unsafe { dot_row_q8_avx2(dtype, row, x) };
    }
    dot_row_q8_portable(dtype, row, x)
}

/// [`dot_row_q8`] of one stored row with each of `xs`, into `out` (one
/// value per row of `xs`), bit for bit what [`dot_row_q8`] gives each. The
/// AVX2 build loads and unpacks each weight block once for up to four
/// activation rows, so a decode step of several sequences reads the weights
/// once rather than once per sequence.
pub fn dot_rows_q8(dtype: DType, row: &[u8], xs: &[Q8Row], out: &mut [f32]) {
    assert_eq!(xs.len(), out.len(), "one output per activation row");
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2, FMA and F16C (checked above).
        with_block_const!(dtype, T => unsafe { dot_rows_q8_avx2::<T>(row, xs, out) });
        return;
    }
    for (x, o) in xs.iter().zip(out.iter_mut()) {
        *o = dot_row_q8(dtype, row, x);
    }
}

/// [`dot_rows_q8`] of each of the consecutive stored rows in `w` (`row_bytes`
/// bytes each, as many as `out` has room for) with each of `xs`: value `r`
/// of weight row `i` goes to `out[i * xs.len() + r]`, bit for bit what
/// [`dot_rows_q8`] gives that row. A matmul's task of a few dozen rows
/// calls this once: the choice of instruction set and of format is made
/// once for all of them, not per row (a 576-weight row is only 18 blocks,
/// where a per-row dispatch costs a tenth of the row's dot).
pub fn dot_many_rows_q8(dtype: DType, w: &[u8], row_bytes: usize, xs: &[Q8Row], out: &mut [f32]) {
    assert!(!xs.is_empty(), "at least one activation row");
    let rows = out.len() / xs.len();
    assert_eq!(rows * xs.len(), out.len(), "whole rows of outputs");
    assert!(w.len() >= rows * row_bytes, "{rows} rows of {row_bytes} bytes in {}", w.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2, FMA and F16C (checked above).
        with_block_const!(dtype, T => unsafe { dot_many_rows_q8_avx2::<T>(w, row_bytes, xs, out) });
        return;
    }
    for (i, o) in out.chunks_exact_mut(xs.len()).enumerate() {
        dot_rows_q8(dtype, &w[i * row_bytes..(i + 1) * row_bytes], xs, o);
    }
}

/// [`dot_many_rows_q8`] in AVX2 for the block format `T`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_many_rows_q8_avx2<const T: u8>(w: &[u8], row_bytes: usize, xs: &[Q8Row], out: &mut [f32]) {
    let row = |i: usize| &w[i * row_bytes..(i + 1) * row_bytes];
    let mut i = 0;
    if xs.len() == 1 && const { block_type(T).block_elems() == QK } {
        // One activation row: two weight rows at a time share each of its
        // block loads, and their chains run side by side.
        while i + 2 <= out.len() {
            let [a, b] = q8_dot_blocks_w_avx2::<T, 2>([row(i), row(i + 1)], &xs[0]);
            (out[i], out[i + 1]) = (a, b);
            i += 2;
        }
    }
    for (j, o) in out.chunks_exact_mut(xs.len()).enumerate().skip(i) {
        dot_rows_q8_avx2::<T>(row(j), xs, o);
    }
}

/// The end of every 8-bit dot: the eight lanes (the even and odd blocks'
/// accumulators already added lane by lane) summed in order, then the two
/// offset sums. Both builds end here, so they round alike.
#[inline(always)]
fn total(lanes: [f32; 8], off: [f32; 2]) -> f32 {
    let mut sum = 0f32;
    for v in lanes {
        sum += v;
    }
    sum + (off[0] + off[1])
}

/// [`total`] of the even and odd blocks' AVX2 accumulators.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn total_avx2(acc0: std::arch::x86_64::__m256, acc1: std::arch::x86_64::__m256, off: [f32; 2]) -> f32 {
    use std::arch::x86_64::*;
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(acc0, acc1));
    total(lanes, off)
}

/// [`dot_row_q8`] without the run-time choice of instruction set: the build
/// for the baseline CPU.
pub fn dot_row_q8_portable(dtype: DType, row: &[u8], x: &Q8Row) -> f32 {
    match dtype {
        DType::Q4_1 => q8_dot_one_scale(DType::Q4_1, row, x),
        DType::Q8_0 => q8_dot_one_scale(DType::Q8_0, row, x),
        _ => per_block_type!(dtype, q8_dot_lanes(row, x)),
    }
}

/// The code of element `i` of a Q4_1 or Q8_0 block (the nibble, 0..15, or
/// the signed byte).
#[inline(always)]
fn one_scale_code(dtype: DType, blk: &[u8], i: usize) -> i32 {
    if dtype == DType::Q4_1 {
        let b = blk[4 + (i & 15)];
        i32::from(if i < 16 { b & 0x0f } else { b >> 4 })
    } else {
        i32::from(blk[2 + i] as i8)
    }
}

/// [`dot_row_q8`] for the formats with one scale per 32-weight block (Q4_1,
/// Q8_0: the default model's matrices and its embedding/LM head), in the
/// shape its AVX2 build computes: lane `k` of a block is the exact integer
/// sum of its elements `4k..4k+3`, added into one of two sets of eight lane
/// accumulators (even and odd blocks, so one block's fused multiply-add does
/// not wait for the one before) as `scale · sum` in one rounding; Q4_1's
/// offsets `m · Σ x` likewise into two scalars. The lanes are then summed in
/// order. `mul_add` rounds once wherever it runs, so both builds give the
/// same bits.
#[inline(always)]
fn q8_dot_one_scale(dtype: DType, row: &[u8], x: &Q8Row) -> f32 {
    let bb = dtype.block_bytes();
    let mut acc = [[0f32; 8]; 2];
    let mut off = [0f32; 2];
    for (b, blk) in row.chunks_exact(bb).take(x.len() / QK).enumerate() {
        let xq = &x.q[b * QK..(b + 1) * QK];
        let scale = f16_at(blk, 0) * x.d[b];
        let a = &mut acc[b & 1];
        for (k, lane) in a.iter_mut().enumerate() {
            let p: i32 = (4 * k..4 * k + 4).map(|i| one_scale_code(dtype, blk, i) * i32::from(xq[i])).sum();
            *lane = scale.mul_add(p as f32, *lane);
        }
        if dtype == DType::Q4_1 {
            off[b & 1] = f16_at(blk, 2).mul_add(x.bsum[b], off[b & 1]);
        }
    }
    total(std::array::from_fn(|k| acc[0][k] + acc[1][k]), off)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_row_q8_avx2(dtype: DType, row: &[u8], x: &Q8Row) -> f32 {
    with_block_const!(dtype, T => dot_row_q8_avx2_of::<T>(row, x))
}

/// [`dot_row_q8_avx2`] for the block format `T` (`DType as u8`, see
/// [`block_type`]): one build per format, so that every per-format choice
/// in the loops below is a constant and the code unpacking (`codes_avx2`)
/// is inlined into them rather than called, through a jump on the format,
/// for every 32 weights.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_row_q8_avx2_of<const T: u8>(row: &[u8], x: &Q8Row) -> f32 {
    if const { block_type(T).block_elems() == QK } {
        q8_dot_blocks_avx2::<T>(row, x)
    } else {
        let mut out = [0f32];
        q8_dot_lanes_avx2::<T, 1>(row, std::slice::from_ref(x), &mut out);
        out[0]
    }
}

/// [`dot_rows_q8`] in AVX2 for the block format `T`: up to four activation
/// rows per pass over the weight row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_rows_q8_avx2<const T: u8>(row: &[u8], xs: &[Q8Row], out: &mut [f32]) {
    let one_scale = const { block_type(T).block_elems() == QK };
    for (xs, out) in xs.chunks(4).zip(out.chunks_mut(4)) {
        match (xs.len(), one_scale) {
            (4, true) => q8_dot_rows_avx2::<T, 4>(row, xs, out),
            (3, true) => q8_dot_rows_avx2::<T, 3>(row, xs, out),
            (2, true) => q8_dot_rows_avx2::<T, 2>(row, xs, out),
            (_, true) => out[0] = q8_dot_blocks_avx2::<T>(row, &xs[0]),
            (4, false) => q8_dot_lanes_avx2::<T, 4>(row, xs, out),
            (3, false) => q8_dot_lanes_avx2::<T, 3>(row, xs, out),
            (2, false) => q8_dot_lanes_avx2::<T, 2>(row, xs, out),
            (_, false) => q8_dot_lanes_avx2::<T, 1>(row, xs, out),
        }
    }
}

/// The block format whose `DType as u8` is `t`: the AVX2 kernels take their
/// format as a const generic `u8` (an enum cannot be one).
#[cfg(target_arch = "x86_64")]
const fn block_type(t: u8) -> DType {
    let mut i = 0;
    while i < DType::BLOCK_FORMATS.len() {
        if DType::BLOCK_FORMATS[i] as u8 == t {
            return DType::BLOCK_FORMATS[i];
        }
        i += 1;
    }
    panic!("not a block format")
}

/// The f16 at `p` (and, if `TWO`, the one after it) widened by F16C, in
/// the low lanes. In assembly because the compiler, seeing that only the
/// low lane of a lone scale is used, loads it with `vpinsrw` into whatever
/// register it likes, often the accumulator the previous block's FMA is
/// still writing: every block's scale then waits on that FMA, a chain of
/// about 17 cycles per two blocks where the loads should take none. `vmovd`
/// from memory writes the whole register and depends on nothing.
///
/// # Safety
/// `p` points to 4 readable bytes if `TWO`, else 2; the CPU has F16C.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn f16_fields_avx2<const TWO: bool>(p: *const u8) -> std::arch::x86_64::__m128 {
    use std::arch::asm;
    let out: std::arch::x86_64::__m128;
    // SAFETY: the caller's: the bytes read are readable, F16C is there.
    unsafe {
        if TWO {
            asm!(
                "vmovd {o}, dword ptr [{p}]",
                "vcvtph2ps {o}, {o}",
                p = in(reg) p,
                o = out(xmm_reg) out,
                options(pure, readonly, nostack, preserves_flags)
            );
        } else {
            asm!(
                "movzx {t:e}, word ptr [{p}]",
                "vmovd {o}, {t:e}",
                "vcvtph2ps {o}, {o}",
                p = in(reg) p,
                t = out(reg) _,
                o = out(xmm_reg) out,
                options(pure, readonly, nostack, preserves_flags)
            );
        }
    }
    out
}

/// [`q8_dot_one_scale`] in AVX2, for every format of one scale per 32
/// weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL; for those but Q4_1 and
/// Q8_0 the portable build is [`q8_dot_lanes`], whose two group scales of a
/// block are the same value, so the same products): the block's 32 codes are
/// unpacked in registers ([`codes_avx2`]), sign-folded where they are signed
/// (as Q8_0: the codes' magnitudes into the unsigned operand, their signs
/// onto the activations), and multiplied with the 32 activations by one
/// `vpmaddubsw`, whose 16 pair sums no pair can saturate (at most 128 · 127
/// · 2 fits an i16); `vpmaddwd` by ones adds neighbouring pairs into the 8
/// lanes of 4 elements, and one FMA per block scales them into the even or
/// odd blocks' accumulator. The same roundings in the same order as the
/// portable loop, so the same bits; its latency chain is one FMA every other
/// block instead of two dependent adds every block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q8_dot_blocks_avx2<const T: u8>(row: &[u8], x: &Q8Row) -> f32 {
    q8_dot_blocks_w_avx2::<T, 1>([row], x)[0]
}

/// [`q8_dot_blocks_avx2`] of `W` weight rows with one activation row: each
/// block of the activations is loaded once for all of them, and each row
/// keeps its own accumulators and goes through the same operations as alone
/// (two rows at a time measured faster at batch 1 than one: their chains run
/// side by side), so each result is the one-row result, bit for bit.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q8_dot_blocks_w_avx2<const T: u8, const W: usize>(rows: [&[u8]; W], x: &Q8Row) -> [f32; W] {
    use std::arch::x86_64::*;
    let dtype = const { block_type(T) };
    let bb = dtype.block_bytes();
    let nb = x.len() / QK;
    let ones = _mm256_set1_epi16(1);
    let signed = offsets(dtype) == Offsets::None;
    let two = f16_scales_at(dtype).1;
    for row in rows {
        assert!(row.len() >= nb * bb, "a row of {} bytes for {nb} blocks", row.len());
    }
    x.check_blocks(nb);
    // Each row's even and odd blocks in two registers, as the portable
    // loop's acc[b & 1].
    let mut acc = [[_mm256_setzero_ps(); 2]; W];
    let mut off = [[0f32; 2]; W];
    // Block `b` of every row into its even or odd accumulators (`p`). A
    // macro, not a closure: a closure would not inherit this function's
    // target features, so it would be called per block.
    macro_rules! block {
        ($b:expr, $p:literal) => {{
            let b = $b;
            // SAFETY: block b < nb of every row and of the activations
            // (checked before the loop: the rows' bytes, the activations'
            // 32 bytes, scale and sum); the code bytes are read inside the
            // block (codes_avx2's slice indexing, on a slice of constant
            // length); unaligned loads. The prefetch only hints at bytes
            // ahead (it never faults).
            let xv = _mm256_loadu_si256(x.q.as_ptr().add(b * QK) as *const __m256i);
            let xd = *x.d.get_unchecked(b);
            for r in 0..W {
                let blk = rows[r].get_unchecked(b * bb..(b + 1) * bb);
                _mm_prefetch::<_MM_HINT_T0>(blk.as_ptr().wrapping_add(8 * 64) as *const i8);
                let w = codes_avx2::<T>(blk, 0);
                let pairs = if signed {
                    _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w))
                } else {
                    _mm256_maddubs_epi16(w, xv)
                };
                let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                // The block's f16 scale (and an offset's) by F16C, in
                // registers: a call per value would spill the accumulators
                // every block. The conversion is exact, so these are the
                // portable loop's values. Every one-scale block is at least
                // 18 bytes, so the four read are inside it.
                let dm = f16_fields_avx2::<true>(blk[..4].as_ptr());
                let scale = _mm_cvtss_f32(dm) * xd;
                if two {
                    let m = _mm_cvtss_f32(_mm_shuffle_ps(dm, dm, 1));
                    off[r][$p] = m.mul_add(*x.bsum.get_unchecked(b), off[r][$p]);
                }
                acc[r][$p] = _mm256_fmadd_ps(_mm256_set1_ps(scale), p, acc[r][$p]);
            }
        }};
    }
    let mut b = 0;
    while b + 1 < nb {
        block!(b, 0);
        block!(b + 1, 1);
        b += 2;
    }
    if b < nb {
        block!(b, 0);
    }
    std::array::from_fn(|r| total_avx2(acc[r][0], acc[r][1], off[r]))
}

/// [`q8_dot_blocks_avx2`] for `R` activation rows at once: each weight
/// block is loaded, unpacked and its scales converted once, then multiplied
/// with every row, each row keeping its own even and odd accumulators and
/// offsets, so each row's result is the one-row function's, bit for bit.
/// One row keeps its own function: this one at `R = 1` measured about 10%
/// slower in batch-1 decode of the default model.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_dot_rows_avx2<const T: u8, const R: usize>(row: &[u8], xs: &[Q8Row], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let dtype = const { block_type(T) };
    let bb = dtype.block_bytes();
    let nb = xs[0].len() / QK;
    assert!(xs.len() == R && out.len() == R && xs.iter().all(|x| x.len() == xs[0].len()));
    assert!(row.len() >= nb * bb, "a row of {} bytes for {nb} blocks", row.len());
    xs.iter().for_each(|x| x.check_blocks(nb));
    let ones = _mm256_set1_epi16(1);
    let signed = offsets(dtype) == Offsets::None;
    let two = f16_scales_at(dtype).1;
    let (mut acc0, mut acc1) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
    let (mut off0, mut off1) = ([0f32; R], [0f32; R]);
    // Block `b` into the even or odd accumulators (a macro so that which
    // is a constant and they stay in registers).
    macro_rules! block {
        ($b:expr, $acc:ident, $off:ident) => {{
            let b = $b;
            // SAFETY: as in q8_dot_blocks_avx2: b < nb, checked before the loop.
            let blk = row.get_unchecked(b * bb..(b + 1) * bb);
            _mm_prefetch::<_MM_HINT_T0>(blk.as_ptr().wrapping_add(8 * 64) as *const i8);
            let codes = codes_avx2::<T>(blk, 0);
            let (w, signs) = if signed {
                (_mm256_sign_epi8(codes, codes), codes)
            } else {
                (codes, _mm256_setzero_si256())
            };
            // SAFETY: every one-scale block is at least 18 bytes.
            let dm = f16_fields_avx2::<true>(blk[..4].as_ptr());
            let (d, m) = (_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_shuffle_ps(dm, dm, 1)));
            for r in 0..R {
                let x = xs.get_unchecked(r);
                let xv = _mm256_loadu_si256(x.q.as_ptr().add(b * QK) as *const __m256i);
                let pairs = if signed {
                    _mm256_maddubs_epi16(w, _mm256_sign_epi8(xv, signs))
                } else {
                    _mm256_maddubs_epi16(w, xv)
                };
                let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                let scale = d * *x.d.get_unchecked(b);
                if two {
                    $off[r] = m.mul_add(*x.bsum.get_unchecked(b), $off[r]);
                }
                $acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale), p, $acc[r]);
            }
        }};
    }
    let mut b = 0;
    while b + 1 < nb {
        block!(b, acc0, off0);
        block!(b + 1, acc1, off1);
        b += 2;
    }
    if b < nb {
        block!(b, acc0, off0);
    }
    let (acc, off) = ([acc0, acc1], [off0, off1]);
    for r in 0..R {
        out[r] = total_avx2(acc[0][r], acc[1][r], [off[0][r], off[1][r]]);
    }
}

/// How a format's weights carry an offset, the `m · Σ x` term of a dot.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Offsets {
    /// None: the codes are centred (signed).
    None,
    /// One per 32 weights (Q4_1, Q5_1, Q4_K, Q5_K): against the activation
    /// block's sum, `Q8Row::bsum`.
    Block,
    /// One per 16 weights (Q2_K): against `Q8Row::gsum`.
    Group,
}

#[inline(always)]
const fn offsets(dtype: DType) -> Offsets {
    match dtype {
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => Offsets::Block,
        DType::Q2_K => Offsets::Group,
        _ => Offsets::None,
    }
}

/// `m · Σ x` of 32-weight sub-block `j` of a block (offsets `m` as
/// [`block_scales`] gives them), the activation's block `b`, added to `off`
/// by fused multiply-adds: the same roundings in both builds.
#[inline(always)]
fn add_offsets(dtype: DType, m: &[f32; 16], j: usize, x: &Q8Row, b: usize, off: &mut f32) {
    match offsets(dtype) {
        Offsets::None => {}
        Offsets::Block => *off = m[2 * j].mul_add(x.bsum[b], *off),
        Offsets::Group => {
            *off = m[2 * j].mul_add(x.gsum[2 * b], *off);
            *off = m[2 * j + 1].mul_add(x.gsum[2 * b + 1], *off);
        }
    }
}

/// [`dot_row_q8`] for every block format, in the shape its AVX2 build
/// ([`q8_dot_lanes_avx2`]) computes: per 32 weights, lane `k` is the exact
/// integer sum of elements `4k..4k+3`, scaled by its 16-weight group's scale
/// times the activation block's (`d[2j + k / 4] · x.d[b]`, one rounding) and
/// added into one of two sets of eight lane accumulators (even and odd
/// 32-weight blocks) by one fused multiply-add; offsets likewise into two
/// scalars; the lanes then summed in order. For Q4_1 and Q8_0 this is what
/// [`q8_dot_one_scale`] computes, with the codes unpacked first.
#[inline(always)]
fn q8_dot_lanes(dtype: DType, row: &[u8], x: &Q8Row) -> f32 {
    let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
    let mut acc = [[0f32; 8]; 2];
    let mut off = [0f32; 2];
    let mut blk = Block::new();
    for (i, bytes) in row.chunks_exact(bb).take(x.len() / be).enumerate() {
        unpack_block(dtype, bytes, &mut blk);
        for j in 0..be / QK {
            let b = i * (be / QK) + j;
            let (q, xq) = (&blk.q[j * QK..(j + 1) * QK], &x.q[b * QK..(b + 1) * QK]);
            for (k, lane) in acc[b & 1].iter_mut().enumerate() {
                let p: i32 = (4 * k..4 * k + 4).map(|e| i32::from(q[e]) * i32::from(xq[e])).sum();
                let scale = blk.d[2 * j + k / 4] * x.d[b];
                *lane = scale.mul_add(p as f32, *lane);
            }
            add_offsets(dtype, &blk.m, j, x, b, &mut off[b & 1]);
        }
    }
    total(std::array::from_fn(|k| acc[0][k] + acc[1][k]), off)
}

/// The 32 codes of 32-weight sub-block `j` of a block, unpacked in
/// registers as [`unpack_block`] unpacks them: unsigned for the formats with
/// offsets, signed otherwise (the caller folds the signs, as for Q8_0).
/// One build per format `T` (see [`block_type`]), small enough to inline.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn codes_avx2<const T: u8>(b: &[u8], j: usize) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let dtype = const { block_type(T) };
    // SAFETY (every load below): the slice indexing checks that the block
    // holds the 16 or 32 bytes read; the loads are unaligned. Macros, not
    // closures: a closure would not inherit this function's target features.
    macro_rules! load32 {
        ($at:expr) => {{
            let at = $at;
            _mm256_loadu_si256(b[at..at + 32].as_ptr() as *const __m256i)
        }};
    }
    // 16 bytes of nibbles: weight i (low) and i + 16 (high) of byte i.
    macro_rules! nibbles {
        ($at:expr) => {{
            let at = $at;
            let v = _mm_loadu_si128(b[at..at + 16].as_ptr() as *const __m128i);
            let m = _mm_set1_epi8(0x0f);
            _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16::<4>(v), m), _mm_and_si128(v, m))
        }};
    }
    macro_rules! levels {
        () => {
            _mm256_broadcastsi128_si256(_mm_loadu_si128(IQ4_LEVELS.as_ptr() as *const __m128i))
        };
    }
    // 0xff in byte i where bit i of the little-endian u32 at `at` is set.
    macro_rules! fifth_bits {
        ($at:expr) => {{
            let at = $at;
            let qh = _mm256_set1_epi32(i32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]));
            let spread = _mm256_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3,
                3,
            );
            let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
            _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(qh, spread), bit), bit)
        }};
    }
    // Each byte of `v` shifted right by `shift` and masked.
    macro_rules! field {
        ($v:expr, $shift:expr, $mask:expr) => {
            _mm256_and_si256(
                _mm256_srl_epi16($v, _mm_cvtsi32_si128(($shift) as i32)),
                _mm256_set1_epi8($mask),
            )
        };
    }
    match dtype {
        DType::Q8_0 => load32!(2),
        DType::Q4_0 => _mm256_sub_epi8(nibbles!(2), _mm256_set1_epi8(8)),
        DType::Q4_1 => nibbles!(4),
        DType::IQ4_NL => _mm256_shuffle_epi8(levels!(), nibbles!(2)),
        // (nibble | 16) − 16 is the nibble where the fifth bit is set and
        // the nibble − 16 (as an i8: the nibble with 0xf0 above it) where not.
        DType::Q5_0 => {
            _mm256_or_si256(nibbles!(6), _mm256_andnot_si256(fifth_bits!(2), _mm256_set1_epi8(-16)))
        }
        DType::Q5_1 => _mm256_or_si256(nibbles!(8), _mm256_and_si256(fifth_bits!(4), _mm256_set1_epi8(0x10))),
        DType::Q2_K => field!(load32!(16 + 32 * (j / 4)), 2 * (j % 4), 3),
        DType::Q3_K => {
            let low = field!(load32!(32 + 32 * (j / 4)), 2 * (j % 4), 3);
            let bit = _mm256_set1_epi8((1u8 << (4 * (j / 4) + j % 4)) as i8);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(load32!(0), bit), bit);
            _mm256_sub_epi8(low, _mm256_andnot_si256(set, _mm256_set1_epi8(4)))
        }
        DType::Q4_K | DType::Q5_K => {
            let at = if dtype == DType::Q5_K { 48 } else { 16 };
            let nib = field!(load32!(at + 32 * (j / 2)), 4 * (j % 2), 0x0f);
            if dtype == DType::Q4_K {
                nib
            } else {
                _mm256_or_si256(nib, _mm256_slli_epi16::<4>(field!(load32!(16), j, 1)))
            }
        }
        DType::Q6_K => {
            let (h, k) = (j / 4, j % 4);
            let nib = field!(load32!(64 * h + 32 * (k % 2)), 4 * (k / 2), 0x0f);
            let high = _mm256_slli_epi16::<4>(field!(load32!(128 + 32 * h), 2 * k, 3));
            _mm256_sub_epi8(_mm256_or_si256(nib, high), _mm256_set1_epi8(32))
        }
        DType::IQ4_XS => _mm256_shuffle_epi8(levels!(), nibbles!(8 + 16 * j)),
        DType::F32 | DType::F16 | DType::BF16 => unreachable!("{dtype} is not a block format"),
    }
}

/// [`block_scales`] of block `b` of format `T` whose f16 fields `f` (low
/// lanes) are already widened: the same values, the 6-bit scales and mins
/// of Q4_K and Q5_K and the 8-bit scales of Q6_K unpacked and converted in
/// vector registers (each a product `d · scale` in one rounding, as the
/// scalar code; `-dmin · min` likewise, the negation being exact), the other
/// formats by `block_scales` itself.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block_scales_avx2<const T: u8>(
    b: &[u8],
    f: std::arch::x86_64::__m128,
    od: &mut [f32; 16],
    om: &mut [f32; 16],
) {
    use std::arch::x86_64::*;
    let dtype = const { block_type(T) };
    match dtype {
        DType::Q4_K | DType::Q5_K => {
            // The 12 scale bytes into 8 scales then 8 mins, one byte each
            // (k4_scale_min for every j at once, as ggml unpacks them).
            let s = &b[4..16];
            let u = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
            let (u0, u1, u2) = (u(0), u(1), u(2));
            const M6: u32 = 0x3f3f_3f3f;
            const M4: u32 = 0x0f0f_0f0f;
            const M2: u32 = 0x0303_0303;
            let scales_lo = u0 & M6;
            let scales_hi = (u2 & M4) | (((u0 >> 6) & M2) << 4);
            let mins_lo = u1 & M6;
            let mins_hi = ((u2 >> 4) & M4) | (((u1 >> 6) & M2) << 4);
            let sc = _mm_set_epi32(mins_hi as i32, mins_lo as i32, scales_hi as i32, scales_lo as i32);
            let scales = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc));
            let mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(sc, sc)));
            let d = _mm256_broadcastss_ps(f);
            let dmin = _mm256_broadcastss_ps(_mm_shuffle_ps(f, f, 1));
            let neg = _mm256_set1_ps(-0.0);
            let (vd, vm) = (_mm256_mul_ps(d, scales), _mm256_mul_ps(_mm256_xor_ps(dmin, neg), mins));
            // Each of the 8 values for its two groups of 16.
            let lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
            let hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
            _mm256_storeu_ps(od.as_mut_ptr(), _mm256_permutevar8x32_ps(vd, lo));
            _mm256_storeu_ps(od.as_mut_ptr().add(8), _mm256_permutevar8x32_ps(vd, hi));
            _mm256_storeu_ps(om.as_mut_ptr(), _mm256_permutevar8x32_ps(vm, lo));
            _mm256_storeu_ps(om.as_mut_ptr().add(8), _mm256_permutevar8x32_ps(vm, hi));
        }
        DType::Q6_K => {
            let s = _mm_loadu_si128(b[192..208].as_ptr() as *const __m128i);
            let d = _mm256_broadcastss_ps(f);
            let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s));
            let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(s, s)));
            _mm256_storeu_ps(od.as_mut_ptr(), _mm256_mul_ps(d, lo));
            _mm256_storeu_ps(od.as_mut_ptr().add(8), _mm256_mul_ps(d, hi));
            // No offsets: `om` is never read for Q6_K.
        }
        _ => block_scales(dtype, b, _mm_cvtss_f32(f), _mm_cvtss_f32(_mm_shuffle_ps(f, f, 1)), od, om),
    }
}

/// [`q8_dot_lanes`] in AVX2 for `R` activation rows at once (every format;
/// the formats of one scale per 32 weights have their own loops,
/// [`q8_dot_blocks_avx2`]): per block the f16 fields are widened by F16C
/// and the group scales worked out once ([`block_scales_avx2`]),
/// each 32-weight sub-block's codes unpacked once ([`codes_avx2`]), then
/// multiplied with each row's activations by `vpmaddubsw` (signed codes
/// through the sign fold, as Q8_0: no pair sum can saturate an i16) and
/// `vpmaddwd` by ones into the 8 lanes of 4 weights, scaled by one FMA
/// with the two groups' scales in the low and high lanes. The same
/// roundings in the same order as the portable loop, so the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_dot_lanes_avx2<const T: u8, const R: usize>(row: &[u8], xs: &[Q8Row], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let dtype = const { block_type(T) };
    let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
    let n = xs[0].len();
    let blocks = n / be;
    assert!(xs.len() == R && out.len() == R && xs.iter().all(|x| x.len() == n));
    assert!(row.len() >= blocks * bb, "a row of {} bytes for {blocks} blocks", row.len());
    xs.iter().for_each(|x| x.check_blocks(n / QK));
    let ones = _mm256_set1_epi16(1);
    let signed = offsets(dtype) == Offsets::None;
    let (at, two) = f16_scales_at(dtype);
    let (mut acc0, mut acc1) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
    let (mut off0, mut off1) = ([0f32; R], [0f32; R]);
    let (mut d, mut m) = ([0f32; 16], [0f32; 16]);
    let per32 = matches!(dtype, DType::Q4_K | DType::Q5_K | DType::IQ4_XS) || be == QK;
    // Sub-block `j` of block `blk` (the activations' block `b`) into the
    // even or odd accumulators (a macro so that which is a constant and
    // they stay in registers).
    macro_rules! sub {
        ($blk:expr, $j:expr, $b:expr, $acc:ident, $off:ident) => {{
            let (blk, j, b) = ($blk, $j, $b);
            let w = codes_avx2::<T>(blk, j);
            let (w, signs) = if signed { (_mm256_sign_epi8(w, w), w) } else { (w, _mm256_setzero_si256()) };
            for r in 0..R {
                // SAFETY: b < n / QK, checked before the loop.
                let x = xs.get_unchecked(r);
                let xv = _mm256_loadu_si256(x.q.as_ptr().add(b * QK) as *const __m256i);
                let xv = if signed { _mm256_sign_epi8(xv, signs) } else { xv };
                let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones));
                let xd = *x.d.get_unchecked(b);
                // Formats scaled per 32 weights have equal group scales
                // d[2j] = d[2j + 1] (block_scales fills both): one product.
                let scale = if per32 {
                    _mm256_set1_ps(d[2 * j] * xd)
                } else {
                    _mm256_set_m128(_mm_set1_ps(d[2 * j + 1] * xd), _mm_set1_ps(d[2 * j] * xd))
                };
                $acc[r] = _mm256_fmadd_ps(scale, p, $acc[r]);
                // add_offsets, reading the activations' sums unchecked.
                match offsets(dtype) {
                    Offsets::None => {}
                    Offsets::Block => $off[r] = m[2 * j].mul_add(*x.bsum.get_unchecked(b), $off[r]),
                    Offsets::Group => {
                        $off[r] = m[2 * j].mul_add(*x.gsum.get_unchecked(2 * b), $off[r]);
                        $off[r] = m[2 * j + 1].mul_add(*x.gsum.get_unchecked(2 * b + 1), $off[r]);
                    }
                }
            }
        }};
    }
    // A block's f16 fields by F16C, in registers (a call per value would
    // spill the accumulators), then its group scales.
    macro_rules! scales {
        ($blk:expr) => {{
            let blk = $blk;
            // SAFETY: the slice holds the bytes read.
            let f = if two {
                f16_fields_avx2::<true>(blk[at..at + 4].as_ptr())
            } else {
                f16_fields_avx2::<false>(blk[at..at + 2].as_ptr())
            };
            block_scales_avx2::<T>(blk, f, &mut d, &mut m);
        }};
    }
    if be == QK {
        // One sub-block a block: even and odd blocks alternate.
        let mut i = 0;
        while i < blocks {
            // SAFETY: i < blocks, checked before the loop.
            let blk = row.get_unchecked(i * bb..(i + 1) * bb);
            scales!(blk);
            if i % 2 == 0 {
                sub!(blk, 0, i, acc0, off0);
            } else {
                sub!(blk, 0, i, acc1, off1);
            }
            i += 1;
        }
    } else {
        for i in 0..blocks {
            // SAFETY: i < blocks, checked before the loop.
            let blk = row.get_unchecked(i * bb..(i + 1) * bb);
            _mm_prefetch::<_MM_HINT_T0>(blk.as_ptr().wrapping_add(2 * bb) as *const i8);
            scales!(blk);
            for j in (0..be / QK).step_by(2) {
                sub!(blk, j, i * (be / QK) + j, acc0, off0);
                sub!(blk, j + 1, i * (be / QK) + j + 1, acc1, off1);
            }
        }
    }
    for r in 0..R {
        out[r] = total_avx2(acc0[r], acc1[r], [off0[r], off1[r]]);
    }
}

/// Whether the CPU has AVX-512 F and BW (the activations' quantizer).
#[cfg(target_arch = "x86_64")]
fn has_avx512bw() -> bool {
    std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw")
}

#[cfg(test)]
mod tests {
    /// The vector quantizer (where the CPU has it) gives the one-value
    /// loop's bits: codes, scales and every sum, over random blocks, halves
    /// and ties of the rounding, zeros, a NaN, a subnormal largest value,
    /// saturating magnitudes and both signs of zero.
    #[test]
    fn the_vector_quantizer_matches_the_one_value_loop() {
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut x: Vec<f32> = Vec::new();
        for b in 0..64 {
            let scale = [1e-3f32, 0.5, 3.0, 1e4][b % 4];
            x.extend((0..super::QK).map(|_| ((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale));
        }
        // Values whose codes land on halves: a largest value of 127, the
        // others k + 0.5 and k + 0.49999997 of both signs.
        x.extend((0..super::QK).map(|i| if i == 0 { 127.0 } else { (i as f32 - 16.0) + 0.5 }));
        x.extend((0..super::QK).map(|i| if i == 0 { -127.0 } else { -(i as f32) - 0.499_999_97 }));
        x.extend(std::iter::repeat_n(0.0f32, super::QK));
        x.extend((0..super::QK).map(|i| if i % 2 == 0 { -0.0 } else { 0.0 }));
        x.extend((0..super::QK).map(|i| if i == 5 { f32::NAN } else { i as f32 }));
        x.extend((0..super::QK).map(|i| if i == 3 { f32::from_bits(7) } else { 0.0 }));
        x.extend((0..super::QK).map(|i| if i == 9 { f32::MAX } else { -(i as f32) * 1e30 }));
        let mut fast = super::Q8Row::default();
        fast.quantize(&x);
        let mut plain = super::Q8Row::default();
        plain.quantize(&x[..0]);
        plain.q.resize(x.len(), 0);
        plain.d.resize(x.len() / super::QK, 0.0);
        plain.gsum.resize(x.len() / super::GROUP, 0.0);
        plain.bsum.resize(x.len() / super::QK, 0.0);
        plain.qsum.resize(x.len() / super::QK, 0);
        plain.qsum16.resize(x.len() / super::GROUP, 0);
        plain.quantize_blocks(&x, 0..x.len() / super::QK);
        assert_eq!(fast.q, plain.q);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fast.d), bits(&plain.d));
        assert_eq!(bits(&fast.gsum), bits(&plain.gsum));
        assert_eq!(bits(&fast.bsum), bits(&plain.bsum));
        assert_eq!(fast.qsum, plain.qsum);
        assert_eq!(fast.qsum16, plain.qsum16);
    }

    /// The quantizer's rounding is `round() as i8` for every value it can
    /// meet and around every half, tie and saturation point.
    #[test]
    fn round_to_i8_is_round_then_cast() {
        let mut checked = 0;
        let mut check = |y: f32| {
            assert_eq!(round_to_i8(y), y.round() as i8, "{y:e}");
            checked += 1;
        };
        for k in -260i32..=260 {
            let half = k as f32 + 0.5;
            for y in [half, k as f32] {
                let mut lo = y;
                let mut hi = y;
                for _ in 0..4 {
                    check(lo);
                    check(hi);
                    lo = f32::from_bits(if lo > 0.0 { lo.to_bits() - 1 } else { lo.to_bits() + 1 });
                    hi = f32::from_bits(if hi >= 0.0 { hi.to_bits() + 1 } else { hi.to_bits() - 1 });
                }
            }
        }
        let mut x = 1u32;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            check((x as f32 / u32::MAX as f32 - 0.5) * 300.0);
        }
        for y in [
            0.0,
            -0.0,
            0.499_999_97,
            -0.499_999_97,
            f32::MIN_POSITIVE,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ] {
            check(y);
        }
        assert!(checked > 200_000);
    }
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
