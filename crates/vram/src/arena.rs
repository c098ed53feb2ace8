//! The KV arena (DESIGN.md §3.3): page ids over one address reservation per
//! card, with physical memory committed and released in chunks underneath.
//!
//! The arena does not know what a page holds; it hands out [`PageId`]s and
//! says where each page lives inside the reservation. Addresses never move,
//! so captured graphs stay valid whatever the residency.
//!
//! Each id is in exactly one state: free (on the free list), in use (held by
//! one or more sequences), cached (unreferenced but kept for prefix reuse,
//! evictable) or withheld. The row cap withholds every id at or above it from
//! the free list, and the cap never rises above the committed watermark, so
//! an id that points at unbacked memory is never handed out. Capacity is the
//! whole id space of the reservation, and
//! `free + cached + in_use + withheld == capacity` holds after every
//! operation (checked in debug builds and by [`KvArena::check_invariants`]).
//!
//! Shrinking releases only whole chunks above the highest live page (in use
//! or cached): nothing live is destroyed to shrink. Released memory comes
//! back when headroom returns, but not before a hold time has passed since
//! the last release, so an intrusion that comes and goes does not make KV
//! thrash. The free list hands out the lowest id first, which keeps live
//! pages low and the tail releasable.

use crate::clock::Clock;
use crate::device::{lock, Commit, Device, VaReservation};
use crate::guard::{Refusal, ReliefProvider, Tier, Urgency};
use corridor_units::{Bytes, CardId, PageId, Pages};
use serde::Serialize;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Above this size a chunk is no longer sized to fit pages exactly into
/// granules; it is rounded up to the granularity instead, wasting under one
/// granule per chunk.
const MAX_EXACT_CHUNK: Bytes = Bytes::mib(64);

/// How pages pack into chunks, the unit of commit and release.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ChunkGeometry {
    pub page_bytes: Bytes,
    pub chunk_pages: usize,
    /// A multiple of the card's granularity, at least `chunk_pages * page_bytes`.
    pub chunk_bytes: Bytes,
}

impl ChunkGeometry {
    /// Chunks of about `target` bytes (at least one page, whole granules).
    pub fn new(page_bytes: Bytes, granularity: Bytes, target: Bytes) -> Result<ChunkGeometry, ArenaError> {
        Ok(Self::common(&[(page_bytes, granularity)], target)?[0])
    }

    /// One chunk geometry per part of a KV arena that spans cards: every part
    /// holds the same page ids, so the parts share `chunk_pages` and each
    /// chunk is whole granules of its own card. `parts` is `(page bytes,
    /// granularity)` per card; the largest part's chunk aims at `target`. One
    /// part gives exactly [`ChunkGeometry::new`].
    pub fn common(parts: &[(Bytes, Bytes)], target: Bytes) -> Result<Vec<ChunkGeometry>, ArenaError> {
        let mut exact_pages = 1u64;
        let mut widest = 0u64;
        for &(page_bytes, granularity) in parts {
            if page_bytes == Bytes::ZERO || granularity == Bytes::ZERO {
                return Err(ArenaError::BadGeometry { page_bytes, granularity });
            }
            let (pb, gran) = (page_bytes.get(), granularity.get());
            // The fewest pages that fill whole granules of this card exactly,
            // folded into the fewest that do so on every card.
            let own = gran / gcd(pb, gran);
            // Saturates on absurd combinations: then chunks are rounded up to granules instead.
            exact_pages = (exact_pages / gcd(exact_pages, own)).saturating_mul(own);
            widest = widest.max(pb);
        }
        if parts.is_empty() {
            return Err(ArenaError::BadGeometry { page_bytes: Bytes::ZERO, granularity: Bytes::ZERO });
        }
        let exact_bytes = exact_pages.saturating_mul(widest);
        let exact = exact_bytes <= target.get().max(MAX_EXACT_CHUNK.get());
        let chunk_pages = if exact {
            exact_pages * (target.get() / exact_bytes).max(1)
        } else {
            (target.get() / widest).max(1)
        };
        Ok(parts
            .iter()
            .map(|&(page_bytes, granularity)| {
                let bytes = Bytes(chunk_pages * page_bytes.get());
                ChunkGeometry {
                    page_bytes,
                    chunk_pages: chunk_pages as usize,
                    chunk_bytes: if exact { bytes } else { bytes.round_up(granularity) },
                }
            })
            .collect())
    }

    /// Where page `id` starts inside the reservation.
    pub fn page_offset(&self, id: PageId) -> Bytes {
        let (chunk, within) = (id.index() / self.chunk_pages, id.index() % self.chunk_pages);
        Bytes(chunk as u64 * self.chunk_bytes.get() + within as u64 * self.page_bytes.get())
    }

    /// Whole chunks that fit in `pages` pages.
    pub fn chunks_in(&self, pages: Pages) -> usize {
        pages.get() / self.chunk_pages
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Errors of the arena's page operations (a caller's bookkeeping bug, or a
/// geometry that cannot work).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArenaError {
    #[error("page size {page_bytes} and granularity {granularity} must be non-zero")]
    BadGeometry { page_bytes: Bytes, granularity: Bytes },
    #[error("the reservation must hold at least one chunk of {chunk_pages} pages, asked for {max_pages}")]
    TooSmall { max_pages: Pages, chunk_pages: usize },
    #[error("{page} is outside the {backed} backed pages")]
    Unbacked { page: PageId, backed: Pages },
    #[error("{page} is {state}, expected {expected}")]
    WrongState { page: PageId, state: &'static str, expected: &'static str },
    #[error("wanted {want} but only {free} are free")]
    Exhausted { want: Pages, free: Pages },
    #[error(transparent)]
    Refused(#[from] Refusal),
}

/// How the arena is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvArenaConfig {
    pub page_bytes: Bytes,
    /// Pages the reservation covers: the largest pool the card could ever hold.
    pub max_pages: Pages,
    /// Commit unit to aim for (rounded to whole pages and granules).
    pub chunk_target: Bytes,
    /// Wait this long after a release before growing back; a chunk must sit
    /// idle this long before [`KvArena::trim_idle`] releases it.
    pub hold: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PageState {
    Free,
    InUse(u32),
    Cached,
    Withheld,
}

impl PageState {
    fn name(self) -> &'static str {
        match self {
            PageState::Free => "free",
            PageState::InUse(_) => "in use",
            PageState::Cached => "cached",
            PageState::Withheld => "withheld",
        }
    }
}

/// Page counts by state; they add up to `capacity`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ArenaCounts {
    pub free: Pages,
    pub cached: Pages,
    pub in_use: Pages,
    pub withheld: Pages,
    pub capacity: Pages,
    /// Backed pages (the committed watermark).
    pub committed: Pages,
    /// Pages the arena grows back to when headroom returns.
    pub target: Pages,
}

/// Counters of chunk traffic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ArenaStats {
    pub chunks_committed: u64,
    pub chunks_released: u64,
    pub grow_refusals: u64,
}

struct ArenaState {
    /// Committed chunks, in order: chunk `i` backs pages `[i*cp, (i+1)*cp)`,
    /// with one commit on each part's card.
    chunks: Vec<Vec<Commit>>,
    /// State of every backed page (`chunks.len() * chunk_pages` of them).
    pages: Vec<PageState>,
    /// Free ids, all under `cap`; the lowest is handed out first.
    free: BTreeSet<u32>,
    /// The row cap: ids at or above it are withheld.
    cap: usize,
    n_in_use: usize,
    n_cached: usize,
    /// Backed pages that are withheld (counted on their own, so the
    /// invariant is a real check rather than a definition).
    n_withheld: usize,
    /// Pages the arena should hold when headroom allows.
    target: usize,
    /// A chunk commit is in flight outside the lock.
    growing: bool,
    last_release: Option<Duration>,
    /// When each chunk last handed out a page.
    chunk_last_used: Vec<Duration>,
    stats: ArenaStats,
}

/// One card's share of a KV arena: its own address reservation, with page
/// `i` of the shared id space at `geometry.page_offset(i)` inside it.
struct Part {
    device: Device,
    va: VaReservation,
    geometry: ChunkGeometry,
}

/// Where one card's share of an arena lives (what a backend that reads KV
/// inside the arena's pages needs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArenaPart {
    pub card: CardId,
    pub geometry: ChunkGeometry,
    /// A device address on a real card, an opaque handle on sim and CPU cards.
    pub base_address: u64,
}

/// A KV arena: one id space of pages over one card, or spanning the cards
/// of a parallel layout (each card holds its ranks' share of every page: its
/// heads under tensor parallelism, its layers under pipeline parallelism).
/// A spanning arena commits a chunk on every card or on none, so the pages
/// the group holds are always the minimum any card can back, and relief on
/// any card releases the chunk everywhere. Share it as `Arc<KvArena>`;
/// every method takes `&self`.
pub struct KvArena {
    /// The lead part first: `card()`, `geometry()` and `base_address()` are its.
    parts: Vec<Part>,
    geometry: ChunkGeometry,
    /// The id space: whole chunks that fit in the reservation.
    max_pages: usize,
    hold: Duration,
    clock: Arc<dyn Clock>,
    state: Mutex<ArenaState>,
}

impl std::fmt::Debug for KvArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvArena").field("cards", &self.cards()).field("counts", &self.counts()).finish()
    }
}

/// What a shrink released.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Shrink {
    pub chunks: usize,
    pub bytes: Bytes,
}

impl KvArena {
    /// Reserve the address space on one card; nothing is committed yet.
    pub fn new(device: &Device, config: KvArenaConfig, clock: Arc<dyn Clock>) -> Result<KvArena, ArenaError> {
        Self::spanning(&[(device.clone(), config.page_bytes)], config, clock)
    }

    /// Reserve the address space on every card of `parts` (`(card, bytes of
    /// one page on it)`, lead first); `config.page_bytes` is ignored. Nothing
    /// is committed yet.
    pub fn spanning(
        parts: &[(Device, Bytes)],
        config: KvArenaConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<KvArena, ArenaError> {
        let shapes: Vec<(Bytes, Bytes)> = parts.iter().map(|(d, pb)| (*pb, d.card().granularity())).collect();
        let geometries = ChunkGeometry::common(&shapes, config.chunk_target)?;
        let geometry = geometries[0];
        let max_chunks = geometry.chunks_in(config.max_pages);
        if max_chunks == 0 {
            return Err(ArenaError::TooSmall {
                max_pages: config.max_pages,
                chunk_pages: geometry.chunk_pages,
            });
        }
        let parts = parts
            .iter()
            .zip(geometries)
            .map(|((device, _), geometry)| {
                let va = device.reserve_va(Bytes(max_chunks as u64 * geometry.chunk_bytes.get()))?;
                Ok(Part { device: device.clone(), va, geometry })
            })
            .collect::<Result<Vec<Part>, ArenaError>>()?;
        Ok(KvArena {
            parts,
            geometry,
            max_pages: max_chunks * geometry.chunk_pages,
            hold: config.hold,
            clock,
            state: Mutex::new(ArenaState {
                chunks: Vec::new(),
                pages: Vec::new(),
                free: BTreeSet::new(),
                cap: 0,
                n_in_use: 0,
                n_cached: 0,
                n_withheld: 0,
                target: 0,
                growing: false,
                last_release: None,
                chunk_last_used: Vec::new(),
                stats: ArenaStats::default(),
            }),
        })
    }

    /// The lead card (the only one, unless the arena spans cards).
    pub fn card(&self) -> CardId {
        self.parts[0].device.id()
    }
    /// Every card the arena spans, lead first.
    pub fn cards(&self) -> Vec<CardId> {
        self.parts.iter().map(|p| p.device.id()).collect()
    }
    /// The share of the arena on `card`.
    pub fn part_on(&self, card: CardId) -> Option<ArenaPart> {
        self.parts.iter().find(|p| p.device.id() == card).map(|p| ArenaPart {
            card,
            geometry: p.geometry,
            base_address: p.va.base_address(),
        })
    }
    pub fn geometry(&self) -> ChunkGeometry {
        self.geometry
    }
    /// Where the reservation starts: a device address on a real card (pages
    /// are at `base_address() + page_offset(id)` once committed), an opaque
    /// handle on sim and CPU cards.
    pub fn base_address(&self) -> u64 {
        self.parts[0].va.base_address()
    }
    /// The whole id space.
    pub fn capacity(&self) -> Pages {
        Pages(self.max_pages)
    }
    /// Where page `id` lives inside the reservation.
    pub fn page_offset(&self, id: PageId) -> Bytes {
        self.geometry.page_offset(id)
    }
    /// The committed watermark: ids under it are backed. Anything that walks
    /// "the whole pool" must stop here.
    pub fn backed(&self) -> Pages {
        Pages(lock(&self.state).pages.len())
    }
    pub fn counts(&self) -> ArenaCounts {
        let st = lock(&self.state);
        self.counts_of(&st)
    }
    pub fn stats(&self) -> ArenaStats {
        lock(&self.state).stats
    }
    /// The highest page that is in use or cached.
    pub fn highest_live(&self) -> Option<PageId> {
        Self::highest_live_of(&lock(&self.state)).map(|i| PageId(i as u32))
    }

    fn counts_of(&self, st: &ArenaState) -> ArenaCounts {
        let (free, cached, in_use) = (st.free.len(), st.n_cached, st.n_in_use);
        ArenaCounts {
            free: Pages(free),
            cached: Pages(cached),
            in_use: Pages(in_use),
            withheld: Pages(st.n_withheld + (self.max_pages - st.pages.len())),
            capacity: Pages(self.max_pages),
            committed: Pages(st.pages.len()),
            target: Pages(st.target),
        }
    }

    // ----- page operations -------------------------------------------------

    /// Take the lowest free page.
    pub fn alloc(&self) -> Option<PageId> {
        let mut st = lock(&self.state);
        let id = st.free.pop_first()?;
        st.pages[id as usize] = PageState::InUse(1);
        st.n_in_use += 1;
        let now = self.clock.now();
        let chunk = id as usize / self.geometry.chunk_pages;
        st.chunk_last_used[chunk] = now;
        self.debug_check(&st);
        Some(PageId(id))
    }

    /// Take `n` pages, all or nothing.
    pub fn alloc_many(&self, n: Pages) -> Result<Vec<PageId>, ArenaError> {
        let mut st = lock(&self.state);
        if st.free.len() < n.get() {
            return Err(ArenaError::Exhausted { want: n, free: Pages(st.free.len()) });
        }
        let now = self.clock.now();
        let mut ids = Vec::with_capacity(n.get());
        for _ in 0..n.get() {
            let Some(id) = st.free.pop_first() else { break };
            st.pages[id as usize] = PageState::InUse(1);
            st.n_in_use += 1;
            let chunk = id as usize / self.geometry.chunk_pages;
            st.chunk_last_used[chunk] = now;
            ids.push(PageId(id));
        }
        self.debug_check(&st);
        Ok(ids)
    }

    /// Add a holder to a page in use (a shared prefix).
    pub fn retain(&self, id: PageId) -> Result<(), ArenaError> {
        let mut st = lock(&self.state);
        match Self::state_of(&st, id)? {
            PageState::InUse(n) => st.pages[id.index()] = PageState::InUse(n + 1),
            other => return Err(wrong(id, other, "in use")),
        }
        Ok(())
    }

    /// Drop a holder; the last one returns the page to the free list (or
    /// withholds it, if it sits above the cap).
    pub fn release(&self, id: PageId) -> Result<(), ArenaError> {
        self.drop_holder(id, PageState::Free)
    }

    /// Drop a holder; the last one keeps the page's contents as cached
    /// (evictable) for prefix reuse.
    pub fn release_to_cache(&self, id: PageId) -> Result<(), ArenaError> {
        self.drop_holder(id, PageState::Cached)
    }

    /// A prefix hit: a cached page is in use again.
    pub fn revive(&self, id: PageId) -> Result<(), ArenaError> {
        let mut st = lock(&self.state);
        match Self::state_of(&st, id)? {
            PageState::Cached => {
                st.pages[id.index()] = PageState::InUse(1);
                st.n_cached -= 1;
                st.n_in_use += 1;
            }
            other => return Err(wrong(id, other, "cached")),
        }
        self.debug_check(&st);
        Ok(())
    }

    /// Forget a cached page's contents.
    pub fn evict(&self, id: PageId) -> Result<(), ArenaError> {
        let mut st = lock(&self.state);
        match Self::state_of(&st, id)? {
            PageState::Cached => {
                st.n_cached -= 1;
                Self::put_free(&mut st, id.index());
            }
            other => return Err(wrong(id, other, "cached")),
        }
        self.debug_check(&st);
        Ok(())
    }

    fn drop_holder(&self, id: PageId, last: PageState) -> Result<(), ArenaError> {
        let mut st = lock(&self.state);
        match Self::state_of(&st, id)? {
            PageState::InUse(n) if n > 1 => st.pages[id.index()] = PageState::InUse(n - 1),
            PageState::InUse(_) => {
                st.n_in_use -= 1;
                if last == PageState::Cached {
                    st.pages[id.index()] = PageState::Cached;
                    st.n_cached += 1;
                } else {
                    Self::put_free(&mut st, id.index());
                }
            }
            other => return Err(wrong(id, other, "in use")),
        }
        self.debug_check(&st);
        Ok(())
    }

    fn state_of(st: &ArenaState, id: PageId) -> Result<PageState, ArenaError> {
        st.pages
            .get(id.index())
            .copied()
            .ok_or(ArenaError::Unbacked { page: id, backed: Pages(st.pages.len()) })
    }

    /// A page with no holder goes to the free list, or is withheld if the cap
    /// is under it.
    fn put_free(st: &mut ArenaState, i: usize) {
        if i < st.cap {
            st.pages[i] = PageState::Free;
            st.free.insert(i as u32);
        } else {
            st.pages[i] = PageState::Withheld;
            st.n_withheld += 1;
        }
    }

    fn highest_live_of(st: &ArenaState) -> Option<usize> {
        st.pages.iter().rposition(|s| matches!(s, PageState::InUse(_) | PageState::Cached))
    }

    // ----- residency -------------------------------------------------------

    /// Commit chunks until `pages` are backed (boot: commit the solved
    /// capacity). This also becomes the target KV grows back to.
    pub fn commit_to(&self, pages: Pages, urgency: Urgency) -> Result<Pages, ArenaError> {
        let want = self.round_to_chunks(pages);
        lock(&self.state).target = want;
        self.grow_until(urgency, |st| st.pages.len() >= want)?;
        Ok(self.backed())
    }

    /// Make sure `n` pages are free, committing chunks through the guard as
    /// needed (on-demand residency, admission). On a refusal the caller waits
    /// or preempts.
    pub fn ensure_free(&self, n: Pages, urgency: Urgency) -> Result<(), ArenaError> {
        if n.get() > self.max_pages {
            return Err(ArenaError::Exhausted { want: n, free: Pages(self.max_pages) });
        }
        self.grow_until(urgency, |st| st.free.len() >= n.get())?;
        let mut st = lock(&self.state);
        st.target = st.target.max(st.pages.len());
        Ok(())
    }

    /// Grow back toward the target if the hold time has passed since the last
    /// release and the card has spare headroom. Returns the pages added.
    pub fn recover(&self) -> Pages {
        let before = {
            let st = lock(&self.state);
            let held = st.last_release.is_some_and(|t| self.clock.now().saturating_sub(t) < self.hold);
            if held || st.pages.len() >= st.target {
                return Pages(0);
            }
            st.pages.len()
        };
        let target = lock(&self.state).target;
        // Opportunistic: growing back takes only headroom that is there; it
        // must never make anything else on the card spend relief.
        let _ = self.grow_until(Urgency::Opportunistic, |st| st.pages.len() >= target);
        let after = self.backed().get();
        if after > before {
            tracing::info!(card = %self.card(), added = after - before, backed = after, "KV grew back");
        }
        Pages(after.saturating_sub(before))
    }

    /// Lift the cap to the watermark, then commit chunks one at a time until
    /// `done` holds or the guard refuses.
    fn grow_until(&self, urgency: Urgency, done: impl Fn(&ArenaState) -> bool) -> Result<(), ArenaError> {
        loop {
            let offset = {
                let mut st = lock(&self.state);
                self.lift_cap(&mut st);
                if done(&st) {
                    return Ok(());
                }
                if st.growing {
                    // Another thread is committing; its chunk will show up.
                    return Err(ArenaError::Exhausted { want: Pages(0), free: Pages(st.free.len()) });
                }
                if st.pages.len() >= self.max_pages {
                    return Err(ArenaError::Exhausted {
                        want: Pages(self.max_pages + 1),
                        free: Pages(st.free.len()),
                    });
                }
                st.growing = true;
                st.chunks.len()
            };
            // The guard may call providers (this arena's own relief among
            // them), so the state lock is not held across the commit.
            let result = self.commit_chunk(offset, urgency);
            let mut st = lock(&self.state);
            st.growing = false;
            match result {
                Ok(commits) => {
                    st.chunks.push(commits);
                    let now = self.clock.now();
                    st.chunk_last_used.push(now);
                    let start = st.pages.len();
                    st.pages.extend(std::iter::repeat_n(PageState::Withheld, self.geometry.chunk_pages));
                    st.n_withheld += self.geometry.chunk_pages;
                    st.stats.chunks_committed += 1;
                    debug_assert_eq!(start, offset * self.geometry.chunk_pages);
                    self.lift_cap(&mut st);
                    self.debug_check(&st);
                }
                Err(refusal) => {
                    st.stats.grow_refusals += 1;
                    return Err(ArenaError::Refused(refusal));
                }
            }
        }
    }

    /// Commit chunk `index` on every part, or on none: a card that refuses
    /// releases what the others committed (the group holds what every card
    /// can back).
    fn commit_chunk(&self, index: usize, urgency: Urgency) -> Result<Vec<Commit>, Refusal> {
        let mut commits = Vec::with_capacity(self.parts.len());
        for p in &self.parts {
            let offset = Bytes(index as u64 * p.geometry.chunk_bytes.get());
            let commit = p.device.commit(&p.va, offset, p.geometry.chunk_bytes, urgency)?;
            debug_assert_eq!(commit.offset(), offset);
            commits.push(commit);
        }
        Ok(commits)
    }

    /// Raise the cap to the watermark: withheld backed pages become free.
    fn lift_cap(&self, st: &mut ArenaState) {
        let top = st.pages.len();
        for i in st.cap..top {
            if st.pages[i] == PageState::Withheld {
                st.pages[i] = PageState::Free;
                st.free.insert(i as u32);
                st.n_withheld -= 1;
            }
        }
        st.cap = top;
    }

    /// Shrink toward `pages` backed pages, never below the chunk holding the
    /// highest live page. Returns what was released.
    pub fn shrink_to(&self, pages: Pages) -> Shrink {
        let mut st = lock(&self.state);
        self.shrink_locked(&mut st, pages.get())
    }

    fn shrink_locked(&self, st: &mut ArenaState, pages: usize) -> Shrink {
        if st.growing {
            // A commit in flight will push at the current top; releasing
            // under it would put its chunk at the wrong index.
            return Shrink::default();
        }
        let floor = Self::highest_live_of(st).map_or(0, |i| i + 1);
        let new_cap = self.round_to_chunks_up(pages.max(floor));
        if new_cap >= st.pages.len() {
            return Shrink::default();
        }
        // Lower the cap first: free ids above it leave the free list.
        for i in new_cap..st.pages.len() {
            debug_assert!(matches!(st.pages[i], PageState::Free | PageState::Withheld));
            if st.pages[i] == PageState::Free {
                st.free.remove(&(i as u32));
                st.pages[i] = PageState::Withheld;
                st.n_withheld += 1;
            }
        }
        st.cap = new_cap;
        let mut out = Shrink::default();
        while st.pages.len() > new_cap {
            let Some(commits) = st.chunks.pop() else { break };
            out.bytes += commits.iter().map(|c| c.bytes()).sum::<Bytes>();
            out.chunks += 1;
            drop(commits);
            st.chunk_last_used.pop();
            let keep = st.chunks.len() * self.geometry.chunk_pages;
            st.pages.truncate(keep);
            st.n_withheld -= self.geometry.chunk_pages;
        }
        st.stats.chunks_released += out.chunks as u64;
        if out.chunks > 0 {
            st.last_release = Some(self.clock.now());
        }
        self.debug_check(st);
        out
    }

    /// Release free tail chunks worth at least `need` bytes (relief under
    /// pressure: ignores the hold time, never touches live pages). The target
    /// stays, so KV grows back later.
    pub fn release_idle(&self, need: Bytes) -> Shrink {
        self.release_idle_on(self.card(), need)
    }

    /// [`KvArena::release_idle`] for `need` bytes on `card` (one of the
    /// arena's cards; the chunks go from every card).
    pub fn release_idle_on(&self, card: CardId, need: Bytes) -> Shrink {
        let Some(part) = self.parts.iter().find(|p| p.device.id() == card) else {
            return Shrink::default();
        };
        let mut st = lock(&self.state);
        let chunks = need.get().div_ceil(part.geometry.chunk_bytes.get()).max(1) as usize;
        let pages = st.pages.len().saturating_sub(chunks * self.geometry.chunk_pages);
        self.shrink_locked(&mut st, pages)
    }

    /// On-demand residency: release tail chunks that hold nothing and have
    /// not handed out a page for the hold time, and lower the target with
    /// them so they are not grown back.
    pub fn trim_idle(&self) -> Shrink {
        let mut st = lock(&self.state);
        let now = self.clock.now();
        let floor = Self::highest_live_of(&st).map_or(0, |i| i + 1);
        let mut keep_chunks = st.chunks.len();
        while keep_chunks > 0 {
            let c = keep_chunks - 1;
            let idle = now.saturating_sub(st.chunk_last_used[c]) >= self.hold;
            if c * self.geometry.chunk_pages < floor || !idle {
                break;
            }
            keep_chunks -= 1;
        }
        let pages = keep_chunks * self.geometry.chunk_pages;
        let out = self.shrink_locked(&mut st, pages);
        st.target = st.target.min(st.pages.len());
        out
    }

    fn round_to_chunks(&self, pages: Pages) -> usize {
        (pages.get().min(self.max_pages) / self.geometry.chunk_pages) * self.geometry.chunk_pages
    }

    fn round_to_chunks_up(&self, pages: usize) -> usize {
        pages.div_ceil(self.geometry.chunk_pages) * self.geometry.chunk_pages
    }

    // ----- invariants ------------------------------------------------------

    /// Recount every page and compare with the running counters and the free
    /// list. Tests call it; debug builds run it after every operation.
    pub fn check_invariants(&self) -> Result<ArenaCounts, String> {
        let st = lock(&self.state);
        self.check_state(&st)
    }

    fn check_state(&self, st: &ArenaState) -> Result<ArenaCounts, String> {
        let (mut free, mut cached, mut in_use, mut withheld) = (0, 0, 0, 0);
        for (i, s) in st.pages.iter().enumerate() {
            match s {
                PageState::Free => {
                    free += 1;
                    if i >= st.cap || !st.free.contains(&(i as u32)) {
                        return Err(format!(
                            "page#{i} is free but off the free list or above the cap {}",
                            st.cap
                        ));
                    }
                }
                PageState::InUse(_) => in_use += 1,
                PageState::Cached => cached += 1,
                PageState::Withheld => withheld += 1,
            }
            if i >= st.cap && *s != PageState::Withheld {
                return Err(format!("page#{i} above the cap {} is {}", st.cap, s.name()));
            }
        }
        if st.cap > st.pages.len() {
            return Err(format!("cap {} above the watermark {}", st.cap, st.pages.len()));
        }
        if st.pages.len() != st.chunks.len() * self.geometry.chunk_pages {
            return Err(format!("{} pages for {} chunks", st.pages.len(), st.chunks.len()));
        }
        if free != st.free.len()
            || cached != st.n_cached
            || in_use != st.n_in_use
            || withheld != st.n_withheld
        {
            return Err(format!(
                "counters off: free {free}/{}, cached {cached}/{}, in use {in_use}/{}, withheld {withheld}/{}",
                st.free.len(),
                st.n_cached,
                st.n_in_use,
                st.n_withheld
            ));
        }
        self.check_counts(st)
    }

    /// The invariant on the running counters, in constant time.
    fn check_counts(&self, st: &ArenaState) -> Result<ArenaCounts, String> {
        let counts = self.counts_of(st);
        let sum = counts.free.get() + counts.cached.get() + counts.in_use.get() + counts.withheld.get();
        if sum != self.max_pages
            || st.cap > st.pages.len()
            || st.pages.len() != st.chunks.len() * self.geometry.chunk_pages
        {
            return Err(format!(
                "free + cached + in_use + withheld != capacity (or cap above watermark): {counts:?}, cap {}",
                st.cap
            ));
        }
        Ok(counts)
    }

    fn debug_check(&self, st: &ArenaState) {
        if cfg!(debug_assertions) {
            // The full recount is linear in backed pages; past this size the
            // constant-time counter check runs on every operation and the
            // recount stays with check_invariants().
            const RECOUNT_UP_TO: usize = 1 << 14;
            let checked =
                if st.pages.len() <= RECOUNT_UP_TO { self.check_state(st) } else { self.check_counts(st) };
            if let Err(e) = checked {
                panic!("KV arena invariant broken on {}: {e}", self.card());
            }
        }
    }
}

fn wrong(page: PageId, state: PageState, expected: &'static str) -> ArenaError {
    ArenaError::WrongState { page, state: state.name(), expected }
}

/// The arena is the first, cheapest relief: free chunks above the highest
/// live page hold nothing.
impl ReliefProvider for KvArena {
    fn name(&self) -> &str {
        "release idle KV chunks"
    }
    fn tier(&self) -> Tier {
        Tier::Local
    }
    fn cost(&self) -> u32 {
        0
    }
    fn relieve(&self, card: CardId, need: Bytes) -> Bytes {
        let Some(part) = self.parts.iter().find(|p| p.device.id() == card) else {
            return Bytes::ZERO;
        };
        // What this card got back: its own share of every released chunk.
        let released = self.release_idle_on(card, need);
        Bytes(released.chunks as u64 * part.geometry.chunk_bytes.get())
    }
}
