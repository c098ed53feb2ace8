//! The routed expert FFN on the device (kernels/moe.cu): routing, grouping
//! and the experts' SwiGLU without a host sync, so a decode step of a
//! mixture-of-experts model can be captured like a dense one.
//!
//! Each sparse layer gets a [`CudaExperts`] at load: a device table of its
//! experts' gate, up and down addresses, so one launch reaches any expert
//! the router chose. A step then runs the router matmul (the ordinary
//! matmul), `moe_route`, `moe_sort`, gate/up/SiLU and down over the pairs
//! grouped by expert, and `moe_combine`. Up to [`MOE_GEMV_MAX_ROWS`] rows
//! take the routed GEMVs (every chosen expert's weights read once, in f32
//! arithmetic, nothing of the other experts); more rows take the grouped
//! bf16 tensor-core GEMM. The routed GEMVs of bf16 experts whose rows are
//! whole 16-byte chunks keep many loads in flight per thread (kernels/moe.cu,
//! "Routed GEMVs of bf16 experts"); gate/up and down choose them each on its
//! own, and other types and widths take the kernels of any storage type.
//! Layers whose experts mix storage types, or whose sizes the kernels do not
//! take, fall back to the unfused op.
//!
//! The routing metadata lives in the scratch's `meta` buffer, laid out by
//! [`MetaLayout`] from the scratch's `MoeShape` (the same for every step).

use super::device::{Args, DeviceBuffer, LaunchDims, Purpose};
use super::kernels::{dtype_code, mmvq_index, MvKernel};
use super::matmul::{mmvq_groups, q8_layout, Q8Input, GEMV_MAX_ROWS, MMVQ_MAX_GROUPS, MMVQ_NW, MMVQ_WARPS};
use super::{CudaAct, CudaBackend, CudaWeight};
use crate::dtype::DType;
use crate::moe::{unfused, Expert, MoeFfn, MoeShape, MOE_TILE_ROWS};
use crate::{Backend, BackendError, Result};

/// Token rows up to which the routed GEMVs run; more take the grouped GEMM.
/// Up to as many rows are routed and grouped by one block in one launch.
pub const MOE_GEMV_MAX_ROWS: usize = crate::moe::MOE_DECODE_ROWS;

/// Token rows up to which down and the weighted sum are one launch (each
/// row's warps read their experts' down rows; beyond, rows would share
/// experts and re-read them, so down runs per expert and a sum follows).
const MOE_FUSED_DOWN_ROWS: usize = 2;

/// Warps per block of the routed GEMVs of any storage type (kernels/moe.cu MOE_GEMV_WARPS).
const MOE_GEMV_WARPS: usize = 8;

/// The bf16 gate/up GEMV: warps per block and the outputs a block owns
/// (kernels/moe.cu MOE_GU_WARPS, MOE_GU_COLS).
const MOE_GU_WARPS: usize = 4;
const MOE_GU_COLS: usize = 4;

/// The bf16 down GEMVs: warps per block and the down rows a warp holds
/// (kernels/moe.cu MOE_DN_WARPS, MOE_DN_ROWS).
const MOE_DN_WARPS: usize = 8;
const MOE_DN_ROWS: usize = 4;

/// Token rows up to which the bf16 GEMVs take an expert's pairs one at a
/// time (`_p1`: the fewer registers, twice the blocks per SM; a second pair
/// re-reads the expert's weights from L2). At 8 rows of 128 experts top 8,
/// routed uniformly, an expert in use has 1.24 pairs on average; beyond,
/// `_p4` shares each weight load between four pairs.
const MOE_GEMV_SINGLE_ROWS: usize = 8;

/// Outputs per block of the grouped GEMM (kernels/moe.cu MOE_BN).
const MOE_BN: usize = 64;

/// Experts `moe_sort` can group (its shared counters, kernels/moe.cu MOE_MAX_EXPERTS).
const MOE_MAX_EXPERTS: usize = 1024;

/// Which form of the expert kernels a step takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoePath {
    /// The routed GEMVs (decode).
    Gemv,
    /// The grouped tensor-core GEMM (prefill).
    Gemm,
}

impl MoePath {
    pub fn for_rows(rows: usize) -> MoePath {
        if rows <= MOE_GEMV_MAX_ROWS {
            MoePath::Gemv
        } else {
            MoePath::Gemm
        }
    }
}

/// One sparse layer's experts as the kernels address them.
pub struct CudaExperts {
    /// `u64 [num_experts][3]`: gate, up, down of each expert. `None`: the
    /// experts cannot go through the kernels; the layer runs unfused.
    table: Option<DeviceBuffer>,
    num_experts: usize,
    /// gate and up: `[ffn, hidden]`, one storage type and row stride.
    gate_up: (DType, usize),
    /// down: `[hidden, ffn]`.
    down: (DType, usize),
    ffn: usize,
    hidden: usize,
    /// gate/up and down take the bf16 routed GEMVs: bf16 rows of whole
    /// 16-byte chunks (a multiple of 8 weights, 16-byte strides and starts).
    bf16_gate_up: bool,
    bf16_down: bool,
    /// gate/up and down take the routed integer GEMVs (kernels/moe_q8.cu):
    /// their indexes in `MMVQ_FORMATS`.
    q8: Option<(usize, usize)>,
}

impl CudaExperts {
    /// Whether the layer runs through the kernels (not the unfused op).
    pub fn on_device(&self) -> bool {
        self.table.is_some()
    }

    /// Whether decode steps take the routed integer GEMVs (block-format
    /// experts: their input rows and SiLU products in 8 bits).
    pub fn integer_gemvs(&self) -> bool {
        self.table.is_some() && self.q8.is_some()
    }

    /// The layer's decode without the routed integer GEMVs (the routed GEMVs
    /// of any storage type), for a benchmark of both on one backend.
    pub(super) fn without_integer_gemvs(mut self) -> CudaExperts {
        self.q8 = None;
        self
    }
}

/// Word offsets of the routing metadata inside the scratch's `meta`.
#[derive(Clone, Copy, Debug)]
struct MetaLayout {
    ids: usize,
    wts: usize,
    pos_of_pair: usize,
    pair_of_pos: usize,
    n_active: usize,
    n_tiles: usize,
    active: usize,
    tiles: usize,
}

impl MetaLayout {
    fn of(s: &MoeShape) -> MetaLayout {
        let (p, e) = (s.max_pairs(), s.routing.num_experts);
        // As `MoeShape::meta_words` counts them: the per-expert counts and
        // offsets (2 (e + 1) words) are kept free for a kernel that wants them.
        let ids = 0;
        let wts = ids + p;
        let pos_of_pair = wts + p;
        let pair_of_pos = pos_of_pair + p;
        let n_active = pair_of_pos + p + 2 * (e + 1);
        let n_tiles = n_active + 1;
        let active = n_tiles + 1;
        let tiles = active + 3 * e;
        MetaLayout { ids, wts, pos_of_pair, pair_of_pos, n_active, n_tiles, active, tiles }
    }
}

/// Tile slots the grouped GEMM launches for `pairs` pairs of `experts`
/// experts: whole tiles of the pairs plus one partial tile per expert used.
fn tile_slots(pairs: usize, experts: usize) -> usize {
    pairs.div_ceil(MOE_TILE_ROWS) + experts.min(pairs)
}

impl CudaBackend {
    pub(super) fn build_expert_table(&self, experts: &[Expert<CudaWeight>]) -> Result<CudaExperts> {
        let Some(first) = experts.first() else {
            return Err(BackendError::Other("a sparse layer without experts".into()));
        };
        let (ffn, hidden) = (first.gate_proj.rows, first.gate_proj.cols);
        let gate_up = (first.gate_proj.dtype, first.gate_proj.row_bytes);
        let down = (first.down_proj.dtype, first.down_proj.row_bytes);
        let same = |w: &CudaWeight, rows: usize, cols: usize, (dt, rb): (DType, usize)| {
            w.rows == rows && w.cols == cols && w.dtype == dt && w.row_bytes == rb
        };
        let uniform = experts.iter().all(|x| {
            same(&x.gate_proj, ffn, hidden, gate_up)
                && same(&x.up_proj, ffn, hidden, gate_up)
                && same(&x.down_proj, hidden, ffn, down)
        });
        // Vectors are f32 on this backend and the kernels read matrices only.
        let kernel_types = [gate_up.0, down.0].iter().all(|&d| d != DType::F32 && d != DType::F16);
        let fits = uniform && kernel_types && experts.len() <= MOE_MAX_EXPERTS && ffn > 1 && hidden > 1;
        let table = if fits {
            let ptrs: Vec<u64> = experts
                .iter()
                .flat_map(|x| [x.gate_proj.ptr(), x.up_proj.ptr(), x.down_proj.ptr()])
                .collect();
            self.ctx.bind()?;
            let buf = self.alloc_buf(ptrs.len() * 8, Purpose::Weights)?;
            self.upload(buf.ptr(), &ptrs)?;
            self.synchronize()?;
            Some(buf)
        } else {
            None
        };
        let chunked = |w: &CudaWeight| {
            w.dtype == DType::BF16
                && w.cols.is_multiple_of(8)
                && w.row_bytes.is_multiple_of(16)
                && w.ptr().is_multiple_of(16)
        };
        let bf16_gate_up = experts.iter().all(|x| chunked(&x.gate_proj) && chunked(&x.up_proj));
        let bf16_down = experts.iter().all(|x| chunked(&x.down_proj));
        // The integer GEMVs read whole blocks of 32 activations, and Q4_K and
        // Q5_K straight into registers from 16-byte aligned rows (kernels/mmvq.cu).
        let q8_ok = |w: &CudaWeight| {
            let aligned = !matches!(w.dtype, DType::Q4_K | DType::Q5_K)
                || (w.ptr().is_multiple_of(16) && w.row_bytes.is_multiple_of(16));
            w.dtype.is_quantized() && w.cols.is_multiple_of(32) && aligned
        };
        let q8_all = experts.iter().all(|x| q8_ok(&x.gate_proj) && q8_ok(&x.up_proj) && q8_ok(&x.down_proj));
        let q8 = match (mmvq_index(gate_up.0), mmvq_index(down.0)) {
            (Some(g), Some(d)) if q8_all && self.config.tuning.q8_gemv && self.config.tuning.moe_q8 => {
                Some((g, d))
            }
            _ => None,
        };
        Ok(CudaExperts {
            table,
            num_experts: experts.len(),
            gate_up,
            down,
            ffn,
            hidden,
            bf16_gate_up,
            bf16_down,
            q8,
        })
    }

    pub(super) fn enqueue_moe_ffn(&self, p: MoeFfn<'_, Self>) -> Result<()> {
        let path = MoePath::for_rows(p.rows);
        self.moe_ffn_with(p, path)
    }

    /// [`Backend::moe_ffn`](crate::Backend::moe_ffn) through the kernels of `path`.
    pub(super) fn moe_ffn_with(&self, p: MoeFfn<'_, Self>, path: MoePath) -> Result<()> {
        let t = p.table;
        let Some(table) = &t.table else {
            return unfused::moe_ffn(self, p);
        };
        let MoeFfn { x, router, routing, rows, scratch: m, out, .. } = p;
        let shape = m.shape;
        let (e, k) = (routing.num_experts, routing.top_k);
        let bad = |what: String| Err(BackendError::Other(format!("moe_ffn: {what}")));
        if e != t.num_experts || k == 0 || k > e || shape.routing != routing {
            return bad(format!(
                "{} experts routed top {k}, the layer has {} and its scratch {:?}",
                e, t.num_experts, shape.routing
            ));
        }
        if rows > shape.max_rows || x.cols != t.hidden || out.cols != t.hidden || shape.hidden != t.hidden {
            return bad(format!(
                "{rows} rows of width {} into width {} for experts of {}x{} (scratch {:?})",
                x.cols, out.cols, t.ffn, t.hidden, shape
            ));
        }
        // The kernels index these buffers by the shape: each must hold it.
        let holds = |a: &CudaAct, rows: usize, cols: usize| a.rows * a.cols >= rows * cols;
        let pairs_max = shape.max_pairs();
        let fits = holds(x, rows, t.hidden)
            && holds(out, rows, t.hidden)
            && holds(&m.router, shape.max_rows, e)
            && holds(&m.act, pairs_max, t.ffn)
            && holds(&m.y, pairs_max, t.hidden)
            && holds(&m.meta, 1, shape.meta_words());
        if shape.expert_ffn != t.ffn || !fits {
            return bad(format!("scratch {shape:?} for experts of ffn {} and {rows} rows", t.ffn));
        }
        if rows == 0 {
            return Ok(());
        }
        let pairs = rows * k;
        let l = MetaLayout::of(&shape);
        let w = |off: usize| m.meta.ptr() + 4 * off as u64;
        let (gu_dt, gu_rb) = (dtype_code(t.gate_up.0), t.gate_up.1 as i64);
        let (dn_dt, dn_rb) = (dtype_code(t.down.0), t.down.1 as i64);
        let (hidden, ffn) = (t.hidden, t.ffn);
        let slots = e.min(pairs) as u32;

        self.matmul(x, router, None, rows, &mut m.router);
        // The rows in 8 bits for block-format experts, before any op forgets
        // the copy the norm before may have stored.
        let xq = match (path, t.q8) {
            (MoePath::Gemv, Some(_)) => self.moe_q8_input(x, rows, &m.q8, &shape),
            _ => None,
        };
        let router_out: &CudaAct = &m.router;
        let sort_args = |a: Args| {
            a.ptr(w(l.pos_of_pair))
                .ptr(w(l.pair_of_pos))
                .ptr(w(l.n_active))
                .ptr(w(l.active))
                .ptr(w(l.n_tiles))
                .ptr(w(l.tiles))
        };
        let route_args = || {
            Args::new()
                .ptr(router_out.ptr())
                .i32(rows as i32)
                .i32(e as i32)
                .i32(k as i32)
                .i32(i32::from(routing.norm_topk_prob))
                .ptr(w(l.ids))
                .ptr(w(l.wts))
        };
        let one_block = LaunchDims { grid: (1, 1, 1), block: 1024 };
        if rows <= MOE_GEMV_MAX_ROWS {
            // One row is routed by one warp with nothing to group (kernels/moe.cu).
            let dims = if rows == 1 { LaunchDims { grid: (1, 1, 1), block: 32 } } else { one_block };
            self.op("moe_route_sort", |_| unsafe {
                self.launch(self.k.moe_route_sort, dims, sort_args(route_args()))
            });
        } else {
            self.op("moe_route + moe_sort", |_| {
                let dims = LaunchDims { grid: (rows.div_ceil(4) as u32, 1, 1), block: 128 };
                unsafe { self.launch(self.k.moe_route, dims, route_args())? };
                let a = sort_args(Args::new().ptr(w(l.ids)).i32(pairs as i32).i32(e as i32));
                unsafe { self.launch(self.k.moe_sort, one_block, a) }
            });
        }
        let (act, ys) = (m.act.ptr(), m.y.ptr());
        if let (MoePath::Gemv, Some(q8), Some(xq)) = (path, t.q8, xq) {
            let at = q8_layout(rows, hidden).bytes.next_multiple_of(16) as u64;
            let aq = Q8Input::at(m.q8.ptr() + at, rows * k, ffn);
            let kernels = (self.k.moe_q8[q8.0][0], self.k.moe_q8[q8.1][1]);
            return self.moe_q8_experts(
                table.ptr(),
                t,
                kernels,
                (xq, aq),
                (rows, k, slots),
                w,
                l,
                (act, ys),
                out.ptr(),
            );
        }
        match path {
            MoePath::Gemv => self.op("moe experts (routed gemv)", |_| {
                // Which instantiation of the bf16 GEMVs: `_p1` or `_p4`.
                let np = usize::from(rows > MOE_GEMV_SINGLE_ROWS);
                let dims = |x: usize, y: u32, warps: usize| LaunchDims {
                    grid: (x as u32, y, 1),
                    block: (warps * 32) as u32,
                };
                let a = Args::new().ptr(table.ptr());
                let (kernel, a, d) = if t.bf16_gate_up {
                    let d = dims(ffn.div_ceil(MOE_GU_COLS), slots, MOE_GU_WARPS);
                    (self.k.moe_gemv_gate_up_bf16[np], a.i64(gu_rb), d)
                } else {
                    let d = dims(ffn.div_ceil(MOE_GEMV_WARPS), slots, MOE_GEMV_WARPS);
                    (self.k.moe_gemv_gate_up, a.i32(gu_dt).i64(gu_rb), d)
                };
                let a = a
                    .ptr(x.ptr())
                    .i32(hidden as i32)
                    .i32(ffn as i32)
                    .i32(k as i32)
                    .ptr(w(l.pair_of_pos))
                    .ptr(w(l.n_active))
                    .ptr(w(l.active))
                    .ptr(act);
                unsafe { self.launch(kernel, d, a)? };
                // At one row the warp-per-output down + sum measured faster than the
                // bf16 kernel's blocks of experts (H200, 30B-A3B: 12.3 against 14.3 µs).
                let bf16_down = t.bf16_down && rows > 1;
                let a = Args::new().ptr(table.ptr());
                let a = if bf16_down { a } else { a.i32(dn_dt) };
                let a = a.i64(dn_rb).ptr(act).i32(ffn as i32).i32(hidden as i32);
                let rows_y = rows as u32;
                if rows <= MOE_FUSED_DOWN_ROWS {
                    let a = a.i32(k as i32).ptr(w(l.ids)).ptr(w(l.wts)).ptr(w(l.pos_of_pair)).ptr(out.ptr());
                    let (kernel, d) = if bf16_down {
                        let d = dims(hidden.div_ceil(MOE_DN_ROWS), rows_y, MOE_DN_WARPS);
                        (self.k.moe_gemv_down_combine_bf16, d)
                    } else {
                        let d = dims(hidden.div_ceil(MOE_GEMV_WARPS), rows_y, MOE_GEMV_WARPS);
                        (self.k.moe_gemv_down_combine, d)
                    };
                    return unsafe { self.launch(kernel, d, a) };
                }
                let a = a.ptr(w(l.n_active)).ptr(w(l.active)).ptr(ys);
                let (kernel, d) = if bf16_down {
                    let d = dims(hidden.div_ceil(MOE_DN_WARPS * MOE_DN_ROWS), slots, MOE_DN_WARPS);
                    (self.k.moe_gemv_down_bf16[np], d)
                } else {
                    (self.k.moe_gemv_down, dims(hidden.div_ceil(MOE_GEMV_WARPS), slots, MOE_GEMV_WARPS))
                };
                unsafe { self.launch(kernel, d, a)? };
                self.combine(ys, w(l.wts), w(l.pos_of_pair), k, hidden, rows, out.ptr())
            }),
            MoePath::Gemm => self.op("moe experts (grouped gemm)", |_| {
                let tiles = tile_slots(pairs, e) as u32;
                let a = Args::new()
                    .ptr(table.ptr())
                    .i32(gu_dt)
                    .i64(gu_rb)
                    .ptr(x.ptr())
                    .i32(hidden as i32)
                    .i32(ffn as i32)
                    .i32(k as i32)
                    .ptr(w(l.pair_of_pos))
                    .ptr(w(l.n_tiles))
                    .ptr(w(l.tiles))
                    .ptr(act);
                let dims = LaunchDims { grid: (ffn.div_ceil(MOE_BN) as u32, tiles, 1), block: 128 };
                unsafe { self.launch(self.k.moe_gemm_gate_up, dims, a)? };
                let a = Args::new()
                    .ptr(table.ptr())
                    .i32(dn_dt)
                    .i64(dn_rb)
                    .ptr(act)
                    .i32(ffn as i32)
                    .i32(hidden as i32)
                    .ptr(w(l.n_tiles))
                    .ptr(w(l.tiles))
                    .ptr(ys);
                let dims = LaunchDims { grid: (hidden.div_ceil(MOE_BN) as u32, tiles, 1), block: 128 };
                unsafe { self.launch(self.k.moe_gemm_down, dims, a)? };
                self.combine(ys, w(l.wts), w(l.pos_of_pair), k, hidden, rows, out.ptr())
            }),
        }
        Ok(())
    }

    /// The first `rows` rows of `x` in 8 bits for the integer expert GEMVs:
    /// the copy an op before stored, or quantized now into the integer GEMVs'
    /// scratch, or for more rows than that holds into the start of `q8`
    /// (`MoeShape::q8_words`). `None` if neither can hold them.
    fn moe_q8_input(&self, x: &CudaAct, rows: usize, q8: &CudaAct, shape: &MoeShape) -> Option<Q8Input> {
        let mut input = None;
        self.matmul_op("moe q8 input", |st| {
            if rows <= GEMV_MAX_ROWS {
                // A scratch too small (it is sized for the widest activation) leaves the
                // layer to the other GEMVs rather than failing the step.
                input = self.q8_input(st, x, rows).ok();
                return Ok(());
            }
            let layout = q8_layout(rows, shape.hidden);
            if rows > MOE_GEMV_MAX_ROWS || x.cols != shape.hidden || 4 * shape.q8_words() < layout.bytes {
                return Ok(());
            }
            let q = Q8Input::at(q8.ptr(), rows, shape.hidden);
            self.q8_quantize(x.ptr(), q, rows)?;
            input = Some(q);
            Ok(())
        });
        input
    }

    /// The experts of block formats through the routed integer GEMVs
    /// (kernels/moe_q8.cu), after routing: gate/up/SiLU into `act`, its rows
    /// quantized into `aq`, down into `ys`, and the weighted sum into `out`.
    #[allow(clippy::too_many_arguments)]
    fn moe_q8_experts(
        &self,
        table: u64,
        t: &CudaExperts,
        (gu, dn): (MvKernel, MvKernel),
        (xq, aq): (Q8Input, Q8Input),
        (rows, k, slots): (usize, usize, u32),
        w: impl Fn(usize) -> u64,
        l: MetaLayout,
        (act, ys): (u64, u64),
        out: u64,
    ) -> Result<()> {
        let (hidden, ffn, pairs) = (t.hidden, t.ffn, rows * k);
        let nw = MMVQ_NW[0];
        self.op("moe experts (routed integer gemv)", |_| {
            // Blocks for about one wave over the experts in use, as a dense GEMV's.
            let groups = |kern: MvKernel, rows_each: usize, max: usize| {
                mmvq_groups(slots as usize * rows_each.div_ceil(nw), kern.per_sm * self.sm_count, max)
            };
            let g = groups(gu, ffn, MMVQ_MAX_GROUPS[0] / 2);
            let dims = LaunchDims { grid: (ffn.div_ceil(nw * g) as u32, slots, 1), block: 32 * MMVQ_WARPS };
            let a = Args::new().ptr(table).i64(t.gate_up.1 as i64).ptr(xq.codes).ptr(xq.scales);
            let a = a.i32(hidden as i32).i32(ffn as i32).i32(k as i32).ptr(w(l.pair_of_pos));
            let a = a.ptr(w(l.n_active)).ptr(w(l.active)).ptr(act).i32(g as i32);
            unsafe { self.launch(gu.k, dims, a)? };
            self.q8_quantize(act, aq, pairs)?;
            let g = groups(dn, hidden, MMVQ_MAX_GROUPS[0]);
            let dims =
                LaunchDims { grid: (hidden.div_ceil(nw * g) as u32, slots, 1), block: 32 * MMVQ_WARPS };
            let a = Args::new().ptr(table).i64(t.down.1 as i64).ptr(aq.codes).ptr(aq.scales);
            let a = a
                .i32(ffn as i32)
                .i32(hidden as i32)
                .ptr(w(l.n_active))
                .ptr(w(l.active))
                .ptr(ys)
                .i32(g as i32);
            unsafe { self.launch(dn.k, dims, a)? };
            self.combine(ys, w(l.wts), w(l.pos_of_pair), k, hidden, rows, out)
        });
        Ok(())
    }

    /// `moe_combine`: each row's weighted sum of its pairs' expert outputs.
    #[allow(clippy::too_many_arguments)]
    fn combine(
        &self,
        ys: u64,
        wts: u64,
        pos_of_pair: u64,
        k: usize,
        hidden: usize,
        rows: usize,
        out: u64,
    ) -> Result<()> {
        let a = Args::new().ptr(ys).ptr(wts).ptr(pos_of_pair).i32(k as i32).i32(hidden as i32).ptr(out);
        unsafe { self.launch(self.k.moe_combine, LaunchDims { grid: (rows as u32, 1, 1), block: 256 }, a) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Routing;

    #[test]
    fn the_metadata_sections_fit_the_words_the_scratch_holds() {
        for (max_rows, e, k) in [(1, 4, 2), (300, 128, 8), (512, 128, 8), (7, 1024, 32)] {
            let s = MoeShape {
                max_rows,
                hidden: 64,
                expert_ffn: 32,
                routing: Routing { num_experts: e, top_k: k, norm_topk_prob: true },
            };
            let l = MetaLayout::of(&s);
            let p = max_rows * k;
            let end = l.tiles + 3 * tile_slots(p, e);
            assert!(end <= s.meta_words(), "{s:?}: {end} words of {}", s.meta_words());
            assert!(l.active + 3 * e <= l.tiles && l.pair_of_pos + p <= l.n_active);
        }
    }

    #[test]
    fn tile_slots_cover_any_grouping_of_the_pairs() {
        // Groupings of pairs over three experts, around the tile size.
        let t = MOE_TILE_ROWS;
        for counts in [[10, 0, 0], [t - 1, t + 1, 1], [t, t, t], [2 * t + 1, 1, 1]] {
            let pairs: usize = counts.iter().sum();
            let used = counts.iter().filter(|&&c| c > 0).count();
            let need: usize = counts.iter().map(|c| c.div_ceil(t)).sum();
            assert!(need <= tile_slots(pairs, used), "{counts:?}");
        }
    }
}
