//! `Backend::sample_rows` on the GPU: the step's rows drawn where their
//! logits are (kernels/sample.cu), so a decode step copies a few numbers per
//! row to the host instead of the whole `[rows, vocab]` block.
//!
//! The specs and edits go up, one launch draws every row, the summaries come
//! back; a row the kernel could not draw (its candidate region did not fit
//! shared memory) has its adjusted logits copied out beside them.

use super::device::{cuda_err, Args, DeviceBuffer, LaunchDims};
use super::{CudaAct, CudaBackend};
use crate::sample::{LogitEdit, RowSummary, SampleRowSpec, SampledRows, ROW_TOO_MANY_CANDIDATES};
use crate::{BackendError, Result};
use cudarc::driver::result as cu;

/// Threads per row: `SAMPLE_THREADS` in kernels/sample.cu.
const THREADS: u32 = 1024;

/// Device copies of one call's specs, edits and summaries, grown to the
/// largest call and kept.
#[derive(Default)]
pub(super) struct SampleBuffers {
    specs: Option<DeviceBuffer>,
    edits: Option<DeviceBuffer>,
    out: Option<DeviceBuffer>,
}

impl CudaBackend {
    pub(super) fn sample_rows_on_device(
        &self,
        logits: &mut CudaAct,
        specs: &[SampleRowSpec],
        edits: &[LogitEdit],
        out: &mut SampledRows,
    ) -> Result<()> {
        out.rows.clear();
        out.spill.clear();
        if specs.is_empty() {
            return Ok(());
        }
        let bad = |what: String| Err(BackendError::Other(format!("sample_rows: {what}")));
        for (i, s) in specs.iter().enumerate() {
            if s.row as usize >= logits.rows {
                return bad(format!("spec {i} reads row {} of {}", s.row, logits.rows));
            }
            if s.edits_start as u64 + s.edits_len as u64 > edits.len() as u64 {
                return bad(format!("spec {i} names edits past the {} given", edits.len()));
            }
        }
        if specs.len() > 65535 {
            return bad(format!("{} rows in one launch", specs.len()));
        }
        let vocab = logits.cols;
        self.ctx.bind()?;
        let mut st = self.lock();
        if st.capturing.is_some() {
            return bad("called during graph capture".into());
        }
        let bufs = &mut st.sampling;
        self.ensure_scratch(&mut bufs.specs, std::mem::size_of_val(specs))?;
        self.ensure_scratch(&mut bufs.edits, std::mem::size_of_val(edits).max(4))?;
        self.ensure_scratch(&mut bufs.out, specs.len() * std::mem::size_of::<RowSummary>())?;
        let ptr = |b: &Option<DeviceBuffer>| b.as_ref().map_or(0, |b| b.ptr());
        let (specs_ptr, edits_ptr, out_ptr) = (ptr(&bufs.specs), ptr(&bufs.edits), ptr(&bufs.out));
        self.upload(specs_ptr, specs)?;
        self.upload(edits_ptr, edits)?;
        let args = Args::new().ptr(logits.ptr()).i32(vocab as i32).ptr(specs_ptr).ptr(edits_ptr).ptr(out_ptr);
        let dims = LaunchDims { grid: (specs.len() as u32, 1, 1), block: THREADS };
        // SAFETY: `logits` holds every row the specs name (checked above),
        // the buffers hold the specs, the edits and one summary per spec.
        unsafe { self.launch(self.k.sample_rows, dims, args)? };
        out.rows.resize(specs.len(), RowSummary::default());
        // SAFETY: `out.rows` holds one summary per spec, as the buffer does.
        unsafe { cu::memcpy_dtoh_async(out.rows.as_mut_slice(), out_ptr, self.stream.0) }
            .map_err(|e| cuda_err("cuMemcpyDtoHAsync", e))?;
        self.synchronize()?;
        let spilled: Vec<u32> = specs
            .iter()
            .zip(&out.rows)
            .filter(|(_, r)| r.status == ROW_TOO_MANY_CANDIDATES)
            .map(|(s, _)| s.row)
            .collect();
        if spilled.is_empty() {
            return Ok(());
        }
        out.spill.resize(spilled.len() * vocab, 0.0);
        for (chunk, &row) in out.spill.chunks_mut(vocab).zip(&spilled) {
            let src = logits.ptr() + (row as u64 * vocab as u64 * 4);
            // SAFETY: row `row` of `logits` is `vocab` f32 values.
            unsafe { cu::memcpy_dtoh_async(chunk, src, self.stream.0) }
                .map_err(|e| cuda_err("cuMemcpyDtoHAsync", e))?;
        }
        self.synchronize()
    }
}
