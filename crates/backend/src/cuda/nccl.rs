//! The collective of ranks on NVIDIA GPUs: NCCL for what moves activations
//! between cards (all-reduce, send/recv), the in-process group for what the
//! host agrees on (barrier, MIN, the gather of host logits onto the rank that
//! samples, the census).
//!
//! Every rank is a thread of this process driving one card, so the
//! communicators are made together (`ncclCommInitAll`) and each rank
//! enqueues its NCCL calls on its backend's stream, where a captured decode
//! step records them like any kernel. The census counts NCCL calls on the
//! host side when they are enqueued, in the same counters the in-process
//! group compares.
//!
//! A failure is final for the group: a rank that fails aborts every
//! communicator (its peers' kernels waiting on it end instead of spinning),
//! and every later collective reports the abort. The server then answers
//! errors until it is restarted; a GPU group is not rebuilt in place.
//!
//! NCCL's own buffers are device memory the driver hands it directly: they
//! show as residue (`nvml_self - our books`), measured at the boot mark after
//! the communicators are made.

use super::CudaBackend;
use crate::collective::{
    Census, Collective, CollectiveError, CollectiveResult, Group, GroupShape, OpKind, ThreadGroup, ThreadRank,
};
use crate::{BackendError, Result};
use corridor_units::Rank;
use cudarc::nccl::{result as nccl, sys};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The communicators of one group, one per card, destroyed together.
struct Comms {
    comms: Vec<sys::ncclComm_t>,
    aborted: AtomicBool,
}

// SAFETY: NCCL communicators may be used from any thread, one thread at a
// time per communicator (each rank's thread uses its own); abort is
// documented as callable from another thread.
unsafe impl Send for Comms {}
unsafe impl Sync for Comms {}

impl Comms {
    fn abort_all(&self) {
        if self.aborted.swap(true, Ordering::AcqRel) {
            return;
        }
        for &c in &self.comms {
            // SAFETY: a communicator made by ncclCommInitAll and not yet destroyed.
            let _ = unsafe { nccl::comm_abort(c) };
        }
    }
}

impl Drop for Comms {
    fn drop(&mut self) {
        if self.aborted.load(Ordering::Acquire) {
            return;
        }
        for &c in &self.comms {
            // SAFETY: every rank has dropped its handle, so no call is in flight.
            let _ = unsafe { nccl::comm_destroy(c) };
        }
    }
}

/// One rank's handle: its NCCL communicator and its place in the host group.
pub struct NcclRank {
    host: ThreadRank,
    comm: sys::ncclComm_t,
    comms: Arc<Comms>,
    /// Whether decode steps with NCCL calls may be captured as graphs
    /// (`CudaTuning::nccl_graphs`: off rules graphs out).
    graphs: bool,
}

// SAFETY: see `Comms`; a rank's communicator is used by its own thread only.
unsafe impl Send for NcclRank {}
unsafe impl Sync for NcclRank {}

/// The NCCL version the process loaded, as `major.minor.patch`.
pub fn nccl_version() -> Result<String> {
    // SAFETY: only asks whether the library can be opened.
    if !unsafe { sys::is_culib_present() } {
        return Err(BackendError::MissingLibrary {
            missing: "libnccl (NCCL 2.x, needed for more than one GPU)".into(),
        });
    }
    let v = nccl::get_nccl_version().map_err(|e| BackendError::Other(format!("ncclGetVersion: {e:?}")))?;
    Ok(format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100))
}

/// Make the group of ranks on `ordinals` (rank `i` drives `ordinals[i]`):
/// the in-process group for the host side and one NCCL communicator per
/// card; `graphs` (`CudaTuning::nccl_graphs`) lets decode steps with NCCL
/// calls be captured. NCCL reads its own switches from the environment; the
/// `corridor` command turns NVLink SHARP (multicast, `NCCL_NVLS_ENABLE`) off
/// unless it is set, as it allocates multicast objects outside any book.
pub fn nccl_group(
    ordinals: &[usize],
    shape: GroupShape,
    timeout: Duration,
    graphs: bool,
) -> Result<(ThreadGroup, Vec<NcclRank>)> {
    let version = nccl_version()?;
    let devs: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
    let mut raw: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); devs.len()];
    // SAFETY: `raw` has room for one communicator per device of `devs`.
    unsafe { nccl::comm_init_all(raw.as_mut_ptr(), devs.len() as i32, devs.as_ptr()) }
        .map_err(|e| BackendError::Other(format!("ncclCommInitAll over GPUs {ordinals:?}: {e:?}")))?;
    tracing::info!(nccl = %version, gpus = ?ordinals, "NCCL communicators ready");
    let comms = Arc::new(Comms { comms: raw.clone(), aborted: AtomicBool::new(false) });
    let (group, hosts) = ThreadGroup::new(ordinals.len(), shape, timeout);
    let ranks = hosts
        .into_iter()
        .zip(raw)
        .map(|(host, comm)| NcclRank { host, comm, comms: comms.clone(), graphs })
        .collect();
    Ok((group, ranks))
}

impl NcclRank {
    fn aborted(&self, op: OpKind) -> CollectiveResult<()> {
        self.host.check_aborted(op)?;
        if self.comms.aborted.load(Ordering::Acquire) {
            return Err(CollectiveError::Aborted {
                rank: self.host.rank(),
                op,
                reason: "the NCCL communicators were aborted after a failure; restart to serve again".into(),
            });
        }
        Ok(())
    }

    /// Enqueue one NCCL call on `backend`'s stream.
    fn enqueue(
        &self,
        backend: &CudaBackend,
        op: OpKind,
        f: impl FnOnce(sys::cudaStream_t) -> std::result::Result<nccl::NcclStatus, nccl::NcclError>,
    ) -> CollectiveResult<()> {
        self.aborted(op)?;
        backend.enqueue_library(op, |stream| {
            f(stream as sys::cudaStream_t)
                .map(|_| ())
                .map_err(|e| BackendError::Other(format!("NCCL {op}: {e:?}")))
        });
        Ok(())
    }
}

impl Group for NcclRank {
    fn rank(&self) -> Rank {
        self.host.rank()
    }
    fn world(&self) -> usize {
        self.host.world()
    }
    fn barrier(&self) -> CollectiveResult<()> {
        self.host.barrier()
    }
    fn min_u64(&self, value: u64) -> CollectiveResult<u64> {
        self.host.min_u64(value)
    }
    fn gathers_here(&self) -> bool {
        self.host.gathers_here()
    }
    fn gather_cols(
        &self,
        mine: &[f32],
        rows: usize,
        at: usize,
        out: Option<&mut [f32]>,
    ) -> CollectiveResult<()> {
        self.host.gather_cols(mine, rows, at, out)
    }
    fn census(&self) -> Census {
        self.host.census()
    }
    fn compare_census(&self) -> CollectiveResult<Census> {
        self.host.compare_census()
    }
    fn abort(&self, reason: &str) {
        self.host.abort(reason);
        self.comms.abort_all();
    }
}

impl Collective<CudaBackend> for NcclRank {
    /// NCCL calls are recorded into a captured step and run at each replay.
    fn capturable(&self) -> bool {
        self.graphs
    }
    fn all_reduce_sum(
        &self,
        backend: &CudaBackend,
        x: &mut super::CudaAct,
        rows: usize,
    ) -> CollectiveResult<()> {
        if self.host.shape() == GroupShape::Pipeline {
            // A stage's reduction is its own (see `ThreadRank::all_reduce_host`).
            return Ok(());
        }
        self.host.count(OpKind::AllReduce, None);
        let (ptr, count) = (x.ptr(), rows * x.cols());
        let comm = self.comm;
        self.enqueue(backend, OpKind::AllReduce, |stream| {
            // SAFETY: `count` f32s at `ptr` on this rank's card, reduced in place.
            unsafe {
                nccl::all_reduce(
                    ptr as *const _,
                    ptr as *mut _,
                    count,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    comm,
                    stream,
                )
            }
        })
    }
    fn send(&self, backend: &CudaBackend, to: Rank, x: &super::CudaAct, rows: usize) -> CollectiveResult<()> {
        self.host.check_peer(OpKind::Send, to)?;
        self.host.count(OpKind::Send, Some(to));
        let (ptr, count, comm) = (x.ptr(), rows * x.cols(), self.comm);
        self.enqueue(backend, OpKind::Send, |stream| {
            // SAFETY: `count` f32s at `ptr`, read until the send completes on this stream.
            unsafe {
                nccl::send(
                    ptr as *const _,
                    count,
                    sys::ncclDataType_t::ncclFloat32,
                    to.0 as i32,
                    comm,
                    stream,
                )
            }
        })
    }
    fn recv(
        &self,
        backend: &CudaBackend,
        from: Rank,
        x: &mut super::CudaAct,
        rows: usize,
    ) -> CollectiveResult<()> {
        self.host.check_peer(OpKind::Recv, from)?;
        self.host.count(OpKind::Recv, Some(from));
        let (ptr, count, comm) = (x.ptr(), rows * x.cols(), self.comm);
        self.enqueue(backend, OpKind::Recv, |stream| {
            // SAFETY: room for `count` f32s at `ptr` on this rank's card.
            unsafe {
                nccl::recv(
                    ptr as *mut _,
                    count,
                    sys::ncclDataType_t::ncclFloat32,
                    from.0 as i32,
                    comm,
                    stream,
                )
            }
        })
    }
}
