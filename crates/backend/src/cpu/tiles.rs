//! Block-format weights repacked in tiles of 16 rows for AVX-512 VNNI.
//!
//! The 8-bit dots of [`quant`](super::quant) take one stored row at a time:
//! each block's 32 products land in the lanes of one register and are summed
//! across them before its scale applies, so a 576-wide row of the default
//! model spends as many instructions on those sums as on the products. Here
//! the codes of 16 rows sit side by side instead: one 64-byte register holds
//! four consecutive codes of each of 16 rows, and one `vpdpbusd` with the
//! activation's four bytes broadcast advances all 16 dots. A row's sum never
//! leaves its lane, and the scales of 16 rows apply in one multiply.
//!
//! Formats: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (the 32-weight blocks; the
//! default model is Q4_1 with a Q8_0 embedding, and a Q4_K_M file of a
//! 576-wide model is mostly Q5_0), and Q4_K, Q5_K and Q6_K (most of a
//! K-quant file of a model whose width is whole 256-weight blocks, its LM
//! head among them): their codes are tiled as the 32-weight formats' are,
//! each 32 weights' 6-bit scale and min are kept a byte a row beside the f16
//! `d` and `dmin` of 256, and Q6_K's signed scale of each 16 a byte a row,
//! its 6-bit codes as nibbles and two bit planes (`z = 32`). Every code is held unsigned (`vpdpbusd`
//! multiplies unsigned bytes by signed ones): Q4_0's and Q5_0's as stored,
//! with their offset (8 or 16) subtracted in the integer sum as `z · Σq`,
//! Q8_0's with its sign bit flipped (`z = 128`). A tile takes the bytes its
//! 16 rows took as stored, so repacking costs no memory beyond padding the
//! last tile (and for a K-quant 4 bytes in 148: its 12 bytes of packed 6-bit
//! scales become 16 bytes).
//!
//! Layout of tile `t` (rows `16t..16t+16`) over `nb` blocks of 32 weights,
//! each section block by block, the tile's size rounded up to 64 bytes:
//! - codes: per block, nibble formats 4 × 64 bytes, where byte `4l + j` of
//!   chunk `i` holds weight `8i + j` of row `l` (low nibble) and weight
//!   `8i + 4 + j` (high); Q8_0 8 × 64 bytes, byte `4l + j` of chunk `g`
//!   holding weight `4g + j` of row `l`;
//! - Q5 formats: per block 8 masks of 64 bits, bit `4l + j` of mask `g` the
//!   fifth bit of weight `4g + j` of row `l`; Q6_K: those, then 8 more of
//!   the sixth bits;
//! - Q4_K and Q5_K: per block the 16 rows' 6-bit scales, a byte each, then
//!   their mins; Q6_K: per block the 16 rows' scales of its first 16
//!   weights, then of its second;
//! - per block (per 8 blocks for a K-quant) the 16 rows' f16 scales `d`,
//!   then (Q4_1, Q5_1, the K-quants) their f16 `m` (`dmin`).
//!
//! Arithmetic, per row and block `b`, in this order (the kernel's lanes and
//! [`RowTiles::dot_portable`] alike), with the block's scale `d` and offset
//! `m` (a K-quant's `d · sc` and `−dmin · mn`, each one f32 product):
//! `s = Σ u·q − z·Σq` in i32 (exact), `acc = fma(d·dx, s, acc)`, then where
//! the format has offsets `acc = fma(m, dx·Σq, acc)`; Q6_K the first two
//! steps once a half, with its scale.

use super::quant::{self, Q8Row};
use crate::dtype::{DType, QK};
use half::f16;

/// Rows per tile: one 64-byte register of four codes per row.
pub const TILE_ROWS: usize = 16;

/// How far ahead of the block being dotted its codes are prefetched.
const PREFETCH_BYTES: usize = 4096;

/// How a format's codes are held in a tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Codes {
    /// Four bits per weight, two weights a byte.
    Nibbles,
    /// Four bits as [`Codes::Nibbles`] plus a mask section of fifth bits.
    Nibbles5,
    /// Four bits plus two mask sections, of fifth and sixth bits (Q6_K).
    Nibbles6,
    /// A byte per weight.
    Bytes,
}

/// A format's tile shape: its codes, the offset subtracted from each
/// unsigned code (`z`), whether each block carries an f16 `m`, and whether
/// the scales are a K-quant's (an f16 `d` and `dmin` per 256 weights, a
/// 6-bit scale and min per 32: block `b`'s are `d · sc` and `−dmin · mn`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Format {
    codes: Codes,
    zero: i32,
    min: bool,
    k: bool,
    /// Q6_K's scales: an f16 `d` per 256 weights and a signed byte per 16,
    /// so a 32-weight block has two (`d · sc`).
    q6: bool,
}

/// Where each section of a tile starts, and the tile's size.
#[derive(Clone, Copy, Debug)]
struct Sections {
    high: usize,
    sc: usize,
    mn: usize,
    d: usize,
    m: usize,
    size: usize,
}

impl Format {
    fn of(dtype: DType) -> Option<Format> {
        let (codes, zero, min, k) = match dtype {
            DType::Q4_0 => (Codes::Nibbles, 8, false, false),
            DType::Q4_1 => (Codes::Nibbles, 0, true, false),
            DType::Q5_0 => (Codes::Nibbles5, 16, false, false),
            DType::Q5_1 => (Codes::Nibbles5, 0, true, false),
            DType::Q8_0 => (Codes::Bytes, 128, false, false),
            DType::Q4_K => (Codes::Nibbles, 0, true, true),
            DType::Q5_K => (Codes::Nibbles5, 0, true, true),
            DType::Q6_K => (Codes::Nibbles6, 32, false, false),
            _ => return None,
        };
        Some(Format { codes, zero, min, k, q6: dtype == DType::Q6_K })
    }
    /// Code bytes of one block of a tile.
    const fn code_bytes(self) -> usize {
        match self.codes {
            Codes::Bytes => 8 * 64,
            _ => 4 * 64,
        }
    }
    /// Bit planes above the nibbles (fifth, and sixth).
    const fn planes(self) -> usize {
        match self.codes {
            Codes::Nibbles5 => 1,
            Codes::Nibbles6 => 2,
            _ => 0,
        }
    }
    /// Mask bytes of one block of a tile: 8 masks of 64 bits a plane.
    const fn high_bytes(self) -> usize {
        self.planes() * 64
    }
    /// The sections of a tile of `nb` 32-weight blocks: codes, fifth bits,
    /// a K-quant's 6-bit scales and mins (a byte a row and block), then the
    /// f16 `d` and `m` (per block, or per 8 blocks for a K-quant).
    fn sections(self, nb: usize) -> Sections {
        let high = nb * self.code_bytes();
        let sc = high + nb * self.high_bytes();
        let (sc_bytes, mn_bytes) = match (self.k, self.q6) {
            (true, _) => (nb * TILE_ROWS, nb * TILE_ROWS),
            (_, true) => (2 * nb * TILE_ROWS, 0),
            _ => (0, 0),
        };
        let mn = sc + sc_bytes;
        let d = mn + mn_bytes;
        let halves = if self.k || self.q6 { nb / 8 } else { nb } * 2 * TILE_ROWS;
        let m = d + halves;
        let end = m + if self.min { halves } else { 0 };
        Sections { high, sc, mn, d, m, size: end.next_multiple_of(64) }
    }
}

/// Bytes aligned to 64, so every code chunk is one aligned load.
struct Aligned {
    words: Vec<Line>,
    len: usize,
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

impl Aligned {
    fn zeroed(len: usize) -> Aligned {
        Aligned { words: vec![Line([0; 64]); len.div_ceil(64)], len }
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: `words` is `len.div_ceil(64)` lines of 64 plain bytes.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.len) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `self` is borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut u8, self.len) }
    }
}

/// A block-format matrix `[rows, cols]` repacked in tiles of 16 rows (see
/// the module's documentation for the layout and the arithmetic).
pub struct RowTiles {
    dtype: DType,
    format: Format,
    rows: usize,
    cols: usize,
    /// 32-weight blocks per row.
    nb: usize,
    /// Where a tile's sections start, and its size.
    sec: Sections,
    data: Aligned,
}

impl std::fmt::Debug for RowTiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RowTiles({} [{}, {}])", self.dtype, self.rows, self.cols)
    }
}

/// Whether this CPU runs the tile kernels (AVX-512 F/BW with VNNI, F16C, FMA).
pub fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vnni")
            && std::is_x86_feature_detected!("f16c")
            && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

impl RowTiles {
    /// Whether `dtype` has a tile layout.
    pub fn takes(dtype: DType) -> bool {
        Format::of(dtype).is_some()
    }

    /// `rows` stored rows of `cols` weights of `dtype` (`row_bytes` each, in
    /// `bytes`), repacked; `None` for a format without a tile layout.
    pub fn pack(dtype: DType, bytes: &[u8], rows: usize, cols: usize) -> Option<RowTiles> {
        let format = Format::of(dtype)?;
        let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
        assert!(cols.is_multiple_of(be), "rows of whole {be}-weight blocks");
        let nb = cols / QK;
        assert!(bytes.len() >= rows * (cols / be) * bb, "{rows} rows of {cols} {dtype} weights");
        let sec = format.sections(nb);
        let tile_bytes = sec.size;
        let tiles = rows.div_ceil(TILE_ROWS);
        let mut data = Aligned::zeroed(tiles * tile_bytes);
        let out = data.bytes_mut();
        let mut unpacked = quant::Block::default();
        for r in 0..rows {
            let tile = &mut out[(r / TILE_ROWS) * tile_bytes..][..tile_bytes];
            let l = r % TILE_ROWS;
            for (s, blk) in bytes[r * (cols / be) * bb..][..(cols / be) * bb].chunks_exact(bb).enumerate() {
                quant::unpack_block(dtype, blk, &mut unpacked);
                for j in 0..be / QK {
                    let b = s * (be / QK) + j;
                    let codes: [u8; QK] =
                        std::array::from_fn(|i| (unpacked.q[j * QK + i] as i32 + format.zero) as u8);
                    put_codes(format, &mut tile[b * format.code_bytes()..][..format.code_bytes()], l, &codes);
                    let hb = format.high_bytes();
                    let masks = &mut tile[sec.high + b * hb..][..hb];
                    for (i, &c) in codes.iter().enumerate() {
                        let (g, j) = (i / 4, i % 4);
                        for p in 0..format.planes() {
                            if c & (0x10 << p) != 0 {
                                masks[64 * p + 8 * g + (4 * l + j) / 8] |= 1 << ((4 * l + j) % 8);
                            }
                        }
                    }
                    if format.k {
                        let (sc, mn) = quant::k4_scale_min(j, &blk[4..16]);
                        tile[sec.sc + b * TILE_ROWS + l] = sc;
                        tile[sec.mn + b * TILE_ROWS + l] = mn;
                    }
                    if format.q6 {
                        // Groups 2j and 2j + 1 of 16: the block's halves.
                        for h in 0..2 {
                            tile[sec.sc + b * 2 * TILE_ROWS + h * TILE_ROWS + l] = blk[192 + 2 * j + h];
                        }
                    }
                }
                // The f16 d (and m or dmin): one per stored block.
                let at = if format.k || format.q6 { s } else { s * (be / QK) };
                let d_at = if format.q6 { 208 } else { 0 };
                tile[sec.d + at * 32 + 2 * l..][..2].copy_from_slice(&blk[d_at..d_at + 2]);
                if format.min {
                    tile[sec.m + at * 32 + 2 * l..][..2].copy_from_slice(&blk[2..4]);
                }
            }
        }
        Some(RowTiles { dtype, format, rows, cols, nb, sec, data })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// `[rows, cols]` as stored.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    fn tile(&self, t: usize) -> &[u8] {
        &self.data.bytes()[t * self.sec.size..][..self.sec.size]
    }

    /// The unsigned code of weight `i` of block `b` of lane `l` in `tile`.
    fn code(&self, tile: &[u8], b: usize, l: usize, i: usize) -> u8 {
        let f = self.format;
        let codes = &tile[b * f.code_bytes()..][..f.code_bytes()];
        let (g, j) = (i / 4, i % 4);
        let low = match f.codes {
            Codes::Bytes => return codes[64 * g + 4 * l + j],
            _ => (codes[64 * (g / 2) + 4 * l + j] >> (4 * (g % 2))) & 0x0f,
        };
        let high_at = self.sec.high + b * f.high_bytes();
        let mut code = low;
        for p in 0..f.planes() {
            let bit = (tile[high_at + 64 * p + 8 * g + (4 * l + j) / 8] >> ((4 * l + j) % 8)) & 1;
            code |= bit << (4 + p);
        }
        code
    }

    /// Lane `l`'s f16 `d` (and `m` or `dmin`) of the stored block that
    /// holds 32-weight block `b`, in `tile`, as bytes.
    fn scales(&self, tile: &[u8], b: usize, l: usize) -> ([u8; 2], [u8; 2]) {
        let sec = self.sec;
        let at = if self.format.k || self.format.q6 { b / 8 } else { b } * 32 + 2 * l;
        let d = [tile[sec.d + at], tile[sec.d + at + 1]];
        let m = match self.format.min {
            true => [tile[sec.m + at], tile[sec.m + at + 1]],
            false => [0, 0],
        };
        (d, m)
    }

    /// Lane `l`'s scales of the two halves of 32-weight block `b` and its
    /// offset as every path applies them: `w = d · c + m` (`c` the code less
    /// `z`); a K-quant's `d · sc` and `−dmin · mn`, Q6_K's `d · sc` per 16, as
    /// [`quant::unpack_block`] computes them. The halves differ only for Q6_K.
    fn lane_dm(&self, tile: &[u8], b: usize, l: usize) -> ([f32; 2], f32) {
        let (d, m) = self.scales(tile, b, l);
        let (d, m) = (f16::from_le_bytes(d).to_f32(), f16::from_le_bytes(m).to_f32());
        let sec = self.sec;
        if self.format.q6 {
            let sc = |h: usize| tile[sec.sc + b * 2 * TILE_ROWS + h * TILE_ROWS + l] as i8;
            return ([d * sc(0) as f32, d * sc(1) as f32], 0.0);
        }
        if !self.format.k {
            return ([d, d], m);
        }
        let (sc, mn) = (tile[sec.sc + b * TILE_ROWS + l], tile[sec.mn + b * TILE_ROWS + l]);
        let d = d * sc as f32;
        ([d, d], -m * mn as f32)
    }

    /// Stored row `r` as the checkpoint held it (`row_bytes` of `dtype`),
    /// written into `out`.
    pub fn stored_row(&self, r: usize, out: &mut Vec<u8>) {
        assert!(r < self.rows, "row {r} of {}", self.rows);
        let bb = self.dtype.block_bytes();
        out.clear();
        out.resize(self.cols / self.dtype.block_elems() * bb, 0);
        let (tile, l) = (self.tile(r / TILE_ROWS), r % TILE_ROWS);
        if self.format.k {
            return self.stored_k_row(tile, l, out);
        }
        if self.format.q6 {
            return self.stored_q6_row(tile, l, out);
        }
        let (scale_at, two) = scales_at(self.dtype);
        for (b, blk) in out.chunks_exact_mut(bb).enumerate() {
            let (d, m) = self.scales(tile, b, l);
            blk[scale_at..scale_at + 2].copy_from_slice(&d);
            if two {
                blk[scale_at + 2..scale_at + 4].copy_from_slice(&m);
            }
            let codes: [u8; QK] = std::array::from_fn(|i| self.code(tile, b, l, i));
            match self.dtype {
                DType::Q8_0 => {
                    for (o, c) in blk[2..].iter_mut().zip(codes) {
                        *o = c ^ 0x80;
                    }
                }
                _ => {
                    let qs_at = scale_at + if two { 4 } else { 2 };
                    let five = self.format.codes == Codes::Nibbles5;
                    let qs_at = if five { qs_at + 4 } else { qs_at };
                    let mut qh = 0u32;
                    for j in 0..16 {
                        blk[qs_at + j] = (codes[j] & 0x0f) | ((codes[j + 16] & 0x0f) << 4);
                        qh |= (((codes[j] >> 4) & 1) as u32) << j
                            | (((codes[j + 16] >> 4) & 1) as u32) << (j + 16);
                    }
                    if five {
                        blk[qs_at - 4..qs_at].copy_from_slice(&qh.to_le_bytes());
                    }
                }
            }
        }
    }

    /// [`RowTiles::stored_row`] of a K-quant: Q4_K `[d][dmin][12 scales][128
    /// qs]`, Q5_K with `[32 qh]` before the `qs` (the layouts of
    /// [`quant::unpack_block`]).
    fn stored_k_row(&self, tile: &[u8], l: usize, out: &mut [u8]) {
        let sec = self.sec;
        let five = self.format.codes == Codes::Nibbles5;
        let qs_at = if five { 48 } else { 16 };
        for (s, blk) in out.chunks_exact_mut(self.dtype.block_bytes()).enumerate() {
            let (d, m) = self.scales(tile, 8 * s, l);
            blk[0..2].copy_from_slice(&d);
            blk[2..4].copy_from_slice(&m);
            let sc: [u8; 8] = std::array::from_fn(|j| tile[sec.sc + (8 * s + j) * TILE_ROWS + l]);
            let mn: [u8; 8] = std::array::from_fn(|j| tile[sec.mn + (8 * s + j) * TILE_ROWS + l]);
            for j in 0..4 {
                blk[4 + j] = sc[j] | (sc[j + 4] >> 4) << 6;
                blk[8 + j] = mn[j] | (mn[j + 4] >> 4) << 6;
                blk[12 + j] = (sc[j + 4] & 0x0f) | (mn[j + 4] & 0x0f) << 4;
            }
            for c in 0..4 {
                for i in 0..QK {
                    let (lo, hi) =
                        (self.code(tile, 8 * s + 2 * c, l, i), self.code(tile, 8 * s + 2 * c + 1, l, i));
                    blk[qs_at + 32 * c + i] = (lo & 0x0f) | (hi & 0x0f) << 4;
                    if five {
                        blk[16 + i] |= ((lo >> 4) & 1) << (2 * c) | ((hi >> 4) & 1) << (2 * c + 1);
                    }
                }
            }
        }
    }

    /// [`RowTiles::stored_row`] of Q6_K: `[128 ql][64 qh][16 i8 scales][d]`,
    /// weight `128h + 32k + i` a nibble of `ql[64h + i + 32(k % 2)]` (low
    /// for k < 2) below bits `2k..2k+2` of `qh[32h + i]`.
    fn stored_q6_row(&self, tile: &[u8], l: usize, out: &mut [u8]) {
        let sec = self.sec;
        for (s, blk) in out.chunks_exact_mut(self.dtype.block_bytes()).enumerate() {
            let (d, _) = self.scales(tile, 8 * s, l);
            blk[208..210].copy_from_slice(&d);
            for jb in 0..8 {
                let b = 8 * s + jb;
                for h in 0..2 {
                    blk[192 + 2 * jb + h] = tile[sec.sc + b * 2 * TILE_ROWS + h * TILE_ROWS + l];
                }
                let (h, k) = (jb / 4, jb % 4);
                for i in 0..QK {
                    let c = self.code(tile, b, l, i);
                    blk[64 * h + i + 32 * (k % 2)] |= (c & 0x0f) << (4 * (k / 2));
                    blk[128 + 32 * h + i] |= (c >> 4) << (2 * k);
                }
            }
        }
    }

    /// Row `r` widened to f32, bit for bit what [`quant::dequantize_row`]
    /// gives the stored row (`d · c + m` per weight, `c` the signed code).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows && out.len() == self.cols, "row {r} of [{}, {}]", self.rows, self.cols);
        let (tile, l) = (self.tile(r / TILE_ROWS), r % TILE_ROWS);
        let f = self.format;
        let high_at = self.sec.high;
        let cb = f.code_bytes();
        let word = |at: usize| u32::from_le_bytes([tile[at], tile[at + 1], tile[at + 2], tile[at + 3]]);
        for (b, o) in out.chunks_exact_mut(QK).enumerate() {
            let (d2, m) = self.lane_dm(tile, b, l);
            let codes = b * cb + 4 * l;
            // The four codes of group g of this lane, as bytes of a word.
            let group = |g: usize| match f.codes {
                Codes::Bytes => word(codes + 64 * g),
                _ => {
                    let mut w = (word(codes + 64 * (g / 2)) >> (4 * (g % 2))) & 0x0f0f_0f0f;
                    for p in 0..f.planes() {
                        // Bits 4l..4l+4 of mask g of plane p, one a byte, at bit 4 + p.
                        let at = high_at + b * f.high_bytes() + 64 * p + 8 * g + l / 2;
                        let bits = (tile[at] >> (4 * (l % 2))) as u32 & 0x0f;
                        let spread = (bits & 1) | (bits & 2) << 7 | (bits & 4) << 14 | (bits & 8) << 21;
                        w |= spread << (4 + p);
                    }
                    w
                }
            };
            for (g, o) in o.chunks_exact_mut(4).enumerate() {
                let (w, d) = (group(g), d2[g / 4]);
                for (j, o) in o.iter_mut().enumerate() {
                    let c = ((w >> (8 * j)) & 0xff) as i32 - f.zero;
                    *o = d * c as f32 + m;
                }
            }
        }
    }

    /// Rows `r0..r0 + cols` widened into the GEMM's column panels (`out`,
    /// [`gemm::pack_cols`](super::gemm)'s layout with 16 columns a panel:
    /// for each weight `p`, the 16 rows' values at `p`), zeros past the last
    /// row: a tile is a panel already, one register of codes a row of it
    /// four times over. The values are [`RowTiles::dequantize_row`]'s.
    pub fn widen_panels(&self, r0: usize, cols: usize, out: &mut [f32]) {
        assert!(r0.is_multiple_of(TILE_ROWS), "a tile's first row, not {r0}");
        let k = self.cols;
        assert_eq!(out.len(), cols.div_ceil(TILE_ROWS) * TILE_ROWS * k, "whole panels");
        assert!(r0 + cols <= self.rows, "rows {r0}..{} of {}", r0 + cols, self.rows);
        for (i, panel) in out.chunks_exact_mut(TILE_ROWS * k).enumerate() {
            let t = r0 / TILE_ROWS + i;
            #[cfg(target_arch = "x86_64")]
            if supported() {
                // SAFETY: the CPU has the features (checked); the tile and
                // the panel hold `nb` blocks of 16 rows.
                unsafe { self.widen_tile_avx512(t, panel) };
                continue;
            }
            let mut row = vec![0f32; k];
            for l in 0..TILE_ROWS {
                match t * TILE_ROWS + l {
                    r if r < self.rows => self.dequantize_row(r, &mut row),
                    _ => row.fill(0.0),
                }
                for (p, v) in row.iter().enumerate() {
                    panel[p * TILE_ROWS + l] = *v;
                }
            }
        }
        // Rows past the matrix in the last tile are zero codes with zero
        // scales, which widen to +0.0 as the panels' padding is.
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    unsafe fn widen_tile_avx512(&self, t: usize, panel: &mut [f32]) {
        use std::arch::x86_64::*;
        let f = self.format;
        let tile = self.tile(t).as_ptr();
        let sec = self.sec;
        let high_at = sec.high;
        let cb = f.code_bytes();
        let low4 = _mm512_set1_epi8(0x0f);
        let byte = _mm512_set1_epi32(0xff);
        let zero = _mm512_set1_epi32(f.zero);
        let out = panel.as_mut_ptr();
        assert!(panel.len() >= self.nb * QK * TILE_ROWS);
        for b in 0..self.nb {
            let (d2, m) = lane_dm_avx512(tile, sec, f, b);
            for g in 0..8 {
                let d = d2[g / 4];
                let u = match f.codes {
                    Codes::Bytes => _mm512_load_si512(tile.add(b * cb + 64 * g) as *const __m512i),
                    _ => {
                        let c = _mm512_load_si512(tile.add(b * cb + 64 * (g / 2)) as *const __m512i);
                        let c = if g % 2 == 1 { _mm512_srli_epi16::<4>(c) } else { c };
                        let mut u = _mm512_and_si512(c, low4);
                        let masks = tile.add(high_at + b * f.high_bytes()) as *const u64;
                        for p in 0..f.planes() {
                            let k = _cvtu64_mask64(masks.add(8 * p + g).read_unaligned());
                            u = _mm512_mask_add_epi8(u, k, u, _mm512_set1_epi8(0x10 << p));
                        }
                        u
                    }
                };
                // Byte j of each row's word: weight 4g + j of the 16 rows.
                let rows = [
                    _mm512_and_si512(u, byte),
                    _mm512_and_si512(_mm512_srli_epi32::<8>(u), byte),
                    _mm512_and_si512(_mm512_srli_epi32::<16>(u), byte),
                    _mm512_srli_epi32::<24>(u),
                ];
                for (j, c) in rows.into_iter().enumerate() {
                    let c = _mm512_cvtepi32_ps(_mm512_sub_epi32(c, zero));
                    // d · c + m, rounded twice as the stored rows widen.
                    let v = _mm512_add_ps(_mm512_mul_ps(d, c), m);
                    _mm512_storeu_ps(out.add((b * QK + 4 * g + j) * TILE_ROWS), v);
                }
            }
        }
    }

    /// Rows `r0..` (as many as `out` holds, `xs.len()` values each, row-major
    /// by weight row) dotted with each 8-bit activation row of `xs`. `r0` is
    /// a multiple of 16. The AVX-512 kernel where [`supported`], else
    /// [`RowTiles::dot_portable`]: the same bits.
    pub fn dot_many(&self, r0: usize, xs: &[Q8Row], out: &mut [f32]) {
        assert!(r0.is_multiple_of(TILE_ROWS), "a tile's first row, not {r0}");
        assert!(!xs.is_empty() && out.len().is_multiple_of(xs.len()), "whole rows of outputs");
        let rows = out.len() / xs.len();
        assert!(r0 + rows <= self.rows, "rows {r0}..{} of {}", r0 + rows, self.rows);
        for x in xs {
            x.check_len(self.cols);
        }
        #[cfg(target_arch = "x86_64")]
        if supported() {
            // SAFETY: the CPU has the kernels' features (checked above); the
            // rows and activations were checked against the shape.
            unsafe { self.dot_many_avx512(r0, xs, out) };
            return;
        }
        self.dot_portable(r0, xs, out)
    }

    /// [`RowTiles::dot_many`] one weight at a time, in the kernel's order of
    /// operations: the reference its lanes match bit for bit.
    pub fn dot_portable(&self, r0: usize, xs: &[Q8Row], out: &mut [f32]) {
        let n = xs.len();
        let zero = self.format.zero;
        for (i, o) in out.chunks_exact_mut(n).enumerate() {
            let r = r0 + i;
            let (tile, l) = (self.tile(r / TILE_ROWS), r % TILE_ROWS);
            for (x, o) in xs.iter().zip(o.iter_mut()) {
                let mut acc = 0f32;
                for b in 0..self.nb {
                    let q = &x.q()[b * QK..(b + 1) * QK];
                    let dot = |r: std::ops::Range<usize>| -> i32 {
                        r.map(|i| self.code(tile, b, l, i) as i32 * q[i] as i32).sum()
                    };
                    let (d, m) = self.lane_dm(tile, b, l);
                    if self.format.q6 {
                        // A scale a half: each half's sum less z times its Σq.
                        for h in 0..2 {
                            let s = dot(16 * h..16 * h + 16) - zero * x.qsum16()[2 * b + h];
                            acc = (d[h] * x.d()[b]).mul_add(s as f32, acc);
                        }
                        continue;
                    }
                    let s = dot(0..QK) - zero * x.qsum()[b];
                    acc = (d[0] * x.d()[b]).mul_add(s as f32, acc);
                    if self.format.min {
                        acc = m.mul_add(x.bsum()[b], acc);
                    }
                }
                *o = acc;
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
    unsafe fn dot_many_avx512(&self, r0: usize, xs: &[Q8Row], out: &mut [f32]) {
        let n = xs.len();
        let rows = out.len() / n;
        let mut lanes = [[0f32; TILE_ROWS]; 4];
        let mut t = r0 / TILE_ROWS;
        // The kernel prefetches a block's codes PREFETCH_BYTES ahead, so a
        // run's first PREFETCH_BYTES (a task's first tiles, often all of a
        // small matrix's share) would be met cold: ask for them now.
        let span = rows.div_ceil(TILE_ROWS) * self.sec.size;
        let first = self.tile(t).as_ptr();
        for line in (0..span.min(PREFETCH_BYTES)).step_by(64) {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                first.add(line) as *const i8
            );
        }
        let mut done = 0;
        while done < rows {
            let tile = self.tile(t).as_ptr();
            let take = TILE_ROWS.min(rows - done);
            let mut r = 0;
            while r < n {
                let k = (n - r).min(4);
                let x = &xs[r..r + k];
                // SAFETY: the tile holds `nb` blocks in its format's layout;
                // every row of `x` holds `nb` blocks (checked by the caller).
                match k {
                    1 => self.tile_kernel::<1>(tile, x, &mut lanes),
                    2 => self.tile_kernel::<2>(tile, x, &mut lanes),
                    3 => self.tile_kernel::<3>(tile, x, &mut lanes),
                    _ => self.tile_kernel::<4>(tile, x, &mut lanes),
                }
                for (a, lane) in lanes[..k].iter().enumerate() {
                    for (i, &v) in lane[..take].iter().enumerate() {
                        out[(done + i) * n + r + a] = v;
                    }
                }
                r += k;
            }
            done += take;
            t += 1;
        }
    }

    /// One tile's 16 rows dotted with `R` activation rows, into `lanes`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
    #[inline]
    unsafe fn tile_kernel<const R: usize>(
        &self,
        tile: *const u8,
        xs: &[Q8Row],
        lanes: &mut [[f32; TILE_ROWS]; 4],
    ) {
        let (nb, z) = ((self.nb, self.sec), self.format.zero);
        match (self.format.codes, self.format.min, self.format.k) {
            (Codes::Nibbles, false, _) => tile_dots::<0, false, false, R>(tile, nb, z, xs, lanes),
            (Codes::Nibbles, true, false) => tile_dots::<0, true, false, R>(tile, nb, z, xs, lanes),
            (Codes::Nibbles, true, true) => tile_dots::<0, true, true, R>(tile, nb, z, xs, lanes),
            (Codes::Nibbles5, false, _) => tile_dots::<1, false, false, R>(tile, nb, z, xs, lanes),
            (Codes::Nibbles5, true, false) => tile_dots::<1, true, false, R>(tile, nb, z, xs, lanes),
            (Codes::Nibbles5, true, true) => tile_dots::<1, true, true, R>(tile, nb, z, xs, lanes),
            (Codes::Bytes, ..) => tile_dots::<2, false, false, R>(tile, nb, z, xs, lanes),
            (Codes::Nibbles6, ..) => tile_dots::<3, false, false, R>(tile, nb, z, xs, lanes),
        }
    }
}

/// The offset of a 32-weight format's f16 `d` in its block, and whether an
/// f16 `m` follows it.
fn scales_at(dtype: DType) -> (usize, bool) {
    (0, matches!(dtype, DType::Q4_1 | DType::Q5_1))
}

/// Lane `l`'s 32 unsigned codes into one block's code section.
fn put_codes(format: Format, codes: &mut [u8], l: usize, c: &[u8; QK]) {
    for (i, &v) in c.iter().enumerate() {
        let (g, j) = (i / 4, i % 4);
        match format.codes {
            Codes::Bytes => codes[64 * g + 4 * l + j] = v,
            _ => codes[64 * (g / 2) + 4 * l + j] |= (v & 0x0f) << (4 * (g % 2)),
        }
    }
}

/// The 16 rows' scale and offset of 32-weight block `b` (zeros for a
/// format without `m`), as [`RowTiles::lane_dm`] computes each: a K-quant's
/// `d · sc` and `−dmin · mn` from its f16 pair and the block's 6-bit bytes.
///
/// # Safety
/// `tile` points at a whole tile of `format` with `sec`'s sections.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,f16c")]
#[inline]
unsafe fn lane_dm_avx512(
    tile: *const u8,
    sec: Sections,
    format: Format,
    b: usize,
) -> ([std::arch::x86_64::__m512; 2], std::arch::x86_64::__m512) {
    use std::arch::x86_64::*;
    let half = |at: usize| _mm512_cvtph_ps(_mm256_loadu_si256(tile.add(at) as *const __m256i));
    let at = if format.k || format.q6 { b / 8 } else { b } * 32;
    let d = half(sec.d + at);
    let m = if format.min { half(sec.m + at) } else { _mm512_setzero_ps() };
    let load16 = |at: usize| _mm_loadu_si128(tile.add(at) as *const __m128i);
    if format.q6 {
        let sc = |h: usize| {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(sec.sc + b * 2 * TILE_ROWS + h * TILE_ROWS)))
        };
        return ([_mm512_mul_ps(d, sc(0)), _mm512_mul_ps(d, sc(1))], m);
    }
    if !format.k {
        return ([d, d], m);
    }
    let bytes = |at: usize| _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(load16(at)));
    // −dmin by its sign bit, exactly as `-m` negates.
    let neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(m), _mm512_set1_epi32(i32::MIN)));
    let sc = bytes(sec.sc + b * TILE_ROWS);
    let mn = bytes(sec.mn + b * TILE_ROWS);
    let d = _mm512_mul_ps(d, sc);
    ([d, d], _mm512_mul_ps(neg, mn))
}

/// The tile kernel for code layout `C` (0 nibbles, 1 nibbles with fifth
/// bits, 2 bytes, 3 Q6_K's nibbles with two bit planes), with or without an
/// `m` per block (`MIN`), a K-quant's scales or not (`K`), over `R`
/// activation rows: lane `l` of `lanes[a]` gets row `l`'s dot with `xs[a]`.
///
/// # Safety
/// `tile` points at a whole tile of `nb` blocks of that layout with sections `sec`, and each of
/// the `R` rows of `xs` holds `nb` blocks with their scales and sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma,f16c")]
#[inline]
unsafe fn tile_dots<const C: u8, const MIN: bool, const K: bool, const R: usize>(
    tile: *const u8,
    (nb, sec): (usize, Sections),
    zero: i32,
    xs: &[Q8Row],
    lanes: &mut [[f32; TILE_ROWS]; 4],
) {
    use std::arch::x86_64::*;
    let format = Format {
        codes: match C {
            0 => Codes::Nibbles,
            1 => Codes::Nibbles5,
            2 => Codes::Bytes,
            _ => Codes::Nibbles6,
        },
        zero,
        min: MIN,
        k: K,
        q6: C == 3,
    };
    let high_at = sec.high;
    let cb = format.code_bytes();
    let low4 = _mm512_set1_epi8(0x0f);
    let high4 = _mm512_set1_epi8(0xf0u8 as i8);
    let sixteen = _mm512_set1_epi8(0x10);
    let thirty_two = _mm512_set1_epi8(0x20);
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        let codes = tile.add(b * cb);
        // Every line of the codes some blocks ahead (the hardware's
        // prefetcher follows a tile's three sections less far).
        for line in (0..cb).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(codes.wrapping_add(PREFETCH_BYTES + line) as *const i8);
        }
        let mut u = [_mm512_setzero_si512(); 8];
        if C == 2 {
            for (g, u) in u.iter_mut().enumerate() {
                *u = _mm512_load_si512(codes.add(64 * g) as *const __m512i);
            }
        } else {
            for i in 0..4 {
                let c = _mm512_load_si512(codes.add(64 * i) as *const __m512i);
                u[2 * i] = _mm512_and_si512(c, low4);
                // Plain nibbles: the high ones in place, 16 times their
                // code (the odd groups' sum is shifted back, exactly, once a
                // block); with fifth bits they must come down first.
                u[2 * i + 1] = match C {
                    0 => _mm512_and_si512(c, high4),
                    _ => _mm512_and_si512(_mm512_srli_epi16::<4>(c), low4),
                };
            }
            if C == 1 || C == 3 {
                // Plane p's masks add 16 << p to the codes whose bit is set.
                let masks = tile.add(high_at + b * format.high_bytes()) as *const u64;
                for p in 0..format.planes() {
                    let add = if p == 0 { sixteen } else { thirty_two };
                    for (g, u) in u.iter_mut().enumerate() {
                        let k = _cvtu64_mask64(masks.add(8 * p + g).read_unaligned());
                        *u = _mm512_mask_add_epi8(*u, k, *u, add);
                    }
                }
            }
        }
        let (d2, m) = lane_dm_avx512(tile, sec, format, b);
        for (a, acc) in acc.iter_mut().enumerate() {
            let x = xs.get_unchecked(a);
            let q = x.q().as_ptr().add(b * QK) as *const i32;
            let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            let xq = |g: usize| _mm512_set1_epi32(q.add(g).read_unaligned());
            if C == 3 {
                // Q6_K: a scale a half, so a sum a half (groups 0-3, 4-7).
                for g in 0..4 {
                    s0 = _mm512_dpbusd_epi32(s0, u[g], xq(g));
                    s1 = _mm512_dpbusd_epi32(s1, u[g + 4], xq(g + 4));
                }
                let qs = x.qsum16().as_ptr().add(2 * b);
                s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(zero * *qs));
                s1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(zero * *qs.add(1)));
                let dx = _mm512_set1_ps(*x.d().get_unchecked(b));
                *acc = _mm512_fmadd_ps(_mm512_mul_ps(d2[0], dx), _mm512_cvtepi32_ps(s0), *acc);
                *acc = _mm512_fmadd_ps(_mm512_mul_ps(d2[1], dx), _mm512_cvtepi32_ps(s1), *acc);
                continue;
            }
            for g in (0..8).step_by(2) {
                s0 = _mm512_dpbusd_epi32(s0, u[g], xq(g));
                s1 = _mm512_dpbusd_epi32(s1, u[g + 1], xq(g + 1));
            }
            let s1 = if C == 0 { _mm512_srai_epi32::<4>(s1) } else { s1 };
            let d = d2[0];
            let mut s = _mm512_add_epi32(s0, s1);
            if !MIN {
                s = _mm512_sub_epi32(s, _mm512_set1_epi32(zero * *x.qsum().get_unchecked(b)));
            }
            let scale = _mm512_mul_ps(d, _mm512_set1_ps(*x.d().get_unchecked(b)));
            *acc = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(s), *acc);
            if MIN {
                *acc = _mm512_fmadd_ps(m, _mm512_set1_ps(*x.bsum().get_unchecked(b)), *acc);
            }
        }
    }
    for (lane, acc) in lanes.iter_mut().zip(acc) {
        _mm512_storeu_ps(lane.as_mut_ptr(), acc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random blocks of `dtype`: every byte random, the f16 scales small
    /// finite values of both signs (one block's scale zero, one an f16
    /// subnormal), so every code and fifth bit turns up.
    fn random_rows(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let mut next = move || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        let bb = dtype.block_bytes();
        let mut bytes: Vec<u8> = (0..rows * cols / QK * bb).map(|_| next() as u8).collect();
        let (at, two) = match dtype {
            DType::Q4_K | DType::Q5_K => (0, true),
            DType::Q6_K => (208, false),
            _ => scales_at(dtype),
        };
        for (i, blk) in bytes.chunks_exact_mut(bb).enumerate() {
            let scale = |v: u32| match i % 7 {
                3 => f16::from_bits(0),
                5 => f16::from_bits(0x0003),
                _ => f16::from_f32((v % 2000) as f32 / 1e5 - 0.01),
            };
            blk[at..at + 2].copy_from_slice(&scale(next()).to_le_bytes());
            if two {
                blk[at + 2..at + 4].copy_from_slice(&scale(next()).to_le_bytes());
            }
        }
        bytes
    }

    fn q8_rows(count: usize, cols: usize, seed: u32) -> Vec<Q8Row> {
        (0..count)
            .map(|r| {
                let x: Vec<f32> = (0..cols)
                    .map(|i| {
                        let h = (i as u32 ^ seed.wrapping_mul(2654435761)).wrapping_mul(2246822519)
                            ^ (r as u32 * 97);
                        ((h >> 8) % 2001) as f32 / 1000.0 - 1.0
                    })
                    .collect();
                let mut q = Q8Row::default();
                q.quantize(&x);
                q
            })
            .collect()
    }

    const FORMATS: [DType; 8] = [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
    ];

    /// A row width of whole blocks of `dtype`: `n` 32-weight blocks, or for
    /// a K-quant `n` rounded up to whole 256-weight ones.
    fn width(dtype: DType, n: usize) -> usize {
        (n * QK).next_multiple_of(dtype.block_elems())
    }

    #[test]
    fn a_tiled_row_is_the_stored_row_and_widens_to_the_same_bits() {
        for dtype in FORMATS {
            // 37 rows: two whole tiles and a padded one.
            let (rows, cols) = (37, width(dtype, 3));
            let bytes = random_rows(dtype, rows, cols, dtype as u64);
            let tiles = RowTiles::pack(dtype, &bytes, rows, cols).expect("a tile format");
            let rb = cols / dtype.block_elems() * dtype.block_bytes();
            let (mut back, mut want, mut got) = (Vec::new(), vec![0f32; cols], vec![0f32; cols]);
            for r in 0..rows {
                tiles.stored_row(r, &mut back);
                assert_eq!(back, &bytes[r * rb..(r + 1) * rb], "{dtype} row {r}");
                quant::dequantize_row(dtype, &bytes[r * rb..(r + 1) * rb], &mut want);
                tiles.dequantize_row(r, &mut got);
                let (w, g): (Vec<u32>, Vec<u32>) =
                    (want.iter().map(|v| v.to_bits()).collect(), got.iter().map(|v| v.to_bits()).collect());
                assert_eq!(w, g, "{dtype} row {r} widened");
            }
        }
    }

    #[test]
    fn the_tile_kernel_gives_the_portable_bits_and_the_8_bit_dot_within_its_rounding() {
        for dtype in FORMATS {
            let (rows, cols) = (53, width(dtype, 6).max(2 * dtype.block_elems()));
            let bytes = random_rows(dtype, rows, cols, 7 + dtype as u64);
            let tiles = RowTiles::pack(dtype, &bytes, rows, cols).expect("a tile format");
            let rb = cols / dtype.block_elems() * dtype.block_bytes();
            for n in [1, 2, 3, 4, 5, 8] {
                let xs = q8_rows(n, cols, n as u32);
                for r0 in [0, 16, 48] {
                    let count = (rows - r0).min(21);
                    let (mut got, mut want) = (vec![0f32; count * n], vec![0f32; count * n]);
                    tiles.dot_many(r0, &xs, &mut got);
                    tiles.dot_portable(r0, &xs, &mut want);
                    let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{dtype}: {n} rows from {r0}");
                    // The same dot in another order: quant's 8-bit dot of
                    // the stored row, within f32 rounding of the sum's terms.
                    for (i, vs) in got.chunks_exact(n).enumerate() {
                        let row = &bytes[(r0 + i) * rb..(r0 + i + 1) * rb];
                        let mut w = vec![0f32; cols];
                        quant::dequantize_row(dtype, row, &mut w);
                        for (x, &v) in xs.iter().zip(vs) {
                            let other = quant::dot_row_q8_portable(dtype, row, x);
                            let scale: f32 = w.iter().zip(x.dequantized()).map(|(a, b)| (a * b).abs()).sum();
                            assert!(
                                (v - other).abs() <= 1e-5 * scale + 1e-30,
                                "{dtype} row {}: {v} against {other} (terms {scale})",
                                r0 + i
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn widened_panels_hold_the_widened_rows() {
        for dtype in FORMATS {
            let (rows, cols) = (37, width(dtype, 2));
            let bytes = random_rows(dtype, rows, cols, 11 + dtype as u64);
            let tiles = RowTiles::pack(dtype, &bytes, rows, cols).expect("a tile format");
            for (r0, n) in [(0usize, 37usize), (16, 21), (32, 5)] {
                let mut panels = vec![f32::NAN; n.div_ceil(TILE_ROWS) * TILE_ROWS * cols];
                tiles.widen_panels(r0, n, &mut panels);
                let mut row = vec![0f32; cols];
                for c in 0..n.div_ceil(TILE_ROWS) * TILE_ROWS {
                    let (panel, l) = (c / TILE_ROWS, c % TILE_ROWS);
                    match r0 + c < rows {
                        true => tiles.dequantize_row(r0 + c, &mut row),
                        false => row.fill(0.0),
                    }
                    for (p, &v) in row.iter().enumerate() {
                        let got = panels[panel * TILE_ROWS * cols + p * TILE_ROWS + l];
                        assert_eq!(got.to_bits(), v.to_bits(), "{dtype} row {} weight {p}", r0 + c);
                    }
                }
            }
        }
    }

    #[test]
    fn formats_without_a_tile_layout_are_not_packed() {
        for dtype in [DType::Q2_K, DType::Q3_K, DType::IQ4_NL, DType::IQ4_XS, DType::F16] {
            assert!(!RowTiles::takes(dtype));
        }
        let bytes = vec![0u8; 18 * 2];
        assert!(RowTiles::pack(DType::IQ4_NL, &bytes, 2, 32).is_none());
    }
}
