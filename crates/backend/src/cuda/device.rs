//! The CUDA context, its stream, and every device allocation of the backend.
//!
//! All device memory goes through [`DeviceAlloc::alloc`], which carries a
//! [`Purpose`] label, so the per-card chokepoint
//! ([`super::vram_alloc::VramAlloc`]) books each byte under weights,
//! workspace, KV, state or graphs; no code here calls a driver allocator. Buffers
//! are RAII guards without `Clone`: dropping one hands its bytes back through
//! the same allocator.

use crate::{BackendError, Result};
use corridor_units::Bytes;
use cudarc::driver::{result as cu, sys};
use std::sync::Arc;

/// What a device allocation is for; the books keep one column per purpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Purpose {
    Weights,
    Workspace,
    Kv,
    /// Recurrent state slots (a hybrid model's per-sequence state).
    State,
    Graphs,
    Other,
}

impl Purpose {
    pub fn label(self) -> &'static str {
        match self {
            Purpose::Weights => "weights",
            Purpose::Workspace => "workspace",
            Purpose::Kv => "kv",
            Purpose::State => "state",
            Purpose::Graphs => "graphs",
            Purpose::Other => "other",
        }
    }
}

/// The one way the backend obtains device memory. The caller has made the
/// backend's context current on this thread.
pub trait DeviceAlloc: Send + Sync {
    /// A device pointer to `bytes` bytes, aligned to at least 256 bytes.
    fn alloc(&self, bytes: Bytes, purpose: Purpose) -> Result<u64>;
    /// Return an allocation made by `alloc` with the same size and purpose.
    fn free(&self, ptr: u64, bytes: Bytes, purpose: Purpose);
    /// The governed card these allocations are booked on, if any.
    fn card(&self) -> Option<corridor_units::CardId> {
        None
    }
}

/// A CUDA context handle that may be shared between threads (the driver
/// allows any thread to make a context current).
#[derive(Clone, Copy, Debug)]
pub struct Ctx(pub sys::CUcontext);
// SAFETY: CUcontext is an opaque handle the driver lets any thread use.
unsafe impl Send for Ctx {}
unsafe impl Sync for Ctx {}

impl Ctx {
    /// Make this context current on the calling thread (cheap when it already is).
    pub fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained for the backend's lifetime.
        unsafe { cu::ctx::set_current(self.0) }.map_err(|e| cuda_err("cuCtxSetCurrent", e))
    }
}

/// A stream handle that may be shared between threads.
#[derive(Clone, Copy, Debug)]
pub struct Stream(pub sys::CUstream);
// SAFETY: a CUstream is an opaque handle; every use is serialized by the backend's lock.
unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

/// A device allocation, freed on drop.
pub struct DeviceBuffer {
    ptr: u64,
    bytes: Bytes,
    purpose: Purpose,
    alloc: Arc<dyn DeviceAlloc>,
    ctx: Ctx,
}

impl DeviceBuffer {
    pub fn new(
        alloc: &Arc<dyn DeviceAlloc>,
        ctx: Ctx,
        bytes: Bytes,
        purpose: Purpose,
    ) -> Result<DeviceBuffer> {
        ctx.bind()?;
        let ptr = alloc.alloc(bytes, purpose)?;
        Ok(DeviceBuffer { ptr, bytes, purpose, alloc: alloc.clone(), ctx })
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn bytes(&self) -> Bytes {
        self.bytes
    }
    pub fn purpose(&self) -> Purpose {
        self.purpose
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            self.alloc.free(self.ptr, self.bytes, self.purpose);
        }
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({:#x}, {}, {})", self.ptr, self.bytes, self.purpose.label())
    }
}

/// A driver error as a backend error naming the call that failed.
pub fn cuda_err(op: &'static str, e: cu::DriverError) -> BackendError {
    let name =
        e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    BackendError::Cuda { op, reason: name }
}

/// Kernel arguments packed into 8-byte slots: the driver reads each parameter's
/// own size from the start of its slot (little-endian), so pointers, `int`,
/// `long long` and `float` all fit without a heap allocation per launch.
pub struct Args {
    vals: [u64; ARGS_MAX],
    n: usize,
    /// Values pushed past the slots: the launch refuses such a list.
    overflow: usize,
}

/// The most parameters a kernel here takes (`attn_tile_rope_*`: 32).
pub(super) const ARGS_MAX: usize = 32;

impl Args {
    pub fn new() -> Args {
        Args { vals: [0; ARGS_MAX], n: 0, overflow: 0 }
    }
    fn push(mut self, v: u64) -> Args {
        match self.vals.get_mut(self.n) {
            Some(slot) => {
                *slot = v;
                self.n += 1;
            }
            None => self.overflow += 1,
        }
        self
    }
    pub fn ptr(self, p: u64) -> Args {
        self.push(p)
    }
    pub fn i32(self, v: i32) -> Args {
        self.push(v as u32 as u64)
    }
    pub fn i64(self, v: i64) -> Args {
        self.push(v as u64)
    }
    pub fn f32(self, v: f32) -> Args {
        self.push(v.to_bits() as u64)
    }
}

impl Default for Args {
    fn default() -> Self {
        Args::new()
    }
}

/// A loaded kernel.
#[derive(Clone, Copy, Debug)]
pub struct Kernel(pub sys::CUfunction);
// SAFETY: a CUfunction is an immutable handle into a loaded module.
unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

/// Grid and block dimensions of one launch.
#[derive(Clone, Copy, Debug)]
pub struct LaunchDims {
    pub grid: (u32, u32, u32),
    pub block: u32,
}

impl Kernel {
    /// Let launches of this kernel take `bytes` of dynamic shared memory
    /// (the driver refuses more than 48 KiB without it), and the blocks of
    /// `threads` threads with that much that fit on one SM at once.
    pub fn allow_shared(&self, bytes: u32, threads: u32) -> Result<u32> {
        use sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYNAMIC;
        // SAFETY: the function handle comes from a loaded module.
        unsafe { cu::function::set_function_attribute(self.0, MAX_DYNAMIC, bytes as i32) }
            .map_err(|e| cuda_err("cuFuncSetAttribute", e))?;
        // SAFETY: as above.
        let blocks = unsafe {
            cu::occupancy::max_active_block_per_multiprocessor(self.0, threads as i32, bytes as usize)
        }
        .map_err(|e| cuda_err("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))?;
        Ok(blocks.max(0) as u32)
    }

    /// Enqueue the kernel on `stream`. With `dependent`, the kernel may be
    /// started before the one ahead of it on the stream has finished
    /// (programmatic dependent launch, sm_90+): it must wait for it on the
    /// device before touching its results, as every kernel in
    /// `kernels/*.cu` does (`pdl_enter`).
    ///
    /// # Safety
    /// The arguments must match the kernel's signature and every pointer must
    /// be valid for what the kernel reads and writes.
    pub unsafe fn launch(
        &self,
        stream: Stream,
        dims: LaunchDims,
        args: &mut Args,
        dependent: bool,
    ) -> Result<()> {
        self.launch_shared(stream, dims, 0, args, dependent)
    }

    /// [`Kernel::launch`] with `shared` bytes of dynamic shared memory (past
    /// 48 KiB the kernel must have been allowed them: [`Kernel::allow_shared`]).
    ///
    /// # Safety
    /// As [`Kernel::launch`].
    pub unsafe fn launch_shared(
        &self,
        stream: Stream,
        dims: LaunchDims,
        shared: u32,
        args: &mut Args,
        dependent: bool,
    ) -> Result<()> {
        if args.overflow > 0 {
            return Err(BackendError::Other(format!(
                "a kernel launch with {} arguments, {ARGS_MAX} slots",
                args.n + args.overflow
            )));
        }
        let mut params: [*mut std::ffi::c_void; ARGS_MAX] = [std::ptr::null_mut(); ARGS_MAX];
        for (i, p) in params.iter_mut().enumerate().take(args.n) {
            *p = (&mut args.vals[i]) as *mut u64 as *mut std::ffi::c_void;
        }
        if dims.grid.0 == 0 || dims.grid.1 == 0 || dims.grid.2 == 0 {
            return Ok(());
        }
        if !dependent {
            return cu::launch_kernel(
                self.0,
                dims.grid,
                (dims.block, 1, 1),
                shared,
                stream.0,
                &mut params[..args.n],
            )
            .map_err(|e| cuda_err("cuLaunchKernel", e));
        }
        // SAFETY: a zeroed attribute is a valid plain-data value; id and value are set below.
        let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: dims.grid.0,
            gridDimY: dims.grid.1,
            gridDimZ: dims.grid.2,
            blockDimX: dims.block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared,
            hStream: stream.0,
            attrs: &mut attr,
            numAttrs: 1,
        };
        sys::cuLaunchKernelEx(&config, self.0, params.as_mut_ptr(), std::ptr::null_mut())
            .result()
            .map_err(|e| cuda_err("cuLaunchKernelEx", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_argument_list_past_the_slots_is_refused_before_the_driver() {
        let full = (0..ARGS_MAX as i32).fold(Args::new(), |a, i| a.i32(i));
        assert_eq!((full.n, full.overflow), (ARGS_MAX, 0));
        let mut over = full.i32(7).f32(1.0);
        assert_eq!(over.overflow, 2);
        // A null kernel and stream: the refusal comes before either is touched.
        let dims = LaunchDims { grid: (1, 1, 1), block: 32 };
        let r = unsafe {
            Kernel(std::ptr::null_mut()).launch(Stream(std::ptr::null_mut()), dims, &mut over, true)
        };
        let e = r.expect_err("34 arguments in 32 slots");
        assert!(e.to_string().contains("34 arguments"), "{e}");
    }
}
