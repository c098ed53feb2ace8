//! On-device self-check and micro-benchmarks, run by `examples/cuda_check.rs`
//! on a GPU machine (never in CI, which has no GPU).
//!
//! Every op runs on the CUDA backend and on the CPU backend with the same
//! random inputs (never all zeros) and the results are compared with a stated
//! tolerance, relative to the largest reference magnitude:
//! - `EXACT` (1e-4) where both sides compute in f32 from the same bf16 weights
//!   (norms, RoPE, SiLU, adds, gathers, the GEMV, the embedding);
//! - `BF16` (2e-2) where the device rounds an f32 operand to bf16 on purpose:
//!   the cuBLASLt path (activations to bf16), f16 weights (widened to bf16) and
//!   attention (the KV cache is bf16 on the device, f32 on the CPU). One bf16
//!   rounding is a relative error of at most 2^-9 ≈ 2e-3 per element; 2e-2 is
//!   ten times that, while a wrong index or a missing term is an O(1) error;
//! - `EXACT` too where the device quantizes a matmul's input to 8 bits per 32
//!   (the integer GEMVs of block formats at 1..8 rows): the CPU reference then
//!   takes its own 8-bit decode (`DecodeActivations::Q8`), which quantizes
//!   bit for bit alike (`q8_quantize` is `Q8Row::quantize`'s arithmetic) and
//!   multiplies codes exactly, so only the f32 scaling and summation order
//!   differ, as for the f32 GEMVs;
//! - `SCAN` (1e-3) for the gated delta rule and the states it leaves: both
//!   sides are f32, but each token's result feeds the next through the state,
//!   so different summation orders compound over a few hundred tokens (the
//!   chunked form of the rule sums in yet another order: by chunks of 16).

use super::device::{cuda_err, Purpose, Stream};
use super::kernels::mmvq_index;
use super::matmul::{GEMV_MAX_ROWS, Q8_GEMV_MAX_ROWS};
use super::{CudaAct, CudaBackend, CudaKv, CudaWeight, DeltaPrefill, PrefillPath};
use crate::cpu::{CpuAct, CpuBackend, CpuWeight, MatmulInput};
use crate::dtype::{DType, HostTensor, TensorBytes};
use crate::{
    ActShape, Backend, DeltaGeometry, DeltaRule, GraphKey, KvGeometry, MatmulPart, QkNorm, ResidualNorm,
    Result, RopeAttention, RopeStyle, RopeTable, SeqStep, StepPlan, VHeadOrder,
};
use corridor_units::{PageId, Pages, StateSlot, TokenId, Tokens};
use cudarc::driver::{result as cu, sys};
use half::{bf16, f16};
use std::time::Instant;

const EXACT: f32 = 1e-4;
/// Block-format experts at decode (the routed integer GEMVs): both sides
/// quantize the rows and then the SiLU products to 8 bits, but the products
/// come out of sums in other orders, so now and then one lands on the other
/// side of a rounding boundary and moves a whole code (1/127 of its block's
/// largest) in one of an expert's ffn terms: about 3e-4 of the largest
/// output for one such code; ten times that.
const Q8_CHAIN: f32 = 3e-3;
const BF16: f32 = 2e-2;
const SCAN: f32 = 1e-3;

/// What the check found: one line per comparison, and how many failed.
#[derive(Debug, Default)]
pub struct CheckReport {
    pub lines: Vec<String>,
    pub failures: usize,
}

impl CheckReport {
    /// Count a comparison that could not run as a failure, naming its error.
    fn refused(&mut self, name: &str, r: Result<()>) {
        if let Err(e) = r {
            self.failures += 1;
            self.lines.push(format!("FAIL {name}: {e}"));
        }
    }

    fn compare(&mut self, name: &str, got: &[f32], want: &[f32], tol: f32) {
        let scale = want.iter().fold(0f32, |a, v| a.max(v.abs())).max(1e-6);
        let mut err = if got.len() == want.len() { 0f32 } else { f32::INFINITY };
        for (g, w) in got.iter().zip(want) {
            let e = (g - w).abs();
            err = if e.is_nan() { f32::INFINITY } else { err.max(e) };
        }
        let ok = err <= tol * scale;
        if !ok {
            self.failures += 1;
        }
        self.lines.push(format!(
            "{} {name}: max error {:.2e} of max |ref| {:.2e} (rel {:.2e}, tol {:.0e})",
            if ok { "PASS" } else { "FAIL" },
            err,
            scale,
            err / scale,
            tol
        ));
    }
}

/// xorshift64*: deterministic, dependency-free inputs.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545f4914f6cdd1d)
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
}

fn tensor(name: &str, dtype: DType, shape: &[usize], bytes: Vec<u8>) -> HostTensor {
    HostTensor { name: name.into(), dtype, shape: shape.to_vec(), data: TensorBytes::from_vec(bytes) }
}

fn float_tensor(name: &str, dtype: DType, rows: usize, cols: usize, vals: &[f32]) -> HostTensor {
    let bytes: Vec<u8> = match dtype {
        DType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => vals.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect(),
        _ => vals.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect(),
    };
    let shape: Vec<usize> = if rows == 1 { vec![cols] } else { vec![rows, cols] };
    tensor(name, dtype, &shape, bytes)
}

/// Byte offsets of the f16 scale fields of the block formats after Q4_1.
fn f16_fields(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
        _ => &[0],
    }
}

/// Random ggml blocks with sane scales (random bytes would make inf/NaN scales).
fn quant_tensor(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> HostTensor {
    if !matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1) {
        // Every other block format: random quant and sub-scale bytes (all
        // codes and sub-scales occur), f16 fields set to small scales.
        let (bb, be) = (dtype.block_bytes(), dtype.block_elems());
        let mut b = Vec::new();
        for _ in 0..rows * cols / be {
            let mut blk: Vec<u8> = (0..bb).map(|_| (rng.next() >> 56) as u8).collect();
            for &at in f16_fields(dtype) {
                let v = f16::from_f32(0.001 + 0.004 * rng.f().abs());
                blk[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
            b.extend(blk);
        }
        return tensor("q", dtype, &[rows, cols], b);
    }
    let mut b = Vec::new();
    for _ in 0..rows * cols / 32 {
        let d = f16::from_f32(0.01 + 0.02 * rng.f().abs());
        b.extend_from_slice(&d.to_le_bytes());
        match dtype {
            DType::Q8_0 => b.extend((0..32).map(|_| (rng.next() >> 56) as u8)),
            DType::Q4_0 => b.extend((0..16).map(|_| (rng.next() >> 56) as u8)),
            _ => {
                b.extend_from_slice(&f16::from_f32(-0.1 * rng.f().abs()).to_le_bytes());
                b.extend((0..16).map(|_| (rng.next() >> 56) as u8));
            }
        }
    }
    tensor("q", dtype, &[rows, cols], b)
}

fn put_gpu(be: &CudaBackend, act: &CudaAct, data: &[f32]) -> Result<()> {
    be.ctx.bind()?;
    be.upload(act.ptr(), data)?;
    be.synchronize()
}

/// Fill the first rows of `act` with `data` (for checks outside this crate:
/// the engine's device-sampling check uploads logits rows with it).
pub fn put_rows(be: &CudaBackend, act: &CudaAct, data: &[f32]) -> Result<()> {
    if data.len() > act.rows() * act.cols() {
        return Err(crate::BackendError::Other(format!(
            "{} values for a [{}, {}] activation",
            data.len(),
            act.rows(),
            act.cols()
        )));
    }
    put_gpu(be, act, data)
}

/// `sample_rows` where the answer needs no sampler to check: greedy rows
/// (the first largest value after sanitizing and the edits, the NaN and +inf
/// counts) and rows with nothing finite. The draws themselves are compared
/// with the engine's host sampler by the engine's `device_sampling_check`
/// example.
fn sample_checks(be: &CudaBackend, rep: &mut CheckReport, rng: &mut Rng) -> Result<()> {
    for slices in [false, true] {
        be.set_sample_slices(Some(slices));
        let checked = sample_greedy_checks(be, rep, rng, slices);
        be.set_sample_slices(None);
        checked?;
    }
    sample_draws_alike(be, rep, rng)
}

/// Every kind of draw gives the same summaries with the rows scanned in
/// slices first as with one block a row.
fn sample_draws_alike(be: &CudaBackend, rep: &mut CheckReport, rng: &mut Rng) -> Result<()> {
    use crate::sample::{LogitEdit, SampleRowSpec, SampledRows, EDIT_BIAS};
    let (rows, vocab) = (8usize, 151_669usize);
    let data = rng.vec(rows * vocab, 6.0);
    let edits: Vec<LogitEdit> = (0..64u32)
        .map(|i| LogitEdit {
            token: i * 2_371 % vocab as u32,
            rep: 1.1,
            sub: 0.0,
            bias: 0.5,
            flags: EDIT_BIAS,
        })
        .collect();
    let shapes =
        [(0.2f32, 0u32, 0.9f32, 0.05f32), (1.0, 0, 1.0, 0.0), (1.0, 40, 1.0, 0.0), (0.7, 0, 0.95, 0.0)];
    for (temperature, top_k, top_p, min_p) in shapes {
        let specs: Vec<SampleRowSpec> = (0..rows as u32)
            .map(|r| SampleRowSpec {
                edits_len: if r % 2 == 0 { edits.len() as u32 } else { 0 },
                ..draw_spec(r, (temperature, top_k, top_p, min_p), (r as f64 + 0.37) / rows as f64)
            })
            .collect();
        let mut got = Vec::new();
        for slices in [false, true] {
            be.set_sample_slices(Some(slices));
            let mut act = be.alloc_act(ActShape { rows, cols: vocab })?;
            put_gpu(be, &act, &data)?;
            let mut out = SampledRows::default();
            let r = be.sample_rows(&mut act, &specs, &edits, &mut out);
            be.set_sample_slices(None);
            r?;
            got.push(
                out.rows
                    .iter()
                    .flat_map(|r| [r.token, r.argmax, r.value_bits, r.status])
                    .collect::<Vec<u32>>(),
            );
        }
        rep.compare(
            &format!("sample_rows slices = one block a row (t {temperature}, top-k {top_k}, top-p {top_p}, min-p {min_p})"),
            &[f32::from(got[0] == got[1])],
            &[1.0],
            EXACT,
        );
    }
    Ok(())
}

/// A spec drawing row `row` with (temperature, top-k, top-p, min-p) and the
/// uniform `uniform`, no edits.
fn draw_spec(
    row: u32,
    (temperature, top_k, top_p, min_p): (f32, u32, f32, f32),
    uniform: f64,
) -> crate::sample::SampleRowSpec {
    crate::sample::SampleRowSpec {
        row,
        top_k,
        temperature,
        inv_t: 1.0 / temperature,
        top_p,
        min_p,
        uniform,
        ..Default::default()
    }
}

/// [`sample_checks`]' greedy rows, the sampler's slices on or off.
fn sample_greedy_checks(be: &CudaBackend, rep: &mut CheckReport, rng: &mut Rng, slices: bool) -> Result<()> {
    use crate::sample::{LogitEdit, SampleRowSpec, SampledRows, EDIT_BIAS, EDIT_MASK, NO_TOKEN};
    for vocab in [37usize, 4099, 8192, 128_256] {
        let rows = 6;
        let mut data = rng.vec(rows * vocab, 8.0);
        // Row 1: NaN and +inf; row 2: nothing finite; row 3: a tie for the
        // largest value (the first must win, and the two sit in different
        // slices); row 4: edits move the argmax; row 5: a tie within one
        // slice's first and last token.
        data[vocab + 3] = f32::NAN;
        data[vocab + vocab / 2] = f32::INFINITY;
        data[2 * vocab..3 * vocab].fill(f32::NEG_INFINITY);
        data[3 * vocab + vocab - 1] = 50.0;
        data[3 * vocab + vocab / 3] = 50.0;
        data[5 * vocab + vocab.min(4096) - 1] = 70.0;
        data[5 * vocab] = 70.0;
        data[4 * vocab + 5] = 60.0;
        let edits = vec![
            LogitEdit { token: 5, rep: 1.0, sub: 0.0, bias: 0.0, flags: EDIT_MASK },
            LogitEdit { token: (vocab - 2) as u32, rep: 1.0, sub: 0.0, bias: 100.0, flags: EDIT_BIAS },
            LogitEdit { token: 7, rep: 2.0, sub: 1.5, bias: 0.0, flags: 0 },
        ];
        let specs: Vec<SampleRowSpec> = (0..rows as u32)
            .map(|r| SampleRowSpec { row: r, edits_len: if r == 4 { 3 } else { 0 }, ..Default::default() })
            .collect();
        let mut act = be.alloc_act(ActShape { rows, cols: vocab })?;
        put_gpu(be, &act, &data)?;
        let mut out = SampledRows::default();
        be.sample_rows(&mut act, &specs, &edits, &mut out)?;
        let mut after = Vec::new();
        be.read_rows(&act, rows, &mut after);
        be.check()?;
        // The host's view of each row: sanitized, edited, first largest.
        let mut ok = out.rows.len() == rows;
        for (r, got) in out.rows.iter().enumerate() {
            let mut row: Vec<f32> = data[r * vocab..(r + 1) * vocab].to_vec();
            let (mut nan, mut inf) = (0, 0);
            for v in row.iter_mut() {
                if v.is_nan() {
                    nan += 1;
                    *v = f32::NEG_INFINITY;
                } else if *v == f32::INFINITY {
                    inf += 1;
                    *v = f32::MAX;
                }
            }
            if r == 4 {
                row[5] = f32::NEG_INFINITY;
                row[vocab - 2] += 100.0;
                row[7] = if row[7] > 0.0 { row[7] / 2.0 } else { row[7] * 2.0 } - 1.5;
            }
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let want = if max == f32::NEG_INFINITY {
                NO_TOKEN
            } else {
                row.iter().position(|&v| v == max).unwrap() as u32
            };
            let drawn = if want == NO_TOKEN || nan + inf > 0 { NO_TOKEN } else { want };
            ok &= got.argmax == want && got.token == drawn && got.nan == nan && got.pos_inf == inf;
            ok &= after[r * vocab..(r + 1) * vocab].iter().zip(&row).all(|(a, b)| a.to_bits() == b.to_bits());
        }
        rep.compare(
            &format!("sample_rows greedy, sanitize and edits, vocab {vocab}, slices {slices}"),
            &[f32::from(ok)],
            &[1.0],
            EXACT,
        );
    }
    Ok(())
}

fn put_cpu(act: &mut CpuAct, data: &[f32]) {
    act.live_mut(data.len() / act.cols()).copy_from_slice(data);
}

/// The same activation on both backends.
struct Pair {
    g: CudaAct,
    c: CpuAct,
}

fn pair(be: &CudaBackend, cpu: &CpuBackend, rows: usize, cols: usize, data: Option<&[f32]>) -> Result<Pair> {
    let shape = ActShape { rows, cols };
    let g = be.alloc_act(shape)?;
    let mut c = cpu.alloc_act(shape)?;
    if let Some(d) = data {
        put_gpu(be, &g, d)?;
        put_cpu(&mut c, d);
    }
    Ok(Pair { g, c })
}

fn read_both(be: &CudaBackend, cpu: &CpuBackend, p: &Pair, rows: usize) -> Result<(Vec<f32>, Vec<f32>)> {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    be.read_rows(&p.g, rows, &mut a);
    be.check()?;
    cpu.read_rows(&p.c, rows, &mut b);
    Ok((a, b))
}

/// The CPU references of a matmul: f32 activations (`f32`, the GPU's f32
/// GEMVs; its bf16 paths against it at `BF16`) and 8-bit ones (`q8`, the
/// GPU's integer GEMVs), the same weights serving both.
struct References {
    f32: CpuBackend,
    q8: CpuBackend,
}

impl References {
    fn new() -> Self {
        References {
            f32: CpuBackend::with_decode_activations(crate::cpu::DecodeActivations::F32),
            q8: CpuBackend::with_decode_activations(crate::cpu::DecodeActivations::Q8),
        }
    }
    /// The reference of a matmul whose input the device takes as `input`, and the tolerance.
    fn of(&self, input: MatmulInput) -> (&CpuBackend, f32) {
        match input {
            MatmulInput::F32 => (&self.f32, EXACT),
            MatmulInput::Bf16 => (&self.f32, BF16),
            MatmulInput::Q8 => (&self.q8, EXACT),
        }
    }
}

/// Run every op on both backends and compare.
/// The device sampler's checks alone (`cuda_check --sample-checks`).
pub fn sample_only(be: &CudaBackend) -> Result<CheckReport> {
    let mut rep = CheckReport::default();
    sample_checks(be, &mut rep, &mut Rng(0x9e3779b97f4a7c15))?;
    Ok(rep)
}

pub fn run_all(be: &CudaBackend) -> Result<CheckReport> {
    // Decode in f32 on the CPU too where the GPU's GEMVs keep activations in
    // f32; in 8 bits where its integer GEMVs take them so (`References`).
    let refs = References::new();
    let cpu = refs.f32.clone();
    let mut rep = CheckReport::default();
    let mut rng = Rng(0x9e3779b97f4a7c15);

    // Matmuls: every storage type, GEMV and cuBLASLt row counts, odd widths.
    for &(dtype, n, k) in &[
        (DType::BF16, 96, 64),
        (DType::BF16, 40, 68),
        (DType::F16, 96, 64),
        (DType::F32, 48, 64),
        (DType::Q8_0, 80, 96),
        (DType::Q4_0, 80, 96),
        (DType::Q4_1, 80, 96),
        // Long rows (more than one pass of the GEMV's unrolled loop, a partial
        // last pass) and row counts that leave the last block half empty.
        (DType::BF16, 37, 4104),
        (DType::BF16, 37, 4128),
        (DType::Q8_0, 51, 4128),
        (DType::Q4_0, 51, 4128),
        (DType::Q4_1, 51, 4128),
        // The formats of gemv_bq_body: short rows, and long ones (more than one
        // pass of the warp over its row) with a half-empty last block.
        (DType::Q5_0, 80, 96),
        (DType::Q5_1, 80, 96),
        (DType::IQ4_NL, 80, 96),
        (DType::Q5_0, 51, 4128),
        (DType::Q5_1, 51, 4128),
        (DType::IQ4_NL, 51, 4128),
        (DType::Q2_K, 37, 512),
        (DType::Q3_K, 37, 512),
        (DType::Q4_K, 37, 512),
        (DType::Q5_K, 37, 512),
        (DType::Q6_K, 37, 512),
        (DType::IQ4_XS, 37, 512),
        (DType::Q2_K, 51, 9216),
        (DType::Q3_K, 51, 9216),
        (DType::Q4_K, 51, 9216),
        (DType::Q5_K, 51, 9216),
        (DType::Q6_K, 51, 9216),
        (DType::IQ4_XS, 51, 9216),
        // The integer GEMVs' steps of 1024 weights: a second, partial step
        // (1280: 5 super-blocks, 40 blocks of 32) and a warp's second step
        // (4352: 5 steps, 4 warps). Rows of 4128 and 96 put the 32-weight
        // formats' rows at every 2-byte alignment, rows of 1280 Q6_K's.
        (DType::Q8_0, 37, 1280),
        (DType::Q4_0, 37, 1280),
        (DType::Q4_1, 37, 1280),
        (DType::Q5_0, 37, 1280),
        (DType::Q5_1, 37, 1280),
        (DType::IQ4_NL, 37, 1280),
        (DType::Q2_K, 37, 1280),
        (DType::Q3_K, 37, 1280),
        (DType::Q4_K, 37, 1280),
        (DType::Q5_K, 37, 1280),
        (DType::Q6_K, 37, 1280),
        (DType::IQ4_XS, 37, 1280),
        (DType::Q8_0, 19, 4352),
        (DType::Q4_K, 19, 4352),
        (DType::Q6_K, 19, 4352),
        (DType::IQ4_XS, 19, 4352),
    ] {
        let t = if dtype.is_quantized() {
            quant_tensor(&mut rng, dtype, n, k)
        } else {
            float_tensor("w", dtype, n, k, &rng.vec(n * k, 0.5))
        };
        let (wg, wc) = (be.upload_weight(&t)?, cpu.upload_weight(&t)?);
        let bias = float_tensor("b", DType::F32, 1, n, &rng.vec(n, 0.5));
        let (bg, bc) = (be.upload_weight(&bias)?, cpu.upload_weight(&bias)?);
        // 1, 2, 3 (4-row kernel), 5 (8-row kernel), 8: every GEMV instantiation;
        // block formats also mmq in groups of 32 and 64 rows, two groups (97, 128 rows) and
        // past them (129 rows: widening).
        let many: &[usize] = if dtype.is_quantized() { &[17, 64, 97, 128, 129] } else { &[] };
        for &rows in [1usize, 2, 3, 5, 8, 9, 40].iter().chain(many) {
            let x = pair(be, &cpu, rows, k, Some(&rng.vec(rows * k, 1.0)))?;
            let mut out = pair(be, &cpu, rows, n, None)?;
            let with_bias = rows == 3 || rows == 40;
            be.matmul(&x.g, &wg, with_bias.then_some(&bg), rows, &mut out.g);
            let input = be.rounds_input(&wg, rows);
            let (reference, tol) = refs.of(input);
            reference.matmul(&x.c, &wc, with_bias.then_some(&bc), rows, &mut out.c);
            let (a, b) = read_both(be, reference, &out, rows)?;
            // f16 weights become bf16 on the device.
            let tol = if dtype == DType::F16 || dtype == DType::F32 { BF16 } else { tol };
            let bias = if with_bias { " + bias" } else { "" };
            rep.compare(&format!("matmul {dtype} {rows}x{k} · {n}x{k}{bias} ({input:?} input)"), &a, &b, tol);
            if input == MatmulInput::Q8 {
                // The integer GEMV with 3 and 32 groups of weight rows a block
                // (a partial last block, every group in one block).
                for groups in [3usize, 32] {
                    let mut o = pair(be, &cpu, rows, n, None)?;
                    be.set_mmvq_groups(groups);
                    be.matmul(&x.g, &wg, with_bias.then_some(&bg), rows, &mut o.g);
                    be.set_mmvq_groups(0);
                    reference.matmul(&x.c, &wc, with_bias.then_some(&bc), rows, &mut o.c);
                    let (a, b) = read_both(be, reference, &o, rows)?;
                    rep.compare(
                        &format!("matmul {dtype} {rows}x{k} · {n}x{k}{bias} ({groups} groups a block)"),
                        &a,
                        &b,
                        tol,
                    );
                }
                // One row on the pipelined kernel (kernels/mmvq.cu `mv_pipe_loop`):
                // the same bits as on registers, and the CPU's within its tolerance.
                if rows == 1 {
                    let mut reg = pair(be, &cpu, rows, n, None)?;
                    let mut piped = pair(be, &cpu, rows, n, None)?;
                    for (o, pipe) in [(&mut reg, false), (&mut piped, true)] {
                        be.set_mmvq_pipe(Some(pipe));
                        be.matmul(&x.g, &wg, with_bias.then_some(&bg), rows, &mut o.g);
                    }
                    be.set_mmvq_pipe(None);
                    reference.matmul(&x.c, &wc, with_bias.then_some(&bc), rows, &mut piped.c);
                    let (a, b) = read_both(be, reference, &piped, rows)?;
                    rep.compare(&format!("matmul {dtype} 1x{k} · {n}x{k}{bias} (pipelined)"), &a, &b, tol);
                    let r = read_both(be, reference, &reg, rows)?.0;
                    rep.compare(
                        &format!("matmul {dtype} 1x{k} · {n}x{k}{bias}: pipelined = registers"),
                        &a,
                        &r,
                        EXACT,
                    );
                }
                // What `--cuda-q8-gemv off` takes for these rows: mmq, or the f32 GEMV.
                let mut off = pair(be, &cpu, rows, n, None)?;
                let via_mmq = be.takes_mmq(&wg, rows);
                be.op("check", |st| {
                    if via_mmq {
                        be.mmq(st, &x.g, &wg, rows, &off.g)
                    } else {
                        be.gemv(&x.g, &wg, rows, &off.g)
                    }
                });
                let (name, tol) = if via_mmq { ("mmq", BF16) } else { ("gemv", EXACT) };
                cpu.matmul(&x.c, &wc, None, rows, &mut off.c);
                let (a, b) = read_both(be, &cpu, &off, rows)?;
                rep.compare(
                    &format!("matmul {dtype} {rows}x{k} · {n}x{k} without the integer GEMV ({name})"),
                    &a,
                    &b,
                    tol,
                );
            }
        }
    }

    // Each pass with the one-row integer GEMVs on registers, then pipelined.
    for pipe in [false, true] {
        let from = rep.lines.len();
        be.set_mmvq_pipe(Some(pipe));
        let mut pass = || -> Result<()> {
            for groups in [0usize, 3] {
                be.set_mmvq_groups(groups);
                let r = fused_matmul_checks(be, &refs, &mut rep, &mut rng, groups);
                be.set_mmvq_groups(0);
                r?;
            }
            q8_input_checks(be, &refs, &mut rep, &mut rng)
        };
        let r = pass();
        be.set_mmvq_pipe(None);
        for line in &mut rep.lines[from..] {
            line.push_str(if pipe { " [one-row GEMVs pipelined]" } else { " [one-row GEMVs on registers]" });
        }
        r?;
    }
    bf16_input_checks(be, &cpu, &mut rep, &mut rng)?;
    stacked_checks(be, &refs, &mut rep, &mut rng)?;
    fold_checks(be, &cpu, &mut rep, &mut rng)?;

    // Embedding from bf16, Q8_0 and K-quant tables (the lookup dequantizes rows).
    for dtype in [DType::BF16, DType::Q8_0, DType::Q4_K, DType::Q6_K, DType::IQ4_XS, DType::Q5_0] {
        let (vocab, cols) = (50, 256);
        let t = if dtype.is_quantized() {
            quant_tensor(&mut rng, dtype, vocab, cols)
        } else {
            float_tensor("e", dtype, vocab, cols, &rng.vec(vocab * cols, 1.0))
        };
        let (tg, tc) = (be.upload_weight(&t)?, cpu.upload_weight(&t)?);
        let ids: Vec<u32> = (0..7).map(|i| (i * 13 + 5) % vocab as u32).collect();
        let mut out = pair(be, &cpu, 8, cols, None)?;
        be.embedding(&tg, &ids, &mut out.g)?;
        cpu.embedding(&tc, &ids, &mut out.c)?;
        let (a, b) = read_both(be, &cpu, &out, ids.len())?;
        rep.compare(&format!("embedding {dtype}"), &a, &b, EXACT);
        rep.compare(
            "embedding rejects an id outside the vocabulary",
            &[f32::from(be.embedding(&tg, &[vocab as u32], &mut out.g).is_err())],
            &[1.0],
            EXACT,
        );
    }

    // Norms, RoPE, SiLU, adds, gathers.
    let (rows, hd, heads) = (5usize, 32usize, 4usize);
    let cols = hd * heads;
    let xs = rng.vec(rows * cols, 2.0);
    let x = pair(be, &cpu, rows, cols, Some(&xs))?;
    let w = float_tensor("n", DType::BF16, 1, cols, &rng.vec(cols, 1.0));
    let (wg, wc) = (be.upload_weight(&w)?, cpu.upload_weight(&w)?);
    let mut out = pair(be, &cpu, rows, cols, None)?;
    be.rms_norm(&x.g, &wg, 1e-5, rows, &mut out.g);
    cpu.rms_norm(&x.c, &wc, 1e-5, rows, &mut out.c);
    let (a, b) = read_both(be, &cpu, &out, rows)?;
    rep.compare("rms_norm", &a, &b, EXACT);
    let ys = rng.vec(rows * cols, 1.0);
    let (mut xa, ya) = (pair(be, &cpu, rows, cols, Some(&xs))?, pair(be, &cpu, rows, cols, Some(&ys))?);
    let mut na = pair(be, &cpu, rows, cols, None)?;
    be.add_rms_norm(&mut xa.g, &ya.g, &wg, 1e-5, rows - 1, &mut na.g);
    cpu.add_rms_norm(&mut xa.c, &ya.c, &wc, 1e-5, rows - 1, &mut na.c);
    let (a, b) = read_both(be, &cpu, &na, rows)?;
    rep.compare("add_rms_norm: the norm", &a, &b, EXACT);
    let (a, b) = read_both(be, &cpu, &xa, rows)?;
    rep.compare("add_rms_norm: the residual (last row untouched)", &a, &b, EXACT);
    let hw = float_tensor("h", DType::BF16, 1, hd, &rng.vec(hd, 1.0));
    let (hg, hc) = (be.upload_weight(&hw)?, cpu.upload_weight(&hw)?);
    let mut y = pair(be, &cpu, rows, cols, Some(&xs))?;
    be.head_rms_norm(&mut y.g, &hg, 1e-6, hd, rows);
    cpu.head_rms_norm(&mut y.c, &hc, 1e-6, hd, rows);
    let (a, b) = read_both(be, &cpu, &y, rows)?;
    rep.compare("head_rms_norm", &a, &b, EXACT);
    for style in [RopeStyle::Half, RopeStyle::Interleaved] {
        let table = RopeTable {
            style,
            rot_dim: hd,
            inv_freq: (0..hd / 2).map(|i| 500000f32.powf(-((2 * i) as f32) / hd as f32)).collect(),
        };
        let positions: Vec<u32> = vec![0, 1, 17, 4095, 70000];
        let mut y = pair(be, &cpu, rows, cols, Some(&xs))?;
        be.rope(&mut y.g, &table, hd, &positions);
        cpu.rope(&mut y.c, &table, hd, &positions);
        let (a, b) = read_both(be, &cpu, &y, rows)?;
        rep.compare(&format!("rope {style:?}"), &a, &b, EXACT);
    }
    let up = pair(be, &cpu, rows, cols, Some(&rng.vec(rows * cols, 3.0)))?;
    let mut o = pair(be, &cpu, rows, cols, None)?;
    be.silu_mul(&x.g, &up.g, rows, &mut o.g);
    cpu.silu_mul(&x.c, &up.c, rows, &mut o.c);
    let (a, b) = read_both(be, &cpu, &o, rows)?;
    rep.compare("silu_mul", &a, &b, EXACT);
    be.add_assign(&mut o.g, &up.g, rows - 1);
    cpu.add_assign(&mut o.c, &up.c, rows - 1);
    let (a, b) = read_both(be, &cpu, &o, rows)?;
    rep.compare("add_assign (last row untouched)", &a, &b, EXACT);
    let mut gth = pair(be, &cpu, 3, cols, None)?;
    be.gather_rows(&x.g, &[4, 0, 2], &mut gth.g);
    cpu.gather_rows(&x.c, &[4, 0, 2], &mut gth.c);
    let (a, b) = read_both(be, &cpu, &gth, 3)?;
    rep.compare("gather_rows", &a, &b, EXACT);

    attention_checks(be, &cpu, &mut rep, &mut rng)?;
    delta_checks(be, &cpu, &mut rep, &mut rng)?;
    sample_checks(be, &mut rep, &mut rng)?;
    Ok(rep)
}

/// The fused launches of a decode layer against the CPU's separate ops: q/k/v
/// in one GEMV launch (with and without biases) and gate/up/SiLU in one, at
/// the row counts that take them (1, 2) and one that falls back (3); and the
/// same ops over block formats (a Q4_K_M layer's Q4_K and Q6_K), whose
/// integer GEMVs share one 8-bit copy of the input.
/// The bf16 inputs that norms and the SiLU product store for the matmuls
/// after them (`State::xbf_holds`): the matmul that reads one gives the same
/// bits as a matmul of a fresh copy of its input (which converts), and any
/// op that writes the input after, or a matmul whose output it is, makes the
/// next matmul convert again (a stale copy would give the old product).
/// After a norm stored its copy of its output `normed` (bf16 or 8-bit), an
/// op that writes `normed` again must make the next matmul of it read the
/// new rows: an add into it, and a matmul whose output it is (`square`,
/// `k x k`), each followed by a matmul with `w` against `reference` (the
/// CPU as the GPU rounds that matmul's input, within `tol`).
struct Stale<'a> {
    cpu: &'a CpuBackend,
    x: &'a Pair,
    z: &'a Pair,
    norm: (&'a CudaWeight, &'a CpuWeight),
    w: (&'a CudaWeight, &'a CpuWeight),
    square: (&'a CudaWeight, &'a CpuWeight),
    rows: usize,
}

impl Stale<'_> {
    fn checks(
        &self,
        be: &CudaBackend,
        (reference, tol): (&CpuBackend, f32),
        normed: &mut Pair,
        y: &mut Pair,
        what: &str,
        rep: &mut CheckReport,
    ) -> Result<()> {
        let (rows, x, z, cpu) = (self.rows, self.x, self.z, self.cpu);
        for add in [true, false] {
            be.rms_norm(&x.g, self.norm.0, 1e-5, rows, &mut normed.g);
            cpu.rms_norm(&x.c, self.norm.1, 1e-5, rows, &mut normed.c);
            if add {
                be.add_assign(&mut normed.g, &z.g, rows);
                cpu.add_assign(&mut normed.c, &z.c, rows);
            } else {
                be.matmul(&z.g, self.square.0, None, rows, &mut normed.g);
                reference.matmul(&z.c, self.square.1, None, rows, &mut normed.c);
            }
            be.matmul(&normed.g, self.w.0, None, rows, &mut y.g);
            reference.matmul(&normed.c, self.w.1, None, rows, &mut y.c);
            let (a, b) = read_both(be, reference, y, rows)?;
            let after = if add { "an add to its input" } else { "a matmul that overwrote the norm's output" };
            rep.compare(&format!("{what} after {after} (the stored copy is stale)"), &a, &b, tol);
        }
        Ok(())
    }
}

fn bf16_input_checks(be: &CudaBackend, cpu: &CpuBackend, rep: &mut CheckReport, rng: &mut Rng) -> Result<()> {
    // 16 rows: past the GEMVs, so every matmul here takes a bf16 input.
    let (rows, k, n) = (16usize, 256usize, 192usize);
    let w = float_tensor("w", DType::BF16, n, k, &rng.vec(n * k, 0.5));
    let sq = float_tensor("s", DType::BF16, k, k, &rng.vec(k * k, 0.5));
    let nw = float_tensor("n", DType::BF16, 1, k, &rng.vec(k, 1.0));
    let [(wg, wc), (sg, sc), (ng, nc)] =
        [&w, &sq, &nw].map(|t| (be.upload_weight(t).expect("upload"), cpu.upload_weight(t).expect("upload")));
    let x = pair(be, cpu, rows, k, Some(&rng.vec(rows * k, 2.0)))?;
    let mut normed = pair(be, cpu, rows, k, None)?;
    let mut y = pair(be, cpu, rows, n, None)?;
    let mut fresh = pair(be, cpu, rows, n, None)?;
    // The norm's copy against a fresh conversion of the same values.
    be.rms_norm(&x.g, &ng, 1e-5, rows, &mut normed.g);
    cpu.rms_norm(&x.c, &nc, 1e-5, rows, &mut normed.c);
    // `made` was just written by `op`: the matmul that reads its stored copy
    // against one of a fresh copy of its rows (which converts), and the CPU.
    let stored_copy_checks =
        |made: &Pair, y: &mut Pair, fresh: &mut Pair, op: &str, rep: &mut CheckReport| {
            be.matmul(&made.g, &wg, None, rows, &mut y.g);
            let mut vals = Vec::new();
            be.read_rows(&made.g, rows, &mut vals);
            be.check()?;
            let copy = pair(be, cpu, rows, k, Some(&vals))?;
            be.matmul(&copy.g, &wg, None, rows, &mut fresh.g);
            let (a, b) = (read_both(be, cpu, y, rows)?.0, read_both(be, cpu, fresh, rows)?.0);
            rep.compare(
                &format!("matmul after {op}: its bf16 input as a conversion of the same rows gives"),
                &a,
                &b,
                EXACT,
            );
            cpu.matmul(&made.c, &wc, None, rows, &mut y.c);
            let (a, b) = read_both(be, cpu, y, rows)?;
            rep.compare(&format!("matmul after {op} (bf16 input stored by it)"), &a, &b, BF16);
            Ok::<(), crate::BackendError>(())
        };
    stored_copy_checks(&normed, &mut y, &mut fresh, "rms_norm", rep)?;
    let z = pair(be, cpu, rows, k, Some(&rng.vec(rows * k, 3.0)))?;
    let stale = Stale { cpu, x: &x, z: &z, norm: (&ng, &nc), w: (&wg, &wc), square: (&sg, &sc), rows };
    stale.checks(be, (cpu, BF16), &mut normed, &mut y, "matmul", rep)?;
    // The SiLU product's copy, read by the next matmul.
    let g = pair(be, cpu, rows, k, Some(&rng.vec(rows * k, 2.0)))?;
    let u = pair(be, cpu, rows, k, Some(&rng.vec(rows * k, 2.0)))?;
    let mut act = pair(be, cpu, rows, k, None)?;
    be.silu_mul(&g.g, &u.g, rows, &mut act.g);
    cpu.silu_mul(&g.c, &u.c, rows, &mut act.c);
    stored_copy_checks(&act, &mut y, &mut fresh, "silu_mul", rep)?;
    Ok(())
}

/// The 8-bit inputs that norms store for the integer GEMVs after them
/// (`State::xq_holds`): the GEMV that reads one gives the same bits as one
/// of a fresh copy of its input (which quantizes), at every row count that
/// takes the integer GEMV; and an op that writes the input after, or a
/// matmul whose output it is, makes the next GEMV quantize again. The same
/// for the gate/up GEMV's SiLU product read by the down projection.
fn q8_input_checks(be: &CudaBackend, refs: &References, rep: &mut CheckReport, rng: &mut Rng) -> Result<()> {
    let cpu = &refs.f32;
    let (reference, tol) = refs.of(MatmulInput::Q8);
    // Q4_K rows of 1280 (five super-blocks), a gate/up of 256 columns (eight
    // blocks of 32 for the product's quantization, two blocks of the launch).
    let (k, n, ff) = (1280usize, 96usize, 256usize);
    let w = quant_tensor(rng, DType::Q4_K, n, k);
    let sq = quant_tensor(rng, DType::Q4_K, k, k);
    let gate = quant_tensor(rng, DType::Q4_K, ff, k);
    let up = quant_tensor(rng, DType::Q4_K, ff, k);
    let down = quant_tensor(rng, DType::Q4_K, n, ff);
    let nw = float_tensor("n", DType::F32, 1, k, &rng.vec(k, 1.0));
    let [(wg, wc), (sg, sc), (gg, gc), (ug, uc), (dg, dc), (ng, nc)] = [&w, &sq, &gate, &up, &down, &nw]
        .map(|t| (be.upload_weight(t).expect("upload"), cpu.upload_weight(t).expect("upload")));
    for rows in 1..=Q8_GEMV_MAX_ROWS {
        let x = pair(be, cpu, rows, k, Some(&rng.vec(rows * k, 2.0)))?;
        let res = rng.vec(rows * k, 1.0);
        let mut normed = pair(be, cpu, rows, k, None)?;
        let mut y = pair(be, cpu, rows, n, None)?;
        let mut fresh = pair(be, cpu, rows, n, None)?;
        // `made` was just written by `op`, `w` reads it: the GEMV of its
        // stored 8-bit copy against one of a fresh copy of its rows, and the CPU's.
        let mut stored_copy =
            |made: &Pair, w: (&CudaWeight, &CpuWeight), y: &mut Pair, op: &str| -> Result<()> {
                be.matmul(&made.g, w.0, None, rows, &mut y.g);
                let mut vals = Vec::new();
                be.read_rows(&made.g, rows, &mut vals);
                be.check()?;
                let copy = pair(be, cpu, rows, made.g.cols, Some(&vals))?;
                be.matmul(&copy.g, w.0, None, rows, &mut fresh.g);
                let (a, b) = (read_both(be, cpu, y, rows)?.0, read_both(be, cpu, &fresh, rows)?.0);
                rep.compare(
                    &format!(
                    "{rows}-row GEMV after {op}: its 8-bit input as a quantization of the same rows gives"
                ),
                    &a,
                    &b,
                    EXACT,
                );
                reference.matmul(&made.c, w.1, None, rows, &mut y.c);
                let (a, b) = read_both(be, reference, y, rows)?;
                rep.compare(&format!("{rows}-row GEMV after {op} (8-bit input stored by it)"), &a, &b, tol);
                Ok(())
            };
        be.rms_norm(&x.g, &ng, 1e-5, rows, &mut normed.g);
        cpu.rms_norm(&x.c, &nc, 1e-5, rows, &mut normed.c);
        stored_copy(&normed, (&wg, &wc), &mut y, "rms_norm")?;
        let mut xr = pair(be, cpu, rows, k, Some(&res))?;
        be.add_rms_norm(&mut xr.g, &x.g, &ng, 1e-5, rows, &mut normed.g);
        cpu.add_rms_norm(&mut xr.c, &x.c, &nc, 1e-5, rows, &mut normed.c);
        stored_copy(&normed, (&wg, &wc), &mut y, "add_rms_norm")?;
        // The SiLU product of the gate/up GEMV, read by the down projection.
        let (mut g, mut u, mut act) =
            (pair(be, cpu, rows, ff, None)?, pair(be, cpu, rows, ff, None)?, pair(be, cpu, rows, ff, None)?);
        be.gate_up_silu(&normed.g, &gg, &ug, rows, &mut g.g, &mut u.g, &mut act.g);
        reference.gate_up_silu(&normed.c, &gc, &uc, rows, &mut g.c, &mut u.c, &mut act.c);
        stored_copy(&act, (&dg, &dc), &mut y, "gate_up_silu")?;
        let z = pair(be, cpu, rows, k, Some(&rng.vec(rows * k, 3.0)))?;
        let stale = Stale { cpu, x: &x, z: &z, norm: (&ng, &nc), w: (&wg, &wc), square: (&sg, &sc), rows };
        stale.checks(be, (reference, tol), &mut normed, &mut y, &format!("{rows}-row GEMV"), rep)?;
    }
    Ok(())
}

/// The residual add + RMSNorm folded into the one-row GEMVs around it
/// (`fold.rs`) against the CPU's separate ops, with blocks of four weight
/// rows (a 4096 hidden size) and of two (256): o_proj's producer then q/k/v
/// with biases as its consumer, down's producer then gate/up/SiLU, a
/// producer whose norm a plain read settles, and one whose norm a plain
/// one-row matmul (a MoE router) takes; each time the products, the
/// norm and the residual. The fold must be what ran: pending after the
/// producer, taken by the consumer with no settle, settled once by the read.
fn fold_checks(be: &CudaBackend, cpu: &CpuBackend, rep: &mut CheckReport, rng: &mut Rng) -> Result<()> {
    use std::sync::atomic::Ordering::Relaxed;
    // Only models without block-format weights fold (their GEMVs take the norm's 8-bit copy).
    let had_q8 = be.q8_weights.swap(false, Relaxed);
    be.set_fold_norm(Some(true));
    let r = (|| -> Result<()> {
        for &(h, k_in, nq, nkv, ff) in
            &[(4096usize, 4096usize, 4096usize, 1024usize, 1024usize), (256, 128, 256, 64, 512)]
        {
            let mut mk = |n: usize, k: usize, scale: f32| -> Result<(CudaWeight, CpuWeight)> {
                let t = float_tensor("w", DType::BF16, n, k, &rng.vec(n * k, scale));
                Ok((be.upload_weight(&t)?, cpu.upload_weight(&t)?))
            };
            let o = mk(h, k_in, 0.05)?;
            let down = mk(h, ff, 0.05)?;
            let (q, kw, v) = (mk(nq, h, 0.05)?, mk(nkv, h, 0.05)?, mk(nkv, h, 0.05)?);
            let (gate, up) = (mk(ff, h, 0.05)?, mk(ff, h, 0.05)?);
            let mut vector = |n: usize| -> Result<(CudaWeight, CpuWeight)> {
                let t = float_tensor("v", DType::F32, 1, n, &rng.vec(n, 1.0));
                Ok((be.upload_weight(&t)?, cpu.upload_weight(&t)?))
            };
            let (norm, bq, bk, bv) = (vector(h)?, vector(nq)?, vector(nkv)?, vector(nkv)?);
            let x = pair(be, cpu, 1, h, Some(&rng.vec(h, 2.0)))?;
            let mut x = x;
            let mut proj = pair(be, cpu, 1, h, None)?;
            let mut normed = pair(be, cpu, 1, h, None)?;
            let shape = format!("hidden {h}");
            // The producer on both backends; on the GPU it must leave the norm pending.
            let mut produce = |input: &Pair,
                               w: &(CudaWeight, CpuWeight),
                               x: &mut Pair,
                               normed: &mut Pair,
                               what: &str,
                               rep: &mut CheckReport|
             -> Result<u64> {
                let n = ResidualNorm { x: &mut x.g, weight: &norm.0, eps: 1e-5, out: &mut normed.g };
                be.matmul_add_rms_norm(&input.g, &w.0, 1, &mut proj.g, n);
                let n = ResidualNorm { x: &mut x.c, weight: &norm.1, eps: 1e-5, out: &mut normed.c };
                cpu.matmul_add_rms_norm(&input.c, &w.1, 1, &mut proj.c, n);
                let (pending, settles) = be.fold_counts();
                rep.compare(
                    &format!("folded norm ({shape}): {what} leaves it pending"),
                    &[f32::from(pending)],
                    &[1.0],
                    0.0,
                );
                Ok(settles)
            };
            // o_proj, then q/k/v with biases.
            let attn = pair(be, cpu, 1, k_in, Some(&rng.vec(k_in, 1.0)))?;
            let settles = produce(&attn, &o, &mut x, &mut normed, "o_proj", rep)?;
            let mut outs =
                [pair(be, cpu, 1, nq, None)?, pair(be, cpu, 1, nkv, None)?, pair(be, cpu, 1, nkv, None)?];
            {
                let [oq, ok, ov] = &mut outs;
                let mut parts = [
                    MatmulPart { w: &q.0, bias: Some(&bq.0), out: &mut oq.g },
                    MatmulPart { w: &kw.0, bias: Some(&bk.0), out: &mut ok.g },
                    MatmulPart { w: &v.0, bias: Some(&bv.0), out: &mut ov.g },
                ];
                be.matmul_many(&normed.g, &mut parts, 1, None);
                let mut parts = [
                    MatmulPart { w: &q.1, bias: Some(&bq.1), out: &mut oq.c },
                    MatmulPart { w: &kw.1, bias: Some(&bk.1), out: &mut ok.c },
                    MatmulPart { w: &v.1, bias: Some(&bv.1), out: &mut ov.c },
                ];
                cpu.matmul_many(&normed.c, &mut parts, 1, None);
            }
            let took = be.fold_counts() == (false, settles);
            rep.compare(&format!("folded norm ({shape}): q/k/v takes it"), &[f32::from(took)], &[1.0], 0.0);
            for (i, out) in outs.iter().enumerate() {
                let (a, b) = read_both(be, cpu, out, 1)?;
                rep.compare(&format!("folded norm ({shape}): q/k/v part {i}"), &a, &b, EXACT);
            }
            for (p, what) in [(&normed, "the norm q/k/v stored"), (&x, "the residual after o_proj")] {
                let (a, b) = read_both(be, cpu, p, 1)?;
                rep.compare(&format!("folded norm ({shape}): {what}"), &a, &b, EXACT);
            }
            // down, then gate/up/SiLU.
            let act = pair(be, cpu, 1, ff, Some(&rng.vec(ff, 1.0)))?;
            let settles = produce(&act, &down, &mut x, &mut normed, "down_proj", rep)?;
            let (mut g, mut u, mut s) =
                (pair(be, cpu, 1, ff, None)?, pair(be, cpu, 1, ff, None)?, pair(be, cpu, 1, ff, None)?);
            be.gate_up_silu(&normed.g, &gate.0, &up.0, 1, &mut g.g, &mut u.g, &mut s.g);
            cpu.gate_up_silu(&normed.c, &gate.1, &up.1, 1, &mut g.c, &mut u.c, &mut s.c);
            let took = be.fold_counts() == (false, settles);
            rep.compare(
                &format!("folded norm ({shape}): gate/up/SiLU takes it"),
                &[f32::from(took)],
                &[1.0],
                0.0,
            );
            for (p, what) in [
                (&s, "the SiLU product"),
                (&normed, "the norm gate/up stored"),
                (&x, "the residual after down_proj"),
            ] {
                let (a, b) = read_both(be, cpu, p, 1)?;
                rep.compare(&format!("folded norm ({shape}): {what}"), &a, &b, EXACT);
            }
            // A producer whose norm is read by something else: settled first.
            let settles = produce(&attn, &o, &mut x, &mut normed, "o_proj", rep)?;
            let (a, b) = read_both(be, cpu, &normed, 1)?;
            rep.compare(&format!("folded norm ({shape}): settled for a plain read"), &a, &b, EXACT);
            let settled = be.fold_counts() == (false, settles + 1);
            rep.compare(&format!("folded norm ({shape}): settled once"), &[f32::from(settled)], &[1.0], 0.0);
            // A plain one-row matmul of the norm (a MoE layer's router) takes it too.
            let settles = produce(&act, &down, &mut x, &mut normed, "down_proj", rep)?;
            let mut r = pair(be, cpu, 1, nkv, None)?;
            be.matmul(&normed.g, &kw.0, None, 1, &mut r.g);
            cpu.matmul(&normed.c, &kw.1, None, 1, &mut r.c);
            let took = be.fold_counts() == (false, settles);
            rep.compare(
                &format!("folded norm ({shape}): a plain matmul takes it"),
                &[f32::from(took)],
                &[1.0],
                0.0,
            );
            for (p, what) in [(&r, "the plain matmul"), (&normed, "the norm the plain matmul stored")] {
                let (a, b) = read_both(be, cpu, p, 1)?;
                rep.compare(&format!("folded norm ({shape}): {what}"), &a, &b, EXACT);
            }
        }
        Ok(())
    })();
    be.set_fold_norm(None);
    be.q8_weights.store(had_q8, Relaxed);
    r
}

/// Three products of one input through `matmul_many` on the GPU, each
/// part against the CPU: weights `wg` / `wc` and, with `with_bias`, biases
/// `bg` / `bc`.
struct Parts<'a> {
    x: &'a Pair,
    wg: &'a [CudaWeight],
    wc: &'a [CpuWeight],
    bg: &'a [CudaWeight],
    bc: &'a [CpuWeight],
    with_bias: bool,
    rows: usize,
}

impl Parts<'_> {
    /// Run them into `outs` (given `scratch`) and compare each part, named
    /// `matmul_many {what} part i ...{suffix}`.
    #[allow(clippy::too_many_arguments)]
    fn check(
        &self,
        be: &CudaBackend,
        refs: &References,
        rep: &mut CheckReport,
        outs: &mut [Pair],
        scratch: Option<&mut CudaAct>,
        what: &str,
        suffix: &str,
    ) -> Result<()> {
        let (wg, rows) = (self.wg, self.rows);
        {
            let [o0, o1, o2] = outs else {
                return Err(crate::BackendError::Other("three outputs".into()));
            };
            let b = |i: usize| self.with_bias.then(|| &self.bg[i]);
            be.matmul_many(
                &self.x.g,
                &mut [
                    MatmulPart { w: &wg[0], bias: b(0), out: &mut o0.g },
                    MatmulPart { w: &wg[1], bias: b(1), out: &mut o1.g },
                    MatmulPart { w: &wg[2], bias: b(2), out: &mut o2.g },
                ],
                rows,
                scratch,
            );
        }
        let k = self.x.c.cols();
        for (i, o) in outs.iter_mut().enumerate() {
            let (reference, tol) = refs.of(be.rounds_input(&wg[i], rows));
            reference.matmul(&self.x.c, &self.wc[i], self.with_bias.then(|| &self.bc[i]), rows, &mut o.c);
            let (a, b) = read_both(be, reference, o, rows)?;
            let bias = if self.with_bias { "" } else { "no " };
            rep.compare(&format!("matmul_many {what} part {i} {rows}x{k} ({bias}bias{suffix})"), &a, &b, tol);
        }
        Ok(())
    }
}

/// q/k/v and gate/up as one GEMM of their weights stacked (uploaded one
/// after another into a weight arena, as a checkpoint's layer is) at rows
/// that take cuBLASLt: each part against the CPU, and the scratch holding the
/// stacked product of row 0 (the stacked launch ran, not the matmuls one by
/// one). Then the same weights uploaded apart, which must fall back.
fn stacked_checks(be: &CudaBackend, refs: &References, rep: &mut CheckReport, rng: &mut Rng) -> Result<()> {
    let cpu = &refs.f32;
    let (k, nq, nkv, ff) = (256usize, 192usize, 64usize, 320usize);
    let tensors: Vec<HostTensor> = [nq, nkv, nkv, ff, ff]
        .iter()
        .map(|&n| float_tensor("w", DType::BF16, n, k, &rng.vec(n * k, 0.5)))
        .collect();
    let bs: Vec<HostTensor> =
        [nq, nkv, nkv].iter().map(|&n| float_tensor("b", DType::F32, 1, n, &rng.vec(n, 0.5))).collect();
    let wc = tensors.iter().map(|t| cpu.upload_weight(t)).collect::<Result<Vec<_>>>()?;
    let bg = bs.iter().map(|t| be.upload_weight(t)).collect::<Result<Vec<_>>>()?;
    let bc = bs.iter().map(|t| cpu.upload_weight(t)).collect::<Result<Vec<_>>>()?;
    for stacked in [true, false] {
        if stacked {
            be.reserve_weights(tensors.iter().map(|t| t.data.len() as u64).sum())?;
        }
        // Apart: each weight followed by a second copy of itself (the same
        // size, so wherever the allocator puts allocations of that size), so
        // no weight is the next one's neighbour.
        let mut wg = Vec::new();
        let mut copies = Vec::new();
        for t in &tensors {
            wg.push(be.upload_weight(t)?);
            if !stacked {
                copies.push(be.upload_weight(t)?);
            }
        }
        if !stacked {
            let next = |a: &CudaWeight, b: &CudaWeight| a.ptr() + (a.rows * a.row_bytes) as u64 == b.ptr();
            if wg.windows(2).any(|p| next(&p[0], &p[1])) {
                return Err(crate::BackendError::Other(
                    "stacked checks: weights uploaded apart are neighbours".into(),
                ));
            }
        }
        let how = if stacked { "stacked" } else { "apart" };
        for rows in [16usize, 40] {
            for with_bias in [false, true] {
                let x = pair(be, cpu, rows, k, Some(&rng.vec(rows * k, 1.0)))?;
                let mut outs = Vec::new();
                for n in [nq, nkv, nkv] {
                    outs.push(pair(be, cpu, rows, n, None)?);
                }
                let scratch = pair(be, cpu, rows, nq + 2 * nkv, Some(&vec![0.0; rows * (nq + 2 * nkv)]))?;
                let mut scratch_g = scratch.g;
                let parts = Parts { x: &x, wg: &wg, wc: &wc, bg: &bg, bc: &bc, with_bias, rows };
                parts.check(be, refs, rep, &mut outs, Some(&mut scratch_g), &format!("bf16 {how}"), "")?;
                let mut row0 = Vec::new();
                for (i, o) in outs.iter().enumerate() {
                    let reference = refs.of(be.rounds_input(&wg[i], rows)).0;
                    // Row 0 of this part before its bias.
                    let mut plain = reference.alloc_act(ActShape { rows, cols: o.c.cols() })?;
                    reference.matmul(&x.c, &wc[i], None, rows, &mut plain);
                    let mut p = Vec::new();
                    reference.read_rows(&plain, 1, &mut p);
                    row0.extend(p);
                }
                let mut held = Vec::new();
                be.read_rows(&scratch_g, 1, &mut held);
                be.check()?;
                let zeros = vec![0.0; row0.len()];
                let (what, want) =
                    if stacked { ("the stacked product", &row0) } else { ("untouched", &zeros) };
                rep.compare(
                    &format!("matmul_many bf16 {how} {rows}x{k}: scratch row 0 {what}"),
                    &held,
                    want,
                    BF16,
                );
            }
            let x = pair(be, cpu, rows, k, Some(&rng.vec(rows * k, 1.0)))?;
            // Room for both halves of every row in `gate_out`.
            let (mut g, mut u, mut o) = (
                pair(be, cpu, 2 * rows, ff, None)?,
                pair(be, cpu, rows, ff, None)?,
                pair(be, cpu, rows, ff, None)?,
            );
            be.gate_up_silu(&x.g, &wg[3], &wg[4], rows, &mut g.g, &mut u.g, &mut o.g);
            let (reference, tol) = refs.of(be.rounds_input(&wg[3], rows));
            reference.gate_up_silu(&x.c, &wc[3], &wc[4], rows, &mut g.c, &mut u.c, &mut o.c);
            let (a, b) = read_both(be, reference, &o, rows)?;
            rep.compare(&format!("gate_up_silu bf16 {how} {rows}x{k} · 2x{ff}x{k}"), &a, &b, tol);
            // Stacked, gate_out's first 2 x ff values are row 0's gate and up.
            let mut held = Vec::new();
            be.read_rows(&g.g, 2, &mut held);
            be.check()?;
            let (mut gate0, mut up0) = (Vec::new(), Vec::new());
            reference.read_rows(&g.c, 1, &mut gate0);
            reference.read_rows(&u.c, 1, &mut up0);
            let want: Vec<f32> = if stacked {
                gate0.iter().chain(&up0).copied().collect()
            } else {
                let mut two = Vec::new();
                reference.read_rows(&g.c, 2, &mut two);
                two
            };
            rep.compare(
                &format!("gate_up_silu bf16 {how} {rows}x{k}: gate_out's first values"),
                &held,
                &want,
                tol,
            );
        }
    }
    Ok(())
}

fn fused_matmul_checks(
    be: &CudaBackend,
    refs: &References,
    rep: &mut CheckReport,
    rng: &mut Rng,
    groups: usize,
) -> Result<()> {
    let cpu = &refs.f32;
    let bf16 = [DType::BF16; 3];
    let kquants = [DType::Q4_K, DType::Q4_K, DType::Q6_K];
    // One integer GEMV launch for all three (one format), its blocks of each
    // part after the last's; 64 columns of gate/up: the SiLU product quantized too.
    let q8 = [DType::Q8_0; 3];
    let cases: &[(usize, usize, usize, [DType; 3])] = if groups > 0 {
        &[(1280, 37, 13, kquants), (4352, 64, 19, q8)]
    } else {
        &[(64, 96, 32, bf16), (4104, 37, 13, bf16), (1280, 37, 13, kquants), (4352, 64, 19, q8)]
    };
    let blocks = if groups > 0 { format!(", {groups} groups a block") } else { String::new() };
    for &(k, nq, nkv, dtypes) in cases {
        let mk = |rng: &mut Rng, dtype: DType, n: usize| match dtype {
            DType::BF16 => float_tensor("w", dtype, n, k, &rng.vec(n * k, 0.5)),
            q => quant_tensor(rng, q, n, k),
        };
        let ws = [mk(rng, dtypes[0], nq), mk(rng, dtypes[1], nkv), mk(rng, dtypes[2], nkv)];
        let bs: Vec<HostTensor> =
            [nq, nkv, nkv].iter().map(|&n| float_tensor("b", DType::F32, 1, n, &rng.vec(n, 0.5))).collect();
        let wg = ws.iter().map(|t| be.upload_weight(t)).collect::<Result<Vec<_>>>()?;
        let wc = ws.iter().map(|t| cpu.upload_weight(t)).collect::<Result<Vec<_>>>()?;
        let bg = bs.iter().map(|t| be.upload_weight(t)).collect::<Result<Vec<_>>>()?;
        let bc = bs.iter().map(|t| cpu.upload_weight(t)).collect::<Result<Vec<_>>>()?;
        let kind = dtypes[0];
        for rows in [1usize, 2, 3] {
            for with_bias in [false, true] {
                let x = pair(be, cpu, rows, k, Some(&rng.vec(rows * k, 1.0)))?;
                let mut outs = Vec::new();
                for n in [nq, nkv, nkv] {
                    outs.push(pair(be, cpu, rows, n, None)?);
                }
                let parts = Parts { x: &x, wg: &wg, wc: &wc, bg: &bg, bc: &bc, with_bias, rows };
                parts.check(be, refs, rep, &mut outs, None, &kind.to_string(), &blocks)?;
            }
            let x = pair(be, cpu, rows, k, Some(&rng.vec(rows * k, 1.0)))?;
            let (mut g, mut u, mut o) = (
                pair(be, cpu, rows, nq, None)?,
                pair(be, cpu, rows, nq, None)?,
                pair(be, cpu, rows, nq, None)?,
            );
            let up = mk(rng, dtypes[0], nq);
            let (ug, uc) = (be.upload_weight(&up)?, cpu.upload_weight(&up)?);
            be.gate_up_silu(&x.g, &wg[0], &ug, rows, &mut g.g, &mut u.g, &mut o.g);
            let (reference, tol) = refs.of(be.rounds_input(&wg[0], rows));
            reference.gate_up_silu(&x.c, &wc[0], &uc, rows, &mut g.c, &mut u.c, &mut o.c);
            let (a, b) = read_both(be, reference, &o, rows)?;
            rep.compare(&format!("gate_up_silu {kind} {rows}x{k} · 2x{nq}x{k}{blocks}"), &a, &b, tol);
        }
    }
    Ok(())
}

/// One attention scenario on both backends.
struct AttnCase<'a> {
    name: &'a str,
    heads: usize,
    geometry: KvGeometry,
    /// (cached, rows) per sequence.
    seqs: &'a [(usize, usize)],
    /// Whether the fused RoPE + KV store also applies Qwen3's q/k head norms.
    qk_norm: bool,
}

fn attention_checks(be: &CudaBackend, cpu: &CpuBackend, rep: &mut CheckReport, rng: &mut Rng) -> Result<()> {
    let g = |page_size, kv_heads, head_dim| KvGeometry {
        page_size: Tokens(page_size),
        num_pages: Pages(400),
        kv_heads,
        head_dim,
    };
    let cases = [
        AttnCase {
            name: "mixed decode / prefix-cached prefill / fresh prefill, hd 64",
            heads: 8,
            geometry: g(16, 2, 64),
            seqs: &[(37, 1), (20, 13), (0, 7)],
            qk_norm: false,
        },
        AttnCase {
            name: "tiny heads (hd 16, GQA 2)",
            heads: 4,
            geometry: g(16, 2, 16),
            seqs: &[(5, 1), (0, 9)],
            qk_norm: false,
        },
        AttnCase {
            name: "long decode, split-K (ctx 3001, hd 128, GQA 4)",
            heads: 32,
            geometry: g(16, 8, 128),
            seqs: &[(3000, 1)],
            qk_norm: false,
        },
        AttnCase {
            name: "decode + short prefill, hd 256, GQA 2",
            heads: 4,
            geometry: g(16, 2, 256),
            seqs: &[(150, 1), (0, 21)],
            qk_norm: false,
        },
        // Batches of decode rows take the token-per-lane kernel: tiles of 32
        // tokens, partial last tiles, contexts shorter than one tile.
        AttnCase {
            name: "batch-9 decode, hd 128, GQA 4, contexts 1..1001",
            heads: 16,
            geometry: g(16, 4, 128),
            seqs: &[(700, 1), (31, 1), (32, 1), (33, 1), (129, 1), (0, 1), (255, 1), (256, 1), (1000, 1)],
            qk_norm: true,
        },
        AttnCase {
            name: "batch-8 decode, hd 128, GQA 8",
            heads: 16,
            geometry: g(16, 2, 128),
            seqs: &[(300, 1), (17, 1), (64, 1), (5, 1), (511, 1), (90, 1), (2, 1), (160, 1)],
            qk_norm: false,
        },
        AttnCase {
            name: "batch-4 decode, hd 128",
            heads: 16,
            geometry: g(32, 4, 128),
            seqs: &[(100, 1), (1000, 1), (7, 1), (63, 1)],
            qk_norm: false,
        },
        AttnCase {
            name: "batch-3 decode with q/k norms, hd 64, GQA 8",
            heads: 16,
            geometry: g(16, 2, 64),
            seqs: &[(40, 1), (200, 1), (3, 1)],
            qk_norm: true,
        },
        // The tiled prefill kernel: several tiles and a partial one, GQA.
        AttnCase {
            name: "fresh prefill of 200 rows (4 tiles), hd 128, GQA 4",
            heads: 8,
            geometry: g(16, 2, 128),
            seqs: &[(0, 200)],
            qk_norm: false,
        },
        // Tiles after a long cached prefix, a one-tile sequence at the
        // threshold, and rows below it (decode, 15 rows) in the same step.
        AttnCase {
            name: "prefix-cached prefill + decode + short chunk, hd 128, GQA 4",
            heads: 16,
            geometry: g(16, 4, 128),
            seqs: &[(300, 1), (700, 77), (0, 16), (5, 15)],
            qk_norm: true,
        },
        AttnCase {
            name: "prefill hd 64, no GQA, page 32",
            heads: 4,
            geometry: g(32, 4, 64),
            seqs: &[(33, 64), (0, 130)],
            qk_norm: false,
        },
        // Head dim 256 (Qwen3.5's full-attention layers, 24 query heads on 4
        // KV heads): two blocks per tile, each writing half of the output
        // dimensions, K/V tiles of 32 tokens.
        AttnCase {
            name: "fresh prefill of 1000 rows (16 tiles, the last of 40 rows), hd 256, GQA 24/4",
            heads: 24,
            geometry: g(16, 4, 256),
            seqs: &[(0, 1000)],
            qk_norm: false,
        },
        AttnCase {
            name: "prefix-cached prefill + decode + short chunk, hd 256, GQA 24/4",
            heads: 24,
            geometry: g(16, 4, 256),
            seqs: &[(300, 1), (700, 77), (0, 16), (5, 15)],
            qk_norm: true,
        },
        AttnCase {
            name: "prefill hd 256, no GQA, page 32",
            heads: 2,
            geometry: g(32, 2, 256),
            seqs: &[(33, 64), (0, 130)],
            qk_norm: false,
        },
    ];
    // A head dim without a tiled kernel falls back to split-K, which would
    // pass the comparisons below as well.
    for hd in [64, 128, 256] {
        let has =
            be.tiled_kernel(hd).map(|_| ()).ok_or_else(|| crate::BackendError::Other("split-K only".into()));
        rep.refused(&format!("a tiled prefill kernel for head_dim {hd}"), has);
    }
    // Every case through both prefill paths: the tiled kernel (for sequences
    // of at least TILED_MIN_ROWS rows) and the split-K kernel for everything.
    // Decode rows take the tile kernel; once more through the per-warp split-K kernel,
    // and once with the splits merged by a combine pass instead of in their own launch.
    let merge = be.lock().attn_merge;
    let set = |path, tiles, merge| {
        let mut st = be.lock();
        (st.prefill, st.decode_tiles, st.attn_merge) = (path, tiles, merge);
    };
    for (path, tiles, merge) in [
        (PrefillPath::Tiled, true, merge),
        (PrefillPath::SplitK, true, merge),
        (PrefillPath::Tiled, false, merge),
        (PrefillPath::Tiled, true, !merge),
    ] {
        set(path, tiles, merge);
        for c in &cases {
            let r = attention_case(be, cpu, rep, rng, c, path);
            if r.is_err() {
                set(PrefillPath::Tiled, true, merge);
            }
            r?;
        }
    }
    set(PrefillPath::Tiled, true, merge);
    Ok(())
}

fn attention_case(
    be: &CudaBackend,
    cpu: &CpuBackend,
    rep: &mut CheckReport,
    rng: &mut Rng,
    c: &AttnCase<'_>,
    path: PrefillPath,
) -> Result<()> {
    let geo = c.geometry;
    let (kvw, qw) = (geo.kv_heads * geo.head_dim, c.heads * geo.head_dim);
    let (mut kg, mut kc): (CudaKv, _) = (be.alloc_kv(geo)?, cpu.alloc_kv(geo)?);
    // Scrambled page tables, distinct pages per sequence.
    let mut next = 3u32;
    let tables: Vec<Vec<PageId>> = c
        .seqs
        .iter()
        .map(|&(cached, rows)| {
            (0..(cached + rows).div_ceil(geo.page_size.get()))
                .map(|i| {
                    next += 1 + (i as u32 % 3);
                    PageId(next)
                })
                .collect()
        })
        .collect();
    // First fill the cached history (one prefill of `cached` rows per sequence).
    let hist: Vec<SeqStep> = {
        let mut row = 0;
        c.seqs
            .iter()
            .zip(&tables)
            .map(|(&(cached, _), t)| {
                let s = SeqStep { row_start: row, rows: cached, cached: 0, pages: t };
                row += cached;
                s
            })
            .collect()
    };
    let hrows: usize = c.seqs.iter().map(|s| s.0).sum();
    if hrows > 0 {
        let k = pair(be, cpu, hrows, kvw, Some(&rng.vec(hrows * kvw, 1.0)))?;
        let v = pair(be, cpu, hrows, kvw, Some(&rng.vec(hrows * kvw, 1.0)))?;
        be.write_kv(&mut kg, &k.g, &v.g, &hist);
        cpu.write_kv(&mut kc, &k.c, &v.c, &hist);
    }
    // Then the step itself.
    let mut row = 0;
    let step: Vec<SeqStep> = c
        .seqs
        .iter()
        .zip(&tables)
        .map(|(&(cached, rows), t)| {
            let s = SeqStep { row_start: row, rows, cached, pages: t };
            row += rows;
            s
        })
        .collect();
    let rows = row;
    let (k_raw, q_raw) = (rng.vec(rows * kvw, 1.0), rng.vec(rows * qw, 2.0));
    let mut k = pair(be, cpu, rows, kvw, Some(&k_raw))?;
    let v = pair(be, cpu, rows, kvw, Some(&rng.vec(rows * kvw, 1.0)))?;
    let mut q = pair(be, cpu, rows, qw, Some(&q_raw))?;
    if path == PrefillPath::SplitK {
        // The fused RoPE + KV store, against the CPU's rope, rope, write_kv.
        let table = RopeTable {
            style: RopeStyle::Half,
            rot_dim: geo.head_dim,
            inv_freq: (0..geo.head_dim / 2)
                .map(|i| 10000f32.powf(-((2 * i) as f32) / geo.head_dim as f32))
                .collect(),
        };
        let positions: Vec<u32> =
            c.seqs.iter().flat_map(|&(cached, rows)| (cached..cached + rows).map(|p| p as u32)).collect();
        // With the q/k norms, against the CPU's two head_rms_norm first.
        let norms = match c.qk_norm {
            true => {
                let w = [rng.vec(geo.head_dim, 1.0), rng.vec(geo.head_dim, 1.0)];
                let t = |i: usize| float_tensor("qk norm", DType::F32, 1, geo.head_dim, &w[i]);
                let dev = [be.upload_weight(&t(0))?, be.upload_weight(&t(1))?];
                Some((dev, [cpu.upload_weight(&t(0))?, cpu.upload_weight(&t(1))?]))
            }
            false => None,
        };
        let (ng, nc) = match &norms {
            Some(([gq, gk], [cq, ck])) => (
                Some(QkNorm { q: gq, k: gk, eps: 1e-6, rows }),
                Some(QkNorm { q: cq, k: ck, eps: 1e-6, rows }),
            ),
            None => (None, None),
        };
        // The launch also carries an L2 prefetch of a weight (`Backend::prefetch`, as a layer asks for
        // its o_proj), 49 chunks of the bulk prefetch dealt over its threads: the results stay exact.
        let pf = float_tensor("prefetched", DType::BF16, 97, 4096, &rng.vec(97 * 4096, 1.0));
        let pf = be.upload_weight(&pf)?;
        be.prefetch(&pf);
        be.rope_write_kv(&mut q.g, &mut k.g, &v.g, ng, &table, geo.head_dim, &positions, &mut kg, &step);
        cpu.rope_write_kv(&mut q.c, &mut k.c, &v.c, nc, &table, geo.head_dim, &positions, &mut kc, &step);
        let normed = if c.qk_norm { " with q/k norms" } else { "" };
        let (a, b) = read_both(be, cpu, &q, rows)?;
        rep.compare(&format!("rope_write_kv{normed}: q of {}", c.name), &a, &b, EXACT);
        let (a, b) = read_both(be, cpu, &k, rows)?;
        rep.compare(&format!("rope_write_kv{normed}: k of {}", c.name), &a, &b, EXACT);
        // A step of decode rows: RoPE and the KV store inside the attention
        // launch (`rope_attention` in one pass; it stores the same K and V
        // again), from the projections' raw q and k, against the CPU's ops.
        if c.seqs.iter().all(|&(_, r)| r == 1) {
            let (mut qr, mut kr) =
                (pair(be, cpu, rows, qw, Some(&q_raw))?, pair(be, cpu, rows, kvw, Some(&k_raw))?);
            let mut o = pair(be, cpu, rows, qw, None)?;
            let before = be.lock().one_pass_attention;
            be.prefetch(&pf);
            let a = RopeAttention {
                q: &mut qr.g,
                k: &mut kr.g,
                v: &v.g,
                norm: ng,
                table: &table,
                head_dim: geo.head_dim,
                positions: &positions,
                kv: &mut kg,
                seqs: &step,
            };
            be.rope_attention(a, c.heads, &mut o.g);
            cpu.attention(&q.c, &kc, c.heads, &step, &mut o.c);
            let one_pass = be.lock().one_pass_attention > before;
            let (a, b) = read_both(be, cpu, &o, rows)?;
            let how = if one_pass { "one pass" } else { "RoPE, then attention" };
            rep.compare(&format!("rope_attention{normed} ({how}): {}", c.name), &a, &b, BF16);
            // Every decode step of at most 7 rows and an exact head dim takes the one pass.
            let tile = be.decode_tile(&be.lock(), rows, geo.head_dim);
            if tile && be.config.tuning.fuse && be.config.tuning.attn_rope && !one_pass {
                rep.refused(
                    &format!("rope_attention in one pass: {}", c.name),
                    Err::<(), _>(crate::BackendError::Other("two launches".into())),
                );
            }
        }
    } else {
        be.write_kv(&mut kg, &k.g, &v.g, &step);
        cpu.write_kv(&mut kc, &k.c, &v.c, &step);
    }
    let mut out = pair(be, cpu, rows, qw, None)?;
    be.attention(&q.g, &kg, c.heads, &step, &mut out.g);
    cpu.attention(&q.c, &kc, c.heads, &step, &mut out.c);
    let (a, b) = read_both(be, cpu, &out, rows)?;
    let how = {
        let st = be.lock();
        (st.decode_tiles, st.attn_merge)
    };
    let decode = match how {
        (true, true) => "",
        (true, false) => ", combine pass",
        (false, _) => ", per-warp decode",
    };
    rep.compare(&format!("attention ({path:?}{decode}): {}", c.name), &a, &b, BF16);

    // Copy-on-write of the first sequence's first page, then attend through the copy.
    let mut moved = tables[0].clone();
    let fresh = PageId(next + 5);
    be.copy_page(&mut kg, moved[0], fresh);
    cpu.copy_page(&mut kc, moved[0], fresh);
    moved[0] = fresh;
    let mut step2 = step.clone();
    step2[0].pages = &moved;
    // The step's rows are already in the cache; re-attending must give the same answer.
    let mut out2 = pair(be, cpu, rows, qw, None)?;
    be.attention(&q.g, &kg, c.heads, &step2, &mut out2.g);
    cpu.attention(&q.c, &kc, c.heads, &step2, &mut out2.c);
    let (a2, b2) = read_both(be, cpu, &out2, rows)?;
    rep.compare(&format!("attention ({path:?}{decode}) after copy_page: {}", c.name), &a2, &b2, BF16);
    Ok(())
}

/// What one decode layer of `graph_check` runs with, besides its buffers.
struct LayerStep<'a> {
    table: &'a RopeTable,
    positions: &'a [u32],
    seqs: &'a [SeqStep<'a>],
    heads: usize,
}

impl LayerStep<'_> {
    /// Norm, q/k/v in one `matmul_many`, RoPE with the KV store and attention
    /// (on the GPU one launch: every row is a decode row).
    /// `w`: the norm and the q, k, v weights; `a`: h, q, k, v and the output.
    fn run<B: Backend>(&self, b: &B, x: &B::Act, w: [&B::Weight; 4], a: [&mut B::Act; 5], kv: &mut B::Kv) {
        let [n, wq, wk, wv] = w;
        let [h, q, k, v, o] = a;
        b.rms_norm(x, n, 1e-5, 2, h);
        b.matmul_many(
            h,
            &mut [
                MatmulPart { w: wq, bias: None, out: &mut *q },
                MatmulPart { w: wk, bias: None, out: &mut *k },
                MatmulPart { w: wv, bias: None, out: &mut *v },
            ],
            2,
            None,
        );
        let a = RopeAttention {
            q,
            k,
            v,
            norm: None,
            table: self.table,
            head_dim: self.table.rot_dim,
            positions: self.positions,
            kv,
            seqs: self.seqs,
        };
        b.rope_attention(a, self.heads, o);
    }
}

/// Capture a decode-shaped step (norm, matmul, KV write, attention), replay it
/// with other metadata and inputs, and compare with the CPU running the ops.
pub fn graph_check(be: &CudaBackend, rep: &mut CheckReport) -> Result<()> {
    let cpu = CpuBackend::new();
    let mut rng = Rng(42);
    let (heads, kvh, hd, hidden) = (8usize, 2usize, 64usize, 128usize);
    let geo = KvGeometry { page_size: Tokens(16), num_pages: Pages(64), kv_heads: kvh, head_dim: hd };
    let (mut kg, mut kc) = (be.alloc_kv(geo)?, cpu.alloc_kv(geo)?);
    let wq = float_tensor("wq", DType::BF16, heads * hd, hidden, &rng.vec(heads * hd * hidden, 0.2));
    let wk = float_tensor("wk", DType::BF16, kvh * hd, hidden, &rng.vec(kvh * hd * hidden, 0.2));
    let wv = float_tensor("wv", DType::BF16, kvh * hd, hidden, &rng.vec(kvh * hd * hidden, 0.2));
    let table = RopeTable {
        style: RopeStyle::Half,
        rot_dim: hd,
        inv_freq: (0..hd / 2).map(|i| 10000f32.powf(-((2 * i) as f32) / hd as f32)).collect(),
    };
    let nw = float_tensor("n", DType::BF16, 1, hidden, &rng.vec(hidden, 1.0));
    let (qg, qc) = (be.upload_weight(&wq)?, cpu.upload_weight(&wq)?);
    let (kwg, kwc) = (be.upload_weight(&wk)?, cpu.upload_weight(&wk)?);
    let (vwg, vwc) = (be.upload_weight(&wv)?, cpu.upload_weight(&wv)?);
    let (ng, nc) = (be.upload_weight(&nw)?, cpu.upload_weight(&nw)?);
    let pages = [PageId(9), PageId(2), PageId(30)];
    let key = GraphKey { rows: 2, logit_rows: 2 };
    let mut h = pair(be, &cpu, 2, hidden, None)?;
    let mut q = pair(be, &cpu, 2, heads * hd, None)?;
    let mut k = pair(be, &cpu, 2, kvh * hd, None)?;
    let mut v = pair(be, &cpu, 2, kvh * hd, None)?;
    let mut o = pair(be, &cpu, 2, heads * hd, None)?;
    for (round, cached) in [(0usize, 3usize), (1, 20), (2, 41)] {
        let x = pair(be, &cpu, 2, hidden, Some(&rng.vec(2 * hidden, 1.0)))?;
        // Two sequences sharing the page list at different lengths (distinct tokens do not matter here).
        let seqs = [
            SeqStep { row_start: 0, rows: 1, cached, pages: &pages },
            SeqStep { row_start: 1, rows: 1, cached: cached + 1, pages: &pages },
        ];
        let positions = [cached as u32, cached as u32 + 1];
        be.begin_step(&StepPlan {
            tokens: &[TokenId(1), TokenId(2)],
            positions: &positions,
            seqs: &seqs,
            logit_rows: &[0, 1],
            state_slots: &[],
        })?;
        // The decode layer's fused launches (q/k/v in one GEMV, RoPE and the
        // KV store inside attention) inside the capture, against the CPU's separate ops.
        let step = LayerStep { table: &table, positions: &positions, seqs: &seqs, heads };
        let replayed = be.graph_replay(key)?;
        if !replayed {
            // The rotary table goes up outside the capture, as a served
            // model's first, uncaptured step leaves it (an earlier check may
            // have left another head size's); q is overwritten by the step.
            be.rope(&mut q.g, &table, hd, &positions);
            let capturing = be.graph_capture_begin(key)?;
            step.run(
                be,
                &x.g,
                [&ng, &qg, &kwg, &vwg],
                [&mut h.g, &mut q.g, &mut k.g, &mut v.g, &mut o.g],
                &mut kg,
            );
            if capturing {
                be.graph_capture_end(key)?;
            }
        }
        step.run(
            &cpu,
            &x.c,
            [&nc, &qc, &kwc, &vwc],
            [&mut h.c, &mut q.c, &mut k.c, &mut v.c, &mut o.c],
            &mut kc,
        );
        let (a, b) = read_both(be, &cpu, &o, 2)?;
        rep.compare(
            &format!(
                "graph round {round} ({}, cached {cached})",
                if replayed { "replayed" } else { "captured" }
            ),
            &a,
            &b,
            BF16,
        );
    }
    Ok(())
}

/// The delta-net ops of a hybrid decode step (convolution, delta rule, gated
/// norm) captured once for a padded step of 4 rows and replayed with other
/// sequences in other slots (fewer, more, reordered, a new one in a used
/// slot), against the CPU running the ops each time.
pub fn delta_graph_check(be: &CudaBackend, rep: &mut CheckReport) -> Result<()> {
    let cpu = CpuBackend::new();
    let mut rng = Rng(1234);
    let g = DeltaGeometry {
        k_heads: 4,
        v_heads: 12,
        k_dim: 128,
        v_dim: 128,
        conv_kernel: 4,
        v_order: VHeadOrder::Grouped,
    };
    let w = delta_weights(&mut rng, g);
    let nw = float_tensor("n", DType::F32, 1, g.v_dim, &rng.vec(g.v_dim, 1.0));
    let (nwg, nwc) = (be.upload_weight(&nw)?, cpu.upload_weight(&nw)?);
    let slots = 6;
    let mut lg = DeltaLayer::new(be, g, slots, [&w[0], &w[1], &w[2]])?;
    let mut lc = DeltaLayer::new(&cpu, g, slots, [&w[0], &w[1], &w[2]])?;
    let up_g = |a: &mut CudaAct, d: &[f32]| put_gpu(be, a, d);
    let up_c = |a: &mut CpuAct, d: &[f32]| {
        put_cpu(a, d);
        Ok(())
    };
    let pages = [PageId(0)];
    // Histories of 5, 9 and 2 tokens in slots 0, 2 and 5, uncaptured.
    {
        let seqs = [
            SeqStep { row_start: 0, rows: 5, cached: 0, pages: &pages },
            SeqStep { row_start: 5, rows: 9, cached: 0, pages: &pages },
            SeqStep { row_start: 14, rows: 2, cached: 0, pages: &pages },
        ];
        let st = [StateSlot(0), StateSlot(2), StateSlot(5)];
        let (qkv, a, b) =
            (rng.vec(16 * g.conv_channels(), 1.0), rng.vec(16 * 12, 2.0), rng.vec(16 * 12, 2.0));
        let inp = DeltaInputs { qkv: &qkv, a: &a, b: &b, seqs: &seqs, slots: &st };
        lg.step(be, g, &inp, &up_g)?;
        lc.step(&cpu, g, &inp, &up_c)?;
    }
    let rows = 4;
    let key = GraphKey { rows, logit_rows: rows };
    let act = |cols: usize| pair(be, &cpu, rows, cols, None);
    let (mut x, mut a, mut b, mut z, mut out) = (
        act(g.conv_channels())?,
        act(g.v_heads)?,
        act(g.v_heads)?,
        act(g.value_width())?,
        act(g.value_width())?,
    );
    // (slot, cached) per sequence, one row each.
    let rounds: [&[(u32, usize)]; 4] =
        [&[(2, 9), (5, 2)], &[(0, 5), (2, 10), (5, 3)], &[(5, 4), (0, 6)], &[(2, 0), (0, 7)]];
    for (round, seqs_of) in rounds.iter().enumerate() {
        let seqs: Vec<SeqStep> = seqs_of
            .iter()
            .enumerate()
            .map(|(i, &(_, cached))| SeqStep { row_start: i, rows: 1, cached, pages: &pages })
            .collect();
        let st: Vec<StateSlot> = seqs_of.iter().map(|&(s, _)| StateSlot(s)).collect();
        for (p, vals) in [
            (&mut x, rng.vec(rows * g.conv_channels(), 1.0)),
            (&mut a, rng.vec(rows * g.v_heads, 2.0)),
            (&mut b, rng.vec(rows * g.v_heads, 2.0)),
            (&mut z, rng.vec(rows * g.value_width(), 2.0)),
        ] {
            put_gpu(be, &p.g, &vals)?;
            put_cpu(&mut p.c, &vals);
        }
        let positions: Vec<u32> = (0..rows as u32).collect();
        be.begin_step(&StepPlan {
            tokens: &[TokenId(0); 4],
            positions: &positions,
            seqs: &seqs,
            logit_rows: &[0, 1, 2, 3],
            state_slots: &st,
        })?;
        let replayed = be.graph_replay(key)?;
        if !replayed {
            let capturing = be.graph_capture_begin(key)?;
            let ran = (|| {
                be.causal_conv_silu(&mut x.g, &lg.conv_w, &mut lg.conv, &seqs, &st)?;
                be.gated_delta_rule(DeltaRule {
                    qkv: &x.g,
                    a: &a.g,
                    b: &b.g,
                    decay: &lg.decay,
                    dt_bias: &lg.dt_bias,
                    geometry: g,
                    state: &mut lg.rec,
                    seqs: &seqs,
                    slots: &st,
                    out: &mut out.g,
                })?;
                be.gated_rms_norm(&mut out.g, &z.g, &nwg, 1e-6, g.v_dim, rows)
            })();
            if capturing {
                be.graph_capture_end(key)?;
            }
            ran?;
        }
        cpu.causal_conv_silu(&mut x.c, &lc.conv_w, &mut lc.conv, &seqs, &st)?;
        cpu.gated_delta_rule(DeltaRule {
            qkv: &x.c,
            a: &a.c,
            b: &b.c,
            decay: &lc.decay,
            dt_bias: &lc.dt_bias,
            geometry: g,
            state: &mut lc.rec,
            seqs: &seqs,
            slots: &st,
            out: &mut out.c,
        })?;
        cpu.gated_rms_norm(&mut out.c, &z.c, &nwc, 1e-6, g.v_dim, rows)?;
        let (o_g, o_c) = read_both(be, &cpu, &out, seqs.len())?;
        let shape: Vec<String> = seqs_of.iter().map(|&(s, c)| format!("slot {s} after {c}")).collect();
        rep.compare(
            &format!(
                "delta-net graph round {round} ({}, {})",
                if replayed { "replayed" } else { "captured" },
                shape.join(", ")
            ),
            &o_g,
            &o_c,
            SCAN,
        );
    }
    let (cg, rg) = lg.states(be, slots)?;
    let (cc, rc) = lc.states(&cpu, slots)?;
    rep.compare("delta-net graph: convolution states left", &cg, &cc, EXACT);
    rep.compare("delta-net graph: recurrent states left", &rg, &rc, SCAN);
    Ok(())
}

/// Device time of `f` in milliseconds: median of `reps` runs after a warm-up, by CUDA events.
fn time_ms(be: &CudaBackend, reps: usize, mut f: impl FnMut()) -> Result<f32> {
    be.ctx.bind()?;
    let stream: Stream = be.stream;
    let ev =
        || cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| cuda_err("cuEventCreate", e));
    let (a, b) = (ev()?, ev()?);
    for _ in 0..3 {
        f();
    }
    let mut ts = Vec::with_capacity(reps);
    for _ in 0..reps {
        // SAFETY: events and stream of this context.
        unsafe {
            cu::event::record(a, stream.0).map_err(|e| cuda_err("cuEventRecord", e))?;
            f();
            cu::event::record(b, stream.0).map_err(|e| cuda_err("cuEventRecord", e))?;
            cu::event::synchronize(b).map_err(|e| cuda_err("cuEventSynchronize", e))?;
            ts.push(cu::event::elapsed(a, b).map_err(|e| cuda_err("cuEventElapsedTime", e))?);
        }
    }
    unsafe {
        let _ = cu::event::destroy(a);
        let _ = cu::event::destroy(b);
    }
    be.check()?;
    ts.sort_by(f32::total_cmp);
    Ok(ts[ts.len() / 2])
}

/// A bf16 weight of random values (a pool of 65521 values repeated: random
/// enough for timing, and cheap to build at a gigabyte).
fn bench_weight(rng: &mut Rng, n: usize, k: usize) -> HostTensor {
    let pool: Vec<u8> = (0..65521).flat_map(|_| bf16::from_f32(rng.f() * 0.05).to_le_bytes()).collect();
    let total = n * k * 2;
    let mut bytes = Vec::with_capacity(total);
    while bytes.len() < total {
        let take = (total - bytes.len()).min(pool.len());
        bytes.extend_from_slice(&pool[..take]);
    }
    tensor("w", DType::BF16, &[n, k], bytes)
}

/// Copies of a weight whose bytes together exceed the L2 cache several times,
/// so that back-to-back runs read device memory, not L2.
fn weight_copies(be: &CudaBackend, t: &HostTensor) -> Result<Vec<CudaWeight>> {
    let copies = (256usize << 20).div_ceil(t.data.len()).max(1);
    (0..copies).map(|_| be.upload_weight(t)).collect()
}

/// Device time of one run of `f`, with `f` captured once as a graph and the
/// graph replayed: no launch gaps, as in a captured decode step.
fn graph_time_ms(be: &CudaBackend, id: usize, reps: usize, mut f: impl FnMut()) -> Result<f32> {
    // Keys far above any real batch size, one per benchmark.
    let key = GraphKey { rows: (1 << 40) + id, logit_rows: 0 };
    f();
    be.check()?;
    if be.graph_capture_begin(key)? {
        f();
        be.graph_capture_end(key)?;
    }
    be.synchronize()?;
    time_ms(be, reps, || {
        if let Err(e) = be.graph_replay(key) {
            be.lock().error.get_or_insert(e);
        }
    })
}

/// cuBLASLt at decode batches of the Llama-3-8B shapes, under each split-K
/// reduction scheme its heuristic may pick (`cuda_check --bench-gemm` runs
/// only this): graph replays over weight copies larger than L2, the input
/// converted once, as a layer's norm stores it.
pub fn bench_gemm_schemes(be: &CudaBackend, graph_id: &mut usize) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let rng = &mut Rng(11);
    let copy_gbs = 4300.0;
    for &(n, k) in &[(4096usize, 4096usize), (1024, 4096), (14336, 4096), (4096, 14336)] {
        let ws = weight_copies(be, &bench_weight(rng, n, k))?;
        let x = be.alloc_act(ActShape { rows: 128, cols: k })?;
        put_gpu(be, &x, &rng.vec(128 * k, 1.0))?;
        let out = be.alloc_act(ActShape { rows: 128, cols: n })?;
        for rows in [16usize, 32, 64, 128] {
            let mut line = format!("cublasLt bf16 {n}x{k} {rows} rows (graph)");
            for (name, mask) in [("any scheme", None), ("in place", Some(1u32)), ("no split", Some(0u32))] {
                be.lock().gemm.set_reduction_mask(mask);
                *graph_id += 1;
                let r = graph_time_ms(be, *graph_id, 20, || {
                    be.matmul_op("bench", |st| {
                        for w in &ws {
                            be.matmul_lt(st, &x, w, rows, &out)?;
                        }
                        Ok(())
                    })
                });
                match r {
                    Ok(ms) => {
                        let us = ms * 1e3 / ws.len() as f32;
                        let gbs = (n * k * 2) as f64 / (us as f64 * 1e-6) / 1e9;
                        line +=
                            &format!(" | {name} {us:.2} us {gbs:.0} GB/s ({:.0}%)", gbs / copy_gbs * 100.0);
                    }
                    Err(e) => {
                        line += &format!(" | {name}: {e}");
                        be.lock().error.take();
                    }
                }
            }
            lines.push(line);
        }
    }
    be.lock().gemm.set_reduction_mask(None);
    Ok(lines)
}

/// What a GEMM of a row count not seen before costs the host, as every mixed
/// step brings (a prompt's chunk beside the decodes; `cuda_check
/// --bench-gemm`): 32 new row counts of one row bucket, each the heuristic's
/// query, or the bucket's algorithm once cuBLASLt confirms it (the first
/// shape of the bucket asks the heuristic either way), then the same shapes
/// again, planned. Host time a call (the input's bf16 conversion launch
/// included), and the wall time to the last GEMM's end.
pub fn bench_gemm_plans(be: &CudaBackend) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let rng = &mut Rng(12);
    let new_rows = 400..432usize; // row_bucket: 448, as the warm-up's 390
    for &(n, k) in &[(4096usize, 4096usize), (14336, 4096), (4096, 14336)] {
        let w = be.upload_weight(&bench_weight(rng, n, k))?;
        let x = be.alloc_act(ActShape { rows: 512, cols: k })?;
        put_gpu(be, &x, &rng.vec(512 * k, 1.0))?;
        let out = be.alloc_act(ActShape { rows: 512, cols: n })?;
        let calls = new_rows.len() as f64;
        let run = |rows: std::ops::Range<usize>| -> Result<(f64, f64)> {
            be.synchronize()?;
            let t = Instant::now();
            for m in rows {
                be.matmul_op("bench", |st| be.matmul_lt(st, &x, &w, m, &out));
            }
            let host = t.elapsed().as_secs_f64();
            be.synchronize()?;
            be.check()?;
            Ok((host * 1e6 / calls, t.elapsed().as_secs_f64() * 1e3))
        };
        let mut line = format!("gemm plans bf16 {n}x{k}, rows {}..{}", new_rows.start, new_rows.end - 1);
        for (name, share) in [("heuristic each", false), ("bucket's algorithm", true)] {
            be.lock().gemm.share_algos(share);
            run(390..391)?;
            let (host, wall) = run(new_rows.clone())?;
            let (host2, wall2) = run(new_rows.clone())?;
            line += &format!(
                " | {name}: new {host:.0} us a call ({wall:.2} ms in all), planned {host2:.0} us ({wall2:.2} ms)"
            );
        }
        lines.push(line);
    }
    be.lock().gemm.share_algos(false);
    Ok(lines)
}

/// A decode layer's integer GEMVs on Q4_K weights of the Llama-3-8B shapes,
/// the launches as they were and as they are (`cuda_check --bench-q8-layer`):
/// each variant starts from an input quantized by `q8_quantize` and ends
/// with every output written. "one group": a block reads one group of
/// weight rows; "groups": as many as fill the card once; "fused": q/k/v in
/// one launch, gate/up with the SiLU product and its quantization in one.
pub fn bench_q8_layer(be: &CudaBackend, graph_id: &mut usize) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let mut rng = Rng(13);
    let (hidden, ff, kv) = (4096usize, 14336usize, 1024usize);
    let mk = |rng: &mut Rng, n: usize, k: usize| -> Result<Vec<CudaWeight>> {
        weight_copies(be, &quant_tensor(rng, DType::Q4_K, n, k))
    };
    let (wq, wk, wv, wo) = (
        mk(&mut rng, hidden, hidden)?,
        mk(&mut rng, kv, hidden)?,
        mk(&mut rng, kv, hidden)?,
        mk(&mut rng, hidden, hidden)?,
    );
    let (wg, wu, wd) = (mk(&mut rng, ff, hidden)?, mk(&mut rng, ff, hidden)?, mk(&mut rng, hidden, ff)?);
    let copies = wq.len().min(wg.len()).min(wd.len()).min(wk.len());
    let rows_max = Q8_GEMV_MAX_ROWS;
    let x = be.alloc_act(ActShape { rows: rows_max, cols: hidden })?;
    put_gpu(be, &x, &rng.vec(rows_max * hidden, 1.0))?;
    let a = |cols| be.alloc_act(ActShape { rows: rows_max, cols });
    let (q, k, v, o) = (a(hidden)?, a(kv)?, a(kv)?, a(hidden)?);
    let (g, u, mut act, mut down) = (a(ff)?, a(ff)?, a(ff)?, a(hidden)?);
    be.set_mmvq_pipe(Some(false));
    for rows in [1usize, 2, 4] {
        let mut time = |what: &str, groups: usize, f: &mut dyn FnMut(usize)| -> Result<()> {
            *graph_id += 1;
            be.set_mmvq_groups(groups);
            let ms = graph_time_ms(be, *graph_id, 20, || {
                for c in 0..copies {
                    f(c);
                }
            });
            be.set_mmvq_groups(0);
            let us = ms? / copies as f32 * 1e3;
            lines.push(format!("q8 layer Q4_K rows {rows}: {what}: {us:.1} us"));
            Ok(())
        };
        // Quantize x afresh (the holds forgotten), then `f` on that input.
        let fresh = |f: &mut dyn FnMut(&mut super::State, super::matmul::Q8Input) -> Result<()>| {
            be.op("bench", |st| {
                st.xq_holds = None;
                let input = be.q8_input(st, &x, rows)?;
                f(st, input)
            })
        };
        for (what, groups) in
            [("q/k/v, one group a block, 3 launches", 1usize), ("q/k/v, groups, 3 launches", 0)]
        {
            time(what, groups, &mut |c| {
                fresh(&mut |st, i| {
                    be.gemv_q8(st, i, &wq[c], rows, &q)?;
                    be.gemv_q8(st, i, &wk[c], rows, &k)?;
                    be.gemv_q8(st, i, &wv[c], rows, &v)
                })
            })?;
        }
        // The fused launches on registers, then (one row) pipelined.
        let pipes: &[bool] = if rows == 1 { &[false, true] } else { &[false] };
        for &pipe in pipes {
            be.set_mmvq_pipe(Some(pipe));
            let tag = if pipe { ", pipelined" } else { "" };
            time(&format!("q/k/v fused{tag}"), 0, &mut |c| {
                fresh(&mut |st, i| {
                    be.mmvq(
                        st,
                        i,
                        &[(&wq[c], 0, q.ptr()), (&wk[c], 0, k.ptr()), (&wv[c], 0, v.ptr())],
                        rows,
                        None,
                    )
                })
            })?;
            time(&format!("o, groups{tag}"), 0, &mut |c| {
                fresh(&mut |st, i| be.gemv_q8(st, i, &wo[c], rows, &o))
            })?;
            time(&format!("gate/up/SiLU fused (groups), quantize, down{tag}"), 0, &mut |c| {
                fresh(&mut |st, i| be.mmvq(st, i, &[(&wg[c], 0, act.ptr())], rows, Some((&wu[c], false))));
                be.lock().xq_holds = None;
                be.matmul(&act, &wd[c], None, rows, &mut down);
            })?;
        }
        be.set_mmvq_pipe(Some(false));
        time("o, one group a block", 1, &mut |c| fresh(&mut |st, i| be.gemv_q8(st, i, &wo[c], rows, &o)))?;
        for (what, groups) in
            [("gate, up, SiLU, quantize, down: one group a block", 1usize), ("the same, groups", 0)]
        {
            time(what, groups, &mut |c| {
                fresh(&mut |st, i| {
                    be.gemv_q8(st, i, &wg[c], rows, &g)?;
                    be.gemv_q8(st, i, &wu[c], rows, &u)
                });
                be.silu_mul(&g, &u, rows, &mut act);
                be.matmul(&act, &wd[c], None, rows, &mut down);
            })?;
        }
        time("gate/up/SiLU fused with the product quantized, down", 0, &mut |c| {
            fresh(&mut |st, i| be.mmvq(st, i, &[(&wg[c], 0, act.ptr())], rows, Some((&wu[c], true))));
            be.matmul(&act, &wd[c], None, rows, &mut down);
        })?;
    }
    be.set_mmvq_pipe(None);
    be.check()?;
    Ok(lines)
}

/// The block-format lines of [`bench`] alone (`cuda_check --bench-quant`);
/// `short`: only the formats of llama.cpp's Q4_K_M and Q8_0 files, on the
/// gate/up and k/v shapes (`--bench-quant-short`).
pub fn bench_quant(be: &CudaBackend, graph_id: &mut usize, short: bool) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let mut rng = Rng(11);
    let copy_gbs = 4300.0;
    // Block formats: bytes are the quantized bytes read. At each row count, what
    // `matmul` picks, and beside it the alternatives: the integer GEMV (up to
    // 8 rows; with the input's quantization, as a matmul runs it, and alone),
    // the per-row f32 GEMV (up to 8 rows), the mmq kernel and widening +
    // cuBLASLt.
    let (formats, shapes): (&[DType], &[(usize, usize)]) = if short {
        (&[DType::Q8_0, DType::Q4_K, DType::Q6_K], &[(1024, 4096), (14336, 4096)])
    } else {
        (
            &[DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q5_K, DType::Q6_K],
            &[(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)],
        )
    };
    for &dtype in formats {
        for &(n, k) in shapes {
            let t = quant_tensor(&mut rng, dtype, n, k);
            let bytes = t.data.len() as f64;
            let ws = weight_copies(be, &t)?;
            let x = be.alloc_act(ActShape { rows: 256, cols: k })?;
            put_gpu(be, &x, &rng.vec(256 * k, 1.0))?;
            let mut out = be.alloc_act(ActShape { rows: 256, cols: n })?;
            for rows in [1usize, 2, 4, 8, 16, 32, 64, 128, 256] {
                let mut time = |f: &mut dyn FnMut(&CudaWeight, &mut CudaAct)| -> Result<f32> {
                    *graph_id += 1;
                    Ok(graph_time_ms(be, *graph_id, 10, || {
                        for w in &ws {
                            f(w, &mut out);
                        }
                    })? / ws.len() as f32)
                };
                let picked = time(&mut |w, out| be.matmul(&x, w, None, rows, out))?;
                let pct = |ms: f32| bytes / (ms as f64 * 1e-3) / 1e9 / copy_gbs * 100.0;
                // "GB/s = % of the copy bandwidth".
                let bw = |ms: f32| format!("{:.0} GB/s = {:.0}%", bytes / (ms as f64 * 1e-3) / 1e9, pct(ms));
                let tflops = |ms: f32| 2.0 * (rows * n * k) as f64 / (ms as f64 * 1e-3) / 1e12;
                let mut line = format!(
                    "quant {dtype} {n}x{k} rows {rows}: matmul {picked:.4} ms {} of {copy_gbs:.0}, {:.1} TFLOP/s",
                    bw(picked),
                    tflops(picked)
                );
                if rows <= GEMV_MAX_ROWS && mmvq_index(dtype).is_some() {
                    let q = time(&mut |w, out| {
                        be.op("bench", |st| {
                            let input = be.q8_input(st, &x, rows)?;
                            be.gemv_q8(st, input, w, rows, out)
                        })
                    })?;
                    let mut input = None;
                    be.op("bench", |st| {
                        input = Some(be.q8_input(st, &x, rows)?);
                        Ok(())
                    });
                    be.check()?;
                    let input = input.ok_or_else(|| crate::BackendError::Other("8-bit input".into()))?;
                    let alone = time(&mut |w, out| be.op("bench", |st| be.gemv_q8(st, input, w, rows, out)))?;
                    be.set_mmvq_groups(1);
                    let one = time(&mut |w, out| be.op("bench", |st| be.gemv_q8(st, input, w, rows, out)));
                    be.set_mmvq_groups(0);
                    let one = one?;
                    line += &format!(
                        " | q8-gemv {q:.4} ms {} (alone {alone:.4} ms {}; a group a block {one:.4} ms {})",
                        bw(q),
                        bw(alone),
                        bw(one)
                    );
                    if rows == 1 {
                        be.set_mmvq_pipe(Some(!be.config.tuning.mmvq_pipe));
                        let other =
                            time(&mut |w, out| be.op("bench", |st| be.gemv_q8(st, input, w, rows, out)));
                        be.set_mmvq_pipe(None);
                        let other = other?;
                        let which = if be.config.tuning.mmvq_pipe { "on registers" } else { "pipelined" };
                        line += &format!(" | q8-gemv {which} alone {other:.4} ms {}", bw(other));
                    }
                }
                if rows <= GEMV_MAX_ROWS {
                    let g = time(&mut |w, out| be.op("bench", |_| be.gemv_simt(&x, w, rows, out)))?;
                    line += &format!(" | gemv {g:.4} ms {}", bw(g));
                }
                {
                    let m = time(&mut |w, out| be.op("bench", |st| be.mmq(st, &x, w, rows, out)))?;
                    let part = be.lock().tile.as_ref().map_or(0, |t| t.bytes().0 as usize);
                    let l = be.mmq_launch(&ws[0], rows, part)?;
                    line += &format!(
                        " | mmq {m:.4} ms {} {:.1} TFLOP/s ({} x {} rows, {}/SM, {} slices)",
                        bw(m),
                        tflops(m),
                        l.groups,
                        l.group_rows,
                        l.kern.per_sm,
                        l.slices
                    );
                }
                if rows >= 16 {
                    let lt = time(&mut |w, out| be.op("bench", |st| be.matmul_lt(st, &x, w, rows, out)))?;
                    line += &format!(" | widen+cuBLASLt {lt:.4} ms {:.0}%", pct(lt));
                }
                lines.push(line);
            }
        }
    }
    Ok(lines)
}

/// One decode row's attention alone (`cuda_check --bench-attention`): the
/// Llama-3-8B and Qwen3-30B-A3B shapes at the contexts of the served
/// benchmarks and longer, each kernel with its splits merged in the launch and
/// by a combine pass, replayed as a captured step.
pub fn bench_decode_attention(be: &CudaBackend) -> Result<Vec<String>> {
    let (mut lines, mut rng) = (Vec::new(), Rng(7));
    let tiled: &[PrefillPath] = &[PrefillPath::Tiled];
    for shape in [
        AttnBenchShape { name: "hd 128, 32/8 heads", heads: 32, kv_heads: 8, head_dim: 128 },
        AttnBenchShape { name: "hd 128, 32/4 heads", heads: 32, kv_heads: 4, head_dim: 128 },
    ] {
        let cases: &[(usize, usize, &[PrefillPath])] = &[(31, 1, tiled), (639, 1, tiled), (4095, 1, tiled)];
        attention_bench(be, &mut rng, &mut lines, &shape, cases)?;
        for rows in [8, 32, 128] {
            batch_attention_bench(be, &mut rng, &mut lines, &shape, rows, 639)?;
        }
    }
    Ok(lines)
}

/// Decode attention of a batch as a served step runs it: `rows` sequences
/// of one row each after `cached` tokens, each in pages of its own, eager
/// and captured (the splits sized for this context, and as a capture sizes
/// them), with the KV read rate.
fn batch_attention_bench(
    be: &CudaBackend,
    rng: &mut Rng,
    lines: &mut Vec<String>,
    shape: &AttnBenchShape,
    rows: usize,
    cached: usize,
) -> Result<()> {
    let (heads, kvw, hd) = (shape.heads, shape.kv_heads * shape.head_dim, shape.head_dim);
    let ctx = cached + 1;
    let per_seq = ctx.div_ceil(16);
    let geo = KvGeometry {
        page_size: Tokens(16),
        num_pages: Pages(rows * per_seq),
        kv_heads: shape.kv_heads,
        head_dim: hd,
    };
    let mut kv = be.alloc_kv(geo)?;
    let lists: Vec<Vec<PageId>> =
        (0..rows).map(|s| (0..per_seq).map(|p| PageId((s * per_seq + p) as u32)).collect()).collect();
    let kvv = be.alloc_act(ActShape { rows: ctx, cols: kvw })?;
    put_gpu(be, &kvv, &rng.vec(ctx * kvw, 1.0))?;
    for pages in &lists {
        be.write_kv(&mut kv, &kvv, &kvv, &[SeqStep { row_start: 0, rows: ctx, cached: 0, pages }]);
    }
    let q = be.alloc_act(ActShape { rows, cols: heads * hd })?;
    put_gpu(be, &q, &rng.vec(rows * heads * hd, 1.0))?;
    let mut out = be.alloc_act(ActShape { rows, cols: heads * hd })?;
    let seqs: Vec<SeqStep<'_>> =
        lists.iter().enumerate().map(|(s, pages)| SeqStep { row_start: s, rows: 1, cached, pages }).collect();
    let (tokens, positions) = (vec![TokenId(1); rows], vec![cached as u32; rows]);
    let logit_rows: Vec<usize> = (0..rows).collect();
    be.begin_step(&StepPlan {
        tokens: &tokens,
        positions: &positions,
        seqs: &seqs,
        logit_rows: &logit_rows,
        state_slots: &[],
    })?;
    let eager = time_ms(be, 20, || be.attention(&q, &kv, heads, &seqs, &mut out))?;
    let id = 2 << 24 | shape.kv_heads << 16 | rows;
    let captured = graph_time_ms(be, id, 50, || be.attention(&q, &kv, heads, &seqs, &mut out))?;
    let bytes = (rows * ctx * kvw * 2 * 2) as f64;
    let rate = |ms: f32| bytes / (ms as f64 * 1e-3) / 1e9;
    lines.push(format!(
        "decode attention ({}) {rows} rows x ctx {ctx}: eager {:.1} us (KV {:.0} GB/s), captured {:.1} us (KV {:.0} GB/s)",
        shape.name,
        eager * 1e3,
        rate(eager),
        captured * 1e3,
        rate(captured)
    ));
    Ok(())
}

/// Micro-benchmarks against the H200 ceilings (~4.3 TB/s copy, ~800 TFLOP/s
/// bf16), measured again here: the copy bandwidth first.
///
/// GEMV lines give two numbers: "1 launch" is one launch between the events
/// (what the earlier benchmark printed; it includes the launch gap and, for
/// weights smaller than L2, reads from L2), "graph" is back-to-back launches
/// over copies of the weight larger than L2 together, replayed as a graph and
/// divided by the count (what a captured decode step sees).
pub fn bench(be: &CudaBackend) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    let mut rng = Rng(7);
    let mut graph_id = 0usize;
    {
        let bytes = 1usize << 30;
        let (src, dst) = (be.alloc_buf(bytes, Purpose::Workspace)?, be.alloc_buf(bytes, Purpose::Workspace)?);
        let ms = time_ms(be, 10, || {
            // SAFETY: two live buffers of `bytes` bytes on our stream.
            let r = unsafe { cu::memcpy_dtod_async(dst.ptr(), src.ptr(), bytes, be.stream.0) };
            if let Err(e) = r {
                be.lock().error.get_or_insert(cuda_err("cuMemcpyDtoDAsync", e));
            }
        })?;
        let gbs = (2 * bytes) as f64 / (ms as f64 * 1e-3) / 1e9;
        lines.push(format!("device copy 1 GiB: {ms:.3} ms, {gbs:.0} GB/s (read + write)"));
    }
    let copy_gbs = 4300.0;
    // One row against the small bf16 matrices of Qwen3-30B-A3B's attention (o_proj, q/k/v as one,
    // k, the router) and Llama-3-8B's q/k/v as one, with four-row blocks and as picked
    // (`gemv_bf16_parts`; the examples turn `--cuda-gemv-fill` on).
    for &(n, k) in &[(2048usize, 4096usize), (5120, 2048), (512, 2048), (128, 2048), (6144, 4096)] {
        let ws = weight_copies(be, &bench_weight(&mut rng, n, k))?;
        let x = be.alloc_act(ActShape { rows: 1, cols: k })?;
        put_gpu(be, &x, &rng.vec(k, 1.0))?;
        let out = be.alloc_act(ActShape { rows: 1, cols: n })?;
        let mut line = format!("gemv bf16 {n}x{k} 1 row (graph)");
        for narrow in [false, true] {
            be.gemv_narrow.store(narrow, std::sync::atomic::Ordering::Relaxed);
            graph_id += 1;
            let ms = graph_time_ms(be, graph_id, 20, || {
                for w in &ws {
                    be.op("bench", |_| be.gemv_simt(&x, w, 1, &out));
                }
            })? / ws.len() as f32;
            let gbs = (n * k * 2) as f64 / (ms as f64 * 1e-3) / 1e9;
            let name = if narrow { "as picked" } else { "4-row blocks" };
            line += &format!(" | {name} {:.2} us {gbs:.0} GB/s ({:.0}%)", ms * 1e3, gbs / copy_gbs * 100.0);
        }
        lines.push(line);
    }
    be.gemv_narrow.store(true, std::sync::atomic::Ordering::Relaxed);
    lines.extend(bench_gemm_schemes(be, &mut graph_id)?);
    // Llama-3-8B decode shapes: q/o, k/v, gate/up, down, lm_head.
    for &(n, k) in &[(4096usize, 4096usize), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)] {
        let ws = weight_copies(be, &bench_weight(&mut rng, n, k))?;
        let x = be.alloc_act(ActShape { rows: 8, cols: k })?;
        put_gpu(be, &x, &rng.vec(8 * k, 1.0))?;
        let mut out = be.alloc_act(ActShape { rows: 8, cols: n })?;
        let bytes = (n * k * 2) as f64;
        for rows in [1usize, 2, 3, 4, 6, 8] {
            // The per-row GEMV kernel itself, whichever path `matmul` picks for these rows.
            let gemv = |w: &CudaWeight, out: &mut CudaAct| be.op("bench", |_| be.gemv_simt(&x, w, rows, out));
            let one = time_ms(be, 50, || gemv(&ws[0], &mut out))?;
            graph_id += 1;
            let all = graph_time_ms(be, graph_id, 20, || {
                for w in &ws {
                    gemv(w, &mut out);
                }
            })? / ws.len() as f32;
            let gbs = bytes / (all as f64 * 1e-3) / 1e9;
            let one_gbs = bytes / (one as f64 * 1e-3) / 1e9;
            // cuBLASLt on the same rows (input rounded to bf16), to pick per shape.
            let lt = graph_time_ms(be, graph_id + 100_000, 20, || {
                be.op("bench", |st| {
                    for w in &ws {
                        be.matmul_lt(st, &x, w, rows, &out)?;
                    }
                    Ok(())
                })
            })? / ws.len() as f32;
            let lt_gbs = bytes / (lt as f64 * 1e-3) / 1e9;
            let tc = graph_time_ms(be, graph_id + 200_000, 20, || {
                for w in &ws {
                    be.op("bench", |_| be.gemv_tc(&x, w, rows, &out));
                }
            })? / ws.len() as f32;
            let tc_gbs = bytes / (tc as f64 * 1e-3) / 1e9;
            let picked = if !be.takes_gemv(&ws[0], rows) {
                ("cuBLASLt", lt_gbs)
            } else if be.takes_gemv_tc(&ws[0], rows) {
                ("gemv-tc", tc_gbs)
            } else {
                ("gemv", gbs)
            };
            lines.push(format!(
                "gemv bf16 {n}x{k} rows {rows}: matmul takes {} = {:.0}% | gemv graph {all:.4} ms {:.0}% (1 launch {one:.4} ms {:.0}%) | gemv-tc {tc:.4} ms {:.0}% | cuBLASLt {lt:.4} ms {:.0}%",
                picked.0,
                picked.1 / copy_gbs * 100.0,
                gbs / copy_gbs * 100.0,
                one_gbs / copy_gbs * 100.0,
                tc_gbs / copy_gbs * 100.0,
                lt_gbs / copy_gbs * 100.0,
            ));
        }
    }
    lines.extend(bench_quant(be, &mut graph_id, false)?);
    {
        let (m, n, k) = (4096usize, 14336usize, 4096usize);
        let w = be.upload_weight(&bench_weight(&mut rng, n, k))?;
        let x = be.alloc_act(ActShape { rows: m, cols: k })?;
        put_gpu(be, &x, &rng.vec(m * k, 1.0))?;
        let mut out = be.alloc_act(ActShape { rows: m, cols: n })?;
        let ms = time_ms(be, 20, || be.matmul(&x, &w, None, m, &mut out))?;
        let tf = 2.0 * (m * n * k) as f64 / (ms as f64 * 1e-3) / 1e12;
        lines.push(format!(
            "matmul (f32->bf16 + cuBLASLt) {m}x{k} · {n}x{k}: {ms:.3} ms, {tf:.0} TFLOP/s = {:.0}% of 800",
            tf / 8.0
        ));
    }
    // Attention: Llama-3-8B shapes (32 heads, 8 KV heads, head_dim 128).
    let llama = AttnBenchShape { name: "hd 128, 32/8 heads", heads: 32, kv_heads: 8, head_dim: 128 };
    let both: &[PrefillPath] = &[PrefillPath::Tiled, PrefillPath::SplitK];
    let cases: [(usize, usize, &[PrefillPath]); 6] = [
        (4095, 1, &[PrefillPath::Tiled]),
        (6000, 1, &[PrefillPath::Tiled]),
        (0, 2048, both),
        (0, 8192, both),
        (4096, 1024, both),
        (0, 512, &[PrefillPath::Tiled]),
    ];
    attention_bench(be, &mut rng, &mut lines, &llama, &cases)?;
    // Decode attention of Qwen3-30B-A3B (32 heads, 4 KV heads, head_dim 128) at the contexts of
    // its benchmark (512-token prompts) and a longer one.
    let moe = AttnBenchShape { name: "hd 128, 32/4 heads", heads: 32, kv_heads: 4, head_dim: 128 };
    attention_bench(
        be,
        &mut rng,
        &mut lines,
        &moe,
        &[(599, 1, &[PrefillPath::Tiled]), (3999, 1, &[PrefillPath::Tiled])],
    )?;
    // One full-attention layer of Qwen3.5-27B (24 heads, 4 KV heads, head_dim 256).
    let qwen = AttnBenchShape { name: "hd 256, 24/4 heads", heads: 24, kv_heads: 4, head_dim: 256 };
    attention_bench(be, &mut rng, &mut lines, &qwen, &[(0, 2048, both), (0, 8192, both)])?;
    delta_bench(be, &mut rng, &mut lines)?;
    moe_bench(be, &mut rng, &mut lines)?;
    lines.extend(bench_sample(be)?);
    Ok(lines)
}

/// Sampling on the device (`--bench-sample`): the kernel alone at 1 to 128
/// rows of a Llama-3 vocabulary, each of three parameter sets (device time
/// by events, no edits, so repeated runs see the same rows), against the
/// copy of the same rows to the host that it replaces.
pub fn bench_sample(be: &CudaBackend) -> Result<Vec<String>> {
    use crate::sample::{SampleRowSpec, SampledRows};
    let mut rng = Rng(7);
    let mut lines = Vec::new();
    let vocab = 128_256;
    for rows in [1usize, 8, 32, 128] {
        let act = be.alloc_act(ActShape { rows, cols: vocab })?;
        put_gpu(be, &act, &rng.vec(rows * vocab, 6.0))?;
        let shapes = [
            ("greedy", 0.0f32, 0u32, 1.0f32, 0.0f32),
            ("server defaults", 0.2, 0, 0.9, 0.05),
            ("temperature 1", 1.0, 0, 1.0, 0.0),
            ("top-k 40", 1.0, 40, 1.0, 0.0),
        ];
        for ((name, temperature, top_k, top_p, min_p), slices) in
            shapes.into_iter().flat_map(|s| [(s, false), (s, true)])
        {
            let specs: Vec<SampleRowSpec> = (0..rows as u32)
                .map(|r| draw_spec(r, (temperature, top_k, top_p, min_p), (r as f64 + 0.5) / rows as f64))
                .collect();
            let mut out = SampledRows::default();
            let mut act_mut = be.alloc_act(ActShape { rows, cols: vocab })?;
            // SAFETY: two live buffers of the same size on our stream.
            unsafe { cu::memcpy_dtod_async(act_mut.ptr(), act.ptr(), rows * vocab * 4, be.stream.0) }
                .map_err(|e| cuda_err("cuMemcpyDtoDAsync", e))?;
            be.set_sample_slices(Some(slices));
            let ms = time_ms(be, 10, || {
                if let Err(e) = be.sample_rows(&mut act_mut, &specs, &[], &mut out) {
                    be.lock().error.get_or_insert(e);
                }
            });
            be.set_sample_slices(None);
            let ms = ms?;
            let how = if slices { ", slices" } else { "" };
            lines.push(format!(
                "sample_rows {rows} x {vocab} ({name}{how}): {ms:.3} ms (launch to summaries on the host)"
            ));
        }
        let mut host = Vec::new();
        let ms = time_ms(be, 10, || be.read_rows(&act, rows, &mut host))?;
        lines.push(format!(
            "read_rows {rows} x {vocab} (the logits copy sampling on the device replaces): {ms:.3} ms"
        ));
    }
    Ok(lines)
}

/// The attention shape of one model's layer, for `attention_bench`.
struct AttnBenchShape {
    name: &'static str,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// Attention of one layer of `shape` for each (cached, rows) case, through
/// each of its prefill paths: one row is a decode step (KV read bandwidth),
/// more rows a prefill (useful TFLOP/s: the causal pairs' Q.K^T and P.V, not
/// what a kernel recomputes).
fn attention_bench(
    be: &CudaBackend,
    rng: &mut Rng,
    lines: &mut Vec<String>,
    shape: &AttnBenchShape,
    cases: &[(usize, usize, &[PrefillPath])],
) -> Result<()> {
    let (heads, kvw, hd) = (shape.heads, shape.kv_heads * shape.head_dim, shape.head_dim);
    let geo =
        KvGeometry { page_size: Tokens(16), num_pages: Pages(600), kv_heads: shape.kv_heads, head_dim: hd };
    let mut kv = be.alloc_kv(geo)?;
    let pages: Vec<PageId> = (0..512u32).map(|i| PageId((i * 7) % 600)).collect();
    for &(cached, rows, paths) in cases {
        let q = be.alloc_act(ActShape { rows, cols: heads * hd })?;
        put_gpu(be, &q, &rng.vec(rows * heads * hd, 1.0))?;
        let seqs = [SeqStep { row_start: 0, rows, cached, pages: &pages }];
        // The whole context in the cache: the cached part and this step's rows.
        let ctx = cached + rows;
        let kvv = be.alloc_act(ActShape { rows: ctx, cols: kvw })?;
        put_gpu(be, &kvv, &rng.vec(ctx * kvw, 1.0))?;
        be.write_kv(&mut kv, &kvv, &kvv, &[SeqStep { row_start: 0, rows: ctx, cached: 0, pages: &pages }]);
        let mut out = be.alloc_act(ActShape { rows, cols: heads * hd })?;
        if rows == 1 {
            // Replayed as a captured step replays it, through the tile kernel and the per-warp
            // one, with the splits merged in the launch and by a combine pass.
            let mut line = format!("decode attention ({}) ctx {ctx} (graph)", shape.name);
            // The splits as a captured step sizes them (for the longest context), for this
            // context, and none (one block per group of heads walks the whole context).
            let merge = be.lock().attn_merge;
            let set = |tiles, merged, split_ctx| {
                let mut st = be.lock();
                (st.decode_tiles, st.attn_merge, st.split_ctx_override) = (tiles, merged, split_ctx);
            };
            let variants: [(bool, bool, Option<usize>); 7] = [
                (true, true, None),
                (true, false, None),
                (true, false, Some(ctx)),
                (true, false, Some(1)),
                (false, true, None),
                (false, false, None),
                (false, false, Some(ctx)),
            ];
            for (i, &(tiles, merged, split_ctx)) in variants.iter().enumerate() {
                set(tiles, merged, split_ctx);
                let id = 1 << 24 | shape.kv_heads << 16 | ctx << 3 | i;
                let ms = graph_time_ms(be, id, 50, || be.attention(&q, &kv, heads, &seqs, &mut out));
                set(true, merge, None);
                let ms = ms?;
                let gbs = (ctx * kvw * 2 * 2) as f64 / (ms as f64 * 1e-3) / 1e9;
                let kind = if tiles { "tiles" } else { "per warp" };
                let how = if merged { "merged" } else { "+ combine" };
                let splits = match split_ctx {
                    None => "captured splits",
                    Some(1) => "one split",
                    Some(_) => "splits for ctx",
                };
                line += &format!(" | {kind} {how}, {splits} {:.2} us, KV {gbs:.0} GB/s", ms * 1e3);
            }
            lines.push(line);
        }
        for &path in paths {
            be.lock().prefill = path;
            let reps = if path == PrefillPath::SplitK && rows > 2048 { 3 } else { 20 };
            let ms = time_ms(be, reps, || be.attention(&q, &kv, heads, &seqs, &mut out));
            be.lock().prefill = PrefillPath::Tiled;
            let ms = ms?;
            let name = shape.name;
            if rows == 1 {
                let gbs = (ctx * kvw * 2 * 2) as f64 / (ms as f64 * 1e-3) / 1e9;
                lines.push(format!("decode attention ({name}) ctx {ctx}: {ms:.4} ms, KV read {gbs:.0} GB/s"));
            } else {
                // Causal: row i (position cached + i) attends to cached + i + 1 keys.
                let pairs = (rows * cached + rows * (rows + 1) / 2) as f64;
                let flops = 4.0 * (heads * hd) as f64 * pairs;
                lines.push(format!(
                    "prefill attention ({name}) {rows} tokens after {cached} cached ({path:?}): {ms:.3} ms, {:.1} TFLOP/s",
                    flops / (ms as f64 * 1e-3) / 1e12
                ));
            }
        }
    }
    Ok(())
}

/// One Qwen3.5-27B linear-attention layer's state path (the convolution and
/// the delta rule, 16 key / 48 value heads of 128) at decode batches and
/// prefill lengths; the state bytes read and written per step give the
/// decode floor.
fn delta_bench(be: &CudaBackend, rng: &mut Rng, lines: &mut Vec<String>) -> Result<()> {
    let g = DeltaGeometry {
        k_heads: 16,
        v_heads: 48,
        k_dim: 128,
        v_dim: 128,
        conv_kernel: 4,
        v_order: VHeadOrder::Grouped,
    };
    let w = delta_weights(rng, g);
    let mut l = DeltaLayer::new(be, g, 32, [&w[0], &w[1], &w[2]])?;
    let pages = [PageId(0)];
    for &(seqs_n, rows_each) in &[(1usize, 1usize), (32, 1), (1, 2048), (1, 8192)] {
        let rows = seqs_n * rows_each;
        let x = be.alloc_act(ActShape { rows, cols: g.conv_channels() })?;
        put_gpu(be, &x, &rng.vec(rows * g.conv_channels(), 1.0))?;
        let a = be.alloc_act(ActShape { rows, cols: g.v_heads })?;
        put_gpu(be, &a, &rng.vec(rows * g.v_heads, 1.0))?;
        let b = be.alloc_act(ActShape { rows, cols: g.v_heads })?;
        put_gpu(be, &b, &rng.vec(rows * g.v_heads, 1.0))?;
        let mut x = x;
        let mut out = be.alloc_act(ActShape { rows, cols: g.value_width() })?;
        let seqs: Vec<SeqStep> = (0..seqs_n)
            .map(|i| SeqStep { row_start: i * rows_each, rows: rows_each, cached: 100, pages: &pages })
            .collect();
        let slots: Vec<StateSlot> = (0..seqs_n as u32).map(StateSlot).collect();
        let run = |x: &mut CudaAct, out: &mut CudaAct, l: &mut DeltaLayer<CudaBackend>| {
            let r = be.causal_conv_silu(x, &l.conv_w, &mut l.conv, &seqs, &slots).and_then(|_| {
                be.gated_delta_rule(DeltaRule {
                    qkv: x,
                    a: &a,
                    b: &b,
                    decay: &l.decay,
                    dt_bias: &l.dt_bias,
                    geometry: g,
                    state: &mut l.rec,
                    seqs: &seqs,
                    slots: &slots,
                    out,
                })
            });
            if let Err(e) = r {
                be.lock().error.get_or_insert(e);
            }
        };
        let reps = if rows > 2048 { 3 } else { 20 };
        let ms = time_ms(be, reps, || run(&mut x, &mut out, &mut l))?;
        // Each sequence reads and writes its recurrent and convolution state once.
        let state = (seqs_n * (g.recurrent_state_elems() + g.conv_state_elems()) * 4 * 2) as f64;
        let acts = (rows * (2 * g.conv_channels() + 2 * g.v_heads + g.value_width()) * 4) as f64;
        let gbs = (state + acts) / (ms as f64 * 1e-3) / 1e9;
        lines.push(format!(
            "delta-net layer (27B heads) {seqs_n} x {rows_each} rows: {ms:.4} ms, state + activations {gbs:.0} GB/s, {:.2} us per token of a sequence",
            ms as f64 * 1e3 / rows_each as f64
        ));
    }
    // The delta rule alone on a prompt continuing a cached state, by the scan
    // and by the chunked form (what a prefill step takes).
    for rows in [2048usize, 8192] {
        let mut put = |cols: usize, scale: f32| -> Result<CudaAct> {
            let act = be.alloc_act(ActShape { rows, cols })?;
            put_gpu(be, &act, &rng.vec(rows * cols, scale))?;
            Ok(act)
        };
        let (x, a, b) = (put(g.conv_channels(), 1.0)?, put(g.v_heads, 1.0)?, put(g.v_heads, 1.0)?);
        let mut out = be.alloc_act(ActShape { rows, cols: g.value_width() })?;
        let seqs = [SeqStep { row_start: 0, rows, cached: 100, pages: &pages }];
        let slots = [StateSlot(0)];
        let mut per_token = Vec::new();
        let configured = be.lock().delta_prefill;
        for path in [DeltaPrefill::Scan, DeltaPrefill::Chunked] {
            be.lock().delta_prefill = path;
            let ms = time_ms(be, if rows > 2048 { 3 } else { 10 }, || {
                let r = be.gated_delta_rule(DeltaRule {
                    qkv: &x,
                    a: &a,
                    b: &b,
                    decay: &l.decay,
                    dt_bias: &l.dt_bias,
                    geometry: g,
                    state: &mut l.rec,
                    seqs: &seqs,
                    slots: &slots,
                    out: &mut out,
                });
                if let Err(e) = r {
                    be.lock().error.get_or_insert(e);
                }
            });
            be.lock().delta_prefill = configured;
            per_token.push(ms? as f64 * 1e3 / rows as f64);
        }
        lines.push(format!(
            "delta rule (27B heads) prompt of {rows}: scan {:.3} us, chunked {:.3} us per token ({:.1}x)",
            per_token[0],
            per_token[1],
            per_token[0] / per_token[1]
        ));
    }
    Ok(())
}

/// One gated delta-net scenario: the layer's heads and a run of steps, each
/// a list of (state slot, rows, cached) sequences, over a pool of slots.
struct DeltaCase<'a> {
    name: &'a str,
    geometry: DeltaGeometry,
    slots: usize,
    steps: &'a [&'a [(u32, usize, usize)]],
}

/// A delta-net layer's state path on one backend: its weights and its slots.
struct DeltaLayer<B: Backend> {
    conv_w: B::Weight,
    decay: B::Weight,
    dt_bias: B::Weight,
    conv: B::Act,
    rec: B::Act,
}

/// Copies host values into an activation of backend `B`.
type Upload<'a, B> = &'a dyn Fn(&mut <B as Backend>::Act, &[f32]) -> Result<()>;

/// One step's inputs, the same on both backends.
struct DeltaInputs<'a> {
    qkv: &'a [f32],
    a: &'a [f32],
    b: &'a [f32],
    seqs: &'a [SeqStep<'a>],
    slots: &'a [StateSlot],
}

impl<B: Backend> DeltaLayer<B> {
    fn new(b: &B, g: DeltaGeometry, slots: usize, w: [&HostTensor; 3]) -> Result<Self> {
        Ok(DeltaLayer {
            conv_w: b.upload_weight(w[0])?,
            decay: b.upload_weight(w[1])?,
            dt_bias: b.upload_weight(w[2])?,
            conv: b.alloc_act(ActShape { rows: slots, cols: g.conv_state_elems() })?,
            rec: b.alloc_act(ActShape { rows: slots, cols: g.recurrent_state_elems() })?,
        })
    }

    /// The convolution, then the delta rule: (the convolved qkv rows, the rule's output rows).
    fn step(
        &mut self,
        b: &B,
        g: DeltaGeometry,
        inp: &DeltaInputs<'_>,
        upload: Upload<'_, B>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let rows = inp.qkv.len() / g.conv_channels();
        let mut x = b.alloc_act(ActShape { rows, cols: g.conv_channels() })?;
        let mut a = b.alloc_act(ActShape { rows, cols: g.v_heads })?;
        let mut bb = b.alloc_act(ActShape { rows, cols: g.v_heads })?;
        let mut out = b.alloc_act(ActShape { rows, cols: g.value_width() })?;
        upload(&mut x, inp.qkv)?;
        upload(&mut a, inp.a)?;
        upload(&mut bb, inp.b)?;
        b.causal_conv_silu(&mut x, &self.conv_w, &mut self.conv, inp.seqs, inp.slots)?;
        b.gated_delta_rule(DeltaRule {
            qkv: &x,
            a: &a,
            b: &bb,
            decay: &self.decay,
            dt_bias: &self.dt_bias,
            geometry: g,
            state: &mut self.rec,
            seqs: inp.seqs,
            slots: inp.slots,
            out: &mut out,
        })?;
        let (mut xs, mut os) = (Vec::new(), Vec::new());
        b.read_rows(&x, rows, &mut xs);
        b.read_rows(&out, rows, &mut os);
        b.check()?;
        Ok((xs, os))
    }

    fn states(&self, b: &B, slots: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut c, mut r) = (Vec::new(), Vec::new());
        b.read_rows(&self.conv, slots, &mut c);
        b.read_rows(&self.rec, slots, &mut r);
        b.check()?;
        Ok((c, r))
    }
}

/// The gated delta-net ops against the CPU: the sigmoid gate and the gated
/// norm alone, then the convolution and the delta rule over runs of steps
/// that carry state across steps (prefill, chunks, decode), put a new
/// sequence in a slot that held another, and mix both in one step, at the
/// Qwen3.5-27B head sizes (16 key heads and 48 value heads of 128) and at
/// others that take every kernel instantiation and partial tiles.
fn delta_checks(be: &CudaBackend, cpu: &CpuBackend, rep: &mut CheckReport, rng: &mut Rng) -> Result<()> {
    // The sigmoid gate and the gated norm (head sizes of the tiny fixture and of the 27B).
    for &(rows, hd, heads) in &[(5usize, 16usize, 4usize), (3, 128, 48)] {
        let cols = hd * heads;
        let mut x = pair(be, cpu, rows, cols, Some(&rng.vec(rows * cols, 2.0)))?;
        let gate = pair(be, cpu, rows, cols, Some(&rng.vec(rows * cols, 4.0)))?;
        be.sigmoid_mul(&mut x.g, &gate.g, rows - 1)?;
        cpu.sigmoid_mul(&mut x.c, &gate.c, rows - 1)?;
        let (a, b) = read_both(be, cpu, &x, rows)?;
        rep.compare(&format!("sigmoid_mul {rows}x{cols} (last row untouched)"), &a, &b, EXACT);
        let w = float_tensor("n", DType::F32, 1, hd, &rng.vec(hd, 1.0));
        let (wg, wc) = (be.upload_weight(&w)?, cpu.upload_weight(&w)?);
        be.gated_rms_norm(&mut x.g, &gate.g, &wg, 1e-6, hd, rows)?;
        cpu.gated_rms_norm(&mut x.c, &gate.c, &wc, 1e-6, hd, rows)?;
        let (a, b) = read_both(be, cpu, &x, rows)?;
        rep.compare(&format!("gated_rms_norm {rows}x{heads} heads of {hd}"), &a, &b, EXACT);
    }

    let geo = |k_heads, v_heads, k_dim, v_dim, conv_kernel, v_order| DeltaGeometry {
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        conv_kernel,
        v_order,
    };
    let cases = [
        DeltaCase {
            name: "tiny fixture heads (2 key / 4 value of 16), prefill, decode, a chunk",
            geometry: geo(2, 4, 16, 16, 4, VHeadOrder::Grouped),
            slots: 2,
            steps: &[
                &[(1, 7, 0)],
                &[(1, 1, 7)],
                &[(1, 1, 8)],
                &[(1, 1, 9)],
                &[(1, 5, 10)],
                &[(1, 2, 15)],
                // Whole staging chunks of the delta rule (8 tokens).
                &[(1, 8, 17)],
                &[(1, 16, 25)],
            ],
        },
        // The hybrid fixture's calls as the model makes them in corridor-gpu-check.
        DeltaCase {
            name: "tiny fixture heads, the 21-token prompt whole, then decode",
            geometry: geo(2, 4, 16, 16, 4, VHeadOrder::Grouped),
            slots: 2,
            steps: &[&[(1, 21, 0)], &[(1, 1, 21)], &[(1, 1, 22)]],
        },
        DeltaCase {
            name: "tiny fixture heads, the 21-token prompt in chunks of 2, 1, 7, 5, 6",
            geometry: geo(2, 4, 16, 16, 4, VHeadOrder::Grouped),
            slots: 2,
            steps: &[&[(1, 2, 0)], &[(1, 1, 2)], &[(1, 7, 3)], &[(1, 5, 10)], &[(1, 6, 15)]],
        },
        DeltaCase {
            name: "tiny fixture heads, 3 sequences in slots 2, 0, 3 decoded together, reordered each step",
            geometry: geo(2, 4, 16, 16, 4, VHeadOrder::Grouped),
            slots: 4,
            steps: &[
                &[(2, 7, 0)],
                &[(0, 12, 0)],
                &[(3, 3, 0)],
                &[(2, 1, 7), (0, 1, 12), (3, 1, 3)],
                &[(2, 1, 8), (3, 1, 4), (0, 1, 13)],
                &[(3, 1, 5), (2, 1, 9), (0, 1, 14)],
                &[(3, 1, 6), (0, 1, 15), (2, 1, 10)],
            ],
        },
        DeltaCase {
            name: "Qwen3.5-27B heads (16 key / 48 value of 128), two prompts, decode, a new sequence in a used slot",
            geometry: geo(16, 48, 128, 128, 4, VHeadOrder::Grouped),
            slots: 4,
            steps: &[
                &[(0, 37, 0), (3, 20, 0)],
                &[(0, 1, 37), (3, 1, 20)],
                // Slot 3 is reused by a new sequence while slot 0 decodes.
                &[(3, 9, 0), (0, 1, 38)],
                &[(0, 1, 39), (3, 1, 9)],
                &[(3, 1, 10), (2, 3, 0), (0, 1, 40)],
            ],
        },
        DeltaCase {
            name: "Qwen3.5-27B heads, one long prompt in chunks (several convolution passes), then decode",
            geometry: geo(16, 48, 128, 128, 4, VHeadOrder::Grouped),
            slots: 1,
            steps: &[&[(0, 150, 0)], &[(0, 67, 150)], &[(0, 1, 217)], &[(0, 1, 218)]],
        },
        // The chunked form's edges (chunks of DELTA_CHUNK_ROWS = 16): prompts of 1,
        // 15, 16, 17 and 53 rows in one launch, from zeros and on a cached state.
        DeltaCase {
            name: "Qwen3.5-27B heads, prompts of 1, 15, 16, 17, 53 rows in one step, each continued",
            geometry: geo(16, 48, 128, 128, 4, VHeadOrder::Grouped),
            slots: 5,
            steps: &[
                &[(0, 1, 0), (1, 15, 0), (2, 16, 0), (3, 17, 0), (4, 53, 0)],
                &[(4, 1, 53), (0, 53, 1), (1, 17, 15), (2, 16, 16), (3, 15, 17)],
            ],
        },
        DeltaCase {
            name: "Qwen3.5-27B heads, a 2048-token prompt, 300 more on its state, then decode",
            geometry: geo(16, 48, 128, 128, 4, VHeadOrder::Grouped),
            slots: 2,
            steps: &[&[(1, 2048, 0)], &[(1, 300, 2048)], &[(1, 1, 2348)]],
        },
        DeltaCase {
            name: "key heads of 256, tiled value heads, v_dim 96 (a partial tile), 3 taps",
            geometry: geo(2, 6, 256, 96, 3, VHeadOrder::Tiled),
            slots: 3,
            steps: &[&[(2, 33, 0), (0, 2, 0)], &[(2, 1, 33), (0, 1, 2)], &[(0, 4, 3)]],
        },
        DeltaCase {
            name: "key heads of 64 (2 warps), v_dim 40, 2 taps, a batch of 5 decodes",
            geometry: geo(1, 3, 64, 40, 2, VHeadOrder::Grouped),
            slots: 6,
            steps: &[
                &[(5, 3, 0), (1, 1, 0), (2, 6, 0), (3, 2, 0), (0, 12, 0)],
                &[(5, 1, 3), (1, 1, 1), (2, 1, 6), (3, 1, 2), (0, 1, 12)],
                &[(5, 1, 4), (1, 1, 2), (2, 1, 7), (3, 1, 3), (0, 1, 13)],
            ],
        },
        DeltaCase {
            name: "key heads of 40 (odd, 2 warps), 6 taps, a prompt shorter than the window then longer chunks",
            geometry: geo(2, 2, 40, 24, 6, VHeadOrder::Grouped),
            slots: 2,
            steps: &[&[(1, 2, 0)], &[(1, 1, 2)], &[(1, 70, 3)], &[(1, 3, 73)]],
        },
    ];
    // Every case through both kernels of the delta rule: the chunked form (for
    // steps with a sequence of CHUNKED_MIN_ROWS rows or more; k_dim up to 128)
    // and the scan for everything.
    let configured = be.lock().delta_prefill;
    for path in [DeltaPrefill::Chunked, DeltaPrefill::Scan] {
        be.lock().delta_prefill = path;
        for c in &cases {
            let r = delta_case(be, cpu, rep, rng, c, path);
            if r.is_err() {
                be.lock().delta_prefill = configured;
            }
            r?;
        }
    }
    be.lock().delta_prefill = configured;

    // Refusals: a slot shared by two sequences, a slot outside the pool.
    let g = cases[0].geometry;
    let w = delta_weights(rng, g);
    let mut l = DeltaLayer::new(be, g, 2, [&w[0], &w[1], &w[2]])?;
    let mut x = be.alloc_act(ActShape { rows: 2, cols: g.conv_channels() })?;
    let pages = [PageId(0)];
    let seqs = [
        SeqStep { row_start: 0, rows: 1, cached: 0, pages: &pages },
        SeqStep { row_start: 1, rows: 1, cached: 0, pages: &pages },
    ];
    let shared = be.causal_conv_silu(&mut x, &l.conv_w, &mut l.conv, &seqs, &[StateSlot(1), StateSlot(1)]);
    let outside = be.causal_conv_silu(&mut x, &l.conv_w, &mut l.conv, &seqs, &[StateSlot(0), StateSlot(2)]);
    rep.compare(
        "causal_conv_silu refuses a shared slot and one outside the pool",
        &[f32::from(shared.is_err()), f32::from(outside.is_err())],
        &[1.0, 1.0],
        EXACT,
    );
    be.check()?;
    Ok(())
}

/// A layer's convolution kernel (bf16 values, so both sides hold the same
/// numbers), decay rates (positive) and biases.
fn delta_weights(rng: &mut Rng, g: DeltaGeometry) -> [HostTensor; 3] {
    let c = g.conv_channels();
    let decay: Vec<f32> = (0..g.v_heads).map(|_| 0.05 + 1.5 * rng.f().abs()).collect();
    [
        float_tensor("conv", DType::BF16, c, g.conv_kernel, &rng.vec(c * g.conv_kernel, 0.6)),
        float_tensor("decay", DType::F32, 1, g.v_heads, &decay),
        float_tensor("dt_bias", DType::F32, 1, g.v_heads, &rng.vec(g.v_heads, 1.0)),
    ]
}

fn delta_case(
    be: &CudaBackend,
    cpu: &CpuBackend,
    rep: &mut CheckReport,
    rng: &mut Rng,
    c: &DeltaCase<'_>,
    path: DeltaPrefill,
) -> Result<()> {
    let g = c.geometry;
    let w = delta_weights(rng, g);
    let mut lg = DeltaLayer::new(be, g, c.slots, [&w[0], &w[1], &w[2]])?;
    let mut lc = DeltaLayer::new(cpu, g, c.slots, [&w[0], &w[1], &w[2]])?;
    let up_g = |a: &mut CudaAct, d: &[f32]| put_gpu(be, a, d);
    let up_c = |a: &mut CpuAct, d: &[f32]| {
        put_cpu(a, d);
        Ok(())
    };
    let pages = [PageId(0)];
    for (i, step) in c.steps.iter().enumerate() {
        let mut row = 0;
        let seqs: Vec<SeqStep> = step
            .iter()
            .map(|&(_, rows, cached)| {
                let s = SeqStep { row_start: row, rows, cached, pages: &pages };
                row += rows;
                s
            })
            .collect();
        let slots: Vec<StateSlot> = step.iter().map(|&(s, _, _)| StateSlot(s)).collect();
        let qkv = rng.vec(row * g.conv_channels(), 1.0);
        let (a, b) = (rng.vec(row * g.v_heads, 2.0), rng.vec(row * g.v_heads, 2.0));
        let inp = DeltaInputs { qkv: &qkv, a: &a, b: &b, seqs: &seqs, slots: &slots };
        let (xg, og) = lg.step(be, g, &inp, &up_g)?;
        let (xc, oc) = lc.step(cpu, g, &inp, &up_c)?;
        let shape: Vec<String> = step.iter().map(|&(s, r, k)| format!("slot {s}: {r} after {k}")).collect();
        rep.compare(
            &format!("causal_conv_silu, {}, step {i} [{}]", c.name, shape.join(", ")),
            &xg,
            &xc,
            EXACT,
        );
        rep.compare(&format!("gated_delta_rule ({path:?}), {}, step {i}", c.name), &og, &oc, SCAN);
    }
    let (cg, rg) = lg.states(be, c.slots)?;
    let (cc, rc) = lc.states(cpu, c.slots)?;
    rep.compare(&format!("convolution states left, {}", c.name), &cg, &cc, EXACT);
    rep.compare(&format!("recurrent states left ({path:?}), {}", c.name), &rg, &rc, SCAN);
    Ok(())
}

/// `cuda_check --bench-moe`: [`moe_bench`] alone.
pub fn bench_moe(be: &CudaBackend) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    moe_bench(be, &mut Rng(0x6d6f6562), &mut lines)?;
    Ok(lines)
}

/// One Qwen3-30B-A3B expert layer (hidden 2048, 128 experts of FFN 768,
/// top 8, random weights and inputs) with bf16 experts, then with those of a
/// Q4_K_M file (gate/up Q4_K, down Q6_K, on the routed integer GEMVs):
/// `moe_ffn` (router matmul included) at 1 and 32 rows as captured graphs,
/// at 2048 rows as launched. At 1 row the bytes read are the router and 8
/// experts; at 2048 rows the rate is the experts' FLOPs.
fn moe_bench(be: &CudaBackend, rng: &mut Rng, lines: &mut Vec<String>) -> Result<()> {
    let (hidden, ffn) = (2048usize, 768usize);
    let routing = crate::Routing { num_experts: 128, top_k: 8, norm_topk_prob: true };
    let rt = float_tensor(
        "router",
        DType::BF16,
        routing.num_experts,
        hidden,
        &rng.vec(routing.num_experts * hidden, 0.05),
    );
    let router = be.upload_weight(&rt)?;
    let zero = be.upload_weight(&float_tensor("zero", DType::F32, 1, hidden, &vec![0.0; hidden]))?;
    let max_rows = 2048;
    let shape = crate::MoeShape { max_rows, hidden, expert_ffn: ffn, routing };
    let mut sc = crate::MoeScratch::new(be, shape)?;
    let x = be.alloc_act(ActShape { rows: max_rows, cols: hidden })?;
    put_gpu(be, &x, &rng.vec(max_rows * hidden, 1.0))?;
    let mut out = be.alloc_act(ActShape { rows: max_rows, cols: hidden })?;
    // Q4_K/Q6_K twice: on the routed integer GEMVs, then on the any-type ones they replace.
    for (variant, (gu, dn), id, integer) in [
        ("bf16", (DType::BF16, DType::BF16), 300_001, true),
        ("Q4_K/Q6_K", (DType::Q4_K, DType::Q6_K), 300_011, true),
        ("Q4_K/Q6_K, any-type GEMVs", (DType::Q4_K, DType::Q6_K), 300_021, false),
    ] {
        let mk = |rng: &mut Rng, dtype: DType, rows: usize, cols: usize| {
            if dtype == DType::BF16 {
                bench_weight(rng, rows, cols)
            } else {
                quant_tensor(rng, dtype, rows, cols)
            }
        };
        let mut experts = Vec::with_capacity(routing.num_experts);
        for _ in 0..routing.num_experts {
            experts.push(crate::Expert {
                gate_proj: be.upload_weight(&mk(rng, gu, ffn, hidden))?,
                up_proj: be.upload_weight(&mk(rng, gu, ffn, hidden))?,
                down_proj: be.upload_weight(&mk(rng, dn, hidden, ffn))?,
            });
        }
        let table = be.expert_table(&experts)?;
        let table = if integer { table } else { table.without_integer_gemvs() };
        let mut run = |rows: usize| {
            let r = be.moe_ffn(crate::MoeFfn {
                x: &x,
                router: &router,
                experts: &experts,
                table: &table,
                routing,
                zero_row: &zero,
                rows,
                scratch: &mut sc,
                out: &mut out,
            });
            if let Err(e) = r {
                be.lock().error.get_or_insert(e);
            }
        };
        let bytes = |d: DType| d.bytes_for(ffn * hidden).unwrap_or(0) as f64;
        let expert_bytes = 2.0 * bytes(gu) + bytes(dn);
        let one = graph_time_ms(be, id, 50, || run(1))?;
        let read = routing.top_k as f64 * expert_bytes + (routing.num_experts * hidden * 2) as f64;
        lines.push(format!(
            "moe_ffn qwen3-30b-a3b {variant} layer, 1 row: {one:.4} ms, {:.0} GB/s of the {:.1} MB a token reads ({:.0}% of 4300)",
            read / (one as f64 * 1e-3) / 1e9,
            read / 1e6,
            read / (one as f64 * 1e-3) / 1e9 / 4300.0 * 100.0
        ));
        let b32 = graph_time_ms(be, id + 1, 20, || run(32))?;
        lines.push(format!(
            "moe_ffn qwen3-30b-a3b {variant} layer, 32 rows: {b32:.4} ms ({:.4} ms per row)",
            b32 / 32.0
        ));
        let pre = time_ms(be, 5, || run(2048))?;
        let flops = 2.0 * 2048.0 * routing.top_k as f64 * 3.0 * (ffn * hidden) as f64;
        lines.push(format!(
            "moe_ffn qwen3-30b-a3b {variant} layer, 2048 rows: {pre:.3} ms, {:.0} TFLOP/s in the experts",
            flops / (pre as f64 * 1e-3) / 1e12
        ));
        be.check()?;
    }
    Ok(())
}

/// How a MoE check case sets its router.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RouterKind {
    /// Every row is 4.0 in one of a few input columns (zero in the others),
    /// and each column ranks the experts in its own order, 0.25 apart in the
    /// logits, which are exact on both backends: the same experts and the
    /// same weights whatever the router matmul rounds; rows of one column
    /// share their experts.
    Spread,
    /// Experts `3i, 3i + 1, 3i + 2` have the same router row: their logits
    /// tie exactly on both backends, and the top k must break the ties
    /// towards the lower index.
    Triples,
    /// All router rows zero: every logit ties, every row takes experts
    /// `0..k` with equal weights (one expert gets every row).
    Flat,
}

/// One layer's experts and router on both backends.
struct MoeLayer {
    hidden: usize,
    ffn: usize,
    routing: crate::Routing,
    gpu: Vec<crate::Expert<CudaWeight>>,
    cpu: Vec<crate::Expert<crate::cpu::CpuWeight>>,
    table: super::CudaExperts,
    router: (CudaWeight, crate::cpu::CpuWeight),
    zero: (CudaWeight, crate::cpu::CpuWeight),
}

/// Columns the `Spread` router reads its ranking from.
fn spread_columns(hidden: usize) -> usize {
    (hidden / 4).clamp(1, 37)
}

fn moe_layer(
    be: &CudaBackend,
    cpu: &CpuBackend,
    rng: &mut Rng,
    (hidden, ffn): (usize, usize),
    routing: crate::Routing,
    (dtype, router_dtype): (DType, DType),
    router: RouterKind,
) -> Result<MoeLayer> {
    let e = routing.num_experts;
    let mk = |rng: &mut Rng, rows: usize, cols: usize| {
        if dtype.is_quantized() {
            quant_tensor(rng, dtype, rows, cols)
        } else {
            float_tensor("w", dtype, rows, cols, &rng.vec(rows * cols, 0.5 / (cols as f32).sqrt()))
        }
    };
    let (mut gpu, mut cpu_x) = (Vec::with_capacity(e), Vec::with_capacity(e));
    for _ in 0..e {
        let ts = [mk(rng, ffn, hidden), mk(rng, ffn, hidden), mk(rng, hidden, ffn)];
        gpu.push(crate::Expert {
            gate_proj: be.upload_weight(&ts[0])?,
            up_proj: be.upload_weight(&ts[1])?,
            down_proj: be.upload_weight(&ts[2])?,
        });
        cpu_x.push(crate::Expert {
            gate_proj: cpu.upload_weight(&ts[0])?,
            up_proj: cpu.upload_weight(&ts[1])?,
            down_proj: cpu.upload_weight(&ts[2])?,
        });
    }
    let cols = spread_columns(hidden);
    let mut w = vec![0f32; e * hidden];
    if router != RouterKind::Flat {
        for ex in 0..e {
            let src = if router == RouterKind::Triples { ex - ex % 3 } else { ex };
            let row = &mut w[ex * hidden..(ex + 1) * hidden];
            for (c, v) in row.iter_mut().take(cols).enumerate() {
                // A permutation of the experts per column (7 is prime to
                // every expert count checked), 1/16 apart: exact in bf16,
                // and so is each logit (one product of the input's 4.0,
                // zeros elsewhere), however a matmul orders its sums.
                *v = ((src * 7 + c * 13) % e) as f32 * 0.0625;
            }
        }
    }
    let rt = float_tensor("router", router_dtype, e, hidden, &w);
    let zt = float_tensor("zero", DType::F32, 1, hidden, &vec![0.0; hidden]);
    let table = be.expert_table(&gpu)?;
    Ok(MoeLayer {
        hidden,
        ffn,
        routing,
        table,
        router: (be.upload_weight(&rt)?, cpu.upload_weight(&rt)?),
        zero: (be.upload_weight(&zt)?, cpu.upload_weight(&zt)?),
        gpu,
        cpu: cpu_x,
    })
}

/// Inputs whose row `r` is 4.0 in one of the `Spread` router's ranking
/// columns (which one moves with `shift`, and so do the experts the row
/// takes), zero in the others, and noise past them (which the router ignores
/// and the experts read).
fn moe_input(rng: &mut Rng, rows: usize, hidden: usize, shift: usize) -> Vec<f32> {
    let cols = spread_columns(hidden);
    let mut x = rng.vec(rows * hidden, 0.05);
    for r in 0..rows {
        let row = &mut x[r * hidden..(r + 1) * hidden];
        row[..cols].fill(0.0);
        row[(r * 5 + r / cols + shift) % cols] = 4.0;
    }
    x
}

/// The CPU's unfused op and the device's, both paths, on the same rows.
fn moe_case(
    be: &CudaBackend,
    cpu: &CpuBackend,
    rep: &mut CheckReport,
    l: &MoeLayer,
    xs: &[f32],
    rows: usize,
    name: &str,
) -> Result<()> {
    let shape = crate::MoeShape { max_rows: rows, hidden: l.hidden, expert_ffn: l.ffn, routing: l.routing };
    let x = pair(be, cpu, rows, l.hidden, Some(xs))?;
    let mut out = pair(be, cpu, rows, l.hidden, None)?;
    // The CPU's op on `b` (its own activation rounding) over `rows` rows of
    // `x`, read back.
    let on_cpu = |b: &CpuBackend, x: &CpuAct, rows: usize, out: &mut CpuAct| -> Result<Vec<f32>> {
        let shape = crate::MoeShape { max_rows: rows, ..shape };
        let mut sc = crate::MoeScratch::new(b, shape)?;
        b.moe_ffn(crate::MoeFfn {
            x,
            router: &l.router.1,
            experts: &l.cpu,
            table: &(),
            routing: l.routing,
            zero_row: &l.zero.1,
            rows,
            scratch: &mut sc,
            out,
        })?;
        let mut got = Vec::new();
        b.read_rows(out, rows, &mut got);
        Ok(got)
    };
    let want = on_cpu(cpu, &x.c, rows, &mut out.c)?;
    // Block-format experts take 8-bit rows at decode: against the CPU's own
    // 8-bit decode. The CPU dots 8-bit rows only up to GEMV_MAX_ROWS rows an
    // expert, so past that the rows go through it in chunks of that many
    // (each row is routed and computed alone, so chunks change no value).
    let (want_q8, q8_tol) = if l.table.integer_gemvs() && rows <= super::moe::MOE_GEMV_MAX_ROWS {
        let q8 = CpuBackend::with_decode_activations(crate::cpu::DecodeActivations::Q8);
        let mut all = Vec::with_capacity(rows * l.hidden);
        for chunk in xs[..rows * l.hidden].chunks(GEMV_MAX_ROWS * l.hidden) {
            let n = chunk.len() / l.hidden;
            let shape = ActShape { rows: n, cols: l.hidden };
            let mut xc = q8.alloc_act(shape)?;
            put_cpu(&mut xc, chunk);
            let mut oc = q8.alloc_act(shape)?;
            all.extend(on_cpu(&q8, &xc, n, &mut oc)?);
        }
        (all, Q8_CHAIN)
    } else {
        (want.clone(), BF16)
    };
    let mut sg = crate::MoeScratch::new(be, shape)?;
    for path in [super::MoePath::Gemv, super::MoePath::Gemm] {
        // Something else first, so a launch that writes nothing shows.
        put_gpu(be, &out.g, &vec![f32::NAN; rows * l.hidden])?;
        be.moe_ffn_with(
            crate::MoeFfn {
                x: &x.g,
                router: &l.router.0,
                experts: &l.gpu,
                table: &l.table,
                routing: l.routing,
                zero_row: &l.zero.0,
                rows,
                scratch: &mut sg,
                out: &mut out.g,
            },
            path,
        )?;
        let mut got = Vec::new();
        be.read_rows(&out.g, rows, &mut got);
        be.check()?;
        // The routed GEMVs compute in f32 like the CPU (and the router's
        // logits are exact on both); the grouped GEMM rounds its inputs and
        // the SwiGLU output to bf16.
        let (want, tol) = match path {
            super::MoePath::Gemv if l.table.integer_gemvs() => (&want_q8, q8_tol),
            super::MoePath::Gemv => (&want, EXACT),
            super::MoePath::Gemm => (&want, BF16),
        };
        rep.compare(&format!("moe_ffn {name} {rows} rows ({path:?})"), &got, want, tol);
    }
    Ok(())
}

/// The routed expert FFN against the CPU's unfused op: the tiny fixture's
/// shape, odd widths (scalar tails), widths that send gate/up and down to
/// different GEMVs (the bf16 ones take rows of a multiple of 8),
/// Qwen3-30B-A3B's layer (hidden 2048, 128 experts, top 8, expert FFN 768),
/// block-format experts (the routed integer GEMVs at decode, against the
/// CPU's 8-bit decode), ties in the router, each at 1, 2, 3, 8, 64 and 300
/// rows on both kernel paths (the bf16 GEMVs' fused down at 1 and 2, their
/// one-pair kernels to 8, their four-pair ones beyond); then a captured
/// decode step replayed with new inputs.
/// A case that fails to run (a refused argument, a device fault) is counted
/// as a failure and the next one runs, so one run reports every case.
pub fn moe_checks(be: &CudaBackend, rep: &mut CheckReport) -> Result<()> {
    let cpu = CpuBackend::with_decode_activations(crate::cpu::DecodeActivations::F32);
    let mut rng = Rng(0x6d6f65);
    let r =
        |e: usize, k: usize, norm: bool| crate::Routing { num_experts: e, top_k: k, norm_topk_prob: norm };
    let cases: &[((usize, usize), crate::Routing, DType, RouterKind)] = &[
        ((64, 32), r(4, 2, true), DType::BF16, RouterKind::Spread),
        ((64, 32), r(4, 2, true), DType::BF16, RouterKind::Triples),
        ((100, 36), r(6, 3, false), DType::BF16, RouterKind::Spread),
        // gate/up on the bf16 GEMV and down on the any-type one, then the other way round.
        ((64, 36), r(4, 2, true), DType::BF16, RouterKind::Spread),
        ((102, 40), r(6, 3, false), DType::BF16, RouterKind::Triples),
        ((2048, 768), r(128, 8, true), DType::BF16, RouterKind::Spread),
        ((2048, 768), r(128, 8, true), DType::BF16, RouterKind::Triples),
        ((256, 96), r(16, 4, true), DType::BF16, RouterKind::Flat),
        ((256, 64), r(8, 2, true), DType::Q8_0, RouterKind::Spread),
        ((256, 256), r(8, 3, true), DType::Q4_K, RouterKind::Spread),
        ((256, 256), r(8, 3, true), DType::Q6_K, RouterKind::Triples),
        ((2048, 768), r(128, 8, true), DType::Q4_K, RouterKind::Spread),
    ];
    for &(dims, routing, dtype, router) in cases {
        let name = format!(
            "{dtype} hidden {} ffn {} {}x top {}{} {router:?}",
            dims.0,
            dims.1,
            routing.num_experts,
            routing.top_k,
            if routing.norm_topk_prob { " normed" } else { "" }
        );
        let l = match moe_layer(be, &cpu, &mut rng, dims, routing, (dtype, DType::BF16), router) {
            Ok(l) => l,
            Err(e) => {
                rep.refused(&format!("moe layer {name}"), Err(e));
                continue;
            }
        };
        rep.compare(
            &format!("moe expert table {name} on the device"),
            &[f32::from(u8::from(l.table.on_device()))],
            &[1.0],
            EXACT,
        );
        for rows in [1usize, 2, 3, 8, 64, 300] {
            let xs = moe_input(&mut rng, rows, dims.0, 0);
            let r = moe_case(be, &cpu, rep, &l, &xs, rows, &name);
            rep.refused(&format!("moe_ffn {name} {rows} rows"), r);
        }
    }
    let r = moe_graph_check(be, &cpu, rep, &mut rng);
    rep.refused("moe graph", r);
    Ok(())
}

/// A decode step's expert FFN captured once and replayed with new inputs
/// (at 1 row, with down and the sum fused, and at 5): nothing of the routing
/// may have been frozen into the capture. Then the tiny Qwen3-MoE GGUF's
/// layer as the device holds it (hidden 64, 4 experts of 32, top 2 normed;
/// f16 experts and an f32 router, both bf16 once uploaded, compared with a
/// CPU that stores them so too) in the steps the batched model check runs:
/// three sequences and a padding row, the sequences in another order each
/// round, captured once and replayed.
fn moe_graph_check(be: &CudaBackend, cpu: &CpuBackend, rep: &mut CheckReport, rng: &mut Rng) -> Result<()> {
    let routing = crate::Routing { num_experts: 16, top_k: 4, norm_topk_prob: true };
    let l = moe_layer(be, cpu, rng, (256, 128), routing, (DType::BF16, DType::BF16), RouterKind::Spread)?;
    for rows in [1, 5] {
        moe_graph_rounds(be, cpu, rep, rng, &l, (rows, false))?;
    }
    let bf16_cpu =
        cpu.clone().with_bf16_rounding(crate::cpu::Bf16Rounding { weights: true, kv: true, inputs: None });
    let routing = crate::Routing { num_experts: 4, top_k: 2, norm_topk_prob: true };
    let l = moe_layer(be, &bf16_cpu, rng, (64, 32), routing, (DType::F16, DType::F32), RouterKind::Spread)?;
    rep.compare(
        "moe expert table of f16 experts (the tiny GGUF's layer) on the device",
        &[f32::from(u8::from(l.table.on_device()))],
        &[1.0],
        EXACT,
    );
    moe_graph_rounds(be, &bf16_cpu, rep, rng, &l, (4, true))
}

/// A decode step as the batched model check (crates/gpu-check) feeds one:
/// three sequences' rows (each routed by its own input column, moved each
/// round) in another order each round, then a row of no sequence, zero in
/// the router's columns (its logits all tie: it takes experts 0..k) and
/// noise past them.
fn padded_step(rng: &mut Rng, hidden: usize, round: usize) -> Vec<f32> {
    let seqs = moe_input(rng, 3, hidden, 1 + 2 * round);
    let mut order: Vec<usize> = (0..3).map(|r| (r + round) % 3).collect();
    if round % 2 == 1 {
        order.reverse();
    }
    let mut x: Vec<f32> = order.iter().flat_map(|&i| seqs[i * hidden..(i + 1) * hidden].to_vec()).collect();
    let mut pad = rng.vec(hidden, 0.05);
    pad[..spread_columns(hidden)].fill(0.0);
    x.extend(pad);
    x
}

/// Rounds of one captured step of `rows` rows; `padded`: the rows are a
/// [`padded_step`] (`rows` must be 4).
fn moe_graph_rounds(
    be: &CudaBackend,
    cpu: &CpuBackend,
    rep: &mut CheckReport,
    rng: &mut Rng,
    l: &MoeLayer,
    (rows, padded): (usize, bool),
) -> Result<()> {
    let routing = l.routing;
    let shape = crate::MoeShape { max_rows: rows, hidden: l.hidden, expert_ffn: l.ffn, routing };
    let mut x = pair(be, cpu, rows, l.hidden, None)?;
    let mut out = pair(be, cpu, rows, l.hidden, None)?;
    let (mut sg, mut sc) = (crate::MoeScratch::new(be, shape)?, crate::MoeScratch::new(cpu, shape)?);
    // A key no other check captures under.
    let key = GraphKey { rows, logit_rows: 0 };
    let label = if padded { ", 3 sequences and a padding row, reordered" } else { "" };
    for round in 0..if padded { 4 } else { 3 } {
        // Each round routes every row to other experts than the last.
        let xs = if padded {
            padded_step(rng, l.hidden, round)
        } else {
            moe_input(rng, rows, l.hidden, 1 + 2 * round)
        };
        put_gpu(be, &x.g, &xs)?;
        put_cpu(&mut x.c, &xs);
        let replayed = be.graph_replay(key)?;
        if !replayed {
            let capturing = be.graph_capture_begin(key)?;
            let r = be.moe_ffn(crate::MoeFfn {
                x: &x.g,
                router: &l.router.0,
                experts: &l.gpu,
                table: &l.table,
                routing,
                zero_row: &l.zero.0,
                rows,
                scratch: &mut sg,
                out: &mut out.g,
            });
            if capturing {
                be.graph_capture_end(key)?;
            }
            r?;
        }
        cpu.moe_ffn(crate::MoeFfn {
            x: &x.c,
            router: &l.router.1,
            experts: &l.cpu,
            table: &(),
            routing,
            zero_row: &l.zero.1,
            rows,
            scratch: &mut sc,
            out: &mut out.c,
        })?;
        let (a, b) = read_both(be, cpu, &out, rows)?;
        rep.compare(
            &format!(
                "moe graph hidden {} {rows} rows{label}, round {round} ({})",
                l.hidden,
                if replayed { "replayed" } else { "captured" }
            ),
            &a,
            &b,
            EXACT,
        );
    }
    Ok(())
}
