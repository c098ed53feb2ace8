//! Compute backends: the kernels a forward pass is written against.
//!
//! The model layer writes its forward pass once, against [`Backend`]; each
//! backend (the CPU now, CUDA later) implements the operations for its own
//! buffers. Activation buffers are allocated once, at the largest step the
//! scheduler may form, and every operation names how many rows of them are live,
//! so a forward pass allocates nothing.
//!
//! Invariant: this crate knows nothing about models, requests or HTTP. It sees
//! matrices, vectors and paged KV storage.

pub mod collective;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dtype;
pub mod kv_units;
pub mod moe;
pub mod sample;
pub mod tuning;

pub use dtype::{DType, HostTensor, TensorBytes, QK, QK_K};
pub use moe::{Expert, MoeFfn, MoeScratch, MoeShape, Routing};
pub use tuning::CudaTuning;

use corridor_units::{PageId, Pages, StateSlot, TokenId, Tokens};
use corridor_vram::KvArena;
use std::sync::Arc;

/// Errors raised by a backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("tensor '{name}': {reason}")]
    BadTensor { name: String, reason: String },
    #[error("out of memory on {device}: wanted {want} bytes for {purpose}")]
    OutOfMemory { device: String, want: u64, purpose: &'static str },
    #[error("{op} failed: {reason}")]
    Cuda { op: &'static str, reason: String },
    #[error("GPU libraries missing: {missing} (searched by their usual names on LD_LIBRARY_PATH and the loader cache)")]
    MissingLibrary { missing: String },
    #[error("{0}")]
    Other(String),
}

pub type Result<T, E = BackendError> = std::result::Result<T, E>;

/// How rotary position embeddings pair up the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Dimension `i` pairs with `i + head_dim/2` (Hugging Face `rotate_half`,
    /// llama.cpp "NeoX" mode).
    Half,
    /// Dimension `2i` pairs with `2i + 1` (llama.cpp mode 0; GGUF Llama files
    /// store Q and K permuted for this).
    Interleaved,
}

/// Rotary embedding tables, computed once per model.
#[derive(Clone, Debug)]
pub struct RopeTable {
    pub style: RopeStyle,
    /// Rotated dimensions per head (the whole head for every model supported).
    pub rot_dim: usize,
    /// Inverse frequencies, `rot_dim / 2` of them, after any scaling.
    pub inv_freq: Vec<f32>,
}

/// The geometry of one layer's paged KV storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    /// Tokens per page.
    pub page_size: Tokens,
    /// Pages the storage can address.
    pub num_pages: Pages,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// Where a rank's KV lives, decided at boot and handed to the model as a
/// value: the model sizes its layers' storage from it and passes it on to
/// the backend ([`Backend::alloc_kv_at`]) without looking inside.
#[derive(Clone, Debug)]
pub enum KvPlacement {
    /// Buffers of the backend's own that address `num_pages` pages.
    Own { num_pages: Pages },
    /// The pages of a card's KV arena, so the memory the governor commits
    /// and releases is the memory attention reads; a backend that keeps KV
    /// in memory of its own addresses the arena's whole id space instead.
    Arena(Arc<KvArena>),
}

impl KvPlacement {
    /// Pages the storage addresses.
    pub fn num_pages(&self) -> Pages {
        match self {
            KvPlacement::Own { num_pages } => *num_pages,
            KvPlacement::Arena(arena) => arena.capacity(),
        }
    }
}

/// Where a model's recurrent state lives, decided at boot and handed to the
/// model as a value (as [`KvPlacement`] is for KV): the model names the
/// states one slot holds and the backend places them
/// ([`Backend::alloc_state_at`]).
#[derive(Clone, Debug)]
pub enum StatePlacement {
    /// Buffers of the backend's own, `[slots, elems]` each: a fixed block.
    Own { slots: usize },
    /// The slots of a governed state pool: an arena of one slot a page, each
    /// slot holding every state of the rank side by side, so the memory the
    /// governor commits and releases is the memory the delta-net ops read.
    /// A backend that keeps state in memory of its own sizes its buffers to
    /// the pool's whole id space instead, and the pool only books it.
    Arena(Arc<KvArena>),
}

impl StatePlacement {
    /// Slots the states address.
    pub fn slots(&self) -> usize {
        match self {
            StatePlacement::Own { slots } => *slots,
            StatePlacement::Arena(arena) => arena.capacity().get(),
        }
    }
}

/// The heads of a gated delta-net layer (linear attention with the gated
/// delta rule, as in Qwen3.5) and the fixed-size state each sequence carries
/// through it: the last `conv_kernel - 1` inputs of its short causal
/// convolution and one `[k_dim, v_dim]` matrix per value head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaGeometry {
    pub k_heads: usize,
    /// Value heads; a multiple of `k_heads` (each key head serves
    /// `v_heads / k_heads` consecutive value heads).
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    /// Taps of the depthwise causal convolution over q, k and v.
    pub conv_kernel: usize,
    /// How the value heads are ordered against the key heads they read.
    pub v_order: VHeadOrder,
}

/// The order of a gated delta-net's value heads, which decides the key head
/// each reads. Every tensor indexed by value head (v's rows and channels, z,
/// a, b, the decay and bias vectors, the output projection's columns) follows
/// the same order, so only this mapping depends on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VHeadOrder {
    /// Hugging Face: the value heads of key head 0, then of key head 1, ...
    /// (value head `h` reads key head `h / (v_heads / k_heads)`).
    Grouped,
    /// llama.cpp's GGUF files: one value head of every key head, then the
    /// next of each (value head `h` reads key head `h % k_heads`).
    Tiled,
}

impl DeltaGeometry {
    /// Columns of the queries (and of the keys): `k_heads * k_dim`.
    pub fn key_width(&self) -> usize {
        self.k_heads * self.k_dim
    }
    /// Columns of the values and of the layer's output: `v_heads * v_dim`.
    pub fn value_width(&self) -> usize {
        self.v_heads * self.v_dim
    }
    /// Channels the convolution runs over: q, k and v side by side.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_width() + self.value_width()
    }
    /// f32 elements of one sequence's convolution state.
    pub fn conv_state_elems(&self) -> usize {
        self.conv_kernel.saturating_sub(1) * self.conv_channels()
    }
    /// The key head value head `h` reads.
    pub fn key_head_of(&self, h: usize) -> usize {
        match self.v_order {
            VHeadOrder::Grouped => h / (self.v_heads / self.k_heads).max(1),
            VHeadOrder::Tiled => h % self.k_heads.max(1),
        }
    }
    /// f32 elements of one sequence's recurrent state.
    pub fn recurrent_state_elems(&self) -> usize {
        self.v_heads * self.k_dim * self.v_dim
    }
}

/// The arguments of [`Backend::gated_delta_rule`].
pub struct DeltaRule<'a, B: Backend + ?Sized> {
    /// `[rows, conv_channels]`: q, k and v after the convolution.
    pub qkv: &'a B::Act,
    /// `[rows, v_heads]`: the decay's input (`in_proj_a`).
    pub a: &'a B::Act,
    /// `[rows, v_heads]`: the write strength's input (`in_proj_b`).
    pub b: &'a B::Act,
    /// `[v_heads]`: each head's decay rate (`exp(A_log)`, positive).
    pub decay: &'a B::Weight,
    /// `[v_heads]`: the bias added to `a` before the softplus.
    pub dt_bias: &'a B::Weight,
    pub geometry: DeltaGeometry,
    /// `[slots, recurrent_state_elems]`.
    pub state: &'a mut B::Act,
    pub seqs: &'a [SeqStep<'a>],
    /// Each sequence's state slot, parallel to `seqs`.
    pub slots: &'a [StateSlot],
    /// `[rows, value_width]`.
    pub out: &'a mut B::Act,
}

/// One sequence's share of a batched step.
#[derive(Clone, Debug)]
pub struct SeqStep<'a> {
    /// First row of this sequence in the step's token rows.
    pub row_start: usize,
    /// New tokens of this sequence in this step (rows `row_start..row_start+rows`).
    pub rows: usize,
    /// Tokens already in the KV cache before this step (so the new tokens sit
    /// at positions `cached..cached+rows`).
    pub cached: usize,
    /// The sequence's page table: token at position `p` lives in
    /// `pages[p / page_size]`, slot `p % page_size`.
    pub pages: &'a [PageId],
}

impl SeqStep<'_> {
    /// Tokens in the cache after this step.
    pub fn context_len(&self) -> usize {
        self.cached + self.rows
    }
}

/// The sizes one forward pass needs scratch space for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActShape {
    pub rows: usize,
    pub cols: usize,
}

/// Everything one forward pass needs to know up front, so a device backend can
/// upload the step's metadata (token ids, positions, page tables, row maps)
/// once instead of once per layer.
#[derive(Clone, Copy, Debug)]
pub struct StepPlan<'a> {
    /// Token ids, sequences concatenated: `[rows]`. A device backend uploads
    /// them as `u32` ([`TokenId::as_u32_slice`]): the kernels' edge.
    pub tokens: &'a [TokenId],
    /// The position of each token: `[rows]`.
    pub positions: &'a [u32],
    /// Each sequence's slice of the rows and its page table.
    pub seqs: &'a [SeqStep<'a>],
    /// Rows whose logits are wanted.
    pub logit_rows: &'a [usize],
    /// Each sequence's recurrent-state slot, parallel to `seqs` (a hybrid
    /// model's linear-attention layers); empty for a model without state.
    pub state_slots: &'a [StateSlot],
}

/// Names a captured replay of a whole forward pass: steps with the same key
/// launch the same kernels on the same buffers, only the metadata differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphKey {
    /// Token rows of the step (the decode batch size).
    pub rows: usize,
    /// Logit rows of the step.
    pub logit_rows: usize,
}

/// The three graph calls [`run_captured`] drives, apart from the rest of a
/// backend (every [`Backend`] has them), so the driving can be tested alone.
pub trait GraphCapture {
    fn replay(&self, key: GraphKey) -> Result<bool>;
    fn begin_capture(&self, key: GraphKey) -> Result<bool>;
    fn end_capture(&self, key: GraphKey) -> Result<()>;
}

impl<B: Backend + ?Sized> GraphCapture for B {
    fn replay(&self, key: GraphKey) -> Result<bool> {
        self.graph_replay(key)
    }
    fn begin_capture(&self, key: GraphKey) -> Result<bool> {
        self.graph_capture_begin(key)
    }
    fn end_capture(&self, key: GraphKey) -> Result<()> {
        self.graph_capture_end(key)
    }
}

/// Run one step's device work, `ops`, replayed from a capture when `key`
/// names one, else run (and captured under `key` when the backend captures):
/// the one place that drives [`Backend::graph_replay`],
/// [`Backend::graph_capture_begin`] and [`Backend::graph_capture_end`]. The
/// engine's executor chooses the key (decode steps of a rank that replays);
/// a model hands over the key it was given and the closure that runs its ops. The capture is ended even after a failed op,
/// so the stream stays usable. Without a key, or on a backend that never
/// captures, `ops` simply runs.
pub fn run_captured<G: GraphCapture + ?Sized, E: From<BackendError>>(
    b: &G,
    key: Option<GraphKey>,
    ops: impl FnOnce() -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let Some(k) = key else { return ops() };
    if b.replay(k)? {
        return Ok(());
    }
    let capturing = b.begin_capture(k)?;
    let ran = ops();
    if capturing {
        let ended = b.end_capture(k);
        ran?;
        ended?;
        return Ok(());
    }
    ran
}

/// Qwen3's per-head RMS norm of q and k, which [`Backend::rope_write_kv`] applies
/// first when given: `head_rms_norm` of the `rows` rows of q with `q`'s weight
/// and of k with `k`'s, both over heads of the call's `head_dim`.
pub struct QkNorm<'a, B: Backend + ?Sized> {
    pub q: &'a B::Weight,
    pub k: &'a B::Weight,
    pub eps: f32,
    pub rows: usize,
}

/// The operands of [`Backend::rope_attention`]: a layer's q, k and v rows after
/// their projections and everything [`Backend::rope_write_kv`] takes with them.
pub struct RopeAttention<'a, B: Backend + ?Sized> {
    pub q: &'a mut B::Act,
    pub k: &'a mut B::Act,
    pub v: &'a B::Act,
    pub norm: Option<QkNorm<'a, B>>,
    pub table: &'a RopeTable,
    pub head_dim: usize,
    pub positions: &'a [u32],
    pub kv: &'a mut B::Kv,
    pub seqs: &'a [SeqStep<'a>],
}

// Two references and two numbers: a copy whatever the backend (a derive would ask `B: Copy`).
impl<B: Backend + ?Sized> Clone for QkNorm<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend + ?Sized> Copy for QkNorm<'_, B> {}

/// One product of [`Backend::matmul_many`]: `out = x · wᵀ (+ bias)`.
pub struct MatmulPart<'a, B: Backend + ?Sized> {
    pub w: &'a B::Weight,
    pub bias: Option<&'a B::Weight>,
    pub out: &'a mut B::Act,
}

/// The residual add and the next norm that close a block in
/// [`Backend::matmul_add_rms_norm`]: `x += proj`, then
/// `out = rms_norm(x) * weight`.
pub struct ResidualNorm<'a, B: Backend + ?Sized> {
    /// The residual stream.
    pub x: &'a mut B::Act,
    pub weight: &'a B::Weight,
    pub eps: f32,
    pub out: &'a mut B::Act,
}

/// The composite ops of [`Backend`] as the plain ops they stand for: the
/// trait's defaults, and what a fusing backend falls back to where its fused
/// launch does not apply.
pub mod unfused {
    use super::{
        Backend, BackendError, DType, HostTensor, MatmulPart, QkNorm, ResidualNorm, Result, RopeTable,
        SeqStep, TensorBytes,
    };

    /// [`Backend::matmul_add_rms_norm`]: the matmul, then `add_rms_norm`.
    pub fn matmul_add_rms_norm<B: Backend + ?Sized>(
        b: &B,
        input: &B::Act,
        w: &B::Weight,
        rows: usize,
        proj: &mut B::Act,
        n: ResidualNorm<'_, B>,
    ) {
        b.matmul(input, w, None, rows, proj);
        b.add_rms_norm(n.x, proj, n.weight, n.eps, rows, n.out);
    }

    /// [`Backend::matmul_many`]: one `matmul` per part.
    pub fn matmul_many<B: Backend + ?Sized>(b: &B, x: &B::Act, parts: &mut [MatmulPart<'_, B>], rows: usize) {
        for p in parts.iter_mut() {
            b.matmul(x, p.w, p.bias, rows, p.out);
        }
    }

    /// [`Backend::gate_up_silu`]: two matmuls into the scratch, then `silu_mul`.
    #[allow(clippy::too_many_arguments)]
    pub fn gate_up_silu<B: Backend + ?Sized>(
        b: &B,
        x: &B::Act,
        gate: &B::Weight,
        up: &B::Weight,
        rows: usize,
        gate_out: &mut B::Act,
        up_out: &mut B::Act,
        out: &mut B::Act,
    ) {
        b.matmul(x, gate, None, rows, gate_out);
        b.matmul(x, up, None, rows, up_out);
        b.silu_mul(gate_out, up_out, rows, out);
    }

    /// [`Backend::add_rows_scaled`] through the host: read both, combine,
    /// upload the sum as a table and embed it back.
    pub fn add_rows_scaled<B: Backend + ?Sized>(
        b: &B,
        out: &mut B::Act,
        out_rows: usize,
        y: &B::Act,
        rows: &[usize],
        scales: &[f32],
    ) -> Result<()> {
        if rows.len() != scales.len() || rows.iter().any(|&r| r >= out_rows) {
            return Err(BackendError::Other(format!(
                "add_rows_scaled: {} rows and {} scales into {out_rows} rows",
                rows.len(),
                scales.len()
            )));
        }
        if out_rows == 0 {
            return Ok(());
        }
        let (mut acc, mut add) = (Vec::new(), Vec::new());
        b.read_rows(out, out_rows, &mut acc);
        b.read_rows(y, rows.len(), &mut add);
        let cols = acc.len() / out_rows;
        for (i, (&r, &s)) in rows.iter().zip(scales).enumerate() {
            for (a, v) in acc[r * cols..(r + 1) * cols].iter_mut().zip(&add[i * cols..(i + 1) * cols]) {
                *a += s * v;
            }
        }
        let bytes = acc.iter().flat_map(|v| v.to_le_bytes()).collect();
        let table = b.upload_weight(&HostTensor {
            name: "scaled rows".into(),
            dtype: DType::F32,
            shape: vec![out_rows, cols],
            data: TensorBytes::from_vec(bytes),
        })?;
        let ids: Vec<u32> = (0..out_rows as u32).collect();
        b.embedding(&table, &ids, out)?;
        // The table must outlive the copy out of it.
        b.synchronize()
    }

    /// [`Backend::rope_write_kv`]: the q and k head norms when given, `rope`
    /// of q and of k, then `write_kv`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_write_kv<B: Backend + ?Sized>(
        b: &B,
        q: &mut B::Act,
        k: &mut B::Act,
        v: &B::Act,
        norm: Option<QkNorm<'_, B>>,
        table: &RopeTable,
        head_dim: usize,
        positions: &[u32],
        kv: &mut B::Kv,
        seqs: &[SeqStep<'_>],
    ) {
        if let Some(n) = norm {
            b.head_rms_norm(q, n.q, n.eps, head_dim, n.rows);
            b.head_rms_norm(k, n.k, n.eps, head_dim, n.rows);
        }
        b.rope(q, table, head_dim, positions);
        b.rope(k, table, head_dim, positions);
        b.write_kv(kv, k, v, seqs);
    }
}

/// The error of an op a backend does not implement.
fn unsupported<B: Backend + ?Sized>(b: &B, op: &str) -> BackendError {
    BackendError::Other(format!("{op} is not implemented on the {} backend", b.name()))
}

/// The operations a forward pass is written against.
///
/// Buffers are row-major f32 matrices from the model's point of view; a
/// backend may store them however it likes. `rows` arguments say how many
/// leading rows are live in this call.
pub trait Backend: Send + Sync + 'static {
    /// An activation matrix with a fixed row capacity.
    type Act: Send;
    /// A weight matrix `[out, in]` (or a vector, `[1, n]`) in its storage type.
    type Weight: Send + Sync;
    /// One layer's paged K and V storage.
    type Kv: Send;
    /// What a backend keeps about one sparse layer's experts so that
    /// [`Backend::moe_ffn`] can index them (a device table of their
    /// weights' addresses); `()` for a backend that runs them one by one.
    type ExpertTable: Send + Sync;

    /// A short name for logs ("cpu", "cuda:0").
    fn name(&self) -> String;

    /// Place a checkpoint tensor on the backend, keeping its storage type where
    /// the backend can compute with it (quantized weights stay quantized).
    fn upload_weight(&self, tensor: &HostTensor) -> Result<Self::Weight>;
    /// Rows and columns of an uploaded weight.
    fn weight_shape(&self, w: &Self::Weight) -> (usize, usize);
    /// Allocate an activation buffer of `rows × cols`, zeroed.
    fn alloc_act(&self, shape: ActShape) -> Result<Self::Act>;
    /// Allocate a buffer of per-sequence recurrent state, `[slots, elems]`,
    /// zeroed: an activation buffer that a device backend books as state
    /// rather than workspace. The default is `alloc_act`.
    fn alloc_state(&self, shape: ActShape) -> Result<Self::Act> {
        self.alloc_act(shape)
    }
    /// One state buffer per entry of `widths` (f32 elements of one slot's
    /// state) inside the slots of a governed state pool: slot `s` holds the
    /// states side by side, in order, at the start of the pool's page `s`.
    /// `Ok(None)`: this backend keeps state in memory of its own
    /// (`alloc_state`), and the pool only books it.
    fn state_in_arena(&self, _arena: &Arc<KvArena>, _widths: &[usize]) -> Result<Option<Vec<Self::Act>>> {
        Ok(None)
    }
    /// State buffers of `widths` elements a slot where `placement` says.
    fn alloc_state_at(&self, placement: &StatePlacement, widths: &[usize]) -> Result<Vec<Self::Act>> {
        if let StatePlacement::Arena(arena) = placement {
            if let Some(states) = self.state_in_arena(arena, widths)? {
                return Ok(states);
            }
        }
        widths.iter().map(|&cols| self.alloc_state(ActShape { rows: placement.slots(), cols })).collect()
    }
    /// Allocate one layer's KV storage.
    fn alloc_kv(&self, geometry: KvGeometry) -> Result<Self::Kv>;
    /// KV storage of `layers` layers inside the pages of a card's KV arena
    /// (one arena page holds its tokens' K and V for every layer), so the
    /// memory the governor commits and releases is the memory attention
    /// reads. `Ok(None)`: this backend keeps KV in memory of its own
    /// (`alloc_kv`), and the arena only books it.
    fn kv_in_arena(
        &self,
        _arena: &Arc<KvArena>,
        _geometry: KvGeometry,
        _layers: usize,
    ) -> Result<Option<Vec<Self::Kv>>> {
        Ok(None)
    }
    /// KV storage of `layers` layers of `geometry` where `placement` says
    /// (`geometry.num_pages` is the placement's).
    fn alloc_kv_at(
        &self,
        placement: &KvPlacement,
        geometry: KvGeometry,
        layers: usize,
    ) -> Result<Vec<Self::Kv>> {
        if let KvPlacement::Arena(arena) = placement {
            if let Some(kv) = self.kv_in_arena(arena, geometry, layers)? {
                return Ok(kv);
            }
        }
        (0..layers).map(|_| self.alloc_kv(geometry)).collect()
    }
    /// Bytes `upload_weight` will place for a `[rows, cols]` tensor stored as
    /// `dtype` in the checkpoint (a backend may widen or narrow it).
    fn stored_bytes(&self, dtype: DType, rows: usize, cols: usize) -> u64 {
        dtype.bytes_for(cols).unwrap_or(0) as u64 * rows as u64
    }
    /// Whether `graph_capture_begin` can ever capture: then the caller pads
    /// decode steps to a few batch sizes so that a few captures serve all.
    fn captures_graphs(&self) -> bool {
        false
    }
    /// Row counts of the prefill-sized steps the executor runs once before
    /// KV is sized: a device that picks library kernels by shape (cuBLASLt)
    /// loads them, and takes their workspace, then, so the KV budget is
    /// measured after them. The default: the largest step, half of it and 64
    /// rows. A backend whose memory does not grow with the shapes it has run
    /// returns none.
    fn warm_up_rows(&self, max_rows: usize) -> Vec<usize> {
        let mut rows = vec![max_rows, max_rows.div_ceil(2), 64.min(max_rows)];
        rows.dedup();
        rows
    }

    /// `out[r] = table[ids[r]]` for each row.
    fn embedding(&self, table: &Self::Weight, ids: &[u32], out: &mut Self::Act) -> Result<()>;
    /// `out[r] = x[r] / rms(x[r]) * weight` over the first `rows` rows.
    fn rms_norm(&self, x: &Self::Act, weight: &Self::Weight, eps: f32, rows: usize, out: &mut Self::Act);
    /// RMS-normalize every `head_dim`-wide head of the first `rows` rows in
    /// place with the shared `weight` (Qwen3's q/k norm).
    fn head_rms_norm(&self, x: &mut Self::Act, weight: &Self::Weight, eps: f32, head_dim: usize, rows: usize);
    /// `out[r] = x[r] · wᵀ (+ bias)` over the first `rows` rows.
    fn matmul(
        &self,
        x: &Self::Act,
        w: &Self::Weight,
        bias: Option<&Self::Weight>,
        rows: usize,
        out: &mut Self::Act,
    );
    /// Rotate every head of the first `rows` rows by its row's position.
    fn rope(&self, x: &mut Self::Act, table: &RopeTable, head_dim: usize, positions: &[u32]);
    /// `out[r][i] = silu(gate[r][i]) * up[r][i]`.
    fn silu_mul(&self, gate: &Self::Act, up: &Self::Act, rows: usize, out: &mut Self::Act);
    /// `x[r] += y[r]` over the first `rows` rows.
    fn add_assign(&self, x: &mut Self::Act, y: &Self::Act, rows: usize);
    /// The residual add and the next norm in one pass: `x[r] += y[r]`, then
    /// `out[r] = rms_norm(x[r]) * weight`, over the first `rows` rows.
    fn add_rms_norm(
        &self,
        x: &mut Self::Act,
        y: &Self::Act,
        weight: &Self::Weight,
        eps: f32,
        rows: usize,
        out: &mut Self::Act,
    ) {
        self.add_assign(x, y, rows);
        self.rms_norm(x, weight, eps, rows, out);
    }
    /// A block's closing projection, its residual add and the next block's
    /// norm: `proj = input · wᵀ`, then `n.x += proj` and
    /// `n.out = rms_norm(n.x) * n.weight`, over the first `rows` rows. The
    /// projection must be this rank's whole sum (no other rank adds to it
    /// before the residual). `proj` holds nothing defined afterwards: a
    /// device backend may fold the add and the norm into the matmuls
    /// around them and never write it.
    fn matmul_add_rms_norm(
        &self,
        input: &Self::Act,
        w: &Self::Weight,
        rows: usize,
        proj: &mut Self::Act,
        n: ResidualNorm<'_, Self>,
    ) {
        unfused::matmul_add_rms_norm(self, input, w, rows, proj, n)
    }
    /// Several products of one input (a layer's q, k and v projections):
    /// `part.out = x · part.wᵀ (+ part.bias)` for each part. A device
    /// backend may run them as one launch, and, given `scratch` (an
    /// activation nothing reads until it is written again, holding at least
    /// `rows` rows of every part's columns side by side), as one matmul whose
    /// output it then splits.
    fn matmul_many(
        &self,
        x: &Self::Act,
        parts: &mut [MatmulPart<'_, Self>],
        rows: usize,
        scratch: Option<&mut Self::Act>,
    ) {
        let _ = scratch;
        unfused::matmul_many(self, x, parts, rows)
    }
    /// The gated MLP's first half: `out = silu(x · gateᵀ) * (x · upᵀ)`.
    /// `gate_out` and `up_out` are scratch of `out`'s shape, which a backend
    /// that fuses the three need not touch (one that multiplies by gate and
    /// up stacked may write both halves of each row into `gate_out`, when it
    /// holds twice the rows).
    #[allow(clippy::too_many_arguments)]
    fn gate_up_silu(
        &self,
        x: &Self::Act,
        gate: &Self::Weight,
        up: &Self::Weight,
        rows: usize,
        gate_out: &mut Self::Act,
        up_out: &mut Self::Act,
        out: &mut Self::Act,
    ) {
        unfused::gate_up_silu(self, x, gate, up, rows, gate_out, up_out, out)
    }
    /// Normalize q's and k's heads when `norm` is given, rotate q and k by
    /// their rows' positions (in place), then store the step's k and v rows
    /// in the cache: `head_rms_norm` twice, `rope`, `rope`, `write_kv`.
    #[allow(clippy::too_many_arguments)]
    fn rope_write_kv(
        &self,
        q: &mut Self::Act,
        k: &mut Self::Act,
        v: &Self::Act,
        norm: Option<QkNorm<'_, Self>>,
        table: &RopeTable,
        head_dim: usize,
        positions: &[u32],
        kv: &mut Self::Kv,
        seqs: &[SeqStep<'_>],
    ) {
        unfused::rope_write_kv(self, q, k, v, norm, table, head_dim, positions, kv, seqs)
    }
    /// A layer's attention after its q/k/v projections: `rope_write_kv` of
    /// `a`, then `attention` of `heads` query heads into `out`. A backend may
    /// do both in one pass where the step allows (the CUDA backend for a step
    /// of decode rows: each attention block rotates its own query heads and
    /// stores the new token's K and V itself), so what `a.q` and `a.k` hold
    /// afterwards is unspecified: nothing may read them before the next
    /// projections write them again.
    fn rope_attention(&self, a: RopeAttention<'_, Self>, heads: usize, out: &mut Self::Act) {
        let RopeAttention { q, k, v, norm, table, head_dim, positions, kv, seqs } = a;
        self.rope_write_kv(q, k, v, norm, table, head_dim, positions, kv, seqs);
        self.attention(q, kv, heads, seqs, out);
    }
    /// A hint that `w` is the next matmul's weight after the op that follows
    /// this call, an op that moves few bytes itself (a layer's RoPE and KV
    /// store, then its attention): a device backend may start reading `w`
    /// into its cache while that op runs, so the matmul does not start from
    /// memory after an idle stretch. Nothing any op computes depends on it;
    /// the hint holds for the next op only. The default does nothing.
    fn prefetch(&self, _w: &Self::Weight) {}
    /// Copy chosen rows: `out[i] = x[rows[i]]`.
    fn gather_rows(&self, x: &Self::Act, rows: &[usize], out: &mut Self::Act);
    /// Scatter scaled rows back: `out[rows[i]] += scales[i] * y[i]` for each
    /// `i` (a mixture-of-experts layer adding one expert's outputs into its
    /// tokens' rows). `out_rows` bounds the rows of `out` in use.
    ///
    /// The default goes through the host with the ops above (read both,
    /// combine, upload the result as a table, embed it back), so it runs
    /// anywhere, but slowly and, on a backend that stores uploaded matrices
    /// narrower than f32 (CUDA keeps bf16), with the sum rounded to that
    /// type; a backend overrides it with a direct kernel (the CPU does).
    fn add_rows_scaled(
        &self,
        out: &mut Self::Act,
        out_rows: usize,
        y: &Self::Act,
        rows: &[usize],
        scales: &[f32],
    ) -> Result<()> {
        unfused::add_rows_scaled(self, out, out_rows, y, rows, scales)
    }
    /// Build the table [`Backend::moe_ffn`] reads one sparse layer's
    /// `experts` through (once, at load; the experts outlive it).
    fn expert_table(&self, experts: &[Expert<Self::Weight>]) -> Result<Self::ExpertTable>;
    /// Whether [`Backend::moe_ffn`] over `table` runs without the host (no
    /// read-back mid-step), so a step with sparse layers may be captured.
    fn moe_on_device(&self, _table: &Self::ExpertTable) -> bool {
        false
    }
    /// The routed expert FFN of a sparse layer (see [`moe`]). The default
    /// routes on the host with the plain ops ([`moe::unfused::moe_ffn`]).
    fn moe_ffn(&self, p: MoeFfn<'_, Self>) -> Result<()> {
        moe::unfused::moe_ffn(self, p)
    }
    /// `x[r][i] *= sigmoid(gate[r][i])` over the first `rows` rows (the
    /// gated output of Qwen3.5's full attention).
    fn sigmoid_mul(&self, _x: &mut Self::Act, _gate: &Self::Act, _rows: usize) -> Result<()> {
        Err(unsupported(self, "sigmoid_mul"))
    }
    /// The depthwise causal convolution of a gated delta-net layer, then
    /// SiLU, in place over each sequence's rows of `x` (`[rows, channels]`).
    /// `weight` is `[channels, taps]`; `state` (`[slots, (taps - 1) *
    /// channels]`) holds each sequence's previous `taps - 1` inputs, oldest
    /// first, and is left holding its last ones. A sequence with nothing
    /// cached starts from zeros, whatever its slot held.
    fn causal_conv_silu(
        &self,
        _x: &mut Self::Act,
        _weight: &Self::Weight,
        _state: &mut Self::Act,
        _seqs: &[SeqStep<'_>],
        _slots: &[StateSlot],
    ) -> Result<()> {
        Err(unsupported(self, "causal_conv_silu"))
    }
    /// The gated delta rule over each sequence's rows, token by token from
    /// its slot's state (zeros for a sequence with nothing cached), leaving
    /// the state after its last row in the slot. Per value head, with q and
    /// k L2-normalized and q scaled by `1/sqrt(k_dim)`:
    /// `S = exp(g) S; S += k (beta (v - Sᵀk))ᵀ; out = Sᵀq`, where
    /// `g = -decay softplus(a + dt_bias)` and `beta = sigmoid(b)`.
    fn gated_delta_rule(&self, _p: DeltaRule<'_, Self>) -> Result<()> {
        Err(unsupported(self, "gated_delta_rule"))
    }
    /// RMS-normalize every `head_dim`-wide head of the first `rows` rows of
    /// `x` in place with the shared `weight`, then multiply by `silu(z)`.
    fn gated_rms_norm(
        &self,
        _x: &mut Self::Act,
        _z: &Self::Act,
        _weight: &Self::Weight,
        _eps: f32,
        _head_dim: usize,
        _rows: usize,
    ) -> Result<()> {
        Err(unsupported(self, "gated_rms_norm"))
    }
    /// Store the step's new K and V rows into the paged cache.
    fn write_kv(&self, kv: &mut Self::Kv, k: &Self::Act, v: &Self::Act, seqs: &[SeqStep<'_>]);
    /// Causal attention of the step's queries over each sequence's cache
    /// (which `write_kv` has already extended with this step's rows).
    /// `q` holds `heads × head_dim` columns per row, `out` the same.
    fn attention(
        &self,
        q: &Self::Act,
        kv: &Self::Kv,
        heads: usize,
        seqs: &[SeqStep<'_>],
        out: &mut Self::Act,
    );
    /// Copy the first `rows` rows to the host.
    fn read_rows(&self, x: &Self::Act, rows: usize, out: &mut Vec<f32>);
    /// Whether [`Backend::sample_rows`] is implemented here.
    fn samples_on_device(&self) -> bool {
        false
    }
    /// Allocate what [`Backend::sample_rows`] needs for `rows` rows of up to
    /// [`sample::MAX_EDITS_PER_ROW`] edits each, once, before the card's
    /// memory is handed to KV, so serving allocates nothing.
    fn reserve_sample_rows(&self, _rows: usize) -> Result<()> {
        Ok(())
    }
    /// Sanitize, adjust (in place) and draw the logits rows `specs` name,
    /// in one launch, and return one [`sample::RowSummary`] per spec
    /// (semantics in [`sample`]); `logits` is `[rows, vocab]`. Backends
    /// without it refuse, and the caller copies the rows to the host instead.
    fn sample_rows(
        &self,
        _logits: &mut Self::Act,
        _specs: &[sample::SampleRowSpec],
        _edits: &[sample::LogitEdit],
        _out: &mut sample::SampledRows,
    ) -> Result<()> {
        Err(unsupported(self, "sample_rows"))
    }
    /// Copy KV rows of one page to another (a copy-on-write of a shared page,
    /// or a live page moved so its chunk can be released). A device backend
    /// may only queue the copy: [`Backend::synchronize`] waits for it.
    fn copy_page(&self, kv: &mut Self::Kv, from: PageId, to: PageId);
    /// Copy one page of one layer's KV to the host as f32: the page's K,
    /// `[page_size, kv_heads, head_dim]`, then its V, the same shape. What a
    /// layout change re-shards between ranks. A backend without it refuses.
    fn read_kv_page(&self, _kv: &Self::Kv, _page: PageId, _out: &mut Vec<f32>) -> Result<()> {
        Err(BackendError::Other(format!("{} cannot read KV pages to the host", self.name())))
    }
    /// Overwrite one page of one layer's KV from the host, in the layout
    /// [`Backend::read_kv_page`] gives.
    fn write_kv_page(&self, _kv: &mut Self::Kv, _page: PageId, _data: &[f32]) -> Result<()> {
        Err(BackendError::Other(format!("{} cannot write KV pages from the host", self.name())))
    }
    /// Wait until every queued operation has finished (before memory they
    /// read is released) and report the first error any of them hit.
    fn synchronize(&self) -> Result<()> {
        self.check()
    }

    // Step hooks. The CPU needs none of them; a device backend uses them to
    // avoid per-op uploads, to place weights in one allocation and to replay
    // captured steps. Each default does nothing, so calling them is always
    // correct and leaving them out is always correct too.

    /// Announce the total bytes of weights about to be uploaded, so they can
    /// live in one allocation.
    fn reserve_weights(&self, _bytes: u64) -> Result<()> {
        Ok(())
    }
    /// Called once at the start of a forward pass, before any op.
    fn begin_step(&self, _plan: &StepPlan<'_>) -> Result<()> {
        Ok(())
    }
    /// Run a whole forward pass (`step`, which calls the ops) where this
    /// backend's ops run best. The CPU backend runs it on its thread pool,
    /// so each op's parallel loop starts from a worker instead of waking the
    /// pool from outside and sleeping until it is done, once per op.
    fn run_step<R: Send>(&self, step: impl FnOnce() -> R + Send) -> R {
        step()
    }
    /// The first error any op hit since the last call (ops that return `()`
    /// cannot report device failures themselves). Call after `read_rows`.
    fn check(&self) -> Result<()> {
        Ok(())
    }
    /// Replay the step captured under `key`, after `begin_step` uploaded this
    /// step's metadata. `Ok(true)`: replayed, skip the ops and go straight to
    /// `read_rows`; `Ok(false)`: nothing captured, run the ops.
    fn graph_replay(&self, _key: GraphKey) -> Result<bool> {
        Ok(false)
    }
    /// Start capturing the ops that follow under `key`. `Ok(false)`: this
    /// backend does not capture (run the ops as usual, no `graph_capture_end`).
    fn graph_capture_begin(&self, _key: GraphKey) -> Result<bool> {
        Ok(false)
    }
    /// Stop capturing and launch what was captured once, so the step's
    /// results are there as if the ops had run.
    fn graph_capture_end(&self, _key: GraphKey) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod capture_tests {
    use super::*;
    use std::cell::RefCell;

    /// Records the graph calls; replays what was captured before.
    #[derive(Default)]
    struct Recorder {
        calls: RefCell<Vec<&'static str>>,
        captured: RefCell<Vec<GraphKey>>,
        captures: bool,
    }
    impl GraphCapture for Recorder {
        fn replay(&self, key: GraphKey) -> Result<bool> {
            self.calls.borrow_mut().push("replay");
            Ok(self.captured.borrow().contains(&key))
        }
        fn begin_capture(&self, _key: GraphKey) -> Result<bool> {
            self.calls.borrow_mut().push("begin");
            Ok(self.captures)
        }
        fn end_capture(&self, key: GraphKey) -> Result<()> {
            self.calls.borrow_mut().push("end");
            self.captured.borrow_mut().push(key);
            Ok(())
        }
    }

    const KEY: GraphKey = GraphKey { rows: 8, logit_rows: 8 };

    fn step(
        r: &Recorder,
        key: Option<GraphKey>,
        fail: bool,
    ) -> (std::result::Result<(), BackendError>, bool) {
        let mut ran = false;
        let out = run_captured(r, key, || {
            ran = true;
            if fail {
                Err(BackendError::Other("op failed".into()))
            } else {
                Ok(())
            }
        });
        (out, ran)
    }

    #[test]
    fn a_step_is_captured_once_then_replayed_without_running_its_ops() {
        let r = Recorder { captures: true, ..Recorder::default() };
        assert!(matches!(step(&r, Some(KEY), false), (Ok(()), true)));
        assert_eq!(*r.calls.borrow(), ["replay", "begin", "end"]);
        r.calls.borrow_mut().clear();
        assert!(matches!(step(&r, Some(KEY), false), (Ok(()), false)), "a replayed step runs no ops");
        assert_eq!(*r.calls.borrow(), ["replay"]);
    }

    #[test]
    fn a_failed_op_still_ends_the_capture_and_reports_the_failure() {
        let r = Recorder { captures: true, ..Recorder::default() };
        let (out, ran) = step(&r, Some(KEY), true);
        assert!(ran && out.is_err());
        assert_eq!(*r.calls.borrow(), ["replay", "begin", "end"]);
    }

    #[test]
    fn without_a_key_or_a_capturing_backend_the_ops_just_run() {
        let r = Recorder::default();
        assert!(matches!(step(&r, None, false), (Ok(()), true)));
        assert!(r.calls.borrow().is_empty(), "no graph call without a key");
        assert!(matches!(step(&r, Some(KEY), false), (Ok(()), true)));
        assert_eq!(*r.calls.borrow(), ["replay", "begin"], "nothing to end when the backend did not capture");
    }
}
