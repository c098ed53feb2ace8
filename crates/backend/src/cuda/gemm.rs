//! Dense GEMMs through cuBLASLt: bf16 × bf16 → f32 with f32 accumulation.
//!
//! Activations are row-major `x[m, k]`, weights row-major `w[n, k]`, and the
//! result `out[m, n]` (row stride `ldc`). cuBLASLt is column-major, so the
//! product is computed as `outᵀ (n×m) = w (k×n)ᵀ · xᵀ (k×m)`: the weight is
//! operand A transposed, the activation operand B as is. Descriptors, layouts
//! and the chosen algorithm are cached per shape, so a steady-state step only
//! calls `cublasLtMatmul`. Mixed and prefill steps bring row counts never
//! seen before (a chunk of a prompt beside the decodes), and the heuristic's
//! query for each costs the host 240-370 µs (H100, `cuda_check
//! --bench-gemm-plans`). Such a shape could take the algorithm the heuristic
//! chose for a shape of nearby row count (the same bucket, `row_bucket`) once
//! cuBLASLt confirms it runs this one (`cublasLtMatmulAlgoCheck`): 11-13 µs
//! of host time, but in the same run those algorithms ran the GEMMs 1.3 to
//! 1.5 times slower than the heuristic's own choice for each shape (32 shapes
//! of 400-431 rows, 4096 to 14336 wide), so sharing is off
//! (`share_algos`) and kept for that benchmark.

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
    /// The heuristic's algorithm per (n, k, ldc, `row_bucket(m)`).
    algos: HashMap<(usize, usize, usize, usize), ltsys::cublasLtMatmulAlgo_t>,
    /// Whether a new shape may take its bucket's algorithm (off, the
    /// default: the heuristic for every new shape; the self-check's
    /// benchmark compares).
    share_algos: bool,
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

/// The row count whose bucket holds `m` rows: buckets an eighth of the next
/// power of two wide (at least 16 rows), so a shape shares its algorithm only
/// with shapes less than a quarter of its rows away, where the heuristic's
/// choice (tile, split) is the same or near it.
fn row_bucket(m: usize) -> usize {
    let step = (m.next_power_of_two() / 8).max(16);
    m.div_ceil(step) * step
}

impl Gemm {
    pub fn new(alloc: &Arc<dyn DeviceAlloc>, ctx: Ctx) -> Result<Gemm> {
        ctx.bind()?;
        let handle = lt::create_handle().map_err(|e| lt_err("cublasLtCreate", e))?;
        let workspace = DeviceBuffer::new(alloc, ctx, WORKSPACE, Purpose::Workspace)?;
        Ok(Gemm {
            handle,
            workspace,
            plans: HashMap::new(),
            algos: HashMap::new(),
            share_algos: false,
            reduction_mask: None,
        })
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
            // SAFETY: a zeroed algorithm is plain data, overwritten below before any use.
            let mut plan = Plan { desc, a, b, c, algo: unsafe { std::mem::zeroed() } };
            let trans: i32 = 1; // CUBLAS_OP_T
            let ws = self.workspace.bytes().0 as usize;
            // SAFETY: a live descriptor, an attribute buffer of the documented size.
            unsafe {
                lt::set_matmul_desc_attribute(
                    desc,
                    ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                    (&trans) as *const i32 as *const _,
                    4,
                )
            }
            .map_err(|e| lt_err("TRANSA", e))?;
            let bucket = (s.n, s.k, s.ldc, row_bucket(s.m));
            let shared = match self.algos.get(&bucket) {
                Some(algo) if self.share_algos && self.runs(&plan, algo, ws) => Some(*algo),
                _ => None,
            };
            if let Some(algo) = shared {
                plan.algo = algo;
                self.plans.insert(s, plan);
                return Ok(&self.plans[&s]);
            }
            let pref = lt::create_matmul_pref().map_err(|e| lt_err("cublasLtMatmulPreferenceCreate", e))?;
            // SAFETY: live handles, attribute buffers of the documented sizes.
            let heuristic = unsafe {
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
            self.algos.insert(bucket, heuristic.algo);
            self.plans.insert(s, plan);
        }
        Ok(&self.plans[&s])
    }

    /// Whether cuBLASLt runs `algo` for `plan`'s shape within `ws` bytes of workspace.
    fn runs(&self, plan: &Plan, algo: &ltsys::cublasLtMatmulAlgo_t, ws: usize) -> bool {
        // SAFETY: a zeroed result is plain data the call fills.
        let mut result: ltsys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        // SAFETY: live handles and descriptors of this plan; `algo` came from the heuristic.
        let status = unsafe {
            ltsys::cublasLtMatmulAlgoCheck(
                self.handle,
                plan.desc,
                plan.a,
                plan.b,
                plan.c,
                plan.c,
                algo,
                &mut result,
            )
        };
        status == ltsys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && result.workspaceSize <= ws
    }

    /// Let new shapes take their row bucket's algorithm (`true`) or ask the
    /// heuristic for each (`false`, the default); forgets every plan either way.
    pub fn share_algos(&mut self, on: bool) {
        self.share_algos = on;
        self.forget_plans();
    }

    /// Drop every plan and remembered algorithm (the next matmul of each
    /// shape plans again).
    pub fn forget_plans(&mut self) {
        self.plans.clear();
        self.algos.clear();
    }

    /// Restrict the split-K reduction schemes later plans may use (a mask of
    /// `cublasLtReductionScheme_t` bits; `None`: all); the plans made so far
    /// are dropped.
    pub fn set_reduction_mask(&mut self, mask: Option<u32>) {
        if self.reduction_mask != mask {
            self.reduction_mask = mask;
            self.forget_plans();
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

#[cfg(test)]
mod tests {
    use super::row_bucket;

    #[test]
    fn a_row_bucket_is_an_eighth_of_the_next_power_of_two_at_least_16_rows() {
        // Decode-sized shapes: buckets of 16.
        assert_eq!((row_bucket(1), row_bucket(16), row_bucket(17), row_bucket(128)), (16, 16, 32, 128));
        // A chunk beside 128 decodes: 640 and 600 rows share a bucket, 700 does not.
        assert_eq!((row_bucket(600), row_bucket(640), row_bucket(700)), (640, 640, 768));
        // Every row count lies in its bucket, less than a quarter of it (or 16 rows) below its top.
        for m in 1..5000 {
            let b = row_bucket(m);
            assert!(b >= m && (b - m) * 4 < b.max(64), "{m} -> {b}");
        }
    }
}
