//! Attention and paged KV: the KV stores (buffers of their own or layers of
//! the card's KV arena), the step's per-row and per-sequence maps that the
//! kernels read page tables through, the KV writes (alone or fused with
//! RoPE), and the attention kernels of kernels/attention.cu.
//!
//! KV is bf16, per layer `[pages, page_size, kv_heads, head_dim]` for K and
//! V. Attention is causal per row and grouped-query. Sequences that bring at
//! least `TILED_MIN_ROWS` rows to a step go through the tiled tensor-core
//! kernel (64 query rows per block, K/V streamed through shared memory,
//! online softmax; head dims 64, 128 and 256, the last as two blocks per tile
//! that each write half of the output); every other row (decode, short
//! chunks, other head dims, and everything inside a graph capture) through
//! the split-K kernel over the context (flash-decoding), whose splits the
//! last of its blocks to finish merges (or, with `--cuda-attn-merge off`, a
//! combine pass after it).

use super::device::{cuda_err, Args, DeviceBuffer, Kernel, LaunchDims, Purpose};
use super::graphs::drop_graphs;
use super::matmul::Q8Input;
use super::{CudaAct, CudaBackend, State};
use crate::kv_units::KvAddressing;
use crate::{BackendError, KvGeometry, QkNorm, Result, RopeAttention, RopeStyle, RopeTable, SeqStep};
use corridor_units::PageId;
use corridor_vram::KvArena;
use cudarc::driver::result as cu;
use std::sync::Arc;

/// A sequence with at least this many rows in a step is attended by the tiled
/// prefill kernel; below it the tile's tensor-core work is mostly padding.
pub const TILED_MIN_ROWS: usize = 16;

/// Query rows per block of the tiled prefill kernel (kernels/attention.cu FA_BM).
pub(super) const TILE_ROWS: usize = 64;

/// Threads per block of the tiled prefill kernel (FA_WARPS warps).
pub(super) const TILE_THREADS: u32 = 128;

/// Blocks per tile and head of the head_dim-256 prefill kernel, each writing
/// 256 / 2 output dimensions (kernels/attention.cu `ATTN_PREFILL(256, 128, 32)`):
/// the whole head's Q fragments and O accumulators do not fit one thread's registers.
pub(super) const TILE_PARTS_HD256: u32 = 2;

/// A tiled prefill kernel and how many blocks share each tile of a head.
#[derive(Clone, Copy)]
pub(super) struct TiledKernel {
    pub(super) kernel: Kernel,
    pub(super) parts: u32,
}

/// Fewest tokens in one split of the split-K attention; each row's split
/// length is its context over the splits, at least this (kernels/attention.cu
/// `split_len`). 16 tokens is one batch of loads for each of a block's warps.
pub(super) const ATT_MIN_SPLIT: usize = 16;

/// Steps with at least this many rows take the token-per-lane decode
/// attention (`attn_lanes_*`), whose splits hold at least a 32-token tile for
/// each of a block's four warps.
pub(super) const ATT_LANES_MIN_ROWS: usize = 8;
pub(super) const ATT_LANES_SPLIT: usize = 128;

/// Steps of fewer rows take the 32-token-tile kernel (`attn_tile_*`), each
/// split at least one tile; kernels/attention.cu ATT_TILE.
pub(super) const ATT_TILE_SPLIT: usize = 32;

/// Largest head dimension the attention kernel holds in registers.
pub const MAX_HEAD_DIM: usize = 256;

/// Which kernel attends the rows of sequences that are prefilled in a step.
/// `Tiled` is what the backend uses; `SplitK` exists so the self-check and the
/// benchmark can run the general kernel on the same inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PrefillPath {
    Tiled,
    SplitK,
}

/// What holds a KV store's bytes alive.
pub(super) enum KvMem {
    /// Two buffers of its own (K and V), page after page.
    Own { _k: DeviceBuffer, _v: DeviceBuffer },
    /// Pages of the card's KV arena, every layer's K and V in each page.
    Arena(#[allow(dead_code)] Arc<KvArena>),
}

/// One layer's paged K and V in bf16: each page holds `[page_size, kv_heads,
/// head_dim]` of K at `k + offset(page)` and of V at `v + offset(page)`.
pub struct CudaKv {
    pub(super) geometry: KvGeometry,
    pub(super) _mem: KvMem,
    pub(super) k: u64,
    pub(super) v: u64,
    pub(super) addr: KvAddressing,
}

impl CudaKv {
    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }
    /// Bytes of K (or V) one page holds for this layer.
    pub(super) fn page_bytes(&self) -> usize {
        let g = self.geometry;
        g.page_size.get() * g.kv_heads * g.head_dim * 2
    }
}

/// The step's per-row and per-sequence maps, built on the host.
#[derive(Default, PartialEq)]
pub(super) struct SeqMaps {
    pub(super) row_pos: Vec<u32>,
    pub(super) row_seq: Vec<u32>,
    pub(super) seq_pt_off: Vec<u32>,
    pub(super) page_table: Vec<u32>,
    /// Rows the maps cover (one past the last row of any sequence).
    pub(super) rows: usize,
    /// Longest context of any row.
    pub(super) max_ctx: usize,
    /// (first row, rows) of every tile of the tiled prefill kernel.
    pub(super) tiles: Vec<u32>,
    /// `row_seq` with the tiled rows masked out: what the split-K kernel attends beside the tiles.
    pub(super) rest_seq: Vec<u32>,
    /// Longest context of any row in `rest_seq`; 0 when there is none.
    pub(super) rest_max_ctx: usize,
}

/// The operands of one attention call, shared by its kernels.
pub(super) struct AttnLaunch<'a> {
    pub(super) q: &'a CudaAct,
    pub(super) kv: &'a CudaKv,
    pub(super) heads: usize,
    /// Device pointer of the output activation.
    pub(super) out: u64,
    /// Where the combine pass also stores the output quantized to 8 bits
    /// for the integer GEMV of the output projection (`None`: nowhere).
    pub(super) q8: Option<Q8Input>,
}

/// What the decode tile kernel needs to rotate its query heads and store the
/// new tokens' K and V itself (`attn_tile_rope_*`, a step of decode rows):
/// the projections' k and v rows, the positions' count, the rotary pairs,
/// and Qwen3's head norms (null pointers: none). The RoPE table and the
/// positions are the ones `sync_rope` and `sync_meta` put on the device.
pub(super) struct TileRope {
    pub(super) k: u64,
    pub(super) v: u64,
    pub(super) npos: usize,
    pub(super) half: usize,
    pub(super) interleaved: bool,
    pub(super) q_norm: u64,
    pub(super) k_norm: u64,
    pub(super) eps: f32,
}

/// The split-K decode kernels: a token per lane (steps of 8 rows and more),
/// tiles of 32 tokens (fewer rows), a warp per token (other head dims, or
/// with the tiles turned off).
#[derive(Clone, Copy, PartialEq, Eq)]
enum DecodeKernel {
    Lanes,
    Tile,
    Warp,
}

/// The head dims with vector-load decode kernels, as their index in the kernel tables.
fn exact_width(head_dim: usize) -> Option<usize> {
    match head_dim {
        64 => Some(0),
        128 => Some(1),
        256 => Some(2),
        _ => None,
    }
}

/// Head sizes the attention kernels hold in registers.
pub(super) fn check_kv_geometry(g: &KvGeometry) -> Result<()> {
    if g.head_dim > MAX_HEAD_DIM || g.head_dim == 0 || g.kv_heads == 0 || g.page_size.get() == 0 {
        return Err(BackendError::Other(format!(
            "head_dim {} (at most {MAX_HEAD_DIM}), kv_heads {}, page size {}",
            g.head_dim,
            g.kv_heads,
            g.page_size.get()
        )));
    }
    Ok(())
}

impl CudaBackend {
    pub(super) fn sync_seqs(&self, st: &mut State, seqs: &[SeqStep<'_>]) -> Result<()> {
        let mut m = std::mem::take(&mut st.maps_scratch);
        m.rows = seqs.iter().map(|s| s.row_start + s.rows).max().unwrap_or(0).max(st.step_rows);
        m.row_pos.clear();
        m.row_pos.resize(m.rows, 0);
        m.row_seq.clear();
        m.row_seq.resize(m.rows, u32::MAX);
        m.seq_pt_off.clear();
        m.page_table.clear();
        m.max_ctx = 0;
        m.tiles.clear();
        m.rest_seq.clear();
        m.rest_seq.resize(m.rows, u32::MAX);
        m.rest_max_ctx = 0;
        for (si, s) in seqs.iter().enumerate() {
            m.seq_pt_off.push(m.page_table.len() as u32);
            if s.pages.len() > self.config.max_pages_per_seq {
                st.maps_scratch = m;
                return Err(BackendError::Other(format!(
                    "a sequence has {} pages, the backend was sized for {}",
                    s.pages.len(),
                    self.config.max_pages_per_seq
                )));
            }
            m.page_table.extend(s.pages.iter().map(|&p| st.kv_addr.unit(p) as u32));
            for i in 0..s.rows {
                m.row_pos[s.row_start + i] = (s.cached + i) as u32;
                m.row_seq[s.row_start + i] = si as u32;
            }
            m.max_ctx = m.max_ctx.max(s.context_len());
            if s.rows >= TILED_MIN_ROWS {
                for t0 in (0..s.rows).step_by(TILE_ROWS) {
                    m.tiles.push((s.row_start + t0) as u32);
                    m.tiles.push(TILE_ROWS.min(s.rows - t0) as u32);
                }
            } else if s.rows > 0 {
                m.rest_seq[s.row_start..s.row_start + s.rows].fill(si as u32);
                m.rest_max_ctx = m.rest_max_ctx.max(s.context_len());
            }
        }
        if m == st.maps && st.row_pos.valid {
            st.maps_scratch = m;
            return Ok(());
        }
        let cap = st.capturing.is_some();
        let r = (|| {
            self.sync_meta(&mut st.row_pos, &m.row_pos, "rows", cap)?;
            self.sync_meta(&mut st.row_seq, &m.row_seq, "rows", cap)?;
            self.sync_meta(&mut st.seq_pt_off, &m.seq_pt_off, "sequences", cap)?;
            self.sync_meta(&mut st.page_table, &m.page_table, "page-table entries", cap)?;
            self.sync_meta(&mut st.tiles, &m.tiles, "prefill tiles", cap)?;
            self.sync_meta(&mut st.rest_seq, &m.rest_seq, "rows", cap)
        })();
        st.maps_scratch = std::mem::replace(&mut st.maps, m);
        r
    }

    /// A new KV store: page tables translate through its addressing from now
    /// on, and captured steps (which point at the old store) are dropped.
    pub(super) fn adopt_kv_addressing(&self, addr: KvAddressing) -> Result<()> {
        self.synchronize()?;
        let mut st = self.lock();
        drop_graphs(&mut st);
        st.kv_addr = addr;
        Ok(())
    }

    /// Which split-K kernel attends `rows` rows of heads of `head_dim`.
    fn decode_kernel(&self, st: &State, rows: usize, head_dim: usize) -> DecodeKernel {
        let exact = exact_width(head_dim).is_some();
        if exact && self.config.tuning.lane_attention && rows >= ATT_LANES_MIN_ROWS {
            DecodeKernel::Lanes
        } else if exact && st.decode_tiles {
            DecodeKernel::Tile
        } else {
            DecodeKernel::Warp
        }
    }

    /// Whether split-K attention over `rows` rows of heads of `head_dim` takes
    /// the 32-token-tile kernel (the one that can do RoPE in it too).
    pub(super) fn decode_tile(&self, st: &State, rows: usize, head_dim: usize) -> bool {
        self.decode_kernel(st, rows, head_dim) == DecodeKernel::Tile
    }

    /// Split-K attention (flash-decoding) for the rows whose sequence index in
    /// `row_seq` is not u32::MAX, over contexts of at most `max_ctx` tokens.
    /// Whether the splits were merged, in the launch or by a combine pass
    /// (and then `a.q8` was written too). With `rope`, the tile kernel also
    /// rotates q and stores the new tokens' K and V (every row a decode row;
    /// the caller checked `decode_tile`).
    pub(super) fn attn_split(
        &self,
        st: &State,
        a: &AttnLaunch<'_>,
        row_seq: u64,
        max_ctx: usize,
        rope: Option<&TileRope>,
    ) -> Result<bool> {
        let g = a.kv.geometry;
        let rows = st.maps.rows;
        // Query heads per block: the largest of 8, 4, 2, 1 that divides the
        // GQA group, so a block reads each K/V row once for all of them.
        let group = a.heads / g.kv_heads;
        let per_block = [8usize, 4, 2, 1].into_iter().find(|p| group.is_multiple_of(*p)).unwrap_or(1);
        let g_idx = per_block.trailing_zeros() as usize;
        let kind = self.decode_kernel(st, rows, g.head_dim);
        if rope.is_some() && kind != DecodeKernel::Tile {
            return Err(BackendError::Other("RoPE in attention needs the decode tile kernel".into()));
        }
        let min_split = match kind {
            DecodeKernel::Lanes => ATT_LANES_SPLIT,
            DecodeKernel::Tile => ATT_TILE_SPLIT,
            DecodeKernel::Warp => ATT_MIN_SPLIT,
        };
        let nsplit = self.splits(rows, a.heads, per_block, max_ctx, min_split);
        // The last split block of each row and block of heads merges them, in this launch.
        let merge = nsplit > 1 && st.attn_merge;
        let scale = 1.0 / (g.head_dim as f32).sqrt();
        let mut args = Args::new()
            .ptr(a.q.ptr())
            .ptr(a.kv.k)
            .ptr(a.kv.v)
            .ptr(st.row_pos.dev.ptr())
            .ptr(row_seq)
            .ptr(st.seq_pt_off.dev.ptr())
            .ptr(st.page_table.dev.ptr())
            .ptr(a.out)
            .ptr(st.part_o.ptr())
            .ptr(st.part_ml.ptr())
            .i32(a.heads as i32)
            .i32(g.kv_heads as i32)
            .i32(g.head_dim as i32)
            .i32(g.page_size.get() as i32)
            .f32(scale)
            .i32(min_split as i32)
            .i32(nsplit as i32)
            .ptr(if merge { st.attn_counts.ptr() } else { 0 })
            .ptr(a.q8.filter(|_| merge).map_or(0, |q| q.codes))
            .ptr(a.q8.filter(|_| merge).map_or(0, |q| q.scales));
        if let Some(r) = rope {
            args = args
                .ptr(r.k)
                .ptr(r.v)
                .ptr(st.inv_freq.ptr())
                .ptr(st.positions.dev.ptr())
                .i32(r.npos as i32)
                .i32(r.half as i32)
                .i32(i32::from(r.interleaved))
                .ptr(r.q_norm)
                .ptr(r.k_norm)
                .f32(r.eps)
                .ptr(st.prefetch.map_or(0, |p| p.ptr))
                .i64(st.prefetch.map_or(0, |p| p.bytes as i64));
        }
        // Splits slowest (kernels/attention.cu `split_live`): the live ones are dispatched first.
        let dims =
            LaunchDims { grid: ((a.heads / per_block) as u32, rows as u32, nsplit as u32), block: 128 };
        let kernel = match (exact_width(g.head_dim), kind) {
            (Some(d), DecodeKernel::Tile) if rope.is_some() => self.k.attn_tile_rope[d][g_idx],
            (Some(d), DecodeKernel::Tile) => self.k.attn_tile[d][g_idx],
            (Some(d), DecodeKernel::Lanes) => self.k.attn_lanes[d][g_idx],
            (Some(d), DecodeKernel::Warp) => self.k.attn_partial_exact[d][g_idx],
            (None, _) => self.k.attn_partial[g_idx],
        };
        unsafe { self.launch(kernel, dims, args)? };
        if merge {
            return Ok(true);
        }
        if nsplit > 1 {
            let args = Args::new()
                .ptr(st.part_o.ptr())
                .ptr(st.part_ml.ptr())
                .ptr(st.row_pos.dev.ptr())
                .ptr(row_seq)
                .ptr(a.out)
                .ptr(a.q8.map_or(0, |q| q.codes))
                .ptr(a.q8.map_or(0, |q| q.scales))
                .i32(a.heads as i32)
                .i32(g.head_dim as i32)
                .i32(nsplit as i32)
                .i32(min_split as i32);
            let dims = LaunchDims { grid: (a.heads as u32, rows as u32, 1), block: 128 };
            unsafe { self.launch(self.k.attn_combine, dims, args)? };
            return Ok(true);
        }
        Ok(false)
    }

    /// The longest context split-K attention splits for: a captured step's
    /// must stay valid for any context the backend was sized for.
    fn split_ctx(&self, st: &State, g: KvGeometry) -> usize {
        if let Some(ctx) = st.split_ctx_override {
            return ctx;
        }
        match st.capturing {
            Some(_) => self.config.max_pages_per_seq * g.page_size.get(),
            None => st.maps.max_ctx,
        }
    }

    /// The tiled prefill kernel for heads of `head_dim`; None: those heads take split-K.
    pub(super) fn tiled_kernel(&self, head_dim: usize) -> Option<TiledKernel> {
        let whole = |kernel| Some(TiledKernel { kernel, parts: 1 });
        match head_dim {
            64 => whole(self.k.attn_prefill_hd64),
            128 => whole(self.k.attn_prefill_hd128),
            256 => Some(TiledKernel { kernel: self.k.attn_prefill_hd256, parts: TILE_PARTS_HD256 }),
            _ => None,
        }
    }

    /// The tiled prefill kernel over every tile of `st.maps.tiles`.
    pub(super) fn attn_tiled(&self, st: &State, a: &AttnLaunch<'_>, tk: TiledKernel) -> Result<()> {
        let g = a.kv.geometry;
        let ntiles = st.maps.tiles.len() / 2;
        let scale_log2 = std::f32::consts::LOG2_E / (g.head_dim as f32).sqrt();
        let args = Args::new()
            .ptr(a.q.ptr())
            .ptr(a.kv.k)
            .ptr(a.kv.v)
            .ptr(st.row_pos.dev.ptr())
            .ptr(st.row_seq.dev.ptr())
            .ptr(st.seq_pt_off.dev.ptr())
            .ptr(st.page_table.dev.ptr())
            .ptr(st.tiles.dev.ptr())
            .ptr(a.out)
            .i32(a.heads as i32)
            .i32(g.kv_heads as i32)
            .i32(g.page_size.get() as i32)
            .f32(scale_log2)
            .i32(ntiles as i32);
        // The parts of one tile are neighbours in x, so they run together and share its K in L2.
        let dims = LaunchDims { grid: (ntiles as u32 * tk.parts, a.heads as u32, 1), block: TILE_THREADS };
        unsafe { self.launch(tk.kernel, dims, args) }
    }

    /// How many context splits attention uses for `rows × heads` queries over at most `max_ctx` tokens.
    pub(super) fn splits(
        &self,
        rows: usize,
        heads: usize,
        per_block: usize,
        max_ctx: usize,
        min_split: usize,
    ) -> usize {
        let base = (rows * heads).max(1);
        let want_blocks = self.sm_count * 8;
        let by_occupancy = want_blocks.div_ceil((base / per_block).max(1));
        let by_length = max_ctx.div_ceil(min_split).max(1);
        let by_scratch = (self.config.attn_partials / base).max(1);
        // 256: kernels/attention.cu ATT_MAX_SPLITS.
        by_occupancy.min(by_length).min(by_scratch).clamp(1, 256)
    }

    pub(super) fn new_kv(&self, g: KvGeometry) -> Result<CudaKv> {
        self.ctx.bind()?;
        check_kv_geometry(&g)?;
        // Pages start on whole KV units; a page whose bytes are not a multiple
        // of the unit is padded.
        let addr = KvAddressing::contiguous(
            (g.page_size.get() * g.kv_heads * g.head_dim * 2) as u64,
            g.num_pages.get(),
        );
        addr.check(g.num_pages.get()).map_err(BackendError::Other)?;
        let bytes = addr.span(g.num_pages.get()).max(2) as usize;
        let k = self.alloc_buf(bytes, Purpose::Kv)?;
        let v = self.alloc_buf(bytes, Purpose::Kv)?;
        for b in [&k, &v] {
            // SAFETY: fresh buffers of `bytes` bytes.
            unsafe { cu::memset_d8_async(b.ptr(), 0, bytes, self.stream.0) }
                .map_err(|e| cuda_err("cuMemsetD8Async", e))?;
        }
        self.adopt_kv_addressing(addr)?;
        let (kp, vp) = (k.ptr(), v.ptr());
        Ok(CudaKv { geometry: g, _mem: KvMem::Own { _k: k, _v: v }, k: kp, v: vp, addr })
    }

    pub(super) fn kv_of_arena(
        &self,
        arena: &Arc<KvArena>,
        g: KvGeometry,
        layers: usize,
    ) -> Result<Option<Vec<CudaKv>>> {
        check_kv_geometry(&g)?;
        // This card's share of the arena (the whole of it unless it spans cards).
        let part = self.alloc.card().and_then(|c| arena.part_on(c)).ok_or_else(|| {
            BackendError::Other(format!(
                "the KV arena spans {:?}; this backend's memory is not booked on any of them",
                arena.cards()
            ))
        })?;
        let geo = part.geometry;
        let layer_bytes = (g.page_size.get() * g.kv_heads * g.head_dim * 2) as u64;
        if layers == 0 || geo.page_bytes.get() != 2 * layers as u64 * layer_bytes {
            return Err(BackendError::Other(format!(
                "a KV arena page of {} does not hold K and V of {layers} layers of {layer_bytes} bytes",
                geo.page_bytes
            )));
        }
        let addr = KvAddressing::of_arena(&geo).map_err(BackendError::Other)?;
        addr.check(arena.capacity().get()).map_err(BackendError::Other)?;
        let base = part.base_address;
        self.adopt_kv_addressing(addr)?;
        // Page-major: page p holds, for layer l, K at 2l and V at 2l+1 (in layer-sized slots).
        Ok(Some(
            (0..layers as u64)
                .map(|l| CudaKv {
                    geometry: KvGeometry { num_pages: arena.capacity(), ..g },
                    _mem: KvMem::Arena(arena.clone()),
                    k: base + 2 * l * layer_bytes,
                    v: base + (2 * l + 1) * layer_bytes,
                    addr,
                })
                .collect(),
        ))
    }

    pub(super) fn enqueue_write_kv(&self, kv: &mut CudaKv, k: &CudaAct, v: &CudaAct, seqs: &[SeqStep<'_>]) {
        self.op("write_kv", |st| {
            st.kv_addr = kv.addr;
            self.sync_seqs(st, seqs)?;
            let g = kv.geometry;
            let a = Args::new()
                .ptr(k.ptr())
                .ptr(v.ptr())
                .ptr(kv.k)
                .ptr(kv.v)
                .ptr(st.row_pos.dev.ptr())
                .ptr(st.row_seq.dev.ptr())
                .ptr(st.seq_pt_off.dev.ptr())
                .ptr(st.page_table.dev.ptr())
                .i32(g.page_size.get() as i32)
                .i32((g.kv_heads * g.head_dim) as i32);
            unsafe {
                self.launch(self.k.write_kv, LaunchDims { grid: (st.maps.rows as u32, 1, 1), block: 256 }, a)
            }
        })
    }

    /// What RoPE with the KV store reads on the device, put there for this
    /// op: the rotary table, the positions, the step's maps (through `kv`'s
    /// addressing); the q and k norms' weights (0 and 0.0: none) come back.
    fn sync_rope_step(
        &self,
        st: &mut State,
        norm: Option<QkNorm<'_, Self>>,
        table: &RopeTable,
        positions: &[u32],
        kv: &CudaKv,
        seqs: &[SeqStep<'_>],
    ) -> Result<(u64, u64, f32)> {
        let norms = match norm {
            Some(n) => (self.vector_ptr(n.q, "q norm")?, self.vector_ptr(n.k, "k norm")?, n.eps),
            None => (0, 0, 0.0),
        };
        self.sync_rope(st, table)?;
        let cap = st.capturing.is_some();
        self.sync_meta(&mut st.positions, positions, "positions", cap)?;
        st.kv_addr = kv.addr;
        self.sync_seqs(st, seqs)?;
        Ok(norms)
    }

    // The signature of `Backend::rope_write_kv`, which this implements.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn enqueue_rope_write_kv(
        &self,
        q: &mut CudaAct,
        k: &mut CudaAct,
        v: &CudaAct,
        norm: Option<QkNorm<'_, Self>>,
        table: &RopeTable,
        head_dim: usize,
        positions: &[u32],
        kv: &mut CudaKv,
        seqs: &[SeqStep<'_>],
    ) {
        if !self.config.tuning.fuse {
            return crate::unfused::rope_write_kv(self, q, k, v, norm, table, head_dim, positions, kv, seqs);
        }
        self.op("rope_write_kv", |st| {
            let (qn, kn, eps) = self.sync_rope_step(st, norm, table, positions, kv, seqs)?;
            let norms = (qn, kn, eps, norm.map_or(0, |n| n.rows));
            let g = kv.geometry;
            let width = g.kv_heads * g.head_dim;
            if k.cols != width || v.cols != width {
                return Err(BackendError::Other(format!(
                    "rope_write_kv: k has {} and v {} columns, the cache {width}",
                    k.cols, v.cols
                )));
            }
            if head_dim == 0 || !q.cols.is_multiple_of(head_dim) || head_dim != g.head_dim {
                return Err(BackendError::Other(format!(
                    "rope_write_kv: q has {} columns, heads of {head_dim}, the cache's {}",
                    q.cols, g.head_dim
                )));
            }
            let heads = q.cols / head_dim;
            let half = table.rot_dim / 2;
            let interleaved = i32::from(table.style == RopeStyle::Interleaved);
            let a = Args::new()
                .ptr(q.ptr())
                .ptr(k.ptr())
                .ptr(v.ptr())
                .ptr(kv.k)
                .ptr(kv.v)
                .ptr(st.inv_freq.ptr())
                .ptr(st.positions.dev.ptr())
                .i32(positions.len() as i32)
                .i32(st.maps.rows as i32)
                .ptr(st.row_pos.dev.ptr())
                .ptr(st.row_seq.dev.ptr())
                .ptr(st.seq_pt_off.dev.ptr())
                .ptr(st.page_table.dev.ptr())
                .i32(g.page_size.get() as i32)
                .i32(heads as i32)
                .i32(g.kv_heads as i32)
                .i32(head_dim as i32)
                .i32(half as i32)
                .i32(interleaved)
                .ptr(norms.0)
                .ptr(norms.1)
                .f32(norms.2)
                .ptr(st.prefetch.map_or(0, |p| p.ptr))
                .i64(st.prefetch.map_or(0, |p| p.bytes as i64));
            // A block per (row, head): q heads, then the KV heads' k, then their v.
            let rows = st.maps.rows.max(positions.len()).max(norms.3);
            let dims = LaunchDims {
                grid: (rows as u32, (heads + 2 * g.kv_heads) as u32, 1),
                block: half.next_power_of_two().clamp(32, 256) as u32,
            };
            unsafe { self.launch(self.k.rope_write_kv, dims, a) }
        })
    }

    pub(super) fn enqueue_attention(
        &self,
        q: &CudaAct,
        kv: &CudaKv,
        heads: usize,
        seqs: &[SeqStep<'_>],
        out: &mut CudaAct,
    ) {
        self.op("attention", |st| {
            st.kv_addr = kv.addr;
            self.sync_seqs(st, seqs)?;
            let g = kv.geometry;
            if !heads.is_multiple_of(g.kv_heads) {
                return Err(BackendError::Other(format!("{heads} heads over {} KV heads", g.kv_heads)));
            }
            // A captured step must stay valid for any rows and contexts, which
            // only the split-K kernel's fixed grid allows; it also splits for
            // the longest context the backend was sized for.
            let tiled = match st.capturing {
                Some(_) => None,
                None => self
                    .tiled_kernel(g.head_dim)
                    .filter(|_| st.prefill == PrefillPath::Tiled && !st.maps.tiles.is_empty()),
            };
            let Some(tk) = tiled else {
                return self.attn_split_rows(st, q, kv, heads, out, None);
            };
            // No combine pass over every row: no 8-bit copy of the output.
            st.xq_holds = None;
            let a = AttnLaunch { q, kv, heads, out: out.ptr(), q8: None };
            self.attn_tiled(st, &a, tk)?;
            if st.maps.rest_max_ctx > 0 {
                self.attn_split(st, &a, st.rest_seq.dev.ptr(), st.maps.rest_max_ctx, None)?;
            }
            Ok(())
        })
    }

    /// Split-K attention over every row of the step, splitting for
    /// `split_ctx`; where the splits are merged the output is also stored
    /// quantized for the output projection's integer GEMV, and where nothing
    /// merged them that copy is forgotten.
    fn attn_split_rows(
        &self,
        st: &mut State,
        q: &CudaAct,
        kv: &CudaKv,
        heads: usize,
        out: &CudaAct,
        rope: Option<&TileRope>,
    ) -> Result<()> {
        let g = kv.geometry;
        let q8 = match g.head_dim.is_multiple_of(32) {
            true => self.q8_output(st, out, st.maps.rows, usize::MAX),
            false => None,
        };
        let a = AttnLaunch { q, kv, heads, out: out.ptr(), q8 };
        let merged = self.attn_split(st, &a, st.row_seq.dev.ptr(), self.split_ctx(st, g), rope);
        if !matches!(merged, Ok(true)) {
            st.xq_holds = None;
        }
        merged.map(|_| ())
    }

    pub(super) fn enqueue_rope_attention(&self, a: RopeAttention<'_, Self>, heads: usize, out: &mut CudaAct) {
        let RopeAttention { q, k, v, norm, table, head_dim, positions, kv, seqs } = a;
        // One launch where every row is a decode row (a sequence's rows of a
        // step attend to each other's new K, which no block could wait for)
        // and the rows take the tile kernel; otherwise the two ops.
        let rows = seqs.iter().map(|s| s.row_start + s.rows).max().unwrap_or(0);
        let tuning = self.config.tuning;
        let one_pass = tuning.fuse
            && tuning.attn_rope
            && seqs.iter().all(|s| s.rows <= 1)
            && table.rot_dim <= head_dim
            && {
                let st = self.lock();
                self.decode_tile(&st, rows.max(st.step_rows), head_dim)
            };
        if !one_pass {
            self.enqueue_rope_write_kv(q, k, v, norm, table, head_dim, positions, kv, seqs);
            return self.enqueue_attention(q, kv, heads, seqs, out);
        }
        self.op("rope_attention", |st| {
            let (q_norm, k_norm, eps) = self.sync_rope_step(st, norm, table, positions, kv, seqs)?;
            let g = kv.geometry;
            let width = g.kv_heads * g.head_dim;
            if k.cols != width || v.cols != width || head_dim != g.head_dim || q.cols != heads * head_dim {
                return Err(BackendError::Other(format!(
                    "rope_attention: q has {} columns ({heads} heads of {head_dim}), k {} and v {}, the cache {} \
                     heads of {}",
                    q.cols, k.cols, v.cols, g.kv_heads, g.head_dim
                )));
            }
            if !heads.is_multiple_of(g.kv_heads) {
                return Err(BackendError::Other(format!("{heads} heads over {} KV heads", g.kv_heads)));
            }
            let rope = TileRope {
                k: k.ptr(),
                v: v.ptr(),
                npos: positions.len(),
                half: table.rot_dim / 2,
                interleaved: table.style == RopeStyle::Interleaved,
                q_norm,
                k_norm,
                eps,
            };
            self.attn_split_rows(st, q, kv, heads, out, Some(&rope))?;
            st.one_pass_attention += 1;
            Ok(())
        })
    }

    pub(super) fn enqueue_copy_page(&self, kv: &mut CudaKv, from: PageId, to: PageId) {
        self.op("copy_page", |_| {
            let n = kv.page_bytes();
            let (src, dst) = (kv.addr.offset(from), kv.addr.offset(to));
            for base in [kv.k, kv.v] {
                // SAFETY: both pages lie inside the store (page ids come from the pool of this geometry).
                unsafe { cu::memcpy_dtod_async(base + dst, base + src, n, self.stream.0) }
                    .map_err(|e| cuda_err("cuMemcpyDtoDAsync", e))?;
            }
            Ok(())
        })
    }
}
