//! Dense GEMMs through cuBLASLt: bf16 × bf16 → f32 with f32 accumulation.
//!
//! Activations are row-major `x[m, k]`, weights row-major `w[n, k]`, and the
//! result `out[m, n]` (row stride `ldc`). cuBLASLt is column-major, so the
//! product is computed as `outᵀ (n×m) = w (k×n)ᵀ · xᵀ (k×m)`: the weight is
//! operand A transposed, the activation operand B as is. Descriptors, layouts
//! and the chosen algorithm are cached per shape, so a steady-state step only
//! calls `cublasLtMatmul`.

use super::device::Ctx;
use super::device::{DeviceAlloc, DeviceBuffer, Purpose, Stream};
use crate::{BackendError, Result};
use corridor_units::Bytes;
use cudarc::cublaslt::{result as lt, sys as ltsys};
use std::collections::HashMap;
use std::sync::Arc;

/// cuBLASLt's workspace; 32 MiB is what NVIDIA recommends for Hopper.
///
/// We allocate it ourselves, through the chokepoint, and pass it to every
/// `cublasLtMatmul`: it is booked under workspace. cudarc's `CudaBlasLT::new`
/// would allocate its own 32 MiB outside the books, so it is not used; what
/// the bare handle keeps (if anything) shows up as residue.
pub const WORKSPACE: Bytes = Bytes(32 << 20);

fn lt_err(op: &'static str, e: lt::CublasError) -> BackendError {
    BackendError::Cuda { op, reason: format!("{:?}", e.0) }
}

/// The shape of one GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub ldc: usize,
}

struct Plan {
    desc: ltsys::cublasLtMatmulDesc_t,
    a: ltsys::cublasLtMatrixLayout_t,
    b: ltsys::cublasLtMatrixLayout_t,
    c: ltsys::cublasLtMatrixLayout_t,
    algo: ltsys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created once in `plan` and is destroyed once.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.c);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// A cuBLASLt handle with its workspace and per-shape plans. Used under the
/// backend's lock only.
pub struct Gemm {
    handle: ltsys::cublasLtHandle_t,
    workspace: DeviceBuffer,
    plans: HashMap<GemmShape, Plan>,
    /// `CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK` of the heuristic query
    /// (`None`: cuBLASLt's default, every scheme); the self-check's benchmark
    /// compares the split-K schemes with it.
    reduction_mask: Option<u32>,
}

// SAFETY: the handle and plans are only touched under the backend's mutex.
unsafe impl Send for Gemm {}

/// Plans kept before the cache is cleared; prefill chunk lengths vary, so the
/// number of distinct shapes is bounded only by the row limit.
const MAX_PLANS: usize = 4096;

impl Gemm {
    pub fn new(alloc: &Arc<dyn DeviceAlloc>, ctx: Ctx) -> Result<Gemm> {
        ctx.bind()?;
        let handle = lt::create_handle().map_err(|e| lt_err("cublasLtCreate", e))?;
        let workspace = DeviceBuffer::new(alloc, ctx, WORKSPACE, Purpose::Workspace)?;
        Ok(Gemm { handle, workspace, plans: HashMap::new(), reduction_mask: None })
    }

    fn plan(&mut self, s: GemmShape) -> Result<&Plan> {
        if self.plans.len() >= MAX_PLANS && !self.plans.contains_key(&s) {
            self.plans.clear();
        }
        if !self.plans.contains_key(&s) {
            let bf = ltsys::cudaDataType::CUDA_R_16BF;
            let f = ltsys::cudaDataType::CUDA_R_32F;
            let a = lt::create_matrix_layout(bf, s.k as u64, s.n as u64, s.k as i64)
                .map_err(|e| lt_err("layout A", e))?;
            let b = lt::create_matrix_layout(bf, s.k as u64, s.m as u64, s.k as i64)
                .map_err(|e| lt_err("layout B", e))?;
            let c = lt::create_matrix_layout(f, s.n as u64, s.m as u64, s.ldc as i64)
                .map_err(|e| lt_err("layout C", e))?;
            let desc = lt::create_matmul_desc(ltsys::cublasComputeType_t::CUBLAS_COMPUTE_32F, f)
                .map_err(|e| lt_err("cublasLtMatmulDescCreate", e))?;
            let mut plan = Plan { desc, a, b, c, algo: unsafe { std::mem::zeroed() } };
            let trans: i32 = 1; // CUBLAS_OP_T
            let pref = lt::create_matmul_pref().map_err(|e| lt_err("cublasLtMatmulPreferenceCreate", e))?;
            let ws = self.workspace.bytes().0 as usize;
            // SAFETY: live handles, attribute buffers of the documented sizes.
            let heuristic = unsafe {
                lt::set_matmul_desc_attribute(
                    desc,
                    ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                    (&trans) as *const i32 as *const _,
                    4,
                )
                .map_err(|e| lt_err("TRANSA", e))?;
                lt::set_matmul_pref_attribute(
                    pref,
                    ltsys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    (&ws) as *const usize as *const _,
                    std::mem::size_of::<usize>(),
                )
                .map_err(|e| lt_err("MAX_WORKSPACE", e))?;
                if let Some(mask) = &self.reduction_mask {
                    lt::set_matmul_pref_attribute(
                        pref,
                        ltsys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                        mask as *const u32 as *const _,
                        4,
                    )
                    .map_err(|e| lt_err("REDUCTION_SCHEME_MASK", e))?;
                }
                let h = lt::get_matmul_algo_heuristic(self.handle, desc, a, b, c, c, pref);
                let _ = lt::destroy_matmul_pref(pref);
                h.map_err(|e| lt_err("cublasLtMatmulAlgoGetHeuristic", e))?
            };
            plan.algo = heuristic.algo;
            self.plans.insert(s, plan);
        }
        Ok(&self.plans[&s])
    }

    /// Restrict the split-K reduction schemes later plans may use (a mask of
    /// `cublasLtReductionScheme_t` bits; `None`: all); the plans made so far
    /// are dropped.
    pub fn set_reduction_mask(&mut self, mask: Option<u32>) {
        if self.reduction_mask != mask {
            self.reduction_mask = mask;
            self.plans.clear();
        }
    }

    /// `out[m, n] (row stride ldc) = x[m, k] · w[n, k]ᵀ`, x and w bf16, out f32.
    pub fn matmul(&mut self, stream: Stream, s: GemmShape, x: u64, w: u64, out: u64) -> Result<()> {
        let (ws, ws_bytes, handle) = (self.workspace.ptr(), self.workspace.bytes().0 as usize, self.handle);
        let plan = self.plan(s)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: pointers are device buffers of the sizes the layouts describe.
        unsafe {
            lt::matmul(
                handle,
                plan.desc,
                (&alpha) as *const f32 as *const _,
                (&beta) as *const f32 as *const _,
                w as *const _,
                plan.a,
                x as *const _,
                plan.b,
                out as *const _,
                plan.c,
                out as *mut _,
                plan.c,
                &plan.algo,
                ws as *mut _,
                ws_bytes,
                stream.0 as ltsys::cudaStream_t,
            )
        }
        .map_err(|e| lt_err("cublasLtMatmul", e))
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}
