//! corridor-vram: every byte corridor holds on a card, governed.
//!
//! The promise is that every card is filled to its limit and never past it:
//! the driver's free memory stays at or above a per-card floor at every
//! instant, and every byte is accounted for. This crate knows nothing about
//! models, requests or HTTP.
//!
//! Map of the crate:
//! - [`card`]: the [`Card`] trait (probes anyone may read; raw primitives
//!   sealed inside this crate) and its implementations [`sim`] (a simulated
//!   card with scheduled foreign processes and injected failures) and
//!   [`cpu`] (host memory, for the plain CPU path), and [`cuda`] (a GPU,
//!   measured by the driver and NVML; the card needs the `cuda` feature,
//!   device selection does not).
//! - [`device`]: the chokepoint. One [`Device`] per card; every allocation
//!   is a [`Device::reserve`] with a [`Purpose`], lands in the [`Books`] and
//!   comes back as an RAII [`Allocation`].
//! - [`guard`]: spill before allocate. Arms under the arming floor, spends
//!   [`ReliefProvider`]s in (tier, cost) order, credits only measured rises,
//!   refuses when exhausted.
//! - [`arena`]: the KV arena: page ids over one address reservation, chunks
//!   committed and released wherever they sit (holes), live pages moved out
//!   of sparse chunks, non-destructive shrink, recovery after a hold time,
//!   and `free + cached + in_use + withheld == capacity`.
//! - [`sizing`]: pages per card solved from the measured free column.
//! - [`sampler`]: every card's free memory every 100 ms; the running
//!   minimum; breaches and intrusions, attributed and timed; the spread.
//! - [`relief`]: the loop that restores the floor after an intrusion and lets
//!   KV grow back when the intruder leaves.
//! - [`governor`]: the fleet: devices, providers, arenas, sampler and relief
//!   loop together, and the threads that run them.
//! - [`recorder`]: the flight recorder (boot and serving marks as JSONL) and
//!   its readers.
//! - [`ledger`]: posts with provenance, the fits verdict, reconciliation
//!   against marks and the drift of the memory identity.
//! - [`report`]: the `GET /v1/memory` body and its table for people.
//! - [`config`]: [`GovernorConfig`], parsed once by the cli.
//! - [`clock`]: injected time, so tests run instantly and deterministically.
//!
//! Invariants: no code outside this crate can call a driver allocator
//! (`tests/chokepoint.rs` checks the sources, and the raw primitives are not
//! nameable from outside); a device byte is booked exactly while its RAII
//! guard lives; the law floor and the arming floor are separate numbers.
//!
//! The raw primitives cannot be reached from outside the crate:
//!
//! ```compile_fail
//! use corridor_units::{Bytes, CardId};
//! use corridor_vram::{Card, CpuCard};
//! let card = CpuCard::new(CardId(0), Bytes::gib(1));
//! let _ = card.raw_alloc(Bytes::mib(1));
//! ```

pub mod arena;
pub mod books;
pub mod card;
pub mod clock;
pub mod config;
pub mod cpu;
pub mod cuda;
pub mod device;
pub mod governor;
pub mod guard;
pub mod ledger;
pub mod recorder;
pub mod relief;
pub mod report;
pub mod sampler;
pub mod sim;
pub mod sizing;

pub use arena::{ArenaCounts, ArenaError, ArenaStats, ChunkGeometry, KvArena, KvArenaConfig, Shrink, Vacate};
pub use books::{Books, Purpose};
pub use card::{Card, CardError, CardKind, ProcessBytes};
pub use clock::{Clock, ManualClock, SystemClock};
pub use config::{CardSettings, ConfigError, GovernorConfig};
pub use cpu::CpuCard;
#[cfg(feature = "cuda")]
pub use cuda::CudaCard;
pub use cuda::{CudaDeviceRef, CudaError, CudaSelection};
pub use device::{Allocation, Commit, Device, ReserveRequest, VaReservation};
pub use governor::Governor;
pub use guard::{
    GuardOutcome, GuardStats, Refusal, RefusalReason, ReliefProvider, ReliefStep, Tier, Urgency,
};
pub use report::{render_table, CardReport, MemoryReport};
pub use sim::{parse_sim_events, SimCard, SimCardSpec, SimEvent};
