//! The f32 GEMM of prefill and of wide decode steps: `C[rows, n] = X[rows, k]
//! · W[n, k]ᵀ` for weights that are widened to f32 a slab of columns at a
//! time.
//!
//! The input rows are packed once per matmul, in panels of [`MR`] rows
//! ([`pack_rows`]), and every task reads that one copy; a task widens its
//! weight rows straight into panels of [`NR`] columns ([`pack_cols`]), so
//! nothing is packed twice. The kernel keeps an `MR × NR` block of `C` in
//! twelve AVX2 registers (with AVX-512, the blocks of two column panels in
//! twelve registers) and adds one product of a row and a column panel per
//! step of `k`, by fused multiply-adds: each output is one running sum
//! over `k` in order, whatever the number of rows, the task widths or the
//! threads, so a row's result does not depend on what else is in the batch.
//! The baseline build performs the same fused multiply-adds in the same
//! order (`f32::mul_add`), so both give the same bits.

/// Rows of `X` in one panel: the kernel's block height.
pub(super) const MR: usize = 6;
/// Columns of `W` in one panel: the kernel's block width (two registers).
pub(super) const NR: usize = 16;

/// Floats that `rows` input rows of `k` take packed (whole panels).
pub(super) fn packed_rows_len(rows: usize, k: usize) -> usize {
    rows.div_ceil(MR) * MR * k
}

/// Floats that `cols` weight columns of `k` take packed (whole panels).
pub(super) fn packed_cols_len(cols: usize, k: usize) -> usize {
    cols.div_ceil(NR) * NR * k
}

/// Panel `i` of the input rows `x` (`rows × k`, row-major) into `out`
/// (`MR × k`): for each `p`, the values `x[i·MR + r][p]` for `r` in
/// `0..MR`, zeros past the last row.
pub(super) fn pack_rows(x: &[f32], rows: usize, k: usize, i: usize, out: &mut [f32]) {
    assert_eq!(out.len(), MR * k, "one panel");
    for r in 0..MR {
        let row = i * MR + r;
        if row < rows {
            let src = &x[row * k..(row + 1) * k];
            for (p, &v) in src.iter().enumerate() {
                out[p * MR + r] = v;
            }
        } else {
            for p in 0..k {
                out[p * MR + r] = 0.0;
            }
        }
    }
}

/// `cols` weight rows of `k` into column panels in `out`
/// ([`packed_cols_len`]): `widen(c, row)` writes weight row `c` (of
/// `0..cols`) as f32; panel `c / NR` holds, for each `p`, the values of its
/// `NR` columns at `p`, zeros past the last column. A panel's rows are
/// widened into `rows` (`NR · k` floats of scratch) first, then written out
/// in the panel's order: written column by column, each store went to
/// another cache line of a panel larger than the L1 cache.
pub(super) fn pack_cols(
    cols: usize,
    k: usize,
    rows: &mut [f32],
    mut widen: impl FnMut(usize, &mut [f32]),
    out: &mut [f32],
) {
    assert_eq!(out.len(), packed_cols_len(cols, k), "whole panels");
    assert_eq!(rows.len(), NR * k, "a panel's rows of scratch");
    for (j, panel) in out.chunks_exact_mut(NR * k).enumerate() {
        for (c, row) in rows.chunks_exact_mut(k).enumerate() {
            match j * NR + c {
                col if col < cols => widen(col, row),
                _ => row.fill(0.0),
            }
        }
        for (p, at) in panel.chunks_exact_mut(NR).enumerate() {
            for (c, v) in at.iter_mut().enumerate() {
                *v = rows[c * k + p];
            }
        }
    }
}

/// `C[r][j] = Σ_p A[r][p] · B[j][p]` for every input row `r < rows` (the
/// packed rows `a`, [`pack_rows`] panel after panel) and column `j < cols`
/// (the packed columns `b`), into `c` at `c + r·ldc + j`.
///
/// # Safety
/// `c` is valid for writes of `rows` rows of `ldc` floats, `cols ≤ ldc`, and
/// nothing else accesses columns `0..cols` of those rows meanwhile.
pub(super) unsafe fn gemm(a: &[f32], rows: usize, b: &[f32], cols: usize, k: usize, c: *mut f32, ldc: usize) {
    assert!(a.len() >= packed_rows_len(rows, k) && b.len() >= packed_cols_len(cols, k));
    assert!(cols <= ldc);
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU supports AVX-512 F (checked above); as below.
        return unsafe { gemm_avx512(a, rows, b, cols, k, c, ldc) };
    }
    #[cfg(target_arch = "x86_64")]
    if super::quant::has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above); the caller
        // vouches for `c`, and the panels' lengths were checked.
        return unsafe { gemm_avx2(a, rows, b, cols, k, c, ldc) };
    }
    for (i, ap) in a.chunks_exact(MR * k).take(rows.div_ceil(MR)).enumerate() {
        for (j, bp) in b.chunks_exact(NR * k).take(cols.div_ceil(NR)).enumerate() {
            let mut acc = [[0f32; NR]; MR];
            for p in 0..k {
                for (r, acc) in acc.iter_mut().enumerate() {
                    for (cc, acc) in acc.iter_mut().enumerate() {
                        *acc = ap[p * MR + r].mul_add(bp[p * NR + cc], *acc);
                    }
                }
            }
            // SAFETY: as the caller vouches.
            unsafe { store(&acc, i, j, rows, cols, c, ldc) };
        }
    }
}

/// The block `acc` of row panel `i` and column panel `j` into `c`, the rows
/// and columns that exist.
///
/// # Safety
/// As [`gemm`]'s.
#[inline(always)]
unsafe fn store(
    acc: &[[f32; NR]; MR],
    i: usize,
    j: usize,
    rows: usize,
    cols: usize,
    c: *mut f32,
    ldc: usize,
) {
    let nr = NR.min(cols - j * NR);
    for (r, acc) in acc.iter().enumerate().take(MR.min(rows - i * MR)) {
        // SAFETY: row i·MR + r < rows and columns j·NR.. j·NR + nr ≤ cols.
        unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), c.add((i * MR + r) * ldc + j * NR), nr) };
    }
}

/// [`gemm`] in AVX2: the `MR × NR` block in twelve registers, one column
/// panel's step loaded as two registers and each row's value broadcast.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gemm_avx2(a: &[f32], rows: usize, b: &[f32], cols: usize, k: usize, c: *mut f32, ldc: usize) {
    use std::arch::x86_64::*;
    for i in 0..rows.div_ceil(MR) {
        let ap = a[i * MR * k..(i + 1) * MR * k].as_ptr();
        for j in 0..cols.div_ceil(NR) {
            let bp = b[j * NR * k..(j + 1) * NR * k].as_ptr();
            let mut acc = [[_mm256_setzero_ps(); 2]; MR];
            for p in 0..k {
                // SAFETY: p < k, within both panels (their lengths were checked).
                let (b0, b1) =
                    unsafe { (_mm256_loadu_ps(bp.add(p * NR)), _mm256_loadu_ps(bp.add(p * NR + 8))) };
                for (r, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: as above.
                    let x = _mm256_broadcast_ss(unsafe { &*ap.add(p * MR + r) });
                    acc[0] = _mm256_fmadd_ps(x, b0, acc[0]);
                    acc[1] = _mm256_fmadd_ps(x, b1, acc[1]);
                }
            }
            let mut out = [[0f32; NR]; MR];
            for (o, acc) in out.iter_mut().zip(&acc) {
                // SAFETY: each row of `out` holds NR = 16 floats.
                unsafe {
                    _mm256_storeu_ps(o.as_mut_ptr(), acc[0]);
                    _mm256_storeu_ps(o.as_mut_ptr().add(8), acc[1]);
                }
            }
            // SAFETY: as the caller vouches.
            unsafe { store(&out, i, j, rows, cols, c, ldc) };
        }
    }
}

/// Whether the CPU has AVX-512 F (and FMA): the GEMM then takes two column
/// panels a pass.
#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("fma")
}

/// [`gemm`] in AVX-512: a panel's 16 columns are one register, so a pass
/// keeps the `MR × NR` blocks of two column panels in twelve registers and
/// does twice the AVX2 kernel's work per broadcast row value. Each output
/// is still one running sum over `k` by fused multiply-adds, in order: the
/// AVX2 kernel's bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn gemm_avx512(a: &[f32], rows: usize, b: &[f32], cols: usize, k: usize, c: *mut f32, ldc: usize) {
    use std::arch::x86_64::*;
    let panels = cols.div_ceil(NR);
    for i in 0..rows.div_ceil(MR) {
        let ap = a[i * MR * k..(i + 1) * MR * k].as_ptr();
        let mut j = 0;
        while j < panels {
            // Two panels where two remain, else the last one alone.
            let two = j + 1 < panels;
            let bp0 = b[j * NR * k..(j + 1) * NR * k].as_ptr();
            let bp1 = if two { b[(j + 1) * NR * k..(j + 2) * NR * k].as_ptr() } else { bp0 };
            let mut acc = [[_mm512_setzero_ps(); 2]; MR];
            for p in 0..k {
                // SAFETY: p < k, within the panels (their lengths were checked).
                let (b0, b1) =
                    unsafe { (_mm512_loadu_ps(bp0.add(p * NR)), _mm512_loadu_ps(bp1.add(p * NR))) };
                for (r, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: as above.
                    let x = _mm512_set1_ps(unsafe { *ap.add(p * MR + r) });
                    acc[0] = _mm512_fmadd_ps(x, b0, acc[0]);
                    if two {
                        acc[1] = _mm512_fmadd_ps(x, b1, acc[1]);
                    }
                }
            }
            let width = if two { 2 } else { 1 };
            for h in 0..width {
                let mut out = [[0f32; NR]; MR];
                for (o, acc) in out.iter_mut().zip(&acc) {
                    // SAFETY: each row of `out` holds NR = 16 floats.
                    unsafe { _mm512_storeu_ps(o.as_mut_ptr(), acc[h]) };
                }
                // SAFETY: as the caller vouches.
                unsafe { store(&out, i, j + h, rows, cols, c, ldc) };
            }
            j += width;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 - 1001.0) / 997.0).collect()
    }

    /// Every row and column, at sizes that leave partial panels on both
    /// sides, against a plain sum in f64; and the same bits whether the
    /// rows come alone or in a batch (one running sum per output), and in
    /// the AVX2 and the baseline builds.
    #[test]
    fn packed_products_match_a_plain_sum_and_do_not_depend_on_the_batch() {
        for (rows, cols, k) in [(1, 1, 1), (5, 17, 9), (13, 40, 64), (6, 16, 33)] {
            let (x, w) = (values(rows * k, 1), values(cols * k, 2));
            let mut a = vec![f32::NAN; packed_rows_len(rows, k)];
            for (i, panel) in a.chunks_exact_mut(MR * k).enumerate() {
                pack_rows(&x, rows, k, i, panel);
            }
            let mut b = vec![f32::NAN; packed_cols_len(cols, k)];
            let mut rows_scratch = vec![0f32; NR * k];
            pack_cols(
                cols,
                k,
                &mut rows_scratch,
                |c, out| out.copy_from_slice(&w[c * k..(c + 1) * k]),
                &mut b,
            );
            let ldc = cols + 3;
            let mut c = vec![f32::NAN; rows * ldc];
            unsafe { gemm(&a, rows, &b, cols, k, c.as_mut_ptr(), ldc) };
            for r in 0..rows {
                for j in 0..cols {
                    let want: f64 = (0..k).map(|p| x[r * k + p] as f64 * w[j * k + p] as f64).sum();
                    let got = c[r * ldc + j] as f64;
                    assert!(
                        (got - want).abs() < 1e-5 * k as f64,
                        "{rows}x{cols}x{k} [{r}][{j}]: {got} vs {want}"
                    );
                }
                assert!(
                    c[r * ldc + cols..(r + 1) * ldc].iter().all(|v| v.is_nan()),
                    "wrote past the columns"
                );
            }
            // Row r alone gives the bits it gave in the batch.
            for r in 0..rows {
                let mut one = vec![0f32; packed_rows_len(1, k)];
                pack_rows(&x[r * k..(r + 1) * k], 1, k, 0, &mut one);
                let mut out = vec![0f32; cols];
                unsafe { gemm(&one, 1, &b, cols, k, out.as_mut_ptr(), cols) };
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&out), bits(&c[r * ldc..r * ldc + cols]), "row {r} alone");
            }
            // The baseline build's running sums, by the same fused multiply-adds.
            for r in 0..rows {
                for j in 0..cols {
                    let mut s = 0f32;
                    for p in 0..k {
                        s = x[r * k + p].mul_add(w[j * k + p], s);
                    }
                    assert_eq!(s.to_bits(), c[r * ldc + j].to_bits(), "[{r}][{j}] is not one running sum");
                }
            }
        }
    }
}
