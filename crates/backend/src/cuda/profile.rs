//! Profiling: where a step's device time goes, op by op
//! (`CudaTuning::profile_every`: a table logged every N steps).

use super::device::cuda_err;
use super::CudaBackend;
use crate::Result;
use cudarc::driver::{result as cu, sys};
use std::collections::HashMap;
use std::sync::Mutex;

/// Where a step's device time goes, op by op: with profiling on, steps run
/// without graphs, every op is waited for, and its time is the device's
/// between two events recorded around it (the host's launch and wait are not
/// in it; the kernel's start on an idle device is).
pub(super) struct OpProfile {
    every: u64,
    steps: u64,
    rows: usize,
    totals: HashMap<String, (std::time::Duration, u64)>,
    /// Recorded around each op on the stream: its device time, without the
    /// host's launch and wait.
    events: Option<(sys::CUevent, sys::CUevent)>,
}

impl OpProfile {
    /// A profile that reports every `every` steps (at least 1).
    pub(super) fn new(every: u64) -> OpProfile {
        OpProfile { every: every.max(1), steps: 0, rows: 0, totals: HashMap::new(), events: None }
    }

    fn add(&mut self, name: &str, d: std::time::Duration) {
        let e = self.totals.entry(name.to_string()).or_default();
        e.0 += d;
        e.1 += 1;
    }

    /// Count a step; every `every` steps log the table and start again.
    pub(super) fn step(&mut self, rows: usize) {
        self.steps += 1;
        self.rows = rows;
        if self.steps < self.every {
            return;
        }
        let mut by_time: Vec<_> = self.totals.iter().collect();
        by_time.sort_by_key(|r| std::cmp::Reverse(r.1 .0));
        let total: f64 = by_time.iter().map(|r| r.1 .0.as_secs_f64()).sum();
        let mut table = String::new();
        for (name, (d, n)) in by_time {
            let ms = d.as_secs_f64() * 1e3 / self.steps as f64;
            table.push_str(&format!(
                "\n  {ms:8.3} ms/step {:5.1}%  {:6} calls/step  {:8.1} us/call  {name}",
                100.0 * d.as_secs_f64() / total.max(1e-12),
                n / self.steps,
                d.as_secs_f64() * 1e6 / *n as f64
            ));
        }
        tracing::info!(
            "CUDA op profile over {} steps (last step {} rows), {:.3} ms/step in ops:{table}",
            self.steps,
            self.rows,
            total * 1e3 / self.steps as f64
        );
        self.steps = 0;
        self.totals.clear();
    }
}

impl CudaBackend {
    /// Run `f` between two events on the stream, wait, and count the
    /// device time between them under `name`.
    pub(super) fn profiled(
        &self,
        profile: &Mutex<OpProfile>,
        name: &str,
        f: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let mut p = profile.lock().unwrap_or_else(|e| e.into_inner());
        if p.events.is_none() {
            let ev = || {
                cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                    .map_err(|e| cuda_err("cuEventCreate", e))
            };
            p.events = Some((ev()?, ev()?));
        }
        let (a, b) = p.events.expect("created above");
        // SAFETY: events of this context, recorded on our stream.
        unsafe { cu::event::record(a, self.stream.0) }.map_err(|e| cuda_err("cuEventRecord", e))?;
        f()?;
        unsafe { cu::event::record(b, self.stream.0) }.map_err(|e| cuda_err("cuEventRecord", e))?;
        self.synchronize()?;
        let ms = unsafe { cu::event::elapsed(a, b) }.map_err(|e| cuda_err("cuEventElapsedTime", e))?;
        p.add(name, std::time::Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3));
        Ok(())
    }
}
