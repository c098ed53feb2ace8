//! `Backend::sample_rows` on the GPU: the step's rows drawn where their
//! logits are (kernels/sample.cu), so a decode step copies a few numbers per
//! row to the host instead of the whole `[rows, vocab]` block.
//!
//! The specs and edits go up, one launch draws every row, the summaries come
//! back; a row the kernel could not draw (its candidate region did not fit
//! shared memory) has its adjusted logits copied out beside them.

use super::device::{cuda_err, Args, DeviceBuffer, LaunchDims};
use super::{CudaAct, CudaBackend};
use crate::sample::{
    LogitEdit, RowSummary, SampleRowSpec, SampledRows, MAX_EDITS_PER_ROW, ROW_TOO_MANY_CANDIDATES,
};
use crate::{BackendError, Result};
use cudarc::driver::result as cu;

/// Threads per row: `SAMPLE_THREADS` in kernels/sample.cu.
const THREADS: u32 = 1024;

/// Threads per slice of `sample_scan`: `SCAN_THREADS` in kernels/sample.cu.
const SCAN_THREADS: u32 = 256;

/// Tokens of one slice of `sample_scan` (more where the vocabulary has more
/// than `MAX_SLICES` of them).
const SLICE_TOKENS: usize = 4096;

/// The most slices a row is cut into.
const MAX_SLICES: usize = 64;

/// Bytes of one slice's result (`SampleSlice`).
const SLICE: usize = 16;

/// How `sample_scan` cuts a row of `vocab` tokens: tokens a slice (a
/// multiple of the block's threads) and slices.
fn slicing(vocab: usize) -> (usize, usize) {
    let chunk = SLICE_TOKENS.max(vocab.div_ceil(MAX_SLICES)).next_multiple_of(SCAN_THREADS as usize);
    (chunk, vocab.div_ceil(chunk).max(1))
}

/// Bytes of one summary on the device.
const SUMMARY: usize = std::mem::size_of::<RowSummary>();

/// Device copies of one call's specs, edits and summaries, grown to the
/// largest call and kept.
#[derive(Default)]
pub(super) struct SampleBuffers {
    specs: Option<DeviceBuffer>,
    edits: Option<DeviceBuffer>,
    out: Option<DeviceBuffer>,
    /// `sample_scan`'s results, `MAX_SLICES` a row.
    slices: Option<DeviceBuffer>,
}

impl CudaBackend {
    /// Grow `slot` to `bytes` if the card lends them; a refusal keeps the
    /// buffer there was (the caller splits its work to fit).
    fn grow(&self, slot: &mut Option<DeviceBuffer>, bytes: usize) {
        if slot.as_ref().is_some_and(|b| b.bytes().0 as usize >= bytes) {
            return;
        }
        match self.alloc_buf(bytes, super::device::Purpose::Workspace) {
            Ok(b) => *slot = Some(b),
            Err(e) => tracing::debug!("sample_rows keeps its smaller buffers: {e}"),
        }
    }

    /// Allocate the buffers of `sample_rows` for `rows` rows, before KV takes
    /// what the card has left, so serving never needs to allocate.
    pub(super) fn reserve_sampling(&self, rows: usize) -> Result<()> {
        self.ctx.bind()?;
        let mut st = self.lock();
        let bufs = &mut st.sampling;
        let want = |n: usize| n.max(1);
        for (slot, bytes) in [
            (&mut bufs.specs, want(rows) * std::mem::size_of::<SampleRowSpec>()),
            (&mut bufs.edits, want(rows) * MAX_EDITS_PER_ROW * std::mem::size_of::<LogitEdit>()),
            (&mut bufs.out, want(rows) * SUMMARY),
            (&mut bufs.slices, want(rows) * MAX_SLICES * SLICE),
        ] {
            if slot.as_ref().is_none_or(|b| (b.bytes().0 as usize) < bytes) {
                *slot = Some(self.alloc_buf(bytes, super::device::Purpose::Workspace)?);
            }
        }
        Ok(())
    }

    /// Whether the sampler scans rows in slices first, in place of
    /// `CudaTuning::sample_slices` (the self-check's comparisons and
    /// benchmark); `None` goes back to the tuning's choice.
    pub(super) fn set_sample_slices(&self, on: Option<bool>) {
        let on = on.unwrap_or(self.config.tuning.sample_slices);
        self.sample_slices.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// One launch of `sample_rows` over `rows` specs already on the device,
    /// after `sample_scan` over `slices` slices a row of `chunk` tokens when
    /// `slices` > 0 (its results in `scanned`).
    #[allow(clippy::too_many_arguments)]
    fn launch_sample_rows(
        &self,
        logits: u64,
        vocab: usize,
        specs: u64,
        edits: u64,
        out: u64,
        rows: usize,
        (scanned, chunk, slices): (u64, usize, usize),
    ) -> Result<()> {
        let dims = LaunchDims { grid: (rows as u32, 1, 1), block: THREADS };
        let args = Args::new().ptr(logits).i32(vocab as i32).ptr(specs).ptr(edits).ptr(out);
        if slices == 0 {
            // SAFETY: the callers checked that `logits` holds every row the
            // specs name and that the buffers hold the specs, their edits and
            // one summary per spec.
            return unsafe { self.launch(self.k.sample_rows, dims, args) };
        }
        let scan_args =
            Args::new().ptr(logits).i32(vocab as i32).i32(chunk as i32).ptr(specs).ptr(edits).ptr(scanned);
        let scan_dims = LaunchDims { grid: (slices as u32, rows as u32, 1), block: SCAN_THREADS };
        // SAFETY: as above; `scanned` holds `slices` results a spec.
        unsafe { self.launch(self.k.sample_scan, scan_dims, scan_args) }?;
        // SAFETY: as above.
        unsafe { self.launch(self.k.sample_rows_sliced, dims, args.ptr(scanned).i32(slices as i32)) }
    }

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
        // Buffers grow to the largest call when the card has room; when it
        // has none (KV fills what the floor leaves), the rows go in launches
        // whose edits fit the buffers there are.
        let bufs = &mut st.sampling;
        self.grow(&mut bufs.specs, std::mem::size_of_val(specs));
        self.grow(&mut bufs.edits, std::mem::size_of_val(edits).max(4));
        self.grow(&mut bufs.out, specs.len() * SUMMARY);
        let (chunk, slices) = slicing(vocab);
        let scan = self.sample_slices.load(std::sync::atomic::Ordering::Relaxed);
        if scan {
            self.grow(&mut bufs.slices, specs.len() * slices * SLICE);
        }
        let cap = |b: &Option<DeviceBuffer>| b.as_ref().map_or(0, |b| b.bytes().0 as usize);
        let max_rows =
            (cap(&bufs.specs) / std::mem::size_of::<SampleRowSpec>()).min(cap(&bufs.out) / SUMMARY);
        // Slices where their buffer holds every row of a launch; a refused
        // growth leaves a row to one block, as without them.
        let slices =
            if scan && cap(&bufs.slices) >= max_rows.min(specs.len()) * slices * SLICE { slices } else { 0 };
        let max_edits = cap(&bufs.edits) / std::mem::size_of::<LogitEdit>();
        let ptr = |b: &Option<DeviceBuffer>| b.as_ref().map_or(0, |b| b.ptr());
        let (specs_ptr, edits_ptr, out_ptr) = (ptr(&bufs.specs), ptr(&bufs.edits), ptr(&bufs.out));
        let scanned = (ptr(&bufs.slices), chunk, slices);
        out.rows.resize(specs.len(), RowSummary::default());
        let mut done = 0;
        let (mut part, mut part_edits) = (Vec::new(), Vec::new());
        // Everything in one launch when the buffers hold it (the usual case):
        // the specs and edits go up as they are, unpacked.
        let whole = specs.len() <= max_rows && edits.len() <= max_edits;
        while done < specs.len() {
            let (launch, launch_edits): (&[SampleRowSpec], &[LogitEdit]) = if whole {
                (specs, edits)
            } else {
                // The next launch: as many rows as the buffers hold, their
                // edits packed from 0.
                part.clear();
                part_edits.clear();
                for s in &specs[done..] {
                    let len = s.edits_len as usize;
                    if part.len() == max_rows || (part_edits.len() + len > max_edits && !part.is_empty()) {
                        break;
                    }
                    if len > max_edits {
                        return bad(format!("a row with {len} edits; the device holds {max_edits}"));
                    }
                    let lo = s.edits_start as usize;
                    part.push(SampleRowSpec { edits_start: part_edits.len() as u32, ..*s });
                    part_edits.extend_from_slice(&edits[lo..lo + len]);
                }
                if part.is_empty() {
                    return bad("no device buffers for the rows".into());
                }
                (&part, &part_edits)
            };
            self.upload(specs_ptr, launch)?;
            self.upload(edits_ptr, launch_edits)?;
            self.launch_sample_rows(
                logits.ptr(),
                vocab,
                specs_ptr,
                edits_ptr,
                out_ptr,
                launch.len(),
                scanned,
            )?;
            let got = &mut out.rows[done..done + launch.len()];
            // SAFETY: `got` holds one summary per spec of this launch, as the buffer does.
            unsafe { cu::memcpy_dtoh_async(got, out_ptr, self.stream.0) }
                .map_err(|e| cuda_err("cuMemcpyDtoHAsync", e))?;
            self.synchronize()?;
            done += launch.len();
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cover_every_token_within_the_limit() {
        for vocab in [1usize, 37, 4096, 4097, 32_000, 128_256, 151_669, 262_144, 1_000_000] {
            let (chunk, slices) = slicing(vocab);
            assert!(chunk.is_multiple_of(SCAN_THREADS as usize) && chunk >= SLICE_TOKENS, "{vocab}");
            assert!(
                slices <= MAX_SLICES && slices * chunk >= vocab && (slices - 1) * chunk < vocab,
                "{vocab}"
            );
        }
        assert_eq!(slicing(128_256), (4096, 32));
    }
}
