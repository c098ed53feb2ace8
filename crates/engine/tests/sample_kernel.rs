//! The GPU's sampling kernel (crates/backend/kernels/sample.cu) against the
//! host sampler, without a GPU: the kernel's source is compiled for the host
//! by the C++ compiler (`sample_kernel/host.cpp` stands in for the CUDA
//! runtime: a thread per CUDA thread, barriers, IEEE arithmetic for the
//! intrinsics) at 64 threads a block, and every row's outcome must be the
//! host sampler's for the same seeded state, its adjusted logits the host's
//! bit for bit. Covers every path of the kernel: greedy, broken and empty
//! rows, the vocabulary-order draw, the sorted candidate region (top-k,
//! min-p, the server's defaults), the nucleus drawn by bisection when it is
//! too large to sort, and the hand-back of a top-k too large for the kernel.
//! The device itself is checked by `examples/device_sampling_check.rs`.

use corridor_backend::sample::{LogitEdit, RowSummary, SampleRowSpec, SampledRows, ROW_TOO_MANY_CANDIDATES};
use corridor_engine::sampling::device::{plan_row, settle_row};
use corridor_engine::sampling::{
    CpuSampler, SampleOutcome, SampleRow, Sampler, SamplerState, SamplerStats, SamplingParams,
};
use corridor_units::{RequestId, TokenId, Tokens};
use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "sample_kernel/rows.rs"]
mod rows;
use rows::{fill, Rng, Rows};

/// The kernel compiled for the host, once per test run.
fn host_kernel(dir: &Path) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let source = std::fs::read_to_string(root.join("../backend/kernels/sample.cu")).unwrap();
    let (threads, scan) = ("#define SAMPLE_THREADS 1024", "#define SCAN_THREADS 256");
    assert!(
        source.contains(threads) && source.contains(scan),
        "sample.cu no longer defines SAMPLE_THREADS and SCAN_THREADS as this test expects"
    );
    let prepared = source
        .replace(threads, "#define SAMPLE_THREADS 64")
        .replace(scan, "#define SCAN_THREADS 64")
        .replace("extern \"C\" ", "");
    std::fs::write(dir.join("kernel.inc"), prepared).unwrap();
    let exe = dir.join("sample_kernel_host");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let out = Command::new(&cxx)
        .args(["-std=c++20", "-O1", "-ffp-contract=off", "-pthread", "-I"])
        .arg(dir)
        .arg(root.join("tests/sample_kernel/host.cpp"))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("this test compiles the kernel with a C++ compiler ({cxx}): {e}"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    exe
}

fn bytes_of<T: bytemuck_free::Plain>(v: &[T]) -> &[u8] {
    // SAFETY: `Plain` types are #[repr(C)] structs of 4- and 8-byte fields without padding.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

mod bytemuck_free {
    /// The op's #[repr(C)] structs, written out as the kernel reads them.
    pub trait Plain {}
    impl Plain for corridor_backend::sample::SampleRowSpec {}
    impl Plain for corridor_backend::sample::LogitEdit {}
}

/// One launch of the host-compiled kernel (after `sample_scan` over slices
/// of `chunk` tokens when `chunk` > 0): its summaries and spill, and the rows
/// as it left them.
fn launch(
    exe: &Path,
    dir: &Path,
    chunk: usize,
    vocab: usize,
    data: &[f32],
    specs: &[SampleRowSpec],
    edits: &[LogitEdit],
) -> (SampledRows, Vec<f32>) {
    let rows = data.len() / vocab;
    let mut input = Vec::new();
    for v in [vocab, rows, specs.len(), edits.len()] {
        input.extend((v as u32).to_le_bytes());
    }
    input.extend(data.iter().flat_map(|v| v.to_le_bytes()));
    input.extend_from_slice(bytes_of(specs));
    input.extend_from_slice(bytes_of(edits));
    let (inp, outp) = (dir.join("in.bin"), dir.join("out.bin"));
    std::fs::write(&inp, input).unwrap();
    let status = Command::new(exe).arg(&inp).arg(&outp).arg(chunk.to_string()).status().unwrap();
    assert!(status.success());
    let out = std::fs::read(&outp).unwrap();
    let n = specs.len() * std::mem::size_of::<RowSummary>();
    let word = |c: &[u8], i: usize| u32::from_le_bytes(c[i * 4..i * 4 + 4].try_into().unwrap());
    let summaries: Vec<RowSummary> = out[..n]
        .chunks(24)
        .map(|c| RowSummary {
            token: word(c, 0),
            argmax: word(c, 1),
            nan: word(c, 2),
            pos_inf: word(c, 3),
            value_bits: word(c, 4),
            status: word(c, 5),
        })
        .collect();
    let left: Vec<f32> = out[n..].chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    let mut spill = Vec::new();
    for (s, r) in specs.iter().zip(&summaries) {
        if r.status == ROW_TOO_MANY_CANDIDATES {
            spill.extend_from_slice(&left[s.row as usize * vocab..(s.row as usize + 1) * vocab]);
        }
    }
    (SampledRows { rows: summaries, spill }, left)
}

/// Row `i` of a case: its request, parameters, sampler state and end tokens.
fn sample_row<'a>(
    i: usize,
    params: &'a SamplingParams,
    state: &'a mut SamplerState,
    eos: &'a [TokenId],
) -> SampleRow<'a> {
    SampleRow { request_id: RequestId(i as u64), params, state, eos_token_ids: eos, mask: None }
}

fn same(a: &SampleOutcome, b: &SampleOutcome) -> bool {
    match (a, b) {
        (Ok(x), Ok(y)) => x.token == y.token && x.fallback == y.fallback && x.stop == y.stop,
        (Err(x), Err(y)) => x == y,
        _ => false,
    }
}

#[test]
fn the_kernel_draws_what_the_host_sampler_draws() {
    let dir = tempfile::tempdir().unwrap();
    let exe = host_kernel(dir.path());
    let big = 128_256;
    let defaults = SamplingParams {
        temperature: 0.2,
        top_p: 0.9,
        min_p: 0.05,
        repetition_penalty: 1.1,
        ..Default::default()
    };
    let p = SamplingParams::default;
    let mut bias = defaults.clone();
    bias.logit_bias.insert(TokenId(17), 100.0);
    bias.logit_bias.insert(TokenId(3), -100.0);
    // (name, vocab, rows, params, rows the kernel must hand back)
    let cases: Vec<(&str, usize, Rows, SamplingParams, bool)> = vec![
        (
            "greedy with penalties",
            big,
            Rows::Model,
            SamplingParams { temperature: 0.0, repetition_penalty: 1.3, frequency_penalty: 0.7, ..p() },
            false,
        ),
        ("server defaults", big, Rows::Model, defaults.clone(), false),
        ("server defaults, flat rows (nucleus by bisection)", big, Rows::Flat, defaults.clone(), false),
        ("temperature 1, untruncated", big, Rows::Model, p(), false),
        (
            "top-k 40, top-p 0.9, min-p 0.02",
            big,
            Rows::Model,
            SamplingParams { top_k: Some(40), top_p: 0.9, min_p: 0.02, temperature: 0.7, ..p() },
            false,
        ),
        ("top-p 0.95", big, Rows::Model, SamplingParams { top_p: 0.95, ..p() }, false),
        (
            "top-p 0.95, flat rows (nucleus by bisection)",
            big,
            Rows::Flat,
            SamplingParams { top_p: 0.95, ..p() },
            false,
        ),
        (
            "top-p 0.8, the nucleus ends in a tie (by bisection)",
            big,
            Rows::Tiers,
            SamplingParams { top_p: 0.8, ..p() },
            false,
        ),
        (
            "top-p 0.8, the nucleus ends in a tie, again",
            big,
            Rows::Tiers,
            SamplingParams { top_p: 0.8, ..p() },
            false,
        ),
        ("min-p 0.1", big, Rows::Model, SamplingParams { min_p: 0.1, ..p() }, false),
        (
            "penalties, bias and masks",
            big,
            Rows::Model,
            SamplingParams {
                min_tokens: Tokens(50),
                stop_token_ids: vec![TokenId(11)],
                presence_penalty: 0.4,
                ..bias
            },
            false,
        ),
        ("top-k 5000 (handed back)", big, Rows::Model, SamplingParams { top_k: Some(5000), ..p() }, true),
        ("NaN and +inf", big, Rows::Broken, defaults.clone(), false),
        ("nothing finite", 1000, Rows::Empty, defaults.clone(), false),
        ("small vocabulary, top-k 3", 37, Rows::Model, SamplingParams { top_k: Some(3), ..p() }, false),
        (
            "small vocabulary, top-p 0.5, min-p 0.2",
            5003,
            Rows::Flat,
            SamplingParams { top_p: 0.5, min_p: 0.2, ..p() },
            false,
        ),
    ];
    let mut rng = Rng(0x5eed_5a3b);
    let batch = 6;
    let mut failures = Vec::new();
    for (name, vocab, kind, params, hands_back) in &cases {
        let vocab = *vocab;
        let eos = [TokenId((vocab - 1) as u32), TokenId(2)];
        let data: Vec<f32> = (0..batch).flat_map(|_| fill(&mut rng, vocab, *kind)).collect();
        let mut host_states: Vec<SamplerState> = (0..batch)
            .map(|_| {
                let prompt: Vec<TokenId> = (0..300).map(|_| TokenId(rng.below(vocab) as u32)).collect();
                let mut s = SamplerState::new(
                    &SamplingParams { seed: Some(rng.next()), ..params.clone() },
                    &prompt,
                    &[],
                );
                for _ in 0..rng.below(40) {
                    s.record(TokenId(rng.below(vocab) as u32));
                }
                s
            })
            .collect();
        let dev_states = host_states.clone();
        let mut host_logits = data.clone();
        let mut rows: Vec<SampleRow<'_>> =
            host_states.iter_mut().enumerate().map(|(i, s)| sample_row(i, params, s, &eos)).collect();
        let want = CpuSampler::new(Default::default()).sample(&mut host_logits, vocab, &mut rows).unwrap();

        // One block a row, and the rows scanned in about six slices first
        // (a multiple of the host build's 64 threads; one slice below that).
        for chunk in [0, (vocab / 6).next_multiple_of(64)] {
            let how = if chunk > 0 { format!(", slices of {chunk}") } else { String::new() };
            let mut dev_states = dev_states.clone();
            let mut rows: Vec<SampleRow<'_>> =
                dev_states.iter_mut().enumerate().map(|(i, s)| sample_row(i, params, s, &eos)).collect();
            let mut edits = Vec::new();
            let specs: Vec<_> =
                rows.iter_mut().enumerate().map(|(i, r)| plan_row(r, vocab, i as u32, &mut edits)).collect();
            let (out, left) = launch(&exe, dir.path(), chunk, vocab, &data, &specs, &edits);
            let stats = SamplerStats::default();
            let mut spill = out.spill.chunks(vocab);
            for (i, r) in rows.iter_mut().enumerate() {
                let summary = &out.rows[i];
                let spilled = (summary.status == ROW_TOO_MANY_CANDIDATES).then(|| spill.next()).flatten();
                if spilled.is_some() != *hands_back {
                    failures.push(format!(
                        "{name}{how}, row {i}: handed back {}, expected {hands_back}",
                        spilled.is_some()
                    ));
                }
                let got = settle_row(&stats, r, &specs[i], summary, vocab, spilled);
                if !same(&got, &want[i]) {
                    failures.push(format!(
                        "{name}{how}, row {i}: host {:?}, kernel {:?} ({summary:?})",
                        want[i].as_ref().map(|s| (s.token, s.fallback)),
                        got.as_ref().map(|s| (s.token, s.fallback))
                    ));
                }
                let adjusted =
                    |v: &[f32]| v[i * vocab..(i + 1) * vocab].iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                if adjusted(&left) != adjusted(&host_logits) {
                    failures
                        .push(format!("{name}{how}, row {i}: the adjusted logits differ from the host's"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
