//! Graph capture and replay: a decode step recorded once as a CUDA graph
//! (under a `GraphKey` the executor chooses) and replayed in one launch.
//!
//! Every op reads its step metadata from device buffers that `begin_step`
//! refreshes, so a captured step stays valid for any rows and contexts it is
//! replayed with; an op whose metadata would change during a capture fails
//! instead (`sync_meta`). Captures are dropped when what they point at
//! changes: a new workspace (`alloc_act`) or a new KV store.

use super::device::cuda_err;
use super::{CudaBackend, State};
use crate::{GraphKey, Result};
use cudarc::driver::{result as cu, sys};

pub(super) struct Captured {
    pub(super) exec: sys::CUgraphExec,
    pub(super) graph: sys::CUgraph,
}

/// Destroy every captured step (the caller has synchronized the stream or
/// is about to change what the captures point at, between steps).
pub(super) fn drop_graphs(st: &mut State) {
    for (_, g) in st.graphs.drain() {
        // SAFETY: created by capture, destroyed once; no replay is in flight
        // that the driver does not finish first (destroying a launched graph
        // exec is deferred by the driver until its work is done).
        unsafe {
            let _ = cu::graph::exec_destroy(g.exec);
            let _ = cu::graph::destroy(g.graph);
        }
    }
}

impl CudaBackend {
    pub(super) fn replay_graph(&self, key: GraphKey) -> Result<bool> {
        let st = self.lock();
        self.ctx.bind()?;
        match st.graphs.get(&key) {
            Some(g) => {
                // SAFETY: an instantiated graph of this context, launched on our stream.
                unsafe { cu::graph::launch(g.exec, self.stream.0) }
                    .map_err(|e| cuda_err("cuGraphLaunch", e))?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    pub(super) fn begin_capture(&self, key: GraphKey) -> Result<bool> {
        let mut st = self.lock();
        self.ctx.bind()?;
        if st.capturing.is_some() || st.graphs.contains_key(&key) || self.profile.is_some() {
            return Ok(false);
        }
        // Relaxed mode: another thread's unrelated driver calls (an allocation
        // for a new KV chunk, say) must not invalidate the capture.
        unsafe {
            cu::stream::begin_capture(self.stream.0, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        }
        .map_err(|e| cuda_err("cuStreamBeginCapture", e))?;
        st.capturing = Some(key);
        Ok(true)
    }

    pub(super) fn end_capture(&self, key: GraphKey) -> Result<()> {
        let mut st = self.lock();
        self.ctx.bind()?;
        st.capturing = None;
        // SAFETY: our stream, capturing since graph_capture_begin.
        let graph = unsafe { cu::stream::end_capture(self.stream.0) }
            .map_err(|e| cuda_err("cuStreamEndCapture", e))?;
        if let Some(e) = st.error.take() {
            // SAFETY: the graph was just created and is not instantiated.
            let _ = unsafe { cu::graph::destroy(graph) };
            return Err(e);
        }
        // SAFETY: a graph captured on this context.
        let exec = unsafe { cu::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) }
            .map_err(|e| cuda_err("cuGraphInstantiate", e))?;
        // The ops were only recorded; run them once so this step has its results.
        unsafe { cu::graph::launch(exec, self.stream.0) }.map_err(|e| cuda_err("cuGraphLaunch", e))?;
        st.graphs.insert(key, Captured { exec, graph });
        Ok(())
    }
}
