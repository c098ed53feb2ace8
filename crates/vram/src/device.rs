//! The chokepoint: one [`Device`] per card, through which every device
//! allocation goes.
//!
//! A reservation names a purpose, passes the floor guard, takes memory with
//! the card's raw primitives (which nothing outside this crate can reach) and
//! lands in the books. What it returns is an RAII guard without `Clone`:
//! dropping an [`Allocation`] or a [`Commit`] gives the memory back and
//! unbooks it, so the books cannot drift from what is held.

use crate::books::{Books, Purpose};
use crate::card::{RawBlock, VaRange};
use crate::config::CardSettings;
use crate::guard::{
    self, GuardOutcome, GuardProbe, GuardStats, Refusal, RefusalReason, ReliefProvider, Urgency,
};
use crate::Card;
use corridor_units::{Bytes, CardId};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere must not turn every later probe into a second panic;
    // the books are updated in single assignments, so they stay consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The relief providers shared by every card of a fleet.
#[derive(Default)]
pub(crate) struct ProviderRegistry {
    providers: RwLock<Vec<Arc<dyn ReliefProvider>>>,
}

impl ProviderRegistry {
    pub(crate) fn register(&self, provider: Arc<dyn ReliefProvider>) {
        self.providers.write().unwrap_or_else(|e| e.into_inner()).push(provider);
    }
    pub(crate) fn snapshot(&self) -> Vec<Arc<dyn ReliefProvider>> {
        self.providers.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Every card of the fleet with its settings, for the host tier's
/// "is the fleet level" question.
pub(crate) struct FleetView {
    pub(crate) cards: Vec<(Arc<dyn Card>, CardSettings)>,
}

impl FleetView {
    /// Every card rests at or under its arming floor + delta, the asking
    /// card judged as if it already held `want`. Nobody has headroom to lend.
    fn is_level(&self, asking: CardId, want: Bytes) -> bool {
        // An empty reading is not level: nothing was shown to be exhausted.
        !self.cards.is_empty()
            && self.cards.iter().all(|(card, s)| {
                let free = card.driver_free();
                let free = if card.id() == asking { free.saturating_sub(want) } else { free };
                free <= s.arming_floor() + s.delta
            })
    }
}

/// How often an allocation that landed under the floor is undone and asked
/// for again before it is refused.
const LANDING_TRIES: usize = 3;

pub(crate) struct DeviceShared {
    pub(crate) card: Arc<dyn Card>,
    pub(crate) settings: CardSettings,
    books: Mutex<Books>,
    /// Serializes guard decisions on this card so two reservations cannot
    /// both spend the same headroom. Held while providers run.
    decide: Mutex<GuardStats>,
    providers: Arc<ProviderRegistry>,
    fleet: Arc<FleetView>,
}

impl DeviceShared {
    fn book(&self, purpose: Purpose, bytes: Bytes) {
        *lock(&self.books).slot(purpose) += bytes;
    }
    fn unbook(&self, purpose: Purpose, bytes: Bytes) {
        let mut books = lock(&self.books);
        let slot = books.slot(purpose);
        debug_assert!(*slot >= bytes, "unbooking more {purpose} than booked");
        *slot = slot.saturating_sub(bytes);
    }
}

struct Probe<'a>(&'a DeviceShared);

impl GuardProbe for Probe<'_> {
    fn probe(&self) -> (Bytes, Bytes) {
        (self.0.card.driver_free(), lock(&self.0.books).total())
    }
    fn fleet_is_level(&self, want: Bytes) -> bool {
        self.0.fleet.is_level(self.0.card.id(), want)
    }
}

/// A request to the chokepoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReserveRequest {
    pub want: Bytes,
    pub purpose: Purpose,
    pub urgency: Urgency,
}

/// One card's chokepoint: the card, its limits, its books and its guard.
/// Cloning is cheap and shares everything.
#[derive(Clone)]
pub struct Device {
    shared: Arc<DeviceShared>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("card", &self.id()).field("books", &self.books()).finish()
    }
}

impl Device {
    /// A device on its own (a one-card fleet with its own providers).
    pub fn standalone(card: Arc<dyn Card>, settings: CardSettings) -> Device {
        let fleet = Arc::new(FleetView { cards: vec![(card.clone(), settings)] });
        Device::in_fleet(card, settings, Arc::default(), fleet)
    }

    pub(crate) fn in_fleet(
        card: Arc<dyn Card>,
        settings: CardSettings,
        providers: Arc<ProviderRegistry>,
        fleet: Arc<FleetView>,
    ) -> Device {
        Device {
            shared: Arc::new(DeviceShared {
                card,
                settings,
                books: Mutex::new(Books::default()),
                decide: Mutex::new(GuardStats::default()),
                providers,
                fleet,
            }),
        }
    }

    pub fn id(&self) -> CardId {
        self.shared.card.id()
    }
    /// The card's probes (read-only; its raw primitives are not reachable).
    pub fn card(&self) -> &Arc<dyn Card> {
        &self.shared.card
    }
    pub fn settings(&self) -> CardSettings {
        self.shared.settings
    }
    pub fn books(&self) -> Books {
        *lock(&self.shared.books)
    }
    pub fn guard_stats(&self) -> GuardStats {
        *lock(&self.shared.decide)
    }
    /// Add a relief provider (shared by every card of the fleet).
    pub fn register_provider(&self, provider: Arc<dyn ReliefProvider>) {
        self.shared.providers.register(provider);
    }

    /// Reserve `want` bytes for `purpose`; the caller can wait on a refusal.
    pub fn reserve(&self, want: Bytes, purpose: Purpose) -> Result<Allocation, Refusal> {
        self.reserve_with(ReserveRequest { want, purpose, urgency: Urgency::Deferrable })
    }

    /// Reserve with an explicit urgency.
    pub fn reserve_with(&self, req: ReserveRequest) -> Result<Allocation, Refusal> {
        let mut stats = lock(&self.shared.decide);
        let card = &self.shared.card;
        let block = self.take_above_floor(
            req.want,
            req.urgency,
            &mut stats,
            || card.raw_alloc(req.want),
            |b| card.raw_free(b),
        )?;
        self.shared.book(req.purpose, req.want);
        Ok(Allocation { device: self.shared.clone(), block: Some(block), purpose: req.purpose })
    }

    /// Run the guard for `want` bytes without taking them: used by the relief
    /// loop (with `want` zero) to bring the card back over its floor.
    pub fn make_room(&self, want: Bytes, urgency: Urgency) -> Result<GuardOutcome, Refusal> {
        let mut stats = lock(&self.shared.decide);
        self.ensure_locked(want, urgency, &mut stats)
    }

    /// Reserve address space for a KV arena; it takes no physical memory.
    pub fn reserve_va(&self, bytes: Bytes) -> Result<VaReservation, Refusal> {
        let range = self
            .shared
            .card
            .reserve_va(bytes)
            .map_err(|e| self.card_refusal(bytes, self.shared.card.driver_free(), e))?;
        lock(&self.shared.books).kv_reserved += bytes;
        Ok(VaReservation { inner: Arc::new(VaInner { device: self.shared.clone(), range }) })
    }

    /// Back `[offset, offset + bytes)` of a reservation with physical memory,
    /// booked as KV, after the guard allows it.
    pub fn commit(
        &self,
        va: &VaReservation,
        offset: Bytes,
        bytes: Bytes,
        urgency: Urgency,
    ) -> Result<Commit, Refusal> {
        self.commit_as(va, offset, bytes, urgency, Purpose::Kv)
    }

    /// [`Device::commit`], booked as `purpose` (an arena of recurrent-state
    /// slots books its chunks as state).
    pub fn commit_as(
        &self,
        va: &VaReservation,
        offset: Bytes,
        bytes: Bytes,
        urgency: Urgency,
        purpose: Purpose,
    ) -> Result<Commit, Refusal> {
        debug_assert!(Arc::ptr_eq(&va.inner.device, &self.shared), "committing another card's reservation");
        // Growth that spends no relief never waits on a guard decision in
        // progress: while relief runs on this card (and may be waiting for
        // the engine to move pages) there is no spare headroom to take.
        let mut stats = if urgency == Urgency::Opportunistic {
            match self.shared.decide.try_lock() {
                Ok(g) => g,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {
                    let free = self.shared.card.driver_free();
                    return Err(self.refusal(bytes, free, RefusalReason::NoSpareHeadroom));
                }
            }
        } else {
            lock(&self.shared.decide)
        };
        let (card, range) = (&self.shared.card, &va.inner.range);
        self.take_above_floor(
            bytes,
            urgency,
            &mut stats,
            || card.commit(range, offset, bytes),
            |()| {
                if let Err(e) = card.decommit(range, offset, bytes) {
                    tracing::error!("undoing a commit that landed under the floor failed: {e}");
                }
            },
        )?;
        self.shared.book(purpose, bytes);
        Ok(Commit { va: va.inner.clone(), offset, bytes, purpose })
    }

    /// Ask the guard for `want`, take it with `take`, then look at the card: a
    /// grant judged above the floor lands under it when another process took
    /// memory between the guard's probe and the driver's allocation. Such an
    /// allocation is undone at once and the guard asked again, now seeing the
    /// card as it is (it relieves, or refuses), so nothing of ours stays under
    /// the floor.
    fn take_above_floor<T>(
        &self,
        want: Bytes,
        urgency: Urgency,
        stats: &mut GuardStats,
        mut take: impl FnMut() -> Result<T, crate::card::CardError>,
        mut undo: impl FnMut(T),
    ) -> Result<T, Refusal> {
        let floor = self.shared.settings.floor;
        for _ in 0..LANDING_TRIES {
            let outcome = self.ensure_locked(want, urgency, stats)?;
            let taken = take().map_err(|e| {
                stats.refusals += 1;
                self.card_refusal(want, outcome.free_after, e)
            })?;
            let free = self.shared.card.driver_free();
            if free >= floor {
                return Ok(taken);
            }
            undo(taken);
            stats.landings_undone += 1;
            tracing::warn!(card = %self.id(), %want, %free, %floor, "an allocation landed under the floor (another process took memory meanwhile); undone, asking the guard again");
        }
        stats.refusals += 1;
        Err(self.refusal(want, self.shared.card.driver_free(), RefusalReason::Floor))
    }

    fn ensure_locked(
        &self,
        want: Bytes,
        urgency: Urgency,
        stats: &mut GuardStats,
    ) -> Result<GuardOutcome, Refusal> {
        let providers = self.shared.providers.snapshot();
        guard::ensure_headroom(
            self.id(),
            &self.shared.settings,
            want,
            urgency,
            &providers,
            &Probe(&self.shared),
            stats,
        )
    }

    fn card_refusal(&self, want: Bytes, free: Bytes, e: crate::card::CardError) -> Refusal {
        self.refusal(want, free, RefusalReason::Card(e))
    }

    /// A refusal of `want` with the card's numbers as they stand.
    fn refusal(&self, want: Bytes, free: Bytes, reason: RefusalReason) -> Refusal {
        Refusal {
            card: self.id(),
            want,
            free,
            floor: self.shared.settings.floor,
            books: self.books().total(),
            budget: self.shared.settings.budget,
            reason,
        }
    }
}

/// A plain device allocation. Dropping it frees the memory and unbooks it.
#[must_use = "dropping an allocation frees it at once"]
pub struct Allocation {
    device: Arc<DeviceShared>,
    block: Option<RawBlock>,
    purpose: Purpose,
}

impl Allocation {
    pub fn bytes(&self) -> Bytes {
        self.block.as_ref().map_or(Bytes::ZERO, |b| b.bytes)
    }
    pub fn purpose(&self) -> Purpose {
        self.purpose
    }
    pub fn card(&self) -> CardId {
        self.device.card.id()
    }
    /// The device address on a real card (an opaque handle on sim and CPU
    /// cards, whose compute buffers are host memory).
    pub fn address(&self) -> u64 {
        self.block.as_ref().map_or(0, |b| b.handle)
    }
}

impl std::fmt::Debug for Allocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Allocation({} {} on {})", self.bytes(), self.purpose, self.card())
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            let bytes = block.bytes;
            self.device.card.raw_free(block);
            self.device.unbook(self.purpose, bytes);
        }
    }
}

struct VaInner {
    device: Arc<DeviceShared>,
    range: VaRange,
}

impl Drop for VaInner {
    fn drop(&mut self) {
        // Commits hold this inner alive, so by now every commit is gone.
        let bytes = self.range.bytes;
        let range = std::mem::replace(&mut self.range, VaRange { handle: 0, bytes: Bytes::ZERO });
        self.device.card.release_va(range);
        let mut books = lock(&self.device.books);
        books.kv_reserved = books.kv_reserved.saturating_sub(bytes);
    }
}

/// An address reservation on one card. Dropped after its last commit, it
/// releases the addresses.
pub struct VaReservation {
    inner: Arc<VaInner>,
}

impl VaReservation {
    pub fn bytes(&self) -> Bytes {
        self.inner.range.bytes
    }
    pub fn card(&self) -> CardId {
        self.inner.device.card.id()
    }
    /// The base address of the range on a real card (an opaque handle on
    /// sim and CPU cards).
    pub fn base_address(&self) -> u64 {
        self.inner.range.handle
    }
}

impl std::fmt::Debug for VaReservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "VaReservation({} on {})", self.bytes(), self.card())
    }
}

/// Physical memory committed under a reservation, booked as KV (or as the
/// purpose it was committed for). Dropping it decommits.
#[must_use = "dropping a commit releases it at once"]
pub struct Commit {
    va: Arc<VaInner>,
    offset: Bytes,
    bytes: Bytes,
    purpose: Purpose,
}

impl Commit {
    pub fn offset(&self) -> Bytes {
        self.offset
    }
    pub fn bytes(&self) -> Bytes {
        self.bytes
    }
}

impl std::fmt::Debug for Commit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Commit({}+{} on {})", self.offset, self.bytes, self.va.device.card.id())
    }
}

impl Drop for Commit {
    fn drop(&mut self) {
        let dev = &self.va.device;
        match dev.card.decommit(&self.va.range, self.offset, self.bytes) {
            Ok(()) => dev.unbook(self.purpose, self.bytes),
            // The memory is still held, so it stays booked; the drift report
            // would otherwise show it as unexplained.
            Err(e) => tracing::error!("decommit failed, memory stays booked: {e}"),
        }
    }
}
