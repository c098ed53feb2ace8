//! The backend's one allocator: every device byte through the card's
//! chokepoint.
//!
//! [`VramAlloc`] implements [`DeviceAlloc`] by asking a
//! [`corridor_vram::Device`] to reserve the bytes under a purpose, so the floor
//! guard decides first and the books record every byte. The chokepoint hands
//! back an RAII [`Allocation`]; the backend's buffers carry only a raw device
//! pointer, so the allocations are kept here, keyed by address, until the
//! backend frees that address.

use super::device::{DeviceAlloc, Purpose};
use crate::{BackendError, Result};
use corridor_units::{Bytes, CardId};
use corridor_vram::{Allocation, CardKind, CardSettings, CudaCard, Device};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// The smallest request passed to the chokepoint: a zero-byte buffer still
/// gets a distinct, valid, 256-byte-aligned pointer, as `DeviceAlloc` promises.
pub const MIN_ALLOCATION: Bytes = Bytes(256);

impl From<Purpose> for corridor_vram::Purpose {
    fn from(p: Purpose) -> Self {
        match p {
            Purpose::Weights => corridor_vram::Purpose::Weights,
            Purpose::Workspace => corridor_vram::Purpose::Workspace,
            Purpose::Kv => corridor_vram::Purpose::Kv,
            Purpose::State => corridor_vram::Purpose::State,
            Purpose::Graphs => corridor_vram::Purpose::Graphs,
            Purpose::Other => corridor_vram::Purpose::Other,
        }
    }
}

/// Device memory for the backend, reserved through one card's chokepoint.
pub struct VramAlloc {
    device: Device,
    /// Every live allocation by its device address. Dropping an entry frees
    /// the memory and unbooks it.
    held: Mutex<HashMap<u64, Allocation>>,
}

impl std::fmt::Debug for VramAlloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VramAlloc").field("device", &self.device).field("live", &self.live()).finish()
    }
}

impl VramAlloc {
    pub fn new(device: Device) -> VramAlloc {
        VramAlloc { device, held: Mutex::new(HashMap::new()) }
    }

    /// A standalone chokepoint with default limits (the 1024 MiB floor) on
    /// CUDA device `ordinal`, for a backend that runs without a governor.
    pub fn open_standalone(ordinal: usize) -> Result<VramAlloc> {
        let card = CudaCard::open(CardId(0), ordinal as u32).map_err(|e| match e {
            corridor_vram::CudaError::MissingLibrary { library, detail } => {
                BackendError::MissingLibrary { missing: format!("{library} ({detail})") }
            }
            other => BackendError::Other(other.to_string()),
        })?;
        Ok(VramAlloc::new(Device::standalone(Arc::new(card), CardSettings::default())))
    }

    /// The chokepoint this allocator reserves through.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Number of live allocations and the bytes they hold.
    pub fn live(&self) -> (usize, Bytes) {
        let held = self.lock();
        (held.len(), held.values().map(Allocation::bytes).sum())
    }

    /// Check that the device's card is CUDA device `ordinal`: a pointer
    /// from any other card would be an address the kernels cannot use.
    pub fn check_card(&self, ordinal: usize) -> Result<()> {
        let card = self.device.card();
        if card.kind() != CardKind::Cuda {
            return Err(BackendError::Other(format!(
                "{} is a {:?} card; the CUDA backend needs a CUDA card",
                card.id(),
                card.kind()
            )));
        }
        let uuid = corridor_vram::cuda::ordinal_uuid(ordinal as u32)
            .map_err(|e| BackendError::Other(e.to_string()))?;
        if card.uuid() != uuid {
            return Err(BackendError::Other(format!(
                "{} is {}, but the backend runs on cuda:{ordinal} ({uuid})",
                card.id(),
                card.uuid()
            )));
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Allocation>> {
        // The map is changed by single inserts and removes, so it is whole
        // even after a panic elsewhere.
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl DeviceAlloc for VramAlloc {
    fn card(&self) -> Option<corridor_units::CardId> {
        Some(self.device.id())
    }

    fn alloc(&self, bytes: Bytes, purpose: Purpose) -> Result<u64> {
        let want = bytes.max(MIN_ALLOCATION);
        let allocation =
            self.device.reserve(want, purpose.into()).map_err(|refusal| BackendError::OutOfMemory {
                device: format!("{} ({refusal})", self.device.id()),
                want: bytes.0,
                purpose: purpose.label(),
            })?;
        let address = allocation.address();
        let mut held = self.lock();
        if held.contains_key(&address) {
            // The card handed out an address that is still live: the driver's
            // bookkeeping and ours disagree. The new allocation is dropped
            // (given back); the old one stays with whoever holds it.
            return Err(BackendError::Other(format!(
                "{}: address {address:#x} was handed out twice",
                self.device.id()
            )));
        }
        held.insert(address, allocation);
        Ok(address)
    }

    fn free(&self, ptr: u64, _bytes: Bytes, _purpose: Purpose) {
        // Dropping the allocation outside the lock: freeing calls the driver.
        let allocation = self.lock().remove(&ptr);
        debug_assert!(allocation.is_some(), "freeing {ptr:#x}, which this allocator never handed out");
        drop(allocation);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corridor_vram::{ManualClock, SimCard, SimCardSpec};

    fn sim(total: Bytes) -> (Arc<SimCard>, VramAlloc) {
        let card =
            Arc::new(SimCard::new(SimCardSpec::new(CardId(0), total), &[], Arc::new(ManualClock::new())));
        let settings = CardSettings { floor: Bytes::mib(64), ..CardSettings::default() };
        (card.clone(), VramAlloc::new(Device::standalone(card, settings)))
    }

    #[test]
    fn every_byte_is_booked_under_its_purpose_until_freed() {
        let (_card, a) = sim(Bytes::gib(1));
        let w = a.alloc(Bytes::mib(100), Purpose::Weights).unwrap();
        let ws = a.alloc(Bytes::mib(32), Purpose::Workspace).unwrap();
        let kv = a.alloc(Bytes::mib(8), Purpose::Kv).unwrap();
        let st = a.alloc(Bytes::mib(4), Purpose::State).unwrap();
        let books = a.device().books();
        assert_eq!(books.weights, Bytes::mib(100));
        assert_eq!(books.workspace, Bytes::mib(32));
        assert_eq!(books.kv_committed, Bytes::mib(8));
        assert_eq!(books.state, Bytes::mib(4));
        assert_eq!(a.live(), (4, Bytes::mib(144)));
        a.free(st, Bytes::mib(4), Purpose::State);
        assert_eq!(a.device().books().state, Bytes::ZERO);
        a.free(ws, Bytes::mib(32), Purpose::Workspace);
        assert_eq!(a.device().books().workspace, Bytes::ZERO);
        assert_eq!(a.device().books().weights, Bytes::mib(100));
        a.free(w, Bytes::mib(100), Purpose::Weights);
        a.free(kv, Bytes::mib(8), Purpose::Kv);
        assert_eq!(a.device().books().total(), Bytes::ZERO);
        assert_eq!(a.live(), (0, Bytes::ZERO));
    }

    #[test]
    fn the_card_sees_the_memory_taken_and_given_back() {
        let (card, a) = sim(Bytes::gib(1));
        let before = corridor_vram::Card::driver_free(card.as_ref());
        let p = a.alloc(Bytes::mib(200), Purpose::Graphs).unwrap();
        assert_eq!(corridor_vram::Card::driver_free(card.as_ref()), before - Bytes::mib(200));
        a.free(p, Bytes::mib(200), Purpose::Graphs);
        assert_eq!(corridor_vram::Card::driver_free(card.as_ref()), before);
    }

    #[test]
    fn zero_byte_buffers_get_distinct_addresses() {
        let (_card, a) = sim(Bytes::gib(1));
        let p = a.alloc(Bytes::ZERO, Purpose::Other).unwrap();
        let q = a.alloc(Bytes::ZERO, Purpose::Other).unwrap();
        assert_ne!(p, q);
        assert_eq!(a.device().books().other, MIN_ALLOCATION + MIN_ALLOCATION);
    }

    #[test]
    fn a_refusal_is_an_out_of_memory_error_naming_the_purpose() {
        let (_card, a) = sim(Bytes::mib(512));
        // 512 MiB card, 64 MiB floor: 500 MiB would leave 12 MiB free.
        let err = a.alloc(Bytes::mib(500), Purpose::Weights).unwrap_err();
        match err {
            BackendError::OutOfMemory { want, purpose, ref device } => {
                assert_eq!(want, Bytes::mib(500).0);
                assert_eq!(purpose, "weights");
                assert!(device.contains("refused"), "{device}");
            }
            other => panic!("{other}"),
        }
        assert_eq!(a.device().books().total(), Bytes::ZERO);
        assert_eq!(a.live(), (0, Bytes::ZERO));
    }

    #[test]
    fn purposes_map_onto_the_books_columns() {
        for (p, q) in [
            (Purpose::Weights, corridor_vram::Purpose::Weights),
            (Purpose::Workspace, corridor_vram::Purpose::Workspace),
            (Purpose::Kv, corridor_vram::Purpose::Kv),
            (Purpose::State, corridor_vram::Purpose::State),
            (Purpose::Graphs, corridor_vram::Purpose::Graphs),
            (Purpose::Other, corridor_vram::Purpose::Other),
        ] {
            assert_eq!(corridor_vram::Purpose::from(p), q);
            assert_eq!(p.label(), q.name());
        }
    }

    #[test]
    fn a_sim_card_is_refused_as_the_backends_card() {
        let (_card, a) = sim(Bytes::gib(1));
        assert!(a.check_card(0).is_err());
    }
}
