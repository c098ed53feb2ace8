//! Attention over one slice of a context: a query head's scores against at
//! most [`ATTN_CHUNK`] tokens, their softmax and the weighted sum of their
//! values, folded into the running state of that row and head.
//!
//! A row's context is cut into slices at fixed positions whose states merge
//! in order, whichever thread computes a slice, so the result does not depend
//! on the split (`CpuBackend::attention`). Within a slice the work is laid
//! out for eight-lane registers: a score is one dot product in two lane
//! accumulators reduced by a fixed tree (the AVX2 build takes four tokens at
//! a time, one q load for four K rows, and reduces the four together, lane
//! for lane the same); the slice's exponentials are taken eight at a time by
//! a polynomial ([`exp_lane`]) and summed in eight lanes; the output keeps
//! eight of its values in a register over all the slice's tokens. The AVX2
//! build and the baseline build perform the same operations in the same
//! order (fused multiply-adds in both), so they give the same bits. The
//! query heads of a KV head go over a slice together ([`attend_group`]), and
//! a prompt's rows in blocks, so a slice's K and V rows are found once and
//! read from cache by every row and head that needs them.
//!
//! K and V are read as the cache stores them ([`KvValue`]: f32, or f16
//! widened eight at a time by F16C); the arithmetic is f32 either way.

/// Tokens of one slice of a context.
pub(super) const ATTN_CHUNK: usize = 32;

/// A value as the KV cache stores it: f32, or f16 (half the bytes a token,
/// so twice the tokens in the same memory and half the bytes a decode step
/// reads).
pub trait KvValue: Copy + Default + Send + Sync + 'static {
    /// Whether the values are f16 (the AVX2 kernel widens eight at once).
    const F16: bool;
    /// `v` as stored: f16 rounds to nearest, and saturates at ±65504 where
    /// f16 would overflow to infinity.
    fn of(v: f32) -> Self;
    /// The stored value, exactly, in f32.
    fn get(self) -> f32;
}

impl KvValue for f32 {
    const F16: bool = false;
    #[inline(always)]
    fn of(v: f32) -> f32 {
        v
    }
    #[inline(always)]
    fn get(self) -> f32 {
        self
    }
}

impl KvValue for half::f16 {
    const F16: bool = true;
    #[inline(always)]
    fn of(v: f32) -> half::f16 {
        half::f16::from_f32(v.clamp(-65504.0, 65504.0))
    }
    #[inline(always)]
    fn get(self) -> f32 {
        self.to_f32()
    }
}

/// Eight stored values from `p`, widened to f32.
///
/// # Safety
/// `p` points at eight readable values; the CPU has AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load8<T: KvValue>(p: *const T) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    if T::F16 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    } else {
        _mm256_loadu_ps(p as *const f32)
    }
}

/// `src` as f32 into `dst` (the same length): exact, so a kernel given the
/// widened values computes what it computes widening them itself.
pub(super) fn widen<T: KvValue>(src: &[T], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if T::F16 && super::quant::has_avx2() {
        // SAFETY: the CPU has AVX2 and F16C (checked above); the lengths match.
        unsafe { widen_avx2(src, dst) };
        return;
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.get();
    }
}

/// [`widen`] eight values at a time.
///
/// # Safety
/// The CPU has AVX2 and F16C; `src` and `dst` have the same length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_avx2<T: KvValue>(src: &[T], dst: &mut [f32]) {
    let whole = src.len() / 8 * 8;
    for i in (0..whole).step_by(8) {
        // SAFETY: i + 8 ≤ whole ≤ the length of both.
        unsafe { std::arch::x86_64::_mm256_storeu_ps(dst.as_mut_ptr().add(i), load8(src.as_ptr().add(i))) };
    }
    for i in whole..src.len() {
        dst[i] = src[i].get();
    }
}

/// A softmax over some tokens of one row and head: the running maximum `m`,
/// the sum `l` of exp(score - m), and the output `o` weighted by them.
pub(super) struct AttnState {
    pub(super) m: f32,
    pub(super) l: f32,
    pub(super) o: Vec<f32>,
}

impl AttnState {
    pub(super) fn new(hd: usize) -> AttnState {
        AttnState { m: f32::NEG_INFINITY, l: 0.0, o: vec![0.0; hd] }
    }

    /// Back to the state `new` makes: no tokens yet.
    pub(super) fn reset(&mut self) {
        (self.m, self.l) = (f32::NEG_INFINITY, 0.0);
        self.o.fill(0.0);
    }

    /// Fold in the state of the next slice of tokens.
    #[inline(always)]
    pub(super) fn merge(&mut self, m: f32, l: f32, o: &[f32]) {
        if l == 0.0 {
            return;
        }
        if self.l == 0.0 {
            (self.m, self.l) = (m, l);
            self.o.copy_from_slice(o);
            return;
        }
        let mx = self.m.max(m);
        let (a, b) = ((self.m - mx).exp(), (m - mx).exp());
        self.l = self.l * a + l * b;
        for (x, y) in self.o.iter_mut().zip(o) {
            *x = *x * a + y * b;
        }
        self.m = mx;
    }

    pub(super) fn finish(&self, out: &mut [f32]) {
        let inv = if self.l > 0.0 { 1.0 / self.l } else { 0.0 };
        for (o, x) in out.iter_mut().zip(&self.o) {
            *o = x * inv;
        }
    }
}

/// The query heads of one row that share a KV head (`qs`: head after head,
/// one per state) over a slice of at most [`ATTN_CHUNK`] tokens (their K and
/// V rows of that KV head, `keys[t]` and `values[t]`), scores scaled by
/// `scale`, head `j`'s softmax state folded into `states[j]`; `buf` holds at
/// least a head's floats. The heads run one after another over the same K
/// and V rows, which stay in cache; each head's result is what it would be
/// alone.
pub(super) fn attend_group<T: KvValue>(
    qs: &[f32],
    keys: &[&[T]],
    values: &[&[T]],
    scale: f32,
    buf: &mut [f32],
    states: &mut [AttnState],
) {
    assert!(!keys.is_empty() && keys.len() <= ATTN_CHUNK && keys.len() == values.len());
    assert!(!states.is_empty() && qs.len().is_multiple_of(states.len()));
    let hd = qs.len() / states.len();
    assert!(keys.iter().chain(values).all(|r| r.len() == hd) && buf.len() >= hd);
    for (q, state) in qs.chunks_exact(hd).zip(states) {
        let slice = Slice { q, keys, values, scale };
        #[cfg(target_arch = "x86_64")]
        if super::quant::has_avx2() {
            // SAFETY: the CPU supports AVX2, FMA and F16C (checked above);
            // the lengths the kernel reads were checked.
            unsafe { attend_slice_avx2(&slice, buf, state) };
            continue;
        }
        attend_slice_portable(&slice, buf, state);
    }
}

/// One query head's row and a slice's K and V rows of its KV head.
#[derive(Clone, Copy)]
struct Slice<'a, T> {
    q: &'a [f32],
    keys: &'a [&'a [T]],
    values: &'a [&'a [T]],
    scale: f32,
}

/// exp(x) for x ≤ 0 (a score less the slice's maximum), as eight lanes
/// compute it: x clamped to -87 (below, the result is under 2⁻¹²⁵ and a
/// softmax weight of nothing), x = n·ln 2 + r with |r| ≤ ln 2 / 2, e^r by its
/// Taylor polynomial to degree 7 (within a few ulps), scaled by 2ⁿ
/// through the exponent bits.
#[inline(always)]
pub(super) fn exp_lane(x: f32) -> f32 {
    let x = x.max(EXP_MIN);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = p.mul_add(r, *c);
    }
    p * f32::from_bits((((n as i32) + 127) as u32) << 23)
}

const EXP_MIN: f32 = -87.0;
/// ln 2 in two parts, the first exact in few bits, so that n·LN2_HI is exact.
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// 1/7!, 1/6!, ..., 1/1!, 1/0!: Horner's order.
const EXP_POLY: [f32; 8] = [1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];

/// The lanes' sum by a fixed tree: lane i and i + 4, then those 0 and 2, 1
/// and 3, then the two.
#[inline(always)]
fn reduce_lanes(s: [f32; 8]) -> f32 {
    let a = [s[0] + s[4], s[1] + s[5], s[2] + s[6], s[3] + s[7]];
    (a[0] + a[2]) + (a[1] + a[3])
}

/// The output's values past the last whole eight (`full..`), by the same
/// fused multiply-adds in both builds.
#[inline(always)]
fn output_tail<T: KvValue>(values: &[&[T]], p: &[f32], full: usize, o: &mut [f32]) {
    for (e, o) in o.iter_mut().enumerate().skip(full) {
        let mut acc = 0f32;
        for (v, p) in values.iter().zip(p) {
            acc = p.mul_add(v[e].get(), acc);
        }
        *o = acc;
    }
}

/// One head of [`attend_group`] in the baseline build: the AVX2 kernel's lanes as arrays.
fn attend_slice_portable<T: KvValue>(slice: &Slice<'_, T>, buf: &mut [f32], state: &mut AttnState) {
    let Slice { q, keys, values, scale } = *slice;
    let hd = q.len();
    let (full, wide) = (hd / 8 * 8, hd / 16 * 16);
    let mut scores = [0f32; ATTN_CHUNK];
    let mut m = f32::NEG_INFINITY;
    for (k, sc) in keys.iter().zip(scores.iter_mut()) {
        let (mut acc0, mut acc1) = ([0f32; 8], [0f32; 8]);
        for e in (0..wide).step_by(16) {
            for l in 0..8 {
                acc0[l] = q[e + l].mul_add(k[e + l].get(), acc0[l]);
                acc1[l] = q[e + 8 + l].mul_add(k[e + 8 + l].get(), acc1[l]);
            }
        }
        if full > wide {
            for l in 0..8 {
                acc0[l] = q[wide + l].mul_add(k[wide + l].get(), acc0[l]);
            }
        }
        let mut s = reduce_lanes(std::array::from_fn(|l| acc0[l] + acc1[l]));
        for e in full..hd {
            s = q[e].mul_add(k[e].get(), s);
        }
        *sc = s * scale;
        m = m.max(*sc);
    }
    let n = keys.len();
    for sc in &mut scores[..n] {
        *sc = exp_lane(*sc - m);
    }
    // The weights' sum in eight lanes (weight c in lane c % 8), reduced by
    // the fixed tree.
    let mut lanes = [0f32; 8];
    for (c, p) in scores[..n].iter().enumerate() {
        lanes[c % 8] += p;
    }
    let l = reduce_lanes(lanes);
    let o = &mut buf[..hd];
    for e in (0..full).step_by(8) {
        let mut acc = [0f32; 8];
        for (v, p) in values.iter().zip(&scores[..n]) {
            for (l, acc) in acc.iter_mut().enumerate() {
                *acc = p.mul_add(v[e + l].get(), *acc);
            }
        }
        o[e..e + 8].copy_from_slice(&acc);
    }
    output_tail(values, &scores[..n], full, o);
    state.merge(m, l, o);
}

/// [`reduce_lanes`] of a register: lane i + lane i + 4, then (a0 + a2,
/// a1 + a3), then their sum.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn reduce_lanes_avx2(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)))
}

/// One head of [`attend_group`] in AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_slice_avx2<T: KvValue>(slice: &Slice<'_, T>, buf: &mut [f32], state: &mut AttnState) {
    use std::arch::x86_64::*;
    let Slice { q, keys, values, scale } = *slice;
    let hd = q.len();
    let (full, wide) = (hd / 8 * 8, hd / 16 * 16);
    let qp = q.as_ptr();
    let mut scores = [0f32; ATTN_CHUNK];
    let mut m = f32::NEG_INFINITY;
    // SAFETY (every load and store below): offsets stay below hd, the length
    // of q, of every key and value row (checked by the caller), and of o.
    //
    // Four tokens at a time where the head has no values past its last
    // eight: each q load serves four K rows (one load per multiply-add, where
    // a token alone took two), and the four sums are reduced together by the
    // same tree as one token's below, lane for lane, so the same bits.
    let mut t = 0;
    if full == hd {
        while t + 4 <= keys.len() {
            let kp: [*const T; 4] = std::array::from_fn(|j| keys[t + j].as_ptr());
            let (mut acc0, mut acc1) = ([_mm256_setzero_ps(); 4], [_mm256_setzero_ps(); 4]);
            let mut e = 0;
            while e < wide {
                unsafe {
                    let (qa, qb) = (_mm256_loadu_ps(qp.add(e)), _mm256_loadu_ps(qp.add(e + 8)));
                    for j in 0..4 {
                        acc0[j] = _mm256_fmadd_ps(qa, load8(kp[j].add(e)), acc0[j]);
                        acc1[j] = _mm256_fmadd_ps(qb, load8(kp[j].add(e + 8)), acc1[j]);
                    }
                }
                e += 16;
            }
            if full > wide {
                let qa = unsafe { _mm256_loadu_ps(qp.add(wide)) };
                for j in 0..4 {
                    acc0[j] = unsafe { _mm256_fmadd_ps(qa, load8(kp[j].add(wide)), acc0[j]) };
                }
            }
            let s: [__m256; 4] = std::array::from_fn(|j| _mm256_add_ps(acc0[j], acc1[j]));
            // Lane i + lane i + 4 of each token (tokens 0 and 1 in one
            // register, 2 and 3 in another) ...
            let a01 = _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(s[0], s[1]),
                _mm256_permute2f128_ps::<0x31>(s[0], s[1]),
            );
            let a23 = _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(s[2], s[3]),
                _mm256_permute2f128_ps::<0x31>(s[2], s[3]),
            );
            // ... then (a0 + a2, a1 + a3) of each, then their sum: tokens
            // 0 and 2 in the low half, 1 and 3 in the high one.
            let b = _mm256_add_ps(_mm256_shuffle_ps::<0x44>(a01, a23), _mm256_shuffle_ps::<0xEE>(a01, a23));
            let h = _mm256_hadd_ps(b, b);
            let four = _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
            // SAFETY: t + 4 ≤ keys.len() ≤ ATTN_CHUNK, within `scores`.
            unsafe { _mm_storeu_ps(scores.as_mut_ptr().add(t), _mm_mul_ps(four, _mm_set1_ps(scale))) };
            t += 4;
        }
    }
    for (k, sc) in keys.iter().zip(scores.iter_mut()).skip(t) {
        let kp = k.as_ptr();
        let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut e = 0;
        while e < wide {
            unsafe {
                acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(e)), load8(kp.add(e)), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(e + 8)), load8(kp.add(e + 8)), acc1);
            }
            e += 16;
        }
        if full > wide {
            unsafe { acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(wide)), load8(kp.add(wide)), acc0) };
        }
        let s8 = _mm256_add_ps(acc0, acc1);
        let mut s = reduce_lanes_avx2(s8);
        for e in full..hd {
            s = q[e].mul_add(k[e].get(), s);
        }
        *sc = s * scale;
    }
    let n = keys.len();
    for sc in &scores[..n] {
        m = m.max(*sc);
    }
    // The exponentials eight at a time (the lanes past n are never read).
    let (mx, lo) = (_mm256_set1_ps(m), _mm256_set1_ps(EXP_MIN));
    let mut c = 0;
    while c < n {
        let p = scores.as_mut_ptr().wrapping_add(c);
        // SAFETY: c + 8 ≤ ATTN_CHUNK, within `scores`.
        unsafe {
            let x = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(p), mx), lo);
            let t = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
                x,
                _mm256_set1_ps(std::f32::consts::LOG2_E),
            ));
            let neg = _mm256_xor_ps(t, _mm256_set1_ps(-0.0));
            let r = _mm256_fmadd_ps(neg, _mm256_set1_ps(LN2_HI), x);
            let r = _mm256_fmadd_ps(neg, _mm256_set1_ps(LN2_LO), r);
            let mut poly = _mm256_set1_ps(EXP_POLY[0]);
            for c in &EXP_POLY[1..] {
                poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(*c));
            }
            let two_n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(t),
                _mm256_set1_epi32(127),
            )));
            _mm256_storeu_ps(p, _mm256_mul_ps(poly, two_n));
        }
        c += 8;
    }
    // The weights' sum in eight lanes, the lanes past n adding nothing (+0,
    // which leaves a sum of weights as it was), reduced by the same tree as
    // a score; one dependent add per eight weights, not per weight.
    let mut lanes = _mm256_setzero_ps();
    let mut c = 0;
    while c < n {
        // SAFETY: c + 8 ≤ ATTN_CHUNK, within `scores`.
        let p = unsafe { _mm256_loadu_ps(scores.as_ptr().add(c)) };
        let live =
            _mm256_cmpgt_epi32(_mm256_set1_epi32((n - c) as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        lanes = _mm256_add_ps(lanes, _mm256_and_ps(p, _mm256_castsi256_ps(live)));
        c += 8;
    }
    let l = reduce_lanes_avx2(lanes);
    let o = &mut buf[..hd];
    // Up to eight registers of the output at once, so that each token's
    // multiply-adds into them are independent (one register over all the
    // tokens waited on its own previous sum at every token).
    macro_rules! output_block {
        ($e:expr, $w:literal) => {{
            let e = $e;
            let mut acc = [_mm256_setzero_ps(); $w];
            for (v, p) in values.iter().zip(&scores[..n]) {
                let p = _mm256_set1_ps(*p);
                for (j, acc) in acc.iter_mut().enumerate() {
                    unsafe { *acc = _mm256_fmadd_ps(p, load8(v.as_ptr().add(e + 8 * j)), *acc) };
                }
            }
            for (j, acc) in acc.iter().enumerate() {
                unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(e + 8 * j), *acc) };
            }
            e + 8 * $w
        }};
    }
    let mut e = 0;
    while e + 64 <= full {
        e = output_block!(e, 8);
    }
    if e + 32 <= full {
        e = output_block!(e, 4);
    }
    if e + 16 <= full {
        e = output_block!(e, 2);
    }
    if e < full {
        e = output_block!(e, 1);
        debug_assert_eq!(e, full);
    }
    output_tail(values, &scores[..n], full, o);
    state.merge(m, l, o);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, hd: usize, seed: u32) -> Vec<Vec<f32>> {
        (0..n)
            .map(|t| {
                (0..hd)
                    .map(|e| {
                        let x =
                            ((t * hd + e) as u32).wrapping_mul(2_654_435_761).wrapping_add(seed * 97) >> 8;
                        (x % 2000) as f32 / 500.0 - 2.0
                    })
                    .collect()
            })
            .collect()
    }

    /// The polynomial exponential against the library's, over the range a
    /// softmax uses, and zero-ish below the clamp.
    #[test]
    fn the_lane_exponential_is_within_a_few_ulps() {
        let mut x = 0f32;
        while x > -87.0 {
            let (got, want) = (exp_lane(x), (x as f64).exp());
            let rel = ((got as f64 - want) / want).abs();
            assert!(rel < 3e-7, "exp({x}) = {got}, want {want} (relative {rel:e})");
            x -= 0.0137;
        }
        assert_eq!(exp_lane(0.0), 1.0);
        assert!(exp_lane(-1e30) < 1e-37 && exp_lane(-1e30) > 0.0);
    }

    /// Both builds give the same bits, for head sizes with and without an
    /// odd eight and a tail, and agree with a plain softmax in f64 over the
    /// values as stored: K and V in f32 and in f16.
    #[test]
    fn a_slice_gives_the_same_bits_in_both_builds_and_a_plain_softmax() {
        slices_agree::<f32>();
        slices_agree::<half::f16>();
    }

    /// f16 K and V read back as the values they store, not as zeros or
    /// neighbours: the f16 slice against the f32 one over the same (f16-exact)
    /// values gives the same bits.
    #[test]
    fn f16_k_and_v_give_the_bits_of_the_same_values_in_f32() {
        for hd in [64, 72, 13] {
            let round = |r: Vec<Vec<f32>>| -> Vec<Vec<f32>> {
                r.into_iter()
                    .map(|r| r.into_iter().map(|x| half::f16::from_f32(x).to_f32()).collect())
                    .collect()
            };
            let (k, v, q) = (round(rows(ATTN_CHUNK, hd, 7)), round(rows(ATTN_CHUNK, hd, 8)), rows(1, hd, 9));
            let halves = |r: &[Vec<f32>]| -> Vec<Vec<half::f16>> {
                r.iter().map(|r| r.iter().map(|&x| half::f16::from_f32(x)).collect()).collect()
            };
            let (kh, vh) = (halves(&k), halves(&v));
            let scale = 1.0 / (hd as f32).sqrt();
            let mut buf = vec![0f32; hd];
            let keys: Vec<&[f32]> = k.iter().map(|r| &r[..]).collect();
            let values: Vec<&[f32]> = v.iter().map(|r| &r[..]).collect();
            let (mut a, mut b) = (AttnState::new(hd), AttnState::new(hd));
            attend_group(&q[0], &keys, &values, scale, &mut buf, std::slice::from_mut(&mut a));
            let keys: Vec<&[half::f16]> = kh.iter().map(|r| &r[..]).collect();
            let values: Vec<&[half::f16]> = vh.iter().map(|r| &r[..]).collect();
            attend_group(&q[0], &keys, &values, scale, &mut buf, std::slice::from_mut(&mut b));
            assert_eq!(bits(&a), bits(&b), "hd {hd}");
        }
    }

    /// A state's bits: its maximum, its sum and its output.
    fn bits(s: &AttnState) -> Vec<u32> {
        let mut b = vec![s.m.to_bits(), s.l.to_bits()];
        b.extend(s.o.iter().map(|x| x.to_bits()));
        b
    }

    fn slices_agree<T: KvValue>() {
        let stored = |r: Vec<Vec<f32>>| -> Vec<Vec<T>> {
            r.into_iter().map(|r| r.into_iter().map(T::of).collect()).collect()
        };
        for hd in [64, 72, 80, 128, 13] {
            let (k, v, q) =
                (stored(rows(ATTN_CHUNK, hd, 4)), stored(rows(ATTN_CHUNK, hd, 5)), rows(1, hd, 6));
            for n in [1, 7, 9, ATTN_CHUNK] {
                let keys: Vec<&[T]> = k[..n].iter().map(|r| &r[..]).collect();
                let values: Vec<&[T]> = v[..n].iter().map(|r| &r[..]).collect();
                let scale = 1.0 / (hd as f32).sqrt();
                let mut buf = vec![0f32; hd];
                let mut plain = AttnState::new(hd);
                let slice = Slice { q: &q[0], keys: &keys, values: &values, scale };
                attend_slice_portable(&slice, &mut buf, &mut plain);
                let s: Vec<f64> = (0..n)
                    .map(|t| {
                        q[0].iter().zip(&k[t]).map(|(a, b)| *a as f64 * b.get() as f64).sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = s.iter().map(|x| (x - mx).exp()).sum();
                let mut out = vec![0f32; hd];
                plain.finish(&mut out);
                for e in 0..hd {
                    let want: f64 = (0..n).map(|t| (s[t] - mx).exp() / sum * v[t][e].get() as f64).sum();
                    assert!(
                        (out[e] as f64 - want).abs() < 1e-5,
                        "f16 {}, hd {hd}, {n} tokens, [{e}]: {} vs {want}",
                        T::F16,
                        out[e]
                    );
                }
                #[cfg(target_arch = "x86_64")]
                if crate::cpu::quant::has_avx2() {
                    let mut fast = AttnState::new(hd);
                    // SAFETY: the CPU supports AVX2, FMA and F16C (checked above).
                    unsafe { attend_slice_avx2(&slice, &mut buf, &mut fast) };
                    assert_eq!(bits(&plain), bits(&fast), "f16 {}, hd {hd}, {n} tokens", T::F16);
                }
            }
        }
    }
}
