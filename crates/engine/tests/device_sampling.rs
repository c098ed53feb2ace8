//! The engine's routing of rows between the host sampler and a device that
//! samples where the logits are: an executor over the tiny checkpoint on
//! the CPU that implements `execute_sampling` with the op on the host
//! (`sampling::device::host_op`). Rows that want log-probabilities or carry
//! a grammar must reach the host as raw logits; every other row must be
//! drawn "on the device"; and seeded requests must give the tokens they
//! give when every row is sampled on the host, including rows the device
//! hands back because their candidates did not fit.

use corridor_backend::cpu::CpuBackend;
use corridor_backend::sample::{SampledRows, ROW_TOO_MANY_CANDIDATES};
use corridor_engine::engine::{spawn_with, EngineConfig, EngineHandle, Event, GenerateRequest};
use corridor_engine::executor::{DeviceDraw, Executor, ExecutorLimits, SingleRank};
use corridor_engine::pages::PagePool;
use corridor_engine::sampling::device::host_op;
use corridor_engine::sampling::{Constraint, ConstraintError, SamplingParams, TokenConstraint, TokenMask};
use corridor_engine::scheduler::{SchedulerConfig, SchedulerOutput};
use corridor_model::{Checkpoint, Model, ModelConfig, ModelError};
use corridor_units::{PageId, Pages, TokenId, Tokens};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// What one step sent where.
#[derive(Clone, Debug, PartialEq)]
struct StepLog {
    host_rows: usize,
    device_rows: usize,
}

/// The CPU executor with the device op done on the host; spills every row
/// with `top_k` set, as a device whose shared memory is too small would.
struct HostDevice {
    inner: SingleRank<CpuBackend>,
    log: Arc<Mutex<Vec<StepLog>>>,
    all: Vec<f32>,
}

impl Executor for HostDevice {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn execute(
        &mut self,
        step: &SchedulerOutput,
        rows: &[usize],
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        self.log.lock().unwrap().push(StepLog { host_rows: rows.len(), device_rows: 0 });
        self.inner.execute(step, rows, logits)
    }
    fn samples_on_device(&self) -> bool {
        true
    }
    fn execute_sampling(
        &mut self,
        step: &SchedulerOutput,
        rows: &[usize],
        logits: &mut Vec<f32>,
        draw: &DeviceDraw<'_>,
        out: &mut SampledRows,
    ) -> Result<(), ModelError> {
        self.log.lock().unwrap().push(StepLog { host_rows: draw.host_rows, device_rows: draw.specs.len() });
        let vocab = self.inner.config().vocab_size;
        self.inner.execute(step, rows, &mut self.all)?;
        logits.clear();
        logits.extend_from_slice(&self.all[..draw.host_rows * vocab]);
        out.rows.clear();
        out.spill.clear();
        for spec in draw.specs {
            assert!(spec.row as usize >= draw.host_rows, "a device row overlaps the host's");
            let row = &mut self.all[spec.row as usize * vocab..(spec.row as usize + 1) * vocab];
            let mut summary = host_op(row, spec, draw.edits);
            if spec.top_k > 0 && !summary.is_broken() {
                summary.status = ROW_TOO_MANY_CANDIDATES;
                summary.token = u32::MAX;
                out.spill.extend_from_slice(row);
            }
            out.rows.push(summary);
        }
        Ok(())
    }
    fn move_pages(&mut self, moves: &[(PageId, PageId)]) -> Result<(), ModelError> {
        self.inner.move_pages(moves)
    }
}

/// Allows only even token ids, so a constrained row must see its mask.
struct EvenOnly;
impl TokenConstraint for EvenOnly {
    fn mask(&mut self, vocab: usize) -> Result<TokenMask, ConstraintError> {
        let mut m = TokenMask::none(vocab);
        (0..vocab as u32).step_by(2).for_each(|t| m.allow(TokenId(t)));
        Ok(m)
    }
    fn accept(&mut self, token: TokenId) -> Result<(), ConstraintError> {
        if token.get() % 2 == 1 {
            return Err(ConstraintError(format!("odd token {token}")));
        }
        Ok(())
    }
    fn fork(&self) -> Box<dyn TokenConstraint> {
        Box::new(EvenOnly)
    }
}

fn executor() -> SingleRank<CpuBackend> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/llama-f32");
    let ckpt = Checkpoint::open(&dir).unwrap();
    let backend = CpuBackend::new();
    let model = Model::load(&backend, &ckpt, |_| {}).unwrap();
    let limits = ExecutorLimits {
        max_rows: Tokens(64),
        max_logit_rows: 8,
        page_size: Tokens(16),
        num_pages: Pages(64),
    };
    SingleRank::new(backend, model, limits).unwrap()
}

fn engine(exec: Box<dyn Executor>) -> EngineHandle {
    let config = EngineConfig {
        scheduler: SchedulerConfig {
            max_running: 8,
            max_batched_tokens: 64,
            context_len: 256,
            itl: corridor_engine::step_budget::ItlBound::NONE,
        },
        page_size: Tokens(16),
    };
    spawn_with(exec, config, PagePool::standalone(Pages(64), Tokens(16))).unwrap()
}

/// The requests: (params, grammar?) of each.
fn requests() -> Vec<(SamplingParams, bool)> {
    let seeded = |seed| SamplingParams { seed: Some(seed), ..SamplingParams::default() };
    vec![
        // The server's defaults.
        (
            SamplingParams {
                temperature: 0.2,
                top_p: 0.9,
                min_p: 0.05,
                repetition_penalty: 1.1,
                ..seeded(1)
            },
            false,
        ),
        (SamplingParams { temperature: 1.0, frequency_penalty: 0.5, ..seeded(2) }, false),
        (SamplingParams { logprobs: Some(3), ..seeded(3) }, false),
        (SamplingParams { top_p: 0.8, ..seeded(4) }, true),
        (SamplingParams { top_k: Some(5), min_p: 0.1, ..seeded(5) }, false),
        (SamplingParams { temperature: 0.0, ..seeded(6) }, false),
    ]
}

type Tokens_ = Vec<(u32, Option<f32>, usize)>;

/// Every request's (token, logprob, top_logprobs count), all run at once.
fn run(handle: &EngineHandle) -> Vec<Tokens_> {
    let mut streams = Vec::new();
    for (i, (params, grammar)) in requests().into_iter().enumerate() {
        let req = GenerateRequest {
            prompt: TokenId::vec(&[1, 5 + i as u32, 9, 12, 7]),
            params,
            max_new_tokens: Some(12),
            eos_ids: vec![],
            constraint: grammar.then(|| Constraint(Box::new(EvenOnly))),
        };
        streams.push(handle.submit(req).unwrap());
    }
    streams
        .iter_mut()
        .map(|s| {
            let mut got = Vec::new();
            while let Some(ev) = s.next_blocking() {
                match ev {
                    Event::Token { token, logprob, top_logprobs } => {
                        got.push((token.get(), logprob, top_logprobs.len()))
                    }
                    Event::Done { reason, .. } => {
                        assert_eq!(reason, corridor_engine::engine::FinishReason::Length);
                        break;
                    }
                }
            }
            got
        })
        .collect()
}

#[test]
fn rows_go_where_they_must_and_draw_what_the_host_draws() {
    let host = engine(Box::new(executor()));
    let want = run(&host);
    host.shutdown();

    let log = Arc::new(Mutex::new(Vec::new()));
    let device = engine(Box::new(HostDevice { inner: executor(), log: log.clone(), all: Vec::new() }));
    let got = run(&device);
    let stats = device.sampler_stats();
    let (rows, spilled) = (stats.device_rows(), stats.device_spilled());
    device.shutdown();

    assert_eq!(got, want, "the device path changed what seeded requests draw");
    assert!(got.iter().all(|t| t.len() == 12));
    // Log-probabilities came through the host path.
    assert!(got[2].iter().all(|&(_, lp, top)| lp.is_some() && top == 3));
    assert!(got[3].iter().all(|&(t, _, _)| t % 2 == 0), "the grammar's row saw its mask");
    let log = log.lock().unwrap();
    let decode: Vec<&StepLog> = log.iter().filter(|s| s.host_rows + s.device_rows == 6).collect();
    assert!(!decode.is_empty(), "no step sampled all six rows: {log:?}");
    for s in decode {
        assert_eq!(s, &StepLog { host_rows: 2, device_rows: 4 }, "{log:?}");
    }
    // Four device rows per token; the top-k row's twelve came back to the host.
    assert_eq!(rows, 4 * 12);
    assert_eq!(spilled, 12);
}

/// Without the capability (the CPU executor), every row stays on the host.
#[test]
fn an_executor_without_the_op_samples_every_row_on_the_host() {
    let exec = executor();
    assert!(!exec.samples_on_device());
    let handle = engine(Box::new(exec));
    let got = run(&handle);
    assert_eq!(handle.sampler_stats().device_rows(), 0);
    handle.shutdown();
    assert!(got.iter().all(|t| t.len() == 12));
}

/// A grammar whose mask fails from its third token on.
struct FailsLater(usize);
impl TokenConstraint for FailsLater {
    fn mask(&mut self, vocab: usize) -> Result<TokenMask, ConstraintError> {
        self.0 += 1;
        if self.0 > 2 {
            return Err(ConstraintError("the grammar broke".into()));
        }
        let mut m = TokenMask::none(vocab);
        (0..vocab as u32).for_each(|t| m.allow(TokenId(t)));
        Ok(m)
    }
    fn accept(&mut self, _token: TokenId) -> Result<(), ConstraintError> {
        Ok(())
    }
    fn fork(&self) -> Box<dyn TokenConstraint> {
        Box::new(FailsLater(self.0))
    }
}

fn greedy_tokens(stream: &mut corridor_engine::engine::RequestStream) -> Vec<u32> {
    let mut got = Vec::new();
    while let Some(ev) = stream.next_blocking() {
        match ev {
            Event::Token { token, .. } => got.push(token.get()),
            Event::Done { .. } => break,
        }
    }
    got
}

/// A request whose grammar fails leaves the batch; the rows after it still
/// sample from their own logits.
#[test]
fn a_failed_grammar_leaves_the_other_rows_their_own_logits() {
    let greedy = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
    let request = |prompt: Vec<u32>, constraint: Option<Constraint>| GenerateRequest {
        prompt: TokenId::vec(&prompt),
        params: greedy.clone(),
        max_new_tokens: Some(10),
        eos_ids: vec![],
        constraint,
    };
    let alone = engine(Box::new(executor()));
    let want = greedy_tokens(&mut alone.submit(request(vec![3, 14, 15, 9], None)).unwrap());
    alone.shutdown();

    let both = engine(Box::new(executor()));
    let mut failing =
        both.submit(request(vec![27, 18, 28], Some(Constraint(Box::new(FailsLater(0)))))).unwrap();
    let mut after = both.submit(request(vec![3, 14, 15, 9], None)).unwrap();
    let failed = greedy_tokens(&mut failing);
    let got = greedy_tokens(&mut after);
    both.shutdown();
    assert_eq!(failed.len(), 2, "the grammar should end its request at its third token");
    assert_eq!(got, want);
}

/// A row with more edits than a device row takes is sampled on the host.
#[test]
fn a_row_with_too_many_edits_is_sampled_on_the_host() {
    use corridor_backend::sample::MAX_EDITS_PER_ROW;
    let log = Arc::new(Mutex::new(Vec::new()));
    let handle = engine(Box::new(HostDevice { inner: executor(), log: log.clone(), all: Vec::new() }));
    let many = SamplingParams {
        stop_token_ids: vec![TokenId(0); MAX_EDITS_PER_ROW + 1],
        seed: Some(9),
        ..Default::default()
    };
    let few = SamplingParams { seed: Some(10), ..Default::default() };
    let mut streams: Vec<_> = [many, few]
        .into_iter()
        .map(|params| {
            let req = GenerateRequest {
                prompt: TokenId::vec(&[1, 2, 3]),
                params,
                max_new_tokens: Some(6),
                eos_ids: vec![],
                constraint: None,
            };
            handle.submit(req).unwrap()
        })
        .collect();
    for s in &mut streams {
        while let Some(ev) = s.next_blocking() {
            if matches!(ev, Event::Done { .. }) {
                break;
            }
        }
    }
    handle.shutdown();
    let log = log.lock().unwrap();
    let both: Vec<&StepLog> = log.iter().filter(|s| s.host_rows + s.device_rows == 2).collect();
    assert!(!both.is_empty(), "{log:?}");
    assert!(both.iter().all(|s| **s == StepLog { host_rows: 1, device_rows: 1 }), "{log:?}");
}
