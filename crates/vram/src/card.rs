//! The card abstraction: what corridor can ask of one device's memory.
//!
//! A [`Card`] answers probes (total, the driver's free memory, this process's
//! bytes, the per-process list) that anyone may read. The primitives that
//! actually take memory (`raw_alloc`, `reserve_va`, `commit`, ...) live on a
//! sealed supertrait in a private module: code outside this crate cannot name
//! that trait, so it cannot call them, and every allocation has to go through
//! the per-card chokepoint ([`crate::Device`]) that books it under a purpose.

use corridor_units::{Bytes, CardId};
use serde::{Deserialize, Serialize};

/// One process's bytes on a card, as the driver (NVML) lists them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ProcessBytes {
    pub pid: u32,
    pub bytes: Bytes,
}

/// Which kind of memory a card is, for logs and reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CardKind {
    /// Host memory, for the plain CPU path.
    Cpu,
    /// A simulated card: CPU compute with simulated device memory.
    Sim,
    /// A CUDA device.
    Cuda,
}

/// Why a raw card primitive failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CardError {
    #[error("{card}: out of memory: wanted {want}, driver free {free}")]
    OutOfMemory { card: CardId, want: Bytes, free: Bytes },
    #[error("{card}: injected allocation failure for {want}")]
    Injected { card: CardId, want: Bytes },
    #[error("{card}: range {offset}+{bytes} is outside the {reserved} reservation or misaligned")]
    BadRange { card: CardId, offset: Bytes, bytes: Bytes, reserved: Bytes },
    #[error("{card}: {what}")]
    Driver { card: CardId, what: String },
}

/// A card's memory as corridor sees it.
///
/// Object-safe, so a fleet of mixed cards is a `Vec<Arc<dyn Card>>`. Probes
/// are cheap enough to call every 100 ms from the sampler thread.
pub trait Card: Send + Sync + raw::RawCard {
    /// corridor's number for this card.
    fn id(&self) -> CardId;
    /// A stable identity (the GPU UUID on CUDA) that survives enumeration order.
    fn uuid(&self) -> String;
    fn kind(&self) -> CardKind;
    /// All memory on the card, including what the driver keeps for itself.
    fn total(&self) -> Bytes;
    /// What the driver reserves for itself and nobody can use (NVML total
    /// minus the driver's total).
    fn carve_out(&self) -> Bytes;
    /// The driver's free memory, probed now. Never total minus used.
    fn driver_free(&self) -> Bytes;
    /// Bytes the driver attributes to this process.
    fn process_bytes(&self) -> Bytes;
    /// Every process holding memory on the card, this one included.
    fn processes(&self) -> Vec<ProcessBytes>;
    /// The unit physical memory is committed in (2 MiB on an H200).
    fn granularity(&self) -> Bytes;
    /// Whether [`Card::processes`] names every holder of the card's used
    /// memory. The host does not (other processes' memory is not ours to
    /// list, and the kernel's has no pid), so its report counts everything
    /// used on it but by this process as foreign, one lump.
    fn names_every_holder(&self) -> bool {
        true
    }
    /// This process's id as the driver lists it.
    fn self_pid(&self) -> u32 {
        std::process::id()
    }
}

/// The raw primitives, sealed inside this crate.
pub(crate) mod raw {
    use super::CardError;
    use corridor_units::Bytes;

    /// A plain device allocation returned by [`RawCard::raw_alloc`].
    #[derive(Debug)]
    pub struct RawBlock {
        /// The device address on a real card; an opaque handle on sim and
        /// CPU cards, whose buffers live in host memory.
        pub(crate) handle: u64,
        pub(crate) bytes: Bytes,
    }

    /// An address-space reservation returned by [`RawCard::reserve_va`]:
    /// addresses only, no physical memory until ranges are committed.
    #[derive(Debug)]
    pub struct VaRange {
        /// The base address on a real card; an opaque handle elsewhere.
        pub(crate) handle: u64,
        pub(crate) bytes: Bytes,
    }

    /// The memory-taking half of a card. Only the chokepoint calls these.
    pub trait RawCard {
        /// Take `bytes` of device memory.
        fn raw_alloc(&self, bytes: Bytes) -> Result<RawBlock, CardError>;
        /// Return a block taken by `raw_alloc`.
        fn raw_free(&self, block: RawBlock);
        /// Reserve an address range of `bytes`; no physical memory yet.
        fn reserve_va(&self, bytes: Bytes) -> Result<VaRange, CardError>;
        /// Give an address range back; every committed range must have been
        /// decommitted first.
        fn release_va(&self, va: VaRange);
        /// Back `[offset, offset + bytes)` of the range with physical memory.
        /// Both must be multiples of the card's granularity.
        fn commit(&self, va: &VaRange, offset: Bytes, bytes: Bytes) -> Result<(), CardError>;
        /// Release the physical memory behind a range committed earlier.
        fn decommit(&self, va: &VaRange, offset: Bytes, bytes: Bytes) -> Result<(), CardError>;
    }
}

pub(crate) use raw::{RawBlock, RawCard, VaRange};
