//! Collectives: how the ranks of a parallel layout exchange activations and
//! agree on shared numbers.
//!
//! Two levels, so the model's code never branches on how many ranks there are:
//! - [`Group`]: what needs no device buffer — the rank's place in the group,
//!   a barrier, the MIN reduction every shared capacity decision goes through,
//!   the gather of host rows onto the rank that samples (logits live on the
//!   host), and the census.
//! - [`Collective`]: the operations on a backend's activations — all-reduce
//!   (sum) and point-to-point send/recv. It is generic over the backend, so a
//!   NCCL implementation can work on device buffers directly while the
//!   in-process one works on host slices.
//!
//! Implementations here: [`Solo`] (one rank; every exchange is a no-op) and
//! [`ThreadGroup`] (ranks as threads of one process, for the CPU and sim
//! cards, which is what CI runs). NCCL comes with the GPU path.
//!
//! The census: every rank counts the collectives it enters, per kind. At a
//! cadence every rank computes from replicated inputs (the step counter), the
//! ranks post their counts on a side board and compare. The board has its own
//! lock and every wait on it is bounded, so the comparison can never wedge even
//! when the collectives themselves have; a divergence names the rank that is
//! behind and by how many.
//!
//! The link: ranks that are threads exchange at memory speed, so a layout of
//! sim cards would show none of what a PCIe link costs, and pipeline versus
//! tensor parallelism could not show their trade-off. A [`LinkModel`] given
//! to [`ThreadGroup::with_link`] makes every transfer pay a modelled time:
//! a message is stamped with the instant it would have arrived, and the
//! receiver waits for that instant, so the sender computes on while its
//! message is in flight (as a DMA would let it), and messages on one link
//! queue behind each other. The time paid is counted per rank
//! ([`ThreadGroup::link_stats`]).

use crate::cpu::CpuAct;
use crate::Backend;
use corridor_units::{Bytes, Rank};
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What a transfer between two ranks costs: a fixed latency per message plus
/// its bytes over the link's bandwidth. The bytes are what the in-process
/// group carries, host `f32` values (4 bytes each).
///
/// Text form `BANDWIDTH,LATENCY`, e.g. `16GB/s,5us`: the bandwidth is a
/// number with `B/s`, decimal `KB/s`, `MB/s`, `GB/s`, `TB/s` (powers of
/// 1000), binary `KiB/s`, `MiB/s`, `GiB/s` (powers of 1024) or bits `Mbit/s`,
/// `Gbit/s`; the latency a number with `ns`, `us` (or `µs`), `ms` or `s`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkModel {
    /// Bytes per second, finite and positive.
    pub bandwidth: f64,
    /// Paid by every message on top of its bytes.
    pub latency: Duration,
}

impl LinkModel {
    /// A link of `bandwidth` bytes per second and `latency` per message.
    pub fn new(bandwidth: f64, latency: Duration) -> Result<LinkModel, LinkModelError> {
        if !(bandwidth.is_finite() && bandwidth > 0.0) {
            return Err(LinkModelError::Bandwidth(bandwidth.to_string()));
        }
        Ok(LinkModel { bandwidth, latency })
    }

    /// The wire time of `bytes`, without the latency.
    pub fn wire(&self, bytes: Bytes) -> Duration {
        Duration::from_secs_f64(bytes.get() as f64 / self.bandwidth)
    }

    /// One point-to-point message of `bytes`: latency + bytes / bandwidth.
    pub fn send(&self, bytes: Bytes) -> Duration {
        self.latency + self.wire(bytes)
    }

    /// A ring all-reduce of `bytes` over `world` ranks: each rank moves
    /// 2(n-1)/n of the buffer in 2(n-1) steps.
    pub fn all_reduce(&self, bytes: Bytes, world: usize) -> Duration {
        let n = world.max(1) as f64;
        let steps = 2 * world.saturating_sub(1) as u32;
        Duration::from_secs_f64(2.0 * (n - 1.0) / n * bytes.get() as f64 / self.bandwidth)
            + self.latency * steps
    }

    /// A ring all-gather whose gathered result is `bytes`: (n-1)/n of it
    /// moves, in n-1 steps.
    pub fn all_gather(&self, bytes: Bytes, world: usize) -> Duration {
        let n = world.max(1) as f64;
        let steps = world.saturating_sub(1) as u32;
        Duration::from_secs_f64((n - 1.0) / n * bytes.get() as f64 / self.bandwidth) + self.latency * steps
    }
}

/// Text that is not a link model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkModelError {
    #[error("link model '{0}': expected BANDWIDTH,LATENCY such as 16GB/s,5us")]
    Shape(String),
    #[error("link bandwidth '{0}': expected a positive number with B/s, KB/s, MB/s, GB/s, TB/s, KiB/s, MiB/s, GiB/s, Mbit/s or Gbit/s")]
    Bandwidth(String),
    #[error("link latency '{0}': expected a number with ns, us, ms or s")]
    Latency(String),
}

/// Split `text` into its number and its unit.
fn number_unit(text: &str) -> Option<(f64, &str)> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.parse().ok()?;
    v.is_finite().then_some((v, unit.trim()))
}

impl FromStr for LinkModel {
    type Err = LinkModelError;
    fn from_str(text: &str) -> Result<LinkModel, LinkModelError> {
        let (bw, lat) = text.split_once(',').ok_or_else(|| LinkModelError::Shape(text.to_string()))?;
        let bad_bw = || LinkModelError::Bandwidth(bw.trim().to_string());
        let (v, unit) = number_unit(bw).ok_or_else(bad_bw)?;
        let per = unit.strip_suffix("/s").ok_or_else(bad_bw)?;
        let scale = match per {
            "B" => 1.0,
            "KB" => 1e3,
            "MB" => 1e6,
            "GB" => 1e9,
            "TB" => 1e12,
            "KiB" => 1024.0,
            "MiB" => 1024.0 * 1024.0,
            "GiB" => 1024.0 * 1024.0 * 1024.0,
            "Mbit" => 1e6 / 8.0,
            "Gbit" => 1e9 / 8.0,
            _ => return Err(bad_bw()),
        };
        let bad_lat = || LinkModelError::Latency(lat.trim().to_string());
        let (l, unit) = number_unit(lat).ok_or_else(bad_lat)?;
        let secs = match unit {
            "ns" => l * 1e-9,
            "us" | "µs" => l * 1e-6,
            "ms" => l * 1e-3,
            "s" => l,
            _ => return Err(bad_lat()),
        };
        let latency = Duration::try_from_secs_f64(secs).map_err(|_| bad_lat())?;
        LinkModel::new(v * scale, latency).map_err(|_| bad_bw())
    }
}

impl fmt::Display for LinkModel {
    /// The text form, in GB/s and microseconds (parses back to the same link).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}GB/s,{}us", self.bandwidth / 1e9, self.latency.as_nanos() as f64 / 1e3)
    }
}

/// The modelled link time a rank has paid and the bytes it moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Modelled time of the transfers this rank started (sends) or took part
    /// in (all-reduce, all-gather).
    pub time: Duration,
    /// Bytes this rank put on the link (for a collective, the buffer size).
    pub bytes: Bytes,
}

#[derive(Debug, Default)]
struct LinkCounter {
    nanos: AtomicU64,
    bytes: AtomicU64,
}

impl LinkCounter {
    fn add(&self, time: Duration, bytes: Bytes) {
        self.nanos.fetch_add(time.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
        self.bytes.fetch_add(bytes.get(), Ordering::Relaxed);
    }
    fn get(&self) -> LinkStats {
        LinkStats {
            time: Duration::from_nanos(self.nanos.load(Ordering::Relaxed)),
            bytes: Bytes(self.bytes.load(Ordering::Relaxed)),
        }
    }
}

/// Bytes of `values` host `f32`s.
fn f32_bytes(values: usize) -> Bytes {
    Bytes(values as u64 * std::mem::size_of::<f32>() as u64)
}

/// The kinds of collective the census counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpKind {
    AllReduce,
    AllGather,
    Send,
    Recv,
    Barrier,
    Min,
}

impl OpKind {
    pub const ALL: [OpKind; 6] =
        [OpKind::AllReduce, OpKind::AllGather, OpKind::Send, OpKind::Recv, OpKind::Barrier, OpKind::Min];

    fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            OpKind::AllReduce => "all-reduce",
            OpKind::AllGather => "all-gather",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::Barrier => "barrier",
            OpKind::Min => "min",
        };
        f.write_str(s)
    }
}

/// Peers whose point-to-point traffic the census tracks one by one; a
/// larger group folds peers onto these slots (still counted, less precisely named).
pub const CENSUS_PEERS: usize = 16;

/// How many collectives of each kind a rank has entered, and how many
/// messages it sent to and received from each peer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Census {
    counts: [u64; 6],
    sent: [u64; CENSUS_PEERS],
    received: [u64; CENSUS_PEERS],
}

impl Census {
    pub fn get(&self, kind: OpKind) -> u64 {
        self.counts[kind.index()]
    }
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }
}

/// Per-kind counters a rank bumps as it enters collectives.
#[derive(Debug, Default)]
struct Counters {
    counts: [AtomicU64; 6],
    sent: [AtomicU64; CENSUS_PEERS],
    received: [AtomicU64; CENSUS_PEERS],
}

impl Counters {
    fn bump(&self, kind: OpKind) {
        self.counts[kind.index()].fetch_add(1, Ordering::Relaxed);
    }
    fn bump_p2p(&self, kind: OpKind, peer: Rank) {
        self.bump(kind);
        let slots = if kind == OpKind::Send { &self.sent } else { &self.received };
        slots[peer.0 as usize % CENSUS_PEERS].fetch_add(1, Ordering::Relaxed);
    }
    fn snapshot(&self) -> Census {
        let load = |a: &[AtomicU64], o: &mut [u64]| {
            o.iter_mut().zip(a).for_each(|(o, a)| *o = a.load(Ordering::Relaxed))
        };
        let mut c = Census::default();
        load(&self.counts, &mut c.counts);
        load(&self.sent, &mut c.sent);
        load(&self.received, &mut c.received);
        c
    }
    fn clear(&self) {
        for a in self.counts.iter().chain(&self.sent).chain(&self.received) {
            a.store(0, Ordering::Relaxed);
        }
    }
}

/// Why a collective failed. Every variant names the rank that saw it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CollectiveError {
    #[error("{rank}: {op} waited {waited:?} for its peers and gave up")]
    Timeout { rank: Rank, op: OpKind, waited: Duration },
    #[error("{rank}: {op} abandoned because the group was aborted: {reason}")]
    Aborted { rank: Rank, op: OpKind, reason: String },
    #[error("{rank}: entered {op} while {other} entered {theirs}: the ranks are out of lockstep")]
    Mismatch { rank: Rank, op: OpKind, other: Rank, theirs: OpKind },
    #[error("{rank}: {op} of {len} values, but {other} gave {theirs}")]
    Length { rank: Rank, op: OpKind, len: usize, other: Rank, theirs: usize },
    #[error("{rank}: {op} names {peer}, which is not in this group of {world}")]
    NoPeer { rank: Rank, op: OpKind, peer: Rank, world: usize },
    #[error("{rank}: {op} over columns {at}+{width} does not fit rows of {cols}")]
    BadColumns { rank: Rank, op: OpKind, at: usize, width: usize, cols: usize },
    #[error("collective census diverged: {behind} is behind {ahead} by {by} {kind} collective(s)")]
    Divergence { kind: OpKind, behind: Rank, ahead: Rank, by: u64 },
    #[error("collective census: {missing:?} did not post within {waited:?}")]
    CensusSilent { missing: Vec<Rank>, waited: Duration },
}

pub type CollectiveResult<T> = std::result::Result<T, CollectiveError>;

/// What every rank of a group can do without a device buffer.
pub trait Group: Send + Sync {
    fn rank(&self) -> Rank;
    /// Ranks in the group.
    fn world(&self) -> usize;
    /// Wait until every rank has arrived.
    fn barrier(&self) -> CollectiveResult<()>;
    /// The minimum of every rank's `value`. Every capacity the ranks share
    /// (how many tokens the group admits) is agreed through this, so one rank
    /// that cannot grow holds the whole group back instead of desyncing it.
    fn min_u64(&self, value: u64) -> CollectiveResult<u64>;
    /// Whether [`Group::gather_cols`] leaves the whole rows on this rank:
    /// rank 0 of a tensor-parallel group (the rank whose logits are sampled),
    /// every stage of a pipeline (a stage's rows are its own), a group of one.
    fn gathers_here(&self) -> bool;
    /// Gather column blocks of host rows: this rank's `mine` is `[rows,
    /// width]` and lands at columns `at..at + width` of `out`, `[rows, cols]`,
    /// on the rank that [gathers](Group::gathers_here); every rank of a tensor
    /// group enters it, and only the gathering one passes `out` (the others
    /// pass `None` and copy nothing but their own block). Columns no rank
    /// covers are left as they were.
    fn gather_cols(
        &self,
        mine: &[f32],
        rows: usize,
        at: usize,
        out: Option<&mut [f32]>,
    ) -> CollectiveResult<()>;
    /// This rank's counts so far.
    fn census(&self) -> Census;
    /// Compare every rank's census over the side channel. Call at a cadence
    /// every rank derives from replicated inputs.
    fn compare_census(&self) -> CollectiveResult<Census>;
    /// Tell the peers this rank has failed, so their waits end now instead of
    /// at a timeout.
    fn abort(&self, reason: &str);
}

/// Operations on a backend's activations. Object-safe: the model takes a
/// `&dyn Collective<B>`.
pub trait Collective<B: Backend>: Group {
    /// Sum the first `rows` rows of `x` over every rank, in place.
    fn all_reduce_sum(&self, backend: &B, x: &mut B::Act, rows: usize) -> CollectiveResult<()>;
    /// Hand the first `rows` rows of `x` to rank `to`.
    fn send(&self, backend: &B, to: Rank, x: &B::Act, rows: usize) -> CollectiveResult<()>;
    /// Receive `rows` rows from rank `from` into `x`.
    fn recv(&self, backend: &B, from: Rank, x: &mut B::Act, rows: usize) -> CollectiveResult<()>;
    /// Whether a step that calls these may be captured as a device graph and
    /// replayed without calling them again.
    fn capturable(&self) -> bool {
        false
    }
}

/// Activations whose rows live in host memory, which the in-process
/// collective reads and writes directly.
pub trait HostRows {
    /// Values per row.
    fn width(&self) -> usize;
    fn host_rows(&self, rows: usize) -> &[f32];
    fn host_rows_mut(&mut self, rows: usize) -> &mut [f32];
}

impl HostRows for CpuAct {
    fn width(&self) -> usize {
        self.cols()
    }
    fn host_rows(&self, rows: usize) -> &[f32] {
        self.live(rows)
    }
    fn host_rows_mut(&mut self, rows: usize) -> &mut [f32] {
        self.live_mut(rows)
    }
}

/// A gather that involves no peer: place this rank's block, if it gathers.
fn place_own(
    rank: Rank,
    mine: &[f32],
    rows: usize,
    at: usize,
    out: Option<&mut [f32]>,
) -> CollectiveResult<()> {
    out.map_or(Ok(()), |out| place_cols(rank, mine, rows, at, out))
}

fn place_cols(rank: Rank, mine: &[f32], rows: usize, at: usize, out: &mut [f32]) -> CollectiveResult<()> {
    let bad = |width: usize, cols: usize| CollectiveError::BadColumns {
        rank,
        op: OpKind::AllGather,
        at,
        width,
        cols,
    };
    if rows == 0 {
        return Ok(());
    }
    let (width, cols) = (mine.len() / rows, out.len() / rows);
    if mine.len() != width * rows || out.len() != cols * rows || at + width > cols {
        return Err(bad(width, cols));
    }
    for r in 0..rows {
        out[r * cols + at..r * cols + at + width].copy_from_slice(&mine[r * width..(r + 1) * width]);
    }
    Ok(())
}

/// Logits as whole rows on the rank that samples: this rank computed the
/// vocabulary columns `cols` (of `total`) of `rows` rows, and `read` copies
/// that block from the device into a host buffer. When the gather involves
/// no other rank and this rank holds every column, `read` fills `out`
/// directly (at a large batch the rows are tens of megabytes, so the copy
/// through `scratch` would cost milliseconds); otherwise the block goes
/// through `scratch` and [`Group::gather_cols`], and `out` is `[rows, total]`
/// on the rank that gathers and left as it was on the others. Here, not in
/// the model, because which of the two applies depends on the group.
pub fn gather_logits<G: Group + ?Sized, E: From<CollectiveError>>(
    group: &G,
    rows: usize,
    cols: std::ops::Range<usize>,
    total: usize,
    scratch: &mut Vec<f32>,
    out: &mut Vec<f32>,
    read: impl FnOnce(&mut Vec<f32>) -> Result<(), E>,
) -> Result<(), E> {
    if group.world() == 1 && cols == (0..total) {
        return read(out);
    }
    read(scratch)?;
    if group.gathers_here() {
        out.resize(rows * total, 0.0);
        group.gather_cols(scratch, rows, cols.start, Some(out))?;
    } else {
        group.gather_cols(scratch, rows, cols.start, None)?;
    }
    Ok(())
}

/// The group of one: every exchange is the identity, so the single-rank path
/// runs the same model code as a layout.
#[derive(Debug, Default)]
pub struct Solo {
    counters: Counters,
}

impl Solo {
    pub fn new() -> Solo {
        Solo::default()
    }
}

impl Group for Solo {
    fn rank(&self) -> Rank {
        Rank(0)
    }
    fn world(&self) -> usize {
        1
    }
    fn barrier(&self) -> CollectiveResult<()> {
        self.counters.bump(OpKind::Barrier);
        Ok(())
    }
    fn min_u64(&self, value: u64) -> CollectiveResult<u64> {
        self.counters.bump(OpKind::Min);
        Ok(value)
    }
    fn gathers_here(&self) -> bool {
        true
    }
    fn gather_cols(
        &self,
        mine: &[f32],
        rows: usize,
        at: usize,
        out: Option<&mut [f32]>,
    ) -> CollectiveResult<()> {
        self.counters.bump(OpKind::AllGather);
        place_own(Rank(0), mine, rows, at, out)
    }
    fn census(&self) -> Census {
        self.counters.snapshot()
    }
    fn compare_census(&self) -> CollectiveResult<Census> {
        Ok(self.census())
    }
    fn abort(&self, _reason: &str) {}
}

impl<B: Backend> Collective<B> for Solo {
    /// One rank exchanges nothing: a replay skips only the counting.
    fn capturable(&self) -> bool {
        true
    }
    fn all_reduce_sum(&self, _backend: &B, _x: &mut B::Act, _rows: usize) -> CollectiveResult<()> {
        self.counters.bump(OpKind::AllReduce);
        Ok(())
    }
    fn send(&self, _backend: &B, to: Rank, _x: &B::Act, _rows: usize) -> CollectiveResult<()> {
        Err(CollectiveError::NoPeer { rank: Rank(0), op: OpKind::Send, peer: to, world: 1 })
    }
    fn recv(&self, _backend: &B, from: Rank, _x: &mut B::Act, _rows: usize) -> CollectiveResult<()> {
        Err(CollectiveError::NoPeer { rank: Rank(0), op: OpKind::Recv, peer: from, world: 1 })
    }
}

/// What one rank brings to a round.
#[derive(Debug)]
enum Contribution {
    Sum(Vec<f32>),
    /// `len`: the values of this rank's block, also when `data` stays
    /// behind (the gathering rank places its own block itself).
    Cols {
        at: usize,
        rows: usize,
        len: usize,
        data: Vec<f32>,
    },
    Min(u64),
    Unit,
}

/// What every rank takes away from a round.
#[derive(Debug)]
enum Outcome {
    Sum(Vec<f32>),
    /// Each rank's block as (at, rows, data), and the values of all blocks.
    Cols {
        blocks: Vec<(usize, usize, Vec<f32>)>,
        values: usize,
    },
    Min(u64),
    Unit,
}

/// The round every rank is (or will be) in: collectives are entered in the
/// same order on every rank, so one round at a time suffices.
#[derive(Debug, Default)]
struct Round {
    kind: Option<(OpKind, Rank)>,
    slots: Vec<Option<Contribution>>,
    arrived: usize,
    generation: u64,
    result: Option<Arc<Outcome>>,
    /// Ranks that have not yet taken the last result; a new round waits for 0.
    readers_left: usize,
    /// When the last result would have crossed the link (with a link model).
    ready_at: Option<Instant>,
}

/// One point-to-point message in flight.
#[derive(Debug)]
struct Message {
    /// When the link would have delivered it (`None`: no link model).
    arrives: Option<Instant>,
    values: Vec<f32>,
}

#[derive(Debug, Default)]
struct State {
    aborted: Option<String>,
    round: Round,
    /// Point-to-point messages, by (from, to), in send order, each with the
    /// instant it arrives (with a link model; else it is there at once).
    mail: HashMap<(u32, u32), VecDeque<Message>>,
    /// With a link model: when each (from, to) link is free again, so
    /// messages on one link queue behind each other.
    link_free: HashMap<(u32, u32), Instant>,
}

/// How many past comparisons each rank's posts are kept for: a rank that
/// has finished comparison `e` may post `e + 1` before a slower peer has read
/// `e`, so a post must not overwrite the one before it.
const BOARD_DEPTH: usize = 4;

#[derive(Debug, Default)]
struct Board {
    /// Each rank's recent posts: (epoch, counts), oldest first.
    posts: Vec<VecDeque<(u64, Census)>>,
}

impl Board {
    fn get(&self, rank: usize, epoch: u64) -> Option<Census> {
        self.posts[rank].iter().find(|(e, _)| *e == epoch).map(|(_, c)| *c)
    }
}

/// Which ranks an all-reduce and an all-gather span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupShape {
    /// Tensor parallelism: every rank holds a share of every layer, so the
    /// reductions span the whole group.
    Tensor,
    /// Pipeline parallelism: each stage holds whole layers, so a stage's
    /// reductions are its own (the identity) and stages talk by send/recv.
    Pipeline,
}

#[derive(Debug)]
struct Shared {
    world: usize,
    shape: GroupShape,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
    counters: Vec<Counters>,
    board: Mutex<Board>,
    board_cv: Condvar,
    epochs: Vec<AtomicU64>,
    link: Option<LinkModel>,
    /// Per rank; kept across [`ThreadGroup::reset`] (a benchmark's total).
    link_stats: Vec<LinkCounter>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank thread that panicked mid-collective leaves consistent data
        // behind (every update is a whole assignment), so a poisoned lock is
        // taken over rather than spreading the panic.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn board(&self) -> MutexGuard<'_, Board> {
        self.board.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A group of ranks that are threads of this process. Create it once, hand
/// one [`ThreadRank`] to each rank thread, and keep the group to
/// [`reset`](ThreadGroup::reset) it after a failed step.
#[derive(Clone, Debug)]
pub struct ThreadGroup {
    shared: Arc<Shared>,
}

/// One rank's handle on a [`ThreadGroup`].
#[derive(Debug)]
pub struct ThreadRank {
    rank: Rank,
    shared: Arc<Shared>,
}

impl ThreadGroup {
    /// A group of `world` ranks; a collective that waits longer than
    /// `timeout` for its peers fails (and aborts the group) instead of hanging.
    /// Barriers and MIN reductions always span every rank; `shape` says
    /// whether all-reduce and all-gather do.
    pub fn new(world: usize, shape: GroupShape, timeout: Duration) -> (ThreadGroup, Vec<ThreadRank>) {
        ThreadGroup::with_link(world, shape, timeout, None)
    }

    /// [`ThreadGroup::new`] whose transfers pay `link` (none: they cost
    /// nothing, as between threads): a send its latency plus its bytes over
    /// the bandwidth, an all-reduce and an all-gather a ring's cost.
    pub fn with_link(
        world: usize,
        shape: GroupShape,
        timeout: Duration,
        link: Option<LinkModel>,
    ) -> (ThreadGroup, Vec<ThreadRank>) {
        let world = world.max(1);
        let shared = Arc::new(Shared {
            world,
            shape,
            timeout,
            state: Mutex::new(State {
                round: Round { slots: (0..world).map(|_| None).collect(), ..Round::default() },
                ..State::default()
            }),
            cv: Condvar::new(),
            counters: (0..world).map(|_| Counters::default()).collect(),
            board: Mutex::new(Board { posts: vec![VecDeque::new(); world] }),
            board_cv: Condvar::new(),
            epochs: (0..world).map(|_| AtomicU64::new(0)).collect(),
            link,
            link_stats: (0..world).map(|_| LinkCounter::default()).collect(),
        });
        let ranks = (0..world).map(|r| ThreadRank { rank: Rank(r as u32), shared: shared.clone() }).collect();
        (ThreadGroup { shared }, ranks)
    }

    pub fn world(&self) -> usize {
        self.shared.world
    }

    /// The link model the group's transfers pay, if any.
    pub fn link(&self) -> Option<LinkModel> {
        self.shared.link
    }

    /// Each rank's modelled link time and bytes so far (zero without a link
    /// model).
    pub fn link_stats(&self) -> Vec<LinkStats> {
        self.shared.link_stats.iter().map(LinkCounter::get).collect()
    }

    /// Abort every wait in progress (e.g. the driver saw a rank fail).
    pub fn abort(&self, reason: &str) {
        let mut st = self.shared.lock();
        st.aborted.get_or_insert_with(|| reason.to_string());
        self.shared.cv.notify_all();
    }

    /// Clear an aborted step: the half-finished round, undelivered messages
    /// and the census (a failed step legitimately leaves ranks at different
    /// counts). Call only while no rank is inside a collective.
    pub fn reset(&self) {
        let mut st = self.shared.lock();
        st.aborted = None;
        st.round = Round { slots: (0..self.shared.world).map(|_| None).collect(), ..Round::default() };
        st.mail.clear();
        st.link_free.clear();
        for c in &self.shared.counters {
            c.clear();
        }
        drop(st);
        let mut board = self.shared.board();
        board.posts.iter_mut().for_each(|p| p.clear());
        for e in &self.shared.epochs {
            e.store(0, Ordering::Relaxed);
        }
    }
}

impl ThreadRank {
    fn abort_error(&self, op: OpKind, st: &State) -> Option<CollectiveError> {
        st.aborted.as_ref().map(|reason| CollectiveError::Aborted {
            rank: self.rank,
            op,
            reason: reason.clone(),
        })
    }

    /// Wait on the group's condition variable until `done` holds, the group
    /// is aborted, or the deadline passes (which aborts the group).
    fn wait_until<'a>(
        &self,
        op: OpKind,
        mut st: MutexGuard<'a, State>,
        started: Instant,
        done: impl Fn(&State) -> bool,
    ) -> CollectiveResult<MutexGuard<'a, State>> {
        let sh = &self.shared;
        loop {
            if let Some(e) = self.abort_error(op, &st) {
                return Err(e);
            }
            if done(&st) {
                return Ok(st);
            }
            let waited = started.elapsed();
            if waited >= sh.timeout {
                st.aborted = Some(format!("{} timed out in {op}", self.rank));
                sh.cv.notify_all();
                return Err(CollectiveError::Timeout { rank: self.rank, op, waited });
            }
            st = sh.cv.wait_timeout(st, sh.timeout - waited).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Enter one round of a collective with this rank's contribution.
    fn round(&self, op: OpKind, mine: Contribution) -> CollectiveResult<Arc<Outcome>> {
        let sh = &self.shared;
        sh.counters[self.rank.0 as usize].bump(op);
        let started = Instant::now();
        let st = sh.lock();
        // The previous round's result must be taken by everyone first.
        let mut st = self.wait_until(op, st, started, |s| s.round.readers_left == 0)?;
        if let Some((theirs, other)) = st.round.kind {
            if theirs != op {
                let e = CollectiveError::Mismatch { rank: self.rank, op, other, theirs };
                st.aborted = Some(e.to_string());
                sh.cv.notify_all();
                return Err(e);
            }
        }
        st.round.kind = Some((op, self.rank));
        st.round.slots[self.rank.0 as usize] = Some(mine);
        st.round.arrived += 1;
        let generation = st.round.generation;
        if st.round.arrived == sh.world {
            let (outcome, cost) = self.combine(op, &mut st)?;
            let r = &mut st.round;
            r.ready_at = cost.map(|c| Instant::now() + c);
            r.result = Some(Arc::new(outcome));
            r.readers_left = sh.world;
            r.arrived = 0;
            r.kind = None;
            r.generation += 1;
            sh.cv.notify_all();
        }
        let mut st = self.wait_until(op, st, started, |s| s.round.generation != generation)?;
        let result = st.round.result.clone().expect("a finished round has a result");
        let ready_at = st.round.ready_at;
        st.round.readers_left -= 1;
        if st.round.readers_left == 0 {
            st.round.result = None;
            sh.cv.notify_all();
        }
        drop(st);
        if let Some(at) = ready_at {
            // The exchange ends when the ring would have: every rank waits
            // out the modelled time after the last one arrived.
            sh.link_stats[self.rank.0 as usize]
                .add(self.round_cost(op, &result), self.round_bytes(op, &result));
            self.wait_link(op, at, started)?;
        }
        Ok(result)
    }

    /// Bytes a round's outcome moved over the link.
    fn round_bytes(&self, op: OpKind, out: &Outcome) -> Bytes {
        match (op, out) {
            (OpKind::AllReduce, Outcome::Sum(v)) => f32_bytes(v.len()),
            (OpKind::AllGather, Outcome::Cols { values, .. }) => f32_bytes(*values),
            _ => Bytes::ZERO,
        }
    }

    /// The modelled time of a round (zero without a link, or for a round
    /// that carries no data over it: barriers and MINs are host messages).
    fn round_cost(&self, op: OpKind, out: &Outcome) -> Duration {
        let Some(link) = self.shared.link else { return Duration::ZERO };
        let (bytes, world) = (self.round_bytes(op, out), self.shared.world);
        match op {
            OpKind::AllReduce => link.all_reduce(bytes, world),
            OpKind::AllGather => link.all_gather(bytes, world),
            _ => Duration::ZERO,
        }
    }

    /// Sleep until `at`, the modelled end of a transfer, unless that runs
    /// past the group's timeout (then fail as a wait for a peer would).
    fn wait_link(&self, op: OpKind, at: Instant, started: Instant) -> CollectiveResult<()> {
        let now = Instant::now();
        if at <= now {
            return Ok(());
        }
        let waited = now - started;
        if waited + (at - now) > self.shared.timeout {
            return Err(CollectiveError::Timeout { rank: self.rank, op, waited });
        }
        std::thread::sleep(at - now);
        Ok(())
    }

    /// Combine every slot of a full round (called by the last rank to
    /// arrive), with the round's modelled link time when there is a link.
    fn combine(&self, op: OpKind, st: &mut State) -> CollectiveResult<(Outcome, Option<Duration>)> {
        let out = self.combine_slots(op, st)?;
        let cost = self.shared.link.map(|_| self.round_cost(op, &out));
        Ok((out, cost))
    }

    fn combine_slots(&self, op: OpKind, st: &mut State) -> CollectiveResult<Outcome> {
        let slots: Vec<Contribution> =
            st.round.slots.iter_mut().map(|s| s.take().unwrap_or(Contribution::Unit)).collect();
        let fail = |st: &mut State, e: CollectiveError| {
            st.aborted = Some(e.to_string());
            self.shared.cv.notify_all();
            Err(e)
        };
        Ok(match op {
            OpKind::AllReduce => {
                let mut acc: Option<Vec<f32>> = None;
                for (r, s) in slots.into_iter().enumerate() {
                    let Contribution::Sum(v) = s else { continue };
                    match &mut acc {
                        None => acc = Some(v),
                        Some(a) if a.len() != v.len() => {
                            let e = CollectiveError::Length {
                                rank: self.rank,
                                op,
                                len: a.len(),
                                other: Rank(r as u32),
                                theirs: v.len(),
                            };
                            return fail(st, e);
                        }
                        Some(a) => a.iter_mut().zip(&v).for_each(|(a, b)| *a += b),
                    }
                }
                Outcome::Sum(acc.unwrap_or_default())
            }
            OpKind::AllGather => {
                let mut values = 0;
                let blocks = slots
                    .into_iter()
                    .filter_map(|s| match s {
                        Contribution::Cols { at, rows, len, data } => {
                            values += len;
                            Some((at, rows, data))
                        }
                        _ => None,
                    })
                    .collect();
                Outcome::Cols { blocks, values }
            }
            OpKind::Min => Outcome::Min(
                slots
                    .iter()
                    .filter_map(|s| match s {
                        Contribution::Min(v) => Some(*v),
                        _ => None,
                    })
                    .min()
                    .unwrap_or(u64::MAX),
            ),
            OpKind::Barrier | OpKind::Send | OpKind::Recv => Outcome::Unit,
        })
    }

    fn peer(&self, op: OpKind, peer: Rank) -> CollectiveResult<()> {
        if peer.0 as usize >= self.shared.world || peer == self.rank {
            return Err(CollectiveError::NoPeer { rank: self.rank, op, peer, world: self.shared.world });
        }
        Ok(())
    }

    /// Which ranks an all-reduce spans.
    pub fn shape(&self) -> GroupShape {
        self.shared.shape
    }

    /// Count a collective another transport carried out for this rank (a
    /// device collective whose host side is this group), so the census sees
    /// it. `peer` names the other end of a send or receive.
    pub fn count(&self, kind: OpKind, peer: Option<Rank>) {
        let c = &self.shared.counters[self.rank.0 as usize];
        match peer {
            Some(p) => c.bump_p2p(kind, p),
            None => c.bump(kind),
        }
    }

    /// Fail with the group's abort, if it has been aborted.
    pub fn check_aborted(&self, op: OpKind) -> CollectiveResult<()> {
        let st = self.shared.lock();
        match self.abort_error(op, &st) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Check that `peer` is another rank of this group.
    pub fn check_peer(&self, op: OpKind, peer: Rank) -> CollectiveResult<()> {
        self.peer(op, peer)
    }

    /// Send host values to `to` (buffered: returns once queued).
    pub fn send_host(&self, to: Rank, values: &[f32]) -> CollectiveResult<()> {
        self.peer(OpKind::Send, to)?;
        let sh = &self.shared;
        sh.counters[self.rank.0 as usize].bump_p2p(OpKind::Send, to);
        let key = (self.rank.0, to.0);
        let mut st = sh.lock();
        if let Some(e) = self.abort_error(OpKind::Send, &st) {
            return Err(e);
        }
        // With a link the message arrives once the link has carried the
        // messages before it and then this one's bytes and latency; the
        // sender goes on at once, as it would after starting a DMA.
        let arrives = sh.link.map(|link| {
            let bytes = f32_bytes(values.len());
            let now = Instant::now();
            let start = st.link_free.get(&key).copied().filter(|&t| t > now).unwrap_or(now);
            let on_wire = start + link.wire(bytes);
            st.link_free.insert(key, on_wire);
            sh.link_stats[self.rank.0 as usize].add(link.send(bytes), bytes);
            on_wire + link.latency
        });
        st.mail.entry(key).or_default().push_back(Message { arrives, values: values.to_vec() });
        sh.cv.notify_all();
        Ok(())
    }

    /// Receive host values from `from` into `out` (which must match the
    /// length sent).
    pub fn recv_host(&self, from: Rank, out: &mut [f32]) -> CollectiveResult<()> {
        self.peer(OpKind::Recv, from)?;
        let sh = &self.shared;
        sh.counters[self.rank.0 as usize].bump_p2p(OpKind::Recv, from);
        let key = (from.0, self.rank.0);
        let started = Instant::now();
        let st = sh.lock();
        let mut st =
            self.wait_until(OpKind::Recv, st, started, |s| s.mail.get(&key).is_some_and(|q| !q.is_empty()))?;
        let Message { arrives, values: msg } =
            st.mail.get_mut(&key).and_then(|q| q.pop_front()).expect("waited for a message");
        if msg.len() != out.len() {
            let e = CollectiveError::Length {
                rank: self.rank,
                op: OpKind::Recv,
                len: out.len(),
                other: from,
                theirs: msg.len(),
            };
            st.aborted = Some(e.to_string());
            sh.cv.notify_all();
            return Err(e);
        }
        drop(st);
        if let Some(at) = arrives {
            self.wait_link(OpKind::Recv, at, started)?;
        }
        out.copy_from_slice(&msg);
        Ok(())
    }

    /// Sum host values over every rank, in place.
    pub fn all_reduce_host(&self, values: &mut [f32]) -> CollectiveResult<()> {
        if self.shared.shape == GroupShape::Pipeline {
            // A stage's reduction is its own: no peer enters it, so the census
            // does not count it (stages hold different numbers of layers).
            return Ok(());
        }
        let out = self.round(OpKind::AllReduce, Contribution::Sum(values.to_vec()))?;
        let Outcome::Sum(sum) = &*out else { unreachable!("an all-reduce round yields a sum") };
        if sum.len() != values.len() {
            return Err(CollectiveError::Length {
                rank: self.rank,
                op: OpKind::AllReduce,
                len: values.len(),
                other: self.rank,
                theirs: sum.len(),
            });
        }
        values.copy_from_slice(sum);
        Ok(())
    }
}

impl Group for ThreadRank {
    fn rank(&self) -> Rank {
        self.rank
    }
    fn world(&self) -> usize {
        self.shared.world
    }
    fn barrier(&self) -> CollectiveResult<()> {
        self.round(OpKind::Barrier, Contribution::Unit).map(|_| ())
    }
    fn min_u64(&self, value: u64) -> CollectiveResult<u64> {
        let out = self.round(OpKind::Min, Contribution::Min(value))?;
        let Outcome::Min(v) = &*out else { unreachable!("a min round yields a minimum") };
        Ok(*v)
    }
    fn gathers_here(&self) -> bool {
        self.shared.shape == GroupShape::Pipeline || self.rank == Rank(0)
    }
    fn gather_cols(
        &self,
        mine: &[f32],
        rows: usize,
        at: usize,
        out: Option<&mut [f32]>,
    ) -> CollectiveResult<()> {
        if self.shared.shape == GroupShape::Pipeline {
            return place_own(self.rank, mine, rows, at, out);
        }
        // The gathering rank places its own block straight from `mine`; only
        // the others' blocks travel through the round.
        let gathering = self.gathers_here();
        let data = if gathering { Vec::new() } else { mine.to_vec() };
        let res = self.round(OpKind::AllGather, Contribution::Cols { at, rows, len: mine.len(), data })?;
        let Some(out) = out.filter(|_| gathering) else { return Ok(()) };
        place_cols(self.rank, mine, rows, at, out)?;
        let Outcome::Cols { blocks, .. } = &*res else { unreachable!("an all-gather round yields blocks") };
        for (at, r, data) in blocks.iter().filter(|b| !b.2.is_empty()) {
            if *r != rows {
                return Err(CollectiveError::Length {
                    rank: self.rank,
                    op: OpKind::AllGather,
                    len: rows,
                    other: self.rank,
                    theirs: *r,
                });
            }
            place_cols(self.rank, data, rows, *at, out)?;
        }
        Ok(())
    }
    fn census(&self) -> Census {
        self.shared.counters[self.rank.0 as usize].snapshot()
    }
    fn compare_census(&self) -> CollectiveResult<Census> {
        let sh = &self.shared;
        let mine = self.census();
        let epoch = sh.epochs[self.rank.0 as usize].fetch_add(1, Ordering::Relaxed) + 1;
        let started = Instant::now();
        let mut board = sh.board();
        let own = &mut board.posts[self.rank.0 as usize];
        own.push_back((epoch, mine));
        if own.len() > BOARD_DEPTH {
            own.pop_front();
        }
        sh.board_cv.notify_all();
        loop {
            let missing: Vec<Rank> =
                (0..sh.world).filter(|&r| board.get(r, epoch).is_none()).map(|r| Rank(r as u32)).collect();
            if missing.is_empty() {
                break;
            }
            let waited = started.elapsed();
            if waited >= sh.timeout {
                return Err(CollectiveError::CensusSilent { missing, waited });
            }
            board = sh.board_cv.wait_timeout(board, sh.timeout - waited).unwrap_or_else(|p| p.into_inner()).0;
        }
        let posts: Vec<Census> = (0..sh.world).map(|r| board.get(r, epoch).unwrap_or_default()).collect();
        drop(board);
        // Group-wide kinds: every rank enters every one of them.
        for kind in [OpKind::AllReduce, OpKind::AllGather, OpKind::Barrier, OpKind::Min] {
            let (behind, lo) = posts
                .iter()
                .enumerate()
                .map(|(r, c)| (r, c.get(kind)))
                .min_by_key(|&(_, v)| v)
                .unwrap_or((0, 0));
            let (ahead, hi) = posts
                .iter()
                .enumerate()
                .map(|(r, c)| (r, c.get(kind)))
                .max_by_key(|&(_, v)| v)
                .unwrap_or((0, 0));
            if hi != lo {
                return Err(CollectiveError::Divergence {
                    kind,
                    behind: Rank(behind as u32),
                    ahead: Rank(ahead as u32),
                    by: hi - lo,
                });
            }
        }
        // Point to point: what `a` sent to `b` must be what `b` took from `a`.
        for a in 0..sh.world {
            for b in 0..sh.world {
                let (sent, got) = (posts[a].sent[b % CENSUS_PEERS], posts[b].received[a % CENSUS_PEERS]);
                if sent > got {
                    return Err(CollectiveError::Divergence {
                        kind: OpKind::Recv,
                        behind: Rank(b as u32),
                        ahead: Rank(a as u32),
                        by: sent - got,
                    });
                }
                if got > sent {
                    return Err(CollectiveError::Divergence {
                        kind: OpKind::Send,
                        behind: Rank(a as u32),
                        ahead: Rank(b as u32),
                        by: got - sent,
                    });
                }
            }
        }
        Ok(mine)
    }
    fn abort(&self, reason: &str) {
        let mut st = self.shared.lock();
        st.aborted.get_or_insert_with(|| format!("{}: {reason}", self.rank));
        self.shared.cv.notify_all();
    }
}

impl<B: Backend> Collective<B> for ThreadRank
where
    B::Act: HostRows,
{
    fn all_reduce_sum(&self, _backend: &B, x: &mut B::Act, rows: usize) -> CollectiveResult<()> {
        self.all_reduce_host(x.host_rows_mut(rows))
    }
    fn send(&self, _backend: &B, to: Rank, x: &B::Act, rows: usize) -> CollectiveResult<()> {
        self.send_host(to, x.host_rows(rows))
    }
    fn recv(&self, _backend: &B, from: Rank, x: &mut B::Act, rows: usize) -> CollectiveResult<()> {
        self.recv_host(from, x.host_rows_mut(rows))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<T: Send + 'static>(world: usize, f: impl Fn(ThreadRank) -> T + Send + Sync + 'static) -> Vec<T> {
        let (_g, ranks) = ThreadGroup::new(world, GroupShape::Tensor, Duration::from_secs(20));
        let f = Arc::new(f);
        let hs: Vec<_> = ranks
            .into_iter()
            .map(|r| {
                let f = f.clone();
                std::thread::spawn(move || f(r))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    }

    #[test]
    fn all_reduce_sums_and_min_agrees() {
        let out = run(3, |r| {
            let me = r.rank().0 as f32;
            let mut acc = Vec::new();
            // Several rounds back to back: results must not leak between rounds.
            for round in 0..50 {
                let mut v = vec![me + round as f32, 1.0];
                r.all_reduce_host(&mut v).unwrap();
                acc.push(v);
            }
            let m = r.min_u64(100 + r.rank().0 as u64 * 7).unwrap();
            (acc, m)
        });
        for (acc, m) in out {
            for (round, v) in acc.iter().enumerate() {
                assert_eq!(v, &vec![3.0 + 3.0 * round as f32, 3.0]);
            }
            assert_eq!(m, 100);
        }
    }

    #[test]
    fn gather_places_uneven_column_blocks() {
        // Widths 3, 1, 2 over 6 columns, 2 rows.
        let out = run(3, |r| {
            let (at, w) = [(0, 3), (3, 1), (4, 2)][r.rank().0 as usize];
            let mine: Vec<f32> = (0..2 * w).map(|i| (r.rank().0 * 100 + i as u32) as f32).collect();
            let mut full = vec![-1.0; 12];
            let here = r.gathers_here();
            r.gather_cols(&mine, 2, at, here.then_some(&mut full[..])).unwrap();
            full
        });
        let want = vec![0., 1., 2., 100., 200., 201., 3., 4., 5., 101., 202., 203.];
        assert_eq!(out[0], want, "rank 0 gathers every block");
        assert!(out[1..].iter().all(|o| o.iter().all(|&v| v == -1.0)), "the others copy nothing: {out:?}");
    }

    #[test]
    fn send_recv_in_order_and_solo_is_identity() {
        let out = run(2, |r| {
            if r.rank() == Rank(0) {
                r.send_host(Rank(1), &[1.0, 2.0]).unwrap();
                r.send_host(Rank(1), &[3.0, 4.0]).unwrap();
                vec![]
            } else {
                let (mut a, mut b) = ([0.0; 2], [0.0; 2]);
                r.recv_host(Rank(0), &mut a).unwrap();
                r.recv_host(Rank(0), &mut b).unwrap();
                vec![a, b]
            }
        });
        assert_eq!(out[1], vec![[1.0, 2.0], [3.0, 4.0]]);
        let solo = Solo::new();
        let mut full = vec![0.0; 4];
        solo.gather_cols(&[1.0, 2.0, 3.0, 4.0], 2, 0, Some(&mut full)).unwrap();
        assert_eq!(full, vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(solo.min_u64(9).unwrap(), 9);
    }

    #[test]
    fn a_mismatched_collective_fails_every_rank_instead_of_hanging() {
        let out = run(2, |r| if r.rank() == Rank(0) { r.barrier() } else { r.min_u64(1).map(|_| ()) });
        assert!(out.iter().all(|o| o.is_err()), "{out:?}");
        assert!(out.iter().any(|o| matches!(o, Err(CollectiveError::Mismatch { .. }))), "{out:?}");
    }

    #[test]
    fn abort_ends_a_wait_and_reset_recovers() {
        let (group, mut ranks) = ThreadGroup::new(2, GroupShape::Tensor, Duration::from_secs(30));
        let r1 = ranks.pop().unwrap();
        let r0 = ranks.pop().unwrap();
        let waiter = std::thread::spawn(move || {
            let mut x = [0.0; 1];
            let e = r1.recv_host(Rank(0), &mut x);
            (r1, e)
        });
        r0.abort("rank0 failed its forward");
        let (r1, e) = waiter.join().unwrap();
        assert!(matches!(e, Err(CollectiveError::Aborted { .. })), "{e:?}");
        group.reset();
        let h = std::thread::spawn(move || r1.min_u64(5));
        assert_eq!(r0.min_u64(3).unwrap(), 3);
        assert_eq!(h.join().unwrap().unwrap(), 3);
    }

    #[test]
    fn a_timeout_is_an_error_not_a_hang() {
        let (_g, ranks) = ThreadGroup::new(2, GroupShape::Tensor, Duration::from_millis(50));
        let e = ranks[0].barrier();
        assert!(matches!(e, Err(CollectiveError::Timeout { op: OpKind::Barrier, .. })), "{e:?}");
    }

    #[test]
    fn census_names_the_rank_behind_and_by_how_many() {
        let out = run(3, |r| {
            for _ in 0..4 {
                r.barrier().unwrap();
            }
            r.compare_census().unwrap();
            // Rank 0 sends a message rank 1 never takes, as a stage that ran
            // ahead would; sends are buffered, so nothing wedges.
            if r.rank() == Rank(0) {
                r.send_host(Rank(1), &[1.0]).unwrap();
            }
            r.compare_census()
        });
        for o in &out {
            match o {
                Err(CollectiveError::Divergence {
                    kind: OpKind::Recv,
                    behind: Rank(1),
                    ahead: Rank(0),
                    by: 1,
                }) => {}
                other => panic!("expected rank1 behind rank0 by 1 recv, got {other:?}"),
            }
        }
    }

    #[test]
    fn census_names_a_rank_that_skipped_a_group_collective() {
        // A rank that skipped a barrier would wedge its peers in a real run;
        // here the skip is staged on the counters (ranks 0 and 1 count one
        // more barrier than rank 2 entered) so only the census sees it.
        let out = run(3, |r| {
            for _ in 0..3 {
                r.barrier().unwrap();
            }
            if r.rank() != Rank(2) {
                r.shared.counters[r.rank.0 as usize].bump(OpKind::Barrier);
            }
            r.compare_census()
        });
        for o in &out {
            match o {
                Err(CollectiveError::Divergence {
                    kind: OpKind::Barrier, behind: Rank(2), by: 1, ..
                }) => {}
                other => panic!("expected rank2 behind by 1 barrier, got {other:?}"),
            }
        }
    }

    #[test]
    fn census_does_not_wedge_when_a_peer_never_posts() {
        let (_g, ranks) = ThreadGroup::new(2, GroupShape::Tensor, Duration::from_millis(50));
        let e = ranks[0].compare_census();
        assert!(
            matches!(e, Err(CollectiveError::CensusSilent { ref missing, .. }) if missing == &vec![Rank(1)]),
            "{e:?}"
        );
    }

    fn link(text: &str) -> LinkModel {
        text.parse().unwrap()
    }

    #[test]
    fn link_model_parses_its_units() {
        let l = link("16GB/s,5us");
        assert_eq!((l.bandwidth, l.latency), (16e9, Duration::from_micros(5)));
        let l = link(" 2GiB/s , 1.5ms ");
        assert_eq!((l.bandwidth, l.latency), (2.0 * 1024.0 * 1024.0 * 1024.0, Duration::from_micros(1500)));
        assert_eq!(link("8Gbit/s,0ns").bandwidth, 1e9);
        assert_eq!(link("500MB/s,2s").latency, Duration::from_secs(2));
        assert_eq!(link("1KiB/s,3µs").latency, Duration::from_micros(3));
        for l in [link("16GB/s,5us"), link("12.5GB/s,2.5us"), link("100MB/s,1ms")] {
            assert_eq!(l.to_string().parse::<LinkModel>(), Ok(l), "{l}");
        }
        for (bad, what) in [
            ("16GB/s", "BANDWIDTH,LATENCY"),
            ("16GB,5us", "link bandwidth '16GB'"),
            ("16Gb/s,5us", "link bandwidth"),
            ("0GB/s,5us", "link bandwidth"),
            ("fastGB/s,5us", "link bandwidth"),
            ("16GB/s,5", "link latency '5'"),
            ("16GB/s,-5us", "link latency"),
            ("16GB/s,5 weeks", "link latency"),
        ] {
            let e = bad.parse::<LinkModel>().unwrap_err().to_string();
            assert!(e.contains(what), "{bad}: {e}");
        }
    }

    #[test]
    fn link_model_costs_follow_the_ring_formulas() {
        let l = LinkModel::new(1e9, Duration::from_micros(10)).unwrap();
        let mb = Bytes(1_000_000);
        assert_eq!(l.send(mb), Duration::from_micros(1010));
        // 4 ranks: 2·3/4 of 1 MB at 1 GB/s is 1.5 ms, plus 6 latencies.
        assert_eq!(l.all_reduce(mb, 4), Duration::from_micros(1500 + 60));
        // 3/4 of it in 3 steps.
        assert_eq!(l.all_gather(mb, 4), Duration::from_micros(750 + 30));
        assert_eq!(l.all_reduce(mb, 1), Duration::ZERO, "a group of one moves nothing");
    }

    #[test]
    fn a_send_takes_at_least_its_modelled_time() {
        // 1 MB per message at 1 GB/s plus 20 ms latency.
        let l = link("1GB/s,20ms");
        let (g, ranks) = ThreadGroup::with_link(2, GroupShape::Pipeline, Duration::from_secs(20), Some(l));
        let msg = vec![1.0f32; 250_000];
        let bytes = f32_bytes(msg.len());
        assert_eq!(bytes, Bytes(1_000_000));
        let mut got = vec![0.0f32; msg.len()];
        let t0 = Instant::now();
        ranks[0].send_host(Rank(1), &msg).unwrap();
        ranks[1].recv_host(Rank(0), &mut got).unwrap();
        assert!(t0.elapsed() >= l.send(bytes), "{:?} < {:?}", t0.elapsed(), l.send(bytes));
        assert_eq!(got, msg);
        // Two messages on one link queue: the second lands after both
        // messages' bytes (the latencies overlap).
        let t0 = Instant::now();
        ranks[0].send_host(Rank(1), &msg).unwrap();
        ranks[0].send_host(Rank(1), &msg).unwrap();
        ranks[1].recv_host(Rank(0), &mut got).unwrap();
        ranks[1].recv_host(Rank(0), &mut got).unwrap();
        let want = l.latency + l.wire(bytes) * 2;
        assert!(t0.elapsed() >= want, "{:?} < {want:?}", t0.elapsed());
        let stats = g.link_stats();
        assert_eq!(stats[0], LinkStats { time: l.send(bytes) * 3, bytes: Bytes(3_000_000) });
        assert_eq!(stats[1], LinkStats::default(), "a receiver starts no transfer");
        // Without a link nothing is paid or counted.
        let (g, ranks) = ThreadGroup::new(2, GroupShape::Pipeline, Duration::from_secs(20));
        ranks[0].send_host(Rank(1), &msg).unwrap();
        ranks[1].recv_host(Rank(0), &mut got).unwrap();
        assert_eq!(g.link_stats(), vec![LinkStats::default(); 2]);
        assert_eq!(g.link(), None);
    }

    #[test]
    fn collectives_take_at_least_their_ring_time() {
        let l = link("1GB/s,5ms");
        let (g, ranks) = ThreadGroup::with_link(3, GroupShape::Tensor, Duration::from_secs(20), Some(l));
        let hs: Vec<_> = ranks
            .into_iter()
            .map(|r| {
                std::thread::spawn(move || {
                    let mut v = vec![1.0f32; 300_000];
                    let t0 = Instant::now();
                    r.all_reduce_host(&mut v).unwrap();
                    let reduce = t0.elapsed();
                    assert!(v.iter().all(|&x| x == 3.0));
                    let mine = vec![r.rank().0 as f32; 2 * 100_000];
                    let mut full = vec![0.0f32; 2 * 300_000];
                    let here = r.gathers_here();
                    let t0 = Instant::now();
                    r.gather_cols(&mine, 2, r.rank().0 as usize * 100_000, here.then_some(&mut full[..]))
                        .unwrap();
                    (reduce, t0.elapsed())
                })
            })
            .collect();
        // The reduced buffer is 300,000 values; the gathered rows 600,000.
        let (reduced, gathered) = (Bytes(1_200_000), Bytes(2_400_000));
        for h in hs {
            let (reduce, gather) = h.join().unwrap();
            assert!(reduce >= l.all_reduce(reduced, 3), "{reduce:?}");
            assert!(gather >= l.all_gather(gathered, 3), "{gather:?}");
        }
        let want = LinkStats {
            time: l.all_reduce(reduced, 3) + l.all_gather(gathered, 3),
            bytes: reduced + gathered,
        };
        assert!(g.link_stats().iter().all(|s| *s == want), "{:?}", g.link_stats());
    }
}
